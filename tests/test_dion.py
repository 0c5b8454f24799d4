"""powertrain.optim.Dion: across 2 and 4 gloo ranks with each rank's own gradients, the mean of the ranks' momenta and
the shared update are single-process Dion's on the averaged gradients (float64, derived tolerance); the factors are
the only data-parallel traffic; a non-finite gradient on one rank raises on every rank with nothing changed; each
rank's state resumes bitwise; bad input is refused."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_utils import EPS64, case, guard, run_ranks, value_errors, within
from models import make_model
from powertrain.compress import NonFiniteGradientError
from powertrain.models import GPT, GPTConfig
from powertrain.optim import Dion
from powertrain.optim.dion import dion_rank

_OPTIONS = {"lr": 0.05, "mu": 0.9, "weight_decay": 0.1, "rank_fraction": 0.25, "adamw_lr": 0.01}


def _grad(p: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s gradient of ``p`` at ``step`` (float64, different on every rank and step)."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + p.numel() % 97)
    return torch.randn(p.shape, generator=g, dtype=torch.float64)


def _trainable(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad and not n.startswith("unused")]


def _run(
    world: int, rank: int | None, steps: int, group: Any = None, state: dict | None = None, start: int = 0
) -> tuple[torch.nn.Module, Dion]:
    """``steps`` steps of Dion on the float64 adversarial model: with ``rank`` given, that rank's own gradients
    (distributed over ``group``); with None, the mean of the ``world`` ranks' gradients (the single process)."""
    model = make_model(torch.float64)
    opt = Dion(model.named_parameters(), group=group, **_OPTIONS)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    for step in range(start, steps):
        for _, p in _trainable(model):
            ranks = [rank] if rank is not None else range(world)
            p.grad = sum(_grad(p, step, r) for r in ranks) / len(ranks)  # type: ignore[assignment]
        opt.step()
    return model, opt


