"""Checkpointing: bitwise resume, kill -9, pre-emption, corruption fallback."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from mjax import config as C
from mjax import train, trainer
from mjax import checkpoint as checkpoint_lib
from mjax.checkpoint import Checkpointer
from mjax.checkpoint import checkpointer, directories, failures, guards, integrity, locks
from mjax.checkpoint.directories import saved_steps
from mjax.parallel import make_mesh
from mjax.errors import UserError
from mjax.metrics import read_metrics

N = 8
# The learning-rate schedule is pinned to N steps so that a run stopped early
# and resumed follows the same schedule as an uninterrupted one.
SMALL = ['ModelConfig.d_model = 128', 'ModelConfig.n_layers = 2', 'ModelConfig.d_ff = 256',
         'ModelConfig.sliding_window = 16', 'ModelConfig.full_attention_every = 0',
         'DataConfig.seq_len = 64', 'TrainConfig.global_batch_size = 16',
         f'OptimConfig.decay_steps = {N}', 'OptimConfig.warmup_steps = 2', 'TrainConfig.eval_every = 0',
         'TrainConfig.eval_batches = 1', 'TrainConfig.progress = False']


def fit(cfg, workdir):
  """Trains `cfg` in `workdir`; the summary and the final train state."""
  t = trainer.Trainer(cfg, str(workdir))
  return t.train(), t.state


def losses(workdir):
  rows = read_metrics(workdir)
  return {r['step']: r['loss'] for r in rows if 'loss' in r}


def final_state(workdir, step):
  """The saved train state of `step`, as numpy, read without any mesh."""
  path = os.path.join(workdir, 'checkpoints', str(step), 'state')
  return ocp.StandardCheckpointer().restore(path)


def assert_bitwise(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb) > 0
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- in-process, 8 devices, FSDP ------------------------------------------------

def cfg8(*extra):
  return C.load_config(['tiny.gin'], [*SMALL, 'MeshConfig.data = 1', 'MeshConfig.fsdp = 8', *extra],
                       num_devices=8)


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('full'))
  _, state = fit(cfg8(f'TrainConfig.steps = {N}'), workdir)
  return workdir, state


def test_fsdp_resume_is_bitwise(uninterrupted, tmp_path):
  full_dir, full_state = uninterrupted
  workdir = str(tmp_path)
  t = trainer.Trainer(cfg8('TrainConfig.steps = 3'), workdir)
  first = t.train()   # a clean stop at step 3
  assert first.final_step == 3
  # A Trainer trains once: a second call would train steps 1-3 again on top
  # of step 3's state, into the same metrics and checkpoints. Refused, with
  # the way on, and nothing touched.
  before = (losses(workdir), sorted(os.listdir(os.path.join(workdir, 'checkpoints'))))
  with pytest.raises(UserError, match=r'has run already.*Build a new Trainer'):
    t.train()
  assert (losses(workdir), sorted(os.listdir(os.path.join(workdir, 'checkpoints')))) == before
  second, second_state = fit(cfg8(f'TrainConfig.steps = {N}'), workdir)
  assert second.start_step == 3
  assert losses(workdir) == losses(full_dir)                  # every step, bit for bit
  assert_bitwise(second_state.params, full_state.params)
  assert_bitwise(second_state.opt_state, full_state.opt_state)


def test_gradient_clipping_turned_off_and_on_between_starts_resumes_the_same_moments(tmp_path):
  """Clipping holds no state, but its empty entry in the optimizer's state
  moved the other stages' along: every checkpoint of a run that turned
  OptimConfig.clip_norm on or off was unreadable ('the state of another
  optimizer')."""
  import optax
  workdir = str(tmp_path)
  trainer.run(cfg8('TrainConfig.steps = 2'), workdir)
  off, off_state = fit(cfg8('TrainConfig.steps = 4', 'OptimConfig.clip_norm = 0.0'), workdir)
  assert off.start_step == 2 and off.final_step == 4 and len(off_state.opt_state) == 4
  with trainer.Trainer(cfg8('TrainConfig.steps = 5'), workdir) as on:
    assert on.start_step == 4 and isinstance(on.state.opt_state[0], optax.EmptyState)
    assert_bitwise(on.state.opt_state[1:], off_state.opt_state)
    assert_bitwise(on.state.params, off_state.params)


def test_resume_on_another_layout_matches(uninterrupted, tmp_path):
  """Stop on FSDP=8, resume on data=2 x pipeline=2 x tensor=2: resharding on
  restore, same numbers within the layout-equivalence tolerance."""
  full_dir, full_state = uninterrupted
  workdir = str(tmp_path)
  trainer.run(cfg8('TrainConfig.steps = 4'), workdir)
  other = C.load_config(['tiny.gin'], [
      *SMALL, f'TrainConfig.steps = {N}', 'MeshConfig.data = 2', 'MeshConfig.pipeline = 2',
      'MeshConfig.tensor = 2', 'ModelConfig.dtype = "bfloat16"'], num_devices=8)
  out, out_state = fit(other, workdir)
  assert out.start_step == 4
  full_losses, got = losses(full_dir), losses(workdir)
  # bf16 compute on both sides; a different reduction order moves bf16 losses
  # by ~1e-3 relative, a wrong restore by O(1).
  for step in range(5, N + 1):
    assert got[step] == pytest.approx(full_losses[step], rel=1e-2)


def test_corrupted_newest_checkpoint_falls_back(uninterrupted, tmp_path, caplog):
  full_dir, _ = uninterrupted
  workdir = str(tmp_path)
  trainer.run(cfg8('TrainConfig.steps = 4', 'CheckpointConfig.save_every = 2'), workdir)
  ckdir = os.path.join(workdir, 'checkpoints')
  assert sorted(int(s) for s in os.listdir(ckdir) if s.isdigit()) == [2, 4]
  # Damage every data file of the newest checkpoint's state.
  damaged = 0
  for root, _, files in os.walk(os.path.join(ckdir, '4', 'state')):
    for f in files:
      p = os.path.join(root, f)
      if os.path.getsize(p) > 64:
        with open(p, 'r+b') as fh:
          fh.truncate(16)
        damaged += 1
  assert damaged
  program = train.make_program(cfg8('TrainConfig.steps = 4'), make_mesh(cfg8().mesh))
  ck = Checkpointer(cfg8().checkpoint, workdir)
  restored = ck.restore_latest(program.abstract_state(canonical=True))
  ck.close()
  assert restored is not None and restored.step == 2
  assert 'checkpoints/4 (step 4) is unreadable' in caplog.text


def _another_run_is_refused(tmp_path, tiers, workdir, fast):
  """Another run pointed at the same fast directory would resume from this
  run's steps and delete them: refused, with this run named, and none of
  its steps listed as the other run's."""
  other = str(tmp_path / 'other')
  before = sorted(os.listdir(fast))
  with pytest.raises(C.ConfigError, match=f"holds the checkpoints of another run, workdir '{workdir}'"):
    trainer.run(cfg8('TrainConfig.steps = 5', *tiers), other)
  assert sorted(os.listdir(fast)) == before
  assert [t for _, t, _ in saved_steps(cfg8(*tiers).checkpoint, other)] == []


def test_two_tiers_restore_the_newest_step(uninterrupted, tmp_path):
  """Fast tier every 2 steps (2 kept), persistent every 3, both at the end: a
  restart picks the newest step across the tiers and continues bitwise."""
  full_dir, full_state = uninterrupted
  workdir, fast = str(tmp_path / 'run'), str(tmp_path / 'fast')
  tiers = ['CheckpointConfig.save_every = 3', 'CheckpointConfig.fast_every = 2',
           f'CheckpointConfig.fast_directory = "{fast}"']
  trainer.run(cfg8('TrainConfig.steps = 5', *tiers), workdir)
  persistent = sorted(int(s) for s in os.listdir(os.path.join(workdir, 'checkpoints')) if s.isdigit())
  fast_steps = sorted(int(s) for s in os.listdir(fast) if s.isdigit())
  assert persistent == [3, 5] and fast_steps == [4, 5]
  # Lose the persistent copy of step 5: the fast tier's step 5 is still newest.
  import shutil
  shutil.rmtree(os.path.join(workdir, 'checkpoints', '5'))
  out, out_state = fit(cfg8(f'TrainConfig.steps = {N}', *tiers), workdir)
  assert out.start_step == 5
  assert losses(workdir) == losses(full_dir)
  assert_bitwise(out_state.params, full_state.params)
  _another_run_is_refused(tmp_path, tiers, workdir, fast)
  assert {t for _, t, _ in saved_steps(cfg8(*tiers).checkpoint, workdir)} == {'fast', 'persistent'}


def test_restore_below_resumes_from_before_a_spike_and_sets_the_later_steps_aside(uninterrupted, tmp_path, capsys):
  """After a loss spike the driver resumes below the step it began at: steps
  saved later (finite, but spiked) in either tier are set aside, and the run
  goes on bitwise as if they had never been saved."""
  full_dir, full_state = uninterrupted
  workdir, fast = str(tmp_path / 'run'), str(tmp_path / 'fast')
  tiers = ['CheckpointConfig.save_every = 3', 'CheckpointConfig.fast_every = 2',
           f'CheckpointConfig.fast_directory = "{fast}"']
  trainer.run(cfg8('TrainConfig.steps = 5', *tiers), workdir)
  # Nothing older than step 3: refused, nothing moved (never a silent start over).
  with pytest.raises(checkpoint_lib.NoUsableCheckpoint, match='no checkpoint of this run is older than step 3'):
    trainer.run(cfg8(f'TrainConfig.steps = {N}', *tiers, 'CheckpointConfig.restore_below = 3'), workdir)
  assert [s for s, _, _ in saved_steps(cfg8(*tiers).checkpoint, workdir)] == [5, 5, 4, 3]
  out, out_state = fit(cfg8(f'TrainConfig.steps = {N}', *tiers, 'CheckpointConfig.restore_below = 4'), workdir)
  assert out.start_step == 3
  aside = sorted(n.rsplit('-', 1)[0] for d in (os.path.join(workdir, 'checkpoints'), fast)
                 for n in os.listdir(d) if n.startswith('rolled-back-'))
  assert aside == ['rolled-back-4', 'rolled-back-5', 'rolled-back-5']
  # Listed where the run's steps are, as a step moved aside damaged is.
  from mjax import report
  assert report.main(['checkpoint', workdir]) == 0
  listed = sorted((l.split()[0], l.split()[1]) for l in capsys.readouterr().out.splitlines()
                  if 'moved aside' in l and 'loss spike' in l)
  assert listed == [('fast', '4'), ('fast', '5'), ('persistent', '5')]
  assert losses(workdir) == losses(full_dir)
  assert_bitwise(out_state.params, full_state.params)


def test_partial_save_is_ignored(uninterrupted, tmp_path):
  """A save cut off mid-way leaves a temporary directory, never a step."""
  workdir = str(tmp_path)
  trainer.run(cfg8('TrainConfig.steps = 2'), workdir)
  ckdir = os.path.join(workdir, 'checkpoints')
  os.makedirs(os.path.join(ckdir, '7.orbax-checkpoint-tmp-123', 'state'))
  ck = Checkpointer(cfg8().checkpoint, workdir)
  assert [s for s, _ in ck.steps()] == [2]
  ck.close()


# --- the real command, one device: kill -9 and pre-emption ------------------------

def mjax_train(workdir, *extra, fsdp8=False):
  """The real command on one device, or on 8 fake devices with FSDP."""
  env = dict(os.environ)
  layout = ['--gin.MeshConfig.data=1']
  if fsdp8:
    env['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
    layout.append('--gin.MeshConfig.fsdp=8')
  else:
    env.pop('XLA_FLAGS', None)
  cmd = [os.path.join(os.path.dirname(sys.executable), 'mjax-train'), '--gin_file', 'configs/tiny.gin',
         '--workdir', str(workdir), *[f'--gin_param={b}' for b in SMALL], *layout, *extra]
  return cmd, env


def wait_for(path, proc, timeout=240):
  t0 = time.time()
  while not os.path.exists(path):
    assert proc.poll() is None, proc.communicate()
    assert time.time() - t0 < timeout, f'{path} never appeared'
    time.sleep(0.05)


def reference_run(workdir, repo_root, fsdp8=False):
  cmd, env = mjax_train(workdir, f'--gin.TrainConfig.steps={N}', fsdp8=fsdp8)
  proc = subprocess.run(cmd, env=env, cwd=repo_root, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return workdir


@pytest.fixture(scope='module')
def one_device_reference(tmp_path_factory, repo_root):
  return reference_run(tmp_path_factory.mktemp('ref1'), repo_root)


@pytest.mark.slow
@pytest.mark.parametrize('fsdp8', [False, True], ids=['1device', '8devices_fsdp'])
def test_kill_9_after_checkpoint_resumes_bitwise(one_device_reference, tmp_path, tmp_path_factory,
                                                repo_root, fsdp8):
  reference = (reference_run(tmp_path_factory.mktemp('ref8'), repo_root, fsdp8=True) if fsdp8
               else one_device_reference)
  cmd, env = mjax_train(tmp_path, f'--gin.TrainConfig.steps={N}', '--gin.CheckpointConfig.save_every=3',
                        fsdp8=fsdp8)
  proc = subprocess.Popen(cmd, env=env, cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  wait_for(os.path.join(tmp_path, 'checkpoints', '3', 'meta'), proc)  # a complete checkpoint
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL
  resumed = subprocess.run(cmd, env=env, cwd=repo_root, capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert 'resumed from' in resumed.stdout
  assert losses(tmp_path) == losses(reference)
  assert_bitwise(final_state(tmp_path, N), final_state(reference, N))


def test_a_stop_on_the_last_step_finishes_the_run(uninterrupted, tmp_path, monkeypatch):
  # SIGTERM during the last step: the run is complete, so it finishes as one
  # (final evaluation, not a pre-emption), bitwise the uninterrupted run.
  # Before, it stopped as pre-empted, and a restart found nothing to do:
  # the final evaluation was never made.
  full_dir, full_state = uninterrupted
  monkeypatch.setenv('MJAX_FAULT', f'term:step={N}')
  summary, state = fit(cfg8(f'TrainConfig.steps = {N}'), str(tmp_path))
  assert not summary.preempted and summary.final_step == N and np.isfinite(summary.eval_loss)
  assert any(r.get('step') == N and 'eval_loss' in r for r in read_metrics(str(tmp_path)))
  assert losses(tmp_path) == losses(full_dir)
  assert_bitwise(state.params, full_state.params)
  # One step earlier, it is a pre-emption, as before.
  monkeypatch.setenv('MJAX_FAULT', f'term:step={N - 1}')
  summary, _ = fit(cfg8(f'TrainConfig.steps = {N}'), str(tmp_path / 'early'))
  assert summary.preempted and summary.final_step == N - 1


def test_a_run_that_fails_ends_its_progress_bar_before_the_error(tmp_path, monkeypatch, capsys):
  """The progress bar's last line is ended before the error leaves: the
  error (and the warnings on the way out) were printed onto it, glued to
  the bar in a log."""
  import gc
  monkeypatch.setenv('MJAX_FAULT', 'raise:step=3')
  with pytest.raises(Exception) as failed:
    fit(cfg8('TrainConfig.steps = 6', 'TrainConfig.progress = True'), str(tmp_path))
  print('the error, as mjax-train says it', file=sys.stderr)
  del failed   # the bar's last owner, the traceback: left open, the bar ended only now, after the error
  gc.collect()
  err = capsys.readouterr().err
  assert 'step/s' in err and err.endswith('\nthe error, as mjax-train says it\n'), repr(err[-300:])


def test_a_nan_in_a_fresh_runs_first_steps_points_at_the_config():
  # A learning rate of 1e30 diverged at step 1 and was told only to skip batches.
  def said(step, saved, start):
    e = trainer.NonFiniteLoss(step, float('nan'))
    e.resumes_from(saved, start, 0)
    return str(e)
  assert said(1, None, 0).endswith('(mjax-launch does so itself); this early in a fresh run the config is the '
                                   'likelier cause: check OptimConfig.learning_rate and warmup_steps, and '
                                   'ModelConfig.init_std')
  for step, saved, start in ((trainer.EARLY_STEPS + 1, None, 0), (3, 2, 0), (12, None, 10)):
    assert said(step, saved, start).endswith('(mjax-launch does so itself)'), (step, saved, start)


def test_a_nan_just_after_a_start_that_changed_the_optimizer_points_at_the_change():
  # A learning rate of 1e30 given on a resume diverged two steps later, and
  # the error advised only skipping the batches (mjax-launch skips them itself).
  saved = C.to_dict(cfg8())
  changed = trainer.numerics_changes(saved, cfg8('OptimConfig.learning_rate = 1e30', 'ModelConfig.rope_theta = 500.0',
                                                 'TrainConfig.steps = 99', 'MeshConfig.data = 2', 'MeshConfig.fsdp = 4'))
  assert changed == ('OptimConfig.learning_rate = 0.003 there, 1e+30 now',
                     'ModelConfig.rope_theta = 10000.0 there, 500.0 now'), changed
  assert trainer.numerics_changes(saved, cfg8('TrainConfig.steps = 99')) == ()

  def said(step, saved_step, start, changed):
    e = trainer.NonFiniteLoss(step, float('nan'))
    e.resumes_from(saved_step, start, 0, changed)
    return str(e)
  assert said(22, 20, 20, changed).endswith(
      '(mjax-launch does so itself); this early after a start that changed the config of step 20 (OptimConfig.'
      'learning_rate = 0.003 there, 1e+30 now; ModelConfig.rope_theta = 10000.0 there, 500.0 now), the change is '
      'the likelier cause: resume with those settings as they were')
  for step, saved_step, start, why in ((22, 20, 20, ()), (20 + trainer.EARLY_STEPS + 1, 20, 20, changed),
                                       (24, 22, 20, changed)):
    assert said(step, saved_step, start, why).endswith('(mjax-launch does so itself)'), (step, saved_step, start)


def test_an_overflowing_gradient_stops_the_run_before_its_state_is_saved(tmp_path, monkeypatch):
  # The gradient overflowed at step 4, a save step: its loss is finite (the
  # loss before the update), but the clip factor is 0 and the update 0 x inf
  # = NaN. Before, that state became checkpoint 4, and every rollback
  # resumed it and failed again.
  monkeypatch.setenv('MJAX_FAULT', 'overflow:step=4')
  # A restart by hand replays the batches since checkpoint 2: the error says
  # how to skip them, as mjax-launch's rollback does.
  with pytest.raises(trainer.NonFiniteLoss, match=r'grad_norm is inf at step 4; a restart from the checkpoint of '
                                                  r'step 2 replays the 2 batch\(es\) that led here: '
                                                  r'TrainConfig.skip_batches = 2 with '
                                                  r'TrainConfig.skip_batches_after = 2 skips them'):
    fit(cfg8('TrainConfig.steps = 6', 'CheckpointConfig.save_every = 2'), str(tmp_path))
  assert sorted(n for n in os.listdir(tmp_path / 'checkpoints') if n.isdigit()) == ['2']
  # The driver's skip holds for a start from the step it counted from: a
  # start from another (a host-local step it could not list) skips nothing,
  # where it dropped good batches; from that step, it skips them.
  monkeypatch.delenv('MJAX_FAULT')
  said = []
  monkeypatch.setattr(trainer.Trainer, 'say', lambda self, msg: said.append(msg))
  t = trainer.Trainer(cfg8('TrainConfig.steps = 6', 'CheckpointConfig.save_every = 2', 'TrainConfig.skip_batches = 2',
                           'TrainConfig.skip_batches_after = 1'), str(tmp_path))
  t.close()
  assert t.start_step == 2 and t.train_iter.get_state()['next_index'] == 2
  assert any('holds for a start from step 1' in m and 'nothing skipped' in m for m in said), said
  t = trainer.Trainer(cfg8('TrainConfig.steps = 6', 'CheckpointConfig.save_every = 2', 'TrainConfig.skip_batches = 2',
                           'TrainConfig.skip_batches_after = 2'), str(tmp_path))
  t.close()
  assert t.train_iter.get_state()['next_index'] == 4 and 'mjax: skipped 2 batches (TrainConfig.skip_batches)' in said


def test_a_skip_given_again_on_a_later_start_skips_nothing(tmp_path, monkeypatch):
  # TrainConfig.skip_batches without skip_batches_after, as a person gives
  # it: the same override on the next start (the same command, or the run's
  # own config.gin, which keeps it) skipped the batches again from every
  # newer checkpoint, each already past them: good data dropped silently on
  # every resume. The checkpoints now carry the skip their data position
  # holds.
  said = []
  monkeypatch.setattr(trainer.Trainer, 'say', lambda self, msg: said.append(msg))
  skip = 'TrainConfig.skip_batches = 2'
  fit(cfg8('TrainConfig.steps = 4', 'CheckpointConfig.save_every = 2', skip), str(tmp_path))
  assert 'mjax: skipped 2 batches (TrainConfig.skip_batches)' in said   # from the start: 2 skipped
  said.clear()
  fit(cfg8('TrainConfig.steps = 6', 'CheckpointConfig.save_every = 2', skip), str(tmp_path))
  assert not any(m.startswith('mjax: skipped') for m in said), said
  assert any('skipped these batches already' in m and 'skip_batches_after = 4' in m for m in said), said
  # Carried on by the checkpoints of a start that skipped nothing.
  t = trainer.Trainer(cfg8('TrainConfig.steps = 8', 'CheckpointConfig.save_every = 2', skip), str(tmp_path))
  t.close()
  assert t.start_step == 6 and t.train_iter.get_state()['next_index'] == 2 + 6
  # Asked for at this step, it skips.
  t = trainer.Trainer(cfg8('TrainConfig.steps = 8', 'CheckpointConfig.save_every = 2', skip,
                           'TrainConfig.skip_batches_after = 6'), str(tmp_path))
  t.close()
  assert t.train_iter.get_state()['next_index'] == 2 + 6 + 2


def test_a_failed_tier_leaves_no_other_tiers_save_in_flight():
  # Checkpointer.close() stopped at the first tier whose save failed: the
  # other tier's save (often the newest step) was never waited for, no
  # manager was closed, and the run lock was let go with the save running.
  import threading

  class Manager:
    def __init__(self, fails):
      self.fails, self.waited, self.closed = fails, False, False

    def wait_until_finished(self):
      self.waited = True
      if self.fails:
        raise RuntimeError('background save failed (EIO)')

    def close(self):
      self.closed = True
  ck = Checkpointer.__new__(Checkpointer)
  ck.tiers = [checkpointer._Tier('persistent', '/p', 2, 2, Manager(True)),
              checkpointer._Tier('fast', '/f', 1, 2, Manager(False))]
  ck._locked, ck._closed = [], threading.Event()
  with pytest.raises(RuntimeError, match='EIO'):
    ck.close()
  assert [(t.manager.waited, t.manager.closed) for t in ck.tiers] == [(True, True), (True, True)]
  assert ck._closed.is_set()   # the lock let go last


def test_a_skip_is_not_taken_as_done_by_a_data_position_not_restored():
  # restore_from with restore_data = False (or another seq_len, whose order
  # starts again): the source checkpoint's skip record came along without
  # the position that held it, and the same TrainConfig.skip_batches was
  # then taken as done and nothing skipped.
  import types
  from mjax import data as data_lib
  from mjax.config import DataConfig, TrainConfig
  cfg = types.SimpleNamespace(data=DataConfig(source='stdlib', seq_len=32, num_threads=1, prefetch=1),
                              train=TrainConfig(global_batch_size=4, skip_batches=5))
  said = []
  stub = types.SimpleNamespace(cfg=cfg, start_step=100, say=said.append)
  record = {'batches': 5, 'at_step': 0}
  it = trainer.Trainer._train_iterator(stub, None, 0, 1, record)
  assert it.get_state()['next_index'] == 5 and stub.skip_record == {'batches': 5, 'at_step': 100}, said
  fresh = data_lib.make_train_iterator(cfg.data, 4)
  at_64 = {**fresh.get_state(), 'next_index': 7, 'global_batch_size': 4, 'seq_len': 64}
  it = trainer.Trainer._train_iterator(stub, at_64, 0, 1, record)
  assert it.get_state()['next_index'] == 5, said   # another seq_len: from the start, then the skip
  # The position restored: the record stands, and the skip is not made again.
  at_32 = {**at_64, 'seq_len': 32}
  it = trainer.Trainer._train_iterator(stub, at_32, 0, 1, record)
  assert it.get_state()['next_index'] == 7 and stub.skip_record == record
  assert any('skipped these batches already' in m for m in said), said


def test_a_resume_under_another_model_function_is_named(tmp_path, monkeypatch):
  # The same shapes, another function: a stale --gin.ModelConfig.rope_theta
  # or sliding_window resumed without a word, and the rewritten config.gin
  # then evaluated the older steps under the new value too.
  said = []
  monkeypatch.setattr(trainer.Trainer, 'say', lambda self, msg: said.append(msg))
  fit(cfg8('TrainConfig.steps = 2', 'CheckpointConfig.save_every = 2'), str(tmp_path))
  t = trainer.Trainer(cfg8('TrainConfig.steps = 4', 'CheckpointConfig.save_every = 2'), str(tmp_path))
  t.close()
  assert t.start_step == 2 and not any('another model function' in m for m in said), said
  t = trainer.Trainer(cfg8('TrainConfig.steps = 4', 'CheckpointConfig.save_every = 2',
                           'ModelConfig.rope_theta = 500000.0'), str(tmp_path))
  t.close()
  warned = [m for m in said if 'another model function' in m]
  assert len(warned) == 1 and 'ModelConfig.rope_theta = 10000.0 there, 500000.0 now' in warned[0], said
  assert '--gin.ModelConfig.rope_theta=10000.0' in warned[0]


def test_a_run_stopped_in_its_final_evaluation_takes_it_on_the_next_start(tmp_path):
  # A SIGTERM during the final evaluation: the last step was saved, its
  # eval_loss never written, and every restart said "already finished":
  # the run never had its final evaluation.
  summary, _ = fit(cfg8('TrainConfig.steps = 2', 'CheckpointConfig.save_every = 2'), str(tmp_path))
  full = summary.eval_loss
  path = tmp_path / 'metrics.jsonl'
  lines = path.read_text().splitlines()
  path.write_text('\n'.join(line for line in lines if 'eval_loss' not in line) + '\n')
  assert not any('eval_loss' in r for r in read_metrics(str(tmp_path)))
  summary, _ = fit(cfg8('TrainConfig.steps = 2', 'CheckpointConfig.save_every = 2'), str(tmp_path))
  assert not summary.already_finished and summary.eval_loss == full
  assert [r['eval_loss'] for r in read_metrics(str(tmp_path)) if 'eval_loss' in r] == [full]
  assert any(r.get('step') == 2 and 'loss' in r for r in read_metrics(str(tmp_path)))   # the step's own row kept
  summary, _ = fit(cfg8('TrainConfig.steps = 2', 'CheckpointConfig.save_every = 2'), str(tmp_path))
  assert summary.already_finished


def test_a_run_stopped_in_an_evaluation_midway_takes_it_on_the_next_start(tmp_path):
  # Killed in the evaluation of step 2 (of TrainConfig.eval_every), after
  # step 2's save committed: the restart went on from step 3, and the run's
  # history never had step 2's eval_loss.
  cfg = lambda: cfg8('TrainConfig.steps = 4', 'CheckpointConfig.save_every = 2', 'TrainConfig.eval_every = 2')
  full, cut = tmp_path / 'full', tmp_path / 'cut'
  fit(cfg(), str(full))
  evals = [(r['step'], r['eval_loss']) for r in read_metrics(str(full)) if 'eval_loss' in r]
  assert [s for s, _ in evals] == [2, 4]
  fit(cfg(), str(cut))
  shutil.rmtree(cut / 'checkpoints' / '4')
  path = cut / 'metrics.jsonl'
  kept = []
  for line in path.read_text().splitlines():
    if 'eval_loss' in line:
      break
    kept.append(line)
  path.write_text('\n'.join(kept) + '\n')
  assert [r['step'] for r in read_metrics(str(cut))] == [1, 2]
  summary, _ = fit(cfg(), str(cut))
  assert summary.start_step == 2
  assert [(r['step'], r['eval_loss']) for r in read_metrics(str(cut)) if 'eval_loss' in r] == evals
  assert [r['step'] for r in read_metrics(str(cut)) if 'loss' in r] == [1, 2, 3, 4]


def test_a_crash_with_a_save_in_flight_completes_the_save_and_says_only_its_error(tmp_path, repo_root):
  # A data file gone bad right after an async save began: the process used to
  # exit with the save half-written (the step lost, its temporary directory
  # left) and Orbax's writer threads, cut off by the interpreter's exit,
  # printing ~130 lines of tracebacks after the error.
  cmd, env = mjax_train(tmp_path, '--gin.TrainConfig.steps=8', '--gin.CheckpointConfig.save_every=4')
  run = subprocess.run(cmd, env={**env, 'MJAX_FAULT': 'raise:step=5'}, cwd=repo_root, capture_output=True,
                       text=True, timeout=600)
  assert run.returncode == 1, run.stderr[-3000:]
  assert 'injected error before step 5' in run.stderr
  assert 'ERROR:absl' not in run.stderr and 'cannot schedule new futures' not in run.stderr, run.stderr[-3000:]
  assert [n for n in sorted(os.listdir(tmp_path / 'checkpoints')) if not n.startswith('.')] == ['4']
  ck = Checkpointer(cfg8().checkpoint, str(tmp_path))
  assert [s for s, _ in ck.steps()] == [4]
  ck.close()


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(one_device_reference, tmp_path, repo_root):
  cmd, env = mjax_train(tmp_path, f'--gin.TrainConfig.steps={N}')
  # As launch/jobset.yaml runs it: a stop short of the last step exits 143
  # after its save (a Job counts an index that exits 0 as finished).
  proc = subprocess.Popen(cmd, env={**env, 'MJAX_PREEMPT_EXIT_STATUS': '143'}, cwd=repo_root,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  # Pre-empt once training is under way (the first step has been logged).
  metrics = os.path.join(tmp_path, 'metrics.jsonl')
  wait_for(metrics, proc)
  while not open(metrics).read().strip():
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 143, err[-2000:]
  assert 'received SIGTERM' in out and 'checkpoint saved; exit status 143 (MJAX_PREEMPT_EXIT_STATUS)' in err
  saved = [int(s) for s in os.listdir(os.path.join(tmp_path, 'checkpoints')) if s.isdigit()]
  assert len(saved) == 1 and 1 <= saved[0] < N
  resumed = subprocess.run(cmd, env={**env, 'MJAX_PREEMPT_EXIT_STATUS': '143'}, cwd=repo_root, capture_output=True,
                           text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-2000:]   # finished: 0 whatever the variable
  assert losses(tmp_path) == losses(one_device_reference)
  assert_bitwise(final_state(tmp_path, N), final_state(one_device_reference, N))


def test_the_preempt_exit_status_is_0_unless_set_and_the_drivers_under_it(monkeypatch):
  from mjax import protocol
  monkeypatch.delenv(protocol.PREEMPT_EXIT_ENV, raising=False)
  monkeypatch.delenv(protocol.DRIVER_ADDRESS_ENV, raising=False)
  assert protocol.preempt_exit_status() == 0
  monkeypatch.setenv(protocol.PREEMPT_EXIT_ENV, ' 143 ')
  assert protocol.preempt_exit_status() == 143
  monkeypatch.setenv(protocol.DRIVER_ADDRESS_ENV, '127.0.0.1:1')   # mjax-launch's --preempt_exit_status says it
  assert protocol.preempt_exit_status() == 0


def test_a_bad_preempt_exit_status_is_said_before_start_up(tmp_path, repo_root):
  cmd, env = mjax_train(tmp_path, '--gin.TrainConfig.steps=1')
  for bad in ('abc', '256', '-1'):
    run = subprocess.run(cmd, env={**env, 'MJAX_PREEMPT_EXIT_STATUS': bad}, cwd=repo_root, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"MJAX_PREEMPT_EXIT_STATUS='{bad}': an exit status is a whole number from 0 to 255" in run.stderr
    assert not os.path.exists(tmp_path / 'checkpoints')


def _tmpfs(path, options):
  """A small tmpfs at `path` (root only); None where mounting is not allowed."""
  os.makedirs(path, exist_ok=True)
  ok = subprocess.run(['mount', '-t', 'tmpfs', '-o', options, 'tmpfs', str(path)],
                      capture_output=True).returncode == 0
  return path if ok else None


def test_a_path_that_is_not_utf8_is_refused_before_anything_is_written(tmp_path, monkeypatch):
  # TensorStore takes UTF-8 paths only: such a workdir trained, then every
  # save failed inside Orbax with ~800 lines of pybind11 cast errors.
  bad = os.fsdecode(os.fsencode(str(tmp_path)) + b'/run-\xff')
  with pytest.raises(C.ConfigError, match=r"--workdir '.*/run-\\xff' has bytes that are not UTF-8"):
    trainer.run(cfg8('TrainConfig.steps = 1'), bad)
  assert os.listdir(tmp_path) == []
  monkeypatch.setenv('MJAX_TEST_CKPT', bad)   # through a variable: gin itself refuses such text
  with pytest.raises(C.ConfigError, match=r"the persistent checkpoint directory '.*/run-\\xff/ck' has bytes"):
    trainer.run(cfg8('TrainConfig.steps = 1', 'CheckpointConfig.directory = "$MJAX_TEST_CKPT/ck"'),
                str(tmp_path / 'ok'))


@pytest.mark.parametrize('options, reason', [('size=256k', 'ENOSPC'), ('ro,size=1m', 'EROFS')],
                         ids=['full', 'read-only'])
def test_a_full_or_read_only_checkpoint_filesystem_is_refused_before_compiling(tmp_path, options, reason):
  fs = _tmpfs(tmp_path / 'fs', options)
  if fs is None:
    pytest.skip('mounting a tmpfs needs root')
  try:
    cfg = C.CheckpointConfig(directory=str(fs / 'ckpt'))
    with pytest.raises(C.ConfigError, match=rf"CheckpointConfig.directory = '{fs}/ckpt' \(the persistent tier\) "
                                             rf'cannot be written: .*\({reason}\)'):
      Checkpointer(cfg, str(tmp_path / 'run'))
  finally:
    subprocess.run(['umount', str(fs)], capture_output=True)


def test_a_workdir_that_is_a_file_is_refused_and_left_alone(tmp_path):
  workdir = tmp_path / 'notes.txt'
  workdir.write_text('keep me')
  cfg = C.load_config(['tiny.gin'], SMALL, num_devices=N)
  with pytest.raises(C.ConfigError, match=r"--workdir '.*notes.txt' cannot be written: it is a file, not a directory"):
    trainer.run(cfg, str(workdir))
  assert workdir.read_text() == 'keep me'


def test_another_model_in_a_workdir_with_checkpoints_is_refused_and_nothing_is_overwritten(uninterrupted):
  from mjax.checkpoint.guards import check_same_model
  workdir, _ = uninterrupted
  before = {f: open(os.path.join(workdir, f)).read() for f in ('config.json', 'config.gin', 'metrics.jsonl')}
  bigger = cfg8(f'TrainConfig.steps = {N}', 'ModelConfig.d_model = 256', 'ModelConfig.d_ff = 512')
  with pytest.raises(C.ConfigError, match=r'holds checkpoints of another model \(ModelConfig.d_model = 128 '
                                           r'there, 256 now, .*ModelConfig.d_ff = 256 there, 512 now\).*new --workdir'):
    trainer.run(bigger, workdir)
  # With checkpoints off too: it would still write over config.json, and
  # the checkpoints there could not be resumed afterwards.
  with pytest.raises(C.ConfigError, match='holds checkpoints of another model'):
    check_same_model(cfg8('ModelConfig.d_model = 256', 'CheckpointConfig.enabled = False'), workdir)
  # The same model with checkpoints off would start over there, silently.
  with pytest.raises(C.ConfigError, match=rf'holds checkpoints \(step\(s\) {N}[,)].*CheckpointConfig.enabled = '
                                          r'False: this run would not resume them but start over'):
    trainer.run(cfg8(f'TrainConfig.steps = {N}', 'CheckpointConfig.enabled = False'), workdir)
  # Spelled differently, the same shapes: 4 kv heads and None (= n_heads) are one model.
  check_same_model(cfg8('ModelConfig.n_kv_heads = 4', 'ModelConfig.head_dim = 32'), workdir)
  assert before == {f: open(os.path.join(workdir, f)).read() for f in before}
  # The same model with other training settings resumes as before.
  check_same_model(cfg8(f'TrainConfig.steps = {2 * N}', 'OptimConfig.learning_rate = 1e-4',
                        "ModelConfig.remat_policy = 'full'"), workdir)


def test_a_checkpoint_directory_changed_between_starts_is_refused_not_started_over(uninterrupted, tmp_path):
  """A run's checkpoints in a directory its config no longer names: the
  start found no step, trained from step 0 and superseded the run's metrics."""
  from mjax.checkpoint.guards import check_same_model
  workdir, _ = uninterrupted
  before = {f: open(os.path.join(workdir, f)).read() for f in ('config.json', 'config.gin', 'metrics.jsonl')}
  elsewhere = tmp_path / 'ckpt'
  moved = cfg8(f'TrainConfig.steps = {2 * N}', f"CheckpointConfig.directory = '{elsewhere}'")
  with pytest.raises(C.ConfigError, match=rf"persistent checkpoint tier was '{workdir}/checkpoints' "
                                           rf'\(CheckpointConfig.directory = None in its config.json\), which holds '
                                           rf'step\(s\) {N}.*would start over from step 0 instead of step {N}.*'
                                           rf'set CheckpointConfig.directory back to None, or move its steps'):
    trainer.run(moved, workdir)
  assert before == {f: open(os.path.join(workdir, f)).read() for f in before} and not elsewhere.exists()
  # Its steps moved there: the run resumes them.
  shutil.copytree(os.path.join(workdir, 'checkpoints'), elsewhere,
                  ignore=shutil.ignore_patterns(directories.OWNER_FILE))
  check_same_model(moved, workdir)
  # A fast tier turned off while it held the newest step: an older one would be resumed.
  run, fast = tmp_path / 'run', tmp_path / 'fast'
  C.write(cfg8('CheckpointConfig.fast_every = 2', f"CheckpointConfig.fast_directory = '{fast}'"), str(run))
  (run / 'checkpoints' / '4' / 'state').mkdir(parents=True)
  (fast / '6' / 'state').mkdir(parents=True)
  with pytest.raises(C.ConfigError, match=r'would resume the older step 4 instead of step 6.*set '
                                           r'CheckpointConfig.fast_every back to 2 to resume it'):
    check_same_model(cfg8(), str(run))
  check_same_model(cfg8('CheckpointConfig.fast_every = 2', f"CheckpointConfig.fast_directory = '{fast}'"), str(run))


def test_a_directory_with_files_of_another_tool_is_no_workdir(tmp_path):
  # A Hugging Face model directory (its own config.json), or a gin file of
  # the user's own as config.gin: a run there would write over them.
  from mjax.checkpoint.guards import check_same_model
  hf, mine = tmp_path / 'hf', tmp_path / 'mine'
  hf.mkdir()
  mine.mkdir()
  (hf / 'config.json').write_text('{"model_type": "llama", "hidden_size": 64}')
  (mine / 'config.gin').write_text("include 'tiny.gin'\n")
  for d, name in ((hf, 'config.json'), (mine, 'config.gin')):
    with pytest.raises(C.ConfigError, match=f'holds a {name} that no mjax run wrote'):
      check_same_model(cfg8(), str(d))
  assert (hf / 'config.json').read_text().startswith('{"model_type"') and \
      (mine / 'config.gin').read_text() == "include 'tiny.gin'\n"
  C.write(cfg8(), str(mine))         # what a run writes: its workdir
  check_same_model(cfg8(), str(mine))


def test_a_run_whose_config_json_was_damaged_or_lost_resumes(tmp_path, capsys):
  """Its run id says an mjax run lives there: the config.json is that run's
  own, damaged or deleted, and the start resumes (writing it again) instead
  of calling the workdir another tool's."""
  from mjax.checkpoint.directories import ensure_run_id
  from mjax.checkpoint.guards import check_same_model
  run = tmp_path / 'run'
  run.mkdir()
  C.write(cfg8(), str(run))
  record = ensure_run_id(cfg8().checkpoint, str(run))
  good = (run / 'config.json').read_text()
  for damage in ('truncated', 'deleted'):
    if damage == 'truncated':
      (run / 'config.json').write_text(good[:200])
    else:
      (run / 'config.json').unlink()
    check_same_model(cfg8(), str(run))
    said = capsys.readouterr().err
    assert f'config.json is {"unreadable" if damage == "truncated" else "missing"}; this is the workdir of ' \
           f'run {record["run"]}' in said, said
  # A readable config.json of another tool there is refused all the same, never written over.
  (run / 'config.json').write_text('{"model_type": "llama"}')
  with pytest.raises(C.ConfigError, match='holds a config.json that no mjax run wrote'):
    check_same_model(cfg8(), str(run))
  # With checkpoints there and none enabled, the run would start over on them: refused, config.json or not.
  (run / 'config.json').unlink()
  (run / 'checkpoints' / '4' / 'state').mkdir(parents=True)
  with pytest.raises(C.ConfigError, match='CheckpointConfig.enabled = False'):
    check_same_model(cfg8('CheckpointConfig.enabled = False'), str(run))


def test_a_run_from_before_the_configs_unrolled_their_layers_is_told_how_to_resume(tmp_path):
  """configs/125m.gin and 1p3b.gin unroll their layers now; a run of them
  from before holds scanned checkpoints: the same model, laid out the
  other way, and the refusal says which binding resumes it."""
  from mjax.checkpoint.guards import check_same_model
  run = tmp_path / 'run'
  run.mkdir()
  C.write(C.load_config(['1p3b.gin'], ['ModelConfig.scan_layers = True']), str(run))
  (run / 'checkpoints' / '1000' / 'state').mkdir(parents=True)
  with pytest.raises(C.ConfigError, match=r'saved with ModelConfig.scan_layers = True, and this config has False.*'
                                          r'Resume with --gin.ModelConfig.scan_layers=True'):
    check_same_model(C.load_config(['1p3b.gin'], []), str(run))
  check_same_model(C.load_config(['1p3b.gin'], ['ModelConfig.scan_layers = True']), str(run))


def test_checkpoints_of_another_model_in_a_shared_checkpoint_directory_are_refused(uninterrupted, tmp_path):
  # A new workdir (no config.json) whose CheckpointConfig.directory holds
  # another model's steps: each step's own config says so. Before, the steps
  # read as unreadable, the run started from scratch, and its saves made
  # Orbax delete them.
  import shutil
  workdir, _ = uninterrupted
  ckdir = str(tmp_path / 'shared')   # a copy: the run's own directory is refused as another run's
  shutil.copytree(os.path.join(workdir, 'checkpoints'), ckdir,
                  ignore=shutil.ignore_patterns('.mjax-run.json'))
  steps = sorted(n for n in os.listdir(ckdir) if n.isdigit())
  other = cfg8(f'TrainConfig.steps = {N}', 'ModelConfig.d_model = 256', 'ModelConfig.d_ff = 512',
               f"CheckpointConfig.directory = '{ckdir}'")
  with pytest.raises(C.ConfigError, match=r"shared/\d+' in the persistent checkpoint tier is a checkpoint of "
                                           r'another model \(ModelConfig.d_model = 128 there, 256 now'):
    trainer.run(other, str(tmp_path / 'new'))
  assert sorted(n for n in os.listdir(ckdir) if n.isdigit()) == steps


def test_a_numbered_directory_that_is_no_checkpoint_is_refused_and_kept(uninterrupted, tmp_path):
  import shutil
  from mjax.checkpoint.guards import check_same_model
  workdir = str(tmp_path / 'run')
  shutil.copytree(uninterrupted[0], workdir)
  junk = os.path.join(workdir, 'checkpoints', '100')
  os.makedirs(junk)
  with open(os.path.join(junk, 'notes.txt'), 'w') as fh:
    fh.write('precious')
  with pytest.raises(C.ConfigError, match=r"checkpoints/100' in the persistent checkpoint tier is not an mjax "
                                           r'checkpoint \(it holds notes.txt'):
    check_same_model(cfg8(f'TrainConfig.steps = {2 * N}'), workdir)
  assert open(os.path.join(junk, 'notes.txt')).read() == 'precious'
  os.remove(os.path.join(junk, 'notes.txt'))       # an empty one holds nothing to lose
  check_same_model(cfg8(f'TrainConfig.steps = {2 * N}'), workdir)
  with open(os.path.join(junk, '_CHECKPOINT_METADATA'), 'w') as fh:
    fh.write('{}')                                 # nor does what a cut-off deletion leaves
  check_same_model(cfg8(f'TrainConfig.steps = {2 * N}'), workdir)
  # A file named like a step: no step, but the save of that step deletes it.
  with open(os.path.join(workdir, 'checkpoints', '300'), 'w') as fh:
    fh.write('precious')
  with pytest.raises(C.ConfigError, match=r"checkpoints/300' in the persistent checkpoint tier is a file named like "
                                           r'a step: the save of step 300 would delete it'):
    check_same_model(cfg8(f'TrainConfig.steps = {2 * N}'), workdir)
  assert open(os.path.join(workdir, 'checkpoints', '300')).read() == 'precious'


def test_a_silently_changed_array_is_caught_by_its_checksum_and_resaved(uninterrupted, tmp_path, caplog, capsys):
  """One bit of one weight changed in the newest checkpoint, every file still
  valid (what a flipped bit in an uncompressed chunk does): the restore names
  the step and the array, falls back, moves the step aside, and the run
  saves that step afresh and ends bitwise equal to an uninterrupted one."""
  import shutil
  full_dir, full_state = uninterrupted
  workdir = str(tmp_path / 'run')
  trainer.run(cfg8('TrainConfig.steps = 4', 'CheckpointConfig.save_every = 2'), workdir)
  ckdir = os.path.join(workdir, 'checkpoints')
  state = jax.tree.map(np.array, final_state(workdir, 4))   # writable host copies
  kernel = state['params']['layers']['block_0']['mlp']['wi']['kernel']
  kernel.view(np.uint32).flat[1234] ^= np.uint32(1 << 7)   # one mantissa bit
  writer = ocp.StandardCheckpointer()
  writer.save(str(tmp_path / 'forged'), state)
  writer.wait_until_finished()
  writer.close()
  shutil.rmtree(os.path.join(ckdir, '4', 'state'))
  shutil.move(str(tmp_path / 'forged'), os.path.join(ckdir, '4', 'state'))
  # The offline check finds it too.
  from mjax import report
  with open(os.path.join(ckdir, '9'), 'w') as fh:    # a file named like a step is no step
    fh.write('notes')
  with caplog.at_level('WARNING'):
    assert report.main(['checkpoint', workdir, '--verify']) == 1
  said = capsys.readouterr()
  table = said.out
  assert 'a restart resumes from step 2, the newest that can be read' in said.err
  assert not re.search(r'persistent\s+9\s', table), table
  assert 'Metadata file does not exist' not in caplog.text     # Orbax's warning per step, not said
  os.remove(os.path.join(ckdir, '9'))
  assert re.search(r"persistent\s+4\s+damaged\s+\['params'\]\['layers'\]\['block_0'\]\['mlp'\]\['wi'\]"
                   r"\['kernel'\]", table), table
  assert re.search(r'persistent\s+2\s+ok\s+\d+ arrays match', table), table

  with caplog.at_level('WARNING'):
    out, out_state = fit(cfg8(f'TrainConfig.steps = {N}', 'CheckpointConfig.save_every = 2'), workdir)
  assert out.start_step == 2
  assert "checkpoints/4 (step 4) is damaged (array .params['layers']['block_0']['mlp']['wi']['kernel'] " \
         "does not match the checksum saved with it)" in caplog.text, caplog.text
  assert any(n.startswith('damaged-4-') for n in os.listdir(ckdir))
  # Step 4 was saved afresh on the way (the newest 3 of 2, 4, 6, 8 are kept).
  assert sorted(int(s) for s in os.listdir(ckdir) if s.isdigit()) == [4, 6, 8]
  assert losses(workdir) == losses(full_dir)
  assert_bitwise(out_state.params, full_state.params)
  assert_bitwise(out_state.opt_state, full_state.opt_state)


def test_a_changed_data_position_is_caught_and_resaved(uninterrupted, tmp_path, caplog):
  """One digit of the data iterator's position changed in the newest step
  (valid JSON, the batches would silently shift): caught by its checksum."""
  full_dir, full_state = uninterrupted
  workdir = str(tmp_path / 'run')
  trainer.run(cfg8('TrainConfig.steps = 4', 'CheckpointConfig.save_every = 2'), workdir)
  path = os.path.join(workdir, 'checkpoints', '4', 'data', 'metadata')
  data = json.load(open(path))
  data['next_index'] += 1
  json.dump(data, open(path, 'w'))
  from mjax.checkpoint.integrity import verify_step
  assert verify_step(os.path.dirname(os.path.dirname(path))) == (
      'damaged', 'the data position (data/metadata) does not match its checksum')
  with caplog.at_level('WARNING'):
    out, out_state = fit(cfg8(f'TrainConfig.steps = {N}', 'CheckpointConfig.save_every = 2'), workdir)
  assert out.start_step == 2
  assert 'the data position does not match the checksum saved with it' in caplog.text, caplog.text
  assert losses(workdir) == losses(full_dir)
  assert_bitwise(out_state.params, full_state.params)


def damage_step(step_dir, damage):
  """A flipped bit, a truncated or a deleted array file (the largest: the
  arrays' data) in one saved step.

  The bit is flipped where an array reads it: an OCDBT data file also holds
  bytes no array of the step refers to, and a flip there changes nothing
  (rightly "ok"). Positions are tried from the middle on until the offline
  check sees the damage; the restore path is what the tests then judge."""
  from mjax.checkpoint.integrity import verify_step
  if damage == 'tree metadata':   # the file Orbax reads the state's tree from
    os.remove(os.path.join(step_dir, 'state', '_METADATA'))
    return
  files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_dir, 'state')) for f in fs]
  target = max(files, key=os.path.getsize)
  if damage == 'delete':
    os.remove(target)
    return
  size = os.path.getsize(target)
  with open(target, 'r+b') as fh:
    if damage == 'truncate':
      fh.truncate(size // 2)
      return
    for k in range(16):
      fh.seek((size // 2 + k * (size // 17)) % size)
      byte = fh.read(1)[0]
      fh.seek(-1, os.SEEK_CUR)
      fh.write(bytes([byte ^ 0x08]))
      fh.flush()
      if verify_step(step_dir)[0] != 'ok':
        return
      fh.seek(-1, os.SEEK_CUR)
      fh.write(bytes([byte]))
      fh.flush()
  raise AssertionError(f'no flipped bit in {target} was seen by the offline check')


@pytest.mark.parametrize('where', ['newest', 'older'])
@pytest.mark.parametrize('damage', ['flip', 'truncate', 'delete', 'tree metadata'])
def test_a_damaged_step_ends_bitwise(uninterrupted, tmp_path, caplog, damage, where):
  """A flipped bit, a truncated or a deleted array file, or the state's
  tree metadata gone, in the newest step (the restore falls back past it)
  or an older one (nothing needs it): the offline check names it, and the
  run ends bitwise equal to an uninterrupted one."""
  from mjax.checkpoint.integrity import verify_step
  full_dir, full_state = uninterrupted
  workdir = str(tmp_path / 'run')
  trainer.run(cfg8('TrainConfig.steps = 4', 'CheckpointConfig.save_every = 2'), workdir)
  step_dir = os.path.join(workdir, 'checkpoints', '4' if where == 'newest' else '2')
  damage_step(step_dir, damage)
  with caplog.at_level('WARNING'):
    verdict = verify_step(step_dir)
  assert verdict[0] in ('damaged', 'unreadable')
  if damage == 'tree metadata':
    # Named by its file: it was "AttributeError: 'NoneType' object has no
    # attribute 'tree'", under Orbax's own warning.
    assert verdict == ('unreadable', 'state/_METADATA: missing') and 'item metadata' not in caplog.text
  with caplog.at_level('WARNING'):
    out, out_state = fit(cfg8(f'TrainConfig.steps = {N}', 'CheckpointConfig.save_every = 2'), workdir)
  assert out.start_step == (2 if where == 'newest' else 4)
  if damage == 'tree metadata' and where == 'newest':
    assert 'is unreadable (state/_METADATA: missing)' in caplog.text, caplog.text
  assert losses(workdir) == losses(full_dir)
  assert_bitwise(out_state.params, full_state.params)
  assert_bitwise(out_state.opt_state, full_state.opt_state)


def test_when_no_checkpoint_can_be_used_the_run_stops_and_changes_nothing(uninterrupted, tmp_path, capsys):
  """Every step damaged or unreadable (a bad device computing the checksums,
  a config change that changes the tree): before, the run moved them all
  aside or started from scratch, and its saves made Orbax delete them. It
  now stops with one message naming each step, and no file changes."""
  import hashlib
  from mjax.checkpoint import NoUsableCheckpoint
  workdir = str(tmp_path / 'run')
  trainer.run(cfg8('TrainConfig.steps = 4', 'CheckpointConfig.save_every = 2'), workdir)
  ckdir = os.path.join(workdir, 'checkpoints')
  damage_step(os.path.join(ckdir, '4'), 'flip')
  damage_step(os.path.join(ckdir, '2'), 'truncate')
  # (The run lock says who holds the directory: each run rewrites it.)
  snapshot = lambda: {os.path.relpath(os.path.join(d, f), ckdir): hashlib.sha1(open(os.path.join(d, f), 'rb').read()).hexdigest()
                      for d, _, fs in os.walk(ckdir) for f in fs if f != locks.LOCK_FILE}
  before = snapshot()
  with pytest.raises(NoUsableCheckpoint, match=r'none of the 2 checkpoint\(s\) of this run can be used: '
                                               r'\S+/checkpoints/4: damaged .*/checkpoints/2: (damaged|unreadable)'):
    trainer.run(cfg8(f'TrainConfig.steps = {N}', 'CheckpointConfig.save_every = 2'), workdir)
  assert snapshot() == before
  # The offline check says so too (it said "a restart falls back past them").
  from mjax import report
  assert report.main(['checkpoint', workdir, '--verify']) == 1
  assert 'no step can be read, so a restart stops with an error' in capsys.readouterr().err
  assert snapshot() == before


def test_verify_beside_a_training_run_says_a_rotated_out_step_is_not_damaged(tmp_path, monkeypatch, capsys):
  """`mjax-report checkpoint --verify` beside a run that trains: the run's
  `keep` retention deleted a step between the listing and its read. That
  was "unreadable" and exit status 1, the alarm for a damaged step."""
  import shutil
  from mjax import report
  workdir = str(tmp_path / 'run')
  trainer.run(cfg8('TrainConfig.steps = 4', 'CheckpointConfig.save_every = 2'), workdir)
  read = integrity.verify_step

  def rotated_while_read(path):
    if path.endswith(os.sep + '2'):
      shutil.rmtree(path)
    return read(path)

  monkeypatch.setattr(integrity, 'verify_step', rotated_while_read)
  assert report.main(['checkpoint', workdir, '--verify']) == 0
  table = capsys.readouterr().out
  # Its checkpoints folder given instead: pointed to the workdir.
  assert report.main(['checkpoint', os.path.join(workdir, 'checkpoints')]) == 2
  assert re.search(r"has no readable config.json .*\('.*/run' is one", capsys.readouterr().err)
  # One of its steps: the same.
  assert report.main(['checkpoint', os.path.join(workdir, 'checkpoints', '4')]) == 2
  assert re.search(r"has no readable config.json .*\('.*/run' is one", capsys.readouterr().err)
  assert re.search(r'persistent\s+2\s+rotated out\s+deleted by the run while this read it', table), table
  assert re.search(r'persistent\s+4\s+ok', table), table
  # The run's config.json damaged: the config saved with its newest step names the tiers.
  with open(os.path.join(workdir, 'config.json'), 'w') as fh:
    fh.write('{"model": ')
  assert report.main(['checkpoint', workdir, '--verify']) == 0
  out = capsys.readouterr()
  assert re.search(r'persistent\s+4\s+ok', out.out), out.out
  assert 'is unreadable (JSONDecodeError); the checkpoint tiers are those of the config saved with step 4' in out.err


def test_a_checkpoint_of_another_shape_is_said_without_orbaxs_advice():
  from mjax.checkpoint.failures import read_error
  e = ValueError('Requested shape: (384, 128) is not compatible with the stored shape: (384, 256). '
                 'Truncating/padding is disabled. To enable it, set `strict=False` in `ArrayRestoreArgs`.')
  said = read_error(e)
  assert said.startswith('an array is (384, 256) in the checkpoint and (384, 128) in this config: the '
                         'checkpoint holds a model of another shape') and 'strict' not in said


def test_a_step_record_that_is_not_json_is_named(tmp_path):
  from mjax.checkpoint.integrity import verify_step
  step = tmp_path / '4'
  (step / 'meta').mkdir(parents=True)
  (step / 'meta' / 'metadata').write_bytes(b'\x00\xf7garbage')
  assert verify_step(str(step)) == ('unreadable', 'meta/metadata is not JSON (damaged or overwritten: '
                                                  'UnicodeDecodeError at byte 1)')
  (step / 'meta' / 'metadata').write_text('[1, 2]')
  assert verify_step(str(step)) == ('unreadable', 'meta/metadata is JSON but not a record (a list)')
  # The restore checks them before Orbax reads (its errors: a bare decoder
  # error, pages of a tree mismatch), and says the same.
  from mjax.checkpoint.checkpointer import read_step
  from mjax.checkpoint.failures import read_error
  with pytest.raises(Exception) as e:
    read_step(None, 4, None, str(step), None)
  assert read_error(e.value) == 'meta/metadata is JSON but not a record (a list)'
  (step / 'meta' / 'metadata').unlink()
  assert verify_step(str(step)) == ('unreadable', 'meta/metadata: missing')


def test_a_change_of_parallel_norms_is_refused_by_name(uninterrupted):
  from mjax.checkpoint.guards import check_same_model
  with pytest.raises(C.ConfigError, match="ModelConfig.parallel_norms = 'shared' there, 'separate' now"):
    check_same_model(cfg8("ModelConfig.parallel_norms = 'separate'"), uninterrupted[0])


def test_a_fast_tier_left_by_a_deleted_workdir_is_refused(tmp_path):
  # The fast tier outside the workdir (by default in /dev/shm, named after
  # the workdir's path) outlives a deleted workdir: a new run at that path
  # resumed the old run's state as its own. With the workdir there, the
  # same steps are the run's own and resume as always.
  import shutil
  workdir, fast = tmp_path / 'run', tmp_path / 'fast'
  cfg = cfg8('TrainConfig.steps = 2', 'CheckpointConfig.fast_every = 1', 'CheckpointConfig.save_every = 100',
             f"CheckpointConfig.fast_directory = '{fast}'")
  trainer.run(cfg, str(workdir))
  shutil.rmtree(workdir)
  with pytest.raises(C.ConfigError, match=r"holds step\(s\) 2, 1 of an earlier run at --workdir .* was "
                                           r"deleted or moved"):
    trainer.run(cfg, str(workdir))
  assert sorted(os.listdir(fast)) == ['.mjax-run.json', '1', '2'] and not (workdir / 'config.json').exists()


def test_a_new_run_at_a_deleted_runs_path_never_resumes_that_runs_fast_tier(tmp_path):
  # Run A left its fast tier (outside the workdir, named after the path);
  # its workdir was deleted and run B started there with the fast tier
  # off, so B's persistent tier held a step of its own. B then turned the
  # fast tier on: it resumed A's newer step 2 as its own. Each workdir now
  # has a run id, which the tiers' claims carry.
  import shutil
  from mjax.checkpoint.directories import OWNER_FILE, RUN_ID_FILE, run_id, saved_steps
  workdir, fast = tmp_path / 'run', tmp_path / 'fast'
  with_fast = ('CheckpointConfig.fast_every = 1', f"CheckpointConfig.fast_directory = '{fast}'")
  trainer.run(cfg8('TrainConfig.steps = 2', 'CheckpointConfig.save_every = 100', *with_fast), str(workdir))
  run_a = run_id(str(workdir))
  assert run_a and json.load(open(fast / OWNER_FILE))['run'] == run_a
  shutil.rmtree(workdir)
  out, _ = fit(cfg8('TrainConfig.steps = 1', 'CheckpointConfig.save_every = 1'), workdir)
  run_b = run_id(str(workdir))
  assert out.start_step == 0 and run_b not in (None, run_a)
  cfg = cfg8('TrainConfig.steps = 3', 'CheckpointConfig.save_every = 1', *with_fast)
  with pytest.raises(C.ConfigError, match=rf"holds the checkpoints of an earlier run at this same --workdir "
                                          rf"path .*\(run {run_a}, .*not of the run living there now \(run {run_b}, "
                                          rf".*{RUN_ID_FILE}.*Delete '{fast}' if that run is over"):
    trainer.run(cfg, str(workdir))
  assert sorted(os.listdir(fast)) == ['.mjax-run.json', '1', '2']            # A's steps untouched
  # Readers (mjax-eval, -generate, -export, the driver) see B's steps only.
  assert [(s, t) for s, t, _ in saved_steps(cfg.checkpoint, str(workdir))] == [(1, 'persistent')]
  shutil.rmtree(fast)
  out, _ = fit(cfg, workdir)
  assert out.start_step == 1 and json.load(open(fast / OWNER_FILE))['run'] == run_b


def test_a_lost_workdir_whose_tiers_name_one_run_resumes_it(tmp_path, monkeypatch):
  # The workdir gone, its checkpoints kept elsewhere (claimed by its path):
  # a new start there takes that run's id and resumes it, as before run ids.
  from mjax.checkpoint.directories import OWNER_FILE, RUN_ID_FILE, ensure_run_id, run_id
  from mjax.checkpoint.guards import check_owner
  workdir = str(tmp_path / 'run')
  ckpt = C.CheckpointConfig(directory=str(tmp_path / 'ckpt'), fast_every=1, fast_directory=str(tmp_path / 'fast'))
  claim = lambda d, run: (tmp_path / d / OWNER_FILE).write_text(json.dumps({'workdir': workdir, 'run': run}))
  for d in ('ckpt', 'fast'):
    (tmp_path / d).mkdir()
    claim(d, 'a1')
  os.makedirs(workdir)
  assert ensure_run_id(ckpt, workdir) == {'run': 'a1', 'fresh': False} and run_id(workdir) == 'a1'
  check_owner({'persistent': str(tmp_path / 'ckpt'), 'fast': str(tmp_path / 'fast')}, workdir)
  # Claims of two runs name no run to take: a new id, and both tiers are
  # then refused as earlier runs', each naming its run.
  os.unlink(os.path.join(workdir, RUN_ID_FILE))
  claim('fast', 'c3')
  new = ensure_run_id(ckpt, workdir)
  assert new['run'] not in ('a1', 'c3') and new['fresh']
  for tier, was in (('ckpt', 'a1'), ('fast', 'c3')):
    with pytest.raises(C.ConfigError, match=rf"an earlier run at this same --workdir path .*\(run {was}, .*"
                                            rf"\(run {new['run']}, "):
      check_owner({'persistent': str(tmp_path / tier)}, workdir)
  # A claim without an id (an mjax from before run ids) of this path: an
  # earlier run's where the workdir is new, this run's own where the run
  # was there before the upgrade (it takes the claim over, with its id).
  claim('fast', None)
  with pytest.raises(C.ConfigError, match=r'\(an mjax from before run ids, while this workdir is new, says'):
    check_owner({'fast': str(tmp_path / 'fast')}, workdir)
  os.unlink(os.path.join(workdir, RUN_ID_FILE))
  (tmp_path / 'run' / 'config.json').write_text(json.dumps({'model': {}, 'checkpoint': {}}))
  claim('ckpt', None)
  old = ensure_run_id(C.CheckpointConfig(directory=str(tmp_path / 'ckpt')), workdir)
  assert not old['fresh']
  check_owner({'fast': str(tmp_path / 'fast')}, workdir)
  assert json.load(open(tmp_path / 'fast' / OWNER_FILE))['run'] == old['run']
  # Two first starts at once: the id made first stands, never replaced,
  # and the later start takes it (its run lock then refuses it).
  os.unlink(os.path.join(workdir, RUN_ID_FILE))
  (tmp_path / 'run' / RUN_ID_FILE).write_text(json.dumps({'run': 'first', 'fresh': False}))
  read = directories.run_record
  calls = iter([{}])   # this start read before the other one wrote
  monkeypatch.setattr(directories, 'run_record', lambda w: next(calls, None) or read(w))
  assert ensure_run_id(ckpt, workdir)['run'] == 'first' == run_id(workdir)
  assert sorted(os.listdir(workdir)) == [RUN_ID_FILE, 'config.json']   # no temporary file left


def test_restore_from_starts_a_new_run_from_another_runs_checkpoint(uninterrupted, tmp_path, caplog):
  """CheckpointConfig.restore_from: a checkpoint directory (its newest step)
  continues exactly, data position included; a wrong path is refused; the
  source is only read."""
  import logging
  full_dir, full_state = uninterrupted
  src = tmp_path / 'src'
  trainer.run(cfg8('TrainConfig.steps = 4', 'CheckpointConfig.save_every = 2'), str(src))
  listing = sorted(os.listdir(src / 'checkpoints'))
  with caplog.at_level(logging.WARNING):
    out, state = fit(cfg8(f'TrainConfig.steps = {N}', f"CheckpointConfig.restore_from = '{src / 'checkpoints'}'"),
                     tmp_path / 'b')
  # Read only, without Orbax's notices that it is (they read like a fault).
  assert not [r.getMessage() for r in caplog.records if 'read only' in r.getMessage() or 'read_only' in r.getMessage()]
  assert out.start_step == 4
  assert losses(tmp_path / 'b') == {k: v for k, v in losses(full_dir).items() if k > 4}
  assert_bitwise(state.params, full_state.params)
  # A missing one is refused at the start that would read it, before
  # anything is compiled or written there.
  with pytest.raises(UserError, match=r"restore_from = '.*/nothing': no such directory"):
    trainer.run(cfg8(f'TrainConfig.steps = {N}', f"CheckpointConfig.restore_from = '{src / 'nothing'}'"),
                str(tmp_path / 'c'))
  assert not (tmp_path / 'c').exists()
  assert sorted(os.listdir(src / 'checkpoints')) == listing
  # Not when a config is read: the run's recorded config names its source
  # (as an absolute path) long after its first start, when the source may
  # be gone, and mjax-eval, -generate, -export and every resume read it.
  recorded = tmp_path / 'b' / 'config.gin'
  assert C.load_config([str(recorded)], [], num_devices=8).checkpoint.restore_from == str(src / 'checkpoints')
  os.rename(src, tmp_path / 'moved')
  assert C.load_config([str(recorded)], [], num_devices=8).checkpoint.restore_from == str(src / 'checkpoints')


def test_raising_the_steps_of_a_run_says_its_schedule_is_rebuilt():
  # decay_steps unset: the cosine spans TrainConfig.steps, so training a
  # finished run further, as its message advises, restarts the curve.
  import types
  said = []
  check = lambda steps, saved, *extra: trainer.Trainer._check_schedule(types.SimpleNamespace(
      cfg=cfg8(f'TrainConfig.steps = {steps}', 'OptimConfig.decay_steps = None', *extra), start_step=300,
      say=said.append), saved)
  check(600, {'train': {'steps': 300}, 'optim': {'decay_steps': None}})
  assert re.fullmatch(r'mjax: warning: TrainConfig.steps is 600 now, 300 when step 300 was saved, .* at step 300 '
                      r'the rate is 0.00\d+ instead of 0.000\d+\. Set OptimConfig.decay_steps = 300 to go on '
                      r'with the schedule the run was trained with.', said[-1]), said
  # Its decay pinned then and left out now (the run's steps the same or
  # not): the schedule is rebuilt all the same, and the rate jumped silently.
  for steps in (600, 300):
    said.clear()
    check(steps, {'train': {'steps': 300}, 'optim': {'decay_steps': 400}})
    assert re.fullmatch(rf'mjax: warning: OptimConfig.decay_steps was 400 when step 300 was saved, and is unset '
                        rf'now, so the learning-rate schedule is rebuilt over {steps} steps: at step 300 the rate '
                        rf'is 0.0\d+ instead of 0.000\d+\. Set OptimConfig.decay_steps = 400 to go on with the '
                        rf'schedule the run was trained with.', said[-1]), said
  said.clear()
  check(300, {'train': {'steps': 300}})                                      # the same steps
  check(600, {'train': {'steps': 300}, 'optim': {'decay_steps': 600}})       # the same decay
  check(600, {'train': {'steps': 300}}, 'OptimConfig.decay_steps = 300')    # pinned now
  check(600, {'train': {'steps': 300}, 'optim': {'decay_steps': 300}}, 'OptimConfig.decay_steps = 300')
  assert said == []


def test_a_resumed_run_given_another_seed_says_it_changes_nothing_and_keeps_its_own():
  # The seed only draws a fresh run's weights: a resume with another one
  # trained on as before, and its config.gin then named a seed that draws
  # other weights than the run's.
  import types
  said = []
  cfg = cfg8('TrainConfig.seed = 7')
  t = types.SimpleNamespace(cfg=cfg, recorded=cfg, is_main=True, say=said.append)
  trainer.Trainer._check_seed(t, {'train': {'seed': 0}}, 20)
  assert said == ['mjax: warning: TrainConfig.seed = 7, but this run\'s weights were drawn with seed 0 and step 20 '
                  'goes on from them: the seed only initializes a fresh run\'s weights (DataConfig.shuffle_seed '
                  'orders the data), so it changes nothing here, and the run\'s config keeps seed 0. For a run from '
                  'other initial weights, give a new --workdir.'], said
  assert t.recorded.train.seed == 0 and t.recorded.optim == cfg.optim
  said.clear()
  t.recorded = cfg
  trainer.Trainer._check_seed(t, {'train': {'seed': 7}}, 20)
  trainer.Trainer._check_seed(t, {'train': {}}, 20)
  assert said == [] and t.recorded.train.seed == 7


def test_a_trainer_built_from_its_own_config_checks_the_vocabulary(tmp_path):
  # The command line checked it (flags.load); a Trainer made from a Config
  # in Python did not, and ids beyond the embedding made NaNs (exit 3).
  with pytest.raises(C.ConfigError, match=r'ModelConfig.vocab_size = 256 is not allowed: the byte tokenizer'):
    trainer.Trainer(cfg8('ModelConfig.vocab_size = 256'), str(tmp_path))
  assert not os.listdir(tmp_path)


def test_rerunning_a_finished_run_says_so_and_writes_nothing(uninterrupted, capsys):
  workdir, _ = uninterrupted
  before = {f: open(os.path.join(workdir, f)).read() for f in ('config.json', 'config.gin', 'metrics.jsonl')}
  # Another learning rate on the command line: still nothing is rewritten.
  out, out_state = fit(cfg8(f'TrainConfig.steps = {N}', 'OptimConfig.learning_rate = 1e-5'), workdir)
  assert out.already_finished and out.final_step == N
  assert f'already finished at step {N}' in capsys.readouterr().out
  assert before == {f: open(os.path.join(workdir, f)).read() for f in before}
  # Fewer steps than it ran, decay_steps unset: the schedule to keep is the
  # one it was trained with (the advice named the new, shorter length).
  out, _ = fit(cfg8('TrainConfig.steps = 3', 'OptimConfig.decay_steps = None'), workdir)
  assert out.already_finished and out.final_step == N
  assert f'set OptimConfig.decay_steps = {N} to keep the learning-rate schedule it was trained with' \
      in capsys.readouterr().out
  assert before == {f: open(os.path.join(workdir, f)).read() for f in before}


def test_an_unreadable_newest_step_is_saved_afresh_when_training_passes_it(uninterrupted, tmp_path):
  full_dir, full_state = uninterrupted
  workdir = str(tmp_path / 'run')
  trainer.run(cfg8('TrainConfig.steps = 4', 'CheckpointConfig.save_every = 2'), workdir)
  for root, _, files in os.walk(os.path.join(workdir, 'checkpoints', '4', 'state')):
    for f in files:
      if os.path.getsize(os.path.join(root, f)) > 64:
        with open(os.path.join(root, f), 'r+b') as fh:
          fh.truncate(16)
  out, out_state = fit(cfg8('TrainConfig.steps = 6', 'CheckpointConfig.save_every = 2'), workdir)
  assert out.start_step == 2
  # Step 4 was written again on the way: the run's checkpoints are all readable.
  program = train.make_program(cfg8(), make_mesh(cfg8().mesh))
  ck = Checkpointer(cfg8().checkpoint, workdir)
  assert [s for s, _ in ck.steps()] == [6, 4, 2]
  assert ck.restore_latest(program.abstract_state(canonical=True)).step == 6
  ck.close()
  from mjax.checkpoint.integrity import verify_step
  assert verify_step(os.path.join(workdir, 'checkpoints', '4'))[0] == 'ok'


@pytest.mark.parametrize('damage', ['state deleted', 'meta not JSON'])
def test_an_unreadable_newest_step_is_moved_aside_and_keeps_no_slot(tmp_path, caplog, damage):
  """The newest step unreadable (not a checksum failure) and the run resumed
  from the one before it, then ended before passing the unreadable step
  again: that step stayed in checkpoints/, one of the `keep` steps, and the
  next save made Orbax delete the good step the run had resumed from. It is
  moved aside as a damaged step is (renamed, never deleted)."""
  import shutil
  workdir = str(tmp_path / 'run')
  ckdir = os.path.join(workdir, 'checkpoints')
  keep = ['CheckpointConfig.save_every = 2', 'CheckpointConfig.keep = 2']
  trainer.run(cfg8('TrainConfig.steps = 3', *keep), workdir)   # saves 2, and 3 at the end
  assert sorted(int(s) for s in os.listdir(ckdir) if s.isdigit()) == [2, 3]
  if damage == 'state deleted':
    shutil.rmtree(os.path.join(ckdir, '3', 'state'))
  else:
    with open(os.path.join(ckdir, '3', 'meta', 'metadata'), 'w') as fh:
      fh.write('{"step": 3,')
  with caplog.at_level('WARNING'):
    out, _ = fit(cfg8('TrainConfig.steps = 4', *keep), workdir)   # saves 4 only
  assert out.start_step == 2
  # The good step resumed from survives retention; the unreadable one is
  # kept aside, whole as it was, for inspection.
  assert sorted(int(s) for s in os.listdir(ckdir) if s.isdigit()) == [2, 4]
  aside = [n for n in os.listdir(ckdir) if n.startswith('damaged-3-')]
  assert len(aside) == 1 and os.path.isdir(os.path.join(ckdir, aside[0], 'meta'))
  assert 'checkpoints/3 (step 3) is unreadable' in caplog.text, caplog.text
  assert re.search(r'moved \S+/checkpoints/3 aside to \S+/checkpoints/damaged-3-\d+ \(unreadable at restore',
                   caplog.text), caplog.text
  from mjax.checkpoint.integrity import verify_step
  assert verify_step(os.path.join(ckdir, '2'))[0] == 'ok'
  assert verify_step(os.path.join(ckdir, '4'))[0] == 'ok'


# --- single-replica restore: the broadcast, in one process ------------------------

def test_the_replica_broadcast_is_bit_exact_for_every_dtype():
  """The reading replica's arrays on every replica, bit for bit: -0.0 and a
  NaN payload (which a float sum would change), bfloat16 (sent as bytes),
  integers and booleans; in several programs when the chunk budget is small.
  (Two processes: tests/test_multihost.py.)"""
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from mjax.checkpoint.replica import ReplicaPlan, broadcast_from_replica, on_replica
  mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4, 1, 1), C.MeshConfig.AXES)
  plan = ReplicaPlan(mesh=mesh, replica_mesh=Mesh(mesh.devices[:1], mesh.axis_names), replicas=2, source=True)
  f32 = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
  f32[0, :3] = [-0.0, np.nan, -np.inf]
  f32.view(np.uint32)[0, 1] |= 0x1234   # a NaN with a payload
  values = {'f32': f32, 'bf16': f32.astype(jnp.bfloat16), 'i32': np.arange(-8, 8, dtype=np.int32),
            'bool': np.arange(16) % 3 == 0, 'u8': np.arange(32, dtype=np.uint8).reshape(8, 4),
            'scalar': np.int32(-5)}
  specs = {'f32': P('fsdp'), 'bf16': P(None, 'fsdp'), 'i32': P(), 'bool': P('fsdp'), 'u8': P('fsdp'),
           'scalar': P()}
  abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[k]))
              for k, v in values.items()}
  for chunk_bytes in (1 << 30, 1):   # one program; one per array
    replica = jax.tree.map(lambda a, v: jax.device_put(v, a.sharding), on_replica(plan, abstract), values)
    out = broadcast_from_replica(plan, replica, abstract, chunk_bytes=chunk_bytes)
    for k, v in values.items():
      assert out[k].sharding == abstract[k].sharding and out[k].dtype == v.dtype, k
      for shard in out[k].addressable_shards:   # both replicas, every device
        assert np.asarray(shard.data).tobytes() == np.asarray(v[shard.index]).tobytes(), (k, shard.device)
    assert all(x.is_deleted() for x in jax.tree.leaves(replica))   # the replica's copy is freed


def test_one_process_has_no_replica_plan():
  """In one process Orbax already reads each shard once and copies it to the
  devices that hold it: nothing to gain, every restore takes the usual path."""
  from mjax.checkpoint.replica import replica_plan
  program = train.make_program(cfg8('MeshConfig.data = 2', 'MeshConfig.fsdp = 4'),
                               make_mesh(cfg8('MeshConfig.data = 2', 'MeshConfig.fsdp = 4').mesh))
  assert replica_plan(program.abstract_state(canonical=True)) is None


# --- a host-local fast tier (CheckpointConfig.fast_scope = 'host') ----------------

def test_a_host_local_fast_tier_resumes_bitwise_and_only_on_its_own_layout(uninterrupted, tmp_path, caplog):
  """Each process's copies go to <fast_directory>/process-<i>; the newest
  step, only there, resumes bitwise. On another mesh those copies are not
  candidates (this process would hold other blocks): the persistent tier
  is used, and the copies newer than the step restored are dropped."""
  import shutil
  full_dir, full_state = uninterrupted
  workdir, fast = str(tmp_path / 'run'), tmp_path / 'fast'
  tiers = ['CheckpointConfig.save_every = 3', 'CheckpointConfig.fast_every = 2',
           f'CheckpointConfig.fast_directory = "{fast}"', "CheckpointConfig.fast_scope = 'host'"]
  import logging
  with caplog.at_level(logging.WARNING):
    trainer.run(cfg8('TrainConfig.steps = 5', *tiers), workdir)
  # Without Orbax's warning on every save of a process's own copy.
  assert not [r for r in caplog.records if 'Global object size logging' in r.getMessage()]
  assert os.listdir(fast) == ['process-0']
  assert sorted(int(s) for s in os.listdir(fast / 'process-0') if s.isdigit()) == [2, 4, 5]   # fast_keep + 1
  assert sorted(int(s) for s in os.listdir(os.path.join(workdir, 'checkpoints')) if s.isdigit()) == [3, 5]
  shutil.rmtree(os.path.join(workdir, 'checkpoints', '5'))
  # Offline tools see no host-local copies: one process's copy is no checkpoint.
  assert [(s, t) for s, t, _ in saved_steps(cfg8(*tiers).checkpoint, workdir)] == [(3, 'persistent')]

  other = cfg8(*tiers, 'MeshConfig.data = 2', 'MeshConfig.fsdp = 4')
  ck = Checkpointer(other.checkpoint, workdir)
  assert ck.steps() == [(5, 'fast'), (4, 'fast'), (3, 'persistent'), (2, 'fast')]
  restored = ck.restore_latest(train.make_program(other, make_mesh(other.mesh)).abstract_state(canonical=True))
  ck.close()
  assert restored.step == 3 and restored.path.endswith('checkpoints/3')
  assert sorted(int(s) for s in os.listdir(fast / 'process-0') if s.isdigit()) == [2]
  # Same layout: the host-local step 5 is the newest step there is.
  trainer.run(cfg8('TrainConfig.steps = 5', *tiers), workdir)   # saves 4 and 5 again, from 3
  shutil.rmtree(os.path.join(workdir, 'checkpoints', '5'))
  out, out_state = fit(cfg8(f'TrainConfig.steps = {N}', *tiers), workdir)
  assert out.start_step == 5
  assert losses(workdir) == losses(full_dir)
  assert_bitwise(out_state.params, full_state.params)
  _another_run_is_refused(tmp_path, tiers, workdir, fast)
  assert_bitwise(out_state.opt_state, full_state.opt_state)


def test_fast_scope_is_validated():
  with pytest.raises(C.ConfigError, match=r"CheckpointConfig.fast_scope = 'local' is not allowed: must be "
                                           r"'shared' .* or 'host'"):
    C.load_config(['tiny.gin'], ["CheckpointConfig.fast_scope = 'local'"])


def test_1f1b_pipeline_resume_is_bitwise_and_either_schedule_reads_the_checkpoint(tmp_path, tmp_path_factory):
  """Data 2 x pipeline 2 x tensor 2, interleaved 1F1B: stopped at step 3 and
  resumed, bit for bit the uninterrupted run; the same checkpoint resumed
  under the circular schedule continues within the layout tolerance (the
  parameter tree is the same for both schedules)."""
  pipe = ['MeshConfig.data = 2', 'MeshConfig.pipeline = 2', 'MeshConfig.tensor = 2',
          'MeshConfig.virtual_stages = 1', 'MeshConfig.microbatches = 2']
  cfg = lambda steps, schedule='1f1b': C.load_config(['tiny.gin'], [
      *SMALL, *pipe, f'TrainConfig.steps = {steps}', f'MeshConfig.pipeline_schedule = "{schedule}"'],
      num_devices=8)
  full_dir = str(tmp_path_factory.mktemp('full-1f1b'))
  _, full_state = fit(cfg(N), full_dir)
  workdir = str(tmp_path / 'resumed')
  fit(cfg(3), workdir)
  out, state = fit(cfg(N), workdir)
  assert out.start_step == 3 and losses(workdir) == losses(full_dir)
  assert_bitwise(state.params, full_state.params)
  other = str(tmp_path / 'circular')
  fit(cfg(3), other)
  fit(cfg(N, 'circular'), other)
  got, want = losses(other), losses(full_dir)
  for step in range(4, N + 1):
    assert got[step] == pytest.approx(want[step], rel=1e-4)


def test_a_full_disk_during_a_save_is_bad_input_naming_the_tier_and_the_steps_kept(tmp_path):
  # Orbax surfaces ENOSPC as a ValueError (RESOURCE_EXHAUSTED), now or at the
  # next save for an asynchronous one; it becomes one exit-2 message. The
  # steps kept are those on disk: Orbax strikes the ones beyond `keep` from
  # its own list before the save that would replace them commits.
  import types
  from mjax.checkpoint.failures import full_disk_is_bad_input
  for step in (2, 4):
    (tmp_path / str(step)).mkdir()
  tier = types.SimpleNamespace(name='persistent', directory=str(tmp_path),
                               manager=types.SimpleNamespace(all_steps=lambda: []))
  with pytest.raises(C.ConfigError, match=r'persistent checkpoint tier \(.*\) is full: a save \(step 6, or the one before .*'
                                           r'saved steps: 4, 2\); free space there.*CheckpointConfig.directory'):
    with full_disk_is_bad_input(tier, 6):
      raise ValueError('RESOURCE_EXHAUSTED: write failed: [errno 28] No space left on device')
  with pytest.raises(C.ConfigError, match='is full'):
    with full_disk_is_bad_input(tier, None):
      raise OSError(28, 'No space left on device')
  # A directory remounted read-only, or whose permissions were taken away,
  # midway: the same, not a traceback (wrapped, as Orbax raises it).
  for code, said in ((30, 'Read-only file system'), (13, 'Permission denied')):
    try:
      raise OSError(code, said)
    except OSError as inner:
      wrapped = RuntimeError('save failed')
      wrapped.__cause__ = inner
    with pytest.raises(C.ConfigError, match=rf'takes no more files: a save \(step 6.*failed with "{said}".*'
                                             r'saved steps: 4, 2\); make it writable again'):
      with full_disk_is_bad_input(tier, 6):
        raise wrapped
  with pytest.raises(ValueError, match='something else'):   # other failures stay what they are
    with full_disk_is_bad_input(tier, 6):
      raise ValueError('something else')


def test_a_disk_too_small_for_the_checkpoints_is_said_at_start_up(tmp_path, monkeypatch):
  # Room for less than one checkpoint: the first save will fail, hours in
  # perhaps; room for fewer than keep + 1 (a new step is written before the
  # oldest goes): a later one will. Said at start-up, by tier.
  import collections
  cfg = C.CheckpointConfig(directory=str(tmp_path / 'ckpt'), keep=3)
  tier = Checkpointer(cfg, str(tmp_path / 'run'))
  usage = collections.namedtuple('usage', 'total used free')
  gib = 2 ** 30
  monkeypatch.setattr(checkpointer.shutil, 'disk_usage', lambda p: usage(100 * gib, 99.5 * gib, 0.5 * gib))
  (w,) = tier.space_warnings(2 * gib)
  assert f"CheckpointConfig.directory = '{tmp_path}/ckpt' (the persistent tier) has 0.50 GiB free" in w
  assert 'less than one checkpoint' in w and '~2.00 GiB' in w and 'exit status 2' in w
  monkeypatch.setattr(checkpointer.shutil, 'disk_usage', lambda p: usage(100 * gib, 95 * gib, 5 * gib))
  (w,) = tier.space_warnings(2 * gib)
  assert 'room for 2 more checkpoint(s)' in w and 'keep = 3' in w and '(4 more' in w
  # Steps already on disk count: with three there, one more is all it needs.
  for step in ('10', '20', '30'):
    os.makedirs(tmp_path / 'ckpt' / step)
  assert tier.space_warnings(2 * gib) == []
  monkeypatch.setattr(checkpointer.shutil, 'disk_usage', lambda p: usage(100 * gib, 10 * gib, 90 * gib))
  os.rmdir(tmp_path / 'ckpt' / '30')
  assert tier.space_warnings(2 * gib) == []
  tier.close()
  # The fast tier's count is fast_keep, and a small state's sizes read in
  # MiB: it said "keep = 2", "~0.00 GiB (0.01 GiB free)", "or lower keep".
  mib = 2 ** 20
  cfg = C.CheckpointConfig(directory=str(tmp_path / 'ckpt2'), fast_every=5, fast_keep=2,
                           fast_directory=str(tmp_path / 'fast'))
  tier = Checkpointer(cfg, str(tmp_path / 'run2'))
  monkeypatch.setattr(checkpointer.shutil, 'disk_usage', lambda p: usage(100 * gib, 100 * gib - 9 * mib, 9 * mib))
  fast = [w for w in tier.space_warnings(3.5 * mib) if 'the fast tier' in w]
  assert len(fast) == 1 and 'room for 2 more checkpoint(s) of ~3.5 MiB (9.0 MiB free)' in fast[0], fast
  assert 'fewer than CheckpointConfig.fast_keep = 2 needs (3 more' in fast[0]
  assert fast[0].endswith('or lower CheckpointConfig.fast_keep.'), fast
  tier.close()


def test_a_disk_that_fills_during_training_is_said_once_with_no_tracebacks(tmp_path, repo_root):
  # A 20 MB filesystem, a state of ~40 MB: warned at start-up, then the
  # first save fails. What the user reads is the warning and one message:
  # neither Orbax's logs of the failed write (a traceback per save thread)
  # nor TensorStore's callbacks into Orbax's closed event loop (one
  # traceback per array) in between.
  fs = _tmpfs(tmp_path / 'fs', 'size=20m')
  if fs is None:
    pytest.skip('mounting a tmpfs needs root')
  try:
    cmd = [os.path.join(os.path.dirname(sys.executable), 'mjax-train'), '--gin_file', 'configs/tiny.gin',
           '--workdir', str(fs / 'run'), '--gin.TrainConfig.steps=3', '--gin.CheckpointConfig.save_every=2',
           '--gin.TrainConfig.progress=False', '--gin.TrainConfig.compilation_cache_dir=None']
    env = {k: v for k, v in os.environ.items() if not k.startswith(('MJAX_', 'XLA_FLAGS'))}
    run = subprocess.run(cmd, env={**env, 'JAX_PLATFORMS': 'cpu'}, cwd=repo_root, capture_output=True,
                         text=True, timeout=300)
  finally:
    subprocess.run(['umount', str(fs)], capture_output=True)
  out = run.stdout + run.stderr
  assert run.returncode == 2, out[-3000:]
  assert 'less than one checkpoint of this train state' in run.stdout
  assert 'the persistent checkpoint tier' in run.stderr and 'is full' in run.stderr
  assert 'Traceback' not in out and 'Event loop is closed' not in out, out[-3000:]


def test_a_checkpoint_filesystem_remounted_read_only_midway_ends_the_run_at_once(tmp_path, repo_root):
  # Before, the failed save left Orbax's background threads waiting up to
  # 20 minutes for a directory that was never made, the process unable to
  # exit, and a page of tracebacks; now one message, exit 2, the steps kept.
  fs = _tmpfs(tmp_path / 'fs', 'size=64m')
  if fs is None:
    pytest.skip('mounting a tmpfs needs root')
  cmd = [os.path.join(os.path.dirname(sys.executable), 'mjax-train'), '--gin_file', 'configs/tiny.gin',
         '--workdir', str(tmp_path / 'run'), f'--gin.CheckpointConfig.directory={fs / "ck"}',
         '--gin.TrainConfig.steps=400', '--gin.CheckpointConfig.save_every=2', '--gin.TrainConfig.progress=False',
         '--gin.ModelConfig.d_model=128', '--gin.ModelConfig.n_layers=2']
  env = {k: v for k, v in os.environ.items() if not k.startswith(('MJAX_', 'XLA_FLAGS'))}
  proc = subprocess.Popen(cmd, env={**env, 'JAX_PLATFORMS': 'cpu'}, cwd=repo_root, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.time() + 240
    while not (fs / 'ck' / '4').is_dir():
      assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
      time.sleep(0.1)
    # A remount waits for no file to be open for writing in it.
    while subprocess.run(['mount', '-o', 'remount,ro', str(fs)], capture_output=True).returncode:
      assert time.time() < deadline
      time.sleep(0.05)
    out = proc.communicate(timeout=60)[0]
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.communicate()
    subprocess.run(['umount', str(fs)], capture_output=True)
  assert proc.returncode == 2, out[-3000:]
  assert 'the persistent checkpoint tier' in out and 'takes no more files' in out and \
      'failed with "Read-only file system"' in out, out[-3000:]
  assert re.search(r'saved steps: (\d+, )*4, 2\)', out) and 'Traceback' not in out, out[-3000:]


def test_a_background_save_failed_in_this_process_alone_ends_it_with_the_message(tmp_path, monkeypatch):
  # In a multi-process job, a save that found the disk full in one process
  # only never reached a main thread: that process's Orbax finalize thread
  # went on to its closing barrier while the others waited in the "write
  # complete" one, each until io_timeout_s (30 minutes), and nothing was
  # said. The save watch hears Orbax's record of the failure (its save
  # thread's, through the log filter) and ends the process with the message
  # the main thread would have given, naming the tier and step.
  import logging
  import threading
  import types
  failures.quiet_failed_io_aftermath()
  persistent = types.SimpleNamespace(name='persistent', directory=str(tmp_path / 'ck'))
  fast = types.SimpleNamespace(name='fast', directory=str(tmp_path / 'ck-fast'))
  (tmp_path / 'ck-fast' / '2').mkdir(parents=True)
  orbax_file = os.path.join(os.sep, 'site-packages', 'orbax', 'checkpoint', 'async_checkpointer.py')
  full = (ValueError, ValueError('RESOURCE_EXHAUSTED: write failed: [errno 28] No space left on device'), None)

  def failed_save(thread, exc_info=full):
    record = logging.LogRecord(
        'absl', logging.ERROR, orbax_file, 1, '[process=1] Failed to run 3 Handler Commit operations or the Commit '
        f'callback in background save thread, directory: {fast.directory}/4.orbax-checkpoint-tmp-1764', None,
        exc_info)
    record.threadName = thread
    # A full disk's record is dropped (the message says it once); any other
    # failure's is left to say what it can.
    # (Python 3.12's filter() returns the record where 3.11's returned True.)
    assert bool(logging.getLogger('absl').filter(record)) == (exc_info is not full)

  # (Long enough that the main thread's raise below comes first on a loaded machine.)
  monkeypatch.setattr(Checkpointer, 'SAVE_WATCH_GRACE_S', 2.0)
  said = []
  monkeypatch.setattr(Checkpointer, '_leave', lambda self, message, status: said.append((message, status)))

  def watch():
    ckpt = Checkpointer.__new__(Checkpointer)
    ckpt.tiers, ckpt._closed, ckpt._locked, ckpt.leave_status = [persistent, fast], threading.Event(), [], None
    failures.FailedSave.seen.clear()
    failures.FailedSave.said_here.clear()
    thread = threading.Thread(target=ckpt._watch_saves, daemon=True)
    thread.start()
    return ckpt, thread

  ckpt, thread = watch()
  failed_save('MainThread')    # raised where it happened: the main thread says it
  time.sleep(1.5)
  assert said == [] and thread.is_alive()
  failed_save('async_save')
  thread.join(timeout=10)
  assert not thread.is_alive() and len(said) == 1, said
  (message, status), = said
  assert message.startswith('the fast checkpoint tier (') and 'a save (step 4, or the one before' in message
  assert 'failed with "No space left on device"' in message and 'saved steps: 2)' in message
  assert 'Process 0 of 1 found it' in message and 'CheckpointConfig.fast_directory' in message
  assert status == 2    # bad input: a restart would fail the same way

  # Any other failure of the write (an I/O error of the filesystem) is a
  # fault: exit 1, which the driver restarts from the steps kept.
  ckpt, thread = watch()
  failed_save('async_save', (OSError, OSError(5, 'Input/output error'), None))
  thread.join(timeout=10)
  assert not thread.is_alive() and len(said) == 2
  message, status = said.pop()
  assert status == 1 and message.startswith(f'a save into the fast checkpoint tier ({fast.directory}) (step 4) '
                                            'failed in process 0 of 1, the others waiting for it: OSError: [Errno 5] '
                                            'Input/output error. The steps saved before are intact (saved steps: 2)')
  # What Orbax logs and goes on from (an old step it could not delete) is
  # no failed save; nor is the barrier after this process's writes, failed
  # because another process left (that one says why): one line for it.
  ckpt, thread = watch()
  barrier = logging.LogRecord('absl', logging.ERROR, orbax_file, 1, 'Failed to run 3 Handler Commit operations', None,
                              (TimeoutError, TimeoutError('Timed out while waiting for async_write_complete barrier.'),
                               None))
  barrier.threadName = 'async_save'
  assert logging.getLogger('absl').filter(barrier) and barrier.exc_info is None
  assert 'another process of the job left or is stuck' in barrier.getMessage()
  gone = logging.LogRecord('absl', logging.ERROR, orbax_file.replace('async_checkpointer', 'storage_backend'), 1,
                           f'Failed to remove checkpoint ({fast.directory}/2)', None,
                           (OSError, OSError(13, 'Permission denied'), None))
  gone.threadName = 'save_finalize'
  logging.getLogger('absl').filter(gone)
  time.sleep(1.5)
  assert thread.is_alive() and len(said) == 1
  ckpt.release_lock()
  thread.join(timeout=10)

  # The main thread raised it itself within the grace (every process's save
  # failed, so their barriers met): one message, the main thread's.
  ckpt, thread = watch()
  failed_save('async_save')
  with pytest.raises(C.ConfigError, match='is full'):
    with failures.full_disk_is_bad_input(fast, 4):
      raise OSError(28, 'No space left on device')
  thread.join(timeout=10)
  assert not thread.is_alive() and len(said) == 1
  # A closed checkpointer's watch ends, saying nothing.
  ckpt, thread = watch()
  ckpt.release_lock()
  thread.join(timeout=10)
  assert not thread.is_alive() and len(said) == 1


def test_a_full_host_tier_found_before_the_next_save_is_bad_input(tmp_path):
  # A host-local fast tier's failed save surfaced at the next one's wait:
  # exit 1 with Orbax's traceback, restarted by the driver into the same
  # full disk, three times. Now the one message and exit 2.
  import types

  def full():
    raise ValueError('RESOURCE_EXHAUSTED: write failed: [errno 28] No space left on device')
  tier = types.SimpleNamespace(name='fast', directory=str(tmp_path), keep=2, host=True,
                               manager=types.SimpleNamespace(wait_until_finished=full, all_steps=lambda: []))
  ckpt = Checkpointer.__new__(Checkpointer)
  with pytest.raises(C.ConfigError, match=r'the fast checkpoint tier \(.*\) is full: a save \(the last one\)'):
    ckpt._host_turn(tier)


def test_host_tier_saves_meet_in_one_barrier_however_many_there_are(tmp_path, monkeypatch):
  # The coordination service keeps every barrier name of the job: a name per
  # save grew process 0 by ~0.8 KB a save at 2 processes (1.0 KB at 6, more
  # with each process), for the whole length of an attempt.
  import types
  from mjax import distributed
  names = []
  monkeypatch.setattr(distributed, 'barrier', lambda name, timeout_s=300.0: names.append(name))
  tier = types.SimpleNamespace(name='fast', directory=str(tmp_path), keep=2, host=True,
                               manager=types.SimpleNamespace(wait_until_finished=lambda: None, all_steps=lambda: []))
  ckpt = Checkpointer.__new__(Checkpointer)
  ckpt.cfg = C.CheckpointConfig()
  for _ in range(1000):
    ckpt._host_turn(tier)
  assert len(names) == 1000 and set(names) == {'ckpt/host/save'}


def test_the_save_watch_leaves_with_the_message_for_the_driver_too(tmp_path):
  # Under the fault-tolerance driver the message is also a fact of the
  # process, which the driver's bad_input event and give-up line report
  # (they said only "exit status 2" before).
  from mjax import protocol
  code = ('import sys\nfrom mjax.checkpoint import Checkpointer\n'
          'c = Checkpointer.__new__(Checkpointer)\n'
          f'c.workdir = {str(tmp_path)!r}\n'
          'c._leave("the persistent checkpoint tier (/x) is full", 2)\nprint("not left")\n')
  env = {**os.environ, protocol.DRIVER_ADDRESS_ENV: '127.0.0.1:9'}
  proc = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and 'not left' not in proc.stdout, proc
  assert proc.stderr.endswith('error: the persistent checkpoint tier (/x) is full\n'), proc.stderr
  facts = protocol.read_facts(str(tmp_path), 0)
  assert facts[protocol.USER_ERROR] == 'the persistent checkpoint tier (/x) is full', facts


def test_the_quieting_hooks_drop_only_the_failed_ios_aftermath(monkeypatch):
  import asyncio
  import logging
  import types
  seen = []
  monkeypatch.setattr(sys, 'unraisablehook', lambda u: seen.append(u.exc_value))
  failures.quiet_failed_io_aftermath()
  failures.quiet_failed_io_aftermath()          # twice: still one filter, one hook
  import warnings
  with warnings.catch_warnings(record=True) as warned:
    # The unstarted reads of a restore that failed, collected.
    warnings.warn("coroutine '_read_array_index_and_device_put' was never awaited", RuntimeWarning)
    warnings.warn("coroutine 'mine' was never awaited", RuntimeWarning)
  assert [str(w.message) for w in warned] == ["coroutine 'mine' was never awaited"]
  loop = asyncio.new_event_loop()
  loop.close()
  try:
    loop.call_soon_threadsafe(print)         # what a late TensorStore completion does
  except RuntimeError as e:
    late = e
  sys.unraisablehook(types.SimpleNamespace(exc_value=late))
  elsewhere = RuntimeError('Event loop is closed')    # the same words, raised anywhere else
  other = RuntimeError('something else')
  sys.unraisablehook(types.SimpleNamespace(exc_value=elsewhere))
  sys.unraisablehook(types.SimpleNamespace(exc_value=other))
  assert seen == [elsewhere, other]
  absl = logging.getLogger('absl')
  assert sum(isinstance(f, failures._FailedIoLogFilter) for f in absl.filters) == 1
  full = (ValueError, ValueError('Failed to write: No space left on device'), None)
  orbax_file = os.path.join(os.sep, 'site-packages', 'orbax', 'checkpoint', 'async_checkpointer.py')
  from_orbax = logging.LogRecord('absl', logging.ERROR, orbax_file, 1, 'save failed', None, full)
  from_others = logging.LogRecord('absl', logging.ERROR, __file__, 1, 'save failed', None, full)
  other_error = logging.LogRecord('absl', logging.ERROR, orbax_file, 1, 'permission denied', None, None)
  assert not absl.filter(from_orbax) and absl.filter(from_others) and absl.filter(other_error)
  # A write task of the failed save, collected with its error unread.
  aio = logging.getLogger('asyncio')
  task = ('Task exception was never retrieved\nfuture: <Task finished coro=<write_fragment() defined at '
          f'{orbax_file}:188> exception=ValueError(\'Failed writing: No space left on device\')>')
  unread = logging.LogRecord('asyncio', logging.ERROR, asyncio.__file__, 1, task, None, None)
  own = logging.LogRecord('asyncio', logging.ERROR, asyncio.__file__, 1, task.replace(orbax_file, __file__), None, None)
  assert not aio.filter(unread) and aio.filter(own)
  # A read task of a damaged step (a truncated file), collected with its
  # error unread: the restore said once why the step cannot be used.
  read = ('Task exception was never retrieved\nfuture: <Task finished coro=<async_deserialize() done, defined at '
          f'{orbax_file}:394> exception=Exception("Encountered error while reading array index: (slice(0, 1, 1),). '
          'See full TensorStore details: ...")>')
  unread_read = logging.LogRecord('asyncio', logging.ERROR, asyncio.__file__, 1, read, None, None)
  other_task = logging.LogRecord('asyncio', logging.ERROR, asyncio.__file__, 1,
                                 read.replace('Encountered error while reading', 'Something else in'), None, None)
  assert not aio.filter(unread_read) and aio.filter(other_task)
  # A bare future of the failed save (no coroutine in its repr: Orbax is
  # named only by the frames of its error), collected with its error unread.
  def failed_in(filename):
    try:
      exec(compile("raise ValueError('RESOURCE_EXHAUSTED: Failed writing: No space left on device')",
                   filename, 'exec'))
    except ValueError as e:
      return e
  future = ('Future exception was never retrieved\nfuture: <Future finished exception=ValueError('
            '\'RESOURCE_EXHAUSTED: Failed writing: No space left on device\')>')
  for where, dropped in ((orbax_file, True), (__file__, False)):
    e = failed_in(where)
    record = logging.LogRecord('asyncio', logging.ERROR, asyncio.__file__, 1, future, None, (type(e), e, e.__traceback__))
    assert aio.filter(record) is not dropped, where


def test_a_tensorstore_read_error_is_said_by_its_array_and_step():
  from mjax.checkpoint.failures import read_error
  spec = ("Encountered error while reading array index: (slice(0, 2, 1),). See full TensorStore details: "
          "<bound method spec of TensorStore({\n  'base': {'kvstore': {'base': {'driver': 'file', "
          "'path': '/run/checkpoints/4/state/'},\n 'path': 'opt_state.1.mu.layers.block_0.attn.query.kernel/'}}})>")
  assert read_error(Exception(spec)) == (
      "Exception: Encountered error while reading array index: (slice(0, 2, 1),). (array "
      "'opt_state.1.mu.layers.block_0.attn.query.kernel' in /run/checkpoints/4/state/)")


def test_a_checkpoint_of_another_model_structure_is_said_by_its_first_array(tmp_path):
  # Restored into a config that makes other arrays (an untied head, norms
  # without biases), Orbax's error said only "tree structures do not match:"
  # and the advice was to check the files, which `--verify` found good.
  import jax.numpy as jnp
  import orbax.checkpoint as ocp
  from mjax.checkpoint.failures import OTHER_MODEL, read_error
  saved = {'params': {'embedding': jnp.zeros((4, 2)), 'norm': {'bias': jnp.zeros(2), 'scale': jnp.ones(2)}},
           'opt_state': {'mu': jnp.zeros(2)}}
  with ocp.PyTreeCheckpointer() as ckpt:
    ckpt.save(tmp_path / 'state', saved)
    for wanted, said in (
        ({**saved, 'params': {**saved['params'], 'lm_head': jnp.zeros((2, 4))}},
         'the config makes params.lm_head, the checkpoint has no such array: '),
        ({**saved, 'params': {**saved['params'], 'norm': {'scale': jnp.ones(2)}}, 'opt_state': {}},
         'the checkpoint holds params.norm.bias, which the config does not make (2 arrays differ): ')):
      abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), wanted)
      with pytest.raises(ValueError) as e:
        ckpt.restore(tmp_path / 'state', args=ocp.args.PyTreeRestore(item=abstract))
      assert read_error(e.value).startswith(said + OTHER_MODEL + ' structure'), read_error(e.value)
    # The same model, another optimizer's state: OptimConfig is what to compare.
    other = {**saved, 'opt_state': {'nu': saved['opt_state']['mu']}}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), other)
    with pytest.raises(ValueError) as e:
      ckpt.restore(tmp_path / 'state', args=ocp.args.PyTreeRestore(item=abstract))
    assert read_error(e.value).startswith('the checkpoint holds opt_state.mu, which the config does not make (2 '
                                          'arrays differ): the checkpoint holds the state of another optimizer; '
                                          'compare OptimConfig'), read_error(e.value)


