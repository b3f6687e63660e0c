"""Pre-tokenized shards: written once by `mjax-prepare`, read on demand (pread).

Format (version 1). A shard directory holds raw token files and one
`manifest.json`:

  train-00000.bin, train-00001.bin, ..., heldout-00000.bin, ...
      Token ids, little-endian, `dtype` wide (uint16 when the tokenizer has at
      most 65535 ids, else uint32), no header. Documents are whole and in the
      order of their source files; each is followed by the EOS id. A shard is
      closed at the first document end at or after `shard_tokens` tokens, so
      a document longer than that makes a longer shard.
  manifest.json
      {"format": "mjax-token-shards", "version": 1,
       "tokenizer": {"name": "bytes" | file name of the tokenizer.json,
                     "path": its absolute path when prepared (null for bytes),
                     "vocab_size": ids, "eos_id": id,
                     "sha256": of the tokenizer.json (null for bytes)},
       "dtype": "uint16" | "uint32", "eos_id": id,
       "input": the text source, "file_pattern": ..., "heldout_fraction": f,
       "split": "file" | "position",
       "shards": [{"file": "train-00000.bin", "split": "train" | "heldout",
                   "tokens": n, "documents": d, "bytes": n * itemsize,
                   "sha256": hex}, ...]}
      `documents` counts the EOS tokens in the shard (the documents that end
      in it). The manifest is written last, so a directory without one is an
      unfinished preparation.

The train / held-out split is the one `mjax.data.corpus` makes for the same
text source, tokenizer and held-out fraction: the train shards, concatenated,
are exactly the train split the text source would give.

Integrity, checked when a shard directory is opened:
  always       every listed file exists and has tokens x itemsize bytes; a
               sample of each shard (evenly spaced blocks) holds only ids
               below the vocabulary size; the train split is not empty.
  verify=True  (DataConfig.verify_checksums, `mjax-prepare --verify DIR`)
               additionally the sha256 of every file, the largest id of every
               shard, and its EOS count against `documents`.
  while read   a shard that shrinks under a running job (truncated, rewritten
               shorter) fails the read that reaches its new end (see
               ShardTokens); one rewritten at the same size is read as it is.
Every failure raises DataError naming the file, the expected and the found.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import json
import os
import re
import resource
import weakref
from typing import Callable, Iterator, Optional

import numpy as np

from mjax import jsonfile
from mjax.data import corpus as corpus_lib
from mjax.data.errors import DataError, read_failure, write_failure
from mjax.data.tokenizer import Tokenizer, TokenizerInfo, load_tokenizer, token_dtype

MANIFEST = 'manifest.json'
FORMAT = 'mjax-token-shards'
VERSION = 1
SPLITS = ('train', 'heldout')
DEFAULT_SHARD_TOKENS = 1 << 27     # 256 MiB of uint16 per shard
_SAMPLE_BLOCKS = 16                # evenly spaced blocks read by the cheap check
_SAMPLE_BLOCK_TOKENS = 1024
_SCAN_CHUNK = 1 << 24              # tokens per read when scanning a whole shard
_READ_BATCH_BYTES = 64 << 20       # text read and tokenized at a time by prepare,
_READ_BATCH_DOCS = 1 << 16         # or documents (short ones cost more as objects than as text)


def is_shard_dir(path: str) -> bool:
  """Whether `path` (~ expanded) is a directory holding a manifest.json."""
  return os.path.isfile(os.path.join(os.path.expanduser(path), MANIFEST))


@dataclasses.dataclass(frozen=True)
class ShardSet:
  """An opened shard directory.

  Attributes:
    root: absolute path of the directory.
    manifest: the parsed manifest.json.
    tokenizer: identity of the tokenizer recorded in the manifest.
    train_files / heldout_files: shard file names, in manifest order.
    train / heldout: one ShardTokens (read on demand, never loaded) per shard.
  """
  root: str
  manifest: dict
  tokenizer: TokenizerInfo
  train_files: tuple[str, ...]
  heldout_files: tuple[str, ...]
  train: tuple[ShardTokens, ...]
  heldout: tuple[ShardTokens, ...]


# ----------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------

class _ShardWriter:
  """Streams tokens into numbered shard files of one split, hashing as it goes."""

  def __init__(self, root: str, split: str, dtype: np.dtype, eos_id: int, shard_tokens: int):
    self._root, self._split, self._dtype = root, split, dtype
    self._eos, self._limit = eos_id, shard_tokens
    self.entries: list[dict] = []
    self._fh = None

  def _open(self):
    name = f'{self._split}-{len(self.entries):05d}.bin'
    self._entry = {'file': name, 'split': self._split, 'tokens': 0, 'documents': 0,
                   'bytes': 0, 'sha256': ''}
    self._hash = hashlib.sha256()
    self._fh = open(os.path.join(self._root, name), 'wb')

  def close_quietly(self) -> None:
    """Closes the shard being written, if any, after a failure (its file is
    the caller's to remove)."""
    if self._fh is not None:
      with contextlib.suppress(OSError):
        self._fh.close()
      self._fh = None

  def _close(self):
    self._fh.close()
    self._fh = None
    self._entry['bytes'] = self._entry['tokens'] * self._dtype.itemsize
    self._entry['sha256'] = self._hash.hexdigest()
    self.entries.append(self._entry)

  def add(self, tokens: np.ndarray) -> None:
    """Appends documents (each already followed by EOS, except maybe the last).

    Args:
      tokens: ids of whole documents; the shard may close after any EOS.
    """
    tokens = np.asarray(tokens)
    ends = np.flatnonzero(tokens == self._eos) + 1
    start = 0
    while start < len(tokens):
      if self._fh is None:
        self._open()
      room = self._limit - self._entry['tokens']
      # Close at the first document end at or after the limit, so documents
      # stay whole inside one shard.
      k = np.searchsorted(ends, start + room, side='left')
      stop = int(ends[k]) if k < len(ends) else len(tokens)
      piece = tokens[start:stop]
      data = piece.astype(self._dtype, copy=False).tobytes()
      self._fh.write(data)
      self._hash.update(data)
      self._entry['tokens'] += len(piece)
      self._entry['documents'] += int(np.count_nonzero(piece == self._eos))
      if self._entry['tokens'] >= self._limit:
        self._close()
      start = stop

  def finish(self) -> list[dict]:
    if self._fh is not None:
      self._close()
    return self.entries


def _document_batches(root: str, files: list[str]) -> Iterator[tuple[list[str], list[bytes]]]:
  """(names, contents) of the source's documents, streamed in batches of
  about `_READ_BATCH_BYTES` or `_READ_BATCH_DOCS`: prepare holds one batch at
  a time, so its memory does not grow with the corpus."""
  names, docs, size = [], [], 0
  for name, doc in corpus_lib.iter_documents(root, files):
    names.append(name)
    docs.append(doc)
    size += len(doc)
    if size >= _READ_BATCH_BYTES or len(docs) >= _READ_BATCH_DOCS:
      yield names, docs
      names, docs, size = [], [], 0
  if docs:
    yield names, docs


def _splits_by_file(root: str, files: list[str], heldout_fraction: float) -> bool:
  """Whether the documents fall on both sides of the by-file split (that is,
  `corpus.split_flags` is not None). Stops at the first document of each
  side, so a large source answers within its first few documents."""
  sides = set()
  for name, _ in corpus_lib.iter_documents(root, files, names_only=True):
    sides.add(corpus_lib.is_heldout(name, heldout_fraction))
    if len(sides) == 2:
      return True
  if not sides:
    raise corpus_lib.no_documents(root)
  return False


def prepare_shards(source: str, output: str, tokenizer: str = 'bytes', *,
                   shard_tokens: int = DEFAULT_SHARD_TOKENS, heldout_fraction: float = 0.02,
                   file_pattern: str = '*.py',
                   log: Optional[Callable[[str], None]] = None) -> dict:
  """Tokenizes a text source once into shard files plus a manifest.

  Args:
    source: 'stdlib', a text file or a directory (as DataConfig.source).
    output: a new or empty directory.
    tokenizer: 'bytes' or the path of a tokenizer.json.
    shard_tokens: tokens per shard (documents are not cut, see the format).
    heldout_fraction: share of files held out, as DataConfig.heldout_fraction.
    file_pattern: which files of a directory to read.
    log: called with one line per written split, when given.
  Returns:
    The manifest written to output/manifest.json.
  Raises:
    DataError: the source is unusable, output is not empty, or an argument
      is out of range.
  """
  if shard_tokens < 1:
    raise DataError(f'shard directory {output}: shard_tokens must be positive, got {shard_tokens}.')
  if not 0.0 < heldout_fraction < 1.0:
    raise DataError(f'shard directory {output}: heldout_fraction must be strictly between '
                    f'0 and 1, got {heldout_fraction}.')
  output = os.path.abspath(os.path.expanduser(output))
  if os.path.exists(output) and not os.path.isdir(output):   # a file: no directory to be empty or not
    raise DataError(f'shard directory {output}: is a file, not a directory; choose a new directory for the '
                    f'shards (one that does not exist, or an empty one).')
  if os.path.isdir(output) and os.listdir(output):
    # Only a folder of nothing but shard files (and the manifest's temporary
    # file) is what an mjax-prepare killed midway leaves; any other (the
    # input corpus itself, given as --output by mistake) is not to remove.
    names = os.listdir(output)
    leftover = bool(names) and all(re.fullmatch(r'(train|heldout)-\d{5}\.bin|manifest\.json\.tmp', n)
                                   for n in names)
    raise DataError(f'shard directory {output}: already exists and is not an empty directory; choose a new '
                    'one' + (' (it holds only shard files and no manifest.json: what an mjax-prepare killed '
                             'midway leaves; remove it and run again)' if leftover else '') + '.')
  tok = load_tokenizer(tokenizer)
  # JSON Lines files stay unexpanded and their documents are streamed: a
  # list of every document's name (and split flag) costs hundreds of bytes
  # per document, tens of GB for a crawl of 10^8 documents.
  root, files = corpus_lib.find_source_files(source, file_pattern, expand=False)
  by_file = _splits_by_file(root, files, heldout_fraction)
  created = not os.path.exists(output)
  try:
    os.makedirs(output, exist_ok=True)
  except OSError as e:
    raise DataError(f'shard directory {output}: cannot be made: {write_failure(e, output)}. Give --output a path where '
                    f'this user can write, on a filesystem with room for the shards.') from None
  dtype = token_dtype(tok.info.vocab_size)
  writers = {s: _ShardWriter(output, s, dtype, tok.info.eos_id, shard_tokens) for s in SPLITS}
  try:
    if not by_file:
      # A by-position cut needs the whole stream's length: small sources only
      # end up here (one file, or a few whose hashes agree), so load it whole.
      c = corpus_lib.load_text(source, file_pattern, tokenizer, heldout_fraction)
      writers['train'].add(c.train_tokens)
      writers['heldout'].add(c.heldout_tokens)
      split = 'position'
    else:
      kept = seen = 0
      sides = set()   # of the documents kept as text
      for names, docs in _document_batches(root, files):
        seen += len(names)
        names, docs = corpus_lib.keep_text(root, names, docs, require_some=False)
        kept += sum(bool(d.strip()) for d in docs)
        held = [corpus_lib.is_heldout(f, heldout_fraction) for f in names]
        sides.update(held)
        for s, want in (('train', False), ('heldout', True)):
          chosen = [d for h, d in zip(held, docs) if h == want]
          if chosen:
            writers[s].add(tok.encode_documents(chosen))
      if not kept:
        raise DataError(f'data source {root}: no text to train on: none of its {seen} documents (files, or JSON Lines records) holds '
                        f'text (UTF-8 without NUL bytes, more than whitespace); DataConfig.file_pattern '
                        f'selects the files.')
      split = 'file'
      if len(sides) < 2:
        # The documents left out as not text were one side's only ones. The
        # text source decides the split after leaving them out
        # (corpus.split_flags) and cuts by position: so do the shards, or
        # the held-out text would be trained on and the run find no
        # held-out split. (Rare: one side's every document was not text.
        # The cut by position reads the source whole, as for one file.)
        for w in writers.values():
          w.close_quietly()
        for name in os.listdir(output):
          os.remove(os.path.join(output, name))
        writers = {s: _ShardWriter(output, s, dtype, tok.info.eos_id, shard_tokens) for s in SPLITS}
        c = corpus_lib.load_text(source, file_pattern, tokenizer, heldout_fraction)
        writers['train'].add(c.train_tokens)
        writers['heldout'].add(c.heldout_tokens)
        split = 'position'
    shards = writers['train'].finish() + writers['heldout'].finish()
    manifest = {
        'format': FORMAT, 'version': VERSION, 'tokenizer': tok.info.to_json(),
        'dtype': dtype.name, 'eos_id': tok.info.eos_id, 'input': root,
        'file_pattern': corpus_lib.file_pattern_of(source, file_pattern),
        'heldout_fraction': float(heldout_fraction), 'split': split, 'shards': shards,
    }
    tmp = os.path.join(output, MANIFEST + '.tmp')
    with open(tmp, 'w') as fh:
      json.dump(manifest, fh, indent=1)
    os.replace(tmp, os.path.join(output, MANIFEST))
  except BaseException as e:
    # Bad input found midway (no text after all), an error or an interrupt
    # (Ctrl-C, SIGTERM): what this call wrote goes, so that the same command
    # runs again as it is. The directory was new or empty: all in it is ours.
    for w in writers.values():
      w.close_quietly()
    for name in os.listdir(output):
      with contextlib.suppress(OSError):
        os.remove(os.path.join(output, name))
    if created:
      with contextlib.suppress(OSError):
        os.rmdir(output)
    if isinstance(e, OSError) and (e.filename is None or
                                   os.path.dirname(os.path.abspath(str(e.filename))) == output):
      # The shards' own writes (a full disk, a filesystem gone read-only):
      # bad ground for the output, said as such, with nothing left behind.
      raise DataError(f'shard directory {output}: writing the shards failed: {e.strerror or e}. Nothing was kept '
                      f'there; free space or give --output another filesystem, then run again.') from None
    raise
  if log:
    for s in SPLITS:
      entries = [e for e in shards if e['split'] == s]
      docs = sum(e['documents'] for e in entries)
      log(f'{s}: {len(entries)} shard(s), {sum(e["tokens"] for e in entries):,} tokens, '
          f'{docs:,} document{"" if docs == 1 else "s"}')
    if manifest.get('split') == 'position' and all(any(e['tokens'] for e in shards if e['split'] == s)
                                                   for s in SPLITS):
      # Documents are counted by their end-of-document token: the piece
      # before the cut has none, and a one-document corpus said "0 documents".
      log('the split cuts the token stream inside a document: train ends with its first part, held-out '
          'starts with the rest (each side\'s count above is of whole documents)')
  return manifest


# ----------------------------------------------------------------------------
# Reading and verifying
# ----------------------------------------------------------------------------

class ShardTokens:
  """One shard's tokens, read from its file on demand.

  Not a memory map: under a memory map, a file truncated (or rewritten
  shorter) while a run reads it kills the process with SIGBUS at the first
  page past its new end, with no message. Here every read is a pread on a
  descriptor opened when the directory was checked, so a short read raises
  DataError naming the file, and a shard replaced by rename is still read as
  it was checked, as a memory map would.

  Array-like as far as the pipeline needs: len(), `dtype`, `shape`, an int or
  a slice (a new ndarray), np.asarray (the whole shard), and `windows`.
  """

  def __init__(self, path: str, dtype: np.dtype, n: int):
    """Opens `path`, which holds `n` tokens of `dtype` (checked by the caller)."""
    self.path, self.dtype, self._n = path, np.dtype(dtype), int(n)
    self._expected = self._n * self.dtype.itemsize
    self._fd = _open_read_only(path)
    # Closed with the object, or at exit; unlike __del__, safe at interpreter shutdown.
    weakref.finalize(self, os.close, self._fd)

  def __len__(self) -> int:
    return self._n

  @property
  def shape(self) -> tuple[int]:
    return (self._n,)

  ndim = 1

  def __repr__(self) -> str:
    return f'ShardTokens({self.path!r}, {self.dtype.name}, {self._n} tokens)'

  def __reduce__(self):
    # A copy in another process opens the file again.
    return ShardTokens, (self.path, self.dtype.str, self._n)

  def __array__(self, dtype=None, copy=None):
    del copy  # always a fresh array
    a = self[:]
    return a if dtype is None else a.astype(dtype, copy=False)

  def __getitem__(self, key) -> np.ndarray:
    if isinstance(key, slice):
      r = range(*key.indices(self._n))
      if r.step == 1:
        return self._read(r.start, max(r.start, r.stop))
      if not r:
        return np.empty((0,), self.dtype)
      lo = min(r[0], r[-1])
      return self._read(lo, max(r[0], r[-1]) + 1)[np.asarray(r) - lo]
    if isinstance(key, (int, np.integer)):
      i = int(key) + (self._n if key < 0 else 0)
      if not 0 <= i < self._n:
        raise IndexError(f'{self.path}: token {int(key)} is out of range for {self._n} tokens.')
      return self._read(i, i + 1)[0]
    raise TypeError(f'{self.path}: shard tokens take an int or a slice, got {type(key).__name__}; '
                    'use windows() for many runs at once.')

  def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
    """Tokens [s, s + length) for every s in `starts`, one read each.

    Args:
      starts: int array (B,), each in [0, len(self) - length].
      length: tokens per window.
    Returns:
      read-only array (B, length) of self.dtype.
    """
    starts = np.asarray(starts, np.int64).tolist()
    if starts and (min(starts) < 0 or max(starts) + length > self._n):
      raise IndexError(f'{self.path}: windows of {length} tokens starting in '
                       f'[{min(starts)}, {max(starts)}] do not fit in {self._n} tokens.')
    size = self.dtype.itemsize
    # One pread per window, joined: fewer Python objects per window than
    # reading into views of the rows (a third faster for short windows).
    try:
      parts = [os.pread(self._fd, length * size, s * size) for s in starts]
    except OSError as e:
      raise self._failed(e) from None
    joined = b''.join(parts)
    if len(joined) != len(starts) * length * size:   # a short read: the file shrank
      return np.stack([self._read(s, s + length) for s in starts])
    return np.frombuffer(joined, self.dtype).reshape(len(starts), length)

  def _read(self, start: int, stop: int) -> np.ndarray:
    out = np.empty((stop - start,), self.dtype)
    self._read_into(out, start)
    return out

  def _read_into(self, out: np.ndarray, start: int) -> None:
    view = memoryview(out).cast('B')
    offset = start * self.dtype.itemsize
    done = 0
    while done < len(view):   # a regular file reads short only at its end (or past 2 GiB)
      try:
        got = os.preadv(self._fd, [view[done:]], offset + done)
      except OSError as e:
        raise self._failed(e) from None
      if not got:
        raise self._shrunk(offset + done)
      done += got

  def _failed(self, e: OSError) -> Exception:
    # EIO from a failing disk, ESTALE from NFS: name the file, not a bare
    # OSError from a reader thread. The storage's failure is a Fault, which
    # the driver restarts (resuming from the last checkpoint).
    said = (f'{self.path}: reading the shard failed ({e.strerror or e}); check the storage it is on, '
            'then resume: the run continues from its last checkpoint.')
    return read_failure(e, said, said)

  def _shrunk(self, offset: int) -> DataError:
    try:
      found = f'{os.fstat(self._fd).st_size} bytes'
    except OSError as e:
      found = f'unknown ({e})'
    return DataError(
        f'{self.path}: size {found}, expected {self._expected} ({self._n} tokens x '
        f'{self.dtype.itemsize} bytes) as when it was opened: the shard was truncated or rewritten '
        f'while this run read it (the read at byte {offset} found its end). Shards must not change '
        'during training: stop the run, prepare the data again with mjax-prepare into a new '
        'directory, and train from that.')


def _open_read_only(path: str) -> int:
  """A read-only descriptor; one per shard, so a large mixture may need more
  than the usual soft limit of 1024: it is raised to the hard limit once."""
  try:
    return os.open(path, os.O_RDONLY)
  except OSError as e:
    if e.errno != errno.EMFILE:
      raise DataError(f'{path}: cannot be opened ({e.strerror}).') from None
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  unlimited = hard == resource.RLIM_INFINITY
  if unlimited or soft < hard:
    with contextlib.suppress(ValueError, OSError):
      resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1 << 20) if unlimited else hard, hard))
      return os.open(path, os.O_RDONLY)
  soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
  raise DataError(f'{path}: cannot be opened: the process has reached its limit of {soft} open files '
                  '(one per shard is kept open); raise it (ulimit -n) or prepare fewer, larger shards '
                  '(mjax-prepare --shard_tokens).')


