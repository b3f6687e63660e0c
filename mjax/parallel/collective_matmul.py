"""Collective matmul: tensor-parallel projections with the sequence-parallel
all-gather / reduce-scatter overlapped with the matrix products.

Under sequence parallelism the residual stream is split along the sequence
over `tensor`. The input projections (q, k, v, MLP in; kernels split along
their output features) need the whole sequence, so GSPMD all-gathers the
activations first and multiplies after; the output projections (kernels
split along their input) produce partial sums that it reduce-scatters
afterwards. Both wait on the network.

Here the transfer is cut into `tensor` chunks passed around a ring with
`ppermute` (Wang et al. 2023, "Overlap communication with dependent
computation via decomposition"; MegaScale, Megatron, MaxText, Praxis):
  all_gather_matmul: at step i each device multiplies the sequence chunk it
    holds while the chunk for step i + 1 travels from its neighbour.
  matmul_reduce_scatter: at step i each device adds its partial product for
    one sequence chunk to the running sum that arrived from its neighbour,
    while the sum of step i - 1 travels on.
Autodiff of ppermute is the reverse ppermute, so the backward passes are the
same rings run the other way, also overlapped.

XLA's own windowed einsum (xla_gpu_threshold_for_windowed_einsum_mib) would
do the same inside the partitioner, but in jax 0.10 its loop count is capped
by the fast-interconnect slice size that only a live GPU client detects
(deviceless compiles get 0 and never emit it), so it can neither be relied
on nor checked ahead of time.

The functions run as a `shard_map` manual over the ring axis only: batch
(data / fsdp) sharding and the FSDP weight gathers stay with GSPMD, as in
every other matmul of the model, so the specs need not be resolved from the
logical rules and the same code serves any data x fsdp layout.

Whether the model uses them is read from the context: the logical rules map
the pseudo-axis `collective_matmul` to the ring's mesh axis when
MeshConfig.collective_matmul is set (mjax/parallel/rules.py). Model code
never holds a mesh.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec as P

# The logical name whose rule says which mesh axis (if any) the rings run on.
RING = 'collective_matmul'


def _shard_map(body, in_specs, out_specs, axis: str):
  """shard_map manual over `axis` only, on the context mesh."""
  if hasattr(jax, 'shard_map'):
    return jax.shard_map(body, in_specs=in_specs, out_specs=out_specs, axis_names={axis}, check_vma=False)
  from jax.experimental.shard_map import shard_map  # jax < 0.7
  mesh = jax.sharding.get_abstract_mesh()
  auto = frozenset(a for a in mesh.axis_names if a != axis)
  return shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False, auto=auto)


def ring_axis() -> Optional[str]:
  """The mesh axis collective matmuls run over in this context, or None.

  None outside a mesh, when the rules do not ask for them, when the axis has
  one device, or inside a region already manual over it (nothing to gather).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return None
  spec = nn.logical_to_mesh_axes((RING,))
  axis = spec[0] if spec else None
  if not isinstance(axis, str) or axis not in mesh.axis_names or mesh.shape[axis] == 1:
    return None
  if axis in getattr(mesh, 'manual_axes', ()):
    return None
  return axis


def _dot(x: jax.Array, kernel: jax.Array, n_in: int) -> jax.Array:
  """x's trailing `n_in` dims contracted with the kernel's leading ones."""
  return jax.lax.dot_general(x, kernel, ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ())))


def _shift_left(x: jax.Array, axis: str, t: int) -> jax.Array:
  """Device j's value to device j - 1 (so each receives its right neighbour's)."""
  return jax.lax.ppermute(x, axis, [(j, (j - 1) % t) for j in range(t)])


def _all_gather_matmul_local(x: jax.Array, kernel: jax.Array, *, n_in: int, axis: str, t: int) -> jax.Array:
  """Per device: x (b, s/t, *in), kernel (*in, *f/t) -> (b, s, *f/t).

  After i shifts device j holds sequence chunk (j + i) % t; its product goes
  to that chunk's slot of the output. The shift is issued before the product
  so the two are independent and the scheduler runs them side by side.
  """
  b, sl = x.shape[:2]
  idx = jax.lax.axis_index(axis)
  out = None
  chunk = x
  for i in range(t):
    y = _dot(chunk, kernel, n_in)                                   # (b, s/t, *f/t)
    if i < t - 1:
      # The next step's chunk passes through a barrier with this product:
      # XLA's dot merger would otherwise join the t products (one kernel,
      # independent chunks) into one, after every transfer. The kernel stays
      # out of it: its gradient would come back in t parts, each all-reduced
      # over the batch axes on its own.
      chunk, y = jax.lax.optimization_barrier((_shift_left(chunk, axis, t), y))
    if out is None:
      out = jnp.zeros((b, t, *y.shape[1:]), y.dtype)
    out = jax.lax.dynamic_update_index_in_dim(out, y, (idx + i) % t, axis=1)
  return out.reshape(b, t * sl, *out.shape[3:])


