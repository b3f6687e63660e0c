"""Per-device memory estimate against arithmetic done by hand."""

import pytest

from mjax import config as C
from mjax.parallel.memory import activation_bytes_per_layer, estimate_memory, format_estimate

# d 128, 4 heads of 32, d_ff 256, vocab 384, 4 layers (2 scanned groups of 2),
# seq 64, global batch 16, bf16 activations, fp32 parameters, parallel block.
SMALL = ['ModelConfig.d_model = 128', 'ModelConfig.n_layers = 4', 'ModelConfig.d_ff = 256',
         'DataConfig.seq_len = 64', 'TrainConfig.global_batch_size = 16']
# Parameters: embedding 384*128 = 49152, final norm 2*128 = 256, per layer
# q/k/v/out 4*128*128 = 65536 + wi/wo 2*128*256 = 65536 + norm 256 = 131328.


def small(*extra):
  return C.load_config(['tiny.gin'], [*SMALL, *extra])


def test_data_fsdp_tensor_mesh_by_hand():
  est = estimate_memory(small(), {'data': 2, 'fsdp': 2, 'tensor': 2}, flash=False)
  # Per device: embedding (vocab/tensor, embed/fsdp) 49152/4; final norm
  # (embed/fsdp) 256/2; layer kernels (embed/fsdp, heads|mlp/tensor)
  # 4*131072/4; layer norms (embed/fsdp) 4*256/2.
  elems = 49152 / 4 + 256 / 2 + 4 * 131072 / 4 + 4 * 256 / 2
  assert est.get('parameters') == elems * 4
  assert est.get('gradients') == elems * 4
  assert est.get('LAMB moments') == elems * 8
  # FSDP: two gathered groups of 2 layers, bf16, kernels split over tensor.
  assert est.get('FSDP gather buffers') == 2 * 2 * (131072 / 2 + 256) * 2
  # The same groups when the layers are unrolled (each group its own subtree).
  unrolled = estimate_memory(small('ModelConfig.scan_layers = False'), {'data': 2, 'fsdp': 2, 'tensor': 2}, flash=False)
  assert unrolled.get('FSDP gather buffers') == est.get('FSDP gather buffers')
  # Activations: replica batch 16 / (2*2) = 4 sequences, s*b = 256, t = 2.
  sb, e = 64 * 4, 2
  norm = 2 * e * sb * 128 + 8 * sb                 # norm input + output, its fp32 mean and 1/std
  split = e * sb * (2 * 128 + 2 * 128) + 2 * e * sb * 256 + e * 4 * 64 * 64 * 4
  assert est.get('activations (layers)') == 4 * (norm + split / 2)
  assert est.get('logits') == 4 * 4 * 64 * 384 / 2
  assert est.total == pytest.approx(sum(r[1] for r in est.rows))
  assert est.info['micro_batch'] == 4 and est.info['in_flight'] == 1


def test_dots_policies_keep_the_layers_kernels_cast():
  # The 4 layers' kernels (4 * 131072 elements), bf16, on their fsdp x
  # tensor shards, under the dots policies and without remat (autodiff
  # keeps what the backward's products read); 'full', an fp32 model and
  # 1F1B (each chunk's forward runs again in its backward) keep no such copy.
  mesh = {'data': 2, 'fsdp': 2, 'tensor': 2}
  for policy in ('dots', 'none'):
    est = estimate_memory(small(f'ModelConfig.remat_policy = "{policy}"'), mesh, flash=False)
    assert est.get('weights kept cast') == 4 * 131072 / 4 * 2
  for other in (['ModelConfig.remat_policy = "full"'],
                ['ModelConfig.remat_policy = "dots"', 'ModelConfig.dtype = "float32"']):
    assert 'weights kept cast' not in [r[0] for r in estimate_memory(small(*other), mesh, flash=False).rows]
  one = estimate_memory(small('ModelConfig.remat_policy = "dots"'), {'pipeline': 2}, micro_batch=2, flash=False,
                        schedule='1f1b')
  assert 'weights kept cast' not in [r[0] for r in one.rows]


