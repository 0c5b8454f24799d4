# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (what CI runs).
# Both create or reuse .venv. The venv sees system site-packages so that a preinstalled torch (e.g. a CUDA
# build on a GPU box) is used as is; the 2.13.0 CPU build is installed only when no torch is importable.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-slow test-kernels lint docs bench gpu-check gpu-multi clean

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
	$(VENV)/bin/ruff check src tests tools examples
	$(VENV)/bin/ruff format --check src tests tools examples
	$(VENV)/bin/mypy

# The guides and the API reference generated from the docstrings (Sphinx, MyST Markdown, furo), warnings as errors;
# open docs/_build/html/index.html. tests/test_docs.py builds them too.
docs: $(VENV)/.installed
	$(PY) -m sphinx -b html -W --keep-going -q -c docs . docs/_build/html

# Tolerances must hold on every CPU, not only this one (issue 16): the numerically sensitive tests run again on
# two other code paths, MKL's generic reproducible path with ATen's scalar kernels, and MKL's Intel AVX-512 path
# (on an AMD CPU MKL takes its AVX2 path; the shim tools/mkl_intel_path.c makes it take Intel's).
NUMERIC_TESTS := tests/test_reproducible.py tests/test_powersgd_unit.py tests/test_compressors_unit.py tests/test_shampoo_math.py \
	tests/test_shampoo_convergence.py tests/test_galore.py tests/test_frozen_adamw.py
SHIM := $(VENV)/lib/libmkl_intel_path.so
KERNEL_PATHS := "MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default" "LD_PRELOAD=$(abspath $(SHIM))"

$(SHIM): tools/mkl_intel_path.c
	-cc -shared -fPIC -O2 -o $@ $< || echo "no C compiler: MKL's Intel path is not tested here"

# The suite on 2 pytest workers (pytest-xdist), which overlap one test's waits with another's work; the tests of a
# module with a module-scoped fixture stay together (tests/conftest.py). `make test` leaves out the end-to-end tests
# marked slow (the benchmarks' commands, emulated nodes, torch.compile, the docs; tests/conftest.py says which):
# `make test-slow` runs them, and CI runs both.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

test: lint $(SHIM)
	$(PYTEST) -m "not slow"
	for paths in $(KERNEL_PATHS); do echo "== $$paths"; env $$paths $(PY) -m pytest -q -p no:cacheprovider \
		$(NUMERIC_TESTS) || exit 1; done

test-slow: $(VENV)/.installed
	$(PYTEST) -m slow

# The whole suite on each code path this machine can select (slow: about 10 minutes a path).
test-kernels: lint $(SHIM)
	for paths in "" "MKL_CBWR=COMPATIBLE" "MKL_CBWR=AVX2" "LD_PRELOAD=$(abspath $(SHIM))" \
		"LD_PRELOAD=$(abspath $(SHIM)) MKL_CBWR=AVX512" "ATEN_CPU_CAPABILITY=default" "ATEN_CPU_CAPABILITY=avx2"; do \
		echo "== $${paths:-native}"; env $$paths $(PY) -m pytest -q -p no:cacheprovider || exit 1; done

bench: $(VENV)/.installed
	$(VENV)/bin/powertrain bench overhead

# The GPU check (tools/gpu_check.py): the CUDA test leg, compression's GPU compute, memory and every --parallel mode on
# one GPU, ~7 minutes; files in $OUT (or runs/gpu-check). DEVICE=cpu: the dry run, a minute or two. It never creates
# a venv or installs anything (a GPU machine may have no network): with no $(VENV)/.installed it runs $(PYTHON) on
# the source tree, using the torch installed there.
# GPU_CHECK_ARGS: more options, e.g. a rerun of some stages merged into an earlier run's results (tools/gpu_check.py).
DEVICE ?= cuda
GPU_CHECK_ARGS ?=
GPU_PY = $(if $(wildcard $(VENV)/.installed),$(PY),$(PYTHON))
gpu-check:
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) tools/gpu_check.py --device $(DEVICE) $(GPU_CHECK_ARGS)

# A machine with several GPUs (tools/gpu_multi.py): DDP and FSDP2, exact, PowerSGD and int8, at 2, 4 and 8 GPUs,
# ~9 minutes; files in $OUT (or runs/gpu-multi). DEVICE=cpu: the dry run on 2 gloo workers. Installs nothing.
gpu-multi:
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) tools/gpu_multi.py --device $(DEVICE)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache docs/_build
