"""The pure core of training: sharded state and the jitted functions.

`make_program(cfg, mesh)` builds, without allocating anything, the model, the
optimizer, the shardings of the state and the batch, and three jitted
functions: `init` (the state, created directly sharded), `step` (one
optimizer step: forward, backward, LAMB update) and `eval_step`. Everything
stateful around them (checkpoints, data position, the loop, fault tolerance)
is the Trainer's, in mjax/trainer.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
from typing import Any, Callable, Iterable, Optional

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mjax.config import Config
from mjax.errors import UserError
from mjax.model import Transformer
from mjax.model.transformer import LayerGroup, remat
from mjax.model.loss import cross_entropy
from mjax.optim import Lamb, make_optimizer, other_clip_layout
from mjax.parallel import logical_rules, ordering, pipeline
from mjax.parallel.rules import data_axis, mesh_axes, rules_without

Batch = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
  step: jax.Array      # () int32
  params: Any          # fp32 master weights
  opt_state: Any       # fp32 LAMB moments


def batch_keys(cfg: Config) -> tuple[str, ...]:
  """The arrays of a batch, each (batch, seq)."""
  keys = ('inputs', 'targets', 'loss_mask')
  return keys + (('segment_ids', 'positions') if cfg.data.document_attention else ())


@dataclasses.dataclass
class Program:
  """Everything compiled for one config on one mesh."""
  cfg: Config
  mesh: Mesh
  lamb: Lamb                                   # LAMB: its optax chain, and its update as the step runs it
  state_shardings: TrainState
  batch_shardings: dict[str, NamedSharding]
  init: Callable[[jax.Array], TrainState]
  step: Callable[[TrainState, Batch], tuple[TrainState, dict]]
  eval_step: Callable[[Any, Batch], jax.Array]
  rules: tuple
  canonical_shardings: TrainState             # the layout checkpoints are written in
  to_canonical: Callable[[TrainState], TrainState]
  from_canonical: Callable[[TrainState], TrainState]
  state_shapes: TrainState                    # ShapeDtypeStructs of what `init` makes

  @property
  def tx(self) -> optax.GradientTransformation:
    """The optimizer as an optax chain: its init makes the optimizer state."""
    return self.lamb.tx

  def context(self):
    """Mesh + logical rules: needed whenever the model is traced."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(self.mesh))
    stack.enter_context(nn.logical_axis_rules(self.rules))
    return stack

  def abstract_batch(self) -> Batch:
    b, s = self.cfg.train.global_batch_size, self.cfg.data.seq_len
    return {k: jax.ShapeDtypeStruct((b, s), jnp.float32 if k == 'loss_mask' else jnp.int32,
                                    sharding=self.batch_shardings[k]) for k in batch_keys(self.cfg)}

  def abstract_state(self, canonical: bool = False) -> TrainState:
    """ShapeDtypeStructs (with shardings) of the state, or of its checkpoint layout."""
    shapes = self.state_shapes
    if canonical:
      with self.context():
        shapes = jax.eval_shape(self.to_canonical, shapes)
    shardings = self.canonical_shardings if canonical else self.state_shardings
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, shardings)

  def other_layouts(self, abstract: TrainState) -> list[tuple[TrainState, Callable[[TrainState], TrainState]]]:
    """The checkpoint layout of the state under the other gradient-clipping
    setting (`optim.other_clip_layout`), with the conversion of a state read
    in it to this config's: a run may turn OptimConfig.clip_norm on or off
    between starts (`checkpoint.resume`). `abstract`: `abstract_state(canonical=True)`."""
    other, convert = other_clip_layout(abstract.opt_state, self.cfg.optim.clip_norm > 0)
    return [(abstract.replace(opt_state=other), lambda st: st.replace(opt_state=convert(st.opt_state)))]

  def canonical_params(self, params):
    """Params in the layout every mesh shares (layers stacked in order)."""
    if not self.cfg.mesh.pipelined:
      return params
    return {**params, 'layers': pipeline.from_pipeline_layout(params['layers'])}

  def params_from_canonical(self, params):
    """The inverse of `canonical_params`, onto the params' shardings."""
    if not self.cfg.mesh.pipelined:
      return params
    with self.context():
      return jax.jit(lambda p: _split_stages(p, self.cfg), out_shardings=self.state_shardings.params)(params)

  def with_params(self, state: TrainState, params: Any) -> TrainState:
    """`state` with the given params (numpy, canonical layout: the same on
    every process) and a fresh optimizer state for them.

    Raises:
      UserError: the params' names or shapes are not the config's.
    """
    want = self.abstract_state(canonical=True).params
    have = {jax.tree_util.keystr(p): np.shape(a) for p, a in jax.tree_util.tree_leaves_with_path(params)}
    for path, leaf in jax.tree_util.tree_leaves_with_path(want):
      key = jax.tree_util.keystr(path)
      if have.get(key) != tuple(leaf.shape):
        raise UserError(f'the weights have params{key} {have.get(key)}, the config makes {tuple(leaf.shape)}.')
    placed = jax.tree.map(
        lambda a, s: jax.make_array_from_callback(s.shape, s.sharding, lambda idx: np.asarray(a, s.dtype)[idx]),
        params, want)
    with self.context():
      placed = self.params_from_canonical(placed)
      opt_state = jax.jit(self.tx.init, out_shardings=self.state_shardings.opt_state)(placed)
    return TrainState(step=state.step, params=placed, opt_state=opt_state)

  def data_share(self) -> tuple[int, int]:
    """(index, count): this process feeds rows block `index` of the global
    batch cut into `count` equal blocks, the rows its devices hold. The
    batch is split over data x fsdp only, so processes of one tensor or
    pipeline group across hosts hold the same rows: they read the same
    block (the pipeline is deterministic), and count is less than the
    number of processes.

    Raises:
      UserError: this process's devices hold rows that are not one block.
    """
    batch = self.cfg.train.global_batch_size
    held = self.batch_shardings['inputs'].addressable_devices_indices_map((batch, self.cfg.data.seq_len))
    rows = sorted({idx[0].indices(batch)[:2] for idx in held.values()})
    lo, hi = rows[0][0], rows[-1][1]
    if any(a[1] != b[0] for a, b in zip(rows, rows[1:])) or batch % (hi - lo) or lo % (hi - lo):
      raise UserError(f'the mesh {dict(self.mesh.shape)} gives process {jax.process_index()} rows {rows} of '
                      f'the global batch of {batch}: not one of equal blocks, which is how each process '
                      f'reads its share of the data. Order the devices so that a process holds adjacent '
                      f'data x fsdp shards, or change the mesh.')
    return lo // (hi - lo), batch // (hi - lo)

  def to_global(self, local: dict[str, np.ndarray]) -> Batch:
    """This host's rows -> one global array per key (MegaScale's one loader
    per machine: each host reads only its own share of the batch)."""
    shape = (self.cfg.train.global_batch_size, self.cfg.data.seq_len)
    return {k: jax.make_array_from_process_local_data(self.batch_shardings[k], np.asarray(v), shape)
            for k, v in local.items()}


