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
