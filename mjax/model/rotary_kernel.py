"""Rotary embeddings as the epilogue of the q and k projections' product (Hopper GPUs).

Attention's q and k are products of the norm's output, then rotated by
their token's position. XLA runs the two as two kernels: the product
(cuBLAS) writes q and k, and an elementwise pass reads them and writes them
rotated, which is what attention reads. On the 1p3b H100 step rotary's passes
take ~9 ms, half of them this forward (bench/RESULTS.md, "What stands between
1p3b and 60%"); no XLA fusion runs them inside the product.

`rotary_product` is that product with the rotation as its epilogue: each
output tile is accumulated in fp32 and written rotated. The unrotated q and
k never reach memory: per layer, one (tokens, q and k width) bf16 write and
one read fewer (0.27 GB for 1p3b at 16 x 2048).

Each consumer warpgroup's output tile is (tile_m, head_dim): one head of
tile_m tokens. The rotate-half form pairs a head's dim i with dim i +
head_dim / 2, so both halves of each pair sit in the same accumulator and
the rotation is elementwise between its two column halves. The product is
JAX's Hopper matmul (see mjax/model/hopper.py), as in gelu_kernel.py.

The angles' cosines and sines come in as tables, one row per token: the
kernel reads each tile's rows behind its K loop. They are fp16 (an eighth
of the output's bf16 rounding: unit roundoffs 2^-11 and 2^-8), carried as bf16 bits:
in fp32 they would not fit in shared memory beside the pipeline, and the
rotated values are written over them for their stores.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from mjax import config as config_lib
from mjax.model import hopper


@dataclasses.dataclass(frozen=True)
class Tiles(hopper.Tiles):
  """The kernel's tiling: tile_n is a head's dims, so a CTA computes two
  heads of tile_m tokens. Shared memory: the pipeline's stages hold
  (tile_m + 2 tile_n) x tile_k bf16 each; the epilogue, per warpgroup, the
  tile's cosines and sines, 2 x tile_m x tile_n / 2, which the rotated
  halves overwrite. 128 x 128 x 64 with 3 stages: 144 + 64 = 208 KiB of an
  H100's 227."""


DEFAULT_TILES = Tiles()


