"""Peer benchmark: mjax and MaxText training the same model, in alternating rounds.

  python bench/peer_maxtext.py
  python bench/peer_maxtext.py --rounds 4 --steps 30 --warmup 5
  python bench/peer_maxtext.py --maxtext_mlp    # MaxText at its default SwiGLU MLP, for reference

The model (both stacks): MegaScale's parallel block y = x + Attn(N(x)) + MLP(N(x))
with one RMSNorm, rotary embeddings, d_model 384, 6 layers, 6 heads of 64,
GeLU MLP 1536, vocabulary 8192, untied LM head, fp32 compute and weights,
layers scanned (but see --remat none), dot-product attention, sequence 256,
batch 4, one device.
Rematerialization: mjax 'dots_no_batch' (its base.gin default) against
MaxText 'minimal' (both save the weight matmuls' outputs, recompute the rest);
`--remat full` runs both with full rematerialization, `--remat none` both
without any, layers unrolled (MaxText's 'none' only holds outside a scan).

MaxText is installed from PyPI into its own virtual environment, once
(`--maxtext_venv`, default ~/.cache/mjax/maxtext-venv; it needs Python >= 3.12,
found under ~/.pyenv/versions or on PATH, or given with `--python`): the
`maxtext` wheel, then the dependency list it ships for DECOUPLE_GCLOUD=TRUE
runs (dependencies/requirements/generated_requirements/decoupled-requirements.txt).

Every round is one fresh process per stack, mjax then MaxText in odd rounds
and MaxText then mjax in even ones, so that slow drift of the machine, and
an advantage of whichever runs first in a pair (measured on one host:
larger than 5%), hit both alike: give an even --rounds. Each process
runs `warmup` untimed steps (compilation included) and then `steps` timed ones:
  mjax     bench/train_bench.py in a subprocess (end-to-end time of the timed
           steps, data loading from the byte-level stdlib corpus included)
  MaxText  maxtext.trainers.pre_train.train on its synthetic data; the mean of
           its per-step `seconds:` log over the steps after the warm-up (it
           times step completion to step completion, so the sum is wall time)
Tokens/s = batch x seq / step time. The table gives every round, each stack's
median, the ratio mjax / MaxText of the medians and the achieved GFLOP/s at
mjax's FLOPs per token (`mjax-flops`; the same count for both, except that
with --maxtext_mlp MaxText's count uses the SwiGLU MLP it then runs).
"of the round's peak" divides the achieved GFLOP/s by the fp32 matrix-product
peak measured at the start of the same round, in a fresh process
(`mjax.devices.measure_matmul_flops`, the figure mjax's MFU divides by on CPU):
on a shared host the peak moves from hour to hour, so a peak cached on
another day would make the fraction say more about that day than about the step.
"other load" is the CPU that processes outside the benchmark used during the
round (machine busy time from /proc/stat minus the round's own CPU time), in
cores: on a shared machine, read a round with a high value with suspicion.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from mjax.config import ModelConfig  # noqa: E402
from mjax.model.flops import flops_per_token  # noqa: E402

MAXTEXT_VERSION = '0.2.5'
DEFAULT_VENV = '~/.cache/mjax/maxtext-venv'
DECOUPLED_REQS = 'dependencies/requirements/generated_requirements/decoupled-requirements.txt'

SHAPE = dict(d_model=384, n_layers=6, n_heads=6, head_dim=64, d_ff=1536, vocab_size=8192, seq_len=256, batch=4)
# mjax policy -> MaxText policy. MaxText's 'none' keeps everything only when the layers
# are not scanned (in a scan it falls back to full remat), so 'none' runs both unscanned.
REMAT = {'dots_no_batch': 'minimal', 'full': 'full', 'none': 'none'}

HEADER = ('| stack | round | tokens/s | step time (s) | GFLOP/s achieved | of the round\'s peak | other load (cores) |\n'
          '|---|---|---|---|---|---|---|')
STEP_RE = re.compile(r'completed step: (\d+), seconds: ([0-9.]+)')


def log(msg: str) -> None:
  print(f'peer_maxtext: {msg}', file=sys.stderr, flush=True)


class OtherLoad:
  """CPU time that processes other than this one's children used while it was open, in cores.

  Busy time of the whole machine (/proc/stat) minus the children's own CPU time
  (getrusage), over wall time: what else was running during a round.
  """

  def __enter__(self):
    self.t, self.busy, self.own = time.monotonic(), self._busy(), self._own()
    return self

  def __exit__(self, *exc):
    wall = time.monotonic() - self.t
    busy = self._busy()
    self.cores = (None if busy is None or self.busy is None
                  else max(0.0, (busy - self.busy - (self._own() - self.own)) / wall))

  @staticmethod
  def _busy():
    try:
      fields = [int(x) for x in open('/proc/stat').readline().split()[1:]]
    except (OSError, ValueError):
      return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf('SC_CLK_TCK')

  @staticmethod
  def _own():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


# ---------------------------------------------------------------- environment

def find_python312(explicit: str = '') -> str:
  """A Python >= 3.12 interpreter for the MaxText environment."""
  candidates = [explicit] if explicit else []
  pyenv_root = os.environ.get('PYENV_ROOT', os.path.expanduser('~/.pyenv'))
  for d in sorted(glob.glob(os.path.join(pyenv_root, 'versions', '3.*')), reverse=True):
    candidates.append(os.path.join(d, 'bin', 'python'))
  for name in ('python3.13', 'python3.12', 'python3'):
    if shutil.which(name):
      candidates.append(shutil.which(name))
  for c in candidates:
    if not c or not os.path.exists(c):
      continue
    out = subprocess.run([c, '-c', 'import sys; print(sys.version_info >= (3, 12))'],
                         capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip() == 'True':
      return c
  raise SystemExit('peer_maxtext: MaxText needs Python >= 3.12 and none was found '
                   '(looked in ~/.pyenv/versions and on PATH); pass --python')


def venv_python(venv: str) -> str:
  return os.path.join(venv, 'bin', 'python')


def ensure_maxtext(venv: str, version: str, python: str = '') -> str:
  """Creates `venv` with MaxText `version` and its dependencies, once; returns its python."""
  venv = os.path.expanduser(venv)
  stamp = os.path.join(venv, '.mjax-maxtext-ready')
  if os.path.exists(stamp) and open(stamp).read().strip() == version:
    return venv_python(venv)
  os.makedirs(os.path.dirname(venv) or '.', exist_ok=True)
  logfile = venv.rstrip('/') + '-install.log'
  log(f'installing maxtext=={version} into {venv} (once; a few minutes; log in {logfile})')
  with open(logfile, 'a') as fh:
    def sh(*cmd):
      fh.write(f'$ {" ".join(cmd)}\n')
      fh.flush()
      if subprocess.run(list(cmd), stdout=fh, stderr=subprocess.STDOUT).returncode:
        raise SystemExit(f'peer_maxtext: `{" ".join(cmd)}` failed; see {logfile}')
    if not os.path.exists(venv_python(venv)):
      sh(find_python312(python), '-m', 'venv', venv)
    pip = [venv_python(venv), '-m', 'pip', 'install', '--no-input', '--disable-pip-version-check']
    sh(*pip, f'maxtext=={version}')
    site = subprocess.run([venv_python(venv), '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'],
                          capture_output=True, text=True, check=True).stdout.strip()
    sh(*pip, '-r', os.path.join(site, DECOUPLED_REQS))
  with open(stamp, 'w') as fh:
    fh.write(version + '\n')
  return venv_python(venv)


def maxtext_info(py: str) -> dict:
  code = ('import json, os, jax, maxtext, maxtext.version as v; '
          'print(json.dumps(dict(jax=jax.__version__, maxtext=v.__version__, '
          'base_yml=os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml"))))')
  out = subprocess.run([py, '-c', code], capture_output=True, text=True,
                       env={**os.environ, 'JAX_PLATFORMS': 'cpu', 'DECOUPLE_GCLOUD': 'TRUE'})
  if out.returncode:
    raise SystemExit(f'peer_maxtext: MaxText environment broken:\n{out.stderr[-2000:]}')
  return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the two stacks

def mjax_bindings(remat: str) -> list[str]:
  s = SHAPE
  return [f'--gin.ModelConfig.d_model={s["d_model"]}', f'--gin.ModelConfig.n_layers={s["n_layers"]}',
          f'--gin.ModelConfig.n_heads={s["n_heads"]}', f'--gin.ModelConfig.d_ff={s["d_ff"]}',
          f'--gin.ModelConfig.vocab_size={s["vocab_size"]}', '--gin.ModelConfig.block=parallel',
          '--gin.ModelConfig.mlp=gelu', '--gin.ModelConfig.norm=rmsnorm',
          '--gin.ModelConfig.dtype=float32', '--gin.ModelConfig.param_dtype=float32',
          '--gin.ModelConfig.tie_embeddings=False', '--gin.ModelConfig.sliding_window=None',
          '--gin.ModelConfig.full_attention_every=0', '--gin.ModelConfig.attention_impl=dot_product',
          f'--gin.ModelConfig.scan_layers={remat != "none"}', f'--gin.ModelConfig.remat_policy={remat}',
          f'--gin.DataConfig.seq_len={s["seq_len"]}', f'--gin.TrainConfig.global_batch_size={s["batch"]}',
          '--gin.MeshConfig.data=1']


def _mjax_env() -> dict:
  """This environment for an mjax process of the benchmark: one CPU device, none of the caller's XLA flags."""
  env = {k: v for k, v in os.environ.items() if k not in ('XLA_FLAGS', 'JAX_PLATFORMS')}
  env['JAX_PLATFORMS'] = 'cpu'
  return env


