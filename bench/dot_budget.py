"""The train step's matrix products, each timed alone: what they cost, and the MFU they leave room for.

  python bench/dot_budget.py --gin_file configs/base.gin [--gin.X=Y ...]
  python bench/dot_budget.py --gin_file configs/125m.gin --gin.DataConfig.seq_len=2048   # on a GPU

Compiles the train step on one device and takes every matrix product of the compiled
program (a `dot` anywhere, inside fusions too, and cuBLAS calls on a GPU),
with how often it runs per step (scanned layers by their trip count), and
times each distinct product alone on the same device: the same operand
shapes, dtypes and contracted and batch dimensions, one jitted dot_general,
the median of repeated calls. It times the step too (the median of --steps
calls), in --rounds rounds of the step and then every product, and takes
each figure's median over the rounds. The tables give, by product and by part of
the model:

  ms per step alone    what the step would take if it ran only its products,
                       each at the speed it reaches alone;
  GFLOP/s alone        the rate of that product on this device, against the
                       peak MFU divides by (a large square product).

and then the budget of the measured step: the products at their own speed,
and the rest (elementwise passes, reductions, the optimizer, copies, and
what running side by side costs). The "MFU ceiling" divides the step's
model FLOPs by the products' time alone: what MFU would be if nothing but
the products took time. A target above that ceiling needs faster products
(other shapes, fewer, or a faster library), not less work around them.

Alone means with its own operand layouts and nothing beside it: inside the
step a product may run slower (two ops sharing the cores on a CPU) or
faster (a fused producer). Products that run under 1 ms alone include the
call's own dispatch. cuDNN attention is a library kernel with no `dot` in
the program: on a GPU its time is in "the rest".
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mjax.parallel import hlo_text  # noqa: E402
from trace_summary import part_of  # noqa: E402

_DIMS = re.compile(r'\b(lhs_batch_dims|rhs_batch_dims|lhs_contracting_dims|rhs_contracting_dims)=\{([\d,]*)\}')
_GEMM_TARGET = re.compile(r'custom_call_target="(__cublas\$gemm|__cublas\$lt\$matmul[^"]*)"')
_BACKEND_DIMS = re.compile(r'"dot_dimension_numbers"\s*:\s*(\{[^}]*\})')


@dataclasses.dataclass(frozen=True)
class Product:
  """One distinct matrix product: operands, result dtype and dimension numbers."""
  lhs: hlo_text.Array
  rhs: hlo_text.Array
  out_dtype: str
  contracting: tuple[tuple[int, ...], tuple[int, ...]]
  batch: tuple[tuple[int, ...], tuple[int, ...]]

  @property
  def out_dims(self) -> tuple[int, ...]:
    (lc, rc), (lb, rb) = self.contracting, self.batch
    free = lambda a, skip: [d for i, d in enumerate(a.dims) if i not in skip]
    return (tuple(self.lhs.dims[i] for i in lb) + tuple(free(self.lhs, lc + lb))
            + tuple(free(self.rhs, rc + rb)))

  @property
  def flops(self) -> float:
    k = math.prod(self.lhs.dims[i] for i in self.contracting[0])
    return 2.0 * math.prod(self.out_dims) * k

  def label(self) -> str:
    (lc, rc), (lb, rb) = self.contracting, self.batch
    shape = lambda a: f'{a.dtype}[{",".join(map(str, a.dims))}]'
    dims = f'contract {list(lc)}x{list(rc)}' + (f', batch {list(lb)}x{list(rb)}' if lb else '')
    return f'{shape(self.lhs)} . {shape(self.rhs)} -> {self.out_dtype}[{",".join(map(str, self.out_dims))}] ({dims})'


def _np_dtype(hlo: str):
  """HLO's element type name as a jnp dtype: f32 -> float32, bf16 -> bfloat16, s8 -> int8."""
  import jax.numpy as jnp
  m = re.fullmatch(r'([fsu])(\d+)(.*)', hlo)
  if hlo == 'bf16' or not m:
    return jnp.dtype('bfloat16' if hlo == 'bf16' else hlo)
  kind, bits, rest = m.groups()
  return jnp.dtype({'f': 'float', 's': 'int', 'u': 'uint'}[kind] + bits + (f'_{rest}' if rest else ''))


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in text.split(',') if x.strip())


