"""Tokenizers: UTF-8 bytes, or a Hugging Face `tokenizers` tokenizer.json.

`DataConfig.tokenizer` is either 'bytes' or the path of a tokenizer.json.

- 'bytes': ids 0..255 are UTF-8 bytes, `EOS_ID` (256) ends every document
  and `PAD_ID` (257) is reserved; 258 ids in all.
- a tokenizer.json: loaded with `tokenizers`. Its end-of-sequence token is
  the `eos_token` of a tokenizer_config.json next to it when there is one,
  else the first of `EOS_CANDIDATES` it knows. Special-token text inside a
  document (a source file that mentions '<|endoftext|>') is encoded as plain
  text, so only document boundaries produce EOS. Files that are not valid
  UTF-8 are decoded with U+FFFD replacement characters.

`train_bpe` trains a byte-level BPE (the GPT-2 scheme: every byte is in the
base alphabet, so any input encodes) with '<|endoftext|>' as its EOS.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import os
import re
import tempfile
import threading
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from mjax import jsonfile
from mjax.data.errors import DataError, write_failure
from mjax.jsonfile import place_new

BYTES = 'bytes'
EOS_ID = 256          # byte tokenizer: separates documents
PAD_ID = 257          # byte tokenizer: never produced by the pipeline; reserved
VOCAB_SIZE = 258      # byte tokenizer: 256 byte values + EOS + PAD

# Looked up in this order when no tokenizer_config.json names the EOS token.
EOS_CANDIDATES = ('<|endoftext|>', '</s>', '<eos>', '<|end_of_text|>', '<|eos|>')
BPE_EOS = '<|endoftext|>'


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
  """What identifies a tokenizer: recorded in shard manifests, compared across sources.

  Attributes:
    name: 'bytes', or the file name of the tokenizer.json.
    path: absolute path of the tokenizer.json; None for bytes.
    vocab_size: one more than the largest id it can produce.
    eos_id: the id appended to every document.
    sha256: hex digest of the tokenizer.json; None for bytes (no file).
  """
  name: str
  path: Optional[str]
  vocab_size: int
  eos_id: int
  sha256: Optional[str]

  def same_as(self, other: 'TokenizerInfo') -> bool:
    """Whether two tokenizers map text to the same ids (file content, not path)."""
    if self.sha256 is None or other.sha256 is None:
      return self.name == other.name == BYTES
    return self.sha256 == other.sha256

  def describe(self) -> str:
    if self.path is None:
      return f"'{self.name}' ({self.vocab_size} ids)"
    return f'{self.path} ({self.vocab_size} ids, sha256 {self.sha256[:12]}...)'

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def never_sampled(info: TokenizerInfo, model_vocab: int) -> list[int]:
  """The ids of a model's vocabulary that no text encodes to, which
  generation must never pick: those past the tokenizer's (the embedding's
  padding to a multiple of 128) and the byte tokenizer's reserved PAD. The
  model learns near-zero probability for them, but sampling at a
  temperature finds them now and then (PAD ~0.2% of one-token samples, the
  padding ids up to ~15% of the mass early in training)."""
  reserved = [PAD_ID] if info.name == BYTES else []
  return reserved + list(range(info.vocab_size, model_vocab))


def token_dtype(vocab_size: int) -> np.dtype:
  """Little-endian storage type of token ids: uint16 up to 65535 ids, else uint32."""
  return np.dtype('<u2') if vocab_size <= 65535 else np.dtype('<u4')


def join_documents(pieces: Sequence[np.ndarray], eos_id: int, dtype: np.dtype) -> np.ndarray:
  """Concatenates token arrays, each followed by `eos_id`.

  Args:
    pieces: one int array per document.
    eos_id: the separator appended after each document.
    dtype: dtype of the result.
  Returns:
    Array of length sum(len(p) + 1).
  """
  if not pieces:
    return np.zeros((0,), dtype)
  flat = np.concatenate([np.asarray(p, dtype) for p in pieces])
  # One vectorised insert instead of a Python loop keeps thousands of
  # documents well under a second.
  return np.insert(flat, np.cumsum([len(p) for p in pieces]), eos_id)


class ByteTokenizer:
  """UTF-8 bytes as ids, EOS 256."""

  info = TokenizerInfo(BYTES, None, VOCAB_SIZE, EOS_ID, None)

  def encode_documents(self, docs: Sequence[bytes]) -> np.ndarray:
    """Tokenizes documents and joins them, each followed by EOS.

    Args:
      docs: raw file contents.
    Returns:
      uint16 array of length sum(len(d) + 1).
    """
    if not docs:
      return np.zeros((0,), np.uint16)
    raw = np.frombuffer(b''.join(docs), dtype=np.uint8).astype(np.uint16)
    return np.insert(raw, np.cumsum([len(d) for d in docs]), EOS_ID)

  def encode(self, text: str) -> np.ndarray:
    """One text's ids, no EOS."""
    return np.frombuffer(text.encode('utf-8'), dtype=np.uint8).astype(np.int32)

  def decode(self, ids: Sequence[int]) -> str:
    """Text of the byte ids (EOS and PAD dropped; a broken UTF-8 sequence is U+FFFD)."""
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode('utf-8', errors='replace')


