"""Packing token streams into training batches with grain.

A split's token array is cut into windows of `seq_len + 1` tokens with stride
`seq_len` (window i starts at token i * seq_len), so consecutive windows share
one token and every token except the first is a target exactly once. An
example is `inputs = w[:-1]`, `targets = w[1:]`; the tail that does not fill a
window is dropped.

Train order: window ids are shuffled globally, a new permutation each epoch,
forever, and cut into global batches. Each process takes a contiguous block
of rows of every global batch, so the global order is the same whatever the
number of processes, and process p of n sees rows
[p * B/n, (p + 1) * B/n) of global batch k at step k.
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

from mjax.config import DataConfig
from mjax.data.corpus import DataError, load_corpus

Batch = dict[str, np.ndarray]


def _local_batch_size(root: str, global_batch_size: int, process_index: int,
                      process_count: int) -> int:
  if global_batch_size < 1:
    raise DataError(f'data source {root}: global_batch_size must be positive, '
                    f'got {global_batch_size}.')
  if process_count < 1 or not 0 <= process_index < process_count:
    raise DataError(f'data source {root}: process_index {process_index} is not in '
                    f'[0, process_count = {process_count}).')
  if global_batch_size % process_count:
    raise DataError(f'data source {root}: global_batch_size {global_batch_size} is not '
                    f'divisible by process_count {process_count}; each process must '
                    'take an equal share of every batch.')
  return global_batch_size // process_count


def num_windows(num_tokens: int, seq_len: int) -> int:
  """How many full `seq_len + 1` windows a stream of tokens yields.

  Args:
    num_tokens: length of the token array.
    seq_len: model sequence length.
  Returns:
    The number of windows (0 when the stream is shorter than one).
  """
  return max(num_tokens - 1, 0) // seq_len


def _check_enough(root: str, split: str, tokens: np.ndarray, seq_len: int,
                  global_batch_size: int) -> int:
  n = num_windows(len(tokens), seq_len)
  if n < global_batch_size:
    need = global_batch_size * seq_len + 1
    raise DataError(
        f'data source {root}: the {split} split has {len(tokens)} tokens but one global '
        f'batch of {global_batch_size} x seq_len {seq_len} needs {need}; use a larger '
        'source, a smaller batch or seq_len'
        + (', or a larger heldout_fraction.' if split == 'held-out' else '.'))
  return n


def gather_windows(tokens: np.ndarray, seq_len: int, window_ids: np.ndarray) -> Batch:
  """Builds a batch from window ids with one fancy index.

  Args:
    tokens: uint16 token stream of a split.
    seq_len: model sequence length.
    window_ids: int array (B,) of window indices.
  Returns:
    {'inputs', 'targets'}: int32 (B, seq_len); 'loss_mask': float32 ones.
  """
  starts = np.asarray(window_ids, np.int64) * seq_len
  w = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
  return {
      'inputs': np.ascontiguousarray(w[:, :-1]),
      'targets': np.ascontiguousarray(w[:, 1:]),
      'loss_mask': np.ones((len(starts), seq_len), np.float32),
  }


class _Gather:
  """Window-id batch -> example batch; a class, not a closure, so it pickles."""

  def __init__(self, tokens: np.ndarray, seq_len: int):
    self._tokens = tokens
    self._seq_len = seq_len

  def __call__(self, window_ids: np.ndarray) -> Batch:
    return gather_windows(self._tokens, self._seq_len, window_ids)


def _grain_seed(seed: int) -> int:
  # grain shuffles epoch e with seed + e, so seeds 0 and 1 would share all but
  # one epoch; spreading seeds over 32 bits keeps runs with nearby seeds apart.
  return (int(seed) * 0x9E3779B1 + 0x7F4A7C15) % 2**32


def make_train_dataset(cfg: DataConfig, global_batch_size: int, *, process_index: int = 0,
                       process_count: int = 1) -> grain.IterDataset:
  """The infinite, shuffled train stream of this process's batches.

  Args:
    cfg: the data config.
    global_batch_size: sequences per step summed over all processes.
    process_index: this process, in [0, process_count).
    process_count: number of processes feeding one global batch.
  Returns:
    A grain IterDataset of dicts (see `gather_windows`) with
    global_batch_size // process_count rows, read by `cfg.num_threads` threads
    with `cfg.prefetch` batches buffered ahead.
  Raises:
    DataError: see `make_train_iterator`.
  """
  corpus = load_corpus(cfg)
  local = _local_batch_size(corpus.root, global_batch_size, process_index, process_count)
  n = _check_enough(corpus.root, 'train', corpus.train_tokens, cfg.seq_len, global_batch_size)
  # shuffle before repeat: grain then reshuffles every epoch. Batching
  # window ids (not examples) lets one fancy index build a whole batch.
  ds = grain.MapDataset.range(n).shuffle(seed=_grain_seed(cfg.shuffle_seed)).repeat()
  # Local batches k*n .. k*n + n - 1 together are global batch k, so taking
  # every n-th local batch gives each process its contiguous block of rows.
  ds = ds.batch(local, drop_remainder=True)[process_index::process_count]
  ds = ds.map(_Gather(corpus.train_tokens, cfg.seq_len))
  return ds.to_iter_dataset(grain.ReadOptions(num_threads=cfg.num_threads,
                                              prefetch_buffer_size=cfg.prefetch))


def make_train_iterator(cfg: DataConfig, global_batch_size: int, *, process_index: int = 0,
                        process_count: int = 1) -> grain.DatasetIterator:
  """An endless iterator over this process's share of the train batches.

  Args:
    cfg: the data config.
    global_batch_size: sequences per step summed over all processes.
    process_index: this process, in [0, process_count).
    process_count: number of processes feeding one global batch.
  Returns:
    A grain DatasetIterator; `get_state()` / `set_state()` checkpoint and
    restore its position (a small dict), given the same config and batch.
  Raises:
    DataError: the source is missing or empty, the train split holds fewer
      than one global batch of windows, or the batch does not divide by
      process_count.
  """
  return iter(make_train_dataset(cfg, global_batch_size, process_index=process_index,
                                 process_count=process_count))


def make_eval_batches(cfg: DataConfig, global_batch_size: int, num_batches: int, *,
                      process_index: int = 0, process_count: int = 1) -> list[Batch]:
  """The first `num_batches` global batches of held-out windows, in order.

  Args:
    cfg: the data config.
    global_batch_size: sequences per batch summed over all processes.
    num_batches: how many batches to return.
    process_index: this process, in [0, process_count).
    process_count: number of processes sharing each batch.
  Returns:
    A list of batches (this process's rows), unshuffled; windows wrap around
    to the start when the split holds fewer than num_batches * batch.
  Raises:
    DataError: as `make_train_iterator`, for the held-out split.
  """
  corpus = load_corpus(cfg)
  local = _local_batch_size(corpus.root, global_batch_size, process_index, process_count)
  n = _check_enough(corpus.root, 'held-out', corpus.heldout_tokens, cfg.seq_len,
                    global_batch_size)
  ids = (np.arange(num_batches * global_batch_size) % n).reshape(num_batches, global_batch_size)
  ids = ids[:, process_index * local:(process_index + 1) * local]
  return [gather_windows(corpus.heldout_tokens, cfg.seq_len, row) for row in ids]


def describe(cfg: DataConfig) -> dict[str, Any]:
  """Corpus statistics for logging.

  Args:
    cfg: the data config.
  Returns:
    A JSON-friendly dict: source root, split mode, and per split the number
    of files, tokens and seq_len windows.
  Raises:
    DataError: the source is missing or matches no file.
  """
  c = load_corpus(cfg)
  return {
      'source': c.root,
      'split': c.split,
      'train_files': len(c.train_files),
      'heldout_files': len(c.heldout_files),
      'train_tokens': int(len(c.train_tokens)),
      'heldout_tokens': int(len(c.heldout_tokens)),
      'train_windows': num_windows(len(c.train_tokens), cfg.seq_len),
      'heldout_windows': num_windows(len(c.heldout_tokens), cfg.seq_len),
  }
