"""mjax-eval: the loss of a saved checkpoint, on any step, mesh and split."""

import contextlib
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from mjax import config as C
from mjax import evaluate, train, trainer
from mjax.errors import UserError
from mjax.metrics import read_metrics

N = 6
EVAL_BATCHES = 2
# fp32 compute, so that another mesh's reduction order moves the loss by
# float32 rounding only (bf16 would move it by ~1e-3).
SMALL = ['ModelConfig.d_model = 128', 'ModelConfig.n_layers = 2', 'ModelConfig.d_ff = 256',
         'ModelConfig.sliding_window = 16', 'ModelConfig.full_attention_every = 0',
         'ModelConfig.dtype = "float32"', 'DataConfig.seq_len = 64', 'TrainConfig.global_batch_size = 16',
         f'TrainConfig.steps = {N}', 'OptimConfig.warmup_steps = 2', 'TrainConfig.eval_every = 0',
         f'TrainConfig.eval_batches = {EVAL_BATCHES}', 'TrainConfig.progress = False',
         'CheckpointConfig.save_every = 3', 'MeshConfig.data = 1', 'MeshConfig.fsdp = 8']
TOKENS_PER_BATCH = 16 * 64


@pytest.fixture(scope='module')
def run(tmp_path_factory) -> str:
  """A finished run with checkpoints of steps 3 and 6, trained on FSDP x 8."""
  workdir = str(tmp_path_factory.mktemp('run'))
  trainer.run(C.load_config(['tiny.gin'], SMALL, num_devices=8), workdir)
  return workdir


def mjax_eval(*argv: str) -> dict:
  """mjax-eval in this process: the report."""
  args, bindings = evaluate.parse_args(list(argv))
  return evaluate.main(args, bindings)


def final_eval_loss(workdir: str) -> float:
  return [r['eval_loss'] for r in read_metrics(workdir) if r.get('step') == N and 'eval_loss' in r][-1]


def test_final_step_matches_the_trainers_eval_loss(run):
  out = mjax_eval('--workdir', run)
  assert out['step'] == N and out['checkpoint'] == os.path.join(run, 'checkpoints', str(N))
  assert out['split'] == 'heldout' and out['batches'] == EVAL_BATCHES   # TrainConfig.eval_batches
  assert out['tokens'] == EVAL_BATCHES * TOKENS_PER_BATCH
  assert out['checksums_verified'] and out['skipped'] == []
  assert out['loss'] == pytest.approx(final_eval_loss(run), rel=1e-6)
  assert out['perplexity'] == pytest.approx(math.exp(out['loss']), rel=1e-12)
  assert out['bits_per_token'] == pytest.approx(out['loss'] / math.log(2), rel=1e-12)
  assert out['tokenizer'] == 'bytes' and out['bits_per_byte'] == out['bits_per_token']
  assert 'EOS' in out['note']
  assert out['mesh'] == {'data': 1, 'fsdp': 8, 'tensor': 1, 'pipeline': 1}
  assert out['data']['heldout_files'] > 0


def test_older_step_has_a_higher_loss(run):
  final = mjax_eval('--workdir', run)
  older = mjax_eval('--workdir', run, '--step', '3')
  assert older['step'] == 3 and older['checkpoint'].endswith(os.path.join('checkpoints', '3'))
  assert older['loss'] > final['loss']
  # The same step named by its directory, with the config saved inside the checkpoint.
  direct = mjax_eval('--checkpoint', older['checkpoint'])
  assert direct['step'] == 3 and direct['tier'] is None
  assert direct['loss'] == older['loss']


@pytest.mark.parametrize('mesh', [['data=2', 'tensor=4'], ['data=2', 'tensor=2', 'pipeline=2']],
                         ids=['data2_tensor4', 'data2_tensor2_pipeline2'])
def test_another_mesh_gives_the_same_loss(run, mesh):
  final = mjax_eval('--workdir', run)
  other = mjax_eval('--workdir', run, '--gin.MeshConfig.fsdp=1', *[f'--gin.MeshConfig.{m}' for m in mesh])
  assert other['mesh'] == {'data': 1, 'fsdp': 1, 'tensor': 1, 'pipeline': 1,
                           **{k: int(v) for k, v in (m.split('=') for m in mesh)}}
  assert other['loss'] == pytest.approx(final['loss'], rel=1e-5)


