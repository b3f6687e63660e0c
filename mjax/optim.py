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

from typing import Any

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


def scale_by_layerwise_trust_ratio(stacked: Any) -> optax.GradientTransformation:
  """LAMB's trust ratio ||w|| / ||u||, computed per layer.

  optax.scale_by_trust_ratio takes one norm per array. With scanned layers one
  array holds every layer (leading `layers` axis), and a single ratio for all
  of them would not be layer-wise any more; here a stacked array gets one
  ratio per layer.

  Args:
    stacked: a tree like the params giving, per leaf, how many leading axes
      index layers: 0 (or False) for an ordinary array, 1 (or True) for a
      scanned stack, 3 for the pipeline layout (repeat, stage, layer).
  """
  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params):
    if params is None:
      raise ValueError('scale_by_layerwise_trust_ratio needs the params')

    def scale(u, w, is_stacked):
      lead = int(is_stacked)
      axes = tuple(range(lead, w.ndim)) if lead and w.ndim > lead else None
      w_norm = jnp.sqrt(jnp.sum(jnp.square(w.astype(jnp.float32)), axis=axes, keepdims=True))
      u_norm = jnp.sqrt(jnp.sum(jnp.square(u.astype(jnp.float32)), axis=axes, keepdims=True))
      # A zero norm (fresh zero-init bias, zero update) means "no information":
      # fall back to a ratio of 1, as the paper and optax do.
      ratio = jnp.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)
      return (u * ratio).astype(u.dtype)

    return jax.tree.map(scale, updates, params, stacked), state

  return optax.GradientTransformation(init_fn, update_fn)


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
    g_norm = optax.tree.norm(updates)
    factor = max_norm / jnp.maximum(g_norm, max_norm)
    return jax.tree.map(lambda t: t * factor.astype(t.dtype), updates), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def make_optimizer(cfg: OptimConfig, total_steps: int, stacked: Any) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Returns (LAMB transformation, learning-rate schedule).

  Args:
    cfg: optimizer config.
    total_steps: TrainConfig.steps, the default decay horizon.
    stacked: per-leaf count of leading layer axes (see scale_by_layerwise_trust_ratio).
  """
  schedule = learning_rate_schedule(cfg, total_steps)
  parts = []
  if cfg.clip_norm > 0:
    parts.append(clip_by_global_norm(cfg.clip_norm))
  parts += [
      optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
      optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask),
      scale_by_layerwise_trust_ratio(stacked),
      optax.scale_by_learning_rate(schedule),
  ]
  return optax.chain(*parts), schedule
