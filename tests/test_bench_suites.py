"""The GPU suite's rows are valid configs: the suite runs only where a GPU is
lent, rarely and under a deadline, so a row that a config change broke must
fail here, on CPU, not there."""

import collections
import json
import importlib.util
import os
import textwrap
import sys

import pytest

from mjax import config as config_lib
from mjax import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench_module(name):
  """A bench script as a module (bench/ is not a package)."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, 'bench', f'{name}.py'))
  mod = importlib.util.module_from_spec(spec)
  sys.modules[name] = mod      # dataclasses look their module up while the class is built
  spec.loader.exec_module(mod)
  return mod


SUITE = _bench_module('gpu_suite')


@pytest.mark.parametrize('row', SUITE.MFU_ROWS + SUITE.EXPERIMENT_ROWS + SUITE.SMOKE_MFU_ROWS, ids=lambda r: r[0])
def test_every_mfu_row_is_a_valid_one_gpu_config(row):
  name, gin, overrides, *_ = row
  bindings = [config_lib.override_to_binding(*o.split('=', 1)) for o in overrides]
  if row not in SUITE.SMOKE_MFU_ROWS:
    bindings.append(config_lib.override_to_binding('ModelConfig.attention_impl', 'cudnn'))
  cfg = flags.load([os.path.join(REPO, 'configs', gin)], bindings, num_devices=1)
  size = name.split()[0]
  assert gin.startswith(size), (name, gin)     # the table groups rows by their first word
  for o in overrides:
    section, rest = o.split('.', 1)
    field, value = rest.split('=', 1)
    got = getattr(getattr(cfg, {'ModelConfig': 'model', 'TrainConfig': 'train',
                                'MeshConfig': 'mesh', 'DataConfig': 'data'}[section]), field)
    assert str(got) == value.strip('\'"'), (o, got)   # a gin string binding is quoted


def test_hlo_traffic_sums_the_step_by_part_and_kind():
  # The tiny model's CPU step: every part of the step is found, the scanned
  # layers' loops have known trip counts, and the table adds up.
  import sys
  sys.path.insert(0, os.path.join(REPO, 'bench'))
  import hlo_traffic
  from mjax import train
  from mjax.parallel import make_mesh
  cfg = flags.load([os.path.join(REPO, 'configs', 'tiny.gin')],
                   [config_lib.override_to_binding('MeshConfig.data', '1')], num_devices=1)
  import jax
  program = train.make_program(cfg, make_mesh(cfg.mesh, devices=jax.devices()[:1]))
  with program.context():
    text = program.step.lower(program.abstract_state(), program.abstract_batch()).compile().as_text()
  by_part, by_kind, unknown = hlo_traffic.traffic(text)
  assert not unknown
  parts = {part for part, _ in by_part}
  for part in ('optimizer and metrics', "forward: layers' weight matrix products",
               "backward: layers' weight matrix products", 'forward: head and loss'):
    assert part in parts, parts
  assert by_kind['matrix products'] > 0 and by_kind['memory-bound passes'] > 0
  assert sum(by_part.values()) == pytest.approx(sum(by_kind.values()))
  # LAMB reads and writes every fp32 parameter and both moments at least
  # once: a lower bound the optimizer's passes must reach.
  n = sum(x.size for x in jax.tree.leaves(program.abstract_state().params))
  assert by_part[('optimizer and metrics', 'memory-bound passes')] >= 6 * 4 * n
  assert '| part of the step |' in hlo_traffic.table(text)


def test_a_fusion_without_an_op_name_has_its_fused_roots():
  """XLA (and jaxlib 0.11 for most fusions) leaves a fusion's metadata
  without op_name: its bytes were "no source" passes, 52.9 of 92.9 GB in a
  1p3b compile with jaxlib 0.11, most of them XLA attention's own passes."""
  import sys
  sys.path.insert(0, os.path.join(REPO, 'bench'))
  import hlo_traffic
  from mjax.parallel import hlo_text
  text = textwrap.dedent('''\
      HloModule m, is_scheduled=true

      %fused (p: f32[4,8,8]) -> f32[4,8,8] {
        %p = f32[4,8,8]{2,1,0} parameter(0)
        ROOT %t = f32[4,8,8]{2,1,0} transpose(%p), dimensions={0,2,1}, metadata={op_name="jit(step)/layers_0/attn/attn.attend/sub"}
      }

      ENTRY %main (x: f32[4,8,8]) -> f32[4,8,8] {
        %x = f32[4,8,8]{2,1,0} parameter(0)
        ROOT %f = f32[4,8,8]{2,1,0} fusion(%x), kind=kInput, calls=%fused, metadata={scheduling_name="f"}
      }
      ''')
  module = hlo_text.parse_module(text)
  f = module.instruction('f')
  assert hlo_text.op_name(f) == '' and hlo_text.op_name(f, module) == 'jit(step)/layers_0/attn/attn.attend/sub'
  _, by_kind, _ = hlo_traffic.traffic(text)
  assert by_kind['attention'] == 2 * 4 * 8 * 8 * 4 and not by_kind['memory-bound passes']


