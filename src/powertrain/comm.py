"""Communication layer: every collective powertrain issues goes through a :class:`Communicator`.

A communicator wraps one process group (``None`` means the default group), counts the bytes this rank
hands to each collective, and degrades to a no-op at world size 1 or when ``torch.distributed`` has not
been initialised, so the same code runs in a single process (unit tests, benchmarks) and under
``torchrun``.

Byte accounting counts *payload*: the number of bytes of the tensor passed to the collective by this
rank. It is the figure to compare between compressors and with a plain all-reduce of the gradients.
What crosses the wire depends on the backend's algorithm (a ring all-reduce moves ``2 (W-1)/W`` times
the payload per rank); cost models apply that factor on top. Nothing is counted when nothing is sent
(world size 1).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

__all__ = ["CommStats", "Communicator"]


@dataclasses.dataclass
class CommStats:
    """Running totals of what one :class:`Communicator` sent.

    Attributes:
        bytes_sent: payload bytes this rank handed to collectives.
        num_collectives: number of collectives issued.
    """

    bytes_sent: int = 0
    num_collectives: int = 0

    def record(self, tensor: torch.Tensor) -> None:
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self.num_collectives += 1

    def reset(self) -> None:
        self.bytes_sent = 0
        self.num_collectives = 0


class Communicator:
    """Collectives on one process group, with byte accounting and a world-size-1 fallback.

    Args:
        group: the process group to use; ``None`` means the default group (if one is initialised).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if group is not None and not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "Communicator(group=...) was given a process group, but torch.distributed is not "
                "initialised: call torch.distributed.init_process_group first, or pass group=None."
            )
        self.group = group
        self.stats = CommStats()

    @property
    def is_distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and self.world_size > 1

    @property
    def world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 0
        return dist.get_rank(self.group)

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        """Replace ``tensor`` by its sum over the ranks of the group, in place (no-op when alone)."""
        if not self.is_distributed or tensor.numel() == 0:
            return
        self.stats.record(tensor)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def all_reduce_mean_(self, tensor: torch.Tensor) -> None:
        """Replace ``tensor`` by its mean over the ranks of the group, in place.

        Divides by the world size *before* the sum, as the reference PowerSGD does, so that results
        match it bitwise in fp32. Empty tensors issue no collective.
        """
        if not self.is_distributed or tensor.numel() == 0:
            return
        tensor.div_(self.world_size)
        self.stats.record(tensor)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
