"""PowerSGD's passes over the gradients that elementwise fusion cannot remove, as two Triton kernels.

The paper variant reads each ``n x m`` matrix ``M = gradient + residual`` four times once the sum is formed: the first
product ``M Q``, the second ``M^T P``, the approximation ``P Q^T`` written, and the new residual ``M - P Q^T`` (read
``M`` and the approximation, write ``M``). Two kernels take two of those passes away:

* :func:`sum_project`: each program loads a block of rows of the gradient and the residual, adds them, stores the sum
  and its extremes and multiplies it by ``Q`` (the rank within one tile): the sum, its check and the first product
  read every entry once (3 passes where they took 4);
* :func:`approx_residual`: ``P Q^T`` computed a tile at a time and written twice, as the approximation and, subtracted
  from ``M``, as the new residual (3 passes where they took 4).

Each has an eager twin (the same results up to the order of a product's sums), which runs unless
``POWERTRAIN_FUSED=1`` asks for the kernels (not yet by default on CUDA: :func:`usable`), and also then without
Triton, on the CPU (unless ``TRITON_INTERPRET=1``, Triton's interpreter, which the tests use), or for dtypes other
than float32. The sum is the eager one to the bit (one IEEE addition in float32 per entry, the gradient rounded to
float32 first); the products are exact-IEEE float32 dot products (``input_precision="ieee"``: no TF32), in another
order than a BLAS's.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from typing import Any

import torch

from powertrain.ops import fused
from powertrain.ops.lowrank import add_owed, low_rank

__all__ = ["approx_residual", "approx_residual_eager", "sum_project", "sum_project_eager", "usable"]


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton kernels run for float tensors of ``dtype`` on ``device``: asked for (``POWERTRAIN_FUSED=1``;
    not by ``auto`` until ``make gpu-check`` has timed them: they move fewer bytes, but launch once a matrix, with
    ``n / 32`` programs each), float32, Triton importable, and a CUDA device or Triton's interpreter
    (``TRITON_INTERPRET=1``)."""
    if dtype != torch.float32 or _FAILED or not fused.enabled(device) or not _has_triton():
        return False
    if os.environ.get("POWERTRAIN_FUSED", "auto") != "1":
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


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
    owed: torch.Tensor, g: torch.Tensor, e: torch.Tensor | None, q: torch.Tensor, p: torch.Tensor
) -> torch.Tensor:
    """``owed <- g + e`` (``g`` rounded to ``owed``'s dtype first; ``e`` None: ``g`` alone), ``p <- owed @ q``; returns
    the (min, max) of ``owed``."""
    if e is None:
        owed.copy_(g)
    else:
        add_owed(owed, g, e)
    torch.mm(owed, q, out=p)
    return torch.stack(torch.aminmax(owed))


