"""Collectives of compiled train steps against what each mesh layout implies,
and the HLO parsing underneath on handwritten snippets."""

import jax
import pytest
from flax import linen as nn

from mjax import config as C
from mjax import train
from mjax.parallel import hlo_text, make_mesh
from mjax.model.flops import abstract_params
from mjax.parallel.comm_report import (collective_stats, comm_report, expected_traffic,
                                       format_report, memory_stats)

# ----------------------------------------------------------------------------
# Parsing handwritten HLO
# ----------------------------------------------------------------------------

LOOP_HLO = """\
HloModule jit_step, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%wrapped_reduce_scatter (p: f32[64,32]) -> f32[8,32] {
  %p = f32[64,32]{1,0} parameter(0)
  ROOT %rs = f32[8,32]{1,0} reduce-scatter(%p), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
}

%body (carry: (s32[], bf16[16,128])) -> (s32[], bf16[16,128]) {
  %carry = (s32[], bf16[16,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%carry), index=0
  %w = bf16[16,128]{1,0} get-tuple-element(%carry), index=1
  %ag-start = (bf16[16,128]{1,0}, bf16[128,128]{1,0}) all-gather-start(%w), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, metadata={op_name="jit(step)/while/body/dot_general"}
  %ag-done = bf16[128,128]{1,0} all-gather-done(%ag-start)
  %ar-start = bf16[16,128]{1,0} all-reduce-start(%w), channel_id=2, replica_groups=mesh['x'=2,'y'=4] {'y'}, to_apply=%add
  %ar-done = bf16[16,128]{1,0} all-reduce-done(%ar-start)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], bf16[16,128]{1,0}) tuple(%next, %ar-done)
}

%cond (carry.1: (s32[], bf16[16,128])) -> pred[] {
  %carry.1 = (s32[], bf16[16,128]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%carry.1), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (w0: bf16[16,128], g: f32[64,32]) -> (s32[], bf16[16,128]) {
  %w0 = bf16[16,128]{1,0} parameter(0)
  %g = f32[64,32]{1,0} parameter(1)
  %rs-start = ((f32[64,32]{1,0}), f32[8,32]{1,0}) async-start(%g), calls=%wrapped_reduce_scatter
  %rs-done = f32[8,32]{1,0} async-done(%rs-start), calls=%wrapped_reduce_scatter
  %cp-start = (f32[8,32]{1,0}, f32[8,32]{1,0}, u32[], u32[]) collective-permute-start(%rs-done), channel_id=4, source_target_pairs={{0,1},{1,2}}
  %cp-done = f32[8,32]{1,0} collective-permute-done(%cp-start)
  %a2a = (f32[4,32]{1,0}, f32[4,32]{1,0}) all-to-all(%cp-done, %cp-done), channel_id=5, replica_groups={}
  %zero = s32[] constant(0)
  %init = (s32[], bf16[16,128]{1,0}) tuple(%zero, %w0)
  ROOT %loop = (s32[], bf16[16,128]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
}
"""


def by_kind(stats):
  return {k: stats.per_step(k) for k in ('all-gather', 'all-reduce', 'reduce-scatter',
                                          'collective-permute', 'all-to-all')}


def test_loop_collectives_count_once_per_iteration_and_async_pairs_once():
  s = by_kind(collective_stats(LOOP_HLO))
  # all-gather-start inside the 6-trip loop: output bf16[128,128] per run.
  assert s['all-gather'] == {'ops': 6, 'static': 1, 'bytes': 6 * 128 * 128 * 2,
                             'wire': 6 * 7 / 8 * 128 * 128 * 2}
  # all-reduce over the mesh axis y (4 devices): 2 (n-1)/n x the buffer.
  assert s['all-reduce']['ops'] == 6 and s['all-reduce']['bytes'] == 6 * 16 * 128 * 2
  assert s['all-reduce']['wire'] == 6 * 2 * 3 / 4 * 16 * 128 * 2
  # reduce-scatter inside an async wrapper: counted once, by its INPUT size.
  assert s['reduce-scatter']['ops'] == 1 and s['reduce-scatter']['bytes'] == 64 * 32 * 4
  # collective-permute-start: the output buffer, sent once.
  assert s['collective-permute'] == {'ops': 1, 'static': 1, 'bytes': 8 * 32 * 4, 'wire': 8 * 32 * 4}
  # replica_groups={} means all 8 partitions.
  assert s['all-to-all']['bytes'] == 2 * 4 * 32 * 4
  assert s['all-to-all']['wire'] == 7 / 8 * 2 * 4 * 32 * 4


