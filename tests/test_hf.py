"""mjax-export: Hugging Face transformers loads the exported model and its
fp32 logits are mjax's."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mjax import config as C
from mjax import hf as export, trainer
from mjax.errors import UserError
from mjax.model import Transformer

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

SEQUENTIAL = ['ModelConfig.block = "sequential"', 'ModelConfig.mlp = "swiglu"', 'ModelConfig.norm = "rmsnorm"',
              'ModelConfig.n_kv_heads = 2']
FULL = ['ModelConfig.sliding_window = None', 'ModelConfig.full_attention_every = 0']
SEQ = 24   # longer than the windows of 8 below: the window shapes the logits


def _cfg(*over):
  return C.load_config(['tiny.gin'], ['ModelConfig.dtype = "float32"', 'MeshConfig.data = 1', *over],
                       num_devices=1)


def _random_params(model, tokens, seed=0):
  """Init's tree with every array random (norm scales near 1, biases and
  kernels away from their 1 / 0 init), so a misplaced weight shows."""
  from flax import linen as nn
  params = nn.meta.unbox(model.init(jax.random.key(seed), tokens)['params'])
  rng = np.random.default_rng(seed)

  def fill(path, a):
    z = rng.standard_normal(a.shape).astype(np.float32)
    name = path[-1].key
    return jnp.asarray(1 + 0.2 * z if name == 'scale' else 0.2 * z if name == 'bias' else 0.05 * z)

  return jax.tree_util.tree_map_with_path(fill, params)


def _hf_logits(out, tokens):
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens, np.int64))).logits.numpy()


def _relative(a, b):
  return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize('over,arch', [
    (FULL, 'GPTNeoXForCausalLM'),
    (FULL + ['ModelConfig.use_bias = True', 'ModelConfig.tie_embeddings = False'], 'GPTNeoXForCausalLM'),
    (SEQUENTIAL + FULL + ['ModelConfig.use_bias = True'], 'LlamaForCausalLM'),
    (SEQUENTIAL + ['ModelConfig.sliding_window = 8', 'ModelConfig.full_attention_every = 0'], 'MistralForCausalLM'),
    (SEQUENTIAL + ['ModelConfig.sliding_window = 8', 'ModelConfig.full_attention_every = 2',
                   'ModelConfig.scan_layers = False'], 'MinistralForCausalLM'),
], ids=['parallel_gpt_neox', 'parallel_bias_untied', 'llama_gqa_bias', 'mistral_window', 'ministral_mixed'])
def test_transformers_computes_the_same_logits(over, arch, tmp_path):
  cfg = _cfg(*over)
  model = Transformer(cfg.model)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 258, (2, SEQ)), jnp.int32)
  params = _random_params(model, tokens)
  ours = np.asarray(model.apply({'params': params}, tokens))
  conf = export.export_hf(jax.device_get(params), cfg, str(tmp_path / 'hf'))
  assert conf['architectures'] == [arch]
  assert sorted(os.listdir(tmp_path)) == ['hf']   # no temporary directory left behind
  assert _relative(_hf_logits(str(tmp_path / 'hf'), tokens), ours) < 1e-4


def test_parallel_windows_are_refused_or_dropped(tmp_path):
  cfg = _cfg('ModelConfig.sliding_window = 8', 'ModelConfig.full_attention_every = 2')
  with pytest.raises(UserError, match='ModelConfig.sliding_window = 8.*--drop_sliding_window'):
    export.export_hf({}, cfg, str(tmp_path / 'a'))
  assert not os.path.exists(tmp_path / 'a')
  # Dropped: full attention, the same logits for texts up to the window.
  model = Transformer(cfg.model)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 258, (2, 8)), jnp.int32)
  params = _random_params(model, tokens)
  export.export_hf(jax.device_get(params), cfg, str(tmp_path / 'b'), drop_window=True)
  ours = np.asarray(model.apply({'params': params}, tokens))
  assert _relative(_hf_logits(str(tmp_path / 'b'), tokens), ours) < 1e-4


@pytest.mark.parametrize('over,needle', [
    (FULL + ['ModelConfig.norm = "rmsnorm"'], "ModelConfig.norm = 'rmsnorm'"),
    (FULL + ['ModelConfig.mlp = "swiglu"'], "ModelConfig.mlp = 'swiglu'"),
    (FULL + ['ModelConfig.n_kv_heads = 2'], 'ModelConfig.n_kv_heads = 2'),
    (SEQUENTIAL + FULL + ['ModelConfig.mlp = "gelu"'], "ModelConfig.mlp = 'gelu'"),
    (SEQUENTIAL + FULL + ['ModelConfig.rotary_fraction = 0.5'], 'ModelConfig.rotary_fraction = 0.5'),
    (SEQUENTIAL + ['ModelConfig.use_bias = True'], 'ModelConfig.use_bias = True'),
])
def test_what_no_architecture_represents_is_refused_by_name(over, needle):
  with pytest.raises(UserError, match=needle.replace('(', r'\(')):
    export.architecture(_cfg(*over).model)


def test_interrupted_export_leaves_nothing(tmp_path, monkeypatch):
  cfg = _cfg(*FULL)
  model = Transformer(cfg.model)
  params = jax.device_get(_random_params(model, jnp.zeros((1, 4), jnp.int32)))

  def fail(*_, **__):
    raise OSError('disk full')

  monkeypatch.setattr(export, 'write_tokenizer', fail)
  with pytest.raises(UserError, match=r'could not be written \(disk full\); nothing is left of it'):
    export.export_hf(params, cfg, str(tmp_path / 'out'))
  assert os.listdir(tmp_path) == []
  monkeypatch.undo()
  # A full disk as safetensors says it (its own error class, not OSError).
  import safetensors.numpy

  def full(*_, **__):
    raise safetensors.SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)')

  monkeypatch.setattr(safetensors.numpy, 'save_file', full)
  with pytest.raises(UserError, match=r'could not be written \(I/O error: No space left on device \(os error '
                                      r'28\)\); nothing is left of it'):
    export.export_hf(params, cfg, str(tmp_path / 'out'))
  assert os.listdir(tmp_path) == []
  monkeypatch.undo()
  (tmp_path / 'busy').mkdir()
  (tmp_path / 'busy' / 'keep.txt').write_text('mine')
  with pytest.raises(UserError, match='is a directory that holds files'):
    export.export_hf(params, cfg, str(tmp_path / 'busy'))
  assert (tmp_path / 'busy' / 'keep.txt').read_text() == 'mine'
  # Links (dangling, or to an empty directory) and a parent that is a file.
  (tmp_path / 'empty').mkdir()
  for name, target in [('dangling', tmp_path / 'nowhere'), ('to_empty', tmp_path / 'empty')]:
    os.symlink(target, tmp_path / name)
    with pytest.raises(UserError, match='is a symbolic link'):
      export.export_hf(params, cfg, str(tmp_path / name))
  with pytest.raises(UserError, match='cannot write in'):
    export.export_hf(params, cfg, str(tmp_path / 'busy' / 'keep.txt' / 'out'))
  # Not among a run's steps, nor inside one: the run would read it as a
  # damaged step, or delete it with the step.
  from mjax.checkpoint.directories import OWNER_FILE
  (tmp_path / 'run' / 'checkpoints' / '40' / 'state').mkdir(parents=True)
  (tmp_path / 'run' / 'checkpoints' / OWNER_FILE).write_text('{"workdir": "run"}')
  for inside in ('50', '40/hf', 'hf/a'):
    with pytest.raises(UserError, match=r"is inside .*checkpoint.*of a training run"):
      export.export_hf(params, cfg, str(tmp_path / 'run' / 'checkpoints' / inside))
  assert sorted(os.listdir(tmp_path / 'run' / 'checkpoints')) == ['.mjax-run.json', '40']
  # Every file as readable as the umask allows, as the directory is.
  export.export_hf(params, cfg, str(tmp_path / 'ok'))
  umask = os.umask(0)
  os.umask(umask)
  assert {os.stat(tmp_path / 'ok' / n).st_mode & 0o777 for n in os.listdir(tmp_path / 'ok')} == {0o666 & ~umask}


def test_an_export_path_that_is_taken_is_said_for_what_it_is(tmp_path):
  (tmp_path / 'notes.txt').write_text('notes')
  with pytest.raises(UserError, match=r"notes.txt' is a file: the export writes a new directory"):
    export.check_out(str(tmp_path / 'notes.txt'))
  with pytest.raises(UserError, match=r"is a directory that holds files: the export writes a new directory"):
    export.check_out(str(tmp_path))
  assert (tmp_path / 'notes.txt').read_text() == 'notes'


def test_a_run_with_nothing_saved_is_said_first(tmp_path):
  # Before, the export asked for --drop_sliding_window first, then, given
  # it, said there was nothing to export.
  C.write(C.load_config(['tiny.gin'], []), str(tmp_path / 'run'))
  args, bindings = export.parse_export_args([str(tmp_path / 'hf'), '--workdir', str(tmp_path / 'run')])
  with pytest.raises(UserError, match=r"--workdir '.*/run' holds no saved checkpoint"):
    export.export_main(args, bindings)
  assert not os.path.exists(tmp_path / 'hf')


def test_cli_exports_a_trained_run_with_its_byte_tokenizer(tmp_path, repo_root):
  """A run trained through the trainer (tiny: parallel block, windows), exported
  through the command; the tokenizer maps text to the same byte ids."""
  workdir = str(tmp_path / 'run')
  small = ['ModelConfig.d_model = 128', 'ModelConfig.n_layers = 2', 'ModelConfig.d_ff = 256',
           'ModelConfig.dtype = "float32"', 'DataConfig.seq_len = 64', 'TrainConfig.global_batch_size = 8',
           'TrainConfig.steps = 2', 'OptimConfig.warmup_steps = 1', 'TrainConfig.eval_every = 0',
           'TrainConfig.progress = False', 'CheckpointConfig.save_every = 2', 'MeshConfig.data = 8']
  cfg = C.load_config(['tiny.gin'], small, num_devices=8)
  trainer.run(cfg, workdir)
  out = str(tmp_path / 'hf')
  args, bindings = export.parse_export_args([out, '--workdir', workdir])
  with pytest.raises(UserError, match='--drop_sliding_window'):
    export.export_main(args, bindings)
  args, bindings = export.parse_export_args([out, '--workdir', workdir, '--drop_sliding_window'])
  result = export.export_main(args, bindings)
  assert result['architecture'] == 'GPTNeoXForCausalLM' and result['step'] == 2
  tok = transformers.AutoTokenizer.from_pretrained(out)
  text = 'def héllo():'
  # EOS first, as mjax-generate feeds a prompt to a model trained without
  # document attention: model.generate(**tok(prompt)) continues it alike.
  assert tok(text)['input_ids'] == [256] + list(text.encode('utf-8'))
  assert tok(text, add_special_tokens=False)['input_ids'] == list(text.encode('utf-8'))
  # Special tokens' text is text, as mjax encodes it: no EOS or PAD mid-text.
  special = 'a<|endoftext|>b<|pad|>'
  from mjax.data import load_tokenizer
  mjax_ids = load_tokenizer('bytes').encode_documents([special.encode()])[:-1].tolist()   # less its closing EOS
  assert tok(special)['input_ids'] == [256] + mjax_ids == [256] + list(special.encode())
  assert tok.eos_token_id == 256 and tok.decode(tok(text)['input_ids'], skip_special_tokens=True) == text
  with open(os.path.join(out, 'config.json')) as fh:
    assert json.load(fh)['eos_token_id'] == 256
  # Sampling skips the ids no text encodes to (PAD, the embedding's padding
  # past 258), as mjax-generate does.
  gen_cfg = transformers.GenerationConfig.from_pretrained(out)
  assert gen_cfg.suppress_tokens == [257, *range(258, 384)] and gen_cfg.eos_token_id == 256
  # The trained weights: mjax's logits from the checkpoint, on a text within the window.
  from mjax import evaluate
  from mjax.parallel import make_mesh
  from mjax.train import make_program
  program = make_program(cfg, make_mesh(cfg.mesh))
  _, params, _, _ = evaluate.restore(program, evaluate.choose(evaluate.parse_args(['--workdir', workdir])[0], cfg))
  from mjax.generate import encode_prompt
  ids = jnp.asarray([encode_prompt(load_tokenizer('bytes'), text, cfg.data.document_attention)], jnp.int32)
  assert ids[0].tolist() == tok(text)['input_ids']
  ours = np.asarray(Transformer(cfg.model).apply({'params': jax.device_get(params)}, ids))
  assert _relative(_hf_logits(out, ids), ours) < 1e-4


# --- import ---------------------------------------------------------------------------

def _hf_model(kind, tmp_path, **extra):
  """A small random Hugging Face model saved to a directory (nothing downloaded)."""
  torch.manual_seed(0)
  base = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
              max_position_embeddings=64)
  if kind == 'gpt_neox':
    conf = transformers.GPTNeoXConfig(**base, **{'rotary_pct': 0.25, 'hidden_act': 'gelu', **extra})
    model = transformers.GPTNeoXForCausalLM(conf)
  elif kind == 'llama':
    conf = transformers.LlamaConfig(**base, num_key_value_heads=2, **extra)
    model = transformers.LlamaForCausalLM(conf)
  elif kind == 'mistral':
    conf = transformers.MistralConfig(**base, num_key_value_heads=2, sliding_window=8, **extra)
    model = transformers.MistralForCausalLM(conf)
  else:
    conf = transformers.MinistralConfig(**base, num_key_value_heads=2, sliding_window=8, head_dim=16,
                                        layer_types=['sliding_attention', 'full_attention'] * 2, **extra)
    model = transformers.MinistralForCausalLM(conf)
  with torch.no_grad():   # every weight random, biases and norms included, so a misplaced one shows
    for name, p in model.named_parameters():
      p.copy_(1 + 0.2 * torch.randn_like(p) if 'norm' in name and name.endswith('weight')
              else 0.1 * torch.randn_like(p))
  out = str(tmp_path / kind)
  model.save_pretrained(out, safe_serialization=True)
  return out, model


@pytest.mark.parametrize('kind,extra', [
    ('gpt_neox', {}),                                       # Pythia-style: parallel, rotary 1/4, two norms, erf GeLU
    ('gpt_neox', {'use_parallel_residual': False, 'hidden_act': 'gelu_new', 'rotary_pct': 1.0}),
    ('llama', {}),
    ('llama', {'attention_bias': True, 'tie_word_embeddings': True}),
    ('mistral', {}),
    ('ministral', {}),
], ids=['gpt_neox_pythia', 'gpt_neox_sequential', 'llama_gqa', 'llama_bias_tied', 'mistral', 'ministral'])
def test_import_gives_the_models_logits_and_exports_back(kind, extra, tmp_path):
  path, model = _hf_model(kind, tmp_path, **extra)
  bindings = export.gin_bindings(path)
  cfg = C.load_config(['tiny.gin'], ['ModelConfig.dtype = "float32"', 'MeshConfig.data = 1', *bindings],
                      num_devices=1)
  params = export.import_params(path, cfg.model)
  tokens = np.random.default_rng(3).integers(0, 300, (2, SEQ))
  with torch.no_grad():
    theirs = model(torch.tensor(tokens)).logits.numpy()
  ours = np.asarray(Transformer(cfg.model).apply({'params': params}, jnp.asarray(tokens, jnp.int32)))
  assert _relative(ours, theirs) < 1e-4
  # Back out again: the same logits from the exported directory.
  export.export_hf(params, cfg, str(tmp_path / 'again'))
  assert _relative(_hf_logits(str(tmp_path / 'again'), tokens), theirs) < 1e-4


def test_import_journey_through_the_trainer(tmp_path, capsys):
  """mjax-import writes the gin; a fresh run starts from the weights (fresh
  optimizer) and the run's config is refused when it describes another model."""
  from mjax import cli
  path, model = _hf_model('gpt_neox', tmp_path)
  gin = str(tmp_path / 'ft.gin')
  cli.import_main([path, gin])
  # The test model has no tokenizer.json: said, in the gin file too.
  said = "has no tokenizer.json, so " + gin + " leaves DataConfig.tokenizer at mjax's byte tokenizer"
  assert said in capsys.readouterr().err and said in open(gin).read()
  with pytest.raises(SystemExit) as e:
    cli.import_main([path, gin])    # never overwritten
  assert e.value.code == 2 and 'exists' in capsys.readouterr().err
  export.write_tokenizer(path, 'bytes', 256)   # with one, the gin names it and nothing is said
  cli.import_main([path, str(tmp_path / 'tok.gin')])
  assert 'warning' not in capsys.readouterr().err
  assert f"DataConfig.tokenizer = '{path}/tokenizer.json'" in open(tmp_path / 'tok.gin').read()
  extra = ['ModelConfig.dtype = "float32"', 'MeshConfig.data = 8', 'DataConfig.seq_len = 32',
           'TrainConfig.global_batch_size = 8', 'TrainConfig.progress = False', 'ModelConfig.vocab_size = 300']
  cfg = C.load_config([gin], extra, num_devices=8)
  assert cfg.checkpoint.init_from_hf == path and cfg.model.parallel_norms == 'separate'
  state = trainer.Trainer(cfg, str(tmp_path / 'run')).state
  want = export.import_params(path, cfg.model)
  got = jax.device_get(state.params)
  for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(p))
  assert int(state.step) == 0
  # A config of another shape is refused by name.
  bad = C.load_config([gin], extra + ['ModelConfig.d_ff = 256'], num_devices=8)
  with pytest.raises(UserError, match='ModelConfig.d_ff = 128'):
    trainer.Trainer(bad, str(tmp_path / 'run2'))
  # A model directory gone: refused at the fresh start that reads it, by
  # its key; the run's own recorded config still loads, and a resume
  # never reads it.
  saved = C.load_config([str(tmp_path / 'run' / 'config.gin')], [], num_devices=8)
  assert saved.checkpoint.init_from_hf == path
  os.rename(path, path + '.moved')
  C.load_config([str(tmp_path / 'run' / 'config.gin')], [], num_devices=8)
  with pytest.raises(UserError, match=r"CheckpointConfig.init_from_hf = '.*', the weights a new run starts from: .* is not a Hugging Face model "
                                      r'directory.*Give a Hugging Face model directory'):
    trainer.Trainer(cfg, str(tmp_path / 'run3'))


