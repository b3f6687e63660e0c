"""Hugging Face interchange: mjax-export writes a `transformers` model
directory from a checkpoint; mjax-import and CheckpointConfig.init_from_hf
start training from one.

  mjax-export exported/tiny --workdir runs/tiny --drop_sliding_window
  mjax-import /models/pythia-160m pythia.gin && mjax-train --gin_file pythia.gin --workdir runs/ft

Export: OUT gets config.json, model.safetensors (fp32, the master weights),
the tokenizer files and generation_config.json; `AutoModelForCausalLM
.from_pretrained(OUT)` loads it with no custom code. The architecture is the
native one that computes exactly mjax's function:

  LayerNorm + GeLU (parallel or sequential block)  ->  GPT-NeoX, with
      use_parallel_residual for the parallel block (a shared norm goes to
      both of its norms), rotary_pct = ModelConfig.rotary_fraction
      (rotate-half, as mjax), 'gelu_new' (tanh) or 'gelu' (erf), the biases
      zero where mjax has none;
  sequential block, RMSNorm, SwiGLU ->  Llama (full attention), Mistral (one
      sliding window in every layer) or Ministral (window and full layers
      alternating, `full_attention_every`).

Window convention: mjax's window w lets a token see itself and the w - 1
before it; Hugging Face's `sliding_window` is the same number. What no
native architecture represents is refused with the option named; GPT-NeoX
has no sliding window, so --drop_sliding_window exports such a model with
full attention (the same logits for texts up to the window).

Import is the inverse mapping, from config.json and safetensors alone (no
torch or transformers needed): GPT-NeoX (Pythia: partial rotary, two norms
per block, exact GeLU, biases), Llama, Mistral, Ministral. Rope scaling and
other activations are refused by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mjax import jsonfile
from mjax.config import Config, ModelConfig
from mjax.errors import UserError
from mjax.jsonfile import current_umask, place_new

PROG = 'mjax-export'
FORMATS = ('hf',)


def architecture(m: ModelConfig, drop_window: bool = False) -> str:
  """The Hugging Face architecture that represents `m`.

  Raises:
    UserError: no native architecture computes this model's function.
  """
  windows = {m.layer_window(i) for i in range(m.layer_period)}
  if m.norm == 'layernorm' and m.mlp == 'gelu':
    # GPT-NeoX: parallel residual or not, LayerNorm, GeLU (tanh or erf), partial rotary.
    block = 'parallel' if m.block == 'parallel' else 'sequential'
    refuse = [(m.kv_heads != m.n_heads, f'ModelConfig.n_kv_heads = {m.n_kv_heads}',
               f'None (= n_heads {m.n_heads}: GPT-NeoX has no grouped-query attention)'),
              (m.dim_per_head * m.n_heads != m.d_model, f'ModelConfig.head_dim = {m.head_dim}',
               'None (= d_model / n_heads: GPT-NeoX derives it)'),
              (windows != {None} and not drop_window, f'ModelConfig.sliding_window = {m.sliding_window}',
               'None (GPT-NeoX has no sliding window); or pass --drop_sliding_window to export with '
               'full attention, which gives the same logits for texts up to the window')]
    for bad, what, allowed in refuse:
      if bad:
        raise UserError(f'{what} cannot be exported to Hugging Face: a {block} block with LayerNorm and '
                        f'GeLU maps to GPT-NeoX, which needs {allowed}.')
    return 'GPTNeoXForCausalLM'
  if m.block == 'parallel':
    raise UserError(f"ModelConfig.norm = {m.norm!r} with ModelConfig.mlp = {m.mlp!r} cannot be exported to "
                    f"Hugging Face: the parallel block maps to GPT-NeoX, which needs norm 'layernorm' and "
                    f"mlp 'gelu'.")
  for bad, what, allowed in [(m.norm != 'rmsnorm', f"ModelConfig.norm = {m.norm!r}", "'rmsnorm'"),
                             (m.mlp != 'swiglu', f"ModelConfig.mlp = {m.mlp!r}", "'swiglu'"),
                             (m.rotary_fraction != 1, f'ModelConfig.rotary_fraction = {m.rotary_fraction}',
                              '1.0 (rotary over the whole head)')]:
    if bad:
      raise UserError(f'{what} cannot be exported to Hugging Face: the sequential block with RMSNorm maps '
                      f'to Llama / Mistral, which need {allowed}.')
  if windows == {None} or drop_window:
    return 'LlamaForCausalLM'
  if m.use_bias:
    raise UserError('ModelConfig.use_bias = True with a sliding window cannot be exported to Hugging Face: '
                    'Mistral has no biases. Use --drop_sliding_window (Llama, with biases, full attention).')
  return 'MistralForCausalLM' if None not in windows else 'MinistralForCausalLM'


def layers(params: dict, m: ModelConfig) -> list[dict]:
  """Each layer's parameter dict (numpy), in order, from canonical params."""
  period, groups = m.layer_period, m.n_layers // m.layer_period
  out = []
  for g in range(groups):
    for i in range(period):
      if 'layers' in params:
        out.append(jax.tree.map(lambda a: np.asarray(a[g]), params['layers'][f'block_{i}']))
      else:
        out.append(params[f'layers_{g}'][f'block_{i}'])
  return out


def _t(kernel: np.ndarray, n_in: int = 1) -> np.ndarray:
  """mjax kernel (*in, *out) -> torch Linear weight (out, in), 2-D."""
  rows = int(np.prod(kernel.shape[:n_in]))
  return np.ascontiguousarray(kernel.reshape(rows, -1).T.astype(np.float32))


def _bias(p: dict, name: str, size: int) -> np.ndarray:
  b = p[name].get('bias') if name in p else None
  return np.zeros(size, np.float32) if b is None else np.asarray(b, np.float32).reshape(-1)