def _configured_eos(path: str) -> Optional[str]:
  """The eos_token of a tokenizer_config.json beside `path`, if any."""
  cfg_path = os.path.join(os.path.dirname(path), 'tokenizer_config.json')
  if not os.path.isfile(cfg_path):
    return None
  try:
    with open(cfg_path) as fh:
      eos = jsonfile.load(fh).get('eos_token')
  except (OSError, ValueError):
    return None
  if isinstance(eos, dict):
    eos = eos.get('content')
  return eos if isinstance(eos, str) else None


def _sha256_file(path: str) -> str:
  h = hashlib.sha256()
  with open(path, 'rb') as fh:
    for chunk in iter(lambda: fh.read(1 << 20), b''):
      h.update(chunk)
  return h.hexdigest()


class HFTokenizer:
  """A tokenizer.json loaded with Hugging Face `tokenizers`."""

  def __init__(self, path: str):
    """Loads the tokenizer and finds its EOS token.

    Args:
      path: a tokenizer.json file.
    Raises:
      DataError: the file is missing, unreadable, or has no EOS token.
    """
    import tokenizers
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
      inside = os.path.join(path, 'tokenizer.json')
      raise DataError(f'tokenizer {path}: ' + (
          f'a directory (give the tokenizer.json in it: {inside})' if os.path.isfile(inside) else
          'a directory' if os.path.isdir(path) else 'no such file')
          + " (DataConfig.tokenizer must be 'bytes' or the path of a tokenizer.json).")
    try:
      tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
      raise DataError(f'tokenizer {path}: not a readable tokenizer.json: {e}') from None
    vocab = tok.get_vocab(with_added_tokens=True)
    configured = _configured_eos(path)
    candidates = ((configured,) if configured else ()) + EOS_CANDIDATES
    eos = next((t for t in candidates if tok.token_to_id(t) is not None), None)
    if eos is None:
      raise DataError(
          f'tokenizer {path}: no end-of-sequence token: it has none of '
          f'{", ".join(candidates)}'
          + (f' (tokenizer_config.json names {configured!r})' if configured else
             ' and no tokenizer_config.json with an eos_token beside it')
          + '; add one as a special token (mjax-tokenizer adds <|endoftext|>).')
    # Documents are text: a file that mentions '<|endoftext|>' must not
    # produce a document boundary in the middle of itself.
    tok.encode_special_tokens = True
    self._tok = tok
    vocab_size = max(vocab.values()) + 1
    self.info = TokenizerInfo(os.path.basename(path), path, vocab_size,
                              tok.token_to_id(eos), _sha256_file(path))
    self._dtype = token_dtype(vocab_size)

  def encode_documents(self, docs: Sequence[bytes]) -> np.ndarray:
    """Tokenizes documents and joins them, each followed by EOS.

    Args:
      docs: raw file contents (UTF-8; invalid bytes become U+FFFD).
    Returns:
      uint16 (or uint32 for vocabularies over 65535) array.
    """
    texts = [d.decode('utf-8', errors='replace') for d in docs]
    # A batch that takes long enough to hold up a stop (prepare's 64 MiB)
    # runs off the main thread; a document's own, as the corpus encodes
    # them, is too short to pay for a thread.
    encode = functools.partial(self._tok.encode_batch_fast, texts, add_special_tokens=False)
    encodings = off_the_main_thread(encode) if sum(map(len, docs)) > _LONG_BATCH_BYTES else encode()
    lengths = [len(e.ids) for e in encodings]
    flat = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings),
                       self._dtype, count=sum(lengths))
    return np.insert(flat, np.cumsum(lengths, dtype=np.int64), self.info.eos_id)

  def encode(self, text: str) -> np.ndarray:
    """One text's ids, no EOS. UnicodeEncodeError for a string that is no
    text (surrogates: a command line's bytes that were not UTF-8), as the
    byte tokenizer raises; the Rust library's own was a bare TypeError."""
    text.encode('utf-8')
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode(list(map(int, ids)), skip_special_tokens=False)


