"""Data pipeline throughput next to what the trainer consumes, as a markdown table.

  python bench/data_bench.py
  python bench/data_bench.py --seconds 3 --tiny_tokens_per_sec 2821 --mfu 0.45

Each pipeline row times the real iterator (`make_train_iterator`: shuffle,
gather, per-host rows, background threads) for `--seconds` after a warm-up,
on the Python standard library as text (bytes, tokenized in memory) and as
pre-tokenized shards (made once into a temporary directory), with 1 and 2
read threads, at the batch shape of each consumer:

  tiny   rows x seq of configs/tiny.gin; its tokens/s is the CPU training
         figure of bench/RESULTS.md (or --tiny_tokens_per_sec).
  1p3b   rows x seq of configs/1p3b.gin on one H100; tokens/s = MFU x peak /
         FLOPs per token, with the H100 SXM bf16 dense peak 989.4 TFLOP/s and
         an assumed MFU (--mfu, 45%) until a GPU run measures it.

"per core" divides by the read threads; ratio = pipeline / consumer, which
must stay well above 1 for the pipeline never to be the bottleneck.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time

from mjax import config as config_lib
from mjax import data
from mjax import flags
from mjax.config import DataConfig
from mjax.model.flops import flops_per_token

H100_PEAK = 989.4e12
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'RESULTS.md')


def tiny_figure_from_results(path: str) -> float:
  """The tokens/s of the `tiny.gin | 1 x cpu` row of bench/RESULTS.md."""
  with open(path) as fh:
    for line in fh:
      m = re.match(r'\|\s*tiny\.gin\s*\|\s*1 x cpu\s*\|\s*([\d,.]+)\s*\|', line)
      if m:
        return float(m.group(1).replace(',', ''))
  raise SystemExit(f'{path}: no "| tiny.gin | 1 x cpu | tokens/s |" row; pass --tiny_tokens_per_sec')


def pipeline_tokens_per_sec(cfg: DataConfig, batch: int, seconds: float) -> float:
  """Tokens (rows x seq_len targets) per second out of the real train iterator."""
  it = data.make_train_iterator(cfg, batch)
  for _ in range(3):   # threads started, buffers filled
    next(it)
  n, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    next(it)
    n += 1
  return n * batch * cfg.seq_len / (time.perf_counter() - t0)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  # Each a positive number: 0 would time no batch (0 tokens/s) or divide by
  # zero in the ratio, and a 0 given for tiny's rate was read as 'not given'.
  p.add_argument('--seconds', type=flags.positive_float, default=2.0, help='timed seconds per row')
  p.add_argument('--tiny_tokens_per_sec', type=flags.positive_float, default=None,
                 help='trainer tokens/s of tiny (default: read from bench/RESULTS.md)')
  p.add_argument('--mfu', type=flags.positive_float, default=0.45, help='assumed MFU of 1p3b on one H100')
  args = p.parse_args(argv)
  if args.mfu > 1:
    p.error(f'argument --mfu: {args.mfu:g} is not allowed: a fraction of the peak, above 0 and at most 1 '
            '(0.45 for 45%)')

  tiny_tps = args.tiny_tokens_per_sec or tiny_figure_from_results(RESULTS)
  consumers = []
  for name, gin_file in (('tiny', 'tiny.gin'), ('1p3b', '1p3b.gin')):
    cfg = config_lib.load_config([gin_file], [])
    if name == 'tiny':
      tps, how = tiny_tps, 'CPU, measured (RESULTS.md)'
    else:
      fpt = flops_per_token(cfg.model, cfg.data.seq_len)
      tps = args.mfu * H100_PEAK / fpt
      how = f'1 x H100, {args.mfu:.0%} MFU assumed, {fpt / 1e9:.2f} GFLOP/token'
    consumers.append((name, cfg.train.global_batch_size, cfg.data.seq_len, tps, how))

  with tempfile.TemporaryDirectory() as tmp:
    shard_dir = os.path.join(tmp, 'stdlib_shards')
    t0 = time.perf_counter()
    m = data.prepare_shards('stdlib', shard_dir)
    prep_s = time.perf_counter() - t0
    total = sum(e['tokens'] for e in m['shards'])
    print(f'mjax-prepare stdlib (bytes): {total:,} tokens in {prep_s:.1f} s '
          f'({total / prep_s:,.0f} tokens/s, 1 process)', file=sys.stderr)
    sources = (('stdlib text (bytes)', 'stdlib', False), ('stdlib shards (bytes)', shard_dir, False),
               ('stdlib shards + document_attention', shard_dir, True))
    rows = []
    for name, batch, seq, consumer_tps, how in consumers:
      for label, source, doc_attn in sources:
        for threads in (1, 2):
          if doc_attn and threads == 2:
            continue
          cfg = DataConfig(source=source, seq_len=seq, num_threads=threads, prefetch=2,
                           document_attention=doc_attn)
          tps = pipeline_tokens_per_sec(cfg, batch, args.seconds)
          rows.append(f'| {label} | {batch} x {seq} | {threads} | {tps:,.0f} | '
                      f'{tps / threads:,.0f} | {name}: {how} | {consumer_tps:,.0f} | '
                      f'{tps / consumer_tps:,.0f}x |')
          print(rows[-1], file=sys.stderr)

  print('| source | rows x seq | threads | pipeline tokens/s | per core | consumer | '
        'consumer tokens/s | ratio |')
  print('|---|---|---|---|---|---|---|---|')
  print('\n'.join(rows))


if __name__ == '__main__':
  main()
