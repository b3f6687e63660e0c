"""Tests of mjax.model: the blocks against their formulas, norms and rotary
against numpy, parameter metadata and dtypes, causality and remat."""

import contextlib
import dataclasses
import io
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from mjax.config import ModelConfig
from mjax.model.attention import Attention
from mjax.model.layers import Mlp, Norm, rotary
from mjax.model.transformer import Block, Transformer

AXIS_NAMES = {'batch', 'seq', 'embed', 'heads', 'kv_heads', 'kv', 'mlp', 'vocab', 'layers'}

# Small fp32 model: GQA 4:2, two layers, biases on so every param kind exists.
SMALL = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                    use_bias=True, dtype='float32', attention_impl='xla')
SEQ = 16


def _compile(fn, *args):
  """jit + compile with LLVM's backend optimizations off: the HLO program is
  unchanged, compiling takes several times less time on the 2 shared cores."""
  return jax.jit(fn).lower(*args).compile({'xla_backend_optimization_level': 0})


def _random_params(init_fn, *args, seed=0, std=0.2):
  """Random params with the tree of `init_fn(rng, *args)['params']`.

  Shapes come from jax.eval_shape (no init compile). Kernels ~ N(0, std^2);
  norm scales ~ 1 + N(0, 0.3^2) and biases ~ N(0, 0.3^2), away from their
  1 / 0 init so that a norm or bias that is skipped or misapplied shows.
  """
  abstract = nn.meta.unbox(jax.eval_shape(init_fn, jax.random.PRNGKey(0), *args))['params']
  rng = np.random.default_rng(seed)

  def fill(path, a):
    name = path[-1].key
    z = rng.standard_normal(a.shape)
    val = 1.0 + 0.3 * z if name == 'scale' else 0.3 * z if name == 'bias' else std * z
    return jnp.asarray(val, a.dtype)

  return jax.tree_util.tree_map_with_path(fill, abstract)


def _tokens(seq=SEQ, batch=2, seed=0, vocab=SMALL.vocab_size):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, seq)), jnp.int32)


