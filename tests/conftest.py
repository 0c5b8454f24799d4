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
