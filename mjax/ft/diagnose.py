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
              waiting in the collective until its check times out.

Each check gives a value, the expected value and pass/fail; a device
passes when all of its own checks pass, the host when every check does.

A blocked host stays blocked, so a healthy host must not fail because other
work slowed it down for a moment:

  baseline    the timed checks (matmul, the collectives) remember the best
              value they ever measured while passing, per host, device
              kind, check, size and JAX version, in
              <cache_dir>/diagnose_baseline.json. Where one exists, the
              expected figure is `min_fraction` of it instead of the data
              sheet's (or the CPU's cached peak): the host's own best is a
              truer figure than a catalogue's, and gives one to devices the
              catalogue lacks. Never written by a run with test-only
              injection, nor from a failed or suspect check.
  repeats     a local timed check that is only too slow (its result is
              right) is measured again, up to `repeats` times; the best try
              counts. The collectives across processes run once: every
              process must issue the same ones.
  suspect     a check still too slow after its repeats on a host whose
              1-minute load average, less this process's own share, is above
              LOADED_SHARE of its CPUs is marked suspect, not failed: the
              load explains it. The host's verdict ignores suspect checks;
              the JSON report lists them under "suspect". Contract with the
              driver (mjax/ft/driver.py): a host that comes back suspect
              twice in a row is blocked like a failing one, so a host that
              is slow under every load cannot hide behind it. A wrong
              result, an exception, running out of memory or a memory
              pattern error is never suspect.
  deadline    each check runs under `check_timeout_s`. One that overruns
              fails ("timed out after Ns"), the checks after it are not run
              (a wedged device or collective would hang them too; the report
              lists them as skipped) and the report says timed_out. The
              stuck thread may keep the interpreter from exiting:
              mjax-diagnose leaves with os._exit then.

Test-only fault injection, MJAX_DIAGNOSE_FAIL, comma-separated names (a
name also covers the checks it prefixes: 'allreduce' is allreduce_local and
allreduce_global):
  NAME        (matmul, memory, allreduce, allgather_global, ...) runs the
              check as usual and then reports it failed, so that the
              driver's "a failing diagnostic blocks the host" path can be
              exercised on healthy machines;
  hang:NAME   the check blocks forever instead of running (the deadline);
  slow:NAME   the check's first measurement is divided by 10 (the repeats).
MJAX_DIAGNOSE_LOADAVG=X (test-only) stands in for os.getloadavg()[0], so
that a loaded or idle host can be tested on any machine. Production sets
neither.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import socket
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np

# Device facts only from mjax.devices, which imports no JAX at load time:
# importing more inside a check once left the next all-reduce check stuck.
from mjax import jsonfile
from mjax.devices import host_memory_bytes, link_bandwidth, lookup_peak, memory_stats, peak_cache_key
from mjax.errors import UserError
from mjax.protocol import DIAGNOSE_FAIL_ENV

CHECKS = ('matmul', 'memory', 'allreduce', 'allgather')
MIB = 1 << 20
GIB = 1 << 30
BASELINE_FILE = 'diagnose_baseline.json'
LOADED_SHARE = 0.75                        # load per CPU above which a slow check is suspect
LOADAVG_ENV = 'MJAX_DIAGNOSE_LOADAVG'      # test-only stand-in for os.getloadavg()[0]
INJECTION_KINDS = ('hang', 'slow')         # MJAX_DIAGNOSE_FAIL prefixes; a plain name forces a failure


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
    suspect: too slow (and not passed), but on a host loaded by other
      work: the host's verdict does not count it.
  """
  name: str
  devices: list[int]
  value: Optional[float]
  expected: Optional[float]
  unit: str
  passed: bool
  note: str = ''
  seconds: float = 0.0
  suspect: bool = False


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
    timed_out: a check overran its deadline; the ones after it did not run.
    skipped: names of the checks not run after a timeout.
  """
  host: str
  process: int
  process_count: int
  platform: str
  device_kind: str
  devices: dict[int, bool]
  checks: list[Check]
  timed_out: bool = False
  skipped: list[str] = dataclasses.field(default_factory=list)

  @property
  def passed(self) -> bool:
    """The host's verdict: no timeout, and every check passed or is suspect."""
    return not self.timed_out and not self.failed

  @property
  def failed(self) -> list[Check]:
    return [c for c in self.checks if not c.passed and not c.suspect]

  @property
  def suspect(self) -> list[str]:
    """Names of the suspect checks, each once."""
    return list(dict.fromkeys(c.name for c in self.checks if c.suspect))

  def to_json(self) -> dict:
    """{"host", "process", "passed", "suspect", "timed_out", "checks": [...], ...}, JSON-ready."""
    return {'host': self.host, 'process': self.process, 'process_count': self.process_count,
            'passed': self.passed, 'suspect': self.suspect, 'timed_out': self.timed_out,
            'skipped': list(self.skipped), 'platform': self.platform, 'device_kind': self.device_kind,
            'devices': [{'id': d, 'passed': ok} for d, ok in sorted(self.devices.items())],
            'checks': [dataclasses.asdict(c) for c in self.checks],
            'time': time.time()}   # the host's clock, for the driver to compare with its own


