"""The Trainer: everything stateful around the jitted Program (mjax/train.py).

  trainer = Trainer(cfg, workdir)   # program, state (resumed or fresh), data, compiled step
  summary = trainer.train()         # the loop; trainer.state is the final state

Building a Trainer goes through these phases, each timed for the start-up
report (MegaScale §5: start-up time is a measured number):
  setup     compilation cache, workdir checks, mesh
  program   model, optimizer, shardings, jitted init / step / eval
  state     resumed (checkpoint.resume decides from what) or initialized,
            directly sharded
  data      grain iterator feeding this host's share of each global batch
  compiled  the step compiled once, ahead of the loop; every process waits
            for the slowest

The loop itself is short because each concern owns its cadence:
  StepReporter    metrics one step behind (no device sync on the hot path),
                  written, shown, sent in heartbeats; a non-finite loss ends
                  the run (exit status 3, the driver rolls back)
  Checkpointer    `due(step)`: two tiers, asynchronous (mjax/checkpoint/)
  evaluation      every TrainConfig.eval_every steps, and at the end
  StopAgreement   SIGTERM / SIGINT: every process stops after the same step
                  (mjax/stop.py)
  StepGC          Python's garbage collection at the same steps in every
                  process, TrainConfig.gc_every_steps (mjax/ft/gc_control.py)
  PhaseTimer, HeartbeatClient   per-phase timings and heartbeats for the
                  fault-tolerance driver (mjax/ft/)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import threading
import time
import weakref
from typing import Optional

import jax
import numpy as np

from mjax import jsonfile
from mjax import checkpoint as checkpoint_lib
from mjax.checkpoint.checkpointer import held_bytes
from mjax.checkpoint.directories import RUN_ID_FILE
from mjax import config as config_lib
from mjax import data as data_lib
from mjax.data import sources as data_sources
from mjax import distributed, protocol
from mjax.config import Config, ConfigError
from mjax.devices import drop_cached_peak, memory_per_device, peak_flops
from mjax.errors import UserError
from mjax.ft.device_time import DeviceSampler
from mjax.ft.gc_control import StepGC
from mjax.ft.heartbeat import HeartbeatClient
from mjax.ft.inject import Injector
from mjax.ft.phases import PhaseTimer
from mjax.metrics import MetricsWriter, read_metrics
from mjax.model.flops import flops_per_token
from mjax.parallel import make_mesh, pipeline
from mjax.profiling import StepProfiler
from mjax.stop import StopAgreement, WorkdirWatch
from mjax.train import Program, evaluate, make_program, setup_compilation_cache
from mjax.workdir import Claim, check_workdir, forget_refused_start, recorded_tokenizer


# Step metrics that must be finite for the state after the step to be.
NONFINITE_CHECKED = ('loss', 'grad_norm', 'update_norm')


EARLY_STEPS = 10   # a NaN this soon after a fresh start points at the config (NonFiniteLoss)
STEADY_AFTER = 2   # the Summary's step time leaves out a run's first steps (warm-up)


class NonFiniteLoss(FloatingPointError):
  """The loss became NaN/Inf, or the gradient or update norm did (then the
  loss is still finite, but the updated state is not): exit status 3, the
  driver rolls back to the last checkpoint (which holds a finite state) and
  skips the data that led here."""

  def __init__(self, step: int, value: float, what: str = 'loss'):
    super().__init__(f'{what} is {value} at step {step}')
    self.step = step

  def resumes_from(self, saved: Optional[int], start: int, skipped: int, changed: tuple[str, ...] = ()) -> None:
    """Says what a restart by hand would replay: the batches between the
    newest checkpoint (`saved`; None: none this run could see, so where it
    started, `start`, having skipped `skipped` batches) and this step.
    `changed`: the settings this start changed from those of the step it
    resumed (`numerics_changes`)."""
    base = start if saved is None else saved
    # A checkpoint this run saved holds the data position past its skip; the
    # one it started from does not.
    n = self.step - base + (skipped if base == start else 0)
    where = f'the checkpoint of step {base}' if base else 'the start'
    # With the step the skip is counted from: a later start from a newer
    # checkpoint (saved past the skipped batches) must not skip again.
    # In a fresh run's first steps, the data is seldom what diverged: a
    # learning rate of 1e30 was told to skip batches, and nothing else.
    early = ('; this early in a fresh run the config is the likelier cause: check OptimConfig.learning_rate '
             'and warmup_steps, and ModelConfig.init_std') if base == 0 and self.step <= EARLY_STEPS else ''
    if changed and base == start and 0 < self.step - start <= EARLY_STEPS:
      # Likewise a few steps after a resume that changed the optimizer or
      # the model's function (a learning rate of 1e30 given on the restart):
      # skipping batches would drop good data, and diverge again.
      early = (f'; this early after a start that changed the config of step {start} ({"; ".join(changed)}), '
               f'the change is the likelier cause: resume with those settings as they were')
    self.args = (f'{self.args[0]}; a restart from {where} replays the {n} batch(es) that led here: '
                 f'TrainConfig.skip_batches = {n} with TrainConfig.skip_batches_after = {base} skips them '
                 f'(mjax-launch does so itself){early}',)


def numerics_changes(saved: dict, cfg: Config) -> tuple[str, ...]:
  """The optimizer settings, compute dtype and model function
  (config.MODEL_FUNCTION_KEYS) of `cfg` that differ from a saved step's
  config (`saved`, its meta's 'config'), as 'Section.key = then there, now
  now'."""
  optim, model = saved.get('optim') or {}, saved.get('model') or {}
  now = dataclasses.asdict(cfg.optim)
  out = [f'OptimConfig.{k} = {optim[k]!r} there, {now[k]!r} now' for k in now if k in optim and optim[k] != now[k]]
  if 'dtype' in model and model['dtype'] != cfg.model.dtype:
    out.append(f'ModelConfig.dtype = {model["dtype"]!r} there, {cfg.model.dtype!r} now')
  out += [f'ModelConfig.{k} = {was!r} there, {is_!r} now'
          for k, was, is_ in config_lib.model_function_changes(model, cfg.model)]
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Summary:
  """What a run did. Throughput counts steady steps only (the first ones after
  compilation warm caches and allocators)."""
  start_step: int
  final_step: int
  already_finished: bool = False   # nothing to do: the state was already at TrainConfig.steps
  preempted: bool = False          # stopped early by SIGTERM / SIGINT, checkpoint saved
  driver_lost: bool = False        # stopped early: the fault-tolerance driver went silent
  final_loss: float = math.nan
  eval_loss: float = math.nan
  step_time: float = math.nan
  tokens_per_sec: float = math.nan
  mfu: float = math.nan
  steps: int = 0                   # steps run by this call
  wall_s: float = math.nan
  compile_s: float = math.nan
  peak_flops: float = math.nan
  peak_source: str = ''
  flops_per_token: float = math.nan
  params: int = 0
  startup: Optional[dict] = None   # seconds to the first step, by phase


def run(cfg: Config, workdir: str, heartbeat: Optional[HeartbeatClient] = None,
        startup: Optional['StartupPhase'] = None) -> Summary:
  """Trains `cfg` in `workdir` (resuming from it when it holds checkpoints).
  `heartbeat` and `startup`: see `Trainer`."""
  return Trainer(cfg, workdir, heartbeat, startup).train()   # which frees the workdir however it ends


class StartupPhase:
  """What start-up is doing, as a heartbeat reads it (`current`, `step`,
  `ticks`, like the loop's PhaseTimer): the part that began at the
  trainer's last start-up mark (`Trainer._mark`)."""
  # In the order they come; 'startup:barrier' is the wait for every other
  # process's compile: one that missed the compilation cache holds the
  # others there, and the start-up timeout then names it by its phase.
  # 'startup:join' is joining the job (jax.distributed.initialize), where
  # mjax-train's heartbeats begin: a process stopped there is named by them.
  ORDER = ('startup:join', 'startup:mesh', 'startup:program', 'startup:restore', 'startup:data',
           'startup:compile', 'startup:barrier', 'startup:first_step')

  def __init__(self, current: str = 'startup:mesh'):
    self.current, self.step, self.ticks = current, None, None


class Trainer:
  """Builds everything a run needs, then `train()` runs the loop, once: a
  Trainer holds the data iterator, checkpointer and heartbeats of one run
  through its steps. To train on, build a new one (it resumes from the
  workdir's last checkpoint)."""

  def __init__(self, cfg: Config, workdir: str | os.PathLike, heartbeat: Optional[HeartbeatClient] = None,
               startup: Optional[StartupPhase] = None):
    """`heartbeat`: a client already beating (mjax-train starts one before
    joining the job), reporting `startup`; the Trainer takes it over and
    closes it. Default: one of its own, under mjax-launch."""
    # A Config of one's own (dataclasses.replace on a loaded one) gets the
    # checks a loaded one had, the mesh's against this job's devices, before
    # anything is written; a path object or ~ is a path like any other.
    cfg = config_lib.validate(cfg, num_devices=jax.device_count())
    workdir = os.path.expanduser(os.fspath(workdir))
    self.cfg, self.workdir = cfg, workdir
    self.is_main = jax.process_index() == 0
    # The config the run records (config.gin, checkpoints), which mjax-eval,
    # -generate and -export read: shards made with a tokenizer.json and
    # DataConfig.tokenizer left at 'bytes' name the shards' tokenizer there.
    # Process 0's alone is written; the others train on `cfg` as given.
    self.recorded = cfg
    if self.is_main:
      tokenizer, note = data_sources.shard_tokenizer(cfg.data)
      kept = recorded_tokenizer(workdir) if note is not None and cfg.data.tokenizer == 'bytes' else None
      if kept not in (None, 'bytes') and data_sources.names_shard_tokenizer(cfg.data, kept):
        # A resume while the shards' tokenizer.json is away: the run's
        # record keeps naming it (a start that found it wrote it there), not
        # 'bytes', under which mjax-eval and -generate read the ids as bytes.
        tokenizer, note = kept, f'{note} The run\'s config goes on naming {kept}, as it did.'
      if note is not None:
        print(f'mjax: warning: {note}', flush=True)
      self.recorded = dataclasses.replace(
          cfg, data=_absolute_paths(dataclasses.replace(cfg.data, tokenizer=tokenizer)),
          checkpoint=dataclasses.replace(cfg.checkpoint, **{
              k: os.path.abspath(os.path.expanduser(getattr(cfg.checkpoint, k)))
              for k in ('restore_from', 'init_from_hf') if getattr(cfg.checkpoint, k)}))
      from mjax.model import rotary_kernel
      for note in [*config_lib.doubtful(cfg, jax.device_count()), *rotary_kernel.doubtful(cfg, jax.device_count())]:
        print(f'mjax: warning: {note}', flush=True)
    self._t_start = time.perf_counter()
    self._marks: dict[str, float] = {}
    self.ckpt: Optional[checkpoint_lib.Checkpointer] = None
    self.heartbeat: Optional[HeartbeatClient] = None

    setup_compilation_cache(cfg.train.compilation_cache_dir)
    # flags.load checks it for the command line; a Trainer built from a
    # Config of one's own must not train on ids beyond the embedding (XLA's
    # gather does not fail: it makes NaNs, read as a numerical fault).
    data_sources.check_vocab(cfg.model, cfg.data)
    config_lib.check_for_training(cfg)
    made = self.is_main and not os.path.lexists(workdir)
    # This start's own run id (not one a run before it made): only that is
    # taken back after a refusal (`forget_refused_start`).
    new_id = self.is_main and not os.path.lexists(os.path.join(workdir, RUN_ID_FILE))
    self._run_record = check_workdir(cfg, workdir, self.is_main)   # the run's id, from process 0
    if protocol.under_driver():   # first, so that a job that fails below can still be shrunk
      protocol.Facts(workdir, jax.process_index()).record(protocol.DEVICES, jax.local_device_count())
    # Heartbeats from here on (under mjax-launch), not from the first step:
    # start-up (a restore from slow storage, a compile that missed the cache)
    # takes minutes at scale. The driver then sees which part of it each
    # process is in; a stopped process (or one whose interpreter is wedged)
    # is lost after heartbeat_timeout_s instead of the whole start-up
    # allowance; and a start-up timeout gets every process's Python stacks.
    self._startup = startup if startup is not None else StartupPhase()
    self._startup.current = 'startup:mesh'
    self._trained = self._closed = False
    self.skipped, self.skip_record = 0, None   # TrainConfig.skip_batches as this start applies it
    self.changed: tuple[str, ...] = ()   # the settings this start changed from the resumed step's (numerics_changes)
    self.final_eval_pending = False
    self.eval_pending = False
    self._claim = Claim(workdir)
    weakref.finalize(self, self._claim.release)
    try:
      self.heartbeat = (heartbeat if heartbeat is not None else
                        HeartbeatClient.from_env(self._startup, cfg.fault, jax.process_index()))
      self._build()
    except BaseException as e:   # the workdir is free again for this process's next run
      empty = []
      if isinstance(e, UserError) and new_id and self.ckpt is not None and jax.process_count() == 1:
        try:   # under the run lock still; never in place of the error being raised
          empty = forget_refused_start(cfg, workdir, self._run_record, made)
        except Exception:  # noqa: BLE001
          empty = []
      self.close()
      for d in empty:   # the lock's files gone with the lock: removed where empty
        with contextlib.suppress(OSError):
          os.rmdir(d)
      raise

  def _build(self) -> None:
    """`__init__` once heartbeats run: the program, then (under the run
    lock) the state, the data and the compiled step."""
    cfg, workdir = self.cfg, self.workdir
    self.mesh = make_mesh(cfg.mesh)
    self._mark('setup', then='startup:program')

    self.program: Program = make_program(cfg, self.mesh)
    devices = list(self.mesh.devices.flat)
    self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
    self.tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
    self.peak, self.peak_source = peak_flops(devices, cfg.model.dtype, cfg.train.peak_cache_dir)
    self.n_params = sum(int(np.prod(x.shape))
                        for x in jax.tree.leaves(self.program.abstract_state().params))
    self._describe(devices)
    self._check_state_fits(devices)
    self._mark('program', then='startup:restore')

    self.ckpt = (checkpoint_lib.Checkpointer(cfg.checkpoint, workdir, self._run_record)
                 if cfg.checkpoint.enabled else None)
    self._claim.ckpt = self.ckpt
    self._start(devices)

  def _start(self, devices: list) -> None:
    """`__init__` once the run lock is held: the state (resumed or fresh),
    the data and the compiled step."""
    cfg, workdir = self.cfg, self.workdir
    abstract = self.program.abstract_state(canonical=True)
    if self.ckpt is not None:
      state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
      for warning in self.ckpt.space_warnings(state_bytes, held_bytes(abstract)):
        print(f'mjax: warning: {warning}', flush=True)
    restored = checkpoint_lib.resume(self.ckpt, cfg.checkpoint, abstract, self.program.other_layouts(abstract))
    with self.program.context():
      if restored is not None:
        self.state = self.program.from_canonical(restored.state)
        self.say(f'mjax: resumed from {restored.path} (step {restored.step})')
      else:
        self.state = self.program.init(jax.random.key(cfg.train.seed))
        if cfg.checkpoint.init_from_hf:
          from mjax import hf   # transformers-free: config.json + safetensors
          self.state = self.program.with_params(self.state,
                                                hf.import_params(cfg.checkpoint.init_from_hf, cfg.model))
          self.say(f'mjax: weights from the Hugging Face model {cfg.checkpoint.init_from_hf}')
    self.start_step = int(self.state.step)
    self.restored_explicitly = restored is not None and restored.explicit
    # The length of the learning-rate schedule the saved state was trained
    # with (its decay_steps, else its steps): what to keep when training on.
    saved = (restored.meta.get('config') or {}) if restored is not None else {}
    self.schedule_steps = ((saved.get('optim') or {}).get('decay_steps') or
                           (saved.get('train') or {}).get('steps') or cfg.train.steps)
    if restored is not None and not restored.explicit:
      self._check_schedule(saved)
      self._check_seed(saved, restored.step)
    if restored is not None:
      self._check_model_function(saved, restored.step)
    self.changed = numerics_changes(saved, cfg) if restored is not None else ()
    # A run stopped in an evaluation (its step saved, its eval_loss never
    # written) takes that evaluation on its next start: else the restart
    # went on from the step after it (the final one: found the run
    # "finished") and the run's history never had it.
    eval_missing = self._eval_missing()
    self.final_eval_pending = self.finished and eval_missing
    self.eval_pending = not self.finished and eval_missing
    if self.final_eval_pending:
      self.eval_batches = self._eval_batch_list(*self.program.data_share())
    if self.finished:
      return   # nothing to train: no data (but the pending evaluation's), no compilation, nothing written
    self._mark('state', then='startup:data')

    share, shares = self.program.data_share()   # this process's block of every batch
    self.train_iter = self._train_iterator(restored.data if restored is not None else None, share, shares,
                                           restored.meta.get('skipped') if restored is not None else None)
    self.eval_batches = self._eval_batch_list(share, shares)
    self._mark('data', then='startup:compile')

    t0 = time.perf_counter()
    with self.program.context(), _cache_entries_from_every_process():
      self.step_fn = self.program.step.lower(self.program.abstract_state(),
                                             self.program.abstract_batch()).compile()
    self.compile_s = time.perf_counter() - t0
    self._check_step_fits(devices)
    # The run's config, once everything it names has been found to work:
    # a start that fails (data it cannot read, a step too large) leaves the
    # workdir's config that of the run whose checkpoints are there, which
    # mjax-eval, mjax-generate and mjax-export read.
    if self.is_main:
      config_lib.write(self.recorded, workdir)
    self._startup.current = 'startup:barrier'   # the report's compile_wait_s
    # Every process waits here for the slowest compile (one that missed the
    # compilation cache), so none sits in the first step's collectives long
    # enough for gloo's or NCCL's own timeout; the coordination service's wait
    # is bounded by the collective timeout the driver works under.
    distributed.barrier('compiled', cfg.fault.collective_timeout_s)
    self._mark('compiled', then='startup:first_step')
    self.say(f'mjax: train step compiled in {self.compile_s:.1f}s; '
             f'start-up {time.perf_counter() - self._t_start:.1f}s')

  @property
  def finished(self) -> bool:
    return self.start_step >= self.cfg.train.steps

  def _eval_missing(self) -> bool:
    """Whether this workdir's run stopped in the evaluation of the step it
    resumes at (TrainConfig.steps, or one of every TrainConfig.eval_every):
    resumed (not CheckpointConfig.restore_from) at exactly that step, with
    metrics that hold that step's loss but no eval_loss for it. Process 0
    reads the metrics; every process takes its answer."""
    steps, every, start = self.cfg.train.steps, self.cfg.train.eval_every, self.start_step
    if not (start == steps or (every and 0 < start < steps and start % every == 0)) or self.restored_explicitly:
      return False
    missing = '0'
    if self.is_main:
      try:
        rows = read_metrics(self.workdir, step=start)
      except OSError:
        rows = []
      missing = '1' if any('loss' in r for r in rows) and not any('eval_loss' in r for r in rows) else '0'
    if jax.process_count() > 1:
      missing = distributed.broadcast_str('eval/missing', missing)
    return missing == '1'

  def say(self, msg: str) -> None:
    if self.is_main:
      print(msg, flush=True)

  def _eval_batch_list(self, share: int, shares: int) -> list:
    """The held-out batches every evaluation of the run reads, as global arrays."""
    cfg = self.cfg
    return [self.program.to_global(b) for b in data_lib.make_eval_batches(
        cfg.data, cfg.train.global_batch_size, self._eval_batch_count(), process_index=share,
        process_count=shares)]

  def _eval_batch_count(self) -> int:
    """TrainConfig.eval_batches, or the whole batches the held-out split
    holds where that is fewer: beyond them its windows repeat, and eval_loss
    would count their tokens twice (mjax-eval stops there too)."""
    cfg = self.cfg
    want = cfg.train.eval_batches
    whole = data_lib.whole_batches(cfg.data, cfg.train.global_batch_size)
    if want > whole > 0:   # none at all: make_eval_batches says what is missing
      self.say(f'mjax: warning: the held-out split holds {whole} whole batch(es) of '
               f'{cfg.train.global_batch_size} x {cfg.data.seq_len} tokens; eval_loss is taken on those, '
               f'not on TrainConfig.eval_batches = {want} (beyond them its windows repeat). A larger '
               'DataConfig.heldout_fraction (mjax-prepare --heldout_fraction for shards) holds more.')
      return whole
    return want

  # --- the loop -------------------------------------------------------------------

  def train(self) -> Summary:
    """Trains from `start_step` to TrainConfig.steps, or until a stop signal."""
    start = self.start_step
    if self._trained or self._closed:
      # A second pass would train steps start+1.. again on the state the
      # first one left, past data, into a closed checkpointer and metrics
      # that already hold those steps; a closed Trainer holds no lock.
      raise UserError(
          f'Trainer.train() {"has run already" if self._trained else "after close()"} on this Trainer (from '
          f'step {start}, in {self.workdir}); a Trainer trains once. Build a new Trainer(cfg, workdir) to train '
          'on: it resumes from the last checkpoint (raise TrainConfig.steps for more steps).')
    self._trained = True
    try:
      summary = self._train()
    except Exception:   # its saves were completed on the way out (`_train`)
      self.close()
      raise
    except BaseException:
      # A second Ctrl-C in an interpreter that goes on (a notebook): out at
      # once, but the workdir stays held until the saves in flight are on
      # disk, or the next run would clean up a half-written step under them.
      self.close_heartbeat()
      threading.Thread(target=self._close_when_saved, name='mjax-trainer-close', daemon=True).start()
      raise
    if protocol.under_driver() and not summary.preempted:
      # Done: a stop recorded by an earlier start of this attempt's number
      # (another driver's job on this workdir) is not this one's.
      protocol.Facts(self.workdir, jax.process_index()).record(protocol.STOPPED, None)
    self.close()
    return summary

  def _final_evaluation(self) -> Summary:
    """The final evaluation a stop during it left undone (_eval_missing):
    taken on the saved last step and written as that step's eval_loss."""
    step = self.start_step
    self.say(f'mjax: this run trained to step {step} but stopped in its final evaluation, which it takes now')
    with self.program.context():
      eval_loss, _ = evaluate(self.program, self.state.params, self.eval_batches)
    writer = MetricsWriter(self.workdir, enabled=self.is_main, resume_step=step)
    writer.write(step, {'eval_loss': eval_loss})
    writer.close()
    if self.ckpt is not None:
      self.ckpt.close()
    self.close_heartbeat()
    self.say(f'mjax: done. eval_loss {eval_loss:.4f}')
    return Summary(start_step=step, final_step=step, eval_loss=eval_loss)

  def _close_when_saved(self) -> None:
    try:
      if self.ckpt is not None:
        self.ckpt.close()
    except Exception:  # noqa: BLE001 -- a save that failed leaves the earlier steps; nobody to tell
      pass
    finally:
      self.close()

  def _train(self) -> Summary:
    cfg, start = self.cfg, self.start_step
    if self.final_eval_pending:
      return self._final_evaluation()
    if self.finished:
      # Re-running a finished run: say so, and touch neither metrics nor checkpoints.
      where = (f'CheckpointConfig.restore_from is at step {start}' if self.restored_explicitly
               else f'this run already finished at step {start}')
      self.say(f'mjax: {where} (TrainConfig.steps = {cfg.train.steps}); nothing to do. '
               f'Raise TrainConfig.steps to train further'
               + (f' (and set OptimConfig.decay_steps = {self.schedule_steps} to keep the learning-rate '
                  f'schedule it was trained with: unset, it is rebuilt over the new length).'
                  if not cfg.optim.decay_steps else '.'))
      if self.ckpt is not None:
        self.ckpt.close()
      self.close_heartbeat()
      return Summary(start_step=start, final_step=start, already_finished=True)

    pid = jax.process_index()
    timer = PhaseTimer(self.workdir, pid, every=cfg.fault.timing_every, max_bytes=cfg.fault.timing_max_mib << 20)
    timer.current, timer.step = 'compute', start
    injector = Injector.from_env(pid)                          # test-only; None in production
    if injector is not None:
      injector.watch(timer)
    heartbeat = self.heartbeat                                 # None without mjax-launch
    reporter = StepReporter(self, heartbeat, injector)
    profiler = StepProfiler(cfg, self.workdir, start, self.step_fn.as_text)
    sampler = DeviceSampler.for_run(cfg.fault.device_timing_every, pid, self.mesh, start_step=start)
    # Which tokenizer made the ids this model learns: evaluation, generation
    # and export check theirs against it (a file edited or replaced since).
    meta = {'config': config_lib.to_dict(self.recorded),
            'tokenizer': data_sources.tokenizer_identity(cfg.data).to_json()}
    if self.skip_record:
      meta['skipped'] = self.skip_record
    try:
      return self._loop(timer, injector, heartbeat, reporter, profiler, sampler, meta)
    except Exception as e:
      # The bar ended on its own line first: the error and the warnings
      # below were printed onto the bar's last line (in a log, its \r
      # updates and the error run together).
      reporter.close_bar()
      # A NaN loss, a data file gone bad, any crash of the loop: the saves
      # still being written hold states that were good when they began (each
      # was checked finite first), and the newest of them is where a restart
      # or the driver's rollback resumes, so it is completed before the error
      # leaves. Cut off by the interpreter's exit instead, it was lost, and
      # Orbax's writer threads printed their tracebacks over the error. In
      # the checkpoint phase, as the heartbeats tell the driver.
      nonfinite = isinstance(e, NonFiniteLoss)
      if nonfinite:
        # Where a restart resumes, as this process sees its checkpoints (the
        # driver cannot list a host-local fast tier, and a rollback that
        # skipped from the one it can see dropped good batches): said as
        # the saves stand now, since the driver may stop this process while
        # the one in flight completes (left incomplete, it is not resumed
        # from), then again once it has.
        self._record_resume_from(reporter)
      if self.ckpt is not None and nonfinite:
        self.ckpt.leave_status = protocol.EXIT_NONFINITE   # a save failing now must not hide the NaN
      with timer.phase('checkpoint'):
        self._finish_saves()
      if nonfinite:
        e.resumes_from(self._record_resume_from(reporter), self.start_step, self.skipped, self.changed)
      raise

  def _record_resume_from(self, reporter: 'StepReporter') -> Optional[int]:
    """The newest complete checkpoint (`_newest_saved`), also in the
    NONFINITE fact for the driver as the step a restart resumes from."""
    saved = self._newest_saved()
    if reporter.facts is not None:
      found = reporter.facts.get(protocol.NONFINITE) or {}
      reporter.facts.record(protocol.NONFINITE, {**found, 'resume_from': saved if saved is not None
                                                 else self.start_step})
    return saved

  def _newest_saved(self) -> Optional[int]:
    """The newest complete checkpoint's step, once the saves are done."""
    try:
      return max((step for step, _ in self.ckpt.steps()), default=None) if self.ckpt is not None else None
    except Exception:  # noqa: BLE001 -- only for a message; the error leaving is the loop's
      return None

  def _finish_saves(self) -> None:
    """Completes the saves in flight after the loop failed; a save that
    fails too is reported, and the loop's error is the one that leaves."""
    if self.ckpt is None:
      return
    try:
      self.ckpt.close()
    except Exception as e:   # the save itself may be what failed
      print(f'mjax: warning: a checkpoint save in flight did not complete: {type(e).__name__}: '
            f'{str(e).splitlines()[0] if str(e) else ""}; the last committed checkpoint is kept',
            file=sys.stderr, flush=True)

  def _loop(self, timer: PhaseTimer, injector: Optional[Injector], heartbeat: Optional[HeartbeatClient],
            reporter: 'StepReporter', profiler: 'StepProfiler', sampler: DeviceSampler, meta: dict) -> Summary:
    """`train`'s steps, final save and evaluation."""
    cfg, program, start = self.cfg, self.program, self.start_step
    step = start
    with StopAgreement(heartbeat, WorkdirWatch(self.workdir)) as stop, profiler, sampler, injector or contextlib.nullcontext(), \
        StepGC(cfg.train.gc_every_steps) as collector:
      if heartbeat is not None:
        # Past start-up only now that SIGTERM saves: the driver's 'running'
        # event follows the first heartbeat of the loop's phases.
        heartbeat.follow(timer)
      if self.eval_pending:
        self.say(f'mjax: this run stopped in the evaluation of step {start}, which it takes now')
        with timer.phase('eval'):
          reporter.eval_loss(start, evaluate(program, self.state.params, self.eval_batches, timer.tick)[0])
      for step in range(start + 1, cfg.train.steps + 1):
        if injector is not None:
          injector.before_step(step)
        profiler.before(step)
        # A sampled step's trace (its start, and reading it back after the
        # step) is no training: left out of step_time, tokens/s and MFU as an
        # evaluation is. It fell in the sampled step's figures, ~5x its step
        # time on CPU, on a step that base.gin's log_every logs. The steps
        # either side are reported first; the sampler waits for them anyway.
        sampled = sampler.due(step) and not profiler.active
        with reporter.aside(sampled):
          sampler.before(step, self.state, profiling=profiler.active)
        with timer.phase('data'):
          batch = program.to_global(next(self.train_iter))
        with timer.phase('compute'):
          self.state, metrics = self.step_fn(self.state, batch)
          reporter.push(step, metrics)     # reads the previous step's metrics
          sampler.wait(self.state)         # a sampled step's trace must hold its device work
        with reporter.aside(sampled):
          device = sampler.collect()       # before a save, whose copies are not the step's
        if self.ckpt is not None and self.ckpt.due(step):
          # Only a state whose loss is known to be finite may become a
          # checkpoint (a NaN checkpoint would make every restart fail
          # again): this step's metrics first. Async: blocks only for the
          # device-to-host copy.
          with reporter.aside(), timer.phase('checkpoint'):   # in the timings, not the next step's time
            self._save(step, meta)
        if collector.due(step):            # the same steps in every process: the pauses line up
          with timer.phase('gc'):
            collector.collect()
        timer.end_step(step, device)
        profiler.after(step, self.state)
        if stop.agreed(step):
          break
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step != cfg.train.steps:
          reporter.flush()
          with timer.phase('eval'):
            reporter.eval_loss(step, evaluate(program, self.state.params, self.eval_batches, timer.tick)[0])
      reporter.flush()
      reporter.close_bar()
      # In the checkpoint phase, as the heartbeats tell: an agent whose driver
      # is gone lets a save finish (mjax/ft/agent.py).
      with timer.phase('checkpoint'):
        self._save(step, meta, force=True)   # skipped when this step is already saved
        if self.ckpt is not None:
          self.ckpt.close()                  # every save durable before we report or exit
      timer.close()
      self.close_heartbeat()               # tells the driver we are wrapping up

    # A stop agreed after the last step stops nothing: the run is complete,
    # and finishing it (the final evaluation) is what a restart would skip.
    if stop.stopped and step < cfg.train.steps and stop.reason == StopAgreement.WORKDIR_GONE:
      reporter.close()
      if self.is_main:
        config_lib.write(self.recorded, self.workdir)   # eval, generate and export read it
      where = (f'step {step} was saved in {self.ckpt.tiers[0].directory}, and the same command goes on '
               f'from it' if self.ckpt is not None and self.ckpt.tiers else 'nothing was saved (checkpoints are off)')
      raise UserError(f'the workdir {self.workdir} was deleted (or replaced) while the run trained; noticed after '
                      f'step {step}, the run stopped there. Its metrics, logs and config before then are gone; '
                      f'{where}.')
    if stop.stopped and step < cfg.train.steps:
      reporter.close()
      why = f'received {stop.name}' if stop.signal is not None else f'stopping: {stop.name}'
      self.say(f'mjax: {why} after step {step}: checkpoint saved, exiting cleanly')
      if protocol.under_driver() and not stop.driver_lost:
        # Exit status 0 says "done" too: the driver reads this to tell a
        # stop short of the last step (a signal to some trainer, not to it).
        # (A lost driver's stop exits 4: no such doubt.)
        protocol.Facts(self.workdir, jax.process_index()).record(protocol.STOPPED, {
            'step': step, 'signal': stop.name if stop.signal is not None else None, 'why': why})
      return self._summary(reporter, final_step=step, preempted=True, driver_lost=stop.driver_lost)
    eval_loss, _ = evaluate(program, self.state.params, self.eval_batches)
    reporter.eval_loss(cfg.train.steps, eval_loss, show=False)
    reporter.close()
    summary = self._summary(reporter, final_step=step, eval_loss=eval_loss)
    self.say(f'mjax: done. loss {summary.final_loss:.4f}, eval_loss {eval_loss:.4f}, '
             f'{summary.tokens_per_sec:,.0f} tokens/s, MFU {summary.mfu:.1%} '
             f'(peak {self.peak_source}), wall {summary.wall_s:.0f}s')
    return summary

  # --- parts ----------------------------------------------------------------------

  def _describe(self, devices: list) -> None:
    cfg = self.cfg
    self.say(f'mjax: {self.n_params / 1e6:.2f}M params, {self.flops_per_token / 1e6:.1f} MFLOP/token, '
             f'{self.tokens_per_step} tokens/step, mesh {dict(self.mesh.shape)} on {len(devices)} '
             f'{devices[0].platform} device(s)')
    self.say(f'mjax: peak {self.peak / 1e12:.3f} TFLOP/s ({self.peak_source})')
    if cfg.mesh.pipelined:
      p, v, m = self.mesh.shape['pipeline'], cfg.mesh.virtual_stages, cfg.mesh.num_microbatches()
      schedule = cfg.mesh.pipeline_schedule
      kept = (f'; 1F1B keeps at most {pipeline.in_flight_bound(p, v)} chunk inputs per stage (circular: {m * v})'
              if schedule == '1f1b' else '')
      self.say(f'mjax: pipeline {p} stages x {v} virtual, {m} micro-batches, {schedule} schedule: bubble '
               f'(p-1)/(v m) = {pipeline.bubble_fraction(p, v, m):.1%}{kept}')

  def _check_schedule(self, saved: dict) -> None:
    """Warns where a resumed run's learning-rate schedule is not the one it
    was trained with: with OptimConfig.decay_steps unset the cosine spans
    TrainConfig.steps, so raising the steps to train further (or leaving
    out the decay_steps the run was trained with) rebuilds the curve, and
    the rate jumps back up at once."""
    from mjax.optim import learning_rate_schedule
    cfg = self.cfg
    steps = (saved.get('train') or {}).get('steps')
    pinned = (saved.get('optim') or {}).get('decay_steps')
    # decay_steps 0 is unset too (TrainConfig.steps).
    before = pinned or steps
    if cfg.optim.decay_steps or not isinstance(before, int) or before == cfg.train.steps:
      return
    was = float(learning_rate_schedule(cfg.optim, before)(self.start_step))
    now = float(learning_rate_schedule(cfg.optim, cfg.train.steps)(self.start_step))
    if not math.isclose(was, now, rel_tol=1e-3, abs_tol=1e-12):
      then = (f'OptimConfig.decay_steps was {pinned} when step {self.start_step} was saved, and is unset now'
              if pinned else f'TrainConfig.steps is {cfg.train.steps} now, {before} when step '
              f'{self.start_step} was saved, and OptimConfig.decay_steps is unset')
      self.say(f'mjax: warning: {then}, so the learning-rate schedule is rebuilt over {cfg.train.steps} '
               f'steps: at step {self.start_step} the rate is {now:.3g} instead of {was:.3g}. Set '
               f'OptimConfig.decay_steps = {before} to go on with the schedule the run was trained with.')

  def _check_seed(self, saved: dict, step: int) -> None:
    """Says where a resumed run is given another TrainConfig.seed than it
    was started with: the seed only draws a fresh run's initial weights, so
    it changes nothing here. The run's config goes on recording the seed its
    weights were drawn with (a fresh run from its config.gin draws those)."""
    was = (saved.get('train') or {}).get('seed')
    if not isinstance(was, int) or was == self.cfg.train.seed:
      return
    self.say(f'mjax: warning: TrainConfig.seed = {self.cfg.train.seed}, but this run\'s weights were drawn with '
             f'seed {was} and step {step} goes on from them: the seed only initializes a fresh run\'s weights '
             f'(DataConfig.shuffle_seed orders the data), so it changes nothing here, and the run\'s config keeps '
             f'seed {was}. For a run from other initial weights, give a new --workdir.')
    if self.is_main:
      self.recorded = dataclasses.replace(self.recorded, train=dataclasses.replace(self.recorded.train, seed=was))

  def _check_model_function(self, saved: dict, step: int) -> None:
    """Warns where the resumed step was trained to compute another function
    than this config's model does (the shapes, which the checkpoint
    enforces, being the same): config.MODEL_FUNCTION_KEYS."""
    changed = config_lib.model_function_changes(saved.get('model') or {}, self.cfg.model)
    if changed:
      diff = ', '.join(f'ModelConfig.{k} = {was!r} there, {now!r} now' for k, was, now in changed)
      self.say(f'mjax: warning: step {step} was trained with another model function than this config '
               f'gives ({diff}). Training goes on with the new one; the run\'s config.gin is rewritten '
               f'with it, and evaluation, generation and export of this workdir use it. If that is not '
               f'meant, stop and resume with {config_lib.saved_model_overrides(changed)}.')

  def _check_state_fits(self, devices: list) -> None:
    """Refuses a train state that cannot fit the devices before anything is
    allocated (otherwise the run sits in initialization, or dies without a
    word, for a model orders of magnitude too large). Only what is certain
    counts: each device's shards of the parameters, the LAMB moments and
    the gradients; activations and XLA's temporaries come on top."""
    state = self.program.abstract_state()
    shardings = self.program.state_shardings
    shard = lambda x, s: math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
    held = sum(shard(x, s) for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)))
    grads = sum(shard(x, s) for x, s in zip(jax.tree.leaves(state.params), jax.tree.leaves(shardings.params)))
    have, source = memory_per_device(devices)
    if have and held + grads > have:
      raise ConfigError(
          f'the train state alone needs {(held + grads) / 2**30:,.1f} GiB per device (parameters, LAMB '
          f'moments and gradients of {self.n_params / 1e6:,.1f}M parameters on mesh {dict(self.mesh.shape)}), '
          f'more than the {have / 2**30:,.1f} GiB each device has ({source}): use more devices or shard '
          f'more (MeshConfig.fsdp, tensor, pipeline), or a smaller model; `mjax-train --print_config` '
          f'estimates the memory of a layout without starting it.')

  def _check_step_fits(self, devices: list) -> None:
    """Refuses a compiled step that cannot fit the devices, before its first
    run: XLA's buffer assignment knows the step's footprint (train state,
    batch, activations and temporaries) exactly, and a step over the
    device's memory would otherwise die in its first run with an
    allocator's traceback (a sequence length too long, a batch too large).
    Agreed by all processes, so none waits for one that refused."""
    from mjax.parallel.comm_report import memory_stats
    stats = memory_stats(self.step_fn)
    have, source = memory_per_device(devices)
    mine = None
    if stats and have and stats['total'] > have:
      cfg = self.cfg
      state = stats['argument_size_in_bytes'] + stats['output_size_in_bytes'] - stats['alias_size_in_bytes']
      mine = (
          f'the train step needs {_size(stats["total"])} per device ({_size(state)} of train state and '
          f'batch, {_size(stats["temp_size_in_bytes"])} of activations and temporaries, from XLA\'s '
          f'buffer assignment of the compiled step), more than the {_size(have)} each device has '
          f'({source}). Lower DataConfig.seq_len '
          f'({cfg.data.seq_len}) or TrainConfig.global_batch_size ({cfg.train.global_batch_size}), take '
          f'the batch in more slices (TrainConfig.grad_accum_steps = {cfg.train.grad_accum_steps}), '
          f'recompute more in the backward pass (ModelConfig.remat_policy = \'{cfg.model.remat_policy}\'; '
          f'\'full\' keeps least), or shard over more devices (MeshConfig); `mjax-train --print_config` '
          f'estimates the memory of a layout without starting it.')
    refused = distributed.report_exceptions('compiled/fits', mine, self.cfg.fault.collective_timeout_s)
    if refused:
      process, message = min(refused.items())
      raise ConfigError(message if jax.process_count() == 1 else f'process {process}: {message}')

  def _train_iterator(self, data_state: Optional[dict], share: int, shares: int,
                      skipped_before: Optional[dict] = None):
    """The training batches from the start position, past
    TrainConfig.skip_batches where it holds. `skipped_before`: the skip the
    checkpoint's data position already holds ({'batches', 'at_step'}: a
    run that started from `at_step` skipped that many), carried in every
    checkpoint saved since."""
    cfg = self.cfg
    it = data_lib.make_train_iterator(cfg.data, cfg.train.global_batch_size,
                                      process_index=share, process_count=shares)
    _check_same_data(it.fingerprint)
    if data_state:
      note = data_lib.restore_position(it, data_state, cfg.train.global_batch_size, cfg.data.seq_len)
      if note:
        self.say(f'mjax: {note}')
    if not data_state or int(data_state.get('seq_len', cfg.data.seq_len)) != cfg.data.seq_len:
      # The skip a checkpoint records is held by its data position: none
      # restored (restore_from with restore_data = False), or another
      # seq_len's order started from its beginning, holds no skip.
      skipped_before = None
    skip, after = cfg.train.skip_batches, cfg.train.skip_batches_after
    if skip and after is not None and after != self.start_step:
      self.say(f'mjax: TrainConfig.skip_batches = {skip} holds for a start from step {after} '
               f'(TrainConfig.skip_batches_after); this run starts from step {self.start_step}: nothing skipped')
      skip = 0
    elif skip and after is None and skipped_before and skipped_before.get('batches') == skip:
      # The same override given again on a later start (the same command,
      # or the run's own config.gin): the checkpoint holds the data position
      # past the batches skipped then, and skipping again drops good ones.
      self.say(f'mjax: TrainConfig.skip_batches = {skip}: the run that started from step '
               f'{skipped_before.get("at_step")} skipped these batches already, and the checkpoint of step '
               f'{self.start_step} holds its data position past them: nothing skipped. To skip {skip} more '
               f'from here, add TrainConfig.skip_batches_after = {self.start_step}')
      skip = 0
    self.skipped = skip
    # What this start's data position holds, recorded in its checkpoints.
    self.skip_record = {'batches': skip, 'at_step': self.start_step} if skip else skipped_before
    if skip:
      data_lib.skip(it, skip)
      self.say(f'mjax: skipped {skip} batches (TrainConfig.skip_batches)')
    return it

  def _save(self, step: int, meta: dict, force: bool = False) -> None:
    if self.ckpt is not None and (force or self.ckpt.due(step)):
      with self.program.context():
        self.ckpt.save(step, self.program.to_canonical(self.state),
                       data_lib.position(self.train_iter, self.cfg.train.global_batch_size, self.cfg.data.seq_len),
                       meta, force=force)

  def _mark(self, phase: str, then: str) -> None:
    """The end of a part of start-up (`startup_report`); heartbeats name
    the part that follows, `then`."""
    self._marks[phase] = time.perf_counter()
    self._startup.current = then

  def close_heartbeat(self) -> None:
    """The last heartbeat (the process is wrapping up); idempotent."""
    if self.heartbeat is not None:
      self.heartbeat.close()
      self.heartbeat = None

  def close(self) -> None:
    """Frees the workdir for another run, in this process or another: its
    lock and this process's claim; the heartbeats end. Idempotent;
    `train()` calls it as it ends (once its saves are on disk), however it
    ends."""
    self._closed = True
    self.close_heartbeat()
    if self.ckpt is not None and not self._trained:
      try:
        self.ckpt.close()   # nothing saved yet: its managers close at once
      except Exception:  # noqa: BLE001 -- the lock is released below either way
        pass
    self._claim.release()

  def __enter__(self) -> 'Trainer':
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def startup_report(self, first_step_done: float) -> dict:
    """Seconds spent getting to the first completed step, by part.
    `launch_to_first_step_s` counts from MJAX_LAUNCH_TIME (set by the
    launcher), so it includes interpreter start, imports and joining the job."""
    m = self._marks
    out = {
        'distributed_init_s': distributed.init_seconds(),
        'setup_s': m['setup'] - self._t_start,
        'program_s': m['program'] - m['setup'],
        'state_s': m['state'] - m['program'],
        'data_s': m['data'] - m['state'],
        'compile_s': self.compile_s,
        'compile_wait_s': m['compiled'] - m['data'] - self.compile_s,   # for the other processes
        'first_step_s': first_step_done - m['compiled'],
        'run_to_first_step_s': first_step_done - self._t_start,
    }
    launched = os.environ.get(distributed.LAUNCH_TIME)
    if launched:
      out['launch_to_first_step_s'] = time.time() - (time.perf_counter() - first_step_done) - float(launched)
    out = {k: round(v, 3) for k, v in out.items()}
    # The step this attempt started from: the driver's events then say where
    # a restart really resumed (older than the newest step when that one was
    # found damaged and moved aside).
    out['resumed_step'] = int(self.start_step)
    return out

  def _summary(self, reporter: 'StepReporter', final_step: int, **fields) -> Summary:
    dt = reporter.mean_step_time()
    mfu = self.flops_per_token * self.tokens_per_step / dt / self.peak
    # Faster than the peak: the cached figure was measured on busy cores. (A
    # job of several processes may span machines, each as fast as the one
    # measured: there MFU above 1 says nothing of the figure.)
    if mfu > 1 and self.peak_source.startswith('measured, cached') and jax.process_count() == 1 and \
        drop_cached_peak(self.mesh.devices.flat[0].platform, self.cfg.model.dtype, self.cfg.train.peak_cache_dir):
      self.say(f'mjax: this run went faster than the cached peak ({self.peak_source}), which was '
               f'measured while other work held the cores; it is forgotten, and the next run measures again')
    return Summary(
        start_step=self.start_step, final_step=final_step,
        final_loss=reporter.last_loss,
        step_time=dt, tokens_per_sec=self.tokens_per_step / dt,
        mfu=mfu, steps=reporter.steps,
        wall_s=time.perf_counter() - self._t_start, compile_s=self.compile_s,
        peak_flops=self.peak, peak_source=self.peak_source, flops_per_token=self.flops_per_token,
        params=self.n_params, startup=reporter.startup, **fields)


