"""Building blocks: projections, norms, MLPs, rotary embeddings.

Every parameter is created with logical axis names (see mjax.parallel.rules
for how they map onto a mesh); nothing here knows about devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from mjax.config import ModelConfig

Dtype = jnp.dtype


def dtype_of(name: str) -> Dtype:
  return jnp.dtype(name)


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
  """Pins an activation's layout by logical names (no-op without a mesh)."""
  return nn.with_logical_constraint(x, axes)


class Linear(nn.Module):
  """y = einsum(x, W) over the trailing `len(in_axes)` dims of x.

  Attributes:
    features: output feature shape, e.g. (heads, head_dim).
    axes: logical names of the kernel, input dims first then output dims.
    n_in: how many trailing dims of x are contracted.
  """
  features: tuple[int, ...]
  axes: tuple[str, ...]
  n_in: int = 1
  std: float = 0.02
  use_bias: bool = False
  dtype: Dtype = jnp.bfloat16
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    in_shape = x.shape[-self.n_in:]
    init = nn.initializers.normal(self.std)
    kernel = self.param('kernel', nn.with_logical_partitioning(init, self.axes),
                        (*in_shape, *self.features), self.param_dtype)
    # Master weights stay fp32; the matrix product runs in the compute dtype.
    # The cast is pinned to the kernel's own (FSDP-sharded) layout, so each
    # device casts its shard and the all-gather moves bf16, half the bytes of
    # gathering fp32 and casting afterwards.
    x = x.astype(self.dtype)
    kernel = constrain(kernel.astype(self.dtype), self.axes)
    y = jax.lax.dot_general(
        x, kernel, (((tuple(range(x.ndim - self.n_in, x.ndim))), tuple(range(self.n_in))), ((), ())))
    if self.use_bias:
      bias = self.param('bias', nn.with_logical_partitioning(nn.initializers.zeros, self.axes[self.n_in:]),
                        self.features, self.param_dtype)
      y = y + bias.astype(self.dtype)
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
    # Statistics in fp32: bf16 variance of a 12k-wide row loses the signal.
    xf = x.astype(jnp.float32)
    if self.kind == 'layernorm':
      xf = xf - jnp.mean(xf, axis=-1, keepdims=True)
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.eps)
    y = y * scale.astype(jnp.float32)
    if self.kind == 'layernorm' and self.use_bias:
      bias = self.param('bias', nn.with_logical_partitioning(nn.initializers.zeros, ('embed',)),
                        (d,), self.param_dtype)
      y = y + bias.astype(jnp.float32)
    return y.astype(self.dtype)


def make_norm(cfg: ModelConfig, name: str) -> Norm:
  return Norm(kind=cfg.norm, eps=cfg.norm_eps, use_bias=True,
              dtype=dtype_of(cfg.dtype), param_dtype=dtype_of(cfg.param_dtype), name=name)


class Mlp(nn.Module):
  """GeLU MLP (MegaScale, GPT-3) or SwiGLU (LLaMA)."""
  cfg: ModelConfig
  out_std: float

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:  # (batch, seq, embed)
    c = self.cfg
    kw = dict(dtype=dtype_of(c.dtype), param_dtype=dtype_of(c.param_dtype), use_bias=c.use_bias)
    up = Linear((c.d_ff,), ('embed', 'mlp'), std=c.init_std, name='wi', **kw)(x)
    if c.mlp == 'swiglu':
      gate = Linear((c.d_ff,), ('embed', 'mlp'), std=c.init_std, name='wi_gate', **kw)(x)
      h = nn.silu(gate) * up
    else:
      h = nn.gelu(up, approximate=True)
    h = constrain(h, ('batch', 'seq', 'mlp'))  # (batch, seq, mlp)
    return Linear((c.d_model,), ('mlp', 'embed'), std=self.out_std, name='wo', **kw)(h)


def embed_lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
  """table[tokens], with the gradient summed in fp32 whatever the table's dtype.

  The embedding is cast to the compute dtype before it is gathered (FSDP then
  moves half the bytes), but a frequent token's gradient is the sum of
  thousands of rows: a bf16 scatter-add would round after every one of them.
  The backward sums in fp32 and rounds once, as a matrix product's
  accumulator does for every other weight gradient.
  """
  shape = table.shape

  @jax.custom_vjp
  def lookup(t, tok):
    return jnp.take(t, tok, axis=0)

  def fwd(t, tok):
    return lookup(t, tok), tok

  def bwd(tok, ct):
    grad = jnp.zeros(shape, jnp.float32).at[tok].add(ct.astype(jnp.float32))
    return grad.astype(table.dtype), None

  lookup.defvjp(fwd, bwd)
  return lookup(table, tokens)


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding (RoFormer), rotate-half form.

  Args:
    x: (batch, seq, heads, head_dim).
    positions: (batch, seq) int positions.
    theta: base wavelength.
  Returns:
    x rotated, same shape and dtype.
  """
  d = x.shape[-1]
  freq = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)      # (head_dim/2,)
  angle = positions[..., None].astype(jnp.float32) * freq                    # (batch, seq, head_dim/2)
  sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def out_proj_std(cfg: ModelConfig) -> float:
  """Residual-branch output init scaled by depth (GPT-2), keeps the stream's
  variance flat at init however many layers there are."""
  branches = 2 * cfg.n_layers
  return cfg.init_std / (branches ** 0.5)
