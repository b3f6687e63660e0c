"""Attention's forward + backward on this machine: every XLA path, side by side.

  python bench/attention_bench.py                 # the default shapes, 3 rounds
  python bench/attention_bench.py --rounds 5 --steps 20 --dtype bfloat16

For each shape, the gradient of sum(attention(q, k, v) * d_out) with respect
to q, k and v (one jitted call: the forward, then the backward) by
  reference       `reference_attention` differentiated by JAX (attention_impl='xla')
  jax.nn (xla)    jax.nn.dot_product_attention(implementation='xla'), what
                  'dot_product' ran before mjax had its own XLA attention
  mjax            `xla_attention`: query blocks, flash attention's backward
                  (attention_impl='dot_product' wherever cuDNN does not run)
Rounds alternate the paths so that drift of a shared machine hits all alike;
each cell is the median over rounds of a median of `--steps` calls. The last
columns are the work each path does on the (q, k) matrix, as a share of the
full matrix (the reference's), and the speed-up over the reference.
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

from mjax.model.attention import jax_nn_attention, query_blocks, reference_attention, xla_attention  # noqa: E402

# (name, batch, seq, heads, kv_heads, head_dim, window)
SHAPES = [
    ('peer model (bench/peer_maxtext.py)', 4, 256, 6, 6, 64, None),
    ('seq 2048, GQA 8:2', 1, 2048, 8, 2, 64, None),
    ('seq 2048, GQA 8:2, window 512', 1, 2048, 8, 2, 64, 512),
]


PATHS = {
    'reference': lambda q, k, v, w: reference_attention(q, k, v, w),
    'jax.nn (xla)': lambda q, k, v, w: jax_nn_attention(q, k, v, w, 'xla'),
    'mjax': lambda q, k, v, w: xla_attention(q, k, v, w),
}


def score_share(seq: int, window) -> float:
  """Share of the full (seq, seq) matrix that mjax's blocks compute."""
  return sum((q1 - q0) * (q1 - k0) for q0, q1, k0 in query_blocks(seq, window)) / seq ** 2


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--rounds', type=int, default=3)
  p.add_argument('--steps', type=int, default=10, help='timed calls per path per round')
  p.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16'])
  args = p.parse_args(argv)
  dtype = jnp.dtype(args.dtype)

  print(f'# attention forward + backward, {args.dtype}, {jax.devices()[0].device_kind} '
        f'({jax.default_backend()}), jax {jax.__version__}; median of {args.rounds} rounds x {args.steps} calls\n')
  print('| shape | path | ms | (q, k) work | vs reference |')
  print('|---|---|---|---|---|')
  for name, b, s, h, kvh, d, window in SHAPES:
    keys = jax.random.split(jax.random.key(s), 4)
    q = jax.random.normal(keys[0], (b, s, h, d), dtype)
    k = jax.random.normal(keys[1], (b, s, kvh, d), dtype)
    v = jax.random.normal(keys[2], (b, s, kvh, d), dtype)
    do = jax.random.normal(keys[3], (b, s, h, d), dtype)
    fns = {}
    for path, attn in PATHS.items():
      loss = lambda q, k, v, attn=attn: jnp.sum(attn(q, k, v, window).astype(jnp.float32) * do.astype(jnp.float32))
      fns[path] = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
      jax.block_until_ready(fns[path](q, k, v))                     # compile
    times = {path: [] for path in PATHS}
    for _ in range(args.rounds):
      for path, fn in fns.items():
        calls = []
        for _ in range(args.steps):
          t = time.perf_counter()
          jax.block_until_ready(fn(q, k, v))
          calls.append(time.perf_counter() - t)
        times[path].append(statistics.median(calls))
    ref = statistics.median(times['reference'])
    for path in PATHS:
      t = statistics.median(times[path])
      work = score_share(s, window) if path == 'mjax' else 1.0
      print(f'| {name} | {path} | {t * 1e3:.1f} | {work:.0%} | {ref / t:.2f}x |', flush=True)


if __name__ == '__main__':
  main()
