"""Straggler detection on synthetic timing rows, and the report's outputs.

The synthetic rows follow what a synchronous multi-process run writes (see
mjax/ft/stragglers.py): every step ends in a collective, so all processes
share the step's wall time, and a process with extra host work ends its
steps that much after the others.
"""

import collections
import json
import math
import os

import numpy as np
import pytest

from mjax import report
from mjax.ft import stragglers as st
from mjax.ft import timeline

T0 = 1.7e9


def lockstep_rows(n=8, steps=60, slow=None, factor=1.3, slow_from=1, slow_phase='after', noise=0.03,
                  pause=None, checkpoint_every=20, seed=0):
  """Rows of a synchronous run.

  Args:
    n: processes.
    steps: steps.
    slow: a process with (factor - 1) x the step's compute of extra host
      work per step from step `slow_from` on: after the step's collective
      (slow_phase 'after') or in its data phase, before it ('data').
    noise: relative noise of the step time (common) and of each process's
      end time (jitter), as a standard deviation.
    pause: (process, step, seconds): one long pause of one process (a GC
      pause, say), once.
    checkpoint_every: every so many steps all processes save, and process 0
      spends an extra half second on it.
  """
  rng = np.random.default_rng(seed)
  end = np.full(n, T0)   # when each process ended the previous step
  rows = []
  for s in range(1, steps + 1):
    compute = 1.0 * (1 + noise * rng.standard_normal())
    data = 0.01 * (1 + 0.1 * rng.standard_normal(n))
    if slow is not None and s >= slow_from and slow_phase == 'data':
      data[slow] += (factor - 1) * compute
    # The step's collective completes when the last process has arrived at it.
    done = np.max(end + data + compute)
    # Host work after it: a straggler's extra, a pause, a checkpoint.
    after = np.zeros(n)
    if slow is not None and s >= slow_from and slow_phase == 'after':
      after[slow] = (factor - 1) * compute
    if pause is not None and s == pause[1]:
      after[pause[0]] += pause[2]
    ckpt = np.zeros(n)
    if checkpoint_every and s % checkpoint_every == 0:
      ckpt[:] = 0.2
      ckpt[0] += 0.5
    new_end = done + after + ckpt + np.abs(noise * 0.2 * rng.standard_normal(n))
    for p in range(n):
      dur = new_end[p] - end[p]
      phases = {'data': round(data[p], 6), 'compute': round(dur - data[p] - ckpt[p], 6)}
      if ckpt[p]:
        phases['checkpoint'] = round(ckpt[p], 6)
      rows.append({'step': s, 'process': p, 'host': f'node-{p // 4}', 'time': float(new_end[p]),
                   'phases': phases})
    end = new_end
  return rows


def independent_rows(n=8, steps=60, slow=3, factor=1.3, seed=0):
  """Rows of processes not held in step (each runs at its own pace)."""
  rng = np.random.default_rng(seed)
  rows, t = [], np.full(n, T0)
  for s in range(1, steps + 1):
    dur = 1.0 * (1 + 0.03 * rng.standard_normal(n))
    dur[slow] *= factor
    t = t + dur
    rows += [{'step': s, 'process': p, 'host': 'h', 'time': float(t[p]),
              'phases': {'data': 0.01, 'compute': float(dur[p] - 0.01)}} for p in range(n)]
  return rows


def upto(rows, step):
  return [r for r in rows if r['step'] <= step]


def first_flag(rows, margin=0.2, window=20):
  """The first step at which a driver polling every step would flag, and whom."""
  last = max(r['step'] for r in rows)
  for s in range(1, last + 1):
    found = st.find_stragglers(upto(rows, s), margin, window)
    if found:
      return s, [f.process for f in found]
  return None, []


@pytest.mark.parametrize('seed', range(4))
def test_clean_run_flags_nobody(seed):
  rows = lockstep_rows(n=8, steps=120, seed=seed, noise=0.05)
  assert first_flag(rows) == (None, [])
  assert {e['verdict'] for e in st.summary_table(rows)} == {'ok'}


def test_slow_process_is_flagged_within_a_few_dozen_steps():
  rows = lockstep_rows(n=8, steps=80, slow=5, factor=1.3, slow_from=30)
  step, who = first_flag(rows)
  assert who == [5]
  assert 30 < step <= 30 + 20, step      # within one window of turning slow
  (s,) = st.find_stragglers(rows, 0.2, 20)
  assert s.host == 'node-1' and 0.2 < s.slowdown < 0.45 and s.slow_share >= 0.8
  assert s.last_step == 80 and s.first_step == 61
  assert 'process 5 on node-1' in s.describe()
  # Its step time is everybody's; what gives it away is that it ends last.
  assert abs(s.ratio - 1) < 0.1 and s.lateness > 0.2


def test_slow_input_is_flagged_by_its_data_phase():
  # Slow before the collective: everybody waits for it and ends together,
  # and it is the only one whose data phase takes a third of a step.
  rows = lockstep_rows(n=8, steps=40, slow=6, factor=1.35, slow_phase='data')
  (s,) = st.find_stragglers(rows, 0.2, 20)
  assert s.process == 6 and s.reason == 'data' and abs(s.lateness) < 0.05
  assert 'longer data phase' in s.describe()


def test_slow_process_is_flagged_by_its_step_time_when_not_in_lockstep():
  rows = independent_rows(n=8, steps=20, slow=3, factor=1.3)
  (s,) = st.find_stragglers(rows, 0.2, 20)
  assert s.process == 3 and s.ratio == pytest.approx(1.3, abs=0.05)


def test_two_processes_the_slow_one_is_compared_with_the_other():
  (s,) = st.find_stragglers(lockstep_rows(n=2, steps=40, slow=1, factor=1.3), 0.2, 20)
  assert s.process == 1


def test_a_single_slow_step_does_not_flag():
  rows = lockstep_rows(n=8, steps=100, pause=(4, 45, 3.0))
  assert first_flag(rows) == (None, [])


