"""XLA flags that overlap GPU collectives with compute, and a safe way to set them.

XLA reads `XLA_FLAGS` once, when the backend starts, and aborts the process on
a flag it does not know. So `apply_xla_flags` must run before the first JAX
computation, and it only adds flags that the installed XLA libraries define.

What the flags do (defaults as in recent XLA's xla/debug_options_flags.cc;
the set follows MaxText's GPU scripts and NVIDIA JAX-Toolbox's "GPU
performance" guide):

  * Collectives are asynchronous by default on GPU (`-start` / `-done` pairs;
    the old `--xla_gpu_enable_async_collectives` flag is gone: jaxlib 0.10
    aborts on it). Asynchronous is not yet overlapped: it is the latency-hiding
    scheduler that places independent compute between a `-start` and its
    `-done` (JAX-Toolbox: overlap needs both).
  * Scanned layers run in a while loop. Pipelining moves the all-gather of
    layer i+1's weights (FSDP) into iteration i, and the reduce-scatter of
    layer i's gradients into iteration i+1, so the loop body always has compute
    to hide them behind; double buffering unrolls the loop by two to make room.
  * Combining merges many small collectives into few large ones (one NCCL
    launch each); the thresholds cap the merged size.
  * Collective matmul ("windowed einsum") splits a tensor-parallel matmul into
    chunks and overlaps each chunk's all-gather / reduce-scatter with the
    previous chunk's matmul. It is a separate group (`collective_matmul=True`),
    which a run sets only through `xla_extra_flags`: mjax's own rings
    (MeshConfig.collective_matmul) do it for fewer bytes (see config_flags).

Not set here: `CUDA_DEVICE_MAX_CONNECTIONS=1` (an environment variable for the
CUDA driver, which JAX-Toolbox recommends before Blackwell and advises against
on Blackwell) and the NCCL environment variables.
"""

from __future__ import annotations

import glob
import logging
import mmap
import os
import shlex
import sys
from typing import Iterable, Optional, Sequence

from mjax import devices

log = logging.getLogger('mjax')

# Flag name -> value. Each one exists for the reason in its comment.
OVERLAP_FLAGS: dict[str, str] = {
    # Schedule collectives so their latency hides behind independent compute
    # (default false).
    'xla_gpu_enable_latency_hiding_scheduler': 'true',
    # Run collectives on a high-priority stream so compute kernels cannot
    # starve them (default true; stated so a user override is visible).
    'xla_gpu_enable_highest_priority_async_stream': 'true',
    # FSDP: gather the next layer's weights during the current layer's compute.
    'xla_gpu_enable_pipelined_all_gather': 'true',
    # FSDP: reduce-scatter a layer's gradients during the next layer's
    # backward (default true; stated so a user override is visible).
    'xla_gpu_enable_pipelined_reduce_scatter': 'true',
    # Data parallel: all-reduce a layer's gradients during the next layer's backward.
    'xla_gpu_enable_pipelined_all_reduce': 'true',
    # Unroll the layer loop by two so that one iteration's pipelined collectives
    # overlap the other iteration's compute (JAX-Toolbox's FSDP recipe).
    'xla_gpu_enable_while_loop_double_buffering': 'true',
    # Merge gradient all-reduces up to 128 MiB (default 30 MiB): fewer, larger
    # NCCL calls reach higher bandwidth (MaxText's GPU value).
    'xla_gpu_all_reduce_combine_threshold_bytes': str(128 * 2**20),
    # Merge FSDP weight all-gathers up to 128 MiB (MaxText's GPU value).
    'xla_gpu_all_gather_combine_threshold_bytes': str(128 * 2**20),
    # Merge FSDP gradient reduce-scatters up to 64 MiB (MaxText's GPU value).
    'xla_gpu_reduce_scatter_combine_threshold_bytes': str(64 * 2**20),
    # Combine across tensor dimensions too, not only along the same dimension,
    # so layers with differently shaped weights merge (default false already;
    # stated because MaxText and JAX-Toolbox set it explicitly).
    'xla_gpu_enable_all_gather_combine_by_dim': 'false',
    'xla_gpu_enable_reduce_scatter_combine_by_dim': 'false',
}

# XLA's collective matmul: overlap a tensor-parallel activation all-gather /
# reduce-scatter with the matmul that consumes / produces it. Asked for
# only explicitly (see config_flags); MeshConfig.collective_matmul is mjax's.
COLLECTIVE_MATMUL_FLAGS: dict[str, str] = {
    # Rewrite every eligible einsum (threshold 0 MiB; the default, 100000 MiB,
    # leaves all of them alone).
    'xla_gpu_threshold_for_windowed_einsum_mib': '0',
    # Run the windowed einsum's chunks on several streams so they overlap.
    'xla_gpu_multi_streamed_windowed_einsum': 'true',
}

