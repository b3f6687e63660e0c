"""Executors: where a host's training processes run.

The driver (mjax/ft/driver.py) talks to hosts only through an executor:
`coordinator(port)`, `start(argv, env, log_path)` -> a handle, `kill(handle)`
and `run(argv, env, timeout)` (diagnostics). Handles offer what
subprocess.Popen does: poll, send_signal, wait, pid, returncode.
`LocalExecutor` runs a host slot as processes on this machine; an executor
for remote hosts (ssh, a Kubernetes pod per host) would implement the same
methods, with its handles forwarding signals to the remote process.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Sequence


class LocalExecutor:
  """A host slot on this machine. A remote executor (ssh, a Kubernetes pod)
  would offer the same four methods, and handles with Popen's poll /
  send_signal / wait / pid / returncode; the driver uses nothing else."""

  def __init__(self, host: str):
    self.host = host

  def coordinator(self, port: int) -> str:
    """The coordinator address when this host runs process 0."""
    return f'127.0.0.1:{port}'

  def start(self, argv: Sequence[str], env: dict, log_path: str) -> subprocess.Popen:
    """Starts a process; its stdout and stderr are appended to `log_path`."""
    from mjax.launch import start_logged
    return start_logged(argv, env, log_path, new_session=True)

  def kill(self, handle: subprocess.Popen) -> None:
    """SIGKILL to the process and anything it started (its own session)."""
    try:
      os.killpg(handle.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass

  def run(self, argv: Sequence[str], env: dict, timeout: float) -> tuple[int, str, str]:
    """Runs a command to completion: (status, stdout, stderr); status 124 on timeout."""
    try:
      p = subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=timeout)
      return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
      return 124, e.stdout or '', f'timed out after {timeout:.0f}s'
