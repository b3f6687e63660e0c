"""What a start checks before it writes anything.

The tiers are apart, writable, seen by every process and this run's own;
the workdir lies inside no other run's; what the workdir and its tiers hold
are checkpoints of this model. Each check raises ConfigError (HostFault,
where only some hosts are at fault) in every process alike, so that none
goes on to hang in a collective the others never reach.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import secrets
import sys
from typing import Any, Optional

import jax
from etils import epath

from mjax import distributed, jsonfile
from mjax.checkpoint.directories import (ancestors, claimed_workdir, earlier_run, enclosing_workdir, foreign,
                                         inside_workdir, is_workdir, OWNER_FILE, read_claim, RUN_ID_FILE, run_record,
                                         steps_in, tier_directories, tier_key, with_host_dirs)
from mjax.checkpoint.failures import write_problem
from mjax.config import ConfigError
from mjax.errors import HostFault, few_processes


def check_apart(dirs: dict[str, str]) -> None:
  """Raises ConfigError where two tiers would save into one directory, or
  one lies inside a step of the other: each tier lists the numbered entries
  of its directory as its steps, and keeps and deletes them by name, so it
  would delete the other's steps, or half-written ones. (One tier in a
  subdirectory of the other, named otherwise, is apart.)"""
  local = {name: os.path.realpath(d) for name, d in dirs.items() if '://' not in d}
  for (a, da), (b, db) in itertools.combinations(sorted(local.items()), 2):
    outer, inner = (da, db) if len(da) <= len(db) else (db, da)
    if os.path.commonpath([da, db]) != outer:
      continue
    first = os.path.relpath(inner, outer).split(os.sep)[0]
    if da == db or first.isdigit():
      how = 'the same directory' if da == db else f'one inside a step ({first}) of the other'
      raise ConfigError(
          f'CheckpointConfig.{tier_key(a)} = {dirs[a]!r} and CheckpointConfig.{tier_key(b)} = {dirs[b]!r} '
          f'(the {a} and {b} tiers) are {how}: each tier deletes the steps it no longer keeps, so they '
          f'would delete each other\'s. Give the fast tier a directory of its own (leave '
          f'CheckpointConfig.fast_directory unset for one in /dev/shm), or set fast_every = 0.')


def check_not_around_the_workdir(dirs: dict[str, str], workdir: str) -> None:
  """Raises ConfigError where a tier is the workdir or one of the folders
  above it ('/', '~', '..'): a checkpoint directory holds its steps and
  nothing else, and its claim (OWNER_FILE) marks all below it as that:
  CheckpointConfig.directory = '/' wrote steps into the root, and then
  every other run's workdir and every tool's output on the machine was
  refused as lying inside this run's checkpoints."""
  me = os.path.realpath(workdir)
  for name, d in dirs.items():
    if '://' in d:
      continue
    real = os.path.realpath(d)
    if os.path.commonpath([real, me]) == real:
      key = tier_key(name)
      raise ConfigError(
          f'CheckpointConfig.{key} = {d!r} (the {name} tier) ' + ('is' if real == me else 'holds')
          + f' the run\'s workdir {workdir!r}: a checkpoint directory holds its steps and nothing else, and '
          f'everything below it would count as this run\'s checkpoints (other runs and the tools refuse to '
          f'write there). Give the tier a directory of its own, or leave CheckpointConfig.{key} unset '
          f'(one per workdir).')


