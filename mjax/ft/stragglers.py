"""Straggler analysis of the per-process step timings (MegaScale §4.2).

Every training process appends one row per step to
`<workdir>/timings/process-<i:05d>.jsonl` (see `mjax.ft.phases.PhaseTimer`):

    {"step": 12, "process": 3, "host": "node-07", "time": 1718000000.123,
     "phases": {"data": 0.004, "compute": 0.91, "checkpoint": 0.2}}

`time` is the unix time at the end of the step and `phases` the host
wall-clock seconds of each phase that ran in it. Everything here is a pure
function of such rows (numpy only), so the driver can call it on rows it
gathers itself, and `mjax-report stragglers` on the files of a workdir.

How a straggler shows in these rows. An SPMD step ends in collectives, so
in a multi-process job every process's step takes the same wall time: the
healthy ones spend the straggler's extra time waiting, inside their own
`compute` phase. What survives that:

  lateness   a process whose extra work comes after the step's collective
             (a busy or throttled CPU, host-side bookkeeping, the test-only
             `slow` fault) ends each step after the others, which the
             collective has already released: its end time lags theirs by
             about its extra work, step after step.
  excess     a process whose extra work comes before the collective in a
             phase the others do not wait in (slow input: `data`) spends
             longer in that phase than the others do; where processes are
             not held in step at all, its whole step is longer.

Per step, each process is compared with the median of the *other*
processes (so that with two processes the reference is not halfway to the
straggler). Its slowdown at that step is the largest of its lateness and
its excess in the whole step and in each phase, all in units of a step
(the others' median step time, less the time they spent waiting for this
process): a `data` phase 0.3 s longer than the others' in steps of 1 s
without it is a slowdown of 0.3 whatever the data phase's own length. A
process is a straggler when, over the last `window` steps, its median
slowdown exceeds `margin` and it was slower than `margin / 2` in at least
`consistency` of those steps: one long step (a GC pause, a checkpoint only
this process paid for) moves neither, and noise around a clean run stays
far below both.

Limits: comparing end times across hosts assumes their clocks agree to
well under `margin` x the step time (NTP keeps them within milliseconds;
steps of large models take seconds), and that the processes are held in
step by their collectives, as every multi-process mjax job is (processes
running each at its own pace drift apart, and their end times with them). A slow accelerator is invisible to
host timings in a synchronous job (its collective partners wait on the
device, not on the host, and all are released together). For those, every
FaultConfig.device_timing_every steps each process traces one step and its
row carries "device": {"compute": s, "collective": s} (mjax/ft/device_time.py;
with several GPUs a process also carries each one's, and its GPUs are ranks):
the slow rank computes longer and waits less in the collectives than the
others, and `device_stragglers` compares the last DEVICE_SAMPLES such steps.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import glob
import itertools
import operator
import os
import re
import stat
import sys
import warnings
from typing import Iterable, Optional, Sequence

import numpy as np

from mjax import jsonfile
from mjax.ft.phases import ROTATED

# The order phases run in within one row: evaluation after step s is
# accumulated into row s + 1 before its data; a checkpoint, then a garbage
# collection (mjax/ft/gc_control.py, every few steps) close the step.
PHASE_ORDER = ('eval', 'data', 'compute', 'checkpoint', 'gc')
STEP = 'step'  # the metric "sum of all phases"
DEVICE = 'device'  # the reason of a straggler found in the sampled device times
DEVICE_SAMPLES = 3  # sampled steps a device verdict rests on


@dataclasses.dataclass(frozen=True)
class Straggler:
  """A process found consistently slower than the others.

  Attributes:
    process: process index.
    host: host name from its rows.
    slowdown: median over the window of its slowdown (the largest of its
      lateness and its excess step or phase time, in step times).
    reason: the signal with the largest median: 'late' (ends its steps
      after the others), 'step' (longer steps), a phase ('data', ...), or
      'device' (the others waited for it inside the step in the sampled
      steps, see `device_compare`).
    ratio: median over the window of its step time divided by the median
      of the other processes' at the same step (for 'device': of its device
      compute time).
    lateness: median over the window of how much later than the others it
      ended each step, in step times (see `compare`).
    lateness_s: the same lag in seconds.
    slow_share: share of the window's steps in which its slowdown exceeded
      margin / 2.
    first_step: first step of the window.
    last_step: last step of the window.
    device: for 'device', the slow device's ordinal on its host where the
      process sampled each of its devices (several GPUs), else None.
  """
  process: int
  host: str
  slowdown: float
  reason: str
  ratio: float
  lateness: float
  lateness_s: float
  slow_share: float
  first_step: int
  last_step: int
  device: Optional[int] = None

  def describe(self) -> str:
    """One line for logs and the driver's decision record."""
    if self.reason == DEVICE:
      where = '' if self.device is None else f' (its device {self.device})'
      return (f'process {self.process} on {self.host}{where}: the others wait {self.slowdown:+.0%} of a step for it '
              f'inside the step\'s collectives in the sampled steps {self.first_step}-{self.last_step} (its '
              f'device compute time x{self.ratio:.2f} the others\'; slow in {self.slow_share:.0%} of the '
              f'samples): a slow device, or a host that stalled while its device was due')
    why = {'late': 'ends its steps late', 'step': 'longer steps'}.get(self.reason, f'longer {self.reason} phase')
    return (f'process {self.process} on {self.host}: {self.slowdown:+.0%} of a step slower than the others '
            f'over steps {self.first_step}-{self.last_step}, mostly {why} (step time x{self.ratio:.2f}, '
            f'ends {self.lateness_s * 1e3:.0f} ms late; slow in {self.slow_share:.0%} of the steps)')

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


# ----------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------

def timings_dir(workdir: str) -> str:
  return os.path.join(workdir, 'timings')


