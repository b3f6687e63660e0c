"""mjax.model.loss.cross_entropy against optax's, value and gradient, and
what its written-out backward buys: no scatter, less memory moved."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mjax.model import loss as loss_lib
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


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_the_one_pass_log_sum_exp_matches_the_two_passes(dtype):
  """`logsumexp_and_target`, the accelerators' forward (one reduction, run
  here element by element by XLA:CPU), against the CPU's max-then-sum:
  logits far from 0, rows with masked (-inf) entries and a row with one
  finite entry, ids at the vocabulary's ends. The value and gradient of
  cross_entropy do not depend on which ran."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(1))
  logits = (3.0 * jax.random.normal(k1, (4, 6, 1000)) + 1000.0)
  # Masked entries after the finite ones, and before them (two -inf
  # maxima meet: their combine must not make inf - inf).
  logits = logits.at[1, :3, 500:].set(-jnp.inf).at[1, 3:, :500].set(-jnp.inf).at[2, 0, 1:].set(-jnp.inf)
  logits = logits.astype(dtype)
  targets = jax.random.randint(k2, (4, 6), 0, 500).at[3].set(jnp.array([0, 999, 0, 999, 1, 2]))
  targets = targets.at[2, 0].set(0).at[1, 3:].add(500)
  one = jax.jit(loss_lib.logsumexp_and_target)(logits, targets)
  two = jax.jit(loss_lib._two_passes)(logits, targets)
  # Within an ulp or two of the logits' magnitude (fp32 spacing at 1000: 6e-5).
  np.testing.assert_allclose(one[0], two[0], rtol=0, atol=2.5e-4)
  np.testing.assert_array_equal(one[1], two[1])
  assert float(one[0][2, 0]) == float(logits[2, 0, 0])   # one finite entry: log(1) on top of it
  # The backward from either forward's log-sum-exp: the same gradient.
  g = jnp.ones(targets.shape, jnp.float32)
  from_one = loss_lib._backward((logits, targets, one[0]), g)[0]
  from_two = loss_lib._backward((logits, targets, two[0]), g)[0]
  assert np.isfinite(np.asarray(from_one, np.float32)).all()
  np.testing.assert_allclose(np.asarray(from_one, np.float32), np.asarray(from_two, np.float32), atol=1e-3)


def test_the_accelerator_branch_is_not_in_a_cpu_program():
  """CPU programs keep the two passes (XLA:CPU does not vectorize a
  reduction of three values with its own combiner); no variadic reduce."""
  x, t = jnp.zeros((8, 256)), jnp.zeros((8,), jnp.int32)
  text = jax.jit(cross_entropy).lower(x, t).compile().as_text()
  assert not re.search(r'\(f32\[8\]\{0\}, f32\[8\]\{0\}, f32\[8\]\{0\}\) reduce\(', text)
  one = jax.jit(loss_lib.logsumexp_and_target).lower(x, t).compile().as_text()
  assert re.search(r'\(f32\[8\]\{0\}, f32\[8\]\{0\}, f32\[8\]\{0\}\) reduce\(', one)


def test_the_one_pass_log_sum_exp_with_the_vocabulary_split_over_devices():
  """Under tensor parallelism the head's logits are split over the
  vocabulary. XLA's partitioner reduces each shard and combines the shards'
  (max, sum of exp, target logit) with the reduction's own combiner (on a
  GPU, a gather of those few numbers per row): the same values as on one
  device, for both branches."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ('data', 'tensor'))
  k1, k2 = jax.random.split(jax.random.PRNGKey(2))
  logits = 4.0 * jax.random.normal(k1, (8, 16, 512)) + 50.0
  targets = jax.random.randint(k2, (8, 16), 0, 512)
  split = NamedSharding(mesh, P('data', None, 'tensor'))
  rows = NamedSharding(mesh, P('data', None))
  for fn in (loss_lib.logsumexp_and_target, loss_lib._two_passes):
    whole = jax.jit(fn)(logits, targets)
    sharded = jax.jit(fn, in_shardings=(split, rows))(jax.device_put(logits, split), jax.device_put(targets, rows))
    np.testing.assert_allclose(sharded[0], whole[0], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(sharded[1], whole[1])
  np.testing.assert_allclose(whole[0], jax.jit(loss_lib.logsumexp_and_target)(logits, targets)[0], atol=1e-5)