def test_hlo_traffic_counts_a_fused_slice_of_a_stacked_buffer_as_the_slice():
  # A scanned layer's fusion takes the whole (layers, ...) stack as its
  # operand and slices its layer inside: it reads one layer, not the stack.
  # An operand the fusion also reads whole counts whole.
  import sys
  sys.path.insert(0, os.path.join(REPO, 'bench'))
  import hlo_traffic
  from mjax.parallel import hlo_text
  text = """HloModule m

%fused (p0: f32[8,256,1024], p1: s32[], p2: f32[256,1024]) -> f32[256,1024] {
  %p0 = f32[8,256,1024]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,256,1024]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,256,1024}
  %b = f32[256,1024]{1,0} bitcast(%ds)
  %p2 = f32[256,1024]{1,0} parameter(2)
  ROOT %t = f32[256,1024]{1,0} multiply(%b, %p2)
}

%whole (q0: f32[8,256,1024], q1: f32[256,1024]) -> f32[256,1024] {
  %q0 = f32[8,256,1024]{2,1,0} parameter(0)
  %r = f32[256,1024]{1,0} slice(%q0), slice={[0:1], [0:256], [0:1024]}
  %c = f32[] constant(0)
  %s = f32[256,1024]{1,0} reduce(%q0, %c), dimensions={0}, to_apply=%add
  ROOT %u = f32[256,1024]{1,0} add(%s, %q1)
}

ENTRY %main (a: f32[8,256,1024], i: s32[], x: f32[256,1024]) -> f32[256,1024] {
  %a = f32[8,256,1024]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = f32[256,1024]{1,0} parameter(2)
  %f = f32[256,1024]{1,0} fusion(%a, %i, %x), kind=kLoop, calls=%fused
  ROOT %g = f32[256,1024]{1,0} fusion(%a, %f), kind=kLoop, calls=%whole
}
"""
  m = hlo_text.parse_module(text)
  layer = 256 * 1024 * 4
  # read: one layer of the stack, the index, x; write: one layer.
  assert hlo_traffic.kernel_bytes(m, m.instruction('f')) == layer + 4 + layer + layer
  assert hlo_traffic.kernel_bytes(m, m.instruction('g')) == 8 * layer + layer + layer


def test_trace_summary_finds_the_parts_of_a_step_run_as_cuda_graphs():
  """On the H100 the whole step ran as CUDA graphs: every kernel's 'hlo_op'
  named the graph, and the part-of-step table put 100% under 'no source'.
  XLA's own kernels are now found by their kernel name."""
  ts = _bench_module('trace_summary')
  src = 'jit(train_step)/transpose(jvp(Transformer))/layers_3/mlp/gelu/mul'
  sources = {'loop_add_multiply_fusion.23': src, 'command_buffer_1': ''}
  in_graph = {'hlo_op': 'command_buffer_1', 'hlo_module': 'jit_train_step'}
  fusion = ts.part_of_event({'name': 'loop_add_multiply_fusion_23', 'args': in_graph}, sources)
  assert fusion == ts.part_of(src) == "backward: layers' other ops (norms, activation, rotary, residual, layout)"
  gemm = ts.part_of_event({'name': 'nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT', 'args': in_graph}, sources)
  assert gemm == ts.IN_GRAPH
  # Outside a graph the kernel's own hlo_op still decides, as before.
  plain = ts.part_of_event({'name': 'nvjet_x', 'args': {'hlo_op': 'loop_add_multiply_fusion.23'}}, sources)
  assert plain == fusion
  assert ts.part_of_event({'name': 'memcpy', 'args': {}}, sources) == ts.part_of('')
  # A kernel of another program in the trace is not taken for the step's own.
  other = {'hlo_op': 'command_buffer_0', 'hlo_module': 'jit_eval_loss'}
  assert ts.part_of_event({'name': 'loop_add_multiply_fusion_23', 'args': other}, sources,
                          'jit_train_step') == ts.IN_GRAPH
  assert ts.part_of_event({'name': 'loop_add_multiply_fusion_23', 'args': in_graph}, sources,
                          'jit_train_step') == fusion
  # A weight gradient's Triton GEMM is named after autodiff's transpose, not
  # a dot_general: its kernel name says it is a matrix product.
  sources['gemm_fusion_dot.97'] = 'jit(train_step)/transpose(jvp(Transformer))/checkpoint/layers_23/block_0/attn/transpose'
  assert (ts.part_of_event({'name': 'gemm_fusion_dot_97', 'args': in_graph}, sources)
          == "backward: layers' weight matrix products")


