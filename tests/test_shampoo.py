"""DistributedShampoo: against a dense float64 Shampoo written here (world size 1), distributed == single
process bitwise on 2 and 4 gloo ranks, resume, and refused options."""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_utils import case, guard, run_ranks, value_errors
from models import batch, loss_fn, make_model
from powertrain.optim.shampoo.optimizer import DistributedShampoo

EPS32 = torch.finfo(torch.float32).eps


def _perturbed(grads: list[torch.Tensor], ulps: float = 3.0) -> list[torch.Tensor]:
    """The gradients in float64, every entry moved by ``ulps`` float32 units of its value, signs at random: the
    float32 optimizer's products and eigendecompositions (of <= 9-term sums: sqrt(9) = 3 eps32, typical) are
    exact for inputs perturbed about this much, so the divergence this causes in a float64 reference estimates
    the float32 run's error on this machine, whatever the conditioning of the steps taken."""
    gen = torch.Generator().manual_seed(0)
    return [g.double() * (1 + ulps * EPS32 * (2 * torch.randint(0, 2, g.shape, generator=gen) - 1)) for g in grads]


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
    # max_preconditioner_dim=9: the 6x9 matrix is one block with two factors (so it is with any larger limit: a
    # matrix is never merged into a vector, unlike in the reference implementation's default)
    opt = DistributedShampoo(
        [w],
        lr=0.05,
        betas=(0.0, 1.0),
        eps=1e-4,
        precondition_frequency=1,
        start_preconditioning_step=1,
        grafting="none",
        max_preconditioner_dim=9,
    )
    g_ = torch.Generator().manual_seed(1)
    grads = [torch.randn(6, 9, generator=g_) for _ in range(6)]
    norms = []
    for g in grads:
        w.grad = g.clone()
        opt.step()
        norms.append(w.detach().norm().item())
    ref = _dense_reference(grads, w0, 0.05, 1e-4)
    err = (w.detach().double() - ref).norm().item()
    # one rounding of W per step (eps32 / 2 |W|) plus twice the divergence of the float64 reference under the
    # float32 computation's backward error (_perturbed); measured at most 1/4 of the bound
    bound = 0.5 * EPS32 * sum(norms) + 2 * (_dense_reference(_perturbed(grads), w0, 0.05, 1e-4) - ref).norm().item()
    assert err < bound, (err, bound)


def _dense_grafted(grads: list[torch.Tensor], w0: torch.Tensor, *, graft: str, soap: bool = False) -> torch.Tensor:
    """Shampoo (or SOAP) with every scalar factor in the tensors, float64: filtered gradient
    F = beta1-EMA / (1 - beta1^t); factors beta2-EMA, bias-corrected before their -1/4 roots (spectrum shifted
    to >= 0, plus eps); the graft F / (sqrt(V / c) + eps_g) with V the squared gradient's EMA (adam: c =
    1 - beta2_g^t, rmsprop: c = 1) or sum (adagrad), or F (none); from step 3 on (roots every step) the
    direction R_L F R_R (SOAP: Q_L [Q_L^T F Q_R / (sqrt(D / (1 - beta2^t)) + eps)] Q_R^T, in the identity basis
    before) rescaled to the graft's norm unless ``graft == "none"``; W <- (1 - lr wd) W - lr direction."""
    lr, (b1, b2), eps, gb2, geps, wd, start = 0.05, (0.9, 0.95), 1e-4, 0.9, 1e-3, 0.01, 3

    def root(a: torch.Tensor) -> torch.Tensor:
        vals, vecs = torch.linalg.eigh(a)
        return vecs @ torch.diag((vals - vals.min().clamp(max=0) + eps) ** -0.25) @ vecs.T

    w = w0.double().clone()
    m, n = w.shape
    left, right = torch.zeros(m, m, dtype=torch.float64), torch.zeros(n, n, dtype=torch.float64)
    ql, qr = torch.eye(m, dtype=torch.float64), torch.eye(n, dtype=torch.float64)
    f, v, d2 = torch.zeros_like(w), torch.zeros_like(w), torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        f = b1 * f + (1 - b1) * g
        fh = f / (1 - b1**t)
        left, right = b2 * left + (1 - b2) * g @ g.T, b2 * right + (1 - b2) * g.T @ g
        v = v + g**2 if graft == "adagrad" else gb2 * v + (1 - gb2) * g**2
        c = 1 - gb2**t if graft == "adam" else 1.0
        graft_dir = fh if graft == "none" else fh / ((v / c).sqrt() + geps)
        if soap:
            if t >= start:
                ql, qr = torch.linalg.eigh(left).eigenvectors, torch.linalg.eigh(right).eigenvectors
            d2 = b2 * d2 + (1 - b2) * (ql.T @ g @ qr) ** 2
            direction = ql @ ((ql.T @ fh @ qr) / ((d2 / (1 - b2**t)).sqrt() + eps)) @ qr.T
        elif t >= start:
            direction = root(left / (1 - b2**t)) @ fh @ root(right / (1 - b2**t))
        else:
            direction = graft_dir
        if graft != "none" and (soap or t >= start):
            direction = direction * graft_dir.norm() / direction.norm()
        w = (1 - lr * wd) * w - lr * direction
    return w


