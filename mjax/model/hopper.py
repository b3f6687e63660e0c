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

import dataclasses
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


# --- the matmul both kernels are: pieces of jax's hopper_matmul_mgpu ---------------

@dataclasses.dataclass(frozen=True)
class Tiles:
  """A kernel's tiling (each kernel's own subclass says what its shared
  memory holds). Each consumer warpgroup owns a (tile_m, tile_n) fp32
  accumulator and the two sit side by side: a CTA computes (tile_m,
  2 tile_n), through `stages` pipeline stages of tile_k. Its epilogue works
  in (epi_m, epi_n) sub-tiles."""
  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  stages: int = 3
  epi_m: int = 64
  epi_n: int = 32
  # Output tiles are visited in bands `band` tiles wide along N, so that
  # neighbouring CTAs share their A rows and B columns in the L2 cache.
  band: int = 8


def swizzled(cols: int, itemsize: int) -> tuple:
  """Shared-memory transforms of a tile whose rows are `cols` elements: the
  widest swizzle that fits them, and tiles of that many bytes."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  swizzle = plgpu.find_swizzle(cols * itemsize * 8)
  return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def k_pipeline(tiles, k_iters: int, itemsize: int):
  """pipeline(body, compute_context): the product's K loop for a CTA's
  (tile_m, 2 tile_n) output, a TMA pipeline of `tiles.stages` stages run by
  a producer warpgroup for two consumer warpgroups, which `body` (see
  `mma`) multiplies into their accumulators; `compute_context` wraps the
  loop in each consumer (its prologue and epilogue)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  transforms = swizzled(tiles.tile_k, itemsize)

  def pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_iters,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((tiles.tile_m, tiles.tile_k), lambda kk: (0, kk), transforms=transforms,
                            memory_space=plgpu.SMEM),
            plgpu.BlockSpec((tiles.tile_k, 2 * tiles.tile_n), lambda kk: (kk, 0), transforms=transforms,
                            memory_space=plgpu.SMEM),
        ],
        wg_axis='wg',
        num_compute_wgs=2,
        max_concurrent_steps=tiles.stages,
        compute_context=compute_context,
    )
  return pipeline


def mma(wg_cols):
  """The pipeline's body: the stage's A tile times this warpgroup's
  columns `wg_cols` of its B tile, into the accumulator."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  def body(_, a_smem, b_smem, acc_ref):
    plgpu.wgmma(acc_ref, a_smem, b_smem.at[:, wg_cols])
    plgpu.wgmma_wait(0)
    return acc_ref
  return body


def persistent_kernel(body, out_type, grid: int | None, interpret):
  """plgpu.kernel of `body` on a persistent grid (one CTA per SM by
  default, axis 'sm'), three warpgroups each (axis 'wg': two consumers and
  the pipeline's producer), warpgroup semantics."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  return plgpu.kernel(
      body,
      out_type=out_type,
      grid=(grid or sm_count(),),
      grid_names=('sm',),
      num_threads=3,
      thread_name='wg',
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      **interpret_params(interpret),
  )