def check_writable(dirs: dict[str, str], timeout_s: float = 300.0) -> None:
  """Raises ConfigError, in every process alike, unless every process can
  write each tier directory: a read-only or full filesystem is found before
  anything compiles, not at the first save."""
  mine = {name: problem for name, d in dirs.items() if (problem := write_problem(d))}
  reports = {i: jsonfile.loads(v) for i, v in distributed.report_exceptions(
      'ckpt/probe/writable', json.dumps(mine) if mine else None, timeout_s).items()}
  for name, directory in dirs.items():
    bad = {i: v[name] for i, v in sorted(reports.items()) if name in v}
    if bad:
      key = tier_key(name)
      n = jax.process_count()
      who = '' if n == 1 else f' in process(es) {sorted(bad)} of {n}'
      if few_processes(bad, n):
        raise HostFault(
            f'CheckpointConfig.{key} = {directory!r} (the {name} tier) cannot be written{who}: '
            f'{next(iter(bad.values()))}. The other processes can write it, so the hosts of those '
            f'processes are at fault (a mount missing or read-only there, their disk full), not the '
            f'config: under mjax-launch the job restarts without them.', bad)
      raise ConfigError(
          f'CheckpointConfig.{key} = {directory!r} (the {name} tier) cannot be written{who}: '
          f'{next(iter(bad.values()))}. Checkpoints need a writable directory with room for '
          f'the train state; fix that there, or point CheckpointConfig.{key} at another '
          f'directory' + (' (or set fast_every = 0).' if name == 'fast' else '.'))


def check_owner(dirs: dict[str, str], workdir: str, timeout_s: float = 300.0,
                record: Optional[dict] = None) -> None:
  """Claims each tier directory for this run, or raises ConfigError, in
  every process alike, where another run (another workdir, or an earlier
  run at this workdir's path) saves there: two runs in one directory
  resume from and delete each other's steps. A directory nobody claimed
  yet (a new one, or one from before claims) becomes this run's.
  `record`: this run's {'run', 'fresh'} (`ensure_run_id`), else read
  from the workdir."""
  me = os.path.realpath(workdir)
  record = record or run_record(workdir)
  run = record.get('run')
  problems = {}
  for name, d in dirs.items():
    if '://' in d:
      continue
    problem = _owner_problem(name, d, workdir, record)
    if problem is not None:
      problems[name] = problem
      continue
    # Claimed even inside the workdir, where it is always this run's (a
    # moved workdir takes over another path's claim): another run pointed
    # at it is refused. Outside, a claim of another path (or of an earlier
    # run at this path) made it foreign.
    claim = read_claim(d)
    if not claim or os.path.realpath(claim['workdir']) != me or (run is not None and claim['run'] != run):
      try:
        jsonfile.write_atomic(os.path.join(d, OWNER_FILE), {'workdir': me, 'run': run})
      except OSError:
        pass   # check_writable has said what is wrong with it
  reports = {i: jsonfile.loads(v) for i, v in distributed.report_exceptions(
      'ckpt/probe/owner', json.dumps(problems) if problems else None, timeout_s).items()}
  for name in dirs:
    problem = next((v[name] for _, v in sorted(reports.items()) if name in v), None)
    if problem is not None:
      raise ConfigError(problem)


def _owner_problem(name: str, directory: str, workdir: str, record: dict) -> Optional[str]:
  """Why tier `name` in `directory` is not this run's to save into, or None."""
  other = foreign(directory, workdir, record)
  if other is None:
    return None
  key = tier_key(name)
  claim_file = os.path.join(directory, OWNER_FILE)
  earlier = earlier_run(directory, workdir, record)
  if earlier is not None:
    # A host-local tier's claims are per process: all of it is that run's.
    tier = os.path.dirname(directory) if re.fullmatch(r'process-\d+', os.path.basename(directory)) else directory
    which = (f'run {earlier}' if earlier != 'unknown' else
             'an mjax from before run ids, while this workdir is new')
    return (f'CheckpointConfig.{key} = {tier!r} (the {name} tier) holds the checkpoints of an earlier run at '
            f'this same --workdir path {workdir!r} ({which}, says {claim_file!r}), not of the run living there '
            f'now (run {record["run"]}, {os.path.join(workdir, RUN_ID_FILE)!r}): that workdir was deleted or '
            f'moved since, and this run would resume that state as its own. Delete {tier!r}'
            + (' on each host' if tier != directory else '') + f' if that run is over; if it is this run\'s '
            f'own (its {RUN_ID_FILE} was lost), delete {OWNER_FILE} there to take the directory over.')
  where = f'its claim {claim_file!r} says so' if claimed_workdir(directory) else 'it lies in that run\'s workdir'
  return (f'CheckpointConfig.{key} = {directory!r} (the {name} tier) holds the checkpoints of another run, '
          f'workdir {other!r} ({where}): two runs there would resume from and delete each other\'s steps. '
          f'Give this run a directory of its own (e.g. one named after the run) or leave '
          f'CheckpointConfig.{key} unset (the default is one per workdir)' +
          (f'; if this is that run moved to a new workdir, delete {OWNER_FILE} there.' if claimed_workdir(directory)
           else '.'))


