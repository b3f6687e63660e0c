"""The rotary kernel (mjax/model/rotary_kernel.py): its values in Pallas's GPU
interpreter against XLA's product and rotary, where the model takes it, and
the gradients of q's and k's projections through it against those without it.

The interpreter runs the kernel as the GPU would, warpgroup by warpgroup,
with its pipeline, barriers and stores simulated: tiles of 64 keep that to
seconds. Its compile for an H100 is in tests/test_gpu_target.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mjax import config as config_lib
from mjax.model import hopper, layers
from mjax.model import rotary_kernel as rk

THETA = 10000.0
SMALL = rk.Tiles(tile_m=64, tile_n=64, tile_k=64, stages=2, epi_m=64, epi_n=16, band=2)


def _operands(tokens, embed, heads, head_dim, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(ks[0], (tokens, embed), jnp.bfloat16)
  w = (jax.random.normal(ks[1], (embed, heads * head_dim), jnp.float32) * 0.1).astype(jnp.bfloat16)
  # Positions as packed documents have them: runs that start again from 0.
  starts = jnp.sort(jax.random.randint(ks[2], (3,), 0, tokens))
  idx = jnp.arange(tokens)
  start = jnp.max(jnp.where(idx[:, None] >= starts[None, :], starts[None, :], 0), axis=1)
  return x, w, (idx - start + 1500).astype(jnp.int32)   # large angles, where fp16 tables round most


def _exact(x, w, positions, head_dim):
  """The product and rotation in fp32 throughout (float64 angles)."""
  y = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  y = y.reshape(y.shape[0], -1, head_dim)
  freq = THETA ** (-np.arange(0, head_dim // 2) * 2.0 / head_dim)
  a = np.asarray(positions, np.float64)[:, None, None] * freq
  lo, hi = np.split(y, 2, axis=-1)
  return np.concatenate([lo * np.cos(a) - hi * np.sin(a), hi * np.cos(a) + lo * np.sin(a)], -1).reshape(x.shape[0], -1)


def test_the_kernel_in_the_gpu_interpreter_gives_xlas_values():
  # 4 x 4 output tiles (a head per warpgroup, two a CTA: 3 of q's, 1 of k's) over 3 CTAs (the
  # persistent loop's uneven share), 3 steps of K through a 2-stage
  # pipeline, two table sub-tiles a warpgroup.
  x, w, positions = _operands(256, 192, 8, 64)
  q, k = rk.rotary_product(x, w, rk.tables(positions, 64, THETA), 384, tiles=SMALL, interpret=True, grid=3)
  assert q.dtype == k.dtype == jnp.bfloat16 and q.shape == (256, 384) and k.shape == (256, 128)
  out = jnp.concatenate([q, k], axis=1)   # 6 heads of q, 2 of k (GQA's shapes)
  exact = _exact(x, w, positions, 64)
  ref = np.asarray(rk.reference(x, w, positions, 64, THETA), np.float32)
  got = np.asarray(out, np.float32)
  scale = np.abs(exact).max()
  assert scale > 1   # not a tile of zeros that passes by tolerance
  # Each element rounded once to bf16 (2^-8), after a product summed in
  # another order than XLA's and fp16 angle tables (2^-11): within 2^-7 of
  # its magnitude, or of the tile's scale for the smallest.
  tol = 2 ** -7 * np.maximum(np.abs(exact), 0.05 * scale)
  assert np.all(np.abs(got - exact) <= tol), np.abs(got - exact).max()
  assert np.all(np.abs(ref - exact) <= tol)
  # Each head's pairs rotated, not merely its product: the unrotated product is far off.
  plain = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  assert np.abs(got - plain).max() > 0.5 * scale


def test_two_output_tiles_a_cta_with_the_race_detector():
  """The tables' barriers and slots used once a tile over two output tiles
  a CTA (their phases turning over), with the interpreter's race detector
  on. (The interpreter runs TMA stores synchronously: that the next tile's
  tables do not overwrite a slot whose store still reads it rests on the
  kernel's wait at the start of each tile, as in gelu_kernel.)"""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  tiles = dataclasses.replace(SMALL, epi_m=32, band=1)
  x, w, positions = _operands(128, 128, 4, 64, seed=2)
  q, k = rk.rotary_product(x, w, rk.tables(positions, 64, THETA), 128, tiles=tiles,
                           interpret=InterpretGPUParams(detect_races=True), grid=2)
  assert not interpret_pallas_call.get_races().races_found
  out = jnp.concatenate([q, k], axis=1)
  exact = _exact(x, w, positions, 64)
  np.testing.assert_allclose(np.asarray(out, np.float32), exact, rtol=2 ** -7, atol=2 ** -7 * np.abs(exact).max())


def test_the_kernel_refuses_what_its_tiles_do_not_divide():
  x, w, positions = _operands(192, 128, 4, 64)
  cs = rk.tables(positions, 64, THETA)
  with pytest.raises(ValueError, match='does not divide tokens 192'):
    rk.rotary_product(x, w, cs, 128, tiles=dataclasses.replace(SMALL, tile_m=128))
  with pytest.raises(ValueError, match='do not match'):
    rk.rotary_product(x, w.T, cs, 128, tiles=SMALL)
  with pytest.raises(ValueError, match='do not match'):   # tables of another head_dim
    rk.rotary_product(x, w, rk.tables(positions, 128, THETA), 128, tiles=SMALL)
  x, w, positions = _operands(128, 128, 4, 64)
  with pytest.raises(ValueError, match=r'columns 64 \(q\) and 192 \(k\)'):   # a CTA's two heads: q's and k's
    rk.rotary_product(x, w, rk.tables(positions, 64, THETA), 64, tiles=SMALL)


def test_the_kernel_applies_on_one_hopper_gpu_only(monkeypatch):
  s = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  x, wq, wk = s(2, 2048, 2048), s(2048, 16, 128), s(2048, 16, 128)
  for kind, takes in [('NVIDIA H100 80GB HBM3', True), ('NVIDIA H200', True), ('NVIDIA A100-SXM4-80GB', False),
                      ('NVIDIA B200', False), ('', False)]:
    monkeypatch.setattr(hopper, 'one_device_kind', lambda kind=kind: kind)
    assert rk.applies(x, wq, wk) is takes, kind
  monkeypatch.setattr(hopper, 'one_device_kind', lambda: 'NVIDIA H100 80GB HBM3')
  assert not rk.applies(x, wq, wk, fraction=0.25)            # part of each head: XLA's
  assert rk.applies(x, wq, s(2048, 4, 128))                   # GQA: 4 kv heads, in pairs
  assert not rk.applies(x, wq, s(2048, 3, 128))               # 3 kv heads: one CTA would hold q's and k's
  assert not rk.applies(x, s(2048, 15, 128), s(2048, 1, 128))
  assert rk.applies(s(2, 2048, 2048), s(2048, 32, 64), s(2048, 32, 64))   # heads of 64
  for hd in (16, 32, 48, 96, 256):   # tilings the GPU's lowering refuses (swizzles, tile columns, memory)
    assert not rk.applies(x, s(2048, 16, hd), s(2048, 16, hd)), hd
    assert 'heads of 64 or 128' in rk.why_not(4096, 16, 16, hd, 2048)
  assert not rk.applies(s(2, 2000, 2048), wq, wk)            # 4,000 tokens
  assert not rk.applies(s(2, 2048, 2048, dtype=jnp.float32), wq, wk)
  # Tilings the GPU's lowering refuses (the interpreter takes them).
  assert rk.runs_on_a_gpu(rk.tiles_for(128)) and rk.runs_on_a_gpu(rk.tiles_for(64))
  assert not rk.runs_on_a_gpu(rk.Tiles(stages=4))            # 256 KiB of shared memory
  assert not rk.runs_on_a_gpu(rk.Tiles(epi_m=32))            # half a warpgroup's row block
  assert not rk.applies(x, wq, wk, tiles=rk.Tiles(stages=4))
  # This machine: CPU devices, so never.
  monkeypatch.undo()
  assert hopper.one_device_kind() == '' and not rk.applies(x, wq, wk)


def test_q_and_k_train_the_same_through_the_kernel(monkeypatch):
  """rotary_projections (the kernel run in the interpreter, as if this CPU
  were an H100) against XLA's products and rotary: q and k, and the
  gradients of x, Wq and Wk, the same up to bf16 rounding."""
  ks = jax.random.split(jax.random.key(1), 5)
  batch, seq, embed, heads, kv_heads, hd = 2, 64, 128, 4, 2, 64
  x = jax.random.normal(ks[0], (batch, seq, embed), jnp.bfloat16)
  wq = (jax.random.normal(ks[1], (embed, heads, hd)) * 0.1).astype(jnp.bfloat16)
  wk = (jax.random.normal(ks[2], (embed, kv_heads, hd)) * 0.1).astype(jnp.bfloat16)
  positions = jnp.tile(jnp.arange(seq, dtype=jnp.int32)[None] * 37, (batch, 1))
  cts = (jax.random.normal(ks[3], (batch, seq, heads, hd), jnp.bfloat16),
         jax.random.normal(ks[4], (batch, seq, kv_heads, hd), jnp.bfloat16))

  def plain(x, wq, wk):
    q, k = layers.matmul(x, wq, 1), layers.matmul(x, wk, 1)
    return layers.rotary(q, positions, THETA), layers.rotary(k, positions, THETA)

  calls = []
  real = rk.rotary_product

  def interpreted(x, w, cos_sin, q_columns, tiles):
    calls.append((x.shape, w.shape, q_columns))
    return real(x, w, cos_sin, q_columns, tiles=dataclasses.replace(tiles, tile_m=64, stages=2), interpret=True,
                grid=2)
  monkeypatch.setattr(hopper, 'one_device_kind', lambda: 'NVIDIA H100 80GB HBM3')
  monkeypatch.setattr(rk, 'rotary_product', interpreted)
  assert rk.applies(x, wq, wk)
  kernel = lambda x, wq, wk: layers.rotary_projections(x, wq, wk, positions, THETA)
  (q, k), vjp = jax.vjp(kernel, x, wq, wk)
  with_kernel = vjp(cts)
  assert calls == [((128, 128), (128, 384), 256)]   # (batch * seq, embed), q's and k's kernels side by side: once
  (q0, k0), vjp0 = jax.vjp(plain, x, wq, wk)
  without = vjp0(cts)
  for name, a, b in zip(('q', 'k', 'x', 'wq', 'wk'), (q, k, *with_kernel), (q0, k0, *without)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = np.abs(b).max()
    assert a.shape == b.shape and scale > 0 and np.abs(a - b).max() <= 0.02 * scale, (name, np.abs(a - b).max())


@pytest.mark.parametrize('bindings, says', [
    ({'mesh': {'data': 8}}, 'the mesh has'),
    ({'model': {'rotary_fraction': 0.5}}, 'rotates part of each head'),
    ({'model': {'use_bias': True}}, 'adds biases to q and k'),
    ({'model': {'dtype': 'float32'}}, "dtype = 'float32' computes in that dtype"),
    ({'model': {'fuse_projections': 'inputs'}}, "joins q and k's product"),
    ({'model': {'n_heads': 4, 'n_kv_heads': 1}}, '4 query and 1 key heads'),
    ({'model': {'head_dim': 256}}, 'heads of 256 dims'),
    ({'data': {'seq_len': 100}}, '1600 tokens a product'),
])
def test_the_flag_says_where_it_does_nothing(bindings, says):
  cfg = config_lib.Config()
  model = dataclasses.replace(cfg.model, rotary_kernel=True, **bindings.get('model', {}))
  mesh = dataclasses.replace(cfg.mesh, **bindings.get('mesh', {}))
  data = dataclasses.replace(cfg.data, **bindings.get('data', {}))
  cfg = dataclasses.replace(cfg, model=model, mesh=mesh, data=data)
  notes = rk.doubtful(cfg, 8 if 'mesh' in bindings else 1)
  assert len(notes) == 1 and says in notes[0], notes
  plain = dataclasses.replace(config_lib.Config(), model=dataclasses.replace(config_lib.Config().model,
                                                                             rotary_kernel=True))
  assert not rk.doubtful(plain, 1) and not [n for n in config_lib.doubtful(plain, 1) if 'rotary_kernel' in n]


def _model_grads(scan: bool, remat: str, jit: bool):
  """grads(flag): a bf16 parallel-block model's (GQA, a window; heads of 64)
  every parameter gradient of its loss, with ModelConfig.rotary_kernel = flag."""
  from mjax.config import ModelConfig
  from mjax.model.transformer import Transformer
  cfg = ModelConfig(vocab_size=128, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256, dtype='bfloat16',
                    attention_impl='xla', sliding_window=32, fuse_projections='none', scan_layers=scan,
                    remat_policy=remat)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 64)), jnp.int32)
  params = Transformer(cfg).init(jax.random.key(0), tokens)

  def grads(flag):
    model = Transformer(dataclasses.replace(cfg, rotary_kernel=flag))

    def loss(p):
      logits = model.apply(p, tokens)
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1))
    return (jax.jit(jax.grad(loss)) if jit else jax.grad(loss))(params)
  return grads


