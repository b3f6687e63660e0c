"""Reading a text corpus into tokens and splitting it for evaluation.

A corpus is a set of files under a root (the Python standard library, a
directory, or a single file). Each file becomes its tokens (UTF-8 bytes, or
the ids of a tokenizer.json, see `mjax.data.tokenizer`) followed by the
tokenizer's EOS id; the files of a split are concatenated in sorted order
into one token array. Files are assigned to the train or held-out split by a
hash of their relative path, so adding or removing a file never moves any
other file across the split.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import hashlib
import json
import logging
import os
import sysconfig
import zlib
from typing import Iterator, Literal, Optional

import numpy as np

from mjax import jsonfile
from mjax.config import DataConfig
from mjax.data.errors import DataError, read_failure
from mjax.data.tokenizer import BYTES, ByteTokenizer, TokenizerInfo, load_tokenizer
# The byte tokenizer's constants were first defined here; callers still import them from here.
from mjax.data.tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE  # noqa: F401

log = logging.getLogger('mjax.data')

# Third-party packages live inside the stdlib folder on most installs; they
# differ between machines and would make the corpus unreproducible.
_EXCLUDED_DIRS = frozenset({'site-packages', 'dist-packages'})


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Token arrays of both splits, plus what is needed to describe them.

  Attributes:
    root: absolute path of the source (a directory, or the file itself).
    train_files: relative paths of the training files, sorted.
    heldout_files: relative paths of the held-out files, sorted.
    train_tokens: read-only array (uint16, or uint32 for vocabularies over
      65535 ids), documents joined by EOS.
    heldout_tokens: read-only array, documents joined by EOS.
    split: 'file' when files were split by hash; 'position' when one side came
      out empty and the token stream was cut instead (then the file at the
      cut is listed on both sides).
    tokenizer: identity of the tokenizer that produced the ids.
  """
  root: str
  train_files: tuple[str, ...]
  heldout_files: tuple[str, ...]
  train_tokens: np.ndarray
  heldout_tokens: np.ndarray
  split: Literal['file', 'position']
  tokenizer: TokenizerInfo = ByteTokenizer.info

  # A run's start opens its sources several times (train stream, held-out
  # batches, the position check) and each reads the cached corpus: the
  # digests are hashed once per corpus, not once per opening.
  @functools.cached_property
  def train_content(self) -> str:
    """A digest of the train split (`TokenSource.content`)."""
    return content_digest(self.train_files, self.train_tokens)

  @functools.cached_property
  def heldout_content(self) -> str:
    """The same of the held-out split."""
    return content_digest(self.heldout_files, self.heldout_tokens)


def content_digest(files: tuple[str, ...], tokens: np.ndarray) -> str:
  """A split's files' names and the ids they make, hashed (~1 GB/s)."""
  h = hashlib.blake2b(json.dumps(list(files)).encode(), digest_size=16)
  h.update(np.ascontiguousarray(tokens).view(np.uint8))
  return h.hexdigest()


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
  # Linked folders are followed (a corpus folder of links to datasets'
  # mounts: left out, they were dropped without a word), each real folder
  # once, so a link back up the tree ends.
  seen = {os.path.realpath(root)}
  for folder, subdirs, names in os.walk(root, followlinks=True):
    if skip_packages:
      # Pruning in place stops os.walk from descending: the stdlib's
      # site-packages can hold ten times more files than the stdlib itself.
      subdirs[:] = [d for d in subdirs if d not in _EXCLUDED_DIRS]
    kept = []
    for d in sorted(subdirs):   # the first of two links to one folder by name, on every host alike
      real = os.path.realpath(os.path.join(folder, d))
      if real not in seen:
        seen.add(real)
        kept.append(d)
    subdirs[:] = kept
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


