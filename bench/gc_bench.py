"""What Python's garbage collector costs a training process, with and without mjax's control.

  python bench/gc_bench.py --gin_file configs/tiny.gin [--steps 200] [--gc_every 50]

Trains in this process (TrainConfig.gc_every_steps = --gc_every), reads the
loop's collections from the timing rows (phase 'gc'), and then, on the heap
the run left (everything a trained process holds: jax, flax, orbax, the
compiled programs), times one full collection as Python's automatic
collector would run it, and one with that heap frozen as the loop has it
(mjax/ft/gc_control.py). A full collection's pause is per process and, left
to Python, at a moment of each process's own: every other process waits
for it at the next collective.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mjax import flags  # noqa: E402
from mjax import trainer  # noqa: E402


def _full_collection_s(n: int = 3) -> float:
  times = []
  for _ in range(n):
    t0 = time.perf_counter()
    gc.collect()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main(argv=None) -> int:
  p = argparse.ArgumentParser('gc_bench', description=__doc__.splitlines()[0])
  p.add_argument('--gin_file', action='append', default=[])
  p.add_argument('--gin_param', action='append', default=[])
  p.add_argument('--steps', type=int, default=200)
  p.add_argument('--gc_every', type=int, default=50)
  args, bindings = flags.parse(p, sys.argv[1:] if argv is None else argv)
  cfg = flags.load(flags.gin_files(args), [
      *bindings, 'MeshConfig.data = 1', f'TrainConfig.steps = {args.steps}', 'TrainConfig.eval_every = 0',
      'TrainConfig.progress = False', 'CheckpointConfig.enabled = False', 'FaultConfig.timing_every = 1',
      f'TrainConfig.gc_every_steps = {args.gc_every}'], num_devices=1)
  with tempfile.TemporaryDirectory() as workdir:
    t = trainer.Trainer(cfg, workdir)
    summary = t.train()
    with open(os.path.join(workdir, 'timings', 'process-00000.jsonl')) as fh:
      rows = [json.loads(line) for line in fh]
    loop = [r['phases']['gc'] for r in rows if 'gc' in r['phases']]
    step = statistics.median(r['phases'].get('compute', 0) + r['phases'].get('data', 0) for r in rows)
    objects = len(gc.get_objects())
    automatic = _full_collection_s()
    gc.freeze()
    frozen = _full_collection_s()
    gc.unfreeze()
  print(f'\ngc bench: {cfg.model.d_model} d_model, {cfg.model.n_layers} layers, {args.steps} steps, '
        f'median step {step * 1e3:.1f} ms, {summary.tokens_per_sec:,.0f} tokens/s; '
        f'{objects:,} objects tracked after the run\n')
  print('| full collection | ms | in step times |')
  print('|---|---|---|')
  print(f'| as Python\'s automatic collector runs it (the whole heap) | {automatic * 1e3:.1f} | {automatic / step:.2f} |')
  print(f'| with start-up\'s objects frozen (what the loop runs) | {frozen * 1e3:.2f} | {frozen / step:.3f} |')
  if loop:
    print(f'| the loop\'s own, every {args.gc_every} steps ({len(loop)}; median / max) | '
          f'{statistics.median(loop) * 1e3:.2f} / {max(loop) * 1e3:.2f} | {statistics.median(loop) / step:.3f} |')
  return 0


if __name__ == '__main__':
  sys.exit(main())