class StepReporter:
  """Metrics one step behind. The loop hands over each step's metrics while
  they are still on the device and the reporter reads the previous step's,
  so the host never waits for the step it has just dispatched. Reading a
  step's metrics writes them (metrics.jsonl, TensorBoard), updates the
  progress bar, tells the heartbeat, and stops the run on a non-finite loss;
  the first one also completes the start-up report."""

  def __init__(self, trainer: Trainer, heartbeat: Optional[HeartbeatClient], injector: Optional[Injector]):
    from tqdm import tqdm
    cfg = trainer.cfg
    self.trainer, self.heartbeat, self.injector = trainer, heartbeat, injector
    self.log_every, self.last_step = cfg.train.log_every, cfg.train.steps
    self.writer = MetricsWriter(trainer.workdir, enabled=trainer.is_main, resume_step=trainer.start_step,
                                wandb_project=cfg.train.wandb_project,
                                config=config_lib.to_dict(cfg) if cfg.train.wandb_project else None)
    self.bar = tqdm(total=cfg.train.steps, initial=trainer.start_step, unit='step', dynamic_ncols=True,
                    smoothing=0.1, mininterval=0.5, disable=not (cfg.train.progress and trainer.is_main))
    # Facts for the fault-tolerance driver (mjax/protocol.py), when there is one.
    self.facts = protocol.Facts(trainer.workdir, jax.process_index()) if protocol.under_driver() else None
    # What the run's Summary needs, kept as running figures: lists of every
    # step's time and loss grew by 64 bytes a step (64 MB a process over a
    # million steps).
    self.steps = 0                 # steps reported
    self.last_loss = math.nan
    self._last_time = math.nan
    self._steady = [0.0, 0]        # sum and count of the step times after the first STEADY_AFTER
    self.startup: Optional[dict] = None
    self._pending: Optional[tuple[int, dict]] = None
    self._t_last = time.perf_counter()

  def push(self, step: int, metrics: dict) -> None:
    """Takes `step`'s metrics (on device) and reports the step before it."""
    previous, self._pending = self._pending, (step, metrics)
    if previous is not None:
      self._report(*previous)

  def flush(self) -> None:
    """Reports the pending step now (before a checkpoint, an evaluation, the end)."""
    if self._pending is not None:
      previous, self._pending = self._pending, None
      self._report(*previous)

  def eval_loss(self, step: int, loss: float, show: bool = True) -> None:
    self.writer.write(step, {'eval_loss': loss})
    if show:
      if self.bar.disable:
        self.trainer.say(f'mjax: step {step}: eval_loss {loss:.4f}')
      else:
        self.bar.write(f'step {step}: eval_loss {loss:.4f}')
    self.not_step_time()

  @contextlib.contextmanager
  def aside(self, on: bool = True):
    """What runs inside (a save's blocking part, a device-time sample) is
    no step's time: the pending step is reported first, and the time spent
    inside left out of the next (`not_step_time`). `on` False: a no-op."""
    if on:
      self.flush()
    yield
    if on:
      self.not_step_time()

  def not_step_time(self) -> None:
    """What ran since the last report (an evaluation, a save's blocking
    part) is left out of the next step's time, so that step_time, tokens/s
    and MFU describe training steps only (the per-rank timings keep each
    phase, checkpoint and eval included)."""
    self._t_last = time.perf_counter()

  def _report(self, step: int, metrics: dict) -> None:
    m = jax.device_get(metrics)           # waits for that step only
    now = time.perf_counter()
    if self.startup is None:
      self.startup = self.trainer.startup_report(now)
      self.trainer.say('mjax: startup ' + json.dumps(self.startup))
      if self.facts is not None:
        self.facts.record(protocol.STARTUP, self.startup)
    dt, self._t_last = now - self._t_last, now
    t = self.trainer
    tps = t.tokens_per_step / dt
    rec = {k: float(v) for k, v in m.items()}
    if self.injector is not None:
      self.injector.after_step(step, rec)
    rec.update(step_time=dt, tokens_per_sec=tps, mfu=t.flops_per_token * tps / t.peak)
    self.steps += 1
    self.last_loss, self._last_time = rec['loss'], dt
    if self.steps > STEADY_AFTER:
      self._steady[0] += dt
      self._steady[1] += 1
    if self.heartbeat is not None:
      self.heartbeat.report_step(step, rec['loss'], dt)
    # An overflowing gradient leaves this step's loss finite (it is the loss
    # before the update) but makes the clip factor 0 and the update 0 x inf
    # = NaN: the state after this step must not become a checkpoint either.
    bad = next((k for k in NONFINITE_CHECKED if k in rec and not np.isfinite(rec[k])), None)
    if bad is not None:
      if self.facts is not None:
        self.facts.record(protocol.NONFINITE, {'step': step, 'loss': str(rec['loss']), 'what': bad})
      raise NonFiniteLoss(step, rec[bad], bad)
    if step % self.log_every == 0 or step == self.last_step:
      self.writer.write(step, rec)
    self.bar.set_postfix(loss=f'{rec["loss"]:.3f}', tok_s=f'{tps:,.0f}', mfu=f'{rec["mfu"]:.1%}', refresh=False)
    self.bar.update(1)

  def close_bar(self) -> None:
    self.bar.close()

  def mean_step_time(self) -> float:
    """The mean time of the steps after the first STEADY_AFTER (which
    include warm-up), else the last step's; NaN before any step."""
    total, n = self._steady
    return total / n if n else self._last_time

  def close(self) -> None:
    self.writer.close()


