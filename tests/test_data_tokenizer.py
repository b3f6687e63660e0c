"""Tests of tokenizer.json support: BPE training, EOS lookup, vocab checks, uint32 shards."""

import hashlib
import json
import re

import gin
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from mjax import config as C
from mjax import data
from mjax.cli import tokenizer_main
from mjax.config import DataConfig, ModelConfig
from mjax.data.sources import check_vocab
from mjax.data.tokenizer import token_dtype

SEQ = 16


@pytest.fixture(autouse=True)
def _no_gin_bindings():
  """DataConfig is gin-configurable: bindings left by another test would change its defaults."""
  gin.clear_config()
  yield
  gin.clear_config()


@pytest.fixture(scope='module')
def corpus_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp('text') / 'src'
  rng = np.random.default_rng(2)
  words = ['def', 'return', 'value', 'lambda', 'énergie', '数据', 'yield', 'self', '(', ')']
  for i in range(30):
    (root / f'd{i % 2}').mkdir(parents=True, exist_ok=True)
    text = ' '.join(rng.choice(words, size=rng.integers(60, 150)))
    (root / f'd{i % 2}' / f'f{i:02d}.py').write_text(f'# {i}\n{text}\n', encoding='utf-8')
  # A document that mentions the EOS text must not be cut in two.
  (root / 'mentions_eos.py').write_text('x = "<|endoftext|>"  # not a boundary\n' * 20)
  return root


@pytest.fixture(scope='module')
def bpe_path(tmp_path_factory, corpus_dir):
  out = tmp_path_factory.mktemp('tok') / 'tokenizer.json'
  tokenizer_main(['--input', str(corpus_dir), '--vocab_size', '300', '--output', str(out)])
  return out


def _word_level(path, vocab, eos=None):
  """A minimal tokenizer.json: one id per whitespace-separated word."""
  tok = Tokenizer(models.WordLevel(vocab, unk_token='[UNK]'))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  if eos:
    tok.add_special_tokens([eos])
  tok.save(str(path))
  return path


def test_trained_bpe_identity_and_eos(bpe_path):
  tok = data.load_tokenizer(str(bpe_path))
  info = tok.info
  assert info.name == 'tokenizer.json' and info.path == str(bpe_path)
  assert 257 <= info.vocab_size <= 300
  assert info.sha256 == hashlib.sha256(bpe_path.read_bytes()).hexdigest()
  raw = Tokenizer.from_file(str(bpe_path))
  assert info.eos_id == raw.token_to_id('<|endoftext|>')


def test_bpe_corpus_round_trips_and_ends_documents_with_eos(bpe_path, corpus_dir):
  cfg = DataConfig(source=str(corpus_dir), tokenizer=str(bpe_path), seq_len=SEQ,
                   heldout_fraction=0.2)
  c = data.load_corpus(cfg)
  tok = data.load_tokenizer(str(bpe_path))
  eos = tok.info.eos_id
  assert c.tokenizer == tok.info and c.train_tokens.dtype == np.uint16
  assert c.train_tokens.max() < tok.info.vocab_size
  assert int(np.sum(c.train_tokens == eos)) == len(c.train_files)
  assert 'mentions_eos.py' in c.train_files + c.heldout_files
  docs = np.split(c.train_tokens, np.flatnonzero(c.train_tokens == eos) + 1)[:-1]
  for f, ids in zip(c.train_files, docs):
    assert tok.decode(ids[:-1]) == (corpus_dir / f).read_text(encoding='utf-8')
  # BPE merges make the stream shorter than the bytes.
  assert len(c.train_tokens) < sum(len((corpus_dir / f).read_bytes()) for f in c.train_files)
  batch = next(data.make_train_iterator(cfg, 4))
  assert batch['inputs'].shape == (4, SEQ) and batch['inputs'].max() < tok.info.vocab_size


