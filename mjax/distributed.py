"""Joining a multi-process JAX job (jax.distributed), from the environment.

`initialize_from_env()` must run before anything starts the JAX backend
(`jax.devices()`, the first computation): `mjax-train` calls it right after
the XLA flags are set. It finds out who this process is from the first of
these sources that is present, and calls `jax.distributed.initialize` when
the job has more than one process:

  1. explicit (local launcher, fault-tolerance driver, any scheduler)
       MJAX_COORDINATOR_ADDRESS   host:port of process 0's coordinator service
       MJAX_NUM_PROCESSES         processes in the job
       MJAX_PROCESS_ID            this process, 0 .. MJAX_NUM_PROCESSES - 1
       MJAX_LOCAL_DEVICE_COUNT    optional: fake CPU devices in this process
                                  (becomes --xla_force_host_platform_device_count)
  2. SLURM, one task per process, started with `srun`
       SLURM_JOB_ID, SLURM_PROCID, SLURM_STEP_NUM_TASKS or SLURM_NTASKS,
       SLURM_STEP_NODELIST or SLURM_JOB_NODELIST (the first host is the
       coordinator), SLURM_LOCALID. The port is MJAX_COORDINATOR_PORT, else
       JAX_COORDINATOR_PORT, else the one jax's own SLURM detector derives from
       the job id, so both agree. MJAX_COORDINATOR_ADDRESS, when set, wins.
  3. Kubernetes Indexed Job / JobSet, one pod per process
       JOB_COMPLETION_INDEX (set by Kubernetes) is the process id;
       MJAX_NUM_PROCESSES (set by the manifest) the number of processes;
       MJAX_COORDINATOR_ADDRESS, else the stable DNS name of the first pod,
       $JOBSET_NAME-$REPLICATED_JOB_NAME-0-0.$JOBSET_NAME:$MJAX_COORDINATOR_PORT
       (REPLICATED_JOB_NAME defaults to 'workers', the port to 1234).

Nothing set, or one process: no initialization, `init_seconds()` is 0.

Joining waits up to MJAX_JOIN_TIMEOUT_S (default 300) for every process.
jax's own wait ends in an abort that blames "another task" and names no
address, so the wait is watched here: a process other than 0 first waits
for the coordinator's port to accept a connection, saying every 30 s what
it is waiting for and why it fails (a name that does not resolve, a refused
connection); and every process gives up before jax would, with a paragraph
that names the coordinator and what to check, and exit status 1 (a crash:
the fault-tolerance driver restarts the job). A port another program holds
is named the same way.

jax has a SLURM detector of its own (jax._src.clusters.SlurmCluster); it is
not called, because when it fills in the job it also restricts every process
to the one GPU whose index is SLURM_LOCALID, which hides seven of eight GPUs
from a one-task-per-node launch. The same parsing is done here (and checked
against jax's in tests/test_multihost.py), with one GPU per task only when a
node runs several tasks, as jax does. Its Kubernetes detector needs the
`kubernetes` package and API access from the pod, which the JobSet route
above does not.

On CPU, cross-process collectives go through gloo (set explicitly, as the
default has changed between jax versions); on GPU NCCL is used.

The persistent compilation cache: jax writes entries from process 0 only.
On GPU it keys an entry the same way in every process, so a restart hits it
everywhere; on CPU the key includes the process's own device assignment and
topology, so the trainer lets every CPU process write its own entry
(`_cache_entries_from_every_process`, trainer.py) and each hits it on the
next start. The trainer waits at a barrier after compiling (`barrier`), so a
process that loaded its step quickly does not sit in the first collective
until gloo gives up on one still compiling.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
import socket
import sys
import threading
import time
from typing import Callable, Mapping, Optional

from mjax import devices
from mjax.errors import Fault, UserError

COORDINATOR = 'MJAX_COORDINATOR_ADDRESS'
NUM_PROCESSES = 'MJAX_NUM_PROCESSES'
PROCESS_ID = 'MJAX_PROCESS_ID'
LOCAL_DEVICE_COUNT = 'MJAX_LOCAL_DEVICE_COUNT'
COORDINATOR_PORT = 'MJAX_COORDINATOR_PORT'
LAUNCH_TIME = 'MJAX_LAUNCH_TIME'
JOIN_TIMEOUT = 'MJAX_JOIN_TIMEOUT_S'
DEFAULT_JOIN_TIMEOUT_S = 300
DEFAULT_JOBSET_PORT = 1234
DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count'

_INIT_SECONDS = 0.0


class DistributedError(UserError):
  """The environment describes an impossible or incomplete job."""


@dataclasses.dataclass(frozen=True)
class JobSpec:
  """Who this process is in the job, as found in the environment.

  Attributes:
    source: 'explicit', 'slurm', 'jobset' or 'none' (a single process).
    num_processes: processes in the job.
    process_id: this process, 0 .. num_processes - 1.
    coordinator_address: host:port of process 0's coordinator (None alone).
    local_device_ids: accelerators this process may use (None: all).
    local_device_count: fake CPU devices asked for (None: leave as is).
  """
  source: str
  num_processes: int = 1
  process_id: int = 0
  coordinator_address: Optional[str] = None
  local_device_ids: Optional[tuple[int, ...]] = None
  local_device_count: Optional[int] = None


def init_seconds() -> float:
  """Seconds spent in jax.distributed.initialize by this process (0 if single-process)."""
  return _INIT_SECONDS


def _int(env: Mapping[str, str], name: str, minimum: int, meaning: str,
         maximum: Optional[int] = None) -> int:
  raw = env.get(name, '')
  try:
    value = int(raw.strip())
  except ValueError:
    raise DistributedError(f'{name}={raw!r} is not an integer; it should be {meaning}.') from None
  if value < minimum:
    raise DistributedError(f'{name}={value} is out of range; it should be {meaning} (at least {minimum}).')
  if maximum is not None and value > maximum:
    raise DistributedError(f'{name}={value} is out of range; it should be {meaning} (at most {maximum}).')
  return value


def _check_address(address: str, name: str) -> str:
  host, colon, port = address.strip().rpartition(':')
  if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise DistributedError(
        f'{name}={address!r} is not a coordinator address; it should be host:port, the host of '
        f'process 0 and a free TCP port on it (1-65535) that every process can reach, e.g. '
        f'10.0.0.1:1234.')
  return address.strip()


def _check_id(process_id: int, num_processes: int, id_name: str, num_name: str) -> None:
  if process_id >= num_processes:
    raise DistributedError(
        f'{id_name}={process_id} is out of range for {num_name}={num_processes}: process ids run '
        f'from 0 to {num_processes - 1}, one per process. Check that every process of the job was '
        f'started with the same {num_name}.')


def first_slurm_host(nodelist: str) -> str:
  """The first host of a SLURM node list ('gpu[003-010,12],cpu1' -> 'gpu003').

  Args:
    nodelist: the compressed list SLURM writes into SLURM_*_NODELIST.
  Returns:
    The first host name, with its zero padding kept.
  """
  nodelist = nodelist.strip()
  m = re.match(r'([^,\[]*)(?:\[([^\],\-]+))?', nodelist)
  if not m or not (m.group(1) or m.group(2)):
    raise DistributedError(f'cannot read a host name from the SLURM node list {nodelist!r}.')
  return m.group(1) + (m.group(2) or '')


def slurm_port(job_id: str) -> int:
  """The coordinator port jax's SLURM detector uses: one of the top 4096
  ephemeral ports, chosen by the job id, so that jobs sharing a node differ."""
  return int(job_id) % 2 ** 12 + (65535 - 2 ** 12 + 1)


def _port(env: Mapping[str, str], default: int) -> int:
  for name in (COORDINATOR_PORT, 'JAX_COORDINATOR_PORT'):
    if env.get(name):
      # Bounded above too: a port past 65535 reached socket.bind as an OverflowError.
      return _int(env, name, 1, 'a TCP port for the coordinator (1-65535)', maximum=65535)
  return default


def _local_count(env: Mapping[str, str]) -> Optional[int]:
  if not env.get(LOCAL_DEVICE_COUNT):
    return None
  return _int(env, LOCAL_DEVICE_COUNT, 1, 'the number of fake CPU devices of each process')


def _rank(env: Mapping[str, str], id_name: str, id_what: str, num_name: str,
          num_what: str) -> tuple[int, int, Optional[str]]:
  """(processes, this process's id, the checked MJAX_COORDINATOR_ADDRESS or
  None), read alike whichever scheduler named the first two."""
  num = _int(env, num_name, 1, num_what)
  pid = _int(env, id_name, 0, id_what)
  _check_id(pid, num, id_name, num_name)
  address = env.get(COORDINATOR)
  return num, pid, _check_address(address, COORDINATOR) if address else None


def _explicit(env: Mapping[str, str]) -> JobSpec:
  missing = [n for n in (NUM_PROCESSES, PROCESS_ID) if not env.get(n)]
  if missing:
    raise DistributedError(
        f'{missing[0]} is not set, but {PROCESS_ID if missing[0] == NUM_PROCESSES else NUM_PROCESSES} '
        f'is: a multi-process job needs {COORDINATOR}, {NUM_PROCESSES} and {PROCESS_ID} in '
        f'every process (or none of them, for a single process).')
  num, pid, address = _rank(env, PROCESS_ID, 'the id of this process, 0 .. processes - 1',
                            NUM_PROCESSES, 'the number of processes in the job')
  if num > 1 and not address:
    raise DistributedError(
        f'{COORDINATOR} is not set, but {NUM_PROCESSES}={num}: every process needs the host:port '
        f'of process 0, e.g. {COORDINATOR}=10.0.0.1:1234.')
  return JobSpec('explicit', num, pid, address, None, _local_count(env))


def _slurm(env: Mapping[str, str]) -> JobSpec:
  num_name = 'SLURM_STEP_NUM_TASKS' if env.get('SLURM_STEP_NUM_TASKS') else 'SLURM_NTASKS'
  if not env.get(num_name):
    raise DistributedError(
        'SLURM_PROCID is set but neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS is: start '
        'mjax-train with srun inside an allocation (sbatch launch/slurm.sbatch).')
  num, pid, address = _rank(env, 'SLURM_PROCID', 'the rank of this SLURM task',
                            num_name, 'the number of SLURM tasks')
  if address is None and num > 1:
    list_name = next((n for n in ('SLURM_STEP_NODELIST', 'SLURM_JOB_NODELIST') if env.get(n)), None)
    if list_name is None:
      raise DistributedError(
          'neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set, so the coordinator (the '
          f'first node) is unknown; start mjax-train with srun, or set {COORDINATOR}=host:port.')
    address = f'{first_slurm_host(env[list_name])}:{_port(env, slurm_port(env["SLURM_JOB_ID"]))}'
  # Several tasks on one node: one GPU each, indexed by the local rank (jax's
  # convention). One task per node: every GPU of the node.
  nodes_name = next((n for n in ('SLURM_STEP_NUM_NODES', 'SLURM_JOB_NUM_NODES', 'SLURM_NNODES')
                     if env.get(n)), None)
  ids = None
  if (nodes_name and env.get('SLURM_LOCALID') and not env.get('JAX_LOCAL_DEVICE_IDS')
      and num > _int(env, nodes_name, 1, 'the number of SLURM nodes')):
    ids = (_int(env, 'SLURM_LOCALID', 0, 'the rank of this task on its node'),)
  return JobSpec('slurm', num, pid, address, ids, _local_count(env))


def _jobset(env: Mapping[str, str]) -> JobSpec:
  if not env.get(NUM_PROCESSES):
    raise DistributedError(
        f'JOB_COMPLETION_INDEX is set (a Kubernetes Indexed Job / JobSet pod) but {NUM_PROCESSES} '
        f'is not: set it in the manifest to the number of pods (the Job\'s parallelism), see '
        f'launch/jobset.yaml.')
  num, pid, address = _rank(env, 'JOB_COMPLETION_INDEX', 'the index of this pod',
                            NUM_PROCESSES, 'the number of pods in the job')
  if address is None and num > 1:
    jobset = env.get('JOBSET_NAME')
    if not jobset:
      raise DistributedError(
          f'neither {COORDINATOR} nor JOBSET_NAME is set, so the coordinator is unknown; set '
          f'{COORDINATOR}=$(JOBSET_NAME)-workers-0-0.$(JOBSET_NAME):1234 in the manifest.')
    rjob = env.get('REPLICATED_JOB_NAME') or 'workers'
    address = f'{jobset}-{rjob}-0-0.{jobset}:{_port(env, DEFAULT_JOBSET_PORT)}'
  return JobSpec('jobset', num, pid, address, None, _local_count(env))


def resolve(env: Optional[Mapping[str, str]] = None) -> JobSpec:
  """Reads the job from the environment, without starting anything.

  Args:
    env: the variables to read (default: os.environ).
  Returns:
    The JobSpec of the first source present (see the module docstring).
  Raises:
    DistributedError: a variable is malformed or contradicts another; the
      message names it.
  """
  env = os.environ if env is None else env
  if env.get(PROCESS_ID) or (env.get(NUM_PROCESSES) and not env.get('JOB_COMPLETION_INDEX')
                             and not env.get('SLURM_PROCID')):
    return _explicit(env)
  if env.get('SLURM_JOB_ID') and env.get('SLURM_PROCID'):
    return _slurm(env)
  if env.get('JOB_COMPLETION_INDEX'):
    return _jobset(env)
  if env.get(COORDINATOR):
    raise DistributedError(
        f'{COORDINATOR} is set but {NUM_PROCESSES} and {PROCESS_ID} are not: a multi-process job '
        f'needs all three in every process.')
  return JobSpec('none', local_device_count=_local_count(env))


def with_device_count(xla_flags: str, count: int) -> str:
  """XLA_FLAGS with the fake CPU device count set to `count`, replacing any
  count already there and keeping every other flag."""
  kept = [f for f in shlex.split(xla_flags or '') if f.split('=', 1)[0] != DEVICE_COUNT_FLAG]
  return ' '.join(kept + [f'{DEVICE_COUNT_FLAG}={count}'])


def _split_address(address: str) -> tuple[str, int]:
  """('host', port) of a checked host:port ('[::1]:1234' -> ('::1', 1234))."""
  host, _, port = address.rpartition(':')
  return host.strip('[]'), int(port)


def _where(spec: JobSpec) -> str:
  """Where this process took the coordinator's address from, for messages."""
  return {'explicit': f'{COORDINATOR}',
          'slurm': (f'{COORDINATOR}, else the first host of the SLURM node list and the port from '
                    f'{COORDINATOR_PORT}, JAX_COORDINATOR_PORT or the job id'),
          'jobset': f'{COORDINATOR}, else the first pod\'s DNS name from JOBSET_NAME'}.get(spec.source, COORDINATOR)