def split_flags(files: list[str], heldout_fraction: float) -> Optional[list[bool]]:
  """Which files are held out, or None when the split must cut by position.

  Args:
    files: relative paths.
    heldout_fraction: share of files to hold out, in (0, 1).
  Returns:
    One flag per file (True: held out), or None when every file hashed to
    the same side (a single file, or a handful of them).
  """
  held = [is_heldout(f, heldout_fraction) for f in files]
  return None if all(held) or not any(held) else held


# JSON Lines files (the export format of Hugging Face datasets and most
# crawls) hold one document per line: {"text": "..."} or a JSON string.
JSONL_SUFFIX = '.jsonl'
JSONL_FIELD = 'text'


def _jsonl_name(rel: str, line: int) -> str:
  """The name of a JSONL file's document: 'path/file.jsonl:LINE' (1-based)."""
  return f'{rel}:{line}'


def _split_jsonl_name(name: str) -> Optional[tuple[str, int]]:
  head, sep, tail = name.rpartition(':')
  if sep and head.endswith(JSONL_SUFFIX) and tail.isdigit():
    return head, int(tail)
  return None


def document_file(name: str) -> str:
  """The file a document name lives in (itself, except for JSONL lines)."""
  parts = _split_jsonl_name(name)
  return name if parts is None else parts[0]


def what_documents_are(names: list[str]) -> str:
  """'files', or 'documents' where some are JSON Lines records: how a
  message counts them."""
  return 'files' if all(document_file(n) == n for n in names) else 'documents'


def _jsonl_lines(path: str) -> list[bytes]:
  """A JSON Lines file's lines; the last file read is kept, since its
  documents are listed, then read batch by batch."""
  st = os.stat(path)
  return _jsonl_lines_cached(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=1)
def _jsonl_lines_cached(path: str, mtime_ns: int, size: int) -> list[bytes]:
  del mtime_ns, size   # cache key only: a changed file is read again
  return _read_file(path).split(b'\n')


def _read_file(path: str) -> bytes:
  """A data file's bytes; a file that cannot be read is named."""
  try:
    with open(path, 'rb') as fh:
      return fh.read()
  except OSError as e:
    raise _unreadable(path, e) from None


def _unreadable(path: str, e: OSError) -> Exception:
  """The file named, not a bare OSError and its traceback: bad input where
  the file is not readable as it is (a restart would fail the same way), a
  Fault where the storage failed (EIO from a disk, ESTALE from NFS), which
  the driver restarts, elsewhere if need be."""
  said = f'{path}: reading the data file failed ({e.strerror or e})'
  return read_failure(e, f'{said}; make it readable, or leave it out with DataConfig.file_pattern.',
                      f'{said}: check the storage it is on; a restart reads it again.')


def expand_jsonl(root: str, rel_paths: list[str]) -> list[str]:
  """`rel_paths` with every .jsonl file replaced by its documents' names,
  one per non-empty line, so that they are split, shuffled and held out
  one by one like files."""
  base = os.path.dirname(root) if os.path.isfile(root) else root
  out = []
  for rel in rel_paths:
    if not rel.endswith(JSONL_SUFFIX):
      out.append(rel)
      continue
    lines = _jsonl_lines(os.path.join(base, rel))
    out.extend(_jsonl_name(rel, n) for n, line in enumerate(lines, 1) if line.strip())
  return out


def iter_documents(root: str, rel_paths: list[str], *,
                   names_only: bool = False) -> Iterator[tuple[str, Optional[bytes]]]:
  """`read_documents(root, expand_jsonl(root, rel_paths))`, streamed.

  JSON Lines files are read line by line, never whole, so memory does not
  grow with the number of documents (`mjax-prepare` on a large crawl).

  Args:
    root: a directory, or a single file (then `rel_paths` is its name).
    rel_paths: '/'-separated paths relative to the root (see `list_files`).
    names_only: yield (name, None): no file other than JSONL is read and no
      JSON is parsed.
  Yields:
    (document name, its raw contents) in order, names as `expand_jsonl`.
  Raises:
    DataError: a JSONL line that is not a JSON string or {"text": string}.
  """
  base = os.path.dirname(root) if os.path.isfile(root) else root
  for rel in rel_paths:
    path = os.path.join(base, rel)
    if not rel.endswith(JSONL_SUFFIX):
      yield rel, None if names_only else _read_file(path)
      continue
    try:
      with open(path, 'rb') as fh:
        # Lines as `_jsonl_lines` splits them: at b'\n' only, numbered from 1.
        for n, line in enumerate(fh, 1):
          if line.strip():
            line = line[:-1] if line.endswith(b'\n') else line
            yield _jsonl_name(rel, n), None if names_only else _jsonl_text(path, n, line)
    except OSError as e:
      raise _unreadable(path, e) from None


