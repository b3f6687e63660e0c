"""Pictures of the per-process step timings: a heat map (processes x steps,
as in MegaScale's Fig. 7) and a Chrome / Perfetto trace of every process's
phases on one time axis. Rows are those of `mjax.ft.stragglers.load_rows`.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Sequence

import numpy as np

from mjax.ft import stragglers as st

MAX_COLUMNS = 2000     # steps drawn as individual columns; more are binned
MAX_LABELLED = 48      # processes named one by one on the y axis
MAX_ROWS = 256         # more processes than this: one row per host (or band of hosts), its worst


def _row_phases(row: dict) -> list[tuple[str, float]]:
  phases = row['phases']
  order = [p for p in st.PHASE_ORDER if p in phases] + sorted(set(phases) - set(st.PHASE_ORDER))
  return [(p, float(phases[p])) for p in order]


def _device_events(row: dict, pid: int, start_s: float) -> list[dict]:
  """A sampled step's device time (mjax/ft/device_time.py) on its own track
  under the compute phase: compute kernels, then collectives. The sums, laid
  end to end: which ran when inside the step is in the trace, not the row.
  With several devices, each one's on a track of its own as well
  (tid 2 + its ordinal), where one slow GPU's longer compute shows."""
  out = []
  tracks = [(1, row['device'])] + [(2 + int(k), v) for k, v in sorted(
      (row['device'].get('devices') or {}).items(), key=lambda kv: int(kv[0]))]
  for tid, split in tracks:
    t = start_s
    for name in ('compute', 'collective'):
      seconds = float(split.get(name, 0.0))
      out.append({'ph': 'X', 'name': f'device {name}', 'cat': 'device', 'pid': pid, 'tid': tid,
                  'ts': round(t * 1e6, 3), 'dur': round(seconds * 1e6, 3), 'args': {'step': int(row['step'])}})
      t += seconds
  return out


def chrome_trace(rows: Sequence[dict]) -> dict:
  """A Chrome / Perfetto trace of all processes' phases.

  Each row only says when its step ended and how long each phase took, so
  its phases are laid end to end, in the order they run, finishing at the
  row's end time; untimed host work between phases is not shown.

  Args:
    rows: deduplicated timing rows of any number of processes.

  Returns:
    {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}:
    one track (pid) per training process, named "process N (host)", and one
    complete event ("ph": "X") per (process, step, phase) with the step in
    its args. Timestamps are microseconds since the earliest phase start of
    any process (`otherData.unix_time_origin`), so all tracks share one axis.
  """
  rows = st.dedupe_rows(rows)
  starts = [float(r['time']) - st.step_duration(r) for r in rows]
  origin = min(starts) if starts else 0.0
  events = []
  named = set()
  sampled = {int(r['process']) for r in rows if isinstance(r.get('device'), dict)}
  gpus = {}   # process -> the ordinals of its devices sampled one by one
  for r in rows:
    if isinstance(r.get('device'), dict) and r['device'].get('devices'):
      gpus.setdefault(int(r['process']), set()).update(int(k) for k in r['device']['devices'])
  for r, start in zip(rows, starts):
    p = int(r['process'])
    if p not in named:
      named.add(p)
      events.append({'ph': 'M', 'name': 'process_name', 'pid': p, 'tid': 0,
                     'args': {'name': f'process {p} ({r.get("host", "?")})'}})
      events.append({'ph': 'M', 'name': 'process_sort_index', 'pid': p, 'tid': 0, 'args': {'sort_index': p}})
      events.append({'ph': 'M', 'name': 'thread_name', 'pid': p, 'tid': 0, 'args': {'name': 'phases'}})
      if p in sampled:
        events.append({'ph': 'M', 'name': 'thread_name', 'pid': p, 'tid': 1,
                       'args': {'name': 'device time (sampled steps)' + (', slowest device' if p in gpus else '')}})
      for k in sorted(gpus.get(p, ())):
        events.append({'ph': 'M', 'name': 'thread_name', 'pid': p, 'tid': 2 + k,
                       'args': {'name': f'device {k} time (sampled steps)'}})
    t = start
    for name, seconds in _row_phases(r):
      events.append({'ph': 'X', 'name': name, 'cat': 'phase', 'pid': p, 'tid': 0,
                     'ts': round((t - origin) * 1e6, 3), 'dur': round(seconds * 1e6, 3),
                     'args': {'step': int(r['step'])}})
      if name == 'compute' and isinstance(r.get('device'), dict):
        events += _device_events(r, p, t - origin)
      t += seconds
  return {'traceEvents': events, 'displayTimeUnit': 'ms',
          'otherData': {'unix_time_origin': origin, 'source': 'mjax timings/process-*.jsonl'}}