def load_rows(workdir: str, tail_bytes: Optional[int] = None, last: Optional[int] = None) -> list[dict]:
  """All timing rows of a run directory, deduplicated: each process's file
  and, where it holds fewer than `last` rows, the one it rotated out before
  (`process-<i>.jsonl.1`, see mjax.ft.phases.PhaseTimer).

  Args:
    workdir: the run's directory (the one holding `timings/`).
    tail_bytes: read only the last this many bytes of each process's file:
      enough for the latest steps, which is all a poller such as the
      driver needs (a row is ~150 bytes; 64 KiB holds ~400 steps), at a
      cost that does not grow with the run's length. None: whole files.
    last: keep the last this many rows of each process's file, reading
      only about as many bytes as they take (their size sampled from the
      file's end), so that a report of a long run at 10,000 processes
      neither reads nor holds its whole history.

  Returns:
    Rows sorted by (process, step), one per (process, step): the last one
    written, since a resumed run appends again the steps it redoes, and
    none of an earlier attempt past the step a later one resumed from.
    What a crash cut short is skipped.

  Raises:
    FileNotFoundError: when `workdir/timings` holds no process-*.jsonl file.
  """
  paths = sorted(p for p in glob.glob(os.path.join(timings_dir(workdir), 'process-*.jsonl')) if os.path.isfile(p))
  if not paths:
    raise FileNotFoundError(
        f'no timing files in {timings_dir(workdir)!r}: every training process writes '
        f'timings/process-<index>.jsonl under its workdir (every FaultConfig.timing_every steps); '
        f'give the --workdir of a run that has taken at least that many steps.')
  rows = []
  for path in paths:
    own = _tail_rows(path, tail_bytes, last)
    # Short of `last` rows (just after a rotation, see PhaseTimer), the rest
    # from the process's previous file, put first: of a row in both, the
    # newer file's is the one written last.
    previous = path + ROTATED
    if (last is None or len(own) < last) and os.path.isfile(previous):
      own = _tail_rows(previous, tail_bytes, None if last is None else last - len(own)) + own
    rows.extend(_superseded_left_out(own))
  return dedupe_rows(rows)


def _tail_rows(path: str, tail_bytes: Optional[int], last: Optional[int]) -> list[dict]:
  """The rows of one timing file, of its end only (see load_rows)."""
  with open(path, 'rb') as fh:
    size = fh.seek(0, os.SEEK_END)
    tail = tail_bytes
    if last is not None:
      sample = min(size, 1 << 16)
      fh.seek(size - sample)
      per_row = sample / max(1, fh.read(sample).count(b'\n'))
      # A margin for rows of other sizes (a resumed run's repeats, samples).
      need = int(last * per_row * 1.5) + 4096
      tail = need if tail is None else min(tail, need)
    start = 0 if tail is None else max(0, size - tail)
    fh.seek(start)
    if start:
      fh.readline()  # most likely the end of a row cut in two by the seek
    kept = collections.deque(maxlen=last)
    for line in fh:
      row = _parse_row(line.decode('utf-8', errors='replace'))
      if row is not None:
        kept.append(row)
  return list(kept)


def _superseded_left_out(rows: list[dict]) -> list[dict]:
  """One process's rows in the order written, less those a restart redid.

  A step at or below the last one is a restart from an older checkpoint,
  whose steps from there on replace the earlier attempt's. That attempt's
  rows past the resumed step are no part of the run any more (as
  metrics.jsonl's superseded rows); kept, a report taken before the run got
  back there showed them as its latest."""
  kept: list[dict] = []
  for row in rows:
    while kept and int(kept[-1]['step']) >= int(row['step']):
      kept.pop()
    kept.append(row)
  return kept


class TimingTail:
  """Incremental reader of a run's timing files, for a poller (the driver).

  Each `read` reads only what the files gained since the previous one and
  keeps the last `keep` rows of every process, so a check costs what the
  processes wrote in between, not the run's length (at 1,536 processes,
  re-reading whole files took 17 s a check). Started `from_end`, it sees
  only rows written from now on: one attempt's, not an earlier one's.

  Beside the rows it keeps the columns the analysis reads of them
  (`table`), taken from each row once, as it is read: at 12,288 processes
  the tail holds ~600k rows, and going through all their dicts again at
  every check cost seconds.
  """

  def __init__(self, workdir: str, keep: int, from_end: bool = True):
    self.directory = timings_dir(workdir)
    self.keep = keep
    self._offsets: dict[str, int] = {}
    self._partial: dict[str, bytes] = {}
    # In the order the files first gained rows: the order `update` returns
    # them in, so that of two rows of one (process, step) in two files the
    # same one wins.
    self._files: dict[str, _FileTail] = {}
    if from_end:
      for path, size in self._sizes():
        self._offsets[path] = size

  def _sizes(self) -> list[tuple[str, int]]:
    """(path, size) of every process-*.jsonl regular file, in directory
    order: one stat a file, for a listing taken at every check."""
    out = []
    try:
      with os.scandir(self.directory) as entries:
        for e in entries:
          if _TIMING_FILE(e.name):
            try:
              info = e.stat()
            except OSError:    # gone since the listing
              continue
            if stat.S_ISREG(info.st_mode):
              out.append((e.path, info.st_size))
    except OSError:
      pass   # no timings directory (yet)
    return out

  def read(self) -> None:
    """Reads what the files gained since the previous call."""
    for path, size in self._sizes():
      offset = self._offsets.get(path, 0)
      if size < offset:            # replaced or truncated: start it again
        # Rotated by its writer (PhaseTimer): first what the file it became
        # gained since the previous call, the rows of the rotation's steps.
        rotated = _size_of(path + ROTATED)
        if rotated is not None and rotated > offset:
          self._take(path, _read_at(path + ROTATED, offset, rotated - offset))
        offset, self._offsets[path], self._partial[path] = 0, 0, b''
      if size == offset:
        continue
      data = _read_at(path, offset, size - offset)
      if data is None:             # gone since the listing
        continue
      self._offsets[path] = offset + len(data)
      self._take(path, data)

  def _take(self, path: str, data: Optional[bytes]) -> None:
    """The rows in `data`, read from the end of `path`'s rows so far."""
    if not data:
      return
    f = self._files.get(path)
    if f is None:
      f = self._files[path] = _FileTail(self.keep)
    buf = self._partial.pop(path, b'') + data
    cut = buf.rfind(b'\n')
    self._partial[path] = buf[cut + 1:]   # a row still being written
    if cut < 0:
      return
    body = buf[:cut]
    # One decode for the whole read where it can make no difference: a
    # line's undecodable bytes are replaced line by line, as load_rows does.
    lines = body.decode('ascii').split('\n') if body.isascii() else \
        [line.decode('utf-8', errors='replace') for line in body.split(b'\n')]
    for line in lines:
      row = _parse_row(line)
      if row is not None:
        f.add(row)

  def update(self) -> list[dict]:
    """The kept rows of every process, after reading what was appended:
    every process's kept device samples first, then its latest rows."""
    self.read()
    files = self._files.values()
    return [r for f in files for r in f.samples] + [r for f in files for r in f.rows]

  def table(self, processes: Optional[Iterable[int]] = None) -> RowTable:
    """What `update` returns (as of the last `read`), of `processes` (None:
    all), as a RowTable, from the columns kept as the rows were read."""
    files = list(self._files.values())
    chain = itertools.chain.from_iterable
    sampled = list(chain(f.samples for f in files))
    rows = sampled + list(chain(f.rows for f in files))
    head = _columns(sampled)
    n = len(rows) - len(sampled)

    def column(part, dtype):
      return np.concatenate([head[part], np.fromiter(chain(getattr(f, part) for f in files), dtype, n)])

    names = set(head['phases']).union(*(f.phases for f in files))
    phases = {}
    for name in names:
      kept = np.fromiter(chain(f.phases[name] if name in f.phases else itertools.repeat(np.nan, len(f.rows))
                               for f in files), float, n)
      phases[name] = np.concatenate([head['phases'].get(name, np.full(len(sampled), np.nan)), kept])
    return RowTable(column('process', np.int64), column('step', np.int64), column('time', float),
                    column('total', float), column('sampled', bool), phases, rows, processes)