def run_mjax(steps: int, warmup: int, remat: str, tmp: str, timeout: float) -> dict:
  out = os.path.join(tmp, f'mjax-{time.monotonic_ns()}.json')
  cmd = [sys.executable, os.path.join(ROOT, 'bench', 'train_bench.py'), '--gin_file', 'configs/base.gin',
         '--steps', str(steps), '--warmup', str(warmup), '--name', 'peer', '--json', out, *mjax_bindings(remat)]
  p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_mjax_env(), timeout=timeout)
  if p.returncode:
    raise SystemExit(f'peer_maxtext: mjax run failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}')
  r = json.load(open(out))
  return dict(tokens_per_sec=r['tokens_per_sec'], step_time=r['step_time'], jax=r['jax'], loss=r['loss'])


def maxtext_args(base_yml: str, steps: int, remat: str, swiglu: bool, outdir: str) -> list[str]:
  s = SHAPE
  mlp = "['silu','linear']" if swiglu else "['gelu']"
  return [base_yml, 'run_name=peer', f'base_output_directory={outdir}', f'steps={steps}',
          'hardware=cpu', 'skip_jax_distributed_system=true', 'dataset_type=synthetic',
          'enable_checkpointing=false', 'enable_tensorboard=false', f'log_period={steps + 100}',
          'decoder_block=default', f'mlp_activations={mlp}',
          f'per_device_batch_size={s["batch"]}', f'max_target_length={s["seq_len"]}',
          f'base_emb_dim={s["d_model"]}', f'base_num_query_heads={s["n_heads"]}',
          f'base_num_kv_heads={s["n_heads"]}', f'head_dim={s["head_dim"]}', f'base_mlp_dim={s["d_ff"]}',
          f'base_num_decoder_layers={s["n_layers"]}', f'vocab_size={s["vocab_size"]}',
          'logits_via_embedding=false', 'dtype=float32', 'weight_dtype=float32', 'logits_dot_in_fp32=false',
          f'remat_policy={REMAT[remat]}', f'scan_layers={str(remat != "none").lower()}', 'attention=dot_product',
          'enable_dropout=false', 'eval_interval=-1', 'ici_fsdp_parallelism=1', 'ici_data_parallelism=1']


