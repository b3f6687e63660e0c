"""Logical axis names -> mesh axes, in one place.

The model names every dimension with one vocabulary:
  batch         sequences
  residual_seq  sequence positions of the residual stream and norms (between
                and at the edges of blocks)
  seq           sequence positions inside attention and the MLP
  embed, heads, kv_heads, kv (head_dim), mlp, vocab
  layers        the scanned layer axis of stacked parameters
  stage, repeat pipeline stage and circular repeat of re-laid-out parameters

Flax resolves a rule list left to right per array and skips a mesh axis
already used by an earlier dimension of the same array. So `embed -> fsdp`
shards weights over `fsdp` at rest while activations, whose `batch`
dimension already took `fsdp`, keep `embed` whole: ZeRO-3 / FSDP, weights
gathered for use. Likewise `residual_seq -> tensor` (sequence parallelism)
shards the residual stream, while q/k/v and the MLP hidden, named `seq`,
stay whole along the sequence and split over heads / mlp instead.

`collective_matmul` names no array dimension: its rule says which mesh axis
the projections' collective matmuls run over (mjax/parallel/collective_matmul.py),
`tensor` when MeshConfig.collective_matmul is set, else none. Model code reads
it from the context like every other rule.
"""

from __future__ import annotations

import jax
from flax import linen as nn

from mjax.config import MeshConfig

Rules = tuple[tuple[str, object], ...]


def logical_rules(mesh: MeshConfig | None = None) -> Rules:
  """Rules for the layout `mesh` describes (default: data + FSDP + tensor)."""
  sp = mesh is not None and mesh.sequence_parallel
  cm = mesh is not None and mesh.collective_matmul
  return (
      ('batch', ('data', 'fsdp')),
      ('residual_seq', 'tensor' if sp else None),
      ('seq', None),
      ('embed', 'fsdp'),
      ('heads', 'tensor'),
      ('kv_heads', 'tensor'),
      ('kv', None),
      ('mlp', 'tensor'),
      ('vocab', 'tensor'),
      ('stage', 'pipeline'),
      ('repeat', None),
      ('layers', None),
      ('collective_matmul', 'tensor' if cm else None),
  )


def mesh_axes(name: str) -> tuple[str, ...]:
  """The mesh axes the context's logical rules give dimension `name`, in
  order (() when none): how model code reads a layout without a mesh."""
  spec = nn.logical_to_mesh_axes((name,))
  axes = spec[0] if spec else None
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def data_axis() -> str | None:
  """The mesh axis of data parallelism when it splits the batch (size > 1):
  the pipeline schedules and the accumulation slices run manual over it,
  so gradients are summed over it once per step."""
  mesh = jax.sharding.get_abstract_mesh()
  return 'data' if 'data' in mesh_axes('batch') and mesh.shape.get('data', 1) > 1 else None


def rules_without(*axes: str | None):
  """The current logical rules with `axes` taken out (a context manager):
  inside a region manual over them, the batch is already this shard's and
  must not be placed on those axes again."""
  rules = nn.get_logical_axis_rules()
  for axis in axes:
    rules = _without_axis(rules, axis)
  return nn.logical_axis_rules(rules)


def _without_axis(rules, axis: str | None):
  """Logical rules with `axis` taken out of every mapping."""
  if axis is None:
    return rules
  out = []
  for name, target in rules:
    if isinstance(target, (tuple, list)):
      kept = tuple(t for t in target if t != axis)
      target = kept if len(kept) > 1 else (kept[0] if kept else None)
    elif target == axis:
      target = None
    out.append((name, target))
  return tuple(out)
