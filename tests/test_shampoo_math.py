"""Shampoo's matrix functions at world size 1, against a float64 eigendecomposition."""

from __future__ import annotations

import math

import pytest
import torch

from powertrain.optim.shampoo.matrix import RootFailure, inverse_root

EPS32 = torch.finfo(torch.float32).eps
EPS64 = torch.finfo(torch.float64).eps


def _psd(n: int, rank: int | None = None, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(n, rank or n, generator=g, dtype=torch.float64)
    return b @ b.T / n


def _reference(a: torch.Tensor, root: int, eps: float) -> torch.Tensor:
    vals, vecs = torch.linalg.eigh(a.double())
    return vecs @ torch.diag((vals.clamp_min(0) + eps) ** (-1.0 / root)) @ vecs.T


def _backward_error(a: torch.Tensor, unit: float = EPS32) -> float:
    """||E||_F of the perturbation a computed eigendecomposition (or Newton's products) is exact for: backward
    stable, ||E||_F <= sqrt(n) * unit * ||a||_F (n-term rounding, the typical case of the O(n) worst case)."""
    return math.sqrt(a.shape[0]) * unit * torch.linalg.matrix_norm(a.double()).item()


def _root_error(a: torch.Tensor, root: int, eps: float, backward: float) -> float:
    """First-order bound on the relative Frobenius error of a computed ``(a + eps I)^(-1/root)`` whose
    decomposition is exact for ``a + E``, ``||E||_F <= backward``: ``f(l) = (l + eps)^(-1/root)`` moves by at
    most ``|f'(l_min)| ||E||_F`` (Daleckii-Krein, symmetric matrices), twice that when round-off can make the
    smallest eigenvalue negative (``l_min <= ||E||``): the spectrum is then shifted by up to ``||E||`` as well."""
    vals = torch.linalg.eigvalsh(a.double()).clamp_min(0)
    shifted = 2.0 if vals.min().item() <= backward else 1.0
    lam = vals.min().item() + eps
    f_norm = ((vals + eps) ** (-1.0 / root)).norm().item()
    return shifted * lam ** (-1.0 / root - 1) / root * backward / f_norm


def _gram_bound(grams_abs: torch.Tensor, terms: int) -> torch.Tensor:
    """Entrywise bound on the float32 rounding of a sum of ``terms`` products (``grams_abs``: the same sum of
    |G| |G|^T): typical sqrt(terms) eps32 per entry, 2x for the largest of many entries (the worst case,
    terms * eps32, is ~100x the measured error on these sizes)."""
    return 2 * math.sqrt(terms) * EPS32 * grams_abs


@pytest.mark.parametrize("root", [1, 2, 4])
@pytest.mark.parametrize("method", ["eigh", "newton"])
def test_inverse_root_matches_float64_reference(root, method):
    a = _psd(24)
    x = inverse_root(a.float(), root, eps=1e-3, method=method)
    ref = _reference(a.float(), root, 1e-3)
    assert x.dtype == torch.float32
    # relative Frobenius error: first-order perturbation of the root (condition number 2.3e3 with eps) under
    # float32 eigh's backward error (Newton's stable coupled products round no worse, and its stopping rule
    # ||M - I||_inf < 1e-6 is below that); measured at most 1/16 of the bound over 7 CPU code paths
    err = (torch.linalg.matrix_norm(x.double() - ref) / torch.linalg.matrix_norm(ref)).item()
    backward = _backward_error(a.float())
    assert err < _root_error(a.float(), root, 1e-3, backward), err
    # defining property X^root (A + eps I) = I: X is exact for A + E, so the residual is X^root E, at most
    # ||E|| / (l_min + eps) (measured at most 1/11 of that)
    prod = torch.linalg.matrix_power(x.double(), root) @ (a + 1e-3 * torch.eye(24, dtype=torch.float64))
    residual = backward / (torch.linalg.eigvalsh(a).min().item() + 1e-3)
    assert (prod - torch.eye(24, dtype=torch.float64)).abs().max().item() < residual


def test_rank_deficient_matrix_uses_epsilon_and_stays_finite():
    """A rank-3 16x16 factor: 13 zero eigenvalues, which float32 eigh returns as +-1e-7 noise (the spectrum is
    shifted so the smallest is 0); eps 1e-4 dominates that noise, so the root is accurate to ~1e-3 relative."""
    a = _psd(16, rank=3)
    x = inverse_root(a.float(), 4, eps=1e-4)
    assert torch.isfinite(x).all()
    ref = _reference(a.float(), 4, 1e-4)
    err = (torch.linalg.matrix_norm(x.double() - ref) / torch.linalg.matrix_norm(ref)).item()
    # first-order perturbation at l_min = 0 (noise and shift: 2 ||E||); measured at most 1/3 of the bound
    assert err < _root_error(a.float(), 4, 1e-4, _backward_error(a.float())), err


def test_non_finite_factor_raises_root_failure():
    a = _psd(8).float()
    a[2, 3] = float("nan")
    with pytest.raises(RootFailure, match="non-finite"):
        inverse_root(a, 2)


def test_newton_without_convergence_raises():
    with pytest.raises(RootFailure, match="4-th root failed \\(newton"):
        inverse_root(_psd(8).float(), 4, method="newton", max_iters=1, retry_float64=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"root": 0}, "root=0"),
        ({"root": 2, "eps": -1.0}, "eps=-1.0"),
        ({"root": 2, "method": "svd"}, "method='svd'"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        inverse_root(_psd(4).float(), **kwargs)
    with pytest.raises(ValueError, match="square"):
        inverse_root(torch.zeros(3, 4), 2)


@pytest.mark.parametrize(
    ("shape", "max_dim", "merged", "blocks"),
    [
        ((64, 3, 3, 3), 64, (64, 27), 1),
        ((64, 3, 3, 3), 1024, (64, 27), 1),
        ((8, 3, 5), 32, (8, 15), 1),
        ((7, 15), 4, (7, 15), 8),
        ((300,), 128, (300,), 3),
        ((1, 1), 8, (1,), 1),
        ((2, 3, 4), 100, (2, 12), 1),
        ((5, 1, 9), 4, (5, 9), 6),
        ((), 8, (1,), 1),
        ((16, 32), 1024, (16, 32), 1),
        ((1, 512), 1024, (512,), 1),
        ((4, 5, 6, 7), 30, (4, 30, 7), 1),
        ((4, 5, 6, 7), 10**6, (4, 210), 1),
    ],
)
def test_blocks_split_and_write_back_round_trip(shape, max_dim, merged, blocks):
    """Writing every block of ``t`` through the same block of a zero tensor's split rebuilds ``t`` (the blocks
    are views that tile it, indexed alike for every tensor of the shape: how the optimizer applies updates)."""
    from powertrain.optim.shampoo.blocks import merged_shape, split

    t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    assert merged_shape(t.shape, max_dim) == merged
    parts = split(t, max_dim)
    assert len(parts) == blocks
    assert all(max(p.shape) <= max(max_dim, 1) or (p.ndim == 1 and p.numel() <= max_dim) for p in parts)
    assert sum(p.numel() for p in parts) == t.numel()
    rebuilt = torch.zeros(shape)
    for view, part in zip(split(rebuilt, max_dim), parts, strict=True):
        view.copy_(part)
    assert torch.equal(rebuilt, t)


def test_blocks_are_views_and_bad_max_dim_refused():
    from powertrain.optim.shampoo.blocks import merged_shape, split

    t = torch.zeros(6, 10)
    for p in split(t, 4):
        p.fill_(1.0)
    assert bool((t == 1).all())
    with pytest.raises(ValueError, match="max_preconditioner_dim=0"):
        merged_shape((3, 3), 0)


def test_preconditioner_matches_dense_float64_shampoo_on_a_matrix():
    """Against the textbook formulas on a 2-D block: L = sum G G^T, R = sum G^T G, direction
    L^-1/4 G R^-1/4, all in float64 (AdaGrad accumulation, beta2 = 1)."""
    from powertrain.optim.shampoo.preconditioner import init_factors, inverse_roots, precondition, update_factors

    g_ = torch.Generator().manual_seed(3)
    grads = [torch.randn(6, 9, generator=g_) for _ in range(5)]
    factors = init_factors(grads[0])
    for g in grads:
        update_factors(factors, g, beta2=1.0)
    left = sum(g.double() @ g.double().T for g in grads)
    right = sum(g.double().T @ g.double() for g in grads)
    # each entry sums 9 (6) products per gradient over 5 gradients: 14 (11) roundings; an off-diagonal entry can
    # cancel to ~0, so the bound scales with sum |G| |G|^T, not the entry (measured at most 1/4 of it)
    left_abs = sum(g.double().abs() @ g.double().abs().T for g in grads)
    right_abs = sum(g.double().abs().T @ g.double().abs() for g in grads)
    assert ((factors[0].double() - left).abs() <= _gram_bound(left_abs, 9 + 5)).all()
    assert ((factors[1].double() - right).abs() <= _gram_bound(right_abs, 6 + 5)).all()
    roots = inverse_roots(factors, eps=1e-6)
    out = precondition(grads[-1], roots).double()
    ref_roots = [_reference(left, 4, 1e-6), _reference(right, 4, 1e-6)]
    ref = ref_roots[0] @ grads[-1].double() @ ref_roots[1]
    # each root's relative error (the factor's rounding and eigh's backward error), amplified by that root's
    # ||R||_F / sigma_min(R) in the product, plus the two 6- and 9-term products; measured at most 1/5 of it
    bound = 2 * math.sqrt(9) * EPS32
    for f, exact, r in zip(factors, (left, right), ref_roots, strict=True):
        backward = _backward_error(f) + torch.linalg.matrix_norm(f.double() - exact).item()
        amplify = torch.linalg.matrix_norm(r).item() / torch.linalg.eigvalsh(r).min().item()
        bound += _root_error(exact, 4, 1e-6, backward) * amplify
    err = (torch.linalg.matrix_norm(out - ref) / torch.linalg.matrix_norm(ref)).item()
    assert err < bound, (err, bound)


@pytest.mark.parametrize(("shape", "beta2"), [((256, 160), 0.95), ((131, 200), 1.0), ((300, 20), 0.9)])
def test_large_factor_updates_match_the_full_product(shape, beta2):
    """Factors of 128+ rows take the lower-half products and mirror the off-diagonal quarter (an odd size
    splits unevenly); fewer than 32 columns take one product: all equal the float64 EMA of G G^T, G^T G, and
    the mirrored part is exactly the transpose of the computed one."""
    from powertrain.optim.shampoo.preconditioner import init_factors, update_factors

    g_ = torch.Generator().manual_seed(4)
    grads = [torch.randn(*shape, generator=g_) for _ in range(3)]
    factors = init_factors(grads[0])
    left = torch.zeros(shape[0], shape[0], dtype=torch.float64)
    right = torch.zeros(shape[1], shape[1], dtype=torch.float64)
    left_abs, right_abs = torch.zeros_like(left), torch.zeros_like(right)
    for g in grads:
        update_factors(factors, g, beta2)
        gd = g.double()
        a = 1.0 if beta2 == 1.0 else 1.0 - beta2
        left, right = beta2 * left + a * gd @ gd.T, beta2 * right + a * gd.T @ gd
        left_abs = beta2 * left_abs + a * gd.abs() @ gd.abs().T
        right_abs = beta2 * right_abs + a * gd.abs().T @ gd.abs()
    for f, ref, ref_abs, columns in zip(
        factors, (left, right), (left_abs, right_abs), (shape[1], shape[0]), strict=True
    ):
        # per entry: a `columns`-term product, then the EMA's scaling and sum (2 roundings) per gradient;
        # measured at most 1/5 of the bound; a quarter off by 1e-5 relative fails
        assert ((f.double() - ref).abs() <= _gram_bound(ref_abs, columns + 2 * len(grads))).all()
        if f.shape[0] >= 128 and columns >= 32:
            h = f.shape[0] // 2
            assert torch.equal(f[:h, h:], f[h:, :h].T)


def test_preconditioner_order3_and_ema():
    """Order 3: each factor gets the -1/6 root, mode products in order; beta2 < 1 is an EMA."""
    from powertrain.optim.shampoo.preconditioner import init_factors, inverse_roots, precondition, update_factors

    g = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(4))
    factors = init_factors(g)
    update_factors(factors, g, beta2=0.9)
    update_factors(factors, g, beta2=0.9)
    gd = g.double()
    unfold = [gd.movedim(i, 0).reshape(gd.shape[i], -1) for i in range(3)]
    for f, u in zip(factors, unfold, strict=True):
        # a u.shape[1]-term product and 2 roundings (scale, sum) per update, as in the matrix test above
        ref_abs = (0.1 * 0.9 + 0.1) * (u.abs() @ u.abs().T)
        assert ((f.double() - (0.1 * 0.9 + 0.1) * (u @ u.T)).abs() <= _gram_bound(ref_abs, u.shape[1] + 4)).all()
    roots = inverse_roots(factors, eps=1e-6)
    out = precondition(g, roots).double()
    r = [_reference(f.double(), 6, 1e-6) for f in factors]
    ref = torch.einsum("abc,ai,bj,ck->ijk", gd, r[0], r[1], r[2])
    # the reference takes the float32 factors: each root's eigh error, amplified by ||R||_F / sigma_min(R),
    # plus three mode products of <= 5 terms; measured at most 0.37 of the bound
    bound = 3 * math.sqrt(5) * EPS32
    for f, ri in zip(factors, r, strict=True):
        amplify = torch.linalg.matrix_norm(ri).item() / torch.linalg.eigvalsh(ri).min().item()
        bound += _root_error(f, 6, 1e-6, _backward_error(f)) * amplify
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < bound, (err, bound)


