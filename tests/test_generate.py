"""mjax-generate: cached decoding against the full forward pass, sampling,
and the command on a trained checkpoint."""

import dataclasses
import io
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from mjax import config as C
from mjax import generate, trainer
from mjax.config import ModelConfig
from mjax.errors import UserError
from mjax.generate import Sampling, init_cache, left_pad, sample
from mjax.model import Transformer

# fp32, GQA 4:2, a window of 5 (the ring buffer wraps several times over 19
# tokens) in every other layer and full attention in the rest.
MODEL = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64, dtype='float32',
                    sliding_window=5, full_attention_every=2, attention_impl='xla')
T = 19


def _setup(cfg, batch=2, seed=0):
  model = Transformer(cfg)
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, T)), jnp.int32)
  params = nn.meta.unbox(model.init(jax.random.key(seed), tokens)['params'])
  return model, params, tokens


def _decode(model, params, tokens, positions, prefill, max_len):
  """Logits of every position: `prefill` tokens at once, then one at a time."""
  cache = jax.tree.map(jnp.asarray, init_cache(model.cfg, tokens.shape[0], max_len))
  step = jax.jit(lambda p, t, pos, c: model.apply({'params': p}, t, pos, cache=c))
  logits, cache = step(params, tokens[:, :prefill], positions[:, :prefill], cache)
  out = [logits]
  for t in range(prefill, tokens.shape[1]):
    logits, cache = step(params, tokens[:, t:t + 1], positions[:, t:t + 1], cache)
    out.append(logits)
  return jnp.concatenate(out, axis=1), cache


@pytest.mark.parametrize('variant', [
    dict(),
    dict(scan_layers=False),
    dict(fuse_projections='none', block='sequential', mlp='swiglu', norm='rmsnorm', n_kv_heads=1),
    dict(sliding_window=None, full_attention_every=0, use_bias=True),
], ids=['scan_window_and_full_gqa', 'unrolled', 'sequential_swiglu_mqa', 'full_only_bias'])
@pytest.mark.parametrize('prefill', [1, 8])
def test_cached_decoding_gives_the_full_forward_logits(variant, prefill):
  cfg = dataclasses.replace(MODEL, **variant)
  model, params, tokens = _setup(cfg)
  full = model.apply({'params': params}, tokens)
  positions = jnp.broadcast_to(jnp.arange(T), tokens.shape)
  got, cache = _decode(model, params, tokens, positions, prefill, T)
  np.testing.assert_allclose(np.asarray(got), np.asarray(full), rtol=2e-5, atol=2e-5)
  # The windowed layers keep `window` slots however long the text is.
  if cfg.sliding_window:
    assert cache['block_0']['k'].shape[2] == cfg.sliding_window == 5
    assert cache['block_1']['k'].shape[2] == T
    # A ring buffer: after 19 tokens it holds positions 14..18.
    assert sorted(np.asarray(cache['block_0']['pos'][0, 0]).tolist()) == [14, 15, 16, 17, 18]


def test_generation_logits_are_not_rounded_to_the_compute_dtype():
  """A bf16 model's logits for sampling come out of an fp32 product: rounded
  to bf16, the most likely tokens tied often."""
  cfg = dataclasses.replace(MODEL, dtype='bfloat16')
  model, params, tokens = _setup(cfg)
  positions = jnp.broadcast_to(jnp.arange(T), tokens.shape)
  got, _ = _decode(model, params, tokens, positions, T, T)
  got = np.asarray(got)
  assert got.dtype == np.float32
  assert np.mean(got != got.astype(jnp.bfloat16).astype(np.float32)) > 0.5


@pytest.mark.slow
def test_left_padded_prompts_decode_as_if_alone():
  """A batch of prompts of different lengths, aligned on their last token:
  each row's logits are those of its prompt run on its own."""
  model, params, tokens = _setup(MODEL, batch=3, seed=1)
  lengths = [T, 11, 4]
  rows = [np.asarray(tokens[r, :n]) for r, n in enumerate(lengths)]
  padded, positions = left_pad(rows)
  assert padded.shape == (3, T) and positions[2, T - 4] == 0 and positions[2, 0] < 0
  got, _ = _decode(model, params, jnp.asarray(padded), jnp.asarray(positions), 12, T)
  for r, n in enumerate(lengths):
    alone = model.apply({'params': params}, jnp.asarray(rows[r])[None])
    np.testing.assert_allclose(np.asarray(got[r, T - n:]), np.asarray(alone[0]), rtol=2e-5, atol=2e-5)


