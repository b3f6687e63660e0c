"""One task of launch/slurm.sbatch: says whom it joins, then becomes the trainer.

  srun --kill-on-bad-exit=1 --label .venv/bin/python launch/slurm_task.py .venv/bin/mjax-train ARGS...

Each task prints

  mjax: joining HOST:PORT as process I/N

before anything else, with the coordinator address and process id that
mjax/distributed.py reads from this task's environment (its `resolve`, so the
line says what the join will do), and checks that HOST resolves on this node.
Without the check an unresolvable coordinator shows up only as every process
waiting out the 300 s join timeout and aborting with DEADLINE_EXCEEDED, naming
no host. The command then replaces this process (exec): SLURM's signals
(`--signal`, scancel, the time limit) reach the trainer itself, which saves a
checkpoint on SIGTERM.
"""

from __future__ import annotations

import os
import socket
import sys

# No sys.path change, unlike launch/local.py: this runs with the python of the
# environment whose mjax-train it starts, so both read the job with the same
# mjax.
from mjax import distributed, protocol


def join_line(spec: distributed.JobSpec) -> str:
  """The line a task prints before the trainer joins the job."""
  if spec.num_processes == 1:
    return 'mjax: one process, no job to join'
  return (f'mjax: joining {spec.coordinator_address} as process '
          f'{spec.process_id}/{spec.num_processes}')


def unresolvable(address: str) -> str | None:
  """Why the host of `address` (host:port) does not resolve here, or None."""
  host, _, port = address.rpartition(':')
  host = host.strip('[]')   # an IPv6 literal, [::1]:1234
  try:
    socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
  except (socket.gaierror, UnicodeError) as e:
    return (f'the coordinator host {host!r} does not resolve on {socket.gethostname()} ({e}); '
            f'every process would wait out the join timeout. Fix the name resolution of the '
            f'nodes (DNS, /etc/hosts), or set {distributed.COORDINATOR}=HOST:PORT to an address '
            f'every node resolves.')
  return None


def main(argv: list[str]) -> int:
  """Prints the join line, checks the coordinator; execs argv (never returns then)."""
  if not argv or argv[0] in ('-h', '--help'):
    print('usage: slurm_task.py COMMAND [ARGS...]\n\n' + __doc__, file=sys.stderr if not argv else sys.stdout)
    return protocol.EXIT_USER_ERROR if not argv else 0
  try:
    spec = distributed.resolve()
  except distributed.DistributedError as e:
    print(f'mjax: error: {e}', file=sys.stderr, flush=True)
    return protocol.EXIT_USER_ERROR
  print(join_line(spec), flush=True)
  if spec.coordinator_address:
    why = unresolvable(spec.coordinator_address)
    if why:
      print(f'mjax: error: {why}', file=sys.stderr, flush=True)
      return protocol.EXIT_FAILED
  try:
    os.execvp(argv[0], argv)
  except OSError as e:
    print(f'mjax: error: cannot run {argv[0]}: {e}', file=sys.stderr, flush=True)
  return protocol.EXIT_FAILED


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
