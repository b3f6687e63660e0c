"""A jax.profiler trace of chosen train steps (TrainConfig.profile_steps,
TrainConfig.profile_from_step), with what bench/trace_summary.py needs beside
it: the step's optimized HLO and how many steps the trace holds."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

import jax

from mjax.config import Config


PROFILE_STEPS_FILE = 'profile_steps.json'


def write_profile_steps(directory: str, steps: int, first_step: Optional[int] = None) -> None:
  """Records beside a trace how many train steps it holds."""
  with open(os.path.join(directory, PROFILE_STEPS_FILE), 'w') as fh:
    json.dump({'steps': int(steps), 'first_step': first_step}, fh)


class StepProfiler:
  """A jax.profiler trace of TrainConfig.profile_steps steps from
  TrainConfig.profile_from_step (0: the second step of this run, past the
  first one's warm-up) into <workdir>/profile, with a Perfetto trace and the
  step's optimized HLO (train_step.hlo.txt), whose source locations let
  bench/trace_summary.py sum the trace by part of the model."""

  def __init__(self, cfg: Config, workdir: str, start_step: int, hlo_text: Callable[[], str]):
    self.hlo_text = hlo_text
    self.steps = cfg.train.profile_steps
    self.first = cfg.train.profile_from_step or start_step + 2
    self.last = self.first + self.steps - 1
    self.directory = os.path.join(workdir, 'profile')
    self.active = False
    self.done = self.first - 1
    traced = os.path.exists(os.path.join(self.directory, PROFILE_STEPS_FILE))   # by an earlier start
    if self.steps and not start_step < self.first <= cfg.train.steps and jax.process_index() == 0 and \
        not (traced and self.first <= start_step):
      # Else the run ends with no trace and no word of why.
      when = (f'TrainConfig.profile_from_step = {cfg.train.profile_from_step}' if cfg.train.profile_from_step
              else f'TrainConfig.profile_from_step = 0 (the second step of this run, {self.first})')
      print(f'mjax: warning: {when}: this run trains steps {start_step + 1}-{cfg.train.steps}, so nothing is '
            f'profiled. Set profile_from_step to a step in that range.', flush=True)

  def before(self, step: int) -> None:
    if self.steps and step == self.first:
      jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
      self.active = True

  def after(self, step: int, state: Any) -> None:
    if self.active:
      self.done = step
    if self.active and step >= self.last:
      jax.block_until_ready(state)   # the traced steps' device work inside the trace
      self._stop()

  def _stop(self) -> None:
    jax.profiler.stop_trace()
    self.active = False
    if jax.process_index() == 0:
      with open(os.path.join(self.directory, 'train_step.hlo.txt'), 'w') as fh:
        fh.write(self.hlo_text())
      # How many steps the trace holds (fewer than asked if the run stopped
      # inside them): trace_summary divides by it.
      write_profile_steps(self.directory, self.done - self.first + 1, self.first)
      if self.done < self.first:   # stopped inside the first traced step
        print(f'mjax: the run ended inside step {self.first}, the first to profile: the trace in '
              f'{self.directory} holds no whole step.', flush=True)
      else:
        print(f'mjax: profiled steps {self.first}-{self.done} into {self.directory} (TensorBoard\'s profile '
              f'plugin, or the perfetto_trace.json.gz in ui.perfetto.dev)', flush=True)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    if self.active:   # the run stopped inside the traced steps
      self._stop()
    return False
