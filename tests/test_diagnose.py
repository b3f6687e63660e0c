"""Host health checks on the 8 fake CPU devices, and mjax-diagnose's verdicts.

The CPU here is shared with other work, so measured throughput is compared
with peaks written into a private cache (not the machine's own): the tests
check the mechanics, not this machine's speed.
"""

import json
import os
import subprocess
import sys
import time

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
  assert blob['suspect'] == [] and blob['timed_out'] is False and blob['skipped'] == []
  assert abs(blob['time'] - time.time()) < 60   # the host's clock, compared with the driver's
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


def test_injected_allreduce_failure_makes_the_cli_exit_1(repo_root, tmp_path):
  env = dict(os.environ, **{DIAGNOSE_FAIL_ENV: 'allreduce'})
  proc = subprocess.run(
      [os.path.join(os.path.dirname(sys.executable), 'mjax-diagnose'), '--json', '--checks', 'memory,allreduce',
       '--cpu_memory_mib', '16', '--collective_mib', '1', '--cache_dir', str(tmp_path)],
      capture_output=True, text=True, cwd=repo_root, timeout=120, env=env)
  assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
  report = json.loads(proc.stdout)
  assert report['passed'] is False
  failed = [c['name'] for c in report['checks'] if not c['passed']]
  assert failed == ['allreduce_local'], report['checks']
  (ar,) = [c for c in report['checks'] if c['name'] == 'allreduce_local']
  assert ar['value'] > 0 and 'test only' in ar['note']
  assert [c['name'] for c in report['checks']].count('memory') == 8
  assert report['suspect'] == [] and report['timed_out'] is False
  assert not (tmp_path / diagnose.BASELINE_FILE).exists()       # an injected run teaches the baseline nothing


def test_cli_passes_and_rejects_unknown_injected_names(monkeypatch, capsys):
  from mjax.cli import diagnose_main
  monkeypatch.delenv(DIAGNOSE_FAIL_ENV, raising=False)
  with pytest.raises(SystemExit) as e:
    diagnose_main(['--checks', 'memory', '--cpu_memory_mib', '8', '--no_baseline'])
  assert e.value.code == 0 and 'verdict: PASS' in capsys.readouterr().out
  monkeypatch.setenv(DIAGNOSE_FAIL_ENV, 'allredcue')
  with pytest.raises(SystemExit) as e:
    diagnose_main(['--checks', 'memory'])
  assert e.value.code == 2 and 'unknown check(s) allredcue' in capsys.readouterr().err
  monkeypatch.setenv(DIAGNOSE_FAIL_ENV, 'memory,hang:memroy')
  with pytest.raises(SystemExit) as e:
    diagnose_main(['--checks', 'memory'])
  assert e.value.code == 2 and 'unknown check(s) hang:memroy' in capsys.readouterr().err
  monkeypatch.setenv(DIAGNOSE_FAIL_ENV, 'memory')
  with pytest.raises(SystemExit) as e:
    diagnose_main(['--checks', 'memory', '--cpu_memory_mib', '8', '--no_baseline'])
  out = capsys.readouterr().out
  assert e.value.code == 1 and 'FAIL: memory' in out and 'failing devices: 0-7' in out
  # No check at all would always pass; a deadline past what a wait takes crashed.
  for argv, said in [(['--checks', ''], "--checks '': no check named"),
                     (['--checks', ',,'], "--checks '': no check named"),
                     (['--checks', 'memory,matmull'], 'unknown check(s) matmull'),
                     (['--check_timeout_s', '1e12'], 'is too large'),
                     (['--check_timeout_s', 'nan'], 'must be >= 0 and --check_timeout_s nan > 0'),
                     (['--cpu_memory_mib', '0'], '--cpu_memory_mib 0: give at least 1 MiB'),
                     # The baseline was written into the working directory.
                     (['--cache_dir', ''], "--cache_dir '' names no folder"),
                     (['--collective_mib', '-3'], '--collective_mib -3: give at least 1 MiB'),
                     # Beyond the host's memory: XLA aborted, or the host failed as out of memory.
                     (['--checks', 'memory', '--cpu_memory_mib', str(10**12)],
                      f'--cpu_memory_mib {10**12}: more than this host\'s memory'),
                     (['--checks', 'allreduce', '--collective_mib', str(10**9)],
                      f'--collective_mib {10**9}: more than this host\'s memory')]:
    with pytest.raises(SystemExit) as e:
      diagnose_main(argv)
    assert e.value.code == 2 and said in capsys.readouterr().err, argv