def test_an_all_reduce_start_counts_its_outputs_in_either_printed_form():
  """jaxlib 0.11 prints all-reduce-start as ((operands), outputs), where 0.10
  printed the outputs alone: read as both, its bytes doubled (the report
  put data parallelism at 2.00x its minimum)."""
  new = LOOP_HLO.replace('%ar-start = bf16[16,128]{1,0} all-reduce-start',
                         '%ar-start = ((bf16[16,128]{1,0}), bf16[16,128]{1,0}) all-reduce-start')
  assert new != LOOP_HLO
  assert by_kind(collective_stats(new)) == by_kind(collective_stats(LOOP_HLO))
  # Several operands in 0.10's form: a tuple of outputs, every one counted.
  two = LOOP_HLO.replace('%ar-start = bf16[16,128]{1,0} all-reduce-start(%w)',
                         '%ar-start = (bf16[16,128]{1,0}, bf16[16,128]{1,0}) all-reduce-start(%w, %w)')
  assert by_kind(collective_stats(two))['all-reduce']['bytes'] == 2 * 6 * 16 * 128 * 2


def test_trip_count_from_the_loop_condition_and_nested_loops():
  no_config = LOOP_HLO.replace(', backend_config={"known_trip_count":{"n":"6"}}', '')
  module = hlo_text.parse_module(no_config)
  loop = module.instruction('loop')
  assert hlo_text.trip_count(module, loop) == 6          # compare(i, 6), direction=LT
  # Wrap the whole step in an outer loop of 3: the inner collectives run 18 times.
  outer = no_config.replace('ENTRY %main', '%inner_step') + """
%outer_body (c: (s32[], bf16[16,128])) -> (s32[], bf16[16,128]) {
  %c = (s32[], bf16[16,128]{1,0}) parameter(0)
  %w1 = bf16[16,128]{1,0} get-tuple-element(%c), index=1
  %g1 = f32[64,32]{1,0} constant({...})
  ROOT %r = (s32[], bf16[16,128]{1,0}) call(%w1, %g1), to_apply=%inner_step
}

%outer_cond (c.1: (s32[], bf16[16,128])) -> pred[] {
  %c.1 = (s32[], bf16[16,128]{1,0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %top (w: (s32[], bf16[16,128])) -> (s32[], bf16[16,128]) {
  %w = (s32[], bf16[16,128]{1,0}) parameter(0)
  ROOT %outer = (s32[], bf16[16,128]{1,0}) while(%w), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
}
"""
  s = collective_stats(outer)
  assert s.per_step('all-gather')['ops'] == 18 and s.per_step('reduce-scatter')['ops'] == 3
  assert not s.unknown_trip_loops
  # A condition that is not `counter < constant`: counted once, reported.
  unknown = collective_stats(no_config.replace('direction=LT', 'direction=NE'))
  assert unknown.per_step('all-gather')['ops'] == 1 and unknown.unknown_trip_loops == ['loop']


def test_replica_group_forms():
  s = collective_stats(LOOP_HLO.replace("replica_groups=mesh['x'=2,'y'=4] {'y'}",
                                        'replica_groups=[2,4]<=[8]'))
  assert [o.group_size for o in s.of_kind('all-reduce')] == [4]
  s = collective_stats(LOOP_HLO.replace("replica_groups=mesh['x'=2,'y'=4] {'y'}",
                                        "replica_groups=mesh['x'=2,'y'=4]"))
  assert [o.group_size for o in s.of_kind('all-reduce')] == [8]   # no axis list: all of them
  assert [o.group_size for o in s.of_kind('all-gather')] == [8]   # {{0,...,7}}
  # What a GPU compile prints for data 2 x fsdp 4: a device list between the
  # mesh and its axes. The group is the listed axis's 4 devices, not all 8
  # (read as 8, the report put HSDP's weight gathers at 1.17x their minimum).
  s = collective_stats(LOOP_HLO.replace(
      "replica_groups=mesh['x'=2,'y'=4] {'y'}",
      "replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}"))
  assert [o.group_size for o in s.of_kind('all-reduce')] == [4]
  s = collective_stats(LOOP_HLO.replace(
      "replica_groups=mesh['x'=2,'y'=4] {'y'}",
      "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_1'}"))
  assert [o.group_size for o in s.of_kind('all-reduce')] == [2]