def test_shards_record_the_tokenizer_and_must_match_it(tmp_path, bpe_path, corpus_dir):
  out = tmp_path / 'bpe'
  m = data.prepare_shards(str(corpus_dir), str(out), str(bpe_path), heldout_fraction=0.2)
  info = data.load_tokenizer(str(bpe_path)).info
  assert m['tokenizer']['sha256'] == info.sha256 and m['eos_id'] == info.eos_id
  text = data.load_corpus(DataConfig(source=str(corpus_dir), tokenizer=str(bpe_path),
                                     heldout_fraction=0.2))
  s = data.open_shards(str(out))
  np.testing.assert_array_equal(np.concatenate(s.train), text.train_tokens)
  # The default tokenizer leaves a shard-only run to the manifest's tokenizer ...
  assert data.describe(DataConfig(source=str(out), seq_len=SEQ))['vocab_size'] == info.vocab_size
  # ... but a different tokenizer file is refused, naming both.
  other = _word_level(tmp_path / 'other.json', {'[UNK]': 0, 'a': 1}, eos='</s>')
  with pytest.raises(data.DataError) as err:
    data.describe(DataConfig(source=str(out), tokenizer=str(other), seq_len=SEQ))
  assert str(out) in str(err.value) and str(other) in str(err.value)
  # So is a mixture of byte-tokenized text with BPE shards.
  with pytest.raises(data.DataError, match='must share one tokenizer'):
    data.make_train_iterator(DataConfig(mixture=f'{corpus_dir}:1,{out}:1', seq_len=SEQ,
                                        heldout_fraction=0.2), 4)


def test_a_run_on_shards_alone_takes_and_records_their_tokenizer(tmp_path, bpe_path, corpus_dir):
  # Left at 'bytes', DataConfig.tokenizer of a run on BPE shards was
  # recorded as 'bytes' in its config.gin and checkpoints: mjax-generate
  # then read the model's ids as bytes ("????"), mjax-export shipped a byte
  # tokenizer beside a BPE model, and both exited 0.
  import shutil
  from mjax.data.sources import run_tokenizer
  tok = tmp_path / 'tok' / 'tokenizer.json'
  tok.parent.mkdir()
  shutil.copyfile(bpe_path, tok)
  out = tmp_path / 'bpe'
  data.prepare_shards(str(corpus_dir), str(out), str(tok), heldout_fraction=0.2)
  assert run_tokenizer(DataConfig(source=str(out))) == str(tok)
  assert run_tokenizer(DataConfig(mixture=f'{out}:1,{out}:2')) == str(tok)
  # A tokenizer named is kept (the pipeline checks it against the shards);
  # text sources and byte shards stay with bytes.
  assert run_tokenizer(DataConfig(source=str(out), tokenizer=str(bpe_path))) == str(bpe_path)
  assert run_tokenizer(DataConfig(source=str(corpus_dir))) == 'bytes'
  byte_shards = tmp_path / 'bytes'
  data.prepare_shards(str(corpus_dir), str(byte_shards), 'bytes', heldout_fraction=0.2)
  assert run_tokenizer(DataConfig(source=str(byte_shards))) == 'bytes'
  # The trainer writes what it resolved (and the checkpoints' meta record).
  from mjax import trainer
  cfg = C.load_config(['tiny.gin'], [f"DataConfig.source = '{out}'", 'ModelConfig.vocab_size = 384'])
  t = trainer.Trainer.__new__(trainer.Trainer)
  (tmp_path / 'afile').write_text('')
  with pytest.raises(C.ConfigError, match='afile'):   # stops after the tokenizer, at the workdir (a file)
    trainer.Trainer.__init__(t, cfg, str(tmp_path / 'afile'))
  assert t.recorded.data.tokenizer == str(tok) and t.cfg.data.tokenizer == 'bytes'
  from mjax.data.sources import shard_tokenizer, tokenizer_identity
  assert tokenizer_identity(DataConfig(source=str(out))) == data.load_tokenizer(str(tok)).info
  # Moved or changed since: training goes on ('bytes' recorded, the shards'
  # identity in the checkpoints), with a note; decoding tools refuse.
  tok.write_text(tok.read_text().replace('"<|endoftext|>"', '"<|end|>"', 1))
  spec, note = shard_tokenizer(DataConfig(source=str(out)))
  assert spec == 'bytes' and re.search(r'tokenized with .*tokenizer.json .*is no longer that file .*'
                                       r'Set DataConfig.tokenizer to the path of that tokenizer.json', note), note
  with pytest.raises(data.DataError, match='is no longer that file'):
    run_tokenizer(DataConfig(source=str(out)))
  tok.unlink()
  with pytest.raises(data.DataError, match=rf'and {tok} is not there\. Set DataConfig.tokenizer'):
    run_tokenizer(DataConfig(source=str(out)))
  # A resume while the file is away keeps the name the run recorded: its
  # config was written over with 'bytes', and mjax-eval then scored the BPE
  # model on byte ids.
  run = tmp_path / 'run'
  run.mkdir()
  (run / 'config.json').write_text(json.dumps({'data': {'tokenizer': str(tok)}}))
  t = trainer.Trainer.__new__(trainer.Trainer)
  with pytest.raises(C.ConfigError) as refused:   # a record of no model: refused at the workdir check, after the tokenizer
    trainer.Trainer.__init__(t, cfg, str(run))
  assert t.recorded.data.tokenizer == str(tok), refused.value
  # Only a name of the shards' own tokenizer is kept (a record of other
  # shards' is not theirs to keep).
  (run / 'config.json').write_text(json.dumps({'data': {'tokenizer': str(tmp_path / 'other.json')}}))
  t = trainer.Trainer.__new__(trainer.Trainer)
  with pytest.raises(C.ConfigError):
    trainer.Trainer.__init__(t, cfg, str(run))
  assert t.recorded.data.tokenizer == 'bytes'
  assert tokenizer_identity(DataConfig(source=str(out))).sha256 == hashlib.sha256(bpe_path.read_bytes()).hexdigest()