def dion_cases(rank: int, world: int) -> dict[str, Any]:
    solo = [dist.new_group([r]) for r in range(world)][rank]

    def parity() -> dict[str, Any]:
        model, opt = _run(world, rank, 3)
        mine = [opt.state[p]["momentum"] for _, p in _trainable(model) if "momentum" in opt.state[p]]
        single, ref = _run(world, None, 3, group=solo)
        mean = [m.clone() for m in mine]
        for m in mean:
            dist.all_reduce(m)
            m /= world
        ref_m = [ref.state[p]["momentum"] for _, p in _trainable(single) if "momentum" in ref.state[p]]
        return {
            "params": [p.detach() for p in model.parameters()],
            "ref": [p.detach() for p in single.parameters()],
            "mean_momentum": mean,
            "ref_momentum": ref_m,
            "bytes": opt.comm.stats.by_op,
            "collectives": opt.comm.stats.num_collectives,
        }

    def resume() -> dict[str, Any]:
        whole, _ = _run(world, rank, 4)
        half_model, half = _run(world, rank, 2)
        saved = copy.deepcopy({"model": half_model.state_dict(), "opt": half.state_dict()})
        resumed, _ = _run(world, rank, 4, state=saved, start=2)
        return {
            "whole": [p.detach() for p in whole.parameters()],
            "resumed": [p.detach() for p in resumed.parameters()],
        }

    def nonfinite() -> dict[str, Any]:
        model, opt = _run(world, rank, 1)
        before = copy.deepcopy(opt.state_dict())
        params = [p.detach().clone() for p in model.parameters()]
        for _, p in _trainable(model):
            p.grad = _grad(p, 1, rank)
        if rank == world - 1:
            model.fc1.weight.grad[0, 0] = float("nan")
        try:
            opt.step()
            raised = ""
        except NonFiniteGradientError as e:
            raised = str(e)
        after = opt.state_dict()
        same_state = all(
            torch.equal(a, b)
            for k in before["state"]
            for a, b in zip(before["state"][k].values(), after["state"][k].values(), strict=True)
        )
        same_params = all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
        return {"raised": raised, "same": same_state and same_params}

    def sharded(wrap: str) -> dict[str, Any]:
        """FSDP2 / SimpleFSDP row shards, the same averaged gradients on every rank: the full parameters after 3
        steps, and what was sent."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor, distribute_tensor

        from powertrain.simple_fsdp import data_parallel

        mesh = init_device_mesh("cpu", (world,))
        model = make_model(torch.float64)
        if wrap == "fsdp2":
            fully_shard(model.fc1, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            model = data_parallel(model, mesh)
        opt = Dion(model.named_parameters(), **_OPTIONS)
        for step in range(3):
            for _, p in _trainable(model):
                p.grad = distribute_tensor(_grad(p, step, 0), p.device_mesh, p.placements)
            opt.step()
        full = [(p.full_tensor() if isinstance(p, DTensor) else p).detach() for p in model.parameters()]
        out = {"params": full, "bytes": dict(opt.comm.stats.by_op), "collectives": opt.comm.stats.num_collectives}
        for _, p in _trainable(model):  # a NaN in the last rank's shard of an AdamW parameter (a bias)
            p.grad = distribute_tensor(_grad(p, 3, 0), p.device_mesh, p.placements)
        if rank == world - 1:  # the stored DTensor (SimpleFSDP's attribute is the gathered tensor)
            dict(model.named_parameters())["fc1.bias"].grad.to_local()[0] = float("nan")
        before = [p.detach().to_local().clone() for p in model.parameters()]
        try:
            opt.step()
            out["raised"] = ""
        except NonFiniteGradientError as e:
            out["raised"] = str(e)
        out["unchanged"] = all(
            torch.equal(a, p.detach().to_local()) for a, p in zip(before, model.parameters(), strict=True)
        )
        return out

    return {
        "parity": guard(parity),
        "resume": guard(resume),
        "nonfinite": guard(nonfinite),
        "fsdp2": guard(sharded, "fsdp2"),
        "simple": guard(sharded, "simple"),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_across_ranks_is_single_process_dion_on_the_mean(world):
    runs = run_ranks(dion_cases, world, timeout=120)
    model = make_model(torch.float64)
    opt = Dion(model.named_parameters(), **_OPTIONS)
    stepped = {id(p) for _, p in _trainable(model)}
    kinds = {id(p): g["algorithm"] for g in opt.param_groups for p in g["params"]}
    factors = sum(
        (max(p.shape) + min(p.shape)) * opt.rank_of(p) for _, p in _trainable(model) if kinds[id(p)] == "dion"
    )
    rest = sum(p.numel() for _, p in _trainable(model) if kinds[id(p)] == "adamw")
    assert stepped and factors < sum(p.numel() for _, p in _trainable(model)) / 2
    for r in case(runs, "parity"):
        # The same algorithm in float64, the sums taken in another order (each rank's B Q and B^T P summed over ranks
        # against the products of the summed B): each product's rounding is at most (terms) u64 of |B| |Q| per
        # entry, at most 72 terms (fc1's 72 columns) and 4 ranks; the QR and the column normalisation pass it on
        # relative to the conditioning of P (random data: a few). 3 steps of at most 1000 x 72 x 4 u64 ~ 6e-11
        # relative to the values, a thousand times what was measured (~1e-14)
        for a, b in zip(r["params"], r["ref"], strict=True):
            within((a - b).abs().max(), 1000 * 72 * 4 * EPS64 * (1 + b.abs().max()), "parameters vs one process")
        for a, b in zip(r["mean_momentum"], r["ref_momentum"], strict=True):
            within((a - b).abs().max(), 1000 * 72 * 4 * EPS64 * (1 + b.abs().max()), "mean momentum vs one process")
        # the only traffic: two all-reduces a step, the factors (m + n) r of every matrix and the other gradients
        assert r["bytes"] == {"all_reduce": 3 * 8 * (factors + rest)}, (r["bytes"], factors, rest)
        assert r["collectives"] == 3 * 2
    # sharded: Dion's equations on W^T (its rows are what the ranks hold), each matrix's Q drawn in order from the
    # seed; the AdamW parameters bitwise torch's AdamW (elementwise on the shards)
    reference = make_model(torch.float64)
    generator = torch.Generator().manual_seed(0)
    by_name = {n: kinds[id(p)] for n, p in model.named_parameters()}
    kinds = {id(p): by_name[n] for n, p in reference.named_parameters()}
    stepped = {id(p) for _, p in _trainable(reference)}
    expect = []
    adamw = torch.optim.AdamW(
        [p for _, p in _trainable(reference) if kinds[id(p)] == "adamw"],
        lr=_OPTIONS["adamw_lr"],
        betas=(0.9, 0.95),
        weight_decay=0.01,
    )
    for _, p in reference.named_parameters():
        if kinds[id(p)] == "dion":
            q0 = torch.randn(p.shape[0], dion_rank(tuple(p.shape), 0.25), generator=generator).double()
            grads = [_grad(p, s, 0) for s in range(3)] if p.requires_grad and id(p) in stepped else []
            expect.append(_dense_dion(p.detach(), q0, grads, lr=0.05, mu=0.9, wd=0.1, eps=1e-8, transposed=True))
        else:
            expect.append(None)
    for step in range(3):
        for _, p in _trainable(reference):
            p.grad = _grad(p, step, 0) if kinds[id(p)] == "adamw" else None
        adamw.step()
    dion_matrices = [p for _, p in _trainable(model) if by_name[_name_of(model, p)] == "dion"]
    sent_p = sum(p.shape[1] * opt.rank_of(p) for p in dion_matrices)  # P: the columns of W x r
    sent_sq = sum(opt.rank_of(p) for p in dion_matrices) + 1  # R's column norms, and one entry for a non-finite flag
    for name in ("fsdp2", "simple"):
        for rank, r in enumerate(case(runs, name)):
            for got, want, ref in zip(r["params"], expect, reference.parameters(), strict=True):
                if want is None:
                    assert torch.equal(got, ref.detach()), name
                else:  # float64, sums of at most 72 terms and Householder QR (the one-process bound)
                    within((got - want).abs().max(), 1e-10 * want.abs().max(), f"{name} vs Dion's equations on W^T")
            assert r["bytes"] == {"all_reduce": 3 * 8 * (sent_p + sent_sq)}, (r["bytes"], sent_p, sent_sq)
            assert r["collectives"] == 3 * 2
            assert "Dion:" in r["raised"] and r["unchanged"], r["raised"]
            # the NaN is in the last rank's rows: that rank names the bias, every other one says another rank's
            mine = rank == len(case(runs, name)) - 1
            assert ("non-finite gradient (or momentum) in fc1.bias" in r["raised"]) == mine, (rank, r["raised"])
            assert ("another rank's were non-finite" in r["raised"]) != mine, (rank, r["raised"])
    for r in case(runs, "resume"):
        for a, b in zip(r["whole"], r["resumed"], strict=True):
            assert torch.equal(a, b)  # each rank's own state: the same operations on the same values
    for r in case(runs, "nonfinite"):
        assert "Dion:" in r["raised"] and "nothing was applied" in r["raised"], r["raised"]
        assert r["same"], "a refused step changed the state or the parameters"
    assert "non-finite gradient" in case(runs, "nonfinite")[-1]["raised"]
    assert "another rank" in case(runs, "nonfinite")[0]["raised"]


def _dense_dion(
    w: torch.Tensor,
    q0: torch.Tensor,
    grads: list[torch.Tensor],
    *,
    lr: float,
    mu: float,
    wd: float,
    eps: float,
    transposed: bool | None = None,
) -> torch.Tensor:
    """Dion's equations for one matrix, written out densely in float64, on ``W^T`` where ``transposed`` (default: a
    wide matrix, so that the view is tall)."""
    wide = w.shape[0] < w.shape[1] if transposed is None else transposed
    m, q = torch.zeros(w.T.shape if wide else w.shape, dtype=torch.float64), q0
    for g in grads:
        b = m + (g.T if wide else g)
        p = torch.linalg.qr(b @ q).Q  # any signs of its columns: the update P Q^T does not depend on them
        r = b.T @ p
        m = b - (1 - mu) * p @ r.T
        q = r / (r.norm(dim=0, keepdim=True) + eps)
        update = p @ q.T
        w = w * (1 - lr * wd) - lr * (w.shape[0] / w.shape[1]) ** 0.5 * (update.T if wide else update)
    return w


@pytest.mark.parametrize("shape", [(24, 8), (8, 24)])
def test_one_process_is_dions_equations(shape):
    """Against the dense float64 equations: each step's products are sums of at most 24 terms, and Householder QR's
    basis is within n r u64 of the exact one (Higham, Thm 19.4); 4 steps of them stay far below 1e-10 relative
    (measured ~1e-15)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(*shape, dtype=torch.float64))
    w0 = w.detach().clone()
    opt = Dion([{"params": [w], "algorithm": "dion"}], lr=0.05, mu=0.9, weight_decay=0.1, rank_fraction=0.5)
    q0 = torch.randn(min(shape), 4, generator=torch.Generator().manual_seed(0)).double()  # Dion's start, seed 0
    grads = [torch.randn(*shape, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in range(4)]
    for g in grads:
        w.grad = g.clone()
        opt.step()
    expect = _dense_dion(w0, q0, grads, lr=0.05, mu=0.9, wd=0.1, eps=1e-8)
    within((w.detach() - expect).abs().max(), 1e-10 * expect.abs().max(), "Dion vs its dense equations")
    assert not torch.allclose(w.detach(), w0)


def _name_of(model: torch.nn.Module, p: torch.Tensor) -> str:
    return next(n for n, q in model.named_parameters() if q is p)


def test_rank_and_state_form():
    assert [dion_rank((256, 1024), f) for f in (1 / 4, 1 / 16, 1.0, 1e-9)] == [64, 16, 256, 1]
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=32))
    opt = Dion(model.named_parameters(), rank_fraction=0.25)
    x = torch.randint(0, 64, (2, 16))
    model(x, x).backward()
    opt.step()
    fc = model.blocks[0].fc.weight  # 128 x 32
    assert {k: tuple(v.shape) for k, v in opt.state[fc].items()} == {"momentum": (128, 32), "Q": (32, 8)}
    assert opt.state_shapes(fc) == {"momentum": (128, 32), "Q": (32, 8)}
    assert set(opt.state[model.tok.weight]) == {"step", "exp_avg", "exp_avg_sq"}


