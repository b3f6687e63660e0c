"""Device time of a sampled step, compute and collectives apart
(mjax/ft/device_time.py): on a synthetic trace, on a real CPU trace, and in
a real 2-process job where one rank is slowed inside the step."""

import gzip
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from mjax.ft import device_time as dt
from mjax.ft import stragglers as st

PY = sys.executable
BIN = os.path.dirname(sys.executable)


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
  # Half a period off the multiples of `every`, where checkpoints fall.
  assert [s for s in range(1, 10) if sampler.due(s)] == [1, 4, 7]
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
      sampler.before(1)
      assert sampler.active
      raise ValueError('a failed save, a NaN, a stop')
  assert not sampler.active and not os.path.exists(tmp_path / 'trace')
  jax.profiler.start_trace(str(tmp_path / 'next'))     # the next trace of this process can start
  jax.profiler.stop_trace()


def test_a_single_process_job_does_not_sample(tmp_path):
  assert dt.DeviceSampler.for_run(5, 0).every == 0


@pytest.mark.slow
def test_a_throttled_rank_in_a_real_job_is_named(tmp_path, repo_root):
  # Two processes of one device each; process 1 is stopped 40% of the time
  # from step 3 on (SIGSTOP cycles of 0.1 s, as a throttled device would be
  # slow inside the step). Its host timings match the others' (the
  # collective releases both together); its sampled device compute does not.
  workdir = str(tmp_path / 'run')
  env = {k: v for k, v in os.environ.items() if not k.startswith(('MJAX_', 'SLURM_', 'XLA_FLAGS'))}
  env.update(JAX_PLATFORMS='cpu', MJAX_FAULT='throttle:factor=0.4:process=1:step=3')
  cmd = [PY, 'launch/local.py', '--processes', '2', '--devices', '1', '--',
         os.path.join(BIN, 'mjax-train'), '--gin_file', 'configs/tiny.gin', '--workdir', workdir,
         '--gin.ModelConfig.d_model=256', '--gin.ModelConfig.n_layers=2', '--gin.ModelConfig.full_attention_every=0',
         '--gin.ModelConfig.sliding_window=16', '--gin.DataConfig.seq_len=128', '--gin.ModelConfig.dtype=float32',
         '--gin.MeshConfig.data=2', '--gin.TrainConfig.steps=30', '--gin.TrainConfig.eval_every=0',
         '--gin.TrainConfig.eval_batches=1', '--gin.TrainConfig.progress=False',
         '--gin.TrainConfig.compilation_cache_dir=None', '--gin.CheckpointConfig.save_every=0',
         '--gin.FaultConfig.device_timing_every=5']
  run = subprocess.run(cmd, env=env, cwd=repo_root, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  rows = st.load_rows(workdir)
  sampled = sorted({r['step'] for r in rows if 'device' in r})
  assert sampled == [2, 7, 12, 17, 22, 27], sampled     # half a period off the round steps
  found = st.device_stragglers(rows)
  assert [s.process for s in found] == [1], [s.describe() for s in found]
  assert found[0].ratio > 1.2
  report = subprocess.run([os.path.join(BIN, 'mjax-report'), 'stragglers', workdir, '--out', str(tmp_path / 'r')],
                          env=env, cwd=repo_root, capture_output=True, text=True, timeout=120)
  assert report.returncode == 0, report.stderr
  assert 'process 1' in report.stdout and 'wait' in report.stdout and 'inside the step' in report.stdout
