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


@pytest.fixture(scope='session')
def repo_root() -> str:
  return REPO


@pytest.fixture(scope='session')
def ft_reference(tmp_path_factory, repo_root):
  """The uninterrupted 2-process run of tests/test_ft.py's job under
  mjax-launch, for every test that ends a recovered run bitwise equal to it."""
  import test_ft
  return test_ft.run_reference(tmp_path_factory.mktemp('ref'), repo_root)