def test_missing_eos_is_an_error_naming_what_was_looked_for(tmp_path):
  path = _word_level(tmp_path / 'no_eos.json', {'[UNK]': 0, 'hello': 1})
  with pytest.raises(data.DataError) as err:
    data.load_tokenizer(str(path))
  msg = str(err.value)
  assert str(path) in msg and 'no end-of-sequence token' in msg
  assert '<|endoftext|>' in msg and '</s>' in msg and 'tokenizer_config.json' in msg


def test_tokenizer_config_names_the_eos(tmp_path):
  d = tmp_path / 'tok'
  d.mkdir()
  path = _word_level(d / 'tokenizer.json', {'[UNK]': 0, 'a': 1, '</s>': 2, '<end>': 3})
  assert data.load_tokenizer(str(path)).info.eos_id == 2      # fallback list
  (d / 'tokenizer_config.json').write_text(json.dumps({'eos_token': {'content': '<end>'}}))
  path.write_text(path.read_text())                             # new mtime: reloaded
  assert data.load_tokenizer(str(path)).info.eos_id == 3


def test_large_vocabulary_is_stored_as_uint32(tmp_path):
  assert token_dtype(65535) == np.dtype('<u2') and token_dtype(65536) == np.dtype('<u4')
  vocab = {'[UNK]': 0, **{f'w{i}': i for i in range(1, 70_000)}}
  path = _word_level(tmp_path / 'big.json', vocab, eos='</s>')
  src = tmp_path / 'doc.txt'
  src.write_text(' '.join(f'w{i}' for i in range(69_000, 70_000)) + '\n')
  out = tmp_path / 'big'
  m = data.prepare_shards(str(src), str(out), str(path), heldout_fraction=0.1)
  assert m['dtype'] == 'uint32' and m['tokenizer']['vocab_size'] == 70_001
  s = data.open_shards(str(out), verify_checksums=True)
  tokens = np.concatenate([*s.train, *s.heldout])
  assert tokens.dtype == np.dtype('<u4') and tokens[-1] == m['eos_id'] == 70_000
  np.testing.assert_array_equal(tokens[:1000], np.arange(69_000, 70_000))


def test_model_vocab_must_cover_the_tokenizer(tmp_path, bpe_path, corpus_dir):
  vocab = data.load_tokenizer(str(bpe_path)).info.vocab_size
  d = DataConfig(source=str(corpus_dir), tokenizer=str(bpe_path), seq_len=64)
  small = C.Config(model=ModelConfig(vocab_size=vocab - 1), data=d)
  with pytest.raises(C.ConfigError) as err:
    check_vocab(small.model, small.data)
  msg = str(err.value)
  assert f'ModelConfig.vocab_size = {vocab - 1}' in msg and f'vocab_size >= {vocab}' in msg
  assert str(bpe_path) in msg
  check_vocab(ModelConfig(vocab_size=vocab), d)
  # A shard directory's manifest sets the bound too.
  out = tmp_path / 'shards'
  data.prepare_shards(str(corpus_dir), str(out), str(bpe_path), heldout_fraction=0.2)
  with pytest.raises(C.ConfigError, match=f'vocab_size >= {vocab}'):
    check_vocab(ModelConfig(vocab_size=vocab - 1), DataConfig(source=str(out), seq_len=64))
  with pytest.raises(C.ConfigError, match="DataConfig.tokenizer = '/no/tok.json'"):
    C.validate(C.Config(data=DataConfig(tokenizer='/no/tok.json', seq_len=64)))


