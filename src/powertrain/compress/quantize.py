"""int8 / int4 quantisation with per-chunk scales, stochastic rounding and error feedback (or LoCo)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from powertrain._checks import check_int
from powertrain.compress.base import GatherRequest
from powertrain.compress.feedback import (
    ErrorFeedbackCompressor,
    Exchange,
    chunk_lengths,
    real_views,
    repad,
    unpad,
)
from powertrain.ops import fused
from powertrain.ops.quantize import dequantize, pack_codes, quantize, unpack_codes


class QuantizedCompressor(ErrorFeedbackCompressor):
    """Send ``x = gradient + error`` as ``bits``-bit integers with one float32 scale per ``chunk`` values.

    Chunks start at every parameter (a chunk never mixes two tensors' magnitudes). Each rank's codes and
    scales travel in one all-gather (a sum of differently scaled integers is not a quantised number), and
    every rank dequantises and averages all messages in rank order, so all ranks get the same result.
    Payload per rank: about ``numel * bits / 8 + 4 * numel / chunk`` bytes.

    Error handling:

    * ``loco_beta=0`` (default): classic error feedback, ``e <- x - deq(q(x))``; lossless in the sum.
    * ``loco_beta > 0``: LoCo's moving-average compensation (Xie et al., "LoCo: Low-Bit Communication
      Adaptor for Large-scale Model Training"): ``e <- beta * e + (1 - beta) * (x - deq(q(x)))``, stored in
      ``error_dtype`` (bf16 by default for LoCo) and reset to zero every ``loco_reset_every`` steps. This
      damps the error instead of conserving it, by design.

    Args:
        params: ``model.parameters()`` or ``model.named_parameters()``.
        bits: 8 or 4.
        chunk: values per scale (>= 8).
        stochastic: unbiased stochastic rounding (each rank its own random stream) instead of nearest.
        loco_beta: LoCo's ``beta`` in [0, 1) (see above); 0, the default, is classic error feedback.
        group: process group to average over (``None``, the default: the default group).
        seed: seed of the stochastic rounding's random streams (one per rank, parameter and step); default 0.
    """

    reduce_scatter = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        bits: int = 8,
        chunk: int = 1024,
        stochastic: bool = True,
        loco_beta: float = 0.0,
        loco_reset_every: int = 512,
        error_dtype: torch.dtype | None = None,
        group: dist.ProcessGroup | None = None,
        seed: int = 0,
    ) -> None:
        if bits not in (4, 8):
            raise ValueError(f"Invalid bits={bits!r}: must be 4 or 8")
        check_int("chunk", chunk, 8)
        if not isinstance(stochastic, bool):
            raise ValueError(f"Invalid stochastic={stochastic!r}: must be True or False")
        if isinstance(loco_beta, bool) or not isinstance(loco_beta, int | float) or not 0.0 <= loco_beta < 1.0:
            raise ValueError(f"Invalid loco_beta={loco_beta!r}: must be in [0, 1); 0 is plain error feedback")
        check_int("loco_reset_every", loco_reset_every, 1)
        if error_dtype is None:
            error_dtype = torch.bfloat16 if loco_beta > 0 else torch.float32
        super().__init__(params, group=group, seed=seed, error_dtype=error_dtype)
        fused.enabled(self.device)  # a bad POWERTRAIN_FUSED is said here, not inside a backward
        self.bits, self.chunk, self.stochastic = bits, chunk, stochastic
        self.loco_beta, self.loco_reset_every = loco_beta, loco_reset_every
        self._keeps_old = loco_beta > 0

    def settings(self) -> dict[str, Any]:
        """``bits``, ``chunk``, ``stochastic``, ``loco_beta`` and ``loco_reset_every``, plus the error buffers'
        (``error_decay``, ``error_dtype``): saved with the state, and a state saved with other settings is refused at
        load."""
        return {
            "bits": self.bits,
            "chunk": self.chunk,
            "stochastic": self.stochastic,
            "loco_beta": self.loco_beta,
            "loco_reset_every": self.loco_reset_every,
            **super().settings(),
        }

    def _exchange(self, x: torch.Tensor, parts: list[torch.Tensor], idx: list[int]) -> Exchange:
        lengths = chunk_lengths([p.numel() for p in parts], self.chunk)  # x is laid out in whole chunks (_layout_chunk)
        noise = None
        if self.stochastic:
            # drawn in place, the numbers torch.rand(n, generator=...) would return; padding (if any) gets zeros
            noise = torch.empty_like(x) if sum(lengths) == sum(p.numel() for p in parts) else torch.zeros_like(x)
            for i, view in zip(idx, real_views(noise, parts, lengths), strict=True):
                view.uniform_(generator=self._rng(i))
        codes, scales = quantize(x, self.bits, self.chunk, noise)
        real = unpad(codes, parts, lengths)  # chunks start at each parameter; their padding is not sent
        gathered = yield GatherRequest(pack_codes(real, scales, self.bits))
        assert gathered is not None, "a gather returns the gathered payloads"
        total: torch.Tensor | None = None
        sent: torch.Tensor | None = None
        for j, row in enumerate(gathered):  # same order on every rank: identical results everywhere
            c, s = unpack_codes(row, real.numel(), scales.numel(), self.bits)
            values = dequantize(repad(c, parts, lengths), s, self.chunk)
            if j == self.comm.rank:  # this rank's own codes and scales, round-tripped exactly: what it sent
                sent = values
            # the first row starts the sum (a new tensor next: the rows stay as they are)
            total = values if total is None else (total + values if j == 1 else total.add_(values))
        assert total is not None and sent is not None, "a gather returns one row per rank, this rank's too"
        return sent, total / gathered.shape[0]

    def _layout_chunk(self) -> int:
        return self.chunk

    def _new_error(self, x: torch.Tensor, sent: torch.Tensor, old: torch.Tensor | None, idx: list[int]) -> torch.Tensor:
        if old is None:  # loco_beta == 0
            return x - sent
        new = old.mul(self.loco_beta).add_(x - sent, alpha=1 - self.loco_beta)
        if idx and (self._steps[idx[0]] + 1) % self.loco_reset_every == 0:
            new.zero_()  # periodic reset: a damped error that lingers too long only adds bias
        return new
