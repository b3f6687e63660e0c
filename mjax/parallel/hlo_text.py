"""Reading optimized HLO text: computations, instructions, shapes, and how
often each computation runs per call of the module.

Only what a communication report needs is parsed: every instruction's name,
result shape, opcode, operand names and attribute text, and the computations
each instruction calls. The text is `jax.stages.Compiled.as_text()`, i.e. the
module after XLA's optimization passes, the one that actually runs.

Execution counts: ENTRY runs once; a while body runs its trip count times per
execution of the while (nested loops multiply); every other called
computation (fusions, async wrappers, reducers, conditional branches) runs
once per execution of its caller. Limits:
  * Trip count: the while's `backend_config` `known_trip_count` (XLA's loop
    analysis writes it for scans), else the loop condition when it is
    `compare(counter, constant N), direction=LT` (counter assumed to start at
    0 and step by 1), else unknown: counted once and reported as unknown.
  * Both branches of a conditional are counted, as if both ran (an upper bound).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Union

# Bytes per element (sub-byte types rounded up to their storage in XLA buffers).
DTYPE_BYTES = {
    'pred': 1, 's4': 0.5, 'u4': 0.5, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 's32': 4, 'u32': 4,
    's64': 8, 'u64': 8, 'f16': 2, 'bf16': 2, 'f32': 4, 'f64': 8, 'c64': 8, 'c128': 16,
    'f8e4m3fn': 1, 'f8e5m2': 1, 'f8e4m3fnuz': 1, 'f8e5m2fnuz': 1, 'f8e4m3b11fnuz': 1,
    'f8e4m3': 1, 'f8e3m4': 1, 'f8e8m0fnu': 1, 'f4e2m1fn': 0.5, 'token': 0,
}


@dataclasses.dataclass(frozen=True)
class Array:
  dtype: str
  dims: tuple[int, ...]

  @property
  def bytes(self) -> float:
    n = 1
    for d in self.dims:
      n *= d
    return n * DTYPE_BYTES.get(self.dtype, 4)


Shape = Union[Array, tuple]  # a tuple shape is a tuple of Shapes


def shape_bytes(shape: Shape) -> float:
  if isinstance(shape, Array):
    return shape.bytes
  return sum(shape_bytes(s) for s in shape)


def shape_arrays(shape: Shape) -> list[Array]:
  if isinstance(shape, Array):
    return [shape]
  return [a for s in shape for a in shape_arrays(s)]


_ARRAY = re.compile(r'([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?')
_COMMENT = re.compile(r'/\*.*?\*/')


def parse_shape(text: str, i: int = 0) -> tuple[Shape, int]:
  """Parses one shape starting at text[i]; returns (shape, index after it)."""
  while text.startswith(' ', i):
    i += 1
  if text.startswith('(', i):
    items, i = [], i + 1
    while True:
      while i < len(text) and text[i] in ' ,':
        i += 1
      if text.startswith('/*', i):
        i = text.index('*/', i) + 2
        continue
      if text.startswith(')', i):
        return tuple(items), i + 1
      item, i = parse_shape(text, i)
      items.append(item)
  m = _ARRAY.match(text, i)
  if not m:
    raise ValueError(f'no shape at {text[i:i + 40]!r}')
  dims = tuple(int(d.replace('<=', '')) for d in m.group(2).split(',') if d.strip())
  return Array(m.group(1), dims), m.end()


@dataclasses.dataclass
class Instruction:
  name: str
  shape: Shape
  opcode: str
  operands: list[str]
  args: str             # the raw text between the parentheses
  attrs: str            # everything after the operand list
  computation: str      # the computation it belongs to


@dataclasses.dataclass
class Module:
  computations: dict[str, list[Instruction]]
  entry: str
  header: str   # the `HloModule ...` line
  by_name: dict[str, Instruction] = dataclasses.field(default_factory=dict, repr=False)

  def __post_init__(self):
    # Instruction names are unique in a module, whatever computation they are in.
    self.by_name = {i.name: i for insts in self.computations.values() for i in insts}

  def instruction(self, name: str) -> Optional[Instruction]:
    return self.by_name.get(name)

  @property
  def num_partitions(self) -> int:
    m = re.search(r'num_partitions=(\d+)', self.header)
    r = re.search(r'replica_count=(\d+)', self.header)
    return max(int(m.group(1)) if m else 1, int(r.group(1)) if r else 1)


def _matching_paren(text: str, i: int) -> int:
  """Index just past the ')' matching the '(' at text[i]."""
  depth = 0
  for j in range(i, len(text)):
    c = text[j]
    if c == '(':
      depth += 1
    elif c == ')':
      depth -= 1
      if depth == 0:
        return j + 1
  return len(text)


_INST = re.compile(r'\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*')
_OPCODE = re.compile(r'\s*([a-z][a-z0-9\-]*)\(')
_OPERAND = re.compile(r'%([^\s,()]+)')


def _parse_instruction(line: str, computation: str) -> Optional[Instruction]:
  m = _INST.match(line)
  if not m:
    return None
  try:
    shape, i = parse_shape(line, m.end())
  except (ValueError, IndexError):
    return None
  op = _OPCODE.match(line, i)
  if not op:
    return None
  start = op.end() - 1
  end = _matching_paren(line, start)
  inside = line[start + 1:end - 1]
  operands = _OPERAND.findall(inside)
  return Instruction(m.group(1), shape, op.group(1), operands, inside, line[end:], computation)


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def op_name(inst: Instruction, module: Optional[Module] = None) -> str:
  """The JAX op an instruction comes from (its metadata's op_name), or ''.

  With `module`, a fusion without one of its own has its fused root's (or
  the last fused instruction's that has one): jaxlib 0.11 names a fusion
  only by its scheduling names, and its ops were left with no source."""
  m = _OP_NAME.search(inst.attrs)
  if m or module is None:
    return m.group(1) if m else ''
  for role, comp in called(inst):
    if role == 'calls' and comp in module.computations:
      for inner in reversed(module.computations[comp]):
        m = _OP_NAME.search(inner.attrs)
        if m:
          return m.group(1)
  return ''


def parse_module(text: str) -> Module:
  """Splits HLO text into computations of instructions."""
  computations: dict[str, list[Instruction]] = {}
  entry, header, current = '', '', None
  for raw in text.splitlines():
    line = raw.rstrip()
    if not line:
      continue
    if line.startswith('HloModule'):
      header = line
      continue
    if not line[0].isspace():
      if line.endswith('{'):
        words = line.split()
        is_entry = words[0] == 'ENTRY'
        current = (words[1] if is_entry else words[0]).lstrip('%')
        computations[current] = []
        if is_entry:
          entry = current
      elif line == '}':
        current = None
      continue
    if current is not None:
      inst = _parse_instruction(line, current)
      if inst is not None:
        computations[current].append(inst)
  if not entry and computations:
    entry = list(computations)[-1]  # XLA prints ENTRY last
  return Module(computations, entry, header)


_CALL_ONE = re.compile(
    r'\b(calls|to_apply|condition|body|true_computation|false_computation)=%?([\w.\-]+)')
_CALL_MANY = re.compile(r'\b(calls|branch_computations|called_computations)=\{([^}]*)\}')
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def called(inst: Instruction) -> list[tuple[str, str]]:
  """(role, computation) pairs an instruction calls."""
  out = [(k, v) for k, v in _CALL_ONE.findall(inst.attrs)]
  for k, group in _CALL_MANY.findall(inst.attrs):
    out += [(k, c.strip().lstrip('%')) for c in group.split(',') if c.strip()]
  return out


def trip_count(module: Module, loop: Instruction) -> Optional[int]:
  """Iterations of a while loop, or None when it cannot be read (see module doc)."""
  m = _TRIP.search(loop.attrs)
  if m:
    return int(m.group(1))
  cond = dict(called(loop)).get('condition')
  insts = module.computations.get(cond, [])
  if not insts:
    return None
  root = insts[-1]
  if root.opcode != 'compare' or 'direction=LT' not in root.attrs:
    return None
  for name in root.operands:
    src = module.instruction(name)
    if src is not None and src.opcode == 'constant' and re.fullmatch(r'\s*-?\d+\s*', src.args):
      return int(src.args)
  return None


def execution_counts(module: Module) -> tuple[dict[str, float], list[str]]:
  """Times each computation runs per execution of the module.

  Returns:
    (counts, loops with an unknown trip count).
  """
  counts: dict[str, float] = {module.entry: 1.0}
  unknown: list[str] = []
  # Callers before callees: a computation's count is complete (all its call
  # sites added) before it passes the count on.
  for comp in _topological(module):
    n = counts.get(comp, 0.0)
    if not n:
      continue
    for inst in module.computations.get(comp, []):
      if inst.opcode.endswith('-done') or inst.opcode.endswith('-update'):
        continue  # same wrapped computation as the matching -start
      for role, callee in called(inst):
        factor = 1.0
        if inst.opcode == 'while' and role == 'body':
          trips = trip_count(module, inst)
          if trips is None:
            unknown.append(inst.name)
          else:
            factor = float(trips)
        counts[callee] = counts.get(callee, 0.0) + n * factor
  return counts, unknown


def _topological(module: Module) -> list[str]:
  """Computations ordered callers before callees, starting at ENTRY."""
  edges = {c: {callee for inst in insts for _, callee in called(inst)}
           for c, insts in module.computations.items()}
  seen, post = set(), []

  def visit(c: str) -> None:
    stack = [(c, iter(sorted(edges.get(c, ()))))]
    seen.add(c)
    while stack:
      node, it = stack[-1]
      nxt = next((x for x in it if x not in seen), None)
      if nxt is None:
        stack.pop()
        post.append(node)
      else:
        seen.add(nxt)
        stack.append((nxt, iter(sorted(edges.get(nxt, ())))))

  visit(module.entry)
  return post[::-1]

