"""Recovery time and effective training time under mjax-launch.

  python bench/recovery_bench.py --processes 2 --steps 2000 --fault_every_s 300

Two runs of the same job in fresh workdirs, the persistent compilation
cache warmed first (see below), so a restart's compile is a cache hit in
every process (on CPU each process writes its own entry, see
mjax/distributed.py):

  baseline  no fault
  faulty    every --fault_every_s seconds of wall time a random training
            process is sent SIGKILL (once the current attempt is training)

For each fault of the faulty run, from the driver's events.jsonl and the
trainer's start-up report, the time from the kill to training back at the
step reached before it, split into:
  detection     kill -> fault event
  stop          fault -> every process gone (SIGTERM, SIGKILL after grace)
  diagnosis     mjax-diagnose on every host
  link check    the all-reduce of each host the fault named with a healthy one
  backoff       restart_backoff_s
  start + init  interpreter, imports, jax.distributed (launch -> run())
  restore       checkpoint read (the trainer's `state_s`)
  compile       the train step (from the persistent cache when it hits)
  compile wait  the barrier after it: waiting for the slowest process's compile
  other setup   mesh, program, data iterator
  first step    process 0's first step, which waits in its first collective
                for the slowest process to finish its own start-up
  catch-up      first step -> the pre-crash step again
Effective training time = useful step time / wall time of the run (the
driver's, launch to finish), where useful step time is the sum of the step
times of the steps that count (a step redone after a restart counts once,
its lost first run not at all), which leave out the time each save
blocked the loop.
The second figure, steps x median step time / wall time, also leaves out
the steps' jitter around their median. The baseline's share is what
start-up, checkpoints and the end of a run without faults leave.

The cache is warmed by a run of the same job (same steps, so the same
program), stopped with SIGTERM once it has trained a step: the baseline and
the faulty run then both start as a restart would.

The checkpoint cadence follows Young's rule, interval ~ sqrt(2 x save cost x
time between faults): on this CPU a save costs the loop about 0.25 s, so
with a fault every 300 s a save every ~12 s (25 steps) balances the time
spent saving against the steps redone after a fault.

MegaScale's production figures are for faults every few hours on weeks-long
runs; here the run is scaled down to minutes with a fault every few
minutes, which makes the ratio a stress figure, not a production estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from mjax.ft import events as events_lib  # noqa: E402
from mjax.metrics import read_metrics  # noqa: E402

PARTS = ('detection', 'stop', 'diagnosis', 'link_check', 'backoff', 'start_init', 'restore', 'compile',
         'compile_wait', 'other_setup', 'first_step', 'catch_up', 'total')


def launch_cmd(args, workdir, steps):
  exe = os.path.join(os.path.dirname(sys.executable), 'mjax-launch')
  return [exe, '--processes', str(args.processes), '--devices', '1', '--workdir', workdir,
          '--grace_s', str(args.grace_s), '--diagnose_args', args.diagnose_args, '--quiet', '--',
          '--gin_file', args.gin_file, f'--gin.TrainConfig.steps={steps}', '--gin.TrainConfig.progress=False',
          f'--gin.CheckpointConfig.save_every={args.save_every}',
          f'--gin.CheckpointConfig.fast_every={args.fast_every}',
          f'--gin.CheckpointConfig.fast_directory={os.path.join(workdir, "fast")}',
          f'--gin.TrainConfig.eval_every={args.eval_every}',
          '--gin.FaultConfig.restart_backoff_s=1', f'--gin.FaultConfig.max_restarts={args.max_restarts}',
          *args.extra]


def run(args, workdir, steps, fault_every_s=None, warm_only=False):
  """Runs the driver; returns (wall seconds, [kill records]). `warm_only`:
  pre-empt it (SIGTERM) once it has trained its first step."""
  env = {k: v for k, v in os.environ.items() if k not in ('MJAX_FAULT', 'XLA_FLAGS')}
  t0 = time.time()
  proc = subprocess.Popen(launch_cmd(args, workdir, steps), cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  kills, rng = [], random.Random(args.seed)
  log = os.path.join(workdir, 'events.jsonl')
  next_kill = t0 + fault_every_s if fault_every_s else None
  while proc.poll() is None:
    time.sleep(0.1)
    if warm_only:
      if any(e['event'] == 'startup' for e in events_lib.read(log)):
        proc.send_signal(signal.SIGTERM)
        warm_only = False
      continue
    if next_kill is None or time.time() < next_kill:
      continue
    evs = events_lib.read(log)
    launches = [e for e in evs if e['event'] == 'launch']
    if not launches:
      continue
    attempt = launches[-1]['attempt']
    ready = {e['event'] for e in evs if e.get('attempt') == attempt}
    if 'startup' not in ready or (attempt > 0 and 'caught_up' not in ready):
      continue            # still recovering from the last one: kill once it has caught up
    victim = rng.randrange(len(launches[-1]['pids']))
    try:
      os.kill(launches[-1]['pids'][victim], signal.SIGKILL)
    except ProcessLookupError:
      continue
    kills.append({'time': time.time(), 'attempt': launches[-1]['attempt'], 'process': victim})
    next_kill = time.time() + fault_every_s
  out = proc.stdout.read()
  if proc.returncode != 0:
    raise SystemExit(f'recovery_bench: the driver exited {proc.returncode}:\n{out[-3000:]}')
  return time.time() - t0, kills


def step_times(workdir) -> dict[int, float]:
  """Step -> its step time; a step run again after a restart, its last run."""
  rows = read_metrics(workdir)
  return {r['step']: r['step_time'] for r in rows if 'step_time' in r}


def effective(workdir, steps) -> dict:
  """Useful step time and wall time of a run (see the module docstring)."""
  times = step_times(workdir)
  blocked = {}
  with open(os.path.join(workdir, 'timings', 'process-00000.jsonl')) as fh:
    for line in fh:
      r = json.loads(line)
      blocked[r['step']] = r['phases'].get('checkpoint', 0.0)   # a save's blocking part
  evs = events_lib.read(os.path.join(workdir, 'events.jsonl'))
  wall = evs[-1]['time'] - evs[0]['time']
  # A step's time leaves out the save that blocked the loop after it (the
  # trainer's StepReporter.not_step_time): the step times are the useful time
  # as they are; taking the saves off again counted each one as lost twice.
  useful = sum(times.values())
  med = statistics.median(times.values())
  return {'wall_s': wall, 'useful_s': useful, 'saves_blocked_s': sum(blocked.get(s, 0.0) for s in times),
          'median_step_s': med, 'effective': useful / wall, 'effective_median': steps * med / wall}


def breakdown(workdir, kills):
  """One dict of PARTS per kill, from the events."""
  evs = events_lib.read(os.path.join(workdir, 'events.jsonl'))
  out = []
  for k in kills:
    after = [e for e in evs if e['time'] >= k['time'] - 0.01]
    def first(kind, since=None, attempt=None):
      return next((e for e in after if e['event'] == kind and (since is None or e['time'] >= since['time'])
                   and (attempt is None or e.get('attempt') == attempt)), None)
    fault = first('fault')
    stopped = first('stopped', fault)
    restart = first('restart', stopped)
    launch = first('launch', restart)
    if None in (fault, stopped, restart, launch):
      continue
    startup = first('startup', launch, launch['attempt'])
    caught = first('caught_up', launch, launch['attempt'])
    if None in (startup, caught):
      continue
    diag = [e for e in after if e['event'] == 'diagnosis' and stopped['time'] <= e['time'] <= restart['time']]
    diag_end = max((e['time'] for e in diag), default=stopped['time'])
    links = [e for e in after if e['event'] == 'link_check' and diag_end <= e['time'] <= restart['time']]
    links_end = max((e['time'] for e in links), default=diag_end)
    first_step = launch['time'] + startup['launch_to_first_step_s']
    start_init = startup['launch_to_first_step_s'] - startup['run_to_first_step_s']
    wait = startup.get('compile_wait_s', 0.0)
    other = (startup['run_to_first_step_s'] - startup['state_s'] - startup['compile_s'] - wait
             - startup['first_step_s'])
    out.append({
        'detection': fault['time'] - k['time'], 'stop': stopped['time'] - fault['time'],
        'diagnosis': diag_end - stopped['time'], 'link_check': links_end - diag_end,
        'backoff': launch['time'] - links_end,
        'start_init': start_init, 'restore': startup['state_s'], 'compile': startup['compile_s'], 'compile_wait': wait,
        'other_setup': other, 'catch_up': caught['time'] - first_step, 'total': caught['time'] - k['time'],
        'distributed_init': startup['distributed_init_s'], 'first_step': startup['first_step_s'],
        # (None: checkpoints the driver cannot list, a host-local tier.)
        'steps_redone': (None if restart.get('checkpoint_step') is None else
                         (fault.get('reached_step') or 0) - restart['checkpoint_step']),
    })
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--processes', type=int, default=2)
  p.add_argument('--gin_file', default='configs/tiny.gin')
  p.add_argument('--steps', type=int, default=400)
  p.add_argument('--fault_every_s', type=float, default=60.0)
  p.add_argument('--save_every', type=int, default=25, help='persistent tier cadence (steps)')
  p.add_argument('--fast_every', type=int, default=0, help='fast tier cadence (steps; 0: none)')
  p.add_argument('--eval_every', type=int, default=0)
  p.add_argument('--grace_s', type=float, default=2.0)
  p.add_argument('--max_restarts', type=int, default=20)
  p.add_argument('--diagnose_args', default='--checks memory,allreduce')
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--keep', default=None, help='keep the workdirs under this folder')
  args, extra = p.parse_known_args(argv)
  args.extra = extra
  root = args.keep or tempfile.mkdtemp(prefix='recovery_bench_')
  os.makedirs(root, exist_ok=True)
  try:
    print('recovery_bench: warming the compilation cache', file=sys.stderr, flush=True)
    run(args, os.path.join(root, 'warm'), args.steps, warm_only=True)
    print(f'recovery_bench: baseline, {args.steps} steps', file=sys.stderr, flush=True)
    run(args, os.path.join(root, 'baseline'), args.steps)
    print(f'recovery_bench: faulty run, a kill every {args.fault_every_s:.0f}s', file=sys.stderr, flush=True)
    faulty_dir = os.path.join(root, 'faulty')
    _, kills = run(args, faulty_dir, args.steps, args.fault_every_s)
    parts = breakdown(faulty_dir, kills)
    faults = [e for e in events_lib.read(os.path.join(faulty_dir, 'events.jsonl')) if e['event'] == 'fault']
    result = {
        'processes': args.processes, 'steps': args.steps, 'save_every': args.save_every,
        'fault_every_s': args.fault_every_s,
        'baseline': effective(os.path.join(root, 'baseline'), args.steps),
        'faulty': {**effective(faulty_dir, args.steps), 'kills': len(kills), 'faults_detected': len(faults)},
        'recovery': parts,
        'recovery_median': {k: statistics.median(r[k] for r in parts) for k in PARTS} if parts else {},
    }
    print(json.dumps(result, indent=1))
    print('\n| run | wall (s) | useful step time (s) | saves blocked (s) | effective | effective (median) |')
    print('|---|---|---|---|---|---|')
    for name in ('baseline', 'faulty'):
      r = result[name]
      print(f'| {name} | {r["wall_s"]:.0f} | {r["useful_s"]:.0f} | {r["saves_blocked_s"]:.1f} | '
            f'{r["effective"]:.1%} | {r["effective_median"]:.1%} |')
    if parts:
      print('\n| part | ' + ' | '.join(f'fault {i + 1}' for i in range(len(parts))) + ' | median |')
      print('|---|' + '---|' * (len(parts) + 1))
      for k in PARTS:
        print(f'| {k} | ' + ' | '.join(f'{r[k]:.1f}' for r in parts) +
              f' | {result["recovery_median"][k]:.1f} |')
    return 0
  finally:
    if not args.keep:
      shutil.rmtree(root, ignore_errors=True)


if __name__ == '__main__':
  sys.exit(main())
