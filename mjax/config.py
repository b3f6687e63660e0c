"""Typed, frozen configuration tree, bound with gin.

Every knob of a run lives in one of the dataclasses below. Gin files bind them
(`ModelConfig.d_model = 512`), the command line overrides them, and `validate`
checks the whole tree once, before anything is compiled, raising `ConfigError`
with a message that names the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
import re
import shlex
import traceback
import types
import typing
from typing import Any, Literal, Optional, Sequence

import gin

from mjax.errors import UserError


class ConfigError(UserError):
  """A config value is unknown, mistyped or inconsistent with another one."""


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer shape and numerics."""
  vocab_size: int = 384             # >= the tokenizer's vocabulary; a multiple of 128 suits GPUs
  d_model: int = 256
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: Optional[int] = None  # None: = n_heads (multi-head); fewer: grouped-query
  head_dim: Optional[int] = None    # None: d_model // n_heads
  d_ff: int = 1024                  # MLP hidden size
  block: Literal['parallel', 'sequential'] = 'parallel'
  mlp: Literal['gelu', 'swiglu'] = 'gelu'
  norm: Literal['layernorm', 'rmsnorm'] = 'layernorm'
  norm_eps: float = 1e-5
  use_bias: bool = False
  # Each token attends to itself and the previous `sliding_window - 1` tokens.
  # None: full causal attention.
  sliding_window: Optional[int] = None
  # k > 0: every k-th layer (k-1, 2k-1, ...) uses full causal attention and
  # the others the sliding window; 0: every layer uses the same attention.
  full_attention_every: int = 0
  rope_theta: float = 10000.0
  # Share of each head's dims that rotary embeddings rotate (the first ones;
  # GPT-NeoX's rotary_pct, 0.25 in its released models); the rest carry no
  # position.
  rotary_fraction: float = 1.0
  # GeLU by its tanh approximation (GPT-2/3, MegaScale) or exactly (erf).
  gelu_approximate: bool = True
  # The GeLU MLP as one unit whose forward GeLU reads its input product
  # directly, so that XLA can run it as that product's cuBLASLt epilogue
  # (layers.gelu_mlp; on GPU with --xla_gpu_enable_triton_gemm=false). Same
  # parameters, and values up to bf16 rounding (the fused GeLU reads the
  # product before it is rounded); applies where the MLP's input product
  # runs on its own (fuse_projections 'none', the GPU default). 1p3b on an
  # H100: 498.5 against 504.2 ms a step (bench/RESULTS.md).
  gelu_epilogue: bool = False
  # With gelu_epilogue, the backward's product dy Wo^T and the GeLU's
  # derivative as one Pallas kernel (mjax/model/gelu_kernel.py) that never
  # writes the product: one (tokens, d_ff) bf16 write and read fewer a layer.
  # On one Hopper GPU (H100, H200); elsewhere autodiff's kernels. Values up
  # to bf16 rounding (the derivative reads the fp32 product).
  gelu_backward_kernel: bool = False
  # q's and k's product with rotary embeddings as its epilogue, one Pallas
  # kernel (mjax/model/rotary_kernel.py) that never writes them unrotated:
  # one (tokens, q and k width) bf16 write and read fewer a layer. On one
  # Hopper GPU (H100, H200), heads of 64 or 128 dims in even counts, every
  # head dim rotated, no biases (a run says where it does nothing); elsewhere
  # XLA's product and pass. Values up to bf16 rounding (fp16 angle tables).
  rotary_kernel: bool = False
  # The parallel block's norm: one for both branches ('shared', PaLM,
  # MegaScale) or one per branch ('separate', GPT-NeoX / Pythia).
  parallel_norms: Literal['shared', 'separate'] = 'shared'
  tie_embeddings: bool = True
  # 'xla': plain einsum + mask, the numerical reference. 'dot_product':
  # jax.nn.dot_product_attention, which picks cuDNN flash attention on GPU
  # when the shapes allow it and XLA otherwise. 'cudnn': insist on cuDNN.
  attention_impl: Literal['xla', 'dot_product', 'cudnn'] = 'dot_product'
  dtype: Literal['bfloat16', 'float32', 'float16'] = 'bfloat16'      # compute
  param_dtype: Literal['float32', 'bfloat16'] = 'float32'            # master weights
  # What the backward pass may keep instead of recomputing: 'none' keeps all
  # activations, 'full' recomputes each layer group, 'dots' keeps matmul
  # outputs, 'dots_attention' also the flash attention kernel's outputs (the
  # backward then skips re-running the attention forward; GPU),
  # 'dots_attention_mlp' also the MLP's activation (one more (batch, seq,
  # d_ff) tensor per layer, for one elementwise pass fewer in the backward).
  # All but 'full' also keep the norms' row statistics and q, k after rotary.
  remat_policy: Literal['none', 'full', 'dots', 'dots_attention', 'dots_attention_mlp',
                        'dots_no_batch'] = 'none'
  scan_layers: bool = True
  # The parallel block's projections that read the same tensor, run as one
  # matrix product (PaLM): 'inputs' joins q, k, v and the MLP input; 'all'
  # also joins the two output projections; 'none' runs each on its own.
  # Parameters and checkpoints are the same whichever is chosen. 'auto':
  # 'none' on GPU, where joining measured 3-5% slower on 1p3b (XLA copies the
  # joined activations and gradients; cuBLAS runs the separate products at
  # the same speed), 'inputs' elsewhere (5-10% faster on CPU). See
  # bench/RESULTS.md.
  fuse_projections: Literal['auto', 'none', 'inputs', 'all'] = 'auto'
  init_std: float = 0.02

  @property
  def kv_heads(self) -> int:
    return self.n_kv_heads or self.n_heads

  @property
  def dim_per_head(self) -> int:
    return self.head_dim or self.d_model // self.n_heads

  @property
  def layer_period(self) -> int:
    """Layers per repeating attention pattern (scan runs over these groups)."""
    return self.full_attention_every or 1

  def layer_window(self, layer: int) -> Optional[int]:
    """The attention window of layer `layer` (None = full causal)."""
    if self.full_attention_every and layer % self.full_attention_every == self.full_attention_every - 1:
      return None
    return self.sliding_window


# What the model computes from the same parameters: a checkpoint resumes,
# evaluates and generates under another value of these (the shapes match),
# as another function. Longer contexts by rope_theta or the window are made
# this way on purpose, a stale override by mistake, so it is said, not refused.
MODEL_FUNCTION_KEYS = ('sliding_window', 'rope_theta', 'rotary_fraction', 'gelu_approximate', 'norm_eps')


def model_function_changes(saved_model: dict, model: ModelConfig) -> list[tuple[str, Any, Any]]:
  """(key, saved value, value now) for the MODEL_FUNCTION_KEYS that differ
  between a saved config's model section and `model`."""
  now = dataclasses.asdict(model)
  return [(k, saved_model[k], now[k]) for k in MODEL_FUNCTION_KEYS if k in saved_model and saved_model[k] != now[k]]