def _x_pos(cfg, seq=SEQ, batch=2):
  x = jnp.asarray(np.random.default_rng(1).standard_normal((batch, seq, cfg.d_model)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
  return x, pos


# ----------------------------------------------------------------------------
# Blocks against their formulas
# ----------------------------------------------------------------------------

def _parts(cfg, window):
  """The block's sub-modules as stand-alone modules (out_std only matters at init)."""
  norm = Norm(kind=cfg.norm, eps=cfg.norm_eps, use_bias=True, dtype=jnp.float32)
  return norm, Attention(cfg, window, 0.02), Mlp(cfg, 0.02)


@pytest.mark.parametrize('window', [4, None], ids=['w4', 'full'])
@pytest.mark.parametrize('fuse,mlp', [('none', 'gelu'), ('inputs', 'gelu'), ('all', 'gelu'), ('all', 'swiglu')])
def test_parallel_block_is_x_plus_attn_ln_plus_mlp_ln(window, fuse, mlp):
  """Whichever projections are joined into one matrix product (GQA, biases,
  SwiGLU's two input projections), the block is the same function of the
  same parameters."""
  cfg = dataclasses.replace(SMALL, block='parallel', fuse_projections=fuse, mlp=mlp)
  x, pos = _x_pos(cfg)
  block = Block(cfg, window)
  params = _random_params(block.init, x, pos)
  assert set(params) == {'norm', 'attn', 'mlp'}
  norm, attn, mlp = _parts(cfg, window)

  def run(params, x, pos):
    got = block.apply({'params': params}, x, pos)
    h = norm.apply({'params': params['norm']}, x)
    a = attn.apply({'params': params['attn']}, h, pos)
    m = mlp.apply({'params': params['mlp']}, h)
    return got, a, m

  got, a, m = (np.asarray(o) for o in _compile(run, params, x, pos)(params, x, pos))
  x = np.asarray(x)
  np.testing.assert_allclose(got, x + a + m, rtol=1e-5, atol=1e-5)
  # Not vacuous: each branch moves the output.
  assert np.abs(a).max() > 1e-2 and np.abs(m).max() > 1e-2


@pytest.mark.parametrize('window', [4, None], ids=['w4', 'full'])
def test_sequential_block_is_two_residual_steps(window):
  cfg = dataclasses.replace(SMALL, block='sequential')
  x, pos = _x_pos(cfg)
  block = Block(cfg, window)
  params = _random_params(block.init, x, pos)
  assert set(params) == {'norm_attn', 'norm_mlp', 'attn', 'mlp'}
  norm, attn, mlp = _parts(cfg, window)

  def run(params, x, pos):
    got = block.apply({'params': params}, x, pos)
    x1 = x + attn.apply({'params': params['attn']}, norm.apply({'params': params['norm_attn']}, x), pos)
    want = x1 + mlp.apply({'params': params['mlp']}, norm.apply({'params': params['norm_mlp']}, x1))
    return got, want

  got, want = _compile(run, params, x, pos)(params, x, pos)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_block_type_switch_changes_the_function():
  # Same weights in both layouts (both norms of the sequential block = the one
  # norm of the parallel block): the only difference left is the wiring.
  par_cfg = dataclasses.replace(SMALL, block='parallel')
  seq_cfg = dataclasses.replace(SMALL, block='sequential')
  x, pos = _x_pos(par_cfg)
  par = _random_params(Block(par_cfg, None).init, x, pos)
  seq = {'attn': par['attn'], 'mlp': par['mlp'], 'norm_attn': par['norm'], 'norm_mlp': par['norm']}

  def run(par, seq, x, pos):
    return (Block(par_cfg, None).apply({'params': par}, x, pos),
            Block(seq_cfg, None).apply({'params': seq}, x, pos))

  y_par, y_seq = _compile(run, par, seq, x, pos)(par, seq, x, pos)
  assert not np.allclose(np.asarray(y_par), np.asarray(y_seq), atol=1e-3)


# ----------------------------------------------------------------------------
# Norms, MLP and rotary against numpy
# ----------------------------------------------------------------------------

def test_layernorm_matches_numpy():
  rng = np.random.default_rng(0)
  x = 3.0 + 2.0 * rng.standard_normal((2, 5, 32))  # offset: mean removal must matter
  scale, bias = 1.0 + 0.3 * rng.standard_normal(32), 0.3 * rng.standard_normal(32)
  eps = 1e-5
  got = Norm(kind='layernorm', eps=eps, dtype=jnp.float32).apply(
      {'params': {'scale': jnp.asarray(scale, jnp.float32), 'bias': jnp.asarray(bias, jnp.float32)}},
      jnp.asarray(x, jnp.float32))
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  want = (x - mean) / np.sqrt(var + eps) * scale + bias
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_rmsnorm_matches_numpy():
  rng = np.random.default_rng(1)
  x = 3.0 + 2.0 * rng.standard_normal((2, 5, 32))
  scale = 1.0 + 0.3 * rng.standard_normal(32)
  norm = Norm(kind='rmsnorm', eps=1e-5, dtype=jnp.float32)
  params = nn.meta.unbox(norm.init(jax.random.PRNGKey(0), jnp.zeros((1, 32))))['params']
  assert set(params) == {'scale'}  # RMSNorm has no bias
  got = norm.apply({'params': {'scale': jnp.asarray(scale, jnp.float32)}}, jnp.asarray(x, jnp.float32))
  want = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5) * scale
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_norm_output_dtype_is_compute_dtype_and_stats_are_fp32():
  # A row with a large offset: in bf16 the mean subtraction would be wrecked,
  # in fp32 the normalized row is still close to the exact one.
  x = jnp.asarray(1000.0 + np.linspace(-1, 1, 64)[None], jnp.float32)
  norm = Norm(kind='layernorm', dtype=jnp.bfloat16)
  y = norm.apply({'params': {'scale': jnp.ones(64), 'bias': jnp.zeros(64)}}, x)
  assert y.dtype == jnp.bfloat16
  ref = np.linspace(-1, 1, 64) / np.std(np.linspace(-1, 1, 64))
  np.testing.assert_allclose(np.asarray(y, np.float32)[0], ref, atol=2e-2)


@pytest.mark.parametrize('kind,use_bias', [('layernorm', True), ('layernorm', False), ('rmsnorm', False)])
def test_norm_backward_is_the_gradient_of_its_formula(kind, use_bias):
  """The norm's written-out backward (kept row statistics, column sums for
  scale and bias) against autodiff of the plain formula, in fp64 numpy's
  stead: fp32 with a large offset, where a wrong centering term shows."""
  rng = np.random.default_rng(2)
  x = jnp.asarray(3.0 + 2.0 * rng.standard_normal((2, 5, 32)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((2, 5, 32)), jnp.float32)
  params = {'scale': jnp.asarray(1.0 + 0.3 * rng.standard_normal(32), jnp.float32)}
  if use_bias:
    params['bias'] = jnp.asarray(0.3 * rng.standard_normal(32), jnp.float32)
  norm = Norm(kind=kind, eps=1e-5, use_bias=use_bias, dtype=jnp.float32)

  def plain(p, x):
    xc = x - jnp.mean(x, -1, keepdims=True) if kind == 'layernorm' else x
    y = xc * jax.lax.rsqrt(jnp.mean(jnp.square(xc), -1, keepdims=True) + 1e-5) * p['scale']
    return y + p['bias'] if use_bias else y

  got_y, got_vjp = jax.vjp(lambda p, x: norm.apply({'params': p}, x), params, x)
  want_y, want_vjp = jax.vjp(plain, params, x)
  np.testing.assert_array_equal(np.asarray(got_y), np.asarray(want_y))   # the forward is the same ops
  for got, want in zip(jax.tree.leaves(got_vjp(dy)), jax.tree.leaves(want_vjp(dy))):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  # bf16 in, out and parameters: each gradient comes back in its primal's
  # dtype, the same values up to bf16's rounding.
  half = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
  bf16 = norm.clone(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  grads = jax.grad(lambda p, x: jnp.sum(bf16.apply({'params': p}, x).astype(jnp.float32) * dy),
                   argnums=(0, 1))(half, x.astype(jnp.bfloat16))
  want = jax.grad(lambda p, x: jnp.sum(plain(p, x) * dy), argnums=(0, 1))(params, x)
  for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    assert got.dtype == jnp.bfloat16
    scale = float(jnp.max(jnp.abs(ref)))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref), atol=0.03 * scale)


def test_gelu_mlp_matches_numpy():
  cfg = dataclasses.replace(SMALL, use_bias=True)
  x, _ = _x_pos(cfg)
  mlp = Mlp(cfg, 0.02)
  p = _random_params(mlp.init, x)
  got = mlp.apply({'params': p}, x)
  xn = np.asarray(x, np.float64)
  u = xn @ np.asarray(p['wi']['kernel']) + np.asarray(p['wi']['bias'])
  h = 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
  want = h @ np.asarray(p['wo']['kernel']) + np.asarray(p['wo']['bias'])
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def _rot(vec, pos, theta=10000.0):
  """rotary() on a single head vector at a single position, as float64 numpy."""
  x = jnp.asarray(vec, jnp.float32)[None, None, None, :]
  return np.asarray(rotary(x, jnp.full((1, 1), pos, jnp.int32), theta), np.float64)[0, 0, 0]


def test_rotary_rotates_half_pairs_by_position_times_frequency():
  d, theta = 16, 10000.0
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 7, 3, d))
  pos = rng.integers(0, 500, (2, 7))
  got = np.asarray(rotary(jnp.asarray(x, jnp.float32), jnp.asarray(pos), theta), np.float64)
  x1, x2 = x[..., : d // 2], x[..., d // 2:]
  g1, g2 = got[..., : d // 2], got[..., d // 2:]
  # Each pair (x1_i, x2_i) keeps its length ...
  np.testing.assert_allclose(g1 ** 2 + g2 ** 2, x1 ** 2 + x2 ** 2, rtol=1e-4, atol=1e-5)
  # ... and is rotated by angle pos * theta^(-2i/d) (RoFormer), counter-clockwise.
  angle = pos[:, :, None, None] * theta ** (-2.0 * np.arange(d // 2) / d)
  np.testing.assert_allclose(g1, x1 * np.cos(angle) - x2 * np.sin(angle), atol=2e-4)
  np.testing.assert_allclose(g2, x2 * np.cos(angle) + x1 * np.sin(angle), atol=2e-4)
  # Position 0 is the identity.
  np.testing.assert_allclose(_rot(x[0, 0, 0], 0), x[0, 0, 0], atol=1e-6)


def test_rotary_dot_product_depends_only_on_relative_position():
  rng = np.random.default_rng(1)
  q, k = rng.standard_normal(16), rng.standard_normal(16)
  dots = {(m, n): _rot(q, m) @ _rot(k, n) for m, n in [(3, 1), (10, 8), (52, 50), (2, 0), (7, 1), (1, 3)]}
  # Same offset m - n = 2: same score (up to fp32 rounding of larger angles).
  for pair in [(10, 8), (52, 50), (2, 0)]:
    np.testing.assert_allclose(dots[pair], dots[(3, 1)], rtol=1e-4, atol=1e-4)
  # Other offsets give other scores (the property is not trivially true).
  assert abs(dots[(7, 1)] - dots[(3, 1)]) > 1e-2
  assert abs(dots[(1, 3)] - dots[(3, 1)]) > 1e-2


# ----------------------------------------------------------------------------
# Parameter metadata and dtypes
# ----------------------------------------------------------------------------

def _boxed(cfg, seq=8):
  return jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(0), _tokens(seq))['params']


def _leaves_with_paths(boxed):
  is_box = lambda x: isinstance(x, nn.Partitioned)
  return jax.tree_util.tree_flatten_with_path(boxed, is_leaf=is_box)[0]


@pytest.mark.parametrize('scan', [True, False], ids=['scan', 'noscan'])
@pytest.mark.parametrize('full_every', [0, 2])
def test_every_param_has_logical_axis_names(scan, full_every):
  cfg = dataclasses.replace(SMALL, scan_layers=scan, full_attention_every=full_every,
                            sliding_window=4 if full_every else None, tie_embeddings=False)
  n_groups = cfg.n_layers // cfg.layer_period
  leaves = _leaves_with_paths(_boxed(cfg))
  assert leaves
  for path, box in leaves:
    where = jax.tree_util.keystr(path)
    assert isinstance(box, nn.Partitioned), f'{where} has no logical axis names'
    names, shape = box.names, box.value.shape
    assert len(names) == len(shape), where
    assert set(names) <= AXIS_NAMES, f'{where}: {names}'
    in_stack = getattr(path[0], 'key', '') == 'layers'
    if scan and in_stack:
      # nn.scan stacks the layer groups on a new leading 'layers' axis.
      assert names[0] == 'layers' and shape[0] == n_groups, f'{where}: {names} {shape}'
      assert 'layers' not in names[1:], where
    else:
      assert 'layers' not in names, f'{where}: {names}'
  # Spot-check the meaning of a few names (the vocabulary alone is not enough).
  by_path = {jax.tree_util.keystr(p): b for p, b in leaves}
  assert by_path["['embedding']"].names == ('vocab', 'embed')
  assert by_path["['lm_head']"].names == ('embed', 'vocab')
  prefix = "['layers']" if scan else "['layers_0']"
  lead = ('layers',) if scan else ()
  assert by_path[prefix + "['block_0']['attn']['query']['kernel']"].names == lead + ('embed', 'heads', 'kv')
  assert by_path[prefix + "['block_0']['attn']['key']['kernel']"].names == lead + ('embed', 'kv_heads', 'kv')
  assert by_path[prefix + "['block_0']['attn']['out']['kernel']"].names == lead + ('heads', 'kv', 'embed')
  assert by_path[prefix + "['block_0']['mlp']['wi']['kernel']"].names == lead + ('embed', 'mlp')
  assert by_path[prefix + "['block_0']['mlp']['wo']['kernel']"].names == lead + ('mlp', 'embed')


@pytest.mark.parametrize('full_every', [0, 2])
def test_scan_and_unrolled_layers_have_the_same_parameter_count(full_every):
  cfg = dataclasses.replace(SMALL, n_layers=4, full_attention_every=full_every,
                            sliding_window=4 if full_every else None)
  count = lambda c: sum(b.value.size for _, b in _leaves_with_paths(_boxed(c)))
  n_scan = count(dataclasses.replace(cfg, scan_layers=True))
  n_loop = count(dataclasses.replace(cfg, scan_layers=False))
  assert n_scan == n_loop
  # And both equal the count from the architecture's formula.
  d, f, h, kvh, hd, v = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.kv_heads, cfg.dim_per_head, cfg.vocab_size
  attn = d * h * hd + 2 * d * kvh * hd + h * hd * d + (h * hd + 2 * kvh * hd + d)  # kernels + biases
  mlp = d * f + f * d + (f + d)
  norm = 2 * d
  assert n_scan == v * d + cfg.n_layers * (attn + mlp + norm) + norm


def test_bf16_compute_keeps_fp32_params_and_fp32_logits():
  cfg = dataclasses.replace(SMALL, dtype='bfloat16', param_dtype='float32')
  tokens = _tokens()
  for _, box in _leaves_with_paths(_boxed(cfg, SEQ)):
    assert box.value.dtype == jnp.float32
  model = Transformer(cfg)
  params = {'params': _random_params(model.init, tokens, std=0.1)}
  logits = _compile(model.apply, params, tokens)(params, tokens)
  assert logits.dtype == jnp.float32 and logits.shape == (2, SEQ, cfg.vocab_size)
  # The bf16 model computes (roughly) the same function as the fp32 one with
  # the same weights: logits here are O(2) and each bf16 rounding is a relative
  # 2^-8, so a few of them through two layers stay well under 0.05 (~0.013
  # measured); a dtype mix-up that loses the signal would be off by O(1).
  fp32 = Transformer(dataclasses.replace(cfg, dtype='float32'))
  ref = _compile(fp32.apply, params, tokens)(params, tokens)
  assert np.all(np.isfinite(np.asarray(logits)))
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=0.05)
  assert not np.array_equal(np.asarray(logits), np.asarray(ref))  # really computed in bf16


# ----------------------------------------------------------------------------
# Causality and receptive field
# ----------------------------------------------------------------------------

def _logits_fn(cfg, seed=0):
  model = Transformer(cfg)
  tokens = _tokens()
  params = {'params': _random_params(model.init, tokens, seed=seed)}
  fn = _compile(model.apply, params, tokens)
  return lambda t: np.asarray(fn(params, t)), tokens


def _change(tokens, t):
  return tokens.at[:, t].set((tokens[:, t] + 1) % SMALL.vocab_size)


@pytest.mark.parametrize('impl', ['xla', 'dot_product'])
def test_model_is_causal(impl):
  cfg = dataclasses.replace(SMALL, attention_impl=impl)
  logits, tokens = _logits_fn(cfg)
  base = logits(tokens)
  for t in (0, 5, SEQ - 1):
    out = logits(_change(tokens, t))
    # Masked keys contribute exactly 0 after the softmax: no change at all.
    np.testing.assert_allclose(out[:, :t], base[:, :t], rtol=0, atol=1e-6)
    # The changed position itself and everything after it do change.
    assert np.all(np.abs(out[:, t:] - base[:, t:]).max(-1) > 1e-4), t


@pytest.mark.parametrize('impl', ['xla', 'dot_product'])
@pytest.mark.parametrize('window', [1, 4])
def test_sliding_window_receptive_field_of_one_layer(impl, window):
  # One layer, window w: query i sees tokens i - w + 1 .. i, so token t reaches
  # positions t .. t + w - 1 and nothing beyond.
  cfg = dataclasses.replace(SMALL, n_layers=1, sliding_window=window, attention_impl=impl)
  logits, tokens = _logits_fn(cfg)
  base = logits(tokens)
  t = 5
  out = logits(_change(tokens, t))
  diff = np.abs(out - base).max(-1)  # (batch, seq)
  assert np.all(diff[:, :t] <= 1e-6), 'future token leaked into the past'
  assert np.all(diff[:, t + window:] <= 1e-6), f'window {window} reaches beyond t + w - 1'
  assert np.all(diff[:, t + window - 1] > 1e-4), f'window {window} does not reach t + w - 1'
  assert np.all(diff[:, t:t + window] > 1e-4)


# ----------------------------------------------------------------------------
# Remat
# ----------------------------------------------------------------------------

@pytest.mark.parametrize('scan,policies', [
    (True, ('none', 'full', 'dots', 'dots_attention_mlp', 'dots_no_batch')),
    # Unrolled layers take the prevent_cse=True branch of nn.remat; one policy
    # is enough to cover it (each policy is a ~2 s compile here).
    (False, ('none', 'full')),
], ids=['scan', 'noscan'])
def test_remat_policies_give_the_same_loss_and_gradients(scan, policies):
  # Rematerialization only changes what the backward pass stores; the loss and
  # gradients must be the same function of the params for every policy.
  tokens = _tokens()
  base_cfg = dataclasses.replace(SMALL, scan_layers=scan, sliding_window=4, full_attention_every=2)
  params = _random_params(Transformer(base_cfg).init, tokens, std=0.1)

  results = {}
  for policy in policies:
    model = Transformer(dataclasses.replace(base_cfg, remat_policy=policy))
    loss_fn = lambda p, t, m=model: jnp.mean(jnp.square(m.apply({'params': p}, t)))
    grad_fn = jax.value_and_grad(loss_fn)
    results[policy] = _compile(grad_fn, params, tokens)(params, tokens)

  loss0, grads0 = results['none']
  flat0 = jax.tree.leaves(grads0)
  # Every parameter gets a gradient (the comparison below is not vacuous).
  assert all(np.abs(np.asarray(g)).max() > 0 for g in flat0)
  for policy, (loss, grads) in results.items():
    np.testing.assert_allclose(float(loss), float(loss0), rtol=1e-6, err_msg=policy)
    assert jax.tree.structure(grads) == jax.tree.structure(grads0)
    for g, g0 in zip(jax.tree.leaves(grads), flat0):
      np.testing.assert_allclose(np.asarray(g), np.asarray(g0), rtol=1e-5, atol=1e-7, err_msg=policy)


def _saved_residual_shapes(model, params, tokens) -> list[str]:
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(
        lambda p: jnp.mean(jnp.square(model.apply({'params': p}, tokens))), params)
  return sorted(line.split()[0] for line in out.getvalue().splitlines() if line.strip())


def test_dots_attention_mlp_keeps_the_mlp_activation_for_the_backward():
  # One residual more than dots_attention: the scanned layers' MLP
  # activations, (layers, batch, seq, d_ff), which the backward then reads
  # instead of recomputing the GeLU.
  tokens = _tokens()
  cfg = dataclasses.replace(SMALL, scan_layers=True)
  params = _random_params(Transformer(cfg).init, tokens, std=0.1)
  kept = {p: _saved_residual_shapes(Transformer(dataclasses.replace(cfg, remat_policy=p)), params, tokens)
          for p in ('dots_attention', 'dots_attention_mlp')}
  extra = list(kept['dots_attention_mlp'])
  for shape in kept['dots_attention']:
    extra.remove(shape)
  batch, seq = tokens.shape
  assert extra == [f'f32[{cfg.n_layers},{batch},{seq},{cfg.d_ff}]'], kept


def test_remat_keeps_q_and_k_rotated_and_rotates_nothing_again(monkeypatch):
  """With separate projections the dots policies keep q and k after rotary
  instead of the projections' outputs (which the backward then has no use
  for): as many bytes (the norms' statistics aside), and nothing for the
  backward to rotate again. The joined product keeps its output, q and k in
  it, so there nothing is named."""
  from mjax.model import transformer
  tokens = _tokens()
  cfg = dataclasses.replace(SMALL, scan_layers=False, fuse_projections='none', remat_policy='dots_attention')
  params = _random_params(Transformer(cfg).init, tokens, std=0.1)

  def loss(c):
    model = Transformer(c)
    return lambda p: jnp.mean(jnp.square(model.apply({'params': p}, tokens)))

  def kept(c):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      jax.ad_checkpoint.print_saved_residuals(loss(c), params)
    return [line for line in out.getvalue().splitlines() if 'from the argument' not in line and line.strip()]

  def nbytes(lines):
    return sum(math.prod(int(d) for d in line.split()[0][4:-1].split(',') if d) * 4 for line in lines)

  now = kept(cfg)
  assert sum("named 'rotated_qk'" in line for line in now) == 2 * cfg.n_layers, now
  stats = [line for line in now if "named 'norm_stats'" in line]
  assert len(stats) == 2 * (cfg.n_layers + 1), now   # mean and 1/std of each layer's norm and the final one
  # The same policy without the names: the projections' q and k are kept and rotated again.
  monkeypatch.setitem(transformer.REMAT_POLICIES, 'dots_attention', transformer._dots_and_flash_attention)
  before = kept(cfg)
  assert not any('rotated_qk' in line for line in before)
  before_stats = [line for line in before if "named 'norm_stats'" in line]
  assert len(before_stats) == 2   # the final norm's, outside the remat'ed layers
  assert nbytes(now) - nbytes(stats) == nbytes(before) - nbytes(before_stats)
  monkeypatch.undo()
  joined = kept(dataclasses.replace(cfg, fuse_projections='inputs'))
  assert not any('rotated_qk' in line for line in joined)


@pytest.mark.parametrize('policy,recomputed', [('dots_attention', False), ('dots_no_batch', False),
                                               ('full', True)])
def test_remat_keeps_the_norm_statistics_and_reduces_no_row_again(policy, recomputed):
  """The dots policies keep the norms' mean and 1/std: the backward's
  recomputation of the norm output (the projections' weight gradients read
  it) is then elementwise, with no row reduction; the compiled gradient has
  as many rsqrt as the forward alone. 'full' keeps nothing and computes them
  again, which the count sees."""
  import re
  tokens = _tokens()
  model = Transformer(dataclasses.replace(SMALL, scan_layers=True, remat_policy=policy))
  params = _random_params(model.init, tokens, std=0.1)
  loss = lambda p: jnp.mean(jnp.square(model.apply({'params': p}, tokens)))
  rsqrts = lambda f: len(re.findall(r' rsqrt\(', _compile(f, params).as_text()))
  forward, grad = rsqrts(loss), rsqrts(jax.grad(loss))
  assert forward > 0 and (grad > forward) == recomputed, (forward, grad)


@pytest.mark.parametrize('policy,dtype', [('none', 'float32'), ('dots_attention', 'float32'),
                                          ('dots_attention_mlp', 'float32'), ('full', 'float32'),
                                          ('dots_attention', 'bfloat16')])
def test_the_gelu_epilogue_unit_is_the_same_model(policy, dtype):
  """ModelConfig.gelu_epilogue (the GeLU MLP as one unit with a written-out
  backward, layers.gelu_mlp): the same loss and gradients as autodiff of the
  plain MLP, under every policy, with biases; in bf16 too, where the cast
  kernels are kept."""
  tokens = _tokens()
  cfg = dataclasses.replace(SMALL, scan_layers=True, fuse_projections='none', remat_policy=policy, dtype=dtype)
  params = _random_params(Transformer(cfg).init, tokens, std=0.1)
  out = {}
  for fused in (False, True):
    model = Transformer(dataclasses.replace(cfg, gelu_epilogue=fused))
    loss_fn = lambda p, t, m=model: jnp.mean(jnp.square(m.apply({'params': p}, t)))
    out[fused] = _compile(jax.value_and_grad(loss_fn), params, tokens)(params, tokens)
  tol = 1e-5 if dtype == 'float32' else 1e-2   # bf16: one rounding either way
  np.testing.assert_allclose(float(out[True][0]), float(out[False][0]), rtol=tol / 10)
  for g, g0 in zip(jax.tree.leaves(out[True][1]), jax.tree.leaves(out[False][1])):
    g, g0 = np.asarray(g, np.float32), np.asarray(g0, np.float32)
    assert np.abs(g0).max() > 0
    np.testing.assert_allclose(g, g0, rtol=tol, atol=max(1e-7, tol * float(np.abs(g0).max())))


@pytest.mark.parametrize('policy,activation', [('dots_attention', False), ('dots_attention_mlp', True)])
def test_the_gelu_epilogue_unit_keeps_its_product_under_a_name_of_its_own(policy, activation):
  """What lets XLA fuse the GeLU into the product: the backward keeps the
  input product under the name 'mlp_product', not the value the forward's
  GeLU reads (autodiff keeps that one, and remat's reduce-precision on it
  stands between the product and the GeLU). dots_attention_mlp also keeps
  the activation, and nothing else changes."""
  tokens = _tokens()
  cfg = dataclasses.replace(SMALL, scan_layers=False, fuse_projections='none', remat_policy=policy)
  params = _random_params(Transformer(cfg).init, tokens, std=0.1)

  def kept(fused):
    model = Transformer(dataclasses.replace(cfg, gelu_epilogue=fused))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      jax.ad_checkpoint.print_saved_residuals(
          lambda p: jnp.mean(jnp.square(model.apply({'params': p}, tokens))), params)
    return [line for line in out.getvalue().splitlines() if line.strip()]

  mlp_shape = f'f32[{tokens.shape[0] * tokens.shape[1]},{cfg.d_ff}]'   # the 2-D product
  act_shape = f'f32[{tokens.shape[0]},{tokens.shape[1]},{cfg.d_ff}]'
  plain, fused = kept(False), kept(True)
  assert sum("named 'mlp_product'" in line for line in fused) == cfg.n_layers, fused
  assert not any('mlp_product' in line for line in plain)
  unnamed_products = lambda lines: [l for l in lines if l.split()[0] in (mlp_shape, act_shape)
                                    and 'output of dot_general' in l]
  assert len(unnamed_products(plain)) == cfg.n_layers and unnamed_products(fused) == [], (plain, fused)
  activations = lambda lines: sum("named 'mlp_activation'" in line for line in lines)
  assert activations(fused) == activations(plain) == (cfg.n_layers if activation else 0), (plain, fused)
  # As many values kept (parameters, which are kept anyway, aside).
  computed = lambda lines: [line for line in lines if 'from the argument' not in line]
  assert len(computed(fused)) == len(computed(plain)), (plain, fused)


def test_embedding_gradient_sums_in_fp32_from_a_bf16_table():
  # Three tokens fill 8k positions: each row's gradient is a sum of ~2.7k
  # cotangents. Summed in fp32 and rounded once it stays within bf16's one
  # rounding; a bf16 scatter-add (rounding after every row) is off by ~6%.
  from mjax.model.layers import embed_lookup
  table = jax.random.normal(jax.random.key(0), (300, 64), jnp.float32)
  tok = jax.random.randint(jax.random.key(1), (4, 2048), 0, 3)
  ct = jax.random.normal(jax.random.key(2), (4, 2048, 64), jnp.bfloat16).astype(jnp.float32)
  ref = jax.grad(lambda t: jnp.sum(jnp.take(t, tok, axis=0) * ct))(table)
  got = jax.grad(lambda t: jnp.sum(embed_lookup(t.astype(jnp.bfloat16), tok).astype(jnp.float32) * ct))(table)
  assert got.dtype == jnp.float32
  assert float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)) < 5e-3
  # The forward is a plain lookup.
  np.testing.assert_array_equal(np.asarray(embed_lookup(table, tok)), np.asarray(table)[np.asarray(tok)])


