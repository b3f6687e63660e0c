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

In a multi-process job every process must restore the same step, or they
hang in their first collective: each one lists what it sees, only steps
every process sees are candidates, and a failed read in any process moves
all of them to the next one (agreed through the coordination service,
mjax/distributed.py). Every tier must be a directory all processes share:
Orbax's process 0 commits a save only once every process has written its
shards there. The default fast tier, /dev/shm, is shared by the processes of
one machine but not across machines, so at start-up process 0 leaves a probe
file in each tier and a tier some process cannot see it in is a
configuration error (exit 2) naming the tier and the processes.

Resume semantics (decided in `resume`, and nowhere else):
  1. the workdir has a readable checkpoint in either tier: resume from the
     newest one (the usual restart after a fault or pre-emption);
  2. else `CheckpointConfig.restore_from` names a checkpoint: start from its
     train state (and data position, unless `restore_data` is False);
  3. else initialize from `TrainConfig.seed`.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import hashlib
import json
import logging
import os
import secrets
import socket
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from mjax import distributed
from mjax.config import CheckpointConfig, ConfigError
from mjax.errors import UserError

log = logging.getLogger('mjax.checkpoint')

# Keys in a checkpoint's meta item: per-array checksums of the state (see
# `fingerprints`), and the sha256 of the data iterator's state, whose one
# changed digit would silently replay or skip batches.
FINGERPRINTS = 'fingerprints'
DATA_SHA256 = 'data_sha256'


def data_digest(data: Optional[dict]) -> str:
  return hashlib.sha256(json.dumps(data or {}, sort_keys=True).encode()).hexdigest()


class CheckpointNotFound(UserError):
  """CheckpointConfig.restore_from names no readable checkpoint."""


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
    dirs['fast'] = _expand(fast)
  return dirs


def saved_steps(cfg: CheckpointConfig, workdir: str) -> list[tuple[int, str, str]]:
  """(step, tier, path) of every complete checkpoint, newest first (the
  persistent tier first at equal steps). Orbax writes a step under a
  temporary name and renames it when complete, so the names say it all."""
  found = [(step, tier, os.path.join(directory, str(step)))
           for tier, directory in tier_directories(cfg, workdir).items() for step in steps_in(directory)]
  return sorted(found, key=lambda x: (x[0], x[1] == 'persistent'), reverse=True)


def steps_in(directory: str) -> list[int]:
  """The complete steps saved in one checkpoint directory, newest first."""
  d = epath.Path(directory)
  return sorted((int(p.name) for p in d.iterdir() if p.name.isdigit()), reverse=True) if d.is_dir() else []


def is_step_dir(path: str) -> bool:
  """Whether `path` is one saved step (`.../checkpoints/120`), not a directory of steps."""
  return os.path.basename(path.rstrip('/')).isdigit() and os.path.isdir(os.path.join(path, 'state'))


def _expand(path: str) -> str:
  """~ and $VARS ($SLURM_TMPDIR, $HOSTNAME, ...) expanded; a remote path
  (gs://, s3://) is left as it is."""
  path = os.path.expandvars(os.path.expanduser(path))
  return path if '://' in path else os.path.abspath(path)


_PROBE_BYTES = 1 << 20  # a full filesystem refuses a megabyte as surely as a checkpoint


def write_problem(directory: str) -> Optional[str]:
  """Why `directory` cannot take files (read-only, full, not a directory, no
  permission), or None. Creates it if needed; remote paths are not probed."""
  if '://' in directory:
    return None
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


