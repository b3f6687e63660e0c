"""launch/slurm.sbatch on a real SLURM cluster: two nodes on this machine.

Debian's SLURM 22.05 (installed here with apt when missing) runs one
`slurmctld` and two `slurmd`s, node1 and node2, both at 127.0.0.1 on their
own ports, with `munged` on a private socket. The node names resolve inside a
private mount namespace (`unshare -m`) whose /etc/hosts maps them, so the
machine's own file is never edited; the daemons, and the jobs they start,
live in that namespace. Everything is under the test's temporary directory
and is stopped at the end.

What is checked, as a user would see it:
  1. `sbatch launch/slurm.sbatch` with 2 nodes runs one JAX job of two
     processes (each prints its join line; process 0 reports a mesh of 2
     devices over 2 processes) that trains to the last step.
  2. `scancel` of a running job: mjax-train saves a checkpoint on SIGTERM;
     the same command submitted again resumes from it and finishes.
  3. launch/slurm_ft.sbatch, the fault-tolerance driver on the first node
     and one mjax-agent per node (srun), and again with MJAX_EXECUTOR=slurm
     (each trainer a job step): a task killed with SIGKILL is detected, and
     a new attempt resumes from the last checkpoint and finishes.

Skipped, with the reason, where it cannot run: not root, or no apt to
install SLURM, or the packages cannot be installed.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ('slurmctld', 'slurmd', 'slurm-client', 'munge')
TRAIN = ['--gin_file', 'configs/tiny.gin', '--gin.ModelConfig.d_model=128', '--gin.ModelConfig.d_ff=256',
         '--gin.DataConfig.seq_len=64', '--gin.TrainConfig.global_batch_size=8', '--gin.TrainConfig.eval_every=0',
         '--gin.CheckpointConfig.save_every=5']

pytestmark = pytest.mark.slow


def _install() -> None:
  """SLURM and munge from Debian's packages, unless already there."""
  if os.geteuid() != 0:
    pytest.skip('a real SLURM cluster needs root (daemons, a private mount namespace)')
  if all(shutil.which(b) for b in ('slurmctld', 'slurmd', 'sbatch', 'munged')):
    return
  if not shutil.which('apt-get'):
    pytest.skip('SLURM is not installed and there is no apt-get to install it')
  env = {**os.environ, 'DEBIAN_FRONTEND': 'noninteractive'}
  r = subprocess.run(['apt-get', 'install', '-y', '-q', '--no-install-recommends', *PACKAGES],
                     capture_output=True, text=True, env=env, timeout=600)
  if r.returncode:
    subprocess.run(['apt-get', 'update', '-q'], capture_output=True, env=env, timeout=600)
    r = subprocess.run(['apt-get', 'install', '-y', '-q', '--no-install-recommends', *PACKAGES],
                       capture_output=True, text=True, env=env, timeout=600)
  if r.returncode:
    pytest.skip(f'apt-get could not install {" ".join(PACKAGES)}: {r.stderr.strip()[-300:]}')


def _free_ports(n: int) -> list[int]:
  socks = [socket.socket() for _ in range(n)]
  for s in socks:
    s.bind(('127.0.0.1', 0))
  ports = [s.getsockname()[1] for s in socks]
  for s in socks:
    s.close()
  return ports


CONF = """\
ClusterName=mjaxci
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={slurmd}
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SwitchType=switch/none
KillWait=30
NodeName=node1 NodeAddr=127.0.0.1 Port={n1} CPUs={cpus} RealMemory=2000 State=UNKNOWN
NodeName=node2 NodeAddr=127.0.0.1 Port={n2} CPUs={cpus} RealMemory=2000 State=UNKNOWN
PartitionName=ci Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""

UP = """\
set -e
mount --bind {d}/hosts /etc/hosts
export SLURM_CONF={d}/slurm.conf
munged --force --socket={d}/munge.sock --key-file={d}/munge.key --log-file={d}/munged.log \\
  --pid-file={d}/munged.pid --seed-file={d}/munged.seed
