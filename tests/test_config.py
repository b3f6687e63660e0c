"""Config loading, overrides and the promised error messages."""

import json
import os
import subprocess
import sys

import pytest

from mjax import config as C
from mjax import flags


def load(*bindings, files=('tiny.gin',), num_devices=8):
  return flags.load(list(files), list(bindings), num_devices=num_devices)


def test_tiny_loads_with_base_include():
  cfg = load()
  assert cfg.model.d_model == 256 and cfg.data.seq_len == 128
  # Values from base.gin arrive through the include.
  assert cfg.model.block == 'parallel' and cfg.optim.b2 == 0.95


def test_both_override_forms_and_later_wins(capsys):
  parser = flags.parser('t', 't')
  args, bindings = flags.parse(parser, [
      '--gin_file', 'tiny.gin', '--gin_param', 'TrainConfig.steps = 30',
      '--gin.TrainConfig.steps=31', '--gin.DataConfig.source=stdlib',
      '--gin.ModelConfig.sliding_window', '32', '--gin.ModelConfig.n_kv_heads=None',
      '--gin.OptimConfig.learning_rate=1e-3'])
  cfg = C.load_config(args.gin_file, bindings, num_devices=8)
  assert cfg.train.steps == 31
  assert cfg.model.sliding_window == 32   # `--gin.KEY VALUE` form
  assert cfg.model.n_kv_heads is None
  assert cfg.optim.learning_rate == 1e-3
  assert cfg.data.source == 'stdlib'   # bare word taken as a string
  # The last one on the command line wins, whichever form it is in (a
  # --gin_param after a --gin. override is not overridden by it).
  for argv, steps in ((['--gin.TrainConfig.steps=5', '--gin_param', 'TrainConfig.steps = 10'], 10),
                      (['--gin_param=TrainConfig.steps = 10', '--gin.TrainConfig.steps', '5'], 5),
                      (['--gin.TrainConfig.steps=5', '--gin_param=TrainConfig.steps = 7',
                        '--gin.TrainConfig.steps=6'], 6)):
    _, bindings = flags.parse(flags.parser('t', 't'), argv)
    assert C.load_config(['tiny.gin'], bindings, num_devices=8).train.steps == steps, argv
  with pytest.raises(SystemExit):
    flags.parse(flags.parser('t', 't'), ['--gin.TrainConfig.steps=5', '--stepz', '3'])
  # An empty value (an unset variable) is named, not gin's 'Unable to parse value'.
  for argv in (['--gin.DataConfig.source='], ['--gin.DataConfig.source', ' ']):
    with pytest.raises(SystemExit):
      flags.parse(flags.parser('t', 't'), argv)
    assert 'DataConfig.source has an empty value' in capsys.readouterr().err
  _, bindings = flags.parse(flags.parser('t', 't'), ["--gin.DataConfig.file_pattern=''"])
  assert bindings == ["DataConfig.file_pattern = ''"]
  # From Python: numbers and path objects as a shell would pass them.
  import pathlib
  args, bindings = flags.parse(flags.parser('t', 't'), ['--gin_file', pathlib.Path('tiny.gin'), '--gin.TrainConfig.steps', 7])
  assert args.gin_file == ['tiny.gin'] and bindings == ['TrainConfig.steps = 7']


def test_ints_accepted_for_floats():
  cfg = load('OptimConfig.learning_rate = 1')
  assert isinstance(cfg.optim.learning_rate, float)


def test_resolved_config_round_trips(tmp_path):
  cfg = load('TrainConfig.steps = 7', 'ModelConfig.n_kv_heads = 2')
  C.write(cfg, str(tmp_path))
  again = C.load_config([str(tmp_path / 'config.gin')], [], num_devices=8)
  assert again == cfg
  assert json.loads((tmp_path / 'config.json').read_text())['train']['steps'] == 7


