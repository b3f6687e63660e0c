"""Single-replica restore (MegaScale's): one data-parallel replica reads the
state and one collective sends it to the others, bit for bit.

Orbax has one (type_handlers.SingleReplicaArrayHandler with
SingleReplicaArrayRestoreArgs), and it runs between CPU processes here, but
two of its properties rule it out for mjax (orbax-checkpoint 0.12.8):
 - it is not bit-exact: its broadcast sums the replicas in the array's own
   dtype (_src/multihost/multislice.py, _sum_over_replica_axis), and
   -0.0 + 0.0 = +0.0, so a negative zero arrives as a positive one on every
   replica: the state differs from the one saved, and its checksums (see
   `fingerprints`) call a sound checkpoint damaged;
 - it reads and broadcasts in one call (_src/serialization/
   jax_array_handlers.py, _single_replica_deserialize_and_broadcast): when
   the reading replica fails (a truncated file) it raises, while the other
   replicas already wait in the broadcast's collective; the job hangs until
   the coordination service aborts it, instead of falling back a step.
So the reading replica reads with Orbax's ordinary handler onto its own
devices, every process learns whether that went well (coordination
service, `restore_latest`), and one jitted sum over the data axis of the
arrays' bits as unsigned integers (x + 0 is exact for integers; the other
replicas contribute zeros) puts the state onto the target shardings, as
multislice.broadcast_one_replica_to_all does with floats.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


REPLICA_AXIS = 'data'
# Bytes per device that one broadcast program moves: bounds the temporary
# buffers (the replica's copy, the zeros, the result) to a few times this.
_BROADCAST_CHUNK_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class ReplicaPlan:
  """How one data-parallel replica restores the state for all of them."""
  mesh: Mesh             # the state's mesh
  replica_mesh: Mesh     # its devices at data index 0 (the `data` axis kept, size 1)
  replicas: int          # size of the `data` axis
  source: bool           # this process holds devices of the reading replica


def _spec_axes(spec: PartitionSpec) -> set:
  return {a for entry in spec for a in (entry if isinstance(entry, tuple) else (entry,))}


def replica_plan(abstract_state: Any) -> Optional[ReplicaPlan]:
  """The single-replica plan for restoring `abstract_state`, or None when
  every process should read the shards its own devices hold:
    - one process: Orbax already reads each distinct shard once per process
      and copies it to every local device that holds it;
    - a `data` axis of size 1, or an array sharded over it: nothing to share;
    - a process holding devices of several replicas: it would read a whole
      replica anyway, so sending it one saves nothing.

  Args:
    abstract_state: ShapeDtypeStructs with NamedShardings on one mesh.
  """
  leaves = jax.tree.leaves(abstract_state)
  shardings = [getattr(x, 'sharding', None) for x in leaves]
  if jax.process_count() == 1 or not leaves or not all(isinstance(s, NamedSharding) for s in shardings):
    return None
  mesh = shardings[0].mesh
  if (not isinstance(mesh, Mesh) or REPLICA_AXIS not in mesh.axis_names or mesh.shape[REPLICA_AXIS] < 2
      or any(s.mesh != mesh or REPLICA_AXIS in _spec_axes(s.spec) for s in shardings)):
    return None
  axis = mesh.axis_names.index(REPLICA_AXIS)
  replicas_of = collections.defaultdict(set)
  for index, device in np.ndenumerate(mesh.devices):
    replicas_of[device.process_index].add(index[axis])
  if any(len(r) > 1 for r in replicas_of.values()):
    return None
  first = np.take(mesh.devices, [0], axis=axis)
  return ReplicaPlan(mesh=mesh, replica_mesh=Mesh(first, mesh.axis_names, axis_types=mesh.axis_types),
                     replicas=mesh.shape[REPLICA_AXIS],
                     source=jax.process_index() in {d.process_index for d in first.flat})


def on_replica(plan: ReplicaPlan, abstract_state: Any) -> Any:
  """`abstract_state` with the same specs on the reading replica's devices."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(plan.replica_mesh, x.sharding.spec)), abstract_state)


