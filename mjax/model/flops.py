"""Parameter and FLOP counting, from the config alone (no arrays allocated).

FLOPs per trained token (forward + backward = 3x forward; a multiply-add is 2):

  6 * N_matmul                      every weight matrix, LM head included
                                    (q, k, v, out, MLP in/out[/gate], head)
+ 12 * sum_layers(heads * head_dim * keys(layer))
                                    attention scores QK^T and the weighted sum
                                    PV: 2 * 2 * heads * head_dim per key, x3

keys(layer) is the average number of keys a query attends to:
  * mask-aware (what mjax reports as `flops_per_token` and uses for MFU):
    causal attention over s tokens averages (s + 1) / 2 keys; a window w < s
    averages (w (w + 1) / 2 + (s - w) w) / s. Work that the mask throws away
    is not counted, so sliding windows cannot inflate MFU.
  * dense (`flops_per_token_dense_attention`): keys = s for every layer, the
    convention of Megatron-LM's formula 72 l h^2 (1 + s / 6h + V / 12 h l) per
    token, which MegaScale's tables use. For a GeLU MLP with d_ff = 4 d and
    multi-head attention the two formulas are identical term by term.

Embedding lookups, norms, activations, softmax and the optimizer are left out,
as in every MFU definition in common use (PaLM appendix B, Megatron-LM).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from mjax.config import ModelConfig


def average_keys(seq_len: int, window: Optional[int]) -> float:
  """Mean number of keys per query under the causal (windowed) mask."""
  s = seq_len
  if window is None or window >= s:
    return (s + 1) / 2
  w = window
  return (w * (w + 1) / 2 + (s - w) * w) / s


def matmul_params(cfg: ModelConfig) -> dict[str, int]:
  """Weight-matrix parameter counts by role (analytic)."""
  d, hd = cfg.d_model, cfg.dim_per_head
  attn = d * hd * (2 * cfg.n_heads + 2 * cfg.kv_heads)        # q, out + k, v
  mlp = d * cfg.d_ff * (3 if cfg.mlp == 'swiglu' else 2)
  return {'attention': cfg.n_layers * attn, 'mlp': cfg.n_layers * mlp,
          'lm_head': d * cfg.vocab_size}


def flops_per_token(cfg: ModelConfig, seq_len: int, dense_attention: bool = False) -> float:
  """Training FLOPs per token (forward + backward), see the module docstring."""
  n_matmul = sum(matmul_params(cfg).values())

  def layer_attn(layer: int) -> float:
    keys = seq_len if dense_attention else average_keys(seq_len, cfg.layer_window(layer))
    return 12 * cfg.n_heads * cfg.dim_per_head * keys
  # The windows repeat every layer_period layers: one period's sum times the
  # periods (a loop over every layer took half an hour for n_layers = 10**9).
  periods, rest = divmod(cfg.n_layers, cfg.layer_period)
  attn = (periods * sum(layer_attn(layer) for layer in range(cfg.layer_period))
          + sum(layer_attn(periods * cfg.layer_period + layer) for layer in range(rest)))
  return 6 * n_matmul + attn


def abstract_params(cfg: ModelConfig, seq_len: int = 8):
  """Parameter shapes/dtypes with their logical names, via eval_shape."""
  from mjax.model.transformer import Transformer
  tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
  return jax.eval_shape(lambda t: Transformer(cfg).init(jax.random.key(0), t), tokens)['params']


def count_params(cfg: ModelConfig) -> dict[str, int]:
  """Actual parameter counts of the Flax model (eval_shape: nothing allocated)."""
  params = nn.meta.unbox(abstract_params(cfg))
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  total = sum(int(np.prod(x.shape)) for _, x in flat)
  embed = sum(int(np.prod(x.shape)) for p, x in flat
              if getattr(p[-1], 'key', None) in ('embedding',))
  return {'params': total, 'embedding_params': embed, 'non_embedding_params': total - embed}


def report(cfg: ModelConfig, seq_len: int) -> dict:
  """Everything `mjax-flops` prints."""
  counts = count_params(cfg)
  mm = matmul_params(cfg)
  fpt = flops_per_token(cfg, seq_len)
  dense = flops_per_token(cfg, seq_len, dense_attention=True)
  return {
      **counts,
      'matmul_params': sum(mm.values()),
      'matmul_params_by_role': mm,
      'seq_len': seq_len,
      'flops_per_token': fpt,
      'attention_flops_per_token': fpt - 6 * sum(mm.values()),
      'flops_per_token_dense_attention': dense,
      'flops_per_sequence': fpt * seq_len,
  }