@pytest.mark.parametrize('binding,needles', [
    ('ModelConfig.d_modle = 3', ["'d_modle'", 'Did you mean ModelConfig.d_model']),
    ('ModelConfg.d_model = 3', ["'ModelConfg'", 'Did you mean ModelConfig']),
    ('TrainConfig.steps = "ten"', ['TrainConfig.steps', "'ten'", 'an int']),
    ('ModelConfig.block = "serial"', ['ModelConfig.block', "'parallel', 'sequential'"]),
    ('ModelConfig.n_heads = 3', ['ModelConfig.n_heads = 3', 'd_model = 256', 'divisors']),
    ('ModelConfig.n_kv_heads = 3', ['ModelConfig.n_kv_heads = 3', 'n_heads = 4']),
    ('ModelConfig.sliding_window = 129', ['sliding_window = 129', 'seq_len = 128']),
    ('ModelConfig.sliding_window = 0', ['sliding_window = 0']),
    ('ModelConfig.full_attention_every = 3', ['full_attention_every = 3', 'n_layers = 4']),
    ('TrainConfig.global_batch_size = 12', ['global_batch_size = 12', 'data x fsdp = 8']),
    ('MeshConfig.data = 3', ['multiply to 3', '8 devices']),
    ('MeshConfig.tensor = 8', ['n_heads', 'tensor-parallel size 8']),
    ('ModelConfig.vocab_size = 200', ['vocab_size = 200', '258']),
    ('DataConfig.source = "/no/such/dir"', ['/no/such/dir', 'existing file or directory']),
    ('OptimConfig.b2 = 1.5', ['OptimConfig.b2 = 1.5', '[0, 1)']),
    ('ModelConfig.rotary_fraction = 0.3', ['rotary_fraction = 0.3', 'even number', 'int(head_dim x fraction) = 19']),
    ('FaultConfig.heartbeat_interval_s = 1e-9', ['heartbeat_interval_s = 1e-09', 'at least 0.01 seconds']),
    # One that rotates no dim would train a model without positions.
    ('ModelConfig.rotary_fraction = 0.01', ['rotary_fraction = 0.01', 'at least 2', 'int(head_dim x fraction) = 0']),
    ('ModelConfig.parallel_norms = "two"', ['ModelConfig.parallel_norms', "'shared', 'separate'"]),
    ("OptimConfig.learning_rate = float('nan')", ["float('nan')", 'an expression, not a literal']),
    ('DataConfig.seq_len = 0', ['DataConfig.seq_len = 0']),
    ('ModelConfig.d_model = 100000000000', ['ModelConfig.d_model = 100000000000', '2**31 - 1']),
    ('DataConfig.seq_len = 4294967296', ['DataConfig.seq_len = 4294967296', '32-bit']),
    # Bindings gin accepts and mjax would never read.
    ('steps = 30', ["'steps' = 30", 'gin macro that nothing refers to', 'e.g. TrainConfig.steps']),
    ('ModelConfig = 3', ["'ModelConfig' = 3", 'e.g. ModelConfig.<field>']),
    ('big/ModelConfig.d_model = 8', ['big/ModelConfig.d_model', 'scoped binding']),
    ('OptimConfig.learning_rate = 1e999', ['OptimConfig.learning_rate = inf', 'a finite float']),
    ('FaultConfig.collective_timeout_s = -1e400', ['collective_timeout_s = -inf', 'a finite float']),
    ('MeshConfig.pipeline_schedule = "bogus"', ["'bogus'", "'circular', '1f1b'"]),
    ('MeshConfig.fsdp_gather = "once"', ["'once'", "'pass', 'step'"]),
    # A prime model width: its divisors, found at once.
    ('ModelConfig.d_model = 2147483647', ['d_model = 2147483647', 'divisors: 1, 2147483647)']),
    ('TrainConfig.seed = 9223372036854775808', ['seed = 9223372036854775808', 'a 64-bit integer']),
    ('TrainConfig.steps = 99999999999999999999999', ['steps = 99999999999999999999999', 'below 2**31']),
    ('FaultConfig.loss_spike_factor = 0.5', ['loss_spike_factor = 0.5', 'greater than 1']),
    ('TrainConfig.skip_batches = 1000000000000000000000', ['skip_batches = 1000000000000000000000', '2**62 rows']),
    ('TrainConfig.xla_extra_flags = "--xla_foo=\'b"', ['xla_extra_flags', 'No closing quotation']),
    ('ModelConfig.mlp = "swiglu"\nModelConfig.gelu_epilogue = True',
     ['ModelConfig.gelu_epilogue = True', "ModelConfig.mlp = 'swiglu' has none"]),
    ('ModelConfig.gelu_backward_kernel = True',
     ['ModelConfig.gelu_backward_kernel = True', 'needs gelu_epilogue = True']),
    # -1 is "the rest" for the batch axes only: a -1 stage or tensor count
    # read as one device turned pipelining (or collective matmul) off.
    ('MeshConfig.data = 4\nMeshConfig.pipeline = -1', ['MeshConfig.pipeline = -1', 'MeshConfig.data or fsdp',
                                                       'splits the layers into stages']),
    ('MeshConfig.data = 2\nMeshConfig.tensor = -1', ['MeshConfig.tensor = -1', 'MeshConfig.data or fsdp']),
    # Weights split along a vocabulary or width the mesh does not divide.
    ('MeshConfig.data = 2\nMeshConfig.tensor = 4\nModelConfig.vocab_size = 258',
     ['ModelConfig.vocab_size = 258', 'tensor-parallel size 4', '512 is a multiple of 128 x 4']),
    ('MeshConfig.data = 1\nMeshConfig.fsdp = 8\nModelConfig.d_model = 132\nModelConfig.n_heads = 2',
     ['ModelConfig.d_model = 132', 'FSDP size 8']),
    ('TrainConfig.xla_extra_flags = "xla_gpu_enable_latency_hiding_scheduler=false"',
     ["'xla_gpu_enable_latency_hiding_scheduler=false' is not", '--name or --name=value']),
    # Finite, but inf or 0 as the 32-bit floats the model and optimizer use:
    # trained without positions, to a nan loss, or without learning.
    ('ModelConfig.rope_theta = 1e300', ['ModelConfig.rope_theta = 1e+300', '32-bit float', 'would be inf']),
    ('ModelConfig.rope_theta = 1e-320', ['ModelConfig.rope_theta = 1e-320', 'would be 0']),
    ('ModelConfig.init_std = 1e300', ['ModelConfig.init_std = 1e+300', 'would be inf']),
    ('ModelConfig.norm_eps = 1e39', ['ModelConfig.norm_eps = 1e+39', 'would be inf']),
    ('OptimConfig.learning_rate = 1e300', ['OptimConfig.learning_rate = 1e+300', 'would be inf']),
    ('OptimConfig.eps = 1e300', ['OptimConfig.eps = 1e+300', 'would be inf']),
    ('OptimConfig.clip_norm = 1e-320', ['OptimConfig.clip_norm = 1e-320', 'would be 0', '(or 0: off)']),
    ('OptimConfig.weight_decay = 1e300', ['OptimConfig.weight_decay = 1e+300', 'would be inf']),
    # The warm-up clips the int32 step counter to it.
    ('OptimConfig.warmup_steps = 1000000000000', ['warmup_steps = 1000000000000', 'below 2**31']),
    # A path with a NUL was a ValueError traceback where it was first opened.
    ('CheckpointConfig.directory = "ck\\x00pt"', ["CheckpointConfig.directory = 'ck\\x00pt'", 'NUL character']),
    ('TrainConfig.compilation_cache_dir = "\\x00"', ['TrainConfig.compilation_cache_dir', 'NUL character']),
    # A quoting slip made a folder named with the spaces, and the run wrote there.
    ('CheckpointConfig.directory = " "', ["CheckpointConfig.directory = ' ' is only whitespace", 'quoting slip']),
    ('TrainConfig.compilation_cache_dir = "/tmp/cache "', ["'/tmp/cache ' begins or ends with whitespace"]),
    ('TrainConfig.peak_cache_dir = ""', ["TrainConfig.peak_cache_dir = ''", 'the directory the run was started in']),
    # head_dim comes from d_model / n_heads: those are what to change.
    ('ModelConfig.d_model = 260', ['ModelConfig.d_model = 260', 'n_heads = 4', 'heads of 65 dims']),
    # grain reads them all before the first batch: 10**12 never started.
    ('DataConfig.prefetch = 1000000000000', ['DataConfig.prefetch = 1000000000000', 'at most 1,024 batches']),
    # Past a date's range, past jax's 32-bit count of seconds: tracebacks at
    # the first save, and as a multi-process job formed.
    ('CheckpointConfig.io_timeout_s = 1e12', ['CheckpointConfig.io_timeout_s = 1000000000000.0', 'below 2**31 seconds']),
    ('FaultConfig.collective_timeout_s = 1e12', ['FaultConfig.collective_timeout_s = 1000000000000.0',
                                                 'below 2**31 seconds', '32-bit count of seconds']),
])
def test_bad_values_name_key_value_and_allowed(binding, needles):
  with pytest.raises(C.ConfigError) as e:
    load(binding)
  msg = str(e.value)
  for n in needles:
    assert n in msg, (n, msg)
  assert '\n' not in msg  # one paragraph