def saved_model_overrides(changes: list[tuple[str, Any, Any]]) -> str:
  """The command-line overrides that put `model_function_changes`' saved values back."""
  return ' '.join(f'--gin.ModelConfig.{k}={was!r}' for k, was, _ in changes)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where tokens come from and how they are cut into training sequences."""
  # 'stdlib': the .py files of the running Python's standard library; a text
  # file or a directory of text files (read recursively); or a directory of
  # pre-tokenized shards made by mjax-prepare (it holds a manifest.json).
  source: str = 'stdlib'
  # Which files of a directory source to read. A .jsonl file (a text or
  # directory source) holds one document per line: {"text": ...} or a string.
  file_pattern: str = '*.py'
  # 'bytes' (UTF-8 bytes + EOS + PAD, 258 ids) or the path of a Hugging Face
  # tokenizer.json (mjax-tokenizer trains one). Applies to text sources; a
  # shard directory was tokenized by mjax-prepare and must agree with it
  # (left at 'bytes' for shards alone: the run takes the shards' tokenizer).
  tokenizer: str = 'bytes'
  seq_len: int = 256
  heldout_fraction: float = 0.02    # share of files held out for evaluation (text sources)
  shuffle_seed: int = 0
  num_threads: int = 2              # grain read threads (threads beat processes on few cores)
  prefetch: int = 2                 # batches prepared ahead of the running step
  # Several sources sampled by weight: 'SOURCE:WEIGHT,SOURCE:WEIGHT', e.g.
  # 'stdlib:0.7,/data/shards:0.3' (each SOURCE as `source` above; weights are
  # relative). None: `source` alone. Held-out batches mix the sources' held-out
  # splits with the same weights.
  mixture: Optional[str] = None
  # Also emit per-token `segment_ids` and `positions` so the model can keep
  # attention inside each packed document.
  document_attention: bool = False
  # Hash every shard and scan every token id at start-up (sizes and a sample
  # of ids are always checked).
  verify_checksums: bool = False

  def source_weights(self) -> tuple[tuple[str, float], ...]:
    """The sources to read and their sampling weights.

    Returns:
      `mixture` parsed into (source, weight) pairs in order, or
      ((source, 1.0),) when there is no mixture.
    Raises:
      ConfigError: `mixture` is malformed or has a weight that is not positive.
    """
    if self.mixture is None:
      return ((self.source, 1.0),)
    pairs = []
    for item in self.mixture.split(','):
      if not item.strip():
        continue
      # rpartition: a path may itself contain ':'; the weight never does.
      src, colon, weight = item.strip().rpartition(':')
      try:
        w = float(weight)
      except ValueError:
        w = None
      if not colon or not src.strip() or w is None or not math.isfinite(w) or w <= 0:
        _fail('DataConfig.mixture', self.mixture,
              f'each comma-separated item must be SOURCE:WEIGHT with a positive weight, '
              f'e.g. \'stdlib:0.7,/data/shards:0.3\'; {item.strip()!r} is not')
      pairs.append((src.strip(), w))
    if not pairs:
      _fail('DataConfig.mixture', self.mixture, 'must list at least one SOURCE:WEIGHT (or be None)')
    return tuple(pairs)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """LAMB with warm-up + cosine decay, clipping and decoupled weight decay."""
  learning_rate: float = 3e-3       # peak, reached at the end of warm-up
  warmup_steps: int = 30
  decay_steps: Optional[int] = None  # None: TrainConfig.steps
  min_lr_ratio: float = 0.1         # final lr = learning_rate * min_lr_ratio
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-6
  weight_decay: float = 0.01        # skipped for norm scales and biases
  clip_norm: float = 1.0            # global-norm clipping; 0 disables


@gin.configurable
@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh and how the model is laid out on it.

  One of data / fsdp may be -1: the rest of the devices (tensor and pipeline
  sizes split heads and layers, and are given).
  The `dcn_*` sizes split the same axes over the slow network between hosts
  (multi-host jobs); the plain sizes are per host (fast interconnect).
  """
  data: int = -1
  fsdp: int = 1                     # ZeRO-3: params, grads, optimizer state sharded
  tensor: int = 1                   # Megatron tensor parallel: heads, MLP hidden, vocab
  pipeline: int = 1                 # pipeline stages (layers split across devices)
  dcn_data: int = 1
  dcn_fsdp: int = 1
  dcn_tensor: int = 1
  dcn_pipeline: int = 1
  # Shard the residual stream / norms over the sequence on the `tensor` axis
  # (Megatron sequence parallelism): between blocks activations are 1/tensor
  # the size, and the all-reduces of tensor parallelism become all-gather +
  # reduce-scatter pairs that XLA can overlap with the neighbouring matmuls.
  sequence_parallel: bool = False
  # With sequence_parallel: run the tensor-parallel projections as collective
  # matmuls (mjax/parallel/collective_matmul.py), the activations' all-gather
  # before q/k/v/MLP-in and reduce-scatter after the output projections cut
  # into chunks passed around the `tensor` ring, each overlapped with the
  # product of the chunk before. Same parameters and results.
  collective_matmul: bool = False
  # Interleaved (circular) pipeline: each device holds `virtual_stages` chunks
  # of layers, a micro-batch goes round the pipeline that many times, and the
  # bubble shrinks to (pipeline - 1) / (virtual_stages * microbatches).
  virtual_stages: int = 1
  microbatches: int = 0             # pipeline micro-batches per step; 0: = pipeline size
  # 'circular': every forward, then the backward by autodiff (GPipe-like:
  # activations of all m x virtual_stages items alive at the peak).
  # '1f1b': interleaved one-forward-one-backward, loss and gradients by the
  # schedule itself; activations bounded by the stage count (at most
  # 2 x virtual_stages x pipeline chunk inputs per stage) whatever the
  # micro-batch count, for one extra forward per chunk (mjax/parallel/pipeline.py).
  pipeline_schedule: Literal['circular', '1f1b'] = 'circular'
  # When FSDP gathers the weights. 'pass' (ZeRO-3): in every forward and
  # backward pass, so each accumulation slice and each pipeline micro-batch
  # gathers them again and reduce-scatters its own gradients. 'step': once a
  # step, cast to the compute dtype, held gathered through the step's slices
  # and micro-batches, with the gradients summed on each device in fp32 and
  # reduce-scattered once: Megatron's distributed optimizer (ZeRO-2 within a
  # step), MegaScale's data parallelism. For slow links (fsdp across hosts)
  # and many slices or micro-batches. Costs memory, each at the size of the
  # whole model over tensor and pipeline: the gathered weights (compute
  # dtype; fp32 where a pipeline's gradients would otherwise come back in
  # it), a pass's gradients, their fp32 sums over slices and the copy
  # reduce-scattered (`mjax-report memory`). No effect where no fsdp axis
  # splits the weights (fsdp x dcn_fsdp = 1).
  fsdp_gather: Literal['pass', 'step'] = 'pass'

  AXES = ('data', 'fsdp', 'tensor', 'pipeline')

  def ici_shape(self) -> tuple[int, ...]:
    return tuple(getattr(self, a) for a in self.AXES)

  def dcn_shape(self) -> tuple[int, ...]:
    return tuple(getattr(self, 'dcn_' + a) for a in self.AXES)

  @property
  def pipelined(self) -> bool:
    return self.pipeline * self.dcn_pipeline > 1

  def num_microbatches(self) -> int:
    return self.microbatches or self.pipeline * self.dcn_pipeline


