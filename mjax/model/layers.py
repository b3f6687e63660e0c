"""Building blocks: projections, norms, MLPs, rotary embeddings.

Every parameter is created with logical axis names (see mjax.parallel.rules
for how they map onto a mesh); nothing here knows about devices.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from mjax.config import ModelConfig
from mjax.model import gelu_kernel, rotary_kernel
from mjax.parallel import collective_matmul, scatter_sum
from mjax.parallel.rules import mesh_axes

Dtype = jnp.dtype


def dtype_of(name: str) -> Dtype:
  return jnp.dtype(name)


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
  """Pins an activation's layout by logical names (no-op without a mesh)."""
  return nn.with_logical_constraint(x, axes)


class Weights(nn.Module):
  """A projection's parameters, cast for use: `(kernel, bias or None)`.

  The kernel has shape `(*in_shape, *features)` and logical names `axes`.
  Kept apart from the matrix product so that the parallel block can join
  several projections' kernels into one product (`fused_dot`) while each
  keeps its own parameter (and LAMB trust ratio, and checkpoint entry).
  """
  in_shape: tuple[int, ...]
  features: tuple[int, ...]
  axes: tuple[str, ...]
  std: float = 0.02
  use_bias: bool = False
  dtype: Dtype = jnp.bfloat16
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self) -> tuple[jax.Array, Optional[jax.Array]]:
    init = nn.initializers.normal(self.std)
    kernel = self.param('kernel', nn.with_logical_partitioning(init, self.axes),
                        (*self.in_shape, *self.features), self.param_dtype)
    # Master weights stay fp32; the matrix product runs in the compute dtype.
    # The cast is pinned to the kernel's own (FSDP-sharded) layout, so each
    # device casts its shard and the all-gather moves bf16, half the bytes of
    # gathering fp32 and casting afterwards.
    cast = kernel.dtype != self.dtype
    kernel = constrain(kernel.astype(self.dtype), self.axes)
    if cast:
      # Named for the remat policies, which keep it: the backward's products
      # read the cast kernel too, and casting it again there reads the fp32
      # master weights again (2.6 ms of the 1p3b H100 step). Kept on its own
      # shards, so FSDP still gathers it again for the backward.
      kernel = checkpoint_name(kernel, CAST_KERNEL)
    bias = None
    if self.use_bias:
      bias = self.param('bias', nn.with_logical_partitioning(
          nn.initializers.zeros, self.axes[len(self.in_shape):]), self.features, self.param_dtype)
      bias = bias.astype(self.dtype)
    return kernel, bias


def apply_weights(x: jax.Array, kernel: jax.Array, bias: Optional[jax.Array], n_in: int,
                  axes: Optional[tuple[Optional[str], ...]] = None) -> jax.Array:
  """einsum of x's trailing `n_in` dims with the kernel's leading ones (+ bias).

  With the kernel's logical names `axes`, a tensor-parallel product of the
  sequence-parallel residual runs as a collective matmul when the context
  asks for one (MeshConfig.collective_matmul): same value, with the
  activations' all-gather / reduce-scatter overlapped with the product.
  """
  y = None if axes is None else collective_matmul.projection(x, kernel, n_in, axes)
  if y is None:
    y = matmul(x.astype(kernel.dtype), kernel, n_in)
  return y if bias is None else y + bias