def hf_tensors(params: dict, m: ModelConfig, arch: str) -> dict[str, np.ndarray]:
  """Hugging Face state-dict names -> fp32 arrays."""
  emb = np.asarray(params['embedding'], np.float32)
  head = emb if m.tie_embeddings else np.asarray(params['lm_head'], np.float32).T
  t: dict[str, np.ndarray] = {}
  d = m.d_model
  if arch == 'GPTNeoXForCausalLM':
    t['gpt_neox.embed_in.weight'] = emb
    for n, p in enumerate(layers(params, m)):
      pre = f'gpt_neox.layers.{n}.'
      a, mlp = p['attn'], p['mlp']
      # A shared norm (the parallel block's one) goes to both of GPT-NeoX's.
      norms = (p['norm'], p['norm']) if 'norm' in p else (p['norm_attn'], p['norm_mlp'])
      for ln, norm in zip(('input_layernorm', 'post_attention_layernorm'), norms):
        t[pre + ln + '.weight'] = np.asarray(norm['scale'], np.float32)
        t[pre + ln + '.bias'] = np.asarray(norm.get('bias', np.zeros(d)), np.float32)
      # query_key_value rows are ordered head by head, [q | k | v] within a head.
      qkv = np.stack([np.asarray(a[k]['kernel']) for k in ('query', 'key', 'value')], axis=2)  # (E, H, 3, D)
      t[pre + 'attention.query_key_value.weight'] = _t(qkv)
      qkv_b = np.stack([_bias(a, k, m.n_heads * m.dim_per_head).reshape(m.n_heads, m.dim_per_head)
                        for k in ('query', 'key', 'value')], axis=1)                          # (H, 3, D)
      t[pre + 'attention.query_key_value.bias'] = qkv_b.reshape(-1)
      t[pre + 'attention.dense.weight'] = _t(np.asarray(a['out']['kernel']), 2)
      t[pre + 'attention.dense.bias'] = _bias(a, 'out', d)
      t[pre + 'mlp.dense_h_to_4h.weight'] = _t(np.asarray(mlp['wi']['kernel']))
      t[pre + 'mlp.dense_h_to_4h.bias'] = _bias(mlp, 'wi', m.d_ff)
      t[pre + 'mlp.dense_4h_to_h.weight'] = _t(np.asarray(mlp['wo']['kernel']))
      t[pre + 'mlp.dense_4h_to_h.bias'] = _bias(mlp, 'wo', d)
    t['gpt_neox.final_layer_norm.weight'] = np.asarray(params['final_norm']['scale'], np.float32)
    t['gpt_neox.final_layer_norm.bias'] = np.asarray(params['final_norm'].get('bias', np.zeros(d)), np.float32)
    t['embed_out.weight'] = np.ascontiguousarray(head)
    return t
  t['model.embed_tokens.weight'] = emb
  for n, p in enumerate(layers(params, m)):
    pre = f'model.layers.{n}.'
    a, mlp = p['attn'], p['mlp']
    t[pre + 'input_layernorm.weight'] = np.asarray(p['norm_attn']['scale'], np.float32)
    t[pre + 'post_attention_layernorm.weight'] = np.asarray(p['norm_mlp']['scale'], np.float32)
    for ours, theirs in (('query', 'q_proj'), ('key', 'k_proj'), ('value', 'v_proj')):
      t[pre + f'self_attn.{theirs}.weight'] = _t(np.asarray(a[ours]['kernel']))
      if m.use_bias:
        t[pre + f'self_attn.{theirs}.bias'] = _bias(a, ours, a[ours]['kernel'][0].size)
    t[pre + 'self_attn.o_proj.weight'] = _t(np.asarray(a['out']['kernel']), 2)
    for ours, theirs in (('wi_gate', 'gate_proj'), ('wi', 'up_proj'), ('wo', 'down_proj')):
      t[pre + f'mlp.{theirs}.weight'] = _t(np.asarray(mlp[ours]['kernel']))
    if m.use_bias:
      t[pre + 'self_attn.o_proj.bias'] = _bias(a, 'out', d)
      for ours, theirs, n_out in (('wi_gate', 'gate_proj', m.d_ff), ('wi', 'up_proj', m.d_ff),
                                  ('wo', 'down_proj', d)):
        t[pre + f'mlp.{theirs}.bias'] = _bias(mlp, ours, n_out)
  t['model.norm.weight'] = np.asarray(params['final_norm']['scale'], np.float32)
  t['lm_head.weight'] = np.ascontiguousarray(head)
  return t


