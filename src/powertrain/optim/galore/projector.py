"""GaLore's math: which side of a gradient matrix is projected, the subspace (exact or randomized SVD),
projecting and projecting back, and carrying Adam's moments into a new subspace.

Shapes use suffixes: ``g_mn`` is an ``m x n`` gradient matrix, ``left_mr`` its top-``r`` left singular
vectors (columns), ``right_rn`` its top-``r`` right singular vectors (rows, as ``Vh[:r]``), the layout the
reference ``galore-torch`` uses, so that every product here is the same product it computes.

Sides (``proj_type`` of the reference, resolved per shape by :func:`projection_side`):

* ``right``: ``low = G V_r`` (``m x r``), back ``low V_r^T``;
* ``left``: ``low = U_r^T G`` (``r x n``), back ``U_r low``;
* ``full``: ``low = U_r^T G V_r`` (``r x r``), back ``U_r low V_r^T``;
* ``std``: ``right`` when ``m >= n`` else ``left`` (the projector is the smaller factor; the moments are
  ``max(m, n) x r``); ``reverse_std``: the opposite.

Nothing in here knows about process groups: the randomized SVD of a row-sharded matrix takes a
``sum_shards`` callback that sums a list of tensors over the shards (identity in one process).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal

import torch

__all__ = [
    "PROJ_TYPES",
    "SVD_METHODS",
    "ProjType",
    "Side",
    "Sketch",
    "SvdMethod",
    "carry_moments",
    "effective_rank",
    "exact_bases",
    "project",
    "project_back",
    "projection_side",
    "randomized_right_bases",
    "sketch_seed",
]

ProjType = Literal["std", "reverse_std", "left", "right", "full"]
SvdMethod = Literal["randomized", "exact"]
Side = Literal["left", "right", "full"]
PROJ_TYPES: tuple[str, ...] = ("std", "reverse_std", "left", "right", "full")
SVD_METHODS: tuple[str, ...] = ("randomized", "exact")


def projection_side(rows: int, cols: int, proj_type: ProjType) -> Side:
    """The side an ``rows x cols`` gradient is projected on under ``proj_type`` (as the reference decides)."""
    match proj_type:
        case "std":
            return "right" if rows >= cols else "left"
        case "reverse_std":
            return "left" if rows >= cols else "right"
        case "left" | "right" | "full":
            return proj_type
    raise ValueError(f"Invalid proj_type={proj_type!r}: choose one of {', '.join(PROJ_TYPES)}")


def effective_rank(rank: int, rows: int, cols: int) -> int:
    """The number of singular vectors kept: ``rank`` capped by the matrix (the reference's ``U[:, :rank]``)."""
    return max(0, min(rank, rows, cols))


def project(
    g_mn: torch.Tensor, side: Side, left_mr: torch.Tensor | None, right_rn: torch.Tensor | None
) -> torch.Tensor:
    """The low-rank gradient: ``G V_r`` (right), ``U_r^T G`` (left) or ``U_r^T G V_r`` (full)."""
    match side:
        case "right":
            assert right_rn is not None, "right projection needs right_rn"
            return torch.matmul(g_mn, right_rn.t())
        case "left":
            assert left_mr is not None, "left projection needs left_mr"
            return torch.matmul(left_mr.t(), g_mn)
        case "full":
            assert left_mr is not None and right_rn is not None, "full projection needs both bases"
            return torch.matmul(left_mr.t(), g_mn) @ right_rn.t()


def project_back(
    low: torch.Tensor, side: Side, left_mr: torch.Tensor | None, right_rn: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``scale`` times the full-size matrix of a low-rank one (the inverse map of :func:`project`).

    The side comes from the caller (it was fixed when the basis was computed), not from ``low``'s shape as
    in the reference, whose ``reverse_std`` back-projection picks the wrong product when ``rank >= min(m, n)``.
    """
    match side:
        case "right":
            assert right_rn is not None, "right projection needs right_rn"
            full = torch.matmul(low, right_rn)
        case "left":
            assert left_mr is not None, "left projection needs left_mr"
            full = torch.matmul(left_mr, low)
        case "full":
            assert left_mr is not None and right_rn is not None, "full projection needs both bases"
            full = torch.matmul(left_mr, low) @ right_rn
    return full * scale


def exact_bases(g_mn: torch.Tensor, rank: int, side: Side) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(U_r, Vh_r)`` of ``torch.linalg.svd`` of ``g_mn`` (computed in float32, returned in ``g_mn``'s dtype);
    only the factors ``side`` needs, the other one None. Each has its own storage: a slice of ``U`` would keep
    all of ``U`` alive (and in a checkpoint)."""
    matrix = g_mn if g_mn.dtype == torch.float32 else g_mn.float()
    u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    left = _compact(u[:, :rank].to(g_mn.dtype)) if side in ("left", "full") else None
    right = _compact(vh[:rank, :].to(g_mn.dtype)) if side in ("right", "full") else None
    return left, right


def _compact(view_xy: torch.Tensor) -> torch.Tensor:
    """A copy of a matrix view in its own storage, in the view's orientation: LAPACK returns column-major
    factors, and a row-major copy would send the products to other BLAS kernels (not bitwise the reference)."""
    if view_xy.stride(0) == 1 and view_xy.shape[0] > 1:
        return view_xy.mT.contiguous().mT
    return view_xy.contiguous()


def sketch_seed(seed: int, index: int, step: int, salt: int = 0) -> int:
    """A 63-bit seed for the random sketch of parameter ``index`` at refresh ``step`` (splitmix64 mixing):
    the same on every rank and after a resume, so no generator state needs to be saved or synchronised."""
    mask = (1 << 64) - 1
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + step * 0x94D049BB133111EB + salt) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


@dataclasses.dataclass(frozen=True)
class Sketch:
    """One matrix whose top right singular vectors are wanted, as this process holds it.

    Attributes:
        rows: this process's rows of the matrix (``m_i x n``, any float dtype; may have zero rows).
        rank: singular vectors wanted (capped at ``min(m, n)``).
        seed: seeds the Gaussian test matrix (see :func:`sketch_seed`).
        row_offset: index of ``rows``' first row in the whole matrix.
        total_rows: ``m``, the whole matrix's row count (None: ``rows`` is the whole matrix).
    """

    rows: torch.Tensor
    rank: int
    seed: int
    row_offset: int = 0
    total_rows: int | None = None


def _no_sum(tensors: list[torch.Tensor]) -> None:
    return None


def randomized_right_bases(
    sketches: Sequence[Sketch],
    *,
    oversample: int,
    power_iters: int,
    sum_shards: Callable[[list[torch.Tensor]], None] = _no_sum,
) -> list[torch.Tensor]:
    """Top-``r`` right singular vectors (``r x n``, rows) of each matrix, by randomized SVD (Halko et al.).

    Each matrix ``A`` (``m x n``) may be split by rows across processes; ``sum_shards`` sums a list of
    tensors over them in place (all processes get identical bits), once per stage for all matrices together,
    so a refresh costs ``power_iters + 2`` collectives whatever the number of matrices. With ``k = min(r +
    oversample, m, n)``, in float32:

    1. ``Omega`` (``m x k``): Gaussian from the sketch's seed, generated whole and cut to this process's rows,
       so the sketch does not depend on how the rows are split.
    2. ``Y = A^T Omega`` (``n x k``, summed over shards); ``Q = qr(Y)``.
    3. ``power_iters`` times: ``Y = A^T (A Q)`` (summed), ``Q = qr(Y)``. (Only ``Y`` is re-orthonormalised:
       ``A Q`` is sharded by rows and would need a distributed QR.)
    4. Rayleigh-Ritz: ``C = (A Q)^T (A Q)`` (``k x k``, summed); its top-``r`` eigenvectors ``W`` (float64
       ``eigh``) give ``V_r = Q W``, the right singular vectors of ``A Q Q^T ~ A``.
    5. Each vector's sign is fixed so its largest-magnitude entry is positive (any consistent rule would do:
       it makes the basis a function of the subspace, stable under the rounding differences between a
       sharded and an unsharded run).

    Returns the bases in each sketch's ``rows`` dtype, contiguous.
    """
    if not sketches:
        return []
    a_list, q_list, ranks = [], [], []
    ys = []
    for s in sketches:
        a = s.rows.float()
        total = a.shape[0] if s.total_rows is None else s.total_rows
        n = a.shape[1]
        k = max(1, min(s.rank + oversample, total, n))
        gen = torch.Generator(device=a.device).manual_seed(s.seed)
        omega = torch.randn(total, k, generator=gen, device=a.device, dtype=torch.float32)
        omega = omega[s.row_offset : s.row_offset + a.shape[0]]
        a_list.append(a)
        ranks.append(effective_rank(s.rank, total, n))
        ys.append(a.t() @ omega)
    sum_shards(ys)
    q_list = [torch.linalg.qr(y, mode="reduced").Q for y in ys]
    for _ in range(power_iters):
        ys = [a.t() @ (a @ q) for a, q in zip(a_list, q_list, strict=True)]
        sum_shards(ys)
        q_list = [torch.linalg.qr(y, mode="reduced").Q for y in ys]
    grams = []
    for a, q in zip(a_list, q_list, strict=True):
        b = a @ q
        grams.append(b.t() @ b)
    sum_shards(grams)
    out = []
    for s, q, c, r in zip(sketches, q_list, grams, ranks, strict=True):
        _, vecs = torch.linalg.eigh(c.double())  # ascending eigenvalues
        w = vecs[:, vecs.shape[1] - r :].flip(1).to(torch.float32)
        v_nr = q @ w
        pivot = v_nr.abs().argmax(dim=0)
        signs = torch.sign(v_nr[pivot, torch.arange(r, device=v_nr.device)])
        v_nr = v_nr * torch.where(signs == 0, torch.ones_like(signs), signs)
        out.append(v_nr.t().to(s.rows.dtype).contiguous())
    return out


def carry_moments(
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    side: Side,
    old: tuple[torch.Tensor | None, torch.Tensor | None],
    new: tuple[torch.Tensor | None, torch.Tensor | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adam's moments re-expressed in a new subspace (``moments_on_refresh="project"``).

    With ``R = Vh_old Vh_new^T`` (``r x r``, right side) the first moment, a low-rank matrix in the old
    coordinates, is mapped exactly: ``M_new = M_old R`` (the projection of ``M_old Vh_old`` onto the new
    basis). The second moment is mapped as the variance of that linear map with independent coordinates,
    ``V_new = V_old (R * R)`` (elementwise square): cross terms are unknown and dropped. Left side: ``L =
    U_new^T U_old``, ``L M`` and ``(L * L) V``; full: both. A direction outside the old subspace starts from
    zero in both moments. ``old``/``new`` are ``(left_mr, right_rn)`` pairs.
    """
    m, v = exp_avg, exp_avg_sq
    if side in ("right", "full"):
        assert old[1] is not None and new[1] is not None, "right side needs right bases"
        rot = old[1].to(m.dtype) @ new[1].to(m.dtype).t()
        m, v = m @ rot, v @ (rot * rot)
    if side in ("left", "full"):
        assert old[0] is not None and new[0] is not None, "left side needs left bases"
        rot = new[0].to(m.dtype).t() @ old[0].to(m.dtype)
        m, v = rot @ m, (rot * rot) @ v
    return m, v