# ModelConfig.gelu_epilogue only: every matrix product on cuBLAS(Lt), whose
# rewriter fuses the GeLU into the MLP's input product (GELU_AUX epilogue).
# XLA's Triton GEMM rewriter runs first and would claim that product. On the
# 1p3b H100 step Triton off alone costs nothing (502.9 against 504.2 ms) and
# with the epilogue the step is 498.5 ms (bench/RESULTS.md).
GELU_EPILOGUE_FLAGS: dict[str, str] = {
    'xla_gpu_enable_triton_gemm': 'false',
}

# Flags a newer XLA replaced by another: old name -> (new name, the new
# flag's value for the old 'true'). jaxlib 0.11 turned the three pipelining
# booleans into modes (default / off / on / explicit): the old names are
# still read from XLA_FLAGS, as deprecated aliases ('true' is 'on'), but
# are no longer compile options, and may go from XLA_FLAGS too.
SUCCESSORS: dict[str, tuple[str, str]] = {
    'xla_gpu_enable_pipelined_all_gather': ('xla_gpu_pipeline_all_gather', 'on'),
    'xla_gpu_enable_pipelined_reduce_scatter': ('xla_gpu_pipeline_reduce_scatter', 'on'),
    'xla_gpu_enable_pipelined_all_reduce': ('xla_gpu_pipeline_all_reduce', 'on'),
}
SUCCESSOR_NAMES = frozenset(new for new, _ in SUCCESSORS.values())
# The modes as a compile option spells them (the DebugOptions enum).
_PIPELINING_MODES = {m: f'COLLECTIVE_PIPELINING_MODE_{m.upper()}' for m in ('default', 'off', 'on', 'explicit')}


def with_successors(flags: dict[str, Optional[str]], supported: Iterable[str],
                    user_set: Iterable[str] = ()) -> dict[str, Optional[str]]:
  """`flags` with each replaced flag under its successor's name where
  `supported` holds that name (and the user set neither name): 'true' is
  the successor's value for it, anything else its 'default'. In order."""
  supported, user_set = set(supported), set(user_set)
  out: dict[str, Optional[str]] = {}
  for name, value in flags.items():
    new = SUCCESSORS.get(name)
    if new and new[0] in supported and new[0] not in user_set and new[0] not in flags:
      on = value is None or value.lower() in ('true', '1')
      out[new[0]] = new[1] if on else 'default'
    else:
      out[name] = value
  return out


# Names every XLA flag table has defined for years. A library is a flag table
# only if it defines all of them: one alone is not enough, since some
# extension modules that parse no flags hold a stray 'xla_dump_to' string
# (jax-cuda13-plugin 0.11's _triton.so and cuda_plugin_extension.so did, and
# counting them as flag tables without the GPU flags dropped every overlap flag).
_FLAG_TABLE_MARKERS = tuple(n + b'\x00' for n in (
    b'xla_dump_to', b'xla_dump_hlo_as_text', b'xla_dump_hlo_pass_re',
    b'xla_backend_optimization_level'))
_GPU_PLATFORMS = ('gpu', 'cuda', 'rocm')
_scan_cache: dict[tuple[str, int, float], dict[str, bool]] = {}


def parse_flags(text: str) -> dict[str, Optional[str]]:
  """'--a=1 --b' -> {'a': '1', 'b': None}; later duplicates win, as in XLA."""
  flags: dict[str, Optional[str]] = {}
  for tok in shlex.split(text or ''):
    if not tok.startswith('--'):
      continue
    name, eq, value = tok[2:].partition('=')
    flags[name] = value if eq else None
  return flags


def xla_libraries(search_paths: Optional[Sequence[str]] = None) -> list[str]:
  """Shared libraries of the installed jaxlib and GPU plugins.

  Args:
    search_paths: directories holding the packages (default: sys.path).
  Returns:
    .so paths under jaxlib/, jax_cuda*_plugin/, jax_rocm*_plugin/ and the PJRT
    plugins in jax_plugins/ (where jax-cuda12-pjrt puts xla_cuda_plugin.so).
  """
  patterns = ('jaxlib', 'jax_cuda*_plugin', 'jax_rocm*_plugin', 'jax_plugins/xla_cuda*',
              'jax_plugins/xla_rocm*')
  found = []
  for base in search_paths if search_paths is not None else sys.path:
    if not base or not os.path.isdir(base):
      continue
    for pat in patterns:
      for pkg in glob.glob(os.path.join(base, pat)):
        found += glob.glob(os.path.join(pkg, '**', '*.so*'), recursive=True)
  return sorted(set(found))