@pytest.mark.parametrize('scan', [False, True])
def test_the_model_trains_the_same_with_the_rotary_kernel(monkeypatch, scan):
  """A bf16 parallel-block model (GQA, a window) through its loss's
  gradients, with the kernel in the interpreter as if this CPU were an
  H100, against the same model without the flag: every parameter's
  gradient the same up to bf16 rounding, and the kernel run once a layer.
  (No remat: the interpreter runs the kernel through ordered callbacks,
  which jax.checkpoint refuses; the GPU's kernel is a plain custom call,
  compiled under the dots_attention policy in tests/test_gpu_target.py.)"""
  grads = _model_grads(scan, 'none', jit=False)

  without = grads(False)
  calls = []
  real = rk.rotary_product

  def interpreted(x, w, cos_sin, q_columns, tiles):
    calls.append(x.shape)
    return real(x, w, cos_sin, q_columns, tiles=dataclasses.replace(tiles, tile_m=64, stages=2), interpret=True,
                grid=2)
  monkeypatch.setattr(hopper, 'one_device_kind', lambda: 'NVIDIA H100 80GB HBM3')
  monkeypatch.setattr(rk, 'rotary_product', interpreted)
  with_kernel = grads(True)
  # Once a layer unrolled; a scan's body is traced more than once.
  assert calls == [(128, 256)] * 2 if not scan else calls and set(calls) == {(128, 256)}, calls
  flat = jax.tree_util.tree_leaves_with_path(without)
  for (path, b), a in zip(flat, jax.tree_util.tree_leaves(with_kernel)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = np.abs(b).max()
    assert scale > 0 and np.abs(a - b).max() <= 0.03 * scale, (jax.tree_util.keystr(path), np.abs(a - b).max(), scale)


def _xla_stand_in(x, w, cos_sin, q_columns, tiles):
  """What the kernel computes, in XLA from the same fp16 tables: the model's
  path through `rotary_projections` without the interpreter, which
  jax.checkpoint refuses."""
  cos, sin = lax_bits(cos_sin)
  y = jnp.einsum('te,ef->tf', x, w, preferred_element_type=jnp.float32).reshape(x.shape[0], -1, tiles.tile_n)
  lo, hi = jnp.split(y, 2, axis=-1)
  out = jnp.concatenate([lo * cos[:, None] - hi * sin[:, None], hi * cos[:, None] + lo * sin[:, None]], -1)
  out = out.reshape(x.shape[0], -1).astype(x.dtype)
  return out[:, :q_columns], out[:, q_columns:]


def lax_bits(cos_sin):
  cs = jax.lax.bitcast_convert_type(cos_sin, jnp.float16).astype(jnp.float32)
  return cs[0], cs[1]


@pytest.mark.parametrize('remat, scan', [('dots_attention', False), ('dots_attention', True), ('full', True)])
def test_the_model_trains_the_same_through_rotary_projections_under_remat(monkeypatch, remat, scan):
  """The kernel's custom_vjp under jax.checkpoint, its outputs named for
  the policies (dots_attention keeps them): every parameter's gradient the
  same as the model's without the flag, the kernel standing in as XLA."""
  grads = _model_grads(scan, remat, jit=True)

  without = grads(False)
  calls = []

  def stand_in(*args, **kwargs):
    calls.append(1)
    return _xla_stand_in(*args, **kwargs)
  monkeypatch.setattr(hopper, 'one_device_kind', lambda: 'NVIDIA H100 80GB HBM3')
  monkeypatch.setattr(rk, 'rotary_product', stand_in)
  with_kernel = grads(True)
  assert calls
  for (path, b), a in zip(jax.tree_util.tree_leaves_with_path(without), jax.tree_util.tree_leaves(with_kernel)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = np.abs(b).max()
    assert scale > 0 and np.abs(a - b).max() <= 0.03 * scale, (jax.tree_util.keystr(path), np.abs(a - b).max(), scale)