def _to_words(x: jax.Array) -> jax.Array:
  """The array's bits as unsigned integers of a width every collective
  library reduces (NCCL has no 16-bit unsigned type): 2-byte elements
  become two uint8, 8-byte ones two uint32 (a trailing axis)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint8)
  return jax.lax.bitcast_convert_type(x, jnp.uint32 if x.dtype.itemsize % 4 == 0 else jnp.uint8)


def _from_words(w: jax.Array, dtype) -> jax.Array:
  return w != 0 if dtype == jnp.bool_ else jax.lax.bitcast_convert_type(w, dtype)


def _merge(words: list, dtypes: tuple) -> list:
  # Integer sums: only the reading replica's words are non-zero, so each sum
  # is that replica's words, bit for bit (NaN payloads and -0.0 included).
  return [_from_words(jnp.sum(w, axis=0, dtype=w.dtype), d) for w, d in zip(words, dtypes)]


def _globalized(plan: ReplicaPlan, target: jax.ShapeDtypeStruct, replica: Optional[jax.Array]) -> jax.Array:
  """A (replicas, *words) array over the whole mesh: the reading replica's
  words at index 0, zeros elsewhere (allocated on each device)."""
  words = jax.eval_shape(_to_words, jax.ShapeDtypeStruct(target.shape, target.dtype))
  spec = tuple(target.sharding.spec) + (None,) * (words.ndim - len(target.sharding.spec))
  sharding = NamedSharding(plan.mesh, PartitionSpec(REPLICA_AXIS, *spec))
  shape = (plan.replicas, *words.shape)
  mine = {s.device: s.data for s in replica.addressable_shards} if replica is not None else {}
  buffers = []
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    if device in mine:   # same spec on a mesh that differs only in `data`: the same block
      buffers.append(_to_words(mine[device])[None])
    else:
      block = tuple(len(range(*i.indices(n))) for i, n in zip(index, shape))
      buffers.append(jnp.zeros(block, words.dtype, device=device))
  return jax.make_array_from_single_device_arrays(shape, sharding, buffers)


def _chunks(targets: list, budget: int) -> list[tuple[int, int]]:
  """[start, end) ranges of `targets` whose per-device bytes stay within
  `budget` (a larger array goes alone)."""
  out, start, used = [], 0, 0
  for i, t in enumerate(targets):
    nbytes = math.prod(t.sharding.shard_shape(t.shape)) * np.dtype(t.dtype).itemsize
    if i > start and used + nbytes > budget:
      out.append((start, i))
      start, used = i, 0
    used += nbytes
  return out + ([(start, len(targets))] if start < len(targets) else [])


def broadcast_from_replica(plan: ReplicaPlan, replica_state: Any, abstract_state: Any,
                           chunk_bytes: int = _BROADCAST_CHUNK_BYTES) -> Any:
  """The reading replica's state on every replica, bit for bit. A collective:
  every process calls it.

  Args:
    plan: from `replica_plan(abstract_state)`.
    replica_state: the state on `plan.replica_mesh` (`on_replica`) in the
      reading replica's processes; None elsewhere. Its arrays are deleted.
    abstract_state: the target shapes, dtypes and shardings.
  Returns:
    The state with `abstract_state`'s shardings.
  """
  targets, treedef = jax.tree.flatten(abstract_state)
  sources = jax.tree.leaves(replica_state) if plan.source else [None] * len(targets)
  if len(sources) != len(targets):
    raise ValueError(f'the replica\'s state has {len(sources)} arrays, the target {len(targets)}')
  out = []
  for start, end in _chunks(targets, chunk_bytes):
    part = targets[start:end]
    words = [_globalized(plan, t, s) for t, s in zip(part, sources[start:end])]
    for s in sources[start:end]:
      if s is not None:
        s.delete()   # the words hold a copy: free the replica's before the result is made
    merge = jax.jit(_merge, static_argnums=1, out_shardings=[t.sharding for t in part])
    out.extend(merge(words, tuple(np.dtype(t.dtype) for t in part)))
    del words
  return jax.tree.unflatten(treedef, out)