@pytest.mark.parametrize(
    ("graft", "soap"),
    [("adam", False), ("rmsprop", False), ("adagrad", False), ("none", False), ("adam", True), ("none", True)],
)
def test_filtering_grafting_and_bias_corrections_match_a_dense_float64_reference(graft, soap):
    """The optimizer keeps scalar factors (the filter's and Adam's bias corrections) out of its tensors where
    grafting makes them cancel: the result must still be the formulas' with every factor applied."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 9))
    w0 = w.detach().clone()
    opt = DistributedShampoo(
        [w],
        lr=0.05,
        betas=(0.9, 0.95),
        eps=1e-4,
        weight_decay=0.01,
        grafting=graft,
        grafting_beta2=0.9,
        grafting_eps=1e-3,
        precondition_frequency=1,
        start_preconditioning_step=3,
        max_preconditioner_dim=9,
        preconditioner="eigenvalue_corrected" if soap else "shampoo",
    )
    g_ = torch.Generator().manual_seed(1)
    grads = [torch.randn(6, 9, generator=g_) for _ in range(6)]
    norms = []
    for g in grads:
        w.grad = g.clone()
        opt.step()
        norms.append(w.detach().norm().item())
    ref = _dense_grafted(grads, w0, graft=graft, soap=soap)
    err = (w.detach().double() - ref).norm().item()
    # two roundings of W per step (decay, update), plus twice the reference's divergence under the float32
    # backward error (see the test above); measured at most 1/3 of the bound (SOAP's eps-sized second
    # moments amplify most); a bias correction off by 1e-3 relative fails
    diverged = (_dense_grafted(_perturbed(grads), w0, graft=graft, soap=soap) - ref).norm().item()
    bound = EPS32 * sum(norms) + 2 * diverged
    assert err < bound, (err, bound)


def _options() -> dict[str, Any]:
    # small blocks so that every parameter has several and ranks share the work; every feature on
    return dict(
        lr=1e-2,
        betas=(0.9, 0.999),
        eps=1e-8,
        momentum=0.9,
        nesterov=True,
        weight_decay=0.01,
        max_preconditioner_dim=8,
        precondition_frequency=2,
        start_preconditioning_step=2,
        grafting="adam",
    )


def _train(
    opt_group: Any, steps: int, start: int = 0, state: dict | None = None, **extra: Any
) -> tuple[torch.Tensor, Any]:
    model = make_model()
    opt = DistributedShampoo(model.parameters(), group=opt_group, **{**_options(), **extra})
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

    def graft_1d() -> dict[str, Any]:
        """Vectors updated by the graft alone: the same guarantees, and a state of other blocks is refused."""
        dist_params, (opt, saved) = _train(None, 6, precondition_1d=False)
        single, _ = _train(solo, 6, precondition_1d=False)
        resumed, _ = _train(None, 6, start=3, state=saved, precondition_1d=False)
        vectors = [b for b in opt.blocks if len(b.shape) == 1 and b.owner == rank]
        states = [opt.state[opt._params[b.param]].get("blocks", {}).get(b.index) for b in vectors]
        live = [sorted(st) for st in states if st]  # vectors of parameters with gradients
        state = {k: v for k, v in saved.items() if k != "params"}
        try:  # written with precondition_1d=False, loaded with True: loading only (no collective to hang in)
            DistributedShampoo(make_model().parameters(), **_options()).load_state_dict(state)
            refused = ""
        except ValueError as e:
            refused = str(e)
        return {"dist": dist_params, "single": single, "resumed": resumed, "live": live, "refused": refused}

    def wrong_world() -> str:
        _, (_, saved) = _train(None, 3)
        model = make_model()
        try:
            DistributedShampoo(model.parameters(), group=solo, **_options()).load_state_dict(saved)
        except ValueError as e:
            return str(e)
        return ""

    def bf16() -> dict[str, Any]:
        """bf16 directions: every rank applies the same rounded values, its own blocks' included."""
        params, (opt, _) = _train(None, 6, comm_dtype=torch.bfloat16)
        gathered = [torch.empty_like(params) for _ in range(world)]
        dist.all_gather(gathered, params)
        fp32, (opt32, _) = _train(None, 6)
        path = [_train(None, k)[0] for k in range(1, 6)]  # the fp32 run after 1..5 steps, for its path length
        return {
            "params": params,
            "all": gathered,
            "fp32": fp32,
            "path": path,
            "bytes": [o.comm.stats.by_op.get("all_gather", 0) for o in (opt, opt32)],
        }

    return {"run": guard(run), "graft_1d": guard(graft_1d), "wrong_world": guard(wrong_world), "bf16": guard(bf16)}


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_equals_single_process_bitwise_and_resumes(world):
    runs = run_ranks(shampoo_cases, world, timeout=120)
    for r in case(runs, "run"):
        assert r["owners"] == list(range(world)), "every rank owns blocks"
        # bitwise: each block's direction is computed by the same operations on the same shapes as alone (by its
        # owner, then copied exactly by the fp32 all-gather); a resume replays the same operations
        assert torch.equal(r["dist"], r["single"])
        assert torch.equal(r["resumed"], r["dist"])
    for r in case(runs, "graft_1d"):
        assert torch.equal(r["dist"], r["single"])
        assert torch.equal(r["resumed"], r["dist"])
        assert r["live"] and all(keys == ["filtered", "graft"] for keys in r["live"]), "vectors keep no factors"
    assert any("other blocks than this rank owns" in r["refused"] for r in case(runs, "graft_1d"))
    for msg in case(runs, "wrong_world"):
        assert "resume with the same world size" in msg
    for r in case(runs, "bf16"):
        assert all(torch.equal(r["params"], other) for other in r["all"]), "replicas stay identical"
        start = torch.cat([p.detach().reshape(-1) for p in make_model().parameters()])
        path = [start, *r["path"], r["fp32"]]
        length = sum((b - a).norm().item() for a, b in itertools.pairwise(path))
        assert not torch.equal(r["params"], r["fp32"])
        # bf16 rounds every direction by <= 2^-9 relative, and momentum carries each rounding on as it carries the
        # direction: the runs differ by about 2^-9 times the fp32 run's path length (measured 0.63 of it), 2x
        # for steps that do not align
        assert (r["params"] - r["fp32"]).norm().item() < 2 * 2.0**-9 * length
        assert 0 < 2 * r["bytes"][0] == r["bytes"][1], r["bytes"]