def _say(message: str) -> None:
  print(f'{os.path.basename(sys.argv[0] or "mjax")}: {message}', file=sys.stderr, flush=True)


PROGRESS_S = 30.0        # how often a waiting process says what it waits for
JAX_TIMEOUT_MARGIN_S = 30  # jax's own join deadline, after ours: its expiry aborts the process


def wait_for_coordinator(spec: JobSpec, deadline: float, say: Callable[[str], None] = _say) -> None:
  """Returns once the coordinator's port accepts a TCP connection.

  Args:
    spec: the job; spec.coordinator_address is the one waited for.
    deadline: time.monotonic() at which to give up.
    say: where the progress lines go (every PROGRESS_S seconds).
  Raises:
    Fault: the port did not accept a connection by the deadline; the
      message names the address and the last reason.
  """
  host, port = _split_address(spec.coordinator_address)
  who = f'process {spec.process_id} of {spec.num_processes}'
  start, last = time.monotonic(), 'not tried'
  next_note = start + PROGRESS_S
  while True:
    left = deadline - time.monotonic()
    try:
      with socket.create_connection((host, port), timeout=max(0.1, min(5.0, left))):
        return
    except socket.gaierror as e:
      last = f'the name {host!r} does not resolve: {e.strerror}'
    except OSError as e:
      last = (e.strerror or str(e) or type(e).__name__).lower()
    now = time.monotonic()
    if now >= deadline:
      raise Fault(
          f'{who} could not reach the coordinator at {spec.coordinator_address} within '
          f'{now - start:.0f} s ({last}). The coordinator is the service process 0 starts when it '
          f'joins the job: check that process 0 was started and is past its start-up, that '
          f'{host} is the host it runs on and port {port} is open from this host. The address '
          f'comes from {_where(spec)}; {JOIN_TIMEOUT} sets how long to wait.')
    if now >= next_note:
      say(f'{who}: still waiting for the coordinator at {spec.coordinator_address} ({last}), '
          f'{now - start:.0f} s of {deadline - start:.0f} s')
      next_note += PROGRESS_S
    time.sleep(max(0.0, min(1.0, deadline - now)))


