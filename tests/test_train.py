"""End-to-end: the real entry point, determinism, and data-parallel equivalence."""

import json
import os
import re
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from mjax import config as C
from mjax import data as data_lib
from mjax import trainer
from mjax.errors import UserError

REQUIRED_KEYS = {'step', 'loss', 'grad_norm', 'lr', 'step_time', 'tokens_per_sec', 'mfu'}


def fit(cfg, workdir):
  """Trains `cfg` in `workdir`; the summary and the final train state."""
  t = trainer.Trainer(cfg, str(workdir))
  return t.train(), t.state


def read_metrics(workdir):
  from mjax.metrics import read_metrics as read
  rows = read(workdir)
  return [r for r in rows if 'loss' in r], [r for r in rows if 'eval_loss' in r]


@pytest.mark.slow
def test_pulse_mjax_train_learns(repo_root, tmp_path):
  """The command a user runs: loss falls, metrics and config land in the workdir."""
  workdir = tmp_path / 'run'
  # One CPU device, as `make train` runs it (the 8-device layouts are checked
  # for equivalence below).
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  proc = subprocess.run(
      [os.path.join(os.path.dirname(sys.executable), 'mjax-train'), '--gin_file', 'configs/tiny.gin',
       '--workdir', str(workdir), '--gin.TrainConfig.steps=40', '--gin.TrainConfig.eval_every=20',
       '--gin_param=TrainConfig.progress = False'],
      capture_output=True, text=True, cwd=repo_root, timeout=600, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  train_rows, eval_rows = read_metrics(workdir)
  assert [r['step'] for r in train_rows] == list(range(1, 41))
  assert REQUIRED_KEYS <= set(train_rows[0])
  first = np.mean([r['loss'] for r in train_rows[:5]])
  last = np.mean([r['loss'] for r in train_rows[-5:]])
  assert first > np.log(256) - 0.5           # starts near uniform over bytes
  assert last < first - 1.5, (first, last)   # and learns
  assert [r['step'] for r in eval_rows] == [20, 40]
  assert eval_rows[-1]['eval_loss'] < eval_rows[0]['eval_loss']
  assert all(0 < r['mfu'] < 1 for r in train_rows)
  assert (workdir / 'config.gin').exists() and (workdir / 'config.json').exists()
  assert any(f.startswith('events.out.tfevents') for f in os.listdir(workdir / 'tensorboard'))
  assert 'peak' in proc.stdout and 'MFU' in proc.stdout


def _small(*extra, num_devices=8):
  return C.load_config(['tiny.gin'], [
      'ModelConfig.d_model = 128', 'ModelConfig.n_layers = 2', 'ModelConfig.d_ff = 256',
      'ModelConfig.sliding_window = 16', 'DataConfig.seq_len = 64', 'TrainConfig.global_batch_size = 16',
      'TrainConfig.progress = False', 'TrainConfig.eval_batches = 2', *extra], num_devices=num_devices)


def test_same_command_twice_gives_the_same_losses(tmp_path):
  cfg = _small('TrainConfig.steps = 4', 'TrainConfig.eval_every = 0')
  a, a_state = fit(cfg, str(tmp_path / 'a'))
  b, b_state = fit(cfg, str(tmp_path / 'b'))
  la = [r['loss'] for r in read_metrics(tmp_path / 'a')[0]]
  lb = [r['loss'] for r in read_metrics(tmp_path / 'b')[0]]
  assert la == lb and len(la) == 4
  assert a.eval_loss == b.eval_loss
  for x, y in zip(jax.tree.leaves(a_state.params), jax.tree.leaves(b_state.params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_garbage_is_collected_at_the_same_steps_and_only_there(tmp_path):
  # Every gc_every_steps steps a full collection, timed as its own phase;
  # none in between (automatic collection is off in the loop), and the
  # collector is back as it was afterwards. Numerics do not change.
  import gc
  from mjax.ft import gc_control
  steps = {}
  frozen = gc.get_freeze_count()   # (some Python builds start with objects frozen)
  for every in (2, 0):
    run = tmp_path / f'every{every}'
    fit(_small('TrainConfig.steps = 4', 'TrainConfig.eval_every = 0', 'CheckpointConfig.enabled = False',
               'FaultConfig.timing_every = 1', f'TrainConfig.gc_every_steps = {every}'), run)
    rows = [json.loads(line) for line in (run / 'timings' / 'process-00000.jsonl').read_text().splitlines()]
    steps[every] = [r['step'] for r in rows if 'gc' in r['phases']]
    # Nothing of the loop's left frozen. (CPython 3.12 puts a few hundred
    # objects of its own back into the frozen set now and then, even after
    # an unfreeze emptied it.)
    assert gc.isenabled() and gc.get_freeze_count() <= max(frozen, gc_control._FROZEN_AT_IMPORT)
  assert steps == {2: [2, 4], 0: []}
  losses = {e: [r['loss'] for r in read_metrics(tmp_path / f'every{e}')[0]] for e in (2, 0)}
  assert losses[2] == losses[0] and len(losses[2]) == 4


def test_a_blocking_save_is_not_counted_in_the_next_steps_time(tmp_path, monkeypatch):
  # A save's blocking part (1 s here) is the checkpoint phase of the
  # timings; step_time (so tokens/s and MFU) covers the step only.
  import time
  save = trainer.Trainer._save

  def slow_save(self, step, meta, force=False):
    if not force:
      time.sleep(1.0)
    return save(self, step, meta, force=force)

  monkeypatch.setattr(trainer.Trainer, '_save', slow_save)
  run = tmp_path / 'run'
  fit(_small('TrainConfig.steps = 5', 'TrainConfig.eval_every = 0', 'CheckpointConfig.save_every = 2',
             'FaultConfig.timing_every = 1'), run)
  times = {r['step']: r['step_time'] for r in read_metrics(run)[0]}
  assert sorted(times) == [1, 2, 3, 4, 5]
  assert all(times[s] < 0.5 for s in (3, 5)), times   # the steps right after a save
  rows = [json.loads(line) for line in (run / 'timings' / 'process-00000.jsonl').read_text().splitlines()]
  assert [r['step'] for r in rows if r['phases'].get('checkpoint', 0) >= 1.0] == [2, 4], rows


def test_heartbeats_begin_in_start_up_and_name_its_parts(tmp_path, monkeypatch):
  # Under a driver the trainer heartbeats from early in start-up, naming
  # the part it is in (restore, compile, ...), then the loop's phases, and
  # says goodbye last.
  import socket
  import threading
  import time
  from mjax.ft import heartbeat as hb
  from mjax.trainer import StartupPhase
  secret = 'ab' * 16
  sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
  sock.bind(('127.0.0.1', 0))
  sock.settimeout(0.1)
  monkeypatch.setenv(hb.ADDRESS_ENV, f'127.0.0.1:{sock.getsockname()[1]}')
  monkeypatch.setenv(hb.SECRET_ENV, secret)
  seen, done = [], threading.Event()

  def receive():
    verifier = hb.Verifier(secret)
    while not done.is_set():
      try:
        p = verifier.verify(sock.recv(hb.MAX_DATAGRAM))
      except (socket.timeout, hb.Rejected):   # nothing yet; a datagram overtaken by a later one
        continue
      seen.append((p['phase'], p['step'], p['final']))

  listener = threading.Thread(target=receive, daemon=True)
  listener.start()
  cfg = _small('TrainConfig.steps = 2', 'TrainConfig.eval_every = 0', 'CheckpointConfig.enabled = False',
               # No driver acknowledges here: the trainer would stop as orphaned after
               # heartbeat_timeout_s, counted from the start of start-up.
               'FaultConfig.heartbeat_interval_s = 0.05', 'FaultConfig.heartbeat_timeout_s = 110')
  t = trainer.Trainer(cfg, str(tmp_path))
  time.sleep(0.2)
  in_start_up = list(seen)
  t.train()
  time.sleep(0.3)
  done.set()
  listener.join()
  sock.close()
  assert in_start_up and all(phase.startswith('startup:') and step is None for phase, step, _ in in_start_up)
  order = StartupPhase.ORDER
  parts = [phase for phase, _, _ in seen if phase.startswith('startup:')]
  assert len(set(parts)) >= 2 and parts == sorted(parts, key=order.index), parts
  assert any(phase == 'compute' for phase, _, _ in seen) and seen[-1][2] and seen[-1][1] == 2, seen[-3:]


def test_a_run_faster_than_the_cached_peak_forgets_that_peak(tmp_path, capsys):
  # A peak cached from busy cores (before they were told apart) is below
  # what a quiet run reaches: MFU above 100%, so the next run measures again.
  from mjax.devices import peak_cache_key
  cache = tmp_path / 'peak'
  cache.mkdir()
  cfg = _small('TrainConfig.steps = 4', 'TrainConfig.eval_every = 0', 'CheckpointConfig.enabled = False',
               f'TrainConfig.peak_cache_dir = "{cache}"')
  kept = {'cpu|other machine|64|float32|jax 0': 1e12}
  (cache / 'peak_flops.json').write_text(json.dumps({peak_cache_key('cpu', cfg.model.dtype): 1e6, **kept}))
  summary, _ = fit(cfg, tmp_path / 'run')
  assert summary.mfu > 1, summary.peak_source
  assert 'went faster than the cached peak' in capsys.readouterr().out
  assert json.loads((cache / 'peak_flops.json').read_text()) == kept


def test_a_gelu_backward_kernel_on_several_devices_is_said_to_do_nothing(tmp_path, monkeypatch, capsys):
  # MeshConfig.data = -1 takes the 8 devices: config_lib.doubtful cannot
  # know that, the started mesh does.
  class Built(Exception):
    pass

  def stop(*_):
    raise Built
  monkeypatch.setattr(trainer, 'make_program', stop)
  cfg = _small('ModelConfig.gelu_epilogue = True', 'ModelConfig.gelu_backward_kernel = True',
               'ModelConfig.remat_policy = "dots_attention"', 'TrainConfig.steps = 2')
  assert cfg.mesh.data == -1
  with pytest.raises(Built):
    trainer.Trainer(cfg, str(tmp_path / 'run'))
  out = capsys.readouterr().out
  assert 'ModelConfig.gelu_backward_kernel = True does nothing here: the mesh has 8 devices' in out, out


def test_a_run_whose_output_reader_went_away_trains_on_and_saves(tmp_path, repo_root):
  # `mjax-train ... | head`, or a `tee` that died: the run ended at its next
  # line with status 141, unsaved since its last checkpoint.
  env = {k: v for k, v in os.environ.items() if not k.startswith('MJAX_')}
  env['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
  command = lambda workdir, progress: [
      sys.executable, '-c', 'from mjax.cli import train_main; train_main()', '--gin_file', 'configs/tiny.gin',
      '--workdir', str(workdir), '--gin.ModelConfig.d_model=128', '--gin.ModelConfig.n_layers=2',
      '--gin.ModelConfig.d_ff=256', '--gin.DataConfig.seq_len=64', '--gin.TrainConfig.steps=4',
      '--gin.CheckpointConfig.save_every=2', '--gin.TrainConfig.eval_every=0', f'--gin.{progress}']
  read, write = os.pipe()
  os.close(read)   # gone before the first line
  try:
    proc = subprocess.run(command(tmp_path / 'run', 'TrainConfig.progress=False'), cwd=repo_root, env=env,
                          stdout=write, stderr=subprocess.PIPE, text=True, timeout=300)
  finally:
    os.close(write)
  assert proc.returncode == 0, proc.stderr[-3000:]
  said = [line for line in proc.stderr.splitlines() if 'stdout' in line]
  assert said == ['mjax-train: warning: cannot write to stdout (Broken pipe); the run goes on without its output '
                  'there (metrics.jsonl in the workdir has every step)'], proc.stderr[-3000:]
  assert 'Traceback' not in proc.stderr
  assert sorted(os.listdir(tmp_path / 'run' / 'checkpoints'), key=lambda s: (not s.isdigit(), s))[:2] == ['2', '4']
  assert [r['step'] for r in read_metrics(tmp_path / 'run')[0]] == [1, 2, 3, 4]
  # `2>&1 | tee log` with the tee gone: stderr, where the progress bar
  # writes, is the same dead pipe (the bar's BrokenPipeError ended the loop).
  read, write = os.pipe()
  os.close(read)
  try:
    proc = subprocess.run(command(tmp_path / 'both', 'TrainConfig.progress=True'), cwd=repo_root, env=env,
                          stdout=write, stderr=write, timeout=300)
  finally:
    os.close(write)
  assert proc.returncode == 0
  assert sorted(os.listdir(tmp_path / 'both' / 'checkpoints'), key=lambda s: (not s.isdigit(), s))[:2] == ['2', '4']


def test_ctrl_c_during_start_up_exits_130_without_a_traceback(tmp_path, repo_root):
  import signal
  env = {k: v for k, v in os.environ.items() if not k.startswith('MJAX_')}
  env['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
  proc = subprocess.Popen(
      [os.path.join(os.path.dirname(sys.executable), 'mjax-train'), '--gin_file', 'configs/tiny.gin',
       '--workdir', str(tmp_path / 'run'), '--gin.TrainConfig.compilation_cache_dir=None',
       '--gin.TrainConfig.progress=False'],
      cwd=repo_root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  # The first line comes once the program is built, before the state and the
  # compiled step: Ctrl-C lands in start-up.
  first = proc.stdout.readline()
  assert 'params' in first, first
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, (proc.returncode, err[-2000:])
  # Once: the handler and the signal-watch thread both saw the Ctrl-C, and
  # each printed the line.
  assert err.count('interrupted') == 1 and 'Traceback' not in err, err[-2000:]


def test_ctrl_c_inside_a_garbage_collector_callback_is_not_lost(repo_root):
  # Python drops a KeyboardInterrupt raised in a gc callback (JAX registers
  # one): a Ctrl-C landing there in start-up was ignored and the job trained
  # on. mjax-train's handler leaves from the handler itself.
  code = (
      'import gc, os, signal, time\n'
      'from mjax import cli\n'
      'cli._exit_on_ctrl_c("mjax-train")\n'
      'def cb(phase, info):\n'
      '  if phase == "start" and not getattr(cb, "done", False):\n'
      '    cb.done = True\n'
      '    os.kill(os.getpid(), signal.SIGINT)\n'
      '    time.sleep(5)\n'
      'gc.callbacks.append(cb)\n'
      'gc.collect()\n'
      'print("trained on", flush=True)\n')
  p = subprocess.run([sys.executable, '-c', code], cwd=repo_root, capture_output=True, text=True, timeout=60)
  assert p.returncode == 130 and 'trained on' not in p.stdout, (p.returncode, p.stdout, p.stderr[-2000:])
  assert 'interrupted' in p.stderr and 'Traceback' not in p.stderr, p.stderr[-2000:]


@pytest.mark.skipif(not os.path.exists('/dev/full'), reason='needs /dev/full (a device that is always full)')
def test_a_full_disk_under_the_run_files_is_one_paragraph_naming_the_file(tmp_path):
  # The timings and metrics are written every step: a filesystem that fills
  # up mid-run used to end the trainer with a traceback and exit 1 (a crash
  # the driver restarts, into the same full disk). /dev/full refuses every
  # write with ENOSPC, as a full disk does.
  from mjax.errors import UserError
  from mjax.ft.phases import PhaseTimer
  from mjax.metrics import MetricsWriter
  timer = PhaseTimer(str(tmp_path), 0, every=1)
  timer._fh = open('/dev/full', 'a', buffering=1)
  with pytest.raises(UserError, match=r"per-rank step timings cannot be written to '.*process-00000.jsonl': "
                                      r"No space left on device .*checkpoints saved so far are kept"):
    timer.end_step(1)
  writer = MetricsWriter(str(tmp_path))
  writer._jsonl = open('/dev/full', 'a', buffering=1)
  with pytest.raises(UserError, match=r"the metrics cannot be written to '/dev/full': No space left on device"):
    writer.write(1, {'loss': 1.0})
  # The TensorBoard events: tensorboardX's writer thread died on the full
  # disk and the next step waited on its queue forever, with no message;
  # at exit its flush printed tracebacks. Now the step's write fails with
  # the same paragraph, and the process ends without a word more.
  code = ('from mjax.metrics import MetricsWriter\nfrom mjax.errors import UserError\n'
          f'w = MetricsWriter({str(tmp_path / "tb")!r})\n'
          'w._tb._fh = open("/dev/full", "wb", buffering=0)\n'
          'try:\n  w.write(1, {"loss": 1.0})\nexcept UserError as e:\n  print(e)\n'
          'w.write(2, {"loss": 1.0})\n')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and re.match(r"the TensorBoard events cannot be written to '.*/tb/tensorboard/"
                                          r"events.out.tfevents.*': No space left on device", out.stdout), out
  assert out.stderr == '', out.stderr[-2000:]


def test_metrics_are_only_appended_and_a_resume_supersedes_the_redone_steps(tmp_path):
  from mjax.metrics import MetricsWriter, read_metrics as read
  first = MetricsWriter(str(tmp_path))
  for step in range(1, 6):
    first.write(step, {'loss': float(step)})
  first.close()
  with open(tmp_path / 'metrics.jsonl', 'a') as fh:
    fh.write('{"step": 6, "lo')                           # a crash in the middle of a line
  before = (tmp_path / 'metrics.jsonl').read_text()
  again = MetricsWriter(str(tmp_path), resume_step=3)   # steps 4 and 5 are redone
  for step in (4, 5):
    again.write(step, {'loss': 10.0 * step})
  again.close()
  after = (tmp_path / 'metrics.jsonl').read_text()
  assert after.startswith(before)                         # nothing deleted or rewritten
  assert [(r['step'], r['loss']) for r in read(str(tmp_path))] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
  # A restart from scratch over the same file supersedes everything.
  fresh = MetricsWriter(str(tmp_path))
  fresh.write(1, {'loss': 7.0})
  fresh.close()
  assert (tmp_path / 'metrics.jsonl').read_text().startswith(after)
  assert [(r['step'], r['loss']) for r in read(str(tmp_path))] == [(1, 7.0)]


def test_tensorboard_keeps_one_value_per_step_after_a_resume_from_an_older_step(tmp_path):
  # A resumed run writes its redone steps again, in a new event file: the
  # values of the first file from the resumed step on must not stay beside them.
  import logging
  from mjax.metrics import MetricsWriter
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  first = MetricsWriter(str(tmp_path))
  for step in range(1, 6):
    first.write(step, {'loss': float(step)})
  first.close()
  time.sleep(1.01)   # event files are named by the second they are made in
  again = MetricsWriter(str(tmp_path), resume_step=3)
  for step in (4, 5):
    again.write(step, {'loss': 10.0 * step})
  again.close()
  logging.getLogger('tensorboard').setLevel(logging.ERROR)   # its note on the values it drops
  acc = EventAccumulator(str(tmp_path / 'tensorboard'))
  acc.Reload()
  assert [(e.step, e.value) for e in acc.Scalars('loss')] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]


def test_a_sampled_steps_trace_is_left_out_of_the_step_time(tmp_path, monkeypatch):
  # Every FaultConfig.device_timing_every steps a job of several ranks traces
  # a step and reads the trace back: monitoring, not training, as an
  # evaluation is. Here reading it back takes 1 s.
  from mjax.ft import device_time
  monkeypatch.setattr(device_time.DeviceSampler, 'has_ranks', staticmethod(lambda *a: True))
  collect = device_time.DeviceSampler.collect

  def slow_collect(self):
    if self.active:
      time.sleep(1.0)
    return collect(self)
  monkeypatch.setattr(device_time.DeviceSampler, 'collect', slow_collect)
  cfg = _small('TrainConfig.steps = 8', 'TrainConfig.eval_every = 0', 'CheckpointConfig.enabled = False',
               'FaultConfig.device_timing_every = 4')
  fit(cfg, tmp_path)
  rows, _ = read_metrics(str(tmp_path))
  sampled = [json.loads(l) for l in open(tmp_path / 'timings' / 'process-00000.jsonl') if '"device"' in l]
  assert [r['step'] for r in sampled] == [2, 6]   # the sampler ran, at the steps it is due
  times = {r['step']: r['step_time'] for r in rows}
  # The sampled steps (2, 6) and the steps after them, whose time a late read
  # would land in, against the 1 s read. (Not step 1: its first execution's
  # set-up alone came near 1 s under jax 0.11.)
  assert len(times) == 8 and max(times[s] for s in (2, 3, 6, 7)) < 0.9, times


def test_a_resumed_run_does_not_sample_the_device_time_of_its_first_step(tmp_path, monkeypatch):
  # Its first execution is no sample of a device's pace (buffers allocated,
  # the collectives' first set-up): resumed at step 5, step 6 is not traced.
  from mjax.ft import device_time
  monkeypatch.setattr(device_time.DeviceSampler, 'has_ranks', staticmethod(lambda *a: True))
  for steps in (5, 10):
    fit(_small(f'TrainConfig.steps = {steps}', 'TrainConfig.eval_every = 0', 'OptimConfig.decay_steps = 10',
               'FaultConfig.device_timing_every = 4'), tmp_path)
  sampled = [json.loads(l)['step'] for l in open(tmp_path / 'timings' / 'process-00000.jsonl') if '"device"' in l]
  assert sampled == [2, 10]


def test_profile_steps_write_a_trace(tmp_path, capsys, repo_root):
  cfg = _small('TrainConfig.steps = 3', 'TrainConfig.eval_every = 0', 'TrainConfig.profile_steps = 2',
               'CheckpointConfig.enabled = False')
  fit(cfg, tmp_path)
  traces = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / 'profile') for f in fs]
  assert any(f.endswith('perfetto_trace.json.gz') for f in traces), traces
  assert any(f.endswith('.xplane.pb') for f in traces), traces
  assert 'profiled steps 2-3' in capsys.readouterr().out
  # The program beside the trace: the trace summed by part of the model.
  assert os.path.exists(tmp_path / 'profile' / 'train_step.hlo.txt')
  summary = subprocess.run([sys.executable, os.path.join(repo_root, 'bench', 'trace_summary.py'),
                            str(tmp_path / 'profile')],
                           capture_output=True, text=True, check=True).stdout
  # The step count comes from beside the trace: per-step figures are per step.
  assert 'per step over 2 steps' in summary, summary
  parts = dict(re.findall(r'^\| ((?:forward|backward): [^|]+|optimizer and metrics) \| ([\d.]+) \|',
                          summary, re.M))
  for part in ('forward: attention (scores, softmax, their products)',
               'backward: attention (scores, softmax, their products)',
               "forward: layers' weight matrix products", "backward: layers' weight matrix products",
               'forward: head and loss', 'backward: head and loss', 'optimizer and metrics'):
    assert float(parts.get(part, 0)) > 0, (part, summary)


def test_a_profile_window_the_run_never_reaches_is_said_at_the_start(tmp_path, capsys):
  from mjax.profiling import StepProfiler
  for at, start, said in [(10, 0, 'profile_from_step = 10: this run trains steps 1-4'),
                          (2, 3, 'profile_from_step = 2: this run trains steps 4-4'),
                          (0, 3, 'profile_from_step = 0 (the second step of this run, 5): this run trains steps 4-4'),
                          (3, 0, None), (0, 0, None)]:
    cfg = _small('TrainConfig.steps = 4', 'TrainConfig.profile_steps = 2', f'TrainConfig.profile_from_step = {at}')
    StepProfiler(cfg, str(tmp_path), start, lambda: '')
    out = capsys.readouterr().out
    assert (said in out and 'nothing is profiled' in out) if said else out == '', (at, start, out)


def test_weights_and_biases_offline_run_gets_the_metrics_and_config(tmp_path, monkeypatch):
  pytest.importorskip('wandb')
  monkeypatch.setenv('WANDB_MODE', 'offline')
  monkeypatch.setenv('WANDB_SILENT', 'true')
  cfg = _small('TrainConfig.steps = 3', 'TrainConfig.eval_every = 0', 'CheckpointConfig.enabled = False',
               'TrainConfig.wandb_project = "mjax-test"')
  summary, _ = fit(cfg, tmp_path)
  runs = [d for d in os.listdir(tmp_path / 'wandb') if d.startswith('offline-run-')]
  assert len(runs) == 1, os.listdir(tmp_path / 'wandb')
  # The run id comes from the workdir: a restart continues the same run.
  assert runs[0].endswith(_wandb_id(tmp_path))
  # The offline log (protobuf records) holds every logged value as JSON text.
  record = (tmp_path / 'wandb' / runs[0] / f'run-{_wandb_id(tmp_path)}.wandb').read_bytes()
  losses, _ = read_metrics(str(tmp_path))
  assert [r['step'] for r in losses] == [1, 2, 3]
  for row in losses:
    assert json.dumps(row['loss']).encode() in record, row
  assert b'd_model' in record and b'sliding_window' in record   # the resolved config travels with the run


def test_weights_and_biases_without_a_login_is_refused_by_name(tmp_path, monkeypatch):
  # wandb's own UsageError, with its traceback, exit 1 (which the driver
  # restarts, to fail the same way): now one paragraph saying what to do.
  pytest.importorskip('wandb')
  from mjax.errors import UserError
  from mjax.metrics import _wandb_run
  for var in ('WANDB_MODE', 'WANDB_API_KEY', 'WANDB_DISABLED'):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setenv('HOME', str(tmp_path))                  # no ~/.netrc, no saved settings
  monkeypatch.setenv('WANDB_CONFIG_DIR', str(tmp_path / 'cfg'))
  monkeypatch.setenv('NETRC', str(tmp_path / 'no-netrc'))
  monkeypatch.setenv('WANDB_SILENT', 'true')
  import wandb
  wandb.teardown()   # wandb keeps the settings of an earlier run in this process (offline mode)
  with pytest.raises(UserError, match=r"TrainConfig.wandb_project = 'p': Weights & Biases would not start a "
                                      r"run: .*wandb login.*WANDB_MODE=offline"):
    _wandb_run(str(tmp_path / 'run'), 'p', {})


def _wandb_id(workdir):
  import hashlib
  return 'mjax-' + hashlib.sha256(os.path.abspath(str(workdir)).encode()).hexdigest()[:16]


def test_wandb_project_without_wandb_is_refused_by_name(monkeypatch):
  import importlib.util
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name == 'wandb' else real(name, *a))
  with pytest.raises(C.ConfigError, match=r"TrainConfig.wandb_project = 'p'.*mjax\[wandb\]"):
    _small('TrainConfig.wandb_project = "p"')


def test_a_train_state_that_cannot_fit_is_refused_before_anything_is_allocated(tmp_path):
  # ~50B parameters on 8 CPU devices sharing this host's memory: the run
  # stops at once, naming the per-device need and what to change, instead of
  # sitting in initialization.
  from mjax.config import ConfigError
  from mjax import trainer
  cfg = _small('ModelConfig.d_model = 16384', 'ModelConfig.d_ff = 65536', 'ModelConfig.n_layers = 16',
               'ModelConfig.n_heads = 64', 'ModelConfig.sliding_window = None',
               'ModelConfig.full_attention_every = 0')
  with pytest.raises(ConfigError, match=r'train state alone needs [\d,.]+ GiB per device .* more than the '
                                        r'[\d,.]+ GiB each device has .*MeshConfig.fsdp'):
    trainer.run(cfg, str(tmp_path / 'run'))
  assert not os.path.exists(tmp_path / 'run' / 'checkpoints' / '0')


def test_a_step_that_cannot_fit_is_refused_before_it_runs(tmp_path, monkeypatch):
  # A sequence far too long for the device used to pass start-up and die in
  # the first step with the allocator's traceback; XLA's buffer assignment of
  # the compiled step says so before it runs. Devices of 64 MiB: the train
  # state fits, the activations of 2 x 2048 tokens per device do not.
  from mjax.config import ConfigError
  monkeypatch.setattr(trainer, 'memory_per_device', lambda devices: (64 * 2**20, 'a 64 MiB test device'))
  cfg = _small('DataConfig.seq_len = 2048', 'TrainConfig.steps = 2', 'TrainConfig.eval_every = 0',
               'CheckpointConfig.save_every = 1')
  # The workdir of an earlier run: its config stays (mjax-eval, -generate
  # and -export read it), however far the failed start got.
  earlier = _small('TrainConfig.steps = 24')
  C.write(earlier, str(tmp_path / 'run'))
  with open(tmp_path / 'run' / 'config.gin') as fh:
    before = fh.read()
  with pytest.raises(ConfigError, match=r'the train step needs [\d.]+ (GiB|MiB) per device .* activations and '
                                        r'temporaries.* more than the 64.0 MiB each device has \(a 64 MiB test '
                                        r'device\)\. Lower DataConfig.seq_len \(2048\)'):
    trainer.run(cfg, str(tmp_path / 'run'))
  assert not os.path.exists(tmp_path / 'run' / 'checkpoints' / '1')
  with open(tmp_path / 'run' / 'config.gin') as fh:
    assert fh.read() == before and 'DataConfig.seq_len = 64' in before
  # So does data it cannot read.
  (tmp_path / 'empty.txt').write_text('')
  with pytest.raises(UserError, match='empty.txt'):
    trainer.run(_small('TrainConfig.steps = 26', f"DataConfig.source = '{tmp_path / 'empty.txt'}'"),
                str(tmp_path / 'run'))
  with open(tmp_path / 'run' / 'config.gin') as fh:
    assert fh.read() == before
  with open(tmp_path / 'run' / 'config.json') as fh:
    assert json.load(fh) == C.to_dict(earlier)


def test_a_workdir_deleted_under_the_run_stops_it_with_a_save_and_says_so(tmp_path, monkeypatch):
  # Deleted mid-run, the workdir's metrics, logs and config went on into
  # deleted files, and the run ended "done" (exit 0) with none of them.
  import shutil
  monkeypatch.setattr(trainer.WorkdirWatch, 'CHECK_S', 0.0)
  assert not trainer.WorkdirWatch(str(tmp_path / 'w')).gone()   # no run there (yet): nothing to watch
  (tmp_path / 'w').mkdir()
  (tmp_path / 'w' / 'config.json').write_text('{}')
  watch = trainer.WorkdirWatch(str(tmp_path / 'w'))
  assert not watch.gone()
  shutil.rmtree(tmp_path / 'w')
  (tmp_path / 'w').mkdir()   # made again (by a save): another directory, perhaps with the same inode number
  assert watch.gone()
  watch.close()
  # The loop: stopped after the step it was noticed, that step saved, the
  # config written again, one message (exit 2: nothing to restart).
  calls = []
  monkeypatch.setattr(trainer.WorkdirWatch, 'gone', lambda self: calls.append(1) or len(calls) >= 3)
  workdir = tmp_path / 'run'
  with pytest.raises(UserError, match=rf'the workdir {workdir} was deleted \(or replaced\) while the run trained; '
                                      r'noticed after step 3, the run stopped there\..*step 3 was saved in '
                                      rf'{workdir}/checkpoints, and the same command goes on from it'):
    trainer.run(_small('TrainConfig.steps = 8', 'CheckpointConfig.save_every = 5', 'TrainConfig.eval_every = 0'),
                str(workdir))
  assert (workdir / 'checkpoints' / '3').is_dir() and (workdir / 'config.gin').is_file()
  # Noticed after the last step: the run is complete, and finishes as one.
  calls.clear()
  monkeypatch.setattr(trainer.WorkdirWatch, 'gone', lambda self: calls.append(1) or len(calls) >= 8)
  done = trainer.run(_small('TrainConfig.steps = 8', 'CheckpointConfig.save_every = 5', 'TrainConfig.eval_every = 0'),
                     str(tmp_path / 'run2'))
  assert done.final_step == 8 and np.isfinite(done.eval_loss) and not done.preempted


def test_the_recorded_config_names_its_data_by_absolute_path(tmp_path, monkeypatch):
  """A run's config.gin / config.json, read by mjax-eval, -generate and a
  resume from any directory: a relative source named other data there."""
  from mjax.config import DataConfig
  monkeypatch.chdir(tmp_path)
  (tmp_path / 'tok.json').write_text('{}')
  got = trainer._absolute_paths(DataConfig(source='data/good', mixture='data/good:1.0,stdlib:2.5',
                                           tokenizer='tok.json'))
  assert got.source == str(tmp_path / 'data' / 'good') and got.tokenizer == str(tmp_path / 'tok.json')
  assert got.source_weights() == ((str(tmp_path / 'data' / 'good'), 1.0), ('stdlib', 2.5))
  assert trainer._absolute_paths(DataConfig()) == DataConfig()      # stdlib and the byte tokenizer stay


def test_processes_that_see_different_data_stop_at_start(monkeypatch):
  # Each process builds the whole order and reads its rows of it: a host
  # that sees other files would mix rows of another order into every batch.
  from mjax import distributed
  from mjax.data.errors import DataError
  mine = {'content': 'b' * 16, 'heldout': 'h' * 16, 'sources': [{'root': '/data', 'files': 9, 'tokens': 900}]}
  first = {'content': 'a' * 16, 'heldout': 'h' * 16, 'sources': [{'root': '/data', 'files': 10, 'tokens': 1000}]}
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  monkeypatch.setattr(distributed, 'broadcast_str', lambda key, value, *a: json.dumps(first))
  monkeypatch.setattr(distributed, 'report_exceptions', lambda key, v, *a: {} if v is None else {1: v})
  with pytest.raises(DataError, match=r"\(train data\): process 0 has \[\{'root': '/data', 'files': 10, "
                                      r"'tokens': 1000\}\], process\(es\) \[1\] have \[\{'root': '/data', 'files': 9"):
    trainer._check_same_data(mine)
  trainer._check_same_data(first)   # the same data: nothing to say
  # The same train data with other held-out files: evaluation would mix
  # two orders, or hang where the processes' evaluation step counts differ.
  with pytest.raises(DataError, match=r'see different data \(held-out data\)'):
    trainer._check_same_data({**first, 'heldout': 'i' * 16})


def test_a_new_runs_refused_start_leaves_nothing_behind(tmp_path):
  """Data too small for one batch, found after the workdir checks made the
  run's id and claimed its checkpoint directories: the refusal takes them
  back. A workdir or checkpoint directory the user made stays, empty; the
  fast tier named after the workdir in /dev/shm goes too."""
  import glob
  from mjax.checkpoint.directories import tier_directories
  (tmp_path / 'few.txt').write_text('too few tokens for a batch\n')
  (tmp_path / 'mine').mkdir()
  (tmp_path / 'ck').mkdir()
  fast = ['CheckpointConfig.fast_every = 2']
  for workdir, extra in [(tmp_path / 'new', fast), (tmp_path / 'mine', [f'CheckpointConfig.directory = "{tmp_path}/ck"'])]:
    cfg = _small('TrainConfig.steps = 2', f'DataConfig.source = "{tmp_path}/few.txt"', *extra)
    dirs = tier_directories(cfg.checkpoint, str(workdir))
    with pytest.raises(data_lib.DataError, match='global batch'):
      trainer.Trainer(cfg, str(workdir))
    for d in dirs.values():
      assert not glob.glob(os.path.join(d, '.mjax-*')), (d, os.listdir(d))
  assert not (tmp_path / 'new').exists() and not os.path.exists(tier_directories(
      _small(*fast).checkpoint, str(tmp_path / 'new'))['fast'])
  assert os.listdir(tmp_path / 'mine') == [] and os.listdir(tmp_path / 'ck') == []
  # A run id this start did not make (a run whose config.json was lost) stays.
  from mjax.checkpoint.directories import RUN_ID_FILE
  (tmp_path / 'lost').mkdir()
  (tmp_path / 'lost' / RUN_ID_FILE).write_text(json.dumps({'run': 'abc123', 'fresh': True}))
  with pytest.raises(data_lib.DataError, match='global batch'):
    trainer.Trainer(_small('TrainConfig.steps = 2', f'DataConfig.source = "{tmp_path}/few.txt"'), str(tmp_path / 'lost'))
  assert json.loads((tmp_path / 'lost' / RUN_ID_FILE).read_text())['run'] == 'abc123'


@pytest.mark.slow
def test_a_trainer_from_python_gets_the_checks_and_holds_its_workdir_alone(tmp_path, monkeypatch):
  """The notebook path. A Config changed by hand gets load_config's checks,
  the mesh's against the devices there are, before anything is written. A
  second Trainer on a workdir a live one of this process holds is refused
  (the run lock is re-entrant within a process: the second trained over the
  first's checkpoints and metrics); a Trainer dropped untrained, closed, or
  done frees it. `~` and path objects are paths."""
  import dataclasses
  import gc
  from mjax import workdir as workdir_lib
  from mjax.checkpoint import locks
  cfg = _small('TrainConfig.steps = 2', 'TrainConfig.eval_every = 0')
  hand = lambda section, **kw: dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **kw)})
  with pytest.raises(C.ConfigError, match=r'ModelConfig.n_heads = 3 is not allowed: must divide'):
    trainer.Trainer(hand('model', n_heads=3), tmp_path / 'bad')
  with pytest.raises(C.ConfigError, match=r'TrainConfig.global_batch_size = 12 is not allowed.*data x fsdp = 8'):
    trainer.Trainer(hand('train', global_batch_size=12), tmp_path / 'bad')
  assert not (tmp_path / 'bad').exists()
  monkeypatch.setenv('HOME', str(tmp_path))
  first = trainer.Trainer(cfg, '~/run')
  assert first.workdir == str(tmp_path / 'run')
  with pytest.raises(C.ConfigError, match=r'in use by another Trainer of this process'):
    trainer.Trainer(cfg, tmp_path / 'run' / '.')
  del first
  gc.collect()
  run = os.path.realpath(tmp_path / 'run')
  assert run not in locks._held_locks and run not in workdir_lib._WORKDIRS
  with trainer.Trainer(hand('train', steps=3), tmp_path / 'run') as t:
    assert t.start_step == 0 and t.train().final_step == 3
  assert run not in locks._held_locks and run not in workdir_lib._WORKDIRS
  with trainer.Trainer(hand('train', steps=3), tmp_path / 'run') as t:
    assert t.start_step == 3   # resumed; closed without training
  from mjax.errors import UserError
  with pytest.raises(UserError, match=r'after close\(\)'):
    t.train()   # it holds no lock any more
  # A second Ctrl-C in a notebook (KeyboardInterrupt out of the loop, a save
  # just started): out at once; the workdir is freed once the save is on
  # disk, and the next Trainer resumes from it.
  every2 = dataclasses.replace(hand('train', steps=4), checkpoint=dataclasses.replace(cfg.checkpoint, save_every=2))
  real = trainer.StepReporter.push

  def push(self, step, metrics):
    if step == 3:
      raise KeyboardInterrupt
    return real(self, step, metrics)
  monkeypatch.setattr(trainer.StepReporter, 'push', push)
  with pytest.raises(KeyboardInterrupt):
    trainer.Trainer(every2, tmp_path / 'ki').train()
  monkeypatch.setattr(trainer.StepReporter, 'push', real)
  ki = os.path.realpath(tmp_path / 'ki')
  deadline = time.time() + 60
  while ki in workdir_lib._WORKDIRS and time.time() < deadline:
    time.sleep(0.05)
  assert ki not in workdir_lib._WORKDIRS and ki not in locks._held_locks
  with trainer.Trainer(every2, tmp_path / 'ki') as t:
    assert t.start_step == 2


