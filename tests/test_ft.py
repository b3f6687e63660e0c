"""Fault tolerance: heartbeats, detection, recovery under mjax-launch.

Unit tests of the pieces first (heartbeat authentication, loss monitor,
hang culprits, elastic layouts, block list), then the real driver on
processes on 127.0.0.1 (1 fake CPU device each): kill -9 of a random
process resumes bitwise, a hang names the silent process and a failing
diagnostic shrinks the job, a NaN rolls back past the bad batches, and
forged heartbeats are refused.
"""

import collections
import json
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from mjax.errors import UserError

from mjax import config as C, protocol
from mjax.ft import detect, driver, events as events_lib, executor, health, heartbeat as hb, hosts as hosts_lib, stragglers
from mjax.metrics import read_metrics

SECRET = 'ab' * 32
N = 12   # training steps of the end-to-end runs

# The tiny model of the end-to-end runs, small timeouts (heartbeat 0.5 s,
# lost after 3 s, hang after 8 s; collectives, and so start-up, 180 s: a
# loaded CI machine can take a minute to start two processes) and a short back-off.
TRAIN = ['--gin_file', 'configs/tiny.gin', '--gin.ModelConfig.d_model=128', '--gin.ModelConfig.n_layers=2',
         '--gin.ModelConfig.d_ff=256', '--gin.ModelConfig.full_attention_every=0',
         '--gin.ModelConfig.sliding_window=16', '--gin.DataConfig.seq_len=64',
         '--gin.TrainConfig.global_batch_size=16', f'--gin.TrainConfig.steps={N}',
         f'--gin.OptimConfig.decay_steps={N}', '--gin.OptimConfig.warmup_steps=2',
         '--gin.TrainConfig.eval_every=0', '--gin.TrainConfig.eval_batches=1',
         '--gin.TrainConfig.progress=False', '--gin.CheckpointConfig.save_every=3',
         '--gin.FaultConfig.heartbeat_interval_s=0.5', '--gin.FaultConfig.heartbeat_timeout_s=3',
         '--gin.FaultConfig.progress_timeout_s=8', '--gin.FaultConfig.collective_timeout_s=180',
         '--gin.FaultConfig.restart_backoff_s=0.2', '--gin.FaultConfig.timing_every=1']
# Memory and all-reduce only: the matmul check compares with the machine's
# peak, which a CPU shared with the other test processes does not reach.
LAUNCH = ['--devices', '1', '--grace_s', '2', '--diagnose_args', '--checks memory,allreduce', '--quiet']


# --- heartbeats: authentication ----------------------------------------------------

def payload(**kw):
  return {'host': 'h', 'process': 0, 'pid': 1, 'step': 3, 'ts': time.time(), 'nonce': os.urandom(8).hex(), **kw}


def test_heartbeat_round_trip_and_forgeries_are_refused():
  v = hb.Verifier(SECRET, window_s=30)
  good = hb.sign(payload(), SECRET)
  assert v.verify(good)['step'] == 3
  with pytest.raises(hb.Rejected, match='replay'):
    v.verify(good)                                         # the same datagram again
  with pytest.raises(hb.Rejected, match='bad signature'):
    v.verify(hb.sign(payload(), 'cd' * 32))                # another job's secret
  tampered = json.loads(hb.sign(payload(), SECRET))
  tampered['payload'] = tampered['payload'].replace('"step":3', '"step":4')
  with pytest.raises(hb.Rejected, match='bad signature'):
    v.verify(json.dumps(tampered).encode())
  for garbage in (b'', b'\xff\xfe', b'not json', b'[1, 2]', b'{"payload": 1, "mac": "00"}'):
    with pytest.raises(hb.Rejected, match='malformed'):
      v.verify(garbage)
  with pytest.raises(hb.Rejected, match='stale'):
    v.verify(hb.sign(payload(ts=time.time() - 100), SECRET))
  with pytest.raises(hb.Rejected, match='malformed'):
    v.verify(b'x' * (hb.MAX_DATAGRAM + 1))
  with pytest.raises(hb.Rejected, match='lacks'):
    v.verify(hb.sign({'ts': time.time()}, SECRET))


class _Timer:
  current, step = 'data', 0


def test_client_reports_step_phase_loss_and_warnings(monkeypatch):
  import logging
  sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
  sock.bind(('127.0.0.1', 0))
  sock.settimeout(5)
  monkeypatch.setenv(hb.ADDRESS_ENV, '127.0.0.1:%d' % sock.getsockname()[1])
  monkeypatch.setenv(hb.SECRET_ENV, SECRET)
  monkeypatch.setenv(hb.HOST_ENV, 'node-7')
  cfg = C.FaultConfig(heartbeat_interval_s=0.05)
  client = hb.HeartbeatClient.from_env(_Timer(), cfg, process_index=3)
  try:
    client.report_step(5, 2.5, 0.1)
    client.report_step(6, float('nan'), 0.1)
    logging.getLogger('mjax.test').warning('disk almost full')
    v = hb.Verifier(SECRET)
    seen = []
    deadline = time.time() + 5
    while time.time() < deadline:
      p = v.verify(sock.recv(hb.MAX_DATAGRAM))
      seen.append(p)
      if p['step'] == 6 and p['logs']:
        break
    last = seen[-1]
    assert (last['host'], last['process'], last['pid'], last['phase']) == ('node-7', 3, os.getpid(), 'data')
    assert np.isnan(last['loss']) and any('disk almost full' in l for l in last['logs'])
    pairs = [tuple(x) for p in seen for x in p['losses']]
    assert pairs[0] == (5, 2.5) and pairs[1][0] == 6          # every step's loss, once
  finally:
    client.close()
  while True:   # the last message says the process is wrapping up
    p = hb.Verifier(SECRET).verify(sock.recv(hb.MAX_DATAGRAM))
    if p['final']:
      break
  sock.close()


def test_client_knows_when_the_driver_is_gone():
  """Authentic acknowledgements keep the client's driver alive; forged ones,
  the client's own heartbeats reflected back and a driver whose loop stopped
  watching (no `watching()` for stall_s) do not."""
  server = hb.HeartbeatServer('127.0.0.1:0', SECRET, window_s=30, stall_s=0.3)
  client = hb.HeartbeatClient(server.address, SECRET, _Timer(), interval_s=0.05, process_index=0,
                              driver_timeout_s=0.6)
  try:
    deadline = time.time() + 2
    while time.time() < deadline:
      server.watching()
      server.receive(0.05)
    assert client.acks > 0 and not client.driver_lost()
    # A driver whose loop is stuck: the heartbeats arrive, nothing answers.
    # Meanwhile an attacker sends forged acknowledgements and reflects the
    # heartbeats it can read off the driver's socket.
    attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    victim = client._sock.getsockname()
    forged = {'kind': 'ack', 'process': 0, 'pid': os.getpid(), 'ts': time.time()}
    t0 = time.time()
    while time.time() - t0 < 1.5:
      if select.select([server.sock], [], [], 0.05)[0]:
        try:
          attacker.sendto(server.sock.recv(hb.MAX_DATAGRAM), victim)   # its own heartbeat, reflected
        except BlockingIOError:
          pass   # the server's thread read it first
      attacker.sendto(hb.sign({**forged, 'nonce': os.urandom(8).hex()}, 'cd' * 32), victim)  # wrong key
    attacker.close()
    acks = client.acks
    assert client.driver_lost() and client.seconds_since_ack() > 0.6
    # (Waiting for one: on a loaded machine the reflecting loop above can
    # read every heartbeat before the server's thread does.)
    assert server.receive(1.0), 'the heartbeats are still taken meanwhile'
    # The loop is back: one authentic acknowledgement is enough.
    deadline = time.time() + 2
    while client.acks == acks and time.time() < deadline:
      server.watching()
      server.receive(0.05)
    assert not client.driver_lost()
  finally:
    client.close()
    server.close()


def test_heartbeats_are_acknowledged_while_the_owner_is_busy_and_kept_in_bounded_memory(monkeypatch):
  """The server's thread acknowledges each authentic heartbeat as it
  arrives, whether or not its owner calls `receive` (the driver's loop held
  up by slow storage). What waits for the owner is bounded: the newest
  heartbeat of each sender with every loss merged in, and the last
  MAX_REJECTED rejections (the rest counted)."""
  monkeypatch.setattr(hb, 'MAX_REJECTED', 50)
  server = hb.HeartbeatServer('127.0.0.1:0', SECRET, window_s=30)
  sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
  try:
    address = hb.parse_address(server.address)
    for i in range(120):
      sock.sendto(b'junk %d' % i, address)
    for seq in (1, 2, 3):
      beat = {'process': 4, 'pid': 77, 'attempt': 0, 'sender': 'abc', 'seq': seq, 'ts': time.time(),
              'step': seq, 'losses': [[seq, 1.0 / seq]], 'final': seq == 2}
      sock.sendto(hb.sign(beat, SECRET), address)
    deadline = time.time() + 5
    while server.acks_sent < 3 and time.time() < deadline:
      time.sleep(0.01)
    assert server.acks_sent == 3   # no `receive` yet
    for _ in range(3):
      acked = hb.Verifier(SECRET).verify(sock.recv(hb.MAX_DATAGRAM))
      assert acked['kind'] == 'ack' and acked['process'] == 4
    got = server.receive(1.0)
    rejected = [reason for p, reason, _ in got if p is None]
    beats = [p for p, _, _ in got if p is not None]
    assert len(rejected) == 50 and server.rejected_dropped == 70
    assert all(r.startswith('malformed') for r in rejected)
    (beat,) = beats
    assert beat['step'] == 3 and beat['final'] and beat['losses'] == [[1, 1.0], [2, 0.5], [3, 1.0 / 3]]
    assert server.receive(0.0) == []
    # Signed but odd (a sender id that is an object, losses that are no
    # list): taken as they are; the thread goes on acknowledging. And a
    # sender's losses pile up uncapped while the owner is away (where a
    # spike began decides where a rollback goes).
    odd = {'process': 5, 'pid': 78, 'attempt': 0, 'sender': {'a': 1}, 'seq': 1, 'ts': time.time(), 'losses': 'x'}
    sock.sendto(hb.sign(odd, SECRET), address)
    sock.sendto(hb.sign({**odd, 'seq': 2, 'losses': [[1, 2.0]]}, SECRET), address)
    for seq in range(1, 301):
      sock.sendto(hb.sign({**beat, 'sender': 'many', 'seq': seq, 'ts': time.time(), 'losses': [[seq, 1.0]],
                           'final': False}, SECRET), address)
    deadline = time.time() + 10
    while server.acks_sent < 3 + 2 + 300 and time.time() < deadline:
      time.sleep(0.01)
    assert server.acks_sent == 305 and server.alive() and server.thread_errors == 0
    got = {p['process'] if p['sender'] != 'many' else 'many': p for p, _, _ in server.receive(1.0)}
    assert got[5]['losses'] == [[1, 2.0]]
    assert [s for s, _ in got['many']['losses']] == list(range(1, 301))
  finally:
    sock.close()
    server.close()



def test_no_driver_no_client(monkeypatch):
  monkeypatch.delenv(hb.ADDRESS_ENV, raising=False)
  assert hb.HeartbeatClient.from_env(_Timer(), C.FaultConfig(), 0) is None
  monkeypatch.setenv(hb.ADDRESS_ENV, '127.0.0.1:9')
  monkeypatch.delenv(hb.SECRET_ENV, raising=False)
  with pytest.raises(ValueError, match='MJAX_JOB_SECRET'):
    hb.HeartbeatClient.from_env(_Timer(), C.FaultConfig(), 0)


# --- detection ----------------------------------------------------------------------

def test_timeout_hierarchy_is_enforced():
  C.validate(C.Config())
  with pytest.raises(C.ConfigError, match=r'FaultConfig.heartbeat_timeout_s = 30.0 is not allowed: must be '
                                          r'less than FaultConfig.progress_timeout_s = 20.0'):
    C.validate(C.Config(fault=C.FaultConfig(heartbeat_timeout_s=30, progress_timeout_s=20)))
  with pytest.raises(C.ConfigError, match='heartbeat_interval_s < heartbeat_timeout_s'):
    C.load_config(['tiny.gin'], ['FaultConfig.progress_timeout_s = 900'])


def test_loss_monitor_nan_and_spike_runs():
  m = detect.LossMonitor(factor=3.0, count=3, min_history=5)
  for s in range(1, 11):
    assert m.feed(s, 2.0 + 0.01 * s) is None
  assert m.feed(11, 9.0) is None and m.feed(12, 9.5) is None   # two spikes: noise
  assert m.feed(13, 2.1) is None                                # run broken
  assert m.feed(13, 50.0) is None                               # a repeated step is ignored
  for s in (14, 15):
    assert m.feed(s, 10.0) is None
  f = m.feed(16, 11.0)
  assert f.kind == 'loss_spike' and f.step == 16 and f.extra['first_step'] == 14
  m.new_attempt()
  f = m.feed(9, float('inf'))
  assert f.kind == 'nonfinite_loss' and f.step == 9


def beat(mon, process, pid, step, phase='compute', now=0.0, **kw):
  return mon.beat({'process': process, 'pid': pid, 'step': step, 'phase': phase, **kw}, now)


def test_monitor_lost_hang_and_culprit():
  cfg = C.FaultConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=3, progress_timeout_s=8,
                      collective_timeout_s=60)
  mon = detect.Monitor(cfg, detect.LossMonitor(3.0, 3))
  mon.add(0, 'a', 100, now=0.0)
  mon.add(1, 'b', 101, now=0.0)
  assert mon.check(59.0) is None                                  # compiling: allowed
  assert mon.check(61.0).kind == 'startup_timeout'
  # Steps from t = 20; process 1 stops at step 25 (t = 22), process 0 one
  # step later, blocked in the collective that 1 never joins.
  for t in range(0, 40):
    beat(mon, 0, 100, None if t < 20 else min(3 + t, 26), now=float(t))
    beat(mon, 1, 101, None if t < 20 else min(3 + t, 25), now=float(t))
  assert beat(mon, 1, 999, 40, now=39.0) is None and mon.procs[1].step == 25  # an old attempt's pid
  assert mon.check(30.0) is None
  f = mon.check(30.5)            # 1 crossed the line; 0, stuck for 7.5 s, is a suspect too
  assert f.kind == 'hang' and f.processes == [1] and set(f.extra['stalled']) == {0, 1}
  assert mon.check(39.0 + 3.5).kind == 'heartbeat_lost'           # heartbeats stop altogether
  # A process that said goodbye is not expected to beat, only to exit.
  beat(mon, 0, 100, 26, now=40.0, final=True)
  mon.procs[1].exited = 0
  assert mon.check(99.0) is None
  f = mon.check(101.0)
  assert f.kind == 'hang' and f.processes == [0]


def test_start_up_heartbeats_name_the_part_of_start_up_and_a_silent_process_is_lost():
  # Trainers heartbeat from early in start-up (phases 'startup:...'): a
  # wedged one is lost after heartbeat_timeout_s, not at the start-up
  # allowance; a late one is named with the part of start-up it was in; and
  # the job is "running" only once every process is past start-up.
  mon = monitor_of_one()
  mon.add(1, 'b', 101, now=0.0)
  beat(mon, 1, 101, None, phase='startup:restore', now=0.0)     # then nothing: wedged
  for t in range(0, 5):
    beat(mon, 0, 100, None, phase='startup:restore', now=float(t))
    assert not mon.everyone_running()
  assert mon.check(3.0) is None
  f = mon.check(3.5)
  assert f.kind == 'heartbeat_lost' and f.processes == [1], f

  mon = monitor_of_one()
  for i in (1, 2):
    mon.add(i, 'abc'[i], 100 + i, now=0.0)
  for t in range(0, 62):
    beat(mon, 0, 100, None, phase='startup:restore' if t < 20 else 'startup:compile', now=float(t))
    beat(mon, 1, 101, 1 if t > 30 else None, phase='compute' if t > 30 else 'startup:compile', now=float(t))
  f = mon.check(61.0)
  assert f.kind == 'startup_timeout' and f.processes == [0, 2], f
  assert f.detail.endswith('of launch: process(es) 0 (startup:compile), 2 (never heard from)'), f.detail
  assert f.extra == {'heartbeating': [0]}
  beat(mon, 0, 100, None, phase='compute', now=62.0)
  beat(mon, 2, 102, None, phase='startup:first_step', now=62.0)
  assert not mon.everyone_running()
  beat(mon, 2, 102, None, phase='data', now=62.5)
  assert mon.everyone_running()


def monitor_of_one(collective_timeout_s=60, **kw):
  """A Monitor of one process (0 on host 'a', pid 100), added at time 0,
  with the small timeouts of these tests (hang after 8 s)."""
  cfg = C.FaultConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=3, progress_timeout_s=8,
                      collective_timeout_s=collective_timeout_s)
  mon = detect.Monitor(cfg, detect.LossMonitor(3.0, 3), **kw)
  mon.add(0, 'a', 100, now=0.0)
  return mon


