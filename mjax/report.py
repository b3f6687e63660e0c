"""mjax-report: what a config communicates, how much memory it needs, and
what a run left behind (its checkpoints, its step timings).

  mjax-report comm --gin_file configs/1p3b.gin
  mjax-report memory --gin_file configs/gpt3_175b.gin --mesh data=16,tensor=8,pipeline=8
  mjax-report checkpoint runs/tiny --verify
  mjax-report stragglers runs/ft

Each subcommand is one function registered with `@command`, which takes its
prog (for messages) and its arguments and returns the exit status; `main`
picks the function. Bad input is a `UserError`, which `main` prints as
`mjax-report COMMAND: error: ...` with exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
import textwrap
import time
from typing import Callable, Optional, Sequence

from mjax import flags, jsonfile, protocol
from mjax.errors import UserError

PROG = 'mjax-report'


@dataclasses.dataclass(frozen=True)
class Command:
  name: str
  help: str                             # for the usage listing, wrapped there
  synopsis: str                         # the arguments, as the usage listing shows them
  run: Callable[[str, list[str]], int]  # (prog, argv) -> exit status


COMMANDS: dict[str, Command] = {}  # in registration order, which is the usage's order


def command(name: str, help: str, synopsis: str = ''):
  """Registers `fn(prog, argv) -> exit status` as the subcommand `name`."""
  def register(fn: Callable[[str, list[str]], int]):
    if name in COMMANDS:
      raise ValueError(f'{PROG} {name} is registered twice')
    COMMANDS[name] = Command(name, help, synopsis, fn)
    return fn
  return register


def usage() -> str:
  """Every registered command: its synopsis, then what it does."""
  lines = ['usage:']
  for c in COMMANDS.values():
    lines.append(f'{PROG} {c.name} {c.synopsis}'.rstrip())
    lines += textwrap.wrap(c.help, width=79, initial_indent=' ' * 4, subsequent_indent=' ' * 4)
  return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the subcommand argv[0] (default sys.argv[1:]) and returns the exit status."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] not in COMMANDS:
    asked = argv[:1] in (['-h'], ['--help'])
    if argv and not asked:
      import difflib
      near = difflib.get_close_matches(argv[0], COMMANDS, n=1)
      print(f'{PROG}: error: no subcommand {argv[0]!r}' + (f' (did you mean {near[0]!r}?)' if near else '')
            + f'; one of {", ".join(COMMANDS)}.', file=sys.stderr)
    print(usage(), file=sys.stdout if asked else sys.stderr)
    return 0 if asked else protocol.EXIT_USER_ERROR
  name, rest = argv[0], argv[1:]
  prog = f'{PROG} {name}'
  try:
    return COMMANDS[name].run(prog, rest)
  except UserError as e:
    # Here rather than in the entry point, so that the message names the subcommand.
    print(f'{prog}: error: {e}', file=sys.stderr)
    return protocol.EXIT_USER_ERROR
  except SystemExit as e:
    # argparse's own exits (a usage error, --help): `main` answers with a status, as for the rest.
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def format_table(rows: Sequence[Sequence[str]]) -> list[str]:
  """Left-aligned columns two spaces apart; the last one (a path) is not padded."""
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
  return ['  '.join(c.ljust(w) for c, w in zip(r, widths)) + '  ' + r[-1] for r in rows]


@command('comm', 'compiles the train step on the available devices (no training) and prints its '
         'collectives per step next to the layout\'s analytical minimum, XLA\'s memory analysis and '
         'the schedule (which collectives overlap compute). For N fake CPU devices run it with '
         'XLA_FLAGS=--xla_force_host_platform_device_count=N. With --target h100:8 it compiles for '
         'GPUs this machine does not have (needs the CUDA plugin, not a GPU), which shows the GPU '
         'schedule.',
         synopsis='--gin_file F [--gin.X=Y ...] [--overlap_flags] [--target CARD:N [--no_overlap]]')
def comm(prog: str, argv: list[str]) -> int:
  p = flags.parser(prog, 'Compile the train step and report its collectives and memory (no training).')
  p.add_argument('--overlap_flags', action='store_true',
                 help='set the GPU collective-overlap XLA flags first (mjax.parallel.xla_flags)')
  p.add_argument('--target', default=None, metavar='CARD:N',
                 help='compile for N GPUs of CARD (h100, h200) without them: a deviceless GPU compile '
                      '(mjax.parallel.gpu_target); the XLA options are those a GPU run of the config '
                      'sets (TrainConfig.xla_overlap_flags, xla_extra_flags)')
  p.add_argument('--no_overlap', action='store_true',
                 help='with --target: compile without the overlap options, to compare')
  args, bindings = flags.parse(p, argv)
  if args.target:
    return _comm_for_target(prog, args, bindings)
  # The overlap flags change what XLA compiles, hence what this reports: only
  # when asked. The config's other flags (xla_extra_flags, the GeLU
  # epilogue's) are part of what a run compiles: always. All are set, and the
  # job joined, before JAX starts.
  cfg = flags.setup(flags.gin_files(args), bindings, join=True, overlap=args.overlap_flags)
  import time
  import jax
  from mjax.parallel import make_mesh
  from mjax.parallel.comm_report import comm_report, format_report, format_schedule, schedule
  from mjax.train import make_program
  mesh = make_mesh(cfg.mesh)
  program = make_program(cfg, mesh)
  t0 = time.perf_counter()
  with program.context():
    compiled = program.step.lower(program.abstract_state(), program.abstract_batch()).compile()
  print(f'{prog}: train step compiled in {time.perf_counter() - t0:.1f}s on {jax.device_count()} '
        f'{jax.devices()[0].platform} device(s); {_shape_line(cfg)}\n')
  print(format_report(comm_report(compiled, cfg, dict(mesh.shape))))
  print()
  print(format_schedule(schedule(compiled.as_text(), dict(mesh.shape)), jax.devices()[0].platform))
  return 0


def _shape_line(cfg) -> str:
  return (f'batch {cfg.train.global_batch_size} x seq {cfg.data.seq_len}, {cfg.model.n_layers} layers, '
          f'd_model {cfg.model.d_model}, {cfg.model.dtype} compute, remat {cfg.model.remat_policy!r}')


def _comm_for_target(prog: str, args: argparse.Namespace, bindings: list[str]) -> int:
  """`comm --target CARD:N`: the same report for a deviceless GPU compile."""
  from mjax.parallel import gpu_target
  target = gpu_target.parse_target(args.target)
  if args.overlap_flags:
    raise UserError('--overlap_flags applies to the local devices; with --target the options are '
                    'those a GPU run of the config sets (--no_overlap leaves them out).')
  gpu_target.keep_local_backend_cpu()
  cfg = flags.load(flags.gin_files(args), bindings, num_devices=target.devices)
  from mjax.parallel.comm_report import comm_report, format_report, format_schedule, schedule
  out = gpu_target.compile_step(cfg, target, options={} if args.no_overlap else None)
  shown = ' '.join(f'{k}={v}' for k, v in out.options.items()) or 'none (XLA defaults)'
  print(f'{prog}: train step compiled for {target} in {out.seconds:.1f}s (deviceless: no GPU used); '
        f'{_shape_line(out.cfg)}')
  print(f'XLA options: {shown}')
  for note in out.notes:
    print(f'note: {note}')
  print()
  print(format_report(comm_report(out.compiled, out.cfg, dict(out.mesh.shape))))
  print()
  print(format_schedule(schedule(out.compiled.as_text(), dict(out.mesh.shape)), 'cuda'))
  return 0


@command('config', 'prints the fully resolved, validated config (every field, defaults included) as gin, '
         'or as JSON: what mjax-train would run, without starting it.',
         synopsis='--gin_file F [--gin.X=Y ...] [--json]')
def config(prog: str, argv: list[str]) -> int:
  p = flags.parser(prog, 'Print the resolved config of gin files and overrides (nothing runs).')
  p.add_argument('--json', action='store_true', help='JSON instead of gin')
  args, bindings = flags.parse(p, argv)
  # The same loading and checks as mjax-train, short of the device count;
  # a mesh whose every axis is given names its own, and the checks that
  # need one (the batch over data x fsdp, heads over tensor, the pipeline's
  # layer split) run on it too.
  cfg = flags.load(flags.gin_files(args), bindings, num_devices=None)
  import math
  from mjax import config as config_lib
  if all(a > 0 for a in cfg.mesh.ici_shape()):
    cfg = config_lib.validate(cfg, num_devices=math.prod(cfg.mesh.ici_shape()) * math.prod(cfg.mesh.dcn_shape()))
  print(json.dumps(config_lib.to_dict(cfg), indent=2) if args.json else config_lib.to_gin(cfg), end='\n')
  return 0


@command('memory', 'prints a per-device memory estimate for a hypothetical mesh (no devices).',
         synopsis='--gin_file F --mesh data=16,tensor=8,pipeline=8 [--micro_batch N]')
def memory(prog: str, argv: list[str]) -> int:
  p = flags.parser(prog, 'Per-device memory estimate of a config on a hypothetical mesh (nothing is allocated).')
  p.add_argument('--mesh', required=True, help='axis sizes, e.g. data=16,tensor=8,pipeline=8 (others 1)')
  p.add_argument('--micro_batch', type=int, default=1,
                 help='sequences per micro-batch per data-parallel replica (default 1, as Megatron '
                      'runs GPT-3 175B; 0: the whole replica batch, no accumulation)')
  p.add_argument('--schedule', choices=('circular', '1f1b'), default=None,
                 help="pipeline schedule (default: the config's MeshConfig.pipeline_schedule)")
  p.add_argument('--virtual_stages', type=int, default=None,
                 help="layer chunks per pipeline stage (default: the config's MeshConfig.virtual_stages)")
  p.add_argument('--attention', choices=('auto', 'flash', 'materialized'), default='auto',
                 help='auto: flash unless ModelConfig.attention_impl is xla')
  p.add_argument('--sequence_parallel', action='store_true',
                 help="split norms / residuals over tensor too (default: the config's MeshConfig.sequence_parallel)")
  args, bindings = flags.parse(p, argv)
  # No devices: the mesh is hypothetical, so the config is not checked against this host's.
  cfg = flags.load(flags.gin_files(args), bindings, num_devices=None)
  from mjax.parallel.memory import estimate_memory, format_estimate
  try:
    pairs = [(k.strip(), int(v)) for k, v in (item.split('=') for item in args.mesh.split(',') if item.strip())]
  except ValueError:
    raise UserError(f'--mesh {args.mesh!r}: expected AXIS=SIZE pairs separated by commas, '
                    'e.g. data=16,tensor=8') from None
  mesh = dict(pairs)
  if not pairs:
    raise UserError(f'--mesh {args.mesh!r}: no axis given (an unset variable?); give AXIS=SIZE pairs '
                    'separated by commas, e.g. data=16,tensor=8 (data=1 for one device).')
  if len(mesh) < len(pairs) or any(v < 1 for v in mesh.values()):
    raise UserError(f'--mesh {args.mesh!r}: each axis once, each size a positive integer, e.g. data=16,tensor=8.')
  if args.virtual_stages is not None and args.virtual_stages < 1:
    raise UserError(f'--virtual_stages {args.virtual_stages}: must be a positive integer (layer chunks per '
                    f'pipeline stage; leave it out for the config\'s MeshConfig.virtual_stages).')
  if args.micro_batch < 0:
    raise UserError(f'--micro_batch {args.micro_batch}: must be >= 0 (0: the whole replica batch).')
  # The splits the estimate assumes (heads and the MLP over tensor, layer
  # groups over pipeline x virtual stages), named as training names them.
  from mjax.config import MeshConfig
  unknown = sorted(set(mesh) - set(MeshConfig.AXES))
  if unknown:
    raise UserError(f'--mesh {args.mesh!r}: unknown axes {unknown}; allowed: {", ".join(MeshConfig.AXES)}.')
  m, tp, pp = cfg.model, mesh.get('tensor', 1), mesh.get('pipeline', 1)
  # As the other pipeline settings (schedule, virtual stages, fsdp_gather),
  # the config's: a run's own gin file with sequence_parallel was estimated
  # without it, its replicated activations counted whole on every rank.
  sequence_parallel = args.sequence_parallel or cfg.mesh.sequence_parallel
  for key, v in (('n_heads', m.n_heads), ('n_kv_heads', m.kv_heads), ('d_ff', m.d_ff), ('vocab_size', m.vocab_size)):
    if v % tp:
      raise UserError(f'--mesh {args.mesh!r} does not fit this config: ModelConfig.{key} = {v} must be '
                      f'divisible by the tensor-parallel size {tp}.')
  if m.d_model % mesh.get('fsdp', 1):
    raise UserError(f'--mesh {args.mesh!r} does not fit this config: ModelConfig.d_model = {m.d_model} must be '
                    f'divisible by the FSDP size {mesh["fsdp"]}, which splits every weight along d_model.')
  if sequence_parallel and cfg.data.seq_len % tp:
    raise UserError(f'--mesh {args.mesh!r} does not fit this config: DataConfig.seq_len = {cfg.data.seq_len} '
                    f'must be divisible by the tensor-parallel size {tp} with sequence parallelism.')
  chunks, groups = pp * (args.virtual_stages or cfg.mesh.virtual_stages), m.n_layers // m.layer_period
  if pp > 1 and groups % chunks:
    raise UserError(f'--mesh {args.mesh!r} does not fit this config: its {groups} layer groups (of '
                    f'{m.layer_period} layers) must split evenly into pipeline x virtual_stages = {chunks} chunks.')
  flash = {'auto': None, 'flash': True, 'materialized': False}[args.attention]
  try:
    est = estimate_memory(cfg, mesh, args.micro_batch or None, flash=flash, schedule=args.schedule,
                          virtual_stages=args.virtual_stages, sequence_parallel=sequence_parallel)
  except ValueError as e:   # a mesh or micro-batch that does not fit the config
    raise UserError(str(e)) from None
  print(format_estimate(est))
  return 0


@command('checkpoint', 'lists every saved step of both checkpoint tiers of a run; with --verify reads '
         'each one and checks every array against the checksum saved with it (exit 1 when a step is '
         'damaged or unreadable).',
         synopsis='WORKDIR [--verify]')
def checkpoint(prog: str, argv: list[str]) -> int:
  p = argparse.ArgumentParser(prog=prog, description='Saved steps of a run, and whether they are intact.')
  p.add_argument('workdir')
  p.add_argument('--verify', action='store_true', help='read every step and check its checksums')
  args = p.parse_args(argv)
  from mjax.config import CheckpointConfig
  from mjax.checkpoint.directories import foreign, steps_in, tier_directories
  from mjax.checkpoint.integrity import verify_step
  try:
    with open(os.path.join(args.workdir, 'config.json')) as fh:
      ck = CheckpointConfig(**jsonfile.load(fh)['checkpoint'])
  except (OSError, ValueError, KeyError, TypeError) as e:
    # A run's config.json lost or damaged: each step saved in its default
    # tier carries the run's config too, which names the tiers as well.
    ck, step = _saved_checkpoint_config(args.workdir)
    if ck is None:
      from mjax.checkpoint.directories import is_workdir
      # Its checkpoints/ folder or one of its steps given instead: the run named.
      parent = os.path.dirname(os.path.abspath(args.workdir))
      run = next((d for d in (parent, os.path.dirname(parent)) if is_workdir(d)), None)
      hint = f' ({run!r} is one: a run\'s checkpoints are read through its workdir)' if run else ''
      raise UserError(f'{args.workdir!r} has no readable config.json ({type(e).__name__}): give the workdir '
                      f'of an mjax-train run{hint}.') from None
    print(f'{prog}: warning: {os.path.join(args.workdir, "config.json")} is unreadable ({type(e).__name__}); '
          f'the checkpoint tiers are those of the config saved with step {step}', file=sys.stderr)
  rows, bad = [], 0
  for tier, directory in tier_directories(ck, args.workdir).items():
    other = foreign(directory, args.workdir)
    if other is not None:
      rows.append((tier, '-', "another run's", f'saved by the run in {other}: not this run\'s', directory))
      continue
    names = os.listdir(directory) if os.path.isdir(directory) else []
    # Steps renamed out of the tier (`<why>-<step>-<time>`, Checkpointer._move_aside), kept for inspection.
    aside = sorted((why, n) for n in names for why in ASIDE if n.startswith(why + '-'))
    for step in steps_in(directory):
      path = os.path.join(directory, str(step))
      verdict, detail = verify_step(path) if args.verify else ('-', '')
      # Listed, then deleted before or while it was read: the run's own
      # retention (`keep`) beside this check, not a damaged step. (A
      # deletion under way takes a moment to remove the step's folder.)
      if verdict == 'unreadable' and os.path.lexists(path):
        time.sleep(1.0)
      if verdict in ('damaged', 'unreadable') and not os.path.lexists(path):
        verdict, detail = 'rotated out', 'deleted by the run while this read it (its `keep` retention)'
      bad += verdict in ('damaged', 'unreadable')
      rows.append((tier, str(step), verdict, detail, path))
    rows += [(tier, n[len(why) + 1:].split('-')[0], 'moved aside', ASIDE[why], os.path.join(directory, n))
             for why, n in aside]
  if not rows:
    print(f'{prog}: no saved steps under {args.workdir}')
    return 0
  for line in format_table([('tier', 'step', 'verdict', 'detail', 'path')] + rows):
    print(line)
  if bad:
    good = [int(step) for _, step, verdict, _, _ in rows if verdict in ('ok', 'unchecked')]
    print(f'{prog}: {bad} step(s) damaged or unreadable; ' +
          (f'a restart resumes from step {max(good)}, the newest that can be read' if good else
           'no step can be read, so a restart stops with an error rather than start over (move these '
           'steps aside to start the run over)'), file=sys.stderr)
    return 1
  return 0


# Why a step was moved aside, by the prefix of its new name.
ASIDE = {'damaged': 'damaged at restore',
         'rolled-back': 'saved during a loss spike, rolled back'}


def _saved_checkpoint_config(workdir: str):
  """(CheckpointConfig, step) from the config saved with the newest step
  of the workdir's default persistent tier that has a readable one, or
  (None, None)."""
  from mjax.checkpoint.directories import steps_in
  from mjax.checkpoint.failures import BadRecord
  from mjax.checkpoint.integrity import step_json
  from mjax.config import CheckpointConfig
  directory = os.path.join(workdir, 'checkpoints')
  for step in steps_in(directory):
    try:
      return CheckpointConfig(**step_json(os.path.join(directory, str(step)), 'meta/metadata')['config']
                              ['checkpoint']), step
    except (BadRecord, KeyError, TypeError, ValueError):
      continue
  return None, None


@command('stragglers', 'reads the per-process step timings of a run (WORKDIR/timings), prints a '
         'per-process summary with a straggler verdict, and writes a heat map (stragglers.png) and a '
         'Chrome/Perfetto trace (trace.json) to DIR (default WORKDIR/stragglers). Defaults of --margin '
         'and --window come from the run\'s config.json when it has one.',
         synopsis='WORKDIR [--out DIR] [--phase P] [--margin M] [--window W]')
def stragglers(prog: str, argv: list[str]) -> int:
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
  p.add_argument('--steps', type=int, default=None,
                 help='read the latest this many steps of every process (default: as many as keep the '
                      f'rows read to about {REPORT_ROWS:,}, at least 2 x --window, at most {REPORT_MAX_STEPS:,})')
  p.add_argument('--json', action='store_true', help='print the summary as JSON instead of a table')
  args = p.parse_args(argv)
  # The run's own thresholds, so that the report agrees with what its driver saw.
  fault = {}
  try:
    with open(os.path.join(args.workdir, 'config.json')) as fh:
      fault = jsonfile.load(fh).get('fault', {})
  except (OSError, ValueError, AttributeError):
    pass
  fault = fault if isinstance(fault, dict) else {}   # a hand-edited config.json: its values are ignored

  def saved(key, kind, default):
    v = fault.get(key, default)
    return v if isinstance(v, kind) and not isinstance(v, bool) else default
  margin = args.margin if args.margin is not None else saved('straggler_margin', (int, float),
                                                              FaultConfig.straggler_margin)
  window = args.window if args.window is not None else saved('straggler_window', int, FaultConfig.straggler_window)
  if not 0 < margin < float('inf') or window < 1:   # NaN fails the first test too
    raise UserError(f'--margin {margin} must be a number > 0 and --window {window} >= 1.')
  if args.steps is not None and args.steps < 1:
    raise UserError(f'--steps {args.steps}: must be a positive integer.')
  # Bounded whatever the run's length and size: the latest steps only (at
  # 10,000 processes x 100 steps, whole files were 2.7 GB of rows in memory).
  paths = glob.glob(os.path.join(st.timings_dir(args.workdir), 'process-*.jsonl'))
  steps = args.steps or max(2 * window, min(REPORT_MAX_STEPS, REPORT_ROWS // max(1, len(paths))))
  try:
    rows = st.load_rows(args.workdir, last=steps)
  except (FileNotFoundError, NotADirectoryError) as e:
    raise UserError(str(e)) from None
  # A process whose file holds no row the analysis can read is left out of
  # it: said, or "one process, no verdict" hid that there were two.
  unread = sorted(set(os.path.basename(p) for p in paths if os.path.isfile(p)) -
                  {f'process-{int(r["process"]):05d}.jsonl' for r in rows})
  if unread and rows:
    print(f'{prog}: warning: {", ".join(unread[:8])}{" and more" if len(unread) > 8 else ""} in '
          f'{st.timings_dir(args.workdir)} hold(s) no readable timing row (empty, damaged, or not a timing '
          f'file): {len(unread)} process(es) left out of the analysis', file=sys.stderr)
  if rows:
    newest = max(int(r['step']) for r in rows)
    rows = [r for r in rows if int(r['step']) > newest - steps]
  if not rows:
    raise UserError(f'{st.timings_dir(args.workdir)}: its timing files hold no complete row (empty, or '
                    'damaged): a run writes a row per process every FaultConfig.timing_every steps.')
  known = st.phases_of(rows)
  if args.phase != st.STEP and args.phase not in known:
    raise UserError(f'--phase {args.phase!r}: this run\'s timings have the phases {", ".join(known)}; '
                    f"give one of them or 'step' (their sum).")
  from mjax.ft import timeline
  found = st.find_stragglers(rows, margin=margin, window=window)
  table = st.summary_table(rows, margin=margin, window=window, metric=args.phase, found=found)
  out = args.out or os.path.join(args.workdir, 'stragglers')
  shown = _report_processes(table, found)
  from mjax.checkpoint.directories import among_checkpoints
  problem = among_checkpoints(out)
  if problem:
    raise UserError(f'--out {problem}; give a directory outside it.')
  try:
    png = timeline.plot_heatmap(rows, os.path.join(out, 'stragglers.png'), metric=args.phase,
                                run=os.path.abspath(args.workdir), stragglers=[s.process for s in found])
    traced = shown if len(table) > REPORT_TRACED else {e['process'] for e in table}
    trace = timeline.write_trace([r for r in rows if int(r['process']) in traced], os.path.join(out, 'trace.json'))
  except OSError as e:
    raise UserError(f'cannot write the heat map and trace into {out!r} ({e.strerror or e}): give --out a '
                    'directory this user can write (a read-only run directory needs one).') from None
  if args.json:
    print(json.dumps({'margin': margin, 'window': window, 'metric': args.phase, 'processes': table,
                      'stragglers': [s.to_json() for s in found], 'heatmap': png, 'trace': trace}, indent=2))
    return 0
  n_steps = len({r['step'] for r in rows})
  print(f'{prog}: {len(table)} process(es), {n_steps} step(s) in {st.timings_dir(args.workdir)}; '
        f'straggler: > {margin:.0%} slower than the others over the last {window} steps\n')
  if len(table) > REPORT_LISTED:
    print(st.format_table([e for e in table if e['process'] in shown], metric=args.phase))
    print(f'(the {len(shown)} latest to end their steps, stragglers and their hosts\' processes first, of '
          f'{len(table):,}; --json lists every process)')
  else:
    print(st.format_table(table, metric=args.phase))
  print()
  if found:
    pass
  elif table[0]['verdict'] != 'n/a':   # judged (on host timings or sampled device times), clean
    print('no straggler.')
  elif len(table) < 2:
    print('one process: nothing to compare it with, no straggler verdict.')
  elif n_steps < window:
    print(f'fewer than {window} steps: no straggler verdict yet.')
  else:
    print('no straggler.')
  for s in found:
    print('straggler: ' + s.describe())
    if s.device is not None:
      print('  ' + st.format_devices(next(e for e in table if e['process'] == s.process)))
  print(f'heat map: {png}\ntrace:    {trace} (open in ui.perfetto.dev or chrome://tracing'
        + (f'; the {len(traced)} processes of the table' if len(traced) < len(table) else '') + ')')
  return 0


# What `mjax-report stragglers` reads and writes stays readable, and fits in
# memory, at 10,000 processes: about this many rows read (~1 KB each in
# memory), the table and the trace limited to the processes worth a look.
REPORT_ROWS = 1_000_000
REPORT_MAX_STEPS = 5_000
REPORT_LISTED = 40         # more processes than this: the table shows the latest
REPORT_TRACED = 64         # more than this: the trace holds the table's processes


def _report_processes(table: list[dict], found) -> set:
  """The processes worth a look: the stragglers, the other processes of
  their hosts, then the latest to end their steps, up to REPORT_LISTED."""
  named = {s.process for s in found}
  hosts = {e['host'] for e in table if e['process'] in named} - {'?'}   # '?': rows that name no host
  first = [e['process'] for e in table if e['process'] in named or e['host'] in hosts]
  late = sorted((e for e in table if e['process'] not in first),
                key=lambda e: -e['lateness_s'] if e['lateness_s'] == e['lateness_s'] else float('inf'))
  return set(first) | {e['process'] for e in late[:max(0, REPORT_LISTED - len(first))]}


if __name__ == '__main__':
  sys.exit(main())