def test_the_step_reporter_holds_no_history_of_the_steps(tmp_path, monkeypatch):
  """A step reported costs no memory kept for the rest of the run: lists of
  every step's time and loss grew by 64 bytes a step (64 MB a process over
  a million steps). The summary's figures stay what they were: the mean
  time of the steps after the first two, the last loss."""
  import tracemalloc
  from types import SimpleNamespace
  cfg = C.Config(train=C.TrainConfig(steps=10**7, progress=False))
  fake = SimpleNamespace(cfg=cfg, workdir=str(tmp_path), is_main=False, start_step=0, tokens_per_step=1024,
                         flops_per_token=1.0, peak=1.0, startup_report=lambda now: {}, say=lambda msg: None)
  monkeypatch.delenv('MJAX_DRIVER_ADDRESS', raising=False)
  reporter = trainer.StepReporter(fake, heartbeat=None, injector=None)
  clock = iter(range(1, 10**7))   # the k-th report at k**2 / 2
  monkeypatch.setattr(trainer.time, 'perf_counter', lambda: float(next(clock)) ** 2 / 2)
  reporter._t_last = 0.0

  def run(steps):
    for step in steps:
      reporter.push(step, {'loss': 1.0 / step})
  run(range(1, 1001))
  tracemalloc.start()
  try:
    before = tracemalloc.take_snapshot()
    run(range(1001, 21001))
    grown = sum(d.size_diff for d in tracemalloc.take_snapshot().compare_to(before, 'filename'))
  finally:
    tracemalloc.stop()
  assert grown < 64 * 1024, grown   # lists of every step: 20,000 x 64 bytes
  reporter.flush()
  # Step k took k - 1/2 seconds: steps 3 .. 21000 average 10501.
  assert reporter.steps == 21000 and reporter.last_loss == 1.0 / 21000
  assert reporter.mean_step_time() == pytest.approx(10501.0)