def measure_peak(timeout: float) -> float:
  """This machine's fp32 matrix-product FLOP/s now, in a fresh process."""
  code = 'from mjax.devices import measure_matmul_flops as m; print(m("float32", seconds=2.0))'
  p = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, env=_mjax_env(),
                     timeout=timeout)
  if p.returncode:
    raise SystemExit(f'peer_maxtext: measuring the matrix-product peak failed:\n{p.stderr[-3000:]}')
  return float(p.stdout.split()[-1])


def run_maxtext(py: str, base_yml: str, steps: int, warmup: int, remat: str, swiglu: bool,
                tmp: str, timeout: float) -> dict:
  outdir = tempfile.mkdtemp(prefix='maxtext-', dir=tmp)
  cmd = [py, '-m', 'maxtext.trainers.pre_train.train',
         *maxtext_args(base_yml, steps + warmup, remat, swiglu, outdir)]
  env = {k: v for k, v in os.environ.items() if k not in ('XLA_FLAGS', 'PYTHONPATH')}
  env.update(DECOUPLE_GCLOUD='TRUE', JAX_PLATFORMS='cpu', TF_CPP_MIN_LOG_LEVEL='2')
  p = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, env=env, timeout=timeout)
  text = p.stdout + p.stderr
  with open(os.path.join(outdir, 'output.log'), 'w') as fh:
    fh.write(text)
  times = {int(n): float(sec) for n, sec in STEP_RE.findall(text)}
  timed = [t for n, t in sorted(times.items()) if n >= warmup]
  if p.returncode or len(timed) < steps:
    raise SystemExit(f'peer_maxtext: MaxText run failed (exit {p.returncode}, {len(timed)} timed steps '
                     f'of {steps}); last output:\n{text[-4000:]}')
  dt = sum(timed) / len(timed)
  loss = re.findall(r'completed step: \d+, .*? loss: ([0-9.]+)', text)
  return dict(tokens_per_sec=SHAPE['batch'] * SHAPE['seq_len'] / dt, step_time=dt,
              loss=float(loss[-1]) if loss else float('nan'))


