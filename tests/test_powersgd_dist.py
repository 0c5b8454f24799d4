"""PowerSGD on real gloo process groups (2 and 4 ranks).

Each world size is spawned once for all the sub-cases (spawning costs seconds); every sub-case returns
its raw observations and the assertions run here in the parent, one pytest test per property.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_utils import EPS32, EPS64, case, feedback_bound, guard, run_ranks, same_on_all_ranks, within
from models import batch, flat_params, loss_fn, make_model
from powertrain.compress import NonFiniteGradientError, PowerSGDCompressor
from powertrain.compress.powersgd import Config
from powertrain.ops.flat import flat_views, pack
from powertrain.powersgd import PowerSGD, optimizer_step

WORLD_SIZES = [2, 4]
TRAIN_CONFIGS = {  # name -> (variant, num_iters_per_step)
    "alternating_k1": ("alternating", 1),
    "alternating_k2": ("alternating", 2),
    "paper_k1": ("paper", 1),
}
STEPS, WARMUP, RANK = 12, 3, 2


# ---------------------------------------------------------------- sub-cases (run on every rank)


def _train(rank: int, variant: str, k: int, api: str, jitter: bool = False) -> dict[str, Any]:
    """``jitter``: perturb every local gradient element by (W - 1) eps relative, random sign, at every step."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cfg = Config(
        rank=RANK,
        min_compression_rate=0,
        num_iters_per_step=k,
        start_compressing_after_num_steps=WARMUP,
        variant=variant,
    )
    if api == "reference":
        agg = PowerSGD(list(model.parameters()), config=cfg)
        comm = agg.comm
    else:
        comp = PowerSGDCompressor(model.named_parameters(), config=cfg)
        comm = comp.comm
    losses, sent = [], []
    for step in range(STEPS):
        loss = loss_fn(model, *batch(rank, step))
        loss.backward()
        if jitter:
            gen = torch.Generator().manual_seed(1000 * rank + step)
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        sign = torch.randint(0, 2, p.shape, generator=gen) * 2 - 1
                        p.grad.add_(p.grad.abs() * sign * (dist.get_world_size() - 1) * EPS32)
        before = comm.stats.bytes_sent
        if api == "reference":
            optimizer_step(opt, agg)
        else:
            comp.reduce_gradients()
            opt.step()
            opt.zero_grad()
        sent.append(comm.stats.bytes_sent - before)
        losses.append(loss.item())
    return {"params": flat_params(model), "losses": losses, "bytes": sent}


def _conservation(rank: int, variant: str) -> dict[str, Any]:
    """Float64: record M (input incl. residual), the average and the new residual at every step."""
    model = make_model(torch.float64)
    params = list(model.parameters())
    agg = PowerSGD(
        params,
        config=Config(
            rank=RANK,
            min_compression_rate=0,
            num_iters_per_step=2,
            start_compressing_after_num_steps=1,
            variant=variant,
        ),
    )
    records = []
    for step in range(5):
        loss_fn(model, *batch(rank, step, torch.float64)).backward()
        grads = _materialized_grads(params)
        inputs = [None if g is None else g.clone() for g in grads]
        out = agg.aggregate(grads)
        records.append([(m, a, g.clone()) for m, a, g in zip(inputs, out, grads, strict=True) if m is not None])
        with torch.no_grad():
            for p, a in zip(params, out, strict=True):
                if a is not None:
                    p -= 0.05 * a
    return {"records": records}


def _conservation_compressor(rank: int, variant: str, factor_dtype: str = "fp32") -> dict[str, Any]:
    """Same invariant for the compressor that owns its residuals: mean(g + e_old) == out + mean(e_new); also the
    bytes each step sent against ``bytes_per_step``."""
    model = make_model(torch.float64)
    cfg = Config(
        rank=RANK,
        min_compression_rate=0,
        start_compressing_after_num_steps=0,
        variant=variant,
        factor_dtype=factor_dtype,
    )
    comp = PowerSGDCompressor(model.parameters(), config=cfg)
    records, sent = [], []
    for step in range(4):
        model.zero_grad()
        loss_fn(model, *batch(rank, step, torch.float64)).backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in comp.params]
        before = [e.clone() for e in comp.residuals()]
        expected, bytes_before = comp.bytes_per_step(), comp.comm.stats.bytes_sent
        out = comp.aggregate(grads)
        sent.append((comp.comm.stats.bytes_sent - bytes_before, expected))
        records.append([(g + e, a, r.clone()) for g, e, a, r in zip(grads, before, out, comp.residuals(), strict=True)])
    return {"records": records, "sent": sent, "dense": comp.dense_bytes_per_step}