def test_round_off_negative_eigenvalues_shift_the_spectrum():
    """A rank-deficient factor whose round-off makes an eigenvalue negative: the spectrum is shifted so the
    smallest is 0 (the reference implementation's rule), so that direction is treated like the other null
    direction instead of being amplified to eps^(-1/p) while its twin stays at ~|round-off|^(-1/p)."""
    from powertrain.optim.shampoo.matrix import inverse_root

    q, _ = torch.linalg.qr(torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    vals = torch.tensor([-1e-9, 1e-9, 2.0, 5.0], dtype=torch.float64)
    a = q @ torch.diag(vals) @ q.T
    out = inverse_root(a, 4, eps=1e-6)
    shifted = vals + 1e-9 + 1e-6
    expect = q @ torch.diag(shifted**-0.25) @ q.T
    # float64: eigh's backward error and a's own 4-term rounding, through the first-order bound at l_min = 0
    # (~3e-8 absolute, measured 1/15 of it); clipping the -1e-9 instead of shifting moves the root by ~2e-3
    backward = 2 * _backward_error(a, EPS64)
    err = (torch.linalg.matrix_norm(out - expect) / torch.linalg.matrix_norm(expect)).item()
    assert err < _root_error(a, 4, 1e-6, backward), err


@pytest.mark.parametrize(
    ("eps", "rel_eps", "damping"),
    [(1e-12, None, 2.0 * 2.0**-23), (1e-3, None, 1e-3), (1e-12, 0.0, 1e-12), (1e-12, 1e-4, 2e-4)],
)
def test_damping_is_epsilon_or_the_round_off_floor(eps, rel_eps, damping):
    """Eigenvalues get max(eps, rel_eps * lambda_max) after the round-off shift; by default rel_eps is the
    dtype's unit round-off (float32: 2^-23), below which a float32 factor's eigenvalues are round-off. A diagonal
    factor (exact eigendecomposition) checks the rule itself; the spectrum's -1e-10 shifts it by 1e-10."""
    vals = torch.tensor([2.0, 1e-3, 1e-9, 0.0, -1e-10])
    out = inverse_root(torch.diag(vals), 2, eps=eps, rel_eps=rel_eps)
    expect = (vals.double() + 1e-10 + damping) ** -0.5
    torch.testing.assert_close(out.diagonal().double(), expect, rtol=1e-6, atol=0.0)
    if rel_eps != 0.0:  # newton damps by the Frobenius norm, here lambda_max (one dominant eigenvalue) to 1e-6
        newton = inverse_root(torch.diag(vals.clamp(min=0)), 2, eps=eps, rel_eps=rel_eps, method="newton")
        torch.testing.assert_close(
            newton.diagonal().double(), (vals.double().clamp(min=0) + damping) ** -0.5, rtol=1e-3, atol=0.0
        )


def test_newton_takes_a_rank_deficient_factor_with_round_off_negative_eigenvalues():
    """The coupled Newton iteration diverges on a negative eigenvalue: with eps alone (1e-12) a float32 factor
    of 3 gradients (rank 3, round-off eigenvalues of either sign) fails, also in float64; the round-off floor makes
    it positive definite, and the iteration converges in float32 to the root on the factor's range (measured
    relative error 5e-3: float32 at a condition number of ~1e7; eigh: 6e-4)."""
    g = torch.Generator().manual_seed(0)
    u = torch.randn(64, 3, generator=g)
    a = u @ u.T
    out = inverse_root(a, 2, method="newton") @ u
    vals, vecs = torch.linalg.eigh(a.double())
    ref = vecs[:, -3:] @ torch.diag(vals[-3:] ** -0.5) @ vecs[:, -3:].T @ u.double()  # the root on the range
    assert torch.linalg.matrix_norm(out.double() - ref) < 5e-2 * torch.linalg.matrix_norm(ref)
    with pytest.raises(ValueError, match=r"rel_eps=-1\.0"):
        inverse_root(a, 2, rel_eps=-1.0)


def test_float64_parameters_are_optimised_in_float64():
    from powertrain.optim.shampoo.optimizer import DistributedShampoo

    w = torch.nn.Parameter(torch.randn(5, 6, dtype=torch.float64))
    opt = DistributedShampoo([w], lr=0.1, precondition_frequency=1, start_preconditioning_step=1)
    for _ in range(2):
        w.grad = torch.randn(5, 6, dtype=torch.float64)
        opt.step()
    st = opt.state[w]
    blk = st["blocks"][0]
    assert blk["filtered"].dtype == torch.float64
    assert blk["graft"].dtype == torch.float64 and blk["factors"][0].dtype == torch.float64


def test_non_contiguous_parameters_are_updated_in_place():
    """A permuted (non-contiguous) parameter whose merged block shape is no view of it gets the same update as a
    contiguous copy, written into the parameter itself (the update runs on a contiguous copy, copied back)."""
    from powertrain.optim.shampoo.optimizer import DistributedShampoo

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 3, 4).permute(2, 1, 0))  # (4, 3, 5), merged to (4, 15) blocks
    ref = torch.nn.Parameter(w.detach().contiguous())
    start = ref.detach().clone()
    assert not w.is_contiguous()
    opts = dict(lr=0.1, momentum=0.9, weight_decay=0.1, precondition_frequency=1, max_preconditioner_dim=16)
    a, b = DistributedShampoo([w], **opts), DistributedShampoo([ref], **opts)
    for step in range(3):
        g = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(step))
        w.grad, ref.grad = g.clone(), g.clone()
        a.step()
        b.step()
    # bitwise: the update runs on a contiguous copy, the same operations on the same shapes as for `ref`
    assert torch.equal(w.detach(), ref.detach())
    assert not torch.equal(ref.detach(), start)
