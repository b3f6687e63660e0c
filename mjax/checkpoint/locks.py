"""The run lock: one run at a time saves into a workdir and its checkpoint
directories (an flock on each, taken by process 0, held until its
Checkpointer closes or the process dies).
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import time
from typing import Optional

import jax

from mjax import distributed, jsonfile, protocol
from mjax.config import ConfigError


LOCK_FILE = '.mjax-lock'   # in the workdir and each local tier: who holds its run lock (`lock_run`)
UNDRIVEN_LOCK_WAIT_S = 10.0   # a run started by hand waits this long for a holder on its way out
# {real path: [locked descriptor, how many Checkpointers of this process hold it]}:
# flock conflicts between two opens of a directory even in one process.
_held_locks: dict = {}


def _job_tag() -> Optional[str]:
  """A tag of the fault-tolerance job this process belongs to (a hash of its
  heartbeat secret, the same for every attempt of the job), or None: also
  for a run started by hand with MJAX_JOB_SECRET in its environment (as
  for starting agents), which is no attempt of any job."""
  secret = os.environ.get(protocol.SECRET_ENV) if protocol.under_driver() else None
  return hashlib.sha256(secret.encode()).hexdigest()[:16] if secret else None


def _try_lock(directory: str, wait_s: float) -> Optional[dict]:
  """Takes `directory`'s run lock, waiting up to `wait_s` for a holder to
  let go; None once held (or where the filesystem has no locks), else what
  the holder wrote about itself.

  The flock is on the directory itself, opened read-only: a file held open
  for writing would keep its filesystem from being remounted read-only
  (which a save must see as a failure, not as a busy device). Who holds it
  goes in LOCK_FILE, written whole beside it."""
  import fcntl
  if directory in _held_locks:   # this process holds it already (a second Checkpointer)
    _held_locks[directory][1] += 1
    return None
  try:
    os.makedirs(directory, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
  except OSError:
    return None   # not there and not creatable: check_writable says what is wrong
  deadline, said = time.monotonic() + wait_s, False
  while True:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      break
    except BlockingIOError:
      holder = _holder(directory)
      if time.monotonic() >= deadline:
        os.close(fd)
        return holder
      if not said:
        print(f'mjax: {directory} is in use by another run ({_describe_holder(holder)}); waiting up to '
              f'{wait_s:.0f} s for it to end', file=sys.stderr, flush=True)
        said = True
      time.sleep(0.5)
    except OSError:   # no flock on this filesystem (some network ones): unguarded, as before
      os.close(fd)
      return None
  try:
    jsonfile.write_atomic(os.path.join(directory, LOCK_FILE),
                          {'pid': os.getpid(), 'host': socket.gethostname(), 'started': time.time(),
                           'job': _job_tag()})
  except OSError:
    pass   # a read-only directory: check_writable says so
  _held_locks[directory] = [fd, 1]
  return None


def unlock_run(directories: list[str]) -> None:
  """Lets go of the run locks `lock_run` took (a Checkpointer's close)."""
  for d in directories:
    held = _held_locks.get(d)
    if held is None:
      continue
    held[1] -= 1
    if held[1] == 0:
      del _held_locks[d]
      try:   # removed while still held: a new holder's note is never the one removed
        os.remove(os.path.join(d, LOCK_FILE))
      except OSError:
        pass
      os.close(held[0])   # closing the descriptor releases its flock


def _holder(directory: str) -> dict:
  """What the holder of `directory`'s run lock wrote about itself ({} where
  that cannot be read)."""
  try:
    with open(os.path.join(directory, LOCK_FILE)) as fh:
      holder = jsonfile.load(fh)
  except (OSError, ValueError):
    return {}
  return holder if isinstance(holder, dict) else {}


def _describe_holder(holder: dict) -> str:
  pid, host = holder.get('pid', '?'), holder.get('host', '?')
  started = holder.get('started')
  try:   # a damaged lock file's value is no time: left out
    since = (f', since {time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))}'
             if isinstance(started, (int, float)) and not isinstance(started, bool) else '')
  except (ValueError, OverflowError, OSError):
    since = ''
  return f'process {pid} on {host}{since}'


OUTSIDE_RUN_WAIT_S = 30.0   # mjax-launch waits this long for a run started by hand to end (its stop save)


def held_outside_a_driver(directory: str, wait_s: float = 0.0) -> Optional[str]:
  """Who holds `directory`'s run lock, described, where that is a run
  started by hand (no fault-tolerance job's) and still holds it after
  `wait_s` (one stopped to be resumed under mjax-launch may be saving);
  None where it is free, held by a driven job (an earlier attempt on its
  way out), or unknown. mjax-launch on such a workdir waited
  DRIVEN_LOCK_WAIT_S in its trainers and then refused, after writing its
  events and logs into that run's."""
  deadline, said = time.monotonic() + wait_s, False
  while True:
    holder = _held_outside_a_driver(directory)
    if holder is None or time.monotonic() >= deadline:
      return holder
    if not said:
      print(f'mjax: {directory} is in use by a run started by hand ({holder}); waiting up to {wait_s:.0f} s '
            f'for it to end', file=sys.stderr, flush=True)
      said = True
    time.sleep(0.5)


def _held_outside_a_driver(directory: str) -> Optional[str]:
  import fcntl
  if not os.path.isdir(directory):
    return None
  try:
    fd = os.open(directory, os.O_RDONLY)
  except OSError:
    return None
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(fd, fcntl.LOCK_UN)
    return None
  except BlockingIOError:
    holder = _holder(directory)
    return _describe_holder(holder) if holder and holder.get('job') is None else None
  except OSError:   # no flock on this filesystem
    return None
  finally:
    os.close(fd)


DRIVEN_LOCK_WAIT_S = 120.0   # under the driver: how long process 0 waits for holders, all directories together
SAME_JOB_LOCK_WAIT_S = 30.0  # ... for an earlier attempt of its own job, before it goes on without the lock


def lock_run(dirs: dict[str, str], workdir: str, timeout_s: float = 300.0) -> list[str]:
  """Raises ConfigError, in every process alike, unless process 0 gets the
  run lock of the workdir and of each local tier directory: two runs saving
  into one directory at once would delete and overwrite each other's steps.

  A lock is an flock, held until the Checkpointer closes or process 0 exits,
  whatever ends it (even SIGKILL). Process 0 of a restarted attempt may
  start while the last attempt's is still on its way out: under the
  fault-tolerance driver it waits up to DRIVEN_LOCK_WAIT_S in all (well
  inside the driver's start-up timeout), and a holder of the same job (an
  earlier attempt that outlived its kill) is warned about after
  SAME_JOB_LOCK_WAIT_S rather than refused. The other processes wait for
  process 0's verdict longer than it can take. Returns the directories
  locked (for `unlock_run`). Where a filesystem has no flock, or one that
  only this host sees (NFS without lock support), nothing is guarded.
  """
  driven = bool(os.environ.get(protocol.DRIVER_ADDRESS_ENV))
  budget = min(timeout_s, DRIVEN_LOCK_WAIT_S) if driven else UNDRIVEN_LOCK_WAIT_S
  mine, locked = None, []
  if jax.process_index() == 0:
    deadline = time.monotonic() + budget
    paths = {os.path.realpath(workdir): workdir}
    for d in dirs.values():
      if '://' not in d:
        paths.setdefault(os.path.realpath(d), d)
    try:
      for real, d in paths.items():
        holder = _try_lock(real, 0.0)
        same_job = (driven and holder is not None and holder.get('job') is not None
                    and holder.get('job') == _job_tag())
        if holder is not None:
          left = max(0.0, deadline - time.monotonic())
          holder = _try_lock(real, min(left, SAME_JOB_LOCK_WAIT_S) if same_job else left)
        if holder is None:
          locked.append(real)
          continue
        if same_job:
          print(f'mjax: warning: {d} is still locked by an earlier attempt of this job '
                f'({_describe_holder(holder)}); going on without its lock', file=sys.stderr, flush=True)
          continue
        mine = (f'{d} is in use by another run: {_describe_holder(holder)} holds its lock '
                f'({os.path.join(d, LOCK_FILE)}). Two runs saving there at once would delete and overwrite '
                f'each other\'s checkpoints. Wait for that run to end or stop it, or give this run another '
                f'workdir (and checkpoint directories of its own).')
        break
    except Exception as e:   # whatever it is, every process hears of it (none waits out the barrier)
      mine = f'taking the run lock of {workdir!r} failed: {type(e).__name__}: {e}'
  try:
    reports = distributed.report_exceptions('ckpt/probe/lock', mine, budget + timeout_s)
  except BaseException:
    unlock_run(locked)
    raise
  if reports:
    unlock_run(locked)
    raise ConfigError(reports[min(reports)])
  return locked