def make_program(cfg: Config, mesh: Mesh) -> Program:
  """Builds the model, optimizer, shardings and jitted functions (no arrays)."""
  # The mesh's own axis sizes in place of a -1 ("the rest"), so that what
  # reads an axis's size (data or fsdp > 1) reads the size it has.
  cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(
      cfg.mesh, **{a: mesh.shape[a] // getattr(cfg.mesh, 'dcn_' + a) for a in cfg.mesh.AXES
                   if getattr(cfg.mesh, a) == -1 and a in mesh.shape}))
  model = Transformer(cfg.model)
  rules = logical_rules(cfg.mesh)
  replicated = NamedSharding(mesh, P())
  lay = _layouts(cfg, mesh, model, rules)
  lamb = make_optimizer(cfg.optim, cfg.train.steps, lay.layer_axes)
  tx, schedule = lamb.tx, lamb.schedule

  def shardings_for(names_tree, params_shapes) -> TrainState:
    param_shardings = jax.tree.map(lambda n: nn.logical_to_mesh_sharding(P(*n), mesh, rules),
                                   names_tree, is_leaf=_is_names)
    # The optimizer moments mirror the params, so they take the params'
    # shardings (ZeRO: optimizer state sharded exactly like the weights);
    # counters are replicated.
    opt_shardings = optax.tree_map_params(
        tx, lambda _, s: s, jax.eval_shape(tx.init, params_shapes), param_shardings,
        transform_non_params=lambda _: replicated)
    return TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)

  pipe = cfg.mesh.pipelined
  state_shardings = shardings_for(lay.names, lay.abstract_params)
  param_shardings = state_shardings.params
  # Checkpoints hold the layout every mesh shares (layers stacked in order), so
  # that a run can resume on any other layout.
  canonical_shardings = (shardings_for(lay.canonical_names, lay.canonical_params) if pipe
                         else state_shardings)

  def relayout(state: TrainState, leaf_fn) -> TrainState:
    fn = lambda w, lead: leaf_fn(w) if lead == 3 else w
    return TrainState(step=state.step, params=jax.tree.map(fn, state.params, lay.layer_axes),
                      opt_state=optax.tree_map_params(tx, fn, state.opt_state, lay.layer_axes))

  stages, repeats = cfg.mesh.pipeline * cfg.mesh.dcn_pipeline, cfg.mesh.virtual_stages
  to_canonical = lambda st: relayout(st, pipeline.from_pipeline_layout)
  from_canonical = lambda st: relayout(st, lambda w: pipeline.to_pipeline_layout(w, stages, repeats))
  row = nn.logical_to_mesh_sharding(P('batch', 'seq'), mesh, rules)
  batch_shardings = {k: row for k in batch_keys(cfg)}

  def state_of(params) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  def init(rng: jax.Array) -> TrainState:
    return state_of(lay.init_params(rng))

  # XLA's CPU runtime needs a program's collectives in one order on every
  # device (mjax.parallel.ordering); GPU programs keep their freedom.
  on_cpu = mesh.devices.flat[0].platform == 'cpu'
  loss_sums = _loss_fn(cfg, model, ordered=on_cpu)

  def eval_loss(params, batch: Batch) -> jax.Array:
    # In the training step's slices: a batch taken in slices to fit the
    # devices would not fit in one forward pass either (the logits alone are
    # grad_accum_steps times larger), and the first evaluation, hours into a
    # run, would fail for memory.
    total, count = _loss_sums_in_slices(loss_sums, params, batch, cfg.train.grad_accum_steps)
    return total / jnp.maximum(count, 1.0)

  # The dtype gradients are reduced in over `data` when the step writes the
  # reduction out (_grad_sums): the compute dtype, as GSPMD reduces them,
  # except on CPUs, whose compiler widens 16-bit collectives to fp32 anyway
  # and aborts on a bf16 one inside a region manual over some axes only
  # (AllReducePromotion: "Invalid binary instruction opcode copy").
  reduce_dtype = jnp.dtype(jnp.float32 if on_cpu else cfg.model.dtype)
  # MeshConfig.fsdp_gather = 'step': the weights gathered once a step, the
  # gradients reduce-scattered once (_grad_sums_gathered).
  gather_once = cfg.mesh.fsdp_gather == 'step' and mesh.shape['fsdp'] > 1
  param_specs = jax.tree.map(lambda s: s.spec, param_shardings)
  gemm_forms = _gemm_forms(lay.names)

  def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
    # Scanned layers only: with unrolled ones the GPU compiler already moves
    # the all-reduce out of the slices' loop, and under tensor parallelism
    # the manual region cost a few % more of its other collectives (1p3b,
    # data 2 x fsdp 2 x tensor 2, 2 slices). Pipeline schedules run manual
    # over `data` themselves.
    manual = cfg.model.scan_layers and not pipe
    if gather_once:
      total, count, grads = _grad_sums_gathered(
          loss_sums, state.params, batch, cfg.train.grad_accum_steps, param_specs=param_specs,
          compute_dtype=jnp.dtype(cfg.model.dtype), reduce_dtype=reduce_dtype, layer_axes=lay.layer_axes,
          keep_fp32=_gathered_in_fp32(cfg), ordered=on_cpu, forms=gemm_forms)
    else:
      total, count, grads = _grad_sums(loss_sums, state.params, batch, cfg.train.grad_accum_steps,
                                       reduce_dtype=reduce_dtype if manual else None, layer_axes=lay.layer_axes,
                                       forms=gemm_forms)
    count = jnp.maximum(count, 1.0)
    updates, opt_state, norms = lamb.update(grads, count, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {'loss': total / count, **norms, 'lr': schedule(state.step)}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return Program(
      cfg=cfg, mesh=mesh, lamb=lamb,
      state_shardings=state_shardings, batch_shardings=batch_shardings, rules=rules,
      init=jax.jit(init, out_shardings=state_shardings),
      # Donating the state lets XLA update params and moments in place: without
      # it the step needs two copies of the whole train state.
      step=jax.jit(train_step, in_shardings=(state_shardings, batch_shardings),
                   out_shardings=(state_shardings, replicated), donate_argnums=0),
      eval_step=jax.jit(eval_loss, in_shardings=(param_shardings, batch_shardings),
                        out_shardings=replicated),
      canonical_shardings=canonical_shardings,
      to_canonical=jax.jit(to_canonical, out_shardings=canonical_shardings) if pipe else (lambda st: st),
      from_canonical=jax.jit(from_canonical, out_shardings=state_shardings) if pipe else (lambda st: st),
      # From the params' shapes, tracing the optimizer's init alone. A
      # restart needs the state's shapes (its restore, the step's lowering)
      # but never runs init: tracing the model's init for them cost it
      # seconds with unrolled layers.
      state_shapes=jax.eval_shape(state_of, lay.abstract_params),
  )


_is_names = lambda x: isinstance(x, tuple)


@dataclasses.dataclass
class _Layouts:
  """Shapes and logical axis names of the params, without allocating any:
  as trained (pipeline stages split out) and as checkpointed (canonical)."""
  init_params: Callable[[jax.Array], Any]
  abstract_params: Any
  canonical_params: Any
  names: Any
  canonical_names: Any
  layer_axes: Any    # per param: how many leading axes index layers (LAMB's trust ratio is per layer)


def _layouts(cfg: Config, mesh: Mesh, model: Transformer, rules) -> _Layouts:
  dummy = jnp.zeros((1, cfg.data.seq_len), jnp.int32)
  pipe = cfg.mesh.pipelined

  def init_params(rng: jax.Array):
    params = nn.meta.unbox(model.init(rng, dummy)['params'])
    return _split_stages(params, cfg) if pipe else params

  # The model's init traced once: `init_params` is the same init, unboxed
  # and (pipelined) split into stages, neither of which needs the model.
  # (Unboxed outside the rules: with them, unboxing constrains shardings,
  # which shapes alone cannot take.)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), dummy))['params']
  canonical_params = nn.meta.unbox(boxed)
  abstract_params = jax.eval_shape(lambda p: _split_stages(p, cfg), canonical_params) if pipe else canonical_params
  canonical_names = jax.tree.map(lambda b: b.names, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  names = canonical_names
  if pipe:
    names = {**names, 'layers': jax.tree.map(pipeline.pipeline_names, names['layers'], is_leaf=_is_names)}
  layer_axes = jax.tree.map(lambda n: n.index('layers') + 1 if 'layers' in n else 0, names, is_leaf=_is_names)
  return _Layouts(init_params, abstract_params, canonical_params, names, canonical_names, layer_axes)


def _split_stages(params, cfg: Config):
  """Canonical params -> each pipeline stage holding its own chunks of layers."""
  stages, repeats = cfg.mesh.pipeline * cfg.mesh.dcn_pipeline, cfg.mesh.virtual_stages
  return {**params, 'layers': pipeline.to_pipeline_layout(params['layers'], stages, repeats)}


def _loss_fn(cfg: Config, model: Transformer, ordered: bool = False):
  """params, batch -> (sum of token losses, number of counted tokens): sums,
  not a mean, so that micro-batches and accumulation slices add up to the
  exact batch mean."""
  pipe = cfg.mesh.pipelined
  group = LayerGroup(cfg.model)
  group_fn = remat(lambda gp, x, aux: group.apply({'params': gp}, x, *aux)[0], cfg.model)

  def forward(params, batch: Batch) -> jax.Array:
    # Packed documents (DataConfig.document_attention) come with their own
    # positions and segment ids; otherwise positions are 0..seq-1.
    positions, segments = batch.get('positions'), batch.get('segment_ids')
    if not pipe:
      return model.apply({'params': params}, batch['inputs'], positions, segments)
    rest = {k: v for k, v in params.items() if k != 'layers'}

    def run_layers(x, pos, seg):
      return pipeline.circular_pipeline(group_fn, params['layers'], x, (pos, seg),
                                        microbatches=cfg.mesh.num_microbatches())
    return model.apply({'params': rest}, batch['inputs'], positions, segments, layers_fn=run_layers)

  def loss_sums(params, batch: Batch) -> tuple[jax.Array, jax.Array]:
    logits = forward(params, batch)                               # (batch, seq, vocab) fp32
    nll = cross_entropy(logits, batch['targets'])
    return jnp.sum(nll * batch['loss_mask']), jnp.sum(batch['loss_mask'])
  if pipe and cfg.mesh.pipeline_schedule == '1f1b':
    return _one_f_one_b_loss(cfg, model, group_fn, loss_sums, ordered=ordered)
  return loss_sums


def _one_f_one_b_loss(cfg: Config, model: Transformer, group_fn, plain, ordered: bool = False):
  """`plain` (the circular schedule's loss sums) whose gradient comes from
  the 1F1B schedule (pipeline.one_f_one_b), which computes loss and
  gradients together: evaluation runs `plain`, differentiation the schedule.
  Embedding and head are the model's own ends ('embed' / 'head' parts)."""

  def stage_fn(chunk, h, aux):
    return jax.lax.scan(lambda h, group: (group_fn(group, h, aux), None), h, chunk)[0]

  def embed_fn(rest, inputs):
    tokens, positions = inputs
    return model.apply({'params': rest}, tokens, positions, part='embed')

  def head_fn(rest, h, head_aux):
    targets, mask = head_aux
    logits = model.apply({'params': rest}, None, part='head', hidden=h)   # (mb, seq, vocab) fp32
    return jnp.sum(cross_entropy(logits, targets) * mask), jnp.sum(mask)

  def with_grads(params, batch: Batch):
    rest = {k: v for k, v in params.items() if k != 'layers'}
    tokens = batch['inputs']
    positions = batch.get('positions')
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    # The embedding's backward runs in the schedule, where its gradient
    # meets the tied head's, except under FSDP with sequence parallelism,
    # where XLA cannot partition its scatter-add there (see one_f_one_b).
    inside = not (cfg.mesh.fsdp * cfg.mesh.dcn_fsdp > 1 and cfg.mesh.sequence_parallel)
    total, count, d_layers, d_rest, dx = pipeline.one_f_one_b(
        embed_fn, stage_fn, head_fn, params['layers'], rest, (tokens, positions),
        (positions, batch.get('segment_ids')), (batch['targets'], batch['loss_mask']),
        microbatches=cfg.mesh.num_microbatches(), embed_backward=inside, ordered=ordered)
    if not inside:
      _, embed_vjp = jax.vjp(lambda r: embed_fn(r, (tokens, positions)), rest)
      (d_embed,) = embed_vjp(dx)
      d_rest = jax.tree.map(lambda a, b: a.astype(jnp.float32) + b, d_embed, d_rest)
    grads = {**d_rest, 'layers': d_layers}
    grads = jax.tree.map(lambda g, w: g.astype(w.dtype), grads, params)
    return (total, count), grads

  @jax.custom_vjp
  def loss_sums(params, batch: Batch) -> tuple[jax.Array, jax.Array]:
    return plain(params, batch)

  def fwd(params, batch):
    out, grads = with_grads(params, batch)
    return out, (grads, batch)

  def bwd(res, cts):
    grads, batch = res
    scale = cts[0]     # the loss sum's cotangent; the token count has no gradient
    no_grad = lambda a: (np.zeros(a.shape, jax.dtypes.float0) if not jnp.issubdtype(a.dtype, jnp.inexact)
                         else jnp.zeros_like(a))
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads), jax.tree.map(no_grad, batch)

  loss_sums.defvjp(fwd, bwd)
  return loss_sums


def _slices(batch: Batch, k: int) -> Batch:
  """The batch as `k` slices stacked on a new leading axis. Strided (rows i,
  i + k, ...), so every slice stays spread over the data-parallel shards."""
  return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)