def _matmul_reduce_scatter_local(x: jax.Array, kernel: jax.Array, *, n_in: int, axis: str,
                                 t: int) -> jax.Array:
  """Per device: x (b, s, *in/t), kernel (*in/t, *f) -> (b, s/t, *f), summed over the ring.

  At step i device j adds its partial product for chunk (j + i + 1) % t to the
  sum received from device j + 1 (which had that chunk at step i - 1); after
  t - 1 shifts the sum for chunk j is complete on device j.
  """
  sl = x.shape[1] // t
  idx = jax.lax.axis_index(axis)
  part = lambda c, a, k: _dot(jax.lax.dynamic_slice_in_dim(a, c * sl, sl, axis=1), k, n_in)
  acc = part((idx + 1) % t, x, kernel)
  for i in range(1, t):
    # As in the all-gather ring, a barrier keeps the partial products apart
    # (each waits for the sum before it), while the transfer of that sum and
    # this step's product stay independent of each other.
    x, acc = jax.lax.optimization_barrier((x, acc))
    acc = _shift_left(acc, axis, t) + part((idx + i + 1) % t, x, kernel)
  return acc


def _spec(ndim: int, dim: Optional[int], axis: str) -> P:
  return P(*(axis if d == dim else None for d in range(ndim)))


def all_gather_matmul(x: jax.Array, kernel: jax.Array, *, n_in: int, out_dim: int, axis: str) -> jax.Array:
  """x (b, s, *in) sequence-split over `axis` times kernel (*in, *f) split over
  `axis` along feature dim `out_dim` (an index into f) -> (b, s, *f) with the
  whole sequence and the features split, as the all-gather + einsum would."""
  t = jax.sharding.get_abstract_mesh().shape[axis]
  body = lambda a, k: _all_gather_matmul_local(a, k, n_in=n_in, axis=axis, t=t)
  out_ndim = x.ndim - n_in + kernel.ndim - n_in
  f = _shard_map(body, (_spec(x.ndim, 1, axis), _spec(kernel.ndim, n_in + out_dim, axis)),
                 _spec(out_ndim, x.ndim - n_in + out_dim, axis), axis)
  return f(x, kernel)


def matmul_reduce_scatter(x: jax.Array, kernel: jax.Array, *, n_in: int, in_dim: int, axis: str) -> jax.Array:
  """x (b, s, *in) split over `axis` along contracted dim `in_dim` (an index
  into in) times kernel (*in, *f) split the same way -> (b, s, *f), the sum
  over the ring, sequence-split over `axis`, as einsum + reduce-scatter would."""
  t = jax.sharding.get_abstract_mesh().shape[axis]
  body = lambda a, k: _matmul_reduce_scatter_local(a, k, n_in=n_in, axis=axis, t=t)
  out_ndim = x.ndim - n_in + kernel.ndim - n_in
  f = _shard_map(body, (_spec(x.ndim, x.ndim - n_in + in_dim, axis), _spec(kernel.ndim, in_dim, axis)),
                 _spec(out_ndim, 1, axis), axis)
  return f(x, kernel)


def _dims_on(spec, axis: str) -> list[int]:
  """Dims of a resolved PartitionSpec whose mesh axes include `axis`."""
  dims = []
  for d, a in enumerate(spec):
    if a == axis or (isinstance(a, tuple) and axis in a):
      dims.append(d)
  return dims


def projection(x: jax.Array, kernel: jax.Array, n_in: int, axes: tuple[Optional[str], ...]) -> Optional[jax.Array]:
  """x's trailing `n_in` dims times the kernel (logical names `axes`) as a
  collective matmul when the context asks for one and the layout is one of
  the two it covers; None otherwise (the caller runs the plain product).

  Covered: x (batch, seq, ...) with seq divisible by the ring size and the
  kernel split over the ring axis on exactly one dim, that axis alone:
  an output dim (column-parallel: q/k/v, MLP in) or a contracted dim
  (row-parallel: attention out, MLP out).
  """
  axis = ring_axis()
  if axis is None or x.ndim < 3:
    return None
  t = jax.sharding.get_abstract_mesh().shape[axis]
  if x.shape[1] % t:
    return None  # e.g. one decoding step: no sequence to split
  spec = tuple(nn.logical_to_mesh_axes(axes))
  spec = spec + (None,) * (kernel.ndim - len(spec))
  dims = _dims_on(spec, axis)
  if len(dims) != 1 or spec[dims[0]] not in (axis, (axis,)):
    return None
  d = dims[0]
  x = x.astype(kernel.dtype)
  if d >= n_in:
    return all_gather_matmul(x, kernel, n_in=n_in, out_dim=d - n_in, axis=axis)
  return matmul_reduce_scatter(x, kernel, n_in=n_in, in_dim=d, axis=axis)