def test_a_mesh_for_one_device_says_1_device():
  with pytest.raises(C.ConfigError) as e:
    C.resolve_mesh_shape(C.MeshConfig(data=2, fsdp=1), 1)
  assert 'but there is 1 device per slice (1 device / DCN 1); make the product 1' in str(e.value), str(e.value)
  with pytest.raises(C.ConfigError) as e:
    C.resolve_mesh_shape(C.MeshConfig(data=-1, fsdp=2), 1)
  assert 'does not divide the 1 device per slice' in str(e.value), str(e.value)


def test_a_warm_up_as_long_as_the_run_is_warned_of():
  (note,) = C.doubtful(C.load_config(['tiny.gin'], ['TrainConfig.steps = 2', 'OptimConfig.warmup_steps = 100',
                                                    'OptimConfig.learning_rate = 1e-3']))
  assert note.startswith('OptimConfig.warmup_steps = 100 is not below TrainConfig.steps = 2') and \
      'ends at 1e-05, not OptimConfig.learning_rate = 0.001' in note, note
  assert C.doubtful(C.load_config(['tiny.gin'], ['TrainConfig.steps = 200'])) == []


@pytest.mark.parametrize('binding,said', [
    ('ModelConfig.remat_policy = "dot"', "Did you mean 'dots'?"),
    ('MeshConfig.pipeline_schedule = "1F1B"', "Did you mean '1f1b'?"),
    ('ModelConfig.dtype = "bf16"', "Did you mean 'bfloat16'?")])
def test_a_misspelt_choice_names_the_nearest_one(binding, said):
  with pytest.raises(C.ConfigError, match='has the wrong type or value; allowed: one of') as e:
    C.load_config(['tiny.gin'], [binding])
  assert str(e.value).endswith(said), str(e.value)


def test_pipeline_micro_batches_without_a_pipeline_are_warned_of():
  (note,) = C.doubtful(C.load_config(['tiny.gin'], ['TrainConfig.steps = 200', 'MeshConfig.microbatches = 4']))
  assert note.startswith('MeshConfig.microbatches = 4 does nothing here') and 'TrainConfig.grad_accum_steps' in note
  assert C.doubtful(C.load_config(['tiny.gin'], ['TrainConfig.steps = 200', 'MeshConfig.microbatches = 2',
                                                 'MeshConfig.pipeline = 2', 'MeshConfig.data = 4'],
                                  num_devices=8)) == []


