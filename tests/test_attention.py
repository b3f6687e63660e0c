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
from mjax.model.attention import (causal_mask, fast_attention, query_blocks, reference_attention,
                                  xla_attention)
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


# ---------------------------------------------------------------- xla_attention: blocks and its backward

# (window, heads / kv_heads, segments, query block): blocks of 5-8 queries on 37
# tokens, so most blocks skip keys (causal corner, and window 3 / 9 far back),
# and the last block is shorter than the others.
BLOCK_CASES = [(None, 1, False, 8), (3, 2, True, 5), (None, 4, True, 7), (9, 4, True, 4), (16, 1, False, 16)]


@functools.lru_cache(maxsize=None)
def _blocked_and_reference(dtype):
  """[(outputs and q/k/v gradients of xla_attention, the same of the reference
  by autodiff)] for BLOCK_CASES, from one compiled function."""
  rng = np.random.default_rng(11)
  b, s, d = 2, 37, 8
  seg = jnp.asarray([[1] * 11 + [2] * 16 + [3] * 10, [1] * s], jnp.int32)
  cases = []
  for window, ratio, segments, block in BLOCK_CASES:
    kvh = HEADS // ratio
    q, k, v, do = (jnp.asarray(sc * rng.standard_normal((b, s, n, d)), dtype)
                   for sc, n in ((2.0, HEADS), (2.0, kvh), (1.0, kvh), (1.0, HEADS)))
    cases.append((q, k, v, do))

  def run(cases):
    out = []
    for (window, _, segments, block), (q, k, v, do) in zip(BLOCK_CASES, cases):
      ids = seg if segments else None

      def value_and_grads(fn):
        loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
        return (fn(q, k, v),) + jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

      out.append((value_and_grads(lambda q, k, v: xla_attention(q, k, v, window, ids, block=block)),
                  value_and_grads(lambda q, k, v: reference_attention(q, k, v, window, ids))))
    return out

  return _compile(run, cases)(cases)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('case', range(len(BLOCK_CASES)),
                         ids=[f'w{w}-gqa{r}-seg{int(s)}-block{b}' for w, r, s, b in BLOCK_CASES])
def test_xla_attention_blocks_and_backward_match_the_reference(dtype, case):
  """Output and all three gradients against the reference's autodiff, with
  query blocks that skip keys. fp32: rounding only; bf16: both paths round
  their bf16 products differently (a few 2^-8), a wrong mask, skipped key or
  gradient term is off by O(1) of the largest value."""
  tol = 1e-5 if dtype == 'float32' else 3e-2
  got, want = _blocked_and_reference(dtype)[case]
  for name, g, w in zip(('out', 'dq', 'dk', 'dv'), got, want):
    assert g.dtype == w.dtype == jnp.dtype(dtype), name
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    scale = np.abs(w).max()
    assert np.abs(g - w).max() <= tol * scale, (name, np.abs(g - w).max(), scale)


@pytest.mark.parametrize('seq,window,block', [(37, None, 8), (37, 3, 5), (300, 100, None), (256, None, None),
                                              (2048, None, None), (8192, 1024, None), (100, 1, 7),
                                              (32768, 128, None)])
def test_query_blocks_cover_every_allowed_key(seq, window, block):
  blocks = query_blocks(seq, window, block)
  # The blocks tile the queries in order ...
  assert blocks[0][0] == 0 and blocks[-1][1] == seq
  assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
  # ... and each sees every key any of its queries may attend to.
  allowed = np.asarray(causal_mask(seq, seq, window)) if seq <= 2048 else None
  for q0, q1, k0 in blocks:
    if allowed is not None:
      assert not allowed[q0:q1, :k0].any() and not allowed[q0:q1, q1:].any()
    else:  # the same by the window convention: query q0 sees back to q0 - window + 1
      assert k0 == (0 if window is None else max(0, q0 - window + 1))


def test_query_blocks_skip_the_work_attention_cannot_use():
  # Causal: 8 blocks of seq / 8 compute 9/16 of the (q, k) matrix.
  blocks = query_blocks(2048, None)
  assert [q1 - q0 for q0, q1, _ in blocks] == [256] * 8
  assert sum((q1 - q0) * (q1 - k0) for q0, q1, k0 in blocks) == 2048 * 2048 * 9 // 16
  # Short sequences keep blocks of at least 128 queries (products stay large).
  assert query_blocks(256, None) == ((0, 128, 0), (128, 256, 0))
  assert query_blocks(100, None) == ((0, 100, 0),)
  # A sliding window: blocks of the window, so the work is O(seq x window).
  blocks = query_blocks(8192, 1024)
  assert len(blocks) == 8 and max(q1 - k0 for _, q1, k0 in blocks) < 2 * 1024
  # ... but at most 16 blocks (each is its own ops: compile time).
  blocks = query_blocks(32768, 128)
  assert len(blocks) == 16 and max(q1 - k0 for _, q1, k0 in blocks) < 2048 + 128
  # In the compiled program too: no (seq, seq) array anywhere, forward or backward.
  b, s, h, d = 1, 1024, 2, 8
  q = jnp.zeros((b, s, h, d))
  loss = lambda q, k, v: jnp.sum(xla_attention(q, k, v, 64))
  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q).as_text()
  assert f'{s},{s}' not in hlo and f'{s}x{s}' not in hlo
  ref = jax.jit(jax.grad(lambda q, k, v: jnp.sum(reference_attention(q, k, v, 64)), argnums=(0, 1, 2)))
  assert f'{s}x{s}' in ref.lower(q, q, q).as_text()  # the check can see one: the reference has them


def _key_reductions(fn, q):
  """Reductions in fn's gradient whose operand ends in a full key axis."""
  jaxpr = jax.make_jaxpr(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2)))(q, q, q)
  s = q.shape[1]
  return [e.primitive.name for e in jaxpr.jaxpr.eqns
          if e.primitive.name.startswith('reduce_') and e.invars[0].aval.ndim >= 4
          and e.invars[0].aval.shape[-1] == s and e.params.get('axes') == (e.invars[0].aval.ndim - 1,)]


def test_xla_attention_backward_reduces_nothing_over_the_keys():
  """The forward's max and sum are the only reductions over the keys: the
  softmax's backward takes its per-query sum from the output (over head_dim).
  Autodiff of the reference reduces p * dp over the keys once more, the step
  that ran slowly on XLA:CPU (bench/RESULTS.md)."""
  q = jnp.zeros((1, 16, 2, 8))
  assert sorted(_key_reductions(lambda q, k, v: xla_attention(q, k, v, None), q)) == ['reduce_max', 'reduce_sum']
  # The check sees the reference's third one, so it would see a regression.
  ref = _key_reductions(lambda q, k, v: reference_attention(q, k, v, None), q)
  assert ref.count('reduce_max') == 1 and ref.count('reduce_sum') >= 2