def test_bfloat16_checkpoint_imports(tmp_path):
  """Most released checkpoints are saved in bfloat16 (numpy has no such dtype)."""
  path, model = _hf_model('llama', tmp_path)
  model.to(torch.bfloat16).save_pretrained(str(tmp_path / 'bf16'), safe_serialization=True)
  cfg = C.load_config(['tiny.gin'], ['ModelConfig.dtype = "float32"', 'MeshConfig.data = 1',
                                     *export.gin_bindings(str(tmp_path / 'bf16'))], num_devices=1)
  params = export.import_params(str(tmp_path / 'bf16'), cfg.model)
  want = model.model.embed_tokens.weight.float().detach().numpy()
  np.testing.assert_array_equal(params['embedding'], want)


def test_a_config_that_would_drop_weights_is_refused(tmp_path):
  """Pythia's biases and separate norms must not load into a config without them."""
  path, _ = _hf_model('gpt_neox', tmp_path)
  bindings = export.gin_bindings(path)
  for wrong, needle in (('ModelConfig.use_bias = False', 'use_bias = True'),
                        ('ModelConfig.parallel_norms = "shared"', "parallel_norms = 'separate'")):
    cfg = C.load_config(['tiny.gin'], ['ModelConfig.dtype = "float32"', 'MeshConfig.data = 1', *bindings, wrong],
                        num_devices=1)
    with pytest.raises(UserError, match=needle):
      export.import_params(path, cfg.model)


