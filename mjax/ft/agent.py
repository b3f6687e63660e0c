"""Per-host agents: the driver's hands on every host (MegaScale §7's executors).

  mjax-agent --driver HEAD:PORT                  # on every host, e.g. srun --ntasks-per-node=1
  mjax-launch --executor agent --bind HEAD:PORT --processes N --workdir DIR -- <mjax-train args>

One agent runs on each host for the whole job; the driver (mjax/ft/driver.py)
talks to the agents only. An agent

  - starts, signals and kills its host's training processes, and reports
    their exits;
  - runs the host's diagnostics (mjax-diagnose) when the driver asks, in a
    thread of its own so that heartbeats keep flowing meanwhile;
  - receives its trainers' heartbeats (UDP on the host itself, verified and
    acknowledged there) and relays them to the driver in aggregate: one
    message per heartbeat interval for the whole host, so that the driver
    verifies one message per host where it would verify one per process.

Starts and stops are messages: the driver sends them to every agent at once
and each host acts in parallel.

The channel is one TCP connection per agent, opened by the agent (so a host
needs only the driver's address, as a pod or a srun task has). Every message
is one line of JSON signed with HMAC-SHA256 under the per-job secret
(MJAX_JOB_SECRET, the same secret as the heartbeats), bound to the session
(both sides' fresh random nonces) and carrying a per-direction sequence
number: a message from another job, an altered one, a replay from an earlier
connection or out of order closes the connection. The handshake:

  agent  -> driver   hello   {host, address, pid, nonce A}
  driver -> agent    welcome {session "D:A", heartbeat interval and timeout,
                              progress timeout}
  agent  -> driver   ready   (the first message carrying the session)

An agent counts as connected only after `ready`, so a replayed hello
registers nothing.

Messages, driver to agent:
  start {id, argv, env, log}     env: the job's MJAX_* variables and what the
                                 driver sets on purpose (XLA_FLAGS, ...), None
                                 for a name to remove; the host's own
                                 environment applies to everything else
  signal {id, sig}, kill {id}    SIGKILL to the process group
  run {id, argv, env, timeout}   -> ran {id, code, out, err}
  port {id}                      -> port {id, port}: a TCP port free on the host,
                                 for the JAX coordinator of process 0
  ack {supervised}               after each `beats`: the driver is alive, and
                                 (supervised) its loop watched the job within
                                 collective_timeout_s (a loop held up by slow
                                 storage is not a lost driver)
  exit {reason}                  the job is over: stop everything, exit 0
Agent to driver:
  started {id, pid}, exited {id, code}, ran {...}
  beats {payloads}               every heartbeat interval, also when empty
                                 (then it is the agent's own heartbeat)

Failure behaviour:
  - The driver hears nothing from an agent for heartbeat_timeout_s, or its
    connection closes: that host's processes count as lost (`host_lost`),
    the driver's usual recovery follows, and the host sits out (not
    blocked: a network blip must not cost a healthy host for good) until
    its agent is back and passes its diagnostics; a spare takes its place.
    So does a host whose agent goes while its diagnostic, or a link check
    with it, runs: that run is no verdict.
  - Hostile or broken peers: before it authenticates a connection may send
    one small hello and has HANDSHAKE_S to finish; at most MAX_PENDING wait
    at once. The server's thread never blocks on one agent (a peer that
    stops reading is dropped) and no message stops it. A second agent
    claiming a live host is refused. A refused connection is told why in
    one unsigned line before it is closed, so that an agent with the wrong
    secret says so instead of 'no driver'; it tries again every
    REFUSED_RETRY_S.
  - An agent hears nothing from its driver for heartbeat_timeout_s, or
    hears that its loop has stopped watching for collective_timeout_s
    (`supervised` false): it stops
    acknowledging its trainers' heartbeats, so they save and exit by
    themselves (HeartbeatClient.driver_lost), as without an agent; after a
    lost connection, whatever still runs a timeout later is killed. Nothing
    trains unsupervised. The agent then connects again, to whichever driver
    comes (a restarted one): the driver tells the agents to exit only when
    the job is over, not when it is pre-empted or dies.
  - An agent that cannot reach a driver for --connect_timeout_s exits 1.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import errno
import itertools
import json
import logging
import math
import os
import secrets
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

from mjax import jsonfile, protocol
from mjax.ft import events as events_lib, heartbeat as hb
from mjax.ft.executor import CANCELLED, run_to_end

log = logging.getLogger('mjax.agent')

MAX_LINE = 8 << 20        # bytes of one message once authenticated
MAX_HELLO = 4096          # bytes a connection may send before it has authenticated
OUTPUT_LIMIT = 64 << 10   # characters of a diagnostic's stdout / stderr relayed (the tail:
                          # the report is its last line); at most 4 bytes each encoded
HANDSHAKE_S = 5.0         # a connection must complete its handshake within this
SEND_TIMEOUT_S = 10.0     # a command to an agent that reads nothing for this long fails
MAX_PENDING = 256         # connections mid-handshake at once; the oldest go first
EXIT_HOST_LOST = protocol.EXIT_HOST_LOST
CONNECT_RETRY_S = 0.5
REFUSED_RETRY_S = 5.0     # an agent the driver refused tries again this much later (its secret may be
                          # fixed by a restarted driver; sooner would fill the driver's events)
REFUSED_EVENT_S = 30.0    # a refusal of the same host for the same reason is written at most this often


class ChannelError(Exception):
  """The peer sent something that is not an authentic, in-order message."""


class Refused(Exception):
  """The driver answered this agent's hello with a refusal and closed."""


def _refusal(data: bytes) -> Optional[str]:
  """The reason in a driver's refusal line (AgentServer._refuse), or None.
  Unsigned, so it only ever changes what the agent tells its user."""
  line = data.partition(b'\n')[0]
  if len(line) > MAX_HELLO:
    return None
  try:
    msg = jsonfile.loads(line)
  except (ValueError, RecursionError):
    return None
  if isinstance(msg, dict) and set(msg) == {'refused'} and isinstance(msg['refused'], str):
    # Printed as it came: no control characters (a terminal's escapes) from an unchecked peer.
    return ''.join(c if c.isprintable() else '?' for c in msg['refused'][:200])
  return None


def _claimed_host(data: bytes) -> Optional[str]:
  """The host a hello that failed to authenticate names, unverified: only
  for telling the user which agent holds the wrong secret."""
  try:
    hello = jsonfile.loads(jsonfile.loads(data.partition(b'\n')[0][:MAX_HELLO])['payload'])
    host = hello['host']
  except (ValueError, RecursionError, KeyError, TypeError, IndexError):
    return None
  return host[:100] if isinstance(host, str) and host.isprintable() and host else None