@pytest.mark.parametrize('row', [r for r in SUITE.EXPERIMENT_ROWS if any('xla_extra_flags' in o for o in r[2])],
                         ids=lambda r: r[0])
def test_every_experiment_row_names_xla_flags_the_gpu_plugin_defines(row):
  # A flag XLA does not define is dropped at start-up (XLA would abort on
  # it), and the row would measure the baseline under another name. (Rows
  # that try a setting of mjax's own, a batch, name no flag.)
  from mjax.parallel import xla_flags
  wanted = SUITE.row_flags(row[2])
  assert wanted, row
  import sys
  search = [*sys.path, os.path.join(sys.prefix, 'cuda-aot')]   # where `make test` puts the CUDA plugin
  plugins = [p for p in xla_flags.xla_libraries(search) if os.sep + 'jaxlib' + os.sep not in p]
  if not plugins:
    pytest.skip('no CUDA plugin installed to read the flag table from')
  assert xla_flags.supported_flags(wanted, plugins) == set(wanted), wanted


def test_attention_time_by_window_runs_and_says_the_work_each_window_keeps():
  # The GPU suite's table, with its smoke shapes on this CPU (XLA's attention).
  import types
  lines = []
  suite = types.SimpleNamespace(args=types.SimpleNamespace(smoke=True), say=lambda line='': lines.append(line))
  rows = SUITE.attention_window_times(suite, None)
  assert [r['window'] for r in rows] == [None, 64, 32, 16]
  assert rows[0]['work'] == 1.0 and all(a['work'] > b['work'] for a, b in zip(rows, rows[1:]))
  assert all(r['ms'] > 0 and r['tflops'] > 0 for r in rows)
  assert any(line.startswith('| causal |') for line in lines), lines


@pytest.mark.slow
def test_the_kernels_section_checks_both_kernels_against_fp32():
  # On CPU the kernels run in Pallas's GPU interpreter at small shapes: the
  # section a GPU run starts with, and its tables, before any GPU sees it.
  import types
  lines = []
  suite = types.SimpleNamespace(args=types.SimpleNamespace(smoke=True, experiments=True),
                                say=lambda line='': lines.append(line), results={})
  ok, detail = SUITE.check_kernels(suite)
  assert ok, detail
  kernel, xla = suite.results['kernels']['gelu']
  assert kernel['du'] < 1e-3 and xla['du'] < 1e-2   # fp32 inside, rounded once; autodiff's bf16 arithmetic
  kernel, xla = suite.results['kernels']['rotary']
  assert kernel['q_k'] < 4e-3 and xla['q_k'] < 1e-2   # fp32 inside, fp16 tables, rounded once
  for name in ('gelu_backward_kernel', 'rotary_kernel'):
    assert any(line.startswith(f'| Pallas kernel ({name}) |') for line in lines), lines
  # --experiments: each kernel again at other tilings, beside XLA's product
  # alone (on CPU two tilings each, in the interpreter), values checked.
  for key in ('gelu_tilings', 'rotary_tilings'):
    rows = suite.results['kernels'][key]
    assert [r['name'] for r in rows][1:] == [n for n, _ in SUITE.SMOKE_TILINGS] + ['XLA: the product alone'], rows
    assert all(r['error'] < 4e-3 for r in rows[:-1]) and not any('failed' in r for r in rows), rows
  assert sum(line.startswith('| tiling |') for line in lines) == 2, lines


