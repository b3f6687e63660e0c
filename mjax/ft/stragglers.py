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
import glob
import json
import math
import os
import re
import warnings
from typing import Iterable, Optional, Sequence

import numpy as np

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


def load_rows(workdir: str, tail_bytes: Optional[int] = None) -> list[dict]:
  """All timing rows of a run directory, deduplicated.

  Args:
    workdir: the run's directory (the one holding `timings/`).
    tail_bytes: read only the last this many bytes of each process's file:
      enough for the latest steps, which is all a poller such as the
      driver needs (a row is ~150 bytes; 64 KiB holds ~400 steps), at a
      cost that does not grow with the run's length. None: whole files.

  Returns:
    Rows sorted by (process, step), one per (process, step): the last one
    written, since a resumed run appends again the steps it redoes. What
    a crash cut short is skipped.

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
    with open(path, 'rb') as fh:
      if tail_bytes is not None:
        size = fh.seek(0, os.SEEK_END)
        fh.seek(max(0, size - tail_bytes))
        if size > tail_bytes:
          fh.readline()  # most likely the end of a row cut in two by the seek
      for line in fh:
        row = _parse_row(line.decode('utf-8', errors='replace'))
        if row is not None:
          rows.append(row)
  return dedupe_rows(rows)


class TimingTail:
  """Incremental reader of a run's timing files, for a poller (the driver).

  Each `update` reads only what the files gained since the previous one and
  keeps the last `keep` rows of every process, so a check costs what the
  processes wrote in between, not the run's length (at 1,536 processes,
  re-reading whole files took 17 s a check). Started `from_end`, it sees
  only rows written from now on: one attempt's, not an earlier one's.
  """

  def __init__(self, workdir: str, keep: int, from_end: bool = True):
    self.directory = timings_dir(workdir)
    self.keep = keep
    self._offsets: dict[str, int] = {}
    self._partial: dict[str, bytes] = {}
    self._rows: dict[str, collections.deque] = {}
    # Sampled rows come every FaultConfig.device_timing_every steps, far
    # apart: the last few are kept apart from the latest rows.
    self._sampled: dict[str, collections.deque] = {}
    if from_end:
      for path in self._paths():
        self._offsets[path] = os.path.getsize(path)

  def _paths(self) -> list[str]:
    return [p for p in glob.glob(os.path.join(self.directory, 'process-*.jsonl')) if os.path.isfile(p)]

  def update(self) -> list[dict]:
    """The kept rows of every process, after reading what was appended."""
    for path in self._paths():
      offset = self._offsets.get(path, 0)
      try:
        size = os.path.getsize(path)
      except OSError:    # gone since the listing
        continue
      if size < offset:            # replaced or truncated: start it again
        offset, self._partial[path] = 0, b''
      if size == offset:
        continue
      with open(path, 'rb') as fh:
        fh.seek(offset)
        data = fh.read(size - offset)
      self._offsets[path] = offset + len(data)
      lines = (self._partial.pop(path, b'') + data).split(b'\n')
      self._partial[path] = lines.pop()   # a row still being written
      kept = self._rows.setdefault(path, collections.deque(maxlen=self.keep))
      sampled = self._sampled.setdefault(path, collections.deque(maxlen=2 * DEVICE_SAMPLES))
      for line in lines:
        row = _parse_row(line.decode('utf-8', errors='replace'))
        if row is not None:
          kept.append(row)
          if 'device' in row:
            sampled.append(row)
    recent = [r for kept in self._rows.values() for r in kept]
    return [r for rows in self._sampled.values() for r in rows] + recent


def _parse_row(line: str) -> Optional[dict]:
  """One timing row, or None for a line that holds none.

  A process killed mid-write leaves half a line without its newline; the
  next run's first row is then appended to it. That row is recovered from
  the end of the line.
  """
  for start in (0, line.rfind('{"step"')):
    if start < 0:
      break
    try:
      row = json.loads(line[start:])
    except ValueError:
      continue
    if _valid_row(row):
      if 'device' in row and not _valid_sample(row['device']):
        del row['device']   # a damaged sample costs the sample, not the row
      return row
  return None


def _number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _count(x, below: int) -> bool:
  return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < below


def _valid_row(row) -> bool:
  """Whether a parsed line has the shape PhaseTimer writes: anything else
  (a damaged or foreign line) would stop the report, or the driver's watch."""
  return (isinstance(row, dict) and _count(row.get('step'), 2**53) and _count(row.get('process'), 2**31)
          and _number(row.get('time')) and isinstance(row.get('host', ''), str)
          and isinstance(row.get('phases'), dict)
          and all(isinstance(k, str) and _number(v) and v >= 0 for k, v in row['phases'].items()))


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
  return [p for p in PHASE_ORDER if p in seen] + sorted(seen - set(PHASE_ORDER))


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
  processes = np.array(sorted({int(r['process']) for r in rows}), dtype=np.int64)
  if steps is None:
    steps = sorted({int(r['step']) for r in rows})
  steps = np.asarray(steps, dtype=np.int64)
  pi = {p: i for i, p in enumerate(processes.tolist())}
  si = {s: i for i, s in enumerate(steps.tolist())}
  names = phases_of(rows)
  shape = (len(processes), len(steps))
  end = np.full(shape, np.nan)
  seconds = {name: np.full(shape, np.nan) for name in (STEP, *names)}
  present = np.zeros(shape, bool)
  for r in rows:
    j = si.get(int(r['step']))
    if j is None:
      continue
    i = pi[int(r['process'])]
    present[i, j] = True
    end[i, j] = float(r['time'])
    phases = r['phases']
    seconds[STEP][i, j] = float(sum(phases.values()))
    for name, v in phases.items():
      seconds[name][i, j] = float(v)
  for name in names:
    seconds[name][present & np.isnan(seconds[name])] = 0.0
  return {'processes': processes, 'steps': steps, 'end': end, 'seconds': seconds}


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
  order = np.argsort(x, axis=0, kind='stable')           # NaNs sort last
  s = np.take_along_axis(x, order, axis=0)
  rank = np.empty_like(order)
  np.put_along_axis(rank, order, np.broadcast_to(np.arange(P)[:, None], (P, S)), axis=0)
  m = np.sum(~np.isnan(x), axis=0) - 1                    # values left per column

  def kth_remaining(k):
    # The k-th smallest of the remaining values is at sorted index k, or k + 1
    # when the removed entry sits at or before k.
    k = np.broadcast_to(np.maximum(k, 0), (P, S))
    idx = np.clip(np.where(k < rank, k, k + 1), 0, P - 1)
    return np.take_along_axis(s, idx, axis=0)

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
  g = grid(rows, steps)
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