def read_manifest(root: str) -> dict:
  """Parses and structurally checks root/manifest.json.

  Args:
    root: a shard directory.
  Returns:
    The manifest dict.
  Raises:
    DataError: missing, not JSON, another format or version, or a field
      missing or of the wrong type.
  """
  path = os.path.join(root, MANIFEST)
  try:
    with open(path) as fh:
      m = jsonfile.load(fh)
  except FileNotFoundError:
    if not os.path.lexists(root):
      raise DataError(f'shard directory {root}: no such directory (give the --output of an mjax-prepare).') from None
    raise DataError(f'shard directory {root}: no {MANIFEST}; make one with mjax-prepare.') from None
  except NotADirectoryError:
    raise DataError(f'{root} is a file, not a shard directory (one that mjax-prepare wrote, holding '
                    f'{MANIFEST} and its shards).') from None
  except ValueError as e:
    raise DataError(f'{path}: not valid JSON ({e}).') from None
  if not isinstance(m, dict) or m.get('format') != FORMAT:
    found = m.get('format') if isinstance(m, dict) else type(m).__name__
    raise DataError(f'{path}: format {found!r}, expected {FORMAT!r}.')
  if m.get('version') != VERSION:
    raise DataError(f'{path}: format version {m.get("version")!r} is not supported, '
                    f'expected {VERSION}.')
  if m.get('dtype') not in ('uint16', 'uint32'):
    raise DataError(f"{path}: dtype {m.get('dtype')!r}, expected 'uint16' or 'uint32'.")
  tok = m.get('tokenizer')
  is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
  if not isinstance(tok, dict) or not all(is_int(tok.get(k)) for k in ('vocab_size', 'eos_id')):
    raise DataError(f'{path}: "tokenizer" must hold integer vocab_size and eos_id, found {tok!r}.')
  if not is_int(m.get('eos_id')) or not 0 <= m['eos_id'] < tok['vocab_size']:
    raise DataError(f'{path}: eos_id {m.get("eos_id")!r} is not a token id of the vocabulary '
                    f'(expected an integer, 0 <= eos_id < {tok["vocab_size"]}).')
  if tok['vocab_size'] > np.iinfo(np.dtype(m['dtype'])).max + 1:
    raise DataError(f'{path}: vocab_size {tok["vocab_size"]} does not fit dtype {m["dtype"]}.')
  shards = m.get('shards')
  if not isinstance(shards, list):
    raise DataError(f'{path}: "shards" must be a list, found {type(shards).__name__}.')
  for i, e in enumerate(shards):
    ok = (isinstance(e, dict) and isinstance(e.get('file'), str) and e.get('split') in SPLITS
          and all(isinstance(e.get(k), int) and e[k] >= 0 for k in ('tokens', 'documents', 'bytes'))
          and isinstance(e.get('sha256'), str))
    if not ok or os.path.basename(e['file']) != e['file']:
      raise DataError(f'{path}: shard entry {i} is malformed: {e!r} (expected file, split '
                      f'{"/".join(SPLITS)}, tokens, documents, bytes, sha256).')
  return m


