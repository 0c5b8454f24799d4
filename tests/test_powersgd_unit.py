"""PowerSGD math and API at world size 1 (no process group)."""

from __future__ import annotations

import io
import math

import pytest
import torch

from dist_utils import EPS32, EPS64, basis_errors, feedback_bound, within
from models import batch, loss_fn, make_model
from powertrain.compress import NonFiniteGradientError, PowerSGDCompressor
from powertrain.compress.powersgd import Config
from powertrain.ops.lowrank import cholesky_qr, householder_qr, matrix_shape, orthonormalize
from powertrain.powersgd import PowerSGD, optimizer_step


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rank", 0),
        ("rank", 1.5),
        ("rank", True),
        ("min_compression_rate", -1),
        ("min_compression_rate", float("nan")),
        ("num_iters_per_step", 0),
        ("start_compressing_after_num_steps", -1),
        ("variant", "svd"),
        ("seed", -3),
        ("factor_dtype", "fp8"),
        ("factor_dtype", torch.bfloat16),
    ],
)
def test_bad_config_names_field_and_range(field, value):
    kwargs = {"rank": 1, field: value}
    with pytest.raises(ValueError, match=rf"Config\.{field}=.*must be"):
        Config(**kwargs)


def test_bf16_factors_need_the_paper_variant():
    with pytest.raises(ValueError, match=r"factor_dtype='bf16' needs variant='paper' \(got 'alternating'\)"):
        Config(rank=4, factor_dtype="bf16")
    assert Config(rank=4, variant="paper", factor_dtype="bf16").factor_dtype == "bf16"


def test_reference_defaults_and_positional_order():
    c = Config(4)
    assert (c.rank, c.min_compression_rate, c.num_iters_per_step, c.start_compressing_after_num_steps) == (
        4,
        2,
        1,
        100,
    )
    assert Config(1, 10, 2, 0) == Config(
        rank=1, min_compression_rate=10, num_iters_per_step=2, start_compressing_after_num_steps=0
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(3, 50, 4, dtype=torch.float64),
        lambda: torch.randn(3, 50, 1, dtype=torch.float64) @ torch.randn(3, 1, 4, dtype=torch.float64),  # rank 1
        lambda: torch.zeros(2, 30, 3, dtype=torch.float64),
    ],
)
def test_orthonormalize_always_orthonormal(make):
    q = orthonormalize(make())
    n, r = q.shape[-2:]
    eye = torch.eye(r, dtype=q.dtype).expand(q.shape[0], -1, -1)
    assert q.isfinite().all()
    # Householder QR, whatever the input's rank: ||Q - Q_exact||_F <= sqrt(r) * gamma(n r) (Higham, Thm 19.4), so
    # |Q^T Q - I| <= 2 sqrt(r) n r u, plus n u for the n-term Gram products; u = eps / 2, 2x safety.
    within((q.transpose(1, 2) @ q - eye).abs(), (2 * r**0.5 * n * r + n) * EPS64, "Q^T Q - I")


