"""Host health checks on the 8 fake CPU devices, and mjax-diagnose's verdicts.

The CPU here is shared with other work, so measured throughput is compared
with peaks written into a private cache (not the machine's own): the tests
check the mechanics, not this machine's speed.
"""

import json
import os
import subprocess
import sys

import jax
import pytest

from mjax.devices import peak_cache_key
from mjax.ft import diagnose
from mjax.protocol import DIAGNOSE_FAIL_ENV

SMALL = dict(cpu_memory_bytes=16 * diagnose.MIB, collective_bytes=diagnose.MIB, seconds=0.05)


def _cache(tmp_path, tflops):
  """A peak-FLOP/s cache like mjax-train's, claiming `tflops` for this CPU."""
  with open(tmp_path / 'peak_flops.json', 'w') as fh:
    json.dump({peak_cache_key('cpu', dt): tflops * 1e12 for dt in ('bfloat16', 'float32')}, fh)
  return str(tmp_path)


def test_device_facts_match_the_longest_name_and_load_without_jax():
  from mjax import devices as F
  assert F.lookup_peak('NVIDIA H100 PCIe', 'bfloat16') == 756e12      # not the SXM 'H100' row
  assert F.lookup_peak('NVIDIA H100 80GB HBM3', 'float32') == 494.7e12
  assert F.lookup_peak('cpu', 'float32') is None
  assert F.link_bandwidth('NVIDIA H100 80GB HBM3') == 450.0
  assert F.link_bandwidth('NVIDIA H100 PCIe') is None and F.link_bandwidth('NVIDIA L4') is None
  jax.local_devices()
  assert F.backend_started()
  # The health checks import it between collectives: it must not load JAX.
  code = 'import sys, mjax.devices as F; assert not F.backend_started(); assert "jax" not in sys.modules'
  subprocess.run([sys.executable, '-c', code], check=True, timeout=60)


def test_every_check_measures_and_passes_on_8_devices(tmp_path, monkeypatch):
  monkeypatch.delenv(DIAGNOSE_FAIL_ENV, raising=False)
  report = diagnose.run_diagnostics(cache_dir=_cache(tmp_path, 1e-4), **SMALL)
  names = [c.name for c in report.checks]
  assert names == ['matmul_bfloat16', 'matmul_float32'] + ['memory'] * 8 + ['allreduce_local', 'allgather_local']
  for c in report.checks:
    assert c.passed, c
    assert isinstance(c.value, float) and c.value > 0, c
  assert report.checks[0].expected == pytest.approx(0.5e-4)      # min_fraction of the cached peak
  assert report.passed and report.devices == {d.id: True for d in jax.local_devices()}
  blob = json.loads(json.dumps(report.to_json()))
  assert {'host', 'process', 'passed', 'checks'} <= set(blob) and blob['passed'] is True
  assert 'verdict: PASS' in diagnose.format_report(report)


def test_matmul_below_the_expected_figure_fails(tmp_path):
  checks = diagnose.check_matmul(jax.local_devices(), 'float32', 0.5, _cache(tmp_path, 1e6), seconds=0.05)
  (c,) = checks
  assert not c.passed and c.value < c.expected and c.devices == list(range(8))


def test_matmul_without_a_cached_peak_passes_with_a_note(tmp_path):
  (c,) = diagnose.check_matmul(jax.local_devices(), 'float32', 0.5, str(tmp_path), seconds=0.05)
  assert c.passed and c.expected is None and 'nothing to compare with' in c.note


def test_collective_bus_bandwidth_follows_the_nccl_tests_formulas():
  devices = jax.local_devices()
  ar = diagnose.check_collective('allreduce', devices, diagnose.MIB, seconds=0.05)
  ag = diagnose.check_collective('allgather', devices, diagnose.MIB, seconds=0.05)
  for c in (ar, ag):
    assert c.passed and c.value > 0 and '8 devices, 1 MiB' in c.note
  ms = float(ar.note.rsplit(', ', 1)[1].split()[0])
  assert ar.value == pytest.approx(diagnose.MIB * 2 * 7 / 8 / (ms / 1e3) / 1e9, rel=0.01)
  one = diagnose.check_collective('allreduce', devices[:1], diagnose.MIB)
  assert one.passed and one.value is None


