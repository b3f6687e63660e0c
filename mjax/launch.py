"""Starting the processes of a multi-process job on this machine.

The API, kept small because the fault-tolerance driver builds on it:

  local_env(process_id, num_processes, coordinator, devices_per_process=None,
            base_env=None) -> dict
      The environment of one process: base_env (default os.environ) plus
      MJAX_COORDINATOR_ADDRESS, MJAX_NUM_PROCESSES, MJAX_PROCESS_ID,
      MJAX_LAUNCH_TIME (time.time() now, for the start-up report) and, when
      devices_per_process is given, MJAX_LOCAL_DEVICE_COUNT, JAX_PLATFORMS=cpu
      and XLA_FLAGS whose --xla_force_host_platform_device_count is replaced.

  spawn_local(num_processes, devices_per_process, argv, workdir=None,
              env=None, port=None, stop_with_parent=False) -> list[subprocess.Popen]
      Starts `argv` num_processes times, coordinated on 127.0.0.1:port (a
      free port when None). Output: with `workdir`, process i writes stdout
      and stderr to <workdir>/logs/process-<i>.log (appended, so a restart
      keeps the earlier attempt's lines); without, every line goes to this
      process's stdout prefixed with '[i] '. With stop_with_parent (on
      Linux), each process gets SIGTERM when this one dies, however it dies
      (launch/local.py: no orphans); call it from the main thread, as the
      kernel sends that signal when the calling thread ends.

  wait_all(procs, timeout=None) -> list[int]
      Waits for every process. When one exits with a non-zero status the
      others are killed at once (a job that lost a process cannot finish its
      next collective, so waiting would only wait for a timeout); when
      `timeout` seconds pass, all are killed. Returns the exit codes in
      process order; a killed process reports -9 (-SIGKILL).

  free_port() -> int
      A TCP port on 127.0.0.1 that nothing listens on now.

The child environment is the contract of mjax/distributed.py, which reads it
in every process (`mjax-train` calls `initialize_from_env()` first thing).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any, Callable, Mapping, Optional, Sequence

from mjax import distributed


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on now.

  Returns:
    The port number. Another program may take it before the coordinator
    binds it: rare, but not never on a busy machine. A training attempt
    that loses it fails and is restarted; the driver's link check
    (health.HostChecks._link_pair) tries again on a new port before it blocks a host.
  """
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def count_problem(processes: Optional[int], devices: Optional[int]) -> Optional[str]:
  """What is wrong with a launcher's --processes / --devices (None: nothing;
  None for either: not given), the flag named with its value: the words of
  launch/local.py and mjax-launch alike."""
  for flag, value in (('--processes', processes), ('--devices', devices)):
    if value is not None and value < 1:
      return f'{flag} {value}: give at least 1' + (' (devices per process; left out, every real device)'
                                                   if flag == '--devices' else ' (processes in the job)')
  return None


def local_env(process_id: int, num_processes: int, coordinator: str,
              devices_per_process: Optional[int] = None,
              base_env: Optional[Mapping[str, str]] = None) -> dict:
  """The environment of process `process_id` of a job.

  Args:
    process_id: 0 .. num_processes - 1.
    num_processes: processes in the job.
    coordinator: host:port of process 0's coordinator service.
    devices_per_process: fake CPU devices per process (None: the devices
      the machine has, e.g. its GPUs).
    base_env: the variables to start from (default: os.environ).
  Returns:
    A new dict; base_env is not modified.
  """
  if not 0 <= process_id < num_processes:
    raise ValueError(f'process_id {process_id} is out of range for {num_processes} processes '
                     f'(0 .. {num_processes - 1}).')
  env = dict(os.environ if base_env is None else base_env)
  env.update({
      distributed.COORDINATOR: coordinator,
      distributed.NUM_PROCESSES: str(num_processes),
      distributed.PROCESS_ID: str(process_id),
      distributed.LAUNCH_TIME: repr(time.time()),
  })
  if devices_per_process is not None:
    if devices_per_process < 1:
      raise ValueError(f'devices_per_process must be at least 1, got {devices_per_process}.')
    env[distributed.LOCAL_DEVICE_COUNT] = str(devices_per_process)
    env['XLA_FLAGS'] = distributed.with_device_count(env.get('XLA_FLAGS', ''), devices_per_process)
    # Fake devices are CPU devices: without this a GPU machine would start
    # its GPUs instead and ignore the count.
    env['JAX_PLATFORMS'] = 'cpu'
  return env


