"""PowerSGD's first pass over the gradients as one Triton kernel.

The paper variant keeps each ``n x m`` matrix ``M = gradient + residual`` whole after a step, with the factors of the
approximation it sent, so that the residual ``M - P Q^T`` is never written out (:mod:`powertrain.compress.powersgd`):
the next step forms its ``M`` from the gradient, the kept ``M`` and those factors. :func:`sum_project` does that and
the first product in one pass: each program loads a block of rows of the gradient and the kept ``M``, subtracts
``P Q^T`` computed a tile at a time, adds, stores the sum and its extremes, and multiplies it by the new ``Q`` (the
rank within one tile). Each entry is read once and written once (3 passes where the eager twin takes 7 with the
residual formed, and the extremes' check one more).

The eager twin (the same results up to the order of the products' sums) runs unless ``POWERTRAIN_FUSED=1`` asks for
the kernel (not yet by default on CUDA: :func:`usable`), and also then without Triton, on the CPU (unless
``TRITON_INTERPRET=1``, Triton's interpreter, which the tests use), or for dtypes other than float32. Without a kept
``M`` the sum is the eager one to the bit (one IEEE addition in float32 per entry, the gradient rounded to float32
first); the products are exact-IEEE float32 dot products (``input_precision="ieee"``: no TF32), in another order than
a BLAS's.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from typing import Any

import torch

from powertrain.ops import fused
from powertrain.ops.lowrank import add_owed

__all__ = ["sum_project", "sum_project_eager", "usable"]


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton kernel runs for float tensors of ``dtype`` on ``device``: asked for (``POWERTRAIN_FUSED=1``;
    not by ``auto`` until ``make gpu-check`` has timed it: it moves fewer bytes, but launches once a matrix, with
    ``n / 32`` programs), float32, Triton importable, and a CUDA device whose float32 matrix products run without TF32
    or Triton's interpreter (``TRITON_INTERPRET=1``)."""
    if dtype != torch.float32 or _FAILED or not fused.enabled(device) or not _has_triton():
        return False
    if os.environ.get("POWERTRAIN_FUSED", "auto") != "1":
        return False
    if device.type == "cuda":
        # its P Q^T is exact float32; with TF32 on, the approximation sent (torch's bmm) is not, and error feedback
        # must subtract the same product it sent
        return torch.backends.cuda.matmul.fp32_precision != "tf32"  # also set by allow_tf32 and "high" precision
    return os.environ.get("TRITON_INTERPRET") == "1"


_FAILED: list[str] = []  # a kernel that did not compile or launch: the eager twins from then on


def _launch(name: str, grid: tuple[int, ...], *args: Any, **meta: Any) -> bool:
    """Launch the kernel ``name``; False (warned once, and :func:`usable` False from then on) if it cannot compile or
    run, so that the caller runs the eager twin instead (at once, for the rest of the call, once one has failed)."""
    if _FAILED:
        return False
    try:
        getattr(_kernels(), name)[grid](*args, **meta)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # no compiler for this GPU, a Triton that does not match: the eager twin
        _FAILED.append(name)
        warnings.warn(
            f"powertrain: Triton kernel {name} did not run ({type(e).__name__}: {e}); eager now", stacklevel=3
        )
        return False
    return True


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def sum_project_eager(
    owed: torch.Tensor,
    g: torch.Tensor,
    e: torch.Tensor | None,
    kept: tuple[torch.Tensor, torch.Tensor] | None,
    q: torch.Tensor,
    p: torch.Tensor,
) -> torch.Tensor:
    """``owed <- g + (e - P_k Q_k^T)`` with ``kept = (P_k, Q_k)`` (``g`` rounded to ``owed``'s dtype first; ``kept``
    None: ``g + e``; ``e`` None: ``g`` alone), ``p <- owed @ q``; returns the (min, max) of ``owed``."""
    if e is None:
        owed.copy_(g)
    else:
        add_owed(owed, g, e, *(kept or ()))
    torch.mm(owed, q, out=p)
    return torch.stack(torch.aminmax(owed))


