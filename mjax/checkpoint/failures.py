"""A failed save or read, said once.

A directory that takes no more files (full, over quota, read-only) is bad
input, not a crash: one message naming the tier and the steps kept
(`full_disk_is_bad_input`). A background save that failed in one process
of a job ends that process rather than hanging the others in Orbax's
barriers (`FailedSave`, `Checkpointer._watch_saves`). A damaged step's read
is one line naming the array (`read_error`), not TensorStore's spec. Orbax's
and asyncio's own logs of the same failure are kept quiet
(`quiet_failed_io_aftermath`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import socket
import sys
import threading
import traceback
import warnings
from typing import Any, Optional

import jax

from mjax.checkpoint.directories import steps_in, tier_key
from mjax.config import ConfigError
from mjax.errors import UNWRITABLE


_PROBE_BYTES = 1 << 20  # a full filesystem refuses a megabyte as surely as a checkpoint
_NO_SPACE = UNWRITABLE[errno.ENOSPC]   # in what Orbax and TensorStore raise and log


def _unwritable(exc: BaseException) -> Optional[str]:
  """The strerror of `exc` (or of an exception it wraps) when it says the
  directory takes no more files, else None."""
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    code = getattr(exc, 'errno', None)
    if code in UNWRITABLE:
      return UNWRITABLE[code]
    text = str(exc)
    found = next((said for said in UNWRITABLE.values() if said in text), None)
    if found:
      return found
    exc = exc.__cause__ or exc.__context__
  return None


def kept_steps(tier: Any) -> str:
  """The steps a tier holds, as a failed save's message lists them: from
  the disk, since Orbax has already struck the steps beyond `keep` from its
  own list, though they are deleted only after a save commits."""
  try:
    return ', '.join(map(str, steps_in(tier.directory))) or 'none'
  except OSError:
    return 'not readable now'


def unwritable_error(tier: Any, step: Optional[int], said: str) -> ConfigError:
  """The one paragraph for a save into `tier` that failed with `said` (an
  UNWRITABLE strerror): what failed, the steps kept, what to do."""
  kept = kept_steps(tier)
  full = said in (_NO_SPACE, 'Disk quota exceeded')
  return ConfigError(
      f'the {tier.name} checkpoint tier ({tier.directory}) ' + ('is full' if full else 'takes no more files') +
      f': a save ({"step " + str(step) + ", or the one before it still being written" if step is not None else "the last one"}) '
      f'failed with "{said}". The steps saved before are intact (saved steps: {kept}); ' +
      ('free space there (older steps can go: a restart resumes from the newest), ' if full else
       'make it writable again, ') +
      f'or point CheckpointConfig.{tier_key(tier.name)} at another filesystem, then start again: the run '
      f'resumes from the newest of them.')


@contextlib.contextmanager
def full_disk_is_bad_input(tier: Any, step: Optional[int]):
  """A save that fails because its directory takes no more files (full,
  over quota, remounted read-only, permissions taken away; now, or an
  earlier asynchronous save surfacing here) is bad input, not a crash: a
  restart would fail the same way, so it exits 2 with one message. Orbax
  writes each step into a temporary directory and commits it by a rename,
  so the steps already saved are untouched."""
  try:
    yield
  except Exception as e:   # Orbax wraps the OSError (ValueError: RESOURCE_EXHAUSTED ...)
    said = _unwritable(e)
    if said is None:
      raise
    FailedSave.said_here.set()   # the save watch has nothing left to say
    raise unwritable_error(tier, step, said) from None


class FailedSave:
  """A background save of this process that failed, as Orbax logged it
  (`_FailedIoLogFilter` sees the record): `said` is the strerror where the
  directory takes no more files (bad input), else None (a fault), and
  `error` the exception's own words.

  In a multi-process job such a failure never reaches the main thread
  unless every process shares it: Orbax's finalize thread of the failed
  process goes on to its closing barrier, while the processes whose writes
  succeeded wait in the "write complete" barrier before it. Each waits for
  the other until CheckpointConfig.io_timeout_s (30 minutes by default),
  saying nothing, and the main thread waits on the finalize thread at its
  next save. `Checkpointer._watch_saves` ends the process instead, with the
  message the main thread would have given."""
  seen = threading.Event()
  said_here = threading.Event()   # the main thread raised it itself
  text = ''
  said: Optional[str] = None
  error = ''

  @classmethod
  def note(cls, text: str, said: Optional[str], error: str) -> None:
    if not cls.seen.is_set():
      cls.text, cls.said, cls.error = text, said, error
      cls.seen.set()


def write_problem(directory: str) -> Optional[str]:
  """Why `directory` cannot take files (read-only, full, not a directory, no
  permission), or None. Creates it if needed; remote paths are not probed."""
  if '://' in directory:
    return None
  if os.path.exists(directory) and not os.path.isdir(directory):
    return 'it is a file, not a directory'
  probe = os.path.join(directory, f'.mjax-write-probe-{socket.gethostname()}-{os.getpid()}')
  try:
    os.makedirs(directory, exist_ok=True)
    with open(probe, 'wb') as fh:
      fh.write(b'\0' * _PROBE_BYTES)
      fh.flush()
      os.fsync(fh.fileno())
  except OSError as e:
    return f'{e.strerror or type(e).__name__} ({errno.errorcode.get(e.errno, e.errno)})'
  finally:
    try:
      os.unlink(probe)
    except OSError:
      pass
  return None


class BadRecord(Exception):
  """A step's JSON record that is missing or not JSON; says which."""


