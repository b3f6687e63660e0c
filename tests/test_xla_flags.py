"""GPU overlap flags: only flags the installed XLA defines, never over the user's."""

import logging
import os
import subprocess
import sys

import pytest

from mjax.parallel import xla_flags as X

# What every real flag table holds (XLA's long-standing dump flags).
TABLE = b'\x00xla_dump_to\x00xla_dump_hlo_as_text\x00xla_dump_hlo_pass_re\x00xla_backend_optimization_level\x00'
FLAG_LIB = (b'\x7fELF junk' + TABLE +
            b'xla_gpu_enable_latency_hiding_scheduler\x00'
            b'xla_gpu_enable_pipelined_all_gather\x00'
            b'xla_gpu_all_reduce_combine_threshold_bytes\x00'
            b'xla_gpu_enable_triton_gemm\x00'
            # A removed flag survives only as a protobuf reserved name: tag 'R',
            # a length byte, the name, no NUL. XLA rejects it.
            b'R\x20xla_gpu_enable_async_collectivesR\x05other')
# The GPU plugin's own XLA copy, older: lacks the pipelined all-gather flag.
PLUGIN_LIB = (TABLE + b'xla_gpu_enable_latency_hiding_scheduler\x00'
              b'xla_gpu_all_reduce_combine_threshold_bytes\x00' b'xla_gpu_enable_triton_gemm\x00')
# A kernel library without a flag table: never consulted.
KERNEL_LIB = b'\x00cuda_prng_kernel\x00'
# An extension module with a stray 'xla_dump_to' and the DebugOptions proto
# descriptor (names length-prefixed, no NUL), as jax-cuda13-plugin 0.11's
# _triton.so: it parses no flags and must not veto any.
STRAY_LIB = b'\x00xla_dump_to\x00\n\x27xla_gpu_enable_latency_hiding_scheduler\x18\xba\x01'


@pytest.fixture
def libs(tmp_path):
  paths = {'jaxlib/libjax_common.so': FLAG_LIB,
           'jax_plugins/xla_cuda12/xla_cuda_plugin.so': PLUGIN_LIB,
           'jax_cuda12_plugin/_cuda_prng.so': KERNEL_LIB,
           'jax_cuda12_plugin/_triton.so': STRAY_LIB}
  for rel, data in paths.items():
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_bytes(data)
  return tmp_path


def test_libraries_are_found_in_jaxlib_and_plugin_dirs(libs):
  found = {os.path.relpath(p, libs) for p in X.xla_libraries([str(libs)])}
  assert found == {'jaxlib/libjax_common.so', 'jax_plugins/xla_cuda12/xla_cuda_plugin.so',
                   'jax_cuda12_plugin/_cuda_prng.so', 'jax_cuda12_plugin/_triton.so'}


def test_only_flags_every_flag_table_defines_are_supported(libs):
  paths = X.xla_libraries([str(libs)])
  names = ['xla_gpu_enable_latency_hiding_scheduler', 'xla_gpu_enable_pipelined_all_gather',
           'xla_gpu_enable_async_collectives', 'xla_gpu_all_reduce_combine',
           'xla_gpu_all_reduce_combine_threshold_bytes']
  assert X.supported_flags(names, paths) == {'xla_gpu_enable_latency_hiding_scheduler',
                                             'xla_gpu_all_reduce_combine_threshold_bytes'}
  # jaxlib alone: the pipelined flag is there; a reserved name or a prefix of
  # a real flag is not a flag.
  assert X.supported_flags(names, [str(libs / 'jaxlib/libjax_common.so')]) == {
      'xla_gpu_enable_latency_hiding_scheduler', 'xla_gpu_enable_pipelined_all_gather',
      'xla_gpu_all_reduce_combine_threshold_bytes'}
  # No flag table anywhere: nothing can be checked, nothing is supported.
  assert X.supported_flags(names, [str(libs / 'jax_cuda12_plugin/_cuda_prng.so')]) == set()
  # A stray 'xla_dump_to' string does not make a flag table.
  assert X.supported_flags(names, [str(libs / 'jax_cuda12_plugin/_triton.so')]) == set()


def test_apply_never_overrides_the_user_and_drops_unknown_flags(libs, monkeypatch, caplog):
  user = '--xla_gpu_enable_latency_hiding_scheduler=false --xla_force_host_platform_device_count=8'
  monkeypatch.setenv('XLA_FLAGS', user)
  with caplog.at_level(logging.WARNING, logger='mjax'):
    added = X.apply_xla_flags(True, extra='--xla_gpu_all_reduce_combine_threshold_bytes=1024',
                              platform='gpu', libraries=X.xla_libraries([str(libs)]))
  assert added == ['--xla_gpu_all_reduce_combine_threshold_bytes=1024']   # extra beats the default
  assert os.environ['XLA_FLAGS'] == user + ' ' + added[0]
  assert X.parse_flags(os.environ['XLA_FLAGS'])['xla_gpu_enable_latency_hiding_scheduler'] == 'false'
  assert 'xla_gpu_enable_pipelined_all_gather' in caplog.text                # dropped, said so


