"""Runs one multi-process job on this machine, the processes talking over 127.0.0.1.

  python launch/local.py --processes 2 --devices 4 -- mjax-train --gin_file configs/tiny.gin --workdir runs/mh

Each process gets MJAX_COORDINATOR_ADDRESS / MJAX_NUM_PROCESSES /
MJAX_PROCESS_ID (and, with --devices, that many fake CPU devices); see
mjax/launch.py. Output goes to the console, each line prefixed with the
process id, or with --log_dir to DIR/logs/process-<i>.log. When one process
fails the others are stopped, and the launcher exits with the first non-zero
status. Ctrl-C / SIGTERM is passed on to every process, so the trainer saves
a checkpoint and exits cleanly; so is a SIGKILL of the launcher itself, on
Linux, as a SIGTERM to each process.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mjax import launch  # noqa: E402


def main(argv=None) -> int:
  """Parses the flags, starts the processes, waits; returns the exit status."""
  p = argparse.ArgumentParser(
      prog='launch/local.py', description='Run a multi-process JAX job on this machine.',
      usage='%(prog)s --processes N [--devices M] [--log_dir DIR] [--port P] -- COMMAND ...')
  p.add_argument('--processes', type=int, required=True, help='number of processes')
  p.add_argument('--devices', type=int, default=None,
                 help='fake CPU devices per process (default: the real devices, e.g. GPUs)')
  p.add_argument('--log_dir', default=None,
                 help='write process i to LOG_DIR/logs/process-<i>.log instead of the console')
  p.add_argument('--port', type=int, default=None, help='coordinator port (default: a free one)')
  p.add_argument('--timeout', type=float, default=None,
                 help='kill everything after this many seconds and exit 124, as timeout(1) does')
  argv = list(sys.argv[1:] if argv is None else argv)
  if '--' not in argv and any(a in ('-h', '--help') for a in argv):
    p.print_help()
    return 0
  if '--' not in argv:
    p.error('give the command after --, e.g. -- mjax-train --gin_file configs/tiny.gin')
  split = argv.index('--')
  args, command = p.parse_args(argv[:split]), argv[split + 1:]
  if not command:
    p.error('the command after -- is empty')
  problem = launch.count_problem(args.processes, args.devices)
  if problem:
    p.error(problem)
  if args.port is not None and not 1 <= args.port <= 65535:
    p.error(f'--port {args.port}: a TCP port is 1 to 65535 (leave it out for a free one)')
  if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
    p.error(f'--timeout {args.timeout}: give a finite number of seconds above 0, or leave it out (no limit)')
  try:
    procs = launch.spawn_local(args.processes, args.devices, command, workdir=args.log_dir, port=args.port,
                               stop_with_parent=True)   # none trains on if this launcher is killed outright
  except OSError as e:
    what = (f'the command {command[0]!r} cannot be started' if e.filename == command[0]
            else f'{e.filename!r} cannot be made' if e.filename else 'the job cannot be started')
    print(f'launch/local.py: error: {what}: {e.strerror or e}. Give a program on PATH (or its path) after --, '
          f'and a --log_dir this user can write.', file=sys.stderr)
    return 2

  def forward(signum, frame):
    for proc in procs:
      if proc.poll() is None:
        proc.send_signal(signum)

  signal.signal(signal.SIGTERM, forward)
  signal.signal(signal.SIGINT, forward)
  timed_out = []
  codes = launch.wait_all(procs, timeout=args.timeout, on_timeout=lambda: timed_out.append(True))
  if timed_out:
    # Said as such: the -9s alone read like a crash of every process.
    print(f'launch/local.py: --timeout {args.timeout:g}s reached: stopped every process still running '
          f'(exit statuses {codes})', file=sys.stderr)
    return 124
  failed = [(i, c) for i, c in enumerate(codes) if c]
  if failed:
    print(f'launch/local.py: exit statuses {codes}', file=sys.stderr)
    # A process's own status, not the -9 of those stopped because of it.
    own = [c for _, c in failed if c != -signal.SIGKILL] or [failed[0][1]]
    return own[0] if own[0] > 0 else 128 - own[0]
  return 0


if __name__ == '__main__':
  sys.exit(main())
