"""Training and evaluation batches with grain: shuffle, mix, shard by host.

Each source's split is cut into windows (`mjax.data.packing`). Train order:
each source's window ids are shuffled globally, a new permutation each epoch,
forever, seeded by `shuffle_seed` (and the source's position in the
mixture). With a mixture, grain's `MapDataset.mix` interleaves the sources'
streams so that every run of consecutive rows holds each source in
proportion to its weight (to within one row); that fixed pattern and the
seeded orders make the whole stream deterministic. The stream is cut into
global batches, and each process takes a contiguous block of rows of every
global batch, so the global order is the same whatever the number of
processes: process p of n sees rows [p * B/n, (p + 1) * B/n) of global batch
k at step k.

Everything before the background reader is a grain MapDataset, a pure
function of the batch index, so the iterator's state is one integer
(`{'next_index': k}` from `get_state()`). A checkpoint stores it with the
batch's shape (`position`); `restore_position` puts it back, and converts it
to the same row of the stream when the global batch size changed (the row
order does not depend on the batch size; windows do depend on seq_len).

Evaluation takes the held-out windows of every source in order (unshuffled),
interleaved with the same weights, wrapping around when a split runs out.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from typing import Any, Sequence

import grain
import numpy as np

from mjax.config import DataConfig
from mjax.data.errors import DataError
from mjax.data.packing import Batch, Windows, num_windows, rows_from_windows
from mjax.data.shards import read_manifest
from mjax.data.sources import TokenSource, load_sources

log = logging.getLogger('mjax.data')
_WARNED_TAILS: set = set()   # (root, split, seq_len): said once per process

__all__ = ['describe', 'make_eval_batches', 'make_train_dataset', 'make_train_iterator',
           'num_windows', 'position', 'restore_position']

# A row id is window_id + (source index << _SOURCE_SHIFT): one int64 per row
# keeps grain's batching a plain np.stack.
_SOURCE_SHIFT = 40
_WINDOW_MASK = (1 << _SOURCE_SHIFT) - 1


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


def _windows(sources: Sequence[tuple[TokenSource, float]], split: str, seq_len: int,
             global_batch_size: int) -> list[Windows]:
  """The windows of `split` of every source, each checked to fill its share of a batch."""
  total = sum(w for _, w in sources)
  out = []
  for src, weight in sources:
    streams = src.train if split == 'train' else src.heldout
    win = Windows(streams, seq_len)
    if src.kind == 'shards':
      _say_lost_tails(src.root, split, streams, seq_len, len(win))
    # (Exact for one source: a float product rounded a huge batch's figures.)
    rows = global_batch_size if len(sources) == 1 else math.ceil(global_batch_size * weight / total)
    if len(win) < rows:
      share = (f'one global batch of {global_batch_size} x seq_len {seq_len}'
               if len(sources) == 1 else
               f'its share of a global batch ({rows} of {global_batch_size} rows) x seq_len {seq_len}')
      label = 'held-out' if split == 'heldout' else split
      # A shard directory's split was fixed by mjax-prepare: DataConfig.heldout_fraction
      # applies to text sources only, and changing it would not help.
      if src.kind == 'shards':
        made = read_manifest(src.root).get('heldout_fraction')
        larger = ('the shards prepared again with a larger mjax-prepare --heldout_fraction'
                  + (f' (these were made with {made})' if made is not None else ''))
      else:
        larger = 'a larger DataConfig.heldout_fraction'
      if src.kind == 'shards' and not len(win) and win.num_tokens > seq_len:
        # Windows never cross shards: a source larger than a batch needs
        # gave none, and 'a larger source' would not say why. (A split
        # shorter than one window in all is too small whatever the shards.)
        raise DataError(
            f'data source {src.root}: every one of the {len(streams)} {label} shard(s) is shorter than one '
            f'window of seq_len + 1 = {seq_len + 1} tokens (the longest has {max(len(t) for t in streams)}), and '
            f'windows never cross shards; prepare the shards again with a larger mjax-prepare --shard_tokens, '
            f'or use a smaller seq_len.')
      raise DataError(
          f'data source {src.root}: the {label} split has {win.num_tokens} tokens '
          f'({len(win)} windows of seq_len + 1) but {share} needs {rows * seq_len + 1}; '
          'use a larger source, a smaller batch or seq_len'
          + (f', or {larger}.' if split == 'heldout' else '.'))
    out.append(win)
  return out


def _say_lost_tails(root: str, split: str, shards: Sequence, seq_len: int, windows: int) -> None:
  """A warning where over 1% of a shard split's tokens are in shard ends
  shorter than a window: windows never cross shards, so each shard's last
  < seq_len + 1 tokens are never read. Negligible at mjax-prepare's default
  shard size; with small --shard_tokens it dropped data without a word."""
  key = (root, split, seq_len)
  tokens = sum(len(t) for t in shards)
  used = sum(n * seq_len + 1 for n in (num_windows(len(t), seq_len) for t in shards) if n)
  # Only what larger shards would read: a split in one shard already (a
  # held-out split, a small corpus at the default --shard_tokens) loses its
  # one tail however large the shards, and the advice would change nothing.
  whole = num_windows(tokens, seq_len)
  avoidable = (whole * seq_len + 1 if whole else 0) - used
  if key in _WARNED_TAILS or not tokens or avoidable <= 0.01 * tokens or not windows:
    return
  _WARNED_TAILS.add(key)
  log.warning('data source %s: %.1f%% of the %s split\'s %d tokens are never read: windows never cross shards, '
              'and each of its %d shards ends in fewer than seq_len + 1 = %d tokens that no window takes; '
              'prepare the shards again with a larger mjax-prepare --shard_tokens (shards of at least %d tokens '
              'keep this under 1%%)', root, 100 * (tokens - used) / tokens, split, tokens, len(shards),
              seq_len + 1, 100 * seq_len)


class _Tag:
  """Window id -> row id of source i; a class, not a closure, so it pickles."""

  def __init__(self, source_index: int):
    self._offset = source_index << _SOURCE_SHIFT

  def __call__(self, window_id: int) -> int:
    return int(window_id) + self._offset


class _Build:
  """Row-id batch -> example batch, one fancy index per source stream."""

  def __init__(self, windows: Sequence[Windows], seq_len: int, eos_id: int,
               document_attention: bool, vocab_size: int = 0, roots: Sequence[str] = ()):
    self._windows = tuple(windows)
    self._seq_len = seq_len
    self._eos_id = eos_id
    self._document_attention = document_attention
    self._vocab_size = vocab_size
    self._roots = tuple(roots)

  def __call__(self, row_ids: np.ndarray) -> Batch:
    ids = np.asarray(row_ids, np.int64)
    which, local = ids >> _SOURCE_SHIFT, ids & _WINDOW_MASK
    if len(self._windows) == 1:
      w = self._windows[0].gather(local)
    else:
      w = np.empty((len(ids), self._seq_len + 1), np.int32)
      for k in np.unique(which):
        rows = which == k
        w[rows] = self._windows[k].gather(local[rows])
    if self._vocab_size and w.size and int(w.max()) >= self._vocab_size:
      # Start-up checks a sample of each shard (every id with
      # verify_checksums); an id beyond it would reach the model's embedding
      # lookup, which reads it as NaN: a data error, not a numerical fault.
      r, c = np.argwhere(w >= self._vocab_size)[0]
      k = int(which[r])
      raise DataError(
          f'data source {self._roots[k] if k < len(self._roots) else "?"}: token id {int(w[r, c])} (window '
          f'{int(local[r])}, offset {int(c)}) is outside the tokenizer\'s {self._vocab_size} ids: the data is '
          f'corrupted or was made with another tokenizer. Check it with mjax-prepare --verify, or set '
          f'DataConfig.verify_checksums = True to check every id at start-up.')
    return rows_from_windows(w, self._eos_id, self._document_attention)


def _grain_seed(seed: int) -> int:
  # grain shuffles epoch e with seed + e, so seeds 0 and 1 would share all but
  # one epoch; spreading seeds over 32 bits keeps runs with nearby seeds apart.
  return (int(seed) * 0x9E3779B1 + 0x7F4A7C15) % 2**32


def _source_seed(seed: int, source_index: int) -> int:
  # Source 0 keeps the single-source seed, so adding a mixture entry does not
  # reorder the first source.
  return (_grain_seed(seed) + source_index * 0x632BE5AB) % 2**32


def _mix(parts: list[grain.MapDataset], weights: Sequence[float]) -> grain.MapDataset:
  return parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, list(weights))


def make_train_dataset(cfg: DataConfig, global_batch_size: int, *, process_index: int = 0,
                       process_count: int = 1) -> grain.IterDataset:
  """The infinite, shuffled (and mixed) train stream of this process's batches.

  Args:
    cfg: the data config.
    global_batch_size: sequences per step summed over all processes.
    process_index: this process, in [0, process_count).
    process_count: number of processes feeding one global batch.
  Returns:
    A grain IterDataset of dicts (see `mjax.data.packing.rows_from_windows`)
    with global_batch_size // process_count rows, read by `cfg.num_threads`
    threads with `cfg.prefetch` batches buffered ahead.
  Raises:
    DataError: see `make_train_iterator`.
  """
  sources = load_sources(cfg)
  local = _local_batch_size(sources[0][0].root, global_batch_size, process_index, process_count)
  windows = _windows(sources, 'train', cfg.seq_len, global_batch_size)
  # shuffle before repeat: grain then reshuffles every epoch. Batching row
  # ids (not examples) lets one fancy index per stream build a whole batch.
  parts = [grain.MapDataset.range(len(w)).shuffle(seed=_source_seed(cfg.shuffle_seed, i))
           .repeat().map(_Tag(i)) for i, w in enumerate(windows)]
  ds = _mix(parts, [w for _, w in sources])
  # Local batches k*n .. k*n + n - 1 together are global batch k, so taking
  # every n-th local batch gives each process its contiguous block of rows.
  ds = ds.batch(local, drop_remainder=True)[process_index::process_count]
  tokenizer = sources[0][0].tokenizer
  ds = ds.map(_Build(windows, cfg.seq_len, tokenizer.eos_id, cfg.document_attention,
                     tokenizer.vocab_size, [src.root for src, _ in sources]))
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=cfg.num_threads, prefetch_buffer_size=cfg.prefetch))
  ds.fingerprint = fingerprint(cfg, sources)
  return ds


def fingerprint(cfg: DataConfig, sources: Sequence[tuple[TokenSource, float]]) -> dict:
  """What the train order is made of: each source (its content, weight,
  tokenizer), the seed and the split. A saved position names the same rows
  only where this is the same; processes of one job must all have it
  alike. {'content': short hex, 'digest': the older, path-based one,
  'heldout': the held-out split's content (what mjax-eval checks a step
  against), 'sources': [...]} (the list says what differs).

  `content` holds each source's files' names and ids (`TokenSource.content`),
  not its path: a corpus copied elsewhere is the same data, and a file
  renamed (the order is by name), reordered or rewritten at the same size
  is not. `digest` (paths, file and token counts) is what positions saved
  before `content` are checked against."""
  # Tokens, not windows: another seq_len cuts other windows of the same data
  # (restore_position says so on its own).
  described = [{'root': src.root, 'weight': weight, 'tokenizer': src.tokenizer.sha256 or src.tokenizer.name,
                'files': len(src.train_files), 'tokens': int(sum(len(s) for s in src.train))}
               for src, weight in sources]
  rest = [cfg.shuffle_seed, cfg.heldout_fraction, cfg.document_attention]
  short = lambda x: hashlib.sha256(json.dumps(x, sort_keys=True).encode()).hexdigest()[:16]
  # Weights as shares: 0.7/0.3 and 7/3 sample alike.
  total = sum(w for _, w in sources)
  share = lambda w: round(w / total, 12)
  content = [{**{k: v for k, v in d.items() if k != 'root'}, 'weight': share(weight), 'content': src.content}
             for d, (src, weight) in zip(described, sources)]
  heldout = [[src.heldout_content, share(weight), d['tokenizer']] for d, (src, weight) in zip(described, sources)]
  # heldout_fraction splits text sources only (shards keep mjax-prepare's
  # split, and their content says which it is).
  fraction = cfg.heldout_fraction if any(src.kind == 'text' for src, _ in sources) else None
  return {'digest': short([described, *rest]), 'content': short([content, cfg.shuffle_seed, fraction,
                                                                   cfg.document_attention]),
          'heldout': short([heldout, fraction, cfg.document_attention]), 'sources': described}


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
    DataError: a source is missing, empty or fails an integrity check, the
      sources disagree on the tokenizer, a train split holds fewer windows
      than its share of a global batch, or the batch does not divide by
      process_count.
  """
  ds = make_train_dataset(cfg, global_batch_size, process_index=process_index, process_count=process_count)
  it = iter(ds)
  it.fingerprint = ds.fingerprint   # read by `position` and `restore_position`
  return it