def _jsonl_text(path: str, n: int, line: bytes) -> bytes:
  try:
    item = jsonfile.loads(line)
    text = item[JSONL_FIELD] if isinstance(item, dict) else item
    if not isinstance(text, str):
      raise TypeError(f'{JSONL_FIELD!r} is a {type(text).__name__}, not a string')
  except (ValueError, KeyError, TypeError) as e:
    raise DataError(f'data source {path} line {n}: {line[:80].decode("utf-8", "replace")!r} is not a JSON '
                    f'string or an object with a '
                    f'string {JSONL_FIELD!r} field ({type(e).__name__}: {e}).') from None
  # 'replace': a lone surrogate (valid JSON, seen in crawls) becomes '?', and
  # not_text judges the document like any other.
  return text.encode('utf-8', errors='replace')


def read_documents(root: str, rel_paths: list[str]) -> list[bytes]:
  """The raw contents of files under `root` (of documents, for JSONL lines).

  Args:
    root: a directory, or a single file (then `rel_paths` is its name).
    rel_paths: '/'-separated paths relative to the root (see `list_files`),
      or 'file.jsonl:LINE' names (see `expand_jsonl`).
  Returns:
    One bytes object per path, in order: a JSONL line's text in UTF-8.
  Raises:
    DataError: a JSONL line that is not a JSON string or {"text": string}.
  """
  base = os.path.dirname(root) if os.path.isfile(root) else root
  docs = []
  for rel in rel_paths:
    parts = _split_jsonl_name(rel)
    if parts is not None:
      path = os.path.join(base, parts[0])
      docs.append(_jsonl_text(path, parts[1], _jsonl_lines(path)[parts[1] - 1]))
      continue
    docs.append(_read_file(os.path.join(base, rel)))
  return docs


def file_pattern_of(source: str, file_pattern: str) -> str:
  """The pattern actually applied: the stdlib source always reads '*.py'."""
  return '*.py' if source == 'stdlib' else file_pattern


def find_source_files(source: str, file_pattern: str, *,
                      expand: bool = True) -> tuple[str, list[str]]:
  """The root of a text source and its matching files.

  Args:
    source: 'stdlib' or a path.
    file_pattern: fnmatch pattern for directory sources.
    expand: replace each JSON Lines file by its documents (`expand_jsonl`);
      without it the caller streams them (`iter_documents`) and reports
      `no_documents` itself.
  Returns:
    (absolute root, sorted relative paths).
  Raises:
    DataError: the root is missing, is a shard directory, or matches nothing.
  """
  root = source_root(source)
  if not os.path.exists(root):
    raise DataError(f'data source {root}: no such file or directory '
                    f"(DataConfig.source = {source!r}).")
  if os.path.isfile(os.path.join(root, 'manifest.json')):
    # Said for the command line (mjax-prepare --input, mjax-tokenizer --input
    # reach here; training reads such a directory as shards before this):
    # what the directory already is, and what takes it.
    raise DataError(f'data source {root}: holds pre-tokenized shards (manifest.json), already prepared, not '
                    f'text to read: train from it with DataConfig.source = {root!r} '
                    f'(--gin.DataConfig.source={root}), or check it with mjax-prepare --verify {root}.')
  pattern = file_pattern_of(source, file_pattern)
  files = list_files(root, pattern, skip_packages=source == 'stdlib')
  if not files:
    raise DataError(f'data source {root}: no files match the file pattern {pattern!r} (DataConfig.file_pattern; '
                    f'--file_pattern of mjax-prepare and mjax-tokenizer)'
                    + ('. It is matched against file names, in every subdirectory: a pattern with "/" never '
                       f'matches; give the name part alone, e.g. {os.path.basename(pattern)!r}.' if '/' in pattern
                       else '.'))
  if not expand:
    return root, files
  files = expand_jsonl(root, files)
  if not files:
    raise no_documents(root)
  return root, files


