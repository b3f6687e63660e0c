"""mjax.model.loss.cross_entropy against optax's, value and gradient, and
what its written-out backward buys: no scatter, less memory moved."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mjax.model.loss import cross_entropy


def _loss(ce, logits, targets, mask):
  return jnp.sum(ce(logits.astype(jnp.float32), targets) * mask)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_value_and_gradient_match_optax(dtype):
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  logits = (4.0 * jax.random.normal(k1, (3, 5, 97))).astype(dtype)
  targets = jax.random.randint(k2, (3, 5), 0, 97)
  mask = jnp.ones((3, 5)).at[1, 2:].set(0.0)     # masked tokens get no gradient
  ours = jax.value_and_grad(lambda x: _loss(cross_entropy, x, targets, mask))(logits)
  ref = jax.value_and_grad(lambda x: _loss(optax.softmax_cross_entropy_with_integer_labels, x,
                                           targets, mask))(logits)
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(ours[0], ref[0], rtol=tol)
  assert ours[1].dtype == dtype
  np.testing.assert_allclose(np.asarray(ours[1], np.float32), np.asarray(ref[1], np.float32),
                             rtol=tol, atol=tol)
  assert not np.any(np.asarray(ours[1], np.float32)[1, 2:])
  # Per-token values, and the target's logit from the masked pick, also
  # exact for the vocabulary's first and last ids.
  edge = jnp.array([[0, 96, 5, 0, 96]] * 3)
  np.testing.assert_allclose(cross_entropy(logits.astype(jnp.float32), edge),
                             optax.softmax_cross_entropy_with_integer_labels(
                                 logits.astype(jnp.float32), edge), rtol=1e-6)


def test_backward_is_one_pass_without_a_scatter():
  # optax's gather differentiates into a scatter-add over a zero-filled
  # logits-sized buffer and a pass to add it; the written-out backward has
  # neither. The compiled value-and-gradient must hold no scatter and move
  # less memory than optax's, by at least one logits-sized buffer.
  logits = jnp.zeros((256, 4096))
  targets = jnp.zeros((256,), jnp.int32)
  mask = jnp.ones((256,))
  moved = {}
  for name, ce in [('mjax', cross_entropy), ('optax', optax.softmax_cross_entropy_with_integer_labels)]:
    compiled = jax.jit(jax.value_and_grad(lambda x, ce=ce: _loss(ce, x, targets, mask))).lower(logits).compile()
    cost = compiled.cost_analysis()
    moved[name] = (cost[0] if isinstance(cost, list) else cost)['bytes accessed']
    if name == 'mjax':
      assert not re.search(r' scatter\(', compiled.as_text())
  assert moved['mjax'] <= moved['optax'] - logits.size * 4, moved
