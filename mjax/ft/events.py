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
                   host_fault, host_lost),
                   the processes and hosts named, details
  stack_dump       where a process was when asked to dump its stacks (hang)
  stopped          every process is gone: exit codes, seconds it took
  agents           under agents, before a launch: the hosts whose agent is
                   connected, the ones chosen, the ones missing
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
                   collective_timeout_s (trainers_kept), the checks were late
  finish / giveup / preempted   how the driver ended
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from typing import Any


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
  """Appends events to a JSONL file; safe to call from several threads."""

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

  def emit(self, event: str, **fields) -> dict:
    rec = {'time': round(time.time(), 3), 'event': event, **_clean(fields)}
    line = json.dumps(rec, sort_keys=False)
    with self._lock:
      self._fh.write(line + '\n')
      self._fh.flush()
    if self._echo is not None:
      self._echo(line)
    return rec

  def close(self) -> None:
    with self._lock:
      self._fh.close()


def read(path: str) -> list[dict]:
  """Every event of a log, oldest first (a torn last line is skipped)."""
  out = []
  if not os.path.exists(path):
    return out
  with open(path) as fh:
    for line in fh:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return out