def write_trace(rows: Sequence[dict], path: str) -> str:
  """Writes `chrome_trace(rows)` as JSON (open it at ui.perfetto.dev or
  chrome://tracing). Returns the path."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  text = json.dumps(chrome_trace(rows), separators=(',', ':'))  # dumps: json.dump to a file is ~4x slower
  with open(path, 'w') as fh:
    fh.write(text)
  return path


def _bin_columns(x: np.ndarray, steps: np.ndarray, max_columns: int) -> tuple[np.ndarray, np.ndarray, int]:
  """Median of consecutive groups of steps, so that long runs fit the page."""
  k = max(1, -(-x.shape[1] // max_columns))
  if k == 1:
    return x, steps, 1
  pad = (-x.shape[1]) % k
  xp = np.pad(x, ((0, 0), (0, pad)), constant_values=np.nan)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', RuntimeWarning)  # a bin without rows stays NaN (grey)
    binned = np.nanmedian(xp.reshape(x.shape[0], -1, k), axis=2)
  return binned, steps[::k], k


def _pool_rows(mats: Sequence[np.ndarray], processes: np.ndarray, hosts: dict, max_rows: int
               ) -> tuple[list[np.ndarray], list[str], list[list[int]]]:
  """Rows of many processes pooled so that none disappears between the
  pixels: one row per host, or per band of consecutive hosts where there are
  more than `max_rows`, each showing the worst (largest) of its processes
  at every step. Returns the pooled matrices, a label and the processes of
  each row."""
  groups: dict[str, list[int]] = {}
  for i, p in enumerate(processes.tolist()):
    # Rows that name no host ('?') are no one host: each its own, banded.
    groups.setdefault(hosts[p] if hosts[p] != '?' else f'process {p}', []).append(i)
  names = list(groups)
  per = max(1, -(-len(names) // max_rows))
  bands = [names[k:k + per] for k in range(0, len(names), per)]
  index = [[i for h in band for i in groups[h]] for band in bands]
  labels = [(band[0] if len(band) == 1 else f'{band[0]}..{band[-1]}') + f' ({len(ix)})'
            for band, ix in zip(bands, index)]
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', RuntimeWarning)   # a step no process of the band has: NaN (grey)
    pooled = [np.stack([np.nanmax(m[ix], axis=0) for ix in index]) for m in mats]
  return pooled, labels, [[int(processes[i]) for i in ix] for ix in index]


def plot_heatmap(rows: Sequence[dict], path: str, metric: str = st.STEP, run: str = '',
                 stragglers: Sequence[int] = ()) -> str:
  """Draws a processes x steps heat map of step (or phase) times as a PNG.

  Two panels share the step axis: the time of `metric`, and how late each
  process ended each step compared with the other processes (in a
  synchronous job the straggler's step time equals everybody's, but it is
  the one that finishes last). Colours are clipped to the 1st-99th
  percentiles so that a checkpoint step does not wash out the rest;
  missing rows are grey.

  Args:
    rows: deduplicated timing rows.
    path: where to write the PNG.
    metric: 'step' (sum of phases) or a phase name.
    run: the run's name (its workdir), shown in the title.
    stragglers: processes to mark in red on the y axis.

  Returns:
    The path written.
  """
  import matplotlib
  matplotlib.use('Agg')  # files only: no display on training hosts
  import matplotlib.pyplot as plt

  rows = st.dedupe_rows(rows)
  if not rows:
    raise ValueError('plot_heatmap: no timing rows to draw.')
  first, last = min(int(r['step']) for r in rows), max(int(r['step']) for r in rows)
  processes, steps, dur, _ = st.matrices(rows, metric, range(first, last + 1))
  late_ms = st.compare(rows, steps)['lateness_s'] * 1e3
  hosts = {int(r['process']): r.get('host', '?') for r in rows}
  dur_ms, xsteps, k = _bin_columns(dur * 1e3, steps, MAX_COLUMNS)
  late_ms, _, _ = _bin_columns(late_ms, steps, MAX_COLUMNS)
  labels = [f'{p} ({hosts[p]})' for p in processes.tolist()]
  members = [[p] for p in processes.tolist()]
  pooled = len(processes) > MAX_ROWS
  if pooled:
    # At thousands of processes nearest-pixel sampling shows one row in
    # tens: a slow host vanished. Each row shows its host's worst process.
    (dur_ms, late_ms), labels, members = _pool_rows([dur_ms, late_ms], processes, hosts, MAX_ROWS)

  n_proc = len(labels)
  # One process has no others to be late against: the second panel would be empty.
  n_panels = 2 if n_proc > 1 else 1
  height = 1.6 + n_panels * min(6.0, max(1.2, 0.22 * n_proc))
  fig, axes = plt.subplots(n_panels, 1, figsize=(11, height), sharex=True, constrained_layout=True, squeeze=False)
  axes = axes[:, 0]
  x0, x1 = float(xsteps[0]) - 0.5 * k, float(xsteps[-1]) + 0.5 * k
  extent = (x0, x1, n_proc - 0.5, -0.5)
  label = 'step time' if metric == st.STEP else f'{metric} phase'
  panels = [
      (axes[0], dur_ms, 'viridis', None, f'{label} (ms)'),
      (axes[-1], late_ms, 'RdBu_r', 'centered', 'late by (ms)'),
  ][:n_panels]
  for ax, data, cmap, mode, cbar_label in panels:
    # The colour range follows the bulk of the steps (5th-95th percentile,
    # the warm-up steps left out) so that the first steps and checkpoints do
    # not flatten everything else; the colour bar's arrows mark the clipping.
    bulk = data[:, min(2, data.shape[1] - 1):]
    finite = bulk[np.isfinite(bulk)]
    lo, hi = (np.percentile(finite, [5, 95]) if finite.size else (0.0, 1.0))
    if mode == 'centered':
      hi = max(abs(lo), abs(hi), 1e-3)
      lo = -hi
    elif hi <= lo:
      hi = lo + 1e-3
    cm = plt.get_cmap(cmap).with_extremes(bad='#d0d0d0')  # missing rows in grey
    im = ax.imshow(np.ma.masked_invalid(data), aspect='auto', interpolation='nearest', cmap=cm,
                   vmin=lo, vmax=hi, extent=extent)
    fig.colorbar(im, ax=ax, pad=0.01, extend='both').set_label(cbar_label)
    ax.set_ylabel('host (its worst process)' if pooled else 'process')
    marked_rows = {i for i, ps in enumerate(members) if set(ps) & set(stragglers)}
    if n_proc <= MAX_LABELLED:
      ax.set_yticks(range(n_proc))
      ax.set_yticklabels(labels, fontsize=8)
      for tick, i in zip(ax.get_yticklabels(), range(n_proc)):
        if i in marked_rows:
          tick.set_color('red')
          tick.set_fontweight('bold')
    else:
      # Too many to name: a few evenly spaced, plus every straggler (in red).
      ticks = sorted(set(np.linspace(0, n_proc - 1, 9).round().astype(int).tolist()) | marked_rows)
      ax.set_yticks(ticks)
      ax.set_yticklabels([labels[t] if pooled else str(members[t][0]) for t in ticks], fontsize=8)
      for tick, t in zip(ax.get_yticklabels(), ticks):
        if t in marked_rows:
          tick.set_color('red')
          tick.set_fontweight('bold')
  axes[-1].set_xlabel('step' + (f' (median of every {k} steps)' if k > 1 else ''))
  axes[0].set_title(f'{label} per process', fontsize=10, loc='left')
  if n_panels > 1:
    axes[-1].set_title('end of step compared with the other processes (red: later; '
                       'in a synchronous job the straggler is the one that ends last)', fontsize=10, loc='left')
  marked = f'; stragglers in red: {", ".join(map(str, stragglers))}' if stragglers else ''
  count = f'{len(processes):,} processes on {n_proc} rows (hosts)' if pooled else f'{n_proc} process(es)'
  fig.suptitle(f'{run + ": " if run else ""}{count}, steps {first}-{last}{marked}', fontsize=11)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
