"""GaLoreAdamW: bitwise parity with galore-torch 1.0 (exact SVD), the projector math, randomized SVD quality,
optimizer-state memory against torch's AdamW, resume, refused options, and 2-rank gloo runs under DDP, FSDP2
and SimpleFSDP against the single-process optimizer."""

from __future__ import annotations

import copy
import io
import math
import threading
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from dist_utils import case, guard, run_ranks
from models import batch, loss_fn, make_model
from powertrain.optim.galore import GaLoreAdamW, optimizer_state_bytes
from powertrain.optim.galore import projector as proj

EPS32 = torch.finfo(torch.float32).eps


def _ulp_nudged(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``t`` with every entry moved by one float32 unit of its value (eps32 relative), signs at random: what a
    different summation order does to a sum of two partial sums, for measuring a computation's sensitivity to
    it on the machine running the test."""
    return t * (1 + EPS32 * (2 * torch.randint(0, 2, t.shape, generator=gen) - 1))


# ------------------------------------------------------------------------------------------ the reference


def _reference_adamw() -> Any:
    """galore-torch's AdamW (see tools/bench_optimizers.py's ``load_galore_torch``)."""
    from bench_optimizers import load_galore_torch

    reference = load_galore_torch()
    if reference is None:
        pytest.skip("galore-torch is not installed (pip install --no-deps galore-torch): no reference to compare")
    return reference


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    # weights 24x16 (tall), 10x24 (wide), 6x10 (wide); biases in a group without rank (plain AdamW)
    return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 10), nn.Tanh(), nn.Linear(10, 6))


def _train_mlp(make_opt: Any, proj_type: str, steps: int = 12) -> torch.Tensor:
    model = _mlp()
    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() != 2]
    groups = [
        {"params": vectors},
        {"params": matrices, "rank": 4, "update_proj_gap": 3, "scale": 0.25, "proj_type": proj_type},
    ]
    opt = make_opt(groups)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 6, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "left", "right", "full"])
def test_exact_svd_matches_galore_torch_bitwise(proj_type):
    """Same operations in the same order and the same SVD factor layouts: bitwise in fp32 through four
    refreshes (moments kept across them, as the reference does), weight decay and bias correction."""
    reference = _reference_adamw()
    ref = _train_mlp(lambda g: reference(g, lr=1e-2, weight_decay=0.1, no_deprecation_warning=True), proj_type)
    ours = _train_mlp(lambda g: GaLoreAdamW(g, lr=1e-2, weight_decay=0.1, svd="exact"), proj_type)
    assert torch.equal(ours, ref)
    # the default, randomized SVD, takes another (approximate) subspace: close, not equal. Not a rounding bound:
    # these gradients' spectra decay slowly, so the sketch's subspace is off by an angle of ~0.1 and the runs
    # part by about that fraction of the distance travelled (measured 6-9%); a wrong subspace parts by ~all of it
    randomized = _train_mlp(lambda g: GaLoreAdamW(g, lr=1e-2, weight_decay=0.1), proj_type)
    assert not torch.equal(randomized, ref)
    travelled = (ref - torch.cat([p.detach().reshape(-1) for p in _mlp().parameters()])).abs().max()
    assert (randomized - ref).abs().max() < 0.25 * travelled


# ------------------------------------------------------------------------------------------------- math


def test_projection_side_follows_the_reference():
    assert [proj.projection_side(8, 4, t) for t in ("std", "reverse_std", "left", "right", "full")] == [
        "right",
        "left",
        "left",
        "right",
        "full",
    ]
    assert [proj.projection_side(4, 8, t) for t in ("std", "reverse_std")] == ["left", "right"]
    assert proj.projection_side(5, 5, "std") == "right"
    with pytest.raises(ValueError, match="proj_type='up'"):
        proj.projection_side(4, 4, _any("up"))


def _any(value: Any) -> Any:
    """A value the type checker lets through, for tests of refused input."""
    return value


def _spectrum_matrix(m: int, n: int, decay: float, seed: int, rank: int | None = None) -> torch.Tensor:
    """A random m x n matrix with singular values decay^i (only the first ``rank`` nonzero when given)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, min(m, n), generator=g)).Q
    v = torch.linalg.qr(torch.randn(n, min(m, n), generator=g)).Q
    s = decay ** torch.arange(min(m, n), dtype=torch.float32)
    if rank is not None:
        s[rank:] = 0
    return (u * s) @ v.T