class ChannelBusy(BlockingIOError):
  """Another thread is sending on the channel (a `wait=False` send gives way)."""


class Channel:
  """One authenticated TCP connection (see the module docstring).

  `send` may be called from several threads; `feed` from one.
  """

  def __init__(self, sock: socket.socket, secret_hex: str, me: str, peer: str):
    self.sock = sock
    self._key = bytes.fromhex(secret_hex)
    self._secret = secret_hex
    self.me, self.peer = me, peer          # 'agent' / 'driver': the direction of each message
    self.session: Optional[str] = None
    self._sent = 0
    self._received = 0
    self._buf = bytearray()
    self._lock = threading.Lock()
    self.max_line = MAX_LINE

  def send(self, msg: dict, wait: bool = True) -> None:
    """Raises OSError when the connection is gone. `wait=False`: all or
    nothing at once, never blocking (for a thread that serves every host):
    BlockingIOError when the peer's buffers are full or another thread is
    sending; a partly sent message has broken the stream, so the caller
    drops the connection."""
    if not self._lock.acquire(blocking=wait):
      raise ChannelBusy('another send is under way')
    try:
      self._sent += 1
      payload = {**msg, 'from': self.me, 'seq': self._sent, 'session': self.session}
      view = memoryview(hb.sign(payload, self._secret) + b'\n')
      deadline = time.monotonic() + SEND_TIMEOUT_S
      while view:
        try:
          view = view[self.sock.send(view):]
        except BlockingIOError:
          pass
        if not view:
          break
        left = deadline - time.monotonic()
        if not wait:
          raise BlockingIOError('the peer is not reading')
        if left <= 0:
          raise TimeoutError(f'the peer read nothing for {SEND_TIMEOUT_S:.0f}s')
        _wait_writable(self.sock, left)
    finally:
      self._lock.release()

  def feed(self, data: bytes):
    """Yields the complete messages in what arrived, one at a time (so that
    a session set while handling one applies to the next); raises
    ChannelError while iterating."""
    self._buf += data
    while True:
      end = self._buf.find(b'\n')
      if end < 0:
        if len(self._buf) > self.max_line:
          raise ChannelError(f'a message longer than {self.max_line} bytes')
        return
      line = bytes(self._buf[:end])
      del self._buf[:end + 1]
      yield self._open(line)

  def _open(self, line: bytes) -> dict:
    if len(line) > self.max_line:
      raise ChannelError(f'a message longer than {self.max_line} bytes')
    try:
      text = hb.open_envelope(line, self._key, what='channel')
    except hb.Rejected as e:
      raise ChannelError(e.reason) from None
    try:
      msg = jsonfile.loads(text)
      if not isinstance(msg, dict) or 'kind' not in msg:   # what the caller dispatches on
        raise KeyError('kind')
      seq = int(msg['seq'])
    except (ValueError, KeyError, TypeError, RecursionError):
      raise ChannelError('signed message lacks kind / seq') from None
    if msg.get('from') != self.peer:
      raise ChannelError('a message of the wrong direction (reflected)')
    if seq != self._received + 1:
      raise ChannelError(f'message {seq} out of order (expected {self._received + 1}): replayed or lost')
    if self.session is not None and msg.get('session') != self.session:
      raise ChannelError('a message of another session (replayed)')
    self._received = seq
    return msg

  def close(self) -> None:
    try:
      self.sock.close()
    except OSError:
      pass


def _wait_writable(sock, timeout: float) -> None:
  """Waits at most `timeout` seconds for room in `sock`'s send buffer. poll,
  not select: select() refuses descriptors from 1,024 on, and a driver
  serving more hosts than that has them."""
  fd = sock.fileno()
  if fd < 0:   # closed meanwhile (the server's thread dropped the connection)
    raise OSError(errno.EBADF, 'the connection is closed')
  poller = select.poll()
  poller.register(fd, select.POLLOUT)
  poller.poll(math.ceil(max(0.0, timeout) * 1000))


# Set on purpose by the driver (mjax/launch.py): sent whatever the driver's
# own environment holds, since the host's may differ.
_DRIVER_OWNED = ('XLA_FLAGS', 'JAX_PLATFORMS', 'PYTHONUNBUFFERED')


def _env_delta(env: dict) -> dict:
  """What a remote host's process needs of `env` (the driver's view of its
  environment): the MJAX_* job variables and the driver-owned names as they
  are, whatever else differs from the driver's own environment, and None
  for a name the driver removed from its own. The host's own environment
  (PATH, its devices, anything set for that host alone) applies to
  everything else."""
  delta: dict = {k: v for k, v in env.items()
                 if os.environ.get(k) != v or k.startswith('MJAX_') or k in _DRIVER_OWNED}
  delta.update({k: None for k in os.environ if k not in env})
  return delta


def _clip(text: str) -> str:
  return text if len(text) <= OUTPUT_LIMIT else text[-OUTPUT_LIMIT:]


# ----------------------------------------------------------------------------
# The driver's end
# ----------------------------------------------------------------------------

class AgentHandle:
  """A process started through an agent, with what the driver uses of
  subprocess.Popen: pid, returncode, poll, send_signal, wait."""

  def __init__(self, link: 'AgentLink', ident: int):
    self.link, self.id = link, ident
    self.pid: Optional[int] = None        # the process's pid on its host (after `started`)
    self.returncode: Optional[int] = None
    self.host_lost = False                # its agent went away: returncode is EXIT_HOST_LOST by fiat
    self._done = threading.Event()

  def poll(self) -> Optional[int]:
    return self.returncode

  def send_signal(self, sig: int) -> None:
    if self.returncode is None:
      self.link.send({'kind': 'signal', 'id': self.id, 'sig': int(sig)})

  def wait(self, timeout: Optional[float] = None) -> int:
    if not self._done.wait(timeout):
      raise subprocess.TimeoutExpired(f'process {self.id} on {self.link.host}', timeout)
    return self.returncode

  def _exited(self, code: int, host_lost: bool = False) -> None:
    if self.returncode is None:
      self.host_lost = host_lost
      self.returncode = int(code)
      self._done.set()