_SHAPE_KEYS = ('global_batch_size', 'seq_len', 'data', 'data_content', 'data_heldout')


def position(it: grain.DatasetIterator, global_batch_size: int, seq_len: int) -> dict:
  """The train iterator's position for a checkpoint: grain's state (the next
  global batch's index), the shape of the batches it counts and the digest
  of the data it counts them in (`fingerprint`)."""
  out = {**it.get_state(), 'global_batch_size': int(global_batch_size), 'seq_len': int(seq_len)}
  found = getattr(it, 'fingerprint', None)
  if found is not None:
    out['data'], out['data_content'], out['data_heldout'] = found['digest'], found['content'], found['heldout']
  return out


def skip(it: grain.DatasetIterator, batches: int) -> None:
  """Moves `it` `batches` global batches on without reading them: the
  position is one integer (the module's docstring), so a skip of millions
  costs what one costs."""
  state = it.get_state()
  to = int(state['next_index']) + int(batches)
  try:
    it.set_state({**state, 'next_index': to})
  except IndexError:   # grain indexes the repeated order with 64 bits: ~2**63 rows in all
    raise DataError(f'TrainConfig.skip_batches = {batches} takes the data position to batch {to:,}, past the '
                    f'end of the data order grain can index (~2**63 rows); skip fewer batches.') from None


