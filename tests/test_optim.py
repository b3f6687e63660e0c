"""Tests of mjax.optim: LAMB against the paper's equations in numpy, the
learning-rate schedule against its closed form, and the weight-decay mask."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mjax.config import OptimConfig
from mjax import optim
from mjax.optim import decay_mask, learning_rate_schedule, make_optimizer

L = 3  # layers of the stacked (scanned) params


def _flatten(tree, prefix=()):
  """Nested dict -> {path tuple: leaf}, the numpy side's view of a param tree."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flatten(v, prefix + (k,)))
    else:
      out[prefix + (k,)] = v
  return out


def _unflatten(flat):
  tree = {}
  for path, v in flat.items():
    node = tree
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = v
  return tree


def _toy_params():
  """A 2-D kernel, a bias and a scale (no decay), a zero-init bias (norm 0:
  trust ratio falls back to 1), and stacked params whose layer slices have
  very different norms (x0.1, x1, x10) so that per-layer and whole-array
  trust ratios disagree."""
  rng = np.random.default_rng(0)
  layer_scale = np.array([0.1, 1.0, 10.0])
  return {
      'dense': {'kernel': rng.standard_normal((4, 3)), 'bias': 0.5 * rng.standard_normal(3)},
      'norm': {'scale': 1.0 + 0.2 * rng.standard_normal(3)},
      'head': {'bias': np.zeros(2)},
      'layers': {
          'kernel': rng.standard_normal((L, 4, 5)) * layer_scale[:, None, None],
          'scale': 1.0 + 0.2 * rng.standard_normal((L, 5)) * layer_scale[:, None],
      },
  }


STACKED = {('layers', 'kernel'), ('layers', 'scale')}


def _toy_grads(params, steps):
  """Per-step gradients. Step 1 has a global norm well above clip_norm = 1,
  step 2 well below it (both branches of clipping), step 3 in between.
  Layer slices get different gradient scales too."""
  rng = np.random.default_rng(1)
  flat = _flatten(params)
  layer_scale = np.array([3.0, 1.0, 0.2])
  out = []
  for target_norm in [5.0, 0.3, 1.5][:steps]:
    g = {}
    for p, w in flat.items():
      g[p] = rng.standard_normal(w.shape)
      if p in STACKED:
        g[p] *= layer_scale.reshape((L,) + (1,) * (w.ndim - 1))
    norm = math.sqrt(sum(float(np.sum(x ** 2)) for x in g.values()))
    out.append({p: x * (target_norm / norm) for p, x in g.items()})
  return out


def lr_closed_form(step, peak, warmup, decay, min_ratio):
  """Linear 0 -> peak over `warmup` steps, cosine peak -> peak * min_ratio at
  `decay`, constant after."""
  end = peak * min_ratio
  if step < warmup:
    return peak * step / warmup
  if step >= decay:
    return end
  frac = (step - warmup) / (decay - warmup)
  return end + (peak - end) * 0.5 * (1.0 + math.cos(math.pi * frac))


def lamb_numpy(params, grads, cfg, total_steps, per_layer=True):
  """LAMB (You et al. 2019, Algorithm 2) with global-norm clipping and
  decoupled weight decay, in float64 numpy.

  The update at the t-th step (t = 1, 2, ...) uses the schedule at step t - 1
  (optax counts the updates applied so far), i.e. the first step uses lr(0).
  per_layer=False computes one trust ratio per whole stacked array instead of
  one per layer slice (the behaviour the library must *not* have).
  """
  w = {p: np.array(v, np.float64) for p, v in _flatten(params).items()}
  m = {p: np.zeros_like(v) for p, v in w.items()}
  v2 = {p: np.zeros_like(v) for p, v in w.items()}
  decay = cfg.decay_steps or total_steps
  history = []
  for t, g in enumerate(grads, start=1):
    gnorm = math.sqrt(sum(float(np.sum(x ** 2)) for x in g.values()))
    if cfg.clip_norm > 0 and gnorm > cfg.clip_norm:
      g = {p: x * (cfg.clip_norm / gnorm) for p, x in g.items()}
    lr = lr_closed_form(t - 1, cfg.learning_rate, cfg.warmup_steps, decay, cfg.min_lr_ratio)
    for p in w:
      m[p] = cfg.b1 * m[p] + (1 - cfg.b1) * g[p]
      v2[p] = cfg.b2 * v2[p] + (1 - cfg.b2) * g[p] ** 2
      mhat = m[p] / (1 - cfg.b1 ** t)
      vhat = v2[p] / (1 - cfg.b2 ** t)
      r = mhat / (np.sqrt(vhat) + cfg.eps)
      if p[-1] not in ('scale', 'bias'):
        r = r + cfg.weight_decay * w[p]
      if per_layer and p in STACKED:
        update = np.stack([_trust(w[p][i], r[i]) * r[i] for i in range(w[p].shape[0])])
      else:
        update = _trust(w[p], r) * r
      w[p] = w[p] - lr * update
    history.append(dict(w))
  return history