def test_a_save_or_an_evaluation_gets_the_collective_timeout_and_each_batch_is_progress():
  mon = monitor_of_one()
  # A last save of 50 s (a large state on network storage): saving, not hung.
  for t in range(0, 51):
    beat(mon, 0, 100, 12, phase='checkpoint', now=float(t))
    assert mon.check(float(t)) is None, t
  for t in range(51, 62):
    beat(mon, 0, 100, 12, phase='checkpoint', now=float(t))
  f = mon.check(61.0)
  assert f.kind == 'hang' and f.processes == [0]
  assert f.detail.endswith('collective_timeout_s = 60s (in phase checkpoint)'), f.detail
  # An evaluation: its first batch compiles (40 s), then each batch ticks
  # (5 s apart, 100 s in all); a stuck one is judged from its last tick.
  mon = monitor_of_one()
  for t in range(0, 141):
    beat(mon, 0, 100, 20, phase='eval', ticks=0 if t < 40 else (t - 40) // 5, now=float(t))
    assert mon.check(float(t)) is None, t
  for t in range(141, 202):   # heartbeats go on, the batch count stays
    beat(mon, 0, 100, 20, phase='eval', ticks=20, now=float(t))
    assert (mon.check(float(t)) is None) == (t <= 200), t
  # In a step, the progress timeout as before.
  beat(mon, 0, 100, 21, phase='compute', now=202.0)
  for t in (204.0, 206.0, 208.0, 210.0):
    beat(mon, 0, 100, 21, phase='compute', now=t)
  assert mon.check(210.0) is None and mon.check(210.5).detail.endswith('progress_timeout_s = 8s')


def test_a_save_and_a_restore_get_the_checkpoint_io_timeout():
  mon = monitor_of_one(io_timeout_s=1000, restoring=True)
  assert mon.check(1059.0) is None                  # restoring: 60 s + 1000 s
  f = mon.check(1061.0)
  assert f.kind == 'startup_timeout' and f.detail.endswith(
      'collective_timeout_s = 60s + CheckpointConfig.io_timeout_s = 1000s (a restore) of launch: '
      'process(es) 0 (never heard from)'), f.detail
  mon = monitor_of_one(io_timeout_s=1000)
  assert mon.check(61.0).kind == 'startup_timeout'  # nothing to restore: 60 s
  mon = monitor_of_one(io_timeout_s=1000)
  for t in range(0, 1002):
    beat(mon, 0, 100, 12, phase='checkpoint', now=float(t))
    assert (mon.check(float(t)) is None) == (t <= 1000), t
  assert mon.check(1001.0).detail.endswith('CheckpointConfig.io_timeout_s = 1000s (in phase checkpoint)')


def test_steps_longer_than_the_progress_timeout_are_no_hang():
  # 20 s steps (many accumulation slices) under an 8 s progress timeout: a
  # step may take three of the last one before it is a hang.
  mon = monitor_of_one(collective_timeout_s=600)
  for t in range(0, 201):
    step = t // 20
    beat(mon, 0, 100, step or None, step_time=20.0 if step else None, now=float(t))
    assert mon.check(float(t)) is None, t
  for t in range(201, 262):   # step 10 never ends
    beat(mon, 0, 100, 10, step_time=20.0, now=float(t))
    assert (mon.check(float(t)) is None) == (t <= 260), t
  f = mon.check(261.0)
  assert f.kind == 'hang' and f.detail.endswith('3 times its last step (20.0s)'), f.detail


def test_a_malformed_injected_fault_is_bad_input_naming_what_is_allowed():
  # A typo in MJAX_FAULT is the user's to fix: a UserError (exit status 2,
  # never restarted, one paragraph), not a ValueError traceback (status 1,
  # a crash the driver restarts).
  from mjax.ft import inject
  for spec, said in (('bogus', "unknown fault 'bogus'"), ('nan:stp=3', "unknown key 'stp'"),
                     ('nan:step=x', "step='x' is not a whole number"), ('nan:step', 'step has no value'),
                     ('delay:seconds=soon', "seconds='soon' is not a number")):
    with pytest.raises(UserError) as e:
      inject.parse(spec)
    msg = str(e.value)
    assert said in msg and f'MJAX_FAULT={spec!r}' in msg and '\n' not in msg, msg
    assert 'the kinds: kill, hang, slow' in msg and 'the keys: step, process' in msg, msg
  with pytest.raises(UserError, match="a throttle's factor"):
    inject.parse('throttle:factor=2')
  assert inject.parse(' nan:step=8 ; kill:step=3:process=1') == [
      inject.InjectedFault('nan', step=8), inject.InjectedFault('kill', step=3, process=1)]


def test_mjax_train_with_a_malformed_injected_fault_exits_2_in_one_paragraph(tmp_path, repo_root):
  run = subprocess.run([sys.executable, '-c', 'from mjax.cli import train_main; train_main()', '--gin_file',
                        'configs/tiny.gin', '--gin.TrainConfig.steps=1', '--gin.CheckpointConfig.enabled=False',
                        '--workdir', str(tmp_path / 'run')], cwd=repo_root, capture_output=True, text=True,
                       timeout=300, env=child_env(MJAX_FAULT='nan:stp=3'))
  assert run.returncode == protocol.EXIT_USER_ERROR, run.stderr[-3000:]
  assert 'Traceback' not in run.stderr, run.stderr[-3000:]
  errors = [l for l in run.stderr.splitlines() if l.startswith('mjax-train: error:')]
  assert len(errors) == 1 and "unknown key 'stp'" in errors[0] and 'the keys: step' in errors[0], run.stderr[-3000:]


def test_an_injected_stall_holds_its_phase_once_after_its_step(tmp_path, monkeypatch):
  from mjax.ft import inject, phases
  with pytest.raises(ValueError, match='a stall names its phase'):
    inject.parse('stall:seconds=3')
  slept = []
  monkeypatch.setattr(inject.time, 'sleep', slept.append)
  timer = phases.PhaseTimer(str(tmp_path), 0)
  inject.Injector(inject.parse('stall:phase=checkpoint:step=2:seconds=30'), 0, 0).watch(timer)
  for step in (1, 2, 3):
    with timer.phase('checkpoint'):
      pass
    with timer.phase('eval'):
      timer.tick()
    timer.end_step(step)
  assert slept == [30.0] and timer.ticks == 3
  with timer.phase('checkpoint'):   # after the last step, as the final save
    pass
  assert slept == [30.0]


def test_culprits_same_step_earliest_stop():
  ps = [detect.ProcState(i, 'h', i, 0.0, step=7, last_progress=t) for i, t in ((0, 5.0), (1, 2.0), (2, 2.5))]
  assert detect.culprits(ps) == [1, 2]
  # Level on metrics, but 0 has dispatched step 8 (it waits in its
  # collective); 1 never started it.
  ps = [detect.ProcState(0, 'h', 0, 0.0, step=7, loop_step=8, last_progress=1.0),
        detect.ProcState(1, 'h', 1, 0.0, step=7, loop_step=7, last_progress=2.0)]
  assert detect.culprits(ps) == [1]
  # 1,000 processes level, stopped within one heartbeat interval and a relay
  # (2 s each) of each other: a hang inside the step, no process named.
  rng = random.Random(0)
  ps = [detect.ProcState(i, 'h', i, 0.0, step=7, loop_step=8, last_progress=rng.uniform(10.0, 14.0))
        for i in range(1000)]
  assert detect.culprits(ps, resolution_s=4.0) == []
  ps[123].last_progress = 1.0   # one stopped well before the rest
  assert detect.culprits(ps, resolution_s=4.0) == [123]


def test_parse_stacks():
  dump = ('Thread 0x01 (most recent call first):\n  File "/x/threading.py", line 1 in wait\n\n'
          'Current thread 0x02 (most recent call first):\n  File "/x/jax/array.py", line 9 in _value\n'
          f'  File "{os.sep}r{os.sep}mjax{os.sep}train.py", line 356 in finish\n')
  t = detect.parse_stacks(dump)
  assert t[0]['current'] and t[0]['where'].endswith('in finish') and t[1]['where'] is None


# --- hosts: block list, spares, elastic -------------------------------------------

def test_block_list_persists_and_spares_replace(tmp_path):
  b = hosts_lib.BlockList(str(tmp_path))
  b.add('h1', 'diagnostic failed: memory')
  again = hosts_lib.BlockList(str(tmp_path))
  assert 'h1' in again and again.entries[0]['reason'] == 'diagnostic failed: memory'
  assert hosts_lib.plan_hosts(2, ['h0', 'h1'], ['s0'], again) == ['h0', 's0']
  assert hosts_lib.plan_hosts(2, ['h0', 'h1'], [], again) == ['h0']
  # A damaged list is a clear error that names it, never a traceback.
  for damaged in (b'\xff\xfe garbage', b'{"bad json', b'[1, 2, 3]'):
    (tmp_path / hosts_lib.BLOCKED_FILE).write_bytes(damaged)
    with pytest.raises(UserError, match=rf'{hosts_lib.BLOCKED_FILE}: .*delete it to unblock every host'):
      hosts_lib.BlockList(str(tmp_path))


def test_elastic_keeps_global_batch():
  cfg = C.load_config(['tiny.gin'], ['TrainConfig.global_batch_size = 16'])
  assert hosts_lib.elastic_bindings(cfg, 4, 2, 2) == ['TrainConfig.grad_accum_steps = 2']
  assert hosts_lib.elastic_bindings(cfg, 2, 2, 1) == []
  with pytest.raises(hosts_lib.ElasticError, match='3 data-parallel replicas do not divide '
                                                  r'TrainConfig.global_batch_size = 16 into equal slices'):
    hosts_lib.elastic_bindings(cfg, 4, 3, 1)
  # Any replica count whose slices divide the batch, not only a divisor of
  # the old one: 1,250 hosts of 8 GPUs (tensor 8) less one go on on 1,000
  # (slices of 5 where they were 8), not on 625.
  big = C.load_config(['tiny.gin'], ['TrainConfig.global_batch_size = 10000', 'MeshConfig.tensor = 8',
                                     'MeshConfig.data = -1'])
  for n in (1249, 1001):
    with pytest.raises(hosts_lib.ElasticError):
      hosts_lib.elastic_bindings(big, 1250, n, 8)
  assert hosts_lib.elastic_bindings(big, 1250, 1000, 8) == ['TrainConfig.grad_accum_steps = 2']
  assert hosts_lib.elastic_bindings(big, 1250, 625, 8) == ['TrainConfig.grad_accum_steps = 2']
  hybrid = C.load_config(['tiny.gin'], ['MeshConfig.dcn_data = 4', 'TrainConfig.grad_accum_steps = 2',
                                        'TrainConfig.global_batch_size = 32'])
  assert hosts_lib.elastic_bindings(hybrid, 4, 2, 2) == ['TrainConfig.grad_accum_steps = 4',
                                                         'MeshConfig.dcn_data = 2']
  tp = C.load_config(['tiny.gin'], ['MeshConfig.tensor = 2'])
  with pytest.raises(hosts_lib.ElasticError, match='model-parallel'):
    hosts_lib.elastic_bindings(tp, 2, 1, 1)


def test_a_shrunk_job_is_laid_out_on_the_devices_its_processes_reported(tmp_path, monkeypatch):
  # 4 hosts of 2 GPUs, tensor = 4. --devices (fake CPU devices) is not
  # given: the layout comes from the devices the trainers reported.
  d = make_driver(tmp_path, '--processes', '4', '--hosts', 'h0,h1,h2,h3',
                  train=['--gin.MeshConfig.tensor=4', '--gin.TrainConfig.global_batch_size=16'])
  try:
    with pytest.raises(hosts_lib.ElasticError, match='no process of this job has said how many devices'):
      d._fit(['h0', 'h1', 'h2'])
    for i in range(4):   # as each trainer records it, first thing
      monkeypatch.setenv(protocol.ATTEMPT_ENV, str(i % 2))
      protocol.Facts(str(tmp_path), i).record(protocol.DEVICES, 2)
    assert protocol.devices_per_process(str(tmp_path)) == 2
    # A later fact of the same attempt (the host fault that ends it) keeps it.
    protocol.Facts(str(tmp_path), 3).record(protocol.HOST_FAULT, {'processes': [3], 'what': 'x'})
    assert protocol.read_facts(str(tmp_path), 3)[protocol.DEVICES] == 2
    # 3 hosts (6 GPUs) hold no tensor group of 4 twice: the job goes on on
    # 2 hosts (one tensor group, twice the accumulation), h2 waiting idle.
    assert d._fit(['h0', 'h1', 'h2']) == (['h0', 'h1'], ['TrainConfig.grad_accum_steps = 2'])
    e = events(tmp_path, 'elastic')[-1]
    assert e['hosts'] == 2 and e['healthy'] == 3 and e['idle'] == ['h2'] and 'does not fit in 6 devices' in e['why']
    with pytest.raises(hosts_lib.ElasticError, match='model-parallel'):
      d._fit(['h0'])
  finally:
    d.server.close()


def test_a_bind_that_cannot_listen_leaves_no_workdir_behind(tmp_path):
  for workdir in (tmp_path / 'new', tmp_path):
    opts = driver.parse_args(['--processes', '1', '--workdir', str(workdir), '--bind', '192.0.2.1:0', '--quiet',
                              '--', '--gin_file', 'tiny.gin'])
    with pytest.raises(UserError, match=r'--bind 192.0.2.1:0: cannot listen for heartbeats there'):
      driver.Driver(opts, executor_factory=FakeExecutor)
  assert sorted(os.listdir(tmp_path)) == []     # neither the new workdir nor logs/ or events.jsonl in an old one


def test_a_workdir_held_by_a_run_started_by_hand_is_refused_before_anything_is_written(tmp_path, monkeypatch):
  """mjax-launch on a workdir that an mjax-train started by hand holds:
  before, its trainers waited 120 s for the run lock and gave up, after the
  driver had written its events and logs into that run's workdir. A
  driven job's holder (an earlier attempt on its way out) is waited for."""
  import fcntl
  from mjax.checkpoint import locks
  monkeypatch.setattr(locks, 'OUTSIDE_RUN_WAIT_S', 0.5)   # (30 s: a run stopped to be resumed here saves first)
  fd = os.open(tmp_path, os.O_RDONLY)
  fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  try:
    for job, refused in ((None, True), ('0123456789abcdef', False)):
      (tmp_path / '.mjax-lock').write_text(json.dumps({'pid': 4242, 'host': 'h', 'started': 0, 'job': job}))
      opts = driver.parse_args(['--processes', '1', '--workdir', str(tmp_path), '--quiet', '--', '--gin_file',
                                'tiny.gin'])
      if refused:
        with pytest.raises(UserError, match=r'is in use by a run started without mjax-launch \(process 4242 on h'):
          driver.Driver(opts, executor_factory=FakeExecutor)
        assert sorted(os.listdir(tmp_path)) == ['.mjax-lock']   # nothing of the driver's written
      else:
        d = driver.Driver(opts, executor_factory=FakeExecutor)
        d.server.close()
        d.events.close()
  finally:
    os.close(fd)
  # A run stopped by hand to be resumed here, still saving: waited for.
  import threading
  monkeypatch.setattr(locks, 'OUTSIDE_RUN_WAIT_S', 30.0)
  (tmp_path / '.mjax-lock').write_text(json.dumps({'pid': 4242, 'host': 'h', 'started': 0, 'job': None}))
  fd = os.open(tmp_path, os.O_RDONLY)
  fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  threading.Timer(1.0, os.close, (fd,)).start()
  d = driver.Driver(opts, executor_factory=FakeExecutor)
  d.server.close()
  d.events.close()


def test_a_workdir_that_exists_but_cannot_be_written_is_said_in_one_paragraph(tmp_path):
  """makedirs passes on an existing workdir that cannot be written (a
  read-only mount, another user's); the driver's first write failed with a
  traceback and exit status 1, a crash to restart. (events.jsonl as a
  folder fails that write the same way, for root too.)"""
  (tmp_path / 'events.jsonl').mkdir()
  opts = driver.parse_args(['--processes', '1', '--workdir', str(tmp_path), '--quiet', '--', '--gin_file',
                            'tiny.gin'])
  with pytest.raises(UserError, match=r'--workdir .* cannot be made or written \(Is a directory\)'):
    driver.Driver(opts, executor_factory=FakeExecutor)


def test_launch_flags_are_checked(capsys):
  with pytest.raises(SystemExit):
    driver.parse_args(['--processes', '2', '--workdir', 'w', '--hosts', 'a', '--', '--gin_file', 'x'])
  with pytest.raises(SystemExit):
    driver.parse_args(['--processes', '1', '--workdir', 'w', '--', '--workdir', 'other'])
  o = driver.parse_args(['--processes', '2', '--workdir', 'w', '--spares', 's', '--host_env',
                         'slot1:MJAX_DIAGNOSE_FAIL=matmul', '--', '--gin_file', 'tiny.gin'])
  assert o.hosts == ['slot0', 'slot1'] and o.spares == ['s']
  assert o.host_env == {'slot1': {'MJAX_DIAGNOSE_FAIL': 'matmul'}}
  # Refused before anything starts: a typo in the diagnostic's arguments
  # failed every diagnosis and blocked healthy hosts for good.
  base = ['--processes', '2', '--workdir', 'w']
  for flags, said in [(['--diagnose_args=--checks matmull'], 'unknown check(s) matmull'),
                      (['--diagnose_args=--checks='], 'no check named'),
                      (['--diagnose_args=--min_fractoin 0.3'], 'unrecognized arguments: --min_fractoin'),
                      (['--diagnose_args', '"open'], 'No closing quotation'),
                      (['--diagnose_args=-h'], 'unrecognized arguments: -h'),
                      (['--grace_s', 'nan'], '--grace_s nan: give a finite number'),
                      (['--diagnose_timeout_s', '0'], 'above 0'),
                      (['--agent_wait_s', '-5'], 'at least 0'),
                      (['--processes', '0'], '--processes 0: give at least 1'),
                      (['--devices', '-2'], '--devices -2: give at least 1'),
                      (['--preempt_exit_status', '256'], 'an exit status is 0 to 255'),
                      (['--hosts', 'a,'], "has an empty name"),
                      (['--hosts', ','], "--hosts ',' has an empty name"),
                      (['--hosts', 'a,a'], "host(s) a appear more than once in --hosts 'a,a'"),
                      (['--hosts', 'a,b', '--spares', 'b'], "host(s) b appear more than once in --hosts 'a,b' / "
                                                            "--spares 'b'"),
                      # The default hosts (slot0, slot1) are no --hosts the user gave.
                      (['--spares', 'slot0'], "host(s) slot0 appear more than once in --spares 'slot0':"),
                      (['--host_env', 'nosuch:X=1'], "no host 'nosuch' in this job"),
                      (['--workdir', ''], "--workdir '': empty"),
                      (['--workdir', 'gs://b/run'], 'a URL')]:
    with pytest.raises(SystemExit) as e:
      driver.parse_args([*base, *flags, '--', '--gin_file', 'tiny.gin'])
    assert e.value.code == 2 and said in capsys.readouterr().err, flags


def test_launch_in_a_slurm_allocation_too_small_names_the_allocation(capsys, monkeypatch):
  # The hosts come from SLURM, not --hosts: a message about --hosts left the
  # user looking for a flag they never gave.
  monkeypatch.setenv('SLURM_JOB_NODELIST', 'node[1-2]')
  monkeypatch.setattr(executor, 'slurm_hosts', lambda: ['node1', 'node2'])
  base = ['--executor', 'slurm', '--workdir', 'w']
  for flags, said in [(['--processes', '3'], "--processes 3 needs 3 node(s), but the SLURM allocation "
                                             "'node[1-2]' has 2: submit with sbatch --nodes=3"),
                      (['--processes', '2', '--spares', 'node2'], "has 1 besides --spares 'node2'")]:
    with pytest.raises(SystemExit) as e:
      driver.parse_args([*base, *flags, '--', '--gin_file', 'tiny.gin'])
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in err and '--hosts names' not in err, (flags, err)
  assert driver.parse_args([*base, '--', '--gin_file', 'tiny.gin']).hosts == ['node1', 'node2']


# --- the driver's decisions, without training processes ------------------------------

class FakeExecutor(executor.LocalExecutor):
  """LocalExecutor whose diagnostics answer from a table."""
  failing: dict = {}

  def run(self, argv, env, timeout, cancel=None):
    bad = self.failing.get(self.host)
    if bad == 'slow_under_load':   # passes, with a check only load excuses
      checks = [{'name': 'matmul_float32', 'passed': False, 'suspect': True}]
      return 0, json.dumps({'host': self.host, 'passed': True, 'checks': checks,
                            'suspect': ['matmul_float32']}), ''
    checks = [{'name': 'memory', 'passed': bad != 'memory'}, {'name': 'allreduce', 'passed': True}]
    report = {'host': self.host, 'process': 0, 'passed': not bad, 'checks': checks}
    return (1 if bad else 0), json.dumps(report, indent=2), ''


def make_driver(tmp_path, *flags, train=()):
  opts = driver.parse_args(['--processes', '2', '--workdir', str(tmp_path), '--quiet', *flags, '--',
                            '--gin_file', 'tiny.gin', *train])
  opts.diagnose = ['mjax-diagnose']
  return driver.Driver(opts, executor_factory=FakeExecutor)


def fake_attempt(d, hosts):
  mon = detect.Monitor(d.fault_cfg, d.losses)
  for i, h in enumerate(hosts):
    mon.add(i, h, 1000 + i, 0.0)
  return driver.Attempt(0, hosts, {i: None for i in range(len(hosts))}, [], {}, mon, [], 0.0)


def test_a_fault_among_thousands_of_processes_is_one_short_event(tmp_path, monkeypatch):
  """At 10,000 processes a hang's event held every process's phase, logs
  and stall (3.4 MB on one line), and every process's stack was asked for:
  now the named process whole, the others counted, stacks of a sample."""
  d = make_driver(tmp_path)
  try:
    att = fake_attempt(d, [f'h{i}' for i in range(3000)])
    for p in att.monitor.procs.values():
      p.phase, p.logs = 'compute', ['a line of its log']
    att.monitor.procs[1234].phase = 'data'
    asked = []
    monkeypatch.setattr(d, '_dump_stacks', lambda att, named=None: asked.append(named))
    stalled = {i: {'host': f'h{i}', 'step': 7, 'phase': 'compute', 'stalled_s': 30.0} for i in range(3000)}
    d._on_fault(att, detect.Fault('hang', [1234], 'no step', extra={'stalled': stalled}))
    e = events(tmp_path, 'fault')[-1]
    assert e['phases'] == {'1234': 'data'} and e['phase_counts'] == {'compute': 2999, 'data': 1}
    assert list(e['last_logs']) == ['1234'] and list(e['stalled']) == ['1234'] and e['stalled_count'] == 3000
    assert len(json.dumps(e)) < 2000 and asked == [[1234]]
  finally:
    d.server.close()


def test_stacks_of_many_processes_are_asked_of_the_named_and_a_sample(tmp_path, monkeypatch):
  import signal as signals
  d = make_driver(tmp_path)
  try:
    n = 200
    att = fake_attempt(d, [f'h{i}' for i in range(n)])

    class Handle:
      def __init__(self):
        self.signals = []

      def poll(self):
        return None

      def send_signal(self, sig):
        self.signals.append(sig)
    att.handles = {i: Handle() for i in range(n)}
    for i in range(n):
      (tmp_path / f'p{i}.log').write_text('')
      att.logs[i] = (str(tmp_path / f'p{i}.log'), 0)
      att.monitor.procs[i].first_beat = 1.0
    monkeypatch.setattr(driver, 'STACK_WAIT_S', 0.0)
    d._dump_stacks(att, [77])
    signalled = sorted(i for i, h in att.handles.items() if h.signals == [signals.SIGUSR1])
    assert 77 in signalled and 0 in signalled and n - 1 in signalled and len(signalled) <= 1 + driver.STACK_SAMPLE
    assert sorted(e['process'] for e in events(tmp_path, 'stack_dump')) == signalled
  finally:
    d.server.close()


def test_a_heartbeat_buffer_too_small_for_the_job_is_said(tmp_path):
  d = make_driver(tmp_path)
  try:
    assert d._buffer_warning() is None               # 2 processes: any buffer holds their beats
    d.opts.processes, d.server.receive_buffer = 10_000, 416 << 10
    said = d._buffer_warning()
    assert said.startswith("the heartbeat socket's receive buffer is 416 KiB, less than the ~7500 KiB 10000 "
                           "processes' heartbeats need") and 'net.core.rmem_max' in said, said
    d.server.receive_buffer = 8 << 20
    assert d._buffer_warning() is None
  finally:
    d.server.close()


def test_failing_diagnostic_blocks_its_host_only(tmp_path, monkeypatch):
  monkeypatch.setattr(FakeExecutor, 'failing', {'slot1': 'memory'})
  d = make_driver(tmp_path)
  d._diagnose(fake_attempt(d, ['slot0', 'slot1']), detect.Fault('exit', [1]))
  blocked = hosts_lib.BlockList(str(tmp_path))
  assert blocked.hosts() == ['slot1'] and 'memory' in blocked.entries[0]['reason']
  # Every host failing at once: a shared cause, nobody blocked.
  monkeypatch.setattr(FakeExecutor, 'failing', {'a': 'memory', 'b': 'memory'})
  d._diagnose(fake_attempt(d, ['a', 'b']), detect.Fault('exit', [1]))
  assert hosts_lib.BlockList(str(tmp_path)).hosts() == ['slot1']
  assert events(tmp_path, 'diagnosis_suspect')
  d.server.close()


def test_slow_under_load_twice_in_a_row_blocks_the_host(tmp_path, monkeypatch):
  monkeypatch.setattr(FakeExecutor, 'failing', {'slot1': 'slow_under_load'})
  d = make_driver(tmp_path)
  att = fake_attempt(d, ['slot0', 'slot1'])
  d._diagnose(att, detect.Fault('exit', [1]))
  assert hosts_lib.BlockList(str(tmp_path)).hosts() == []          # load may explain it once
  monkeypatch.setattr(FakeExecutor, 'failing', {})
  d._diagnose(att, detect.Fault('exit', [1]))                      # a clean pass resets the count
  monkeypatch.setattr(FakeExecutor, 'failing', {'slot1': 'slow_under_load'})
  d._diagnose(att, detect.Fault('exit', [1]))
  assert hosts_lib.BlockList(str(tmp_path)).hosts() == []
  d._diagnose(att, detect.Fault('exit', [1]))                      # twice in a row: it does not
  blocked = hosts_lib.BlockList(str(tmp_path))
  assert blocked.hosts() == ['slot1'] and 'slow under load' in blocked.entries[0]['reason']
  d.server.close()


def test_every_host_slow_under_load_blocks_none(tmp_path, monkeypatch):
  # Hosts of one machine, diagnosed side by side, are all slow under the
  # load they share: however often that happens, nobody is blocked (blocking
  # them all would end the workdir for good).
  monkeypatch.setattr(FakeExecutor, 'failing', {'slot0': 'slow_under_load', 'slot1': 'slow_under_load'})
  d = make_driver(tmp_path)
  att = fake_attempt(d, ['slot0', 'slot1'])
  for _ in range(3):
    d._diagnose(att, detect.Fault('exit', [1]))
  assert hosts_lib.BlockList(str(tmp_path)).hosts() == []
  assert any('shared' in e['detail'] for e in events(tmp_path, 'diagnosis_suspect'))
  # One host left (the other blocked for a real failure): slow twice, kept.
  monkeypatch.setattr(FakeExecutor, 'failing', {'slot1': 'memory'})
  d._diagnose(att, detect.Fault('exit', [1]))
  monkeypatch.setattr(FakeExecutor, 'failing', {'slot0': 'slow_under_load'})
  alone = fake_attempt(d, ['slot0'])
  d._diagnose(alone, detect.Fault('exit', [0]))
  d._diagnose(alone, detect.Fault('exit', [0]))
  assert hosts_lib.BlockList(str(tmp_path)).hosts() == ['slot1']
  assert any('last host left' in e['detail'] for e in events(tmp_path, 'diagnosis_suspect'))
  d.server.close()


def test_straggler_flagged_then_evicted(tmp_path, monkeypatch):
  """The analysis runs in its own thread on what the timing files gain
  during the attempt (an earlier attempt's rows are not judged), read
  incrementally, a row split across two reads included."""
  monkeypatch.setattr(FakeExecutor, 'failing', {})
  os.makedirs(tmp_path / 'timings')
  path = lambda p: tmp_path / 'timings' / f'process-{p:05d}.jsonl'

  def rows(steps, slow_process):
    return {p: ''.join(json.dumps({'step': s, 'process': p, 'host': 'h', 'time': 1000.0 + s * 1.5,
                                   'phases': {'data': 0.01, 'compute': 1.5 if p == slow_process else 1.0}})
                       + '\n' for s in steps) for p in range(3)}

  for p, text in rows(range(1, 31), 0).items():   # an earlier attempt, where process 0 was slow
    path(p).write_text(text)
  d = make_driver(tmp_path, '--processes', '3')
  att = fake_attempt(d, ['slot0', 'slot1', 'slot2'])
  watch = driver._StragglerWatch(str(tmp_path), {0, 1, 2}, d.fault_cfg, every_s=0.05)
  found = []
  try:
    new = rows(range(31, 61), 2)
    for p, text in new.items():
      with open(path(p), 'a') as fh:
        fh.write(text[:len(text) // 2 + 7])        # cut inside a row
    time.sleep(0.2)
    for p, text in new.items():
      with open(path(p), 'a') as fh:
        fh.write(text[len(text) // 2 + 7:])
    deadline = time.time() + 10
    while not found and time.time() < deadline:
      found += watch.take()
      time.sleep(0.05)
  finally:
    watch.close()
  assert [s.process for s in found][:1] == [2] and all(s.process == 2 for s in found)
  assert d._stragglers(att, set(), found) is None                # flagged only
  (ev,) = events(tmp_path, 'straggler')
  assert ev['process'] == 2 and ev['host'] == 'slot2' and not ev['evict']
  d.server.close()
  d = make_driver(tmp_path, '--processes', '3', train=['--gin.FaultConfig.evict_stragglers=True'])
  fault = d._stragglers(att, set(), found)
  assert fault.kind == 'straggler' and fault.processes == [2]
  d._diagnose(att, fault)
  assert hosts_lib.BlockList(str(tmp_path)).hosts() == ['slot2']
  d.server.close()


def test_a_straggler_in_the_last_seconds_is_named_when_the_job_finishes(tmp_path, monkeypatch):
  # The periodic analysis runs every 5 s or more: a process slowed only in
  # the run's last seconds shows in no periodic run. The job's end asks for
  # one last analysis; its straggler is reported and, the job being over,
  # not evicted.
  monkeypatch.setattr(FakeExecutor, 'failing', {})
  os.makedirs(tmp_path / 'timings')
  for p in range(3):
    (tmp_path / 'timings' / f'process-{p:05d}.jsonl').write_text('')
  d = make_driver(tmp_path, '--processes', '3', train=['--gin.FaultConfig.evict_stragglers=True'])
  att = fake_attempt(d, ['slot0', 'slot1', 'slot2'])
  watch = driver._StragglerWatch(str(tmp_path), {0, 1, 2}, d.fault_cfg, every_s=3600.0)
  for p in range(3):
    with open(tmp_path / 'timings' / f'process-{p:05d}.jsonl', 'a') as fh:
      fh.write(''.join(json.dumps({'step': s, 'process': p, 'host': 'h', 'time': 1000.0 + s * 1.5,
                                   'phases': {'data': 0.01, 'compute': 1.5 if p == 1 else 1.0}}) + '\n'
                       for s in range(1, 31)))
  assert watch.take() == []
  found = watch.close(final=True)
  assert found and all(s.process == 1 for s in found)
  assert d._stragglers(att, set(), found, finished=True) is None
  (ev,) = events(tmp_path, 'straggler')
  assert ev['process'] == 1 and not ev['evict'] and 'found as the job finished' in ev['detail']
  # One name for the host in the event: the driver's (the timings' is 'h').
  assert ev['host'] == 'slot1' and ev['detail'].startswith('process 1 on slot1:') and ev['timing_host'] == 'h'
  # Stopped for any other reason, no last analysis is run.
  watch = driver._StragglerWatch(str(tmp_path), {0, 1, 2}, d.fault_cfg, every_s=3600.0, from_end=False)
  t0 = time.monotonic()
  assert watch.close() == [] and time.monotonic() - t0 < 5
  d.server.close()


def test_the_only_host_is_not_evicted_as_a_straggler(tmp_path):
  # A single-process job of several GPUs can name a slow GPU; evicting its
  # host would end the job, so it is reported only.
  d = make_driver(tmp_path, '--processes', '1', train=['--gin.FaultConfig.evict_stragglers=True'])
  att = fake_attempt(d, ['slot0'])
  slow = stragglers.Straggler(process=0, host='slot0', slowdown=0.5, reason='device', ratio=1.5, lateness=0.0,
                              lateness_s=0.0, slow_share=1.0, first_step=10, last_step=30, device=3)
  assert d._stragglers(att, set(), [slow]) is None
  (ev,) = events(tmp_path, 'straggler')
  assert not ev['evict'] and ev['device'] == 3 and 'not evicted: no host left' in ev['detail']
  assert hosts_lib.BlockList(str(tmp_path)).hosts() == []
  d.server.close()


def test_a_job_slowed_as_a_whole_is_reported_though_no_process_stands_out(tmp_path, monkeypatch):
  # A process slowed inside the step holds every process in the collective:
  # all steps take 1.0 s, then all 2.0 s, every process ending together. No
  # straggler; the job's pace against its own start is what shows it.
  monkeypatch.setattr(FakeExecutor, 'failing', {})
  os.makedirs(tmp_path / 'timings')
  path = lambda p: tmp_path / 'timings' / f'process-{p:05d}.jsonl'

  def rows(steps, seconds):
    return {p: ''.join(json.dumps({'step': s, 'process': p, 'host': 'h', 'time': 1000.0 + 3.0 * s,
                                   'phases': {'data': 0.01, 'compute': seconds}}) + '\n' for s in steps)
            for p in range(2)}

  for p in range(2):
    path(p).write_text('')
  d = make_driver(tmp_path)
  att = fake_attempt(d, ['slot0', 'slot1'])
  watch = driver._StragglerWatch(str(tmp_path), {0, 1}, d.fault_cfg, every_s=0.05)
  w = d.fault_cfg.straggler_window
  found = []
  try:
    for steps, seconds in ((range(1, w + 1), 1.0), (range(w + 1, 3 * w + 1), 2.0)):
      found += watch.take()                        # what was analysed before this write
      seen = watch.analyses
      for p, text in rows(steps, seconds).items():
        with open(path(p), 'a') as fh:
          fh.write(text)
      # Two analyses after the write: the second one started after it.
      deadline = time.time() + 30
      while time.time() < deadline and (watch.analyses < seen + 2 or (seconds == 2.0 and not watch.pace_notes)):
        found += watch.take()
        time.sleep(0.05)
  finally:
    watch.close()
  assert not found
  (note,) = watch.pace_notes
  assert note['slowed'] and note['baseline_s'] == pytest.approx(1.01) and note['pace_s'] == pytest.approx(2.01)
  d._pace_event(att, note)
  (ev,) = events(tmp_path, 'job_slowdown')
  assert ev['factor'] == pytest.approx(1.99, abs=0.01) and 'no process ends its steps later' in ev['detail']
  assert stragglers.job_pace([], 5) is None
  d.server.close()


def test_rollback_accumulates_skips(tmp_path, monkeypatch):
  d = make_driver(tmp_path)
  att = fake_attempt(d, ['slot0', 'slot1'])
  monkeypatch.setattr(d, '_checkpoint_step', lambda below=None: 6)
  d._rollback(att, detect.Fault('nonfinite_loss', [0], step=8))
  assert d.skip == (6, 2)
  # NaN again before a newer checkpoint: step 7 now reads batch 7 + 2.
  d._rollback(att, detect.Fault('nonfinite_loss', [0], step=7))
  assert d.skip == (6, 3)
  d.server.close()


def test_with_a_host_local_tier_the_rollback_and_the_restart_streak_follow_the_trainers(tmp_path, monkeypatch):
  # The driver cannot list a host-local fast tier. A NaN at 55 with the
  # persistent tier at 0 and the host tier at 40: the rollback skipped 55
  # batches from "0" while the trainers resumed at 40, dropping 40 good
  # ones. And a job dying at step 58 every time resumed from 40 every time
  # and caught up every time, which reset the streak: it never gave up.
  from mjax import protocol
  host = ['--gin.CheckpointConfig.fast_every=20', "--gin.CheckpointConfig.fast_scope='host'"]
  d = make_driver(tmp_path, train=host)
  assert not d._progress_visible()
  att = fake_attempt(d, ['slot0', 'slot1'])
  monkeypatch.setenv(protocol.ATTEMPT_ENV, str(att.number))
  monkeypatch.setenv(protocol.DRIVER_RUN_ENV, d.run_id)   # as the driver launches its trainers
  for i in (0, 1):
    protocol.Facts(str(tmp_path), i).record(protocol.NONFINITE, {'step': 55, 'loss': 'nan', 'what': 'loss',
                                                                 'resume_from': 40})
  d._rollback(att, detect.Fault('nonfinite_loss', [0], step=55))
  assert d.skip == (40, 15) and d._resume_step() == 40
  assert events(tmp_path, 'rollback')[-1]['checkpoint_step'] == 40
  # The restart streak: attempts that resume from the step the one before
  # resumed from saved nothing newer in between.
  progressed = []
  for number, resumed in enumerate((0, 40, 40, 40)):
    att = driver.Attempt(number, ['slot0'], {0: None}, [], {}, detect.Monitor(d.fault_cfg, d.losses), [], 0.0)
    monkeypatch.setenv(protocol.ATTEMPT_ENV, str(number))
    monkeypatch.setenv(protocol.DRIVER_RUN_ENV, d.run_id)
    protocol.Facts(str(tmp_path), 0).record(protocol.STARTUP, {'resumed_step': resumed})
    progressed.append(d._progressed(att))
  assert progressed == [True, True, False, False]
  d.server.close()


def test_progress_counts_from_the_step_the_trainers_resumed_from(tmp_path, monkeypatch):
  # The newest step on disk at launch (1000 here: a stray numbered folder,
  # or a damaged step) was set aside by the trainers, who resumed from 80
  # and saved 120 before the next fault. Measured against 1000, that was no
  # progress: a restart the job had earned counted against max_restarts.
  from mjax import protocol
  d = make_driver(tmp_path)
  assert d._progress_visible()
  for step in (80, 120):
    (tmp_path / 'checkpoints' / str(step) / 'state').mkdir(parents=True)
  monkeypatch.setenv(protocol.DRIVER_RUN_ENV, d.run_id)
  for number, resumed, progressed in ((0, 80, True), (1, 120, False)):
    monkeypatch.setenv(protocol.ATTEMPT_ENV, str(number))
    att = driver.Attempt(number, ['slot0'], {0: None}, [], {}, detect.Monitor(d.fault_cfg, d.losses), [], 0.0,
                         checkpoint_at_launch=1000)
    protocol.Facts(str(tmp_path), 0).record(protocol.STARTUP, {'resumed_step': resumed})
    assert d._progressed(att) is progressed, (number, resumed)
  d.server.close()


def test_a_process_whose_collective_failed_after_its_peer_left_is_not_blamed(tmp_path, monkeypatch):
  # Process 1 killed; process 0's next all-reduce fails on the closed
  # connection and it exits 1 in the same poll. The fault named both, and
  # the link check found no healthy host to pair with.
  from mjax import distributed
  gloo = RuntimeError('UNKNOWN: Gloo all-reduce failed: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] '
                      'Read error [127.0.0.1]:61107: Connection reset by peer')
  assert distributed.peer_gone(gloo)
  assert not distributed.peer_gone(RuntimeError('Connection reset by peer'))   # not a collective's
  assert not distributed.peer_gone(ValueError('all-reduce of a wrong shape'))
  d = make_driver(tmp_path)
  att = fake_attempt(d, ['slot0', 'slot1'])
  monkeypatch.setenv(protocol.ATTEMPT_ENV, str(att.number))
  monkeypatch.setenv(protocol.DRIVER_RUN_ENV, d.run_id)   # as the driver launches its trainers
  protocol.Facts(str(tmp_path), 0).record(protocol.PEER_LOST, str(gloo))
  fault = d._exit_fault(att, {0: 1, 1: -9})
  assert fault.processes == [1] and fault.extra['peers_left_after'] == [0], fault
  assert fault.detail == 'exited abnormally (process 1: SIGKILL)', fault   # how it ended, not only that
  # Every one of them saying so: nothing to tell apart, all are named.
  protocol.Facts(str(tmp_path), 1).record(protocol.PEER_LOST, str(gloo))
  fault = d._exit_fault(att, {0: 1, 1: 1})
  assert fault.processes == [0, 1] and fault.detail == 'exited abnormally (process 0: status 1, process 1: status 1)'
  # Facts of the same attempt number under an earlier driver on this
  # workdir (each driver counts its attempts from 0) are not this one's:
  # a stale peer_lost of process 0 named only process 1 when both were
  # killed.
  monkeypatch.setenv(protocol.DRIVER_RUN_ENV, 'an-earlier-driver')
  for i in (0, 1):
    protocol.Facts(str(tmp_path), i).record(protocol.PEER_LOST, str(gloo))
  monkeypatch.setenv(protocol.DRIVER_RUN_ENV, d.run_id)
  assert d._exit_fault(att, {0: -9, 1: -9}).processes == [0, 1]
  assert protocol.Facts(str(tmp_path), 0).get(protocol.PEER_LOST) is None   # nor merged into this run's
  # Process 1 stopped before its first heartbeat; process 0 gave up waiting
  # for it to join the job (exit 1): the silent one is the suspect.
  att = fake_attempt(d, ['slot0', 'slot1'])
  att.monitor.procs[0].first_beat, att.monitor.procs[0].phase = 1.0, 'startup:join'
  fault = d._exit_fault(att, {0: 1})
  assert (fault.kind, fault.processes) == ('startup_timeout', [1]), fault
  assert 'never heard from: process(es) 1, while process(es) 0 gave up waiting for them to join' in fault.detail
  # Past the join, an exit is the process's own.
  att.monitor.procs[0].phase = 'startup:compile'
  assert d._exit_fault(att, {0: 1}).processes == [0]
  d.server.close()


def test_a_trainer_whose_peer_left_says_so_in_one_paragraph(tmp_path, monkeypatch, capsys):
  """A process killed mid-step: the survivor's all-reduce fails on the
  closed connection. It printed jax's forty-line traceback, which read as
  its own crash; it says in one paragraph that a peer left, exits 1 (the
  driver restarts the job) and records the fact that names the peer."""
  from mjax import cli, trainer
  gloo = ('UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:547] '
          'Connection closed by peer [127.0.0.1]:27032')

  def run(*args):
    raise jax.errors.JaxRuntimeError(gloo)
  monkeypatch.setattr(trainer, 'run', run)
  monkeypatch.setattr(cli, '_early_heartbeat', lambda args, bindings: (None, None))
  monkeypatch.setenv(protocol.DRIVER_ADDRESS_ENV, '127.0.0.1:1')   # as the driver launches its trainers
  monkeypatch.setenv(protocol.ATTEMPT_ENV, '0')
  with pytest.raises(SystemExit) as e:
    cli.train_main(['--gin_file', 'configs/tiny.gin', '--workdir', str(tmp_path / 'run')])
  assert e.value.code == protocol.EXIT_FAILED
  err = capsys.readouterr().err
  assert 'Traceback' not in err, err
  assert err.startswith('mjax-train: error: a collective failed because another process of the job left first '
                        f'({gloo})') and err.count('\n') == 1, err
  assert gloo in (protocol.Facts(str(tmp_path / 'run'), 0).get(protocol.PEER_LOST) or '')


def test_a_stop_signal_to_a_trainer_in_start_up_is_a_stop_not_a_crash(tmp_path, monkeypatch):
  """SIGTERM to one trainer (not to the driver) while it compiles: it exits
  143, nothing to save yet. The driver took that for a crash and diagnosed
  every host; it is a stop, as one in the loop (fault 'signalled')."""
  from mjax import distributed
  d = make_driver(tmp_path)
  try:
    att = fake_attempt(d, ['slot0', 'slot1'])
    monkeypatch.setenv(protocol.ATTEMPT_ENV, str(att.number))
    monkeypatch.setenv(protocol.DRIVER_RUN_ENV, d.run_id)
    fault = d._exit_fault(att, {0: protocol.EXIT_TERMINATED})
    assert (fault.kind, fault.processes) == ('signalled', [0]), fault
    assert fault.detail.startswith('SIGTERM to process(es) 0 (not to the driver), which stopped in start-up'), fault
    assert d._exit_fault(att, {1: protocol.EXIT_INTERRUPTED}).detail.startswith('SIGINT to process(es) 1')
    # A crash beside it is a crash.
    for other in (-9, 1):
      assert d._exit_fault(att, {0: protocol.EXIT_TERMINATED, 1: other}).kind == 'exit'
    # Its peer's collective failed after it left (its fact says so): a stop.
    gloo = 'UNKNOWN: Gloo all-reduce failed: Read error [127.0.0.1]:61107: Connection reset by peer'
    assert distributed.peer_gone(RuntimeError(gloo))
    protocol.Facts(str(tmp_path), 1).record(protocol.PEER_LOST, gloo)
    fault = d._exit_fault(att, {0: protocol.EXIT_TERMINATED, 1: 1})
    assert (fault.kind, fault.processes) == ('signalled', [0]), fault
  finally:
    d.server.close()


def test_a_process_jax_aborted_because_the_coordinator_died_is_not_blamed(tmp_path, monkeypatch):
  """Process 0, the coordination service's host, killed: jax's client aborts
  process 1 in C++ (SIGABRT) before it can record anything, and says why
  in its log. Both were blamed (when the driver polled after the abort):
  no healthy host for the link check, every host diagnosed. Only this
  attempt's part of the log counts."""
  d = make_driver(tmp_path)
  try:
    att = fake_attempt(d, ['slot0', 'slot1'])
    monkeypatch.setenv(protocol.ATTEMPT_ENV, str(att.number))
    monkeypatch.setenv(protocol.DRIVER_RUN_ENV, d.run_id)
    for i in (0, 1):
      att.logs[i] = (str(tmp_path / f'process-{i}.log'), 0)
      open(att.logs[i][0], 'w').write('=== attempt ===\n')
    abort = ('F1128 12:08:30.479367 25100 client.h:80] Terminating process because the JAX distributed service '
             'detected fatal errors. This most likely indicates that another task died\n')
    open(att.logs[1][0], 'a').write(abort)
    fault = d._exit_fault(att, {0: -9, 1: -6})
    assert fault.processes == [0] and fault.extra['peers_left_after'] == [1], fault
    assert d._exit_fault(att, {0: -9, 1: 1}).processes == [0, 1]       # not aborted by jax: its own exit
    open(att.logs[0][0], 'a').write(abort)
    assert d._exit_fault(att, {0: -6, 1: -6}).processes == [0, 1]      # all of them: nothing to tell apart
    att.logs[1] = (att.logs[1][0], os.path.getsize(att.logs[1][0]))   # the line is an older attempt's
    assert d._exit_fault(att, {0: -9, 1: -6}).processes == [0, 1]
  finally:
    d.server.close()


def test_a_loss_spike_rolls_back_to_a_step_saved_before_it_began(tmp_path):
  # Saves at 6, 8 and 10; the spike ran from step 9 to 11. Step 10 is finite
  # but spiked, and step 9's loss was taken on the state saved as 8: the next
  # attempt resumes below 8, from 6, skipping to 12.
  d = make_driver(tmp_path)
  att = fake_attempt(d, ['slot0', 'slot1'])
  for step in (6, 8, 10):
    os.makedirs(tmp_path / 'checkpoints' / str(step) / 'state')
  d._rollback(att, detect.Fault('loss_spike', [0], step=11, extra={'first_step': 9}))
  assert d.restore_below == 8 and d.skip == (6, 5)
  e = events(tmp_path, 'rollback')[-1]
  assert (e['checkpoint_step'], e['restore_below'], e['skip_data_steps']) == (6, 8, 5)
  # Nothing saved before the spike: the newest step, as before, never a start over.
  d.restore_below, d.skip = None, None
  d._rollback(att, detect.Fault('loss_spike', [0], step=7, extra={'first_step': 6}))
  assert d.restore_below is None and d.skip == (10, 0)
  # A NaN rolls back to the newest step, as before: every saved step is finite.
  d._rollback(att, detect.Fault('nonfinite_loss', [0], step=12))
  assert d.restore_below is None and d.skip == (10, 2)
  d.server.close()


FAKE_TRAINER = """
import os, signal, sys, time
from mjax.config import FaultConfig
from mjax.ft.heartbeat import HeartbeatClient

class Timer:
  current, step = 'compute', 0

mode, attempt = os.environ['FAKE_MODE'], int(os.environ['MJAX_ATTEMPT'])
if mode.startswith('exit') or (mode == 'crash_once' and attempt == 0):
  sys.exit(int(mode[4:] or 1))
if mode == 'stuck_in_start_up_once' and attempt == 0:   # heartbeats, but never gets to a step
  Timer.current = 'startup:restore'
client = HeartbeatClient.from_env(Timer, FaultConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=1),
                                  int(os.environ['MJAX_PROCESS_ID']))
if mode == 'startup_143':                # SIGTERM in its start-up (a compile): status 143, no step run
  Timer.current = 'startup:compile'
  signal.signal(signal.SIGTERM, lambda *a: (client.close(), sys.exit(143)))
  while True:
    time.sleep(0.05)
while Timer.current == 'startup:restore':
  time.sleep(0.05)
if mode == 'long':                       # trains until pre-empted, then exits cleanly
  signal.signal(signal.SIGTERM, lambda *a: (client.close(), sys.exit(0)))
if mode == 'saving_stop':                # its stop save takes a second, then a clean exit
  signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.0), client.close(), sys.exit(0)))
  mode = 'long'
if mode == 'slow_stop':                  # its stop save takes for ever
  signal.signal(signal.SIGTERM, lambda *a: None)
  mode = 'long'
for step in range(1, 4):
  Timer.step = step
  client.report_step(step, 1.0, 0.01)
  time.sleep(0.15)
if mode == 'wedge' and attempt == 0 and os.environ['MJAX_PROCESS_ID'] == '1':
  os.kill(os.getpid(), signal.SIGSTOP)   # alive, but silent: no heartbeats
if mode == 'host_fault_once' and attempt == 0:   # every process finds process 2's host at fault
  from mjax import protocol
  workdir = sys.argv[sys.argv.index('--workdir') + 1]
  protocol.Facts(workdir, int(os.environ['MJAX_PROCESS_ID'])).record(
      protocol.HOST_FAULT, {'processes': [2], 'what': 'cannot be written in process(es) [2] of 3'})
  sys.exit(1)
if mode == 'crash_at_3':                 # the same step every attempt: a deterministic crash
  time.sleep(0.3)
  sys.exit(1)
if mode == 'orphanable':                 # trains 6 s; stops as a trainer does once its driver is gone
  for step in range(4, 64):
    if client.driver_lost():
      sys.exit(4)                        # protocol.EXIT_DRIVER_LOST
    Timer.step = step
    client.report_step(step, 1.0, 0.01)
    time.sleep(0.1)
while mode == 'long':
  Timer.step += 1
  client.report_step(Timer.step, 1.0, 0.01)
  time.sleep(0.05)
client.close()
"""
QUICK = ['--gin.FaultConfig.heartbeat_interval_s=0.1', '--gin.FaultConfig.heartbeat_timeout_s=1',
         '--gin.FaultConfig.progress_timeout_s=3', '--gin.FaultConfig.collective_timeout_s=30',
         '--gin.FaultConfig.restart_backoff_s=0.05', '--gin.FaultConfig.max_restarts=2']


def fake_driver(tmp_path, monkeypatch, mode, processes=1, train=QUICK):
  """The driver, in this process, over a stand-in trainer (no JAX) in `mode`."""
  monkeypatch.setenv('FAKE_MODE', mode)
  monkeypatch.delenv('MJAX_FAULT', raising=False)
  monkeypatch.setattr(FakeExecutor, 'failing', {})
  d = make_driver(tmp_path, '--processes', str(processes), '--grace_s', '1', train=train)
  d.trainer = [sys.executable, '-c', FAKE_TRAINER]
  return d


def fake_run(tmp_path, monkeypatch, mode, processes=1):
  """fake_driver's run: its exit status."""
  return fake_driver(tmp_path, monkeypatch, mode, processes).run()


def test_a_process_stuck_in_start_up_is_named_with_its_part_and_its_stacks(tmp_path, monkeypatch):
  # A restore that never returns: the process heartbeats (start-up phases),
  # so the start-up timeout names the part it was in and asks for its stacks.
  d = fake_driver(tmp_path, monkeypatch, 'stuck_in_start_up_once',
                  train=[*QUICK, '--gin.FaultConfig.collective_timeout_s=5'])
  assert d.run() == driver.EXIT_OK
  (fault,) = events(tmp_path, 'fault')
  assert fault['kind'] == 'startup_timeout' and fault['phases'] == {'0': 'startup:restore'}, fault
  assert 'process(es) 0 (startup:restore)' in fault['detail'], fault
  (dump,) = events(tmp_path, 'stack_dump')
  assert dump['phase'] == 'startup:restore', dump
  assert any('<string>' in f for t in dump['threads'] for f in t['frames']), dump
  assert events(tmp_path, 'finish')


def _driver_held_up_once(tmp_path, monkeypatch, seconds, train, whole=False):
  """A driver over fake trainers whose loop is held up `seconds` once, in
  the write of its 'running' event (as by a stalled mount under workdir);
  `whole`: its heartbeat server's thread as well (the process stopped)."""
  monkeypatch.setenv('FAKE_MODE', 'orphanable')
  monkeypatch.delenv('MJAX_FAULT', raising=False)
  monkeypatch.setattr(FakeExecutor, 'failing', {})
  d = make_driver(tmp_path, '--processes', '2', '--grace_s', '1', train=train)
  d.trainer = [sys.executable, '-c', FAKE_TRAINER]
  emit, held, hold = d.events.emit, [], threading.Event()

  def slow_emit(event, **fields):
    if event == 'running' and not held:
      held.append(event)
      hold.set()
      time.sleep(seconds)
      hold.clear()
    return emit(event, **fields)

  read = d.server._read

  def held_read():
    if whole and hold.is_set():
      while hold.is_set():
        time.sleep(0.01)
    return read()

  d.events.emit, d.server._read = slow_emit, held_read
  return d.run()


def test_a_driver_held_up_by_its_storage_keeps_its_trainers(tmp_path, monkeypatch):
  # Held up 2.5 s, past the trainers' 1 s heartbeat timeout: the heartbeat
  # server's thread acknowledged them meanwhile, so nobody stopped.
  assert _driver_held_up_once(tmp_path, monkeypatch, 2.5, QUICK) == driver.EXIT_OK
  assert len(events(tmp_path, 'launch')) == 1 and not events(tmp_path, 'fault'), events(tmp_path, 'fault')
  (stall,) = events(tmp_path, 'driver_stalled')
  assert stall['seconds'] >= 2.5 and stall['trainers_kept'] and 'kept acknowledging' in stall['detail'], stall
  assert not stall['process_held']
  assert events(tmp_path, 'finish')


def test_a_driver_process_held_whole_says_that_its_trainers_were_let_go(tmp_path, monkeypatch):
  # A SIGSTOP (Ctrl-Z) or a frozen container holds the heartbeat server's
  # thread with the loop: nothing acknowledges the trainers, and they stop
  # by themselves (exit status 4) a heartbeat timeout later. The event said
  # they were kept, judging by the loop's hold alone (under
  # collective_timeout_s).
  assert _driver_held_up_once(tmp_path, monkeypatch, 2.5, QUICK, whole=True) == driver.EXIT_OK
  (stall,) = events(tmp_path, 'driver_stalled')
  assert stall['process_held'] and not stall['trainers_kept'], stall
  assert 'the whole driver process was held' in stall['detail'] and 'SIGSTOP' in stall['detail'], stall
  (fault,) = events(tmp_path, 'fault')
  assert set(fault['exit'].values()) == {'status 4'}, fault
  # The driver's own hold-up: no host diagnosed, no link checked (every
  # host was diagnosed and the link check found no healthy one to pair).
  assert fault['kind'] == 'driver_held', fault
  assert not events(tmp_path, 'diagnosis') and not events(tmp_path, 'link_check')
  assert len(events(tmp_path, 'launch')) == 2 and events(tmp_path, 'finish')


def test_a_driver_loop_stuck_past_the_collective_timeout_lets_its_trainers_go(tmp_path, monkeypatch):
  # Held up 4 s with collective_timeout_s = 2.5: acknowledgements stop
  # 2.5 s after the loop last watched, the trainers stop a heartbeat
  # timeout later (exit status 4), and the loop, back, restarts them.
  train = [*QUICK, '--gin.FaultConfig.progress_timeout_s=2', '--gin.FaultConfig.collective_timeout_s=2.5']
  assert _driver_held_up_once(tmp_path, monkeypatch, 4.0, train) == driver.EXIT_OK
  (fault,) = events(tmp_path, 'fault')
  assert fault['kind'] == 'driver_held' and 'heard nothing from the driver' in fault['detail'], fault
  assert set(fault['exit'].values()) == {'status 4'}, fault
  (stall,) = events(tmp_path, 'driver_stalled')
  assert not stall['trainers_kept'] and 'stopped acknowledging' in stall['detail'], stall
  assert len(events(tmp_path, 'launch')) == 2 and events(tmp_path, 'finish')


def test_bad_input_is_not_retried(tmp_path, monkeypatch):
  monkeypatch.setattr(FakeExecutor, 'failing', {})
  assert fake_run(tmp_path, monkeypatch, 'exit2') == driver.EXIT_BAD_INPUT
  assert len(events(tmp_path, 'launch')) == 1 and events(tmp_path, 'fault')[0]['kind'] == 'bad_input'
  assert 'bad input' in events(tmp_path, 'giveup')[0]['reason']


def test_gives_up_after_max_restarts_in_a_row(tmp_path, monkeypatch):
  monkeypatch.setattr(FakeExecutor, 'failing', {})
  assert fake_run(tmp_path, monkeypatch, 'exit1') == driver.EXIT_GAVE_UP
  restarts = events(tmp_path, 'restart')
  assert [r['in_a_row'] for r in restarts] == [1, 2]
  assert [r['backoff_s'] for r in restarts] == [0.05, 0.1]      # doubling
  assert 'max_restarts = 2' in events(tmp_path, 'giveup')[0]['reason']


def test_catching_up_without_a_newer_checkpoint_is_no_recovery(tmp_path, monkeypatch):
  # Every attempt reaches step 3 (the step reached before the fault) and
  # dies there: caught up each time, but nothing saved beyond where it
  # started, so the restarts stay "in a row" and max_restarts ends it.
  monkeypatch.setattr(FakeExecutor, 'failing', {})
  assert fake_run(tmp_path, monkeypatch, 'crash_at_3') == driver.EXIT_GAVE_UP
  assert events(tmp_path, 'caught_up')
  assert [r['in_a_row'] for r in events(tmp_path, 'restart')] == [1, 2]
  assert 'max_restarts = 2' in events(tmp_path, 'giveup')[0]['reason']


def test_progress_counts_checkpoints_only_where_the_driver_sees_them(tmp_path):
  # Without checkpoints, or with a fast tier in the hosts' own memory, a
  # restart's progress is invisible on disk: catching up is all there is.
  cases = [([], True), (['--gin.CheckpointConfig.enabled=False'], False),
           (['--gin.CheckpointConfig.fast_every=10'], True),
           (['--gin.CheckpointConfig.fast_every=10', "--gin.CheckpointConfig.fast_scope='host'"], False)]
  for train, visible in cases:
    d = make_driver(tmp_path, train=train)
    assert d._progress_visible() == visible, train
    d.server.close()


def test_no_host_left_names_the_block_list(tmp_path, monkeypatch):
  monkeypatch.setattr(FakeExecutor, 'failing', {})
  d = make_driver(tmp_path)
  d.health.block('slot0', 'test')
  d.health.block('slot1', 'test')
  assert d.run() == driver.EXIT_GAVE_UP
  reason = events(tmp_path, 'giveup')[0]['reason']
  assert 'slot0, slot1 blocked in' in reason and 'blocked_hosts.json' in reason and 'repaired' in reason


def test_silent_process_is_lost_and_restarted(tmp_path, monkeypatch):
  monkeypatch.setattr(FakeExecutor, 'failing', {})
  assert fake_run(tmp_path, monkeypatch, 'wedge', processes=2) == driver.EXIT_OK
  fault = events(tmp_path, 'fault')[0]
  assert fault['kind'] == 'heartbeat_lost' and fault['processes'] == [1] and fault['hosts'] == ['slot1']
  assert events(tmp_path, 'stopped')[0]['killed'] == [1]         # SIGTERM cannot stop a stopped process
  assert [e['attempt'] for e in events(tmp_path, 'launch')] == [0, 1] and events(tmp_path, 'finish')


def test_spare_replaces_blocked_host_for_good(tmp_path, monkeypatch):
  monkeypatch.setattr(FakeExecutor, 'failing', {'a1': 'memory'})
  monkeypatch.setenv('FAKE_MODE', 'crash_once')
  d = make_driver(tmp_path, '--hosts', 'a0,a1', '--spares', 's0', train=QUICK)
  d.trainer = [sys.executable, '-c', FAKE_TRAINER]
  assert d.run() == driver.EXIT_OK
  assert [e['hosts'] for e in events(tmp_path, 'launch')] == [['a0', 'a1'], ['a0', 's0']]
  assert events(tmp_path, 'launch')[1]['bindings'] == []          # same size: no elastic change
  # A new driver on this workdir never uses a1 again.
  monkeypatch.setattr(FakeExecutor, 'failing', {})
  monkeypatch.setenv('FAKE_MODE', 'ok')
  d = make_driver(tmp_path, '--hosts', 'a0,a1', '--spares', 's0', train=QUICK)
  d.trainer = [sys.executable, '-c', FAKE_TRAINER]
  assert d.run() == driver.EXIT_OK
  assert events(tmp_path, 'start')[-1]['blocked'] == ['a1']
  assert events(tmp_path, 'launch')[-1]['hosts'] == ['a0', 's0']


def test_a_host_fault_the_trainers_found_blocks_that_host_and_a_spare_takes_its_place(tmp_path, monkeypatch):
  monkeypatch.setattr(FakeExecutor, 'failing', {})   # mjax-diagnose finds nothing: the trainers did
  monkeypatch.setenv('FAKE_MODE', 'host_fault_once')
  d = make_driver(tmp_path, '--processes', '3', '--hosts', 'a0,a1,a2', '--spares', 's0', '--grace_s', '1',
                  train=QUICK)
  d.trainer = [sys.executable, '-c', FAKE_TRAINER]
  assert d.run() == driver.EXIT_OK
  fault = events(tmp_path, 'fault')[0]
  assert fault['kind'] == 'host_fault' and fault['processes'] == [2], fault
  assert [e['host'] for e in events(tmp_path, 'host_blocked')] == ['a2']
  assert [e['hosts'] for e in events(tmp_path, 'launch')] == [['a0', 'a1', 'a2'], ['a0', 'a1', 's0']]


def test_sigterm_to_the_driver_preempts_the_job(tmp_path, monkeypatch):
  import threading

  def preempt():
    while not events(tmp_path, 'running'):
      time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)    # caught by the driver, passed on

  threading.Thread(target=preempt, daemon=True).start()
  assert fake_run(tmp_path, monkeypatch, 'long', processes=2) == driver.EXIT_OK
  (ev,) = events(tmp_path, 'preempted')
  assert ev['exit'] == {'0': 'status 0', '1': 'status 0'} and not events(tmp_path, 'fault')


def test_a_preemption_in_the_trainers_start_up_is_clean(tmp_path, monkeypatch):
  # SIGTERM taken outside the loop (start-up, a compile) is the trainers'
  # clean stop, status 143: it exited 1, the "gave up" status, with a detail
  # that said not every process had stopped cleanly.
  import threading

  def preempt():
    while not events(tmp_path, 'running'):
      time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)
  threading.Thread(target=preempt, daemon=True).start()
  d = fake_driver(tmp_path, monkeypatch, 'startup_143', processes=2)
  assert d.run() == d.opts.preempt_exit_status
  (ev,) = events(tmp_path, 'preempted')
  assert ev['exit'] == {'0': 'status 143 (SIGTERM)', '1': 'status 143 (SIGTERM)'} and 'detail' not in ev, ev


def _signal_twice_once_running(tmp_path, sig: int, gap_s: float) -> None:
  """This process (the driver's) sent `sig` twice, `gap_s` apart, once the job runs."""
  import threading

  def twice():
    while not events(tmp_path, 'running'):
      time.sleep(0.05)
    time.sleep(0.5)
    os.kill(os.getpid(), sig)
    time.sleep(gap_s)
    os.kill(os.getpid(), sig)
  threading.Thread(target=twice, daemon=True).start()


def test_a_second_signal_cuts_the_preemption_and_is_said(tmp_path, monkeypatch):
  # Ctrl-C twice: the trainers were killed before their stop save, and the
  # driver exited 1, as when it gives up after restarts, without a word.
  _signal_twice_once_running(tmp_path, signal.SIGINT, 0.5)
  assert fake_run(tmp_path, monkeypatch, 'slow_stop', processes=2) == protocol.EXIT_INTERRUPTED
  (ev,) = events(tmp_path, 'preempted')
  assert 'a second signal cut the wait' in ev['detail'] and 'resumes from the newest checkpoint' in ev['detail'], ev


def test_one_sigterm_delivered_twice_is_one_stop(tmp_path, monkeypatch):
  # scancel signals every process of the batch step, the driver among them,
  # and launch/slurm_ft.sbatch's trap passes the shell's SIGTERM on: the
  # driver counted two signals and killed the trainers before their stop save.
  _signal_twice_once_running(tmp_path, signal.SIGTERM, 0.05)
  d = fake_driver(tmp_path, monkeypatch, 'saving_stop', processes=2)
  assert d.run() == d.opts.preempt_exit_status
  (ev,) = events(tmp_path, 'preempted')
  assert ev['exit'] == {'0': 'status 0', '1': 'status 0'} and 'detail' not in ev, ev


def test_sigterm_to_the_whole_process_group_ends_the_driver(tmp_path):
  """What scancel and timeout send: SIGTERM to the driver, its trainers and
  its straggler analysis at once. The driver pre-empts the job and exits;
  before, it hung for good stopping the analysis child it had just lost."""
  (tmp_path / 'trainer.py').write_text(FAKE_TRAINER)
  workdir = tmp_path / 'run'
  script = ('import sys\nfrom mjax.ft import driver\n'
            f'opts = driver.parse_args(["--processes", "1", "--workdir", {str(workdir)!r}, "--quiet", '
            f'"--grace_s", "1", "--", *{QUICK!r}])\n'
            'd = driver.Driver(opts)\n'
            f'd.trainer = [sys.executable, {str(tmp_path / "trainer.py")!r}]\n'
            'sys.exit(d.run())\n')
  proc = subprocess.Popen([sys.executable, '-c', script], env=child_env(FAKE_MODE='long'), start_new_session=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    wait_event(workdir, 'running', proc, timeout=120)
    time.sleep(3)   # the analysis child is up, waiting for its next round (every 5 s)
    os.killpg(proc.pid, signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.communicate()
  assert proc.returncode == driver.EXIT_OK, out[-3000:]
  assert len(events(workdir, 'preempted')) == 1 and 'Traceback' not in out, out[-3000:]


# --- the real driver ----------------------------------------------------------------

def launch_cmd(workdir, processes, *extra, train=()):
  exe = os.path.join(os.path.dirname(sys.executable), 'mjax-launch')
  return [exe, '--processes', str(processes), '--workdir', str(workdir), *LAUNCH, *extra, '--', *TRAIN, *train]


def child_env(**kw):
  env = {k: v for k, v in os.environ.items() if k not in ('MJAX_FAULT', 'XLA_FLAGS')}
  env.update(kw)
  return env


def events(workdir, kind=None):
  evs = events_lib.read(os.path.join(workdir, 'events.jsonl'))
  return [e for e in evs if kind is None or e['event'] == kind]


def wait_event(workdir, kind, proc, timeout=300):
  t0 = time.time()
  while True:
    found = events(workdir, kind)
    if found:
      return found
    assert proc.poll() is None, f'driver exited {proc.returncode} before a {kind!r} event: {events(workdir)}'
    assert time.time() - t0 < timeout, f'no {kind!r} event after {timeout}s'
    time.sleep(0.05)


def final_state(workdir):
  """The saved train state of step N as numpy: saved by two processes, so it
  is read without their device topology."""
  path = os.path.join(workdir, 'checkpoints', str(N), 'state')
  ck = ocp.PyTreeCheckpointer()
  tree = ck.metadata(path).item_metadata.tree
  return ck.restore(path, restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))


def losses(workdir):
  rows = read_metrics(workdir)
  return {r['step']: r['loss'] for r in rows if 'loss' in r}


def data_position(workdir, step):
  with open(os.path.join(workdir, 'checkpoints', str(step), 'data', 'metadata')) as fh:
    return json.load(fh)['next_index']


def assert_bitwise(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb) > 0
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def run_reference(workdir, repo_root):
  """An uninterrupted 2-process run; forged heartbeats are sent to it
  meanwhile. Shared by every test that compares a recovered run with it
  (conftest's `ft_reference`), under the driver's local executor or agents."""
  env = child_env()
  env.pop(protocol.SECRET_ENV, None)    # the driver's own, so that the forgery below is one
  proc = subprocess.Popen(launch_cmd(workdir, 2), cwd=repo_root, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  start = wait_event(workdir, 'start', proc)[0]
  host, port = hb.parse_address(start['heartbeat_address'])
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.sendto(b'\x00garbage', (host, port))
    s.sendto(hb.sign(payload(process=0, step=10 ** 6), 'cd' * 32), (host, port))  # wrong secret
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-3000:]
  return workdir


@pytest.fixture(scope='module')
def reference(ft_reference):
  return ft_reference


@pytest.mark.slow
def test_forged_heartbeats_are_rejected_and_logged(reference):
  reasons = [e['reason'] for e in events(reference, 'heartbeat_rejected')]
  assert any(r.startswith('malformed') for r in reasons), reasons
  assert any(r.startswith('bad signature') for r in reasons), reasons
  assert events(reference, 'finish') and not events(reference, 'fault')


def alive(pid):
  """Whether `pid` runs (a zombie nobody reaps yet counts as gone)."""
  try:
    with open(f'/proc/{pid}/stat') as fh:
      return fh.read().rsplit(')', 1)[1].split()[0] != 'Z'
  except (OSError, IndexError):
    return False


def newest_step(workdir):
  d = os.path.join(workdir, 'checkpoints')
  return max((int(n) for n in os.listdir(d) if n.isdigit()), default=0) if os.path.isdir(d) else 0


@pytest.mark.slow
def test_hang_names_silent_process_then_failing_host_is_blocked(tmp_path, repo_root):
  """Process 1 hangs at step 7; its host then fails a diagnostic, so the job
  continues on one process, accumulating gradients to keep the batch."""
  cmd = launch_cmd(tmp_path, 2, '--host_env', 'slot1:MJAX_DIAGNOSE_FAIL=memory')
  env = child_env(MJAX_FAULT='hang:step=7:process=1')
  t0 = time.time()
  proc = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  fault = events(tmp_path, 'fault')[0]
  assert fault['kind'] == 'hang' and fault['processes'] == [1] and fault['hosts'] == ['slot1'], fault
  stalled_s = max(s['stalled_s'] for s in fault['stalled'].values())
  # Named once progress_timeout_s had passed, well before the collectives time out.
  assert 8.0 <= stalled_s <= 8.0 + 3.0
  dumps = {e['process']: e for e in events(tmp_path, 'stack_dump')}
  assert 'inject.py' in dumps[1]['threads'][0]['where']            # what the silent one was doing
  assert 'trainer.py' in dumps[0]['threads'][0]['where']
  diag = {e['host']: e['passed'] for e in events(tmp_path, 'diagnosis')}
  assert diag == {'slot0': True, 'slot1': False}
  assert [e['host'] for e in events(tmp_path, 'host_blocked')] == ['slot1']
  blocked = json.load(open(os.path.join(tmp_path, 'blocked_hosts.json')))
  assert [b['host'] for b in blocked] == ['slot1'] and 'memory' in blocked[0]['reason']
  relaunch = events(tmp_path, 'launch')[1]
  assert relaunch['hosts'] == ['slot0'] and relaunch['bindings'] == ['TrainConfig.grad_accum_steps = 2']
  assert events(tmp_path, 'finish')[0]['step'] == N
  assert all(e['time'] >= t0 for e in events(tmp_path))


@pytest.mark.slow
def test_a_long_evaluation_and_a_long_last_save_are_not_hangs(tmp_path, repo_root):
  """An evaluation that compiles and a last save to slow storage each stay
  longer in their phase than progress_timeout_s (here 4 s): under the driver
  the run still ends at its first attempt."""
  stalls = 'stall:phase=eval:step=6:seconds=6;stall:phase=checkpoint:step=12:seconds=6'
  train = ['--gin.TrainConfig.eval_every=6', '--gin.FaultConfig.progress_timeout_s=4']
  proc = subprocess.run(launch_cmd(tmp_path, 1, train=train), cwd=repo_root,
                        env=child_env(MJAX_FAULT=stalls), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert events(tmp_path, 'fault') == [] and len(events(tmp_path, 'launch')) == 1, events(tmp_path, 'fault')
  assert events(tmp_path, 'finish')[0]['step'] == N
  assert [r['step'] for r in read_metrics(tmp_path) if 'eval_loss' in r] == [6, N]
  # The driver again on the finished run: nothing to train, and the step it
  # finished at said (no step runs to say it: it was null).
  again = subprocess.run(launch_cmd(tmp_path, 1), cwd=repo_root, env=child_env(), capture_output=True, text=True,
                         timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  assert [e['step'] for e in events(tmp_path, 'finish')] == [N, N]


@pytest.mark.slow
def test_a_host_that_cannot_write_its_checkpoints_is_replaced_by_a_spare(tmp_path, repo_root):
  """Each host keeps its fast-tier copies in a directory named after it; on
  a2 that path is a file (a mount gone wrong). The trainers find it before
  compiling, name process 2, and the job goes on with the spare in its place
  where it used to end as bad input (exit 2, no restart)."""
  (tmp_path / 'fast-a2').write_text('not a directory')
  train = ['--gin.TrainConfig.steps=3', '--gin.TrainConfig.global_batch_size=12',
           '--gin.CheckpointConfig.fast_every=3', "--gin.CheckpointConfig.fast_scope='host'",
           f"--gin.CheckpointConfig.fast_directory='{tmp_path}/fast-$MJAX_HOST'"]
  cmd = launch_cmd(tmp_path / 'run', 3, '--hosts', 'a0,a1,a2', '--spares', 's0', train=train)
  proc = subprocess.run(cmd, cwd=repo_root, env=child_env(), capture_output=True, text=True, timeout=600)
  run = tmp_path / 'run'
  assert proc.returncode == 0, (proc.stderr[-3000:], events(run))
  fault = events(run, 'fault')[0]
  assert fault['kind'] == 'host_fault' and fault['processes'] == [2], fault
  assert "cannot be written in process(es) [2] of 3" in fault['detail'], fault['detail']
  assert [e['host'] for e in events(run, 'host_blocked')] == ['a2']
  assert [e['hosts'] for e in events(run, 'launch')] == [['a0', 'a1', 'a2'], ['a0', 'a1', 's0']]
  assert events(run, 'finish')[0]['step'] == 3


@pytest.mark.slow
def test_nan_rolls_back_and_skips_the_bad_batches(tmp_path, repo_root):
  cmd = launch_cmd(tmp_path, 1)
  proc = subprocess.run(cmd, cwd=repo_root, env=child_env(MJAX_FAULT='nan:step=8'), capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  fault = events(tmp_path, 'fault')[0]
  assert fault['kind'] == 'nonfinite_loss' and fault['step'] == 8, fault
  rb = events(tmp_path, 'rollback')[0]
  assert rb['bad_step'] == 8 and rb['checkpoint_step'] in (3, 6)
  assert rb['skip_data_steps'] == 8 - rb['checkpoint_step']
  assert events(tmp_path, 'launch')[1]['skip_data_steps'] == rb['skip_data_steps']
  assert events(tmp_path, 'finish')
  # The data went past the skipped batches: position = steps + skipped.
  assert data_position(tmp_path, N) == N + rb['skip_data_steps']


@pytest.mark.slow
def test_sigterm_to_one_trainer_alone_resumes_the_job_to_its_last_step(tmp_path, repo_root):
  """A node's own pre-emption (or an scancel of one step): SIGTERM to one
  trainer, not to the driver. Every trainer stops after the same step,
  saves and exits 0, which said "finished" before: the job ended as a
  success short of its last step. It is restarted from that save, with no
  host diagnosed, and trains to the end."""
  cmd = launch_cmd(tmp_path, 2)
  proc = subprocess.run(cmd, cwd=repo_root, env=child_env(MJAX_FAULT='term:step=5:process=1'), capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (fault,) = events(tmp_path, 'fault')
  assert fault['kind'] == 'signalled' and fault['processes'] == [1], fault
  assert 'SIGTERM to process(es) 1 (not to the driver)' in fault['detail'] and fault['step'] >= 4, fault
  assert not events(tmp_path, 'diagnosis') and len(events(tmp_path, 'launch')) == 2
  (finish,) = events(tmp_path, 'finish')
  assert finish['step'] == N and finish['restarts'] == 1, finish
  assert [r['step'] for r in read_metrics(str(tmp_path)) if 'loss' in r] == list(range(1, N + 1))


@pytest.mark.slow
def test_a_loss_spike_stops_the_job_without_saving_its_spiked_state(tmp_path, repo_root):
  """Losses 20x from step 14 (first attempt): the driver stops the job
  without a save. Before, the trainers saved the spiked state on their way
  out, and with keep = 2 that save deleted step 12, the last one from before
  the spike: the rollback found none and resumed the spiked state."""
  steps = 24
  train = [f'--gin.TrainConfig.steps={steps}', f'--gin.OptimConfig.decay_steps={steps}',
           '--gin.CheckpointConfig.save_every=4', '--gin.CheckpointConfig.keep=2',
           '--gin.FaultConfig.loss_spike_count=3']
  cmd = launch_cmd(tmp_path, 1, train=train)
  proc = subprocess.run(cmd, cwd=repo_root, env=child_env(MJAX_FAULT='spike:step=14:factor=20;delay:seconds=0.4'),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, (proc.stderr[-3000:], events(tmp_path))
  fault = events(tmp_path, 'fault')[0]
  assert fault['kind'] == 'loss_spike', fault
  stopped = events(tmp_path, 'stopped')[0]
  assert stopped['why'] == 'loss_spike' and stopped['killed'] == [0], stopped
  rb = events(tmp_path, 'rollback')[0]
  assert rb['restore_below'] == 13 and rb['checkpoint_step'] == 12, rb
  assert events(tmp_path, 'launch')[1]['skip_data_steps'] == rb['skip_data_steps']
  assert events(tmp_path, 'finish')[0]['step'] == steps


def _hostile_datagrams(rng: random.Random, n: int):
  """Random bytes, mangled envelopes and payloads, and the shapes that once
  escaped the verifier (lone surrogate, non-ASCII mac, deep nesting)."""
  good = hb.sign({'ts': time.time(), 'nonce': 'n0', 'process': 0}, SECRET)
  fixed = [
      json.dumps({'payload': '\ud800', 'mac': '0' * 64}).encode(),           # lone surrogate
      json.dumps({'payload': '{}', 'mac': '\u00e9' * 64}).encode(),          # non-ASCII mac
      b'[' * 16000 + b']' * 16000,                                          # deep nesting
      b'{"payload":' + b'[' * 8000 + b']' * 8000 + b',"mac":"00"}',
      json.dumps({'payload': '{}', 'mac': 'zz'}).encode(),
      json.dumps({'payload': 1, 'mac': None}).encode(), b'', b'null', b'[]', b'"x"', b'1e999',
      json.dumps({'payload': json.dumps({'ts': 'nan', 'nonce': 1, 'process': 0}), 'mac': '0' * 64}).encode(),
  ]
  for d in fixed:
    yield d
  pieces = [b'{', b'}', b'[', b']', b'"', b'\\', b'payload', b'mac', b':', b',', b'\\ud800', b'\xff',
            b'1e400', b'-0', b'null', b'true', 'é'.encode(), b'\x00']
  for i in range(n - len(fixed)):
    k = i % 4
    if k == 0:
      yield bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
    elif k == 1:
      yield b''.join(rng.choice(pieces) for _ in range(rng.randint(1, 40)))
    elif k == 2:  # a real datagram with bytes flipped, cut or repeated
      d = bytearray(good)
      for _ in range(rng.randint(1, 4)):
        d[rng.randrange(len(d))] = rng.getrandbits(8)
      out = bytes(d[:rng.randint(0, len(d))]) if rng.random() < 0.3 else bytes(d)
      yield out if out != good else out[:-1]  # a flip back to the original is no attack
    else:  # well-formed envelopes with hostile fields
      payload = rng.choice(['{}', '[]', '"s"', '{"ts":1}', '\ud800x', '[' * 200 + ']' * 200,
                            json.dumps({'ts': rng.random(), 'nonce': [], 'process': {}})])
      mac = rng.choice(['', '0' * 64, 'g' * 64, '\u0100' * 64, 'A' * 64, '0' * 63])
      yield json.dumps({'payload': payload, 'mac': mac}).encode(errors='surrogatepass') \
          if '\ud800' in payload else json.dumps({'payload': payload, 'mac': mac}).encode()


def test_verifier_survives_100k_hostile_datagrams_and_accepts_the_next_real_one():
  seed = random.randrange(2**32)
  rng = random.Random(seed)
  v = hb.Verifier(SECRET, window_s=30)
  reasons = collections.Counter()
  for d in _hostile_datagrams(rng, 100_000):
    try:
      v.verify(d)
    except hb.Rejected as e:
      reasons[e.reason.split(':')[0]] += 1
      continue
    raise AssertionError(f'seed {seed}: accepted {d[:200]!r}')
  assert sum(reasons.values()) == 100_000, (seed, reasons)
  assert not v._seen, 'nothing unauthenticated may be remembered'
  # The driver's verifier still works for the real thing, once.
  real = hb.sign({'ts': time.time(), 'nonce': 'real', 'process': 1}, SECRET)
  assert v.verify(real)['process'] == 1
  with pytest.raises(hb.Rejected, match='replay'):
    v.verify(real)


def test_nonce_cache_forgets_as_the_window_moves():
  """Replays are refused inside the window; nonces leave the cache as the
  window passes them, a few per datagram (no pause to rebuild it)."""
  v = hb.Verifier(SECRET, window_s=10)
  t0 = time.time()
  for i in range(1000):
    v.verify(hb.sign({'ts': t0, 'nonce': f'n{i}', 'process': 0}, SECRET), now=t0)
  with pytest.raises(hb.Rejected, match='replay'):
    v.verify(hb.sign({'ts': t0, 'nonce': 'n5', 'process': 0}, SECRET), now=t0 + 5)
  assert len(v._seen) == 1000
  v.verify(hb.sign({'ts': t0 + 11, 'nonce': 'late', 'process': 0}, SECRET), now=t0 + 11)
  assert v._seen == {'late'}
  with pytest.raises(hb.Rejected, match='stale'):   # the forgotten nonce cannot come back
    v.verify(hb.sign({'ts': t0, 'nonce': 'n5', 'process': 0}, SECRET), now=t0 + 11)


def test_sequence_numbers_refuse_replays_with_one_entry_per_sender():
  v = hb.Verifier(SECRET, window_s=10)
  t0 = time.time()
  beat = lambda seq, ts=t0, sender='a': hb.sign({'ts': ts, 'sender': sender, 'seq': seq, 'process': 0}, SECRET)
  for seq in (1, 2, 5):
    v.verify(beat(seq), now=t0)
  for seq in (5, 4, 1):   # the same datagram again, or an older one
    with pytest.raises(hb.Rejected, match='replay: sequence number'):
      v.verify(beat(seq), now=t0)
  v.verify(beat(1, sender='b'), now=t0)   # another sender has its own count
  for i in range(1000):
    v.verify(beat(6 + i), now=t0)
  assert len(v._senders) == 2 and not v._seen   # two entries, however many datagrams
  v.verify(beat(1, ts=t0 + 11, sender='c'), now=t0 + 11)
  assert set(v._senders) == {'c'}               # silent senders leave with the window
  with pytest.raises(hb.Rejected, match='stale'):   # and what they sent cannot come back
    v.verify(beat(7), now=t0 + 11)
  with pytest.raises(hb.Rejected, match='malformed'):
    v.verify(hb.sign({'ts': t0, 'sender': 'a', 'seq': 'x', 'process': 0}, SECRET), now=t0)


def test_heartbeat_server_turns_every_datagram_into_a_verdict():
  server = hb.HeartbeatServer('127.0.0.1:0', SECRET, window_s=30)
  sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
  try:
    host, port = hb.parse_address(server.address)
    sent = list(_hostile_datagrams(random.Random(0), 300))
    sent = [d for d in sent if len(d) <= 60000]  # UDP's own limit
    sent.append(hb.sign({'ts': time.time(), 'nonce': 'ok', 'process': 3}, SECRET))
    got = []
    for d in sent:
      sock.sendto(d, (host, port))
      got += server.receive(0.0)
    deadline = time.time() + 5
    while len(got) < len(sent) and time.time() < deadline:
      got += server.receive(0.2)
    assert len(got) == len(sent)
    accepted = [p for p, reason, _ in got if p is not None]
    assert [p['process'] for p in accepted] == [3]
  finally:
    sock.close()
    server.close()


class Flood:
  """Hostile datagrams at the current driver's heartbeat port, from a thread,
  paced so that the real heartbeats still get through."""

  def __init__(self, workdir, rng: random.Random, total: int, driver_alive):
    self.workdir, self.rng, self.total, self.driver_alive = workdir, rng, total, driver_alive
    self.sent = 0
    self.stop = False
    self.thread = threading.Thread(target=self._run, daemon=True)
    self.thread.start()

  def _run(self):
    datagrams = [d for d in _hostile_datagrams(self.rng, self.total) if len(d) <= 60000]
    addr, looked = None, 0.0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
      while self.sent < len(datagrams) and not self.stop:
        if time.monotonic() - looked > 0.5:   # the event log grows with every rejection: read it seldom
          starts, looked = events(self.workdir, 'start'), time.monotonic()
          addr = hb.parse_address(starts[-1]['heartbeat_address']) if starts else None
        if addr is None or not self.driver_alive():
          time.sleep(0.05)
          continue
        for d in datagrams[self.sent:self.sent + 200]:
          try:
            s.sendto(d, addr)
          except OSError:
            pass
        self.sent = min(len(datagrams), self.sent + 200)
        time.sleep(0.02)


def damage(step_dir, rng, tries=20):
  """Flips random bits of the largest file of a step's arrays (an array
  chunk) until the step reads as damaged. Not every byte there is used: a
  bit flipped in the unused tail of an OCDBT data file changes nothing, and
  the step rightly reads as intact (seen in CI), so each flip is checked
  with the product's own verifier."""
  from mjax.checkpoint.integrity import verify_step
  state = os.path.join(step_dir, 'state')
  files = [os.path.join(d, f) for d, _, fs in os.walk(state) for f in fs]
  target = max(files, key=os.path.getsize)
  for _ in range(tries):
    with open(target, 'r+b') as fh:
      data = bytearray(fh.read())
      i = rng.randrange(len(data))
      data[i] ^= 1 << rng.randrange(8)
      fh.seek(0)
      fh.write(data)
    if verify_step(step_dir)[0] != 'ok':
      return target
  raise AssertionError(f'{tries} bits flipped in {target} and the step still reads as intact')


@pytest.mark.slow
def test_chaos_kills_a_dead_driver_a_flipped_bit_and_a_datagram_flood_end_bitwise(reference, tmp_path,
                                                                                 repo_root):
  """One run through everything, at random moments: a trainer killed
  mid-step; the driver killed (its trainers stop by themselves); a bit
  flipped in the newest checkpoint; a new driver, whose trainer is killed
  mid-save; 100,000 hostile datagrams at the drivers meanwhile. Each kill is
  exactly one fault (no false hang after a restart) and the final state is
  bitwise the uninterrupted run's. (The driver's kill -9 alone, with its
  agents: tests/test_agent.py; a trainer's kill -9 without a driver:
  tests/test_checkpoint.py.) Replay a failure with
  MJAX_CHAOS_SEED=<the printed seed>."""
  seed = int(os.environ.get('MJAX_CHAOS_SEED') or random.randrange(2**31))
  print(f'chaos seed {seed} (replay with MJAX_CHAOS_SEED={seed})')
  rng = random.Random(seed)
  # Steps slow enough to act between them, where there is something to do: in
  # the first driver's attempt whose driver is killed 2 s, so that its
  # trainers notice (3 s, then STOP_MARGIN_STEPS more) well before the end.
  # Each driver counts attempts from 0; the second one's last attempt, after
  # the last kill, runs at full speed.
  envs = [child_env(MJAX_FAULT='delay:seconds=0.8:attempt=0;delay:seconds=2:attempt=1'),
          child_env(MJAX_FAULT='delay:seconds=0.8:attempt=0')]
  ckdir = os.path.join(tmp_path, 'checkpoints')
  driver = {}

  def start_driver():
    env = envs[len(events(tmp_path, 'start'))]
    driver['proc'] = subprocess.Popen(launch_cmd(tmp_path, 2), cwd=repo_root, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    driver['launches'] = len(events(tmp_path, 'launch'))

  def until(cond, what, timeout=300):
    t0 = time.time()
    while not cond():
      p = driver['proc']
      assert p.poll() is None, (seed, what, p.communicate()[0][-3000:])
      assert time.time() - t0 < timeout, (seed, f'{what}: not after {timeout}s')
      time.sleep(0.005)

  def attempt_running(k):
    """pids of this driver's k-th launch, once every one of its processes is past start-up."""
    until(lambda: len(events(tmp_path, 'launch')) >= driver['launches'] + k, f'launch {k}')
    until(lambda: len(events(tmp_path, 'running')) >= driver['launches'] + k, f'running {k}')
    return events(tmp_path, 'launch')[driver['launches'] + k - 1]['pids']

  start_driver()
  flood = Flood(tmp_path, random.Random(seed + 1), 100_000, lambda: driver['proc'].poll() is None)
  # 1. A trainer killed mid-step, once a checkpoint exists.
  pids = attempt_running(1)
  until(lambda: newest_step(tmp_path) >= 3, 'first checkpoint')
  time.sleep(rng.uniform(0.0, 0.8))
  first_victim = rng.randrange(2)
  os.kill(pids[first_victim], signal.SIGKILL)
  # 2. The driver killed while the restarted job runs: its trainers stop by
  # themselves, after a save.
  pids = attempt_running(2)
  time.sleep(rng.uniform(0.0, 1.0))
  driver['proc'].kill()
  driver['proc'].communicate()
  t0 = time.time()
  while any(alive(p) for p in pids):
    assert time.time() - t0 < 90, (seed, 'trainers outlived their driver by 90 s')
    time.sleep(0.1)
  stopped = newest_step(tmp_path)
  assert stopped < N and 'the fault-tolerance driver is gone' in open(
      os.path.join(tmp_path, 'logs', 'process-0.log')).read(), (seed, stopped)
  # 3. Bits flipped in the arrays of the newest checkpoint (the one the
  # trainers saved on their way out).
  damage(os.path.join(ckdir, str(stopped)), rng)
  # 4. A new driver; one of its trainers killed while a save is being
  # written (Orbax's temporary directory is there), else mid-step.
  start_driver()
  pids = attempt_running(1)
  saving = lambda: any('tmp' in n for n in os.listdir(ckdir))
  t0 = time.time()
  while time.time() - t0 < 10 and not saving():
    assert driver['proc'].poll() is None, seed
    time.sleep(0.002)
  print(f'chaos: kill {"mid-save" if saving() else "mid-step"}; driver killed at step {stopped}')
  last_victim = rng.randrange(2)
  os.kill(pids[last_victim], signal.SIGKILL)
  out, _ = driver['proc'].communicate(timeout=600)
  flood.stop = True
  assert driver['proc'].returncode == 0, (seed, out[-3000:])
  faults = events(tmp_path, 'fault')
  assert [f['kind'] for f in faults] == ['exit', 'exit'], (seed, faults)     # one per kill, nothing else
  for fault, victim in zip(faults, (first_victim, last_victim)):            # each names its victim
    assert victim in fault['processes'] and fault['exit'][str(victim)] == 'SIGKILL', (seed, fault)
  # The first restart resumed from a complete checkpoint (step 3 or later).
  first_restart = [e for e in events(tmp_path, 'startup') if e['attempt'] == 1][0]
  assert first_restart['resumed_step'] >= 3, (seed, first_restart)
  logs = ''.join(open(os.path.join(tmp_path, 'logs', f)).read() for f in os.listdir(os.path.join(tmp_path, 'logs')))
  assert re.search(rf'\(step {stopped}\) is (damaged|unreadable)', logs), (seed, os.listdir(ckdir))
  assert flood.sent >= 100_000 - 100, (seed, flood.sent)
  rejected = events(tmp_path, 'heartbeat_rejected')
  assert sum(1 + e['suppressed_before'] for e in rejected) > 1000, (seed, len(rejected))
  # A host blocked on the way (a diagnostic failing on a healthy machine)
  # shrinks the job: one process with gradient accumulation computes the same
  # steps a few ulps off, which would read as a broken resume below.
  assert not events(tmp_path, 'host_blocked'), (seed, events(tmp_path, 'host_blocked'))
  assert {e['processes'] for e in events(tmp_path, 'launch')} == {2}, (seed, events(tmp_path, 'launch'))
  assert losses(tmp_path) == losses(reference), seed
  assert_bitwise(final_state(tmp_path), final_state(reference))


# --- collective check between the hosts a fault names -----------------------------------

def test_links_of_the_named_host_are_checked_with_a_healthy_host(tmp_path, monkeypatch):
  """A hang named slot1: after both hosts pass their own checks, slot1 runs
  an all-reduce with slot0 (a real two-process mjax-diagnose job); a failing
  one (injected on slot1's side) blocks slot1 alone."""
  monkeypatch.delenv('MJAX_FAULT', raising=False)
  for inject, blocked in (('', []), ('allreduce_global', ['slot1'])):
    work = tmp_path / (inject or 'ok')
    opts = driver.parse_args(['--processes', '3', '--devices', '1', '--workdir', str(work), '--quiet',
                              '--diagnose_args', '--checks memory', '--host_env', f'slot1:MJAX_DIAGNOSE_FAIL={inject}',
                              '--', '--gin_file', 'tiny.gin', '--gin.TrainConfig.global_batch_size=6'])
    d = driver.Driver(opts)
    try:
      att = fake_attempt(d, ['slot0', 'slot1', 'slot2'])
      d._diagnose(att, detect.Fault('hang', [1], 'stuck'))
    finally:
      d.server.close()
      d.events.close()
    checks = events(work, 'link_check')
    assert [(c['host'], c['partner']) for c in checks] == [('slot1', 'slot0')], checks
    assert checks[0]['passed'] is (not inject), checks
    assert [b['host'] for b in events(work, 'host_blocked')] == blocked
    if inject:
      assert 'allreduce_global' in events(work, 'host_blocked')[0]['reason']
    # Their own checks ran on every host; the link check only for the named one.
    assert sorted(e['host'] for e in events(work, 'diagnosis')) == ['slot0', 'slot1', 'slot2']


def _diagnose_exit_of_slot1(tmp_path, executor_factory):
  """The driver's diagnosis after process 1 (on slot1) of a two-host job exited."""
  opts = driver.parse_args(['--processes', '2', '--workdir', str(tmp_path), '--quiet', '--',
                            '--gin_file', 'tiny.gin'])
  opts.diagnose = ['mjax-diagnose']
  d = driver.Driver(opts, executor_factory=executor_factory)
  try:
    d._diagnose(fake_attempt(d, ['slot0', 'slot1']), detect.Fault('exit', [1], 'exited abnormally'))
  finally:
    d.server.close()
    d.events.close()


class FlakyLinkExecutor(FakeExecutor):
  """Own checks pass; the first `fails` link-check jobs fail as a two-process
  job does whose coordinator port was taken before it bound it (process 0
  cannot listen, process 1 never reaches it), later ones pass."""
  fails = 1
  link_runs: list = []

  def run(self, argv, env, timeout, cancel=None):
    if '--no_baseline' not in argv:   # the host's own checks
      return super().run(argv, env, timeout)
    FlakyLinkExecutor.link_runs.append((self.host, env.get('MJAX_COORDINATOR_ADDRESS')))
    if len(FlakyLinkExecutor.link_runs) <= 2 * self.fails:
      return 1, '', 'RuntimeError: Failed to add port to server: address already in use'
    checks = [{'name': 'allreduce_global', 'passed': True}]
    return 0, json.dumps({'host': self.host, 'passed': True, 'checks': checks}), ''


@pytest.mark.parametrize('fails,blocked', [(1, []), (2, ['slot1'])])
def test_a_link_check_that_fails_once_blocks_nobody(tmp_path, monkeypatch, fails, blocked):
  """The chaos test once ended 1 ulp off the reference from the step after
  a kill: one failed start of the link-check job (on a loaded machine)
  blocked the killed process's healthy host for good, and the job went on
  on one process with gradient accumulation, exactly but not bitwise the
  two-process numbers. A link check is tried again before it blocks; a
  link that fails twice still blocks its host."""
  monkeypatch.setattr(FakeExecutor, 'failing', {})
  monkeypatch.setattr(FlakyLinkExecutor, 'fails', fails)
  monkeypatch.setattr(FlakyLinkExecutor, 'link_runs', [])
  _diagnose_exit_of_slot1(tmp_path, FlakyLinkExecutor)
  assert hosts_lib.BlockList(str(tmp_path)).hosts() == blocked
  (check,) = events(tmp_path, 'link_check')
  assert (check['host'], check['partner'], check['passed']) == ('slot1', 'slot0', not blocked), check
  assert 'address already in use' in check['detail'], check
  runs = FlakyLinkExecutor.link_runs
  assert len(runs) == 4 and [h for h, _ in runs[:2]] == ['slot1', 'slot0'], runs


class CrashingDiagnoseExecutor(FakeExecutor):
  """The host's own diagnostic crashes before it reports (no JSON) on its
  first `crashes` runs, then reports as FakeExecutor does."""
  crashes = 1
  runs: list = []

  def run(self, argv, env, timeout, cancel=None):
    if '--no_baseline' in argv:   # a link check: passes
      return 0, json.dumps({'host': self.host, 'passed': True, 'checks': []}), ''
    CrashingDiagnoseExecutor.runs.append(self.host)
    if self.host == 'slot1' and CrashingDiagnoseExecutor.runs.count('slot1') <= self.crashes:
      return 1, '', 'OSError: [Errno 5] Input/output error'
    return super().run(argv, env, timeout)


@pytest.mark.parametrize('crashes,blocked', [(1, []), (2, ['slot1'])])
def test_a_diagnostic_that_crashes_once_blocks_nobody(tmp_path, monkeypatch, crashes, blocked):
  """A host's own diagnostic that crashed without a report is run again
  before its host is blocked; crashing twice blocks it. A failed check
  blocks at once (test_failing_diagnostic_blocks_its_host_only)."""
  monkeypatch.setattr(FakeExecutor, 'failing', {})
  monkeypatch.setattr(CrashingDiagnoseExecutor, 'crashes', crashes)
  monkeypatch.setattr(CrashingDiagnoseExecutor, 'runs', [])
  _diagnose_exit_of_slot1(tmp_path, CrashingDiagnoseExecutor)
  assert hosts_lib.BlockList(str(tmp_path)).hosts() == blocked
  assert sorted(CrashingDiagnoseExecutor.runs) == ['slot0', 'slot1', 'slot1']   # slot1 twice, slot0 once
  diag = {e['host']: e for e in events(tmp_path, 'diagnosis')}
  assert diag['slot0']['passed'] and diag['slot1']['passed'] == (not blocked), diag
  if blocked:
    assert 'Input/output error (crashed 2 times)' in diag['slot1']['detail'], diag


def test_numerical_faults_check_no_links(tmp_path, monkeypatch):
  monkeypatch.setattr(FakeExecutor, 'failing', {})
  d = make_driver(tmp_path)
  att = fake_attempt(d, ['slot0', 'slot1'])
  d._diagnose(att, detect.Fault('nonfinite_loss', [1], 'nan'))
  assert events(tmp_path, 'link_check') == [] and len(events(tmp_path, 'diagnosis')) == 2


class StuckProcess:
  """A local process SIGKILL does not end (stuck in the kernel): Popen's
  interface, and never a status."""
  pid, returncode = None, None

  def poll(self):
    return None

  def send_signal(self, sig):
    pass

  def wait(self, timeout=None):
    time.sleep(timeout)
    raise subprocess.TimeoutExpired('stuck', timeout)


class NoKill:
  def kill(self, handle):
    pass


def test_processes_that_outlive_sigkill_cost_one_wait_and_count_as_lost_hosts(tmp_path, monkeypatch):
  monkeypatch.setattr(driver, 'KILL_WAIT_S', 0.5)
  d = make_driver(tmp_path, '--grace_s', '0')
  try:
    att = fake_attempt(d, ['slot0', 'slot1', 'slot2'])
    att.handles = {i: StuckProcess() for i in range(3)}
    att.executors = [NoKill()] * 3
    t0 = time.monotonic()
    d._stop(att, 'exit')
    assert time.monotonic() - t0 < 1.0   # one KILL_WAIT_S for all three
  finally:
    d.server.close()
    d.events.close()
  (stopped,) = events(tmp_path, 'stopped')
  assert stopped['killed'] == [0, 1, 2] and stopped['exit'] == {'0': 'host lost', '1': 'host lost', '2': 'host lost'}
  assert driver.Driver._describe_status(None) == 'not exited'
  # A signal named either way it ended a process: raised, or as 128 + its number.
  assert [driver.Driver._describe_status(c) for c in (-15, 143, 137, 1, 4, 200)] == [
      'SIGTERM', 'status 143 (SIGTERM)', 'status 137 (SIGKILL)', 'status 1', 'status 4', 'status 200']


@pytest.mark.slow
def test_a_rank_throttled_inside_the_step_is_named_by_the_driver(tmp_path, repo_root):
  """Process 1 is stopped 80% of the time from step 3 (SIGSTOP cycles, as a
  throttled device): its host timings match the other's, since the
  all-reduce releases both together; its sampled device compute time does
  not, and the driver names it (a report: evict_stragglers is off).

  The stop cycle (0.1 s) is close to this model's step (~0.25 s), so how
  much of a step it takes varies: at 40% some sampled steps read only ~0.1
  slower, under the verdict's margin / 2; at 60% every one read >= 0.5 on a
  quiet machine, but beside the suite's other worker a verdict went
  missing in 2 of 3 full runs. At 80% the throttled compute is ~5x slower."""
  # Device times sampled at 2, 6, ..., 18; a verdict rests on the latest
  # stragglers.DEVICE_SAMPLES (10, 14, 18), all throttled. However few of
  # the driver's 5 s analyses ran during the job, its last one, as the job
  # finishes, sees them all.
  train = ['--gin.ModelConfig.d_model=256', '--gin.DataConfig.seq_len=128', '--gin.TrainConfig.steps=20',
           '--gin.OptimConfig.decay_steps=20', '--gin.CheckpointConfig.save_every=0',
           '--gin.FaultConfig.device_timing_every=4', '--gin.FaultConfig.timing_every=4']
  env = child_env(MJAX_FAULT='throttle:factor=0.8:process=1:step=3')
  run = subprocess.run(launch_cmd(tmp_path, 2, train=train), cwd=repo_root, env=env, capture_output=True,
                       text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  found = events(tmp_path, 'straggler')
  # What the rows say, for a failure's message: a verdict the rows hold but
  # the driver did not report is the driver's analysis, not the throttle.
  sampled = [(r['process'], r['step'], r['device']) for r in stragglers.load_rows(str(tmp_path))
             if 'device' in r]
  assert [(e['process'], e['reason'], e['host']) for e in found] == [(1, 'device', 'slot1')], (
      found, sampled, stragglers.device_stragglers(stragglers.load_rows(str(tmp_path))), run.stderr[-2000:])
  assert 'the others wait' in found[0]['detail'] and not found[0]['evict']
  assert events(tmp_path, 'finish') and not events(tmp_path, 'fault')
  # The rows behind it: samples half a period off the round steps, and the
  # report's verdict from them.
  rows = stragglers.load_rows(str(tmp_path))
  assert sorted({r['step'] for r in rows if 'device' in r}) == list(range(2, 21, 4))
  (s,) = stragglers.device_stragglers(rows)
  assert s.process == 1 and s.ratio > 1.2
  report = subprocess.run([os.path.join(os.path.dirname(sys.executable), 'mjax-report'), 'stragglers',
                           str(tmp_path), '--out', str(tmp_path / 'report')], env=env, cwd=repo_root,
                          capture_output=True, text=True, timeout=120)
  assert report.returncode == 0, report.stderr
  assert 'straggler: process 1' in report.stdout and 'device compute' in report.stdout


def test_slurm_kills_of_one_attempt_list_the_steps_once_and_a_slurmctld_error_ends_nothing(tmp_path,
                                                                                           monkeypatch):
  """After a hang every process is killed: one squeue serves them all (one
  per process is a thousand calls to slurmctld on a 1,000-node job), each
  step is cancelled, and a step started since is listed afresh. A squeue or
  scancel that fails (missing, timed out) costs a message, not the driver."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  calls = tmp_path / 'calls'
  (bin_dir / 'squeue').write_text(f'#!/bin/sh\necho squeue >> {calls}\ncat {tmp_path / "steps"}\n')
  (bin_dir / 'scancel').write_text(f'#!/bin/sh\necho "scancel $*" >> {calls}\n')
  for f in ('squeue', 'scancel'):
    os.chmod(bin_dir / f, 0o755)
  (tmp_path / 'steps').write_text('7.0 mjax-a1-n0\n7.1 mjax-a1-n1\n7.2 mjax-a1-n2\n7.3 other\n')
  monkeypatch.setenv('PATH', f'{bin_dir}{os.pathsep}{os.environ["PATH"]}')
  monkeypatch.setenv('SLURM_JOB_ID', '7')
  monkeypatch.setattr(executor.SlurmExecutor, '_steps', (-1e9, {}))

  def handle(host, attempt=1):
    h = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)
    h.step_name = f'mjax-a{attempt}-{host}'
    return h

  handles = [handle(f'n{i}') for i in range(3)]
  for i, h in enumerate(handles):
    executor.SlurmExecutor(f'n{i}').kill(h)
    assert h.wait(10) == -signal.SIGKILL
  assert calls.read_text().splitlines() == ['squeue', 'scancel --signal=KILL 7.0', 'scancel --signal=KILL 7.1',
                                            'scancel --signal=KILL 7.2']
  # A step of the next attempt, started after that listing: listed afresh.
  (tmp_path / 'steps').write_text('7.4 mjax-a2-n0\n')
  h = handle('n0', attempt=2)
  executor.SlurmExecutor('n0').kill(h)
  assert calls.read_text().splitlines()[-2:] == ['squeue', 'scancel --signal=KILL 7.4']
  # No scancel at all (an image without the SLURM client): said, the srun client still killed.
  os.remove(bin_dir / 'scancel')
  monkeypatch.setenv('PATH', str(bin_dir))
  h = handle('n1', attempt=3)
  h.step_name = 'mjax-a2-n0'
  executor.SlurmExecutor('n1').kill(h)
  assert h.wait(10) == -signal.SIGKILL


def test_a_slurm_diagnostic_that_overruns_or_is_cancelled_has_its_step_cancelled(tmp_path, monkeypatch):
  # Before, only the local srun client was killed: the step ran on, on its node.
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  calls, name = tmp_path / 'calls', tmp_path / 'name'
  # srun: keeps its step's name for squeue, then runs the command after its options.
  (bin_dir / 'srun').write_text(
      '#!/bin/sh\nfor a in "$@"; do case "$a" in --job-name=*) echo "${a#--job-name=}" > %s;; esac; done\n'
      'while [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n' % name)
  (bin_dir / 'squeue').write_text(f'#!/bin/sh\necho "7.9 $(cat {name})"\n')
  (bin_dir / 'scancel').write_text(f'#!/bin/sh\necho "scancel $*" >> {calls}\n')
  for f in ('srun', 'squeue', 'scancel'):
    os.chmod(bin_dir / f, 0o755)
  monkeypatch.setenv('PATH', f'{bin_dir}{os.pathsep}{os.environ["PATH"]}')
  monkeypatch.setenv('SLURM_JOB_ID', '7')
  monkeypatch.setattr(executor.SlurmExecutor, '_steps', (-1e9, {}))
  ex = executor.SlurmExecutor('n0')
  sleep = [sys.executable, '-c', 'import time; time.sleep(60)']
  t0 = time.monotonic()
  code, _, _ = ex.run(sleep, dict(os.environ), 60.0, cancel=lambda: time.monotonic() - t0 > 1.0)
  assert code == executor.CANCELLED and calls.read_text().splitlines() == ['scancel --signal=KILL 7.9']
  first = name.read_text().strip()
  assert first.startswith('mjax-diagnose-n0-')
  assert ex.run(sleep, dict(os.environ), 1.0)[0] == 124
  assert calls.read_text().splitlines()[-1] == 'scancel --signal=KILL 7.9' and name.read_text().strip() != first
  assert ex.run([sys.executable, '-c', 'print(1)'], dict(os.environ), 30.0) == (0, '1\n', '')
  assert len(calls.read_text().splitlines()) == 2   # one that ends by itself is left alone


def test_rejected_heartbeats_are_logged_once_per_kind_whatever_their_numbers():
  # A flood that varies the datagram's size (or its clock offset) made each
  # size a reason of its own, logged once each: tens of thousands of lines.
  import types
  emitted = []
  from mjax.ft.events import Throttle
  fake = types.SimpleNamespace(_rejected=Throttle(5.0), _unread_seen=0, server=types.SimpleNamespace(rejected_dropped=0),
                               events=types.SimpleNamespace(emit=lambda *a, **kw: emitted.append(kw)))
  reject = lambda reason: driver.Driver._rejected_heartbeat(fake, reason, ('10.0.0.9', 1))
  for n in range(1000):
    reject(f'malformed: {70000 + n} bytes, more than 65507')
    reject(f'stale: timestamp {n + 100:+.1f}s from now, outside +-60s')
  assert [e['reason'].partition(':')[0] for e in emitted] == ['malformed', 'stale']
  # 5 s on, each event says how many it stands for; and those the server
  # let go of while the driver's loop was held up (it keeps the last 1,024)
  # are counted on the next event, once.
  fake.server.rejected_dropped = 70
  for kind in fake._rejected._keys.values():
    kind[0] -= 6
  reject('malformed: 9 bytes')
  reject('stale: timestamp +99.0s from now, outside +-60s')
  assert [(e['suppressed_before'], e.get('unread')) for e in emitted[2:]] == [(999, 70), (999, None)]


def test_a_host_whose_clock_is_far_off_fails_its_diagnosis():
  # Its own checks pass, but its heartbeats fall outside the driver's window
  # (60 s): its processes would count as lost after every restart, until
  # max_restarts ended the job. Within half the window of the run, it passes.
  check = lambda t: health.clock_verdict({'passed': True, 'time': t}, 1000.0, 1010.0, 60.0)
  assert check(1005.0) == (True, 'passed') and check(975.0)[0] and check(1035.0)[0]
  passed, detail = check(1100.0)
  assert not passed and 'its clock is +90s off the driver\'s' in detail and 'NTP' in detail
  assert not check(900.0)[0] and check(float('nan'))[0] and health.clock_verdict({}, 0, 1, 60.0)[0]


def test_every_event_the_driver_writes_is_documented():
  """events.jsonl's kinds are listed in mjax/ft/events.py, the page a person
  reading the log opens: none written that is not there."""
  pkg = os.path.dirname(driver.__file__)
  emitted = set()
  for name in os.listdir(pkg):
    if name.endswith('.py'):
      # emit('kind', ...) and emit('a' if ... else 'b', ...)
      for kinds in re.findall(r"emit\(\s*'([a-z_]+)'(?:\s+if\s+[^,]+?\s+else\s+'([a-z_]+)')?",
                              open(os.path.join(pkg, name)).read()):
        emitted |= set(kinds) - {''}
  # The kind column: a line's first word(s), two spaces in ('a / b' for alternatives).
  documented = {k for line in re.findall(r'^  ([a-z_]+(?: / [a-z_]+)*)\s', events_lib.__doc__, re.M)
                for k in line.split(' / ')}
  assert {'start', 'fault', 'job_slowdown', 'job_pace_recovered', 'driver_stalled'} <= emitted
  assert emitted - documented == set()


@pytest.mark.skipif(not os.path.exists('/dev/full'), reason='needs /dev/full (a device that is always full)')
def test_the_event_log_outlives_a_full_disk_and_a_deleted_file(tmp_path, capsys):
  # A full workdir made the driver die of its own event log (a traceback,
  # exit 1, its trainers left running); a deleted events.jsonl took every
  # later event with it.
  path = str(tmp_path / 'events.jsonl')
  log = events_lib.EventLog(path)
  log.emit('start')
  os.unlink(path)
  log.emit('launch', attempt=0)
  assert [e['event'] for e in events_lib.read(path)] == ['launch']
  log._fh.close()
  log._fh, log.path = open('/dev/full', 'a', buffering=1), '/dev/full'
  log.emit('fault', kind='exit')
  log.emit('restart', attempt=1)
  log.close()
  err = capsys.readouterr().err
  assert err.count("events cannot be written to '/dev/full': No space left on device") == 1, err
  assert '"event": "fault"' in err and '"event": "restart"' in err


def test_a_stop_in_the_back_off_ends_the_driver_without_a_relaunch(tmp_path, monkeypatch):
  # The back-off (up to a minute) slept through SIGTERM and SIGINT, and the
  # driver said 'restart', then 'preempted during waiting for hosts'.
  d = fake_driver(tmp_path, monkeypatch, 'crash_once', train=[*QUICK, '--gin.FaultConfig.restart_backoff_s=60'])
  emit = d.events.emit

  def emit_then_stop(event, **fields):
    out = emit(event, **fields)
    if event == 'restart':   # SIGTERM as the back-off begins
      threading.Timer(0.5, d._on_signal, args=(signal.SIGTERM, None)).start()
    return out
  d.events.emit = emit_then_stop
  assert d.run() == d.opts.preempt_exit_status
  (pre,) = events(tmp_path, 'preempted')
  assert pre['during'] == 'back-off' and len(events(tmp_path, 'launch')) == 1, pre


def test_a_host_diagnosis_is_a_job_of_its_own_not_the_slurm_steps(tmp_path, monkeypatch):
  # Under launch/slurm_ft.sbatch each agent runs in one SLURM step over every
  # node, and mjax-diagnose read its SLURM_PROCID / SLURM_NTASKS as a job to
  # join with the other nodes' diagnostics: with a node lost, the healthy
  # node's diagnosis waited out the join timeout (300 s) and failed.
  from mjax import distributed
  d = fake_driver(tmp_path, monkeypatch, 'crash_once', processes=2)
  for k, v in {'SLURM_JOB_ID': '7', 'SLURM_PROCID': '0', 'SLURM_NTASKS': '2',
               'SLURM_STEP_NODELIST': 'node[1-2]', distributed.COORDINATOR: 'node1:1234'}.items():
    monkeypatch.setenv(k, v)
  seen = []

  class Recording:
    def run(self, argv, env, timeout, cancel=None):
      seen.append(distributed.resolve(env))
      return 0, json.dumps({'host': 'slot0', 'passed': True, 'checks': []}), ''
  d.health.executor_factory = lambda host: Recording()
  d.health.diagnose_host('slot0')
  assert seen and seen[0].num_processes == 1, seen


def test_a_stop_during_a_diagnosis_ends_it_there_and_blocks_no_host(tmp_path, monkeypatch):
  # The driver waited for every diagnostic to its deadline (300 s by
  # default, a hung check's 120 s), then blocked hosts on what it got, and
  # only then said 'preempted': past SLURM's TERM-to-KILL window.
  d = fake_driver(tmp_path, monkeypatch, 'crash_once', processes=2)
  d.executor_factory = d.health.executor_factory = executor.LocalExecutor
  d.health.diagnose_cmd = [sys.executable, '-c', 'import time; time.sleep(120)']   # a hung check
  emit = d.events.emit

  def emit_then_stop(event, **fields):
    out = emit(event, **fields)
    if event == 'fault':   # SIGTERM once the diagnosis has begun
      threading.Timer(1.0, d._on_signal, args=(signal.SIGTERM, None)).start()
    return out
  d.events.emit = emit_then_stop
  t0 = time.monotonic()
  assert d.run() == d.opts.preempt_exit_status
  assert time.monotonic() - t0 < 60
  (pre,) = events(tmp_path, 'preempted')
  assert pre['during'] == 'diagnosis', pre
  assert not events(tmp_path, 'host_blocked') and not events(tmp_path, 'link_check')
  assert not os.path.exists(tmp_path / 'blocked_hosts.json') or not json.load(open(tmp_path / 'blocked_hosts.json'))


def test_a_command_the_driver_runs_ends_at_its_deadline_or_when_cancelled():
  ex = executor.LocalExecutor('h')
  sleep = [sys.executable, '-c', 'import sys, time; print("began", flush=True); time.sleep(60)']
  t0 = time.monotonic()
  code, out, err = ex.run(sleep, dict(os.environ), 1.0)
  assert code == 124 and 'timed out after 1s' in err and out == 'began\n' and time.monotonic() - t0 < 10
  t0 = time.monotonic()
  code, _, err = ex.run(sleep, dict(os.environ), 60.0, cancel=lambda: time.monotonic() - t0 > 0.5)
  assert code == executor.CANCELLED and 'cancelled' in err and time.monotonic() - t0 < 10
  assert ex.run([sys.executable, '-c', 'print(7)'], dict(os.environ), 30.0, cancel=lambda: False) == (0, '7\n', '')


def test_a_workdir_in_another_runs_checkpoints_or_logs_is_refused_before_the_driver_writes(tmp_path):
  # The trainers refused it, but the driver had written its lock, events,
  # logs/ and protocol/ among that run's steps already.
  from mjax.checkpoint.directories import OWNER_FILE
  run = tmp_path / 'k9'
  (run / 'checkpoints' / '75').mkdir(parents=True)
  (run / 'logs').mkdir()
  (run / 'config.json').write_text(json.dumps({'model': {}, 'checkpoint': {}}))
  (run / 'checkpoints' / OWNER_FILE).write_text(json.dumps({'workdir': str(run)}))
  before = sorted(str(p) for p in run.rglob('*'))
  for inside, said in [(run / 'checkpoints', 'the checkpoint directory of the run'),
                       (run / 'logs' / 'x', "the logs/ folder of the mjax run")]:
    with pytest.raises(UserError, match=re.escape(said)):
      make_driver(inside)
  assert sorted(str(p) for p in run.rglob('*')) == before


def test_a_second_driver_on_a_supervised_workdir_is_refused_before_it_writes(tmp_path, monkeypatch):
  # It wrote its events into the first job's events.jsonl (ending in its
  # 'giveup') and its attempts into logs/ for two minutes before its
  # trainers met the run lock.
  held = driver._hold_driver_lock(str(tmp_path), str(tmp_path))
  try:
    d = make_driver(tmp_path, '--processes', '1', train=QUICK)
    with pytest.raises(UserError, match=rf"is supervised by another mjax-launch \(pid {os.getpid()} on "):
      d.run()
    assert events_lib.read(str(tmp_path / 'events.jsonl')) == []
  finally:
    os.close(held)
  assert fake_run(tmp_path, monkeypatch, 'exit0') == driver.EXIT_OK   # free again: the next one runs


def test_a_trainer_that_lost_the_driver_is_diagnosed_unless_the_driver_held_itself(tmp_path):
  """Exit status 4 alone is no proof of the driver's own hold-up: one host
  whose link to the driver failed exits 4 as well, while the others train
  on, and is diagnosed. Only where the driver let its trainers go itself
  (`_stalled`) is it the fault `driver_held`, with no host diagnosed."""
  d = make_driver(tmp_path)
  try:
    att = fake_attempt(d, ['slot0', 'slot1'])
    assert d._exit_fault(att, {1: protocol.EXIT_DRIVER_LOST}).kind == 'exit'
    att.trainers_let_go = True
    assert d._exit_fault(att, {0: protocol.EXIT_DRIVER_LOST, 1: protocol.EXIT_DRIVER_LOST}).kind == 'driver_held'
  finally:
    d.server.close()


def test_an_address_is_host_and_port_and_a_port_out_of_range_is_named():
  assert hb.parse_address('127.0.0.1:7000') == ('127.0.0.1', 7000)
  assert hb.parse_address('[::1]:7000') == ('::1', 7000)
  with pytest.raises(ValueError, match='is not an address: expected host:port'):
    hb.parse_address('127.0.0.1')
  with pytest.raises(ValueError, match='port 99999 is out of range; give a port from 0 to 65535'):
    hb.parse_address('127.0.0.1:99999')


def test_a_node_name_that_resolves_to_loopback_is_listened_for_on_every_interface(monkeypatch):
  """Debian's /etc/hosts maps a node's own name to 127.0.1.1: a driver
  bound to it (launch/slurm_ft.sbatch binds the node's name) was
  unreachable from the other nodes' agents and trainers."""
  import socket as socket_lib
  real = socket_lib.getaddrinfo
  names = {'node7': '127.0.1.1', 'node8': '10.0.0.8'}

  def fake(host, *args, **kwargs):
    if host in names:
      return [(socket_lib.AF_INET, socket_lib.SOCK_STREAM, 6, '', (names[host], 0))]
    return real(host, *args, **kwargs)
  monkeypatch.setattr(socket_lib, 'getaddrinfo', fake)
  bind = lambda *flags: driver.parse_args(['--processes', '1', '--workdir', '/tmp/unused', *flags, '--',
                                           '--gin_file', 'tiny.gin']).bind
  assert bind('--executor', 'agent', '--bind', 'node7:7001') == '0.0.0.0:7001'
  assert bind('--executor', 'agent', '--bind', 'node8:7001') == 'node8:7001'
  assert bind('--executor', 'agent', '--bind', '127.0.0.1:7001') == '127.0.0.1:7001'   # an address: meant
  assert bind('--bind', 'node7:0') == 'node7:0'   # the local executor: every trainer on this machine
