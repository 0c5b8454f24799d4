"""Start N local workers through torch's elastic launcher, or run in place under ``torchrun``."""

from __future__ import annotations

import atexit
import os
import pickle
import sys
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from torch.distributed.launcher.api import LaunchConfig, elastic_launch

T = TypeVar("T")


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _shutdown_timeout(seconds: int) -> dict[str, Any]:
    """How long the agent waits for the other workers after one fails (a newer LaunchConfig field)."""
    return {"shutdown_timeout": seconds} if "shutdown_timeout" in LaunchConfig.__dataclass_fields__ else {}


def _exit_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _then_skip_finalization(fn: Callable[..., T], *args: Any) -> T:
    """A launched worker's entry point: ``fn(*args)``; once it has returned, the process exits without
    interpreter finalisation.

    Tearing the interpreter down can race torch's background threads (gloo's, the autograd engine's) for the
    GIL, a hang reported upstream (pytorch/pytorch#75097, #190489); the agent joins its workers without a
    timeout, so one stuck worker blocks the run for good (CI saw a run hang after its last line). By then there is
    nothing left to do: the process group is destroyed, files are closed, and the agent has read the result
    before it lets the worker leave. The atexit hook (LIFO: it runs first) flushes stdio and calls
    ``os._exit(0)``; it is registered only after ``fn`` succeeded and its result is known to pickle, so a
    failing worker keeps its exit code and error file.
    """
    result = fn(*args)
    pickle.dumps(result)  # what the agent's queue will do: fail here, with the worker's real exit code
    atexit.register(_exit_now)
    return result


def launch(fn: Callable[..., T], nproc: int, *args: Any) -> dict[int, T]:
    """Run ``fn(*args)`` on ``nproc`` local processes; return each rank's result.

    Under ``torchrun`` (or any launcher that sets RANK/WORLD_SIZE), runs ``fn`` in this process only. The
    rendezvous binds to 127.0.0.1 on a free port, and gloo to the loopback interface unless
    ``GLOO_SOCKET_IFNAME`` is already set.
    """
    if under_torchrun():
        return {int(os.environ.get("RANK", "0")): fn(*args)}
    if nproc == 1:
        return {0: fn(*args)}
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"powertrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        **_shutdown_timeout(5),
    )
    return elastic_launch(config, _then_skip_finalization)(fn, *args)