def _subspace_gap(a_rn: torch.Tensor, b_rn: torch.Tensor) -> float:
    """Spectral norm of the difference of the projectors onto two row spaces (sine of the largest angle)."""
    return torch.linalg.matrix_norm(a_rn.T @ a_rn - b_rn.T @ b_rn, ord=2).item()


def test_randomized_svd_finds_the_top_subspace():
    exact_rank = _spectrum_matrix(40, 30, 0.9, 0, rank=5)
    graded = _spectrum_matrix(50, 30, 0.7, 1)
    wide = _spectrum_matrix(12, 33, 0.6, 2)
    sketches = [proj.Sketch(x, 5, seed=i) for i, x in enumerate((exact_rank, graded, wide))]
    bases = proj.randomized_right_bases(sketches, oversample=5, power_iters=2)
    gaps = []
    for x, b in zip((exact_rank, graded, wide), bases, strict=True):
        m, n = x.shape
        k = min(10, m, n)
        assert b.shape == (5, n)
        # Householder Q (n rows) is orthonormal to ~n eps32, V = Q W adds a k-term product: (n + k) eps32, the
        # worst-case accumulation (measured 1/13 of it)
        assert ((b @ b.T - torch.eye(5)).abs() <= (n + k) * EPS32).all(), "orthonormal rows"
        _, exact = proj.exact_bases(x, 5, "right")
        assert exact is not None
        # randomized subspace iteration: sin(angle) <= C (s_{k+1} / s_r)^(2q + 1), C the Gaussian sketch's
        # factor (Halko et al. 2011, sec. 10: sqrt(r / (p - 1)) + e sqrt(k) / p sqrt(n - r)); plus float32: the Gram
        # A^T A perturbed by sqrt(m) eps32 |A|^2 turns the subspace by that over the gap s_r^2 - s_{r+1}^2
        # (Davis-Kahan); 2x for the rounding of the other stages. Measured at most 0.28 of the bound
        s = [*torch.linalg.svdvals(x.double()).tolist(), 0.0]
        c = math.sqrt(5 / 4) + math.e * math.sqrt(k) / 5 * math.sqrt(min(m, n) - 5)
        gap = c * (s[k] / s[4]) ** 5 + 2 * math.sqrt(m) * EPS32 * s[0] ** 2 / (s[4] ** 2 - s[5] ** 2)
        assert _subspace_gap(b, exact) < gap
        gaps.append(gap)
    # the same seed gives the same bits; another seed another sketch (the same subspace here: both within the
    # bound above of the exact one)
    again = proj.randomized_right_bases(sketches[:1], oversample=5, power_iters=2)
    assert torch.equal(again[0], bases[0])
    other = proj.randomized_right_bases([proj.Sketch(exact_rank, 5, seed=99)], oversample=5, power_iters=2)
    assert not torch.equal(other[0], bases[0]) and _subspace_gap(other[0], bases[0]) < 2 * gaps[0]
    # a zero gradient still gives an orthonormal basis (no NaN): Q of a zero sketch, then a 3-term product
    (zero,) = proj.randomized_right_bases([proj.Sketch(torch.zeros(6, 9), 3, seed=0)], oversample=2, power_iters=1)
    assert torch.isfinite(zero).all() and ((zero @ zero.T - torch.eye(3)).abs() <= (9 + 3) * EPS32).all()


