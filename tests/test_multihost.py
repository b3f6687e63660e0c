"""Multi-process jobs: reading the job from the environment, the local
launcher, and a real 2-process run held to the 1-process run."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import socket
import tempfile
import threading
import time
import types

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import SingleDeviceSharding

from mjax import distributed as D
from mjax import launch
from mjax.metrics import read_metrics

PY = sys.executable
BIN = os.path.dirname(sys.executable)


# --- the environment -> JobSpec ------------------------------------------------

def test_nothing_set_is_one_process():
  assert D.resolve({}) == D.JobSpec('none')
  assert D.resolve({'PATH': '/bin', 'SLURM_JOB_ID': '7'}).source == 'none'  # salloc shell, no srun


def test_explicit():
  spec = D.resolve({'MJAX_COORDINATOR_ADDRESS': '10.0.0.1:1234', 'MJAX_NUM_PROCESSES': '4',
                    'MJAX_PROCESS_ID': '3', 'MJAX_LOCAL_DEVICE_COUNT': '2'})
  assert spec == D.JobSpec('explicit', 4, 3, '10.0.0.1:1234', None, 2)
  # One process needs no coordinator.
  assert D.resolve({'MJAX_NUM_PROCESSES': '1', 'MJAX_PROCESS_ID': '0'}).num_processes == 1


def test_explicit_wins_over_slurm_and_jobset():
  env = {'MJAX_COORDINATOR_ADDRESS': 'h:1', 'MJAX_NUM_PROCESSES': '2', 'MJAX_PROCESS_ID': '1',
         'SLURM_JOB_ID': '5', 'SLURM_PROCID': '0', 'SLURM_NTASKS': '8', 'JOB_COMPLETION_INDEX': '0'}
  assert D.resolve(env) == D.JobSpec('explicit', 2, 1, 'h:1')


@pytest.mark.parametrize('env, names', [
    ({'MJAX_COORDINATOR_ADDRESS': 'h:1', 'MJAX_NUM_PROCESSES': '2', 'MJAX_PROCESS_ID': '2'},
     ['MJAX_PROCESS_ID=2', 'MJAX_NUM_PROCESSES=2', '0 to 1']),
    ({'MJAX_COORDINATOR_ADDRESS': 'h:1', 'MJAX_NUM_PROCESSES': 'two', 'MJAX_PROCESS_ID': '0'},
     ["MJAX_NUM_PROCESSES='two'", 'not an integer']),
    ({'MJAX_COORDINATOR_ADDRESS': 'h:1', 'MJAX_NUM_PROCESSES': '0', 'MJAX_PROCESS_ID': '0'},
     ['MJAX_NUM_PROCESSES=0']),
    ({'MJAX_COORDINATOR_ADDRESS': 'h', 'MJAX_NUM_PROCESSES': '2', 'MJAX_PROCESS_ID': '0'},
     ["MJAX_COORDINATOR_ADDRESS='h'", 'host:port']),
    ({'MJAX_NUM_PROCESSES': '2', 'MJAX_PROCESS_ID': '0'}, ['MJAX_COORDINATOR_ADDRESS is not set']),
    ({'MJAX_COORDINATOR_ADDRESS': 'h:1', 'MJAX_PROCESS_ID': '0'}, ['MJAX_NUM_PROCESSES is not set']),
    ({'MJAX_COORDINATOR_ADDRESS': 'h:1', 'MJAX_NUM_PROCESSES': '2'}, ['MJAX_PROCESS_ID is not set']),
    ({'MJAX_COORDINATOR_ADDRESS': 'h:1'}, ['MJAX_NUM_PROCESSES and MJAX_PROCESS_ID are not']),
    ({'MJAX_NUM_PROCESSES': '1', 'MJAX_PROCESS_ID': '0', 'MJAX_LOCAL_DEVICE_COUNT': '-1'},
     ['MJAX_LOCAL_DEVICE_COUNT=-1']),
    ({'SLURM_JOB_ID': '9', 'SLURM_PROCID': '4', 'SLURM_NTASKS': '4', 'SLURM_JOB_NODELIST': 'n1'},
     ['SLURM_PROCID=4', 'SLURM_NTASKS=4']),
    ({'JOB_COMPLETION_INDEX': '0', 'JOBSET_NAME': 'run'}, ['MJAX_NUM_PROCESSES is not', 'manifest']),
    ({'JOB_COMPLETION_INDEX': '3', 'MJAX_NUM_PROCESSES': '2', 'JOBSET_NAME': 'run'},
     ['JOB_COMPLETION_INDEX=3', 'MJAX_NUM_PROCESSES=2']),
    ({'JOB_COMPLETION_INDEX': '0', 'MJAX_NUM_PROCESSES': '2'}, ['JOBSET_NAME']),
    ({**{'SLURM_JOB_ID': '9', 'SLURM_PROCID': '0', 'SLURM_NTASKS': '2', 'SLURM_JOB_NODELIST': 'n[1-2]'},
      'MJAX_COORDINATOR_PORT': '99999'}, ['MJAX_COORDINATOR_PORT=99999', '1-65535']),
    ({'JOB_COMPLETION_INDEX': '0', 'MJAX_NUM_PROCESSES': '2', 'JOBSET_NAME': 'run',
      'MJAX_COORDINATOR_PORT': '70000'}, ['MJAX_COORDINATOR_PORT=70000', 'at most 65535']),
])
def test_inconsistent_env_names_the_variable(env, names):
  with pytest.raises(D.DistributedError) as e:
    D.resolve(env)
  for name in names:
    assert name in str(e.value)


SLURM = {'SLURM_JOB_ID': '123456', 'SLURM_PROCID': '1', 'SLURM_NTASKS': '2', 'SLURM_LOCALID': '0',
         'SLURM_STEP_NODELIST': 'gpu[007-008]', 'SLURM_STEP_NUM_NODES': '2',
         'SLURM_JOB_NODELIST': 'gpu[007-008]'}


def test_slurm_one_task_per_node_sees_every_gpu():
  spec = D.resolve(SLURM)
  assert spec == D.JobSpec('slurm', 2, 1, f'gpu007:{123456 % 4096 + 61440}', None, None)


def test_slurm_several_tasks_per_node_get_one_gpu_each():
  spec = D.resolve({**SLURM, 'SLURM_NTASKS': '16', 'SLURM_PROCID': '11', 'SLURM_LOCALID': '3'})
  assert (spec.num_processes, spec.process_id, spec.local_device_ids) == (16, 11, (3,))


def test_slurm_port_and_address_overrides():
  assert D.resolve({**SLURM, 'MJAX_COORDINATOR_PORT': '4000'}).coordinator_address == 'gpu007:4000'
  assert D.resolve({**SLURM, 'MJAX_COORDINATOR_ADDRESS': 'ib0-gpu007:5'}).coordinator_address == 'ib0-gpu007:5'
  batch_only = {k: v for k, v in SLURM.items() if not k.startswith('SLURM_STEP')}
  assert D.resolve(batch_only).coordinator_address.startswith('gpu007:')


@pytest.mark.parametrize('nodelist', ['node001', 'node001,host2', 'node[001-0015],host2',
                                      'node[001,007-015],host2', 'a-b[09-12]'])
def test_slurm_coordinator_agrees_with_jax(nodelist, monkeypatch):
  """Same address as jax's own SLURM detector, so mixing the two never splits a job."""
  from jax._src.clusters.slurm_cluster import SlurmCluster
  monkeypatch.setenv('SLURM_STEP_NODELIST', nodelist)
  monkeypatch.setenv('SLURM_JOB_ID', '98765')
  ours = D.resolve({**SLURM, 'SLURM_JOB_ID': '98765', 'SLURM_STEP_NODELIST': nodelist})
  assert ours.coordinator_address == SlurmCluster.get_coordinator_address(None, None)


