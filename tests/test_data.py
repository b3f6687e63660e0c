"""Tests of mjax.data: corpus split, packing, shuffling, sharding, resume."""

import json
import os
import zlib

import numpy as np
import pytest

from mjax import data
from mjax.config import DataConfig
from mjax.data import corpus as corpus_lib

SEQ = 32


def _write_corpus(root, n_files=40):
  """A directory of small text files (some nested, some non-ASCII, one not matching)."""
  rng = np.random.default_rng(0)
  words = ['def', 'return', 'x', 'lambda', 'énergie', '数据', 'yield', '(', ')', ':']
  for i in range(n_files):
    sub = root / f'pkg{i % 3}' if i % 2 else root
    sub.mkdir(exist_ok=True)
    text = ' '.join(rng.choice(words, size=rng.integers(40, 120)))
    (sub / f'mod_{i:02d}.py').write_text(f'# file {i}\n{text}\n', encoding='utf-8')
  (root / 'notes.txt').write_text('not python\n')
  return root


@pytest.fixture
def corpus_dir(tmp_path):
  return _write_corpus(tmp_path / 'src')


def _cfg(path, **kw):
  kw.setdefault('seq_len', SEQ)
  kw.setdefault('heldout_fraction', 0.2)
  kw.setdefault('num_threads', 2)
  kw.setdefault('prefetch', 2)
  return DataConfig(source=str(path), **kw)


def _take(it, n):
  return [next(it) for _ in range(n)]


def _assert_same(batches_a, batches_b):
  assert len(batches_a) == len(batches_b)
  for a, b in zip(batches_a, batches_b):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])


def test_shapes_dtypes_and_windows(corpus_dir):
  cfg = _cfg(corpus_dir)
  batch = next(data.make_train_iterator(cfg, 8))
  assert set(batch) == {'inputs', 'targets', 'loss_mask'}
  for k in ('inputs', 'targets'):
    assert batch[k].shape == (8, SEQ) and batch[k].dtype == np.int32
  assert batch['loss_mask'].shape == (8, SEQ) and batch['loss_mask'].dtype == np.float32
  assert np.all(batch['loss_mask'] == 1.0)
  np.testing.assert_array_equal(batch['targets'][:, :-1], batch['inputs'][:, 1:])
  # Every row is a stride-aligned window of the train stream.
  tokens = data.load_corpus(cfg).train_tokens
  for inp, tgt in zip(batch['inputs'], batch['targets']):
    starts = [s for s in range(0, len(tokens) - SEQ, SEQ) if np.array_equal(tokens[s:s + SEQ], inp)]
    assert starts, 'row is not a window of the train split'
    np.testing.assert_array_equal(tokens[starts[0] + 1:starts[0] + SEQ + 1], tgt)


def test_split_by_file_is_disjoint_and_follows_crc32(corpus_dir):
  c = data.load_corpus(_cfg(corpus_dir))
  assert c.split == 'file'
  assert set(c.train_files).isdisjoint(c.heldout_files)
  all_files = sorted(c.train_files + c.heldout_files)
  assert len(all_files) == 40 and 'notes.txt' not in all_files
  assert 'pkg1/mod_01.py' in all_files  # nested, '/'-separated
  for f in all_files:
    held = zlib.crc32(f.encode()) / 2**32 < 0.2
    assert (f in c.heldout_files) == held
  assert c.heldout_files and c.train_files


def test_tokens_are_bytes_with_eos_between_documents(corpus_dir):
  c = data.load_corpus(_cfg(corpus_dir))
  for files, tokens in ((c.train_files, c.train_tokens), (c.heldout_files, c.heldout_tokens)):
    assert tokens.max() < data.VOCAB_SIZE and data.PAD_ID not in tokens
    expected = []
    for f in files:
      expected += list((corpus_dir / f).read_bytes()) + [data.EOS_ID]
    np.testing.assert_array_equal(tokens, expected)
    assert np.sum(tokens == data.EOS_ID) == len(files)


def test_vocab_matches_config():
  assert data.VOCAB_SIZE == 258 and data.EOS_ID == 256 and data.PAD_ID == 257


