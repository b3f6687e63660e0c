"""Command-line entry points. Each one parses its flags (the shared gin flags
and config loading are mjax/flags.py), calls one function, and leaves with
an exit status from mjax/protocol.py; bad input (mjax.errors.UserError)
becomes exit status 2 in `entry_point`, and nowhere else.

  mjax-train --gin_file configs/tiny.gin --workdir runs/tiny \
             --gin.TrainConfig.steps=30 --gin_param='OptimConfig.learning_rate = 1e-3'
  mjax-flops --gin_file configs/gpt3_175b.gin
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import errno
import functools
import json
import os
import signal
import sys
import threading
import time
import traceback
from typing import Optional, Sequence

from mjax import flags, protocol
from mjax.errors import Fault, HostFault, UserError


class Terminated(KeyboardInterrupt):
  """SIGTERM in a tool: unwinds like Ctrl-C (clean-ups run, and code that
  lets KeyboardInterrupt through, as asyncio does, lets this through too);
  exit status 143."""


# The stop handlers installed here, with what _SignalWatch does for each:
# ('now', leave) ends the process at once; ('grace', leave) gives the main
# thread GRACE_S to unwind, then ends it.
_OURS: dict = {}
GRACE_S = 10.0


REDELIVER_S = 0.05
_RESEND_LOCK = threading.Lock()   # a stop sent again, against the tool's return


def _stop_dropped(previous, running: threading.Event, unraisable) -> None:
  """sys.unraisablehook while a tool runs. A stop's exception that Python
  dropped (the handler ran inside a garbage-collector callback, which JAX
  registers, or a __del__) is the signal raised again in the main thread a
  moment later (`_thread.interrupt_main`, for Python's handler only), when
  it is most likely elsewhere: the tool then unwinds through its clean-ups
  as if it had landed the first time. Before, it ran on until the grace
  ended it without them (a half-written shard directory, a temporary
  file). Not once the tool has returned (`running` cleared, under the
  lock): its handlers are gone then. Anything else goes to the hook there
  was, as does everything once the tool has returned (a library may have
  chained its own hook onto this one)."""
  if running.is_set() and isinstance(unraisable.exc_value, KeyboardInterrupt):   # only a stop handler raises one
    signum = signal.SIGTERM if isinstance(unraisable.exc_value, Terminated) else signal.SIGINT

    def again():
      with _RESEND_LOCK:
        if running.is_set():
          _thread.interrupt_main(signum)
    timer = threading.Timer(REDELIVER_S, again)
    timer.daemon = True
    timer.start()
    return
  previous(unraisable)


def _stop_status(signum: int) -> tuple[int, str]:
  """(exit status, word) of a stop by Ctrl-C or SIGTERM."""
  return ((protocol.EXIT_INTERRUPTED, 'interrupted') if signum == signal.SIGINT
          else (protocol.EXIT_TERMINATED, 'terminated'))


def _leave_tool(prog: str, signum: int) -> None:
  status, what = _stop_status(signum)
  print(f'{prog}: {what}', file=sys.stderr, flush=True)
  os._exit(status)


class _SignalWatch:
  """Acts on Ctrl-C and SIGTERM from a thread of its own, at once. Python
  runs a signal handler only when the main thread is back in the
  interpreter: not during a compilation, a collective or a stuck read, so a
  handler alone would have made `kill` wait for those (by default SIGTERM
  kills at once). Python's C-level handler writes the signal's number to a
  pipe (signal.set_wakeup_fd); this thread reads it and, while one of the
  handlers in _OURS is the signal's handler (not the training loop's
  StopAgreement, which stops after the step), does what _OURS says. A tool's
  main thread meanwhile unwinds through its clean-ups (its handler raises;
  an exception Python drops in a garbage-collector callback, which JAX
  registers, is raised again: _stop_dropped), and nothing can leave the
  tool running on past the grace. (A child forked without
  exec would write its signals into the same pipe; mjax forks none: its
  subprocesses exec, and the pipe does not survive that.)"""

  def __init__(self):
    self._r, self._w = os.pipe()
    os.set_blocking(self._w, False)
    self._old_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
    self.timers: list = []
    self.signum: Optional[int] = None   # the stop a 'grace' handler was given
    self._thread = threading.Thread(target=self._run, name='mjax-signal-watch', daemon=True)
    self._thread.start()

  def _run(self) -> None:
    while True:
      try:
        data = os.read(self._r, 64)
      except OSError:
        return
      if not data:
        return
      for signum in data:
        mode, leave = _OURS.get(signal.getsignal(signum), (None, None))
        if mode == 'now':
          leave(signum)
        elif mode == 'grace' and not self.timers:
          self.signum = signum
          timer = threading.Timer(GRACE_S, leave, args=(signum,))
          timer.daemon = True
          timer.start()
          self.timers.append(timer)

  def close(self) -> None:
    """Stops watching (an in-process caller goes on: nothing may end it later)."""
    signal.set_wakeup_fd(self._old_fd)
    os.close(self._w)
    self._thread.join(timeout=1.0)
    os.close(self._r)
    for timer in self.timers:
      timer.cancel()


class OutputError(OSError):
  """A write to the tool's stdout failed: its reader went away (EPIPE), a
  full disk under a redirection (ENOSPC). Not a bug of the tool: said in
  one line, not a traceback."""


class _Output:
  """sys.stdout whose failed writes raise OutputError: an OSError from a
  write to stdout is told apart from one of the tool's own files."""

  def __init__(self, stream):
    self._stream = stream

  def _call(self, name, *args):
    try:
      return getattr(self._stream, name)(*args)
    except OSError as e:
      raise OutputError(e.errno, e.strerror) from e

  def write(self, text):
    return self._call('write', text)

  def writelines(self, lines):
    return self._call('writelines', lines)

  def flush(self):
    return self._call('flush')

  def __getattr__(self, name):
    return getattr(self._stream, name)