def hf_config(m: ModelConfig, arch: str, max_positions: int, eos_id: int, drop_window: bool) -> dict:
  """config.json for `arch` (keys understood by transformers 4.46 and 5.x)."""
  common = dict(architectures=[arch], vocab_size=m.vocab_size, hidden_size=m.d_model,
                num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, intermediate_size=m.d_ff,
                max_position_embeddings=max_positions, tie_word_embeddings=m.tie_embeddings,
                bos_token_id=eos_id, eos_token_id=eos_id, torch_dtype='float32', initializer_range=m.init_std)
  if arch == 'GPTNeoXForCausalLM':
    return dict(common, model_type='gpt_neox', hidden_act='gelu_new' if m.gelu_approximate else 'gelu',
                use_parallel_residual=m.block == 'parallel', rotary_pct=m.rotary_fraction,
                rotary_emb_base=m.rope_theta, layer_norm_eps=m.norm_eps,
                attention_bias=True, hidden_dropout=0.0, attention_dropout=0.0,
                rope_parameters={'rope_type': 'default', 'rope_theta': m.rope_theta,
                                 'partial_rotary_factor': m.rotary_fraction})
  cfg = dict(common, hidden_act='silu', num_key_value_heads=m.kv_heads, head_dim=m.dim_per_head,
             rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, attention_dropout=0.0,
             rope_parameters={'rope_type': 'default', 'rope_theta': m.rope_theta})
  if arch == 'LlamaForCausalLM':
    return dict(cfg, model_type='llama', attention_bias=m.use_bias, mlp_bias=m.use_bias)
  cfg.update(sliding_window=m.sliding_window)
  if arch == 'MistralForCausalLM':
    return dict(cfg, model_type='mistral')
  return dict(cfg, model_type='ministral', layer_types=[
      'full_attention' if m.layer_window(n % m.layer_period) is None else 'sliding_attention'
      for n in range(m.n_layers)])


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table (what ByteLevel pre-tokenizers use)."""
  bs = list(range(ord('!'), ord('~') + 1)) + list(range(ord('¡'), ord('¬') + 1)) + list(range(ord('®'), ord('ÿ') + 1))
  cs, n = bs[:], 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


def write_tokenizer(out: str, spec: str, eos_id: int, eos_first: bool = False) -> None:
  """tokenizer.json + tokenizer_config.json for mjax's tokenizer.

  'bytes' becomes a byte-level BPE with no merges, so every UTF-8 byte is
  its own id (0..255) as in mjax, with EOS 256 and PAD 257 as special
  tokens; a tokenizer.json made by mjax-tokenizer is copied, its model as
  it is. With `eos_first` the tokenizer puts EOS before a text, as
  mjax-generate does where the model was trained without document
  attention (a document follows an EOS there): `model.generate` on
  `tokenizer(prompt)` then continues a prompt as mjax-generate does.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors  # noqa: PLC0415
  from mjax.data.tokenizer import BYTES, EOS_ID, PAD_ID  # noqa: PLC0415
  if spec == BYTES:
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken  # noqa: PLC0415
    tok.add_special_tokens([AddedToken('<|endoftext|>', special=True), AddedToken('<|pad|>', special=True)])
    assert tok.token_to_id('<|endoftext|>') == EOS_ID and tok.token_to_id('<|pad|>') == PAD_ID
    eos, pad = '<|endoftext|>', '<|pad|>'
  else:
    tok = Tokenizer.from_file(os.path.expanduser(spec))
    eos, pad = tok.id_to_token(eos_id), None
  if eos_first:
    first = processors.TemplateProcessing(single=f'{eos} $A', pair=f'{eos} $A {eos} $B:1',
                                          special_tokens=[(eos, eos_id)])
    # After the tokenizer's own post-processing (a ByteLevel offset trim), if any.
    tok.post_processor = first if tok.post_processor is None else processors.Sequence([tok.post_processor, first])
  if spec == BYTES or eos_first:
    tok.save(os.path.join(out, 'tokenizer.json'))
  else:
    shutil.copyfile(os.path.expanduser(spec), os.path.join(out, 'tokenizer.json'))
  # split_special_tokens: the text '<|endoftext|>' (Python's sources hold
  # it) is its bytes, as mjax encodes it (Tokenizer.encode_special_tokens),
  # not an EOS mid-text; the EOS the post-processor puts first stays an id.
  conf = {'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': eos, 'bos_token': eos,
          'model_max_length': 1_000_000, 'clean_up_tokenization_spaces': False, 'split_special_tokens': True}
  if pad:
    conf['pad_token'] = pad
  with open(os.path.join(out, 'tokenizer_config.json'), 'w') as fh:
    json.dump(conf, fh, indent=2)
  with open(os.path.join(out, 'special_tokens_map.json'), 'w') as fh:
    json.dump({k: v for k, v in (('eos_token', eos), ('bos_token', eos), ('pad_token', pad)) if v}, fh, indent=2)


def export_hf(params: dict, cfg: Config, out: str, drop_window: bool = False) -> dict:
  """Writes the Hugging Face directory `out` (created; must not hold files).

  The files are written into a temporary directory beside `out` and moved
  into place at the end, so an interrupted export leaves no half model.
  Returns the config.json written.
  """
  from safetensors import SafetensorError  # noqa: PLC0415
  from safetensors.numpy import save_file  # noqa: PLC0415
  from mjax.data import load_tokenizer  # noqa: PLC0415
  from mjax.data.sources import run_tokenizer  # noqa: PLC0415
  from mjax.data.tokenizer import never_sampled  # noqa: PLC0415
  m = cfg.model
  arch = architecture(m, drop_window)
  out = check_out(out)
  spec = run_tokenizer(cfg.data)   # a run on BPE shards alone: theirs
  info = load_tokenizer(spec).info
  if info.vocab_size > m.vocab_size:
    raise UserError(f'the tokenizer has {info.vocab_size} ids but ModelConfig.vocab_size is {m.vocab_size}.')
  parent = os.path.dirname(out)
  try:
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix='.mjax-export-', dir=parent)
  except OSError as e:
    raise UserError(f'{out!r}: cannot write in {parent!r} ({e.strerror or e}).') from None
  umask = current_umask()
  try:
    conf = hf_config(m, arch, cfg.data.seq_len, info.eos_id, drop_window)
    with open(os.path.join(tmp, 'config.json'), 'w') as fh:
      json.dump(conf, fh, indent=2)
    with open(os.path.join(tmp, 'generation_config.json'), 'w') as fh:
      # The ids no text encodes to (the embedding's padding past the
      # tokenizer, the byte tokenizer's PAD): never sampled, as in
      # mjax-generate, so that sampled text matches it.
      json.dump({'bos_token_id': info.eos_id, 'eos_token_id': info.eos_id,
                 'suppress_tokens': never_sampled(info, m.vocab_size)}, fh, indent=2)
    save_file(hf_tensors(params, m, arch), os.path.join(tmp, 'model.safetensors'), metadata={'format': 'pt'})
    write_tokenizer(tmp, spec, info.eos_id, eos_first=not cfg.data.document_attention)
    # mkdtemp and the writers make some of it private; the model is for others to read too.
    for name in os.listdir(tmp):
      os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
    os.chmod(tmp, 0o777 & ~umask)
    if os.path.isdir(out):
      os.rmdir(out)
    os.rename(tmp, out)
  except (OSError, SafetensorError) as e:   # safetensors wraps the OSError: "I/O error: No space left..."
    shutil.rmtree(tmp, ignore_errors=True)
    said = getattr(e, 'strerror', None) or str(e).replace('Error while serializing: ', '')
    raise UserError(f'{out!r}: the export could not be written ({said}); nothing is left of it, '
                    'and nothing there was changed.') from None
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return conf


