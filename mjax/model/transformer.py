"""The decoder-only transformer, built from MegaScale's parallel block.

Parallel block (GPT-J, PaLM, MegaScale):   y = x + Attn(LN(x)) + MLP(LN(x))
Sequential block (GPT-2/3, for comparison): h = x + Attn(LN1(x)); y = h + MLP(LN2(h))

The parallel form needs one norm instead of two and lets attention and the MLP
run side by side, so their input all-gather / output reduce-scatter under
tensor parallelism can be fused into one.

Layers are grouped by the attention pattern (`ModelConfig.layer_period`
layers, the last one full-causal when `full_attention_every` is set) and the
groups are stacked with `nn.scan`: one compiled group body however deep the
model is, and parameters carry a leading `layers` axis.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import linen as nn

from mjax.config import ModelConfig
from mjax.parallel import collective_matmul, scatter_sum
from mjax.model.attention import Attention
from mjax.model.layers import (CAST_KERNEL, MLP_ACTIVATION, MLP_PRODUCT, NORM_STATS, ROTATED, Mlp, constrain, dtype_of, embed_lookup, fan_out, fused_inputs, fused_outputs, make_norm,
                               matmul, out_proj_std, project_many, project_sum)

# The residual stream: sharded over the sequence under sequence parallelism.
ACT = ('batch', 'residual_seq', 'embed')



def _dots_and_flash_attention(prim, *args, **params) -> bool:
  """checkpoint_dots, and also the fused (cuDNN) attention forward's outputs.

  The flash kernel's output and softmax statistics are what its backward
  reads; keeping them (a (batch, seq, heads, head_dim) tensor and a small
  fp32 one per layer) saves running the attention forward a second time in
  the backward pass. Elsewhere (XLA attention) this is 'dots'.
  """
  return (prim.name.startswith('dot_product_attention_fwd')
          or jax.checkpoint_policies.checkpoint_dots(prim, *args, **params))


_MLP_ACTIVATION_SAVEABLE = jax.checkpoint_policies.save_only_these_names(MLP_ACTIVATION)


def _dots_attention_and_mlp_activation(prim, *args, **params) -> bool:
  """dots_attention, and also the MLP's activation (GeLU(x W_in), or SwiGLU's
  product): the output projection's weight gradient reads it, so the
  backward does not compute it again from the saved input projection. One
  (batch, seq, d_ff) tensor more per layer, in the compute dtype."""
  return (_dots_and_flash_attention(prim, *args, **params)
          or _MLP_ACTIVATION_SAVEABLE(prim, *args, **params))


# What every policy but 'full' keeps by name (see _and_named).
KEPT_NAMES = (NORM_STATS, ROTATED, MLP_PRODUCT, CAST_KERNEL)
_NAMED_SAVEABLE = jax.checkpoint_policies.save_only_these_names(*KEPT_NAMES)


def _and_named(policy):
  """`policy`, and also what costs nothing to keep: the norms' row
  statistics (one fp32 number per row; kept, the backward reads the norm's
  input once instead of recomputing them) and q and k after rotary (kept in
  place of the projections' outputs, which then nothing in the backward
  reads), and the GeLU MLP unit's input product (`layers.gelu_mlp`: the
  product every dots policy keeps, under its own name), and the
  projections' kernels cast to the compute dtype (the fp32 master weights
  are then read once a step, not again in the backward)."""
  return jax.checkpoint_policies.save_from_both_policies(policy, _NAMED_SAVEABLE)


REMAT_POLICIES = {
    'full': jax.checkpoint_policies.nothing_saveable,
    'dots': _and_named(jax.checkpoint_policies.checkpoint_dots),
    'dots_attention': _and_named(_dots_and_flash_attention),
    'dots_attention_mlp': _and_named(_dots_attention_and_mlp_activation),
    'dots_no_batch': _and_named(jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
}


def fusion(cfg: ModelConfig, platform: Optional[str] = None) -> str:
  """ModelConfig.fuse_projections with 'auto' resolved for `platform`
  (default: the running backend). On a GPU cuBLAS runs the separate products
  at full speed and XLA would materialize the joined ones (measured slower on
  an H100, bench/RESULTS.md), so they stay apart there."""
  if cfg.fuse_projections != 'auto':
    return cfg.fuse_projections
  return 'none' if (platform or jax.default_backend()) == 'gpu' else 'inputs'


class Block(nn.Module):
  cfg: ModelConfig
  window: Optional[int]

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: Optional[jax.Array] = None,
               cache: Optional[dict] = None):  # (batch, seq, embed)
    """x after the block; with a KV cache (generation), (x, the updated cache)."""
    c = self.cfg
    std = out_proj_std(c)
    fuse = fusion(c)
    # (Where a layout cannot join them, `_fused_parallel` falls back to
    # separate products with q and k unnamed: right, without that saving.)
    shared = c.block == 'parallel' and c.parallel_norms != 'separate'
    joined = shared and fuse != 'none'
    attn = Attention(c, self.window, std, keep_rotated=not joined, name='attn')
    mlp = Mlp(c, std, name='mlp')
    if c.block == 'parallel' and c.parallel_norms == 'separate':
      # GPT-NeoX: each branch its own norm (so no shared input to join on).
      a, cache = _split(attn(make_norm(c, 'norm_attn')(x), positions, segment_ids, cache), cache)
      x = x + (a + mlp(make_norm(c, 'norm_mlp')(x)))
    elif joined or (shared and cache is None and collective_matmul.wanted(x)):
      # Under collective matmul the branches share their rings even where
      # the products stay apart (fuse 'none', the GPU's): one all-gather
      # ring into q, k, v and the MLP, one reduce-scatter ring out of both.
      # Each branch on its own ran its own two rings (1p3b, fsdp 4 x tensor
      # 2 on 8 H100s: 7 ring transfers a layer where 4 do).
      y, cache = self._fused_parallel(attn, mlp, make_norm(c, 'norm')(x), positions, segment_ids, fuse,
                                      cache)
      x = x + y
    elif c.block == 'parallel':
      h = make_norm(c, 'norm')(x)
      # (Both branches' input gradients summed into the products: fan_out.)
      h_attn, h = fan_out(h, 2)
      a, cache = _split(attn(h_attn, positions, segment_ids, cache), cache)
      # The branches summed first: cuBLAS then adds one output projection
      # into the other's result (beta = 1), and x comes once after. Summed
      # onto x first, XLA copies x for that (the backward still reads it):
      # one (batch, seq, embed) copy a layer more (a deviceless H100 count).
      x = x + (a + mlp(h))
    else:
      a, cache = _split(attn(make_norm(c, 'norm_attn')(x), positions, segment_ids, cache), cache)
      x = x + a
      x = x + mlp(make_norm(c, 'norm_mlp')(x))
    x = constrain(x, ACT)
    return x if cache is None else (x, cache)

  def _fused_parallel(self, attn: Attention, mlp: Mlp, h: jax.Array, positions: jax.Array,
                      segment_ids: Optional[jax.Array], fuse: str, cache: Optional[dict]):
    """(Attn(h) + MLP(h), cache) with q, k, v and the MLP input as one matrix
    product and, with fuse_projections='all', both output projections as one."""
    ins = attn.inputs() + mlp.inputs()
    ys = fused_inputs(h, ins) if fuse != 'none' else None
    if ys is None:  # a layout the kernels cannot be joined in, or not to be
      ys = project_many(h, ins, 1)
    a, cache = _split(attn.attend(*ys[:3], positions, segment_ids, cache), cache)
    m = mlp.activate(*ys[3:])
    if fuse == 'all':
      y = fused_outputs([(a, attn.output()), (m, mlp.output())])
      if y is not None:
        return y, cache
    return project_sum([(a, attn.output(), 2), (m, mlp.output(), 1)]), cache


def _split(result, cache: Optional[dict]):
  """(value, cache) of a call that returns a pair only when given a cache."""
  return result if cache is not None else (result, None)


def _gathered_twice(table: jax.Array, dtype, plan: Optional[scatter_sum.Plan] = None):
  """The embedding cast to `dtype` on its shards and gathered along `embed`,
  once, returned for its two readers (lookup and tied head), with the zeros
  their partial gradients go to under a `plan` (else None).

  Without a plan their gradients come back separately and are added in fp32:
  through one shared bf16 value JAX would add them in bf16. With one (data
  parallelism or FSDP, mjax/parallel/scatter_sum.py) each reader leaves its
  fp32 partial table of each batch shard in the zeros' cotangent instead,
  where autodiff adds the two; their sum is reduced onto the table's shards
  once, in the compute dtype. GSPMD would reduce each reader's sum on its
  own (the lookup's as an fp32 all-reduce of the whole table): 1p3b on 8
  H100s, deviceless, 2,321 MiB of collectives a step -> 1,446 under FSDP,
  1,985 -> 1,110 data parallel, all at the report's minimum.
  """

  def gather(t):
    g = constrain(constrain(t.astype(dtype), ('vocab', 'embed')), ('vocab', None))
    return g, g, (None if plan is None else scatter_sum.zeros(plan, table.shape))

  def backward(cts):
    lookup, head, partials = cts
    if plan is not None:   # the readers' cotangents are zeros: all is in the partials
      total = scatter_sum.reduce_partials(plan, partials, dtype)
      return constrain(total.astype(table.dtype), ('vocab', 'embed'))
    # The head's gradient is a matrix product over the batch: laid out on
    # the table's own shards at once, its sum over the batch's devices is a
    # reduce-scatter (an all-reduce, twice the bytes, when it was first laid
    # out gathered). The lookup's scatter-add stays laid out as the forward's
    # value: on its shards at once, GSPMD moves the cotangent from batch to
    # embed sharding, which it cannot do without a full regather when both
    # fsdp and other axes split the batch (data 2, fsdp 2, tensor 2).
    a = constrain(lookup.astype(jnp.float32), ('vocab', None))
    b = constrain(head.astype(jnp.float32), ('vocab', 'embed'))
    return constrain((a + b).astype(table.dtype), ('vocab', 'embed'))

  return _with_backward(gather, backward)(table)


def _with_backward(forward: Callable, backward: Callable) -> Callable:
  """`forward` (one argument) with `backward(cotangents) -> its cotangent`
  as its VJP; nothing is kept from the forward."""
  f = jax.custom_vjp(forward)
  f.defvjp(lambda x: (forward(x), None), lambda _, cts: (backward(cts),))
  return f


def _gathered_head(head: jax.Array, dtype, plan: Optional[scatter_sum.Plan] = None):
  """The untied head (embed, vocab) cast to `dtype` on its shards and
  gathered along `embed` once, for the product and its backward, with the
  zeros its partial gradients go to under a `plan` (else None), as
  `_gathered_twice` does for the tied table. Without the plan GSPMD reduced
  the head's gradient by layout: under data x fsdp x tensor as an all-reduce
  of the gathered head, sliced."""

  def gather(h):
    g = constrain(constrain(h.astype(dtype), ('embed', 'vocab')), (None, 'vocab'))
    return g, (None if plan is None else scatter_sum.zeros(plan, h.shape[::-1]))

  if plan is None:
    return gather(head)

  def backward(cts):
    total = scatter_sum.reduce_partials(plan, cts[1], dtype)   # (vocab, embed), as a table
    return constrain(total.T.astype(head.dtype), ('embed', 'vocab'))

  return _with_backward(gather, backward)(head)


def _head_to_partials(x: jax.Array, table: jax.Array, plan: scatter_sum.Plan, partials: jax.Array,
                      kernel_in_last: bool = True) -> jax.Array:
  """x table^T, the logits of the tied head, whose weight gradient goes to
  `partials` (each batch shard's fp32 partial: scatter_sum.head_partials)
  rather than to the table: see _gathered_twice. With `kernel_in_last`
  False, x head for an untied (embed, vocab) head (_gathered_head); its
  partials are laid out (vocab, embed) all the same."""

  def logits(x, t):
    return matmul(x, t, kernel_in_last=kernel_in_last)

  @jax.custom_vjp
  def f(x, t, c):
    return logits(x, t)

  def fwd(x, t, c):
    return logits(x, t), (x, t)

  def bwd(res, dy):
    x, t = res
    dx = jax.vjp(lambda x: logits(x, t), x)[1](dy)[0]
    return dx, None, scatter_sum.head_partials(plan, x, dy)

  f.defvjp(fwd, bwd)
  return f(x, table, partials)


def remat(fn: Callable, cfg: ModelConfig) -> Callable:
  """`fn` under the configured rematerialization policy (identity for 'none')."""
  if cfg.remat_policy == 'none':
    return fn
  return jax.checkpoint(fn, policy=REMAT_POLICIES[cfg.remat_policy])


class LayerGroup(nn.Module):
  """`layer_period` consecutive blocks: the unit that `nn.scan` repeats."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: Optional[jax.Array] = None,
               cache: Optional[dict] = None):
    """(x, None), or with a KV cache {'block_i': ...} (x, the updated cache):
    (carry, per-step output) as nn.scan expects."""
    new = {}
    for i in range(self.cfg.layer_period):
      block = Block(self.cfg, self.cfg.layer_window(i), name=f'block_{i}')
      if cache is None:
        x = block(x, positions, segment_ids)
      else:
        x, new[f'block_{i}'] = block(x, positions, segment_ids, cache[f'block_{i}'])
    return x, (new if cache is not None else None)


def _scanned(group, cfg: ModelConfig, in_axes: tuple) -> nn.Module:
  """The layer groups stacked with nn.scan: params carry a leading `layers`
  axis; `in_axes` says which inputs are shared (broadcast) or per group (0)."""
  stack = nn.scan(group, variable_axes={'params': 0}, split_rngs={'params': True}, in_axes=in_axes,
                  length=cfg.n_layers // cfg.layer_period, metadata_params={nn.PARTITION_NAME: 'layers'})
  return stack(cfg, name='layers')


class Transformer(nn.Module):
  """tokens (batch, seq) int -> logits (batch, seq, vocab) fp32."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens: jax.Array, positions: Optional[jax.Array] = None,
               segment_ids: Optional[jax.Array] = None,
               layers_fn: Optional[Callable] = None, cache: Optional[dict] = None,
               last_only: bool = False, part: str = 'all', hidden: Optional[jax.Array] = None):
    """Args:
      tokens: (batch, seq) int token ids.
      positions: (batch, seq) positions for rotary embeddings; default 0..seq-1.
      segment_ids: optional (batch, seq) document ids of packed rows; attention
        then stays within each document.
      layers_fn: `(x, positions, segment_ids) -> x` that runs the layer stack in place of
        the built-in scan (the pipeline schedule passes one); the `layers`
        parameters are then its business and need not be in the variables.
      cache: a KV cache (`mjax.generate.init_cache`): every layer group's
        caches stacked along a leading axis. The call then returns
        (logits, updated cache); positions must be given (see
        `cached_attention` for left padding).
      last_only: logits of the last position only, (batch, 1, vocab): what
        generation samples from, without (batch, seq, vocab) fp32 logits.
      part: 'all'; or one end of the model alone, for a pipeline schedule
        that runs the layer stack and the loss itself (the 1F1B schedule):
        'embed' returns the layer stack's input (batch, seq, embed), and
        'head' the logits of `hidden` (the stack's output; tokens unused).
    """
    c = self.cfg
    dtype, pdtype = dtype_of(c.dtype), dtype_of(c.param_dtype)
    if positions is None and part != 'head':
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    table = self.param('embedding', nn.with_logical_partitioning(
        nn.initializers.normal(c.init_std), ('vocab', 'embed')), (c.vocab_size, c.d_model), pdtype)
    # Look rows up in a table gathered along `embed` (FSDP): GSPMD cannot move
    # a shard from the table's embed dim to the activations' batch dim inside
    # a gather except by replicating everything.
    # Cast on the shard before gathering (half the bytes); the values are the
    # same as casting the looked-up rows. The tied head reads the same
    # gathered table (one gather per step).
    # Wherever devices split the batch, both readers' gradients are summed
    # per batch shard and reduced once (_gathered_twice).
    plan = scatter_sum.plan(tokens.shape, table.shape) if part == 'all' and cache is None else None
    lookup, head_table, partials = _gathered_twice(table, dtype, plan)
    if part == 'head':
      return self._head(hidden, head_table)
    x = embed_lookup(lookup, tokens, plan, partials)                 # (batch, seq, embed)
    if 'fsdp' in getattr(jax.sharding.get_abstract_mesh(), 'manual_axes', ()):
      # Whole along the sequence first: in a region manual over `fsdp`
      # (MeshConfig.fsdp_gather = 'step'), XLA's SPMD partitioner (jax 0.10)
      # aborts on a lookup from a tensor-split vocabulary straight into the
      # sequence-parallel layout.
      x = constrain(x, ('batch', 'seq', 'embed'))
    x = constrain(x, ACT)
    if part == 'embed':
      return x

    group = LayerGroup
    if cache is not None:
      # Generation: no backward pass, so no remat; the caches ride along the
      # layer scan as per-group inputs and outputs.
      x, cache = self._cached_layers(x, positions, cache)
      # Logits accumulated and kept in fp32: sampling compares them, and
      # rounded to bf16 the most likely tokens tie often (top_k 1 then
      # drew among them by seed). Training keeps bf16 logits (the loss's
      # passes read them: 4 GB a step for 1p3b).
      return self._head(x[:, -1:] if last_only else x, head_table, out_dtype=jnp.float32), cache
    if c.remat_policy != 'none':
      # prevent_cse is only needed outside scan (scan already blocks CSE).
      group = nn.remat(group, policy=REMAT_POLICIES[c.remat_policy], prevent_cse=not c.scan_layers)
    n_groups = c.n_layers // c.layer_period
    if layers_fn is not None:
      x = layers_fn(x, positions, segment_ids)
    elif c.scan_layers:
      x, _ = _scanned(group, c, (nn.broadcast, nn.broadcast))(x, positions, segment_ids)
    else:
      for g in range(n_groups):
        x, _ = group(c, name=f'layers_{g}')(x, positions, segment_ids)

    return self._head(x, head_table, plan, partials)

  def _cached_layers(self, x: jax.Array, positions: jax.Array, cache: dict):
    c = self.cfg
    n_groups = c.n_layers // c.layer_period
    if c.scan_layers:
      return _scanned(LayerGroup, c, (nn.broadcast, nn.broadcast, 0))(x, positions, None, cache)
    outs = []
    for g in range(n_groups):
      x, new = LayerGroup(c, name=f'layers_{g}')(x, positions, None, jax.tree.map(lambda a: a[g], cache))
      outs.append(new)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *outs)

  def _head(self, x: jax.Array, head_table: jax.Array, plan: Optional[scatter_sum.Plan] = None,
            partials: Optional[jax.Array] = None, out_dtype=None) -> jax.Array:
    c = self.cfg
    dtype, pdtype = dtype_of(c.dtype), dtype_of(c.param_dtype)
    x = make_norm(c, 'final_norm')(x)
    if c.tie_embeddings:
      # The gathered table of the lookup serves the tied head too: one
      # all-gather of the embedding per step instead of two.
      kernel, in_last = head_table, True
    else:
      head = self.param('lm_head', nn.with_logical_partitioning(
          nn.initializers.normal(c.init_std), ('embed', 'vocab')), (c.d_model, c.vocab_size), pdtype)
      # As the tied table: cast on its shards, gathered along `embed` once,
      # and that copy read by the product and its backward, its gradient
      # summed per batch shard and reduced once. Left to GSPMD, under FSDP x
      # tensor the head was gathered three times a step and its gradient
      # reduce-scattered twice (1p3b, fsdp 4 x tensor 2 with sequence
      # parallelism: 281 MiB gathered where 94 do).
      (kernel, partials), in_last = _gathered_head(head, dtype, plan), False
    if plan is None:
      logits = matmul(x, kernel, kernel_in_last=in_last, out_dtype=out_dtype)
    else:
      logits = _head_to_partials(x, kernel, plan, partials, kernel_in_last=in_last)
    # The softmax / loss run in fp32 whatever the compute dtype.
    return constrain(logits.astype(jnp.float32), ('batch', 'seq', 'vocab'))
