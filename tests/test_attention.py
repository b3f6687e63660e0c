"""Tests of mjax.model.attention: both attention paths against a naive numpy
reference, the window convention, the mask, and the two paths inside the model.

Window convention (attention.py docstring): with window w, query i attends to
keys j with i - w < j <= i; None is full causal attention.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from mjax.config import ModelConfig
from mjax.model.attention import causal_mask, fast_attention, reference_attention
from mjax.model.transformer import Transformer

BATCH = 2
HEADS = 4
HEAD_DIM = 8

WINDOWS = (1, 3, 8, None)
SEQ_LENS = (8, 17, 32)
GQA_RATIOS = (1, 2, 4)  # heads / kv_heads


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


def _compile(fn, *args):
  """jit + compile with LLVM's backend optimizations off.

  The HLO program (what the tests are about) is unchanged, only the machine
  code is less optimized; compiling takes ~4x less time, which matters with
  the 2 CPU cores these tests share.
  """
  return jax.jit(fn).lower(*args).compile({'xla_backend_optimization_level': 0})


def _qkv(seq, ratio, dtype):
  """Random q, k, v. Scaled by 2 so the softmax is far from uniform: a wrong
  mask or a wrong head mapping then moves the output by O(1), not O(1e-3)."""
  rng = np.random.default_rng(1000 * seq + ratio)
  kvh = HEADS // ratio
  q = 2.0 * rng.standard_normal((BATCH, seq, HEADS, HEAD_DIM))
  k = 2.0 * rng.standard_normal((BATCH, seq, kvh, HEAD_DIM))
  v = rng.standard_normal((BATCH, seq, kvh, HEAD_DIM))
  return tuple(jnp.asarray(a, dtype) for a in (q, k, v))


@functools.lru_cache(maxsize=None)
def _outputs(seq, ratio, dtype, windows=WINDOWS):
  """{window: (reference, fast, naive)} for one (seq, ratio, dtype).

  Both jax paths for every window run in one compiled function: on a 2-core
  CPU one compile per shape is much cheaper than op-by-op dispatch per case.
  The naive result uses the same (possibly bf16-rounded) inputs, in float64.
  """
  q, k, v = _qkv(seq, ratio, jnp.dtype(dtype))

  def run(q, k, v):
    return [(reference_attention(q, k, v, w), fast_attention(q, k, v, w)) for w in windows]

  exact_inputs = [np.asarray(a.astype(jnp.float32)) for a in (q, k, v)]
  out = {}
  for w, (ref, fast) in zip(windows, _compile(run, q, k, v)(q, k, v)):
    assert ref.shape == fast.shape == q.shape
    assert ref.dtype == fast.dtype == q.dtype  # "in q's dtype"
    out[w] = (np.asarray(ref, np.float32), np.asarray(fast, np.float32),
              naive_attention(*exact_inputs, w))
  return out


GRID = [(w, s, r) for r in GQA_RATIOS for s in SEQ_LENS for w in WINDOWS]
GRID_IDS = [f'w{w}-s{s}-gqa{r}' for w, s, r in GRID]


@pytest.mark.parametrize('window,seq,ratio', GRID, ids=GRID_IDS)
def test_reference_attention_matches_naive_loops(window, seq, ratio):
  ref, _, naive = _outputs(seq, ratio, 'float32')[window]
  np.testing.assert_allclose(ref, naive, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('window,seq,ratio', GRID, ids=GRID_IDS)
def test_fast_attention_matches_reference_fp32(window, seq, ratio):
  ref, fast, naive = _outputs(seq, ratio, 'float32')[window]
  np.testing.assert_allclose(fast, ref, rtol=1e-5, atol=1e-5)
  # And against the independent loops, so both paths cannot share one mistake.
  np.testing.assert_allclose(fast, naive, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('window,seq,ratio', GRID, ids=GRID_IDS)
def test_fast_attention_matches_reference_bf16(window, seq, ratio):
  ref, fast, naive = _outputs(seq, ratio, 'bfloat16')[window]
  # Tolerance: both paths take the same bf16 inputs and compute logits and the
  # softmax in fp32, but cast the probabilities to bf16 before the PV product
  # and return bf16. One bf16 rounding is a relative 2^-8 ~ 0.4%; the outputs
  # are convex combinations of N(0, 1) values (|out| <~ 3), so a few roundings
  # apart stay well inside 3e-2. A wrong mask or head mapping is off by O(1).
  np.testing.assert_allclose(fast, ref, rtol=3e-2, atol=3e-2)
  # Both also stay near the exact result for these (bf16-rounded) inputs.
  np.testing.assert_allclose(fast, naive, rtol=3e-2, atol=3e-2)
  np.testing.assert_allclose(ref, naive, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize('seq', [8, 17])
def test_window_at_least_seq_len_is_full_causal(seq):
  windows = (None, seq, seq + 1, 4 * seq, seq - 1)
  out = _outputs(seq, 2, 'float32', windows)
  full_ref, full_fast, _ = out[None]
  for w in (seq, seq + 1, 4 * seq):
    ref, fast, _ = out[w]
    np.testing.assert_allclose(ref, full_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(fast, full_fast, rtol=1e-6, atol=1e-6)
  # Sanity: a window one shorter than the sequence really is different (the
  # last query loses its first key), so the equalities above are not vacuous.
  ref, fast, _ = out[seq - 1]
  assert not np.allclose(ref, full_ref, atol=1e-4)
  assert not np.allclose(fast, full_fast, atol=1e-4)


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


def _random_params(model, tokens, scale, seed=0):
  """N(0, scale^2) params with the model's param tree (shapes from
  jax.eval_shape, so no init compile: that alone takes seconds on 2 cores)."""
  abstract = nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens))
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda a: jnp.asarray(scale * rng.standard_normal(a.shape), a.dtype), abstract)


def test_transformer_xla_and_dot_product_give_same_logits():
  # Two layers: layer 0 sliding window (4), layer 1 full causal
  # (full_attention_every=2), GQA 4:2. Params are large (std 0.2) so attention
  # is not near-uniform and a masking difference would show up in the logits.
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                    sliding_window=4, full_attention_every=2, dtype='float32')
  seq = 16
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, seq), 0, cfg.vocab_size)
  xla = Transformer(dataclasses.replace(cfg, attention_impl='xla'))
  dpa = Transformer(dataclasses.replace(cfg, attention_impl='dot_product'))
  params = _random_params(xla, tokens, scale=0.2)
  out_xla = np.asarray(_compile(xla.apply, params, tokens)(params, tokens))
  out_dpa = np.asarray(_compile(dpa.apply, params, tokens)(params, tokens))
  assert out_xla.shape == (2, seq, cfg.vocab_size)
  np.testing.assert_allclose(out_dpa, out_xla, rtol=1e-5, atol=1e-5)
  # The window matters for this model (so the comparison exercises it): a
  # window >= seq (full causal everywhere, same param tree) changes the logits.
  full = Transformer(dataclasses.replace(cfg, attention_impl='xla', sliding_window=seq))
  out_full = np.asarray(_compile(full.apply, params, tokens)(params, tokens))
  assert not np.allclose(out_full, out_xla, atol=1e-4)


def _naive_segmented(q, k, v, window, seg):
  """Loops again, now also refusing keys of another document."""
  b, s, h, d = q.shape
  g = h // k.shape[2]
  out = np.zeros(q.shape, np.float64)
  for bi in range(b):
    for hi in range(h):
      for i in range(s):
        js = [j for j in range(i + 1) if (window is None or j > i - window) and seg[bi, j] == seg[bi, i]]
        sc = np.array([q[bi, i, hi] @ k[bi, j, hi // g] for j in js]) / np.sqrt(d)
        p = np.exp(sc - sc.max())
        p /= p.sum()
        out[bi, i, hi] = sum(pj * v[bi, j, hi // g] for pj, j in zip(p, js))
  return out


@pytest.mark.parametrize('window', [None, 3])
def test_segment_ids_keep_attention_inside_documents(window):
  rng = np.random.default_rng(7)
  b, s, h, kvh, d = 2, 12, 4, 2, 8
  q, k, v = (rng.standard_normal((b, s, n, d)).astype(np.float32) for n in (h, kvh, kvh))
  seg = np.array([[1] * 5 + [2] * 4 + [3] * 3, [1] * 12], np.int32)
  want = _naive_segmented(q, k, v, window, seg)
  ref = reference_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), window, jnp.asarray(seg))
  fast = fast_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), window, segment_ids=jnp.asarray(seg))
  np.testing.assert_allclose(np.asarray(ref), want, atol=1e-5)
  np.testing.assert_allclose(np.asarray(fast), want, atol=1e-5)