# --- sampling ----------------------------------------------------------------------

def _draws(logits, s, n=2000, vocab=None, reserved=()):
  logits = jnp.asarray(np.broadcast_to(np.asarray(logits, np.float32), (n, len(logits))))
  return np.asarray(sample(logits, jax.random.key(s.seed), s, vocab or logits.shape[-1], reserved))


def test_greedy_and_filters():
  logits = np.log([0.05, 0.5, 0.3, 0.15])
  assert set(_draws(logits, Sampling(temperature=0))) == {1}
  assert set(_draws(logits, Sampling(temperature=5.0, top_k=1))) == {1}
  assert set(_draws(logits, Sampling(temperature=1.0, top_k=2))) == {1, 2}
  # Nucleus: 0.5 < 0.7 <= 0.5 + 0.3, so the two most likely tokens.
  assert set(_draws(logits, Sampling(temperature=1.0, top_p=0.7))) == {1, 2}
  assert set(_draws(logits, Sampling(temperature=1.0, top_p=0.4))) == {1}
  # Unfiltered: every token, at about its probability.
  counts = np.bincount(_draws(logits, Sampling(temperature=1.0), n=20000), minlength=4) / 20000
  np.testing.assert_allclose(counts, [0.05, 0.5, 0.3, 0.15], atol=0.02)
  # Ties are cut by rank, the lower id first, whatever the seed: top_k 1 is
  # greedy, and the k kept are k (by value, every token tied with the k-th
  # stayed, and top_k 1 drew among them).
  tied = [0.0, 2.0, 2.0, 2.0]
  for seed in range(4):
    assert set(_draws(tied, Sampling(temperature=1.0, top_k=1, seed=seed))) == {1}
    assert set(_draws(tied, Sampling(temperature=1.0, top_p=1e-6, seed=seed))) == {1}
  assert set(_draws(tied, Sampling(temperature=1.0, top_k=2))) == {1, 2}
  # Ids past the tokenizer's vocabulary (padding of the embedding) never come out.
  assert set(_draws([0.0, 0.0, 10.0, 10.0], Sampling(temperature=1.0), vocab=2)) <= {0, 1}
  # Nor do reserved ids within it (the byte tokenizer's PAD), greedy or not.
  assert set(_draws([0.0, 0.0, 10.0, 10.0], Sampling(temperature=1.0), vocab=3, reserved=(2,))) <= {0, 1}
  assert set(_draws([0.0, 5.0, 10.0], Sampling(temperature=0), reserved=(2,))) == {1}
  from mjax.data import load_tokenizer, never_sampled
  assert never_sampled(load_tokenizer('bytes').info, 384) == [257, *range(258, 384)]
  # Seeded: the same seed draws the same tokens.
  s = Sampling(temperature=1.0, seed=7)
  assert (_draws(logits, s) == _draws(logits, s)).all()
  assert (_draws(logits, s) != _draws(logits, Sampling(temperature=1.0, seed=8))).any()


@pytest.mark.slow
def test_the_nucleus_over_a_large_vocabulary():
  """top_p over 4,096 ids: a nucleus inside the best NUCLEUS_CANDIDATES is
  drawn from them, one that reaches past them from the sorted vocabulary,
  and both are the nucleus itself, highest ranks first (a tie at its edge
  to the lower id)."""
  from mjax import generate
  v = 4096
  rng = np.random.default_rng(0)
  base = rng.permutation(v).astype(np.float32)   # distinct ranks, scattered over the ids
  # Peaked: the best 3 ids hold all but ~1e-7 of the probability.
  peaked = np.full(v, -20.0, np.float32)
  best3 = np.argsort(-base)[:3]
  peaked[best3] = [6.0, 5.5, 5.0]
  drawn = set(_draws(peaked, Sampling(temperature=1.0, top_p=0.8)))
  assert drawn == set(best3[:2].tolist()), drawn   # 0.51 + 0.31 reach 0.8; the third does not enter
  # Flat over the best 1,000 (each ~0.1%): a 0.9 nucleus is their best 900,
  # past the candidates; drawn from the whole vocabulary's order.
  ranked = np.argsort(-base)[:1000]
  flat = np.full(v, -30.0, np.float32)
  flat[ranked] = -1e-4 * np.arange(1000)   # nearly equal, in `ranked`'s order
  drawn = _draws(flat, Sampling(temperature=1.0, top_p=0.9), n=4000)
  assert set(drawn) <= set(ranked[:901].tolist())
  assert len(set(drawn) - set(ranked[:generate.NUCLEUS_CANDIDATES].tolist())) > 100
  # A tie at the nucleus's edge: the lower id is kept.
  tie = np.full(v, -30.0, np.float32)
  tie[[7, 3000]] = 1.0
  tie[10] = 2.0
  for seed in range(3):
    assert set(_draws(tie, Sampling(temperature=1.0, top_p=0.75, seed=seed))) == {10, 7}
  # The same past the candidates: 1,000 nearly equal ids, then two tied at
  # the edge of a nucleus that takes one of them.
  tie = np.full(v, -30.0, np.float32)
  tie[ranked] = -1e-6 * np.arange(1000)
  tie[[4000, 3999]] = -1e-6 * 1000
  drawn = set(_draws(tie, Sampling(temperature=1.0, top_p=1000.5 / 1002), n=20000))
  assert 3999 in drawn and 4000 not in drawn