def _sum_over_slices(fn, params, batch: Batch, k: int, zeros, apart: bool = False, ordered: bool = False):
  """fn(params, batch), a tree of sums, over the batch in `k` sequential
  slices, summed (fp32 sums across slices, one division by the caller).

  `apart`: the first and the last slice run outside the slices' loop (a
  loop takes its inputs whole and gives its outputs at its end): what
  comes before can finish behind the first slice's work, each input
  arriving by the time it is read, and what follows can start on each of
  the last slice's results as it is made. `ordered`: the loop and the last
  slice each start once the part before them has finished (XLA's CPU
  runtime would otherwise run them side by side, their collectives in any
  order: `mjax.parallel.ordering`)."""
  if k == 1:
    return fn(params, batch)
  # Each new term is laid out as its sum (`zeros`), which may be a gradient's
  # matrix-product form (`_gemm_forms`).
  add = lambda acc, new: jax.tree.map(lambda a, x: a + x.astype(a.dtype).reshape(a.shape), acc, new)
  loop = lambda acc, sls: jax.lax.scan(lambda acc, sl: (add(acc, fn(params, sl)), None), acc, sls)[0]
  slices = _slices(batch, k)
  if not apart:
    return loop(zeros, slices)
  pick = lambda i: jax.tree.map(lambda a: a[i], slices)
  acc = add(zeros, fn(params, pick(0)))
  if k > 2:
    # The loop reads `acc` as its start: after the first slice already.
    acc = loop(acc, jax.tree.map(lambda a: a[1:-1], slices))
  last = pick(k - 1)
  if ordered:
    last = ordering.after(last, acc)
  return add(acc, fn(params, last))


