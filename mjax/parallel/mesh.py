"""Device mesh from MeshConfig."""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from mjax.config import ConfigError, MeshConfig, resolve_mesh_shape


def make_mesh(cfg: MeshConfig, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """Builds the (data, fsdp, tensor, pipeline) mesh.

  Fast axes (the plain sizes) stay inside a host/slice; the `dcn_*` sizes span
  hosts. Axis types are Auto: sharding is propagated by GSPMD from the jit
  in/out shardings and the model's logical constraints.
  """
  devices = list(devices if devices is not None else jax.devices())
  ici = resolve_mesh_shape(cfg, len(devices))
  dcn = cfg.dcn_shape()
  if np.prod(dcn) > 1:
    # The slow network's units: slices where the devices name as many as the
    # dcn shape asks for (TPU slices; GPU hosts, one slice each whatever
    # their processes), else processes (CPU processes all say slice 0).
    slices = {getattr(d, 'slice_index', None) for d in devices}
    by_process = None in slices or len(slices) != np.prod(dcn)
    processes = len({d.process_index for d in devices})
    if by_process and processes != np.prod(dcn):
      raise ConfigError(
          f'MeshConfig.dcn_* = {dict(zip(MeshConfig.AXES, dcn))} is not allowed here: their product '
          f'({int(np.prod(dcn))}) must equal the number of processes (hosts) the mesh spans, {processes}; '
          f'the dcn_* sizes split the mesh between hosts over the slow network. '
          + ('On one process leave them at 1.' if processes == 1 else
             f'Make their product {processes}, or leave them at 1.'))
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices, process_is_granule=by_process)
  elif len(devices) == len(jax.devices()):
    grid = mesh_utils.create_device_mesh(ici, devices=devices)
  else:  # a subset (tests): keep the given order
    grid = np.asarray(devices).reshape(ici)
  # Axes in MeshConfig.AXES order: outermost (slowest network) first.
  return Mesh(grid, MeshConfig.AXES, axis_types=(AxisType.Auto,) * len(MeshConfig.AXES))
