"""The fault-tolerance driver at thousands of processes, simulated on one machine.

  python bench/scale_sim.py                       # 1,536 and 12,288 processes, 45 s each
  python bench/scale_sim.py --processes 1536 --seconds 60
  python bench/scale_sim.py --per_host 8         # through per-host agents (mjax-agent), 8 processes each

The driver's own supervision loop (`Driver._supervise`: the heartbeat
server, the monitor, the straggler analysis thread) runs unchanged in this
process, over an attempt whose processes are simulated: sender processes
send each simulated trainer's signed heartbeat every heartbeat_interval_s
(the default 2 s) from 127.0.0.1, with a new step every second, and append
its timing rows every 10 steps as PhaseTimer does (500 steps of history are
written first). Halfway through, one simulated process falls silent.

With --per_host K, the heartbeats take the agents' path instead
(mjax/ft/agent.py): each simulated host opens one authenticated TCP
connection to the driver's AgentServer, exactly as mjax-agent does, and
relays its K processes' heartbeats as one message per interval; the driver
runs with `--executor agent`.

Printed per size, as a markdown table: heartbeats sent, received and dropped;
false faults (any fault but the silent process's); how long the driver took
to name the silent process (the timeout is heartbeat_timeout_s); the
driver's CPU per heartbeat (everything in this process: verification,
acknowledgements, monitor, straggler thread) and the straggler analysis's
duration.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mjax import protocol  # noqa: E402
from mjax.ft import agent as agent_lib, detect, driver as driver_lib, heartbeat as hb  # noqa: E402

PID0 = 1_000_000   # simulated pids: never a real process's
STEP_S = 1.0       # simulated step time
TIMING_EVERY = 10  # rows appended per flush, as FaultConfig.timing_every
HISTORY = 500      # steps of timing history written before the start


class FakeHandle:
  """Stands for a live trainer process: never exits."""

  def __init__(self, pid: int):
    self.pid, self.returncode = pid, None

  def poll(self):
    return None


def timing_row(process: int, step: int) -> str:
  return json.dumps({'step': step, 'process': process, 'host': f'h{process}', 'time': time.time(),
                     'phases': {'data': 0.002, 'compute': STEP_S * 0.95}}) + '\n'


def sender(first: int, last: int, address: str, secret: str, interval: float, t0: float, seconds: float,
           silent: int, silent_at: float, workdir: str, sent_out) -> None:
  """Heartbeats (and timing rows) of simulated processes first..last-1."""
  host, port = hb.parse_address(address)
  sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
  n = last - first
  # Spread the processes over the interval, as real ones are.
  next_at = [t0 + interval * (i / n) for i in range(n)]
  flushed = [HISTORY] * n
  seq = [0] * n
  sent = 0
  end = t0 + seconds
  while True:
    now = time.time()
    if now >= end:
      break
    step = HISTORY + int((now - t0) / STEP_S)
    for k in range(n):
      p = first + k
      if p == silent and now >= silent_at:
        continue
      if now >= next_at[k]:
        seq[k] += 1
        payload = {'host': f'h{p}', 'process': p, 'pid': PID0 + p, 'attempt': 0, 'step': step,
                   'step_time': STEP_S, 'step_at': now, 'loss': 2.5, 'losses': [[step, 2.5]],
                   'phase': 'compute', 'loop_step': step + 1, 'logs': [], 'final': False,
                   'seq': seq[k], 'ts': now, 'sender': f's{p}'}
        try:
          sock.sendto(hb.sign(payload, secret), (host, port))
          sent += 1
        except OSError:
          pass
        next_at[k] += interval
      if step - flushed[k] >= TIMING_EVERY:
        with open(os.path.join(workdir, 'timings', f'process-{p:05d}.jsonl'), 'a') as fh:
          fh.writelines(timing_row(p, s) for s in range(flushed[k] + 1, step + 1))
        flushed[k] = step
    time.sleep(0.002)
  sent_out.put(sent)


def _beat(p: int, step: int, now: float, seq: int) -> dict:
  return {'host': f'h{p}', 'process': p, 'pid': PID0 + p, 'attempt': 0, 'step': step,
          'step_time': STEP_S, 'step_at': now, 'loss': 2.5, 'losses': [[step, 2.5]],
          'phase': 'compute', 'loop_step': step + 1, 'logs': [], 'final': False,
          'seq': seq, 'ts': now, 'sender': f's{p}'}


def agent_sender(first: int, last: int, per_host: int, address: str, secret: str, interval: float, t0: float,
                 seconds: float, silent: int, silent_at: float, workdir: str, sent_out) -> None:
  """Simulated hosts first..last-1, each an agent relaying `per_host`
  processes' heartbeats over its own authenticated connection."""
  import selectors
  host, port = hb.parse_address(address)
  sel = selectors.DefaultSelector()
  chans = []
  for h in range(first, last):   # the agent's handshake (agent.Agent._connect)
    sock = socket.create_connection((host, port), timeout=60)
    ch = agent_lib.Channel(sock, secret, 'agent', 'driver')
    nonce = os.urandom(8).hex()
    ch.send({'kind': 'hello', 'host': f'host{h}', 'address': '127.0.0.1', 'pid': PID0 + h, 'nonce': nonce})
    welcome = None
    while welcome is None:
      welcome = next(ch.feed(sock.recv(65536)), None)
    ch.session = welcome['session']
    ch.send({'kind': 'ready'})
    sock.setblocking(False)
    sel.register(sock, selectors.EVENT_READ, ch)
    chans.append(ch)
  n = last - first
  next_at = [t0 + interval * (i / n) for i in range(n)]
  flushed = {}
  sent = 0
  end = t0 + seconds
  while time.time() < end:
    now = time.time()
    step = HISTORY + int((now - t0) / STEP_S)
    for k, ch in enumerate(chans):
      procs = range((first + k) * per_host, (first + k + 1) * per_host)
      if now >= next_at[k]:
        payloads = [_beat(p, step, now, 0) for p in procs if not (p == silent and now >= silent_at)]
        ch.sock.setblocking(True)
        ch.send({'kind': 'beats', 'payloads': payloads})
        ch.sock.setblocking(False)
        sent += len(payloads)
        next_at[k] += interval
      for p in procs:
        if step - flushed.get(p, HISTORY) >= TIMING_EVERY:
          with open(os.path.join(workdir, 'timings', f'process-{p:05d}.jsonl'), 'a') as fh:
            fh.writelines(timing_row(p, s) for s in range(flushed.get(p, HISTORY) + 1, step + 1))
          flushed[p] = step
    for key, _ in sel.select(0):   # the driver's acks: read and let go
      try:
        key.fileobj.recv(1 << 20)
      except OSError:
        pass
    time.sleep(0.002)
  sent_out.put(sent)
  for ch in chans:
    ch.close()


