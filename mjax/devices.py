"""Facts about this machine's devices: data-sheet peaks and link bandwidths,
the measured peak and its cache, memory statistics, whether the backend has
started.

Imports neither JAX nor NumPy at load time (only inside the functions that
run something on a device), so that the health checks (mjax/ft/diagnose.py),
the XLA flag setup and the job start-up can import it at any point: a helper
imported from the metrics module inside the memory check once left the next
all-reduce check stuck in XLA's rendezvous.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence, TypeVar

from mjax import jsonfile

if TYPE_CHECKING:
  import jax

V = TypeVar('V')

# Dense (no sparsity) peak TFLOP/s per device, from the vendors' data sheets:
# (bf16/fp16 tensor core, fp32 as XLA runs it: TF32 tensor cores on NVIDIA
# Ampere and later, bf16 passes on TPU). Looked up longest name first
# (`lookup_by_kind`): 'H100 PCIe' matches before 'H100'.
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

# NVLink bandwidth per GPU and direction, GB/s, from NVIDIA's data sheets
# (half the bidirectional figure they quote). PCIe-only cards (L4, L40S, A10,
# H100 PCIe without bridges) have no figure: their collectives are reported
# without a verdict. 'H100 PCIe' is listed, as None, so that it does not
# match 'H100'.
NVLINK_GBPS = {
    'GB200': 900.0,
    'B200': 900.0,
    'H200': 450.0,
    'H100 PCIe': None,
    'H100': 450.0,     # SXM, NVLink 4
    'H800': 200.0,
    'H20': 450.0,
    'A100': 300.0,     # SXM, NVLink 3
    'A800': 200.0,
    'V100': 150.0,
}


def lookup_by_kind(table: dict[str, V], device_kind: str) -> Optional[V]:
  """The value of the longest key of `table` contained in `device_kind`
  (case-insensitive), or None. Longest first, since one name can contain
  another ('H100 PCIe' and 'H100')."""
  kind = device_kind.lower()
  for name in sorted(table, key=len, reverse=True):
    if name.lower() in kind:
      return table[name]
  return None


def lookup_peak(device_kind: str, dtype: str) -> Optional[float]:
  """Per-device peak FLOP/s from the table, or None for an unknown device."""
  peaks = lookup_by_kind(PEAK_TFLOPS, device_kind)
  if peaks is None:
    return None
  bf16, fp32 = peaks
  return (fp32 if dtype == 'float32' else bf16) * 1e12


def link_bandwidth(device_kind: str) -> Optional[float]:
  """NVLink GB/s per direction of one device, or None where none is known."""
  return lookup_by_kind(NVLINK_GBPS, device_kind)


def cpu_model() -> str:
  """The host CPU's model name."""
  try:
    with open('/proc/cpuinfo') as fh:
      for line in fh:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def peak_cache_key(platform: str, dtype: str) -> str:
  """Key of a measured peak in `<cache_dir>/peak_flops.json`: one machine,
  one dtype, one JAX version."""
  import jax
  return f'{platform}|{cpu_model()}|{os.cpu_count()}|{dtype}|jax {jax.__version__}'


def memory_stats(device: Any) -> dict:
  """`device.memory_stats()`, or {} where the backend does not keep any."""
  try:
    return device.memory_stats() or {}
  except Exception:  # some backends do not implement it
    return {}


def start_backend() -> int:
  """Starts this process's JAX backend; the number of devices of the job.

  Raises:
    UserError: JAX_PLATFORMS names a platform this jax does not know.
    Fault: a known platform did not start (jax says "Unable to initialize
      backend", or, for a CUDA plugin without a GPU, fails an assertion with
      no message), or none did where none was asked for.
  """
  import jax
  try:
    return jax.device_count()
  except (RuntimeError, AssertionError) as e:
    from mjax.errors import Fault, UserError
    said = str(e).split(" (set JAX_PLATFORMS='' to")[0].strip().rstrip('.')
    asked = os.environ.get('JAX_PLATFORMS', '').strip()
    if not asked:
      raise Fault(f'the JAX backend could not start: {said or type(e).__name__}') from None
    advice = (f'JAX_PLATFORMS={asked!r}: ' + (said or 'no backend of that platform could start') +
              '. Name a platform this machine has (cpu; cuda needs a GPU, its driver and jax with its '
              'CUDA plugin, `pip install mjax[cuda12]`), or unset JAX_PLATFORMS to take the best one found')
    if 'is not in the list of known backends' in said:
      raise UserError(advice + '.') from None   # a name this jax does not know: bad input
    # A known platform that did not start: no GPU here, or a GPU node whose
    # device or driver failed. The latter is a fault the driver restarts
    # (elsewhere, with a spare), so it is not called bad input.
    raise Fault(advice + '; if this machine has one, its device or driver may have failed.') from None


