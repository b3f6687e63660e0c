"""A run's workdir at start-up: this process's claim on it, the checks made
before anything is written there, and what a refused start takes back."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Optional

from mjax import checkpoint as checkpoint_lib
from mjax import distributed, jsonfile
from mjax.checkpoint.directories import (OWNER_FILE, RUN_ID_FILE, ensure_run_id, is_workdir, read_claim, run_id,
                                         steps_in, tier_directories, with_host_dirs)
from mjax.checkpoint.failures import write_problem
from mjax.checkpoint.guards import check_not_inside_a_tier, check_not_inside_a_workdir, check_same_model
from mjax.config import Config, ConfigError


# The workdirs this process's live Trainers hold. The run lock
# (mjax/checkpoint/locks.py) keeps other processes out; within one process it is
# re-entrant (a Checkpointer that reads a run's steps beside it), so a
# second Trainer on the same workdir, in a notebook, trained over the first
# one's checkpoints and metrics.
_WORKDIRS: set[str] = set()


class Claim:
  """One Trainer's hold on its workdir: the in-process claim and, once the
  Trainer has one, its Checkpointer's run lock. Released by `close()`, or
  when the Trainer is collected (one built and dropped, never trained)."""

  def __init__(self, workdir: str):
    self.key = os.path.realpath(workdir)
    if self.key in _WORKDIRS:
      raise ConfigError(
          f'{workdir} is in use by another Trainer of this process, not yet trained or closed: one workdir '
          f'trains one run at a time. Call train() or close() on that one first (or build it as '
          f'`with Trainer(cfg, workdir) as t:`), or give this run its own workdir.')
    _WORKDIRS.add(self.key)
    self.ckpt: Optional[checkpoint_lib.Checkpointer] = None
    self.held = True

  def release(self) -> None:
    if self.held:
      self.held = False
      _WORKDIRS.discard(self.key)
    if self.ckpt is not None:
      self.ckpt.release_lock()   # idempotent


def check_workdir(cfg: Config, workdir: str, is_main: bool) -> dict:
  """Process 0 checks the workdir (writable; no checkpoints of another model)
  and makes its run id; every process raises the same ConfigError, so none
  is left waiting in the next collective, or gets the run's id record
  (`ensure_run_id`): the hosts of a host-local fast tier need
  not share the workdir."""
  check_utf8(workdir, '--workdir')
  for tier, directory in tier_directories(cfg.checkpoint, workdir).items():
    check_utf8(directory, f'the {tier} checkpoint directory')
  verdict, record = '', {}
  if is_main:
    try:
      # Before anything is made or written (write_problem makes the
      # workdir): a refused start leaves nothing in another run's directory,
      # where a new numbered folder would read as a step.
      check_not_inside_a_tier(workdir)
      check_not_inside_a_workdir(workdir)
      problem = write_problem(workdir)
      if problem:
        raise ConfigError(
            f'--workdir {workdir!r} cannot be written: {problem}. The workdir holds the config, '
            f'metrics and (by default) the checkpoints: give a directory you can write, or a new path.')
      check_same_model(cfg, workdir)
      record = ensure_run_id(cfg.checkpoint, workdir)
    except ConfigError as e:
      verdict = str(e)
  said = jsonfile.loads(distributed.broadcast_str('workdir/verdict', json.dumps({'verdict': verdict, 'run': record}),
                                              cfg.fault.collective_timeout_s))
  if said['verdict']:
    raise ConfigError(said['verdict'])
  return said['run']


def forget_refused_start(cfg: Config, workdir: str, record: dict, made: bool) -> list[str]:
  """Takes back what a new run's start wrote before it was refused (data
  too small for a batch, a state that does not fit): its run id and its
  claims on checkpoint directories that hold no step. Called while the
  start still holds the run lock (no other start is past it), in a
  one-process job (a host-local tier's claims on other hosts are theirs to
  keep). Returns the directories it made, to be removed where left empty
  once the lock is let go (its files are in them): the default tiers (in the
  workdir it made, or named after it in /dev/shm), a host-local tier's own,
  and the workdir it made. The same command, corrected, then starts in a
  workdir as it found it; one given up on leaves nothing behind. A run that
  ever started (its config.json, written once everything worked) is left
  as it is, and so is a run id this start did not make (the caller's
  check). One of the user's directories stays, empty as it was."""
  if not record.get('fresh') or is_workdir(workdir) or run_id(workdir) != record.get('run'):
    return []
  empty = []
  for tier, directory in tier_directories(cfg.checkpoint, workdir).items():
    if '://' in directory or not os.path.isdir(directory):
      continue
    ours = (made and os.path.commonpath([os.path.realpath(directory), os.path.realpath(workdir)]) ==
            os.path.realpath(workdir)) or (tier == 'fast' and cfg.checkpoint.fast_directory is None)
    for d in reversed(with_host_dirs(directory)):
      if read_claim(d).get('run') == record['run'] and not steps_in(d):
        with contextlib.suppress(OSError):
          os.remove(os.path.join(d, OWNER_FILE))
      if ours or d != directory:
        empty.append(d)
  with contextlib.suppress(OSError):
    os.remove(os.path.join(workdir, RUN_ID_FILE))
  return empty + ([workdir] if made else [])


def check_utf8(path: str, what: str) -> None:
  """Refuses a path with bytes that are not UTF-8 (Python carries them as
  surrogates): TensorStore, which writes the checkpoints, takes UTF-8 paths
  only, and the first save would fail deep in Orbax after training began."""
  try:
    path.encode('utf-8')
  except UnicodeEncodeError:
    shown = path.encode('utf-8', 'surrogateescape').decode('utf-8', 'backslashreplace')
    raise ConfigError(
        f"{what} '{shown}' has bytes that are not UTF-8 in its name; the checkpoint writer "
        f'(TensorStore) takes UTF-8 paths only. Rename the directory, or give another path.') from None


def recorded_tokenizer(workdir: str) -> Optional[str]:
  """DataConfig.tokenizer as the run in `workdir` recorded it (its
  config.json), or None: no run there, or no record readable."""
  try:
    with open(os.path.join(workdir, 'config.json')) as fh:
      saved = jsonfile.load(fh)
  except (OSError, ValueError):
    return None
  tokenizer = saved.get('data', {}).get('tokenizer') if isinstance(saved, dict) and \
      isinstance(saved.get('data'), dict) else None
  return tokenizer if isinstance(tokenizer, str) else None
