"""Per-device memory of a training run on a hypothetical mesh, without allocating.

Training state (from the parameter shapes and the logical-axis rules, see
mjax.parallel.param_layout): master parameters, gradients and LAMB's two
moments, all in ModelConfig.param_dtype (fp32), each divided by the mesh axes
that shard the parameter (fsdp, tensor) and, for the stacked layers, by the
pipeline stages.

Activations: what the backward pass keeps per layer, for one micro-batch of b
sequences of s tokens. With e bytes per activation element (2 for bf16),
h = d_model, a = heads, q = heads x head_dim, k = kv_heads x head_dim,
F = d_ff and t = tensor-parallel size, remat policy 'none' keeps

  replicated over t:  2 e s b h per norm            (norm input and output;
                                                     1 norm in the parallel
                                                     block, 2 in the sequential)
  split over t:       e s b (2q + 2k)               (Q, K, V, attention output)
                    + m e s b F                     (MLP: m = 2 for GeLU: its
                                                     input and output; 3 for
                                                     SwiGLU: up, gate, product)
                    + e a s^2 b                     (softmax probabilities;
                                                     flash attention keeps only
                                                     a 4 a s b fp32 logsumexp)

This is Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4), s b h (10 + 24/t + 5 a s/(h t))
for 16-bit activations, minus the dropout terms (mjax has no dropout: no
1-byte masks, no dropped-out attention probabilities): for a
sequential GeLU block with F = 4h, q = k = h it reads s b h (8 + 24/t +
2 a s/(h t)). Sequence parallelism also splits the replicated part over t.
With remat:
  'full'           keeps only each layer's input (e s b h, the scan carry),
                   plus one layer's 'none' activations while it is recomputed;
  'dots'           keeps the layer input and every matmul output: Q, K, V
                   projections and MLP input projection(s) (split over t), the
                   two output projections (e s b h each: partial sums, whole on
                   every tensor rank), and with materialized attention the fp32
                   scores (4 a s^2 b) and the probabilities x V output; plus one
                   layer being recomputed;
  'dots_attention' as 'dots', and flash attention's output and softmax
                   statistics (its backward then skips the forward);
  'dots_attention_mlp' as 'dots_attention', and the MLP's activation (e s b F,
                   split over t);
  'dots_no_batch'  the same as 'dots' without the attention matmuls (they
                   have batch dimensions).
The parallel block with fuse_projections='all' has one output projection
(attention's and the MLP's joined), so one partial sum, not two.

Sharding of activations: the batch is split over data x fsdp (each replica
holds global_batch / (data x fsdp) sequences, processed in micro-batches of
`micro_batch`), heads / MLP over tensor, and layers over pipeline stages
(each stage's n_layers / pipeline layers in v = virtual_stages chunks). What
a stage keeps depends on mjax's pipeline schedule (mjax/parallel/pipeline.py):
the circular schedule's autodiff keeps every micro-batch's activations of all
its layers (m micro-batches in flight); the interleaved 1F1B schedule keeps
only its chunks' inputs between their forward and backward, at most
min(2 v p, m v) of them (one layer input each), and recomputes one chunk
(n_layers / (p v) layers under the remat policy) in its backward. The pipeline
takes m micro-batches at a time (MeshConfig.microbatches); further
micro-batches of the step are gradient-accumulation slices, one after another.
The fp32 logits (4 b s vocab / t per micro-batch: all m of them at once
under the circular schedule, one under 1F1B) of the last stage are added; totals assume one device holds
both (exact without pipelining, conservative with it). FSDP adds two gathered
layer groups in the compute dtype (the one in use and the next, prefetched).

Not counted: XLA temporaries and fragmentation, the data batch, the CUDA, cuDNN
and NCCL workspaces.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional

import jax.numpy as jnp

from mjax.config import Config, MeshConfig
from mjax.parallel.param_layout import ParamInfo, param_infos

GiB = 2**30


@dataclasses.dataclass
class MemoryEstimate:
  """Per-device bytes by component.

  Attributes:
    rows: (component, bytes per device, how it was computed).
    info: the derived quantities (micro-batch, stages, in-flight, ...).
  """
  rows: list[tuple[str, float, str]]
  info: dict

  @property
  def total(self) -> float:
    return sum(r[1] for r in self.rows)

  def get(self, component: str) -> float:
    return next(r[1] for r in self.rows if r[0] == component)


def activation_bytes_per_layer(cfg: Config, b: float, tensor: int, *, policy: Optional[str] = None,
                               flash: bool = False, sequence_parallel: bool = False,
                               ) -> tuple[float, float]:
  """Bytes one layer keeps for the backward pass, for b sequences, on one device.

  Args:
    cfg: config (model shape, compute dtype, sequence length).
    b: sequences in the micro-batch (per data-parallel replica).
    tensor: tensor-parallel size.
    policy: remat policy (default cfg.model.remat_policy).
    flash: attention keeps no s^2 probabilities (cuDNN flash attention).
    sequence_parallel: the replicated terms are split over tensor too.
  Returns:
    (kept per layer, working set of the one layer being recomputed: 0 for 'none').
  """
  m = cfg.model
  policy = policy or m.remat_policy
  e = jnp.dtype(m.dtype).itemsize
  s, h, a, F = cfg.data.seq_len, m.d_model, m.n_heads, m.d_ff
  q, k = m.n_heads * m.dim_per_head, m.kv_heads * m.dim_per_head
  t = tensor
  rt = t if sequence_parallel else 1            # divisor of the "replicated" terms
  norms = 1 if m.block == 'parallel' and m.parallel_norms == 'shared' else 2
  mlp = 3 if m.mlp == 'swiglu' else 2
  sb = s * b

  attn_probs = 4 * a * sb if flash else e * a * s * s * b
  # Each norm's fp32 row statistics, which every policy but 'full' keeps:
  # mean and 1/std for LayerNorm, 1/std for RMSNorm.
  stats = (8 if m.norm == 'layernorm' else 4) * norms * sb / rt
  none = (2 * norms * e * sb * h / rt + stats
          + (e * sb * (2 * q + 2 * k) + mlp * e * sb * F + attn_probs) / t)
  if policy == 'none':
    return none, 0.0
  layer_input = e * sb * h / rt
  if policy == 'full':
    return layer_input, none
  # Matmul outputs: Q, K, V, MLP input projection(s) (split over t); the
  # output projections (whole on each tensor rank: partial sums): two, or one
  # where the parallel block joins them into one product.
  outs = 1 if m.block == 'parallel' and m.fuse_projections == 'all' else 2  # 'auto' never joins them
  dots = (layer_input + stats + (e * sb * (q + 2 * k) + (mlp - 1) * e * sb * F) / t
          + outs * e * sb * h / rt)
  if policy == 'dots' and not flash:
    dots += (4 * a * s * s * b + e * sb * q) / t   # fp32 scores, probs x V
  if policy in ('dots_attention', 'dots_attention_mlp'):
    # Flash attention's output and fp32 softmax statistics; with
    # materialized attention the same as 'dots'.
    dots += (e * sb * q + 4 * a * sb) / t if flash else (4 * a * s * s * b + e * sb * q) / t
  if policy == 'dots_attention_mlp':
    dots += e * sb * F / t   # the MLP's activation, one (batch, seq, d_ff) tensor
  if policy in ('dots', 'dots_attention', 'dots_attention_mlp', 'dots_no_batch'):
    return dots, none
  raise ValueError(f'unknown remat policy {policy!r}')


def estimate_memory(cfg: Config, mesh: Mapping[str, int], micro_batch: Optional[int] = None, *,
                    flash: Optional[bool] = None, sequence_parallel: bool = False,
                    schedule: Optional[str] = None, virtual_stages: Optional[int] = None,
                    params: Optional[list[ParamInfo]] = None) -> MemoryEstimate:
  """Per-device memory of `cfg` on a mesh of the given sizes (see module doc).

  Args:
    cfg: the config (its own MeshConfig is ignored).
    mesh: axis sizes, e.g. {'data': 16, 'fsdp': 1, 'tensor': 8, 'pipeline': 8};
      missing axes are 1.
    micro_batch: sequences per micro-batch per data-parallel replica (Megatron's
      micro-batch size); default: the whole replica batch.
    flash: attention without s^2 probabilities; default: True unless
      ModelConfig.attention_impl is 'xla' (cuDNN flash attention on GPU).
    sequence_parallel: activations outside attention / MLP split over tensor.
    schedule: mjax's pipeline schedule, 'circular' or '1f1b' (default
      cfg.mesh.pipeline_schedule): what a stage keeps (see module doc).
    virtual_stages: layer chunks per stage (default cfg.mesh.virtual_stages).
    params: ParamInfo list (default: from cfg.model and the logical rules).
  Returns:
    MemoryEstimate.
  Raises:
    ValueError: the batch, layers or micro-batch do not divide as required.
  """
  unknown = set(mesh) - set(MeshConfig.AXES)
  if unknown:
    raise ValueError(f'unknown mesh axes {sorted(unknown)}; allowed: {", ".join(MeshConfig.AXES)}')
  sizes = {a: int(mesh.get(a, 1)) for a in MeshConfig.AXES}
  d, f, t, pp = (sizes[a] for a in MeshConfig.AXES)
  m = cfg.model
  replicas = d * f
  if cfg.train.global_batch_size % replicas:
    raise ValueError(f'global batch {cfg.train.global_batch_size} is not divisible by '
                     f'data x fsdp = {replicas}')
  replica_batch = cfg.train.global_batch_size // replicas
  b = micro_batch or replica_batch
  if replica_batch % b:
    raise ValueError(f'micro-batch {b} does not divide the per-replica batch {replica_batch}')
  n_micro = replica_batch // b
  schedule = schedule or cfg.mesh.pipeline_schedule
  if schedule not in ('circular', '1f1b'):
    raise ValueError(f"schedule must be 'circular' or '1f1b', not {schedule!r}")
  v = (virtual_stages or cfg.mesh.virtual_stages) if pp > 1 else 1
  layers_per_stage = math.ceil(m.n_layers / pp)
  if pp > 1 and (v < 1 or layers_per_stage % v):
    raise ValueError(f'{layers_per_stage} layers per stage do not split into {v} virtual stages')
  one_f_one_b = pp > 1 and schedule == '1f1b'
  # Micro-batches (circular) or chunk inputs (1F1B) a stage holds at once.
  # The pipeline takes m micro-batches at a time (MeshConfig.microbatches,
  # default the stage count); the rest of the step's micro-batches are
  # gradient-accumulation slices, run one after another.
  m_pipe = min(n_micro, cfg.mesh.microbatches or pp) if pp > 1 else 1
  if n_micro % m_pipe:
    # The step's micro-batches run m at a time: a remainder would be a
    # partial pipeline pass, which mjax-train refuses; it was dropped here,
    # and the estimate was of a layout that does not run.
    given = cfg.mesh.microbatches or f'0 (the pipeline size, {pp})'
    raise ValueError(f'MeshConfig.microbatches = {given} does not divide the {n_micro} micro-batches of '
                     f'{b} sequence(s) per replica that the step runs; set it to a divisor of {n_micro}, or '
                     f'choose another micro-batch size')
  in_flight = 1 if pp == 1 else (min(2 * v * pp, m_pipe * v) if one_f_one_b else m_pipe)
  flash = m.attention_impl != 'xla' if flash is None else flash
  params = param_infos(m) if params is None else params

  param_bytes = sum(p.size * p.itemsize / p.shards(sizes) for p in params)
  rows = [
      ('parameters', param_bytes, f'{m.param_dtype} master weights / (fsdp x tensor; layers / pipeline)'),
      ('gradients', param_bytes, 'same dtype and sharding as the parameters'),
      # optax keeps Adam's moments in the parameters' dtype.
      ('LAMB moments', 2 * param_bytes, f'2 x {m.param_dtype} per parameter, sharded like them'),
  ]
  e = jnp.dtype(m.dtype).itemsize
  once = f > 1 and cfg.mesh.fsdp_gather == 'step'
  if once:
    # Every weight gathered over fsdp for the whole step, and the gradients
    # at the same size until they are reduce-scattered once
    # (train._grad_sums_gathered): a pass's, 1F1B's fp32 accumulators, the
    # fp32 sums over accumulation slices, and the copy that is reduced.
    # Held in fp32 where the gradients would otherwise come back in the
    # compute dtype before being summed (train._gathered_in_fp32).
    slices = n_micro // m_pipe if pp > 1 else n_micro
    held = 4 if pp > 1 and (schedule == 'circular' or slices > 1) else e
    matrix = lambda p: len(p.shape) - int(p.layers) >= 2
    whole = lambda nbytes: sum(p.size / p.shards(sizes, ('tensor', 'pipeline')) * (nbytes if matrix(p) else p.itemsize)
                               for p in params)
    dtype = lambda nbytes: 'float32' if nbytes == 4 else m.dtype
    rows.append(('weights gathered for the step', whole(held),
                 f"fsdp_gather = 'step': every weight / (tensor; layers / pipeline), matrices in {dtype(held)}"))
    rows.append(('gradients of a pass, gathered', whole(held), f'in {dtype(held)}, the same size'))
    if one_f_one_b:
      rows.append(('1F1B gradient accumulators', whole(4), 'fp32, the same size'))
    if slices > 1:
      rows.append(('gradient sums, gathered', whole(4), f'fp32 over the {slices} accumulation slices'))
    if slices > 1 or held != e:
      rows.append(('gradients as reduce-scattered', whole(e), f'{m.dtype}, the same size, reduce-scattered over '
                   f'fsdp once a step'))
  elif f > 1:
    if any(p.layers for p in params):
      group = sum(p.size / p.shape[0] / p.shards(sizes, ('tensor',)) for p in params if p.layers)
    else:   # unrolled: each layer group is a subtree of its own
      group = sum(p.size / p.shards(sizes, ('tensor',)) for p in params if p.path.startswith("['layers_0']"))
    rows.append(('FSDP gather buffers', 2 * group * e,
                 f'2 gathered layer groups (in use + prefetched) in {m.dtype}'))
  if m.remat_policy != 'full' and m.param_dtype != m.dtype and not one_f_one_b and not once:
    # (Gathered once a step, the weights are already cast.)
    # The dots policies keep each projection's kernel as cast for the
    # backward's products (transformer._and_named), on the parameters'
    # shards, and so does autodiff without remat. (1F1B runs each chunk's
    # forward again inside its backward tick: nothing is kept across ticks.)
    cast = sum(p.size * e / p.shards(sizes) for p in params
               if p.in_layers and p.path.endswith("['kernel']"))
    rows.append(('weights kept cast', cast, f'the layers\' kernels in {m.dtype}, sharded like the parameters'))
  per_layer, working = activation_bytes_per_layer(
      cfg, b, t, flash=flash, sequence_parallel=sequence_parallel)
  if one_f_one_b:
    # A chunk's input is one layer input: what remat 'full' keeps per layer.
    chunk_input, _ = activation_bytes_per_layer(cfg, b, t, policy='full', flash=flash,
                                                sequence_parallel=sequence_parallel)
    rows.append(('activations (layers)', chunk_input * in_flight,
                 f'{in_flight} chunk inputs kept (min(2 v p, m v), v = {v}) x '
                 f'{chunk_input / 2**20:,.1f} MiB'))
    chunk = layers_per_stage // v
    rows.append(('activations (recompute)', chunk * per_layer + working,
                 f'one chunk of {chunk} layer(s) recomputed in its backward '
                 f'({per_layer / 2**20:,.1f} MiB/layer, remat {m.remat_policy!r})'))
  else:
    rows.append(('activations (layers)', per_layer * layers_per_stage * in_flight,
                 f'{per_layer / 2**20:,.1f} MiB/layer x {layers_per_stage} layers/stage x '
                 f'{in_flight} micro-batch(es) in flight (remat {m.remat_policy!r})'))
    if working:
      rows.append(('activations (recompute)', working, 'one layer rematerialized in the backward'))
  vocab_split = t if any('tensor' in p.axes() for p in params if p.path.startswith("['embedding']")) else 1
  # The circular schedule applies the head to the whole slice of m
  # micro-batches at once; 1F1B to one micro-batch at a time.
  head_rows = b * (m_pipe if pp > 1 and not one_f_one_b else 1)
  rows.append(('logits', 4 * head_rows * cfg.data.seq_len * m.vocab_size / vocab_split,
               f'fp32 ({head_rows:g} sequence(s), seq, vocab / {vocab_split}), last stage'))
  info = dict(mesh=sizes, devices=math.prod(sizes.values()), micro_batch=b,
              micro_batches=n_micro, in_flight=in_flight, layers_per_stage=layers_per_stage,
              virtual_stages=v, flash=flash, sequence_parallel=sequence_parallel,
              schedule=schedule if pp > 1 else 'no pipeline',
              params=sum(p.size for p in params))
  return MemoryEstimate(rows, info)


def format_estimate(est: MemoryEstimate) -> str:
  """The estimate as a table, with the assumptions above it."""
  i = est.info
  lines = [f'per-device memory estimate: mesh {i["mesh"]} ({i["devices"]} device{"" if i["devices"] == 1 else "s"}), '
           + (f'{i["params"] / 1e9:.2f}B' if i['params'] >= 1e9 else f'{i["params"] / 1e6:.2f}M')
           + ' parameters',
           f'micro-batch {i["micro_batch"]} sequence(s) x {i["micro_batches"]} per replica per step, '
           f'{i["layers_per_stage"]} layers/stage'
           + (f' in {i["virtual_stages"]} chunks' if i['virtual_stages'] > 1 else '')
           + f' ({i["schedule"]}), attention: {"flash" if i["flash"] else "materialized s^2"}'
           f'{", sequence parallel" if i["sequence_parallel"] else ""}', '']
  w = max(len(r[0]) for r in est.rows)
  for name, nbytes, how in est.rows:
    lines.append(f'  {name.ljust(w)}  {nbytes / GiB:10.2f} GiB   {how}')
  lines.append(f'  {"total".ljust(w)}  {est.total / GiB:10.2f} GiB')
  return '\n'.join(lines)
