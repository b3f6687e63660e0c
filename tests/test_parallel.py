"""Every layout computes the same training steps as one device.

Same seed, same data, fp32 compute: the losses of the first steps and the
final parameters of each 8-device layout must match a 1-device run. The only
legitimate differences are the order of floating-point sums in cross-device
reductions (~1e-7 relative per op in fp32), so the tolerances below (1e-5 on
losses, 1e-4 relative on parameters after three LAMB steps) leave a wide
margin, while a real sharding bug (a missing all-reduce, a stage applied out
of order, a micro-batch dropped) is off by O(1e-2) or more.
"""

import jax
import numpy as np
import pytest

from mjax import config as C
from mjax import data as data_lib
from mjax import train
from mjax.parallel import make_mesh

# Eight scanned layers, so that 2 or 4 stages x 2 virtual stages split evenly.
MODEL = ['ModelConfig.d_model = 128', 'ModelConfig.n_layers = 8', 'ModelConfig.d_ff = 256',
         'ModelConfig.full_attention_every = 0', 'ModelConfig.sliding_window = 16',
         'ModelConfig.dtype = "float32"', 'DataConfig.seq_len = 64',
         'TrainConfig.global_batch_size = 16', 'TrainConfig.progress = False']
STEPS = 3


def make_cfg(*layout, num_devices=8):
  return C.load_config(['tiny.gin'], [*MODEL, *layout], num_devices=num_devices)


def train_steps(cfg, devices):
  """STEPS steps of the real jitted program; returns losses, canonical params, program."""
  program = train.make_program(cfg, make_mesh(cfg.mesh, devices=devices))
  it = data_lib.make_train_iterator(cfg.data, cfg.train.global_batch_size)
  with program.context():
    state = program.init(jax.random.key(cfg.train.seed))
    losses = []
    for _ in range(STEPS):
      state, m = program.step(state, program.to_global(next(it)))
      losses.append(float(m['loss']))
  return losses, jax.device_get(program.canonical_params(state.params)), state


@pytest.fixture(scope='module', autouse=True)
def no_compilation_cache():
  """Compile for real: a cache hit would hide the partitioner's warnings."""
  before = jax.config.jax_enable_compilation_cache
  jax.config.update('jax_enable_compilation_cache', False)
  yield
  jax.config.update('jax_enable_compilation_cache', before)


@pytest.fixture(scope='module')
def reference():
  losses, params, _ = train_steps(make_cfg('MeshConfig.data = 1', num_devices=1), jax.devices()[:1])
  return losses, params


