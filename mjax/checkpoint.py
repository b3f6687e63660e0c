"""Asynchronous Orbax checkpoints in two tiers (MegaScale's two-stage save).

  fast tier        frequent, few kept, on local disk or /dev/shm: a restart
                   after a process crash loses at most `fast_every` steps
  persistent tier  less frequent, more kept, any path Orbax supports: survives
                   the loss of the machine

Each checkpoint holds three items: `state` (params + LAMB state + step, the
layout every mesh shares), `data` (the data iterator's state, JSON) and
`meta` (the resolved config and the step, JSON). Saves are asynchronous: the
step returns as soon as the arrays are copied off the devices, and Orbax
writes in a background thread. Orbax writes into a temporary directory and
renames it when complete, so a crash or `kill -9` mid-save leaves the previous
checkpoints untouched and the partial one is ignored (and cleaned up at the
next start).

Restore takes the newest step across both tiers; a checkpoint that fails to
read (truncated, corrupted, missing files) is reported and skipped, and the
next older one is used; once that one is read, the failed one is moved aside
(`damaged-<step>-<time>`), so that it takes no slot of the steps kept.

Single-replica restore (MegaScale's): params and LAMB moments are replicated
over the `data` mesh axis, so when the data-parallel replicas live in
different processes, one replica (data index 0) reads the state and a
collective sends it to the others; a restart reads the state's bytes once
instead of once per replica (192 times for a 175B layout with data = 192).
It applies when every array of the state is replicated over `data` (size
> 1) and no process holds devices of two replicas; otherwise, or with
`CheckpointConfig.single_replica_restore = False`, every process reads the
shards its devices hold, as Orbax does by default. Both paths give the same
bits (tests/test_multihost.py; figures from bench/restore_bench.py).

In a multi-process job every process must restore the same step, or they
hang in their first collective: each one lists what it sees, only steps
every process sees are candidates, and a failed read in any process moves
all of them to the next one (agreed through the coordination service,
mjax/distributed.py, before any collective runs).

Who sees a tier (`CheckpointConfig.fast_scope` for the fast tier; the
persistent tier is always shared):
  shared  one directory every process sees at the same path: Orbax's
          process 0 commits a save only once every process has written its
          shards there. The default fast tier, /dev/shm, is shared by the
          processes of one machine but not across machines, so at start-up
          process 0 leaves a probe file in each shared tier, and a tier some
          process cannot see it in is a configuration error (exit 2) naming
          the tier and the processes.
  host    (MegaScale's first save stage: device -> host memory, for
          multi-host jobs without a shared filesystem.) Each process writes
          the shards it holds, and the data position and checksums, to its
          own directory, <fast_directory>/process-<i>, committed by itself.
          Such a step is a restore candidate only when every process has its
          copy of it, saved by the same layout (process count, mesh, the
          blocks each process holds) with the same checksums; otherwise the
          persistent tier (or an older step) is used. Before each such save
          the processes meet at a barrier, which tells each that every copy
          of the earlier steps is committed; only then does it drop its
          copies beyond `fast_keep`, so a save cut off in any process leaves
          an older step that every process still has. After a restore, each
          process drops its copies newer than the step restored: they belong
          to a timeline the job left. Offline tools (mjax-report, mjax-eval)
          see none of these steps: one process's copy is not a checkpoint.

Resume semantics (decided in `resume`, and nowhere else):
  1. the workdir has a readable checkpoint in either tier: resume from the
     newest one (the usual restart after a fault or pre-emption);
  2. else `CheckpointConfig.restore_from` names a checkpoint: start from its
     train state (and data position, unless `restore_data` is False);
  3. else initialize from `TrainConfig.seed`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import hashlib
import itertools
import json
import logging
import math
import os
import re
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mjax import distributed, jsonfile, protocol
from mjax.config import CheckpointConfig, ConfigError
from mjax.errors import UNWRITABLE, HostFault, UserError, few_processes

log = logging.getLogger('mjax.checkpoint')

# Keys in a checkpoint's meta item: per-array checksums of the state (see
# `fingerprints`), and the sha256 of the data iterator's state, whose one
# changed digit would silently replay or skip batches.
FINGERPRINTS = 'fingerprints'
DATA_SHA256 = 'data_sha256'
# In a host-local step's meta item: which process of which layout saved it
# (`host_layout`), and the digest of the checksums, which names the state.
HOST = 'host'


def data_digest(data: Optional[dict]) -> str:
  return hashlib.sha256(json.dumps(data or {}, sort_keys=True).encode()).hexdigest()


class CheckpointNotFound(UserError):
  """CheckpointConfig.restore_from names no readable checkpoint."""


class NoUsableCheckpoint(UserError):
  """The run has checkpoints and none of them can be read: starting over
  would make its saves delete them (Orbax keeps the newest `keep` it
  saved), so a person decides."""


@dataclasses.dataclass
class Restored:
  step: int
  state: Any
  data: Optional[dict]     # the data iterator's state; None: start the data afresh
  meta: dict
  path: str
  explicit: bool = False   # from CheckpointConfig.restore_from, not from the workdir


@dataclasses.dataclass
class _Tier:
  name: str
  directory: str
  every: int
  keep: int                # steps kept: CheckpointConfig.keep, or fast_keep
  manager: ocp.CheckpointManager
  host: bool = False       # this process's own directory (CheckpointConfig.fast_scope = 'host')


def host_directory(directory: str) -> str:
  """This process's directory in a host-local tier: processes that share a
  machine (one per GPU) share its /dev/shm as well."""
  return os.path.join(directory, f'process-{jax.process_index()}')


def host_layout(tree: Any) -> str:
  """What a host-local copy of `tree` (arrays or ShapeDtypeStructs with
  NamedShardings) depends on: the job's process count, this process's index,
  the mesh, and the blocks of every array this process holds. Equal digests:
  this process can read its copy back onto `tree`'s shardings."""
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  mesh = next((x.sharding.mesh for _, x in leaves if isinstance(getattr(x, 'sharding', None), NamedSharding)), None)
  parts = [jax.process_count(), jax.process_index(), dict(mesh.shape) if mesh is not None else None]
  for path, x in leaves:
    parts.append([jax.tree_util.keystr(path), list(x.shape), str(x.dtype), _held_blocks(x)])
  return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def _held_blocks(x: Any) -> list:
  """The distinct blocks of array `x` this process holds, as (start, stop) per dim."""
  return sorted({tuple(tuple(i.indices(n)[:2]) for i, n in zip(index, x.shape))
                 for index in x.sharding.addressable_devices_indices_map(x.shape).values()})


def held_bytes(tree: Any) -> int:
  """Bytes of the distinct blocks of `tree`'s arrays (or ShapeDtypeStructs
  with shardings) that this process holds: what it writes to a host-local
  tier, at the least."""
  total = 0
  for x in jax.tree.leaves(tree):
    blocks = _held_blocks(x) if getattr(x, 'sharding', None) is not None else [tuple((0, n) for n in x.shape)]
    total += sum(int(np.prod([b - a for a, b in block])) for block in blocks) * np.dtype(x.dtype).itemsize
  return total


def _prints_digest(prints: dict) -> str:
  return hashlib.sha256(json.dumps(prints, sort_keys=True).encode()).hexdigest()[:16]


def _async_options(timeout_s: float) -> ocp.options.AsyncOptions:
  """Orbax's options for saves written in the background: its deadline
  (CheckpointConfig.io_timeout_s, whole seconds), and directories made in
  the save call (see the callers)."""
  return ocp.options.AsyncOptions(timeout_secs=max(1, math.ceil(timeout_s)),
                                  create_directories_asynchronously=False)


# Orbax writes an array replicated over devices in slices, one per replica
# ("replica-parallel"); each slice is cut on its device by a small XLA
# program, compiled per shape, offset and device on a process's first save,
# in the save's blocking part (never cached: under the persistent cache's
# minimum compile time). For a 0.7M-parameter model on 8 data-parallel CPU
# devices that was 264 slices, 56 compiles, 3.9 of the first save's 4.4 s.
# In a single process every slice goes to the same host's disk, so cutting
# a small array gains nothing (microseconds of copy and write): a slice under
# 1 MiB is written whole by one replica there. Across processes the cut is
# what spreads a data-parallel job's write over its hosts (without it, the
# hosts of replica 0 would write the whole state), so it stays as Orbax does
# it. (Orbax leaves replica-parallel off anyway where JAX_PLATFORMS names a
# GPU.)
MIN_SLICE_BYTES = 1 << 20


def _whole_small_slices() -> None:
  """Sets MIN_SLICE_BYTES, in a single-process job, on Orbax's handler of
  jax.Array, which the persistent and shared fast tiers save with (it takes
  the floor only as a constructor argument; replacing the handler would
  drop its metadata store). An Orbax without the setting keeps its own
  behaviour."""
  if jax.process_count() > 1:
    return
  handler = ocp.type_handlers.get_type_handler(jax.Array)
  if getattr(handler, '_min_slice_bytes_for_replica_parallel', 0) is None:
    handler._min_slice_bytes_for_replica_parallel = MIN_SLICE_BYTES


