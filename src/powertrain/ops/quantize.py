"""Low-bit quantisation with per-chunk scales, and bit packing.

``x`` (flat) is cut into chunks of ``chunk`` elements; each chunk gets the scale ``absmax / qmax`` and
integer codes in ``[-qmax, qmax]`` (``qmax`` = 127 for 8 bits, 7 for 4 bits), rounded stochastically
(unbiased: ``E[deq(q(x))] = x``) when uniform ``noise`` in [0, 1) is given, to nearest otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

from powertrain.ops import fused as fusion
from powertrain.ops.flat import pack_payload, unpack_payload

__all__ = [
    "dequantize",
    "pack_2bit",
    "pack_bits",
    "pack_codes",
    "pack_int4",
    "quantize",
    "unpack_2bit",
    "unpack_bits",
    "unpack_codes",
    "unpack_int4",
]


def _chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    pad = (-x.numel()) % chunk
    # a view when no padding is needed (the compressors pad each parameter to whole chunks): F.pad copies even then
    return (torch.nn.functional.pad(x, (0, pad)) if pad else x).reshape(-1, chunk)


def quantize(
    x: torch.Tensor, bits: int, chunk: int, noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int8, ``x.numel()``) and per-chunk float32 scales of a flat float tensor.

    ``noise`` (same size as ``x``, uniform in [0, 1)) selects stochastic rounding.
    """
    assert bits in (4, 8), f"bits must be 4 or 8, got {bits}"
    qmax = 2 ** (bits - 1) - 1
    x_c = _chunks(x.float(), chunk)
    lo, hi = torch.aminmax(x_c, dim=1)  # the largest magnitude in one pass, no |x| temporary; + 0: never -0
    scales = torch.maximum(hi, lo.neg()).add_(0.0).div_(qmax)
    divisor = torch.where(scales > 0, scales, 1.0)[:, None]
    noise_c = None if noise is None else _chunks(noise.to(x_c.device, torch.float32), chunk)
    codes = rounded_codes(x_c, divisor, noise_c, qmax).view(-1)[: x.numel()]
    return codes, scales


def _rounded_eager(x_c: torch.Tensor, divisor: torch.Tensor, noise_c: torch.Tensor | None, qmax: int) -> torch.Tensor:
    # noise + x / scale in one temporary instead of two (the same two roundings)
    y = torch.div(x_c, divisor).round_() if noise_c is None else torch.addcdiv(noise_c, x_c, divisor).floor_()
    return y.clamp_(-qmax, qmax).to(torch.int8)


def _rounded_pure(
    x_c: torch.Tensor, divisor: torch.Tensor, noise_c: torch.Tensor | None, qmax: torch.Tensor
) -> torch.Tensor:
    """:func:`_rounded_eager`'s operations without in-place ones, for finite values: what torch.compile fuses into one
    kernel (reads ``x`` and the noise, writes the int8 codes: 2.25 passes over float32 values, against 8.25 eager).
    Clamped again as integers: the compiled code assumes finite math, and a NaN's code must still be in range (an
    int4 code out of range would spill into its neighbour's half of a byte). ``qmax``: a 0-dim tensor, so that int8
    and int4 share one compilation."""
    y = torch.round(x_c / divisor) if noise_c is None else torch.floor(torch.addcdiv(noise_c, x_c, divisor))
    return torch.clamp(y, -qmax, qmax).to(torch.int32).clamp(-qmax, qmax).to(torch.int8)


def _rounded_fallback(
    x_c: torch.Tensor, divisor: torch.Tensor, noise_c: torch.Tensor | None, qmax: torch.Tensor
) -> Any:
    return _rounded_eager(x_c, divisor, noise_c, int(qmax))  # once, where the fused kernel failed to compile


def rounded_codes(x_c: torch.Tensor, divisor: torch.Tensor, noise_c: torch.Tensor | None, qmax: int) -> torch.Tensor:
    """The int8 codes of chunks ``x_c`` (divided by their ``divisor``, stochastically rounded with ``noise_c`` or to
    nearest, clamped to ``qmax``): one fused kernel where ``powertrain.ops.fused.enabled`` says so, else eager
    (the same values: the same operations in the same order)."""
    if x_c.shape[0] <= 1:  # one chunk (or none): nothing to gain, and a compilation of its own (sizes 0 and 1 are
        return _rounded_eager(x_c, divisor, noise_c, qmax)  # specialised) towards the recompilation limit
    fused = fusion.fused_or_eager("rounded_codes", _rounded_pure, _rounded_fallback, x_c.device)
    if fused is _rounded_fallback:
        return _rounded_eager(x_c, divisor, noise_c, qmax)
    return fused(x_c, divisor, noise_c, torch.full((), qmax, dtype=torch.int32, device=x_c.device))


def dequantize(codes: torch.Tensor, scales: torch.Tensor, chunk: int) -> torch.Tensor:
    n = codes.numel()
    # int8 times float32 is computed in float32 (the codes converted exactly): one pass, no float copy of the codes
    return torch.mul(_chunks(codes, chunk), scales[:, None]).view(-1)[:n]


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes in ``[-7, 7]`` per byte (``ceil(n / 2)`` bytes)."""
    c = (codes.to(torch.int16) + 8).to(torch.uint8)
    if c.numel() % 2:
        c = torch.cat([c, c.new_full((1,), 8)])
    c = c.view(-1, 2)
    return c[:, 0] | (c[:, 1] << 4)


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    lo, hi = packed & 0x0F, packed >> 4
    return (torch.stack([lo, hi], dim=1).view(-1)[:n].to(torch.int16) - 8).to(torch.int8)


def pack_codes(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """One uint8 message of :func:`quantize`'s output: the float32 scales, then the codes (int8 as bytes, int4
    two to a byte)."""
    packed = codes.view(torch.uint8) if bits == 8 else pack_int4(codes)
    return pack_payload([scales, packed])


def unpack_codes(message: torch.Tensor, n: int, n_scales: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of a :func:`pack_codes` message holding ``n`` codes and ``n_scales`` scales."""
    scales, packed = unpack_payload(message, [(torch.float32, n_scales), (torch.uint8, n if bits == 8 else -(-n // 2))])
    return (packed.view(torch.int8) if bits == 8 else unpack_int4(packed, n)), scales


def pack_2bit(codes: torch.Tensor) -> torch.Tensor:
    """Four 2-bit codes in ``[0, 3]`` per byte (``ceil(n / 4)`` bytes), the first in the lowest bits."""
    c = torch.nn.functional.pad(codes.to(torch.uint8), (0, (-codes.numel()) % 4)).view(-1, 4)
    return c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)


def unpack_2bit(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` codes of :func:`pack_2bit` (uint8)."""
    return torch.stack([(packed >> shift) & 3 for shift in (0, 2, 4, 6)], dim=1).view(-1)[:n]


def _weights(device: torch.device) -> torch.Tensor:
    """The bits' values in a byte, most significant first (128, 64, ..., 1), made on ``device``: a constant copied
    from the CPU would make the host wait on CUDA."""
    return torch.arange(7, -1, -1, device=device, dtype=torch.float32).exp2_().to(torch.uint8)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Booleans, 8 per byte (``ceil(n / 8)`` bytes)."""
    b = torch.nn.functional.pad(bits.to(torch.uint8), (0, (-bits.numel()) % 8)).view(-1, 8)
    return (b * _weights(b.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    return ((packed[:, None] & _weights(packed.device)) != 0).view(-1)[:n]
