"""Device time of a sampled step, compute and collectives apart
(mjax/ft/device_time.py): on a synthetic trace and on a real CPU trace. A
real 2-process job with one rank slowed inside the step is in test_ft.py
(`test_a_rank_throttled_inside_the_step_is_named_by_the_driver`)."""

import gzip
import json
import os

import jax
import jax.numpy as jnp
import pytest

from mjax.ft import device_time as dt


def _trace(tmp_path, events, device='/device:GPU:0'):
  meta = [{'ph': 'M', 'name': 'process_name', 'pid': 1, 'args': {'name': device}},
          {'ph': 'M', 'name': 'process_name', 'pid': 2, 'args': {'name': '/host:CPU'}}]
  path = tmp_path / 'x.perfetto_trace.json.gz'
  with gzip.open(path, 'wt') as fh:
    json.dump({'traceEvents': meta + events}, fh)
  return str(path)


def test_split_counts_overlapping_streams_once_and_collectives_apart(tmp_path):
  ev = lambda name, ts, dur, pid=1: {'ph': 'X', 'name': name, 'pid': pid, 'tid': 1, 'ts': ts, 'dur': dur}
  path = _trace(tmp_path, [
      ev('loop_fusion_3', 0, 100_000), ev('gemm_fusion', 50_000, 100_000),        # two streams: 150 ms busy
      ev('ncclDevKernel_AllReduce_Sum_f32_RING_LL', 150_000, 300_000),
      ev('all-gather-start.2', 500_000, 20_000),
      ev('PjitFunction(step)', 0, 900_000, pid=2),                                 # host side: not device
  ])
  assert dt.find_trace(str(tmp_path)) == path
  ops = dt.device_ops(path)
  assert len(ops) == 4
  assert dt.split(ops) == {'compute': 0.15, 'collective': 0.32}


def test_the_sampler_reads_a_real_cpu_trace(tmp_path):
  sampler = dt.DeviceSampler(every=3, directory=str(tmp_path / 'trace'))
  f = jax.jit(lambda x: jnp.tanh(x @ x) @ x)
  x = f(jnp.ones((512, 512)))
  # Half a period off the multiples of `every`, where checkpoints fall, and
  # never the first step of a run, fresh or resumed (its first execution).
  assert [s for s in range(1, 10) if sampler.due(s)] == [4, 7]
  resumed = dt.DeviceSampler(every=3, directory=str(tmp_path / 'trace'), start_step=3)
  assert [s for s in range(4, 14) if resumed.due(s)] == [7, 10, 13]
  sampler.before(3)
  sampler.wait(x)
  assert sampler.collect() is None                     # not a sampled step: nothing traced
  sampler.before(4, x)                                  # waits for x before tracing
  y = f(x)
  sampler.wait(y)
  got = sampler.collect()
  assert got['compute'] > 0 and got['collective'] == 0.0, got
  assert not os.path.exists(tmp_path / 'trace')       # deleted once read
  sampler.before(7, profiling=True)                    # the user's own profile runs: skip
  assert not sampler.active


def test_a_loop_left_inside_a_sampled_step_stops_the_trace(tmp_path):
  sampler = dt.DeviceSampler(every=2, directory=str(tmp_path / 'trace'))
  with pytest.raises(ValueError):
    with sampler:
      sampler.before(3)
      assert sampler.active
      raise ValueError('a failed save, a NaN, a stop')
  assert not sampler.active and not os.path.exists(tmp_path / 'trace')
  jax.profiler.start_trace(str(tmp_path / 'next'))     # the next trace of this process can start
  jax.profiler.stop_trace()


def test_a_single_process_job_does_not_sample(tmp_path):
  assert dt.DeviceSampler.for_run(5, 0).every == 0   # one process of CPU devices: no ranks to tell apart


def test_a_new_run_removes_the_traces_of_killed_processes(tmp_path, monkeypatch):
  """A trainer killed inside a sampled step leaves its trace in the host's
  temporary directory, under its own pid: each restart's start removes
  those whose process is gone, and only those."""
  import subprocess
  import sys
  import tempfile
  dead = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True,
                        text=True, check=True)
  live = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
  try:
    names = [f'mjax-device-trace-{dead.stdout.strip()}-00001', f'mjax-device-trace-{live.pid}-00000',
             f'mjax-device-trace-{os.getpid()}-00003', 'mjax-device-trace-notes', 'other']
    for name in names:
      (tmp_path / name / 'plugins').mkdir(parents=True)
    monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))
    sampler = dt.DeviceSampler.for_run(5, 2)
    assert sorted(os.listdir(tmp_path)) == sorted(names[1:])
    assert sampler.directory == str(tmp_path / f'mjax-device-trace-{os.getpid()}-00002')
  finally:
    live.kill()
    live.wait()