def check_port_free(spec: JobSpec) -> None:
  """Process 0: the coordinator's port can be listened on, as jax's service
  will (all addresses). Checked beforehand because jaxlib, failing to
  start its service on a taken port, sometimes crashes the process
  (SIGSEGV) instead of raising.

  Raises:
    Fault: another program listens on the port.
  """
  _, port = _split_address(spec.coordinator_address)
  try:
    probe, anywhere = socket.socket(socket.AF_INET6, socket.SOCK_STREAM), '::'
  except OSError:   # no IPv6 on this host
    probe, anywhere = socket.socket(socket.AF_INET, socket.SOCK_STREAM), '0.0.0.0'
  # SO_REUSEADDR as gRPC sets it: a port left in TIME_WAIT by an earlier
  # run's coordinator is free to it, one with a listener is not.
  probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    probe.bind((anywhere, port))
    probe.listen()
  except OSError as e:
    raise Fault(
        f'process 0 of {spec.num_processes} cannot start the coordinator at '
        f'{spec.coordinator_address}: port {port} cannot be listened on here '
        f'({(e.strerror or str(e)).lower()}; another job, or a process of an earlier run still '
        f'running?). Choose another port ({_where(spec)}) or stop what holds it (e.g. '
        f'`ss -ltnp | grep :{port}`).') from None
  finally:
    probe.close()