def test_fsdp_gathered_once_a_step_holds_the_weights_and_gradient_sums():
  # fsdp_gather = 'step': every weight gathered over fsdp (still split over
  # tensor) in bf16, norms fp32, and the gradients at the same size until
  # the one reduce-scatter; no per-group gather buffers or kept casts.
  mesh = {'data': 2, 'fsdp': 2, 'tensor': 2}
  matrices = 49152 / 2 + 4 * 131072 / 2          # embedding (vocab / tensor), layer kernels / tensor
  vectors = (256 + 4 * 256) * 4                  # final norm, layer norms: whole, fp32
  once = ['MeshConfig.fsdp_gather = "step"']
  # 2 slices (the replica batch of 4 in micro-batches of 2): a slice's
  # bf16 gradients, their fp32 sums and the bf16 copy reduce-scattered.
  est = estimate_memory(small(*once), mesh, micro_batch=2, flash=False)
  assert est.get('weights gathered for the step') == matrices * 2 + vectors
  assert est.get('gradients of a pass, gathered') == matrices * 2 + vectors
  assert est.get('gradient sums, gathered') == matrices * 4 + vectors
  assert est.get('gradients as reduce-scattered') == matrices * 2 + vectors
  rows = [r[0] for r in est.rows]
  assert 'FSDP gather buffers' not in rows and 'weights kept cast' not in rows
  # One pass: its gradients are what is reduce-scattered.
  single = [r[0] for r in estimate_memory(small(*once), mesh, flash=False).rows]
  assert 'gradient sums, gathered' not in single and 'gradients as reduce-scattered' not in single
  # The circular pipeline holds the gathered matrices in fp32: its scan sums
  # their gradients in their dtype. 1F1B keeps fp32 accumulators of its own.
  stage = 49152 + 4 * 131072 / 2
  stage_vectors = (256 + 4 * 256 / 2) * 4
  piped = estimate_memory(small(*once), {'fsdp': 2, 'pipeline': 2}, micro_batch=2, flash=False)
  assert piped.get('weights gathered for the step') == stage * 4 + stage_vectors
  one = estimate_memory(small(*once), {'fsdp': 2, 'pipeline': 2}, micro_batch=4, flash=False, schedule='1f1b')
  assert one.get('weights gathered for the step') == stage * 2 + stage_vectors
  assert one.get('1F1B gradient accumulators') == stage * 4 + stage_vectors
  # With accumulation slices too (2 micro-batches of 2, twice) 1F1B hands
  # back each slice's gradients in the weights' dtype: held in fp32.
  sliced = estimate_memory(small(*once), {'fsdp': 2, 'pipeline': 2}, micro_batch=2, flash=False, schedule='1f1b')
  assert sliced.get('weights gathered for the step') == stage * 4 + stage_vectors
  # Without fsdp there is nothing to gather.
  assert 'weights gathered for the step' not in [r[0] for r in estimate_memory(small(*once), {'data': 8}).rows]


def test_pipeline_stages_and_what_each_schedule_keeps():
  est = estimate_memory(small(), {'pipeline': 2}, micro_batch=2, flash=False, schedule='circular')
  # Layers split into 2 stages; embedding and final norm stay whole.
  assert est.get('parameters') == (49152 + 256 + 4 * 131328 / 2) * 4
  # 16 / 2 = 8 micro-batches of 2; the pipeline takes m = 2 (the stage
  # count, MeshConfig.microbatches' default) at a time, the other 6 are
  # accumulation slices after them. The circular schedule's autodiff keeps
  # all m of a slice, for each of the stage's 2 layers.
  assert (est.info['micro_batches'], est.info['in_flight'], est.info['layers_per_stage']) == (8, 2, 2)
  sb, e = 64 * 2, 2
  layer = 2 * e * sb * 128 + 8 * sb + e * sb * 512 + 2 * e * sb * 256 + e * 4 * 64 * 64 * 2
  assert est.get('activations (layers)') == 2 * layer * 2
  # Its head runs on the whole slice: m x 2 sequences of fp32 logits.
  assert est.get('logits') == 4 * (2 * 2) * 64 * 384
  wide = estimate_memory(small('MeshConfig.microbatches = 8'), {'pipeline': 2}, micro_batch=2, flash=False,
                         schedule='circular')
  assert wide.info['in_flight'] == 8 and wide.get('activations (layers)') == 2 * layer * 8
  # 1F1B with v = 2 chunks of one layer: at most min(2 v p, m v) = 4 chunk
  # inputs (one layer input each), one chunk recomputed, one micro-batch's logits.
  one = estimate_memory(small(), {'pipeline': 2}, micro_batch=2, flash=False, schedule='1f1b',
                        virtual_stages=2)
  assert one.info['in_flight'] == 4
  assert one.get('activations (layers)') == 4 * e * sb * 128
  assert one.get('activations (recompute)') == 1 * layer
  assert one.get('logits') == 4 * 2 * 64 * 384
  # The config's schedule and chunks are the defaults.
  cfg = small('MeshConfig.pipeline = 2', 'MeshConfig.virtual_stages = 2', 'MeshConfig.pipeline_schedule = "1f1b"')
  assert estimate_memory(cfg, {'pipeline': 2}, micro_batch=2, flash=False).rows == one.rows
  with pytest.raises(ValueError, match='virtual stages'):
    estimate_memory(small(), {'pipeline': 2}, micro_batch=2, schedule='1f1b', virtual_stages=3)


