"""Every layout's collectives against `mjax-report comm`'s minimum, with the
options that change them, compiled for 8 GPUs without a GPU.

  PYTHONPATH=.venv/cuda-aot python bench/comm_minimum.py                  # every layout x variant
  PYTHONPATH=.venv/cuda-aot python bench/comm_minimum.py --layouts f4t2sp --variants '' untied

Compiles the train step of `--gin_file` (default: 1p3b at 4 layers, 16 x 512
tokens, window 256, its unrolled layers and remat) for `--target` with the
real GPU compiler (mjax.parallel.gpu_target: the CUDA plugin that `make
test` installs into .venv/cuda-aot), once per layout and variant, and prints
one table: wire MiB per device and step by collective kind, measured in the
compiled program and as the report's analytical minimum, and their ratio.
A ratio above 1 is traffic the minimum does not need (or that the minimum
does not model: pipeline stages' shifts, for one); a config the layout
refuses prints its error. Nothing runs: these are programs, not timings.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KINDS = ('all-reduce', 'all-gather', 'reduce-scatter', 'collective-permute', 'all-to-all')
MODEL = ['DataConfig.seq_len = 512', 'ModelConfig.sliding_window = 256', 'ModelConfig.n_layers = 4',
         'TrainConfig.global_batch_size = 16', 'TrainConfig.progress = False']
_PIPELINE = ['ModelConfig.scan_layers = True']   # pipelining needs scanned layers
LAYOUTS = {
    'd8': ['MeshConfig.data = 8', 'MeshConfig.fsdp = 1'],
    'f8': ['MeshConfig.data = 1', 'MeshConfig.fsdp = 8'],
    'd2f4': ['MeshConfig.data = 2', 'MeshConfig.fsdp = 4'],
    'd4t2': ['MeshConfig.data = 4', 'MeshConfig.fsdp = 1', 'MeshConfig.tensor = 2'],
    'd2f2t2': ['MeshConfig.data = 2', 'MeshConfig.fsdp = 2', 'MeshConfig.tensor = 2'],
    'f4t2sp': ['MeshConfig.data = 1', 'MeshConfig.fsdp = 4', 'MeshConfig.tensor = 2',
               'MeshConfig.sequence_parallel = True'],
    'f4t2spcm': ['MeshConfig.data = 1', 'MeshConfig.fsdp = 4', 'MeshConfig.tensor = 2',
                 'MeshConfig.sequence_parallel = True', 'MeshConfig.collective_matmul = True'],
    'd2p4': ['MeshConfig.data = 2', 'MeshConfig.fsdp = 1', 'MeshConfig.pipeline = 4', 'MeshConfig.microbatches = 4',
             *_PIPELINE],
    'd2p4_1f1b': ['MeshConfig.data = 2', 'MeshConfig.fsdp = 1', 'MeshConfig.pipeline = 4',
                  'MeshConfig.microbatches = 4', 'MeshConfig.pipeline_schedule = "1f1b"', *_PIPELINE],
    'f2t2p2': ['MeshConfig.data = 1', 'MeshConfig.fsdp = 2', 'MeshConfig.tensor = 2', 'MeshConfig.pipeline = 2',
               'MeshConfig.microbatches = 2', *_PIPELINE],
    'f2t2p2_1f1b': ['MeshConfig.data = 1', 'MeshConfig.fsdp = 2', 'MeshConfig.tensor = 2', 'MeshConfig.pipeline = 2',
                    'MeshConfig.microbatches = 2', 'MeshConfig.pipeline_schedule = "1f1b"', *_PIPELINE],
}
VARIANTS = {
    '': [],
    'accumulation 2': ['TrainConfig.grad_accum_steps = 2'],
    'untied': ['ModelConfig.tie_embeddings = False'],
    'swiglu rmsnorm': ['ModelConfig.mlp = "swiglu"', 'ModelConfig.norm = "rmsnorm"', 'ModelConfig.gelu_epilogue = False'],
    'remat dots_attention_mlp': ["ModelConfig.remat_policy = 'dots_attention_mlp'"],
    'remat full': ["ModelConfig.remat_policy = 'full'"],
    'scanned': ['ModelConfig.scan_layers = True'],
    # FSDP's weights gathered once a step, gradients reduce-scattered once.
    'gather once': ['MeshConfig.fsdp_gather = "step"'],
    'gather once, accumulation 2': ['MeshConfig.fsdp_gather = "step"', 'TrainConfig.grad_accum_steps = 2'],
}


def bindings(layout: str, variant: str) -> list[str]:
  return [*MODEL, *LAYOUTS[layout], *VARIANTS[variant]]


def measure(gin_file: str, layout: str, variant: str, target_spec: str) -> dict:
  """{kind: (measured, minimum) wire MiB} and the compile's seconds, or
  {'error': text} for a config the layout refuses or a program that does not
  compile."""
  from mjax import flags
  from mjax.config import ConfigError
  from mjax.parallel import gpu_target
  from mjax.parallel.comm_report import collective_stats, expected_traffic
  target = gpu_target.parse_target(target_spec)
  try:
    cfg = flags.load([gin_file], bindings(layout, variant), num_devices=target.devices)
  except ConfigError as e:
    return {'error': str(e).splitlines()[0]}
  try:
    out = gpu_target.compile_step(cfg, target)
  except Exception as e:  # a program the GPU compiler rejects is a finding, not the end of the table
    return {'error': f'the GPU compiler failed: {type(e).__name__}: {str(e).splitlines()[0]}'}
  mesh = dict(out.mesh.shape)
  stats = collective_stats(out.compiled.as_text())
  minimum: dict[str, float] = {}
  for e in expected_traffic(out.cfg, mesh):
    minimum[e.kind] = minimum.get(e.kind, 0.0) + e.wire_bytes
  return {'kinds': {k: (stats.per_step(k)['wire'] / 2**20, minimum.get(k, 0.0) / 2**20) for k in KINDS},
          'seconds': out.seconds}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--gin_file', default='configs/1p3b.gin')
  p.add_argument('--layouts', nargs='+', default=list(LAYOUTS), choices=list(LAYOUTS))
  p.add_argument('--variants', nargs='+', default=list(VARIANTS), choices=list(VARIANTS))
  p.add_argument('--target', default='h100:8')
  args = p.parse_args()
  import jax
  from mjax.parallel import gpu_target
  gpu_target.keep_local_backend_cpu()
  print(f'# {time.strftime("%Y-%m-%d")}, {args.gin_file} ({", ".join(MODEL[:4])}) compiled for {args.target} '
        f'(jax {jax.__version__}); nothing run. Cells: measured / minimum wire MiB per device and step\n')
  print('| layout | variant | ' + ' | '.join(KINDS) + ' | total | ratio |')
  print('|---|---|' + '---|' * (len(KINDS) + 2))
  for layout in args.layouts:
    for variant in args.variants:
      r = measure(args.gin_file, layout, variant, args.target)
      if 'error' in r:
        print(f'| {layout} | {variant or "-"} | {r["error"][:160]} |', flush=True)
        continue
      cells = [f'{m:,.1f} / {e:,.1f}' if m or e else '' for m, e in r['kinds'].values()]
      total_m = sum(m for m, _ in r['kinds'].values())
      total_e = sum(e for _, e in r['kinds'].values())
      ratio = f'{total_m / total_e:.2f}' if total_e else '-'
      print(f'| {layout} | {variant or "-"} | ' + ' | '.join(cells)
            + f' | {total_m:,.1f} / {total_e:,.1f} | {ratio} |', flush=True)


if __name__ == '__main__':
  main()
