"""Start N local workers through torch's elastic launcher, or run in place under ``torchrun``."""

from __future__ import annotations

import os
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
    return elastic_launch(config, fn)(*args)
