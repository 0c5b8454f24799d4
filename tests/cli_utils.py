"""Running the ``powertrain`` command in a subprocess, so that a hang fails fast *and* says where it hung."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_utils import EXTENSIONS


def children(pid: int) -> list[int]:
    """A process's direct children, from /proc (no psutil needed); [] once it is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out = []
    for tid in tasks:
        with contextlib.suppress(OSError):
            out += map(int, Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
    return out


def _descendants(pid: int) -> list[int]:
    """Child processes, depth first."""
    return [d for child in children(pid) for d in (child, *_descendants(child))]


def run_cli(
    *args: str,
    timeout: float = 120,
    cwd: Path | None = None,
    module: str = "powertrain",
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` (``powertrain`` by default), with ``env`` added to the environment.

    If it is still running after ``timeout`` seconds, every process of the run gets SIGABRT, which (with
    PYTHONFAULTHANDLER) prints each one's Python stack of every thread to the stderr the test shows, and the test
    fails naming the command. The stderr returned leaves out faulthandler's list of loaded extension modules."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    cmd = [sys.executable, "-m", module, *args]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, cwd=cwd, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [*reversed(_descendants(proc.pid)), proc.pid]:  # workers first: their stacks are the story
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err = EXTENSIONS.sub("", err)
        pytest.fail(f"still running after {timeout:g} s: {' '.join(cmd)}\n--- stderr (stacks)\n{err[-20000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, EXTENSIONS.sub("", err))


def torchrun(
    script: Path, *args: str, nproc: int = 2, timeout: float = 150, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node NPROC SCRIPT ARGS`` as a user runs it on one machine (c10d rendezvous on a free
    loopback port), one torch thread per worker, the tests' directory importable, in ``cwd`` (a script that writes
    relative paths, as the guides' do, needs one: the default is pytest's, the checkout); a hang fails as in
    :func:`run_cli`."""
    tests = str(Path(__file__).parent)
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p)
    return run_cli(
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:0",
        str(script),
        *args,
        timeout=timeout,
        cwd=cwd,
        module="torch.distributed.run",
        env={"OMP_NUM_THREADS": "1", "PYTHONPATH": path},
    )