def _sorted_sample(logits, key, s, vocab):
  """What `sample` drew when every filter sorted the whole vocabulary (a
  stable sort, the nucleus over the sorted row, jax.random.categorical
  over the whole row with the rest at -inf)."""
  x = jnp.where(jnp.arange(logits.shape[-1]) < vocab, logits, -jnp.inf) / s.temperature
  order = jnp.argsort(-x, axis=-1, stable=True)
  desc = jnp.take_along_axis(x, order, axis=-1)
  keep = jnp.arange(desc.shape[-1]) < (s.top_k or vocab)
  if s.top_p < 1:
    probs = jax.nn.softmax(jnp.where(keep, desc, -jnp.inf), axis=-1)
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < s.top_p
  rows = jnp.arange(x.shape[0])[:, None]
  kept = jnp.full_like(x, -jnp.inf).at[rows, order].set(jnp.where(keep, desc, -jnp.inf))
  return jax.random.categorical(key, kept, axis=-1)


def test_a_rows_draw_is_the_sorted_vocabularys_whatever_its_batch():
  """Each row's token is the one the whole-vocabulary sort drew with the
  same key, row by row, whichever way its nucleus was found: so it does
  not depend on the other rows (padding rows added for the mesh, finished
  rows), and a seed's text is what it was."""
  v = 4096
  rng = np.random.default_rng(1)
  peaked = rng.normal(size=v).astype(np.float32)
  peaked[rng.choice(v, 4, replace=False)] += 12.0
  flat = rng.normal(size=v).astype(np.float32)
  for s in [Sampling(0.8, top_p=0.9), Sampling(1.0, top_k=40), Sampling(1.3, top_k=300, top_p=0.95),
            Sampling(1.0, top_p=0.5)]:
    for seed in range(6):
      key = jax.random.key(seed)
      for rows in ([peaked, peaked], [peaked, flat], [flat, peaked]):
        x = jnp.asarray(np.stack(rows))
        got = np.asarray(sample(x, key, s, v - 10))
        want = np.asarray(_sorted_sample(x, key, s, v - 10))
        np.testing.assert_array_equal(got, want, err_msg=f'{s} seed {seed}')
      alone = [int(sample(jnp.asarray(np.stack([peaked, r])), key, s, v - 10)[0]) for r in (peaked, flat)]
      assert alone[0] == alone[1]



def test_filters_sort_the_vocabulary_only_where_a_nucleus_needs_it():
  """top_k is a partial selection (XLA:CPU's TopK, not a sort of the row);
  top_p's one sort is the fallback branch's, for a nucleus past the
  candidates. (Slicing top_k's values once turned the selection into a
  full sort: ~90 ms a token at vocab 64,000 on CPU instead of ~2.)"""
  import re
  x, key = jnp.zeros((8, 64000)), jax.random.key(0)
  for s, sorts in [(Sampling(0.8, top_k=40), 0), (Sampling(0.8, top_p=0.9), 1),
                   (Sampling(0.8, top_k=40, top_p=0.9), 0)]:
    text = jax.jit(lambda x, k, s=s: sample(x, k, s, 64000)).lower(x, key).compile().as_text()
    assert len(re.findall(r' sort\(', text)) == sorts, s

