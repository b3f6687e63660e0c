"""The one exception the data pipeline raises for bad sources or requests."""


class DataError(ValueError):
  """The data source cannot produce what was asked of it.

  The message names the file or directory at fault and, where there is one,
  the expected and the found value.
  """