def sum_project(
    owed: torch.Tensor, g: torch.Tensor, e: torch.Tensor | None, q: torch.Tensor, p: torch.Tensor
) -> torch.Tensor:
    """:func:`sum_project_eager` in one pass over ``g`` and ``e`` (``owed``, an ``n x m`` float32 matrix, and ``p``,
    ``n x r``, each with rows of adjacent entries, written once). The extremes of a sum holding a NaN are (-inf, inf),
    where the eager twin's are NaN: both fail a finiteness check. Call only where :func:`usable`."""
    if owed.stride(1) != 1 or p.stride(1) != 1:
        raise ValueError(f"sum_project writes rows of adjacent entries: got strides {owed.stride()} and {p.stride()}")
    n, m = owed.shape
    r = q.shape[1]
    block_n, block_k, block_r = 32, 64, max(16, _next_power_of_2(r))
    programs = -(-n // block_n)
    partial = torch.empty((programs, 2), dtype=owed.dtype, device=owed.device)
    ee = g if e is None else e  # a pointer the kernel never reads without HAS_E
    launched = _launch(
        "sum_project",
        (programs,),
        g,
        ee,
        owed,
        q,
        p,
        partial,
        n,
        m,
        r,
        g.stride(0),
        g.stride(1),
        ee.stride(0),
        ee.stride(1),
        owed.stride(0),
        q.stride(0),
        q.stride(1),
        p.stride(0),
        HAS_E=e is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_R=block_r,
    )
    if not launched:
        return sum_project_eager(owed, g, e, q, p)
    return torch.stack((partial[:, 0].amin(), partial[:, 1].amax()))


def approx_residual_eager(m_bnm: torch.Tensor, p_bnr: torch.Tensor, q_bmr: torch.Tensor) -> torch.Tensor:
    """The approximation ``P Q^T`` of each matrix of the batch, returned; ``m_bnm`` becomes the residual."""
    approx = low_rank(p_bnr, q_bmr)
    m_bnm.sub_(approx)
    return approx


def approx_residual(m_bnm: torch.Tensor, p_bnr: torch.Tensor, q_bmr: torch.Tensor) -> torch.Tensor:
    """:func:`approx_residual_eager` in one pass over ``m_bnm`` (read once, written once) that writes the approximation.
    Call only where :func:`usable`."""
    b, n, m = m_bnm.shape
    r = p_bnr.shape[2]
    approx = torch.empty_like(m_bnm)
    block_n, block_m, block_r = 32, 64, max(16, _next_power_of_2(r))
    grid = (b, -(-n // block_n), -(-m // block_m))
    if not _launch(
        "approx_residual",
        grid,
        m_bnm,
        p_bnr,
        q_bmr,
        approx,
        n,
        m,
        r,
        *m_bnm.stride(),
        *p_bnr.stride(),
        *q_bmr.stride(),
        *approx.stride(),
        BLOCK_N=block_n,
        BLOCK_M=block_m,
        BLOCK_R=block_r,
    ):
        return approx_residual_eager(m_bnm, p_bnr, q_bmr)
    return approx


def _next_power_of_2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@functools.cache
def _kernels() -> Any:
    """The kernels, compiled (or interpreted) on first use: importing this module does not import Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def sum_project_kernel(  # type: ignore[no-untyped-def]
        g_ptr,
        e_ptr,
        m_ptr,
        q_ptr,
        p_ptr,
        ext_ptr,
        n,
        m,
        r,
        sg0,
        sg1,
        se0,
        se1,
        sm0,
        sq0,
        sq1,
        sp0,
        HAS_E: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        # offsets in int64: Triton computes in int32, and a row times a stride passes 2^31 in a matrix of 2^31 entries
        rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        ranks = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
        low = tl.full((BLOCK_N, BLOCK_K), float("inf"), tl.float32)
        high = tl.full((BLOCK_N, BLOCK_K), float("-inf"), tl.float32)
        for k0 in range(0, m, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            inside = (rows[:, None] < n) & (cols[None, :] < m)
            x = tl.load(g_ptr + rows[:, None] * sg0 + cols[None, :] * sg1, mask=inside, other=0.0).to(tl.float32)
            if HAS_E:
                x = x + tl.load(e_ptr + rows[:, None] * se0 + cols[None, :] * se1, mask=inside, other=0.0)
            tl.store(m_ptr + rows[:, None] * sm0 + cols[None, :], x, mask=inside)
            nan = x != x
            low = tl.minimum(low, tl.where(inside, tl.where(nan, float("-inf"), x), float("inf")))
            high = tl.maximum(high, tl.where(inside, tl.where(nan, float("inf"), x), float("-inf")))
            qk = tl.load(
                q_ptr + cols[:, None] * sq0 + ranks[None, :] * sq1,
                mask=(cols[:, None] < m) & (ranks[None, :] < r),
                other=0.0,
            )
            acc = tl.dot(x, qk, acc, input_precision="ieee")
        tl.store(p_ptr + rows[:, None] * sp0 + ranks[None, :], acc, mask=(rows[:, None] < n) & (ranks[None, :] < r))
        tl.store(ext_ptr + tl.program_id(0) * 2, tl.min(tl.min(low, axis=1), axis=0))
        tl.store(ext_ptr + tl.program_id(0) * 2 + 1, tl.max(tl.max(high, axis=1), axis=0))

    @triton.jit
    def approx_residual_kernel(  # type: ignore[no-untyped-def]
        m_ptr,
        p_ptr,
        q_ptr,
        a_ptr,
        n,
        m,
        r,
        sm0,
        sm1,
        sm2,
        sp0,
        sp1,
        sp2,
        sq0,
        sq1,
        sq2,
        sa0,
        sa1,
        sa2,
        BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        # offsets in int64: a batch of 7B-parameter-model matrices holds more than 2^31 entries
        b = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.program_id(2).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        ranks = tl.arange(0, BLOCK_R)
        pt = tl.load(
            p_ptr + b * sp0 + rows[:, None] * sp1 + ranks[None, :] * sp2,
            mask=(rows[:, None] < n) & (ranks[None, :] < r),
            other=0.0,
        )
        qt = tl.load(
            q_ptr + b * sq0 + ranks[:, None] * sq2 + cols[None, :] * sq1,
            mask=(ranks[:, None] < r) & (cols[None, :] < m),
            other=0.0,
        )
        approx = tl.dot(pt, qt, input_precision="ieee")
        inside = (rows[:, None] < n) & (cols[None, :] < m)
        at = b * sm0 + rows[:, None] * sm1 + cols[None, :] * sm2
        x = tl.load(m_ptr + at, mask=inside, other=0.0)
        tl.store(a_ptr + b * sa0 + rows[:, None] * sa1 + cols[None, :] * sa2, approx, mask=inside)
        tl.store(m_ptr + at, x - approx, mask=inside)

    class Kernels:
        sum_project = sum_project_kernel
        approx_residual = approx_residual_kernel

    return Kernels
