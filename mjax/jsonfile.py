"""Small JSON files that no reader ever sees half of, new files placed
whole (`place_new`), and JSON read from files others wrote (`load`).

Caches and records shared between processes (the measured peak, the
diagnostics' baselines, the blocked hosts) are rewritten whole: written to
a temporary name, then renamed over the old file, which is atomic on POSIX,
so a concurrent reader or a crash mid-write finds the old file or the new
one. (mjax/protocol.py keeps its own few lines of the same: it imports
nothing from mjax.)
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any


def loads(text: str | bytes) -> Any:
  """json.loads, with input nested too deeply for Python's parser (a line of
  100,000 '[') refused as any other malformed JSON is: a ValueError
  (json.JSONDecodeError), which every reader of a file a user or another
  process wrote already handles, instead of a RecursionError."""
  try:
    return json.loads(text)
  except RecursionError:
    raise json.JSONDecodeError('nested too deeply to be read', text if isinstance(text, str) else '', 0) \
        from None


def load(fh) -> Any:
  """json.load with `loads`' handling of too deep nesting."""
  return loads(fh.read())


def write_atomic(path: str, obj: Any, **dump_kw) -> None:
  """`obj` as JSON at `path` (its directory created), replacing the file whole."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f'{path}.{os.getpid()}.{threading.get_ident()}.tmp'
  with open(tmp, 'w') as fh:
    json.dump(obj, fh, **dump_kw)
  os.replace(tmp, path)


def current_umask() -> int:
  """This process's umask (reading it means setting it: set it back at once)."""
  mask = os.umask(0)
  os.umask(mask)
  return mask


def place_new(tmp: str, path: str) -> None:
  """Moves the finished file `tmp` (on the same filesystem) to `path`, which
  must not exist: FileExistsError, never a replaced file, if it appeared
  meanwhile (a user's file, or a link someone put there). The temporary
  file was private (mkstemp); the placed one is as readable as any file
  this user creates."""
  os.chmod(tmp, 0o666 & ~current_umask())
  try:
    os.link(tmp, path)            # fails where `path` exists, unlike a rename
  except FileExistsError:
    raise
  except OSError:                 # a filesystem without hard links
    if os.path.lexists(path):
      raise FileExistsError(path) from None
    os.rename(tmp, path)
    return
  os.unlink(tmp)
