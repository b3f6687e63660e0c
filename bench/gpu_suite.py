"""The GPU suite: correctness on the GPU, then the MFU table, in one command.

  make bench-gpu                      # on a GPU machine (see the Makefile for the wheels)
  python bench/gpu_suite.py --smoke   # the same sections on CPU with tiny shapes

Sections, each independent (one failing never stops the next):
  attention  cuDNN flash attention (sliding window, segment ids, GQA) against
             the fp32 einsum reference, forward and gradients, bf16 tolerance;
             then its time at 1p3b's shape by window, against the work the
             window keeps (does the kernel skip the blocks it masks?).
  kernels    mjax's Pallas kernels (the GeLU backward's product and
             derivative, ModelConfig.gelu_backward_kernel; q's and k's
             product with rotary, ModelConfig.rotary_kernel) against fp32
             at 1p3b's shapes, each timed beside XLA's product and pass.
  train      `mjax-train` on 125m for 30 steps through the real CLI (data,
             async checkpoints, metrics.jsonl); the loss must fall.
  mfu        bench/train_bench.py on 125m and 1p3b at seq 2048, bf16, cuDNN
             attention, over remat policies, one process per row so that the
             peak HBM column belongs to that row alone.
  variants   the execution variants one GPU can run (scan or unrolled layers,
             remat policies, gradient accumulation, XLA attention) train the
             same model on the same batches: losses compared step by step.

  dots       (opt-in: --sections dots) bench/dot_budget.py on the best 1p3b
             row: every matrix product of the step timed alone, and the
             MFU ceiling they set.

--experiments adds MFU rows for XLA options under trial (EXPERIMENT_ROWS), and
times each kernel at other tilings (GELU_TILINGS, ROTARY_TILINGS) beside the
plain products: XLA's and jax's own Hopper matmul with no epilogue.
--baseline DIR runs every MFU row a second time in another source tree (the
code before a change, `make baseline REF=<commit>`), right after this one's.
Everything runs under one deadline (--budget_s); rows that do not fit are
reported as skipped. The tables go to stdout and, with --out DIR, to
DIR/gpu_suite.md and DIR/gpu_suite.json with every sub-process log.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, gin file, overrides[, 'profile'][, 'optional'][, {env var: value}]). The remat sweep finds the best
# policy per size; an 'optional' row is an experiment whose failure is reported but fails nothing;
# 'none' for 1p3b is expected to run out of memory on an 80 GB card and shows
# where the limit is.
MFU_ROWS = [
    ('125m remat=dots_no_batch', '125m.gin', ['ModelConfig.remat_policy=dots_no_batch', 'ModelConfig.scan_layers=True']),
    ('125m remat=none unrolled', '125m.gin', ['ModelConfig.remat_policy=none', 'ModelConfig.scan_layers=False']),
    ('1p3b remat=dots', '1p3b.gin', ['ModelConfig.remat_policy=dots', 'ModelConfig.scan_layers=True']),
    # The same row without the XLA overlap flags (latency-hiding scheduler,
    # pipelined collectives): on one GPU there is nothing to overlap, so the
    # pair shows what the flags cost or give the step itself. What they do
    # for FSDP / TP / pipeline collectives needs more GPUs: RESULTS.md has
    # the 8-GPU schedules instead. (The projections-joined ablation measured
    # 1.035-1.05x slower twice on 2026-11-23 and left the suite for this.)
    ('1p3b remat=dots overlap flags off', '1p3b.gin',
     ['ModelConfig.remat_policy=dots', 'ModelConfig.scan_layers=True', 'TrainConfig.xla_overlap_flags=False']),
    # (dots_attention with scanned layers ran as dots, 559.9-565.5 ms, in
    # every run of 2026-11-23/24: the scan copies the saved outputs.)
    ('1p3b remat=dots_attention unrolled', '1p3b.gin',
     ['ModelConfig.remat_policy=dots_attention', 'ModelConfig.scan_layers=False'], 'profile'),
    # Also the MLP's activation (+0.5 GiB a layer): the backward's weight
    # gradient of the MLP output reads it instead of recomputing the GeLU.
    ('1p3b remat=dots_attention_mlp unrolled', '1p3b.gin',
     ['ModelConfig.remat_policy=dots_attention_mlp', 'ModelConfig.scan_layers=False']),
    ('1p3b remat=full', '1p3b.gin', ['ModelConfig.remat_policy=full', 'ModelConfig.scan_layers=True']),
    # Tried on 2026-11-24 and left out, each against the dots_attention
    # unrolled row in the same call: cuBLASLt epilogues (520.1 against
    # 520.5 ms) and no recomputation in two micro-batches of 8, the same
    # optimizer batch (527.7 against 517.4 ms).
]
# XLA options that could move elementwise work into the matrix products,
# which the 1p3b step's profile says is what is left between ~55% and 60%
# MFU (bench/RESULTS.md). Opt-in (--experiments): each row compiles and
# trains 1p3b, ~1 minute, and a compiler crash in one of them fails nothing.
# Beside the best row: --mfu_rows 'dots_attention unrolled' --experiments.
_BEST = ['ModelConfig.remat_policy=dots_attention', 'ModelConfig.scan_layers=False']
# The same without the GeLU epilogue (configs/1p3b.gin turns it on): XLA's
# Triton GEMMs run where cuBLAS does not win the autotuning.
_PLAIN = [*_BEST, 'ModelConfig.gelu_epilogue=False']
EXPERIMENT_ROWS = [
    # configs/1p3b.gin runs the forward GeLU as its input product's cuBLASLt
    # GELU_AUX epilogue (ModelConfig.gelu_epilogue, layers.gelu_mlp), which
    # turns XLA's Triton GEMMs off (xla_flags.GELU_EPILOGUE_FLAGS). These two
    # rows take it apart: without it, and without it with Triton's GEMMs off
    # all the same. H100, 2026-11-27, one call: 504.2 and 502.9 ms against
    # 498.5 with it.
    ('1p3b dots_attention unrolled, GeLU epilogue off', '1p3b.gin', _PLAIN, 'optional'),
    ('1p3b dots_attention unrolled, GeLU epilogue off, Triton GEMMs off', '1p3b.gin',
     [*_PLAIN, 'TrainConfig.xla_extra_flags="--xla_gpu_enable_triton_gemm=false"'], 'optional'),
    # The MLP's activation kept as well (+0.5 GiB a layer at 16 sequences):
    # the backward reads GeLU(u) instead of computing it again (0.7% without
    # the epilogue on the H100, 2026-11-24, within that day's spread; with
    # it on an H200, 2026-11-28: 493.4 against 493.2 ms, 11.6 GiB more).
    ('1p3b dots_attention_mlp unrolled, GeLU epilogue', '1p3b.gin',
     ['ModelConfig.remat_policy=dots_attention_mlp', 'ModelConfig.scan_layers=False'], 'optional'),
    # 125m.gin keeps its GeLU unfused until this row has been measured beside
    # the one without it (H200, 2026-11-28: 71.8 ms, 41.1%; the same card
    # ran no row without it, another one 71.2 ms on 2026-11-27).
    ('125m remat=none unrolled, GeLU epilogue', '125m.gin',
     ['ModelConfig.remat_policy=none', 'ModelConfig.scan_layers=False', 'ModelConfig.gelu_epilogue=True'],
     'optional'),
    # A pre-training batch nearer GPT-3 XL's (0.5M tokens where its paper
    # used 1M), in four slices of the suite's 16 sequences: LAMB and the
    # metrics (20.3 ms, 3.9% of the 16-sequence step; ~57 GB of fp32
    # passes) run once per 64 sequences, and the slices' gradient sums are
    # added inside the weight-gradient products (the table's excepted:
    # ~4 GB a slice). Measured on an H200 (2026-11-27, without the GeLU
    # epilogue): 484.7 ms per 16 sequences against 490.6, 57.3% to 58.0%
    # MFU, 59.8 GiB. On an H100 (2026-11-27): 493.3 ms without the epilogue
    # (57.0%), 488.4 ms with it (57.6%, 62.9 GiB).
    ('1p3b dots_attention unrolled, batch 64 in 4 slices', '1p3b.gin',
     [*_BEST, 'TrainConfig.global_batch_size=64', 'TrainConfig.grad_accum_steps=4'], 'optional'),
    # The backward's dy Wo^T and the GeLU's derivative as one Pallas kernel
    # (ModelConfig.gelu_backward_kernel, mjax/model/gelu_kernel.py): dg never
    # written, 1.07 GB a layer fewer (deviceless, 2026-11-29; ~8 ms of the
    # 16-sequence step at 3.1 TB/s) if the kernel's product keeps cuBLAS's
    # speed. Beside the best row: --mfu_rows '=1p3b remat=dots_attention
    # unrolled,=1p3b dots_attention unrolled, GeLU backward kernel' --experiments.
    ('1p3b dots_attention unrolled, GeLU backward kernel', '1p3b.gin',
     [*_BEST, 'ModelConfig.gelu_backward_kernel=True'], 'optional'),
    ('1p3b dots_attention unrolled, batch 64 in 4 slices, GeLU backward kernel', '1p3b.gin',
     [*_BEST, 'TrainConfig.global_batch_size=64', 'TrainConfig.grad_accum_steps=4',
      'ModelConfig.gelu_backward_kernel=True'], 'optional'),
    # q's and k's product with rotary as its epilogue (ModelConfig.rotary_kernel,
    # mjax/model/rotary_kernel.py): the forward's rotary pass gone, 2 x 0.29 GB
    # a layer in the H100 trace of 2026-11-28 (~4.5 ms of the 16-sequence
    # step), if the kernel's product keeps cuBLAS's speed. Then with the GeLU
    # backward kernel too, at the 64-sequence batch.
    ('1p3b dots_attention unrolled, rotary kernel', '1p3b.gin',
     [*_BEST, 'ModelConfig.rotary_kernel=True'], 'optional'),
    ('1p3b dots_attention unrolled, batch 64 in 4 slices, both kernels', '1p3b.gin',
     [*_BEST, 'TrainConfig.global_batch_size=64', 'TrainConfig.grad_accum_steps=4',
      'ModelConfig.gelu_backward_kernel=True', 'ModelConfig.rotary_kernel=True'], 'optional'),
    # Both of the above: the candidate for 60% on an H100 (bench/RESULTS.md,
    # "What stands between 1p3b and 60%"), if its ~76 GiB fits an 80 GB card.
    ('1p3b dots_attention_mlp unrolled, batch 64 in 4 slices', '1p3b.gin',
     ['ModelConfig.remat_policy=dots_attention_mlp', 'ModelConfig.scan_layers=False',
      'TrainConfig.global_batch_size=64', 'TrainConfig.grad_accum_steps=4'], 'optional'),
    # Slices of 32 sequences, for cards whose memory holds them (the
    # 16-sequence row's 50.8 GiB roughly doubles): larger products, and
    # LAMB once per 32 or 64 sequences. H200, 2026-11-27: 57.7% (86.0 GiB)
    # and 58.1% (101.5 GiB), against 57.3% for 16 sequences.
    ('1p3b dots_attention unrolled, batch 32', '1p3b.gin',
     [*_BEST, 'TrainConfig.global_batch_size=32'], 'optional'),
    ('1p3b dots_attention unrolled, batch 64 in 2 slices', '1p3b.gin',
     [*_BEST, 'TrainConfig.global_batch_size=64', 'TrainConfig.grad_accum_steps=2'], 'optional'),
    # No recomputation at all, unrolled: the backward reads every activation
    # instead of recomputing the layers' non-matmul work. It runs out of
    # memory on an 80 GB card at 16 sequences (two slices of 8 ran 527.7 ms
    # against 517.4 on the H100). A 141 GB H200 holds it (79.8 GiB): 491.3
    # against 490.6 ms for dots_attention (2026-11-27), recomputation free.
    ('1p3b remat=none unrolled', '1p3b.gin',
     ['ModelConfig.remat_policy=none', 'ModelConfig.scan_layers=False'], 'optional'),
    # Elementwise producers (GeLU, its derivative, norms) fused into the
    # consuming GEMM's operand reads. In a deviceless compile on jaxlib
    # 0.10.2 it takes the MLP's GeLU into the GEMMs of its forward and
    # backward (three kernels fewer for the MLP), and rotary's backward
    # compiles, but XLA crashes on the whole step (with either of the
    # attentions a deviceless compile can build). The GPU's jaxlib 0.11.2
    # compiles and trains it: 497.0 against 490.6 ms on an H200 (2026-11-27).
    ('1p3b dots_attention unrolled, GEMM fusion v2', '1p3b.gin',
     [*_PLAIN, 'TrainConfig.xla_extra_flags="--xla_gpu_experimental_gemm_fusion_v2=true"'], 'optional'),
    # Hopper warp specialization for XLA's own (Triton) GEMMs: they run the
    # layers' products in the backward (73.7 ms of the step) and forward (39.2).
    # H100, 2026-11-27: 502.0 against 501.8 ms, nothing (the GeLU epilogue
    # turns Triton's GEMMs off, so this row runs without it).
    ('1p3b dots_attention unrolled, Triton warp specialization', '1p3b.gin',
     [*_PLAIN, 'TrainConfig.xla_extra_flags="--xla_gpu_experimental_enable_triton_warp_specialization=true"'],
     'optional'),
    # Scanned layers (the default, and what models too deep to unroll need)
    # pay for the scan with copies: each saved matrix-product output is
    # copied into its stacked buffer and each sliced one back out (~26 and
    # ~15-21 GB per step at batch 8 in a deviceless count, beside ~14 GB of
    # zero-filled stacks; 1.06x against unrolled on the H100). Dynamic-slice
    # fusion lets cuBLAS write into and read from the stack in place. Beside
    # the '1p3b remat=dots' row (--mfu_rows '=1p3b remat=dots,dynamic-slice'
    # --experiments); a deviceless compile with jaxlib 0.10.2 fails
    # ("BufferAllocation::Slice not assigned"), the GPU's may not.
    ('1p3b remat=dots, dynamic-slice fusion', '1p3b.gin',
     ['ModelConfig.remat_policy=dots', 'ModelConfig.scan_layers=True',
      'TrainConfig.xla_extra_flags="--xla_gpu_enable_dynamic_slice_fusion=true"'],
     'optional'),
]
SMOKE_MFU_ROWS = [
    ('tiny remat=none', 'tiny.gin', ['ModelConfig.remat_policy=none']),
    ('tiny remat=full', 'tiny.gin', ['ModelConfig.remat_policy=full']),
]


class Suite:
  def __init__(self, args):
    self.args = args
    self.deadline = time.monotonic() + args.budget_s
    self.out = args.out or tempfile.mkdtemp(prefix='mjax-gpu-suite-')
    os.makedirs(self.out, exist_ok=True)
    self.results: dict = {'sections': {}}
    self.lines: list[str] = []

  def left(self) -> float:
    return self.deadline - time.monotonic()

  def say(self, line: str = '') -> None:
    print(line, flush=True)
    self.lines.append(line)

  def save(self) -> None:
    with open(os.path.join(self.out, 'gpu_suite.json'), 'w') as fh:
      json.dump(self.results, fh, indent=1, default=str)
    with open(os.path.join(self.out, 'gpu_suite.md'), 'w') as fh:
      fh.write('\n'.join(self.lines) + '\n')

  def section(self, name: str) -> None:
    """Runs one section in a child process (see `main`): a process that has
    touched the GPU keeps its memory (JAX pre-allocates 75% of the card), so
    the parent never does, and every section and MFU row starts on an empty card."""
    t0 = time.monotonic()
    path = os.path.join(self.out, f'section_{name}.json')
    argv = [sys.executable, os.path.abspath(__file__), '--child', name, *self.args.forward]
    rc, log = self.run(argv, f'section_{name}.log', timeout=self.left() + 30, quiet=False)
    try:
      with open(path) as fh:
        child = json.load(fh)
      ok, detail = child['ok'], child['detail']
      self.results[name] = child.get('results')
      self.results.update(child.get('more') or {})   # e.g. mfu_best, attention_windows
      self.lines += child.get('lines', [])
    except (OSError, ValueError):
      tail = '\n'.join(log.strip().splitlines()[-15:])
      ok, detail = False, f'exit {rc} without a result; log tail:\n{tail}'
    status = 'PASS' if ok else 'FAIL'
    self.results['sections'][name] = dict(ok=ok, detail=detail, seconds=time.monotonic() - t0)
    self.say(f'[{status}] {name} ({time.monotonic() - t0:.0f} s): {detail}')
    self.save()

  def env(self) -> dict:
    """Sub-process environment: the repository importable, and the card's
    memory for the run (JAX pre-allocates 75% by default)."""
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(p for p in (REPO, env.get('PYTHONPATH')) if p)
    env.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.92')
    env['PYTHONUNBUFFERED'] = '1'
    return env

  def run(self, argv: list[str], log_name: str, timeout: float, quiet: bool = True,
          env: Optional[dict] = None, tree: str = REPO) -> tuple[int, str]:
    """Runs argv with its output in OUT/log_name (and on stdout unless quiet);
    `env` adds to the environment (XLA_FLAGS are appended to); `tree`: the
    source tree it runs in and imports mjax from (a --baseline's)."""
    path = os.path.join(self.out, log_name)
    full_env = self.env()
    if tree != REPO:
      rest = [p for p in full_env['PYTHONPATH'].split(os.pathsep) if os.path.abspath(p) != REPO]
      full_env['PYTHONPATH'] = os.pathsep.join([tree, *rest])
    for k, v in (env or {}).items():
      full_env[k] = f'{full_env.get(k, "")} {v}'.strip() if k == 'XLA_FLAGS' else v
    with open(path, 'w') as log:
      # Its own process group: a timed-out section takes its MFU rows (which
      # hold the GPU) down with it.
      proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env,
                              cwd=tree, text=True, start_new_session=True)

      def kill_group():
        try:
          os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
      timer = threading.Timer(max(timeout, 1), kill_group)
      timer.start()
      for line in proc.stdout:
        log.write(line)
        if not quiet:
          print(line, end='', flush=True)
      rc = proc.wait()
      timed_out = not timer.is_alive()
      timer.cancel()
    with open(path) as fh:
      return (124 if timed_out else rc), fh.read()


