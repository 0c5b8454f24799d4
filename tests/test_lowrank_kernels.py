"""PowerSGD's Triton kernel on the CPU, under Triton's interpreter, in a process of its own.

The interpreter has to be on before Triton is first imported: Triton's own library functions (``tl.min``, ``tl.max``)
are compiled-mode functions in a process that imported Triton without it (torch.compile's tests do, in the same test
worker), and an interpreted kernel cannot call them. So the cases (tests/lowrank_kernels_cases.py: their tolerances
are derived there) run in a fresh interpreter with ``TRITON_INTERPRET=1`` from its start, as a user would set it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.timeout(300)
def test_the_kernels_under_tritons_interpreter():
    cases = Path(__file__).with_name("lowrank_kernels_cases.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "POWERTRAIN_FUSED": "1"}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE", str(cases)]
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=280, cwd=cases.parent.parent)
    assert r.returncode == 0 and " passed" in r.stdout and "skipped" not in r.stdout, (
        r.stdout[-6000:] + r.stderr[-2000:]
    )
