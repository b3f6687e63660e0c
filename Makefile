# Two commands on a fresh machine:
#   make train   create .venv if missing, install, train the default (tiny) model
#   make test    same set-up, then the test suite on 8 fake CPU devices, less the
#                tests marked slow (make test-slow runs those; CI runs both)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mjax-installed
ARGS ?=

.PHONY: setup train test test-slow test-all test-gpu-image bench bench-gpu baseline gpu-wheels clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(BIN)/mjax-train --gin_file configs/tiny.gin --workdir runs/tiny $(ARGS)

# The CUDA compiler of the installed jaxlib, for the tests that compile for
# GPUs this machine lacks (mjax-report comm --target h100:8). It needs no GPU
# and no CUDA libraries; kept out of the environment's site-packages so that
# nothing else starts the CUDA plugin (tests put it on PYTHONPATH).
CUDA_AOT := $(VENV)/cuda-aot
$(CUDA_AOT)/.installed: $(STAMP)
	V=$$($(BIN)/python -c 'import jaxlib; print(jaxlib.__version__)') && \
	  $(BIN)/python -m pip install -q --no-deps --target $(CUDA_AOT) \
	    "jax-cuda12-plugin==$$V" "jax-cuda12-pjrt==$$V"
	touch $@

# Two workers, one test file each at a time (pytest-xdist): most end-to-end
# tests wait on subprocesses, heartbeats and checkpoints, so a second file
# runs in their idle time (the suite takes ~0.75 of its serial time on two
# cores). Module fixtures stay shared within their file. The longest files
# go first, so that the two workers finish together instead of one running
# a long file alone at the end. TEST_WORKERS=0: serial.
#
# Two legs: `make test` leaves out the tests marked slow (each over ~30 s on
# two cores: the end-to-end fault runs, the deviceless GPU compiles), so that
# it stays under 20 minutes on a 2-core machine; `make test-slow` runs just
# those, `make test-all` everything at once. CI (.ci/run) runs both legs.
TEST_WORKERS ?= 2
TEST_MARK ?= not slow
LONG_TESTS := tests/test_ft.py tests/test_multihost.py tests/test_checkpoint.py tests/test_gpu_target.py \
	tests/test_slurm_cluster.py tests/test_agent.py tests/test_train.py tests/test_hf.py tests/test_generate.py
TEST_FILES := $(LONG_TESTS) $(filter-out $(LONG_TESTS),$(sort $(wildcard tests/test_*.py)))
test: $(STAMP) $(CUDA_AOT)/.installed
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(BIN)/python -m pytest -q --durations=15 \
	  $(if $(TEST_MARK),-m '$(TEST_MARK)') \
	  $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) $(TEST_FILES) $(ARGS)
test-slow:
	$(MAKE) test TEST_MARK=slow
test-all:
	$(MAKE) test TEST_MARK=

# The GPU image's Python and jaxlib (3.12, 0.11.2) on this CPU, for what
# breaks only there before a GPU call finds it: CPython 3.12 starts with
# objects frozen and tokenizes gin values itself, jaxlib 0.11 names and
# schedules ops its own way. The files that need neither torch nor the CUDA
# compiler, one end-to-end run, and a pipelined layout whose compile XLA's
# partitioner aborted under 0.11 only. Skipped, with a note, without Python 3.12.
PY312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python) \
	$(shell python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null))
VENV312 ?= .venv312
GPU_IMAGE_JAX ?= 0.11.2
GPU_IMAGE_TESTS := tests/test_gc_control.py tests/test_config.py tests/test_xla_flags.py tests/test_optim.py \
	tests/test_loss.py tests/test_memory.py tests/test_flops.py tests/test_launch.py tests/test_stragglers.py \
	tests/test_device_time.py tests/test_data.py tests/test_data_shards.py tests/test_data_mixture.py \
	tests/test_data_tokenizer.py tests/test_attention.py \
	tests/test_train.py::test_garbage_is_collected_at_the_same_steps_and_only_there \
	tests/test_train.py::test_the_abstract_state_is_inits_without_tracing_the_model \
	'tests/test_parallel.py::test_layout_matches_one_device[fsdp2_pipeline2_tensor2_sp_gather_once]'
$(VENV312)/.mjax-installed: pyproject.toml
	test -x $(VENV312)/bin/python || $(PY312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip install -q --upgrade pip
	$(VENV312)/bin/python -m pip install -q "jax==$(GPU_IMAGE_JAX)" "jaxlib==$(GPU_IMAGE_JAX)" -e '.[test]'
	touch $@
ifeq ($(PY312),)
test-gpu-image:
	@echo "test-gpu-image: no Python 3.12 on this machine (python3.12 or pyenv); skipped"
else
test-gpu-image: $(VENV312)/.mjax-installed
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(VENV312)/bin/python -m pytest -q \
	  $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) $(GPU_IMAGE_TESTS) $(ARGS)
endif

bench: $(STAMP)
	$(BIN)/python bench/train_bench.py --gin_file configs/tiny.gin $(ARGS)

# The GPU suite (bench/gpu_suite.py): attention, a 125m run, the MFU table.
# On the GPU machine, with .whl/ brought along from `make gpu-wheels`.
bench-gpu:
	bash bench/gpu.sh $(ARGS)

# The code at REF as a source tree for `bench/gpu_suite.py --baseline .baseline`
# (carry .baseline with the wheels): a change and the code before it timed
# side by side on one card. .baseline/ is git-ignored.
REF ?= HEAD
baseline:
	rm -rf .baseline && mkdir .baseline && git archive $(REF) mjax bench configs pyproject.toml | tar -x -C .baseline

# Wheels of what the GPU image lacks (Python 3.12, x86-64), for machines that
# reach no package registry. Run where pip works; .whl/ is git-ignored.
GPU_PY ?= 3.12
GPU_WHEELS ?= grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 gin-config==0.5.0 \
	tensorboardX==2.6.5 importlib_resources==7.1.0
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PY) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
	  -d .whl $(GPU_WHEELS)

clean:
	rm -rf runs .pytest_cache