def assert_matches(reference, losses, params):
  ref_losses, ref_params = reference
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  assert len(flat) == len(jax.tree.leaves(ref_params))
  for (path, x), y in zip(flat, jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


LAYOUTS = {
    'data8': ['MeshConfig.data = 8'],
    'fsdp8': ['MeshConfig.data = 1', 'MeshConfig.fsdp = 8'],
    'data2_fsdp2_tensor2': ['MeshConfig.data = 2', 'MeshConfig.fsdp = 2', 'MeshConfig.tensor = 2'],
    'fsdp4_tensor2_sp': ['MeshConfig.data = 1', 'MeshConfig.fsdp = 4', 'MeshConfig.tensor = 2',
                         'MeshConfig.sequence_parallel = True'],
    'pipeline2_v2': ['MeshConfig.data = 4', 'MeshConfig.pipeline = 2', 'MeshConfig.virtual_stages = 2'],
    'pipeline4_v2': ['MeshConfig.data = 2', 'MeshConfig.pipeline = 4', 'MeshConfig.virtual_stages = 2',
                     'MeshConfig.microbatches = 4'],
    'data2_pipeline2_tensor2': ['MeshConfig.data = 2', 'MeshConfig.pipeline = 2', 'MeshConfig.tensor = 2',
                                'MeshConfig.virtual_stages = 2', 'MeshConfig.microbatches = 4'],
    'fsdp2_pipeline2_tensor2_sp': ['MeshConfig.data = 1', 'MeshConfig.fsdp = 2', 'MeshConfig.pipeline = 2',
                                   'MeshConfig.tensor = 2', 'MeshConfig.sequence_parallel = True'],
    'data8_grad_accum2': ['MeshConfig.data = 4', 'MeshConfig.fsdp = 2', 'TrainConfig.grad_accum_steps = 2'],
    # The parallel block's projections joined (inputs and outputs) and kept
    # apart, under tensor + sequence parallelism: kernels joined shard by shard.
    'fsdp4_tensor2_sp_joined': ['MeshConfig.data = 1', 'MeshConfig.fsdp = 4', 'MeshConfig.tensor = 2',
                                'MeshConfig.sequence_parallel = True', 'ModelConfig.fuse_projections = "all"'],
    # The interleaved 1F1B schedule: loss and gradients by the schedule itself.
    'pipeline4_v2_1f1b': ['MeshConfig.data = 2', 'MeshConfig.pipeline = 4', 'MeshConfig.virtual_stages = 2',
                          'MeshConfig.microbatches = 4', 'MeshConfig.pipeline_schedule = "1f1b"'],
    # fsdp spelled -1, "the rest" (2 here): read as its size, not as one
    # device (which left the embedding's backward where XLA cannot
    # partition it: an abort in the SPMD partitioner).
    'fsdp2_pipeline2_tensor2_sp_1f1b': ['MeshConfig.data = 1', 'MeshConfig.fsdp = -1', 'MeshConfig.pipeline = 2',
                                        'MeshConfig.tensor = 2', 'MeshConfig.sequence_parallel = True',
                                        'MeshConfig.virtual_stages = 2', 'MeshConfig.microbatches = 4',
                                        'MeshConfig.pipeline_schedule = "1f1b"'],
    'data2_pipeline2_tensor2_apart': ['MeshConfig.data = 2', 'MeshConfig.pipeline = 2', 'MeshConfig.tensor = 2',
                                      'MeshConfig.microbatches = 4', 'ModelConfig.fuse_projections = "none"'],
    # FSDP's weights gathered once a step (MeshConfig.fsdp_gather = 'step'):
    # every slice and micro-batch on the gathered copy, gradients summed on
    # each device and reduce-scattered once.
    'data2_fsdp4_grad_accum2_gather_once': ['MeshConfig.data = 2', 'MeshConfig.fsdp = 4',
                                            'TrainConfig.grad_accum_steps = 2', 'MeshConfig.fsdp_gather = "step"'],
    'data2_fsdp2_tensor2_grad_accum4_gather_once': ['MeshConfig.data = 2', 'MeshConfig.fsdp = 2',
                                                    'MeshConfig.tensor = 2', 'TrainConfig.grad_accum_steps = 4',
                                                    'MeshConfig.fsdp_gather = "step"'],
    'fsdp2_pipeline2_tensor2_sp_gather_once': ['MeshConfig.data = 1', 'MeshConfig.fsdp = 2', 'MeshConfig.pipeline = 2',
                                               'MeshConfig.tensor = 2', 'MeshConfig.sequence_parallel = True',
                                               'TrainConfig.grad_accum_steps = 2', 'MeshConfig.fsdp_gather = "step"'],
    'fsdp2_pipeline2_tensor2_sp_1f1b_gather_once': ['MeshConfig.data = 1', 'MeshConfig.fsdp = 2',
                                                    'MeshConfig.pipeline = 2', 'MeshConfig.tensor = 2',
                                                    'MeshConfig.sequence_parallel = True',
                                                    'MeshConfig.virtual_stages = 2', 'MeshConfig.microbatches = 4',
                                                    'MeshConfig.pipeline_schedule = "1f1b"',
                                                    'TrainConfig.grad_accum_steps = 2',
                                                    'MeshConfig.fsdp_gather = "step"'],
    # The GeLU MLP as one unit with its own backward (ModelConfig.gelu_epilogue),
    # traced outside the pipeline's forward, which takes 'data' out of the rules.
    'data2_pipeline2_tensor2_gelu_epilogue': ['MeshConfig.data = 2', 'MeshConfig.pipeline = 2',
                                              'MeshConfig.tensor = 2', 'MeshConfig.microbatches = 4',
                                              'ModelConfig.fuse_projections = "none"',
                                              'ModelConfig.gelu_epilogue = True'],
}


@pytest.mark.parametrize('name', list(LAYOUTS))
def test_layout_matches_one_device(reference, name, capfd):
  cfg = make_cfg(*LAYOUTS[name])
  losses, params, state = train_steps(cfg, jax.devices())
  assert_matches(reference, losses, params)
  # XLA's partitioner logs (C++ stderr) when it falls back to replicating a
  # tensor to change its sharding: a layout that does that wastes memory and
  # bandwidth even though the numbers come out right.
  assert 'Involuntary full rematerialization' not in capfd.readouterr().err
  # The layout is real: parameters are sharded the way the layout says.
  spec = state.params['layers']['block_0']['mlp']['wi']['kernel'].sharding.spec
  mesh = dict(cfg.mesh.__dict__)
  if mesh['pipeline'] > 1:
    assert spec[1] == 'pipeline', spec          # (repeat, stage, layers, embed, mlp)
  if mesh['tensor'] > 1:
    assert spec[-1] == 'tensor', spec
  if mesh['fsdp'] > 1:
    assert spec[-2] == 'fsdp', spec


def test_evaluation_takes_the_batch_in_the_training_steps_slices():
  # A batch taken in accumulation slices to fit the devices would not fit one
  # forward pass either: evaluation slices it the same way, with the same loss.
  devices = jax.devices()[:1]
  losses, compiled = {}, {}
  for k in (1, 4):
    cfg = make_cfg('MeshConfig.data = 1', f'TrainConfig.grad_accum_steps = {k}', num_devices=1)
    program = train.make_program(cfg, make_mesh(cfg.mesh, devices=devices))
    batch = program.to_global(next(data_lib.make_train_iterator(cfg.data, cfg.train.global_batch_size)))
    with program.context():
      params = program.init(jax.random.key(cfg.train.seed)).params
      losses[k] = float(program.eval_step(params, batch))
      compiled[k] = program.eval_step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes
  assert losses[4] == pytest.approx(losses[1], rel=1e-6)
  assert compiled[4] < 0.6 * compiled[1], compiled


def test_pipeline_layout_round_trips():
  from mjax.parallel.pipeline import from_pipeline_layout, to_pipeline_layout
  w = {'k': np.arange(8 * 3).reshape(8, 3)}
  p = to_pipeline_layout(w, stages=2, repeats=2)
  assert p['k'].shape == (2, 2, 2, 3)
  # Chunk c = repeat * stages + stage holds layers 2c, 2c + 1: stage 1 of
  # repeat 0 is chunk 1 (layers 2, 3); stage 0 of repeat 1 is chunk 2.
  np.testing.assert_array_equal(p['k'][0, 1], w['k'][2:4])
  np.testing.assert_array_equal(p['k'][1, 0], w['k'][4:6])
  np.testing.assert_array_equal(from_pipeline_layout(p)['k'], w['k'])


def test_bubble_fraction():
  from mjax.parallel.pipeline import bubble_fraction
  assert bubble_fraction(4, 2, 4) == 3 / 8
  assert bubble_fraction(8, 6, 16) == 7 / 96


@pytest.mark.parametrize('binding,needle', [
    (['MeshConfig.data = 4', 'MeshConfig.pipeline = 2', 'MeshConfig.virtual_stages = 3'], 'split evenly'),
    (['MeshConfig.data = 2', 'MeshConfig.pipeline = 4', 'MeshConfig.virtual_stages = 2',
      'MeshConfig.microbatches = 2'], 'at least as many micro-batches'),
    (['MeshConfig.data = 4', 'MeshConfig.tensor = 2', 'MeshConfig.sequence_parallel = True',
      'DataConfig.seq_len = 63', 'ModelConfig.sliding_window = 8'], 'seq_len = 63'),
    (['MeshConfig.data = 8', 'TrainConfig.grad_accum_steps = 4'], 'data x fsdp = 8'),
    (['MeshConfig.data = 2', 'MeshConfig.pipeline = 4', 'MeshConfig.microbatches = 6',
      'TrainConfig.global_batch_size = 12', 'MeshConfig.pipeline_schedule = "1f1b"'], 'groups of the 4 stages'),
    (['MeshConfig.data = 4', 'MeshConfig.pipeline = 2', 'MeshConfig.pipeline_schedule = "zb"'],
     "pipeline_schedule = 'zb'.*'circular', '1f1b'"),
])
def test_layout_errors(binding, needle):
  with pytest.raises(C.ConfigError, match=needle):
    make_cfg(*binding)


def test_a_slow_network_split_on_one_process_is_refused_by_name():
  """dcn_* > 1 needs as many processes (hosts) as their product: on one
  process it was jax's traceback ("Number of slices 1 must equal ..."),
  which the driver restarted as a crash."""
  cfg = C.load_config(['tiny.gin'], ['MeshConfig.dcn_data = 2', 'MeshConfig.data = 4'], num_devices=8).mesh
  with pytest.raises(C.ConfigError, match=r"MeshConfig.dcn_\* = \{'data': 2, .*their product \(2\) must equal "
                                          r'the number of processes \(hosts\) the mesh spans, 1.*On one process '
                                          r'leave them at 1'):
    make_mesh(cfg)


@pytest.mark.slow
def test_document_attention_on_a_pipeline_matches_one_device():
  """Segment ids and per-document positions travel through the pipeline's
  micro-batches exactly as through the plain layer stack."""
  doc = ['DataConfig.document_attention = True', 'ModelConfig.n_layers = 4']
  ref_losses, ref_params, _ = train_steps(make_cfg(*doc, 'MeshConfig.data = 1', num_devices=1),
                                          jax.devices()[:1])
  for schedule in ('circular', '1f1b'):
    cfg = make_cfg(*doc, 'MeshConfig.data = 2', 'MeshConfig.pipeline = 2', 'MeshConfig.tensor = 2',
                   'MeshConfig.virtual_stages = 2', 'MeshConfig.microbatches = 2',
                   f'MeshConfig.pipeline_schedule = "{schedule}"')
    losses, params, _ = train_steps(cfg, jax.devices())
    assert_matches((ref_losses, ref_params), losses, params)
  # (That the masks really separate documents is tested in test_attention.)


def _step_temp_bytes(*layout) -> int:
  from mjax.parallel.comm_report import memory_stats
  cfg = make_cfg(*layout)
  program = train.make_program(cfg, make_mesh(cfg.mesh, devices=jax.devices()))
  with program.context():
    compiled = program.step.lower(program.abstract_state(), program.abstract_batch()).compile()
  return memory_stats(compiled)['temp_size_in_bytes']


@pytest.mark.slow
def test_1f1b_activations_are_bounded_by_the_stages_not_the_microbatches():
  """Compiled step, p = 4, v = 2, 4 sequences per micro-batch: four times the
  micro-batches (and the batch) multiply the circular schedule's temporaries
  (every item's activations live until its backward), while 1F1B's grow only
  by the batch-sized ends (the embedding's input and cotangent)."""
  temp = {}
  for schedule in ('circular', '1f1b'):
    for m in (4, 16):
      temp[schedule, m] = _step_temp_bytes(
          'MeshConfig.data = 2', 'MeshConfig.pipeline = 4', 'MeshConfig.virtual_stages = 2',
          f'MeshConfig.microbatches = {m}', f'TrainConfig.global_batch_size = {4 * m}',
          'ModelConfig.remat_policy = "none"', f'MeshConfig.pipeline_schedule = "{schedule}"')
  assert temp['circular', 16] > 2.5 * temp['circular', 4], temp
  assert temp['1f1b', 16] < 0.3 * temp['circular', 16], temp
  assert temp['1f1b', 16] - temp['1f1b', 4] < 0.15 * (temp['circular', 16] - temp['circular', 4]), temp