def test_low_and_mixed_precision_parameters():
    """bfloat16 matrices keep a float32 momentum and right factor, also through a state_dict round trip (torch's load
    casts state to the parameter's dtype), so a resume is bitwise; float32 and float64 parameters step together, the
    float64 one's gradient averaged in float64 (one process: unchanged)."""

    def run(steps: int, state: dict | None = None, start: int = 0) -> tuple[torch.nn.Module, Dion, dict | None]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Linear(12, 16)).to(torch.bfloat16)
        opt = Dion(
            [
                {"params": [model[0].weight, model[1].weight], "algorithm": "dion"},
                {"params": [model[0].bias, model[1].bias], "algorithm": "adamw"},
            ],
            rank_fraction=0.5,
        )
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
        saved = None
        for step in range(start, steps):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
            model.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()
            if step + 1 == 2:
                saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
        return model, opt, saved

    whole, opt, saved = run(4)
    assert opt.state[whole[0].weight]["momentum"].dtype == torch.float32
    resumed, opt2, _ = run(4, saved, start=2)
    assert opt2.state[resumed[0].weight]["Q"].dtype == torch.float32
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    mixed = [torch.nn.Parameter(torch.randn(8, 6)), torch.nn.Parameter(torch.randn(6, 8, dtype=torch.float64))]
    bias = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = Dion([{"params": mixed, "algorithm": "dion"}, {"params": [bias], "algorithm": "adamw"}], rank_fraction=0.5)
    for p in [*mixed, bias]:
        p.grad = torch.randn_like(p) / 3
    grad = bias.grad.clone()
    opt.step()
    assert torch.equal(bias.grad, grad), "a float64 gradient is averaged in float64"
    assert all(torch.isfinite(p).all() for p in mixed)