def matmul(x: jax.Array, kernel: jax.Array, n_in: int = 1, kernel_in_last: bool = False,
           out_dtype=None) -> jax.Array:
  """x's trailing `n_in` dims contracted with the kernel's leading ones (with
  `kernel_in_last`, its trailing ones: a (vocab, embed) table as the head).

  Run as one 2-D product, (batch * seq, in) x (in, out), wherever the
  sequence is not split over devices: that is what a GEMM is, and the form in
  which the backward's weight gradient contracts one dim, not two. With
  (batch, seq) both contracted XLA:CPU picked a layout that transposes the
  logits' gradient and multiplies both operands transposed, at a quarter of
  the plain product's speed (the head's weight gradient of the peer model:
  84 ms of a 500 ms step, against 20 ms as one 2-D product). On GPU the GEMM
  rewriter makes the same 2-D product either way. Under sequence
  parallelism (batch, seq) are split over different mesh axes and their
  merged dim has no tiled sharding, so the dims stay apart there.
  """
  lead = x.shape[:x.ndim - n_in]
  k_in = kernel.shape[kernel.ndim - n_in:] if kernel_in_last else kernel.shape[:n_in]
  k_out = kernel.shape[:kernel.ndim - n_in] if kernel_in_last else kernel.shape[n_in:]
  if len(lead) > 1 and logical_shards('residual_seq') == 1:
    size = math.prod(k_in)
    rows = x.reshape(-1, size)
    if kernel_in_last:
      y = jax.lax.dot_general(rows, kernel.reshape(-1, size), (((1,), (1,)), ((), ())),
                              preferred_element_type=out_dtype)
    else:
      y = jax.lax.dot_general(rows, kernel.reshape(size, -1), (((1,), (0,)), ((), ())),
                              preferred_element_type=out_dtype)
    return y.reshape(*lead, *k_out)
  x_in = tuple(range(x.ndim - n_in, x.ndim))
  k_dims = tuple(range(kernel.ndim - n_in, kernel.ndim)) if kernel_in_last else tuple(range(n_in))
  return jax.lax.dot_general(x, kernel, ((x_in, k_dims), ((), ())), preferred_element_type=out_dtype)


def project(x: jax.Array, w: Weights, n_in: int) -> jax.Array:
  """`x` through projection `w` (its parameters fetched and cast here)."""
  return apply_weights(x, *w(), n_in, w.axes)


def fan_out(x: jax.Array, n: int) -> tuple[jax.Array, ...]:
  """`x` as `n` values for `n` readers, whose gradients are summed each new
  one onto the sum so far: cotangent[i] + (... + (cotangent[1] + cotangent[0])).

  Where the readers are matrix products (the parallel block's q, k, v and
  MLP input projections all read the norm's output), each input gradient
  is a product, and the GPU compiler adds the sum so far into the next
  product's output as its addend (cuBLAS, beta = 1) only when that product
  is the add's first operand. Autodiff's own order adds the sum so far
  first: one of the block's sums stayed a pass of its own, reading two
  (batch, seq, embed) gradients and writing their sum (1p3b on an H100,
  deviceless: 0.40 GB a layer, ~3 ms a step). Values are those of
  autodiff's sum, up to the order of the bf16 additions."""

  @jax.custom_vjp
  def split(x):
    return (x,) * n

  def fwd(x):
    return (x,) * n, None

  def bwd(_, cts):
    total = cts[0]
    for ct in cts[1:]:
      total = ct + total
    return (total,)

  split.defvjp(fwd, bwd)
  return split(x)


def project_many(x: jax.Array, ws: list[Weights], n_in: int) -> list[jax.Array]:
  """`x` through several projections of the same input (q, k, v, MLP in).

  Under collective matmul they share one all-gather ring: the activation
  chunks travel once and each step multiplies them by every kernel.
  """
  built = [w() for w in ws]
  ys = collective_matmul.input_projections(x, [k for k, _ in built], n_in, [w.axes for w in ws])
  if ys is None:
    return [apply_weights(xi, k, b, n_in) for xi, (k, b) in zip(fan_out(x, len(built)), built)]
  return [y if b is None else y + b for y, (_, b) in zip(ys, built)]


def project_sum(parts: list[tuple[jax.Array, Weights, int]]) -> jax.Array:
  """sum_i parts[i][0] through projection parts[i][1] (contracting its
  trailing parts[i][2] dims): the parallel block's two output projections.

  Under collective matmul one reduce-scatter ring carries their sum.
  """
  built = [w() for _, w, _ in parts]
  y = collective_matmul.output_projections(
      [(x, k, n, w.axes) for (x, w, n), (k, _) in zip(parts, built)])
  if y is None:
    return sum(apply_weights(x, k, b, n) for (x, _, n), (k, b) in zip(parts, built))
  for _, b in built:
    if b is not None:
      y = y + b
  return y


class Norm(nn.Module):
  """LayerNorm (MegaScale / GPT) or RMSNorm, computed in fp32."""
  kind: str = 'layernorm'
  eps: float = 1e-5
  use_bias: bool = True
  dtype: Dtype = jnp.bfloat16
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    d = x.shape[-1]
    scale = self.param('scale', nn.with_logical_partitioning(nn.initializers.ones, ('embed',)),
                       (d,), self.param_dtype)
    bias = None
    if self.kind == 'layernorm' and self.use_bias:
      bias = self.param('bias', nn.with_logical_partitioning(nn.initializers.zeros, ('embed',)),
                        (d,), self.param_dtype)
    return normalize(x, scale, bias, self.kind == 'layernorm', self.eps, self.dtype)


