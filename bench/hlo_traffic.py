"""Memory traffic of the compiled train step, by part of the model, from its HLO (nothing runs).

  python bench/hlo_traffic.py --gin_file configs/tiny.gin                 # this machine's backend
  PYTHONPATH=.venv/cuda-aot python bench/hlo_traffic.py --gin_file configs/1p3b.gin --target h100:1 \
      --gin.MeshConfig.data=1 --gin.ModelConfig.scan_layers=False --gin.ModelConfig.remat_policy=dots
  python bench/hlo_traffic.py --hlo OUT/profile_3/train_step.hlo.txt      # a program saved with a trace

Every top-level op of the optimized program (a fusion, a library call, a
copy: what the GPU runs as one kernel) is taken to read each operand and
write its result once, times how often its computation runs per step (loop
bodies by their trip count, `mjax.parallel.hlo_text.execution_counts`). A
dynamic-update-slice writes only its update, in place; a dynamic-slice reads
only its slice, and so does a fusion of an operand it only slices (a
scanned layer's slice of a stacked buffer). Matrix products and attention kernels are listed apart from
the rest: the elementwise and reduction passes are bound by memory
bandwidth, so their bytes over the bandwidth estimate their time. On an H100
the 1p3b step's ~340 GB of such passes (this count) took 110 ms in a real
trace (bench/RESULTS.md, 2026-11-23): ~3.1 TB/s, the figure `--bandwidth`
defaults to for a GPU target.

What it cannot see: what a kernel keeps in cache between its own passes, and
cuDNN attention in a deviceless compile (attention compiles as XLA's there,
so its rows are not the real kernels'). Use it to compare two versions of
the program, not as a time.
"""

from __future__ import annotations

import collections
import os
import re
import sys
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mjax.parallel import hlo_text  # noqa: E402
from trace_summary import kind_of as kernel_kind, part_of  # noqa: E402

NOT_KERNELS = {'parameter', 'constant', 'tuple', 'get-tuple-element', 'bitcast', 'while', 'call',
               'conditional', 'after-all', 'partition-id', 'replica-id', 'opt-barrier', 'add-dependency'}


def control_computations(module: hlo_text.Module) -> set[str]:
  """ENTRY and the loop bodies, called computations and branches it runs:
  the computations whose ops are kernels (a fusion's own computation is not)."""
  out, todo = set(), [module.entry]
  while todo:
    comp = todo.pop()
    if comp in out or comp not in module.computations:
      continue
    out.add(comp)
    for inst in module.computations[comp]:
      if inst.opcode in ('while', 'call', 'conditional'):
        todo += [c for role, c in hlo_text.called(inst) if role != 'condition']
  return out


def fused_root(module: hlo_text.Module, inst: hlo_text.Instruction) -> str:
  """The opcode a fusion computes last (its root), else the op's own."""
  if inst.opcode != 'fusion':
    return inst.opcode
  callee = dict(hlo_text.called(inst)).get('calls')
  body = module.computations.get(callee or '', [])
  return body[-1].opcode if body else 'fusion'


def _sliced_reads(module: hlo_text.Module, inst: hlo_text.Instruction) -> dict[int, float]:
  """{operand index: bytes read} for a fusion's operands that its computation
  only slices (through bitcasts): a layer's slice of a scan's stacked buffer
  reads that slice, not the whole stack."""
  callee = dict(hlo_text.called(inst)).get('calls') if inst.opcode == 'fusion' else None
  body = module.computations.get(callee or '', [])
  users = collections.defaultdict(list)
  for i in body:
    for o in i.operands:
      users[o].append(i)

  def read(name: str) -> Optional[float]:   # None: something reads it whole
    total = 0.0
    for u in users.get(name, []):
      if u.opcode in ('dynamic-slice', 'slice') and u.operands and u.operands[0] == name:
        total += hlo_text.shape_bytes(u.shape)
      elif u.opcode == 'bitcast' and users.get(u.name):   # (a bitcast that is the root: read whole)
        r = read(u.name)
        if r is None:
          return None
        total += r
      else:
        return None
    return total

  out = {}
  for i in body:
    if i.opcode == 'parameter' and i.args.strip().isdigit():
      r = read(i.name)
      if r is not None and users.get(i.name):
        out[int(i.args)] = r
  return out


def kernel_bytes(module: hlo_text.Module, inst: hlo_text.Instruction) -> float:
  result = hlo_text.shape_bytes(inst.shape)
  operands = [module.instruction(o) for o in inst.operands]
  sliced = _sliced_reads(module, inst)
  read = sum(sliced.get(k, hlo_text.shape_bytes(o.shape)) for k, o in enumerate(operands) if o is not None)
  root = fused_root(module, inst)
  if root == 'dynamic-update-slice':   # in place: reads and writes the update only
    return 2 * max(read - result, 0.0)
  if root == 'dynamic-slice':          # reads the slice only
    return 2 * result
  return read + result


def kind_of(module: hlo_text.Module, inst: hlo_text.Instruction, source: str) -> str:
  target = re.search(r'custom_call_target="([^"]*)"', inst.attrs)
  label = f'{inst.name} {target.group(1) if target else ""}'
  kind = kernel_kind(label)   # the trace's kernel-name patterns fit HLO names too
  if kind.startswith('attention') or 'attend' in source:
    return 'attention'
  if kind == 'matrix product' or fused_root(module, inst) == 'dot' or source.endswith('dot_general'):
    return 'matrix products'
  return 'memory-bound passes'


