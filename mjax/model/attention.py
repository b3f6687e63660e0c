"""Causal self-attention: full or sliding-window, multi-head or grouped-query.

Two implementations compute the same function:
  * `reference_attention`: einsum + explicit mask + fp32 softmax. Plain XLA,
    easy to read, the numerical reference every other path is tested against.
  * `fast_attention`: cuDNN flash attention through
    `jax.nn.dot_product_attention` on GPU (O(seq) memory, fused kernel), and
    elsewhere `xla_attention`: the reference's forward with the backward
    written out as flash attention computes it (see there).

Window convention (used everywhere in mjax, FLOP counting included): with
window `w`, query position i attends to key positions j with i - w < j <= i,
i.e. itself and the w - 1 tokens before it. `None` is full causal attention,
and any w >= seq_len is the same function as full causal attention.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from mjax.config import ModelConfig
from mjax.model import rotary_kernel
from mjax.model.layers import (ROTATED, Weights, constrain, fan_out, project, project_many, rotary,
                                rotary_projections, weights)

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: no inf - inf = NaN


def causal_mask(q_len: int, k_len: int, window: Optional[int], q_start: int = 0, k_start: int = 0) -> jax.Array:
  """(q_len, k_len) bool mask; True where attention is allowed.

  q_start, k_start: positions of the first query and key (a block of a longer
  sequence)."""
  q = jnp.arange(q_start, q_start + q_len)[:, None]
  k = jnp.arange(k_start, k_start + k_len)[None, :]
  allowed = k <= q
  if window is not None:
    allowed &= k > q - window
  return allowed


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: Optional[int],
                        segment_ids: Optional[jax.Array] = None) -> jax.Array:
  """Masked softmax attention, the readable reference.

  Args:
    q: (batch, seq, heads, head_dim).
    k, v: (batch, seq, kv_heads, head_dim); heads % kv_heads == 0 (GQA).
    window: sliding window or None (full causal).
    segment_ids: optional (batch, seq) document ids of packed sequences; a
      token attends only within its own document.
  Returns:
    (batch, seq, heads, head_dim) in q's dtype.
  """
  b, s, h, d = q.shape
  kvh = k.shape[2]
  q = q.reshape(b, s, kvh, h // kvh, d)                       # (batch, seq, kv_heads, group, head_dim)
  scores = jnp.einsum('bqhgd,bkhd->bhgqk', q, k, preferred_element_type=jnp.float32)
  scores = scores / jnp.sqrt(jnp.float32(d))
  scores = jnp.where(_allowed((0, s, 0), window, segment_ids, head_axes=2), scores, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)     # (batch, kv_heads, group, q, k)
  out = jnp.einsum('bhgqk,bkhd->bqhgd', probs, v)
  return out.reshape(b, s, h, d)


def query_blocks(seq: int, window: Optional[int], block: Optional[int] = None) -> tuple[tuple[int, int, int], ...]:
  """(q0, q1, k0) per block of queries: queries q0..q1-1 see keys k0..q1-1 at most.

  Causal attention never looks ahead, and a sliding window never further back
  than window - 1 keys, so a block of queries needs only that span of keys:
  with 8 blocks a causal layer computes 9/16 of the (q, k) matrix, and a
  window w << seq costs O(seq * (block + w)) instead of O(seq^2). Blocks are
  seq/8 queries (at least 128, so the products stay large), or the window
  when that is shorter, but never more than 16 blocks: each is its own ops in
  the program, so a short window on a long sequence must not multiply the
  compile time. Measured on CPU (bench/RESULTS.md), forward + backward at
  seq 2048: seq/8 against seq/4 1.13x as fast, 1.37x with a 512 window; 16
  blocks were no faster than 8, and at seq 256 blocks of 64 did not speed up
  the peer model's step. `block` overrides that choice.
  """
  block = block or max(128, -(-seq // 16), min(-(-seq // 8), window or seq))
  return tuple((q0, min(seq, q0 + block), 0 if window is None else max(0, q0 - window + 1))
               for q0 in range(0, seq, block))


def _allowed(blk: tuple[int, int, int], window: Optional[int], segment_ids: Optional[jax.Array],
             head_axes: int = 1) -> jax.Array:
  """Where queries q0..q1-1 may attend to keys k0..q1-1 (blk = (q0, q1, k0)):
  (q, k), or with documents (batch, 1 x head_axes, q, k)."""
  q0, q1, k0 = blk
  allowed = causal_mask(q1 - q0, q1 - k0, window, q0, k0)
  if segment_ids is not None:
    same = segment_ids[:, q0:q1, None] == segment_ids[:, None, k0:q1]   # (batch, q, k)
    allowed = (allowed & same).reshape(same.shape[:1] + (1,) * head_axes + same.shape[1:])
  return allowed


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: Optional[int],
                   blocks: tuple, segment_ids: Optional[jax.Array]) -> jax.Array:
  return _xla_attention_fwd(q, k, v, window, blocks, segment_ids)[0]


def _heads_first(x: jax.Array) -> jax.Array:
  """(batch, seq, heads, d) <-> (batch, heads, seq, d)."""
  return x.transpose(0, 2, 1, 3)


def _xla_attention_fwd(q, k, v, window, blocks, segment_ids):
  # Heads first, once, for the whole layer: every block's products are then
  # batched over (batch, heads) with the contracted dim already innermost.
  # Left to XLA:CPU, the layout is chosen per product and each block pays
  # its own transposes (the peer model's attention: 1.3x the time).
  q, k, v = _heads_first(q), _heads_first(k), _heads_first(v)
  scale = 1.0 / float(q.shape[-1]) ** 0.5
  outs, probs = [], []
  for blk in blocks:
    q0, q1, k0 = blk
    scores = jnp.einsum('bhqd,bhkd->bhqk', q[:, :, q0:q1], k[:, :, k0:q1], preferred_element_type=jnp.float32)
    scores = jnp.where(_allowed(blk, window, segment_ids), scores * scale, _MASK_VALUE)
    e = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    probs.append(e / jnp.sum(e, axis=-1, keepdims=True))   # fp32 (batch, heads, q1 - q0, q1 - k0)
    outs.append(jnp.einsum('bhqk,bhkd->bhqd', probs[-1].astype(v.dtype), v[:, :, k0:q1]))
  out = jnp.concatenate(outs, axis=2)
  return _heads_first(out), (q, k, v, segment_ids, probs, out)


def _xla_attention_bwd(window, blocks, res, d_out):
  q, k, v, segment_ids, probs, out = res      # heads first
  d_out = _heads_first(d_out)
  f32 = jnp.float32
  scale = 1.0 / float(q.shape[-1]) ** 0.5
  # The softmax's backward needs, per query, sum_k p_k dp_k. That equals
  # d_out . out (out = sum_k p_k v_k): a reduction over head_dim instead of
  # over the keys, so the (q, k)-sized arrays are only read, never reduced.
  rows = jnp.einsum('bhqd,bhqd->bhq', d_out, out, preferred_element_type=f32)[..., None]
  dq, dk, dv = [], jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32)
  for (q0, q1, k0), p in zip(blocks, probs):
    d_probs = jnp.einsum('bhqd,bhkd->bhqk', d_out[:, :, q0:q1], v[:, :, k0:q1], preferred_element_type=f32)
    d_scores = (p * (d_probs - rows[:, :, q0:q1]) * scale).astype(q.dtype)
    dq.append(jnp.einsum('bhqk,bhkd->bhqd', d_scores, k[:, :, k0:q1], preferred_element_type=f32))
    dk = dk.at[:, :, k0:q1].add(jnp.einsum('bhqk,bhqd->bhkd', d_scores, q[:, :, q0:q1], preferred_element_type=f32))
    dv = dv.at[:, :, k0:q1].add(jnp.einsum('bhqk,bhqd->bhkd', p.astype(v.dtype), d_out[:, :, q0:q1],
                                           preferred_element_type=f32))
  dq = jnp.concatenate(dq, axis=2)
  back = lambda g, like: _heads_first(g).astype(like.dtype)
  return back(dq, q), back(dk, k), back(dv, v), None


_xla_attention.defvjp(_xla_attention_fwd, _xla_attention_bwd)


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: Optional[int],
                  segment_ids: Optional[jax.Array] = None, block: Optional[int] = None) -> jax.Array:
  """Same contract and function as `reference_attention`, in less time.

  Two changes, both what flash attention does:
    * Queries go in blocks, each with only the keys it can see
      (`query_blocks`): the masked-out corner of the (q, k) matrix is never
      computed.
    * The backward is written out. Autodiff of the reference differentiates
      the softmax as written: it reduces the probabilities times their
      cotangents over the keys, and XLA:CPU fuses that reduction into the
      product before it, which then runs at a fraction of the machine's speed
      (bench/RESULTS.md). Here the per-query sum comes from the output instead
      (`_xla_attention_bwd`), so each (q, k)-sized step is one product or one
      elementwise pass.
  The residuals are the autodiff's (the fp32 probabilities), of the blocks.

  Grouped-query k and v are repeated to every query head of their group
  (consecutive heads share one kv head); the repeat's gradient sums the group.
  Batched products over one head axis lay out better than over (kv_heads,
  group) on XLA:CPU, and the copies are (seq, head_dim)-sized, not (q, k).
  """
  s = q.shape[1]
  group = q.shape[2] // k.shape[2]
  if group > 1:
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  return _xla_attention(q, k, v, window, query_blocks(s, window, block), segment_ids)


def jax_nn_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: Optional[int],
                     implementation: Optional[str], segment_ids: Optional[jax.Array] = None) -> jax.Array:
  """`reference_attention`'s contract through jax.nn.dot_product_attention."""
  s = q.shape[1]
  local = None if window is None or window >= s else (window - 1, 0)
  mask = None
  if segment_ids is not None:
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # (batch, 1, q, k)
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, local_window_size=local,
                                      implementation=implementation)