def test_too_few_steps_or_one_process_gives_no_verdict():
  rows = lockstep_rows(n=8, steps=15, slow=2)
  assert st.find_stragglers(rows, 0.2, 20) == []
  assert {e['verdict'] for e in st.summary_table(rows, window=20)} == {'n/a'}
  one = [r for r in lockstep_rows(n=4, steps=40, slow=0) if r['process'] == 0]
  assert st.find_stragglers(one, 0.2, 20) == []
  with pytest.raises(ValueError, match='margin'):
    st.find_stragglers(rows, 0.0, 20)


def _write(workdir, rows, truncated_tail=False):
  os.makedirs(workdir / 'timings', exist_ok=True)
  for p in sorted({r['process'] for r in rows}):
    with open(workdir / 'timings' / f'process-{p:05d}.jsonl', 'a') as fh:
      fh.writelines(json.dumps(r) + '\n' for r in rows if r['process'] == p)
      if truncated_tail:
        fh.write('{"step": 99, "process"')  # a crash mid-line


def test_load_keeps_the_last_row_of_a_step_written_twice(tmp_path):
  first = lockstep_rows(n=3, steps=30, seed=1)
  # Resumed from a step-20 checkpoint: steps 21-40 are appended again, later.
  again = [dict(r, time=r['time'] + 1000.0) for r in lockstep_rows(n=3, steps=40, seed=2) if r['step'] > 20]
  _write(tmp_path, first, truncated_tail=True)
  _write(tmp_path, again)
  rows = st.load_rows(str(tmp_path))
  assert len(rows) == 3 * 40
  assert [(r['process'], r['step']) for r in rows] == [(p, s) for p in range(3) for s in range(1, 41)]
  by_key = {(r['process'], r['step']): r for r in rows}
  assert by_key[(1, 25)]['time'] > T0 + 1000 and by_key[(1, 20)]['time'] < T0 + 1000
  assert st.dedupe_rows(first + again) == rows
  # A poller reads only the ends of the files: the latest steps, whole.
  tail = st.load_rows(str(tmp_path), tail_bytes=2000)
  assert 0 < len(tail) < len(rows) and all(r['step'] > 20 for r in tail)
  assert all(r == by_key[(r['process'], r['step'])] for r in tail)


def test_an_earlier_attempts_steps_past_a_resume_are_not_the_runs_latest(tmp_path, capsys):
  # Steps 1-70, then a restart from the step-50 checkpoint that has reached
  # step 60: steps 61-70 of the first attempt are no part of the run any more.
  first = lockstep_rows(n=2, steps=70, seed=1)
  again = [dict(r, time=r['time'] + 1000.0) for r in lockstep_rows(n=2, steps=60, seed=2) if r['step'] > 50]
  _write(tmp_path, first)
  _write(tmp_path, again)
  for rows in (st.load_rows(str(tmp_path)), st.load_rows(str(tmp_path), last=30)):
    assert max(r['step'] for r in rows) == 60
    assert all(r['time'] > T0 + 1000 for r in rows if r['step'] > 50)
  assert report.main(['stragglers', str(tmp_path), '--out', str(tmp_path / 'out')]) == 0
  assert '2 process(es), 60 step(s)' in capsys.readouterr().out


def test_trace_has_one_event_per_process_step_and_phase(tmp_path):
  rows = lockstep_rows(n=3, steps=25, slow=2)
  path = timeline.write_trace(rows, str(tmp_path / 'trace.json'))
  with open(path) as fh:
    trace = json.load(fh)
  events = trace['traceEvents']
  spans = [e for e in events if e['ph'] == 'X']
  expected = {(r['process'], r['step'], ph) for r in rows for ph in r['phases']}
  assert sorted((e['pid'], e['args']['step'], e['name']) for e in spans) == sorted(expected)
  assert {e['pid']: e['args']['name'] for e in events if e['name'] == 'process_name'} == {
      0: 'process 0 (node-0)', 1: 'process 1 (node-0)', 2: 'process 2 (node-0)'}
  # One time axis: each process's phases follow one another and end at the row's end time.
  origin = trace['otherData']['unix_time_origin']
  for p in range(3):
    mine = sorted((e for e in spans if e['pid'] == p), key=lambda e: e['ts'])
    assert all(e['dur'] >= 0 for e in mine)
    assert all(a['ts'] + a['dur'] <= b['ts'] + 1 for a, b in zip(mine, mine[1:]))
    last = [r for r in rows if r['process'] == p][-1]
    assert (mine[-1]['ts'] + mine[-1]['dur']) / 1e6 + origin == pytest.approx(last['time'], abs=1e-4)


def test_report_stragglers_prints_table_and_writes_heatmap_and_trace(tmp_path, capsys):
  _write(tmp_path, lockstep_rows(n=6, steps=40, slow=4, factor=1.4))
  assert report.main(['stragglers', str(tmp_path), '--out', str(tmp_path / 'out')]) == 0
  out = capsys.readouterr().out
  lines = {l.split()[0]: l for l in out.splitlines() if l.strip() and l.split()[0].isdigit()}
  assert 'straggler' in lines['4'] and all('ok' in lines[str(p)] for p in (0, 1, 2, 3, 5))
  assert 'straggler: process 4 on node-1' in out
  with open(tmp_path / 'out' / 'stragglers.png', 'rb') as fh:
    assert fh.read(8) == b'\x89PNG\r\n\x1a\n'
  assert json.load(open(tmp_path / 'out' / 'trace.json'))['traceEvents']


def test_a_timing_file_with_no_readable_row_is_said_not_silently_dropped(tmp_path, capsys):
  _write(tmp_path, lockstep_rows(n=3, steps=30, seed=2))
  with open(tmp_path / 'timings' / 'process-00001.jsonl', 'wb') as fh:
    fh.write(os.urandom(2000).replace(b'\n', b' '))    # overwritten with garbage
  assert report.main(['stragglers', str(tmp_path), '--out', str(tmp_path / 'out')]) == 0
  err = capsys.readouterr().err
  assert ('process-00001.jsonl in ' in err and 'hold(s) no readable timing row' in err and
          '1 process(es) left out of the analysis' in err), err


def test_report_stragglers_explains_a_missing_timings_folder(tmp_path, capsys):
  assert report.main(['stragglers', str(tmp_path)]) == 2
  assert capsys.readouterr().err.startswith('mjax-report stragglers: error: no timing files')


