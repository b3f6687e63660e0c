"""Each process's device time of a sampled step, compute and collectives
apart: the slow rank that host timings cannot name (MegaScale §4.3).

In a synchronous job a rank slowed inside the step (a throttled GPU, a host
stopped while its device's part of a collective is due) holds every rank in
that collective: every process's host sees the same step time, and none ends
late. The device trace tells them apart. The slow rank arrives last at each
collective, so it waits little there, while the healthy ranks finish their
kernels on time and then wait for it inside the collective; where the device
itself is slow, its kernels also take longer. Per rank, time in compute
kernels and time in collectives name it (measured on two CPU processes, one
stopped a third of the time: its compute 9.4 s against 6.8 s, its all-reduce
wait 0.07 s against 2.7 s; see mjax.ft.stragglers.device_compare).

`DeviceSampler` traces one step every FaultConfig.device_timing_every steps
with jax.profiler on every process (the same steps everywhere), reads the
trace back, and hands {'compute': s, 'collective': s} to the process's
timing row (`mjax.ft.phases`), where `mjax.ft.stragglers` compares the
ranks. A process with several GPUs also records each one's split
('devices'): the ranks compared are then its devices, so that one slow GPU
among a host's eight is named, in a single-process job too. The trace is
deleted once read.
"""

from __future__ import annotations

import collections
import glob
import gzip
import os
import re
import shutil
import tempfile
from typing import Any, Iterable, Optional

import jax
import numpy as np

from mjax import jsonfile

# Collective kernels and ops: NCCL's kernels on GPU, XLA's collective ops
# (their async start/done halves included) on CPU and in HLO names.
COLLECTIVE = re.compile(r'nccl|all-reduce|all-gather|reduce-scatter|collective|all-to-all|^send|^recv', re.I)


def find_trace(path: str) -> Optional[str]:
  """The newest perfetto_trace.json.gz (or *.trace.json.gz) at or below `path`."""
  if os.path.isfile(path):
    return path
  hits = sorted(glob.glob(os.path.join(path, '**', '*perfetto_trace.json.gz'), recursive=True)
                or glob.glob(os.path.join(path, '**', '*.trace.json.gz'), recursive=True))
  return hits[-1] if hits else None


# The lines (threads) of a device plane. On GPU, CUPTI's kernels and copies,
# one line per stream ("Stream #14(...)"), beside lines that hold no kernel
# time ("_counters_", "CUPTI overhead"). On TPU, the runtime's "XLA Ops"
# beside lines that enclose them ("XLA Modules": the whole program, "Steps").
# Taking all of them would count the step twice, and the program's span as
# compute. (A stream line that also caught a CUPTI overhead record is named
# "CUPTI overhead" as a whole: its kernels are lost to this count; rare,
# and the same on every device.)
_STREAM_LINE = re.compile(r'^Stream\b', re.I)
_OPS_LINE = re.compile(r'^XLA Ops$', re.I)
_NOT_KERNELS = re.compile(r'XLA Modules|Steps|Launch Stats|Framework|Source|TensorFlow|Async|counters|overhead',
                          re.I)
_DEVICE = re.compile(r'/device:(?:GPU|TPU):(\d+)')


