"""Whether a saved step holds the bits that were saved.

Each save records per-array checksums of the state, computed on the devices
(`fingerprints`), and the sha256 of the data position in the step's meta
item. Every restore checks them (a step that fails is skipped, never
resumed), and so does `mjax-report checkpoint --verify` (`verify_step`),
without a mesh.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from mjax import jsonfile
from mjax.checkpoint.failures import BadRecord, quiet_failed_io_aftermath, read_error


# Keys in a checkpoint's meta item: per-array checksums of the state (see
# `fingerprints`), and the sha256 of the data iterator's state, whose one
# changed digit would silently replay or skip batches.
FINGERPRINTS = 'fingerprints'
DATA_SHA256 = 'data_sha256'


def data_digest(data: Optional[dict]) -> str:
  return hashlib.sha256(json.dumps(data or {}, sort_keys=True).encode()).hexdigest()


def prints_digest(prints: dict) -> str:
  return hashlib.sha256(json.dumps(prints, sort_keys=True).encode()).hexdigest()[:16]


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


def _no_item_metadata_warning(record: logging.LogRecord) -> bool:
  # (The second: a step whose tree metadata cannot be read, which the
  # verdict says with the file's name.)
  return not record.getMessage().startswith(('Metadata file does not exist', 'Failed to get item metadata'))


def tree_metadata_missing(step_path: str) -> Optional[str]:
  """'state/_METADATA: missing' when a step has lost the file Orbax reads its
  state's tree from (every later error then names no file), else None."""
  if '://' in step_path or not os.path.isdir(os.path.join(step_path, 'state')):
    return None   # a bucket's step (no local look), or a step gone whole: the read's error says it
  return None if os.path.exists(os.path.join(step_path, 'state', '_METADATA')) else 'state/_METADATA: missing'


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
        raise BadRecord(tree_metadata_missing(path) or
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
