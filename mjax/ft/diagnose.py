"""Short health checks of this host's accelerators (MegaScale §4.2).

Run before a job starts and after a fault, so that a host with a slow or
broken device, or a slow link between devices, is blocked before it costs
the job another restart:

  matmul      per device, the throughput of a large matrix product in each
              training dtype, against the data-sheet peak (`lookup_peak`)
              times `min_fraction`. On CPU the fake devices share one set of
              cores, so one measurement stands for all of them, compared
              with the machine's measured peak cached by mjax-train
              (~/.cache/mjax/peak_flops.json); without that cache there is
              nothing to compare with and the check passes with a note.
  memory      per device, allocate a buffer (a fraction of the device's
              allocator limit; a fixed size on CPU), write a pattern, read it
              back, free it.
  allreduce   bus bandwidth of a psum / all_gather over a 1-D mesh of all
  allgather   local devices (shard_map), with the nccl-tests conventions:
                all-reduce  busbw = S * 2(n - 1)/n / t, S = bytes per device
                all-gather  busbw = S * (n - 1)/n / t,  S = bytes gathered
              and the result checked. Expected: `min_fraction` of the
              devices' NVLink bandwidth (per direction, data sheet) where it
              is known; elsewhere (CPU, PCIe-only cards) the figure is
              reported and the check passes with a note.
  *_global    the same two collectives over every device of every process,
              when this process is part of a jax.distributed job. Every
              process of the job must run the diagnostics, with the same
              options; a process that cannot join them leaves the others
              waiting in the collective, so run it under a timeout.

Each check gives a value, the expected value and pass/fail; a device
passes when all of its own checks pass, the host when every check does.

Test-only fault injection: MJAX_DIAGNOSE_FAIL=matmul (or memory,
allreduce, allgather, allreduce_global, ...; several separated by commas)
runs the check as usual and then reports it failed, so that the driver's
"a failing diagnostic blocks the host" path can be exercised on healthy
machines. Production never sets it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from typing import Optional, Sequence

import numpy as np

# Device facts only from mjax.devices, which imports no JAX at load time:
# importing more inside a check once left the next all-reduce check stuck.
from mjax.devices import link_bandwidth, lookup_peak, memory_stats, peak_cache_key
from mjax.protocol import DIAGNOSE_FAIL_ENV

CHECKS = ('matmul', 'memory', 'allreduce', 'allgather')
MIB = 1 << 20
GIB = 1 << 30


@dataclasses.dataclass
class Check:
  """The outcome of one health check.

  Attributes:
    name: 'matmul_bfloat16', 'matmul_float32', 'memory', 'allreduce_local',
      'allgather_local', 'allreduce_global' or 'allgather_global'.
    devices: ids of the devices it measured (all of them for a collective).
    value: what was measured, in `unit` (None when it could not run).
    expected: the least acceptable value, in `unit` (None: no figure to
      compare with, the check passes on running correctly).
    unit: 'TFLOP/s', 'GiB' or 'GB/s'.
    passed: whether the device(s) are fit for training on this count.
    note: where the expected figure comes from, or what went wrong.
    seconds: how long the check took, compilation included.
  """
  name: str
  devices: list[int]
  value: Optional[float]
  expected: Optional[float]
  unit: str
  passed: bool
  note: str = ''
  seconds: float = 0.0


@dataclasses.dataclass
class Report:
  """All checks of one process (one host's devices, or its share of them).

  Attributes:
    host: host name.
    process: jax.process_index().
    process_count: processes in the job.
    platform: 'gpu', 'tpu' or 'cpu'.
    device_kind: e.g. 'NVIDIA H100 80GB HBM3'.
    devices: {device id: verdict of the checks that measured it alone}.
    checks: every check, in the order run.
  """
  host: str
  process: int
  process_count: int
  platform: str
  device_kind: str
  devices: dict[int, bool]
  checks: list[Check]

  @property
  def passed(self) -> bool:
    """The host's verdict: every check passed."""
    return all(c.passed for c in self.checks)

  @property
  def failed(self) -> list[Check]:
    return [c for c in self.checks if not c.passed]

  def to_json(self) -> dict:
    """{"host", "process", "passed", "checks": [...], ...}, JSON-ready."""
    return {'host': self.host, 'process': self.process, 'process_count': self.process_count,
            'passed': self.passed, 'platform': self.platform, 'device_kind': self.device_kind,
            'devices': [{'id': d, 'passed': ok} for d, ok in sorted(self.devices.items())],
            'checks': [dataclasses.asdict(c) for c in self.checks]}


# ----------------------------------------------------------------------------
# Test-only failure injection
# ----------------------------------------------------------------------------

def injected_failures(environ=None) -> set[str]:
  """Check names (or prefixes such as 'allreduce') that MJAX_DIAGNOSE_FAIL
  forces to fail. Test-only.

  Raises:
    ValueError: for a name that matches no check, so a typo in a test does
      not quietly test nothing.
  """
  spec = (os.environ if environ is None else environ).get(DIAGNOSE_FAIL_ENV, '')
  names = {n.strip() for n in spec.split(',') if n.strip()}
  known = set(CHECKS) | {'matmul_bfloat16', 'matmul_float32'} | {
      f'{c}_{scope}' for c in ('allreduce', 'allgather') for scope in ('local', 'global')}
  bad = sorted(names - known)
  if bad:
    raise ValueError(f'{DIAGNOSE_FAIL_ENV}={spec!r}: unknown check(s) {", ".join(bad)}; '
                     f'known: {", ".join(sorted(known))} (comma-separated).')
  return names


def _apply_injection(check: Check, forced: set[str]) -> Check:
  if any(check.name == f or check.name.startswith(f + '_') for f in forced):
    check.passed = False
    check.note = (check.note + '; ' if check.note else '') + f'failure injected by {DIAGNOSE_FAIL_ENV} (test only)'
  return check


# ----------------------------------------------------------------------------
# Timing helper
# ----------------------------------------------------------------------------

def _time_per_call(fn, *args, seconds: float = 0.3, max_calls: int = 64,
                   fixed: Optional[tuple[int, int]] = None) -> float:
  """Best seconds per call of `fn(*args)`, calls issued back to back.

  Compiles and warms up first. Calls are queued in batches with one wait at
  the end, so that dispatch overhead does not hide the device's speed; the
  best batch wins, as other work on the host can only slow a batch down.

  Args:
    fn, args: what to time.
    seconds: time budget, which sets the batch size and count.
    max_calls: largest batch.
    fixed: (batches, calls per batch) regardless of time, for collectives
      that every process of a job must issue the same number of times.
  """
  import jax
  jax.block_until_ready(fn(*args))
  t = time.perf_counter()
  jax.block_until_ready(fn(*args))
  one = max(time.perf_counter() - t, 1e-6)
  batches, calls = fixed or (None, int(min(max_calls, max(1, seconds / 3 / one))))
  best = one
  deadline = time.perf_counter() + seconds
  done = 0
  while True:
    t = time.perf_counter()
    out = None
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - t) / calls)
    done += 1
    if (done >= batches) if batches else time.perf_counter() >= deadline:
      return best