def test_first_slurm_host():
  # 'x[7]' too, where jax 0.10's parser keeps the bracket ('x7]').
  assert D.first_slurm_host('x[7]') == 'x7'
  assert D.first_slurm_host('gpu[003-010,12],cpu1') == 'gpu003'
  assert D.first_slurm_host('n-1,n-2') == 'n-1'


def test_jobset():
  env = {'JOB_COMPLETION_INDEX': '2', 'MJAX_NUM_PROCESSES': '4', 'JOBSET_NAME': 'mjax-run',
         'REPLICATED_JOB_NAME': 'workers', 'MJAX_LOCAL_DEVICE_COUNT': '1'}
  assert D.resolve(env) == D.JobSpec('jobset', 4, 2, 'mjax-run-workers-0-0.mjax-run:1234', None, 1)
  manifest = {**env, 'MJAX_COORDINATOR_ADDRESS': 'mjax-run-workers-0-0.mjax-run:8476'}
  assert D.resolve(manifest).coordinator_address == 'mjax-run-workers-0-0.mjax-run:8476'


def test_with_device_count_replaces_the_count():
  flags = '--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/x'
  assert D.with_device_count(flags, 4) == '--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=4'
  assert D.with_device_count('', 2) == '--xla_force_host_platform_device_count=2'


def test_initialize_after_backend_start_is_refused():
  jax.devices()  # the test process's backend is up, as after any JAX call
  one = D.initialize_from_env({})
  assert (one['source'], one['initialized'], D.init_seconds()) == ('none', False, 0.0)
  with pytest.raises(D.DistributedError, match='already started'):
    D.initialize_from_env({'MJAX_COORDINATOR_ADDRESS': '127.0.0.1:1', 'MJAX_NUM_PROCESSES': '2',
                           'MJAX_PROCESS_ID': '0'})
  with pytest.raises(D.DistributedError, match='MJAX_LOCAL_DEVICE_COUNT=3 came too late'):
    D.initialize_from_env({'MJAX_LOCAL_DEVICE_COUNT': '3'})


def test_peers_are_given_up_on_after_the_collective_timeout(monkeypatch):
  """jax's coordination service aborts the job when a peer stops beating;
  that is the outermost timeout of the hierarchy, after the driver's own."""
  seen = {}
  monkeypatch.setattr('mjax.devices.backend_started', lambda: False)
  monkeypatch.setattr(D, '_INIT_SECONDS', 0.0)    # restored afterwards: this job is pretend
  monkeypatch.setattr(jax.distributed, 'is_initialized', lambda: False)
  monkeypatch.setattr(jax.distributed, 'initialize', lambda **kw: seen.update(kw))
  monkeypatch.setattr(D, 'wait_for_coordinator', lambda spec, deadline: None)
  monkeypatch.setenv('JAX_CPU_COLLECTIVES_IMPLEMENTATION', 'gloo')   # leave jax's config alone
  env = {'MJAX_COORDINATOR_ADDRESS': '127.0.0.1:1', 'MJAX_NUM_PROCESSES': '2', 'MJAX_PROCESS_ID': '1'}
  out = D.initialize_from_env(env, peer_timeout_s=180.0)
  assert out['initialized'] and seen['heartbeat_timeout_seconds'] == 180
  assert seen['num_processes'] == 2 and seen['process_id'] == 1
  seen.clear()
  D.initialize_from_env(env)
  assert 'heartbeat_timeout_seconds' not in seen      # jax's default


def test_a_coordinator_that_does_not_answer_is_named_and_one_that_comes_late_is_joined(monkeypatch):
  monkeypatch.setattr(D, 'PROGRESS_S', 0.4)
  port = launch.free_port()
  spec = D.JobSpec('explicit', 2, 1, f'127.0.0.1:{port}')
  said = []
  with pytest.raises(D.Fault) as e:
    D.wait_for_coordinator(spec, time.monotonic() + 1.5, say=said.append)
  assert f'process 1 of 2 could not reach the coordinator at 127.0.0.1:{port}' in str(e.value)
  assert 'connection refused' in str(e.value) and 'MJAX_JOIN_TIMEOUT_S' in str(e.value)
  assert said and all(f'still waiting for the coordinator at 127.0.0.1:{port} (connection refused)' in s
                      for s in said)
  # Process 0 starting late: the wait ends as soon as the port answers.
  server = socket.socket()
  threading.Timer(0.8, lambda: (server.bind(('127.0.0.1', port)), server.listen())).start()
  try:
    t0 = time.monotonic()
    D.wait_for_coordinator(spec, t0 + 30, say=said.append)
    assert time.monotonic() - t0 < 10
  finally:
    server.close()