Tokenizer = Union[ByteTokenizer, HFTokenizer]


_LONG_BATCH_BYTES = 1 << 20   # ~0.1 s of encoding


def off_the_main_thread(fn: Callable[..., Any], *args, **kwargs) -> Any:
  """fn(*args, **kwargs), run in a thread of its own while this one waits.

  For the tokenizers library's long calls (a 64 MiB batch encoded, a BPE's
  merges): Rust, which lets the GIL go but never returns to Python to let a
  signal handler run, so Ctrl-C or SIGTERM waited for the call's end, past
  the tools' 10 s grace, and the tools were ended with their partial shards
  and temporary files left behind. Waited on from here, the main thread
  stays in the interpreter: a stop raises at once and the caller's clean-ups
  run; the abandoned call runs on, unseen, until the process exits. Its
  exception, if any, is raised here. Off the main thread (signals are the
  main thread's alone) it is a plain call."""
  if threading.current_thread() is not threading.main_thread():
    return fn(*args, **kwargs)
  out: dict = {}

  def call():
    try:
      out['value'] = fn(*args, **kwargs)
    except BaseException as e:   # handed to the waiting thread, which raises it
      out['error'] = e

  worker = threading.Thread(target=call, name='mjax-tokenizer', daemon=True)
  worker.start()
  while worker.is_alive():
    worker.join(0.05)
  if 'error' in out:
    raise out['error']
  return out['value']


@functools.lru_cache(maxsize=8)
def _load_cached(spec: str, mtime: float) -> Tokenizer:
  del mtime  # only part of the cache key: an edited file is loaded again
  return ByteTokenizer() if spec == BYTES else HFTokenizer(spec)


def load_tokenizer(spec: str) -> Tokenizer:
  """The tokenizer that `DataConfig.tokenizer` names.

  Args:
    spec: 'bytes' or a path to a tokenizer.json (~ expanded).
  Returns:
    A ByteTokenizer or HFTokenizer, with `.info` and `.encode_documents`.
  Raises:
    DataError: see HFTokenizer.
  """
  if spec == BYTES:
    return _load_cached(BYTES, 0.0)
  path = os.path.abspath(os.path.expanduser(spec))
  mtime = os.path.getmtime(path) if os.path.exists(path) else -1.0
  return _load_cached(path, mtime)


MAX_BPE_VOCAB = 1 << 22   # ids a trained BPE may have