def test_determinism_and_seed(corpus_dir):
  cfg = _cfg(corpus_dir)
  a = _take(data.make_train_iterator(cfg, 4), 3)
  b = _take(data.make_train_iterator(cfg, 4), 3)
  _assert_same(a, b)
  c = _take(data.make_train_iterator(_cfg(corpus_dir, shuffle_seed=1), 4), 3)
  assert not all(np.array_equal(x['inputs'], y['inputs']) for x, y in zip(a, c))


def test_each_epoch_is_a_new_permutation(corpus_dir):
  cfg = _cfg(corpus_dir)
  tokens = data.load_corpus(cfg).train_tokens
  n = (len(tokens) - 1) // SEQ
  window_id = {tokens[i * SEQ:i * SEQ + SEQ].tobytes(): i for i in range(n)}
  # A batch of n windows with one process is exactly one epoch.
  it = data.make_train_iterator(cfg, n)
  epochs = [[window_id[row.astype(np.uint16).tobytes()] for row in next(it)['inputs']]
            for _ in range(2)]
  assert sorted(epochs[0]) == list(range(n)) == sorted(epochs[1])
  assert epochs[0] != epochs[1] and epochs[0] != list(range(n))


@pytest.mark.parametrize('process_count', [2, 4])
def test_process_shards_concatenate_to_global_batch(corpus_dir, process_count):
  cfg = _cfg(corpus_dir)
  steps = 3
  whole = _take(data.make_train_iterator(cfg, 8), steps)
  shards = [_take(data.make_train_iterator(cfg, 8, process_index=p, process_count=process_count),
                  steps) for p in range(process_count)]
  for k in range(steps):
    for key in whole[k]:
      assert shards[0][k][key].shape[0] == 8 // process_count
      joined = np.concatenate([shards[p][k][key] for p in range(process_count)])
      np.testing.assert_array_equal(joined, whole[k][key])


def test_get_state_set_state_resumes_exactly(corpus_dir):
  cfg = _cfg(corpus_dir)
  it = data.make_train_iterator(cfg, 4, process_index=1, process_count=2)
  _take(it, 3)
  state = json.loads(json.dumps(it.get_state()))  # must survive serialization
  expected = _take(it, 4)
  resumed = data.make_train_iterator(cfg, 4, process_index=1, process_count=2)
  resumed.set_state(state)
  _assert_same(_take(resumed, 4), expected)


def test_eval_batches_are_ordered_sharded_and_wrap(corpus_dir):
  cfg = _cfg(corpus_dir)
  tokens = data.load_corpus(cfg).heldout_tokens
  n = (len(tokens) - 1) // SEQ
  num_batches = n // 4 + 2  # more than the split holds: must wrap around
  batches = data.make_eval_batches(cfg, 4, num_batches)
  assert len(batches) == num_batches
  rows = np.concatenate([b['inputs'] for b in batches])
  for j, row in enumerate(rows):
    w = (j % n) * SEQ
    np.testing.assert_array_equal(row, tokens[w:w + SEQ])
  _assert_same(batches, data.make_eval_batches(cfg, 4, num_batches))
  halves = [data.make_eval_batches(cfg, 4, 2, process_index=p, process_count=2) for p in (0, 1)]
  for k in range(2):
    np.testing.assert_array_equal(
        np.concatenate([halves[0][k]['targets'], halves[1][k]['targets']]),
        batches[k]['targets'])


def test_single_file_is_split_by_position(tmp_path):
  path = tmp_path / 'one.txt'
  path.write_text(''.join(chr(c) for c in range(32, 127)) * 50 + 'ünïcödé\n' * 40)
  cfg = _cfg(path, heldout_fraction=0.25)
  c = data.load_corpus(cfg)
  assert c.split == 'position'
  full = np.append(np.frombuffer(path.read_bytes(), np.uint8), data.EOS_ID)
  np.testing.assert_array_equal(np.concatenate([c.train_tokens, c.heldout_tokens]), full)
  assert len(c.heldout_tokens) == round(len(full) * 0.25)
  info = data.describe(cfg)
  assert info['source'] == str(path) and info['train_tokens'] == len(c.train_tokens)
  assert next(data.make_train_iterator(cfg, 4))['inputs'].shape == (4, SEQ)
  assert len(data.make_eval_batches(cfg, 4, 2)) == 2