def test_tied_table_gradients_of_lookup_and_head_meet_in_fp32():
  from mjax.model.transformer import _gathered_twice
  table = jax.random.normal(jax.random.key(0), (64, 32), jnp.float32)
  ca = jax.random.normal(jax.random.key(1), (64, 32), jnp.float32) * 1e3
  cb = jax.random.normal(jax.random.key(2), (64, 32), jnp.float32) * 1e-1

  def loss(t):
    a, b, _ = _gathered_twice(t, jnp.bfloat16)
    return jnp.sum(a.astype(jnp.float32) * ca) + jnp.sum(b.astype(jnp.float32) * cb)
  got = jax.grad(loss)(table)
  # Each cotangent rounded to bf16 once (the compute dtype), then an fp32 sum:
  # the small one survives next to the large one.
  want = ca.astype(jnp.bfloat16).astype(jnp.float32) + cb.astype(jnp.bfloat16).astype(jnp.float32)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  a, b, _ = _gathered_twice(table, jnp.bfloat16)
  assert a.dtype == b.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(a), np.asarray(table.astype(jnp.bfloat16)))


def _primitives(jaxpr):
  """Every primitive in a jaxpr, sub-jaxprs (pjit, remat, custom rules) included."""
  for eqn in jaxpr.eqns:
    yield eqn.primitive.name
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _primitives(sub)