def _sums_with_grads(loss_sums):
  """(params, batch) -> (loss sum, token count, gradient sums)."""
  grad_fn = jax.value_and_grad(loss_sums, has_aux=True)

  def sums(p, b):
    (total, count), grads = grad_fn(p, b)
    return total, count, grads

  return sums


def _is_matrix(w, lead: int) -> bool:
  """A weight matrix (used, and its gradient reduced, in the compute dtype),
  not a vector such as a norm scale; `lead`: its leading axes that index
  layers."""
  return w.ndim - lead >= 2


def _gemm_forms(names) -> Any:
  """Per param, the 2-D shape its gradient's sum over accumulation slices is
  kept in, or None for its own.

  A projection kernel with more than two dims (attention's q, k, v, as
  (embed, heads, head_dim), and its output, as (heads, head_dim, embed)) is
  multiplied as a 2-D matrix, (embed, rest) or (rest, embed), and its
  weight gradient comes out of one 2-D product. Summed in that form, the
  sum is the product's own addend: the GPU compiler runs `sum + x^T dy` as
  one cuBLAS call (beta = 1, the product's output fp32). Summed in the
  kernel's shape, the reshape between product and sum stopped that fusion:
  each slice wrote the gradient in bf16 and a pass of its own read it and
  the fp32 sum and wrote the sum (1p3b on an H100, deviceless: 4 of each
  layer's 6 weight gradients, 4 GB of memory traffic a slice). Stacked
  layers' kernels (a scan's or a pipeline's) keep their shape: their
  gradients leave a loop, not a product."""

  def form(n) -> Optional[tuple[str, ...]]:
    if len(n) < 3 or 'layers' in n or n.count('embed') != 1 or 'embed' not in (n[0], n[-1]):
      return None
    return n
  return jax.tree.map(form, names, is_leaf=_is_names)