def test_errors_name_the_path(tmp_path, corpus_dir):
  missing = tmp_path / 'nope'
  cases = [
      (lambda: data.make_train_iterator(_cfg(missing), 4), missing, 'no such file'),
      (lambda: data.describe(_cfg(corpus_dir, file_pattern='*.rs')), corpus_dir, 'no files match'),
      (lambda: data.describe(_cfg(corpus_dir, file_pattern='**/*.txt')), corpus_dir,
       'a pattern with "/" never matches; give the name part alone, e.g. \'*.txt\''),
      (lambda: data.make_train_iterator(_cfg(corpus_dir), 4096), corpus_dir, 'train split'),
      (lambda: data.make_eval_batches(_cfg(corpus_dir), 512, 1), corpus_dir, 'held-out split'),
      (lambda: data.make_train_iterator(_cfg(corpus_dir), 6, process_count=4), corpus_dir,
       'not divisible'),
      (lambda: data.make_eval_batches(_cfg(corpus_dir), 6, 1, process_count=4), corpus_dir,
       'not divisible'),
  ]
  for fn, path, what in cases:
    with pytest.raises(data.DataError) as err:
      fn()
    assert str(path) in str(err.value) and what in str(err.value), str(err.value)
  assert issubclass(data.DataError, ValueError)


def test_stdlib_source():
  cfg = DataConfig(source='stdlib', seq_len=64)
  info = data.describe(cfg)
  assert info['split'] == 'file' and info['train_files'] > 500 and info['heldout_files'] > 0
  assert os.path.isfile(os.path.join(info['source'], 'os.py'))
  c = data.load_corpus(cfg)
  assert 'os.py' in c.train_files + c.heldout_files
  assert not any('site-packages' in f or 'dist-packages' in f
                 for f in c.train_files + c.heldout_files)
  assert list(c.train_files) == sorted(c.train_files)
  batch = next(data.make_train_iterator(cfg, 8))
  assert batch['inputs'].shape == (8, 64) and batch['inputs'].max() < data.VOCAB_SIZE
  assert data.make_eval_batches(cfg, 8, 1)[0]['targets'].shape == (8, 64)


def test_data_position_restores_onto_another_number_of_hosts(tmp_path):
  """The saved position is a global step: 2 hosts resuming a 1-host run's
  state read exactly the rows the 1-host run would have read next."""
  from mjax.config import DataConfig as DC
  from mjax.data import make_train_iterator as make
  cfg = DC(source='stdlib', seq_len=32)
  one = make(cfg, 8)
  for _ in range(3):
    next(one)
  state = one.get_state()
  want = next(one)
  halves = []
  for p in range(2):
    it = make(cfg, 8, process_index=p, process_count=2)
    it.set_state(state)
    halves.append(next(it))
  for key in want:
    np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), want[key])


