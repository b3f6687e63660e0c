"""MFU accounting and metric writers (metrics.jsonl + TensorBoard)."""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Dense (no sparsity) peak TFLOP/s per device, from the vendors' data sheets:
# (bf16/fp16 tensor core, fp32 as XLA runs it: TF32 tensor cores on NVIDIA
# Ampere and later, bf16 passes on TPU). Longest names first: 'H100 PCIe'
# must match before 'H100'.
PEAK_TFLOPS = {
    'GB200': (2500.0, 1250.0),
    'B200': (2250.0, 1100.0),
    'H200': (989.4, 494.7),
    'H100 PCIe': (756.0, 378.0),
    'H100': (989.4, 494.7),          # SXM
    'H800': (989.4, 494.7),
    'H20': (148.0, 74.0),
    'A100': (312.0, 156.0),
    'A800': (312.0, 156.0),
    'L40S': (362.1, 183.0),
    'L4': (121.0, 60.0),
    'A10G': (70.0, 35.0),
    'A10': (125.0, 62.5),
    'V100': (125.0, 15.7),
    'TPU v6': (918.0, 918.0),
    'TPU v5p': (459.0, 459.0),
    'TPU v5 lite': (197.0, 197.0),
    'TPU v5e': (197.0, 197.0),
    'TPU v4': (275.0, 275.0),
}


def lookup_peak(device_kind: str, dtype: str) -> Optional[float]:
  """Per-device peak FLOP/s from the table, or None for an unknown device."""
  for name in sorted(PEAK_TFLOPS, key=len, reverse=True):
    if name.lower() in device_kind.lower():
      bf16, fp32 = PEAK_TFLOPS[name]
      return (fp32 if dtype == 'float32' else bf16) * 1e12
  return None


def _cpu_model() -> str:
  try:
    with open('/proc/cpuinfo') as fh:
      for line in fh:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def measure_matmul_flops(dtype: str, n: int = 1024, seconds: float = 1.0) -> float:
  """Best sustained FLOP/s of an n x n matrix product on the first device.

  On CPU every fake device shares the same cores and XLA's thread pool, so
  one device's product already measures the whole machine.
  """
  dt = jnp.dtype(dtype)
  a = jnp.ones((n, n), dt)
  f = jax.jit(lambda x, y: (x @ y).astype(dt))
  f(a, a).block_until_ready()
  best = float('inf')
  deadline = time.perf_counter() + seconds
  while time.perf_counter() < deadline:
    t = time.perf_counter()
    f(a, a).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return 2 * n ** 3 / best


def peak_flops(devices: Sequence[jax.Device], dtype: str, cache_dir: str) -> tuple[float, str]:
  """Peak FLOP/s of `devices` together, and where the figure comes from.

  Known accelerators use the data-sheet table; anything else (CPU) runs a
  short matrix-product benchmark, cached per machine under `cache_dir`.
  """
  kind = devices[0].device_kind
  per_device = lookup_peak(kind, dtype)
  if per_device is not None:
    return per_device * len(devices), f'table: {len(devices)} x {kind} {dtype} {per_device / 1e12:.1f} TFLOP/s'
  cache_dir = os.path.expanduser(cache_dir)
  path = os.path.join(cache_dir, 'peak_flops.json')
  key = f'{devices[0].platform}|{_cpu_model()}|{os.cpu_count()}|{dtype}|jax {jax.__version__}'
  cache = {}
  try:
    with open(path) as fh:
      cache = json.load(fh)
  except (OSError, ValueError):
    pass
  if key not in cache:
    cache[key] = measure_matmul_flops(dtype)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f'{path}.{os.getpid()}.tmp'
    with open(tmp, 'w') as fh:
      json.dump(cache, fh, indent=1)
    os.replace(tmp, path)  # atomic: concurrent runs never see half a file
    source = 'measured'
  else:
    source = 'measured, cached'
  # CPU fake devices share one machine: its peak is the peak of all of them.
  return cache[key], f'{source}: {dtype} matmul on {_cpu_model()} ({os.cpu_count()} cores), {path}'


def peak_memory_bytes(devices: Sequence[jax.Device]) -> tuple[Optional[int], str]:
  """Largest per-device peak allocation, or the process's max RSS on CPU."""
  peaks = []
  for d in devices:
    try:
      stats = d.memory_stats()
    except Exception:  # some backends do not implement it
      stats = None
    if stats and 'peak_bytes_in_use' in stats:
      peaks.append(stats['peak_bytes_in_use'])
  if peaks:
    return max(peaks), 'device peak'
  import resource
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 'host max RSS'


