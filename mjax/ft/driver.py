"""The fault-tolerance driver: runs a job, watches it, recovers it (MegaScale §7).

  mjax-launch --processes 2 --devices 1 --workdir runs/ft -- \
      --gin_file configs/tiny.gin --gin.TrainConfig.steps=300

One executor per host starts that host's training process (`mjax-train`
with the arguments after `--`, plus `--workdir`); here hosts are process
slots on this machine (`LocalExecutor`, mjax/ft/executor.py, the one place
that would change for remote hosts), named by `--hosts` (default slot0,
slot1, ...). The driver generates a per-job secret, serves
authenticated heartbeats (mjax/ft/heartbeat.py) on `--bind` (127.0.0.1 and
a free port by default) and watches for:

  exit             a process exits with a non-zero status (2 = bad input:
                   stop, retrying cannot help; 3 = non-finite loss; see
                   mjax/protocol.py for every status and what travels
                   between trainer and driver)
  heartbeat_lost   no heartbeat for heartbeat_timeout_s
  host_fault       the trainers found a fault of a few processes' hosts
                   (a checkpoint directory they cannot write or do not
                   see, where the others can): those hosts are blocked
  hang             heartbeats but no step for progress_timeout_s (for
                   collective_timeout_s in an evaluation, io_timeout_s in a save): the
                   processes furthest behind are named (detect.culprits),
                   then every process is sent SIGUSR1 and dumps its Python
                   stacks into its log; where each one was goes into the
                   events (also after heartbeat_lost and startup_timeout)
  startup_timeout  no first step within collective_timeout_s of launch (+
                   io_timeout_s when it restores); trainers heartbeat from
                   early in start-up, so the fault names the part of
                   start-up each late one was in (startup:restore, ...)
  nonfinite_loss   a NaN/Inf loss (exit status 3, or seen in a heartbeat)
  loss_spike       loss_spike_count losses in a row > loss_spike_factor x
                   the running median
  straggler        mjax.ft.stragglers.find_stragglers on <workdir>/timings:
                   flagged in the events; a fault only with evict_stragglers
  driver_held      every trainer that stopped saved and exited 4: the driver
                   was unreachable (held up, stopped whole): restarted with
                   no host diagnosed
  signalled        every trainer stopped short of the last step, saved and
                   exited 0, because one of them got a stop signal that
                   the driver did not (a node's own pre-emption, an scancel
                   of one step): restarted with no host diagnosed; where
                   the node is going away, the restart finds it lost

Timeout hierarchy (FaultConfig; checked at start, see mjax/ft/detect.py):
heartbeat_interval_s < heartbeat_timeout_s < progress_timeout_s <
collective_timeout_s. A lost process is noticed first, a hang next, and
both before a collective times out on the healthy processes, so that the
driver, not a timeout error on every rank, decides what failed.

Recovery, without a human:
  1. stop every process: SIGTERM, SIGKILL after --grace_s;
  2. run `mjax-diagnose --json` on every host of the job (in parallel);
     a host that fails is added to <workdir>/blocked_hosts.json and never
     used again by this workdir (a diagnostic that crashed before it could
     report is run once more first); an evicted straggler too, and a host whose
     checks were slow while it was loaded (suspect) twice in a row. When every host
     of a multi-host job fails, none is blocked (a shared cause is likelier);
     then the hosts the fault named (a crash, a lost or hung process) that
     passed run an all-reduce with a healthy host each, as two-process JAX
     jobs, all at once: a failing link blocks the named host (mjax/ft/health.py);
  3. wait restart_backoff_s (doubled after each restart in a row, at most
     60 s);
  4. restart from the newest good checkpoint (the trainer resumes from the
     workdir by itself), on spare hosts (--spares) in place of blocked ones,
     else on fewer hosts with gradient accumulation keeping the global
     batch (mjax/ft/hosts.py); the attempt number goes to MJAX_ATTEMPT.
     The `restart` event's checkpoint_step is the newest complete checkpoint
     on disk; where the trainer finds it unreadable it resumes from the one
     before, and its `startup` event names the step it really resumed.
  A numerical fault (NaN/Inf, loss spikes) also skips the data between the
  checkpoint and the bad step (TrainConfig.skip_batches), so that the restart
  does not replay the batches that led to it; checkpoints only ever hold
  finite states, so the rollback target is good.
FaultConfig.max_restarts bounds the restarts in a row that do not get
training back to where it was: an attempt that catches up with the step
reached before its fault and saves a checkpoint newer than the one it
started from resets the count and the back-off, so a weeks-long
run survives any number of faults spread over time (MegaScale: > 100), while
a job that fails again before recovering gives up after max_restarts.

Everything it does is a line of <workdir>/events.jsonl (mjax/ft/events.py);
process i writes to <workdir>/logs/process-<i>.log (appended over attempts).
SIGTERM / SIGINT to the driver is a pre-emption: passed on as SIGTERM (each
trainer saves and exits), no restart; a second one stops waiting.
Exit status: 0 finished (or pre-empted cleanly), 1 gave up, 2 bad input.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

from mjax import distributed, flags, jsonfile, protocol
from mjax.ft import detect, events as events_lib, heartbeat as hb, hosts as hosts_lib
from mjax.ft import executor as executor_lib
from mjax.ft import agent as agent_lib
from mjax.ft import health as health_lib
from mjax.ft.executor import LocalExecutor
from mjax.errors import UserError

# The driver's own exit statuses.
EXIT_OK, EXIT_GAVE_UP, EXIT_BAD_INPUT = protocol.EXIT_OK, protocol.EXIT_FAILED, protocol.EXIT_USER_ERROR
MAX_BACKOFF_S = 60.0
STACK_WAIT_S = 1.0            # time given to faulthandler to write the stacks
KILL_WAIT_S = 60.0            # after SIGKILL, a process still there this long counts its host as lost


# ----------------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------------

@dataclasses.dataclass
class Options:
  """What `mjax-launch` was asked to do (see `parse_args`)."""
  processes: int
  devices: Optional[int]
  workdir: str
  train_args: list[str]
  hosts: list[str]
  spares: list[str] = dataclasses.field(default_factory=list)
  bind: str = '127.0.0.1:0'
  host_env: dict = dataclasses.field(default_factory=dict)   # host -> {name: value}
  grace_s: float = 5.0
  trainer: Optional[list[str]] = None
  diagnose: Optional[list[str]] = None          # the command (default: mjax-diagnose)
  diagnose_args: list[str] = dataclasses.field(default_factory=list)
  diagnose_timeout_s: float = 300.0
  quiet: bool = False
  executor: str = 'local'                       # 'local', 'slurm' or 'agent' (mjax/ft/executor.py, agent.py)
  discover: bool = False                        # agent: hosts are the agents that connect
  agent_wait_s: float = 300.0
  preempt_exit_status: int = EXIT_OK             # the driver's status after a clean pre-emption


def _script(name: str) -> Optional[list[str]]:
  """An installed console script: next to this interpreter, else on PATH."""
  here = os.path.join(os.path.dirname(sys.executable), name)
  found = here if os.path.exists(here) else shutil.which(name)
  return [found] if found else None


def parse_args(argv: Sequence[str]) -> Options:
  """mjax-launch's flags; everything after `--` goes to mjax-train."""
  p = argparse.ArgumentParser(
      prog='mjax-launch', description='Run mjax-train under the fault-tolerance driver.',
      usage='%(prog)s --processes N [--devices M] [--hosts h1,h2 --spares s1] --workdir DIR -- '
            '<mjax-train args>')
  p.add_argument('--processes', type=int, default=None,
                 help='training processes (one per host); with --executor slurm, default: one per node')
  p.add_argument('--executor', choices=('local', 'slurm', 'agent'), default='local',
                 help='local: processes on this machine; slurm: one job step per node of the SLURM '
                      'allocation this runs in; agent: through the mjax-agent of each host, which '
                      'connect to --bind (launch/slurm_ft.sbatch, launch/jobset_ft.yaml)')
  p.add_argument('--agent_wait_s', type=float, default=300.0,
                 help='with --executor agent: how long each attempt waits for the agents of its hosts; '
                      'a host whose agent is not connected by then sits the attempt out (default 300)')
  p.add_argument('--devices', type=int, default=None,
                 help='fake CPU devices per process (default: the real devices, e.g. GPUs)')
  p.add_argument('--workdir', required=True, help='run directory (checkpoints, events.jsonl, logs/)')
  p.add_argument('--hosts', default=None, help='comma-separated host names, one per process '
                 '(default: slot0,slot1,...)')
  p.add_argument('--spares', default='', help='comma-separated spare hosts, used in place of blocked ones')
  p.add_argument('--bind', default='127.0.0.1:0',
                 help='host:port the heartbeat server listens on (port 0: any free port)')
  p.add_argument('--host_env', action='append', default=[], metavar='HOST:NAME=VALUE',
                 help='an environment variable for one host\'s processes and diagnostics (repeatable)')
  p.add_argument('--grace_s', type=float, default=5.0,
                 help='seconds between SIGTERM and SIGKILL when stopping the job (default 5)')
  p.add_argument('--diagnose_args', default='',
                 help='extra arguments for mjax-diagnose, e.g. "--min_fraction 0.3 --checks memory,allreduce"')
  p.add_argument('--diagnose_timeout_s', type=float, default=300.0,
                 help='a diagnostic taking longer fails its host (default 300)')
  p.add_argument('--quiet', action='store_true', help='do not echo events to stderr')
  p.add_argument('--preempt_exit_status', type=int, default=EXIT_OK,
                 help='exit status after a clean pre-emption (SIGTERM): 0 by default; a scheduler that '
                      'must start the driver again to finish the job wants non-zero, e.g. 143 in '
                      'launch/jobset_ft.yaml')
  argv = list(argv)
  if '--' not in argv:
    p.parse_args(argv)   # --help, and missing flags, are answered first
    p.error('give the mjax-train arguments after --, e.g. -- --gin_file configs/tiny.gin')
  split = argv.index('--')
  args, train_args = p.parse_args(argv[:split]), argv[split + 1:]
  if not args.workdir.strip() or '://' in args.workdir:
    p.error(f'--workdir {args.workdir!r}: ' + ('empty (an unset variable?)' if not args.workdir.strip() else
            'a URL; the workdir is a local or mounted directory') + ': give the run directory')
  for name, least in (('grace_s', 0.0), ('agent_wait_s', 0.0), ('diagnose_timeout_s', None)):
    value = getattr(args, name)
    if not (math.isfinite(value) and (value > 0 if least is None else value >= least)):
      p.error(f'--{name} {value}: give a finite number of seconds, ' + ('above 0' if least is None else 'at least 0'))
  if not 0 <= args.preempt_exit_status <= 255:
    p.error(f'--preempt_exit_status {args.preempt_exit_status}: an exit status is 0 to 255')
  # The diagnostic's arguments are checked now: a typo there would fail
  # every diagnosis, and so block healthy hosts for good.
  from mjax.errors import RefusingParser
  from mjax.ft import diagnose
  try:
    diagnose_args = shlex.split(args.diagnose_args)
    diagnose.parse_args(diagnose_args, RefusingParser)
  except (ValueError, UserError) as e:
    p.error(f'--diagnose_args {args.diagnose_args!r}: {e}')
  if any(a == '--workdir' or a.startswith('--workdir=') for a in train_args):
    p.error('give --workdir to mjax-launch, before --: the driver passes it on to every process')
  slurm_nodes = None
  discover = args.executor == 'agent' and not args.hosts and not os.environ.get('SLURM_JOB_NODELIST')
  if args.executor in ('slurm', 'agent') and not args.hosts and not discover:
    try:
      slurm_nodes = executor_lib.slurm_hosts()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
      p.error(f'--executor slurm: {e}; submit launch/slurm_ft.sbatch with sbatch, or name --hosts')
    spare_names = {h for h in args.spares.split(',') if h}
    slurm_nodes = [h for h in slurm_nodes if h not in spare_names]
    if args.processes is None:
      args.processes = len(slurm_nodes)
    slurm_nodes = slurm_nodes[:args.processes]
  if args.processes is None:
    p.error(f'--processes is required (with --executor {args.executor}'
            + (' outside a SLURM allocation)' if args.executor == 'agent' else ')'))
  from mjax import launch
  problem = launch.count_problem(args.processes, args.devices)
  if problem:
    p.error(problem)
  hosts = (args.hosts.split(',') if args.hosts else slurm_nodes if slurm_nodes is not None
           else [] if discover else [f'slot{i}' for i in range(args.processes)])
  spares = [h for h in args.spares.split(',') if h]
  if discover and spares:
    p.error('--spares needs --hosts: without --hosts, every connected agent beyond --processes is a spare')
  if len(hosts) != args.processes and not discover and not args.hosts and slurm_nodes is not None:
    # The hosts came from the allocation, not --hosts: say so, and what to change.
    p.error(f'--processes {args.processes} needs {args.processes} node(s), but the SLURM allocation '
            f'{os.environ.get("SLURM_JOB_NODELIST")!r} has {len(hosts)}'
            + (f' besides --spares {args.spares!r}' if spare_names else '')
            + f': submit with sbatch --nodes={args.processes + len(spare_names)}, or give a --processes '
            f'of at most {len(hosts)} (left out, it is every node of the allocation)')
  if len(hosts) != args.processes and not discover:
    p.error(f'--hosts names {len(hosts)} host(s) for --processes {args.processes}: one host per '
            f'process; list extra hosts with --spares')
  if '' in hosts:
    p.error(f'--hosts {args.hosts!r} has an empty name: give comma-separated host names')
  twice = sorted(h for h, n in collections.Counter(hosts + spares).items() if n > 1)
  if twice:
    given = ' / '.join(f'--{name} {value!r}' for name, value in (('hosts', args.hosts), ('spares', args.spares))
                       if value)
    p.error(f'host(s) {", ".join(twice)} appear more than once in {given}: name each host once')
  host_env: dict = {}
  for item in args.host_env:
    host, colon, kv = item.partition(':')
    name, eq, value = kv.partition('=')
    if not colon or not eq or not name:
      p.error(f'--host_env {item!r}: expected HOST:NAME=VALUE, e.g. slot1:MJAX_DIAGNOSE_FAIL=matmul')
    if not discover and host not in hosts + spares:
      p.error(f'--host_env {item!r}: no host {host!r} in this job (hosts: {", ".join(hosts + spares)})')
    host_env.setdefault(host, {})[name] = value
  bind = args.bind
  if args.executor in ('slurm', 'agent') and bind == p.get_default('bind'):
    # The trainers run on other nodes: listen on this node's own address.
    bind = f'{socket.gethostname()}:0'
  try:
    host, port = hb.parse_address(bind)
  except ValueError as e:
    p.error(f'--bind: {e}')
  if args.executor in ('slurm', 'agent') and _names_loopback(host):
    # A node's name that resolves to a loopback address here (Debian's
    # 127.0.1.1 in /etc/hosts) is unreachable from the other nodes: listen
    # on every interface instead; trainers and agents are told the node's
    # name (HeartbeatServer.address), which they resolve as their own DNS does.
    bind = f'0.0.0.0:{port}'
  if args.executor == 'agent' and port == 0:
    p.error(f'--executor agent needs --bind HOST:PORT with a fixed port (not {bind!r}): every '
            f'mjax-agent is started with --driver HOST:PORT before the driver listens')
  return Options(args.processes, args.devices, args.workdir, train_args, hosts, spares, bind,
                 host_env, args.grace_s, diagnose_args=diagnose_args,
                 diagnose_timeout_s=args.diagnose_timeout_s, quiet=args.quiet, executor=args.executor,
                 discover=discover, agent_wait_s=args.agent_wait_s,
                 preempt_exit_status=args.preempt_exit_status)


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------

