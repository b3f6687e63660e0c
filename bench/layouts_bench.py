"""Tokens/s and MFU of every 3D layout on the same devices, side by side.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/layouts_bench.py --gin_file configs/tiny.gin

Each layout trains the same model on the same data; the last column is the
step time relative to pure data parallelism measured in the same run. On fake
CPU devices this measures the overhead each layout adds (collectives,
pipeline bubbles, resharding), not a speed-up: the 8 devices share the cores.
"""

from __future__ import annotations

import sys

import jax

sys.path.insert(0, __file__.rsplit('/', 1)[0])
from train_bench import bench  # noqa: E402

from mjax import flags  # noqa: E402

LAYOUTS = {
    'data=8': ['MeshConfig.data = 8'],
    'fsdp=8': ['MeshConfig.data = 1', 'MeshConfig.fsdp = 8'],
    'data=2 fsdp=2 tensor=2': ['MeshConfig.data = 2', 'MeshConfig.fsdp = 2', 'MeshConfig.tensor = 2'],
    'fsdp=4 tensor=2 +SP': ['MeshConfig.data = 1', 'MeshConfig.fsdp = 4', 'MeshConfig.tensor = 2',
                            'MeshConfig.sequence_parallel = True'],
    'data=4 pipeline=2 v=2 m=4': ['MeshConfig.data = 4', 'MeshConfig.pipeline = 2',
                                  'MeshConfig.virtual_stages = 2', 'MeshConfig.microbatches = 4'],
    'data=2 pipeline=4 v=2 m=4': ['MeshConfig.data = 2', 'MeshConfig.pipeline = 4',
                                  'MeshConfig.virtual_stages = 2', 'MeshConfig.microbatches = 4'],
    'data=2 pipeline=2 tensor=2 v=2 m=4': ['MeshConfig.data = 2', 'MeshConfig.pipeline = 2',
                                           'MeshConfig.tensor = 2', 'MeshConfig.virtual_stages = 2',
                                           'MeshConfig.microbatches = 4'],
}
# Eight single-layer groups and 16 sequences, so that every layout divides.
MODEL = ['ModelConfig.n_layers = 8', 'ModelConfig.full_attention_every = 0',
         'TrainConfig.global_batch_size = 16']


def main(argv=None):
  p = flags.parser('layouts_bench', __doc__.splitlines()[0])
  p.add_argument('--steps', type=flags.whole_number(), default=10)
  p.add_argument('--warmup', type=flags.whole_number(0), default=2)
  args, bindings = flags.parse(p, sys.argv[1:] if argv is None else argv)
  print('| layout | tokens/s | step time (s) | MFU | step time vs data=8 |\n|---|---|---|---|---|')
  base = None
  for name, layout in LAYOUTS.items():
    cfg = flags.load(flags.gin_files(args), [*MODEL, *bindings, *layout,
                                             f'TrainConfig.steps = {args.steps + args.warmup}'],
                     num_devices=jax.device_count())
    r = bench(cfg, args.steps, args.warmup)
    base = base or r['step_time']
    print(f'| {name} | {r["tokens_per_sec"]:,.0f} | {r["step_time"]:.3f} | {r["mfu"]:.1%} | '
          f'{r["step_time"] / base:.2f}x |', flush=True)


if __name__ == '__main__':
  # A bad config is one paragraph and exit status 2, not a traceback.
  from mjax import cli
  cli.entry_point('layouts_bench')(main)()