FAST_SCOPES = ('shared', 'host')
MAX_PREFETCH = 1024   # DataConfig.prefetch's ceiling (see validate)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Orbax checkpoints in two tiers; resume rules in mjax/checkpoint/checkpointer.py."""
  enabled: bool = True
  directory: Optional[str] = None   # persistent tier; None: <workdir>/checkpoints; a relative path: in the workdir
  # Persistent-tier cadence in steps (0: only at the end and on SIGTERM):
  # what a crash costs at most, since a restart resumes the newest save.
  save_every: int = 1000
  keep: int = 3
  fast_directory: Optional[str] = None  # fast tier; None: /dev/shm/mjax/<workdir hash>
  fast_every: int = 0               # fast-tier cadence in steps; 0: no fast tier
  fast_keep: int = 2
  # Who sees the fast tier's directory. 'shared': every process, at the same
  # path (one machine's /dev/shm, or a shared filesystem). 'host': each
  # process writes the shards it holds to its own directory,
  # <fast_directory>/process-<i> (host memory in a multi-host job without a
  # shared filesystem); a restart uses those copies only when every process
  # has its copy of the step and the job's layout is unchanged.
  fast_scope: str = 'shared'
  async_save: bool = True           # write in the background while training goes on
  restore_from: Optional[str] = None  # explicit checkpoint when the workdir has none
  restore_data: bool = True         # with restore_from: also resume the data position
  # Resume only from a step below this one; newer steps are moved aside
  # (`rolled-back-<step>-<time>`). Set by mjax-launch after a loss spike:
  # a step saved during the spike holds a finite but spiked state.
  restore_below: Optional[int] = None
  # Multi-process jobs whose data-parallel replicas live in different
  # processes: one replica reads the train state and sends it to the others
  # over the network, instead of every replica reading its own full copy
  # (MegaScale's restore; mjax/checkpoint/replica.py). False: every process reads.
  single_replica_restore: bool = True
  # How long one save or one restore may take: Orbax's deadline for a save
  # written in the background, the processes' waits for each other around
  # reads and host-tier saves, and what the fault-tolerance driver allows a
  # process in a save (and, at start-up, for its restore) before calling it
  # hung. A large state on network storage takes minutes.
  io_timeout_s: float = 1800.0
  # A Hugging Face model directory (GPT-NeoX, Llama, Mistral, Ministral) whose
  # weights a fresh run starts from, with a fresh optimizer; `mjax-import`
  # writes the matching ModelConfig. A run that has checkpoints resumes them.
  init_from_hf: Optional[str] = None


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The loop: how long, how big, how often to look."""
  steps: int = 300
  global_batch_size: int = 16       # sequences per step over all devices
  # Gradient accumulation: the global batch is processed in this many
  # sequential slices whose gradients are summed, for batches that do not fit.
  grad_accum_steps: int = 1
  seed: int = 0
  eval_every: int = 100             # 0: only at the end
  eval_batches: int = 4
  log_every: int = 1                # metrics.jsonl / TensorBoard cadence
  progress: bool = True             # progress bar on stderr
  # Persistent XLA compilation cache: a restart skips recompiling the step.
  compilation_cache_dir: Optional[str] = '~/.cache/mjax/jax_cache'
  # Where the measured CPU peak FLOP/s is cached (per machine).
  peak_cache_dir: str = '~/.cache/mjax'
  # GPU only: XLA flags that overlap collectives with compute (latency-hiding
  # scheduler, pipelined collectives, collective matmul under tensor
  # parallelism); see mjax/parallel/xla_flags.py. `xla_extra_flags` adds or
  # replaces flags; a flag already in the XLA_FLAGS environment always wins.
  xla_overlap_flags: bool = True
  xla_extra_flags: str = ''
  # Python's garbage collector runs only every this many steps, at the same
  # steps in every process, with what start-up left alive frozen out of it
  # (mjax/ft/gc_control.py): an automatic full collection pauses one process
  # for ~0.3 s at a moment of its own, and every other process waits for it.
  # 0: Python's automatic collection, as outside mjax.
  gc_every_steps: int = 100
  # Batches to skip after the start position (resumed or fresh). The
  # fault-tolerance driver sets it after a NaN / loss-spike rollback, so that
  # the restart does not replay the batches that led to the fault.
  skip_batches: int = 0
  # Only when starting from this step (None: whatever the start): the
  # checkpoint the driver's rollback counted the skip from. A start from a
  # newer one (a host-local tier the driver cannot list) holds its own data
  # position, past the bad batches: skipping there would drop good ones.
  skip_batches_after: Optional[int] = None
  # jax.profiler trace of `profile_steps` steps starting at `profile_from_step`
  # (0: the first step after compilation, whose caches are warm) into
  # <workdir>/profile: TensorBoard's profile plugin or ui.perfetto.dev read it.
  profile_steps: int = 0
  profile_from_step: int = 0
  # Also log the metrics to Weights & Biases under this project (needs
  # `pip install 'mjax[wandb]'`; WANDB_MODE=offline keeps the run local). The
  # run id is derived from the workdir, so a restarted run continues it.
  wandb_project: Optional[str] = None


@gin.configurable
@dataclasses.dataclass(frozen=True)
class FaultConfig:
  """Fault tolerance: timeouts, restarts, stragglers (see mjax/ft/).

  Timeouts form a hierarchy, heartbeat < progress < collective, so that the
  driver notices a dead or stuck process and acts before a collective on
  the healthy ones times out by itself.
  """
  heartbeat_interval_s: float = 2.0
  heartbeat_timeout_s: float = 20.0     # no heartbeat for this long: process lost (and, the
                                        # other way, no acknowledgement: the driver is gone)
  progress_timeout_s: float = 120.0     # heartbeats but no new step: hang (or 3 x the last step's time
                                        # where longer; an evaluation: collective_timeout_s; a save:
                                        # CheckpointConfig.io_timeout_s)
  collective_timeout_s: float = 600.0   # what the job tolerates by itself (jax's peer heartbeat);
                                        # also how long a driver whose own loop is held up (slow
                                        # storage) keeps acknowledging its trainers
  timing_every: int = 10                # steps between per-process timing flushes
  timing_max_mib: int = 16              # a process's timings file past this is rotated to
                                        # process-<i>.jsonl.1 (the one before dropped): ~130k steps
                                        # of ~130-byte rows each, at most twice this per process
  device_timing_every: int = 100        # trace one step's device time per process every this many
                                        # steps, naming a rank slowed inside the step (0: off;
                                        # jobs of several processes or GPUs; see mjax/ft/device_time.py)
  straggler_margin: float = 0.2         # slower than the median by this share...
  straggler_window: int = 20            # ...over this many steps: a straggler
  evict_stragglers: bool = False
  max_restarts: int = 5
  restart_backoff_s: float = 2.0        # doubled after each restart, capped at 60 s
  loss_spike_factor: float = 3.0        # loss > factor x running median: a spike
  loss_spike_count: int = 3             # this many spikes in a row: a fault


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  fault: FaultConfig = dataclasses.field(default_factory=FaultConfig)


SECTIONS = {'model': ModelConfig, 'data': DataConfig, 'optim': OptimConfig, 'mesh': MeshConfig,
            'checkpoint': CheckpointConfig, 'train': TrainConfig, 'fault': FaultConfig}
_CLASSES = {c.__name__: c for c in SECTIONS.values()}


# ----------------------------------------------------------------------------
# Loading: gin files + overrides -> Config
# ----------------------------------------------------------------------------

def default_config_dir() -> Optional[str]:
  """The repository's configs/ folder, when mjax runs from a checkout."""
  here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs')
  return here if os.path.isdir(here) else None


def _resolve_gin_file(path: str) -> str:
  candidates = [path]
  cfg_dir = default_config_dir()
  if cfg_dir and not os.path.isabs(path):
    candidates += [os.path.join(cfg_dir, path), os.path.join(cfg_dir, path + '.gin')]
    # The README's commands say configs/tiny.gin from the checkout's root;
    # typed in another directory they mean the bundled one all the same.
    if os.path.dirname(os.path.normpath(path)) == 'configs':
      candidates.append(os.path.join(cfg_dir, os.path.basename(path)))
  for c in candidates:
    if os.path.isfile(c):
      return c
  known = sorted(f for f in os.listdir(cfg_dir) if f.endswith('.gin')) if cfg_dir else []
  what = ('a directory' if os.path.isdir(path) else
          'not a regular file (a device, a pipe or a socket)' if os.path.exists(path) else 'no such file')
  raise ConfigError(
      f'--gin_file {path!r}: {what}. Give a path to a .gin file'
      + (f' or one of the bundled configs: {", ".join(known)}.' if known else '.'))


def _parse_one_binding(binding: str) -> None:
  try:
    gin.parse_config(binding)
  except Exception as e:  # gin raises ValueError/NameError/SyntaxError variants
    raise ConfigError(_explain_gin_error(binding, e)) from None


def _explain_gin_error(text: str, err: Exception) -> str:
  """One paragraph: what gin said, where, and the nearest valid key."""
  import re
  lines = [l.strip() for l in str(err).strip().splitlines() if l.strip()]
  msg = (lines[0] if lines else type(err).__name__).rstrip('.')
  where = next((l for l in lines[1:] if l.startswith('In file')), '')
  hint = ''
  unknown_param = re.search(r"Configurable '(\w+)' doesn't have a parameter named '(\w+)'", msg)
  unknown_cls = re.search(r"No configurable matching '([\w.]+)'", msg)
  if unknown_param and unknown_param.group(1) in _CLASSES:
    cls, param = unknown_param.groups()
    params = [f.name for f in dataclasses.fields(_CLASSES[cls])]
    close = difflib.get_close_matches(param, params, n=1)
    hint = (f' {cls} takes: {", ".join(params)}.'
            + (f' Did you mean {cls}.{close[0]}?' if close else ''))
  elif unknown_cls:
    close = difflib.get_close_matches(unknown_cls.group(1), list(_CLASSES), n=1)
    hint = (f' Allowed config classes: {", ".join(_CLASSES)}.'
            + (f' Did you mean {close[0]}?' if close else ''))
  elif _too_deep(err):
    msg = f'the value {_TOO_DEEP}'
  elif msg.startswith('malformed node or string'):
    # gin's value parser is Python's literal_eval: an expression is not a value.
    msg = ('the value is an expression, not a literal; gin takes numbers, quoted strings, True, False, '
           'None, lists, tuples, dicts and @references (a float such as 1e-3, not float(...))')
  subject = f'invalid config binding {_elided(text)!r}' if text else 'invalid config'
  return f'{subject}: {_elided(msg)}{" (" + where + ")" if where else ""}.{hint}'


_TOO_DEEP = ('is nested too deeply to be read (brackets inside brackets, hundreds deep); no config value needs '
             'more than a few levels')