def _trust(w, r):
  wn, rn = np.linalg.norm(w), np.linalg.norm(r)
  return wn / rn if wn > 0 and rn > 0 else 1.0


def _run_mjax(params, grads, cfg, total_steps):
  stacked = _unflatten({p: p in STACKED for p in _flatten(params)})
  tx = make_optimizer(cfg, total_steps, stacked).tx
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  state = tx.init(params)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  history = []
  for g in grads:
    g = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), _unflatten(g))
    params, state = step(params, state, g)
    history.append({p: np.asarray(v, np.float64) for p, v in _flatten(params).items()})
  return history


@pytest.mark.parametrize('warmup', [0, 2])
def test_lamb_matches_paper_equations(warmup):
  # warmup 2: lr = 0, peak/2, peak for the three updates (the first is a
  # no-op); warmup 0: the three updates all run on the cosine part.
  cfg = OptimConfig(learning_rate=0.05, warmup_steps=warmup, decay_steps=None, min_lr_ratio=0.1,
                    b1=0.9, b2=0.95, eps=1e-6, weight_decay=0.1, clip_norm=1.0)
  total = 6
  params = _toy_params()
  grads = _toy_grads(params, 3)
  got = _run_mjax(params, grads, cfg, total)
  want = lamb_numpy(params, grads, cfg, total)
  for step, (g, w) in enumerate(zip(got, want), start=1):
    for p in w:
      np.testing.assert_allclose(g[p], w[p], rtol=1e-5, atol=1e-6, err_msg=f'step {step} {p}')
  # Every param moved, the zero-init bias included: its trust ratio must fall
  # back to 1 (a ratio of ||w|| / ||r|| = 0 would freeze it at zero forever).
  start = _flatten(params)
  assert all(not np.allclose(got[-1][p], start[p]) for p in start)


def test_lamb_trust_ratio_is_per_layer_slice():
  cfg = OptimConfig(learning_rate=0.05, warmup_steps=0, decay_steps=10, min_lr_ratio=0.1,
                    weight_decay=0.1, clip_norm=1.0)
  params = _toy_params()
  grads = _toy_grads(params, 1)
  got = _run_mjax(params, grads, cfg, 10)[0]
  per_layer = lamb_numpy(params, grads, cfg, 10, per_layer=True)[0]
  whole = lamb_numpy(params, grads, cfg, 10, per_layer=False)[0]
  start = _flatten(params)
  for p in sorted(STACKED):
    step_got = got[p] - start[p]
    np.testing.assert_allclose(step_got, per_layer[p] - start[p], rtol=1e-4, atol=1e-7, err_msg=str(p))
    # With slices of norm x0.1 / x1 / x10 a single ratio gives a different
    # step; the library's step must be the per-layer one, not this one.
    step_whole = whole[p] - start[p]
    assert not np.allclose(step_got, step_whole, rtol=0.1, atol=0), p
    # Per-layer LAMB: every slice moves by lr * ||w_slice|| (times one, since
    # the trust ratio normalizes the update's norm to the weight's norm).
    lr = cfg.learning_rate  # step 0 of a schedule without warm-up
    for i in range(L):
      np.testing.assert_allclose(np.linalg.norm(step_got[i]), lr * np.linalg.norm(start[p][i]),
                                 rtol=1e-4, err_msg=f'{p} slice {i}')