def test_foreign_or_damaged_timing_rows_are_skipped_and_bad_options_named(tmp_path, capsys):
  rows = lockstep_rows(n=2, steps=30, seed=1)
  _write(tmp_path, rows)
  with open(tmp_path / 'timings' / 'process-00001.jsonl', 'a') as fh:
    for bad in ['{"step": "abc", "process": 1, "time": 1.0, "phases": {}}',
                '{"step": 31, "process": 1, "time": 1.0, "phases": [1, 2]}',
                '{"step": 1e400, "process": 1, "time": 1.0, "phases": {}}',
                '{"step": 32, "process": 1, "time": NaN, "phases": {}}',
                '{"step": 33, "process": 1, "time": 1.0, "phases": {"data": "x"}}',
                '{"step": 34, "process": true, "time": 1.0, "phases": {}}', '[1, 2]']:
      fh.write(bad + '\n')
  os.makedirs(tmp_path / 'timings' / 'process-00005.jsonl')        # a directory by that name
  assert st.load_rows(str(tmp_path)) == st.dedupe_rows(rows)
  tail = st.TimingTail(str(tmp_path), keep=48, from_end=False)    # the driver's watch
  assert len(tail.update()) == len(rows)
  assert report.main(['stragglers', str(tmp_path), '--margin', 'nan']) == 2
  assert '--margin nan must be a number > 0' in capsys.readouterr().err
  (tmp_path / 'afile').write_text('x')
  assert report.main(['stragglers', str(tmp_path), '--out', str(tmp_path / 'afile')]) == 2
  assert 'give --out a directory' in capsys.readouterr().err
  # Not into a run's checkpoint directory, nor into a saved step of it.
  from mjax.checkpoint.directories import OWNER_FILE
  (tmp_path / 'checkpoints' / '40' / 'state').mkdir(parents=True)
  (tmp_path / 'checkpoints' / OWNER_FILE).write_text('{"workdir": "."}')
  for inside in ('', '40'):
    assert report.main(['stragglers', str(tmp_path), '--out', str(tmp_path / 'checkpoints' / inside)]) == 2
    assert 'holds its steps and nothing else' in capsys.readouterr().err
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['.mjax-run.json', '40']
  assert os.listdir(tmp_path / 'checkpoints' / '40') == ['state']
  empty = tmp_path / 'empty'
  os.makedirs(empty / 'timings')
  (empty / 'timings' / 'process-00000.jsonl').write_text('')
  assert report.main(['stragglers', str(empty)]) == 2
  assert 'hold no complete row' in capsys.readouterr().err


# --- device time of sampled steps: a rank slowed inside the step -------------------

def with_device_samples(rows, every=10, slow=None, factor=1.5, seed=0, stall=0.0):
  """Adds what DeviceSampler records every `every` steps: each process's
  device time in compute kernels and in collectives. The step's compute is
  the same 0.8 s everywhere but on `slow`, which takes `factor` x as long,
  or whose device starts `stall` s late (its host stalled: its kernels take
  no longer); everyone else waits that difference out inside the step's
  collectives."""
  rng = np.random.default_rng(seed)
  out = []
  for r in rows:
    r = dict(r)
    if r['step'] % every == 0:
      n = 1 + max(x['process'] for x in rows)
      base = 0.8 * (1 + 0.03 * rng.standard_normal(n))
      compute = base.copy()
      if slow is not None:
        compute[slow] *= factor
      arrive = compute + 0.02
      if slow is not None:
        arrive[slow] += stall
      wait = np.max(arrive) - arrive + 0.05      # the collective itself, plus waiting for the last
      r['device'] = {'compute': float(compute[r['process']]), 'collective': float(wait[r['process']])}
    out.append(r)
  return out


def test_a_rank_slowed_inside_the_step_is_named_by_its_device_time():
  # Host timings cannot see it: every process ends each step together.
  rows = with_device_samples(lockstep_rows(n=4, steps=60, seed=3), slow=2, factor=1.5)
  assert st._host_stragglers(st.dedupe_rows(rows), 0.2, 20, 0.8) == []
  (found,) = st.find_stragglers(rows, margin=0.2, window=20)
  assert found.process == 2 and found.reason == 'device'
  assert 0.3 < found.slowdown < 0.7 and 1.4 < found.ratio < 1.6   # 0.4 s more, in a step of 0.85 s
  assert (found.first_step, found.last_step) == (40, 60)
  assert 'the others wait' in found.describe() and 'process 2' in found.describe()
  # The report's table shows the device columns and the verdict.
  text = st.format_table(st.summary_table(rows))
  assert 'device compute' in text and 'straggler (+' in text.splitlines()[4] and 'device)' in text


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_device_samples_of_a_clean_run_flag_nobody(seed):
  rows = with_device_samples(lockstep_rows(n=8, steps=60, seed=seed), seed=seed)
  assert st.find_stragglers(rows) == []


def test_a_device_verdict_needs_three_samples_and_two_processes():
  rows = with_device_samples(lockstep_rows(n=4, steps=60, seed=3), slow=2, factor=1.5)
  assert st.device_stragglers(upto(rows, 29)) == []                  # samples at 10 and 20 only
  assert [s.process for s in st.device_stragglers(upto(rows, 30))] == [2]
  one = [r for r in rows if r['process'] == 2]
  assert st.device_stragglers(one) == []
  # One slow sample (a rank that paid for something once) is not a straggler.
  once = [dict(r, device={**r['device'], 'compute': r['device']['compute'] * 1.5})
          if 'device' in r and r['process'] == 1 and r['step'] == 50 else r
          for r in with_device_samples(lockstep_rows(n=4, steps=60, seed=4))]
  assert st.find_stragglers(once) == []


