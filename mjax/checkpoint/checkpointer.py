"""The Checkpointer: asynchronous Orbax saves into the two tiers, the restore
of the newest readable step (falling back past damaged ones, agreed by every
process), and the resume policy (`resume`). The package docstring says how
the parts fit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import re
import shutil
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import NamedSharding

from mjax import distributed, jsonfile, protocol
from mjax.checkpoint.directories import is_step_dir, steps_in, tier_directories, tier_key
from mjax.checkpoint.failures import (FailedSave, full_disk_is_bad_input, kept_steps, OTHER_OPTIMIZER, other_config,
                                      quiet_failed_io_aftermath, read_error, unwritable_error)
from mjax.checkpoint.guards import (check_apart, check_not_around_the_workdir, check_not_inside_a_tier, check_owner,
                                   check_shared, check_writable)
from mjax.checkpoint.integrity import (data_digest, DATA_SHA256, FINGERPRINTS, fingerprints, first_mismatch,
                                       prints_digest, step_json, tree_metadata_missing)
from mjax.checkpoint.locks import lock_run, unlock_run
from mjax.checkpoint.replica import broadcast_from_replica, on_replica, replica_plan, ReplicaPlan
from mjax.config import CheckpointConfig
from mjax.errors import UserError

log = logging.getLogger('mjax.checkpoint')


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


# In a host-local step's meta item: which process of which layout saved it
# (`host_layout`), and the digest of the checksums, which names the state.
HOST = 'host'


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


def _size(n: float) -> str:
  """A size as the space warnings say it: GiB, or MiB where that would read 0.00 GiB."""
  return f'{n / 2**20:,.1f} MiB' if n < 2**30 / 10 else f'{n / 2**30:,.2f} GiB'


def keep_key_of(name: str) -> str:
  """The CheckpointConfig field that sets how many steps tier `name` keeps."""
  return 'fast_keep' if name == 'fast' else 'keep'


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


def _no_size_logging_notice(record: logging.LogRecord) -> bool:
  # Orbax's warning on every save of a host-local tier (each process its
  # own primary host): it crowded the lines that matter out of the
  # driver's last_logs of a fault.
  return not record.getMessage().startswith('Global object size logging disabled')


def _read_only_notice(record: logging.LogRecord) -> bool:
  return not record.getMessage().startswith('Given directory is read only')


# The restores of this process; every process of a job makes the same ones in
# the same order, so the count keeps their agreement keys new to the job.
_RESTORE_ROUNDS = itertools.count()


def _restore_key(n: int, key: str) -> str:
  return f'ckpt/{key}' if n == 0 else f'ckpt/again{n}/{key}'


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


def _delete_old_step(delete: Callable[[int], None], step: int, directory: str, keep: str) -> None:
  """`delete(step)`, a step beyond a tier's count (`keep`: 'CheckpointConfig.keep
  = 3'); one that cannot be deleted stays, said once (see _OldStepsMayStay)."""
  try:
    delete(step)
  except OSError as e:
    log.warning('old checkpoint %s (beyond %s) could not be deleted: %s. It stays (perhaps in part: '
                'a later start skips it if it is no longer readable); the newer steps are saved as usual. '
                'Delete it by hand to free its space.', os.path.join(directory, str(step)), keep, e.strerror or e)


class _OldStepsMayStay:
  """Orbax's deleter of a tier's steps beyond `keep`, with a step that
  cannot be deleted left where it is, said once. Orbax deletes them in a
  save's finalize thread after the new step has committed, and raised such
  a failure (a file in the step held open on NFS: EBUSY; its permissions;
  an immutable directory) as the failure of that save: the run ended with
  Orbax's traceback (exit 1), or, for EPERM, as a tier that "takes no more
  files" (exit 2), the step it had just saved intact. The tier holds a step
  more than `keep` instead; a later start deletes it (Orbax lists the disk
  when it opens)."""

  def __init__(self, deleter: Any, directory: str, keep: str):
    self._deleter, self._directory, self._keep = deleter, directory, keep   # keep: 'CheckpointConfig.keep = 3'

  def delete(self, step: int) -> None:
    # A step deleted on purpose (`CheckpointManager.delete`: one to be saved
    # afresh) must go, or its save fails: raised as before.
    self._deleter.delete(step)

  def delete_steps(self, steps) -> None:
    for step in steps:
      _delete_old_step(self._deleter.delete, step, self._directory, self._keep)

  def close(self) -> None:
    self._deleter.close()


