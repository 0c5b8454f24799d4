"""DistributedShampoo: against a dense float64 Shampoo written here (world size 1), distributed == single
process bitwise on 2 and 4 gloo ranks, resume, and refused options."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_utils import case, guard, run_ranks
from models import batch, loss_fn, make_model
from powertrain.optim.shampoo.optimizer import DistributedShampoo


def _dense_reference(grads: list[torch.Tensor], w0: torch.Tensor, lr: float, eps: float) -> torch.Tensor:
    """Textbook Shampoo on one matrix, float64: L += G G^T, R += G^T G, W -= lr L^-1/4 G R^-1/4 with the
    roots recomputed every step (frequency 1, from step 1), no grafting, filtering, momentum or decay."""

    def root(a: torch.Tensor) -> torch.Tensor:
        vals, vecs = torch.linalg.eigh(a)
        return vecs @ torch.diag((vals.clamp_min(0) + eps) ** -0.25) @ vecs.T

    w = w0.double().clone()
    left = torch.zeros(w.shape[0], w.shape[0], dtype=torch.float64)
    right = torch.zeros(w.shape[1], w.shape[1], dtype=torch.float64)
    for g in grads:
        g = g.double()
        left += g @ g.T
        right += g.T @ g
        w -= lr * root(left) @ g @ root(right)
    return w


def test_single_process_matches_dense_float64_reference():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 9))
    w0 = w.detach().clone()
    # max_preconditioner_dim=9: the 6x9 matrix stays one block with two factors (a larger limit would merge
    # it into a 54-vector with one 54x54 factor, as the reference implementation's dimension merging does)
    opt = DistributedShampoo([w], lr=0.05, betas=(0.0, 1.0), epsilon=1e-4, precondition_frequency=1,
                             start_preconditioning_step=1, grafting="none", max_preconditioner_dim=9)  # fmt: skip
    g_ = torch.Generator().manual_seed(1)
    grads = [torch.randn(6, 9, generator=g_) for _ in range(6)]
    for g in grads:
        w.grad = g.clone()
        opt.step()
    ref = _dense_reference(grads, w0, 0.05, 1e-4)
    err = (w.detach().double() - ref).norm() / ref.norm()
    assert err < 1e-5, err


def _options() -> dict[str, Any]:
    # small blocks so that every parameter has several and ranks share the work; every feature on
    return dict(lr=1e-2, betas=(0.9, 0.999), epsilon=1e-8, momentum=0.9, nesterov=True, weight_decay=0.01,
                max_preconditioner_dim=8, precondition_frequency=2, start_preconditioning_step=2,
                grafting="adam")  # fmt: skip


def _train(opt_group: Any, steps: int, start: int = 0, state: dict | None = None) -> tuple[torch.Tensor, Any]:
    model = make_model()
    opt = DistributedShampoo(model.parameters(), group=opt_group, **_options())
    if state is not None:
        opt.load_state_dict({k: v for k, v in state.items() if k != "params"})
        with torch.no_grad():
            for p, q in zip(model.parameters(), state["params"], strict=True):
                p.copy_(q)
    saved = None
    for step in range(start, steps):
        opt.zero_grad()
        loss_fn(model, *batch(0, step)).backward()  # the same (already averaged) gradient on every rank
        opt.step()
        if step + 1 == 3:
            # state_dict() holds the live tensors: copy them, as torch.save would
            saved = {**copy.deepcopy(opt.state_dict()), "params": [p.detach().clone() for p in model.parameters()]}
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), (opt, saved)


def shampoo_cases(rank: int, world: int) -> dict[str, Any]:
    solo = [dist.new_group([r]) for r in range(world)][rank]  # a one-rank group: the single-process optimizer

    def run() -> dict[str, Any]:
        dist_params, (opt, saved) = _train(None, 6)
        single, _ = _train(solo, 6)
        resumed, _ = _train(None, 6, start=3, state=saved)
        owned = sorted({b.owner for b in opt.blocks})
        return {"dist": dist_params, "single": single, "resumed": resumed, "owners": owned}

    def wrong_world() -> str:
        _, (_, saved) = _train(None, 3)
        model = make_model()
        try:
            DistributedShampoo(model.parameters(), group=solo, **_options()).load_state_dict(saved)
        except ValueError as e:
            return str(e)
        return ""

    return {"run": guard(run), "wrong_world": guard(wrong_world)}


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_equals_single_process_bitwise_and_resumes(world):
    runs = run_ranks(shampoo_cases, world, timeout=120)
    for r in case(runs, "run"):
        assert r["owners"] == list(range(world)), "every rank owns blocks"
        assert torch.equal(r["dist"], r["single"])
        assert torch.equal(r["resumed"], r["dist"])
    for msg in case(runs, "wrong_world"):
        assert "resume with the same world size" in msg


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"lr": 0.0}, "lr=0.0"), ({"betas": (1.0, 0.9)}, "betas[0]=1.0"), ({"grafting": "sgd"}, "grafting='sgd'"),
     ({"precondition_frequency": 0}, "precondition_frequency=0"), ({"root_method": "svd"}, "root_method='svd'"),
     ({"nesterov": True}, "nesterov=True needs momentum"), ({"max_preconditioner_dim": 0}, "max_preconditioner_dim=0")],
)  # fmt: skip
def test_bad_options_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        DistributedShampoo([torch.nn.Parameter(torch.zeros(3, 3))], **kwargs)