def _norm_stats(x: jax.Array, center: bool, eps: float) -> tuple[jax.Array, jax.Array]:
  """(row mean, or None without centering; 1 / row std), fp32, (..., 1)."""
  # Statistics in fp32: bf16 variance of a 12k-wide row loses the signal.
  xf = x.astype(jnp.float32)
  mean = jnp.mean(xf, axis=-1, keepdims=True) if center else None
  xc = xf - mean if center else xf
  return mean, jax.lax.rsqrt(jnp.mean(jnp.square(xc), axis=-1, keepdims=True) + eps)


def _normalized(x: jax.Array, mean: Optional[jax.Array], rstd: jax.Array) -> jax.Array:
  """x_hat = (x - mean) / std in fp32 (RMSNorm, mean None: x / rms)."""
  xf = x.astype(jnp.float32)
  return (xf if mean is None else xf - mean) * rstd


def normalize(x: jax.Array, scale: jax.Array, bias: Optional[jax.Array], center: bool, eps: float,
              dtype: Dtype) -> jax.Array:
  """(x - mean) / std * scale + bias over the last dim (RMSNorm: no mean, no
  bias), in fp32, returned in `dtype`.

  The backward is written out. Autodiff of the forward recomputes the row
  statistics, writes scale's gradient term dy * x_hat as an fp32 tensor of
  the activation's size and reads it back to sum it over the rows: on the
  1p3b H100 step those two passes were 7 ms of the 24 layers' backward. Here
  the backward keeps the forward's mean and 1/std (one fp32 number per row),
  so x_hat is elementwise from x and the scale and bias gradients are
  column sums of one pass over (dy, x); the input's gradient takes the two
  row means its formula needs, and nothing of the activation's size is
  written but that gradient."""

  def forward(x, scale, bias):
    # Named before use: a remat policy that keeps them then also spares the
    # backward's recomputation of y (the projections' weight gradients
    # read it) its two row reductions. (Under jax_remat3, off by default
    # in jax 0.10-0.11, names inside a custom VJP's forward are not seen:
    # the gradients stay right, only this saving goes.)
    mean, rstd = checkpoint_name(_norm_stats(x, center, eps), NORM_STATS)
    y = _normalized(x, mean, rstd) * scale.astype(jnp.float32)
    if bias is not None:
      y = y + bias.astype(jnp.float32)
    return y.astype(dtype), (mean, rstd)

  @jax.custom_vjp
  def norm(x, scale, bias):
    return forward(x, scale, bias)[0]

  def fwd(x, scale, bias):
    y, (mean, rstd) = forward(x, scale, bias)
    return y, (x, scale, bias, mean, rstd)

  def bwd(res, dy):
    x, scale, bias, mean, rstd = res
    x_hat = _normalized(x, mean, rstd)
    g = dy.astype(jnp.float32)
    rows = tuple(range(x.ndim - 1))
    d_scale = jnp.sum(g * x_hat, axis=rows).astype(scale.dtype)
    d_bias = None if bias is None else jnp.sum(g, axis=rows).astype(bias.dtype)
    gs = g * scale.astype(jnp.float32)
    # d/dx of x_hat * s: rstd * (gs - mean(gs) - x_hat * mean(gs * x_hat));
    # without centering (RMSNorm) the mean(gs) term is absent.
    proj = jnp.mean(gs * x_hat, axis=-1, keepdims=True)
    dx = gs - x_hat * proj
    if center:
      dx = dx - jnp.mean(gs, axis=-1, keepdims=True)
    return (dx * rstd).astype(x.dtype), d_scale, d_bias

  norm.defvjp(fwd, bwd)
  return norm(x, scale, bias)


def make_norm(cfg: ModelConfig, name: str) -> Norm:
  return Norm(kind=cfg.norm, eps=cfg.norm_eps, use_bias=True,
              dtype=dtype_of(cfg.dtype), param_dtype=dtype_of(cfg.param_dtype), name=name)


