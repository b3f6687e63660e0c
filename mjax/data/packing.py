"""Packing token streams into fixed-length training rows.

A stream is one token array with documents joined by EOS (a text split, or
one shard). It is cut into windows of `seq_len + 1` tokens with stride
`seq_len` (window i starts at token i * seq_len), so consecutive windows share
one token and every token except the first is a target exactly once; the
tail that does not fill a window is dropped. Windows never cross from one
stream into the next. A row is `inputs = w[:-1]`, `targets = w[1:]`; rows are
packed densely, so `loss_mask` is all ones and no PAD is ever produced.

With document attention a row also carries, per input token:
  segment_ids  1-based index of its document within the row; the document
               the row starts in (usually a partial one) is 1, and every
               token after an EOS starts the next. An EOS belongs to the
               document it ends.
  positions    its offset within that document, 0 at each document start
               and at the start of the row.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

Batch = dict[str, np.ndarray]


def num_windows(num_tokens: int, seq_len: int) -> int:
  """How many full `seq_len + 1` windows a stream of tokens yields.

  Args:
    num_tokens: length of the token array.
    seq_len: model sequence length.
  Returns:
    The number of windows (0 when the stream is shorter than one).
  """
  return max(num_tokens - 1, 0) // seq_len


class Windows:
  """The windows of a list of streams, numbered 0..len-1 stream after stream."""

  def __init__(self, streams: Sequence[np.ndarray], seq_len: int):
    """Indexes the windows of `streams`.

    Args:
      streams: token arrays, or shard files read on demand
        (mjax.data.shards.ShardTokens); never copied.
      seq_len: model sequence length.
    """
    self._streams = tuple(streams)
    self._seq_len = seq_len
    counts = np.array([num_windows(len(s), seq_len) for s in self._streams], np.int64)
    self._ends = np.cumsum(counts)
    self._starts = self._ends - counts
    self._offsets = np.arange(seq_len + 1, dtype=np.int64)

  def __len__(self) -> int:
    return int(self._ends[-1]) if len(self._ends) else 0

  @property
  def num_tokens(self) -> int:
    return sum(len(s) for s in self._streams)

  def gather(self, window_ids: np.ndarray) -> np.ndarray:
    """The token windows with the given ids.

    Args:
      window_ids: int array (B,), each in [0, len(self)).
    Returns:
      int32 array (B, seq_len + 1).
    """
    ids = np.asarray(window_ids, np.int64)
    out = np.empty((len(ids), self._seq_len + 1), np.int32)
    which = np.searchsorted(self._ends, ids, side='right')
    for k in np.unique(which):
      rows = which == k
      starts = (ids[rows] - self._starts[k]) * self._seq_len
      stream = self._streams[k]
      if isinstance(stream, np.ndarray):
        out[rows] = stream[starts[:, None] + self._offsets]   # one fancy index per stream
      else:
        # A shard file (mjax.data.shards.ShardTokens): one read per window.
        out[rows] = stream.windows(starts, self._seq_len + 1)
    return out


def document_ids_and_positions(inputs: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Segment ids and in-document positions of packed rows (module docstring).

  Args:
    inputs: int array (B, S) of input tokens.
    eos_id: the id that ends a document.
  Returns:
    (segment_ids, positions), both int32 (B, S).
  """
  b, s = inputs.shape
  starts = np.zeros((b, s), bool)
  starts[:, 1:] = inputs[:, :-1] == eos_id
  segment_ids = 1 + np.cumsum(starts, axis=1, dtype=np.int32)
  idx = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
  last_start = np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
  return segment_ids.astype(np.int32), (idx - last_start).astype(np.int32)


def rows_from_windows(windows: np.ndarray, eos_id: int, document_attention: bool) -> Batch:
  """Training rows from `seq_len + 1` token windows.

  Args:
    windows: int32 (B, seq_len + 1).
    eos_id: the tokenizer's EOS id.
    document_attention: also return segment_ids and positions.
  Returns:
    {'inputs', 'targets'}: int32 (B, seq_len); 'loss_mask': float32 ones;
    with document_attention, 'segment_ids' and 'positions': int32 (B, seq_len).
  """
  batch = {
      'inputs': np.ascontiguousarray(windows[:, :-1]),
      'targets': np.ascontiguousarray(windows[:, 1:]),
      'loss_mask': np.ones((windows.shape[0], windows.shape[1] - 1), np.float32),
  }
  if document_attention:
    batch['segment_ids'], batch['positions'] = document_ids_and_positions(batch['inputs'], eos_id)
  return batch
