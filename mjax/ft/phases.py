"""Per-phase step timers of every process, read by the straggler report
(mjax/ft/stragglers.py) and the heartbeats (mjax/ft/heartbeat.py)."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import time
from typing import Optional

from mjax.errors import refused_write

ROTATED = '.1'   # suffix of a process's previous timings file (not a process-*.jsonl)


class PhaseTimer:
  """Always-on, per-process timers of the phases of each step.

  Host wall-clock only, no device synchronization beyond the one the loop
  already does (fetching the previous step's metrics), so it is cheap enough
  to leave on in production (MegaScale §8). Phases, as the host sees them:
    data        next batch from the pipeline + host-to-device transfer
    compute     dispatch + waiting for the device: forward, backward,
                optimizer and their collectives run as one XLA program
    checkpoint  the blocking part of a save
    eval        held-out evaluation
    gc          Python's garbage collection, every TrainConfig.gc_every_steps
  Rows are appended every `every` steps to
  `<workdir>/timings/process-<index>.jsonl`, one JSON object per step
  (past `max_bytes` the file becomes `process-<index>.jsonl.1`, replacing
  the one before, and a new one starts: a row is ~130 bytes, so a million
  steps at 12,288 processes were 1.6 TB of the workdir's filesystem):
  {"step", "process", "host", "time" (unix, end of step), "phases": {...}},
  plus "device": {"compute", "collective"} in the steps whose device time
  was sampled (FaultConfig.device_timing_every): its slowest device's, and
  with several devices each one's under "devices" (see
  mjax.ft.device_time.split_devices).
  `current`, `step` and `ticks` are what a heartbeat reports: `tick()`
  marks progress inside a long phase (each evaluation batch), so that the
  driver tells a long evaluation from a stuck one. `on_enter` callables are
  called with each phase's name as it begins (fault injection).
  """

  def __init__(self, workdir: str, process_index: int, every: int = 10, max_bytes: Optional[int] = None):
    self.process = process_index
    self.host = socket.gethostname()
    self.every = every
    self.max_bytes = max_bytes   # None: never rotated
    self.current = 'startup'
    self.step = 0
    self.ticks = 0
    self.on_enter: list = []
    self._acc = collections.defaultdict(float)
    self._rows: list[dict] = []
    directory = os.path.join(workdir, 'timings')
    self.path = os.path.join(directory, f'process-{process_index:05d}.jsonl')
    try:
      os.makedirs(directory, exist_ok=True)
      self._fh = open(self.path, 'a', buffering=1)
    except OSError as e:
      raise refused_write(e, self.path, 'the per-rank step timings') from None

  def phase(self, name: str):
    """Context manager timing one phase of the current step."""
    @contextlib.contextmanager
    def timed():
      prev, self.current = self.current, name
      t0 = time.perf_counter()
      for fn in self.on_enter:
        fn(name)
      try:
        yield
      finally:
        self._acc[name] += time.perf_counter() - t0
        self.current = prev
    return timed()

  def tick(self) -> None:
    """Progress inside the current phase (read by the heartbeat thread: an
    int's increment needs no lock)."""
    self.ticks += 1

  def end_step(self, step: int, device: dict | None = None) -> None:
    """Closes the row of `step`; `device` is a sampled step's device time
    ({'compute': s, 'collective': s}, see mjax.ft.device_time)."""
    self.step = step
    row = {'step': int(step), 'process': self.process, 'host': self.host,
           'time': time.time(), 'phases': {k: round(v, 6) for k, v in self._acc.items()}}
    if device:
      row['device'] = device
    self._rows.append(row)
    self._acc.clear()
    if len(self._rows) >= self.every:
      self.flush()

  def flush(self) -> None:
    try:
      self._fh.writelines(json.dumps(r) + '\n' for r in self._rows)
      if self.max_bytes is not None and os.fstat(self._fh.fileno()).st_size >= self.max_bytes:
        self._rotate()
    except OSError as e:
      self._rows.clear()
      raise refused_write(e, self.path, 'the per-rank step timings') from None
    self._rows.clear()

  def _rotate(self) -> None:
    """The file so far becomes the previous one (ROTATED), and a new one
    starts. Readers take both (stragglers.load_rows); the driver's tail,
    finding the file shorter than it read, reads the rest of this one
    before the new one (stragglers.TimingTail)."""
    self._fh.close()
    try:
      os.replace(self.path, self.path + ROTATED)
    finally:
      self._fh = open(self.path, 'a', buffering=1)

  def close(self) -> None:
    self.flush()
    self._fh.close()