class _TrainingOutput(_Output):
  """mjax-train's stdout and stderr: a failed write (its reader gone, a full
  disk) drops the rest of that stream's output, said once on stderr where
  stdout failed, and the run goes on to its steps and checkpoints. A run
  that ended there, on the first line (or progress bar update) after its
  log's reader went (`| head`, `2>&1 | tee log` with the tee gone), lost
  every step since its last save."""

  def __init__(self, stream, prog: str, fd: int):
    super().__init__(stream)
    self._prog, self._fd, self._dropped = prog, fd, False
    self._lock = threading.Lock()   # the loop, heartbeats and the bar's monitor thread all write

  def _call(self, name, *args):
    if self._dropped:
      return None
    try:
      return super()._call(name, *args)
    except OutputError as e:
      with self._lock:
        if self._dropped:
          return None
        self._dropped = True
        _drop_output(self._fd)
      if self._fd == 1:
        with contextlib.suppress(Exception):   # stderr may be the same dead pipe: then nothing can say it
          print(f'{self._prog}: warning: cannot write to stdout ({e.strerror}); the run goes on without its '
                'output there (metrics.jsonl in the workdir has every step)', file=sys.stderr, flush=True)
      return None


def _drop_output(fd: int = 1) -> None:
  """Points `fd` (stdout) at /dev/null: what the tool had left to write there is
  dropped (Python would try it again at exit, and fail again with a
  traceback and status 120)."""
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, fd)
  os.close(devnull)


def _flush_output(stopping: bool) -> None:
  """Flushes the tool's stdout on its way out. `stopping`: the tool is
  ending on an error or a stop, whose own line and status are what to say:
  a failed flush then drops the rest quietly; otherwise it raises
  OutputError, said by `_output_failed`."""
  try:
    sys.stdout.flush()
  except OutputError:
    if not stopping:
      raise
    _drop_output()


def _output_failed(prog: str, e: OutputError) -> None:
  """Ends a tool whose stdout failed: quietly with 141 where its reader went
  away (as `yes | head` does), with one line and status 1 otherwise."""
  _drop_output()
  if e.errno == errno.EPIPE:
    sys.exit(protocol.EXIT_BROKEN_PIPE)
  advice = ('give it room (a file system with free space) or another place to write' if e.errno == errno.ENOSPC
            else 'give it another place to write')
  print(f'{prog}: error: cannot write its output to stdout ({e.strerror}); what it wrote there is '
        f'incomplete: {advice}.', file=sys.stderr, flush=True)
  sys.exit(protocol.EXIT_FAILED)


