"""mjax-generate: sample text from a saved checkpoint, with a KV cache.

  mjax-generate --workdir runs/tiny --prompt 'def main(' --max_new_tokens 200
  mjax-generate --workdir runs/tiny --prompt_file prompts.txt --temperature 0.7 --top_p 0.9 --seed 3
  mjax-generate --checkpoint /ckpt/run7/checkpoints/1200 --prompt 'import' --temperature 0
  mjax-generate --workdir runs/1p3b --prompt 'x' --gin.MeshConfig.data=2 --gin.MeshConfig.tensor=4

The config and checkpoint are chosen as mjax-eval chooses them (the run's
config.gin, then gin files and overrides; the newest readable step, or
--step / --checkpoint), and only the parameters are read.

Decoding: the prompts are left-padded to one length and run through the
model in one call (prefill), which fills each layer's KV cache; then one
jit-compiled step per new token reads and extends the caches. A
sliding-window layer's cache holds only its last `w` keys (a ring buffer),
so its memory does not grow with the text; full-attention layers hold the
whole text. Every prompt starts with EOS, as every training document
follows one.

Sampling: greedy (--temperature 0), or temperature with top-k and top-p
(nucleus) filtering, from --seed: the same seed and prompts give the same
text on any mesh. Ids the tokenizer cannot produce (the padding of the
vocabulary) are never sampled.

Output: with one prompt and --format text, the prompt and then the new text
as it is sampled, on stdout. With several prompts, each prompt and its
completion once all are done, in order. --format jsonl prints one JSON
object per prompt. Timings go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mjax import jsonfile
from mjax import data as data_lib
from mjax import evaluate, flags
from mjax.config import Config, ConfigError, ModelConfig
from mjax.devices import available_memory_bytes, memory_per_device
from mjax.errors import UserError
from mjax.model import Transformer
from mjax.model.attention import cache_slots
from mjax.model.layers import dtype_of
from mjax.parallel import logical_rules, make_mesh
from mjax.train import make_program, setup_compilation_cache

# A prefill of this many chunks or more says where it is every PROGRESS_S.
PROGRESS_CHUNKS = 16
PROGRESS_S = 15.0
PROG = 'mjax-generate'
FORMATS = ('text', 'jsonl')
# Logical names of the cache arrays: (layer groups, batch, slots, ...).
CACHE_AXES = {'k': ('layers', 'batch', None, 'kv_heads', 'kv'),
              'v': ('layers', 'batch', None, 'kv_heads', 'kv'),
              'pos': ('layers', 'batch', None)}


def cache_shardings(mesh: Mesh, rules) -> dict:
  """{'k', 'v', 'pos': NamedSharding} of one block's cache on `mesh`."""
  return {k: nn.logical_to_mesh_sharding(P(*v), mesh, rules) for k, v in CACHE_AXES.items()}


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is drawn from the logits."""
  temperature: float = 0.8   # 0: greedy (argmax)
  top_k: int = 0             # keep the k most likely tokens; 0: all
  top_p: float = 1.0         # keep the smallest set whose probability reaches p; 1: all
  seed: int = 0

  def check(self) -> None:
    """Raises UserError naming a value out of range."""
    if not (self.temperature >= 0 and math.isfinite(self.temperature)):
      raise UserError(f'--temperature {self.temperature}: must be a finite number >= 0 (0 is greedy).')
    if self.top_k < 0:
      raise UserError(f'--top_k {self.top_k}: must be >= 0 (0 keeps every token).')
    if not 0 < self.top_p <= 1:
      raise UserError(f'--top_p {self.top_p}: must be in (0, 1] (1 keeps every token).')
    if not -2**63 <= self.seed < 2**63:   # what jax.random.key takes
      raise UserError(f'--seed {self.seed}: must be a 64-bit integer (|seed| < 2**63).')


def sample(logits: jax.Array, key: jax.Array, s: Sampling, vocab: int, reserved: Sequence[int] = ()) -> jax.Array:
  """Next token ids (batch,) int32 from (batch, model_vocab) logits.

  Args:
    logits: fp32 logits; ids >= `vocab` (the tokenizer's size) and the
      `reserved` ones are masked.
    key: PRNG key (unused when greedy).
    s: the sampling settings.
    vocab: how many ids the tokenizer has.
    reserved: ids below `vocab` that no text encodes to (the byte
      tokenizer's PAD; `never_sampled`).
  """
  ids = jnp.arange(logits.shape[-1])
  allowed = ids < vocab
  for r in reserved:
    allowed &= ids != r
  logits = jnp.where(allowed, logits.astype(jnp.float32), -jnp.inf)
  if s.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  # -0.0 as 0.0: lax.top_k ranks +0.0 first, a sort takes them as tied.
  logits = jnp.where(logits == 0, 0.0, logits / s.temperature)
  # The draw is the argmax of logits plus Gumbel noise, one value per (row,
  # id), as jax.random.categorical draws over the whole row: a row's token
  # depends neither on the other rows (padding rows, finished ones) nor on
  # which way below its kept set was found, and a seed gives the tokens it
  # gave when every filter sorted the whole vocabulary.
  noise = jax.random.gumbel(key, logits.shape, jnp.float32)
  if s.top_k and s.top_k < vocab:
    # The k best by rank, ties to the lower id (lax.top_k keeps the lower
    # index first): by value, every token tied with the k-th stayed, and
    # top_k 1 drew among equal logits by seed where it is greedy. A partial
    # selection, not a sort of the whole vocabulary every decoded token.
    desc, order = jax.lax.top_k(logits, s.top_k)
    return _draw(_nucleus(desc, s.top_p), noise, order)
  if s.top_p < 1:
    # The nucleus is usually a few dozen tokens: taken from the best
    # NUCLEUS_CANDIDATES by rank where they hold p for every row, the same
    # set as a sort of the whole vocabulary gives, for a fraction of it.
    k = min(NUCLEUS_CANDIDATES, logits.shape[-1])
    desc, order = jax.lax.top_k(logits, k)
    # The row's max (not desc[:, :1]: slicing top_k's values makes XLA:CPU
    # sort the whole row for it): probabilities as softmax takes them.
    top = jnp.max(logits, axis=-1, keepdims=True)
    total = jnp.sum(jnp.exp(logits - top), axis=-1, keepdims=True)
    probs = jnp.exp(desc - top) / total
    held = jnp.all(jnp.sum(probs, axis=-1) >= s.top_p)

    def among_candidates(noise):
      return _draw(_nucleus(desc, s.top_p, probs), noise, order)

    def whole_vocabulary(noise):
      # By rank, as above: values and ids from one stable sort.
      neg, ranked_ids = jax.lax.sort((-logits, jnp.broadcast_to(jnp.arange(logits.shape[-1]), logits.shape)),
                                     num_keys=1, is_stable=True)
      return _draw(_nucleus(-neg, s.top_p, jnp.exp(-neg - top) / total), noise, ranked_ids)

    return jax.lax.cond(held, among_candidates, whole_vocabulary, noise)
  return _draw(logits, noise)


def _draw(kept: jax.Array, noise: jax.Array, ids: Optional[jax.Array] = None) -> jax.Array:
  """argmax of `kept` logits plus their ids' noise: the ids (batch,) int32.
  `kept` holds the logits of `ids` (a row's ranked ids), or of every id."""
  if ids is None:
    return jnp.argmax(kept + noise, axis=-1).astype(jnp.int32)
  pick = jnp.argmax(kept + jnp.take_along_axis(noise, ids, axis=-1), axis=-1)
  return jnp.take_along_axis(ids, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


# How many of the most likely tokens `sample` looks for the top-p nucleus
# among before it sorts the whole vocabulary.
NUCLEUS_CANDIDATES = 256


def _nucleus(desc: jax.Array, top_p: float, probs: Optional[jax.Array] = None) -> jax.Array:
  """Logits sorted high to low, with those outside the smallest set whose
  probability reaches `top_p` set to -inf. A token stays while the
  probability before it is below p: the most likely always stays, and the
  set stops at the first to reach p. `probs`: those of `desc` within its
  whole row, where `desc` is only the row's best (default: over `desc`)."""
  if top_p >= 1:
    return desc
  probs = jax.nn.softmax(desc, axis=-1) if probs is None else probs
  return jnp.where((jnp.cumsum(probs, axis=-1) - probs) < top_p, desc, -jnp.inf)


def _cache_layout(cfg: ModelConfig, batch: int, max_len: int) -> dict:
  """The KV caches' arrays as (shape, dtype, fill), without allocating them."""
  groups, dtype = cfg.n_layers // cfg.layer_period, dtype_of(cfg.dtype)
  layout = {}
  for i in range(cfg.layer_period):
    n = cache_slots(cfg.layer_window(i), max_len)
    kv = (groups, batch, n, cfg.kv_heads, cfg.dim_per_head)
    layout[f'block_{i}'] = {'k': (kv, dtype, 0), 'v': (kv, dtype, 0), 'pos': ((groups, batch, n), np.int32, -1)}
  return layout


def init_cache(cfg: ModelConfig, batch: int, max_len: int, full: Callable = np.full) -> dict:
  """Empty KV caches for `batch` rows of up to `max_len` tokens (numpy, or
  whatever `full` makes: jnp.full under jit puts them on the devices).

  {'block_i': {'k', 'v': (groups, batch, slots_i, kv_heads, head_dim) in the
  compute dtype, 'pos': (groups, batch, slots_i) int32, -1 = empty}}, where
  slots_i is the window of block i of each layer group, or max_len.
  """
  return {block: {k: full(shape, fill, dtype) for k, (shape, dtype, fill) in arrays.items()}
          for block, arrays in _cache_layout(cfg, batch, max_len).items()}


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, shards: Optional[dict] = None) -> int:
  """Bytes of `init_cache(cfg, batch, max_len)`, without allocating it; with
  `shards` ({'k', 'v', 'pos': sharding}), of one device's shard of it."""
  return sum(math.prod(shards[k].shard_shape(shape) if shards else shape) * np.dtype(dtype).itemsize
             for arrays in _cache_layout(cfg, batch, max_len).values() for k, (shape, dtype, _) in arrays.items())


def _check_cache_fits(cfg: Config, mesh: Mesh, batch: int, max_len: int) -> None:
  """The KV cache and the weights must fit where they live: on CPU in this
  host's free memory, on an accelerator in each device's; otherwise say
  what to lower, before anything is allocated (on CPU an allocation past
  the free memory is the OOM killer's, with no message at all).

  Each device holds its shard of both: the weights as read (fp32) and as
  cast for compute (`Generator.compute_params`), the cache by its own layout. A CPU process's devices
  all live in the host's memory, so there a weight replicated over the
  data-parallel devices counts once per device that holds it."""
  from mjax.parallel.param_layout import param_infos
  rules = logical_rules(cfg.mesh)
  shape = dict(mesh.shape)
  compute = np.dtype(dtype_of(cfg.model.dtype)).itemsize
  # The compute copy is a new buffer whatever its dtype (a jit's output).
  weights = sum(p.size * (p.itemsize + compute) // p.shards(shape) for p in param_infos(cfg.model, rules))
  cache = cache_bytes(cfg.model, batch, max_len, cache_shardings(mesh, rules))
  devices = list(mesh.devices.flat)
  if devices[0].platform == 'cpu':
    local = sum(1 for d in devices if d.process_index == jax.process_index())
    have, where, times = available_memory_bytes(), 'this host\'s free memory', local
  else:
    have, where, times = memory_per_device(devices)[0], 'one device\'s memory', 1
  need = (cache + weights) * times
  if have is not None and need > have:
    raise UserError(f'the KV cache for {batch} row(s) of up to {max_len:,} tokens needs {cache * times / 2**30:,.1f} '
                    f'GiB, and the weights {weights * times / 2**30:,.1f} GiB beside it, more than {where} '
                    f'({have / 2**30:,.1f} GiB): lower --max_new_tokens (or the prompts\' length, or their '
                    f'number), or shard the weights over more devices (MeshConfig.fsdp, MeshConfig.tensor).')


def left_pad(prompts: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
  """(tokens, positions), each (batch, longest): prompts aligned on their
  last token; padding has position < 0 (see `cached_attention`)."""
  width = max(len(p) for p in prompts)
  tokens = np.zeros((len(prompts), width), np.int32)
  positions = np.zeros((len(prompts), width), np.int32)
  for r, p in enumerate(prompts):
    tokens[r, width - len(p):] = p
    positions[r] = np.arange(width) - (width - len(p))
  return tokens, positions


class Generator:
  """The jitted prefill / decode steps of one model on one mesh."""

  def __init__(self, cfg: Config, mesh: Mesh, vocab: int, sampling: Sampling, reserved: Sequence[int] = ()):
    self.cfg, self.mesh, self.sampling = cfg, mesh, sampling
    self.rules = logical_rules(cfg.mesh)
    model = Transformer(cfg.model)
    sharding = lambda names: nn.logical_to_mesh_sharding(P(*names), mesh, self.rules)
    self.rows = sharding(('batch', None))
    self.cache_shardings = {f'block_{i}': cache_shardings(mesh, self.rules) for i in range(cfg.model.layer_period)}
    # The sampled ids are replicated: every process reads them (a batch
    # sharded over processes would not be addressable from one).
    first = NamedSharding(mesh, P())

    def advance(params, tokens, positions, cache, key):
      """Runs the new tokens ((batch, t), or (batch,): the last step's
      samples, fed back without a trip through the host); samples the next
      one from the last position."""
      if tokens.ndim == 1:
        tokens = tokens[:, None]
      logits, cache = model.apply({'params': params}, tokens, positions, cache=cache, last_only=True)
      last = logits[:, -1]
      return sample(last, key, sampling, vocab, reserved), last, cache

    # The cache is donated: each step updates it in place.
    self._advance = jax.jit(advance, donate_argnums=(3,),
                            out_shardings=(first, sharding(('batch', 'vocab')), self.cache_shardings))

  def compute_params(self, params: Any) -> Any:
    """The weight matrices (and embedding) cast to the compute dtype once,
    instead of at every decode step (which would read the fp32 master
    weights, twice the bytes, at each token). Norm scales and biases stay
    as saved (norms are computed in fp32; biases are cast where they are added). The values the matrix
    products see are the same either way."""
    dtype = dtype_of(self.cfg.model.dtype)
    matrices = ('kernel', 'embedding', 'lm_head')

    def cast(path, w):
      return w.astype(dtype) if getattr(path[-1], 'key', None) in matrices else w

    with jax.set_mesh(self.mesh):
      return jax.jit(lambda p: jax.tree_util.tree_map_with_path(cast, p))(params)

  def _new_cache(self, batch: int, max_len: int) -> dict:
    """`init_cache` made on the devices, each its own shard: no host copy
    of the whole cache (on CPU that doubled its memory)."""
    make = lambda: init_cache(self.cfg.model, batch, max_len, full=jnp.full)
    return jax.jit(make, out_shardings=self.cache_shardings)()

  def put(self, array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from the same numpy array on every process."""
    return jax.make_array_from_callback(array.shape, sharding, lambda idx: array[idx])

  def run(self, params: Any, prompts: Sequence[np.ndarray], max_new: int, eos: Optional[int],
          on_tokens: Optional[Callable[[np.ndarray], None]] = None, live: Optional[int] = None,
          prefill_chunk: int = 512,
          on_prefill: Optional[Callable[[int, int], None]] = None) -> tuple[np.ndarray, dict]:
    """Generates up to `max_new` tokens after each prompt.

    Args:
      params: the model's params on the mesh.
      prompts: token ids per row (the batch must divide over data x fsdp).
      max_new: tokens to generate per row.
      eos: stop a row after it samples this id (None: never stop early).
      on_tokens: called with each step's (batch,) new ids, as they come.
      live: rows past the first `live` only fill the batch; they never keep
        the loop going (default: every row counts).
      prefill_chunk: prompts longer than this run through the model in
        chunks of this many tokens (one compiled shape; attention scores
        chunk x (cache + chunk) instead of prompt x prompt).
      on_prefill: called with (prompt tokens done, of how many) every
        PROGRESS_S or so while a prompt of PROGRESS_CHUNKS chunks or more
        runs through.
    Returns:
      ((batch, steps) new ids, timings {'prefill_s', 'decode_s', 'steps'}).
    """
    tokens, positions = left_pad(prompts)
    b, width = tokens.shape
    extra_pad = 0
    if width > prefill_chunk:
      # More left padding, to whole chunks: every chunk has the same shape.
      extra = extra_pad = -width % prefill_chunk
      tokens = np.pad(tokens, ((0, 0), (extra, 0)))
      positions = np.concatenate([positions[:, :1] - np.arange(extra, 0, -1), positions], axis=1)
      width += extra
    chunk = min(width, prefill_chunk)
    cache = self._new_cache(b, width + max_new)
    key = jax.random.key(self.sampling.seed)
    out, done = [], np.arange(b) >= (b if live is None else live)
    next_pos = (positions[:, -1:] + 1).astype(np.int32)
    times = {'prefill_s': 0.0, 'decode_s': 0.0, 'steps': 0}
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      t0 = time.perf_counter()
      said = time.perf_counter()
      for at in range(0, width, chunk):
        new, _, cache = self._advance(params, self.put(tokens[:, at:at + chunk], self.rows),
                                      self.put(positions[:, at:at + chunk].astype(np.int32), self.rows),
                                      cache, jax.random.fold_in(key, 0))
        if on_prefill is not None and width // chunk >= PROGRESS_CHUNKS:
          # A long prompt's prefill takes minutes: where it is, now and
          # then (each chunk waited for, which a prefill this long affords).
          jax.block_until_ready(new)
          if time.perf_counter() - said >= PROGRESS_S and at + chunk < width:
            on_prefill(at + chunk - extra_pad, width - extra_pad)
            said = time.perf_counter()
      for step in range(max_new):
        # The next step is queued before this one's tokens are read: the
        # device never waits for the host (printing, the EOS check).
        if step < max_new - 1:
          following, _, cache = self._advance(params, new, self.put(next_pos + step, self.rows), cache,
                                              jax.random.fold_in(key, step + 1))
        ids = np.asarray(jax.device_get(new))
        if step == 0:
          times['prefill_s'] = time.perf_counter() - t0
          t0 = time.perf_counter()
        ids = np.where(done, -1, ids)   # -1: the row had already finished
        out.append(ids)
        if on_tokens is not None:
          on_tokens(ids)
        if eos is not None:
          done |= ids == eos
        if done.all() or step == max_new - 1:
          break
        new = following
      times['decode_s'] = time.perf_counter() - t0
      times['steps'] = len(out)
    return np.stack(out, axis=1), times


# --- the command ---------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog=PROG, description='Sample text from a saved checkpoint (KV cache, sliding-window ring buffers).',
      epilog='Overrides: --gin.MeshConfig.tensor=2, --gin_param="MeshConfig.data = 2" (repeatable).')
  evaluate.add_checkpoint_args(p, 'sample from')
  p.add_argument('--prompt', action='append', default=[], help='a prompt; repeat for a batch')
  p.add_argument('--prompt_file', help='prompts, one per line (a .jsonl file: one JSON string, '
                 '{"prompt": ...} or {"text": ...} per line, for prompts with line breaks); - reads '
                 'standard input')
  p.add_argument('--max_new_tokens', type=int, default=128)
  p.add_argument('--temperature', type=float, default=Sampling.temperature, help='0: greedy')
  p.add_argument('--top_k', type=int, default=0, help='sample among the k most likely tokens; 0: all')
  p.add_argument('--top_p', type=float, default=1.0, help='nucleus sampling threshold; 1: off')
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--stop_at_eos', action=argparse.BooleanOptionalAction, default=True,
                 help='end a prompt\'s text at EOS (the end of a document)')
  p.add_argument('--format', choices=FORMATS, default='text')
  return p


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
  p = parser()
  args, bindings = evaluate.parse_checkpoint_args(p, argv)
  if not args.prompt and not args.prompt_file:
    p.error('needs --prompt TEXT (repeatable) or --prompt_file FILE')
  if args.max_new_tokens < 1:
    p.error(f'--max_new_tokens {args.max_new_tokens}: must be at least 1')
  return args, bindings


def read_prompts(args: argparse.Namespace) -> list[str]:
  """--prompt values, then --prompt_file's."""
  prompts = list(args.prompt)
  if args.prompt_file:
    path = args.prompt_file
    try:
      # utf-8-sig: a byte-order mark (Windows editors write one) is no part
      # of the first prompt.
      if path == '-':   # standard input: `... | mjax-generate --prompt_file -`
        text = sys.stdin.buffer.read().decode('utf-8-sig')
      else:
        with open(path, encoding='utf-8-sig') as fh:
          text = fh.read()
      # '\n' only: JSON strings may hold U+2028 and the like, which splitlines() splits on.
      lines = [line.rstrip('\r') for line in text.split('\n')]
    except (OSError, UnicodeDecodeError) as e:
      raise UserError(f'--prompt_file {path!r} cannot be read ({type(e).__name__}: {e}); give a UTF-8 '
                      f'text file with one prompt per line.') from None
    for n, line in enumerate(lines, 1):
      if not line.strip():
        continue
      if path.endswith('.jsonl'):
        try:
          item = jsonfile.loads(line)
          # {"text": ...} too: the form of mjax's .jsonl data files.
          item = item['prompt' if 'prompt' in item else 'text'] if isinstance(item, dict) else item
          if not isinstance(item, str):
            raise TypeError(type(item).__name__)
        except (ValueError, KeyError, TypeError) as e:
          raise UserError(f'--prompt_file {path!r} line {n}: {line[:80]!r} is not a JSON string, '
                          f'{{"prompt": "..."}} or {{"text": "..."}} ({type(e).__name__}: {e}).') from None
        prompts.append(item)
      else:
        prompts.append(line)
  if not prompts:
    raise UserError(f'--prompt_file {args.prompt_file!r} holds no prompt (every line is empty).')
  return prompts


class Printer:
  """Writes the prompts' texts as --format asks, streaming one prompt's text."""

  def __init__(self, tokenizer, prompts: list[str], fmt: str, eos: Optional[int] = None, out=None):
    self.tok, self.prompts, self.fmt, self.eos = tokenizer, prompts, fmt, eos
    self.out = out or sys.stdout
    self.stream = fmt == 'text' and len(prompts) == 1 and jax.process_index() == 0
    self.ids: list[list[int]] = [[] for _ in prompts]
    self.shown = 0
    if self.stream:
      self.out.write(prompts[0])
      self.out.flush()

  def add(self, ids: np.ndarray) -> None:
    for r in range(len(self.prompts)):
      if ids[r] >= 0:
        self.ids[r].append(int(ids[r]))
    if self.stream:
      # Decode the whole text each time and print what is new, holding back
      # an incomplete character (a byte token or a BPE piece may end mid-way).
      text = self.text(0, self.eos)
      end = len(text.rstrip('\ufffd'))
      if end > self.shown:
        self.out.write(text[self.shown:end])
        self.out.flush()
        self.shown = end

  def text(self, r: int, eos: Optional[int] = None) -> str:
    ids = self.ids[r]
    if eos is not None and ids and ids[-1] == eos:
      ids = ids[:-1]
    return self.tok.decode(ids)

  def finish(self, eos: Optional[int]) -> list[dict]:
    rows = []
    for r, prompt in enumerate(self.prompts):
      ended = eos is not None and bool(self.ids[r]) and self.ids[r][-1] == eos
      rows.append({'prompt': prompt, 'completion': self.text(r, eos if ended else None),
                   'tokens': len(self.ids[r]), 'finish_reason': 'eos' if ended else 'length'})
    if jax.process_index() != 0:
      return rows
    if self.stream:
      self.out.write(rows[0]['completion'][self.shown:] + '\n')
    elif self.fmt == 'text':
      for r, row in enumerate(rows):
        self.out.write(f'{"" if r == 0 else chr(10)}--- sample {r + 1} of {len(rows)} ---\n'
                       f'{row["prompt"]}{row["completion"]}\n')
    else:
      for row in rows:
        self.out.write(json.dumps(row, ensure_ascii=False) + '\n')
    self.out.flush()
    return rows


def _without_pipeline(cfg, bindings: Sequence[str]) -> list[str]:
  """Bindings that turn a pipelined run's mesh into a data-parallel one on
  the same devices (the pipeline's size folded into `data`), for a config
  whose pipeline comes from the run rather than the command line: decoding
  has no pipeline schedule, and checkpoints load on any layout."""
  mesh = cfg.mesh
  given = [b.replace(' ', '') for b in bindings]
  if not mesh.pipelined or any(b.startswith(('MeshConfig.pipeline=', 'MeshConfig.dcn_pipeline=')) for b in given):
    return []
  data = mesh.data * mesh.pipeline if mesh.data != -1 else -1
  evaluate.say(f'{PROG}: the run is pipelined (pipeline {mesh.pipeline * mesh.dcn_pipeline}, virtual_stages '
               f'{mesh.virtual_stages}); generating on data {data} x fsdp {mesh.fsdp} x tensor {mesh.tensor} instead')
  return ['MeshConfig.pipeline = 1', 'MeshConfig.dcn_pipeline = 1', 'MeshConfig.virtual_stages = 1',
          'MeshConfig.microbatches = 0', f'MeshConfig.data = {data}',
          f'MeshConfig.dcn_data = {mesh.dcn_data * mesh.dcn_pipeline}', "MeshConfig.pipeline_schedule = 'circular'"]


def encode_prompt(tokenizer, text: str, document_attention: bool) -> np.ndarray:
  """A prompt's ids as the model saw text in training: after an end of
  document (EOS), where a document starts. With document attention a
  document's tokens never attend to the EOS before it, and its positions
  start at 0: the EOS is left out there, unless the prompt is empty (then
  it gives the first token something to follow)."""
  ids = tokenizer.encode(text)
  if document_attention and len(ids):
    return np.asarray(ids, np.int32)
  return np.concatenate([[tokenizer.info.eos_id], ids]).astype(np.int32)


def main(args: argparse.Namespace, bindings: Sequence[str]) -> list[dict]:
  """Generates for the prompts `args` give; one dict per prompt.

  Raises:
    UserError: bad settings, prompts, config or checkpoint (exit status 2).
  """
  sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
  sampling.check()
  prompts = read_prompts(args)
  files, saved = evaluate.config_sources(args)
  try:
    recorded = flags.load(files, [*saved, *bindings])
  except ConfigError as e:
    # A mesh no longer taken (MeshConfig.tensor = -1, refused since): a
    # checkpoint loads on any mesh, and the one here is chosen below.
    if not str(e).startswith('MeshConfig') or any(b.replace(' ', '').startswith('MeshConfig.') for b in bindings):
      raise
    recorded = flags.load(files, [*saved, *bindings, *evaluate.ALL_DATA])
  saved = [*saved, *_without_pipeline(recorded, bindings)]
  cfg = evaluate.setup_on_these_devices(files, saved, bindings, PROG)
  if cfg.mesh.pipelined:
    raise UserError(f'{PROG} runs on data / fsdp / tensor meshes; this config has MeshConfig.pipeline = '
                    f'{cfg.mesh.pipeline} (virtual_stages {cfg.mesh.virtual_stages}). Leave MeshConfig.pipeline '
                    f'out of the command line, or set it to 1 (checkpoints load on any layout).')
  setup_compilation_cache(cfg.train.compilation_cache_dir)
  tokenizer = data_lib.load_tokenizer(data_lib.run_tokenizer(cfg.data))   # a run on BPE shards: theirs
  info = tokenizer.info
  encoded = []
  for i, p in enumerate(prompts):
    try:
      encoded.append(encode_prompt(tokenizer, p, cfg.data.document_attention))
    except UnicodeError as e:
      raise UserError(f'prompt {i + 1} ({p[:40]!r}) is not valid text ({type(e).__name__}: {e}); '
                      'give prompts as UTF-8.') from None
  mesh = make_mesh(cfg.mesh)
  program = make_program(cfg, mesh)
  rows = _padded_batch(encoded, mesh)
  longest = max(len(e) for e in encoded) + args.max_new_tokens
  _check_cache_fits(cfg, mesh, len(rows), longest)   # before the checkpoint is read
  choice = evaluate.choose(args, cfg)
  picked, params, verified, _ = evaluate.restore(program, choice, PROG)
  changed = evaluate.tokenizer_change(picked.path, cfg)
  if changed:
    evaluate.say(f'{PROG}: warning: {changed}; the text below is decoded with the tokenizer named now.')
  evaluate.say(f'{PROG}: step {picked.step} from {picked.path} '
               f'({"checksums verified" if verified else "saved without checksums"}); {len(prompts)} '
               f'prompt(s), up to {args.max_new_tokens} new tokens, mesh {dict(mesh.shape)}, KV cache '
               f'{cache_bytes(cfg.model, len(rows), longest) / 2**20:.1f} MiB')
  if longest > cfg.data.seq_len:
    evaluate.say(f'{PROG}: note: texts reach {longest} tokens, longer than the {cfg.data.seq_len} the model '
                 f'was trained on; positions past that are extrapolated.')
  reserved = [i for i in data_lib.never_sampled(info, cfg.model.vocab_size) if i < info.vocab_size]
  gen = Generator(cfg, mesh, info.vocab_size, sampling, reserved)
  eos = info.eos_id if args.stop_at_eos else None
  printer = Printer(tokenizer, prompts, args.format, eos)
  try:
    _, times = gen.run(gen.compute_params(params), rows, args.max_new_tokens, eos,
                       on_tokens=lambda ids: printer.add(ids[:len(prompts)]), live=len(prompts),
                       on_prefill=lambda done, total: evaluate.say(
                           f'{PROG}: prefill: {done:,} of {total:,} prompt tokens'))
  except jax.errors.JaxRuntimeError as e:
    # The cache fitted, but a step's working memory (attention over every
    # slot of it) did not: what to lower is the same.
    if 'RESOURCE_EXHAUSTED' not in str(e):
      raise
    raise UserError(f'generation ran out of memory ({str(e).splitlines()[0][:200]}) with a KV cache of '
                    f'{cache_bytes(cfg.model, len(rows), longest) / 2**30:,.1f} GiB for {len(rows)} row(s) of up '
                    f'to {longest:,} tokens: lower --max_new_tokens (or the prompts\' length, or their '
                    f'number).') from None
  result = printer.finish(eos)
  n = sum(r['tokens'] for r in result)
  evaluate.say(f'{PROG}: prefill {times["prefill_s"] * 1e3:.0f} ms (compile included), then '
               f'{times["steps"] - 1} decode steps in {times["decode_s"]:.2f} s; {n} tokens')
  return result


def _padded_batch(encoded: list[np.ndarray], mesh: Mesh) -> list[np.ndarray]:
  """The prompts, plus copies of the last one until the batch divides over
  the batch-sharded mesh axes (their output is dropped)."""
  shards = mesh.shape.get('data', 1) * mesh.shape.get('fsdp', 1)
  extra = (-len(encoded)) % shards
  return encoded + [encoded[-1]] * extra