def device_streams(path: str) -> dict[Optional[int], list[dict]]:
  """The complete events of each device in a jax.profiler trace, by the
  device's ordinal in this process (the N of /device:GPU:N: CUDA's
  numbering of the GPUs this process sees, which CUDA_VISIBLE_DEVICES
  renumbers): GPU kernels (TPU ops), or on CPU (ordinal None) the XLA ops
  of the host threads that run them, which all of a process's CPU devices
  share. Each is a Chrome-trace event with at least 'name', 'ts' and 'dur'
  (µs). Devices without a kernel in the trace are left out.
  """
  with gzip.open(path, 'rt') if path.endswith('.gz') else open(path) as fh:
    trace = jsonfile.load(fh)
  events = trace['traceEvents'] if isinstance(trace, dict) else trace
  pname = {e['pid']: e.get('args', {}).get('name', '') for e in events
           if e.get('ph') == 'M' and e.get('name') == 'process_name'}
  tname = {(e['pid'], e.get('tid')): e.get('args', {}).get('name', '') for e in events
           if e.get('ph') == 'M' and e.get('name') == 'thread_name'}
  device_pids = {p: int(m.group(1)) for p, n in pname.items() if (m := _DEVICE.search(n))}
  complete = [e for e in events if e.get('ph') == 'X' and 'dur' in e]
  if not device_pids:  # CPU: the XLA ops run on host threads
    host = {p for p, n in pname.items() if 'host' in n.lower() or 'cpu' in n.lower()}
    # The host threads also carry the runtime's and Python's own spans,
    # which enclose the ops; keep the XLA instructions (HLO names) alone.
    ops = [e for e in complete if e.get('pid') in host and re.fullmatch(r'[\w.\-]+', e['name'])
           and 'Thunk' not in e['name']]
    return {None: ops} if ops else {}
  by_line: dict[tuple, list[dict]] = collections.defaultdict(list)
  for e in complete:
    if e.get('pid') in device_pids:
      by_line[(e['pid'], e.get('tid'))].append(e)
  # One rule for the whole trace, so that every device is counted alike:
  # stream kernels where there are any, else the XLA ops line, else any
  # line that does not merely enclose or annotate them.
  names = {k: tname.get(k, '') for k in by_line}
  for pick in (_STREAM_LINE.search, _OPS_LINE.search, lambda n: not _NOT_KERNELS.search(n)):
    keep = [k for k, n in names.items() if pick(n)]
    if keep:
      break
  out: dict[Optional[int], list[dict]] = {}
  for pid, tid in sorted(keep, key=lambda k: (device_pids[k[0]], str(k[1]))):
    out.setdefault(device_pids[pid], []).extend(by_line[(pid, tid)])
  return out


def device_ops(path: str) -> list[dict]:
  """The device events of `device_streams`, all devices together."""
  return [e for ops in device_streams(path).values() for e in ops]


def busy_seconds(ops: Iterable[dict]) -> float:
  """Seconds covered by the union of the ops' intervals: kernels of one GPU
  stream never overlap, but several streams (and XLA:CPU's threads) do."""
  spans = sorted((e['ts'], e['ts'] + e['dur']) for e in ops)
  busy, end = 0.0, float('-inf')
  for a, b in spans:
    if b > end:
      busy += b - max(a, end)
      end = b
  return busy / 1e6


def split(ops: list[dict]) -> dict:
  """{'compute': s, 'collective': s}: device time in compute kernels and in
  collectives (each the union of its intervals)."""
  coll = [e for e in ops if COLLECTIVE.search(e['name'])]
  comp = [e for e in ops if not COLLECTIVE.search(e['name'])]
  return {'compute': round(busy_seconds(comp), 6), 'collective': round(busy_seconds(coll), 6)}


def split_devices(streams: dict[Optional[int], list[dict]],
                  stages: Optional[dict[int, int]] = None) -> Optional[dict]:
  """A process's sample from its devices' events (`device_streams`).

  {'compute', 'collective'} of its slowest device (the most compute time):
  the one its collective partners wait for, if any. With several devices,
  also 'devices': {ordinal: {'compute', 'collective'}} for every one of
  them, so that one slow GPU among a host's eight is named, and a
  single-process job has ranks to compare. `stages` (ordinal -> pipeline
  stage, in a pipelined mesh) adds each split's 'stage': stages do unequal
  work (the last one also runs the head and the loss), so only devices of
  one stage are compared. None without events.
  """
  per = {d: split(ops) for d, ops in streams.items() if ops}
  if not per:
    return None
  if stages:
    for d, v in per.items():
      if d in stages:
        v['stage'] = int(stages[d])
  worst = max(per, key=lambda d: (per[d]['compute'], -1 if d is None else -d))
  out = dict(per[worst])
  if len(per) > 1:
    out['devices'] = {str(d): v for d, v in sorted(per.items())}
  return out


def local_stages(mesh: Any) -> Optional[dict[int, int]]:
  """Each of this process's devices' pipeline stage, by its ordinal in the
  process's trace (`device_streams`); None without a pipeline axis > 1."""
  if mesh is None or 'pipeline' not in mesh.axis_names or mesh.shape['pipeline'] == 1:
    return None
  axis = list(mesh.axis_names).index('pipeline')
  me = jax.process_index()
  out = {}
  for idx, d in np.ndenumerate(mesh.devices):
    if d.process_index == me:
      ordinal = getattr(d, 'local_hardware_id', None)
      out[d.id if ordinal is None else int(ordinal)] = int(idx[axis])
  return out


TRACE_PREFIX = 'mjax-device-trace-'
_TRACE_DIR = re.compile(re.escape(TRACE_PREFIX) + r'(\d+)-\d{5}')


