"""The cluster launch files in launch/, checked without a cluster.

SLURM: launch/slurm.sbatch runs with a fake `scontrol` and `srun` on PATH and
a fake environment whose mjax-train only prints its arguments; each task runs
the real launch/slurm_task.py. Kubernetes: every JobSet in launch/*.yaml is
validated against the openAPIV3Schema of the JobSet CRD kept in launch/crd/
with unknown fields rejected, then held to what the schema cannot say: the
process count and coordinator address mjax/distributed.py will read in each
pod.
"""

import copy
import functools
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jsonschema
import pytest
import yaml

from mjax import config as config_lib
from mjax import distributed as D
from mjax import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(REPO, 'launch', 'slurm.sbatch')
TASK = os.path.join(REPO, 'launch', 'slurm_task.py')
CRD = os.path.join(REPO, 'launch', 'crd', 'jobset.x-k8s.io_jobsets.yaml')
MANIFESTS = sorted(glob.glob(os.path.join(REPO, 'launch', '*.yaml'))
                   + glob.glob(os.path.join(REPO, 'launch', '*.yml')))
UNRESOLVABLE = 'gpu-no-such-node.invalid'   # .invalid never resolves (RFC 2606)
JOB_ID = '123456'
JOB_PORT = 62016   # 123456 % 4096 + 61440: jax's SLURM port rule, as in mjax/distributed.py
Loader = getattr(yaml, 'CSafeLoader', yaml.SafeLoader)


# --- SLURM ---------------------------------------------------------------------

def _write(path, text):
  with open(path, 'w') as f:
    f.write(text)
  os.chmod(path, 0o755)
  return str(path)


FAKE_SCONTROL = """#!/bin/bash
# scontrol show hostnames LIST, for a LIST of plain names separated by commas.
[[ "$1 $2" == "show hostnames" ]] || { echo "fake scontrol: unexpected $*" >&2; exit 2; }
tr ',' '\\n' <<< "$3"
"""

# srun as far as the batch script uses it: one task per node, one after the
# other, with the variables a task of a real step gets, and --label's prefix.
FAKE_SRUN = """#!/bin/bash
set -euo pipefail
printf '%s\\n' "$@" > "$FAKE_SRUN_ARGS"
while [[ "$1" == --* ]]; do shift; done
n="$SLURM_JOB_NUM_NODES"
for ((i = 0; i < n; i++)); do
  SLURM_PROCID=$i SLURM_NTASKS=$n SLURM_STEP_NUM_TASKS=$n SLURM_LOCALID=0 SLURM_STEP_NUM_NODES=$n \\
    SLURM_STEP_NODELIST="$SLURM_JOB_NODELIST" "$@" 2>&1 | sed "s/^/$i: /"
done
"""

FAKE_TRAINER = """#!/bin/bash
echo "trainer $SLURM_PROCID:$(printf ' [%s]' "$@")"
"""


def _clean_env(**extra):
  """This process's environment without any job in it, plus `extra`."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(('SLURM_', 'MJAX_', 'JOB_COMPLETION_INDEX', 'JOBSET_', 'JAX_COORDINATOR'))}
  env.update(extra)
  return env


@pytest.fixture
def cluster(tmp_path):
  """A fake SLURM allocation of two nodes: the environment to run the batch
  script in; `srun_args` is where srun leaves its arguments."""
  fake_bin, venv = tmp_path / 'bin', tmp_path / 'venv' / 'bin'
  fake_bin.mkdir()
  venv.mkdir(parents=True)
  _write(fake_bin / 'scontrol', FAKE_SCONTROL)
  _write(fake_bin / 'srun', FAKE_SRUN)
  _write(venv / 'python', f'#!/bin/sh\nexec {sys.executable} "$@"\n')
  _write(venv / 'mjax-train', FAKE_TRAINER)
  srun_args = tmp_path / 'srun-args'
  env = _clean_env(PATH=f'{fake_bin}{os.pathsep}{os.environ["PATH"]}', MJAX_VENV=str(venv.parent),
                   SLURM_JOB_ID=JOB_ID, SLURM_JOB_NUM_NODES='2',
                   SLURM_JOB_NODELIST='localhost,localhost', FAKE_SRUN_ARGS=str(srun_args))
  return env, srun_args


def _sbatch(env, *args, timeout=60):
  return subprocess.run(['bash', SBATCH, *args], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=timeout)


def _directives(path=SBATCH):
  """The #SBATCH options, read as sbatch does: up to the first command."""
  out = []
  with open(path) as f:
    for line in f:
      line = line.strip()
      if line and not line.startswith('#'):
        break
      if line.startswith('#SBATCH'):
        out.append(line.split(None, 1)[1])
  return out