@dataclasses.dataclass
class AgentLink:
  """The driver's view of one connected agent."""
  host: str
  address: str                 # how other hosts reach this one (coordinator address)
  pid: int
  channel: Channel
  last_heard: float
  handles: dict = dataclasses.field(default_factory=dict)    # id -> AgentHandle
  runs: dict = dataclasses.field(default_factory=dict)       # id -> Future
  ready: bool = False
  lost: bool = False
  stopping: Optional[str] = None   # the signal its agent was sent (the host is going): its trainers' stop

  def send(self, msg: dict) -> None:
    if self.lost:
      return
    try:
      self.channel.send(msg)
    except (OSError, ValueError):   # ValueError: a socket closed under the send
      pass   # noticed by the server's loop, which marks the host lost


class AgentServer:
  """Accepts the agents' connections and serves them from one thread.

  Relayed heartbeats wait in a queue for the driver's loop (`take_beats`);
  process exits and diagnostic results go straight to their handles and
  futures.
  """

  def __init__(self, host: str, port: int, secret_hex: str, interval_s: float, timeout_s: float,
               on_event: Optional[Callable[..., None]] = None, save_timeout_s: float = 600.0,
               stall_s: Optional[float] = None):
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    self._listener = socket.socket(info[0], socket.SOCK_STREAM)
    self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self._listener.bind(info[4])
    self._listener.listen(4096)
    self.port = self._listener.getsockname()[1]
    self.secret = secret_hex
    self.interval_s, self.timeout_s = interval_s, timeout_s
    self.save_timeout_s = save_timeout_s   # what the driver lets a save take (detect.SLOW_PHASES)
    # How long the driver's loop may go without `watching` before the job
    # counts as unsupervised (default: the heartbeat timeout).
    self.stall_s = timeout_s if stall_s is None else stall_s
    self._on_event = on_event or (lambda kind, **kw: None)
    # An agent with the wrong secret tries again and again; the driver's
    # events say so once in REFUSED_EVENT_S per host and reason, with the
    # count in between.
    self._refused = events_lib.Throttle(REFUSED_EVENT_S)
    self._lock = threading.Lock()
    self._links: dict[str, AgentLink] = {}       # host -> its ready agent
    self._pending: dict[socket.socket, tuple[Channel, float, Optional[dict]]] = {}
    self._by_sock: dict[socket.socket, AgentLink] = {}
    self._beats: dict[tuple, dict] = {}          # (process, pid, attempt) -> newest, losses merged
    self._ids = itertools.count(1)
    self._watched = time.monotonic()              # the driver's loop was last seen here (`watching`)
    self._accept_paused_until = 0.0
    self.messages = 0            # beats messages received
    self.relayed = 0             # heartbeats inside them
    # The newest refused handshake of each kind of reason ('bad signature',
    # 'another agent ...'): (host, reason), for the driver to name when no
    # agent of a host it waits for gets in.
    self.refusals: dict[str, tuple[Optional[str], str]] = {}
    # Hosts whose agent said it was stopping (a signal: its node evicted or
    # drained), until an agent of theirs connects again: not waited for.
    self.departed: set[str] = set()
    self._farewell = False
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, name='mjax-agent-server', daemon=True)
    self._thread.start()

  # --- what the driver uses ---------------------------------------------------

  def connected(self) -> list[str]:
    with self._lock:
      return sorted(h for h, link in self._links.items() if not link.lost)

  def link(self, host: str) -> Optional[AgentLink]:
    with self._lock:
      link = self._links.get(host)
    return link if link is not None and not link.lost else None

  def wait_for(self, hosts: Sequence[str], timeout_s: float, enough: Optional[int] = None,
               go_on: Callable[[], bool] = lambda: True) -> list[str]:
    """Waits until every host in `hosts` (or `enough` of them) has an agent,
    at most `timeout_s` and while `go_on()`; returns those connected."""
    want = len(hosts) if enough is None else enough
    deadline = time.monotonic() + timeout_s
    while True:
      have = [h for h in hosts if self.link(h) is not None]
      if len(have) >= want or time.monotonic() >= deadline or self._stop.is_set() or not go_on():
        return have
      time.sleep(0.05)

  def take_beats(self) -> list[dict]:
    """The heartbeats relayed since the last call: the newest of each
    process, with every loss reported in between."""
    with self._lock:
      out, self._beats = list(self._beats.values()), {}
    return out

  def watching(self) -> None:
    """Called by the driver's loop every tick it watches the job: the acks
    tell the agents the job is supervised only while this goes on (a
    driver whose loop is stuck must not keep its trainers training)."""
    self._watched = time.monotonic()

  def alive(self) -> bool:
    return self._thread.is_alive()

  def start(self, host: str, argv: Sequence[str], env: dict, log_path: str) -> AgentHandle:
    link = self.link(host)
    ident = next(self._ids)
    if link is None:   # no agent: the process never runs, the host counts as lost
      handle = AgentHandle(AgentLink(host, host, 0, None, 0.0, lost=True), ident)
      handle._exited(EXIT_HOST_LOST, host_lost=True)
      return handle
    handle = AgentHandle(link, ident)
    if not self._enrol(link, link.handles, ident, handle):
      handle._exited(EXIT_HOST_LOST, host_lost=True)
      return handle
    link.send({'kind': 'start', 'id': ident, 'argv': list(argv), 'env': _env_delta(env), 'log': log_path})
    return handle

  def _enrol(self, link: 'AgentLink', table: dict, ident: int, item: Any) -> bool:
    """Registers a handle or future with its link, unless the link is lost
    (checked under the lock `_lose` takes, so nothing lands after it)."""
    with self._lock:
      if link.lost:
        return False
      table[ident] = item
      return True

  def kill(self, handle: AgentHandle) -> None:
    if handle.returncode is None:
      handle.link.send({'kind': 'kill', 'id': handle.id})

  def run(self, host: str, argv: Sequence[str], env: dict, timeout: float,
          cancel: Optional[Callable[[], bool]] = None) -> tuple[int, str, str]:
    link = self.link(host)
    if link is None:
      return EXIT_HOST_LOST, '', f'no agent connected for host {host}'
    ident = next(self._ids)
    fut: concurrent.futures.Future = concurrent.futures.Future()
    if not self._enrol(link, link.runs, ident, fut):
      return EXIT_HOST_LOST, '', f'the agent on {host} went away'
    link.send({'kind': 'run', 'id': ident, 'argv': list(argv), 'env': _env_delta(env), 'timeout': timeout})
    deadline = time.monotonic() + timeout + 30.0   # the agent enforces `timeout`; this covers a silent agent
    while True:
      try:
        return fut.result(min(0.25, max(0.0, deadline - time.monotonic())))
      except concurrent.futures.TimeoutError:
        pass
      if cancel is not None and cancel():
        # Not waited for: the agent kills the command (an older agent, which
        # knows no 'cancel', ends it at its own timeout).
        link.send({'kind': 'cancel', 'id': ident})
        return CANCELLED, '', 'cancelled: the driver was asked to stop'
      if time.monotonic() >= deadline:
        link.send({'kind': 'cancel', 'id': ident})
        return 124, '', f'the agent on {host} did not answer within {timeout + 30.0:.0f}s'

  def free_port(self, host: str, fallback: int) -> int:
    """A port free on `host` (its agent looks), else `fallback`."""
    link = self.link(host)
    if link is None:
      return fallback
    ident = next(self._ids)
    fut: concurrent.futures.Future = concurrent.futures.Future()
    if not self._enrol(link, link.runs, ident, fut):
      return fallback
    link.send({'kind': 'port', 'id': ident})
    try:
      port = fut.result(10.0)
    except concurrent.futures.TimeoutError:
      return fallback
    return port if isinstance(port, int) and 0 < port < 65536 else fallback

  def farewell(self, reason: str) -> None:
    """Tells every agent the job is over (they stop their processes and exit)."""
    self._farewell = True   # the connections closing now are no news
    with self._lock:
      links = list(self._links.values())
    for link in links:
      link.send({'kind': 'exit', 'reason': reason})

  def close(self, linger_s: float = 0.0) -> None:
    """Stops serving; with `linger_s`, first waits that long at most for the
    agents to close their ends (after `farewell`, so that it reaches them)."""
    deadline = time.monotonic() + linger_s
    while self.connected() and time.monotonic() < deadline and self.alive():
      time.sleep(0.05)
    self._stop.set()
    self._thread.join(timeout=15.0)
    if self._thread.is_alive():
      return   # stuck in a system call: leave its sockets to the process's exit
    with self._lock:
      links = list(self._links.values())
    for link in links:
      link.channel.close()
    for ch, _, _ in list(self._pending.values()):
      ch.close()
    self._listener.close()

  # --- the server's thread ----------------------------------------------------

  def _loop(self) -> None:
    # epoll where there is one: select() stops at 1,024 descriptors, and a
    # large job has more hosts than that.
    self._sel = selectors.DefaultSelector()
    self._sel.register(self._listener, selectors.EVENT_READ)
    next_check = time.monotonic() + 0.1
    while not self._stop.is_set():
      now = time.monotonic()
      if self._accept_paused_until and now >= self._accept_paused_until:
        self._accept_paused_until = 0.0
        self._sel.register(self._listener, selectors.EVENT_READ)
      for key, _ in self._sel.select(0.1):
        # Nothing one connection does may stop the thread that serves them all.
        try:
          if key.fileobj is self._listener:
            self._accept()
          else:
            self._read(key.fileobj)
        except Exception as e:  # noqa: BLE001
          self._drop(key.fileobj, f'{type(e).__name__}: {e}')
      now = time.monotonic()
      if now >= next_check:
        next_check = now + 0.1
        try:
          self._check_silent(now)
        except Exception as e:  # noqa: BLE001
          log.warning('agent server: %s', e)

  def _drop(self, sock, why: str) -> None:
    link = self._by_sock.get(sock)
    if link is not None:
      self._lose(link, f'dropped: {why}')
    else:
      pending = self._pending.get(sock)
      self._forget(sock)
      if pending is not None:
        pending[0].close()

  def _accept(self) -> None:
    try:
      sock, _ = self._listener.accept()
    except OSError as e:
      if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
        # Out of descriptors: the listener stays readable; watching it now
        # would spin. Look again in a second (connections wait in the backlog).
        self._sel.unregister(self._listener)
        self._accept_paused_until = time.monotonic() + 1.0
        log.warning('agent server: cannot accept (%s); pausing for 1 s', e)
      return
    if len(self._pending) >= MAX_PENDING:   # a flood of unauthenticated connections: the oldest go
      oldest = min(self._pending, key=lambda s: self._pending[s][1])
      self._drop(oldest, 'too many connections mid-handshake')
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # Non-blocking: the server's thread never waits on one agent
    # (Channel.send(wait=False)); the driver's own commands wait at most
    # SEND_TIMEOUT_S for a slow one.
    sock.setblocking(False)
    channel = Channel(sock, self.secret, 'driver', 'agent')
    channel.max_line = MAX_HELLO   # until it has authenticated
    self._pending[sock] = (channel, time.monotonic(), None)
    self._sel.register(sock, selectors.EVENT_READ)

  def _read(self, sock: socket.socket) -> None:
    try:
      data = sock.recv(1 << 20)
    except BlockingIOError:
      return   # nothing after all
    except OSError:
      data = b''
    if sock in self._pending:
      self._handshake(sock, data)
      return
    link = self._by_sock.get(sock)
    if link is None:
      return
    if not data:
      self._lose(link, 'connection closed')
      return
    link.last_heard = time.monotonic()
    try:
      for msg in link.channel.feed(data):
        self._handle(link, msg)
    except ChannelError as e:
      self._on_event('agent_rejected', host=link.host, reason=str(e))
      self._lose(link, f'rejected: {e}')

  def _handshake(self, sock: socket.socket, data: bytes) -> None:
    channel, since, hello = self._pending[sock]
    try:
      if not data:
        raise ChannelError('closed during the handshake')
      for msg in channel.feed(data):
        if hello is None:
          if msg.get('kind') != 'hello' or not isinstance(msg.get('nonce'), str) or not msg.get('host'):
            raise ChannelError('the first message is not a hello')
          hello = msg
          channel.session = f'{secrets.token_hex(16)}:{msg["nonce"]}'
          channel.send({'kind': 'welcome', 'interval_s': self.interval_s, 'timeout_s': self.timeout_s,
                        'save_timeout_s': self.save_timeout_s}, wait=False)
          self._pending[sock] = (channel, since, hello)
        elif msg.get('kind') == 'ready' and msg.get('session') == channel.session:
          self._register(sock, channel, hello)
          return
        else:
          raise ChannelError('expected ready')
    except (ChannelError, OSError) as e:
      if data:
        self._refuse(sock, channel, (hello or {}).get('host'), str(e),
                     claimed=None if hello else _claimed_host(data))
      else:
        self._forget(sock)
        channel.close()

  def _refuse(self, sock: socket.socket, channel: Channel, host: Optional[str], reason: str,
              claimed: Optional[str] = None) -> None:
    """Ends a connection that did not authenticate, saying why in one
    unsigned line: the agent cannot check it (with the wrong secret nothing
    the driver signs would verify), but it can tell its user that a driver
    answered and refused it, and why, instead of 'no driver'. The line
    carries nothing an impostor could use."""
    try:
      peer = '%s:%s' % sock.getpeername()[:2]
    except OSError:
      peer = '?'
    try:
      sock.send(json.dumps({'refused': reason[:200]}).encode() + b'\n')
    except OSError:
      pass   # gone, or its buffer full: it learns nothing, as before
    self._forget(sock)
    channel.close()
    key = (str(host or claimed), reason.partition(':')[0])
    since = self._refused.admit(key)
    if since is None:
      return
    with self._lock:
      self.refusals[key[1]] = (host or (claimed and f'an agent that says it is {claimed}'), reason)
    self._on_event('agent_rejected', host=host, peer=peer, reason=reason,
                   **({'claimed_host': claimed} if claimed else {}),
                   **({'suppressed_before': since} if since else {}))

  def _forget(self, sock: socket.socket) -> None:
    self._pending.pop(sock, None)
    self._by_sock.pop(sock, None)
    try:
      self._sel.unregister(sock)
    except (KeyError, ValueError):
      pass

  def _register(self, sock: socket.socket, channel: Channel, hello: dict) -> None:
    del self._pending[sock]
    host = str(hello['host'])
    with self._lock:
      old = self._links.get(host)
    if old is not None and not old.lost and time.monotonic() - old.last_heard < self.timeout_s:
      # A live agent already speaks for this host (two agents with one host
      # name would otherwise knock each other off in turn). A restarted
      # agent gets in once the old link falls silent.
      self._refuse(sock, channel, host, 'another agent of this host is connected and alive')
      return
    channel.max_line = MAX_LINE
    pid = hello.get('pid')
    link = AgentLink(host, str(hello.get('address') or host), pid if isinstance(pid, int) else 0, channel,
                     time.monotonic(), ready=True)
    with self._lock:
      self._links[host] = link
    self._by_sock[sock] = link
    if old is not None and not old.lost:
      self._lose(old, 'replaced by a new connection from the same host')
    self.departed.discard(host)
    self._on_event('agent_connected', host=host, address=link.address, pid=link.pid)

  def _handle(self, link: AgentLink, msg: dict) -> None:
    kind = msg.get('kind')
    if kind == 'beats':
      payloads = msg.get('payloads')
      payloads = [p for p in payloads if isinstance(p, dict)] if isinstance(payloads, list) else []
      with self._lock:
        for p in payloads:
          key = (p.get('process'), p.get('pid'), p.get('attempt'))
          self._beats[key] = hb.merge_beats(self._beats.get(key), p)
        self.messages += 1
        self.relayed += len(payloads)
      # Supervised: the driver's loop is watching the job right now. The
      # agent acknowledges its trainers' heartbeats only while it is.
      supervised = time.monotonic() - self._watched < self.stall_s
      try:
        link.channel.send({'kind': 'ack', 'supervised': supervised}, wait=False)
      except ChannelBusy:
        pass   # the driver's thread is sending to it: this ack can go, the next one comes
      except BlockingIOError:
        self._lose(link, 'not reading what the driver sends')
      except OSError as e:
        self._lose(link, f'send failed: {e}')
    elif kind == 'stopping':
      link.stopping = str(msg.get('signal') or 'a stop signal')
      self.departed.add(link.host)
      self._on_event('agent_stopping', host=link.host, signal=link.stopping)
    elif kind == 'started':
      h = link.handles.get(msg.get('id'))
      if h is not None and isinstance(msg.get('pid'), int):
        h.pid = msg['pid']
    elif kind == 'exited':
      h = link.handles.pop(msg.get('id'), None)
      code = msg.get('code')
      if h is not None:
        h._exited(code if isinstance(code, int) else 1)
    elif kind == 'ran':
      fut = link.runs.pop(msg.get('id'), None)
      code = msg.get('code')
      if fut is not None and not fut.done():
        fut.set_result((code if isinstance(code, int) else 1, str(msg.get('out', '')), str(msg.get('err', ''))))
    elif kind == 'port':
      fut = link.runs.pop(msg.get('id'), None)
      if fut is not None and not fut.done():
        fut.set_result(msg.get('port'))

  def _check_silent(self, now: float) -> None:
    for sock, (channel, since, _) in list(self._pending.items()):
      if now - since > HANDSHAKE_S:   # a connection that never completes its handshake
        self._forget(sock)
        channel.close()
    for link in list(self._by_sock.values()):
      if not link.lost and now - link.last_heard > self.timeout_s:
        self._lose(link, f'silent for {now - link.last_heard:.1f}s')

  def _lose(self, link: AgentLink, why: str) -> None:
    """The host is gone: its processes count as exited (EXIT_HOST_LOST)."""
    with self._lock:
      if link.lost:
        return
      link.lost = True   # under the lock: nothing enrols with this link after this
      if self._links.get(link.host) is link:
        del self._links[link.host]
    for sock, l in list(self._by_sock.items()):
      if l is link:
        self._forget(sock)
    link.channel.close()
    for h in list(link.handles.values()):
      h._exited(EXIT_HOST_LOST, host_lost=True)
    for fut in list(link.runs.values()):
      if not fut.done():
        fut.set_result((EXIT_HOST_LOST, '', f'the agent on {link.host} went away ({why})'))
    link.runs.clear()
    if not (self._stop.is_set() or self._farewell):
      self._on_event('agent_lost', host=link.host, reason=why)