def check_out(out: str) -> str:
  """The absolute export directory, refused where it exists and holds files,
  is a file, or is a link (what it points at would be replaced)."""
  out = os.path.abspath(os.path.expanduser(out))
  if os.path.islink(out):
    raise UserError(f'{out!r} is a symbolic link; give the path of a new directory (nothing is overwritten).')
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    what = 'a directory that holds files' if os.path.isdir(out) else 'a file'
    raise UserError(f'{out!r} is {what}: the export writes a new directory; give a new path (nothing is '
                    f'overwritten).')
  if os.path.ismount(out):
    raise UserError(f'{out!r} is a mount point; give a new directory inside it.')
  from mjax.checkpoint.directories import refuse_among_checkpoints  # noqa: PLC0415
  # A run's checkpoint directory holds its steps only: a numbered export
  # there reads as a damaged step (the run then refuses to resume), and an
  # export inside a step goes when Orbax deletes that step.
  refuse_among_checkpoints(out)
  return out


# --- the command -------------------------------------------------------------------

def export_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=PROG, description='A checkpoint as a Hugging Face transformers model directory.')
  p.add_argument('out', help='the directory to create (must not exist, or be empty)')
  p.add_argument('--format', choices=FORMATS, default='hf')
  from mjax import evaluate  # noqa: PLC0415
  evaluate.add_checkpoint_args(p, 'export')
  p.add_argument('--drop_sliding_window', action='store_true',
                 help='export a windowed model with full attention (the same logits for texts up to the window)')
  return p


def parse_export_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
  from mjax import evaluate  # noqa: PLC0415
  return evaluate.parse_checkpoint_args(export_parser(), argv)


def export_main(args: argparse.Namespace, bindings: Sequence[str]) -> dict:
  """Exports what `args` name; returns {'out', 'architecture', 'step', 'checkpoint'}."""
  from mjax import evaluate, flags  # noqa: PLC0415
  from mjax.parallel import make_mesh  # noqa: PLC0415
  from mjax.train import make_program  # noqa: PLC0415
  files, saved = evaluate.config_sources(args)
  # One process and one device, whatever mesh the run trained on: the params
  # end up in one host's memory anyway, and checkpoints reshard onto any mesh.
  one_device = [f'MeshConfig.{a} = 1' for a in ('data', 'fsdp', 'tensor', 'pipeline', 'virtual_stages',
                                                 'dcn_data', 'dcn_fsdp', 'dcn_tensor', 'dcn_pipeline')]
  cfg = flags.load(files, [*saved, *bindings, *one_device], num_devices=1)
  choice = evaluate.choose(args, cfg)   # a run with nothing saved: said first, whatever else is amiss
  architecture(cfg.model, args.drop_sliding_window)     # refuse before reading anything
  check_out(args.out)
  program = make_program(cfg, make_mesh(cfg.mesh, devices=jax.devices()[:1]))
  picked, params, verified, _ = evaluate.restore(program, choice, PROG)
  changed = evaluate.tokenizer_change(picked.path, cfg)
  if changed:
    # The exported directory would ship that tokenizer beside the weights,
    # and every user of the model would decode its ids with it.
    raise UserError(f'{changed}. The export would ship that tokenizer with the model: give the one it was '
                    f'trained with (--gin.DataConfig.tokenizer=<that file>, or put it back in place).')
  conf = export_hf(jax.device_get(program.canonical_params(params)), cfg, args.out, args.drop_sliding_window)
  evaluate.say(f'{PROG}: step {picked.step} ({picked.path}, '
               f'{"checksums verified" if verified else "saved without checksums"}) -> {args.out} '
               f'as {conf["architectures"][0]}')
  return {'out': os.path.abspath(args.out), 'architecture': conf['architectures'][0],
          'step': picked.step, 'checkpoint': picked.path}


# --- import --------------------------------------------------------------------------

IMPORTABLE = ('gpt_neox', 'llama', 'mistral', 'ministral')


