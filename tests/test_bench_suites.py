"""The GPU suite's rows are valid configs: the suite runs only where a GPU is
lent, rarely and under a deadline, so a row that a config change broke must
fail here, on CPU, not there."""

import importlib.util
import os

import pytest

from mjax import config as config_lib
from mjax import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _suite():
  spec = importlib.util.spec_from_file_location('gpu_suite', os.path.join(REPO, 'bench', 'gpu_suite.py'))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


SUITE = _suite()


@pytest.mark.parametrize('row', SUITE.MFU_ROWS + SUITE.SMOKE_MFU_ROWS, ids=lambda r: r[0])
def test_every_mfu_row_is_a_valid_one_gpu_config(row):
  name, gin, overrides, *_ = row
  bindings = [config_lib.override_to_binding(*o.split('=', 1)) for o in overrides]
  if row in SUITE.MFU_ROWS:
    bindings.append(config_lib.override_to_binding('ModelConfig.attention_impl', 'cudnn'))
  cfg = flags.load([os.path.join(REPO, 'configs', gin)], bindings, num_devices=1)
  size = name.split()[0]
  assert gin.startswith(size), (name, gin)     # the table groups rows by their first word
  for o in overrides:
    section, rest = o.split('.', 1)
    field, value = rest.split('=', 1)
    got = getattr(getattr(cfg, {'ModelConfig': 'model', 'TrainConfig': 'train',
                                'MeshConfig': 'mesh', 'DataConfig': 'data'}[section]), field)
    assert str(got) == value, (o, got)