def test_a_runs_own_checkpoint_directory_is_refused_to_another_run(tmp_path):
  # The default tier (WORKDIR/checkpoints) is claimed too: another run
  # pointed at it would resume from and delete the first run's steps.
  from mjax.checkpoint.directories import foreign, OWNER_FILE, saved_steps
  from mjax.checkpoint.guards import check_owner
  a, b = tmp_path / 'a', tmp_path / 'b'
  for w in (a, b):
    (w / 'checkpoints').mkdir(parents=True)
    (w / 'config.json').write_text(json.dumps({'model': {}, 'checkpoint': {}}))
  (a / 'checkpoints' / '7').mkdir()
  check_owner({'persistent': str(a / 'checkpoints')}, str(a))
  assert json.load(open(a / 'checkpoints' / OWNER_FILE))['workdir'] == str(a)
  with pytest.raises(C.ConfigError, match=rf"holds the checkpoints of another run, workdir '{a}' "
                                          rf"\(its claim .* says so\).*delete {OWNER_FILE} there"):
    check_owner({'persistent': str(a / 'checkpoints')}, str(b))
  assert saved_steps(C.CheckpointConfig(directory=str(a / 'checkpoints')), str(b)) == []
  # A workdir from before default tiers were claimed: its config.json says whose.
  os.unlink(a / 'checkpoints' / OWNER_FILE)
  with pytest.raises(C.ConfigError, match=r"\(it lies in that run's workdir\).*one per workdir\)\.$"):
    check_owner({'persistent': str(a / 'checkpoints' / 'sub')}, str(b))
  check_owner({'persistent': str(a / 'checkpoints')}, str(a))
  # A moved workdir takes its checkpoints along ...
  os.rename(a, tmp_path / 'moved')
  moved = tmp_path / 'moved'
  check_owner({'persistent': str(moved / 'checkpoints')}, str(moved))
  assert json.load(open(moved / 'checkpoints' / OWNER_FILE))['workdir'] == str(moved)
  assert [s for s, _, _ in saved_steps(C.CheckpointConfig(), str(moved))] == [7]
  # ... but a run whose workdir holds another run's workdir does not take that one's.
  (tmp_path / 'config.json').write_text(json.dumps({'model': {}, 'checkpoint': {}}))
  assert foreign(str(moved / 'checkpoints'), str(tmp_path)) == str(moved)
  with pytest.raises(C.ConfigError, match='holds the checkpoints of another run'):
    check_owner({'persistent': str(moved / 'checkpoints')}, str(tmp_path))
  assert json.load(open(moved / 'checkpoints' / OWNER_FILE))['workdir'] == str(moved)


