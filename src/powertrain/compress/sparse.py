"""Top-k and random-k sparsification with error feedback, per parameter."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from powertrain.compress.base import GatherRequest, ReduceRequest
from powertrain.compress.feedback import ErrorFeedbackCompressor, Exchange
from powertrain.ops.flat import index_dtype, pack_payload, unpack_payload
from powertrain.ops.quantize import pack_2bit, unpack_2bit


def _check_ratio(ratio: float) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
        raise ValueError(f"Invalid ratio={ratio!r}: must be in (0, 1], the fraction of values sent")


def _k(ratio: float, numel: int) -> int:
    return max(1, min(numel, round(ratio * numel))) if numel else 0


class TopKCompressor(ErrorFeedbackCompressor):
    """Send each parameter's ``ratio * numel`` largest-magnitude values of ``x = gradient + error_decay * error``.

    Ranks choose different positions, so values and positions (within each parameter; int16 when every
    parameter of the call has at most 32768 values, else int32) travel in one all-gather; every rank
    scatter-adds all messages in rank order.

    ``bits=2`` sends each value as a 2-bit code, one of ``(-1, -1/3, 1/3, 1)`` times its parameter's largest chosen
    magnitude (one float32 scale per parameter), rounded to the nearest: what the rounding loses stays in the error
    buffer like what was not chosen. With ``error_decay`` below 1 this is SparseLoCo's outer step (Sarfi et al.,
    arXiv 2508.15706: top-k at 1-3% and 2-bit values, the decayed accumulator in place of outer momentum).

    Args:
        params: ``model.parameters()`` or ``model.named_parameters()``.
        ratio: the fraction of each parameter's values sent, in (0, 1] (at least one); default 0.01.
        bits: 32 (float32 values, the default) or 2 (2-bit codes and a scale, see above).
        error_decay: ``beta`` of ``x = gradient + beta * error``, in (0, 1]; 1 (the default) loses nothing.
        group: process group to average over (``None``, the default: the default group).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        ratio: float = 0.01,
        bits: int = 32,
        error_decay: float = 1.0,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        _check_ratio(ratio)
        if bits not in (32, 2):
            raise ValueError(f"Invalid bits={bits!r}: 32 (float32 values) or 2 (2-bit codes and a scale)")
        super().__init__(params, group=group, error_decay=error_decay)
        self.ratio, self.bits = ratio, bits

    def settings(self) -> dict[str, Any]:
        """``ratio`` and ``bits`` plus the error buffers' settings (``error_decay``, ``error_dtype``): saved with the
        state, and a state saved with other settings is refused at load."""
        return {"ratio": self.ratio, "bits": self.bits, **super().settings()}

    def _exchange(self, x: torch.Tensor, parts: list[torch.Tensor], idx: list[int]) -> Exchange:
        ks = [_k(self.ratio, p.numel()) for p in parts]
        itype = index_dtype(max((p.numel() for p in parts), default=0))
        picked = [p.abs().topk(k, sorted=False).indices for p, k in zip(parts, ks, strict=True)]
        if not parts:  # an empty call still takes part in the gather (every rank issues the same collectives)
            parts, ks = [torch.zeros(0, device=self.device)], [0]
            picked = [torch.zeros(0, dtype=torch.long, device=self.device)]
        values = torch.cat([p[i] for p, i in zip(parts, picked, strict=True)])
        positions = torch.cat(picked).to(itype)
        if self.bits == 2:
            chosen = zip(values.split(ks), ks, strict=True)
            scales = torch.stack([v.abs().amax() if k else v.new_zeros(()) for v, k in chosen])
            each = torch.repeat_interleave(scales, torch.tensor(ks, device=scales.device), output_size=values.numel())
            codes = (values / torch.where(each > 0, each, 1.0) * 1.5 + 1.5).round_().clamp_(0, 3).to(torch.uint8)
            values = _decoded(codes, each)  # what every rank decodes: the own message included
            message = [scales, positions, pack_2bit(codes)]
        else:
            message = [values, positions]
        gathered = yield GatherRequest(pack_payload(message))
        assert gathered is not None, "a gather returns the gathered payloads"
        # each pick's parameter offset in the flat vector, filled on the device (no copy from the host)
        starts = [sum(p.numel() for p in parts[:j]) for j in range(len(parts))]
        device = values.device
        base = torch.cat(
            [torch.full((k,), start, dtype=torch.long, device=device) for start, k in zip(starts, ks, strict=True)]
        )
        n = sum(p.numel() for p in parts)
        mean = torch.zeros(n, device=values.device)
        for row in gathered:
            if self.bits == 2:
                specs = [(torch.float32, len(ks)), (itype, values.numel()), (torch.uint8, -(-values.numel() // 4))]
                s, i, packed = unpack_payload(row, specs)
                each = torch.repeat_interleave(s, torch.tensor(ks, device=s.device), output_size=values.numel())
                v = _decoded(unpack_2bit(packed, values.numel()), each)
            else:
                v, i = unpack_payload(row, [(torch.float32, values.numel()), (itype, values.numel())])
            mean.index_add_(0, base + i.long(), v)
        mean.div_(gathered.shape[0])
        sent = torch.zeros(n, device=values.device).index_copy_(0, base + positions.long(), values)
        return sent, mean


def _decoded(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """2-bit codes ``0..3`` as the values ``(-1, -1/3, 1/3, 1) x scale``."""
    return (codes.float() * 2 - 3) / 3 * scale


class RandomKCompressor(ErrorFeedbackCompressor):
    """Send ``ratio * numel`` values of each parameter's ``x = gradient + error`` at random positions that
    every rank draws identically (same seed, parameter and step), so no positions are sent: one all-reduce
    of the values.

    Args:
        params: ``model.parameters()`` or ``model.named_parameters()``.
        ratio: the fraction of each parameter's values sent, in (0, 1] (at least one); default 0.01.
        group: process group to average over (``None``, the default: the default group).
        seed: seed of the positions drawn (the same on every rank); default 0.
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

    def settings(self) -> dict[str, Any]:
        """``ratio`` plus the error buffers' settings (``error_decay``, ``error_dtype``): saved with the state, and a
        state saved with other settings is refused at load."""
        return {"ratio": self.ratio, **super().settings()}

    def _exchange(self, x: torch.Tensor, parts: list[torch.Tensor], idx: list[int]) -> Exchange:
        offset, picks = 0, []
        for p, i in zip(parts, idx, strict=True):
            k = _k(self.ratio, p.numel())
            picks.append(torch.randperm(p.numel(), generator=self._rng(i), device=self.device)[:k] + offset)
            offset += p.numel()
        pos = torch.cat(picks) if picks else torch.zeros(0, dtype=torch.long, device=self.device)
        values = x[pos]
        yield ReduceRequest(values, "mean")
        mean = torch.zeros_like(x).index_copy_(0, pos, values)
        sent = torch.zeros_like(x).index_copy_(0, pos, x[pos])
        return sent, mean