class AgentExecutor:
  """The executor (mjax/ft/executor.py's interface) of one host with an agent."""
  remote = True   # pids are the host's own: the attempt number tells processes apart

  def __init__(self, server: AgentServer, host: str):
    self.server, self.host = server, host

  def coordinator(self, port: int) -> str:
    """The address of process 0's coordinator on this host: a port free
    there (the driver's `port` was free on the driver's machine)."""
    link = self.server.link(self.host)
    return f'{link.address if link else self.host}:{self.server.free_port(self.host, port)}'

  def start(self, argv: Sequence[str], env: dict, log_path: str) -> AgentHandle:
    return self.server.start(self.host, argv, env, log_path)

  def kill(self, handle: AgentHandle) -> None:
    self.server.kill(handle)

  def run(self, argv: Sequence[str], env: dict, timeout: float,
          cancel: Optional[Callable[[], bool]] = None) -> tuple[int, str, str]:
    return self.server.run(self.host, argv, env, timeout, cancel)


# ----------------------------------------------------------------------------
# The agent
# ----------------------------------------------------------------------------

class Agent:
  """One host's agent: `serve()` returns its exit status."""

  def __init__(self, driver: str, secret_hex: str, host: str, address: str,
               connect_timeout_s: float = 600.0, heartbeat_bind: str = '127.0.0.1:0', grace_s: float = 5.0):
    self.driver = hb.parse_address(driver)
    self.secret = secret_hex
    self.host, self.address = host, address
    self.connect_timeout_s = connect_timeout_s
    self.grace_s = grace_s
    # The host's trainers send their heartbeats here (window: clock skew
    # between trainer and agent is nil, they share the host).
    self.beats = hb.HeartbeatServer(heartbeat_bind, secret_hex, 60.0)
    self.beats.acking = False   # until a driver is heard (`_session`)
    self.procs: dict[int, subprocess.Popen] = {}
    self.latest: dict[int, dict] = {}       # process -> merged payload since the last relay
    self.step_s: dict[int, float] = {}      # process -> its last step's seconds
    self.interval_s, self.timeout_s, self.save_timeout_s = 2.0, 20.0, 600.0
    self._channel: Optional[Channel] = None
    self._signal: Optional[int] = None
    self._signals = 0   # how many: a second one during the trainers' stop cuts it
    self._signalled_at = 0.0
    self._stopping = False   # its trainers told to stop (a signal to the agent): nothing new starts
    self._termed: set = set()   # trainers sent SIGTERM, by the driver or by the agent: not again
    self._exit = False
    self.refused: Optional[str] = None   # why the driver refused this agent, while it does
    self._running: set = set()     # ids of the driver's commands running (diagnostics)
    self._cancelled: set = set()   # those of them the driver cancelled

  # --- connection -------------------------------------------------------------

  def _connect(self) -> Optional[Channel]:
    """Connects and completes the handshake, retrying until connect_timeout_s."""
    deadline = time.monotonic() + self.connect_timeout_s
    said = False
    self.refused = None
    while time.monotonic() < deadline and self._signal is None:
      sock = None
      try:
        sock = socket.create_connection(self.driver, timeout=5.0)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ch = Channel(sock, self.secret, 'agent', 'driver')
        nonce = secrets.token_hex(16)
        ch.send({'kind': 'hello', 'host': self.host, 'address': self.address, 'pid': os.getpid(),
                 'nonce': nonce})
        welcome = None
        while welcome is None:
          data = sock.recv(1 << 16)
          if not data:
            raise ConnectionError('closed by the driver')
          reason = _refusal(data)
          if reason is not None:
            raise Refused(reason)
          welcome = next(ch.feed(data), None)
        if welcome.get('kind') != 'welcome' or not str(welcome.get('session', '')).endswith(f':{nonce}'):
          raise ChannelError('no welcome for this hello')
        ch.session = welcome['session']
        self.interval_s = float(welcome.get('interval_s', self.interval_s))
        self.timeout_s = float(welcome.get('timeout_s', self.timeout_s))
        self.save_timeout_s = float(welcome.get('save_timeout_s', self.save_timeout_s))
        ch.send({'kind': 'ready'})
        sock.settimeout(10.0)
        print(f'mjax-agent: {self.host}: connected to the driver at {self.driver[0]}:{self.driver[1]}',
              file=sys.stderr, flush=True)
        self.refused = None
        return ch
      except Refused as e:
        sock.close()
        if str(e) != self.refused:
          # Once per reason: the agent keeps trying (a driver restarted
          # with the right secret lets it in), less often than for a driver
          # that is not up yet, whose events would fill with refusals.
          hint = (f' {protocol.SECRET_ENV} must be the same for the driver and every agent of the job.'
                  if str(e).startswith('bad signature') else '')
          print(f'mjax-agent: {self.host}: the driver at {self.driver[0]}:{self.driver[1]} refused this '
                f'agent: {e}.{hint} Trying again every {REFUSED_RETRY_S:.0f}s until --connect_timeout_s.',
                file=sys.stderr, flush=True)
        self.refused = str(e)
        wake = min(deadline, time.monotonic() + REFUSED_RETRY_S)
        while time.monotonic() < wake and self._signal is None:
          time.sleep(0.1)
      except (OSError, ChannelError) as e:
        if sock is not None:
          sock.close()
        self.refused = None   # what it says at the end is what it saw last
        if not said:
          print(f'mjax-agent: {self.host}: waiting for the driver at {self.driver[0]}:{self.driver[1]} '
                f'({e})', file=sys.stderr, flush=True)
          said = True
        time.sleep(CONNECT_RETRY_S)
    return None

  # --- main loop --------------------------------------------------------------

  def serve(self) -> int:
    old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
      while not self._exit and self._signal is None:
        self._channel = self._connect()
        if self._channel is None:
          if self._signal is None:
            if self.refused is not None:
              print(f'mjax-agent: {self.host}: the driver at {self.driver[0]}:{self.driver[1]} still refused '
                    f'this agent after {self.connect_timeout_s:.0f}s ({self.refused}); exiting',
                    file=sys.stderr, flush=True)
            else:
              print(f'mjax-agent: {self.host}: no driver at {self.driver[0]}:{self.driver[1]} within '
                    f'{self.connect_timeout_s:.0f}s; exiting', file=sys.stderr, flush=True)
            return 1
          break
        self._session()
      # Stopped by a signal (an eviction): 128 + its number, as a process a
      # signal ended. A Job counts an agent pod that exits 0 as complete and
      # would not recreate it (launch/jobset_ft.yaml); the driver's end of
      # the job is 0.
      return 128 + self._signal if self._signal is not None and not self._exit else 0
    finally:
      self._stop_all(self.grace_s)
      self.beats.close()
      for s, h in old.items():
        signal.signal(s, h)

  def _on_signal(self, signum, frame) -> None:
    if protocol.repeated_term(signum, self._signal, self._signalled_at):
      return   # the same stop delivered twice: not one that cuts the saves
    self._signal = signum
    self._signals += 1
    self._signalled_at = time.monotonic()

  def _session(self) -> None:
    """Serves one driver connection until it ends."""
    ch = self._channel
    heard = time.monotonic()
    next_relay = time.monotonic()
    lost_at: Optional[float] = None
    supervised = True
    # The trainers' heartbeats are read and acknowledged by the server's own
    # thread: for timeout_s after the driver was last heard saying the job
    # is supervised, whatever this loop is doing meanwhile (a blocking
    # relay, a slow start), so that trainers notice a lost driver when they
    # would without us, and before _orphaned's deadlines count from `heard`.
    self.beats.stall_s = self.timeout_s
    self.beats.acking = True
    self.beats.watching()   # heard just now: the handshake
    stop_by: Optional[float] = None   # a signal to the agent: its trainers' stop, then the agent's
    while not self._exit:
      if self._signal is not None:
        if stop_by is None and self._alive():
          stop_by = self._stop_trainers()
        elif stop_by is None or self._signals > 1:
          break
      ready, _, _ = select.select([ch.sock], [], [], 0.05)
      now = time.monotonic()
      if ch.sock in ready:
        try:
          data = ch.sock.recv(1 << 20)
          if not data:
            raise ConnectionError('closed by the driver')
          heard = now
          for msg in ch.feed(data):
            if msg.get('kind') == 'ack':
              supervised = bool(msg.get('supervised', True))
            self._command(msg)
          self.beats.acking = supervised
          if supervised:
            self.beats.watching(at=heard)   # not later: commands above may have taken a while
        except (OSError, ChannelError) as e:
          print(f'mjax-agent: {self.host}: connection to the driver ended ({e})', file=sys.stderr, flush=True)
          lost_at = now
          break
      for payload, _, _ in self.beats.receive(0.0):
        if payload is not None:
          self._merge(payload)
      self._reap()
      if now >= next_relay:
        next_relay = now + self.interval_s
        self._relay()
      if now - heard > self.timeout_s:
        print(f'mjax-agent: {self.host}: nothing from the driver for {now - heard:.0f}s; its trainers stop '
              f'by themselves', file=sys.stderr, flush=True)
        lost_at = heard
        break
      if stop_by is not None and (not self._alive() or now >= stop_by):
        break   # their exits reported (_reap above), the agent goes
    ch.close()
    self.beats.acking = False   # no driver: nothing acknowledged until the next one is heard
    if lost_at is not None and stop_by is not None:
      # Stopping, and the driver gone too: the trainers' saves still get their time.
      while self._alive() and time.monotonic() < stop_by and self._signals <= 1:
        self.beats.receive(0.1)
        self._reap(report=False)
    elif lost_at is not None:
      self._orphaned(lost_at)

  def _stop_trainers(self) -> float:
    """A stop signal to the agent (an eviction, scancel, a node drain):
    passed to its trainers, which stop at the step every process agrees
    on and save, as for a signal to them. The agent stays connected
    meanwhile, relaying their heartbeats and exits, so that the driver sees
    a stop, not a lost host (which stopped every other trainer after its
    grace, cutting their save). Returns the time by which the agent goes
    whatever they do: the steps to the agreed one, a save and a heartbeat
    timeout (a second signal goes at once)."""
    name = signal.Signals(self._signal).name
    print(f'mjax-agent: {self.host}: received {name}: stopping its trainers, which save at the step every '
          f'process agrees on; a second signal stops them at once', file=sys.stderr, flush=True)
    self._stopping = True
    # The driver counts its trainers' exits as a stop (a signal in start-up
    # exits 143), not as a fault of this host to diagnose.
    self._send({'kind': 'stopping', 'signal': name})
    for ident, p in self.procs.items():
      if p.poll() is None and ident not in self._termed:   # (the driver's own stop may have come first)
        self._termed.add(ident)
        try:
          p.send_signal(signal.SIGTERM)
        except ProcessLookupError:
          pass
    slack = (protocol.STOP_MARGIN_STEPS + 1) * max(self.step_s.values(), default=0.0)
    return time.monotonic() + slack + self.save_timeout_s + self.timeout_s

  def _orphaned(self, heard: float) -> None:
    """The driver is gone: the trainers hear no acknowledgement for
    heartbeat_timeout_s, agree to stop protocol.STOP_MARGIN_STEPS steps
    later, save and exit. Whatever still runs a timeout after that is
    killed, unless it is saving: a large model's last save can take
    minutes, and killing it would throw away all the work since the
    checkpoint before, so a save whose heartbeats keep coming gets what the
    driver would give it (CheckpointConfig.io_timeout_s, at least
    collective_timeout_s). Heartbeats keep being
    received (and not acknowledged) meanwhile."""
    self.beats.acking = False
    saves: dict[int, list[float]] = {}   # process -> [its save began, last heard saving]
    stop_by: Optional[float] = None      # a signal to the agent meanwhile: its trainers' stop
    while self._alive() and self._signals <= 1:
      if self._signal is not None and stop_by is None:
        stop_by = self._stop_trainers()   # (they stop anyway; theirs to save, not the agent's to kill)
      for payload, _, _ in self.beats.receive(0.1):
        if payload is not None:
          self._note_step(payload)
          self._note_save(saves, payload, time.monotonic())
      self._reap(report=False)
      now = time.monotonic()
      # Steps are counted in the slowest trainer's last step time: at scale a
      # step can take longer than the heartbeat timeout.
      slack = (protocol.STOP_MARGIN_STEPS + 1) * max(self.step_s.values(), default=0.0)
      saving = any(now - last < self.timeout_s and now - began < self.save_timeout_s
                   for began, last in saves.values())
      if now >= heard + 2 * self.timeout_s + self.grace_s + slack and not saving and (
          stop_by is None or now >= stop_by):
        break
    self._stop_all(0.0)
    self.latest.clear()
    self.step_s.clear()

  def _note_step(self, payload: dict) -> None:
    try:
      seconds = float(payload.get('step_time') or 0.0)
    except (TypeError, ValueError):
      return
    if math.isfinite(seconds) and seconds >= 0:
      self.step_s[int(payload['process'])] = seconds

  @staticmethod
  def _note_save(saves: dict, payload: dict, now: float) -> None:
    process = int(payload['process'])   # an int: the verifier checked it
    if payload.get('phase') == 'checkpoint' and not payload.get('final'):
      saves.setdefault(process, [now, now])[1] = now
    else:
      saves.pop(process, None)

  def _alive(self) -> bool:
    return any(p.poll() is None for p in self.procs.values())

  def _command(self, msg: dict) -> None:
    kind = msg.get('kind')
    if kind == 'start':
      if self._stopping:   # the host is going (evicted): the driver hears the trainer's exit
        self._send({'kind': 'exited', 'id': msg.get('id'), 'code': protocol.EXIT_TERMINATED})
        return
      self._start(msg)
    elif kind == 'signal':
      p = self.procs.get(msg.get('id'))
      if p is not None and p.poll() is None:
        try:
          sig = int(msg['sig'])
          if sig == signal.SIGTERM:
            if msg.get('id') in self._termed:   # the one the agent sent is the same stop
              return
            self._termed.add(msg.get('id'))
          p.send_signal(sig)
        except (ProcessLookupError, ValueError, KeyError):
          pass
    elif kind == 'kill':
      p = self.procs.get(msg.get('id'))
      if p is not None:
        _kill_group(p)
    elif kind == 'run':
      self._running.add(msg.get('id'))
      threading.Thread(target=self._run, args=(msg,), daemon=True).start()
    elif kind == 'cancel':
      if msg.get('id') in self._running:   # only what runs: a late cancel must not pile up
        self._cancelled.add(msg.get('id'))
    elif kind == 'port':
      from mjax.launch import free_port
      self._send({'kind': 'port', 'id': msg.get('id'), 'port': free_port()})
    elif kind == 'exit':
      print(f'mjax-agent: {self.host}: the driver ended the job ({msg.get("reason")})', file=sys.stderr, flush=True)
      self._exit = True

  def _env(self, delta: Any) -> dict:
    env = dict(os.environ)
    for k, v in (delta or {}).items():
      if v is None:
        env.pop(str(k), None)
      else:
        env[str(k)] = str(v)
    env[protocol.HOST_ENV] = self.host
    return env

  def _start(self, msg: dict) -> None:
    from mjax.launch import start_logged
    ident = msg.get('id')
    env = self._env(msg.get('env'))
    env[protocol.DRIVER_ADDRESS_ENV] = self.beats.address   # heartbeats come here, relayed from here
    log_path = str(msg.get('log') or os.devnull)
    try:
      os.makedirs(os.path.dirname(log_path) or '.', exist_ok=True)
      p = start_logged([str(a) for a in msg.get('argv') or []], env, log_path, new_session=True)
    except (OSError, ValueError) as e:
      print(f'mjax-agent: {self.host}: could not start {msg.get("argv")}: {e}', file=sys.stderr, flush=True)
      self._send({'kind': 'exited', 'id': ident, 'code': 127})
      return
    self.procs[ident] = p
    self._send({'kind': 'started', 'id': ident, 'pid': p.pid})

  def _run(self, msg: dict) -> None:
    ident = msg.get('id')
    timeout = float(msg.get('timeout') or 300.0)
    argv = [str(a) for a in msg.get('argv') or []]
    # Ended when the driver cancels it (a stop signal during a diagnosis)
    # or this agent is stopped: it must not hold the host's devices for
    # the rest of its deadline. Its own process group: what it started goes too.
    stopped = lambda: ident in self._cancelled or self._signal is not None or self._exit
    try:
      code, out, err = run_to_end(argv, self._env(msg.get('env')), timeout, cancel=stopped)
    except OSError as e:
      code, out, err = 127, '', f'{argv[:1]}: {e}'
    finally:
      self._running.discard(ident)
      self._cancelled.discard(ident)
    self._send({'kind': 'ran', 'id': ident, 'code': code, 'out': _clip(out), 'err': _clip(err)})

  def _send(self, msg: dict) -> None:
    ch = self._channel
    if ch is None:
      return
    try:
      ch.send(msg)
    except OSError:
      pass   # the session loop notices the closed connection

  def _merge(self, payload: dict) -> None:
    """The newest heartbeat of each process, with every loss since the last relay."""
    try:
      process = int(payload['process'])
    except (KeyError, TypeError, ValueError):
      return
    self._note_step(payload)
    prev = self.latest.get(process)
    self.latest[process] = hb.merge_beats(prev if prev is not None and prev.get('pid') == payload.get('pid')
                                          else None, payload)

  def _relay(self) -> None:
    payloads, self.latest = list(self.latest.values()), {}
    self._send({'kind': 'beats', 'payloads': payloads})

  def _reap(self, report: bool = True) -> None:
    for ident, p in list(self.procs.items()):
      code = p.poll()
      if code is not None:
        del self.procs[ident]
        if report:
          self._relay()   # its last heartbeats before its exit
          self._send({'kind': 'exited', 'id': ident, 'code': code})

  def _stop_all(self, grace_s: float) -> None:
    from mjax.launch import terminate
    terminate(self.procs, grace_s, lambda _, p: _kill_group(p))
    for p in self.procs.values():
      p.wait()
    self.procs.clear()


