"""Peak memory of the pipeline schedules, from the compiled train step.

  python bench/pipeline_memory.py                       # p=4, v=2; m = 8, 16, 32
  python bench/pipeline_memory.py --microbatches 8 --remat none dots full

Compiles the real train step (mjax.train.make_program, nothing run) on 8
CPU devices, data 2 x pipeline 4 with 2 virtual stages, for the circular
schedule (every forward, then the backward by autodiff) and the interleaved
1F1B schedule (MeshConfig.pipeline_schedule), at a fixed micro-batch size and
a growing micro-batch count m, and prints XLA's own per-device figures
(`Compiled.memory_analysis()`): temporaries (activations, gradients in
flight, buffers) and the total. The state itself (params, LAMB moments) is
the same under both schedules and sits in the arguments.

The model: 8 layers (4 stages x 2 virtual stages of 1 layer), d_model 256,
seq 256, 2 sequences per micro-batch per data shard, fp32 compute.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = ['ModelConfig.d_model = 256', 'ModelConfig.n_layers = 8', 'ModelConfig.d_ff = 1024',
         'ModelConfig.n_heads = 4', 'ModelConfig.full_attention_every = 0', 'ModelConfig.sliding_window = 64',
         'ModelConfig.dtype = "float32"', 'DataConfig.seq_len = 256', 'TrainConfig.progress = False',
         'MeshConfig.data = 2', 'MeshConfig.pipeline = 4', 'MeshConfig.virtual_stages = 2']
MICRO_BATCH = 4   # sequences per micro-batch (2 per data shard)


def measure(schedule: str, m: int, remat: str, steps: int = 0) -> dict:
  import jax
  from mjax import config as C
  from mjax.parallel import make_mesh
  from mjax.parallel.comm_report import memory_stats
  from mjax.train import make_program
  cfg = C.load_config(['tiny.gin'], [*MODEL, f'MeshConfig.microbatches = {m}',
                                     f'TrainConfig.global_batch_size = {m * MICRO_BATCH}',
                                     f'MeshConfig.pipeline_schedule = "{schedule}"',
                                     f'ModelConfig.remat_policy = "{remat}"'], num_devices=8)
  program = make_program(cfg, make_mesh(cfg.mesh))
  t0 = time.perf_counter()
  with program.context():
    compiled = program.step.lower(program.abstract_state(), program.abstract_batch()).compile()
  stats = memory_stats(compiled) or {}
  out = {'temp': stats.get('temp_size_in_bytes', 0), 'total': stats.get('total', 0),
         'compile_s': time.perf_counter() - t0, 'step_s': None}
  if steps:
    from mjax import data as data_lib
    it = data_lib.make_train_iterator(cfg.data, cfg.train.global_batch_size)
    with program.context():
      state = program.init(jax.random.key(0))
      times = []
      for _ in range(steps + 1):   # the first one warms up
        batch = program.to_global(next(it))
        t0 = time.perf_counter()
        state, metrics = program.step(state, batch)
        jax.block_until_ready(metrics['loss'])
        times.append(time.perf_counter() - t0)
    out['step_s'] = sorted(times[1:])[len(times[1:]) // 2]
  return out


def main(argv=None) -> None:
  p = argparse.ArgumentParser('pipeline_memory', description=__doc__.splitlines()[0])
  p.add_argument('--microbatches', type=int, nargs='*', default=[8, 16, 32])
  p.add_argument('--remat', nargs='*', default=['none', 'full'])
  p.add_argument('--steps', type=int, default=0, help='also time this many steps of each (median)')
  args = p.parse_args(argv)
  import jax
  from mjax.parallel import pipeline
  jax.config.update('jax_enable_compilation_cache', False)
  print(f'p = 4 stages x v = 2 virtual, {MICRO_BATCH} sequences x 256 tokens per micro-batch, d_model 256, '
        f'8 layers, fp32; per-device figures of the compiled step on {jax.device_count()} CPU devices\n')
  timed = ' | circular step | 1F1B step | 1F1B / circular' if args.steps else ''
  print('| remat | m | circular temp | 1F1B temp | 1F1B / circular | circular total | 1F1B total '
        f'| 1F1B stage inputs kept (bound){timed} |\n|' + '---|' * (8 + 3 * bool(args.steps)), flush=True)
  for remat in args.remat:
    for m in args.microbatches:
      c, f = measure('circular', m, remat, args.steps), measure('1f1b', m, remat, args.steps)
      times = (f' | {c["step_s"] * 1e3:,.0f} ms | {f["step_s"] * 1e3:,.0f} ms | {f["step_s"] / c["step_s"]:.2f}'
               if args.steps else '')
      print(f'| {remat} | {m} | {c["temp"] / 2**20:,.1f} MiB | {f["temp"] / 2**20:,.1f} MiB | '
            f'{f["temp"] / max(1, c["temp"]):.2f} | {c["total"] / 2**20:,.1f} MiB | {f["total"] / 2**20:,.1f} MiB | '
            f'{pipeline.in_flight_bound(4, 2)} of {m * 2} items{times} |', flush=True)


if __name__ == '__main__':
  main()