def _scan(path: str, names: Iterable[str]) -> dict[str, bool]:
  """{name: whether the library defines the flag}, plus '' -> whether it has
  an XLA flag table at all. Results are cached per file version.

  A flag is registered as a NUL-terminated C string literal, so the name must
  be followed by a NUL byte. A bare substring match is not enough: the
  DebugOptions protobuf descriptor keeps removed flags as length-prefixed
  reserved names (e.g. `xla_gpu_enable_async_collectives` in jaxlib 0.10,
  which XLA rejects).
  """
  st = os.stat(path)
  cached = _scan_cache.setdefault((path, st.st_size, st.st_mtime), {})
  todo = [n for n in names if n not in cached]
  if todo or '' not in cached:
    with open(path, 'rb') as fh:
      data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if st.st_size else b''
      try:
        if '' not in cached:
          cached[''] = all(data.find(m) >= 0 for m in _FLAG_TABLE_MARKERS)
        for n in todo:
          cached[n] = cached[''] and data.find(n.encode() + b'\x00') >= 0
      finally:
        if isinstance(data, mmap.mmap):
          data.close()
  return cached


def supported_flags(names: Iterable[str], libraries: Optional[Sequence[str]] = None) -> set[str]:
  """The subset of flag `names` that every flag-parsing XLA library defines.

  jaxlib and the GPU PJRT plugin each parse XLA_FLAGS with their own copy of
  XLA, and either aborts on a flag it lacks, so a flag must be in all of them.

  Args:
    names: flag names without the leading '--'.
    libraries: .so paths to check (default: `xla_libraries()`).
  Returns:
    Supported names; empty when no library with a flag table is found, since
    then nothing can be checked.
  """
  names = list(names)
  libraries = xla_libraries() if libraries is None else libraries
  tables = [r for r in (_scan(p, names) for p in libraries) if r['']]
  if not tables:
    return set()
  return {n for n in names if all(t[n] for t in tables)}


def detect_platform() -> str:
  """'gpu' when a GPU backend will start, else the first platform ('cpu', 'tpu').

  Decided without starting a backend: JAX_PLATFORMS (or jax.config when JAX is
  already imported) if set, else whether a CUDA / ROCm plugin is installed.
  """
  platforms = os.environ.get('JAX_PLATFORMS', '')
  jax_mod = sys.modules.get('jax')
  if jax_mod is not None:
    platforms = getattr(jax_mod.config, 'jax_platforms', None) or platforms
  if platforms:
    names = [p.strip().lower() for p in platforms.split(',') if p.strip()]
    return 'gpu' if any(p in _GPU_PLATFORMS for p in names) else names[0]
  plugins = [p for p in xla_libraries() if os.sep + 'jaxlib' + os.sep not in p]
  return 'gpu' if plugins else 'cpu'


def wanted_flags(extra: str = '', *, collective_matmul: bool = False, gelu_epilogue: bool = False,
                 overlap: bool = True) -> dict[str, Optional[str]]:
  """The flags a GPU run asks for: OVERLAP_FLAGS and, when `collective_matmul`,
  COLLECTIVE_MATMUL_FLAGS (both only when `overlap`), GELU_EPILOGUE_FLAGS
  when `gelu_epilogue`, then `extra` ('--xla_foo=1 ...'), which wins."""
  wanted: dict[str, Optional[str]] = dict(OVERLAP_FLAGS) if overlap else {}
  if collective_matmul and overlap:
    wanted.update(COLLECTIVE_MATMUL_FLAGS)
  if gelu_epilogue:
    wanted.update(GELU_EPILOGUE_FLAGS)
  wanted.update(parse_flags(extra))
  return wanted


