"""The tied embedding's gradient under FSDP and data parallelism
(mjax/parallel/scatter_sum.py): the lookup's and the head's partial tables
of each batch shard summed, then reduce-scattered onto the table's shards
(all-reduced, without FSDP) once. On real 8-device meshes: the
same gradient as one device, the collectives it asks for, and where it
leaves the sum to GSPMD."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from mjax.config import MeshConfig
from mjax.model.layers import constrain, embed_lookup, matmul
from mjax.model.transformer import _gathered_head, _gathered_twice, _head_to_partials
from mjax.parallel import logical_rules, make_mesh, scatter_sum

VOCAB, EMBED, BATCH, SEQ = 64, 32, 8, 16
ACT = ('batch', 'residual_seq', 'embed')


def loss(table, tokens, w, v=None):
  """As the model reads the table: cast on its shards and gathered along
  embed once, for the lookup (weighted by w) and, given v, the tied head
  (its logits weighted by v, of the lookup's output: a one-layer model)."""
  plan = scatter_sum.plan(tokens.shape, table.shape)
  t, h, partials = _gathered_twice(constrain(table, ('vocab', 'embed')), w.dtype, plan)
  x = constrain(embed_lookup(t, tokens, plan, partials), ACT)
  out = jnp.sum(x.astype(jnp.float32) * w.astype(jnp.float32))
  if v is not None:
    logits = matmul(x, h, kernel_in_last=True) if plan is None else _head_to_partials(x, h, plan, partials)
    out = out + jnp.sum(constrain(logits, ('batch', 'seq', 'vocab')).astype(jnp.float32) * v)
  return out


def inputs(dtype=jnp.float32, head=False):
  rng = np.random.default_rng(0)
  args = (jnp.asarray(rng.normal(size=(VOCAB, EMBED)), jnp.float32),
          jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ)), jnp.int32),
          jnp.asarray(rng.normal(size=(BATCH, SEQ, EMBED)), dtype))
  return args + ((jnp.asarray(rng.normal(size=(BATCH, SEQ, VOCAB)), jnp.float32),) if head else ())


def grad_on(layout: dict, args):
  """(gradient, its sharding spec, compiled HLO) under a mesh of `layout`."""
  mc = MeshConfig(**layout)
  with jax.set_mesh(make_mesh(mc)), nn.logical_axis_rules(logical_rules(mc)):
    f = jax.jit(jax.grad(loss))
    grad = f(*args)
    return grad, grad.sharding.spec, f.lower(*args).compile().as_text()


def collectives(hlo: str) -> dict[str, int]:
  return {k: hlo.count(f' {k}(') for k in ('all-reduce', 'reduce-scatter', 'all-to-all', 'all-gather')}


def all_reduced_tables(hlo: str) -> list[str]:
  """The 2-D (table-shaped) results of the all-reduces; the head's input
  gradient under tensor parallelism is an all-reduce too, of activations."""
  return re.findall(r'= \w+\[(\d+,\d+)\]\S* all-reduce\(', hlo)


LAYOUTS = {
    'fsdp8': dict(data=1, fsdp=8),
    'data2_fsdp4': dict(data=2, fsdp=4),
    'data2_fsdp2_tensor2': dict(data=2, fsdp=2, tensor=2),
    'fsdp4_tensor2_sp': dict(data=1, fsdp=4, tensor=2, sequence_parallel=True),
    # Manual over every axis: the pipeline's devices each compute the whole.
    'fsdp2_tensor2_pipeline2': dict(data=1, fsdp=2, tensor=2, pipeline=2),
}