def test_injected_allreduce_failure_makes_the_cli_exit_1(repo_root):
  env = dict(os.environ, **{DIAGNOSE_FAIL_ENV: 'allreduce'})
  proc = subprocess.run(
      [os.path.join(os.path.dirname(sys.executable), 'mjax-diagnose'), '--json', '--checks', 'memory,allreduce',
       '--cpu_memory_mib', '16', '--collective_mib', '1'],
      capture_output=True, text=True, cwd=repo_root, timeout=120, env=env)
  assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
  report = json.loads(proc.stdout)
  assert report['passed'] is False
  failed = [c['name'] for c in report['checks'] if not c['passed']]
  assert failed == ['allreduce_local'], report['checks']
  (ar,) = [c for c in report['checks'] if c['name'] == 'allreduce_local']
  assert ar['value'] > 0 and 'test only' in ar['note']
  assert [c['name'] for c in report['checks']].count('memory') == 8


def test_cli_passes_and_rejects_unknown_injected_names(monkeypatch, capsys):
  from mjax.cli import diagnose_main
  monkeypatch.delenv(DIAGNOSE_FAIL_ENV, raising=False)
  with pytest.raises(SystemExit) as e:
    diagnose_main(['--checks', 'memory', '--cpu_memory_mib', '8'])
  assert e.value.code == 0 and 'verdict: PASS' in capsys.readouterr().out
  monkeypatch.setenv(DIAGNOSE_FAIL_ENV, 'allredcue')
  with pytest.raises(SystemExit) as e:
    diagnose_main(['--checks', 'memory'])
  assert e.value.code == 2 and 'unknown check(s) allredcue' in capsys.readouterr().err
  monkeypatch.setenv(DIAGNOSE_FAIL_ENV, 'memory')
  with pytest.raises(SystemExit) as e:
    diagnose_main(['--checks', 'memory', '--cpu_memory_mib', '8'])
  out = capsys.readouterr().out
  assert e.value.code == 1 and 'FAIL: memory' in out and 'failing devices: 0-7' in out


def test_two_processes_also_check_the_collectives_across_them(repo_root, tmp_path):
  import socket
  with socket.socket() as s:
    s.bind(('localhost', 0))
    port = s.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if k not in ('XLA_FLAGS', DIAGNOSE_FAIL_ENV)}
  env.update(MJAX_COORDINATOR_ADDRESS=f'localhost:{port}', MJAX_NUM_PROCESSES='2', MJAX_LOCAL_DEVICE_COUNT='2')
  procs = [subprocess.Popen(
      [os.path.join(os.path.dirname(sys.executable), 'mjax-diagnose'), '--json', '--checks', 'allreduce,allgather',
       '--collective_mib', '1'],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=repo_root,
      env=dict(env, MJAX_PROCESS_ID=str(i))) for i in range(2)]
  try:
    outs = [p.communicate(timeout=90) for p in procs]
  finally:
    for p in procs:  # a hung collective must not outlive the test
      if p.poll() is None:
        p.kill()
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-2000:]
  reports = [json.loads(out) for out, _ in outs]
  assert [r['process'] for r in reports] == [0, 1]
  for r in reports:
    by_name = {c['name']: c for c in r['checks']}
    assert set(by_name) == {'allreduce_local', 'allgather_local', 'allreduce_global', 'allgather_global'}
    for kind in ('allreduce', 'allgather'):
      assert len(by_name[f'{kind}_global']['devices']) == 4 and by_name[f'{kind}_global']['value'] > 0
      # CPU devices: measured across processes only (see run_diagnostics).
      assert by_name[f'{kind}_local']['passed'] and 'skipped' in by_name[f'{kind}_local']['note']