def tiles_for(head_dim: int) -> Tiles:
  """The default tiling for heads of `head_dim` (a warpgroup's tile is one head)."""
  return dataclasses.replace(DEFAULT_TILES, tile_n=head_dim, epi_n=min(DEFAULT_TILES.epi_n, max(head_dim // 2, 1)))


def angles(positions: jax.Array, head_dim: int, theta: float) -> jax.Array:
  """(..., head_dim / 2) fp32 angles of `positions`, as layers.rotary computes them."""
  freq = theta ** (-jnp.arange(0, head_dim // 2, dtype=jnp.float32) * 2.0 / head_dim)
  return positions[..., None].astype(jnp.float32) * freq


def tables(positions: jax.Array, head_dim: int, theta: float) -> jax.Array:
  """(2, tokens, head_dim / 2): the cosines and sines of `positions`
  ((batch, seq) or (tokens,)), flattened to tokens, as fp16 carried in bf16."""
  a = angles(positions.reshape(-1), head_dim, theta)
  cs = jnp.stack([jnp.cos(a), jnp.sin(a)]).astype(jnp.float16)
  return lax.bitcast_convert_type(cs, jnp.bfloat16)


def reference(x: jax.Array, w: jax.Array, positions: jax.Array, head_dim: int, theta: float) -> jax.Array:
  """What `rotary_product` computes, as plain XLA with fp32 cosines and sines:
  (x w), rotated head by head, rounded once to x's dtype. x (tokens, embed),
  w (embed, heads * head_dim), positions (tokens,)."""
  y = jnp.einsum('te,ef->tf', x, w, preferred_element_type=jnp.float32)
  y = y.reshape(y.shape[0], -1, head_dim)
  a = angles(positions, head_dim, theta)[:, None, :]
  lo, hi = jnp.split(y, 2, axis=-1)
  out = jnp.concatenate([lo * jnp.cos(a) - hi * jnp.sin(a), hi * jnp.cos(a) + lo * jnp.sin(a)], axis=-1)
  return out.reshape(x.shape[0], -1).astype(x.dtype)


def fits(tokens: int, q_columns: int, k_columns: int, embed: int, head_dim: int,
         tiles: Tiles = DEFAULT_TILES) -> bool:
  """Whether the kernel's tiles divide these dimensions (it has no ragged
  edges): a warpgroup's tile is one head, and a CTA's two heads are both
  q's or both k's."""
  half = tiles.tile_n // 2
  return (tiles.tile_n == head_dim and tokens % tiles.tile_m == 0 and q_columns % (2 * tiles.tile_n) == 0
          and k_columns % (2 * tiles.tile_n) == 0 and embed % tiles.tile_k == 0
          and tiles.tile_m % tiles.epi_m == 0 and half % tiles.epi_n == 0)


def doubtful(cfg, num_devices: int | None = None) -> list[str]:
  """ModelConfig.rotary_kernel = True where it does nothing, one sentence
  (config.doubtful's kind, for the run to warn of; here, since its shape
  rules are the kernel's). `num_devices`: the job's, where known."""
  m, mesh = cfg.model, cfg.mesh
  if not m.rotary_kernel:
    return []
  why = config_lib.several_devices(mesh, num_devices)
  if why is not None:
    pass
  elif m.rotary_fraction != 1.0:
    why = (f'ModelConfig.rotary_fraction = {m.rotary_fraction} rotates part of each head, and the kernel '
           'rotates whole heads')
  elif m.use_bias:
    why = 'ModelConfig.use_bias = True adds biases to q and k before rotary, and the kernel has none'
  elif m.dtype != 'bfloat16':
    why = f'ModelConfig.dtype = {m.dtype!r} computes in that dtype, and the kernel takes bf16'
  elif m.fuse_projections in ('inputs', 'all') and m.block == 'parallel' and m.parallel_norms == 'shared':
    why = (f'ModelConfig.fuse_projections = {m.fuse_projections!r} joins q and k\'s product with v\'s '
           'and the MLP\'s')
  else:
    t = cfg.train
    tokens = t.global_batch_size // t.grad_accum_steps * cfg.data.seq_len
    why = why_not(tokens, m.n_heads, m.kv_heads, m.dim_per_head, m.d_model)
  return [f'ModelConfig.rotary_kernel = True does nothing here: {why}'] if why else []


def why_not(tokens: int, heads: int, kv_heads: int, head_dim: int, embed: int) -> str | None:
  """Why `tiles_for(head_dim)` cannot take these shapes, in a user's terms
  (None where it can): a run whose flag would do nothing says so."""
  tiles = tiles_for(head_dim)
  if not runs_on_a_gpu(tiles):
    return f'heads of {head_dim} dims (the kernel takes heads of 64 or 128)'
  if heads % 2 or kv_heads % 2:
    return (f'{heads} query and {kv_heads} key heads (the kernel computes heads two at a time, q\'s and k\'s '
            'apart: both counts must be even)')
  if tokens % tiles.tile_m:
    return f'{tokens} tokens a product (the kernel takes multiples of {tiles.tile_m})'
  if embed % tiles.tile_k:
    return f'd_model {embed} (the kernel takes multiples of {tiles.tile_k})'
  assert fits(tokens, heads * head_dim, kv_heads * head_dim, embed, head_dim, tiles)
  return None


# The swizzles TMA and wgmma take: rows of 32, 64 or 128 bytes.
_SWIZZLES = (32, 64, 128)


def runs_on_a_gpu(tiles: Tiles) -> bool:
  """Whether the GPU's lowering takes this tiling (the interpreter takes
  more): rows of the stages and of the tables' sub-tiles that TMA can
  swizzle, a warpgroup's columns in whole tiles of the stage's swizzle
  (64 bf16 at 128 bytes: heads of 64 or 128 under `tiles_for`), epilogue rows in whole
  warpgroup row blocks of 64, a barrier per table sub-tile of each
  warpgroup, and shared memory for the pipeline's stages and the tables."""
  half = tiles.tile_n // 2
  if 2 * tiles.tile_k not in _SWIZZLES or 2 * tiles.epi_n not in _SWIZZLES or half % tiles.epi_n:
    return False
  subs = (tiles.tile_m // tiles.epi_m) * (half // tiles.epi_n)
  smem = 2 * (tiles.stages * (tiles.tile_m + 2 * tiles.tile_n) * tiles.tile_k + 2 * tiles.tile_m * tiles.tile_n)
  # (A stage's rows are tile_k bf16, its swizzle as wide: its tiles tile_k columns.)
  return (tiles.tile_n % tiles.tile_k == 0 and tiles.epi_m % 64 == 0 and 4 * subs <= hopper.MAX_BARRIERS
          and smem <= hopper.SMEM_BYTES - 1024)   # (barriers)


def applies(x: jax.Array, wq: jax.Array, wk: jax.Array, fraction: float = 1.0,
            tiles: Tiles | None = None) -> bool:
  """Whether `rotary_product` takes q and k's projections: one Hopper GPU
  (with several, the product's operands are split over devices, which the
  kernel cannot be), every head dim rotated, bf16 operands, and tokens,
  heads and embed that its tiles divide (`tiles_for` the heads by
  default). x (..., embed), wq (embed, heads, head_dim), wk (embed,
  kv_heads, head_dim)."""
  if fraction != 1.0 or not hopper.on_one_hopper():
    return False
  tiles = tiles or tiles_for(wq.shape[-1])
  if not x.dtype == wq.dtype == wk.dtype == jnp.bfloat16 or not runs_on_a_gpu(tiles):
    return False
  head_dim = wq.shape[-1]
  return fits(math.prod(x.shape[:-1]), wq.shape[1] * head_dim, wk.shape[1] * head_dim, x.shape[-1], head_dim,
              tiles)


def rotary_product(x: jax.Array, w: jax.Array, cos_sin: jax.Array, q_columns: int,
                   tiles: Tiles = DEFAULT_TILES, interpret=False,
                   grid: int | None = None) -> tuple[jax.Array, jax.Array]:
  """(x w), each head_dim = tiles.tile_n columns rotated by its row's
  angles, in one kernel, as (q, k): its first `q_columns` columns and the rest.
  Two arrays, not one to be sliced: attention's kernels read q and k each
  whole, and the slices would be copies, as many bytes as the pass saved.

  Args:
    x: (tokens, embed) bf16, the norm's output.
    w: (embed, heads * head_dim) bf16, q's and k's kernels side by side.
    q_columns: q's heads x head_dim.
    cos_sin: (2, tokens, head_dim / 2), `tables` of the tokens' positions.
    tiles: the tiling; `fits` must hold for these shapes.
    interpret: run in Pallas's GPU interpreter (on a CPU, for tests): True,
      or its InterpretGPUParams.
    grid: CTAs of the persistent grid (default: one per SM).
  """
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  m, k = x.shape
  k2, n = w.shape
  half = tiles.tile_n // 2
  if k != k2 or cos_sin.shape != (2, m, half):
    raise ValueError(f'rotary_product: x {x.shape}, w {w.shape} and cos_sin {cos_sin.shape} do not match '
                     f'(tokens, embed), (embed, heads x head_dim), (2, tokens, head_dim / 2) with head_dim '
                     f'{tiles.tile_n}')
  if not fits(m, q_columns, n - q_columns, k, tiles.tile_n, tiles):
    raise ValueError(f'rotary_product: {tiles} does not divide tokens {m}, columns {q_columns} (q) and '
                     f'{n - q_columns} (k), embed {k}')
  if not x.dtype == w.dtype == cos_sin.dtype == jnp.bfloat16:
    raise ValueError(f'rotary_product: bf16 x, w and cos_sin, not {x.dtype}, {w.dtype}, {cos_sin.dtype}')
  dtype = x.dtype
  itemsize = jnp.dtype(dtype).itemsize
  tile_m, tile_n, tile_k = tiles.tile_m, tiles.tile_n, tiles.tile_k
  epi_m, epi_n = tiles.epi_m, tiles.epi_n
  cta_n = 2 * tile_n                     # the two consumer warpgroups, a head each
  m_iters, n_iters, k_iters = m // tile_m, n // cta_n, k // tile_k
  q_iters = q_columns // cta_n

  out_transforms = hopper.swizzled(epi_n, itemsize)

  def rope_gemm(x_gmem, w_gmem, cs_gmem, q_gmem, k_gmem):
    pipeline = hopper.k_pipeline(tiles, k_iters, itemsize)

    ignore = lambda *_, **__: None
    # Sub-tiles of a head's first half; each pairs with the same columns of the second.
    subs = [(ei, ej) for ei in range(tile_m // epi_m) for ej in range(half // epi_n)]

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem),
        # The tile's cosines and sines, (warpgroup, cos | sin, sub-tile),
        # loaded before the product's K loop so that they are there when
        # the epilogue reads them. The rotated first and second halves are
        # written over them for their stores.
        cs_smem=plgpu.SMEM((2, 2, len(subs), epi_m, epi_n), dtype, transforms=out_transforms),
        cs_barrier=plgpu.Barrier(num_barriers=4 * len(subs)),
        collective_axes='wg',
    )
    def scope(allocations, cs_smem, cs_barrier):
      wg = lax.axis_index('wg')

      @plgpu.nd_loop((m_iters * n_iters,), collective_axes='sm')
      def mn_loop(info):
        (linear,) = info.index
        mi, ni = plgpu.planar_snake(linear, (m_iters, n_iters), 1, tiles.band)
        rows = pl.ds(mi * tile_m, tile_m)
        cols = pl.ds(ni * cta_n, cta_n)
        wg_cols = pl.ds(wg * tile_n, tile_n)
        table = lambda c, ei, ej: (cs_gmem.at[c].at[rows]
                                   .at[ei * epi_m:(ei + 1) * epi_m, ej * epi_n:(ej + 1) * epi_n])

        def store(s, ei, ej):
          # To q's array or k's: each CTA's two heads are one's (`fits`).
          for o_gmem, first, is_it in ((q_gmem, 0, ni < q_iters), (k_gmem, q_iters, ni >= q_iters)):
            @pl.when(is_it)
            def _():
              out = lambda col: (o_gmem.at[rows, pl.ds((ni - first) * cta_n, cta_n)].at[:, wg_cols]
                                 .at[ei * epi_m:(ei + 1) * epi_m, col:col + epi_n])
              plgpu.copy_smem_to_gmem(cs_smem.at[wg, 0, s], out(ej * epi_n))
              plgpu.copy_smem_to_gmem(cs_smem.at[wg, 1, s], out(half + ej * epi_n))
        barrier = lambda c, s: cs_barrier.at[(2 * wg + c) * len(subs) + s]

        def compute_context(eval_pipeline):
          # The last tile's stores have read cs_smem; then this tile's
          # tables are loaded into it behind the K loop.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          for s, (ei, ej) in enumerate(subs):
            for c in (0, 1):
              plgpu.copy_gmem_to_smem(table(c, ei, ej), cs_smem.at[wg, c, s], barrier(c, s))

          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
          def acc_scope(acc_ref):
            eval_pipeline(acc_ref)
            acc = acc_ref[...]   # (registers: the slices below select from them)
            for s, (ei, ej) in enumerate(subs):
              plgpu.barrier_wait(barrier(0, s))
              plgpu.barrier_wait(barrier(1, s))
              cos = lax.bitcast_convert_type(cs_smem[wg, 0, s], jnp.float16).astype(jnp.float32)
              sin = lax.bitcast_convert_type(cs_smem[wg, 1, s], jnp.float16).astype(jnp.float32)
              r = slice(ei * epi_m, (ei + 1) * epi_m)
              lo = acc[r, ej * epi_n:(ej + 1) * epi_n]
              hi = acc[r, half + ej * epi_n:half + (ej + 1) * epi_n]
              cs_smem[wg, 0, s] = (lo * cos - hi * sin).astype(dtype)
              cs_smem[wg, 1, s] = (hi * cos + lo * sin).astype(dtype)
              plgpu.commit_smem()
              store(s, ei, ej)

        pipeline(hopper.mma(wg_cols), compute_context)(x_gmem.at[rows, :], w_gmem.at[:, cols],
                                                       allocations=allocations)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # every store done before the kernel ends

  out_type = (jax.ShapeDtypeStruct((m, q_columns), dtype), jax.ShapeDtypeStruct((m, n - q_columns), dtype))
  return hopper.persistent_kernel(rope_gemm, out_type, grid, interpret)(x, w, cos_sin)