@pytest.mark.parametrize('head', [False, True], ids=['lookup', 'lookup_and_head'])
@pytest.mark.parametrize('layout', list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_fsdp_reduce_scatters_the_tables_gradient_once(layout, head):
  args = inputs(head=head)
  ref = jax.grad(loss)(*args)
  grad, spec, hlo = grad_on(layout, args)
  np.testing.assert_allclose(grad, ref, rtol=1e-5, atol=1e-5)
  # It leaves on the table's own layout (embed over fsdp, vocab over tensor).
  assert spec[1] == 'fsdp', spec
  if layout.get('tensor', 1) > 1:
    assert spec[0] == 'tensor', spec
  ops = collectives(hlo)
  # One reduce-scatter over fsdp of the lookup's and head's partials summed
  # (GSPMD reduced each reader's on its own, the lookup's as an all-reduce
  # of the whole table); the only table all-reduced is the 1/fsdp shard over
  # data, none when data is 1; nothing moved by all-to-all.
  assert ops['reduce-scatter'] == 1, ops
  shard = f'{VOCAB // layout.get("tensor", 1)},{EMBED // layout["fsdp"]}'
  assert all_reduced_tables(hlo) == ([shard] if layout['data'] > 1 else []), all_reduced_tables(hlo)
  assert ops['all-to-all'] == 0, ops


@pytest.mark.parametrize('layout', [LAYOUTS['fsdp8'], LAYOUTS['data2_fsdp2_tensor2']], ids=['fsdp8', 'data2_fsdp2_tensor2'])
def test_in_bf16_the_summed_partials_match_one_device(layout):
  # bf16 compute: each device's two partials added in fp32 and rounded once,
  # the sum over devices in bf16. Against one device's bf16 gradient, and
  # no further from the fp32 one than 1.5x of it (both ~2^-8: the forward's
  # bf16 table and logits).
  table, tokens, w, v = inputs(jnp.bfloat16, head=True)
  exact = jax.grad(loss)(table, tokens, w.astype(jnp.float32), v)
  one = jax.grad(loss)(table, tokens, w, v)
  grad, _, hlo = grad_on(layout, (table, tokens, w, v))
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(exact))
  assert rel(grad, one) < 2 ** -7, rel(grad, one)
  assert rel(grad, exact) < 1.5 * rel(one, exact), (rel(grad, exact), rel(one, exact))
  assert collectives(hlo)['reduce-scatter'] == 1


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['f32', 'bf16'])
@pytest.mark.parametrize('layout', [dict(data=8), dict(data=4, tensor=2)], ids=['data8', 'data4_tensor2'])
def test_data_parallel_all_reduces_the_tables_gradient_once(layout, dtype):
  # No FSDP: the table is whole on each device (vocab split over tensor).
  # GSPMD all-reduced the lookup's partial in fp32 and the head's in the
  # compute dtype, the table twice; summed first, it crosses once, in the
  # compute dtype, as the layers' gradients do.
  table, tokens, w, v = inputs(dtype, head=True)
  one = jax.grad(loss)(table, tokens, w, v)
  grad, spec, hlo = grad_on(layout, (table, tokens, w, v))
  if dtype == jnp.float32:
    np.testing.assert_allclose(grad, one, rtol=1e-5, atol=1e-5)
  else:
    exact = jax.grad(loss)(table, tokens, w.astype(jnp.float32), v)
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(exact))
    assert rel(grad, one) < 2 ** -7 and rel(grad, exact) < 1.5 * rel(one, exact)
  rows = VOCAB // layout.get('tensor', 1)
  assert all_reduced_tables(hlo) == [f'{rows},{EMBED}'], all_reduced_tables(hlo)
  # (In the compute dtype: XLA's CPU backend widens 16-bit collectives to
  # fp32 after partitioning; tests/test_gpu_target.py reads a GPU's.)
  assert collectives(hlo)['reduce-scatter'] == 0 and collectives(hlo)['all-to-all'] == 0
  if layout.get('tensor', 1) > 1:
    assert spec[0] == 'tensor', spec


def untied_loss(head, x, v, tokens_shape=(BATCH, SEQ)):
  """An untied (embed, vocab) head read as the model reads it: its logits of
  x, weighted by v."""
  plan = scatter_sum.plan(tokens_shape, head.shape[::-1])
  g, partials = _gathered_head(constrain(head, ('embed', 'vocab')), x.dtype, plan)
  x = constrain(x, ACT)
  logits = matmul(x, g) if plan is None else _head_to_partials(x, g, plan, partials, kernel_in_last=False)
  return jnp.sum(constrain(logits, ('batch', 'seq', 'vocab')).astype(jnp.float32) * v)


@pytest.mark.parametrize('layout', [LAYOUTS['fsdp8'], LAYOUTS['data2_fsdp2_tensor2'], LAYOUTS['fsdp4_tensor2_sp'],
                                    dict(data=8)], ids=['fsdp8', 'data2_fsdp2_tensor2', 'fsdp4_tensor2_sp', 'data8'])