# What `read_error` says of a checkpoint whose arrays are not the ones the
# config makes (`OTHER_MODEL` + ' shape' / ' structure', or OTHER_OPTIMIZER):
# no other step of that run reads either, and the advice is the config, not
# the files (`other_config`).
OTHER_MODEL = 'the checkpoint holds a model of another'
OTHER_OPTIMIZER = 'the checkpoint holds the state of another optimizer'
_SAVED_WITH = 'with the config.gin of the run that saved it'


def _compare(section: str) -> str:
  return f'compare {section} {_SAVED_WITH}'


def other_config(why: str) -> bool:
  """Whether `read_error`'s `why` says the checkpoint is of another config."""
  return _SAVED_WITH in why


def _structure_problem(text: str) -> Optional[str]:
  """One line for Orbax's "tree structures do not match" (its diff: each
  path, then `- Source:` the config's array or MISSING, `- Target:` the
  checkpoint's): the first array of the params that differs, the count."""
  if not text.startswith('User-provided restore item and on-disk value metadata tree structures do not match'):
    return None
  diffs = re.findall(r'^(\S[^\n]*):\n\s+- Source: ([^\n]*)\n\s+- Target: ([^\n]*)', text, re.M)
  if not diffs:
    return f'the checkpoint\'s arrays are not the ones this config makes: {OTHER_MODEL} structure'
  path, source, target = min(diffs, key=lambda d: not d[0].startswith('params'))   # the params first
  what = (f'the config makes {path}, the checkpoint has no such array' if target.strip() == 'MISSING' else
          f'the checkpoint holds {path}, which the config does not make' if source.strip() == 'MISSING' else
          f'{path} differs between the config and the checkpoint')
  more = f' ({len(diffs)} arrays differ)' if len(diffs) > 1 else ''
  if not path.startswith('params'):
    # The model's arrays are alike; its optimizer's state is not.
    return f'{what}{more}: {OTHER_OPTIMIZER}; {_compare("OptimConfig")}'
  return (f'{what}{more}: {OTHER_MODEL} structure (tied or untied embeddings, biases, norms, '
          f'scanned or unrolled layers); {_compare("ModelConfig")}')


def read_error(e: BaseException) -> str:
  """One line on why a read failed. TensorStore's own error is mostly the
  store's spec (pages of JSON, 'See full TensorStore details'); the error it
  wraps names the array, the file and what is wrong with it (e.g.
  'OUT_OF_RANGE: Error reading "params.embedding/0.0" ... not valid for
  value of size 100'), so the innermost cause that says something wins."""
  if isinstance(e, BadRecord):
    return str(e)
  chain, x = [], e
  while x is not None and len(chain) < 8:
    chain.append(x)
    # A context raised `from None` is an implementation detail (json's
    # decoder leaves StopIteration(0) there): never the reason to show.
    x = x.__cause__ or (None if x.__suppress_context__ else x.__context__)
  for x in reversed(chain):
    first = str(x).splitlines()[0] if str(x) else ''
    shapes = re.search(r'Requested shape: (\(.*?\)) is not compatible with the stored shape: (\(.*?\))', first)
    if shapes:
      # Orbax's advice (`strict=False`, padding and truncation) is for its
      # own callers: a model of another shape is never what to restore.
      return (f'an array is {shapes.group(2)} in the checkpoint and {shapes.group(1)} in this config: '
              f'{OTHER_MODEL} shape; {_compare("ModelConfig")}')
    structure = _structure_problem(str(x))
    if structure:
      return structure
    if first and 'TensorStore details' not in first:
      return f'{type(x).__name__}: {first}'[:500]
  # Only the store's spec: its kvstore paths name the step's directory and,
  # last, the array ('opt_state.1.mu.layers.block_0.attn.query.kernel/').
  text = str(e)
  paths = re.findall(r"'path': '([^']*)'", text)
  head = text.splitlines()[0].split(' See full TensorStore details')[0] if text else ''
  if len(paths) > 1:
    head += f' (array {paths[-1].rstrip("/")!r} in {paths[0]})'
  elif paths:
    head += f' (in {paths[0]})'
  return f'{type(e).__name__}: {head}'[:500]


