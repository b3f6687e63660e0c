"""Token sources: what one entry of `DataConfig.source` / `DataConfig.mixture` reads.

A source is either text ('stdlib', a file, a directory), tokenized in memory
once per process (`mjax.data.corpus`), or a directory of pre-tokenized shards
(`mjax.data.shards`), read from disk on demand. Either way it yields two lists of token
streams, train and held-out, plus the identity of its tokenizer.

All sources of a run share one tokenizer: text sources use
`DataConfig.tokenizer`, a shard directory the tokenizer in its manifest. When
`DataConfig.tokenizer` names a file, every shard directory must have been
made with that file (same sha256); left at 'bytes', a run made of shard
directories only takes their tokenizer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Literal, Optional

import numpy as np

from mjax.config import ConfigError, DataConfig, ModelConfig
from mjax.data import corpus as corpus_lib
from mjax.data import shards as shards_lib
from mjax.data.errors import DataError
from mjax.data.tokenizer import BYTES, VOCAB_SIZE, TokenizerInfo, load_tokenizer


@dataclasses.dataclass(frozen=True)
class TokenSource:
  """The token streams of one source.

  Attributes:
    spec: the source as written in the config.
    root: its absolute path.
    kind: 'text' or 'shards'.
    split: 'file' or 'position' (see Corpus.split), as the text was split.
    tokenizer: identity of the tokenizer that made the ids.
    train / heldout: token streams (documents joined by EOS), read-only:
      arrays for text, mjax.data.shards.ShardTokens for shards.
    train_files / heldout_files: text files or shard files behind them.
    content: a digest of the train split's content, wherever it lies: its
      files' names (relative to the source), each one's tokens, and the
      tokens themselves (a shard's sha256 from its manifest; for text, a
      hash of the ids). What a saved data position is checked against.
  """
  spec: str
  root: str
  kind: Literal['text', 'shards']
  split: str
  tokenizer: TokenizerInfo
  train: tuple[np.ndarray | shards_lib.ShardTokens, ...]
  heldout: tuple[np.ndarray | shards_lib.ShardTokens, ...]
  train_files: tuple[str, ...]
  heldout_files: tuple[str, ...]
  content: str = ''
  heldout_content: str = ''   # the same of the held-out split (what mjax-eval checks)


def load_source(spec: str, cfg: DataConfig) -> TokenSource:
  """Opens one source.

  Args:
    spec: 'stdlib', a text file or directory, or a shard directory.
    cfg: file_pattern, tokenizer, heldout_fraction and verify_checksums apply.
  Returns:
    The TokenSource (text corpora and opened shards are cached per process).
  Raises:
    DataError: the source is missing, empty, fails an integrity check, or
      was tokenized with another tokenizer than DataConfig.tokenizer names.
  """
  if spec != 'stdlib' and shards_lib.is_shard_dir(spec):
    s = shards_lib.open_shards(spec, cfg.verify_checksums)
    if cfg.tokenizer != BYTES:
      shards_lib.check_tokenizer(s, load_tokenizer(cfg.tokenizer))
    digest = lambda split: hashlib.sha256(json.dumps(
        [(e['file'], e['tokens'], e['sha256']) for e in s.manifest['shards'] if e['split'] == split]
    ).encode()).hexdigest()
    return TokenSource(spec, s.root, 'shards', s.manifest.get('split', 'file'), s.tokenizer,
                       s.train, s.heldout, s.train_files, s.heldout_files, digest('train'), digest('heldout'))
  c = corpus_lib.load_text(spec, cfg.file_pattern, cfg.tokenizer, cfg.heldout_fraction)
  return TokenSource(spec, c.root, 'text', c.split, c.tokenizer, (c.train_tokens,),
                     (c.heldout_tokens,), c.train_files, c.heldout_files,
                     c.train_content, c.heldout_content)


def load_sources(cfg: DataConfig) -> list[tuple[TokenSource, float]]:
  """Every source of the config with its weight, checked to share one tokenizer.

  Args:
    cfg: the data config (`mixture`, else `source`).
  Returns:
    (source, weight) pairs in config order.
  Raises:
    DataError: see `load_source`, or two sources disagree on the tokenizer.
  """
  out = [(load_source(spec, cfg), w) for spec, w in cfg.source_weights()]
  first = out[0][0]
  for src, _ in out[1:]:
    if not src.tokenizer.same_as(first.tokenizer):
      raise DataError(f'data source {src.root}: tokenized with {src.tokenizer.describe()}, but '
                      f'{first.root} with {first.tokenizer.describe()}; all sources of a mixture '
                      'must share one tokenizer.')
  return out


def _shards_alone(cfg: DataConfig) -> Optional[str]:
  """The first shard directory of a run made of shard directories only,
  with DataConfig.tokenizer left at 'bytes' (the run takes their tokenizer);
  else None."""
  specs = [spec for spec, _ in cfg.source_weights()]
  if cfg.tokenizer != BYTES or not all(s != 'stdlib' and shards_lib.is_shard_dir(s) for s in specs):
    return None
  return os.path.abspath(os.path.expanduser(specs[0]))


def shard_tokenizer(cfg: DataConfig) -> tuple[str, Optional[str]]:
  """(the tokenizer a run's ids come from, as DataConfig.tokenizer names
  it; a note where that cannot be confirmed here).

  DataConfig.tokenizer, except where it is left at 'bytes' and every source
  is a shard directory made with a tokenizer.json: then the file its
  manifest names (the path it was prepared with), where it is still there
  with the same sha256. Recorded as 'bytes', mjax-eval, mjax-generate and
  mjax-export read a BPE model's ids as bytes. Where the file is gone or
  changed, 'bytes' stays, with a note saying what to set: training needs
  no tokenizer (the shards hold ids), so that is no reason to refuse it.
  """
  root = _shards_alone(cfg)
  if root is None:
    return cfg.tokenizer, None
  info = shards_lib.tokenizer_info(shards_lib.read_manifest(root))
  if info.name == BYTES or info.sha256 is None:
    return cfg.tokenizer, None
  path = info.path
  problem = _not_that_tokenizer(path, info)
  if problem is None:
    return path, None
  return cfg.tokenizer, (
      f'shard directory {root} was tokenized with {info.describe()}, and {problem}. Set DataConfig.tokenizer to '
      f'the path of that tokenizer.json (a copy of it: the sha256 is checked): mjax-eval, mjax-generate and '
      f'mjax-export decode the model\'s ids with it.')


def _not_that_tokenizer(path: Optional[str], info: TokenizerInfo) -> Optional[str]:
  """None where the file at `path` is the tokenizer `info` describes (its
  sha256), else why not, for a note."""
  if not path or not os.path.isfile(path):
    return f'{path or "the file it was prepared with"} is not there'
  try:
    return None if load_tokenizer(path).info.same_as(info) else f'{path} is no longer that file (its sha256 differs)'
  except DataError as e:
    return f'{path} cannot be read ({e})'


def names_shard_tokenizer(cfg: DataConfig, path: str) -> bool:
  """Whether `path` names the tokenizer the shards of a run on shards alone
  were made with: the path their manifest records, or a file there now with
  its sha256."""
  root = _shards_alone(cfg)
  if root is None:
    return False
  info = shards_lib.tokenizer_info(shards_lib.read_manifest(root))
  return info.sha256 is not None and (path == info.path or _not_that_tokenizer(path, info) is None)


def tokenizer_identity(cfg: DataConfig) -> TokenizerInfo:
  """The identity of the tokenizer that made a run's ids (what checkpoints
  record): the shards' own, from their manifest, for a run on shards
  alone with DataConfig.tokenizer left at 'bytes', whether or not its file
  is at hand; else DataConfig.tokenizer's."""
  root = _shards_alone(cfg)
  if root is not None:
    return shards_lib.tokenizer_info(shards_lib.read_manifest(root))
  return load_tokenizer(cfg.tokenizer).info


