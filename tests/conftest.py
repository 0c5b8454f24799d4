"""Session set-up shared by every test (and inherited by the workers and subprocesses the tests start)."""

from __future__ import annotations

import getpass
import os
import tempfile

# Inductor's on-disk cache is shared by every run of a user. Measured on an AMD EPYC with AVX-512 (torch 2.13): with
# the cache filled by native runs, test_simple_fsdp's compiled reshard test under ATEN_CPU_CAPABILITY=avx2 got NaN
# gradients (twice), and it passed (twice) with a cache of its own. So each CPU code path the suite runs under
# (make test-kernels) gets its own cache, unless the user chose one.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _path = os.environ.get("ATEN_CPU_CAPABILITY", "native")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}", f"powertrain-tests-{_path}"
    )


# ---------------------------------------------------------------- the device the device-generic tests run on

# imported after the cache set-up above, which must precede any torch import
import pytest
import torch

#: POWERTRAIN_TEST_DEVICE=cuda runs the tests marked ``device`` on CUDA (``pytest -m device``: the GPU leg of
#: ``make gpu-check``); unset or ``cpu``, they run on the CPU as every other test does.
DEVICE_ENV = "POWERTRAIN_TEST_DEVICE"


def device_under_test() -> torch.device:
    """The device POWERTRAIN_TEST_DEVICE names; pytest.skip when it is CUDA and this torch has none."""
    name = os.environ.get(DEVICE_ENV, "cpu")
    if name not in ("cpu", "cuda"):
        raise pytest.UsageError(f"Invalid {DEVICE_ENV}={name!r}: use cpu or cuda")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"{DEVICE_ENV}=cuda, but this torch ({torch.__version__}) sees no CUDA device")
    if name == "cuda":
        # float32 tolerances are derived for IEEE float32 products: TF32 (cuDNN's default for convolutions) rounds
        # inputs to 10 mantissa bits
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return torch.device(name)


@pytest.fixture
def device() -> torch.device:
    """The device of a device-generic test (see :data:`DEVICE_ENV`)."""
    return device_under_test()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"device: runs on the device {DEVICE_ENV} names (cpu by default; cuda: make gpu-check's test leg)"
    )
    config.addinivalue_line(
        "markers", "slow: end to end through a benchmark, a second node, torch.compile or the docs (make test-slow)"
    )
    config.addinivalue_line("markers", "slow_unless(*ids): slow but for the parametrized cases named (corners)")
    config.addinivalue_line(
        "markers", "netem: creates network namespaces: skipped without root; under pytest-xdist on one worker"
    )


#: ``make test`` runs the suite but these (``-m "not slow"``), ``make test-slow`` runs these; CI runs both. They
#: go end to end through what the rest of the suite tests part by part: the benchmarks' commands, emulated nodes
#: and torchrun's restarts, the docs' build and examples, the integrations' trainers (tests marked ``slow`` in other
#: modules: torch.compile's).
SLOW_MODULES = {
    "test_bench_optimizers",
    "test_bench_parallel",
    "test_bench_quality",
    "test_bench_simple_fsdp",
    "test_bench_torchft",
    "test_gpu_check",
    "test_multinode",
    "test_elastic",
    "test_netem",
    "test_docs",
    "test_examples",
    "test_hf",
    "test_lightning",
}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test`` runs ``-n 2 --dist loadgroup``), the tests of a module that has a
    module-scoped fixture (one launch of ranks that serves all of them) run on one worker, so that the fixture
    runs once; so do the tests marked ``netem``, which check that they leave no namespace behind (and are skipped
    where namespaces cannot be made); every other test goes wherever a worker is free."""
    from powertrain.bench.netem import unavailable

    no_namespaces = unavailable()
    for item in items:
        if item.module is not None and item.module.__name__ in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        corners = item.get_closest_marker("slow_unless")  # a matrix: the corners fast, the rest slow
        if corners is not None and getattr(item, "callspec", None) is not None and item.callspec.id not in corners.args:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("netem") is not None:
            if no_namespaces is not None:
                item.add_marker(pytest.mark.skip(reason=f"namespaces unavailable: {no_namespaces}"))
            item.add_marker(pytest.mark.xdist_group("netem"))
            continue
        info = getattr(item, "_fixtureinfo", None)
        defs = [] if info is None else [d for ds in info.name2fixturedefs.values() for d in ds]
        if any(d.scope == "module" for d in defs) and item.module is not None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