def entry_point(prog: str):
  """The one place bad input becomes an exit status: a UserError (config,
  data, distributed set-up, checkpoint path) is printed as one paragraph and
  the process exits 2 (protocol.EXIT_USER_ERROR), which the fault-tolerance
  driver never restarts. A Fault (a peer that never joined, a failed disk)
  is printed the same way but exits 1, a crash the driver restarts. Ctrl-C
  and SIGTERM end a tool with one line,
  status 130 or 143, after its clean-ups (mjax-train handles its own)."""
  def wrap(main):
    def handler(signum, frame):
      raise KeyboardInterrupt if signum == signal.SIGINT else Terminated
    _OURS[handler] = ('grace', functools.partial(_leave_tool, prog))

    @functools.wraps(main)
    def run(argv: Optional[Sequence[str]] = None):
      if argv is not None:
        return _run(argv)   # a caller in Python: its process is its own to end
      try:
        return _run(argv)
      except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if status and _in_a_job():
          if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
          _quit_job(status)
        raise
      except Exception:
        if not _in_a_job():
          raise
        traceback.print_exc()
        _quit_job(protocol.EXIT_FAILED)

    def _run(argv: Optional[Sequence[str]]):
      in_main = threading.current_thread() is threading.main_thread()
      old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
      for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        if old.get(sig) is default:   # an ignored signal (a background job's Ctrl-C) stays so
          signal.signal(sig, handler)
      watch = _SignalWatch() if in_main else None
      unraisable, running = sys.unraisablehook, threading.Event()
      ours = functools.partial(_stop_dropped, unraisable, running)
      if in_main:
        running.set()
        sys.unraisablehook = ours
      # An in-process caller keeps its own stdout; a tool started with
      # stdout closed (`>&-`) has none, and prints nothing, as Python does.
      console = argv is None and sys.stdout is not None
      if console:
        sys.stdout = _Output(sys.stdout)
      try:
        try:
          result = main(argv)
        except BaseException as e:
          if console:   # a tool's own sys.exit(0) is a success, whose output failing is said
            _flush_output(stopping=not (isinstance(e, SystemExit) and e.code in (None, 0)))
          raise
        if console:
          _flush_output(stopping=False)   # here, where a failure is said; not at exit
        if watch is not None and watch.signum is not None:
          # A Ctrl-C or SIGTERM whose exception Python dropped (raised in a
          # garbage-collector callback; JAX registers one), or one that came
          # as the tool returned: it ran on to its end, and would have
          # exited 0 as if never stopped. The status says it was stopped;
          # the line, that what it wrote is whole.
          status, what = _stop_status(watch.signum)
          print(f'{prog}: {what} as it finished; its work was done in full', file=sys.stderr, flush=True)
          sys.exit(status)
        return result
      except OutputError as e:
        _output_failed(prog, e)
      except (UserError, Fault) as e:
        print(f'{prog}: error: {e}', file=sys.stderr, flush=True)
        sys.exit(protocol.EXIT_USER_ERROR if isinstance(e, UserError) else protocol.EXIT_FAILED)
      except Terminated:
        print(f'{prog}: terminated', file=sys.stderr, flush=True)
        sys.exit(protocol.EXIT_TERMINATED)
      except KeyboardInterrupt:
        print(f'{prog}: interrupted', file=sys.stderr, flush=True)
        sys.exit(protocol.EXIT_INTERRUPTED)
      finally:
        with _RESEND_LOCK:
          running.clear()
        if sys.unraisablehook is ours:   # not one that a library chained onto it meanwhile
          sys.unraisablehook = unraisable
        if console and isinstance(sys.stdout, _Output):
          sys.stdout = sys.stdout._stream
        for sig, was in old.items():
          signal.signal(sig, was)
        # A console run keeps its watch (and a started grace) until the
        # process ends: a shutdown stuck after the signal still ends.
        if watch is not None and argv is not None:
          watch.close()
    return run
  return wrap


# Held by the first path that leaves on a stop signal: the handler, run by
# the main thread, and _SignalWatch's thread both see the same Ctrl-C, and
# each printed the line before either reached os._exit.
_LEAVING = threading.Lock()


def _in_a_job() -> bool:
  """Whether this process joined a multi-process JAX job."""
  jax_mod = sys.modules.get('jax')
  return jax_mod is not None and jax_mod.distributed.is_initialized()


def _quit_job(status: int) -> None:
  """Ends a process of a multi-process job that failed, now. Left to the
  interpreter's exit, jax's shutdown waited there for the other processes,
  still training or stuck in a collective, while this process's heartbeats
  went on: the driver saw no exit and, after progress_timeout_s, took the
  others for hung (naming the healthy process). What a failed run must keep
  is on disk by then: the loop completes a save in flight before its error
  leaves it, and the run's files are written a line (an event) at a time."""
  try:
    sys.stdout.flush()
    sys.stderr.flush()
    _after_the_others()
  finally:
    os._exit(status)


# How long process 0 waits, leaving, for the others to leave too.
LEAVE_WAIT_S = 3.0


def _after_the_others() -> None:
  """Process 0 hosts jax's coordination service: leaving before the others
  cut off a peer still reading the agreement that ends it too (a refusal
  every process reaches, such as a checkpoint tier some cannot see), which
  then died of the lost service with a traceback instead of its message.
  Each process says it is leaving; process 0 waits for the others' word,
  LEAVE_WAIT_S at most (one that is not leaving, stuck or training on, the
  launcher or the driver ends)."""
  try:
    import jax
    from mjax import distributed
    client = distributed.coordination_client()
    me, n = jax.process_index(), jax.process_count()
    client.key_value_set(f'mjax/leaving/{me}', '1')
    if me != 0:
      return
    deadline = time.monotonic() + LEAVE_WAIT_S
    for i in range(1, n):
      left_ms = int((deadline - time.monotonic()) * 1000)
      if left_ms <= 0:
        return
      client.blocking_key_value_get(f'mjax/leaving/{i}', left_ms)
  except Exception:  # noqa: BLE001 -- the service gone, a peer not leaving: nothing to wait for
    pass