class Checkpointer:
  """Saves and restores train state, data-iterator state and config."""

  def __init__(self, cfg: CheckpointConfig, workdir: str, run: Optional[dict] = None):
    """`run`: the run's id record from process 0 (`ensure_run_id`), else read from the workdir."""
    self.cfg = cfg
    self.workdir = workdir
    self.tiers: list[_Tier] = []
    self._unusable: set[tuple[str, int]] = set()   # (tier, step) that failed to restore
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
    check_not_around_the_workdir(dirs, workdir)
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
      FailedSave.seen.clear()
      FailedSave.said_here.clear()
      threading.Thread(target=self._watch_saves, name='mjax-save-watch', daemon=True).start()

  # How long the save watch gives the main thread to report a failed save
  # itself (it does when every process's save failed: their finalize threads
  # then meet in the same barrier, and the error reaches the next save).
  SAVE_WATCH_GRACE_S = 5.0

  def _watch_saves(self) -> None:
    """(A thread, in multi-process jobs.) Ends this process, with the
    message its main thread would give, once a background save of its own
    found its directory full or unwritable (`FailedSave`): a failure no
    other process shares hangs the job in Orbax's barriers otherwise. The
    failed process leaving is what ends the others: the launcher, the
    fault-tolerance driver (exit status 2: not restarted) or, failing both,
    jax's coordination service when the process's heartbeats stop."""
    while not FailedSave.seen.wait(1.0):
      if self._closed.is_set():
        return
    if FailedSave.said_here.wait(self.SAVE_WATCH_GRACE_S) or self._closed.is_set():
      return
    tier, step = self._failed_save_at(FailedSave.text)
    here = f'process {jax.process_index()} of {jax.process_count()}'
    if self.leave_status is not None:   # the run is ending for a reason of its own (a NaN): that one's status
      self._leave(f'a save into the {tier.name} checkpoint tier ({tier.directory}) failed in {here} '
                  f'({FailedSave.said or FailedSave.error}) while the run was ending; the steps saved before '
                  f'are intact.', self.leave_status)
      return
    if FailedSave.said is not None:
      error = unwritable_error(tier, step, FailedSave.said)
      self._leave(f'{error} ({here.capitalize()} found it while the others waited for its save: it leaves now, '
                  f'which ends the job.)', protocol.EXIT_USER_ERROR)
      return
    kept = kept_steps(tier)
    self._leave(
        f'a save into the {tier.name} checkpoint tier ({tier.directory}) '
        f'{"(step " + str(step) + ") " if step is not None else ""}failed in {here}, the others waiting for it: '
        f'{FailedSave.error}. The steps saved before are intact (saved steps: {kept}). This process leaves now '
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
      # full_disk_is_bad_input).
      options = ocp.CheckpointManagerOptions(
          max_to_keep=keep, create=True, cleanup_tmp_directories=True,
          enable_async_checkpointing=cfg.async_save,
          multiprocessing_options=ocp.options.MultiprocessingOptions(
              barrier_sync_key_prefix=f'mjax_{name}'),
          async_options=_async_options(cfg.io_timeout_s))
      manager = ocp.CheckpointManager(directory, options=options, item_names=('state', 'data', 'meta'))
      if hasattr(manager, '_checkpoint_deleter'):   # an Orbax without it keeps its own behaviour
        manager._checkpoint_deleter = _OldStepsMayStay(manager._checkpoint_deleter, directory,
                                                       f'CheckpointConfig.{keep_key_of(name)} = {keep}')
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
      key, keep_key = tier_key(t.name), keep_key_of(t.name)
      where = f'CheckpointConfig.{key} = {t.directory!r} (the {t.name} tier' + (
          ', this process\'s part; the other processes on this machine write theirs beside it)' if t.host else ')')
      if room < 1:
        out.append(f'{where} has {_size(free)} free, less than one checkpoint of this train state '
                   f'(~{_size(need)}): its first save will fail and stop the run (exit status 2; earlier '
                   f'checkpoints stay intact). Make room there or point CheckpointConfig.{key} elsewhere.')
      elif room < keep + 1 - have:
        out.append(f'{where} has room for {room} more checkpoint(s) of ~{_size(need)} ({_size(free)} free), '
                   f'fewer than CheckpointConfig.{keep_key} = {keep} needs ({keep + 1 - have} more: a new step is '
                   f'written before the oldest is deleted): a save will fail and stop the run once the disk '
                   f'fills. Make room there, or lower CheckpointConfig.{keep_key}.')
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
                        'layout': host_layout(state), 'state': prints_digest(prints)}
      args = ocp.args.Composite(state=(ocp.args.PyTreeSave(state) if tier.host else ocp.args.StandardSave(state)),
                                data=ocp.args.JsonSave(data or {}), meta=ocp.args.JsonSave(record))
      with full_disk_is_bad_input(tier, step):
        tier.manager.save(step, args=args, force=True)
      saved.append(tier.name)
    return saved

  def wait(self) -> None:
    """Blocks until every started save is complete on disk: every tier's,
    then the first failure is raised. A tier that failed must not leave
    another's save (often the newest step) in flight, to be cut off at exit."""
    first = None
    for tier in self.tiers:
      try:
        with full_disk_is_bad_input(tier, None):
          tier.manager.wait_until_finished()
      except Exception as e:  # noqa: BLE001 -- raised once every tier is waited for
        first = first or e
    if first is not None:
      raise first

  def _host_turn(self, tier: _Tier) -> None:
    """Before a host-tier save: this process's earlier save committed, every
    process here (so theirs are too), then this process's copies beyond
    `fast_keep` dropped. A save cut off later, in any process, leaves the
    newest `fast_keep` steps that every process has."""
    with full_disk_is_bad_input(tier, None):   # this process's last save into it, failed
      tier.manager.wait_until_finished()
    # One name for every save: the coordination service (in process 0) keeps
    # each barrier name it has seen for the rest of the job, ~0.8 KB and more
    # with each process (1.0 KB at 6), so a name per save grew with the run's
    # steps; a name used again is the next round of the same barrier.
    distributed.barrier('ckpt/host/save', self.cfg.io_timeout_s)
    for old in sorted(tier.manager.all_steps(), reverse=True)[tier.keep:]:
      # (As Orbax's own deletions beyond keep: one that fails leaves the step.)
      _delete_old_step(tier.manager.delete, old, tier.directory,
                       f'CheckpointConfig.{keep_key_of(tier.name)} = {tier.keep}')

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

  def restore_latest(self, abstract_state: Any, single_replica: Optional[bool] = None,
                     other_layouts: Sequence[tuple[Any, Callable[[Any], Any]]] = ()) -> Optional[Restored]:
    """Newest readable checkpoint across the tiers, or None if there is none.

    Args:
      abstract_state: the state's ShapeDtypeStructs with target shardings;
        restoring reshards onto them (any mesh, any device count).
      single_replica: one data-parallel replica reads, the others receive
        (where `replica_plan` allows it); None: CheckpointConfig.single_replica_restore.
      other_layouts: see `resume`.
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
                                                self.cfg.io_timeout_s, host=tier.host,
                                                other_layouts=other_layouts)
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
                      key: str, timeout_s: float, host: bool = False,
                      other_layouts: Sequence[tuple[Any, Callable[[Any], Any]]] = ()
                      ) -> tuple[Optional[Restored], dict[int, str]]:
    """Reads one step, sends it to the other replicas (with a plan) and checks
    it against its checksums. `timeout_s`: how long a process waits for the
    others' reads (with a plan, most processes read almost nothing and wait
    for the replica that reads the state). `other_layouts`: see `resume`.

    Returns:
      (restored, verdicts): verdicts is {process: '0 why' (unreadable) or
      'D why' (damaged)}, empty when the step is good; the same in every
      process, so that all use the step or all skip it.
    """
    def read(layout: Any, round_key: str) -> tuple[Optional[Restored], dict[int, str]]:
      try:
        restored, error = read_step(manager, step, layout, path, plan, host), None
      except Exception as e:  # any unreadable checkpoint: report, fall back
        restored, error = None, tree_metadata_missing(path) or read_error(e)
      # Every process learns whether every read went well before any
      # collective (the broadcast, the checksums): a process whose read
      # failed must not leave the others waiting in one.
      return restored, distributed.report_exceptions(round_key, None if error is None else f'0 {error}', timeout_s)

    layout, convert = abstract_state, None
    restored, verdicts = read(abstract_state, f'{key}/read')
    if verdicts and all(OTHER_OPTIMIZER in v for v in verdicts.values()):
      # The same arrays as another setting of the optimizer lays them out:
      # read and checked as saved, then laid out as this config's. Every
      # process reads again (Orbax's read ends at a barrier of all of them),
      # also where only the reading replica's read failed.
      for i, (other, to_ours) in enumerate(other_layouts):
        again, other_verdicts = read(other, f'{key}/read-other{i}')
        if not other_verdicts:
          restored, verdicts, layout, convert = again, {}, other, to_ours
          break
    if verdicts:   # the first read's error is the one to tell
      return None, verdicts
    damaged, error = False, None
    try:
      if plan is not None:
        restored.state = broadcast_from_replica(plan, restored.state, layout)
      bad = first_mismatch(restored.meta.get(FINGERPRINTS, {}), restored.state)
      if bad is not None:
        damaged, error = True, f'array {bad} does not match the checksum saved with it'
      elif restored.meta.get(DATA_SHA256, data_digest(restored.data)) != data_digest(restored.data):
        damaged, error = True, 'the data position does not match the checksum saved with it'
      elif convert is not None:
        restored.state = convert(restored.state)
    except Exception as e:
      error = read_error(e)
    # A key of its own: one whose directory held the reads' reports would
    # count a first read's error that a read in another layout made good.
    verdicts = distributed.report_exceptions(f'{key}/check', None if error is None else
                                             f'{"D" if damaged else "0"} {error}', timeout_s)
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
    """Waits for every tier's saves (raising the first failure), closes
    every manager (its threads), whatever failed, then lets go of the lock."""
    try:
      self.wait()
    finally:
      try:
        for tier in self.tiers:
          with contextlib.suppress(Exception):   # a failure to report is wait()'s, raised above
            tier.manager.close()
      finally:
        self.release_lock()

  def release_lock(self) -> None:
    """Lets go of the run lock only (a run that failed in this process, which
    goes on: a notebook, a test), touching nothing of Orbax's."""
    self._closed.set()   # and stops the save watch: nothing here waits on a save any more
    unlock_run(self._locked)
    self._locked = []


