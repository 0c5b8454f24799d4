"""Switching DDP's gradient all-reduce off for DeMo, which exchanges its own compressed components instead."""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

__all__ = ["local_gradients"]


def _keep_local(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def local_gradients(ddp_model: DistributedDataParallel) -> DistributedDataParallel:
    """Make ``ddp_model``'s backward leave every rank's own gradient in ``.grad``: no gradient communication.

    Registers a DDP comm hook that returns each bucket unchanged (DDP does not divide a hooked bucket by the
    world size, so ``.grad`` is exactly the local gradient). DDP still broadcasts parameters at construction
    and buffers before forward (``broadcast_buffers``), and with ``find_unused_parameters=True`` it still
    all-reduces its small bitmap of used parameters. A model without DDP, or ``ddp_model.no_sync()`` around
    every forward and backward (the reference DeMo's advice), has the same effect.

    Args:
        ddp_model: a DistributedDataParallel model without a comm hook yet (DDP allows only one).

    Returns:
        ``ddp_model``, for chaining.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise ValueError(
            f"Invalid ddp_model of type {type(ddp_model).__name__}: local_gradients needs a "
            "DistributedDataParallel model (a plain model already keeps local gradients)"
        )
    ddp_model.register_comm_hook(None, _keep_local)
    return ddp_model