def traffic(text: str) -> tuple[dict, dict, list[str]]:
  """(bytes by (part, kind), bytes by kind, loops of unknown trip count)."""
  module = hlo_text.parse_module(text)
  counts, unknown = hlo_text.execution_counts(module)
  by_part: dict = collections.Counter()
  by_kind: dict = collections.Counter()
  for comp in control_computations(module):
    n = counts.get(comp, 0.0)
    for inst in module.computations[comp]:
      if inst.opcode in NOT_KERNELS or inst.opcode.endswith('-done'):
        continue
      source = hlo_text.op_name(inst, module)
      kind = kind_of(module, inst, source)
      b = n * kernel_bytes(module, inst)
      by_part[(part_of(source, kind == 'matrix products'), kind)] += b
      by_kind[kind] += b
  return by_part, by_kind, unknown


def table(text: str, bandwidth: float = 0.0) -> str:
  by_part, by_kind, unknown = traffic(text)
  total = sum(by_kind.values())
  lines = ['| part of the step | kind | GB per step | share |', '|---|---|---|---|']
  for (part, kind), b in sorted(by_part.items(), key=lambda kv: -kv[1]):
    if b >= 0.001 * total:
      lines.append(f'| {part} | {kind} | {b / 1e9:,.2f} | {b / total:.1%} |')
  lines.append('')
  for kind, b in sorted(by_kind.items(), key=lambda kv: -kv[1]):
    est = f' (~{b / bandwidth * 1e3:,.1f} ms at {bandwidth / 1e12:g} TB/s)' if bandwidth and \
        kind == 'memory-bound passes' else ''
    lines.append(f'{kind}: {b / 1e9:,.2f} GB per step{est}')
  if unknown:
    lines.append(f'loops of unknown trip count, counted once: {", ".join(unknown)}')
  return '\n'.join(lines)


def _opaque_attention() -> None:
  """Attention as one opaque kernel: an optimization barrier on its inputs
  and output, which JAX's autodiff puts on their gradients too. A cuDNN
  kernel (a custom call) reads q, k and v and writes its output, and its
  backward writes dq, dk and dv, all in memory; XLA's own attention of a
  deviceless compile otherwise fuses the neighbouring passes into its
  layout transposes, and a change to those passes (the rotary kernel's)
  shows as less than the GPU's program would see."""
  import jax
  from mjax.model import attention
  inner = attention.attend

  def attend(q, k, v, *args, **kwargs):
    out = inner(*jax.lax.optimization_barrier((q, k, v)), *args, **kwargs)
    return jax.lax.optimization_barrier(out)
  attention.attend = attend


def main(argv=None) -> int:
  from mjax import flags
  p = flags.parser('hlo_traffic', __doc__.splitlines()[0])
  p.add_argument('--target', default='', help='compile for GPUs this machine does not have, e.g. h100:1')
  p.add_argument('--hlo', default='', help='read this optimized HLO text instead of compiling')
  p.add_argument('--save_hlo', default='', help='write the compiled HLO here')
  p.add_argument('--opaque_attention', action='store_true',
                 help="with --target: attention's inputs and outputs (and their gradients) kept as arrays in "
                      "memory, as cuDNN's kernels have them, so that XLA's attention of a deviceless compile "
                      "fuses nothing of its neighbours into its own passes (rotary, layouts)")
  p.add_argument('--bandwidth', type=flags.positive_float, default=None,
                 help='bytes/s for the time estimate of the memory-bound passes (default: 3.1e12 for a '
                      'GPU target, none otherwise)')
  args, bindings = flags.parse(p, sys.argv[1:] if argv is None else argv)
  if args.opaque_attention and (args.hlo or not args.target):
    p.error('--opaque_attention changes a compile for --target; it does nothing with --hlo or on this machine')
  if args.hlo:
    if not os.path.isfile(args.hlo):
      p.error(f'--hlo {args.hlo!r}: no such file (the optimized HLO text of a train step, as --save_hlo writes)')
    text = open(args.hlo).read()
  elif args.target:
    from mjax.parallel import gpu_target
    gpu_target.keep_local_backend_cpu()
    target = gpu_target.parse_target(args.target)
    cfg = flags.load(flags.gin_files(args), bindings, num_devices=target.devices)
    if args.opaque_attention:
      _opaque_attention()
    text = gpu_target.compile_step(cfg, target).compiled.as_text()
  else:
    from mjax import train
    from mjax.parallel import make_mesh
    cfg = flags.setup(flags.gin_files(args), bindings, join=False)
    program = train.make_program(cfg, make_mesh(cfg.mesh))
    with program.context():
      text = program.step.lower(program.abstract_state(), program.abstract_batch()).compile().as_text()
  if args.save_hlo:
    with open(args.save_hlo, 'w') as fh:
      fh.write(text)
  bandwidth = args.bandwidth if args.bandwidth is not None else (3.1e12 if args.target else 0.0)
  print(table(text, bandwidth))
  return 0


if __name__ == '__main__':
  # A bad config or --target is one paragraph and exit status 2, as from
  # mjax-train, not a traceback.
  from mjax import cli
  sys.exit(cli.entry_point('hlo_traffic')(main)())
