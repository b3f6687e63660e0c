"""mjax-export: a saved checkpoint as a Hugging Face `transformers` model directory.

  mjax-export --workdir runs/tiny --format hf exported/tiny
  mjax-export --checkpoint /ckpt/run7/checkpoints/1200 --format hf out/ --drop_sliding_window

OUT gets config.json, model.safetensors (fp32, the master weights), the
tokenizer files and generation_config.json; `AutoModelForCausalLM
.from_pretrained(OUT)` loads it with no custom code. The architecture is the
native one that computes exactly mjax's function:

  parallel block, LayerNorm, GeLU  ->  GPT-NeoX with use_parallel_residual:
      both of its norms carry mjax's one norm, rotary over the whole head
      (rotary_pct 1, rotate-half as mjax), tanh GeLU ('gelu_new'), the
      attention and MLP biases zero where mjax has none.
  sequential block, RMSNorm, SwiGLU ->  Llama (full attention), Mistral (one
      sliding window in every layer) or Ministral (window and full layers
      alternating, `full_attention_every`).

Window convention: mjax's window w lets a token see itself and the w - 1
before it; Hugging Face's `sliding_window` is the same number.

What no native architecture represents is refused with the option named:
a parallel block with RMSNorm, SwiGLU or grouped-query attention; a sequential
block with LayerNorm or GeLU; sliding windows in the parallel block (GPT-NeoX
has none). --drop_sliding_window exports such a model with full attention,
which computes the same logits for texts no longer than the window.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Any, Optional, Sequence

import jax
import numpy as np

from mjax.config import Config, ModelConfig
from mjax.errors import UserError

PROG = 'mjax-export'
FORMATS = ('hf',)


def architecture(m: ModelConfig, drop_window: bool = False) -> str:
  """The Hugging Face architecture that represents `m`.

  Raises:
    UserError: no native architecture computes this model's function.
  """
  windows = {m.layer_window(i) for i in range(m.layer_period)}
  if m.block == 'parallel':
    refuse = [(m.norm != 'layernorm', f"ModelConfig.norm = {m.norm!r}", "'layernorm'"),
              (m.mlp != 'gelu', f"ModelConfig.mlp = {m.mlp!r}", "'gelu'"),
              (m.kv_heads != m.n_heads, f'ModelConfig.n_kv_heads = {m.n_kv_heads}',
               f'None (= n_heads {m.n_heads}: GPT-NeoX has no grouped-query attention)'),
              (m.dim_per_head * m.n_heads != m.d_model, f'ModelConfig.head_dim = {m.head_dim}',
               f'None (= d_model / n_heads: GPT-NeoX derives it)'),
              (windows != {None} and not drop_window, f'ModelConfig.sliding_window = {m.sliding_window}',
               'None (GPT-NeoX has no sliding window); or pass --drop_sliding_window to export with '
               'full attention, which gives the same logits for texts up to the window')]
    for bad, what, allowed in refuse:
      if bad:
        raise UserError(f'{what} cannot be exported to Hugging Face: the parallel block maps to GPT-NeoX '
                        f'(use_parallel_residual), which needs {allowed}.')
    return 'GPTNeoXForCausalLM'
  for bad, what, allowed in [(m.norm != 'rmsnorm', f"ModelConfig.norm = {m.norm!r}", "'rmsnorm'"),
                             (m.mlp != 'swiglu', f"ModelConfig.mlp = {m.mlp!r}", "'swiglu'")]:
    if bad:
      raise UserError(f'{what} cannot be exported to Hugging Face: the sequential block maps to Llama / '
                      f'Mistral, which need {allowed}.')
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
      a, mlp, norm = p['attn'], p['mlp'], p['norm']
      for ln in ('input_layernorm', 'post_attention_layernorm'):   # one norm, both places
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
    return dict(common, model_type='gpt_neox', hidden_act='gelu_new', use_parallel_residual=True,
                rotary_pct=1.0, rotary_emb_base=m.rope_theta, layer_norm_eps=m.norm_eps,
                attention_bias=True, hidden_dropout=0.0, attention_dropout=0.0,
                rope_parameters={'rope_type': 'default', 'rope_theta': m.rope_theta,
                                 'partial_rotary_factor': 1.0})
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


def write_tokenizer(out: str, spec: str, eos_id: int) -> None:
  """tokenizer.json + tokenizer_config.json for mjax's tokenizer.

  'bytes' becomes a byte-level BPE with no merges, so every UTF-8 byte is
  its own id (0..255) as in mjax, with EOS 256 and PAD 257 as special
  tokens; a tokenizer.json made by mjax-tokenizer is copied as it is.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415
  from mjax.data.tokenizer import BYTES, EOS_ID, PAD_ID  # noqa: PLC0415
  if spec == BYTES:
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken  # noqa: PLC0415
    tok.add_special_tokens([AddedToken('<|endoftext|>', special=True), AddedToken('<|pad|>', special=True)])
    assert tok.token_to_id('<|endoftext|>') == EOS_ID and tok.token_to_id('<|pad|>') == PAD_ID
    tok.save(os.path.join(out, 'tokenizer.json'))
    eos, pad = '<|endoftext|>', '<|pad|>'
  else:
    shutil.copyfile(os.path.expanduser(spec), os.path.join(out, 'tokenizer.json'))
    eos = Tokenizer.from_file(os.path.join(out, 'tokenizer.json')).id_to_token(eos_id)
    pad = None
  conf = {'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': eos, 'bos_token': eos,
          'model_max_length': 1_000_000, 'clean_up_tokenization_spaces': False}
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
  from safetensors.numpy import save_file  # noqa: PLC0415
  from mjax.data import load_tokenizer  # noqa: PLC0415
  m = cfg.model
  arch = architecture(m, drop_window)
  out = os.path.abspath(os.path.expanduser(out))
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise UserError(f'{PROG}: {out!r} exists and is not an empty directory; give a new path (nothing is '
                    f'overwritten).')
  info = load_tokenizer(cfg.data.tokenizer).info
  if info.vocab_size > m.vocab_size:
    raise UserError(f'the tokenizer has {info.vocab_size} ids but ModelConfig.vocab_size is {m.vocab_size}.')
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix='.mjax-export-', dir=parent)
  try:
    conf = hf_config(m, arch, cfg.data.seq_len, info.eos_id, drop_window)
    with open(os.path.join(tmp, 'config.json'), 'w') as fh:
      json.dump(conf, fh, indent=2)
    with open(os.path.join(tmp, 'generation_config.json'), 'w') as fh:
      json.dump({'bos_token_id': info.eos_id, 'eos_token_id': info.eos_id}, fh, indent=2)
    save_file(hf_tensors(params, m, arch), os.path.join(tmp, 'model.safetensors'), metadata={'format': 'pt'})
    write_tokenizer(tmp, cfg.data.tokenizer, info.eos_id)
    if os.path.isdir(out):
      os.rmdir(out)
    os.rename(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return conf


# --- the command -------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=PROG, description='A checkpoint as a Hugging Face transformers model directory.')
  p.add_argument('out', help='the directory to create (must not exist, or be empty)')
  p.add_argument('--format', choices=FORMATS, default='hf')
  p.add_argument('--workdir', help='an mjax-train run: its config.gin and newest readable checkpoint')
  p.add_argument('--checkpoint', help='a step directory or a directory of steps, instead of a run\'s own')
  p.add_argument('--step', type=int, help='the saved step to export (default: the newest readable one)')
  p.add_argument('--gin_file', action='append', default=[])
  p.add_argument('--gin_param', action='append', default=[])
  p.add_argument('--drop_sliding_window', action='store_true',
                 help='export a windowed model with full attention (the same logits for texts up to the window)')
  return p


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
  from mjax import flags  # noqa: PLC0415
  p = parser()
  args, bindings = flags.parse(p, argv)
  if not args.workdir and not args.checkpoint:
    p.error('needs --workdir RUN or --checkpoint PATH')
  return args, bindings


def main(args: argparse.Namespace, bindings: Sequence[str]) -> dict:
  """Exports what `args` name; returns {'out', 'architecture', 'step', 'checkpoint'}."""
  from mjax import evaluate, flags  # noqa: PLC0415
  from mjax.parallel import make_mesh  # noqa: PLC0415
  from mjax.train import make_program  # noqa: PLC0415
  files, saved = evaluate.config_sources(args)
  # One device is enough to hold the params; the saved layout reshards onto it.
  cfg = flags.setup(files, [*saved, *bindings])
  architecture(cfg.model, args.drop_sliding_window)     # refuse before reading anything
  program = make_program(cfg, make_mesh(cfg.mesh))
  picked, params, verified, _ = evaluate.restore(program, evaluate.choose(args, cfg))
  canonical = jax.device_get(program.canonical_params(params))
  conf = {}
  if jax.process_index() == 0:
    conf = export_hf(canonical, cfg, args.out, args.drop_sliding_window)
    evaluate.say(f'{PROG}: step {picked.step} ({picked.path}, '
                 f'{"checksums verified" if verified else "saved without checksums"}) -> {args.out} '
                 f'as {conf["architectures"][0]}')
  return {'out': os.path.abspath(args.out), 'architecture': conf.get('architectures', [None])[0],
          'step': picked.step, 'checkpoint': picked.path}