def test_sequence_parallelism_without_tensor_parallelism_is_warned_of():
  (note,) = C.doubtful(C.load_config(['tiny.gin'], ['TrainConfig.steps = 200', 'MeshConfig.sequence_parallel = True',
                                                    'MeshConfig.tensor = 1']))
  assert note.startswith('MeshConfig.sequence_parallel = True does nothing here') and 'tensor = 1' in note, note
  assert C.doubtful(C.load_config(['tiny.gin'], ['TrainConfig.steps = 200', 'MeshConfig.sequence_parallel = True',
                                                 'MeshConfig.tensor = 2', 'MeshConfig.data = 4'],
                                  num_devices=8)) == []


def test_a_gelu_epilogue_that_cannot_fuse_is_warned_of():
  for binding, says in (('ModelConfig.fuse_projections = "inputs"', "joins the MLP's input product"),
                        ('ModelConfig.gelu_approximate = False', 'the exact (erf) GeLU')):
    (note,) = C.doubtful(C.load_config(['1p3b.gin'], [binding], num_devices=1))
    assert note.startswith('ModelConfig.gelu_epilogue = True does nothing here') and says in note, note
  # 'auto' leaves the GPU's products apart: nothing to say.
  assert C.doubtful(C.load_config(['1p3b.gin'], [], num_devices=1)) == []
  # The backward's kernel runs on one GPU only.
  (note,) = C.doubtful(C.load_config(['1p3b.gin'], ['ModelConfig.gelu_backward_kernel = True', 'MeshConfig.data = 8'],
                                     num_devices=8))
  assert note.startswith('ModelConfig.gelu_backward_kernel = True does nothing here: the mesh has several'), note
  assert C.doubtful(C.load_config(['1p3b.gin'], ['ModelConfig.gelu_backward_kernel = True', 'MeshConfig.data = 1'],
                                  num_devices=1)) == []
  (note,) = C.doubtful(C.load_config(['1p3b.gin'], ['ModelConfig.gelu_backward_kernel = True',
                                                    'ModelConfig.remat_policy = "none"'], num_devices=1))
  assert "remat_policy = 'none' keeps GeLU(u)" in note, note


def test_pipelining_a_config_that_unrolls_its_layers_says_how():
  """125m.gin and 1p3b.gin unroll their layers (the fastest on one GPU);
  pipelining them is refused with the binding that allows it."""
  bindings = ['MeshConfig.data = 2', 'MeshConfig.pipeline = 4', 'ModelConfig.n_layers = 16']
  for gin_file in ('125m.gin', '1p3b.gin'):
    with pytest.raises(C.ConfigError, match=r'ModelConfig.scan_layers = False is not allowed: pipeline '
                                            r'parallelism needs scanned layers; add '
                                            r'--gin.ModelConfig.scan_layers=True'):
      C.load_config([gin_file], bindings, num_devices=8)
    assert C.load_config([gin_file], [*bindings, 'ModelConfig.scan_layers = True'],
                         num_devices=8).mesh.pipeline == 4


def test_macros_work_as_in_gin(tmp_path):
  f = tmp_path / 'm.gin'
  f.write_text("include 'tiny.gin'\nWIDTH = 192\nFF = %WIDTH\nUNUSED = 3\nModelConfig.d_model = %WIDTH\n"
               "ModelConfig.d_ff = %FF\ns/STEPS = 7\nTrainConfig.steps = %s/STEPS\n")
  cfg = C.load_config([str(f)], ['WIDTH = 128'])
  assert (cfg.model.d_model, cfg.model.d_ff, cfg.train.steps) == (128, 128, 7)
  # A field a file sets through a macro, overridden by a later file or on
  # the command line: the file's macro is then unused, as gin allows.
  later = tmp_path / 'later.gin'
  later.write_text('ModelConfig.d_model = 512\n')
  assert C.load_config([str(f), str(later)], []).model.d_model == 512
  assert C.load_config([str(f)], ['ModelConfig.d_model = 256']).model.d_model == 256
  loop = tmp_path / 'loop.gin'
  loop.write_text("include 'loop.gin'\n")
  with pytest.raises(C.ConfigError, match="loop.gin: its includes never end"):
    C.load_config([str(loop)], [])
  # Nesting, not an include, is what recursed: said so, and the value is not echoed whole.
  deep = 'TrainConfig.wandb_project = ' + '[' * 3000 + ']' * 3000
  (tmp_path / 'deep.gin').write_text(deep + '\n')
  with pytest.raises(C.ConfigError, match=r'deep.gin: a value is nested too deeply to be read'):
    C.load_config([str(tmp_path / 'deep.gin')], [])
  (tmp_path / 'top.gin').write_text("include 'deep.gin'\n")     # through an include: still no loop
  with pytest.raises(C.ConfigError, match=r'a value is nested too deeply to be read'):
    C.load_config([str(tmp_path / 'top.gin')], [])
  with pytest.raises(C.ConfigError, match=r'the value is nested too deeply to be read') as e:
    C.load_config(['tiny.gin'], [deep])
  assert len(str(e.value)) < 600 and '...(5' in str(e.value)
  # A macro used but never defined: gin said a function `macro` lacked an argument.
  undefined = tmp_path / 'undefined.gin'
  undefined.write_text("include 'tiny.gin'\nModelConfig.d_model = %DMODEL\n")
  with pytest.raises(C.ConfigError, match=r'the gin macro %DMODEL is used but never defined'):
    C.load_config([str(undefined)], [])