def _materialized_grads(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """p.grad for trainable params (zeros where unused, kept in p.grad for the residual), None if frozen."""
    for p in params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad if p.requires_grad else None for p in params]


def _exact_mean(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Plain all-reduce as the reference does it: one flat buffer, divided by W, summed."""
    buf = pack(tensors, torch.float64 if tensors[0].dtype == torch.float64 else torch.float32, tensors[0].device)
    buf /= dist.get_world_size()
    dist.all_reduce(buf)
    return flat_views(buf, [t.shape for t in tensors])


def _full_rank(rank: int, variant: str, k: int) -> dict[str, Any]:
    model = make_model(torch.float64)
    params = list(model.parameters())
    agg = PowerSGD(
        params,
        config=Config(
            rank=64,
            min_compression_rate=0,
            num_iters_per_step=k,
            start_compressing_after_num_steps=0,
            variant=variant,
        ),
    )
    assert agg.compressor.compressed_names, "full-rank case must actually compress"
    steps = []
    for step in range(3):
        model.zero_grad()
        loss_fn(model, *batch(rank, step, torch.float64)).backward()
        grads = _materialized_grads(params)
        exact = _exact_mean([g for g in grads if g is not None])
        frob = [g.norm().item() for g in grads if g is not None]
        out = [a for a in agg.aggregate(grads) if a is not None]
        # How far this step's orthonormal left factor is from orthonormal (paper: P; it is square here)
        ortho = [
            0.0 if p is None else torch.linalg.matrix_norm(p.T @ p - torch.eye(p.shape[1], dtype=p.dtype), ord=2).item()
            for p in agg.compressor.state_dict()["p"]
        ]
        shapes = [None if mat is None else tuple(mat) for mat in agg.compressor.state_dict()["layout"]]
        errs = [(a - e).abs().max().item() for a, e in zip(out, exact, strict=True)]
        steps.append({"err": errs, "frob": frob, "ortho": ortho, "mat": shapes})
    return {"steps": steps}


def _warmup(rank: int) -> dict[str, Any]:
    model = make_model()
    params = list(model.parameters())
    agg = PowerSGD(params, config=Config(rank=1, start_compressing_after_num_steps=3))
    pairs = []
    for step in range(3):
        model.zero_grad()
        loss_fn(model, *batch(rank, step)).backward()
        grads = _materialized_grads(params)
        expected = _exact_mean([g.clone() for g in grads if g is not None])
        out = [a for a in agg.aggregate(grads) if a is not None]
        pairs.append((out, expected))
    return {"pairs": pairs}


def _snapshot(x: Any) -> Any:
    """Deep copy of a state dict made of tensors, lists, dicts, numbers and None."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _snapshot(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_snapshot(v) for v in x]
    return x


def _same(a: Any, b: Any) -> bool:
    """Bitwise equality of two such states."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _nonfinite(rank: int, world_size: int) -> dict[str, Any]:
    bad_rank = world_size - 1
    result: dict[str, Any] = {}
    # Compressor API with skip: every rank skips the same step and keeps its state.
    model = make_model()
    comp = PowerSGDCompressor(model.named_parameters(), config=Config(rank=2, start_compressing_after_num_steps=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    applied = []
    for step in range(6):
        opt.zero_grad()
        loss_fn(model, *batch(rank, step)).backward()
        if step == 3 and rank == bad_rank:
            model.odd.weight.grad[1, 2] = float("nan")
        if step == 4 and rank == bad_rank:  # finite, but beyond what PowerSGD can take without overflowing
            model.big.weight.grad[0, 1] = 1e37
        state_before = _snapshot(comp.state_dict())
        errors_before = [e.clone() for e in comp.residuals()]
        grads_before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        if step == 4:  # raising, for its message
            try:
                ok = comp.reduce_gradients()
            except NonFiniteGradientError as e:
                ok = False
                result["too_large"] = str(e)
        else:
            ok = comp.reduce_gradients(skip_nonfinite=True)
        applied.append(ok)
        if not ok:
            result["state_unchanged"] = (
                result.get("state_unchanged", True)
                and _same(state_before, comp.state_dict())
                and all(torch.equal(a, b) for a, b in zip(errors_before, comp.residuals(), strict=True))
            )
            grads_now = [p.grad for p in model.parameters() if p.grad is not None]
            result["grads_untouched"] = result.get("grads_untouched", True) and all(
                torch.equal(a, b) or (a.isnan() == b.isnan()).all().item()
                for a, b in zip(grads_before, grads_now, strict=True)
            )
            continue
        opt.step()
    result["applied"] = applied
    result["params_finite"] = bool(flat_params(model).isfinite().all())
    # Reference API: raises on every rank, naming the parameter on the rank that has it.
    for warm in (0, 5):  # 5: during warm-up (exact all-reduce); 0: compressed step
        model = make_model()
        params = list(model.parameters())
        agg = PowerSGD(params, config=Config(rank=2, start_compressing_after_num_steps=warm))
        loss_fn(model, *batch(rank, 0)).backward()
        if rank == bad_rank:
            model.fc1.weight.grad[0, 0] = float("inf")
        p_before = _snapshot(agg.compressor.state_dict())
        try:
            optimizer_step(torch.optim.SGD(params, lr=0.1), agg)
            result[f"raised_warm{warm}"] = ""
        except NonFiniteGradientError as e:
            result[f"raised_warm{warm}"] = str(e)
        result[f"factors_unchanged_warm{warm}"] = _same(p_before, agg.compressor.state_dict())
        result[f"step_counter_warm{warm}"] = agg.step_counter
    return result


def _readme(rank: int) -> dict[str, Any]:
    """The reference README's usage, unchanged, on a real regression task."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
    teacher = torch.randn(20, 5, generator=torch.Generator().manual_seed(7))
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    powersgd = PowerSGD(
        params,
        config=Config(
            rank=1,  # lower rank => more aggressive compression
            min_compression_rate=10,  # don't compress gradients with less compression
            num_iters_per_step=2,  # lower number => more aggressive compression
            start_compressing_after_num_steps=0,
        ),
    )
    losses = []
    for step in range(40):
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(32, 20, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x @ teacher)
        loss.backward()
        optimizer_step(optimizer, powersgd)
        losses.append(loss.item())
    return {
        "params": flat_params(model),
        "losses": losses,
        "compressed": powersgd.compressor.compressed_names,
    }


def _mixed(rank: int) -> dict[str, Any]:
    out = {}
    # bf16 parameters (the reference crashes), SGD on bf16.
    model = make_model(torch.bfloat16)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05)
    agg = PowerSGD(params, config=Config(rank=2, min_compression_rate=0, start_compressing_after_num_steps=1))
    for step in range(4):
        loss_fn(model, *batch(rank, step, torch.bfloat16)).backward()
        optimizer_step(opt, agg)
    out["bf16_params"] = flat_params(model)
    out["bf16_grad_dtypes"] = sorted({str(p.grad.dtype) for p in params if p.grad is not None})
    # Nothing compressible (the reference raises IndexError).
    model = make_model()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05)
    agg = PowerSGD(params, config=Config(rank=2, min_compression_rate=1e9, start_compressing_after_num_steps=0))
    for step in range(3):
        loss_fn(model, *batch(rank, step)).backward()
        optimizer_step(opt, agg)
    out["plain_params"] = flat_params(model)
    out["plain_compressed"] = agg.compressor.compressed_names
    out["unused_grad_is_zero"] = bool((model.unused.weight.grad == 0).all())
    out["frozen_grad_is_none"] = model.frozen.weight.grad is None
    return out