def _too_deep(err: Exception) -> bool:
  """A value nested past what the parser reads: gin's recursion on Python
  3.11, or from 3.12 on Python's own tokenizer, which stops at 200 open
  brackets ('too many nested parentheses') before gin recurses."""
  return isinstance(err, RecursionError) or 'too many nested parentheses' in str(err)


def _elided(text: str, keep: int = 240) -> str:
  """`text`, its middle left out when longer than `keep` characters: a
  message quotes what it refuses, in one paragraph, not a 6 KB value."""
  if len(text) <= keep:
    return text
  return f'{text[:keep * 3 // 4]} ...({len(text) - keep} characters)... {text[-keep // 4:]}'


def load_config(gin_files: Sequence[str] = (), bindings: Sequence[str] = (),
                num_devices: Optional[int] = None) -> Config:
  """Parses gin files then bindings (later wins) and returns a validated Config.

  Args:
    gin_files: paths, or names of files in the repository's configs/ folder.
    bindings: gin statements such as 'TrainConfig.steps = 30'.
    num_devices: when given, mesh-dependent checks run too.
  Raises:
    ConfigError: with a one-paragraph explanation.
  """
  # A single name is one file or one binding, not a sequence of letters.
  gin_files = [os.fspath(f) for f in ([gin_files] if isinstance(gin_files, (str, os.PathLike)) else gin_files)]
  bindings = [bindings] if isinstance(bindings, str) else list(bindings)
  gin.clear_config()
  try:
    cfg = _bound_config(gin_files, bindings)
  finally:
    # The dataclasses are gin configurables: left bound, every later
    # `ModelConfig()` built by hand would take this file's values.
    gin.clear_config()
  return validate(cfg, num_devices=num_devices)


def _guard_gin_file_readers() -> None:
  """Makes gin's file-existence checks answer False instead of raising.

  gin looks for an `include`d file with each registered reader in turn; the
  one it adds itself (gin.resource_reader) reads a path with a folder
  ('configs/tiny.gin') as a Python package and its file, and raises a
  TypeError where that package has no file of its own (a folder without
  __init__.py on sys.path: a namespace package). The search then ended in
  'expected str, bytes or os.PathLike object, not NoneType' instead of gin's
  own 'Unable to open file: ... Searched config paths: [...]'."""
  readers = getattr(gin.config, '_FILE_READERS', None)   # gin has no public way to change them
  if not isinstance(readers, list):
    return
  for i, entry in enumerate(readers):
    try:
      reader, exists = entry
    except (TypeError, ValueError):
      continue
    if getattr(exists, '_mjax_guarded', False):
      continue

    def guarded(path, _exists=exists):
      try:
        return bool(_exists(path))
      except Exception:  # noqa: BLE001 -- a reader that cannot tell has not found the file
        return False
    guarded._mjax_guarded = True
    readers[i] = (reader, guarded)


def _bound_config(gin_files: Sequence[str], bindings: Sequence[str]) -> Config:
  """`load_config`'s parse: the Config the files and bindings make, unchecked."""
  _guard_gin_file_readers()
  cfg_dir = default_config_dir()
  if cfg_dir:
    gin.add_config_file_search_path(cfg_dir)
  for f in gin_files:
    path = _resolve_gin_file(f)
    gin.add_config_file_search_path(os.path.dirname(os.path.abspath(path)))
    # gin logs an ERROR for every search path an `include` is not found in
    # before the one it is found in; only a real failure should be reported.
    logging.disable(logging.ERROR)
    try:
      gin.parse_config_file(path)
    except Exception as e:  # noqa: BLE001 -- every failure becomes one ConfigError below
      if not _too_deep(e):
        raise ConfigError(f'in gin file {path}: {_explain_gin_error("", e)}') from None
      # gin's parser recurses for includes and for nested values alike.
      # A chain of includes is a few files deep; a loop, as deep as Python goes.
      if sum(f.name == 'parse_config_file' for f in traceback.extract_tb(e.__traceback__)) > 50:
        raise ConfigError(f'in gin file {path}: its includes never end (a file includes itself, directly or '
                          f'through another); remove the include that closes the loop.') from None
      raise ConfigError(f'in gin file {path}: a value {_TOO_DEEP}.') from None
    finally:
      logging.disable(logging.NOTSET)
  macros = set()   # defined on the command line, where a macro is almost surely a slip
  for b in bindings:
    before = set(gin.config._CONFIG)
    _parse_one_binding(b)
    macros |= {scope for scope, selector in set(gin.config._CONFIG) - before if selector == 'gin.macro'}
  _check_nothing_unused(macros)
  try:
    cfg = Config()
  except Exception as e:
    # A macro used (`%NAME`) but never defined: gin says only that a function
    # called `macro` lacks an argument.
    undefined = re.search(r"configurable 'macro' \(.*?\) in scope '([^']+)'", str(e))
    if undefined:
      name = undefined.group(1)
      raise ConfigError(f'the gin macro %{name} is used but never defined: define it in a gin file '
                        f'({name} = VALUE) or on the command line (--gin_param "{name} = VALUE"), or '
                        f'check its spelling.') from None
    raise ConfigError(f'could not build the config: {e}') from None
  return cfg


def _check_nothing_unused(command_line_macros: set) -> None:
  """Raises ConfigError for a binding gin accepts but mjax never reads: a
  macro given on the command line that nothing refers to (`--gin.steps=30`
  for `--gin.TrainConfig.steps=30`), or a scoped binding of mjax's classes
  (mjax builds its config without scopes). Either would leave the run on
  the value it was meant to change, without a word. Macros of gin files
  are theirs to define: one left unused by a later override is normal."""
  config = gin.config._CONFIG   # gin has no public view of what was bound
  used: set = set()

  def refs(value):
    if isinstance(value, gin.config.ConfigurableReference) and value._selector == 'gin.macro':
      used.add('/'.join(value._scopes))
    elif isinstance(value, (list, tuple, set)):
      for v in value:
        refs(v)
    elif isinstance(value, dict):
      for v in value.values():
        refs(v)
  for params in config.values():
    refs(list(params.values()))
  keys = [f'{c}.{f.name}' for c, cls in _CLASSES.items() for f in dataclasses.fields(cls)]
  for scope, selector in config:
    if selector == 'gin.macro' and scope in command_line_macros and scope not in used:
      close = ([f'{scope}.<field>'] if scope in _CLASSES else
               [k for k in keys if k.endswith('.' + scope)] or difflib.get_close_matches(scope, keys, n=1))
      raise ConfigError(
          f'invalid config binding {scope!r} = {config[(scope, selector)]["value"]!r}: it defines a gin macro '
          f'that nothing refers to (%{scope}), so it changes nothing. Bindings name a class and a field, '
          f'e.g. {close[0] if close else "TrainConfig.steps"} = ...')
    if scope and selector != 'gin.macro' and selector.rpartition('.')[2] in _CLASSES:
      name = selector.rpartition('.')[2]
      raise ConfigError(
          f'invalid config binding {scope}/{name}.{", ".join(config[(scope, selector)])}: a scoped binding, '
          f'which mjax never reads (it builds its config without gin scopes); write {name}.<field> = ... .')


def override_to_binding(key: str, value: str) -> str:
  """`--gin.TrainConfig.steps=30` -> 'TrainConfig.steps = 30'.

  A bare word that is not a Python literal (`--gin.DataConfig.source=/tmp/x`)
  is taken as a string, so shell users need no nested quotes.
  """
  import ast
  v = value.strip()
  if v and v[0] not in '@%':
    try:
      ast.literal_eval(v)
    except (ValueError, SyntaxError):
      v = repr(v)
  return f'{key} = {v}'


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------

def _type_ok(value, tp) -> tuple[bool, object]:
  """Checks `value` against a field annotation; returns (ok, normalized)."""
  origin = typing.get_origin(tp)
  if origin in (typing.Union, types.UnionType):
    for arg in typing.get_args(tp):
      ok, v = _type_ok(value, arg)
      if ok:
        return True, v
    return False, value
  if origin is Literal:
    return value in typing.get_args(tp), value
  if tp is type(None):
    return value is None, value
  if tp is bool:
    return isinstance(value, bool), value
  if tp is int:
    return isinstance(value, int) and not isinstance(value, bool), value
  if tp is float:
    # 1e999 parses as inf: no setting of mjax means infinity (it ended in
    # an OverflowError deep in the start-up, or a nan loss).
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      try:
        number = float(value)
      except OverflowError:   # an int beyond any float
        return False, value
      return (True, number) if math.isfinite(number) else (False, value)
    return False, value
  if tp is str:
    return isinstance(value, str), value
  return isinstance(value, tp), value


