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
do the same inside the partitioner. In jax 0.10 its loop count is capped by
the fast-interconnect slice size that only a live GPU client detects
(deviceless compiles get 0 and never emit it); jaxlib 0.11 emits it, and
for a tensor x sequence parallel step it sends 2.7x the bytes of the plain
all-gathers and reduce-scatters, many of its permutes synchronous
(xla_flags.config_flags), where these rings send fewer than they do.

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

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec as P

# The logical name whose rule says which mesh axis (if any) the rings run on.
RING = 'collective_matmul'


def _shard_map(body, in_specs, out_specs, axis: str, t: int):
  """shard_map manual over `axis` only, on the context mesh; `body` gets this
  device's index along `axis` as its first argument.

  The index comes in as a slice of an iota split over `axis`, not from
  `axis_index`: that lowers to a partition-id, which XLA's partitioner
  refuses outside a fully manual region once the layers are unrolled ("the
  meaning is ambiguous"; an H100 compile of 1p3b with collective matmul).
  """
  ids = jnp.arange(t, dtype=jnp.int32)
  f = jax.shard_map(lambda i, *args: body(i[0], *args), in_specs=(P(axis), *in_specs), out_specs=out_specs,
                    axis_names={axis}, check_vma=False)
  return lambda *args: f(ids, *args)


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


def contract(x: jax.Array, kernel: jax.Array, n_in: int) -> jax.Array:
  """x's trailing `n_in` dims contracted with the kernel's leading ones."""
  return jax.lax.dot_general(x, kernel, ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ())))


def _shift_left(x: jax.Array, axis: str, t: int) -> jax.Array:
  """Device j's value to device j - 1 (so each receives its right neighbour's)."""
  return jax.lax.ppermute(x, axis, [(j, (j - 1) % t) for j in range(t)])


def _all_gather_matmul_local(idx: jax.Array, x: jax.Array, kernels: tuple, *, n_in: int, axis: str,
                             t: int) -> tuple:
  """Per device `idx` along `axis`: x (b, s/t, *in), kernels (*in, *f_i/t) ->
  each (b, s, *f_i/t).

  After i shifts device j holds sequence chunk (j + i) % t; its products go
  to that chunk's slot of the outputs. Every kernel reads the same chunk, so
  one ring serves them all (q, k, v and the MLP input: one transfer, not
  four). The shift is issued before the products so the two are independent
  and the scheduler runs them side by side.
  """
  b, sl = x.shape[:2]
  outs = None
  chunk = x
  for i in range(t):
    ys = tuple(contract(chunk, k, n_in) for k in kernels)               # each (b, s/t, *f/t)
    if i < t - 1:
      # The next step's chunk passes through a barrier with these products:
      # XLA's dot merger would otherwise join the t products (one kernel,
      # independent chunks) into one, after every transfer. The kernels stay
      # out of it: their gradients would come back in t parts, each
      # all-reduced over the batch axes on its own.
      chunk, ys = jax.lax.optimization_barrier((_shift_left(chunk, axis, t), ys))
    if outs is None:
      outs = [jnp.zeros((b, t, *y.shape[1:]), y.dtype) for y in ys]
    outs = [jax.lax.dynamic_update_index_in_dim(o, y, (idx + i) % t, axis=1) for o, y in zip(outs, ys)]
  return tuple(o.reshape(b, t * sl, *o.shape[3:]) for o in outs)


def _matmul_reduce_scatter_local(idx: jax.Array, xs: tuple, kernels: tuple, *, n_ins: tuple, axis: str,
                                 t: int) -> jax.Array:
  """Per device `idx` along `axis`: xs (b, s, *in_i/t), kernels (*in_i/t, *f)
  -> (b, s/t, *f), sum_i x_i @ k_i summed over the ring.

  At step i device j adds its partial products for chunk (j + i + 1) % t to
  the sum received from device j + 1 (which had that chunk at step i - 1);
  after t - 1 shifts the sum for chunk j is complete on device j. Several
  products summed (attention's and the MLP's output projections) share the
  one ring.
  """
  sl = xs[0].shape[1] // t

  def part(c, xs):
    return sum(contract(jax.lax.dynamic_slice_in_dim(x, c * sl, sl, axis=1), k, n)
               for x, k, n in zip(xs, kernels, n_ins))

  acc = part((idx + 1) % t, xs)
  for i in range(1, t):
    # As in the all-gather ring, a barrier keeps the partial products apart
    # (each waits for the sum before it), while the transfer of that sum and
    # this step's product stay independent of each other.
    xs, acc = jax.lax.optimization_barrier((xs, acc))
    acc = _shift_left(acc, axis, t) + part((idx + i + 1) % t, xs)
  return acc


def _spec(ndim: int, dim: Optional[int], axis: str) -> P:
  return P(*(axis if d == dim else None for d in range(ndim)))


def all_gather_matmul(x: jax.Array, kernels: Sequence[jax.Array], *, n_in: int, out_dims: Sequence[int],
                      axis: str) -> list[jax.Array]:
  """x (b, s, *in) sequence-split over `axis` times each kernel (*in, *f_i)
  split over `axis` along feature dim `out_dims[i]` (an index into f_i) ->
  each (b, s, *f_i) with the whole sequence and the features split, as the
  all-gather + einsums would, with one ring for all of them."""
  t = jax.sharding.get_abstract_mesh().shape[axis]
  body = lambda i, a, ks: _all_gather_matmul_local(i, a, ks, n_in=n_in, axis=axis, t=t)
  k_specs = tuple(_spec(k.ndim, n_in + d, axis) for k, d in zip(kernels, out_dims))
  o_specs = tuple(_spec(x.ndim - n_in + k.ndim - n_in, x.ndim - n_in + d, axis)
                  for k, d in zip(kernels, out_dims))
  f = _shard_map(body, (_spec(x.ndim, 1, axis), k_specs), o_specs, axis, t)
  return list(f(x, tuple(kernels)))