def read_config(path: str) -> dict:
  """A Hugging Face model directory's config.json."""
  file = os.path.join(os.path.abspath(os.path.expanduser(path)), 'config.json')
  try:
    with open(file) as fh:
      conf = jsonfile.load(fh)
  except (OSError, ValueError) as e:
    raise UserError(f'{path!r} is not a Hugging Face model directory: {file} cannot be read '
                    f'({type(e).__name__}: {e}).') from None
  if not isinstance(conf, dict):
    raise UserError(f'{file} holds a JSON {type(conf).__name__}, not the object of a Hugging Face config.')
  if conf.get('model_type') not in IMPORTABLE:
    from mjax.checkpoint.directories import is_workdir  # noqa: PLC0415
    # An mjax-train run has a config.json too (mjax's own, no model_type):
    # 'model_type None' would not say what the directory is.
    if is_workdir(path):
      saved = conf['checkpoint'].get('directory') if isinstance(conf['checkpoint'], dict) else None
      where = saved or os.path.join(os.path.abspath(os.path.expanduser(path)), 'checkpoints')
      raise UserError(f'{path!r} is an mjax-train run, not a Hugging Face model directory: train from its '
                      f'checkpoints with CheckpointConfig.restore_from = {where!r}, or mjax-export it first '
                      f'to get a Hugging Face model.')
    raise UserError(f'{path!r}: model_type {conf.get("model_type")!r} cannot be imported; mjax imports '
                    f'{", ".join(IMPORTABLE)}.')
  bad = {k: conf.get(k) for k in _SIZES if not (isinstance(conf.get(k), int) and not isinstance(conf.get(k), bool)
                                                 and 0 < conf[k] < 2**31)}
  if bad:
    raise UserError(f'{file}: {", ".join(f"{k} = {v!r}" for k, v in bad.items())}: each of '
                    f'{", ".join(_SIZES)} must be a positive integer.')
  return conf


# The sizes every importable config.json states.
_SIZES = ('vocab_size', 'hidden_size', 'num_hidden_layers', 'num_attention_heads', 'intermediate_size')


def check_shapes(tensors: dict[str, np.ndarray], m: ModelConfig, neox: bool) -> None:
  """Every weight tensor has the shape the config says (Hugging Face's (out, in) layout).

  Raises:
    UserError: naming the first tensor that is missing or of another shape,
      or the tensors the config does not describe.
  """
  d, f, hd, v = m.d_model, m.d_ff, m.dim_per_head, m.vocab_size
  q, kv = m.n_heads * hd, m.kv_heads * hd
  if neox:
    want = {'gpt_neox.embed_in.weight': (v, d), 'gpt_neox.final_layer_norm.weight': (d,)}
    per = {'attention.query_key_value.weight': (3 * q, d), 'attention.dense.weight': (d, q),
           'mlp.dense_h_to_4h.weight': (f, d), 'mlp.dense_4h_to_h.weight': (d, f),
           'input_layernorm.weight': (d,), 'post_attention_layernorm.weight': (d,)}
    want.update({f'gpt_neox.layers.{i}.{k}': s for i in range(m.n_layers) for k, s in per.items()})
    head = 'embed_out.weight' if 'embed_out.weight' in tensors else 'lm_head.weight'
  else:
    want = {'model.embed_tokens.weight': (v, d), 'model.norm.weight': (d,)}
    per = {'self_attn.q_proj.weight': (q, d), 'self_attn.k_proj.weight': (kv, d), 'self_attn.v_proj.weight': (kv, d),
           'self_attn.o_proj.weight': (d, q), 'mlp.gate_proj.weight': (f, d), 'mlp.up_proj.weight': (f, d),
           'mlp.down_proj.weight': (d, f), 'input_layernorm.weight': (d,), 'post_attention_layernorm.weight': (d,)}
    want.update({f'model.layers.{i}.{k}': s for i in range(m.n_layers) for k, s in per.items()})
    head = 'lm_head.weight'
  if not m.tie_embeddings and head in tensors:
    want[head] = (v, d)
  for name, shape in want.items():
    if tuple(_tensor(tensors, name).shape) != shape:
      raise UserError(f'tensor {name!r} has shape {tuple(tensors[name].shape)}, but config.json (hidden_size '
                      f'{d}, intermediate_size {f}, {m.n_heads} heads of {hd}, vocab_size {v}) makes it {shape}: '
                      'the weights do not match their config.json.')
  # Tensors no part of the config reads: more layers than num_hidden_layers
  # says (the import would drop them without a word), or another model's.
  known = {*want, *(k[:-len('weight')] + 'bias' for k in want if k.endswith('.weight')),
           'embed_out.weight', 'lm_head.weight'}
  extra = sorted(k for k in tensors if k not in known)
  if extra:
    layers = sorted({int(x) for k in extra for x in re.findall(r'\.layers\.(\d+)\.', k)})
    beyond = (f' (layers {layers[0]}-{layers[-1]}, where config.json has num_hidden_layers = {m.n_layers})'
              if layers and layers[0] >= m.n_layers else '')
    raise UserError(f'the weights hold {len(extra)} tensor(s) their config.json does not describe{beyond}, e.g. '
                    f'{", ".join(repr(k) for k in extra[:3])}: importing would drop them. The weights do not '
                    'match their config.json.')


def _tensor(tensors: dict[str, np.ndarray], name: str) -> np.ndarray:
  """tensors[name], or the UserError that says the weights do not match their config."""
  if name not in tensors:
    raise UserError(f'the Hugging Face model has no tensor {name!r}: its weights do not match its config.json.')
  return tensors[name]


_BUFFER = re.compile(r'\.attention\.(bias|masked_bias)$|rotary_emb\.inv_freq$')