def _describe(tp) -> str:
  origin = typing.get_origin(tp)
  if origin in (typing.Union, types.UnionType):
    return ' or '.join(_describe(a) for a in typing.get_args(tp))
  if origin is Literal:
    return 'one of ' + ', '.join(repr(a) for a in typing.get_args(tp))
  if tp is type(None):
    return 'None'
  return 'a finite float' if tp is float else f'an {tp.__name__}' if tp is int else f'a {tp.__name__}'


def _nearest_choice(value, tp) -> str:
  """' Did you mean X?' for a misspelt word of a Literal field ('dot' for
  remat 'dots', '1F1B'), as for a misspelt key; '' where none is close."""
  if not isinstance(value, str):
    return ''
  args = typing.get_args(tp) if typing.get_origin(tp) is Literal else [
      c for a in typing.get_args(tp) if typing.get_origin(a) is Literal for c in typing.get_args(a)]
  choices = [c for c in args if isinstance(c, str)]
  close = [c for c in choices if c.lower() == value.strip().lower()] or difflib.get_close_matches(value, choices, n=1)
  return f' Did you mean {close[0]!r}?' if close else ''


def _check_types(section):
  hints = typing.get_type_hints(type(section))
  changes = {}
  for f in dataclasses.fields(section):
    value = getattr(section, f.name)
    ok, norm = _type_ok(value, hints[f.name])
    if not ok:
      raise ConfigError(
          f'{type(section).__name__}.{f.name} = {value!r} has the wrong type or value; '
          f'allowed: {_describe(hints[f.name])}.{_nearest_choice(value, hints[f.name])}')
    if isinstance(value, str) and '\x00' in value:
      # No path, name or flag holds one; as a path it was a ValueError
      # traceback (embedded null byte) wherever it was first opened.
      raise ConfigError(
          f'{type(section).__name__}.{f.name} = {_elided(value)!r} holds a NUL character (\\x00), which no '
          f'path, name or flag can contain; give the value without it.')
    if norm is not value:
      changes[f.name] = norm
  return dataclasses.replace(section, **changes) if changes else section


# Fields that name a path (some also take a word: 'stdlib', 'bytes').
# (Not DataConfig.mixture: a list of sources and weights, whose own parser
# names what is wrong with it.)
PATH_FIELDS = (('data', 'source'), ('data', 'tokenizer'), ('checkpoint', 'directory'),
               ('checkpoint', 'fast_directory'), ('checkpoint', 'restore_from'), ('checkpoint', 'init_from_hf'),
               ('train', 'compilation_cache_dir'), ('train', 'peak_cache_dir'))


def _check_paths(cfg) -> None:
  """Refuses a path that is only whitespace or begins or ends with it, unless
  such a path exists: a quoting slip (`directory = ' '`, `'/data/ckpt '`)
  made a folder named with the spaces, in the workdir or wherever the run
  started, and the run wrote there without a word."""
  if cfg.train.peak_cache_dir == '':   # (not Optional: '' is no setting of its own)
    _fail('TrainConfig.peak_cache_dir', '', "must name a folder (default '~/.cache/mjax'): an empty one is the "
                                            'directory the run was started in')
  for section, name in PATH_FIELDS:
    value = getattr(getattr(cfg, section), name)
    if not isinstance(value, str) or not value or value.strip() == value or os.path.lexists(value):
      continue
    key = f'{type(getattr(cfg, section)).__name__}.{name}'
    what = 'is only whitespace' if not value.strip() else 'begins or ends with whitespace'
    raise ConfigError(
        f'{key} = {value!r} {what}, which is nearly always a quoting slip: as a path it would name a folder '
        f'with the spaces in its name. Give the path without them (no such path exists as given).')


def _fail(key: str, value, allowed: str):
  raise ConfigError(f'{key} = {value!r} is not allowed: {allowed}.')


def several_devices(mesh: MeshConfig, num_devices: Optional[int] = None) -> Optional[str]:
  """Why a Pallas kernel for one GPU does nothing on this job (None where it
  runs on one device). `num_devices`: the job's, where known."""
  several = num_devices > 1 if num_devices else any(s > 1 for s in (*mesh.ici_shape(), *mesh.dcn_shape()))
  if not several:
    return None
  return (f'the mesh has {f"{num_devices} devices" if num_devices else "several devices"}, and the kernel runs on '
          'one GPU (an H100 or H200) only')


def doubtful(cfg: Config, num_devices: Optional[int] = None) -> list[str]:
  """Settings that are valid but rarely what was meant, one sentence each
  (a run prints them as warnings and goes on). `num_devices`: the job's, where
  known (a mesh axis of -1 takes the rest of them)."""
  t, o = cfg.train, cfg.optim
  out = []
  if 0 < t.steps <= o.warmup_steps:   # the last step, steps - 1, still warming up
    out.append(f'OptimConfig.warmup_steps = {o.warmup_steps} is not below TrainConfig.steps = {t.steps}: the '
               f'learning rate never leaves its warm-up and ends at '
               f'{o.learning_rate * (t.steps - 1) / o.warmup_steps:.3g}, not OptimConfig.learning_rate = '
               f'{o.learning_rate:g} (a short run needs a shorter warm-up)')
  m, mesh = cfg.model, cfg.mesh
  if mesh.microbatches and not mesh.pipelined:
    # Read as gradient accumulation, it trained the whole batch at once.
    out.append(f'MeshConfig.microbatches = {mesh.microbatches} does nothing here: it splits a step into '
               f'micro-batches for the pipeline\'s stages, and there is no pipeline (MeshConfig.pipeline = '
               f'{mesh.pipeline}); to process the batch in slices, set TrainConfig.grad_accum_steps')
  if mesh.sequence_parallel and mesh.tensor * mesh.dcn_tensor == 1:   # the tensor axis is never -1
    # Set for its memory saving, it saved nothing: a sequence split one way
    # is the whole sequence on every device.
    out.append(f'MeshConfig.sequence_parallel = True does nothing here: it shards activations over the sequence '
               f'on the tensor axis, and that axis has 1 device (MeshConfig.tensor = {mesh.tensor}, dcn_tensor = '
               f'{mesh.dcn_tensor}); to shard activations, use tensor parallelism (MeshConfig.tensor > 1) or '
               f'set sequence_parallel to False')
  if m.gelu_epilogue:
    # It still turns XLA's Triton GEMMs off on a GPU, for nothing.
    why = None
    if m.fuse_projections in ('inputs', 'all'):
      why = f"ModelConfig.fuse_projections = {m.fuse_projections!r} joins the MLP's input product with q, k and v"
    elif mesh.collective_matmul and mesh.tensor * mesh.dcn_tensor > 1:
      why = "MeshConfig.collective_matmul runs the MLP's products as collective matmuls"
    elif not m.gelu_approximate:
      why = ("ModelConfig.gelu_approximate = False asks for the exact (erf) GeLU, and cuBLASLt's epilogue is "
             "the tanh one")
    if why:
      out.append(f'ModelConfig.gelu_epilogue = True does nothing here: {why} (it needs the MLP\'s input '
                 f'product on its own and the tanh GeLU)')
  if m.gelu_backward_kernel:
    why = several_devices(mesh, num_devices)
    if why is not None:
      pass
    elif not m.gelu_approximate:
      why = 'ModelConfig.gelu_approximate = False asks for the exact (erf) GeLU, and the kernel has the tanh one'
    elif m.remat_policy in ('none', 'dots_attention_mlp'):
      why = (f'ModelConfig.remat_policy = {m.remat_policy!r} keeps GeLU(u) from the forward, and the kernel '
             'is for a backward that computes it')
    elif m.dtype != 'bfloat16':
      why = f'ModelConfig.dtype = {m.dtype!r} computes in that dtype, and the kernel takes bf16'
    if why:
      out.append(f'ModelConfig.gelu_backward_kernel = True does nothing here: {why}')
  return out


def _check_xla_flags(text: str) -> None:
  """TrainConfig.xla_extra_flags as XLA reads them, on every platform (they
  take effect on GPUs only, where a bad one was a traceback at start-up, or
  a token without '--' silently dropped while the default it meant to
  change stayed)."""
  key = 'TrainConfig.xla_extra_flags'
  try:
    tokens = shlex.split(text or '')
  except ValueError as e:
    _fail(key, text, f'must be XLA flags as a shell would split them ({e}), e.g. '
          "'--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/dump'")
  bad = [t for t in tokens if not re.fullmatch(r'--[A-Za-z0-9_]+(=.*)?', t, re.S)]
  if bad:
    _fail(key, text, f'every word must be one XLA flag, --name or --name=value; {bad[0]!r} is not')