def test_two_tiers_in_one_directory_are_refused(tmp_path):
  # Each tier deletes the steps it no longer keeps: in one directory (or
  # one inside the other) they deleted each other's, and the run hung.
  from mjax.checkpoint import Checkpointer
  workdir = str(tmp_path / 'run')
  for fast, scope, how in [(f'{workdir}/checkpoints', 'shared', 'the same directory'),
                           (f'{workdir}/checkpoints/12', 'shared', r'one inside a step \(12\) of the other'),
                           (f'{workdir}/checkpoints/12/fast', 'host', r'one inside a step \(12\) of the other')]:
    cfg = C.CheckpointConfig(fast_every=1, fast_directory=fast, fast_scope=scope)
    with pytest.raises(C.ConfigError, match=f'the fast and persistent tiers\\) are {how}'):
      Checkpointer(cfg, workdir)
  assert not os.path.exists(workdir)
  # Apart: side by side, or one in a subdirectory of the other not named like a step.
  for fast, scope in [(str(tmp_path / 'checkpoints-fast'), 'shared'), (f'{workdir}/checkpoints/fast', 'shared'),
                      (f'{workdir}/checkpoints', 'host')]:
    Checkpointer(C.CheckpointConfig(fast_every=1, fast_directory=fast, fast_scope=scope), workdir).close()