def _edit_config(path, **changes):
  with open(os.path.join(path, 'config.json')) as fh:
    conf = json.load(fh)
  conf.update(changes)
  with open(os.path.join(path, 'config.json'), 'w') as fh:
    json.dump(conf, fh)


def test_import_refuses_a_config_json_that_does_not_describe_its_weights(tmp_path):
  import shutil
  from safetensors.numpy import load_file, save_file
  path, _ = _hf_model('gpt_neox', tmp_path)
  pristine = str(tmp_path / 'pristine')
  shutil.copytree(path, pristine)

  def case(name, **changes):
    p = str(tmp_path / name)
    shutil.copytree(pristine, p)
    _edit_config(p, **changes)
    return p
  for p, said in [
      (case('wide', hidden_size=128), "tensor 'gpt_neox.embed_in.weight' has shape (300, 64)"),
      (case('heads', num_attention_heads=3), 'describes a model mjax cannot build'),
      (case('text', num_hidden_layers='2'), "num_hidden_layers = '2'"),
      (case('none', hidden_size=None), 'hidden_size = None'),
      (case('tiny_vocab', vocab_size=100), "'gpt_neox.embed_in.weight' has shape (300, 64)"),
      (case('fewer_layers', num_hidden_layers=1), 'does not describe (layers 1-3, where config.json has '
                                                   'num_hidden_layers = 1)'),
      # Read as a truth value, "false" tied the head; 0 positions became 2048.
      (case('tie_text', tie_word_embeddings='false'), "tie_word_embeddings 'false' in config.json is not true or false"),
      (case('no_positions', max_position_embeddings=0), 'max_position_embeddings 0 in config.json is not a positive')]:
    with pytest.raises(UserError, match=re.escape(said)):
      export.gin_bindings(p)
  listed = str(tmp_path / 'listed')
  shutil.copytree(pristine, listed)
  with open(os.path.join(listed, 'config.json'), 'w') as fh:
    json.dump([1, 2], fh)
  with pytest.raises(UserError, match='holds a JSON list'):
    export.gin_bindings(listed)
  # Weights one row short, or integers (a quantized model), with a true config.
  for name, edit, said in [('short', lambda t: t[:-1], 'has shape (191, 64)'),
                           ('ints', lambda t: t.astype(np.int32), 'not floating point')]:
    p = str(tmp_path / name)
    shutil.copytree(pristine, p)
    tensors = load_file(os.path.join(p, 'model.safetensors'))
    key = 'gpt_neox.layers.1.attention.query_key_value.weight'
    tensors[key] = np.ascontiguousarray(edit(tensors[key]))
    save_file(tensors, os.path.join(p, 'model.safetensors'))
    with pytest.raises(UserError, match=re.escape(said)):
      export.gin_bindings(p)
  # Pythia's buffers beside the weights (a bool causal mask, its fill value,
  # the rotary frequencies) are no weights: imported as before.
  p = str(tmp_path / 'buffers')
  shutil.copytree(pristine, p)
  tensors = load_file(os.path.join(p, 'model.safetensors'))
  tensors.update({'gpt_neox.layers.0.attention.bias': np.tril(np.ones((1, 1, 8, 8), bool)),
                  'gpt_neox.layers.0.attention.masked_bias': np.array(-1e9, np.float32),
                  'gpt_neox.layers.0.attention.rotary_emb.inv_freq': np.ones(4, np.float32)})
  save_file(tensors, os.path.join(p, 'model.safetensors'))
  assert export.gin_bindings(p) == export.gin_bindings(pristine)[:-1] + [f'CheckpointConfig.init_from_hf = {p!r}']
  with open(os.path.join(pristine, 'model.safetensors.index.json'), 'w') as fh:
    fh.write('{"weight_map": 5}')
  with pytest.raises(UserError, match='is not an index of safetensors shards'):
    export.gin_bindings(pristine)