def no_documents(root: str) -> DataError:
  """The error for a source whose only files are JSON Lines with no document."""
  return DataError(f'data source {root}: its JSON Lines files hold no document (every line is empty).')


def _frozen(a: np.ndarray) -> np.ndarray:
  # Arrays are shared through the cache; a caller writing into one would
  # silently corrupt every later pipeline.
  a.setflags(write=False)
  return a


# A file with NUL bytes, or with more than this share of bytes that are not
# UTF-8, is not text: an executable or an image would train the model on noise.
MAX_INVALID_SHARE = 0.01


def not_text(data: bytes) -> Optional[str]:
  """Why `data` is not UTF-8 text, or None when it is."""
  if b'\x00' in data:
    return 'NUL bytes'
  text = data.decode('utf-8', errors='replace')
  bad = text.count('\ufffd')
  if bad > MAX_INVALID_SHARE * max(1, len(text)):
    return f'{bad / len(text):.0%} of it not UTF-8'
  return None


def keep_text(source: str, files: list[str], docs: list[bytes],
              require_some: bool = True) -> tuple[list[str], list[bytes]]:
  """The files (and contents) that are text. The others are left out with
  one warning naming them; DataError when none is left, or what is left is
  only whitespace (unless not `require_some`: one batch of a larger source
  may hold no text)."""
  verdicts = [not_text(d) for d in docs]
  dropped = [(f, why) for f, why in zip(files, verdicts) if why]
  names = ', '.join(f'{f} ({why})' for f, why in dropped[:5])
  names += f' and {len(dropped) - 5} more' if len(dropped) > 5 else ''
  if dropped and len(dropped) == len(files) and require_some:
    raise DataError(f'data source {source}: no text to train on: {names} '
                    f'{"is" if len(files) == 1 else "are"} not text. Text is UTF-8 without NUL '
                    f'bytes (at most {MAX_INVALID_SHARE:.0%} of the bytes invalid); give text files '
                    f'(DataConfig.file_pattern selects them) or shards made by mjax-prepare.')
  kept = [(f, d) for f, d, why in zip(files, docs, verdicts) if not why]
  if require_some and not any(d.strip() for _, d in kept):
    # Empty files are kept (an empty __init__.py is a document), but a
    # source of nothing else would train on end-of-document tokens alone.
    blank = [f for f, _ in kept]
    raise DataError(f'data source {source}: no text to train on: its {len(blank)} text file(s) '
                    f'({", ".join(blank[:5])}{" ..." if len(blank) > 5 else ""}) hold nothing but '
                    f'whitespace; give files with text in them (DataConfig.file_pattern selects them).')
  if dropped:
    log.warning('data source %s: left out %d of %d %s that are not text: %s', source, len(dropped),
                len(files), what_documents_are(files), names)
  return [f for f, _ in kept], [d for _, d in kept]


# Room for every source of a large mixture: the trainer opens its sources for
# the train stream and again for the held-out batches, and an evicted one was
# read and tokenized twice (the train iterator holds the first copy anyway).
# {(source, file_pattern, tokenizer, heldout_fraction): (file stamps, corpus)}.
_CORPORA: dict = {}
MAX_CORPORA = 64