def weights(cfg: ModelConfig, in_shape: tuple[int, ...], features: tuple[int, ...],
            axes: tuple[str, ...], std: float, name: str) -> Weights:
  return Weights(in_shape, features, axes, std, cfg.use_bias, dtype_of(cfg.dtype),
                 dtype_of(cfg.param_dtype), name=name)


CAST_KERNEL = 'cast_kernel'  # a projection's kernel in the compute dtype, which every policy but 'full' keeps
NORM_STATS = 'norm_stats'   # a norm's row mean and 1/std, which every remat policy but 'full' keeps
ROTATED = 'rotated_qk'      # attention's q and k after rotary, kept by the same policies
MLP_ACTIVATION = 'mlp_activation'   # the name remat policies may keep the MLP's activation by


class Mlp(nn.Module):
  """GeLU MLP (MegaScale, GPT-3) or SwiGLU (LLaMA).

  `inputs()` / `activate()` / `output()` are the pieces the fused parallel
  block joins with attention's; `__call__` is the MLP on its own.
  """
  cfg: ModelConfig
  out_std: float

  def setup(self):
    c = self.cfg
    self.wi = weights(c, (c.d_model,), (c.d_ff,), ('embed', 'mlp'), c.init_std, 'wi')
    if c.mlp == 'swiglu':
      self.wi_gate = weights(c, (c.d_model,), (c.d_ff,), ('embed', 'mlp'), c.init_std, 'wi_gate')
    self.wo = weights(c, (c.d_ff,), (c.d_model,), ('mlp', 'embed'), self.out_std, 'wo')

  def inputs(self) -> list[Weights]:
    """The input projections, in the order `activate` takes their outputs."""
    return [self.wi, self.wi_gate] if self.cfg.mlp == 'swiglu' else [self.wi]

  def activate(self, up: jax.Array, gate: Optional[jax.Array] = None) -> jax.Array:
    c = self.cfg
    h = nn.silu(gate) * up if c.mlp == 'swiglu' else nn.gelu(up, approximate=c.gelu_approximate)
    # Named for the remat policy 'dots_attention_mlp', which keeps it: the
    # output projection's weight gradient reads it, and every other policy
    # recomputes it from the saved input projection. An identity otherwise.
    return checkpoint_name(constrain(h, ('batch', 'seq', 'mlp')), MLP_ACTIVATION)  # (batch, seq, mlp)

  def output(self) -> Weights:
    return self.wo

  def __call__(self, x: jax.Array) -> jax.Array:  # (batch, seq, embed)
    c = self.cfg
    if c.gelu_epilogue and c.mlp == 'gelu' and not collective_matmul.wanted(x):
      (wi, bi), (wo, bo) = self.wi(), self.wo()
      # The activation too where the policy keeps it ('none' keeps
      # everything): then the backward does not compute GeLU(u) again.
      return gelu_mlp(x, wi, bi, wo, bo, c.gelu_approximate,
                      keep_activation=c.remat_policy in ('none', 'dots_attention_mlp'),
                      backward_kernel=c.gelu_backward_kernel)
    h = self.activate(*project_many(x, self.inputs(), 1))
    return project(h, self.wo, 1)


MLP_PRODUCT = 'mlp_product'   # the GeLU MLP unit's input product, which every policy but 'full' keeps


