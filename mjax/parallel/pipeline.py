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

`one_f_one_b` (MeshConfig.pipeline_schedule = '1f1b') is the interleaved
1F1B schedule instead: it computes loss and gradients itself, a forward and
a backward of different micro-batches on every stage each tick, keeping at
most 2 v p chunk inputs per stage whatever m is. It runs as a `shard_map`
over the stage axis only (the other axes stay automatic), so that each
stage skips the work it has no item for (`lax.cond`); the shifts between
stages are `ppermute`s issued at the end of each tick, ahead of the next
tick's backward, which does not need them.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

from mjax.parallel import ordering
from mjax.parallel.rules import data_axis, rules_without

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
  data = data_axis()
  if data is None:
    return _circular(group_fn, layers, x, aux, microbatches)
  # Manual over the data axis: each data shard runs the schedule on its own
  # rows, and autodiff sums the layer gradients over `data` once, at this
  # boundary. Left to the automatic layout, the backward's scan all-reduced
  # every tick's gradient contribution over `data` (in the compute dtype)
  # and re-gathered the micro-batch buffer's cotangent each tick (8-GPU
  # compile of 125m, p = 4, v = 2, m = 8: 923 MiB of all-reduces, 3.1x the
  # gradient bytes, and 684 MiB of all-gathers a step).

  def body(layers, x, aux):
    with rules_without(data):
      return _circular(group_fn, layers, x, aux, microbatches)

  P = jax.sharding.PartitionSpec
  run = jax.shard_map(body, in_specs=(jax.tree.map(lambda _: P(), layers), P(data),
                                      jax.tree.map(lambda _: P(data), aux)),
                      out_specs=P(data), axis_names={data}, check_vma=False)
  return run(layers, x, aux)


def _circular(group_fn: Callable, layers: Any, x: jax.Array, aux: Any, microbatches: int) -> jax.Array:
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
  stage_ids = jnp.arange(p)

  def pick_repeat(w, repeat):  # (v, p, ...), (p,) -> each stage's chunk of its repeat, (p, ...)
    if v == 1:
      return w[0]
    # A select among the v repeats, not a per-stage gather: the gradient of a
    # batched gather is a batched scatter, which XLA's GPU compiler (jax 0.10)
    # rewrites into an invalid one (HLO verifier: repeated dimensions in
    # scatter_dims_to_operand_dims, after batched_gather_scatter_normalizer),
    # found compiling this schedule for 8 H100s. A select's gradient is a select.
    r = jnp.broadcast_to(repeat.reshape((p,) + (1,) * (w.ndim - 2)), w.shape[1:])
    return jax.lax.select_n(r, *(w[i] for i in range(v)))

  def step(carry, t):
    state, buf = carry                       # (p, mb, s, d), (m, mb, s, d)
    first = jnp.where(t < m, xs[t % m], buf[t % m])
    # Stage 0 takes `first`, the others their left neighbour's output. A
    # select, not `.at[0].set`: that scatter's transpose gathers row 0 of a
    # stage-split cotangent, on which XLA's SPMD partitioner (jax 0.11, 0.12)
    # aborts in a region manual over `fsdp` (MeshConfig.fsdp_gather =
    # 'step'). The select's transpose is a sum over stages: on CPU the same
    # collectives as before; in an 8-GPU compile some all-gathers over
    # `pipeline` become all-reduces, the same bytes on the wire in all.
    inputs = jnp.where((stage_ids == 0).reshape((p,) + (1,) * first.ndim), first, jnp.roll(state, 1, axis=0))
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


# ----------------------------------------------------------------------------
# Interleaved 1F1B: forward and backward of different micro-batches interleaved
# ----------------------------------------------------------------------------

def one_f_one_b_ticks(stages: int, repeats: int, microbatches: int) -> int:
  """Lockstep ticks of `one_f_one_b`: m v forwards per stage, the first
  backward v p ticks after the first forward, and the pipe's depth."""
  return microbatches * repeats + repeats * stages + stages - 1