def _conditioned(n: int, r: int, kappa: float, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    u, _ = torch.linalg.qr(torch.randn(2, n, r, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(2, r, r, generator=gen, dtype=torch.float64))
    return ((u * torch.logspace(0, -math.log10(kappa), r, dtype=torch.float64)) @ v.transpose(1, 2)).to(dtype)


def _low_rank(n: int, r: int, k: int, dtype: torch.dtype, seed: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    left = torch.randn(1, n, k, generator=gen, dtype=torch.float64)
    return (left @ torch.randn(1, k, r, generator=gen, dtype=torch.float64)).to(dtype)


def _scale(dtype: torch.dtype, exp: int) -> float:
    """10**exp in float64, 10**(exp // 7) in float32 (within range either way, far from 1)."""
    return 10.0 ** (exp if dtype == torch.float64 else exp // 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "make",
    [
        lambda dt: torch.randn(3, 500, 32, generator=torch.Generator().manual_seed(0), dtype=dt),
        lambda dt: torch.zeros(2, 100, 8, dtype=dt),  # an unused layer's factor
        lambda dt: torch.ones(2, 200, 2, dtype=dt) @ torch.ones(2, 2, 16, dtype=dt),  # rank 1 of 16
        lambda dt: _low_rank(4096, 16, 8, dt),  # rank-deficient at PowerSGD's sizes
        lambda dt: _low_rank(16384, 32, 1, dt),
        # a GPT's embedding at rank 64: three passes leave it 1.1e-7 from orthonormal in float64, four 1.3e-14
        lambda dt: _low_rank(50000, 64, 32, dt, seed=1),
        lambda dt: _conditioned(300, 20, 1e12, dt),  # singular values from 1 to 1e-12
        lambda dt: torch.randn(2, 100, 4, generator=torch.Generator().manual_seed(3), dtype=dt) * _scale(dt, 200),
        lambda dt: torch.randn(2, 100, 4, generator=torch.Generator().manual_seed(3), dtype=dt) * _scale(dt, -170),
        lambda dt: torch.randn(30, 4, generator=torch.Generator().manual_seed(4), dtype=dt),  # one matrix, no batch
        lambda dt: torch.randn(2, 3, 30, 4, generator=torch.Generator().manual_seed(4), dtype=dt),  # 2 batch dims
        lambda dt: torch.tensor([[[-(2.0**-24), 1.0], [0.0, -(2.0**-24)]]], dtype=dt),  # square, near-singular
    ],
    ids=[
        "randn",
        "zeros",
        "rank-1",
        "rank-8-of-16",
        "rank-1-of-32",
        "rank-32-of-64",
        "kappa-1e12",
        "huge",
        "tiny",
        "2-d",
        "4-d",
        "sq",
    ],
)
def test_cholesky_qr_is_an_orthonormal_basis_of_the_span(make, dtype):
    """The orthonormalisation PowerSGD runs on CUDA, checked here on the CPU: orthonormal whatever the input's rank,
    conditioning or magnitude (a rank-deficient input completed by other directions), and a basis of the input's own
    span. Checked in float64 on the input scaled by its largest entry (the huge and tiny ones would overflow the
    check): (I - Q Q^T) Y = (I - Q Q^T) (Y + F) - (I - Q Q^T) F, whose first term is Q (I - Q^T Q) R for the exact
    factor R of Y + F = Q R, so ||(I - Q Q^T) Y||_F <= (||F||_F / ||Y||_F + ||Q^T Q - I||_F (1 + ...)) ||Y||_F with F
    as basis_errors bounds it and Q's measured departure from orthonormality, plus the check's own products
    (n + r) u64 ||Y||_F; 2x safety."""
    x = make(dtype)
    q = cholesky_qr(x).double()
    n, r = q.shape[-2:]
    assert cholesky_qr(x).dtype == dtype and q.shape == x.shape and q.isfinite().all()
    orth, span = basis_errors("cholesky", n, r, dtype)
    departure = q.mT @ q - torch.eye(r, dtype=q.dtype)
    within(departure.abs(), 2 * orth, "Q^T Q - I")
    y = x.double() / x.double().abs().amax(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    residual = (y - q @ (q.mT @ y)).norm(dim=(-2, -1))
    measured = departure.norm(dim=(-2, -1))
    within(residual, 2 * (span + measured + (n + r) * EPS64 / 2) * y.norm(dim=(-2, -1)), "(I - Q Q^T) Y")


def test_cholesky_qr_of_an_input_that_cancels_the_completion_is_finite():
    """Scaled and completed, [[-u64, 1], [0, -u64]] becomes [[0, 1], [0, 0]] exactly: singular, the plain passes'
    Cholesky factorisations fail, and those passes leave the matrix as the shifted ones made it (no gradient is
    such an input: this is the guard against NaN, not a basis). The result is finite and spans the input to within
    u64 of its norm (its second direction is u64 long: what the completion cancelled), in one nonzero column."""
    x = torch.tensor([[[-(2.0**-53), 1.0], [0.0, -(2.0**-53)]]], dtype=torch.float64)
    q = cholesky_qr(x)
    assert q.isfinite().all()
    e = q[0, :, 1] / q[0, :, 1].norm()  # the nonzero column
    within((x[0] - torch.outer(e, e) @ x[0]).norm(), 2 * EPS64 * x[0].norm(), "(I - e e^T) Y")  # u64 ||Y||, 4x


def test_cholesky_qr_of_zero_is_the_completion_and_cpu_keeps_householder():
    """An all-zero input (a zero gradient) gets the completion's columns (so the power iteration can start again
    from them); off CUDA orthonormalize stays torch's Householder QR, bitwise (the CPU figures were measured with it,
    and it is the faster one there)."""
    z = cholesky_qr(torch.zeros(1, 10, 3))
    expect = torch.zeros(10, 3)
    for j in range(3):
        expect[j::3, j] = 1 / len(range(j, 10, 3)) ** 0.5
    within((z[0] - expect).abs(), 2 * EPS32, "the completion")
    x = torch.randn(2, 40, 5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(orthonormalize(x), torch.linalg.qr(x, mode="reduced").Q)
    with pytest.raises(ValueError, match="at most as many columns as rows"):
        cholesky_qr(torch.randn(1, 3, 4))


#: PowerSGD's orthonormalisation: the CPU's (Householder QR) and the one it runs on CUDA (Cholesky QR), both tested
#: here on the CPU through the compressor.
ORTHO = {"householder": householder_qr, "cholesky": cholesky_qr}


@pytest.fixture(params=sorted(ORTHO))
def ortho(request, monkeypatch):
    from powertrain.compress import powersgd

    monkeypatch.setattr(powersgd, "orthonormalize", ORTHO[request.param])
    return request.param


def test_matrix_shape_of_conv_weight():
    assert matrix_shape(torch.Size([8, 3, 3, 3])) == (8, 27)


def _fixed_gradient_approximation(
    variant: str, g: torch.Tensor, rank: int, steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed the same gradient repeatedly, discarding the residual: pure warm-started power iteration.
    Returns the last approximation and the factor the iteration starts from (P for the alternating variant,
    whose first step projects onto P; Q for the paper's, whose first step computes P = M Q)."""
    p = torch.nn.Parameter(torch.zeros_like(g))
    agg = PowerSGD(
        [p],
        config=Config(rank=rank, min_compression_rate=0, start_compressing_after_num_steps=0, variant=variant),
    )
    start = agg.compressor.state_dict()["p" if variant == "alternating" else "q"][0].clone()
    out = None
    for _ in range(steps):
        p.grad = g.clone()
        out = agg.aggregate([p.grad])[0]
    assert out is not None
    return out, start


def _tan_angle(x_nr: torch.Tensor, basis_nn: torch.Tensor) -> float:
    """tan of the largest principal angle between span(x) and the first r columns of an orthogonal basis."""
    r = x_nr.shape[1]
    inside, outside = basis_nn[:, :r].T @ x_nr, basis_nn[:, r:].T @ x_nr
    return torch.linalg.matrix_norm(outside @ torch.linalg.inv(inside), ord=2).item()


@pytest.mark.parametrize("variant", ["alternating", "paper"])
@pytest.mark.parametrize("rank", [1, 3])
def test_warm_start_converges_to_best_rank_r(variant, rank, ortho):
    gen = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(40, 40, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(30, 30, generator=gen, dtype=torch.float64))
    s = torch.tensor([10.0, 8.0, 6.0] + [2.0 / (i + 1) for i in range(27)], dtype=torch.float64)
    g = u[:, :30] @ torch.diag(s) @ v.T
    best = u[:, :rank] @ torch.diag(s[:rank]) @ v[:, :rank].T  # Eckart-Young
    steps = 150
    approx, start = _fixed_gradient_approximation(variant, g, rank, steps)
    # Subspace iteration: tan(angle to the top-r singular space) shrinks by s[r] / s[r-1] per half-iteration
    # (one matrix product); the last step's subspace has had steps - 1 of them (alternating: one per step) or
    # 2 steps - 1 (paper: P = M Q, then Q = M^T P). Rounding adds up to nu s[0] / (s[r-1] - s[r]) to the angle
    # (Wedin: a perturbation of size nu ||g||_2 moves the singular space by that over the gap), nu = n u for the
    # product plus the orthonormalisation's own perturbation of the span (basis_errors).
    half_iterations = steps - 1 if variant == "alternating" else 2 * steps - 1
    tan0 = _tan_angle(start, u if variant == "alternating" else v)
    orth, span = basis_errors(ortho, 40, rank, torch.float64)
    nu = g.shape[0] * EPS64 / 2 + span
    sin_angle = (s[rank] / s[rank - 1]) ** half_iterations * tan0 + nu * s[0] / (s[rank - 1] - s[rank])
    # approx = P P^T g with P at that angle and off orthonormal by r orth: ||approx - best||_F <= (sin + n u +
    # r orth) ||g||_F; 2x safety.
    err = sin_angle + nu + rank * orth
    within((approx - best).norm() / best.norm(), 2 * err * g.norm() / best.norm(), "approx")
    # What remains is the best rank-r error: its norm is off by sin^2 s[0]^2 / (2 ||s[r:]||^2) (second order in
    # the angle) plus n u ||g||_F / ||s[r:]|| for forming g - approx; 2x safety.
    tail = s[rank:].norm()
    rel = sin_angle**2 * s[0] ** 2 / (2 * tail**2) + nu * g.norm() / tail
    within(((g - approx).norm() - tail).abs() / tail, 2 * rel, "residual norm")


@pytest.mark.parametrize("variant", ["alternating", "paper"])
def test_exactly_low_rank_gradient_gives_no_nan(variant, ortho):
    g = torch.outer(torch.arange(1.0, 21.0), torch.arange(1.0, 11.0))  # rank 1, compressed at rank 4
    approx, _ = _fixed_gradient_approximation(variant, g, rank=4, steps=3)
    assert approx.isfinite().all()
    # From the second step the factor spans g's column (row) space, so approx = P P^T g = g up to rounding in
    # float32: P's departure from orthonormality (r times basis_errors' entrywise bound) and from g's span, and the
    # n-, m- and r-term products, all relative to ||g||_F; u = eps / 2, 2x safety. (n, m, r) = (20, 10, 4)
    n, m, r = 20, 10, 4
    orth, span = basis_errors(ortho, n, r, torch.float32)
    bound = 2 * (r * orth + span + (n + m + r) * EPS32 / 2)
    within((approx - g).norm() / g.norm(), bound, "rank-1 reconstruction")


@pytest.mark.device
@pytest.mark.parametrize("variant", ["alternating", "paper"])
def test_compressor_conserves_at_world_size_1(variant, device):
    model = make_model(torch.float64).to(device)
    comp = PowerSGDCompressor(
        model.named_parameters(),
        config=Config(
            rank=1,
            min_compression_rate=0,
            num_iters_per_step=2,
            start_compressing_after_num_steps=0,
            variant=variant,
        ),
    )
    for step in range(4):
        model.zero_grad()
        loss_fn(model, *(t.to(device) for t in batch(0, step, torch.float64))).backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in comp.params]
        before = [e.clone() for e in comp.residuals()]
        out = comp.aggregate(grads)
        for g, e0, a, e1, name in zip(grads, before, out, comp.residuals(), comp.names, strict=True):
            # derivation: dist_utils.feedback_bound, at W = 1 (2 power iterations at rank 1)
            bound = feedback_bound(
                (g + e0)[None], e1[None], eps=EPS64, iters=2, rank=1, matrix=name in comp.compressed_names
            )
            within((a + e1 - (g + e0)).abs(), bound, name)
    assert any(e.abs().sum() > 0 for e in comp.residuals()), "rank 1 must leave a residual"


def test_uncompressed_residual_stays_zero():
    """torch's hook lets the error of uncompressed tensors grow; here they are exact and owe nothing."""
    model = make_model()
    params = list(model.parameters())
    agg = PowerSGD(params, config=Config(rank=1, start_compressing_after_num_steps=0))
    opt = torch.optim.SGD(params, lr=0.01)
    for step in range(5):
        loss_fn(model, *batch(0, step)).backward()
        optimizer_step(opt, agg)
    compressed = set(agg.compressor.compressed_names)
    for i, p in enumerate(params):
        if p.requires_grad and f"param[{i}]" not in compressed:
            assert p.grad is not None and (p.grad == 0).all()


@pytest.mark.device
def test_nonfinite_at_world_size_1_raises_or_skips(device):
    model = make_model().to(device)
    comp = PowerSGDCompressor(model.named_parameters(), config=Config(rank=2, start_compressing_after_num_steps=0))
    loss_fn(model, *(t.to(device) for t in batch(0, 0))).backward()
    model.big.weight.grad[0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"big\.weight.*rank 0"):
        comp.reduce_gradients()
    assert comp.num_steps == 0 and comp.num_compressed_steps == 0
    assert comp.reduce_gradients(skip_nonfinite=True) is False
    assert model.big.weight.grad[0, 0].isnan()


LIMIT_CASES = [
    ("alternating", 1, "fp32"),
    ("alternating", 2, "fp32"),
    ("paper", 1, "fp32"),
    ("paper", 2, "fp32"),
    ("paper", 1, "bf16"),
]


def _pattern(kind: str, n: int, m: int, device: torch.device) -> torch.Tensor:
    """An ``n x m`` matrix with entries in [-1, 1]: random, all ones, one column of ones, or random signs."""
    if kind == "rand":
        return torch.empty(n, m, device=device).uniform_(-1, 1)
    if kind == "ones":
        return torch.ones(n, m, device=device)
    if kind == "column":
        out = torch.zeros(n, m, device=device)
        out[:, 0] = 1
        return out
    return torch.randint(0, 2, (n, m), device=device).float() * 2 - 1


def _limit_of(comp: PowerSGDCompressor, i: int) -> float:
    from powertrain.compress.powersgd import _Batch

    n, m, r = comp._mat[i]  # type: ignore[misc]
    return comp._limit(_Batch([0], [i], n, m, r, 0, None, None, None))  # type: ignore[arg-type]


@pytest.mark.device
@pytest.mark.parametrize(("variant", "iters", "factors"), LIMIT_CASES)
def test_gradients_just_below_the_limit_never_overflow(variant, iters, factors, device):
    """:meth:`PowerSGDCompressor._limit` is a bound on what any factor, sum, approximation or residual can reach: with
    gradient + residual at 98% of it in every entry, in shapes tall, wide and square, ranks 1 to 16, random, constant,
    one-column and sign patterns, over 4 steps (so the paper variant's ``P = M Q`` meets a ``Q`` of the size of such a
    step), no output or residual is NaN or Inf. Then, with the residuals dropped, an ordinary gradient goes through
    (before ``Q`` was scaled, the paper variant's ``P = M Q`` overflowed on it: the last large step's ``Q`` stays)."""
    torch.manual_seed(0)
    for n, m in ((64, 32), (8, 300), (50, 50), (256, 256)):
        for rank in (1, 4, 16):
            for kind in ("rand", "ones", "column", "sign"):
                p = torch.nn.Parameter(torch.zeros(n, m, device=device))
                config = Config(
                    rank=rank,
                    variant=variant,
                    num_iters_per_step=iters,
                    factor_dtype=factors,
                    start_compressing_after_num_steps=0,
                    min_compression_rate=0,
                )
                comp = PowerSGDCompressor([("w", p)], config=config)
                limit = _limit_of(comp, 0)
                for _ in range(4):
                    target = _pattern(kind, n, m, device)
                    (out,) = comp.aggregate([0.98 * limit * target - comp.residuals()[0]])
                    what = f"{variant} k={iters} {factors} {n}x{m} rank {rank} {kind}"
                    assert out.isfinite().all() and comp.residuals()[0].isfinite().all(), what
                comp.pop_residuals()  # those can be beyond the limit themselves: the next test
                (out,) = comp.aggregate([torch.randn(n, m, device=device)])
                assert out.isfinite().all(), f"{what}: an ordinary step after large ones"


@pytest.mark.device
@pytest.mark.parametrize(("variant", "iters", "factors"), LIMIT_CASES)
def test_a_gradient_beyond_the_limit_raises_naming_it_and_changes_nothing(variant, iters, factors, device):
    """A finite gradient + residual above the limit on a compressed matrix raises NonFiniteGradientError naming the
    parameter, its size and the limit (before, a 3.3e38 entry raised "another rank sent non-finite values" at world
    size 1, or committed an Inf residual that failed every later step); the state is as before, and the next ordinary
    step goes through."""
    torch.manual_seed(0)
    model = make_model().to(device)
    config = Config(
        rank=2, variant=variant, num_iters_per_step=iters, factor_dtype=factors, start_compressing_after_num_steps=0
    )
    comp = PowerSGDCompressor(model.named_parameters(), config=config)
    i = comp.names.index("big.weight")
    grads = [torch.randn_like(p) for p in comp.params]
    comp.aggregate(grads)
    state = comp.state_dict()
    before = {
        k: [t.clone() if isinstance(t, torch.Tensor) else t for t in v] for k, v in state.items() if isinstance(v, list)
    }
    grads[i] = grads[i].clone()
    grads[i][0, 0] = 1.5 * _limit_of(comp, i)
    with pytest.raises(
        NonFiniteGradientError, match=r"too large on rank 0: big\.weight reaches .*\(limit .*likely diverged"
    ):
        comp.aggregate(grads)
    after = comp.state_dict()
    for key, saved in before.items():
        for a, b in zip(saved, after[key], strict=True):
            assert (a is None and b is None) or (a == b if not isinstance(a, torch.Tensor) else torch.equal(a, b)), key
    grads[i][0, 0] = 1.0
    assert all(o.isfinite().all() for o in comp.aggregate(grads))
    # gradient + residual at 98% of the limit: the step goes through, and its residual may be beyond the limit on its
    # own; then every later step must say that no step can go through any more
    limit = _limit_of(comp, i)
    grads[i] = 0.98 * limit * torch.sign(torch.randn_like(grads[i])) - comp.residuals()[i]
    comp.aggregate(grads)
    grads[i] = torch.randn_like(grads[i])
    assert float(comp.residuals()[i].abs().max()) > limit, "the case below did not arise: make it"
    with pytest.raises(NonFiniteGradientError, match=r"residual owed from earlier steps alone .*pop_residuals\(\)"):
        comp.aggregate(grads)
    comp.pop_residuals()
    assert all(o.isfinite().all() for o in comp.aggregate(grads))


def test_unit_scaled_is_an_exact_power_of_two_scaling():
    """Entries at most 1, each matrix's largest in [1/2, 1]; a product with it is the product with the input scaled by
    that matrix's power of two, to the bit; zero stays zero; float32 inputs near its largest number and float64 ones
    far beyond it scale without overflow; one tiny matrix beside a large one is not pushed into subnormals."""
    from powertrain.ops.lowrank import unit_scaled

    torch.manual_seed(0)
    for dtype, big in ((torch.float32, 5e37), (torch.float64, 1e300), (torch.float32, 1e-30), (torch.float32, 3.0)):
        x = torch.randn(3, 40, 5, dtype=dtype) * big
        y = unit_scaled(x)
        tops = y.abs().amax(dim=(1, 2))
        assert ((tops >= 0.5) & (tops <= 1.0)).all(), (dtype, big, tops)
        scale = y[:, :1, :1] / x[:, :1, :1]  # one per matrix
        assert torch.equal(y, x * scale), "not one scale per matrix"
        assert all(math.log2(float(s)).is_integer() for s in scale.flatten()), scale.flatten()
        m = torch.randn(3, 7, 40, dtype=dtype)
        product = torch.bmm(m, x)
        if product.isfinite().all():  # the float32 5e37 one overflows: why the scaling
            assert torch.equal(torch.bmm(m, y), product * scale)
        assert torch.bmm(m, y).isfinite().all()
    zero = torch.zeros(2, 4, 3)
    assert torch.equal(unit_scaled(zero), zero)
    mixed = torch.stack([torch.ones(4, 3), torch.full((4, 3), 2.0**-140)])  # one scale each: no subnormal
    assert torch.equal(unit_scaled(mixed), torch.full((2, 4, 3), 0.5))
    # LAPACK's QR does not scale a column's norm: 256 entries of 2.2e37 overflowed float32 before scaling
    q = householder_qr(torch.full((1, 256, 1), 2.2e37))
    assert torch.allclose(q.abs(), torch.full_like(q, 1 / 16))


def test_bounded_flag_fails_nan_inf_and_entries_above_their_bound():
    from powertrain.ops.finite import bounded_flag, read_flag

    x, y = torch.tensor([1.0, -3.0]), torch.tensor([[2.0]], dtype=torch.float64)
    assert read_flag(bounded_flag([x, y], [3.0, 2.0]))
    assert not read_flag(bounded_flag([x, y], [2.9, 2.0]))  # -3 is beyond 2.9: magnitudes count
    assert not read_flag(bounded_flag([x, y], [3.0, 1.5]))
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert not read_flag(bounded_flag([torch.tensor([0.0, bad]), y], [1e38, 2.0])), bad
    assert read_flag(bounded_flag([torch.empty(0), y], [0.5, 2.0]))  # an empty tensor has nothing to exceed
    assert bounded_flag([], []) is True
    assert read_flag(bounded_flag([torch.tensor([1e300], dtype=torch.float64)], [1e301]))  # no float32 detour


def test_step_counts_and_bytes_advance_under_per_bucket_calls():
    """DDP averages a bucket at a time (indices=): each parameter counts its own steps, so the warm-up ends and
    bytes_per_step() reports the compressed message for a model only ever averaged in parts (one counter,
    "steps"; the number of steps and the alternation phase derive from it)."""
    params = [torch.nn.Parameter(torch.randn(32, 24)), torch.nn.Parameter(torch.randn(16, 40))]
    comp = PowerSGDCompressor(params, config=Config(rank=2, start_compressing_after_num_steps=2))
    dense = comp.dense_bytes_per_step
    for step in range(3):
        assert comp.num_steps == step and comp.bytes_per_step() == (dense if step < 2 else comp.bytes_per_step(0))
        for i in (1, 0):  # two buckets, in backward's order
            comp.aggregate([torch.randn(params[i].shape)], [i])
    assert comp.num_steps == 3 and comp.num_compressed_steps == 1
    assert comp.bytes_per_step(0) < dense / 4
    # a state written while the counts were stored separately (extra keys) still loads
    state = {**comp.state_dict(), "num_steps": 3, "compressed_steps": [1, 1]}
    fresh = PowerSGDCompressor(params, config=Config(rank=2, start_compressing_after_num_steps=2))
    fresh.load_state_dict(state)
    assert fresh.num_steps == 3 and fresh.bytes_per_step() == comp.bytes_per_step()


@pytest.mark.device
def test_state_dict_roundtrip_weights_only_and_mismatch(device):
    model = make_model().to(device)
    comp = PowerSGDCompressor(model.parameters(), config=Config(rank=2, start_compressing_after_num_steps=0))
    loss_fn(model, *(t.to(device) for t in batch(0, 0))).backward()
    comp.reduce_gradients()
    buf = io.BytesIO()
    torch.save(comp.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True, map_location="cpu")  # written on the device, read on the CPU
    fresh = PowerSGDCompressor(model.parameters(), config=Config(rank=2, start_compressing_after_num_steps=0))
    fresh.load_state_dict(state)
    assert fresh.num_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.residuals(), comp.residuals(), strict=True))
    other = PowerSGDCompressor(model.parameters(), config=Config(rank=3))
    with pytest.raises(ValueError, match="does not fit"):
        other.load_state_dict(state)


def test_the_paper_variant_keeps_m_and_loads_a_state_that_holds_the_residual():
    """The paper variant keeps each matrix's last M and its factors and owes M - P Q^T (one write of the matrix fewer a
    step), saved as "m". A state written before that (the residual in "errors") resumes the same run: its residual is
    owed through zero factors, and the next call equals the uninterrupted one bitwise (the residual formed by the same
    addmm, then the same addition). The alternating variant keeps the residual itself ("errors")."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((24, 16), (24, 16), (9, 31), (5,))]
    config = Config(rank=3, variant="paper", start_compressing_after_num_steps=1)
    comp = PowerSGDCompressor(params, config=config)
    for _ in range(3):
        grads = [torch.randn(p.shape) for p in params]
        before = comp.state_dict()
        out = comp.aggregate(grads)
    state = comp.state_dict()
    assert "errors" not in state and "errors" in PowerSGDCompressor(params, config=Config(rank=3)).state_dict()
    for i in range(3):  # what is kept is this call's M, its residual M less the approximation it sent
        m = grads[i].reshape(before["m"][i].shape) + torch.addmm(
            before["m"][i], before["p"][i], before["q"][i].T, alpha=-1
        )
        assert torch.equal(state["m"][i], m), i
        # M - P Q^T, a sum of rank + 1 terms, in two orders (addmm; the output's bmm, then a subtraction)
        p, q, u = state["p"][i], state["q"][i], EPS32 / 2
        bound = 2 * (4 * u / (1 - 4 * u)) * (m.abs() + p.abs() @ q.abs().T)
        assert ((comp.residuals()[i].reshape(m.shape) - (m - out[i].reshape(m.shape))).abs() <= bound).all(), i
    old = {k: v for k, v in state.items() if k != "m"}
    old["errors"] = [
        None if e is None else r.reshape(e.shape) for e, r in zip(state["m"], comp.residuals(), strict=True)
    ]
    resumed = PowerSGDCompressor(params, config=config)
    resumed.load_state_dict(old)
    assert all(torch.equal(a, b) for a, b in zip(resumed.residuals(), comp.residuals(), strict=True))
    grads = [torch.randn(p.shape) for p in params]
    assert all(torch.equal(a, b) for a, b in zip(resumed.aggregate(grads), comp.aggregate(grads), strict=True))
    kept = zip(resumed.state_dict()["m"], comp.state_dict()["m"], strict=True)
    assert all(a is b is None or torch.equal(a, b) for a, b in kept)
    # popped into the gradients: the residuals pop_residuals() returns, written where they were asked for
    want = [None if r is None else r.clone() for r in resumed.pop_residuals()]
    into = [torch.full(p.shape, float("nan")) for p in params]
    assert all(a is b for a, b in zip(comp.pop_residuals(into=into), into, strict=True))
    for w, got in zip(want, into, strict=True):
        assert torch.equal(got, torch.zeros_like(got) if w is None else w.view(got.shape))
    with pytest.raises(ValueError, match="takes a tensor shaped as each parameter"):
        comp.pop_residuals(into=into[:3])
    with pytest.raises(ValueError, match=r"holds both 'm' \(a kept M\) and 'errors'"):
        resumed.load_state_dict({**state, "errors": state["m"]})


@pytest.mark.parametrize(("shapes", "rank"), [(((256, 96), (300, 128)), 8), (((33, 27),) * 4, 5)])
def test_a_resume_through_a_checkpoint_is_bitwise(shapes, rank):
    """A state written through the checkpoint's serialisation (tensors made contiguous) resumes as one loaded
    directly and as the run that never stopped: the P Q^T each subtracts from its kept M is the same product of
    operands laid out alike (float64, where this machine's BLAS rounds such a product differently for a P by columns
    and by rows, and for factors that start part-way into a batch's buffer, as same-shape matrices' do)."""
    from powertrain.checkpoint import from_blob, to_blob

    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in shapes]
    for variant in ("paper", "alternating"):
        config = Config(rank=rank, variant=variant, start_compressing_after_num_steps=0, min_compression_rate=0)
        gen = torch.Generator().manual_seed(0)
        steps = [[torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params] for _ in range(5)]
        comp = PowerSGDCompressor(params, config=config)
        for grads in steps[:3]:
            comp.aggregate(grads)
        state = comp.state_dict()
        resumed = []
        for loaded in (from_blob(to_blob(state)), state):
            fresh = PowerSGDCompressor(params, config=config)
            fresh.load_state_dict(loaded)
            resumed.append([fresh.aggregate(grads) for grads in steps[3:]])
        uninterrupted = [comp.aggregate(grads) for grads in steps[3:]]
        for run in resumed:
            for a, b in zip(run, uninterrupted, strict=True):
                assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), variant


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_residuals_are_what_the_next_call_adds_also_after_a_resume(dtype):
    """residuals() is what the next call adds to its gradient (its kept M is gradient + residual, one rounding),
    bitwise, in the run that never stopped and in one resumed from its state, whose residuals are the same: the
    paper variant forms M - P Q^T from factors laid out alike wherever they are kept. The shapes are ones where this
    machine's MKL rounds that product by its operands' layout (512 x 9 at rank 5: P by columns, as the QR leaves it,
    or by rows) and start (three 33 x 47: factors part-way into a stack). A compressed matrix without factors is
    refused."""
    from powertrain.checkpoint import from_blob, to_blob

    shapes = ((512, 9), (33, 47), (33, 47), (33, 47), (5,))
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
    config = Config(rank=5, variant="paper", start_compressing_after_num_steps=0, min_compression_rate=0)
    gen = torch.Generator().manual_seed(0)
    comp = PowerSGDCompressor(params, config=config)
    for _ in range(3):
        comp.aggregate([torch.randn(s, generator=gen, dtype=dtype) for s in shapes])
    resumed = PowerSGDCompressor(params, config=config)
    resumed.load_state_dict(from_blob(to_blob(comp.state_dict())))
    assert all(torch.equal(a, b) for a, b in zip(resumed.residuals(), comp.residuals(), strict=True))
    grads = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    for run in (comp, resumed):
        owed = run.residuals()
        run.aggregate(grads)
        for i, m in enumerate(run.state_dict()["m"][:4]):
            assert torch.equal(m, (grads[i] + owed[i]).reshape(m.shape)), i
    state = comp.state_dict()
    for key, i in (("q", 1), ("p", 0)):  # a kept M without its factors, or none of the three
        bad = {**state, key: [x if j != i else None for j, x in enumerate(state[key])]}
        if i == 0:
            bad["m"] = [None, *state["m"][1:]]
        with pytest.raises(ValueError, match=rf"no factors p and q for the compressed parameters \[{i}\]"):
            resumed.load_state_dict(bad)


def test_bad_inputs_raise_value_error():
    model = make_model()
    params = list(model.parameters())
    agg = PowerSGD(params, config=Config(rank=1))
    with pytest.raises(ValueError, match="gradients for the"):
        agg.aggregate([])
    stranger = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="not given to PowerSGD"):
        optimizer_step(torch.optim.SGD([*params, stranger], lr=0.1), agg)
    with pytest.raises(ValueError, match="floating-point"):
        PowerSGDCompressor([torch.zeros(3, 3, dtype=torch.complex64, requires_grad=True)], config=Config(rank=1))
    with pytest.raises(ValueError, match="powertrain Config"):
        PowerSGDCompressor(params, config={"rank": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Invalid fuse_exact=1: must be True or False"):
        PowerSGDCompressor(params, config=Config(rank=1), fuse_exact=1)  # type: ignore[arg-type]


def test_conv_and_odd_shapes_are_compressed():
    """Which tensors are compressed (public: compressed_names). Same-shape matrices are batched internally; that
    batching gives each matrix what a per-tensor implementation gives is test_powersgd_dist's naive reference."""
    model = make_model()
    comp = PowerSGDCompressor(
        model.named_parameters(), config=Config(rank=2, min_compression_rate=0, start_compressing_after_num_steps=0)
    )
    names = comp.compressed_names
    assert {"conv.weight", "odd.weight", "big.weight", "big2.weight"} <= set(names)
    assert "frozen.weight" not in comp.names  # frozen parameters are left out entirely
    assert not any(n.endswith("bias") for n in names)  # 1-D tensors are never compressed


def test_empty_parameter_list():
    comp = PowerSGDCompressor([], config=Config(rank=1, start_compressing_after_num_steps=0))
    assert comp.aggregate([]) == []
    assert comp.reduce_gradients() is True


@pytest.mark.device
@pytest.mark.parametrize("variant", ["alternating", "paper"])
def test_rows_give_the_same_rows_and_residuals(variant, device):
    """Under FSDP a rank asks only for its rows: same numbers as slicing the full result, same residual, same
    factors and counters. Each step starts both from the same state, so only that step's rounding differs."""
    model = make_model(torch.float64).to(device)
    k, r = 2, 2
    cfg = Config(
        rank=r, min_compression_rate=0, num_iters_per_step=k, start_compressing_after_num_steps=1, variant=variant
    )
    full = PowerSGDCompressor(model.named_parameters(), config=cfg)
    part = PowerSGDCompressor(model.named_parameters(), config=cfg)
    for step in range(3):
        model.zero_grad()
        loss_fn(model, *(t.to(device) for t in batch(0, step, torch.float64))).backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in full.params]
        rows = [(min(1, g.shape[0]), min(5, g.shape[0])) for g in grads]
        part.load_state_dict(full.state_dict())
        frob = [(g + e).norm() for g, e in zip(grads, full.residuals(), strict=True)]
        expected = full.aggregate(grads)
        got = part.aggregate(grads, rows=rows)
        # The factors come from the same operations on the same shapes and inputs in both: bitwise.
        new_full, new_part = full.state_dict(), part.state_dict()
        for key in ("p", "q", "steps"):
            assert _bitwise(new_full[key], new_part[key]), key
        # The approximation's rows: P[lo:hi] Q^T against rows of P Q^T (or of Q P^T, on odd iterations). Each side
        # sums k iterations of r-term products, <= k (r + 1) roundings on terms <= k ||M||_F (|P Q^T|_ij <=
        # ||M||_F for orthonormal P); both sides and 2x safety: 2 k^2 (r + 1) eps ||M||_F, with u = eps / 2.
        # The residual (paper: M - P Q^T against M.baddbmm(P, Q^T, alpha=-1); alternating: the same operations):
        # (r + 1) u (|M| + ||M||_F) <= 2 (r + 1) u ||M||_F per side; both and 2x safety: 4 (r + 1) eps ||M||_F.
        for e, g, (lo, hi), f, name in zip(expected, got, rows, frob, full.names, strict=True):
            within((g - e[lo:hi]).abs(), 2 * k * k * (r + 1) * EPS64 * f, f"rows of {name}")
        for a, b, f, name in zip(full.residuals(), part.residuals(), frob, full.names, strict=True):
            within((a - b).abs(), 4 * (r + 1) * EPS64 * f, f"residual of {name}")


def _bitwise(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_bitwise(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_new_code_gets_the_recommended_config_and_the_reference_config_keeps_its_defaults():
    from powertrain import powersgd as reference_api
    from powertrain.compress import make_compressor
    from powertrain.compress.powersgd import RECOMMENDED
    from powertrain.train.config import RECOMMENDED_POWERSGD, parse_compressor

    params = [torch.nn.Parameter(torch.zeros(8, 6))]
    recommended = Config(**RECOMMENDED)
    assert (recommended.rank, recommended.variant, recommended.factor_dtype) == (32, "paper", "bf16")
    assert recommended.start_compressing_after_num_steps == 5
    assert make_compressor("powersgd", params).config == recommended
    # a field given replaces only itself; the alternating variant cannot send bf16 factors, so it keeps fp32
    assert make_compressor("powersgd", params, rank=8).config == Config(**{**RECOMMENDED, "rank": 8})
    alt = make_compressor("powersgd", params, variant="alternating").config
    assert (alt.rank, alt.variant, alt.factor_dtype, alt.start_compressing_after_num_steps) == (
        32,
        "alternating",
        "fp32",
        5,
    )
    with pytest.raises(ValueError, match="needs variant='paper'"):
        make_compressor("powersgd", params, variant="alternating", factor_dtype="bf16")
    # the command line's specs are the same rule; its default spelled out is exactly RECOMMENDED (start aside)
    assert parse_compressor("powersgd")[1] == dict(RECOMMENDED)
    assert parse_compressor(RECOMMENDED_POWERSGD)[1] == dict(RECOMMENDED)
    assert parse_compressor("powersgd:variant=alternating,start=2")[1]["factor_dtype"] == "fp32"
    # the reference-compatible Config is untouched: the reference's defaults, field for field
    ref = reference_api.Config(rank=4)
    assert (ref.variant, ref.factor_dtype, ref.start_compressing_after_num_steps, ref.min_compression_rate) == (
        "alternating",
        "fp32",
        100,
        2,
    )