# Key of the marker row a resumed (or restarted) run appends: rows written
# before it for steps past its value are superseded.
SUPERSEDES = 'supersedes_after_step'


def read_metrics(workdir: str) -> list[dict]:
  """The rows of `<workdir>/metrics.jsonl` as one uninterrupted run: rows a
  later start superseded are left out, as are the markers and any line a
  crash cut short."""
  rows: list[dict] = []
  with open(os.path.join(workdir, 'metrics.jsonl')) as fh:
    for line in fh:
      try:
        row = json.loads(line)
      except ValueError:
        continue
      if not isinstance(row, dict):
        continue
      if SUPERSEDES in row:
        rows = [r for r in rows if r.get('step', 0) <= row[SUPERSEDES]]
      else:
        rows.append(row)
  return rows


class MetricsWriter:
  """Appends one JSON line per record to metrics.jsonl and mirrors the
  scalars to TensorBoard event files. Only process 0 writes."""

  def __init__(self, workdir: str, enabled: bool = True, resume_step: int = 0):
    self.enabled = enabled
    self._jsonl = None
    self._tb = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, 'metrics.jsonl')
    # Append only: nothing an earlier run wrote is ever deleted. A run that
    # starts at `resume_step` (0: from scratch) over an existing file first
    # writes a marker that supersedes the earlier rows past that step, so
    # `read_metrics` reads the file as one uninterrupted run.
    self._jsonl = open(path, 'a', buffering=1)
    if self._jsonl.tell():
      with open(path, 'rb') as fh:   # a line a crash cut short must not swallow the marker
        fh.seek(-1, os.SEEK_END)
        if fh.read(1) != b'\n':
          self._jsonl.write('\n')
      self._jsonl.write(json.dumps({'step': int(resume_step), SUPERSEDES: int(resume_step),
                                    'time': time.time()}) + '\n')
    from tensorboardX import SummaryWriter
    self._tb = SummaryWriter(os.path.join(workdir, 'tensorboard'))

  def write(self, step: int, scalars: dict, prefix: str = '') -> None:
    if not self.enabled:
      return
    record = {'step': int(step), **{prefix + k: _py(v) for k, v in scalars.items()}}
    self._jsonl.write(json.dumps(record) + '\n')
    for k, v in scalars.items():
      if isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool):
        self._tb.add_scalar(prefix + k, float(v), int(step))

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._tb.close()


def _py(v):
  if isinstance(v, (np.floating, np.integer)):
    return v.item()
  if isinstance(v, np.ndarray) and v.ndim == 0:
    return v.item()
  return v


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
  Rows are appended every `every` steps to
  `<workdir>/timings/process-<index>.jsonl`, one JSON object per step:
  {"step", "process", "host", "time" (unix, end of step), "phases": {...}}.
  `current` and `step` are what a heartbeat reports.
  """

  def __init__(self, workdir: str, process_index: int, every: int = 10):
    import collections
    import socket
    self.process = process_index
    self.host = socket.gethostname()
    self.every = every
    self.current = 'startup'
    self.step = 0
    self._acc = collections.defaultdict(float)
    self._rows: list[dict] = []
    directory = os.path.join(workdir, 'timings')
    os.makedirs(directory, exist_ok=True)
    self._fh = open(os.path.join(directory, f'process-{process_index:05d}.jsonl'), 'a', buffering=1)

  def phase(self, name: str):
    """Context manager timing one phase of the current step."""
    import contextlib

    @contextlib.contextmanager
    def timed():
      prev, self.current = self.current, name
      t0 = time.perf_counter()
      try:
        yield
      finally:
        self._acc[name] += time.perf_counter() - t0
        self.current = prev
    return timed()

  def end_step(self, step: int) -> None:
    self.step = step
    self._rows.append({'step': int(step), 'process': self.process, 'host': self.host,
                       'time': time.time(), 'phases': {k: round(v, 6) for k, v in self._acc.items()}})
    self._acc.clear()
    if len(self._rows) >= self.every:
      self.flush()

  def flush(self) -> None:
    self._fh.writelines(json.dumps(r) + '\n' for r in self._rows)
    self._rows.clear()

  def close(self) -> None:
    self.flush()
    self._fh.close()