def test_sbatch_is_valid_bash():
  subprocess.run(['bash', '-n', SBATCH], check=True)


@pytest.mark.skipif(shutil.which('shellcheck') is None, reason='shellcheck is not installed')
def test_sbatch_passes_shellcheck():
  out = subprocess.run(['shellcheck', '-s', 'bash', SBATCH], capture_output=True, text=True)
  assert out.returncode == 0, out.stdout


def test_sbatch_header_asks_for_no_gpu_and_an_early_signal():
  opts = _directives()
  # A CPU-only cluster rejects a job that asks for GPUs: they come from the command line.
  assert not [o for o in opts if re.match(r'--(gpus|gres|gpus-per-\w+|cpus-per-gpu|mem-per-gpu)\b', o)], opts
  # Steps, not the batch shell (no B:), get the signal: the trainers save on it.
  assert '--signal=TERM@120' in opts
  output = next(o.split('=', 1)[1] for o in opts if o.startswith('--output='))
  assert os.path.isabs(output), 'a relative --output lands in the repository (the submit directory)'
  assert os.path.isdir(os.path.dirname(output)), 'sbatch creates no directory for its output'
  assert '--ntasks-per-node=1' in opts


@pytest.mark.parametrize('script', ['slurm.sbatch', 'slurm_ft.sbatch'])
def test_sbatch_output_survives_a_requeue(script):
  # A requeued job (scontrol requeue, a failed node) opens the same --output
  # again: truncated, the previous run's output, why it stopped, was lost.
  assert '--open-mode=append' in _directives(os.path.join(REPO, 'launch', script))


def test_sbatch_joins_every_task_to_the_first_node(cluster):
  env, srun_args = cluster
  out = _sbatch(env, '--gin_file', 'configs/tiny.gin', '--workdir', '/shared/runs/x')
  assert out.returncode == 0, out.stderr
  assert 'mjax: coordinator localhost' in out.stdout
  for i in range(2):
    assert f'{i}: mjax: joining localhost:{JOB_PORT} as process {i}/2\n' in out.stdout
    # The progress bar is turned off before the user's arguments, which come after it.
    assert (f'{i}: trainer {i}: [--gin_param=TrainConfig.progress = False] [--gin_file] '
            f'[configs/tiny.gin] [--workdir] [/shared/runs/x]') in out.stdout
  lines = out.stdout.splitlines()
  assert lines.index(f'0: mjax: joining localhost:{JOB_PORT} as process 0/2') < lines.index(
      next(l for l in lines if l.startswith('0: trainer')))
  srun = srun_args.read_text().splitlines()
  assert '--kill-on-bad-exit=1' in srun and '--label' in srun
  assert not [a for a in srun if a.startswith('--gpu')]


def test_sbatch_join_line_names_the_chosen_port(cluster):
  env, _ = cluster
  out = _sbatch({**env, 'MJAX_COORDINATOR_PORT': '2345'})
  assert out.returncode == 0, out.stderr
  assert '1: mjax: joining localhost:2345 as process 1/2' in out.stdout


def test_sbatch_unresolvable_coordinator_fails_at_once(cluster):
  env, srun_args = cluster
  t0 = time.monotonic()
  out = _sbatch({**env, 'SLURM_JOB_NODELIST': f'{UNRESOLVABLE},localhost'}, timeout=120)
  assert out.returncode != 0
  assert time.monotonic() - t0 < 60   # not the 300 s join timeout
  assert f"coordinator host '{UNRESOLVABLE}' does not resolve" in out.stderr
  assert not srun_args.exists(), 'no process may start'


def test_sbatch_checks_an_explicit_coordinator(cluster):
  env, srun_args = cluster
  out = _sbatch({**env, 'MJAX_COORDINATOR_ADDRESS': f'{UNRESOLVABLE}:1234'})
  assert out.returncode != 0 and UNRESOLVABLE in out.stderr
  assert not srun_args.exists()
  # A bracketed IPv6 address, as mjax/distributed.py takes it, resolves.
  out = _sbatch({**env, 'MJAX_COORDINATOR_ADDRESS': '[::1]:1234'})
  assert out.returncode == 0 and 'does not resolve' not in out.stderr, out.stderr