def test_train_split_and_batch_count(run):
  out = mjax_eval('--workdir', run, '--split', 'train', '--batches', '3')
  assert out['split'] == 'train' and out['batches'] == 3 and out['tokens'] == 3 * TOKENS_PER_BATCH
  assert math.isfinite(out['loss']) and out['loss'] != mjax_eval('--workdir', run)['loss']


def test_a_longer_sequence_than_trained_is_said(run, capsys):
  # Rotary positions past the trained length are extrapolated: the loss
  # there is no measure of the model at its own length.
  capsys.readouterr()
  out = mjax_eval('--workdir', run, '--batches', '1', '--gin.DataConfig.seq_len=128')
  assert math.isfinite(out['loss'])
  assert ('note: DataConfig.seq_len = 128 is longer than the 64 step 6 was trained on; positions past that '
          'are extrapolated') in capsys.readouterr().err
  mjax_eval('--workdir', run, '--batches', '1', '--gin.DataConfig.seq_len=32')
  assert 'extrapolated' not in capsys.readouterr().err


def test_damaged_newest_step_falls_back_and_named_step_is_refused(run, tmp_path):
  copy = str(tmp_path / 'run')
  shutil.copytree(run, copy)
  # A checksum that no longer matches: what a changed bit in the array looks like.
  meta_path = os.path.join(copy, 'checkpoints', str(N), 'meta', 'metadata')
  with open(meta_path) as fh:
    meta = json.load(fh)
  meta['fingerprints'][".params['embedding']"][0] += 1
  with open(meta_path, 'w') as fh:
    json.dump(meta, fh)
  out = mjax_eval('--workdir', copy)
  assert out['step'] == 3
  assert out['skipped'][0]['step'] == N and 'checksum' in out['skipped'][0]['error']
  with pytest.raises(UserError, match=r"step 6 at .*checksum.*Saved steps: .*: 6, 3"):
    mjax_eval('--workdir', copy, '--step', str(N))
  assert os.path.isdir(os.path.join(copy, 'checkpoints', str(N)))   # evaluation moves nothing


def test_a_damaged_step_record_is_named_not_a_decoder_error(run, tmp_path):
  # json's decoder leaves StopIteration(0) as the context of its error: the
  # reason shown is the record, named, as training says it.
  copy = str(tmp_path / 'run')
  shutil.copytree(run, copy)
  with open(os.path.join(copy, 'checkpoints', str(N), 'meta', 'metadata'), 'w') as fh:
    fh.write('garbage{')
  out = mjax_eval('--workdir', copy)
  assert out['step'] == 3
  error = out['skipped'][0]['error']
  assert 'meta/metadata is not JSON' in error and 'StopIteration' not in error, error
  # The same through --checkpoint's directory of steps alone: its config is
  # the newest readable step's, not an error for the damaged one's record.
  out = mjax_eval('--checkpoint', os.path.join(copy, 'checkpoints'))
  assert out['step'] == 3 and out['skipped'][0]['step'] == N
  with pytest.raises(UserError, match=r'holds no readable config'):   # asked for by name: refused
    mjax_eval('--checkpoint', os.path.join(copy, 'checkpoints'), '--step', str(N))


def test_held_out_data_other_than_the_runs_is_said(run, capsys):
  """A step's data position names the held-out split's content too: a
  held-out file edited since (or another heldout_fraction) gave another
  loss than the run's eval_loss without a word."""
  step = os.path.join(run, 'checkpoints', str(N))
  assert evaluate.heldout_change(step, C.load_config(['tiny.gin'], SMALL)) is None
  other = C.load_config(['tiny.gin'], SMALL + ['DataConfig.heldout_fraction = 0.05'])
  assert 'not comparable with the run\'s eval_loss' in evaluate.heldout_change(step, other)
  capsys.readouterr()
  mjax_eval('--workdir', run, '--gin.DataConfig.heldout_fraction=0.05')
  assert 'warning: the held-out data is not what the run that saved this step held out' in capsys.readouterr().err