def _gemm_zeros(w: jax.Array, names: Optional[tuple[str, ...]], dtype) -> jax.Array:
  """Zeros for the sum of `w`'s gradients, in its `_gemm_forms` form."""
  if names is None:
    return jnp.zeros(w.shape, dtype)
  rest = math.prod(w.shape[1:] if names[0] == 'embed' else w.shape[:-1])
  return jnp.zeros((w.shape[0], rest) if names[0] == 'embed' else (rest, w.shape[-1]), dtype)


def _in_shapes(grads, params):
  """Sums kept in `_gemm_forms` form, back in their params' shapes."""
  return jax.tree.map(lambda g, w: g.reshape(w.shape), grads, params)


def _grad_sums(loss_sums, params, batch: Batch, k: int, reduce_dtype=None, layer_axes=None, forms=None):
  """(loss sum, token count, gradient sums) over the batch, in `k`
  sequential accumulation slices, each param's summed in its `forms` form
  (`_gemm_forms`; None: every param's in its own shape).

  With `reduce_dtype` (the compute dtype) and a `data` axis splitting the
  batch, the slices run manual over `data`: each data shard sums its own
  slices' gradients and they are all-reduced over `data` once, in that
  dtype (norms' and other vectors' in fp32), as one slice's would be. Left
  to the automatic layout, a program with scanned layers all-reduced every
  slice's gradients over `data` (the GPU compiler moves the all-reduce out
  of the slices' loop only when the layers are unrolled): k times the
  cross-host traffic of HSDP. `layer_axes` (per param, its leading axes
  that index layers) tells a stacked vector from a matrix."""
  sums = _sums_with_grads(loss_sums)
  forms = forms if forms is not None else jax.tree.map(lambda _: None, params)
  zeros = lambda p: (jnp.zeros(()), jnp.zeros(()),
                     jax.tree.map(lambda w, n: _gemm_zeros(w, n, w.dtype), p, forms))
  data = data_axis() if k > 1 and reduce_dtype is not None else None
  if data is None:
    total, count, grads = _sum_over_slices(sums, params, batch, k, zeros(params))
    return total, count, _in_shapes(grads, params)

  def local(p, b):
    with rules_without(data):
      total, count, grads = _sum_over_slices(sums, p, b, k, zeros(p))
      grads = _in_shapes(grads, p)
    # Matrices are used in the compute dtype, and their gradients reduced in
    # it, as without slices; vectors (norm scales) in fp32.
    narrow = lambda g, lead: g.astype(reduce_dtype) if _is_matrix(g, lead) else g
    leads = layer_axes if layer_axes is not None else jax.tree.map(lambda _: 0, grads)
    grads = jax.tree.map(lambda g, lead: jax.lax.psum(narrow(g, lead), data).astype(g.dtype), grads, leads)
    return jax.lax.psum(total, data), jax.lax.psum(count, data), grads

  replicated = lambda tree: jax.tree.map(lambda _: P(), tree)
  run = jax.shard_map(local, in_specs=(replicated(params), jax.tree.map(lambda _: P(data), batch)),
                      out_specs=(P(), P(), replicated(params)), axis_names={data}, check_vma=False)
  return run(params, batch)