class _JoinWatch:
  """Watches jax.distributed.initialize from a thread: says every
  PROGRESS_S seconds what the process waits for, and at the deadline
  prints why it gives up and ends the process with status 1, before jax's
  own deadline aborts it without naming the coordinator."""

  def __init__(self, spec: JobSpec, seconds: float, say: Callable[[str], None] = _say):
    self.spec, self.seconds, self.say = spec, seconds, say
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._watch, name='mjax-join-watch', daemon=True)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._done.set()
    self._thread.join()

  def _watch(self) -> None:
    spec, start = self.spec, time.monotonic()
    who = f'process {spec.process_id} of {spec.num_processes}'
    others = 'the other processes' if spec.process_id == 0 else 'every process'
    while not self._done.wait(min(PROGRESS_S, max(0.0, start + self.seconds - time.monotonic()))):
      waited = time.monotonic() - start
      if waited < self.seconds:
        self.say(f'{who}: waiting for {others} to join the job at the coordinator '
                 f'{spec.coordinator_address}, {waited:.0f} s of {self.seconds:.0f} s')
        continue
      self.say(
          f'error: {who}: the job did not form within {waited:.0f} s: not all '
          f'{spec.num_processes} processes joined at the coordinator {spec.coordinator_address} '
          f'(jax does not say which are missing). Look at the other processes\' output for one '
          f'that failed or is still starting, and check that every process was given the same '
          f'coordinator address ({_where(spec)}) and {NUM_PROCESSES}={spec.num_processes}. '
          f'{JOIN_TIMEOUT} sets how long to wait.')
      sys.stdout.flush()
      os._exit(1)   # protocol.EXIT_FAILED; the main thread is inside jax's wait