def simulate(n: int, seconds: float, interval: float, timeout: float, senders: int, per_host: int = 1) -> dict:
  workdir = tempfile.mkdtemp(prefix=f'mjax-scale-{n}-')
  os.makedirs(os.path.join(workdir, 'timings'))
  for p in range(n):   # the history a long run has behind it
    with open(os.path.join(workdir, 'timings', f'process-{p:05d}.jsonl'), 'w') as fh:
      fh.writelines(timing_row(p, s) for s in range(1, HISTORY + 1))
  train = ['--gin_file', 'tiny.gin', f'--gin.FaultConfig.heartbeat_interval_s={interval}',
           f'--gin.FaultConfig.heartbeat_timeout_s={timeout}',
           f'--gin.FaultConfig.progress_timeout_s={max(120.0, 3 * timeout)}',
           f'--gin.FaultConfig.collective_timeout_s={max(600.0, 6 * timeout)}']
  if per_host > 1:
    os.environ[protocol.SECRET_ENV] = hb.new_secret()
    from mjax import launch
    opts = driver_lib.parse_args(['--executor', 'agent', '--bind', f'127.0.0.1:{launch.free_port()}',
                                  '--processes', '1', '--hosts', 'host0', '--workdir', workdir, '--quiet', '--',
                                  *train])
  else:
    opts = driver_lib.parse_args(['--processes', str(n), '--workdir', workdir, '--quiet', '--', *train])
  d = driver_lib.Driver(opts)
  monitor = detect.Monitor(d.fault_cfg, d.losses)
  handles = {p: FakeHandle(PID0 + p) for p in range(n)}
  start = time.monotonic()
  for p in range(n):
    monitor.add(p, f'h{p}', PID0 + p, start)
  logs = {p: (os.devnull, 0) for p in range(n)}
  att = driver_lib.Attempt(0, [f'h{p}' for p in range(n)], handles, [None] * n, logs, monitor, [], start)

  received = {'ok': 0, 'rejected': 0}
  receive = d.server.receive

  def counting_receive(timeout):
    out = receive(timeout)
    for payload, _, _ in out:
      received['ok' if payload is not None else 'rejected'] += 1
    return out
  d.server.receive = counting_receive

  silent = n // 2
  t0 = time.time() + 1.0
  silent_at = t0 + seconds / 3
  queue = mp.Queue()
  bounds = [n * i // senders for i in range(senders + 1)]
  if per_host > 1:
    hosts = n // per_host
    hb_ = [hosts * i // senders for i in range(senders + 1)]
    procs = [mp.Process(target=agent_sender, args=(hb_[i], hb_[i + 1], per_host, d.server.address, d.secret,
                                                   interval, t0, seconds, silent, silent_at, workdir, queue))
             for i in range(senders)]
  else:
    procs = [mp.Process(target=sender, args=(bounds[i], bounds[i + 1], d.server.address, d.secret, interval, t0,
                                             seconds, silent, silent_at, workdir, queue))
             for i in range(senders)]
  for pr in procs:
    pr.start()
  cpu0, faults, detected = time.process_time(), [], None
  watch_seconds = []
  real_watch = getattr(driver_lib, '_StragglerWatch', None)   # None: a driver from before it existed
  if real_watch is not None:
    class TimedWatch(real_watch):
      def close(self, *args, **kwargs):
        watch_seconds.append(self.last_seconds)
        return super().close(*args, **kwargs)
    driver_lib._StragglerWatch = TimedWatch
  try:
    while time.time() < t0 + seconds:
      d._signal = None
      # The driver's loop returns at the first fault; note it, take the
      # process back in as if restarted, and go on watching.
      fault = _supervise_until(d, att, t0 + seconds)
      if fault is None:
        break
      now = time.time()
      for p in fault.processes:
        if fault.kind == 'heartbeat_lost' and p == silent and detected is None:
          detected = now - silent_at
        else:
          faults.append((fault.kind, p))
        monitor.add(p, f'h{p}', PID0 + p, time.monotonic())
  finally:
    if real_watch is not None:
      driver_lib._StragglerWatch = real_watch
  cpu = time.process_time() - cpu0
  for pr in procs:
    pr.join()
  sent = sum(queue.get() for _ in procs)
  time.sleep(0.5)
  if hasattr(d.server, 'heartbeats'):   # its thread merges what waits of one sender: count datagrams there
    received['ok'] = d.server.heartbeats
  messages = received['ok']
  if d.agents is not None:   # every heartbeat came through the agents
    received['ok'] += d.agents.relayed
    messages += d.agents.messages
    d.agents.close()
  rcvbuf = getattr(d.server, 'receive_buffer', None) or d.server.sock.getsockopt(socket.SOL_SOCKET,
                                                                                 socket.SO_RCVBUF)
  d.server.close()
  d.events.close()
  return {'processes': n, 'sent': sent, 'received': received['ok'], 'dropped': sent - received['ok'],
          'false_faults': faults, 'detected_s': detected, 'cpu_us_per_msg': 1e6 * cpu / max(1, received['ok']),
          'messages': messages,
          'straggler_s': max(watch_seconds) if watch_seconds else None,
          'rcvbuf': rcvbuf}


def _supervise_until(d, att, deadline: float):
  """Driver._supervise, stopped at `deadline` through its own stop path."""
  import threading

  def stop():
    time.sleep(max(0.0, deadline - time.time()))
    d._signal = 0
  threading.Thread(target=stop, daemon=True).start()
  out = d._supervise(att)
  return None if out == 'preempted' else out


# --- start-up agreement with jax's own coordination service ---------------------------

class CountingClient:
  """A coordination-service client that counts the calls made through it."""

  def __init__(self, client):
    self._client, self.calls = client, 0

  def __getattr__(self, name):
    fn = getattr(self._client, name)

    def counted(*a, **kw):
      self.calls += 1
      return fn(*a, **kw)
    return counted


def startup_agreement(client, me: int, n: int, scheme: str, timeout_s: float = 600.0) -> None:
  """What a start-up agrees on between the processes, in order: the workdir
  verdict, the checkpoint tiers' writability and sharing, the checkpoints
  every process sees, the restore's read and its verdict, the compiled
  barrier. `scheme`
  'new' is mjax's (mjax/distributed.py); 'old' gathers every process's value
  in every process, as it did before."""
  from mjax import distributed as dist
  if scheme == 'new':
    dist.broadcast_with(client, me, 'workdir/verdict', '', timeout_s)
    dist.report_with(client, me, 'ckpt/probe/writable', None, timeout_s)
    dist.broadcast_with(client, me, 'ckpt/probe/token', 'abc', timeout_s)
    dist.report_with(client, me, 'ckpt/probe/seen', None, timeout_s)
    dist.broadcast_with(client, me, 'ckpt/steps', '[[100, "persistent"]]', timeout_s)
    dist.report_with(client, me, 'ckpt/steps/missing', None, timeout_s)
    dist.report_with(client, me, 'ckpt/restore/0/read', None, timeout_s)   # the read, before any collective
    dist.report_with(client, me, 'ckpt/restore/0/check', None, timeout_s)
  else:
    for key in ('workdir/verdict', 'ckpt/probe/writable', 'ckpt/probe/token', 'ckpt/probe/seen',
                'ckpt/steps', 'ckpt/restore/0'):
      client.key_value_set(f'old/{key}/{me}', 'x')
      for i in range(n):
        client.blocking_key_value_get(f'old/{key}/{i}', int(timeout_s * 1000))
  client.wait_at_barrier('mjax/compiled', int(timeout_s * 1000))


def simulate_startup(n: int, scheme: str) -> dict:
  """n clients of one coordination service, each in its own thread."""
  import threading
  from jax._src.lib import _jax
  from mjax.launch import free_port
  address = f'127.0.0.1:{free_port()}'
  service = _jax.get_distributed_runtime_service(address, n, heartbeat_timeout=600, shutdown_timeout=60)
  clients = [CountingClient(_jax.get_distributed_runtime_client(address, i, init_timeout=600,
                                                                 heartbeat_timeout=600))
             for i in range(n)]
  ready = threading.Barrier(n + 1)
  errors = []

  def run(i):
    try:
      clients[i]._client.connect()
      ready.wait()
      ready.wait()
      startup_agreement(clients[i], i, n, scheme)
    except Exception as e:  # noqa: BLE001 -- reported in the table
      errors.append(f'{i}: {type(e).__name__}: {e}'[:200])
      ready.abort()
  threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
  for t in threads:
    t.start()
  ready.wait()
  cpu0, t0 = time.process_time(), time.perf_counter()
  ready.wait()
  for t in threads:
    t.join()
  wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
  calls = sum(c.calls for c in clients) / n

  def shutdown(c):   # a barrier of every client: all at once
    try:
      c._client.shutdown()
    except Exception:  # noqa: BLE001
      pass
  closers = [threading.Thread(target=shutdown, args=(c,), daemon=True) for c in clients]
  for t in closers:
    t.start()
  for t in closers:
    t.join()
  service.shutdown()
  return {'n': n, 'scheme': scheme, 'wall_s': wall, 'cpu_s': cpu, 'calls': calls, 'errors': errors}


def main(argv=None):
  p = argparse.ArgumentParser('scale_sim', description=__doc__.splitlines()[0])
  p.add_argument('--processes', type=int, nargs='*', default=[1536, 12288])
  p.add_argument('--seconds', type=float, default=45.0)
  p.add_argument('--interval', type=float, default=2.0, help='heartbeat_interval_s (default: FaultConfig)')
  p.add_argument('--timeout', type=float, default=20.0, help='heartbeat_timeout_s (default: FaultConfig)')
  p.add_argument('--senders', type=int, default=2, help='sender processes')
  p.add_argument('--per_host', type=int, default=1,
                 help='processes per host: above 1, heartbeats go through simulated per-host agents')
  p.add_argument('--agreement', type=int, nargs='*', default=[256, 2048],
                 help='simulated processes for the start-up agreement table (none: skip it)')
  p.add_argument('--old_up_to', type=int, default=512,
                 help='largest size at which the previous all-to-all agreement is timed too')
  args = p.parse_args(argv)
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
  print('| processes | path | heartbeats sent | messages to the driver | dropped | false faults | silent process '
        'named after | driver CPU / heartbeat | straggler analysis | socket buffer |\n'
        '|---|---|---|---|---|---|---|---|---|---|', flush=True)
  path = f'agents, {args.per_host} per host' if args.per_host > 1 else 'direct UDP'
  for n in args.processes:
    r = simulate(n, args.seconds, args.interval, args.timeout, args.senders, args.per_host)
    det = f'{r["detected_s"]:.1f} s' if r['detected_s'] is not None else 'not named'
    strag = f'{r["straggler_s"]:.2f} s' if r['straggler_s'] is not None else '-'
    print(f'| {n:,} | {path} | {r["sent"]:,} | {r["messages"]:,} | {r["dropped"]:,} ({r["dropped"] / max(1, r["sent"]):.2%}) | '
          f'{len(r["false_faults"])} | {det} (timeout {args.timeout:g} s) | {r["cpu_us_per_msg"]:.0f} µs | '
          f'{strag} | {r["rcvbuf"] / 2**10:,.0f} KiB |', flush=True)
    if r['false_faults']:
      print(f'  false faults at {n}: {r["false_faults"][:10]}', flush=True)
  if not args.agreement:
    return
  print('\n| processes | agreement | coordination calls per process | start-up agreement wall time '
        '| CPU (service + clients) |\n|---|---|---|---|---|', flush=True)
  for n in args.agreement:
    for scheme in ('new', 'old') if n <= args.old_up_to else ('new',):
      r = simulate_startup(n, scheme)
      what = 'mjax (broadcast / report)' if scheme == 'new' else 'previous (all-to-all gets)'
      err = f' ({len(r["errors"])} errors: {r["errors"][0]})' if r['errors'] else ''
      print(f'| {n:,} | {what} | {r["calls"]:.0f} | {r["wall_s"]:.2f} s | {r["cpu_s"]:.1f} s |{err}',
            flush=True)


if __name__ == '__main__':
  main()
