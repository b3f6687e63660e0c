"""Test-only fault injection, from the environment.

    MJAX_FAULT="kill:step=12:process=1"     SIGKILL itself before step 12
    MJAX_FAULT="hang:step=12:process=0"     stop making progress at step 12
    MJAX_FAULT="slow:factor=1.3:process=2"  every step takes 1.3x as long
    MJAX_FAULT="throttle:factor=0.3:process=1:step=5"
                                            from step 5, stopped (SIGSTOP) 30% of the time,
                                            in cycles of 0.1 s: slowed inside the step, like a
                                            throttled device, so the others wait in collectives
    MJAX_FAULT="delay:seconds=0.5"          every step takes 0.5 s longer (time to act in)
    MJAX_FAULT="nan:step=8"                 report a NaN loss at step 8
    MJAX_FAULT="overflow:step=8"            report an infinite gradient norm at step 8, its
                                            loss finite (a gradient that overflowed)
    MJAX_FAULT="spike:step=14:factor=20"    report each loss from step 14 on 20x as large (a
                                            loss spike, finite)
    MJAX_FAULT="exit:step=5:code=3"         exit with status 3 before step 5
    MJAX_FAULT="term:step=5"                SIGTERM itself before step 5 (a pre-emption, on cue)
    MJAX_FAULT="raise:step=5"               raise an exception before step 5 (a crash in Python:
                                            a data file gone bad), with a save perhaps in flight
    MJAX_FAULT="stall:phase=checkpoint:seconds=30:step=12"
                                            the first time the phase begins once step 12 has
                                            ended, stay in it 30 s longer (slow storage under a
                                            save, a long compile in an evaluation)

Several faults are separated by ';'. `process` defaults to every process.
A fault fires in the first attempt only, unless `attempt=N` names another
(the driver exports MJAX_ATTEMPT, counting restarts from 0), so a restarted
run goes past the step that failed; `attempt=-1` fires in every attempt. Nothing here is reachable unless
MJAX_FAULT is set: production runs never pay for it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from typing import Optional

from mjax import protocol
from mjax.errors import UserError

KINDS = ('kill', 'hang', 'slow', 'throttle', 'delay', 'nan', 'overflow', 'spike', 'exit', 'term', 'raise', 'stall')


class InjectedError(RuntimeError):
  """The 'raise' fault: a crash of the training loop's own code."""


@dataclasses.dataclass(frozen=True)
class InjectedFault:
  kind: str
  step: int = 0
  process: Optional[int] = None
  factor: float = 1.0
  seconds: float = 0.0
  code: int = 1
  attempt: int = 0
  phase: str = ''


# The keys a fault takes, and what each value must be.
INTS = ('step', 'process', 'code', 'attempt')
FLOATS = ('factor', 'seconds')
FIELDS = INTS + FLOATS + ('phase',)
_FORM = (f'each fault is KIND or KIND:KEY=VALUE:..., several separated by \';\' (e.g. \'nan:step=8\'); '
         f'the kinds: {", ".join(KINDS)}; the keys: {", ".join(INTS)} (whole numbers), {", ".join(FLOATS)} '
         f'(numbers) and phase (a phase name); see mjax/ft/inject.py, or unset {protocol.INJECT_ENV}')


def parse(spec: str) -> list[InjectedFault]:
  """Parses MJAX_FAULT.

  Raises:
    UserError: (a ValueError) naming the bad part and what is allowed: a
      typo in the test-only variable is bad input (exit status 2, never
      restarted), not a crash.
  """
  def bad(part: str, what: str) -> UserError:
    return UserError(f'{protocol.INJECT_ENV}={spec!r}: in {part!r}, {what}; {_FORM}.')

  faults = []
  for part in filter(None, (p.strip() for p in spec.split(';'))):
    kind, *fields = (x.strip() for x in part.split(':'))
    if kind not in KINDS:
      raise bad(part, f'unknown fault {kind!r}')
    kw = {}
    for f in fields:
      key, eq, value = (x.strip() for x in f.partition('='))
      if key not in FIELDS:
        raise bad(part, f'unknown key {key!r}')
      if not eq or not value:
        raise bad(part, f'{key} has no value (write {key}=VALUE)')
      try:
        kw[key] = float(value) if key in FLOATS else value if key == 'phase' else int(value)
      except ValueError:
        raise bad(part, f'{key}={value!r} is not {"a number" if key in FLOATS else "a whole number"}') from None
    if kind == 'throttle' and not 0 < kw.get('factor', 0) < 1:
      raise UserError(f'{protocol.INJECT_ENV}={spec!r}: {part!r}: a throttle\'s factor is the share of time '
                      f'stopped, between 0 and 1 (factor=0.3).')
    if kind == 'stall' and not kw.get('phase'):
      raise UserError(f'{protocol.INJECT_ENV}={spec!r}: {part!r}: a stall names its phase (phase=checkpoint).')
    faults.append(InjectedFault(kind, **kw))
  return faults


