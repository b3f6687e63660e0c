"""Python's garbage collector at the same steps in every process (MegaScale §8).

Python collects cyclic garbage when its allocation counters say so: at a
moment of its own choosing, different in every process. A full collection
walks every tracked object, and a trained process holds hundreds of
thousands (jax, flax, orbax, the compiled programs: 355k objects and a
270 ms pause on the tiny model, bench/RESULTS.md). One process pausing
stalls all the others at the next collective, and with N processes each
pausing at its own time the job stalls N times as often: MegaScale traced a
slowly falling MFU to exactly this and fixed it by controlling the
collector.

So, for the training loop:
  * at its start, one full collection (start-up's garbage), then
    `gc.freeze()`: what is alive now (the model, the program, the libraries)
    lives for the run, and later collections skip it;
  * automatic collection off;
  * a full collection every `every` steps, at the same steps in every
    process, after the step is dispatched (the device computes meanwhile);
  * on the way out, the collector as it was (objects frozen before mjax was
    imported, such as CPython 3.12's own few hundred, leave the frozen set
    with ours: unfreeze() cannot tell them apart, and they are alive anyway).
Objects that die without a reference cycle are freed at once either way;
only cyclic garbage waits for the next collection.
"""

from __future__ import annotations

import gc
import time
from typing import Optional

# What is frozen before any loop of ours: the interpreter's own objects on
# some builds (CPython 3.12 starts with a few hundred frozen, and puts them
# back now and then after an unfreeze; 3.11 and 3.13 start with none) and
# whatever the program froze before importing mjax. A count above this at a
# loop's start is a caller's own freeze (see __enter__).
_FROZEN_AT_IMPORT = gc.get_freeze_count()


class StepGC:
  """Context manager around the loop; `due(step)` / `collect()` at the end of a step.

  every: steps between collections; 0 leaves Python's collector alone.
  """

  def __init__(self, every: int):
    self.every = every
    self._was_enabled: Optional[bool] = None
    self._froze = False
    self.collections = 0
    self.seconds = 0.0     # time spent in the loop's collections

  def __enter__(self) -> 'StepGC':
    if self.every:
      gc.collect()
      # A caller that froze objects itself keeps them frozen: unfreeze()
      # would release theirs too, so only a freeze of our own is undone.
      self._froze = gc.get_freeze_count() <= _FROZEN_AT_IMPORT
      if self._froze:
        gc.freeze()
      self._was_enabled = gc.isenabled()
      gc.disable()
    return self

  def due(self, step: int) -> bool:
    return bool(self.every) and step % self.every == 0

  def collect(self) -> float:
    """One full collection; its seconds."""
    t0 = time.perf_counter()
    gc.collect()
    dt = time.perf_counter() - t0
    self.collections += 1
    self.seconds += dt
    return dt

  def __exit__(self, *exc) -> bool:
    if self.every:
      if self._froze:
        gc.unfreeze()
      if self._was_enabled:
        gc.enable()
    return False