def test_dot_budget_finds_every_product_with_its_runs_per_step_and_times_it():
  # A scanned layer's product runs once per layer, the head's once; batched
  # and transposed products keep their dimension numbers, so each is timed
  # as the program runs it, and the FLOPs add up to the function's.
  import jax
  import jax.numpy as jnp
  budget = _bench_module('dot_budget')
  layers, t, d, v = 3, 64, 32, 48

  def f(x, w, head, q):
    x, _ = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)
    scores = jnp.einsum('bqd,bkd->bqk', q, q)              # batched, contracting the last dims
    return jnp.sum(x @ head) + jnp.sum(jnp.tanh(scores))

  args = (jnp.ones((t, d)), jnp.ones((layers, d, d)), jnp.ones((d, v)), jnp.ones((2, 16, 8)))
  text = jax.jit(jax.grad(f, argnums=(1, 2, 3))).lower(*args).compile().as_text()
  rows, unknown = budget.products(text)
  assert not unknown
  runs = collections.Counter()
  for (p, _), n in rows.items():
    runs[(p.lhs.dims, p.rhs.dims, p.contracting)] += n
  # The layer: forward h @ w, and the data and weight gradients, each once per layer.
  assert runs[((t, d), (d, d), ((1,), (0,)))] == layers
  assert runs[((t, d), (d, d), ((1,), (1,)))] == layers
  assert runs[((t, d), (t, d), ((0,), (0,)))] == layers
  # The head's gradients (its forward product is dead code: the sum's gradient is ones).
  assert runs[((t, d), (t, v), ((0,), (0,)))] == 1 and runs[((t, v), (d, v), ((1,), (1,)))] == 1
  batched = [p for (p, _), _ in rows.items() if p.batch[0] and p.out_dims == (2, 16, 16)]
  assert len(batched) == 1 and batched[0].flops == 2 * 2 * 16 * 16 * 8
  assert sum(n * p.flops for (p, _), n in rows.items()) == (
      3 * layers * 2 * t * d * d + 2 * 2 * t * d * v + 3 * 2 * 2 * 16 * 16 * 8)
  seconds = {p: budget.time_product(p, min_seconds=0.01) for p in {p for p, _ in rows}}
  assert all(s > 0 for s in seconds.values())
  table = budget.budget(rows, seconds, step_s=1.0, model_flops=1e6, peak=1e9)
  assert '| **all matrix products** |' in table and 'MFU ceiling' in table


def test_dot_budget_reads_a_cublas_call_as_its_product():
  budget = _bench_module('dot_budget')
  text = """HloModule m

ENTRY %main (a: bf16[512,256], b: bf16[4096,256]) -> bf16[512,4096] {
  %a = bf16[512,256]{1,0} parameter(0)
  %b = bf16[4096,256]{1,0} parameter(1)
  %g = (bf16[512,4096]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", metadata={op_name="jit(train_step)/jvp(Transformer)/Transformer._head/dot_general"}, backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}
  ROOT %r = bf16[512,4096]{1,0} get-tuple-element(%g), index=0
}
"""
  rows, _ = budget.products(text)
  ((p, part), n), = rows.items()
  assert n == 1 and part == 'forward: head and loss'
  assert p.out_dtype == 'bf16' and p.out_dims == (512, 4096) and p.contracting == ((1,), (1,))
  assert p.flops == 2 * 512 * 4096 * 256


