"""Tests of document attention arrays and of weighted mixtures of sources."""

import json

import gin
import numpy as np
import pytest

from mjax import config as C
from mjax import data
from mjax.config import DataConfig

SEQ = 32
EOS = data.EOS_ID
DIGITS = set(range(ord('0'), ord('9') + 1))


@pytest.fixture(autouse=True)
def _no_gin_bindings():
  """DataConfig is gin-configurable: bindings left by another test would change its defaults."""
  gin.clear_config()
  yield
  gin.clear_config()


def _write(root, alphabet, n_files, seed):
  rng = np.random.default_rng(seed)
  root.mkdir(parents=True)
  for i in range(n_files):
    n = int(rng.integers(20, 200))
    (root / f'f{i:02d}.py').write_text(''.join(rng.choice(list(alphabet), size=n)))
  return root


@pytest.fixture(scope='module')
def letters(tmp_path_factory):
  return _write(tmp_path_factory.mktemp('a') / 'letters', 'abcdefghij', 60, 0)


@pytest.fixture(scope='module')
def digits(tmp_path_factory):
  """Digits only, as pre-tokenized shards: a mixture of text and shards."""
  text = _write(tmp_path_factory.mktemp('b') / 'digits', '0123456789', 60, 1)
  out = tmp_path_factory.mktemp('b') / 'digit_shards'
  data.prepare_shards(str(text), str(out), shard_tokens=800, heldout_fraction=0.3)
  return out


def _mix_cfg(letters, digits, weights=(3, 1), **kw):
  kw.setdefault('seq_len', SEQ)
  kw.setdefault('heldout_fraction', 0.3)
  return DataConfig(mixture=f'{letters}:{weights[0]},{digits}:{weights[1]}', **kw)


def _is_digit_row(row):
  """Rows of one source only hold its characters (and EOS)."""
  chars = set(row.tolist()) - {EOS}
  assert chars and (chars <= DIGITS or not chars & DIGITS), chars
  return chars <= DIGITS


def _take(it, n):
  return [next(it) for _ in range(n)]


# ----------------------------------------------------------------------------
# Document attention
# ----------------------------------------------------------------------------

