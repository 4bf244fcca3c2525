# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow lint install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch==2.13.0 first: the CPU wheel on disk; nothing may pull a CUDA torch.
$(STAMP): pyproject.toml setup.py transfer/_kernels.c transfer/_xxh3_avx2.h | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvpool demo

lint: $(STAMP)
	$(BIN)/ruff check kvpool transfer prefill_node decode_node tests scripts
	$(BIN)/ruff format --check kvpool transfer prefill_node decode_node tests scripts
	$(BIN)/mypy kvpool transfer prefill_node decode_node

test: lint
	$(BIN)/python -m pytest -q -m 'not slow'

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) build *.egg-info