def _interrupted(prog: str, signum: int = signal.SIGINT) -> None:
  if not _LEAVING.acquire(blocking=False):
    threading.Event().wait()   # the other path is leaving: os._exit ends this one too
  status, what = _stop_status(signum)
  what += ' (SIGTERM)' if signum == signal.SIGTERM else ''
  try:
    print(f'{prog}: {what}; the last committed checkpoint, if any, is kept', file=sys.stderr, flush=True)
    sys.stdout.flush()
  finally:   # also where the print fails (a pipe gone with the terminal, `| tee`): the other path waits on us
    os._exit(status)


def _exit_on_ctrl_c(prog: str) -> None:
  """Ctrl-C and SIGTERM outside the training loop (start-up, compilation,
  the final evaluation; the loop's own handler stops it cleanly on the
  first one, and passes a second one here): nothing more to save, leave at
  once with status 130 or 143, from _SignalWatch's thread even while the
  main thread is inside XLA.

  Done in the handler, not through KeyboardInterrupt: Python raises that
  wherever the main thread happens to be, and one raised inside a garbage
  collector callback (JAX registers one) is printed and dropped, so Ctrl-C
  in start-up was now and then ignored and the job trained on. Leaving with
  os._exit also skips unwinding through XLA's running threads, which can
  crash at interpreter exit.
  """
  def handler(signum, frame):
    _interrupted(prog, signum)
  _OURS[handler] = ('now', functools.partial(_interrupted, prog))
  for sig in (signal.SIGINT, signal.SIGTERM):   # the loop's StopAgreement puts these back when it ends
    signal.signal(sig, handler)