def test_a_job_that_does_not_form_and_a_taken_port_end_with_a_paragraph_and_status_1(repo_root, tmp_path):
  """jax would abort after its own deadline, blaming "another task" and
  naming no address; exit status 1 is a crash, which the driver restarts."""
  holder = socket.socket()
  holder.bind(('0.0.0.0', 0))
  holder.listen()
  taken = holder.getsockname()[1]
  try:
    for port, expect in ((launch.free_port(), 'the job did not form within'),
                         (taken, f'port {taken} cannot be listened on here')):
      env = {**os.environ, 'MJAX_COORDINATOR_ADDRESS': f'127.0.0.1:{port}', 'MJAX_NUM_PROCESSES': '2',
             'MJAX_PROCESS_ID': '0', 'MJAX_JOIN_TIMEOUT_S': '3'}
      proc = subprocess.run([os.path.join(BIN, 'mjax-train'), '--gin_file', 'configs/tiny.gin',
                             '--workdir', str(tmp_path / 'run')],
                            env=env, cwd=repo_root, capture_output=True, text=True, timeout=120)
      assert proc.returncode == 1, proc.stderr[-2000:]
      assert 'mjax-train: error: process 0 of 2' in proc.stderr and expect in proc.stderr, proc.stderr[-2000:]
      assert f'127.0.0.1:{port}' in proc.stderr and 'Traceback' not in proc.stderr
      assert 'Check failure' not in proc.stderr
  finally:
    holder.close()


def test_a_process_told_another_process_count_is_refused(repo_root, tmp_path):
  """jax's coordination service takes a process that was given 3 processes
  into the 2-process job its coordinator was given, silently: it trained as
  one of 2. It now stops with status 2 and names the two counts."""
  port = launch.free_port()
  procs = []
  try:
    for pid, count in ((0, 2), (1, 3)):
      env = {**os.environ, 'MJAX_COORDINATOR_ADDRESS': f'127.0.0.1:{port}', 'MJAX_NUM_PROCESSES': str(count),
             'MJAX_PROCESS_ID': str(pid), 'MJAX_LOCAL_DEVICE_COUNT': '1', 'MJAX_JOIN_TIMEOUT_S': '60'}
      procs.append(subprocess.Popen([os.path.join(BIN, 'mjax-train'), '--gin_file', 'configs/tiny.gin',
                                     '--workdir', str(tmp_path / 'run'), '--gin.TrainConfig.steps=2'],
                                    env=env, cwd=repo_root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True))
    _, err = procs[1].communicate(timeout=120)
    assert procs[1].returncode == 2, err[-2000:]
    assert ('process 1 was told the job has 3 processes (MJAX_NUM_PROCESSES), but the job that formed at the '
            f'coordinator 127.0.0.1:{port} has 2' in err), err[-2000:]
    assert 'Traceback' not in err
  finally:
    for p in procs:
      p.kill()
      p.communicate()


def test_a_bad_join_timeout_is_named():
  with pytest.raises(D.DistributedError, match=r"MJAX_JOIN_TIMEOUT_S='soon' is not a number of seconds"):
    D.initialize_from_env({'MJAX_COORDINATOR_ADDRESS': '127.0.0.1:1', 'MJAX_NUM_PROCESSES': '2',
                           'MJAX_PROCESS_ID': '1', 'MJAX_JOIN_TIMEOUT_S': 'soon'})