def tokenizer_info(m: dict) -> TokenizerInfo:
  """The identity of the tokenizer a manifest records."""
  t = m['tokenizer']
  return TokenizerInfo(str(t.get('name')), t.get('path'), t['vocab_size'], m['eos_id'],
                       t.get('sha256'))


def _check_size(root: str, entry: dict, itemsize: int) -> str:
  path = os.path.join(root, entry['file'])
  expected = entry['tokens'] * itemsize
  if entry['bytes'] != expected:
    raise DataError(f'{os.path.join(root, MANIFEST)}: shard {entry["file"]} lists {entry["bytes"]} '
                    f'bytes but {entry["tokens"]} tokens x {itemsize} bytes = {expected}.')
  if not os.path.isfile(path):
    # A directory (or another non-file) in a shard's place was called
    # missing, and sent one looking for a file that is there by that name.
    what = ('missing' if not os.path.exists(path) else
            'a directory, not a shard file' if os.path.isdir(path) else 'not a regular file')
    raise DataError(f'{path}: {what} (listed in {MANIFEST} with {entry["tokens"]} tokens); put the shard '
                    f'back, or prepare the shards again with mjax-prepare.')
  found = os.path.getsize(path)
  if found != expected:
    raise DataError(f'{path}: size {found} bytes, expected {expected} ({entry["tokens"]} tokens '
                    f'x {itemsize} bytes); the shard is truncated or was replaced.')
  return path