def test_tokenizer_command_rejects_a_tiny_vocabulary(tmp_path, corpus_dir, capsys):
  with pytest.raises(SystemExit) as exit_info:
    tokenizer_main(['--input', str(corpus_dir), '--vocab_size', '100',
                    '--output', str(tmp_path / 't.json')])
  assert exit_info.value.code == 2
  assert 'vocab_size 100 is too small' in capsys.readouterr().err


def test_tokenizer_command_never_writes_over_a_file(tmp_path, corpus_dir, bpe_path, capsys):
  before = bpe_path.read_bytes()
  text = corpus_dir / 'mentions_eos.py'
  for out, said in [(bpe_path, 'already exists'), (text, 'already exists'),
                    (tmp_path / 'big.json', 'too large')]:
    with pytest.raises(SystemExit) as exit_info:
      tokenizer_main(['--input', str(corpus_dir), '--vocab_size', '10000000000' if 'big' in str(out) else '300',
                      '--output', str(out)])
    assert exit_info.value.code == 2 and said in capsys.readouterr().err
  assert bpe_path.read_bytes() == before and text.read_text().startswith('x = ')
  (tmp_path / 'afile').write_text('x')                          # a parent that is a file
  with pytest.raises(SystemExit) as exit_info:
    tokenizer_main(['--input', str(corpus_dir), '--vocab_size', '300', '--output', str(tmp_path / 'afile' / 't.json')])
  assert exit_info.value.code == 2 and 'afile is a file, not a directory' in capsys.readouterr().err
  assert not list(tmp_path.glob('.tokenizer-*'))
  (tmp_path / 'a_dir').mkdir()
  with pytest.raises(SystemExit) as exit_info:
    tokenizer_main(['--input', str(corpus_dir), '--vocab_size', '300', '--output', str(tmp_path / 'a_dir')])
  assert exit_info.value.code == 2 and 'already exists (a directory)' in capsys.readouterr().err


def test_tokenizer_command_on_a_full_disk_says_so_and_leaves_nothing(tmp_path, corpus_dir, monkeypatch, capsys):
  # The tokenizers library raises its I/O errors as bare Exceptions.
  from tokenizers import Tokenizer

  def full(self, path, *a, **k):
    raise Exception('No space left on device (os error 28)')
  monkeypatch.setattr(Tokenizer, 'save', full)
  with pytest.raises(SystemExit) as exit_info:
    tokenizer_main(['--input', str(corpus_dir), '--vocab_size', '300', '--output', str(tmp_path / 't.json')])
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and 'cannot write it (No space left on device (os error 28))' in err, err
  assert not (tmp_path / 't.json').exists() and not list(tmp_path.glob('.tokenizer-*'))


def test_tokenizer_command_learns_from_text_files_only(tmp_path, capsys):
  """A binary among the inputs is left out (as training leaves it); inputs
  with no text at all are refused, and nothing is written."""
  src = tmp_path / 'src'
  src.mkdir()
  (src / 'blob.txt').write_bytes(b'\0\x01\x02' * 2000)
  (src / 'empty.txt').write_text(' \n')
  with pytest.raises(SystemExit) as exit_info:
    tokenizer_main(['--input', str(src), '--vocab_size', '300', '--file_pattern', '*.txt',
                    '--output', str(tmp_path / 't.json')])
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and 'no text to train on' in err
  assert 'left out 1 of 2 files that are not text: blob.txt (NUL bytes)' in err   # what there was instead
  assert not (tmp_path / 't.json').exists() and not list(tmp_path.glob('.tokenizer-*'))
  (src / 'words.txt').write_text('the cat sat on the mat. ' * 200)
  tokenizer_main(['--input', str(src), '--vocab_size', '300', '--file_pattern', '*.txt',
                   '--output', str(tmp_path / 't.json')])
  out = capsys.readouterr()
  assert 'left out 1 of 3 files that are not text: blob.txt (NUL bytes)' in out.err
  assert json.loads(out.out)['files'] == json.loads(out.out)['documents'] == 2
  from tokenizers import Tokenizer
  vocab = Tokenizer.from_file(str(tmp_path / 't.json')).get_vocab()
  assert not any('\u0100\u0101' in t for t in vocab)   # no merge learnt from NUL, \x01


