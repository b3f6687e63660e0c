"""Every parameter's size and the mesh axes that shard it, from the config.

Shapes come from `eval_shape` (nothing is allocated, so 175B works on a
laptop) and mesh axes from the logical-axis rules, so the analytical
communication and memory estimates follow whatever layout the rules define.
Pipeline parallelism splits the stacked `layers` axis into stages; that split
is applied here whether or not the rules name the `pipeline` axis.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional, Sequence

import jax
import numpy as np
from flax import linen as nn

from mjax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ParamInfo:
  """One parameter array.

  Attributes:
    path: its name in the parameter tree, e.g. "['layers']['block_0']['mlp']['wi']['kernel']".
    shape: the full (unsharded) shape.
    itemsize: bytes per element of the stored (master) parameter.
    spec: per dimension, the mesh axes that shard it (() = replicated).
    layers: True for parameters stacked along the scanned `layers` axis.
  """
  path: str
  shape: tuple[int, ...]
  itemsize: int
  spec: tuple[tuple[str, ...], ...]
  layers: bool

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def in_layers(self) -> bool:
    """A layer's parameter, scanned ("['layers']...") or not ("['layers_3']...");
    not the embedding, final norm or head."""
    return self.path.startswith("['layers")

  def axes(self) -> set[str]:
    return {a for dim in self.spec for a in dim}

  def shards(self, mesh: Mapping[str, int], axes: Optional[Sequence[str]] = None) -> int:
    """Pieces the array is cut into by the mesh axes in `axes` (default: all).

    Stacked-layer parameters are also cut into `pipeline` stages.
    """
    used = self.axes() | ({'pipeline'} if self.layers else set())
    if axes is not None:
      used &= set(axes)
    return math.prod(mesh.get(a, 1) for a in used)


def _spec_axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def param_infos(cfg: ModelConfig, rules=None) -> list[ParamInfo]:
  """All parameters of the model with their sharding under `rules`.

  Args:
    cfg: the model shape.
    rules: logical-axis rules (default: mjax.parallel.logical_rules()).
  Returns:
    One ParamInfo per parameter array.
  """
  from mjax.model.flops import abstract_params
  from mjax.parallel.rules import logical_rules
  rules = logical_rules() if rules is None else rules
  boxed = abstract_params(cfg)
  is_box = lambda x: isinstance(x, nn.Partitioned)
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(boxed, is_leaf=is_box)[0]:
    value = leaf.value if is_box(leaf) else leaf
    names = tuple(leaf.names) if is_box(leaf) else (None,) * len(value.shape)
    spec = nn.logical_to_mesh_axes(names, rules) if is_box(leaf) else None
    spec = tuple(_spec_axes(e) for e in (spec or (None,) * len(value.shape)))
    spec = spec + ((),) * (len(value.shape) - len(spec))
    out.append(ParamInfo(path=jax.tree_util.keystr(path), shape=tuple(value.shape),
                         itemsize=np.dtype(value.dtype).itemsize, spec=spec,
                         layers=bool(names) and names[0] == 'layers'))
  return out