@pytest.mark.parametrize('bad,needle', [(dict(temperature=-1), '--temperature -1'),
                                        (dict(top_p=0.0), '--top_p 0.0'), (dict(top_k=-2), '--top_k -2'),
                                        (dict(seed=2**63), f'--seed {2**63}')])
def test_bad_sampling_settings_are_named(bad, needle):
  with pytest.raises(UserError, match=needle):
    Sampling(**bad).check()


# --- the command -------------------------------------------------------------------

SMALL = ['ModelConfig.d_model = 128', 'ModelConfig.n_layers = 4', 'ModelConfig.d_ff = 256',
         'ModelConfig.sliding_window = 16', 'ModelConfig.full_attention_every = 2',
         'ModelConfig.dtype = "float32"', 'DataConfig.seq_len = 64', 'TrainConfig.global_batch_size = 16',
         'TrainConfig.steps = 4', 'OptimConfig.warmup_steps = 2', 'TrainConfig.eval_every = 0',
         'TrainConfig.progress = False', 'CheckpointConfig.save_every = 4', 'MeshConfig.data = 8']


@pytest.fixture(scope='module')
def run(tmp_path_factory) -> str:
  workdir = str(tmp_path_factory.mktemp('run'))
  trainer.run(C.load_config(['tiny.gin'], SMALL, num_devices=8), workdir)
  return workdir



def mjax_generate(*argv):
  args, bindings = generate.parse_args(list(argv))
  return generate.main(args, bindings)


@pytest.mark.slow
def test_greedy_text_is_the_same_on_another_mesh(run, capsys):
  prompts = ['def main(', 'import os\n', 'x']
  argv = ['--workdir', run, '--temperature', '0', '--max_new_tokens', '40', '--no-stop_at_eos',
          '--format', 'jsonl'] + [a for p in prompts for a in ('--prompt', p)]
  one = mjax_generate(*argv)
  lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert [r['prompt'] for r in lines] == prompts and lines == one
  assert all(r['tokens'] == 40 and r['finish_reason'] == 'length' for r in one)
  # 40 new tokens per prompt, the ring buffers of the 16-token windows wrapped:
  # the same greedy text on data x tensor, and the batch padded to the mesh.
  other = mjax_generate(*argv, '--gin.MeshConfig.data=2', '--gin.MeshConfig.tensor=4')
  assert [r['completion'] for r in other] == [r['completion'] for r in one]
  # A prompt alone generates what it generated in the batch.
  alone = mjax_generate('--workdir', run, '--temperature', '0', '--max_new_tokens', '40', '--no-stop_at_eos',
                        '--prompt', prompts[1], '--format', 'jsonl')
  assert alone[0]['completion'] == one[1]['completion']


def test_seeded_sampling_repeats_and_streams(run, capsys):
  argv = ['--workdir', run, '--prompt', 'class ', '--max_new_tokens', '24', '--temperature', '1.0',
          '--top_k', '20', '--top_p', '0.9']
  a = mjax_generate(*argv, '--seed', '1')
  streamed = capsys.readouterr().out
  assert streamed == 'class ' + a[0]['completion'] + '\n'
  assert mjax_generate(*argv, '--seed', '1') == a
  capsys.readouterr()
  # Another seed draws other tokens (24 tokens from a near-uniform model).
  assert mjax_generate(*argv, '--seed', '2')[0]['completion'] != a[0]['completion']