def test_two_processes_also_check_the_collectives_across_them(repo_root, tmp_path):
  import socket
  with socket.socket() as s:
    s.bind(('localhost', 0))
    port = s.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if k not in ('XLA_FLAGS', DIAGNOSE_FAIL_ENV)}
  env.update(MJAX_COORDINATOR_ADDRESS=f'localhost:{port}', MJAX_NUM_PROCESSES='2', MJAX_LOCAL_DEVICE_COUNT='2')
  procs = [subprocess.Popen(
      [os.path.join(os.path.dirname(sys.executable), 'mjax-diagnose'), '--json', '--checks', 'allreduce,allgather',
       '--collective_mib', '1', '--cache_dir', str(tmp_path)],
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
  # Both processes wrote the one baseline file; it holds both global figures.
  saved = json.load(open(tmp_path / diagnose.BASELINE_FILE))
  assert sorted(k.split('|')[2] for k in saved) == ['allgather_global', 'allreduce_global']


# ----------------------------------------------------------------------------
# Verdicts that load cannot fool: own baseline, repeats, suspect, deadline
# ----------------------------------------------------------------------------

MATMUL = dict(checks=('matmul',), dtypes=('float32',))


def _saved(cache_dir):
  with open(os.path.join(cache_dir, diagnose.BASELINE_FILE)) as fh:
    return json.load(fh)


def test_baseline_is_written_by_a_passing_run_and_expected_on_the_next(tmp_path, monkeypatch):
  monkeypatch.delenv(DIAGNOSE_FAIL_ENV, raising=False)
  cache = _cache(tmp_path, 1e-4)
  first = diagnose.run_diagnostics(checks=('matmul', 'allreduce'), dtypes=('float32',), cache_dir=cache, **SMALL)
  assert first.passed and 'measured peak' in first.checks[0].note
  saved = _saved(cache)
  key = diagnose.Baseline.key('matmul_float32', 'cpu', 'n=1024')
  assert saved[key]['value'] == first.checks[0].value and saved[key]['unit'] == 'TFLOP/s'
  assert key.split('|')[0] == first.host and key.endswith(f'jax {jax.__version__}')
  assert any('|allreduce_local|1048576 bytes x 8 devices|' in k for k in saved)
  # The next run expects a share of the host's own best, not the cached peak
  # (this one may pass or not: the CPU is shared, only the figure is checked).
  second = diagnose.run_diagnostics(min_fraction=0.4, cache_dir=cache, **MATMUL, **SMALL)
  (c,) = second.checks
  assert c.expected == pytest.approx(0.4 * saved[key]['value'])
  assert 'own baseline' in c.note and saved[key]['measured'][:10] in c.note
  best = _saved(cache)[key]['value']
  assert best == max(saved[key]['value'], c.value if c.passed else 0)
  # Neither a run with injected faults nor one that opted out writes it.
  monkeypatch.setenv(DIAGNOSE_FAIL_ENV, 'memory')
  diagnose.run_diagnostics(min_fraction=0.01, cache_dir=cache, **MATMUL, **SMALL)
  monkeypatch.delenv(DIAGNOSE_FAIL_ENV)
  assert _saved(cache)[key]['value'] == best
  diagnose.run_diagnostics(baseline=False, cache_dir=str(tmp_path / 'none'), **MATMUL, **SMALL)
  assert not (tmp_path / 'none').exists()


def test_baseline_writers_merge_and_failing_checks_record_nothing(tmp_path):
  one, two = diagnose.Baseline(str(tmp_path)), diagnose.Baseline(str(tmp_path))
  one.record('a', 1.0, 'GB/s')
  two.record('a', 0.5, 'GB/s')
  two.record('b', 2.0, 'GB/s')
  one.save()
  two.save()   # re-reads first: keeps one's better 'a'
  saved = _saved(str(tmp_path))
  assert {k: v['value'] for k, v in saved.items()} == {'a': 1.0, 'b': 2.0}
  assert os.listdir(tmp_path) == [diagnose.BASELINE_FILE]     # no temporary file left
  (tmp_path / diagnose.BASELINE_FILE).write_text('{"a": ')      # damaged: read as empty
  assert diagnose.Baseline(str(tmp_path)).entries == {}
  base = diagnose.Baseline(str(tmp_path / 'b'))
  (c,) = diagnose.check_matmul(jax.local_devices(), 'float32', 0.5, _cache(tmp_path, 1e6), seconds=0.02,
                               repeats=0, baseline=base)
  assert not c.passed and base.recorded == {}


def test_a_slow_first_try_passes_on_the_repeat(tmp_path, monkeypatch):
  monkeypatch.delenv(DIAGNOSE_FAIL_ENV, raising=False)
  monkeypatch.setenv(diagnose.LOADAVG_ENV, '0')   # idle: a shortfall fails, never suspect
  cache = str(tmp_path)
  # No figure yet: this run sets the baseline, timed longer to be near the
  # best this CPU does.
  assert diagnose.run_diagnostics(cache_dir=cache, **MATMUL, **dict(SMALL, seconds=0.3)).passed
  saved = _saved(cache)
  # A tenth of the first try falls below 30% of the best; the second try,
  # unslowed, passes (either holds within a factor 3 of the baseline, as
  # the shared CPU's speed wanders).
  monkeypatch.setenv(DIAGNOSE_FAIL_ENV, 'slow:matmul')
  report = diagnose.run_diagnostics(min_fraction=0.3, cache_dir=cache, **MATMUL, **SMALL)
  (c,) = report.checks
  assert report.passed and c.passed and not c.suspect, c
  assert 'best of 2 tries' in c.note and 'first try slowed 10x' in c.note
  assert _saved(cache) == saved
  # Without a repeat the slowed try stands, and fails the host.
  report = diagnose.run_diagnostics(min_fraction=0.5, cache_dir=cache, repeats=0, **MATMUL, **SMALL)
  (c,) = report.checks
  assert not report.passed and not c.passed and 'tries' not in c.note, c


def test_persistent_slowness_is_suspect_on_a_loaded_host_and_fails_on_an_idle_one(tmp_path, monkeypatch):
  monkeypatch.delenv(DIAGNOSE_FAIL_ENV, raising=False)
  cache = _cache(tmp_path, 1e6)   # a peak no CPU reaches: every try falls short
  monkeypatch.setenv(diagnose.LOADAVG_ENV, str(100 * os.cpu_count()))
  report = diagnose.run_diagnostics(cache_dir=cache, repeats=1, **MATMUL, **SMALL)
  (c,) = report.checks
  assert c.suspect and not c.passed and 'best of 2 tries' in c.note and 'host loaded' in c.note, c
  assert report.passed and report.suspect == ['matmul_float32'] and not report.failed
  assert all(report.devices.values())
  blob = report.to_json()
  assert blob['passed'] is True and blob['suspect'] == ['matmul_float32'] and blob['checks'][0]['suspect']
  assert 'suspect under load: matmul_float32' in diagnose.format_report(report)
  assert not (tmp_path / diagnose.BASELINE_FILE).exists()        # a suspect value is no baseline
  # A forced failure is never excused by load.
  monkeypatch.setenv(DIAGNOSE_FAIL_ENV, 'matmul')
  report = diagnose.run_diagnostics(cache_dir=cache, repeats=0, **MATMUL, **SMALL)
  assert not report.passed and not report.checks[0].suspect
  monkeypatch.delenv(DIAGNOSE_FAIL_ENV)
  # The same shortfall on an idle host fails it.
  monkeypatch.setenv(diagnose.LOADAVG_ENV, '0')
  report = diagnose.run_diagnostics(cache_dir=cache, repeats=1, **MATMUL, **SMALL)
  (c,) = report.checks
  assert not c.suspect and not c.passed and not report.passed and report.to_json()['suspect'] == []
  assert not any(report.devices.values())


def test_wrong_results_and_errors_are_never_suspect_nor_repeated(monkeypatch):
  monkeypatch.delenv(DIAGNOSE_FAIL_ENV, raising=False)
  monkeypatch.setenv(diagnose.LOADAVG_ENV, str(100 * os.cpu_count()))
  calls = []

  def wrong():
    calls.append(1)
    return 1.0, False, ''

  def broken():
    calls.append(1)
    raise RuntimeError('device lost')

  c = diagnose._timed('allreduce_local', [0, 1], 2.0, 'GB/s', 'link', wrong, repeats=2)
  assert not c.passed and not c.suspect and 'WRONG RESULT' in c.note and len(calls) == 1
  c = diagnose._timed('allreduce_local', [0, 1], 2.0, 'GB/s', 'link', broken, repeats=2)
  assert not c.passed and not c.suspect and 'device lost' in c.note and len(calls) == 2
  # Only the load of other work counts: this process's own is taken off.
  assert diagnose.host_load({diagnose.LOADAVG_ENV: '0'}) == (0.0, os.cpu_count())
  assert diagnose.own_load() >= 0


def test_a_hung_check_times_out_and_the_rest_are_not_run(tmp_path, monkeypatch):
  monkeypatch.setenv(DIAGNOSE_FAIL_ENV, 'hang:matmul')   # its thread blocks for good, a daemon
  t0 = time.monotonic()
  report = diagnose.run_diagnostics(checks=('matmul', 'memory'), dtypes=('float32',), cache_dir=str(tmp_path),
                                    check_timeout_s=1, **SMALL)
  assert time.monotonic() - t0 < 10
  assert report.timed_out and not report.passed and report.skipped == ['memory']
  (c,) = report.checks
  assert c.name == 'matmul_float32' and not c.passed and c.note.startswith('timed out after 1s')
  assert not any(report.devices.values())
  text = diagnose.format_report(report)
  assert 'FAIL: matmul_float32 (timed out)' in text and 'not run' in text


def test_a_hung_check_gives_a_verdict_through_the_cli(repo_root, tmp_path):
  env = dict(os.environ, **{DIAGNOSE_FAIL_ENV: 'hang:memory'})
  t0 = time.monotonic()
  proc = subprocess.run(
      [os.path.join(os.path.dirname(sys.executable), 'mjax-diagnose'), '--json', '--check_timeout_s', '5',
       '--checks', 'memory,allreduce', '--cpu_memory_mib', '16', '--collective_mib', '1',
       '--cache_dir', str(tmp_path)],
      capture_output=True, text=True, cwd=repo_root, timeout=60, env=env)
  wall = time.monotonic() - t0
  assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
  report = json.loads(proc.stdout)
  assert report['passed'] is False and report['timed_out'] is True and report['skipped'] == ['allreduce_local']
  (memory,) = report['checks']
  assert memory['name'] == 'memory' and memory['note'].startswith('timed out after 5s')
  assert 5 <= memory['seconds'] < 6 and wall < 5 + 20    # the deadline, plus starting Python and JAX
