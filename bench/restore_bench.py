"""Bytes each process reads to restore the train state: every replica reading
its own copy versus one data-parallel replica reading and sending it.

  python bench/restore_bench.py                       # the table, configs/tiny.gin
  python bench/restore_bench.py --layouts 2x4:2x4 4x2:4x2 --gin.ModelConfig.d_model=512

Each layout PxD:AxB is a job of P processes x D fake CPU devices on 127.0.0.1
with MeshConfig.data = A and fsdp = B. The job saves the real (sharded)
train state once, then restores it with `CheckpointConfig.single_replica_restore`
off ('every': each process reads the shards its devices hold) and on
('single'), after one restore that warms the code paths. Bytes read are the
`rchar` of /proc/self/io over the restore: what the process passed through
read()/pread(), page-cache hits included (on this machine's tmpfs and page
cache, `read_bytes`, the storage device's share, is 0). Both restores are
checked bit for bit against the saved state.

Worker mode (`--worker`, one per process; tests/test_multihost.py uses it):
writes <out>/process-<i>.json with the figures and the checks, and with
`--damage` then truncates the newest step's largest data file and restores
again, which must fall back to the older step in every process.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rchar() -> int:
  with open('/proc/self/io') as fh:
    return int(next(l for l in fh if l.startswith('rchar:')).split()[1])


def _bits_equal(a, b) -> bool:
  """Whether two states hold the same bits in every local shard (-0.0 and
  NaN payloads included), on the same shardings."""
  import jax
  import numpy as np
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  if len(la) != len(lb):
    return False
  for x, y in zip(la, lb):
    if x.sharding != y.sharding:
      return False
    shards = {s.device: np.asarray(s.data) for s in y.addressable_shards}
    for s in x.addressable_shards:
      u, v = np.asarray(s.data), shards[s.device]
      if u.shape != v.shape or u.dtype != v.dtype or u.tobytes() != v.tobytes():
        return False
  return True


def worker(args, bindings) -> None:
  from mjax import distributed
  distributed.initialize_from_env()
  import jax
  import numpy as np
  from mjax import flags, train
  from mjax.checkpoint import Checkpointer
  from mjax.checkpoint.replica import replica_plan
  from mjax.parallel import make_mesh

  cfg = flags.load(flags.gin_files(args), bindings, num_devices=jax.device_count())
  program = train.make_program(cfg, make_mesh(cfg.mesh))
  abstract = program.abstract_state(canonical=True)
  # The state's arrays filled with noise, not initialized (no compile; and a
  # fresh LAMB state is zeros, which compress to nothing on disk), each with a
  # negative zero first: a broadcast that adds floats would turn it positive
  # (-0.0 + 0.0 = +0.0). Every process draws the same global values.
  def noise(i, a):
    values = np.random.default_rng(i).standard_normal(a.shape).astype(a.dtype)
    if np.issubdtype(values.dtype, np.floating):
      values.flat[0] = -0.0
    else:
      values = np.full(a.shape, 7, a.dtype)
    return jax.make_array_from_callback(a.shape, a.sharding, lambda index: values[index])
  leaves, treedef = jax.tree.flatten(abstract)
  state = jax.tree.unflatten(treedef, [noise(i, a) for i, a in enumerate(leaves)])
  # The run's own layout (a workdir and its checkpoints/): a tier may not be
  # the workdir itself.
  ck_dir = os.path.join(args.dir, 'checkpoints')
  ck_cfg = dataclasses.replace(cfg.checkpoint, directory=ck_dir, fast_every=0, keep=5)
  ck = Checkpointer(ck_cfg, args.dir)
  for step in (1, 2):
    ck.save(step, state, {'next_index': step}, {}, force=True)
  ck.wait()
  plan = replica_plan(abstract)
  for single in (False, True):   # imports, compiles: not measured
    ck.restore_latest(abstract, single_replica=single)
  out = {'process': jax.process_index(), 'processes': jax.process_count(),
         'devices': jax.device_count(), 'data': cfg.mesh.data, 'fsdp': cfg.mesh.fsdp,
         'replica_plan': plan is not None, 'reading_replica': bool(plan and plan.source),
         'state_bytes': int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))),
         'modes': {}}
  restored = {}
  for mode in ('every', 'single'):
    before, t0 = _rchar(), time.perf_counter()
    r = ck.restore_latest(abstract, single_replica=(mode == 'single'))
    jax.block_until_ready(r.state)
    seconds, read = time.perf_counter() - t0, _rchar() - before
    restored[mode] = r.state
    out['modes'][mode] = {'step': r.step, 'rchar': read, 'seconds': round(seconds, 3),
                          'bitwise_saved': _bits_equal(r.state, state)}
  out['modes_bitwise_equal'] = _bits_equal(restored['every'], restored['single'])
  if args.damage:
    if jax.process_index() == 0:
      files = glob.glob(os.path.join(ck_dir, '2', 'state', '**', 'd', '*'), recursive=True)
      target = max(files, key=os.path.getsize)
      with open(target, 'r+b') as fh:
        fh.truncate(16)
    distributed.barrier('bench/damaged')
    t0 = time.perf_counter()
    r = ck.restore_latest(abstract, single_replica=True)
    out['damaged'] = {'step': r.step if r else None, 'seconds': round(time.perf_counter() - t0, 3),
                      'bitwise_saved': bool(r) and _bits_equal(r.state, state)}
  ck.close()
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, f'process-{jax.process_index()}.json'), 'w') as fh:
    json.dump(out, fh)


def run_layout(layout: str, passthrough: list[str], timeout: float, damage: bool = False) -> list[dict]:
  """Runs one job of the layout 'PxD:AxB'; the per-process results."""
  from mjax import launch
  procs_devs, mesh = layout.split(':')
  procs, devs = (int(v) for v in procs_devs.split('x'))
  data, fsdp = (int(v) for v in mesh.split('x'))
  base = tempfile.mkdtemp(prefix='mjax-restore-bench-')
  try:
    env = {k: v for k, v in os.environ.items() if not k.startswith(('MJAX_', 'SLURM_', 'JOB_COMPLETION'))}
    argv = [sys.executable, os.path.abspath(__file__), '--worker', '--dir', os.path.join(base, 'ckpt'),
            '--out', os.path.join(base, 'out'), *(['--damage'] if damage else []), *passthrough,
            f'--gin.MeshConfig.data={data}', f'--gin.MeshConfig.fsdp={fsdp}',
            '--gin.TrainConfig.compilation_cache_dir=None']
    jobs = launch.spawn_local(procs, devs, argv, workdir=base, env=env)
    codes = launch.wait_all(jobs, timeout=timeout)
    if codes != [0] * procs:
      logs = ''.join(open(p).read()[-3000:] for p in sorted(glob.glob(os.path.join(base, 'logs', '*'))))
      raise RuntimeError(f'layout {layout}: exit statuses {codes}\n{logs}')
    rows = [json.load(open(os.path.join(base, 'out', f'process-{i}.json'))) for i in range(procs)]
    state = os.path.join(base, 'ckpt', 'checkpoints', '1', 'state', '**')
    disk = sum(os.path.getsize(p) for p in glob.glob(state, recursive=True) if os.path.isfile(p))
    for r in rows:
      r['state_disk_bytes'] = disk
    return rows
  finally:
    shutil.rmtree(base, ignore_errors=True)


def main(argv=None) -> None:
  from mjax import flags
  p = flags.parser('restore_bench', __doc__.splitlines()[0])
  p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
  p.add_argument('--dir', help=argparse.SUPPRESS)
  p.add_argument('--out', help=argparse.SUPPRESS)
  p.add_argument('--damage', action='store_true', help=argparse.SUPPRESS)
  p.add_argument('--layouts', nargs='+', default=['2x4:1x8', '2x4:2x4', '4x2:2x4', '4x2:4x2'],
                 help='jobs as PROCESSESxDEVICES:DATAxFSDP')
  p.add_argument('--timeout', type=float, default=600)
  argv = sys.argv[1:] if argv is None else argv
  args, bindings = flags.parse(p, argv)
  if args.worker:
    return worker(args, bindings)
  passthrough = [*(f'--gin_file={f}' for f in args.gin_file), *(f'--gin_param={b}' for b in bindings)]
  print(f'{time.strftime("%Y-%m-%d")}, {os.cpu_count()} CPU cores; bytes = rchar of /proc/self/io over '
        f'one restore; MiB = 2^20 bytes\n')
  print('| processes x devices | data x fsdp | replicas | mode | MiB read per process | total MiB read | '
        'x state on disk | restore (s, process 0) | bitwise |')
  print('|---|---|---|---|---|---|---|---|---|')
  receivers = []   # bytes read by processes outside the reading replica, single-replica mode
  for layout in args.layouts:
    rows = run_layout(layout, passthrough, args.timeout)
    receivers += [r['modes']['single']['rchar'] for r in rows if r['replica_plan'] and not r['reading_replica']]
    disk = rows[0]['state_disk_bytes']
    for mode in ('every', 'single'):
      reads = [r['modes'][mode]['rchar'] for r in rows]
      used = mode == 'every' or rows[0]['replica_plan']
      ok = all(r['modes'][mode]['bitwise_saved'] for r in rows) and all(r['modes_bitwise_equal'] for r in rows)
      name = mode if used else 'single (n/a: every)'
      print(f'| {layout.split(":")[0]} | {layout.split(":")[1]} | {rows[0]["data"]} | {name} | '
            f'{" / ".join(f"{b / 2**20:.2f}" for b in reads)} | {sum(reads) / 2**20:.2f} | '
            f'{sum(reads) / disk:.2f} | {rows[0]["modes"][mode]["seconds"]:.2f} | {"yes" if ok else "NO"} |')
  print(f'\nstate: {rows[0]["state_bytes"] / 2**20:.2f} MiB in memory, {disk / 2**20:.2f} MiB on disk (one step)')
  if receivers:
    print(f'processes that receive the state read {min(receivers)} to {max(receivers)} bytes each '
          f'(step listings and metadata, no array data)')


if __name__ == '__main__':
  main()