def test_randomized_svd_of_row_shards_equals_the_whole_matrix():
    """Two "ranks" (threads) holding 7 and 6 rows of a 13 x 9 matrix, with an in-process sum over shards, agree
    bitwise and get the basis of the whole matrix (the same sketch: Omega is cut by rows)."""
    x = _spectrum_matrix(13, 9, 0.5, 3)
    whole = proj.randomized_right_bases([proj.Sketch(x, 3, seed=7)], oversample=2, power_iters=2)[0]
    barrier, deposited, results = threading.Barrier(2, timeout=30), {}, {}

    def sum_two(ts: list[torch.Tensor]) -> None:
        deposited[threading.current_thread().name] = ts
        barrier.wait()
        sums = [a + b for a, b in zip(deposited["0"], deposited["7"], strict=True)]  # same order on both
        barrier.wait()  # both have summed before either overwrites its inputs
        for t, total in zip(ts, sums, strict=True):
            t.copy_(total)

    def shard(lo: int, hi: int) -> None:
        sk = proj.Sketch(x[lo:hi], 3, seed=7, row_offset=lo, total_rows=13)
        results[lo] = proj.randomized_right_bases([sk], oversample=2, power_iters=2, sum_shards=sum_two)[0]

    threads = [threading.Thread(target=shard, args=r, name=str(r[0])) for r in ((0, 7), (7, 13))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert torch.equal(results[0], results[7]), "both shards compute the same basis"
    # a sum of two shards' products differs from the whole product by about one rounding per entry, as a
    # one-ulp change of x does: 4x the largest change of the whole basis under 4 such changes (measured 1/3)
    gen = torch.Generator().manual_seed(0)
    nudged = [proj.Sketch(_ulp_nudged(x, gen), 3, seed=7) for _ in range(4)]
    sensitivity = max((b - whole).abs().max() for b in proj.randomized_right_bases(nudged, oversample=2, power_iters=2))
    assert (results[0] - whole).abs().max() <= 4 * sensitivity


def test_project_back_inverts_project_at_full_rank_and_scales():
    g = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
    sides: tuple[proj.Side, ...] = ("left", "right", "full")
    for side in sides:
        left, right = proj.exact_bases(g, 5, side)
        low = proj.project(g, side, left, right)
        assert low.shape == {"left": (5, 5), "right": (7, 5), "full": (5, 5)}[side]
        back = proj.project_back(low, side, left, right, 0.5)
        # float32 SVD: factors orthonormal and G's spaces reproduced to ~(m + n) eps32 ||G||_2 (Householder
        # bidiagonalisation), then two r-term products: (m + n + 2r) eps32 ||G||_2 (measured 1/5 of it)
        bound = 0.5 * (7 + 5 + 2 * 5) * EPS32 * torch.linalg.matrix_norm(g, ord=2)
        assert ((back - 0.5 * g).abs() <= bound).all(), side


def test_carry_moments_maps_the_first_moment_exactly():
    gen = torch.Generator().manual_seed(0)
    old_right = torch.linalg.qr(torch.randn(9, 4, generator=gen)).Q.T.contiguous()  # 4 x 9
    old_left = torch.linalg.qr(torch.randn(6, 4, generator=gen)).Q  # 6 x 4
    m, v = torch.randn(6, 4, generator=gen), torch.rand(6, 4, generator=gen)

    def close(a: torch.Tensor, b: torch.Tensor, bound: torch.Tensor) -> bool:
        return bool(((a - b).abs() <= bound).all())

    # The rotation R = B_old B_new^T of orthonormal rows: |R - exact| <= 2 gamma_9 (the 9-term products, Q's
    # orthonormality from Householder QR), then M R takes a 4-term product: (2 * 9 + 4) eps32 times the row
    # sums of |M| (|R| <= 1), worst case; measured at most 1/16 of it. R * R squares R's error (2x)
    rows = lambda t: t.abs().sum(dim=1, keepdim=True)
    # the same basis: nothing changes
    m2, v2 = proj.carry_moments(m, v, "right", (None, old_right), (None, old_right))
    assert close(m2, m, (2 * 9 + 4) * EPS32 * rows(m)) and close(v2, v, (4 * 9 + 4) * EPS32 * rows(v))
    # a permuted, sign-flipped basis: the moments follow the columns exactly
    perm, signs = torch.tensor([2, 0, 3, 1]), torch.tensor([1.0, -1.0, 1.0, -1.0])
    new_right = old_right[perm] * signs[:, None]
    m3, v3 = proj.carry_moments(m, v, "right", (None, old_right), (None, new_right))
    assert close(m3, m[:, perm] * signs, (2 * 9 + 4) * EPS32 * rows(m))
    assert close(v3, v[:, perm], (4 * 9 + 4) * EPS32 * rows(v))
    # in general the full-size first moment is projected onto the new subspace: products of 9, 4, 4, 9 and 4
    # terms on either side, worst case 30 eps32 times the product of the absolute values
    new_right = torch.linalg.qr(torch.randn(9, 4, generator=gen)).Q.T
    m4, _ = proj.carry_moments(m, v, "right", (None, old_right), (None, new_right))
    chain = m.abs() @ old_right.abs() @ new_right.abs().T @ new_right.abs()
    assert close(m4 @ new_right, (m @ old_right) @ new_right.T @ new_right, 30 * EPS32 * chain)
    ml, vl = torch.randn(4, 9, generator=gen), torch.rand(4, 9, generator=gen)
    new_left = old_left[:, perm] * signs
    m5, v5 = proj.carry_moments(ml, vl, "left", (old_left, None), (new_left, None))
    # the left side: 6-term products in R, then a 4-term product down the columns of M
    cols = lambda t: t.abs().sum(dim=0, keepdim=True)
    assert close(m5, ml[perm] * signs[:, None], (2 * 6 + 4) * EPS32 * cols(ml))
    assert close(v5, vl[perm], (4 * 6 + 4) * EPS32 * cols(vl))


# ---------------------------------------------------------------------------------------- the optimizer


def test_memory_of_state_against_adamw():
    """Four 64 x 64 weights at rank 16 (d/4): moments 2 * 64 * 16 and a 16 x 64 projector per weight, 62.5%
    less than AdamW's two 64 x 64 moments, measured on both optimizers' real state after a step."""
    d, r = 64, 16

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(4)])

    def stepped(make_opt: Any) -> torch.optim.Optimizer:
        m = model()
        opt = make_opt(m.parameters())
        m(torch.randn(8, d)).square().mean().backward()
        opt.step()
        return opt

    galore = stepped(lambda ps: GaLoreAdamW(ps, rank=r))
    assert isinstance(galore, GaLoreAdamW)
    adamw = stepped(lambda ps: torch.optim.AdamW(ps))
    ours, theirs = galore.state_bytes(), optimizer_state_bytes(adamw)
    assert ours == 4 * 4 * (2 * d * r + r * d)
    assert theirs == 4 * (4 * 2 * d * d + 4)  # two fp32 moments and a 0-d fp32 step tensor per weight
    assert ours <= 0.4 * theirs, f"GaLore state {ours} B vs AdamW {theirs} B: less than 60% saved"


