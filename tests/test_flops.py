"""FLOP and parameter counting, by hand and against MegaScale's published table."""

import json
import subprocess
import sys

import pytest

from mjax import config as C
from mjax.config import ModelConfig
from mjax.model import flops as F


def test_average_keys_by_hand():
  # Causal, s = 4: queries see 1, 2, 3, 4 keys -> 2.5.
  assert F.average_keys(4, None) == 2.5
  # Window 2, s = 4: 1, 2, 2, 2 -> 1.75.
  assert F.average_keys(4, 2) == 1.75
  # A window at least as long as the sequence is full causal attention.
  assert F.average_keys(4, 4) == F.average_keys(4, 9) == 2.5


def test_flops_per_token_by_hand():
  cfg = ModelConfig(vocab_size=300, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=16,
                    sliding_window=2, full_attention_every=2, mlp='gelu')
  s = 4
  # Per layer matrices: q 8x8, out 8x8, k 8x4, v 8x4 (head_dim 4, 1 kv head) = 192;
  # MLP 8x16 + 16x8 = 256. Two layers -> 896; head 8x300 = 2400. Total 3296.
  assert sum(F.matmul_params(cfg).values()) == 3296
  # Attention, per layer 12 * heads(2) * head_dim(4) * keys: layer 0 windowed
  # (1.75 keys), layer 1 full causal (2.5 keys) -> 96 * 4.25 = 408.
  assert F.flops_per_token(cfg, s) == 6 * 3296 + 408
  # Dense convention: every layer attends to s = 4 keys -> 96 * 8 = 768.
  assert F.flops_per_token(cfg, s, dense_attention=True) == 6 * 3296 + 768


def test_flops_per_token_looks_at_one_period_of_layers(monkeypatch):
  # A billion layers (validated: below 2**31) took half an hour, one
  # window lookup per layer, and mjax-flops and mjax-train's start-up hung.
  cfg = ModelConfig(d_model=8, n_layers=10**9, n_heads=2, sliding_window=2, full_attention_every=2)
  calls = []

  def layer_window(self, layer):
    calls.append(layer)
    assert len(calls) <= 2 * self.layer_period, 'a window lookup per layer'
    return None if layer % 2 else 2
  monkeypatch.setattr(ModelConfig, 'layer_window', layer_window)
  assert F.flops_per_token(cfg, 4) == 6 * sum(F.matmul_params(cfg).values()) + 10**9 // 2 * 96 * 4.25


def test_swiglu_counts_three_matrices():
  g = ModelConfig(d_model=8, n_layers=1, n_heads=2, d_ff=16, mlp='gelu')
  s = ModelConfig(d_model=8, n_layers=1, n_heads=2, d_ff=16, mlp='swiglu')
  assert F.matmul_params(s)['mlp'] - F.matmul_params(g)['mlp'] == 8 * 16


@pytest.mark.parametrize('kw', [
    dict(), dict(mlp='swiglu', tie_embeddings=False, n_kv_heads=2, block='sequential'),
    dict(sliding_window=16, full_attention_every=2)])
def test_eval_shape_params_match_the_formula(kw):
  cfg = ModelConfig(**kw)
  counts = F.count_params(cfg)
  mm = F.matmul_params(cfg)
  norms = cfg.n_layers * (1 if cfg.block == 'parallel' else 2) * 2 * cfg.d_model + 2 * cfg.d_model
  head = 0 if cfg.tie_embeddings else mm['lm_head']
  # Every parameter is accounted for: matrices + embedding + norm scales/biases.
  assert counts['params'] == mm['attention'] + mm['mlp'] + cfg.vocab_size * cfg.d_model + head + norms


# MegaScale (NSDI'24) Table 2, 175B model: (GPUs, throughput tokens/s, aggregate PFLOP/s).
# Megatron-LM rows, large-batch part, whose PFLOP/s column is consistent with its MFU column.
MEGATRON_175B = [(3072, 433.6e3, 466.8), (6144, 851.6e3, 916.3),
                 (8192, 1027.9e3, 1106.7), (12288, 1466.8e3, 1579.5)]
# MegaScale rows (sliding-window attention, so slightly fewer attention FLOPs counted).
MEGASCALE_175B = [(3072, 531.9e3, 566.5), (6144, 1030.9e3, 1098.4), (8192, 1315.6e3, 1400.6)]


def _gpt3_175b():
  return C.load_config(['gpt3_175b.gin'], [])


def test_175b_matches_megascale_table():
  cfg = _gpt3_175b()
  dense = F.flops_per_token(cfg.model, cfg.data.seq_len, dense_attention=True)
  causal = F.flops_per_token(cfg.model, cfg.data.seq_len)
  for _, tps, pflops in MEGATRON_175B:
    # The table's PFLOP/s / tokens/s is the Megatron formula; ours in the dense
    # convention must agree to the table's rounding (0.2%).
    assert dense == pytest.approx(pflops * 1e15 / tps, rel=2e-3)
  for _, tps, pflops in MEGASCALE_175B:
    # MegaScale counts less attention work (windowed); the mask-aware figure for
    # full causal attention is within 0.5% of it, the dense one above it.
    per_token = pflops * 1e15 / tps
    assert causal == pytest.approx(per_token, rel=5e-3)
    assert dense > per_token
  # The parameter count is GPT-3's 175B (with MegaScale's 64k vocabulary).
  assert F.count_params(cfg.model)['params'] == pytest.approx(174.7e9, rel=1e-3)


def test_mjax_flops_cli_on_530b_without_allocating(repo_root):
  proc = subprocess.run([sys.executable, '-c', 'from mjax.cli import flops_main; flops_main()',
                         '--gin_file', 'configs/530b.gin'],
                        capture_output=True, text=True, cwd=repo_root, timeout=300)
  assert proc.returncode == 0, proc.stderr
  out = json.loads(proc.stdout)
  assert out['params'] == pytest.approx(530e9, rel=0.01)
  # Megatron formula for MegaScale's 530B shape: 72 l h^2 (1 + s/6h + V/12hl).
  l, h, s, v = 105, 20480, 2048, 64000
  assert out['flops_per_token_dense_attention'] == pytest.approx(
      72 * l * h * h * (1 + s / (6 * h) + v / (12 * h * l)), rel=1e-9)
  assert out['flops_per_token'] < out['flops_per_token_dense_attention']
