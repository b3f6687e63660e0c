"""Training throughput and MFU of one config, as one markdown table row.

  python bench/train_bench.py --gin_file configs/tiny.gin --steps 20 --warmup 3
  python bench/train_bench.py --gin_file configs/1p3b.gin --gin.TrainConfig.global_batch_size=8

Runs `warmup` steps (compilation, allocator warm-up), then times `steps` steps
end to end, data loading included, syncing with the device only at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax

from mjax import cli
from mjax import data as data_lib
from mjax import train
from mjax import flags
from mjax.devices import peak_flops, peak_memory_bytes
from mjax.model.flops import flops_per_token
from mjax.parallel import make_mesh
from mjax.profiling import write_profile_steps

PROFILE_STEPS = 2

HEADER = ('| config | devices | tokens/s | step time (s) | FLOPs/token | achieved TFLOP/s '
          '| peak TFLOP/s (source) | MFU | peak memory |\n'
          '|---|---|---|---|---|---|---|---|---|')


def bench(cfg, steps: int, warmup: int, profile_dir: str = '') -> dict:
  mesh = make_mesh(cfg.mesh)
  devices = list(mesh.devices.flat)
  program = train.make_program(cfg, mesh)
  it = data_lib.make_train_iterator(cfg.data, cfg.train.global_batch_size,
                                    process_index=jax.process_index(),
                                    process_count=jax.process_count())
  with program.context():
    state = program.init(jax.random.key(cfg.train.seed))
    for _ in range(warmup):
      state, m = program.step(state, program.to_global(next(it)))
      jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(steps):
      state, m = program.step(state, program.to_global(next(it)))
    jax.block_until_ready((state, m))
    dt = (time.perf_counter() - t0) / steps
    if profile_dir:  # after the timing, so the profiler's overhead is not in it
      # The program the trace runs, for trace_summary's parts of the step.
      os.makedirs(profile_dir, exist_ok=True)
      with open(os.path.join(profile_dir, 'train_step.hlo.txt'), 'w') as fh:
        fh.write(program.step.lower(program.abstract_state(), program.abstract_batch()).compile().as_text())
      with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
        for _ in range(PROFILE_STEPS):
          state, m = program.step(state, program.to_global(next(it)))
        jax.block_until_ready((state, m))
      write_profile_steps(profile_dir, PROFILE_STEPS)
  fpt = flops_per_token(cfg.model, cfg.data.seq_len)
  # Megatron-LM's count, which MegaScale's and most peers' tables use: every
  # key of the context, masked or not. For comparison only; mjax's MFU is
  # `fpt`'s, which a causal mask or a sliding window cannot inflate.
  fpt_dense = flops_per_token(cfg.model, cfg.data.seq_len, dense_attention=True)
  peak, source = peak_flops(devices, cfg.model.dtype, cfg.train.peak_cache_dir)
  tps = cfg.train.global_batch_size * cfg.data.seq_len / dt
  mem, mem_source = peak_memory_bytes(devices)
  return dict(batch=cfg.train.global_batch_size, seq_len=cfg.data.seq_len,
              devices=f'{len(devices)} x {devices[0].device_kind}', tokens_per_sec=tps, step_time=dt,
              flops_per_token=fpt, achieved=fpt * tps, peak=peak, peak_source=source,
              mfu=fpt * tps / peak, mfu_dense_attention=fpt_dense * tps / peak, mem=mem,
              mem_source=mem_source, loss=float(m['loss']))


def row(name: str, r: dict) -> str:
  return (f'| {name} | {r["devices"]} | {r["tokens_per_sec"]:,.0f} | {r["step_time"]:.3f} | '
          f'{r["flops_per_token"] / 1e6:,.1f} M | {r["achieved"] / 1e12:.3f} | '
          f'{r["peak"] / 1e12:.3f} ({r["peak_source"].split(":")[0]}) | {r["mfu"]:.1%} | '
          f'{r["mem"] / 2**30:.2f} GiB ({r["mem_source"]}) |')


def main(argv=None):
  p = flags.parser('train_bench', __doc__.splitlines()[0])
  p.add_argument('--steps', type=flags.whole_number(), default=20, help='timed steps')
  p.add_argument('--warmup', type=flags.whole_number(0), default=3,
                 help='untimed steps first (compilation included)')
  p.add_argument('--name', default=None, help='label in the table (default: the gin file)')
  p.add_argument('--json', default=None, help='also write the result as JSON to this file')
  p.add_argument('--profile', default='', help='trace 2 more steps into this folder '
                 '(perfetto_trace.json.gz; summarize with bench/trace_summary.py)')
  args, bindings = flags.parse(p, sys.argv[1:] if argv is None else argv)
  bindings = [*bindings, f'TrainConfig.steps = {args.steps + args.warmup}']
  cfg = flags.setup(flags.gin_files(args), bindings, join=False)
  train.setup_compilation_cache(cfg.train.compilation_cache_dir)
  r = bench(cfg, args.steps, args.warmup, args.profile)
  name = args.name or ' + '.join(os.path.basename(f) for f in flags.gin_files(args))
  print(HEADER)
  print(row(name, r))
  print(f'\npeak source: {r["peak_source"]}; jax {jax.__version__}; loss after the run {r["loss"]:.3f}')
  if args.json:
    with open(args.json, 'w') as fh:
      json.dump({'name': name, 'jax': jax.__version__, **r}, fh, indent=1)


if __name__ == '__main__':
  # A bad config (a gin file that is not there, a key no config has) is one
  # paragraph and exit status 2, as from mjax-train, not a traceback.
  cli.entry_point('train_bench')(main)()