def resume(ckpt: Optional[Checkpointer], cfg: CheckpointConfig, abstract_state: Any,
           other_layouts: Sequence[tuple[Any, Callable[[Any], Any]]] = ()) -> Optional[Restored]:
  """What a run starts from; the one place the policy is decided:
    1. the workdir's newest readable checkpoint (`ckpt`, either tier);
    2. else the checkpoint `CheckpointConfig.restore_from` names: its train
       state, and its data position unless `restore_data` is False;
    3. else None: initialize from `TrainConfig.seed`.

  Args:
    ckpt: the run's Checkpointer, or None when checkpointing is disabled.
    abstract_state: the state's ShapeDtypeStructs with target shardings, in
      the checkpoint layout.
    other_layouts: (abstract state, convert) pairs: the same arrays as
      another setting of the config lays them out (`Program.other_layouts`:
      the optimizer's state with and without gradient clipping), tried where
      a step holds the state of another optimizer; `convert` takes a state
      read so to `abstract_state`'s layout.
  Raises:
    CheckpointNotFound: `restore_from` names no readable checkpoint.
  """
  restored = ckpt.restore_latest(abstract_state, other_layouts=other_layouts) if ckpt is not None else None
  if restored is not None or not cfg.restore_from:
    return restored
  restored = restore_from_path(cfg.restore_from, abstract_state, cfg.single_replica_restore, cfg.io_timeout_s,
                               other_layouts)
  restored.explicit = True
  if not cfg.restore_data:
    restored.data = None
  return restored