def test_missing_gin_file_lists_bundled_configs(tmp_path):
  with pytest.raises(C.ConfigError, match='no such file.*tiny.gin'):
    C.load_config(['no_such.gin'], [])
  with pytest.raises(C.ConfigError, match=f"--gin_file '{tmp_path}': a directory. .*tiny.gin"):
    C.load_config([str(tmp_path)], [])
  with pytest.raises(C.ConfigError, match="--gin_file '/dev/null': not a regular file"):
    C.load_config(['/dev/null'], [])


def test_the_readmes_configs_path_finds_the_bundled_config_from_anywhere(tmp_path, monkeypatch):
  # `--gin_file configs/tiny.gin`, as the README writes it, typed outside the checkout.
  monkeypatch.chdir(tmp_path)
  assert C.load_config(['configs/tiny.gin'], []) == C.load_config(['tiny.gin'], [])
  with pytest.raises(C.ConfigError, match="'configs/no_such.gin': no such file"):
    C.load_config(['configs/no_such.gin'], [])


def test_a_missing_include_with_a_folder_is_said_with_where_it_was_searched(tmp_path, monkeypatch):
  # gin also looks for 'folder/file.gin' as a file of a Python package; a
  # folder on sys.path without __init__.py (the checkout's configs/ where the
  # repository is on PYTHONPATH) made that look-up fail with "expected str,
  # bytes or os.PathLike object, not NoneType" instead of saying the file
  # is not there.
  (tmp_path / 'nspkg').mkdir()
  monkeypatch.syspath_prepend(str(tmp_path))
  (tmp_path / 'x').mkdir()
  top = tmp_path / 'x' / 'my2.gin'
  top.write_text("include 'nspkg/tiny.gin'\n")
  with pytest.raises(C.ConfigError) as e:
    C.load_config([str(top)], [])
  msg = str(e.value)
  assert 'Unable to open file: nspkg/tiny.gin. Searched config paths: [' in msg and str(tmp_path / 'x') in msg, msg
  assert 'NoneType' not in msg and '\n' not in msg, msg
  # A file there is still found, through the search path of the including file.
  (tmp_path / 'x' / 'nspkg').mkdir()
  (tmp_path / 'x' / 'nspkg' / 'tiny.gin').write_text("include 'tiny.gin'\nTrainConfig.steps = 7\n")
  assert C.load_config([str(top)], []).train.steps == 7


def test_cli_error_exits_2_without_traceback(repo_root, tmp_path):
  bad = tmp_path / 'bad.gin'
  bad.write_text("include 'tiny.gin'\nModelConfig.n_heads = 6\n")
  proc = subprocess.run(
      [sys.executable, '-m', 'mjax.cli', '--gin_file', str(bad), '--workdir', str(tmp_path / 'w')],
      capture_output=True, text=True, cwd=repo_root, timeout=120)
  assert proc.returncode == 2
  assert 'Traceback' not in proc.stderr
  assert 'mjax-train: error: ModelConfig.n_heads = 6' in proc.stderr
  assert not (tmp_path / 'w').exists()  # nothing started, nothing written


def test_report_names_a_subcommand_it_does_not_have(capsys):
  from mjax import report
  assert report.main(['checkpont', 'runs/x']) == 2
  err = capsys.readouterr().err
  assert err.startswith("mjax-report: error: no subcommand 'checkpont' (did you mean 'checkpoint'?); one of ")
  assert 'usage' in err.lower()
  assert report.main([]) == 2 and 'error' not in capsys.readouterr().err   # no subcommand: the usage alone
  assert report.main(['--help']) == 0 and 'error' not in capsys.readouterr().out


def test_report_config_prints_the_resolved_config_that_reloads_the_same(tmp_path, capsys):
  from mjax import report
  assert report.main(['config', '--gin_file', 'tiny.gin', '--gin.TrainConfig.steps=7']) == 0
  text = capsys.readouterr().out
  assert 'TrainConfig.steps = 7' in text and 'ModelConfig.d_model = 256' in text
  (tmp_path / 'resolved.gin').write_text(text)
  assert C.load_config([str(tmp_path / 'resolved.gin')], []) == load('TrainConfig.steps = 7', num_devices=None)
  assert report.main(['config', '--gin.TrainConfig.stepz=7']) == 2
  assert 'Did you mean TrainConfig.steps?' in capsys.readouterr().err
  # A mesh given in full is checked as mjax-train checks it ("validated",
  # its help says): it printed a batch that cannot be split over it.
  assert report.main(['config', '--gin_file', 'tiny.gin', '--gin.TrainConfig.global_batch_size=7',
                      '--gin.MeshConfig.data=2', '--gin.MeshConfig.fsdp=1']) == 2
  assert 'global_batch_size = 7 is not allowed: must be divisible by the batch-parallel size' in \
      capsys.readouterr().err