def read_tensors(path: str) -> dict[str, np.ndarray]:
  """Every tensor of model.safetensors (or of its shards, model.safetensors.index.json), as numpy."""
  # The flax loader reads bfloat16 (most released checkpoints); numpy has no such dtype.
  from safetensors.flax import load_file  # noqa: PLC0415
  path = os.path.abspath(os.path.expanduser(path))
  index = os.path.join(path, 'model.safetensors.index.json')
  if os.path.isfile(index):
    try:
      with open(index) as fh:
        files = sorted(set(jsonfile.load(fh)['weight_map'].values()))
      if not all(isinstance(f, str) and f and os.path.basename(f) == f for f in files):
        raise ValueError('its weight_map names files outside the model directory, or no file')
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
      raise UserError(f'{index} is not an index of safetensors shards ({type(e).__name__}: {e}); it maps '
                      '"weight_map": {tensor name: shard file name}.') from None
  elif os.path.isfile(os.path.join(path, 'model.safetensors')):
    files = ['model.safetensors']
  else:
    raise UserError(f'{path!r} holds no model.safetensors (nor an index of shards); mjax reads safetensors '
                    f'only: save the model with save_pretrained(..., safe_serialization=True).')
  tensors = {}
  for f in files:
    try:
      loaded = load_file(os.path.join(path, f))
    except Exception as e:  # safetensors raises its own error types
      raise UserError(f'{os.path.join(path, f)} cannot be read ({type(e).__name__}: {e}).') from None
    # Buffers older GPT-NeoX checkpoints (Pythia) carry beside the weights:
    # the causal mask (bool), its fill value and the rotary frequencies.
    loaded = {k: v for k, v in loaded.items() if not _BUFFER.search(k)}
    ints = sorted(k for k, v in loaded.items() if not jnp.issubdtype(v.dtype, jnp.floating))
    if ints:
      raise UserError(f'{os.path.join(path, f)}: tensor {ints[0]!r} is of type {loaded[ints[0]].dtype}, not '
                      'floating point: mjax imports float32, float16 and bfloat16 weights (a quantized model '
                      'must be dequantized first).')
    tensors.update({k: np.asarray(jax.device_get(v.astype(np.float32))) for k, v in loaded.items()})
  return tensors


def _rope(conf: dict) -> tuple[float, float]:
  """(theta, rotary fraction) from a config of transformers 4.x or 5.x."""
  # Both read: a config with both has transformers apply the legacy
  # `rope_scaling` (it becomes `rope_parameters`), so a scaling in either
  # one is what the model computes.
  for key in ('rope_scaling', 'rope_parameters'):
    kind = (conf.get(key) or {}).get('rope_type', (conf.get(key) or {}).get('type', 'default'))
    if kind != 'default':
      raise UserError(f'{key}: rope_type {kind!r} (rope scaling) cannot be imported: mjax computes plain '
                      f'rotary embeddings.')
  rope = conf.get('rope_parameters') or conf.get('rope_scaling') or {}
  theta = rope.get('rope_theta', conf.get('rope_theta', conf.get('rotary_emb_base', 10000.0)))
  fraction = rope.get('partial_rotary_factor', conf.get('rotary_pct', 1.0))
  return float(theta), float(fraction)


def _layer_windows(conf: dict, n_layers: int) -> tuple[Optional[int], int]:
  """(ModelConfig.sliding_window, full_attention_every) of a Llama-family config."""
  window = conf.get('sliding_window') if conf['model_type'] in ('mistral', 'ministral') else None
  positions = conf.get('max_position_embeddings')
  if window is None or (isinstance(positions, int) and isinstance(window, int) and window >= positions):
    return None, 0    # (a window as long as every position the model knows: full attention)
  types = conf.get('layer_types') or ['sliding_attention'] * n_layers
  full = [t == 'full_attention' for t in types]
  if not any(full):
    return int(window), 0
  if all(full):
    return None, 0
  k = full.index(True) + 1     # every k-th layer full, the others windowed
  if n_layers % k or full != [(i % k) == k - 1 for i in range(n_layers)]:
    raise UserError(f'layer_types {types} cannot be imported: mjax makes every k-th layer full '
                    f'(ModelConfig.full_attention_every) and the others windowed.')
  return int(window), k