@entry_point('mjax-train')
def train_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-train: trains a model described by gin files."""
  prog = 'mjax-train'
  p = flags.parser(prog, 'Train a language model.')
  p.add_argument('--workdir', default=None,
                 help='run directory: config, metrics.jsonl, TensorBoard events (default: runs/<config>)')
  p.add_argument('--print_config', action='store_true',
                 help='resolve and validate the config, print it with the parameter count, FLOPs per token '
                      'and the per-device memory estimate on this machine\'s devices, and exit (nothing '
                      'is compiled or written)')
  args, bindings = flags.parse(p, sys.argv[1:] if argv is None else argv)
  if args.print_config:
    print(_resolved_config(args, bindings), flush=True)
    return
  if args.workdir is not None and (not args.workdir.strip() or '://' in args.workdir):
    raise UserError(f'--workdir {args.workdir!r}: ' + ('empty (an unset variable?)' if not args.workdir.strip() else
                    'a URL; the workdir is a local or mounted directory (checkpoints can go to a bucket '
                    'with CheckpointConfig.directory)') + '. Give the run directory, or leave --workdir out '
                    'for runs/<config>.')
  workdir = args.workdir or default_workdir(flags.gin_files(args))
  _exit_on_ctrl_c(prog)
  if isinstance(sys.stdout, _Output):   # the console's (entry_point), not an in-process caller's
    sys.stdout = _TrainingOutput(sys.stdout._stream, prog, 1)
    if sys.stderr is not None:   # before the progress bar takes it
      sys.stderr = _TrainingOutput(sys.stderr, prog, 2)
  from mjax import trainer   # imports jax, but starts no backend: XLA flags can still be set
  heartbeat = None
  try:
    from mjax.ft import inject
    inject.parse(os.environ.get(protocol.INJECT_ENV, ''))   # a typo there said now, not after start-up
    try:
      preempt_status = protocol.preempt_exit_status()   # a bad value said before start-up
    except ValueError as e:
      raise UserError(str(e)) from None
    heartbeat, startup = _early_heartbeat(args, bindings)
    cfg = flags.setup(flags.gin_files(args), bindings)
    summary = trainer.run(cfg, workdir, heartbeat, startup)
  except UserError as e:   # the driver reports the message when it gives up
    _tell_driver(workdir, protocol.USER_ERROR, str(e))
    raise
  except HostFault as e:   # the driver restarts without those hosts
    _tell_driver(workdir, protocol.HOST_FAULT, {'processes': e.processes, 'what': str(e)})
    raise
  except trainer.NonFiniteLoss as e:
    # A distinct status, so that a supervisor can tell a numerical fault
    # (roll back, skip the data) from a crash (restart as is).
    print(f'{prog}: error: {e}; last good checkpoint kept', file=sys.stderr)
    sys.exit(protocol.EXIT_NONFINITE)
  except KeyboardInterrupt:   # only where something put Python's default SIGINT handler back
    _interrupted(prog)
  except Exception as e:
    from mjax import distributed
    if distributed.peer_gone(e):   # the driver blames the peer that left, not this process
      first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ''
      _tell_driver(workdir, protocol.PEER_LOST, first)
      # Said in one paragraph, a Fault (exit 1, restarted): every survivor of
      # a killed process printed forty lines of jax's traceback, which read
      # as its own crash, above the one line that says a peer left.
      raise Fault(f'a collective failed because another process of the job left first ({first}); this '
                  f'process stopped too. Look at the process that left (the driver names it in its fault '
                  f'event); under mjax-launch the job restarts from its last checkpoint.') from None
    raise
  finally:
    if heartbeat is not None:   # the trainer's to close once it has it; not yet, where it failed before
      heartbeat.close()
  if summary.driver_lost:
    print(f'{prog}: stopped after step {summary.final_step}: the fault-tolerance driver is gone '
          f'(no acknowledgement of the heartbeats); checkpoint saved, restart mjax-launch to resume',
          file=sys.stderr)
    sys.exit(protocol.EXIT_DRIVER_LOST)
  if summary.preempted and preempt_status:
    print(f'{prog}: stopped after step {summary.final_step} of {cfg.train.steps}, checkpoint saved; exit status '
          f'{preempt_status} ({protocol.PREEMPT_EXIT_ENV}): the same command goes on from it', file=sys.stderr)
    sys.exit(preempt_status)


def _early_heartbeat(args: argparse.Namespace, bindings: Sequence[str]):
  """(HeartbeatClient, StartupPhase) beating from before this process joins
  the job, under mjax-launch; (None, None) otherwise. A process stopped or
  wedged in jax.distributed.initialize was never heard from: the healthy
  ones timed out waiting for it, and the driver blamed them."""
  if not protocol.under_driver():
    return None, None
  from mjax.distributed import PROCESS_ID
  from mjax.ft.heartbeat import HeartbeatClient
  from mjax.trainer import StartupPhase
  early = flags.load(flags.gin_files(args), bindings)   # FaultConfig's intervals; checked again in setup
  startup = StartupPhase('startup:join')
  return HeartbeatClient.from_env(startup, early.fault, int(os.environ.get(PROCESS_ID, '0') or 0)), startup


def default_workdir(gin_files: list[str]) -> str:
  """mjax-train's workdir without --workdir: runs/<the last gin file's
  name>, except for a run's own config.gin, whose run goes on in its own
  workdir (`--gin_file runs/pp/config.gin`, as the README resumes a run,
  had started a new one in runs/config)."""
  last = gin_files[-1]
  folder = os.path.dirname(last) or '.'
  if os.path.basename(last) == 'config.gin':
    from mjax.checkpoint.directories import is_workdir
    if is_workdir(folder):
      print(f'mjax: --workdir {folder}: the run whose config.gin this is', flush=True)
      return folder
  return os.path.join('runs', os.path.splitext(os.path.basename(last))[0])


def _tell_driver(workdir: str, fact: str, value) -> None:
  """Records the fact that ends this trainer, for the driver that started it."""
  if protocol.under_driver():
    from mjax.distributed import PROCESS_ID
    protocol.Facts(workdir, int(os.environ.get(PROCESS_ID, '0') or 0)).record(fact, value)


def _resolved_config(args: argparse.Namespace, bindings: Sequence[str]) -> str:
  """mjax-train --print_config: the config as gin, then what it amounts to."""
  import jax
  from mjax import config as config_lib
  from mjax.model.flops import report
  from mjax.parallel.memory import estimate_memory, format_estimate
  from mjax.devices import start_backend
  n = start_backend()
  cfg = flags.load(flags.gin_files(args), bindings, num_devices=n)
  # What a start refuses before it reads data or builds anything, refused
  # here too: a config printed as valid had trained nothing (a mixture
  # naming a source twice, cuDNN attention off GPUs).
  flags.check_devices(cfg)
  config_lib.check_for_training(cfg)
  mesh = dict(zip(cfg.mesh.AXES, (i * j for i, j in zip(config_lib.resolve_mesh_shape(cfg.mesh, n),
                                                          cfg.mesh.dcn_shape()))))
  replica = cfg.train.global_batch_size // (mesh['data'] * mesh['fsdp'])
  micro = replica // cfg.train.grad_accum_steps
  if cfg.mesh.pipelined:
    micro //= cfg.mesh.num_microbatches()
  est = estimate_memory(cfg, mesh, micro, sequence_parallel=cfg.mesh.sequence_parallel)
  f = report(cfg.model, cfg.data.seq_len)
  tokens = cfg.train.global_batch_size * cfg.data.seq_len
  # The warnings a start would print (settings that do nothing here), as
  # comments: the output stays a gin file.
  from mjax.model import rotary_kernel
  notes = [*config_lib.doubtful(cfg, n), *rotary_kernel.doubtful(cfg, n)]
  return '\n'.join([
      config_lib.to_gin(cfg).rstrip(), '',
      f'# {f["params"] / 1e6:,.2f}M parameters ({f["matmul_params"] / 1e6:,.2f}M in matrix products); '
      f'{f["flops_per_token"] / 1e9:,.3f} GFLOP per token (training, attention mask-aware); '
      f'{tokens:,} tokens per step; {f["flops_per_token"] * tokens / 1e12:,.2f} TFLOP per step',
      f'# on {n} {jax.devices()[0].platform} device(s), mesh {mesh}:',
      *('# ' + line for line in format_estimate(est).splitlines()),
      *(f'# warning: {note}' for note in notes)])


@entry_point('mjax-flops')
def flops_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-flops: parameter count and training FLOPs per token, as JSON."""
  p = flags.parser('mjax-flops', 'Print parameter count and FLOPs per token of a config (nothing is allocated).')
  args, bindings = flags.parse(p, sys.argv[1:] if argv is None else argv)
  cfg = flags.load(flags.gin_files(args), bindings)
  from mjax.model.flops import report
  print(json.dumps(report(cfg.model, cfg.data.seq_len), indent=2))