def test_ranks_are_processes_or_the_gpus_of_one():
  assert dt.DeviceSampler.has_ranks(2, 1, 'cpu') and dt.DeviceSampler.has_ranks(1, 8, 'gpu')
  assert not dt.DeviceSampler.has_ranks(1, 8, 'cpu') and not dt.DeviceSampler.has_ranks(1, 1, 'gpu')


def _device_trace(tmp_path, per_device, lines, kernel_line):
  """A trace as jax.profiler writes one: a process per device plane, a
  thread per line. Each device computes `compute_ms` then waits `wait_ms`
  in an all-reduce; its kernel events are on `kernel_line`; the other
  `lines` hold events that are not kernel time (the program's span, CUPTI's
  counters)."""
  meta, events = [{'ph': 'M', 'name': 'process_name', 'pid': 0, 'args': {'name': '/host:CPU'}}], []
  for d, (compute_ms, wait_ms) in per_device.items():
    pid = 10 + d
    meta.append({'ph': 'M', 'name': 'process_name', 'pid': pid,
                 'args': {'name': f'/device:{"TPU" if kernel_line == "XLA Ops" else "GPU"}:{d}'}})
    for tid, line in enumerate([kernel_line, *lines], 1):
      meta.append({'ph': 'M', 'name': 'thread_name', 'pid': pid, 'tid': tid, 'args': {'name': line}})
    ev = lambda name, tid, ts, dur: {'ph': 'X', 'name': name, 'pid': pid, 'tid': tid, 'ts': ts, 'dur': dur}
    c, w = compute_ms * 1000, wait_ms * 1000
    if c:
      events += [ev('gemm_fusion', 1, 0, c), ev('ncclDevKernel_AllReduce_Sum_f32_RING_LL', 1, c, w)]
    events += [ev(f'{line} event', tid, 0, c + w) for tid, line in enumerate(lines, 2)]
  events.append({'ph': 'X', 'name': 'PjitFunction(step)', 'pid': 0, 'tid': 1, 'ts': 0, 'dur': 900_000})
  path = tmp_path / f'{len(per_device)}.perfetto_trace.json.gz'
  with gzip.open(path, 'wt') as fh:
    json.dump({'traceEvents': meta + events}, fh)
  return str(path)


@pytest.mark.parametrize('kernel_line, lines', [
    ('Stream #14(Kernel,MemcpyH2D)', ['_counters_', 'CUPTI overhead']),    # GPU
    ('XLA Ops', ['XLA Modules', 'Steps'])])                                  # TPU
def test_each_device_of_a_process_is_split_from_its_kernels(tmp_path, kernel_line, lines):
  # Device 1 computes 300 ms where the others compute 200 and wait 100 for
  # it; device 3 shows only counters (no kernels in this step).
  path = _device_trace(tmp_path, {0: (200, 110), 1: (300, 10), 2: (200, 105), 3: (0, 0)}, lines, kernel_line)
  streams = dt.device_streams(path)
  assert sorted(streams) == [0, 1, 2]
  # The kernels alone: neither the program's span nor the counters.
  assert {e['name'] for e in streams[1]} == {'gemm_fusion', 'ncclDevKernel_AllReduce_Sum_f32_RING_LL'}
  got = dt.split_devices(streams, stages={0: 0, 1: 0, 2: 1})
  assert got['compute'] == 0.3 and got['collective'] == 0.01 and got['stage'] == 0   # its slowest device
  assert got['devices'] == {'0': {'compute': 0.2, 'collective': 0.11, 'stage': 0},
                            '1': {'compute': 0.3, 'collective': 0.01, 'stage': 0},
                            '2': {'compute': 0.2, 'collective': 0.105, 'stage': 1}}
  # One GPU: its split alone, as a single device process always had.
  assert dt.split_devices(dt.device_streams(_device_trace(tmp_path, {0: (200, 50)}, lines, kernel_line))) == {
      'compute': 0.2, 'collective': 0.05}


def test_pipeline_stages_of_the_local_devices():
  from mjax.config import MeshConfig
  from mjax.parallel.mesh import make_mesh
  assert dt.local_stages(make_mesh(MeshConfig(data=8))) is None
  stages = dt.local_stages(make_mesh(MeshConfig(data=2, pipeline=4)))
  assert sorted(stages.values()) == [0, 0, 1, 1, 2, 2, 3, 3] and len(stages) == 8
