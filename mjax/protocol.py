"""The contract between a training process and the fault-tolerance driver.

Everything the two sides agree on lives here, as data:

  exit statuses   what a trainer's (and the driver's) exit status means
  environment     the variables the driver sets for the processes it starts
  facts           structured things the driver needs from a trainer, written
                  by the trainer as one small JSON file per process under
                  <workdir>/protocol/ and read by the driver: the start-up
                  report (MegaScale §5, start-up time as a measured number)
                  and the step whose loss was not finite
  skipped data    the batches to skip after a rollback travel in the config
                  (TrainConfig.skip_batches), as a gin binding the driver adds;
                  after a loss spike, so does the step to resume below
                  (CheckpointConfig.restore_below)

Live state (step, loss, phase) travels in heartbeats (mjax/ft/heartbeat.py);
facts are what must not be lost with a dropped datagram, hence a file,
written atomically. Neither side ever parses the other's log text.

This module imports nothing from mjax and nothing heavy.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from typing import Any, Optional

# --- exit statuses ------------------------------------------------------------
EXIT_OK = 0            # finished, or stopped cleanly on request (pre-emption)
EXIT_FAILED = 1        # a crash (the driver restarts it); the driver's own: it gave up
EXIT_USER_ERROR = 2    # bad input (mjax.errors.UserError): retrying cannot help, never restarted
EXIT_NONFINITE = 3     # the loss became NaN/Inf: the driver rolls back and skips the data
EXIT_DRIVER_LOST = 4   # no word from the driver for heartbeat_timeout_s: saved and stopped; a
                       # driver that is in fact alive (a network cut) restarts it from that save
EXIT_HOST_LOST = 255   # the driver's verdict, never a trainer's: the process's host agent went away
                       # (mjax/ft/agent.py), so the process is as good as gone
EXIT_INTERRUPTED = 130  # Ctrl-C outside the loop's own stop handling (shell convention 128 + SIGINT)
EXIT_TERMINATED = 143   # SIGTERM outside the loop's own stop handling (start-up, compilation, the
                        # final evaluation): nothing to save there (shell convention 128 + SIGTERM)
EXIT_BROKEN_PIPE = 141  # a tool whose output's reader went away (`| head`): 128 + SIGPIPE, as the
                        # shell's own tools end there

# --- stopping on a signal or a lost driver -----------------------------------------
# The processes of a job stop after the same step: the first one asked proposes
# the step it has reached plus this many (mjax.stop.StopAgreement). An agent
# whose driver is gone counts on it too: its trainers need up to this many
# steps more, after they notice, before their last save (mjax/ft/agent.py).
STOP_MARGIN_STEPS = 3
# A SIGTERM again within this many seconds is the same stop delivered twice,
# not a second one that cuts the saves short: scancel signals every process of
# a SLURM step (the driver and launch/slurm_ft.sbatch's shell, which passes
# its own on; an agent and the srun that forwards its own), and a JobSet's
# teardown reaches a trainer through its agent and its driver. A later one,
# or a second Ctrl-C, still cuts them.
SIGNAL_REPEAT_S = 5.0


def repeated_term(signum: int, last: Optional[int], last_at: float, window: float = SIGNAL_REPEAT_S) -> bool:
  """Whether `signum` is that same stop delivered twice: a SIGTERM within
  `window` seconds of the SIGTERM taken before it (`last`, at monotonic
  time `last_at`)."""
  return signum == last == signal.SIGTERM and time.monotonic() - last_at < window

# --- environment the driver sets for each training process ----------------------
DRIVER_ADDRESS_ENV = 'MJAX_DRIVER_ADDRESS'   # host:port of the driver's heartbeat server
SECRET_ENV = 'MJAX_JOB_SECRET'               # per-job HMAC secret of the heartbeats (hex)
HOST_ENV = 'MJAX_HOST'                       # the driver's name for this process's host
ATTEMPT_ENV = 'MJAX_ATTEMPT'                 # launch attempt, 0 first, +1 per restart
DRIVER_RUN_ENV = 'MJAX_DRIVER_RUN'           # one driver start's own id: its attempts' facts are its own
INJECT_ENV = 'MJAX_FAULT'                    # test-only fault injection (mjax/ft/inject.py)
DIAGNOSE_FAIL_ENV = 'MJAX_DIAGNOSE_FAIL'     # test-only diagnostic failure (mjax/ft/diagnose.py)
# mjax-train's exit status after a clean stop short of the last step (a
# signal, checkpoint saved), where no driver reads its facts: 0 by default.
# A Kubernetes Job counts a pod that exits 0 as finished, so one evicted pod
# ended a JobSet as complete mid-run; launch/jobset.yaml sets 143 (failed:
# the JobSet restarts and resumes).
PREEMPT_EXIT_ENV = 'MJAX_PREEMPT_EXIT_STATUS'

# --- gin binding the driver adds after a rollback --------------------------------
SKIP_BATCHES_KEY = 'TrainConfig.skip_batches'
SKIP_AFTER_KEY = 'TrainConfig.skip_batches_after'   # the skip holds for a start from this step only
RESTORE_BELOW_KEY = 'CheckpointConfig.restore_below'   # after a loss spike: resume from before it

# --- facts ------------------------------------------------------------------------
FACTS_DIR = 'protocol'
STARTUP = 'startup'          # {part: seconds} to the first completed step
NONFINITE = 'nonfinite'      # {'step': N, 'loss': 'nan', 'what': 'loss' (or grad_norm, update_norm),
                             #  'resume_from': the checkpoint step a restart resumes from, as the
                             #  trainer sees its tiers (a host-local one the driver cannot list)}
USER_ERROR = 'user_error'    # the message of the bad input that ended the process (exit status 2)
PEER_LOST = 'peer_lost'      # the collective error that ended the process: a peer left first (its
                             # own exit is the fault; this one's is its consequence)
DEVICES = 'devices'          # the process's devices (jax.local_device_count()), recorded first:
                             # what the driver lays a job shrunk to fewer hosts out on
HOST_FAULT = 'host_fault'    # {'processes': [i, ...], 'what': message}: a fault of those processes'
                             # hosts alone (mjax.errors.HostFault, exit status 1): not restarted there
STOPPED = 'stopped'          # {'step': N, 'signal': name or None, 'why': words}: the run stopped early
                             # on a stop signal, saved, and exited 0; 'signal' where this process got
                             # it (a node's pre-emption), None where another one did


def under_driver() -> bool:
  """Whether this process was started by the fault-tolerance driver."""
  return bool(os.environ.get(DRIVER_ADDRESS_ENV))


def preempt_exit_status() -> int:
  """PREEMPT_EXIT_ENV's status (0 where unset or under the driver, whose
  own --preempt_exit_status says it for the job).

  Raises:
    ValueError: not an exit status (the message for the user).
  """
  raw = os.environ.get(PREEMPT_EXIT_ENV, '').strip()
  if not raw or under_driver():
    return 0
  try:
    status = int(raw)
  except ValueError:
    status = -1
  if not 0 <= status <= 255:
    raise ValueError(f'{PREEMPT_EXIT_ENV}={raw!r}: an exit status is a whole number from 0 to 255 (143 makes a '
                    f'stop short of the last step count as failed, for a supervisor that restarts failed '
                    f'processes; unset for 0)')
  return status


def attempt() -> int:
  """This process's launch attempt (0 when not started by the driver)."""
  try:
    return int(os.environ.get(ATTEMPT_ENV, '0') or 0)
  except ValueError:
    return 0