def check_not_inside_a_tier(workdir: str) -> None:
  """Raises ConfigError where the workdir is, or lies inside, another run's
  checkpoint directory (it holds that run's claim, OWNER_FILE): that run's
  clean-up of its old steps would delete this one, and this run's files
  would hide its steps."""
  me = os.path.realpath(workdir)
  for path in ancestors(workdir):
    claim = claimed_workdir(path)
    if claim is not None and os.path.realpath(claim) != me:
      where = 'is' if path == me else f'lies inside {path!r}, which is'
      raise ConfigError(
          f'workdir {workdir!r} {where} the checkpoint directory of the run with workdir {claim!r} '
          f'({os.path.join(path, OWNER_FILE)} says so): that run deletes old steps there and would delete '
          f'this run with them. Give this run a workdir outside it.')


# The folders a run writes in its workdir (TensorBoard events, driver logs,
# timing rows, traces, reports, the trainer-driver facts).
RUN_FOLDERS = ('tensorboard', 'logs', 'timings', 'profile', 'stragglers', 'protocol')


def check_not_inside_a_workdir(workdir: str) -> None:
  """Raises ConfigError where the workdir is, or lies inside, one of the
  folders another run writes in its workdir (RUN_FOLDERS): the two runs'
  files would mix there (TensorBoard would show this run as that one). A
  folder of one's own inside a run's workdir (runs/a/ablation) is fine."""
  me = os.path.realpath(workdir)
  other = enclosing_workdir(os.path.dirname(me))
  if other is None or other == me:
    return
  folder = os.path.relpath(me, other).split(os.sep)[0]
  if folder in RUN_FOLDERS:
    raise ConfigError(
        f'workdir {workdir!r} lies inside {os.path.join(other, folder)!r}, the {folder}/ folder of the mjax '
        f'run with workdir {other!r} (its config.json says so): the two runs\' files would mix there. Give '
        f'this run a workdir outside it, e.g. beside it.')


def check_shared(dirs: dict[str, str], timeout_s: float = 300.0) -> None:
  """Raises ConfigError unless every process sees each tier directory as
  the same directory (a no-op in a one-process job).

  Process 0 writes a probe file with a fresh name into each directory; every
  process looks for it; the verdicts are gathered so that all processes
  raise alike, rather than some going on to hang in a save.
  """
  if jax.process_count() == 1:
    return
  token = distributed.broadcast_str('ckpt/probe/token', secrets.token_hex(8), timeout_s)
  probes = {name: epath.Path(d) / f'.mjax-probe-{token}' for name, d in dirs.items()}
  if jax.process_index() == 0:
    for probe in probes.values():
      probe.parent.mkdir(parents=True, exist_ok=True)
      probe.write_text(token)
  distributed.barrier('ckpt/probe/written', timeout_s)
  unseen = [name for name, probe in probes.items() if not (probe.exists() and probe.read_text() == token)]
  reports = {i: jsonfile.loads(v) for i, v in distributed.report_exceptions(
      'ckpt/probe/seen', json.dumps(unseen) if unseen else None, timeout_s).items()}
  if jax.process_index() == 0:
    for probe in probes.values():
      probe.unlink(missing_ok=True)
  for name, directory in dirs.items():
    blind = sorted(i for i, v in reports.items() if name in v)
    if blind and few_processes(blind, jax.process_count()):
      raise HostFault(
          f'CheckpointConfig.{tier_key(name)} = {directory!r} (the {name} tier) is not seen by '
          f'process(es) {blind} of {jax.process_count()}: they do not see the file process 0 wrote '
          f'there, which the others do, so the hosts of those processes do not mount it (or mount '
          f'something else there): under mjax-launch the job restarts without them.', blind)
    if blind:
      key = tier_key(name)
      raise ConfigError(
          f'CheckpointConfig.{key} = {directory!r} (the {name} tier) is not shared by every process: '
          f'process(es) {blind} of {jax.process_count()} do not see the file process 0 wrote there, so '
          f'their checkpoint shards would never be committed. A multi-host job needs this tier '
          f'on a filesystem all hosts mount at the same path'
          + ("; set CheckpointConfig.fast_scope = 'host' to keep a copy per process in each "
             "one's own directory (host memory), point CheckpointConfig.fast_directory at a shared "
             'path, or set fast_every = 0 to turn the fast tier off.' if name == 'fast' else '.'))