def test_train_print_config_validates_and_starts_nothing(repo_root, tmp_path, capsys):
  from mjax import cli
  cli.train_main(['--gin_file', 'configs/tiny.gin', '--print_config', '--workdir', str(tmp_path / 'run'),
                  '--gin.MeshConfig.data=2', '--gin.MeshConfig.fsdp=4', '--gin.ModelConfig.d_model=192'])
  out = capsys.readouterr().out
  cfg = C.load_config([], [line for line in out.splitlines() if line and not line.startswith('#')])
  assert cfg.model.d_model == 192 and cfg.mesh.fsdp == 4
  assert 'M parameters' in out and 'GFLOP per token' in out
  assert "mesh {'data': 2, 'fsdp': 4, 'tensor': 1, 'pipeline': 1}" in out and 'LAMB moments' in out
  assert not (tmp_path / 'run').exists()   # nothing written
  assert '# warning:' not in out
  # The warnings a start prints, as comments (the output stays gin).
  cli.train_main(['--gin_file', 'configs/tiny.gin', '--print_config', '--gin.MeshConfig.microbatches=4'])
  out = capsys.readouterr().out
  assert '\n# warning: MeshConfig.microbatches = 4 does nothing here' in out, out[-2000:]
  C.load_config([], [line for line in out.splitlines() if line and not line.startswith('#')])
  # A mesh that does not fit the devices is refused like a real start would be.
  with pytest.raises(SystemExit) as e:
    cli.train_main(['--gin_file', 'configs/tiny.gin', '--print_config', '--gin.MeshConfig.data=3'])
  assert e.value.code == 2 and 'MeshConfig' in capsys.readouterr().err


def test_train_print_config_refuses_what_a_start_refuses(repo_root, capsys):
  # It printed, exit 0, configs that training refuses at start-up before
  # reading anything: a mixture naming a source twice, cuDNN attention on CPU.
  from mjax import cli
  for binding, said in (("--gin.DataConfig.mixture='stdlib:0.5,stdlib:0.5'", "names the source 'stdlib' twice"),
                        ("--gin.ModelConfig.attention_impl='cudnn'", "attention_impl = 'cudnn' is not allowed")):
    with pytest.raises(SystemExit) as e:
      cli.train_main(['--gin_file', 'configs/tiny.gin', '--print_config', binding])
    captured = capsys.readouterr()
    assert e.value.code == 2 and said in captured.err and 'parameters' not in captured.out


def test_train_refuses_an_empty_or_remote_workdir(tmp_path, monkeypatch, capsys):
  # An unset shell variable made it train into runs/<config> of the current directory.
  from mjax.cli import train_main
  monkeypatch.chdir(tmp_path)
  for workdir, said in (('', "--workdir '': empty"), ('gs://bucket/run', 'a URL')):
    with pytest.raises(SystemExit) as e:
      train_main(['--gin_file', 'tiny.gin', '--workdir', workdir])
    assert e.value.code == 2 and said in capsys.readouterr().err
  assert os.listdir(tmp_path) == []


def test_a_runs_own_config_gin_goes_on_in_that_run(tmp_path, monkeypatch, capsys):
  # The README resumes a run with `--gin_file runs/pp/config.gin`; without
  # --workdir that started a new run in runs/config.
  from mjax.cli import default_workdir
  monkeypatch.chdir(tmp_path)
  assert default_workdir(['configs/tiny.gin']) == os.path.join('runs', 'tiny')
  run = tmp_path / 'runs' / 'pp'
  run.mkdir(parents=True)
  (run / 'config.gin').write_text('')
  # Not a run's workdir (no config.json of a run): a gin file like any other.
  assert default_workdir(['runs/pp/config.gin']) == os.path.join('runs', 'config')
  (run / 'config.json').write_text('{"model": {}, "checkpoint": {}}')
  assert default_workdir(['runs/pp/config.gin']) == 'runs/pp'
  assert 'the run whose config.gin this is' in capsys.readouterr().out


@pytest.fixture
def foreground():
  """Ctrl-C and SIGTERM as a tool started from a terminal has them. A
  background job of a non-interactive shell (`cmd &`, as CI scripts start
  the suite) inherits Ctrl-C ignored, which a tool rightly leaves so.
  Yields the lines a Python child runs first to have them too (not a
  preexec_fn: a fork of this process, whose JAX threads run, can deadlock)."""
  import signal
  old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
  signal.signal(signal.SIGINT, signal.default_int_handler)
  signal.signal(signal.SIGTERM, signal.SIG_DFL)
  yield ('import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n'
         'signal.signal(signal.SIGTERM, signal.SIG_DFL)\n')
  for sig, was in old.items():
    signal.signal(sig, was)


def test_a_tool_stopped_by_a_signal_cleans_up_and_says_so(capsys, foreground):
  # Ctrl-C and SIGTERM unwind the tool (its clean-ups run) and end it with
  # one line and a documented status; before, SIGTERM killed a tool without
  # a word or its clean-ups (a half shard directory, a temporary file).
  import signal
  import time
  from mjax import cli, protocol
  for sig, status, said in ((signal.SIGTERM, protocol.EXIT_TERMINATED, 'terminated'),
                            (signal.SIGINT, protocol.EXIT_INTERRUPTED, 'interrupted')):
    cleaned = []

    @cli.entry_point('mjax-tool')
    def main(argv):
      try:
        signal.raise_signal(sig)
        time.sleep(30)
      finally:
        cleaned.append(True)
    before = signal.getsignal(sig)
    with pytest.raises(SystemExit) as e:
      main([])
    assert e.value.code == status and cleaned == [True] and f'mjax-tool: {said}' in capsys.readouterr().err
    assert signal.getsignal(sig) is before