def test_sbatch_without_the_environment_fails_before_srun(cluster, tmp_path):
  # mjax installed elsewhere (`pip install -e .` into another environment):
  # without MJAX_VENV the script's default .venv does not exist there, and
  # every task would fail on its own node with an execve error.
  env, srun_args = cluster
  out = _sbatch({**env, 'MJAX_VENV': str(tmp_path / 'no-venv')})
  assert out.returncode == 1
  assert f'no python and mjax-train in {tmp_path / "no-venv"}/bin' in out.stderr
  assert 'MJAX_VENV' in out.stderr
  assert not srun_args.exists(), 'no task may start'


def _task_env(**extra):
  """Task 1 of a two-node step of job JOB_ID, as srun sets it."""
  return _clean_env(**{'SLURM_JOB_ID': JOB_ID, 'SLURM_PROCID': '1', 'SLURM_NTASKS': '2',
                       'SLURM_LOCALID': '0', 'SLURM_STEP_NUM_NODES': '2', **extra})


def test_task_stops_on_an_unresolvable_coordinator():
  out = subprocess.run([sys.executable, TASK, 'sh', '-c', 'echo trainer ran'],
                       env=_task_env(SLURM_STEP_NODELIST=f'{UNRESOLVABLE},localhost'),
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 1
  assert out.stdout == f'mjax: joining {UNRESOLVABLE}:{JOB_PORT} as process 1/2\n'
  assert f"coordinator host '{UNRESOLVABLE}' does not resolve" in out.stderr


def test_task_reports_an_inconsistent_job_as_mjax_train_would():
  out = subprocess.run([sys.executable, TASK, 'true'],
                       env=_task_env(SLURM_PROCID='2', SLURM_STEP_NODELIST='localhost'),
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 2
  assert 'SLURM_PROCID=2' in out.stderr and 'ran' not in out.stdout


def test_task_becomes_the_trainer_so_signals_reach_it(tmp_path):
  # The command replaces the task's process: SIGTERM sent to the task (as
  # SLURM's --signal does) lands in the command's handler.
  script = ('trap "echo saved; exit 0" TERM; echo ready; '
            'while :; do sleep 0.05; done')
  proc = subprocess.Popen([sys.executable, TASK, 'bash', '-c', script],
                          env=_task_env(SLURM_STEP_NODELIST='localhost,localhost'),
                          stdout=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline() == f'mjax: joining localhost:{JOB_PORT} as process 1/2\n'
    assert proc.stdout.readline() == 'ready\n'
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert proc.stdout.read() == 'saved\n'
  finally:
    proc.kill()
    proc.stdout.close()


@pytest.mark.parametrize('user_args, progress', [
    ([], False),
    (['--gin.TrainConfig.progress=True'], True),
    (['--gin_param', 'TrainConfig.progress = True'], True),
])
def test_progress_is_off_unless_the_arguments_turn_it_on(user_args, progress):
  with open(SBATCH) as f:
    srun = f.read().split('exec srun', 1)[1]
  default = re.search(r"--gin_param='([^']*)' \"\$@\"", srun).group(1)
  _, bindings = flags.parse(flags.parser('t', ''), ['--gin_param', default, *user_args])
  assert config_lib.load_config(['tiny.gin'], bindings).train.progress is progress


# --- Kubernetes: JobSet --------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _crd_schemas() -> dict:
  """apiVersion -> the strict openAPIV3Schema of that JobSet version."""
  with open(CRD) as f:
    crd = yaml.load(f, Loader=Loader)
  assert crd['kind'] == 'CustomResourceDefinition' and crd['spec']['names']['kind'] == 'JobSet'
  group = crd['spec']['group']
  return {f'{group}/{v["name"]}': strict(v['schema']['openAPIV3Schema'])
          for v in crd['spec']['versions'] if v.get('served')}


def strict(schema: dict) -> dict:
  """A copy of an OpenAPI v3 schema in which every object with listed
  properties rejects the unlisted ones, as the API server's strict field
  validation does. Objects marked x-kubernetes-preserve-unknown-fields, and
  free-form maps (additionalProperties given, or no properties listed:
  labels, resource limits, metadata), stay open."""
  schema = copy.deepcopy(schema)

  def visit(node):
    if not isinstance(node, dict):
      return
    if ('properties' in node and 'additionalProperties' not in node
        and not node.get('x-kubernetes-preserve-unknown-fields')):
      node['additionalProperties'] = False
    for child in node.get('properties', {}).values():
      visit(child)
    for key in ('items', 'additionalProperties', 'not'):
      visit(node.get(key))
    for key in ('allOf', 'anyOf', 'oneOf'):
      for child in node.get(key, ()):
        visit(child)

  visit(schema)
  return schema


def schema_errors(doc: dict) -> list[str]:
  schemas = _crd_schemas()
  if doc.get('apiVersion') not in schemas:
    return [f'apiVersion {doc.get("apiVersion")!r} is not served by the CRD ({sorted(schemas)})']
  validator = jsonschema.Draft4Validator(schemas[doc['apiVersion']])
  return [f'{"/".join(map(str, e.absolute_path)) or "(top)"}: {e.message}'
          for e in validator.iter_errors(doc)]


def _jobsets():
  docs = []
  for path in MANIFESTS:
    with open(path) as f:
      docs += [(os.path.relpath(path, REPO), i, d)
               for i, d in enumerate(yaml.load_all(f, Loader=Loader)) if d and d.get('kind') == 'JobSet']
  return docs


JOBSETS = _jobsets()


def test_launch_holds_a_jobset():
  assert JOBSETS, 'no JobSet in launch/*.yaml: the checks below would check nothing'


def test_crd_schema_covers_the_pod_template():
  # The embedded PodTemplate is listed field by field (not
  # x-kubernetes-preserve-unknown-fields), so container fields are checked too.
  schema = _crd_schemas()['jobset.x-k8s.io/v1alpha2']
  rjob = schema['properties']['spec']['properties']['replicatedJobs']['items']
  pod = rjob['properties']['template']['properties']['spec']['properties']['template']['properties']['spec']
  container = pod['properties']['containers']['items']
  assert container['additionalProperties'] is False and 'env' in container['properties']


@pytest.mark.parametrize('path, index, doc', JOBSETS, ids=[f'{p}#{i}' for p, i, _ in JOBSETS])
def test_jobset_matches_the_crd_schema(path, index, doc):
  assert schema_errors(doc) == []


def _rename(d, old, new):
  d[new] = d.pop(old)


def _container(doc):
  return doc['spec']['replicatedJobs'][0]['template']['spec']['template']['spec']['containers'][0]


@pytest.mark.parametrize('mutate, where', [
    (lambda d: _rename(d['spec'], 'replicatedJobs', 'replicatedJob'), "'replicatedJob'"),
    (lambda d: _rename(_container(d), 'workingDir', 'workdir'), "'workdir'"),
    (lambda d: _container(d)['env'][0].update(valueFromm={}), "'valueFromm'"),
    (lambda d: d['spec']['replicatedJobs'][0]['template']['spec'].update(parallelism='2'),
     "'2' is not of type 'integer'"),
], ids=['spec-field', 'container-field', 'env-field', 'wrong-type'])
def test_schema_rejects_a_misspelled_manifest(mutate, where):
  doc = copy.deepcopy(JOBSETS[0][2])
  mutate(doc)
  errors = schema_errors(doc)
  assert any(where in e for e in errors), errors


# What the pods of a JobSet read through fieldRef (labels and annotations set
# by the JobSet and Job controllers), for a pod of replicated job `rjob`.
def _pod_fields(jobset: str, rjob: str, job_index: int, pod_index: int) -> dict:
  fields = {}
  for key, value in (('jobset.sigs.k8s.io/jobset-name', jobset),
                     ('jobset.sigs.k8s.io/replicatedjob-name', rjob),
                     ('jobset.sigs.k8s.io/job-index', str(job_index)),
                     ('batch.kubernetes.io/job-completion-index', str(pod_index))):
    fields[f"metadata.labels['{key}']"] = fields[f"metadata.annotations['{key}']"] = value
  return fields


def _expand(value: str, env: dict) -> str:
  """Kubernetes' $(VAR) expansion: only variables defined earlier in the
  list; an unknown reference stays as written, $$ is a literal $."""
  return re.sub(r'\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)',
                lambda m: '$' if m.group(0) == '$$' else env.get(m.group(1), m.group(0)), value)


def _pod_env(container: dict, fields: dict, pod_index: int) -> tuple[dict, list[str]]:
  env, problems = {}, []
  for var in container.get('env', []):
    name = var['name']
    if 'value' in var:
      env[name] = _expand(str(var['value']), env)
    elif 'fieldRef' in var.get('valueFrom', {}):
      path = var['valueFrom']['fieldRef']['fieldPath']
      if path not in fields:
        problems.append(f'{name}: fieldRef {path!r} is not one this check knows the value of')
      env[name] = fields.get(path, '')
    else:
      problems.append(f'{name}: valueFrom other than fieldRef is not checked here')
  # The Job controller adds it to every container of an Indexed Job's pods.
  env.setdefault('JOB_COMPLETION_INDEX', str(pod_index))
  return env, problems


def _runs_trainer(container: dict) -> bool:
  return any(os.path.basename(str(a)) == 'mjax-train'
             for a in container.get('command', []) + container.get('args', []))


def _runs(container: dict, script: str) -> bool:
  return any(os.path.basename(str(a)) == script for a in container.get('command', []) + container.get('args', []))


def _flag(argv: list, name: str):
  return next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name), None)


def _secret_ref(container: dict):
  return next((v['valueFrom']['secretKeyRef'] for v in container.get('env', [])
               if v['name'] == 'MJAX_JOB_SECRET' and 'secretKeyRef' in v.get('valueFrom', {})), None)


def ft_jobset_problems(doc: dict) -> list[str]:
  """A JobSet under the fault-tolerance driver (launch/jobset_ft.yaml): one
  driver pod with agents; what would keep the agents from reaching the
  driver, or the driver from finding enough hosts; [] if nothing."""
  name, spec, problems = doc['metadata']['name'], doc['spec'], []
  subdomain = spec.get('network', {}).get('subdomain') or name
  found = {script: [(rj, c) for rj in spec.get('replicatedJobs', [])
                    for c in rj['template']['spec']['template']['spec']['containers'] if _runs(c, script)]
           for script in ('mjax-launch', 'mjax-agent', 'mjax-train')}
  if found['mjax-train']:
    problems.append('a container runs mjax-train beside the driver: under the driver, the agents start the trainers')
  if len(found['mjax-launch']) != 1 or not found['mjax-agent']:
    return problems + ['expected one replicated job running mjax-launch and one running mjax-agent']
  drj, driver_c = found['mjax-launch'][0]
  argv = driver_c.get('command', []) + driver_c.get('args', [])
  if _flag(argv, '--executor') != 'agent':
    problems.append('the driver does not run with --executor agent')
  djob = drj['template']['spec']
  if drj.get('replicas', 1) != 1 or djob.get('parallelism', 1) != 1:
    problems.append('the driver must be one pod (replicas 1, parallelism 1)')
  bind = _flag(argv, '--bind') or ':'
  port = bind.rpartition(':')[2]
  declared = {(p['containerPort'], p.get('protocol', 'TCP')) for p in driver_c.get('ports', [])}
  for proto in ('TCP', 'UDP'):
    if declared and (int(port or 0), proto) not in declared:
      problems.append(f'the driver\'s --bind port {port} is not a containerPort/{proto} ({sorted(declared)})')
  processes = int(_flag(argv, '--processes') or 0)
  driver_pod = f'{name}-{drj["name"]}-0-0'
  fields = {**_pod_fields(name, drj['name'], 0, 0), 'spec.nodeName': 'node-a'}
  agents = 0
  for arj, agent_c in found['mjax-agent']:
    agents += arj.get('replicas', 1) * arj['template']['spec'].get('parallelism', 1)
    env = {}
    for var in agent_c.get('env', []):
      if 'value' in var:
        env[var['name']] = _expand(str(var['value']), env)
      elif 'fieldRef' in var.get('valueFrom', {}):
        env[var['name']] = {**fields, **_pod_fields(name, arj['name'], 0, 1)}.get(
            var['valueFrom']['fieldRef']['fieldPath'], '?')
    aargv = [_expand(str(a), env) for a in agent_c.get('command', []) + agent_c.get('args', [])]
    if _flag(aargv, '--driver') != f'{driver_pod}.{subdomain}:{port}':
      problems.append(f'{arj["name"]}: --driver {_flag(aargv, "--driver")!r} is not the driver pod\'s '
                      f'{driver_pod}.{subdomain}:{port}')
    address = _flag(aargv, '--address')
    if address is not None and address != f'{name}-{arj["name"]}-0-1.{subdomain}':
      problems.append(f'{arj["name"]}: --address {address!r} is not the pod\'s own DNS name')
    if _secret_ref(agent_c) is None or _secret_ref(agent_c) != _secret_ref(driver_c):
      problems.append(f'{arj["name"]}: MJAX_JOB_SECRET must come from the driver\'s secret')
  if agents < processes:
    problems.append(f'{agents} agent pods for --processes {processes}: a host per process is needed')
  if spec.get('failurePolicy', {}).get('maxRestarts', 0) != 0:
    problems.append('failurePolicy.maxRestarts must be 0: the driver restarts, JobSet must not restart everything')
  if drj['name'] not in (spec.get('successPolicy') or {}).get('targetReplicatedJobs', []):
    problems.append('successPolicy must target the driver: the set is done when the driver is')
  return sorted(set(problems))


def jobset_problems(doc: dict) -> list[str]:
  """What mjax/distributed.py would get wrong in the pods of this JobSet: the
  process count, the process ids, the coordinator address; [] if nothing."""
  name, spec, problems = doc['metadata']['name'], doc['spec'], []
  if any(_runs(c, 'mjax-launch') for rj in spec.get('replicatedJobs', [])
         for c in rj['template']['spec']['template']['spec']['containers']):
    return ft_jobset_problems(doc)
  trainers = [(rj, c) for rj in spec.get('replicatedJobs', [])
              for c in rj['template']['spec']['template']['spec']['containers'] if _runs_trainer(c)]
  if not trainers:
    return ['no container runs mjax-train']
  rjobs = list({rj['name']: rj for rj, _ in trainers}.values())
  pods = 0
  for rj in rjobs:
    job = rj['template']['spec']
    parallelism = job.get('parallelism', 1)
    if job.get('completionMode') != 'Indexed':
      problems.append(f'{rj["name"]}: completionMode must be Indexed '
                      f'(JOB_COMPLETION_INDEX is the process id)')
    if job.get('completions', parallelism) != parallelism:
      problems.append(f'{rj["name"]}: completions {job.get("completions")} != parallelism {parallelism}: '
                      f'every process must run at once')
    pods += rj.get('replicas', 1) * parallelism
  # JOB_COMPLETION_INDEX counts the pods of one Job: a second Job (another
  # replica or replicated job) would repeat the process ids 0, 1, ...
  jobs = sum(rj.get('replicas', 1) for rj in rjobs)
  if jobs != 1:
    problems.append(f'{jobs} Jobs run mjax-train; the process id is JOB_COMPLETION_INDEX, so all '
                    f'processes must be the pods of one Job (one replicated job, replicas: 1)')
  if spec.get('network', {}).get('enableDNSHostnames') is False:
    problems.append('network.enableDNSHostnames is false: pod 0 has no DNS name to coordinate on')
  subdomain = spec.get('network', {}).get('subdomain') or name
  rj, container = trainers[0]
  pod0 = f'{name}-{rj["name"]}-0-0'
  if len(pod0) > 63:
    problems.append(f'the host name of pod 0, {pod0!r}, is longer than a DNS label (63)')
  ports = {p['containerPort'] for p in container.get('ports', [])}
  for index in range(rj['template']['spec'].get('parallelism', 1)):
    env, env_problems = _pod_env(container, _pod_fields(name, rj['name'], 0, index), index)
    problems += env_problems
    try:
      job = D.resolve(env)
    except D.DistributedError as e:
      problems.append(f'pod {index}: {e}')
      continue
    if (job.source, job.process_id, job.num_processes) != ('jobset', index, pods):
      problems.append(f'pod {index}: mjax reads process {job.process_id} of {job.num_processes} '
                      f'({job.source}); the JobSet runs {pods} trainer pods and this is pod {index} '
                      f'(MJAX_NUM_PROCESSES must be replicas x parallelism)')
    host, _, port = (job.coordinator_address or ':').rpartition(':')
    if host != f'{pod0}.{subdomain}':
      problems.append(f'pod {index}: coordinator host {host!r} is not pod 0, {pod0}.{subdomain}')
    if ports and int(port or 0) not in ports:
      problems.append(f'pod {index}: coordinator port {port} is not a containerPort ({sorted(ports)})')
  return sorted(set(problems))


@pytest.mark.parametrize('path, index, doc', JOBSETS, ids=[f'{p}#{i}' for p, i, _ in JOBSETS])
def test_jobset_process_count_and_coordinator_agree_with_mjax(path, index, doc):
  assert jobset_problems(doc) == []


def _job(doc):
  return doc['spec']['replicatedJobs'][0]['template']['spec']


def _env(doc, name):
  return next(v for v in _container(doc)['env'] if v['name'] == name)


@pytest.mark.parametrize('mutate, says', [
    (lambda d: _job(d).update(parallelism=3, completions=3), 'MJAX_NUM_PROCESSES must be'),
    (lambda d: _job(d).update(completions=1), 'completions 1 != parallelism'),
    (lambda d: d['spec']['replicatedJobs'][0].update(replicas=2), '2 Jobs run mjax-train'),
    (lambda d: d['spec']['replicatedJobs'][0].update(name='trainers'), 'is not pod 0'),
    (lambda d: d['spec'].setdefault('network', {}).update(subdomain='other'), 'is not pod 0'),
    (lambda d: _container(d).update(ports=[{'containerPort': 4321}]), 'is not a containerPort'),
    (lambda d: _env(d, 'MJAX_NUM_PROCESSES').update(value='two'), "MJAX_NUM_PROCESSES='two'"),
], ids=['parallelism', 'completions', 'replicas', 'rjob-name', 'subdomain', 'port', 'count'])
def test_process_check_catches_a_mismatch(mutate, says):
  doc = copy.deepcopy(JOBSETS[0][2])
  mutate(doc)
  problems = jobset_problems(doc)
  assert any(says in p for p in problems), problems


def test_a_preempted_pod_restarts_the_jobset_without_counting_a_failure():
  """launch/jobset.yaml: a trainer stopped short of its last step exits
  MJAX_PREEMPT_EXIT_STATUS (0 would count its index as finished and end
  the JobSet as complete); the Job's podFailurePolicy fails it for that
  code, and the JobSet's rule restarts without spending maxRestarts."""
  doc = JOBSETS[0][2]
  status = int(_env(doc, 'MJAX_PREEMPT_EXIT_STATUS')['value'])
  assert status == 143
  (rule,) = _job(doc)['podFailurePolicy']['rules']
  assert rule['action'] == 'FailJob' and rule['onExitCodes'] == {
      'containerName': _container(doc)['name'], 'operator': 'In', 'values': [status]}
  (restart,) = doc['spec']['failurePolicy']['rules']
  assert restart['action'] == 'RestartJobSetAndIgnoreMaxRestarts'
  assert restart['onJobFailureReasons'] == ['PodFailurePolicy']
  assert _job(doc)['template']['spec']['terminationGracePeriodSeconds'] >= 120


def test_launch_readme_says_what_a_preemption_costs():
  """launch/README.md tells the JobSet's restart budget as the manifest sets
  it: a pre-emption spends none of maxRestarts (a user sizing maxRestarts for
  evictions would otherwise raise it for nothing, or expect the run to end)."""
  (restart,) = JOBSETS[0][2]['spec']['failurePolicy']['rules']
  assert restart['action'] == 'RestartJobSetAndIgnoreMaxRestarts'
  with open(os.path.join(REPO, 'launch', 'README.md')) as f:
    text = ' '.join(f.read().split())
  jobset = text[text.index('## Kubernetes (JobSet)'):text.index('### Under the fault-tolerance driver', text.index('## Kubernetes'))]
  assert 'without spending one of its `maxRestarts`' in jobset, jobset
  assert 'each pre-emption one of its' not in jobset


def test_coordinator_derived_by_mjax_is_checked_too():
  # Without MJAX_COORDINATOR_ADDRESS mjax builds the address itself from
  # JOBSET_NAME, REPLICATED_JOB_NAME ('workers') and MJAX_COORDINATOR_PORT (1234).
  doc = copy.deepcopy(JOBSETS[0][2])
  _container(doc)['env'] = [v for v in _container(doc)['env'] if v['name'] != 'MJAX_COORDINATOR_ADDRESS']
  _container(doc)['ports'] = [{'containerPort': 1234}]
  doc['spec']['replicatedJobs'][0]['name'] = 'workers'
  assert jobset_problems(doc) == []
  doc['spec']['replicatedJobs'][0]['name'] = 'trainers'
  assert any('is not pod 0' in p for p in jobset_problems(doc))
  _container(doc)['env'].append({'name': 'REPLICATED_JOB_NAME', 'valueFrom': {'fieldRef': {
      'fieldPath': "metadata.labels['jobset.sigs.k8s.io/replicatedjob-name']"}}})
  assert jobset_problems(doc) == []


FT_JOBSET = next(doc for path, _, doc in JOBSETS if path.endswith('jobset_ft.yaml'))


def _ft_part(doc, name):
  rj = next(r for r in doc['spec']['replicatedJobs'] if r['name'] == name)
  return rj, rj['template']['spec']['template']['spec']['containers'][0]


@pytest.mark.parametrize('mutate, says', [
    (lambda d: _ft_part(d, 'agents')[0]['template']['spec'].update(parallelism=1, completions=1),
     '1 agent pods for --processes 2'),
    (lambda d: _ft_part(d, 'agents')[1]['command'].__setitem__(2, 'mjax-ft-driver-0-0.mjax-ft:7001'),
     'is not the driver pod'),
    (lambda d: _ft_part(d, 'driver')[1]['command'].__setitem__(4, '0.0.0.0:7001'), 'is not a containerPort'),
    (lambda d: _ft_part(d, 'driver')[1]['command'].__setitem__(2, 'local'), '--executor agent'),
    (lambda d: _ft_part(d, 'agents')[1]['env'].pop(), 'MJAX_JOB_SECRET'),
    (lambda d: d['spec']['failurePolicy'].update(maxRestarts=3), 'maxRestarts must be 0'),
    (lambda d: d['spec'].pop('successPolicy'), 'successPolicy'),
], ids=['agents', 'driver-address', 'port', 'executor', 'secret', 'restarts', 'success'])
def test_ft_jobset_check_catches_a_mismatch(mutate, says):
  assert ft_jobset_problems(FT_JOBSET) == []
  doc = copy.deepcopy(FT_JOBSET)
  mutate(doc)
  problems = ft_jobset_problems(doc)
  assert any(says in p for p in problems), problems


def test_ft_jobset_evictions_spend_no_backoff():
  """launch/jobset_ft.yaml: a stopped driver (--preempt_exit_status) and a
  stopped agent exit 143 after their trainers saved; each Job ignores that
  status, so only crashes count against backoffLimit. Counted, a fourth
  eviction of the driver pod failed its Job, and with maxRestarts 0 the run."""
  rj, driver_c = _ft_part(FT_JOBSET, 'driver')
  status = int(driver_c['command'][driver_c['command'].index('--preempt_exit_status') + 1])
  for name, code in (('driver', status), ('agents', 143)):
    rj, container = _ft_part(FT_JOBSET, name)
    rules = rj['template']['spec'].get('podFailurePolicy', {}).get('rules', [])
    assert {'action': 'Ignore', 'onExitCodes': {'containerName': container['name'], 'operator': 'In',
                                                'values': [code]}} in rules, (name, rules)
    assert rj['template']['spec']['template']['spec']['restartPolicy'] == 'Never'   # podFailurePolicy needs it


def test_terminate_asks_to_save_or_kills_at_once():
  """SIGTERM (a trainer saves and exits), then a kill for whoever is still
  there; save=False (after a loss spike: the state is spiked) kills at once,
  with no SIGTERM for a trainer to save on."""
  import signal as signals
  from mjax import launch as launch_lib

  class Handle:
    def __init__(self, leaves_on_term):
      self.signals, self.code, self.leaves_on_term = [], None, leaves_on_term

    def poll(self):
      return self.code

    def send_signal(self, sig):
      self.signals.append(sig)
      if self.leaves_on_term:
        self.code = 0

  def kill(key, handle):
    handle.code = -9
  handles = {0: Handle(True), 1: Handle(False)}
  assert launch_lib.terminate(handles, 0.2, kill) == [1]
  assert [h.signals for h in handles.values()] == [[signals.SIGTERM], [signals.SIGTERM]]
  assert [h.code for h in handles.values()] == [0, -9]
  handles = {0: Handle(True), 1: Handle(False)}
  assert launch_lib.terminate(handles, 30, kill, save=False) == [0, 1]
  assert [h.signals for h in handles.values()] == [[], []] and [h.code for h in handles.values()] == [-9, -9]


def test_a_pump_whose_output_fails_drains_its_process(capsys):
  # launch/local.py's output piped into `head`, or onto a full disk: the
  # pump thread died with a traceback and stopped reading, and a process
  # that went on printing blocked on its full pipe: the job hung.
  import io
  from mjax import launch
  src = io.BytesIO(b'a line of the trainer\n' * 10_000)
  full = open('/dev/full', 'w')
  launch._pump(src, '[1] ', full)
  assert src.closed   # read to the end, then closed
  try:
    full.close()   # what stayed in its buffer fails again
  except OSError:
    pass
  assert capsys.readouterr().err.splitlines() == [
      '[1] output dropped from here on: cannot write it (No space left on device)']