slurmctld -i
slurmd -N node1
slurmd -N node2
exec sleep infinity
"""


@pytest.fixture(scope='module')
def cluster(tmp_path_factory):
  """(environment for SLURM's commands, directory) of a running 2-node cluster."""
  _install()
  d = str(tmp_path_factory.mktemp('slurm'))
  for sub in ('state', 'spool'):
    os.makedirs(os.path.join(d, sub))
  with open(os.path.join(d, 'munge.key'), 'wb') as fh:
    fh.write(os.urandom(1024))
  os.chmod(os.path.join(d, 'munge.key'), 0o600)
  ctld, slurmd, n1, n2 = _free_ports(4)
  with open(os.path.join(d, 'slurm.conf'), 'w') as fh:
    fh.write(CONF.format(d=d, ctld=ctld, slurmd=slurmd, n1=n1, n2=n2, cpus=os.cpu_count() or 1))
  with open(os.path.join(d, 'hosts'), 'w') as fh:
    # The machine's own name too: gloo (JAX's CPU collectives) resolves it.
    fh.write(f'127.0.0.1 localhost\n127.0.0.1 node1\n127.0.0.1 node2\n127.0.0.1 {socket.gethostname()}\n')
  with open(os.path.join(d, 'up.sh'), 'w') as fh:
    fh.write(UP.format(d=d))
  holder = subprocess.Popen(['unshare', '-m', '--propagation', 'private', 'bash', os.path.join(d, 'up.sh')],
                            stdout=open(os.path.join(d, 'up.log'), 'w'), stderr=subprocess.STDOUT,
                            start_new_session=True)
  env = {**os.environ, 'SLURM_CONF': os.path.join(d, 'slurm.conf'), 'JAX_PLATFORMS': 'cpu'}
  env.pop('XLA_FLAGS', None)   # one CPU device per task, as on a real CPU node
  try:
    deadline = time.monotonic() + 60
    while True:
      out = subprocess.run(['sinfo', '-h', '-o', '%T %D'], capture_output=True, text=True, env=env).stdout
      if out.strip() == 'idle 2':
        break
      if holder.poll() is not None or time.monotonic() > deadline:
        log = open(os.path.join(d, 'up.log')).read()
        if 'unshare' in log and ('Operation not permitted' in log or 'cannot' in log):
          pytest.skip(f'no private mount namespace here (unshare -m): {log.strip()[-200:]}')
        raise AssertionError(f'the cluster did not come up: sinfo {out!r}; {log[-1000:]}')
      time.sleep(0.5)
    yield env, d
  finally:
    subprocess.run(['scancel', '--full', '-u', 'root'], env=env, capture_output=True)
    for name in ('slurmd-node1.pid', 'slurmd-node2.pid', 'slurmctld.pid', 'munged.pid'):
      try:
        with open(os.path.join(d, name)) as fh:
          os.kill(int(fh.read().strip()), signal.SIGTERM)
      except (OSError, ValueError):
        pass
    os.killpg(holder.pid, signal.SIGTERM)
    holder.wait(timeout=30)


def _submit(env, d, *args, extra_env=None, script='slurm.sbatch') -> int:
  out = subprocess.run(['sbatch', '--parsable', f'--chdir={REPO}', f'--output={d}/job-%j.out',
                        os.path.join(REPO, 'launch', script), *args],
                       capture_output=True, text=True, env={**env, **(extra_env or {})}, timeout=60)
  assert out.returncode == 0, out.stderr
  return int(out.stdout.strip().split(';')[0])


def _state(env, job: int) -> str:
  out = subprocess.run(['scontrol', 'show', 'job', str(job)], capture_output=True, text=True, env=env).stdout
  m = re.search(r'JobState=(\w+)', out)
  return m.group(1) if m else 'GONE'


def _wait(env, d, job: int, timeout: float = 300) -> str:
  deadline = time.monotonic() + timeout
  while _state(env, job) in ('PENDING', 'RUNNING', 'CONFIGURING', 'COMPLETING'):
    assert time.monotonic() < deadline, f'job {job} still {_state(env, job)}:\n{_log(d, job)[-3000:]}'
    time.sleep(1)
  return _state(env, job)


def _log(d, job: int) -> str:
  try:
    with open(os.path.join(d, f'job-{job}.out')) as fh:
      return fh.read()
  except OSError:
    return ''


def test_scancel_saves_and_a_resubmission_resumes_to_the_end(cluster, tmp_path):
  env, d = cluster
  workdir = str(tmp_path / 'run')
  args = (*TRAIN, '--workdir', workdir, '--gin.TrainConfig.steps=40')
  # Slow steps (0.5 s each) leave time to cancel the job in the middle.
  job = _submit(env, d, *args, extra_env={'MJAX_FAULT': 'delay:seconds=0.5'})
  deadline = time.monotonic() + 240
  while not os.path.isdir(os.path.join(workdir, 'checkpoints', '5')):
    assert _state(env, job) in ('PENDING', 'RUNNING', 'CONFIGURING'), _log(d, job)[-3000:]
    assert time.monotonic() < deadline, _log(d, job)[-3000:]
    time.sleep(0.5)
  subprocess.run(['scancel', str(job)], env=env, check=True)
  _wait(env, d, job)
  log = _log(d, job)
  saved = sorted(int(s) for s in os.listdir(os.path.join(workdir, 'checkpoints')) if s.isdigit())
  assert saved and saved[-1] < 40, (saved, log[-2000:])
  # Saved on SIGTERM: the last step reached, not only the last multiple of 5.
  assert re.search(r'received SIGTERM', log), log[-2000:]
  again = _submit(env, d, *args)
  assert _wait(env, d, again) == 'COMPLETED', _log(d, again)[-3000:]
  resumed = _log(d, again)
  assert re.search(rf'0: mjax: resumed from \S+ \(step {saved[-1]}\)', resumed), resumed[-2000:]
  assert os.path.isdir(os.path.join(workdir, 'checkpoints', '40'))
  # The resubmission is one two-process job run to the end, as sbatch starts it.
  assert 'mjax: coordinator node1' in resumed
  assert re.search(r'^0: mjax: joining node1:\d+ as process 0/2', resumed, re.M), resumed[-2000:]
  assert re.search(r'^1: mjax: joining node1:\d+ as process 1/2', resumed, re.M), resumed[-2000:]
  assert "mesh {'data': 2, 'fsdp': 1, 'tensor': 1, 'pipeline': 1} on 2 cpu device(s)" in resumed
  assert '0: mjax: done.' in resumed


@pytest.mark.parametrize('executor', ['agent', 'slurm'])
def test_fault_tolerance_driver_recovers_a_killed_task(cluster, tmp_path, executor):
  env, d = cluster
  workdir = str(tmp_path / 'run')
  job = _submit(env, d, '--workdir', workdir, '--diagnose_args=--checks memory', '--', *TRAIN,
                '--gin.TrainConfig.steps=20', '--gin.FaultConfig.restart_backoff_s=0.2', script='slurm_ft.sbatch',
                extra_env={'MJAX_FAULT': 'kill:step=12:process=1',   # SIGKILL, first attempt only
                           'MJAX_EXECUTOR': executor})
  assert _wait(env, d, job, timeout=400) == 'COMPLETED', _log(d, job)[-3000:]
  with open(os.path.join(workdir, 'events.jsonl')) as fh:
    events = [json.loads(line) for line in fh]
  kinds = [e['event'] for e in events]
  launches = [e for e in events if e['event'] == 'launch']
  assert len(launches) == 2, kinds
  assert launches[0]['hosts'] == ['node1', 'node2'] and launches[0]['coordinator'].startswith('node1:')
  if executor == 'agent':   # one mjax-agent per node (srun --ntasks-per-node=1), connected before the launch
    assert sorted(e['host'] for e in events if e['event'] == 'agent_connected')[:2] == ['node1', 'node2'], kinds
    assert kinds.index('agent_connected') < kinds.index('launch')
  else:                     # each trainer a job step of its own
    assert 'agent_connected' not in kinds
  faults = [e for e in events if e['event'] == 'fault']
  assert faults and 1 in faults[0]['processes'], faults
  assert kinds[-1] == 'finish', kinds
  restart = next(e for e in events if e['event'] == 'restart')
  assert restart['fault'] == 'exit' and 0 < restart['checkpoint_step'] < 12, restart
  with open(os.path.join(workdir, 'logs', 'process-0.log')) as fh:
    assert re.search(rf'mjax: resumed from \S+ \(step {restart["checkpoint_step"]}\)', fh.read())
  assert os.path.isdir(os.path.join(workdir, 'checkpoints', '20'))
