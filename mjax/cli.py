"""Command-line entry points. Each one parses flags, builds the config and
calls one function; flags are defined here and nowhere else.

  mjax-train --gin_file configs/tiny.gin --workdir runs/tiny \
             --gin.TrainConfig.steps=30 --gin_param='OptimConfig.learning_rate = 1e-3'
  mjax-flops --gin_file configs/gpt3_175b.gin
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

DEFAULT_GIN = 'tiny.gin'
EXIT_BAD_INPUT = 2     # config, data or usage error: retrying will not help
EXIT_NONFINITE = 3     # the loss became NaN/Inf
EXIT_INTERRUPTED = 130  # Ctrl-C outside the loop's own stop handling (shell convention 128 + SIGINT)


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog=prog, description=description,
      epilog='Overrides: --gin_param="TrainConfig.steps = 30" or --gin.TrainConfig.steps=30 '
             '(both repeatable, applied after the gin files, last one wins).')
  p.add_argument('--gin_file', action='append', default=[],
                 help=f'gin config file, repeatable (default: configs/{DEFAULT_GIN}); '
                      'a bare name is looked up in the configs/ folder')
  p.add_argument('--gin_param', action='append', default=[], help="gin binding, e.g. 'TrainConfig.steps = 30'")
  return p


def _split_overrides(parser: argparse.ArgumentParser, argv: Sequence[str]):
  """Parses known flags and turns every `--gin.KEY=VALUE` into a binding."""
  from mjax.config import override_to_binding
  args, rest = parser.parse_known_args(argv)
  bindings = list(args.gin_param)
  i = 0
  while i < len(rest):
    tok = rest[i]
    if not tok.startswith('--gin.'):
      parser.error(f'unrecognized argument {tok!r}; see --help')
    key, eq, value = tok[len('--gin.'):].partition('=')
    if not eq:  # `--gin.KEY VALUE`
      if i + 1 >= len(rest):
        parser.error(f'{tok} needs a value: {tok}=VALUE')
      i += 1
      value = rest[i]
    bindings.append(override_to_binding(key, value))
    i += 1
  return args, bindings


def _load(prog: str, args, bindings, num_devices: Optional[int]):
  from mjax.config import ConfigError, load_config
  try:
    return load_config(args.gin_file or [DEFAULT_GIN], bindings, num_devices=num_devices)
  except ConfigError as e:
    _die(prog, str(e))


def _die(prog: str, message: str):
  print(f'{prog}: error: {message}', file=sys.stderr)
  sys.exit(EXIT_BAD_INPUT)


def _apply_overlap_flags(cfg) -> None:
  """XLA reads XLA_FLAGS once, when the backend starts: this must run before
  anything asks JAX for its devices, hence before mesh-aware validation."""
  from mjax.parallel.xla_flags import apply_xla_flags
  apply_xla_flags(cfg.train.xla_overlap_flags, extra=cfg.train.xla_extra_flags,
                  collective_matmul=cfg.mesh.tensor * cfg.mesh.dcn_tensor > 1)


def _join_job(prog: str, cfg=None) -> None:
  """Joins a multi-process job described by the environment (mjax/distributed.py):
  after the XLA flags are set, before anything starts the JAX backend."""
  from mjax import distributed
  try:
    distributed.initialize_from_env(peer_timeout_s=cfg.fault.collective_timeout_s if cfg else None)
  except distributed.DistributedError as e:
    _die(prog, str(e))


def train_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-train: trains a model described by gin files."""
  prog = 'mjax-train'
  p = _parser(prog, 'Train a language model.')
  p.add_argument('--workdir', default=None,
                 help='run directory: config, metrics.jsonl, TensorBoard events (default: runs/<config>)')
  args, bindings = _split_overrides(p, sys.argv[1:] if argv is None else argv)
  early = _load(prog, args, bindings, num_devices=None)
  _apply_overlap_flags(early)
  _join_job(prog, early)
  import jax
  cfg = _load(prog, args, bindings, num_devices=jax.device_count())
  workdir = args.workdir or os.path.join(
      'runs', os.path.splitext(os.path.basename((args.gin_file or [DEFAULT_GIN])[-1]))[0])
  from mjax import train
  from mjax.config import ConfigError
  from mjax.data import DataError
  try:
    train.run(cfg, workdir)
  except (DataError, ConfigError) as e:   # found once running: data files, checkpoint tiers
    _die(prog, str(e))
  except train.NonFiniteLoss as e:
    # A distinct status, so that a supervisor can tell a numerical fault
    # (roll back, skip the data) from a crash (restart as is).
    print(f'{prog}: error: {e}; last good checkpoint kept', file=sys.stderr)
    sys.exit(EXIT_NONFINITE)
  except KeyboardInterrupt:
    # Ctrl-C during start-up or compilation (the loop itself stops cleanly on
    # the first one), or a second Ctrl-C: nothing more to save. Leave at once:
    # unwinding through XLA's running threads at interpreter exit can crash.
    print(f'{prog}: interrupted; the last committed checkpoint, if any, is kept', file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_INTERRUPTED)


