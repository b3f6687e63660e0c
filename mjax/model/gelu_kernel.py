"""GeLU's backward as the epilogue of the matrix product that feeds it (Hopper GPUs).

In the GeLU MLP's backward the product dg = dy Wo^T is read only by the
GeLU's derivative: du = dg * GeLU'(u). XLA runs the two as two kernels: the
product writes dg, and an elementwise pass reads dg and u and writes du and
GeLU(u) (the latter is Wo's gradient's operand). On the 1p3b H100 step that
pass is the largest outside the products, 2.15 GB a layer and 17.2 ms a step
(bench/RESULTS.md, "What stands between 1p3b and 60%"). cuBLASLt has a DGELU
epilogue for it, which XLA does not use.

`dgelu_product` is that product with the epilogue: each output tile is
accumulated in fp32, then the same kernel reads the tile's u, and writes du and
GeLU(u). dg never reaches memory: per layer, one (tokens, d_ff) bf16 write
and one read fewer (1.07 GB for 1p3b at 16 x 2048).

The product is JAX's own Hopper matmul (jax.experimental.pallas.ops.gpu.
hopper_matmul_mgpu: a persistent grid, a TMA pipeline run by a producer
warpgroup, two consumer warpgroups issuing wgmma) with the epilogue above in
place of its plain store. It runs on sm_90 only; everything else takes
autodiff's two kernels (layers.gelu_mlp). On a CPU, `interpret=True` runs it
in Pallas's GPU interpreter, which the tests use to check it against the
reference. Wo comes in as (embed, d_ff), the product's plain right operand
(the interpreter has no transposed wgmma operand): the caller's `wo.T` of
the bf16 copy, which XLA makes as the fp32 weights' cast writes it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from mjax.model import hopper

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@dataclasses.dataclass(frozen=True)
class Tiles(hopper.Tiles):
  """The kernel's tiling: its two warpgroups' tiles side by side along
  d_ff. Shared memory: the pipeline's stages hold (tile_m + 2 tile_n) x
  tile_k bf16 each; the epilogue, per warpgroup, the tile's u (then
  GeLU(u)), tile_m x tile_n, and two (epi_m, epi_n) slots of du. 128 x 128
  x 64 with 3 stages and 64 x 32 sub-tiles: 144 + 64 + 16 = 224 KiB of an
  H100's 227."""


DEFAULT_TILES = Tiles()


def gelu_and_grad(u: jax.Array, approximate: bool) -> tuple[jax.Array, jax.Array]:
  """(GeLU(u), GeLU'(u)) in u's dtype's arithmetic, as jax.nn.gelu defines GeLU."""
  if approximate:
    inner = _SQRT_2_OVER_PI * (u + 0.044715 * (u * u * u))
    t = jnp.tanh(inner)
    g = 0.5 * u * (1.0 + t)
    dg = 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * (u * u))
    return g, dg
  cdf = 0.5 * (1.0 + lax.erf(u * _SQRT_HALF))
  return u * cdf, cdf + u * _INV_SQRT_2PI * jnp.exp(-0.5 * (u * u))


def reference(dy: jax.Array, wo: jax.Array, u: jax.Array, approximate: bool) -> tuple[jax.Array, jax.Array]:
  """What `dgelu_product` computes, as plain XLA: (du, GeLU(u)) for
  dy (tokens, embed), wo (d_ff, embed), u (tokens, d_ff); fp32 inside,
  rounded once to u's dtype."""
  dg = jnp.einsum('te,fe->tf', dy, wo, preferred_element_type=jnp.float32)
  g, grad = gelu_and_grad(u.astype(jnp.float32), approximate)
  return (dg * grad).astype(u.dtype), g.astype(u.dtype)


def fits(tokens: int, d_ff: int, embed: int, tiles: Tiles = DEFAULT_TILES) -> bool:
  """Whether the kernel's tiles divide these dimensions (it has no ragged edges)."""
  return (tokens % tiles.tile_m == 0 and d_ff % (2 * tiles.tile_n) == 0 and embed % tiles.tile_k == 0
          and tiles.tile_m % tiles.epi_m == 0 and tiles.tile_n % tiles.epi_n == 0)