def gelu_mlp(x: jax.Array, wi: jax.Array, bi: Optional[jax.Array], wo: jax.Array, bo: Optional[jax.Array],
             approximate: bool, keep_activation: bool = False, backward_kernel: bool = False) -> jax.Array:
  """GeLU(x Wi + bi) Wo + bo, (batch, seq, embed) in and out, with the
  backward written out so that XLA can run the GeLU as the input product's
  cuBLASLt epilogue (GELU_AUX: one kernel writes GeLU(u) and u).

  XLA fuses that epilogue only when the GeLU reads the product directly. Under
  remat, autodiff saves the product the GeLU reads and puts a
  reduce-precision on it, and the separate GeLU pass stays (bench/RESULTS.md,
  "GeLU into the matrix product"; XLA's Triton GEMMs, which claim the dot
  first, must also be off: --xla_gpu_enable_triton_gemm=false). Here the
  forward's GeLU reads the product, and what the backward keeps is the same
  product under a name of its own (`MLP_PRODUCT`) that nothing in the forward
  reads. The backward is autodiff's: GeLU(u) for Wo's gradient (kept from
  the forward with `keep_activation`, as `MLP_ACTIVATION`; computed again
  otherwise) and GeLU'(u) for the input product's. The function of
  `Mlp.activate` and two projections, in the same dtypes; fused on a GPU,
  the GeLU reads the product before its rounding to bf16.

  `keep_activation` must match the remat policy: a kept GeLU(u) that the
  policy does not save is recomputed from the unnamed product, which the
  dots policies would then keep as well, and with it comes the
  reduce-precision that stops the fusion.

  `backward_kernel`: on one Hopper GPU, dg = dy Wo^T and the GeLU's
  derivative run as one kernel (mjax/model/gelu_kernel.py) that writes du
  and GeLU(u), never dg; elsewhere (other devices, several of them, shapes
  its tiles do not divide, a kept GeLU(u)) the backward is autodiff's."""
  act = functools.partial(nn.gelu, approximate=approximate)
  # The backward is traced when the gradient is taken, outside whatever
  # axis rules surround this call (a pipeline's forward drops 'data' from
  # them): it lays its activations out by the rules of the forward.
  rules = nn.get_logical_axis_rules()

  def up(x, wi, bi):
    u = matmul(x.astype(wi.dtype), wi, 1)
    return constrain(u if bi is None else u + bi, ('batch', 'seq', 'mlp'))

  def down(g, wo, bo):
    y = matmul(g, wo, 1)
    return y if bo is None else y + bo

  @jax.custom_vjp
  def mlp(x, wi, bi, wo, bo):
    return down(act(up(x, wi, bi)), wo, bo)

  def fwd(x, wi, bi, wo, bo):
    u = up(x, wi, bi)
    g = act(u)
    kept = checkpoint_name(g, MLP_ACTIVATION) if keep_activation else None
    return down(g, wo, bo), (x, wi, bi, wo, bo, checkpoint_name(u, MLP_PRODUCT), kept)

  def bwd(res, dy):
    with nn.logical_axis_rules(rules):
      return backward(res, dy)

  def backward(res, dy):
    x, wi, bi, wo, bo, u, kept = res
    # Without remat nothing else stands between this and the forward, and
    # XLA would share the GeLU's tanh with the forward's GeLU, whose then
    # second reader stops the epilogue fusion.
    u = jax.lax.optimization_barrier(u)
    if backward_kernel and kept is None and gelu_kernel.applies(dy, wo, u, approximate):
      flat = lambda a: a.reshape(-1, a.shape[-1])   # (batch * seq, features): the kernel's 2-D product
      du, g = gelu_kernel.dgelu_product(flat(dy), wo.T, flat(u), approximate)
      du, g = du.reshape(u.shape), g.reshape(u.shape)
      # (The forward product this vjp would compute is unused: XLA drops it.)
      dwo, dbo = jax.vjp(lambda wo, bo: down(g, wo, bo), wo, bo)[1](dy)
    else:
      g, act_vjp = jax.vjp(act, u)
      g = g if kept is None else kept
      dg, dwo, dbo = jax.vjp(down, g, wo, bo)[1](dy)
      du, = act_vjp(dg)
    # (The product this vjp would recompute is unused: XLA drops it.)
    dx, dwi, dbi = jax.vjp(up, x, wi, bi)[1](du)
    return dx, dwi, dbi, dwo, dbo

  mlp.defvjp(fwd, bwd)
  return mlp(x, wi, bi, wo, bo)


def embed_lookup(table: jax.Array, tokens: jax.Array, plan: Optional[scatter_sum.Plan] = None,
                 partials: Optional[jax.Array] = None) -> jax.Array:
  """table[tokens], with the gradient summed in fp32 whatever the table's dtype.

  The embedding is cast to the compute dtype before it is gathered (FSDP then
  moves half the bytes), but a frequent token's gradient is the sum of
  thousands of rows: a bf16 scatter-add would round after every one of them.
  The backward sums in fp32 and rounds once, as a matrix product's
  accumulator does for every other weight gradient.

  With a `plan` (data parallelism or FSDP, mjax/parallel/scatter_sum.py) the
  table's gradient goes to `partials` instead (their zeros in, each batch
  shard's fp32 partial table out, for the caller to reduce once with the
  tied head's), and the table's own cotangent is zero.
  """
  shape = table.shape

  @jax.custom_vjp
  def lookup(t, tok, c):
    return jnp.take(t, tok, axis=0)

  def fwd(t, tok, c):
    return lookup(t, tok, c), tok

  def bwd(tok, ct):
    if plan is not None:
      return None, None, scatter_sum.lookup_partials(plan, shape, tok, ct)
    grad = jnp.zeros(shape, jnp.float32).at[tok].add(ct.astype(jnp.float32))
    return grad.astype(table.dtype), None, None

  lookup.defvjp(fwd, bwd)
  return lookup(table, tokens, partials)


