"""The one exception the data pipeline raises for bad sources or requests."""

from mjax.errors import UserError


class DataError(UserError):
  """The data source cannot produce what was asked of it.

  The message names the file or directory at fault and, where there is one,
  the expected and the found value.
  """