def applies(dy: jax.Array, wo: jax.Array, u: jax.Array, approximate: bool = True,
            tiles: Tiles = DEFAULT_TILES) -> bool:
  """Whether `dgelu_product` takes this backward: one Hopper GPU (with
  several, the product's operands are split over devices, which the kernel
  cannot be: autodiff's kernels run there), the tanh GeLU, bf16 operands,
  and tokens, d_ff and embed that its tiles divide. dy (..., embed), wo
  (d_ff, embed), u (..., d_ff)."""
  if not approximate or not hopper.on_one_hopper():
    return False
  if not dy.dtype == wo.dtype == u.dtype == jnp.bfloat16 or not runs_on_a_gpu(tiles):
    return False
  return fits(math.prod(u.shape[:-1]), u.shape[-1], dy.shape[-1], tiles)


def runs_on_a_gpu(tiles: Tiles) -> bool:
  """Whether the GPU's lowering takes this tiling (the interpreter takes
  more): epilogue rows in whole warpgroup row blocks of 64, a barrier per
  u sub-tile of each warpgroup, and shared memory for the pipeline's stages,
  u's tiles and du's slots."""
  subs = (tiles.tile_m // tiles.epi_m) * (tiles.tile_n // tiles.epi_n)
  smem = 2 * (tiles.stages * (tiles.tile_m + 2 * tiles.tile_n) * tiles.tile_k
              + 2 * tiles.tile_m * tiles.tile_n + 4 * tiles.epi_m * tiles.epi_n)
  return tiles.epi_m % 64 == 0 and 2 * subs <= hopper.MAX_BARRIERS and smem <= hopper.SMEM_BYTES - 1024   # (barriers)


def dgelu_product(dy: jax.Array, wo_t: jax.Array, u: jax.Array, approximate: bool,
                  tiles: Tiles = DEFAULT_TILES, interpret=False,
                  grid: int | None = None) -> tuple[jax.Array, jax.Array]:
  """(du, GeLU(u)): du = (dy wo_t) * GeLU'(u), in one kernel.

  Args:
    dy: (tokens, embed) bf16, the MLP output's gradient.
    wo_t: (embed, d_ff) bf16, the output projection's kernel transposed.
    u: (tokens, d_ff) bf16, the input product (the GeLU's input).
    approximate: GeLU's tanh approximation; must be True.
    tiles: the tiling; `fits` must hold for these shapes.
    interpret: run in Pallas's GPU interpreter (on a CPU, for tests): True,
      or its InterpretGPUParams.
    grid: CTAs of the persistent grid (default: one per SM).
  """
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  m, k = dy.shape
  k2, n = wo_t.shape
  if k != k2 or u.shape != (m, n):
    raise ValueError(f'dgelu_product: dy {dy.shape}, wo_t {wo_t.shape} and u {u.shape} do not match '
                     '(tokens, embed), (embed, d_ff), (tokens, d_ff)')
  if not fits(m, n, k, tiles):
    raise ValueError(f'dgelu_product: {tiles} does not divide tokens {m}, d_ff {n}, embed {k}')
  if not approximate:
    # (Mosaic GPU lowers no erf; `gelu_and_grad` has it for the reference.)
    raise ValueError('dgelu_product: the tanh GeLU only (approximate=True)')
  if not dy.dtype == wo_t.dtype == u.dtype:
    raise ValueError(f'dgelu_product: one dtype for dy, wo_t and u, not {dy.dtype}, {wo_t.dtype}, {u.dtype}')
  dtype = u.dtype
  itemsize = jnp.dtype(dtype).itemsize
  tile_m, tile_n, tile_k = tiles.tile_m, tiles.tile_n, tiles.tile_k
  epi_m, epi_n = tiles.epi_m, tiles.epi_n
  cta_n = 2 * tile_n                     # the two consumer warpgroups, side by side along d_ff
  m_iters, n_iters, k_iters = m // tile_m, n // cta_n, k // tile_k

  out_transforms = hopper.swizzled(epi_n, itemsize)

  def dgelu_gemm(dy_gmem, wo_gmem, u_gmem, du_gmem, g_gmem):   # wo_gmem: (embed, d_ff)
    pipeline = hopper.k_pipeline(tiles, k_iters, itemsize)

    ignore = lambda *_, **__: None
    subs = [(ei, ej) for ei in range(tile_m // epi_m) for ej in range(tile_n // epi_n)]

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(dy_gmem, wo_gmem),
        # u's whole tile, per warpgroup, as epilogue sub-tiles: loaded before
        # the product's K loop, so that it is there when the epilogue reads
        # it (loaded in the epilogue, each sub-tile cost a memory round trip
        # with the tensor cores idle). GeLU(u) is written over each sub-tile
        # for its store.
        ug_smem=plgpu.SMEM((2, len(subs), epi_m, epi_n), dtype, transforms=out_transforms),
        # du, (warpgroup, slot): two slots in turn, so that one sub-tile's
        # store runs while the next is computed.
        du_smem=plgpu.SMEM((2, 2, epi_m, epi_n), dtype, transforms=out_transforms),
        u_barrier=plgpu.Barrier(num_barriers=2 * len(subs)),
        collective_axes='wg',
    )
    def scope(allocations, ug_smem, du_smem, u_barrier):
      wg = lax.axis_index('wg')

      @plgpu.nd_loop((m_iters * n_iters,), collective_axes='sm')
      def mn_loop(info):
        (linear,) = info.index
        mi, ni = plgpu.planar_snake(linear, (m_iters, n_iters), 1, tiles.band)
        rows = pl.ds(mi * tile_m, tile_m)
        cols = pl.ds(ni * cta_n, cta_n)
        wg_cols = pl.ds(wg * tile_n, tile_n)
        sub_tile = lambda ref, ei, ej: (ref.at[rows, cols].at[:, wg_cols]
                                        .at[ei * epi_m:(ei + 1) * epi_m, ej * epi_n:(ej + 1) * epi_n])

        def compute_context(eval_pipeline):
          # The last tile's stores have read ug_smem and du_smem; then this
          # tile's u is loaded into ug_smem behind the K loop.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          for s, (ei, ej) in enumerate(subs):
            plgpu.copy_gmem_to_smem(sub_tile(u_gmem, ei, ej), ug_smem.at[wg, s], u_barrier.at[wg * len(subs) + s])

          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
          def acc_scope(acc_ref):
            eval_pipeline(acc_ref)
            acc = acc_ref[...]   # (registers: the slices below select from them)
            for s, (ei, ej) in enumerate(subs):
              slot = s % 2
              # Two stores a sub-tile (du, GeLU(u)): the last sub-tile's may
              # still run; this du slot's own (two sub-tiles ago) must be done.
              plgpu.wait_smem_to_gmem(2, wait_read_only=True)
              plgpu.barrier_wait(u_barrier.at[wg * len(subs) + s])
              g, grad = gelu_and_grad(ug_smem[wg, s].astype(jnp.float32), approximate)
              ug_smem[wg, s] = g.astype(dtype)
              du_smem[wg, slot] = (acc[ei * epi_m:(ei + 1) * epi_m, ej * epi_n:(ej + 1) * epi_n]
                                   * grad).astype(dtype)
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(du_smem.at[wg, slot], sub_tile(du_gmem, ei, ej))
              plgpu.copy_smem_to_gmem(ug_smem.at[wg, s], sub_tile(g_gmem, ei, ej))

        pipeline(hopper.mma(wg_cols), compute_context)(dy_gmem.at[rows, :], wo_gmem.at[:, cols],
                                                       allocations=allocations)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # every store done before the kernel ends

  out = jax.ShapeDtypeStruct((m, n), dtype)
  return hopper.persistent_kernel(dgelu_gemm, (out, out), grid, interpret)(dy, wo_t, u)