def test_print_config_estimates_the_pipeline_it_would_run(repo_root, capsys):
  # --print_config takes the micro-batches, chunks and schedule from the
  # config (the trainer's own), not the whole replica batch as one micro-batch.
  from mjax import cli
  out = {}
  for schedule in ('circular', '1f1b'):
    cli.train_main(['--gin_file', 'configs/tiny.gin', '--print_config', '--gin.ModelConfig.n_layers=16',
                    '--gin.MeshConfig.data=2', '--gin.MeshConfig.pipeline=4', '--gin.MeshConfig.virtual_stages=2',
                    '--gin.MeshConfig.microbatches=4', f'--gin.MeshConfig.pipeline_schedule={schedule}'])
    out[schedule] = capsys.readouterr().out
  # tiny: global batch 8 over data 2 -> 4 sequences per replica in 4 micro-batches of 1.
  for schedule, text in out.items():
    assert 'micro-batch 1 sequence(s) x 4 per replica per step, 4 layers/stage in 2 chunks' in text
    assert f'({schedule})' in text
  assert '4 micro-batch(es) in flight' in out['circular']
  assert '8 chunk inputs kept' in out['1f1b'] and 'one chunk of 2 layer(s) recomputed' in out['1f1b']


def test_remat_policies_keep_less():
  sb, e, h = 64 * 4, 2, 128
  full, working = activation_bytes_per_layer(small(), 4, 1, policy='full', flash=True)
  none, _ = activation_bytes_per_layer(small(), 4, 1, policy='none', flash=True)
  assert full == e * sb * h and working == none
  # dots_no_batch: layer input + q, k, v + MLP input projection + 2 output projections.
  dnb, _ = activation_bytes_per_layer(small(), 4, 1, policy='dots_no_batch', flash=True)
  # (And each norm's fp32 row mean and 1/std: 8 bytes per token.)
  assert dnb == e * sb * (h + 3 * h + 256 + 2 * h) + 8 * sb
  # Joined into one product, the two output projections are one partial sum.
  joined, _ = activation_bytes_per_layer(small('ModelConfig.fuse_projections = "all"'), 4, 1,
                                         policy='dots_no_batch', flash=True)
  assert joined == dnb - e * sb * h
  # dots also keeps the attention matmuls: fp32 scores and probs x V.
  dots, _ = activation_bytes_per_layer(small(), 4, 1, policy='dots', flash=False)
  assert dots == dnb + 4 * 4 * 64 * 64 * 4 + e * sb * h
  # dots_attention keeps flash attention's output and fp32 softmax statistics.
  da, _ = activation_bytes_per_layer(small(), 4, 1, policy='dots_attention', flash=True)
  assert da == dnb + e * sb * h + 4 * 4 * sb
  # dots_attention_mlp also keeps the MLP's activation (d_ff 256).
  dam, _ = activation_bytes_per_layer(small(), 4, 1, policy='dots_attention_mlp', flash=True)
  assert dam == da + e * sb * 256
  assert full < dnb < da < none and da < dam