def _positive(section, *names, allow_zero=False):
  for n in names:
    v = getattr(section, n)
    if v is not None and (v < 0 or (v == 0 and not allow_zero)):
      _fail(f'{type(section).__name__}.{n}', v,
            'must be >= 0' if allow_zero else 'must be a positive number')


# The model and the optimizer compute these settings as 32-bit floats.
_F32_MAX = 3.4028234663852886e38
_F32_TINY = 1.1754943508222875e-38   # the smallest normal float32; XLA flushes smaller ones to 0


def _float32(section, *names):
  """Refuses a value that a 32-bit float makes inf or 0: rope_theta = 1e300
  trained a model without positions, init_std = 1e300 a nan loss (exit 3,
  which advises skipping data), clip_norm = 1e-320 a model that never
  learned, all without a word about the value."""
  for n in names:
    v = getattr(section, n)
    if v and not _F32_TINY <= abs(v) <= _F32_MAX:
      _fail(f'{type(section).__name__}.{n}', v,
            f'it is computed as a 32-bit float, where it would be {"inf" if abs(v) > _F32_MAX else "0"}; '
            f'give a value between {_F32_TINY:.3g} and {_F32_MAX:.3g}'
            + (' (or 0: off)' if n in ('weight_decay', 'clip_norm') else ''))


# Token ids, positions and per-head sizes are 32-bit integers in the model.
_INT32_MAX = 2 ** 31 - 1


def _below_int32(section, *names, rule: Optional[str] = None):
  """Refuses a value of 2**31 or more; `rule` says why, in place of the model's reason."""
  for n in names:
    v = getattr(section, n)
    if v is not None and v >= 2**31:
      _fail(f'{type(section).__name__}.{n}', v,
            rule or f'must be at most 2**31 - 1 = {_INT32_MAX:,}: the model computes token ids, positions and '
            'per-head sizes as 32-bit integers, which a larger value overflows')


