"""The one exception the data pipeline raises for bad sources or requests."""

import errno

from mjax.errors import UserError


class DataError(UserError):
  """The data source cannot produce what was asked of it.

  The message names the file or directory at fault and, where there is one,
  the expected and the found value.
  """


# Why a read fails that a restart cannot cure: the file is not readable as it
# is. Other errors (EIO from a disk, ESTALE from NFS) are the storage's:
# mjax.errors.Fault, which the fault-tolerance driver restarts.
BAD_INPUT_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR,
                              errno.ELOOP, errno.ENAMETOOLONG})