def flops_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-flops: parameter count and training FLOPs per token, as JSON."""
  prog = 'mjax-flops'
  p = _parser(prog, 'Print parameter count and FLOPs per token of a config (nothing is allocated).')
  args, bindings = _split_overrides(p, sys.argv[1:] if argv is None else argv)
  cfg = _load(prog, args, bindings, num_devices=None)
  from mjax.model.flops import report
  print(json.dumps(report(cfg.model, cfg.data.seq_len), indent=2))


def report_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-report: what a config communicates and how much memory it needs.

    mjax-report comm --gin_file F [--gin.X=Y ...] [--overlap_flags]
        compiles the train step on the available devices (no training) and
        prints its collectives per step next to the layout's analytical
        minimum, and XLA's memory analysis. For N fake CPU devices run it with
        XLA_FLAGS=--xla_force_host_platform_device_count=N.
    mjax-report memory --gin_file F --mesh data=16,tensor=8,pipeline=8 [--micro_batch N]
        prints a per-device memory estimate for a hypothetical mesh (no devices).
    mjax-report checkpoint WORKDIR [--verify]
        lists every saved step of both checkpoint tiers of a run; with --verify
        reads each one and checks every array against the checksum saved with
        it (exit 1 when a step is damaged or unreadable).
    mjax-report stragglers WORKDIR [--out DIR] [--phase P] [--margin M] [--window W]
        reads the per-process step timings of a run (WORKDIR/timings), prints a
        per-process summary with a straggler verdict, and writes a heat map
        (stragglers.png) and a Chrome/Perfetto trace (trace.json) to DIR
        (default WORKDIR/stragglers). Defaults of --margin and --window come
        from the run's config.json when it has one.
  """
  import textwrap
  prog = 'mjax-report'
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] not in ('comm', 'memory', 'stragglers', 'checkpoint'):
    asked = argv[:1] in (['-h'], ['--help'])
    usage = textwrap.dedent(report_main.__doc__.split('\n', 1)[1]).rstrip()
    print('usage:' + usage, file=sys.stdout if asked else sys.stderr)
    sys.exit(0 if asked else 2)
  command, rest = argv[0], argv[1:]
  prog = f'{prog} {command}'

  if command == 'stragglers':
    _report_stragglers(prog, rest)
    return
  if command == 'checkpoint':
    _report_checkpoint(prog, rest)
    return

  if command == 'memory':
    p = _parser(prog, 'Per-device memory estimate of a config on a hypothetical mesh (nothing is allocated).')
    p.add_argument('--mesh', required=True, help='axis sizes, e.g. data=16,tensor=8,pipeline=8 (others 1)')
    p.add_argument('--micro_batch', type=int, default=1,
                   help='sequences per micro-batch per data-parallel replica (default 1, as Megatron '
                        'runs GPT-3 175B; 0: the whole replica batch, no accumulation)')
    p.add_argument('--schedule', choices=('1f1b', 'gpipe'), default='1f1b', help='pipeline schedule')
    p.add_argument('--attention', choices=('auto', 'flash', 'materialized'), default='auto',
                   help='auto: flash unless ModelConfig.attention_impl is xla')
    p.add_argument('--sequence_parallel', action='store_true', help='split norms / residuals over tensor too')
    args, bindings = _split_overrides(p, rest)
    cfg = _load(prog, args, bindings, num_devices=None)
    from mjax.parallel.memory import estimate_memory, format_estimate
    try:
      mesh = {k.strip(): int(v) for k, v in (item.split('=') for item in args.mesh.split(',') if item.strip())}
    except ValueError:
      _die(prog, f'--mesh {args.mesh!r}: expected AXIS=SIZE pairs separated by commas, e.g. data=16,tensor=8')
    flash = {'auto': None, 'flash': True, 'materialized': False}[args.attention]
    try:
      est = estimate_memory(cfg, mesh, args.micro_batch or None, flash=flash, schedule=args.schedule,
                            sequence_parallel=args.sequence_parallel)
    except ValueError as e:
      _die(prog, str(e))
    print(format_estimate(est))
    return

  p = _parser(prog, 'Compile the train step and report its collectives and memory (no training).')
  p.add_argument('--overlap_flags', action='store_true',
                 help='set the GPU collective-overlap XLA flags first (mjax.parallel.xla_flags)')
  args, bindings = _split_overrides(p, rest)
  if args.overlap_flags:
    _apply_overlap_flags(_load(prog, args, bindings, num_devices=None))
  _join_job(prog)
  import time
  import jax
  cfg = _load(prog, args, bindings, num_devices=jax.device_count())
  from mjax.parallel import make_mesh
  from mjax.parallel.comm_report import comm_report, format_report
  from mjax.train import make_program
  mesh = make_mesh(cfg.mesh)
  program = make_program(cfg, mesh)
  t0 = time.perf_counter()
  with program.context():
    compiled = program.step.lower(program.abstract_state(), program.abstract_batch()).compile()
  print(f'{prog}: train step compiled in {time.perf_counter() - t0:.1f}s on {jax.device_count()} '
        f'{jax.devices()[0].platform} device(s); batch {cfg.train.global_batch_size} x seq '
        f'{cfg.data.seq_len}, {cfg.model.n_layers} layers, d_model {cfg.model.d_model}, '
        f'{cfg.model.dtype} compute, remat {cfg.model.remat_policy!r}\n')
  print(format_report(comm_report(compiled, cfg, dict(mesh.shape))))



