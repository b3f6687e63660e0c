"""Text and pre-tokenized data: tokenizers, shards, packing, mixtures, grain batches.

Modules, one concern each:
  tokenizer  'bytes' or a Hugging Face tokenizer.json; BPE training
  corpus     text sources read into tokens, file-level train/held-out split
  shards     pre-tokenized shard directories: format, writing, verification
  sources    one config entry -> train/held-out token streams
  packing    streams -> fixed-length rows (+ segment ids / positions)
  pipeline   grain: seeded shuffle, mixtures, per-host rows, prefetch

With the byte tokenizer, ids 0..255 are UTF-8 bytes, `EOS_ID` ends every
document and `PAD_ID` is reserved (the pipeline packs documents densely and
never pads).
"""

from mjax.data.corpus import EOS_ID, PAD_ID, VOCAB_SIZE, load_corpus
from mjax.data.errors import DataError
from mjax.data.packing import document_ids_and_positions
from mjax.data.pipeline import (describe, make_eval_batches, make_train_iterator, position,
                                restore_position, skip, whole_batches)
from mjax.data.shards import open_shards, prepare_shards, verify_shards
from mjax.data.sources import load_sources, run_tokenizer
from mjax.data.tokenizer import load_tokenizer, never_sampled, train_bpe

__all__ = [
    'EOS_ID', 'PAD_ID', 'VOCAB_SIZE', 'DataError',
    'describe', 'document_ids_and_positions', 'load_corpus', 'load_sources', 'load_tokenizer',
    'make_eval_batches', 'make_train_iterator', 'never_sampled', 'open_shards', 'position', 'prepare_shards',
    'restore_position', 'run_tokenizer', 'skip', 'train_bpe',
    'verify_shards', 'whole_batches',
]