def start_logged(argv: Sequence[str], env: Mapping[str, str], log_path: str,
                 new_session: bool = False, preexec_fn: Optional[Callable[[], None]] = None) -> subprocess.Popen:
  """Starts `argv` with stdout and stderr appended to `log_path` (a restart
  keeps the earlier attempt's lines). `new_session`: in a process group of its
  own, so that it and everything it starts can be killed together, and a
  Ctrl-C at the terminal reaches only the supervisor."""
  with open(log_path, 'ab') as log:
    return subprocess.Popen(list(argv), env=dict(env), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=new_session, preexec_fn=preexec_fn)


def _stopped_with_parent() -> Optional[Callable[[], None]]:
  """What a child runs before its program (Linux: a SIGTERM when this
  process dies, however it dies). launch/local.py killed outright (SIGKILL,
  the OOM killer) could forward nothing: with --log_dir its processes
  trained on unsupervised, holding the workdir's lock against the run
  started again. SIGTERM, not SIGKILL: a trainer saves and exits, as after
  a Ctrl-C. None elsewhere. (A child with this is forked, not vforked:
  jax, where imported, warns of that, so only the launcher asks for it.)"""
  if not sys.platform.startswith('linux'):
    return None
  import ctypes
  try:
    prctl = ctypes.CDLL(None, use_errno=True).prctl   # resolved here, not in the forked child
  except (OSError, AttributeError):
    return None
  parent = os.getpid()

  def preexec() -> None:
    prctl(1, signal.SIGTERM, 0, 0, 0)   # PR_SET_PDEATHSIG
    if os.getppid() != parent:   # died before the line above: no signal would come
      os.kill(os.getpid(), signal.SIGTERM)
  return preexec


def _pump(src: IO[bytes], prefix: str, dst: IO[str]) -> None:
  """Copies `src` to `dst` line by line, each line prefixed. Where `dst`
  fails (its reader gone, `| head`; a full disk), the rest is read and
  dropped: a pump that stopped reading would leave the process blocked on
  a full pipe, and the job hung."""
  binary = getattr(dst, 'buffer', None)
  for line in iter(src.readline, b''):
    try:
      if binary is not None:   # bytes as they came, whatever the encoding
        dst.flush()
        binary.write(prefix.encode() + line)
        binary.flush()
      else:
        dst.write(prefix + line.decode(errors='replace'))
        dst.flush()
    except OSError as e:
      print(f'{prefix}output dropped from here on: cannot write it ({e.strerror or e})', file=sys.stderr,
            flush=True)
      for _ in iter(src.readline, b''):
        pass
      break
  src.close()