def test_tokenizer_command_counts_files_and_documents(tmp_path, capsys):
  # A JSON Lines file of 200 documents was reported as "files": 200.
  lines = [json.dumps({'text': f'document {i}: the cat sat on the mat.'}) for i in range(200)]
  (tmp_path / 'docs.jsonl').write_text('\n'.join(lines) + '\n')
  tokenizer_main(['--input', str(tmp_path / 'docs.jsonl'), '--vocab_size', '300',
                  '--output', str(tmp_path / 't.json')])
  out = json.loads(capsys.readouterr().out)
  assert out['files'] == 1 and out['documents'] == 200


def test_a_long_line_of_one_character_trains_in_seconds(tmp_path):
  """BPE training is quadratic in a pre-token's length where a pair repeats
  along it: a 300 kB run of 'x' took minutes, a 3 MB one hours."""
  import threading
  line = 'x' * 300_000
  done = {}
  worker = threading.Thread(target=lambda: done.setdefault(
      'info', data.train_bpe(['a few words. ' * 50 + line, ' ' * 300_000], 300, str(tmp_path / 't.json'))),
                            daemon=True)
  worker.start()
  worker.join(30)
  assert 'info' in done, 'training on a 300 kB line did not end in 30 s'
  tok = data.load_tokenizer(str(tmp_path / 't.json'))
  ids = tok.encode(line)
  assert tok.decode(ids) == line and len(ids) < len(line) / 2   # 'xx', 'xxxx', ... merges were learnt


def test_the_tokenizers_long_calls_run_off_the_main_thread(tmp_path, bpe_path, corpus_dir, monkeypatch):
  # So that a stop is not held up by them (tests/test_config.py,
  # test_a_tool_stopped_inside_a_native_call_cleans_up_at_once): a BPE's
  # training, and a batch of over 1 MiB encoded (prepare's are 64 MiB),
  # with the same results as on the main thread.
  from mjax.data import tokenizer as tokenizer_lib
  calls = []

  def recorded(fn, *args, **kwargs):
    calls.append(getattr(fn, 'func', fn).__name__)
    return real(fn, *args, **kwargs)
  real = tokenizer_lib.off_the_main_thread
  monkeypatch.setattr(tokenizer_lib, 'off_the_main_thread', recorded)
  tokenizer_main(['--input', str(corpus_dir), '--vocab_size', '300', '--output', str(tmp_path / 't.json')])
  assert calls == ['train_from_iterator']
  assert (tmp_path / 't.json').read_bytes() == bpe_path.read_bytes()
  tok = data.load_tokenizer(str(bpe_path))
  docs = [f.read_bytes() for f in sorted(corpus_dir.rglob('*.py'))]
  small = tok.encode_documents(docs)
  assert calls == ['train_from_iterator']          # a small batch stays on the main thread
  big = tok.encode_documents(docs * (2 * (1 << 20) // sum(map(len, docs)) + 1))
  assert calls == ['train_from_iterator', 'encode_batch_fast']
  np.testing.assert_array_equal(big[:len(small)], small)


def test_a_string_that_is_no_text_is_a_unicode_error_for_every_tokenizer(bpe_path):
  # mjax-generate turns a UnicodeError into "prompt N is not valid text";
  # a BPE's own error for a command line's non-UTF-8 bytes was a TypeError,
  # and the tool ended with a traceback.
  for tok in (data.load_tokenizer('bytes'), data.load_tokenizer(str(bpe_path))):
    assert len(tok.encode('def x')) > 0
    with pytest.raises(UnicodeEncodeError):
      tok.encode('ab\udcff')


def test_a_folder_given_as_the_tokenizer_names_the_file_in_it(tmp_path, corpus_dir, bpe_path, capsys):
  # A Hugging Face model's folder holds its tokenizer.json: the message
  # names that file, where it said "no such file" of a folder that exists.
  from mjax.cli import prepare_main
  folder = str(bpe_path.parent)
  with pytest.raises(SystemExit) as exit_info:
    prepare_main(['--input', str(corpus_dir), '--output', str(tmp_path / 'shards'), '--tokenizer', folder])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert f'a directory (give the tokenizer.json in it: {bpe_path})' in err and 'no such file' not in err
  with pytest.raises(C.ConfigError, match=re.escape(f'this is a folder: give the one in it, {bpe_path}')):
    C.load_config(['tiny.gin'], [f'DataConfig.tokenizer = "{folder}"', 'ModelConfig.vocab_size = 512'])
  with pytest.raises(SystemExit):
    prepare_main(['--input', str(corpus_dir), '--output', str(tmp_path / 'shards'), '--tokenizer', str(tmp_path)])
  assert 'a directory (DataConfig.tokenizer must be' in capsys.readouterr().err