def _product(module: hlo_text.Module, inst: hlo_text.Instruction) -> Optional[Product]:
  """The matrix product an instruction computes, or None."""
  if inst.opcode == 'dot':
    dims = {k: _ints(v) for k, v in _DIMS.findall(inst.attrs)}
  elif inst.opcode == 'custom-call' and _GEMM_TARGET.search(inst.attrs):
    m = _BACKEND_DIMS.search(inst.attrs)
    if not m:
      return None
    raw = json.loads(m.group(1))
    dims = {f'{side}_{kind}_dims': tuple(int(x) for x in raw.get(f'{side}_{kind}_dimensions', []))
            for side in ('lhs', 'rhs') for kind in ('batch', 'contracting')}
  else:
    return None
  operands = [module.instruction(o) for o in inst.operands[:2]]
  if len(operands) < 2 or any(o is None or not isinstance(o.shape, hlo_text.Array) for o in operands):
    return None
  out = hlo_text.shape_arrays(inst.shape)[0]   # a cuBLAS call returns (result, workspace)
  return Product(operands[0].shape, operands[1].shape, out.dtype,
                 (dims.get('lhs_contracting_dims', ()), dims.get('rhs_contracting_dims', ())),
                 (dims.get('lhs_batch_dims', ()), dims.get('rhs_batch_dims', ())))


def products(text: str) -> tuple[dict[tuple[Product, str], float], list[str]]:
  """{(product, part of the step): runs per step} of an optimized HLO module,
  and the loops whose trip count could not be read (counted once)."""
  module = hlo_text.parse_module(text)
  counts, unknown = hlo_text.execution_counts(module)
  out: dict[tuple[Product, str], float] = collections.defaultdict(float)
  for comp, insts in module.computations.items():
    n = counts.get(comp, 0.0)
    if not n:
      continue
    for inst in insts:
      p = _product(module, inst)
      if p is not None:
        out[(p, part_of(hlo_text.op_name(inst, module), matmul=True))] += n
  return dict(out), unknown