def test_a_tier_that_holds_the_workdir_is_refused(tmp_path, monkeypatch):
  # CheckpointConfig.directory = '/' saved into the root, and its claim made
  # every other run's workdir and every tool's output on the machine
  # count as inside this run's checkpoints.
  from mjax.checkpoint.directories import OWNER_FILE
  workdir = tmp_path / 'runs' / 'a'
  monkeypatch.setenv('HOME', str(tmp_path))
  for cfg, what in [(C.CheckpointConfig(directory=str(tmp_path)), 'holds'),
                    (C.CheckpointConfig(directory='~'), 'holds'),
                    (C.CheckpointConfig(directory='..'), 'holds'),
                    (C.CheckpointConfig(directory='.'), 'is'),
                    (C.CheckpointConfig(fast_every=1, fast_directory=str(tmp_path / 'runs')), 'holds')]:
    with pytest.raises(C.ConfigError, match=f"tier\\) {what} the run's workdir"):
      Checkpointer(cfg, str(workdir))
  assert not any(p.name in (OWNER_FILE, '.mjax-lock') for p in tmp_path.rglob('*'))
  # Below the workdir, or beside it: its own.
  Checkpointer(C.CheckpointConfig(directory='ckpt'), str(workdir)).close()
  Checkpointer(C.CheckpointConfig(directory=str(tmp_path / 'runs' / 'a-ckpt')), str(workdir)).close()