def test_a_tokenizer_other_than_the_trained_one_is_said_and_refused_for_export(run, tmp_path, capsys):
  # Each step records the tokenizer that made its ids; one edited or
  # replaced since would decode them as other text.
  from mjax import hf
  with open(os.path.join(run, 'checkpoints', str(N), 'meta', 'metadata')) as fh:
    assert json.load(fh)['tokenizer']['name'] == 'bytes'
  assert evaluate.tokenizer_change(os.path.join(run, 'checkpoints', str(N)), C.load_config(['tiny.gin'], SMALL)) is None
  copy = str(tmp_path / 'run')
  shutil.copytree(run, copy)
  meta_path = os.path.join(copy, 'checkpoints', str(N), 'meta', 'metadata')
  with open(meta_path) as fh:
    meta = json.load(fh)
  meta['tokenizer'] = {'name': 'tok.json', 'path': '/data/tok.json', 'vocab_size': 256, 'eos_id': 0, 'sha256': 'ab' * 32}
  with open(meta_path, 'w') as fh:
    json.dump(meta, fh)
  capsys.readouterr()
  assert mjax_eval('--workdir', copy)['step'] == N
  said = capsys.readouterr().err
  assert "warning: DataConfig.tokenizer is 'bytes' (258 ids), but step 6 was trained with /data/tok.json" in said, said
  args, bindings = hf.parse_export_args([str(tmp_path / 'hf'), '--workdir', copy, '--drop_sliding_window'])
  with pytest.raises(UserError, match=r'trained with /data/tok.json .*The export would ship that tokenizer'):
    hf.export_main(args, bindings)
  assert not os.path.exists(tmp_path / 'hf')


def test_a_step_evaluated_under_another_model_function_is_said(run, capsys):
  # A resume with another rope_theta rewrites the run's config.gin, which
  # then evaluated the steps trained before it under the new value, silently.
  step = os.path.join(run, 'checkpoints', str(N))
  assert evaluate.model_function_change(step, C.load_config(['tiny.gin'], SMALL)) is None
  capsys.readouterr()
  assert mjax_eval('--workdir', run, '--gin.ModelConfig.rope_theta=500000.0')['step'] == N
  said = capsys.readouterr().err
  assert ('warning: step 6 was trained with ModelConfig.rope_theta = 10000.0, and this config has 500000.0 '
          '(to use it as trained: --gin.ModelConfig.rope_theta=10000.0)') in said, said


def test_config_of_another_model_is_refused(run, tmp_path):
  with pytest.raises(UserError, match=r"another model.*params\['embedding'\] is \(384, 128\).* Run mjax-eval with "
                                      r"the config it was trained with"):
    mjax_eval('--workdir', run, '--gin.ModelConfig.d_model=256')
  # A workdir that is not there is said to be so (not "has no config.gin").
  with pytest.raises(UserError, match=rf"--workdir '{tmp_path}/nothing' does not exist: give the workdir"):
    mjax_eval('--workdir', str(tmp_path / 'nothing'))
  (tmp_path / 'afile').write_text('')
  with pytest.raises(UserError, match=r"--workdir '.*/afile' is not a directory"):
    mjax_eval('--workdir', str(tmp_path / 'afile'))


def test_a_workdir_without_config_gin_points_to_its_newest_checkpoint_alone(tmp_path):
  # --checkpoint needs no --gin_file (the config saved with the step is
  # used): the advice says so, and names the newest step the workdir holds.
  for step in (3, 12, 6):
    (tmp_path / 'checkpoints' / str(step) / 'state').mkdir(parents=True)
  with pytest.raises(UserError) as e:
    mjax_eval('--workdir', str(tmp_path))
  msg = str(e.value)
  assert f'--checkpoint {tmp_path}/checkpoints/12 on its own' in msg, msg
  assert '--gin_file.' not in msg and 'with --gin_file' not in msg and '\n' not in msg, msg
  # No steps there: --checkpoint PATH, still without --gin_file.
  empty = tmp_path / 'empty'
  empty.mkdir()
  with pytest.raises(UserError, match=r'has no config.gin: .*--checkpoint PATH on its own') as e:
    mjax_eval('--workdir', str(empty))
  assert 'with --gin_file' not in str(e.value)