def _check_ids(path: str, block: np.ndarray, offset: int, vocab_size: int) -> None:
  if len(block) and int(block.max()) >= vocab_size:
    bad = int(np.argmax(block >= vocab_size))
    raise DataError(f'{path}: token id {int(block[bad])} at position {offset + bad} is outside the '
                    f'vocabulary (expected < {vocab_size}); the shard is corrupt or was made with '
                    'another tokenizer.')


def _sample_check(path: str, tokens: ShardTokens, vocab_size: int) -> None:
  """Reads a few evenly spaced blocks (first and last included)."""
  n = len(tokens)
  if n <= _SAMPLE_BLOCKS * _SAMPLE_BLOCK_TOKENS:
    _check_ids(path, np.asarray(tokens), 0, vocab_size)
    return
  starts = np.linspace(0, n - _SAMPLE_BLOCK_TOKENS, _SAMPLE_BLOCKS).astype(np.int64)
  for s in starts:
    _check_ids(path, np.asarray(tokens[s:s + _SAMPLE_BLOCK_TOKENS]), int(s), vocab_size)


def _full_check(path: str, entry: dict, tokens: ShardTokens, vocab_size: int, eos_id: int) -> None:
  """sha256 of the file, every id below vocab_size, EOS count == documents."""
  h = hashlib.sha256()
  with open(path, 'rb') as fh:
    for chunk in iter(lambda: fh.read(1 << 22), b''):
      h.update(chunk)
  if h.hexdigest() != entry['sha256']:
    raise DataError(f'{path}: sha256 {h.hexdigest()}, expected {entry["sha256"]} from {MANIFEST}; '
                    'the shard was altered or corrupted. Prepare it again with mjax-prepare.')
  eos = 0
  for s in range(0, len(tokens), _SCAN_CHUNK):
    block = np.asarray(tokens[s:s + _SCAN_CHUNK])
    _check_ids(path, block, s, vocab_size)
    eos += int(np.count_nonzero(block == eos_id))
  if eos != entry['documents']:
    raise DataError(f'{path}: {eos} end-of-document tokens (id {eos_id}), expected '
                    f'{entry["documents"]} documents from {MANIFEST}.')