@pytest.mark.parametrize("precondition_1d", [True, False])
def test_blocks_are_balanced_by_their_estimated_time(precondition_1d):
    """The default GPT's blocks (max_preconditioner_dim 256) over 2 and 4 ranks: every rank's estimated time per
    step is within 2% of the mean, and a vector the graft alone updates costs a small part of a matrix block."""
    from powertrain.models import GPT, GPTConfig
    from powertrain.optim.distributor import assign
    from powertrain.optim.shampoo.blocks import block_cost

    model = GPT(GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=256, block_size=128))
    opt = DistributedShampoo(
        model.parameters(), max_preconditioner_dim=256, precondition_frequency=50, precondition_1d=precondition_1d
    )
    costs = [block_cost(b.shape, precondition_1d or len(b.shape) > 1, 2, 50) for b in opt.blocks]
    for world in (2, 4):
        blocks = assign([(b.param, b.index, b.shape, c) for b, c in zip(opt.blocks, costs, strict=True)], world)
        load = [sum(c for b, c in zip(blocks, costs, strict=True) if b.owner == r) for r in range(world)]
        assert max(load) < 1.02 * sum(load) / world, load
    assert block_cost((256,), False, 2, 50) < 0.1 * block_cost((256, 256), True, 2, 50)


def test_vectors_without_preconditioning_are_adam():
    """precondition_1d=False: a bias is updated by Adam (the filtered gradient as its first moment), while a
    matrix in the same optimizer keeps its factors."""
    torch.manual_seed(0)
    bias, weight = torch.nn.Parameter(torch.randn(37)), torch.nn.Parameter(torch.randn(6, 5))
    twin = torch.nn.Parameter(bias.detach().clone())
    opt = DistributedShampoo(
        [bias, weight],
        lr=1e-2,
        betas=(0.9, 0.95),
        grafting="adam",
        grafting_beta2=0.95,
        grafting_eps=1e-8,
        precondition_frequency=2,
        max_preconditioner_dim=8,
        precondition_1d=False,
    )
    adam = torch.optim.Adam([twin], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    m_abs, v = torch.zeros(37, dtype=torch.float64), torch.zeros(37, dtype=torch.float64)
    bound = torch.zeros(37, dtype=torch.float64)
    for t in range(1, 9):
        g = torch.randn(37)
        bias.grad, twin.grad, weight.grad = g.clone(), g.clone(), torch.randn(6, 5)
        opt.step()
        adam.step()
        # per step, the two implementations' different operations: W's rounding (<= eps32 |W| apart), and ~24 eps32
        # of Adam's update computed with |g| (the moments' EMAs carry a rounding 1 / (1 - beta) = 10 and 20 steps,
        # the update takes ~4 more) in each run; measured at most 1/13 of the bound
        m_abs, v = 0.9 * m_abs + 0.1 * g.double().abs(), 0.95 * v + 0.05 * g.double() ** 2
        adam_abs = (m_abs / (1 - 0.9**t)) / (v / (1 - 0.95**t)).sqrt()
        bound += EPS32 * twin.detach().double().abs() + 2 * 24 * EPS32 * 1e-2 * adam_abs
    assert ((bias.detach().double() - twin.detach().double()).abs() <= bound).all()
    assert len(opt.state[bias]["blocks"]) == 5 and not any("factors" in b for b in opt.state[bias]["blocks"].values())
    assert "roots" in opt.state[weight]["blocks"][0], "the matrix is still preconditioned"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": 0.0}, "lr=0.0"),
        ({"betas": (1.0, 0.9)}, "betas[0]=1.0"),
        ({"grafting": "sgd"}, "grafting='sgd'"),
        ({"precondition_frequency": 0}, "precondition_frequency=0"),
        ({"root_method": "svd"}, "root_method='svd'"),
        ({"nesterov": True}, "nesterov=True needs momentum"),
        ({"max_preconditioner_dim": 0}, "max_preconditioner_dim=0"),
        ({"preconditioner": "kfac"}, "preconditioner='kfac'"),
        ({"exponent_multiplier": 0}, "exponent_multiplier=0"),
        ({"exponent_multiplier": 2.0, "preconditioner": "eigenvalue_corrected"}, "preconditioner='shampoo' only"),
        ({"rel_eps": 1.0}, "rel_eps=1.0"),
        ({"rel_eps": -1e-7}, "rel_eps=-1e-07"),
    ],
)
def test_bad_options_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        DistributedShampoo([torch.nn.Parameter(torch.zeros(3, 3))], **kwargs)


