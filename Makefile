# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (what CI runs).
# Both create or reuse .venv. The venv sees system site-packages so that a preinstalled torch (e.g. a CUDA
# build on a GPU box) is used as is; the 2.13.0 CPU build is installed only when no torch is importable.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint bench clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# galore-torch: the GaLore reference tests/test_galore.py compares with. Its declared transformers and
	# bitsandbytes are not needed by the modules the test loads, so they are not installed.
	$(PY) -m pip install -q --no-deps galore-torch==1.0
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/powertrain train

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests tools
	$(VENV)/bin/ruff format --check src tests tools
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(VENV)/bin/powertrain bench overhead

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