def check_writable(dirs: dict[str, str], timeout_s: float = 300.0) -> None:
  """Raises ConfigError, in every process alike, unless every process can
  write each tier directory: a read-only or full filesystem is found before
  anything compiles, not at the first save."""
  mine = {name: problem for name, d in dirs.items() if (problem := write_problem(d))}
  reports = {i: json.loads(v) for i, v in distributed.report_exceptions(
      'ckpt/probe/writable', json.dumps(mine) if mine else None, timeout_s).items()}
  for name, directory in dirs.items():
    bad = {i: v[name] for i, v in sorted(reports.items()) if name in v}
    if bad:
      key = _tier_key(name)
      n = jax.process_count()
      who = '' if n == 1 else f' in process(es) {sorted(bad)} of {n}'
      raise ConfigError(
          f'CheckpointConfig.{key} = {directory!r} (the {name} tier) cannot be written{who}: '
          f'{next(iter(bad.values()))}. Checkpoints need a writable filesystem with room for '
          f'the train state; free space there, or point CheckpointConfig.{key} at another '
          f'directory' + (' (or set fast_every = 0).' if name == 'fast' else '.'))


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
  reports = {i: json.loads(v) for i, v in distributed.report_exceptions(
      'ckpt/probe/seen', json.dumps(unseen) if unseen else None, timeout_s).items()}
  if jax.process_index() == 0:
    for probe in probes.values():
      probe.unlink(missing_ok=True)
  for name, directory in dirs.items():
    blind = sorted(i for i, v in reports.items() if name in v)
    if blind:
      key = _tier_key(name)
      raise ConfigError(
          f'CheckpointConfig.{key} = {directory!r} (the {name} tier) is not shared by every process: '
          f'process(es) {blind} of {jax.process_count()} do not see the file process 0 wrote there, so '
          f'their checkpoint shards would never be committed. A multi-host job needs each tier '
          f'on a filesystem all hosts mount at the same path'
          + ('; set CheckpointConfig.fast_directory to such a path, or fast_every = 0 to turn the '
             'fast tier off.' if name == 'fast' else '.'))


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


def verify_step(path: str) -> tuple[str, str]:
  """Reads one saved step without a mesh and checks it against its checksums.

  Returns:
    (verdict, detail): 'ok', 'damaged' (detail names the arrays),
    'unreadable' (the error) or 'unchecked' (saved without checksums).
  """
  try:
    with open(os.path.join(path, 'meta', 'metadata')) as fh:
      meta = json.load(fh)
    saved = meta.get(FINGERPRINTS)
    data = None
    if os.path.exists(os.path.join(path, 'data', 'metadata')):
      with open(os.path.join(path, 'data', 'metadata')) as fh:
        data = json.load(fh)
    # Host arrays, whatever devices and mesh saved them: this runs on a login
    # node as well as next to a job that holds the GPUs.
    reader = ocp.PyTreeCheckpointer()
    tree = reader.metadata(os.path.join(path, 'state')).item_metadata.tree
    state = reader.restore(os.path.join(path, 'state'), restore_args=jax.tree.map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))
    reader.close()
  except Exception as e:  # any reason the step cannot be read is the verdict
    return 'unreadable', f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}'[:300]
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
                    'scan_layers', 'param_dtype')