def _report_checkpoint(prog: str, argv: Sequence[str]) -> None:
  p = argparse.ArgumentParser(prog=prog, description='Saved steps of a run, and whether they are intact.')
  p.add_argument('workdir')
  p.add_argument('--verify', action='store_true', help='read every step and check its checksums')
  args = p.parse_args(argv)
  from mjax.config import CheckpointConfig
  from mjax.checkpoint import tier_directories, verify_step
  try:
    with open(os.path.join(args.workdir, 'config.json')) as fh:
      ck = CheckpointConfig(**json.load(fh)['checkpoint'])
  except (OSError, ValueError, KeyError, TypeError) as e:
    _die(prog, f'{args.workdir!r} has no readable config.json ({type(e).__name__}): give the workdir '
               f'of an mjax-train run.')
  rows, bad = [], 0
  for tier, directory in tier_directories(ck, args.workdir).items():
    names = os.listdir(directory) if os.path.isdir(directory) else []
    steps = sorted((int(n) for n in names if n.isdigit()), reverse=True)
    aside = sorted(n for n in names if n.startswith('damaged-'))
    for step in steps:
      path = os.path.join(directory, str(step))
      verdict, detail = verify_step(path) if args.verify else ('-', '')
      bad += verdict in ('damaged', 'unreadable')
      rows.append((tier, str(step), verdict, detail, path))
    rows += [(tier, n.split('-')[1], 'moved aside', 'damaged at restore', os.path.join(directory, n))
             for n in aside]
  if not rows:
    print(f'{prog}: no saved steps under {args.workdir}')
    return
  widths = [max(len(r[i]) for r in rows + [('tier', 'step', 'verdict', 'detail', 'path')]) for i in range(4)]
  for r in [('tier', 'step', 'verdict', 'detail', 'path')] + rows:
    print('  '.join(c.ljust(w) for c, w in zip(r[:4], widths)) + '  ' + r[4])
  if bad:
    print(f'{prog}: {bad} step(s) damaged or unreadable; a restart falls back past them', file=sys.stderr)
    sys.exit(1)


