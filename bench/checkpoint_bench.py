"""How long a save blocks the training loop, async versus synchronous.

  python bench/checkpoint_bench.py --gin_file configs/tiny.gin \
      --gin.ModelConfig.d_model=1024 --gin.ModelConfig.n_layers=4 --gin.ModelConfig.d_ff=4096

Builds the real (sharded) train state of the config, then for each mode saves
it `--repeats` times into a fresh directory and reports the median of:
  blocked   time the training loop waits in `Checkpointer.save`
  durable   time until the checkpoint is complete on disk
  restore   time to read it back onto the devices
The async target is blocked < 5% of the synchronous save.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import time

import jax
import numpy as np

from mjax import flags, train
from mjax.checkpoint import Checkpointer
from mjax.parallel import make_mesh


def measure(cfg, program, state, directory: str, async_save: bool, repeats: int) -> dict:
  # `directory` as a run's workdir, the steps in its checkpoints/ (a tier may
  # not be the workdir itself).
  ck_cfg = dataclasses.replace(cfg.checkpoint, directory=os.path.join(directory, 'checkpoints'),
                               async_save=async_save, keep=repeats + 1, fast_every=0)
  ck = Checkpointer(ck_cfg, directory)
  blocked, durable, restore = [], [], []
  for i in range(1, repeats + 1):
    t0 = time.perf_counter()
    ck.save(i, state, {'next_index': i}, {}, force=True)
    blocked.append(time.perf_counter() - t0)
    ck.wait()
    durable.append(time.perf_counter() - t0)
  for _ in range(repeats):
    t0 = time.perf_counter()
    r = ck.restore_latest(program.abstract_state(canonical=True))
    jax.block_until_ready(r.state)
    restore.append(time.perf_counter() - t0)
  ck.close()
  return {k: float(np.median(v)) for k, v in
          (('blocked', blocked), ('durable', durable), ('restore', restore))}


def main(argv=None):
  p = flags.parser('checkpoint_bench', __doc__.splitlines()[0])
  p.add_argument('--repeats', type=flags.whole_number(), default=3)
  p.add_argument('--dir', default=None, help='where to write (default: a temporary directory)')
  args, bindings = flags.parse(p, sys.argv[1:] if argv is None else argv)
  cfg = flags.load(flags.gin_files(args), bindings, num_devices=jax.device_count())
  program = train.make_program(cfg, make_mesh(cfg.mesh))
  with program.context():
    state = program.init(jax.random.key(0))
  nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  base = args.dir or tempfile.mkdtemp(prefix='mjax-ckpt-bench-')
  rows = {}
  for mode, flag in (('synchronous', False), ('async', True)):
    d = os.path.join(base, mode)
    shutil.rmtree(d, ignore_errors=True)
    rows[mode] = measure(cfg, program, state, d, flag, args.repeats)
  sync_blocked = rows['synchronous']['blocked']
  print(f'train state: {nbytes / 2**20:,.0f} MiB on {jax.device_count()} device(s); '
        f'directory {base}; median of {args.repeats}\n')
  print('| mode | loop blocked (s) | durable after (s) | restore (s) | blocked / synchronous save |')
  print('|---|---|---|---|---|')
  for mode, r in rows.items():
    print(f'| {mode} | {r["blocked"]:.3f} | {r["durable"]:.3f} | {r["restore"]:.3f} | '
          f'{r["blocked"] / sync_blocked:.1%} |')
  if not args.dir:
    shutil.rmtree(base, ignore_errors=True)


if __name__ == '__main__':
  # A bad config is one paragraph and exit status 2, not a traceback.
  from mjax import cli
  cli.entry_point('checkpoint_bench')(main)()