def _join_timeout(env: Mapping[str, str], timeout_s: Optional[float]) -> float:
  if timeout_s is not None:
    return float(timeout_s)
  if not env.get(JOIN_TIMEOUT):
    return float(DEFAULT_JOIN_TIMEOUT_S)
  raw = env[JOIN_TIMEOUT]
  try:
    value = float(raw)
  except ValueError:
    value = math.nan
  if not (value > 0 and math.isfinite(value)):
    raise DistributedError(f'{JOIN_TIMEOUT}={raw!r} is not a number of seconds; it should be how '
                           f'long a process waits for the whole job to join, > 0 (default '
                           f'{DEFAULT_JOIN_TIMEOUT_S}).')
  return value


def raise_open_files_limit(wanted: Optional[int] = None) -> None:
  """The soft limit of open files raised towards `wanted` (None: as far as
  the hard limit lets, 2**20 where it sets none); never lowered, never past
  the hard limit, which a process may not raise."""
  import resource
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  unlimited = hard == resource.RLIM_INFINITY
  if wanted is None:
    wanted = max(soft, 1 << 20) if unlimited else hard
  if soft == resource.RLIM_INFINITY or soft >= wanted:
    return
  target = wanted if unlimited else min(wanted, hard)
  if target > soft:
    try:
      resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
      pass