@pytest.mark.parametrize('fuse', ['inputs', 'all'])
def test_joined_inputs_backward_joins_cotangents_without_padding(fuse):
  """The joined product's output is split into q, k, v and the MLP input.
  Its backward must join their cotangents with one concatenate: slices
  transpose to a zero-padded copy of the whole joined width per projection
  plus their sum, which XLA keeps (13% of a small model's CPU step)."""
  cfg = dataclasses.replace(SMALL, block='parallel', fuse_projections=fuse)
  x, pos = _x_pos(cfg)
  block = Block(cfg, 4)
  params = _random_params(block.init, x, pos)
  loss = lambda p, x: jnp.sum(block.apply({'params': p}, x, pos) ** 2)
  prims = list(_primitives(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x).jaxpr))
  assert 'pad' not in prims
  assert 'split' in prims and 'concatenate' in prims


@pytest.mark.parametrize('fuse,dots', [('none', 6), ('inputs', 3), ('all', 2)])
def test_joined_projections_are_one_product_under_tensor_parallelism(fuse, dots):
  """The joins happen on a tensor-parallel mesh too (kernels joined shard by
  shard), not only on one device: count the projections' matrix products."""
  from mjax.config import MeshConfig
  from mjax.parallel import make_mesh
  from mjax.parallel.rules import logical_rules
  cfg = dataclasses.replace(SMALL, fuse_projections=fuse)
  mesh_cfg = MeshConfig(data=2, tensor=2, sequence_parallel=True)
  x, pos = _x_pos(cfg)
  block = Block(cfg, 4)
  params = _random_params(block.init, x, pos)
  with jax.set_mesh(make_mesh(mesh_cfg, devices=jax.devices()[:4])), nn.logical_axis_rules(logical_rules(mesh_cfg)):
    jaxpr = jax.make_jaxpr(lambda p: block.apply({'params': p}, x, pos))(params)
  n = sum(e.primitive.name == 'dot_general' for e in jaxpr.jaxpr.eqns)
  assert n == dots + 2  # + the reference attention's two einsums