def test_korthikanti_formula_without_dropout():
  """Sequential GeLU block, d_ff = 4h: s b h (10 + 24/t + 5as/(ht)) of
  Korthikanti et al. minus the dropout masks and outputs = s b h (8 + 24/t + 2as/(ht)),
  plus what the paper leaves out: each norm's fp32 row mean and 1/std (16 s b)."""
  cfg = C.load_config(['gpt3_175b.gin'], ['ModelConfig.block = "sequential"',
                                          'ModelConfig.remat_policy = "none"'])
  s, b, h, a = 2048, 1, 12288, 128
  for t in (1, 8):
    got, _ = activation_bytes_per_layer(cfg, b, t, flash=False)
    assert got == pytest.approx(s * b * h * (8 + 24 / t + 2 * a * s / (h * t)) + 16 * s * b)
  sp, _ = activation_bytes_per_layer(cfg, b, 8, flash=False, sequence_parallel=True)
  assert sp == pytest.approx((s * b * h * (8 + 24 + 2 * a * s / h) + 16 * s * b) / 8)


def test_bad_inputs_raise():
  with pytest.raises(ValueError, match='unknown mesh axes'):
    estimate_memory(small(), {'tensr': 2})
  with pytest.raises(ValueError, match='divisible'):
    estimate_memory(small(), {'data': 3})
  with pytest.raises(ValueError, match='micro-batch'):
    estimate_memory(small(), {'data': 2}, micro_batch=3)


@pytest.mark.parametrize('mesh,said', [
    ('data=0', 'each size a positive integer'), ('data=-1,fsdp=-1', 'each size a positive integer'),
    ('data=2,data=4', 'each axis once'), ('pipeline=3', 'must split evenly into pipeline'),
    ('tensor=7', 'divisible by the tensor-parallel size 7'), ('dat=2', "unknown axes ['dat']"),
    ('', "--mesh '': no axis given"), (' , ', "--mesh ' , ': no axis given")])
def test_report_memory_names_a_mesh_the_config_cannot_take(mesh, said, capsys):
  from mjax import report
  assert report.main(['memory', '--gin_file', 'configs/tiny.gin', '--mesh', mesh]) == 2
  assert said in capsys.readouterr().err
  assert report.main(['memory', '--gin_file', 'configs/tiny.gin', '--mesh', 'data=8', '--micro_batch', '-1']) == 2
  assert '--micro_batch -1' in capsys.readouterr().err
  for v in ('0', '-2'):   # 0 meant the config's value; -2 was "-4 chunks"
    assert report.main(['memory', '--gin_file', 'configs/tiny.gin', '--mesh', 'pipeline=2',
                        '--virtual_stages', v]) == 2
    assert f'--virtual_stages {v}: must be a positive integer' in capsys.readouterr().err
  assert report.main(['memory', '--gin_file', 'configs/tiny.gin', '--mesh', 'data=4,tensor=2']) == 0
  assert 'total' in capsys.readouterr().out


def test_report_memory_takes_the_configs_sequence_parallel_and_refuses_what_training_refuses(capsys):
  from mjax import report
  tiny = ['memory', '--gin_file', 'configs/tiny.gin']
  totals = []   # (7b: tiny's differ below the table's 0.01 GiB)
  for extra in (['--sequence_parallel'], ['--gin.MeshConfig.sequence_parallel=True'], []):
    assert report.main(['memory', '--gin_file', 'configs/7b.gin', '--mesh', 'data=8,tensor=8', *extra]) == 0
    totals.append(capsys.readouterr().out.splitlines()[-1])
  assert totals[0] == totals[1] != totals[2]
  for mesh, extra, said in (
      ('data=2,pipeline=2', ['--gin.MeshConfig.microbatches=3'], 'MeshConfig.microbatches = 3 does not divide the 4'),
      ('data=4,tensor=2', ['--gin.ModelConfig.vocab_size=385'], 'ModelConfig.vocab_size = 385 must be divisible'),
      ('fsdp=8', ['--gin.ModelConfig.d_model=252', '--gin.ModelConfig.n_heads=6'], 'd_model = 252 must be divisible'),
      ('data=4,tensor=2', ['--gin.DataConfig.seq_len=127', '--sequence_parallel'], 'seq_len = 127 must be divisible')):
    assert report.main([*tiny, '--mesh', mesh, *extra]) == 2
    assert said in capsys.readouterr().err


def test_the_estimate_says_1_device_and_8_devices():
  # --print_config on one device said "(1 devices)".
  assert '(1 device), ' in format_estimate(estimate_memory(small(), {'data': 1}))
  assert '(8 devices), ' in format_estimate(estimate_memory(small(), {'data': 8}))
