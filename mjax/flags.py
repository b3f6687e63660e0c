"""Flags and config loading, shared by every entry point, the driver, bench/
and the tests.

  p = flags.parser('my-tool', 'What it does.')
  args, bindings = flags.parse(p, sys.argv[1:])       # --gin_file, --gin_param, --gin.KEY=VALUE
  cfg = flags.setup(flags.gin_files(args), bindings)  # XLA flags, job joined, mesh-checked Config

Order matters once per process: XLA reads XLA_FLAGS when the backend starts,
and `jax.distributed.initialize` must run before that too, so `setup` loads
the config without devices first, sets the flags, joins the job, and only
then asks JAX for its devices and checks the config against them.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

from mjax import config as config_lib
from mjax.config import Config, ConfigError

DEFAULT_GIN = 'tiny.gin'
GIN_PREFIX = '--gin.'


def parser(prog: str, description: str) -> argparse.ArgumentParser:
  """An argument parser with --gin_file and --gin_param (add your own flags)."""
  p = argparse.ArgumentParser(
      prog=prog, description=description,
      epilog='Overrides: --gin_param="TrainConfig.steps = 30" or --gin.TrainConfig.steps=30 '
             '(both repeatable, applied after the gin files in their order on the command line: the last one wins).')
  p.add_argument('--gin_file', action='append', default=[],
                 help=f'gin config file, repeatable (default: configs/{DEFAULT_GIN}); '
                      'a bare name is looked up in the configs/ folder')
  p.add_argument('--gin_param', action='append', default=[], help="gin binding, e.g. 'TrainConfig.steps = 30'")
  return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
  """Parses `p`'s flags; the bindings of --gin_param and of every
  `--gin.KEY=VALUE` (or `--gin.KEY VALUE`) in their order on the command
  line, so that the last one given wins, whichever form each is in.
  Anything else unknown is a usage error."""
  # From Python, a number or a path object is its text, as a shell would pass it.
  argv, spelled = [os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in argv], []
  i = 0
  while i < len(argv):
    tok = argv[i]
    if tok == '--':
      spelled.extend(argv[i:])
      break
    if tok.startswith(GIN_PREFIX):
      key, eq, value = tok[len(GIN_PREFIX):].partition('=')
      if not eq:
        if i + 1 >= len(argv):
          p.error(f'{tok} needs a value: {tok}=VALUE')
        i += 1
        value = argv[i]
      if not value.strip():
        # gin reads 'KEY = ' as nothing ('Unable to parse value'); most often
        # a shell variable that is not set (--gin.DataConfig.source=$DATA).
        p.error(f'{GIN_PREFIX}{key} has an empty value (an unset shell variable?): give one, '
                f'{GIN_PREFIX}{key}=VALUE, or {GIN_PREFIX}{key}="\'\'" for an empty string')
      # As a --gin_param of its own, where it stands: argparse keeps the order.
      tok = '--gin_param=' + config_lib.override_to_binding(key, value)
    spelled.append(tok)
    i += 1
  args, rest = p.parse_known_args(spelled)
  if rest:
    p.error(f'unrecognized argument {rest[0]!r}; see --help')
  return args, list(args.gin_param)


def whole_number(minimum: int = 1):
  """An argparse `type` for a count of at least `minimum` (1: positive, 0:
  none allowed): --steps 0 or --rounds -1 is a usage error that names the
  flag and the value, not a division by zero or an empty table further on."""
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f'{text!r} is not a whole number') from None
    if value < minimum:
      raise argparse.ArgumentTypeError(
          f'{value} is not allowed: must be {"positive" if minimum == 1 else f"at least {minimum}"}')
    return value
  return parse


def positive_float(text: str) -> float:
  """An argparse `type`: a number above 0 (seconds, a rate, a fraction)."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f'{text!r} is not a number') from None
  if not value > 0 or value == float('inf'):
    raise argparse.ArgumentTypeError(f'{text} is not allowed: must be a positive number')
  return value


def gin_files(args: argparse.Namespace) -> list[str]:
  """The --gin_file values, or the default config."""
  return list(args.gin_file) or [DEFAULT_GIN]


def load(files: Sequence[str], bindings: Sequence[str] = (), num_devices: Optional[int] = None) -> Config:
  """The validated config, including the checks that read data files (the
  tokenizer's or the shards' vocabulary against the model's).

  Raises:
    ConfigError (a mjax.errors.UserError): with a one-paragraph explanation.
  """
  cfg = config_lib.load_config(files, bindings, num_devices=num_devices)
  from mjax.data.sources import check_vocab
  check_vocab(cfg.model, cfg.data)
  return cfg


def apply_xla_flags(cfg: Config, overlap: bool = True) -> None:
  """The config's XLA flags into XLA_FLAGS: before anything starts the JAX
  backend. `overlap=False` leaves the collective-overlap flags out whatever
  the config says; its other flags (xla_extra_flags, the GeLU epilogue's)
  still apply."""
  from mjax.parallel import xla_flags
  xla_flags.apply_xla_flags(cfg.train.xla_overlap_flags and overlap, **xla_flags.config_flags(cfg))


def join_job(cfg: Optional[Config] = None) -> None:
  """Joins the multi-process job the environment describes (mjax/distributed.py),
  if any: after the XLA flags, before anything starts the JAX backend.

  Raises:
    DistributedError (a mjax.errors.UserError): the environment is inconsistent.
  """
  from mjax import distributed
  distributed.initialize_from_env(peer_timeout_s=cfg.fault.collective_timeout_s if cfg else None)


def setup(files: Sequence[str], bindings: Sequence[str] = (), join: bool = True,
          xla_flags: bool = True, overlap: bool = True) -> Config:
  """Config -> XLA flags -> job joined -> config checked against the devices.

  xla_flags=False sets none; overlap=False all but the collective-overlap
  ones (apply_xla_flags)."""
  early = load(files, bindings)
  if xla_flags:
    apply_xla_flags(early, overlap=overlap)
  if join:
    join_job(early)
  from mjax.devices import start_backend
  num_devices = start_backend()
  if join:
    from mjax import distributed
    distributed.check_membership()
  cfg = load(files, bindings, num_devices=num_devices)
  check_devices(cfg)
  return cfg


def check_devices(cfg: Config) -> None:
  """Raises ConfigError for a config this job's devices cannot run (the
  backend started): setup's check, which `mjax-train --print_config` makes too."""
  import jax
  platform = jax.devices()[0].platform
  if cfg.model.attention_impl == 'cudnn' and platform != 'gpu':
    # Found before anything compiles: it was a traceback from inside the
    # first trace (RuntimeError: cuDNN is not detected), exit 1, which the
    # driver restarted as a crash.
    raise ConfigError(f"ModelConfig.attention_impl = 'cudnn' is not allowed on this job's {platform} devices: "
                      f"cuDNN attention runs on NVIDIA GPUs; use 'dot_product' (cuDNN where it can, XLA "
                      f"elsewhere) or 'xla'.")