def _agent_secret() -> str:
  """The job secret the agents share, from MJAX_JOB_SECRET."""
  try:
    return hb.job_secret_from_env()
  except ValueError as e:
    raise UserError(f'--executor agent: {e}') from None


# What jax's coordination client logs as it aborts a process whose peer
# (or the coordination service's host) died (jaxlib 0.4-0.12, client.h).
_JAX_PEER_ABORT = 'the JAX distributed service detected fatal errors'


def _read_from(path: str, offset: int, limit: int = 1 << 20) -> str:
  try:
    with open(path, 'rb') as fh:
      fh.seek(offset)
      return fh.read(limit).decode(errors='replace')
  except OSError:
    return ''


def _size(path: str) -> int:
  try:
    return os.path.getsize(path)
  except OSError:
    return 0


def _echo(line: str) -> None:
  """One event on the driver's stderr, shortened (events.jsonl has it all)."""
  rec = jsonfile.loads(line)
  kind = rec.pop('event')
  rec.pop('time', None)
  text = json.dumps(rec, separators=(',', ':'))
  print(f'mjax-launch: {time.strftime("%H:%M:%S")} {kind} {text[:300]}', file=sys.stderr, flush=True)


@dataclasses.dataclass
class Attempt:
  """One launch of the job."""
  number: int
  hosts: list[str]
  handles: dict            # process index -> Popen (or a remote executor's handle)
  executors: list          # process index -> executor of its host
  logs: dict               # process index -> (path, offset at launch)
  monitor: detect.Monitor
  bindings: list[str]
  started: float
  running: bool = False
  startup_reported: bool = False
  recovered: bool = False   # caught up with the step reached before the last fault
  checkpoint_at_launch: int = 0   # the newest checkpoint when it started (0: none)
  trainers_let_go: bool = False   # the driver's own hold-up stopped acknowledging them (_stalled)


# ----------------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------------

def _names_loopback(host: str) -> bool:
  """Whether `host` is a name (not an address, not 'localhost') that
  resolves to a loopback address on this machine."""
  import ipaddress
  if host in ('localhost', '') or host.startswith('['):
    return False
  try:
    ipaddress.ip_address(host)
    return False   # an address given as such: meant
  except ValueError:
    pass
  try:
    infos = socket.getaddrinfo(host, None)
  except OSError:
    return False
  return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


DRIVER_LOCK = '.mjax-driver.lock'   # in the workdir: held (flock) by the driver supervising it


def _hold_driver_lock(workdir: str, shown: str) -> int:
  """An flock on the workdir's DRIVER_LOCK, naming this driver in it, or
  UserError where another driver holds it. A second mjax-launch on a job's
  workdir wrote its own events into the first's events.jsonl (ending in its
  'giveup'), its attempts into the first's logs/, and took the first's
  processes for its own for two minutes before its trainers met the run
  lock. The kernel drops the lock with the process, however it ends."""
  import fcntl
  path = os.path.join(workdir, DRIVER_LOCK)
  try:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  except OSError as e:
    raise UserError(f'--workdir {shown!r}: {path!r} cannot be made ({e.strerror or e}); the driver holds '
                    f'it while it supervises the job: give a directory you can write.') from None
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    try:
      holder = os.pread(fd, 200, 0).decode('utf-8', 'replace').strip()
    except OSError:
      holder = ''
    os.close(fd)
    raise UserError(f'--workdir {shown!r} is supervised by another mjax-launch ({holder or "its pid unknown"}, '
                    f'says {path!r}): two drivers of one job would write into one events.jsonl and logs/ '
                    f'and relaunch each other\'s trainers. Wait for it to end, stop it (SIGTERM saves and '
                    f'ends the job), or give this one another --workdir.') from None
  os.ftruncate(fd, 0)
  os.pwrite(fd, f'pid {os.getpid()} on {socket.gethostname()}'.encode(), 0)
  return fd


