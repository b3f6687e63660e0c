"""Byte-level text data: corpus loading, train/held-out split, grain batches.

Token ids 0..255 are UTF-8 bytes, `EOS_ID` ends every document and `PAD_ID`
is reserved (the pipeline packs documents densely and never pads).
"""

from mjax.data.corpus import EOS_ID, PAD_ID, VOCAB_SIZE, DataError, load_corpus
from mjax.data.pipeline import describe, make_eval_batches, make_train_iterator

__all__ = [
    'EOS_ID', 'PAD_ID', 'VOCAB_SIZE', 'DataError',
    'describe', 'load_corpus', 'make_eval_batches', 'make_train_iterator',
]
