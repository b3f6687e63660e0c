"""Tests of mjax.model.attention: both attention paths against a naive numpy
reference, the window convention, the mask, and the two paths inside the model.

Window convention (attention.py docstring): with window w, query i attends to
keys j with i - w < j <= i; None is full causal attention.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mjax.config import ModelConfig
from mjax.model.attention import causal_mask, fast_attention, reference_attention
from mjax.model.transformer import Transformer

# jit with the window static: one small compile per (shape, window) instead of
# eager op-by-op dispatch, which is several times slower on a 2-core machine.
reference_attention = jax.jit(reference_attention, static_argnums=3)
fast_attention = jax.jit(fast_attention, static_argnums=3)

BATCH = 2
HEADS = 4
HEAD_DIM = 8

WINDOWS = [1, 3, 8, None]
SEQ_LENS = [8, 17, 32]
GQA_RATIOS = [1, 2, 4]  # heads / kv_heads


def naive_attention(q, k, v, window):
  """Loops over batch, head and query; softmax over the allowed keys only.

  Written from the window convention, not from mjax's mask: the allowed keys
  of query i are range(max(0, i - w + 1), i + 1). Computed in float64.
  """
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, s, h, d = q.shape
  kvh = k.shape[2]
  group = h // kvh
  out = np.zeros((b, s, h, d))
  for bi in range(b):
    for hi in range(h):
      kv = hi // group  # GQA: consecutive query heads share one kv head
      for i in range(s):
        lo = 0 if window is None else max(0, i - window + 1)
        keys = np.arange(lo, i + 1)
        logits = k[bi, keys, kv] @ q[bi, i, hi] / np.sqrt(d)   # (len(keys),)
        p = np.exp(logits - logits.max())
        out[bi, i, hi] = (p / p.sum()) @ v[bi, keys, kv]
  return out


def _qkv(seq, ratio, seed=0, dtype=np.float32):
  """Random q, k, v. Scaled by 2 so the softmax is far from uniform: a wrong
  mask or a wrong head mapping then moves the output by O(1), not O(1e-3)."""
  rng = np.random.default_rng(seed)
  kvh = HEADS // ratio
  q = 2.0 * rng.standard_normal((BATCH, seq, HEADS, HEAD_DIM))
  k = 2.0 * rng.standard_normal((BATCH, seq, kvh, HEAD_DIM))
  v = rng.standard_normal((BATCH, seq, kvh, HEAD_DIM))
  return tuple(jnp.asarray(a, dtype) for a in (q, k, v))


@pytest.mark.parametrize('window', WINDOWS, ids=lambda w: f'w{w}')
@pytest.mark.parametrize('seq', SEQ_LENS)
@pytest.mark.parametrize('ratio', GQA_RATIOS)
def test_reference_attention_matches_naive_loops(window, seq, ratio):
  q, k, v = _qkv(seq, ratio)
  got = reference_attention(q, k, v, window)
  assert got.shape == q.shape and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), naive_attention(q, k, v, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('window', WINDOWS, ids=lambda w: f'w{w}')
@pytest.mark.parametrize('seq', SEQ_LENS)
@pytest.mark.parametrize('ratio', GQA_RATIOS)
def test_fast_attention_matches_reference_fp32(window, seq, ratio):
  q, k, v = _qkv(seq, ratio, seed=1)
  got = fast_attention(q, k, v, window)
  assert got.shape == q.shape and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(reference_attention(q, k, v, window)),
                             rtol=1e-5, atol=1e-5)
  # And against the independent loops, so both paths cannot share one mistake.
  np.testing.assert_allclose(np.asarray(got), naive_attention(q, k, v, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('window', WINDOWS, ids=lambda w: f'w{w}')
@pytest.mark.parametrize('seq', SEQ_LENS)
@pytest.mark.parametrize('ratio', GQA_RATIOS)
def test_fast_attention_matches_reference_bf16(window, seq, ratio):
  q, k, v = _qkv(seq, ratio, seed=2, dtype=jnp.bfloat16)
  fast = fast_attention(q, k, v, window)
  ref = reference_attention(q, k, v, window)
  assert fast.dtype == ref.dtype == jnp.bfloat16
  # Tolerance: both paths take the same bf16 inputs and compute logits and the
  # softmax in fp32, but cast the probabilities to bf16 before the PV product
  # and return bf16. One bf16 rounding is a relative 2^-8 ~ 0.4%; the outputs
  # are convex combinations of N(0, 1) values (|out| <~ 3), so a few roundings
  # apart stay well inside 3e-2. A wrong mask or head mapping is off by O(1).
  fast32, ref32 = np.asarray(fast, np.float32), np.asarray(ref, np.float32)
  np.testing.assert_allclose(fast32, ref32, rtol=3e-2, atol=3e-2)
  # Both also stay near the exact result for these (bf16-rounded) inputs.
  exact = naive_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), window)
  np.testing.assert_allclose(fast32, exact, rtol=3e-2, atol=3e-2)
  np.testing.assert_allclose(ref32, exact, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize('impl', ['reference', 'fast'])
@pytest.mark.parametrize('seq', [8, 17])
def test_window_at_least_seq_len_is_full_causal(impl, seq):
  fn = reference_attention if impl == 'reference' else fast_attention
  q, k, v = _qkv(seq, 2, seed=3)
  full = np.asarray(fn(q, k, v, None))
  for w in (seq, seq + 1, 4 * seq):
    np.testing.assert_allclose(np.asarray(fn(q, k, v, w)), full, rtol=1e-6, atol=1e-6)
  # Sanity: a window one shorter than the sequence really is different (the
  # last query loses its first key), so the equality above is not vacuous.
  assert not np.allclose(np.asarray(fn(q, k, v, seq - 1)), full, atol=1e-4)


def test_causal_mask_small_case():
  # seq 4, window 2: each query sees itself and the one token before it.
  expected = np.array([[1, 0, 0, 0],
                       [1, 1, 0, 0],
                       [0, 1, 1, 0],
                       [0, 0, 1, 1]], dtype=bool)
  got = causal_mask(4, 4, 2)
  assert got.shape == (4, 4) and got.dtype == jnp.bool_
  np.testing.assert_array_equal(np.asarray(got), expected)
  # window 1: only the diagonal; None: the lower triangle.
  np.testing.assert_array_equal(np.asarray(causal_mask(4, 4, 1)), np.eye(4, dtype=bool))
  np.testing.assert_array_equal(np.asarray(causal_mask(4, 4, None)), np.tril(np.ones((4, 4), bool)))


def test_transformer_xla_and_dot_product_give_same_logits():
  # Two layers: layer 0 sliding window (4), layer 1 full causal
  # (full_attention_every=2), GQA 4:2. init_std is large so attention is not
  # near-uniform and a masking difference would show up in the logits.
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                    sliding_window=4, full_attention_every=2, dtype='float32', init_std=0.2)
  seq = 16
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, seq), 0, cfg.vocab_size)
  xla = Transformer(dataclasses.replace(cfg, attention_impl='xla'))
  dpa = Transformer(dataclasses.replace(cfg, attention_impl='dot_product'))
  params = xla.init(jax.random.PRNGKey(1), tokens)
  out_xla = np.asarray(jax.jit(xla.apply)(params, tokens))
  out_dpa = np.asarray(jax.jit(dpa.apply)(params, tokens))
  assert out_xla.shape == (2, seq, cfg.vocab_size)
  np.testing.assert_allclose(out_dpa, out_xla, rtol=1e-5, atol=1e-5)
  # The window matters for this model (so the comparison exercises it): a
  # window >= seq (full causal everywhere, same param tree) changes the logits.
  full = Transformer(dataclasses.replace(cfg, attention_impl='xla', sliding_window=seq))
  assert not np.allclose(np.asarray(jax.jit(full.apply)(params, tokens)), out_xla, atol=1e-4)