def _adversarial_opt(model: nn.Module, **kw: Any) -> GaLoreAdamW:
    return GaLoreAdamW(model.parameters(), lr=1e-2, weight_decay=0.01, rank=3, update_proj_gap=2, **kw)


def _teacher(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable task: 4 batches labelled by a fixed random model of the same architecture."""
    x, _ = batch(0, step % 4, n=16)
    with torch.no_grad():
        return x, make_model(seed=123)(x)


def test_conv_weights_are_matrices_and_vectors_plain_adamw():
    model = make_model()
    opt = _adversarial_opt(model)
    losses = []
    for step in range(25):
        opt.zero_grad()
        loss = loss_fn(model, *_teacher(step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-4:]) < 0.2 * sum(losses[:4]), losses  # measured: 0.0374 vs 0.5088
    st = opt.state
    assert st[model.conv.weight]["exp_avg"].shape == (3, 27)  # 8 x 27 matrix, wide: left side under std
    assert st[model.conv.weight]["proj_left"].shape == (8, 3)
    assert st[model.fc1.weight]["exp_avg"].shape == (3, 72)
    assert st[model.odd.weight]["exp_avg"].shape == (3, 15)  # 7 x 15
    assert st[model.proj.weight]["exp_avg"].shape == (3, 32)  # 15 x 32
    assert st[model.fc1.bias]["exp_avg"].shape == (32,) and "proj_left" not in st[model.fc1.bias]
    assert model.unused.weight not in st and model.frozen.weight not in st


@pytest.mark.parametrize("moments", ["keep", "project"])
def test_resume_is_bitwise(moments):
    """Train 5 steps, save through torch.save / torch.load(weights_only=True), continue to 9 in a fresh
    model and optimizer: equal to the uninterrupted run (randomized SVD needs no saved RNG state)."""

    def run(steps: int, start: int = 0, saved: dict | None = None) -> tuple[torch.Tensor, dict | None]:
        model = make_model()
        opt = _adversarial_opt(model, moments_on_refresh=moments)
        if saved is not None:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optim"])
        out = None
        for step in range(start, steps):
            opt.zero_grad()
            loss_fn(model, *batch(0, step)).backward()
            opt.step()
            if step + 1 == 5:
                buf = io.BytesIO()
                torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
                buf.seek(0)
                out = torch.load(buf, weights_only=True)
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), out

    full, saved = run(9)
    assert saved is not None
    resumed, _ = run(9, start=5, saved=saved)
    assert torch.equal(resumed, full)


def test_load_refuses_other_layouts():
    def stepped(shape: tuple[int, int]) -> GaLoreAdamW:
        p = nn.Parameter(torch.ones(shape))
        opt = GaLoreAdamW([p], rank=3)
        p.grad = torch.randn(shape)
        opt.step()
        return opt

    saved = stepped((6, 4)).state_dict()  # tall: moments 6 x 3
    with pytest.raises(ValueError, match=r"this rank needs .*; resume with the same sharding"):
        stepped((4, 6)).load_state_dict(copy.deepcopy(saved))  # wide: 3 x 6
    with pytest.raises(ValueError, match="Not a GaLoreAdamW state dict"):
        stepped((6, 4)).load_state_dict(torch.optim.AdamW([nn.Parameter(torch.ones(6, 4))]).state_dict())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 0}, "rank=0"),
        ({"rank": 2.5}, "rank=2.5"),
        ({"update_proj_gap": 0}, "update_proj_gap=0"),
        ({"scale": 0.0}, "scale=0.0"),
        ({"scale": -1}, "scale=-1"),
        ({"proj_type": "up"}, "proj_type='up'"),
        ({"svd": "lanczos"}, "svd='lanczos'"),
        ({"oversample": -1}, "oversample=-1"),
        ({"lr": -1.0}, "lr=-1.0"),
        ({"betas": (1.0, 0.9)}, "betas=\\(1.0, 0.9\\)"),
        ({"moments_on_refresh": "rotate"}, "moments_on_refresh='rotate'"),
        ({"seed": -2}, "seed=-2"),
    ],
)
def test_bad_options_refused(kwargs, message):
    kwargs = {"rank": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        GaLoreAdamW([nn.Parameter(torch.zeros(3, 3))], **kwargs)
    if "seed" not in kwargs:  # a param group is checked the same way (the seed is the optimizer's)
        with pytest.raises(ValueError, match=message):
            GaLoreAdamW([{"params": [nn.Parameter(torch.zeros(3, 3))], **kwargs}])
        opt = GaLoreAdamW([nn.Parameter(torch.zeros(3, 3))], rank=2)
        with pytest.raises(ValueError, match=message):  # a group added later: refused, and not kept
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, 3))], **kwargs})
        assert len(opt.param_groups) == 1


def test_no_rank_anywhere_warns():
    with pytest.warns(UserWarning, match="plain AdamW"):
        GaLoreAdamW([nn.Parameter(torch.zeros(3, 3))])


# --------------------------------------------------------------------------------- 2 gloo ranks: DDP, FSDP


class _Net(nn.Module):
    """Uneven shards on 2 ranks: conv 5 x 18 (3 + 2 rows), fc1 19 x 45 (10 + 9), fc2 27 x 19 tall (14 + 13),
    head 1 x 27 and its bias (rank 1 holds no rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 5, 3)
        self.fc1 = nn.Linear(45, 19)
        self.fc2 = nn.Linear(19, 27)
        self.head = nn.Linear(27, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x)).flatten(1)
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(h)))))


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 2, 5, 5, generator=g), torch.randn(8, 1, generator=g)