def test_a_zero_gradient_moves_nothing_but_the_decay():
    """Dion's equations: a momentum of zeros gives R = 0, so Q = R / (|R| + eps) = 0 and no update (the next power
    iteration starts from the old Q: a zero one would stay zero); only the weight decay acts."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(12, 5))
    opt = Dion([{"params": [w], "algorithm": "dion"}], lr=0.01, weight_decay=0.1, rank_fraction=0.5)
    q = opt.state[w]["Q"].clone()
    before = w.detach().clone()
    w.grad = torch.zeros_like(w)
    opt.step()
    assert torch.equal(w.detach(), before * (1 - 0.01 * 0.1))
    assert torch.equal(opt.state[w]["Q"], q) and not opt.state[w]["momentum"].any()


def test_bad_input_is_refused_in_one_line():
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=32))
    named = lambda: model.named_parameters()
    errors = value_errors(
        {
            "plain": lambda: Dion(model.parameters()),
            "rank": lambda: Dion(named(), rank_fraction=0.0),
            "mu": lambda: Dion(named(), mu=1.0),
            "lr": lambda: Dion(named(), lr=float("inf")),
            "seed": lambda: Dion(named(), seed=-1),
            "vector": lambda: Dion([{"params": [model.ln_f.weight], "algorithm": "dion"}]),
            "typo": lambda: Dion([{"params": [model.head.weight], "algorithm": "dion", "rank_fracton": 0.5}]),
            "bool": lambda: Dion(named(), adamw_lr=True),
            "string": lambda: Dion([{"params": [model.ln_f.weight], "algorithm": "adamw", "lr": "0.1"}]),
            "shape": lambda: Dion(named(), rank_fraction=0.5).load_state_dict(Dion(named()).state_dict()),
        }
    )
    expected = {
        "plain": "needs model.named_parameters()",
        "rank": "Invalid rank_fraction=0.0",
        "mu": "Invalid mu=1.0",
        "lr": "Invalid lr=inf",
        "seed": "Invalid seed=-1",
        "vector": "give it to the 'adamw' group",
        "typo": "unknown option(s) ['rank_fracton']",
        "bool": "Invalid adamw_lr=True",
        "string": "Invalid adamw_lr='0.1'",
        "shape": "was saved with rank_fraction=1.0, this optimizer has rank_fraction=0.5: build it with",
    }
    for key, fragment in expected.items():
        assert fragment in errors[key], (key, errors[key])
        assert "\n" not in errors[key]