def config_flags(cfg) -> dict[str, object]:
  """What of a Config (mjax.config.Config) decides its XLA flags, as the
  keyword arguments of `wanted_flags` and `apply_xla_flags` (all but
  `overlap`: TrainConfig.xla_overlap_flags, which callers may turn off)."""
  # Not XLA's own collective matmul (COLLECTIVE_MATMUL_FLAGS), once asked
  # for with any tensor parallelism. jaxlib 0.11's GPU compiler is the first
  # to emit it without a GPU, and there a tensor x sequence parallel step
  # (tiny, 8 layers, data 2 x tensor 4) sent 2.7x the bytes over `tensor`
  # (23.7 against 8.8 MB: 200 collective-permutes, 46 of them synchronous,
  # in place of the all-gathers and reduce-scatters), while
  # MeshConfig.collective_matmul's rings send 7.3 MB, each behind a product.
  # `xla_extra_flags` still turns it on.
  return dict(extra=cfg.train.xla_extra_flags, gelu_epilogue=cfg.model.gelu_epilogue)


def as_compile_options(flags: dict[str, Optional[str]]) -> dict[str, object]:
  """XLA flags as `Lowered.compile(compiler_options=...)` takes them: typed
  values ('true' -> True, '128' -> 128), since XLA rejects the string 'true'
  for a bool option there (XLA_FLAGS parses text, compile options do not)."""
  out: dict[str, object] = {}
  for name, value in flags.items():
    if name in SUCCESSOR_NAMES and value is not None and value.lower() in _PIPELINING_MODES:
      out[name] = _PIPELINING_MODES[value.lower()]
    elif value is None or value.lower() == 'true':
      out[name] = True
    elif value.lower() == 'false':
      out[name] = False
    else:
      try:
        out[name] = int(value)
      except ValueError:
        try:
          out[name] = float(value)
        except ValueError:
          out[name] = value
  return out


def apply_xla_flags(enabled: bool, extra: str = '', platform: Optional[str] = None, *,
                    collective_matmul: bool = False, gelu_epilogue: bool = False,
                    libraries: Optional[Sequence[str]] = None) -> list[str]:
  """Adds the overlap flags, and those the config asks for, to
  os.environ['XLA_FLAGS'] (GPU only).

  Call it before the first JAX computation: XLA reads the variable once, when
  the backend starts. A flag already in XLA_FLAGS is never overridden, and a
  flag the installed XLA does not define is dropped with a warning (XLA would
  abort the process on it).

  Args:
    enabled: False leaves the overlap flags out (TrainConfig.xla_overlap_flags);
      `extra` and the GeLU epilogue's flags still apply.
    extra: more flags ('--xla_foo=1 --xla_bar=2'); they replace the defaults
      of the same name, and are subject to the same two rules.
    platform: 'gpu' / 'cuda' / 'rocm' apply the flags; anything else is a
      no-op. None: `detect_platform()`.
    collective_matmul: also add COLLECTIVE_MATMUL_FLAGS (XLA's windowed
      einsum; it can only help tensor-parallel matmuls).
    gelu_epilogue: also add GELU_EPILOGUE_FLAGS; pass ModelConfig.gelu_epilogue.
    libraries: .so files to check the flags against (default: the installed
      jaxlib and GPU plugins).
  Returns:
    The flags added, as '--name=value' strings, in the order added.
  """
  if not (enabled or extra or gelu_epilogue):
    return []
  platform = (platform or detect_platform()).lower()
  if platform not in _GPU_PLATFORMS:
    log.info('XLA overlap flags: platform %s is not a GPU, nothing set', platform)
    return []
  wanted = wanted_flags(extra, collective_matmul=collective_matmul, gelu_epilogue=gelu_epilogue,
                        overlap=enabled)
  current = os.environ.get('XLA_FLAGS', '')
  user_set = parse_flags(current)
  todo = {k: v for k, v in wanted.items() if k not in user_set}
  libraries = xla_libraries() if libraries is None else libraries
  if todo and not any(_scan(p, ())[''] for p in libraries):
    log.warning('XLA overlap flags: no jaxlib / GPU plugin library with an XLA flag table '
                'found to check them against; none set')
    return []
  todo = with_successors(todo, supported_flags(SUCCESSOR_NAMES, libraries), user_set)
  ok = supported_flags(todo, libraries)
  dropped = sorted(set(todo) - ok)
  if dropped:
    log.warning('XLA overlap flags: the installed jaxlib / GPU plugin does not define %s; '
                'left out (XLA aborts on unknown flags)', ', '.join(dropped))
  added = [f'--{k}' if v is None else f'--{k}={v}' for k, v in todo.items() if k in ok]
  if added:
    if devices.backend_started():
      log.warning('XLA overlap flags set after the JAX backend started; they take '
                  'effect only in processes started later')
    os.environ['XLA_FLAGS'] = ' '.join([current.strip(), *added]).strip()
    log.info('XLA overlap flags: added %s', ' '.join(added))
  return added