@contextlib.contextmanager
def _cache_entries_from_every_process():
  """Lets every process write the compiled step to the persistent cache.

  jax writes cache entries from process 0 only. On GPU that is enough: it
  keys an entry without the device assignment, so every process finds
  process 0's. On CPU the key holds each process's own devices, so every
  other process missed and compiled in full on each restart (6.3 s of a 21 s
  recovery, bench/RESULTS.md). Each CPU process writing its own entry (a key
  of its own, so no contention) lets it hit next time. jax decides who
  writes by `distributed.global_state.process_id`, read when the entry is
  written; binary sharing between hosts, which reads it too, is a GPU
  option left off here.
  """
  from jax._src import distributed as jax_distributed
  state = jax_distributed.global_state
  if (jax.process_count() == 1 or jax.devices()[0].platform != 'cpu' or not hasattr(state, 'process_id')
      or jax.config.jax_share_binary_between_hosts):
    yield
    return
  saved, state.process_id = state.process_id, 0
  try:
    yield
  finally:
    state.process_id = saved


def _size(nbytes: float) -> str:
  return f'{nbytes / 2**30:,.1f} GiB' if nbytes >= 2**30 else f'{nbytes / 2**20:,.1f} MiB'


def _absolute_paths(data: config_lib.DataConfig) -> config_lib.DataConfig:
  """The data config with its sources and tokenizer file as absolute paths,
  for the run's recorded config: relative ones named other data (or none)
  for mjax-eval, -generate and a resume started from another directory."""
  def path(p: str) -> str:
    # (A path with a comma cannot stand in a mixture: such a one stays as given.)
    full = p if p == 'stdlib' else os.path.abspath(os.path.expanduser(p))
    return p if ',' in full else full
  mixture = data.mixture
  if mixture is not None:
    mixture = ','.join(f'{path(src)}:{w!r}' for src, w in data.source_weights())
  tokenizer = data.tokenizer
  if tokenizer != 'bytes' and os.path.exists(os.path.expanduser(tokenizer)):
    tokenizer = path(tokenizer)
  source = path(data.source)
  return dataclasses.replace(data, source=source, mixture=mixture, tokenizer=tokenizer)


