"""mjax-eval: the loss of a saved checkpoint on any data, on any mesh.

  mjax-eval --workdir runs/tiny                          # newest readable step, held-out split
  mjax-eval --workdir runs/tiny --step 200 --batches 64 --split train
  mjax-eval --workdir runs/tiny --gin.DataConfig.source=/data/other --gin.MeshConfig.tensor=2
  mjax-eval --checkpoint /ckpt/run7/checkpoints/1200    # config saved with the checkpoint

The config is the run's own (`<workdir>/config.gin`, every resolved value),
then the command line's gin files and overrides: another data source or
another mesh is one override away, since checkpoints hold the layout every
mesh shares and restoring reshards. Without --workdir the config comes from
--gin_file, or else from the one saved in the checkpoint.

Only the parameters are read (a partial restore: no optimizer moments, a
third of the train state) and checked against the checksums saved with
them. Nothing in the run's directories is written, moved or cleaned up, so
a run may be evaluated while it trains.

The loss is the exact token-weighted mean over every counted token of the
batches. The result is one JSON document (`make_report`), printed by process 0;
progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import time
from typing import Any, Iterable, Optional, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from mjax import jsonfile
from mjax import config as config_lib
from mjax import data as data_lib
from mjax import distributed, flags
from mjax.checkpoint.directories import foreign, is_step_dir, saved_steps, steps_in, tier_directories
from mjax.checkpoint.failures import quiet_failed_io_aftermath, read_error
from mjax.checkpoint.integrity import FINGERPRINTS, first_mismatch, step_json
from mjax.config import Config, ConfigError
from mjax.data.tokenizer import BYTES
from mjax.errors import UserError
from mjax.parallel import make_mesh
from mjax.train import Program, TrainState, evaluate, make_program, setup_compilation_cache

PROG = 'mjax-eval'
SPLITS = ('heldout', 'train')
BYTES_NOTE = ('bits_per_byte = bits_per_token: the byte tokenizer makes one token of each UTF-8 '
              'byte, and the EOS token that ends each document counts as one byte too.')


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A saved step that may be evaluated."""
  step: int
  path: str
  tier: Optional[str]   # 'persistent' or 'fast' in a run's workdir; None: an explicit --checkpoint


@dataclasses.dataclass(frozen=True)
class Choice:
  """The steps to try, newest first, and what to say when none of them can be read."""
  candidates: list[Candidate]
  explicit: bool        # --step or a step directory: no falling back to an older step
  where: str            # the run or directory, for messages
  available: str        # every saved step, for messages


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog=PROG,
      description='Loss, perplexity and bits per token (per byte with the byte tokenizer) of a saved '
                  'checkpoint, as one JSON document on stdout; progress on stderr.',
      epilog='Overrides: --gin.DataConfig.source=/other/data, --gin.MeshConfig.tensor=2, '
             '--gin_param="TrainConfig.global_batch_size = 64" (repeatable, applied after the '
             'config, last one wins).')
  add_checkpoint_args(p, 'evaluate')
  p.add_argument('--split', choices=SPLITS, default='heldout',
                 help='held-out batches in order (default), or the train stream from its start')
  p.add_argument('--batches', type=int, default=None,
                 help='global batches to evaluate (default: TrainConfig.eval_batches)')
  return p


def add_checkpoint_args(p: argparse.ArgumentParser, verb: str) -> None:
  """The flags that choose a config and a saved step (mjax-eval, -generate, -export)."""
  p.add_argument('--workdir', help="an mjax-train run: its config.gin is the config and its "
                 "checkpoints (both tiers) the ones to choose from")
  p.add_argument('--step', type=int, help=f'the saved step to {verb} (default: the newest readable one)')
  p.add_argument('--checkpoint', help='a step directory (.../checkpoints/120) or a directory of steps '
                 '(its newest readable one), instead of a run\'s own checkpoints')
  p.add_argument('--gin_file', action='append', default=[],
                 help='gin file applied after the run\'s config.gin, repeatable; without --workdir it '
                      'is the config (default there: the config saved with the checkpoint)')
  p.add_argument('--gin_param', action='append', default=[],
                 help="gin binding, e.g. 'MeshConfig.tensor = 2'")