def test_state_of_an_older_layout_refused():
    """State written with the filtered gradient per parameter (layout 1) cannot resume bitwise: refused."""
    w = torch.nn.Parameter(torch.randn(4, 5))
    opt = DistributedShampoo([w], precondition_frequency=1)
    w.grad = torch.randn(4, 5)
    opt.step()
    state = opt.state_dict()
    old = {**state, "shampoo": {k: v for k, v in state["shampoo"].items() if k != "layout"}}
    with pytest.raises(ValueError, match="layout 1, this version reads layout 3"):
        DistributedShampoo([w], precondition_frequency=1).load_state_dict(old)
    with pytest.raises(ValueError, match="Not a DistributedShampoo state dict"):
        DistributedShampoo([w]).load_state_dict(torch.optim.AdamW([w]).state_dict())
    DistributedShampoo([w], precondition_frequency=1).load_state_dict(state)  # the current layout loads


def test_state_with_the_old_option_names_resumes_bitwise():
    """State saved while the options were named epsilon / grafting_epsilon (before they followed torch's eps)
    loads under the new names and the next step is the same bits."""
    w = torch.nn.Parameter(torch.randn(4, 5))
    opt = DistributedShampoo([w], precondition_frequency=1, eps=1e-6, grafting_eps=1e-7)
    for step in range(2):
        w.grad = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
        opt.step()
    state = copy.deepcopy(opt.state_dict())
    for group in state["param_groups"]:
        group["epsilon"], group["grafting_epsilon"] = group.pop("eps"), group.pop("grafting_eps")
    w2 = torch.nn.Parameter(w.detach().clone())
    fresh = DistributedShampoo([w2], precondition_frequency=1)  # the defaults: the state's values must win
    fresh.load_state_dict(state)
    assert fresh.param_groups[0]["eps"] == 1e-6 and fresh.param_groups[0]["grafting_eps"] == 1e-7
    for p in (w, w2):
        p.grad = torch.randn(4, 5, generator=torch.Generator().manual_seed(2))
    opt.step()
    fresh.step()
    assert torch.equal(w, w2)


