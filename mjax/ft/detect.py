"""Fault detection from heartbeats: lost processes, hangs, bad losses.

Pure bookkeeping, no I/O: the driver feeds heartbeats and the clock in and
asks `Monitor.check(now)` for a fault. Clocks are the driver's monotonic
clock, never the senders' (hosts' clocks disagree).

Timeouts (FaultConfig), in the order they must hold:

  heartbeat_interval_s < heartbeat_timeout_s < progress_timeout_s < collective_timeout_s

  heartbeat_timeout_s   no heartbeat for this long: the process is lost
                        (dead host, wedged interpreter holding the GIL)
  progress_timeout_s    heartbeats arrive but the step has not moved for
                        this long: a hang (typically a collective waiting
                        for a peer that will never come). It bounds the
                        step's own phases (data, compute), or three of
                        the process's last step times where that is
                        longer (a step of many accumulation slices can
                        take minutes); see SLOW_PHASES for the others
  collective_timeout_s  what the job tolerates by itself: the trainer sets
                        jax's coordination-service heartbeat timeout (after
                        which jax aborts every process once a peer is gone)
                        and bounds its post-compile barrier with it. The
                        driver must act before that, or every healthy
                        process fails with a timeout of its own and the
                        culprit is no longer visible. Also the allowance for
                        start-up (restore, compile, first step), before a
                        process reports its first step: progress is only
                        judged from then on.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
import re
from typing import Optional


# Phases whose length is set by storage or by the compiler, not by a step:
# the blocking part of a save (a final save of a large state on a network
# file system takes minutes) and evaluation (its first call compiles the
# eval step; then each batch ticks, see PhaseTimer.tick). Judged by the
# progress timeout, a run whose last save outlasted it was killed as hung at
# its very end, and again after every restart. They get collective_timeout_s
# from one tick to the next, a save at least CheckpointConfig.io_timeout_s.
SLOW_PHASES = ('checkpoint', 'eval')
# A step may take this many times the process's last one before it counts as
# hung, where that is longer than progress_timeout_s: a step of many
# accumulation slices takes minutes, and every one of them was a "hang".
STEP_TIMES = 3


def in_startup(phase: Optional[str]) -> bool:
  """A heartbeat's phase from before the loop (mjax.trainer.StartupPhase)."""
  return isinstance(phase, str) and phase.startswith('startup')


def save_allowance(fault_cfg, io_timeout_s: float) -> float:
  """How long a process may stay in a save (the blocking part), under the
  driver or, once the driver is gone, under its agent."""
  return max(fault_cfg.collective_timeout_s, io_timeout_s)


@dataclasses.dataclass
class Fault:
  """What went wrong. `processes` are the ones named as the cause."""
  kind: str
  processes: list[int]
  detail: str = ''
  step: Optional[int] = None        # the step of a numerical fault
  extra: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ProcState:
  """What the driver knows about one process of the current attempt."""
  process: int
  host: str
  pid: Optional[int]                  # None: a remote process (known by its attempt)
  started: float                      # driver clock at launch
  first_beat: Optional[float] = None
  last_beat: Optional[float] = None
  step: Optional[int] = None          # last step with known metrics
  loop_step: Optional[int] = None     # last step the loop dispatched
  phase: Optional[str] = None
  ticks: Optional[int] = None         # progress inside a long phase (PhaseTimer.ticks)
  step_time: float = 0.0              # its last step's seconds
  last_progress: Optional[float] = None  # when (step, loop_step, phase, ticks) last changed
  loss: Optional[float] = None
  logs: list = dataclasses.field(default_factory=list)
  final: bool = False
  exited: Optional[int] = None