def check_same_model(cfg: Any, workdir: str) -> None:
  """Raises ConfigError when `workdir` holds checkpoints of a model whose
  state has other shapes than `cfg`'s: resuming would fail, and starting
  over would overwrite the earlier run's config and metrics."""
  try:
    with open(os.path.join(workdir, 'config.json')) as fh:
      before = json.load(fh).get('model', {})
  except (OSError, ValueError, AttributeError):
    return  # a new workdir, or one without a readable record: nothing to protect
  tiers = tier_directories(cfg.checkpoint, workdir) if cfg.checkpoint.enabled else {}
  has_steps = any(os.path.isdir(d) and any(n.isdigit() for n in os.listdir(d))
                  for d in tiers.values() if '://' not in d)
  if not has_steps:
    return
  now = dataclasses.asdict(cfg.model)

  def resolved(m: dict, key: str):
    # None means "the default shape": 4 kv heads and None are the same with 4 heads.
    if key == 'n_kv_heads':
      return m.get(key) or m.get('n_heads')
    if key == 'head_dim':
      return m.get(key) or (m['d_model'] // m['n_heads'] if m.get('n_heads') else None)
    return m.get(key)
  differ = [k for k in STATE_SHAPE_KEYS if k in before and resolved(before, k) != resolved(now, k)]
  if differ:
    changes = ', '.join(f'ModelConfig.{k} = {resolved(before, k)!r} there, {resolved(now, k)!r} now' for k in differ)
    raise ConfigError(
        f'--workdir {workdir!r} holds checkpoints of another model ({changes}): they cannot be '
        f'resumed with this config, and starting over there would overwrite that run\'s config '
        f'and metrics. Either train this model in a new --workdir, or start it from a checkpoint '
        f'of its own shape with CheckpointConfig.restore_from (in a new --workdir as well).')


class Checkpointer:
  """Saves and restores train state, data-iterator state and config."""

  def __init__(self, cfg: CheckpointConfig, workdir: str):
    self.cfg = cfg
    self.workdir = workdir
    self.tiers: list[_Tier] = []
    self._unusable: set[tuple[str, int]] = set()   # (tier, step) that failed to restore
    dirs = tier_directories(cfg, workdir)
    check_writable(dirs)
    check_shared(dirs)
    for name, directory in dirs.items():
      keep, every = (cfg.keep, cfg.save_every) if name == 'persistent' else (cfg.fast_keep, cfg.fast_every)
      # Orbax names its multi-process barriers by step ('async_write_complete.4'):
      # two tiers saving the same step would meet in one barrier and fail
      # ("already ongoing"). A prefix per tier keeps their barriers apart.
      options = ocp.CheckpointManagerOptions(
          max_to_keep=keep, create=True, cleanup_tmp_directories=True,
          enable_async_checkpointing=cfg.async_save,
          multiprocessing_options=ocp.options.MultiprocessingOptions(
              barrier_sync_key_prefix=f'mjax_{name}'))
      manager = ocp.CheckpointManager(directory, options=options, item_names=('state', 'data', 'meta'))
      self.tiers.append(_Tier(name, directory, every, manager))

  def due(self, step: int) -> bool:
    return any(t.every and step % t.every == 0 for t in self.tiers)

  def save(self, step: int, state: Any, data: Optional[dict], meta: dict, force: bool = False) -> list[str]:
    """Starts the saves due at `step` (all tiers when `force`); returns their names.

    Blocks only while the arrays are copied to host memory; call `wait` to
    know the files are durable.
    """
    saved, prints = [], None
    for tier in self.tiers:
      if not (force or (tier.every and step % tier.every == 0)):
        continue
      if step in tier.manager.all_steps():
        if (tier.name, step) not in self._unusable:
          continue
        # This step failed to restore earlier in this run: replace it.
        self._move_aside(tier, step, os.path.join(tier.directory, str(step)))
        self._unusable.discard((tier.name, step))
      if prints is None:  # once per step, whatever the number of tiers
        prints = fingerprints(state)
      args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                data=ocp.args.JsonSave(data or {}),
                                meta=ocp.args.JsonSave({**meta, 'step': int(step), FINGERPRINTS: prints,
                                                        DATA_SHA256: data_digest(data)}))
      tier.manager.save(step, args=args, force=True)
      saved.append(tier.name)
    return saved

  def wait(self) -> None:
    """Blocks until every started save is complete on disk."""
    for tier in self.tiers:
      tier.manager.wait_until_finished()

  def steps(self) -> list[tuple[int, str]]:
    """(step, tier) of every complete checkpoint, newest first."""
    return [(step, tier) for step, tier, _ in saved_steps(self.cfg, self.workdir)]

  def restore_latest(self, abstract_state: Any) -> Optional[Restored]:
    """Newest readable checkpoint across the tiers, or None if there is none.

    Args:
      abstract_state: the state's ShapeDtypeStructs with target shardings;
        restoring reshards onto them (any mesh, any device count).
    """
    tiers = {t.name: t for t in self.tiers}
    for i, (step, name) in enumerate(self._candidates()):
      tier = tiers[name]
      path = os.path.join(tier.directory, str(step))
      damaged = False
      try:
        restored, error = self._restore(tier.manager, step, abstract_state, path), None
        bad = first_mismatch(restored.meta.get(FINGERPRINTS, {}), restored.state)
        if bad is not None:
          damaged, error = True, f'array {bad} does not match the checksum saved with it'
        elif restored.meta.get(DATA_SHA256, data_digest(restored.data)) != data_digest(restored.data):
          damaged, error = True, 'the data position does not match the checksum saved with it'
      except Exception as e:  # any unreadable checkpoint: report, fall back
        restored, error = None, f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}'
      # One process failing to read its shards sends every process back.
      verdicts = distributed.report_exceptions(f'ckpt/restore/{i}',
                                               None if error is None else ('D' if damaged else '0'))
      failed = sorted(verdicts)
      if not failed:
        return restored
      restored = None  # freed before the next candidate is read
      log.warning('checkpoint %s (step %d) is %s%s; falling back to an older one', path, step,
                  'damaged' if damaged else 'unreadable', f' ({error})' if error else f' in process(es) {failed}')
      # Saved afresh when training passes this step again (see `save`).
      self._unusable.add((name, step))
      if len(verdicts) == jax.process_count() and all(v == 'D' for v in verdicts.values()):
        # Bits that changed since the save: never usable again. (An unreadable
        # step may be a passing I/O fault: it stays where it is.)
        self._move_aside(tier, step, path)
    return None

  @staticmethod
  def _move_aside(tier: _Tier, step: int, path: str) -> None:
    """Renames a damaged step out of the tier (kept for inspection), so that
    training saves that step afresh when it gets there again."""
    if jax.process_index() == 0 and '://' not in path and os.path.isdir(path):
      aside = os.path.join(tier.directory, f'damaged-{step}-{int(time.time())}')
      try:
        os.rename(path, aside)
        log.warning('moved %s aside to %s', path, aside)
      except OSError as e:
        log.warning('could not move %s aside (%s); it will be skipped again', path, e)
    if jax.process_count() > 1:
      distributed.barrier(f'ckpt/aside/{tier.name}/{step}', 300.0)
    tier.manager.reload()

  def _candidates(self) -> list[tuple[int, str]]:
    """`steps()`, narrowed in a multi-process job to those every process sees."""
    mine = self.steps()
    if jax.process_count() == 1:
      return mine
    # Process 0's list, less what some process cannot see.
    first = [tuple(c) for c in json.loads(distributed.broadcast_str('ckpt/steps', json.dumps(mine)))]
    missing = [c for c in first if c not in set(mine)]
    hidden = {tuple(c) for v in distributed.report_exceptions(
        'ckpt/steps/missing', json.dumps(missing) if missing else None).values() for c in json.loads(v)}
    if hidden or len(first) != len(mine):
      log.warning('checkpoints %s are not seen by every process; skipped',
                  sorted(hidden | (set(mine) - set(first))))
    return [c for c in first if c not in hidden]

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
  restored = restore_from_path(cfg.restore_from, abstract_state)
  restored.explicit = True
  if not cfg.restore_data:
    restored.data = None
  return restored


def restore_from_path(path: str, abstract_state: Any) -> Restored:
  """Restores an explicit checkpoint: a step directory (`.../checkpoints/120`)
  or a checkpoint directory (its newest step)."""
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isdir(path):
    raise CheckpointNotFound(f'CheckpointConfig.restore_from = {path!r}: no such directory; give a '
                             f'run\'s checkpoints/ directory or one of its step folders.')
  base, leaf = os.path.split(path.rstrip('/'))
  if is_step_dir(path):
    directory, step = base, int(leaf)
  else:
    directory, step = path, None
  manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True),
                                  item_names=('state', 'data', 'meta'))
  try:
    if step is None:
      step = manager.latest_step()
      if step is None:
        raise CheckpointNotFound(f'CheckpointConfig.restore_from = {path!r}: no checkpoint in it; give '
                                 f'a run\'s checkpoints/ directory or one of its step folders.')
    return Checkpointer._restore(manager, step, abstract_state, os.path.join(directory, str(step)))
  finally:
    manager.close()