def test_a_run_is_its_workdir_however_the_path_is_spelled(tmp_path):
  from mjax.checkpoint.directories import foreign, OWNER_FILE
  from mjax.checkpoint.guards import check_owner
  (tmp_path / 'real' / 'run').mkdir(parents=True)
  os.symlink(tmp_path / 'real', tmp_path / 'link')
  tier = str(tmp_path / 'fast')
  check_owner({'fast': tier}, str(tmp_path / 'link' / 'run'))        # claimed through the link
  assert json.load(open(os.path.join(tier, OWNER_FILE)))['workdir'] == str(tmp_path / 'real' / 'run')
  assert foreign(tier, str(tmp_path / 'real' / 'run')) is None
  check_owner({'fast': tier}, str(tmp_path / 'real' / 'run'))         # the same run: no error
  assert foreign(tier, str(tmp_path / 'other')) == str(tmp_path / 'real' / 'run')
  with pytest.raises(C.ConfigError, match='holds the checkpoints of another run'):
    check_owner({'fast': tier}, str(tmp_path / 'other'))


def test_a_second_run_on_a_workdir_in_use_is_refused_and_a_nested_workdir_too(tmp_path, monkeypatch):
  """Two runs saving into one directory would delete and overwrite each
  other's steps: process 0 holds a lock on the workdir and each tier for
  as long as it runs, and a second run is refused, naming the holder. A
  later attempt of the same fault-tolerance job is only warned about."""
  import subprocess
  import sys
  from mjax import protocol
  workdir, tier = str(tmp_path / 'run'), str(tmp_path / 'run' / 'checkpoints')
  holder = subprocess.Popen(
      [sys.executable, '-c', 'import sys, time; from mjax.checkpoint import locks as c; '
       'assert c.lock_run({"persistent": sys.argv[2]}, sys.argv[1]) ; print("held", flush=True); time.sleep(600)',
       workdir, tier], stdout=subprocess.PIPE, text=True,
      env={**os.environ, protocol.DRIVER_ADDRESS_ENV: '127.0.0.1:1', protocol.SECRET_ENV: 'ab' * 16})
  try:
    assert holder.stdout.readline().strip() == 'held'
    monkeypatch.delenv(protocol.DRIVER_ADDRESS_ENV, raising=False)
    monkeypatch.setattr(locks, 'UNDRIVEN_LOCK_WAIT_S', 1.0)
    with pytest.raises(C.ConfigError, match=rf'{workdir} is in use by another run: process {holder.pid} on '):
      locks.lock_run({'persistent': tier}, workdir)
    # The same job's next attempt, its predecessor not gone yet: warned, goes on.
    monkeypatch.setenv(protocol.DRIVER_ADDRESS_ENV, '127.0.0.1:1')
    monkeypatch.setenv(protocol.SECRET_ENV, 'ab' * 16)
    assert locks.lock_run({'persistent': tier}, workdir, timeout_s=0.0) == []
    monkeypatch.setenv(protocol.SECRET_ENV, 'cd' * 16)   # another job's: refused
    with pytest.raises(C.ConfigError, match='in use by another run'):
      locks.lock_run({'persistent': tier}, workdir, timeout_s=0.0)
  finally:
    holder.kill()
    holder.wait()
  # The holder gone (whatever killed it), the lock is free; held twice in
  # one process (two Checkpointers), it is let go of by the last close.
  monkeypatch.delenv(protocol.DRIVER_ADDRESS_ENV)
  first = locks.lock_run({'persistent': tier}, workdir)
  second = locks.lock_run({'persistent': tier}, workdir)
  assert sorted(first) == sorted(second) == sorted({os.path.realpath(workdir), os.path.realpath(tier)})
  locks.unlock_run(first)
  probe = [sys.executable, '-c', 'import sys; from mjax.checkpoint import locks as c; c.UNDRIVEN_LOCK_WAIT_S = 0; '
           'c.lock_run({"persistent": sys.argv[2]}, sys.argv[1])', workdir, tier]
  assert subprocess.run(probe, capture_output=True, timeout=120).returncode != 0   # still held once
  locks.unlock_run(second)
  assert subprocess.run(probe, capture_output=True, timeout=120).returncode == 0
  # A workdir in (or being) another run's checkpoint directory: that run's
  # clean-up of old steps would delete it.
  from mjax import jsonfile
  jsonfile.write_atomic(os.path.join(tier, directories.OWNER_FILE), {'workdir': os.path.realpath(workdir)})
  guards.check_not_inside_a_tier(workdir)
  for inside in (tier, os.path.join(tier, '4')):
    with pytest.raises(C.ConfigError, match=rf"is the checkpoint directory of the run with workdir '{os.path.realpath(workdir)}'"):
      guards.check_not_inside_a_tier(inside)