def with_gpu_samples(rows, gpus, slow=None, every=10, factor=1.5, seed=0, stall=None, stages=None):
  """As `with_device_samples`, each process with `gpus` GPUs sampled one by
  one ('devices'); `slow` is a (process, gpu) whose kernels take `factor` x
  as long, which every other GPU of the job waits out in the collectives;
  `stall` a process whose GPUs all start 0.4 s late (its host stalled).
  `stages` (gpu -> pipeline stage) marks each GPU's stage; the last stage
  computes 1.3 x (the head and the loss) in every step.
  The process's own split is its slowest GPU's, as DeviceSampler records."""
  rng = np.random.default_rng(seed)
  n = 1 + max(x['process'] for x in rows)
  draws = {}
  out = []
  for r in rows:
    r = dict(r)
    if r['step'] % every == 0:
      if r['step'] not in draws:
        compute = 0.8 * (1 + 0.03 * rng.standard_normal((n, gpus)))
        if stages is not None:
          last = max(stages(g) for g in range(gpus))
          compute[:, [stages(g) == last for g in range(gpus)]] *= 1.3
        if slow is not None:
          compute[slow] *= factor
        arrive = compute + 0.02
        if stall is not None:
          arrive[stall] += 0.4
        draws[r['step']] = (compute, arrive.max() - arrive + 0.05)
      compute, wait = draws[r['step']]
      p = r['process']
      per = {str(g): {'compute': float(compute[p, g]), 'collective': float(wait[p, g])} for g in range(gpus)}
      if stages is not None:
        for g in range(gpus):
          per[str(g)]['stage'] = stages(g)
      worst = max(per, key=lambda g: per[g]['compute'])
      r['device'] = {**per[worst], 'devices': per}
    out.append(r)
  return out


def test_one_slow_gpu_among_a_hosts_eight_is_named():
  rows = with_gpu_samples(lockstep_rows(n=2, steps=60, seed=5), gpus=8, slow=(1, 5))
  (found,) = st.find_stragglers(rows)
  assert (found.process, found.device, found.reason) == (1, 5, 'device')
  assert 0.4 < found.slowdown < 0.6 and 1.4 < found.ratio < 1.6
  assert 'process 1 on' in found.describe() and '(its device 5):' in found.describe()
  assert st.Straggler(**found.to_json()) == found                  # as the driver hands it over
  text = st.format_table(st.summary_table(rows))
  assert 'straggler (+' in text.splitlines()[3] and 'device 5)' in text.splitlines()[3]
  # A single-process job of eight GPUs: its GPUs are the ranks.
  one = [r for r in with_gpu_samples(lockstep_rows(n=2, steps=60, seed=6), gpus=8, slow=(0, 2))
         if r['process'] == 0]
  assert [(s.process, s.device) for s in st.find_stragglers(one)] == [(0, 2)]


def test_report_names_the_slow_gpu_of_a_single_process_job(tmp_path, capsys):
  rows = with_gpu_samples(lockstep_rows(n=2, steps=60, seed=6), gpus=4, slow=(0, 2))
  _write(tmp_path, [r for r in rows if r['process'] == 0])
  assert report.main(['stragglers', str(tmp_path), '--out', str(tmp_path / 'out')]) == 0
  out = capsys.readouterr().out
  assert 'nothing to compare' not in out and 'straggler: process 0 on node-0 (its device 2):' in out
  (by_device,) = [l for l in out.splitlines() if 'by device' in l]
  cells = by_device.split(': ', 1)[1].split(', ')
  assert [c.split()[0] for c in cells] == ['0', '1', '2*', '3']
  compute = [float(c.split()[1].split('/')[0]) for c in cells]
  assert compute[2] > 1.4 * max(compute[:2] + compute[3:])
  # Without the slow GPU: judged, and clean.
  clean = tmp_path / 'clean'
  _write(clean, [r for r in with_gpu_samples(lockstep_rows(n=2, steps=60, seed=6), gpus=4) if r['process'] == 0])
  assert report.main(['stragglers', str(clean), '--out', str(clean / 'out')]) == 0
  out = capsys.readouterr().out
  assert 'no straggler.' in out and 'nothing to compare' not in out and ' ok' in out.splitlines()[4]


def test_a_stalled_host_is_named_as_a_whole_not_by_one_of_its_gpus():
  rows = with_gpu_samples(lockstep_rows(n=2, steps=60, seed=5), gpus=8, stall=1)
  (found,) = st.find_stragglers(rows)
  assert (found.process, found.device) == (1, None) and 'process 1 on node-0:' in found.describe()


def test_a_damaged_device_sample_costs_the_sample_not_the_report(tmp_path, capsys):
  rows = with_gpu_samples(lockstep_rows(n=3, steps=60, seed=5), gpus=4, slow=(1, 2))
  bad = [{'compute': 'x', 'collective': 0.1}, {'compute': 1.0, 'collective': 0.1, 'devices': {'a': {}}},
         {'compute': 1.0, 'collective': 0.1, 'devices': {'0': {'compute': None, 'collective': 0.1}}},
         {'compute': 1.0, 'collective': 0.1, 'devices': []}, [1, 2]]
  hit = [r for r in rows if r['process'] == 0 and 'device' in r][:len(bad)]
  for r, d in zip(hit, bad):
    r['device'] = d
  _write(tmp_path, rows)
  loaded = st.load_rows(str(tmp_path))
  assert [r['step'] for r in loaded if r['process'] == 0 and 'device' in r] == [60]
  assert len([r for r in loaded if 'device' in r]) == len([r for r in rows if 'device' in r]) - len(bad)
  assert report.main(['stragglers', str(tmp_path), '--out', str(tmp_path / 'out')]) == 0
  assert 'straggler: process 1' in capsys.readouterr().out


def test_gpus_are_compared_within_their_pipeline_stage():
  # Four stages of two GPUs per host: the last stage's GPUs always compute
  # longer, and are no stragglers; a slow GPU of stage 1 is.
  stages = lambda g: g // 2
  clean = with_gpu_samples(lockstep_rows(n=2, steps=60, seed=7), gpus=8, stages=stages)
  assert st.find_stragglers(clean) == []
  slow = with_gpu_samples(lockstep_rows(n=2, steps=60, seed=7), gpus=8, stages=stages, slow=(0, 3))
  assert [(s.process, s.device) for s in st.find_stragglers(slow)] == [(0, 3)]
  # One process, a stage per GPU: nothing of the same stage to compare with.
  one = [r for r in with_gpu_samples(lockstep_rows(n=2, steps=60, seed=7), gpus=8, stages=lambda g: g, slow=(0, 3))
         if r['process'] == 0]
  assert st.find_stragglers(one) == [] and st.device_compare(one) is None