_TIMING_FILE = re.compile(fnmatch.translate('process-*.jsonl')).match
_STALE_PHASES = 16   # a file's phase columns beyond which those no kept row has are dropped


def _size_of(path: str) -> Optional[int]:
  try:
    return os.stat(path).st_size
  except OSError:
    return None


def _read_at(path: str, offset: int, size: int) -> Optional[bytes]:
  """Up to `size` bytes of a file from `offset`; None when it cannot be opened."""
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return None
  try:
    parts = []
    while size > 0:
      part = os.pread(fd, size, offset)
      if not part:
        break
      parts.append(part)
      offset, size = offset + len(part), size - len(part)
    return b''.join(parts)
  except OSError:
    return None
  finally:
    os.close(fd)


class _FileTail:
  """What a TimingTail keeps of one file: its last rows, and beside them the
  columns the analysis reads (see RowTable), in the same order."""

  __slots__ = ('rows', 'process', 'step', 'time', 'total', 'sampled', 'phases', 'samples')

  def __init__(self, keep: int):
    self.rows = collections.deque(maxlen=keep)
    self.process, self.step, self.time, self.total, self.sampled = (
        collections.deque(maxlen=keep) for _ in range(5))
    self.phases: dict[str, collections.deque] = {}   # seconds, NaN in a row without that phase
    # Sampled rows come every FaultConfig.device_timing_every steps, far
    # apart: the last few are kept apart from the latest rows.
    self.samples = collections.deque(maxlen=2 * DEVICE_SAMPLES)

  def add(self, row: dict) -> None:
    """A row that passed _valid_row."""
    phases, columns = row['phases'], self.phases
    if not phases.keys() <= columns.keys():
      if len(columns) >= _STALE_PHASES:   # a stray phase name costs nothing for long
        for name in [k for k, col in columns.items() if all(v != v for v in col)]:
          del columns[name]
      for name in phases.keys() - columns.keys():
        columns[name] = collections.deque([np.nan] * len(self.rows), maxlen=self.rows.maxlen)
    for name, col in columns.items():
      col.append(phases.get(name, np.nan))
    self.rows.append(row)
    self.process.append(row['process'])
    self.step.append(row['step'])
    self.time.append(float(row['time']))
    self.total.append(float(sum(phases.values())))
    sampled = 'device' in row   # _parse_row keeps a "device" only where it is a sample
    self.sampled.append(sampled)
    if sampled:
      self.samples.append(row)


def _parse_row(line: str) -> Optional[dict]:
  """One timing row, or None for a line that holds none.

  A process killed mid-write leaves half a line without its newline; the
  next run's first row is then appended to it. That row is recovered from
  the end of the line.
  """
  row = _loads(line)
  if not _valid_row(row):
    start = line.rfind('{"step"')
    if start <= 0:   # no row after the damage (at 0: the line just read)
      return None
    row = _loads(line[start:])
    if not _valid_row(row):
      return None
  if 'device' in row and not _valid_sample(row['device']):
    del row['device']   # a damaged sample costs the sample, not the row
  return row


def _loads(text: str):
  try:
    return jsonfile.loads(text)
  except (ValueError, RecursionError):   # not JSON; nested past the parser's depth
    return None


# What the checks below accept is what json.loads returns, whose types are
# exact: `type(x) is int` leaves out bools (true, false) as isinstance
# would not. An int counts as a number only as large as float arithmetic on
# it (a step's phases summed) stays finite: a larger one, converted, would
# stop the analysis.
_FLOAT_MAX = sys.float_info.max
_INT_MAX = 2**1000


def _number(x) -> bool:
  t = type(x)
  if t is float:
    return -_FLOAT_MAX <= x <= _FLOAT_MAX   # not NaN, not infinite
  return t is int and -_INT_MAX <= x <= _INT_MAX


def _count(x, below: int) -> bool:
  return type(x) is int and 0 <= x < below


def _valid_row(row) -> bool:
  """Whether a parsed line has the shape PhaseTimer writes: anything else
  (a damaged or foreign line) would stop the report, or the driver's watch.
  Checked for every row the driver reads (~120k at every check at 12,288
  processes), so with plain comparisons."""
  if type(row) is not dict:
    return False
  phases = row.get('phases')
  if not (_count(row.get('step'), 2**53) and _count(row.get('process'), 2**31) and _number(row.get('time'))
          and type(row.get('host', '')) is str and type(phases) is dict):
    return False
  for v in phases.values():   # a JSON object's keys are strings
    t = type(v)
    if t is float:
      if not 0 <= v <= _FLOAT_MAX:
        return False
    elif t is not int or not 0 <= v <= _INT_MAX:
      return False
  return True


