"""Metric writers (metrics.jsonl + TensorBoard) and their reader.

The device facts MFU is computed from (peak FLOP/s, peak memory) are in
mjax/devices.py.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import time

from typing import Optional

import numpy as np

from mjax import jsonfile
from mjax.errors import refused_write

# Key of the marker row a resumed (or restarted) run appends: rows written
# before it for steps past its value are superseded.
SUPERSEDES = 'supersedes_after_step'


def read_metrics(workdir: str, step: Optional[int] = None) -> list[dict]:
  """The rows of `<workdir>/metrics.jsonl` as one uninterrupted run: rows a
  later start superseded are left out, as are the markers and any line a
  crash cut short.

  Args:
    workdir: the run directory.
    step: only the rows of this step. The file is still read through, but
      only lines that can be its rows (or markers) are parsed and kept: a
      restart that checks one step must not parse and hold a long run's
      whole history (~1 GB of rows at a million steps).
  """
  wanted = None if step is None else str(int(step))
  entries: list = []   # in file order: the rows, and each marker's step (an int)
  # Bytes that are no UTF-8 (a line garbled on disk) fail that line's JSON,
  # not the file.
  with open(os.path.join(os.fspath(workdir), 'metrics.jsonl'), errors='replace') as fh:
    for line in fh:
      # A row of `step` holds its digits, a marker its key: any other line is neither.
      if wanted is not None and wanted not in line and SUPERSEDES not in line:
        continue
      try:
        row = jsonfile.loads(line)
      except ValueError:
        continue
      if not isinstance(row, dict):
        continue
      if SUPERSEDES in row:
        after = row[SUPERSEDES]
        if isinstance(after, int) and not isinstance(after, bool):   # a damaged marker supersedes nothing
          entries.append(after)
      elif step is None or row.get('step') == step:
        entries.append(row)
  # A row is superseded by any later marker below its step. One pass from the
  # end, with the lowest marker seen so far: dropping rows at each marker
  # went over every earlier row again, 10 minutes for a run of a million
  # steps and 1,000 restarts.
  rows, bound = [], math.inf
  for e in reversed(entries):
    if isinstance(e, dict):
      s = e.get('step', 0)
      if not _number(s) or s <= bound:
        rows.append(e)
    else:
      bound = min(bound, e)
  rows.reverse()
  return rows


def _number(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


class MetricsWriter:
  """Appends one JSON line per record to metrics.jsonl and mirrors the
  scalars to TensorBoard event files. Only process 0 writes."""

  def __init__(self, workdir: str, enabled: bool = True, resume_step: int = 0,
               wandb_project: Optional[str] = None, config: Optional[dict] = None):
    self.enabled = enabled
    self._jsonl = None
    self._tb = None
    self._wandb = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, 'metrics.jsonl')
    # Append only: nothing an earlier run wrote is ever deleted. A run that
    # starts at `resume_step` (0: from scratch) over an existing file first
    # writes a marker that supersedes the earlier rows past that step, so
    # `read_metrics` reads the file as one uninterrupted run.
    try:
      self._jsonl = open(path, 'a', buffering=1)
      if self._jsonl.tell():
        with open(path, 'rb') as fh:   # a line a crash cut short must not swallow the marker
          fh.seek(-1, os.SEEK_END)
          if fh.read(1) != b'\n':
            self._jsonl.write('\n')
        self._jsonl.write(json.dumps({'step': int(resume_step), SUPERSEDES: int(resume_step),
                                      'time': time.time()}) + '\n')
    except OSError as e:
      raise refused_write(e, path, 'the metrics') from None
    tb_dir = os.path.join(workdir, 'tensorboard')
    try:
      self._tb = EventFile(tb_dir, first_step=int(resume_step) + 1)
    except OSError as e:
      raise refused_write(e, tb_dir, 'the TensorBoard events') from None
    if wandb_project:
      self._wandb = _wandb_run(workdir, wandb_project, config)

  def write(self, step: int, scalars: dict, prefix: str = '') -> None:
    if not self.enabled:
      return
    record = {'step': int(step), **{prefix + k: _py(v) for k, v in scalars.items()}}
    try:
      self._jsonl.write(json.dumps(record) + '\n')
    except OSError as e:
      raise refused_write(e, self._jsonl.name, 'the metrics') from None
    numbers = {prefix + k: float(v) for k, v in scalars.items()
               if isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)}
    try:
      self._tb.scalars(numbers, int(step))
    except OSError as e:
      raise refused_write(e, self._tb.path, 'the TensorBoard events') from None
    if self._wandb is not None and numbers:
      # `step` is a metric, not W&B's own step counter: a run resumed from an
      # earlier checkpoint logs steps again, which W&B's counter would drop.
      self._wandb.log({'step': int(step), **numbers})

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      try:
        self._tb.close()
      except OSError as e:
        raise refused_write(e, self._tb.path, 'the TensorBoard events') from None
      if self._wandb is not None:
        self._wandb.finish()


class EventFile:
  """Scalars to a TensorBoard event file, written by the caller's thread
  with tensorboardX's protos and record checksum.

  tensorboardX's SummaryWriter writes from a thread of its own through a
  queue of 10 events. A disk that filled under it killed that thread, and
  the next add_scalar waited on the full queue forever: the run hung at a
  step with no message (where a full disk under metrics.jsonl or the
  timings ends it with one paragraph and exit 2), and at exit its atexit
  flush printed more tracebacks. Here each event is one unbuffered write
  of its record, so a failed write is an OSError in the caller and nothing
  waits in a buffer for an exit that may skip it (a failed process of a
  job ends with os._exit); the file is synced every SYNC_S seconds, as
  SummaryWriter's default, and on close."""

  SYNC_S = 120.0

  def __init__(self, logdir: str, first_step: Optional[int] = None):
    _import_tensorboardx()
    from tensorboardX.proto import event_pb2, summary_pb2
    from tensorboardX.record_writer import masked_crc32c
    self._event, self._summary, self._crc = event_pb2.Event, summary_pb2.Summary, masked_crc32c
    os.makedirs(logdir, exist_ok=True)
    # The name SummaryWriter gives its files (TensorBoard reads any events.out.tfevents.*).
    self.path = os.path.join(logdir, f'events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}')
    self._fh = open(self.path, 'ab', buffering=0)
    self._synced = time.monotonic()
    self._write(self._event(wall_time=time.time(), file_version='brain.Event:2'))
    if first_step is not None:
      # A run resumed from an older checkpoint writes its redone steps
      # again, in this new file. A session start at the first of them tells
      # TensorBoard to drop the earlier files' values from that step on (as
      # SummaryWriter's purge_step does): without it its Python reader
      # (--load_fast=false, EventAccumulator) kept both, and every curve ran
      # back from the newest step to the resumed one.
      self._write(self._event(wall_time=time.time(), step=first_step,
                              session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))

  def scalars(self, values: dict[str, float], step: int) -> None:
    if values:
      summary = self._summary(value=[self._summary.Value(tag=k, simple_value=v) for k, v in values.items()])
      self._write(self._event(wall_time=time.time(), step=step, summary=summary))

  def _write(self, event) -> None:
    if self._fh is None:
      return   # a write failed before: the run is ending with that error
    data = event.SerializeToString()
    header = struct.pack('<Q', len(data))   # TFRecord: length, its checksum, data, its checksum
    record = header + struct.pack('<I', self._crc(header)) + data + struct.pack('<I', self._crc(data))
    try:
      self._fh.write(record)
      if time.monotonic() - self._synced > self.SYNC_S:
        os.fsync(self._fh.fileno())
        self._synced = time.monotonic()
    except OSError:
      self._fh.close()
      self._fh = None
      raise

  def close(self) -> None:
    if self._fh is not None:
      try:
        os.fsync(self._fh.fileno())
      finally:
        self._fh.close()
        self._fh = None