def test_root_failures_are_counted_warned_once_and_survive_state_dict(monkeypatch):
    """Every failed root computation is counted, with the steps it sends to the graft and the blocks given up for
    good (max_root_failures); the first failure and the first block given up warn once each; the counts travel
    with state_dict() and are restored by load_state_dict()."""
    import powertrain.optim.shampoo.optimizer as shampoo_optimizer
    from powertrain.optim.shampoo.matrix import RootFailure

    def fail(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
        raise RootFailure("forced")

    torch.manual_seed(0)
    w, v = torch.nn.Parameter(torch.randn(6, 9)), torch.nn.Parameter(torch.randn(4))
    opt = DistributedShampoo([w, v], precondition_frequency=2, max_root_failures=1, precondition_1d=False)
    monkeypatch.setattr(shampoo_optimizer, "inverse_roots", fail)
    with pytest.warns(RuntimeWarning) as caught:
        for _ in range(7):
            w.grad, v.grad = torch.randn(6, 9), torch.randn(4)
            opt.step()
    messages = [str(m.message) for m in caught]
    assert len(messages) == 2, messages
    assert "failed (forced)" in messages[0] and "this warning is shown once" in messages[0]
    assert "failed 2 times (more than max_root_failures=1)" in messages[1]
    # roots at steps 2 and 4 fail (the second gives up), steps 6.. are not tried; the graft from step 2 on is a
    # fallback (6 steps), the vector's graft (precondition_1d=False) is not
    assert opt.root_stats() == shampoo_optimizer.RootStats(computed=0, failed=2, graft_steps=6, abandoned=1)
    state = copy.deepcopy(opt.state_dict())
    assert state["shampoo"]["root_stats"] == opt.root_stats()._asdict()
    again = DistributedShampoo([w, v], precondition_frequency=2, max_root_failures=1, precondition_1d=False)
    again.load_state_dict(state)
    assert again.root_stats() == opt.root_stats()
    monkeypatch.undo()
    fresh = DistributedShampoo([w, v], precondition_frequency=2)
    for _ in range(4):
        w.grad, v.grad = torch.randn(6, 9), torch.randn(4)
        fresh.step()
    assert fresh.root_stats() == (4, 0, 0, 0)  # steps 2 and 4, the matrix's block and the vector's
    older = copy.deepcopy(fresh.state_dict())
    del older["shampoo"]["root_stats"]  # written before the counters existed: they start at 0
    again = DistributedShampoo([w, v], precondition_frequency=2)
    again.load_state_dict(older)
    assert again.root_stats() == (0, 0, 0, 0)


def test_factors_of_another_blocking_refused():
    """A state whose factors do not fit the blocks (a (16, 32) weight's single 512 x 512 factor, as versions that
    merged small matrices into vectors wrote it) is refused before anything is loaded."""
    w = torch.nn.Parameter(torch.randn(16, 32))
    opt = DistributedShampoo([w], precondition_frequency=1)
    w.grad = torch.randn(16, 32)
    opt.step()
    assert [tuple(f.shape) for f in opt.state[w]["blocks"][0]["factors"]] == [(16, 16), (32, 32)]
    state = copy.deepcopy(opt.state_dict())
    state["state"][0]["blocks"][0]["factors"] = [torch.zeros(512, 512)]
    fresh = DistributedShampoo([w], precondition_frequency=1)
    with pytest.raises(ValueError, match=r"have shapes \[\(512, 512\)\], but the block is \(16, 32\) here"):
        fresh.load_state_dict(state)
    assert not fresh.state, "nothing was loaded"


# ---------------------------------------------------------------- eigenvalue-corrected (SOAP) preconditioner


def _dense_soap(
    grads: list[torch.Tensor], w0: torch.Tensor, lr: float, beta2: float, eps: float, start: int
) -> torch.Tensor:
    """Textbook eigenvalue-corrected Shampoo on one matrix, float64: factors L, R (EMA beta2); from step
    ``start`` on their eigenbases Q_L, Q_R are recomputed every step (identities before: Adam); every step
    D <- beta2 D + (1 - beta2) (Q_L^T G Q_R)^2, and W -= lr Q_L [(Q_L^T G Q_R) / (sqrt(D / (1 - beta2^t)) + eps)]
    Q_R^T; no grafting, filtering or decay."""
    w = w0.double().clone()
    left = torch.zeros(w.shape[0], w.shape[0], dtype=torch.float64)
    right = torch.zeros(w.shape[1], w.shape[1], dtype=torch.float64)
    ql, qr = torch.eye(w.shape[0], dtype=torch.float64), torch.eye(w.shape[1], dtype=torch.float64)
    d2 = torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        left = beta2 * left + (1 - beta2) * g @ g.T
        right = beta2 * right + (1 - beta2) * g.T @ g
        if t >= start:
            ql, qr = torch.linalg.eigh(left).eigenvectors, torch.linalg.eigh(right).eigenvectors
        rot = ql.T @ g @ qr
        d2 = beta2 * d2 + (1 - beta2) * rot**2
        w -= lr * ql @ (rot / ((d2 / (1 - beta2**t)).sqrt() + eps)) @ qr.T
    return w


def test_eigenvalue_corrected_matches_dense_float64_reference():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 9))
    w0 = w.detach().clone()
    # start at step 3: by then both factors have full rank. Earlier, SOAP's first (sign-like, Adam's first
    # step) update would amplify float32 round-off in the right factor's null space into O(1) steps.
    opt = DistributedShampoo(
        [w],
        lr=0.05,
        betas=(0.0, 0.95),
        eps=1e-8,
        precondition_frequency=1,
        start_preconditioning_step=3,
        grafting="none",
        max_preconditioner_dim=9,
        preconditioner="eigenvalue_corrected",
    )
    g_ = torch.Generator().manual_seed(1)
    grads = [torch.randn(6, 9, generator=g_) for _ in range(6)]
    norms = []
    for g in grads:
        w.grad = g.clone()
        opt.step()
        norms.append(w.detach().norm().item())
    ref = _dense_soap(grads, w0, 0.05, 0.95, 1e-8, start=3)
    err = (w.detach().double() - ref).norm().item()
    # one rounding of W per step, plus twice the reference's divergence under the float32 backward error (see
    # test_single_process_matches_dense_float64_reference); measured at most 1/3 of the bound
    bound = 0.5 * EPS32 * sum(norms) + 2 * (_dense_soap(_perturbed(grads), w0, 0.05, 0.95, 1e-8, 3) - ref).norm().item()
    assert err < bound, (err, bound)
    assert not torch.equal(w.detach(), w0)