def parse_checkpoint_args(p: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
  """`flags.parse` for a parser with `add_checkpoint_args`: one of --workdir / --checkpoint is needed."""
  args, bindings = flags.parse(p, argv)
  if not args.workdir and not args.checkpoint:
    p.error('needs --workdir RUN or --checkpoint PATH')
  return args, bindings


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
  p = parser()
  args, bindings = parse_checkpoint_args(p, argv)
  if args.batches is not None and args.batches < 1:
    p.error(f'--batches {args.batches}: must be at least 1')
  return args, bindings


# A mesh of one data axis over every device: what a tool that reads a
# checkpoint runs on where the run's own mesh does not fit its devices.
ALL_DATA = ('MeshConfig.data = -1', 'MeshConfig.fsdp = 1', 'MeshConfig.tensor = 1', 'MeshConfig.pipeline = 1',
            'MeshConfig.virtual_stages = 1', 'MeshConfig.microbatches = 0', 'MeshConfig.dcn_data = 1',
            'MeshConfig.dcn_fsdp = 1', 'MeshConfig.dcn_tensor = 1', 'MeshConfig.dcn_pipeline = 1',
            "MeshConfig.pipeline_schedule = 'circular'")


def setup_on_these_devices(files: Sequence[str], saved: Sequence[str], bindings: Sequence[str],
                           prog: str = PROG) -> Config:
  """flags.setup for a tool that reads a run's checkpoint: on the run's mesh
  where it fits this job's devices. Where it does not (trained on 8 GPUs,
  evaluated on one) and the command line names no mesh, data-parallel over
  the devices there are, with a note: a checkpoint loads on any mesh."""
  try:
    return flags.setup(files, [*saved, *bindings])
  except ConfigError as e:
    said = str(e).split(' is not allowed', 1)[0]   # 'MeshConfig = {...}', or one of its multi-slice keys
    # (Or a width the mesh here cannot split: the run's fsdp = -1 over other devices.)
    layout = said.startswith('MeshConfig') or any(w in str(e) for w in ('tensor-parallel size', 'FSDP size'))
    if not layout or any(b.replace(' ', '').startswith('MeshConfig.') for b in bindings):
      raise
  n = jax.device_count()
  say(f'{prog}: the run\'s {said} does not fit the {n} device(s) here: running data-parallel on them instead '
      f'(a checkpoint loads on any mesh; --gin.MeshConfig.* sets another)')
  return flags.load(files, [*saved, *bindings, *ALL_DATA], num_devices=n)


def main(args: argparse.Namespace, bindings: Sequence[str]) -> Optional[dict]:
  """Evaluates what `args` name; the report in process 0, None in the others.

  Raises:
    UserError: a bad config, data source or checkpoint (exit status 2).
  """
  t0 = time.perf_counter()
  files, saved = config_sources(args)
  cfg = setup_on_these_devices(files, saved, bindings)
  setup_compilation_cache(cfg.train.compilation_cache_dir)
  choice = choose(args, cfg)
  mesh = make_mesh(cfg.mesh)
  program = make_program(cfg, mesh)
  # Asked for or TrainConfig.eval_batches, no more than the split's whole
  # batches: the trainer's own eval stops there too, and the default must
  # equal its eval_loss.
  n = _whole_batches(cfg, args.batches or cfg.train.eval_batches, args.split)
  batches = make_batches(cfg, args.split, n, program.data_share())   # data errors before the checkpoint is read
  picked, params, verified, skipped = restore(program, choice)
  changed = tokenizer_change(picked.path, cfg)
  if changed:
    say(f'{PROG}: warning: {changed}; the loss below is of that other tokenization.')
  changed = model_function_change(picked.path, cfg)
  if changed:
    say(f'{PROG}: warning: {changed}; the loss below is of the config\'s model function.')
  if args.split == 'heldout':
    changed = heldout_change(picked.path, cfg)
    if changed:
      say(f'{PROG}: warning: {changed}')
  trained = trained_seq_len(picked.path)
  if trained is not None and cfg.data.seq_len > trained:
    say(f'{PROG}: note: DataConfig.seq_len = {cfg.data.seq_len} is longer than the {trained} step '
        f'{picked.step} was trained on; positions past that are extrapolated.')
  say(f'{PROG}: step {picked.step} from {picked.path} '
      f'({"checksums verified" if verified else "saved without checksums"}); '
      f'{n} {args.split} batches of {cfg.train.global_batch_size} x {cfg.data.seq_len} tokens '
      f'on mesh {dict(mesh.shape)}')
  loss, tokens = token_mean_loss(program, params, batches)
  report = make_report(cfg, program, picked, verified, skipped, args.split, n, loss, tokens,
                       time.perf_counter() - t0)
  say(f'{PROG}: loss {loss:.4f} over {tokens:,} tokens, {report["seconds"]:.1f}s')
  return report if jax.process_index() == 0 else None


def tokenizer_change(step_dir: str, cfg: Config) -> Optional[str]:
  """What differs between the tokenizer a step was trained with (its meta
  record) and the one the config names now, or None (the same, or a step
  saved before steps recorded it)."""
  from mjax.data.tokenizer import TokenizerInfo
  try:
    saved = step_json(step_dir, 'meta/metadata').get('tokenizer')
    then = TokenizerInfo(**saved)
  except Exception:  # noqa: BLE001 -- no record (an older step) or not one: nothing to compare
    return None
  from mjax.data.sources import tokenizer_identity
  now = tokenizer_identity(cfg.data)
  if now.same_as(then):
    return None
  return (f'DataConfig.tokenizer is {now.describe()}, but step {os.path.basename(step_dir.rstrip("/"))} was trained '
          f'with {then.describe()}: the same ids would stand for other text')


def model_function_change(step_dir: str, cfg: Config) -> Optional[str]:
  """What differs between the model function a step was trained with (its
  meta record's config.MODEL_FUNCTION_KEYS) and the config's, or None."""
  try:
    saved = step_json(step_dir, 'meta/metadata')['config']['model']
  except Exception:  # noqa: BLE001 -- no record, or not one: nothing to compare
    return None
  changed = config_lib.model_function_changes(saved if isinstance(saved, dict) else {}, cfg.model)
  if not changed:
    return None
  return (f'step {os.path.basename(step_dir.rstrip("/"))} was trained with ' +
          ', '.join(f'ModelConfig.{k} = {was!r}' for k, was, _ in changed) + ', and this config has ' +
          ', '.join(f'{now!r}' for _, _, now in changed) +
          f' (to use it as trained: {config_lib.saved_model_overrides(changed)})')


def heldout_change(step_dir: str, cfg: Config) -> Optional[str]:
  """What differs between the held-out data now and the held-out data of the
  run that saved the step (its data position names it), or None: the same,
  or a step saved before positions named it."""
  try:
    saved = step_json(step_dir, 'data/metadata', record=False).get('data_heldout')
  except Exception:  # noqa: BLE001 -- no record, or not one: nothing to compare
    return None
  if not isinstance(saved, str):
    return None
  from mjax.data import pipeline
  if pipeline.fingerprint(cfg.data, data_lib.load_sources(cfg.data))['heldout'] == saved:
    return None
  return ('the held-out data is not what the run that saved this step held out (a held-out file edited, '
          'added or removed, another heldout_fraction or tokenizer): this loss is not comparable with the '
          'run\'s eval_loss')


def trained_seq_len(step_dir: str) -> Optional[int]:
  """The sequence length a step was trained with (its meta record), or None."""
  try:
    found = step_json(step_dir, 'meta/metadata')['config']['data']['seq_len']
  except Exception:  # noqa: BLE001 -- no record, or not one: nothing to compare
    return None
  return found if isinstance(found, int) else None


def say(msg: str) -> None:
  if jax.process_index() == 0:
    print(msg, file=sys.stderr, flush=True)


# --- config ---------------------------------------------------------------------

def config_sources(args: argparse.Namespace) -> tuple[list[str], list[str]]:
  """(gin files, bindings before the command line's) of the config to evaluate with."""
  if args.workdir:
    run_gin = os.path.join(args.workdir, 'config.gin')
    if not os.path.isdir(args.workdir):
      what = 'is not a directory' if os.path.exists(args.workdir) else 'does not exist'
      raise UserError(f'--workdir {args.workdir!r} {what}: give the workdir of an mjax-train run, or '
                      f'{_checkpoint_advice(None)}.')
    if not os.path.isfile(run_gin):
      raise UserError(f'--workdir {args.workdir!r} has no config.gin: give the workdir of an mjax-train '
                      f'run, or {_checkpoint_advice(args.workdir)}.')
    return [run_gin, *args.gin_file], []
  if args.gin_file:
    return list(args.gin_file), []
  return [], saved_bindings(_meta_path(args))


def _checkpoint_advice(workdir: Optional[str]) -> str:
  """How to evaluate a checkpoint without a run's config.gin: --checkpoint
  alone (the config saved with it), naming the newest step of `workdir`'s
  checkpoints/ where it has one."""
  try:
    steps = steps_in(os.path.join(workdir, 'checkpoints')) if workdir else []
  except OSError:   # an unreadable directory: the plain advice
    steps = []
  if steps:
    where = os.path.join(workdir, 'checkpoints', str(steps[0]))
    return (f'--checkpoint {where} on its own (its newest saved step, of {_list_steps(steps)}; the config '
            f'saved with it is used, no --gin_file needed)')
  return ('--checkpoint PATH on its own, PATH a saved step (.../checkpoints/120): the config saved with it is '
          'used (--gin_file only to give another)')


def _meta_path(args: argparse.Namespace) -> str:
  """The step directory whose saved config stands for --checkpoint's."""
  path = _checked_dir(args.checkpoint)
  if is_step_dir(path):
    return path
  steps = steps_in(path)
  step = args.step if args.step is not None else (steps[0] if steps else None)
  if step is None or step not in steps:
    hint = ''
    if os.path.isfile(os.path.join(path, 'config.gin')):
      hint = ' It is an mjax-train run directory: give it as --workdir (its config.gin and both checkpoint tiers).'
    raise UserError(_missing(f'--checkpoint {path!r}', args.step, _list_steps(steps)) + hint)
  if args.step is None:
    # The newest step whose config can be read: a damaged newer step is
    # skipped when the params are read (`restore`), so its record must not
    # stop the choice of config before that, as --workdir's config.gin does not.
    for s in steps:
      try:
        saved_bindings(os.path.join(path, str(s)))
        return os.path.join(path, str(s))
      except UserError:
        continue
  return os.path.join(path, str(step))


def saved_bindings(step_dir: str) -> list[str]:
  """The config a checkpoint was saved with, as gin bindings."""
  try:
    saved = jsonfile.loads((epath.Path(step_dir) / 'meta' / 'metadata').read_text())['config']
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise UserError(f'checkpoint {step_dir!r} holds no readable config ({type(e).__name__}): give the '
                    f'config with --gin_file (or the run with --workdir).') from None
  return [f'{cls.__name__}.{key} = {value!r}'
          for name, cls in config_lib.SECTIONS.items() for key, value in saved.get(name, {}).items()]


# --- which checkpoint -------------------------------------------------------------

def choose(args: argparse.Namespace, cfg: Config) -> Choice:
  """The steps `args` allow, newest first.

  Raises:
    UserError: the step or directory asked for does not exist; the message lists what does.
  """
  explicit = args.step is not None
  if not args.checkpoint:
    found = [Candidate(step, path, tier) for step, tier, path in saved_steps(cfg.checkpoint, args.workdir)]
    available = _list_tiers(cfg, args.workdir, found)
    where = f'--workdir {args.workdir!r}'
  else:
    path = _checked_dir(args.checkpoint)
    if is_step_dir(path):
      step = int(os.path.basename(path.rstrip('/')))
      if args.step is not None and args.step != step:
        raise UserError(f'--checkpoint {path!r} is step {step} but --step is {args.step}: give one of them, '
                        f'or --checkpoint the directory that holds the steps.')
      return Choice([Candidate(step, path, None)], True, f'--checkpoint {path!r}', str(step))
    found = [Candidate(s, os.path.join(path, str(s)), None) for s in steps_in(path)]
    available = _list_steps([c.step for c in found])
    where = f'--checkpoint {path!r}'
  if explicit:
    found = [c for c in found if c.step == args.step]
  if not found:
    raise UserError(_missing(where, args.step, available))
  # Every process must try the same steps in the same order.
  mine = json.dumps([dataclasses.astuple(c) for c in found])
  agreed = jsonfile.loads(distributed.broadcast_str('eval/candidates', mine))
  return Choice([Candidate(*c) for c in agreed], explicit, where, available)


def _checked_dir(path: str) -> str:
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isdir(path):
    raise UserError(f'--checkpoint {path!r}: no such directory; give a run\'s checkpoints/ directory '
                    f'or one of its step folders.')
  return path


def _list_steps(steps: Sequence[int]) -> str:
  return ', '.join(map(str, steps)) if steps else 'none'


def _list_tiers(cfg: Config, workdir: str, found: Sequence[Candidate]) -> str:
  """Saved steps per tier, e.g. 'persistent tier (/run/checkpoints): 8, 4; fast tier (/dev/shm/..): none'.
  A tier of another run's (checkpoint.directories.foreign) is said to be, with how to read it anyway."""
  def steps(tier: str, d: str) -> str:
    other = foreign(d, workdir)
    if other is not None:
      return f"another run's (workdir {other}), not this one's; read it with --checkpoint {d}"
    return _list_steps([c.step for c in found if c.tier == tier])
  return '; '.join(f'{tier} tier ({d}): {steps(tier, d)}' for tier, d in tier_directories(cfg.checkpoint, workdir).items())


def _missing(where: str, step: Optional[int], available: str) -> str:
  if step is None:
    return f'{where} holds no saved checkpoint (saved steps: {available}).'
  return f'{where} has no checkpoint of --step {step}; saved steps: {available}.'


# --- restoring ------------------------------------------------------------------

class Damaged(Exception):
  """A restored array whose bits differ from those saved."""


class OtherModel(Exception):
  """The checkpoint holds params of other names or shapes than the config makes."""


# Marks an OtherModel verdict among the processes' reports: no older step of
# the same run can help, so it ends the search at once.
_OTHER_MODEL = 'other model: '


def restore(program: Program, choice: Choice, prog: str = PROG) -> tuple[Candidate, Any, bool, list[dict]]:
  """The params of the newest candidate every process reads intact (a
  step skipped is said under `prog`, the tool's name).

  Returns:
    (the step used, its params in the program's layout, whether checksums
    were checked, [{step, path, error}] of the newer steps skipped).
  Raises:
    UserError: no candidate can be read, or the config describes another model.
  """
  skipped: list[dict] = []
  quiet_failed_io_aftermath()   # a damaged step's failed reads, said once
  for i, cand in enumerate(choice.candidates):
    params, verified, error = None, False, None
    try:
      params, verified = read_params(program, cand.path)
    except OtherModel as e:
      error = _OTHER_MODEL + str(e)
    except Exception as e:  # any reason a step cannot be used: report it, try the next
      error = read_error(e)[:300]
    # A step one process cannot read is skipped by all: they must evaluate the same one.
    verdicts = distributed.report_exceptions(f'eval/restore/{i}', error, program.cfg.checkpoint.io_timeout_s)
    if not verdicts:
      return cand, params, verified, skipped
    params = None
    other = next((v for v in verdicts.values() if v.startswith(_OTHER_MODEL)), None)
    if other is not None:
      raise UserError(
          f'{choice.where}: step {cand.step} ({cand.path}) was saved from another model than the config '
          f'describes: {other[len(_OTHER_MODEL):]}. Run {prog} with the config it was trained with: the '
          f'run\'s config.gin (--workdir) or, with --checkpoint and no --gin_file, the config saved in '
          f'the checkpoint; overrides may change the data and the mesh, not ModelConfig shapes.')
    skipped.append({'step': cand.step, 'path': cand.path,
                    'error': error or f'unreadable in process(es) {sorted(verdicts)}'})
    say(f'{prog}: step {cand.step} ({cand.path}) cannot be used: {skipped[-1]["error"]}')
  errors = '; '.join(f'step {s["step"]} at {s["path"]}: {s["error"]}' for s in skipped)
  what = 'that checkpoint cannot be read' if choice.explicit else 'no saved checkpoint can be read'
  raise UserError(f'{choice.where}: {what} ({errors}). Saved steps: {choice.available}.')


def read_params(program: Program, step_dir: str) -> tuple[Any, bool]:
  """The params of a step directory on the program's mesh, and whether they
  were checked against the checksums saved with them.

  Raises:
    OtherModel: the saved params have other names or shapes than the config's.
    Damaged: an array's bits changed since the save.
    Exception: whatever Orbax raises for a step it cannot read.
  """
  canonical = program.abstract_state(canonical=True)
  item = {'step': canonical.step, 'params': canonical.params}
  state_dir = os.path.join(step_dir, 'state')
  # Checked first: Orbax fails on a wrong shape only after it has started
  # reading, and leaves its pending reads to complain at exit.
  handler = ocp.PyTreeCheckpointHandler()
  try:
    saved_params = handler.metadata(epath.Path(state_dir)).tree['params']
  finally:
    handler.close()
  problem = _shape_problem(saved_params, canonical.params)
  if problem:
    raise OtherModel(problem)
  reader = ocp.PyTreeCheckpointer()
  try:
    restore_args = jax.tree.map(
        lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype), item)
    # Partial: the optimizer moments (two thirds of the state) stay on disk.
    tree = reader.restore(state_dir, args=ocp.args.PyTreeRestore(
        item=item, restore_args=restore_args, partial_restore=True))
  finally:
    reader.close()
  meta = step_json(step_dir, 'meta/metadata')   # a damaged record is named, not a decoder's error
  prints = meta.get(FINGERPRINTS)
  if prints:
    # Keys as the trainer saved them (paths in the TrainState); the moments are not read.
    bad = first_mismatch(prints, TrainState(step=tree['step'], params=tree['params'], opt_state=None),
                         partial=True)
    if bad is not None:
      raise Damaged(f'array {bad} does not match the checksum saved with it')
  return program.params_from_canonical(tree['params']), bool(prints)