def initialize_from_env(env: Optional[Mapping[str, str]] = None, timeout_s: Optional[float] = None,
                        peer_timeout_s: Optional[float] = None) -> dict:
  """Joins the multi-process job the environment describes, if any.

  Call it once per process, before anything asks JAX for devices. A second
  call, or a call in an already initialized process, changes nothing.

  Args:
    env: the variables to read (default: os.environ). MJAX_LOCAL_DEVICE_COUNT
      is written into os.environ['XLA_FLAGS'] either way.
    timeout_s: how long to wait for every process to reach the coordinator
      (default: MJAX_JOIN_TIMEOUT_S, else 300 s).
    peer_timeout_s: after how long without a heartbeat from a peer jax's
      coordination service aborts every process (its own default: 100 s).
      The trainer passes FaultConfig.collective_timeout_s, the outermost
      timeout of the hierarchy (mjax/ft/detect.py), so that a supervising
      driver, which finds a lost process within heartbeat_timeout_s, always
      acts first.
  Returns:
    dict with `source`, `num_processes`, `process_id`, `coordinator_address`,
    `local_device_ids`, `local_device_count`, `initialized` (whether
    jax.distributed was initialized by this call) and `seconds` it took.
  Raises:
    DistributedError: the environment is inconsistent, or the backend has
      already started.
    Fault: the coordinator could not be reached, or its port is taken. Not
      joining in time ends the process (see the module docstring).
  """
  global _INIT_SECONDS
  spec = resolve(env)
  out = {**dataclasses.asdict(spec), 'initialized': False, 'seconds': 0.0}
  import jax
  if spec.local_device_count is not None:
    flags = os.environ.get('XLA_FLAGS', '')
    wanted = with_device_count(flags, spec.local_device_count)
    if wanted != flags:
      if devices.backend_started():
        raise DistributedError(
            f'{LOCAL_DEVICE_COUNT}={spec.local_device_count} came too late: the JAX backend has '
            f'already started; set XLA_FLAGS={DEVICE_COUNT_FLAG}=N before starting the process.')
      os.environ['XLA_FLAGS'] = wanted
  if spec.num_processes == 1 or jax.distributed.is_initialized():
    return out
  timeout_s = _join_timeout(os.environ if env is None else env, timeout_s)
  if devices.backend_started():
    raise DistributedError(
        f'the environment describes process {spec.process_id} of {spec.num_processes} ({spec.source}), '
        f'but the JAX backend has already started in this process; join the job before anything '
        f'calls jax.devices() or computes.')
  if not os.environ.get('JAX_CPU_COLLECTIVES_IMPLEMENTATION'):
    # Without cross-process CPU collectives a multi-process CPU job fails at
    # its first all-reduce; this setting is ignored by GPU backends.
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  # jax's pre-emption service takes SIGTERM for itself at initialize (a C
  # handler over the one mjax-train set for start-up) and only notes it for
  # a sync point mjax never asks for: a SIGTERM in start-up (a pre-emption,
  # scancel) was swallowed and the job trained on. mjax stops on signals
  # its own way (mjax/stop.py), so jax's service stays off.
  jax.config.update('jax_enable_preemption_service', False)
  t0 = time.perf_counter()
  deadline = time.monotonic() + timeout_s
  if spec.process_id == 0:
    check_port_free(spec)
    # Process 0 hosts jax's coordination service: one connection per
    # process, past a soft limit of 1,024 open files at a few hundred hosts.
    raise_open_files_limit(spec.num_processes + 1024)
  else:
    wait_for_coordinator(spec, deadline)
  left = max(1.0, deadline - time.monotonic())
  with _JoinWatch(spec, left):
    # 'deactivate': every value is decided above; jax's detectors would
    # otherwise fill in local_device_ids from SLURM_LOCALID (see the docstring).
    jax.distributed.initialize(
        coordinator_address=spec.coordinator_address, num_processes=spec.num_processes,
        process_id=spec.process_id,
        local_device_ids=list(spec.local_device_ids) if spec.local_device_ids else None,
        cluster_detection_method='deactivate',
        initialization_timeout=int(left) + JAX_TIMEOUT_MARGIN_S,
        **({'heartbeat_timeout_seconds': max(1, int(peer_timeout_s))} if peer_timeout_s else {}))
  _INIT_SECONDS = time.perf_counter() - t0
  global _JOINED
  _JOINED = spec
  out.update(initialized=True, seconds=_INIT_SECONDS)
  return out


_JOINED: Optional[JobSpec] = None   # the job this process joined (initialize_from_env)