def cli(repo_root: str, *argv: str, devices: int = 8) -> subprocess.CompletedProcess:
  env = {**os.environ, 'XLA_FLAGS': f'--xla_force_host_platform_device_count={devices}'}
  return subprocess.run([sys.executable, '-c', 'from mjax.cli import eval_main; eval_main()', *argv],
                        capture_output=True, text=True, cwd=repo_root, timeout=300, env=env)


def test_cli_prints_one_json_document(run, repo_root):
  proc = cli(repo_root, '--workdir', run, '--batches', '1')
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout)   # the whole of stdout: one document, nothing else
  assert out['step'] == N and out['batches'] == 1 and out['tokens'] == TOKENS_PER_BATCH
  assert 'mjax-eval: loss' in proc.stderr
  # On a machine with fewer devices than the run's mesh (fsdp = 8, named in
  # its config.gin): data-parallel on those there are, said; the same loss.
  # Before, the run's mesh was refused as if the user had written it.
  two = cli(repo_root, '--workdir', run, '--batches', '1', devices=2)
  assert two.returncode == 0, two.stderr[-3000:]
  assert "the run's MeshConfig = {'data': 1, 'fsdp': 8, 'tensor': 1, 'pipeline': 1} does not fit the 2 device(s) " \
         'here: running data-parallel on them instead' in two.stderr, two.stderr
  got = json.loads(two.stdout)
  assert got['mesh']['data'] == 2 and got['loss'] == pytest.approx(out['loss'], rel=1e-5)
  # A mesh on the command line is the user's: refused as written.
  bad = cli(repo_root, '--workdir', run, '--batches', '1', '--gin.MeshConfig.fsdp=4', devices=2)
  assert bad.returncode == 2 and "MeshConfig = {'data': 1, 'fsdp': 4" in bad.stderr, bad.stderr[-2000:]


def test_cli_missing_step_exits_2_naming_the_saved_steps(run, repo_root):
  proc = cli(repo_root, '--workdir', run, '--step', '999')
  assert proc.returncode == 2
  assert proc.stdout == '' and 'Traceback' not in proc.stderr
  errors = [line for line in proc.stderr.splitlines() if line.startswith('mjax-eval: error:')]
  assert len(errors) == 1, proc.stderr
  assert '--step 999' in errors[0] and 'saved steps' in errors[0] and ': 6, 3' in errors[0]


def test_heldout_batches_stop_where_its_windows_would_repeat(capsys):
  # The mean over "every counted token" stays exact: past the split's whole
  # batches its windows wrap around, and would count twice.
  from mjax import data as data_lib
  cfg = C.load_config(['tiny.gin'], SMALL, num_devices=8)
  windows = data_lib.describe(cfg.data)['heldout_windows']
  whole = windows // cfg.train.global_batch_size
  assert evaluate._whole_batches(cfg, 10**6) == whole
  assert f'holds {whole} whole batch(es)' in capsys.readouterr().err and whole > 2
  assert evaluate._whole_batches(cfg, 2) == 2
  # The train split too (its stream starts another pass past them): it
  # counted every window again, ~2.4x for a small source, without a word.
  train_whole = data_lib.describe(cfg.data)['train_windows'] // cfg.train.global_batch_size
  assert evaluate._whole_batches(cfg, 10**7, 'train') == train_whole
  assert f'the train split holds {train_whole} whole batch(es)' in capsys.readouterr().err
  # Not even one batch: no claim that the split "holds 1 whole batch", but
  # the error that says what one batch needs.
  seq = windows * cfg.data.seq_len // cfg.train.global_batch_size * 2
  short = C.load_config(['tiny.gin'], SMALL + [f'DataConfig.seq_len = {seq}'], num_devices=8)
  assert data_lib.whole_batches(short.data, short.train.global_batch_size) == 0
  assert evaluate._whole_batches(short, 4) == 4 and 'whole batch' not in capsys.readouterr().err
  with pytest.raises(data_lib.DataError, match=f'but one global batch of 16 x seq_len {seq} needs'):
    list(data_lib.make_eval_batches(short.data, 16, 4))