def test_a_start_refused_for_another_runs_directory_writes_nothing_there(tmp_path):
  """A workdir that is another run's checkpoint tier, a step in it, or a
  directory inside that run's workdir: refused before the run id (or
  anything) is written there."""
  from mjax import jsonfile, workdir as workdir_lib
  base = tmp_path / 'base'
  (base / 'checkpoints' / '4').mkdir(parents=True)
  (base / 'tensorboard').mkdir()
  (base / 'config.json').write_text(json.dumps({'model': {}, 'checkpoint': {}}))
  jsonfile.write_atomic(str(base / 'checkpoints' / directories.OWNER_FILE), {'workdir': str(base)})
  files = lambda: sorted(os.path.join(d, f) for d, ds, fs in os.walk(tmp_path) for f in fs + ds)
  before = files()
  cfg = C.load_config(['tiny.gin'], [])
  for workdir, said in ((base / 'checkpoints', r"'\S+/checkpoints' is the checkpoint directory of the run"),
                        (base / 'checkpoints' / '4', r"lies inside '\S+/checkpoints', which is the checkpoint"),
                        (base / 'checkpoints' / '99', r"lies inside '\S+/checkpoints', which is the checkpoint"),
                        (base / 'tensorboard' / 'new', rf"lies inside '{base}/tensorboard', the tensorboard/"),
                        (base / 'tensorboard', rf"lies inside '{base}/tensorboard', the tensorboard/ folder of "
                                               rf"the mjax run with workdir '{base}'")):
    with pytest.raises(C.ConfigError, match=said):
      workdir_lib.check_workdir(cfg, str(workdir), True)
    assert files() == before, workdir
  # A folder of one's own in a run's workdir is no run's folder.
  workdir_lib.check_workdir(cfg, str(base / 'ablation'), True)


