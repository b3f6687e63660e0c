"""LAMB (You et al., 2019) as a composition of optax transforms.

MegaScale uses LAMB because its layer-wise trust ratio keeps training stable
at a 4x larger global batch, and a bigger batch means fewer pipeline bubbles.

    g      <- clip_by_global_norm(g)
    m, v   <- Adam moments of g (bias-corrected)
    r      <- m / (sqrt(v) + eps) + wd * w         (decay skipped for norms, biases)
    w      <- w - lr(t) * ||w|| / ||r|| * r        (one trust ratio per layer)

Master weights and both moments are fp32: the step runs on the fp32 params
that the model only casts to bf16 for its matrix products.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mjax.config import OptimConfig

NO_DECAY = ('scale', 'bias')


def learning_rate_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
  """Linear warm-up from 0 to the peak, then cosine decay to peak * min_lr_ratio."""
  decay = cfg.decay_steps or total_steps
  end = cfg.learning_rate * cfg.min_lr_ratio
  if cfg.warmup_steps >= decay:
    # A run shorter than its warm-up (a smoke test) only ever warms up, at the
    # configured slope: it must not reach the peak sooner than a real run would.
    return optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
  return optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps, decay, end)


def decay_mask(params: Any) -> Any:
  """True for weights that get weight decay: everything but norm scales and biases."""
  def keep(path, _):
    return getattr(path[-1], 'key', None) not in NO_DECAY
  return jax.tree_util.tree_map_with_path(keep, params)


def layerwise_trust_ratio(updates: Any, params: Any, stacked: Any) -> tuple[Any, jax.Array]:
  """LAMB's trust ratio ||w|| / ||u||, one per layer: (scaled updates, the sum
  over every layer of the scaled updates' squared norms).

  optax.scale_by_trust_ratio takes one norm per array. With scanned layers one
  array holds every layer (leading `layers` axis), and a single ratio for all
  of them would not be layer-wise any more; here a stacked array gets one
  ratio per layer. The second result is ||ratio * u||^2 from the norms already
  taken, so the update's norm (a metric every step) costs no pass of its own.

  Args:
    updates: the Adam update plus weight decay, one leaf per param.
    params: the weights.
    stacked: a tree like the params giving, per leaf, how many leading axes
      index layers: 0 (or False) for an ordinary array, 1 (or True) for a
      scanned stack, 3 for the pipeline layout (repeat, stage, layer).
  """
  def scale(u, w, is_stacked):
    lead = int(is_stacked)
    axes = tuple(range(lead, w.ndim)) if lead and w.ndim > lead else None
    w_norm = jnp.sqrt(jnp.sum(jnp.square(w.astype(jnp.float32)), axis=axes, keepdims=True))
    u_norm = jnp.sqrt(jnp.sum(jnp.square(u.astype(jnp.float32)), axis=axes, keepdims=True))
    # A zero norm (fresh zero-init bias, zero update) means "no information":
    # fall back to a ratio of 1, as the paper and optax do.
    ratio = jnp.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)
    return (u * ratio).astype(u.dtype), jnp.sum(jnp.square(ratio * u_norm))

  pairs = jax.tree.map(scale, updates, params, stacked)
  is_pair = lambda x: isinstance(x, tuple)
  scaled = jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair)
  sq = sum(jax.tree.leaves(jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair)), jnp.zeros((), jnp.float32))
  return scaled, sq


def scale_by_layerwise_trust_ratio(stacked: Any) -> optax.GradientTransformation:
  """layerwise_trust_ratio as an optax transform (see there for `stacked`)."""
  def update_fn(updates, state, params):
    if params is None:
      raise ValueError('scale_by_layerwise_trust_ratio needs the params')
    return layerwise_trust_ratio(updates, params, stacked)[0], state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def _clip_factor(g_norm: jax.Array, max_norm: float) -> jax.Array:
  return max_norm / jnp.maximum(g_norm, max_norm)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """optax.clip_by_global_norm as one multiply by a scalar factor.

  optax selects between g and g / ||g|| * max_norm per array; XLA then keeps
  the divided copy of every gradient in memory for the moments' two passes.
  A scalar factor min(1, max_norm / ||g||) fuses into the moments' update, so
  the clipped gradients are never written (the form optax itself notes as
  faster). Same result up to one rounding of the factor.
  """
  def update_fn(updates, state, params=None):
    del params
    factor = _clip_factor(optax.tree.norm(updates), max_norm)
    return jax.tree.map(lambda t: t * factor.astype(t.dtype), updates), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def other_clip_layout(opt_state: Any, clip: bool) -> tuple[Any, Callable[[Any], Any]]:
  """`opt_state` (LAMB's chain's state; `clip`: with its clipping stage) as
  the chain of the other clipping setting lays it out, and the conversion
  of a state in that layout back to this one. Clipping holds no state of its
  own, so both hold the same arrays, but its empty entry moves the other
  stages' along: a run that turned clipping on or off read none of its
  checkpoints (OptimConfig.clip_norm)."""
  if clip:
    return tuple(opt_state)[1:], lambda other: (optax.EmptyState(), *other)
  return (optax.EmptyState(), *opt_state), lambda other: tuple(other)[1:]


class Lamb(NamedTuple):
  """LAMB for the train step.

  tx: the optax chain. Its init gives the optimizer state (and so the
    checkpoint's layout); its update is the plain optax form of `update`.
  schedule: the learning rate by step.
  update: (gradient sums, token count > 0, state, params) -> (updates,
    state, {'grad_norm', 'update_norm'}). The same chain, run part by part, so that
    the gradients' mean, its norm, the clip and the update's norm cost no
    pass over the model of their own: the division by the token count and
    the clip are one scalar folded into the moments' update, the gradient
    norm is the sums' norm divided by the count, and the update norm comes
    from the trust ratio's norms. Each of those, written as a pass over the
    gradients or updates, is a full read (and a write of the scaled copy
    where a reduction cannot fuse its producer, as on XLA:CPU).
  """
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  update: Callable[..., tuple[Any, Any, dict]]


def make_optimizer(cfg: OptimConfig, total_steps: int, stacked: Any) -> Lamb:
  """LAMB with its learning-rate schedule.

  Args:
    cfg: optimizer config.
    total_steps: TrainConfig.steps, the default decay horizon.
    stacked: per-leaf count of leading layer axes (see layerwise_trust_ratio).
  """
  schedule = learning_rate_schedule(cfg, total_steps)
  clip = cfg.clip_norm > 0
  adam = optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
  decay = optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask)
  lr = optax.scale_by_learning_rate(schedule)
  parts = ([clip_by_global_norm(cfg.clip_norm)] if clip else []) + [
      adam, decay, scale_by_layerwise_trust_ratio(stacked), lr]
  tx = optax.chain(*parts)

  def update(grad_sums, count, opt_state, params):
    inv = 1.0 / jnp.asarray(count, jnp.float32)   # count > 0: the train step clamps it to at least 1
    g_norm = optax.tree.norm(grad_sums) * inv
    scale = inv * _clip_factor(g_norm, cfg.clip_norm) if clip else inv
    grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grad_sums)
    states = list(opt_state)
    k = int(clip)                      # the clip's state is empty: nothing to carry
    u, states[k] = adam.update(grads, states[k], params)
    u, states[k + 1] = decay.update(u, states[k + 1], params)
    u, sq = layerwise_trust_ratio(u, params, stacked)
    rate = schedule(states[k + 3].count)
    u, states[k + 3] = lr.update(u, states[k + 3], params)
    return u, tuple(states), {'grad_norm': g_norm, 'update_norm': jnp.abs(rate) * jnp.sqrt(sq)}

  return Lamb(tx, schedule, update)