def _import_tensorboardx() -> None:
  """Imports tensorboardX without torch. tensorboardX imports torch, where
  it is installed, only to accept torch tensors (mjax logs floats); that
  import alone took 2.6-2.8 s of every run's start-up on 2 cores (and 180
  MiB), in the process every other one waits for at its first step. A
  torch the process already imported stays as it is."""
  import sys
  hide = 'torch' not in sys.modules
  if hide:
    sys.modules['torch'] = None   # `import torch` raises ImportError: tensorboardX goes without
  try:
    import tensorboardX  # noqa: F401
  finally:
    if hide and 'torch' in sys.modules and sys.modules['torch'] is None:
      del sys.modules['torch']    # a later `import torch` (the user's own) imports it as usual


def _wandb_run(workdir: str, project: str, config: Optional[dict]):
  """A W&B run for this workdir: the same id on every restart (resumed)."""
  import hashlib
  import wandb
  path = os.path.abspath(workdir)
  try:
    run = wandb.init(project=project, dir=path, name=os.path.basename(path.rstrip('/')),
                     id='mjax-' + hashlib.sha256(path.encode()).hexdigest()[:16], resume='allow',
                     config=config or {})
  except wandb.errors.UsageError as e:   # no API key on this machine, a bad setting
    from mjax.errors import UserError
    said = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise UserError(
        f'TrainConfig.wandb_project = {project!r}: Weights & Biases would not start a run: {said} '
        f'Log in on this machine (`wandb login`, or set WANDB_API_KEY), set WANDB_MODE=offline to '
        f'keep the run on disk (`wandb sync` uploads it later), or leave wandb_project unset.') from None
  run.define_metric('step')
  run.define_metric('*', step_metric='step')
  return run


def _py(v):
  if isinstance(v, (np.floating, np.integer)):
    return v.item()
  if isinstance(v, np.ndarray) and v.ndim == 0:
    return v.item()
  return v