def _gathered_in_fp32(cfg: Config) -> bool:
  """Whether fsdp_gather = 'step' holds the gathered weights in fp32 (their
  values as cast): where the gradients would otherwise come back in the
  compute dtype before they are summed. The circular schedule's scan sums
  its micro-batches' in the weights' dtype; 1F1B sums them in fp32 but
  returns them in the weights' dtype, once per accumulation slice."""
  if not cfg.mesh.pipelined:
    return False
  return cfg.mesh.pipeline_schedule == 'circular' or cfg.train.grad_accum_steps > 1


_on = lambda dim: -1 if dim is None else dim   # (None is no pytree leaf)


def _axis_dim(spec: P, axis: str) -> Optional[int]:
  """The dimension `spec` splits over mesh axis `axis` (None if none)."""
  for i, entry in enumerate(spec):
    names = entry if isinstance(entry, tuple) else (entry,)
    if axis in names:
      if len(names) > 1:
        raise NotImplementedError(f'a parameter dimension split over {names}: MeshConfig.fsdp_gather '
                                  f"= 'step' gathers dimensions split over {axis!r} alone")
      return i
  return None


def _grad_sums_gathered(loss_sums, params, batch: Batch, k: int, *, param_specs, compute_dtype,
                        reduce_dtype, layer_axes, keep_fp32: bool, ordered: bool = False, forms=None):
  """`_grad_sums` with FSDP's weights gathered once for the whole step
  (MeshConfig.fsdp_gather = 'step'), returning the same sums.

  Every weight is cast to the compute dtype on its shards and gathered over
  `fsdp` once (norm scales and other vectors stay fp32). The step then runs
  manual over the axes that split the batch (data, fsdp): each device runs
  all its accumulation slices and pipeline micro-batches on the gathered
  copy and sums their gradients in fp32 on the device. The sums are
  reduce-scattered over `fsdp` once, in `reduce_dtype` (vectors fp32), and
  all-reduced over `data` on the shards. Left to GSPMD inside the slices'
  loop or the pipeline's scan, every slice and micro-batch gathers the
  weights again and reduce-scatters its own gradients (ZeRO-3): k times the
  traffic. Held gathered in fp32 (`keep_fp32`, values as cast) where the
  gradients would come back in the weights' dtype before they are summed
  (`_gathered_in_fp32`).

  The gather is GSPMD's and the reduction runs manual over every axis: a
  collective over `fsdp` inside a region manual over the batch axes only
  makes JAX gather its operand over the automatic axes (tensor) first.

  Args:
    param_specs: per param, its PartitionSpec.
    layer_axes: per param, its leading axes that index layers (a stacked
      vector is not a matrix).
    ordered: for XLA's CPU runtime, the gathers all before the first slice,
      and the slices one after another (`_sum_over_slices`).
    forms: per param, the form its sum over slices is kept in (`_gemm_forms`).
  """
  mesh = jax.sharding.get_abstract_mesh()
  forms = forms if forms is not None else jax.tree.map(lambda _: None, params)
  manual = tuple(a for a in mesh_axes('batch') if mesh.shape[a] > 1)
  rest = tuple(a for a in manual if a != 'fsdp')
  full = lambda spec, w: tuple(spec) + (None,) * (w.ndim - len(spec))
  fsdp_dims = jax.tree.map(lambda s: _on(_axis_dim(s, 'fsdp')), param_specs)
  # Each param's layout with `fsdp` taken out: what it is gathered to.
  gathered_specs = jax.tree.map(lambda s: P(*(None if e == 'fsdp' else e for e in s)), param_specs)
  sums = _sums_with_grads(loss_sums)

  def gather(w, lead, spec):
    g = jax.lax.with_sharding_constraint(w.astype(compute_dtype) if _is_matrix(w, lead) else w, spec)
    return g.astype(jnp.float32) if keep_fp32 and _is_matrix(w, lead) else g

  def local(p, b):
    # Held as gathered: without a barrier GSPMD moved the gather into the
    # forward and the backward each (1p3b, fsdp 8, no slices: twice the
    # gathers' bytes). One barrier per weight, so that each layer's gather
    # need only end before that layer's forward reads it, behind the
    # products of the layers before; on CPUs one over them all, so that
    # every gather ends before the first slice's collectives start
    # (`mjax.parallel.ordering`).
    p = jax.lax.optimization_barrier(p) if ordered else jax.tree.map(jax.lax.optimization_barrier, p)
    zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(lambda w, n: _gemm_zeros(w, n, jnp.float32), p, forms))
    # The first and last slices apart from the loop: the gathers run behind
    # the first slice's forward, and each layer's reduce-scatter can start
    # as the last slice's backward leaves the layer.
    with rules_without(*manual):
      total, count, grads = _sum_over_slices(sums, p, b, k, zeros, apart=True, ordered=ordered)
      grads = _in_shapes(grads, p)
    # Each device's sums leave stacked along a leading dim of one per batch
    # shard, rounded once to the dtype they are reduced in.
    narrow = lambda g, lead: (g.astype(reduce_dtype) if _is_matrix(g, lead) else g)[None]
    return jax.lax.psum(total, manual), jax.lax.psum(count, manual), jax.tree.map(narrow, grads, layer_axes)

  def reduce(g, dim):
    g = g[0]
    if dim < 0:   # not split over fsdp: one sum over every batch axis
      return jax.lax.psum(g, manual)
    g = jax.lax.psum_scatter(g, 'fsdp', scatter_dimension=dim, tiled=True)
    return jax.lax.psum(g, rest) if rest else g

  gathered = jax.tree.map(gather, params, layer_axes, gathered_specs)
  replicated = lambda tree: jax.tree.map(lambda _: P(), tree)
  stacked_specs = jax.tree.map(lambda s, w: P(manual, *full(s, w)), gathered_specs, params)
  run = jax.shard_map(local, in_specs=(replicated(params), jax.tree.map(lambda _: P(manual), batch)),
                      out_specs=(P(), P(), jax.tree.map(lambda _: P(manual), params)),
                      axis_names=set(manual), check_vma=False)
  total, count, partials = run(gathered, batch)
  grads = jax.shard_map(lambda t: jax.tree.map(reduce, t, fsdp_dims), in_specs=(stacked_specs,),
                        out_specs=param_specs, check_vma=False)(partials)
  return total, count, jax.tree.map(lambda g, w: g.astype(w.dtype), grads, params)