def _consistently_slow(slow: np.ndarray, margin: float, consistency: float,
                       least: int) -> Optional[tuple[float, float]]:
  """(median slowdown, share of its judged steps slower than margin / 2) of
  one process over a window, when it is a straggler: at least `least`
  judged steps, a median above `margin`, and that share at least
  `consistency`. None otherwise."""
  valid = ~np.isnan(slow)
  if valid.sum() < max(1, least):
    return None   # too few of its rows in the window to judge it
  med, share = float(np.median(slow[valid])), float(np.mean(slow[valid] > margin / 2))
  return (med, share) if med > margin and share >= consistency else None


def device_stragglers(rows: Sequence[dict], margin: float = 0.2, consistency: float = 0.8,
                      samples: int = DEVICE_SAMPLES) -> list[Straggler]:
  """Processes the others waited for inside the step in the latest `samples`
  sampled steps (see `device_compare`): median slowdown above `margin`,
  above margin / 2 in at least `consistency` of them (all, for three)."""
  if margin <= 0 or samples < 1 or not 0 < consistency <= 1:
    raise ValueError(f'device_stragglers: margin {margin!r} must be > 0, samples {samples!r} >= 1 and '
                     f'consistency {consistency!r} in (0, 1].')
  sig = device_compare(dedupe_rows(rows), samples)
  if sig is None:
    return []
  hosts = {int(r['process']): r.get('host', '?') for r in rows}
  procs, devs = sig['processes'].tolist(), sig['devices'].tolist()
  verdicts = [_consistently_slow(sig['slowdown'][i], margin, consistency, (samples + 1) // 2)
              for i in range(len(procs))]
  found: dict[int, Straggler] = {}
  for i, (p, dev, verdict) in enumerate(zip(procs, devs, verdicts)):
    if verdict is None or (p in found and verdict[0] <= found[p].slowdown):
      continue   # a process once, by its slowest device
    # A device is named where it stands out from its process's other
    # devices; where most of them are slow too (a host that stalled, a
    # node-wide throttle), the process is.
    siblings = [verdicts[k] is not None for k in range(len(procs)) if procs[k] == p and k != i]
    whole = dev < 0 or (bool(siblings) and sum(siblings) >= len(siblings) / 2)
    med, share = verdict
    found[p] = Straggler(process=p, host=hosts.get(p, '?'), slowdown=med, reason=DEVICE,
                         ratio=float(_nanmedian(sig['ratio'][i])), lateness=0.0, lateness_s=0.0,
                         slow_share=share, first_step=int(sig['steps'][0]),
                         last_step=int(sig['steps'][-1]), device=None if whole else dev)
  return sorted(found.values(), key=lambda s: -s.slowdown)


def find_stragglers(rows: Sequence[dict], margin: float = 0.2, window: int = 20,
                    consistency: float = 0.8) -> list[Straggler]:
  """Processes consistently slower than the others over the last steps.

  Args:
    rows: timing rows of any number of processes (duplicates allowed: the
      last row of a (process, step) wins).
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
  rows = dedupe_rows(rows)
  found = {}
  for s in _host_stragglers(rows, margin, window, consistency) + device_stragglers(rows, margin, consistency):
    if s.process not in found or s.slowdown > found[s.process].slowdown:
      found[s.process] = s
  return sorted(found.values(), key=lambda s: -s.slowdown)


def _host_stragglers(rows: Sequence[dict], margin: float, window: int, consistency: float) -> list[Straggler]:
  n_proc = len({r['process'] for r in rows})
  if n_proc < 2:
    return []
  steps = _latest_steps(rows, window, max(2, (n_proc + 1) // 2))
  if len(steps) < window:
    return []
  recent = [r for r in rows if int(r['step']) >= steps[0]]
  sig = compare(recent, steps)
  hosts = {int(r['process']): r.get('host', '?') for r in recent}
  found = []
  for i, p in enumerate(sig['processes'].tolist()):
    verdict = _consistently_slow(sig['slowdown'][i], margin, consistency, window // 2)
    if verdict is not None:
      med, share = verdict
      by_signal = {k: float(_nanmedian(v[i])) for k, v in sig['signals'].items()}
      found.append(Straggler(
          process=p, host=hosts.get(p, '?'), slowdown=med,
          reason=max(by_signal, key=lambda k: -np.inf if np.isnan(by_signal[k]) else by_signal[k]),
          ratio=float(_nanmedian(sig['ratio'][i])), lateness=by_signal['late'],
          lateness_s=float(_nanmedian(sig['lateness_s'][i])), slow_share=share,
          first_step=int(sig['steps'][0]), last_step=int(sig['steps'][-1])))
  return found


def job_pace(rows: Sequence[dict], window: int = 20) -> Optional[float]:
  """The job's step time: per step the median over processes, then the
  median over the latest `window` steps that at least half the processes
  reported; None before there are that many.

  What find_stragglers cannot see, this can: a process slowed inside the
  step's work (a throttled accelerator, a host stopped while its device
  part of a collective is due) holds every process in that collective, so
  no process ends late or works longer than the others, but the whole job's
  steps get longer. Compared with the same job's pace earlier in the attempt
  (`_StragglerWatch`), it shows as a slowdown of the job."""
  rows = dedupe_rows(rows)
  n_proc = len({r['process'] for r in rows})
  if not n_proc or window < 1:
    return None
  steps = _latest_steps(rows, window, (n_proc + 1) // 2)
  if len(steps) < window:
    return None
  by_step: dict[int, list[float]] = collections.defaultdict(list)
  for r in rows:
    by_step[int(r['step'])].append(step_duration(r))
  return float(np.median([np.median(by_step[s]) for s in steps]))


# ----------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------

def summary_table(rows: Sequence[dict], margin: float = 0.2, window: int = 20,
                  metric: str = STEP) -> list[dict]:
  """Per-process summary of a run's timings, with a straggler verdict.

  Args:
    rows: timing rows (deduplicated here).
    margin, window: as for `find_stragglers`, which gives the verdict.
    metric: 'step' (sum of phases) or a phase name: what median_s and p90_s
      describe.

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
  sig = compare(rows)
  processes, steps = sig['processes'], sig['steps']
  seconds = grid(rows)['seconds']
  values = seconds.get(metric, seconds[STEP] * 0)
  phase_vals = {ph: v for ph, v in seconds.items() if ph != STEP}
  hosts = {int(r['process']): r.get('host', '?') for r in rows}
  flagged = {s.process: s for s in find_stragglers(rows, margin, window)}
  judged = (len(processes) >= 2 and len(steps) >= window) or device_compare(rows) is not None
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