def _host_manager(directory: str, async_save: bool, timeout_s: float) -> ocp.CheckpointManager:
  """An Orbax manager of this process's own directory: every process is its
  own primary host, writes the shards it holds (replica_id=None: not only
  the shards of replica 0), and commits alone (Orbax's recipe for local
  checkpoints, orbax.checkpoint.experimental.emergency). Keeps every step:
  `Checkpointer._host_turn` drops old ones once it is safe."""
  me = jax.process_index()
  os.makedirs(directory, exist_ok=True)   # Orbax creates no root for a subset of processes
  mp = ocp.options.MultiprocessingOptions(primary_host=None, active_processes={me},
                                          barrier_sync_key_prefix=f'mjax_host{me}')
  registry = ocp.type_handlers.create_type_handler_registry(
      (jax.Array, ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False)))
  # Directories made in the save call, not by Orbax's background signalling:
  # its signal keys are named by an operation count that every process's own
  # manager repeats, so one process would take another's "directory made"
  # for its own and write into a directory not there yet (FileNotFoundError
  # in the save thread, seen with 2 processes).
  options = ocp.CheckpointManagerOptions(
      max_to_keep=None, create=False, cleanup_tmp_directories=True, enable_async_checkpointing=async_save,
      multiprocessing_options=mp, async_options=_async_options(timeout_s))
  return ocp.CheckpointManager(directory, options=options, item_handlers={
      'state': ocp.PyTreeCheckpointHandler(multiprocessing_options=mp, type_handler_registry=registry),
      'data': ocp.JsonCheckpointHandler(multiprocessing_options=mp),
      'meta': ocp.JsonCheckpointHandler(multiprocessing_options=mp)})


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


def _read_claim(directory: str) -> dict:
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


def _claim(directory: str) -> Optional[str]:
  """The workdir written in `directory`'s claim (OWNER_FILE), or None."""
  return _read_claim(directory).get('workdir')


def _run_record(workdir: str) -> dict:
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
  return _run_record(workdir).get('run')


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
  found = _run_record(workdir)
  if found:
    return found
  me = os.path.realpath(workdir)
  claims = [_read_claim(d) for d in _claimable(tier_directories(cfg, workdir))]
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
      return _run_record(workdir) or record
  except OSError as e:
    raise ConfigError(f'--workdir {workdir!r}: its run id ({RUN_ID_FILE}) cannot be written: '
                      f'{e.strerror or e}. Free space there or make it writable, or give another --workdir.') from None
  return record


def _with_host_dirs(directory: str) -> list[str]:
  """`directory` and, where it is a host-local tier, its directories per
  process (`host_directory`), each with its own steps and claim."""
  return [directory] + [os.path.join(directory, n) for n in sorted(os.listdir(directory))
                        if n.startswith('process-')]


def _claimable(dirs: dict[str, str]) -> list[str]:
  """The local tier directories that hold claims (`_with_host_dirs`)."""
  return [d for tier in dirs.values() if '://' not in tier and os.path.isdir(tier) for d in _with_host_dirs(tier)]


def earlier_run(directory: str, workdir: str, record: Optional[dict] = None) -> Optional[str]:
  """Where `directory`'s claim names this workdir's path but an earlier run
  there than the one living there now (whose workdir was deleted or moved
  since), that run's id, or 'unknown' for a claim from an mjax before run
  ids (which only a fresh workdir's run can tell apart); else None.
  `record`: this run's {'run', 'fresh'} where known (the trainer's
  processes get it from process 0), else read from the workdir."""
  if _inside(directory, workdir):
    return None   # a tier inside the workdir is its run's, whichever id its claim has
  claim = _read_claim(directory)
  if not claim or os.path.realpath(claim['workdir']) != os.path.realpath(workdir):
    return None
  record = record or _run_record(workdir)
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


def _ancestors(path: str, below: Optional[str] = None):
  """`path`'s real path, then each of its parents up to the root (or, with
  `below`, up to but not including that directory)."""
  path, stop = os.path.realpath(path), below and os.path.realpath(below)
  while path != stop:
    yield path
    parent = os.path.dirname(path)
    if parent == path:
      return
    path = parent


def _enclosing_workdir(directory: str, below: Optional[str] = None) -> Optional[str]:
  """The workdir of the run whose directory holds `directory` (itself or its
  nearest ancestor with an mjax config.json), or None; with `below`, only
  a workdir inside `below`."""
  return next((path for path in _ancestors(directory, below) if is_workdir(path)), None)


def owner(directory: str) -> Optional[str]:
  """The workdir of the run that saves into `directory`, or None (nobody's
  yet; remote directories are not claimed). A directory's claim says it;
  an unclaimed one inside a run's workdir (its default tier, saved before
  default tiers were claimed too) is that run's."""
  if '://' in directory:
    return None
  return _claim(directory) or _enclosing_workdir(directory)


def _inside(directory: str, workdir: str) -> bool:
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
  if _inside(directory, workdir):
    return _enclosing_workdir(directory, below=workdir)
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
  for d in _ancestors(path):
    if os.path.isdir(d) and (os.path.isfile(os.path.join(d, OWNER_FILE)) or is_step_dir(d)):
      what = 'a saved step' if is_step_dir(d) else 'a checkpoint directory'
      return (f'{path!r} is {"" if d == me else f"inside {d!r}, "}{what} of a training run, '
              f'which holds its steps and nothing else (the run would read a new entry as a damaged step, or '
              f'delete it with an old step)')
  return None


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


_PROBE_BYTES = 1 << 20  # a full filesystem refuses a megabyte as surely as a checkpoint
_NO_SPACE = UNWRITABLE[errno.ENOSPC]   # in what Orbax and TensorStore raise and log


def _unwritable(exc: BaseException) -> Optional[str]:
  """The strerror of `exc` (or of an exception it wraps) when it says the
  directory takes no more files, else None."""
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    code = getattr(exc, 'errno', None)
    if code in UNWRITABLE:
      return UNWRITABLE[code]
    text = str(exc)
    found = next((said for said in UNWRITABLE.values() if said in text), None)
    if found:
      return found
    exc = exc.__cause__ or exc.__context__
  return None


def _kept_steps(tier: Any) -> str:
  """The steps a tier holds, as a failed save's message lists them: from
  the disk, since Orbax has already struck the steps beyond `keep` from its
  own list, though they are deleted only after a save commits."""
  try:
    return ', '.join(map(str, steps_in(tier.directory))) or 'none'
  except OSError:
    return 'not readable now'


def _unwritable_error(tier: Any, step: Optional[int], said: str) -> ConfigError:
  """The one paragraph for a save into `tier` that failed with `said` (an
  UNWRITABLE strerror): what failed, the steps kept, what to do."""
  kept = _kept_steps(tier)
  full = said in (_NO_SPACE, 'Disk quota exceeded')
  return ConfigError(
      f'the {tier.name} checkpoint tier ({tier.directory}) ' + ('is full' if full else 'takes no more files') +
      f': a save ({"step " + str(step) + ", or the one before it still being written" if step is not None else "the last one"}) '
      f'failed with "{said}". The steps saved before are intact (saved steps: {kept}); ' +
      ('free space there (older steps can go: a restart resumes from the newest), ' if full else
       'make it writable again, ') +
      f'or point CheckpointConfig.{_tier_key(tier.name)} at another filesystem, then start again: the run '
      f'resumes from the newest of them.')


@contextlib.contextmanager
def _full_disk_is_bad_input(tier: Any, step: Optional[int]):
  """A save that fails because its directory takes no more files (full,
  over quota, remounted read-only, permissions taken away; now, or an
  earlier asynchronous save surfacing here) is bad input, not a crash: a
  restart would fail the same way, so it exits 2 with one message. Orbax
  writes each step into a temporary directory and commits it by a rename,
  so the steps already saved are untouched."""
  try:
    yield
  except Exception as e:   # Orbax wraps the OSError (ValueError: RESOURCE_EXHAUSTED ...)
    said = _unwritable(e)
    if said is None:
      raise
    _FailedSave.said_here.set()   # the save watch has nothing left to say
    raise _unwritable_error(tier, step, said) from None


class _FailedSave:
  """A background save of this process that failed, as Orbax logged it
  (`_FailedIoLogFilter` sees the record): `said` is the strerror where the
  directory takes no more files (bad input), else None (a fault), and
  `error` the exception's own words.

  In a multi-process job such a failure never reaches the main thread
  unless every process shares it: Orbax's finalize thread of the failed
  process goes on to its closing barrier, while the processes whose writes
  succeeded wait in the "write complete" barrier before it. Each waits for
  the other until CheckpointConfig.io_timeout_s (30 minutes by default),
  saying nothing, and the main thread waits on the finalize thread at its
  next save. `Checkpointer._watch_saves` ends the process instead, with the
  message the main thread would have given."""
  seen = threading.Event()
  said_here = threading.Event()   # the main thread raised it itself
  text = ''
  said: Optional[str] = None
  error = ''

  @classmethod
  def note(cls, text: str, said: Optional[str], error: str) -> None:
    if not cls.seen.is_set():
      cls.text, cls.said, cls.error = text, said, error
      cls.seen.set()


def write_problem(directory: str) -> Optional[str]:
  """Why `directory` cannot take files (read-only, full, not a directory, no
  permission), or None. Creates it if needed; remote paths are not probed."""
  if '://' in directory:
    return None
  if os.path.exists(directory) and not os.path.isdir(directory):
    return 'it is a file, not a directory'
  probe = os.path.join(directory, f'.mjax-write-probe-{socket.gethostname()}-{os.getpid()}')
  try:
    os.makedirs(directory, exist_ok=True)
    with open(probe, 'wb') as fh:
      fh.write(b'\0' * _PROBE_BYTES)
      fh.flush()
      os.fsync(fh.fileno())
  except OSError as e:
    return f'{e.strerror or type(e).__name__} ({errno.errorcode.get(e.errno, e.errno)})'
  finally:
    try:
      os.unlink(probe)
    except OSError:
      pass
  return None


def _tier_key(name: str) -> str:
  """The CheckpointConfig field that sets tier `name`'s directory."""
  return 'fast_directory' if name == 'fast' else 'directory'


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
          f'CheckpointConfig.{_tier_key(a)} = {dirs[a]!r} and CheckpointConfig.{_tier_key(b)} = {dirs[b]!r} '
          f'(the {a} and {b} tiers) are {how}: each tier deletes the steps it no longer keeps, so they '
          f'would delete each other\'s. Give the fast tier a directory of its own (leave '
          f'CheckpointConfig.fast_directory unset for one in /dev/shm), or set fast_every = 0.')


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
      key = _tier_key(name)
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
  record = record or _run_record(workdir)
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
    claim = _read_claim(d)
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
  key = _tier_key(name)
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
  where = f'its claim {claim_file!r} says so' if _claim(directory) else 'it lies in that run\'s workdir'
  return (f'CheckpointConfig.{key} = {directory!r} (the {name} tier) holds the checkpoints of another run, '
          f'workdir {other!r} ({where}): two runs there would resume from and delete each other\'s steps. '
          f'Give this run a directory of its own (e.g. one named after the run) or leave '
          f'CheckpointConfig.{key} unset (the default is one per workdir)' +
          (f'; if this is that run moved to a new workdir, delete {OWNER_FILE} there.' if _claim(directory)
           else '.'))