def run_tokenizer(cfg: DataConfig) -> str:
  """`shard_tokenizer`'s tokenizer, for a tool that decodes ids.

  Raises:
    DataError: the shards' tokenizer.json cannot be confirmed (its note).
  """
  spec, note = shard_tokenizer(cfg)
  if note is not None:
    raise DataError(note)
  return spec


def data_vocab(cfg: DataConfig) -> tuple[int, str]:
  """The vocabulary size the model must cover, without reading any tokens.

  Args:
    cfg: the data config.
  Returns:
    (largest vocab_size over the sources' tokenizers, what it comes from).
  Raises:
    DataError: a tokenizer.json or a manifest cannot be read.
  """
  best = (0, '')
  for spec, _ in cfg.source_weights():
    if spec != 'stdlib' and shards_lib.is_shard_dir(spec):
      m = shards_lib.read_manifest(os.path.abspath(os.path.expanduser(spec)))
      found = (m['tokenizer']['vocab_size'],
               f"the tokenizer of the shards in {spec} ({m['tokenizer'].get('name')})")
    else:
      info = load_tokenizer(cfg.tokenizer).info
      found = (info.vocab_size, f'the tokenizer {info.path or repr(info.name)}')
    best = max(best, found, key=lambda t: t[0])
  return best


def check_vocab(model: ModelConfig, data: DataConfig) -> None:
  """Raises ConfigError unless the model's vocabulary covers every id the
  data can produce. Reads a tokenizer.json or a manifest at most (cheap); the
  shards themselves are checked when the pipeline opens them."""
  if data.tokenizer == BYTES and not any(s != 'stdlib' and shards_lib.is_shard_dir(s)
                                         for s, _ in data.source_weights()):
    vocab, what = VOCAB_SIZE, 'the byte tokenizer (256 bytes + EOS + PAD)'
  else:
    try:
      vocab, what = data_vocab(data)
    except DataError as e:
      raise ConfigError(f'DataConfig: {e}') from None
  if model.vocab_size < vocab:
    raise ConfigError(
        f'ModelConfig.vocab_size = {model.vocab_size!r} is not allowed: {what} produces ids up to '
        f'{vocab - 1}, so the model needs vocab_size >= {vocab} (a multiple of 128 suits GPUs: '
        f'{-(-vocab // 128) * 128}).')