def _report_stragglers(prog: str, argv: Sequence[str]) -> None:
  """`mjax-report stragglers`: summary table, heat map and trace of a run's timings."""
  from mjax.config import FaultConfig
  from mjax.ft import stragglers as st
  p = argparse.ArgumentParser(
      prog=prog, description='Per-process step timings of a run: summary with straggler verdict, '
      'heat map (processes x steps) and a Chrome/Perfetto trace of every process\'s phases.')
  p.add_argument('workdir', help='the run directory (holds timings/process-*.jsonl)')
  p.add_argument('--out', default=None, help='where to write stragglers.png and trace.json '
                 '(default WORKDIR/stragglers)')
  p.add_argument('--phase', default=st.STEP,
                 help="what the heat map colours and the table's p50 / p90 describe: 'step' (sum of "
                      "phases, default) or a phase (data, compute, checkpoint, eval); the verdict "
                      "always weighs every phase and the end times")
  p.add_argument('--margin', type=float, default=None,
                 help='slower than the others by this share: a straggler (default: the run\'s '
                      f'FaultConfig.straggler_margin, else {FaultConfig.straggler_margin})')
  p.add_argument('--window', type=int, default=None,
                 help='judge on this many of the latest steps (default: the run\'s '
                      f'FaultConfig.straggler_window, else {FaultConfig.straggler_window})')
  p.add_argument('--json', action='store_true', help='print the summary as JSON instead of a table')
  args = p.parse_args(argv)
  # The run's own thresholds, so that the report agrees with what its driver saw.
  fault = {}
  try:
    with open(os.path.join(args.workdir, 'config.json')) as fh:
      fault = json.load(fh).get('fault', {}) or {}
  except (OSError, ValueError, AttributeError):
    pass
  margin = args.margin if args.margin is not None else fault.get('straggler_margin', FaultConfig.straggler_margin)
  window = args.window if args.window is not None else fault.get('straggler_window', FaultConfig.straggler_window)
  if margin <= 0 or window < 1:
    _die(prog, f'--margin {margin} must be > 0 and --window {window} >= 1.')
  try:
    rows = st.load_rows(args.workdir)
  except FileNotFoundError as e:
    _die(prog, str(e))
  known = st.phases_of(rows)
  if args.phase != st.STEP and args.phase not in known:
    _die(prog, f'--phase {args.phase!r}: this run\'s timings have the phases {", ".join(known)}; '
               f"give one of them or 'step' (their sum).")
  from mjax.ft import timeline
  table = st.summary_table(rows, margin=margin, window=window, metric=args.phase)
  found = st.find_stragglers(rows, margin=margin, window=window)
  out = args.out or os.path.join(args.workdir, 'stragglers')
  png = timeline.plot_heatmap(rows, os.path.join(out, 'stragglers.png'), metric=args.phase,
                              run=os.path.abspath(args.workdir), stragglers=[s.process for s in found])
  trace = timeline.write_trace(rows, os.path.join(out, 'trace.json'))
  if args.json:
    print(json.dumps({'margin': margin, 'window': window, 'metric': args.phase, 'processes': table,
                      'stragglers': [s.to_json() for s in found], 'heatmap': png, 'trace': trace}, indent=2))
    return
  n_steps = len({r['step'] for r in rows})
  print(f'{prog}: {len(table)} process(es), {n_steps} step(s) in {st.timings_dir(args.workdir)}; '
        f'straggler: > {margin:.0%} slower than the others over the last {window} steps\n')
  print(st.format_table(table, metric=args.phase))
  print()
  if len(table) < 2:
    print('one process: nothing to compare it with, no straggler verdict.')
  elif n_steps < window:
    print(f'fewer than {window} steps: no straggler verdict yet.')
  elif not found:
    print('no straggler.')
  for s in found:
    print('straggler: ' + s.describe())
  print(f'heat map: {png}\ntrace:    {trace} (open in ui.perfetto.dev or chrome://tracing)')