def _kill_group(p: subprocess.Popen) -> None:
  try:
    os.killpg(p.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def agent_main(argv: Optional[Sequence[str]] = None) -> int:
  """mjax-agent: one per host; see the module docstring."""
  p = argparse.ArgumentParser(
      prog='mjax-agent', description='Per-host agent of the fault-tolerance driver (mjax-launch --executor '
      'agent): starts and stops this host\'s training processes, runs its diagnostics and relays its '
      'heartbeats. The job secret comes from MJAX_JOB_SECRET, as the driver\'s.')
  p.add_argument('--driver', required=True, help='host:port of the driver (mjax-launch --bind)')
  p.add_argument('--host', default=None,
                 help='this host\'s name for the driver (default: MJAX_HOST, else SLURM\'s node name, else the '
                      'host name)')
  p.add_argument('--address', default=None,
                 help='the address other hosts reach this one at, for the JAX coordinator when this host '
                      'runs process 0 (default: SLURM\'s node name, else the host name)')
  p.add_argument('--connect_timeout_s', type=float, default=600.0,
                 help='give up (exit 1) when no driver answers for this long (default 600)')
  p.add_argument('--grace_s', type=float, default=5.0,
                 help='seconds between SIGTERM and SIGKILL when the agent stops its processes (default 5)')
  args = p.parse_args(sys.argv[1:] if argv is None else argv)
  for name in ('connect_timeout_s', 'grace_s'):
    value = getattr(args, name)
    if not (math.isfinite(value) and value >= 0):
      p.error(f'--{name} {value}: give a finite number of seconds, at least 0')
  try:
    hb.parse_address(args.driver)
  except ValueError as e:
    p.error(f'--driver: {e}')
  try:
    secret = hb.job_secret_from_env()
  except ValueError as e:
    p.error(str(e))
  # SLURMD_NODENAME: SLURM's name for the node, the one its node list (and
  # so the driver's host list) uses, also where several nodes share a machine.
  host = args.host or os.environ.get(protocol.HOST_ENV) or os.environ.get('SLURMD_NODENAME') or socket.gethostname()
  address = args.address or os.environ.get('SLURMD_NODENAME') or socket.gethostname()
  agent = Agent(args.driver, secret, host, address,
                connect_timeout_s=args.connect_timeout_s, grace_s=args.grace_s)
  return agent.serve()