class Injector:
  """Fires the faults meant for this process at the right step."""

  def __init__(self, faults: list[InjectedFault], process_index: int, attempt: int):
    self.faults = [f for f in faults
                   if (f.process is None or f.process == process_index) and f.attempt in (attempt, -1)]
    self._t = None
    self._throttle: Optional[subprocess.Popen] = None

  @classmethod
  def from_env(cls, process_index: int) -> Optional['Injector']:
    spec = os.environ.get(protocol.INJECT_ENV)
    if not spec:
      return None
    return cls(parse(spec), process_index, protocol.attempt())

  def close(self) -> None:
    """Stops a throttle: its child continues this process and exits."""
    if self._throttle is not None:
      self._throttle.terminate()
      self._throttle.wait(timeout=10)
      self._throttle = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
    return False

  def watch(self, timer) -> None:
    """Stalls go into the phases of `timer` (a PhaseTimer)."""
    stalls = [f for f in self.faults if f.kind == 'stall']

    def on_enter(name: str) -> None:
      for f in [f for f in stalls if f.phase == name and timer.step >= f.step]:
        stalls.remove(f)          # once
        time.sleep(f.seconds)
    if stalls:
      timer.on_enter.append(on_enter)

  def before_step(self, step: int) -> None:
    for f in self.faults:
      if f.kind == 'kill' and step == f.step:
        os.kill(os.getpid(), signal.SIGKILL)
      if f.kind == 'exit' and step == f.step:
        os._exit(f.code)
      if f.kind == 'term' and step == f.step:
        signal.raise_signal(signal.SIGTERM)
      if f.kind == 'raise' and step == f.step:
        raise InjectedError(f'injected error before step {step} ({protocol.INJECT_ENV})')
      if f.kind == 'hang' and step == f.step:
        while True:  # a stuck collective: alive, heartbeating, no progress
          time.sleep(3600)
      if f.kind == 'throttle' and step >= f.step and self._throttle is None:
        self._throttle = _start_throttle(f.factor)
    self._t = time.perf_counter()

  def after_step(self, step: int, metrics: dict) -> None:
    """Changes the step's metrics as reported (a NaN loss, an infinite
    gradient norm) when such a fault fires."""
    for f in self.faults:
      if f.kind == 'slow' and self._t is not None:
        time.sleep((f.factor - 1.0) * (time.perf_counter() - self._t))
      if f.kind == 'delay':
        time.sleep(f.seconds)
      if f.kind == 'nan' and step == f.step:
        metrics['loss'] = float('nan')
      if f.kind == 'overflow' and step == f.step:
        metrics['grad_norm'] = float('inf')
      if f.kind == 'spike' and step >= f.step:
        metrics['loss'] = metrics['loss'] * f.factor


# A process cannot resume itself from SIGSTOP: a child stops and continues it,
# and continues it for good when told to stop (SIGTERM, `Injector.close`) or
# when the parent is gone. (A child killed outright, SIGKILL, can leave the
# parent stopped: test-only, so no more than that.)
_THROTTLE = """
import os, signal, sys, time
pid, stopped = int(sys.argv[1]), float(sys.argv[2])
signal.signal(signal.SIGTERM, lambda *_: (os.kill(pid, signal.SIGCONT), sys.exit(0)))
try:
  while os.getppid() == pid:
    os.kill(pid, signal.SIGSTOP); time.sleep(0.1 * stopped)
    os.kill(pid, signal.SIGCONT); time.sleep(0.1 * (1 - stopped))
except ProcessLookupError:
  pass
finally:
  try:
    os.kill(pid, signal.SIGCONT)
  except ProcessLookupError:
    pass
"""


def _start_throttle(share: float) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, '-c', _THROTTLE, str(os.getpid()), str(share)])
