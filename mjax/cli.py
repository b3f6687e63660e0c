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
  sys.exit(2)


def train_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-train: trains a model described by gin files."""
  prog = 'mjax-train'
  p = _parser(prog, 'Train a language model.')
  p.add_argument('--workdir', default=None,
                 help='run directory: config, metrics.jsonl, TensorBoard events (default: runs/<config>)')
  args, bindings = _split_overrides(p, sys.argv[1:] if argv is None else argv)
  import jax
  cfg = _load(prog, args, bindings, num_devices=jax.device_count())
  workdir = args.workdir or os.path.join(
      'runs', os.path.splitext(os.path.basename((args.gin_file or [DEFAULT_GIN])[-1]))[0])
  from mjax import train
  from mjax.data import DataError
  try:
    train.run(cfg, workdir)
  except DataError as e:
    _die(prog, str(e))


def flops_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-flops: parameter count and training FLOPs per token, as JSON."""
  prog = 'mjax-flops'
  p = _parser(prog, 'Print parameter count and FLOPs per token of a config (nothing is allocated).')
  args, bindings = _split_overrides(p, sys.argv[1:] if argv is None else argv)
  cfg = _load(prog, args, bindings, num_devices=None)
  from mjax.model.flops import report
  print(json.dumps(report(cfg.model, cfg.data.seq_len), indent=2))


if __name__ == '__main__':
  train_main()