@functools.lru_cache(maxsize=64)   # every source of a large mixture, opened for train and held-out
def _open(root: str, verify_checksums: bool, manifest_mtime: float) -> ShardSet:
  del manifest_mtime  # only part of the cache key: a re-prepared directory is read again
  m = read_manifest(root)
  tok = tokenizer_info(m)
  dtype = np.dtype(m['dtype']).newbyteorder('<')
  arrays = {s: [] for s in SPLITS}
  names = {s: [] for s in SPLITS}
  for e in m['shards']:
    path = _check_size(root, e, dtype.itemsize)
    tokens = ShardTokens(path, dtype, e['tokens'])
    if verify_checksums:
      _full_check(path, e, tokens, tok.vocab_size, tok.eos_id)
    else:
      _sample_check(path, tokens, tok.vocab_size)
    arrays[e['split']].append(tokens)
    names[e['split']].append(e['file'])
  if not sum(len(a) for a in arrays['train']):
    raise DataError(f'{os.path.join(root, MANIFEST)}: empty corpus: found 0 train tokens in '
                    f'{len(arrays["train"])} train shard(s), expected at least one.')
  return ShardSet(root, m, tok, tuple(names['train']), tuple(names['heldout']),
                  tuple(arrays['train']), tuple(arrays['heldout']))