LOCK_FILE = '.mjax-lock'   # in the workdir and each local tier: who holds its run lock (`lock_run`)
UNDRIVEN_LOCK_WAIT_S = 10.0   # a run started by hand waits this long for a holder on its way out
# {real path: [locked descriptor, how many Checkpointers of this process hold it]}:
# flock conflicts between two opens of a directory even in one process.
_held_locks: dict = {}


def _job_tag() -> Optional[str]:
  """A tag of the fault-tolerance job this process belongs to (a hash of its
  heartbeat secret, the same for every attempt of the job), or None."""
  from mjax import protocol
  secret = os.environ.get(protocol.SECRET_ENV)
  return hashlib.sha256(secret.encode()).hexdigest()[:16] if secret else None


def _try_lock(directory: str, wait_s: float) -> Optional[dict]:
  """Takes `directory`'s run lock, waiting up to `wait_s` for a holder to
  let go; None once held (or where the filesystem has no locks), else what
  the holder wrote about itself.

  The flock is on the directory itself, opened read-only: a file held open
  for writing would keep its filesystem from being remounted read-only
  (which a save must see as a failure, not as a busy device). Who holds it
  goes in LOCK_FILE, written whole beside it."""
  import fcntl
  if directory in _held_locks:   # this process holds it already (a second Checkpointer)
    _held_locks[directory][1] += 1
    return None
  try:
    os.makedirs(directory, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
  except OSError:
    return None   # not there and not creatable: check_writable says what is wrong
  deadline, said = time.monotonic() + wait_s, False
  while True:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      break
    except BlockingIOError:
      try:
        with open(os.path.join(directory, LOCK_FILE)) as fh:
          holder = jsonfile.load(fh)
      except (OSError, ValueError):
        holder = {}
      holder = holder if isinstance(holder, dict) else {}
      if time.monotonic() >= deadline:
        os.close(fd)
        return holder
      if not said:
        print(f'mjax: {directory} is in use by another run ({_describe_holder(holder)}); waiting up to '
              f'{wait_s:.0f} s for it to end', file=sys.stderr, flush=True)
        said = True
      time.sleep(0.5)
    except OSError:   # no flock on this filesystem (some network ones): unguarded, as before
      os.close(fd)
      return None
  try:
    jsonfile.write_atomic(os.path.join(directory, LOCK_FILE),
                          {'pid': os.getpid(), 'host': socket.gethostname(), 'started': time.time(),
                           'job': _job_tag()})
  except OSError:
    pass   # a read-only directory: check_writable says so
  _held_locks[directory] = [fd, 1]
  return None


def unlock_run(directories: list[str]) -> None:
  """Lets go of the run locks `lock_run` took (a Checkpointer's close)."""
  for d in directories:
    held = _held_locks.get(d)
    if held is None:
      continue
    held[1] -= 1
    if held[1] == 0:
      del _held_locks[d]
      try:   # removed while still held: a new holder's note is never the one removed
        os.remove(os.path.join(d, LOCK_FILE))
      except OSError:
        pass
      os.close(held[0])   # closing the descriptor releases its flock


def _describe_holder(holder: dict) -> str:
  pid, host = holder.get('pid', '?'), holder.get('host', '?')
  started = holder.get('started')
  try:   # a damaged lock file's value is no time: left out
    since = (f', since {time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))}'
             if isinstance(started, (int, float)) and not isinstance(started, bool) else '')
  except (ValueError, OverflowError, OSError):
    since = ''
  return f'process {pid} on {host}{since}'


DRIVEN_LOCK_WAIT_S = 120.0   # under the driver: how long process 0 waits for holders, all directories together
SAME_JOB_LOCK_WAIT_S = 30.0  # ... for an earlier attempt of its own job, before it goes on without the lock


def lock_run(dirs: dict[str, str], workdir: str, timeout_s: float = 300.0) -> list[str]:
  """Raises ConfigError, in every process alike, unless process 0 gets the
  run lock of the workdir and of each local tier directory: two runs saving
  into one directory at once would delete and overwrite each other's steps.

  A lock is an flock, held until the Checkpointer closes or process 0 exits,
  whatever ends it (even SIGKILL). Process 0 of a restarted attempt may
  start while the last attempt's is still on its way out: under the
  fault-tolerance driver it waits up to DRIVEN_LOCK_WAIT_S in all (well
  inside the driver's start-up timeout), and a holder of the same job (an
  earlier attempt that outlived its kill) is warned about after
  SAME_JOB_LOCK_WAIT_S rather than refused. The other processes wait for
  process 0's verdict longer than it can take. Returns the directories
  locked (for `unlock_run`). Where a filesystem has no flock, or one that
  only this host sees (NFS without lock support), nothing is guarded.
  """
  from mjax import protocol
  driven = bool(os.environ.get(protocol.DRIVER_ADDRESS_ENV))
  budget = min(timeout_s, DRIVEN_LOCK_WAIT_S) if driven else UNDRIVEN_LOCK_WAIT_S
  mine, locked = None, []
  if jax.process_index() == 0:
    deadline = time.monotonic() + budget
    paths = {os.path.realpath(workdir): workdir}
    for d in dirs.values():
      if '://' not in d:
        paths.setdefault(os.path.realpath(d), d)
    try:
      for real, d in paths.items():
        holder = _try_lock(real, 0.0)
        same_job = (driven and holder is not None and holder.get('job') is not None
                    and holder.get('job') == _job_tag())
        if holder is not None:
          left = max(0.0, deadline - time.monotonic())
          holder = _try_lock(real, min(left, SAME_JOB_LOCK_WAIT_S) if same_job else left)
        if holder is None:
          locked.append(real)
          continue
        if same_job:
          print(f'mjax: warning: {d} is still locked by an earlier attempt of this job '
                f'({_describe_holder(holder)}); going on without its lock', file=sys.stderr, flush=True)
          continue
        mine = (f'{d} is in use by another run: {_describe_holder(holder)} holds its lock '
                f'({os.path.join(d, LOCK_FILE)}). Two runs saving there at once would delete and overwrite '
                f'each other\'s checkpoints. Wait for that run to end or stop it, or give this run another '
                f'workdir (and checkpoint directories of its own).')
        break
    except Exception as e:   # whatever it is, every process hears of it (none waits out the barrier)
      mine = f'taking the run lock of {workdir!r} failed: {type(e).__name__}: {e}'
  try:
    reports = distributed.report_exceptions('ckpt/probe/lock', mine, budget + timeout_s)
  except BaseException:
    unlock_run(locked)
    raise
  if reports:
    unlock_run(locked)
    raise ConfigError(reports[min(reports)])
  return locked


def check_not_inside_a_tier(workdir: str) -> None:
  """Raises ConfigError where the workdir is, or lies inside, another run's
  checkpoint directory (it holds that run's claim, OWNER_FILE): that run's
  clean-up of its old steps would delete this one, and this run's files
  would hide its steps."""
  me = os.path.realpath(workdir)
  for path in _ancestors(workdir):
    claim = _claim(path)
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
  other = _enclosing_workdir(os.path.dirname(me))
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
          f'CheckpointConfig.{_tier_key(name)} = {directory!r} (the {name} tier) is not seen by '
          f'process(es) {blind} of {jax.process_count()}: they do not see the file process 0 wrote '
          f'there, which the others do, so the hosts of those processes do not mount it (or mount '
          f'something else there): under mjax-launch the job restarts without them.', blind)
    if blind:
      key = _tier_key(name)
      raise ConfigError(
          f'CheckpointConfig.{key} = {directory!r} (the {name} tier) is not shared by every process: '
          f'process(es) {blind} of {jax.process_count()} do not see the file process 0 wrote there, so '
          f'their checkpoint shards would never be committed. A multi-host job needs this tier '
          f'on a filesystem all hosts mount at the same path'
          + ("; set CheckpointConfig.fast_scope = 'host' to keep a copy per process in each "
             "one's own directory (host memory), point CheckpointConfig.fast_directory at a shared "
             'path, or set fast_every = 0 to turn the fast tier off.' if name == 'fast' else '.'))