def _shape_problem(saved: Any, wanted: Any) -> Optional[str]:
  """How the saved params' names and shapes differ from the wanted ones, or None."""
  have = {jax.tree_util.keystr(p): tuple(m.shape) for p, m in jax.tree_util.tree_leaves_with_path(saved)}
  want = {jax.tree_util.keystr(p): tuple(s.shape) for p, s in jax.tree_util.tree_leaves_with_path(wanted)}
  for key, shape in want.items():
    if key not in have:
      return f'the config makes params{key} {shape}, the checkpoint has no such array'
    if have[key] != shape:
      return f'params{key} is {have[key]} in the checkpoint, {shape} with the config'
  extra = sorted(set(have) - set(want))
  return f'the checkpoint holds params{extra[0]}, which the config does not make' if extra else None


# --- batches and the loss ---------------------------------------------------------

def _whole_batches(cfg: Config, n: int, split: str = 'heldout') -> int:
  """`n`, or the whole batches the split holds where that is fewer
  (`data.whole_batches`; the train split's first pass): past them
  its windows would repeat, and a token counted twice would bias the mean
  this reports as exact."""
  gbs = cfg.train.global_batch_size
  whole = data_lib.whole_batches(cfg.data, gbs, split)
  if n > whole > 0:   # none at all: make_eval_batches says what is missing
    name = 'held-out split' if split == 'heldout' else 'train split'
    say(f'{PROG}: the {name} holds {whole} whole batch(es) of {gbs} x {cfg.data.seq_len} tokens; '
        f'evaluating those, not {n} (beyond them its windows repeat).')
    return whole
  return n