def fast_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: Optional[int],
                   implementation: Optional[str] = None,
                   segment_ids: Optional[jax.Array] = None) -> jax.Array:
  """Same contract as `reference_attention`: cuDNN or `xla_attention`.

  Args:
    implementation: 'cudnn' runs jax.nn.dot_product_attention's cuDNN flash
      attention and fails loudly if cuDNN cannot run these shapes; None runs
      `xla_attention` (jax.nn.dot_product_attention's own XLA path is the
      reference's autodiff, which `xla_attention` is faster than).
  """
  if implementation != 'cudnn':
    return xla_attention(q, k, v, window, segment_ids)
  return jax_nn_attention(q, k, v, window, 'cudnn', segment_ids)


def cudnn_eligible(q: jax.Array) -> bool:
  """Whether cuDNN flash attention can run these queries on this backend.

  jax.nn.dot_product_attention with implementation=None always runs XLA's
  O(seq^2) attention, even on a GPU, so 'dot_product' chooses for itself:
  cuDNN needs a CUDA device, 16-bit inputs and a head_dim that is a multiple
  of 8 up to 128.
  """
  d = q.shape[-1]
  if jax.default_backend() != 'gpu' or q.dtype not in (jnp.bfloat16, jnp.float16) or d % 8 or d > 128:
    return False
  # cuDNN flash attention needs an NVIDIA GPU of compute capability 8.0
  # (Ampere) or newer; jax's own cuDNN check reads the same attribute. Other
  # GPUs (ROCm: no such attribute, or not a number) keep XLA's attention.
  try:
    return float(getattr(jax.devices()[0], 'compute_capability', None)) >= 8.0
  except (TypeError, ValueError):
    return False