STEPS = 7
OPTS: dict[str, Any] = dict(lr=1e-2, weight_decay=0.05, rank=3, update_proj_gap=3)


def _params(model: nn.Module) -> torch.Tensor:
    parts = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().reshape(-1) for p in parts])


def _single(world: int, nudge: bool = False, **kw: Any) -> torch.Tensor:
    """The single-process optimizer on every rank's data (the mean of the ranks' mean losses), the gradient
    computed as DDP computes it: each rank's batch on its own, then averaged (adding two halves is exact, so
    the sum's order does not matter). ``nudge``: every gradient entry moved by one ulp (see _ulp_nudged)."""
    model = _net()
    opt = GaLoreAdamW(model.parameters(), **{**OPTS, **kw})
    gen = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        opt.zero_grad()
        for r in range(world):
            x, y = _data(r, step)
            nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():
            assert p.grad is not None, "every parameter of _Net gets a gradient"
            p.grad = _ulp_nudged(p.grad / world, gen) if nudge else p.grad / world
        opt.step()
    return _params(model)


def _distributed(
    rank: int,
    model: nn.Module,
    steps: range = range(STEPS),
    opt: GaLoreAdamW | None = None,
    save_at: int = -1,
    **kw: Any,
) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = opt or GaLoreAdamW(model.parameters(), **{**OPTS, **kw})
        saved = None
        for step in steps:
            opt.zero_grad()
            nn.functional.mse_loss(model(_data(rank, step)[0]), _data(rank, step)[1]).backward()
            opt.step()
            if step + 1 == save_at:
                buf = io.BytesIO()
                torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
                saved = buf.getvalue()
    messages = [str(w.message) for w in caught if "projected on its columns" in str(w.message)]
    bases = [st[k].reshape(-1) for st in opt.state.values() for k in ("proj_left", "proj_right") if k in st]
    return {
        "params": _params(model),
        "bases": torch.cat(bases),
        "bytes": opt.comm.stats.bytes_sent,
        "warnings": len(messages),
        "saved": saved,
        "state_bytes": opt.state_bytes(),
    }