def test_checkpoint_directories_relative_to_the_workdir_and_unset_variables_refused(tmp_path, monkeypatch):
  # config.gin records the path as given: relative to the workdir, it names
  # the same directory wherever a resume (or mjax-eval) is started from.
  monkeypatch.chdir(tmp_path)
  cfg = C.CheckpointConfig(directory='ckpt', fast_every=5, fast_directory='~/fast-$MJAX_TEST_SET')
  monkeypatch.setenv('MJAX_TEST_SET', 'x')
  dirs = directories.tier_directories(cfg, '/data/run1')
  assert dirs == {'persistent': '/data/run1/ckpt', 'fast': os.path.expanduser('~/fast-x')}
  assert directories.tier_directories(C.CheckpointConfig(directory='gs://b/ck'), 'run')['persistent'] == 'gs://b/ck'
  monkeypatch.delenv('MJAX_TEST_SET')
  with pytest.raises(C.ConfigError, match=r"CheckpointConfig.fast_directory = '~/fast-\$MJAX_TEST_SET': "
                                          r"\$MJAX_TEST_SET is not set"):
    directories.tier_directories(cfg, '/data/run1', strict=True)
  # Outside the run (the driver, mjax-eval), whose environment may lack it:
  # a tier with no steps seen here, not an error.
  assert directories.tier_directories(cfg, '/data/run1')['fast'] == os.path.expanduser('~/fast-$MJAX_TEST_SET')


