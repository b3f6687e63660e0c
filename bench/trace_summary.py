"""Where a traced train step's device time goes, op by op, as markdown tables.

  python bench/train_bench.py --gin_file configs/125m.gin --profile /tmp/prof
  python bench/trace_summary.py /tmp/prof            # finds perfetto_trace.json.gz below it

Reads the Chrome-trace JSON that `jax.profiler.trace(create_perfetto_trace=True)`
writes, keeps the complete events of the device streams (GPU kernels; on CPU,
the XLA ops of the host threads that run them) and sums their durations by
name and by kind (matrix products, attention, fusions, collectives, copies).

With the step's optimized HLO beside the trace (`train_step.hlo.txt`, which
`train_bench.py --profile` writes), it also sums them by part of the model,
from each op's source location in the HLO metadata: the layers' weight
matrix products, attention, the layers' other ops, head and loss, forward
and backward apart, and the optimizer and metrics outside the model.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re

from mjax import flags
from mjax.ft import device_time
from mjax.parallel import hlo_text

# Kernel-name patterns, first match wins. cuBLAS/cuBLASLt and CUTLASS GEMMs
# carry 'gemm' or 'xmma' or 'cutlass'; cuDNN flash attention 'fmha' or 'cudnn'.
KINDS = [
    ('attention (cuDNN)', re.compile(r'fmha|flash|cudnn|sdpa', re.I)),
    # XLA:CPU hands dots, and the elementwise work fused around them, to
    # YNNPACK: one kind, since the name does not say which.
    ('YNNPACK fusion (CPU: matrix products and what is fused with them)', re.compile(r'^ynn_fusion', re.I)),
    # (mosaic_gpu: mjax's Pallas kernels, products with their epilogues,
    # mjax/model/gelu_kernel.py and rotary_kernel.py (dgelu_gemm, rope_gemm);
    # their HLO custom calls and their trace kernels.)
    ('matrix product', re.compile(r'gemm|xmma|cutlass|matmul|dot|nvjet|sm90_|mosaic_gpu|dgelu|rope_', re.I)),
    ('collective', device_time.COLLECTIVE),
    ('copy / transpose', re.compile(r'memcpy|memset|copy|transpose', re.I)),
    ('reduction / norm fusion', re.compile(r'reduce|norm', re.I)),
    ('elementwise / other fusion', re.compile(r'fusion|loop_|input_|wrapped_|convert', re.I)),
]


def find_trace(path: str) -> str:
  hit = device_time.find_trace(path)
  if not hit:
    raise SystemExit(f'trace_summary: no perfetto_trace.json.gz under {path}')
  return hit


def traced_steps(trace: str) -> int:
  """The step count recorded beside the trace: in a folder above the trace
  file (jax.profiler writes it under plugins/profile/<time>/ of the folder
  the trainer's profile_steps.json is in), at most 5 levels up."""
  d = os.path.dirname(os.path.abspath(trace))
  for _ in range(6):
    f = os.path.join(d, 'profile_steps.json')
    if os.path.exists(f):
      with open(f) as fh:
        return int(json.load(fh)['steps'])
    if os.path.dirname(d) == d:
      break
    d = os.path.dirname(d)
  raise SystemExit(f'trace_summary: no profile_steps.json beside {trace} (traces from mjax-train and '
                   'train_bench.py --profile have one): give --steps N, the train steps it holds')


def kind_of(name: str) -> str:
  for kind, pat in KINDS:
    if pat.search(name):
      return kind
  return 'other'


def op_sources(text: str) -> dict[str, str]:
  """HLO instruction name -> the op_name of its metadata (where in the
  program it comes from, e.g. `jit(train_step)/transpose(jvp(Transformer))/
  while/body/.../attn.attend/dot_general`)."""
  module = hlo_text.parse_module(text)
  return {name: hlo_text.op_name(inst, module) for name, inst in module.by_name.items()}


def part_of(source: str, matmul: bool = False) -> str:
  """Which part of the train step an op with this HLO op_name belongs to.

  `matmul`: the op is known to be a matrix product (its kernel is a GEMM).
  A weight gradient's product is named after the transpose that autodiff
  wraps it in (`.../attn/transpose`), not after a dot_general: without the
  flag the H100 step's Triton weight-gradient GEMMs (74 ms) were counted as
  the layers' elementwise work."""
  if not source:
    return 'no source (runtime, copies XLA added)'
  if 'jvp(' not in source:  # outside the differentiated model: clipping, LAMB, metrics
    return 'optimizer and metrics'
  side = 'backward' if 'transpose(jvp' in source else 'forward'
  if 'attend' in source:
    return f'{side}: attention (scores, softmax, their products)'
  if re.search(r'/layers(_\d+)?/', source) or '/while/body' in source:   # scanned or unrolled
    if matmul or source.endswith('dot_general'):
      return f'{side}: layers\' weight matrix products'
    if 'dynamic_update_slice' in source or 'dynamic_slice' in source:
      return f'{side}: layers\' stacking and slicing (scan)'
    return f'{side}: layers\' other ops (norms, activation, rotary, residual, layout)'
  if '_head' in source or 'Transformer' not in source:
    return f'{side}: head and loss'
  if source.endswith('broadcast_in_dim'):
    return f'{side}: zero-filled buffers (scan outputs, gradient sums)'
  return f'{side}: embedding and the rest of the model'


IN_GRAPH = 'library kernel inside a CUDA graph (cuBLAS, cuDNN: no HLO name)'


def part_of_event(event: dict, sources: dict[str, str], module: str = '') -> str:
  """The part of the step one trace event belongs to.

  GPU kernels name their HLO op in args['hlo_op'] and CPU events are HLO
  names. Where XLA runs the step as CUDA graphs (command buffers, the
  default on recent GPUs), 'hlo_op' names the whole graph, so XLA's own
  kernels are found by their kernel name instead: the HLO instruction's
  name with '_' for its '.' (`loop_add_multiply_fusion_23` is
  `loop_add_multiply_fusion.23`). A library's kernel in a graph (cuBLAS
  `nvjet_*`, cuDNN) carries no name of its own in the HLO. XLA runs one
  kernel for identical fusions (their `deduplicated_name`), so such a
  kernel's every call counts under the part of the instruction it is
  named after."""
  args = event.get('args', {})
  op = args.get('hlo_op', event['name'])
  names = [op]
  # Kernel names are unique within one program only: another jitted
  # program in the trace (evaluation, a metric) may reuse them.
  if not module or args.get('hlo_module', module) == module:
    names += [event['name'], re.sub(r'_(\d+)$', r'.\1', event['name'])]
  for name in names:
    if sources.get(name):   # the graph itself is in the HLO too, with no source
      return part_of(sources[name], kind_of(name) == 'matrix product')
  if op.startswith('command_buffer'):
    return IN_GRAPH
  return part_of('')


def summarize(path: str, steps: int = 2, top: int = 25, hlo: str = '') -> str:
  ops = device_time.device_ops(path)
  if not ops:
    return f'no device events in {path}'
  busy = device_time.busy_seconds(ops) * 1e6
  spans = sorted((e['ts'], e['ts'] + e['dur']) for e in ops)
  wall = spans[-1][1] - spans[0][0]
  by_name = collections.Counter()
  by_kind = collections.Counter()
  count = collections.Counter()
  for e in ops:
    by_name[e['name']] += e['dur']
    by_kind[kind_of(e['name'])] += e['dur']
    count[e['name']] += 1
  total = sum(by_name.values())
  by_part = collections.Counter()
  if hlo:
    sources = op_sources(hlo)
    named = re.match(r'HloModule ([^,\s]+)', hlo)   # the name the trace's events give as hlo_module
    module = named.group(1) if named else ''
    for e in ops:
      by_part[part_of_event(e, sources, module)] += e['dur']
  out = [f'trace {os.path.basename(path)}: {len(ops)} device events over {wall / 1e3:.1f} ms; '
         f'device busy {busy / 1e3:.1f} ms ({busy / wall:.0%} of the span), '
         f'{busy / 1e3 / steps:.1f} ms per step over {steps} steps', '',
         '| kind | ms per step | share |', '|---|---|---|']
  for k, v in by_kind.most_common():
    out.append(f'| {k} | {v / 1e3 / steps:.2f} | {v / total:.1%} |')
  if by_part:
    out += ['', '| part of the step | ms per step | share |', '|---|---|---|']
    for k, v in by_part.most_common():
      out.append(f'| {k} | {v / 1e3 / steps:.2f} | {v / total:.1%} |')
  out += ['', f'| top {top} ops | calls per step | ms per step | share | kind |', '|---|---|---|---|---|']
  for name, v in by_name.most_common(top):
    short = name if len(name) <= 70 else name[:67] + '...'
    out.append(f'| `{short}` | {count[name] / steps:g} | {v / 1e3 / steps:.2f} | {v / total:.1%} | '
               f'{kind_of(name)} |')
  return '\n'.join(out)


def main(argv=None):
  p = argparse.ArgumentParser('trace_summary', description=__doc__.splitlines()[0])
  p.add_argument('path', help='a perfetto_trace.json.gz or a folder holding one')
  p.add_argument('--steps', type=flags.whole_number(), default=None,
                 help='steps the trace holds (default: from profile_steps.json, which mjax-train\'s '
                      'profiler and train_bench.py --profile write beside the trace)')
  p.add_argument('--top', type=flags.whole_number(), default=25)
  p.add_argument('--hlo', default='', help='the step\'s optimized HLO text (default: train_step.hlo.txt '
                 'in the trace\'s folder, when there)')
  args = p.parse_args(argv)
  hlo = args.hlo or (os.path.join(args.path, 'train_step.hlo.txt') if os.path.isdir(args.path) else '')
  text = open(hlo).read() if hlo and os.path.exists(hlo) else ''
  if args.hlo and not text:
    raise SystemExit(f'trace_summary: --hlo {args.hlo}: no such file')
  trace = find_trace(args.path)
  if not trace.endswith('.json.gz'):
    # A file given as the path is read as the trace: anything else (the HLO
    # text beside it, a trace not compressed) would end in a JSON traceback.
    raise SystemExit(f'trace_summary: {args.path} is not a trace: give a perfetto_trace.json.gz (or '
                     '*.trace.json.gz) or a folder holding one')
  print(summarize(trace, args.steps or traced_steps(trace), args.top, text))


if __name__ == '__main__':
  main()