def _valid_sample(d) -> bool:
  """Whether a row's "device" has the shape DeviceSampler writes."""
  def split(x):
    return (isinstance(x, dict) and all(_number(x.get(k)) for k in ('compute', 'collective'))
            and isinstance(x.get('stage', 0), int))
  per = d.get('devices', {}) if isinstance(d, dict) else None
  return split(d) and isinstance(per, dict) and all(
      isinstance(k, str) and re.fullmatch(r'[0-9]{1,6}', k) and split(v) for k, v in per.items())


def dedupe_rows(rows: Iterable[dict]) -> list[dict]:
  """One row per (process, step), the last in iteration order.

  Args:
    rows: timing rows in the order they were written (per process, file
      order is time order).

  Returns:
    The surviving rows sorted by (process, step).
  """
  latest = {}
  for r in rows:
    latest[(int(r['process']), int(r['step']))] = r
  return [latest[k] for k in sorted(latest)]


def step_duration(row: dict, metric: str = STEP) -> float:
  """Seconds of one row: all phases summed (`metric='step'`) or one phase
  (0 when that phase did not run in this step)."""
  phases = row['phases']
  if metric == STEP:
    return float(sum(phases.values()))
  return float(phases.get(metric, 0.0))


def phases_of(rows: Iterable[dict]) -> list[str]:
  """Phase names present in `rows`, in the order they run within a step."""
  seen = set()
  for r in rows:
    seen.update(r['phases'])
  return _in_phase_order(seen)


def _in_phase_order(names) -> list[str]:
  names = set(names)
  return [p for p in PHASE_ORDER if p in names] + sorted(names - set(PHASE_ORDER))


class RowTable:
  """Timing rows as the columns the analysis reads, one row per (process,
  step) (the last one written), sorted by (process, step).

  find_stragglers, device_stragglers and job_pace take one in place of
  rows: the driver's TimingTail keeps these columns as it reads (`table`),
  so that a check does not go through every kept row's dict again.

  Attributes, arrays over the rows:
    process, step: int64.
    time: the step's end, unix seconds.
    total: the step's seconds, its phases summed (`step_duration`).
    phases: {phase: seconds, NaN in a row whose step it did not run in}.
    sampled: whether the row holds a device sample ("device").
  """

  def __init__(self, process: np.ndarray, step: np.ndarray, time: np.ndarray, total: np.ndarray,
               sampled: np.ndarray, phases: dict, rows: Sequence[dict],
               processes: Optional[Iterable[int]] = None):
    """Columns of `rows`, in the order they were written; `processes`: keep
    only the rows of these (None: all)."""
    index = np.arange(len(process))
    if processes is not None:
      index = np.flatnonzero(np.isin(process, np.fromiter(processes, np.int64)))
    index = index[_last_of_each(process[index], step[index])]
    self._index, self._rows = index, rows
    self.process, self.step = process[index], step[index]
    self.time, self.total, self.sampled = time[index], total[index], sampled[index]
    self.phases = {name: v[index] for name, v in phases.items()}
    self._step_counts = None

  @classmethod
  def from_rows(cls, rows: Iterable[dict], processes: Optional[Iterable[int]] = None) -> RowTable:
    rows = list(rows)
    c = _columns(rows)
    return cls(c['process'], c['step'], c['time'], c['total'], c['sampled'], c['phases'], rows, processes)

  def __len__(self) -> int:
    return len(self.process)

  def rows(self, at: Optional[Iterable[int]] = None) -> list[dict]:
    """The rows themselves (at these positions)."""
    index = self._index if at is None else self._index[np.asarray(at, np.int64)]
    return [self._rows[i] for i in index.tolist()]

  def processes(self) -> np.ndarray:
    return np.unique(self.process)

  def latest_steps(self, window: int, quorum: int) -> np.ndarray:
    """The latest `window` steps that at least `quorum` processes reported:
    rows arrive in batches, so the newest steps may be missing a few processes."""
    if self._step_counts is None:
      self._step_counts = np.unique(self.step, return_counts=True)
    steps, counts = self._step_counts
    return steps[counts >= quorum][-window:]

  def host(self, process: int) -> str:
    """The host its latest row names."""
    end = int(np.searchsorted(self.process, process, side='right'))
    if not end or self.process[end - 1] != process:
      return '?'
    return self._rows[int(self._index[end - 1])].get('host', '?')

  def sampled_rows(self) -> list[dict]:
    """The rows holding a device sample, sorted by (process, step)."""
    return self.rows(np.flatnonzero(self.sampled))


def _columns(rows: Sequence[dict]) -> dict:
  """RowTable's columns of rows, in their order (through C-level maps: a
  report's or a test's rows may be hundreds of thousands)."""
  n = len(rows)
  phases = list(map(operator.itemgetter('phases'), rows))
  devices = map(operator.methodcaller('get', 'device'), rows)
  return {'process': np.fromiter(map(int, map(operator.itemgetter('process'), rows)), np.int64, n),
          'step': np.fromiter(map(int, map(operator.itemgetter('step'), rows)), np.int64, n),
          'time': np.fromiter(map(float, map(operator.itemgetter('time'), rows)), float, n),
          'total': np.fromiter(map(float, map(sum, map(dict.values, phases))), float, n),
          'sampled': np.fromiter(map(isinstance, devices, itertools.repeat(dict)), bool, n),
          'phases': {name: np.fromiter(map(operator.methodcaller('get', name, np.nan), phases), float, n)
                     for name in set().union(*phases)}}


def _last_of_each(process: np.ndarray, step: np.ndarray) -> np.ndarray:
  """Positions of the last row of each (process, step), sorted by (process, step)."""
  n = len(process)
  if not n:
    return np.zeros(0, np.int64)
  low, span = int(step.min()), int(step.max()) - int(step.min()) + 1
  if int(process.min()) >= 0 and (int(process.max()) + 1) * span < 2**62:
    key = process * span + (step - low)
    order = np.argsort(key, kind='stable')   # each file is a run already in order
    key = key[order]
    last = np.append(key[1:] != key[:-1], True)
  else:
    order = np.lexsort((np.arange(n), step, process))
    p, s = process[order], step[order]
    last = np.append((p[1:] != p[:-1]) | (s[1:] != s[:-1]), True)
  return order[last]


