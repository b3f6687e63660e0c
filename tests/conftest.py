"""Test set-up: 8 fake CPU devices, so every sharding runs on a real Mesh.

XLA reads the flag when the backend starts, so it must be set before anything
imports jax.
"""

import os

_FLAG = '--xla_force_host_platform_device_count=8'
if 'xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + _FLAG).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import pytest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
  """The CPU's peak FLOP/s, measured once while the machine is still quiet.

  Every run measures the peak its MFU divides by unless this machine's is
  cached (mjax.devices.peak_flops), and a figure taken while other work held
  the cores is used but never cached. Once the test workers start, the
  cores are never quiet: each of the suite's ~200 Trainers, in-process or
  not, spent a second of the cores on matrix products (about 300-400 of
  the suite's ~3,200 CPU-seconds; bench/RESULTS.md). So the controller
  measures first, as a user's first run on a quiet machine would, into the
  same default cache (an accelerator's peak comes from the data-sheet
  table: nothing is measured). xdist workers skip this: the controller has
  done it. On a busy machine nothing is cached, as before. The tests of the
  measurement use their own folders.
  """
  if hasattr(config, 'workerinput'):
    return
  import jax
  from mjax.config import TrainConfig
  from mjax.devices import peak_flops
  for dtype in ('float32', 'bfloat16'):
    peak_flops(jax.devices()[:1], dtype, TrainConfig().peak_cache_dir)


@pytest.fixture(scope='session')
def repo_root() -> str:
  return REPO


@pytest.fixture(scope='session')
def ft_reference(tmp_path_factory, repo_root):
  """The uninterrupted 2-process run of tests/test_ft.py's job under
  mjax-launch, for every test that ends a recovered run bitwise equal to it."""
  import test_ft
  return test_ft.run_reference(tmp_path_factory.mktemp('ref'), repo_root)