def _norm_diff(xs: Any, ys: Any) -> float:
    """Frobenius norm of the difference of two lists of tensors, taken as one vector."""
    return sum((x - y.to(x.dtype).reshape(x.shape)).square().sum().item() for x, y in zip(xs, ys, strict=True)) ** 0.5


class _Naive:
    """A straightforward per-parameter float64 implementation of both variants (one all-reduce per tensor, no
    batching, no fusing), started from given factors. With ``jitter``, each matrix gradient (n x m) is perturbed
    at every step by (n + m + W) eps relative per element, random signs (seeded by rank and step)."""

    def __init__(self, state: dict[str, Any], variant: str, k: int, jitter: bool = False) -> None:
        self.variant, self.k, self.jitter = variant, k, jitter
        self.P, self.Q, self.shape = {}, {}, {}
        for i, (p0, q0) in enumerate(zip(state["p"], state["q"], strict=True)):
            if p0 is not None:
                self.P[i], self.Q[i], self.shape[i] = p0.clone(), q0.clone(), (p0.shape[0], q0.shape[0])
        self.err = {i: torch.zeros(self.shape[i], dtype=torch.float64) for i in self.P}

    def step(self, step: int, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        world_size, k, P, Q = dist.get_world_size(), self.k, self.P, self.Q
        expected = []
        for i, g in enumerate(grads):
            if i not in P:
                e = g.clone()
                dist.all_reduce(e)
                expected.append(e / world_size)
                continue
            m = g.reshape(self.shape[i])
            if self.jitter:
                gen = torch.Generator().manual_seed(1000 * dist.get_rank() + 10 * step + 1)
                sign = torch.randint(0, 2, m.shape, generator=gen, dtype=m.dtype) * 2 - 1
                m = m + m.abs() * sign * (sum(m.shape) + world_size) * EPS64
            m = m + self.err[i]
            approx = torch.zeros_like(m)
            for it in range(k):
                if self.variant == "paper":
                    p_new = m @ Q[i]
                    dist.all_reduce(p_new)
                    P[i] = torch.linalg.qr(p_new).Q
                    q_new = m.T @ P[i]
                    dist.all_reduce(q_new)
                    Q[i] = q_new / world_size
                    if it == k - 1:
                        approx = P[i] @ Q[i].T
                        m = m - approx
                elif (step * k + it) % 2 == 0:
                    P[i] = torch.linalg.qr(P[i]).Q
                    q_local = m.T @ P[i]
                    m = m - P[i] @ q_local.T  # the local rank-r part leaves the residual
                    Q[i] = q_local.clone()
                    dist.all_reduce(Q[i])
                    approx = approx + P[i] @ Q[i].T / world_size
                else:
                    Q[i] = torch.linalg.qr(Q[i]).Q
                    p_local = m @ Q[i]
                    m = m - p_local @ Q[i].T
                    P[i] = p_local.clone()
                    dist.all_reduce(P[i])
                    approx = approx + P[i] @ Q[i].T / world_size
            self.err[i] = m
            expected.append(approx.reshape(g.shape))
        return expected


def _naive_reference(rank: int, world_size: int, variant: str) -> dict[str, Any]:
    """PowerSGDCompressor against the naive implementation, and the naive implementation against itself with
    jittered gradients (which measures how much these 4 steps amplify a rounding-sized change)."""
    k = 2
    model = make_model(torch.float64)
    comp = PowerSGDCompressor(
        model.named_parameters(),
        config=Config(
            rank=2, min_compression_rate=0, num_iters_per_step=k, start_compressing_after_num_steps=0, variant=variant
        ),
    )
    naive, jittered = _Naive(comp.state_dict(), variant, k), _Naive(comp.state_dict(), variant, k, jitter=True)
    diffs = []
    for step in range(4):
        model.zero_grad()
        loss_fn(model, *batch(rank, step, torch.float64)).backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in comp.params]
        out = comp.aggregate(grads)
        expected, moved = naive.step(step, grads), jittered.step(step, grads)
        residuals = comp.residuals()
        mats = list(naive.P)
        exact = [i for i in range(len(grads)) if i not in naive.P]
        absmax = [grads[i].abs() for i in exact]
        for a in absmax:
            dist.all_reduce(a, op=dist.ReduceOp.MAX)
        diffs.append(
            {
                "out": _norm_diff([out[i] for i in mats], [expected[i] for i in mats]),
                "residual": _norm_diff([residuals[i] for i in mats], naive.err.values()),
                "out_jitter": _norm_diff([expected[i] for i in mats], [moved[i] for i in mats]),
                "residual_jitter": _norm_diff(naive.err.values(), jittered.err.values()),
                "exact": [(out[i] - expected[i]).abs() for i in exact],
                "exact_absmax": absmax,
            }
        )
    return {"steps": diffs}


