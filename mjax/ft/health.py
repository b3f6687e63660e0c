"""Which hosts a fault leaves fit to run on (MegaScale §4.2, step 2 of the
driver's recovery, mjax/ft/driver.py).

After a fault every host of the attempt runs `mjax-diagnose --json`, in
parallel. A host that fails is blocked for good (<workdir>/blocked_hosts.json,
mjax/ft/hosts.py); a diagnostic that crashed before it could report is run
once more first. Then each host the fault named (a crash, a lost or hung
process) that passed its own checks runs an all-reduce with a healthy host,
as a two-process JAX job: a host's own checks cannot see its network, and a
failing link blocks it. A host whose checks were slow only while it was
loaded ("suspect") is blocked the second time in a row. When every host of a
multi-host job fails, or every one is slow, none is blocked or counted: a
shared cause is likelier than all of them at once.

With agents, a host whose agent is away is not judged (a network blip must
not block a healthy host for good): it sits out until its agent is back, and
is diagnosed then (`diagnose_late`).
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import threading
import time
from typing import Any, Callable, Optional, Sequence

from mjax import jsonfile, protocol
from mjax.ft import detect, hosts as hosts_lib

SUSPECT_LIMIT = 2             # diagnoses in a row a host may pass only because it was loaded
# Faults that may come from a host's network: the hosts they name get a
# collective with a healthy host after their own checks (_check_links).
LINK_FAULTS = ('exit', 'heartbeat_lost', 'hang', 'startup_timeout')
LINK_TRIES = 2                # link-check jobs a named host must fail before it is blocked
DIAGNOSE_TRIES = 2            # crashes without a report a host's own diagnostic may have before blocking
DIAGNOSE_AT_ONCE = 128        # hosts diagnosed in parallel

# (passed, report, detail); passed None: no verdict (the host's agent away,
# or a stop asked for), report None where the diagnostic gave none.
Verdict = tuple[Optional[bool], Optional[dict], str]


def verdict(code: int, out: str, err: str) -> Verdict:
  """(passed, report, detail) of one mjax-diagnose run."""
  report = None
  for line in reversed(out.strip().splitlines()):
    try:
      report = jsonfile.loads(line)
      break
    except ValueError:
      continue
  if not isinstance(report, dict):
    # The whole output may be one indented JSON document.
    try:
      report = jsonfile.loads(out)
    except ValueError:
      report = None
  passed = code == 0 and isinstance(report, dict) and bool(report.get('passed'))
  if passed:
    return True, report, 'passed'
  failed = [c.get('name', '?') for c in (report or {}).get('checks', []) if not c.get('passed', True)]
  if failed:
    detail = 'failed checks: ' + ', '.join(failed)
  else:
    detail = f'exit status {code}: ' + (err.strip().splitlines() or ['no output'])[-1][:300]
  return False, report, detail


def clock_verdict(report: dict, began: float, ended: float, window_s: float) -> tuple[bool, str]:
  """A host whose clock is far off the driver's passes every check of its
  own, yet its heartbeats fall outside the window the driver accepts
  (`window_s`; and the driver's acknowledgements outside its trainers'): its
  processes count as lost again after every restart. The report's time must
  lie within the run (`began`..`ended`), give or take half that window."""
  t = report.get('time')
  if not isinstance(t, (int, float)) or not math.isfinite(t):
    return True, 'passed'   # a diagnostic that does not say (older, or another tool)
  slack = window_s / 2
  off = t - ended if t > ended else t - began if t < began else 0.0
  if abs(off) <= slack:
    return True, 'passed'
  return False, (f'its clock is {off:+.0f}s off the driver\'s (more than {slack:.0f}s): its heartbeats would '
                 f'be refused as stale and its processes lost again; fix its time sync (NTP, chrony)')


class HostChecks:
  """The driver's diagnostics of hosts and the blocks their verdicts make.

  Args:
    opts: the driver's Options (diagnose_args, diagnose_timeout_s, devices,
      host_env, spares).
    events: the job's EventLog.
    executor_factory: host -> an executor whose `run` runs a command there.
    agents: the AgentServer, or None without agents.
    blocked: the workdir's BlockList.
    diagnose_cmd: the mjax-diagnose command line, or None (not installed).
    clock_window_s: the driver's heartbeat acceptance window.
    stop_asked: whether the driver was asked to stop (a diagnosis under way
      ends there, with no verdict).
  """

  def __init__(self, opts, events, executor_factory: Callable, agents, blocked: hosts_lib.BlockList,
               diagnose_cmd: Optional[list[str]], clock_window_s: float, stop_asked: Callable[[], bool]):
    self.opts = opts
    self.events = events
    self.executor_factory = executor_factory
    self.agents = agents
    self.blocked = blocked
    self.diagnose_cmd = diagnose_cmd
    self.clock_window_s = clock_window_s
    self.stop_asked = stop_asked
    self.suspect: dict[str, int] = {}   # host -> diagnoses in a row slow under load
    self.undiagnosed: set[str] = set()  # hosts whose agent was away when they were to be diagnosed

  def block(self, host: str, reason: str) -> None:
    if host in self.blocked:
      return
    entry = self.blocked.add(host, reason)
    self.events.emit('host_blocked', **entry)

  def after_fault(self, hosts: Sequence[str], fault: detect.Fault) -> None:
    """mjax-diagnose on every host of the attempt (`hosts`, by process), in
    parallel; failing hosts (and an evicted straggler's) are blocked."""
    if fault.kind == 'straggler':
      for i in fault.processes:
        self.block(hosts[i], f'straggler: {fault.detail}')
    if fault.kind == 'host_fault':   # found by the trainers themselves; the others passed
      for i in fault.processes:
        self.block(hosts[i], f'host fault: {fault.detail}')
    if not self.diagnose_cmd:
      self.events.emit('diagnosis', host=None, passed=None,
                       detail='mjax-diagnose is not installed: no host checked, none blocked')
      return
    t0 = time.monotonic()
    # At most DIAGNOSE_AT_ONCE hosts at a time: 1,250 threads, and under
    # SLURM 1,250 srun at once, on every fault otherwise.
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(hosts), DIAGNOSE_AT_ONCE)) as pool:
      results = list(pool.map(self.diagnose_host, hosts))
    if self.stop_asked():
      # A stop signal ends a diagnosis there (the caller says so): the hosts
      # cut short have no verdict, and none is blocked on half of one.
      return
    for host, (passed, report, detail) in zip(hosts, results):
      self.events.emit('diagnosis', host=host, passed=passed, detail=detail,
                       checks=report.get('checks') if report else None,
                       seconds=round(time.monotonic() - t0, 3))
    self.undiagnosed |= {h for h, r in zip(hosts, results) if r[0] is None}
    failing = [(h, r[2]) for h, r in zip(hosts, results) if r[0] is False]
    if len(hosts) > 1 and len(failing) == len(hosts):
      # Every host failing at once points at something they share (the
      # diagnostic's thresholds, a shared file system, the driver itself)
      # rather than at all of them: blocking them all would end this
      # workdir for good. Restart as is; max_restarts still bounds it.
      self.events.emit('diagnosis_suspect', hosts=list(hosts),
                       detail='every host failed: none blocked, the cause is probably shared')
      return
    for host, detail in failing:
      self.block(host, f'diagnostic failed: {detail}')
    self._check_links(hosts, fault, [h for h, r in zip(hosts, results) if r[0] is True])
    # Slow only while the host was loaded (mjax-diagnose's "suspect"): load
    # may explain it once; the same twice in a row, it does not. Every host
    # slow at once is load they share (hosts of one machine, diagnosed side
    # by side), as every host failing at once is a shared cause: none is
    # counted. Nor does a count ever block the last hosts left.
    suspects = {host: (report or {}).get('suspect') or [] for host, (passed, report, _) in zip(hosts, results)
                if passed}
    suspects = {h: s for h, s in suspects.items() if s}
    if len(hosts) > 1 and len(suspects) == len(hosts):
      self.events.emit('diagnosis_suspect', hosts=list(hosts),
                       detail='every host slow under load: the load is probably shared, none counted')
      return
    for host in hosts:
      self.suspect[host] = self.suspect.get(host, 0) + 1 if host in suspects else 0
      if self.suspect[host] >= SUSPECT_LIMIT:
        if not [h for h in [*hosts, *self.opts.spares] if h != host and h not in self.blocked]:
          self.events.emit('diagnosis_suspect', hosts=[host],
                           detail='slow under load again, but the last host left: not blocked')
          continue
        self.block(host, f'slow under load in {SUSPECT_LIMIT} diagnoses in a row: {", ".join(suspects[host])}')

  def diagnose_late(self, hosts: Sequence[str]) -> set[str]:
    """Diagnoses those of `hosts` whose agent was away at the last diagnosis
    (all at once), blocking the failing ones; returns those whose agent went
    again meanwhile (no verdict: they sit this attempt out)."""
    late = [h for h in hosts if h in self.undiagnosed]
    away: set[str] = set()
    if not late:
      return away
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(late)) as workers:
      results = list(workers.map(self.diagnose_host, late))
    for h, (passed, _, detail) in zip(late, results):
      self.events.emit('diagnosis', host=h, passed=passed, detail=detail, late=True)
      if passed is None:
        away.add(h)
        continue
      self.undiagnosed.discard(h)
      if not passed:
        self.block(h, f'diagnostic failed: {detail}')
    return away

  def _env(self, host: str, base: Optional[dict] = None) -> dict:
    from mjax import distributed
    env = dict(os.environ if base is None else base)
    env.pop(protocol.INJECT_ENV, None)   # the trainer's test faults are not the host's
    if self.opts.devices:
      env['XLA_FLAGS'] = distributed.with_device_count(env.get('XLA_FLAGS', ''), self.opts.devices)
      env['JAX_PLATFORMS'] = 'cpu'
    env[protocol.HOST_ENV] = host
    env.update(self.opts.host_env.get(host, {}))
    return env

  def diagnose_host(self, host: str) -> Verdict:
    """(passed, report, detail) of `host`'s own checks; passed None: the
    host's agent is away, or a stop was asked for: not judged."""
    if self.agents is not None and self._agent_link(host) is None:
      return None, None, 'no agent connected: diagnosed when it is back'
    if self.stop_asked():   # a host whose turn came after the stop: none started
      return None, None, 'not judged: the driver was asked to stop'
    # A job of one process, said so: an agent's environment is its SLURM
    # step's (launch/slurm_ft.sbatch: SLURM_PROCID, SLURM_NTASKS = the
    # nodes), which mjax-diagnose read as a job to join with the other
    # nodes' diagnostics. With a node lost, the healthy one waited out the
    # join timeout for it and failed its own diagnosis.
    from mjax import distributed
    alone = {k: v for k, v in os.environ.items() if k != distributed.COORDINATOR}
    alone.update({distributed.NUM_PROCESSES: '1', distributed.PROCESS_ID: '0'})
    for attempt in range(1, DIAGNOSE_TRIES + 1):
      link = self._agent_link(host)
      began = time.time()
      code, out, err = self.executor_factory(host).run([*self.diagnose_cmd, '--json', *self.opts.diagnose_args],
                                                       self._env(host, alone), self.opts.diagnose_timeout_s,
                                                       cancel=self.stop_asked)
      ended = time.time()
      if self.stop_asked():   # cut short by a stop signal: no verdict on the host
        return None, None, 'not judged: the driver was asked to stop during the diagnostic'
      if self._agent_went(host, link, code):
        # The link dropped while it ran: no verdict on the host (a network
        # blip must not block it for good); it is diagnosed when it is back.
        return None, None, f'its agent went away during the diagnostic ({err.strip()[:300] or "no detail"})'
      passed, report, detail = verdict(code, out, err)
      # A failed check is a verdict, and a diagnostic that hangs points at
      # the host; one that crashed before it could report says nothing
      # about the host yet (the tool's own start failed: a port taken, a
      # file system hiccup) and is run once more before the host is blocked.
      if passed or report is not None or code == 124 or attempt == DIAGNOSE_TRIES:
        break
    if not passed and attempt > 1:
      detail = f'{detail} (crashed {attempt} times)'
    if passed:
      passed, detail = clock_verdict(report, began, ended, self.clock_window_s)
    return passed, report, detail

  def _agent_link(self, host: str):
    """The agent's link to `host` now (None without agents, or none connected)."""
    return self.agents.link(host) if self.agents is not None else None

  def _agent_went(self, host: str, link, code: int) -> bool:
    """Whether a run on `host` that began on `link` ended because that agent
    went away: status EXIT_HOST_LOST (what the agent server answers then)
    and the link lost or replaced since (a diagnostic that itself exits 255
    on a live link is a verdict)."""
    if self.agents is None or code != protocol.EXIT_HOST_LOST:
      return False
    return link is None or link.lost or self.agents.link(host) is not link

  def _check_links(self, hosts: Sequence[str], fault: detect.Fault, passed: list[str]) -> None:
    """A collective between hosts, run only for the hosts the fault named.

    Each host's own checks cannot see its network: a bad NIC, cable or
    switch port passes them and fails the job's next collective again. So
    each named host that passed its own checks runs an all-reduce with a
    healthy host (one that passed and was not named), as a two-process JAX
    job of mjax-diagnose; all pairs at once. A pair that fails blocks the
    named host: the healthy one has no fault against it. Numerical faults
    and stragglers say nothing about links; they are not checked.
    """
    if fault.kind not in LINK_FAULTS or not self.diagnose_cmd or self.stop_asked():
      return
    named = [hosts[i] for i in fault.processes if hosts[i] in passed and hosts[i] not in self.blocked]
    healthy = [h for h in passed if h not in named and h not in self.blocked]
    named = list(dict.fromkeys(named))
    if not named:
      return
    if not healthy:
      self.events.emit('link_check', hosts=named, passed=None,
                       detail='no healthy host to pair with: links not checked')
      return
    # Rounds of pairs, each healthy host in one pair at a time: two jobs on
    # one host's devices at once would fail each other.
    t0 = time.monotonic()
    for first in range(0, len(named), len(healthy)):
      pairs = list(zip(named[first:first + len(healthy)], healthy))
      with concurrent.futures.ThreadPoolExecutor(max_workers=len(pairs)) as pool:
        results = list(pool.map(lambda pair: self._link_pair(*pair), pairs))
      if self.stop_asked():
        return   # checks cut short by a stop signal: no verdict, none blocked
      for (suspect, ref), (passed_, detail) in zip(pairs, results):
        self.events.emit('link_check', host=suspect, partner=ref, passed=passed_, detail=detail,
                         seconds=round(time.monotonic() - t0, 3))
        if passed_ is None:
          # An agent of the pair went away: no verdict on the link, none
          # blocked. A host whose agent is gone sits out until it is back
          # and passes its diagnostic (diagnose_late).
          self.undiagnosed |= {h for h in (suspect, ref) if self._agent_link(h) is None}
        elif not passed_:
          self.block(suspect, f'collective with {ref} failed: {detail}')

  def _link_pair(self, suspect: str, ref: str) -> tuple[Optional[bool], str]:
    """mjax-diagnose --checks allreduce as one JAX job of two processes,
    the named host first (process 0, so its coordinator is tested too).

    A failing job is run once more, on a new coordinator port, before the
    verdict: blocking is for good (and shrinks the job, which then no longer
    trains bitwise as before), while one failed start of a two-process job
    has causes that are not the link's: the port `free_port` chose taken by
    another program before the coordinator bound it, a start-up slowed past
    a deadline on a loaded host. A bad link fails both times. None: an
    agent of the pair went away, no verdict."""
    first = None
    for _ in range(LINK_TRIES):
      if self.stop_asked():
        return None, 'not checked: the driver was asked to stop'
      passed, detail = self._link_job(suspect, ref)
      if passed is None:
        return None, detail
      if passed:
        return True, 'passed' if first is None else f'passed when tried again (first try: {first})'
      first = first or detail
    return False, detail if LINK_TRIES == 1 else f'{detail} (failed {LINK_TRIES} times)'

  def _link_job(self, suspect: str, ref: str) -> tuple[Optional[bool], str]:
    """One two-process mjax-diagnose job (see `_link_pair`); passed None:
    an agent of the pair went away while it ran."""
    from mjax import launch
    pair = [suspect, ref]
    links = [self._agent_link(h) for h in pair]
    executors = [self.executor_factory(h) for h in pair]
    coordinator = executors[0].coordinator(launch.free_port())
    # Whether the collective works (right result, within its deadline), not
    # how fast: one run on a loaded host is no measure of a link's speed,
    # and a slow link shows up in the straggler analysis.
    argv = [*self.diagnose_cmd, '--json', *self.opts.diagnose_args, '--checks', 'allreduce', '--no_baseline']
    # A side whose agent went away ends its run at once; the other side waits
    # in the collective for a partner that never comes, up to
    # diagnose_timeout_s, and holds the restart up that long: cancelled.
    partner_gone = threading.Event()

    def run(i: int, host: str, ex: Any, link: Any) -> tuple[int, str, str]:
      result = ex.run(argv, self._env(host, launch.local_env(i, 2, coordinator, self.opts.devices)),
                      self.opts.diagnose_timeout_s, lambda: self.stop_asked() or partner_gone.is_set())
      if self._agent_went(host, link, result[0]):
        partner_gone.set()
      return result
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
      runs = [pool.submit(run, i, h, ex, link) for i, (h, ex, link) in enumerate(zip(pair, executors, links))]
      results = [r.result() for r in runs]
    gone = [h for h, link, (code, _, _) in zip(pair, links, results) if self._agent_went(h, link, code)]
    if gone:
      # Not the link's fault: the other side of a two-process job whose
      # partner is gone fails too, waiting on a collective that never comes.
      return None, f'the agent on {", ".join(gone)} went away during the check: no verdict'
    verdicts = [verdict(*r) for r in results]
    bad = [f'{h}: {v[2]}' for h, v in zip(pair, verdicts) if not v[0]]
    return (not bad), ('passed' if not bad else '; '.join(bad))
