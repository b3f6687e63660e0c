"""What a compiled train step communicates, next to what its layout implies.

Three parts:
  1. Measured: every collective in the optimized HLO (`Compiled.as_text()`),
     counted per executed step: ops inside the scanned-layer while loops count
     once per iteration (see mjax.parallel.hlo_text for how trip counts are
     read, and their limits). Asynchronous pairs count once, at their `-start`.
  2. Expected: the analytical minimum of the mesh layout (below).
  3. Memory: `Compiled.memory_analysis()`, per device.

Byte conventions, per device and per step:
  * buffer bytes: the logical size of the collective: all-reduce, all-to-all
    and collective-permute their result (= operand); all-gather its OUTPUT
    (the gathered array); reduce-scatter its INPUT (the array before
    scattering). All shapes in SPMD HLO are per device.
  * wire bytes: what each device sends with ring algorithms over a group of n:
    all-reduce 2 (n-1)/n x buffer; all-gather, reduce-scatter, all-to-all
    (n-1)/n x buffer; collective-permute 1 x buffer. The expectations are in
    wire bytes, so the two columns compare directly.

Analytical minimum (per device, per step, ring algorithms); t, f, d: tensor,
fsdp, data sizes, B = d f, t_p: the tensor shards of parameter p:
  * FSDP weights (f > 1): all-gather each layer's weight before use, in the
    forward and again in the backward (keeping the gathered weights from the
    forward to the backward would hold the whole model unsharded, which FSDP
    avoids), and the ends (embedding, head: outside the rematerialized
    layers) once, their gathered copy kept for the backward (not under
    1F1B, twice there like the layers'):
        (f-1)/f x (2 sum_layers + sum_ends) elements_p / t_p x compute-dtype bytes
    (gathering after the bf16 cast is the minimum; gathering the fp32 master
    weights doubles it). With k gradient-accumulation slices still once
    (keeping the gathered weights across slices); a step that does not
    keep them gathers, and reduce-scatters, k times this.
  * FSDP gradients: reduce-scatter over fsdp in the compute dtype (the
    gradient of a weight cast before its gather comes back through the
    gather in that dtype; a GPU compile shows bf16 reduce-scatters),
        (f-1)/f x sum_p elements_p / t_p x compute-dtype bytes
    then an all-reduce of the 1/f shard over data, in the same dtype, when
    d > 1. A tied embedding counts once: its two readers' (lookup, head)
    partial sums meet on each device before the reduce-scatter.
  * Replicated gradients (data parallel): one all-reduce over B,
        2 (B-1)/B x sum_p elements_p / t_p x compute-dtype bytes
    (norms' scales and biases, used in fp32, at 4). A tied embedding
    counts once here too.
  * Tensor parallel (t > 1), Megatron-style without sequence parallelism: per
    layer, an all-reduce of the (batch/B, seq, d_model) activations after each
    row-parallel matmul in the forward and of the input gradient in the
    backward: 1 + 1 per layer for the parallel block (attention and MLP partial
    sums add before one all-reduce, MegaScale's point) and 2 + 2 for the
    sequential block, under every remat policy (XLA keeps the reduced
    outputs), plus one per pass of each layer inside a remat group of
    `layer_period` layers but its last (recomputed with the group's forward). Plus the vocab-sharded embedding lookup (forward) and LM head
    (backward). With sequence parallelism each all-reduce becomes an
    all-gather plus a reduce-scatter with the same wire bytes, and the
    backward gathers each pass's input again for the weight gradients
    (every policy but 'none'), as well as the head's input and the
    embedding's cotangent; with collective matmul the
    layers' ones are rings of t-1 collective-permutes each (the same bytes
    again), and the embedding's and head's stay gathers and scatters. The loss's max / sum over the
    sharded vocabulary are (batch, seq) scalars and left out.
  * Pipeline stages (collective-permute of activations) are not modelled.
    Their schedules add the micro-batches' gradients in fp32 and all-reduce
    those sums over data once, at 4 bytes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mjax.config import Config
from mjax.parallel import hlo_text
from mjax.parallel.hlo_text import Instruction, Module, shape_arrays, shape_bytes

KINDS = ('all-reduce', 'all-gather', 'reduce-scatter', 'collective-permute', 'all-to-all')
MiB = 2**20


@dataclasses.dataclass
class CollectiveOp:
  """One collective instruction of the optimized HLO.

  Attributes:
    name, kind, computation: where it is and what it is ('all-gather', ...).
    executions: how often it runs per step (loop trip counts multiplied in).
    buffer_bytes: per execution, by the convention of the module docstring.
    group_size: devices in each replica group (None for collective-permute).
    arrays: the buffers moved (the gathered / reduced arrays).
    op_name: the JAX op it came from (metadata), for tracing it back.
  """
  name: str
  kind: str
  computation: str
  executions: float
  buffer_bytes: float
  group_size: Optional[int]
  arrays: list[hlo_text.Array]
  op_name: str
  # The 16-bit dtype the program gave this f32 collective's operand, when the
  # backend widened it (see `_widened_from`); None otherwise.
  widened_from: Optional[str] = None

  @property
  def wire_bytes(self) -> float:
    """Bytes each device sends per execution (ring algorithms)."""
    n = self.group_size or 1
    if self.kind == 'collective-permute':
      return self.buffer_bytes
    if n <= 1:
      return 0.0
    factor = 2 * (n - 1) / n if self.kind == 'all-reduce' else (n - 1) / n
    return factor * self.buffer_bytes

  @property
  def program_wire_bytes(self) -> float:
    """wire_bytes at the dtype the program asked for (before widening)."""
    if not self.widened_from:
      return self.wire_bytes
    return self.wire_bytes * hlo_text.DTYPE_BYTES[self.widened_from] / hlo_text.DTYPE_BYTES['f32']


@dataclasses.dataclass
class CommStats:
  """All collectives of one module; per_step() sums them by kind."""
  ops: list[CollectiveOp]
  unknown_trip_loops: list[str]
  num_partitions: int

  def of_kind(self, kind: str) -> list[CollectiveOp]:
    return [o for o in self.ops if o.kind == kind]

  def per_step(self, kind: str) -> dict[str, float]:
    ops = self.of_kind(kind)
    return {'ops': sum(o.executions for o in ops), 'static': len(ops),
            'bytes': sum(o.executions * o.buffer_bytes for o in ops),
            'wire': sum(o.executions * o.wire_bytes for o in ops)}


# ----------------------------------------------------------------------------
# Measured
# ----------------------------------------------------------------------------

def _group_size(attrs: str, default: int) -> Optional[int]:
  """Devices per replica group, from any of XLA's printed forms
  (`_replica_groups`); `default` (every partition) when there are none."""
  mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]", attrs)
  n = math.prod(int(v) for v in re.findall(r"=\s*(\d+)", mesh.group(1))) if mesh else default
  groups = _replica_groups(attrs, n)
  return len(groups[0]) if groups and groups[0] else default


def _buffer(module: Module, inst: Instruction, kind: str, group: Optional[int]):
  """(bytes, arrays) of one collective by the module docstring's convention."""
  shape = inst.shape
  is_start = inst.opcode.endswith('-start')
  if is_start and kind in ('all-gather', 'collective-permute') and isinstance(shape, tuple) \
      and len(shape) >= 2:
    shape = shape[1]  # (operands, outputs[, contexts]): keep the outputs
  elif is_start and isinstance(shape, tuple) and len(shape) == 2 and isinstance(shape[0], tuple):
    # jaxlib 0.11's all-reduce-start: ((operands), outputs), where 0.10
    # printed the outputs alone (a tuple of arrays for several operands).
    shape = shape[1]
  if kind == 'reduce-scatter':
    srcs = [module.instruction(o) for o in inst.operands]
    if srcs and all(s is not None for s in srcs):
      arrays = [a for s in srcs for a in shape_arrays(s.shape)]
      return sum(a.bytes for a in arrays), arrays
    return shape_bytes(shape) * (group or 1), shape_arrays(shape)
  return shape_bytes(shape), shape_arrays(shape)