def backend_started() -> bool:
  """Whether this process's JAX backend has started (it reads XLA_FLAGS then,
  once). Imports nothing: JAX not yet imported means not started."""
  xb = sys.modules.get('jax._src.xla_bridge')
  if xb is None:
    return False
  started = getattr(xb, 'backends_are_initialized', None)
  if started is not None:
    return bool(started())
  return bool(getattr(xb, '_backends', None))   # older JAX: no accessor


def _cpus() -> list[int]:
  """The CPUs this process may run on."""
  try:
    return sorted(os.sched_getaffinity(0))
  except (AttributeError, OSError):   # not Linux
    return list(range(os.cpu_count() or 1))


def _cpu_quota() -> Optional[float]:
  """The CPUs a container's cgroup (v2) quota allows, or None without one."""
  try:
    with open('/sys/fs/cgroup/cpu.max') as fh:
      quota, period = fh.read().split()[:2]
    return None if quota == 'max' else int(quota) / int(period)
  except (OSError, ValueError):
    return None


def _busy_cpu_seconds(cpus: Sequence[int]) -> Optional[float]:
  """CPU seconds spent so far by anything on `cpus` (Linux /proc/stat), or
  None where the OS does not say."""
  try:
    with open('/proc/stat') as fh:
      lines = fh.read().splitlines()
    hz = os.sysconf('SC_CLK_TCK')
  except (OSError, ValueError, AttributeError):
    return None
  wanted = {f'cpu{i}' for i in cpus}
  total = 0
  for line in lines:
    name, *fields = line.split()
    if name in wanted:
      # user nice system idle iowait irq softirq steal: all but idle and
      # iowait is time the CPU was not ours to take (steal: the hypervisor's).
      f = [int(x) for x in fields[:8]] + [0] * (8 - len(fields[:8]))
      total += f[0] + f[1] + f[2] + f[5] + f[6] + f[7]
  return total / hz


def measure_matmul(dtype: str, n: int = 1024, seconds: float = 1.0) -> tuple[float, bool]:
  """Best sustained FLOP/s of an n x n matrix product on the first device,
  and whether other work shared the CPUs while it was measured (CPU
  devices only: an accelerator's speed is not its host's).

  On CPU every fake device shares the same cores and XLA's thread pool, so
  one device's product already measures the whole machine. Other processes
  on those cores (a build, a second test worker) would make the clock's
  figure a fraction of the machine's: then the product's own CPU time per
  call, times the CPUs it may use, estimates it instead, and the caller
  keeps the figure for this run only.
  """
  import jax
  import jax.numpy as jnp
  dt = jnp.dtype(dtype)
  a = jnp.ones((n, n), dt)
  f = jax.jit(lambda x, y: (x @ y).astype(dt))
  f(a, a).block_until_ready()
  on_cpu = jax.devices()[0].platform == 'cpu'
  cpus = _cpus()
  best_wall = best_cpu = float('inf')
  busy0 = _busy_cpu_seconds(cpus) if on_cpu else None
  cpu0, wall0 = time.process_time(), time.perf_counter()
  deadline = wall0 + seconds
  while time.perf_counter() < deadline:
    t, c = time.perf_counter(), time.process_time()
    f(a, a).block_until_ready()
    best_wall = min(best_wall, time.perf_counter() - t)
    best_cpu = min(best_cpu, time.process_time() - c)
  busy1 = _busy_cpu_seconds(cpus) if on_cpu else None
  cpu1, wall1 = time.process_time(), time.perf_counter()
  flops = 2 * n ** 3 / best_wall
  if busy0 is None or busy1 is None:
    return flops, False
  # CPU time others took on our CPUs; a fifth of one CPU on average is more
  # than background noise (the kernel, an idle test runner) ever takes.
  others = (busy1 - busy0) - (cpu1 - cpu0)
  shared = others > 0.2 * (wall1 - wall0)
  if shared and best_cpu > 0:
    quota = _cpu_quota()
    usable = min(len(cpus), quota) if quota else len(cpus)
    flops = max(flops, 2 * n ** 3 / best_cpu * usable)
  return flops, shared


def measure_matmul_flops(dtype: str, n: int = 1024, seconds: float = 1.0) -> float:
  """Best sustained FLOP/s of an n x n matrix product (`measure_matmul`)."""
  return measure_matmul(dtype, n, seconds)[0]