# ----------------------------------------------------------------------------
# Compiled train steps on 8 CPU devices
# ----------------------------------------------------------------------------

# 4 layers = 2 scanned groups of 2 (tiny's full_attention_every = 2), so the
# layer loop runs twice; fp32 compute so measured and expected dtypes agree.
SMALL = ['ModelConfig.d_model = 128', 'ModelConfig.n_layers = 4', 'ModelConfig.d_ff = 256',
         'DataConfig.seq_len = 64', 'TrainConfig.global_batch_size = 16',
         'ModelConfig.dtype = "float32"']


def compile_step(*mesh_bindings):
  cfg = C.load_config(['tiny.gin'], [*SMALL, *mesh_bindings], num_devices=8)
  mesh = make_mesh(cfg.mesh)
  program = train.make_program(cfg, mesh)
  with program.context():
    compiled = program.step.lower(program.abstract_state(), program.abstract_batch()).compile()
  return cfg, dict(mesh.shape), compiled


@pytest.fixture(scope='module')
def fsdp():
  return compile_step('MeshConfig.data = 1', 'MeshConfig.fsdp = 8')


@pytest.fixture(scope='module')
def data_parallel():
  return compile_step('MeshConfig.data = 8')


@pytest.fixture(scope='module')
def tensor_parallel():
  return compile_step('MeshConfig.data = 4', 'MeshConfig.tensor = 2')


def expected(cfg, mesh, kind):
  return sum(e.wire_bytes for e in expected_traffic(cfg, mesh) if e.kind == kind)


def param_bytes(cfg):
  params = nn.meta.unbox(abstract_params(cfg.model))
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def test_fsdp_gathers_weights_and_reduces_gradients(fsdp):
  cfg, mesh, compiled = fsdp
  stats = collective_stats(compiled.as_text())
  gathers = stats.of_kind('all-gather')
  assert gathers and all(o.group_size == 8 for o in gathers)
  # The per-layer gathers sit in the scanned loop and run once per iteration.
  assert {o.executions for o in gathers} == {1, 2}
  # Each weight gathered in the forward and again in the backward, in fp32.
  ratio = stats.per_step('all-gather')['wire'] / expected(cfg, mesh, 'all-gather')
  assert 0.9 < ratio < 1.2, ratio
  # Gradients: FSDP implies a reduce-scatter over fsdp. XLA's CPU backend
  # emits an all-reduce of the full gradient instead (then keeps its shard),
  # which sends 2x the bytes; either is a correct lowering of the layout.
  reduced = stats.per_step('reduce-scatter')['wire'] + stats.per_step('all-reduce')['wire']
  ratio = reduced / expected(cfg, mesh, 'reduce-scatter')
  assert 0.9 < ratio < 2.3, ratio
  if not stats.of_kind('reduce-scatter'):
    # Then the all-reduce carries whole MLP kernel gradients, not 1/8 shards.
    biggest = max(stats.of_kind('all-reduce'), key=lambda o: o.buffer_bytes)
    assert biggest.group_size == 8
    assert any(a.dims in ((128, 256), (256, 128)) for a in biggest.arrays)


def test_data_parallel_all_reduces_the_gradients_only(data_parallel):
  cfg, mesh, compiled = data_parallel
  stats = collective_stats(compiled.as_text())
  assert not stats.of_kind('all-gather') and not stats.of_kind('reduce-scatter')
  # One gradient-sized all-reduce (and the step's few scalars): the tied
  # embedding's two gradient terms (lookup, LM head) are summed on each
  # device first (mjax/parallel/scatter_sum.py); reduced apart, they had
  # added 11% here.
  ratio = stats.per_step('all-reduce')['bytes'] / param_bytes(cfg)
  assert 1.0 <= ratio < 1.01, ratio
  ratio = stats.per_step('all-reduce')['wire'] / expected(cfg, mesh, 'all-reduce')
  assert 1.0 <= ratio < 1.01, ratio