@entry_point('mjax-report')
def report_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-report: what a config communicates, how much memory it needs, what a
  run saved and how evenly its processes ran (subcommands: mjax/report.py)."""
  from mjax import report
  sys.exit(report.main(sys.argv[1:] if argv is None else argv))


@entry_point('mjax-prepare')
def prepare_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-prepare: tokenizes text once into token shards, or verifies shards.

    mjax-prepare --input DIR_OR_FILE --output DIR [--tokenizer bytes|tokenizer.json]
                 [--shard_tokens N] [--heldout_fraction F] [--file_pattern GLOB]
    mjax-prepare --verify DIR
  """
  prog = 'mjax-prepare'
  from mjax.config import DataConfig
  from mjax.data.shards import DEFAULT_SHARD_TOKENS
  defaults = DataConfig()
  p = argparse.ArgumentParser(
      prog=prog, description='Tokenize a text source once into .bin shards + manifest.json '
      '(train with --gin.DataConfig.source=DIR), or check an existing shard directory.')
  p.add_argument('--input', help="'stdlib', a text file or a directory of text files")
  p.add_argument('--output', help='new or empty directory for the shards and manifest.json')
  p.add_argument('--tokenizer', default='bytes', help="'bytes' (default) or the path of a tokenizer.json")
  p.add_argument('--shard_tokens', type=int, default=DEFAULT_SHARD_TOKENS,
                 help=f'tokens per shard, documents kept whole (default {DEFAULT_SHARD_TOKENS})')
  p.add_argument('--heldout_fraction', type=float, default=defaults.heldout_fraction,
                 help=f'share of files held out for evaluation (default {defaults.heldout_fraction})')
  p.add_argument('--file_pattern', default=defaults.file_pattern,
                 help=f'which files of a directory to read (default {defaults.file_pattern!r})')
  p.add_argument('--verify', metavar='DIR',
                 help='check sizes, sha256 checksums, token ids and document counts of DIR')
  args = p.parse_args(sys.argv[1:] if argv is None else argv)
  from mjax.data import prepare_shards, verify_shards
  if args.verify:
    if args.input or args.output:
      p.error('--verify DIR takes no --input / --output')
    summary = verify_shards(args.verify)
    print(json.dumps({'ok': True, **summary}, indent=2))
    return
  if not args.input or not args.output:
    p.error('needs --input and --output (or --verify DIR)')
  from mjax.checkpoint.directories import refuse_among_checkpoints
  # A run's checkpoint directory holds its steps and nothing else.
  refuse_among_checkpoints(os.path.abspath(os.path.expanduser(args.output)), give='--output a path')
  manifest = prepare_shards(args.input, args.output, args.tokenizer,
                            shard_tokens=args.shard_tokens,
                            heldout_fraction=args.heldout_fraction,
                            file_pattern=args.file_pattern,
                            log=lambda line: print(f'{prog}: {line}', file=sys.stderr))
  print(f'{prog}: wrote {len(manifest["shards"])} shard(s) and manifest.json to '
        f'{os.path.abspath(args.output)} ({manifest["dtype"]}, tokenizer '
        f'{manifest["tokenizer"]["name"]}, {manifest["tokenizer"]["vocab_size"]} ids)')


