"""Logical axis names -> mesh axes, in one place.

The model names every dimension with the vocabulary
  batch, seq, embed, heads, kv_heads, kv (head_dim), mlp, vocab, layers
and these rules decide which mesh axes shard each name. Flax resolves a rule
list left to right per array and skips a mesh axis already used by an earlier
dimension of the same array, so `embed -> fsdp` shards weights over `fsdp`
while activations, whose `batch` dimension already took `fsdp`, keep `embed`
whole (ZeRO-3 / FSDP: weights sharded at rest, gathered for use).
"""

from __future__ import annotations

Rules = tuple[tuple[str, object], ...]

# Mesh axis order, outermost (slowest network) first.
MESH_AXES = ('data', 'fsdp', 'tensor', 'pipeline')


def logical_rules() -> Rules:
  """The default layout: data + FSDP over the batch, Megatron-style tensor
  parallelism over heads / MLP hidden / vocabulary."""
  return (
      ('batch', ('data', 'fsdp')),
      ('seq', None),
      ('embed', 'fsdp'),
      ('heads', 'tensor'),
      ('kv_heads', 'tensor'),
      ('kv', None),
      ('mlp', 'tensor'),
      ('vocab', 'tensor'),
      ('layers', None),
  )
