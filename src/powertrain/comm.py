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
import threading
import time
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

from powertrain._compat import all_gather_single

__all__ = ["CommStats", "Communicator", "ReduceKind", "collective_device", "group_of_its_own", "ring_cost"]

#: How a reducing collective combines the ranks' tensors: their sum, or their mean (the sum divided by the world size).
ReduceKind = Literal["sum", "mean"]


@dataclasses.dataclass
class CommStats:
    """Running totals of what one :class:`Communicator` sent.

    Attributes:
        bytes_sent: payload bytes this rank handed to collectives.
        num_collectives: number of collectives issued.
        comm_s: seconds spent blocked in synchronous collectives (asynchronous ones overlap other work and
            are not counted).
        compress_s: seconds compressors spent in their own math around the collectives.
    """

    bytes_sent: int = 0
    num_collectives: int = 0
    comm_s: float = 0.0
    compress_s: float = 0.0
    #: payload bytes per kind of collective ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"): cost models
    #: need the kind, since a ring all-gather of P bytes sends (W-1) P and an all-reduce of N sends 2 (W-1)/W N.
    by_op: dict[str, int] = dataclasses.field(default_factory=dict)
    # Collectives may be issued from communication threads (DDP hooks): updates take this lock.
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, tensor: torch.Tensor, op: str = "all_reduce") -> None:
        """Counts one collective of kind ``op`` sending ``tensor`` (its ``numel() * element_size()`` bytes)."""
        self.record_bytes(tensor.numel() * tensor.element_size(), op)

    def record_bytes(self, nbytes: int, op: str = "all_reduce", collectives: int = 1) -> None:
        """Counts ``collectives`` collectives of kind ``op`` that sent ``nbytes`` payload bytes in all (for
        collectives issued by code that does not go through a :class:`Communicator`, e.g. torch's FSDP)."""
        with self._lock:
            self.bytes_sent += nbytes
            self.num_collectives += collectives
            self.by_op[op] = self.by_op.get(op, 0) + nbytes

    def add_time(self, *, comm_s: float = 0.0, compress_s: float = 0.0) -> None:
        """Adds seconds to the running totals: ``comm_s`` blocked in collectives, ``compress_s`` in compression."""
        with self._lock:
            self.comm_s += comm_s
            self.compress_s += compress_s

    @staticmethod
    def combined(parts: list[CommStats]) -> CommStats:
        """A snapshot of several communicators' totals added up (a run whose gradient averaging and optimizer
        communicate separately)."""
        out = CommStats()
        for s in parts:
            out.bytes_sent += s.bytes_sent
            out.num_collectives += s.num_collectives
            out.comm_s += s.comm_s
            out.compress_s += s.compress_s
            for op, n in s.by_op.items():
                out.by_op[op] = out.by_op.get(op, 0) + n
        return out

    def reset(self) -> None:
        """Zeroes every total, in place (holders of this object see the reset)."""
        with self._lock:
            self.bytes_sent = 0
            self.num_collectives = 0
            self.comm_s = 0.0
            self.compress_s = 0.0
            self.by_op = {}