def restore_position(it: grain.DatasetIterator, state: dict, global_batch_size: int,
                     seq_len: int) -> str:
  """Moves `it` (a fresh train iterator) to a saved `position`.

  Same batch shape: exactly where the saved run stopped. Another global
  batch size: the same row of the same order, at the batch that holds it;
  a batch index alone would skip or repeat (k batches of 8 rows are not k
  batches of 16). Another seq_len cuts other windows, so no row corresponds
  and the order starts from its beginning. A state saved without the shape
  (older checkpoints) is taken as the same shape.

  Returns:
    '' when the position was restored exactly, else one sentence for the log
    saying what was done instead.
  """
  saved_b = int(state.get('global_batch_size', global_batch_size))
  saved_s = int(state.get('seq_len', seq_len))
  grain_state = {k: v for k, v in state.items() if k not in _SHAPE_KEYS}
  changed = _changed_data(it, state)
  restored = _restore(it, grain_state, saved_b, saved_s, global_batch_size, seq_len)
  return '; '.join(n for n in (changed, restored) if n)


def _changed_data(it: grain.DatasetIterator, state: dict) -> str:
  now = getattr(it, 'fingerprint', None)
  key, saved = ('content', state['data_content']) if 'data_content' in state else ('digest', state.get('data'))
  if saved is None or now is None or saved == now[key]:
    return ''   # saved before positions named their data, or the same data
  return ('warning: the data is not what this position was saved with (other files, file names or contents in a '
          'source, another '
          'tokenizer, shuffle_seed, mixture or heldout_fraction; now: '
          + ', '.join(f'{s["root"]}: {s["tokens"]:,} tokens in {s["files"]:,} files' for s in now['sources'])
          + '): training goes on at the same batch index of the new order, whose rows are not those the '
          'run would have read next')


