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
next older one is used.

Resume semantics (the only place they are decided, see `train.run`):
  1. the workdir has a readable checkpoint in either tier: resume from the
     newest one (the usual restart after a fault or pre-emption);
  2. else `CheckpointConfig.restore_from` names a checkpoint: start from its
     train state (and data position, unless `restore_data` is False);
  3. else initialize from `TrainConfig.seed`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from typing import Any, Optional

import orbax.checkpoint as ocp

from mjax.config import CheckpointConfig

log = logging.getLogger('mjax.checkpoint')


@dataclasses.dataclass
class Restored:
  step: int
  state: Any
  data: Optional[dict]
  meta: dict
  path: str


@dataclasses.dataclass
class _Tier:
  name: str
  directory: str
  every: int
  manager: ocp.CheckpointManager


def tier_directories(cfg: CheckpointConfig, workdir: str) -> dict[str, str]:
  """Where each enabled tier writes. The default fast tier lives in /dev/shm
  under a name derived from the workdir, so two runs never share it."""
  dirs = {'persistent': os.path.abspath(os.path.expanduser(cfg.directory or os.path.join(workdir, 'checkpoints')))}
  if cfg.fast_every:
    fast = cfg.fast_directory
    if fast is None:
      tag = hashlib.sha1(os.path.abspath(workdir).encode()).hexdigest()[:12]
      fast = os.path.join('/dev/shm', 'mjax', tag)
    dirs['fast'] = os.path.abspath(os.path.expanduser(fast))
  return dirs


class Checkpointer:
  """Saves and restores train state, data-iterator state and config."""

  def __init__(self, cfg: CheckpointConfig, workdir: str):
    self.cfg = cfg
    self.tiers: list[_Tier] = []
    dirs = tier_directories(cfg, workdir)
    for name, directory in dirs.items():
      keep, every = (cfg.keep, cfg.save_every) if name == 'persistent' else (cfg.fast_keep, cfg.fast_every)
      options = ocp.CheckpointManagerOptions(
          max_to_keep=keep, create=True, cleanup_tmp_directories=True,
          enable_async_checkpointing=cfg.async_save)
      manager = ocp.CheckpointManager(directory, options=options, item_names=('state', 'data', 'meta'))
      self.tiers.append(_Tier(name, directory, every, manager))

  def due(self, step: int) -> bool:
    return any(t.every and step % t.every == 0 for t in self.tiers)

  def save(self, step: int, state: Any, data: Optional[dict], meta: dict, force: bool = False) -> list[str]:
    """Starts the saves due at `step` (all tiers when `force`); returns their names.

    Blocks only while the arrays are copied to host memory; call `wait` to
    know the files are durable.
    """
    saved = []
    for tier in self.tiers:
      if not (force or (tier.every and step % tier.every == 0)):
        continue
      if step in tier.manager.all_steps():
        continue
      args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                data=ocp.args.JsonSave(data or {}),
                                meta=ocp.args.JsonSave({**meta, 'step': int(step)}))
      tier.manager.save(step, args=args, force=True)
      saved.append(tier.name)
    return saved

  def wait(self) -> None:
    """Blocks until every started save is complete on disk."""
    for tier in self.tiers:
      tier.manager.wait_until_finished()

  def steps(self) -> list[tuple[int, str]]:
    """(step, tier) of every complete checkpoint, newest first."""
    found = [(s, t.name) for t in self.tiers for s in t.manager.all_steps()]
    return sorted(found, key=lambda x: (x[0], x[1] == 'persistent'), reverse=True)

  def restore_latest(self, abstract_state: Any) -> Optional[Restored]:
    """Newest readable checkpoint across the tiers, or None if there is none.

    Args:
      abstract_state: the state's ShapeDtypeStructs with target shardings;
        restoring reshards onto them (any mesh, any device count).
    """
    tiers = {t.name: t for t in self.tiers}
    for step, name in self.steps():
      tier = tiers[name]
      path = os.path.join(tier.directory, str(step))
      try:
        return self._restore(tier.manager, step, abstract_state, path)
      except Exception as e:  # any unreadable checkpoint: report, fall back
        log.warning('checkpoint %s is unreadable (%s: %s); falling back to an older one',
                    path, type(e).__name__, str(e).splitlines()[0] if str(e) else '')
    return None

  @staticmethod
  def _restore(manager, step, abstract_state, path) -> Restored:
    out = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
    return Restored(step=int(step), state=out['state'], data=out['data'] or None,
                    meta=out['meta'] or {}, path=path)

  def close(self) -> None:
    self.wait()
    for tier in self.tiers:
      tier.manager.close()


def restore_from_path(path: str, abstract_state: Any) -> Restored:
  """Restores an explicit checkpoint: a step directory (`.../checkpoints/120`)
  or a checkpoint directory (its newest step)."""
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isdir(path):
    raise FileNotFoundError(f'CheckpointConfig.restore_from = {path!r}: no such directory')
  base, leaf = os.path.split(path.rstrip('/'))
  if leaf.isdigit() and os.path.isdir(os.path.join(path, 'state')):
    directory, step = base, int(leaf)
  else:
    directory, step = path, None
  manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True),
                                  item_names=('state', 'data', 'meta'))
  try:
    if step is None:
      step = manager.latest_step()
      if step is None:
        raise FileNotFoundError(f'CheckpointConfig.restore_from = {path!r}: no checkpoint in it')
    return Checkpointer._restore(manager, step, abstract_state, os.path.join(directory, str(step)))
  finally:
    manager.close()