# The BPE trainer merges inside each pre-token (a run of letters, digits,
# punctuation or spaces) in time quadratic in its length when a pair repeats
# along it: a 3 MB line of one character took hours. Training sees such a
# run in pieces of MAX_TRAINING_RUN characters: its pairs are counted as
# before but at the cuts, and the tokenizer still encodes any text.
MAX_TRAINING_RUN = 1000
_LONG_RUN = re.compile(r'\S{%d,}|\s{%d,}' % (MAX_TRAINING_RUN + 1, MAX_TRAINING_RUN + 1))


def _bounded_runs(text: str) -> Iterator[str]:
  """`text` in pieces, cut only inside runs of over MAX_TRAINING_RUN
  characters without (or of nothing but) whitespace, every
  MAX_TRAINING_RUN characters; the pieces join to `text`."""
  start = 0
  for m in _LONG_RUN.finditer(text):
    for cut in range(m.start() + MAX_TRAINING_RUN, m.end(), MAX_TRAINING_RUN):
      yield text[start:cut]
      start = cut
  yield text[start:]


def train_bpe(texts: Iterable[str], vocab_size: int, output: str) -> TokenizerInfo:
  """Trains a byte-level BPE on `texts` and writes it as a tokenizer.json.

  Args:
    texts: the training documents.
    vocab_size: ids in the result: 256 byte symbols + '<|endoftext|>' + merges;
      at least 257.
    output: path of the tokenizer.json to write.
  Returns:
    The identity of the written tokenizer.
  Raises:
    DataError: vocab_size is below 257 or above MAX_BPE_VOCAB, `output`
      exists already, or cannot be written, or `texts` hold no text.
  """
  from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  if vocab_size < len(alphabet) + 1:
    raise DataError(f'tokenizer {output}: vocab_size {vocab_size} is too small: a byte-level '
                    f'BPE needs at least {len(alphabet) + 1} ids ({len(alphabet)} bytes + EOS).')
  if vocab_size > MAX_BPE_VOCAB:
    raise DataError(f'tokenizer {output}: vocab_size {vocab_size} is too large: at most {MAX_BPE_VOCAB:,} '
                    '(the trainer allocates per id; the largest vocabularies in use hold ~256k).')
  output = os.path.abspath(os.path.expanduser(output))
  # Never over an existing file: shards and checkpoints are tied to their
  # tokenizer by its sha256, and the input may be the very file named.
  if os.path.lexists(output):
    raise DataError(f'tokenizer {output} already exists{" (a directory)" if os.path.isdir(output) else ""}: '
                    'mjax-tokenizer never writes over an existing path (runs and shards made with a tokenizer '
                    'need it as it is); give a new file name.')
  parent = os.path.dirname(output)
  try:
    os.makedirs(parent, exist_ok=True)
    probe = tempfile.NamedTemporaryFile(dir=parent, prefix='.tokenizer-', suffix='.tmp', delete=False)
  except OSError as e:
    raise DataError(f'tokenizer {output}: cannot write in {parent} ({write_failure(e, parent)}).') from None
  probe.close()
  tok = HFTok(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_EOS],
                                initial_alphabet=alphabet, show_progress=False)
  said = [0]

  def counted():
    for text in texts:
      said[0] += bool(text.strip())
      yield from _bounded_runs(text)
  try:
    off_the_main_thread(tok.train_from_iterator, counted(), trainer)
    if not said[0]:
      raise DataError(f'tokenizer {output}: no text to train on: the input holds no text (empty or '
                      f'whitespace-only documents, or files that are not text); nothing was written.')
    try:
      tok.save(probe.name)
    except Exception as e:   # the Rust library's I/O errors are bare Exceptions ('... (os error 28)')
      raise DataError(f'tokenizer {output}: cannot write it ({e}); nothing was written. Free space there, or '
                      f'give another --output.') from None
    place_new(probe.name, output)
  except FileExistsError:
    raise DataError(f'tokenizer {output} appeared while training; nothing written over it.') from None
  except OSError as e:
    raise DataError(f'tokenizer {output}: cannot write it ({e.strerror or e}).') from None
  finally:
    if os.path.lexists(probe.name):
      os.unlink(probe.name)
  return load_tokenizer(output).info
