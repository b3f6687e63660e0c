"""StepGC: Python's collector at fixed steps only, and as it was afterwards."""

import gc

from mjax.ft import gc_control
from mjax.ft.gc_control import StepGC


class Node:
  def __init__(self):
    self.me = self   # a reference cycle: only the collector frees it


def _collections(fn) -> int:
  seen = []
  cb = lambda phase, info: seen.append(info['generation']) if phase == 'start' else None
  gc.callbacks.append(cb)
  try:
    fn()
  finally:
    gc.callbacks.remove(cb)
  return len(seen)


def test_no_automatic_collection_inside_and_the_collector_restored_after():
  assert gc.isenabled()
  # CPython 3.12 starts with a few hundred frozen, and puts them back now
  # and then after an unfreeze (gc_control._FROZEN_AT_IMPORT).
  frozen = gc.get_freeze_count()
  with StepGC(every=3) as c:
    assert not gc.isenabled() and gc.get_freeze_count() > frozen + 1000   # start-up's objects frozen out
    # Far more cyclic garbage than the thresholds (700 allocations) allow
    # outside: no collection runs until the loop asks for one.
    assert _collections(lambda: [Node() for _ in range(50_000)]) == 0
    assert [s for s in range(1, 10) if c.due(s)] == [3, 6, 9]
    assert _collections(c.collect) == 1 and c.collections == 1 and c.seconds > 0
  assert gc.isenabled() and gc.get_freeze_count() <= max(frozen, gc_control._FROZEN_AT_IMPORT)
  assert _collections(lambda: [Node() for _ in range(50_000)]) > 0


def test_zero_leaves_the_collector_alone_and_a_callers_freeze_is_kept():
  frozen = gc.get_freeze_count()
  with StepGC(every=0) as c:
    assert gc.isenabled() and gc.get_freeze_count() == frozen and not c.due(100)
  gc.freeze()
  try:
    with StepGC(every=5):
      assert not gc.isenabled()
    # Still frozen (an unfreeze empties it; the count itself moves as frozen
    # objects are freed by their reference counts, from any thread).
    assert gc.isenabled() and gc.get_freeze_count() > 0
  finally:
    gc.unfreeze()


def test_the_collector_is_restored_when_the_loop_fails():
  frozen = gc.get_freeze_count()
  try:
    with StepGC(every=2):
      raise RuntimeError('step failed')
  except RuntimeError:
    pass
  assert gc.isenabled() and gc.get_freeze_count() <= max(frozen, gc_control._FROZEN_AT_IMPORT)


def test_an_interpreter_that_starts_with_objects_frozen_still_gets_the_freeze(monkeypatch):
  # CPython 3.12 starts with a few hundred objects frozen (3.11 with none).
  # Read as a caller's freeze, they had kept the loop from freezing its own
  # start-up objects: every collection walked the whole heap (0.28 s on the
  # tiny model, against 0.4 ms frozen). Here such an interpreter, on any.
  gc.freeze()
  try:
    monkeypatch.setattr(gc_control, '_FROZEN_AT_IMPORT', gc.get_freeze_count())
    alive = [Node() for _ in range(20_000)]   # alive at the loop's start: frozen out
    before = gc.get_freeze_count()
    with StepGC(every=1):
      assert not gc.isenabled() and gc.get_freeze_count() > before + len(alive)
    assert gc.isenabled() and gc.get_freeze_count() <= before
  finally:
    gc.unfreeze()


def test_a_negative_cadence_is_refused_by_name():
  import pytest
  from mjax import config as C
  with pytest.raises(C.ConfigError, match=r'TrainConfig.gc_every_steps = -1 is not allowed: must be >= 0'):
    C.load_config(['tiny.gin'], ['TrainConfig.gc_every_steps = -1'])
  assert C.load_config(['tiny.gin'], ['TrainConfig.gc_every_steps = 0']).train.gc_every_steps == 0