def test_accumulation_slices_gather_per_slice_and_all_reduce_once():
  # Two slices, each gathering the weights again (FSDP): twice the minimum,
  # which keeps them gathered across the slices, and the report says why.
  cfg, mesh, compiled = compile_step('MeshConfig.data = 2', 'MeshConfig.fsdp = 4',
                                     'TrainConfig.grad_accum_steps = 2')
  stats = collective_stats(compiled.as_text())
  assert 'the 2 accumulation slices usually run it 2 times' in ' '.join(e.note for e in expected_traffic(cfg, mesh))
  ratio = stats.per_step('all-gather')['wire'] / expected(cfg, mesh, 'all-gather')
  assert 1.8 < ratio < 2.4, ratio
  # The data axis's sum adds up across the slices and is all-reduced once:
  # the slices run manual over `data` (scanned layers, as here). Left to the
  # automatic layout, every slice's gradients were all-reduced over `data`.
  over_data = [o for o in stats.of_kind('all-reduce') if o.group_size == 2]
  assert over_data and all(o.executions == 1 for o in over_data), \
      [(o.executions, o.op_name[-60:]) for o in over_data]


def test_fsdp_gathered_once_a_step_whatever_the_slices():
  # fsdp_gather = 'step': the weights gathered once before the slices and
  # the gradient sums reduce-scattered once after them, where each slice
  # gathers and reduce-scatters its own by default (the test above).
  once = ['MeshConfig.data = 2', 'MeshConfig.fsdp = 4', 'MeshConfig.fsdp_gather = "step"']
  per_step = {}
  for k in (1, 2):
    cfg, mesh, compiled = compile_step(*once, f'TrainConfig.grad_accum_steps = {k}')
    stats = collective_stats(compiled.as_text())
    for kind in ('all-gather', 'reduce-scatter'):
      assert all(o.executions == 1 for o in stats.of_kind(kind)), kind
      per_step[kind, k] = stats.per_step(kind)['wire']
    # Every weight once (the backward reads the gathered copy): the minimum
    # the report computes for this setting, which says so.
    assert 0.95 < per_step['all-gather', k] / expected(cfg, mesh, 'all-gather') < 1.05
    assert 'once a step and held' in ' '.join(e.note for e in expected_traffic(cfg, mesh))
    over_data = [o for o in stats.of_kind('all-reduce') if o.group_size == 2 and o.wire_bytes > 2 ** 12]
    assert over_data and all(o.executions == 1 for o in over_data)
  assert per_step['all-gather', 2] == per_step['all-gather', 1]
  assert per_step['reduce-scatter', 2] == per_step['reduce-scatter', 1]


@pytest.mark.parametrize('schedule', ['1f1b', 'circular'])
def test_pipelines_sum_data_parallel_gradients_once_per_step(schedule):
  # Both schedules accumulate each stage's gradients over its micro-batches
  # in a loop (1F1B's ticks, the circular schedule's scan transposed). Left
  # to the automatic layout, every tick's contribution was all-reduced over
  # `data` (1F1B: 11x the gradient bytes with 4 micro-batches); both run
  # manual over `data` and sum once.
  cfg, mesh, compiled = compile_step('MeshConfig.data = 2', 'MeshConfig.pipeline = 4', 'ModelConfig.n_layers = 8',
                                     'MeshConfig.microbatches = 4', f'MeshConfig.pipeline_schedule = "{schedule}"')
  stats = collective_stats(compiled.as_text())
  grads = [o for o in stats.of_kind('all-reduce') if o.group_size == 2]   # over data
  assert grads and all(o.executions == 1 for o in grads), [(o.op_name, o.executions) for o in grads]
  big = [o for o in stats.of_kind('all-reduce') if o.wire_bytes > 2 ** 16]   # not the loss and norms
  wire = sum(o.executions * o.wire_bytes for o in big)
  if schedule == 'circular':
    # The gradients' bytes over `data` about once (the tied embedding's two
    # terms are reduced apart); the rest is the x cotangent's sum over stages.
    ratio = sum(o.executions * o.wire_bytes for o in grads) / expected(cfg, mesh, 'all-reduce')
    assert 0.9 < ratio < 1.25, ratio
  else:
    # 1F1B: the layers' gradients over `data`; the embedding's and the
    # head's (one tied table) added on their shard and summed over stages and
    # `data` together, once; no activation cotangent leaves the schedule.
    assert sorted(o.group_size for o in big) == [2, 8], [(o.group_size, o.arrays) for o in big]
    assert all(o.executions == 1 for o in big)
    ratio = wire / expected(cfg, mesh, 'all-reduce')
    assert 0.98 < ratio < 1.05, ratio


