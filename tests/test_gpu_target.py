"""The train step compiled for 8 H100s on this CPU-only machine (a deviceless
GPU compile, mjax.parallel.gpu_target): what the GPU schedule does with each
layout's collectives, which a CPU compile cannot show (its collectives are
all synchronous).

The CUDA compiler comes from the jax-cuda12 plugin that `make test` installs
into .venv/cuda-aot (outside site-packages, so no other test starts it); the
compiles run in child processes with it on PYTHONPATH.
"""

import concurrent.futures
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = Path(sys.prefix) / 'cuda-aot'

if not (PLUGIN / 'jax_plugins').is_dir():
  if os.environ.get('CI'):
    raise RuntimeError(f'{PLUGIN} is missing: `make test` installs the CUDA plugin there')
  pytest.skip(f'no CUDA plugin in {PLUGIN} (make test installs it)', allow_module_level=True)

# Each test reads programs that module fixtures compile, ~20 deviceless GPU
# compiles in all (~7 minutes of one core): the whole module is slow.
pytestmark = pytest.mark.slow

TINY = ['ModelConfig.dtype = "bfloat16"', 'ModelConfig.n_layers = 8']

# Compiles in a child and prints the schedule and per-kind traffic as JSON.
SCRIPT = textwrap.dedent('''
    import dataclasses, json, sys
    from mjax import flags
    from mjax.parallel import gpu_target
    gpu_target.keep_local_backend_cpu()
    from mjax.parallel.comm_report import collective_stats, expected_traffic, schedule
    args = json.loads(sys.argv[1])
    target = gpu_target.parse_target('h100:8')
    cfg = flags.load(['configs/tiny.gin'], args['bindings'], num_devices=target.devices)
    out = gpu_target.compile_step(cfg, target, options=None if args['overlap'] else {})
    text = out.compiled.as_text()
    stats = collective_stats(text)
    print(json.dumps({
        'schedule': [dataclasses.asdict(s) for s in schedule(text, dict(out.mesh.shape))],
        'ops': {k: sum(o.executions for o in stats.of_kind(k))
                for k in ('all-reduce', 'all-gather', 'reduce-scatter', 'collective-permute', 'all-to-all')},
        'options': {k: str(v) for k, v in out.options.items()},
        'all_reduced': [o.op_name for o in stats.of_kind('all-reduce')],
        'all_reduced_arrays': [[str(x.dtype), list(x.dims)] for o in stats.of_kind('all-reduce') for x in o.arrays],
        'all_reduce_runs': [o.executions for o in stats.of_kind('all-reduce')],
        'gathered_bytes': {o.name: sum(x.bytes for x in o.arrays) for o in stats.of_kind('all-gather')},
        'wire': {k: stats.per_step(k)['wire'] for k in ('all-reduce', 'all-gather', 'reduce-scatter')},
        'minimum': {k: sum(e.wire_bytes for e in expected_traffic(out.cfg, dict(out.mesh.shape)) if e.kind == k)
                    for k in ('all-reduce', 'all-gather', 'reduce-scatter')},
    }))
''')