def powersgd_cases(rank: int, world_size: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name, (variant, k) in TRAIN_CONFIGS.items():
        for api in ("reference", "compressor"):
            res[f"train/{name}/{api}"] = guard(_train, rank, variant, k, api)
        res[f"train/{name}/jitter"] = guard(_train, rank, variant, k, "reference", jitter=True)
    for variant in ("alternating", "paper"):
        res[f"conservation/{variant}"] = guard(_conservation, rank, variant)
        res[f"conservation_compressor/{variant}"] = guard(_conservation_compressor, rank, variant)
    res["conservation_compressor/paper_bf16"] = guard(_conservation_compressor, rank, "paper", "bf16")
    for variant in ("alternating", "paper"):
        res[f"naive/{variant}"] = guard(_naive_reference, rank, world_size, variant)
    res["full_rank/alternating_k2"] = guard(_full_rank, rank, "alternating", 2)
    res["full_rank/paper_k1"] = guard(_full_rank, rank, "paper", 1)
    res["warmup"] = guard(_warmup, rank)
    res["nonfinite"] = guard(_nonfinite, rank, world_size)
    res["readme"] = guard(_readme, rank)
    res["mixed"] = guard(_mixed, rank)
    return res


# ---------------------------------------------------------------- parent-side assertions


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=[f"w{w}" for w in WORLD_SIZES])
def results(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    world_size = request.param
    return world_size, run_ranks(powersgd_cases, world_size, timeout=90)


def expected_bytes(variant: str, k: int) -> list[int]:
    """Payload bytes per step for the Adversarial model, from first principles (fp32, 4 bytes)."""
    model = make_model()
    shapes = [p.shape for p in model.parameters() if p.requires_grad]
    total = sum(s.numel() for s in shapes)
    mats = [(s[0], s.numel() // s[0]) for s in shapes if len(s) >= 2]
    vec = sum(s.numel() for s in shapes if len(s) < 2)
    out = []
    for step in range(STEPS):
        if step < WARMUP:
            out.append(4 * total)
            continue
        c = step - WARMUP
        floats = vec
        for it in range(k):
            for n, m in mats:
                r = min(RANK, n, m)
                if variant == "paper":
                    floats += r * (n + m)
                else:
                    floats += r * (m if (c * k + it) % 2 == 0 else n)
        out.append(4 * floats)
    return out


@pytest.mark.parametrize("api", ["reference", "compressor"])
@pytest.mark.parametrize("config", list(TRAIN_CONFIGS))
def test_ranks_bitwise_identical_and_bytes_match_formula(results, config, api):
    runs = case(results[1], f"train/{config}/{api}")
    same_on_all_ranks(runs)  # bitwise: see its docstring
    assert all(torch.tensor(r["losses"]).isfinite().all() for r in runs)
    variant, k = TRAIN_CONFIGS[config]
    for r in runs:
        assert r["bytes"] == expected_bytes(variant, k)
    assert sum(runs[0]["bytes"][WARMUP:]) < 0.5 * sum(expected_bytes(variant, k)[:WARMUP]) * (STEPS - WARMUP) / WARMUP


def test_both_apis_agree(results):
    """The reference API and the compressor object share the math: same model after training."""
    for config in TRAIN_CONFIGS:
        ref = case(results[1], f"train/{config}/reference")[0]["params"]
        new = case(results[1], f"train/{config}/compressor")[0]["params"]
        jittered = case(results[1], f"train/{config}/jitter")[0]["params"]
        # The APIs differ only in buffer layout (the compressor fuses the exact tensors into the last factor
        # all-reduce), which may change the order of each element's W-term sum: <= (W - 1) eps relative per
        # element and step. The jittered run perturbs every gradient by that much at every step; 4x the
        # divergence it causes over the same 12 steps bounds the APIs' difference.
        within((new - ref).abs().max(), 4 * (jittered - ref).abs().max(), config)


def _check_conservation(runs: list[dict[str, Any]], iters: int) -> None:
    n_steps = len(runs[0]["records"])
    for step in range(n_steps):
        for j in range(len(runs[0]["records"][step])):
            ms = torch.stack([r["records"][step][j][0] for r in runs])
            avg = runs[0]["records"][step][j][1]
            res = torch.stack([r["records"][step][j][2] for r in runs])
            for r in runs[1:]:
                assert torch.equal(r["records"][step][j][1], avg), "average differs across ranks"
            bound = feedback_bound(ms, res, eps=EPS64, iters=iters, rank=RANK, matrix=ms.dim() > 2)
            within((avg + res.mean(0) - ms.mean(0)).abs(), bound, f"step {step} tensor {j}")


@pytest.mark.parametrize("variant", ["alternating", "paper"])
def test_error_feedback_loses_nothing(results, variant):
    _check_conservation(case(results[1], f"conservation/{variant}"), iters=2)
    _check_conservation(case(results[1], f"conservation_compressor/{variant}"), iters=1)


def test_bf16_factors_lose_nothing_and_send_fewer_bytes(results):
    """Factors sent in bf16: every rank gets the same rounded factors and the residual is M minus that shared
    approximation, so the rounding is carried by error feedback and the invariant holds at float64's bound (the
    same derivation: the rounding happens before any of the operations it counts). Fewer bytes than with the
    float64 factors of this float64 model, and exactly what bytes_per_step says."""
    runs = case(results[1], "conservation_compressor/paper_bf16")
    _check_conservation(runs, iters=1)
    fp32 = case(results[1], "conservation_compressor/paper")
    for r, full in zip(runs, fp32, strict=True):
        assert [got for got, _ in r["sent"]] == [want for _, want in r["sent"]], r["sent"]
        assert all(0 < got < full_got for (got, _), (full_got, _) in zip(r["sent"], full["sent"], strict=True))


@pytest.mark.parametrize("variant", ["alternating", "paper"])
def test_matches_naive_per_parameter_reference(results, variant):
    """Outputs and residuals equal a plain per-tensor float64 implementation of the algorithm. (The
    batched code is also checked bitwise against epfml/powersgd itself: test_powersgd_reference.py.)"""
    world = results[0]
    for r in case(results[1], f"naive/{variant}"):
        for step, d in enumerate(r["steps"]):
            # Compressed matrices (Frobenius norms over all of them): the two differ only in rounding, each operation
            # of a step by <= gamma(n + m + W) relative (its longest dot product and the W-term sum). The jittered
            # naive run changes every gradient by that much at every step; the divergence it causes through these
            # 4 steps (QR conditioning and error feedback included) bounds theirs; each side has its own
            # errors: 2x, and 2x safety.
            within(d["out"], 4 * d["out_jitter"], f"output, step {step}")
            within(d["residual"], 4 * d["residual_jitter"], f"residual, step {step}")
            # Exact tensors: the same W-term sums in other orders (one buffer against one per tensor),
            # (W - 1) u max_w |g_w| per side; both sides and 2x safety: 2 (W - 1) eps max_w |g_w|.
            for j, (err, absmax) in enumerate(zip(d["exact"], d["exact_absmax"], strict=True)):
                within(err, 2 * (world - 1) * EPS64 * absmax, f"exact tensor {j}, step {step}")


@pytest.mark.parametrize("name", ["full_rank/alternating_k2", "full_rank/paper_k1"])
def test_full_rank_is_exact_averaging(results, name):
    world, runs = results[0], case(results[1], name)
    k = 2 if name.endswith("k2") else 1
    for step in range(len(runs[0]["steps"])):
        per_rank = [r["steps"][step] for r in runs]
        for j, mat in enumerate(per_rank[0]["mat"]):
            frob = max(s["frob"][j] for s in per_rank)
            err = max(s["err"][j] for s in per_rank)
            if mat is None:  # averaged exactly, in another buffer than the reference's: two W-term sums whose
                # order may differ, (W - 1) u max|M| each; both and 2x safety: 2 (W - 1) eps max|M| <= ... ||M||_F
                within(err, 2 * (world - 1) * EPS64 * frob, f"{name} step {step} param {j}")
                continue
            n, m, r = mat
            assert r == n <= m, "every matrix here has n <= m: P is square"
            # approx - mean(M): P P^T != I by the measured |P^T P - I|_2 (the paper variant uses P P^T directly;
            # the alternating one's second iteration projects that residual back out, so it enters only at second
            # order), plus the n-term product (sqrt(r) n u ||M||_F), each iteration's (r + 1)-term updates and the
            # W-term sums (see dist_utils.feedback_bound): all on terms <= (k + 2) ||M||_F; u = eps / 2, 2x safety.
            ortho = max(s["ortho"][j] for s in per_rank) if name.startswith("full_rank/paper") else 0.0
            rounding = (r**0.5 * n + 2 * k * (r + 1) + 3 * world) * EPS64
            within(err, 2 * (ortho + rounding) * (k + 2) * frob, f"{name} step {step} param {j}")


def test_warmup_equals_plain_allreduce_bitwise(results):
    """Bitwise: during warm-up both pack the same tensors in the same order into one float32 buffer, divide it
    by W and all-reduce it: the same operations on the same buffer, on any CPU."""
    for r in case(results[1], "warmup"):
        for out, expected in r["pairs"]:
            assert len(out) == len(expected)
            for a, e in zip(out, expected, strict=True):
                assert torch.equal(a, e)


def test_nonfinite_gradient_on_one_rank(results):
    world_size, _ = results
    runs = case(results[1], "nonfinite")
    for rank, r in enumerate(runs):
        assert r["applied"] == [True, True, True, False, False, True]
        if rank == world_size - 1:
            assert f"too large on rank {rank}: big.weight reaches 1e+37" in r["too_large"], r["too_large"]
        else:
            assert (
                f"gradients on rank {rank} are finite: another rank's were non-finite (or too large" in r["too_large"]
            )
        assert r["state_unchanged"] and r["grads_untouched"] and r["params_finite"]
        for warm in (0, 5):
            msg = r[f"raised_warm{warm}"]
            assert msg, f"rank {rank} did not raise (warm-up {warm})"
            if rank == world_size - 1:
                assert "param[2]" in msg and f"rank {rank}" in msg  # fc1.weight is parameter #2
            else:
                assert "another rank" in msg
            assert r[f"factors_unchanged_warm{warm}"]
            assert r[f"step_counter_warm{warm}"] == 0


def test_reference_readme_usage(results):
    runs = case(results[1], "readme")
    for r in runs[1:]:
        assert torch.equal(r["params"], runs[0]["params"])
    assert runs[0]["compressed"] == ["param[0]"]  # 5x64 at rank 1, 2 iters: rate 4.6 < 10
    first, last = runs[0]["losses"][:5], runs[0]["losses"][-5:]
    assert sum(last) < 0.5 * sum(first), "training with compression must still learn"


def test_bf16_nothing_compressible_frozen_unused(results):
    runs = case(results[1], "mixed")
    for r in runs[1:]:
        assert torch.equal(r["bf16_params"], runs[0]["bf16_params"])
        assert torch.equal(r["plain_params"], runs[0]["plain_params"])
    for r in runs:
        assert r["bf16_grad_dtypes"] == ["torch.bfloat16"]
        assert r["bf16_params"].isfinite().all()
        assert r["plain_compressed"] == []
        assert r["unused_grad_is_zero"] and r["frozen_grad_is_none"]