def open_shards(path: str, verify_checksums: bool = False) -> ShardSet:
  """Opens a shard directory after checking it (see the module docstring).

  Args:
    path: the directory (~ expanded).
    verify_checksums: also hash every file and scan every id.
  Returns:
    The ShardSet, cached per directory, mode and manifest modification time.
  Raises:
    DataError: the manifest or a shard fails a check.
  """
  root = os.path.abspath(os.path.expanduser(path))
  manifest = os.path.join(root, MANIFEST)
  mtime = os.path.getmtime(manifest) if os.path.exists(manifest) else -1.0
  return _open(root, bool(verify_checksums), mtime)


def verify_shards(path: str) -> dict:
  """Full verification of a shard directory, uncached (for `mjax-prepare --verify`).

  Args:
    path: the directory.
  Returns:
    Per split: shards, tokens, documents; plus the tokenizer and dtype.
  Raises:
    DataError: the first failed check.
  """
  root = os.path.abspath(os.path.expanduser(path))
  s = _open.__wrapped__(root, True, 0.0)
  out = {'directory': root, 'tokenizer': s.tokenizer.describe(), 'dtype': s.manifest['dtype']}
  for split in SPLITS:
    entries = [e for e in s.manifest['shards'] if e['split'] == split]
    out[split] = {'shards': len(entries), 'tokens': sum(e['tokens'] for e in entries),
                  'documents': sum(e['documents'] for e in entries)}
  return out


def check_tokenizer(shards: ShardSet, tokenizer: Tokenizer) -> None:
  """Raises DataError when `tokenizer` is not the one the shards were made with."""
  if not shards.tokenizer.same_as(tokenizer.info):
    raise DataError(f'shard directory {shards.root}: tokenized with {shards.tokenizer.describe()}, '
                    f'but DataConfig.tokenizer is {tokenizer.info.describe()}.')
