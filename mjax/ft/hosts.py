"""Which hosts a job runs on: the block list, spares, elastic shrinking.

`<workdir>/blocked_hosts.json` lists the hosts that failed a diagnostic (or
were evicted as stragglers) as `[{"host", "reason", "time"}, ...]`. It only
grows: a host in it is never used again by that workdir (take it out by
hand once it has been repaired).

After a fault the job restarts on the same number of hosts when it can,
taking spares for blocked ones; when not enough healthy hosts remain it
shrinks (elastic): fewer processes, a smaller data-parallel size, and the
same global batch kept by gradient accumulation, so the run trains the same
model on the same data order (checkpoints restore onto any layout, and the
data position is global).
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional, Sequence

from mjax import jsonfile
from mjax.errors import UserError

BLOCKED_FILE = 'blocked_hosts.json'


class ElasticError(ValueError):
  """The job cannot continue on the hosts that are left."""


class BlockList:
  """The persisted list of hosts this workdir must not use."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, BLOCKED_FILE)
    self.entries: list[dict] = []
    if os.path.exists(self.path):
      try:
        with open(self.path) as fh:
          entries = jsonfile.load(fh)
      except (OSError, ValueError) as e:   # UnicodeDecodeError is a ValueError
        raise UserError(f'{self.path}: not readable as the list of blocked hosts ({type(e).__name__}: {e}). '
                        f'It is a JSON list of {{"host", "reason", "time"}} entries that mjax-launch writes; '
                        f'fix it, or delete it to unblock every host.') from None
      if not (isinstance(entries, list) and all(isinstance(e, dict) and isinstance(e.get('host'), str)
                                                and 'reason' in e for e in entries)):
        raise UserError(f'{self.path}: expected a JSON list of {{"host": ..., "reason": ..., "time": ...}} '
                        f'entries, found {json.dumps(entries)[:200]}; fix it, or delete it to unblock every host.')
      self.entries = entries

  def __contains__(self, host: str) -> bool:
    return any(e['host'] == host for e in self.entries)

  def hosts(self) -> list[str]:
    return [e['host'] for e in self.entries]

  def add(self, host: str, reason: str) -> dict:
    entry = {'host': host, 'reason': reason, 'time': round(time.time(), 3)}
    if host not in self:
      self.entries.append(entry)
      jsonfile.write_atomic(self.path, self.entries, indent=1)   # never a half-written list
    return entry


def plan_hosts(wanted: int, hosts: Sequence[str], spares: Sequence[str], blocked: BlockList) -> list[str]:
  """The hosts of the next attempt: the job's healthy hosts in order, then
  spares for the blocked ones; fewer than `wanted` when both run out."""
  pool = [h for h in list(hosts) + list(spares) if h not in blocked]
  return pool[:wanted]


def data_parallel_size(mesh, num_devices: int) -> int:
  """data x fsdp of `mesh` (MeshConfig) on `num_devices`, dcn axes included."""
  from mjax.config import resolve_mesh_shape
  ici = resolve_mesh_shape(mesh, num_devices)
  sizes = dict(zip(mesh.AXES, (i * j for i, j in zip(ici, mesh.dcn_shape()))))
  return sizes['data'] * sizes['fsdp']


def elastic_bindings(cfg, processes: int, new_processes: int, devices: int) -> list[str]:
  """Gin bindings that run `cfg` (laid out for `processes` x `devices`) on
  `new_processes` x `devices`, keeping the global batch.

  The data-parallel size becomes what the devices left hold; each replica
  then takes the batch in as many slices (gradient accumulation) as it needs
  for a step to still see `global_batch_size` sequences, none larger than
  before (so that they fit in memory). Any data-parallel size whose slices
  divide the global batch will do, not only a divisor of the old one: a
  job of 1,250 hosts that loses one goes on on 1,000 (10,000 sequences,
  slices of 5), not on 625. Axes sized -1 adapt by themselves; an explicit
  data-parallel axis (the dcn one on a hybrid mesh) is resized.

  Raises:
    ElasticError: no slicing of the global batch fits the new data-parallel
      size, or the layout needs more devices than are left; the message
      says which.
  """
  if new_processes == processes:
    return []
  mesh, train = cfg.mesh, cfg.train
  model_parallel = mesh.tensor * mesh.dcn_tensor * mesh.pipeline * mesh.dcn_pipeline
  new_devices = new_processes * devices
  if new_devices % model_parallel:
    raise ElasticError(
        f'cannot continue on {new_processes} process(es) x {devices} device(s): the model-parallel '
        f'group (tensor x pipeline = {model_parallel} devices) does not fit in {new_devices} '
        f'devices. Bring back enough healthy hosts, or give spares with --spares.')
  from mjax.config import ConfigError
  try:
    old_dp = data_parallel_size(mesh, processes * devices)
  except ConfigError as e:   # the job's own layout, as the driver understands it, does not resolve
    raise ElasticError(f'cannot lay out a smaller job: {e}') from None
  new_dp = new_devices // model_parallel
  rows = train.global_batch_size
  # Sequences each replica took in one slice before: no new slice is larger.
  most = max(1, rows // (old_dp * train.grad_accum_steps))
  slices = next((k for k in range(1, rows // new_dp + 1)
                 if rows % (new_dp * k) == 0 and rows // (new_dp * k) <= most), None)
  if slices is None:
    raise ElasticError(
        f'cannot keep the global batch on {new_processes} process(es): {new_dp} data-parallel replicas '
        f'do not divide TrainConfig.global_batch_size = {rows} into equal slices of at most {most} '
        f'sequences, so no whole number of gradient-accumulation steps gives the same batch. Give spares '
        f'with --spares, or run with a process count whose replicas divide the batch.')
  out = [f'TrainConfig.grad_accum_steps = {slices}'] if slices != train.grad_accum_steps else []
  if mesh.dcn_data > 1 or mesh.dcn_fsdp > 1:
    axis = 'dcn_data' if mesh.dcn_data > 1 else 'dcn_fsdp'
  elif -1 not in (mesh.data, mesh.fsdp):
    axis = 'data' if mesh.data > 1 else 'fsdp'
  else:
    return out
  size = getattr(mesh, axis)
  rest = old_dp // size   # the data-parallel size the other axes make
  if new_dp % rest:
    raise ElasticError(f'MeshConfig.{axis} = {size} cannot become {new_dp} / {rest} data-parallel '
                       f'groups; bring back hosts or give spares.')
  return out + [f'MeshConfig.{axis} = {new_dp // rest}']


def check_bindings(gin_files: Sequence[str], bindings: Sequence[str], num_devices: Optional[int]) -> None:
  """Validates the trainer's config with extra bindings before launching it;
  raises ElasticError with the config's own one-paragraph message."""
  from mjax.config import ConfigError, load_config
  try:
    load_config(gin_files, bindings, num_devices=num_devices)
  except ConfigError as e:
    raise ElasticError(f'the shrunk layout is not valid: {e}') from None