def _check_same_data(fingerprint: dict) -> None:
  """Raises DataError, in every process alike, unless all processes see the
  same data: each builds the whole order itself and reads its rows of it,
  so hosts that see other files (a directory still being written to, shard
  copies of other versions) would mix rows of different orders into every
  batch without an error."""
  if jax.process_count() == 1:
    return
  first = jsonfile.loads(distributed.broadcast_str('data/fingerprint', json.dumps(fingerprint)))
  # By content: hosts may mount the same data at other paths. The held-out
  # split too: evaluation batches are built alike from it, and processes with
  # other held-out data mix rows of two orders (or, of other sizes, run other
  # numbers of evaluation steps and wait for each other in a collective).
  parts = [what for key, what in (('content', 'train data'), ('heldout', 'held-out data'))
           if first.get(key) != fingerprint.get(key)]
  mine = json.dumps({'sources': fingerprint['sources'], 'parts': parts}) if parts else None
  differ = distributed.report_exceptions('data/fingerprint/differs', mine)
  if differ:
    from mjax.data.errors import DataError
    theirs = jsonfile.loads(next(iter(differ.values())))
    raise DataError(
        f'the processes of this job see different data ({" and ".join(theirs["parts"])}): process 0 has '
        f'{first["sources"]}, process(es) {sorted(differ)} have {theirs["sources"]} (files, tokens or tokenizer '
        f'of a source differ; with the same config, the hosts see other files). Each process reads its rows of '
        f'one order that all must build alike: give every host the same data, complete, before the job starts.')