def test_apply_is_a_no_op_off_gpu_or_disabled(libs, monkeypatch):
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
  paths = X.xla_libraries([str(libs)])
  assert X.apply_xla_flags(True, platform='cpu', libraries=paths) == []
  assert X.apply_xla_flags(False, platform='gpu', libraries=paths) == []
  assert os.environ['XLA_FLAGS'] == '--xla_force_host_platform_device_count=8'
  # Off, the overlap flags stay out; a flag the user asks for still goes in,
  # and so does the GeLU epilogue's.
  assert X.apply_xla_flags(False, extra='--xla_gpu_enable_latency_hiding_scheduler=false', platform='gpu',
                           libraries=paths) == ['--xla_gpu_enable_latency_hiding_scheduler=false']
  monkeypatch.setenv('XLA_FLAGS', '')
  assert X.apply_xla_flags(False, gelu_epilogue=True, platform='gpu', libraries=paths) == [
      '--xla_gpu_enable_triton_gemm=false']


def test_apply_sets_nothing_when_no_flag_table_is_found(libs, monkeypatch, caplog):
  monkeypatch.setenv('XLA_FLAGS', '')
  with caplog.at_level(logging.WARNING, logger='mjax'):
    assert X.apply_xla_flags(True, platform='gpu',
                             libraries=[str(libs / 'jax_cuda12_plugin/_cuda_prng.so')]) == []
  assert os.environ['XLA_FLAGS'] == '' and 'no jaxlib' in caplog.text


def test_the_gelu_epilogue_turns_tritons_gemms_off_unless_told_otherwise():
  # XLA's Triton GEMM rewriter would claim the MLP's input product before
  # the cuBLAS one could fuse its GeLU; a user's own value still wins.
  assert 'xla_gpu_enable_triton_gemm' not in X.wanted_flags()
  assert X.wanted_flags(gelu_epilogue=True)['xla_gpu_enable_triton_gemm'] == 'false'
  assert X.wanted_flags('--xla_gpu_enable_triton_gemm=true', gelu_epilogue=True)[
      'xla_gpu_enable_triton_gemm'] == 'true'
  # Not an overlap flag: it stays when those are turned off, as a user's own do.
  assert X.wanted_flags('--xla_foo=1', gelu_epilogue=True, overlap=False) == {
      'xla_gpu_enable_triton_gemm': 'false', 'xla_foo': '1'}


def test_parse_flags():
  assert X.parse_flags('--a=1  --b --c="x y" junk --a=2') == {'a': '2', 'b': None, 'c': 'x y'}


def test_installed_xla_accepts_every_flag_that_passes_the_filter(repo_root):
  """The real jaxlib: the filter keeps the current flags, drops the removed
  async-collectives flag, and XLA starts with what it keeps (it aborts on an
  unknown flag)."""
  names = [*X.OVERLAP_FLAGS, *X.COLLECTIVE_MATMUL_FLAGS, *X.GELU_EPILOGUE_FLAGS]
  ok = X.supported_flags([*names, 'xla_gpu_enable_async_collectives'])
  assert 'xla_gpu_enable_latency_hiding_scheduler' in ok and 'xla_gpu_enable_triton_gemm' in ok
  assert 'xla_gpu_enable_async_collectives' not in ok
  code = ('import os; from mjax.parallel.xla_flags import apply_xla_flags as a; '
          'print(len(a(True, platform="gpu", collective_matmul=True, gelu_epilogue=True))); '
          'import jax, jax.numpy as jnp; print(float(jnp.ones(3).sum()))')
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': ''}
  proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env,
                        cwd=repo_root, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.split() == [str(len(ok & set(names))), '3.0']


def test_a_report_without_overlap_flags_still_sets_the_configs_other_flags(monkeypatch):
  # `mjax-report comm` without --overlap_flags compiles what a run compiles
  # but for the overlap flags: the user's xla_extra_flags and the GeLU
  # epilogue's flag still go in (on a GPU host; elsewhere nothing is set).
  from mjax import flags
  from mjax.config import load_config
  calls = []
  monkeypatch.setattr(X, 'apply_xla_flags', lambda enabled, **kw: calls.append((enabled, kw)) or [])
  cfg = load_config(['tiny.gin'], ['TrainConfig.xla_extra_flags = "--xla_gpu_foo=1"',
                                   'ModelConfig.gelu_epilogue = True'])
  flags.apply_xla_flags(cfg, overlap=False)
  flags.apply_xla_flags(cfg)
  assert [enabled for enabled, _ in calls] == [False, True]
  assert all(kw['extra'] == '--xla_gpu_foo=1' and kw['gelu_epilogue'] for _, kw in calls)