def _divisors(n: int) -> str:
  """The first dozen divisors of `n`, in order (up to its square root and their
  cofactors: a d_model of 2**31 - 1 took minutes by trial of every number)."""
  root = math.isqrt(n)
  limit = min(root, 1 << 20)
  small = [d for d in range(1, limit + 1) if n % d == 0]
  large = [n // d for d in reversed(small) if n // d != d] if limit == root else []
  ds = small + large
  return ', '.join(map(str, ds[:12])) + (', ...' if len(ds) > 12 or limit < root else '')


def resolve_mesh_shape(mesh: MeshConfig, num_devices: int) -> tuple[int, ...]:
  """ICI axis sizes with -1 filled in, checked against the device count."""
  dcn = math.prod(mesh.dcn_shape())
  if num_devices % dcn:
    _fail('MeshConfig.dcn_*', mesh.dcn_shape(),
          f'their product ({dcn}) must divide the device count ({num_devices})')
  per_slice = num_devices // dcn
  # '1 device', not '1 devices': one device is where these errors come most.
  devices = lambda n: f'{n} device{"" if n == 1 else "s"}'
  shape = list(mesh.ici_shape())
  if shape.count(-1) > 1:
    _fail('MeshConfig', dict(zip(mesh.AXES, shape)), 'at most one axis may be -1')
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if per_slice % known:
      _fail('MeshConfig', dict(zip(mesh.AXES, shape)),
            f'the fixed axes multiply to {known}, which does not divide the '
            f'{devices(per_slice)} per slice')
    shape[shape.index(-1)] = per_slice // known
  elif known != per_slice:
    _fail('MeshConfig', dict(zip(mesh.AXES, shape)),
          f'the axis sizes multiply to {known} but there {"is" if per_slice == 1 else "are"} '
          f'{devices(per_slice)} per slice ({devices(num_devices)} / DCN {dcn}); make the product '
          f'{per_slice} or set one axis to -1')
  return tuple(shape)


def _check_collective_matmul(mesh: MeshConfig, tp: Optional[int]) -> None:
  """collective_matmul replaces the all-gather / reduce-scatter of sequence
  parallelism over a tensor axis of 2 or more devices: without those there is
  nothing to overlap. `tp`: the resolved tensor size (None: not known yet)."""
  if not mesh.collective_matmul:
    return
  if not mesh.sequence_parallel:
    _fail('MeshConfig.collective_matmul', True,
          'it overlaps the all-gather / reduce-scatter of sequence parallelism with the '
          'tensor-parallel matmuls, so it needs MeshConfig.sequence_parallel = True; set that too, '
          'or set collective_matmul to False')
  if tp is None and mesh.tensor != -1:
    tp = mesh.tensor * mesh.dcn_tensor
  if tp is not None and tp < 2:
    _fail('MeshConfig.collective_matmul', True,
          f'it passes activation chunks around the tensor-parallel ring, which needs '
          f'MeshConfig.tensor > 1 (the tensor axis has {tp} device); use tensor parallelism '
          f'or set collective_matmul to False')
  if mesh.pipeline * mesh.dcn_pipeline > 1:
    _fail('MeshConfig.collective_matmul', True,
          'it is not supported together with pipeline parallelism (MeshConfig.pipeline > 1): '
          'the pipeline schedules run the layers inside their own shard_map; set it to False')


def check_for_training(cfg: Config) -> None:
  """Raises ConfigError for settings that train silently wrong. Checked where
  training starts, not in `validate`: a run trained so before must still be
  evaluated, sampled from and exported."""
  m, o, t = cfg.model, cfg.optim, cfg.train
  if m.param_dtype != 'float32':
    _fail('ModelConfig.param_dtype', m.param_dtype,
          "must be 'float32' to train: LAMB changes each weight by about learning_rate times itself, below "
          "what bfloat16's 8-bit mantissa resolves, so most updates would round away and training would "
          "stall without an error (ModelConfig.dtype = 'bfloat16' is the compute dtype, and is the default)")
  if o.decay_steps and o.decay_steps <= o.warmup_steps < t.steps:   # 0, like None: TrainConfig.steps
    _fail('OptimConfig.decay_steps', o.decay_steps,
          f'must be above OptimConfig.warmup_steps = {o.warmup_steps} (the schedule decays from the end of '
          f'the warm-up to decay_steps; below it the rate would stay at its peak for all '
          f'{t.steps} steps), or unset (TrainConfig.steps)')
  d = cfg.data
  if d.mixture is not None:
    if d.source != 'stdlib':
      _fail('DataConfig.source', d.source,
            f'must be left unset with DataConfig.mixture = {d.mixture!r}, which names every source the run reads '
            f'(this one would not be read); add it to the mixture as SOURCE:WEIGHT, or set mixture = None')
    seen = {}
    for src, _ in d.source_weights():
      key = os.path.realpath(os.path.expanduser(src)) if src != 'stdlib' else src
      if key in seen:
        _fail('DataConfig.mixture', d.mixture,
              f'names the source {seen[key]!r} twice{"" if seen[key] == src else f" (as {src!r})"}: give it once, '
              f'with the weights added')
      seen[key] = src


def validate(cfg: Config, num_devices: Optional[int] = None) -> Config:
  """Type- and consistency-checks the tree; returns it with floats normalized."""
  for name, cls in SECTIONS.items():
    if not isinstance(getattr(cfg, name), cls):
      _fail(f'Config.{name}', getattr(cfg, name), f'must be a {cls.__name__}')
  cfg = dataclasses.replace(cfg, **{n: _check_types(getattr(cfg, n)) for n in SECTIONS})
  m, d, o, t, mesh, ck = cfg.model, cfg.data, cfg.optim, cfg.train, cfg.mesh, cfg.checkpoint
  _check_paths(cfg)

  _positive(m, 'vocab_size', 'd_model', 'n_layers', 'n_heads', 'n_kv_heads', 'head_dim',
            'd_ff', 'norm_eps', 'rope_theta', 'init_std')
  _positive(m, 'full_attention_every', allow_zero=True)
  _float32(m, 'norm_eps', 'rope_theta', 'init_std')
  _below_int32(m, 'vocab_size', 'd_model', 'n_layers', 'n_heads', 'n_kv_heads', 'head_dim', 'd_ff',
               'sliding_window')
  if m.head_dim is None and m.d_model % m.n_heads:
    _fail('ModelConfig.n_heads', m.n_heads,
          f'must divide ModelConfig.d_model = {m.d_model} (divisors: {_divisors(m.d_model)}), '
          'or set ModelConfig.head_dim explicitly')
  if m.n_heads % m.kv_heads:
    _fail('ModelConfig.n_kv_heads', m.n_kv_heads,
          f'must divide ModelConfig.n_heads = {m.n_heads} (divisors: {_divisors(m.n_heads)})')
  if m.dim_per_head % 2:
    if m.head_dim is None:   # d_model // n_heads: the user set those, not head_dim
      _fail('ModelConfig.d_model', m.d_model,
            f'with ModelConfig.n_heads = {m.n_heads} it makes heads of {m.dim_per_head} dims, and rotary '
            f'embeddings need an even head dimension: make d_model / n_heads even, or set ModelConfig.head_dim')
    _fail('ModelConfig.head_dim', m.dim_per_head, 'rotary embeddings need an even head dimension')
  rotated = int(m.dim_per_head * m.rotary_fraction) if 0 < m.rotary_fraction <= 1 else 0
  # (A fraction that rotates no dim, 0.01 of 64, would train a model
  # without positions, silently.)
  if not 0 < m.rotary_fraction <= 1 or rotated % 2 or rotated == 0:
    _fail('ModelConfig.rotary_fraction', m.rotary_fraction,
          f'must be in (0, 1] and rotate an even number, at least 2, of the {m.dim_per_head} head dims'
          + (f' (int(head_dim x fraction) = {rotated})' if 0 < m.rotary_fraction <= 1 else ''))
  _positive(d, 'seq_len')   # before the window checks that compare with it
  _below_int32(d, 'seq_len')
  if m.gelu_epilogue and m.mlp != 'gelu':
    _fail('ModelConfig.gelu_epilogue', m.gelu_epilogue,
          f"fuses a GeLU into its product; ModelConfig.mlp = {m.mlp!r} has none (True needs mlp 'gelu')")
  if m.gelu_backward_kernel and not m.gelu_epilogue:
    _fail('ModelConfig.gelu_backward_kernel', m.gelu_backward_kernel,
          'replaces part of the backward that ModelConfig.gelu_epilogue writes out (the GeLU MLP as one '
          'unit); True needs gelu_epilogue = True')
  if m.sliding_window is not None:
    if m.sliding_window < 1:
      _fail('ModelConfig.sliding_window', m.sliding_window, 'must be None or a positive int')
    if m.sliding_window > d.seq_len:
      _fail('ModelConfig.sliding_window', m.sliding_window,
            f'must be at most DataConfig.seq_len = {d.seq_len} (or None for full causal attention)')
  if m.full_attention_every:
    if m.sliding_window is None:
      _fail('ModelConfig.full_attention_every', m.full_attention_every,
            'interleaving full and windowed layers needs ModelConfig.sliding_window set; use 0')
    if m.n_layers % m.full_attention_every:
      _fail('ModelConfig.full_attention_every', m.full_attention_every,
            f'must divide ModelConfig.n_layers = {m.n_layers} (divisors: {_divisors(m.n_layers)})')

  _positive(d, 'seq_len', 'num_threads')
  _positive(d, 'prefetch', allow_zero=True)
  if d.prefetch > MAX_PREFETCH:
    # grain starts reading every one of them before it hands over the first
    # batch, and keeps them all in host memory: 10**12 never started (its
    # memory grew until the host ran out), 10**5 took 10 s to its first batch.
    _fail('DataConfig.prefetch', d.prefetch,
          f'must be at most {MAX_PREFETCH:,} batches: they are all read before the first step and held in host '
          f'memory, and two keep the step fed (the default)')
  if not 0.0 < d.heldout_fraction < 1.0:
    _fail('DataConfig.heldout_fraction', d.heldout_fraction, 'must be strictly between 0 and 1')
  if d.mixture is None and d.source != 'stdlib' and not os.path.exists(os.path.expanduser(d.source)):
    _fail('DataConfig.source', d.source, "must be 'stdlib' or an existing file or directory")
  if d.mixture is not None:
    for src, _ in d.source_weights():
      if src != 'stdlib' and not os.path.exists(os.path.expanduser(src)):
        _fail('DataConfig.mixture', d.mixture,
              f"source {src!r} must be 'stdlib' or an existing file or directory")
  if d.tokenizer != 'bytes' and not os.path.isfile(os.path.expanduser(d.tokenizer)):
    inside = os.path.join(os.path.expanduser(d.tokenizer), 'tokenizer.json')
    _fail('DataConfig.tokenizer', d.tokenizer, "must be 'bytes' or the path of an existing tokenizer.json"
          + (f' (this is a folder: give the one in it, {inside})' if os.path.isfile(inside) else ''))
  _positive(o, 'learning_rate', 'eps')
  _positive(o, 'warmup_steps', 'decay_steps', 'weight_decay', 'clip_norm', allow_zero=True)
  _float32(o, 'learning_rate', 'eps', 'weight_decay', 'clip_norm')
  # The warm-up clips the int32 step counter to it (a larger one was an
  # OverflowError traceback when the step compiled).
  _below_int32(o, 'warmup_steps',
               rule='must be below 2**31 (2,147,483,648): the warm-up compares it with the 32-bit step counter')
  if not 0.0 <= o.min_lr_ratio <= 1.0:
    _fail('OptimConfig.min_lr_ratio', o.min_lr_ratio, 'must be in [0, 1]')
  for b in ('b1', 'b2'):
    if not 0.0 <= getattr(o, b) < 1.0:
      _fail(f'OptimConfig.{b}', getattr(o, b), 'must be in [0, 1)')

  _positive(t, 'steps', 'global_batch_size', 'eval_batches', 'log_every')
  if t.steps >= 2**31:   # the train state counts steps in an int32 (and the schedule reads it)
    _fail('TrainConfig.steps', t.steps, 'must be below 2**31 (2,147,483,648): the step counter is a 32-bit integer')
  if not -2**63 <= t.seed < 2**63:   # what jax.random.key takes
    _fail('TrainConfig.seed', t.seed, 'must be a 64-bit integer (|seed| < 2**63)')
  _check_xla_flags(t.xla_extra_flags)
  if t.skip_batches * t.global_batch_size >= 2**62:   # grain indexes the (endless) order's rows with 64 bits
    _fail('TrainConfig.skip_batches', t.skip_batches,
          f'must keep skip_batches x global_batch_size ({t.global_batch_size}) below 2**62 rows')
  _positive(t, 'eval_every', 'skip_batches', 'skip_batches_after', 'profile_steps', 'profile_from_step', 'gc_every_steps',
            allow_zero=True)
  _positive(ck, 'keep', 'fast_keep', 'io_timeout_s', 'restore_below')
  # Orbax's save deadline is now + this, a date: 1e12 s (past the year
  # 9999) was an OverflowError traceback at the first save.
  _below_int32(ck, 'io_timeout_s', rule='must be below 2**31 seconds (68 years): a save\'s deadline is a date, '
                                        'which a longer one overflows')
  _positive(ck, 'save_every', 'fast_every', allow_zero=True)
  if ck.fast_scope not in FAST_SCOPES:
    _fail('CheckpointConfig.fast_scope', ck.fast_scope,
          "must be 'shared' (one fast directory every process sees) or 'host' (one per process, "
          'e.g. each host\'s /dev/shm)')
  if t.wandb_project is not None:
    import importlib.util
    if importlib.util.find_spec('wandb') is None:
      _fail('TrainConfig.wandb_project', t.wandb_project,
            "needs the wandb package: pip install 'mjax[wandb]' (or set it to None)")
  # CheckpointConfig.restore_from and init_from_hf are read by a run's first
  # start only (a workdir with checkpoints resumes from them), and checked
  # there: a run's recorded config names them long after that start, when
  # they may be gone (mjax-eval, -generate, -export and every resume read it).

  f = cfg.fault
  _positive(f, 'heartbeat_interval_s', 'heartbeat_timeout_s', 'progress_timeout_s',
            'collective_timeout_s', 'timing_every', 'timing_max_mib', 'straggler_window', 'loss_spike_factor',
            'loss_spike_count')
  _positive(f, 'straggler_margin', 'max_restarts', 'restart_backoff_s', 'device_timing_every', allow_zero=True)
  # jax's peer heartbeat timeout, a 32-bit count of seconds: 1e12 was a
  # TypeError traceback in every process of a job as it formed.
  _below_int32(f, 'collective_timeout_s', rule='must be below 2**31 seconds (68 years): a multi-process job gives '
                                               'it to jax as its peers\' heartbeat timeout, a 32-bit count of seconds')
  if f.heartbeat_interval_s < 0.01:
    # Each beat is a write and a send: 1e-320 s passed and busy-looped a
    # core under the driver, taken from the trainer it watches.
    _fail('FaultConfig.heartbeat_interval_s', f.heartbeat_interval_s,
          'must be at least 0.01 seconds: more often, the heartbeat thread takes a core from the trainer '
          '(default 2.0; a lost process is noticed after heartbeat_timeout_s anyway)')
  if not f.loss_spike_factor > 1:
    # At or below 1 every loss at or above the running median is a "spike":
    # a falling loss restarted the job again and again.
    _fail('FaultConfig.loss_spike_factor', f.loss_spike_factor,
          'must be greater than 1 (a spike is a loss this many times the running median; default 3.0)')
  # The driver has to notice a lost process (heartbeat) before it calls it a
  # hang (progress), and both before a collective times out on the healthy
  # processes (collective): then the driver, not a timeout on every rank,
  # decides what failed.
  chain = ('heartbeat_interval_s', 'heartbeat_timeout_s', 'progress_timeout_s', 'collective_timeout_s')
  for a, b in zip(chain, chain[1:]):
    if not getattr(f, a) < getattr(f, b):
      _fail(f'FaultConfig.{a}', getattr(f, a),
            f'must be less than FaultConfig.{b} = {getattr(f, b)}; the driver needs '
            f'heartbeat_interval_s < heartbeat_timeout_s < progress_timeout_s < collective_timeout_s')

  for a in mesh.AXES:
    for key in (a, 'dcn_' + a):
      v = getattr(mesh, key)
      if v == 0 or v < -1 or (key.startswith('dcn_') and v < 1):
        _fail(f'MeshConfig.{key}', v, 'must be a positive int' + ('' if key.startswith('dcn_') else ' or -1'))
  _positive(mesh, 'virtual_stages')
  _positive(mesh, 'microbatches', allow_zero=True)
  _positive(t, 'grad_accum_steps')
  if t.global_batch_size % t.grad_accum_steps:
    _fail('TrainConfig.grad_accum_steps', t.grad_accum_steps,
          f'must divide TrainConfig.global_batch_size = {t.global_batch_size}')
  _check_collective_matmul(mesh, None)
  for axis, what in (('tensor', 'splits the heads, the MLP and the vocabulary'),
                     ('pipeline', 'splits the layers into stages')):
    if getattr(mesh, axis) == -1:
      # Elsewhere a -1 axis would read as "one device" where its size is
      # meant (pipelining off, collective matmul's flags off).
      _fail(f'MeshConfig.{axis}', -1, f'-1 ("the rest of the devices") is for MeshConfig.data or fsdp; the '
            f'{axis} size {what} and must be given: a whole number, 1 or more')
  if mesh.virtual_stages > 1 and mesh.pipeline * mesh.dcn_pipeline == 1:
    _fail('MeshConfig.virtual_stages', mesh.virtual_stages, 'needs MeshConfig.pipeline > 1; use 1')
  if num_devices is not None:
    if not isinstance(num_devices, int) or isinstance(num_devices, bool) or num_devices < 1:
      _fail('num_devices', num_devices, 'must be the number of devices the job has: a whole number, 1 or more')
    shape = resolve_mesh_shape(mesh, num_devices)
    sizes = dict(zip(mesh.AXES, (i * j for i, j in zip(shape, mesh.dcn_shape()))))
    batch_shards = sizes['data'] * sizes['fsdp']
    if t.global_batch_size % batch_shards:
      _fail('TrainConfig.global_batch_size', t.global_batch_size,
            f'must be divisible by the batch-parallel size data x fsdp = {batch_shards} '
            f'(mesh {sizes})')
    tp = sizes['tensor']
    for key, v in (('n_heads', m.n_heads), ('n_kv_heads', m.kv_heads), ('d_ff', m.d_ff)):
      if v % tp:
        _fail(f'ModelConfig.{key}', v, f'must be divisible by the tensor-parallel size {tp}')
    if m.vocab_size % tp:
      _fail('ModelConfig.vocab_size', m.vocab_size,
            f'must be divisible by the tensor-parallel size {tp}, which splits the embedding table\'s rows '
            f'(pad the vocabulary: {-(-m.vocab_size // (128 * tp)) * 128 * tp} is a multiple of 128 x {tp})')
    if m.d_model % sizes['fsdp']:
      _fail('ModelConfig.d_model', m.d_model,
            f'must be divisible by the FSDP size {sizes["fsdp"]} (fsdp x dcn_fsdp), which splits every weight '
            f'along d_model')
    _check_collective_matmul(mesh, tp)
    if mesh.sequence_parallel and d.seq_len % tp:
      _fail('DataConfig.seq_len', d.seq_len,
            f'must be divisible by the tensor-parallel size {tp} with MeshConfig.sequence_parallel')
    slice_rows = t.global_batch_size // t.grad_accum_steps
    if slice_rows % batch_shards:
      _fail('TrainConfig.grad_accum_steps', t.grad_accum_steps,
            f'each accumulation slice ({t.global_batch_size} / {t.grad_accum_steps} = {slice_rows} '
            f'sequences) must divide over data x fsdp = {batch_shards}')
    pp = sizes['pipeline']
    if pp > 1:
      if not m.scan_layers:
        _fail('ModelConfig.scan_layers', m.scan_layers,
              'pipeline parallelism needs scanned layers; add --gin.ModelConfig.scan_layers=True (configs/125m.gin '
              'and 1p3b.gin unroll them, the fastest on one GPU)')
      chunks = pp * mesh.virtual_stages
      groups = m.n_layers // m.layer_period
      if groups % chunks:
        _fail('ModelConfig.n_layers', m.n_layers,
              f'the {groups} layer groups (of {m.layer_period} layers) must split evenly into '
              f'pipeline x virtual_stages = {pp} x {mesh.virtual_stages} = {chunks} chunks')
      mb = mesh.num_microbatches()
      if mesh.pipeline_schedule not in ('circular', '1f1b'):
        _fail('MeshConfig.pipeline_schedule', mesh.pipeline_schedule, "one of 'circular', '1f1b'")
      if mesh.pipeline_schedule == '1f1b' and mb % pp:
        _fail('MeshConfig.microbatches', mb,
              f'the 1F1B schedule takes micro-batches in groups of the {pp} stages: use a multiple of {pp}')
      if mesh.virtual_stages > 1 and mb < pp:
        _fail('MeshConfig.microbatches', mb,
              f'an interleaved pipeline needs at least as many micro-batches as stages ({pp})')
      if slice_rows % mb or (slice_rows // mb) % batch_shards:
        _fail('MeshConfig.microbatches', mb,
              f'must divide the {slice_rows} sequences of a step into micro-batches that '
              f'divide over data x fsdp = {batch_shards}')
  return cfg


# ----------------------------------------------------------------------------
# Writing the resolved config next to the run
# ----------------------------------------------------------------------------

def to_dict(cfg: Config) -> dict:
  return dataclasses.asdict(cfg)


def to_gin(cfg: Config) -> str:
  """The complete config as gin bindings; parsing it back gives `cfg` again."""
  lines = []
  for name in SECTIONS:
    section = getattr(cfg, name)
    for f in dataclasses.fields(section):
      lines.append(f'{type(section).__name__}.{f.name} = {getattr(section, f.name)!r}')
    lines.append('')
  return '\n'.join(lines)


def write(cfg: Config, workdir: str) -> None:
  """config.json, then config.gin, each replaced whole: the workdir check
  (checkpoint.guards.check_same_model) reads config.json as the mark of a run, so a
  process killed midway never leaves a half one, nor a config.gin alone."""
  os.makedirs(workdir, exist_ok=True)
  for name, text in (('config.json', json.dumps(to_dict(cfg), indent=2, sort_keys=True)),
                     ('config.gin', '# Resolved config of this run (every value, defaults included).\n' + to_gin(cfg))):
    path = os.path.join(workdir, name)
    tmp = f'{path}.{os.getpid()}.tmp'
    with open(tmp, 'w') as fh:
      fh.write(text)
    os.replace(tmp, path)