def test_the_default_count_stops_where_the_trainers_eval_does(run, capsys):
  # TrainConfig.eval_batches beyond the held-out split's whole batches: the
  # trainer takes eval_loss on those, and mjax-eval by default evaluated
  # them all, counting wrapped-around windows twice (another loss, no word).
  cfg = C.load_config(['tiny.gin'], SMALL, num_devices=8)
  whole = evaluate._whole_batches(cfg, 10**6)
  capsys.readouterr()
  out = mjax_eval('--workdir', run, f'--gin.TrainConfig.eval_batches={whole + 2}')
  assert out['batches'] == whole and out['tokens'] == whole * TOKENS_PER_BATCH, out
  assert f'holds {whole} whole batch(es)' in capsys.readouterr().err


def test_eval_loss_weights_each_batch_by_its_counted_tokens():
  """The trainer's eval_loss was the plain mean of the batch means: under a
  loss mask that drops tokens, a batch with few counted tokens would weigh
  as much as a full one. It is now mjax-eval's exact mean, one function."""
  masks = {1.0: np.zeros((2, 8), np.float32), 3.0: np.ones((2, 8), np.float32)}
  masks[1.0][0, :5] = 1.0                                 # 5 counted tokens at loss 1, 16 at loss 3
  program = types.SimpleNamespace(
      mesh=Mesh(np.array(jax.devices()[:1]), ('data',)), context=contextlib.nullcontext,
      eval_step=lambda params, batch: batch['loss'])
  batches = [{'loss': loss, 'loss_mask': mask} for loss, mask in masks.items()]
  loss, tokens = train.evaluate(program, None, batches)
  assert tokens == 21
  assert loss == pytest.approx((5 * 1.0 + 16 * 3.0) / 21)   # not (1 + 3) / 2


def test_trainer_eval_loss_stops_where_heldout_windows_would_repeat(capsys):
  # The trainer evaluated TrainConfig.eval_batches whatever the split held,
  # wrapping around and counting windows twice; it now stops where mjax-eval does.
  cfg = C.load_config(['tiny.gin'], SMALL + ['TrainConfig.eval_batches = 1000000'], num_devices=8)
  whole = evaluate._whole_batches(cfg, 10**6)
  capsys.readouterr()
  count = trainer.Trainer._eval_batch_count(types.SimpleNamespace(cfg=cfg, say=print))
  assert count == whole
  out = capsys.readouterr().out
  assert f'holds {whole} whole batch(es)' in out and 'TrainConfig.eval_batches = 1000000' in out
  small = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_batches=2))
  assert trainer.Trainer._eval_batch_count(types.SimpleNamespace(cfg=small, say=print)) == 2
  assert capsys.readouterr().out == ''


def test_a_run_whose_width_the_mesh_here_cannot_split_is_evaluated_data_parallel(monkeypatch):
  """A run recorded with MeshConfig.fsdp = -1 (the rest), evaluated where the
  rest is 6 devices and d_model does not split 6 ways: the checkpoint loads
  on any mesh, so the tool goes data-parallel, as for a mesh that does not
  fit; before, the width's error stopped it."""
  from mjax import config as C
  from mjax import evaluate as E
  from mjax import flags

  def setup(files, bindings):
    raise C.ConfigError('ModelConfig.d_model = 256 is not allowed: must be divisible by the FSDP size 6 '
                        '(fsdp x dcn_fsdp), which splits every weight along d_model')
  monkeypatch.setattr(flags, 'setup', setup)
  loaded = []
  monkeypatch.setattr(flags, 'load', lambda files, bindings, num_devices=None: loaded.append(bindings) or 'cfg')
  assert E.setup_on_these_devices(['tiny.gin'], ['MeshConfig.fsdp = -1'], []) == 'cfg'
  assert loaded and all(b in loaded[0] for b in E.ALL_DATA)
  # A mesh named on the command line is the user's: its error stands.
  with pytest.raises(C.ConfigError, match='FSDP size 6'):
    E.setup_on_these_devices(['tiny.gin'], [], ['MeshConfig.fsdp = 6'])