def test_import_writes_nothing_through_a_link_or_into_a_missing_directory(tmp_path, capsys):
  from mjax import cli
  path, _ = _hf_model('llama', tmp_path)
  precious = tmp_path / 'precious.txt'
  precious.write_text('precious')
  os.symlink(precious, tmp_path / 'o.gin.tmp')
  cli.import_main([path, str(tmp_path / 'o.gin')])
  assert precious.read_text() == 'precious' and 'init_from_hf' in (tmp_path / 'o.gin').read_text()
  assert not os.path.islink(tmp_path / 'o.gin') and oct(os.stat(tmp_path / 'o.gin').st_mode)[-3:] == '644'
  with pytest.raises(SystemExit) as exit_info:
    cli.import_main([path, str(tmp_path / 'nodir' / 'o.gin')])
  assert exit_info.value.code == 2 and 'does not exist; create it first' in capsys.readouterr().err
  with pytest.raises(SystemExit) as exit_info:
    cli.import_main([path, str(precious / 'o.gin')])
  assert exit_info.value.code == 2 and "precious.txt' is a file, not a directory." in capsys.readouterr().err
  # Nor into a run's checkpoint directory, which holds its steps alone.
  from mjax.checkpoint.directories import OWNER_FILE
  (tmp_path / 'ck').mkdir()
  (tmp_path / 'ck' / OWNER_FILE).write_text('{"workdir": "/r"}')
  with pytest.raises(SystemExit) as exit_info:
    cli.import_main([path, str(tmp_path / 'ck' / '5.gin')])
  assert exit_info.value.code == 2 and 'a checkpoint directory of a training run' in capsys.readouterr().err
  assert not list(tmp_path.glob('.mjax-import-*')) and not (tmp_path / 'ck' / '5.gin').exists()