def _load(source: str, file_pattern: str, tokenizer: str, heldout_fraction: float) -> Corpus:
  """The corpus, from the cache while none of its files (nor the tokenizer)
  changed since it was read: a process that trains on after the data was
  edited (a notebook) reads the files as they are now. Checking costs a
  walk and a stat per file (the standard library's 1,790: ~10 ms)."""
  root, files = find_source_files(source, file_pattern, expand=False)
  base = os.path.dirname(root) if os.path.isfile(root) else root   # a one-file source names itself
  stamps = []
  for f in files:
    try:
      st = os.stat(os.path.join(base, f))
      stamps.append((f, st.st_size, st.st_mtime_ns))
    except OSError:   # gone or unreadable: reading it says so
      stamps.append((f, -1, -1))
  tok = os.path.abspath(os.path.expanduser(tokenizer))
  stamps.append(('tokenizer', os.stat(tok).st_mtime_ns if tokenizer != BYTES and os.path.isfile(tok) else 0))
  key, stamps = (source, file_pattern, tokenizer, heldout_fraction), tuple(stamps)
  held = _CORPORA.pop(key, None)
  corpus = held[1] if held is not None and held[0] == stamps else _read_corpus(*key)
  _CORPORA[key] = (stamps, corpus)   # newest last; one version of each source
  while len(_CORPORA) > MAX_CORPORA:
    _CORPORA.pop(next(iter(_CORPORA)))
  return corpus


def _read_corpus(source: str, file_pattern: str, tokenizer: str, heldout_fraction: float) -> Corpus:
  tok = load_tokenizer(tokenizer)
  root, files = find_source_files(source, file_pattern)
  files, docs = keep_text(root, files, read_documents(root, files))

  held = split_flags(files, heldout_fraction)
  if held is None:
    # Too few files for a by-file split (a single-file source, or a handful
    # of files whose hashes all fall on one side): cut the stream instead,
    # keeping the last `heldout_fraction` of tokens for evaluation.
    pieces = [tok.encode_documents([d]) for d in docs]
    tokens = np.concatenate(pieces)
    cut = len(tokens) - int(round(len(tokens) * heldout_fraction))
    ends = np.cumsum([len(p) for p in pieces])
    starts = ends - [len(p) for p in pieces]
    train = tuple(f for f, s in zip(files, starts) if s < cut)
    heldout = tuple(f for f, e in zip(files, ends) if e > cut)
    return Corpus(root, train, heldout, _frozen(tokens[:cut].copy()),
                  _frozen(tokens[cut:].copy()), 'position', tok.info)

  train = [f for f, h in zip(files, held) if not h]
  heldout = [f for f, h in zip(files, held) if h]
  return Corpus(
      root, tuple(train), tuple(heldout),
      _frozen(tok.encode_documents([d for d, h in zip(docs, held) if not h])),
      _frozen(tok.encode_documents([d for d, h in zip(docs, held) if h])),
      'file', tok.info)


def load_corpus(cfg: DataConfig) -> Corpus:
  """The tokenized, split corpus of `cfg`, read once per process.

  Args:
    cfg: only `source`, `file_pattern`, `tokenizer` and `heldout_fraction`
      matter; configs differing elsewhere share one cached corpus.
  Returns:
    The Corpus, read once per process while its files stay as they are.
  Raises:
    DataError: the source is missing, matches no file, is a shard directory,
      or the tokenizer cannot be loaded.
  """
  return _load(cfg.source, cfg.file_pattern, cfg.tokenizer, float(cfg.heldout_fraction))


def load_text(source: str, file_pattern: str, tokenizer: str, heldout_fraction: float) -> Corpus:
  """`load_corpus` for one source given explicitly (a mixture entry).

  Args:
    source: 'stdlib', a text file or a directory.
    file_pattern: which files of a directory to read.
    tokenizer: 'bytes' or the path of a tokenizer.json.
    heldout_fraction: share of files held out, in (0, 1).
  Returns:
    The Corpus, cached per process as in `load_corpus`.
  Raises:
    DataError: as `load_corpus`.
  """
  return _load(source, file_pattern, tokenizer, float(heldout_fraction))
