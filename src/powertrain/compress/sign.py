"""Scaled sign compression with error feedback (EF-signSGD, Karimireddy et al., ICML 2019)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from powertrain.compress.base import GatherRequest
from powertrain.compress.feedback import ErrorFeedbackCompressor, Exchange
from powertrain.ops.flat import pack_payload, unpack_payload
from powertrain.ops.quantize import pack_bits, unpack_bits


def _scaled_sign(signs: torch.Tensor, scales: torch.Tensor, chunk: int, n: int) -> torch.Tensor:
    pad = (-n) % chunk
    s = torch.nn.functional.pad(signs.float() * 2 - 1, (0, pad)).view(-1, chunk)
    return (s * scales[:, None]).view(-1)[:n]


class SignCompressor(ErrorFeedbackCompressor):
    """Send ``sign(x)`` (1 bit per value) and ``mean(|x|)`` per chunk of ``x = gradient + error``.

    The message decodes to ``mean(|x_c|) * sign(x_c)`` for each chunk ``c``, the scaled sign of
    EF-signSGD; the error buffer keeps the rest. Signs and scales travel in one all-gather.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        chunk: int = 4096,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 8:
            raise ValueError(f"Invalid chunk={chunk!r}: must be an integer >= 8")
        super().__init__(params, group=group)
        self.chunk = chunk

    def _exchange(self, x: torch.Tensor) -> Exchange:
        n = x.numel()
        x_c = torch.nn.functional.pad(x, (0, (-n) % self.chunk)).view(-1, self.chunk)
        counts = torch.full((x_c.shape[0],), float(self.chunk), device=x.device)
        if n % self.chunk:
            counts[-1] = n % self.chunk
        scales = x_c.abs().sum(dim=1) / counts
        signs = x >= 0
        packed = pack_bits(signs)
        gathered = yield GatherRequest(pack_payload([scales, packed]))
        assert gathered is not None, "a gather returns the gathered payloads"
        mean = torch.zeros_like(x)
        for row in gathered:
            s, b = unpack_payload(row, [(torch.float32, scales.numel()), (torch.uint8, packed.numel())])
            mean.add_(_scaled_sign(unpack_bits(b, n), s, self.chunk, n))
        mean.div_(gathered.shape[0])
        return _scaled_sign(signs, scales, self.chunk, n), mean