def prepare_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-prepare: tokenizes text once into memory-mapped shards, or verifies shards.

    mjax-prepare --input DIR_OR_FILE --output DIR [--tokenizer bytes|tokenizer.json]
                 [--shard_tokens N] [--heldout_fraction F] [--file_pattern GLOB]
    mjax-prepare --verify DIR
  """
  prog = 'mjax-prepare'
  from mjax.config import DataConfig
  from mjax.data.shards import DEFAULT_SHARD_TOKENS
  defaults = DataConfig()
  p = argparse.ArgumentParser(
      prog=prog, description='Tokenize a text source once into .bin shards + manifest.json '
      '(train with --gin.DataConfig.source=DIR), or check an existing shard directory.')
  p.add_argument('--input', help="'stdlib', a text file or a directory of text files")
  p.add_argument('--output', help='new or empty directory for the shards and manifest.json')
  p.add_argument('--tokenizer', default='bytes', help="'bytes' (default) or the path of a tokenizer.json")
  p.add_argument('--shard_tokens', type=int, default=DEFAULT_SHARD_TOKENS,
                 help=f'tokens per shard, documents kept whole (default {DEFAULT_SHARD_TOKENS})')
  p.add_argument('--heldout_fraction', type=float, default=defaults.heldout_fraction,
                 help=f'share of files held out for evaluation (default {defaults.heldout_fraction})')
  p.add_argument('--file_pattern', default=defaults.file_pattern,
                 help=f'which files of a directory to read (default {defaults.file_pattern!r})')
  p.add_argument('--verify', metavar='DIR',
                 help='check sizes, sha256 checksums, token ids and document counts of DIR')
  args = p.parse_args(sys.argv[1:] if argv is None else argv)
  from mjax.data import DataError, prepare_shards, verify_shards
  if args.verify:
    if args.input or args.output:
      p.error('--verify DIR takes no --input / --output')
    try:
      summary = verify_shards(args.verify)
    except DataError as e:
      _die(prog, str(e))
    print(json.dumps({'ok': True, **summary}, indent=2))
    return
  if not args.input or not args.output:
    p.error('needs --input and --output (or --verify DIR)')
  try:
    manifest = prepare_shards(args.input, args.output, args.tokenizer,
                              shard_tokens=args.shard_tokens,
                              heldout_fraction=args.heldout_fraction,
                              file_pattern=args.file_pattern,
                              log=lambda line: print(f'{prog}: {line}', file=sys.stderr))
  except DataError as e:
    _die(prog, str(e))
  print(f'{prog}: wrote {len(manifest["shards"])} shard(s) and manifest.json to '
        f'{os.path.abspath(args.output)} ({manifest["dtype"]}, tokenizer '
        f'{manifest["tokenizer"]["name"]}, {manifest["tokenizer"]["vocab_size"]} ids)')


def tokenizer_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-tokenizer: trains a byte-level BPE tokenizer.json on local text.

    mjax-tokenizer --input DIR_OR_FILE --vocab_size N --output tokenizer.json [--file_pattern GLOB]
  """
  prog = 'mjax-tokenizer'
  from mjax.config import DataConfig
  p = argparse.ArgumentParser(
      prog=prog, description='Train a byte-level BPE (EOS <|endoftext|>) with Hugging Face '
      'tokenizers; use it with --gin.DataConfig.tokenizer=FILE or mjax-prepare --tokenizer FILE.')
  p.add_argument('--input', required=True, help="'stdlib', a text file or a directory of text files")
  p.add_argument('--vocab_size', type=int, required=True, help='ids in the result (>= 257)')
  p.add_argument('--output', required=True, help='path of the tokenizer.json to write')
  p.add_argument('--file_pattern', default=DataConfig().file_pattern,
                 help=f'which files of a directory to read (default {DataConfig().file_pattern!r})')
  args = p.parse_args(sys.argv[1:] if argv is None else argv)
  from mjax.data import DataError, train_bpe
  from mjax.data.corpus import find_source_files, read_documents

  try:
    root, files = find_source_files(args.input, args.file_pattern)

    def texts():
      # One file at a time: the trainer counts words as it goes, so the
      # corpus never has to fit in memory.
      for f in files:
        yield read_documents(root, [f])[0].decode('utf-8', errors='replace')

    info = train_bpe(texts(), args.vocab_size, args.output)
  except DataError as e:
    _die(prog, str(e))
  print(json.dumps({'files': len(files), **info.to_json()}, indent=2))