def test_exponent_multiplier_changes_the_root():
    """exponent_multiplier=2 on a matrix turns Shampoo's L^-1/4 G R^-1/4 into L^-1/2 G R^-1/2: one step from
    zero statistics on a 4 x 5 gradient (checked densely)."""
    torch.manual_seed(0)
    g = torch.randn(4, 5)
    outs = {}
    for mult in (1.0, 2.0):
        w = torch.nn.Parameter(torch.zeros(4, 5))
        opt = DistributedShampoo(
            [w],
            lr=1.0,
            betas=(0.0, 1.0),
            eps=1e-6,
            precondition_frequency=1,
            start_preconditioning_step=1,
            grafting="none",
            max_preconditioner_dim=5,
            exponent_multiplier=mult,
        )
        w.grad = g.clone()
        opt.step()
        outs[mult] = -w.detach().double()

    def power(a: torch.Tensor, e: float) -> torch.Tensor:
        vals, vecs = torch.linalg.eigh(a)
        return vecs @ torch.diag((vals.clamp_min(0) + 1e-6) ** e) @ vecs.T

    gd = g.double()
    gen = torch.Generator().manual_seed(0)

    def nudged(a: torch.Tensor) -> torch.Tensor:
        """``a + E``, E random symmetric with ||E||_F = sqrt(n) eps32 ||a||_F: float32 eigh's backward error."""
        s = torch.randn(a.shape, generator=gen, dtype=torch.float64)
        return a + math.sqrt(a.shape[0]) * EPS32 * a.norm() * (s + s.T) / (s + s.T).norm()

    for mult, e in ((1.0, -0.25), (2.0, -0.5)):
        left, right = gd @ gd.T, gd.T @ gd
        ref = power(left, e) @ gd @ power(right, e)
        # R = G^T G (5 x 5) has rank 4: eigh's error leaves G a component along R's computed null vector, which
        # the root scales by eps^e (1e3 for e = -1/2). Bound: 4x the largest change that 4 random backward
        # errors cause in the float64 formula (their spread is ~4x), plus the products' rounding; measured at
        # most 0.81 of the largest change (1/5 of the bound)
        diverged = max((power(nudged(left), e) @ gd @ power(nudged(right), e) - ref).norm().item() for _ in range(4))
        bound = 4 * diverged + 2 * math.sqrt(5) * EPS32 * ref.norm().item()
        assert (outs[mult] - ref).norm().item() < bound, mult
    assert not torch.allclose(outs[1.0], outs[2.0])