def _words(x: jax.Array) -> jax.Array:
  """The array's bits as uint32 words, one per element, same shape."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}.get(x.dtype.itemsize)
  if bits is None:  # 8-byte types: fold the two halves
    halves = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return halves[..., 0] ^ (halves[..., 1] * jnp.uint32(0x9E3779B1))
  return jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32)


# Multipliers that turn an element's coordinates into a position weight
# (no flat index: one stacked array of a 500B model has more than 2^32 elements).
_AXIS_WEIGHTS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1, 0xD3A2646C, 0xFD7046C5)


@jax.jit
def _fingerprints(leaves: list) -> jax.Array:
  # Per array: the wrapping sum of its words, and of words x a weight of
  # their position. Any single flipped bit changes the first; moved elements
  # change the second. Integer sums of the global array: the same numbers on
  # any mesh and in any reduction order.
  out = []
  for x in leaves:
    w = _words(x)
    pos = jnp.ones(w.shape, jnp.uint32)
    for k in range(w.ndim):
      pos = pos + jax.lax.broadcasted_iota(jnp.uint32, w.shape, k) * jnp.uint32(_AXIS_WEIGHTS[k % 7])
    out.append(jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * pos, dtype=jnp.uint32)]))
  return jnp.stack(out) if out else jnp.zeros((0, 2), jnp.uint32)


def fingerprints(state: Any) -> dict[str, list[int]]:
  """{array path: [sum, weighted sum]} of every array in `state`, computed on
  the devices (one pass over the state, a few numbers back to the host)."""
  paths, leaves = zip(*jax.tree_util.tree_leaves_with_path(state)) if jax.tree.leaves(state) else ((), ())
  values = np.asarray(jax.device_get(_fingerprints(list(leaves))))
  return {jax.tree_util.keystr(p): [int(a), int(b)] for p, (a, b) in zip(paths, values)}


def first_mismatch(expected: dict, state: Any, partial: bool = False) -> Optional[str]:
  """The first array of `state` whose fingerprint differs from `expected`.
  `partial`: `state` holds only some of the saved arrays; check those."""
  got = fingerprints(state)
  for key, want in expected.items():
    if (key in got or not partial) and got.get(key) != want:
      return key
  return None


def _no_size_logging_notice(record: logging.LogRecord) -> bool:
  # Orbax's warning on every save of a host-local tier (each process its
  # own primary host): it crowded the lines that matter out of the
  # driver's last_logs of a fault.
  return not record.getMessage().startswith('Global object size logging disabled')


def _read_only_notice(record: logging.LogRecord) -> bool:
  return not record.getMessage().startswith('Given directory is read only')


def _no_item_metadata_warning(record: logging.LogRecord) -> bool:
  # (The second: a step whose tree metadata cannot be read, which the
  # verdict says with the file's name.)
  return not record.getMessage().startswith(('Metadata file does not exist', 'Failed to get item metadata'))


def _tree_metadata_missing(step_path: str) -> Optional[str]:
  """'state/_METADATA: missing' when a step has lost the file Orbax reads its
  state's tree from (every later error then names no file), else None."""
  if '://' in step_path or not os.path.isdir(os.path.join(step_path, 'state')):
    return None   # a bucket's step (no local look), or a step gone whole: the read's error says it
  return None if os.path.exists(os.path.join(step_path, 'state', '_METADATA')) else 'state/_METADATA: missing'


class BadRecord(Exception):
  """A step's JSON record that is missing or not JSON; says which."""


def step_json(step_path: str, rel: str, record: bool = True) -> Any:
  """A JSON record of a saved step (e.g. 'meta/metadata'), or BadRecord
  naming it: the bare decoder error (UnicodeDecodeError at byte 3) said
  neither which file nor what it means. `record`: it must be an object."""
  try:
    with open(os.path.join(step_path, rel), 'rb') as fh:
      raw = fh.read()
  except OSError as e:
    raise BadRecord(f'{rel}: {"missing" if isinstance(e, FileNotFoundError) else (e.strerror or e)}') from None
  try:
    out = jsonfile.loads(raw.decode('utf-8'))
  except ValueError as e:   # UnicodeDecodeError is one
    raise BadRecord(f'{rel} is not JSON (damaged or overwritten: {type(e).__name__} at byte '
                     f'{getattr(e, "start", getattr(e, "pos", "?"))})') from None
  if record and not isinstance(out, dict):
    raise BadRecord(f'{rel} is JSON but not a record (a {type(out).__name__})')
  return out


def verify_step(path: str) -> tuple[str, str]:
  """Reads one saved step without a mesh and checks it against its checksums.

  Returns:
    (verdict, detail): 'ok', 'damaged' (detail names the arrays),
    'unreadable' (the error) or 'unchecked' (saved without checksums).
  """
  quiet_failed_io_aftermath()   # a damaged step's failed reads, said once
  try:
    meta = step_json(path, 'meta/metadata')
    saved = meta.get(FINGERPRINTS)
    data = None
    if os.path.exists(os.path.join(path, 'data', 'metadata')):
      data = step_json(path, 'data/metadata', record=False)
    # Host arrays, whatever devices and mesh saved them: this runs on a login
    # node as well as next to a job that holds the GPUs. Read as an item, the
    # state has no step metadata of its own, which Orbax warns of every time.
    reader = ocp.PyTreeCheckpointer()
    absl_log = logging.getLogger('absl')
    absl_log.addFilter(_no_item_metadata_warning)
    try:
      item = reader.metadata(os.path.join(path, 'state')).item_metadata
      if item is None:
        raise BadRecord(_tree_metadata_missing(path) or
                        "state/_METADATA: the state's tree metadata cannot be read (damaged)")
      tree = item.tree
      state = reader.restore(os.path.join(path, 'state'), restore_args=jax.tree.map(
          lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))
    finally:
      absl_log.removeFilter(_no_item_metadata_warning)
      reader.close()
  except BadRecord as e:
    return 'unreadable', str(e)
  except Exception as e:  # any reason the step cannot be read is the verdict
    return 'unreadable', read_error(e)
  if not saved:
    return 'unchecked', 'saved without checksums'
  # Read without the train state's classes, the tree's names differ from the
  # saved ones (dicts for dataclasses): match the checksums as a multiset.
  want = collections.Counter(tuple(v) for v in saved.values())
  try:  # the host's CPU, not an accelerator a running job may hold
    cpu = jax.devices('cpu')[0]
  except RuntimeError:  # JAX_PLATFORMS leaves the CPU out
    cpu = None
  with jax.default_device(cpu):
    got = fingerprints(state)
  bad = []
  for key, value in got.items():
    if want[tuple(value)]:
      want[tuple(value)] -= 1
    else:
      bad.append(key)
  if bad or len(got) != len(saved):
    return 'damaged', (', '.join(bad) or f'{len(saved)} arrays saved, {len(got)} read')
  if DATA_SHA256 in meta and meta[DATA_SHA256] != data_digest(data or None):
    return 'damaged', 'the data position (data/metadata) does not match its checksum'
  return 'ok', f'{len(got)} arrays match their checksums, and the data position too'


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
  run = _run_record(workdir)
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
  fast = local.get('fast')
  if not os.path.lexists(record) and not ours and fast is not None and not _inside(fast, workdir) and \
      not steps.get('persistent') and '://' not in tiers['persistent']:
    # A workdir with no run in it whose fast tier, outside it and claimed by
    # this path (another's is check_owner's), holds steps while the
    # persistent tier holds none: an earlier run's at this path, whose
    # workdir was deleted or moved (the default fast tier is named after the
    # workdir's path and outlives it in /dev/shm). A new run would resume
    # that run's state as its own. A host-local tier keeps its steps, and
    # its claims, in a directory per process.
    dirs = _with_host_dirs(fast)
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


# ----------------------------------------------------------------------------
# Single-replica restore
# ----------------------------------------------------------------------------
# Orbax has one (type_handlers.SingleReplicaArrayHandler with
# SingleReplicaArrayRestoreArgs), and it runs between CPU processes here, but
# two of its properties rule it out for mjax (orbax-checkpoint 0.12.8):
#  - it is not bit-exact: its broadcast sums the replicas in the array's own
#    dtype (_src/multihost/multislice.py, _sum_over_replica_axis), and
#    -0.0 + 0.0 = +0.0, so a negative zero arrives as a positive one on every
#    replica: the state differs from the one saved, and its checksums (see
#    `fingerprints`) call a sound checkpoint damaged;
#  - it reads and broadcasts in one call (_src/serialization/
#    jax_array_handlers.py, _single_replica_deserialize_and_broadcast): when
#    the reading replica fails (a truncated file) it raises, while the other
#    replicas already wait in the broadcast's collective; the job hangs until
#    the coordination service aborts it, instead of falling back a step.
# So the reading replica reads with Orbax's ordinary handler onto its own
# devices, every process learns whether that went well (coordination
# service, `restore_latest`), and one jitted sum over the data axis of the
# arrays' bits as unsigned integers (x + 0 is exact for integers; the other
# replicas contribute zeros) puts the state onto the target shardings, as
# multislice.broadcast_one_replica_to_all does with floats.

REPLICA_AXIS = 'data'
# Bytes per device that one broadcast program moves: bounds the temporary
# buffers (the replica's copy, the zeros, the result) to a few times this.
_BROADCAST_CHUNK_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class ReplicaPlan:
  """How one data-parallel replica restores the state for all of them."""
  mesh: Mesh             # the state's mesh
  replica_mesh: Mesh     # its devices at data index 0 (the `data` axis kept, size 1)
  replicas: int          # size of the `data` axis
  source: bool           # this process holds devices of the reading replica


def _spec_axes(spec: PartitionSpec) -> set:
  return {a for entry in spec for a in (entry if isinstance(entry, tuple) else (entry,))}


def replica_plan(abstract_state: Any) -> Optional[ReplicaPlan]:
  """The single-replica plan for restoring `abstract_state`, or None when
  every process should read the shards its own devices hold:
    - one process: Orbax already reads each distinct shard once per process
      and copies it to every local device that holds it;
    - a `data` axis of size 1, or an array sharded over it: nothing to share;
    - a process holding devices of several replicas: it would read a whole
      replica anyway, so sending it one saves nothing.

  Args:
    abstract_state: ShapeDtypeStructs with NamedShardings on one mesh.
  """
  leaves = jax.tree.leaves(abstract_state)
  shardings = [getattr(x, 'sharding', None) for x in leaves]
  if jax.process_count() == 1 or not leaves or not all(isinstance(s, NamedSharding) for s in shardings):
    return None
  mesh = shardings[0].mesh
  if (not isinstance(mesh, Mesh) or REPLICA_AXIS not in mesh.axis_names or mesh.shape[REPLICA_AXIS] < 2
      or any(s.mesh != mesh or REPLICA_AXIS in _spec_axes(s.spec) for s in shardings)):
    return None
  axis = mesh.axis_names.index(REPLICA_AXIS)
  replicas_of = collections.defaultdict(set)
  for index, device in np.ndenumerate(mesh.devices):
    replicas_of[device.process_index].add(index[axis])
  if any(len(r) > 1 for r in replicas_of.values()):
    return None
  first = np.take(mesh.devices, [0], axis=axis)
  return ReplicaPlan(mesh=mesh, replica_mesh=Mesh(first, mesh.axis_names, axis_types=mesh.axis_types),
                     replicas=mesh.shape[REPLICA_AXIS],
                     source=jax.process_index() in {d.process_index for d in first.flat})