def test_recovery_breakdown_splits_the_link_check_from_the_back_off(tmp_path):
  """The recovery bench's parts of one recovery, from a driver's events (the
  times of a measured run): the link check after the diagnosis is its own
  part, and back-off is only the driver's wait before the relaunch."""
  bench = _bench_module('recovery_bench')
  startup = {'launch_to_first_step_s': 5.5, 'run_to_first_step_s': 4.5, 'state_s': 1.4, 'compile_s': 1.1,
             'compile_wait_s': 0.1, 'first_step_s': 0.8, 'distributed_init_s': 0.1}
  events = [(0.0, 'launch', {'attempt': 0}), (59.6, 'fault', {'reached_step': 180}),
            (59.7, 'stopped', {}), (61.5, 'diagnosis', {}), (61.6, 'diagnosis', {}),
            (64.1, 'link_check', {}), (64.1, 'restart', {'checkpoint_step': 175, 'backoff_s': 1.0}),
            (65.1, 'launch', {'attempt': 1}), (72.1, 'startup', {'attempt': 1, **startup}),
            (72.6, 'caught_up', {'attempt': 1})]
  with open(tmp_path / 'events.jsonl', 'w') as fh:
    for t, kind, fields in events:
      fh.write(json.dumps({'time': 1000.0 + t, 'event': kind, **fields}) + '\n')
  (part,) = bench.breakdown(str(tmp_path), [{'time': 1059.5}])
  assert part['diagnosis'] == pytest.approx(1.9)
  assert part['link_check'] == pytest.approx(2.5)
  assert part['backoff'] == pytest.approx(1.0)
  assert part['compile_wait'] == pytest.approx(0.1)
  assert part['catch_up'] == pytest.approx(72.6 - (65.1 + 5.5))
  assert part['total'] == pytest.approx(72.6 - 59.5)
  assert part['steps_redone'] == 5
  assert set(bench.PARTS) - {'total'} <= set(part)


def test_recovery_effective_time_counts_a_save_once(tmp_path, monkeypatch):
  """The bench's useful time is the steps' own time, which leaves out each
  save's blocking part already: a run whose saves block longer than its
  steps take keeps a positive useful time, its step times' sum."""
  import time
  from mjax import trainer
  bench = _bench_module('recovery_bench')
  save = trainer.Trainer._save

  def slow_save(self, step, meta, force=False):
    if self.ckpt is not None and (force or self.ckpt.due(step)):
      time.sleep(0.5)
    save(self, step, meta, force)
  monkeypatch.setattr(trainer.Trainer, '_save', slow_save)
  cfg = config_lib.load_config(['tiny.gin'], [
      'ModelConfig.d_model = 128', 'ModelConfig.n_layers = 2', 'ModelConfig.d_ff = 256',
      'ModelConfig.sliding_window = 16', 'DataConfig.seq_len = 64', 'TrainConfig.global_batch_size = 16',
      'TrainConfig.progress = False', 'TrainConfig.steps = 6', 'TrainConfig.eval_every = 0',
      'CheckpointConfig.save_every = 2', 'FaultConfig.timing_every = 1'], num_devices=8)
  t0 = time.time()
  trainer.Trainer(cfg, str(tmp_path)).train()
  with open(tmp_path / 'events.jsonl', 'w') as fh:   # the driver's launch and finish
    for t, kind in ((t0, 'launch'), (time.time(), 'finish')):
      fh.write(json.dumps({'time': t, 'event': kind}) + '\n')
  got = bench.effective(str(tmp_path), 6)
  assert got['saves_blocked_s'] >= 1.5
  assert got['useful_s'] == pytest.approx(sum(bench.step_times(str(tmp_path)).values()))
  assert 0 < got['useful_s'] < got['wall_s'] - got['saves_blocked_s']


def test_mfu_rows_are_chosen_by_substring_or_exactly():
  rows = SUITE.MFU_ROWS + SUITE.EXPERIMENT_ROWS
  names = lambda spec: [r[0] for r in SUITE.select_rows(rows, spec)]
  assert names('=1p3b remat=dots,dynamic-slice') == ['1p3b remat=dots', '1p3b remat=dots, dynamic-slice fusion']
  assert len(names('1p3b remat=dots')) > 2 and names('') == [r[0] for r in rows]
  assert names('=1p3b remat') == []
  # A name with ', ' in it is one selection: '=' picks that row alone.
  assert names('=1p3b dots_attention unrolled, GeLU epilogue off,=1p3b remat=none unrolled') == [
      '1p3b dots_attention unrolled, GeLU epilogue off', '1p3b remat=none unrolled']


COMM = _bench_module('comm_minimum')


@pytest.mark.parametrize('layout', list(COMM.LAYOUTS))
@pytest.mark.parametrize('variant', list(COMM.VARIANTS))
def test_every_comm_minimum_layout_and_variant_is_a_valid_8_device_config(layout, variant):
  # The sweep prints a refusal as a row; every combination it ships must
  # compile instead, so a config change that breaks one fails here.
  cfg = flags.load([os.path.join(REPO, 'configs', '1p3b.gin')], COMM.bindings(layout, variant), num_devices=8)
  assert cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor * cfg.mesh.pipeline == 8