# Ops that move or re-lay values without computing on them: followed when
# tracing a collective's operand back to where its dtype was set.
_MOVES = ('copy', 'bitcast', 'reshape', 'transpose', 'dynamic-slice', 'slice')


def _widened_from(module: Module, inst: Instruction) -> Optional[str]:
  """'bf16' / 'f16' when an f32 collective moves a value the program had in
  16 bits: tracing its operand back through data movement and fusion bodies
  reaches a convert from a 16-bit value. XLA's CPU backend has no 16-bit
  collectives and widens them to f32 after partitioning (float
  normalization); the program, and a GPU backend, move the 16-bit value:
  e.g. FSDP weights cast on the shard and then gathered."""
  arrays = [a for a in shape_arrays(inst.shape) if a.dims]
  if not arrays or any(a.dtype != 'f32' for a in arrays) or not inst.operands:
    return None
  found = {_trace_16_bit(module, module.instruction(o)) for o in inst.operands}
  return found.pop() if len(found) == 1 and None not in found else None  # every operand, one dtype


def _trace_16_bit(module: Module, src: Optional[Instruction]) -> Optional[str]:
  callers: list[Instruction] = []   # fusions entered, innermost last
  for _ in range(64):  # a chain of moves is short; never loop forever
    if src is None:
      return None
    if src.opcode == 'fusion':
      body = [c for role, c in hlo_text.called(src) if role == 'calls']
      insts = module.computations.get(body[0], []) if body else []
      if not insts:
        return None
      callers.append(src)
      src = insts[-1]  # HLO text prints a computation's ROOT last
    elif src.opcode == 'parameter' and callers:
      caller = callers.pop()
      k = int(src.args.strip() or 0)
      src = module.instruction(caller.operands[k]) if k < len(caller.operands) else None
    elif src.opcode == 'convert' and src.operands:
      inner = module.instruction(src.operands[0])
      dtypes = {a.dtype for a in shape_arrays(inner.shape)} if inner is not None else set()
      if len(dtypes) == 1 and dtypes <= {'bf16', 'f16'}:
        return dtypes.pop()
      src = inner
    elif src.opcode in _MOVES and src.operands:
      src = module.instruction(src.operands[0])
    else:
      return None
  return None


def collective_stats(text: str, trace_widening: bool = True) -> CommStats:
  """Every collective in optimized HLO text, with its executions per step.

  Args:
    trace_widening: look for f32 collectives the backend widened from 16
      bits (`_widened_from`); off for a program that computes in f32.
  """
  module = hlo_text.parse_module(text)
  counts, unknown = hlo_text.execution_counts(module)
  ops = []
  for comp, insts in module.computations.items():
    n = counts.get(comp, 0.0)
    if not n:
      continue  # not reachable from ENTRY: never runs
    for inst in insts:
      kind = inst.opcode[:-len('-start')] if inst.opcode.endswith('-start') else inst.opcode
      if kind not in KINDS:
        continue
      group = None if kind == 'collective-permute' else _group_size(inst.attrs, module.num_partitions)
      nbytes, arrays = _buffer(module, inst, kind, group)
      ops.append(CollectiveOp(inst.name, kind, comp, n, nbytes, group, arrays, hlo_text.op_name(inst),
                              _widened_from(module, inst) if trace_widening else None))
  return CommStats(ops, unknown, module.num_partitions)


