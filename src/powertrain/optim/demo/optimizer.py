"""``DeMo``: Decoupled Momentum optimization (Peng, Quesnelle, Kingma, arXiv 2411.19870).

Every rank keeps its own momentum and never averages gradients. Per step, for every parameter with a
gradient ``g`` (its local gradient: the data-parallel all-reduce is switched off, see :mod:`.ddp`):

1. Decoupled weight decay: ``p <- p (1 - lr * weight_decay)``.
2. Momentum: ``m <- compression_decay * m + lr * g`` (the reference folds the learning rate in here).
3. Fast components: ``m`` is cut into chunks (:func:`.dct.chunk_layout`, ``compression_chunk`` per dimension)
   and each chunk goes through an orthonormal 2-D DCT-II; the ``compression_topk`` largest-magnitude
   coefficients of each chunk are kept (values rounded to ``comm_dtype``).
4. They leave the momentum: ``m <- m - IDCT(kept)``; the rest stays local and keeps accumulating.
5. One all-gather for all parameters: every rank sends its kept values and their positions within the
   chunk (int16 when every chunk has at most 32768 coefficients, else int32) in one packed buffer.
6. Each rank decodes all ranks' coefficients: at each position the mean of the ranks that sent it (zero
   where none did), as the reference's ``scatter_reduce(mean)``; then the inverse DCT gives ``q``.
7. Sign update: ``p <- p - lr * sign(q)``.

Every rank decodes the same gathered buffer in the same order, so parameters stay bitwise equal across
ranks. The momentum has the parameter's dtype (as in the reference); the transforms run in at least
float32. Parameters that do not require gradients or have none this step are skipped; all ranks must agree
on which those are (the same model on every rank: a one-byte layout fingerprint in the payload turns
most disagreements into an error). The momentum is per rank:
``state_dict()`` holds this rank's, so each rank saves and loads its own. ``opt.comm.stats`` counts the
payload bytes sent (one all-gather per step) and the time spent in the math (``compress_s``).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from powertrain._checks import check_int
from powertrain.comm import Communicator
from powertrain.ops.finite import read_flag
from powertrain.ops.flat import index_dtype, local_tensor, pack_payload, unpack_payload
from powertrain.optim.demo.dct import (
    ChunkLayout,
    chunk_layout,
    dct_basis,
    decode,
    encode,
    mean_over_senders,
    scatter_chunks,
    topk_per_chunk,
)

__all__ = ["DeMo"]

_COMM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class _Sent(NamedTuple):
    """One parameter's part of a step's payload."""

    slot: int  # position among all the optimizer's parameters
    param: torch.Tensor  # this rank's part of the parameter (updated in place)
    lr: float
    layout: ChunkLayout
    k: int  # coefficients sent per chunk


class DeMo(torch.optim.Optimizer):
    """DeMo: local momentum, its fast DCT components exchanged by one all-gather, sign update.

    Args:
        params: parameters or parameter groups (``lr`` and ``weight_decay`` may differ per group).
        lr: learning rate: scales the gradient into the momentum and the sign step.
        compression_decay: momentum decay, in ``[0, 1)`` (reference default 0.999).
        compression_topk: coefficients sent per chunk (clamped to the chunk's size; default 32).
        compression_chunk: target chunk size per dimension: each dimension uses its largest divisor at most
            this (default 64, so a 2-D chunk has up to 4096 coefficients).
        weight_decay: decoupled weight decay (default 0).
        group: the ranks exchanging components (default: the world when initialised, else none).
        comm_dtype: dtype of the values sent (default float32; bfloat16 or float16 halve them).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        compression_decay: float = 0.999,
        compression_topk: int = 32,
        compression_chunk: int = 64,
        weight_decay: float = 0.0,
        group: dist.ProcessGroup | None = None,
        comm_dtype: torch.dtype = torch.float32,
    ) -> None:
        checks = [
            ("lr", lr, lr > 0, "> 0"),
            ("compression_decay", compression_decay, 0 <= compression_decay < 1, "in [0, 1)"),
            ("weight_decay", weight_decay, weight_decay >= 0, ">= 0"),
        ]
        for name, value, ok, want in checks:
            if isinstance(value, bool) or not isinstance(value, int | float) or not ok:
                raise ValueError(f"Invalid {name}={value!r}: must be a number {want}")
        check_int("compression_topk", compression_topk, 1)
        check_int("compression_chunk", compression_chunk, 1)
        if comm_dtype not in _COMM_DTYPES:
            raise ValueError(f"Invalid comm_dtype={comm_dtype!r}: must be one of {_COMM_DTYPES}")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self.compression_decay = compression_decay
        self.compression_topk = compression_topk
        self.compression_chunk = compression_chunk
        self.comm_dtype = comm_dtype
        self.comm = Communicator(group)
        self._bases: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def _basis(self, dtype: torch.dtype, device: torch.device) -> Any:
        def basis(n: int) -> torch.Tensor:
            key = (n, dtype, device)
            if key not in self._bases:
                self._bases[key] = dct_basis(n, dtype=dtype, device=device)
            return self._bases[key]

        return basis

    # -- step ----------------------------------------------------------------------------------------------

    def _extract(
        self, slot: int, p: torch.Tensor, group: dict[str, Any]
    ) -> tuple[_Sent, torch.Tensor, torch.Tensor] | None:
        """Steps 1-4 for one parameter: the kept coefficients' values (comm_dtype) and positions (int64)."""
        w, g = local_tensor(p), local_tensor(p.grad)  # type: ignore[arg-type]
        if g.is_sparse:
            raise ValueError("DeMo does not support sparse gradients")
        if w.numel() == 0:  # an empty FSDP2 shard: nothing to update, nothing to send
            return None
        lr, wd = group["lr"], group["weight_decay"]
        state = self.state[p]
        if "momentum" not in state:
            state["momentum"] = torch.zeros_like(w)
        m = state["momentum"]
        if wd != 0:
            w.mul_(1 - lr * wd)
        m.mul_(self.compression_decay).add_(g, alpha=lr)
        layout = chunk_layout(w.shape, self.compression_chunk)
        cdtype = _compute_dtype(m.dtype)
        basis = self._basis(cdtype, m.device)
        values, positions = topk_per_chunk(encode(m, layout, basis), self.compression_topk)
        values = values.to(self.comm_dtype)  # what is sent is what leaves the momentum
        sent = decode(scatter_chunks(values.to(cdtype), positions, layout.chunk_numel), layout, m.shape, basis)
        m.sub_(sent.to(m.dtype))
        return _Sent(slot, w, lr, layout, values.shape[1]), values.reshape(-1), positions.reshape(-1)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One DeMo step (see the module docstring); issues one all-gather on ``group``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t0 = time.perf_counter()
        sent: list[_Sent] = []
        values: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        slot = -1
        for group in self.param_groups:
            for p in group["params"]:
                slot += 1
                if not p.requires_grad or p.grad is None:
                    continue
                out = self._extract(slot, p, group)
                if out is not None:
                    sent.append(out[0])
                    values.append(out[1])
                    positions.append(out[2])
        if not sent:
            return loss
        itype = index_dtype(max(s.layout.chunk_numel for s in sent))
        device = sent[0].param.device
        payload = pack_payload([torch.cat(values), torch.cat(positions).to(itype)])
        # The last byte (pack_payload's spare flag byte) fingerprints the layout: ranks that disagree on which
        # parameters have gradients, or on their shapes, would otherwise decode each other's bytes wrongly.
        payload[-1:].fill_(_fingerprint(sent, itype))  # fill_ with a number: no host-to-device copy (sync) on CUDA
        t1 = time.perf_counter()
        gathered, _ = self.comm.all_gather(payload)
        t2 = time.perf_counter()
        # A host synchronisation on CUDA, kept on purpose: decoding another layout's bytes would corrupt the update
        # silently, and a wrong layout (a user error) must stop every rank with a message.
        if not read_flag((gathered[:, -1] == payload[-1]).all()):
            raise RuntimeError(
                "DeMo: ranks disagree on the parameters being updated (which have gradients, or their shapes): "
                "every rank of the group must step the same parameters"
            )
        total = sum(v.numel() for v in values)
        rows = [unpack_payload(row, [(self.comm_dtype, total), (itype, total)]) for row in gathered]
        values_wn = torch.stack([r[0] for r in rows])
        positions_wn = torch.stack([r[1] for r in rows])
        offset = 0
        for s in sent:
            n = s.layout.num_chunks * s.k
            shape = (gathered.shape[0], s.layout.num_chunks, s.k)
            cdtype = _compute_dtype(s.param.dtype)
            basis = self._basis(cdtype, device)
            v = values_wn[:, offset : offset + n].reshape(shape).to(cdtype)
            mean = mean_over_senders(v, positions_wn[:, offset : offset + n].reshape(shape), s.layout.chunk_numel)
            q = decode(mean, s.layout, s.param.shape, basis)
            s.param.add_(q.sign_().to(s.param.dtype), alpha=-s.lr)
            offset += n
        self.comm.stats.add_time(compress_s=(t1 - t0) + (time.perf_counter() - t2))
        return loss


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The DCT runs in at least float32: bf16 or fp16 matmuls would lose the small components."""
    return torch.promote_types(dtype, torch.float32)


def _fingerprint(sent: list[_Sent], itype: torch.dtype) -> int:
    """One byte summarising which parameters are sent, their shapes and the index dtype."""
    text = repr([(s.slot, tuple(s.param.shape), s.k) for s in sent] + [str(itype)])
    return zlib.crc32(text.encode()) % 256
