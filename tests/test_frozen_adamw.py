"""FrozenVarianceAdamW: torch's AdamW until the freeze (bitwise: the same operations in the same order as
``torch.optim.AdamW(foreach=False)``), then each parameter's denominator fixed at its value of the freeze step,
except where no gradient had come (those stay AdamW); a state dict round trip resumes bitwise; bad
arguments are one-line errors."""

from __future__ import annotations

import copy

import pytest
import torch

from powertrain.optim import FrozenVarianceAdamW

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adamw_until_the_freeze_then_a_fixed_denominator(dtype):
    ref, model = _model(dtype), _model(dtype)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **KW)
    opt = FrozenVarianceAdamW(model.parameters(), freeze_after=FREEZE, **KW)
    frozen: dict[int, torch.Tensor] = {}
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
                expect = (old * (1 - KW["lr"] * KW["weight_decay"])).addcdiv_(
                    opt.state[p]["exp_avg"], v_hat.sqrt().add_(KW["eps"]), value=-step_size
                )
                assert torch.equal(p.detach(), expect)


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