def check_membership() -> None:
  """After the backend started: the job that formed has the processes this
  one was told of. jax's coordination service takes a process that was
  given another count into the job the coordinator was given, silently:
  it trained as one of fewer (or more) processes than its environment said.

  Raises:
    DistributedError: the counts differ.
  """
  import jax
  spec = _JOINED
  if spec is None or not jax.distributed.is_initialized() or jax.process_count() == spec.num_processes:
    return
  told = NUM_PROCESSES if spec.source == 'explicit' else f"{spec.source}'s task count"
  raise DistributedError(
      f'process {spec.process_id} was told the job has {spec.num_processes} processes ({told}), but the job '
      f'that formed at the coordinator {spec.coordinator_address} has {jax.process_count()}: every process must be '
      f'started with the same process count (and its own process id, 0 to count - 1)')


# What a collective says when the process at its other end is gone: a
# peer that crashed or was killed first (gloo on CPU, NCCL on GPU).
_PEER_GONE = re.compile(r'(gloo|nccl|collective|all-?reduce|all-?gather|reduce-?scatter).*'
                        r'(connection (reset|closed|refused)|socket closed|broken pipe|remote process exited|'
                        r'peer (closed|left|died))', re.I | re.S)


def peer_gone(exc: BaseException) -> bool:
  """Whether `exc` is a collective failing because another process of the
  job left (the cause is that process's, not this one's)."""
  return bool(_PEER_GONE.search(f'{type(exc).__name__}: {exc}'))


# ----------------------------------------------------------------------------
# Agreement between processes, through jax's coordination service
# ----------------------------------------------------------------------------
# Small decisions every process must take alike (which checkpoint to restore,
# whether a directory is shared, when to stop) go through the coordination
# service's key-value store rather than a device collective: it works before
# the first step is compiled, and its waits have their own timeouts, so a
# missing process shows up as an error naming it instead of a hung all-reduce.

def coordination_client():
  """jax's coordination-service client (the key-value store, barriers)."""
  from jax._src.distributed import global_state
  if global_state.client is None:
    raise RuntimeError('jax.distributed is not initialized in this multi-process job')
  return global_state.client


# Agreement between the processes of a job costs O(1) coordination-service
# calls per process, whatever the job's size (MegaScale: start-up in seconds
# at thousands of GPUs): process 0 decides and the others read one key, or
# only the processes with something to report write, and everyone reads the
# (usually empty) list once after a barrier. Keys must be new to the job:
# each call site adds what makes them unique.

def broadcast_str(key: str, value: str, timeout_s: float = 300.0) -> str:
  """Process 0's `value`, in every process (one call per process)."""
  import jax
  if jax.process_count() == 1:
    return value
  return broadcast_with(coordination_client(), jax.process_index(), key, value, timeout_s)


def report_exceptions(key: str, mine: Optional[str], timeout_s: float = 300.0) -> dict[int, str]:
  """{process: what it reported} over the processes that report something
  (`mine` not None), the same dict in every process. Three calls per process:
  a write by the reporting ones only, a barrier, one directory read."""
  import jax
  if jax.process_count() == 1:
    return {} if mine is None else {0: mine}
  return report_with(coordination_client(), jax.process_index(), key, mine, timeout_s)


def broadcast_with(client, me: int, key: str, value: str, timeout_s: float) -> str:
  """`broadcast_str` through a given client as process `me` (bench/scale_sim.py
  runs thousands of clients in one process)."""
  if me == 0:
    client.key_value_set(f'mjax/{key}', value)
    return value
  try:
    return client.blocking_key_value_get(f'mjax/{key}', int(timeout_s * 1000))
  except Exception as e:
    raise RuntimeError(f'process 0 did not publish {key!r} within {timeout_s:.0f}s '
                       f'(it may have died or be stuck): {e}') from e


def report_with(client, me: int, key: str, mine: Optional[str], timeout_s: float) -> dict[int, str]:
  """`report_exceptions` through a given client as process `me`."""
  if mine is not None:
    client.key_value_set(f'mjax/{key}/{me}', mine)
  client.wait_at_barrier(f'mjax/{key}/reported', int(timeout_s * 1000))
  return {int(k.rsplit('/', 1)[1]): v for k, v in client.key_value_dir_get(f'mjax/{key}/')}


def barrier(name: str, timeout_s: float = 300.0) -> None:
  """Waits until every process has reached the barrier `name`. A name used
  again is the barrier's next round (jax 0.10-0.12 hold every process to it:
  none passes round n + 1 before all have reached it)."""
  import jax
  if jax.process_count() > 1:
    coordination_client().wait_at_barrier(f'mjax/{name}', int(timeout_s * 1000))