def grid(rows: Sequence[dict], steps: Optional[Sequence[int]] = None) -> dict:
  """Rows as process x step arrays, every metric at once.

  Args:
    rows: deduplicated timing rows.
    steps: the step columns to build; default every step in `rows`.

  Returns:
    {'processes': [P], 'steps': [S], 'end': [P, S] unix end times,
     'seconds': {'step': [P, S] sum of phases, phase: [P, S], ...}}. A
    (process, step) without a row is NaN everywhere; a phase that did not
    run in a row's step is 0.
  """
  return _grid(RowTable.from_rows(rows), steps)


def _grid(t: RowTable, steps: Optional[Sequence[int]] = None, first: Optional[int] = None) -> dict:
  """`grid` of a table's rows, those from step `first` on where given."""
  sel = slice(None) if first is None else np.flatnonzero(t.step >= first)
  process, step = t.process[sel], t.step[sel]
  processes = np.unique(process)
  steps = np.unique(step) if steps is None else np.asarray(steps, dtype=np.int64)
  i = np.searchsorted(processes, process)
  if np.all(steps[1:] > steps[:-1]):
    j = np.minimum(np.searchsorted(steps, step), max(len(steps) - 1, 0))
    on = steps[j] == step if len(steps) else np.zeros(len(step), bool)
  else:   # the step columns as given, where the same step twice keeps the last
    column = {s: k for k, s in enumerate(steps.tolist())}
    j = np.fromiter((column.get(s, -1) for s in step.tolist()), np.int64, len(step))
    on = j >= 0
  i, j = i[on], j[on]
  shape = (len(processes), len(steps))

  def spread(values):
    out = np.full(shape, np.nan)
    out[i, j] = values[sel][on]
    return out

  present = np.zeros(shape, bool)
  present[i, j] = True
  names = _in_phase_order(name for name, v in t.phases.items() if not np.all(np.isnan(v[sel])))
  seconds = {STEP: spread(t.total)}
  for name in names:
    seconds[name] = spread(t.phases[name])
    seconds[name][present & np.isnan(seconds[name])] = 0.0
  return {'processes': processes, 'steps': steps, 'end': spread(t.time), 'seconds': seconds}