def test_an_untied_head_is_reduced_once(layout):
  # The untied head goes the same way: gathered once, its partials summed
  # per batch shard and reduce-scattered (all-reduced without FSDP) once.
  # GSPMD had all-reduced it whole under data x fsdp x tensor.
  rng = np.random.default_rng(1)
  head = jnp.asarray(rng.normal(size=(EMBED, VOCAB)), jnp.float32)
  x = jnp.asarray(rng.normal(size=(BATCH, SEQ, EMBED)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(BATCH, SEQ, VOCAB)), jnp.float32)
  ref = jax.grad(untied_loss)(head, x, v)
  mc = MeshConfig(**layout)
  with jax.set_mesh(make_mesh(mc)), nn.logical_axis_rules(logical_rules(mc)):
    f = jax.jit(jax.grad(untied_loss))
    grad = f(head, x, v)
    hlo = f.lower(head, x, v).compile().as_text()
  np.testing.assert_allclose(grad, ref, rtol=1e-5, atol=1e-5)
  fsdp, tensor = layout.get('fsdp', 1), layout.get('tensor', 1)
  spec = tuple(grad.sharding.spec) + (None,) * 2
  assert spec[0] == ('fsdp' if fsdp > 1 else None), grad.sharding.spec
  ops = collectives(hlo)
  assert ops['reduce-scatter'] == (1 if fsdp > 1 else 0) and ops['all-to-all'] == 0, ops
  data = layout.get('data', 1)
  tables = all_reduced_tables(hlo)
  assert tables == ([f'{VOCAB // tensor},{EMBED // fsdp}'] if data > 1 else []), tables


def test_each_device_sums_its_rows_in_fp32_before_the_bf16_reduce_scatter():
  # One frequent token: 1,024 rows of 1/3 add into table[3]. Summed in bf16
  # one row at a time they stall at 128 (past it, bf16's spacing of 1 swallows
  # a third), not 342: each device sums its 128 rows in fp32 and rounds once,
  # and only the 8 partial sums meet in bf16.
  seq = 128
  table = jnp.zeros((VOCAB, EMBED), jnp.float32)
  tokens = jnp.full((BATCH, seq), 3, jnp.int32)
  w = jnp.full((BATCH, seq, EMBED), 1 / 3, jnp.bfloat16)
  grad, spec, hlo = grad_on(dict(data=1, fsdp=8), (table, tokens, w))
  true = BATCH * seq * float(jnp.asarray(1 / 3, jnp.bfloat16))
  np.testing.assert_allclose(np.asarray(grad[3], np.float32), true, rtol=2 ** -7)
  assert not np.asarray(grad[:3]).any() and not np.asarray(grad[4:]).any()
  assert collectives(hlo)['reduce-scatter'] == 1


def test_plan_leaves_the_sum_to_gspmd_where_nothing_is_written_out():
  shape, tokens = (VOCAB, EMBED), (BATCH, SEQ)
  assert scatter_sum.plan(tokens, shape) is None   # no mesh
  mc = MeshConfig(data=2, fsdp=2, tensor=2)
  mesh = make_mesh(mc)
  with jax.set_mesh(mesh), nn.logical_axis_rules(logical_rules(mc)):
    assert scatter_sum.plan(tokens, shape) == scatter_sum.Plan(
        batch=('data', 'fsdp'), seq=(), embed=('fsdp',), vocab=('tensor',), n=4, vocab_shards=2)
    assert scatter_sum.plan(tokens, (VOCAB + 1, EMBED)).vocab == ()   # a vocab tensor does not divide
    assert scatter_sum.plan((BATCH - 2, SEQ), shape) is None   # rows the batch axes do not split
    assert scatter_sum.plan(tokens, (VOCAB, 31)) is None       # an embed fsdp does not divide
  mc = MeshConfig(data=8)
  with jax.set_mesh(make_mesh(mc)), nn.logical_axis_rules(logical_rules(mc)):
    # Data parallelism: partials all-reduced over data, nothing scattered.
    assert scatter_sum.plan(tokens, shape) == scatter_sum.Plan(
        batch=('data',), seq=(), embed=(), vocab=(), n=8, vocab_shards=1)

    # Inside a region already manual over data (a pipeline schedule's),
    # where the same mesh outside gives a plan.
    seen = []

    def body(x):
      seen.append(scatter_sum.plan(tokens, shape))
      return x

    jax.jit(jax.shard_map(body, in_specs=P('data'), out_specs=P('data'), axis_names={'data'},
                          check_vma=False))(jnp.zeros(8))
    assert seen == [None]
  mc = MeshConfig(data=1, tensor=8)
  with jax.set_mesh(make_mesh(mc)), nn.logical_axis_rules(logical_rules(mc)):
    assert scatter_sum.plan(tokens, shape) is None             # nothing splits the batch