def test_prompt_file_and_bad_input(run, tmp_path, repo_root, monkeypatch):
  f = tmp_path / 'p.jsonl'
  f.write_text(json.dumps('line one\nline two') + '\n\n' + json.dumps({'prompt': 'b'}) + '\n'
               + json.dumps({'text': 'c', 'source': 'as in a data file'}) + '\n')
  got = mjax_generate('--workdir', run, '--prompt_file', str(f), '--max_new_tokens', '3', '--temperature', '0',
                      '--format', 'jsonl')
  assert [r['prompt'] for r in got] == ['line one\nline two', 'b', 'c']
  # Standard input, one prompt per line.
  monkeypatch.setattr(sys, 'stdin', io.TextIOWrapper(io.BytesIO('\ufefffirst\nsecond one\n'.encode())))
  got = mjax_generate('--workdir', run, '--prompt_file', '-', '--max_new_tokens', '2', '--temperature', '0',
                      '--format', 'jsonl')
  assert [r['prompt'] for r in got] == ['first', 'second one']   # a byte-order mark is no part of it
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"text": 1}\n')
  with pytest.raises(UserError, match='line 1'):
    mjax_generate('--workdir', run, '--prompt_file', str(bad))
  with pytest.raises(UserError, match='MeshConfig.pipeline'):
    mjax_generate('--workdir', run, '--prompt', 'x', '--gin.MeshConfig.data=4', '--gin.MeshConfig.pipeline=2')
  # A KV cache beyond the host's memory, and a prompt that is no text,
  # are named before anything is allocated.
  with pytest.raises(UserError, match=r'KV cache for .* tokens needs .* lower --max_new_tokens'):
    mjax_generate('--workdir', run, '--prompt', 'x', '--max_new_tokens', str(10 ** 12))
  # On CPU the cache counts against the memory still free, not the
  # machine's: past it the OOM killer ends the process with no word.
  real = generate.available_memory_bytes
  monkeypatch.setattr(generate, 'available_memory_bytes', lambda: 1 << 10)
  with pytest.raises(UserError, match=r"more than this host's free memory \(0\.0 GiB\)"):
    mjax_generate('--workdir', run, '--prompt', 'x', '--max_new_tokens', '40')
  monkeypatch.setattr(generate, 'available_memory_bytes', real)
  # A step's working memory past what is left: the same advice, no traceback.
  def exhausted(*a, **k):
    raise jax.errors.JaxRuntimeError('RESOURCE_EXHAUSTED: Out of memory allocating 82054647232 bytes.')
  monkeypatch.setattr(generate.Generator, 'run', exhausted)
  with pytest.raises(UserError, match=r'generation ran out of memory \(RESOURCE_EXHAUSTED.*lower --max_new_tokens'):
    mjax_generate('--workdir', run, '--prompt', 'x', '--max_new_tokens', '4')
  monkeypatch.undo()
  with pytest.raises(UserError, match=r'prompt 2 .* is not valid text'):
    mjax_generate('--workdir', run, '--prompt', 'fine', '--prompt', 'bad \udcff bytes')
  # The installed command: a missing step exits 2 naming the saved ones.
  r = subprocess.run([sys.executable, '-c', 'from mjax.cli import generate_main; generate_main()',
                      '--workdir', run, '--prompt', 'x', '--step', '3'],
                     capture_output=True, text=True, cwd=repo_root, timeout=300)
  assert r.returncode == 2, r.stderr
  assert 'no checkpoint of --step 3' in r.stderr and 'persistent tier' in r.stderr


def test_a_pipelined_run_generates_data_parallel_on_the_same_devices(run, tmp_path, capsys):
  # The same checkpoint under a run config with a pipeline (data 4 x
  # pipeline 2, 1F1B): generation folds the pipeline
  # into data by itself and samples what the plain run samples.
  piped = tmp_path / 'piped'
  piped.mkdir()
  (piped / 'config.gin').write_text(open(os.path.join(run, 'config.gin')).read() + '\n'.join([
      '', 'MeshConfig.data = 4', 'MeshConfig.pipeline = 2', 'MeshConfig.virtual_stages = 1',
      'MeshConfig.microbatches = 4', "MeshConfig.pipeline_schedule = '1f1b'", '']))
  # The checkpoints, reached through a link, are the run's, not this
  # directory's: said, and read when named.
  os.symlink(os.path.join(run, 'checkpoints'), piped / 'checkpoints')
  argv = ['--temperature', '0', '--max_new_tokens', '12', '--prompt', 'def ', '--format', 'jsonl']
  with pytest.raises(UserError, match=rf"persistent tier \({piped}/checkpoints\): another run's \(workdir {run}\), "
                                      rf"not this one's; read it with --checkpoint {piped}/checkpoints"):
    mjax_generate('--workdir', str(piped), *argv)
  capsys.readouterr()
  got = mjax_generate('--workdir', str(piped), '--checkpoint', str(piped / 'checkpoints'), *argv)
  assert 'the run is pipelined (pipeline 2, virtual_stages 1); generating on data 8' in capsys.readouterr().err
  assert got == mjax_generate('--workdir', run, *argv)