def diagnose_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-diagnose: short health checks of this host's devices.

    mjax-diagnose [--json] [--min_fraction F] [--memory_fraction F] [--checks matmul,memory,...]

  Exit status 0 when every check passes, 1 when any fails (the host should
  not take part in a job), 2 for a usage error. Under a multi-process
  launch (see mjax/distributed.py) every process of the job must run it:
  the cross-process collectives are checked too.
  """
  prog = 'mjax-diagnose'
  from mjax.ft import diagnose
  p = argparse.ArgumentParser(
      prog=prog, description='Health checks of this host: matmul throughput per device, device memory, '
      'all-reduce / all-gather bus bandwidth (and across processes in a multi-process job). '
      'Exit 0: all pass; 1: a check failed.')
  p.add_argument('--json', action='store_true', help='print {"host", "process", "passed", "checks": [...]} as JSON')
  p.add_argument('--min_fraction', type=float, default=0.5,
                 help='least acceptable share of the expected matmul throughput and link bandwidth (default 0.5)')
  p.add_argument('--memory_fraction', type=float, default=0.5,
                 help='share of each accelerator\'s memory to allocate and verify (default 0.5)')
  p.add_argument('--cpu_memory_mib', type=int, default=128, help='MiB to allocate per CPU device (default 128)')
  p.add_argument('--collective_mib', type=int, default=None,
                 help='collective message size in MiB (default 256 on accelerators, 8 on CPU)')
  p.add_argument('--checks', default=','.join(diagnose.CHECKS),
                 help=f'comma-separated subset of {",".join(diagnose.CHECKS)} (default: all)')
  args = p.parse_args(sys.argv[1:] if argv is None else argv)
  checks = [c.strip() for c in args.checks.split(',') if c.strip()]
  if not 0 < args.min_fraction <= 1 or not 0 < args.memory_fraction < 1:
    _die(prog, f'--min_fraction {args.min_fraction} must be in (0, 1] and --memory_fraction '
               f'{args.memory_fraction} in (0, 1).')
  try:
    diagnose.injected_failures()  # a typo in the test-only variable is a usage error, found before any work
  except ValueError as e:
    _die(prog, str(e))
  # With --json, stdout must hold the JSON document alone, but native
  # libraries (gloo's connection messages) print to it: send their output to
  # stderr until the report is ready.
  saved = None
  if args.json:
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
  try:
    _join_job(prog)
    report = diagnose.run_diagnostics(
        checks, min_fraction=args.min_fraction, memory_fraction=args.memory_fraction,
        cpu_memory_bytes=args.cpu_memory_mib * diagnose.MIB,
        collective_bytes=args.collective_mib * diagnose.MIB if args.collective_mib else None)
  except ValueError as e:
    _die(prog, str(e))
  finally:
    if saved is not None:
      sys.stdout.flush()
      os.dup2(saved, 1)
      os.close(saved)
  if args.json:
    print(json.dumps(report.to_json(), indent=2))
  else:
    print(f'{prog}: ' + diagnose.format_report(report))
  sys.exit(0 if report.passed else 1)


def launch_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-launch: runs mjax-train under the fault-tolerance driver.

    mjax-launch --processes N [--devices M] [--hosts h1,h2 --spares h3] --workdir DIR \
        -- <mjax-train args>

  Heartbeats, hang / NaN / straggler detection, diagnostics, blocked hosts
  and automatic restarts: see mjax/ft/driver.py. Exit status 0: finished,
  1: gave up (events.jsonl says why), 2: bad input.
  """
  from mjax.ft import driver
  sys.exit(driver.main(sys.argv[1:] if argv is None else argv))


if __name__ == '__main__':
  train_main()
