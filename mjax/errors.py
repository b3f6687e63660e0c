"""The one base class of errors that are the user's to fix.

A `UserError` means the input is wrong: a config key or value, a data file,
the distributed set-up, a checkpoint path. Retrying cannot help, so every
entry point turns it into one paragraph on stderr and exit status 2
(`mjax.protocol.EXIT_USER_ERROR`, in `mjax.cli`), and the fault-tolerance
driver never restarts a job that exited with it. Anything else that escapes
is a crash, which the driver does restart.

A `Fault` is a crash whose cause is known and is not the input's: a peer
process that never joined, a port another program holds, a disk that
failed (a full one is bad input: a restart would fail the same way). It
is printed as one paragraph too, but exits 1 (`EXIT_FAILED`), so the
driver restarts the job as after any crash. A `HostFault` is a Fault found
in a few processes of the job only (their hosts' storage), which the
driver then restarts without those hosts.

This module imports nothing from mjax: every layer may raise these.
"""

import argparse
import errno

# What a write meets when its directory stops taking files (errno, and
# strerror: libraries such as Orbax and TensorStore wrap the OSError in
# exceptions of their own, whose text still says it). No restart cures these.
UNWRITABLE = {errno.ENOSPC: 'No space left on device', errno.EDQUOT: 'Disk quota exceeded',
              errno.EROFS: 'Read-only file system', errno.EACCES: 'Permission denied',
              errno.EPERM: 'Operation not permitted'}


class UserError(ValueError):
  """Bad input; the message names the bad value and what is allowed."""


class Fault(RuntimeError):
  """A known failure of the machine or the job around the process; the
  message says what failed, where, and what to check. A restart may cure it."""


class HostFault(Fault):
  """A fault of the hosts of `processes` alone: the job's other processes
  passed the same check, so the input is fine and those hosts are not (a
  mount missing or read-only there, their disk full)."""

  def __init__(self, message: str, processes):
    super().__init__(message)
    self.processes = sorted(int(p) for p in processes)


def few_processes(failed, count: int) -> bool:
  """Whether `failed` processes of `count` are few enough to blame their
  hosts rather than the input: fewer than half. One of two is ambiguous
  (a directory only process 0's machine has is the input's fault), so a
  job of two never blames a host."""
  return 0 < len(failed) and 2 * len(failed) < count


def refused_write(e: OSError, path: str, what: str) -> Exception:
  """What to raise for a write to `path` that failed with `e`: a UserError
  naming the file and what to do where its filesystem takes no more files
  (UNWRITABLE: a restart would fail the same way); `e` itself otherwise."""
  if e.errno not in UNWRITABLE:
    return e
  return UserError(f'{what} cannot be written to {path!r}: {e.strerror or e} (errno {e.errno}). The '
                   f'checkpoints saved so far are kept; free space there or make it writable (or give --workdir on another '
                   f'filesystem, with CheckpointConfig.directory where the checkpoints are) and run the same '
                   f'command again: it resumes from the newest checkpoint.')


class RefusingParser(argparse.ArgumentParser):
  """An ArgumentParser whose usage errors raise UserError instead of exiting
  (arguments checked on behalf of another command); -h is one of them."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault('add_help', False)
    super().__init__(*args, **kwargs)

  def error(self, message):
    raise UserError(message)