def test_segment_ids_and_positions_by_hand():
  inputs = np.array([[1, 2, 9, 3, 4, 9, 9, 5],
                     [9, 1, 2, 3, 9, 4, 5, 6],
                     [1, 2, 3, 4, 5, 6, 7, 8]])
  seg, pos = data.document_ids_and_positions(inputs, eos_id=9)
  np.testing.assert_array_equal(seg, [[1, 1, 1, 2, 2, 2, 3, 4],
                                      [1, 2, 2, 2, 2, 3, 3, 3],
                                      [1, 1, 1, 1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(pos, [[0, 1, 2, 0, 1, 2, 0, 0],
                                      [0, 0, 1, 2, 3, 0, 1, 2],
                                      [0, 1, 2, 3, 4, 5, 6, 7]])
  assert seg.dtype == pos.dtype == np.int32


def _reference(row, eos):
  seg, pos, s, p = [], [], 1, 0
  for t, tok in enumerate(row):
    if t and row[t - 1] == eos:
      s, p = s + 1, 0
    seg.append(s)
    pos.append(p)
    p += 1
  return seg, pos


def test_pipeline_emits_document_arrays_only_when_asked(letters):
  cfg = DataConfig(source=str(letters), seq_len=SEQ, heldout_fraction=0.3)
  plain = _take(data.make_train_iterator(cfg, 8), 2)
  assert set(plain[0]) == {'inputs', 'targets', 'loss_mask'}
  docs = _take(data.make_train_iterator(
      DataConfig(source=str(letters), seq_len=SEQ, heldout_fraction=0.3,
                 document_attention=True), 8), 2)
  saw_boundary = False
  for p, d in zip(plain, docs):
    for k in p:
      np.testing.assert_array_equal(p[k], d[k])
    for key in ('segment_ids', 'positions'):
      assert d[key].shape == (8, SEQ) and d[key].dtype == np.int32
    for row, seg, pos in zip(d['inputs'], d['segment_ids'], d['positions']):
      ref_seg, ref_pos = _reference(row.tolist(), EOS)
      np.testing.assert_array_equal(seg, ref_seg)
      np.testing.assert_array_equal(pos, ref_pos)
      saw_boundary |= seg[-1] > 1
  assert saw_boundary, 'documents of 20-200 bytes must end inside some 32-token rows'
  ev = data.make_eval_batches(DataConfig(source=str(letters), seq_len=SEQ, heldout_fraction=0.3,
                                         document_attention=True), 4, 1)[0]
  np.testing.assert_array_equal(ev['segment_ids'][0], _reference(ev['inputs'][0].tolist(), EOS)[0])


# ----------------------------------------------------------------------------
# Mixtures
# ----------------------------------------------------------------------------

def test_rows_follow_the_weights_in_every_batch(letters, digits):
  it = data.make_train_iterator(_mix_cfg(letters, digits, (3, 1)), 8)
  counts = [sum(_is_digit_row(r) for r in b['inputs']) for b in _take(it, 12)]
  assert all(abs(c - 2) <= 1 for c in counts), counts      # 8 rows x 1/4
  assert abs(sum(counts) - 24) <= 1, counts
  it = data.make_train_iterator(_mix_cfg(letters, digits, (1, 3)), 8)
  counts = [sum(_is_digit_row(r) for r in b['inputs']) for b in _take(it, 12)]
  assert abs(sum(counts) - 72) <= 1, counts


def test_mixture_is_deterministic_and_seeded(letters, digits):
  a = _take(data.make_train_iterator(_mix_cfg(letters, digits), 8), 3)
  b = _take(data.make_train_iterator(_mix_cfg(letters, digits), 8), 3)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x['inputs'], y['inputs'])
  c = _take(data.make_train_iterator(_mix_cfg(letters, digits, shuffle_seed=5), 8), 3)
  assert not all(np.array_equal(x['inputs'], y['inputs']) for x, y in zip(a, c))


@pytest.mark.parametrize('process_count', [2, 4])
def test_mixture_global_batches_do_not_depend_on_process_count(letters, digits, process_count):
  cfg = _mix_cfg(letters, digits, document_attention=True)
  whole = _take(data.make_train_iterator(cfg, 8), 3)
  parts = [_take(data.make_train_iterator(cfg, 8, process_index=p, process_count=process_count), 3)
           for p in range(process_count)]
  for k in range(3):
    for key in whole[k]:
      np.testing.assert_array_equal(
          np.concatenate([parts[p][k][key] for p in range(process_count)]), whole[k][key])


def test_mixture_weights_at_another_scale_are_the_same_data(letters, digits):
  """7:3 samples as 0.7:0.3 does: a position saved under one is not
  "other data" under the other (it warned); 1:3 is other data."""
  it = data.make_train_iterator(_mix_cfg(letters, digits, (0.75, 0.25)), 8)
  _take(it, 2)
  state = data.position(it, 8, SEQ)
  same = data.make_train_iterator(_mix_cfg(letters, digits, (3, 1)), 8)
  assert data.restore_position(same, state, 8, SEQ) == ''
  np.testing.assert_array_equal(next(same)['inputs'], next(it)['inputs'])
  other = data.make_train_iterator(_mix_cfg(letters, digits, (1, 3)), 8)
  assert data.restore_position(other, state, 8, SEQ).startswith('warning: the data is not')


def test_mixture_state_restores_exactly(letters, digits):
  cfg = _mix_cfg(letters, digits, num_threads=2, prefetch=3)
  it = data.make_train_iterator(cfg, 4, process_index=1, process_count=2)
  _take(it, 5)
  state = json.loads(json.dumps(it.get_state()))   # must survive serialization
  expected = _take(it, 4)
  resumed = data.make_train_iterator(cfg, 4, process_index=1, process_count=2)
  resumed.set_state(state)
  got = _take(resumed, 4)
  for x, y in zip(got, expected):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  fresh = next(data.make_train_iterator(cfg, 4, process_index=1, process_count=2))
  assert not np.array_equal(fresh['inputs'], got[0]['inputs'])


def test_mixture_eval_interleaves_heldout_splits_in_order(letters, digits):
  cfg = _mix_cfg(letters, digits, (1, 1))
  held_letters = data.load_corpus(DataConfig(source=str(letters), heldout_fraction=0.3)).heldout_tokens
  held_digits = data.open_shards(str(digits)).heldout
  expect_digits = [s[i * SEQ:i * SEQ + SEQ] for s in held_digits for i in range((len(s) - 1) // SEQ)]
  batches = data.make_eval_batches(cfg, 4, 3)
  rows = np.concatenate([b['inputs'] for b in batches])
  kinds = [_is_digit_row(r) for r in rows]
  assert kinds == [False, True] * 6       # equal weights alternate
  for j, row in enumerate(rows[0::2]):
    np.testing.assert_array_equal(row, held_letters[j * SEQ:j * SEQ + SEQ])
  for j, row in enumerate(rows[1::2]):
    np.testing.assert_array_equal(row, expect_digits[j % len(expect_digits)])
  info = data.describe(cfg)
  assert [m['kind'] for m in info['mixture']] == ['text', 'shards']
  assert [m['weight'] for m in info['mixture']] == [1.0, 1.0]


def test_a_small_source_names_itself(letters, tmp_path):
  tiny = tmp_path / 'tiny.txt'
  tiny.write_text('0123456789' * 5)
  cfg = DataConfig(mixture=f'{letters}:1,{tiny}:1', seq_len=SEQ, heldout_fraction=0.3)
  with pytest.raises(data.DataError) as err:
    data.make_train_iterator(cfg, 8)
  msg = str(err.value)
  assert str(tiny) in msg and 'train split' in msg and '4 of 8 rows' in msg


@pytest.mark.parametrize('mixture,needle', [
    ('stdlib', 'SOURCE:WEIGHT'),
    ('stdlib:0', 'positive weight'),
    ('stdlib:-1,stdlib:1', "'stdlib:-1'"),
    ('stdlib:x', "'stdlib:x'"),
    (':1', "':1'"),
    (' , ', 'at least one'),
])
def test_malformed_mixtures_are_config_errors(mixture, needle):
  with pytest.raises(C.ConfigError) as err:
    C.validate(C.Config(data=DataConfig(mixture=mixture, seq_len=64)))
  assert 'DataConfig.mixture' in str(err.value) and needle in str(err.value)


def test_mixture_parsing_and_missing_sources(tmp_path):
  d = DataConfig(mixture=f'stdlib:0.7, {tmp_path}:0.3')
  assert d.source_weights() == (('stdlib', 0.7), (str(tmp_path), 0.3))
  assert DataConfig(source='x').source_weights() == (('x', 1.0),)
  with pytest.raises(C.ConfigError, match="source '/no/such' must be 'stdlib' or an existing"):
    C.validate(C.Config(data=DataConfig(mixture='stdlib:1,/no/such:1', seq_len=64)))
  cfg = C.load_config(['tiny.gin'], ["DataConfig.mixture = 'stdlib:0.5,stdlib:0.5'",
                                     'DataConfig.document_attention = True',
                                     'DataConfig.verify_checksums = True'])
  assert cfg.data.mixture == 'stdlib:0.5,stdlib:0.5' and cfg.data.document_attention
  again = C.load_config([], [line for line in C.to_gin(cfg).splitlines() if line])
  assert again == cfg
  # Training refuses what would be read otherwise than written (a run so
  # configured before is still evaluated): a source twice, and a `source`
  # beside a mixture, which was ignored without a word.
  with pytest.raises(C.ConfigError, match=r"DataConfig.mixture = 'stdlib:0.5,stdlib:0.5' is not allowed: names "
                                          r"the source 'stdlib' twice: give it once, with the weights added"):
    C.check_for_training(cfg)
  with pytest.raises(C.ConfigError, match=r"names the source '.*' twice \(as '.*/\.'\)"):
    C.check_for_training(C.Config(data=DataConfig(mixture=f'{tmp_path}:1,{tmp_path}/.:1')))
  with pytest.raises(C.ConfigError, match=rf"DataConfig.source = '{tmp_path}' is not allowed: must be left unset "
                                          r"with DataConfig.mixture = 'stdlib:1'.*add it to the mixture"):
    C.check_for_training(C.Config(data=DataConfig(source=str(tmp_path), mixture='stdlib:1')))
  C.check_for_training(C.Config(data=DataConfig(mixture=f'stdlib:1,{tmp_path}:2')))