def time_product(p: Product, min_seconds: float = 0.2, max_calls: int = 50) -> float:
  """Median seconds of one call of this product alone on the default device."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  def operand(a: hlo_text.Array, seed: int):
    x = np.random.default_rng(seed).standard_normal(a.dims, dtype=np.float32)
    return jax.device_put(jnp.asarray(x, dtype=_np_dtype(a.dtype)))

  lhs, rhs = operand(p.lhs, 0), operand(p.rhs, 1)
  fn = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (p.contracting, p.batch),
                                                preferred_element_type=_np_dtype(p.out_dtype)))
  jax.block_until_ready(fn(lhs, rhs))
  jax.block_until_ready(fn(lhs, rhs))
  times, spent = [], 0.0
  while len(times) < 5 or (spent < min_seconds and len(times) < max_calls):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(lhs, rhs))
    times.append(time.perf_counter() - t0)
    spent += times[-1]
  return statistics.median(times)


def budget(rows: dict[tuple[Product, str], float], seconds: dict[Product, float], step_s: float,
           model_flops: float, peak: float) -> str:
  """The tables, from runs per step, each product's time alone and the step's time."""
  lines = ['| product | part of the step | runs per step | GFLOP per step | ms per run alone | '
           'GFLOP/s alone | ms per step alone |', '|---|---|---|---|---|---|---|']
  by_part: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
  ordered = sorted(rows.items(), key=lambda kv: -kv[1] * seconds[kv[0][0]])
  for (p, part), n in ordered:
    s = seconds[p]
    by_part[part][0] += n * p.flops
    by_part[part][1] += n * s
    lines.append(f'| `{p.label()}` | {part} | {n:g} | {n * p.flops / 1e9:.2f} | {s * 1e3:.2f} | '
                 f'{p.flops / s / 1e9:.0f} | {n * s * 1e3:.1f} |')
  flops = sum(f for f, _ in by_part.values())
  alone = sum(t for _, t in by_part.values())
  lines += ['', '| part of the step | GFLOP per step | ms per step alone | GFLOP/s alone | '
            'share of the measured step |', '|---|---|---|---|---|']
  for part, (f, t) in sorted(by_part.items(), key=lambda kv: -kv[1][1]):
    lines.append(f'| {part} | {f / 1e9:.2f} | {t * 1e3:.1f} | {f / t / 1e9:.0f} | {t / step_s:.1%} |')
  lines.append(f'| **all matrix products** | {flops / 1e9:.2f} | {alone * 1e3:.1f} | {flops / alone / 1e9:.0f} | '
               f'{alone / step_s:.1%} |')
  lines.append(f'| **the rest of the step** (measured step - products alone) | | '
               f'{(step_s - alone) * 1e3:.1f} | | {(step_s - alone) / step_s:.1%} |')
  lines += ['', f'measured step: {step_s * 1e3:.1f} ms; model FLOPs per step {model_flops / 1e9:.2f} G '
            f'(the program\'s products: {flops / 1e9:.2f} G, with rematerialized and masked work); '
            f'peak {peak / 1e9:,.0f} GFLOP/s',
            f'MFU measured: {model_flops / step_s / peak:.1%}; MFU ceiling (only the products, each at its '
            f'speed alone): {model_flops / alone / peak:.1%}; the products at the peak: '
            f'{model_flops / flops:.1%}']
  return '\n'.join(lines)


def main(argv=None) -> int:
  import jax
  from mjax import data as data_lib
  from mjax import flags
  from mjax.devices import peak_flops
  from mjax.model.flops import flops_per_token
  from mjax.parallel import make_mesh
  from mjax.train import make_program

  p = argparse.ArgumentParser('dot_budget', description=__doc__.splitlines()[0])
  p.add_argument('--gin_file', action='append', default=[])
  p.add_argument('--gin_param', action='append', default=[])
  p.add_argument('--steps', type=int, default=10, help='calls of the step timed per round (median)')
  p.add_argument('--rounds', type=int, default=3, help='rounds of the step and then every product (median)')
  args, bindings = flags.parse(p, sys.argv[1:] if argv is None else argv)
  cfg = flags.load(flags.gin_files(args), [*bindings, 'MeshConfig.data = 1'], num_devices=1)
  devices = jax.devices()[:1]
  program = make_program(cfg, make_mesh(cfg.mesh, devices=devices))
  batch = program.to_global(next(data_lib.make_train_iterator(cfg.data, cfg.train.global_batch_size)))
  rows, unknown = [], []
  with program.context():
    state = program.init(jax.random.key(0))
    step = program.step.lower(state, batch).compile()   # the program timed is the one read
    rows, unknown = products(step.as_text())
    distinct = sorted({prod for prod, _ in rows}, key=lambda prod: prod.label())

    def time_step(n: int) -> float:
      nonlocal state
      times = []
      for _ in range(n):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
      return statistics.median(times)

    time_step(2)   # warm up
    # Rounds alternate the step and its products, so that a machine whose
    # speed drifts (a shared host) moves both alike; each figure is the
    # median over rounds.
    step_rounds, product_rounds = [], collections.defaultdict(list)
    for _ in range(args.rounds):
      step_rounds.append(time_step(args.steps))
      for prod in distinct:
        product_rounds[prod].append(time_product(prod))
  step_s = statistics.median(step_rounds)
  seconds = {prod: statistics.median(ts) for prod, ts in product_rounds.items()}
  tokens = cfg.train.global_batch_size * cfg.data.seq_len
  peak, source = peak_flops(devices, cfg.model.dtype, cfg.train.peak_cache_dir)
  m = cfg.model
  print(f'\ndot budget ({args.rounds} rounds): {devices[0].device_kind}, d_model {m.d_model}, {m.n_layers} layers, seq {cfg.data.seq_len}, '
        f'batch {cfg.train.global_batch_size}, {m.dtype}, remat {m.remat_policy!r}, scan {m.scan_layers}, '
        f'attention {m.attention_impl!r}; jax {jax.__version__}; peak: {source}\n')
  print(budget(rows, seconds, step_s, flops_per_token(m, cfg.data.seq_len) * tokens, peak))
  if unknown:
    print(f'note: {len(unknown)} loop(s) of unknown trip count, their products counted once: {", ".join(unknown)}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
