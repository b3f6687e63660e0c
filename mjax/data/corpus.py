"""Reading a text corpus into byte tokens and splitting it for evaluation.

A corpus is a set of files under a root (the Python standard library, a
directory, or a single file). Each file becomes its UTF-8 bytes followed by
`EOS_ID`; the files of a split are concatenated in sorted order into one token
array. Files are assigned to the train or held-out split by a hash of their
relative path, so adding or removing a file never moves any other file across
the split.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import os
import sysconfig
import zlib
from typing import Literal

import numpy as np

from mjax.config import BYTE_VOCAB, DataConfig

EOS_ID = 256          # separates documents
PAD_ID = 257          # never produced by the pipeline; reserved for callers
VOCAB_SIZE = BYTE_VOCAB

# Third-party packages live inside the stdlib folder on most installs; they
# differ between machines and would make the corpus unreproducible.
_EXCLUDED_DIRS = frozenset({'site-packages', 'dist-packages'})


class DataError(ValueError):
  """The data source cannot produce what was asked of it."""


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Token arrays of both splits, plus what is needed to describe them.

  Attributes:
    root: absolute path of the source (a directory, or the file itself).
    train_files: relative paths of the training files, sorted.
    heldout_files: relative paths of the held-out files, sorted.
    train_tokens: read-only uint16 array, documents joined by EOS.
    heldout_tokens: read-only uint16 array, documents joined by EOS.
    split: 'file' when files were split by hash; 'position' when one side came
      out empty and the token stream was cut instead (then the file at the
      cut is listed on both sides).
  """
  root: str
  train_files: tuple[str, ...]
  heldout_files: tuple[str, ...]
  train_tokens: np.ndarray
  heldout_tokens: np.ndarray
  split: Literal['file', 'position']


def source_root(source: str) -> str:
  """The absolute path that `DataConfig.source` designates.

  Args:
    source: 'stdlib' or a path (a leading ~ is expanded).
  Returns:
    The stdlib folder of the running Python, or the absolute path.
  """
  if source == 'stdlib':
    return os.path.abspath(sysconfig.get_paths()['stdlib'])
  return os.path.abspath(os.path.expanduser(source))


def list_files(root: str, pattern: str, *, skip_packages: bool = False) -> list[str]:
  """Relative paths (with '/') of the files under `root` whose name matches.

  Args:
    root: a directory, or a single file (which is then the whole list).
    pattern: fnmatch pattern applied to the file name only.
    skip_packages: prune site-packages / dist-packages folders.
  Returns:
    Sorted relative paths; '/'-separated so hashes agree across platforms.
  """
  if os.path.isfile(root):
    return [os.path.basename(root)]
  found = []
  for folder, subdirs, names in os.walk(root):
    if skip_packages:
      # Pruning in place stops os.walk from descending: the stdlib's
      # site-packages can hold ten times more files than the stdlib itself.
      subdirs[:] = [d for d in subdirs if d not in _EXCLUDED_DIRS]
    rel_folder = os.path.relpath(folder, root)
    for name in names:
      if fnmatch.fnmatch(name, pattern) and os.path.isfile(os.path.join(folder, name)):
        rel = name if rel_folder == '.' else os.path.join(rel_folder, name)
        found.append(rel.replace(os.sep, '/'))
  return sorted(found)


def is_heldout(rel_path: str, heldout_fraction: float) -> bool:
  """Whether a file belongs to the held-out split (stable per path).

  Args:
    rel_path: '/'-separated path relative to the source root.
    heldout_fraction: share of files to hold out, in (0, 1).
  Returns:
    True when the path's CRC32, scaled to [0, 1), is below the fraction.
  """
  return zlib.crc32(rel_path.encode()) / 2**32 < heldout_fraction


def encode_documents(docs: list[bytes]) -> np.ndarray:
  """Byte-tokenizes documents and joins them, each followed by EOS.

  Args:
    docs: raw file contents.
  Returns:
    uint16 array of length sum(len(d) + 1).
  """
  if not docs:
    return np.zeros((0,), np.uint16)
  raw = np.frombuffer(b''.join(docs), dtype=np.uint8).astype(np.uint16)
  # One vectorised insert instead of a Python loop over ~2k files keeps the
  # stdlib load well under a second.
  ends = np.cumsum([len(d) for d in docs])
  return np.insert(raw, ends, EOS_ID)


def _read_all(root: str, rel_paths: list[str]) -> list[bytes]:
  if os.path.isfile(root):
    base = os.path.dirname(root)
  else:
    base = root
  docs = []
  for rel in rel_paths:
    with open(os.path.join(base, rel), 'rb') as fh:
      docs.append(fh.read())
  return docs


def _frozen(a: np.ndarray) -> np.ndarray:
  # Arrays are shared through the cache; a caller writing into one would
  # silently corrupt every later pipeline.
  a.setflags(write=False)
  return a


@functools.lru_cache(maxsize=4)
def _load(source: str, file_pattern: str, tokenizer: str, heldout_fraction: float) -> Corpus:
  root = source_root(source)
  if tokenizer != 'bytes':
    raise DataError(f'data source {root}: tokenizer {tokenizer!r} is not supported; use \'bytes\'.')
  if not os.path.exists(root):
    raise DataError(f'data source {root}: no such file or directory '
                    f"(DataConfig.source = {source!r}).")
  pattern = '*.py' if source == 'stdlib' else file_pattern
  files = list_files(root, pattern, skip_packages=source == 'stdlib')
  if not files:
    raise DataError(f'data source {root}: no files match DataConfig.file_pattern = {pattern!r}.')
  docs = _read_all(root, files)

  held = [is_heldout(f, heldout_fraction) for f in files]
  if all(held) or not any(held):
    # Too few files for a by-file split (a single-file source, or a handful
    # of files whose hashes all fall on one side): cut the stream instead,
    # keeping the last `heldout_fraction` of tokens for evaluation.
    tokens = encode_documents(docs)
    cut = len(tokens) - int(round(len(tokens) * heldout_fraction))
    ends = np.cumsum([len(d) + 1 for d in docs])
    starts = ends - [len(d) + 1 for d in docs]
    train = tuple(f for f, s in zip(files, starts) if s < cut)
    heldout = tuple(f for f, e in zip(files, ends) if e > cut)
    return Corpus(root, train, heldout,
                  _frozen(tokens[:cut].copy()), _frozen(tokens[cut:].copy()), 'position')

  train = [f for f, h in zip(files, held) if not h]
  heldout = [f for f, h in zip(files, held) if h]
  return Corpus(
      root, tuple(train), tuple(heldout),
      _frozen(encode_documents([d for d, h in zip(docs, held) if not h])),
      _frozen(encode_documents([d for d, h in zip(docs, held) if h])),
      'file')


def load_corpus(cfg: DataConfig) -> Corpus:
  """The tokenized, split corpus of `cfg`, read once per process.

  Args:
    cfg: only `source`, `file_pattern`, `tokenizer` and `heldout_fraction`
      matter; configs differing elsewhere share one cached corpus.
  Returns:
    The Corpus. Files changed on disk after the first call are not re-read.
  Raises:
    DataError: the source is missing, matches no file, or the tokenizer is
      unknown.
  """
  return _load(cfg.source, cfg.file_pattern, cfg.tokenizer, float(cfg.heldout_fraction))