def _restore(it: grain.DatasetIterator, grain_state: dict, saved_b: int, saved_s: int, global_batch_size: int,
             seq_len: int) -> str:
  if saved_s != seq_len:
    return (f'seq_len changed from {saved_s} to {seq_len}: windows are cut differently, so the data '
            'order starts again from its beginning')
  if saved_b == global_batch_size:
    it.set_state(grain_state)
    return ''
  rows = int(grain_state['next_index']) * saved_b
  k, again = divmod(rows, global_batch_size)
  it.set_state({**grain_state, 'next_index': k})
  return (f'global batch size changed from {saved_b} to {global_batch_size}: the data continues at row '
          f'{rows:,} of the same order (batch {k:,})'
          + (f', reading its first {again} rows again' if again else ''))


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
    A list of batches (this process's rows), unshuffled; a mixture's held-out
    splits are interleaved with the training weights; windows wrap around to
    the start when a split holds fewer than it is asked for.
  Raises:
    DataError: as `make_train_iterator`, for the held-out splits.
  """
  sources = load_sources(cfg)
  local = _local_batch_size(sources[0][0].root, global_batch_size, process_index, process_count)
  windows = _windows(sources, 'heldout', cfg.seq_len, global_batch_size)
  parts = [grain.MapDataset.range(len(w)).repeat().map(_Tag(i)) for i, w in enumerate(windows)]
  ds = _mix(parts, [w for _, w in sources])
  ids = np.array([ds[j] for j in range(num_batches * global_batch_size)], np.int64)
  ids = ids.reshape(num_batches, global_batch_size)[:, process_index * local:(process_index + 1) * local]
  tokenizer = sources[0][0].tokenizer
  build = _Build(windows, cfg.seq_len, tokenizer.eos_id, cfg.document_attention, tokenizer.vocab_size,
                 [src.root for src, _ in sources])
  return [build(row) for row in ids]


def whole_batches(cfg: DataConfig, global_batch_size: int, split: str = 'heldout') -> int:
  """How many whole global batches the held-out split (or, with `split`
  'train', the train split's first pass) holds: past them
  `make_eval_batches` wraps around (the train order starts another pass)
  and windows repeat, and a token counted twice biases a mean loss. A
  mixture takes each source's share of a batch, so its smallest source, for
  its share, sets the count. 0: not even one, which `make_eval_batches`
  refuses with the numbers."""
  info = describe(cfg)
  key = f'{split}_windows'
  if 'mixture' in info:
    total = sum(s['weight'] for s in info['mixture'])
    whole = min(int(s[key] // (global_batch_size * s['weight'] / total)) for s in info['mixture'])
  else:
    whole = info[key] // global_batch_size
  return int(whole)


def _describe_source(src: TokenSource, seq_len: int) -> dict[str, Any]:
  return {
      'source': src.root,
      'kind': src.kind,
      'split': src.split,
      'train_files': len(src.train_files),
      'heldout_files': len(src.heldout_files),
      'train_tokens': int(sum(len(t) for t in src.train)),
      'heldout_tokens': int(sum(len(t) for t in src.heldout)),
      'train_windows': len(Windows(src.train, seq_len)),
      'heldout_windows': len(Windows(src.heldout, seq_len)),
  }


def describe(cfg: DataConfig) -> dict[str, Any]:
  """Corpus statistics for logging.

  Args:
    cfg: the data config.
  Returns:
    A JSON-friendly dict. One source: its root, kind ('text' / 'shards'),
    split mode, and per split the number of files (or shards), tokens and
    seq_len windows. A mixture: {'mixture': [that dict + 'weight', ...]}.
    Both also give 'tokenizer' and 'vocab_size'.
  Raises:
    DataError: as `make_train_iterator`.
  """
  sources = load_sources(cfg)
  tok = sources[0][0].tokenizer
  common = {'tokenizer': tok.path or tok.name, 'vocab_size': tok.vocab_size}
  if cfg.mixture is None:
    return {**_describe_source(sources[0][0], cfg.seq_len), **common}
  return {'mixture': [{**_describe_source(s, cfg.seq_len), 'weight': w} for s, w in sources],
          **common}