def on_replica(plan: ReplicaPlan, abstract_state: Any) -> Any:
  """`abstract_state` with the same specs on the reading replica's devices."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(plan.replica_mesh, x.sharding.spec)), abstract_state)


def _to_words(x: jax.Array) -> jax.Array:
  """The array's bits as unsigned integers of a width every collective
  library reduces (NCCL has no 16-bit unsigned type): 2-byte elements
  become two uint8, 8-byte ones two uint32 (a trailing axis)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint8)
  return jax.lax.bitcast_convert_type(x, jnp.uint32 if x.dtype.itemsize % 4 == 0 else jnp.uint8)


def _from_words(w: jax.Array, dtype) -> jax.Array:
  return w != 0 if dtype == jnp.bool_ else jax.lax.bitcast_convert_type(w, dtype)


def _merge(words: list, dtypes: tuple) -> list:
  # Integer sums: only the reading replica's words are non-zero, so each sum
  # is that replica's words, bit for bit (NaN payloads and -0.0 included).
  return [_from_words(jnp.sum(w, axis=0, dtype=w.dtype), d) for w, d in zip(words, dtypes)]


def _globalized(plan: ReplicaPlan, target: jax.ShapeDtypeStruct, replica: Optional[jax.Array]) -> jax.Array:
  """A (replicas, *words) array over the whole mesh: the reading replica's
  words at index 0, zeros elsewhere (allocated on each device)."""
  words = jax.eval_shape(_to_words, jax.ShapeDtypeStruct(target.shape, target.dtype))
  spec = tuple(target.sharding.spec) + (None,) * (words.ndim - len(target.sharding.spec))
  sharding = NamedSharding(plan.mesh, PartitionSpec(REPLICA_AXIS, *spec))
  shape = (plan.replicas, *words.shape)
  mine = {s.device: s.data for s in replica.addressable_shards} if replica is not None else {}
  buffers = []
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    if device in mine:   # same spec on a mesh that differs only in `data`: the same block
      buffers.append(_to_words(mine[device])[None])
    else:
      block = tuple(len(range(*i.indices(n))) for i, n in zip(index, shape))
      buffers.append(jnp.zeros(block, words.dtype, device=device))
  return jax.make_array_from_single_device_arrays(shape, sharding, buffers)


def _chunks(targets: list, budget: int) -> list[tuple[int, int]]:
  """[start, end) ranges of `targets` whose per-device bytes stay within
  `budget` (a larger array goes alone)."""
  out, start, used = [], 0, 0
  for i, t in enumerate(targets):
    nbytes = math.prod(t.sharding.shard_shape(t.shape)) * np.dtype(t.dtype).itemsize
    if i > start and used + nbytes > budget:
      out.append((start, i))
      start, used = i, 0
    used += nbytes
  return out + ([(start, len(targets))] if start < len(targets) else [])


def broadcast_from_replica(plan: ReplicaPlan, replica_state: Any, abstract_state: Any,
                           chunk_bytes: int = _BROADCAST_CHUNK_BYTES) -> Any:
  """The reading replica's state on every replica, bit for bit. A collective:
  every process calls it.

  Args:
    plan: from `replica_plan(abstract_state)`.
    replica_state: the state on `plan.replica_mesh` (`on_replica`) in the
      reading replica's processes; None elsewhere. Its arrays are deleted.
    abstract_state: the target shapes, dtypes and shardings.
  Returns:
    The state with `abstract_state`'s shardings.
  """
  targets, treedef = jax.tree.flatten(abstract_state)
  sources = jax.tree.leaves(replica_state) if plan.source else [None] * len(targets)
  if len(sources) != len(targets):
    raise ValueError(f'the replica\'s state has {len(sources)} arrays, the target {len(targets)}')
  out = []
  for start, end in _chunks(targets, chunk_bytes):
    part = targets[start:end]
    words = [_globalized(plan, t, s) for t, s in zip(part, sources[start:end])]
    for s in sources[start:end]:
      if s is not None:
        s.delete()   # the words hold a copy: free the replica's before the result is made
    merge = jax.jit(_merge, static_argnums=1, out_shardings=[t.sharding for t in part])
    out.extend(merge(words, tuple(np.dtype(t.dtype) for t in part)))
    del words
  return jax.tree.unflatten(treedef, out)


# The restores of this process; every process of a job makes the same ones in
# the same order, so the count keeps their agreement keys new to the job.
_RESTORE_ROUNDS = itertools.count()


def _restore_key(n: int, key: str) -> str:
  return f'ckpt/{key}' if n == 0 else f'ckpt/again{n}/{key}'


def read_error(e: BaseException) -> str:
  """One line on why a read failed. TensorStore's own error is mostly the
  store's spec (pages of JSON, 'See full TensorStore details'); the error it
  wraps names the array, the file and what is wrong with it (e.g.
  'OUT_OF_RANGE: Error reading "params.embedding/0.0" ... not valid for
  value of size 100'), so the innermost cause that says something wins."""
  if isinstance(e, BadRecord):
    return str(e)
  chain, x = [], e
  while x is not None and len(chain) < 8:
    chain.append(x)
    # A context raised `from None` is an implementation detail (json's
    # decoder leaves StopIteration(0) there): never the reason to show.
    x = x.__cause__ or (None if x.__suppress_context__ else x.__context__)
  for x in reversed(chain):
    first = str(x).splitlines()[0] if str(x) else ''
    shapes = re.search(r'Requested shape: (\(.*?\)) is not compatible with the stored shape: (\(.*?\))', first)
    if shapes:
      # Orbax's advice (`strict=False`, padding and truncation) is for its
      # own callers: a model of another shape is never what to restore.
      return (f'an array is {shapes.group(2)} in the checkpoint and {shapes.group(1)} in this config: the '
              f'checkpoint holds a model of another shape; compare ModelConfig with the config.gin of the '
              f'run that saved it')
    if first and 'TensorStore details' not in first:
      return f'{type(x).__name__}: {first}'[:500]
  # Only the store's spec: its kvstore paths name the step's directory and,
  # last, the array ('opt_state.1.mu.layers.block_0.attn.query.kernel/').
  text = str(e)
  paths = re.findall(r"'path': '([^']*)'", text)
  head = text.splitlines()[0].split(' See full TensorStore details')[0] if text else ''
  if len(paths) > 1:
    head += f' (array {paths[-1].rstrip("/")!r} in {paths[0]})'
  elif paths:
    head += f' (in {paths[0]})'
  return f'{type(e).__name__}: {head}'[:500]


def read_step(manager: ocp.CheckpointManager, step: int, abstract_state: Any, path: str,
              plan: Optional[ReplicaPlan], host: bool = False) -> Restored:
  """Reads one saved step. Without a plan every process reads the shards
  its devices hold; with one, only the reading replica's processes read the
  state, onto that replica's devices (`broadcast_from_replica` then sends
  it), and elsewhere `Restored.state` is None. Not a collective: a failure
  here leaves no other process waiting. `host`: `manager` is this process's
  host-local tier (no plan: each process reads its own copy)."""
  if '://' not in path:
    # The step's JSON records first: read by Orbax, a damaged one is a bare
    # decoder error, a missing one pages of a tree mismatch.
    step_json(path, 'meta/metadata')
    if os.path.isdir(os.path.join(path, 'data')):
      step_json(path, 'data/metadata', record=False)
  if host:
    items = {'state': ocp.args.PyTreeRestore(
        item=abstract_state, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state))}
  else:
    items = {'state': ocp.args.StandardRestore(abstract_state)} if plan is None else {}
  out = manager.restore(step, args=ocp.args.Composite(**items, data=ocp.args.JsonRestore(),
                                                      meta=ocp.args.JsonRestore()))
  state = out['state'] if plan is None else None
  if plan is not None and plan.source:
    # The handler, not a Checkpointer: a Checkpointer's restore ends at a
    # barrier of every process, which the other replicas never reach.
    handler = ocp.StandardCheckpointHandler()
    try:
      state = handler.restore(epath.Path(path) / 'state',
                              args=ocp.args.StandardRestore(on_replica(plan, abstract_state)))
    finally:
      handler.close()
  return Restored(step=int(step), state=state, data=out['data'] or None, meta=out['meta'] or {}, path=path)


# What Orbax's failed read of an array says (its read tasks' exceptions).
READ_FAILED = 'Encountered error while reading array index'


# Where Orbax's background save thread logs the failure of a save's writes.
_ORBAX_SAVE_THREAD_FILE = 'async_checkpointer.py'


