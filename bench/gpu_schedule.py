"""What the GPU compiler does with each layout's collectives, without a GPU.

  PYTHONPATH=.venv/cuda-aot python bench/gpu_schedule.py              # every layout, overlap options on and off
  PYTHONPATH=.venv/cuda-aot python bench/gpu_schedule.py --layouts fsdp_1p3b --target h200:8

Compiles the real train step for 8 H100s (mjax.parallel.gpu_target: a
deviceless compile with the CUDA plugin, which `make test` installs into
.venv/cuda-aot) for each layout, once with the XLA options a GPU run of the
config sets (mjax.parallel.xla_flags: latency-hiding scheduler, pipelined
FSDP collectives, combining, collective matmul under tensor parallelism) and
once with none, and prints one table: per layout and collective kind, over
which mesh axes, how many of the scheduled collectives have compute between
start and done, how many have a matrix product there, how many are exposed,
and the wire bytes per device and step against the layout's analytical
minimum. Nothing runs: these are schedules, not timings.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Scanned layers and base.gin's remat policy, as these schedules were first
# measured (RESULTS.md), whatever 125m.gin / 1p3b.gin choose for one GPU:
# pipelining needs scanned layers.
_SCANNED = ['ModelConfig.scan_layers = True', "ModelConfig.remat_policy = 'dots_no_batch'"]
LAYOUTS = {
    # The README's FSDP example (as in RESULTS' CPU communication report).
    'fsdp_1p3b': ('1p3b.gin', [*_SCANNED, 'TrainConfig.global_batch_size = 8', 'DataConfig.seq_len = 512',
                               'ModelConfig.sliding_window = 256', 'MeshConfig.fsdp = 8', 'MeshConfig.data = 1']),
    'tensor_sp_125m': ('125m.gin', [*_SCANNED, 'MeshConfig.data = 2', 'MeshConfig.tensor = 4',
                                    'MeshConfig.sequence_parallel = True']),
    'tensor_sp_cm_125m': ('125m.gin', [*_SCANNED, 'MeshConfig.data = 2', 'MeshConfig.tensor = 4',
                                       'MeshConfig.sequence_parallel = True', 'MeshConfig.collective_matmul = True']),
    'pipeline_circular_125m': ('125m.gin', [*_SCANNED, 'ModelConfig.n_layers = 16', 'MeshConfig.data = 2',
                                            'MeshConfig.pipeline = 4', 'MeshConfig.virtual_stages = 2',
                                            'MeshConfig.microbatches = 8', 'DataConfig.seq_len = 1024']),
    'pipeline_1f1b_125m': ('125m.gin', [*_SCANNED, 'ModelConfig.n_layers = 16', 'MeshConfig.data = 2',
                                        'MeshConfig.pipeline = 4', 'MeshConfig.virtual_stages = 2',
                                        'MeshConfig.microbatches = 8', 'DataConfig.seq_len = 1024',
                                        'MeshConfig.pipeline_schedule = "1f1b"']),
}


def measure(name: str, target_spec: str, overlap: bool) -> list[dict]:
  from mjax import flags
  from mjax.parallel import gpu_target
  from mjax.parallel.comm_report import comm_report, schedule
  gin, bindings = LAYOUTS[name]
  target = gpu_target.parse_target(target_spec)
  cfg = flags.load([os.path.join('configs', gin)], ['TrainConfig.progress = False', *bindings],
                   num_devices=target.devices)
  out = gpu_target.compile_step(cfg, target, options=None if overlap else {})
  text = out.compiled.as_text()
  mesh = dict(out.mesh.shape)
  report = comm_report(out.compiled, out.cfg, mesh)
  stats = report.stats
  items = schedule(text, mesh)
  rows = []
  for kind in ('all-gather', 'reduce-scatter', 'all-reduce', 'collective-permute', 'all-to-all'):
    mine = [s for s in items if s.kind == kind]
    if not mine:
      continue
    wire = stats.per_step(kind)['wire'] / 2**20
    rows.append(dict(
        layout=name, options='on' if overlap else 'off', kind=kind,
        axes='/'.join(sorted({s.axes or '?' for s in mine})),
        n=len(mine), overlapped=sum(s.mode == 'overlapped' for s in mine),
        matmul=sum(s.matmuls_between > 0 for s in mine), exposed=sum(s.mode == 'exposed' for s in mine),
        sync=sum(s.mode == 'synchronous' for s in mine), wire=wire,
        ratio=(wire * 2**20 / report.expected_wire(kind)) if report.expected_wire(kind) else None,
        dtypes=','.join(sorted({a.dtype for o in stats.of_kind(kind) for a in o.arrays})),
        compile_s=out.seconds))
  return rows


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--layouts', nargs='+', default=list(LAYOUTS), choices=list(LAYOUTS))
  p.add_argument('--target', default='h100:8')
  p.add_argument('--options', nargs='+', default=['on', 'off'], choices=['on', 'off'])
  args = p.parse_args()
  import jax
  from mjax.parallel import gpu_target
  gpu_target.keep_local_backend_cpu()
  print(f'# {time.strftime("%Y-%m-%d")}, compiled for {args.target} on {os.cpu_count()} CPU cores '
        f'(jax {jax.__version__}); nothing run\n')
  print('| layout | XLA options | kind | over | in HLO | overlapped | behind a matmul | exposed | '
        'synchronous | wire MiB/step/device | / minimum | dtypes | compile s |')
  print('|---|---|---|---|---|---|---|---|---|---|---|---|---|')
  for name in args.layouts:
    for opt in args.options:
      for r in measure(name, args.target, opt == 'on'):
        ratio = f'{r["ratio"]:.2f}' if r['ratio'] is not None else '-'
        print(f'| {r["layout"]} | {r["options"]} | {r["kind"]} | {r["axes"]} | {r["n"]} | {r["overlapped"]} | '
              f'{r["matmul"]} | {r["exposed"]} | {r["sync"]} | {r["wire"]:,.1f} | {ratio} | {r["dtypes"]} | '
              f'{r["compile_s"]:.0f} |', flush=True)


if __name__ == '__main__':
  main()