def test_the_mfu_table_prints_both_attention_counts(tmp_path):
  # The smoke row through the suite's MFU section, train_bench in this
  # process: the table has mjax's MFU and, for comparison with published
  # figures, Megatron-LM's count of every key of the context, larger for
  # tiny's windowed layers by exactly the ratio of the two FLOP counts.
  import types
  from mjax.model.flops import flops_per_token
  bench = _bench_module('train_bench')
  lines = []

  def run(argv, log, timeout, env, tree=SUITE.REPO):
    bench.main(argv[2:])
    return 0, ''

  args = types.SimpleNamespace(smoke=True, experiments=False, mfu_rows='=tiny remat=none', steps=1,
                               profile=False, row_timeout_s=600)
  suite = types.SimpleNamespace(args=args, say=lambda line='': lines.append(line), left=lambda: 600.0,
                                run=run, out=str(tmp_path), results={})
  ok, summary = SUITE.check_mfu(suite)
  assert ok, (summary, lines)
  header = next(line for line in lines if line.startswith('| config |'))
  assert header.endswith('| MFU, attention counted dense |'), header
  (r,) = suite.results['mfu']
  cfg = flags.load([os.path.join(REPO, 'configs', 'tiny.gin')], [], num_devices=1).model
  ratio = flops_per_token(cfg, 128, dense_attention=True) / flops_per_token(cfg, 128)
  assert ratio > 1.01 and r['mfu_dense_attention'] == pytest.approx(r['mfu'] * ratio)
  assert any(line.startswith('| tiny remat=none |') and line.endswith(f'| {r["mfu_dense_attention"]:.1%} |')
             for line in lines), lines


def test_a_baseline_tree_runs_every_mfu_row_right_after_this_ones(tmp_path):
  # `--baseline DIR` (`make baseline REF=...`): the code before a change,
  # timed on the same card right after each row of this tree, its own
  # bench/train_bench.py run in its own tree; its rows decide nothing.
  import types
  base = tmp_path / 'base'
  (base / 'bench').mkdir(parents=True)
  (base / 'bench' / 'train_bench.py').write_text('')
  calls = []

  def run(argv, log, timeout, env, tree=SUITE.REPO):
    calls.append((argv[1], tree, log))
    out = argv[argv.index('--json') + 1]
    mfu = 0.3 if tree == SUITE.REPO else 0.4
    with open(out, 'w') as fh:
      json.dump(dict(batch=8, seq_len=128, devices='1 x cpu', tokens_per_sec=1.0, step_time=1.0,
                     flops_per_token=1.0, achieved=1.0, peak=1.0, peak_source='x', mfu=mfu, mem=0), fh)
    return 0, ''

  lines = []
  args = types.SimpleNamespace(smoke=True, experiments=False, mfu_rows='tiny', steps=1, profile=False,
                               row_timeout_s=600, baseline=str(base))
  suite = types.SimpleNamespace(args=args, say=lambda line='': lines.append(line), left=lambda: 600.0,
                                run=run, out=str(tmp_path), results={})
  ok, summary = SUITE.check_mfu(suite)
  mine = os.path.join(SUITE.REPO, 'bench', 'train_bench.py')
  theirs = os.path.join(str(base), 'bench', 'train_bench.py')
  assert calls == [(mine, SUITE.REPO, 'mfu_0.log'), (theirs, str(base), 'mfu_0_baseline.log'),
                   (mine, SUITE.REPO, 'mfu_1.log'), (theirs, str(base), 'mfu_1_baseline.log')], calls
  assert [r['name'] for r in suite.results['mfu']] == [
      'tiny remat=none', 'tiny remat=none [baseline]', 'tiny remat=full', 'tiny remat=full [baseline]']
  assert any(line.startswith('| tiny remat=full [baseline] |') for line in lines), lines
  # The best row is this tree's, though the baseline's ran faster.
  assert ok and suite.results['mfu_best'] == {'tiny': {'name': 'tiny remat=none', 'mfu': 0.3}}, summary
  # A folder that is no source tree is refused before anything runs.
  with pytest.raises(SystemExit):
    SUITE.main(['--smoke', '--sections', 'mfu', '--baseline', str(tmp_path / 'nothing')])