def driver_run() -> str:
  """The id of the driver start that launched this process ('' without one).
  Attempt numbers start at 0 again with every driver on a workdir: the
  facts a process finds of "its" attempt may be another driver's."""
  return os.environ.get(DRIVER_RUN_ENV, '')


def facts_path(workdir: str, process: int) -> str:
  return os.path.join(workdir, FACTS_DIR, f'process-{process:05d}.json')


class Facts:
  """The trainer's side: records facts for the driver, one file per process.

  The file holds the facts of the current attempt only; each `record` rewrites
  it atomically (write, then rename), so the driver never reads half of it.
  Facts this attempt recorded before (another Facts of the same process)
  are kept; an attempt of the same number under an earlier driver is
  another attempt (a `peer_lost` of its, read by the next driver, named
  the wrong process as the one that failed).
  """

  def __init__(self, workdir: str, process: int):
    self.path = facts_path(workdir, process)
    number, run = attempt(), driver_run()
    self._facts: dict[str, Any] = {'attempt': number, 'driver_run': run, 'process': process}
    earlier = read_facts(workdir, process, number, run)
    if earlier.get('process') == process:
      self._facts.update(earlier)

  def get(self, name: str, default: Any = None) -> Any:
    """A fact this process recorded in this attempt."""
    return self._facts.get(name, default)

  def record(self, name: str, value: Any) -> None:
    self._facts[name] = value
    try:
      os.makedirs(os.path.dirname(self.path), exist_ok=True)
      tmp = f'{self.path}.{os.getpid()}.{threading.get_ident()}.tmp'   # a thread's own (the save watch's)
      with open(tmp, 'w') as fh:
        json.dump(self._facts, fh)
      os.replace(tmp, self.path)
    except OSError:
      pass   # a fact the driver cannot read costs it a detail, never the run


def devices_per_process(workdir: str) -> Optional[int]:
  """The devices each process of the job has, as the trainers recorded them
  (any attempt, any driver before this one), where they all agree."""
  try:
    names = os.listdir(os.path.join(workdir, FACTS_DIR))
  except OSError:
    return None
  found = (read_facts(workdir, int(m.group(1))).get(DEVICES)
           for m in map(re.compile(r'process-(\d+)\.json').fullmatch, names) if m)
  seen = {v for v in found if isinstance(v, int) and v > 0}
  return seen.pop() if len(seen) == 1 else None


def read_facts(workdir: str, process: int, attempt_number: Optional[int] = None, run: Optional[str] = None) -> dict:
  """The driver's side: what process `process` recorded ({} if nothing, or
  only facts of another attempt: another `attempt_number`, or one of that
  number under another driver start than `run`)."""
  try:
    with open(facts_path(workdir, process)) as fh:
      facts = json.load(fh)
  except (OSError, ValueError, RecursionError):   # RecursionError: nested too deeply to parse
    return {}
  if not isinstance(facts, dict):
    return {}
  if attempt_number is not None and facts.get('attempt') != attempt_number:
    return {}
  if run is not None and facts.get('driver_run', '') != run:
    return {}
  return facts