# ----------------------------------------------------------------------------
# Test-only failure injection
# ----------------------------------------------------------------------------

def _known_checks() -> set[str]:
  return set(CHECKS) | {'matmul_bfloat16', 'matmul_float32'} | {
      f'{c}_{scope}' for c in ('allreduce', 'allgather') for scope in ('local', 'global')}


def injections(environ=None) -> dict[str, set[str]]:
  """{'fail': names, 'hang': names, 'slow': names} from MJAX_DIAGNOSE_FAIL
  (plain names, 'hang:NAME', 'slow:NAME'). Test-only.

  Raises:
    ValueError: for a name that matches no check, or an unknown prefix, so
      a typo in a test does not quietly test nothing.
  """
  spec = (os.environ if environ is None else environ).get(DIAGNOSE_FAIL_ENV, '')
  found: dict[str, set[str]] = {'fail': set(), **{k: set() for k in INJECTION_KINDS}}
  known, bad = _known_checks(), []
  for item in (n.strip() for n in spec.split(',')):
    if not item:
      continue
    prefix, _, name = item.rpartition(':')
    kind = prefix.strip() if prefix else 'fail'
    if name.strip() in known and (kind in INJECTION_KINDS or not prefix):
      found[kind].add(name.strip())
    else:
      bad.append(item)
  if bad:
    raise ValueError(f'{DIAGNOSE_FAIL_ENV}={spec!r}: unknown check(s) {", ".join(sorted(bad))}; '
                     f'known: {", ".join(sorted(known))}, each alone (a forced failure) or after '
                     f'{" or ".join(k + ":" for k in INJECTION_KINDS)} (comma-separated).')
  return found


def injected_failures(environ=None) -> set[str]:
  """Check names (or prefixes such as 'allreduce') that MJAX_DIAGNOSE_FAIL
  forces to fail. Test-only.

  Raises:
    ValueError: as `injections`.
  """
  return injections(environ)['fail']


def _matches(name: str, names: set[str]) -> bool:
  return any(name == f or name.startswith(f + '_') for f in names)


def _apply_injection(check: Check, forced: set[str]) -> Check:
  if _matches(check.name, forced):
    check.passed, check.suspect = False, False
    check.note = (check.note + '; ' if check.note else '') + f'failure injected by {DIAGNOSE_FAIL_ENV} (test only)'
  return check


# ----------------------------------------------------------------------------
# Own baseline
# ----------------------------------------------------------------------------