# What Orbax's failed read of an array says (its read tasks' exceptions).
READ_FAILED = 'Encountered error while reading array index'


# Where Orbax's background save thread logs the failure of a save's writes.
_ORBAX_SAVE_THREAD_FILE = 'async_checkpointer.py'


class _FailedIoLogFilter(logging.Filter):
  """Drops Orbax's own error logs (with their tracebacks, one per thread of
  the save) of a write that found the disk full or unwritable:
  `full_disk_is_bad_input` reports that once, naming the tier and the
  steps kept. Drops too asyncio's report of each read task of a damaged
  step (a truncated file: one traceback of ~80 lines per array, up to
  hundreds, as the collector finds them): the restore says why the step
  cannot be used once (`read_error`) and falls back."""

  def filter(self, record: logging.LogRecord) -> bool:
    # asyncio's: a write task of the failed save, or a read task of the
    # failed restore, collected with its error never retrieved ("Task
    # exception was never retrieved").
    text = record.getMessage()
    exc = record.exc_info[1] if record.exc_info else None
    if record.name == 'asyncio':
      # A task names its coroutine (Orbax's) in the message; a bare future
      # ("Future exception was never retrieved") only in its error's frames.
      frames = traceback.extract_tb(exc.__traceback__) if exc is not None else []
      where = text + ' '.join(f.filename for f in frames)
    else:
      where = record.pathname
    if f'{os.sep}orbax{os.sep}' not in where:
      return True
    if exc is not None:
      text += f' {exc}'
    if record.name == 'asyncio' and READ_FAILED in text:
      return False
    said = next((said for said in UNWRITABLE.values() if said in text), None)
    # Orbax's record of a failed background save (its save thread's, with
    # the exception): what `Checkpointer._watch_saves` acts on. A failure in
    # the main thread is raised there; one Orbax logs and goes on from (an
    # old step it could not delete) is no failed save.
    if os.path.basename(record.pathname) == _ORBAX_SAVE_THREAD_FILE and record.levelno >= logging.ERROR and \
        record.exc_info and record.exc_info[1] is not None and record.threadName != 'MainThread':
      exc = record.exc_info[1]
      if isinstance(exc, TimeoutError) and 'barrier' in str(exc):
        # This process's writes went well; the barrier after them failed,
        # because another process left (its own log says why) or never came.
        # One line, not Orbax's traceback through jax's barrier.
        record.msg, record.args, record.exc_info, record.exc_text = (
            f'[process={jax.process_index()}] a checkpoint save\'s writes are done here, but the processes '
            f'did not all finish theirs ({exc}): another process of the job left or is stuck; its log says why.',
            None, None, None)
        return True
      first = (str(exc).strip().splitlines() or [''])[0]
      FailedSave.note(text, said, f'{type(exc).__name__}: {first}'[:500])
    return said is None


def quiet_failed_io_aftermath() -> None:
  """Keeps a save that found the disk full, or a restore of a damaged step,
  to one message.

  Orbax logs the failed write from each of its save threads, with a
  traceback. Then it closes its asyncio loop while TensorStore is still
  finishing the save's other writes; each completion's callback into the
  closed loop raises RuntimeError('Event loop is closed') in a TensorStore
  thread, which Python reports as unraisable: one traceback per array (58 for
  `tiny`, ~330 lines in all before the message that matters). The log
  filter drops Orbax's records that say the disk is full; the hook drops a
  closed loop's refusal of a late callback (raised in asyncio's
  call_soon_threadsafe, which nothing can act on once the loop is gone) and
  hands every other unraisable exception on.
  """
  for logger in (logging.getLogger('absl'), logging.getLogger('asyncio')):
    if not any(isinstance(f, _FailedIoLogFilter) for f in logger.filters):
      logger.addFilter(_FailedIoLogFilter())
  # A restore that fails on one array leaves Orbax's reads of the others
  # unstarted: each coroutine, collected, warns "was never awaited" (seen in
  # about one fallback in six, after the fallback had been said).
  warnings.filterwarnings('ignore', message=r"coroutine '_read_array_index_and_device_put' was never awaited",
                          category=RuntimeWarning)
  previous = sys.unraisablehook
  if getattr(previous, 'mjax_closed_loop_filter', False):
    return

  def hook(unraisable):
    exc = unraisable.exc_value
    if isinstance(exc, RuntimeError) and str(exc) == 'Event loop is closed' and \
        any(f.name == 'call_soon_threadsafe' for f in traceback.extract_tb(exc.__traceback__)):
      return
    # A read that failed leaves its sibling reads' coroutines to be closed
    # by the collector, each reporting the failure again: the read's error
    # itself has been said (read_error).
    if str(exc).startswith(READ_FAILED) and \
        isinstance(exc.__cause__, GeneratorExit):
      return
    previous(unraisable)

  hook.mjax_closed_loop_filter = True
  sys.unraisablehook = hook
