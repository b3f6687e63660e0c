"""Executors: where a host's training processes run.

The driver (mjax/ft/driver.py) talks to hosts only through an executor:
`coordinator(port)`, `start(argv, env, log_path)` -> a handle, `kill(handle)`
and `run(argv, env, timeout)` (diagnostics). Handles offer what
subprocess.Popen does: poll, send_signal, wait, pid, returncode.
`LocalExecutor` runs a host slot as processes on this machine;
`SlurmExecutor` runs each process as a SLURM job step on its node; the
executor of a host with an `mjax-agent` (the way for clusters, SLURM or
Kubernetes) is `AgentExecutor` in mjax/ft/agent.py, whose handles forward
signals to the remote process through the agent.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence

# What `run` returns when `cancel` ended it: the driver was asked to stop.
CANCELLED = 130


def run_to_end(argv: Sequence[str], env: dict, timeout: float, cancel: Optional[Callable[[], bool]] = None,
               stop: Optional[Callable[[], None]] = None) -> tuple[int, str, str]:
  """Runs a command in a process group of its own to completion: (status,
  stdout, stderr); status 124 on timeout, CANCELLED once `cancel()` is true
  (checked a few times a second). Either way the group is killed, after
  `stop()` has ended whatever runs elsewhere for it (a SLURM step).
  Raises OSError when the command cannot be started."""
  p = subprocess.Popen(list(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       start_new_session=True)   # its own group: what it started goes with it
  deadline = time.monotonic() + timeout
  while True:
    try:
      out, err = p.communicate(timeout=min(0.25, max(0.0, deadline - time.monotonic())))
      return p.returncode, out, err
    except subprocess.TimeoutExpired:
      pass
    cancelled = cancel is not None and cancel()
    if cancelled or time.monotonic() >= deadline:
      if stop is not None:
        stop()
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      p.wait()
      try:   # bounded: a descendant that left the group may hold the pipes open
        out, _ = p.communicate(timeout=5.0)
      except subprocess.TimeoutExpired:
        out = ''
      return (CANCELLED, out or '', 'cancelled: the driver was asked to stop') if cancelled else \
          (124, out or '', f'timed out after {timeout:.0f}s')


class LocalExecutor:
  """A host slot on this machine. A remote executor (agent.AgentExecutor)
  offers the same four methods, and handles with Popen's poll /
  send_signal / wait / pid / returncode; the driver uses nothing else."""

  def __init__(self, host: str):
    self.host = host

  def coordinator(self, port: int) -> str:
    """The coordinator address when this host runs process 0."""
    return f'127.0.0.1:{port}'

  def start(self, argv: Sequence[str], env: dict, log_path: str) -> subprocess.Popen:
    """Starts a process; its stdout and stderr are appended to `log_path`."""
    from mjax.launch import start_logged
    return start_logged(argv, env, log_path, new_session=True)

  def kill(self, handle: subprocess.Popen) -> None:
    """SIGKILL to the process and anything it started (its own session)."""
    try:
      os.killpg(handle.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass

  def run(self, argv: Sequence[str], env: dict, timeout: float,
          cancel: Optional[Callable[[], bool]] = None) -> tuple[int, str, str]:
    """Runs a command to completion: (status, stdout, stderr); status 124 on
    timeout, CANCELLED once `cancel()` is true (checked a few times a
    second: a stop signal to the driver ends a diagnosis there)."""
    return run_to_end(argv, env, timeout, cancel)


class SlurmExecutor:
  """A node of the SLURM allocation the driver runs in (launch/slurm_ft.sbatch).

  Each training process is a job step on its node (`srun --nodelist=NODE
  --ntasks=1`), so SLURM's own daemons start, signal and stop it there; the
  handle is the local `srun` client, which forwards SIGTERM / SIGUSR1 to the
  task and exits with the task's status. Killing cancels the step itself
  (`scancel --signal=KILL JOB.STEP`): a killed client alone would leave the
  task running. Steps overlap (`--overlap`): a diagnostic may run beside a
  trainer on the same node.
  """
  remote = True   # handles' pids are srun clients here, not the trainers

  def __init__(self, host: str):
    self.host = host

  def coordinator(self, port: int) -> str:
    return f'{self.host}:{port}'

  def _srun(self, name: str) -> list[str]:
    return ['srun', '--nodes=1', '--ntasks=1', f'--nodelist={self.host}', '--overlap', '--export=ALL',
            '--kill-on-bad-exit=1', f'--job-name={name}']

  def start(self, argv: Sequence[str], env: dict, log_path: str) -> subprocess.Popen:
    from mjax.launch import start_logged
    from mjax import protocol
    name = f'mjax-a{env.get(protocol.ATTEMPT_ENV, "0")}-{self.host}'
    handle = start_logged([*self._srun(name), *argv], env, log_path, new_session=True)
    handle.step_name = name
    return handle

  # One listing of the job's steps serves the kills of a whole attempt
  # (every process after a hang): one squeue per process would be a
  # thousand calls to slurmctld on a 1,000-node job, when it is busiest.
  _steps: tuple[float, dict[str, list[str]]] = (-1e9, {})
  STEPS_FRESH_S = 2.0
  _run_ids = itertools.count(1)

  @classmethod
  def _step_ids(cls, job: str, name: str) -> list[str]:
    """The ids (JOB.STEP) of the job's running steps named `name`, from a
    listing at most STEPS_FRESH_S old that holds the name (a step started
    since is listed afresh)."""
    listed_at, steps = cls._steps
    if time.monotonic() - listed_at > cls.STEPS_FRESH_S or name not in steps:
      out = subprocess.run(['squeue', '--steps', '--noheader', '--format=%i %j', f'--jobs={job}'],
                           capture_output=True, text=True, timeout=30).stdout
      steps = {}
      for line in out.splitlines():
        step, _, step_name = line.strip().partition(' ')
        steps.setdefault(step_name, []).append(step)
      cls._steps = (time.monotonic(), steps)
    return steps.get(name, [])

  def _cancel_steps(self, name: Optional[str]) -> None:
    """scancel of the job's running steps named `name`."""
    job = os.environ.get('SLURM_JOB_ID')
    if job and name:
      try:
        for step in self._step_ids(job, name):
          subprocess.run(['scancel', '--signal=KILL', step], capture_output=True, timeout=30)
      except (subprocess.TimeoutExpired, OSError) as e:
        # A slurmctld too busy to answer must not end the driver in the
        # middle of a recovery: the client is killed after this, and SLURM
        # ends the step with its job at the latest.
        print(f'mjax-launch: could not cancel the job step {name} of {self.host} ({e})', file=sys.stderr,
              flush=True)

  def kill(self, handle: subprocess.Popen) -> None:
    self._cancel_steps(getattr(handle, 'step_name', None))
    try:
      os.killpg(handle.pid, signal.SIGKILL)   # the srun client
    except ProcessLookupError:
      pass

  def run(self, argv: Sequence[str], env: dict, timeout: float,
          cancel: Optional[Callable[[], bool]] = None) -> tuple[int, str, str]:
    # A diagnostic that overruns or is cancelled is a step of its own to
    # cancel, as a trainer's: killing the srun client alone left it running
    # on the node. Named apart from the host's other diagnostics (a link
    # check may run beside one).
    name = f'mjax-diagnose-{self.host}-{next(self._run_ids)}'
    return run_to_end([*self._srun(name), *argv], env, timeout, cancel, stop=lambda: self._cancel_steps(name))


def slurm_hosts() -> list[str]:
  """The nodes of the SLURM allocation this runs in, in order."""
  nodes = os.environ.get('SLURM_JOB_NODELIST')
  if not nodes:
    raise RuntimeError('not inside a SLURM allocation (no SLURM_JOB_NODELIST)')
  out = subprocess.run(['scontrol', 'show', 'hostnames', nodes], capture_output=True, text=True,
                       check=True, timeout=30).stdout
  return [h for h in out.split() if h]