class LossMonitor:
  """Non-finite losses and runs of loss spikes, over the steps in order.

  A spike is a loss above `factor` x the running median of the last
  `window` non-spike losses; `count` spikes in a row are a fault (one spike
  is noise that LAMB usually absorbs). Spikes do not enter the median, so a
  slow rise cannot drag the baseline up with it.
  """

  def __init__(self, factor: float, count: int, window: int = 100, min_history: int = 10):
    self.factor, self.count = factor, count
    self.window, self.min_history = window, min_history
    self._hist: list[float] = []      # in arrival order
    self._sorted: list[float] = []
    self._last_step = -1
    self._run: list[tuple[int, float]] = []

  def new_attempt(self) -> None:
    """After a restart the steps start again from the checkpoint."""
    self._last_step = -1
    self._run = []

  def median(self) -> Optional[float]:
    if len(self._sorted) < self.min_history:
      return None
    n = len(self._sorted)
    return (self._sorted[n // 2] + self._sorted[(n - 1) // 2]) / 2

  def feed(self, step: int, loss: float) -> Optional[Fault]:
    """One step's loss (repeats and older steps are ignored); a Fault or None."""
    if step <= self._last_step:
      return None
    self._last_step = step
    if not math.isfinite(loss):
      return Fault('nonfinite_loss', [], f'loss {loss} at step {step}', step=step)
    med = self.median()
    if med is not None and loss > self.factor * med:
      self._run.append((step, loss))
      if len(self._run) >= self.count:
        first, last = self._run[0][0], self._run[-1][0]
        return Fault('loss_spike', [], f'{len(self._run)} losses in a row above {self.factor} x median '
                     f'{med:.4g} (steps {first}-{last}, last {loss:.4g})', step=last,
                     extra={'first_step': first, 'median': med})
      return None
    self._run = []
    self._hist.append(loss)
    bisect.insort(self._sorted, loss)
    if len(self._hist) > self.window:
      old = self._hist.pop(0)
      del self._sorted[bisect.bisect_left(self._sorted, old)]
    return None


class Monitor:
  """Tracks the processes of one attempt and says when one has failed."""

  def __init__(self, fault_cfg, losses: LossMonitor, attempt: Optional[int] = None,
               io_timeout_s: float = 0.0, restoring: bool = False):
    """`io_timeout_s`: what one save or restore may take
    (CheckpointConfig.io_timeout_s), allowed a process in its checkpoint
    phase and added to start-up where it restores (`restoring`)."""
    self.cfg = fault_cfg
    self.save_s = save_allowance(fault_cfg, io_timeout_s)
    self.startup_s = fault_cfg.collective_timeout_s + (io_timeout_s if restoring else 0.0)
    # How closely heartbeats time a stop: one interval, and one more where an
    # agent relays them on its own interval.
    self.resolution_s = 2 * fault_cfg.heartbeat_interval_s
    self.procs: dict[int, ProcState] = {}
    self.losses = losses
    self.attempt = attempt   # heartbeats of another attempt are not this one's

  def add(self, process: int, host: str, pid: Optional[int], now: float) -> None:
    # pid None: the process runs elsewhere (its heartbeats' pid means nothing here).
    self.procs[process] = ProcState(process, host, pid, started=now)

  def beat(self, payload: dict, now: float) -> Optional[Fault]:
    """Takes one verified heartbeat; returns a numerical fault if it shows one.

    Heartbeats from a process of an earlier attempt (another pid) are
    ignored: a datagram can arrive after its sender was replaced.
    """
    p = self.procs.get(int(payload['process']))
    if p is None or (p.pid is not None and payload.get('pid') != p.pid):
      return None
    if self.attempt is not None and payload.get('attempt') != self.attempt:
      return None   # a process of an earlier attempt
    if p.first_beat is None:
      p.first_beat = now
    p.last_beat = now
    step, loop_step, phase = payload.get('step'), payload.get('loop_step'), payload.get('phase')
    ticks = payload.get('ticks')
    if p.last_progress is None or (step, loop_step, phase, ticks) != (p.step, p.loop_step, p.phase, p.ticks):
      # Progress = the step moved. A phase change counts too: a process
      # going from compute to checkpoint is busy, not stuck; so does a tick
      # inside a phase (an evaluation batch done).
      p.last_progress = now
    p.step, p.loop_step, p.phase, p.ticks = step, loop_step, phase, ticks
    try:
      seconds = float(payload.get('step_time') or 0.0)
    except (TypeError, ValueError):
      seconds = 0.0
    if math.isfinite(seconds) and seconds > 0:
      p.step_time = seconds
    p.loss = payload.get('loss')
    p.logs = payload.get('logs') or p.logs
    p.final = p.final or bool(payload.get('final'))
    pairs = payload.get('losses') or []
    if not pairs and step is not None and p.loss is not None:
      pairs = [[step, p.loss]]
    for s, loss in pairs:
      fault = self.losses.feed(int(s), float(loss))
      if fault is not None:
        fault.processes = [p.process]
        return fault
    return None

  def everyone_running(self) -> bool:
    """Every process has heartbeated from its loop: start-up is over
    (trainers heartbeat from early in start-up, phases 'startup:...')."""
    return bool(self.procs) and all(p.first_beat is not None and not in_startup(p.phase)
                                    for p in self.procs.values())

  def check(self, now: float) -> Optional[Fault]:
    """A fault visible from timing alone (lost, stuck in start-up, hung)."""
    live = [p for p in self.procs.values() if p.exited is None and not p.final]
    # After its last heartbeat a process only evaluates, saves and exits;
    # one still there a collective timeout later is stuck on the way out.
    stuck = [p for p in self.procs.values() if p.exited is None and p.final
             and now - p.last_beat > self.cfg.collective_timeout_s]
    if stuck:
      return Fault('hang', [p.process for p in stuck],
                   f'still running collective_timeout_s = {self.cfg.collective_timeout_s}s after its '
                   f'final heartbeat')
    # Start-up (restore, compile, the first step and its first collectives)
    # ends with the first step reported; until then only the collective
    # timeout bounds it, since compiling can take long.
    late = [p for p in live if p.step is None and now - p.started > self.startup_s]
    if late:
      allowed = f'collective_timeout_s = {self.cfg.collective_timeout_s}s'
      if self.startup_s > self.cfg.collective_timeout_s:
        allowed += f' + CheckpointConfig.io_timeout_s = {self.startup_s - self.cfg.collective_timeout_s}s (a restore)'
      # Where each was: the part of start-up its heartbeats last named
      # (startup:restore, startup:compile, ...), or never heard from.
      where = {p.process: (p.phase or '?') if p.first_beat is not None else 'never heard from' for p in late}
      shown = ', '.join(f'{k} ({v})' for k, v in sorted(where.items())[:8])
      more = f' and {len(where) - 8} more' if len(where) > 8 else ''
      return Fault('startup_timeout', [p.process for p in late],
                   f'no step within {allowed} of launch: process(es) {shown}{more}',
                   extra={'heartbeating': [p.process for p in late if p.first_beat is not None]})
    lost = [p for p in live if p.last_beat is not None and now - p.last_beat > self.cfg.heartbeat_timeout_s]
    if lost:
      return Fault('heartbeat_lost', [p.process for p in lost],
                   f'no heartbeat for more than heartbeat_timeout_s = {self.cfg.heartbeat_timeout_s}s',
                   extra={'last_seen_s': {p.process: round(now - p.last_beat, 1) for p in lost}})
    over = [p for p in live if p.step is not None and now - p.last_progress > self.allowance(p)]
    if over:
      lines = sorted({self._allowance_text(p) for p in over})
      # The others blocked within a step of the culprit, so whichever crossed
      # the line first, every process stuck for longer than a heartbeat
      # timeout is a suspect; `culprits` picks among them.
      stalled = [p for p in live if p.step is not None
                 and now - p.last_progress > self.cfg.heartbeat_timeout_s]
      return Fault('hang', culprits(stalled, self.resolution_s),
                   f'heartbeats continue but no step for more than {" / ".join(lines)}',
                   extra={'stalled': {p.process: {'host': p.host, 'step': p.step, 'loop_step': p.loop_step,
                                                  'phase': p.phase,
                                                  'stalled_s': round(now - p.last_progress, 1)}
                                      for p in stalled}})
    return None

  def allowance(self, p: ProcState) -> float:
    """How long `p` may go without progress before it counts as hung."""
    if p.phase == 'checkpoint':
      return self.save_s
    if p.phase in SLOW_PHASES:
      return self.cfg.collective_timeout_s
    return max(self.cfg.progress_timeout_s, STEP_TIMES * p.step_time)

  def _allowance_text(self, p: ProcState) -> str:
    if p.phase == 'checkpoint' and self.save_s > self.cfg.collective_timeout_s:
      return f'CheckpointConfig.io_timeout_s = {self.save_s}s (in phase checkpoint)'
    if p.phase in SLOW_PHASES:
      return f'collective_timeout_s = {self.cfg.collective_timeout_s}s (in phase {p.phase})'
    if STEP_TIMES * p.step_time > self.cfg.progress_timeout_s:
      return f'{STEP_TIMES} times its last step ({p.step_time:.1f}s)'
    return f'progress_timeout_s = {self.cfg.progress_timeout_s}s'

  def max_step(self) -> Optional[int]:
    steps = [p.step for p in self.procs.values() if p.step is not None]
    return max(steps) if steps else None

  def min_step(self) -> Optional[int]:
    steps = [p.step for p in self.procs.values() if p.step is not None]
    return min(steps) if len(steps) == len(self.procs) and steps else None


def culprits(stalled: list[ProcState], resolution_s: float = 1.0) -> list[int]:
  """Which of the stalled processes stopped first.

  In a hang every process ends up waiting: the healthy ones inside the
  collective the culprit never joined, having dispatched that step (the
  loop runs one step ahead of the metrics), the culprit one step behind
  (MegaScale §8: the ranks that fell silent first are the culprits). So the
  processes furthest behind, by (loop step, step), are named; when all are
  level, those whose progress stopped earliest, more than `resolution_s`
  before the others. Heartbeats tell when a process stopped only to within
  their interval (and an agent's relay): closer than that, all level is a
  hang inside the step (a device, a link) that heartbeats cannot place, and
  no process is named; the stack dumps and every host's diagnosis are what
  tell. (Naming those that happened to report last named a random quarter
  to half of a large job, each then given link checks.)
  """
  known = [p for p in stalled if p.step is not None]
  if not known:
    return sorted(p.process for p in stalled)
  pos = lambda p: (p.loop_step if p.loop_step is not None else p.step, p.step)
  low = min(pos(p) for p in known)
  at_low = [p for p in known if pos(p) == low]
  if len(at_low) < len(known):
    return sorted(p.process for p in at_low)
  first = min(p.last_progress for p in at_low)
  early = [p.process for p in at_low if p.last_progress - first <= resolution_s]
  return sorted(early) if len(early) < len(at_low) or len(known) == 1 else []


def parse_stacks(text: str, frames: int = 4) -> list[dict]:
  """faulthandler's dump -> [{"thread", "current", "frames", "where"}], the
  thread that took the signal (the main one, in CPython) first.

  `frames` are the innermost ones (often inside jax, waiting); `where` is
  the innermost frame in mjax's own code: what the trainer was doing."""
  threads, cur = [], None
  for line in text.splitlines():
    m = re.match(r'(Current thread|Thread) (0x[0-9a-f]+)', line)
    if m:
      cur = {'thread': m.group(2), 'current': m.group(1) == 'Current thread', 'frames': [], 'where': None}
      threads.append(cur)
    elif cur is not None and line.startswith('  File '):
      frame = line.strip()
      if len(cur['frames']) < frames:
        cur['frames'].append(frame)
      if cur['where'] is None and f'{os.sep}mjax{os.sep}' in frame:
        cur['where'] = frame
  return sorted(threads, key=lambda t: not t['current'])