# ----------------------------------------------------------------------------
# Learning-rate schedule
# ----------------------------------------------------------------------------

@pytest.mark.parametrize('decay_steps,total_steps', [(None, 50), (50, 1000)])
def test_schedule_warmup_then_cosine_then_flat(decay_steps, total_steps):
  cfg = OptimConfig(learning_rate=2.0, warmup_steps=10, decay_steps=decay_steps, min_lr_ratio=0.1)
  sched = learning_rate_schedule(cfg, total_steps)
  lr = lambda s: float(sched(s))
  assert lr(0) == 0.0
  np.testing.assert_allclose(lr(5), 1.0, rtol=1e-6)                  # halfway up the ramp
  np.testing.assert_allclose(lr(10), 2.0, rtol=1e-6)                 # peak at warmup_steps
  # Cosine midpoint (step 30 of 10..50): end + (peak - end) / 2 = 0.2 + 0.9.
  np.testing.assert_allclose(lr(30), 1.1, rtol=1e-6)
  # A quarter of the way down: end + (peak - end) * (1 + cos(pi/4)) / 2.
  np.testing.assert_allclose(lr(20), 0.2 + 1.8 * (1 + math.cos(math.pi / 4)) / 2, rtol=1e-6)
  np.testing.assert_allclose(lr(50), 0.2, rtol=1e-6)                 # peak * min_lr_ratio at decay
  for s in (51, 80, 10_000):
    np.testing.assert_allclose(lr(s), 0.2, rtol=1e-6)                # and stays there
  for s in range(0, 70, 3):
    np.testing.assert_allclose(lr(s), lr_closed_form(s, 2.0, 10, 50, 0.1), rtol=1e-6, atol=1e-7)
  # Monotone: up during warm-up, down during decay.
  vals = [lr(s) for s in range(60)]
  assert all(a <= b for a, b in zip(vals[:10], vals[1:11]))
  assert all(a >= b for a, b in zip(vals[10:50], vals[11:51]))


def test_schedule_without_warmup_starts_at_peak():
  cfg = OptimConfig(learning_rate=1.0, warmup_steps=0, decay_steps=20, min_lr_ratio=0.0)
  sched = learning_rate_schedule(cfg, 100)
  np.testing.assert_allclose(float(sched(0)), 1.0, rtol=1e-6)
  np.testing.assert_allclose(float(sched(10)), 0.5, rtol=1e-6)
  np.testing.assert_allclose(float(sched(20)), 0.0, atol=1e-7)


# ----------------------------------------------------------------------------
# Weight-decay mask
# ----------------------------------------------------------------------------

def test_decay_mask_skips_scales_and_biases():
  params = {
      'embedding': np.zeros((5, 4)),
      'final_norm': {'scale': np.zeros(4), 'bias': np.zeros(4)},
      'layers': {'block_0': {
          'attn': {'query': {'kernel': np.zeros((1, 4, 2, 2)), 'bias': np.zeros((1, 2, 2))}},
          'norm': {'scale': np.zeros((1, 4)), 'bias': np.zeros((1, 4))},
          'mlp': {'wi': {'kernel': np.zeros((1, 4, 8))}},
      }},
  }
  mask = _flatten(decay_mask(params))
  assert mask == {
      ('embedding',): True,
      ('final_norm', 'scale'): False,
      ('final_norm', 'bias'): False,
      ('layers', 'block_0', 'attn', 'query', 'kernel'): True,
      ('layers', 'block_0', 'attn', 'query', 'bias'): False,
      ('layers', 'block_0', 'norm', 'scale'): False,
      ('layers', 'block_0', 'norm', 'bias'): False,
      ('layers', 'block_0', 'mlp', 'wi', 'kernel'): True,
  }