def run_child(script: str, args: dict) -> dict:
  """`script` in a child with the CUDA plugin on its path; the JSON of its last line."""
  env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(PLUGIN), str(ROOT)]), 'JAX_PLATFORMS': 'cpu'}
  proc = subprocess.run([sys.executable, '-c', script, json.dumps(args)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def gpu_compile(*bindings: str, overlap: bool = True) -> dict:
  return run_child(SCRIPT, {'bindings': TINY + list(bindings), 'overlap': overlap})


def of(result: dict, kind: str, axes: str) -> list[dict]:
  return [s for s in result['schedule'] if s['kind'] == kind and s['axes'] == axes]


# The programs this module reads, compiled up front two at a time (and the
# report command's): one deviceless compile keeps ~1.45 of the two CI cores
# busy for ~15 s.
PROGRAMS = {
    'fsdp': (('MeshConfig.data = 1', 'MeshConfig.fsdp = 8'), True),
    'fsdp without the overlap options': (('MeshConfig.data = 1', 'MeshConfig.fsdp = 8'), False),
    # Unrolled layers, as 1p3b.gin runs them on GPUs. (With scanned layers
    # the layers' gradients are still all-reduced once per slice.)
    'data, 2 accumulation slices': (('MeshConfig.data = 8', 'TrainConfig.global_batch_size = 16',
                                     'TrainConfig.grad_accum_steps = 2', 'ModelConfig.scan_layers = False'), True),
    '1f1b': (('MeshConfig.data = 2', 'MeshConfig.pipeline = 4', 'MeshConfig.microbatches = 4',
              'MeshConfig.pipeline_schedule = "1f1b"'), True),
    'tensor + sequence': (('MeshConfig.data = 2', 'MeshConfig.tensor = 4', 'MeshConfig.sequence_parallel = True'),
                          True),
    'collective matmul': (('MeshConfig.data = 2', 'MeshConfig.tensor = 4', 'MeshConfig.sequence_parallel = True',
                           'MeshConfig.collective_matmul = True'), True),
    # Unrolled layers (1p3b.gin's GPU default): the rings' device index once
    # lowered to a partition-id that the GPU compiler's partitioner refused.
    'collective matmul, unrolled': (('MeshConfig.data = 2', 'MeshConfig.tensor = 4',
                                     'MeshConfig.sequence_parallel = True', 'MeshConfig.collective_matmul = True',
                                     'ModelConfig.scan_layers = False'), True),
    'fsdp gathered once, 2 slices': (('MeshConfig.data = 2', 'MeshConfig.fsdp = 2', 'MeshConfig.tensor = 2',
                                      'TrainConfig.global_batch_size = 16', 'TrainConfig.grad_accum_steps = 2',
                                      'MeshConfig.fsdp_gather = "step"'), True),
}


@pytest.fixture(scope='module')
def compiled():
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    futures = {name: pool.submit(gpu_compile, *bindings, overlap=overlap)
               for name, (bindings, overlap) in PROGRAMS.items()}
    futures['report'] = pool.submit(run_report, '--target', 'h100:8', '--gin.MeshConfig.fsdp=8',
                                    '--gin.MeshConfig.data=1')
    yield lambda name: futures[name].result()
    for f in futures.values():
      f.cancel()


@pytest.fixture(scope='module')
def fsdp(compiled):
  return compiled('fsdp')


def test_fsdp_gathers_run_behind_matmuls_and_gradients_are_reduce_scattered(fsdp):
  gathers, scatters = of(fsdp, 'all-gather', 'fsdp'), of(fsdp, 'reduce-scatter', 'fsdp')
  assert gathers and scatters, fsdp['schedule']
  # Every collective runs behind compute on the GPU but the step's last
  # all-reduce (the norms), which has nothing left to hide behind (jaxlib
  # 0.10 leaves that pair asynchronous and exposed, 0.11 runs it
  # synchronously: the same wait). The weight gathers all have compute
  # between start and done, and most of them a matrix product: the next
  # layer's weights arrive while this layer multiplies (prefetch).
  not_hidden = [s for s in fsdp['schedule'] if s['mode'] != 'overlapped']
  assert [s['kind'] for s in not_hidden] in ([], ['all-reduce']), not_hidden
  assert all(s['mode'] == 'overlapped' for s in gathers), gathers
  assert sum(s['matmuls_between'] > 0 for s in gathers) >= len(gathers) / 2, gathers
  # Gradients leave as reduce-scatters (each device keeps its shard), never
  # as a full all-reduce followed by slicing, and they too hide behind compute.
  # (The few all-reduces left are the 1-D vectors and the step's norms; the
  # last of them has nothing left to hide behind.)
  assert all(s['mode'] == 'overlapped' for s in scatters), scatters
  assert fsdp['options']['xla_gpu_enable_latency_hiding_scheduler'] == 'True'


def test_the_tied_embeddings_gradients_are_reduce_scattered(fsdp):
  # The head's, a matrix product over the batch, and the lookup's, a
  # scatter-add written out as a reduce-scatter (mjax/parallel/scatter_sum.py):
  # each device's partial table lands summed on the table's shards. Either
  # was an all-reduce of the whole table (twice the bytes) before. What is
  # left all-reduced is the 1-D vectors and the step's norms.
  assert not any('_head' in name or 'scatter' in name for name in fsdp['all_reduced']), fsdp['all_reduced']
  assert fsdp['wire']['all-reduce'] < 0.01 * fsdp['wire']['reduce-scatter'], fsdp['wire']


def test_data_parallel_all_reduces_the_tied_table_once_in_bf16_once_a_step(compiled):
  # Without FSDP the lookup's and the head's partial tables are summed on
  # each device and all-reduced once (mjax/parallel/scatter_sum.py), in
  # bf16 like the layers' gradients. GSPMD all-reduced the lookup's in fp32
  # and the head's in bf16: the table crossed twice, once at fp32.
  data = compiled('data, 2 accumulation slices')
  # (The compiler combines every gradient into one flat buffer here: the
  # table's single bf16 reduction shows as the total at the minimum below.)
  # (A combined all-reduce's name lists its parts with ':' between; the final
  # norm's scale and bias live under '_head' too, and are 1-D vectors.)
  parts = [p for name in data['all_reduced'] for p in name.split(':')]
  assert not any(('_head' in p and 'final_norm' not in p) or 'scatter-add' in p for p in parts), parts
  assert {d for d, dims in data['all_reduced_arrays'] if math.prod(dims) > 10_000} == {'bf16'}, \
      data['all_reduced_arrays']
  # Summed over the accumulation slices first, all-reduced once a step (the
  # GPU compiler moves the all-reduces out of the slices' loop): at the
  # report's minimum, which counts them once.
  ratio = data['wire']['all-reduce'] / data['minimum']['all-reduce']
  assert 0.99 < ratio < 1.01, (ratio, data['all_reduced_arrays'])


def test_overlap_options_pipeline_the_fsdp_collectives(fsdp, compiled):
  plain = compiled('fsdp without the overlap options')
  assert plain['options'] == {}
  # Same traffic either way; with the options every weight gather and
  # gradient reduce-scatter is hidden, without them some are not.
  assert plain['ops']['all-gather'] == fsdp['ops']['all-gather']
  behind = lambda r: sum(s['matmuls_between'] > 0 for k in ('all-gather', 'reduce-scatter')
                         for s in of(r, k, 'fsdp'))
  assert behind(fsdp) > behind(plain), (behind(fsdp), behind(plain))


def test_fsdp_gathered_once_a_step_on_the_gpu(compiled):
  # MeshConfig.fsdp_gather = 'step' with tensor parallelism and two slices:
  # each weight gathered over fsdp alone, once, kept split over tensor, and
  # each gradient reduce-scattered once. A gather written inside the region
  # manual over the batch axes had made JAX gather the weights over tensor
  # first: 5x the minimum's gathers.
  r = compiled('fsdp gathered once, 2 slices')
  for kind in ('all-gather', 'reduce-scatter'):
    assert 0.99 < r['wire'][kind] / r['minimum'][kind] < 1.01, (kind, r['wire'], r['minimum'])
  # Over tensor only the loss's row statistics, when the vocabulary is split
  # there: each shard's (max, sum of exp, target logit) per row
  # (`loss.logsumexp_and_target`), a few KiB against the weights' MiB.
  over_tensor = [s['name'] for s in of(r, 'all-gather', 'tensor')]
  assert sum(r['gathered_bytes'][n] for n in over_tensor) < 0.01 * r['minimum']['all-gather'], \
      (over_tensor, r['gathered_bytes'], r['minimum'])


def test_1f1b_stage_shifts_are_asynchronous(compiled):
  r = compiled('1f1b')
  shifts = of(r, 'collective-permute', 'pipeline')
  assert shifts and all(s['mode'] == 'overlapped' for s in shifts), shifts
  # A stage's output travels to the next stage while this stage runs its
  # backward (matmuls inside a conditional); the cotangent, sent last in the
  # tick, only has the tick's bookkeeping to hide behind.
  assert sum(s['matmuls_between'] > 0 for s in shifts) >= len(shifts) / 2, shifts
  # The data-parallel gradients are summed once, not every tick.
  grads = of(r, 'all-reduce', 'data')
  assert len(grads) == 1 and r['ops']['all-reduce'] <= 6, (grads, r['ops'])


def test_tensor_sequence_parallel_collectives_overlap_compute(compiled):
  r = compiled('tensor + sequence')
  tensor = [s for s in r['schedule'] if s['axes'] == 'tensor']
  assert {s['kind'] for s in tensor} >= {'all-gather', 'reduce-scatter'}, tensor
  assert all(s['mode'] != 'synchronous' for s in tensor)
  assert sum(s['matmuls_between'] > 0 for s in tensor) >= 1, tensor


@pytest.mark.parametrize('program', ['collective matmul', 'collective matmul, unrolled'])
def test_collective_matmul_rings_run_behind_the_projections(compiled, program):
  r = compiled(program)
  rings = of(r, 'collective-permute', 'tensor')
  assert rings and all(s['mode'] == 'overlapped' for s in rings), rings
  assert sum(s['matmuls_between'] > 0 for s in rings) >= 0.75 * len(rings), rings
  # The blocks' activations move only around the rings: what all-gathers
  # over `tensor` remain are the embedding's and the head's, a few.
  assert not of(r, 'all-to-all', 'tensor') and len(of(r, 'all-gather', 'tensor')) <= 6, r['ops']


def run_report(*args: str, plugin: bool = True) -> subprocess.CompletedProcess:
  env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(PLUGIN)] * plugin + [str(ROOT)])}
  return subprocess.run([str(Path(sys.executable).parent / 'mjax-report'), 'comm', '--gin_file',
                         'configs/tiny.gin', *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)


def test_report_command_for_a_gpu_target(compiled):
  proc = compiled('report')   # mjax-report comm --target h100:8, fsdp 8
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'compiled for 8 x H100' in proc.stdout and 'deviceless' in proc.stdout
  assert 'behind matmul' in proc.stdout and 'xla_gpu_enable_latency_hiding_scheduler' in proc.stdout
  assert 'no asynchronous collectives' not in proc.stdout


@pytest.mark.parametrize('target, plugin, says', [
    ('a100:8', True, 'expected CARD:DEVICES'),
    ('h100:12', True, 'do not fill hosts of 8'),
    ('h100:8', False, 'pip install "jax-cuda12-plugin=='),
])
def test_report_target_errors(target, plugin, says):
  proc = run_report('--target', target, plugin=plugin)
  assert proc.returncode == 2, (proc.stdout, proc.stderr[-2000:])
  assert says in proc.stderr and 'Traceback' not in proc.stderr


# One H100, two unrolled layers: what the GPU compiler does with the MLP and
# the weights' casts. XLA's dot merger would join tiny's small MLP input
# product with q, k and v (1p3b's are too large for it): off here.
ONE_GPU = ['ModelConfig.n_layers = 2', 'ModelConfig.scan_layers = False', 'MeshConfig.data = 1',
           'TrainConfig.xla_extra_flags = "--xla_gpu_dot_merger_threshold_mb=0"']
ONE_GPU_SCRIPT = textwrap.dedent('''
    import json, re, sys
    from mjax import flags
    from mjax.parallel import gpu_target
    gpu_target.keep_local_backend_cpu()
    args = json.loads(sys.argv[1])
    if args['unsaved_casts']:   # dots_attention as it was before the cast kernels were named
      import jax
      from mjax.model import transformer as T
      T.REMAT_POLICIES['dots_attention'] = jax.checkpoint_policies.save_from_both_policies(
          T._dots_and_flash_attention, jax.checkpoint_policies.save_only_these_names(
              *(n for n in T.KEPT_NAMES if n != T.CAST_KERNEL)))
    if args['sums_as_kernels']:   # the slices' gradient sums in the kernels' own shapes, as before
      import jax
      from mjax import train
      train._gemm_forms = lambda names: jax.tree.map(lambda _: None, names, is_leaf=lambda n: isinstance(n, tuple))
    if args['two_pass_loss']:   # the loss's log-sum-exp as the CPU computes it, as before
      from mjax.model import loss
      loss.logsumexp_and_target = loss._two_passes
    if args['autodiff_sums']:   # the readers' gradients summed in autodiff's order, as before fan_out
      from mjax.model import layers, transformer
      layers.fan_out = transformer.fan_out = lambda x, n: (x,) * n
    cfg = flags.load(['configs/tiny.gin'], args['bindings'], num_devices=1)
    out = gpu_target.compile_step(cfg, gpu_target.parse_target('h100:1'))
    text, m = out.compiled.as_text(), out.cfg.model
    hd = m.d_model // m.n_heads
    kernels = {f'{m.d_model},{m.n_heads},{hd}', f'{m.n_heads},{hd},{m.d_model}', f'{m.d_model},{m.d_ff}',
               f'{m.d_ff},{m.d_model}'}
    found = re.findall(r'bf16\\[([\\d,]+)\\]\\{[^}]*\\} convert\\(', text)
    rows = cfg.train.global_batch_size * cfg.data.seq_len
    residual_copies = len(re.findall(rf'bf16\\[{rows},{m.d_model}\\]\\{{[^}}]*\\}} copy\\(', text))
    # Passes that only add two (rows, d_model) bf16 values: the input
    # gradients of the norm output, summed outside the products.
    lone_sums = len(re.findall(rf'%wrapped_add[.\\d]* = bf16\\[{rows},{m.d_model}\\]', text))
    # Weight gradients that a cuBLAS call adds into their sum over slices
    # (fp32 output, aliased to its addend), once per program (not XLA's
    # double-buffered copies of the slices' loop body).
    summed_in_gemm = len(re.findall(r'%cublas-lt-matmul\\.\\d+ = \\(f32\\[[^\\n]*output_to_operand_aliasing', text))
    # Passes that read the head's logits (the product's output, by name).
    # (a cuBLAS call's first result, or a Triton GEMM fusion)
    head = re.search(rf'\\n\\s*(%[\\w.-]+) = bf16\\[{rows},{m.vocab_size}\\]\\S* '
                     r'(?:get-tuple-element\\(|fusion\\([^\\n]*kind=kCustom)', text)
    logits_reads = len(re.findall(rf'[(,] ?{re.escape(head.group(1))}[,)]', text)) if head else -1
    sys.path.insert(0, 'bench')
    from hlo_traffic import traffic
    by_kind = traffic(text)[1]
    print(json.dumps({'gelu_aux': text.count('"epilogue":"GELU_AUX"'), 'residual_copies': residual_copies,
                      'mosaic_kernels': text.count('custom_call_target="mosaic_gpu'),
                      # Each Mosaic kernel's results.
                      'mosaic_results': [m.group(2) for m in re.finditer(r'\\n\\s*(%[\\w.-]+) = (\\S+|\\([^)]*\\)) custom-call\\('
                                                         r'[^\\n]*mosaic_gpu', text)],
                      'memory_bound': by_kind['memory-bound passes'], 'products': by_kind['matrix products'],
                      'rows': rows, 'd_ff': m.d_ff,
                      'logits_reads': logits_reads,
                      'summed_in_gemm': summed_in_gemm, 'lone_sums': lone_sums,
                      'kernel_casts': sum(s in kernels for s in found),
                      'triton_gemm': out.options.get('xla_gpu_enable_triton_gemm')}))
''')
ONE_GPU_PROGRAMS = {
    'dots_attention': ('ModelConfig.remat_policy = "dots_attention"',),
    # Two changes of what was before in one program: neither touches what
    # the other's test counts (the weights' casts; the logits' reads).
    'dots_attention, casts not kept, two-pass loss': ('ModelConfig.remat_policy = "dots_attention"',),
    'gelu epilogue, dots_attention': ('ModelConfig.remat_policy = "dots_attention"',
                                      'ModelConfig.gelu_epilogue = True'),
    'gelu epilogue, no remat': ('ModelConfig.remat_policy = "none"', 'ModelConfig.gelu_epilogue = True'),
    # 1p3b.gin's products (all cuBLAS under the epilogue) in 2 slices.
    'gelu epilogue, dots_attention, autodiff\'s sums': ('ModelConfig.remat_policy = "dots_attention"',
                                                       'ModelConfig.gelu_epilogue = True'),
    '2 slices': ('ModelConfig.remat_policy = "dots_attention"', 'ModelConfig.gelu_epilogue = True',
                 'TrainConfig.grad_accum_steps = 2'),
    '2 slices, sums in the kernels\' shapes': ('ModelConfig.remat_policy = "dots_attention"',
                                               'ModelConfig.gelu_epilogue = True', 'TrainConfig.grad_accum_steps = 2'),
    'gelu epilogue, dots_attention, backward kernel': ('ModelConfig.remat_policy = "dots_attention"',
                                                       'ModelConfig.gelu_epilogue = True',
                                                       'ModelConfig.gelu_backward_kernel = True'),
    'backward kernel, erf GeLU': ('ModelConfig.remat_policy = "dots_attention"', 'ModelConfig.gelu_epilogue = True',
                                  'ModelConfig.gelu_backward_kernel = True', 'ModelConfig.gelu_approximate = False'),
    'rotary kernel': ('ModelConfig.remat_policy = "dots_attention"', 'ModelConfig.gelu_epilogue = True',
                      'ModelConfig.rotary_kernel = True'),
    # Heads of 128, 1p3b's: the kernel's default tiling (3 stages, 208 KiB).
    'rotary kernel, heads of 128': ('ModelConfig.remat_policy = "dots_attention"', 'ModelConfig.n_heads = 2',
                                    'ModelConfig.rotary_kernel = True'),
}


def one_gpu_compile(name: str) -> dict:
  return run_child(ONE_GPU_SCRIPT, {'bindings': TINY + ONE_GPU + list(ONE_GPU_PROGRAMS[name]),
                                    'unsaved_casts': 'not kept' in name, 'sums_as_kernels': 'kernels\'' in name,
                                    'autodiff_sums': 'autodiff' in name, 'two_pass_loss': 'two-pass' in name})


@pytest.fixture(scope='module')
def one_gpu():
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    futures = {name: pool.submit(one_gpu_compile, name) for name in ONE_GPU_PROGRAMS}
    yield {name: f.result() for name, f in futures.items()}


def test_the_backward_casts_no_weight_again(one_gpu):
  """The dots policies keep each projection's kernel as cast to bf16: the
  backward's products read it instead of casting the fp32 weights again,
  at least one cast fewer for each of the 2 layers' 6 kernels."""
  kept, before = one_gpu['dots_attention'], one_gpu['dots_attention, casts not kept, two-pass loss']
  assert before['kernel_casts'] - kept['kernel_casts'] >= 2 * 6, (kept, before)


@pytest.mark.parametrize('remat', ['dots_attention', 'no remat'])
def test_the_gelu_epilogue_fuses_the_gelu_into_the_product(one_gpu, remat):
  """ModelConfig.gelu_epilogue: each layer's MLP input product runs as one
  cuBLASLt GELU_AUX call (it writes GeLU(u) and u), under remat and without
  it (where XLA would otherwise share the GeLU with the backward's), and
  the run turns XLA's Triton GEMMs off for it. Without it, no epilogue."""
  fused = one_gpu[f'gelu epilogue, {remat}']
  assert fused['gelu_aux'] == 2 and fused['triton_gemm'] is False, fused
  assert one_gpu['dots_attention']['gelu_aux'] == 0
  # With cuBLAS running the products, one output projection is added into
  # the other's result (beta = 1) and the residual after: nothing copies it
  # (summed onto the residual first, XLA copied it once a layer without remat).
  assert fused['residual_copies'] == 0, fused


def test_the_weight_gradients_are_summed_over_slices_inside_their_products(one_gpu):
  """With accumulation slices each of the 2 layers' 6 weight gradients is
  added into its fp32 sum by the product that makes it (cuBLAS, beta = 1):
  the sums are kept in the products' 2-D form (`train._gemm_forms`). Kept in
  the kernels' own shapes, attention's 3-D kernels (q, k, v, out) took a
  pass of their own per slice; only the MLP's 2-D ones were added in place."""
  assert one_gpu['2 slices']['summed_in_gemm'] == 2 * 6, one_gpu['2 slices']
  assert one_gpu["2 slices, sums in the kernels' shapes"]['summed_in_gemm'] == 2 * 2


def test_the_norm_outputs_gradients_are_summed_inside_the_products(one_gpu):
  """q, k, v and the MLP input read the norm's output; each of their input
  gradients is a product, and each is added onto the sum so far as that
  product's addend (layers.fan_out): no pass of its own sums two of them.
  In autodiff's order one sum a layer stayed a pass."""
  assert one_gpu['gelu epilogue, dots_attention']['lone_sums'] == 0, one_gpu['gelu epilogue, dots_attention']
  assert one_gpu["gelu epilogue, dots_attention, autodiff's sums"]['lone_sums'] == 2


def test_the_loss_reads_the_logits_twice(one_gpu):
  """On a GPU the forward's log-sum-exp and the target's logit are one
  reduction (`loss.logsumexp_and_target`), and the backward one pass: two
  reads of the logits in all. The row's max, then its sum of exp, read them
  once more."""
  assert one_gpu['dots_attention']['logits_reads'] == 2, one_gpu['dots_attention']
  before = one_gpu['dots_attention, casts not kept, two-pass loss']
  assert before['logits_reads'] == 3, before


def test_the_gelu_backward_kernel_takes_the_derivative_into_the_product(one_gpu):
  """ModelConfig.gelu_backward_kernel: each of the 2 layers' dg = dy Wo^T
  runs as the Pallas kernel (mjax/model/gelu_kernel.py), lowered here for an
  H100, which writes du and GeLU(u). The elementwise pass that read dg and u
  and wrote both is gone, and so is dg's round trip through memory: a
  (rows, d_ff) bf16 write and read a layer fewer in all."""
  plain, kernel = one_gpu['gelu epilogue, dots_attention'], one_gpu['gelu epilogue, dots_attention, backward kernel']
  assert plain['mosaic_kernels'] == 0 and kernel['mosaic_kernels'] == 2, kernel
  # Mosaic GPU lowers no erf: the exact GeLU keeps autodiff's kernels.
  assert one_gpu['backward kernel, erf GeLU']['mosaic_kernels'] == 0
  tensor = kernel['rows'] * kernel['d_ff'] * 2   # one (rows, d_ff) bf16 array
  # The pass read u and dg and wrote du and GeLU(u): four arrays a layer.
  assert plain['memory_bound'] - kernel['memory_bound'] >= 2 * 3.9 * tensor, (plain, kernel)
  total = lambda r: r['memory_bound'] + r['products']
  assert total(plain) - total(kernel) >= 2 * 1.9 * tensor, (plain, kernel)


def test_the_rotary_kernel_writes_q_and_k_rotated_for_attention_to_read(one_gpu):
  """ModelConfig.rotary_kernel: each of the 2 layers' q and k products run
  as one Pallas kernel (mjax/model/rotary_kernel.py), lowered here for an
  H100, with rotary as its epilogue. It writes q and k as two arrays
  (slices of one would be copies), each read where attention reads it,
  and the forward's rotary pass is gone. (The bytes saved are counted
  with cuDNN's boundaries in bench/RESULTS.md: XLA's attention here fuses
  rotary into its own layout passes.)"""
  plain, kernel = one_gpu['gelu epilogue, dots_attention'], one_gpu['rotary kernel']
  assert plain['mosaic_kernels'] == 0 and kernel['mosaic_kernels'] == 2, kernel
  rows = kernel['rows']
  for results in kernel['mosaic_results']:
    assert results == f'(bf16[{rows},256]{{1,0}}, bf16[{rows},256]{{1,0}})', kernel['mosaic_results']
  assert kernel['products'] < plain['products']   # q's and k's cuBLAS products are the kernel's
  wide = one_gpu['rotary kernel, heads of 128']
  assert wide['mosaic_kernels'] == 2 and wide['mosaic_results'][0] == f'(bf16[{rows},256]{{1,0}}, bf16[{rows},256]{{1,0}})'


TILINGS_SCRIPT = textwrap.dedent('''
    import dataclasses, importlib.util, json, sys
    from mjax.parallel import gpu_target
    gpu_target.keep_local_backend_cpu()
    import jax, jax.numpy as jnp
    from mjax.model import gelu_kernel as gk, rotary_kernel as rk
    spec = importlib.util.spec_from_file_location('gpu_suite', 'bench/gpu_suite.py')
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    device = gpu_target.topology_devices(gpu_target.parse_target('h100:1'))[0]
    at = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16,
                                             sharding=jax.sharding.SingleDeviceSharding(device))
    m, n, k, hd = 16 * 2048, 8192, 2048, 128      # 1p3b, as the kernels section times them
    results = {}
    for name, change in [(None, {})] + suite.GELU_TILINGS:
      t = dataclasses.replace(gk.DEFAULT_TILES, **change)
      f = lambda dy, wo_t, u, t=t: gk.dgelu_product(dy, wo_t, u, True, tiles=t)
      jax.jit(f).lower(at(m, k), at(k, n), at(m, n)).compile()
      results[f'gelu {name}'] = gk.runs_on_a_gpu(t) and gk.fits(m, n, k, t)
    for name, change in [(None, {})] + suite.ROTARY_TILINGS:
      t = dataclasses.replace(rk.tiles_for(hd), **change)
      f = lambda x, w, cs, t=t: rk.rotary_product(x, w, cs, 16 * hd, tiles=t)
      jax.jit(f).lower(at(m, k), at(k, 32 * hd), at(2, m, hd // 2)).compile()
      results[f'rotary {name}'] = rk.runs_on_a_gpu(t) and rk.fits(m, 16 * hd, 16 * hd, k, hd, t)
    print(json.dumps(results))
''')


def test_every_tiling_the_gpu_suite_times_lowers_for_a_hopper_gpu():
  """The kernels section's --experiments sweep (bench/gpu_suite.py) spends
  device time on each tiling: each must lower for sm_90 at 1p3b's shapes,
  and pass the kernels' own checks, before a GPU sees it."""
  results = run_child(TILINGS_SCRIPT, {})
  assert len(results) > 2, results   # the defaults and the sweep's
  assert all(results.values()), results
