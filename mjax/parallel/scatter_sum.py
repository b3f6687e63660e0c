"""The embedding's gradient under data parallelism and FSDP: each batch
shard's partial table, summed over the table's two readers, then
reduce-scattered onto the table's shards (all-reduced where nothing splits
the table) once, in the compute dtype.

Every device holds a slice of the batch, so every device makes a partial
table of the embedding's gradient, and the gradient is their sum over the
devices that split the batch. The lookup's partial is a scatter-add, for
which GSPMD has no way to say "partial sums, reduce them onto the shards":
it all-reduced each device's whole table in fp32 (and under FSDP sliced
the shard out: twice a reduce-scatter's bytes, at twice the dtype's). The
tied head's partial is a matrix product over the batch, which GSPMD
reduces, but on its own: autodiff hands each reader its own sum, so the
table crossed the network twice.

Here the readers leave their partials, stacked along a leading dim of one
per batch shard (`p.n`), in the cotangent of a zeros array that nothing
reads: the lookup's from a `shard_map` (each device adds its own rows, in
fp32), the head's as a product with the batch shards as a batch dim (GSPMD
multiplies each shard locally and sums nothing). Autodiff adds the two, on
each device. `reduce_partials` then rounds the sum once to the compute dtype
and reduce-scatters it over the axes that also split the table's `embed`
dimension (FSDP), all-reducing only over the others (data parallelism), as
every other weight gradient is (they come back through the kernels' casts,
in the compute dtype). Tensor-split vocabularies stay split: each device
adds only its vocab slice's rows. The axes come from the context's logical
rules; model code never holds a mesh. The untied head's gradient takes the
same way (its partials laid out as a table's).

1p3b (4 layers) on 8 H100s (deviceless): under FSDP 2,321 -> 1,446 MiB of
collectives a step, data parallel 1,985 -> 1,110 MiB; both at `mjax-report
comm`'s minimum (bench/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mjax.parallel.rules import mesh_axes


@dataclasses.dataclass(frozen=True)
class Plan:
  """How the partial tables are laid out and summed (mesh axis names).

  batch, seq: the axes splitting the activations' batch and sequence dims.
  embed: the batch axes that also split the table's embed dim (FSDP): the
    partial tables are reduce-scattered over them along embed. () when the
    table is whole on every device (data parallelism): all-reduced.
  vocab: the axes splitting the table's vocab dim (tensor), or () when they
    do not divide it: the partials are split along vocab as the table is.
  n: devices along the batch: the partials' leading dim.
  vocab_shards: devices along vocab.
  """
  batch: tuple[str, ...]
  seq: tuple[str, ...]
  embed: tuple[str, ...]
  vocab: tuple[str, ...]
  n: int
  vocab_shards: int

  @property
  def stacked(self) -> P:
    """The layout of the stacked partials, (n, vocab, embed)."""
    return P(self.batch, self.vocab or None, None)


def plan(tokens_shape: tuple[int, int], shape: tuple[int, int]) -> Optional[Plan]:
  """The Plan for (batch, seq) tokens summed into a (vocab, embed) table in
  this context, or None when there is nothing to write out: no mesh, no axis
  splitting the batch, sizes the axes do not divide, or a region already
  manual over some axis (a pipeline schedule's). GSPMD's sum then stands."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or getattr(mesh, 'manual_axes', ()):
    return None
  size = lambda axes: math.prod(mesh.shape[a] for a in axes)
  live = lambda name, taken=(): tuple(a for a in mesh_axes(name)
                                      if a in mesh.axis_names and mesh.shape[a] > 1 and a not in taken)
  batch = live('batch')
  seq = live('residual_seq', batch)
  embed = tuple(a for a in live('embed') if a in batch)
  vocab = live('vocab', batch)
  vocab = vocab if not shape[0] % size(vocab) else ()
  if not batch or tokens_shape[0] % size(batch) or shape[1] % size(embed):
    return None
  return Plan(batch, seq, embed, vocab, size(batch), size(vocab))


def zeros(p: Plan, shape: tuple[int, int]) -> jax.Array:
  """The stacked partials' primal: (n, vocab, embed) fp32 zeros that nothing
  reads (XLA drops them); their cotangent carries each reader's partials."""
  return jax.lax.with_sharding_constraint(jnp.zeros((p.n, *shape), jnp.float32), p.stacked)


def lookup_partials(p: Plan, shape: tuple[int, int], tokens: jax.Array, ct: jax.Array) -> jax.Array:
  """Each batch shard's fp32 partial table of the lookup `table[tokens]`'s
  gradient (ct's rows added at `tokens`), stacked (n, vocab, embed) in the
  layout `p.stacked`.

  A frequent token's gradient is the sum of thousands of rows: they are
  added in fp32, as a matrix product's accumulator adds. Where vocab is
  split (tensor), each device adds only the rows of its own vocab slice,
  from the whole sequence: under sequence parallelism the cotangent is
  gathered along the sequence for that, a few MiB where summing whole-table
  partials over the sequence's devices would move the table (1p3b: 250 MiB
  in fp32).
  """
  rows = shape[0] // p.vocab_shards

  def body(tok, c):
    if p.vocab:
      lo = _linear_index(p.vocab) * rows
      # Rows of other slices go to index `rows`, out of bounds: dropped.
      tok = jnp.where((tok >= lo) & (tok < lo + rows), tok - lo, rows)
    g = jnp.zeros((rows, shape[1]), jnp.float32).at[tok].add(c.astype(jnp.float32), mode='drop')
    return g[None]

  return _manual(body, (P(p.batch), P(p.batch)), p.stacked)(tokens, ct)


def _linear_index(axes: tuple[str, ...]) -> jax.Array:
  """This device's index along `axes` taken together, the first major (as a
  PartitionSpec entry tiles them)."""
  i = jnp.int32(0)
  for a in axes:
    i = i * jax.lax.axis_size(a) + jax.lax.axis_index(a)
  return i


def head_partials(p: Plan, x: jax.Array, dy: jax.Array) -> jax.Array:
  """Each batch shard's fp32 partial of the tied head's weight gradient,
  dy^T x for logits = x table^T ((batch, seq, embed), (batch, seq, vocab)),
  stacked (n, vocab, embed) in the layout `p.stacked`.

  The batch's split into n shards becomes a batch dim of the product, so
  GSPMD multiplies each shard's rows locally and sums nothing over devices;
  the sequence's devices (sequence parallelism) it handles as in any
  product.
  """
  b, s = x.shape[:2]
  if p.seq:   # the sequence is split: its dim stays apart (no tiled merge)
    xs, ds, dims = x.reshape(p.n, b // p.n, s, -1), dy.reshape(p.n, b // p.n, s, -1), (1, 2)
  else:       # one 2-D product per shard, as layers.matmul runs it
    xs, ds, dims = x.reshape(p.n, b // p.n * s, -1), dy.reshape(p.n, b // p.n * s, -1), (1,)
  g = jax.lax.dot_general(ds, xs, ((dims, dims), ((0,), (0,))), preferred_element_type=jnp.float32)
  return jax.lax.with_sharding_constraint(g, p.stacked)


def reduce_partials(p: Plan, stacked: jax.Array, dtype) -> jax.Array:
  """The sum of the stacked partials, rounded once to `dtype` (the compute
  dtype, as every weight gradient comes back through its cast) and
  reduce-scattered onto the table's shards: embed over FSDP, all-reduced
  over the other batch axes (data), vocab as `p.vocab`."""
  rest = tuple(a for a in p.batch if a not in p.embed)

  def body(g):
    g = g[0].astype(dtype)
    if p.embed:
      g = jax.lax.psum_scatter(g, p.embed, scatter_dimension=1, tiled=True)
    return jax.lax.psum(g, rest) if rest else g

  return _manual(body, (p.stacked,), P(p.vocab or None, p.embed or None))(stacked)


def _manual(body, in_specs, out_specs):
  # Manual over every mesh axis: manual over some only, JAX constrains every
  # op of the body to the others, the reduction's adder too, which XLA's CPU
  # compiler cannot promote for a bf16 reduce-scatter (it aborts). Axes the
  # specs leave out see the same values on each device: each computes the
  # whole, as GSPMD's own lowering would.
  return jax.shard_map(body, in_specs=in_specs, out_specs=out_specs, check_vma=False)