def remove_orphaned_traces(root: str) -> None:
  """Deletes the sample directories under `root` of processes no longer
  running. A trainer killed inside a sampled step (SIGKILL after a fault,
  the OOM killer) leaves its trace there, one directory of its own pid per
  attempt (2 MB for the tiny model on CPU, a step's trace of a large
  model on a GPU): a host's temporary directory filled up over a long
  run's restarts."""
  try:
    names = os.listdir(root)
  except OSError:
    return
  for name in names:
    m = _TRACE_DIR.fullmatch(name)
    if m is None or _running(int(m.group(1))):
      continue
    shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _running(pid: int) -> bool:
  if pid == os.getpid():
    return True
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:   # another user's process: running
    pass
  return True


class DeviceSampler:
  """Traces one step every `every` steps and returns its device split.

  Off (every step a no-op) when `every` is 0, where there is no other rank
  to compare with (`has_ranks`: a single process on a CPU or one GPU), and in the steps the user's own profile
  (TrainConfig.profile_steps) traces: jax.profiler runs one trace at a time.
  """

  def __init__(self, every: int, directory: str, enabled: bool = True,
               stages: Optional[dict[int, int]] = None, start_step: int = 0):
    self.every = every if enabled else 0
    self.directory = directory
    self.stages = stages
    self.start_step = start_step
    self.active = False

  @classmethod
  def for_run(cls, every: int, process_index: int, mesh: Any = None, start_step: int = 0) -> 'DeviceSampler':
    """The sampler of a training run; `mesh` (jax.sharding.Mesh) gives each
    local device's pipeline stage, where the mesh has a 'pipeline' axis > 1;
    `start_step` is the step the run resumes from (every process's)."""
    # The host's own temporary directory, not the workdir: at thousands of
    # processes the workdir is a shared filesystem, and each sample is a
    # trace file per process, read once and deleted.
    root = tempfile.gettempdir()
    remove_orphaned_traces(root)
    directory = os.path.join(root, f'{TRACE_PREFIX}{os.getpid()}-{process_index:05d}')
    return cls(every, directory, enabled=cls.has_ranks(jax.process_count(), jax.local_device_count(),
                                                       jax.default_backend()),
               stages=local_stages(mesh), start_step=start_step)

  @staticmethod
  def has_ranks(processes: int, local_devices: int, backend: str) -> bool:
    """Whether a sample can name a slow rank: several processes, or one
    with several GPUs (TPUs), whose traces keep each device's kernels apart.
    A CPU trace does not: its devices' ops share the host's threads."""
    return processes > 1 or (local_devices > 1 and backend != 'cpu')

  def due(self, step: int) -> bool:
    # Half a period off the multiples of `every`: checkpoints (save_every,
    # 1000 by default) fall on round steps, and a save's device-to-host copy
    # inside the trace would read as compute. Never a run's first step,
    # whose first execution (buffers allocated, the collectives' first set-up)
    # is no sample of the device's pace: resumed at 49, step 50's compute read
    # 141 and 209 ms in two healthy processes whose steps take 15, and made
    # one of them a straggler.
    return bool(self.every) and step > self.start_step + 1 and step % self.every == self.every // 2

  def before(self, step: int, state: Any = None, profiling: bool = False) -> None:
    """Starts the trace of a sampled step, once the previous step's device
    work (`state`) is done, so that none of it lands in this step's trace."""
    if not self.due(step) or profiling:
      return
    if state is not None:
      jax.block_until_ready(state)
    shutil.rmtree(self.directory, ignore_errors=True)
    try:
      jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
    except RuntimeError:          # another trace is running (the user's own): skip this sample
      return
    self.active = True

  def wait(self, state: Any) -> None:
    """In a sampled step: waits for its device work, which the trace must hold."""
    if self.active:
      jax.block_until_ready(state)

  def collect(self) -> Optional[dict]:
    """The sampled step's {'compute', 'collective'} seconds, or None."""
    if not self.active:
      return None
    self.active = False
    try:
      jax.profiler.stop_trace()
      path = find_trace(self.directory)
      return split_devices(device_streams(path), self.stages) if path else None
    except Exception:   # noqa: BLE001 - a trace that cannot be written or read costs the sample, not the run
      return None
    finally:
      shutil.rmtree(self.directory, ignore_errors=True)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    # The loop left inside a sampled step (an error, a stop): the trace must
    # not stay running, or the next trace in this process could not start.
    if self.active:
      self.collect()
    return False