# Receive-buffer bytes one process's heartbeat takes in the kernel's count
# (the datagram, ~400 bytes, and its buffer overhead): a 10,000-process job
# dropped none with 8 MiB and 4% with 416 KiB.
HEARTBEAT_BUFFER_PER_PROCESS = 768
# More processes than this: a fault event lists the named ones in full and
# counts the others; stacks are asked of the named and STACK_SAMPLE others.
EVENT_PROCESSES = 64
STACK_SAMPLE = 8


class Driver:
  """Runs, supervises and recovers one job; `run()` returns the exit status."""

  def __init__(self, opts: Options, executor_factory=None):
    """Raises mjax.errors.UserError (exit status 2) for a config that cannot run."""
    self.opts = opts
    self.workdir = os.path.abspath(opts.workdir)
    # Its own name in the usage and errors: these are the arguments after --.
    args, bindings = flags.parse(flags.parser('mjax-launch -- (the mjax-train arguments)', ''), opts.train_args)
    self.gin_files = flags.gin_files(args)
    self.bindings = bindings
    total = opts.processes * (opts.devices or 1) if opts.devices else None
    # The trainers validate exactly the same way; failing here spares a launch.
    self.cfg = flags.load(self.gin_files, bindings, num_devices=total)
    self.fault_cfg = self.cfg.fault
    # Before anything is written (the trainers check the same, too late for
    # the driver's lock, events and logs): a workdir in another run's
    # checkpoint tier or in a folder that run writes.
    from mjax.checkpoint.guards import check_not_inside_a_tier, check_not_inside_a_workdir
    check_not_inside_a_tier(self.workdir)
    check_not_inside_a_workdir(self.workdir)
    from mjax.checkpoint import locks
    holder = locks.held_outside_a_driver(self.workdir, locks.OUTSIDE_RUN_WAIT_S)
    if holder is not None:
      raise UserError(f'--workdir {opts.workdir!r} is in use by a run started without mjax-launch ({holder}): '
                      f'this job\'s trainers would wait for it and give up. Stop that run first (SIGTERM saves '
                      f'it; the job then resumes from its checkpoint), or give another --workdir.')
    # A start refused below (a --bind it cannot listen on) leaves the
    # workdir as it found it: what this start made, it takes away.
    made = [d for d in (self.workdir, os.path.join(self.workdir, 'logs')) if not os.path.exists(d)]
    events_path = os.path.join(self.workdir, 'events.jsonl')
    made += [events_path] if not os.path.exists(events_path) else []
    try:
      os.makedirs(os.path.join(self.workdir, 'logs'), exist_ok=True)
      # Opened here, in the same guard: an existing workdir that cannot be
      # written (read-only, another user's) passes makedirs and fails first here.
      self.events = events_lib.EventLog(events_path, echo=None if opts.quiet else _echo)
    except OSError as e:
      raise UserError(f'--workdir {opts.workdir!r} cannot be made or written ({e.strerror or e}): the driver '
                      f'keeps events.jsonl and logs/ there, and the run its config and checkpoints; give a '
                      f'directory you can write, or a new path.') from None
    self.trainer = opts.trainer or _script('mjax-train') or [
        sys.executable, '-c', 'import sys; from mjax.cli import train_main; sys.argv[0] = "mjax-train"; train_main()']
    # The agents were started with the job's secret (MJAX_JOB_SECRET) before
    # the driver: it is theirs to share. Otherwise the driver makes one.
    self.secret = _agent_secret() if opts.executor == 'agent' else hb.new_secret()
    # This start's own id: its attempts count from 0 again, and the facts
    # an earlier driver's attempts left in the workdir are not theirs.
    self.run_id = secrets.token_hex(8)
    window = max(60.0, 2 * self.fault_cfg.heartbeat_timeout_s)
    self.clock_window_s = window
    try:
      # Acknowledged from the server's thread while the loop below watches,
      # and for as long as collective_timeout_s after it last did: a storage
      # stall of the driver's workdir is not a lost driver, and the job
      # tolerates that long without any supervision anyway (jax's own peer
      # heartbeat); a loop stuck longer lets its trainers go.
      self.server = hb.HeartbeatServer(opts.bind, self.secret, window,
                                       stall_s=self.fault_cfg.collective_timeout_s)
    except OSError as e:
      self._unmake(made)
      raise UserError(f'--bind {opts.bind}: cannot listen for heartbeats there (UDP): {e}; give an address '
                      f'of this machine (host:port, port 0 for any free one).') from None
    self.agents: Optional[agent_lib.AgentServer] = None
    if opts.executor == 'agent':
      # One connection per host: a common soft limit of 1,024 descriptors
      # would stop a large job's driver from accepting its agents.
      distributed.raise_open_files_limit()
      # TCP on the heartbeat server's port: one address for the agents.
      host, _ = hb.parse_address(opts.bind)
      port = int(self.server.address.rpartition(':')[2])
      try:
        self.agents = agent_lib.AgentServer(host, port, self.secret, self.fault_cfg.heartbeat_interval_s,
                                            self.fault_cfg.heartbeat_timeout_s, on_event=self.events.emit,
                                            save_timeout_s=detect.save_allowance(
                                                self.fault_cfg, self.cfg.checkpoint.io_timeout_s),
                                            stall_s=self.fault_cfg.collective_timeout_s)
      except OSError as e:
        self.server.close()
        self._unmake(made)
        raise UserError(f'--bind {opts.bind}: cannot listen for the agents there (TCP): {e}') from None
    if executor_factory is None:
      executor_factory = {'slurm': executor_lib.SlurmExecutor,
                          'agent': lambda host: agent_lib.AgentExecutor(self.agents, host)}.get(
                              opts.executor, LocalExecutor)
    self.executor_factory = executor_factory
    self.blocked = hosts_lib.BlockList(self.workdir)
    self.losses = detect.LossMonitor(self.fault_cfg.loss_spike_factor, self.fault_cfg.loss_spike_count)
    self.skip: Optional[tuple[int, int]] = None   # (checkpoint step, batches to skip after it)
    # After a loss spike: the step the next attempt resumes below (the steps
    # saved during the spike are set aside), until an attempt has resumed.
    self.restore_below: Optional[int] = None
    # Where tiers the driver cannot list are (host-local): the checkpoint the
    # trainers last said a restart resumes from, and the step the last
    # attempt resumed from (their start-up facts).
    self._resume_hint: Optional[int] = None
    self._last_resumed: Optional[int] = None
    self.pre_fault: Optional[tuple[int, float]] = None  # (step reached, wall time of the fault)
    self._signal: Optional[int] = None
    self._signals = 0
    self._signalled_at = 0.0
    self._rejected = events_lib.Throttle(5.0)   # heartbeat rejections, by kind
    self._unread_seen = 0   # the server's rejected_dropped already reported
    self.health = health_lib.HostChecks(opts, self.events, executor_factory, self.agents, self.blocked,
                                        opts.diagnose or _script('mjax-diagnose'), self.clock_window_s,
                                        self._stop_asked)
    self._launched = False
    self._over = False

  # --- main loop ----------------------------------------------------------------

  def run(self) -> int:
    """Supervises the job to its end; the exit status (EXIT_*)."""
    try:
      lock = _hold_driver_lock(self.workdir, self.opts.workdir)
    except UserError:
      if self.agents is not None:
        self.agents.close(linger_s=0.0)
      self.server.close()
      self.events.close()
      raise
    try:
      return self._run()
    finally:
      os.close(lock)   # the lock goes with it

  def _unmake(self, made: list[str]) -> None:
    """Takes away what a refused start made (`made`, in the order made): an
    events.jsonl only while it is still empty (another driver starting on
    the same new workdir may have written to it), directories only where
    empty."""
    self.events.close()
    for path in reversed(made):
      with contextlib.suppress(OSError):
        if os.path.isdir(path):
          os.rmdir(path)
        elif os.path.getsize(path) == 0:
          os.remove(path)

  def _buffer_warning(self) -> Optional[str]:
    """Direct heartbeats of every process into one socket: a receive buffer
    the kernel capped below what a beat of each holds drops heartbeats (4%
    at 10,000 processes with 416 KiB), read as lost processes."""
    need = self.opts.processes * HEARTBEAT_BUFFER_PER_PROCESS
    if self.agents is not None or self.server.receive_buffer >= need:
      return None
    return (f'the heartbeat socket\'s receive buffer is {self.server.receive_buffer >> 10} KiB, less than the '
            f'~{need >> 10} KiB {self.opts.processes} processes\' heartbeats need between two reads: some will be '
            f'dropped, and processes read as lost. Raise net.core.rmem_max (or run the driver as root), or run '
            f'one mjax-agent per host (--executor agent), which relays its processes\' heartbeats.')

  def _run(self) -> int:
    f = self.fault_cfg
    warning = self._buffer_warning()
    if warning:
      print(f'mjax-launch: warning: {warning}', file=sys.stderr, flush=True)
    self.events.emit('start', processes=self.opts.processes, devices=self.opts.devices,
                     receive_buffer=self.server.receive_buffer, **({'warning': warning} if warning else {}),
                     hosts=self.opts.hosts, spares=self.opts.spares, blocked=self.blocked.hosts(),
                     heartbeat_address=self.server.address, trainer=self.trainer,
                     train_args=self.opts.train_args, checkpoint_step=self._checkpoint_step(),
                     timeouts={k: getattr(f, k) for k in ('heartbeat_interval_s', 'heartbeat_timeout_s',
                                                          'progress_timeout_s', 'collective_timeout_s')},
                     max_restarts=f.max_restarts, pid=os.getpid())
    old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    restarts = 0      # in all, for the record
    streak = 0        # in a row without recovering: bounded by max_restarts
    self._over = False   # finished or given up: the agents may go (not after a pre-emption or a crash)
    try:
      while True:
        hosts = self._plan()
        if self._signal is not None:
          self.events.emit('preempted', attempt=restarts, during='waiting for hosts')
          return self.opts.preempt_exit_status
        if not hosts:
          return self._give_up(self._no_hosts(), restarts)
        try:
          hosts, bindings = self._fit(hosts)
        except hosts_lib.ElasticError as e:
          return self._give_up(str(e), restarts)
        att = self._launch(restarts, hosts, bindings)
        self._launched = True
        outcome = self._supervise(att)
        if att.monitor.max_step() is not None:
          self.restore_below = None   # resumed: the spiked steps are set aside
        if outcome == 'finished':
          self._stop(att, 'finished')
          step = att.monitor.max_step()
          if step is None and self._progress_visible():   # already finished: no step ran
            step = self._checkpoint_step() or None
          self.events.emit('finish', attempt=att.number, restarts=restarts, step=step)
          self._over = True
          return EXIT_OK
        if outcome == 'preempted':
          return self._preempt(att)
        fault = outcome
        self._on_fault(att, fault)
        if fault.kind == 'bad_input':
          self._stop(att, fault.kind)
          self.events.emit('giveup', reason=f'a process reported bad input (exit status 2), retrying '
                           f'cannot help: {fault.detail}', restarts=restarts)
          self._over = True
          return EXIT_BAD_INPUT
        self._stop(att, fault.kind)
        if self._signal is not None:
          self.events.emit('preempted', attempt=att.number, during='recovery')
          return self.opts.preempt_exit_status
        if fault.kind not in ('driver_held', 'signalled'):
          self._diagnose(att, fault)
        if self._signal is not None:   # a stop asked for while the hosts were checked
          self.events.emit('preempted', attempt=att.number, during='diagnosis')
          return self.opts.preempt_exit_status
        if fault.kind in ('nonfinite_loss', 'loss_spike'):
          self._rollback(att, fault)
        # Recovered: caught up with the step reached before the last fault,
        # and saved a checkpoint newer than the one it started from. The
        # heartbeats' step lags the real one by a few steps, so catching up
        # alone is also what an attempt that dies at the same step every
        # time does; a newer checkpoint is progress no restart undoes (where
        # the driver cannot list them, see _progressed).
        progressed = self._progressed(att)   # (every fault: it follows the attempts' resumed steps)
        if att.recovered and progressed:
          streak = 0
        if streak >= f.max_restarts:
          return self._give_up(f'max_restarts = {f.max_restarts} restarts in a row without getting back '
                               f'to the step reached before the fault', restarts)
        restarts += 1
        streak += 1
        backoff = min(MAX_BACKOFF_S, f.restart_backoff_s * 2 ** (streak - 1))
        # (None: the checkpoints are where the driver cannot list them.)
        self.events.emit('restart', attempt=restarts, restarts=restarts, in_a_row=streak, backoff_s=backoff,
                         fault=fault.kind,
                         checkpoint_step=self._checkpoint_step() if self._progress_visible() else None)
        # Up to a minute: a stop signal ends it (time.sleep resumes after one).
        end = time.monotonic() + backoff
        while self._signal is None and time.monotonic() < end:
          time.sleep(min(0.1, max(0.0, end - time.monotonic())))
        if self._signal is not None:
          self.events.emit('preempted', attempt=restarts, during='back-off')
          return self.opts.preempt_exit_status
    finally:
      for s, h in old.items():
        signal.signal(s, h)
      if self.agents is not None:
        # The job is over: the agents stop too. After a pre-emption or a
        # crash of the driver they stay, for the driver that comes next.
        if self._over:
          self.agents.farewell('the job is over')
        self.agents.close(linger_s=5.0 if self._over else 0.0)
      self.server.close()
      self.events.close()

  def _on_signal(self, signum, frame) -> None:
    if protocol.repeated_term(signum, self._signal, self._signalled_at):
      return   # the same stop delivered twice: not one that cuts the saves
    self._signal = signum
    self._signals += 1
    self._signalled_at = time.monotonic()

  def _give_up(self, reason: str, restarts: int) -> int:
    self.events.emit('giveup', reason=reason, restarts=restarts)
    self._over = True
    return EXIT_GAVE_UP

  def _progress_visible(self) -> bool:
    """Whether every checkpoint a restart may resume from is one the driver
    sees (`_checkpoint_step`): not with checkpoints off, nor with a fast tier
    in the hosts' own memory (host scope, or /dev/shm of machines other than
    the driver's)."""
    ck = self.cfg.checkpoint
    if not ck.enabled:
      return False
    return not ck.fast_every or (ck.fast_scope == 'shared' and self.opts.executor == 'local')

  def _resume_step(self) -> int:
    """The checkpoint step the next attempt resumes from, as far as the
    driver knows: the newest it sees (below restore_below), or, with tiers
    it cannot list, the one the trainers last said (a rollback's)."""
    found = self._checkpoint_step(self.restore_below)
    if self._resume_hint is not None and not self._progress_visible() and \
        (self.restore_below is None or self._resume_hint < self.restore_below):
      found = max(found, self._resume_hint)
    return found

  def _progressed(self, att: Attempt) -> bool:
    """Whether the job got further than a restart undoes, judged at the
    fault that ended `att`: a checkpoint newer than the one it started from.
    Where the driver cannot list the checkpoints (a host-local fast tier),
    the steps the trainers resumed from (their start-up facts) stand in: an
    attempt that resumed from a newer step than the one before it shows
    that one saved. Later by an attempt, but a job that dies at the same
    step every time resumes from the same step every time, and gives up.
    Without checkpoints, catching up is all there is."""
    resumed = next((r for r in ((self._facts(att, i).get(protocol.STARTUP) or {}).get('resumed_step')
                                for i in att.handles) if isinstance(r, int)), None)
    if self._progress_visible():
      # Against the step the trainers say they resumed from, where they
      # said: the newest step on disk at launch may be one they found
      # damaged and set aside (or a stray numbered folder), and newer
      # steps than the one before it were progress all the same.
      return self._checkpoint_step() > (att.checkpoint_at_launch if resumed is None else resumed)
    if not self.cfg.checkpoint.enabled:
      return True
    before, self._last_resumed = self._last_resumed, resumed if resumed is not None else self._last_resumed
    return resumed is None or before is None or resumed > before

  def _checkpoint_step(self, below: Optional[int] = None) -> int:
    """The newest complete checkpoint over both tiers (0: none yet), below
    step `below` where given."""
    if not self.cfg.checkpoint.enabled:
      return 0
    from mjax.checkpoint.directories import saved_steps
    found = [s for s, _, _ in saved_steps(self.cfg.checkpoint, self.workdir) if below is None or s < below]
    return found[0] if found else 0

  def _plan(self) -> list[str]:
    """The hosts of the next attempt (mjax/ft/hosts.py); with agents, only
    hosts whose agent is connected, waiting up to --agent_wait_s for them."""
    o = self.opts
    if self.agents is None:
      return hosts_lib.plan_hosts(o.processes, o.hosts, o.spares, self.blocked)
    if o.discover:   # the connected agents, in name order; those beyond --processes are spares
      deadline = time.monotonic() + o.agent_wait_s
      while True:
        usable = [h for h in self.agents.connected() if h not in self.blocked]
        if len(usable) >= o.processes or time.monotonic() >= deadline or self._signal is not None:
          break
        time.sleep(0.05)
      pool = usable
    else:
      # At start, every planned host's agent is waited for; after a fault,
      # only enough of them (a lost host must not hold up the restart).
      wanted = hosts_lib.plan_hosts(o.processes, o.hosts, o.spares, self.blocked)
      # (Not a host whose agent said it was stopping and went: an evicted
      # node is not coming back soon; --agent_wait_s for it held the job up.)
      candidates = wanted if not self._launched else [
          h for h in [*o.hosts, *o.spares]
          if h not in self.blocked and not (h in self.agents.departed and self.agents.link(h) is None)]
      self.agents.wait_for(candidates, o.agent_wait_s, enough=min(o.processes, len(candidates)),
                           go_on=lambda: self._signal is None)
      # A host without an agent sits this attempt out (not blocked: its agent
      # may just be late); a spare takes its place where there is one.
      pool = [h for h in [*o.hosts, *o.spares] if h not in self.blocked and self.agents.link(h) is not None]
    # A host whose agent was away when the hosts were diagnosed is checked
    # now that it is back, before it runs anything: those this attempt would
    # take, all at once (as after a fault), until every host it takes has
    # passed. One whose agent goes again meanwhile sits the attempt out.
    away: set[str] = set()
    while True:
      hosts = [h for h in pool if h not in self.blocked and h not in away][:o.processes]
      if not any(h in self.health.undiagnosed for h in hosts):
        break
      away |= self.health.diagnose_late(hosts)
    missing = sorted(set(o.hosts) - set(self.blocked.hosts()) - set(self.agents.connected()))
    self.events.emit('agents', connected=self.agents.connected(), chosen=hosts, missing=missing)
    return hosts

  def _no_hosts(self) -> str:
    """Why `_plan` found no host to run on: every host blocked, or (with
    agents) none of the others' agents connected in time, and what the
    driver refused meanwhile (a wrong job secret)."""
    o = self.opts
    path = os.path.join(self.workdir, hosts_lib.BLOCKED_FILE)
    blocked = self.blocked.hosts()
    why = (f'no healthy host left: {", ".join(blocked) or "none"} blocked in {path} (each with its reason); '
           f'take a host out of that file once it is repaired, or add hosts (--hosts, --spares)')
    if self.agents is None:
      return why
    waited = [h for h in [*o.hosts, *o.spares] if h not in blocked]
    if not waited and o.hosts:
      return why
    # Agents sent a stop signal (an scancel of their step, an eviction) said
    # so and left: not waited for, and not to be reported as late.
    gone = [h for h in waited if h in self.agents.departed and self.agents.link(h) is None]
    late = [h for h in waited if h not in gone]
    why = '; '.join(
        ([f'the agent(s) of host(s) {", ".join(gone)} were sent a stop signal (their node evicted or drained, '
          f'their job step cancelled) and left'] if gone else []) +
        ([f'no agent {"of hosts " + ", ".join(late) + " " if late else ""}connected within '
          f'--agent_wait_s {o.agent_wait_s:g}s'] if late or not gone else []))
    refusals = dict(self.agents.refusals)
    if refusals:
      why += '; the driver refused ' + '; '.join(
          f'{host or "an agent"}: {reason}' for host, reason in refusals.values())
      if any(r.startswith('bad signature') for _, r in refusals.values()):
        why += f' ({protocol.SECRET_ENV} must be the same for the driver and every agent of the job)'
    if blocked:
      why += f'; blocked in {path}: {", ".join(blocked)}'
    return why

  def _fit(self, hosts: list[str]) -> tuple[list[str], list[str]]:
    """The most of `hosts` the job can run on, keeping its global batch, and
    the bindings for that. One host lost of 64, with no spare, leaves 63,
    whose replicas do not split a batch of 64 into equal slices: the job
    goes on on 32 and the other 31
    wait as spares, rather than giving up."""
    first, devices = None, self._devices()
    for n in range(len(hosts), 0, -1):
      try:
        bindings = self._elastic(n, devices)
      except hosts_lib.ElasticError as e:
        first = first or e
        if devices is None:
          break   # no smaller count can be laid out either
        continue
      if n < len(hosts):
        self.events.emit('elastic', hosts=n, healthy=len(hosts), idle=hosts[n:], why=str(first))
      return hosts[:n], bindings
    raise first

  def _devices(self) -> Optional[int]:
    """Devices per process: --devices (fake CPU devices), else what the
    trainers recorded (protocol.DEVICES). Laid out for one device each, a
    job of 8-GPU hosts with tensor = 8 could never shrink."""
    return self.opts.devices or protocol.devices_per_process(self.workdir)

  def _elastic(self, n: int, devices: Optional[int]) -> list[str]:
    """Bindings for running on n hosts of `devices` each instead of the
    --processes asked for."""
    if n == self.opts.processes:
      return []
    if devices is None:
      raise hosts_lib.ElasticError(
          f'cannot continue on {n} of {self.opts.processes} hosts: no process of this job has said how '
          f'many devices it has (none started in this workdir), so the smaller layout cannot be '
          f'computed. Give spares (--spares) or bring the blocked hosts back.')
    extra = hosts_lib.elastic_bindings(self.cfg, self.opts.processes, n, devices)
    hosts_lib.check_bindings(self.gin_files, self.bindings + extra, n * devices)
    return extra

  # --- launching --------------------------------------------------------------

  def _launch(self, number: int, hosts: list[str], bindings: list[str]) -> Attempt:
    from mjax import launch
    self.server.watching()   # the first trainers beat while the last ones start
    if self.agents is not None:
      self.agents.watching()
    n = len(hosts)
    executors = [self.executor_factory(h) for h in hosts]
    coordinator = executors[0].coordinator(launch.free_port())
    skip = 0
    resume_at = self._resume_step()
    if self.skip is not None and self.skip[0] == resume_at:
      skip = self.skip[1]   # still resuming from the rolled-back checkpoint
    if skip:
      bindings = [*bindings, f'{protocol.SKIP_BATCHES_KEY} = {skip}', f'{protocol.SKIP_AFTER_KEY} = {resume_at}']
    if self.restore_below is not None:
      bindings = [*bindings, f'{protocol.RESTORE_BELOW_KEY} = {self.restore_below}']
    argv = [*self.trainer, *self.opts.train_args, '--workdir', self.workdir,
            *[f'--gin_param={b}' for b in bindings]]
    ck = self.cfg.checkpoint
    restoring = bool(resume_at) or (ck.enabled and bool(ck.restore_from))
    monitor = detect.Monitor(self.fault_cfg, self.losses, attempt=number, io_timeout_s=ck.io_timeout_s,
                             restoring=restoring)
    self.losses.new_attempt()
    handles, logs, now = {}, {}, time.monotonic()
    for i, (host, ex) in enumerate(zip(hosts, executors)):
      env = launch.local_env(i, n, coordinator, self.opts.devices)
      env.update({protocol.DRIVER_ADDRESS_ENV: self.server.address, protocol.SECRET_ENV: self.secret,
                  protocol.HOST_ENV: host, protocol.ATTEMPT_ENV: str(number), protocol.DRIVER_RUN_ENV: self.run_id,
                  'PYTHONUNBUFFERED': '1'})
      env.update(self.opts.host_env.get(host, {}))
      log = os.path.join(self.workdir, 'logs', f'process-{i}.log')
      with open(log, 'ab') as fh:
        fh.write(f'=== mjax-launch attempt {number}: process {i} of {n} on {host} ===\n'.encode())
      logs[i] = (log, _size(log))
      handles[i] = ex.start(argv, env, log)
      # A remote handle's pid is the local client's; the attempt number in
      # the heartbeats then tells this attempt's processes from older ones.
      monitor.add(i, host, None if getattr(ex, 'remote', False) else handles[i].pid, now)
    self.events.emit('launch', attempt=number, hosts=hosts, processes=n,
                     pids=[handles[i].pid for i in range(n)], bindings=bindings, skip_data_steps=skip,
                     coordinator=coordinator)
    return Attempt(number, hosts, handles, executors, logs, monitor, bindings, now,
                   checkpoint_at_launch=resume_at)

  # --- watching ---------------------------------------------------------------

  def _supervise(self, att: Attempt):
    """Returns 'finished', 'preempted' or the first Fault."""
    f = self.fault_cfg
    watch = _StragglerWatch(self.workdir, set(att.handles), f, every_s=max(5.0, 5 * f.heartbeat_interval_s))
    flagged: set[int] = set()
    try:
      result = self._watch(att, watch, flagged)
    except BaseException:
      watch.close()
      raise
    # A job that finished gets one last analysis of what its processes wrote
    # since the previous one: a process slow only in the last seconds of the
    # run is named too (reported, never evicted: there is nothing to evict from).
    late = watch.close(final=result == 'finished')
    if result == 'finished':
      self._stragglers(att, flagged, late, finished=True)
      for note in watch.pace_notes:
        self._pace_event(att, note)
    return result

  def _watch(self, att: Attempt, watch: '_StragglerWatch', flagged: set):
    tick = min(0.1, self.fault_cfg.heartbeat_interval_s / 4)
    next_scan = 0.0
    self._last_watch = time.monotonic()
    while True:
      if self._signal is not None:
        return 'preempted'
      self._watching(att)
      for payload, reason, sender in self.server.receive(tick):
        now = time.monotonic()
        if payload is None:
          self._rejected_heartbeat(reason, sender)
          continue
        fault = att.monitor.beat(payload, now)
        if fault is not None:
          return fault
      if self.agents is not None:   # heartbeats relayed by the hosts' agents, verified there
        self.agents.watching()
        now = time.monotonic()
        for payload in self.agents.take_beats():
          try:
            fault = att.monitor.beat(payload, now)
          except (KeyError, TypeError, ValueError):
            continue   # an agent of this job relaying a malformed payload: ignore it
          if fault is not None:
            return fault
      # The scans below are O(processes): once per tick, not after every
      # batch of datagrams (thousands of senders keep the socket busy).
      now = time.monotonic()
      if now < next_scan:
        continue
      next_scan = now + tick
      self._progress_events(att)   # writes events and reads facts: where slow storage holds the loop
      self._watching(att)
      codes = {i: h.poll() for i, h in att.handles.items()}
      for i, c in codes.items():
        if c is not None and att.monitor.procs[i].exited is None:
          att.monitor.procs[i].exited = c
      failed = {i: c for i, c in codes.items() if c not in (None, 0)}
      if failed:
        return self._exit_fault(att, failed)
      if all(c == 0 for c in codes.values()):
        return self._signalled(att) or 'finished'
      fault = att.monitor.check(now)
      if fault is not None:
        return fault
      fault = self._stragglers(att, flagged, watch.take())
      for note in watch.pace_notes:
        self._pace_event(att, note)
      watch.pace_notes.clear()
      if fault is not None:
        return fault

  def _watching(self, att: Attempt) -> None:
    """The loop is here: the heartbeat server may acknowledge on; a gap
    since the last call longer than heartbeat_timeout_s is said."""
    held = self.server.watching()
    now = time.monotonic()
    if now - self._last_watch > self.fault_cfg.heartbeat_timeout_s:
      self._stalled(att, now - self._last_watch, held)
    self._last_watch = now

  def _stalled(self, att: Attempt, seconds: float, held: float = 0.0) -> None:
    """The loop itself was held up (storage under events.jsonl or the facts
    files, a paused driver): said, since every timeout was late by as much.
    `held`: the longest the heartbeat server's thread went without a turn
    meanwhile; past heartbeat_timeout_s, the whole process was held and
    nothing acknowledged the trainers."""
    allowance, timeout = self.fault_cfg.collective_timeout_s, self.fault_cfg.heartbeat_timeout_s
    whole = held > timeout
    if whole:
      acked = (f'the whole driver process was held {held:,.1f}s (stopped, or its machine or container frozen), '
               f'its heartbeat server with it: no acknowledgement reached the trainers for longer than '
               f'heartbeat_timeout_s, so they save and stop by themselves (exit status 4) and are restarted')
    elif seconds < allowance:
      acked = (f'its heartbeat server kept acknowledging the trainers, as it does for up to '
               f'collective_timeout_s = {allowance:g}s')
    else:
      acked = (f'its heartbeat server stopped acknowledging the trainers after collective_timeout_s = '
               f'{allowance:g}s, so they save and stop by themselves (exit status 4) and are restarted')
    kept = seconds < allowance and not whole
    att.trainers_let_go = att.trainers_let_go or not kept
    self.events.emit('driver_stalled', attempt=att.number, seconds=round(seconds, 3),
                     trainers_kept=kept, process_held=whole,
                     detail=f'the driver\'s loop was held up {seconds:,.1f}s (longer than heartbeat_timeout_s = '
                            f'{timeout:g}s); {acked}; the checks resume now. ' +
                            ('A SIGSTOP (Ctrl-Z), a paused container or a VM migration is the usual cause.' if whole
                             else f'Slow storage under {self.workdir} is the usual cause.'))

  def _signalled(self, att: Attempt) -> Optional[detect.Fault]:
    """Where every trainer exited 0 but stopped short of the last step (the
    facts say so), the fault: a stop signal that reached trainers and not
    the driver, whose own stop is handled before this (`_watch`)."""
    stopped = {i: f[protocol.STOPPED] for i in att.handles
               if isinstance((f := self._facts(att, i)).get(protocol.STOPPED), dict)}
    if not stopped or not self.cfg.checkpoint.enabled:   # nothing saved to go on from
      return None
    got = sorted(i for i, v in stopped.items() if v.get('signal')) or sorted(stopped)
    steps = [v['step'] for v in stopped.values() if isinstance(v.get('step'), int)]
    signal_name = next((stopped[i]['signal'] for i in got if stopped[i].get('signal')), 'a stop signal')
    return detect.Fault('signalled', got, f'{signal_name} to process(es) {", ".join(map(str, got))} (not to the '
                        f'driver): every process stopped after step {max(steps) if steps else "?"}, saved, and '
                        f'exited 0 short of the last step; restarted from that checkpoint',
                        step=max(steps) if steps else None)

  def _exit_fault(self, att: Attempt, failed: dict) -> detect.Fault:
    codes = {i: self._describe_status(c) for i, c in failed.items()}
    if protocol.EXIT_USER_ERROR in failed.values():
      procs = sorted(i for i, c in failed.items() if c == protocol.EXIT_USER_ERROR)
      error = next((f[protocol.USER_ERROR] for f in (self._facts(att, i) for i in procs)
                    if isinstance(f.get(protocol.USER_ERROR), str)), None)
      return detect.Fault('bad_input', procs, error or 'exit status 2 (configuration, data or usage error)',
                          extra={'exit': codes})
    if protocol.EXIT_NONFINITE in failed.values():
      procs = sorted(i for i, c in failed.items() if c == protocol.EXIT_NONFINITE)
      return detect.Fault('nonfinite_loss', procs, 'exit status 3 (non-finite loss)',
                          step=self._nan_step(att, procs), extra={'exit': codes})
    if protocol.EXIT_DRIVER_LOST in failed.values():
      what = 'stopped: heard nothing from the driver for heartbeat_timeout_s'
      if set(failed.values()) == {protocol.EXIT_DRIVER_LOST} and att.trainers_let_go:
        # Every trainer that stopped did so, saved, because the driver was
        # unreachable, and the driver knows it was held up itself (a host
        # whose own link to the driver failed is no such case: diagnosed):
        # nothing of the hosts' to diagnose, no link to check.
        return detect.Fault('driver_held', sorted(failed), f"{what} (the driver's own hold-up, not the hosts')",
                            extra={'exit': codes})
      return detect.Fault('exit', sorted(failed), what, extra={'exit': codes})   # and more went wrong
    for i in range(len(att.hosts)):   # not only those gone yet: each records it
      fact = self._facts(att, i).get(protocol.HOST_FAULT)
      if isinstance(fact, dict) and isinstance(fact.get('processes'), list):
        # The trainers found it in a few processes only (their hosts' storage):
        # the others passed the same check.
        named = sorted({int(p) for p in fact['processes']
                        if isinstance(p, int) and 0 <= p < len(att.hosts)})
        if named:
          return detect.Fault('host_fault', named, str(fact.get('what', 'a fault of these hosts')),
                              extra={'exit': codes})
    going = {i: s for i in failed if (s := getattr(getattr(att.handles[i], 'link', None), 'stopping', None))}
    if going and all(failed[i] in (protocol.EXIT_INTERRUPTED, protocol.EXIT_TERMINATED) for i in going) and all(
        self._facts(att, i).get(protocol.PEER_LOST) is not None or self._aborted_by_jax_for_a_peer(att, i, failed[i])
        for i in set(failed) - set(going)):
      # Their agents were sent a stop signal (a node evicted or drained):
      # a trainer stopped in start-up exits 143, as mjax-train by hand does,
      # and its peers' collectives fail after it. A stop to restart from
      # the newest checkpoint, not a host to diagnose.
      procs = sorted(going)
      return detect.Fault('signalled', procs, f'{next(iter(going.values()))} to the agent(s) of process(es) '
                          f'{", ".join(map(str, procs))}, which stopped them in start-up (status 143: before any '
                          f'step to save); restarted from the newest checkpoint', extra={'exit': codes})
    stops = (protocol.EXIT_INTERRUPTED, protocol.EXIT_TERMINATED)
    by_signal = sorted(i for i, c in failed.items() if c in stops)
    if by_signal and all(
        failed[i] in stops or self._facts(att, i).get(protocol.PEER_LOST) is not None
        or self._aborted_by_jax_for_a_peer(att, i, failed[i]) for i in failed):
      # A stop signal that reached trainers in start-up and not the driver
      # (whose own stop is handled before this): a trainer stopped there
      # says so with 143 (130 for SIGINT), as mjax-train by hand does, and
      # its peers' collectives fail after it. Nothing of its host's to
      # diagnose; where the node is going away, the restart finds it lost.
      status = failed[by_signal[0]]
      name = 'SIGTERM' if status == protocol.EXIT_TERMINATED else 'SIGINT'
      return detect.Fault('signalled', by_signal, f'{name} to process(es) {", ".join(map(str, by_signal))} (not to '
                          f'the driver), which stopped in start-up (status {status}: before any step to save); '
                          f'restarted from the newest checkpoint', extra={'exit': codes})
    lost = sorted(i for i in failed if getattr(att.handles[i], 'host_lost', False))
    if lost:   # its agent disconnected or fell silent (an exit status cannot say so: any is a trainer's)
      codes.update({i: 'host lost' for i in lost})
      return detect.Fault('host_lost', lost, 'the host\'s agent went away (connection lost or silent for '
                          'heartbeat_timeout_s)', extra={'exit': codes})
    # Failed while joining the job, with processes never heard from: those
    # are what the others waited for (jax does not say whom), stopped or
    # wedged before their first heartbeat. Blaming the ones that timed out
    # restarted onto the bad host again and again.
    procs = att.monitor.procs
    # Silent for a heartbeat timeout at least: not merely still importing.
    now = time.monotonic()
    silent = sorted(p.process for p in procs.values() if p.first_beat is None and p.exited is None
                    and now - p.started >= self.fault_cfg.heartbeat_timeout_s)
    if silent and all(procs[i].phase == 'startup:join' for i in failed if i in procs):
      return detect.Fault('startup_timeout', silent,
                          f'never heard from: process(es) {", ".join(map(str, silent[:8]))}'
                          f'{" and more" if len(silent) > 8 else ""}, while process(es) '
                          f'{", ".join(map(str, sorted(failed)[:8]))} gave up waiting for them to join the job',
                          extra={'exit': codes, 'heartbeating': sorted(set(procs) - set(silent))})
    # Processes whose collectives failed because a peer left first (their
    # facts say so) are the fault's consequence: blaming them too left no
    # healthy host for the link check, and diagnosed healthy ones.
    followed = {i for i in failed if self._facts(att, i).get(protocol.PEER_LOST) is not None
                or self._aborted_by_jax_for_a_peer(att, i, failed[i])}
    # How each named process ended, in the detail a person reads first (a
    # SIGKILL, the OOM killer's, reads differently from a crash's status 1).
    def how(named: list[int]) -> str:
      said = ', '.join(f'process {i}: {codes[i]}' for i in named[:8])
      return f'exited abnormally ({said}{", ..." if len(named) > 8 else ""})'

    if followed and len(followed) < len(failed):
      named = sorted(set(failed) - followed)
      return detect.Fault('exit', named, how(named), extra={'exit': codes, 'peers_left_after': sorted(followed)})
    return detect.Fault('exit', sorted(failed), how(sorted(failed)), extra={'exit': codes})

  def _aborted_by_jax_for_a_peer(self, att: Attempt, process: int, code: Optional[int]) -> bool:
    """Whether jax's coordination client aborted `process` (SIGABRT) because
    another task died: when the process hosting the coordination service
    (process 0) goes, the others are killed in C++ before any Python runs,
    so they cannot record PEER_LOST; jax's last words in their log say it."""
    # (-SIGABRT from a local process; 128 + SIGABRT from a remote client's status.)
    if code not in (-signal.SIGABRT, 128 + signal.SIGABRT) or process not in att.logs:
      return False
    path, offset = att.logs[process]
    tail = _read_from(path, max(offset, _size(path) - (64 << 10)))
    return _JAX_PEER_ABORT in tail

  def _facts(self, att: Attempt, process: int) -> dict:
    """What process `process` of this attempt recorded for the driver (mjax/protocol.py)."""
    return protocol.read_facts(self.workdir, process, att.number, self.run_id)

  @staticmethod
  def _describe_status(code: Optional[int]) -> str:
    """'SIGKILL' for a process a signal ended; 'status 143 (SIGTERM)' for
    one that exited with 128 + a signal's number: a trainer stopped in its
    start-up, or a remote process through its launcher, which reports the
    signal that way."""
    if code is None:   # no status: still there after SIGKILL
      return 'not exited'
    if code < 0:
      try:
        return signal.Signals(-code).name
      except ValueError:
        return f'signal {-code}'
    if 128 < code < 128 + signal.NSIG:
      with contextlib.suppress(ValueError):
        return f'status {code} ({signal.Signals(code - 128).name})'
    return f'status {code}'

  def _nan_step(self, att: Attempt, procs: list[int]) -> Optional[int]:
    """The step whose loss was non-finite, as the trainer recorded it."""
    for i in procs:
      step = (self._facts(att, i).get(protocol.NONFINITE) or {}).get('step')
      if isinstance(step, int):
        return step
    step = att.monitor.max_step()
    return None if step is None else step + 1

  def _rejected_heartbeat(self, reason: str, sender: tuple) -> None:
    """Logged, at most once per kind of reason per 5 s (a flood must not
    flood the log). The kind is the reason's first word ('malformed',
    'stale', ...): its details carry numbers (a size, a clock offset), and a
    flood that varies them would otherwise make each one a reason of its own."""
    suppressed = self._rejected.admit(reason.partition(':')[0])
    if suppressed is None:
      return
    # Rejections the server let go of while this loop was held up (it keeps
    # the last 1,024): counted, of no kind, on the next event written.
    unread = self.server.rejected_dropped - self._unread_seen
    self._unread_seen += unread
    self.events.emit('heartbeat_rejected', reason=reason, sender=f'{sender[0]}:{sender[1]}',
                     suppressed_before=suppressed, **({'unread': unread} if unread else {}))

  def _progress_events(self, att: Attempt) -> None:
    m = att.monitor
    if not att.running and m.everyone_running():
      att.running = True
      self.events.emit('running', attempt=att.number, seconds=round(time.monotonic() - att.started, 3))
    p0 = m.procs.get(0)
    if not att.startup_reported and p0 is not None and p0.step is not None:
      report = self._facts(att, 0).get(protocol.STARTUP)
      if isinstance(report, dict):
        att.startup_reported = True
        self.events.emit('startup', attempt=att.number, **report)
    if self.pre_fault is not None:
      low = m.min_step()
      if low is not None and low >= self.pre_fault[0]:
        self.events.emit('caught_up', attempt=att.number, step=low,
                         seconds_since_fault=round(time.time() - self.pre_fault[1], 3))
        self.pre_fault = None
        att.recovered = True

  def _pace_event(self, att: Attempt, note: dict) -> None:
    """The whole job slower than earlier in the attempt (or back to its
    pace): no process stands out, so nothing is evicted; the event says
    when; the device-time samples (mjax/ft/device_time.py) name which rank."""
    factor = note['pace_s'] / note['baseline_s']
    detail = (f'the job\'s steps take {note["pace_s"] * 1e3:,.0f} ms, x{factor:.2f} its pace earlier in this '
              f'attempt ({note["baseline_s"] * 1e3:,.0f} ms), and no process ends its steps later than the others: '
              'a process slow inside the step (a throttled device, a host stalled while its part of a '
              'collective is due) holds them all; the sampled device times (FaultConfig.device_timing_every) '
              'name it as a straggler within three samples, and mjax-diagnose on each host can confirm it'
              if note['slowed'] else
              f'the job is back to {note["pace_s"] * 1e3:,.0f} ms a step (x{factor:.2f} of its earlier pace)')
    self.events.emit('job_slowdown' if note['slowed'] else 'job_pace_recovered', attempt=att.number,
                     pace_s=round(note['pace_s'], 6), baseline_s=round(note['baseline_s'], 6),
                     factor=round(factor, 3), detail=detail)

  def _stragglers(self, att: Attempt, flagged: set, found: list, finished: bool = False) -> Optional[detect.Fault]:
    """Events for newly found stragglers; a fault with evict_stragglers
    (never once the job has `finished`)."""
    f = self.fault_cfg
    for s in found:
      if s.process in flagged:
        continue
      flagged.add(s.process)
      host = att.hosts[s.process]
      fields = {**s.to_json(), 'timing_host': s.host, 'host': host}   # host: the driver's name for it
      # Evicting the last host would end the job; slow is better than stopped.
      evict = f.evict_stragglers and not finished and self._can_run_without(host)
      # Described with the driver's name for its host, as the event's `host`
      # (its timings carry the machine's own, `timing_host`: 'vm' for 'slot1').
      detail = dataclasses.replace(s, host=host).describe() + (' (found as the job finished)' if finished else
                               '' if evict or not f.evict_stragglers else
                               f' (not evicted: no host left to run on without {host})')
      self.events.emit('straggler', attempt=att.number, detail=detail, evict=evict, **fields)
      if evict:
        return detect.Fault('straggler', [s.process], s.describe())
    return None

  def _can_run_without(self, host: str) -> bool:
    """Whether another healthy host (of the job, a spare, a connected agent) is left."""
    pool = [*self.opts.hosts, *self.opts.spares]
    if self.opts.discover and self.agents is not None:
      pool += list(self.agents.connected())
    return any(h != host and h not in self.blocked for h in pool)

  # --- recovering -------------------------------------------------------------

  def _on_fault(self, att: Attempt, fault: detect.Fault) -> None:
    m = att.monitor
    step = m.max_step()
    if step is not None and (self.pre_fault is None or step > self.pre_fault[0]):
      self.pre_fault = (step, time.time())
    elif self.pre_fault is not None:
      self.pre_fault = (self.pre_fault[0], time.time())
    named = set(fault.processes)
    phases = {i: p.phase for i, p in m.procs.items()}
    extra = dict(fault.extra)
    if len(m.procs) > EVENT_PROCESSES:
      # At 10,000 processes one fault line of every process's phase, logs
      # and stall was 3.4 MB: the named processes whole, the rest counted.
      extra['phase_counts'] = dict(collections.Counter(str(v) for v in phases.values()).most_common())
      phases = {i: v for i, v in phases.items() if i in named}
      if isinstance(extra.get('stalled'), dict) and len(extra['stalled']) > EVENT_PROCESSES:
        extra['stalled_count'] = len(extra['stalled'])
        extra['stalled'] = {i: v for i, v in extra['stalled'].items() if i in named}
    logs = {i: p.logs for i, p in m.procs.items() if p.logs and (len(m.procs) <= EVENT_PROCESSES or i in named)}
    self.events.emit('fault', kind=fault.kind, attempt=att.number, processes=fault.processes,
                     hosts=[att.hosts[i] for i in fault.processes], detail=fault.detail,
                     step=fault.step, reached_step=step, phases=phases, last_logs=logs, **extra)
    if fault.kind in ('hang', 'heartbeat_lost', 'startup_timeout'):
      # Named in the fault event first, then asked where they are: the
      # stacks show what each process was waiting for (trainers heartbeat
      # from early in start-up, so a stuck restore or compile answers too).
      self._dump_stacks(att, fault.processes)

  def _dump_stacks(self, att: Attempt, named: Optional[Sequence[int]] = None) -> None:
    """SIGUSR1 to every process that can take it (it has heartbeated, so
    faulthandler is registered), then the top frames of each into the events."""
    asked = {}
    wanted = set(att.handles)
    if len(wanted) > EVENT_PROCESSES:
      # Of thousands, the named ones and a sample of the others (where they
      # wait): every one's stack was 10,000 log reads and events.
      ordered = sorted(wanted)
      sample = {ordered[round(k * (len(ordered) - 1) / (STACK_SAMPLE - 1))] for k in range(STACK_SAMPLE)}
      wanted = set(named or ()) | sample
    for i, h in att.handles.items():
      if i in wanted and h.poll() is None and att.monitor.procs[i].first_beat is not None:
        asked[i] = _size(att.logs[i][0])
        try:
          h.send_signal(signal.SIGUSR1)
        except ProcessLookupError:
          pass
    if not asked:
      return
    time.sleep(STACK_WAIT_S)
    for i, offset in asked.items():
      path = att.logs[i][0]
      self.events.emit('stack_dump', attempt=att.number, process=i, host=att.hosts[i], log=path,
                       step=att.monitor.procs[i].step, phase=att.monitor.procs[i].phase,
                       threads=detect.parse_stacks(_read_from(path, offset))[:8])

  def _terminate(self, att: Attempt, wait_s: float, patient=lambda: True, save: bool = True) -> list[int]:
    """SIGTERM to every live process (a trainer saves and exits), SIGKILL to
    those still alive after `wait_s` or once `patient()` turns False (at
    once, with save=False); returns the processes killed."""
    from mjax import launch
    killed = launch.terminate(att.handles, wait_s, lambda i, h: att.executors[i].kill(h), patient, save=save)
    # One deadline for them all: k stuck processes cost KILL_WAIT_S, not k times it.
    deadline = time.monotonic() + KILL_WAIT_S
    for h in att.handles.values():
      try:
        h.wait(timeout=max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        # Not gone a minute after SIGKILL (a process stuck in the kernel, a
        # wedged device): the host cannot be trusted with the next attempt.
        # A local process keeps no status (returncode None): it is marked
        # the same way, for the events.
        if hasattr(h, '_exited'):
          h._exited(protocol.EXIT_HOST_LOST, host_lost=True)
        else:
          try:
            h.host_lost = True
          except AttributeError:
            pass
    return killed

  def _exit_statuses(self, att: Attempt) -> dict:
    return {i: 'host lost' if getattr(h, 'host_lost', False) else self._describe_status(h.returncode)
            for i, h in att.handles.items()}

  def _stop(self, att: Attempt, why: str) -> None:
    """Stops the job after a fault or at the end, with --grace_s to save;
    after a loss spike without a save: the state is spiked, and its save
    would make the tiers delete their oldest step, the good one from before
    the spike that the rollback needs."""
    t0 = time.monotonic()
    killed = self._terminate(att, self.opts.grace_s, save=why != 'loss_spike')
    if why != 'finished' or killed:
      self.events.emit('stopped', attempt=att.number, why=why, seconds=round(time.monotonic() - t0, 3),
                       killed=killed, exit=self._exit_statuses(att))

  def _diagnose(self, att: Attempt, fault: detect.Fault) -> None:
    """mjax-diagnose on every host of the attempt (mjax/ft/health.py)."""
    self.health.after_fault(att.hosts, fault)

  def _stop_asked(self) -> bool:
    return self._signal is not None

  def _rollback(self, att: Attempt, fault: detect.Fault) -> None:
    """After a numerical fault: back to the newest checkpoint (always a
    finite state; after a loss spike, the newest from before it began),
    skipping the data from there to the bad step."""
    first = fault.extra.get('first_step') if fault.kind == 'loss_spike' else None
    if isinstance(first, int) and self._checkpoint_step(first - 1):
      # Steps saved during the spike are finite, but spiked (a fast tier
      # saves every few steps, and the driver hears of the spike a few
      # steps late): resuming from one would go on from the damage. The
      # loss of step `first` was taken on the state saved as step first - 1
      # (before that step's update), so that state is suspect too; where no
      # step older than that is saved, the newest is all there is.
      self.restore_below = first - 1
    ckpt = self._checkpoint_step(self.restore_below)
    if not self._progress_visible() and fault.kind == 'nonfinite_loss':
      # A host-local fast tier the driver cannot list: where the trainers
      # say a restart resumes (skipping from the persistent tier's older
      # step instead dropped every good batch in between).
      said = [r for r in ((self._facts(att, i).get(protocol.NONFINITE) or {}).get('resume_from')
                          for i in att.handles) if isinstance(r, int)]
      if said:
        ckpt = self._resume_hint = min(said)
    bad = fault.step if fault.step is not None else (att.monitor.max_step() or ckpt) + 1
    # Steps after `ckpt` read batches `skip` further on than their number
    # when this checkpoint was already rolled back to once.
    already = self.skip[1] if self.skip is not None and self.skip[0] == ckpt else 0
    skip = max(0, bad - ckpt) + already
    self.skip = (ckpt, skip)
    self.events.emit('rollback', kind=fault.kind, bad_step=bad, checkpoint_step=ckpt,
                     skip_data_steps=skip, restore_below=self.restore_below)

  def _preempt(self, att: Attempt) -> int:
    """SIGTERM/SIGINT to the driver: pass SIGTERM on, so every process saves
    and exits; wait for them (the steps to the agreed stop, a collective
    timeout, and then the save's CheckpointConfig.io_timeout_s at most, or
    until a second signal says not to wait)."""
    killed = self._terminate(att, self.fault_cfg.collective_timeout_s + self.cfg.checkpoint.io_timeout_s,
                             patient=lambda: self._signals < 2)
    # 130 / 143 from a process that never reported a step: the signal taken
    # in its start-up, where nothing was trained: a clean stop. (In the loop
    # a clean stop saves and exits 0; 143 there is a second signal that cut
    # the save short.)
    clean = all(h.returncode == 0 or (h.returncode in (protocol.EXIT_INTERRUPTED, protocol.EXIT_TERMINATED)
                                      and att.monitor.procs[i].step is None)
                for i, h in att.handles.items())
    cut = bool(killed) and self._signals >= 2
    fields = {}
    if not clean:
      # Said: the status alone read as "gave up after restarts".
      newest = self._checkpoint_step() if self._progress_visible() else None
      fields['detail'] = (
          ('a second signal cut the wait: the processes were killed before their stop save completed'
           if cut else 'not every process stopped cleanly (its exit status above)') +
          (f'; the newest checkpoint is step {newest}' if newest else '') +
          '; mjax-launch on this workdir resumes from the newest checkpoint')
    self.events.emit('preempted', attempt=att.number, exit=self._exit_statuses(att), **fields)
    if clean:
      return self.opts.preempt_exit_status
    return protocol.EXIT_INTERRUPTED if cut else EXIT_GAVE_UP


class _StragglerWatch:
  """The straggler analysis, off the heartbeat path: a child process reads
  what the timing files gained (stragglers.TimingTail) and runs
  find_stragglers, then waits `every_s` from the end of that run. In a
  process of its own it takes no time from the loop that receives
  heartbeats (at 12,288 processes one analysis is seconds of Python); a slow
  analysis only comes later. `take()` hands the driver's loop what it found."""

  def __init__(self, workdir: str, processes: set, fault_cfg, every_s: float, from_end: bool = True):
    import multiprocessing as mp
    from mjax.ft import stragglers
    # The attempt starts now: the tail starts at the files' current ends here,
    # not whenever the child is up.
    tail = stragglers.TimingTail(workdir, keep=2 * fault_cfg.straggler_window + 8, from_end=from_end)
    ctx = mp.get_context('spawn')   # a fresh interpreter: nothing of the driver's threads or sockets
    self._conn, child_conn = ctx.Pipe(duplex=False)
    # Stopped by closing a pipe, not by an Event: a child killed while it
    # waited on an Event (a SIGTERM to the whole process group, as scancel
    # and timeout send) leaves the Event's condition waiting for a wake-up
    # that never comes, and the driver hung in set(). A closed pipe also
    # ends the child when the driver itself dies.
    stop_conn, self._stop = ctx.Pipe(duplex=False)
    self.last_seconds = 0.0      # how long the latest analysis took
    self.pace_notes: list = []   # the job's slowdowns and recoveries (see _straggler_loop)
    self.analyses = 0            # analyses received so far
    self._proc = ctx.Process(target=_straggler_loop, name='mjax-stragglers', daemon=True,
                             args=(tail, sorted(processes), fault_cfg.straggler_margin,
                                   fault_cfg.straggler_window, every_s, stop_conn, child_conn))
    self._proc.start()
    child_conn.close()
    stop_conn.close()

  def take(self) -> list:
    """The stragglers found since the last call; the job-pace notes go to `pace_notes`."""
    from mjax.ft.stragglers import Straggler
    out = []
    try:
      while self._conn.poll():
        seconds, found, note = self._conn.recv()
        self.last_seconds = seconds
        self.analyses += 1
        out += [Straggler(**s) for s in found]
        if note is not None:
          self.pace_notes.append(note)
    except (EOFError, OSError):
      pass   # the analysis ended (or died): no verdicts, training goes on
    return out

  def close(self, final: bool = False) -> list:
    """Stops the analysis; with `final`, after one last run over what the
    files gained since the previous one. Returns the stragglers not yet taken."""
    wait = 5.0
    if final:
      try:
        self._stop.send('final')
        # An analysis at 12,288 processes takes seconds: wait for one, bounded.
        wait = 10.0 + 2 * self.last_seconds
      except (BrokenPipeError, OSError):
        pass   # the analysis already ended
    self._stop.close()
    # What the child sends is read while waiting for it: a result larger than
    # the pipe's buffer would otherwise keep it from exiting.
    out, deadline = [], time.monotonic() + wait
    while self._proc.is_alive() and time.monotonic() < deadline:
      out += self.take()
      self._proc.join(timeout=0.05)
    if self._proc.is_alive():
      self._proc.kill()
      self._proc.join(timeout=5.0)
    out += self.take()
    self._conn.close()
    return out


def _straggler_loop(tail, processes: list, margin: float, window: int, every_s: float, stop, conn) -> None:
  """The child process of _StragglerWatch. Besides the stragglers it
  watches the job's pace (stragglers.job_pace): the first full window of the
  attempt is the baseline, and a pace slower than it by 2 x margin is a
  slowdown of the whole job, reported once until the pace is back within
  margin of the baseline."""
  import signal
  from mjax.ft import stragglers
  # Ctrl-C reaches the whole process group: the driver stops this child
  # (closing `stop`), with no traceback of its own.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  baseline, slowed = None, False
  while True:
    final = False
    if stop.poll(every_s):   # a message, or the driver closed its end (or died)
      try:
        final = stop.recv() == 'final'
      except (EOFError, OSError):
        pass
      if not final:
        return
    t0 = time.monotonic()
    tail.read()
    # The columns the tail kept as it read, not its rows: at 12,288
    # processes going through ~600k row dicts again took seconds a check.
    rows = tail.table(processes)
    found = stragglers.find_stragglers(rows, margin, window)
    pace, note = stragglers.job_pace(rows, window), None
    if pace is not None and pace > 0:
      if baseline is None:
        baseline = pace
      elif not slowed and pace > baseline * (1 + 2 * margin):
        slowed, note = True, {'slowed': True, 'pace_s': pace, 'baseline_s': baseline}
      elif slowed and pace <= baseline * (1 + margin):
        slowed, note = False, {'slowed': False, 'pace_s': pace, 'baseline_s': baseline}
    try:
      conn.send((time.monotonic() - t0, [s.to_json() for s in found], note))
    except (BrokenPipeError, OSError):
      return
    if final:
      return
