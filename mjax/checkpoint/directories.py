"""Where a run's checkpoints live, which steps are complete there, and whose they are.

A run's tiers (`tier_directories`) may lie outside its workdir (/dev/shm,
a bucket, another disk), and a workdir's path may be reused by a new run.
Two files tie them together: OWNER_FILE in each tier directory names the
workdir (and run id) saving there, RUN_ID_FILE in the workdir the run living
there. A run never resumes from, or deletes, another run's steps (`foreign`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import tempfile
from typing import Optional

from etils import epath

from mjax import jsonfile
from mjax.config import CheckpointConfig, ConfigError
from mjax.errors import UserError


def tier_directories(cfg: CheckpointConfig, workdir: str, strict: bool = False) -> dict[str, str]:
  """Where each enabled tier writes. The default fast tier lives in /dev/shm
  under a name derived from the workdir, so two runs never share it. With
  `strict` (the run itself), a variable in a path that is not set is an
  error; elsewhere (the driver, mjax-eval, mjax-report, whose environment
  need not be the trainers') such a tier is one with no steps seen here."""
  # _expand: ~, $VARS, and a bucket (gs://, s3://) left as it is, not
  # taken for a local path.
  dirs = {'persistent': _expand(cfg.directory, workdir, 'directory', strict) if cfg.directory
          else os.path.abspath(os.path.join(workdir, 'checkpoints'))}
  if cfg.fast_every:
    fast = cfg.fast_directory
    if fast is None:
      # The real path: a workdir spelled through a link is the same run. A
      # tier named after the path as spelled (before the real path was
      # used) is still this run's.
      named = lambda path: os.path.join('/dev/shm', 'mjax', hashlib.sha1(path.encode('utf-8', 'surrogateescape')).hexdigest()[:12])
      fast, spelled = named(os.path.realpath(workdir)), named(os.path.abspath(workdir))
      if spelled != fast and os.path.isdir(spelled) and not os.path.isdir(fast):
        fast = spelled
    dirs['fast'] = _expand(fast, workdir, 'fast_directory', strict)
  return dirs


OWNER_FILE = '.mjax-run.json'   # in each tier directory: the workdir (and run id) of the run whose steps it holds
# In the workdir: the id of the run that lives there, made by its first start.
# A workdir's path names its default fast tier, which outlives a deleted
# workdir in /dev/shm; the id tells a new run at the same path from the old
# one, whose steps it must not resume as its own.
RUN_ID_FILE = '.mjax-run-id'


def read_claim(directory: str) -> dict:
  """`directory`'s claim (OWNER_FILE) as {'workdir': str, 'run': str or None}, or {}."""
  try:
    with open(os.path.join(directory, OWNER_FILE)) as fh:
      found = jsonfile.load(fh)
    workdir, run = found.get('workdir'), found.get('run')
  except (OSError, ValueError, AttributeError):
    return {}
  if not isinstance(workdir, str):
    return {}
  return {'workdir': workdir, 'run': run if isinstance(run, str) and run else None}


def claimed_workdir(directory: str) -> Optional[str]:
  """The workdir written in `directory`'s claim (OWNER_FILE), or None."""
  return read_claim(directory).get('workdir')


def run_record(workdir: str) -> dict:
  """RUN_ID_FILE as {'run': str, 'fresh': bool}, or {} (none yet, or
  written by an mjax from before run ids)."""
  try:
    with open(os.path.join(workdir, RUN_ID_FILE)) as fh:
      found = jsonfile.load(fh)
    run = found.get('run')
  except (OSError, ValueError, AttributeError):
    return {}
  return {'run': run, 'fresh': found.get('fresh') is True} if isinstance(run, str) and run else {}


def run_id(workdir: str) -> Optional[str]:
  """The id of the run in `workdir` (RUN_ID_FILE), or None."""
  return run_record(workdir).get('run')


def ensure_run_id(cfg: CheckpointConfig, workdir: str) -> dict:
  """The workdir's run record {'run': id, 'fresh': bool}, made on the run's first start there (process 0,
  which hands it to the others: a host-local tier's hosts need not share
  the workdir).

  A workdir without one whose tiers all name one run of this path in their
  claims (the workdir was lost, its checkpoints kept elsewhere) takes that
  run's id and resumes it, as before run ids. Otherwise a new id; 'fresh'
  where the workdir holds no run yet (no config.json): such a run never
  wrote a claim without an id, so one of its path without an id is an
  earlier run's, from an mjax before run ids (`earlier_run`)."""
  found = run_record(workdir)
  if found:
    return found
  me = os.path.realpath(workdir)
  claims = [read_claim(d) for d in _claimable(tier_directories(cfg, workdir))]
  runs = {c['run'] for c in claims if c and os.path.realpath(c['workdir']) == me and c['run']}
  record = {'run': runs.pop(), 'fresh': False} if len(runs) == 1 else \
      {'run': secrets.token_hex(8), 'fresh': not is_workdir(workdir)}
  # Made whole under a private name, then linked into place, never over a
  # file: of two first starts at once, one id stands and the other start
  # reads it (and is then refused by the workdir's run lock).
  path = os.path.join(workdir, RUN_ID_FILE)
  try:
    fd, tmp = tempfile.mkstemp(dir=workdir, prefix=f'{RUN_ID_FILE}.')
    with os.fdopen(fd, 'w') as fh:
      json.dump(record, fh)
    try:
      jsonfile.place_new(tmp, path)
    except FileExistsError:
      os.unlink(tmp)
      return run_record(workdir) or record
  except OSError as e:
    raise ConfigError(f'--workdir {workdir!r}: its run id ({RUN_ID_FILE}) cannot be written: '
                      f'{e.strerror or e}. Free space there or make it writable, or give another --workdir.') from None
  return record


def with_host_dirs(directory: str) -> list[str]:
  """`directory` and, where it is a host-local tier, its directories per
  process (`host_directory`), each with its own steps and claim."""
  return [directory] + [os.path.join(directory, n) for n in sorted(os.listdir(directory))
                        if n.startswith('process-')]


def _claimable(dirs: dict[str, str]) -> list[str]:
  """The local tier directories that hold claims (`with_host_dirs`)."""
  return [d for tier in dirs.values() if '://' not in tier and os.path.isdir(tier) for d in with_host_dirs(tier)]


def earlier_run(directory: str, workdir: str, record: Optional[dict] = None) -> Optional[str]:
  """Where `directory`'s claim names this workdir's path but an earlier run
  there than the one living there now (whose workdir was deleted or moved
  since), that run's id, or 'unknown' for a claim from an mjax before run
  ids (which only a fresh workdir's run can tell apart); else None.
  `record`: this run's {'run', 'fresh'} where known (the trainer's
  processes get it from process 0), else read from the workdir."""
  if inside_workdir(directory, workdir):
    return None   # a tier inside the workdir is its run's, whichever id its claim has
  claim = read_claim(directory)
  if not claim or os.path.realpath(claim['workdir']) != os.path.realpath(workdir):
    return None
  record = record or run_record(workdir)
  if not record:
    return None
  if claim['run'] is None:
    return 'unknown' if record['fresh'] else None
  return claim['run'] if claim['run'] != record['run'] else None


def is_workdir(path: str) -> bool:
  """Whether `path` is an mjax run's workdir (it holds the run's config.json)."""
  try:
    with open(os.path.join(path, 'config.json')) as fh:
      cfg = jsonfile.load(fh)
  except (OSError, ValueError):
    return False
  return isinstance(cfg, dict) and {'model', 'checkpoint'} <= cfg.keys()


def ancestors(path: str, below: Optional[str] = None):
  """`path`'s real path, then each of its parents up to the root (or, with
  `below`, up to but not including that directory)."""
  path, stop = os.path.realpath(path), below and os.path.realpath(below)
  while path != stop:
    yield path
    parent = os.path.dirname(path)
    if parent == path:
      return
    path = parent


def enclosing_workdir(directory: str, below: Optional[str] = None) -> Optional[str]:
  """The workdir of the run whose directory holds `directory` (itself or its
  nearest ancestor with an mjax config.json), or None; with `below`, only
  a workdir inside `below`."""
  return next((path for path in ancestors(directory, below) if is_workdir(path)), None)


def owner(directory: str) -> Optional[str]:
  """The workdir of the run that saves into `directory`, or None (nobody's
  yet; remote directories are not claimed). A directory's claim says it;
  an unclaimed one inside a run's workdir (its default tier, saved before
  default tiers were claimed too) is that run's."""
  if '://' in directory:
    return None
  return claimed_workdir(directory) or enclosing_workdir(directory)


def inside_workdir(directory: str, workdir: str) -> bool:
  """Whether `directory` lies in the workdir (the default persistent tier):
  a copied or moved workdir takes its checkpoints along, and they are its own."""
  if '://' in directory:
    return False
  w = os.path.realpath(workdir)
  return os.path.commonpath([os.path.realpath(directory), w]) == w


def foreign(directory: str, workdir: str, record: Optional[dict] = None) -> Optional[str]:
  """The other run's workdir where `directory` belongs to another run than
  `workdir`'s, else None. A directory inside the workdir is its own, unless
  it is inside another run's workdir within this one. An earlier run at
  the workdir's path is another run (`earlier_run`; `record` as there)."""
  if inside_workdir(directory, workdir):
    return enclosing_workdir(directory, below=workdir)
  found = owner(directory)
  # Real paths: a workdir spelled through a link (~, $PWD where /home is
  # one) is the same run.
  if found is not None and os.path.realpath(found) != os.path.realpath(workdir):
    return found
  earlier = earlier_run(directory, workdir, record)
  return f'{found} (an earlier run at that path, id {earlier})' if earlier else None


def saved_steps(cfg: CheckpointConfig, workdir: str) -> list[tuple[int, str, str]]:
  """(step, tier, path) of every complete checkpoint, newest first (the
  persistent tier first at equal steps). Orbax writes a step under a
  temporary name and renames it when complete, so the names say it all.
  A tier directory that another run claims (`check_owner`) holds none of
  this run's steps."""
  found = [(step, tier, os.path.join(directory, str(step)))
           for tier, directory in tier_directories(cfg, workdir).items()
           if not foreign(directory, workdir) for step in steps_in(directory)]
  return sorted(found, key=lambda x: (x[0], x[1] == 'persistent'), reverse=True)


def steps_in(directory: str) -> list[int]:
  """The complete steps saved in one checkpoint directory, newest first."""
  d = epath.Path(directory)
  # A file named like a step is not one (Orbax's steps are directories).
  return sorted((int(p.name) for p in d.iterdir() if p.name.isdigit() and p.is_dir()),
                reverse=True) if d.is_dir() else []


def is_step_dir(path: str) -> bool:
  """Whether `path` is one saved step (`.../checkpoints/120`), not a directory of steps."""
  return os.path.basename(path.rstrip('/')).isdigit() and os.path.isdir(os.path.join(path, 'state'))


def among_checkpoints(path: str) -> Optional[str]:
  """Why files may not be written at `path` (the directory itself, or
  inside it), or None: it is, or lies inside, a run's checkpoint directory
  (its claim) or a saved step. Such a directory holds steps and nothing
  else: the run reads a new entry there as a damaged step, or deletes it
  with an old step."""
  me = os.path.realpath(path)
  for d in ancestors(path):
    if os.path.isdir(d) and (os.path.isfile(os.path.join(d, OWNER_FILE)) or is_step_dir(d)):
      what = 'a saved step' if is_step_dir(d) else 'a checkpoint directory'
      return (f'{path!r} is {"" if d == me else f"inside {d!r}, "}{what} of a training run, '
              f'which holds its steps and nothing else (the run would read a new entry as a damaged step, or '
              f'delete it with an old step)')
  return None


def refuse_among_checkpoints(path: str, give: str = 'a path') -> None:
  """Raises UserError where `among_checkpoints` says no: for the tools
  that write outside a run (mjax-export, mjax-import, mjax-prepare,
  mjax-tokenizer); `give` names what the user should change."""
  problem = among_checkpoints(path)
  if problem:
    raise UserError(f'{problem}; give {give} outside it.')


def _expand(path: str, workdir: str, key: str, strict: bool) -> str:
  """~ and $VARS ($SLURM_TMPDIR, $HOSTNAME, ...) expanded, a relative path
  taken relative to the workdir (as config.gin records it, wherever a
  resume is started from); a remote path (gs://, s3://) is left as it is.
  A variable that is not set is an error, not a directory named after it."""
  expanded = os.path.expandvars(os.path.expanduser(path))
  unset = re.search(r'\$\{?([A-Za-z_][A-Za-z0-9_]*)', expanded)
  if unset and strict:
    raise ConfigError(f'CheckpointConfig.{key} = {path!r}: ${unset.group(1)} is not set in this environment, '
                      f'so the path would name a directory {unset.group(0)!r}. Set it, or give the path '
                      f'without it.')
  if '://' in expanded:
    return expanded
  return os.path.abspath(os.path.join(workdir, expanded))   # an absolute path stays as it is


def tier_key(name: str) -> str:
  """The CheckpointConfig field that sets tier `name`'s directory."""
  return 'fast_directory' if name == 'fast' else 'directory'