def test_a_platform_that_cannot_start_is_named(repo_root):
  # jax's RuntimeError (or, for a CUDA plugin without a GPU, an assertion
  # with no message) and its traceback, exit 1: now one paragraph, exit 2.
  env = {**os.environ, 'JAX_PLATFORMS': 'nosuchplatform'}
  proc = subprocess.run([os.path.join(BIN, 'mjax-train'), '--gin_file', 'configs/tiny.gin', '--print_config'],
                        env=env, cwd=repo_root, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "mjax-train: error: JAX_PLATFORMS='nosuchplatform': Unable to initialize backend" in proc.stderr
  assert 'unset JAX_PLATFORMS' in proc.stderr and 'Traceback' not in proc.stderr


def test_mjax_train_rejects_a_bad_env(repo_root):
  env = {**os.environ, 'MJAX_COORDINATOR_ADDRESS': '127.0.0.1:1', 'MJAX_NUM_PROCESSES': '2',
         'MJAX_PROCESS_ID': '2'}
  proc = subprocess.run([os.path.join(BIN, 'mjax-train'), '--gin_file', 'configs/tiny.gin'],
                        env=env, cwd=repo_root, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert 'mjax-train: error: MJAX_PROCESS_ID=2 is out of range for MJAX_NUM_PROCESSES=2' in proc.stderr


# --- the launcher ------------------------------------------------------------------

SHOW_ENV = ('import os; print(*(os.environ.get(k) for k in ("MJAX_PROCESS_ID", "MJAX_NUM_PROCESSES", '
            '"MJAX_COORDINATOR_ADDRESS", "XLA_FLAGS", "JAX_PLATFORMS", "MJAX_LAUNCH_TIME")), sep="|")')


def test_local_env():
  env = launch.local_env(1, 2, '127.0.0.1:5', 4, {'XLA_FLAGS': '--xla_force_host_platform_device_count=8'})
  assert env['MJAX_PROCESS_ID'] == '1' and env['MJAX_NUM_PROCESSES'] == '2'
  assert env['MJAX_LOCAL_DEVICE_COUNT'] == '4' and env['JAX_PLATFORMS'] == 'cpu'
  assert env['XLA_FLAGS'] == '--xla_force_host_platform_device_count=4'
  assert D.resolve(env) == D.JobSpec('explicit', 2, 1, '127.0.0.1:5', None, 4)
  real = launch.local_env(0, 2, 'h:1', None, {'XLA_FLAGS': '--xla_foo'})
  assert real['XLA_FLAGS'] == '--xla_foo' and 'JAX_PLATFORMS' not in real
  with pytest.raises(ValueError, match='out of range'):
    launch.local_env(2, 2, 'h:1')


def test_spawn_local_writes_one_log_per_process(tmp_path):
  procs = launch.spawn_local(2, 3, [PY, '-c', SHOW_ENV], workdir=str(tmp_path), port=4321)
  assert launch.wait_all(procs, timeout=60) == [0, 0]
  for i in range(2):
    pid, num, addr, flags, platforms, t = open(tmp_path / 'logs' / f'process-{i}.log').read().strip().split('|')
    assert (pid, num, addr, platforms) == (str(i), '2', '127.0.0.1:4321', 'cpu')
    assert flags.endswith('--xla_force_host_platform_device_count=3') and float(t) > 0


def test_spawn_local_prefixes_console_lines(capsys):
  procs = launch.spawn_local(2, None, [PY, '-c', SHOW_ENV])
  assert launch.wait_all(procs, timeout=60) == [0, 0]
  lines = sorted(capsys.readouterr().out.splitlines())
  assert [l[:5] for l in lines] == ['[0] 0', '[1] 1']


def test_wait_all_stops_the_others_when_one_fails():
  procs = launch.spawn_local(3, None, [PY, '-c', (
      'import os, sys, time\nif os.environ["MJAX_PROCESS_ID"] == "1": sys.exit(7)\ntime.sleep(60)')])
  assert launch.wait_all(procs, timeout=50) == [-9, 7, -9]


def test_wait_all_timeout_kills_everything():
  procs = launch.spawn_local(2, None, [PY, '-c', 'import time; time.sleep(60)'])
  assert launch.wait_all(procs, timeout=0.5) == [-9, -9]


def test_local_py_exits_with_the_failing_status(repo_root):
  cmd = [PY, 'launch/local.py', '--processes', '2', '--', PY, '-c',
         'import os, sys, time\nif os.environ["MJAX_PROCESS_ID"] == "0": sys.exit(5)\ntime.sleep(60)']
  proc = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 5, proc.stderr
  assert 'exit statuses [5, -9]' in proc.stderr


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='PR_SET_PDEATHSIG is Linux\'s')
@pytest.mark.parametrize('log_dir', [False, True])
def test_local_py_killed_outright_takes_its_processes_along(repo_root, tmp_path, log_dir):
  # launch/local.py SIGKILLed (the OOM killer) forwards nothing: its
  # processes, writing to --log_dir, ran on unsupervised as orphans.
  pids = tmp_path / 'pids'
  code = (f'import os, time\nopen({str(pids)!r} + os.environ["MJAX_PROCESS_ID"], "w").write(str(os.getpid()))\n'
          'time.sleep(120)')
  cmd = [PY, 'launch/local.py', '--processes', '2', *(['--log_dir', str(tmp_path)] if log_dir else []),
         '--', PY, '-c', code]
  proc = subprocess.Popen(cmd, cwd=repo_root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 60
    while not all(os.path.exists(f'{pids}{i}') and os.path.getsize(f'{pids}{i}') for i in (0, 1)) \
        and time.time() < deadline:
      time.sleep(0.1)
    children = [int(open(f'{pids}{i}').read()) for i in (0, 1)]
  except BaseException:   # the processes never said who they are: stop the launcher the polite way
    proc.terminate()
    proc.wait(30)
    raise
  proc.kill()
  proc.wait()
  deadline = time.time() + 10

  def running(pid):   # neither gone nor a zombie
    try:
      with open(f'/proc/{pid}/stat') as fh:
        return fh.read().split(')')[-1].split()[0] != 'Z'
    except OSError:
      return False

  alive = children
  while alive and time.time() < deadline:
    alive = [p for p in children if running(p)]
    time.sleep(0.1)
  for p in alive:   # none, unless the test fails
    try:
      os.kill(p, signal.SIGKILL)
    except ProcessLookupError:
      pass
  assert not alive, f'processes {alive} outlived launch/local.py'


def test_local_py_says_its_timeout_fired_and_exits_124(repo_root):
  # Before: 'exit statuses [-9, -9]' and 137, as if both had crashed.
  cmd = [PY, 'launch/local.py', '--processes', '2', '--timeout', '1', '--', PY, '-c', 'import time; time.sleep(60)']
  proc = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 124, proc.stderr
  assert '--timeout 1s reached: stopped every process still running (exit statuses [-9, -9])' in proc.stderr
  for bad in ('0', 'nan', '-5'):
    proc = subprocess.run([*cmd[:4], '--timeout', bad, '--', PY, '-c', 'pass'], cwd=repo_root,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f'--timeout {float(bad)}: give a finite number' in proc.stderr, proc.stderr
  # A port out of range was each process's error about MJAX_COORDINATOR_ADDRESS, a variable not set by hand.
  for bad in ('70000', '-5', '0'):
    proc = subprocess.run([*cmd[:4], '--port', bad, '--', PY, '-c', 'pass'], cwd=repo_root,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f'--port {bad}: a TCP port is 1 to 65535' in proc.stderr, proc.stderr


def test_local_py_names_a_command_or_log_dir_it_cannot_use(repo_root, tmp_path):
  # A missing program, one that is not executable, and a log directory that
  # cannot be made were tracebacks (FileNotFoundError, PermissionError) and
  # exit 1; when a later process failed to start, the earlier ones ran on.
  cases = [(['--', 'mjax-no-such-tool'], "the command 'mjax-no-such-tool' cannot be started: No such file"),
           (['--', str(tmp_path)], f"the command '{tmp_path}' cannot be started: Permission denied"),
           (['--log_dir', '/proc/no-such', '--', PY, '-c', 'pass'], "'/proc/no-such' cannot be made"),
           # A count below 1 is named with its value, which the message left out.
           (['--devices', '0', '--', PY, '-c', 'pass'], '--devices 0: give at least 1'),
           (['--processes', '-1', '--', PY, '-c', 'pass'], '--processes -1: give at least 1')]
  for args, says in cases:
    proc = subprocess.run([PY, 'launch/local.py', '--processes', '2', *args], cwd=repo_root,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and says in proc.stderr and 'Traceback' not in proc.stderr, proc.stderr


def _two_processes(repo_root, code: str) -> subprocess.CompletedProcess:
  """Python `code` as the two processes of a job on this machine (launch/local.py)."""
  return subprocess.run([PY, 'launch/local.py', '--processes', '2', '--', PY, '-c', code], cwd=repo_root,
                        capture_output=True, text=True, timeout=120)


def test_sigterm_after_joining_the_job_ends_start_up(repo_root):
  # jax's pre-emption service took SIGTERM over at jax.distributed.initialize
  # and only noted it: a pre-emption (scancel) in start-up was swallowed and
  # the job trained on. mjax-train's start-up handler leaves with 143.
  code = ('import os, signal, time\nfrom mjax import cli, distributed\n'
          'cli._exit_on_ctrl_c("mjax-train")\ndistributed.initialize_from_env()\n'
          'os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(20)\nprint("trained on", flush=True)\n')
  proc = _two_processes(repo_root, code)
  # (A process whose peer left first may be ended by jax instead: -6, status 134.)
  assert proc.returncode in (143, 134) and 'trained on' not in proc.stdout, (proc.stdout[-2000:], proc.stderr[-2000:])
  assert 'terminated (SIGTERM)' in proc.stdout, proc.stdout[-2000:]


def test_a_process_that_fails_leaves_the_job_at_once(repo_root):
  # A failed process waited at exit in jax's shutdown for the others (still
  # training, or here asleep) while its heartbeats went on: the driver saw
  # no exit, and after progress_timeout_s took the healthy process for hung.
  code = ('import time\nfrom mjax import cli, distributed\n@cli.entry_point("mjax-test")\n'
          'def main(argv=None):\n  distributed.initialize_from_env()\n  import jax\n'
          '  if jax.process_index() == 0:\n    raise RuntimeError("boom")\n  time.sleep(300)\nmain()\n')
  proc = _two_processes(repo_root, code)
  # The other process is stopped by the launcher (-9), or first by jax on
  # seeing its peer gone (-6), or, when its backend was still starting,
  # fails to reach the coordinator that left (1): either way the job ends
  # now, not in 300 s.
  assert proc.returncode == 1 and re.search(r'exit statuses \[1, (-9|-6|1)\]', proc.stderr), \
      (proc.stdout[-2000:], proc.stderr)
  assert 'RuntimeError: boom' in proc.stdout, proc.stdout[-2000:]


# --- a real job: 2 processes x 4 devices == 1 process x 8 devices -----------------------

STEPS = 4
# The 2-process runs below compile the same few train steps again and again
# (~5 s a process each time on 2 cores): they share a compilation cache, a
# restart's as a job's would (one entry per process, see
# test_a_warm_compilation_cache_serves_every_process).
CACHE = os.path.join(tempfile.gettempdir(), f'mjax-multihost-cache-{os.getpid()}')
TRAIN = ['--gin_file', 'configs/tiny.gin', '--gin.ModelConfig.d_model=128', '--gin.ModelConfig.n_layers=2',
         '--gin.ModelConfig.full_attention_every=0', '--gin.ModelConfig.sliding_window=16',
         '--gin.DataConfig.seq_len=64', '--gin.ModelConfig.dtype=float32', '--gin.MeshConfig.data=8',
         f'--gin.TrainConfig.steps={STEPS}', '--gin.OptimConfig.warmup_steps=1',
         '--gin.TrainConfig.eval_every=0', '--gin.TrainConfig.eval_batches=1',
         '--gin.TrainConfig.progress=False', f'--gin.TrainConfig.compilation_cache_dir={CACHE}']


@pytest.fixture(scope='module', autouse=True)
def _shared_cache():
  shutil.rmtree(CACHE, ignore_errors=True)   # a pid reused from an earlier session
  os.makedirs(CACHE)
  yield
  shutil.rmtree(CACHE, ignore_errors=True)


def _clean_env(**extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith(('MJAX_', 'SLURM_', 'JOB_COMPLETION'))}
  return {**env, 'JAX_PLATFORMS': 'cpu', **extra}


def _losses(workdir):
  rows = read_metrics(workdir)
  return [r['loss'] for r in rows if 'loss' in r]


def _final_state(workdir, directory=None):
  """The last checkpoint's train state on one local device: a checkpoint
  written by 2 processes names devices this process does not have, so the
  target layout is given instead of taken from the file."""
  path = os.path.join(directory or os.path.join(workdir, 'checkpoints'), str(STEPS), 'state')
  ck = ocp.StandardCheckpointer()
  meta = ck.metadata(path)
  meta = getattr(meta, 'item_metadata', meta)
  one = SingleDeviceSharding(jax.devices()[0])
  return ck.restore(path, jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), meta))


@pytest.fixture(scope='module')
def two_process_run(tmp_path_factory):
  """(directory, stdout) of one 2-process run of TRAIN, with a fast tier as
  well, which both processes must see (they do: one machine). Both tiers
  save steps 2 and 4: their multi-process barriers must not meet (Orbax
  names them by step). Shared: it is also the uninterrupted reference of
  the resumed runs below."""
  tmp = tmp_path_factory.mktemp('two')
  out = _train_two(tmp / 'multi', '--gin.CheckpointConfig.fast_every=2', '--gin.CheckpointConfig.save_every=2',
                   f'--gin.CheckpointConfig.fast_directory={tmp / "fast"}')
  return tmp, out


@pytest.mark.slow
def test_two_processes_match_one(two_process_run, tmp_path, repo_root):
  shared, stdout = two_process_run
  multi, single = str(shared / 'multi'), str(tmp_path / 'single')
  run = types.SimpleNamespace(stdout=stdout)
  # One job over 8 devices, reported once, by process 0.
  assert 'on 8 cpu device(s)' in run.stdout and '[1] mjax:' not in run.stdout
  startup = json.loads(next(l for l in run.stdout.splitlines() if 'mjax: startup' in l).split('startup ', 1)[1])
  assert startup['distributed_init_s'] > 0 and startup['launch_to_first_step_s'] > startup['run_to_first_step_s']
  assert startup['resumed_step'] == 0    # a fresh run; a restart reports the step it resumed from

  ref = subprocess.run([os.path.join(BIN, 'mjax-train'), *TRAIN, '--workdir', single,
                        f'--gin.OptimConfig.decay_steps={STEPS}'],
                       env=_clean_env(XLA_FLAGS='--xla_force_host_platform_device_count=8'),
                       cwd=repo_root, capture_output=True, text=True, timeout=300)
  assert ref.returncode == 0, ref.stderr[-3000:]

  # Same rows on the same 8 devices; only the gradient all-reduce differs
  # (gloo between processes, in-process otherwise), which reorders fp32 sums:
  # ~1e-7 relative. A host reading the wrong rows moves the loss by > 1e-3,
  # and a missing or doubled all-reduce moves the weights by about the
  # learning rate (3e-3 relative per step under LAMB); the tolerances sit
  # two orders of magnitude above rounding and below either.
  np.testing.assert_allclose(_losses(multi), _losses(single), rtol=1e-5)
  assert len(_losses(multi)) == STEPS
  # Every save of both tiers committed.
  for tier in (os.path.join(multi, 'checkpoints'), str(shared / 'fast')):
    assert {'2', '4'} <= set(os.listdir(tier)), (tier, os.listdir(tier))
  got, want = _final_state(multi), _final_state(single)
  # Both tiers saved the same final step, bit for bit.
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(_final_state(multi, str(shared / 'fast')))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert int(got['step']) == int(want['step']) == STEPS
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    x, y = np.asarray(x), np.asarray(y)
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4 * float(np.abs(y).max(initial=0)),
                               err_msg=jax.tree_util.keystr(path))

  # Generation from the 2-process checkpoint, by 2 processes x 4 devices
  # (the batch of 3 prompts padded to the 8-way data axis) and by one
  # process: the same greedy text.
  gen = ['--workdir', multi, '--prompt', 'def ', '--prompt', 'import', '--prompt', 'x = ', '--temperature', '0',
         '--max_new_tokens', '12', '--no-stop_at_eos', '--format', 'jsonl']
  two = subprocess.run([PY, 'launch/local.py', '--processes', '2', '--devices', '4', '--',
                        os.path.join(BIN, 'mjax-generate'), *gen], env=_clean_env(), cwd=repo_root,
                       capture_output=True, text=True, timeout=300)
  assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
  one = subprocess.run([os.path.join(BIN, 'mjax-generate'), *gen],
                       env=_clean_env(XLA_FLAGS='--xla_force_host_platform_device_count=8'),
                       cwd=repo_root, capture_output=True, text=True, timeout=300)
  assert one.returncode == 0, one.stderr[-3000:]
  rows = [json.loads(line[4:]) for line in two.stdout.splitlines() if line.startswith('[0] {')]
  assert not any(line.startswith('[1] {') for line in two.stdout.splitlines())   # process 0 prints
  assert [r['completion'] for r in rows] == [json.loads(line)['completion'] for line in one.stdout.splitlines()]
  assert len(rows) == 3 and all(r['tokens'] == 12 for r in rows)


def test_a_checkpoint_tier_some_process_cannot_see_is_refused(tmp_path, repo_root):
  """A fast tier declared shared (the default fast_scope) that is not (here:
  one directory per process) would never commit a save; it is refused
  before training starts, and the message names the host-local scope."""
  fast = tmp_path / 'fast' / '$MJAX_PROCESS_ID'
  cmd = [PY, 'launch/local.py', '--processes', '2', '--devices', '4', '--',
         os.path.join(BIN, 'mjax-train'), *TRAIN, '--workdir', str(tmp_path / 'run'),
         '--gin.CheckpointConfig.fast_every=2', f'--gin.CheckpointConfig.fast_directory={fast}']
  run = subprocess.run(cmd, env=_clean_env(), cwd=repo_root, capture_output=True, text=True, timeout=300)
  out = run.stdout + run.stderr
  assert run.returncode == 2, out[-3000:]
  assert 'not shared by every process: process(es) [1] of 2' in out, out[-3000:]
  assert f"fast_directory = '{tmp_path / 'fast' / '0'}'" in out and 'fast_every = 0' in out
  assert "fast_scope = 'host'" in out
  assert 'Traceback' not in out
  assert not (tmp_path / 'run' / 'checkpoints').exists() or \
      not [n for n in os.listdir(tmp_path / 'run' / 'checkpoints') if n.isdigit()]


@pytest.mark.slow
def test_a_warm_compilation_cache_serves_every_process(tmp_path, repo_root):
  """On CPU jax keys the cached step by each process's devices and writes
  from process 0 only; mjax has every process write its own entry, so a
  restarted job loads the step everywhere instead of recompiling it in every
  process but the first."""
  cache = tmp_path / 'cache'
  entries = lambda: {n: os.stat(cache / n).st_mtime_ns for n in os.listdir(cache) if n.startswith('jit_train_step')}
  for run_dir in ('cold', 'warm'):
    cmd = [PY, 'launch/local.py', '--processes', '2', '--devices', '4', '--',
           os.path.join(BIN, 'mjax-train'), *TRAIN, '--workdir', str(tmp_path / run_dir),
           '--gin.TrainConfig.steps=2', f'--gin.TrainConfig.compilation_cache_dir={cache}',
           '--gin.CheckpointConfig.enabled=False']
    run = subprocess.run(cmd, env=_clean_env(), cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    if run_dir == 'cold':   # one entry per process: each is keyed by its own devices
      cold = entries()
      assert len(cold) == 2, os.listdir(cache)
  # Warm, no process compiles: a process that missed the cache would have
  # compiled and written an entry of its own. (Not timed: a loaded machine
  # can make a cache load as slow as a small model's compile.)
  assert entries() == cold, (cold, entries())


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_after_the_same_step(tmp_path, repo_root):
  """A signal reaches one process of two: both stop after the same step (the
  agreement goes through the coordination service, with no call per step),
  save it, and exit 0."""
  import signal
  import time
  workdir = str(tmp_path / 'run')
  env = _clean_env(MJAX_FAULT='delay:seconds=0.3')   # room to act before the end
  procs = launch.spawn_local(2, 4, [os.path.join(BIN, 'mjax-train'), *TRAIN, '--workdir', workdir,
                                    '--gin.TrainConfig.steps=40'], workdir=workdir, env=env)
  try:
    metrics = os.path.join(workdir, 'metrics.jsonl')
    deadline = time.time() + 240
    while not (os.path.exists(metrics) and len(read_metrics(workdir)) >= 3):
      assert time.time() < deadline and all(p.poll() is None for p in procs)
      time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    assert launch.wait_all(procs, timeout=120) == [0, 0]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  logs = [open(os.path.join(workdir, 'logs', f'process-{i}.log')).read() for i in range(2)]
  assert 'another process of the job was asked to stop' in logs[0], logs[0][-2000:]   # process 1 was
  saved = [int(n) for n in os.listdir(os.path.join(workdir, 'checkpoints')) if n.isdigit()]
  stop = max(saved)
  assert 3 <= stop < 40 and f'after step {stop}: checkpoint saved' in logs[0], (saved, logs[0][-2000:])
  assert max(r['step'] for r in read_metrics(workdir)) == stop


def test_the_stop_reason_travels_with_the_agreed_step():
  """Whichever process proposes the stop, all stop for its reason: a lost
  driver makes every process exit with status 4, not only the first to notice."""
  from mjax.stop import StopAgreement
  s = StopAgreement()
  assert s._parse('12 driver_lost') == 12 and s.driver_lost and 'fault-tolerance driver' in s.name
  s = StopAgreement()
  assert s._parse('7 SIGTERM') == 7 and not s.driver_lost and s.name.endswith('(SIGTERM)')
  assert StopAgreement()._parse('done') is None


def test_the_stop_watch_waits_once_however_long_the_run(monkeypatch):
  """A wait for the stop key that times out stays pending in the coordination
  service until the key is set (~14 KB there, ~20 KB in the waiting process):
  the watcher waited 10 s again and again, growing every process by 170 MB
  a day, and process 0 by that much for each process of the job. It waits
  once, as long as the service takes, and the key written on the way out
  wakes it."""
  from mjax import stop
  calls, values, written = [], {}, threading.Event()

  class Client:
    def blocking_key_value_get(self, key, timeout_ms):
      calls.append(timeout_ms)
      if timeout_ms < 24 * 3600 * 1000:   # a wait that ends long before the run: over at once here
        raise jax.errors.JaxRuntimeError('DEADLINE_EXCEEDED: timed out')
      written.wait()
      return values[key]

    def key_value_set(self, key, value):
      values[key] = value
      written.set()
  monkeypatch.setattr(D, 'coordination_client', Client)
  monkeypatch.setattr(stop.jax, 'process_count', lambda: 2)
  with stop.StopAgreement() as s:
    time.sleep(0.5)
    assert len(calls) == 1, len(calls)
  assert not s._watcher.is_alive() and not s.stopped and values == {s.KEY: s.DONE}


# --- single-replica restore: 2 processes, data = 2 across them -----------------------

def test_one_replica_reads_the_state_and_the_other_receives_it_bit_for_bit(tmp_path, repo_root):
  """MeshConfig.data = 2 over 2 processes x 4 devices (fsdp = 4 inside each):
  process 0 holds replica 0 and reads the whole state, process 1 reads none
  of it and receives it over the collective. The state (with a -0.0 in every
  float array) comes back bit for bit in both modes; a truncated newest step
  sends both processes back to the older one, with no hang."""
  sys.path.insert(0, os.path.join(repo_root, 'bench'))
  try:
    import restore_bench
  finally:
    sys.path.remove(os.path.join(repo_root, 'bench'))
  rows = restore_bench.run_layout('2x4:2x4', ['--gin_file=tiny.gin', *(f'--gin_param={b}' for b in (
      'ModelConfig.d_model = 128', 'ModelConfig.n_layers = 2', 'ModelConfig.d_ff = 256'))], timeout=240,
      damage=True)
  disk = rows[0]['state_disk_bytes']
  assert [r['reading_replica'] for r in rows] == [True, False] and all(r['replica_plan'] for r in rows)
  for r in rows:
    assert r['modes_bitwise_equal'], r
    for mode in ('every', 'single'):
      assert r['modes'][mode]['step'] == 2 and r['modes'][mode]['bitwise_saved'], (mode, r)
    # Every replica reads its whole copy (the state's files, give or take
    # their metadata)...
    assert 0.95 * disk < r['modes']['every']['rchar'] < 1.1 * disk, (r, disk)
    # ...or only the first replica does; the second reads a few small files
    # (step listings), none of the arrays.
    assert r['damaged'] == {**r['damaged'], 'step': 1, 'bitwise_saved': True}, r
  assert 0.95 * disk < rows[0]['modes']['single']['rchar'] < 1.1 * disk, rows[0]
  assert rows[1]['modes']['single']['rchar'] < 0.01 * disk, rows[1]


@pytest.mark.slow
def test_gradient_clipping_turned_off_on_a_resume_that_one_replica_reads(tmp_path):
  """The same arrays in the other clipping setting's layout, read again by
  every process: only the reading replica's first read fails (the other
  reads no arrays), and a second read by it alone waited in Orbax's barrier
  for the other process, which waited for it in the agreement: a hang."""
  layout = ['--gin.MeshConfig.data=2', '--gin.MeshConfig.fsdp=4']
  _train_two(tmp_path / 'run', *layout, steps=2)
  out = _train_two(tmp_path / 'run', *layout, '--gin.OptimConfig.clip_norm=0.0', steps=3)
  assert f'resumed from {tmp_path / "run" / "checkpoints" / "2"} (step 2)' in out, out[-3000:]
  losses = _losses(tmp_path / 'run')
  assert len(losses) == 3 and np.isfinite(losses).all(), losses


# --- a host-local fast tier: 2 processes, one fast directory each ----------------------

def _train_two(workdir, *extra, steps=STEPS):
  cmd = [PY, 'launch/local.py', '--processes', '2', '--devices', '4', '--', os.path.join(BIN, 'mjax-train'),
         *TRAIN, '--workdir', str(workdir), f'--gin.TrainConfig.steps={steps}', f'--gin.OptimConfig.decay_steps={STEPS}',
         *extra]
  run = subprocess.run(cmd, env=_clean_env(), cwd=os.path.dirname(os.path.dirname(__file__)),
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  return run.stdout


@pytest.mark.slow
def test_a_shared_checkpoint_disk_that_fills_ends_the_job_with_the_message(tmp_path):
  # A 12 MB filesystem holds one checkpoint of this state (~8 MB) and not
  # two. When one process's part of step 4 found it full and the other's
  # did not, the two processes waited for each other in different Orbax
  # barriers for io_timeout_s (30 minutes), saying nothing. Now the job
  # ends in seconds with one message (exit 2: bad input, not restarted),
  # and step 2 stays committed. (Which processes fail depends on the order
  # of their writes: any, one or both; either way the same message.)
  fs = tmp_path / 'fs'
  fs.mkdir()
  if subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=12m', 'tmpfs', str(fs)], capture_output=True).returncode:
    pytest.skip('mounting a tmpfs needs root')
  try:
    cmd = [PY, 'launch/local.py', '--processes', '2', '--devices', '4', '--', os.path.join(BIN, 'mjax-train'),
           *TRAIN, '--workdir', str(tmp_path / 'run'), '--gin.TrainConfig.steps=6',
           '--gin.CheckpointConfig.save_every=2', f'--gin.CheckpointConfig.directory={fs / "ck"}']
    run = subprocess.run(cmd, env=_clean_env(), cwd=os.path.dirname(os.path.dirname(__file__)),
                         capture_output=True, text=True, timeout=240)
    kept = sorted(os.listdir(fs / 'ck'))
  finally:
    subprocess.run(['umount', str(fs)], capture_output=True)
  out = run.stdout + run.stderr
  assert run.returncode == 2, out[-3000:]
  said = re.findall(r'^\[(\d)\] mjax-train: error: (.*)$', run.stdout, re.M)
  assert said, out[-3000:]
  for _, message in said:
    # Step 4's save, said by the watch of a process that failed alone, or
    # by the main thread at the next save (6, "or the one before it").
    assert re.match(re.escape(f'the persistent checkpoint tier ({fs / "ck"}) is full: a save (step ') + '[46],',
                    message) and 'saved steps: 2)' in message, message
  assert '2' in kept and 'Traceback' not in run.stdout, (kept, out[-3000:])


def _steps(directory):
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


@pytest.mark.slow
def test_a_host_local_fast_tier_resumes_bitwise_and_falls_back_when_one_copy_is_missing(two_process_run, tmp_path):
  """fast_scope = 'host' with a directory per process that the other cannot
  see (each host's /dev/shm): (a) the newest step, kept only there, resumes
  bitwise equal to an uninterrupted run; (b) with one process's copy of the
  newest step gone, both processes agree on the persistent tier's older
  step, without a hang, and end bitwise equal as well."""
  reference = two_process_run[0] / 'multi'
  workdir, fast = tmp_path / 'run', tmp_path / 'fast'
  host = ['--gin.CheckpointConfig.save_every=1', '--gin.CheckpointConfig.fast_every=1',
          f'--gin.CheckpointConfig.fast_directory={fast / "$MJAX_PROCESS_ID"}',
          "--gin.CheckpointConfig.fast_scope='host'"]
  _train_two(workdir, *host, steps=2)
  copies = [fast / str(i) / f'process-{i}' for i in range(2)]
  assert [_steps(c) for c in copies] == [[1, 2], [1, 2]]
  # (a) The persistent copy of step 2 lost: the host-local copies are newest.
  shutil.rmtree(workdir / 'checkpoints' / '2')
  out = _train_two(workdir, *host)
  assert f'resumed from {copies[0] / "2"} (step 2)' in out, out[-3000:]
  assert _losses(workdir)[-2:] == _losses(reference)[-2:]
  for x, y in zip(jax.tree.leaves(_final_state(str(workdir))), jax.tree.leaves(_final_state(str(reference)))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # (b) Step 4 only in process 0's host memory (process 1's copy lost, the
  # persistent one too): both take the persistent step 3.
  assert _steps(workdir / 'checkpoints') == [1, 3, 4] and [_steps(c)[-1] for c in copies] == [4, 4]
  shutil.rmtree(workdir / 'checkpoints' / '4')
  shutil.rmtree(copies[1] / '4')
  out = _train_two(workdir, *host)
  assert f'resumed from {workdir / "checkpoints" / "3"} (step 3)' in out, out[-3000:]
  assert 4 not in _steps(copies[0]) or _steps(copies[0])[-1] == 4   # dropped, then saved afresh
  for x, y in zip(jax.tree.leaves(_final_state(str(workdir))), jax.tree.leaves(_final_state(str(reference)))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_tensor_and_pipeline_groups_across_processes_read_their_rows_once_per_group(two_process_run, tmp_path):
  """Tensor 4 in each process of 4 devices, the 2 pipeline stages across the
  processes (MeshConfig.dcn_pipeline, the slow network): every device holds
  every row of the batch (it is split over data x fsdp only), so both
  processes feed the whole batch, the same rows. Before, each read half and
  the first batch failed ("the process data has 4 elements. Process
  addresses 8"), and a dcn_* mesh off TPUs failed to build ("Number of
  slices 1 must equal the product of dcn_mesh_shape"). Same rows as the
  data-parallel run: the same losses, up to the order of the sums."""
  out = _train_two(tmp_path / 'tp', '--gin.MeshConfig.data=1', '--gin.MeshConfig.tensor=4',
                   '--gin.MeshConfig.dcn_pipeline=2')
  assert "mesh {'data': 1, 'fsdp': 1, 'tensor': 4, 'pipeline': 2}" in out, out[-2000:]
  np.testing.assert_allclose(_losses(tmp_path / 'tp'), _losses(two_process_run[0] / 'multi'), rtol=1e-4)


@pytest.mark.slow
def test_fsdp_across_processes_gathered_once_a_step(two_process_run, tmp_path):
  """FSDP x tensor with the fsdp axis across the processes (MeshConfig.dcn_fsdp,
  the slow network it is for) and the weights gathered once a step
  (MeshConfig.fsdp_gather = 'step') over 2 accumulation slices: the gathers
  and reduce-scatters run between processes. Same rows as the data-parallel
  run: the same losses, up to the order of the sums."""
  out = _train_two(tmp_path / 'hsdp', '--gin.MeshConfig.data=1', '--gin.MeshConfig.fsdp=2',
                   '--gin.MeshConfig.tensor=2', '--gin.MeshConfig.dcn_fsdp=2', "--gin.MeshConfig.fsdp_gather='step'",
                   '--gin.TrainConfig.grad_accum_steps=2')
  assert "mesh {'data': 1, 'fsdp': 4, 'tensor': 2, 'pipeline': 1}" in out, out[-2000:]
  np.testing.assert_allclose(_losses(tmp_path / 'hsdp'), _losses(two_process_run[0] / 'multi'), rtol=1e-4)


def test_the_coordinator_raises_its_open_files_limit_for_the_job():
  """Process 0 hosts jax's coordination service, one connection per process:
  a soft limit of 1,024 open files held a job of a few hundred hosts."""
  import resource
  before = resource.getrlimit(resource.RLIMIT_NOFILE)
  try:
    hard = before[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    D.raise_open_files_limit(2048)
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == (2048 if hard == resource.RLIM_INFINITY else min(2048, hard))
    D.raise_open_files_limit(100)     # never lowered
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= min(2048, hard)
  finally:
    resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_one_sigterm_delivered_twice_is_one_stop(monkeypatch):
  """SLURM signals every process of a step and mjax-agent passes its own
  on; a JobSet's teardown reaches a trainer through its agent and its
  driver. A second SIGTERM within StopAgreement.REPEAT_S is the same stop
  (before, it cut the save); a later one, or a second Ctrl-C, still cuts."""
  import signal
  from mjax.stop import StopAgreement
  cut = []
  old = signal.signal(signal.SIGTERM, lambda *a: cut.append('SIGTERM'))
  try:
    stop = StopAgreement()
    with stop:
      signal.raise_signal(signal.SIGTERM)
      signal.raise_signal(signal.SIGTERM)
      assert stop.signal == signal.SIGTERM and cut == []
    monkeypatch.setattr(StopAgreement, 'REPEAT_S', 0.0)
    stop = StopAgreement()
    with stop:
      signal.raise_signal(signal.SIGTERM)
      signal.raise_signal(signal.SIGTERM)   # the handler before it: what the default would do, killing
    assert cut == ['SIGTERM']
  finally:
    signal.signal(signal.SIGTERM, old)


def test_a_run_started_by_hand_is_no_attempt_of_a_job_whatever_its_environment(monkeypatch):
  """MJAX_JOB_SECRET exported (as for starting agents) in a shell that then
  starts mjax-train by hand: its run lock named the job, and mjax-launch's
  trainers on that workdir took it for their own earlier attempt and
  trained beside it."""
  from mjax import protocol
  from mjax.checkpoint import locks
  monkeypatch.setenv(protocol.SECRET_ENV, 'ab' * 32)
  monkeypatch.delenv(protocol.DRIVER_ADDRESS_ENV, raising=False)
  assert locks._job_tag() is None
  monkeypatch.setenv(protocol.DRIVER_ADDRESS_ENV, '127.0.0.1:1')
  assert locks._job_tag() == locks._job_tag() is not None