def attend(q, k, v, window: Optional[int], impl: str, segment_ids=None) -> jax.Array:
  if impl == 'xla':
    return reference_attention(q, k, v, window, segment_ids)
  use_cudnn = impl == 'cudnn' or cudnn_eligible(q)
  return fast_attention(q, k, v, window, implementation='cudnn' if use_cudnn else None,
                        segment_ids=segment_ids)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                     cache: dict, window: Optional[int]) -> tuple[jax.Array, dict]:
  """Attention of new tokens over a KV cache and themselves; the updated cache.

  The cache of a layer holds `L` slots: k, v (batch, L, kv_heads, head_dim)
  and `pos` (batch, L), the position of the token in each slot (-1: empty).
  A token at position p goes to slot p mod L, so a sliding-window layer with
  L = window is a ring buffer: its memory stays w tokens however long the
  text grows, and the oldest key is overwritten exactly when it leaves the
  window. Which keys a query sees is decided by the stored positions alone
  (causal, within the window, not empty), so the same code serves prefill
  (many tokens) and decoding (one).

  Args:
    q: (batch, t, heads, head_dim), rotated.
    k, v: (batch, t, kv_heads, head_dim), k rotated.
    positions: (batch, t) positions of the new tokens; negative marks left
      padding (attends to nothing, is never attended to).
    cache: {'k', 'v', 'pos'} as above.
    window: the layer's sliding window, None for full causal attention.
  Returns:
    ((batch, t, heads, head_dim) in q's dtype, the cache with the newest
    min(t, L) tokens written).
  """
  b, t, h, d = q.shape
  kvh, slots = k.shape[2], cache['pos'].shape[1]
  new_pos = jnp.where(positions >= 0, positions, -1).astype(jnp.int32)
  # The newest L tokens go into their slots (consecutive positions mod L:
  # distinct slots, so no write lands on another).
  n = min(t, slots)
  slot = jnp.mod(positions[:, t - n:], slots)                                    # (batch, n)
  rows = jnp.arange(b)[:, None]
  new_cache = {
      'k': cache['k'].at[rows, slot].set(k[:, t - n:].astype(cache['k'].dtype)),
      'v': cache['v'].at[rows, slot].set(v[:, t - n:].astype(cache['v'].dtype)),
      'pos': cache['pos'].at[rows, slot].set(new_pos[:, t - n:]),
  }
  if t == 1:
    # Decoding: the updated cache holds every key the token may see (the one
    # it overwrote has left the window), so no copy of cache + new token.
    keys, vals, kpos = new_cache['k'], new_cache['v'], new_cache['pos'][:, None, :]
  else:
    # Several tokens: a token may overwrite a key an earlier one of them
    # still sees, so attend over the old cache and the new tokens.
    keys = jnp.concatenate([cache['k'], k.astype(cache['k'].dtype)], axis=1)   # (batch, L + t, kv, d)
    vals = jnp.concatenate([cache['v'], v.astype(cache['v'].dtype)], axis=1)
    kpos = jnp.concatenate([cache['pos'], new_pos], axis=1)[:, None, :]          # (batch, 1, L + t)
  qpos = positions[:, :, None]                                                   # (batch, t, 1)
  allowed = (kpos >= 0) & (kpos <= qpos)
  if window is not None:
    allowed &= kpos > qpos - window
  qg = q.reshape(b, t, kvh, h // kvh, d)
  scores = jnp.einsum('bqhgd,bkhd->bhgqk', qg, keys, preferred_element_type=jnp.float32)
  scores = jnp.where(allowed[:, None, None], scores / jnp.sqrt(jnp.float32(d)), _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(vals.dtype)
  out = jnp.einsum('bhgqk,bkhd->bqhgd', probs, vals).reshape(b, t, h, d).astype(q.dtype)
  return out, new_cache


def cache_slots(window: Optional[int], max_len: int) -> int:
  """KV-cache length of a layer: its window (a ring buffer) or the whole text."""
  return max_len if window is None else min(window, max_len)


class Attention(nn.Module):
  """Projections + rotary + (windowed) causal attention + output projection.

  `inputs()` / `attend()` / `output()` are the pieces the fused parallel
  block joins with the MLP's; `__call__` is attention on its own.
  """
  cfg: ModelConfig
  window: Optional[int]
  out_std: float
  # Name q and k after rotary for the remat policies (see `attend`); off
  # where the projections run as one joined product, whose saved output
  # holds q and k already.
  keep_rotated: bool = True

  def setup(self):
    c = self.cfg
    hd, e = c.dim_per_head, (c.d_model,)
    self.query = weights(c, e, (c.n_heads, hd), ('embed', 'heads', 'kv'), c.init_std, 'query')
    self.key = weights(c, e, (c.kv_heads, hd), ('embed', 'kv_heads', 'kv'), c.init_std, 'key')
    self.value = weights(c, e, (c.kv_heads, hd), ('embed', 'kv_heads', 'kv'), c.init_std, 'value')
    self.out = weights(c, (c.n_heads, hd), e, ('heads', 'kv', 'embed'), self.out_std, 'out')

  def inputs(self) -> list[Weights]:
    """The q, k, v projections, in the order `attend` takes their outputs."""
    return [self.query, self.key, self.value]

  def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
             segment_ids: Optional[jax.Array] = None, cache: Optional[dict] = None, rotated: bool = False):
    """(batch, seq, heads | kv_heads, head_dim) projections -> (batch, seq, heads, head_dim).

    `rotated`: q and k come rotated already (`rotary_projections`).

    With a KV cache (generation): attention over the cache and the new
    tokens, returned with the updated cache (see `cached_attention`).
    """
    c = self.cfg
    # Laid out as attention reads them already where the projections leave
    # them (heads over tensor, the whole sequence), not only after rotary:
    # under sequence parallelism GSPMD otherwise kept some layers' q and k
    # split along the sequence with every head, gathered their kernels over
    # tensor too and moved the activations by all-to-all.
    q = constrain(q, ('batch', 'seq', 'heads', 'kv'))
    k = constrain(k, ('batch', 'seq', 'kv_heads', 'kv'))
    if not rotated:
      q = constrain(rotary(q, positions, c.rope_theta, c.rotary_fraction), ('batch', 'seq', 'heads', 'kv'))
      k = constrain(rotary(k, positions, c.rope_theta, c.rotary_fraction), ('batch', 'seq', 'kv_heads', 'kv'))
    if self.keep_rotated:
      # Named for the remat policies, which keep q and k rotated rather than
      # as their projections left them: the attention's backward reads them
      # rotated and rotary's own backward reads neither, so as many bytes
      # are kept and the backward does not rotate them again (on the 1p3b
      # H100 step, 48 passes of ~0.1 ms).
      q, k = checkpoint_name(q, ROTATED), checkpoint_name(k, ROTATED)
    v = constrain(v, ('batch', 'seq', 'kv_heads', 'kv'))
    if cache is not None:
      out, cache = cached_attention(q, k, v, positions, cache, self.window)
      return constrain(out, ('batch', 'seq', 'heads', 'kv')), cache
    out = attend(q, k, v, self.window, c.attention_impl, segment_ids)
    return constrain(out, ('batch', 'seq', 'heads', 'kv'))

  def output(self) -> Weights:
    return self.out

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: Optional[jax.Array] = None,
               cache: Optional[dict] = None):  # x: (batch, seq, embed)
    if cache is None and self.cfg.rotary_kernel and not self.cfg.use_bias:
      (wq, _), (wk, _) = self.query(), self.key()
      if rotary_kernel.applies(x, wq, wk, self.cfg.rotary_fraction):
        # q and k rotated in their product's epilogue, on one Hopper GPU.
        x_qk, x_v = fan_out(x, 2)
        q, k = rotary_projections(x_qk, wq, wk, positions, self.cfg.rope_theta)
        v = project(x_v, self.value, 1)
        return project(self.attend(q, k, v, positions, segment_ids, rotated=True), self.out, 2)
    q, k, v = project_many(x, self.inputs(), 1)
    if cache is not None:
      out, cache = self.attend(q, k, v, positions, cache=cache)
      return project(out, self.out, 2), cache
    return project(self.attend(q, k, v, positions, segment_ids), self.out, 2)