class _FailedIoLogFilter(logging.Filter):
  """Drops Orbax's own error logs (with their tracebacks, one per thread of
  the save) of a write that found the disk full or unwritable:
  `_full_disk_is_bad_input` reports that once, naming the tier and the
  steps kept. Drops too asyncio's report of each read task of a damaged
  step (a truncated file: one traceback of ~80 lines per array, up to
  hundreds, as the collector finds them): the restore says why the step
  cannot be used once (`read_error`) and falls back."""

  def filter(self, record: logging.LogRecord) -> bool:
    # asyncio's: a write task of the failed save, or a read task of the
    # failed restore, collected with its error never retrieved ("Task
    # exception was never retrieved").
    text = record.getMessage()
    exc = record.exc_info[1] if record.exc_info else None
    if record.name == 'asyncio':
      # A task names its coroutine (Orbax's) in the message; a bare future
      # ("Future exception was never retrieved") only in its error's frames.
      frames = traceback.extract_tb(exc.__traceback__) if exc is not None else []
      where = text + ' '.join(f.filename for f in frames)
    else:
      where = record.pathname
    if f'{os.sep}orbax{os.sep}' not in where:
      return True
    if exc is not None:
      text += f' {exc}'
    if record.name == 'asyncio' and READ_FAILED in text:
      return False
    said = next((said for said in UNWRITABLE.values() if said in text), None)
    # Orbax's record of a failed background save (its save thread's, with
    # the exception): what `Checkpointer._watch_saves` acts on. A failure in
    # the main thread is raised there; one Orbax logs and goes on from (an
    # old step it could not delete) is no failed save.
    if os.path.basename(record.pathname) == _ORBAX_SAVE_THREAD_FILE and record.levelno >= logging.ERROR and \
        record.exc_info and record.exc_info[1] is not None and record.threadName != 'MainThread':
      exc = record.exc_info[1]
      if isinstance(exc, TimeoutError) and 'barrier' in str(exc):
        # This process's writes went well; the barrier after them failed,
        # because another process left (its own log says why) or never came.
        # One line, not Orbax's traceback through jax's barrier.
        record.msg, record.args, record.exc_info, record.exc_text = (
            f'[process={jax.process_index()}] a checkpoint save\'s writes are done here, but the processes '
            f'did not all finish theirs ({exc}): another process of the job left or is stuck; its log says why.',
            None, None, None)
        return True
      first = (str(exc).strip().splitlines() or [''])[0]
      _FailedSave.note(text, said, f'{type(exc).__name__}: {first}'[:500])
    return said is None


def quiet_failed_io_aftermath() -> None:
  """Keeps a save that found the disk full, or a restore of a damaged step,
  to one message.

  Orbax logs the failed write from each of its save threads, with a
  traceback. Then it closes its asyncio loop while TensorStore is still
  finishing the save's other writes; each completion's callback into the
  closed loop raises RuntimeError('Event loop is closed') in a TensorStore
  thread, which Python reports as unraisable: one traceback per array (58 for
  `tiny`, ~330 lines in all before the message that matters). The log
  filter drops Orbax's records that say the disk is full; the hook drops a
  closed loop's refusal of a late callback (raised in asyncio's
  call_soon_threadsafe, which nothing can act on once the loop is gone) and
  hands every other unraisable exception on.
  """
  for logger in (logging.getLogger('absl'), logging.getLogger('asyncio')):
    if not any(isinstance(f, _FailedIoLogFilter) for f in logger.filters):
      logger.addFilter(_FailedIoLogFilter())
  # A restore that fails on one array leaves Orbax's reads of the others
  # unstarted: each coroutine, collected, warns "was never awaited" (seen in
  # about one fallback in six, after the fallback had been said).
  warnings.filterwarnings('ignore', message=r"coroutine '_read_array_index_and_device_put' was never awaited",
                          category=RuntimeWarning)
  previous = sys.unraisablehook
  if getattr(previous, 'mjax_closed_loop_filter', False):
    return

  def hook(unraisable):
    exc = unraisable.exc_value
    if isinstance(exc, RuntimeError) and str(exc) == 'Event loop is closed' and \
        any(f.name == 'call_soon_threadsafe' for f in traceback.extract_tb(exc.__traceback__)):
      return
    # A read that failed leaves its sibling reads' coroutines to be closed
    # by the collector, each reporting the failure again: the read's error
    # itself has been said (read_error).
    if str(exc).startswith(READ_FAILED) and \
        isinstance(exc.__cause__, GeneratorExit):
      return
    previous(unraisable)

  hook.mjax_closed_loop_filter = True
  sys.unraisablehook = hook