def test_files_that_are_not_text_are_left_out_by_name_and_a_binary_source_is_refused(tmp_path, caplog):
  from mjax.data import corpus as corpus_lib
  from mjax.data.errors import DataError
  src = tmp_path / 'src'
  src.mkdir()
  (src / 'a.txt').write_text('hello world\n' * 50)
  (src / 'b.txt').write_text('more text, ünïcode too\n' * 50)
  (src / 'tool.txt').write_bytes(bytes(range(256)) * 8)          # NUL bytes: a binary
  (src / 'latin1.txt').write_bytes('caf\xe9 '.encode('latin-1') * 40)  # 20% invalid UTF-8
  with caplog.at_level('WARNING'):
    c = corpus_lib.load_text(str(src), '*.txt', 'bytes', 0.0)
  assert set(c.train_files) == {'a.txt', 'b.txt'}
  assert 'left out 2 of 4 files that are not text' in caplog.text
  assert 'tool.txt (NUL bytes)' in caplog.text and 'latin1.txt (20% of it not UTF-8)' in caplog.text
  # JSON Lines records are counted as documents, not files.
  (tmp_path / 'r.jsonl').write_text(json.dumps({'text': 'fine text ' * 20}) + '\n' +
                                    json.dumps({'text': 'a\u0000b'}) + '\n')
  caplog.clear()
  with caplog.at_level('WARNING'):
    corpus_lib.load_text(str(tmp_path / 'r.jsonl'), '*', 'bytes', 0.0)
  assert 'left out 1 of 2 documents that are not text: r.jsonl:2 (NUL bytes)' in caplog.text, caplog.text
  with pytest.raises(DataError, match=r'no text to train on: tool.txt \(NUL bytes\) is not text'):
    corpus_lib.load_text(str(src / 'tool.txt'), '*', 'bytes', 0.0)
  # Empty files are documents, but a source of nothing else is refused, as
  # text and as shards (before, it made a corpus of one end-of-document token).
  from mjax.data.shards import prepare_shards
  blank = tmp_path / 'blank'
  blank.mkdir()
  (blank / 'empty.txt').write_text('')
  (blank / 'spaces.txt').write_text(' \n\t\n')
  (blank / 'tool.txt').write_bytes(b'\0' * 10)
  for many in ('*.txt', 'empty.txt'):
    with pytest.raises(DataError, match=r'no text to train on: its \d text file\(s\) \(.*\) hold nothing but whitespace'):
      corpus_lib.load_text(str(blank), many, 'bytes', 0.5)
  for i in range(8):                # enough files for a split by file
    (blank / f'e{i}.txt').write_text('')
  with pytest.raises(DataError, match=r'none of its 11 documents \(files, or JSON Lines records\) holds text|hold nothing but whitespace'):
    prepare_shards(str(blank), str(tmp_path / 'shards'), file_pattern='*.txt', heldout_fraction=0.2)
  assert not (tmp_path / 'shards').exists()         # nothing left behind to remove first


def test_json_lines_documents_are_split_and_tokenized_one_by_one(tmp_path):
  docs = [f'document {i}: ' + 'x' * (i % 7) for i in range(60)]
  lines = [json.dumps({'text': d, 'meta': i}) if i % 2 else json.dumps(d) for i, d in enumerate(docs)]
  (tmp_path / 'a.jsonl').write_text('\n'.join(lines[:30]) + '\n\n')     # an empty line is no document
  (tmp_path / 'b.jsonl').write_text('\n'.join(lines[30:]))
  (tmp_path / 'note.txt').write_text('plain text file')
  cfg = DataConfig(source=str(tmp_path), file_pattern='*', seq_len=16, heldout_fraction=0.2)
  c = corpus_lib.load_corpus(cfg)
  names = c.train_files + c.heldout_files
  assert len(names) == 61 and 'a.jsonl:1' in names and 'b.jsonl:30' in names and 'note.txt' in names
  # Each document by itself, followed by EOS; the split follows the names' hashes.
  texts = {f'a.jsonl:{i + 1}': d for i, d in enumerate(docs[:30])}
  texts.update({f'b.jsonl:{i + 1}': d for i, d in enumerate(docs[30:])}, **{'note.txt': 'plain text file'})
  for split, files in (('train', c.train_files), ('heldout', c.heldout_files)):
    want = b''.join(texts[f].encode() + b'\x00' for f in files)
    got = getattr(c, f'{split}_tokens')
    assert len(got) == len(want)
    assert bytes(np.where(got == corpus_lib.EOS_ID, 0, got).astype(np.uint8)) == want
    assert all(corpus_lib.is_heldout(f, 0.2) == (split == 'heldout') for f in files)
  assert c.heldout_files and c.train_files


def test_bad_json_line_is_named(tmp_path):
  (tmp_path / 'd.jsonl').write_text('{"text": "fine"}\n{"body": "no text field"}\n')
  with pytest.raises(data.DataError, match=r"d.jsonl line 2: '\{\"body\".*a string 'text' field"):
    corpus_lib.load_corpus(DataConfig(source=str(tmp_path / 'd.jsonl'), seq_len=16))
  # Nested deeper than Python's parser goes: named like any bad line, not a RecursionError.
  (tmp_path / 'd.jsonl').write_text('{"text": "fine"}\n' + '[' * 100_000 + ']' * 100_000 + '\n')
  with pytest.raises(data.DataError, match=r"d.jsonl line 2: '\[\[\[.*nested too deeply to be read"):
    corpus_lib.load_corpus(DataConfig(source=str(tmp_path / 'd.jsonl'), seq_len=16))


