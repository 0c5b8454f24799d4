"""FrozenVarianceAdamW: torch's AdamW until the freeze (bitwise: the same operations in the same order as
``torch.optim.AdamW(foreach=False)``), then each parameter's denominator fixed at its value of the freeze step,
except where no gradient had come (those stay AdamW); a state dict round trip resumes bitwise; bad
arguments are one-line errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from powertrain.optim import FrozenVarianceAdamW
from powertrain.optim.frozen_adamw import _adamw_step_bound

FREEZE, STEPS = 4, 9
KW = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-8}


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(dtype)


def _grads(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 6, generator=g, dtype=next(model.parameters()).dtype)
    model.zero_grad()
    model(x).pow(2).mean().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_adamw_until_the_freeze_then_a_fixed_denominator(dtype):
    """After the freeze: AdamW's update with the frozen denominator, bit for bit (addcdiv's operations), wherever it
    moves a coordinate at most lr * _adamw_step_bound; elsewhere exactly that far, in the update's direction. This
    toy (lr 1e-2, a freeze at step 4) has coordinates of both kinds, which the test checks it saw."""
    ref, model = _model(dtype), _model(dtype)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **KW)
    opt = FrozenVarianceAdamW(model.parameters(), freeze_after=FREEZE, **KW)
    frozen: dict[int, torch.Tensor] = {}
    seen = {"free": 0, "bounded": 0}
    for step in range(1, STEPS + 1):
        before = [p.detach().clone() for p in model.parameters()]
        for m, o in ((ref, ref_opt), (model, opt)):
            _grads(m, step)
            o.step()
        same = all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters(), strict=True))
        assert same == (step <= FREEZE), step  # AdamW's exact bits until the freeze, then another trajectory
        for p, r, old in zip(model.parameters(), ref.parameters(), before, strict=True):
            v_hat = opt.state[p]["exp_avg_sq"]
            if step == FREEZE:  # the bias-corrected second moment of the freeze step, kept from now on
                frozen[id(p)] = ref_opt.state[r]["exp_avg_sq"] / (1 - KW["betas"][1] ** FREEZE)
                assert torch.equal(v_hat, frozen[id(p)])
            if step > FREEZE:  # ... and AdamW's update with it, recomputed here
                assert torch.equal(v_hat, frozen[id(p)])
                step_size = KW["lr"] / (1 - KW["betas"][0] ** step)
                decayed = old * (1 - KW["lr"] * KW["weight_decay"])
                exp_avg, denom = opt.state[p]["exp_avg"], v_hat.sqrt().add_(KW["eps"])
                free = decayed.addcdiv(exp_avg, denom, value=-step_size)
                most = KW["lr"] * _adamw_step_bound(*KW["betas"], step)
                bounded = (exp_avg / denom).abs() * step_size > most
                assert torch.equal(p.detach(), torch.where(bounded, decayed - exp_avg.sign() * most, free))
                seen["free"] += int((~bounded).sum())
                seen["bounded"] += int(bounded.sum())
    assert seen["free"] and seen["bounded"], seen


def test_state_dict_round_trip_resumes_bitwise():
    model = _model(torch.float32)
    opt = FrozenVarianceAdamW(model.parameters(), freeze_after=FREEZE, **KW)
    for step in range(1, 3):
        _grads(model, step)
        opt.step()
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    for step in range(3, STEPS + 1):  # across the freeze
        _grads(model, step)
        opt.step()
    fresh = _model(torch.float32)
    fresh.load_state_dict(saved_model)
    fresh_opt = FrozenVarianceAdamW(fresh.parameters(), freeze_after=FREEZE, **KW)
    fresh_opt.load_state_dict(saved_opt)
    for step in range(3, STEPS + 1):
        _grads(fresh, step)
        fresh_opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters(), strict=True))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"freeze_after": 0}, "Invalid freeze_after=0: must be an integer >= 1"),
        ({"freeze_after": True}, "Invalid freeze_after=True"),
        ({"freeze_after": 3, "lr": -1.0}, "Invalid lr=-1.0: must be >= 0"),
        ({"freeze_after": 3, "eps": 0.0}, "Invalid eps=0.0: must be > 0"),
        ({"freeze_after": 3, "betas": (0.9, 1.0)}, r"Invalid betas=\(0.9, 1.0\): must be two in \[0, 1\)"),
    ],
)
def test_bad_arguments_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FrozenVarianceAdamW(torch.nn.Linear(2, 2).parameters(), **kwargs)


@pytest.mark.parametrize("resume_at", [None, FREEZE + 2])
def test_a_coordinate_first_seen_after_the_freeze_steps_as_adamw(resume_at):
    """Token 1's embedding row has no gradient before the freeze (v_hat = 0): frozen, its first step would be
    lr * m_hat / eps ~ 1e5 here. It stays AdamW: its trajectory equals torch's AdamW's up to rounding. Tolerance:
    AdamW adds (1 - beta2) g^2 with addcmul, this optimizer subtracts it from the negated v (one rounding apart,
    a few ulp of the update, which is ~lr); each step's weight also rounds to an ulp of |w|, so after STEPS steps
    the rows differ by at most STEPS * eps * (max|w| + 10 lr). Row 0 (seen before the freeze only) is frozen.
    Through a state dict round trip after the freeze (resume_at) nothing changes: the mark is in the state."""
    torch.manual_seed(0)
    emb, ref = torch.nn.Embedding(2, 4), torch.nn.Embedding(2, 4)
    ref.load_state_dict(emb.state_dict())
    start = emb.weight[1].detach().clone()
    opts = {**KW, "weight_decay": 0.0}
    opt = FrozenVarianceAdamW(emb.parameters(), freeze_after=FREEZE, **opts)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **opts)
    for step in range(1, STEPS + 1):
        if step == resume_at:
            saved_model, saved_opt = copy.deepcopy(emb.state_dict()), copy.deepcopy(opt.state_dict())
            emb = torch.nn.Embedding(2, 4)
            emb.load_state_dict(saved_model)
            opt = FrozenVarianceAdamW(emb.parameters(), freeze_after=FREEZE, **opts)
            opt.load_state_dict(saved_opt)
        token = torch.tensor([0 if step <= FREEZE else 1])
        for m, o in ((emb, opt), (ref, ref_opt)):
            o.zero_grad()
            m(token).sum().backward()
            o.step()
    eps = torch.finfo(torch.float32).eps
    tol = STEPS * eps * (ref.weight.abs().max().item() + 10 * KW["lr"])
    assert (emb.weight[1] - ref.weight[1]).abs().max().item() <= tol
    assert (emb.weight[1] - start).abs().min().item() > 100 * tol  # it trained
    v = opt.state[emb.weight]["exp_avg_sq"]
    assert torch.signbit(v[1]).all() and not torch.signbit(v[0]).any()


@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.9, 0.999), (0.0, 0.9), (0.95, 0.9), (0.5, 0.3), (0.5, 0.25)])
@pytest.mark.parametrize("step", [1, 2, 7, 60])
def test_the_step_bound_is_the_largest_adamw_step(betas, step):
    """_adamw_step_bound is AdamW's largest |m_hat| / sqrt(v_hat) at ``step`` (eps 0), in float64: the gradients of
    the Cauchy-Schwarz equality case, g_k ~ (beta1 / beta2)**k steps back, reach it to within 1e-12 (relative), and
    2,000 random histories (Gaussian and heavy-tailed, signs mixed) stay below it. q = beta1**2 / beta2 below, above
    and at 1 are covered."""
    b1, b2 = betas
    bound = _adamw_step_bound(b1, b2, step)

    def ratio(g: torch.Tensor) -> torch.Tensor:  # g[..., 0] is the oldest gradient: AdamW's recurrences
        m = v = torch.zeros(g.shape[:-1], dtype=torch.float64)
        for t in range(step):
            m = b1 * m + (1 - b1) * g[..., t]
            v = b2 * v + (1 - b2) * g[..., t] ** 2
        return (m / (1 - b1**step)).abs() / (v / (1 - b2**step)).sqrt()

    k = torch.arange(step - 1, -1, -1, dtype=torch.float64)  # steps back, oldest first
    assert ratio((b1 / b2) ** k).item() == pytest.approx(bound, rel=1e-12)
    gen = torch.Generator().manual_seed(step)
    gauss = torch.randn(1000, step, dtype=torch.float64, generator=gen)
    heavy = torch.randn(1000, step, dtype=torch.float64, generator=gen) / torch.rand(1000, step, generator=gen)
    assert ratio(torch.cat([gauss, heavy])).max().item() <= bound * (1 + 1e-12)


def test_a_coordinate_seen_rarely_before_the_freeze_steps_no_further_than_adamw_could():
    """The failure the bound exists for: coordinate 0's only gradient before a freeze at step 200 came at step 1, so
    its frozen v_hat is 0.05 * 0.95**199 ~ 2e-6 (not 0: it is frozen, not live). At step 201 its gradient is 1 again:
    unbounded, it would move 0.1 / sqrt(2e-6) ~ 70 learning rates; it moves lr * _adamw_step_bound (~1.16 lr), above
    torch's AdamW on the same gradients (~0.45 lr, its v_hat taking the new gradient in) and far below the unbounded
    step. Coordinate 1, given the same gradient every step, takes the unbounded update's step, bit for bit."""
    lr, freeze = 1e-3, 200
    opts = {"lr": lr, "betas": (0.9, 0.95), "weight_decay": 0.0, "eps": 1e-8}
    w, ref = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    opt = FrozenVarianceAdamW([w], freeze_after=freeze, **opts)
    ref_opt = torch.optim.AdamW([ref], foreach=False, **opts)
    for step in range(1, freeze + 2):
        grad = torch.tensor([1.0 if step in (1, freeze + 1) else 0.0, 0.5])
        before, ref_before = w.detach().clone(), ref.detach().clone()
        w.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
    moved, ref_moved = (before - w.detach()).abs(), (ref_before - ref.detach()).abs()
    state = opt.state[w]
    unbounded = state["exp_avg"] * (lr / (1 - 0.9 ** (freeze + 1))) / (state["exp_avg_sq"].sqrt() + 1e-8)
    assert unbounded[0].item() > 50 * lr  # the step the bound stops
    assert moved[0].item() == pytest.approx(lr * _adamw_step_bound(0.9, 0.95, freeze + 1), rel=1e-6)
    assert ref_moved[0].item() < moved[0].item()
    free = before.addcdiv(state["exp_avg"], state["exp_avg_sq"].sqrt() + 1e-8, value=-lr / (1 - 0.9 ** (freeze + 1)))
    assert unbounded[1].item() < lr and torch.equal(w.detach()[1], free[1])