def test_read_metrics_skips_the_damage_it_can_meet(tmp_path):
  """Lines garbled on disk (bytes that are no UTF-8, a marker whose step is
  no number) are left out, as a line a crash cut short is; the rest reads
  as one run."""
  from mjax.metrics import read_metrics
  good = [{'step': 1, 'loss': 3.0}, {'step': 2, 'loss': 2.5}, {'step': 2, 'loss': 2.4}]
  lines = [json.dumps(good[0]).encode(), json.dumps(good[1]).encode(), b'\xff\xfe{"step": 9',
           b'{"step": 2, "supersedes_after_step": null}', b'{"step": 1, "supersedes_after_step": "1"}',
           b'{"step": "x", "loss": 1.0}', b'{"step": 1, "supersedes_after_step": 1}', json.dumps(good[2]).encode(),
           b'{"step": 3, "lo']
  (tmp_path / 'metrics.jsonl').write_bytes(b'\n'.join(lines))
  assert read_metrics(tmp_path) == [good[0], {'step': 'x', 'loss': 1.0}, good[2]]


def test_read_metrics_of_many_restarts_takes_one_pass_and_one_step_holds_only_its_rows(tmp_path):
  """Each restart's marker is applied in one pass from the end: dropping
  rows at each marker went over every earlier row again (10 minutes and
  1 GB at a million steps and 1,000 restarts, read by process 0 at every
  restart that resumes at an evaluation step). The same rows whatever the
  number of markers, in the same time; `step=` keeps only that step's."""
  import time
  from mjax.metrics import read_metrics

  def write(path, every):
    """40,000 steps; every `every` steps a crash, resumed `every` / 2 back."""
    path.mkdir()
    lines, latest, step, attempt, since = [], {}, 1, 0, 0
    while step <= 40_000:
      lines.append(json.dumps({'step': step, 'loss': float(step), 'attempt': attempt}))
      latest[step] = attempt
      since += 1
      if since == every:
        step, attempt, since = step - every // 2, attempt + 1, 0
        lines.append(json.dumps({'step': step, 'supersedes_after_step': step}))
        lines.append(json.dumps({'step': step, 'eval_loss': 1.0}))
      step += 1
    (path / 'metrics.jsonl').write_text('\n'.join(lines) + '\n')
    return latest

  def timed(path):
    best = float('inf')
    for _ in range(2):
      t0 = time.perf_counter()
      rows = read_metrics(path)
      best = min(best, time.perf_counter() - t0)
    return rows, best

  write(tmp_path / 'few', 40_000)
  latest = write(tmp_path / 'many', 50)   # 1,600 restarts
  few, few_s = timed(tmp_path / 'few')
  many, many_s = timed(tmp_path / 'many')
  assert [r['step'] for r in few if 'loss' in r] == list(range(1, 40_001))
  assert [(r['step'], r['attempt']) for r in many if 'loss' in r] == sorted(latest.items())
  assert many_s < 3 * few_s + 0.2, (many_s, few_s)   # one pass over the rows per marker: ~20x
  assert read_metrics(tmp_path / 'many', step=990) == [{'step': 990, 'loss': 990.0, 'attempt': latest[990]}]
  assert read_metrics(tmp_path / 'many', step=1000) == [
      {'step': 1000, 'loss': 1000.0, 'attempt': latest[1000]}, {'step': 1000, 'eval_loss': 1.0}]