@pytest.mark.parametrize('seed', [0, 1])
def test_gpu_samples_of_a_clean_run_flag_nobody(seed):
  assert st.find_stragglers(with_gpu_samples(lockstep_rows(n=4, steps=60, seed=seed), gpus=8, seed=seed)) == []
  one = [r for r in with_gpu_samples(lockstep_rows(n=2, steps=60, seed=seed), gpus=8, seed=seed)
         if r['process'] == 0]
  assert st.find_stragglers(one) == []


def test_the_driver_tail_keeps_device_samples_far_behind_its_window(tmp_path):
  # The driver keeps the last ~50 rows a process; samples come every 100
  # steps, so they are kept apart, or no verdict could ever form.
  rows = with_device_samples(lockstep_rows(n=3, steps=400, checkpoint_every=0), every=100, slow=1)
  tail = st.TimingTail(str(tmp_path), keep=48, from_end=False)
  _write(tmp_path, [r for r in rows if r['step'] <= 250])
  tail.update()
  _write(tmp_path, [r for r in rows if r['step'] > 250])
  seen = tail.update()
  assert sorted({r['step'] for r in seen if 'device' in r}) == [100, 200, 300, 400]
  assert [s.process for s in st.find_stragglers(seen)] == [1]


def test_trace_shows_sampled_device_time_on_its_own_track(tmp_path):
  rows = with_device_samples(lockstep_rows(n=2, steps=20), every=10, slow=1)
  trace = timeline.chrome_trace(rows)
  dev = [e for e in trace['traceEvents'] if e.get('cat') == 'device']
  assert sorted((e['pid'], e['args']['step'], e['name']) for e in dev) == sorted(
      (p, s, f'device {k}') for p in (0, 1) for s in (10, 20) for k in ('compute', 'collective'))
  assert all(e['tid'] == 1 for e in dev)
  by = {(e['pid'], e['args']['step'], e['name']): e for e in dev}
  row = next(r for r in rows if r['process'] == 1 and r['step'] == 20)
  assert by[(1, 20, 'device compute')]['dur'] == pytest.approx(row['device']['compute'] * 1e6, abs=1)
  # Inside the step's compute phase, which starts where the device track does.
  compute = next(e for e in trace['traceEvents'] if e.get('cat') == 'phase' and e['pid'] == 1
                 and e['args']['step'] == 20 and e['name'] == 'compute')
  assert by[(1, 20, 'device compute')]['ts'] == compute['ts']


def test_trace_gives_each_gpu_of_a_process_its_own_device_track(tmp_path):
  rows = with_gpu_samples(lockstep_rows(n=2, steps=20), gpus=4, slow=(1, 2))
  trace = timeline.chrome_trace(rows)
  names = {(e['pid'], e['tid']): e['args']['name'] for e in trace['traceEvents'] if e['name'] == 'thread_name'}
  assert names[(1, 1)] == 'device time (sampled steps), slowest device'
  assert [names[(1, 2 + k)] for k in range(4)] == [f'device {k} time (sampled steps)' for k in range(4)]
  compute = {e['tid']: e['dur'] for e in trace['traceEvents'] if e.get('cat') == 'device'
             and e['pid'] == 1 and e['args']['step'] == 20 and e['name'] == 'device compute'}
  assert compute[1] == compute[2 + 2] > 1.4 * max(compute[2 + k] for k in (0, 1, 3))


def test_a_rank_whose_host_stalled_is_named_by_its_short_wait():
  # Its kernels take no longer (a GPU left idle by its host), but it arrives
  # last at the collectives and waits there less than the others.
  rows = with_device_samples(lockstep_rows(n=4, steps=60, seed=5), slow=1, factor=1.0, stall=0.4)
  (found,) = st.find_stragglers(rows)
  assert found.process == 1 and found.reason == 'device' and found.slowdown > 0.3
  assert 0.9 < found.ratio < 1.1     # its compute time is the others'


# --- the driver's fast path against the analysis written row by row --------------
#
# The driver's TimingTail keeps columns as it reads and the analysis works
# on them (RowTable); what follows is the analysis as first written, row by
# row, which the fast path must agree with exactly, damaged lines and all.

def _ref_valid_row(row):
  def number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

  def count(x, below):
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < below

  return (isinstance(row, dict) and count(row.get('step'), 2**53) and count(row.get('process'), 2**31)
          and number(row.get('time')) and isinstance(row.get('host', ''), str)
          and isinstance(row.get('phases'), dict)
          and all(isinstance(k, str) and number(v) and v >= 0 for k, v in row['phases'].items()))


def _ref_parse_row(line):
  for start in (0, line.rfind('{"step"')):
    if start < 0:
      break
    try:
      row = json.loads(line[start:])
    except ValueError:
      continue
    if _ref_valid_row(row):
      if 'device' in row and not st._valid_sample(row['device']):
        del row['device']
      return row
  return None


def _ref_grid(rows, steps):
  processes = np.array(sorted({int(r['process']) for r in rows}), dtype=np.int64)
  steps = np.asarray(steps, dtype=np.int64)
  pi = {p: i for i, p in enumerate(processes.tolist())}
  si = {s: i for i, s in enumerate(steps.tolist())}
  names = st.phases_of(rows)
  shape = (len(processes), len(steps))
  end = np.full(shape, np.nan)
  seconds = {name: np.full(shape, np.nan) for name in (st.STEP, *names)}
  present = np.zeros(shape, bool)
  for r in rows:
    j = si.get(int(r['step']))
    if j is None:
      continue
    i = pi[int(r['process'])]
    present[i, j] = True
    end[i, j] = float(r['time'])
    seconds[st.STEP][i, j] = float(sum(r['phases'].values()))
    for name, v in r['phases'].items():
      seconds[name][i, j] = float(v)
  for name in names:
    seconds[name][present & np.isnan(seconds[name])] = 0.0
  return {'processes': processes, 'steps': steps, 'end': end, 'seconds': seconds}


