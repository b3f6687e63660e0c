"""Start-up time of a multi-process job: launch to the first completed step.

  python bench/startup_bench.py --processes 1,2,4,8
  python bench/startup_bench.py --processes 2 -- --gin.ModelConfig.n_layers=2

For each process count N, starts `mjax-train --gin_file configs/tiny.gin` as
N local processes of one fake CPU device each (a data=N mesh, as
launch/local.py does) twice: with an empty persistent compilation cache
(cold) and again with the same cache directory (warm, as after a restart).
Every run trains one step, without evaluation or checkpoints, in a fresh
workdir. The split comes from the `mjax: startup {json}` line of process 0:

  launch      MJAX_LAUNCH_TIME -> first step done (launch_to_first_step_s)
  before run  interpreter start, imports, config: launch - run - dist. init
  dist. init  jax.distributed.initialize (distributed_init_s; 0 for N = 1)
  compile     lowering + compiling the train step (compile_s), or loading
              it from the persistent cache
  wait        the barrier after compiling: process 0 waiting for the
              slowest process's compile (compile_wait_s)
  rest        the rest of the Trainer: mesh, program, state, data, the step

On CPU only process 0 can hit the persistent cache (mjax/distributed.py
explains why): in a warm job of more than one process, process 0 loads its
step and then waits for the others, which compile in full.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mjax import flags  # noqa: E402
from mjax import launch  # noqa: E402

HEADER = ('| processes x devices | cache | launch to first step (s) | before run (s) | dist. init (s) '
          '| compile (s) | wait (s) | rest (s) |\n|---|---|---|---|---|---|---|---|')


def run_once(processes: int, cache_dir: str, workdir: str, extra: list[str], timeout: float) -> dict:
  """One job; returns process 0's start-up report."""
  argv = [os.path.join(os.path.dirname(sys.executable), 'mjax-train'), '--gin_file', 'configs/tiny.gin',
          '--workdir', workdir, '--gin.TrainConfig.steps=1', f'--gin.MeshConfig.data={processes}',
          '--gin.TrainConfig.eval_every=0', '--gin.TrainConfig.eval_batches=1',
          '--gin.TrainConfig.progress=False', '--gin.CheckpointConfig.enabled=False',
          f'--gin.TrainConfig.compilation_cache_dir={cache_dir}', *extra]
  env = {k: v for k, v in os.environ.items() if not k.startswith('MJAX_')}
  procs = launch.spawn_local(processes, 1, argv, workdir=workdir, env=env)
  codes = launch.wait_all(procs, timeout=timeout)
  log = os.path.join(workdir, 'logs', 'process-0.log')
  text = open(log).read()
  if any(codes):
    raise RuntimeError(f'{processes} processes exited with {codes}; see {log}:\n{text[-2000:]}')
  line = next((l for l in text.splitlines() if l.startswith('mjax: startup ')), None)
  if line is None:
    raise RuntimeError(f'no start-up report in {log}')
  return json.loads(line[len('mjax: startup '):])


def row(processes: int, cache: str, r: dict) -> str:
  launch_s, run_s = r['launch_to_first_step_s'], r['run_to_first_step_s']
  init_s, compile_s, wait_s = r['distributed_init_s'], r['compile_s'], r.get('compile_wait_s', 0.0)
  return (f'| {processes} x 1 | {cache} | {launch_s:.1f} | {launch_s - run_s - init_s:.1f} | {init_s:.2f} '
          f'| {compile_s:.1f} | {wait_s:.1f} | {run_s - compile_s - wait_s:.1f} |')


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--processes', default='1,2,4,8', help='comma-separated process counts')
  p.add_argument('--timeout', type=flags.positive_float, default=600, help='seconds allowed per job')
  argv = sys.argv[1:]
  extra = argv[argv.index('--') + 1:] if '--' in argv else []
  args = p.parse_args(argv[:argv.index('--')] if '--' in argv else argv)
  try:
    counts = [flags.whole_number()(n.strip()) for n in args.processes.split(',')]
  except argparse.ArgumentTypeError as e:   # '1,x', '0', '2,,4': named here, not a traceback from a launch
    p.error(f'argument --processes {args.processes!r}: {e}; give comma-separated process counts, e.g. 1,2,4')
  print(f'# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, '
        f'load average {os.getloadavg()[0]:.1f} at start', file=sys.stderr)
  rows = []
  with tempfile.TemporaryDirectory(prefix='mjax-startup-') as tmp:
    for n in counts:
      cache = os.path.join(tmp, f'cache-{n}')
      for kind in ('cold', 'warm'):
        t0 = time.perf_counter()
        r = run_once(n, cache, os.path.join(tmp, f'run-{n}-{kind}'), extra, args.timeout)
        rows.append(row(n, kind, r))
        print(f'# {n} process(es), {kind}: {time.perf_counter() - t0:.0f}s wall, '
              f'load average {os.getloadavg()[0]:.1f}', file=sys.stderr, flush=True)
  print(HEADER)
  print('\n'.join(rows))


if __name__ == '__main__':
  main()