# ----------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------

def _cpu_peak(dtype: str, cache_dir: str) -> tuple[Optional[float], str]:
  """The machine's cached measured matmul peak, as mjax-train stores it."""
  path = os.path.join(os.path.expanduser(cache_dir), 'peak_flops.json')
  try:
    with open(path) as fh:
      value = json.load(fh).get(peak_cache_key('cpu', dtype))
  except (OSError, ValueError, AttributeError):
    value = None
  if value is None:
    return None, f'no measured peak for this CPU in {path} (mjax-train caches one): nothing to compare with'
  return float(value), f'measured peak {value / 1e12:.3f} TFLOP/s from {path}'


def check_matmul(devices: Sequence, dtype: str, min_fraction: float = 0.5, cache_dir: str = '~/.cache/mjax',
                 seconds: float = 0.3) -> list[Check]:
  """Matrix-product throughput of each device in one dtype.

  Args:
    devices: the devices to measure (jax.local_devices()).
    dtype: 'bfloat16' or 'float32' (XLA's default precision, TF32 on recent
      NVIDIA GPUs, as training runs it).
    min_fraction: least acceptable share of the expected peak.
    cache_dir: where mjax-train caches a CPU's measured peak.
    seconds: timing budget per device.

  Returns:
    One Check per device, named 'matmul_<dtype>'. On CPU one measurement
    covers every (fake) device, which all share the same cores.
  """
  import jax
  import jax.numpy as jnp
  name = f'matmul_{dtype}'
  platform = devices[0].platform
  if platform == 'cpu':
    n, measured_on = 1024, devices[:1]  # the size the cached peak was measured at
    peak, source = _cpu_peak(dtype, cache_dir)
  else:
    n, measured_on = 8192, list(devices)
    peak = lookup_peak(devices[0].device_kind, dtype)
    source = (f'data sheet {peak / 1e12:.1f} TFLOP/s ({devices[0].device_kind})' if peak else
              f'no data-sheet figure for {devices[0].device_kind!r}: nothing to compare with')
  expected = peak * min_fraction / 1e12 if peak else None
  f = jax.jit(lambda a, b: a @ b)
  checks = []
  for d in measured_on:
    t0 = time.perf_counter()
    try:
      # Operands made on the device itself: a broken device 0 must not fail
      # every other device's check. Random values, as training's draw more
      # power than constant ones.
      with jax.default_device(d):
        ka, kb = jax.random.split(jax.random.key(0))
        a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
        b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
      tflops = 2 * n ** 3 / _time_per_call(f, a, b, seconds=seconds) / 1e12
      del a, b
    except Exception as e:  # a broken device raises here; that is the finding
      checks.append(Check(name, [d.id], None, expected, 'TFLOP/s', False,
                          f'{type(e).__name__}: {e}'.strip()[:500], time.perf_counter() - t0))
      continue
    passed = expected is None or tflops >= expected
    note = f'>= {min_fraction:.0%} of {source}' if expected is not None else source
    if platform == 'cpu':
      note += f'; CPU devices share the host\'s cores: one measurement for all {len(devices)}'
    checks.append(Check(name, [d.id] if platform != 'cpu' else [x.id for x in devices], tflops, expected,
                        'TFLOP/s', passed, note, time.perf_counter() - t0))
  return checks