def rotary(x: jax.Array, positions: jax.Array, theta: float, fraction: float = 1.0) -> jax.Array:
  """Rotary position embedding (RoFormer), rotate-half form.

  Args:
    x: (batch, seq, heads, head_dim).
    positions: (batch, seq) int positions.
    theta: base wavelength.
    fraction: share of the head dims rotated, the first ones (GPT-NeoX's
      rotary_pct); the others pass through.
  Returns:
    x rotated, same shape and dtype.
  """
  r = int(x.shape[-1] * fraction)
  if r < x.shape[-1]:
    rotated, kept = jnp.split(x, [r], axis=-1)  # a split's backward concatenates; slices pad
    return jnp.concatenate([rotary(rotated, positions, theta), kept], axis=-1)
  d = x.shape[-1]
  freq = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)      # (head_dim/2,)
  angle = positions[..., None].astype(jnp.float32) * freq                    # (batch, seq, head_dim/2)
  sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def rotary_projections(x: jax.Array, wq: jax.Array, wk: jax.Array, positions: jax.Array,
                       theta: float) -> tuple[jax.Array, jax.Array]:
  """rotary(x Wq), rotary(x Wk) with the rotation as the product's epilogue
  (mjax/model/rotary_kernel.py: the unrotated q and k never reach memory),
  where `rotary_kernel.applies` holds. Values up to bf16 rounding.

  x (batch, seq, embed) bf16, wq (embed, heads, head_dim), wk (embed,
  kv_heads, head_dim), positions (batch, seq) or broadcast to it. The
  backward is XLA's: the gradients rotated back (rotary by -positions: the
  rotation's transpose), then the products' own gradients."""
  heads, head_dim = wq.shape[1], wq.shape[2]
  positions = jnp.broadcast_to(positions, x.shape[:-1])

  def products(x, wq, wk):
    return matmul(x, wq, 1), matmul(x, wk, 1)

  def kernel(x, wq, wk, positions):
    # q's and k's kernels side by side: one product (XLA writes the
    # joined bf16 copy from the cast ones, 34 MB a layer for 1p3b).
    w = jnp.concatenate([wq.reshape(wq.shape[0], -1), wk.reshape(wk.shape[0], -1)], axis=1)
    q, k = rotary_kernel.rotary_product(x.reshape(-1, x.shape[-1]), w,
                                        rotary_kernel.tables(positions, head_dim, theta), heads * head_dim,
                                        tiles=rotary_kernel.tiles_for(head_dim))
    shape = lambda a: a.reshape(*x.shape[:-1], -1, head_dim)
    return shape(q), shape(k)

  # The kernel in the primal too: a forward that nothing differentiates
  # (evaluation) runs it as well. (Generation, with its KV cache, takes
  # XLA's product and rotary: Attention.__call__.)
  qk = jax.custom_vjp(kernel)

  def fwd(x, wq, wk, positions):
    return kernel(x, wq, wk, positions), (x, wq, wk, positions)

  def bwd(res, cts):
    x, wq, wk, positions = res
    dq, dk = (rotary(ct, -positions, theta) for ct in cts)
    dx, dwq, dwk = jax.vjp(products, x, wq, wk)[1]((dq, dk))
    return dx, dwq, dwk, None

  qk.defvjp(fwd, bwd)
  return qk(x, wq, wk, positions)


def out_proj_std(cfg: ModelConfig) -> float:
  """Residual-branch output init scaled by depth (GPT-2), keeps the stream's
  variance flat at init however many layers there are."""
  branches = 2 * cfg.n_layers
  return cfg.init_std / (branches ** 0.5)