def test_import_refuses_what_mjax_cannot_compute(tmp_path):
  path, _ = _hf_model('llama', tmp_path, rope_scaling={'rope_type': 'linear', 'factor': 2.0})
  with pytest.raises(UserError, match="rope_type 'linear'"):
    export.gin_bindings(path)
  with pytest.raises(UserError, match='not a Hugging Face model directory'):
    export.gin_bindings(str(tmp_path))
  # Both keys: transformers applies the legacy rope_scaling; a plain
  # rope_parameters beside it imported the model as plain rotary.
  path, _ = _hf_model('llama', tmp_path / 'both')
  conf_path = os.path.join(path, 'config.json')
  conf = json.load(open(conf_path))
  conf['rope_parameters'] = {'rope_type': 'default', 'rope_theta': 10000.0}
  conf['rope_scaling'] = {'type': 'linear', 'factor': 2.0}
  json.dump(conf, open(conf_path, 'w'))
  with pytest.raises(UserError, match="rope_scaling: rope_type 'linear'"):
    export.gin_bindings(path)


def test_import_names_an_mjax_run_for_what_it_is(tmp_path):
  # A run's workdir has a config.json too, mjax's own: said as a run, with
  # what trains from it, rather than "model_type None cannot be imported".
  run = tmp_path / 'run'
  run.mkdir()
  (run / 'config.json').write_text(json.dumps({'model': {'d_model': 64}, 'checkpoint': {}}))
  with pytest.raises(UserError, match=r"is an mjax-train run, not a Hugging Face model directory: .*"
                                      r"CheckpointConfig.restore_from = '.*/run/checkpoints'") as e:
    export.gin_bindings(str(run))
  assert 'model_type' not in str(e.value)


def test_import_keeps_sequences_within_the_models_positions(tmp_path):
  """A Mistral window as long as max_position_embeddings or longer is full
  attention: imported as such, at the positions the model knows (the
  sequence length written was the window, 10**9)."""
  path, _ = _hf_model('mistral', tmp_path)
  conf_path = os.path.join(path, 'config.json')
  conf = json.load(open(conf_path))
  conf['sliding_window'] = 10**9
  json.dump(conf, open(conf_path, 'w'))
  lines = export.gin_bindings(path)
  assert 'DataConfig.seq_len = 64' in lines and 'ModelConfig.sliding_window = None' in lines, lines
