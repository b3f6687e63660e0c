"""The module structure: no import cycles, leaves that stay leaves.

Function-level imports count: a cycle hidden behind a lazy import is still a
cycle for whoever reads the code, and the next refactor turns it into a crash.
"""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, 'mjax')


def modules() -> dict[str, str]:
  """Every mjax module: dotted name -> file."""
  out = {}
  for d, _, files in os.walk(PKG):
    for f in files:
      if f.endswith('.py'):
        rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].replace(os.sep, '.')
        out[rel[:-len('.__init__')] if rel.endswith('.__init__') else rel] = os.path.join(d, f)
  return out


def import_graph() -> dict[str, set[str]]:
  """module -> the mjax modules it imports, anywhere in its code."""
  mods = modules()
  graph = {}
  for name, path in mods.items():
    is_pkg = path.endswith('__init__.py')
    deps = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
      if isinstance(node, ast.Import):
        deps |= {a.name for a in node.names if a.name.startswith('mjax')}
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ''
        if node.level:   # relative import
          parts = name.split('.') if is_pkg else name.split('.')[:-1]
          base = '.'.join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
        if not base.startswith('mjax'):
          continue
        for a in node.names:   # `from mjax.pkg import submodule` imports the submodule
          deps.add(f'{base}.{a.name}' if f'{base}.{a.name}' in mods else base)
    graph[name] = {d for d in deps if d in mods and d != name}
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, on, stack, out = {}, {}, set(), [], []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def without_packages(graph):
  """A package's __init__ re-exporting its submodules is not a cycle with
  them: leave out the edges from a package into its own submodules and from
  a submodule to its parent package."""
  return {m: {d for d in deps if not d.startswith(m + '.') and not m.startswith(d + '.')}
          for m, deps in graph.items()}


def test_no_import_cycles():
  found = cycles(without_packages(import_graph()))
  assert not found, f'import cycles (function-level imports included): {found}'


def test_cycle_detector_finds_a_cycle():
  assert cycles({'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}) == [['a', 'b', 'c']]


@pytest.mark.parametrize('leaf', ['mjax.errors', 'mjax.protocol'])
def test_leaves_import_nothing_from_mjax(leaf):
  assert import_graph()[leaf] == set()


def test_config_imports_only_the_error_base():
  assert import_graph()['mjax.config'] <= {'mjax.errors'}


# The README's "leaves": what everything else may build on. They import
# nothing of mjax but each other.
LEAVES = {'mjax.config', 'mjax.devices', 'mjax.jsonfile', 'mjax.protocol', 'mjax.errors'}


def test_the_leaves_import_only_leaves():
  graph = import_graph()
  assert {leaf: graph[leaf] - LEAVES for leaf in LEAVES} == {leaf: set() for leaf in LEAVES}


def test_every_module_imports_on_its_own_in_a_fresh_interpreter():
  """Each module imported first, with no other mjax module loaded: an import
  that only works in some order fails here. The device facts and the
  protocol load without JAX (a diagnostic or the driver must not start it)."""
  code = f'''
import importlib, sys
import gin
gin.enter_interactive_mode()   # mjax.config registers its classes again at each re-import
names = {sorted(modules())!r}
for name in names:
  for m in [m for m in sys.modules if m == 'mjax' or m.startswith('mjax.')]:
    del sys.modules[m]
  importlib.import_module(name)
for m in [m for m in sys.modules if m == 'mjax' or m.startswith('mjax.')]:
  del sys.modules[m]
for name in ('jax', 'jaxlib'):
  sys.modules.pop(name, None)
'''
  proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  light = subprocess.run(
      [sys.executable, '-c', 'import sys, mjax.devices, mjax.protocol, mjax.errors, mjax.flags; '
                             'print(sorted(m for m in ("jax", "numpy") if m in sys.modules))'],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert light.returncode == 0, light.stderr[-3000:]
  assert 'jax' not in light.stdout, light.stdout


def test_the_metrics_writer_does_not_import_torch(tmp_path):
  """tensorboardX imports torch where it is installed (2.6-2.8 s of every
  run's start-up here); mjax logs floats, so it goes without. A later
  `import torch` still works, and a torch imported first stays."""
  pytest.importorskip('torch')
  code = ('import sys\nfrom mjax.metrics import MetricsWriter, read_metrics\n'
          f'w = MetricsWriter({str(tmp_path)!r})\nw.write(1, {{"loss": 2.5}})\nw.close()\n'
          'assert "torch" not in sys.modules, "torch imported"\n'
          'import torch\nassert torch.zeros(1).numpy().tolist() == [0.0]\n'
          f'assert read_metrics({str(tmp_path)!r}) == [{{"step": 1, "loss": 2.5}}]\n'
          f'w = MetricsWriter({str(tmp_path / "b")!r})\nw.close()\nprint("ok")\n')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == 'ok', out.stderr[-2000:]
  assert os.listdir(tmp_path / 'tensorboard')
