"""Programs for CPU meshes run their collectives in one order on every device.

XLA's CPU runtime runs independent ops side by side on a thread pool that
all host devices share, and each collective holds its thread until every
participant arrives; collectives that two devices start in different orders
deadlock the step (`mjax.parallel.ordering`). That happened now and then to
the 1F1B schedule, whose tick has a backward, a forward and a head
conditional and two stage shifts, none of them reading the others. The
check here reads the compiled step: in every computation, each loop,
conditional or stage shift that holds a collective must reach or be
reached by every other op holding one through its operands. (Pairs of
plain gathers and reductions are left out: GSPMD leaves many of them
unordered in every layout, and none has been seen to deadlock.)
"""

import itertools

import jax

from mjax import config as C
from mjax import train
from mjax.parallel import hlo_text, make_mesh, ordering

# The 1F1B layout with accumulation slices and FSDP gathered once a step:
# where the deadlock was seen (about one run in five under load).
LAYOUT = ['ModelConfig.d_model = 128', 'ModelConfig.n_layers = 8', 'ModelConfig.d_ff = 256',
          'ModelConfig.full_attention_every = 0', 'ModelConfig.sliding_window = 16',
          'ModelConfig.dtype = "float32"', 'DataConfig.seq_len = 64', 'TrainConfig.global_batch_size = 16',
          'MeshConfig.data = 1', 'MeshConfig.fsdp = 2', 'MeshConfig.pipeline = 2', 'MeshConfig.tensor = 2',
          'MeshConfig.sequence_parallel = True', 'MeshConfig.virtual_stages = 2', 'MeshConfig.microbatches = 4',
          'MeshConfig.pipeline_schedule = "1f1b"', 'MeshConfig.fsdp_gather = "step"',
          'TrainConfig.grad_accum_steps = 2']
COLLECTIVES = {'all-gather', 'all-reduce', 'reduce-scatter', 'collective-permute', 'all-to-all'}


def compiled_step_text():
  cfg = C.load_config(['tiny.gin'], LAYOUT, num_devices=8)
  program = train.make_program(cfg, make_mesh(cfg.mesh))
  with program.context():
    return program.step.lower(program.abstract_state(), program.abstract_batch()).compile().as_text()


def unordered_collectives(text: str) -> list[tuple[str, str]]:
  """Pairs of ops holding collectives, at least one of them a loop, a
  conditional or a stage shift, that no operand path orders."""
  module = hlo_text.parse_module(text)
  memo: dict[str, bool] = {}

  def holds(comp: str) -> bool:
    if comp not in memo:
      memo[comp] = False   # (no recursion in HLO; guards the walk)
      memo[comp] = any(is_collective(i) or any(holds(c) for _, c in hlo_text.called(i))
                       for i in module.computations.get(comp, []))
    return memo[comp]

  def is_collective(inst) -> bool:
    return inst.opcode.removesuffix('-start') in COLLECTIVES

  pairs = []
  for comp, insts in module.computations.items():
    # HLO text lists an instruction after its operands.
    before: dict[str, set] = {}
    for i in insts:
      before[i.name] = set().union(*[{op} | before[op] for op in i.operands if op in before])
    holders = [i for i in insts if is_collective(i) or any(holds(c) for _, c in hlo_text.called(i))]
    pairs += [(a.name, b.name) for a, b in itertools.combinations(holders, 2)
              if not (is_collective(a) and is_collective(b) and 'permute' not in a.opcode + b.opcode)
              and a.name not in before[b.name] and b.name not in before[a.name]]
  return pairs


def test_one_f_one_b_collectives_run_in_one_order_on_cpu():
  assert unordered_collectives(compiled_step_text()) == []


def test_the_check_sees_collectives_left_unordered(monkeypatch):
  # The same program without the dependencies (as for GPUs): the tick's
  # conditionals and shifts are left free, and the check says so.
  monkeypatch.setattr(ordering, 'after', lambda x, dep: x)
  assert unordered_collectives(compiled_step_text())


def test_after_keeps_values():
  x = {'a': jax.numpy.arange(4.0), 'b': jax.numpy.arange(3)}
  for dep in (jax.numpy.array([-2.5]), jax.numpy.array([jax.numpy.inf]), jax.numpy.array([jax.numpy.nan])):
    out = jax.jit(ordering.after)(x, dep)
    assert (out['a'] == x['a']).all() and (out['b'] == x['b']).all() and out['b'].dtype == x['b'].dtype
