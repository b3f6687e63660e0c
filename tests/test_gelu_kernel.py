"""The GeLU backward's kernel (mjax/model/gelu_kernel.py): its values in
Pallas's GPU interpreter against autodiff's, where the model takes it, and
the GeLU MLP's gradients through it against those without it.

The interpreter runs the kernel as the GPU would, warpgroup by warpgroup,
with its pipeline, barriers and stores simulated: tiles of 64 keep that to
seconds. Its compile for an H100 is in tests/test_gpu_target.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mjax.model import gelu_kernel as gk
from mjax.model import hopper
from mjax.model import layers

SMALL = gk.Tiles(tile_m=64, tile_n=64, tile_k=64, stages=2, epi_m=64, epi_n=32, band=2)


def _operands(m, n, k, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  dy = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
  wo = (jax.random.normal(ks[1], (n, k), jnp.float32) * 0.1).astype(jnp.bfloat16)
  u = (jax.random.normal(ks[2], (m, n), jnp.float32) * 2).astype(jnp.bfloat16)
  return dy, wo, u


def _ulps(a, b):
  """Largest difference in units of bf16's last place at b's magnitude."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-3) / 2.0 ** -8))


@pytest.mark.parametrize('approximate', [True, False])
def test_gelu_and_its_derivative_are_jax_nn_gelus(approximate):
  u = jnp.linspace(-8.0, 8.0, 4001, dtype=jnp.float32)
  g, grad = gk.gelu_and_grad(u, approximate)
  gelu = functools.partial(jax.nn.gelu, approximate=approximate)
  np.testing.assert_allclose(g, gelu(u), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(grad, jax.vmap(jax.grad(gelu))(u), rtol=1e-5, atol=1e-6)


def test_the_kernel_in_the_gpu_interpreter_gives_autodiffs_values():
  # 4 x 2 output tiles over 3 CTAs (the persistent loop's uneven share), 3
  # steps of K through a 2-stage pipeline, 2 epilogue tiles per
  # warpgroup's row (both store slots in turn).
  dy, wo, u = _operands(256, 512, 192)
  du, g = gk.dgelu_product(dy, wo.T, u, True, tiles=SMALL, interpret=True, grid=3)
  ref_du, ref_g = gk.reference(dy, wo, u, True)
  # Autodiff's own, in fp32 throughout: both are it rounded once to bf16.
  gelu = functools.partial(jax.nn.gelu, approximate=True)
  exact_g, vjp = jax.vjp(gelu, u.astype(jnp.float32))
  exact_du, = vjp(jnp.einsum('te,fe->tf', dy.astype(jnp.float32), wo.astype(jnp.float32)))
  assert du.dtype == g.dtype == jnp.bfloat16 and du.shape == g.shape == u.shape
  assert _ulps(g, exact_g) <= 1 and _ulps(ref_g, exact_g) <= 1
  # du's product sums 192 terms in fp32, in another order than XLA's.
  np.testing.assert_allclose(np.asarray(du, np.float32), exact_du, rtol=2 ** -7, atol=1e-2)
  np.testing.assert_allclose(np.asarray(du, np.float32), np.asarray(ref_du, np.float32), rtol=2 ** -7, atol=1e-2)
  assert float(jnp.abs(du.astype(jnp.float32)).max()) > 1   # not a tile of zeros that passes by tolerance


def test_four_sub_tiles_a_warpgroup_over_two_output_tiles_a_cta():
  """Each du slot used twice a tile and u's barriers once a tile over two
  output tiles a CTA (their phases turning over), with the interpreter's
  race detector on. (The interpreter runs TMA stores synchronously: that a
  slot is not written while its store still reads it rests on the
  kernel's waits, argued where they are, not on this test.)"""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  tiles = gk.Tiles(tile_m=64, tile_n=64, tile_k=64, stages=2, epi_m=32, epi_n=32, band=1)
  dy, wo, u = _operands(128, 256, 128, seed=2)
  du, g = gk.dgelu_product(dy, wo.T, u, True, tiles=tiles, interpret=InterpretGPUParams(detect_races=True), grid=2)
  assert not interpret_pallas_call.get_races().races_found
  ref_du, ref_g = gk.reference(dy, wo, u, True)
  np.testing.assert_allclose(np.asarray(du, np.float32), np.asarray(ref_du, np.float32), rtol=2 ** -7, atol=1e-2)
  assert _ulps(g, ref_g) <= 1


def test_the_kernel_refuses_what_its_tiles_do_not_divide():
  dy, wo, u = _operands(192, 512, 192)
  with pytest.raises(ValueError, match='does not divide tokens 192'):
    gk.dgelu_product(dy, wo.T, u, True, tiles=gk.Tiles(tile_m=128, tile_n=64, tile_k=64))
  with pytest.raises(ValueError, match='do not match'):
    gk.dgelu_product(dy, wo, u, True, tiles=SMALL)
  dy, wo, u = _operands(256, 512, 192)
  with pytest.raises(ValueError, match='the tanh GeLU only'):   # Mosaic GPU lowers no erf
    gk.dgelu_product(dy, wo.T, u, False, tiles=SMALL)


def test_the_kernel_applies_on_one_hopper_gpu_only(monkeypatch):
  dy, wo, u = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((2, 2048, 2048), (8192, 2048), (2, 2048, 8192)))
  for kind, takes in [('NVIDIA H100 80GB HBM3', True), ('NVIDIA H200', True), ('NVIDIA GH200 480GB', True),
                      ('NVIDIA A100-SXM4-80GB', False), ('NVIDIA B200', False), ('', False)]:
    monkeypatch.setattr(hopper, 'one_device_kind', lambda kind=kind: kind)
    assert gk.applies(dy, wo, u) is takes, kind
  assert not gk.applies(dy, wo, u, approximate=False)   # the exact GeLU: autodiff's
  # Tilings the GPU's lowering refuses (the interpreter takes them).
  assert gk.runs_on_a_gpu(gk.DEFAULT_TILES)
  assert not gk.runs_on_a_gpu(gk.Tiles(stages=4))               # 272 KiB of shared memory
  assert not gk.runs_on_a_gpu(gk.Tiles(epi_m=32))               # half a warpgroup's row block
  assert not gk.applies(dy, wo, u, tiles=gk.Tiles(stages=4))
  odd = jax.ShapeDtypeStruct((2, 2000, 8192), jnp.bfloat16)
  assert not gk.applies(jax.ShapeDtypeStruct((2, 2000, 2048), jnp.bfloat16), wo, odd)   # 4,000 tokens
  assert not gk.applies(jax.ShapeDtypeStruct(dy.shape, jnp.float32), wo, u)
  # This machine: CPU devices, so never.
  monkeypatch.undo()
  assert hopper.one_device_kind() == '' and not gk.applies(dy, wo, u)