def galore_cases(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from powertrain.simple_fsdp import data_parallel

    mesh = init_device_mesh("cpu", (world,))

    def fsdp() -> nn.Module:
        model = _net()
        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def ddp(**kw: Any) -> dict[str, Any]:
        model = DDP(_net())
        out = _distributed(rank, model, **kw)
        return {**out, "single": _single(world, **kw)}

    def sharded(make: Any, **kw: Any) -> dict[str, Any]:
        out = _distributed(rank, make(), **kw)
        single_kw = {**kw, "proj_type": "right"}  # what the sharded run uses for every weight
        return {**out, "single": _single(world, **single_kw), "nudged": _single(world, nudge=True, **single_kw)}

    def resume() -> dict[str, Any]:
        full = _distributed(rank, fsdp(), save_at=3)
        saved = torch.load(io.BytesIO(full["saved"]), weights_only=True)
        model = fsdp()
        model.load_state_dict(saved["model"])
        opt = GaLoreAdamW(model.parameters(), **OPTS)
        opt.load_state_dict(saved["optim"])
        resumed = _distributed(rank, model, steps=range(3, STEPS), opt=opt)
        return {"full": full["params"], "resumed": resumed["params"]}

    return {
        "ddp": guard(ddp),
        "ddp_exact": guard(ddp, svd="exact"),
        "fsdp_randomized": guard(sharded, fsdp),
        # no oversampling or power iteration: the basis is the raw sketch's, so every Omega row must be right
        "fsdp_raw_sketch": guard(sharded, fsdp, oversample=0, power_iters=0),
        "fsdp_exact": guard(sharded, fsdp, svd="exact"),
        "fsdp_project": guard(sharded, fsdp, moments_on_refresh="project", proj_type="right"),
        "simple_fsdp": guard(sharded, lambda: data_parallel(_net(), mesh)),
        "resume": guard(resume),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_ranks(galore_cases, 2, timeout=180)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", ["ddp", "ddp_exact"])
def test_ddp_ranks_agree_bitwise_without_communication(two_ranks, name):
    runs = case(two_ranks, name)
    assert torch.equal(runs[0]["params"], runs[1]["params"]), "every rank computes the same projector"
    assert torch.equal(runs[0]["bases"], runs[1]["bases"])
    assert all(r["bytes"] == 0 for r in runs), "replicated gradients: the refresh needs no collective"
    # bitwise: DDP averages the same per-rank gradients (each rank's batch through the same operations, 1 thread)
    # as the single-process run does, and the optimizer then runs the same operations on the same gradient
    assert torch.equal(runs[0]["params"], runs[0]["single"])


@pytest.mark.parametrize("name", ["fsdp_randomized", "fsdp_raw_sketch", "fsdp_exact", "fsdp_project", "simple_fsdp"])
def test_sharded_matches_single_process(two_ranks, name):
    """FSDP2 / SimpleFSDP on 2 ranks (uneven shards, a rank without rows) against the single-process optimizer
    on the same data: equal up to the rounding of the sums over shards and of the row blocks' products (measured
    max |diff| 0 to 1.1e-7 over 7 steps with 3 refreshes; a wrong sketch or subspace gives ~1e-2)."""
    runs = case(two_ranks, name)
    assert runs[0]["bases"].numel() > 0 and torch.equal(runs[0]["bases"], runs[1]["bases"]), "replicated projectors"
    # The sums over shards differ from the whole matrix's by about one rounding per entry: 4x the divergence
    # a one-ulp change of every gradient entry causes over the same steps, plus one ulp of W per in-place
    # update (2 per step) where the updates differ at all (measured at most 1/6 of the bound)
    params, single = runs[0]["params"], runs[0]["single"]
    bound = 4 * _max_diff(runs[0]["nudged"], single) + 2 * STEPS * EPS32 * single.abs().max().item()
    assert _max_diff(params, single) < bound
    assert all(r["bytes"] > 0 for r in runs), "the refresh communicates over the shards"
    # conv (5 x 18), fc1 (19 x 45) and head (1 x 27) are wide: the default std would project their rows
    assert [r["warnings"] for r in runs] == [0 if name == "fsdp_project" else 3] * 2


def test_sharded_state_is_split_across_ranks(two_ranks):
    fsdp, ddp = case(two_ranks, "fsdp_randomized"), case(two_ranks, "ddp")
    # moments are sharded with the rows, projectors replicated: each rank holds less than a DDP rank
    assert all(r["state_bytes"] < ddp[0]["state_bytes"] for r in fsdp)


def test_sharded_resume_is_bitwise(two_ranks):
    for r in case(two_ranks, "resume"):
        assert torch.equal(r["resumed"], r["full"])
