"""Top-k and random-k sparsification with error feedback."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from powertrain.compress.base import GatherRequest, ReduceRequest
from powertrain.compress.feedback import ErrorFeedbackCompressor, Exchange
from powertrain.ops.flat import pack_payload, unpack_payload


def _check_ratio(ratio: float) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
        raise ValueError(f"Invalid ratio={ratio!r}: must be in (0, 1], the fraction of values sent")


def _index_dtype(numel: int) -> torch.dtype:
    """The smallest integer dtype that can address ``numel`` values (compact indices)."""
    return torch.int16 if numel <= 2**15 else torch.int32


class TopKCompressor(ErrorFeedbackCompressor):
    """Send the ``ratio * numel`` largest-magnitude values of ``x = gradient + error`` and their indices.

    Ranks choose different indices, so values and indices (int16 when a call has at most 32768 values,
    else int32) travel in one all-gather; every rank scatter-adds all messages in rank order.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        ratio: float = 0.01,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        _check_ratio(ratio)
        super().__init__(params, group=group)
        self.ratio = ratio

    def k(self, numel: int) -> int:
        return max(1, min(numel, round(self.ratio * numel))) if numel else 0

    def _exchange(self, x: torch.Tensor) -> Exchange:
        k, itype = self.k(x.numel()), _index_dtype(x.numel())
        idx = x.abs().topk(k, sorted=False).indices
        values = x[idx]
        gathered = yield GatherRequest(pack_payload([values, idx.to(itype)]))
        assert gathered is not None, "a gather returns the gathered payloads"
        mean = torch.zeros_like(x)
        for row in gathered:
            v, i = unpack_payload(row, [(torch.float32, k), (itype, k)])
            mean.index_add_(0, i.long(), v)
        mean.div_(gathered.shape[0])
        sent = torch.zeros_like(x).index_copy_(0, idx, values)
        return sent, mean


class RandomKCompressor(ErrorFeedbackCompressor):
    """Send ``ratio * numel`` values of ``x = gradient + error`` at random positions shared by all ranks.

    Every rank draws the same positions from a generator seeded identically, so no indices are sent at
    all: one all-reduce of ``k`` values. The generator's state is part of the compressor's state.
    """

    _shared_randomness = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        ratio: float = 0.01,
        group: dist.ProcessGroup | None = None,
        seed: int = 0,
    ) -> None:
        _check_ratio(ratio)
        super().__init__(params, group=group, seed=seed)
        self.ratio = ratio

    def k(self, numel: int) -> int:
        return max(1, min(numel, round(self.ratio * numel))) if numel else 0

    def _exchange(self, x: torch.Tensor) -> Exchange:
        idx = torch.randperm(x.numel(), generator=self._generator)[: self.k(x.numel())].to(x.device)
        values = x[idx]
        yield ReduceRequest(values, "mean")
        mean = torch.zeros_like(x).index_copy_(0, idx, values)
        sent = torch.zeros_like(x).index_copy_(0, idx, x[idx])
        return sent, mean
