"""The one exception the data pipeline raises for bad sources or requests."""

import errno
import os

from mjax.errors import Fault, UserError


class DataError(UserError):
  """The data source cannot produce what was asked of it.

  The message names the file or directory at fault and, where there is one,
  the expected and the found value.
  """


# Why a read fails that a restart cannot cure: the file is not readable as it
# is. Other errors (EIO from a disk, ESTALE from NFS) are the storage's.
_BAD_INPUT_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR,
                               errno.ELOOP, errno.ENAMETOOLONG})


def write_failure(e: OSError, path: str) -> str:
  """Why writing at `path` failed, in words: a file standing where a
  directory of the path should be (makedirs says only "File exists" or "Not
  a directory"), else the error's own."""
  parent = os.path.abspath(path)
  while parent != os.path.dirname(parent):
    if os.path.exists(parent) and not os.path.isdir(parent):
      return f'{parent} is a file, not a directory'
    parent = os.path.dirname(parent)
  return e.strerror or str(e)


def read_failure(e: OSError, bad_input: str, fault: str) -> Exception:
  """What a failed read of a data file raises: DataError(`bad_input`) where
  the file is not readable as it is, else Fault(`fault`), the storage's
  failure, which the fault-tolerance driver restarts."""
  return DataError(bad_input) if e.errno in _BAD_INPUT_ERRNOS else Fault(fault)
