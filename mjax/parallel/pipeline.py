"""Interleaved (circular) pipeline parallelism as one SPMD program.

The layer stack, `G` scanned layer groups, is cut into `p * v` chunks of
`G / (p v)` consecutive groups; chunk `c = r * p + s` lives on stage `s`
(`p` stages on the `pipeline` mesh axis, `v` virtual stages = repeats).
Parameters are re-laid out from `(G, ...)` to `(v, p, G/(p v), ...)`, a plain
row-major reshape (layer order is kept), with the `p` axis sharded over
`pipeline`: each device holds exactly its own chunks.

Schedule. The batch is split into `m` micro-batches (m >= p when v > 1). At
time t stage s works on item k = t - s, i.e. micro-batch k mod m on its
(k div m)-th trip round the pipeline. Every time step all stages run in
parallel (a `vmap` over the stage axis that GSPMD partitions over
`pipeline`), then outputs shift one stage forward (`jnp.roll` on the sharded
axis, which XLA lowers to a collective-permute that the latency-hiding
scheduler overlaps with the next step's compute). Stage 0 takes a fresh
micro-batch for the first trip and, for later trips, the last stage's output
of m steps earlier, kept in a circular buffer; m >= p guarantees it is ready.
After T = m v + p - 1 steps the buffer holds every micro-batch's final
output. Idle (bubble) slots compute on placeholder data whose results are
never used, so the bubble fraction is (p - 1) / (m v) of a step.

The backward pass is the autodiff of the forward scan (all forwards, then all
backwards, GPipe-style memory; remat policies bound it). Sharding is
expressed with logical names only; no mesh object appears here.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

STAGE_ACT = ('stage', 'batch', 'residual_seq', 'embed')
BUF_ACT = (None, 'batch', 'residual_seq', 'embed')


def bubble_fraction(stages: int, repeats: int, microbatches: int) -> float:
  """Idle share of a pipelined step relative to its useful work."""
  return (stages - 1) / (repeats * microbatches)


def to_pipeline_layout(layers: Any, stages: int, repeats: int) -> Any:
  """(G, ...) stacked layer params -> (repeats, stages, G / (stages repeats), ...)."""
  def split(w):
    return w.reshape(repeats, stages, w.shape[0] // (stages * repeats), *w.shape[1:])
  return jax.tree.map(split, layers)


def from_pipeline_layout(layers: Any) -> Any:
  """Inverse of `to_pipeline_layout`: back to (G, ...) in layer order."""
  return jax.tree.map(lambda w: w.reshape(-1, *w.shape[3:]), layers)


def pipeline_names(names: tuple) -> tuple:
  """Logical names of a stacked param, ('layers', ...), after re-layout."""
  assert names[0] == 'layers', names
  return ('repeat', 'stage', *names)


def _stage_axis() -> str | None:
  """The mesh axis the current logical rules give the `stage` dimension."""
  axes = nn.logical_to_mesh_axes(('stage',))
  return axes[0] if axes else None


def circular_pipeline(group_fn: Callable, layers: Any, x: jax.Array, aux: Any, *,
                      microbatches: int) -> jax.Array:
  """Runs the layer stack over a pipeline.

  Args:
    group_fn: `(group_params, x, aux) -> x` for one layer group.
    layers: params in pipeline layout, leaves (repeats, stages, per_chunk, ...).
    x: (batch, seq, embed) layer-stack input.
    aux: pytree of per-token (batch, seq) inputs (positions, segment ids, or
      None leaves), split into micro-batches alongside x.
    microbatches: m; batch % m == 0.
  Returns:
    (batch, seq, embed), equal to running the groups in order on x.
  """
  leaf = jax.tree.leaves(layers)[0]
  v, p = leaf.shape[0], leaf.shape[1]
  m = microbatches
  b, s, d = x.shape
  mb = b // m
  # Strided micro-batches (micro-batch i = rows i, i + m, ...): each
  # data-parallel shard of the batch splits locally, no data moves.
  xs = nn.with_logical_constraint(x.reshape(mb, m, s, d).swapaxes(0, 1), BUF_ACT)  # (m, mb, s, d)
  aux = jax.tree.map(lambda a: a.reshape(mb, m, s).swapaxes(0, 1), aux)            # (m, mb, s)

  def stage_fn(chunk, h, aux_s):  # chunk leaves (per_chunk, ...); h (mb, s, d)
    def body(h, group):
      return group_fn(group, h, aux_s), None
    return jax.lax.scan(body, h, chunk)[0]

  spmd_axis = _stage_axis()
  run_stages = jax.vmap(stage_fn, spmd_axis_name=spmd_axis)
  pick_repeat = jax.vmap(lambda w, r: w[r], in_axes=(1, 0), spmd_axis_name=spmd_axis)
  stage_ids = jnp.arange(p)

  def step(carry, t):
    state, buf = carry                       # (p, mb, s, d), (m, mb, s, d)
    first = jnp.where(t < m, xs[t % m], buf[t % m])
    inputs = jnp.roll(state, 1, axis=0).at[0].set(first)
    inputs = nn.with_logical_constraint(inputs, STAGE_ACT)
    item = t - stage_ids                     # what each stage works on
    repeat = jnp.clip(item // m, 0, v - 1)
    chunks = jax.tree.map(lambda w: pick_repeat(w, repeat), layers)
    out = run_stages(chunks, inputs, jax.tree.map(lambda a: a[item % m], aux))
    out = nn.with_logical_constraint(out, STAGE_ACT)
    # Item t - (p - 1) leaves the last stage. Before the pipeline fills this
    # writes placeholders into slots that real items overwrite before any read.
    buf = jax.lax.dynamic_update_index_in_dim(buf, out[p - 1], (t - (p - 1)) % m, 0)
    return (out, nn.with_logical_constraint(buf, BUF_ACT)), None

  state = nn.with_logical_constraint(jnp.zeros((p, mb, s, d), x.dtype), STAGE_ACT)
  buf = nn.with_logical_constraint(jnp.zeros((m, mb, s, d), x.dtype), BUF_ACT)
  (_, buf), _ = jax.lax.scan(step, (state, buf), jnp.arange(m * v + p - 1))
  return buf.swapaxes(0, 1).reshape(b, s, d)