def test_the_step_bound_where_adamw_has_none():
    """beta2 = 0: v_hat is the last gradient's square, so only the first step (or beta1 = 0) is bounded; beta1**2 >
    beta2: the bound grows without limit and is inf once it overflows a float."""
    assert _adamw_step_bound(0.9, 0.0, 1) == 1.0 and _adamw_step_bound(0.9, 0.0, 2) == math.inf
    assert _adamw_step_bound(0.0, 0.0, 50) == 1.0
    assert _adamw_step_bound(0.95, 0.9, 10**6) == math.inf


@pytest.mark.parametrize(
    ("betas", "lr", "step"),
    [((0.9, 0.8), 1e-3, 20_000), ((0.9, 0.0), 0.0, 10), ((0.9, 0.95), 0.0, 10)],
    ids=["bound-past-float-max", "no-bound-lr-0", "lr-0"],
)
def test_without_a_finite_bound_the_update_is_adamws_with_the_frozen_denominator(betas, lr, step):
    """Where lr * bound is not a finite float of the parameter's dtype (beta1**2 > beta2 after many steps; an infinite
    bound at lr 0 is nan) the update is the unbounded one, bit for bit: no overflow error, no nan. At lr 0 nothing
    moves."""
    w = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
    opt = FrozenVarianceAdamW([w], lr=lr, betas=betas, weight_decay=0.0, freeze_after=1)
    state = opt.state[w]
    state.update(step=torch.tensor(float(step)), exp_avg=torch.tensor([1e-3, -2.0, 0.3]))
    state["exp_avg_sq"] = torch.tensor([1e-12, 1e-6, 0.01])  # frozen, some tiny
    w.grad = torch.tensor([1.0, -1.0, 0.5])
    before = w.detach().clone()
    exp_avg = state["exp_avg"].lerp(w.grad, 1 - betas[0])
    denom = state["exp_avg_sq"].sqrt().add(1e-8)
    expect = before.addcdiv(exp_avg, denom, value=-lr / (1 - betas[0] ** (step + 1)))
    opt.step()
    assert torch.equal(w.detach(), expect) and w.isfinite().all()
    if lr == 0:
        assert torch.equal(w.detach(), before)
