"""How a run stops before its last step, in every process after the same
step: a signal (pre-emption, Ctrl-C), the loss of the fault-tolerance driver,
or its workdir deleted under it. The loop then saves and exits."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

import jax

from mjax import distributed, protocol
from mjax.ft.heartbeat import HeartbeatClient


class WorkdirWatch:
  """Whether the run's workdir was deleted (or replaced) under it, looked
  at no more than every CHECK_S. Its metrics, logs and config then went
  on into deleted files without a word, and the job ended "finished" with
  none of them; the loop stops instead (StopAgreement), saves, and says so.

  It holds the run's config.json open: a deleted file keeps its inode while
  open, with no name left (st_nlink 0), which a directory made again at
  the same path (by a save) cannot hide, as its inode number can repeat."""
  CHECK_S = 5.0
  MARK = 'config.json'

  def __init__(self, workdir: str):
    self.workdir = workdir
    try:
      self._fd: Optional[int] = os.open(os.path.join(workdir, self.MARK), os.O_RDONLY)
    except OSError:
      self._fd = None   # none here (another host's workdir): nothing to watch
    self._next = time.monotonic() + self.CHECK_S

  def gone(self) -> bool:
    now = time.monotonic()
    if self._fd is None or now < self._next:
      return False
    self._next = now + self.CHECK_S
    try:
      return os.fstat(self._fd).st_nlink == 0
    except OSError:
      return False

  def close(self) -> None:
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None


class StopAgreement:
  """SIGTERM / SIGINT (pre-emption, Ctrl-C) ask the loop to finish the step,
  save and exit 0. A second signal gets the default behaviour (kill now).
  So does the loss of the fault-tolerance driver (no acknowledgement of the
  heartbeats for heartbeat_timeout_s): a job nobody supervises stops cleanly
  instead of training on, and a restarted driver resumes it from that save."""

  # Steps between the one the first process to stop has reached and the one
  # every process stops after: each step's collectives keep the processes
  # within a step or two of each other, and the others learn the agreed step
  # within a coordination-service round trip (milliseconds), so none can have
  # passed it yet.
  MARGIN = protocol.STOP_MARGIN_STEPS
  KEY = 'mjax/stop/after_step'
  DONE = 'done'            # written on the way out: wakes every watcher, stops nobody
  DRIVER_LOST = 'driver_lost'
  WORKDIR_GONE = 'workdir_gone'
  POLL_MS = 10_000
  # The watcher's one wait, as long as the service takes (a 32-bit count of
  # milliseconds, 24.8 days): every wait that times out stays pending in the
  # coordination service until the key is set, ~14 KB there and ~20 KB in
  # the process that waited, so a wait of 10 s again and again grew every
  # process by 170 MB a day and process 0 by that much for each of them.
  WATCH_MS = 2**31 - 1
  JOIN_S = 11.0            # how long leaving waits for the woken watcher
  REPEAT_S = protocol.SIGNAL_REPEAT_S   # a SIGTERM again this soon is the same stop

  def __init__(self, heartbeat: Optional[HeartbeatClient] = None, workdir: Optional['WorkdirWatch'] = None):
    self.signal = None
    self._signalled_at = 0.0
    self.driver_lost = False
    self.workdir_gone = False
    self.reason: Optional[str] = None   # why the stop agreed on was asked for (every process alike)
    self._heartbeat = heartbeat
    self._workdir = workdir
    self._old = {}
    self._stop_after: Optional[int] = None
    self._why_elsewhere: Optional[str] = None   # why the process that proposed the stop stopped
    self._proposed = False
    self._watcher: Optional[threading.Thread] = None
    self._closing = threading.Event()
    self.stopped = False     # the loop was left early, in every process alike

  @property
  def name(self) -> str:
    if self.signal is not None:
      return signal.Signals(self.signal).name
    if self.driver_lost:
      return 'no word from the fault-tolerance driver for heartbeat_timeout_s'
    if self.workdir_gone:
      return 'the workdir was deleted under the running job'
    return f'another process of the job was asked to stop ({self._why_elsewhere or "a signal"})'

  def _requested(self) -> bool:
    if self.signal is None and not self.driver_lost and self._heartbeat is not None:
      self.driver_lost = self._heartbeat.driver_lost()
    if self.signal is None and not self.driver_lost and not self.workdir_gone and self._workdir is not None:
      self.workdir_gone = self._workdir.gone()
    return self.signal is not None or self.driver_lost or self.workdir_gone

  def agreed(self, step: int) -> bool:
    """Whether to stop after `step`. One process: once asked. Several: after
    the same step in every process, since a signal reaches them between
    different steps, and a process that stops alone leaves the others waiting
    in the next step's collectives forever. The first process asked proposes
    a step through the coordination service; a watcher thread in every
    process waits for that key (one pending call, not one call per step)."""
    self.stopped = self._agreed(step)
    return self.stopped

  def _why(self) -> str:
    return (self.DRIVER_LOST if self.driver_lost else self.WORKDIR_GONE if self.workdir_gone else
            signal.Signals(self.signal).name)

  def _agreed(self, step: int) -> bool:
    if jax.process_count() == 1:
      if self._requested():
        self.reason = self.reason or self._why()
        return True
      return False
    if self._stop_after is None and not self._proposed and self._requested():
      self._proposed = True
      client = distributed.coordination_client()
      # The reason travels with the step: every process stops for the same
      # one (a lost driver means exit status 4 everywhere, not only here).
      why = self._why()
      try:
        client.key_value_set(self.KEY, f'{step + self.MARGIN} {why}')
      except jax.errors.JaxRuntimeError as e:
        if 'ALREADY_EXISTS' not in str(e):
          raise
        # another process proposed first: theirs stands
      self._stop_after = self._parse(client.blocking_key_value_get(self.KEY, self.POLL_MS))
    return self._stop_after is not None and step >= self._stop_after

  def _parse(self, value: str) -> Optional[int]:
    if value == self.DONE:
      return None
    step, _, why = value.partition(' ')
    self._why_elsewhere = why or None
    self.reason = why or None
    if why == self.DRIVER_LOST:
      self.driver_lost = True
    if why == self.WORKDIR_GONE:
      self.workdir_gone = True
    return int(step)

  def _watch(self) -> None:
    client = distributed.coordination_client()
    while not self._closing.is_set():
      try:
        value = client.blocking_key_value_get(self.KEY, self.WATCH_MS)
      except jax.errors.JaxRuntimeError:
        continue   # nothing yet (the wait timed out): wait again
      if self._stop_after is None:
        self._stop_after = self._parse(value)
      return

  def _handle(self, signum, frame):
    if self.signal is not None:
      if protocol.repeated_term(signum, self.signal, self._signalled_at, self.REPEAT_S):
        return
      signal.signal(signum, self._old.get(signum, signal.SIG_DFL))
      signal.raise_signal(signum)
    self.signal = signum
    self._signalled_at = time.monotonic()

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._old[sig] = signal.signal(sig, self._handle)
    if jax.process_count() > 1:
      self._watcher = threading.Thread(target=self._watch, name='mjax-stop-watch', daemon=True)
      self._watcher.start()
    return self

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)
    if self._workdir is not None:
      self._workdir.close()
    if self._watcher is not None:
      # A thread still waiting in the coordination service when jax shuts it
      # down at exit aborts the process: wake it (every process leaves the
      # loop after the same step, so the key stops nobody) and let it end.
      self._closing.set()
      try:
        distributed.coordination_client().key_value_set(self.KEY, self.DONE)
      except Exception:  # noqa: BLE001 -- already set, or the service is gone: nothing to wake
        pass
      self._watcher.join(timeout=self.JOIN_S)
    return False
