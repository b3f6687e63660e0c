"""Decoding speed of mjax-generate's KV-cache loop, and its agreement with the
full forward pass, on randomly initialized weights of a config.

  python bench/generate_bench.py --gin_file configs/125m.gin --batch 8 --prompt_len 512 --new_tokens 256
  python bench/generate_bench.py --gin_file configs/tiny.gin --batch 4 --prompt_len 64 --new_tokens 64
  python bench/generate_bench.py --gin_file configs/125m.gin --temperature 0.8 --top_k 40   # sampled

Prints one table row: prefill time, decode time per step, decoded tokens/s,
the KV cache's size, and the largest difference between the cached logits of
the last prompt positions and those of one full forward pass over the same
tokens (relative to the largest logit), in the config's compute dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mjax import flags  # noqa: E402
from mjax.generate import Generator, Sampling, cache_bytes, init_cache  # noqa: E402
from mjax.model import Transformer  # noqa: E402
from mjax.parallel import make_mesh  # noqa: E402
from mjax.train import make_program  # noqa: E402


def main(argv=None):
  p = argparse.ArgumentParser('generate_bench', description=__doc__.splitlines()[0])
  p.add_argument('--gin_file', action='append', default=[])
  p.add_argument('--gin_param', action='append', default=[])
  p.add_argument('--batch', type=flags.whole_number(), default=8)
  # The comparison with a full pass caches all but the prompt's last
  # positions (at least 1 of each), and the first new token comes from the
  # prefill: decode is timed from the second on (1 gave 0 tokens/s).
  p.add_argument('--prompt_len', type=flags.whole_number(2), default=256)
  p.add_argument('--new_tokens', type=flags.whole_number(2), default=128)
  p.add_argument('--temperature', type=float, default=0.0, help='0: greedy (the default)')
  p.add_argument('--top_k', type=int, default=0)
  p.add_argument('--top_p', type=float, default=1.0)
  p.add_argument('--json', default=None)
  p.add_argument('--profile', default='', help='also trace a short decode run (jax.profiler) into this folder')
  args, bindings = flags.parse(p, argv if argv is not None else sys.argv[1:])
  cfg = flags.load(flags.gin_files(args), [*bindings, 'MeshConfig.data = -1', 'MeshConfig.pipeline = 1',
                                           'MeshConfig.virtual_stages = 1'], num_devices=jax.device_count())
  mesh = make_mesh(cfg.mesh)
  program = make_program(cfg, mesh)
  with program.context():
    params = program.init(jax.random.key(0)).params
  vocab = cfg.model.vocab_size
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, vocab, args.prompt_len).astype(np.int32) for _ in range(args.batch)]
  gen = Generator(cfg, mesh, vocab, Sampling(args.temperature, args.top_k, args.top_p))
  cast = gen.compute_params(params)
  gen.run(cast, prompts, args.new_tokens, None)   # compiles prefill and decode (shapes as timed)
  _, times = gen.run(cast, prompts, args.new_tokens, None)
  steps = times['steps'] - 1
  if args.profile:
    # Prefill and decode at the timed shapes, compiled already.
    jax.profiler.start_trace(args.profile, create_perfetto_trace=True)
    gen.run(cast, prompts, args.new_tokens, None)
    jax.profiler.stop_trace()

  # The cached logits of the prompt's last positions against one full pass.
  model = Transformer(cfg.model)
  tokens = jnp.asarray(np.stack(prompts))
  pos = jnp.broadcast_to(jnp.arange(args.prompt_len), tokens.shape)
  k = min(16, args.prompt_len - 1)
  with program.context():
    full = jax.jit(lambda p_, t: model.apply({'params': p_}, t))(params, tokens)[:, -k:]
    cache = jax.tree.map(jnp.asarray, init_cache(cfg.model, args.batch, args.prompt_len))
    step = jax.jit(lambda p_, t, q, c: model.apply({'params': p_}, t, q, cache=c))
    _, cache = step(params, tokens[:, :-k], pos[:, :-k], cache)
    cached = []
    for i in range(args.prompt_len - k, args.prompt_len):
      logits, cache = step(params, tokens[:, i:i + 1], pos[:, i:i + 1], cache)
      cached.append(logits)
    cached = jnp.concatenate(cached, axis=1)
  diff = float(jnp.max(jnp.abs(cached - full)) / jnp.max(jnp.abs(full)))

  row = dict(config=' '.join(args.gin_file) or 'default', device=jax.devices()[0].device_kind,
             devices=jax.device_count(), dtype=cfg.model.dtype, batch=args.batch, prompt_len=args.prompt_len,
             new_tokens=args.new_tokens, prefill_ms=times['prefill_s'] * 1e3,
             decode_ms_per_step=times['decode_s'] / max(steps, 1) * 1e3,
             decode_tokens_per_s=args.batch * steps / times['decode_s'],
             cache_mib=cache_bytes(cfg.model, args.batch, args.prompt_len + args.new_tokens) / 2**20,
             cached_vs_full_rel=diff)
  print('| config | device | dtype | batch | prompt | new | prefill (ms) | decode (ms/step) | tokens/s | '
        'KV cache | cached vs full |')
  print('|---|---|---|---|---|---|---|---|---|---|---|')
  print(f'| {row["config"]} | {row["devices"]} x {row["device"]} | {row["dtype"]} | {args.batch} | '
        f'{args.prompt_len} | {args.new_tokens} | {row["prefill_ms"]:.1f} | {row["decode_ms_per_step"]:.2f} | '
        f'{row["decode_tokens_per_s"]:,.0f} | {row["cache_mib"]:.1f} MiB | {diff:.1e} |')
  if args.json:
    with open(args.json, 'w') as fh:
      json.dump(row, fh)


if __name__ == '__main__':
  # A bad config is one paragraph and exit status 2, not a traceback.
  from mjax import cli
  cli.entry_point('generate_bench')(main)()