def _both_transposed_dots(hlo: str) -> list[str]:
  """Plain dots of 2-D operands that contract the leading dim of the lhs and
  the trailing dim of the rhs: both operands transposed."""
  return [line.strip()[:160] for line in hlo.splitlines()
          if ' dot(' in line and 'lhs_contracting_dims={0}' in line and 'rhs_contracting_dims={1}' in line
          and 'batch_dims' not in line]


def test_weight_gradients_are_plain_2d_products():
  # With (batch, seq) both contracted, XLA:CPU computed the head's and the
  # MLP output's weight gradients with both operands transposed (and a
  # transposed copy of the logits' gradient first), at a quarter of a plain
  # product's speed. As 2-D products (layers.matmul) they are plain.
  cfg = dataclasses.replace(SMALL, tie_embeddings=False, n_kv_heads=None, use_bias=False, d_model=64,
                            d_ff=128, vocab_size=256)
  model = Transformer(cfg)
  tokens = _tokens(seq=32, batch=4, vocab=cfg.vocab_size)
  params = _random_params(model.init, tokens)
  cotangent = jnp.asarray(np.random.default_rng(2).standard_normal((4, 32, cfg.vocab_size)), jnp.float32)
  loss = lambda p: jnp.sum(model.apply({'params': p}, tokens) * cotangent)
  hlo = _compile(jax.grad(loss), params).as_text()
  assert not _both_transposed_dots(hlo), _both_transposed_dots(hlo)