def _ref_loo_median(x):
  P, S = x.shape
  order = np.argsort(x, axis=0, kind='stable')
  s = np.take_along_axis(x, order, axis=0)
  rank = np.empty_like(order)
  np.put_along_axis(rank, order, np.broadcast_to(np.arange(P)[:, None], (P, S)), axis=0)
  m = np.sum(~np.isnan(x), axis=0) - 1

  def kth_remaining(k):
    k = np.broadcast_to(np.maximum(k, 0), (P, S))
    idx = np.clip(np.where(k < rank, k, k + 1), 0, P - 1)
    return np.take_along_axis(s, idx, axis=0)

  med = 0.5 * (kth_remaining((m - 1) // 2) + kth_remaining(m // 2))
  med[:, m < 1] = np.nan
  med[np.isnan(x)] = np.nan
  return med


def _ref_compare(rows, steps):
  g = _ref_grid(rows, steps)
  end, seconds = g['end'], g['seconds']
  total = seconds[st.STEP]

  def per_step(extra_s, ref):
    return extra_s / np.maximum(ref - np.clip(extra_s, 0, None), 0.1 * ref)

  with np.errstate(invalid='ignore', divide='ignore'):
    ref_total = _ref_loo_median(total)
    ref_total = np.where(ref_total > 0, ref_total, np.nan)
    late_s = end - _ref_loo_median(end)
    excess = {st.STEP: (total - ref_total) / ref_total}
    for ph, x in seconds.items():
      if ph != st.STEP:
        excess[ph] = per_step(x - _ref_loo_median(x), ref_total)
    signals = {'late': per_step(late_s, ref_total), **excess}
    stacked = np.stack(list(signals.values()))
    slowdown = np.where(np.all(np.isnan(stacked), axis=0), np.nan,
                        np.nanmax(np.where(np.isnan(stacked), -np.inf, stacked), axis=0))
    ratio = total / ref_total
  return {'processes': g['processes'], 'steps': g['steps'], 'ratio': ratio, 'lateness_s': late_s,
          'signals': signals, 'slowdown': slowdown}


def _ref_latest_steps(rows, window, quorum):
  counts = collections.Counter(int(r['step']) for r in rows)
  return sorted(s for s, c in counts.items() if c >= quorum)[-window:]


def _ref_consistently_slow(slow, margin, consistency, least):
  valid = ~np.isnan(slow)
  if valid.sum() < max(1, least):
    return None
  med, share = float(np.median(slow[valid])), float(np.mean(slow[valid] > margin / 2))
  return (med, share) if med > margin and share >= consistency else None


def _ref_host_stragglers(rows, margin, window, consistency):
  n_proc = len({r['process'] for r in rows})
  if n_proc < 2:
    return []
  steps = _ref_latest_steps(rows, window, max(2, (n_proc + 1) // 2))
  if len(steps) < window:
    return []
  recent = [r for r in rows if int(r['step']) >= steps[0]]
  sig = _ref_compare(recent, steps)
  hosts = {int(r['process']): r.get('host', '?') for r in recent}
  found = []
  for i, p in enumerate(sig['processes'].tolist()):
    verdict = _ref_consistently_slow(sig['slowdown'][i], margin, consistency, window // 2)
    if verdict is not None:
      med, share = verdict
      by_signal = {k: float(st._nanmedian(v[i])) for k, v in sig['signals'].items()}
      found.append(st.Straggler(
          process=p, host=hosts.get(p, '?'), slowdown=med,
          reason=max(by_signal, key=lambda k: -np.inf if np.isnan(by_signal[k]) else by_signal[k]),
          ratio=float(st._nanmedian(sig['ratio'][i])), lateness=by_signal['late'],
          lateness_s=float(st._nanmedian(sig['lateness_s'][i])), slow_share=share,
          first_step=int(sig['steps'][0]), last_step=int(sig['steps'][-1])))
  return found


def _ref_device_stragglers(rows, margin, consistency, samples=st.DEVICE_SAMPLES):
  sig = st.device_compare(st.dedupe_rows(rows), samples)
  if sig is None:
    return []
  hosts = {int(r['process']): r.get('host', '?') for r in rows}
  procs, devs = sig['processes'].tolist(), sig['devices'].tolist()
  verdicts = [_ref_consistently_slow(sig['slowdown'][i], margin, consistency, (samples + 1) // 2)
              for i in range(len(procs))]
  found = {}
  for i, (p, dev, verdict) in enumerate(zip(procs, devs, verdicts)):
    if verdict is None or (p in found and verdict[0] <= found[p].slowdown):
      continue
    siblings = [verdicts[k] is not None for k in range(len(procs)) if procs[k] == p and k != i]
    whole = dev < 0 or (bool(siblings) and sum(siblings) >= len(siblings) / 2)
    med, share = verdict
    found[p] = st.Straggler(process=p, host=hosts.get(p, '?'), slowdown=med, reason=st.DEVICE,
                            ratio=float(st._nanmedian(sig['ratio'][i])), lateness=0.0, lateness_s=0.0,
                            slow_share=share, first_step=int(sig['steps'][0]),
                            last_step=int(sig['steps'][-1]), device=None if whole else dev)
  return sorted(found.values(), key=lambda s: -s.slowdown)


def _ref_find_stragglers(rows, margin, window, consistency=0.8):
  rows = st.dedupe_rows(rows)
  found = {}
  for s in _ref_host_stragglers(rows, margin, window, consistency) + _ref_device_stragglers(rows, margin, consistency):
    if s.process not in found or s.slowdown > found[s.process].slowdown:
      found[s.process] = s
  return sorted(found.values(), key=lambda s: -s.slowdown)


def _ref_job_pace(rows, window):
  rows = st.dedupe_rows(rows)
  n_proc = len({r['process'] for r in rows})
  if not n_proc or window < 1:
    return None
  steps = _ref_latest_steps(rows, window, (n_proc + 1) // 2)
  if len(steps) < window:
    return None
  by_step = collections.defaultdict(list)
  for r in rows:
    by_step[int(r['step'])].append(st.step_duration(r))
  return float(np.median([np.median(by_step[s]) for s in steps]))


def _same(a, b):
  """Equal, NaN matching NaN."""
  if isinstance(a, float) and isinstance(b, float):
    return a == b or (a != a and b != b)
  if isinstance(a, (list, tuple)):
    return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
  if isinstance(a, dict):
    return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
  return a == b


def _damaged(rng, row):
  """A line as a crash, a foreign writer or a bad disk leaves it."""
  text = json.dumps(row)
  kind = rng.integers(9)
  if kind == 0:
    return text[:rng.integers(1, len(text))]                        # cut short
  if kind == 1:
    return text[:rng.integers(1, len(text))] + json.dumps(row)      # cut short, the next row after it
  if kind == 2:
    return json.dumps({**row, 'step': [True, -1, 2**53, 1.5, '3', None][rng.integers(6)]})
  if kind == 3:
    return json.dumps({**row, 'process': [True, -2, 2**31, 2.0][rng.integers(4)]})
  if kind == 4:
    return json.dumps({**row, 'time': [float('nan'), float('inf'), 'x', None, False][rng.integers(5)]})
  if kind == 5:
    bad = [-0.5, float('nan'), float('-inf'), 'x', True, None, [1]][rng.integers(7)]
    return json.dumps({**row, 'phases': {**row['phases'], 'data': bad}})
  if kind == 6:
    return json.dumps({**row, 'host': [3, None, ['h']][rng.integers(3)]})
  if kind == 7:
    return ['[1, 2]', '"text"', '17', 'null', '{}', '\x00\xff junk', '[' * 100000, ''][rng.integers(8)]
  return json.dumps({**row, 'device': [{'compute': 'x'}, [1], {'compute': 1.0, 'collective': 0.1, 'devices': {'a': {}}}]
                     [rng.integers(3)]})


@pytest.mark.parametrize('seed', range(6))
def test_row_checks_agree_with_the_plain_ones_on_damaged_lines(seed):
  rng = np.random.default_rng(seed)
  rows = with_gpu_samples(lockstep_rows(n=3, steps=30, seed=seed), gpus=2, every=3)
  lines = [json.dumps(r) for r in rows] + [_damaged(rng, rows[rng.integers(len(rows))]) for _ in range(400)]
  for line in lines:
    try:
      want = _ref_parse_row(line)
    except RecursionError:   # the first checks let a line nested this deep stop the analysis
      want = None
    assert st._parse_row(line) == want, line[:200]
  # A number too large for float arithmetic, which the first checks let
  # through to stop the analysis, is no row either.
  assert st._parse_row(json.dumps({**rows[0], 'time': 10**400})) is None
  assert st._parse_row(json.dumps({**rows[0], 'phases': {'data': 10**400}})) is None
  assert st._parse_row(json.dumps({**rows[0], 'time': 10**300})) == {**rows[0], 'time': 10**300}


@pytest.mark.parametrize('seed', range(8))
def test_the_driver_tails_verdicts_are_those_of_the_plain_analysis(tmp_path, seed):
  rng = np.random.default_rng(seed)
  n, window = int(rng.integers(2, 10)), int(rng.integers(4, 12))
  slow = int(rng.integers(n))
  rows = lockstep_rows(n=n, steps=120, slow=slow, factor=float(rng.uniform(1.1, 1.6)), slow_from=int(rng.integers(1, 80)),
                       slow_phase=['after', 'data'][rng.integers(2)], seed=seed,
                       pause=(int(rng.integers(n)), int(rng.integers(1, 120)), 3.0))
  rows = with_gpu_samples(rows, gpus=int(rng.integers(1, 4)), every=int(rng.integers(3, 15)), seed=seed,
                          slow=(int(rng.integers(n)), 0) if rng.random() < 0.5 else None)
  for r in rows:
    if rng.random() < 0.05:
      r['phases']['gc'] = round(float(rng.uniform(0, 0.3)), 6)      # a phase in some steps only
    if rng.random() < 0.02:
      r['phases'] = {}
  # A resumed run writes some steps again, later; a foreign file holds
  # another process's rows; one process stops writing early.
  again = [dict(r, time=r['time'] + 500.0) for r in rows if 40 < r['step'] <= 50 and rng.random() < 0.5]
  stop = int(rng.integers(60, 121))
  written = [r for r in rows if r['process'] != n - 1 or r['step'] <= stop]
  keep = [p for p in range(n) if p != 1 or rng.random() < 0.5]    # the attempt's processes
  margin = float(rng.choice([0.05, 0.1, 0.2]))
  tail = st.TimingTail(str(tmp_path), keep=2 * window + 8, from_end=False)
  os.makedirs(tmp_path / 'timings')
  files = {p: open(tmp_path / 'timings' / f'process-{p:05d}.jsonl', 'a') for p in range(n)}
  files['foreign'] = open(tmp_path / 'timings' / 'process-00077.jsonl', 'a')
  checks = flagged = 0
  for s in range(1, 121):
    for r in [r for r in written if r['step'] == s] + [r for r in again if r['step'] + 25 == s]:
      line = json.dumps(r)
      if rng.random() < 0.03:
        line = _damaged(rng, r)
      files[r['process']].write(line + '\n')
      if r['process'] == 0 and rng.random() < 0.2:
        files['foreign'].write(json.dumps(dict(r, process=int(rng.integers(n)), host='elsewhere')) + '\n')
    if rng.random() < 0.3:
      files[int(rng.integers(n))].write('{"step": 9')               # half a row, the rest later or never
    if s % 5 and s < 120:
      continue
    for fh in files.values():
      fh.flush()
    rows_seen = [r for r in tail.update() if r['process'] in keep]
    table = tail.table(keep)
    want = _ref_find_stragglers(rows_seen, margin, window)
    assert _same([x.to_json() for x in st.find_stragglers(table, margin, window)], [x.to_json() for x in want])
    assert _same([x.to_json() for x in st.find_stragglers(rows_seen, margin, window)], [x.to_json() for x in want])
    assert _same(st.job_pace(table, window), _ref_job_pace(rows_seen, window))
    assert _same(st.job_pace(rows_seen, window), _ref_job_pace(rows_seen, window))
    checks, flagged = checks + 1, flagged + bool(want)
  for fh in files.values():
    fh.close()
  assert checks == 24 and flagged   # the comparison saw verdicts, not only empty lists


@pytest.mark.parametrize('seed', range(4))
def test_leave_one_out_medians_agree_with_the_plain_ones(seed):
  rng = np.random.default_rng(seed)
  for P in (1, 2, 3, 5, 8, 33):
    x = rng.choice([0.0, 0.5, 1.0, 2.0, np.nan, np.inf], size=(P, 7)) if seed % 2 else rng.random((P, 7))
    x[rng.random((P, 7)) < 0.2] = np.nan
    np.testing.assert_array_equal(st._loo_median(x), _ref_loo_median(x))
    np.testing.assert_array_equal(st._row_medians(x), st._nanmedian(x, axis=1))


def test_the_latest_rows_are_read_without_the_files_history(tmp_path, monkeypatch):
  """load_rows(last=N): the last N rows of each process, the bytes read
  about what they take, not the whole file (nor 30 times too many)."""
  rows = lockstep_rows(n=3, steps=2000, seed=4)
  _write(tmp_path, rows)
  read = []
  real = st._parse_row
  monkeypatch.setattr(st, '_parse_row', lambda line: read.append(1) or real(line))
  got = st.load_rows(str(tmp_path), last=100)
  assert [r['step'] for r in got if r['process'] == 1] == list(range(1901, 2001))
  assert 3 * 100 <= len(read) < 3 * 200, len(read)


def test_a_process_timings_are_rotated_and_read_across_the_rotation(tmp_path):
  """A process's timings file past its limit becomes process-<i>.jsonl.1
  (the one before dropped): the files stay under twice the limit however
  many steps are written (they grew ~130 bytes a step, 1.6 TB over a
  million steps at 12,288 processes). The report's reader takes the rows
  it lacks from the previous file; the driver's tail goes on reading the
  new one, after the rest of the one rotated out."""
  from mjax.ft.phases import PhaseTimer
  timer = PhaseTimer(str(tmp_path), 0, every=10, max_bytes=20_000)
  tail = st.TimingTail(str(tmp_path), keep=48, from_end=False)
  directory = tmp_path / 'timings'
  for step in range(1, 3001):
    with timer.phase('compute'):
      pass
    timer.end_step(step)
    if step % 50 == 0:
      assert sum(f.stat().st_size for f in directory.iterdir()) < 2 * 20_000 + 2_000
      assert [r['step'] for r in tail.update() if r['process'] == 0] == list(range(step - 47, step + 1))
  timer.close()
  assert sorted(os.listdir(directory)) == ['process-00000.jsonl', 'process-00000.jsonl.1']
  now = len((directory / 'process-00000.jsonl').read_text().splitlines())
  assert 0 < now < 200
  assert [r['step'] for r in st.load_rows(str(tmp_path), last=200)] == list(range(2801, 3001))
  assert st.load_rows(str(tmp_path), last=now) == st.load_rows(str(tmp_path), last=200)[-now:]


def test_the_report_of_many_processes_stays_readable_and_bounded(tmp_path, capsys, monkeypatch):
  """300 processes (75 hosts of 4), process 137 slow from step 10: the table
  lists the straggler, its host's other processes and the latest others
  (not 300 lines), the trace holds those processes alone, the heat map one
  row per host, and --steps reads the latest steps only."""
  rows = lockstep_rows(n=300, steps=60, slow=137, factor=1.4, slow_from=10, seed=3)
  _write(tmp_path, rows)
  assert report.main(['stragglers', str(tmp_path), '--out', str(tmp_path / 'out'), '--steps', '40']) == 0
  out = capsys.readouterr().out
  table = [l for l in out.splitlines() if l[:8].strip().isdigit()]
  assert len(table) == report.REPORT_LISTED, out
  listed = {int(l.split()[0]) for l in table}
  assert {136, 137, 138, 139} <= listed     # the straggler and its host's other processes
  assert 'straggler: process 137 on node-34' in out and 'of 300; --json lists every process' in out
  assert f'the {report.REPORT_LISTED} processes of the table' in out
  with open(tmp_path / 'out' / 'trace.json') as fh:
    traced = {e['pid'] for e in json.load(fh)['traceEvents'] if e.get('ph') == 'X'}
  assert len(traced) == report.REPORT_LISTED
  assert '300 process(es), 40 step(s)' in out   # --steps 40: the latest 40 of 60
  assert report.main(['stragglers', str(tmp_path), '--json', '--steps', '40', '--out', str(tmp_path / 'o2')]) == 0
  said = json.loads(capsys.readouterr().out)
  assert len(said['processes']) == 300 and {p['last_step'] - p['first_step'] for p in said['processes']} == {39}
  # The heat map: a row per host, each its worst process (max-pooled), so a
  # slow host shows however many processes there are.
  processes = np.arange(8)
  hosts = {p: f'h{p // 4}' for p in range(8)}
  x = np.arange(16, dtype=float).reshape(8, 2)
  (pooled,), labels, members = timeline._pool_rows([x], processes, hosts, max_rows=4)
  assert labels == ['h0 (4)', 'h1 (4)'] and members == [[0, 1, 2, 3], [4, 5, 6, 7]]
  np.testing.assert_array_equal(pooled, [[6, 7], [14, 15]])
  (banded,), labels, _ = timeline._pool_rows([x], processes, {p: f'h{p}' for p in range(8)}, max_rows=4)
  assert labels == ['h0..h1 (2)', 'h2..h3 (2)', 'h4..h5 (2)', 'h6..h7 (2)'] and banded.shape == (4, 2)
  # Rows that name no host are no one host: banded by process, not one row.
  (unnamed,), labels, _ = timeline._pool_rows([x], processes, {p: '?' for p in range(8)}, max_rows=4)
  assert labels[0] == 'process 0..process 1 (2)' and unnamed.shape == (4, 2)
  monkeypatch.setattr(timeline, 'MAX_ROWS', 50)
  png = timeline.plot_heatmap(rows, str(tmp_path / 'pooled.png'), stragglers=[137])
  assert os.path.getsize(png) > 0