def in_flight_bound(stages: int, repeats: int) -> int:
  """Stage inputs a stage of `one_f_one_b` keeps at most: 2 v p, whatever
  the number of micro-batches (the circular schedule keeps m v)."""
  return 2 * repeats * stages


def one_f_one_b(embed_fn: Callable, stage_fn: Callable, head_fn: Callable, layers: Any, head_params: Any,
                inputs: Any, aux: Any, head_aux: Any, *, microbatches: int, embed_backward: bool = True,
                ordered: bool = False):
  """Loss and gradients of the layer stack + head by an interleaved 1F1B
  schedule (Megatron-LM's interleaved schedule, run in lockstep).

  Order. Micro-batches go round the pipeline in groups of p: the group's p
  micro-batches through chunk 0 of every stage, then through chunk 1, ...,
  then the next group. In sequence order, item k = g v p + r p + j is
  micro-batch g p + j on its trip r; stage s runs its forward at tick k + s,
  so the last stage's output of trip r is stage 0's input of trip r + 1 on
  the very next tick (no buffer: the shift is a ring). On its last trip the
  last stage applies the head and the loss to the micro-batch at once, and
  its backward starts on the next tick; backward items run in the mirror
  order (trips reversed, the cotangents shifted backwards round the ring),
  item k at stage s at tick v p + k + (p - 1 - s). After warm-up every tick
  has one forward and one backward on each stage.

  Memory. A stage keeps only the inputs of its chunks between their forward
  and their backward, at most 2 v p of them (`in_flight_bound`), and
  recomputes the chunk in its backward (the model's remat policy applies
  inside): bounded by the stage count, not by the micro-batches, where the
  circular schedule's autodiff keeps every item's activations (m v).

  Time. `lax.cond` runs a stage's forward and backward only on ticks where
  they are scheduled (each stage is its own program in a `shard_map` over
  the stage axis), so the step costs about (m v + p - 1)(F + B), as the
  circular schedule's forward then backward; plus one forward per chunk for
  the recomputation.

  Gradients leave once. Each stage and data shard sums its own gradients
  until the end of the step: the layers' are summed over `data` once; the
  head's and the embedding's are added on the shard first (with a tied
  table the two ends' gradients meet there) and summed over stages and
  `data` in one all-reduce. The embedding's backward runs here, on stage
  0's shards, so no activation gradient leaves the schedule either.
  `embed_backward=False` returns the stack input's cotangent instead (summed
  over stages), for the caller to run the embedding's backward: XLA's SPMD
  partitioner aborts on the lookup's scatter-add inside this partly manual
  region when its table is sharded over FSDP and tensor with sequence
  parallelism.

  Args:
    embed_fn: `(head_params, inputs) -> x`, the layer stack's input
      (batch, seq, embed) from one micro-batch's `inputs`.
    stage_fn: `(chunk_params, h, aux) -> h` for one chunk of layer groups.
    head_fn: `(head_params, h, head_aux) -> (loss_sum, count)` for one
      micro-batch's layer-stack output.
    layers: params in pipeline layout, leaves (repeats, stages, per_chunk, ...).
    head_params: the rest of the params: what the embedding, the head and
      the loss read.
    inputs, aux, head_aux: pytrees of (batch, seq) per-token inputs of the
      embedding, the stack and the head (None leaves allowed), split into
      micro-batches.
    microbatches: m, a multiple of the stage count.
    ordered: run a tick's collectives in one chain (backward, forward,
      head, then the two shifts) on every device, for XLA's CPU runtime
      (`mjax.parallel.ordering`).
  Returns:
    (loss_sum, count, d_layers, d_rest, dx): sums over the batch, the
    gradients of the layer params (pipeline layout, fp32) and of
    head_params (fp32), and with `embed_backward=False` the cotangent of the
    stack input (batch, seq, embed) (else None).
  """
  leaf = jax.tree.leaves(layers)[0]
  v, p = leaf.shape[0], leaf.shape[1]
  m = microbatches
  if m % p:
    raise ValueError(f'1F1B takes micro-batches in groups of the {p} stages; {m} is not a multiple of {p}')
  axis = _stage_axis()
  data = data_axis()
  b = jax.tree.leaves(inputs)[0].shape[0]
  mb = b // m
  # Strided micro-batches, as in circular_pipeline: no data moves.
  split = lambda a: a.reshape(mb, m, *a.shape[1:]).swapaxes(0, 1)
  inputs, aux, head_aux = (jax.tree.map(split, t) for t in (inputs, aux, head_aux))
  n_items, slots, first_back = m * v, in_flight_bound(p, v), v * p
  ticks = one_f_one_b_ticks(p, v, m)
  f32 = lambda t: jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), t)
  then = ordering.after if ordered else (lambda x, dep: x)

  def decode(k):
    """Sequence index -> (trip, micro-batch)."""
    g, rem = k // (v * p), k % (v * p)
    return rem // p, g * p + rem % p

  def body(layers, head_params, inputs, aux, head_aux):
    with rules_without(data):
      return run_stage(layers, head_params, inputs, aux, head_aux)

  def run_stage(layers, head_params, inputs, aux, head_aux):
    layers = jax.tree.map(lambda w: w[:, 0], layers)        # this stage's chunks, (v, per_chunk, ...)
    # Every item's stack input, (m, mb, seq, embed); a lookup, made on each
    # stage and used on stage 0, whose backward runs at the end.
    flat = lambda a: a.reshape(m * a.shape[1], *a.shape[2:])
    items = lambda a: a.reshape(m, a.shape[0] // m, *a.shape[1:])
    x, embed_vjp = jax.vjp(lambda hp: embed_fn(hp, jax.tree.map(flat, inputs)), head_params)
    xs = items(x)
    stage = jax.lax.axis_index(axis)
    chunk = lambda r: jax.tree.map(lambda w: w[r], layers)
    pick = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
    zeros = jnp.zeros(xs.shape[1:], xs.dtype)               # one micro-batch of this data shard

    def tick(c, t):
      # The conditionals take and give one item's values only; the buffers
      # (stage inputs, gradients, dx) are updated outside them, in place,
      # with the item masked in: a buffer passed through a conditional may
      # be copied every tick.
      # Backward first: it reads the head's cotangent the previous tick left.
      kb = t - first_back - (p - 1 - stage)
      on_b = (kb >= 0) & (kb < n_items)
      kb_c = jnp.clip(kb, 0, n_items - 1)
      rev, i_b = decode(kb_c)
      r_b = v - 1 - rev
      slot_b = ((kb_c // (v * p)) * v * p + r_b * p + kb_c % p) % slots
      cot = jnp.where((stage == p - 1) & (r_b == v - 1), c['pending'], c['b_in'])

      def backward(w, h, a, cot):
        _, vjp = jax.vjp(stage_fn, w, h, a)   # the chunk again from its input (remat policy inside)
        dw, dh, _ = vjp(cot)
        return dw, dh

      dw, dh = jax.lax.cond(on_b, backward, lambda w, h, a, cot: (jax.tree.map(jnp.zeros_like, w), zeros),
                            chunk(r_b), c['saved'][slot_b], pick(aux, i_b), cot)
      d_layers = jax.tree.map(lambda acc, g: acc.at[r_b].add(g.astype(jnp.float32)), c['d_layers'], dw)
      first_chunk = on_b & (stage == 0) & (r_b == 0)
      dx = c['dx'].at[i_b].set(jnp.where(first_chunk, dh, c['dx'][i_b]))
      # Forward.
      kf = t - stage
      on_f = (kf >= 0) & (kf < n_items)
      kf_c = jnp.clip(kf, 0, n_items - 1)
      r_f, i_f = decode(kf_c)
      inp = then(jnp.where((stage == 0) & (r_f == 0), xs[i_f], c['f_in']), dh)
      y = jax.lax.cond(on_f, stage_fn, lambda w, h, a: zeros, chunk(r_f), inp, pick(aux, i_f))
      slot = kf_c % slots
      saved = c['saved'].at[slot].set(jnp.where(on_f, inp, c['saved'][slot]))

      def head(hp, y, ha):
        (loss, count), vjp = jax.vjp(lambda hp, h: head_fn(hp, h, ha), hp, y)
        d_hp, d_y = vjp((jnp.ones_like(loss), jnp.zeros_like(count)))
        return loss, count, d_hp, d_y

      def no_head(hp, y, ha):
        return (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, hp), zeros)

      loss, count, d_hp, pending = jax.lax.cond(on_f & (stage == p - 1) & (r_f == v - 1), head, no_head,
                                                head_params, y, pick(head_aux, i_f))
      d_head = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), c['d_head'], d_hp)
      # Outputs one stage on round the ring; cotangents one stage back.
      f_in = jax.lax.ppermute(then(y, pending), axis, [(i, (i + 1) % p) for i in range(p)])
      b_in = jax.lax.ppermute(then(dh, f_in), axis, [(i, (i - 1) % p) for i in range(p)])
      return dict(f_in=f_in, b_in=b_in, pending=pending, saved=saved, d_layers=d_layers, d_head=d_head,
                  loss=c['loss'] + loss, count=c['count'] + count, dx=dx), None

    c = dict(f_in=zeros, b_in=zeros, pending=zeros, saved=jnp.zeros((slots, *xs.shape[1:]), xs.dtype),
             d_layers=f32(layers), d_head=f32(head_params), loss=jnp.zeros((), jnp.float32),
             count=jnp.zeros((), jnp.float32), dx=jnp.zeros_like(xs))
    c, _ = jax.lax.scan(tick, c, jnp.arange(ticks))
    # The embedding's backward, on stage 0 (the others hold no dx): its
    # gradient joins the head's on the shard, one all-reduce for both.
    d_rest, dx = c['d_head'], None
    if embed_backward:
      d_embed = jax.lax.cond(stage == 0, lambda dx: embed_vjp(flat(dx))[0],
                             lambda dx: jax.tree.map(jnp.zeros_like, head_params), c['dx'])
      d_rest = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), d_rest, d_embed)
    else:
      # Summed in fp32 (exact: one stage holds it, the others zeros): XLA's
      # CPU backend aborts on a 16-bit all-reduce over the manual stage axis.
      dx = jax.lax.psum(c['dx'].astype(jnp.float32), axis).astype(xs.dtype)
    # Gradients are sums over this data shard's micro-batches until here:
    # summed over the data shards once per step, where the accumulation in
    # an automatic layout would all-reduce every tick's contribution.
    everywhere = lambda a: jax.lax.psum(a, (axis, data) if data else axis)
    over_data = (lambda a: jax.lax.psum(a, data)) if data else (lambda a: a)
    return (everywhere(c['loss']), everywhere(c['count']),
            jax.tree.map(lambda w: over_data(w)[:, None], c['d_layers']), jax.tree.map(everywhere, d_rest), dx)

  P = jax.sharding.PartitionSpec
  stage_spec = jax.tree.map(lambda _: P(None, axis), layers)
  rep = lambda tree: jax.tree.map(lambda _: P(), tree)
  per_item = lambda tree: jax.tree.map(lambda _: P(None, data), tree)   # (m, mb, ...): mb over data
  run = jax.shard_map(body, in_specs=(stage_spec, rep(head_params), per_item(inputs), per_item(aux),
                                      per_item(head_aux)),
                      out_specs=(P(), P(), stage_spec, rep(head_params),
                                 None if embed_backward else P(None, data)),
                      axis_names={axis, data} if data else {axis}, check_vma=False)
  loss, count, d_layers, d_rest, dxs = run(layers, head_params, inputs, aux, head_aux)
  dx = None if embed_backward else dxs.swapaxes(0, 1).reshape(b, *dxs.shape[2:])
  return loss, count, d_layers, d_rest, dx