@entry_point('mjax-tokenizer')
def tokenizer_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-tokenizer: trains a byte-level BPE tokenizer.json on local text.

    mjax-tokenizer --input DIR_OR_FILE --vocab_size N --output tokenizer.json [--file_pattern GLOB]
  """
  prog = 'mjax-tokenizer'
  from mjax.config import DataConfig
  p = argparse.ArgumentParser(
      prog=prog, description='Train a byte-level BPE (EOS <|endoftext|>) with Hugging Face '
      'tokenizers; use it with --gin.DataConfig.tokenizer=FILE or mjax-prepare --tokenizer FILE.')
  p.add_argument('--input', required=True, help="'stdlib', a text file or a directory of text files")
  p.add_argument('--vocab_size', type=int, required=True, help='ids in the result (>= 257)')
  p.add_argument('--output', required=True, help='path of the tokenizer.json to write')
  p.add_argument('--file_pattern', default=DataConfig().file_pattern,
                 help=f'which files of a directory to read (default {DataConfig().file_pattern!r})')
  args = p.parse_args(sys.argv[1:] if argv is None else argv)
  from mjax.data import train_bpe
  import itertools
  from mjax.data.corpus import document_file, find_source_files, not_text, read_documents, what_documents_are
  root, files = find_source_files(args.input, args.file_pattern)
  dropped, dropped_names = [], set()

  def texts():
    # One file at a time (all the documents of a JSON Lines file together):
    # the trainer counts words as it goes, so the corpus never has to fit in
    # memory. Files that are not text are left out, as training leaves them.
    for _, names in itertools.groupby(files, key=document_file):
      names = list(names)
      for name, doc in zip(names, read_documents(root, names)):
        why = not_text(doc)
        if why:
          dropped.append(f'{name} ({why})')
          dropped_names.add(name)
          continue
        yield doc.decode('utf-8', errors='replace')

  from mjax.checkpoint.directories import refuse_among_checkpoints
  # A run's checkpoint directory holds its steps and nothing else.
  refuse_among_checkpoints(os.path.abspath(os.path.expanduser(args.output)), give='--output a path')
  try:
    info = train_bpe(texts(), args.vocab_size, args.output)
  finally:
    # Also before a refusal for want of text: it is these files that left none.
    if dropped:
      print(f'{prog}: left out {len(dropped)} of {len(files)} {what_documents_are(files)} that are not text: '
            f'{", ".join(dropped[:5])}{" and more" if len(dropped) > 5 else ""}', file=sys.stderr)
  # `files` counts files (a JSON Lines file once, however many documents it
  # holds: it counted each of its records as a file), `documents` what the
  # tokenizer learnt from; the two are the same for plain text files.
  kept = [n for n in files if n not in dropped_names]
  print(json.dumps({'files': len({document_file(n) for n in kept}), 'documents': len(kept), **info.to_json()},
                   indent=2))


@entry_point('mjax-diagnose')
def diagnose_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-diagnose: short health checks of this host's devices.

    mjax-diagnose [--json] [--min_fraction F] [--memory_fraction F] [--checks matmul,memory,...]
                  [--repeats N] [--check_timeout_s S] [--no_baseline] [--cache_dir DIR]

  Exit status 0 when every check passes (or is only suspect: too slow on a
  loaded host, listed under "suspect"), 1 when any fails or overruns its
  deadline (the host should not take part in a job), 2 for a usage error.
  Under a multi-process launch (see mjax/distributed.py) every process of
  the job must run it: the cross-process collectives are checked too.
  """
  prog = 'mjax-diagnose'
  from mjax.ft import diagnose
  args = diagnose.parse_args(sys.argv[1:] if argv is None else argv)
  checks = args.checks
  try:
    diagnose.injected_failures()  # a typo in the test-only variable is a usage error, found before any work
  except ValueError as e:
    raise UserError(str(e)) from None
  # With --json, stdout must hold the JSON document alone, but native
  # libraries (gloo's connection messages) print to it.
  with _stdout_to_stderr(args.json):
    flags.join_job()
    from mjax import distributed
    distributed.check_membership()   # (starts the backend: the diagnostics' first step anyway)
    try:
      report = diagnose.run_diagnostics(
          checks, min_fraction=args.min_fraction, memory_fraction=args.memory_fraction,
          cpu_memory_bytes=args.cpu_memory_mib * diagnose.MIB,
          collective_bytes=args.collective_mib * diagnose.MIB if args.collective_mib else None,
          cache_dir=args.cache_dir, baseline=not args.no_baseline, repeats=args.repeats,
          check_timeout_s=args.check_timeout_s)
    except ValueError as e:   # an unknown check name
      raise UserError(str(e)) from None
  if args.json:
    print(json.dumps(report.to_json(), indent=2))
  else:
    print(f'{prog}: ' + diagnose.format_report(report))
  if report.timed_out:
    # The overrun check's thread may be stuck inside XLA, where it can hold
    # up a normal interpreter exit (and the driver's wait) for good.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
  sys.exit(0 if report.passed else 1)