# ModelConfig fields that set the shapes (or the tree) of the saved state;
# everything else (attention kernel, remat, dtype of compute, optimizer
# hyper-parameters, mesh) may change between a run and its resumption.
STATE_SHAPE_KEYS = ('vocab_size', 'd_model', 'n_layers', 'n_heads', 'n_kv_heads', 'head_dim', 'd_ff',
                    'block', 'mlp', 'norm', 'use_bias', 'tie_embeddings', 'full_attention_every',
                    'parallel_norms', 'scan_layers', 'param_dtype')


CHECKPOINT_ITEMS = ('state', 'data', 'meta')


def _resolved_shape(m: dict, key: str):
  # None means "the default shape": 4 kv heads and None are the same with 4 heads.
  if key == 'n_kv_heads':
    return m.get(key) or m.get('n_heads')
  if key == 'head_dim':
    return m.get(key) or (m['d_model'] // m['n_heads'] if m.get('n_heads') else None)
  return m.get(key)


def _shape_changes(before: dict, now: dict) -> str:
  """'ModelConfig.d_model = 128 there, 256 now, ...' for the state-shaping keys that differ; '' if none."""
  differ = [k for k in STATE_SHAPE_KEYS if k in before and _resolved_shape(before, k) != _resolved_shape(now, k)]
  return ', '.join(f'ModelConfig.{k} = {_resolved_shape(before, k)!r} there, {_resolved_shape(now, k)!r} now'
                   for k in differ)


def _check_steps_not_left_behind(cfg: Any, saved: dict, workdir: str, steps: dict[str, list[int]]) -> None:
  """Raises ConfigError where a checkpoint directory the workdir's run saved
  into (by its config.json) and this config no longer names holds a newer
  step than this config's tiers (`steps`: their steps, by tier): the run
  would not resume it but start over from step 0 (or an older step),
  silently, writing over that run's config and metrics: a
  CheckpointConfig.directory changed between starts, or a fast tier turned
  off while it held the newest step."""
  keys = ('directory', 'fast_directory', 'fast_every')
  try:
    then = tier_directories(dataclasses.replace(cfg, **{k: saved[k] for k in keys if k in saved}), workdir)
  except (TypeError, ValueError):
    return   # a record this version cannot read: the checks above still hold
  dirs = tier_directories(cfg, workdir)
  now = {os.path.realpath(d) for d in dirs.values()}
  newest = max((s for held in steps.values() for s in held), default=None)
  for name, d in then.items():
    if '://' in d or not os.path.isdir(d) or os.path.realpath(d) in now:
      continue
    behind = [s for s in steps_in(d) if newest is None or s > newest]
    if not behind:
      continue
    key = tier_key(name)
    if name == 'fast' and cfg.fast_every == 0:
      back = (f'set CheckpointConfig.fast_every back to {saved.get("fast_every")!r} to resume it (or delete '
              f'{d!r} if that step is not wanted)')
    else:
      back = (f'set CheckpointConfig.{key} back to {saved.get(key)!r}, or move its steps into '
              f'{dirs[name]!r} first')
    instead = 'start over from step 0' if newest is None else f'resume the older step {newest}'
    raise ConfigError(
        f'--workdir {workdir!r} is the workdir of a run whose {name} checkpoint tier was {d!r} '
        f'(CheckpointConfig.{key} = {saved.get(key)!r} in its config.json), which holds step(s) '
        f'{", ".join(map(str, behind[:5]))}; this config does not save there, so the run would {instead} '
        f'instead of step {behind[0]}, and write over that run\'s metrics and config. To go on with the run, '
        f'{back}; for a new run, give a new --workdir.')


def check_same_model(cfg: Any, workdir: str) -> None:
  """Raises ConfigError when the workdir or its checkpoint directories hold
  something a start would destroy:
    * checkpoints of a model whose state has other shapes than `cfg`'s (by
      the workdir's config.json, and by each saved step's own config, which
      also covers a CheckpointConfig.directory shared with another run):
      they cannot be resumed, and a fresh start's saves would make Orbax
      delete them as the oldest steps beyond `keep`;
    * a numbered entry that is not an mjax checkpoint (none of state/,
      data/, meta/): Orbax counts it among the kept steps and deletes it,
      or a good checkpoint in its place.
  """
  now = dataclasses.asdict(cfg.model)
  advice = ('Either train this model in a new --workdir (and checkpoint directory), or start it from a '
            'checkpoint of its own shape with CheckpointConfig.restore_from (in a new --workdir as well).')
  record = os.path.join(workdir, 'config.json')
  unusual = (os.path.lexists(record) and not is_workdir(workdir) or
             os.path.lexists(os.path.join(workdir, 'config.gin')) and not os.path.lexists(record))
  run = run_record(workdir)
  ours = bool(run)
  try:
    with open(record) as fh:
      saved = jsonfile.load(fh)
  except (OSError, ValueError):
    saved = None   # a new workdir, or a record that cannot be read
  # Damaged (unreadable) or missing only: a readable config.json of another
  # tool in a run's workdir is still refused, never written over.
  if unusual and ours and saved is None:
    # The run's own record (RUN_ID_FILE) says an mjax run lives here: its
    # config.json was damaged or lost, not a user's file. Each saved step's
    # own config still guards the model's shape (below), and this start
    # writes config.json again once it is running.
    print(f'mjax: warning: {record} is {"unreadable" if os.path.lexists(record) else "missing"}; this is '
          f'the workdir of run {run["run"]} ({RUN_ID_FILE}), which resumes with the config '
          f'given now and writes config.json again.', file=sys.stderr, flush=True)
  elif unusual:
    theirs = 'config.json' if os.path.lexists(record) else 'config.gin'
    raise ConfigError(
        f'--workdir {workdir!r} holds a {theirs} that no mjax run wrote (an mjax workdir has both '
        f'config.json and config.gin, its config.json with the run\'s model and checkpoint '
        f'settings): a run there would write over it with its own. Give a new or empty directory, or '
        f'the workdir of an mjax run to resume (a gin file of your own is best kept outside the workdir).')
  before = saved.get('model', {}) if isinstance(saved, dict) else None
  # With checkpoints off too: the run would still write over config.json,
  # and the checkpoints there could not be resumed afterwards.
  tiers = tier_directories(cfg.checkpoint, workdir)
  local = {name: d for name, d in tiers.items() if '://' not in d and os.path.isdir(d)}
  steps = {name: steps_in(d) for name, d in local.items()}
  if before is not None and any(steps.values()):
    changes = _shape_changes(before, now)
    if changes and 'scan_layers' in before and changes == _shape_changes({'scan_layers': before['scan_layers']}, now):
      # The same model, its layers stacked (scanned) or not: configs/125m.gin
      # and 1p3b.gin unroll them since 2026-11-27, and their runs from before
      # hold scanned checkpoints.
      raise ConfigError(
          f'--workdir {workdir!r} holds checkpoints saved with ModelConfig.scan_layers = '
          f'{before["scan_layers"]!r}, and this config has {now["scan_layers"]!r} (configs/125m.gin and '
          f'1p3b.gin unroll their layers, the fastest on one GPU): the saved state is laid out the other way. '
          f'Resume with --gin.ModelConfig.scan_layers={before["scan_layers"]!r}.')
    if changes:
      raise ConfigError(
          f'--workdir {workdir!r} holds checkpoints of another model ({changes}): they cannot be '
          f'resumed with this config, and starting over there would overwrite that run\'s config '
          f'and metrics. {advice}')
  if not cfg.checkpoint.enabled and (before is not None or ours) and any(steps.values()):
    held = sorted({s for v in steps.values() for s in v}, reverse=True)
    raise ConfigError(
        f'--workdir {workdir!r} holds checkpoints (step(s) {", ".join(map(str, held[:5]))}), and '
        f'CheckpointConfig.enabled = False: this run would not resume them but start over from step '
        f'0 there, writing over that run\'s config and metrics. Enable checkpoints to resume the run, '
        f'or give a new --workdir for a run without them.')
  if cfg.checkpoint.enabled and isinstance(saved, dict) and isinstance(saved.get('checkpoint'), dict) and \
      not any('://' in d for d in tiers.values()):
    _check_steps_not_left_behind(cfg.checkpoint, saved['checkpoint'], workdir, steps)
  fast = local.get('fast')
  if not os.path.lexists(record) and not ours and fast is not None and not inside_workdir(fast, workdir) and \
      not steps.get('persistent') and '://' not in tiers['persistent']:
    # A workdir with no run in it whose fast tier, outside it and claimed by
    # this path (another's is check_owner's), holds steps while the
    # persistent tier holds none: an earlier run's at this path, whose
    # workdir was deleted or moved (the default fast tier is named after the
    # workdir's path and outlives it in /dev/shm). A new run would resume
    # that run's state as its own. A host-local tier keeps its steps, and
    # its claims, in a directory per process.
    dirs = with_host_dirs(fast)
    if not any(foreign(d, workdir) for d in dirs):
      held = sorted({s for d in dirs for s in steps_in(d)}, reverse=True)
      if held:
        raise ConfigError(
            f'CheckpointConfig.fast_directory = {fast!r} (the fast tier'
            + (', named after the workdir\'s path' if cfg.checkpoint.fast_directory is None else '')
            + f') holds step(s) {", ".join(map(str, held[:5]))} of an earlier run at --workdir {workdir!r}, '
            f'which holds no run now (no config.json) and whose persistent tier holds no steps: that '
            f'workdir was deleted or moved, and a new run here would resume its state as its own. Delete '
            f'{fast!r} if that run is over, or resume it from its own workdir.')
  for name, d in local.items():
    # A file named like a step is none (Orbax's steps are directories), but
    # Orbax's save of that step would delete it to make room.
    files = sorted(n for n in os.listdir(d) if n.isdigit() and not os.path.isdir(os.path.join(d, n)))
    if files:
      raise ConfigError(
          f'{os.path.join(d, files[0])!r} in the {name} checkpoint tier is a file named like a step: the save '
          f'of step {int(files[0])} would delete it. Move it out of {d!r}, then start again.')
    for step in steps[name]:
      path = os.path.join(d, str(step))
      try:
        entries = os.listdir(path) if os.path.isdir(path) else ['(a file)']
      except OSError:
        continue   # unreadable here: the restore reports it and falls back
      # Orbax's own bookkeeping (_CHECKPOINT_METADATA, ...) alone is what a
      # step cut off while being deleted leaves: partial, nothing to lose.
      entries = [e for e in entries if not e.startswith(('_', '.'))]
      if entries and not any(item in entries for item in CHECKPOINT_ITEMS):
        raise ConfigError(
            f'{path!r} in the {name} checkpoint tier is not an mjax checkpoint (it holds '
            f'{", ".join(sorted(entries)[:3])}{", ..." if len(entries) > 3 else ""}, none of '
            f'{"/, ".join(CHECKPOINT_ITEMS)}/). Orbax would count it among the kept steps and delete it '
            f'(or a good checkpoint in its place): move it out of {d!r}, then start again.')
      try:
        with open(os.path.join(path, 'meta', 'metadata')) as fh:
          saved = jsonfile.load(fh)['config'].get('model', {})
      except (OSError, ValueError, KeyError, TypeError, AttributeError):
        continue   # damaged or partial: the restore moves it aside and falls back
      changes = _shape_changes(saved, now)
      if changes:
        raise ConfigError(
            f'{path!r} in the {name} checkpoint tier is a checkpoint of another model ({changes}): it '
            f'cannot be resumed with this config, and a fresh start\'s saves would make Orbax delete it. '
            f'{advice}')