def test_a_tool_that_loses_the_interrupt_still_ends(capsys, foreground):
  # Python drops an exception raised inside a garbage-collector callback
  # (JAX registers one): the tool ran on to the end. The signal watch ends
  # it after the grace, with the same line and status.
  import signal
  code = ('import sys, time\nfrom mjax import cli\ncli.GRACE_S = 1.0\n'
          '@cli.entry_point("mjax-tool")\ndef main(argv):\n  print("ready", flush=True)\n'
          '  while True:\n    try:\n      time.sleep(60)\n    except KeyboardInterrupt:\n      pass\nmain()\n')
  for sig, status, said in ((signal.SIGTERM, 143, 'terminated'), (signal.SIGINT, 130, 'interrupted')):
    proc = subprocess.Popen([sys.executable, '-c', foreground + code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == 'ready\n'
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == status and f'mjax-tool: {said}' in err, err
  # A tool that ran on to its end after the lost exception exited 0, as if
  # never stopped (seen in mjax-prepare and mjax-export): it ends as stopped.
  import time
  from mjax import cli

  @cli.entry_point('mjax-tool')
  def finishes(argv):
    try:
      signal.raise_signal(signal.SIGINT)
      time.sleep(5)
    except KeyboardInterrupt:
      pass   # dropped, as in a garbage-collector callback
    time.sleep(0.5)   # the signal watch has read the signal
    return 0
  with pytest.raises(SystemExit) as e:
    finishes([])
  assert e.value.code == 130
  assert 'mjax-tool: interrupted as it finished; its work was done in full' in capsys.readouterr().err


def test_a_tool_stopped_inside_a_native_call_cleans_up_at_once(foreground):
  # The tokenizers library's long calls (prepare's 64 MiB batches, a BPE's
  # merges) run in Rust, which never hands a signal to Python: a stop
  # waited for them past the tools' 10 s grace, and the tools were ended
  # without their clean-ups (partial shards, a temporary tokenizer file).
  # Run off the main thread, the call is left behind and the stop is at
  # once. Here the call blocks on a held mutex through ctypes (which lets
  # the GIL go, as Rust does), a wait that no signal ends.
  import signal
  import time
  code = ('import ctypes, sys\nfrom mjax import cli\nfrom mjax.data.tokenizer import off_the_main_thread\n'
          'libc = ctypes.CDLL(None)\nmutex = ctypes.create_string_buffer(64)\nlibc.pthread_mutex_lock(mutex)\n'
          '@cli.entry_point("mjax-tool")\ndef main(argv):\n  try:\n    print("ready", flush=True)\n'
          '    off_the_main_thread(libc.pthread_mutex_lock, mutex)\n'
          '  finally:\n    print("cleaned up", flush=True)\nmain()\n')
  proc = subprocess.Popen([sys.executable, '-c', foreground + code], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  assert proc.stdout.readline() == 'ready\n'
  time.sleep(0.5)
  t0 = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == 143 and 'mjax-tool: terminated' in err and out == 'cleaned up\n', (out, err)
  assert time.monotonic() - t0 < 5.0   # not the 10 s grace


def test_a_stop_dropped_in_a_garbage_collector_callback_is_sent_again(foreground):
  # The handler's exception, raised inside a gc callback (JAX registers
  # one), is dropped by Python: the tool ran on until the grace ended it,
  # without its clean-ups. Seen in mjax-prepare: a half shard directory left.
  import time
  code = ('import gc, time\nfrom mjax import cli\ncli.GRACE_S = 30.0\nfired = []\n'
          'def stop_inside_gc(phase, info):\n'
          '  if not fired:\n    fired.append(1)\n    signal.raise_signal(signal.SIGTERM)\n'
          '    sum(range(1000))   # the handler runs here, inside the callback\n'
          'gc.callbacks.append(stop_inside_gc)\n'
          '@cli.entry_point("mjax-tool")\ndef main(argv):\n  try:\n    print("ready", flush=True)\n'
          '    while True:\n      gc.collect()\n      time.sleep(0.01)\n'
          '  finally:\n    print("cleaned up", flush=True)\nmain()\n')
  t0 = time.monotonic()
  proc = subprocess.Popen([sys.executable, '-c', foreground + code], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 143 and out == 'ready\ncleaned up\n' and 'mjax-tool: terminated' in err, (out, err)
  assert 'Exception ignored' not in err and time.monotonic() - t0 < 25.0, err   # not the 30 s grace


def test_a_tool_whose_stdout_fails_says_so_in_a_line_or_ends_quietly(repo_root):
  # `mjax-generate ... | head` and `mjax-eval > results.json` on a full disk
  # ended with a traceback (BrokenPipeError, OSError 28). A reader gone is
  # the end of the output: quiet, 141 as the shell's own tools; a full disk
  # is one line and status 1.
  cmd = [sys.executable, '-c', 'from mjax.cli import flops_main; flops_main()', '--gin_file', 'configs/tiny.gin']
  with open('/dev/full', 'w') as full:
    r = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, cwd=repo_root, timeout=300)
  assert r.returncode == 1 and 'Traceback' not in r.stderr, r.stderr
  assert r.stderr.strip().splitlines() == [
      'mjax-flops: error: cannot write its output to stdout (No space left on device); what it wrote there is '
      'incomplete: give it room (a file system with free space) or another place to write.'], r.stderr
  read, write = os.pipe()
  os.close(read)   # the reader is gone before the first write
  try:
    r = subprocess.run(cmd, stdout=write, stderr=subprocess.PIPE, text=True, cwd=repo_root, timeout=300)
  finally:
    os.close(write)
  assert r.returncode == 141 and r.stderr == '', r.stderr
  # A tool that ends with its own status (mjax-report, mjax-diagnose), its
  # output still in Python's buffer: the status stays its own, not 120 and
  # "Exception ignored" from the flush at exit. One started with stdout
  # closed prints nothing, as Python lets it.
  tool = ('import sys\nfrom mjax import cli\n@cli.entry_point("mjax-tool")\ndef main(argv):\n'
          '  print("a line")\n  sys.exit(3)\nmain()\n')
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONUNBUFFERED'}
  with open('/dev/full', 'w') as full:
    r = subprocess.run([sys.executable, '-c', tool], stdout=full, stderr=subprocess.PIPE, text=True,
                       cwd=repo_root, env=env, timeout=300)
  assert r.returncode == 3 and r.stderr == '', r.stderr
  r = subprocess.run(['sh', '-c', 'exec "$0" -c "$1" >&-', sys.executable, tool.replace('sys.exit(3)', 'return 0')],
                     stderr=subprocess.PIPE, text=True, cwd=repo_root, env=env, timeout=300)
  assert r.returncode == 0 and r.stderr == '', r.stderr


def test_settings_that_would_train_silently_wrong_are_refused_for_training():
  check = lambda *bindings: C.check_for_training(C.load_config(['tiny.gin'], list(bindings)))
  # bfloat16 master weights: LAMB's updates (about lr x the weight) round
  # away, and training stalls without an error. Such a config still loads
  # (a run trained so is evaluated, sampled from, exported).
  with pytest.raises(C.ConfigError, match=r"ModelConfig.param_dtype = 'bfloat16' is not allowed: must be 'float32'"):
    check("ModelConfig.param_dtype = 'bfloat16'")
  # A decay that ends before the warm-up does: the rate stayed at its peak all run.
  with pytest.raises(C.ConfigError, match=r'OptimConfig.decay_steps = 100 is not allowed: must be above '
                                          r'OptimConfig.warmup_steps = 100'):
    check('OptimConfig.warmup_steps = 100', 'OptimConfig.decay_steps = 100', 'TrainConfig.steps = 1000')
  # A smoke test shorter than its warm-up still trains, and 0 means unset.
  check('OptimConfig.warmup_steps = 100', 'OptimConfig.decay_steps = 50', 'TrainConfig.steps = 20')
  check('OptimConfig.decay_steps = 0', 'TrainConfig.steps = 1000')


def test_load_config_leaves_no_bindings_behind_and_takes_single_names():
  """The config classes are gin configurables: bindings left in gin made a
  `ModelConfig()` built by hand after a load take that file's values."""
  cfg = C.load_config('tiny.gin', 'TrainConfig.steps = 3')   # one file, one binding: not sequences of letters
  assert cfg.train.steps == 3 and C.TrainConfig().steps == 300
  C.load_config(['tiny.gin'], ['ModelConfig.d_model = 128'])
  assert C.ModelConfig().d_model == 256
  with pytest.raises(C.ConfigError, match=r'num_devices = 0 is not allowed'):
    C.load_config(['tiny.gin'], [], num_devices=0)


def test_cudnn_attention_on_devices_without_it_is_refused_before_compiling(repo_root, tmp_path):
  # It crashed inside the first trace (RuntimeError: cuDNN is not detected),
  # exit 1, which the fault-tolerance driver restarted as a crash.
  import subprocess
  import sys
  from mjax import flags
  with pytest.raises(C.ConfigError, match=r"ModelConfig.attention_impl = 'cudnn' is not allowed on this job's cpu "
                                          r"devices: cuDNN attention runs on NVIDIA GPUs; use 'dot_product'"):
    flags.setup([os.path.join(repo_root, 'configs', 'tiny.gin')], ["ModelConfig.attention_impl = 'cudnn'"],
                join=False, xla_flags=False)
  flags.setup([os.path.join(repo_root, 'configs', 'tiny.gin')], [], join=False, xla_flags=False)   # the default is fine
  run = subprocess.run([sys.executable, '-c', 'from mjax.cli import train_main; train_main()', '--gin_file',
                        'configs/tiny.gin', '--gin.ModelConfig.attention_impl=cudnn', '--workdir',
                        str(tmp_path / 'run')], cwd=repo_root, capture_output=True, text=True, timeout=300)
  assert run.returncode == 2 and "attention_impl = 'cudnn' is not allowed" in run.stderr, run.stderr[-2000:]
  assert 'Traceback' not in run.stderr and not (tmp_path / 'run').exists()
