# Two commands on a fresh machine:
#   make train   create .venv if missing, install, train the default (tiny) model
#   make test    same set-up, then the whole test suite on 8 fake CPU devices
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mjax-installed
ARGS ?=

.PHONY: setup train test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(BIN)/mjax-train --gin_file configs/tiny.gin --workdir runs/tiny $(ARGS)

test: $(STAMP)
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(BIN)/python -m pytest -q tests $(ARGS)

bench: $(STAMP)
	$(BIN)/python bench/train_bench.py --gin_file configs/tiny.gin $(ARGS)

clean:
	rm -rf runs .pytest_cache