def sum_project(
    owed: torch.Tensor,
    g: torch.Tensor,
    e: torch.Tensor | None,
    kept: tuple[torch.Tensor, torch.Tensor] | None,
    q: torch.Tensor,
    p: torch.Tensor,
) -> torch.Tensor:
    """:func:`sum_project_eager` in one pass over ``g`` and ``e`` (``owed``, an ``n x m`` float32 matrix, and ``p``,
    ``n x r``, each with rows of adjacent entries, written once). The extremes of a sum holding a NaN are (-inf, inf),
    where the eager twin's are NaN: both fail a finiteness check. Call only where :func:`usable`."""
    if owed.stride(1) != 1 or p.stride(1) != 1:
        raise ValueError(f"sum_project writes rows of adjacent entries: got strides {owed.stride()} and {p.stride()}")
    n, m = owed.shape
    r = q.shape[1]
    kr = 1 if kept is None else kept[0].shape[1]
    block_n, block_k = 32, 64
    programs = -(-n // block_n)
    partial = torch.empty((programs, 2), dtype=owed.dtype, device=owed.device)
    ee = g if e is None else e  # pointers the kernel never reads without HAS_E and HAS_KEPT
    pk, qk = (p, q) if kept is None else kept
    launched = _launch(
        "sum_project",
        (programs,),
        g,
        ee,
        pk,
        qk,
        owed,
        q,
        p,
        partial,
        n,
        m,
        r,
        kr,
        *g.stride(),
        *ee.stride(),
        *pk.stride(),
        *qk.stride(),
        owed.stride(0),
        *q.stride(),
        p.stride(0),
        HAS_E=e is not None,
        HAS_KEPT=e is not None and kept is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_R=_block_r(r),
        BLOCK_KR=_block_r(kr),
    )
    if not launched:
        return sum_project_eager(owed, g, e, kept, q, p)
    return torch.stack((partial[:, 0].amin(), partial[:, 1].amax()))


def _block_r(r: int) -> int:
    """The rank's tile: a power of two, at least 16 (``tl.dot``'s smallest)."""
    return max(16, 1 << max(0, (r - 1).bit_length()))


@functools.cache
def _kernels() -> Any:
    """The kernels, compiled (or interpreted) on first use: importing this module does not import Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def sum_project_kernel(  # type: ignore[no-untyped-def]
        g_ptr,
        e_ptr,
        pk_ptr,
        qk_ptr,
        m_ptr,
        q_ptr,
        p_ptr,
        ext_ptr,
        n,
        m,
        r,
        kr,
        sg0,
        sg1,
        se0,
        se1,
        spk0,
        spk1,
        sqk0,
        sqk1,
        sm0,
        sq0,
        sq1,
        sp0,
        HAS_E: tl.constexpr,
        HAS_KEPT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_KR: tl.constexpr,
    ):
        # offsets in int64: Triton computes in int32, and a row times a stride passes 2^31 in a matrix of 2^31 entries
        rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        ranks = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
        low = tl.full((BLOCK_N, BLOCK_K), float("inf"), tl.float32)
        high = tl.full((BLOCK_N, BLOCK_K), float("-inf"), tl.float32)
        if HAS_KEPT:  # this block's rows of the kept P, loaded once
            kranks = tl.arange(0, BLOCK_KR)
            pk = tl.load(
                pk_ptr + rows[:, None] * spk0 + kranks[None, :] * spk1,
                mask=(rows[:, None] < n) & (kranks[None, :] < kr),
                other=0.0,
            )
        for k0 in range(0, m, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            inside = (rows[:, None] < n) & (cols[None, :] < m)
            x = tl.load(g_ptr + rows[:, None] * sg0 + cols[None, :] * sg1, mask=inside, other=0.0).to(tl.float32)
            if HAS_E:
                e = tl.load(e_ptr + rows[:, None] * se0 + cols[None, :] * se1, mask=inside, other=0.0)
                if HAS_KEPT:  # the residual, e - P Q^T, formed here rather than written out last step
                    qkt = tl.load(
                        qk_ptr + kranks[:, None] * sqk1 + cols[None, :] * sqk0,
                        mask=(kranks[:, None] < kr) & (cols[None, :] < m),
                        other=0.0,
                    )
                    e = e - tl.dot(pk, qkt, input_precision="ieee")
                x = x + e
            tl.store(m_ptr + rows[:, None] * sm0 + cols[None, :], x, mask=inside)
            nan = x != x
            low = tl.minimum(low, tl.where(inside, tl.where(nan, float("-inf"), x), float("inf")))
            high = tl.maximum(high, tl.where(inside, tl.where(nan, float("inf"), x), float("-inf")))
            qt = tl.load(
                q_ptr + cols[:, None] * sq0 + ranks[None, :] * sq1,
                mask=(cols[:, None] < m) & (ranks[None, :] < r),
                other=0.0,
            )
            acc = tl.dot(x, qt, acc, input_precision="ieee")
        tl.store(p_ptr + rows[:, None] * sp0 + ranks[None, :], acc, mask=(rows[:, None] < n) & (ranks[None, :] < r))
        tl.store(ext_ptr + tl.program_id(0) * 2, tl.min(tl.min(low, axis=1), axis=0))
        tl.store(ext_ptr + tl.program_id(0) * 2 + 1, tl.max(tl.max(high, axis=1), axis=0))

    class Kernels:
        sum_project = sum_project_kernel

    return Kernels