def test_json_from_others_nested_too_deeply_is_malformed_json(tmp_path):
  """Every reader of a JSON file a user or another process wrote (run
  records, manifests, configs, facts) handles ValueError: so is too deep
  nesting refused."""
  from mjax import jsonfile
  deep = '[' * 100_000 + ']' * 100_000
  for text in (deep, deep.encode()):
    with pytest.raises(json.JSONDecodeError, match='nested too deeply'):
      jsonfile.loads(text)
  (tmp_path / 'f.json').write_text(deep)
  with open(tmp_path / 'f.json') as fh, pytest.raises(ValueError):
    jsonfile.load(fh)
  assert jsonfile.loads('[[1]]') == [[1]]
  # The run's own files, damaged so: a workdir's claim and its config are unreadable, not a crash.
  from mjax import protocol
  from mjax.checkpoint.directories import is_workdir
  (tmp_path / 'config.json').write_text(deep)
  assert not is_workdir(str(tmp_path))
  os.makedirs(os.path.dirname(protocol.facts_path(str(tmp_path), 0)), exist_ok=True)
  with open(protocol.facts_path(str(tmp_path), 0), 'w') as fh:
    fh.write(deep)
  assert protocol.read_facts(str(tmp_path), 0) == {}


def test_prepare_reads_json_lines(tmp_path):
  from mjax.data import shards
  (tmp_path / 'in').mkdir()
  (tmp_path / 'in' / 'x.jsonl').write_text('\n'.join(json.dumps({'text': f'doc {i} ' * 5}) for i in range(50)))
  shards.prepare_shards(str(tmp_path / 'in'), str(tmp_path / 'out'), 'bytes', file_pattern='*.jsonl',
                 heldout_fraction=0.1)
  manifest = json.loads((tmp_path / 'out' / 'manifest.json').read_text())
  assert manifest['split'] == 'file'
  total = sum(s['tokens'] for s in manifest['shards'])
  assert total == sum(len(f'doc {i} ' * 5) + 1 for i in range(50))


@pytest.mark.parametrize('old_batch, new_batch', [(8, 16), (8, 4), (8, 12)])
def test_position_continues_the_same_rows_after_a_batch_size_change(old_batch, new_batch):
  """A resume with another global batch size reads on from the row where the
  saved run stopped, in the same order: nothing skipped, and at most one
  new batch's worth of rows read again when the boundaries do not line up."""
  from mjax.config import DataConfig as DC
  cfg = DC(source='stdlib', seq_len=32)
  whole = np.concatenate([b['inputs'] for b in _take(data.make_train_iterator(cfg, 4), 12)])
  old = data.make_train_iterator(cfg, old_batch)
  _take(old, 3)
  state = json.loads(json.dumps(data.position(old, old_batch, 32)))
  assert state['global_batch_size'] == old_batch and state['seq_len'] == 32
  resumed = data.make_train_iterator(cfg, new_batch)
  note = data.restore_position(resumed, state, new_batch, 32)
  rows = 3 * old_batch
  start = rows // new_batch * new_batch
  assert f'row {rows}' in note and f'changed from {old_batch} to {new_batch}' in note
  assert ('again' in note) == (start != rows)
  np.testing.assert_array_equal(next(resumed)['inputs'], whole[start:start + new_batch])


def test_a_skip_moves_on_as_reading_would_without_reading():
  """TrainConfig.skip_batches: the same next batch as reading them, and a
  skip of a trillion batches as quick as one (it read them one by one)."""
  from mjax.config import DataConfig as DC
  cfg = DC(source='stdlib', seq_len=32)
  read, skipped = data.make_train_iterator(cfg, 4), data.make_train_iterator(cfg, 4)
  _take(read, 5)
  data.skip(skipped, 5)
  np.testing.assert_array_equal(next(skipped)['inputs'], next(read)['inputs'])
  far = data.make_train_iterator(cfg, 4)
  data.skip(far, 10**12)
  assert far.get_state()['next_index'] == 10**12 and next(far)['inputs'].shape == (4, 32)
  with pytest.raises(data.DataError, match='past the end of the data order grain can index'):
    data.skip(data.make_train_iterator(cfg, 64), 2**60 - 1)