def test_clipping_is_fused_into_the_moments():
  # optax's clip selects between g and a divided copy of g, which XLA keeps
  # in memory for both moments' passes; mjax's clip is a scalar factor that
  # fuses into them. The compiled update must move less memory, by at least
  # one gradient's worth, with the same result.
  params = {'a': jnp.ones((512, 512)), 'b': jnp.full((512, 512), 2.0)}
  grads = jax.tree.map(lambda p: p * 3.0, params)        # global norm well above 1
  one_grad = 4 * 512 * 512
  results, moved = [], []
  for clip in (optim.clip_by_global_norm(1.0), optax.clip_by_global_norm(1.0)):
    tx = optax.chain(clip, optax.scale_by_adam())
    fn = jax.jit(lambda g, s, tx=tx: tx.update(g, s))
    state = tx.init(params)
    cost = fn.lower(grads, state).compile().cost_analysis()
    moved.append((cost[0] if isinstance(cost, list) else cost)['bytes accessed'])
    results.append(fn(grads, state)[0])
  assert moved[0] <= moved[1] - one_grad, moved
  for k in params:
    np.testing.assert_allclose(results[0][k], results[1][k], rtol=1e-6)


@pytest.mark.parametrize('clip_norm', [1.0, 0.0])
def test_step_update_is_the_chain_on_the_mean_gradient(clip_norm):
  # The train step hands LAMB gradient sums and a token count; its update
  # must equal the optax chain on the mean gradient, state included, and its
  # norms the norms of that mean gradient and of the resulting update.
  cfg = OptimConfig(learning_rate=0.05, warmup_steps=1, decay_steps=None, min_lr_ratio=0.1,
                    weight_decay=0.1, clip_norm=clip_norm)
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), _toy_params())
  stacked = _unflatten({p: p in STACKED for p in _flatten(params)})
  lamb = make_optimizer(cfg, 6, stacked)
  ours = theirs = lamb.tx.init(params)
  count = jnp.float32(37.0)
  for step, g in enumerate(_toy_grads(params, 3), start=1):
    sums = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32) * count, _unflatten(g))
    u, ours, norms = jax.jit(lamb.update)(sums, count, ours, params)
    mean = jax.tree.map(lambda s: s / count, sums)
    want, theirs = jax.jit(lamb.tx.update)(mean, theirs, params)
    for a, b in zip(jax.tree.leaves((u, ours)), jax.tree.leaves((want, theirs))):
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7, err_msg=f'step {step}')
    np.testing.assert_allclose(norms['grad_norm'], optax.tree.norm(mean), rtol=1e-5)
    np.testing.assert_allclose(norms['update_norm'], optax.tree.norm(want), rtol=1e-5)
    assert float(norms['update_norm']) > 0 or step == 1       # step 1 runs at lr 0 (warm-up)
    params = optax.apply_updates(params, u)


def test_step_update_moves_less_memory_than_the_plain_form():
  # Written plainly (divide by the count, run the chain, take both norms as
  # metrics) the update writes a divided copy of the gradients and a copy of
  # the updates for their norms where a reduction does not fuse its producer
  # (XLA:CPU). The step's form folds both into scalars: at least two
  # gradients' worth less memory moved, on any backend.
  cfg = OptimConfig(learning_rate=0.05, warmup_steps=0, clip_norm=1.0)
  params = {'a': jnp.ones((512, 512)), 'layers': jnp.full((4, 256, 512), 2.0)}
  stacked = {'a': 0, 'layers': 1}
  lamb = make_optimizer(cfg, 10, stacked)
  state = lamb.tx.init(params)
  sums = jax.tree.map(lambda p: p * 300.0, params)
  count = jnp.float32(100.0)
  one_grad = 4 * sum(p.size for p in jax.tree.leaves(params))

  def step(sums, count, state, params):
    u, state, norms = lamb.update(sums, count, state, params)
    return optax.apply_updates(params, u), state, norms

  def plain(sums, count, state, params):
    mean = jax.tree.map(lambda s: s / count, sums)
    u, state = lamb.tx.update(mean, state, params)
    return optax.apply_updates(params, u), state, {'grad_norm': optax.tree.norm(mean),
                                                  'update_norm': optax.tree.norm(u)}

  moved, results = [], []
  for fn in (step, plain):
    jitted = jax.jit(fn)
    cost = jitted.lower(sums, count, state, params).compile().cost_analysis()
    moved.append((cost[0] if isinstance(cost, list) else cost)['bytes accessed'])
    results.append(jitted(sums, count, state, params))
  assert moved[0] <= moved[1] - 2 * one_grad, (moved, one_grad)
  for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
    np.testing.assert_allclose(a, b, rtol=2e-5)