class Baseline:
  """The best value each timed check of this host measured while passing,
  kept in `<cache_dir>/diagnose_baseline.json` as
  {key: {"value", "unit", "measured"}}.

  Checks read it when they start and `record` what they passed with; `save`
  merges those into the file as it is then, so that diagnostics running at
  the same time (one per process) lose nothing but a race between two
  improvements of the same key.
  """

  def __init__(self, cache_dir: str = '~/.cache/mjax'):
    self.path = os.path.join(os.path.expanduser(cache_dir), BASELINE_FILE)
    self.entries = self._read()
    self.recorded: dict[str, dict] = {}

  def _read(self) -> dict:
    try:
      with open(self.path) as fh:
        data = jsonfile.load(fh)
    except (OSError, ValueError):   # none yet, or damaged: start afresh
      return {}
    if not isinstance(data, dict):
      return {}
    return {k: v for k, v in data.items() if isinstance(v, dict) and isinstance(v.get('value'), (int, float))}

  @staticmethod
  def key(check: str, device_kind: str, size: str) -> str:
    """Host, device kind, check, what sets its size, JAX version: a figure
    is only comparable with one measured the same way."""
    import jax
    return f'{socket.gethostname()}|{device_kind}|{check}|{size}|jax {jax.__version__}'

  def get(self, key: str) -> Optional[dict]:
    return self.entries.get(key)

  def record(self, key: str, value: float, unit: str) -> None:
    """A passing check's value; kept where it beats the best so far."""
    best = self.recorded.get(key) or self.entries.get(key)
    if best is None or value > best['value']:
      self.recorded[key] = {'value': float(value), 'unit': unit,
                            'measured': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}

  def save(self) -> None:
    """Merges the recorded values into the file (written atomically)."""
    if not self.recorded:
      return
    merged = self._read()   # again: another process may have written since
    for key, entry in self.recorded.items():
      if key not in merged or entry['value'] > merged[key]['value']:
        merged[key] = entry
    jsonfile.write_atomic(self.path, merged, indent=1, sort_keys=True)
    self.entries, self.recorded = merged, {}


def _expected(baseline: Optional[Baseline], key: Optional[str], min_fraction: float,
              expected: Optional[float], note: str, unit: str) -> tuple[Optional[float], str]:
  """The baseline's figure where there is one, else the one given."""
  own = baseline.get(key) if baseline is not None and key else None
  if own is None:
    return expected, note
  return own['value'] * min_fraction, (f'>= {min_fraction:.0%} of own baseline {_fmt(own["value"], unit)} '
                                       f'measured {str(own.get("measured", "?"))[:10]}')


# ----------------------------------------------------------------------------
# Load of the host by other work
# ----------------------------------------------------------------------------

# (monotonic seconds, this process's CPU seconds), sampled as checks run:
# the CPU time between two samples is this process's share of the load then.
_CPU_SAMPLES: list[tuple[float, float]] = [(time.monotonic(), time.process_time())]


def _sample_cpu() -> None:
  _CPU_SAMPLES.append((time.monotonic(), time.process_time()))
  while len(_CPU_SAMPLES) > 2 and _CPU_SAMPLES[1][0] < _CPU_SAMPLES[-1][0] - 600:
    del _CPU_SAMPLES[0]   # ten minutes on, a sample's weight is e**-10


def own_load() -> float:
  """This process's share of the 1-minute load average, in CPUs.

  The kernel's average decays with e**(-t / 60 s); the CPU time this
  process used between each two samples, weighted the same way, is what it
  added. Its threads that wait for a CPU add to the load but not to its CPU
  time: on a host busy with other work this comes out low, which errs
  towards calling that work's load what it is.
  """
  _sample_cpu()
  now, total = _CPU_SAMPLES[-1][0], 0.0
  for (t0, c0), (t1, c1) in zip(_CPU_SAMPLES, _CPU_SAMPLES[1:]):
    if t1 > t0:
      total += (c1 - c0) / (t1 - t0) * (math.exp(-(now - t1) / 60) - math.exp(-(now - t0) / 60))
  return total


def host_load(environ=None) -> Optional[tuple[float, int]]:
  """(1-minute load average less this process's share, CPU count), or None
  where the system does not tell."""
  env = os.environ if environ is None else environ
  try:
    load = float(env[LOADAVG_ENV]) if env.get(LOADAVG_ENV) else os.getloadavg()[0]
  except (OSError, ValueError, AttributeError):
    return None
  return max(0.0, load - own_load()), os.cpu_count() or 1


def _loaded() -> Optional[str]:
  """A note naming the load when it is above LOADED_SHARE, else None."""
  got = host_load()
  if got is None:
    return None
  load, cpus = got
  if load <= LOADED_SHARE * cpus:
    return None
  return (f'SUSPECT: host loaded by other work (1-minute load {load:.1f} on {cpus} CPUs, '
          f'above {LOADED_SHARE:.0%}): the load explains the shortfall')


# ----------------------------------------------------------------------------
# Timing helpers
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