def spawn_local(num_processes: int, devices_per_process: Optional[int], argv: Sequence[str],
                workdir: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
                port: Optional[int] = None, stop_with_parent: bool = False) -> list[subprocess.Popen]:
  """Starts `argv` as the processes of one job on this machine.

  Args:
    num_processes: how many processes.
    devices_per_process: fake CPU devices per process, or None.
    argv: the command, e.g. ['mjax-train', '--gin_file', 'configs/tiny.gin'].
    workdir: where logs/process-<i>.log go; None: this process's stdout,
      each line prefixed with '[i] '.
    env: the base environment (default: os.environ).
    port: the coordinator's port on 127.0.0.1 (default: a free one).
    stop_with_parent: on Linux, each process gets SIGTERM when this one
      dies, even by SIGKILL. The kernel sends it when the thread that
      started the process ends (PR_SET_PDEATHSIG): called from any thread
      but the main one, the job would be stopped when that thread returns.
  Returns:
    The processes, in process-id order.
  """
  if num_processes < 1:
    raise ValueError(f'num_processes must be at least 1, got {num_processes}.')
  if not argv:
    raise ValueError('argv is empty: give the command to run, e.g. mjax-train --gin_file ...')
  coordinator = f'127.0.0.1:{port or free_port()}'
  log_dir = os.path.join(workdir, 'logs') if workdir else None
  if log_dir:
    os.makedirs(log_dir, exist_ok=True)
  procs, preexec = [], _stopped_with_parent() if stop_with_parent else None
  try:
    for i in range(num_processes):
      child_env = local_env(i, num_processes, coordinator, devices_per_process, env)
      # Lines as they are written, not 8 KiB later: the log is what one reads
      # when a process hangs.
      child_env['PYTHONUNBUFFERED'] = '1'
      if log_dir:
        proc = start_logged(argv, child_env, os.path.join(log_dir, f'process-{i}.log'), preexec_fn=preexec)
      else:
        proc = subprocess.Popen(list(argv), env=child_env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, preexec_fn=preexec)
        pump = threading.Thread(target=_pump, args=(proc.stdout, f'[{i}] ', sys.stdout), daemon=True)
        pump.start()
        proc.mjax_pump = pump  # joined by wait_all, so no output is lost
      procs.append(proc)
  except BaseException:
    _kill(procs)   # none left waiting for peers that never start
    raise
  return procs


def _kill(procs: Sequence[subprocess.Popen]) -> None:
  for p in procs:
    if p.poll() is None:
      p.send_signal(signal.SIGKILL)
  for p in procs:
    p.wait()


def terminate(handles: Mapping[Any, Any], grace_s: float, kill: Callable[[Any, Any], None],
              patient: Callable[[], bool] = lambda: True, save: bool = True) -> list:
  """SIGTERM to every live process (a trainer saves and exits), then
  `kill(key, handle)` for each still alive after `grace_s`, or as soon as
  `patient()` turns False; with save=False, `kill` at once (no SIGTERM, so
  no trainer saves). Handles offer Popen's poll and send_signal (a remote
  executor's do too). Returns the keys of those killed; waiting for them is
  the caller's."""
  if save:
    alive = [h for h in handles.values() if h.poll() is None]
    for h in alive:
      try:
        h.send_signal(signal.SIGTERM)
      except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while any(h.poll() is None for h in alive) and time.monotonic() < deadline and patient():
      time.sleep(0.05)
  killed = [k for k, h in handles.items() if h.poll() is None]
  for k in killed:
    kill(k, handles[k])
  return killed


def wait_all(procs: Sequence[subprocess.Popen], timeout: Optional[float] = None,
             on_timeout: Optional[Callable[[], None]] = None) -> list[int]:
  """Waits for every process; the first failure ends the others.

  Args:
    procs: as returned by spawn_local.
    timeout: seconds to wait in all (None: no limit).
    on_timeout: called once if the timeout ends the wait, before the
      processes still running are killed.
  Returns:
    The exit codes in process order (negative: killed by that signal).
  """
  deadline = None if timeout is None else time.monotonic() + timeout
  try:
    while True:
      codes = [p.poll() for p in procs]
      if all(c is not None for c in codes) or any(c for c in codes):
        break
      if deadline is not None and time.monotonic() > deadline:
        if on_timeout is not None:
          on_timeout()
        break
      time.sleep(0.1)
  finally:
    _kill(procs)
  for p in procs:
    pump = getattr(p, 'mjax_pump', None)
    if pump is not None:
      pump.join(timeout=5)
  return [p.returncode for p in procs]