def test_the_peak_is_measured_where_it_cannot_be_cached(tmp_path, monkeypatch):
  # A read-only HOME (here: a file where the cache directory should be)
  # costs the cache, not the run.
  from mjax import devices
  monkeypatch.setattr(devices, '_busy_cpu_seconds', lambda cpus: None)   # a quiet machine, whatever runs beside
  (tmp_path / 'file').write_text('')
  peak, source = devices.peak_flops(jax.devices()[:1], 'float32', str(tmp_path / 'file' / 'cache'))
  assert peak > 0 and source.startswith('measured, not cached (')


def test_a_peak_measured_while_other_work_holds_the_cores_is_estimated_and_not_kept(tmp_path, monkeypatch):
  # A second test worker or a build on the same cores once halved the
  # measured peak; cached, it put every later run's MFU above 100%.
  from mjax import devices
  hogs = [subprocess.Popen([sys.executable, '-c', 'while True: pass']) for _ in devices._cpus()[:4]]
  try:
    time.sleep(0.5)
    peak, source = devices.peak_flops(jax.devices()[:1], 'float32', str(tmp_path))
  finally:
    for p in hogs:
      p.kill()
      p.wait()
  assert peak > 0 and source.startswith('estimated from CPU time while other work held the cores, not cached')
  assert not (tmp_path / 'peak_flops.json').exists()
  # Measured on quiet cores, the figure is kept for the next run.
  monkeypatch.setattr(devices, '_busy_cpu_seconds', lambda cpus: None)
  peak, source = devices.peak_flops(jax.devices()[:1], 'float32', str(tmp_path))
  assert source.startswith('measured:') and (tmp_path / 'peak_flops.json').exists()
  assert devices.peak_flops(jax.devices()[:1], 'float32', str(tmp_path)) == (peak, source.replace('measured', 'measured, cached', 1))


def test_the_checkpoint_io_timeout_reaches_orbax(tmp_path):
  # Orbax gives a background save 20 minutes by default; a large state on
  # network storage takes longer, and the save then failed the run.
  cfg = C.CheckpointConfig(io_timeout_s=5400.0, fast_every=1, fast_directory=str(tmp_path / 'fast'))
  ck = Checkpointer(cfg, str(tmp_path / 'run'))
  try:
    # (Orbax keeps its options privately; what it was given is what it waits.)
    assert {t.name: t.manager._options.async_options.timeout_secs for t in ck.tiers} == \
        {'persistent': 5400, 'fast': 5400}
  finally:
    ck.close()
  with pytest.raises(C.ConfigError, match=r'CheckpointConfig.io_timeout_s = 0.0 is not allowed'):
    C.validate(C.Config(checkpoint=C.CheckpointConfig(io_timeout_s=0.0)))


def test_a_tier_few_processes_cannot_write_is_their_hosts_fault(tmp_path, monkeypatch):
  # Process 2 of 3 cannot write where the others can: its host (a mount
  # missing there), not the config, which a restart without it cures.
  from mjax import distributed
  from mjax.errors import HostFault
  monkeypatch.setattr(jax, 'process_count', lambda: 3)
  dirs = {'persistent': str(tmp_path)}
  said = {2: json.dumps({'persistent': 'Read-only file system'})}
  monkeypatch.setattr(distributed, 'report_exceptions', lambda key, mine, timeout_s=300.0: said)
  with pytest.raises(HostFault, match=r"cannot be written in process\(es\) \[2\] of 3: Read-only file system\. "
                                      r"The other processes can write it") as e:
    guards.check_writable(dirs)
  assert e.value.processes == [2]
  # Two of three: the directory's fault, the config's to fix.
  said[1] = said[2]
  with pytest.raises(C.ConfigError, match=r'in process\(es\) \[1, 2\] of 3'):
    guards.check_writable(dirs)


def test_a_replicated_state_is_saved_without_compiling_a_program_per_slice(tmp_path, monkeypatch):
  """Orbax cuts an array replicated over devices into one slice per replica,
  each by a program compiled per shape, offset and device in the save's
  blocking part: 3.9 s of a 0.7M-parameter model's first save on 8 CPU
  devices. Arrays whose slices would be under MIN_SLICE_BYTES are written
  whole by one replica: the first save compiles nothing, and restores
  bit for bit."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:8]), ('data',))
  rng = np.random.default_rng(0)
  host = {'w': rng.standard_normal((64, 96), np.float32), 'b': rng.standard_normal((96,), np.float32),
          'mu': {'w': rng.standard_normal((64, 96), np.float32)}, 'step': np.int32(7)}
  state = jax.device_put(host, NamedSharding(mesh, P()))
  integrity.fingerprints(state)   # its own program, compiled once per state's structure
  compiles = []
  listener = lambda event, duration, **_: compiles.append(event) if 'backend_compile' in event else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  ck = Checkpointer(cfg8().checkpoint, str(tmp_path))
  try:
    ck.save(1, state, {}, {}, force=True)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  ck.wait()
  assert compiles == []
  # Across processes the cut spreads the write over the hosts: left as is.
  import orbax.checkpoint as ocp_
  handler = ocp_.type_handlers.get_type_handler(jax.Array)
  handler._min_slice_bytes_for_replica_parallel = None
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  checkpointer._whole_small_slices()
  assert handler._min_slice_bytes_for_replica_parallel is None
  monkeypatch.undo()
  checkpointer._whole_small_slices()
  assert handler._min_slice_bytes_for_replica_parallel == checkpointer.MIN_SLICE_BYTES
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  restored = ck.restore_latest(abstract)
  ck.close()
  assert restored.step == 1
  for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(host)):
    np.testing.assert_array_equal(np.asarray(a), b)


def _saves_with_step_1_held_open(ck, monkeypatch, caplog, **save) -> list[str]:
  """Steps 1, 2 and 3 saved by `ck` while step 1 cannot be deleted (a file in
  it held open on NFS: EBUSY); the warnings that said so."""
  import errno
  import shutil
  rmtree = shutil.rmtree

  def held_open(path, *args, **kwargs):
    if os.path.basename(str(path).rstrip('/')) == '1':
      raise OSError(errno.EBUSY, 'Device or resource busy', str(path))
    return rmtree(path, *args, **kwargs)
  monkeypatch.setattr(shutil, 'rmtree', held_open)
  try:
    for step in (1, 2, 3):
      ck.save(step, {'w': jax.numpy.arange(8, dtype=jax.numpy.float32)}, {}, {}, **save)
      ck.wait()
  finally:
    ck.close()
  return [r.getMessage() for r in caplog.records if 'could not be deleted' in r.getMessage()]


def test_an_old_step_that_cannot_be_deleted_stays_and_the_run_saves_on(tmp_path, monkeypatch, caplog):
  """Orbax deletes the steps beyond `keep` in a save's finalize thread, once
  the new step has committed, and raised a step it could not delete (a
  file in it held open on NFS: EBUSY; its permissions; an immutable
  directory) as that save's failure: a traceback and exit 1, or, for
  EPERM, 'the tier takes no more files' (exit 2), with the save intact. The
  step stays, said once; the saves go on."""
  directory = tmp_path / 'ckpt'
  said = _saves_with_step_1_held_open(
      Checkpointer(C.CheckpointConfig(directory=str(directory), keep=1), str(tmp_path / 'run')), monkeypatch,
      caplog, force=True)
  assert directories.steps_in(str(directory)) == [3, 1]   # 2 deleted; 1 left, with what it held
  assert len(said) == 1 and f'{directory}/1' in said[0] and 'Device or resource busy' in said[0], said


def test_a_host_local_copy_that_cannot_be_deleted_stays_and_the_run_saves_on(tmp_path, monkeypatch, caplog):
  # A host-local fast tier drops this process's copies beyond fast_keep
  # itself, before each save: one it could not delete ended the run.
  fast = tmp_path / 'fast'
  cfg = C.CheckpointConfig(directory=str(tmp_path / 'ckpt'), save_every=100, fast_every=1, fast_keep=1,
                           fast_directory=str(fast), fast_scope='host')
  said = _saves_with_step_1_held_open(Checkpointer(cfg, str(tmp_path / 'run')), monkeypatch, caplog)
  own = fast / 'process-0'
  # Each save first drops the copies beyond fast_keep but the newest: 1 stays.
  assert directories.steps_in(str(own)) == [3, 2, 1]
  assert len(said) == 1 and f'{own}/1' in said[0] and 'CheckpointConfig.fast_keep = 1' in said[0], said
