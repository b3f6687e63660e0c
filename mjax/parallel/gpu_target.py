"""Compiling the train step for GPUs this machine does not have.

XLA's CUDA compiler can compile for a described GPU without one attached (a
deviceless, ahead-of-time compile): the CUDA PJRT plugin builds a topology of
N devices from a `GpuTargetConfigProto` (the card's SM count, memory, compute
capability), and `jit(...).lower(...).compile()` against that topology's
devices runs the whole GPU pipeline: SPMD partitioning, the GPU fusion and
collective passes, the latency-hiding scheduler. The result is the program an
N-GPU machine would run, scheduled, which is what shows what a CPU compile
cannot: asynchronous collectives, what compute the scheduler places between a
collective's start and done, FSDP gathers pipelined across layers, the
pipeline's stage shifts hidden behind compute.

What it needs: the CUDA plugin of the installed jaxlib (`pip install
"jax[cuda12-local]"`: `jax-cuda12-plugin` and `jax-cuda12-pjrt`, ~180 MB),
neither a GPU, a driver nor the CUDA libraries. What differs from a run on the
real machine:
  * no autotuning (XLA takes its default GEMM configurations), which changes
    kernels, not the collective schedule;
  * cuDNN kernels need libcudnn to be built, so attention compiles as XLA's
    own (`attention_impl='xla'`), as it would without cuDNN.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from typing import Any, Optional

from mjax.errors import UserError

# GpuTargetConfigProto text of each card: what XLA's cost models and the
# scheduler read (SMs, clocks, memory size and bandwidth, cache, compute
# capability), from NVIDIA's published specifications.
_SM90 = """
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{name}"
"""
TARGETS: dict[str, str] = {
    'h100': _SM90.format(name='NVIDIA H100 80GB HBM3', memory=84978434048, bandwidth=3352320000000),
    'h200': _SM90.format(name='NVIDIA H200', memory=150754820096, bandwidth=4800000000000),
}
DEVICES_PER_HOST = 8   # one NVLink domain (HGX board)


@dataclasses.dataclass(frozen=True)
class Target:
  """`name` GPUs, `devices` in all, on ceil(devices / 8) hosts of up to 8."""
  name: str
  devices: int

  @property
  def hosts(self) -> int:
    return math.ceil(self.devices / DEVICES_PER_HOST)

  def __str__(self) -> str:
    return f'{self.devices} x {self.name.upper()}' + (f' ({self.hosts} hosts)' if self.hosts > 1 else '')


def parse_target(spec: str) -> Target:
  """'h100:8' -> Target('h100', 8).

  Raises:
    UserError: an unknown card, or a device count that does not fill whole
      hosts of 8 (a partly filled host is not a machine anyone runs).
  """
  m = re.fullmatch(r'\s*([A-Za-z0-9]+)\s*[:x]\s*(\d+)\s*', spec or '')
  cards = ', '.join(sorted(TARGETS))
  if not m or m.group(1).lower() not in TARGETS or int(m.group(2)) < 1:
    raise UserError(f'--target {spec!r}: expected CARD:DEVICES with CARD one of {cards} and DEVICES '
                    'a positive count, e.g. h100:8 (one 8-GPU host) or h100:16 (two hosts).')
  n = int(m.group(2))
  if n > DEVICES_PER_HOST and n % DEVICES_PER_HOST:
    raise UserError(f'--target {spec!r}: {n} devices do not fill hosts of {DEVICES_PER_HOST}; '
                    f'use up to {DEVICES_PER_HOST}, or a multiple of {DEVICES_PER_HOST}.')
  return Target(m.group(1).lower(), n)


def keep_local_backend_cpu() -> None:
  """This process's own backend stays the CPU (unless JAX_PLATFORMS says
  otherwise): a CUDA plugin with no GPU would otherwise be tried first, and
  fail noisily, when JAX starts. Call before anything starts the backend."""
  import jax
  if not jax.config.jax_platforms:
    jax.config.update('jax_platforms', 'cpu')


def topology_devices(target: Target) -> list[Any]:
  """The devices of a deviceless topology for `target` (no GPU needed).

  Raises:
    UserError: the CUDA PJRT plugin is not installed.
  """
  import jax
  from jax.experimental import topologies
  per_host = min(target.devices, DEVICES_PER_HOST)
  try:
    topo = topologies.get_topology_desc(
        platform='cuda', topology_name=target.name,
        topology=f'1x{target.hosts}x{per_host}', target_config=TARGETS[target.name])
  except (NotImplementedError, RuntimeError) as e:
    if 'topology not implemented' not in str(e) and 'cuda' not in str(e).lower():
      raise
    import jaxlib
    raise UserError(
        f'--target {target.name}:{target.devices} compiles with the CUDA compiler, which is not '
        f'installed ({e}). Install the CUDA plugin of this jaxlib, which needs no GPU: pip install '
        f'"jax-cuda12-plugin=={jaxlib.__version__}" "jax-cuda12-pjrt=={jaxlib.__version__}" '
        '(or jax-cuda13-*), then run again.') from None
  return list(topo.devices)


def for_target(cfg):
  """The config as a GPU run would resolve it, and notes on what differs.

  'auto' choices that depend on the backend are made for a GPU, since this
  process's own backend is the CPU: fuse_projections takes the GPU's choice.
  cuDNN attention cannot be built without libcudnn, so attention is XLA's.
  """
  from mjax.model.transformer import fusion
  model = cfg.model
  notes = []
  if model.fuse_projections == 'auto':
    model = dataclasses.replace(model, fuse_projections=fusion(model, platform='gpu'))
  if model.attention_impl in ('cudnn', 'dot_product'):
    notes.append(f'attention compiled as XLA\'s (attention_impl {model.attention_impl!r} would run '
                 'cuDNN on the GPU; its kernels need libcudnn to be built)')
    model = dataclasses.replace(model, attention_impl='xla')
  notes.append('no autotuning: default GEMM kernels (the collective schedule is what a GPU compile '
               'gives; kernel times are not)')
  return dataclasses.replace(cfg, model=model), notes


def compile_options(cfg) -> dict[str, object]:
  """The XLA options a GPU training run of `cfg` sets (mjax.flags.apply_xla_flags)
  as typed compile options, keeping those the installed plugin defines."""
  from mjax.parallel import xla_flags
  wanted = xla_flags.wanted_flags(**xla_flags.config_flags(cfg), overlap=cfg.train.xla_overlap_flags)
  plugins = [p for p in xla_flags.xla_libraries() if os.sep + 'jaxlib' + os.sep not in p]
  if plugins:
    wanted = xla_flags.with_successors(wanted, xla_flags.supported_flags(xla_flags.SUCCESSOR_NAMES, plugins))
  ok = xla_flags.supported_flags(wanted, plugins) if plugins else set(wanted)
  return xla_flags.as_compile_options({k: v for k, v in wanted.items() if k in ok})


@dataclasses.dataclass
class Compiled:
  compiled: Any          # jax.stages.Compiled for the target's devices
  mesh: Any              # the jax Mesh over the topology's devices
  cfg: Any               # the config as compiled (see for_target)
  notes: list[str]
  options: dict[str, object]
  seconds: float


def compile_step(cfg, target: Target, options: Optional[dict[str, object]] = None) -> Compiled:
  """The train step of `cfg` compiled for `target`.

  `cfg` must be validated for the target's device count
  (`mjax.flags.load(..., num_devices=target.devices)`).

  Args:
    options: XLA compile options; default `compile_options(cfg)`, what a GPU
      run of this config would set.
  """
  from mjax.parallel import make_mesh
  from mjax.train import make_program
  cfg, notes = for_target(cfg)
  devices = topology_devices(target)
  mesh = make_mesh(cfg.mesh, devices=devices)
  program = make_program(cfg, mesh)
  options = dict(compile_options(cfg) if options is None else options)
  t0 = time.perf_counter()
  with program.context():
    lowered = program.step.lower(program.abstract_state(), program.abstract_batch())
    compiled = compile_with(lowered, options, notes)
  return Compiled(compiled, mesh, cfg, notes, options, time.perf_counter() - t0)


_NO_SUCH_OPTION = re.compile(r"No such compile option: '([^']+)'")


def compile_with(lowered, options: dict[str, object], notes: list[str]):
  """`lowered` compiled with `options`, less those this jaxlib has no
  compile option for (each dropped from `options`, with a note).

  Compile options are fields of XLA's DebugOptions, and a jaxlib removes a
  field when its flag becomes the default: jaxlib 0.11 has no
  xla_gpu_enable_pipelined_reduce_scatter, while its flag table still names
  it (XLA_FLAGS takes it as a no-op), so the flag scan cannot tell."""
  while True:
    try:
      return lowered.compile(compiler_options=options)
    except Exception as e:  # noqa: BLE001 -- jax's runtime error type moved between versions
      found = _NO_SUCH_OPTION.search(str(e))
      if not found or found.group(1) not in options:
        raise
      options.pop(found.group(1))
      notes.append(f'--{found.group(1)} left out: this jaxlib has no such compile option (its default applies)')