def test_tensor_parallel_all_reduces_activations_every_layer(tensor_parallel):
  cfg, mesh, compiled = tensor_parallel
  stats = collective_stats(compiled.as_text())
  # (batch per data replica, seq, d_model), or its rows joined (batch * seq,
  # d_model) where the projections run as 2-D products.
  is_act = lambda dims: dims in ((16 // 4, 64, 128), (16 // 4 * 64, 128))
  tp_ops = [o for o in stats.of_kind('all-reduce')
            if o.group_size == 2 and any(is_act(a.dims) for a in o.arrays)]
  buffers = sum(o.executions * sum(is_act(a.dims) for a in o.arrays) for o in tp_ops)
  # At least one forward and one backward activation all-reduce per layer.
  assert buffers >= 2 * cfg.model.n_layers
  tp_wire = sum(o.executions * o.wire_bytes for o in tp_ops)
  tp_expected = next(e.wire_bytes for e in expected_traffic(cfg, mesh) if 'tensor=' in e.note)
  # The minimum sums attention and MLP partial results before one all-reduce
  # per pass; XLA reduces them separately (2 forward, 4 backward buffers per
  # layer on CPU), hence up to ~3x.
  assert 0.9 < tp_wire / tp_expected < 4, tp_wire / tp_expected


def test_report_and_memory_analysis(fsdp):
  cfg, mesh, compiled = fsdp
  report = comm_report(compiled, cfg, mesh)
  mem = memory_stats(compiled)
  assert mem['temp_size_in_bytes'] > 0 and mem['argument_size_in_bytes'] > 0
  assert mem['total'] >= mem['temp_size_in_bytes']
  text = format_report(report)
  for word in ('all-gather', 'expected (analytical minimum)', 'memory analysis', 'largest'):
    assert word in text
  # The CPU's gradient all-reduces are named where the minimum has none (the
  # tied table's reduce-scatter made the old note's "no reduce-scatter"
  # condition false, and the 2x went unexplained).
  assert 'all-reduce instructions where the minimum has none' in text and '--target h100:8' in text


WIDENED_HLO = """\
HloModule jit_step, is_scheduled=true, num_partitions=8

%cast_back (p0: f32[16,128]) -> f32[16,128] {
  %p0 = f32[16,128]{1,0} parameter(0)
  %narrow = bf16[16,128]{1,0} convert(%p0)
  %t = bf16[16,128]{1,0} copy(%narrow)
  ROOT %wide = f32[16,128]{1,0} convert(%t)
}

ENTRY %main (w: f32[16,128], v: f32[16,128]) -> (f32[128,128], f32[128,128]) {
  %w = f32[16,128]{1,0} parameter(0)
  %v = f32[16,128]{1,0} parameter(1)
  %f = f32[16,128]{1,0} fusion(%w), kind=kLoop, calls=%cast_back
  %b = f32[16,128]{1,0} bitcast(%f)
  %ag.1 = f32[128,128]{1,0} all-gather(%b), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %ag.2 = f32[128,128]{1,0} all-gather(%v), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %out = (f32[128,128]{1,0}, f32[128,128]{1,0}) tuple(%ag.1, %ag.2)
}
"""


def test_collectives_widened_by_the_backend_are_traced_to_their_16_bit_source():
  ops = {o.name: o for o in collective_stats(WIDENED_HLO).ops}
  # Through a bitcast, into the fusion, to a convert from bf16: the program
  # gathers bf16 and the backend widened it; half the wire bytes at bf16.
  assert ops['ag.1'].widened_from == 'bf16'
  assert ops['ag.1'].program_wire_bytes == ops['ag.1'].wire_bytes / 2
  # An fp32 parameter gathered as it is: fp32 for real.
  assert ops['ag.2'].widened_from is None
  assert ops['ag.2'].program_wire_bytes == ops['ag.2'].wire_bytes


def test_fsdp_weights_are_cast_on_the_shard_then_gathered_in_bf16():
  cfg, mesh, compiled = compile_step('MeshConfig.data = 1', 'MeshConfig.fsdp = 8',
                                     'ModelConfig.dtype = "bfloat16"')
  stats = collective_stats(compiled.as_text())
  matrices = [o for o in stats.of_kind('all-gather')
              if any(len(a.dims) >= 2 and a.dtype in ('f32', 'bf16') for a in o.arrays)]  # not token ids
  # Every weight matrix (the embedding included) travels as bf16 in the
  # program; XLA's CPU backend widens 16-bit collectives to f32 afterwards.
  assert matrices and all('bf16' in (o.widened_from, o.arrays[0].dtype) for o in matrices), \
      [(o.op_name, o.arrays[0].dtype) for o in matrices if o.widened_from is None]
  wire = sum(o.executions * o.program_wire_bytes for o in stats.of_kind('all-gather'))
  ratio = wire / expected(cfg, mesh, 'all-gather')
  assert 0.8 < ratio <= 1.1, ratio
  text = format_report(comm_report(compiled, cfg, mesh))
  assert 'widens them to f32' in text and 'gathered before their cast' not in text


def test_schedule_marks_overlapped_exposed_and_synchronous_collectives():
  from mjax.parallel.comm_report import format_schedule, schedule
  # A GPU-style scheduled module: one fusion placed between the all-gather's
  # start and done; the rest of the pairs start and finish back to back.
  text = LOOP_HLO.replace(
      '  %ag-done = ',
      '  %f = bf16[16,128]{1,0} fusion(%w), kind=kLoop, calls=%add\n  %ag-done = ')
  items = {s.name: s for s in schedule(text)}
  assert set(items) == {'ag-start', 'ar-start', 'rs-start', 'cp-start', 'a2a'}   # the wrapped rs once
  assert (items['ag-start'].mode, items['ag-start'].compute_between) == ('overlapped', 1)
  assert items['ag-start'].matmuls_between == 0   # an elementwise fusion hides it, not a matmul
  assert items['ar-start'].mode == 'exposed' and items['cp-start'].mode == 'exposed'
  assert (items['rs-start'].kind, items['rs-start'].mode) == ('reduce-scatter', 'exposed')
  assert items['a2a'].mode == 'synchronous'
  table = format_schedule(list(items.values()))
  assert 'all-gather' in table and 'exposed, e.g.' in table


def test_schedule_tells_a_collective_behind_a_matmul_from_one_behind_elementwise_work():
  from mjax.parallel.comm_report import format_schedule, schedule
  gemm = ('%gemm_body (a: bf16[16,128], b: bf16[128,128]) -> bf16[16,128] {\n'
          '  %a = bf16[16,128]{1,0} parameter(0)\n  %b = bf16[128,128]{1,0} parameter(1)\n'
          '  ROOT %d = bf16[16,128]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}\n'
          '}\n\n')
  text = LOOP_HLO.replace('%body (carry', gemm + '%body (carry').replace(
      '  %ag-done = ',
      '  %mm = bf16[16,128]{1,0} fusion(%w, %w), kind=kCustom, calls=%gemm_body\n'
      '  %ag-done = ').replace(
      '  %ar-done = ',
      '  %cb = bf16[16,128]{1,0} custom-call(%w, %w), custom_call_target="__cublas$gemm"\n'
      '  %ar-done = ')
  items = {s.name: s for s in schedule(text)}
  assert (items['ag-start'].mode, items['ag-start'].matmuls_between) == ('overlapped', 1)
  assert (items['ar-start'].mode, items['ar-start'].matmuls_between) == ('overlapped', 1)
  assert items['cp-start'].matmuls_between == 0
  assert 'behind matmul' in format_schedule(list(items.values()))


def test_cpu_compile_schedule_is_synchronous_and_says_why(fsdp):
  from mjax.parallel.comm_report import format_schedule, schedule
  cfg, mesh, compiled = fsdp
  items = schedule(compiled.as_text())
  assert items and all(s.mode == 'synchronous' for s in items)
  assert {'all-gather', 'all-reduce'} <= {s.kind for s in items} or {'all-gather', 'reduce-scatter'} <= {
      s.kind for s in items}
  assert 'no asynchronous collectives' in format_schedule(items, 'cpu')


def test_collective_axes_from_every_printed_group_form():
  from mjax.parallel.comm_report import collective_axes
  mesh = {'data': 2, 'fsdp': 1, 'tensor': 2, 'pipeline': 2}   # partition = 4 data + 2 tensor + pipeline
  assert collective_axes('replica_groups={{0,1},{2,3},{4,5},{6,7}}', mesh) == 'pipeline'
  assert collective_axes('replica_groups={{0,2},{1,3},{4,6},{5,7}}', mesh) == 'tensor'
  assert collective_axes('replica_groups=[4,2]<=[8]', mesh) == 'pipeline'
  # iota with a transpose: [[0,4],[1,5],[2,6],[3,7]]: pairs differing in data.
  assert collective_axes('replica_groups=[4,2]<=[2,4]T(1,0)', mesh) == 'data'
  assert collective_axes('replica_groups=[2,4]<=[2,4]', mesh) == 'tensor+pipeline'
  assert collective_axes('replica_groups={}', mesh) == 'data+tensor+pipeline'
  assert collective_axes('source_target_pairs={{0,1},{1,0},{2,3},{3,2}}', mesh) == 'pipeline'
  # The form XLA prints for meshes (size-1 axes may be left out).
  assert collective_axes("replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_1'}", mesh) == 'tensor'
  assert collective_axes("replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_0','axis_2'}",
                         mesh) == 'data+pipeline'
  assert collective_axes("replica_groups=mesh['a'=2,'b'=2,'c'=2]", mesh) == 'data+tensor+pipeline'
  # A reordered printed mesh with the partitions at its positions: [[0,4],[1,5],[2,6],[3,7]] by data.
  assert collective_axes("replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_1'}",
                         mesh) == 'data'
  assert collective_axes('channel_id=1', mesh) is None


def test_schedule_names_the_axes_of_each_collective(tensor_parallel):
  from mjax.parallel.comm_report import format_schedule, schedule
  cfg, mesh, compiled = tensor_parallel
  items = schedule(compiled.as_text(), mesh)
  by_axes = {(s.kind, s.axes) for s in items}
  # Tensor parallelism's activation all-reduces run over `tensor` alone; the
  # gradients' over the batch axes.
  assert ('all-reduce', 'tensor') in by_axes, by_axes
  assert any(k == 'all-reduce' and a and 'data' in a and 'tensor' not in a for k, a in by_axes), by_axes
  assert all(s.axes is not None for s in items), [s for s in items if s.axes is None]
  assert 'over' in format_schedule(items, 'cpu') and 'tensor' in format_schedule(items, 'cpu')


def test_sequence_parallel_expects_gathers_and_scatters_not_all_reduces():
  # Sequence parallelism moves tensor parallelism's activations as an
  # all-gather and a reduce-scatter per all-reduce of plain tensor
  # parallelism (half of its wire bytes each); collective matmul moves the
  # layers' share as collective-permute rings.
  mesh = {'data': 2, 'tensor': 4}
  tp = C.load_config(['tiny.gin'], ['MeshConfig.data = 2', 'MeshConfig.tensor = 4'])
  sp = C.load_config(['tiny.gin'], ['MeshConfig.data = 2', 'MeshConfig.tensor = 4',
                                    'MeshConfig.sequence_parallel = True'])
  cm = C.load_config(['tiny.gin'], ['MeshConfig.data = 2', 'MeshConfig.tensor = 4',
                                    'MeshConfig.sequence_parallel = True', 'MeshConfig.collective_matmul = True'])
  data_part = expected(sp, mesh, 'all-reduce')
  activations = expected(tp, mesh, 'all-reduce') - data_part
  # tiny: 4 parallel blocks x 2 all-reduces + the embedding's and the head's
  # = 10. Under SP that is 10 reduce-scatters and, with remat 'none' (tiny's:
  # every input kept), 11 all-gathers: the head's input and the embedding's
  # cotangent once more in the backward.
  assert activations > 0 and expected(sp, mesh, 'all-gather') == pytest.approx(activations / 2 * 11 / 10)
  assert expected(sp, mesh, 'reduce-scatter') == pytest.approx(activations / 2)
  assert expected(sp, mesh, 'collective-permute') == 0
  # Any other policy gathers each block's input again for its weight
  # gradient: 4 more (what a GPU compile of 1p3b shows).
  dots = C.load_config(['tiny.gin'], ['MeshConfig.data = 2', 'MeshConfig.tensor = 4',
                                      'MeshConfig.sequence_parallel = True', 'ModelConfig.remat_policy = "dots"'])
  assert expected(dots, mesh, 'all-gather') == pytest.approx(activations / 2 * 15 / 10)
  # 4 layers x 2 per layer of each kind in rings, the rest not; with remat
  # 'dots' the backward's gathers of the blocks' inputs too.
  assert expected(cm, mesh, 'all-gather') == pytest.approx(activations / 2 * 3 / 10)
  assert expected(cm, mesh, 'reduce-scatter') == pytest.approx(activations / 2 * 2 / 10)
  assert expected(cm, mesh, 'collective-permute') == pytest.approx(activations * 8 / 10)
  cm_dots = C.load_config(['tiny.gin'], ['MeshConfig.data = 2', 'MeshConfig.tensor = 4',
                                         'MeshConfig.sequence_parallel = True', 'MeshConfig.collective_matmul = True',
                                         'ModelConfig.remat_policy = "dots"'])
  assert expected(cm_dots, mesh, 'all-gather') == pytest.approx(activations / 2 * 3 / 10)
  # Rings: 12 gathers, 8 scatters, and the 2 sums recomputed inside tiny's
  # remat groups of 2 layers (the groups' outputs are kept).
  assert expected(cm_dots, mesh, 'collective-permute') == pytest.approx(activations / 2 * 22 / 10)
  assert expected(dots, mesh, 'reduce-scatter') == pytest.approx(activations / 2 * 12 / 10)


def test_an_untied_head_is_gathered_once_a_step():
  # Cast on its shards and gathered along embed once, for the product and
  # its backward (the model's _gathered_head). Left to GSPMD, FSDP x tensor
  # with sequence parallelism gathered it three times a step.
  cfg, mesh, compiled = compile_step('MeshConfig.data = 1', 'MeshConfig.fsdp = 4', 'MeshConfig.tensor = 2',
                                     'MeshConfig.sequence_parallel = True', 'ModelConfig.tie_embeddings = False')
  head = (cfg.model.d_model, cfg.model.vocab_size // 2)    # embed gathered, vocab over tensor
  stats = collective_stats(compiled.as_text())
  runs = sum(o.executions for o in stats.of_kind('all-gather') for a in o.arrays if a.dims == head)
  assert runs == 1, [(o.executions, [a.dims for a in o.arrays]) for o in stats.of_kind('all-gather')]


def test_bf16_accumulation_slices_reduce_once_on_cpu_too():
  # The slices' gradients, summed manual over `data`, are reduced in fp32 on
  # CPUs: a bf16 reduction inside a region manual over some axes only
  # aborted XLA's CPU compiler (AllReducePromotion), killing the process.
  cfg, mesh, compiled = compile_step('MeshConfig.data = 8', 'TrainConfig.grad_accum_steps = 2',
                                     'ModelConfig.dtype = "bfloat16"')
  over_data = [o for o in collective_stats(compiled.as_text()).of_kind('all-reduce') if o.group_size == 8]
  assert over_data and all(o.executions == 1 for o in over_data)
