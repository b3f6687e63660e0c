"""What mjax's Pallas kernels for Hopper GPUs share: which device a program
runs on, its SM count, the limits their tilings are checked against, and
the GPU interpreter that runs them on a CPU for tests.

The kernels (mjax/model/gelu_kernel.py, mjax/model/rotary_kernel.py) are
JAX's own Hopper matmul (jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu:
a persistent grid, a TMA pipeline run by a producer warpgroup, two consumer
warpgroups issuing wgmma) with an epilogue of their own in place of its
plain store. They run on one sm_90 GPU; everywhere else the model takes
XLA's kernels for the same values.
"""

from __future__ import annotations

import math
import re

import jax

# Hopper (sm_90) GPUs by name: wgmma, which the kernels issue, is theirs only.
_HOPPER = re.compile(r'\bG?H(100|200|800|20)\b')

# An H100's shared memory a block may take, and the mbarriers a kernel may use.
SMEM_BYTES = 232448
MAX_BARRIERS = 32


def one_device_kind() -> str:
  """The device kind the program being traced runs on, '' unless it runs
  on one device: from the mesh in context (a compile for a described GPU
  too), else from jax's devices."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is not None and not mesh.empty:
    if math.prod(mesh.shape.values()) != 1:
      return ''
    return getattr(getattr(mesh, 'abstract_device', None), 'device_kind', None) or ''
  if jax.device_count() != 1:
    return ''
  device = jax.devices()[0]
  return device.device_kind if device.platform == 'gpu' else ''


def on_one_hopper() -> bool:
  """Whether the program being traced runs on one Hopper GPU (with
  several, a product's operands are split over devices, which the kernels
  cannot be)."""
  return bool(_HOPPER.search(one_device_kind()))


def sm_count() -> int:
  """The GPU's SM count: the persistent grid's size. Read from the mesh's
  device description where there is one (a compile for a described GPU),
  else from the device."""
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, 'abstract_device', None)
  if getattr(device, 'num_cores', None):
    return int(device.num_cores)
  try:
    return int(jax.devices()[0].core_count)
  except (AttributeError, RuntimeError, TypeError, ValueError):
    return 132   # an H100 SXM's; any count is correct, this one keeps every SM busy there


def interpret_params(interpret) -> dict:
  """plgpu.kernel's keyword for `interpret`: False (the GPU), True (Pallas's
  GPU interpreter on a CPU, for tests) or the interpreter's own parameters
  (a test's race detection)."""
  if interpret is True:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return {'interpret': InterpretGPUParams()}
  return {'interpret': interpret} if interpret else {}