# ---------------------------------------------------------------- sharded parameters (FSDP2, SimpleFSDP)


def _sharded_options(preconditioner: str) -> dict[str, Any]:
    return {**_options(), "preconditioner": preconditioner, "eps": 1e-8}


def sharded_cases(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from powertrain.simple_fsdp import data_parallel

    solo = [dist.new_group([r]) for r in range(world)][rank]

    def run(wrap: str, preconditioner: str) -> dict[str, Any]:
        """Shampoo on the FSDP2 / SimpleFSDP shards == single-process Shampoo on every rank's rows of every
        parameter as separate tensors (what "blocks of the local shard" means), bitwise; a replica whose
        weights are the reference's rows sees the same loss, so the sharded updates reach the forward."""
        mesh = init_device_mesh("cpu", (world,))
        model = make_model()
        trainable = [p for p in make_model().parameters() if p.requires_grad]
        model = fully_shard(model, mesh=mesh) if wrap == "fsdp2" else data_parallel(model, mesh)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = DistributedShampoo(params, **_sharded_options(preconditioner))
        # FSDP2 shards dim 0 as torch.chunk does (a rank past the last chunk holds no rows)
        rows = [[c.clone().requires_grad_(True) for c in p.detach().chunk(world, dim=0)] for p in trainable]
        ref = DistributedShampoo([c for r in rows for c in r], group=solo, **_sharded_options(preconditioner))
        replica = make_model()
        losses = []
        for step in range(5):
            with torch.no_grad():
                for p, r in zip([p for p in replica.parameters() if p.requires_grad], rows, strict=True):
                    p.copy_(torch.cat([c.detach() for c in r]))
            opt.zero_grad()
            loss = loss_fn(model, *batch(rank, step))
            loss.backward()
            losses.append((loss.item(), loss_fn(replica, *batch(rank, step)).item()))
            for p, r in zip(params, rows, strict=True):
                full = None if p.grad is None else p.grad.full_tensor()
                for c, g in zip(r, [None] * len(r) if full is None else full.chunk(world, dim=0), strict=True):
                    c.grad = None if g is None else g.clone()  # standalone tensors, as a single process has
            opt.step()
            ref.step()
        mine = [r[rank] if rank < len(r) else torch.empty(0) for r in rows]
        return {
            "local": torch.cat([p.to_local().detach().reshape(-1) for p in params]),
            "expect": torch.cat([c.detach().reshape(-1) for c in mine]),
            "start": torch.cat(
                [p.detach().chunk(world)[rank].reshape(-1) for p in trainable if rank < len(p.chunk(world))]
            ),
            "losses": losses,
        }

    def bad() -> dict[str, str]:
        mesh = init_device_mesh("cpu", (world,))
        model = fully_shard(make_model(), mesh=mesh)
        return value_errors(
            {
                "mixed": lambda: DistributedShampoo([*model.parameters(), torch.nn.Parameter(torch.zeros(2, 2))]),
                "group": lambda: DistributedShampoo(model.parameters(), group=solo),
            }
        )

    out = {f"{w}_{p}": guard(run, w, p) for w in ("fsdp2", "simple") for p in ("shampoo", "eigenvalue_corrected")}
    out["bad"] = guard(bad)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_parameters_precondition_their_local_shards(world):
    runs = run_ranks(sharded_cases, world, timeout=150)
    # the forward's dot products (conv 27, fc1 72, big/big2/proj 32, odd 15, frozen 7 terms): typical rounding
    # sqrt(k) eps32 each; the loss squares the output (2x). The sharded model may run its kernels on differently
    # laid out weights (views of FSDP2's all-gather buffer); measured equal. An update that does not reach the
    # forward is off by ~lr = 1e-2 relative
    rel = 2 * EPS32 * sum(math.sqrt(k) for k in (27, 72, 32, 32, 32, 15, 7))
    for name in ("fsdp2_shampoo", "fsdp2_eigenvalue_corrected", "simple_shampoo", "simple_eigenvalue_corrected"):
        for r in case(runs, name):
            # bitwise: the same operations on the same rows (the optimizer copies each gradient shard to fresh,
            # aligned memory, as the reference's standalone tensors are)
            assert torch.equal(r["local"], r["expect"]), (name, (r["local"] - r["expect"]).abs().max())
            assert not torch.equal(r["local"], r["start"]), name
            for sharded, replica in r["losses"]:
                assert sharded == pytest.approx(replica, rel=rel), name
    for r in case(runs, "bad"):
        assert "both DTensor (sharded) and plain" in r["mixed"]
        assert "leave group=None" in r["group"]
