"""Training: sharded state, the jitted step, the loop, evaluation.

`run(cfg, workdir)` goes through these phases, marked below:
  1. set-up     compilation cache, mesh, config written to the workdir
  2. program    model, optimizer, shardings, jitted init / step / eval
  3. state      created directly sharded: eval_shape -> shardings -> jit(init)
  4. data       grain iterator feeding this host's share of each global batch
  5. compile    the step compiled once, ahead of the loop (timed)
  6. loop       step, metrics one step behind (no device sync on the hot path),
                periodic held-out evaluation
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import signal
import threading
import time
from typing import Any, Callable, Iterator, Optional

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mjax import config as config_lib
from mjax import data as data_lib
from mjax import distributed
from mjax.checkpoint import Checkpointer, check_same_model, restore_from_path, write_problem
from mjax.ft.heartbeat import HeartbeatClient
from mjax.ft.inject import Injector
from mjax.config import Config
from mjax.metrics import MetricsWriter, PhaseTimer, peak_flops
from mjax.model import Transformer
from mjax.model.transformer import LayerGroup, remat
from mjax.model.flops import flops_per_token
from mjax.optim import make_optimizer
from mjax.parallel import logical_rules, make_mesh, pipeline

log = logging.getLogger('mjax')

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
  model: Transformer
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  state_shardings: TrainState
  batch_shardings: dict[str, NamedSharding]
  init: Callable[[jax.Array], TrainState]
  step: Callable[[TrainState, Batch], tuple[TrainState, dict]]
  eval_step: Callable[[Any, Batch], jax.Array]
  rules: tuple
  canonical_shardings: TrainState             # the layout checkpoints are written in
  to_canonical: Callable[[TrainState], TrainState]
  from_canonical: Callable[[TrainState], TrainState]

  def context(self):
    """Mesh + logical rules: needed whenever the model is traced."""
    import contextlib
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
    with self.context():
      shapes = jax.eval_shape(self.init, jax.random.key(0))
      if canonical:
        shapes = jax.eval_shape(self.to_canonical, shapes)
    shardings = self.canonical_shardings if canonical else self.state_shardings
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, shardings)

  def canonical_params(self, params):
    """Params in the layout every mesh shares (layers stacked in order)."""
    if not self.cfg.mesh.pipelined:
      return params
    return {**params, 'layers': pipeline.from_pipeline_layout(params['layers'])}

  def to_global(self, local: dict[str, np.ndarray]) -> Batch:
    """This host's rows -> one global array per key (MegaScale's one loader
    per machine: each host reads only its own share of the batch)."""
    shape = (self.cfg.train.global_batch_size, self.cfg.data.seq_len)
    return {k: jax.make_array_from_process_local_data(self.batch_shardings[k], np.asarray(v), shape)
            for k, v in local.items()}


def make_program(cfg: Config, mesh: Mesh) -> Program:
  """Builds the model, optimizer, shardings and jitted functions (no arrays)."""
  model = Transformer(cfg.model)
  rules = logical_rules(cfg.mesh)
  dummy = jnp.zeros((1, cfg.data.seq_len), jnp.int32)
  replicated = NamedSharding(mesh, P())
  pipe = cfg.mesh.pipelined
  stages = cfg.mesh.pipeline * cfg.mesh.dcn_pipeline
  repeats = cfg.mesh.virtual_stages
  is_box = lambda x: isinstance(x, nn.Partitioned)

  def init_params(rng: jax.Array):
    params = nn.meta.unbox(model.init(rng, dummy)['params'])
    if pipe:  # each pipeline stage holds its own chunks of layers
      params = {**params, 'layers': pipeline.to_pipeline_layout(params['layers'], stages, repeats)}
    return params

  # Shapes and logical names of every parameter, without allocating any.
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), dummy))['params']
    abstract_params = jax.eval_shape(init_params, jax.random.key(0))
  is_names = lambda x: isinstance(x, tuple)
  canonical_names = jax.tree.map(lambda b: b.names, boxed, is_leaf=is_box)
  names = canonical_names
  if pipe:
    names = {**names, 'layers': jax.tree.map(pipeline.pipeline_names, names['layers'], is_leaf=is_names)}
  # LAMB's trust ratio is per layer: tell it how many leading axes index layers.
  layer_axes = jax.tree.map(lambda n: n.index('layers') + 1 if 'layers' in n else 0,
                            names, is_leaf=is_names)
  tx, schedule = make_optimizer(cfg.optim, cfg.train.steps, layer_axes)

  def shardings_for(names_tree, params_shapes) -> TrainState:
    param_shardings = jax.tree.map(lambda n: nn.logical_to_mesh_sharding(P(*n), mesh, rules),
                                   names_tree, is_leaf=is_names)
    # The optimizer moments mirror the params, so they take the params'
    # shardings (ZeRO: optimizer state sharded exactly like the weights);
    # counters are replicated.
    opt_shardings = optax.tree_map_params(
        tx, lambda _, s: s, jax.eval_shape(tx.init, params_shapes), param_shardings,
        transform_non_params=lambda _: replicated)
    return TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)

  state_shardings = shardings_for(names, abstract_params)
  param_shardings = state_shardings.params
  # Checkpoints hold the layout every mesh shares (layers stacked in order), so
  # that a run can resume on any other layout.
  canonical_shardings = (shardings_for(canonical_names, nn.meta.unbox(boxed)) if pipe
                         else state_shardings)

  def relayout(state: TrainState, leaf_fn) -> TrainState:
    fn = lambda w, lead: leaf_fn(w) if lead == 3 else w
    return TrainState(step=state.step, params=jax.tree.map(fn, state.params, layer_axes),
                      opt_state=optax.tree_map_params(tx, fn, state.opt_state, layer_axes))

  to_canonical = lambda st: relayout(st, lambda w: w.reshape(-1, *w.shape[3:]))
  from_canonical = lambda st: relayout(st, lambda w: w.reshape(repeats, stages, -1, *w.shape[1:]))
  row = nn.logical_to_mesh_sharding(P('batch', 'seq'), mesh, rules)
  batch_shardings = {k: row for k in batch_keys(cfg)}

  def init(rng: jax.Array) -> TrainState:
    params = init_params(rng)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

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
    """(sum of token losses, number of counted tokens): sums, not a mean, so
    that micro-batches and accumulation slices add up to the exact batch mean."""
    logits = forward(params, batch)                               # (batch, seq, vocab) fp32
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch['targets'])
    return jnp.sum(nll * batch['loss_mask']), jnp.sum(batch['loss_mask'])

  def eval_loss(params, batch: Batch) -> jax.Array:
    total, count = loss_sums(params, batch)
    return total / jnp.maximum(count, 1.0)

  def grads_of(params, batch: Batch):
    k = cfg.train.grad_accum_steps
    grad_fn = jax.value_and_grad(loss_sums, has_aux=True)
    if k == 1:
      (total, count), grads = grad_fn(params, batch)
      return total, count, grads
    # Strided slices (rows i, i + k, ...) keep every slice spread over the
    # data-parallel shards; fp32 sums across slices, one division at the end.
    slices = jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)

    def body(acc, sl):
      (total, count), g = grad_fn(params, sl)
      return jax.tree.map(jnp.add, acc, (total, count, g)), None

    zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
    return jax.lax.scan(body, zeros, slices)[0]

  def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
    total, count, grads = grads_of(state.params, batch)
    count = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: g / count, grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {'loss': total / count, 'grad_norm': optax.tree.norm(grads),
               'update_norm': optax.tree.norm(updates), 'lr': schedule(state.step)}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return Program(
      cfg=cfg, mesh=mesh, model=model, tx=tx, schedule=schedule,
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
  )


def setup_compilation_cache(cache_dir: Optional[str]) -> None:
  """Persistent XLA cache: a restarted job reuses the compiled step."""
  if not cache_dir:
    return
  jax.config.update('jax_compilation_cache_dir', os.path.expanduser(cache_dir))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)


def evaluate(program: Program, params, batches: list[Batch]) -> float:
  with program.context():
    losses = [program.eval_step(params, b) for b in batches]
  return float(np.mean(jax.device_get(losses)))


def _progress(cfg: Config, start: int, enabled: bool):
  from tqdm import tqdm
  return tqdm(total=cfg.train.steps, initial=start, disable=not enabled, unit='step',
              dynamic_ncols=True, smoothing=0.1, mininterval=0.5)


def run(cfg: Config, workdir: str) -> dict:
  """Trains `cfg` in `workdir`; returns a summary of the run.

  Returns:
    dict with final train/eval loss, mean tokens/s, MFU and timings.
  """
  # --- 1. set-up -------------------------------------------------------------
  t_start = time.perf_counter()
  setup_compilation_cache(cfg.train.compilation_cache_dir)
  is_main = jax.process_index() == 0
  _check_workdir(cfg, workdir, is_main)
  mesh = make_mesh(cfg.mesh)
  devices = list(mesh.devices.flat)
  say = lambda msg: print(msg, flush=True) if is_main else None

  marks = {'setup': time.perf_counter()}
  # --- 2. program --------------------------------------------------------------
  program = make_program(cfg, mesh)
  fpt = flops_per_token(cfg.model, cfg.data.seq_len)
  peak, peak_source = peak_flops(devices, cfg.model.dtype, cfg.train.peak_cache_dir)
  tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(program.abstract_state().params))
  say(f'mjax: {n_params / 1e6:.2f}M params, {fpt / 1e6:.1f} MFLOP/token, '
      f'{tokens_per_step} tokens/step, mesh {dict(mesh.shape)} on {len(devices)} '
      f'{devices[0].platform} device(s)')
  say(f'mjax: peak {peak / 1e12:.3f} TFLOP/s ({peak_source})')
  if cfg.mesh.pipelined:
    p, v, m = mesh.shape['pipeline'], cfg.mesh.virtual_stages, cfg.mesh.num_microbatches()
    say(f'mjax: pipeline {p} stages x {v} virtual, {m} micro-batches: bubble (p-1)/(v m) = '
        f'{pipeline.bubble_fraction(p, v, m):.1%}')

  marks['program'] = time.perf_counter()
  # --- 3. state: resume (see mjax/checkpoint.py for the rules) or initialize --
  ckpt = Checkpointer(cfg.checkpoint, workdir) if cfg.checkpoint.enabled else None
  restored = ckpt.restore_latest(program.abstract_state(canonical=True)) if ckpt else None
  explicit = restored is None and bool(cfg.checkpoint.restore_from)
  if explicit:
    restored = restore_from_path(cfg.checkpoint.restore_from, program.abstract_state(canonical=True))
    if not cfg.checkpoint.restore_data:
      restored.data = None
  with program.context():
    if restored is not None:
      state = program.from_canonical(restored.state)
      say(f'mjax: resumed from {restored.path} (step {restored.step})')
    else:
      state = program.init(jax.random.key(cfg.train.seed))
  start_step = int(state.step)
  if start_step >= cfg.train.steps:
    # Re-running a finished run: say so, and touch neither metrics nor checkpoints.
    where = (f'CheckpointConfig.restore_from is at step {start_step}' if explicit
             else f'this run already finished at step {start_step}')
    say(f'mjax: {where} (TrainConfig.steps = {cfg.train.steps}); nothing to do. '
        f'Raise TrainConfig.steps to train further.')
    if ckpt is not None:
      ckpt.close()
    return {'start_step': start_step, 'final_step': start_step, 'already_finished': True, 'state': state}
  if is_main:   # after the finished-run check: re-running a finished run rewrites nothing
    config_lib.write(cfg, workdir)

  marks['state'] = time.perf_counter()
  # --- 4. data -----------------------------------------------------------------
  pid, nproc = jax.process_index(), jax.process_count()
  train_iter = data_lib.make_train_iterator(cfg.data, cfg.train.global_batch_size,
                                            process_index=pid, process_count=nproc)
  if restored is not None and restored.data:
    train_iter.set_state(restored.data)   # continue exactly where the data stopped
  # Fault tolerance: after a NaN / loss-spike rollback the driver
  # (mjax/ft/driver.py) skips the batches between the checkpoint and the bad
  # step, so the restart does not replay them. Unset: nothing skipped.
  skip = int(os.environ.get('MJAX_SKIP_DATA_STEPS', '0') or 0)
  for _ in range(skip):
    next(train_iter)
  if skip:
    say(f'mjax: skipped {skip} batches (MJAX_SKIP_DATA_STEPS, after a rollback)')
  eval_batches = [program.to_global(b) for b in data_lib.make_eval_batches(
      cfg.data, cfg.train.global_batch_size, cfg.train.eval_batches,
      process_index=pid, process_count=nproc)]

  marks['data'] = time.perf_counter()
  # --- 5. compile --------------------------------------------------------------
  t0 = time.perf_counter()
  with program.context():
    step_fn = program.step.lower(program.abstract_state(), program.abstract_batch()).compile()
  compile_s = time.perf_counter() - t0
  # Every process waits here for the slowest compile (one that missed the
  # compilation cache), so none sits in the first step's collectives long
  # enough for gloo's or NCCL's own timeout; the coordination service's wait
  # is bounded by the collective timeout the driver works under.
  distributed.barrier('compiled', cfg.fault.collective_timeout_s)
  marks['compiled'] = time.perf_counter()
  say(f'mjax: train step compiled in {compile_s:.1f}s; start-up {time.perf_counter() - t_start:.1f}s')

  # --- 6. loop -----------------------------------------------------------------
  writer = MetricsWriter(workdir, enabled=is_main, resume_step=start_step)
  bar = _progress(cfg, start_step, cfg.train.progress and is_main)
  summary: dict[str, Any] = {'compile_s': compile_s, 'peak_flops': peak, 'peak_source': peak_source,
                             'flops_per_token': fpt, 'params': n_params, 'start_step': start_step}
  times, losses = [], []
  pending = None  # (step, metrics on device)
  t_last = time.perf_counter()
  meta = {'config': config_lib.to_dict(cfg)}

  def finish(step: int, metrics: dict) -> None:
    nonlocal t_last
    m = jax.device_get(metrics)          # waits for that step only
    now = time.perf_counter()
    if 'startup' not in summary:
      summary['startup'] = _startup_report(marks, t_start, compile_s, now)
      say('mjax: startup ' + json.dumps(summary['startup']))
    dt, t_last = now - t_last, now
    tps = tokens_per_step / dt
    rec = {k: float(v) for k, v in m.items()}
    if injector is not None:
      rec['loss'] = injector.after_step(step, rec['loss'])
    rec.update(step_time=dt, tokens_per_sec=tps, mfu=fpt * tps / peak)
    times.append(dt)
    losses.append(rec['loss'])
    if heartbeat is not None:    # fault tolerance: step, loss, time to the driver
      heartbeat.report_step(step, rec['loss'], dt)
    if not np.isfinite(rec['loss']):
      raise NonFiniteLoss(step, rec['loss'])
    if step % cfg.train.log_every == 0 or step == cfg.train.steps:
      writer.write(step, rec)
    bar.set_postfix(loss=f'{rec["loss"]:.3f}', tok_s=f'{tps:,.0f}', mfu=f'{rec["mfu"]:.1%}', refresh=False)
    bar.update(1)

  def save(step: int, force: bool = False) -> None:
    if ckpt is not None and (force or ckpt.due(step)):
      with program.context():
        ckpt.save(step, program.to_canonical(state), train_iter.get_state(), meta, force=force)

  step = start_step
  timer = PhaseTimer(workdir, pid, every=cfg.fault.timing_every)
  timer.current, timer.step = 'compute', start_step
  injector = Injector.from_env(pid)          # test-only; None in production
  heartbeat = HeartbeatClient.from_env(timer, cfg.fault, pid)  # fault tolerance; None without mjax-launch
  with _StopOnSignal() as stop:
    for step in range(start_step + 1, cfg.train.steps + 1):
      if injector is not None:
        injector.before_step(step)
      with timer.phase('data'):
        batch = program.to_global(next(train_iter))
      with timer.phase('compute'):
        state, metrics = step_fn(state, batch)
        if pending is not None:
          finish(*pending)
      pending = (step, metrics)
      if ckpt is not None and ckpt.due(step):
        # Only a state whose loss is known to be finite may become a checkpoint
        # (a NaN checkpoint would make every restart fail again): wait for this
        # step's metrics, then save. Async: blocks only for the device-to-host
        # copy, then training goes on.
        finish(*pending)
        pending = None
        with timer.phase('checkpoint'):
          save(step)
      timer.end_step(step)
      if stop.agreed(step):
        break
      if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step != cfg.train.steps:
        if pending is not None:
          finish(*pending)
          pending = None
        with timer.phase('eval'):
          eval_loss = evaluate(program, state.params, eval_batches)
        writer.write(step, {'eval_loss': eval_loss})
        bar.write(f'step {step}: eval_loss {eval_loss:.4f}') if not bar.disable else say(
            f'mjax: step {step}: eval_loss {eval_loss:.4f}')
        t_last = time.perf_counter()  # evaluation time is not step time
    if pending is not None:
      finish(*pending)
    bar.close()
    save(step, force=True)      # skipped when this step is already saved
    if ckpt is not None:
      ckpt.close()              # every save durable before we report or exit
    timer.close()
    if heartbeat is not None:    # fault tolerance: tells the driver we are wrapping up
      heartbeat.close()

  if stop.stopped:
    writer.close()
    say(f'mjax: received {stop.name} after step {step}: checkpoint saved, exiting cleanly')
    summary.update(preempted=True, final_step=step, state=state)
    return summary
  eval_loss = evaluate(program, state.params, eval_batches)
  writer.write(cfg.train.steps, {'eval_loss': eval_loss})
  writer.close()
  # The first steps after compilation warm caches and allocators; report the rest.
  steady = times[min(len(times) - 1, 2):] if times else []
  mean_dt = float(np.mean(steady)) if steady else float('nan')
  summary.update(
      final_loss=losses[-1] if losses else float('nan'), eval_loss=eval_loss,
      step_time=mean_dt, tokens_per_sec=tokens_per_step / mean_dt,
      mfu=fpt * tokens_per_step / mean_dt / peak, steps=len(times), final_step=step,
      wall_s=time.perf_counter() - t_start, preempted=False)
  say(f'mjax: done. loss {summary["final_loss"]:.4f}, eval_loss {eval_loss:.4f}, '
      f'{summary["tokens_per_sec"]:,.0f} tokens/s, MFU {summary["mfu"]:.1%} '
      f'(peak {peak_source}), wall {summary["wall_s"]:.0f}s')
  summary['state'] = state
  return summary


def _check_workdir(cfg: Config, workdir: str, is_main: bool) -> None:
  """Process 0 checks the workdir (writable; no checkpoints of another model)
  and every process raises the same ConfigError, so none is left waiting in
  the next collective."""
  verdict = ''
  if is_main:
    problem = write_problem(workdir)
    try:
      if problem:
        raise config_lib.ConfigError(
            f'--workdir {workdir!r} cannot be written: {problem}. The workdir holds the config, '
            f'metrics and (by default) the checkpoints: give a directory you can write, or a new path.')
      check_same_model(cfg, workdir)
    except config_lib.ConfigError as e:
      verdict = str(e)
  if jax.process_count() > 1:
    verdict = distributed.all_gather_str('workdir/verdict', verdict, cfg.fault.collective_timeout_s)[0]
  if verdict:
    raise config_lib.ConfigError(verdict)


def _startup_report(marks: dict, t_start: float, compile_s: float, first_step_done: float) -> dict:
  """Seconds spent getting to the first completed step, by part (MegaScale
  §5: start-up time is a measured number). `launch_to_first_step_s` counts
  from MJAX_LAUNCH_TIME (set by the launcher) and so includes interpreter
  start, imports and distributed initialization."""
  out = {
      'distributed_init_s': distributed.init_seconds(),
      'setup_s': marks['setup'] - t_start,
      'program_s': marks['program'] - marks['setup'],
      'state_s': marks['state'] - marks['program'],
      'data_s': marks['data'] - marks['state'],
      'compile_s': compile_s,
      'compile_wait_s': marks['compiled'] - marks['data'] - compile_s,   # for the other processes
      'first_step_s': first_step_done - marks['compiled'],
      'run_to_first_step_s': first_step_done - t_start,
  }
  launched = os.environ.get('MJAX_LAUNCH_TIME')
  if launched:
    out['launch_to_first_step_s'] = time.time() - (time.perf_counter() - first_step_done) - float(launched)
  return {k: round(v, 3) for k, v in out.items()}


class NonFiniteLoss(FloatingPointError):
  """The loss became NaN/Inf: the driver rolls back to the last checkpoint."""

  def __init__(self, step: int, loss: float):
    super().__init__(f'loss is {loss} at step {step}')
    self.step = step


class _StopOnSignal:
  """SIGTERM / SIGINT (pre-emption, Ctrl-C) ask the loop to finish the step,
  save and exit 0. A second signal gets the default behaviour (kill now)."""

  # A few steps ahead of the step the first signalled process has reached:
  # each step's collectives keep the processes within a step or two of each
  # other, so none can have passed it yet.
  MARGIN = 2
  KEY = 'mjax/stop/after_step'

  def __init__(self):
    self.signal = None
    self._old = {}
    self._stop_after: Optional[int] = None
    self.stopped = False     # the loop was left early, in every process alike

  @property
  def name(self) -> str:
    return signal.Signals(self.signal).name if self.signal is not None else 'a stop request'

  def agreed(self, step: int) -> bool:
    """Whether to stop after `step`. One process: once signalled. Several:
    after the same step in every process, since a signal reaches them between
    different steps, and a process that stops alone leaves the others waiting
    in the next step's collectives forever. The first process signalled
    proposes a step through the coordination service; all read it."""
    self.stopped = self._agreed(step)
    return self.stopped

  def _agreed(self, step: int) -> bool:
    if jax.process_count() == 1:
      return self.signal is not None
    client = distributed.coordination_client()
    if self._stop_after is None:
      if self.signal is not None:
        try:
          client.key_value_set(self.KEY, str(step + self.MARGIN))
        except Exception:  # another process proposed first: theirs stands
          pass
      found = dict(client.key_value_dir_get(self.KEY.rsplit('/', 1)[0]))
      if found:
        self._stop_after = int(next(iter(found.values())))
    return self._stop_after is not None and step >= self._stop_after

  def _handle(self, signum, frame):
    if self.signal is not None:
      signal.signal(signum, self._old.get(signum, signal.SIG_DFL))
      signal.raise_signal(signum)
    self.signal = signum

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)
    return False