def test_position_restores_exactly_or_restarts_on_another_seq_len():
  from mjax.config import DataConfig as DC
  cfg = DC(source='stdlib', seq_len=32)
  it = data.make_train_iterator(cfg, 8)
  _take(it, 2)
  state = data.position(it, 8, 32)
  want = next(it)['inputs']
  same = data.make_train_iterator(cfg, 8)
  assert data.restore_position(same, state, 8, 32) == ''
  np.testing.assert_array_equal(next(same)['inputs'], want)
  # A state from before the shape was saved is grain's alone: same shape.
  older = data.make_train_iterator(cfg, 8)
  assert data.restore_position(older, {'next_index': 2}, 8, 32) == ''
  np.testing.assert_array_equal(next(older)['inputs'], want)
  other = data.make_train_iterator(DC(source='stdlib', seq_len=16), 8)
  note = data.restore_position(other, state, 8, 16)
  assert 'seq_len changed from 32 to 16' in note and 'beginning' in note
  first = next(data.make_train_iterator(DC(source='stdlib', seq_len=16), 8))['inputs']
  np.testing.assert_array_equal(next(other)['inputs'], first)


def test_linked_folders_of_a_text_source_are_read_once_each(tmp_path):
  """A corpus folder of links to datasets' folders: the linked files were
  left out without a word. A link back up the tree ends."""
  from mjax.data import corpus
  (tmp_path / 'mount' / 'a').mkdir(parents=True)
  (tmp_path / 'mount' / 'a' / 'x.txt').write_text('x')
  (tmp_path / 'corpus').mkdir()
  (tmp_path / 'corpus' / 'local.txt').write_text('y')
  os.symlink(tmp_path / 'mount' / 'a', tmp_path / 'corpus' / 'part1')
  os.symlink(tmp_path / 'corpus', tmp_path / 'corpus' / 'loop')
  assert corpus.list_files(str(tmp_path / 'corpus'), '*.txt') == ['local.txt', 'part1/x.txt']


def test_a_position_names_its_data_by_content_not_by_path(tmp_path):
  """A file renamed (the order is by name) or rewritten at the same size
  keeps the file and token counts: resumed without a word, on other rows.
  The same data copied to another path warned instead. A position saved
  before content was named is checked the older way."""
  import shutil
  from mjax.config import DataConfig as DC
  src = tmp_path / 'src'
  src.mkdir()
  for i in range(3):
    (src / f'{i}.txt').write_text(f'document {i} ' * 400)
  make = lambda root: data.make_train_iterator(DC(source=str(root), seq_len=32, file_pattern='*.txt'), 8)
  it = make(src)
  _take(it, 2)
  state = data.position(it, 8, 32)
  shutil.copytree(src, tmp_path / 'copy')
  assert data.restore_position(make(tmp_path / 'copy'), state, 8, 32) == ''
  legacy = {k: v for k, v in state.items() if k != 'data_content'}
  assert data.restore_position(make(tmp_path / 'copy'), legacy, 8, 32).startswith('warning: the data is not')
  assert data.restore_position(make(src), legacy, 8, 32) == ''
  (src / '0.txt').rename(src / '9.txt')
  assert data.restore_position(make(src), state, 8, 32).startswith('warning: the data is not what'), state
  (src / '9.txt').rename(src / '0.txt')
  (src / '1.txt').write_text('document 7 ' * 400)          # the same size
  assert data.restore_position(make(src), state, 8, 32).startswith('warning: the data is not what')
  (src / '1.txt').write_text('document 1 ' * 400)
  assert data.restore_position(make(src), state, 8, 32) == ''