class Checkpointer:
  """Saves and restores train state, data-iterator state and config."""

  def __init__(self, cfg: CheckpointConfig, workdir: str, run: Optional[dict] = None):
    """`run`: the run's id record from process 0 (`ensure_run_id`), else read from the workdir."""
    self.cfg = cfg
    self.workdir = workdir
    self.tiers: list[_Tier] = []
    self._unusable: set[tuple[str, int]] = set()   # (tier, step) that failed to restore
    self._host_saves = itertools.count()            # this process's host-tier saves (barrier names)
    self.is_main = jax.process_index() == 0
    self._locked: list[str] = []
    self._closed = threading.Event()
    # The exit status for the save watch, where the run is already ending
    # for a reason of its own (a non-finite loss: 3, rolled back).
    self.leave_status: Optional[int] = None
    quiet_failed_io_aftermath()
    dirs = tier_directories(cfg, workdir, strict=True)
    host = {'fast'} if cfg.fast_scope == 'host' and 'fast' in dirs else set()
    dirs = {name: host_directory(d) if name in host else d for name, d in dirs.items()}
    check_apart(dirs)
    check_not_inside_a_tier(workdir)
    check_writable(dirs)
    check_owner(dirs, workdir, record=run)
    self._locked = lock_run(dirs, workdir)
    try:
      self._open_tiers(cfg, dirs, host)
    except BaseException:
      unlock_run(self._locked)
      raise
    if jax.process_count() > 1 and cfg.async_save:
      _FailedSave.seen.clear()
      _FailedSave.said_here.clear()
      threading.Thread(target=self._watch_saves, name='mjax-save-watch', daemon=True).start()

  # How long the save watch gives the main thread to report a failed save
  # itself (it does when every process's save failed: their finalize threads
  # then meet in the same barrier, and the error reaches the next save).
  SAVE_WATCH_GRACE_S = 5.0

  def _watch_saves(self) -> None:
    """(A thread, in multi-process jobs.) Ends this process, with the
    message its main thread would give, once a background save of its own
    found its directory full or unwritable (`_FailedSave`): a failure no
    other process shares hangs the job in Orbax's barriers otherwise. The
    failed process leaving is what ends the others: the launcher, the
    fault-tolerance driver (exit status 2: not restarted) or, failing both,
    jax's coordination service when the process's heartbeats stop."""
    while not _FailedSave.seen.wait(1.0):
      if self._closed.is_set():
        return
    if _FailedSave.said_here.wait(self.SAVE_WATCH_GRACE_S) or self._closed.is_set():
      return
    tier, step = self._failed_save_at(_FailedSave.text)
    here = f'process {jax.process_index()} of {jax.process_count()}'
    if self.leave_status is not None:   # the run is ending for a reason of its own (a NaN): that one's status
      self._leave(f'a save into the {tier.name} checkpoint tier ({tier.directory}) failed in {here} '
                  f'({_FailedSave.said or _FailedSave.error}) while the run was ending; the steps saved before '
                  f'are intact.', self.leave_status)
      return
    if _FailedSave.said is not None:
      error = _unwritable_error(tier, step, _FailedSave.said)
      self._leave(f'{error} ({here.capitalize()} found it while the others waited for its save: it leaves now, '
                  f'which ends the job.)', protocol.EXIT_USER_ERROR)
      return
    kept = _kept_steps(tier)
    self._leave(
        f'a save into the {tier.name} checkpoint tier ({tier.directory}) '
        f'{"(step " + str(step) + ") " if step is not None else ""}failed in {here}, the others waiting for it: '
        f'{_FailedSave.error}. The steps saved before are intact (saved steps: {kept}). This process leaves now '
        f'(exit status 1, a fault: the fault-tolerance driver restarts the job from the newest of them) rather '
        f'than wait CheckpointConfig.io_timeout_s in Orbax\'s barriers; if it recurs, check that filesystem '
        f'from this process\'s host.', protocol.EXIT_FAILED)

  def _failed_save_at(self, text: str) -> tuple[_Tier, Optional[int]]:
    """The tier and step of a failed save from Orbax's record of it, which
    names the step's temporary directory; the first tier and no step where
    it names none."""
    for tier in sorted(self.tiers, key=lambda t: -len(t.directory)):
      found = re.search(re.escape(tier.directory.rstrip(os.sep)) + re.escape(os.sep) + r'(\d+)\b', text)
      if found:
        return tier, int(found.group(1))
      if tier.directory in text:
        return tier, None
    return self.tiers[0], None

  def _leave(self, message: str, status: int) -> None:
    """Says `message` as the entry point would say an error (and tells a
    supervising driver, which reports it) and ends the process now with
    `status`: the main thread is stuck in Orbax's wait, and a normal exit
    would wait there too. What the run keeps is on disk: the steps saved
    before, and its logs, written a line at a time."""
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else 'mjax'
    try:
      print(f'{prog}: error: {message}', file=sys.stderr, flush=True)
      sys.stdout.flush()
      if status == protocol.EXIT_USER_ERROR and protocol.under_driver():
        protocol.Facts(self.workdir, jax.process_index()).record(protocol.USER_ERROR, message)
    finally:
      os._exit(status)

  def _open_tiers(self, cfg: CheckpointConfig, dirs: dict[str, str], host: set) -> None:
    check_shared({name: d for name, d in dirs.items() if name not in host})
    _whole_small_slices()
    for name, directory in dirs.items():
      keep, every = (cfg.keep, cfg.save_every) if name == 'persistent' else (cfg.fast_keep, cfg.fast_every)
      if name in host:
        absl_log = logging.getLogger('absl')
        if _no_size_logging_notice not in absl_log.filters:
          absl_log.addFilter(_no_size_logging_notice)
        self.tiers.append(_Tier(name, directory, every, keep,
                                _host_manager(directory, cfg.async_save, cfg.io_timeout_s), host=True))
        continue
      # Orbax names its multi-process barriers by step ('async_write_complete.4'):
      # two tiers saving the same step would meet in one barrier and fail
      # ("already ongoing"). A prefix per tier keeps their barriers apart.
      # Directories made in the save call, not in Orbax's background: there,
      # a directory that takes no more files (read-only, permissions gone)
      # left its threads waiting 20 minutes for a "directory made" signal
      # and the process unable to exit; here it is one error (see
      # _full_disk_is_bad_input).
      options = ocp.CheckpointManagerOptions(
          max_to_keep=keep, create=True, cleanup_tmp_directories=True,
          enable_async_checkpointing=cfg.async_save,
          multiprocessing_options=ocp.options.MultiprocessingOptions(
              barrier_sync_key_prefix=f'mjax_{name}'),
          async_options=_async_options(cfg.io_timeout_s))
      manager = ocp.CheckpointManager(directory, options=options, item_names=('state', 'data', 'meta'))
      self.tiers.append(_Tier(name, directory, every, keep, manager))

  def due(self, step: int) -> bool:
    return any(t.every and step % t.every == 0 for t in self.tiers)

  def space_warnings(self, state_bytes: int, held: Optional[int] = None) -> list[str]:
    """What each tier's free disk space will not hold, as warnings.

    A save that finds the disk full stops the run (exit 2, earlier steps
    intact), but only at the first save, possibly hours in: say it at
    start-up. A checkpoint is about the train state's bytes (a host-local
    tier holds what this process holds, `held`, and the other processes
    on its machine theirs beside it); Orbax writes a new step before it
    deletes the oldest beyond `keep`, so `keep` + 1 steps must fit, less
    those already on disk. Warnings, not errors: compression and other
    runs' cleanup can make room, and what fails later fails safely.

    Args:
      state_bytes: the whole train state's bytes (parameters, moments, step).
      held: the bytes of the blocks this process holds (`held_bytes`);
        default state_bytes / process count.
    """
    out = []
    for t in self.tiers:
      if '://' in t.directory or not (self.is_main or t.host):
        continue
      need = (state_bytes / jax.process_count() if held is None else held) if t.host else state_bytes
      try:
        free = shutil.disk_usage(t.directory).free
        have = len(steps_in(t.directory))
      except OSError:
        continue
      keep = t.keep
      room = int(free // max(need, 1))
      key, gib = _tier_key(t.name), lambda b: f'{b / 2**30:,.2f} GiB'
      where = f'CheckpointConfig.{key} = {t.directory!r} (the {t.name} tier' + (
          ', this process\'s part; the other processes on this machine write theirs beside it)' if t.host else ')')
      if room < 1:
        out.append(f'{where} has {gib(free)} free, less than one checkpoint of this train state '
                   f'(~{gib(need)}): its first save will fail and stop the run (exit status 2; earlier '
                   f'checkpoints stay intact). Make room there or point CheckpointConfig.{key} elsewhere.')
      elif room < keep + 1 - have:
        out.append(f'{where} has room for {room} more checkpoint(s) of ~{gib(need)} ({gib(free)} free), '
                   f'fewer than keep = {keep} needs ({keep + 1 - have} more: a new step is written before the '
                   f'oldest is deleted): a save will fail and stop the run once the disk fills. Make room '
                   f'there, or lower keep.')
    return out

  def save(self, step: int, state: Any, data: Optional[dict], meta: dict, force: bool = False) -> list[str]:
    """Starts the saves due at `step` (all tiers when `force`); returns their names.

    Blocks only while the arrays are copied to host memory; call `wait` to
    know the files are durable.
    """
    saved, prints = [], None
    for tier in self.tiers:
      if not (force or (tier.every and step % tier.every == 0)):
        continue
      if tier.host:   # in every process alike, before any decision of its own
        self._host_turn(tier)
      if step in tier.manager.all_steps():
        if (tier.name, step) not in self._unusable:
          continue
        # This step failed to restore earlier in this run (or was saved during
        # a loss spike): replace it.
        self._move_aside(tier, step, os.path.join(tier.directory, str(step)), self.cfg.io_timeout_s)
        self._unusable.discard((tier.name, step))
        if step in tier.manager.all_steps():   # not moved (a bucket, a failed rename): Orbax
          tier.manager.delete(step)            # would refuse to write the step over it
      if prints is None:  # once per step, whatever the number of tiers
        prints = fingerprints(state)
      record = {**meta, 'step': int(step), FINGERPRINTS: prints, DATA_SHA256: data_digest(data)}
      if tier.host:
        record[HOST] = {'process': jax.process_index(), 'processes': jax.process_count(),
                        'layout': host_layout(state), 'state': _prints_digest(prints)}
      args = ocp.args.Composite(state=(ocp.args.PyTreeSave(state) if tier.host else ocp.args.StandardSave(state)),
                                data=ocp.args.JsonSave(data or {}), meta=ocp.args.JsonSave(record))
      with _full_disk_is_bad_input(tier, step):
        tier.manager.save(step, args=args, force=True)
      saved.append(tier.name)
    return saved

  def wait(self) -> None:
    """Blocks until every started save is complete on disk."""
    for tier in self.tiers:
      with _full_disk_is_bad_input(tier, None):
        tier.manager.wait_until_finished()

  def _host_turn(self, tier: _Tier) -> None:
    """Before a host-tier save: this process's earlier save committed, every
    process here (so theirs are too), then this process's copies beyond
    `fast_keep` dropped. A save cut off later, in any process, leaves the
    newest `fast_keep` steps that every process has."""
    with _full_disk_is_bad_input(tier, None):   # this process's last save into it, failed
      tier.manager.wait_until_finished()
    distributed.barrier(f'ckpt/host/save/{next(self._host_saves)}', self.cfg.io_timeout_s)
    for old in sorted(tier.manager.all_steps(), reverse=True)[tier.keep:]:
      tier.manager.delete(old)

  def _host_steps(self, tier: _Tier, layout: Optional[str]) -> list[tuple[int, str, str]]:
    """(step, tier, state digest) of this process's copies in a host tier,
    saved by this process in `layout` (any, when None)."""
    out = []
    for step in steps_in(tier.directory):
      try:
        with open(os.path.join(tier.directory, str(step), 'meta', 'metadata')) as fh:
          record = jsonfile.load(fh).get(HOST, {})
      except (OSError, ValueError, AttributeError):
        continue   # no readable record: not a candidate
      if layout is None or record.get('layout') == layout:
        out.append((step, tier.name, record.get('state', '')))
    return out

  def _listing(self, layout: Optional[str] = None) -> list[tuple[int, str, str]]:
    """(step, tier, tag) of every complete checkpoint this process sees,
    newest first (the persistent tier first at equal steps); the tag names
    a host-local copy's state ('' elsewhere)."""
    found = [(step, tier.name, '') for tier in self.tiers if not tier.host for step in steps_in(tier.directory)]
    found += [c for tier in self.tiers if tier.host for c in self._host_steps(tier, layout)]
    return sorted(found, key=lambda x: (x[0], x[1] == 'persistent'), reverse=True)

  def steps(self) -> list[tuple[int, str]]:
    """(step, tier) of every complete checkpoint, newest first (a host-local
    tier: this process's copies)."""
    return [(step, tier) for step, tier, _ in self._listing()]

  def restore_latest(self, abstract_state: Any, single_replica: Optional[bool] = None) -> Optional[Restored]:
    """Newest readable checkpoint across the tiers, or None if there is none.

    Args:
      abstract_state: the state's ShapeDtypeStructs with target shardings;
        restoring reshards onto them (any mesh, any device count).
      single_replica: one data-parallel replica reads, the others receive
        (where `replica_plan` allows it); None: CheckpointConfig.single_replica_restore.
    """
    use = self.cfg.single_replica_restore if single_replica is None else single_replica
    plan = replica_plan(abstract_state) if use else None
    n = next(_RESTORE_ROUNDS)
    tiers = {t.name: t for t in self.tiers}
    layout = host_layout(abstract_state) if any(t.host for t in self.tiers) else None
    restored, failures, damaged_steps = None, [], []
    candidates = self._candidates(_restore_key(n, 'steps'), layout)
    # After a loss spike (CheckpointConfig.restore_below): the steps saved
    # during it hold the spiked state, finite as it is, and are set aside.
    below = self.cfg.restore_below
    abandoned = [(step, name) for step, name in candidates if below is not None and step >= below]
    candidates = [(step, name) for step, name in candidates if below is None or step < below]
    for i, (step, name) in enumerate(candidates):
      tier = tiers[name]
      path = os.path.join(tier.directory, str(step))
      # A host-local copy is read by its own process: host memory, no shared
      # storage to spare.
      restored, verdicts = self._restore_agreed(tier.manager, step, abstract_state, path,
                                                None if tier.host else plan, _restore_key(n, f'restore/{i}'),
                                                self.cfg.io_timeout_s, host=tier.host)
      failed = sorted(verdicts)
      if not failed:
        break
      damaged = all(v.startswith('D') for v in verdicts.values())
      mine = verdicts.get(jax.process_index(), '')[2:]
      log.warning('checkpoint %s (step %d) is %s%s; falling back to an older one', path, step,
                  'damaged' if damaged else 'unreadable', f' ({mine})' if mine else f' in process(es) {failed}')
      # Saved afresh when training passes this step again (see `save`).
      self._unusable.add((name, step))
      failures.append(f'{path}: {"damaged" if damaged else "unreadable"} '
                      f'({mine or "in process(es) " + str(failed)})')
      # Moved aside below, as damaged (bits that changed since the save:
      # never usable again) or unreadable alike: left in the tier, an
      # unreadable step takes one of the `keep` slots, and Orbax's next saves
      # delete a good older step in its place (the one just fallen back to,
      # even). Renamed, not deleted: evidence, and a step that a passing I/O
      # fault kept from being read can be renamed back. A host-local copy
      # newer than the step restored is dropped below instead, with every
      # newer one (the failed copy may be only one process's), unless every
      # process found its copy damaged.
      if not tier.host or (damaged and len(verdicts) == jax.process_count()):
        damaged_steps.append((tier, step, path, 'damaged' if damaged else 'unreadable'))
    if restored is None and abandoned and not failures:
      raise NoUsableCheckpoint(
          f'CheckpointConfig.restore_below = {below}: no checkpoint of this run is older than step '
          f'{below} (its steps: {", ".join(str(s) for s, _ in abandoned)}), so there is nothing from '
          f'before the loss spike to resume, and starting over would make the new saves delete these '
          f'steps. Nothing was changed. Resume from the newest step anyway by running without '
          f'restore_below, or start over in a new --workdir.')
    if restored is None and failures:
      raise NoUsableCheckpoint(
          f'none of the {len(failures)} checkpoint(s) of this run can be used: ' + '; '.join(failures)
          + '. Nothing was changed: starting from scratch instead would make the new saves delete these '
          'steps. If the storage was only unreachable, run again; if the steps are damaged for good, '
          '`mjax-report checkpoint --verify DIR` names what is wrong, and a new --workdir (or the '
          'checkpoint directory moved aside) starts over.')
    # Moved aside only once an older step has been read and checked: a fault
    # in the devices that compute the checksums would otherwise make every
    # good step look damaged, and move them all.
    for tier, step, path, verdict in damaged_steps:
      self._move_aside(tier, step, path, self.cfg.io_timeout_s, said=f'{verdict} at restore')
    for step, name in abandoned:
      tier = tiers[name]
      if tier.host:   # host copies: dropped below, with every newer one
        continue
      path = os.path.join(tier.directory, str(step))
      if '://' in path:
        # A bucket has no rename: left there, the spiked step would be
        # resumed again by the next restart before training passed it.
        log.warning('deleting %s: saved during a loss spike (CheckpointConfig.restore_below = %d)', path, below)
        tier.manager.delete(step)
        continue
      self._move_aside(tier, step, path, self.cfg.io_timeout_s, why='rolled-back')
      self._unusable.add((name, step))   # if the rename failed: replaced when training gets there
    for tier in self.tiers:
      if tier.host:   # newer copies are of a timeline the job has left
        for step in tier.manager.all_steps():
          if restored is None or step > restored.step:
            tier.manager.delete(step)
    return restored

  @staticmethod
  def _restore_agreed(manager, step: int, abstract_state: Any, path: str, plan: Optional[ReplicaPlan],
                      key: str, timeout_s: float, host: bool = False) -> tuple[Optional[Restored], dict[int, str]]:
    """Reads one step, sends it to the other replicas (with a plan) and checks
    it against its checksums. `timeout_s`: how long a process waits for the
    others' reads (with a plan, most processes read almost nothing and wait
    for the replica that reads the state).

    Returns:
      (restored, verdicts): verdicts is {process: '0 why' (unreadable) or
      'D why' (damaged)}, empty when the step is good; the same in every
      process, so that all use the step or all skip it.
    """
    try:
      restored, error = read_step(manager, step, abstract_state, path, plan, host), None
    except Exception as e:  # any unreadable checkpoint: report, fall back
      restored, error = None, _tree_metadata_missing(path) or read_error(e)
    # Every process learns whether every read went well before any
    # collective (the broadcast, the checksums): a process whose read failed
    # must not leave the others waiting in one.
    verdicts = distributed.report_exceptions(f'{key}/read', None if error is None else f'0 {error}', timeout_s)
    if verdicts:
      return None, verdicts
    damaged = False
    try:
      if plan is not None:
        restored.state = broadcast_from_replica(plan, restored.state, abstract_state)
      bad = first_mismatch(restored.meta.get(FINGERPRINTS, {}), restored.state)
      if bad is not None:
        damaged, error = True, f'array {bad} does not match the checksum saved with it'
      elif restored.meta.get(DATA_SHA256, data_digest(restored.data)) != data_digest(restored.data):
        damaged, error = True, 'the data position does not match the checksum saved with it'
    except Exception as e:
      error = read_error(e)
    verdicts = distributed.report_exceptions(key, None if error is None else f'{"D" if damaged else "0"} {error}',
                                             timeout_s)
    return (None if verdicts else restored), verdicts

  @staticmethod
  def _move_aside(tier: _Tier, step: int, path: str, timeout_s: float, why: str = 'damaged',
                  said: Optional[str] = None) -> None:
    """Renames a damaged or unreadable (or rolled-back) step out of the tier,
    kept for inspection and no longer among the `keep` steps, so that
    training saves that step afresh when it gets there again. `said`: what
    happened to it, for the log."""
    if (tier.host or jax.process_index() == 0) and '://' not in path and os.path.isdir(path):
      aside = os.path.join(tier.directory, f'{why}-{step}-{int(time.time())}')
      try:
        os.rename(path, aside)
        log.warning('moved %s aside to %s%s', path, aside,
                    f' ({said}; kept for inspection, no longer one of the steps kept)' if said else '')
      except OSError as e:
        log.warning('could not move %s aside (%s); it will be skipped again', path, e)
    if jax.process_count() > 1:
      distributed.barrier(f'ckpt/aside/{tier.name}/{step}', timeout_s)
    tier.manager.reload()

  def _candidates(self, key: str = 'ckpt/steps', layout: Optional[str] = None) -> list[tuple[int, str]]:
    """(step, tier) of the checkpoints every process sees, newest first; a
    host-local step only where every process has its copy of the same state,
    saved in `layout` (see `host_layout`)."""
    mine = [tuple(c) for c in self._listing(layout)]
    if jax.process_count() == 1:
      return [(step, tier) for step, tier, _ in mine]
    # Process 0's list, less what some process cannot see.
    first = [tuple(c) for c in jsonfile.loads(distributed.broadcast_str(key, json.dumps(mine)))]
    missing = [c for c in first if c not in set(mine)]
    hidden = {tuple(c) for v in distributed.report_exceptions(
        f'{key}/missing', json.dumps(missing) if missing else None).values() for c in jsonfile.loads(v)}
    if hidden or len(first) != len(mine):
      log.warning('checkpoints %s are not seen by every process; skipped',
                  sorted((step, tier) for step, tier, _ in hidden | (set(mine) - set(first))))
    return [(step, tier) for step, tier, tag in first if (step, tier, tag) not in hidden]

  def close(self) -> None:
    try:
      self.wait()
      for tier in self.tiers:
        tier.manager.close()
    finally:
      self.release_lock()

  def release_lock(self) -> None:
    """Lets go of the run lock only (a run that failed in this process, which
    goes on: a notebook, a test), touching nothing of Orbax's."""
    self._closed.set()   # and stops the save watch: nothing here waits on a save any more
    unlock_run(self._locked)
    self._locked = []


def resume(ckpt: Optional[Checkpointer], cfg: CheckpointConfig, abstract_state: Any) -> Optional[Restored]:
  """What a run starts from; the one place the policy is decided:
    1. the workdir's newest readable checkpoint (`ckpt`, either tier);
    2. else the checkpoint `CheckpointConfig.restore_from` names: its train
       state, and its data position unless `restore_data` is False;
    3. else None: initialize from `TrainConfig.seed`.

  Args:
    ckpt: the run's Checkpointer, or None when checkpointing is disabled.
    abstract_state: the state's ShapeDtypeStructs with target shardings, in
      the checkpoint layout.
  Raises:
    CheckpointNotFound: `restore_from` names no readable checkpoint.
  """
  restored = ckpt.restore_latest(abstract_state) if ckpt is not None else None
  if restored is not None or not cfg.restore_from:
    return restored
  restored = restore_from_path(cfg.restore_from, abstract_state, cfg.single_replica_restore, cfg.io_timeout_s)
  restored.explicit = True
  if not cfg.restore_data:
    restored.data = None
  return restored


def restore_from_path(path: str, abstract_state: Any, single_replica: bool = True,
                      timeout_s: float = CheckpointConfig.io_timeout_s) -> Restored:
  """Restores an explicit checkpoint: a step directory (`.../checkpoints/120`)
  or a checkpoint directory (its newest step).

  Args:
    path: the step or checkpoint directory.
    abstract_state: the state's ShapeDtypeStructs with target shardings.
    single_replica: one data-parallel replica reads, where `replica_plan`
      allows it (see the module docstring).
    timeout_s: how long a process waits for the others' reads.
  Raises:
    CheckpointNotFound: no checkpoint there, or it cannot be read (in any
      process of the job).
  """
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isdir(path):
    raise CheckpointNotFound(f'CheckpointConfig.restore_from = {path!r}: no such directory; give a '
                             f'run\'s checkpoints/ directory or one of its step folders.')
  base, leaf = os.path.split(path.rstrip('/'))
  if is_step_dir(path):
    directory, step = base, int(leaf)
  else:
    directory, step = path, None
  # Read only, and said so in full: Orbax warns of each option it has to
  # change for read_only, and that the directory is read only, which reads
  # like a fault to whoever restores from another run.
  absl_log = logging.getLogger('absl')
  absl_log.addFilter(_read_only_notice)
  try:
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
        read_only=True, create=False, cleanup_tmp_directories=False, save_interval_steps=0),
        item_names=('state', 'data', 'meta'))
  finally:
    absl_log.removeFilter(_read_only_notice)
  try:
    if step is None:
      # Process 0's newest, in every process: the run it comes from may
      # commit a new step while the processes look, and all must read one.
      step = jsonfile.loads(distributed.broadcast_str(_restore_key(next(_RESTORE_ROUNDS), 'explicit/step'),
                                                  json.dumps(manager.latest_step())))
      if step is None:
        raise CheckpointNotFound(f'CheckpointConfig.restore_from = {path!r}: no checkpoint in it; give '
                                 f'a run\'s checkpoints/ directory or one of its step folders.')
    step_path = os.path.join(directory, str(step))
    plan = replica_plan(abstract_state) if single_replica else None
    restored, verdicts = Checkpointer._restore_agreed(manager, step, abstract_state, step_path, plan,
                                                      _restore_key(next(_RESTORE_ROUNDS), 'explicit'), timeout_s)
    if verdicts:
      why = verdicts.get(jax.process_index(), next(iter(verdicts.values())))[2:]
      raise CheckpointNotFound(
          f'CheckpointConfig.restore_from = {path!r}: step {step} cannot be used ({why}'
          + (f', in process(es) {sorted(verdicts)} of {jax.process_count()}' if jax.process_count() > 1 else '')
          + '); give another step folder, or check the files with `mjax-report checkpoint --verify`.')
    return restored
  finally:
    manager.close()