@pytest.mark.parametrize('script,argv,named', [
    ('train_bench', ['--steps', '0'], 'argument --steps: 0 is not allowed'),
    ('train_bench', ['--warmup', '-1'], 'argument --warmup: -1 is not allowed'),
    ('trace_summary', ['.', '--steps', '0'], 'argument --steps: 0 is not allowed'),
    ('trace_summary', ['.', '--top', '-1'], 'argument --top: -1 is not allowed'),
    ('data_bench', ['--seconds', '0'], 'argument --seconds: 0 is not allowed'),
    ('data_bench', ['--tiny_tokens_per_sec', '0'], 'argument --tiny_tokens_per_sec: 0 is not allowed'),
    ('data_bench', ['--mfu', '45'], 'argument --mfu: 45 is not allowed'),
    ('hlo_traffic', ['--bandwidth', '0'], 'argument --bandwidth: 0 is not allowed'),
    ('checkpoint_bench', ['--repeats', '0'], 'argument --repeats: 0 is not allowed'),
    ('generate_bench', ['--batch', '0'], 'argument --batch: 0 is not allowed'),
    ('generate_bench', ['--prompt_len', '1'], 'argument --prompt_len: 1 is not allowed: must be at least 2'),
    ('generate_bench', ['--new_tokens', '1'], 'argument --new_tokens: 1 is not allowed: must be at least 2'),
    ('layouts_bench', ['--steps', '0'], 'argument --steps: 0 is not allowed'),
    ('layouts_bench', ['--warmup', '-1'], 'argument --warmup: -1 is not allowed'),
    ('hlo_traffic', ['--hlo', '/nonexistent/step.hlo'], "--hlo '/nonexistent/step.hlo': no such file"),
])
def test_a_bench_refuses_a_count_or_amount_that_is_not_positive(script, argv, named, capsys):
  # --steps 0 divided by zero after a compile; --seconds 0 printed 0 tokens/s
  # and a 0x ratio; --steps -2 printed negative times; a 0 rate was read as
  # 'not given'. Each is a usage error that names the flag and the value.
  with pytest.raises(SystemExit) as e:
    _bench_module(script).main(argv)
  assert e.value.code == 2
  assert named in capsys.readouterr().err


def test_startup_bench_names_a_malformed_process_count(monkeypatch, capsys):
  bench = _bench_module('startup_bench')
  for spec, named in (('1,x', "'x' is not a whole number"), ('0', '0 is not allowed'), ('2,,4', "'' is not")):
    monkeypatch.setattr(sys, 'argv', ['startup_bench.py', '--processes', spec])
    with pytest.raises(SystemExit) as e:
      bench.main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f'--processes {spec!r}' in err and named in err, err


def test_trace_summary_says_a_file_that_is_not_a_trace(tmp_path):
  hlo = tmp_path / 'train_step.hlo.txt'
  hlo.write_text('HloModule jit_train_step\n')
  with pytest.raises(SystemExit) as e:
    _bench_module('trace_summary').main([str(hlo)])
  assert 'is not a trace' in str(e.value.code) and str(hlo) in str(e.value.code)


def test_train_bench_says_a_missing_gin_file_in_one_paragraph():
  import subprocess
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
  p = subprocess.run([sys.executable, os.path.join(REPO, 'bench', 'train_bench.py'), '--gin_file', 'nope.gin'],
                     capture_output=True, text=True, env=env, timeout=300)
  assert p.returncode == 2, p.stderr
  assert "--gin_file 'nope.gin': no such file" in p.stderr and 'Traceback' not in p.stderr, p.stderr


@pytest.mark.parametrize('argv,named', [
    (['--mfu_rows', '=nosuchrow'], "'=nosuchrow' selects no MFU row"),
    (['--mfu_rows', '1p3b,'], 'an empty selection'),
    (['--sections', 'mfu,bogus'], "unknown section 'bogus'"),
    (['--steps', '0'], 'argument --steps: 0 is not allowed'),
    (['--budget_s', '-5'], 'argument --budget_s: -5 is not allowed'),
])
def test_the_gpu_suite_refuses_bad_arguments_before_any_section_runs(argv, named, tmp_path, capsys):
  # A misspelt row ran every other section first and then printed an empty
  # MFU table; --steps 0 reached train_bench's division. On a GPU lent for
  # minutes, each is now a usage error before anything starts.
  with pytest.raises(SystemExit) as e:
    SUITE.main([*argv, '--out', str(tmp_path)])
  assert e.value.code == 2
  assert named in capsys.readouterr().err
  assert not os.listdir(tmp_path)