class Communicator:
    """Collectives on one process group, with byte accounting and a world-size-1 fallback.

    Args:
        group: the process group to use; ``None`` means the default group (if one is initialised).
        stats: where to count bytes; communicators that serve one compressor on several groups share it.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, stats: CommStats | None = None) -> None:
        if group is not None and not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "Communicator(group=...) was given a process group, but torch.distributed is not "
                "initialised: call torch.distributed.init_process_group first, or pass group=None."
            )
        self.group = group
        self.stats = CommStats() if stats is None else stats

    @property
    def is_distributed(self) -> bool:
        """Whether torch.distributed is initialised and the group has more than one rank (else nothing is sent)."""
        return dist.is_available() and dist.is_initialized() and self.world_size > 1

    @property
    def world_size(self) -> int:
        """The number of ranks in the group; 1 when torch.distributed is not initialised."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        """This process's rank in the group; 0 when torch.distributed is not initialised."""
        if not (dist.is_available() and dist.is_initialized()):
            return 0
        return dist.get_rank(self.group)

    def all_reduce_(
        self, tensor: torch.Tensor, op: ReduceKind, *, async_op: bool = False
    ) -> torch.futures.Future | None:
        """Sum or mean over the ranks of the group, in place.

        ``"mean"`` divides by the world size *before* summing, as the reference PowerSGD does, so that
        results match it bitwise in fp32 (and fp16 cannot overflow in the sum). With ``async_op`` a future
        that completes once ``tensor`` holds the result is returned; otherwise None. At world size 1 or
        for an empty tensor nothing is sent (and a completed future is returned if one was asked for).
        """
        if not self.is_distributed or tensor.numel() == 0:
            return _done(tensor) if async_op else None
        if op == "mean":
            tensor.div_(self.world_size)
        self.stats.record(tensor)
        t0 = time.perf_counter()
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        if not async_op:
            self.stats.add_time(comm_s=time.perf_counter() - t0)
        return work.get_future() if async_op and work is not None else None

    def all_gather(
        self, tensor: torch.Tensor, *, async_op: bool = False
    ) -> tuple[torch.Tensor, torch.futures.Future | None]:
        """Gather ``tensor`` (same shape on every rank) from all ranks: returns ``(world_size, *shape)``.

        With ``async_op`` the result is only valid once the returned future completes.
        """
        out = torch.empty((self.world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        if not self.is_distributed:
            out[0].copy_(tensor)
            return out, _done(out) if async_op else None
        self.stats.record(tensor, "all_gather")
        t0 = time.perf_counter()
        work = all_gather_single(out.view(-1), tensor.contiguous().view(-1), group=self.group, async_op=async_op)
        if not async_op:
            self.stats.add_time(comm_s=time.perf_counter() - t0)
        return out, work.get_future() if async_op and work is not None else None

    def all_to_all(self, send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
        """Personalised exchange: the 1-D ``send`` holds, one after the other, ``send_sizes[r]`` elements for each
        rank ``r`` of the group; returns a new 1-D tensor with what each rank sent this one, in rank order
        (``recv_sizes[r]`` elements from rank ``r``, which must equal that rank's ``send_sizes`` entry for this one).

        Counted as the bytes that leave this rank (its part for itself stays), under ``"all_to_all"``. Alone, the
        only part is this rank's own and is copied."""
        world = self.world_size
        if len(send_sizes) != world or len(recv_sizes) != world or sum(send_sizes) != send.numel():
            raise ValueError(
                f"all_to_all got {len(send_sizes)} send and {len(recv_sizes)} receive sizes for {world} ranks and "
                f"{send.numel()} elements to send ({sum(send_sizes)} in the sizes): give one size per rank"
            )
        out = torch.empty(sum(recv_sizes), dtype=send.dtype, device=send.device)
        if not self.is_distributed:
            return out.copy_(send)
        me = self.rank
        self.stats.record_bytes((sum(send_sizes) - send_sizes[me]) * send.element_size(), "all_to_all")
        t0 = time.perf_counter()
        dist.all_to_all_single(out, send.contiguous(), recv_sizes, send_sizes, group=self.group)
        self.stats.add_time(comm_s=time.perf_counter() - t0)
        return out

    def shift(self, send: list[torch.Tensor], recv: list[torch.Tensor], *, tag: int = 0) -> Callable[[], None]:
        """One hop around the ring: ``send`` goes to the next rank of the group, ``recv`` is filled from the
        previous one (same shapes and dtypes on every rank); returns a function that waits for both.

        Both directions are posted at once (``batch_isend_irecv``), so the hop overlaps whatever the caller
        computes before it waits. ``tag`` keeps two streams of hops between the same peers apart. Waiting
        again is a no-op.
        """
        if len(send) != len(recv):
            raise ValueError(f"shift got {len(send)} tensors to send and {len(recv)} to receive: give one each")
        if not all(t.is_contiguous() for t in recv):
            raise ValueError("shift receives into contiguous tensors only: pass buffers from torch.empty_like")
        if not self.is_distributed:
            for s, r in zip(send, recv, strict=True):
                r.copy_(s)
            return _nothing
        world, me = self.world_size, self.rank
        nxt, prev = (me + 1) % world, (me - 1) % world
        if self.group is not None:  # P2POp takes global ranks
            nxt, prev = dist.get_global_rank(self.group, nxt), dist.get_global_rank(self.group, prev)
        ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, self.group, tag) for t in send]
        ops += [dist.P2POp(dist.irecv, t, prev, self.group, tag) for t in recv]
        for t in send:
            self.stats.record(t, "send")
        works = dist.batch_isend_irecv(ops)

        def wait() -> None:  # idempotent: a second wait on a gloo send would wait for a send that never comes
            while works:
                works.pop(0).wait()
            ops.clear()  # the messages (and any contiguous copies) were held until here

        return wait

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        """Replace ``tensor`` by its sum over the ranks of the group, in place (no-op when alone)."""
        self.all_reduce_(tensor, "sum")

    def all_reduce_mean_(self, tensor: torch.Tensor) -> None:
        """Replace ``tensor`` by its mean over the ranks of the group, in place (see :meth:`all_reduce_`)."""
        self.all_reduce_(tensor, "mean")


def ring_cost(op: str, world: int) -> tuple[float, int]:
    """A ring collective's two cost terms per rank, the alpha-beta model's multipliers: the bytes it sends per byte of
    payload (beta's), and the messages it sends (alpha's). The payload is what one rank hands to the collective (the
    tensor for all-reduce, its own part for all-gather, what leaves it for all-to-all). Ring all-reduce sends
    ``2 (W-1)/W`` of it in ``2 (W-1)`` messages, all-gather ``W-1`` times it in ``W-1``, reduce-scatter ``(W-1)/W`` in
    ``W-1``, all-to-all all of it once in ``W-1``; nothing at world size 1.

    Args:
        op: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"`` or ``"all_to_all"`` (else ValueError).
        world: the ranks in the ring.
    """
    known = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    if op not in known:
        raise ValueError(f"Unknown collective {op!r}: the cost model knows {', '.join(known)}")
    if world < 2:
        return 0.0, 0
    per_byte = {
        "all_reduce": 2 * (world - 1) / world,
        "all_gather": world - 1,
        "reduce_scatter": (world - 1) / world,
        "all_to_all": 1.0,
    }[op]
    return per_byte, 2 * (world - 1) if op == "all_reduce" else world - 1


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where ``group``'s (default: the world's) collectives take their tensors: the current CUDA device under NCCL
    (which refuses CPU tensors), else the CPU (gloo; also when torch.distributed is not initialised). Tensors that
    exist only to be sent (flags, counts, the loss's average) are made here."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_of_its_own(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """A new process group with the ranks of ``group`` (default: the world), for collectives that run beside the
    caller's own on ``group`` (from another thread, in the background). ``new_group`` must be called by every rank
    of the world with the same ranks, so every rank calls this: the ranks learn each other's groups (one all-gather
    on the default group) and create each distinct one, in the same order; each gets the copy of its own. None when
    torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    mine = torch.zeros(world, dtype=torch.int64)
    mine[dist.get_process_group_ranks(group) if group is not None else list(range(world))] = 1
    device = collective_device()  # the all-gather runs on the default group
    masks = torch.empty(world, world, dtype=torch.int64, device=device)
    all_gather_single(masks.view(-1), mine.to(device))
    masks = masks.cpu()
    own = None
    for ranks in dict.fromkeys(tuple(int(r) for r in row.nonzero().flatten()) for row in masks):
        created = dist.new_group(ranks=list(ranks))
        if mine[list(ranks)].all() and int(mine.sum()) == len(ranks):
            own = created
    return own


def _nothing() -> None:
    pass


def _done(value: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut
