"""The driver's event log: `<workdir>/events.jsonl`, append-only.

One JSON object per line, `{"time": <unix seconds>, "event": <kind>, ...}`,
written and flushed as it happens, so that the log of a driver that is
itself killed is complete up to its last action. Kinds written by
mjax/ft/driver.py:

  start            the driver's job: processes, devices, hosts, spares,
                   heartbeat address, timeouts
  launch           an attempt starts: attempt, hosts, process pids, overrides
  running          every process of the attempt has sent a heartbeat
  startup          process 0's start-up report (restore, compile, ...)
  heartbeat_rejected  a heartbeat that failed authentication or parsing (one
                   per kind per 5 s: suppressed_before counts the others;
                   unread, those dropped while the driver's loop was held up)
  fault            kind (exit, heartbeat_lost, startup_timeout, hang,
                   nonfinite_loss, loss_spike, straggler, bad_input,
                   host_fault, host_lost, driver_held, signalled),
                   the processes and hosts named, details
  stack_dump       where a process was when asked to dump its stacks (hang)
  stopped          every process is gone: exit codes, seconds it took
  agents           under agents, before a launch: the hosts whose agent is
                   connected, the ones chosen, the ones missing
  agent_connected / agent_lost   an agent's link made (host, address, pid)
                   or lost (host, reason)
  agent_rejected   a connection refused: host (or claimed_host, unverified,
                   when its hello did not authenticate: a wrong job secret),
                   peer, reason; one per host and reason per 30 s
                   (suppressed_before counts the others)
  diagnosis        one host's mjax-diagnose result
  link_check       a host's links, checked in a pair with a healthy host
                   (passed true / false, or null: not checked)
  diagnosis_suspect  every host failed: none blocked (a shared cause)
  host_blocked     a host added to <workdir>/blocked_hosts.json
  elastic          the healthy hosts are more than the job can be laid out
                   on: how many it runs on, the idle ones, why
  rollback         a numerical fault: checkpoint step, data batches skipped
  restart          attempt, back-off, restarts in all and in a row
  straggler        a process flagged as slow (evicted only if configured)
  job_slowdown / job_pace_recovered   the whole job's step time against its
                   earlier pace (every process slower alike: no straggler)
  caught_up        training is back at the step it had reached before a fault
  driver_stalled   the driver's own loop was held up longer than
                   heartbeat_timeout_s (slow storage under its workdir); the
                   trainers were acknowledged meanwhile up to
                   collective_timeout_s (trainers_kept), the checks were late;
                   process_held: the whole driver process was (SIGSTOP, a
                   frozen container), so nothing acknowledged them
  finish / giveup / preempted   how the driver ended
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from typing import Any, Optional

from mjax import jsonfile


class Throttle:
  """At most one event per key every `every_s` (a flood of rejections must
  not flood the log): `admit(key)` is None for one to drop, else how many
  were dropped since the last one admitted. Keys may come from hostile
  peers, so the table is cleared past `max_keys`."""

  def __init__(self, every_s: float, max_keys: int = 4096):
    self.every_s, self.max_keys = every_s, max_keys
    self._keys: dict[Any, list] = {}   # key -> [last admitted, dropped since]

  def admit(self, key: Any) -> Optional[int]:
    now = time.monotonic()
    last, dropped = self._keys.get(key, (-math.inf, 0))
    if now - last < self.every_s:
      self._keys[key] = [last, dropped + 1]
      return None
    if len(self._keys) >= self.max_keys:
      self._keys.clear()
    self._keys[key] = [now, 0]
    return dropped


def _clean(v: Any) -> Any:
  """JSON has no NaN/Inf: write them as strings so every line stays valid JSON."""
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)
  if isinstance(v, dict):
    return {k: _clean(x) for k, x in v.items()}
  if isinstance(v, (list, tuple)):
    return [_clean(x) for x in v]
  return v


class EventLog:
  """Appends events to a JSONL file; safe to call from several threads.

  The log is a record, not the supervision: a write that fails (the
  workdir's disk full, its file system gone read-only) says so on stderr,
  where the event goes too, and the caller goes on (the driver died of it
  with its trainers left running). A log deleted or replaced meanwhile is
  opened again at its path, so later events are not written into a file
  nobody can read."""

  def __init__(self, path: str, echo=None):
    """Args:
      path: the events.jsonl file (created with its folder if missing).
      echo: optional callable given a one-line summary of each event (the
        driver prints them to its own stderr).
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self.path = path
    self._fh = open(path, 'a', buffering=1)
    self._lock = threading.Lock()
    self._echo = echo
    self._failing: Optional[str] = None   # the error of the last write, until one succeeds

  def emit(self, event: str, **fields) -> dict:
    rec = {'time': round(time.time(), 3), 'event': event, **_clean(fields)}
    line = json.dumps(rec, sort_keys=False)
    with self._lock:
      try:
        self._reopen_if_gone()
        self._fh.write(line + '\n')
        self._fh.flush()
        self._failing = None
      except OSError as e:
        self._lost(e, line)
    if self._echo is not None:
      self._echo(line)
    return rec

  def _reopen_if_gone(self) -> None:
    try:
      same = os.path.samestat(os.fstat(self._fh.fileno()), os.stat(self.path))
    except FileNotFoundError:
      same = False
    if not same:
      self._close_quietly()
      os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
      self._fh = open(self.path, 'a', buffering=1)

  def _lost(self, e: OSError, line: str) -> None:
    said = f'{e.strerror or e} (errno {e.errno})'
    if said != self._failing:
      print(f'mjax: events cannot be written to {self.path!r}: {said}; they go to stderr until it can '
            f'be written again', file=sys.stderr, flush=True)
      self._failing = said
    if self._echo is None:
      print(line, file=sys.stderr, flush=True)

  def _close_quietly(self) -> None:
    try:
      self._fh.close()
    except OSError:
      pass   # what it held is lost with the failed writes, which said so

  def close(self) -> None:
    with self._lock:
      self._close_quietly()


def read(path: str) -> list[dict]:
  """Every event of a log, oldest first (a torn last line is skipped)."""
  out = []
  if not os.path.exists(path):
    return out
  with open(path) as fh:
    for line in fh:
      try:
        out.append(jsonfile.loads(line))
      except json.JSONDecodeError:
        continue
  return out
