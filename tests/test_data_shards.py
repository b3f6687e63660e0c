"""Tests of pre-tokenized shards: format, equivalence with text, integrity checks, CLI."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import tracemalloc

import gin
import numpy as np
import pytest

from mjax import data
from mjax.cli import prepare_main
from mjax.config import DataConfig
from mjax.data import shards

SEQ = 32


@pytest.fixture(autouse=True)
def _no_gin_bindings():
  """DataConfig is gin-configurable: bindings left by another test would change its defaults."""
  gin.clear_config()
  yield
  gin.clear_config()


def _write_corpus(root, n_files=40):
  rng = np.random.default_rng(1)
  words = ['def', 'return', 'x', 'lambda', 'énergie', '数据', 'yield', '(', ')', ':']
  for i in range(n_files):
    sub = root / f'pkg{i % 3}' if i % 2 else root
    sub.mkdir(parents=True, exist_ok=True)
    text = ' '.join(rng.choice(words, size=rng.integers(40, 120)))
    (sub / f'mod_{i:02d}.py').write_text(f'# file {i}\n{text}\n', encoding='utf-8')
  return root


@pytest.fixture(scope='module')
def corpus_dir(tmp_path_factory):
  return _write_corpus(tmp_path_factory.mktemp('text') / 'src')


@pytest.fixture(scope='module')
def shard_dir(tmp_path_factory, corpus_dir):
  out = tmp_path_factory.mktemp('shards') / 'out'
  data.prepare_shards(str(corpus_dir), str(out), shard_tokens=1500, heldout_fraction=0.2)
  return out


@pytest.fixture
def shard_copy(tmp_path, shard_dir):
  """A private copy to damage."""
  dst = tmp_path / 'copy'
  shutil.copytree(shard_dir, dst)
  return dst


def _cfg(path, **kw):
  kw.setdefault('seq_len', SEQ)
  kw.setdefault('heldout_fraction', 0.2)
  return DataConfig(source=str(path), **kw)


def _manifest(d):
  return json.loads((d / 'manifest.json').read_text())


def _rewrite_manifest(d, m):
  (d / 'manifest.json').write_text(json.dumps(m))


def test_manifest_fields_and_files(shard_dir):
  m = _manifest(shard_dir)
  assert m['format'] == 'mjax-token-shards' and m['version'] == 1
  assert m['dtype'] == 'uint16' and m['eos_id'] == data.EOS_ID
  assert m['tokenizer'] == {'name': 'bytes', 'path': None, 'vocab_size': 258, 'eos_id': 256,
                            'sha256': None}
  train = [e for e in m['shards'] if e['split'] == 'train']
  assert len(train) > 2, 'shard_tokens=1500 must split the train split into several shards'
  for e in m['shards']:
    raw = (shard_dir / e['file']).read_bytes()
    assert e['bytes'] == len(raw) == 2 * e['tokens']
    assert e['sha256'] == hashlib.sha256(raw).hexdigest()
    tokens = np.frombuffer(raw, '<u2')
    assert e['documents'] == int(np.sum(tokens == data.EOS_ID))
    assert tokens[-1] == data.EOS_ID   # documents stay whole
  # Every shard but the last of a split reached the limit at a document end.
  assert all(e['tokens'] >= 1500 for e in train[:-1])


def test_shards_hold_exactly_the_text_split(corpus_dir, shard_dir):
  c = data.load_corpus(_cfg(corpus_dir))
  s = data.open_shards(str(shard_dir))
  assert isinstance(s.train[0], shards.ShardTokens)  # read on demand, not loaded
  np.testing.assert_array_equal(np.concatenate(s.train), c.train_tokens)
  np.testing.assert_array_equal(np.concatenate(s.heldout), c.heldout_tokens)


def test_single_shard_source_gives_the_text_batches(tmp_path, corpus_dir):
  out = tmp_path / 'one'
  data.prepare_shards(str(corpus_dir), str(out), heldout_fraction=0.2)
  text_it = data.make_train_iterator(_cfg(corpus_dir, document_attention=True), 4)
  shard_it = data.make_train_iterator(_cfg(out, document_attention=True), 4)
  for _ in range(3):
    x, y = next(text_it), next(shard_it)
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  ev_text = data.make_eval_batches(_cfg(corpus_dir), 4, 2)
  ev_shard = data.make_eval_batches(_cfg(out), 4, 2)
  for x, y in zip(ev_text, ev_shard):
    np.testing.assert_array_equal(x['inputs'], y['inputs'])


def test_windows_never_cross_shards(shard_dir):
  s = data.open_shards(str(shard_dir))
  windows = {}
  for shard in s.train:
    for i in range((len(shard) - 1) // SEQ):
      windows[bytes(np.asarray(shard[i * SEQ:i * SEQ + SEQ + 1]).tobytes())] = True
  batch = next(data.make_train_iterator(_cfg(shard_dir), 16))
  info = data.describe(_cfg(shard_dir))
  assert info['kind'] == 'shards' and info['train_windows'] == len(windows)
  for inp, tgt in zip(batch['inputs'], batch['targets']):
    w = np.append(inp, tgt[-1]).astype('<u2').tobytes()
    assert w in windows


def test_eval_batches_come_from_heldout_shards(shard_dir):
  s = data.open_shards(str(shard_dir))
  assert len(s.heldout) > 1
  # Held-out windows in order, shard after shard, none across a boundary.
  expected = [shard[i * SEQ:i * SEQ + SEQ] for shard in s.heldout
              for i in range((len(shard) - 1) // SEQ)]
  num_batches = len(expected) // 4 + 1     # asks for more: must wrap around
  batches = data.make_eval_batches(_cfg(shard_dir), 4, num_batches)
  rows = np.concatenate([b['inputs'] for b in batches])
  for j, row in enumerate(rows):
    np.testing.assert_array_equal(row, expected[j % len(expected)])


def test_a_held_out_split_too_small_for_a_batch_asks_for_shards_prepared_again(shard_dir):
  # DataConfig.heldout_fraction does not split shards: mjax-prepare's
  # --heldout_fraction did, and it is what to change.
  n = data.describe(_cfg(shard_dir))['heldout_windows']
  with pytest.raises(data.DataError, match=r'held-out split .*prepared again with a larger mjax-prepare '
                     r'--heldout_fraction \(these were made with 0\.2\)') as e:
    data.make_eval_batches(_cfg(shard_dir), n + 1, 1)
  assert 'DataConfig.heldout_fraction' not in str(e.value)


def test_shard_ends_no_window_reads_are_said(tmp_path, corpus_dir, shard_dir, caplog):
  # Windows never cross shards: each shard's last < seq_len + 1 tokens are
  # never read. With small shards that was data dropped without a word.
  small = tmp_path / 'small'
  data.prepare_shards(str(corpus_dir), str(small), shard_tokens=100, heldout_fraction=0.2)
  with caplog.at_level('WARNING', logger='mjax.data'):
    info = data.describe(_cfg(small))
    next(data.make_train_iterator(_cfg(small), 4))
  said = [r.getMessage() for r in caplog.records if 'never read' in r.getMessage()]
  assert len(said) == 1, said   # once, however many readers
  tokens = sum(len(t) for t in data.open_shards(str(small)).train)
  lost = 100 * (tokens - (info['train_windows'] * SEQ + len(data.open_shards(str(small)).train))) / tokens
  assert f"{lost:.1f}% of the train split's {tokens} tokens are never read" in said[0], said
  assert '--shard_tokens (shards of at least 3200 tokens' in said[0], said
  caplog.clear()
  one = tmp_path / 'one'   # mjax-prepare's default size: one shard, a tail of under a window
  data.prepare_shards(str(corpus_dir), str(one), heldout_fraction=0.2)
  with caplog.at_level('WARNING', logger='mjax.data'):
    next(data.make_train_iterator(_cfg(one), 4))
    # Its one tail over 1% of the split (a window of 513 in ~11k tokens, ~4k
    # held out): no shard size reads more of it, so nothing to advise.
    assert len(data.open_shards(str(one)).train) == len(data.open_shards(str(one)).heldout) == 1
    next(data.make_train_iterator(_cfg(one, seq_len=512), 2))
    data.make_eval_batches(_cfg(one, seq_len=512), 1, 1)
  assert not [r for r in caplog.records if 'never read' in r.getMessage()]
  # No shard as long as a window: said as that, not 'use a larger source'.
  n = len(data.open_shards(str(shard_dir)).train)
  with pytest.raises(data.DataError, match=rf'every one of the {n} train shard\(s\) is shorter than one window of '
                     r'seq_len \+ 1 = 8193 tokens .* larger mjax-prepare --shard_tokens'):
    data.make_train_iterator(_cfg(shard_dir, seq_len=8192), 1)
  # Shorter than a window in all: too small a source, whatever the shard size.
  tokens = sum(len(t) for t in data.open_shards(str(one)).train)
  with pytest.raises(data.DataError, match=r'the train split has \d+ tokens .*use a larger source') as e:
    data.make_train_iterator(_cfg(one, seq_len=tokens), 1)
  assert '--shard_tokens' not in str(e.value)


def test_open_rejects_missing_shard(shard_copy):
  os.remove(shard_copy / 'train-00001.bin')
  with pytest.raises(data.DataError, match=r'train-00001\.bin: missing'):
    data.open_shards(str(shard_copy))
  # A directory in a shard's place is said to be one, not called missing.
  os.mkdir(shard_copy / 'train-00001.bin')
  with pytest.raises(data.DataError, match=r'train-00001\.bin: a directory, not a shard file \(listed in'):
    data.open_shards(str(shard_copy))


def test_open_rejects_truncated_shard(shard_copy):
  path = shard_copy / 'train-00000.bin'
  size = path.stat().st_size
  with open(path, 'r+b') as fh:
    fh.truncate(size - 2)
  with pytest.raises(data.DataError) as err:
    data.open_shards(str(shard_copy))
  msg = str(err.value)
  assert str(path) in msg and f'size {size - 2} bytes, expected {size}' in msg


_READ_WHILE_TRUNCATED = textwrap.dedent('''
    import os, sys
    import numpy as np
    from mjax import data
    from mjax.config import DataConfig
    from mjax.data.packing import Windows

    out = sys.argv[1]
    path = os.path.join(out, 'train-00000.bin')
    windows = Windows(data.open_shards(out).train, 32)
    last = np.arange(len(windows) - 4, len(windows))
    windows.gather(last)                      # whole: reads fine
    it = data.make_train_iterator(DataConfig(source=out, seq_len=32, heldout_fraction=0.2), 8)
    next(it)
    os.truncate(path, os.path.getsize(path) // 4)
    windows.gather(np.arange(4))              # before the new end: still fine
    for name, read in (('windows', lambda: windows.gather(last)),
                       ('iterator', lambda: [next(it) for _ in range(100)])):
      try:
        read()
      except data.DataError as e:
        print(name, 'DataError:', e)
      else:
        sys.exit(name + ': read past the end of a truncated shard without a DataError')
    ''')


def test_a_shard_truncated_during_training_raises_data_error(tmp_path, corpus_dir):
  # A memory-mapped shard truncated under a running job killed it with
  # SIGBUS and no message; run in a subprocess so that such a death fails
  # this test instead of killing pytest.
  out = tmp_path / 'live'
  data.prepare_shards(str(corpus_dir), str(out), heldout_fraction=0.2)
  path = out / 'train-00000.bin'
  size = path.stat().st_size
  assert [e['split'] for e in _manifest(out)['shards']].count('train') == 1
  assert size > 4 * 4096, 'the shard must span pages past its truncated end'
  proc = subprocess.run([sys.executable, '-c', _READ_WHILE_TRUNCATED, str(out)], capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, f'exit status {proc.returncode} (negative: killed by that signal)\n{proc.stderr}'
  lines = proc.stdout.splitlines()
  assert [line.split()[0] for line in lines] == ['windows', 'iterator']
  for line in lines:
    assert f'{path}: size {size // 4} bytes, expected {size}' in line
    assert 'truncated or rewritten while this run read it' in line and 'mjax-prepare' in line


def test_shard_tokens_read_like_an_array(shard_dir):
  s = data.open_shards(str(shard_dir))
  t = s.train[0]
  whole = np.fromfile(shard_dir / 'train-00000.bin', '<u2')
  assert len(t) == len(whole) and t.shape == whole.shape and t.dtype == whole.dtype
  np.testing.assert_array_equal(np.asarray(t), whole)
  for key in (slice(5, 40), slice(None, 7), slice(-9, None), slice(3, 50, 4), slice(40, 2, -3),
              slice(10, 10)):
    np.testing.assert_array_equal(t[key], whole[key])
  assert t[0] == whole[0] and t[-1] == whole[-1]
  np.testing.assert_array_equal(t.windows(np.array([0, 3, len(t) - 33]), 33),
                                whole[np.array([0, 3, len(t) - 33])[:, None] + np.arange(33)])
  with pytest.raises(IndexError):
    t.windows(np.array([len(t) - 32]), 33)


def test_a_failing_read_names_the_shard(shard_dir, monkeypatch):
  # EIO from a dying disk (or ESTALE on NFS) came out of a reader thread as
  # a bare OSError; it names the shard now.
  import errno
  t = data.open_shards(str(shard_dir)).train[0]
  def eio(*_):
    raise OSError(errno.EIO, 'Input/output error')
  monkeypatch.setattr(os, 'pread', eio)
  monkeypatch.setattr(os, 'preadv', eio)
  from mjax.errors import Fault
  for read in (lambda: t[0:8], lambda: t.windows(np.array([0]), 8)):
    # The storage's failure: a Fault (exit 1), which the driver restarts.
    with pytest.raises(Fault, match=r'train-00000\.bin: reading the shard failed \(Input/output error\)'):
      read()

  def eacces(*_):
    raise OSError(errno.EACCES, 'Permission denied')
  monkeypatch.setattr(os, 'pread', eacces)
  with pytest.raises(data.DataError, match=r'train-00000\.bin: reading the shard failed \(Permission denied\)'):
    t.windows(np.array([0]), 8)


def _write_mixed_source(root):
  """Text files and JSON Lines with blank lines, CRLF endings, bare JSON
  strings, a lone surrogate and documents that are not text (no RNG, so the
  bytes are the same everywhere)."""
  words = ['def', 'return', 'énergie', '数据', 'yield', '(x)', ':']
  root.mkdir(parents=True)
  for i in range(6):
    (root / f'notes_{i}.txt').write_text(' '.join(words[(i + j) % 7] for j in range(i * 13)),
                                         encoding='utf-8')
  lines = []
  for i in range(3000):
    text = f'doc {i} ' + ' '.join(words[(i * 5 + j * 3) % 7] for j in range(i % 29))
    kind = i % 11
    lines.append(b'' if kind == 0 else b'  \r' if kind == 1 else
                 json.dumps(text).encode() + b'\r' if kind == 2 else
                 json.dumps({'text': 'bad \udc80 ' + text}).encode() if kind == 3 else
                 json.dumps({'text': '\x00' + text}).encode() if kind == 4 else
                 json.dumps({'text': text, 'id': i}).encode())
  (root / 'part-0.jsonl').write_bytes(b'\n'.join(lines))          # no newline at the end
  (root / 'part-1.jsonl').write_bytes(b'\n'.join(lines[::-7]) + b'\n')
  (root / 'blank.jsonl').write_bytes(b'\n \n')
  return root


# sha256 of the manifest's shard entries (each with its file's sha256) that
# mjax-prepare wrote for _write_mixed_source when it held every document name
# in memory: streaming must not change a byte.
_MIXED_SHARDS_SHA256 = '6841dcd514c03cfe60b1eb171b7d5d8e3b9c01332f41e73a2b49d4f5583f1eb6'


@pytest.mark.parametrize('batch_docs', [None, 7])
def test_prepare_jsonl_output_is_pinned(tmp_path, monkeypatch, batch_docs):
  src = _write_mixed_source(tmp_path / 'src')
  if batch_docs:   # many small read batches: the output must not depend on them
    monkeypatch.setattr(shards, '_READ_BATCH_DOCS', batch_docs, raising=False)
    monkeypatch.setattr(shards, '_READ_BATCH_BYTES', 500)
  out = tmp_path / 'out'
  m = data.prepare_shards(str(src), str(out), shard_tokens=3000, heldout_fraction=0.1, file_pattern='*')
  assert m == _manifest(out) and m['split'] == 'file' and len(m['shards']) > 10
  assert hashlib.sha256(json.dumps(m['shards'], sort_keys=True).encode()).hexdigest() == _MIXED_SHARDS_SHA256
  c = data.load_corpus(DataConfig(source=str(src), file_pattern='*', heldout_fraction=0.1))
  s = data.open_shards(str(out))
  np.testing.assert_array_equal(np.concatenate(s.train), c.train_tokens)
  np.testing.assert_array_equal(np.concatenate(s.heldout), c.heldout_tokens)


def test_prepare_memory_does_not_grow_with_documents(tmp_path, monkeypatch):
  # Holding every document's name and split flag cost ~360 bytes per
  # document (tens of GB for a large crawl); streamed, what prepare holds is
  # one read batch. tracemalloc counts Python and numpy allocations exactly.
  n = 50_000
  (tmp_path / 'src').mkdir()
  with open(tmp_path / 'src' / 'docs.jsonl', 'w') as fh:
    fh.writelines(f'{{"text": "document {i}"}}\n' for i in range(n))
  monkeypatch.setattr(shards, '_READ_BATCH_DOCS', 1000, raising=False)
  tracemalloc.start()
  try:
    m = data.prepare_shards(str(tmp_path / 'src'), str(tmp_path / 'out'), file_pattern='*.jsonl')
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert sum(e['documents'] for e in m['shards']) == n
  assert peak < 40 * n, f'peak {peak:,} bytes traced for {n:,} documents'


def test_altered_shard_fails_only_checksum_verification(shard_copy):
  path = shard_copy / 'train-00000.bin'
  raw = bytearray(path.read_bytes())
  raw[10] = ord('Z') if raw[10] != ord('Z') else ord('Y')   # same size, still valid ids
  path.write_bytes(bytes(raw))
  data.open_shards(str(shard_copy))          # sizes and sampled ids are fine
  expected = _manifest(shard_copy)['shards'][0]['sha256']
  with pytest.raises(data.DataError) as err:
    data.open_shards(str(shard_copy), verify_checksums=True)
  msg = str(err.value)
  assert str(path) in msg and expected in msg and hashlib.sha256(raw).hexdigest() in msg
  with pytest.raises(data.DataError, match='sha256'):
    data.make_train_iterator(_cfg(shard_copy, verify_checksums=True), 4)


def test_out_of_vocabulary_id_is_caught_by_the_sampled_check(shard_copy):
  path = shard_copy / 'train-00000.bin'
  tokens = np.fromfile(path, '<u2')
  tokens[3] = 300                             # in the first sampled block
  tokens.tofile(path)
  with pytest.raises(data.DataError) as err:
    data.open_shards(str(shard_copy))
  msg = str(err.value)
  assert str(path) in msg and 'token id 300 at position 3' in msg and 'expected < 258' in msg


def test_out_of_vocabulary_id_outside_the_sample_is_caught_by_verify(tmp_path):
  # One big shard, so most positions are outside the sampled blocks.
  rng = np.random.default_rng(0)
  src = tmp_path / 'big.txt'
  src.write_bytes(rng.integers(97, 123, size=200_000, dtype=np.uint8).tobytes())
  out = tmp_path / 'big'
  data.prepare_shards(str(src), str(out), heldout_fraction=0.1)
  path = out / 'train-00000.bin'
  tokens = np.fromfile(path, '<u2')
  pos = 100_000 + 517                        # between two sampled blocks
  tokens[pos] = 4000
  tokens.tofile(path)
  m = _manifest(out)                         # as if made by another tokenizer:
  m['shards'][0]['sha256'] = hashlib.sha256(path.read_bytes()).hexdigest()  # checksum agrees
  _rewrite_manifest(out, m)
  data.open_shards(str(out))
  with pytest.raises(data.DataError, match=f'token id 4000 at position {pos} .*expected < 258'):
    data.open_shards(str(out), verify_checksums=True)
  # Past the sampled check, the training stream stops at the batch that holds
  # it (the model would read the id as NaN: a numerical fault, rolled back
  # and retried, not the data error it is).
  it = data.make_train_iterator(DataConfig(source=str(out), seq_len=64), 8)
  with pytest.raises(data.DataError, match=r"token id 4000 .* outside the tokenizer's 258 ids"):
    for _ in range(200_000 // (8 * 64) + 1):
      next(it)


def test_document_count_is_verified(shard_copy):
  m = _manifest(shard_copy)
  m['shards'][0]['documents'] += 1
  _rewrite_manifest(shard_copy, m)
  with pytest.raises(data.DataError, match='expected .* documents'):
    data.open_shards(str(shard_copy), verify_checksums=True)


def test_empty_corpus_and_bad_manifests(shard_copy):
  m = _manifest(shard_copy)
  _rewrite_manifest(shard_copy, {**m, 'shards': [e for e in m['shards'] if e['split'] != 'train']})
  with pytest.raises(data.DataError, match='empty corpus: found 0 train tokens'):
    data.open_shards(str(shard_copy))
  _rewrite_manifest(shard_copy, {**m, 'version': 7})
  with pytest.raises(data.DataError, match='version 7 is not supported, expected 1'):
    data.open_shards(str(shard_copy))
  # An end-of-sequence id that is no integer: a string was a TypeError traceback, a float trained.
  for eos in ('3', 3.5, True):
    _rewrite_manifest(shard_copy, {**m, 'eos_id': eos})
    with pytest.raises(data.DataError, match=rf'eos_id {eos!r} is not a token id of the vocabulary '
                                             r'\(expected an integer'):
      data.open_shards(str(shard_copy))
  (shard_copy / 'manifest.json').write_text('{not json')
  with pytest.raises(data.DataError, match='manifest.json: not valid JSON'):
    data.open_shards(str(shard_copy))
  with pytest.raises(data.DataError, match='manifest.json is a file, not a shard directory'):
    data.open_shards(str(shard_copy / 'manifest.json'))
  with pytest.raises(data.DataError, match='nowhere: no such directory'):   # not "no manifest.json"
    data.open_shards(str(shard_copy / 'nowhere'))


def test_prepare_refuses_a_non_empty_output(tmp_path, corpus_dir, shard_dir):
  with pytest.raises(data.DataError, match='not an empty directory; choose a new one.$'):
    data.prepare_shards(str(corpus_dir), str(shard_dir))
  (tmp_path / 'half').mkdir()
  (tmp_path / 'half' / 'train-00000.bin').write_bytes(b'\0' * 8)      # an interrupted run's
  with pytest.raises(data.DataError, match='what an mjax-prepare killed midway leaves'):
    data.prepare_shards(str(corpus_dir), str(tmp_path / 'half'))
  # The input corpus given as the output: never called a leftover to remove.
  with pytest.raises(data.DataError, match='not an empty directory; choose a new one.$'):
    data.prepare_shards(str(corpus_dir), str(corpus_dir))
  # A file is said to be one, not "not an empty directory".
  (tmp_path / 'a_file').write_text('x')
  with pytest.raises(data.DataError, match=r'a_file: is a file, not a directory; choose a new directory'):
    data.prepare_shards(str(corpus_dir), str(tmp_path / 'a_file'))


def test_an_interrupted_prepare_leaves_nothing(tmp_path, corpus_dir, monkeypatch):
  # Ctrl-C or SIGTERM (which the tools turn into an exception) midway: the
  # shards written so far go, and the same command then runs as it is.
  from mjax.data import shards
  calls = []
  real = shards._ShardWriter.add

  def add(self, tokens):
    calls.append(1)
    if len(calls) == 2:
      raise KeyboardInterrupt
    real(self, tokens)
  monkeypatch.setattr(shards._ShardWriter, 'add', add)
  with pytest.raises(KeyboardInterrupt):
    data.prepare_shards(str(corpus_dir), str(tmp_path / 'out'), shard_tokens=200, heldout_fraction=0.2)
  assert len(calls) == 2 and not (tmp_path / 'out').exists()
  monkeypatch.undo()
  data.prepare_shards(str(corpus_dir), str(tmp_path / 'out'), shard_tokens=200, heldout_fraction=0.2)
  assert (tmp_path / 'out' / 'manifest.json').exists()


def test_an_output_that_cannot_be_written_is_bad_input_and_leaves_nothing(tmp_path, corpus_dir, monkeypatch):
  # A path under a file, and a disk that fills midway: one DataError (exit 2)
  # each, not an OSError's traceback, and nothing left in the output.
  import errno
  from mjax.data import shards
  (tmp_path / 'a_file').write_text('x')
  with pytest.raises(data.DataError, match=r'cannot be made: .*a_file is a file, not a directory\. Give --output'):
    data.prepare_shards(str(corpus_dir), str(tmp_path / 'a_file' / 'out'))
  real = shards._ShardWriter._open

  class Full:   # a shard file on a disk that is full
    def __init__(self, fh):
      self.close = fh.close

    def write(self, data):
      raise OSError(errno.ENOSPC, 'No space left on device')

  def full(self):
    real(self)
    self._fh = Full(self._fh)
  monkeypatch.setattr(shards._ShardWriter, '_open', full)
  with pytest.raises(data.DataError, match='writing the shards failed: No space left on device. Nothing was kept'):
    data.prepare_shards(str(corpus_dir), str(tmp_path / 'out'), shard_tokens=200, heldout_fraction=0.2)
  assert not (tmp_path / 'out').exists()


def test_prepare_and_tokenizer_write_nothing_into_a_runs_checkpoints(tmp_path, corpus_dir, capsys):
  # A run's checkpoint directory holds its steps and nothing else: a
  # numbered folder there reads as a damaged step.
  from mjax import cli
  from mjax.checkpoint.directories import OWNER_FILE
  ck = tmp_path / 'run' / 'checkpoints'
  ck.mkdir(parents=True)
  (ck / OWNER_FILE).write_text(json.dumps({'workdir': str(tmp_path / 'run')}))
  for main, argv in [(cli.prepare_main, ['--input', str(corpus_dir), '--output', str(ck / '55')]),
                     (cli.tokenizer_main, ['--input', str(corpus_dir), '--vocab_size', '300',
                                           '--output', str(ck / 'tok.json')])]:
    with pytest.raises(SystemExit) as exit_info:
      main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and 'a checkpoint directory of a training run' in err, err
    assert err.rstrip().endswith('give --output a path outside it.'), err
  assert os.listdir(ck) == [OWNER_FILE]


def test_a_tool_interrupted_says_so_and_exits_130(capsys):
  from mjax import cli

  def interrupted(_):
    raise KeyboardInterrupt
  wrapped = cli.entry_point('mjax-x')(interrupted)
  with pytest.raises(SystemExit) as exit_info:
    wrapped([])
  assert exit_info.value.code == 130 and capsys.readouterr().err == 'mjax-x: interrupted\n'


def test_prepare_splits_a_single_file_by_position(tmp_path):
  src = tmp_path / 'one.txt'
  src.write_text(''.join(chr(c) for c in range(32, 127)) * 50 + 'ünïcödé\n' * 40)
  out = tmp_path / 'one'
  said = []
  m = data.prepare_shards(str(src), str(out), heldout_fraction=0.25, log=said.append)
  c = data.load_corpus(DataConfig(source=str(src), heldout_fraction=0.25))
  s = data.open_shards(str(out))
  assert m['split'] == 'position'
  # One document cut in two: no side holds it whole, and the log says why
  # its counts are 0 and 1.
  assert said[0].endswith('0 documents') and said[1].endswith('1 document'), said
  assert 'cuts the token stream inside a document' in said[2]
  # Nothing held out: no cut to speak of.
  said.clear()
  (tmp_path / 'short.txt').write_text('hi\n')
  data.prepare_shards(str(tmp_path / 'short.txt'), str(tmp_path / 'all'), heldout_fraction=0.01, log=said.append)
  assert len(said) == 2 and said[1].startswith('heldout: 0 shard(s)'), said
  np.testing.assert_array_equal(np.concatenate(s.train), c.train_tokens)
  np.testing.assert_array_equal(np.concatenate(s.heldout), c.heldout_tokens)


def test_prepare_splits_as_the_text_does_when_a_side_held_only_files_that_are_not_text(tmp_path):
  """The text source leaves out files that are not text before it chooses
  by file or by position; shards chose before, and a held-out side of
  nothing but a binary file gave a by-file split with no held-out shard
  while the text cut the stream."""
  from mjax.data import corpus
  src = tmp_path / 'src'
  src.mkdir()
  text = next(f'a{i}.txt' for i in range(100) if not corpus.is_heldout(f'a{i}.txt', 0.2))
  binary = next(f'b{i}.txt' for i in range(100) if corpus.is_heldout(f'b{i}.txt', 0.2))
  (src / text).write_text('hello world\n' * 500)
  (src / binary).write_bytes(b'\x00\x01' * 500)
  c = data.load_corpus(DataConfig(source=str(src), file_pattern='*.txt', heldout_fraction=0.2))
  m = data.prepare_shards(str(src), str(tmp_path / 'out'), file_pattern='*.txt', heldout_fraction=0.2)
  assert c.split == m['split'] == 'position'
  s = data.open_shards(str(tmp_path / 'out'))
  np.testing.assert_array_equal(np.concatenate(s.train), c.train_tokens)
  np.testing.assert_array_equal(np.concatenate(s.heldout), c.heldout_tokens)
  assert sorted(os.listdir(tmp_path / 'out')) == ['heldout-00000.bin', 'manifest.json', 'train-00000.bin']


def test_prepare_and_verify_commands(tmp_path, corpus_dir, capsys):
  out = tmp_path / 'cli'
  prepare_main(['--input', str(corpus_dir), '--output', str(out), '--shard_tokens', '2000',
                '--heldout_fraction', '0.2'])
  assert 'manifest.json' in capsys.readouterr().out
  prepare_main(['--verify', str(out)])
  report = json.loads(capsys.readouterr().out)
  assert report['ok'] and report['train']['shards'] >= 2 and report['heldout']['documents'] > 0
  victim = out / 'heldout-00000.bin'
  victim.write_bytes(victim.read_bytes()[:-2] + b'\x00\x00')
  with pytest.raises(SystemExit) as exit_info:
    prepare_main(['--verify', str(out)])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert 'mjax-prepare: error:' in err and str(victim) in err and 'sha256' in err


def test_prepare_of_shards_says_they_are_prepared_already(tmp_path, shard_dir, capsys):
  # It said to read them "with mjax.data.sources.load_source", a Python
  # function, to someone at the command line.
  with pytest.raises(SystemExit) as exit_info:
    prepare_main(['--input', str(shard_dir), '--output', str(tmp_path / 'again')])
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and 'already prepared' in err and 'load_source' not in err
  assert f'DataConfig.source = {str(shard_dir)!r}' in err and f'mjax-prepare --verify {shard_dir}' in err


def test_shards_and_their_text_name_their_content_alike_wherever_they_lie(tmp_path, shard_dir, shard_copy,
                                                                           corpus_dir):
  """A saved position is checked against the shards' content (their
  manifest's sha256s), not their path: a copy is the same data, shards of
  other text are not (checked by `mjax.data.pipeline.fingerprint`)."""
  from mjax.config import DataConfig
  from mjax.data.sources import load_source
  content = lambda root: load_source(str(root), DataConfig(source=str(root))).content
  assert content(shard_dir) == content(shard_copy) != ''
  other = tmp_path / 'other'
  shutil.copytree(corpus_dir, other)
  next(other.rglob('*.py')).write_text('# another file\n', encoding='utf-8')
  data.prepare_shards(str(other), str(tmp_path / 'shards2'), shard_tokens=1500, heldout_fraction=0.2)
  assert content(tmp_path / 'shards2') != content(shard_dir)