def test_a_compilation_cache_dir_that_cannot_be_written_is_said_once_and_left_unset(tmp_path, caplog):
  # JAX warned once per program it failed to write, its reason in each; the
  # run is right without the cache (only its restarts compile again).
  import jax
  from mjax.train import setup_compilation_cache
  blocker = tmp_path / 'a_file'
  blocker.write_text('')
  before = jax.config.jax_compilation_cache_dir
  with caplog.at_level('WARNING', logger='mjax'):
    setup_compilation_cache(str(blocker / 'cache'))
  assert jax.config.jax_compilation_cache_dir == before
  assert [r.getMessage() for r in caplog.records if 'compilation_cache_dir' in r.getMessage()] == [
      f"TrainConfig.compilation_cache_dir '{blocker / 'cache'}' is not a directory this process can write: the "
      'compiled programs are not cached, so a restart compiles them again. Give a writable folder, or None.']


@pytest.mark.parametrize('layout', [
    ['MeshConfig.data = 2', 'MeshConfig.fsdp = 4', 'ModelConfig.scan_layers = False'],
    ['MeshConfig.data = 2', 'MeshConfig.pipeline = 2', 'MeshConfig.tensor = 2', 'MeshConfig.virtual_stages = 2',
     'MeshConfig.microbatches = 4', 'ModelConfig.n_layers = 8', 'OptimConfig.clip_norm = 0.0'],
])
def test_the_abstract_state_is_inits_without_tracing_the_model(monkeypatch, layout):
  """`Program.abstract_state` (restore, the step's lowering, the memory
  check) is what `init` makes, shape, dtype and sharding, leaf for leaf,
  in both layouts; it comes from the params' shapes, with no trace of the
  model's init (seconds each with unrolled layers)."""
  from mjax import train
  from mjax.model import Transformer
  from mjax.parallel import make_mesh
  cfg = C.load_config(['tiny.gin'], layout, num_devices=8)
  traced = []
  real_call = Transformer.__call__
  monkeypatch.setattr(Transformer, '__call__', lambda self, *a, **k: traced.append(1) or real_call(self, *a, **k))
  program = train.make_program(cfg, make_mesh(cfg.mesh, devices=jax.devices()))
  assert len(traced) == 1   # the params' shapes and names
  abstract, abstract_canonical = program.abstract_state(), program.abstract_state(canonical=True)
  assert len(traced) == 1
  with program.context():
    made = jax.eval_shape(lambda: program.init(jax.random.key(0)))
    canonical = jax.eval_shape(program.to_canonical, made)
  assert len(traced) == 2   # (the check can see a trace)
  for abstract, want, shardings in ((abstract, made, program.state_shardings),
                                    (abstract_canonical, canonical, program.canonical_shardings)):
    assert jax.tree.structure(abstract) == jax.tree.structure(want)
    for a, w, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(want), jax.tree.leaves(shardings)):
      assert (a.shape, a.dtype, a.weak_type, a.sharding) == (w.shape, w.dtype, w.weak_type, s), (a, w)