def logical_shards(name: str) -> int:
  """How many shards the current mesh and logical rules cut dimension `name` into.

  1 outside a mesh. Read from the context (jax.set_mesh + flax's logical
  rules), so model code still never holds a mesh.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return 1
  return math.prod(mesh.shape[a] for a in mesh_axes(name))


def _shard_groups(names: list[str], sizes: list[int]) -> Optional[int]:
  """The common shard count of the fused pieces' split dimensions, or None when
  they differ or one does not divide (then the pieces stay separate)."""
  counts = {logical_shards(n) for n in names}
  if len(counts) != 1:
    return None
  t = counts.pop()
  return t if all(s % t == 0 for s in sizes) else None


def fused_inputs(x: jax.Array, projections: list[Weights]) -> Optional[list[jax.Array]]:
  """Several projections of the same input as one matrix product.

  PaLM / MegaScale: q, k, v and the MLP's input projection read the same norm
  output, so one product with their kernels side by side does the work of
  four, with one weight all-gather under FSDP and one larger GEMM instead of
  several small ones. The parameters stay separate; only the compute-dtype
  copies are joined, per step.

  Under tensor parallelism each kernel's output dim is split over `t` shards;
  the kernels are joined shard by shard, as (embed, t, joined / t), so that
  every device joins only what it holds and no data moves.

  Args:
    x: (batch, seq, embed).
    projections: Weights with in_shape (embed,), kernels (embed, n_i, ...).
  Returns:
    Each projection's output, (batch, seq, *features_i), or None when the
    layout cannot join them (the caller then applies them one by one).
  """
  built = [w() for w in projections]
  kernels = [k for k, _ in built]
  t = _shard_groups([w.axes[1] for w in projections], [w.features[0] for w in projections])
  if t is None:
    return None
  e = x.shape[-1]
  joined = jnp.concatenate([k.reshape(e, t, -1) for k in kernels], axis=-1)
  joined_axes = ('embed', projections[0].axes[1], None)
  joined = constrain(joined, joined_axes)
  y = apply_weights(x, joined, None, 1, joined_axes)  # (batch, seq, t, joined / t)
  y = constrain(y, ('batch', 'seq', projections[0].axes[1], None))
  # One split, not a slice per projection: the backward of a split is one
  # concatenate of the cotangents, where slices transpose to zero-padded
  # copies of the whole joined width that XLA then sums (a pad per
  # projection plus an add: 13% of the peer model's CPU step, and the same
  # pads in a GPU compile).
  sizes = [k[0].size // t for k, _ in built]
  pieces = jnp.split(y, list(itertools.accumulate(sizes[:-1])), axis=-1)
  outs = []
  for w, (_, bias), out in zip(projections, built, pieces):
    out = out.reshape(*x.shape[:-1], *w.features)
    outs.append(out if bias is None else out + bias)
  return outs


def fused_outputs(parts: list[tuple[jax.Array, Weights]]) -> Optional[jax.Array]:
  """The sum of several output projections as one matrix product.

  The parallel block adds attention's and the MLP's output projections; with
  their inputs side by side along the contracted dim the sum is one product
  (and one reduce-scatter under tensor parallelism, not two).

  Args:
    parts: (activation (batch, seq, *in_shape_i), Weights with kernel
      (*in_shape_i, embed)).
  Returns:
    (batch, seq, embed), or None when the layout cannot join them.
  """
  built = [w() for _, w in parts]
  t = _shard_groups([w.axes[0] for _, w in parts], [w.in_shape[0] for _, w in parts])
  if t is None:
    return None
  e = parts[0][1].features[-1]
  lead = parts[0][0].shape[:2]
  acts = jnp.concatenate([a.reshape(*lead, t, -1).astype(k.dtype) for (a, _), (k, _) in zip(parts, built)],
                         axis=-1)
  kernels = jnp.concatenate([k.reshape(t, -1, e) for k, _ in built], axis=1)
  name = parts[0][1].axes[0]
  acts = constrain(acts, ('batch', 'seq', name, None))
  kernel_axes = (name, None, 'embed')
  y = apply_weights(acts, constrain(kernels, kernel_axes), None, 2, kernel_axes)  # (batch, seq, embed)
  for _, bias in built:
    if bias is not None:
      y = y + bias
  return y