@contextlib.contextmanager
def _stdout_to_stderr(enabled: bool):
  """File descriptor 1 points at stderr inside the block (native code included)."""
  if not enabled:
    yield
    return
  sys.stdout.flush()
  saved = os.dup(1)
  os.dup2(2, 1)
  try:
    yield
  finally:
    sys.stdout.flush()
    os.dup2(saved, 1)
    os.close(saved)


@entry_point('mjax-launch')
def launch_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-launch: runs mjax-train under the fault-tolerance driver.

    mjax-launch --processes N [--devices M] [--hosts h1,h2 --spares h3] --workdir DIR \
        -- <mjax-train args>

  Heartbeats, hang / NaN / straggler detection, diagnostics, blocked hosts
  and automatic restarts: see mjax/ft/driver.py. Exit status 0: finished,
  1: gave up (events.jsonl says why), 2: bad input.
  """
  from mjax.ft import driver
  sys.exit(driver.Driver(driver.parse_args(sys.argv[1:] if argv is None else argv)).run())


@entry_point('mjax-agent')
def agent_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-agent: the per-host agent of the fault-tolerance driver.

    MJAX_JOB_SECRET=... mjax-agent --driver HEAD:PORT [--host NAME] [--address ADDR]

  Starts, signals and stops this host's training processes for the driver
  (mjax-launch --executor agent), runs its diagnostics and relays its
  heartbeats in aggregate; see mjax/ft/agent.py. Exit status 0 when the
  driver ends the job, 1 when no driver answered, 2 for bad input.
  """
  from mjax.ft import agent
  sys.exit(agent.agent_main(sys.argv[1:] if argv is None else argv))


@entry_point('mjax-eval')
def eval_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-eval: loss, perplexity and bits per byte of a checkpoint, as JSON.

    mjax-eval --workdir RUN [--step N] [--checkpoint PATH] [--split heldout|train] [--batches N]
              [--gin_file F ...] [--gin.KEY=VALUE ...]

  The config is the run's config.gin, then the command line's gin files and
  overrides (another data source, another mesh); see mjax/evaluate.py.
  Exit status 0 with one JSON document on stdout (process 0 only), 2 for
  bad input: a config, a data source, a step that is missing or unreadable.
  """
  from mjax import evaluate
  args, bindings = evaluate.parse_args(sys.argv[1:] if argv is None else argv)
  # stdout must hold the JSON document alone, but native libraries (gloo's
  # connection messages) print to it.
  with _stdout_to_stderr(True):
    report = evaluate.main(args, bindings)
  if report is not None:
    print(json.dumps(report, indent=2), flush=True)



@entry_point('mjax-generate')
def generate_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-generate: sample text from a checkpoint, streamed to stdout.

    mjax-generate --workdir RUN --prompt TEXT [--prompt TEXT ...] [--prompt_file F]
                  [--max_new_tokens N] [--temperature T] [--top_k K] [--top_p P] [--seed S]
                  [--format text|jsonl] [--step N] [--checkpoint PATH] [--gin.KEY=VALUE ...]

  KV cache with ring buffers for sliding-window layers; see mjax/generate.py.
  Exit status 0, or 2 for bad input (settings, prompts, config, checkpoint).
  """
  from mjax import generate
  args, bindings = generate.parse_args(sys.argv[1:] if argv is None else argv)
  generate.main(args, bindings)



@entry_point('mjax-export')
def export_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-export: a checkpoint as a Hugging Face transformers model directory.

    mjax-export OUT --workdir RUN [--format hf] [--step N] [--checkpoint PATH] [--drop_sliding_window]

  GPT-NeoX (parallel block) or Llama / Mistral / Ministral (sequential
  block); see mjax/hf.py. Exit status 0, or 2 for bad input: a model no
  native architecture represents (the option is named), an OUT that holds
  files, a missing or unreadable checkpoint.
  """
  from mjax import hf
  args, bindings = hf.parse_export_args(sys.argv[1:] if argv is None else argv)
  hf.export_main(args, bindings)



@entry_point('mjax-import')
def import_main(argv: Optional[Sequence[str]] = None) -> None:
  """mjax-import: the gin config that trains from a Hugging Face model directory.

    mjax-import MODEL_DIR OUT.gin
    mjax-train --gin_file OUT.gin --workdir runs/finetune

  GPT-NeoX (parallel residual or not), Llama, Mistral, Ministral; see
  mjax/hf.py. Exit status 0, or 2 for a directory it cannot read or a model
  mjax cannot represent (the option is named).
  """
  from mjax import hf
  hf.import_main(sys.argv[1:] if argv is None else argv)


if __name__ == '__main__':
  train_main()