def _loss_sums_in_slices(loss_sums, params, batch: Batch, k: int):
  """(loss sum, token count) over the batch, in `k` sequential slices."""
  return _sum_over_slices(loss_sums, params, batch, k, (jnp.zeros(()), jnp.zeros(())))


def setup_compilation_cache(cache_dir: Optional[str]) -> None:
  """Persistent XLA cache: a restarted job reuses the compiled step."""
  if not cache_dir:
    return
  path = os.path.expanduser(cache_dir)
  try:
    os.makedirs(path, exist_ok=True)
    writable = os.access(path, os.W_OK | os.X_OK)
  except OSError:
    writable = False
  if not writable:
    # JAX would warn once per program it could not write, the reason buried
    # in each; a run is right without the cache, only its restarts compile.
    logging.getLogger('mjax').warning(
        'TrainConfig.compilation_cache_dir %r is not a directory this process can write: the compiled '
        'programs are not cached, so a restart compiles them again. Give a writable folder, or None.', cache_dir)
    return
  jax.config.update('jax_compilation_cache_dir', path)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)


def evaluate(program: Program, params, batches: Iterable[Batch],
             on_batch: Optional[Callable[[], None]] = None) -> tuple[float, int]:
  """(mean loss over every counted token of the global batches, number of
  those tokens): what the trainer logs as eval_loss and mjax-eval reports.
  `on_batch` is called as each batch's loss is computed (the trainer's
  heartbeats count them as progress), one batch behind the dispatch.

  `eval_step` gives each batch's mean over its counted tokens; weighting it
  by that count keeps the mean exact for any loss mask. (The pipeline's
  masks are all ones today, so every batch counts the same; a mask that
  drops tokens, such as a prompt masked out in fine-tuning data, would make
  a plain mean of the batch means weight a sparse batch's tokens more.)
  Tokens are counted in int32: a float32 sum of ones stops being exact past
  2^24, about the tokens of one large pre-training batch."""
  replicated = NamedSharding(program.mesh, P())
  count = _token_count(replicated)
  means, counts = [], []
  with program.context():
    for batch in batches:
      means.append(program.eval_step(params, batch))
      counts.append(count(batch['loss_mask']))
      if len(means) > 1:
        # One batch in flight behind the one waited for: the device stays
        # busy, and hundreds of batches are not queued at once (XLA:CPU
        # aborted the process at 437 batches over 8 devices).
        jax.block_until_ready(means[-2])
        if on_batch is not None:
          on_batch()
  means = np.asarray(jax.device_get(means), np.float64)
  counts = np.asarray(jax.device_get(counts), np.float64)
  tokens = float(counts.sum())
  return float((means * counts).sum() / max(tokens, 1.0)), int(round(tokens))


@functools.lru_cache(maxsize=8)   # one compiled count per mesh, not one per evaluation
def _token_count(out: NamedSharding) -> Callable[[jax.Array], jax.Array]:
  return jax.jit(lambda mask: jnp.sum(mask != 0, dtype=jnp.int32), out_shardings=out)