def test_a_position_names_its_data_and_says_when_the_data_changed(tmp_path):
  # The position was only an index: files added to a source, another
  # shuffle_seed or tokenizer continued at index k of another order, silently.
  from mjax.config import DataConfig as DC
  src = tmp_path / 'src'
  src.mkdir()
  for i in range(3):
    (src / f'{i}.txt').write_text(f'document {i} ' * 400)
  cfg = DC(source=str(src), seq_len=32, file_pattern='*.txt')
  it = data.make_train_iterator(cfg, 8)
  _take(it, 2)
  state = data.position(it, 8, 32)
  assert data.restore_position(data.make_train_iterator(cfg, 8), state, 8, 32) == ''
  note = data.restore_position(data.make_train_iterator(DC(source=str(src), seq_len=32, file_pattern='*.txt', shuffle_seed=7), 8),
                               state, 8, 32)
  assert note.startswith('warning: the data is not what this position was saved with'), note
  # Read afresh in the same process too (a notebook training on after the
  # data changed), not served from the corpus read before.
  (src / '3.txt').write_text('one more document ' * 400)
  note = data.restore_position(data.make_train_iterator(cfg, 8), state, 8, 32)
  assert 'warning: the data is not what' in note and f'{src}: ' in note and ' in 4 files' in note, note
  # Another seq_len cuts other windows of the same data: said as before, no warning.
  src_cfg16 = DC(source=str(src), seq_len=16, file_pattern='*.txt')
  (src / '3.txt').unlink()
  note = data.restore_position(data.make_train_iterator(src_cfg16, 8), state, 8, 16)
  assert note.startswith('seq_len changed from 32 to 16'), note
  # A file edited in place (same names) is read again as well.
  before = next(data.make_train_iterator(cfg, 8))['inputs'].copy()
  (src / '0.txt').write_text('x' * 4000)
  (src / '1.txt').write_text('x' * 4000)
  (src / '2.txt').write_text('x' * 4000)
  after = next(data.make_train_iterator(cfg, 8))['inputs']
  assert len(np.unique(after)) <= 3 < len(np.unique(before))
  # And a source that is one file.
  one = DC(source=str(src / '0.txt'), seq_len=32)
  assert len(np.unique(next(data.make_train_iterator(one, 8))['inputs'])) <= 3
  (src / '0.txt').write_text('document zero, written again ' * 200)
  assert len(np.unique(next(data.make_train_iterator(one, 8))['inputs'])) > 3


def test_a_data_file_that_cannot_be_read_is_named(tmp_path, monkeypatch):
  # A failing disk (EIO) or a file gone between listing and reading: the
  # file's name and the reason, not a bare OSError and its traceback; the
  # disk's failure a Fault (exit 1, restarted), the missing file bad input.
  from mjax.errors import Fault
  (tmp_path / 'a.txt').write_text('hello')
  (tmp_path / 'b.jsonl').write_text('"x"\n')
  real_open = open

  def failing(path, *a, **k):
    if str(path).endswith(('a.txt', 'b.jsonl')):
      raise OSError(5, 'Input/output error')
    return real_open(path, *a, **k)

  monkeypatch.setattr('builtins.open', failing)
  for read in (lambda: corpus_lib.read_documents(str(tmp_path), ['a.txt']),
               lambda: list(corpus_lib.iter_documents(str(tmp_path), ['a.txt'])),
               lambda: list(corpus_lib.iter_documents(str(tmp_path), ['b.jsonl'], names_only=True))):
    with pytest.raises(Fault, match=r'/(a\.txt|b\.jsonl): reading the data file failed \(Input/output '
                                    r'error\): check the storage'):
      read()
  monkeypatch.undo()
  with pytest.raises(data.DataError, match=r'/gone\.txt: reading the data file failed \(No such file'):
    corpus_lib.read_documents(str(tmp_path), ['gone.txt'])


def test_a_huge_batch_is_refused_with_exact_figures():
  from mjax.config import DataConfig as DC
  with pytest.raises(data.DataError, match=r'one global batch of 99999999999999999999999 x seq_len 128 needs '
                                           r'12799999999999999999999873;'):   # not a float's 127999...8926258177
    next(data.make_train_iterator(DC(source='stdlib', seq_len=128), 99999999999999999999999))