def make_batches(cfg: Config, split: str, n: int,
                 share: Optional[tuple[int, int]] = None) -> Iterable[dict[str, np.ndarray]]:
  """This process's rows of the first `n` global batches of `split`: held-out
  batches in order (what the trainer evaluates), or the train stream from its
  start. share: (index, count) of this process's block of rows
  (`Program.data_share`); by default one block per process."""
  gbs = cfg.train.global_batch_size
  pid, nproc = share if share is not None else (jax.process_index(), jax.process_count())
  if split == 'heldout':
    return data_lib.make_eval_batches(cfg.data, gbs, n, process_index=pid, process_count=nproc)
  it = data_lib.make_train_iterator(cfg.data, gbs, process_index=pid, process_count=nproc)
  return itertools.islice(it, n)


def token_mean_loss(program: Program, params: Any,
                    batches: Iterable[dict[str, np.ndarray]]) -> tuple[float, int]:
  """`train.evaluate` over this process's rows of each batch, made global
  one batch at a time (a long evaluation never holds them all)."""
  return evaluate(program, params, (program.to_global(b) for b in batches))


# --- the report -----------------------------------------------------------------

def make_report(cfg: Config, program: Program, picked: Candidate, verified: bool, skipped: list[dict],
                split: str, n: int, loss: float, tokens: int, seconds: float) -> dict:
  """The JSON document mjax-eval prints."""
  tokenizer = data_lib.load_sources(cfg.data)[0][0].tokenizer
  bits = loss / math.log(2)
  report = {
      'checkpoint': picked.path, 'step': picked.step, 'tier': picked.tier,
      'checksums_verified': verified, 'skipped': skipped,
      'split': split, 'batches': n, 'global_batch_size': cfg.train.global_batch_size,
      'seq_len': cfg.data.seq_len, 'tokens': tokens,
      'loss': _finite(loss), 'perplexity': _finite(math.exp(loss)) if loss < 700 else None,
      'bits_per_token': _finite(bits),
  }
  if tokenizer.name == BYTES:
    report.update(bits_per_byte=_finite(bits), note=BYTES_NOTE)
  devices = list(program.mesh.devices.flat)
  report.update(
      tokenizer=tokenizer.path or tokenizer.name, data=data_lib.describe(cfg.data),
      mesh=dict(program.mesh.shape), devices=len(devices), platform=devices[0].platform,
      processes=jax.process_count(), seconds=round(seconds, 3))
  return report


def _finite(x: float) -> Optional[float]:
  """JSON has no NaN or Infinity: a non-finite value is null."""
  return x if math.isfinite(x) else None