def matmul_reduce_scatter(xs: Sequence[jax.Array], kernels: Sequence[jax.Array], *, n_ins: Sequence[int],
                          in_dims: Sequence[int], axis: str) -> jax.Array:
  """Each x_i (b, s, *in_i) split over `axis` along contracted dim
  `in_dims[i]` (an index into in_i) times kernel_i (*in_i, *f) split the same
  way -> (b, s, *f): the sum over i and over the ring, sequence-split over
  `axis`, as einsums + one reduce-scatter would."""
  t = jax.sharding.get_abstract_mesh().shape[axis]
  body = lambda i, a, ks: _matmul_reduce_scatter_local(i, a, ks, n_ins=tuple(n_ins), axis=axis, t=t)
  x_specs = tuple(_spec(x.ndim, x.ndim - n + d, axis) for x, n, d in zip(xs, n_ins, in_dims))
  k_specs = tuple(_spec(k.ndim, d, axis) for k, d in zip(kernels, in_dims))
  out_ndim = xs[0].ndim - n_ins[0] + kernels[0].ndim - n_ins[0]
  f = _shard_map(body, (x_specs, k_specs), _spec(out_ndim, 1, axis), axis, t)
  return f(tuple(xs), tuple(kernels))


def _dims_on(spec, axis: str) -> list[int]:
  """Dims of a resolved PartitionSpec whose mesh axes include `axis`."""
  dims = []
  for d, a in enumerate(spec):
    if a == axis or (isinstance(a, tuple) and axis in a):
      dims.append(d)
  return dims


def _ring_dim(kernel: jax.Array, axes: tuple[Optional[str], ...], axis: str) -> Optional[int]:
  """The one kernel dim split over the ring axis (that axis alone), else None."""
  spec = tuple(nn.logical_to_mesh_axes(axes))
  spec = spec + (None,) * (kernel.ndim - len(spec))
  dims = _dims_on(spec, axis)
  if len(dims) != 1 or spec[dims[0]] not in (axis, (axis,)):
    return None
  return dims[0]


def _ring_for(x: jax.Array) -> Optional[str]:
  """The ring axis for activations `x` (batch, seq, ...), or None: no ring
  asked for, or a sequence the ring cannot split (one decoding step)."""
  axis = ring_axis()
  if axis is None or x.ndim < 3 or x.shape[1] % jax.sharding.get_abstract_mesh().shape[axis]:
    return None
  return axis


def wanted(x: jax.Array) -> bool:
  """Whether the context asks for collective matmuls on activations `x`."""
  return _ring_for(x) is not None


def input_projections(x: jax.Array, kernels: Sequence[jax.Array], n_in: int,
                      axes: Sequence[tuple[Optional[str], ...]]) -> Optional[list[jax.Array]]:
  """x's trailing `n_in` dims times each kernel (logical names `axes[i]`),
  all column-parallel (split over the ring along an output dim: q, k, v, MLP
  in), as one all-gather ring when the context asks for collective matmul;
  None otherwise (the caller runs the plain products)."""
  axis = _ring_for(x)
  if axis is None:
    return None
  dims = [_ring_dim(k, a, axis) for k, a in zip(kernels, axes)]
  if any(d is None or d < n_in for d in dims):
    return None
  x = x.astype(kernels[0].dtype)
  return all_gather_matmul(x, kernels, n_in=n_in, out_dims=[d - n_in for d in dims], axis=axis)


def output_projections(parts: Sequence[tuple[jax.Array, jax.Array, int, tuple[Optional[str], ...]]]
                       ) -> Optional[jax.Array]:
  """sum_i x_i @ kernel_i for parts (x_i, kernel_i, n_in_i, logical names of
  kernel_i), all row-parallel (split over the ring along a contracted dim:
  attention out, MLP out), as one reduce-scatter ring when the context asks
  for collective matmul; None otherwise."""
  axis = _ring_for(parts[0][0])
  if axis is None:
    return None
  dims = [_ring_dim(k, a, axis) for _, k, _, a in parts]
  if any(d is None or d >= n for d, (_, _, n, _) in zip(dims, parts)):
    return None
  dtype = parts[0][1].dtype
  return matmul_reduce_scatter([x.astype(dtype) for x, _, _, _ in parts], [k for _, k, _, _ in parts],
                               n_ins=[n for _, _, n, _ in parts], in_dims=dims, axis=axis)


def projection(x: jax.Array, kernel: jax.Array, n_in: int, axes: tuple[Optional[str], ...]) -> Optional[jax.Array]:
  """x's trailing `n_in` dims times the kernel (logical names `axes`) as a
  collective matmul when the context asks for one and the layout is one of
  the two it covers; None otherwise (the caller runs the plain product).

  Covered: x (batch, seq, ...) with seq divisible by the ring size and the
  kernel split over the ring axis on exactly one dim, that axis alone:
  an output dim (column-parallel: q/k/v, MLP in) or a contracted dim
  (row-parallel: attention out, MLP out).
  """
  axis = _ring_for(x)
  if axis is None:
    return None
  d = _ring_dim(kernel, axes, axis)
  if d is None:
    return None
  if d >= n_in:
    return input_projections(x, [kernel], n_in, [axes])[0]
  return output_projections([(x, kernel, n_in, axes)])