def _timed(name: str, devices: list[int], expected: Optional[float], unit: str, note: str,
           measure: Callable[[], tuple[float, bool, str]], repeats: int,
           baseline: Optional[Baseline] = None, key: Optional[str] = None) -> Check:
  """One timed check: `measure()` -> (value, result right, detail for the
  note), tried again while only its speed falls short, `repeats` times at
  most; the best try counts.

  A shortfall that outlasts the repeats on a loaded host is suspect; a
  passing value goes into `baseline` (not saved here).
  """
  t0 = time.perf_counter()
  slow = _matches(name, injections()['slow'])
  best, best_detail, tries = None, '', 0
  while True:
    tries += 1
    _sample_cpu()
    try:
      value, right, detail = measure()
    except Exception as e:  # a broken device or link raises here; that is the finding
      return Check(name, devices, None, expected, unit, False, f'{type(e).__name__}: {e}'.strip()[:500],
                   time.perf_counter() - t0)
    if slow and tries == 1:
      value /= 10
    if best is None or value > best:
      best, best_detail = value, detail
    if not right:   # wrong data is a fault whatever the speed: no second try, never suspect
      return Check(name, devices, value, expected, unit, False, f'{note}{detail}; WRONG RESULT',
                   time.perf_counter() - t0)
    if expected is None or best >= expected or tries > repeats:
      break
  passed = expected is None or best >= expected
  note += best_detail
  if tries > 1:
    note += f'; best of {tries} tries'
  if slow:
    note += f'; first try slowed 10x by {DIAGNOSE_FAIL_ENV} (test only)'
  suspect = None if passed else _loaded()
  if suspect:
    note += '; ' + suspect
  if passed and baseline is not None and key:
    baseline.record(key, best, unit)
  return Check(name, devices, best, expected, unit, passed, note, time.perf_counter() - t0, suspect=bool(suspect))


# ----------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------

def _cpu_peak(dtype: str, cache_dir: str) -> tuple[Optional[float], str]:
  """The machine's cached measured matmul peak, as mjax-train stores it."""
  path = os.path.join(os.path.expanduser(cache_dir), 'peak_flops.json')
  try:
    with open(path) as fh:
      value = jsonfile.load(fh).get(peak_cache_key('cpu', dtype))
  except (OSError, ValueError, AttributeError):
    value = None
  if value is None:
    return None, f'no measured peak for this CPU in {path} (mjax-train caches one): nothing to compare with'
  return float(value), f'measured peak {value / 1e12:.3f} TFLOP/s from {path}'


def check_matmul(devices: Sequence, dtype: str, min_fraction: float = 0.5, cache_dir: str = '~/.cache/mjax',
                 seconds: float = 0.3, repeats: int = 2, baseline: Optional[Baseline] = None) -> list[Check]:
  """Matrix-product throughput of each device in one dtype.

  Args:
    devices: the devices to measure (jax.local_devices()).
    dtype: 'bfloat16' or 'float32' (XLA's default precision, TF32 on recent
      NVIDIA GPUs, as training runs it).
    min_fraction: least acceptable share of the expected peak.
    cache_dir: where mjax-train caches a CPU's measured peak.
    seconds: timing budget per device and try.
    repeats: further tries of a device that is only too slow.
    baseline: the host's own best figures, used before any other and
      updated (in memory) with passing values.

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
  note = f'>= {min_fraction:.0%} of {source}' if expected is not None else source
  key = Baseline.key(name, devices[0].device_kind, f'n={n}')
  expected, note = _expected(baseline, key, min_fraction, expected, note, 'TFLOP/s')
  if platform == 'cpu':
    note += f'; CPU devices share the host\'s cores: one measurement for all {len(devices)}'
  f = jax.jit(lambda a, b: a @ b)
  checks = []
  for d in measured_on:
    def measure(d=d):
      # Operands made on the device itself: a broken device 0 must not fail
      # every other device's check. Random values, as training's draw more
      # power than constant ones.
      with jax.default_device(d):
        ka, kb = jax.random.split(jax.random.key(0))
        a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
        b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
      return 2 * n ** 3 / _time_per_call(f, a, b, seconds=seconds) / 1e12, True, ''
    ids = [d.id] if platform != 'cpu' else [x.id for x in devices]
    checks.append(_timed(name, ids, expected, 'TFLOP/s', note, measure, repeats, baseline, key))
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
                     min_fraction: float = 0.5, seconds: float = 0.3, repeats: int = 2,
                     baseline: Optional[Baseline] = None) -> Check:
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
    seconds: timing budget of a try.
    repeats: further tries when only the speed falls short (scope 'local'
      only).
    baseline: the host's own best figures, used before any other and
      updated (in memory) with a passing value.

  Returns:
    A Check named '<kind>_<scope>' with the bus bandwidth in GB/s.
  """
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  name = f'{kind}_{scope}'
  ids = [d.id for d in devices]
  n = len(devices)
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
  if expected is not None:
    note = f'>= {min_fraction:.0%} of NVLink {link:.0f} GB/s per direction (data sheet)'
  else:
    note = f'no expected figure for {devices[0].device_kind!r} {"across hosts" if scope == "global" else ""}'.rstrip()
  key = Baseline.key(name, devices[0].device_kind, f'{size} bytes x {n} devices')
  expected, note = _expected(baseline, key, min_fraction, expected, note, 'GB/s')

  def measure():
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
    return size * factor / t / 1e9, ok, f'; {n} devices, {size / MIB:.0f} MiB, {t * 1e3:.3g} ms'

  # Across processes, one try: a process that measured again on its own
  # would issue collectives the others never join, and every one would wait
  # in them until its deadline.
  return _timed(name, ids, expected, 'GB/s', note, measure, repeats if scope == 'local' else 0, baseline, key)


