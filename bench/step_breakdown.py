"""What each part of a train step costs on this machine, measured side by side.

  python bench/step_breakdown.py --gin_file configs/base.gin [--gin.X=Y ...] [--rounds 3]

Times, per step, in alternating rounds (each a median of `--steps` calls,
after a warm-up), on one device:
  full step          program.step: forward, backward, LAMB, the norms it
                     reports, the parameter update (what training runs)
  forward+backward   the same loss and gradients, nothing else
  LAMB update        what the step runs after the gradients (program.lamb.update:
                     the mean gradient, clip, moments, trust ratio, the two norms it
                     reports) and apply_updates
  data               one batch from the grain pipeline (it runs in background
                     threads during training: on few cores it competes with
                     the step for them)
The breakdown column is each part's share of the full step. Parts overlap
in XLA's schedule, so they need not add up exactly.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from mjax import data as data_lib  # noqa: E402
from mjax import flags  # noqa: E402
from mjax.parallel import make_mesh  # noqa: E402
from mjax.train import _grad_sums, _loss_fn, make_program  # noqa: E402
from mjax.model import Transformer  # noqa: E402


def _time(fn, n: int) -> float:
  """Median seconds of n calls of fn (which blocks on its result)."""
  out = []
  for _ in range(n):
    t0 = time.perf_counter()
    fn()
    out.append(time.perf_counter() - t0)
  return statistics.median(out)


def main(argv=None):
  p = argparse.ArgumentParser('step_breakdown', description=__doc__.splitlines()[0])
  p.add_argument('--gin_file', action='append', default=[])
  p.add_argument('--gin_param', action='append', default=[])
  p.add_argument('--steps', type=int, default=10)
  p.add_argument('--rounds', type=int, default=3)
  args, bindings = flags.parse(p, argv if argv is not None else sys.argv[1:])
  cfg = flags.load(flags.gin_files(args), [*bindings, 'MeshConfig.data = 1'], num_devices=1)
  mesh = make_mesh(cfg.mesh, devices=jax.devices()[:1])
  program = make_program(cfg, mesh)
  it = data_lib.make_train_iterator(cfg.data, cfg.train.global_batch_size)
  batch = program.to_global(next(it))
  loss_sums = _loss_fn(cfg, Transformer(cfg.model))

  with program.context():
    state = program.init(jax.random.key(0))
    fb = jax.jit(lambda params, b: _grad_sums(loss_sums, params, b, cfg.train.grad_accum_steps))
    grads = jax.block_until_ready(fb(state.params, batch)[2])
    count = jnp.float32(cfg.train.global_batch_size * cfg.data.seq_len)
    lamb = jax.jit(lambda g, o, p: (lambda u, o2, n: (optax.apply_updates(p, u), o2, n))(
        *program.lamb.update(g, count, o, p)))
    step_state = [program.init(jax.random.key(0))]   # the step donates its state: a copy of its own

    def full():
      step_state[0], m = program.step(step_state[0], batch)
      jax.block_until_ready(m)

    parts = {
        'full step': full,
        'forward+backward': lambda: jax.block_until_ready(fb(state.params, batch)),
        'LAMB update': lambda: jax.block_until_ready(lamb(grads, state.opt_state, state.params)),
        'data': lambda: next(it),
    }
    for fn in parts.values():   # compile and warm up
      fn()
      fn()
    results = {k: [] for k in parts}
    for _ in range(args.rounds):
      for name, fn in parts.items():
        results[name].append(_time(fn, args.steps))

  full_s = statistics.median(results['full step'])
  m = cfg.model
  print(f'\nstep breakdown: {jax.devices()[0].device_kind}, d_model {m.d_model}, {m.n_layers} layers, '
        f'seq {cfg.data.seq_len}, batch {cfg.train.global_batch_size}, {m.dtype}, remat {m.remat_policy!r}, '
        f'{args.rounds} alternating rounds x median of {args.steps}\n')
  print('| part | ms per step (median of rounds) | rounds (ms) | share of the full step |')
  print('|---|---|---|---|')
  for name, xs in results.items():
    med = statistics.median(xs)
    print(f'| {name} | {med * 1e3:.1f} | {" / ".join(f"{x * 1e3:.1f}" for x in xs)} | {med / full_s:.1%} |')


if __name__ == '__main__':
  main()