def peak_flops(devices: Sequence[jax.Device], dtype: str, cache_dir: str) -> tuple[float, str]:
  """Peak FLOP/s of `devices` together, and where the figure comes from.

  Known accelerators use the data-sheet table; anything else (CPU) runs a
  short matrix-product benchmark, cached per machine under `cache_dir`.
  """
  kind = devices[0].device_kind
  per_device = lookup_peak(kind, dtype)
  if per_device is not None:
    return per_device * len(devices), f'table: {len(devices)} x {kind} {dtype} {per_device / 1e12:.1f} TFLOP/s'
  path, cache = _peak_cache(cache_dir)
  key = peak_cache_key(devices[0].platform, dtype)
  if key in cache:
    peak, source = cache[key], 'measured, cached'
  else:
    peak, shared = measure_matmul(dtype)
    if shared:
      # A figure taken while other work held the cores is an estimate; kept,
      # it would set every later run's MFU against it (above 100% once the
      # machine is quiet), so the next run measures again.
      source = 'estimated from CPU time while other work held the cores, not cached'
    else:
      cache[key], source = peak, 'measured'
      try:
        jsonfile.write_atomic(path, cache, indent=1)   # concurrent runs never see half a file
      except OSError as e:   # a read-only HOME, a file where the directory should be: measured, not kept
        source = f'measured, not cached ({type(e).__name__}: {e.strerror or e})'
  # CPU fake devices share one machine: its peak is the peak of all of them.
  return peak, f'{source}: {dtype} matmul on {cpu_model()} ({os.cpu_count()} cores), {path}'


def _peak_cache(cache_dir: str) -> tuple[str, dict]:
  """The peak cache's path and what it holds ({} where it is missing or not
  a JSON object)."""
  path = os.path.join(os.path.expanduser(cache_dir), 'peak_flops.json')
  try:
    with open(path) as fh:
      cache = jsonfile.load(fh)
  except (OSError, ValueError):
    cache = {}
  return path, cache if isinstance(cache, dict) else {}


def drop_cached_peak(platform: str, dtype: str, cache_dir: str) -> bool:
  """Forgets this machine's cached peak for `dtype` (a run went faster than
  it, so it was measured on busy cores); whether there was one to forget."""
  path, cache = _peak_cache(cache_dir)
  if cache.pop(peak_cache_key(platform, dtype), None) is None:
    return False
  try:
    jsonfile.write_atomic(path, cache, indent=1)
  except OSError:   # not writable: nothing to do
    return False
  return True


def peak_memory_bytes(devices: Sequence[jax.Device]) -> tuple[Optional[int], str]:
  """Largest per-device peak allocation, or the process's max RSS on CPU."""
  peaks = [s['peak_bytes_in_use'] for s in map(memory_stats, devices) if 'peak_bytes_in_use' in s]
  if peaks:
    return max(peaks), 'device peak'
  import resource
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 'host max RSS'


def host_memory_bytes() -> Optional[int]:
  """This machine's physical memory, or None where the OS does not say."""
  try:
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  except (ValueError, OSError, AttributeError):
    return None


def available_memory_bytes() -> Optional[int]:
  """Memory this process may still allocate without the OOM killer: the
  kernel's MemAvailable, or less where a cgroup (v2) limit leaves less;
  the physical memory where the OS says nothing more, else None."""
  have = None
  try:
    with open('/proc/meminfo') as fh:
      for line in fh:
        if line.startswith('MemAvailable:'):
          have = int(line.split()[1]) * 1024
          break
  except (OSError, ValueError, IndexError):
    pass
  # The process's own cgroup (v2) and every one above it: under SLURM or
  # systemd without a cgroup namespace the job's limit is not the root's.
  groups = ['']
  try:
    with open('/proc/self/cgroup') as fh:
      for line in fh:
        if line.startswith('0::'):
          path = line[3:].strip().strip('/')
          parts = path.split('/') if path else []
          groups = ['/'.join(parts[:i]) for i in range(len(parts), -1, -1)]
  except OSError:
    pass
  for group in groups:
    base = os.path.join('/sys/fs/cgroup', group)
    try:
      with open(os.path.join(base, 'memory.max')) as fh:
        limit = fh.read().strip()
      with open(os.path.join(base, 'memory.current')) as fh:
        used = int(fh.read().strip())
      if limit != 'max':
        left = max(0, int(limit) - used)
        have = left if have is None else min(have, left)
    except (OSError, ValueError):
      continue
  return have if have is not None else host_memory_bytes()


def memory_per_device(devices: Sequence[jax.Device]) -> tuple[Optional[int], str]:
  """What one device can hold: the backend's limit (GPU), else this host's
  physical memory shared by its local devices (CPU); None when unknown."""
  limits = [s['bytes_limit'] for s in map(memory_stats, devices) if s.get('bytes_limit')]
  if limits:
    return min(limits), 'device memory'
  if devices and devices[0].platform != 'cpu':
    # An accelerator whose allocator reports no limit (e.g. the platform
    # allocator): its memory is unknown here, and the host's says nothing of it.
    return None, 'unknown'
  host = host_memory_bytes()
  if host is None:
    return None, 'unknown'
  import jax
  local = max(1, sum(1 for d in devices if d.process_index == jax.process_index()))
  return host // local, f'host memory / {local} local device(s)'