def _with_deadline(run: Callable[[], list[Check]], timeout_s: Optional[float],
                   hang: bool = False) -> Optional[list[Check]]:
  """`run()` in a daemon thread, waited for `timeout_s` seconds (None: no
  limit); None when it overran. A thread stuck in a device call cannot be
  stopped, only left behind, as a daemon so that it holds no exit up."""
  box: dict = {}

  def target():
    try:
      if hang:
        threading.Event().wait()   # test only: a wedged device or collective
      box['checks'] = run()
    except BaseException as e:  # noqa: BLE001 -- raised again in the caller's thread
      box['error'] = e

  thread = threading.Thread(target=target, name='mjax-diagnose-check', daemon=True)
  thread.start()
  thread.join(timeout_s)
  if thread.is_alive():
    return None
  if 'error' in box:
    raise box['error']
  return box['checks']


def run_diagnostics(checks: Sequence[str] = CHECKS, min_fraction: float = 0.5, memory_fraction: float = 0.5,
                    cpu_memory_bytes: int = 128 * MIB, collective_bytes: Optional[int] = None,
                    dtypes: Optional[Sequence[str]] = None, cache_dir: str = '~/.cache/mjax',
                    seconds: float = 0.3, baseline: bool = True, repeats: int = 2,
                    check_timeout_s: Optional[float] = 120.0) -> Report:
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
    cache_dir: where mjax-train caches a CPU's measured peak, and where the
      host's own baseline is kept.
    seconds: timing budget of each measurement.
    baseline: compare with (and keep) the host's own best figures.
    repeats: further tries of a local timed check that is only too slow.
    check_timeout_s: deadline of each check (None: none).

  Returns:
    The Report; MJAX_DIAGNOSE_FAIL (test only) has been applied to it.

  Raises:
    ValueError: an unknown check name, here or in MJAX_DIAGNOSE_FAIL.
  """
  import jax
  unknown = sorted(set(checks) - set(CHECKS))
  if unknown:
    raise ValueError(f'unknown check(s) {", ".join(unknown)}; known: {", ".join(CHECKS)}.')
  injected = injections()
  local = jax.local_devices()
  ids = [d.id for d in local]
  platform = local[0].platform
  if dtypes is None:
    dtypes = ('bfloat16', 'float32')
  if collective_bytes is None:
    collective_bytes = 8 * MIB if platform == 'cpu' else 256 * MIB
  own = Baseline(cache_dir) if baseline else None
  # What to run, in order: (name, devices, unit, run), each run under its
  # own deadline.
  plan: list[tuple[str, list[int], str, Callable[[], list[Check]]]] = []
  if 'matmul' in checks:
    for dt in dtypes:
      plan.append((f'matmul_{dt}', ids, 'TFLOP/s',
                   lambda dt=dt: check_matmul(local, dt, min_fraction, cache_dir, seconds, repeats, own)))
  if 'memory' in checks:
    plan.append(('memory', ids, 'GiB', lambda: check_memory(local, memory_fraction, cpu_memory_bytes)))
  # A multi-process CPU job (tests, CI) runs even the local devices'
  # collectives through gloo, and two processes doing so at once can wait on
  # each other forever; on CPU there is no link between local devices to
  # test anyway, so only the cross-process collectives are measured there.
  skip_local = platform == 'cpu' and jax.process_count() > 1
  for kind in ('allreduce', 'allgather'):
    if kind in checks and skip_local:
      skipped = Check(f'{kind}_local', ids, None, None, 'GB/s', True,
                      'skipped: CPU devices in a multi-process job (measured across processes below)')
      plan.append((skipped.name, ids, 'GB/s', lambda c=skipped: [c]))
    elif kind in checks:
      plan.append((f'{kind}_local', ids, 'GB/s', lambda kind=kind: [
          check_collective(kind, local, collective_bytes, 'local', min_fraction, seconds, repeats, own)]))
  # Across processes last, after every process has finished its local checks:
  # these are collectives of the whole job.
  if jax.process_count() > 1:
    everyone = jax.devices()
    for kind in ('allreduce', 'allgather'):
      if kind in checks:
        plan.append((f'{kind}_global', [d.id for d in everyone], 'GB/s', lambda kind=kind: [
            check_collective(kind, everyone, collective_bytes, 'global', min_fraction, seconds, 0, own)]))
  results: list[Check] = []
  not_run: list[str] = []
  timed_out = False
  for name, devices, unit, run in plan:
    if timed_out:
      # A wedged device or collective would hang these too: not run.
      not_run.append(name)
      continue
    t0 = time.perf_counter()
    got = _with_deadline(run, check_timeout_s, hang=_matches(name, injected['hang']))
    if got is None:
      timed_out = True
      results.append(Check(name, devices, None, None, unit, False,
                           f'timed out after {check_timeout_s:g}s; the checks after it were not run',
                           time.perf_counter() - t0))
    else:
      results += got
  results = [_apply_injection(c, injected['fail']) for c in results]
  # A timed-out run leaves a thread that may still record; a run with
  # injected faults measured nothing trustworthy.
  if own is not None and not timed_out and not any(injected.values()):
    try:
      own.save()
    except OSError as e:   # an unwritable cache costs the baseline, not the verdict
      import sys
      print(f'mjax-diagnose: baseline not saved: {e}', file=sys.stderr, flush=True)
  per_device = {d.id: True for d in local}
  for c in results:
    if c.name.startswith(('matmul', 'memory')):  # collectives are the host's, not one device's
      for d in c.devices:
        if d in per_device:
          per_device[d] &= c.passed or c.suspect
  return Report(host=socket.gethostname(), process=jax.process_index(), process_count=jax.process_count(),
                platform=platform, device_kind=local[0].device_kind, devices=per_device, checks=results,
                timed_out=timed_out, skipped=not_run)


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
            'pass' if c.passed else 'suspect' if c.suspect else 'FAIL', f'{c.seconds:.2f}', c.note]
           for c in report.checks]
  lines += [[name, '', '-', '-', 'not run', '', 'after the timeout'] for name in report.skipped]
  widths = [max([len(h)] + [len(l[k]) for l in lines]) for k, h in enumerate(head)]

  def fmt(cells):
    return '  '.join(c.ljust(w) if k != 2 and k != 3 else c.rjust(w)
                     for k, (c, w) in enumerate(zip(cells, widths))).rstrip()

  bad = sorted(d for d, ok in report.devices.items() if not ok)
  title = (f'host {report.host}, process {report.process} of {report.process_count}: '
           f'{len(report.devices)} x {report.device_kind} ({report.platform})')
  verdict = ('PASS' if report.passed else 'FAIL: ' + ', '.join(c.name for c in report.failed)) + \
            (' (timed out)' if report.timed_out else '') + \
            (f'; suspect under load: {", ".join(report.suspect)}' if report.suspect else '') + \
            (f'; failing devices: {_ids(bad)}' if bad else '')
  return '\n'.join([title, fmt(head), fmt(['-' * w for w in widths])] + [fmt(l) for l in lines] +
                   [f'verdict: {verdict}'])


# --- the command line ---------------------------------------------------------------

def parse_args(argv: Sequence[str], parser_class=argparse.ArgumentParser) -> argparse.Namespace:
  """mjax-diagnose's arguments, checked (UserError, or the parser's own
  usage error); `args.checks` becomes the list of checks. mjax-launch checks
  its --diagnose_args with it before any host is judged by them."""
  p = parser_class(
      prog='mjax-diagnose', description='Health checks of this host: matmul throughput per device, device memory, '
      'all-reduce / all-gather bus bandwidth (and across processes in a multi-process job). '
      'Exit 0: all pass; 1: a check failed or timed out.')
  p.add_argument('--json', action='store_true',
                 help='print {"host", "process", "passed", "suspect", "timed_out", "checks": [...]} as JSON')
  p.add_argument('--min_fraction', type=float, default=0.5,
                 help='least acceptable share of the expected matmul throughput and link bandwidth: the '
                 'host\'s own baseline where it has one, else the data sheet (default 0.5)')
  p.add_argument('--memory_fraction', type=float, default=0.5,
                 help='share of each accelerator\'s memory to allocate and verify (default 0.5)')
  p.add_argument('--cpu_memory_mib', type=int, default=128, help='MiB to allocate per CPU device (default 128)')
  p.add_argument('--collective_mib', type=int, default=None,
                 help='collective message size in MiB (default 256 on accelerators, 8 on CPU)')
  p.add_argument('--checks', default=','.join(CHECKS),
                 help=f'comma-separated subset of {",".join(CHECKS)} (default: all)')
  p.add_argument('--repeats', type=int, default=2,
                 help='further tries of a local timed check that is only too slow; the best counts (default 2)')
  p.add_argument('--check_timeout_s', type=float, default=120.0,
                 help='deadline of each check; one that overruns fails and the rest are not run (default 120)')
  p.add_argument('--no_baseline', action='store_true',
                 help=f'neither compare with nor update the host\'s own best figures '
                 f'(<cache_dir>/{BASELINE_FILE})')
  p.add_argument('--cache_dir', default='~/.cache/mjax',
                 help='where the baseline is kept and mjax-train caches a CPU\'s peak (default ~/.cache/mjax)')
  args = p.parse_args(list(argv))
  if not 0 < args.min_fraction <= 1 or not 0 < args.memory_fraction < 1:
    raise UserError(f'--min_fraction {args.min_fraction} must be in (0, 1] and --memory_fraction '
                    f'{args.memory_fraction} in (0, 1).')
  if not args.cache_dir.strip():   # '' was the working directory: the baseline written wherever it ran
    raise UserError(f'--cache_dir {args.cache_dir!r} names no folder; give the folder that keeps the baseline '
                    '(default ~/.cache/mjax).')
  if args.repeats < 0 or not args.check_timeout_s > 0:
    raise UserError(f'--repeats {args.repeats} must be >= 0 and --check_timeout_s {args.check_timeout_s} > 0.')
  args.checks = [c.strip() for c in args.checks.split(',') if c.strip()]
  unknown = sorted(set(args.checks) - set(CHECKS))
  if unknown or not args.checks:
    raise UserError(f'--checks {",".join(args.checks)!r}: ' + (f'unknown check(s) {", ".join(unknown)}' if unknown
                    else 'no check named') + f'; give a comma-separated subset of {",".join(CHECKS)}.')
  host = host_memory_bytes()
  for name in ('cpu_memory_mib', 'collective_mib'):
    value = getattr(args, name)
    if value is not None and value < 1:
      raise UserError(f'--{name} {value}: give at least 1 MiB.')
    # Each device allocates this much: more than the host has is a typo,
    # not a fault of the host (--cpu_memory_mib 10**12 aborted in XLA,
    # --collective_mib 10**9 failed the host as out of memory).
    if value is not None and host and value * MIB > host:
      raise UserError(f'--{name} {value}: more than this host\'s memory ({host // MIB:,} MiB), and each device '
                      f'allocates that much; give a size it can hold.')
  if not args.check_timeout_s < threading.TIMEOUT_MAX:
    raise UserError(f'--check_timeout_s {args.check_timeout_s} is too large (at most {threading.TIMEOUT_MAX:.0f}).')
  return args