def test_the_gelu_mlp_trains_the_same_through_the_kernel(monkeypatch):
  """The GeLU MLP's gradients with the kernel (run in the interpreter, as
  if this CPU were an H100) against autodiff's, for every input: the same
  up to bf16 rounding of the GeLU's derivative."""
  ks = jax.random.split(jax.random.key(1), 6)
  x = jax.random.normal(ks[0], (2, 128, 128), jnp.bfloat16)
  wi = (jax.random.normal(ks[1], (128, 512)) * 0.05).astype(jnp.bfloat16)
  bi = (jax.random.normal(ks[2], (512,)) * 0.1).astype(jnp.bfloat16)
  wo = (jax.random.normal(ks[3], (512, 128)) * 0.05).astype(jnp.bfloat16)
  bo = (jax.random.normal(ks[4], (128,)) * 0.1).astype(jnp.bfloat16)
  dy = jax.random.normal(ks[5], (2, 128, 128), jnp.bfloat16)

  def grads(kernel):
    f = lambda *a: layers.gelu_mlp(*a, approximate=True, backward_kernel=kernel)
    return jax.vjp(f, x, wi, bi, wo, bo)[1](dy)

  without = grads(False)
  calls = []
  real = gk.dgelu_product

  def interpreted(dy, wo_t, u, approximate):
    calls.append(dy.shape)
    return real(dy, wo_t, u, approximate, tiles=SMALL, interpret=True, grid=2)
  monkeypatch.setattr(hopper, 'one_device_kind', lambda: 'NVIDIA H100 80GB HBM3')
  monkeypatch.setattr(gk, 'applies', functools.partial(gk.applies, tiles=SMALL))
  monkeypatch.setattr(gk, 'dgelu_product', interpreted)
  with_kernel = grads(True)
  assert calls == [(256, 128)]   # (batch * seq, embed): the kernel ran, once
  for name, a, b in zip(('x', 'wi', 'bi', 'wo', 'bo'), with_kernel, without):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = np.abs(b).max()
    assert scale > 0 and np.abs(a - b).max() <= 0.02 * scale, (name, np.abs(a - b).max(), scale)