def test_a_deviceless_compile_leaves_out_options_this_jaxlib_does_not_have():
  """jaxlib 0.11 has no compile option xla_gpu_enable_pipelined_reduce_scatter
  (its flag table still names it): `mjax-report comm --target` failed there on
  "No such compile option". The option is dropped, with a note, and the
  others are kept."""
  import jax
  from mjax.parallel import gpu_target
  lowered = jax.jit(lambda x: x + 1).lower(1.0)
  options = {'xla_gpu_no_such_option': True, 'xla_backend_optimization_level': 1}
  notes = []
  compiled = gpu_target.compile_with(lowered, options, notes)
  assert float(compiled(1.0)) == 2.0
  assert options == {'xla_backend_optimization_level': 1}
  assert notes == ['--xla_gpu_no_such_option left out: this jaxlib has no such compile option (its default applies)']
  with pytest.raises(Exception, match='xla_backend_optimization_level'):   # a bad value still fails
    gpu_target.compile_with(lowered, {'xla_backend_optimization_level': 'high'}, [])


def test_pipelining_flags_go_under_their_successors_names_where_xla_has_them(tmp_path, monkeypatch):
  """jaxlib 0.11 made the three pipelining booleans modes
  (xla_gpu_pipeline_all_gather=on, ...): the old names are deprecated
  aliases in XLA_FLAGS and no compile options at all, so a deviceless
  compile with them failed, and without them nothing was pipelined. Where
  the successor exists mjax sets it; where not, the old flag as before."""
  new_table = (TABLE + b'xla_gpu_enable_latency_hiding_scheduler\x00xla_gpu_enable_pipelined_all_gather\x00'
               b'xla_gpu_pipeline_all_gather\x00xla_gpu_pipeline_reduce_scatter\x00')
  lib = tmp_path / 'jaxlib' / 'libjax_common.so'
  lib.parent.mkdir()
  lib.write_bytes(new_table)
  monkeypatch.setenv('XLA_FLAGS', '--xla_gpu_pipeline_reduce_scatter=off')   # the user's own stays
  added = X.apply_xla_flags(True, platform='gpu', libraries=[str(lib)])
  assert '--xla_gpu_pipeline_all_gather=on' in added
  assert not any('enable_pipelined_all_gather' in a or 'reduce_scatter' in a for a in added), added
  assert X.with_successors({'xla_gpu_enable_pipelined_all_gather': 'false'}, {'xla_gpu_pipeline_all_gather'}) == {
      'xla_gpu_pipeline_all_gather': 'default'}
  assert X.with_successors({'xla_gpu_enable_pipelined_all_gather': 'true'}, set()) == {
      'xla_gpu_enable_pipelined_all_gather': 'true'}
  # As compile options the modes are the DebugOptions enum's names.
  assert X.as_compile_options({'xla_gpu_pipeline_all_gather': 'on', 'xla_gpu_enable_pipelined_all_reduce': 'true'}) == {
      'xla_gpu_pipeline_all_gather': 'COLLECTIVE_PIPELINING_MODE_ON', 'xla_gpu_enable_pipelined_all_reduce': True}


def test_tensor_parallelism_does_not_turn_on_xlas_windowed_einsum():
  """In jaxlib 0.11's GPU compile XLA's windowed einsum sent 2.7x the bytes
  of a tensor x sequence parallel step's all-gathers and reduce-scatters,
  46 of its 200 permutes synchronous; mjax's own rings
  (MeshConfig.collective_matmul) are the overlapped path. The flags stay
  available through xla_extra_flags."""
  from mjax import config as C
  cfg = C.load_config(['tiny.gin'], ['MeshConfig.data = 2', 'MeshConfig.tensor = 4',
                                     'MeshConfig.sequence_parallel = True'], num_devices=8)
  wanted = X.wanted_flags(**X.config_flags(cfg))
  assert not set(X.COLLECTIVE_MATMUL_FLAGS) & set(wanted), wanted
  extra = C.load_config(['tiny.gin'], ['MeshConfig.data = 2', 'MeshConfig.tensor = 4',
                                       'TrainConfig.xla_extra_flags = "--xla_gpu_threshold_for_windowed_einsum_mib=0"'],
                        num_devices=8)
  assert X.wanted_flags(**X.config_flags(extra))['xla_gpu_threshold_for_windowed_einsum_mib'] == '0'