def test_cache_bytes_is_what_the_cache_allocates():
  from mjax.generate import cache_bytes
  for extra in ([], ['ModelConfig.sliding_window = 16', 'ModelConfig.full_attention_every = 2',
                     'ModelConfig.n_kv_heads = 2', 'ModelConfig.dtype = "float32"']):
    m = C.load_config(['tiny.gin'], extra).model
    for batch, max_len in ((1, 10), (3, 100)):
      allocated = sum(a.nbytes for a in jax.tree.leaves(init_cache(m, batch, max_len)))
      assert cache_bytes(m, batch, max_len) == allocated


@pytest.mark.slow
def test_matrices_cast_once_give_the_same_tokens(monkeypatch):
  """bf16 compute: casting the weight matrices once before decoding (norm
  scales, stacked per layer, stay fp32) gives the tokens of casting them at
  every step, and the prompt's cached logits match the full forward pass."""
  from mjax.generate import Generator
  from mjax.parallel import make_mesh
  cfg = C.load_config(['tiny.gin'], ['MeshConfig.data = 1', 'ModelConfig.dtype = "bfloat16"'], num_devices=1)
  mesh = make_mesh(cfg.mesh, devices=jax.devices()[:1])
  model = Transformer(cfg.model)
  params = nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))['params'])
  gen = Generator(cfg, mesh, 256, Sampling(temperature=0))
  cast = gen.compute_params(params)
  assert cast['embedding'].dtype == jnp.bfloat16
  assert cast['layers']['block_0']['norm']['scale'].dtype == jnp.float32
  prompts = [np.arange(5, 30, dtype=np.int32), np.arange(40, 52, dtype=np.int32)]
  a, _ = gen.run(params, prompts, 12, None)
  b, _ = gen.run(cast, prompts, 12, None)
  assert (a == b).all() and a.shape == (2, 12)
  # A long prompt prefilled in chunks (windows of 64 wrap inside one chunk
  # of 48 plus the cache) gives the same tokens as one prefill call.
  long = [np.arange(150, dtype=np.int32) % 200, np.arange(37, dtype=np.int32)]
  whole, _ = gen.run(cast, long, 10, None, prefill_chunk=1024)
  chunked, _ = gen.run(cast, long, 10, None, prefill_chunk=48)
  assert (whole == chunked).all()
  # A prefill of many chunks says where it is (a 200k-token prompt ran for
  # minutes without a word), and gives the same tokens.
  said = []
  monkeypatch.setattr(generate, 'PROGRESS_CHUNKS', 2)
  monkeypatch.setattr(generate, 'PROGRESS_S', 0.0)
  told, _ = gen.run(cast, long, 10, None, prefill_chunk=48, on_prefill=lambda done, total: said.append((done, total)))
  assert (told == whole).all()
  assert said == [(6, 150), (54, 150), (102, 150)], said   # chunks of 48 after 42 tokens of padding


def test_prompts_start_where_documents_start_in_training():
  # With document attention, a document's tokens never attend to the EOS
  # before it and start at position 0: a prompt is encoded so, and only an
  # empty one keeps the EOS (something for the first token to follow).
  from mjax import data as data_lib
  from mjax.generate import encode_prompt
  tok = data_lib.load_tokenizer('bytes')
  eos = tok.info.eos_id
  assert encode_prompt(tok, 'ab', False).tolist() == [eos, *tok.encode('ab')]
  assert encode_prompt(tok, 'ab', True).tolist() == list(tok.encode('ab'))
  assert encode_prompt(tok, '', True).tolist() == [eos]


def test_the_memory_check_counts_each_devices_weights_and_cache(monkeypatch):
  """On CPU every device's buffers are the host's memory: 125m's weights
  replicated over 8 data-parallel devices are 8 copies (fp32 and the
  compute copy, ~6 GiB), sharded over fsdp = 8 one copy. Refused, and
  accepted, by what each layout holds."""
  monkeypatch.setattr(generate, 'available_memory_bytes', lambda: 2 << 30)
  from mjax.parallel import make_mesh
  load = lambda *b: C.load_config(['125m.gin'], list(b), num_devices=8)
  cfg = load('MeshConfig.data = 8')
  with pytest.raises(UserError, match=r'and the weights ([5-7])\.\d GiB beside it, more than this host\'s free '
                                      r'memory \(2\.0 GiB\).*MeshConfig\.fsdp'):
    generate._check_cache_fits(cfg, make_mesh(cfg.mesh), 8, 256)
  cfg = load('MeshConfig.data = 1', 'MeshConfig.fsdp = 8')
  generate._check_cache_fits(cfg, make_mesh(cfg.mesh), 8, 256)