# ---------------------------------------------------------------- main

def main(argv=None):
  p = argparse.ArgumentParser(prog='peer_maxtext', description=__doc__.splitlines()[0])
  p.add_argument('--rounds', type=int, default=2, help='rounds per stack (alternating)')
  p.add_argument('--steps', type=int, default=20, help='timed steps per round')
  p.add_argument('--warmup', type=int, default=5, help='untimed steps first (compilation included)')
  p.add_argument('--remat', choices=sorted(REMAT), default='dots_no_batch',
                 help='mjax remat policy; MaxText gets its counterpart (dots_no_batch -> minimal, '
                 'full -> full, none -> none; none runs both with the layers unrolled)')
  p.add_argument('--maxtext_mlp', action='store_true',
                 help="leave MaxText at its default SwiGLU MLP (['silu','linear']) instead of GeLU")
  p.add_argument('--maxtext_venv', default=DEFAULT_VENV, help='MaxText environment (created if missing)')
  p.add_argument('--maxtext_version', default=MAXTEXT_VERSION)
  p.add_argument('--python', default='', help='Python >= 3.12 to create the MaxText environment with')
  p.add_argument('--timeout', type=float, default=1800, help='seconds per round before giving up')
  p.add_argument('--json', default=None, help='also write the rounds and the summary as JSON to this file')
  args = p.parse_args(sys.argv[1:] if argv is None else argv)

  py = ensure_maxtext(args.maxtext_venv, args.maxtext_version, args.python)
  info = maxtext_info(py)
  tmp = tempfile.mkdtemp(prefix='peer_maxtext-')
  s = SHAPE
  mcfg = ModelConfig(d_model=s['d_model'], n_layers=s['n_layers'], n_heads=s['n_heads'], d_ff=s['d_ff'],
                     vocab_size=s['vocab_size'], tie_embeddings=False, dtype='float32')
  fpt = {'mjax': flops_per_token(mcfg, s['seq_len']),
         'MaxText': flops_per_token(dataclasses.replace(mcfg, mlp='swiglu') if args.maxtext_mlp
                                    else mcfg, s['seq_len'])}

  rows = []
  for rnd in range(1, args.rounds + 1):
    peak = measure_peak(args.timeout)
    log(f'round {rnd}: fp32 matrix-product peak {peak / 1e9:.1f} GFLOP/s')
    # Each stack goes first in every other round: on some hosts the first
    # run of a pair is the faster one, by more than the changes measured here.
    for stack in ('mjax', 'MaxText') if rnd % 2 else ('MaxText', 'mjax'):
      log(f'round {rnd}: {stack} ({args.warmup} + {args.steps} steps)')
      with OtherLoad() as load:
        if stack == 'mjax':
          r = run_mjax(args.steps, args.warmup, args.remat, tmp, args.timeout)
          info['mjax_jax'] = r.pop('jax')
        else:
          r = run_maxtext(py, info['base_yml'], args.steps, args.warmup, args.remat, args.maxtext_mlp,
                          tmp, args.timeout)
      rows.append(dict(stack=stack, round=rnd, other_load=load.cores, peak_flops=peak, **r))
      log(f'  {r["tokens_per_sec"]:,.0f} tokens/s, {r["step_time"]:.3f} s/step, loss {r["loss"]:.3f}')

  med = {st: statistics.median(r['tokens_per_sec'] for r in rows if r['stack'] == st) for st in fpt}
  ratio = med['mjax'] / med['MaxText']
  of_peak = lambda r: fpt[r['stack']] * r['tokens_per_sec'] / r['peak_flops']
  med_peak = {st: statistics.median(of_peak(r) for r in rows if r['stack'] == st) for st in fpt}
  mlp = 'SwiGLU (its default)' if args.maxtext_mlp else 'GeLU'
  print(f'parallel block, d_model {s["d_model"]}, {s["n_layers"]} layers, {s["n_heads"]} heads x '
        f'{s["head_dim"]}, MLP {s["d_ff"]}, vocab {s["vocab_size"]}, seq {s["seq_len"]}, batch {s["batch"]}, '
        f'fp32, remat {args.remat} / {REMAT[args.remat]}; MaxText MLP {mlp}; '
        f'{args.warmup} warm-up + {args.steps} timed steps per round\n')
  print(HEADER)
  for r in rows:
    other = '-' if r['other_load'] is None else f'{r["other_load"]:.2f}'
    print(f'| {r["stack"]} | {r["round"]} | {r["tokens_per_sec"]:,.0f} | {r["step_time"]:.3f} | '
          f'{fpt[r["stack"]] * r["tokens_per_sec"] / 1e9:.1f} | {of_peak(r):.0%} | '
          f'{other} |')
  for st in fpt:
    print(f'| {st} | median | {med[st]:,.0f} | {s["batch"] * s["seq_len"] / med[st]:.3f} | '
          f'{fpt[st] * med[st] / 1e9:.1f} | {med_peak[st]:.0%} | |')
  print(f'\nmjax / MaxText tokens/s: {ratio:.2f}x')
  peaks = [r['peak_flops'] for r in rows if r['stack'] == 'mjax']
  print(f'mjax at {med_peak["mjax"]:.0%} of the fp32 matrix-product peak (median of its rounds, each against '
        f'its own round\'s peak: {min(peaks) / 1e9:.0f}-{max(peaks) / 1e9:.0f} GFLOP/s)')
  print(f'FLOPs/token: mjax {fpt["mjax"] / 1e6:.1f} M, MaxText {fpt["MaxText"] / 1e6:.1f} M '
        f'(mjax.model.flops.flops_per_token, mask-aware)')
  print(f'versions: mjax env jax {info.get("mjax_jax", "?")}; MaxText env jax {info["jax"]}, '
        f'maxtext {info["maxtext"]}')
  if args.json:
    with open(args.json, 'w') as fh:
      json.dump(dict(rows=rows, median=med, ratio=ratio, of_peak=med_peak, flops_per_token=fpt, versions=info,
                     args=vars(args)), fh, indent=1)
  shutil.rmtree(tmp, ignore_errors=True)  # kept on failure: MaxText's output.log is in it


if __name__ == '__main__':
  main()