def matrices(rows: Sequence[dict], metric: str = STEP,
             steps: Optional[Sequence[int]] = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """Rows as process x step arrays, one metric.

  Args:
    rows: deduplicated timing rows.
    metric: 'step' (sum of phases) or a phase name.
    steps: the step columns to build; default every step in `rows`.

  Returns:
    (processes [P], steps [S], seconds [P, S], end_times [P, S]); a
    (process, step) without a row is NaN in both arrays.
  """
  g = grid(rows, steps)
  values = g['seconds'].get(metric)
  if values is None:  # a phase no row has: it never ran
    values = np.where(np.isnan(g['end']), np.nan, 0.0)
  return g['processes'], g['steps'], values, g['end']


def _loo_median(x: np.ndarray) -> np.ndarray:
  """Per column, the median of the other rows' values (NaNs ignored).

  Leaving the row itself out keeps the reference honest in small jobs: with
  two processes the plain median would be halfway to the straggler.

  Args:
    x: [P, S] array, NaN where missing.

  Returns:
    [P, S]: for each entry, the median of the column without that row; NaN
    where the entry is NaN or no other value exists.
  """
  P, S = x.shape
  s = np.sort(x, axis=0)                                  # NaNs sort last
  m = np.sum(~np.isnan(x), axis=0) - 1                    # values left per column
  columns = np.arange(S)

  def kth_remaining(k):
    # The k-th smallest of the remaining values is the k-th of the column
    # where that lies below the entry removed, else the (k + 1)-th; which
    # of several equal values is removed makes no difference.
    k = np.maximum(k, 0)
    at, after = s[np.minimum(k, P - 1), columns], s[np.minimum(k + 1, P - 1), columns]
    return np.where(at < x, at, after)

  med = 0.5 * (kth_remaining((m - 1) // 2) + kth_remaining(m // 2))
  med[:, m < 1] = np.nan
  med[np.isnan(x)] = np.nan
  return med


def _nanmedian(x, axis=None):
  """np.nanmedian without the warning for all-NaN input (NaN is the answer)."""
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', RuntimeWarning)
    return np.nanmedian(x, axis=axis)


def compare(rows: Sequence[dict], steps: Optional[Sequence[int]] = None) -> dict:
  """Per (process, step), how each process compares with the others.

  Args:
    rows: deduplicated timing rows.
    steps: the steps to compare (default all of them).

  Returns:
    dict with 'processes' [P], 'steps' [S] and [P, S] arrays (NaN where a
    row is missing or nothing is compared): 'ratio' (step time / the others'
    median), 'lateness_s' (end time - the others' median end time),
    'lateness' (lateness_s in step times), 'excess' ({'step' or phase:
    seconds more than the others' median, in step times}), 'signals'
    (lateness as 'late', and the excesses) and 'slowdown' (the largest
    signal). A step time here is the others' median step time; for
    lateness and phases, less this process's extra time, which the others
    spent waiting for it.
  """
  return _compare(grid(rows, steps))


def _compare(g: dict) -> dict:
  """`compare` of a `grid`."""
  processes, steps, end, seconds = g['processes'], g['steps'], g['end'], g['seconds']
  total = seconds[STEP]

  def per_step(extra_s, ref):
    # In a lock-stepped job the others' step time includes waiting out this
    # process's extra time; measured against a step without it, 30% of extra
    # work reads as 0.3 rather than 0.3 / 1.3. The floor keeps a one-off lag
    # longer than a whole step finite.
    rest = np.maximum(ref - np.clip(extra_s, 0, None), 0.1 * ref)
    return extra_s / rest

  with np.errstate(invalid='ignore', divide='ignore'):
    ref_total = _loo_median(total)
    ref_total = np.where(ref_total > 0, ref_total, np.nan)
    late_s = end - _loo_median(end)
    excess = {STEP: (total - ref_total) / ref_total}
    for ph, x in seconds.items():
      if ph != STEP:
        excess[ph] = per_step(x - _loo_median(x), ref_total)
    signals = {'late': per_step(late_s, ref_total), **excess}
    stacked = np.stack(list(signals.values()))
    slowdown = np.where(np.all(np.isnan(stacked), axis=0), np.nan,
                        np.nanmax(np.where(np.isnan(stacked), -np.inf, stacked), axis=0))
  return {'processes': processes, 'steps': steps, 'ratio': total / ref_total, 'lateness_s': late_s,
          'lateness': signals['late'], 'excess': excess, 'signals': signals, 'slowdown': slowdown}


# ----------------------------------------------------------------------------
# Detection
# ----------------------------------------------------------------------------

def _latest_steps(rows: Sequence[dict], window: int, quorum: int) -> list[int]:
  """The latest `window` steps that at least `quorum` processes reported:
  rows arrive in batches, so the newest steps may be missing a few processes."""
  counts: dict[int, int] = collections.Counter(int(r['step']) for r in rows)
  return sorted(s for s, c in counts.items() if c >= quorum)[-window:]


def device_compare(rows: Sequence[dict], samples: int = DEVICE_SAMPLES) -> Optional[dict]:
  """Per rank, its device compute time in the latest sampled steps against the others'.

  A rank slowed inside the step holds the others in the step's collectives:
  their compute kernels end on time and they wait, while it arrives last
  and waits little (see mjax.ft.device_time). Its kernels take longer where
  the device itself is slow; where its host stalled (the device idle, then
  late), they do not, but its wait in the collectives is still shorter. So
  its extra time is the larger of its compute beyond the others' and its
  collective time short of theirs; in units of the others' device step
  (compute + collectives) less that extra, which they spent waiting, it is
  its slowdown, as `compare` measures a phase.

  The ranks are the processes, or their devices where the samples hold each
  device's split ('devices': a process with several GPUs), so that one slow
  GPU among a host's eight stands against the other fifteen of a two-host
  job, or against its seven peers in a single-process one.

  Returns:
    None with fewer than `samples` steps sampled by at least half the
    processes (and two of them, or one with several devices), or no two
    ranks of one pipeline stage; else {'processes' [R], 'devices' [R] (the
    device's ordinal in its process, -1 for a process sampled as a whole),
    'steps' [S], 'ratio' [R, S] (compute / the others' median of its
    stage), 'slowdown' [R, S]}, NaN where a rank has no sample or no other
    rank of its stage.
  """
  sampled = [r for r in rows if isinstance(r.get('device'), dict)]
  processes = sorted({int(r['process']) for r in sampled})
  if not processes:
    return None

  def parts(d):
    # A process's own split where it has one, else each device's ('devices').
    per = d.get('devices')
    if isinstance(per, dict) and len(per) > 1:
      return [(int(k), v) for k, v in per.items() if isinstance(v, dict)]
    return [(-1, d)]

  stage = {(int(r['process']), dev): d.get('stage') for r in sampled for dev, d in parts(r['device'])}
  ranks = sorted(stage)
  if len(ranks) < 2:
    return None
  steps = _latest_steps(sampled, samples, max(1 if len(processes) == 1 else 2, (len(processes) + 1) // 2))
  if len(steps) < samples:
    return None
  ri, si = {k: i for i, k in enumerate(ranks)}, {s: j for j, s in enumerate(steps)}
  compute = np.full((len(ranks), len(steps)), np.nan)
  collective = compute.copy()
  for r in sampled:
    j = si.get(int(r['step']))
    if j is None:
      continue
    for dev, d in parts(r['device']):
      i = ri[(int(r['process']), dev)]
      compute[i, j] = float(d.get('compute', np.nan))
      collective[i, j] = float(d.get('collective', 0.0))
  # Each rank against the others of its pipeline stage (all of them, unpipelined).
  ref, ref_total, ref_coll = (np.full_like(compute, np.nan) for _ in range(3))
  for g in set(stage.values()):
    idx = [i for i, k in enumerate(ranks) if stage[k] == g]
    ref[idx], ref_total[idx] = _loo_median(compute[idx]), _loo_median(compute[idx] + collective[idx])
    ref_coll[idx] = _loo_median(collective[idx])
  with np.errstate(invalid='ignore', divide='ignore'):
    extra = np.fmax(compute - ref, ref_coll - collective)
    rest = np.maximum(ref_total - np.clip(extra, 0, None), 0.1 * ref_total)
    slowdown = extra / rest
  if np.all(np.isnan(slowdown)):
    return None   # no rank has another of its stage to compare with
  return {'processes': np.array([p for p, _ in ranks]), 'devices': np.array([d for _, d in ranks]),
          'steps': np.array(steps), 'ratio': compute / ref, 'slowdown': slowdown}


def _row_medians(x: np.ndarray) -> np.ndarray:
  """np.nanmedian of each row of a 2-D array (NaN for a row of NaNs), all
  rows at once: row by row, thousands of rows took a second of calls."""
  R, S = x.shape
  n = np.count_nonzero(~np.isnan(x), axis=1)
  if not S:
    return np.full(R, np.nan)
  ordered = np.sort(x, axis=1)                             # NaNs sort last
  rows = np.arange(R)
  low, high = ordered[rows, np.maximum((n - 1) // 2, 0)], ordered[rows, n // 2]
  # np.median's: the middle value, or the mean of the middle two.
  with np.errstate(invalid='ignore'):
    median = np.where(n % 2 == 1, high, (low + high) / 2)
  median[n == 0] = np.nan
  return median


def _slow_verdicts(slow: np.ndarray, margin: float, consistency: float,
                   least: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Which rows of `slow` ([R, S]: a process's or a rank's slowdown in each
  step of a window, NaN where not judged) are stragglers: at least `least`
  judged steps, a median above `margin`, and a share of its judged steps
  slower than margin / 2 of at least `consistency`.

  Returns:
    (flagged [R] bool, median [R], share [R]).
  """
  judged = np.count_nonzero(~np.isnan(slow), axis=1)
  median = _row_medians(slow)
  share = np.count_nonzero(slow > margin / 2, axis=1) / np.maximum(judged, 1)
  flagged = (judged >= max(1, least)) & (median > margin) & (share >= consistency)
  return flagged, median, share


def device_stragglers(rows: Sequence[dict] | RowTable, margin: float = 0.2, consistency: float = 0.8,
                      samples: int = DEVICE_SAMPLES) -> list[Straggler]:
  """Processes the others waited for inside the step in the latest `samples`
  sampled steps (see `device_compare`): median slowdown above `margin`,
  above margin / 2 in at least `consistency` of them (all, for three).
  `rows` may be a RowTable."""
  if margin <= 0 or samples < 1 or not 0 < consistency <= 1:
    raise ValueError(f'device_stragglers: margin {margin!r} must be > 0, samples {samples!r} >= 1 and '
                     f'consistency {consistency!r} in (0, 1].')
  table = rows if isinstance(rows, RowTable) else None
  sig = device_compare(table.sampled_rows() if table is not None else dedupe_rows(rows), samples)
  if sig is None:
    return []
  if table is not None:
    host = table.host
  else:
    hosts = {int(r['process']): r.get('host', '?') for r in rows}
    host = lambda p: hosts.get(p, '?')
  procs, devs = sig['processes'].tolist(), sig['devices'].tolist()
  flagged, median, share = _slow_verdicts(sig['slowdown'], margin, consistency, (samples + 1) // 2)
  ranks, slow_ranks = collections.Counter(procs), collections.Counter(p for p, f in zip(procs, flagged) if f)
  found: dict[int, Straggler] = {}
  for i in np.flatnonzero(flagged).tolist():
    p, dev, med = procs[i], devs[i], float(median[i])
    if p in found and med <= found[p].slowdown:
      continue   # a process once, by its slowest device
    # A device is named where it stands out from its process's other
    # devices; where most of them are slow too (a host that stalled, a
    # node-wide throttle), the process is.
    siblings, slow_siblings = ranks[p] - 1, slow_ranks[p] - 1
    whole = dev < 0 or (siblings > 0 and slow_siblings >= siblings / 2)
    found[p] = Straggler(process=p, host=host(p), slowdown=med, reason=DEVICE,
                         ratio=float(_nanmedian(sig['ratio'][i])), lateness=0.0, lateness_s=0.0,
                         slow_share=float(share[i]), first_step=int(sig['steps'][0]),
                         last_step=int(sig['steps'][-1]), device=None if whole else dev)
  return sorted(found.values(), key=lambda s: -s.slowdown)


def find_stragglers(rows: Sequence[dict] | RowTable, margin: float = 0.2, window: int = 20,
                    consistency: float = 0.8) -> list[Straggler]:
  """Processes consistently slower than the others over the last steps.

  Args:
    rows: timing rows of any number of processes (duplicates allowed: the
      last row of a (process, step) wins), or a RowTable of them.
    margin: FaultConfig.straggler_margin: how much slower than the others,
      in step times (0.2: 20%), the median over the window must be.
    window: FaultConfig.straggler_window: how many of the latest steps to
      judge on. Fewer steps than this, or a single process, flag nobody.
    consistency: the share of the window's steps in which a flagged
      process must be slower than margin / 2.

  Returns:
    The stragglers, slowest first: those the host timings show, and those
    the others wait for inside the step in the sampled steps (`device_stragglers`),
    a process found both ways once, by its larger slowdown.
  """
  if margin <= 0 or window < 1 or not 0 < consistency <= 1:
    raise ValueError(f'find_stragglers: margin {margin!r} must be > 0, window {window!r} >= 1 and '
                     f'consistency {consistency!r} in (0, 1].')
  table = rows if isinstance(rows, RowTable) else RowTable.from_rows(rows)
  found = {}
  for s in _host_stragglers(table, margin, window, consistency) + device_stragglers(table, margin, consistency):
    if s.process not in found or s.slowdown > found[s.process].slowdown:
      found[s.process] = s
  return sorted(found.values(), key=lambda s: -s.slowdown)


def _host_stragglers(rows: Sequence[dict] | RowTable, margin: float, window: int,
                     consistency: float) -> list[Straggler]:
  table = rows if isinstance(rows, RowTable) else RowTable.from_rows(rows)
  n_proc = len(table.processes())
  if n_proc < 2:
    return []
  steps = table.latest_steps(window, max(2, (n_proc + 1) // 2))
  if len(steps) < window:
    return []
  sig = _compare(_grid(table, steps, first=steps[0]))
  flagged, median, share = _slow_verdicts(sig['slowdown'], margin, consistency, window // 2)
  at = np.flatnonzero(flagged)
  signals = {k: _row_medians(v[at]).tolist() for k, v in sig['signals'].items()}
  ratio, lateness_s = _row_medians(sig['ratio'][at]).tolist(), _row_medians(sig['lateness_s'][at]).tolist()
  found = []
  for n, i in enumerate(at.tolist()):
    p = int(sig['processes'][i])
    by_signal = {k: v[n] for k, v in signals.items()}
    found.append(Straggler(
        process=p, host=table.host(p), slowdown=float(median[i]),
        reason=max(by_signal, key=lambda k: -np.inf if np.isnan(by_signal[k]) else by_signal[k]),
        ratio=ratio[n], lateness=by_signal['late'], lateness_s=lateness_s[n], slow_share=float(share[i]),
        first_step=int(sig['steps'][0]), last_step=int(sig['steps'][-1])))
  return found


def job_pace(rows: Sequence[dict] | RowTable, window: int = 20) -> Optional[float]:
  """The job's step time: per step the median over processes, then the
  median over the latest `window` steps that at least half the processes
  reported; None before there are that many. `rows` may be a RowTable.

  What find_stragglers cannot see, this can: a process slowed inside the
  step's work (a throttled accelerator, a host stopped while its device
  part of a collective is due) holds every process in that collective, so
  no process ends late or works longer than the others, but the whole job's
  steps get longer. Compared with the same job's pace earlier in the attempt
  (`_StragglerWatch`), it shows as a slowdown of the job."""
  table = rows if isinstance(rows, RowTable) else RowTable.from_rows(rows)
  n_proc = len(table.processes())
  if not n_proc or window < 1:
    return None
  steps = table.latest_steps(window, (n_proc + 1) // 2)
  if len(steps) < window:
    return None
  at = np.flatnonzero(np.isin(table.step, steps))
  at = at[np.argsort(table.step[at], kind='stable')]      # by step, each in process order
  bounds = np.searchsorted(table.step[at], steps)
  totals = np.split(table.total[at], bounds[1:])
  return float(np.median([np.median(x) for x in totals]))


# ----------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------

def summary_table(rows: Sequence[dict], margin: float = 0.2, window: int = 20,
                  metric: str = STEP, found: Optional[Sequence[Straggler]] = None) -> list[dict]:
  """Per-process summary of a run's timings, with a straggler verdict.

  Args:
    rows: timing rows (deduplicated here).
    margin, window: as for `find_stragglers`, which gives the verdict.
    metric: 'step' (sum of phases) or a phase name: what median_s and p90_s
      describe.
    found: `find_stragglers(rows, margin, window)` where the caller has it
      already (at 10,000 processes it takes seconds).

  Returns:
    One dict per process, sorted by process: process, host, steps (rows),
    first_step, last_step, median_s and p90_s (of `metric`), ratio (median
    over all steps of its step time / the others' median), lateness_s
    (median lag of its end of step behind the others'), phases ({phase:
    median s}), verdict ('straggler', 'ok', or 'n/a' when there is nothing
    to compare with or fewer than `window` steps) and, for stragglers,
    slowdown and reason (the signal that gave it away: 'late', 'step', a
    phase or 'device'), with device_index where a device was named. Where
    it sampled device time: device ({'compute', 'collective'} medians, its
    slowest device's in each sample), and with several devices, devices
    ({ordinal: the same for that device}).
  """
  rows = dedupe_rows(rows)
  if not rows:
    return []
  t = RowTable.from_rows(rows)
  g = _grid(t)
  sig = _compare(g)
  processes, steps = sig['processes'], sig['steps']
  seconds = g['seconds']
  values = seconds.get(metric, seconds[STEP] * 0)
  phase_vals = {ph: v for ph, v in seconds.items() if ph != STEP}
  hosts = {int(r['process']): r.get('host', '?') for r in rows}
  flagged = {s.process: s for s in (found if found is not None else find_stragglers(t, margin, window))}
  judged = (len(processes) >= 2 and len(steps) >= window) or device_compare(t.sampled_rows()) is not None
  samples = collections.defaultdict(list)
  for r in rows:
    if isinstance(r.get('device'), dict):
      samples[int(r['process'])].append(r['device'])
  table = []
  for i, p in enumerate(processes.tolist()):
    have = ~np.isnan(values[i])
    x = values[i][have]
    entry = {
        'process': p, 'host': hosts[p], 'steps': int(have.sum()),
        'first_step': int(steps[have][0]), 'last_step': int(steps[have][-1]),
        'median_s': float(np.median(x)), 'p90_s': float(np.percentile(x, 90)),
        'ratio': float(_nanmedian(sig['ratio'][i])), 'lateness_s': float(_nanmedian(sig['lateness_s'][i])),
        'phases': {ph: float(_nanmedian(v[i])) for ph, v in phase_vals.items()},
        'verdict': 'straggler' if p in flagged else ('ok' if judged else 'n/a'),
    }
    if p in flagged:
      entry.update(slowdown=flagged[p].slowdown, reason=flagged[p].reason)
      if flagged[p].device is not None:
        entry['device_index'] = flagged[p].device
    if samples[p]:
      entry['device'] = _median_split(samples[p])
      per = collections.defaultdict(list)
      for d in samples[p]:
        for ordinal, v in (d.get('devices') or {}).items():
          per[int(ordinal)].append(v)
      if per:   # each of its GPUs, where it has several
        entry['devices'] = {g: _median_split(vs) for g, vs in sorted(per.items())}
    table.append(entry)
  return table


def _median_split(splits: Sequence[dict]) -> dict:
  """{'compute', 'collective'}: the medians over sampled steps' splits."""
  return {k: float(np.median([d.get(k, np.nan) for d in splits])) for k in ('compute', 'collective')}


def format_devices(entry: dict) -> str:
  """A `summary_table` entry's GPUs, one per column: median device compute
  and collective time over the sampled steps, the flagged one marked."""
  if not entry.get('devices'):
    return ''
  cells = [f'{g}{"*" if g == entry.get("device_index") else ""} {v["compute"] * 1e3:.1f}/{v["collective"] * 1e3:.1f}'
           for g, v in entry['devices'].items()]
  return (f'process {entry["process"]} by device (median compute/collective ms over the sampled steps'
          f'{"; * the slow one" if "device_index" in entry else ""}): ' + ', '.join(cells))


def format_table(table: Sequence[dict], metric: str = STEP) -> str:
  """`summary_table` as aligned text, one line per process."""
  if not table:
    return '(no timing rows)'
  phase_names = list(table[0]['phases'])
  sampled = any('device' in e for e in table)
  head = ['process', 'host', 'steps', f'{metric} p50', 'p90', 'x others', 'late ms'] + \
         [f'{ph} p50' for ph in phase_names] + (['device compute', 'device collective'] if sampled else []) + \
         ['verdict']

  def ms(v):
    return '-' if v != v else f'{v * 1e3:.1f}'  # v != v: NaN, nothing to compare

  lines = []
  for e in table:
    reason = e.get('reason', '') + (f' {e["device_index"]}' if 'device_index' in e else '')
    verdict = e['verdict'] + (f' ({e["slowdown"]:+.0%}, {reason})' if 'slowdown' in e else '')
    lines.append([str(e['process']), e['host'], str(e['steps']), ms(e['median_s']), ms(e['p90_s']),
                  '-' if e['ratio'] != e['ratio'] else f'{e["ratio"]:.2f}', ms(e['lateness_s'])] +
                 [ms(e['phases'][ph]) for ph in phase_names] +
                 ([ms(e.get('device', {}).get(k, float('nan'))) for k in ('compute', 'collective')]
                  if sampled else []) + [verdict])
  widths = [max(len(h), *(len(l[k]) for l in lines)) for k, h in enumerate(head)]

  def fmt(cells):
    return '  '.join(c.ljust(w) if k in (1, len(cells) - 1) else c.rjust(w)
                     for k, (c, w) in enumerate(zip(cells, widths))).rstrip()

  return '\n'.join([fmt(head), fmt(['-' * w for w in widths])] + [fmt(l) for l in lines]) + \
      '\n(times in ms; "x others": median step time / the other processes\' median at the same step, ' \
      'where a straggler can read below 1: the others wait for it inside the step\'s collectives, so their ' \
      'steps take longer; "late ms": median lag of its end of step behind the others\', what a verdict ' \
      'rests on' + ('; "device": median over the sampled steps of its device\'s (its slowest one\'s) time in '
                    'compute kernels and in collectives, where a rank slowed inside the step computes longer and '
                    'the others wait)' if sampled else ')')