def check_memory(devices: Sequence, fraction: float = 0.5, cpu_bytes: int = 128 * MIB) -> list[Check]:
  """Allocate, fill, verify and free a large buffer on each device.

  All devices are checked at once, by one program over a mesh of them (two
  compilations in all, not two per device); when that program fails (one
  device out of memory, one broken), each device is retried alone to find
  which.

  Args:
    devices: the devices to check.
    fraction: share of each accelerator's allocator limit to allocate.
    cpu_bytes: bytes to allocate per CPU device (host memory: there is no
      device limit to take a fraction of).

  Returns:
    One Check per device, named 'memory': value and expected in GiB.
  """
  limits = [memory_stats(d).get('bytes_limit') for d in devices]
  if devices[0].platform != 'cpu' and all(limits):
    nbytes = int(min(limits) * fraction)
    note = f'{fraction:.0%} of the allocator limit {min(limits) / GIB:.1f} GiB'
  else:
    nbytes, note = cpu_bytes, f'fixed size on {devices[0].platform}'
  rows = max(1, nbytes // (4 * _COLS))
  want = rows * _COLS * 4 / GIB
  t0 = time.perf_counter()
  try:
    bad = _fill_and_verify(devices, rows)
  except Exception:
    bad = None
  if bad is not None:
    per = (time.perf_counter() - t0) / len(devices)
    return [Check('memory', [d.id], want, want, 'GiB', b == 0,
                  note + (f'; {b} of {rows * _COLS} words read back wrong' if b else ''), per)
            for d, b in zip(devices, bad)]
  checks = []
  for d in devices:
    t0 = time.perf_counter()
    try:
      b = _fill_and_verify([d], rows)[0]
    except Exception as e:  # out of memory or a device error: the finding
      checks.append(Check('memory', [d.id], 0.0, want, 'GiB', False,
                          f'{note}; {type(e).__name__}: {e}'.strip()[:500], time.perf_counter() - t0))
      continue
    checks.append(Check('memory', [d.id], want, want, 'GiB', b == 0,
                        note + (f'; {b} of {rows * _COLS} words read back wrong' if b else ''),
                        time.perf_counter() - t0))
  return checks


_COLS = MIB  # uint32 words per row: 4 MiB rows keep every index below 2**31


def _fill_and_verify(devices: Sequence, rows: int) -> list[int]:
  """Fills `rows` x 4 MiB on each device with a pattern, then counts the
  words that read back wrong, per device. Frees the buffer before returning."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  n = len(devices)
  sharding = NamedSharding(Mesh(np.array(devices), ('d',)), P('d'))

  def pattern():
    i = jax.lax.broadcasted_iota(jnp.uint32, (n * rows, _COLS), 0)
    j = jax.lax.broadcasted_iota(jnp.uint32, (n * rows, _COLS), 1)
    return (i * jnp.uint32(_COLS) + j) * jnp.uint32(2654435761) + jnp.uint32(0x9E3779B9)

  # Two programs, so that the buffer really sits in device memory between them.
  buf = jax.jit(pattern, out_shardings=sharding)()
  bad = jax.jit(lambda x: jnp.sum((x != pattern()).astype(jnp.int32), axis=1), out_shardings=sharding)(buf)
  per_row = np.asarray(bad, dtype=np.int64)
  buf.delete()
  return [int(x) for x in per_row.reshape(n, rows).sum(axis=1)]


def check_collective(kind: str, devices: Sequence, nbytes: int, scope: str = 'local',
                     min_fraction: float = 0.5, seconds: float = 0.3) -> Check:
  """Bus bandwidth of an all-reduce or all-gather over `devices`.

  Args:
    kind: 'allreduce' (psum) or 'allgather' (all_gather).
    devices: the devices of the 1-D mesh: this process's (scope 'local') or
      every process's (scope 'global'; every process must call this too).
    nbytes: message size: bytes per device for the all-reduce, bytes
      gathered for the all-gather (nccl-tests' "size").
    scope: 'local' or 'global', part of the check's name.
    min_fraction: least acceptable share of the NVLink bandwidth, where
      the device kind has one and the collective stays within one host.
    seconds: timing budget.

  Returns:
    A Check named '<kind>_<scope>' with the bus bandwidth in GB/s.
  """
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  name = f'{kind}_{scope}'
  ids = [d.id for d in devices]
  n = len(devices)
  t0 = time.perf_counter()
  if n < 2:
    return Check(name, ids, None, None, 'GB/s', True, 'one device: nothing to exchange', 0.0)
  mesh = Mesh(np.array(devices), ('d',))
  per_device = max(1, (nbytes if kind == 'allreduce' else nbytes // n) // 4)  # float32 words
  if kind == 'allreduce':
    body, out_spec = (lambda x: jax.lax.psum(x, 'd')), P('d')
    factor = 2 * (n - 1) / n
    size = per_device * 4
  else:
    body, out_spec = (lambda x: jax.lax.all_gather(x, 'd', axis=0, tiled=True)), P()
    factor = (n - 1) / n
    size = per_device * 4 * n
  # check_vma off: all_gather's result is the same on every device, which
  # out_specs P() states but the checker cannot infer.
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P('d'), out_specs=out_spec, check_vma=False))

  def block():
    # One row per device, each 0, 1, .., 250, 0, 1, ..: sums stay exact in
    # float32, and no index grows with the number of devices.
    col = jax.lax.broadcasted_iota(jnp.int32, (n, per_device), 1)
    return (col % 251).astype(jnp.float32)

  make = jax.jit(block, out_shardings=NamedSharding(mesh, P('d')))
  link = link_bandwidth(devices[0].device_kind) if scope == 'local' else None
  expected = link * min_fraction if link else None
  try:
    x = make()
    # Across processes every process must issue the same collectives, so the
    # number of calls is fixed there instead of following this host's clock.
    # On CPU, collectives queued back to back can deadlock: each queued run's
    # participants take threads of XLA's shared pool and wait in a rendezvous
    # whose other participants then find no free thread ("only 7 of 8
    # arrived"). CPU devices have no link to measure anyway: one call at a time.
    cpu = devices[0].platform == 'cpu'
    t = _time_per_call(f, x, seconds=seconds, max_calls=1 if cpu else 64,
                       fixed=((3, 1) if cpu else (3, 4)) if scope == 'global' else None)
    # The result, not only the speed: a link that corrupts data fails here.
    out = f(x)
    ok = True
    for shard in out.addressable_shards:
      for row in range(shard.data.shape[0]):
        got = np.asarray(shard.data[row, :64])
        want = (n if kind == 'allreduce' else 1) * (np.arange(got.size) % 251)
        ok &= bool(np.array_equal(got, want.astype(np.float32)))
    del x, out
  except Exception as e:  # a wedged or broken link raises (or times out) here
    return Check(name, ids, None, expected, 'GB/s', False, f'{type(e).__name__}: {e}'.strip()[:500],
                 time.perf_counter() - t0)
  busbw = size * factor / t / 1e9
  if expected is not None:
    note = f'>= {min_fraction:.0%} of NVLink {link:.0f} GB/s per direction (data sheet)'
  else:
    note = f'no expected figure for {devices[0].device_kind!r} {"across hosts" if scope == "global" else ""}'.rstrip()
  note += f'; {n} devices, {size / MIB:.0f} MiB, {t * 1e3:.3g} ms'
  if not ok:
    note += '; WRONG RESULT'
  return Check(name, ids, busbw, expected, 'GB/s', ok and (expected is None or busbw >= expected), note,
               time.perf_counter() - t0)


def run_diagnostics(checks: Sequence[str] = CHECKS, min_fraction: float = 0.5, memory_fraction: float = 0.5,
                    cpu_memory_bytes: int = 128 * MIB, collective_bytes: Optional[int] = None,
                    dtypes: Optional[Sequence[str]] = None, cache_dir: str = '~/.cache/mjax',
                    seconds: float = 0.3) -> Report:
  """Runs the health checks of this process's devices.

  Args:
    checks: which of 'matmul', 'memory', 'allreduce', 'allgather' to run.
    min_fraction: least acceptable share of the expected matmul throughput
      and link bandwidth.
    memory_fraction: share of each accelerator's memory to allocate.
    cpu_memory_bytes: bytes to allocate per CPU device.
    collective_bytes: collective message size (default 256 MiB on
      accelerators, 8 MiB on CPU).
    dtypes: matmul dtypes (default bfloat16 and float32 on accelerators,
      float32 on CPU, the dtype CPU training uses).
    cache_dir: where mjax-train caches a CPU's measured peak.
    seconds: timing budget of each measurement.

  Returns:
    The Report; MJAX_DIAGNOSE_FAIL (test only) has been applied to it.

  Raises:
    ValueError: an unknown check name, here or in MJAX_DIAGNOSE_FAIL.
  """
  import jax
  unknown = sorted(set(checks) - set(CHECKS))
  if unknown:
    raise ValueError(f'unknown check(s) {", ".join(unknown)}; known: {", ".join(CHECKS)}.')
  forced = injected_failures()
  local = jax.local_devices()
  platform = local[0].platform
  if dtypes is None:
    dtypes = ('bfloat16', 'float32')
  if collective_bytes is None:
    collective_bytes = 8 * MIB if platform == 'cpu' else 256 * MIB
  results: list[Check] = []
  if 'matmul' in checks:
    for dt in dtypes:
      results += check_matmul(local, dt, min_fraction, cache_dir, seconds)
  if 'memory' in checks:
    results += check_memory(local, memory_fraction, cpu_memory_bytes)
  # A multi-process CPU job (tests, CI) runs even the local devices'
  # collectives through gloo, and two processes doing so at once can wait on
  # each other forever; on CPU there is no link between local devices to
  # test anyway, so only the cross-process collectives are measured there.
  skip_local = platform == 'cpu' and jax.process_count() > 1
  for kind in ('allreduce', 'allgather'):
    if kind in checks and skip_local:
      results.append(Check(f'{kind}_local', [d.id for d in local], None, None, 'GB/s', True,
                           'skipped: CPU devices in a multi-process job (measured across processes below)'))
    elif kind in checks:
      results.append(check_collective(kind, local, collective_bytes, 'local', min_fraction, seconds))
  # Across processes last, after every process has finished its local checks:
  # these are collectives of the whole job.
  if jax.process_count() > 1:
    for kind in ('allreduce', 'allgather'):
      if kind in checks:
        results.append(check_collective(kind, jax.devices(), collective_bytes, 'global', min_fraction, seconds))
  results = [_apply_injection(c, forced) for c in results]
  per_device = {d.id: True for d in local}
  for c in results:
    if c.name.startswith(('matmul', 'memory')):  # collectives are the host's, not one device's
      for d in c.devices:
        if d in per_device:
          per_device[d] &= c.passed
  return Report(host=socket.gethostname(), process=jax.process_index(), process_count=jax.process_count(),
                platform=platform, device_kind=local[0].device_kind, devices=per_device, checks=results)


def _fmt(value: Optional[float], unit: str) -> str:
  if value is None:
    return '-'
  digits = 3 if abs(value) < 10 else 1
  return f'{value:.{digits}f} {unit}'


def _ids(ids: Sequence[int]) -> str:
  ids = sorted(ids)
  if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
    return f'{ids[0]}-{ids[-1]}'
  return ','.join(map(str, ids))


def format_report(report: Report) -> str:
  """The report as an aligned table with a verdict line."""
  head = ['check', 'devices', 'measured', 'expected', 'result', 'seconds', 'note']
  lines = [[c.name, _ids(c.devices), _fmt(c.value, c.unit),
            ('>= ' + _fmt(c.expected, c.unit)) if c.expected is not None else '-',
            'pass' if c.passed else 'FAIL', f'{c.seconds:.2f}', c.note] for c in report.checks]
  widths = [max([len(h)] + [len(l[k]) for l in lines]) for k, h in enumerate(head)]

  def fmt(cells):
    return '  '.join(c.ljust(w) if k != 2 and k != 3 else c.rjust(w)
                     for k, (c, w) in enumerate(zip(cells, widths))).rstrip()

  bad = sorted(d for d, ok in report.devices.items() if not ok)
  title = (f'host {report.host}, process {report.process} of {report.process_count}: '
           f'{len(report.devices)} x {report.device_kind} ({report.platform})')
  verdict = ('PASS' if report.passed else 'FAIL: ' + ', '.join(c.name for c in report.failed)) + \
            (f'; failing devices: {_ids(bad)}' if bad else '')
  return '\n'.join([title, fmt(head), fmt(['-' * w for w in widths])] + [fmt(l) for l in lines] +
                   [f'verdict: {verdict}'])