def restore_from_path(path: str, abstract_state: Any, single_replica: bool = True,
                      timeout_s: float = CheckpointConfig.io_timeout_s,
                      other_layouts: Sequence[tuple[Any, Callable[[Any], Any]]] = ()) -> Restored:
  """Restores an explicit checkpoint: a step directory (`.../checkpoints/120`)
  or a checkpoint directory (its newest step).

  Args:
    path: the step or checkpoint directory.
    abstract_state: the state's ShapeDtypeStructs with target shardings.
    single_replica: one data-parallel replica reads, where `replica_plan`
      allows it (see the module docstring).
    timeout_s: how long a process waits for the others' reads.
    other_layouts: see `resume`.
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
                                                      _restore_key(next(_RESTORE_ROUNDS), 'explicit'), timeout_s,
                                                      other_layouts=other_layouts)
    if verdicts:
      why = verdicts.get(jax.process_index(), next(iter(verdicts.values())))[2:]
      raise CheckpointNotFound(
          f'CheckpointConfig.restore_from = {path!r}: step {step} cannot be used ({why}'
          + (f', in process(es) {sorted(verdicts)} of {jax.process_count()}' if jax.process_count() > 1 else '')
          + ('); restore it with the config it was saved with, or give a checkpoint this config makes.'
             if other_config(why) else
             '); give another step folder, or check the files with `mjax-report checkpoint --verify`.'))
    return restored
  finally:
    manager.close()