# ----------------------------------------------------------------------------
# Expected
# ----------------------------------------------------------------------------

@dataclasses.dataclass
class Expectation:
  """One source of expected traffic (e.g. FSDP weight gathers), in wire bytes."""
  kind: str
  wire_bytes: float
  note: str


def _dtype_bytes(name: str) -> int:
  return jnp.dtype(name).itemsize


def expected_traffic(cfg: Config, mesh: Mapping[str, int], params=None) -> list[Expectation]:
  """The analytical minimum of the module docstring, one entry per source.

  Args:
    cfg: the run's config (model shape, dtypes, batch, sequence length).
    mesh: mesh axis sizes, e.g. dict(jax_mesh.shape).
    params: ParamInfo list (default: computed from cfg.model).
  Returns:
    Expectations in wire bytes per device per step; several may share a kind.
  """
  from mjax.parallel.param_layout import param_infos
  params = param_infos(cfg.model) if params is None else params
  m = cfg.model
  d, f, t = mesh.get('data', 1), mesh.get('fsdp', 1), mesh.get('tensor', 1)
  batch_axes = ('data', 'fsdp')
  ec, out = _dtype_bytes(m.dtype), []
  # A gradient is reduced in the dtype its parameter is used in: matrices
  # (kernels, the embedding) are cast to the compute dtype, and their
  # gradients come back through the cast in it; norms' scales and biases are
  # used, and reduced, in fp32.
  # Pipeline schedules add their micro-batches' gradients in fp32 and
  # all-reduce the sums once: the stages' layers (and under 1F1B the ends,
  # which its stages run too) at 4 bytes.
  # MeshConfig.fsdp_gather = 'step' gathers every weight once a step and
  # holds it, and sums every gradient on the device first, pipelined or not
  # (train._grad_sums_gathered).
  once = cfg.mesh.fsdp_gather == 'step' and f > 1
  piped = lambda p: (mesh.get('pipeline', 1) > 1 and not once
                     and (p.in_layers or cfg.mesh.pipeline_schedule == '1f1b'))
  reduced = lambda p: ec if len(p.shape) - int(p.layers) >= 2 and not piped(p) else p.itemsize
  grad_bytes = lambda p, *axes: p.size * reduced(p) / p.shards(mesh, ('tensor', 'pipeline', *axes))

  fsdp_params = [p for p in params if 'fsdp' in p.axes()] if f > 1 else []
  # With accumulation slices the minimum is still once a step: gathering
  # once means keeping the gathered weights across the slices, and
  # reduce-scattering once keeping whole gradients, memory a step usually
  # spends on neither, so its gathers and reduce-scatters run once per slice
  # (k times this). The data axis's all-reduce can add up across slices
  # first at no cost in memory.
  k = cfg.train.grad_accum_steps
  per_slice = (f'; once a step: the {k} accumulation slices usually run it {k} times, unless the weights '
               f"stay gathered (MeshConfig.fsdp_gather = 'step')") if k > 1 and not once else ''
  if fsdp_params:
    elems = sum(p.size / p.shards(mesh, ('tensor', 'pipeline')) for p in fsdp_params)
    # The ends (embedding, head) are gathered once: their gathered copy is
    # kept for the backward, outside the rematerialized layers. Not under
    # 1F1B, whose stages run them per micro-batch in their own programs.
    ends = (sum(p.size / p.shards(mesh, ('tensor', 'pipeline')) for p in fsdp_params if not p.in_layers)
            if cfg.mesh.pipeline_schedule != '1f1b' else 0)
    if once:
      out.append(Expectation('all-gather', (f - 1) / f * elems * ec,
                             f"FSDP: {len(fsdp_params)} weight arrays gathered over fsdp={f} once a step and held "
                             f"(MeshConfig.fsdp_gather = 'step'), in {m.dtype} ((f-1)/f x {elems / 1e6:.2f}M "
                             f'elements x {ec} B)'))
    else:
      out.append(Expectation('all-gather', (f - 1) / f * (2 * elems - ends) * ec,
                             f'FSDP: {len(fsdp_params)} weight arrays gathered over fsdp={f} in the '
                             f'forward and again in the backward' + (' (the embedding and head once)' if ends else '')
                             + f', in {m.dtype} ((f-1)/f x (2 x {(elems - ends) / 1e6:.2f}M + {ends / 1e6:.2f}M) '
                             f'elements x {ec} B{per_slice})'))
    # The weights are cast to the compute dtype on their shards before the
    # gather, so their gradients come back through the gather, and are
    # reduce-scattered, in that dtype (then widened to fp32 for LAMB).
    # A tied table once: its two readers' partials are summed before the
    # reduce-scatter (mjax/parallel/scatter_sum.py).
    rs = sum(p.size / p.shards(mesh, ('tensor', 'pipeline')) * reduced(p) for p in fsdp_params)
    out.append(Expectation('reduce-scatter', (f - 1) / f * rs,
                           f'FSDP: gradients reduce-scattered over fsdp={f} in {m.dtype}, the dtype of '
                           f'the gathered weights ((f-1)/f x {rs / MiB:.1f} MiB{per_slice})'))
    pp = mesh.get('pipeline', 1)
    # 1F1B computes the ends' gradients on its first and last stage and
    # sums them over the stages in fp32 (pipeline.one_f_one_b), on their
    # fsdp shards; in the same all-reduce over data, unless the step holds
    # the weights gathered ('step': over the stages only, gathered, and over
    # data with the rest).
    ends_in_schedule = cfg.mesh.pipeline_schedule == '1f1b' and pp > 1
    over_data = [p for p in fsdp_params if once or not ends_in_schedule or p.in_layers]
    if d > 1:
      ar = sum(grad_bytes(p, 'fsdp') for p in over_data)
      out.append(Expectation('all-reduce', 2 * (d - 1) / d * ar,
                             f'data={d}: all-reduce of the 1/fsdp gradient shards in {m.dtype} '
                             f'(2 (d-1)/d x {ar / MiB:.1f} MiB)'))
    if ends_in_schedule:
      n = pp if once else pp * d
      ends_bytes = sum(p.size * 4 / p.shards(mesh, ('tensor',) if once else ('tensor', 'fsdp'))
                       for p in fsdp_params if not p.in_layers)
      out.append(Expectation('all-reduce', 2 * (n - 1) / n * ends_bytes,
                             f'1F1B: the embedding\'s and head\'s gradients summed over {n} devices '
                             f'(pipeline={pp}' + ('' if once else f' x data={d}') + ') in fp32 '
                             f'(2 (n-1)/n x {ends_bytes / MiB:.1f} MiB)'))
  replicated = [p for p in params if p not in fsdp_params]
  # The 1F1B schedule computes the embedding's gradient on the first stage
  # and the head's on the last: the params outside the layer stack (one
  # table, when tied) are summed over the stages as well as the data shards.
  stages = mesh.get('pipeline', 1) if cfg.mesh.pipeline_schedule == '1f1b' else 1
  if replicated:
    groups: dict[int, float] = {}
    for p in replicated:
      n = math.prod(mesh.get(a, 1) for a in batch_axes) // p.shards(mesh, batch_axes)
      n *= stages if p.shards(mesh, ('pipeline',)) == 1 else 1
      groups[n] = groups.get(n, 0.0) + grad_bytes(p, *batch_axes)
    for n, nbytes in sorted(groups.items()):
      if n > 1:
        out.append(Expectation('all-reduce', 2 * (n - 1) / n * nbytes,
                               f'data parallel: gradient all-reduce over {n} devices in {m.dtype} '
                               f'(norms in fp32; 2 (n-1)/n x {nbytes / MiB:.1f} MiB)'))
  if t > 1:
    b = cfg.train.global_batch_size / (d * f)
    act = b * cfg.data.seq_len * m.d_model * ec
    per_pass = 1 if m.block == 'parallel' else 2
    # One sum of partial products per pass forward and one of the input
    # gradient backward; XLA keeps the forward's reduced outputs for the
    # backward even under remat 'full' (a GPU compile of 1p3b shows 2).
    per_layer = per_pass * 2
    # Remat recomputes a layer group's forward in the backward, and with it
    # the sums inside the group; the group's output is kept.
    recomputed = (m.n_layers - m.n_layers // m.layer_period) * per_pass if m.remat_policy != 'none' else 0
    # 1F1B runs each chunk's forward again in its backward tick.
    if cfg.mesh.pipeline_schedule == '1f1b' and mesh.get('pipeline', 1) > 1:
      recomputed += m.n_layers * per_pass
    vocab_sharded = any('tensor' in p.axes() for p in params if p.path.startswith("['embedding']"))
    n = m.n_layers * per_layer + recomputed + (2 if vocab_sharded else 0)
    ends = ' + embedding fwd + LM head bwd' if vocab_sharded else ''
    again_in_groups = (f' + {recomputed} recomputed (inside remat groups of {m.layer_period}'
                       + (", 1F1B's chunks run forward again" if cfg.mesh.pipeline_schedule == '1f1b'
                          and mesh.get('pipeline', 1) > 1 else '') + ')') if recomputed else ''
    shape = f'(batch {b:g}, seq {cfg.data.seq_len}, d_model {m.d_model}) {m.dtype} = {act / MiB:.2f} MiB'
    what = f'{per_layer} per layer ({m.block} block) x {m.n_layers} layers{again_in_groups}{ends} = {n}, each {shape}'
    if not cfg.mesh.sequence_parallel:
      out.append(Expectation('all-reduce', n * 2 * (t - 1) / t * act,
                             f'tensor={t}: activation all-reduces, {what}, x 2 (t-1)/t'))
    else:
      # Each all-reduce is an all-gather of the sequence-split activations
      # before the column-parallel products and a reduce-scatter after the
      # row-parallel ones: (t-1)/t each. The input products' weight
      # gradients read their gathered input again, which every policy but
      # 'none' gathers again in the backward (Megatron's sequence
      # parallelism does the same), as the head does for its own and the
      # embedding's gradient its cotangent (mjax/parallel/scatter_sum.py).
      # Collective matmul moves the layers' halves as rings of
      # collective-permutes, t-1 chunks of 1/t each.
      again = m.remat_policy != 'none'
      layer_gathers = m.n_layers * per_pass * (2 + again)
      gathers = layer_gathers + (3 if vocab_sharded else 0)
      cm = cfg.mesh.collective_matmul
      ring_gathers, ring_scatters = (layer_gathers, m.n_layers * per_layer + recomputed) if cm else (0, 0)
      for kind, count, rings, note in (
          ('all-gather', gathers, ring_gathers,
           f'{per_pass * (2 + again)} per layer ({m.block} block'
           + (', the backward gathering the input again' if again else '') + ')'
           + f' x {m.n_layers} layers' + (' + LM head fwd, bwd + embedding bwd' if vocab_sharded else '')
           + f' = {gathers}'),
          ('reduce-scatter', n, ring_scatters,
           f'{per_layer} per layer ({m.block} block) x {m.n_layers} layers{again_in_groups}{ends} = {n}')):
        out.append(Expectation(kind, (count - rings) * (t - 1) / t * act,
                               f'tensor={t}, sequence parallel: activation {kind}s, {note}, each {shape}'
                               + (f', less the layers\' {rings} in collective-matmul rings' if rings else '')
                               + ', x (t-1)/t'))
      if cm:
        out.append(Expectation('collective-permute', (ring_gathers + ring_scatters) * (t - 1) / t * act,
                               f'tensor={t}, collective matmul: the layers\' {ring_gathers} all-gathers and '
                               f'{ring_scatters} reduce-scatters as rings of t-1 chunk permutes, x (t-1)/t each'))
  return out


# ----------------------------------------------------------------------------
# Memory analysis of the compiled step
# ----------------------------------------------------------------------------

MEMORY_FIELDS = ('argument_size_in_bytes', 'output_size_in_bytes', 'alias_size_in_bytes',
                 'temp_size_in_bytes', 'generated_code_size_in_bytes')


def memory_stats(compiled: Any) -> Optional[dict[str, int]]:
  """`compiled.memory_analysis()` per device as a dict, None when unavailable.

  `total` = arguments + outputs - aliased (donated buffers reused for outputs)
  + temporaries + generated code: XLA's own bound on the step's footprint.
  """
  try:
    ma = compiled.memory_analysis()
  except Exception:  # some backends raise Unimplemented
    return None
  if isinstance(ma, (list, tuple)):
    ma = ma[0] if ma else None
  if ma is None:
    return None
  stats = {f: int(getattr(ma, f, 0) or 0) for f in MEMORY_FIELDS}
  stats['total'] = (stats['argument_size_in_bytes'] + stats['output_size_in_bytes']
                    - stats['alias_size_in_bytes'] + stats['temp_size_in_bytes']
                    + stats['generated_code_size_in_bytes'])
  return stats


# ----------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------

@dataclasses.dataclass
class CommReport:
  stats: CommStats
  expected: list[Expectation]
  memory: Optional[dict[str, int]]
  mesh: dict[str, int]
  compute_dtype: str = 'bf16'   # HLO spelling of ModelConfig.dtype
  gpu: bool = False             # compiled for GPUs

  def expected_wire(self, kind: str) -> float:
    return sum(e.wire_bytes for e in self.expected if e.kind == kind)


def comm_report(compiled: Any, cfg: Config, mesh: Mapping[str, int]) -> CommReport:
  """Measured collectives, expectations and memory of a compiled train step.

  Args:
    compiled: `jax.stages.Compiled` (e.g. program.step.lower(...).compile()).
    cfg: the config it was built from.
    mesh: mesh axis sizes (dict(mesh.shape)).
  """
  hlo_dtype = {'bfloat16': 'bf16', 'float32': 'f32', 'float16': 'f16'}[cfg.model.dtype]
  # f32 compute: a convert from 16 bits (bf16 master weights, say) is the
  # program's own cast, and its f32 collectives are real.
  stats = collective_stats(compiled.as_text(), trace_widening=hlo_dtype != 'f32')
  device = next(iter(jax.tree.leaves(compiled.input_shardings)[0].device_set))
  return CommReport(stats=stats,
                    expected=expected_traffic(cfg, mesh),
                    memory=memory_stats(compiled), mesh=dict(mesh), compute_dtype=hlo_dtype,
                    gpu=device.platform in ('gpu', 'cuda', 'rocm'))


def _mb(x: float) -> str:
  return f'{x / MiB:,.2f}'


def format_report(report: CommReport) -> str:
  """The tables a performance engineer reads: collectives, notes, memory."""
  s = report.stats
  rows = [('kind', 'ops/step', 'in HLO', 'MiB/step', 'wire MiB/dev', 'expected wire MiB', 'ratio',
           'dtypes')]
  tot = {'wire': 0.0, 'exp': 0.0}
  for kind in KINDS:
    ps = s.per_step(kind)
    exp = report.expected_wire(kind)
    if not ps['static'] and not exp:
      continue
    dtypes = sorted({a.dtype for o in s.of_kind(kind) for a in o.arrays if a.dims})
    ratio = f'{ps["wire"] / exp:.2f}' if exp else ('-' if not ps['wire'] else 'n/a')
    rows.append((kind, f'{ps["ops"]:g}', str(ps['static']), _mb(ps['bytes']), _mb(ps['wire']),
                 _mb(exp) if exp else '-', ratio, ','.join(dtypes) or '-'))
    tot['wire'] += ps['wire']
    tot['exp'] += exp
  rows.append(('total', '', '', '', _mb(tot['wire']), _mb(tot['exp']),
               f'{tot["wire"] / tot["exp"]:.2f}' if tot['exp'] else '-', ''))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  fmt = lambda r: '  '.join(c.ljust(w) if i in (0, 7) else c.rjust(w)
                            for i, (c, w) in enumerate(zip(r, widths)))
  lines = [f'collectives per train step, per device (mesh {report.mesh}, '
           f'{s.num_partitions} partitions)', fmt(rows[0]), fmt(tuple('-' * w for w in widths))]
  lines += [fmt(r) for r in rows[1:]]
  lines.append('')
  lines.append('MiB/step: all-gather output, reduce-scatter input, others result size. wire: what '
               'each device sends (ring): 2(n-1)/n x all-reduce, (n-1)/n x all-gather / '
               'reduce-scatter / all-to-all. ratio = measured wire / expected.')
  lines.append('expected (analytical minimum):')
  lines += [f'  [{e.kind}] {_mb(e.wire_bytes)} MiB: {e.note}' for e in report.expected] or ['  none']
  looped = sum(1 for o in s.ops if o.executions != 1)
  lines.append(f'{looped} of {len(s.ops)} collective instructions run more than once per step '
               '(inside while loops: counted x trip count).')
  if s.unknown_trip_loops:
    lines.append(f'WARNING: unknown trip count for {", ".join(s.unknown_trip_loops)}; '
                 'their collectives are counted once.')
  reduced = s.per_step('all-reduce')
  # (Gradient-sized all-reduces only: the loss's scalar sums are in every program.)
  if not report.gpu and reduced['wire'] > 0.1 * report.expected_wire('reduce-scatter') > 0 \
      and not report.expected_wire('all-reduce'):
    # XLA:CPU has no pass that turns all-reduce + dynamic-slice into a
    # reduce-scatter (XLA:GPU's ReduceScatterCreator): the FSDP gradients
    # of such a program are all-reduced whole.
    some = 'no reduce-scatter in the HLO' if not s.per_step('reduce-scatter')['static'] else \
        f'{reduced["static"]:g} all-reduce instructions where the minimum has none'
    lines.append(f'note: {some}: this backend reduces the FSDP gradients with all-reduce + slice (2x the '
                 f'reduce-scatter wire bytes, counted under all-reduce; as reduce-scatters '
                 f'{_mb(reduced["wire"] / 2)} MiB). A GPU compile reduce-scatters them: --target h100:8 '
                 'compiles the GPU\'s program without a GPU.')
  gathers = s.of_kind('all-gather')
  widened = [o for o in gathers if o.widened_from]
  if widened:
    exp = report.expected_wire('all-gather')
    wire = sum(o.executions * o.program_wire_bytes for o in gathers)
    lines.append(
        f'note: {len(widened)} of {len(gathers)} all-gather instructions move f32 values that the '
        f'program cast to {widened[0].widened_from} on each shard before gathering: this backend '
        'has no 16-bit collectives and widens them to f32 after partitioning (a GPU gathers them '
        f'in {widened[0].widened_from}). At the program\'s dtypes the all-gathers send '
        f'{_mb(wire)} MiB per device' + (f', ratio {wire / exp:.2f}.' if exp else '.'))
  # Large f32 gathers that nothing widened: weights gathered before their cast.
  # (Norm scales and biases stay f32 on purpose: the norms compute in f32.)
  unwidened = [o for o in gathers if not o.widened_from and any(
      a.dtype == 'f32' and len(a.dims) >= 2 for a in o.arrays)]
  if report.compute_dtype != 'f32' and unwidened:
    lines.append(f'note: {len(unwidened)} all-gather instructions move f32 matrices where the '
                 'expectation assumes the compute dtype: weights gathered before their cast '
                 f'(2x the bytes), e.g. {unwidened[0].op_name or unwidened[0].name}.')
  lines.append('')
  lines.append(format_top(s))
  lines.append('')
  lines.append(format_memory(report.memory))
  return '\n'.join(lines)


def _arrays(arrays: list[hlo_text.Array]) -> str:
  text = lambda a: f'{a.dtype}[{",".join(map(str, a.dims))}]'
  big = [a for a in arrays if a.dims] or arrays
  if len(big) <= 2:
    return ' '.join(text(a) for a in big)
  return f'{len(arrays)} arrays, largest {text(max(big, key=lambda a: a.bytes))}'


def format_top(stats: CommStats, n: int = 8) -> str:
  """The n collectives that send the most bytes per step, traced back to JAX ops."""
  ops = sorted(stats.ops, key=lambda o: -o.executions * o.wire_bytes)[:n]
  lines = [f'largest {len(ops)} collectives (wire MiB per step = runs x wire MiB per run):']
  for o in ops:
    where = o.op_name.removeprefix('jit(train_step)/')
    where = where if len(where) <= 90 else where[:87] + '...'
    lines.append(f'  {o.kind:<18} {o.executions:>4g} x {_mb(o.wire_bytes):>9} = '
                 f'{_mb(o.executions * o.wire_bytes):>9}  n={o.group_size or "-"}  '
                 f'{_arrays(o.arrays)}  {where}')
  return '\n'.join(lines)


def format_memory(stats: Optional[dict[str, int]]) -> str:
  """`memory_stats` as a table (GiB, or MiB below 1 GiB)."""
  if stats is None:
    return 'memory analysis: not available on this backend'
  gib = lambda x: f'{x / 2**30:,.2f} GiB' if x >= 2**30 else f'{x / MiB:,.1f} MiB'
  names = {'argument_size_in_bytes': 'arguments (state + batch)',
           'output_size_in_bytes': 'outputs', 'alias_size_in_bytes': 'aliased (donated, reused)',
           'temp_size_in_bytes': 'temporaries (activations, buffers)',
           'generated_code_size_in_bytes': 'generated code',
           'total': 'total = args + outputs - aliased + temp + code'}
  w = max(len(v) for v in names.values())
  lines = ['memory analysis of the compiled step, per device:']
  lines += [f'  {names[k].ljust(w)}  {gib(stats[k]).rjust(14)}' for k in (*MEMORY_FIELDS, 'total')]
  return '\n'.join(lines)


# ----------------------------------------------------------------------------
# Schedule: is anything computed while a collective is in flight?
# ----------------------------------------------------------------------------

# Instructions that do work on the device between a collective's start and done.
_COMPUTE = ('fusion', 'dot', 'convolution', 'custom-call', 'while', 'call', 'conditional')


@dataclasses.dataclass(frozen=True)
class Scheduled:
  """One collective as the scheduled HLO orders it.

  Attributes:
    name, kind, computation: the collective (its `-start` for an async pair).
    mode: 'overlapped' (compute scheduled between start and done), 'exposed'
      (an async pair with nothing to hide behind) or 'synchronous' (no
      start/done pair: the backend runs it as one blocking op).
    compute_between: compute instructions scheduled between start and done.
    matmuls_between: how many of those run a matrix product: a collective
      with one behind it is hidden by real work (FSDP's next-layer gather
      behind this layer's matmuls), not only by elementwise kernels.
    axes: the mesh axes its devices differ along ('tensor', 'data+fsdp',
      ...), from its replica groups or source-target pairs; None when the
      mesh is not given or the groups are in a form not decoded here.
  """
  name: str
  kind: str
  computation: str
  mode: str
  compute_between: int
  axes: Optional[str] = None
  matmuls_between: int = 0


def _replica_groups(attrs: str, n: int) -> Optional[list[list[int]]]:
  """The partition groups of a collective from XLA's printed forms: explicit
  `{{0,1},{2,3}}`, iota `[G,S]<=[dims]T(perm)`, `{}` (everyone); for a
  collective-permute, its source-target pairs. None for other forms."""
  pairs = re.search(r'source_target_pairs=\{(.*?)\}\}', attrs)
  if pairs:
    return [[int(x) for x in g.split(',')] for g in re.findall(r'\{([\d,\s]+)', pairs.group(1) + '}')]
  m = re.search(r'replica_groups=', attrs)
  if not m:
    return None
  rest = attrs[m.end():]
  if rest.startswith('{}'):
    return [list(range(n))]
  if rest.startswith('{{'):
    body = rest[1:rest.index('}}') + 1]
    return [[int(x) for x in g.split(',') if x.strip()] for g in re.findall(r'\{([^}]*)\}', body)]
  iota = re.match(r'\[(\d+),(\d+)\]<=\[([\d,]+)\](T\(([\d,]+)\))?', rest)
  if iota:
    dims = [int(x) for x in iota.group(3).split(',')]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if iota.group(5):
      ids = ids.transpose([int(x) for x in iota.group(5).split(',')])
    return ids.reshape(int(iota.group(1)), int(iota.group(2))).tolist()
  named = re.match(r"mesh\[([^\]]*)\](,\s*device_ids=\(([^)]*\)?)\))?(\s*\{([^}]*)\})?", rest)
  if named:
    # mesh['axis_0'=4,'axis_1'=2] {'axis_1'}: groups along the listed axes
    # of a printed mesh, whose positions hold the partitions `device_ids`
    # lists (an iota, possibly transposed; default 0, 1, 2, ...).
    sizes = [(k, int(v)) for k, v in re.findall(r"'?([\w]+)'?\s*=\s*(\d+)", named.group(1))]
    chosen = re.findall(r"'?([\w]+)'?", named.group(5) or '') if named.group(4) else [k for k, _ in sizes]
    total = math.prod(v for _, v in sizes)
    if total != n:
      return None
    ids = np.arange(total)
    if named.group(3):
      spec = named.group(3)
      iota = re.fullmatch(r'\[([\d,]+)\](T\(([\d,]+)\))?', spec.strip())
      if iota:
        dims = [int(x) for x in iota.group(1).split(',')]
        ids = np.arange(total).reshape(dims)
        if iota.group(3):
          ids = ids.transpose([int(x) for x in iota.group(3).split(',')])
        ids = ids.reshape(-1)
      else:
        try:
          ids = np.array([int(x) for x in spec.split(',') if x.strip()])
        except ValueError:
          return None
    ids = ids.reshape([v for _, v in sizes] or [1])
    keep = [i for i, (k, _) in enumerate(sizes) if k in chosen]
    rest_axes = [i for i in range(len(sizes)) if i not in keep]
    group = math.prod(sizes[i][1] for i in keep)
    return ids.transpose(rest_axes + keep).reshape(-1, group).tolist()
  return None


def collective_axes(attrs: str, mesh: Mapping[str, int]) -> Optional[str]:
  """The mesh axes a collective's devices differ along, e.g. 'tensor'.

  Partition ids number the mesh's devices in row-major order of its axes
  (`mesh` in its own axis order), so a group's coordinates say which axes
  it spans: an all-reduce over 'tensor' is tensor parallelism's, an
  all-gather over 'fsdp' FSDP's weight gather, and so on.
  """
  shape = [int(v) for v in mesh.values()]
  groups = _replica_groups(attrs, math.prod(shape))
  if not groups:
    return None
  coords = np.array(np.unravel_index(np.arange(math.prod(shape)), shape)).T   # partition -> coordinates
  spans = set()
  for g in groups:
    if not g or max(g) >= len(coords):
      return None
    c = coords[g]
    spans |= {a for a, col in zip(mesh, c.T) if len(set(col.tolist())) > 1}
  named = [a for a in mesh if a in spans]
  return '+'.join(named) if named else 'none'


def _async_kind(module: Module, inst: Instruction) -> Optional[str]:
  """The collective an async start begins ('all-gather-start', or an
  `async-start` wrapping a collective), else None."""
  if inst.opcode.endswith('-start') and inst.opcode[:-len('-start')] in KINDS:
    return inst.opcode[:-len('-start')]
  if inst.opcode == 'async-start':
    called = re.search(r'calls=%?([\w.\-]+)', inst.attrs)
    for sub in module.computations.get(called.group(1), []) if called else []:
      if sub.opcode in KINDS:
        return sub.opcode
  return None


def schedule(text: str, mesh: Optional[Mapping[str, int]] = None) -> list[Scheduled]:
  """Every collective of a compiled module's text with what is scheduled
  between its start and done (instruction order of a scheduled module), and
  with `mesh` (axis sizes in the mesh's order) the axes each one spans."""
  module = hlo_text.parse_module(text)
  counts, _ = hlo_text.execution_counts(module)
  wrapped = {m.group(1) for insts in module.computations.values() for inst in insts
             if inst.opcode == 'async-start' for m in [re.search(r'calls=%?([\w.\-]+)', inst.attrs)] if m}
  out = []
  for comp, insts in module.computations.items():
    if not counts.get(comp) or comp in wrapped:
      continue   # never runs, or the inside of an async pair (listed at its start)
    for i, inst in enumerate(insts):
      kind = _async_kind(module, inst)
      if kind is None:
        if inst.opcode in KINDS:
          out.append(Scheduled(inst.name, inst.opcode, comp, 'synchronous', 0, _axes_of(module, inst, mesh)))
        continue
      between = matmuls = 0
      for later in insts[i + 1:]:
        if inst.name in later.operands and (later.opcode.endswith('-done') or later.opcode == 'async-done'):
          break
        if later.opcode in _COMPUTE and _async_kind(module, later) is None:
          between += 1
          matmuls += _is_matmul(module, later)
      out.append(Scheduled(inst.name, kind, comp, 'overlapped' if between else 'exposed', between,
                           _axes_of(module, inst, mesh), matmuls))
  return out


_GEMM_TARGET = re.compile(r'custom_call_target="[^"]*(gemm|matmul|cublas)', re.IGNORECASE)


def _is_matmul(module: Module, inst: Instruction, depth: int = 0) -> bool:
  """Whether `inst` runs a matrix product: a dot or convolution, a GEMM
  library call (cuBLAS), or a fusion / call / conditional / loop around one
  (XLA:GPU's Triton `gemm_fusion`s, CPU dot fusions, a 1F1B stage's branch)."""
  if inst.opcode in ('dot', 'convolution'):
    return True
  if inst.opcode == 'custom-call':
    return bool(_GEMM_TARGET.search(inst.attrs))
  if inst.opcode in ('fusion', 'call', 'conditional', 'while') and depth < 4:
    return any(_is_matmul(module, sub, depth + 1)
               for name in _called(inst) for sub in module.computations.get(name, []))
  return False


def _called(inst: Instruction) -> list[str]:
  """The computations a fusion, call, conditional (each branch) or while
  (its body) runs."""
  names = re.findall(r'(?:calls|to_apply|body|true_computation|false_computation)=%?([\w.\-]+)', inst.attrs)
  branches = re.search(r'branch_computations=\{([^}]*)\}', inst.attrs)
  if branches:
    names += [b.strip().lstrip('%') for b in branches.group(1).split(',') if b.strip()]
  return names


def _axes_of(module: Module, inst: Instruction, mesh: Optional[Mapping[str, int]]) -> Optional[str]:
  if not mesh:
    return None
  attrs = inst.attrs
  if inst.opcode == 'async-start':   # the groups are on the wrapped collective
    called = re.search(r'calls=%?([\w.\-]+)', attrs)
    for sub in module.computations.get(called.group(1), []) if called else []:
      if sub.opcode in KINDS:
        attrs = sub.attrs
  return collective_axes(attrs, mesh)


def format_schedule(items: list[Scheduled], platform: str = '') -> str:
  """Per kind: how many collectives overlap compute, run exposed, or block."""
  if not items:
    return 'schedule: no collectives'
  rows = [('kind', 'over', 'overlapped', 'behind matmul', 'exposed', 'synchronous')]
  for kind in KINDS:
    for axes in sorted({s.axes or '?' for s in items if s.kind == kind}):
      mine = [s for s in items if s.kind == kind and (s.axes or '?') == axes]
      counts = [sum(s.mode == 'overlapped' for s in mine), sum(s.matmuls_between > 0 for s in mine),
                sum(s.mode == 'exposed' for s in mine), sum(s.mode == 'synchronous' for s in mine)]
      rows.append((kind, axes, *map(str, counts)))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = ['schedule of the compiled step (instruction order of the scheduled HLO): a collective is '
           'overlapped when compute is scheduled between its start and its done, behind a matmul '
           'when that compute includes a matrix product']
  lines += ['  ' + '  '.join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths)))
            for r in rows]
  lines.append('  over: the mesh axes its devices span (tensor: tensor/sequence parallelism, whose '
               'all-gathers and reduce-scatters collective matmul overlaps; fsdp: weight gathers and '
               'gradient reduce-scatters; data: gradient all-reduce; pipeline: stage shifts)')
  if all(s.mode == 'synchronous' for s in items):
    lines.append(f'note: every collective is synchronous{" on " + platform if platform else ""}: this '
                 'backend has no asynchronous collectives, so nothing can overlap them. The overlap '
                 'techniques (latency-hiding scheduler, collective matmul, FSDP prefetch) show on a '
                 'GPU compile: mjax-report comm --target h100:8 compiles for GPUs without one.')
  exposed = [s for s in items if s.mode == 'exposed']
  if exposed:
    lines.append(f'exposed, e.g.: {", ".join(s.name for s in exposed[:4])}')
  return '\n'.join(lines)
