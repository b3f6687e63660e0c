"""Collective matmul (MeshConfig.collective_matmul) computes what the plain
products compute.

The ring functions against an einsum (values and gradients) on a data2 x
tensor4 mesh of fake CPU devices; then a model's training steps with the
option on, against the same layout with it off and against one device, with
test_parallel's tolerances; and the config errors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import AxisType, Mesh

from mjax import config as C
from mjax.config import MeshConfig
from mjax.parallel import collective_matmul as cm
from mjax.parallel import logical_rules
from tests.test_parallel import STEPS, assert_matches, make_cfg, train_steps

SP = ['MeshConfig.data = 2', 'MeshConfig.tensor = 4', 'MeshConfig.sequence_parallel = True']
CM = [*SP, 'MeshConfig.collective_matmul = True']


def _mesh(data=2, tensor=4) -> Mesh:
  devices = np.asarray(jax.devices()[:data * tensor]).reshape(data, 1, tensor, 1)
  return Mesh(devices, MeshConfig.AXES, axis_types=(AxisType.Auto,) * 4)


def _rules(on: bool):
  return logical_rules(MeshConfig(data=2, tensor=4, sequence_parallel=True, collective_matmul=on))


def _block(x, wq, wo, on: bool):
  """A column-parallel then a row-parallel projection of a sequence-split
  (batch, seq, embed) activation, as in an attention block; a scalar out."""
  with nn.logical_axis_rules(_rules(on)):
    x = nn.with_logical_constraint(x, ('batch', 'residual_seq', 'embed'))
    if on:
      h = cm.projection(x, wq, 1, ('embed', 'heads', 'kv'))
      assert h is not None, 'the column-parallel product should be a collective matmul'
      y = cm.projection(jnp.tanh(h), wo, 2, ('heads', 'kv', 'embed'))
      assert y is not None, 'the row-parallel product should be a collective matmul'
    else:
      y = jnp.einsum('bshd,hde->bse', jnp.tanh(jnp.einsum('bse,ehd->bshd', x, wq)), wo)
    y = nn.with_logical_constraint(y, ('batch', 'residual_seq', 'embed'))
    return jnp.sum(y * jnp.cos(y))


@pytest.fixture(scope='module')
def operands():
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(k1, (4, 32, 16)), jax.random.normal(k2, (16, 8, 6)) / 4,
          jax.random.normal(k3, (8, 6, 16)) / 7)


def test_ring_matches_einsum_values_and_grads(operands):
  with jax.set_mesh(_mesh()):
    results = {on: jax.jit(jax.value_and_grad(lambda *a: _block(*a, on), argnums=(0, 1, 2)))(*operands)
               for on in (False, True)}
  (ref, ref_grads), (got, grads) = results[False], results[True]
  np.testing.assert_allclose(got, ref, rtol=1e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def test_shared_rings_match_einsum_values_and_grads(operands):
  """Several kernels on one all-gather ring (q and an MLP input) and two
  products summed on one reduce-scatter ring, against the einsums."""
  x, wq, wo = operands
  wi = jax.random.normal(jax.random.key(5), (16, 24)) / 4
  wm = jax.random.normal(jax.random.key(6), (24, 16)) / 5

  def f(x, wq, wo, wi, wm, on):
    with nn.logical_axis_rules(_rules(on)):
      x = nn.with_logical_constraint(x, ('batch', 'residual_seq', 'embed'))
      if on:
        h, g = cm.input_projections(x, [wq, wi], 1, [('embed', 'heads', 'kv'), ('embed', 'mlp')])
        y = cm.output_projections([(jnp.tanh(h), wo, 2, ('heads', 'kv', 'embed')),
                                   (jnp.sin(g), wm, 1, ('mlp', 'embed'))])
      else:
        h, g = jnp.einsum('bse,ehd->bshd', x, wq), jnp.einsum('bse,ef->bsf', x, wi)
        y = jnp.einsum('bshd,hde->bse', jnp.tanh(h), wo) + jnp.einsum('bsf,fe->bse', jnp.sin(g), wm)
      y = nn.with_logical_constraint(y, ('batch', 'residual_seq', 'embed'))
      return jnp.sum(y * jnp.cos(y))

  with jax.set_mesh(_mesh()):
    (ref, ref_g), (got, g) = (jax.jit(jax.value_and_grad(lambda *a: f(*a, on), argnums=(0, 1, 2, 3, 4)))(
        x, wq, wo, wi, wm) for on in (False, True))
    text = jax.jit(jax.grad(lambda *a: f(*a, True))).lower(x, wq, wo, wi, wm).compile().as_text()
  np.testing.assert_allclose(got, ref, rtol=1e-5)
  for a, b in zip(g, ref_g):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  # One ring each way, forward and backward: 3 shifts per ring on tensor = 4.
  permutes = sum(line.count(' collective-permute(') for line in text.splitlines())
  assert 0 < permutes <= 4 * 3, permutes


def test_ring_replaces_the_activation_collectives(operands):
  """The forward and backward move activations with collective-permutes
  only: no all-gather or reduce-scatter left (the all-reduces are the
  weight gradients' over `data`)."""
  with jax.set_mesh(_mesh()):
    step = jax.jit(jax.grad(lambda *a: _block(*a, True), argnums=(0, 1, 2)))
    text = step.lower(*operands).compile().as_text()
  assert 'collective-permute' in text
  assert 'all-gather' not in text and 'reduce-scatter' not in text


def test_projection_declines_layouts_it_does_not_cover(operands):
  x, wq, _ = operands
  with jax.set_mesh(_mesh()):
    with nn.logical_axis_rules(_rules(False)):   # option off
      assert cm.projection(x, wq, 1, ('embed', 'heads', 'kv')) is None
    with nn.logical_axis_rules(_rules(True)):
      assert cm.projection(x[:, :1], wq, 1, ('embed', 'heads', 'kv')) is None   # one decoding step
      assert cm.projection(x, wq, 1, ('embed', 'kv', None)) is None             # not tensor-split
  with nn.logical_axis_rules(_rules(True)):
    assert cm.projection(x, wq, 1, ('embed', 'heads', 'kv')) is None             # no mesh


@pytest.fixture(scope='module')
def sp_reference():
  """The same layout with collective matmul off."""
  losses, params, _ = train_steps(make_cfg(*SP), jax.devices())
  return losses, params


def _counting(monkeypatch) -> dict:
  """Counts the ring calls the model traces (a fallback to the plain
  product would pass the equivalence checks without testing anything)."""
  calls = {'all_gather_matmul': 0, 'matmul_reduce_scatter': 0}
  for name in calls:
    fn = getattr(cm, name)

    def wrapped(*a, _fn=fn, _name=name, **k):
      calls[_name] += 1
      return _fn(*a, **k)
    monkeypatch.setattr(cm, name, wrapped)
  return calls


@pytest.mark.parametrize('fuse', ['none', 'inputs', 'all'])
def test_model_with_collective_matmul_matches(sp_reference, fuse, monkeypatch):
  fusion = f'ModelConfig.fuse_projections = "{fuse}"'
  calls = _counting(monkeypatch)
  losses, params, _ = train_steps(make_cfg(*CM, fusion), jax.devices())
  # Per traced block one ring in (q, k, v and the MLP input share it, joined
  # or not) and one out (the two output projections' sum), in every mode.
  assert calls['all_gather_matmul'] > 0
  assert calls['all_gather_matmul'] == calls['matmul_reduce_scatter'], calls
  assert len(losses) == STEPS
  assert_matches(sp_reference, losses, params)
  if fuse == 'inputs':
    one = train_steps(make_cfg('MeshConfig.data = 1', fusion, num_devices=1), jax.devices()[:1])
    assert_matches(one[:2], losses, params)


@pytest.mark.parametrize('binding,needle', [
    (['MeshConfig.data = 2', 'MeshConfig.tensor = 4', 'MeshConfig.collective_matmul = True'],
     'needs MeshConfig.sequence_parallel = True'),
    (['MeshConfig.data = 8', 'MeshConfig.sequence_parallel = True', 'MeshConfig.collective_matmul = True'],
     'needs MeshConfig.tensor > 1'),
    (['MeshConfig.data = 2', 'MeshConfig.tensor = 2', 'MeshConfig.pipeline = 2',
      'MeshConfig.sequence_parallel = True', 'MeshConfig.collective_matmul = True'],
     'pipeline parallelism'),
])
def test_config_errors(binding, needle):
  with pytest.raises(C.ConfigError, match=needle):
    make_cfg(*binding)


def test_the_parallel_blocks_branches_share_their_rings_with_separate_products(monkeypatch):
  # fuse 'none' (the GPU's default) keeps the products apart, yet q, k, v and
  # the MLP input share one ring in and the two output projections one ring
  # out, as with joined products: the same rings per traced block. Each
  # branch had run its own two.
  from mjax import train
  from mjax.parallel import make_mesh

  def rings(fuse):
    calls = _counting(monkeypatch)
    cfg = make_cfg(*CM, f'ModelConfig.fuse_projections = "{fuse}"')
    program = train.make_program(cfg, make_mesh(cfg.mesh))
    with program.context():
      program.step.lower(program.abstract_state(), program.abstract_batch())   # traced, not compiled
    return dict(calls)

  none, joined = rings('none'), rings('inputs')
  assert none['all_gather_matmul'] > 0 and none == joined, (none, joined)