def model_overrides(conf: dict, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
  """The ModelConfig fields that describe the Hugging Face model."""
  kind = conf['model_type']
  theta, fraction = _rope(conf)
  n, d = conf['num_hidden_layers'], conf['hidden_size']
  tie = conf.get('tie_word_embeddings', False)
  if not isinstance(tie, bool):   # bool('false') is True
    raise UserError(f'tie_word_embeddings {tie!r} in config.json is not true or false.')
  common = dict(vocab_size=conf['vocab_size'], d_model=d, n_layers=n, n_heads=conf['num_attention_heads'],
                d_ff=conf['intermediate_size'], rope_theta=theta, rotary_fraction=fraction, tie_embeddings=tie)
  biases = [v for k, v in tensors.items() if k.endswith('.bias') and 'layernorm' not in k and 'layer_norm' not in k]
  if kind == 'gpt_neox':
    act = conf.get('hidden_act', 'gelu')
    if act not in ('gelu', 'gelu_new', 'gelu_pytorch_tanh', 'gelu_fast'):
      raise UserError(f'hidden_act {act!r} cannot be imported: mjax has GeLU (exact or tanh).')
    parallel = bool(conf.get('use_parallel_residual', True))
    shared = parallel and all(
        np.array_equal(_tensor(tensors, f'gpt_neox.layers.{i}.input_layernorm.{w}'),
                       _tensor(tensors, f'gpt_neox.layers.{i}.post_attention_layernorm.{w}'))
        for i in range(n) for w in ('weight', 'bias'))
    return dict(common, block='parallel' if parallel else 'sequential', mlp='gelu', norm='layernorm',
                norm_eps=conf.get('layer_norm_eps', 1e-5), gelu_approximate=act != 'gelu',
                parallel_norms='shared' if shared else 'separate', n_kv_heads=None, head_dim=None,
                use_bias=any(np.any(b) for b in biases), sliding_window=None, full_attention_every=0)
  if conf.get('hidden_act', 'silu') != 'silu':
    raise UserError(f'hidden_act {conf["hidden_act"]!r} cannot be imported: mjax\'s SwiGLU uses silu.')
  window, every = _layer_windows(conf, n)
  return dict(common, block='sequential', mlp='swiglu', norm='rmsnorm', norm_eps=conf.get('rms_norm_eps', 1e-6),
              n_kv_heads=conf.get('num_key_value_heads') or conf['num_attention_heads'],
              head_dim=conf.get('head_dim') or d // conf['num_attention_heads'],
              use_bias=any(np.any(b) for b in biases), sliding_window=window, full_attention_every=every)


def _linear_in(w: np.ndarray, *out_shape: int) -> np.ndarray:
  """torch Linear weight (out, in) -> mjax kernel (in, *out_shape); (in, out) by default."""
  return np.ascontiguousarray(w.T.reshape(w.shape[1], *(out_shape or (w.shape[0],))))


def mjax_params(tensors: dict[str, np.ndarray], m: ModelConfig) -> dict:
  """Hugging Face tensors -> mjax's canonical params (numpy, fp32), the inverse of `hf_tensors`."""
  hd, h, kv = m.dim_per_head, m.n_heads, m.kv_heads
  neox = any(k.startswith('gpt_neox.') for k in tensors)

  def get(name):
    return _tensor(tensors, name)

  def bias(name, shape):
    # A model with some biases (Llama's attention_bias without mlp_bias) loads
    # into mjax's all-or-none biases with zeros where it has none.
    b = tensors.get(name + '.bias')
    return np.zeros(shape, np.float32) if b is None else b.reshape(shape)

  def kernel(name, *out):
    return {'kernel': _linear_in(get(name + '.weight'), *out), **({'bias': bias(name, out)} if m.use_bias else {})}

  def norm(name):
    out = {'scale': get(name + '.weight')}
    if m.norm == 'layernorm':
      out['bias'] = get(name + '.bias')
    return out

  blocks = []
  for i in range(m.n_layers):
    if neox:
      pre = f'gpt_neox.layers.{i}.'
      w = get(pre + 'attention.query_key_value.weight').reshape(h, 3, hd, m.d_model)   # (H, [q k v], D, E)
      attn = {name: {'kernel': np.ascontiguousarray(w[:, j].transpose(2, 0, 1))}
              for j, name in enumerate(('query', 'key', 'value'))}
      attn['out'] = {'kernel': _linear_in(get(pre + 'attention.dense.weight')).reshape(h, hd, m.d_model)}
      mlp = {'wi': {'kernel': _linear_in(get(pre + 'mlp.dense_h_to_4h.weight'))},
             'wo': {'kernel': _linear_in(get(pre + 'mlp.dense_4h_to_h.weight'))}}
      if m.use_bias:
        b = bias(pre + 'attention.query_key_value', (h, 3, hd))
        for j, name in enumerate(('query', 'key', 'value')):
          attn[name]['bias'] = np.ascontiguousarray(b[:, j])
        attn['out']['bias'] = bias(pre + 'attention.dense', (m.d_model,))
        mlp['wi']['bias'] = bias(pre + 'mlp.dense_h_to_4h', (m.d_ff,))
        mlp['wo']['bias'] = bias(pre + 'mlp.dense_4h_to_h', (m.d_model,))
      block = {'attn': attn, 'mlp': mlp}
      if m.block == 'parallel' and m.parallel_norms == 'shared':
        block['norm'] = norm(pre + 'input_layernorm')
      else:
        block['norm_attn'], block['norm_mlp'] = norm(pre + 'input_layernorm'), norm(pre + 'post_attention_layernorm')
    else:
      pre = f'model.layers.{i}.'
      attn = {'query': kernel(pre + 'self_attn.q_proj', h, hd), 'key': kernel(pre + 'self_attn.k_proj', kv, hd),
              'value': kernel(pre + 'self_attn.v_proj', kv, hd)}
      attn['out'] = {'kernel': _linear_in(get(pre + 'self_attn.o_proj.weight')).reshape(h, hd, m.d_model),
                     **({'bias': bias(pre + 'self_attn.o_proj', (m.d_model,))} if m.use_bias else {})}
      mlp = {'wi_gate': kernel(pre + 'mlp.gate_proj', m.d_ff), 'wi': kernel(pre + 'mlp.up_proj', m.d_ff),
             'wo': kernel(pre + 'mlp.down_proj', m.d_model)}
      block = {'attn': attn, 'mlp': mlp, 'norm_attn': norm(pre + 'input_layernorm'),
               'norm_mlp': norm(pre + 'post_attention_layernorm')}
    blocks.append(block)
  if neox:
    params = {'embedding': get('gpt_neox.embed_in.weight'), 'final_norm': norm('gpt_neox.final_layer_norm')}
    head = tensors.get('embed_out.weight', tensors.get('lm_head.weight'))
  else:
    params = {'embedding': get('model.embed_tokens.weight'), 'final_norm': norm('model.norm')}
    head = tensors.get('lm_head.weight')
  if not m.tie_embeddings:
    if head is None:
      raise UserError('the Hugging Face model has no output embedding (lm_head) and does not tie it to the '
                      'input embedding.')
    params['lm_head'] = np.ascontiguousarray(head.T)
  period = m.layer_period
  groups = [{f'block_{i}': blocks[g * period + i] for i in range(period)} for g in range(m.n_layers // period)]
  if m.scan_layers:
    params['layers'] = jax.tree.map(lambda *a: np.stack(a), *groups)
  else:
    params.update({f'layers_{g}': group for g, group in enumerate(groups)})
  return params


def import_params(path: str, m: ModelConfig) -> dict:
  """The params of the Hugging Face model at `path` for ModelConfig `m`.

  Raises:
    UserError: the directory cannot be read, or `m` describes another model
      (the field that differs is named).
  """
  try:
    conf = read_config(path)
    tensors = read_tensors(path)
  except UserError as e:
    raise UserError(f'CheckpointConfig.init_from_hf = {path!r}, the weights a new run starts from: {e} Give a '
                    'Hugging Face model directory (config.json and model.safetensors), or unset it.') from None
  want = model_overrides(conf, tensors)
  for key, value in want.items():
    have = getattr(m, key)
    if (key, value) in (('use_bias', False), ('parallel_norms', 'shared')):
      continue   # all-zero biases, or two equal norms, load into either setting
    if key == 'n_kv_heads':
      have, value = m.kv_heads, value or m.n_heads
    if key == 'head_dim':
      have, value = m.dim_per_head, value or m.d_model // m.n_heads
    if have != value and not (isinstance(value, float) and np.isclose(have, value)):
      raise UserError(f'CheckpointConfig.init_from_hf = {path!r}: the model has ModelConfig.{key} = {value!r}, '
                      f'the config says {have!r}. `mjax-import {path} OUT.gin` writes the config that matches.')
  return mjax_params(tensors, m)


def gin_bindings(path: str) -> list[str]:
  """The gin bindings that train from the Hugging Face model at `path`."""
  path = os.path.abspath(os.path.expanduser(path))
  conf = read_config(path)
  tensors = read_tensors(path)
  model = model_overrides(conf, tensors)
  lines = [f'ModelConfig.{k} = {v!r}' for k, v in model.items()]
  positions = conf.get('max_position_embeddings', 2048)
  if not isinstance(positions, int) or isinstance(positions, bool) or positions < 1:
    raise UserError(f'max_position_embeddings {positions!r} in config.json is not a positive integer (the '
                    f'longest sequence the model was trained on).')
  seq = min(positions, 2048)
  if model.get('sliding_window'):
    seq = max(seq, model['sliding_window'])
  lines.append(f'DataConfig.seq_len = {seq}')
  # What training would refuse or crash on, said now: a config mjax cannot
  # lay out, weights of other shapes than config.json says.
  from mjax import config as config_lib
  try:
    cfg = config_lib.validate(Config(model=dataclasses.replace(ModelConfig(), **model),
                                      data=config_lib.DataConfig(seq_len=seq)))
  except (config_lib.ConfigError, TypeError, ValueError) as e:
    raise UserError(f'{path!r}: its config.json describes a model mjax cannot build: {e}') from None
  check_shapes(tensors, cfg.model, neox=conf['model_type'] == 'gpt_neox')
  tok = os.path.join(path, 'tokenizer.json')
  if os.path.isfile(tok):
    lines.append(f'DataConfig.tokenizer = {tok!r}')
  lines.append(f'CheckpointConfig.init_from_hf = {path!r}')
  return lines


def import_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog='mjax-import', description='Write the gin config that trains (fine-tunes) from a Hugging Face '
                                      'GPT-NeoX, Llama, Mistral or Ministral model directory.')
  p.add_argument('model', help='a Hugging Face model directory (config.json + model.safetensors)')
  p.add_argument('out', help='the gin file to write (must not exist)')
  return p


def import_main(argv: Sequence[str]) -> str:
  """mjax-import MODEL OUT.gin; returns the path written."""
  args = import_parser().parse_args(list(argv))
  out = os.path.abspath(os.path.expanduser(args.out))
  if os.path.lexists(out):
    raise UserError(f'{out!r} exists; give a new path (nothing is overwritten).')
  parent = os.path.dirname(out)
  if not os.path.isdir(parent):
    raise UserError(f'{out!r}: its directory {parent!r} ' +
                    ('is a file, not a directory' if os.path.exists(parent) else 'does not exist; create it first')
                    + '.')
  from mjax.checkpoint.directories import refuse_among_checkpoints  # noqa: PLC0415
  refuse_among_checkpoints(out)   # as for an export: a run's checkpoint directory holds its steps only
  lines = gin_bindings(args.model)
  # Without the model's own tokenizer the run would read text as mjax's
  # byte ids, which mean nothing to the imported embedding: said loudly.
  untokenized = not any(line.startswith('DataConfig.tokenizer') for line in lines)
  warning = (f'{os.path.abspath(args.model)!r} has no tokenizer.json, so {args.out} leaves '
             f"DataConfig.tokenizer at mjax's byte tokenizer: its ids mean nothing to this model's "
             f"embedding. Set DataConfig.tokenizer to the model's tokenizer.json before training.")
  text = ('# Written by mjax-import from ' + os.path.abspath(args.model) + '\n'
          f"# mjax-train --gin_file {args.out} --workdir runs/finetune\n" +
          (f'# WARNING: {warning}\n' if untokenized else '') +
          "include 'base.gin'\n" + '\n'.join(lines) + '\n')
  # A fresh temporary file beside OUT (never a fixed name someone may have
  # put a link at), then linked in: a path that appeared meanwhile is kept.
  try:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(out), prefix='.mjax-import-', suffix='.gin')
  except OSError as e:
    raise UserError(f'{out!r}: cannot write in {os.path.dirname(out)!r} ({e.strerror or e}).') from None
  try:
    with os.fdopen(fd, 'w') as fh:
      fh.write(text)
    place_new(tmp, out)
  except FileExistsError:
    raise UserError(f'{out!r} appeared meanwhile; nothing written over it.') from None
  except OSError as e:
    raise UserError(f'{out!r}: cannot write it ({e.strerror or e}).') from None
  finally:
    if os.path.lexists(tmp):
      os.unlink(tmp)
  print(f'mjax-import: {out}: {len(lines)} bindings; the weights load at the start of a fresh run', file=sys.stderr)
  if untokenized:
    print(f'mjax-import: warning: {warning}', file=sys.stderr)
  return out