# --- attention ---------------------------------------------------------------

def check_attention(suite: Suite):
  import jax
  import jax.numpy as jnp
  import numpy as np

  from mjax.model.attention import attend, fast_attention, reference_attention

  smoke = suite.args.smoke
  impl = None if smoke else 'cudnn'
  b, s = (2, 128) if smoke else (2, 2048)
  cases = []
  for heads, kv_heads, hd in ((8, 8, 64), (16, 4, 128)):
    for window in (None, s // 4):
      for segments in (False, True):
        cases.append((heads, kv_heads, hd, window, segments))
  rows, worst = [], 0.0
  rel = lambda a, r: float(jnp.linalg.norm((a - r).astype(jnp.float32)) /
                           jnp.linalg.norm(r.astype(jnp.float32)))
  tol = 2e-2  # bf16 operands: 1e-3 .. 1e-2 relative is the expected band
  for i, (h, kvh, hd, window, segments) in enumerate(cases):
    keys = jax.random.split(jax.random.key(100 + i), 4)
    q = jax.random.normal(keys[0], (b, s, h, hd), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, kvh, hd), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, kvh, hd), jnp.bfloat16)
    do = jax.random.normal(keys[3], (b, s, h, hd), jnp.bfloat16)
    seg = None
    if segments:  # three documents per row, boundaries differing between rows
      cuts = np.array([[s // 5, s // 2], [s // 3, 3 * s // 4]])
      seg = jnp.asarray((np.arange(s)[None, :, None] >= cuts[:, None, :]).sum(-1), jnp.int32)

    def loss(fn, q, k, v):
      return jnp.sum(fn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

    fast = lambda q, k, v: fast_attention(q, k, v, window, implementation=impl, segment_ids=seg)
    # The reference computes in fp32 from the same bf16 inputs.
    ref = lambda q, k, v: reference_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                              v.astype(jnp.float32), window, seg)
    out = jax.jit(fast)(q, k, v)
    out_ref = jax.jit(ref)(q, k, v)
    g = jax.jit(jax.grad(lambda *a: loss(fast, *a), argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.jit(jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2)))(q, k, v)
    errs = [rel(out, out_ref)] + [rel(a, r) for a, r in zip(g, g_ref)]
    finite = all(bool(jnp.all(jnp.isfinite(x))) for x in (out, *g))
    worst = max(worst, *errs) if finite else float('inf')
    hlo = jax.jit(fast).lower(q, k, v).as_text() if not smoke else ''
    used = 'cudnn' if ('cudnn' in hlo or '__cudnn' in hlo) else ('xla' if smoke else '?')
    # The default ('dot_product') must pick cuDNN by itself on this GPU.
    auto_hlo = jax.jit(lambda q, k, v: attend(q, k, v, window, 'dot_product', seg)).lower(q, k, v).as_text()
    if not smoke and 'cudnn' not in auto_hlo:
      used = "? ('dot_product' did not pick cuDNN)"
    rows.append(dict(heads=h, kv_heads=kvh, head_dim=hd, window=window, segments=segments,
                     out=errs[0], dq=errs[1], dk=errs[2], dv=errs[3], finite=finite, kernel=used))
  suite.say(f'\n### Attention on {jax.devices()[0].device_kind}: fast path vs fp32 reference, '
            f'batch {b}, seq {s}, bf16 inputs (relative error, tolerance {tol})\n')
  suite.say('| heads / kv | head_dim | window | segments | out | dq | dk | dv | kernel |')
  suite.say('|---|---|---|---|---|---|---|---|---|')
  for r in rows:
    suite.say(f'| {r["heads"]}/{r["kv_heads"]} | {r["head_dim"]} | {r["window"] or "full"} | '
              f'{"yes" if r["segments"] else "no"} | {r["out"]:.1e} | {r["dq"]:.1e} | '
              f'{r["dk"]:.1e} | {r["dv"]:.1e} | {r["kernel"]} |')
  suite.say()
  suite.results['attention'] = rows
  try:   # a measurement: its failure is reported, the correctness verdict stands
    suite.results['attention_windows'] = attention_window_times(suite, impl)
  except Exception as e:  # noqa: BLE001
    traceback.print_exc()
    suite.say(f'attention time by window: {type(e).__name__}: {str(e)[:300]}\n')
  ok = worst < tol and all(r['kernel'] == ('xla' if smoke else 'cudnn') for r in rows)
  return ok, f'{len(rows)} cases, worst relative error {worst:.2e} (tolerance {tol})'


def attention_window_times(suite: Suite, impl: Optional[str]) -> list[dict]:
  """Forward + backward time of the fast attention at 1p3b's shape, causal
  and with sliding windows. MFU counts only the keys a window keeps (1p3b's
  1024 of 2048: 75% of causal's work); if the kernel's time does not fall
  with the window, it computes the masked blocks too, and the difference is
  step time a block-skipping schedule would recover."""
  import jax
  import jax.numpy as jnp

  from mjax.model.attention import fast_attention
  from mjax.model.flops import average_keys

  smoke = suite.args.smoke
  b, s, h, hd = (2, 128, 4, 64) if smoke else (16, 2048, 16, 128)
  keys = jax.random.split(jax.random.key(7), 3)
  q, k, v = (jax.random.normal(key, (b, s, h, hd), jnp.bfloat16) for key in keys)
  rows = []
  for window in (None, s // 2, s // 4, s // 8):
    def loss(q, k, v, window=window):
      return jnp.sum(fast_attention(q, k, v, window, implementation=impl).astype(jnp.float32))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(step(q, k, v))
    times = []
    for _ in range(3 if smoke else 10):
      t0 = time.perf_counter()
      jax.block_until_ready(step(q, k, v))
      times.append(time.perf_counter() - t0)
    t = sorted(times)[len(times) // 2]
    work = 12 * h * hd * average_keys(s, window) * b * s     # mjax.model.flops' attention term
    rows.append(dict(window=window, ms=t * 1e3, tflops=work / t / 1e12,
                     work=average_keys(s, window) / average_keys(s, None)))
  full = rows[0]['ms']
  suite.say(f'\n### Attention time by window, {"xla" if smoke else "cuDNN"}, forward + backward, '
            f'batch {b}, seq {s}, {h} heads of {hd}, bf16 (median of {len(times)})\n')
  suite.say('| window | ms | work (kept keys) vs causal | time vs causal | TFLOP/s (kept keys) |')
  suite.say('|---|---|---|---|---|')
  for r in rows:
    suite.say(f'| {r["window"] or "causal"} | {r["ms"]:.2f} | {r["work"]:.0%} | {r["ms"] / full:.0%} | '
              f'{r["tflops"]:.3g} |')
  suite.say()
  return rows


# --- train -------------------------------------------------------------------

def check_train(suite: Suite):
  smoke = suite.args.smoke
  steps = 30
  workdir = tempfile.mkdtemp(prefix='mjax-gpu-train-')
  gin = 'tiny.gin' if smoke else '125m.gin'
  argv = [sys.executable, '-c', 'from mjax.cli import train_main; train_main()',
          '--gin_file', gin, '--workdir', workdir,
          f'--gin.TrainConfig.steps={steps}', '--gin.TrainConfig.log_every=1',
          '--gin.OptimConfig.warmup_steps=5', '--gin.TrainConfig.eval_every=0',
          '--gin.CheckpointConfig.save_every=15']
  if not smoke:
    argv.append('--gin.ModelConfig.attention_impl=cudnn')
  rc, log = suite.run(argv, 'train_125m.log', timeout=min(240, suite.left()))
  from mjax.metrics import read_metrics
  try:
    losses = [(m['step'], m['loss']) for m in read_metrics(workdir) if 'loss' in m]
  except OSError:
    losses = []
  suite.results['train'] = dict(rc=rc, losses=losses, workdir=workdir)
  if rc != 0 or len(losses) < 10:
    tail = '\n'.join(log.strip().splitlines()[-15:])
    return False, f'exit {rc}, {len(losses)} loss lines; log tail:\n{tail}'
  first = sum(l for _, l in losses[:3]) / 3
  last = sum(l for _, l in losses[-3:]) / 3
  ckpts = sorted(os.listdir(workdir))
  ok = last < first - 1.0 and all(l == l for _, l in losses)
  return ok, (f'{gin}: loss {first:.3f} (first 3 steps) -> {last:.3f} (last 3) in {steps} steps; '
              f'workdir holds {", ".join(ckpts)}')


# --- mfu ---------------------------------------------------------------------

def row_flags(overrides: list[str]) -> dict:
  """The XLA flags a row sets through TrainConfig.xla_extra_flags, {name: value}."""
  from mjax.parallel import xla_flags
  out = {}
  for o in overrides:
    if o.startswith('TrainConfig.xla_extra_flags='):
      out.update(xla_flags.parse_flags(o.split('=', 1)[1].strip('\'"')))
  return out


def select_rows(rows: list, spec: str) -> list:
  """The rows `spec` names: comma-separated substrings of their names, or
  =NAME for one row exactly (a name that others contain, '1p3b remat=dots').
  Row names hold ', ' themselves ('1p3b ..., GeLU epilogue off'), so only a
  comma without a space after it separates two selections."""
  if not spec:
    return rows
  return [r for r in rows if any(r[0] == sel[1:] if sel.startswith('=') else sel in r[0]
                                 for sel in re.split(r',(?! )', spec))]


def check_mfu(suite: Suite):
  rows = SMOKE_MFU_ROWS if suite.args.smoke else MFU_ROWS + (EXPERIMENT_ROWS if suite.args.experiments else [])
  rows = select_rows(rows, suite.args.mfu_rows)
  results = []
  from mjax.parallel import xla_flags
  # With --baseline, each row runs in this tree and then in the baseline's
  # (`make baseline REF=...`), one after the other on the same card: a
  # change judged against the code before it, not against another day's card.
  trees = [('', REPO)] + ([(' [baseline]', os.path.abspath(suite.args.baseline))]
                          if getattr(suite.args, 'baseline', None) else [])
  runs = [(i, row, label, tree) for i, row in enumerate(rows) for label, tree in trees]
  for i, (name, gin, overrides, *extra), label, tree in runs:
    name = name + label
    left = suite.left()
    if left < 45:
      results.append(dict(name=name, status='skipped (suite deadline)', baseline=bool(label)))
      continue
    wanted = row_flags(overrides)
    if wanted and set(wanted) - xla_flags.supported_flags(wanted):
      # mjax would drop the flag at start-up (XLA aborts on one it does not
      # define): the row would time the baseline under another name.
      results.append(dict(name=name, status='its XLA flag is not in this jaxlib'))
      suite.say(f'  {name}: {results[-1]["status"]}')
      continue
    tag = f'{i}_baseline' if label else f'{i}'
    jpath = os.path.join(suite.out, f'mfu_{tag}.json')
    argv = [sys.executable, os.path.join(tree, 'bench', 'train_bench.py'), '--gin_file', gin,
            '--steps', str(suite.args.steps), '--warmup', '2', '--name', name, '--json', jpath,
            *[f'--gin.{o}' for o in overrides]]
    if not suite.args.smoke:
      argv.append('--gin.ModelConfig.attention_impl=cudnn')
    if 'profile' in extra and suite.args.profile:
      argv += ['--profile', os.path.join(suite.out, f'profile_{tag}')]
    t0 = time.monotonic()
    limit = min(suite.args.row_timeout_s, left - 5)
    rc, log = suite.run(argv, f'mfu_{tag}.log', timeout=limit,
                        env=next((e for e in extra if isinstance(e, dict)), {}), tree=tree)
    wall = time.monotonic() - t0
    if rc == 0 and os.path.exists(jpath):
      with open(jpath) as fh:
        r = json.load(fh)
      r.update(name=name, status='ok', wall_s=wall)
    else:
      oom = 'RESOURCE_EXHAUSTED' in log or 'Out of memory' in log or 'out of memory' in log
      # A row cut by what was left of the suite's deadline says so: that is
      # no verdict on the row itself, which may only need a longer compile.
      cut_by = 'the suite deadline' if limit < suite.args.row_timeout_s else '--row_timeout_s'
      why = ('out of memory' if oom else
             f'timed out after {limit:.0f} s ({cut_by})' if rc == 124 else f'exit {rc}')
      r = dict(name=name, status=why, wall_s=wall,
               tail='\n'.join(log.strip().splitlines()[-8:]))
      if not oom:
        suite.say(f'  {name}: {why}; log tail:\n' + (r['tail'] or '(it printed nothing: still compiling)'))
    r['baseline'] = bool(label)
    results.append(r)
    suite.say(f'  {name}: {r["status"]}' + (f', MFU {r["mfu"]:.1%}, {r["tokens_per_sec"]:,.0f} tokens/s, '
                                            f'peak {r["mem"] / 2**30:.1f} GiB, {wall:.0f} s'
                                            if r['status'] == 'ok' else ''))
  suite.results['mfu'] = results
  done = [r for r in results if r['status'] == 'ok']
  dev = done[0]['devices'] if done else '?'
  suite.say(f'\n### MFU: {dev}, seq 2048, bf16, cuDNN attention, LAMB, real data '
            f'(stdlib bytes), {suite.args.steps} timed steps\n')
  # The last MFU column counts attention as Megatron-LM's formula does (every
  # key of the context, masked or not), the convention of MegaScale's and
  # most peers' published MFU: for comparison with them, never a target.
  suite.say('| config | batch x seq | tokens/s | step (ms) | GFLOP/token | TFLOP/s | MFU | peak HBM '
            '| MFU, attention counted dense |')
  suite.say('|---|---|---|---|---|---|---|---|---|')
  for r in results:
    if r['status'] != 'ok':
      suite.say(f'| {r["name"]} | | {r["status"]} | | | | | | |')
      continue
    dense = r.get('mfu_dense_attention')
    suite.say(f'| {r["name"]} | {r["batch"]} x {r["seq_len"]} | '
              f'{r["tokens_per_sec"]:,.0f} | {r["step_time"] * 1e3:.1f} | '
              f'{r["flops_per_token"] / 1e9:.2f} | {r["achieved"] / 1e12:.1f} | {r["mfu"]:.1%} | '
              f'{r["mem"] / 2**30:.1f} GiB | {"" if dense is None else f"{dense:.1%}"} |')
  suite.say(f'\npeak: {done[0]["peak_source"] if done else "?"}')
  best = {}
  for r in done:
    if r.get('baseline'):
      continue   # the code before: no verdict on this tree
    size = r['name'].split()[0]
    if r['mfu'] > best.get(size, {}).get('mfu', -1):
      best[size] = r
  suite.results['mfu_best'] = {k: dict(name=v['name'], mfu=v['mfu']) for k, v in best.items()}
  summary = '; '.join(f'{k}: {v["mfu"]:.1%} ({v["name"]})' for k, v in best.items())
  optional = {r[0] for r in rows if 'optional' in r[3:]}
  mine = [r for r in results if not r.get('baseline')]
  failed = [r['name'] for r in mine if r['status'] not in ('ok', 'out of memory')
            and not r['status'].startswith('skipped') and r['name'] not in optional]
  sizes = {r['name'].split()[0] for r in mine if not r['status'].startswith('skipped')}
  failed += [f'{size} (no row fits)' for size in sorted(sizes - set(best))]
  return bool(done) and not failed, f'best {summary or "none"}' + (
      f'; failed: {", ".join(failed)}' if failed else '')


# --- dots ---------------------------------------------------------------------

def check_dots(suite: Suite):
  """bench/dot_budget.py on the best 1p3b row: the step's matrix products
  each timed alone, and the MFU they leave room for. Whether the gap to the
  MFU target is in the GEMMs themselves or in the work around them."""
  gin, overrides = ('tiny.gin', ['ModelConfig.remat_policy=none']) if suite.args.smoke else ('1p3b.gin', _BEST)
  argv = [sys.executable, os.path.join(REPO, 'bench', 'dot_budget.py'), '--gin_file', gin,
          *[f'--gin.{o}' for o in overrides]]
  if not suite.args.smoke:
    argv.append('--gin.ModelConfig.attention_impl=cudnn')
  rc, log = suite.run(argv, 'dots.log', timeout=max(suite.left() - 5, 1))
  lines = log.splitlines()
  start = next((i for i, line in enumerate(lines) if line.startswith('dot budget')), None)
  if rc or start is None:
    return False, f'exit {rc}; log tail:\n' + '\n'.join(lines[-15:])
  suite.say(f'\n### Matrix products timed alone: {" ".join(["1p3b" if not suite.args.smoke else "tiny", *overrides])}\n')
  for line in lines[start:]:
    suite.say(line)
  ceiling = next((line for line in lines if line.startswith('MFU measured')), '')
  return True, ceiling


# --- kernels -----------------------------------------------------------------

def check_kernels(suite: Suite):
  """mjax's own Pallas kernels against what XLA runs without them, values
  against the fp32 reference at 1p3b's shapes and the two timed side by
  side: a kernel is worth its flag only where it is the faster.
  - the GeLU backward's product with its derivative
    (ModelConfig.gelu_backward_kernel, mjax/model/gelu_kernel.py) against
    the product dy Wo^T, then the elementwise pass that writes du and GeLU(u);
  - q's and k's product with rotary as its epilogue
    (ModelConfig.rotary_kernel, mjax/model/rotary_kernel.py) against the
    product, then rotary's pass.
  On CPU (--smoke) they run in Pallas's GPU interpreter at small shapes,
  values only."""
  import jax
  import jax.numpy as jnp

  from mjax.model import gelu_kernel as gk
  from mjax.model import layers
  from mjax.model import rotary_kernel as rk

  smoke = suite.args.smoke
  tol = 1e-2
  rel = lambda a, r: float(jnp.linalg.norm((a.astype(jnp.float32) - r.astype(jnp.float32)).ravel()) /
                           jnp.linalg.norm(r.astype(jnp.float32).ravel()))

  def timed(f, *args):
    out = jax.block_until_ready(f(*args))
    if smoke:
      return out, None
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
      last = f(*args)
    jax.block_until_ready(last)
    return out, (time.perf_counter() - t0) / reps * 1e3

  def report(title, columns, rows, flops):
    suite.say(f'\n### {title} on {jax.devices()[0].device_kind} (bf16; relative error against fp32, '
              f'tolerance {tol})\n')
    suite.say('| | ' + ' | '.join(columns) + ' | ms | product TFLOP/s |')
    suite.say('|---|' + '---|' * (len(columns) + 2))
    for r in rows:
      ms, speed = (f'{r["ms"]:.3f}', f'{flops / r["ms"] / 1e9:,.0f}') if r['ms'] else ('-', '-')
      suite.say(f'| {r["name"]} | ' + ' | '.join(f'{r[c]:.1e}' for c in columns) + f' | {ms} | {speed} |')
    if not smoke:
      suite.say(f'\nkernel / XLA time: {rows[0]["ms"] / rows[1]["ms"]:.3f}')

  # The GeLU backward: (du, GeLU(u)) from dy, Wo and u.
  m, n, k = (256, 512, 192) if smoke else (16 * 2048, 8192, 2048)   # 1p3b: tokens, d_ff, d_model
  tiles = gk.Tiles(tile_m=64, tile_n=64, tile_k=64, stages=2, epi_m=64, epi_n=32, band=2) if smoke \
      else gk.DEFAULT_TILES
  keys = jax.random.split(jax.random.key(7), 3)
  dy = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
  wo = (jax.random.normal(keys[1], (n, k), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
  u = (jax.random.normal(keys[2], (m, n), jnp.float32) * 2).astype(jnp.bfloat16)
  kernel = jax.jit(lambda dy, wo, u: gk.dgelu_product(dy, wo.T, u, True, tiles=tiles, interpret=smoke,
                                                      grid=3 if smoke else None))

  def xla(dy, wo, u):   # autodiff's two kernels, as layers.gelu_mlp runs them without the flag
    g, vjp = jax.vjp(lambda u: jax.nn.gelu(u, approximate=True), u)
    return vjp(jnp.einsum('te,fe->tf', dy, wo))[0], g
  ref_du, ref_g = jax.jit(lambda *a: gk.reference(*a, True))(dy, wo, u)
  gelu_rows = []
  for name, f in (('Pallas kernel (gelu_backward_kernel)', kernel), ('XLA: product, then the pass', jax.jit(xla))):
    (du, g), ms = timed(f, dy, wo, u)
    gelu_rows.append(dict(name=name, du=rel(du, ref_du), g=rel(g, ref_g), ms=ms))
  report(f'GeLU backward: (du, GeLU(u)) from dy {m}x{k}, Wo {n}x{k}, u {m}x{n}', ['du', 'g'], gelu_rows,
         2 * m * n * k)

  # Rotary: q and k rotated, from x, their kernels side by side, and positions.
  m, e, heads, hd = (256, 192, 8, 64) if smoke else (16 * 2048, 2048, 32, 128)   # 1p3b: q's 16 heads and k's
  rtiles = rk.Tiles(tile_m=64, tile_n=64, tile_k=64, stages=2, epi_m=64, epi_n=16, band=2) if smoke \
      else rk.tiles_for(hd)
  keys = jax.random.split(jax.random.key(8), 2)
  x = jax.random.normal(keys[0], (m, e), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (e, heads * hd), jnp.float32) * e ** -0.5).astype(jnp.bfloat16)
  positions = jnp.arange(m, dtype=jnp.int32) % 2048
  kernel = jax.jit(lambda x, w, p: rk.rotary_product(x, w, rk.tables(p, hd, 1e4), heads // 2 * hd, tiles=rtiles,
                                                     interpret=smoke, grid=3 if smoke else None))

  def xla_rope(x, w, p):   # q's product, k's, then rotary's pass, as the model runs them without the flag
    return tuple(layers.rotary((x @ part).reshape(1, m, heads // 2, hd), p[None], 1e4).reshape(m, -1)
                 for part in jnp.split(w, 2, axis=1))
  ref = jax.jit(lambda *a: rk.reference(*a, hd, 1e4))(x, w, positions)
  rope_rows = []
  for name, f in (('Pallas kernel (rotary_kernel)', kernel), ('XLA: products, then rotary', jax.jit(xla_rope))):
    out, ms = timed(f, x, w, positions)
    rope_rows.append(dict(name=name, q_k=rel(jnp.concatenate(out, axis=1), ref), ms=ms))
  report(f'Rotary: q and k from x {m}x{e}, W {e}x{heads * hd} ({heads} heads of {hd})', ['q_k'], rope_rows,
         2 * m * e * heads * hd)
  suite.say()
  suite.results['kernels'] = dict(gelu=gelu_rows, rotary=rope_rows)
  if getattr(suite.args, 'experiments', False):
    _kernel_tilings(suite, timed, rel, tiles, rtiles, gelu=(dy, wo, u, ref_du), rope=(x, w, positions, ref, hd))
  worst = max(gelu_rows[0]['du'], gelu_rows[0]['g'], rope_rows[0]['q_k'])   # the kernels' (XLA's rows compare)
  return worst < tol, f'kernels\' worst relative error {worst:.2e} (tolerance {tol})' + (
      f'; GeLU backward {gelu_rows[0]["ms"]:.3f} ms against XLA\'s {gelu_rows[1]["ms"]:.3f}, rotary '
      f'{rope_rows[0]["ms"]:.3f} against {rope_rows[1]["ms"]:.3f}' if not smoke else '')


# Tilings the kernels section times with --experiments, each a change of one
# or two of the default's fields; all of them lower for sm_90 (checked in a
# deviceless compile, tests/test_bench_suites.py) and fit the shared memory.
# The kernels' defaults are jax's own Hopper matmul's tiles; which of these a
# GPU runs fastest at 1p3b's shapes is what one call can tell.
GELU_TILINGS = [
    ('L2 bands of 4 tiles', dict(band=4)),
    ('L2 bands of 16 tiles', dict(band=16)),
    ('2 stages', dict(stages=2)),
    ('tile_k 32, 5 stages', dict(tile_k=32, stages=5)),
    ('warpgroup tiles 128 x 64, 4 stages', dict(tile_n=64, stages=4)),
    ('warpgroup tiles 128 x 64, 5 stages, epilogue 64 x 64', dict(tile_n=64, stages=5, epi_n=64)),
    ('epilogue sub-tiles 128 x 16', dict(epi_m=128, epi_n=16)),
    ('2 stages, epilogue sub-tiles 64 x 64', dict(stages=2, epi_n=64)),
]
ROTARY_TILINGS = [
    ('L2 bands of 4 tiles', dict(band=4)),
    ('L2 bands of 16 tiles', dict(band=16)),
    ('2 stages', dict(stages=2)),
    ('tile_k 32, 5 stages', dict(tile_k=32, stages=5)),
    ('epilogue sub-tiles 64 x 64', dict(epi_n=64)),
    ('epilogue sub-tiles 128 x 16', dict(epi_m=128, epi_n=16)),
]
# At the smoke shapes, in the interpreter: the sweep's own code, one tiling each.
SMOKE_TILINGS = [('L2 bands of 1 tile, 3 stages', dict(band=1, stages=3))]


def _kernel_tilings(suite: Suite, timed, rel, gelu_tiles, rope_tiles, *, gelu, rope):
  """Each kernel timed at other tilings, beside the plain products: XLA's
  (cuBLAS) and, on a GPU, jax's own Hopper matmul with no epilogue at the
  kernel's tiles. A kernel slower than XLA's product and pass is either its
  matmul (the Pallas matmul alone is as slow) or its epilogue (it is not):
  the table says which, and which tiling to make the default."""
  import dataclasses

  import jax
  import jax.numpy as jnp

  from mjax.model import gelu_kernel as gk
  from mjax.model import rotary_kernel as rk

  smoke = suite.args.smoke
  interp = dict(interpret=True, grid=3) if smoke else {}

  def pallas_matmul(a, b, t):
    # jax's own kernel, as the GPU's jax has it: a missing or changed API is a
    # row that says so, not a failed section.
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
    config = hm.TuningConfig(tile_m=t.tile_m, tile_n=t.tile_n, tile_k=t.tile_k, max_concurrent_steps=t.stages,
                             epi_tile_m=t.epi_m, epi_tile_n=64, grid_tile_width=t.band)
    return hm.matmul(a, b, None, config)

  def sweep(title, flops, default, variants, kernel, args, ref, product):
    rows = []
    candidates = [('default ' + str(default), default)]
    for name, change in (SMOKE_TILINGS if smoke else variants):
      candidates.append((name, dataclasses.replace(default, **change)))
    for name, t in candidates:
      try:
        out, ms = timed(jax.jit(functools.partial(kernel, tiles=t)), *args)
        rows.append(dict(name=name, error=rel(out, ref), ms=ms))
      except Exception as e:   # a tiling this GPU's lowering refuses: the others still run
        rows.append(dict(name=name, error=None, ms=None, failed=f'{type(e).__name__}: {str(e)[:160]}'))
    plain = [('XLA: the product alone', lambda a, b, t: a @ b)]
    if not smoke:
      plain.append(('jax\'s Hopper matmul alone, the default\'s tiles', pallas_matmul))
    for name, f in plain:
      try:
        _, ms = timed(jax.jit(functools.partial(f, t=default)), *product)
        rows.append(dict(name=name, error=None, ms=ms))
      except Exception as e:
        rows.append(dict(name=name, error=None, ms=None, failed=f'{type(e).__name__}: {str(e)[:160]}'))
    suite.say(f'\n### {title}: tilings (--experiments)\n')
    suite.say('| tiling | relative error | ms | TFLOP/s |')
    suite.say('|---|---|---|---|')
    for r in rows:
      err = f'{r["error"]:.1e}' if r['error'] is not None else ''
      ms, speed = (f'{r["ms"]:.3f}', f'{flops / r["ms"] / 1e9:,.0f}') if r.get('ms') else \
          (r.get('failed', '-'), '-')
      suite.say(f'| {r["name"]} | {err} | {ms} | {speed} |')
    return rows

  dy, wo, u, ref_du = gelu
  m, n, k = u.shape[0], u.shape[1], dy.shape[1]
  wo_t = jnp.asarray(wo.T)
  gelu_rows = sweep(f'GeLU backward, {m}x{k} by {k}x{n}', 2 * m * n * k, gelu_tiles, GELU_TILINGS,
                    lambda dy, wo_t, u, tiles: gk.dgelu_product(dy, wo_t, u, True, tiles=tiles, **interp)[0],
                    (dy, wo_t, u), ref_du, (dy, wo_t))
  x, w, positions, ref, hd = rope
  q_columns = w.shape[1] // 2
  cos_sin = rk.tables(positions, hd, 1e4)
  rope_rows = sweep(f'Rotary, {x.shape[0]}x{x.shape[1]} by {w.shape[0]}x{w.shape[1]}',
                    2 * x.shape[0] * w.shape[0] * w.shape[1], rope_tiles, ROTARY_TILINGS,
                    lambda x, w, cs, tiles: jnp.concatenate(
                        rk.rotary_product(x, w, cs, q_columns, tiles=tiles, **interp), axis=1),
                    (x, w, cos_sin), ref, (x, w))
  suite.say()
  suite.results['kernels'].update(gelu_tilings=gelu_rows, rotary_tilings=rope_rows)


# --- variants ----------------------------------------------------------------

def check_variants(suite: Suite):
  import jax
  import numpy as np

  smoke = suite.args.smoke
  base = ['ModelConfig.d_model = 256', 'ModelConfig.n_layers = 4', 'ModelConfig.n_heads = 4',
          'ModelConfig.d_ff = 1024', 'ModelConfig.vocab_size = 512',
          'ModelConfig.full_attention_every = 2', 'OptimConfig.warmup_steps = 2',
          'TrainConfig.steps = 100', 'OptimConfig.learning_rate = 1e-3']
  if smoke:
    base += ['DataConfig.seq_len = 128', 'ModelConfig.sliding_window = 32',
             'TrainConfig.global_batch_size = 8']
  else:
    base += ['DataConfig.seq_len = 1024', 'ModelConfig.sliding_window = 256',
             'TrainConfig.global_batch_size = 8', "ModelConfig.dtype = 'bfloat16'"]
  fast = 'dot_product' if smoke else 'cudnn'
  variants = [
      ('scan, remat dots_no_batch', [f"ModelConfig.attention_impl = '{fast}'"]),
      ('unrolled layers', [f"ModelConfig.attention_impl = '{fast}'", 'ModelConfig.scan_layers = False']),
      ('remat full', [f"ModelConfig.attention_impl = '{fast}'", "ModelConfig.remat_policy = 'full'"]),
      ('remat none', [f"ModelConfig.attention_impl = '{fast}'", "ModelConfig.remat_policy = 'none'"]),
      ('remat dots_attention', [f"ModelConfig.attention_impl = '{fast}'",
                                "ModelConfig.remat_policy = 'dots_attention'"]),
      ('remat dots_attention_mlp', [f"ModelConfig.attention_impl = '{fast}'",
                                    "ModelConfig.remat_policy = 'dots_attention_mlp'"]),
      ('projections joined', [f"ModelConfig.attention_impl = '{fast}'", "ModelConfig.fuse_projections = 'all'"]),
      ('projections apart', [f"ModelConfig.attention_impl = '{fast}'", "ModelConfig.fuse_projections = 'none'"]),
      ('grad accumulation 2', [f"ModelConfig.attention_impl = '{fast}'", 'TrainConfig.grad_accum_steps = 2']),
      ('XLA attention', ["ModelConfig.attention_impl = 'xla'"]),
      ('GeLU MLP as one unit', [f"ModelConfig.attention_impl = '{fast}'", 'ModelConfig.gelu_epilogue = True']),
      # The Pallas kernel of the GeLU's backward (mjax/model/gelu_kernel.py):
      # on one Hopper GPU it runs here (8 x 1024 tokens, d_ff 1024 fit its
      # tiles), checked against the rows without it before its MFU row counts.
      ('GeLU backward kernel', [f"ModelConfig.attention_impl = '{fast}'", 'ModelConfig.gelu_epilogue = True',
                                'ModelConfig.gelu_backward_kernel = True']),
      # The Pallas kernel of q's and k's product with rotary
      # (mjax/model/rotary_kernel.py): heads of 64 and 8 x 1024 tokens fit its tiles.
      ('rotary kernel', [f"ModelConfig.attention_impl = '{fast}'", 'ModelConfig.rotary_kernel = True']),
  ]
  n_steps = 4
  batches = params0 = None
  losses, errors = {}, {}
  for name, extra in variants:
    if suite.left() < 20:
      losses[name] = None
      continue
    try:
      losses[name], batches, params0 = _variant_losses(base, extra, n_steps, batches, params0)
    except Exception as e:  # noqa: BLE001 -- one variant's failure (a kernel that does not build) is its row's
      losses[name], errors[name] = None, f'{type(e).__name__}: {str(e)[:300]}'
  ref = losses[variants[0][0]]
  tol = 2e-3 if smoke else 2e-2  # bf16 compute: orderings of sums differ between variants
  suite.say(f'\n### Variants on one {jax.devices()[0].device_kind}: loss per step '
            f'(d 256, 4 layers, window + full layers; relative tolerance {tol} vs the first row)\n')
  suite.say('| variant | ' + ' | '.join(f'step {i + 1}' for i in range(n_steps)) + ' | max rel. diff |')
  suite.say('|---|' + '---|' * (n_steps + 1))
  worst = 0.0
  for name, _ in variants:
    seq = losses[name]
    if seq is None:
      suite.say(f'| {name} | {"failed: " + errors[name] if name in errors else "skipped (suite deadline)"} |')
      continue
    d = max(abs(a - r) / abs(r) for a, r in zip(seq, ref))
    worst = max(worst, d if np.isfinite(seq).all() else float('inf'))
    suite.say(f'| {name} | ' + ' | '.join(f'{l:.4f}' for l in seq) + f' | {d:.1e} |')
  suite.say()
  suite.results['variants'] = losses
  falls = ref[-1] < ref[0]
  skipped = [name for name, seq in losses.items() if seq is None and name not in errors]
  return worst < tol and falls and not skipped and not errors, (
      f'worst relative loss difference {worst:.1e} (tolerance {tol}); loss falls: {falls}'
      + (f'; not run (suite deadline): {", ".join(skipped)}' if skipped else '')
      + (f'; failed: {", ".join(errors)}' if errors else ''))


def _variant_losses(base: list, extra: list, n_steps: int, batches, params0) -> tuple:
  """(one variant's losses over `n_steps` steps from `params0` on `batches`,
  the batches, params0): the first variant makes both, every later one
  reuses them."""
  import jax
  import numpy as np

  from mjax import data as data_lib
  from mjax import flags
  from mjax import train
  from mjax.parallel import make_mesh

  cfg = flags.load(['base.gin'], base + ["ModelConfig.remat_policy = 'dots_no_batch'"] + extra,
                   num_devices=jax.device_count())
  if batches is None:
    it = data_lib.make_train_iterator(cfg.data, cfg.train.global_batch_size)
    batches = [next(it) for _ in range(n_steps)]
  program = train.make_program(cfg, make_mesh(cfg.mesh))
  with program.context():
    if params0 is None:  # every variant starts from these weights
      params0 = jax.device_get(program.init(jax.random.key(0)).params)
    params = params0
    if not cfg.model.scan_layers:  # the unrolled tree holds layer g as 'layers_g'
      params = {k: v for k, v in params0.items() if k != 'layers'}
      for g in range(cfg.model.n_layers // cfg.model.layer_period):
        params[f'layers_{g}'] = jax.tree.map(lambda w: w[g], params0['layers'])
    params = jax.device_put(params, program.state_shardings.params)
    state = train.TrainState(step=jax.device_put(np.zeros((), np.int32), program.state_shardings.step),
                             params=params,
                             opt_state=jax.jit(program.tx.init,
                                               out_shardings=program.state_shardings.opt_state)(params))
    seq = []
    for b in batches:
      state, m = program.step(state, program.to_global(b))
      seq.append(float(m['loss']))
  return seq, batches, params0


def _positive(kind):
  """An argparse type: a number above 0 (--steps 0 would divide by zero in
  every MFU row, a budget of 0 would skip every section)."""
  def parse(text):
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f'{text!r} is not a {"whole " if kind is int else ""}number') from None
    if not value > 0:
      raise argparse.ArgumentTypeError(f'{text} is not allowed: must be positive')
    return value
  return parse


def main(argv=None):
  p = argparse.ArgumentParser('gpu_suite', description=__doc__.splitlines()[0])
  p.add_argument('--smoke', action='store_true', help='tiny shapes, runs on CPU: checks the suite itself')
  p.add_argument('--out', default=os.environ.get('OUT') or None, help='folder for tables and logs')
  p.add_argument('--budget_s', type=_positive(float), default=560, help='deadline for the whole suite')
  p.add_argument('--row_timeout_s', type=_positive(float), default=170, help='limit for one MFU row')
  p.add_argument('--steps', type=_positive(int), default=10, help='timed steps per MFU row')
  p.add_argument('--sections', default='attention,kernels,train,mfu,variants',
                 help='comma-separated, from attention, kernels, train, mfu, variants, dots')
  p.add_argument('--mfu_rows', default='',
                 help='comma-separated substrings of MFU row names to run (=NAME: that row alone; a comma followed by a space is part of a name)')
  p.add_argument('--profile', action='store_true', help='trace the rows marked for it (jax.profiler)')
  p.add_argument('--experiments', action='store_true',
                 help='also the MFU rows of XLA options under trial (EXPERIMENT_ROWS; they fail nothing)')
  p.add_argument('--baseline', default=None,
                 help='a source tree of the code before (`make baseline REF=<commit>`, then carry .baseline): '
                      'every MFU row runs in it too, right after this tree\'s, on the same card')
  p.add_argument('--child', default=None, help=argparse.SUPPRESS)
  argv = sys.argv[1:] if argv is None else argv
  args = p.parse_args(argv)
  if args.baseline and not os.path.isfile(os.path.join(args.baseline, 'bench', 'train_bench.py')):
    p.error(f'--baseline {args.baseline}: not a source tree of mjax (no bench/train_bench.py in it); make one '
            f'with `make baseline REF=<commit>`.')
  sections = dict(attention=check_attention, kernels=check_kernels, train=check_train, mfu=check_mfu,
                  variants=check_variants, dots=check_dots)
  # Before the machine's time is spent: a misspelt section or MFU row is a
  # usage error here, not a table with no rows after the other sections ran.
  for name in args.sections.split(','):
    if name not in sections:
      p.error(f'--sections {args.sections!r}: unknown section {name!r}; choose from {", ".join(sections)}')
  if args.mfu_rows:
    rows = SMOKE_MFU_ROWS if args.smoke else MFU_ROWS + (EXPERIMENT_ROWS if args.experiments else [])
    for sel in re.split(r',(?! )', args.mfu_rows):
      if not sel.lstrip('='):   # a stray comma: '' is in every name, and would select every row
        p.error(f'--mfu_rows {args.mfu_rows!r}: an empty selection (a stray comma?)')
      if not select_rows(rows, sel):
        p.error(f'--mfu_rows {args.mfu_rows!r}: {sel!r} selects no MFU row' + ('' if args.experiments or args.smoke
                else ' (the rows of XLA options under trial need --experiments)') +
                f'; the rows: {"; ".join(r[0] for r in rows)}')
  if args.child:  # one section in this process; the parent collects the JSON
    suite = Suite(args)
    import jax
    dev = jax.devices()[0]
    if dev.platform != 'gpu' and not args.smoke:
      ok, detail = False, f'no GPU (jax sees {dev.platform}): run with --smoke to check the suite on CPU'
    else:
      try:
        ok, detail = sections[args.child](suite)
      except Exception as e:  # a broken section is a finding, not the end of the suite
        traceback.print_exc()
        ok, detail = False, f'{type(e).__name__}: {e}'
    with open(os.path.join(suite.out, f'section_{args.child}.json'), 'w') as fh:
      more = {k: v for k, v in suite.results.items() if k.startswith(args.child + '_')}
      json.dump(dict(ok=ok, detail=detail, lines=suite.lines, results=suite.results.get(args.child), more=more,
                     device=dev.device_kind, jax=jax.__version__), fh, indent=1, default=str)
    return
  # Children see the same options; the deadline they get is what is left.
  args.forward, skip = [], False
  for a in argv:
    if not skip and not a.startswith('--budget_s'):
      args.forward.append(a)
    skip = a == '--budget_s'
  suite = Suite(args)
  args.forward = [*args.forward, '--out', suite.out]
  gpus = subprocess.run(['nvidia-smi', '-L'], capture_output=True, text=True).stdout.strip() \
      if shutil.which('nvidia-smi') else 'no nvidia-smi'
  suite.say(f'mjax GPU suite {time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, '
            f'python {sys.version.split()[0]}: {gpus}')
  for name in args.sections.split(','):
    suite.args.forward = [*args.forward, '--budget_s', str(max(suite.left(), 1))]
    suite.section(name)
  ran = suite.results['sections']
  failed = [k for k, v in ran.items() if not v['ok']]
  print('\n=== summary ===\n' + '\n'.join(suite.lines), flush=True)
  suite.say(f'\nsuite: {len(ran) - len(failed)} of {len(ran)} sections passed'
            + (f'; failed: {", ".join(failed)}' if failed else ''))
  suite.save()
  sys.exit(1 if failed else 0)


if __name__ == '__main__':
  main()
