"""Scaled sign compression with error feedback (EF-signSGD, Karimireddy et al., ICML 2019)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from powertrain._checks import check_int
from powertrain.compress.base import GatherRequest
from powertrain.compress.feedback import ErrorFeedbackCompressor, Exchange, chunk_lengths, repad, unpad
from powertrain.ops.flat import pack_payload, unpack_payload
from powertrain.ops.quantize import pack_bits, unpack_bits


class SignCompressor(ErrorFeedbackCompressor):
    """Send ``sign(x)`` (1 bit per value) and ``mean(|x|)`` per chunk of ``x = gradient + error``.

    Chunks start at every parameter. The message decodes to ``mean(|x_c|) * sign(x_c)`` for each chunk
    ``c``, the scaled sign of EF-signSGD; the error buffer keeps the rest. Signs and scales travel in one
    all-gather.

    Args:
        params: ``model.parameters()`` or ``model.named_parameters()``.
        chunk: values per scale (>= 8); default 4096.
        group: process group to average over (``None``, the default: the default group).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        chunk: int = 4096,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        check_int("chunk", chunk, 8)
        super().__init__(params, group=group)
        self.chunk = chunk

    def settings(self) -> dict[str, Any]:
        """``chunk`` plus the error buffers' settings (``error_decay``, ``error_dtype``): saved with the state, and a
        state saved with other settings is refused at load."""
        return {"chunk": self.chunk, **super().settings()}

    def _exchange(self, x: torch.Tensor, parts: list[torch.Tensor], idx: list[int]) -> Exchange:
        lengths = chunk_lengths([p.numel() for p in parts], self.chunk)  # x is laid out in whole chunks (_layout_chunk)
        real = torch.zeros_like(x)
        for p, view in zip(parts, real.split(lengths), strict=True):
            view[: p.numel()] = 1.0
        x_c = x.view(-1, self.chunk)
        scales = x_c.abs().sum(dim=1) / real.view(-1, self.chunk).sum(dim=1).clamp_(min=1)
        signs = x >= 0
        n_real = sum(p.numel() for p in parts)
        packed = pack_bits(unpad(signs, parts, lengths))  # padding is not sent
        gathered = yield GatherRequest(pack_payload([scales, packed]))
        assert gathered is not None, "a gather returns the gathered payloads"
        decode = lambda b, s: ((b.float() * 2 - 1).view(-1, self.chunk) * s[:, None]).view(-1) * real
        mean = torch.zeros_like(x)
        for row in gathered:
            s, b = unpack_payload(row, [(torch.float32, scales.numel()), (torch.uint8, packed.numel())])
            mean.add_(decode(repad(unpack_bits(b, n_real), parts, lengths), s))
        mean.div_(gathered.shape[0])
        return decode(signs, scales), mean

    def _layout_chunk(self) -> int:
        return self.chunk
