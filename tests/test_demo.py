"""DeMo and FlexDeMo: the chunked DCT / top-k math, a dense float64 DeMo written here (1 and 2 simulated ranks),
DDP with local_gradients on 2 gloo ranks (no gradient all-reduce, ranks bitwise equal, payload bytes exact),
resume bitwise, and FlexDeMo on a 2x2 mesh against plain DeMo on the shard-shaped pieces."""

from __future__ import annotations

import copy
import io
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dist_utils import case, guard, run_ranks, value_errors
from models import batch, loss_fn, make_model
from powertrain.ddp import local_gradients
from powertrain.ops.flat import local_tensor
from powertrain.optim.demo import DeMo, FlexDeMo
from powertrain.optim.demo.dct import (
    chunk_layout,
    chunk_size,
    dct_basis,
    decode,
    encode,
    mean_over_senders,
    scatter_chunks,
    topk_per_chunk,
)

# chunk 8 and top-4: several chunks per matrix, top-k below the chunk size, odd chunks (7 x 5 for the 7x15 weight)
OPTS: dict[str, Any] = dict(lr=0.01, compression_decay=0.9, compression_topk=4, compression_chunk=8, weight_decay=0.1)
STEPS = 4
EPS64 = torch.finfo(torch.float64).eps


def _sign_step_bound(params: torch.Tensor) -> float:
    """How far two correct DeMo runs in float64 may part: the update is +-lr per entry (exact) and the decay
    one multiply, so the runs are equal unless a top-k choice or a sign flips (which moves an entry by ~lr: any
    different DCT or top-k code does), or their two in-place operations round differently (2 ulps per step); a
    flip needs two coefficients within float64 rounding of each other."""
    return 2 * STEPS * EPS64 * params.abs().max().item()


# ---------------------------------------------------------------- the math


def _largest_divisor(n: int, target: int) -> int:
    return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


def test_chunk_size_is_the_largest_divisor_at_most_the_target():
    for n in range(1, 131):
        for target in range(1, 70):
            assert chunk_size(n, target) == _largest_divisor(n, target), (n, target)
    assert [chunk_size(n, 64) for n in (7, 15, 96, 127, 4096)] == [7, 15, 48, 1, 64]
    assert tuple(chunk_layout((7, 15), 4)) == (7, 15, 1, 3)
    assert tuple(chunk_layout((8, 3, 3, 3), 8)) == (8, 27, 8, 3)  # conv weight as 8 x 27
    assert tuple(chunk_layout((32,), 8)) == (1, 32, 1, 8)  # a vector is one row


def _dct_by_fft(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal DCT-II along the last dim via an FFT of the mirrored signal (independent of dct_basis)."""
    n = x.shape[-1]
    y = torch.fft.fft(torch.cat([x, x.flip(-1)], dim=-1))[..., :n]
    k = torch.arange(n, dtype=torch.float64)
    out = (torch.exp(-1j * math.pi * k / (2 * n)) * y).real / 2
    scale = torch.full((n,), math.sqrt(2.0 / n), dtype=torch.float64)
    scale[0] = math.sqrt(1.0 / n)
    return out * scale


@pytest.mark.parametrize("n", [1, 2, 7, 8, 27, 64])
def test_dct_basis_is_orthonormal_and_the_dct(n):
    c = dct_basis(n, dtype=torch.float64)
    # each entry: cos of an argument < pi n rounded 4 times (pi, *, *, /), so |dC| <= sqrt(2/n) (2 pi n + 2) eps;
    # rows are unit vectors: |C C^T - I| <= 2 sqrt(n) max |dC| + gamma_n, the worst case (measured 1/80 of it
    # at n = 64, 1/24 at n = 8)
    entry = math.sqrt(2 / n) * (2 * math.pi * n + 2) * EPS64
    assert ((c @ c.T - torch.eye(n, dtype=torch.float64)).abs() <= 2 * math.sqrt(n) * entry + n * EPS64).all()
    x = torch.randn(5, n, dtype=torch.float64)
    # the product: ||x_row|| (||dC_row|| + gamma_n); the FFT of 2n points: ~log2(2n) levels of ~7 eps each
    # (twiddles and butterflies, Higham 2002, ch. 24), then the twiddle, halving and scaling; worst case (measured
    # at most 1/16)
    per_norm = math.sqrt(n) * entry + n * EPS64 + (7 * math.log2(2 * n) + 4) * EPS64
    assert ((x @ c.T - _dct_by_fft(x)).abs() <= per_norm * x.norm(dim=1, keepdim=True)).all()


def _defect(c: torch.Tensor) -> float:
    """An upper bound on a basis' orthonormality defect max |C^T C - I|: computed in float64 (exact products of
    float32 entries), plus gamma_n for the float64 product's own rounding."""
    n = c.shape[0]
    gram = c.double().T @ c.double()
    return (gram - torch.eye(n, dtype=torch.float64)).abs().max().item() + n * EPS64


@pytest.mark.parametrize("shape", [(7, 15), (96, 64), (8, 3, 3, 3), (33,), (1,), (32, 72)])
def test_round_trip_is_exact_at_full_topk(shape):
    """Top-k with k = chunk size keeps everything: decode(encode(x)) == x to float rounding, and each chunk's
    coefficients are the 2-D DCT of that chunk."""
    for dtype in (torch.float32, torch.float64):
        eps = torch.finfo(dtype).eps
        cache: dict[int, torch.Tensor] = {}
        basis = lambda n, dtype=dtype, cache=cache: cache.setdefault(n, dct_basis(n, dtype=dtype))
        x = torch.randn(shape, dtype=dtype)
        layout = chunk_layout(shape, 8)
        c1, c2 = layout.c1, layout.c2
        coeff = encode(x, layout, basis)
        assert coeff.shape == (layout.num_chunks, layout.chunk_numel)
        values, idx = topk_per_chunk(coeff, 10**6)
        back = decode(scatter_chunks(values, idx, layout.chunk_numel), layout, shape, basis)
        assert back.shape == x.shape
        # two c-term products per dimension and way, typical sqrt(c) eps each on values of the size of x (the
        # transforms are orthonormal), 4x for the largest of the entries; plus the bases' orthonormality defect
        # d = max |C^T C - I| (float64: its arguments < c pi are rounded), at most c d max|x| per dimension.
        # Measured at most 1/6 of the bound (300 random x)
        rounding = 4 * (math.sqrt(c1) + math.sqrt(c2)) * eps + c1 * _defect(basis(c1)) + c2 * _defect(basis(c2))
        assert (back - x).abs().max() <= rounding * x.abs().max()
        # the last chunk (row-major over the grid) is the DCT of the matrix view's bottom-right block: the same
        # two products, maybe by other kernels (a batched product against two plain ones): each side's typical
        # rounding, sqrt(c1) + sqrt(c2) eps of the chunk's norm, 4x for the largest entry (measured <= 1/100)
        m = x.reshape(layout.rows, layout.cols)
        block = m[-c1:, -c2:]
        expect = basis(c1) @ block @ basis(c2).T
        assert (coeff[-1] - expect.reshape(-1)).abs().max() <= 8 * (math.sqrt(c1) + math.sqrt(c2)) * eps * block.norm()


def test_topk_picks_the_largest_magnitudes():
    torch.manual_seed(0)
    coeff = torch.randn(6, 20)
    values, idx = topk_per_chunk(coeff, 5)
    assert values.shape == idx.shape == (6, 5)
    expect = coeff.abs().argsort(dim=-1, descending=True)[:, :5]
    for r in range(6):
        assert set(idx[r].tolist()) == set(expect[r].tolist())
    assert torch.equal(values, coeff.gather(1, idx))  # signed values, not magnitudes
    assert topk_per_chunk(coeff, 0)[0].shape == (6, 1)  # k clamped to [1, chunk size]
    assert topk_per_chunk(coeff, 99)[0].shape == (6, 20)


def test_mean_over_senders_averages_only_those_who_sent():
    values = torch.tensor([[[1.0, 2.0]], [[3.0, 10.0]]])  # 2 senders, 1 chunk, k = 2
    idx = torch.tensor([[[0, 1]], [[0, 3]]])
    assert mean_over_senders(values, idx, 4).tolist() == [[2.0, 2.0, 0.0, 10.0]]


# ---------------------------------------------------------------- a dense DeMo written here


def _basis64(n: int) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    scale = torch.where(k == 0, math.sqrt(1.0 / n), math.sqrt(2.0 / n))
    return scale * torch.cos(math.pi * (2 * i + 1) * k / (2 * n))


def _reference_update(
    params: Sequence[torch.Tensor], grads: list[list[torch.Tensor | None]], moms: list[list[Any]], opts: dict[str, Any]
) -> None:
    """One DeMo step for ``W = len(grads)`` simulated ranks, float64, dense: each chunked matrix is transformed
    by block-diagonal DCT matrices, top-k is picked chunk by chunk in loops, and the sent coefficients are
    averaged over the ranks that sent them, then the sign step."""
    lr, topk, chunk = opts["lr"], opts["compression_topk"], opts["compression_chunk"]
    for i, p in enumerate(params):
        if grads[0][i] is None:
            continue
        shape = p.shape
        rows, cols = (1, p.numel()) if p.dim() == 1 else (shape[0], p.numel() // shape[0])
        c1, c2 = _largest_divisor(rows, chunk), _largest_divisor(cols, chunk)
        t1 = torch.block_diag(*[_basis64(c1)] * (rows // c1))
        t2 = torch.block_diag(*[_basis64(c2)] * (cols // c2))
        p.mul_(1 - lr * opts["weight_decay"])
        total = torch.zeros(rows, cols, dtype=torch.float64)
        count = torch.zeros(rows, cols, dtype=torch.float64)
        for r, rank_grads in enumerate(grads):
            if moms[r][i] is None:
                moms[r][i] = torch.zeros(rows, cols, dtype=torch.float64)
            m = moms[r][i]
            m.mul_(opts["compression_decay"]).add_(rank_grads[i].reshape(rows, cols), alpha=lr)  # type: ignore[union-attr]
            f = t1 @ m @ t2.T
            mask = torch.zeros(rows, cols, dtype=torch.bool)
            for a in range(rows // c1):
                for b in range(cols // c2):
                    block = f[a * c1 : (a + 1) * c1, b * c2 : (b + 1) * c2]
                    keep = block.reshape(-1).abs().topk(min(topk, c1 * c2)).indices
                    chosen = torch.zeros(c1 * c2, dtype=torch.bool)
                    chosen[keep] = True
                    mask[a * c1 : (a + 1) * c1, b * c2 : (b + 1) * c2] = chosen.view(c1, c2)
            sent = torch.where(mask, f, 0.0)
            m.sub_(t1.T @ sent @ t2)
            total += sent
            count += mask
        q = t1.T @ (total / count.clamp_min(1)) @ t2
        p.sub_(lr * q.sign().reshape(shape))


def _reference_run(world: int, steps: int, opts: dict[str, Any]) -> torch.Tensor:
    model = make_model(torch.float64)
    params = list(model.parameters())
    moms: list[list[Any]] = [[None] * len(params) for _ in range(world)]
    for step in range(steps):
        grads = []
        for r in range(world):
            model.zero_grad()
            loss_fn(model, *batch(r, step, torch.float64)).backward()
            grads.append([p.grad.clone() if p.grad is not None else None for p in params])
        with torch.no_grad():
            _reference_update(params, grads, moms, opts)
    return torch.cat([p.detach().reshape(-1) for p in params])


def _stepped_shapes(model: torch.nn.Module) -> list[list[int]]:
    """Shapes of the parameters that get gradients (not the frozen or the unused layer)."""
    return [list(p.shape) for n, p in model.named_parameters() if p.requires_grad and not n.startswith("unused")]


def _payload_bytes(shapes: list[list[int]], opts: dict[str, Any], value_bytes: int) -> int:
    """What one step sends: ``K`` values and ``K`` int16 positions, ``K = sum chunks * min(topk, chunk size)``
    over the parameters with gradients, then pack_payload's flag byte and padding to a multiple of 8."""
    k_total = 0
    for shape in shapes:
        rows, cols = (1, shape[0]) if len(shape) == 1 else (shape[0], math.prod(shape[1:]))
        c1, c2 = _largest_divisor(rows, opts["compression_chunk"]), _largest_divisor(cols, opts["compression_chunk"])
        k_total += (rows // c1) * (cols // c2) * min(opts["compression_topk"], c1 * c2)
    used = k_total * (value_bytes + 2)
    return used + (-(used + 1)) % 8 + 1


def _demo_run(steps: int, opts: dict[str, Any], dtype: torch.dtype = torch.float64) -> tuple[torch.nn.Module, DeMo]:
    model = make_model(dtype)
    opt = DeMo(model.parameters(), comm_dtype=dtype, **opts)
    rank = dist.get_rank() if dist.is_initialized() else 0
    for step in range(steps):
        opt.zero_grad()
        loss_fn(model, *batch(rank, step, dtype)).backward()
        opt.step()
    return model, opt


def test_world_size_1_matches_the_dense_reference_and_skips_frozen_and_unused():
    """float64 throughout: any different top-k choice or sign would move a value by ~lr = 1e-2, far above
    the tolerance (see _sign_step_bound), which the different order of the DCT's sums never reaches."""
    model, opt = _demo_run(STEPS, OPTS)
    ours = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = _reference_run(1, STEPS, OPTS)
    assert (ours - ref).abs().max() <= _sign_step_bound(ref)
    fresh = make_model(torch.float64)
    for name in ("frozen", "unused"):
        for p, q in zip(getattr(model, name).parameters(), getattr(fresh, name).parameters(), strict=True):
            assert torch.equal(p, q), f"{name} changed"
            assert p not in opt.state, f"{name} has optimizer state"
    assert opt.comm.stats.bytes_sent == 0 and opt.comm.stats.num_collectives == 0  # nothing to send alone


def test_bad_options_refused():
    p = [torch.nn.Parameter(torch.zeros(3, 3))]
    attempts: dict[str, dict[str, Any]] = {
        "lr=0": dict(lr=0.0),
        "compression_decay=1.0": dict(compression_decay=1.0),
        "compression_decay=-0.1": dict(compression_decay=-0.1),
        "compression_topk=0": dict(compression_topk=0),
        "compression_chunk=2.5": dict(compression_chunk=2.5),
        "weight_decay=-1": dict(weight_decay=-1),
        "comm_dtype=torch.int8": dict(comm_dtype=torch.int8),
    }
    for text, kwargs in attempts.items():
        with pytest.raises(ValueError, match=f"Invalid {text}"):
            DeMo(p, **kwargs)
    with pytest.raises(ValueError, match="needs a DistributedDataParallel"):
        local_gradients(torch.nn.Linear(2, 2))  # type: ignore[arg-type]


# ---------------------------------------------------------------- 2 ranks: DDP, payload, resume


def _allreduced_numel(fn: Any) -> int:
    """Elements all-reduced by gloo while ``fn()`` runs, as the profiler records them."""
    from torch.profiler import profile

    with profile(record_shapes=True) as prof:
        fn()
    return sum(math.prod(s[0]) for e in prof.events() if e.name == "gloo:all_reduce" for s in [e.input_shapes])


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None, "a parameter that should have a gradient has none"
    return p.grad


def _full(p: torch.Tensor) -> torch.Tensor:
    assert isinstance(p, DTensor), "FSDP2 parameters are DTensors"
    return p.full_tensor()


def _ddp_case(rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(torch.float64)
    ddp = local_gradients(DDP(model, find_unused_parameters=True))
    opt = DeMo(ddp.parameters(), comm_dtype=torch.float64, **OPTS)
    plain = make_model(torch.float64)
    sent, backward_numel, grads_local = [], [], True
    for step in range(STEPS):
        opt.zero_grad()
        backward_numel.append(_allreduced_numel(lambda s=step: loss_fn(ddp, *batch(rank, s, torch.float64)).backward()))
        plain.load_state_dict(model.state_dict())
        plain.zero_grad()
        loss_fn(plain, *batch(rank, step, torch.float64)).backward()
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            grads_local &= (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
        before = opt.comm.stats.bytes_sent
        opt.step()
        sent.append(opt.comm.stats.bytes_sent - before)
    # control: the profiler does see a normal DDP's gradient all-reduce
    control = DDP(make_model(torch.float64), find_unused_parameters=True)
    control_numel = _allreduced_numel(lambda: loss_fn(control, *batch(rank, 0, torch.float64)).backward())
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "sent": sent,
        "collectives": opt.comm.stats.num_collectives,
        "backward_numel": backward_numel,
        "control_numel": control_numel,
        "grads_local": grads_local,
        "grad0": _grad(model.conv.weight).clone(),
    }


def _resume_case() -> dict[str, Any]:
    opts = {**OPTS, "compression_chunk": 64, "compression_topk": 32}  # the reference defaults' chunk and top-k
    rank = dist.get_rank()
    full, _ = _demo_run(6, opts, torch.float32)
    model, opt = _demo_run(3, opts, torch.float32)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model = make_model(torch.float32)
    model.load_state_dict(saved["model"])
    opt = DeMo(model.parameters(), **opts)
    opt.load_state_dict(saved["opt"])
    sent = []
    for step in range(3, 6):
        opt.zero_grad()
        loss_fn(model, *batch(rank, step)).backward()
        before = opt.comm.stats.bytes_sent
        opt.step()
        sent.append(opt.comm.stats.bytes_sent - before)
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    return {"full": flat(full), "resumed": flat(model), "sent": sent}


def _int32_case() -> dict[str, Any]:
    """A 200 x 200 weight in one chunk of 40000 coefficients: positions need int32."""
    lin = torch.nn.Linear(200, 200)
    opt = DeMo(lin.parameters(), compression_chunk=200, compression_topk=5)
    lin(torch.randn(3, 200)).sum().backward()
    opt.step()
    return {"sent": opt.comm.stats.bytes_sent}


def _mismatch_case() -> str:
    """Ranks stepping different parameters of the same size: the layout byte catches it."""
    a, b = torch.nn.Parameter(torch.ones(8)), torch.nn.Parameter(torch.ones(8))
    opt = DeMo([a, b])
    (a if dist.get_rank() == 0 else b).grad = torch.ones(8)
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return ""


def demo_2_rank_cases(rank: int, world: int) -> dict[str, Any]:
    return {
        "ddp": guard(_ddp_case, rank),
        "resume": guard(_resume_case),
        "int32": guard(_int32_case),
        "mismatch": guard(_mismatch_case),
    }


def test_two_ranks_ddp_resume_and_payload():
    runs = run_ranks(demo_2_rank_cases, 2, timeout=120)
    ddp = case(runs, "ddp")
    ref = _reference_run(2, STEPS, OPTS)
    model = make_model(torch.float64)
    for r in ddp:
        assert torch.equal(r["params"], ddp[0]["params"]), "ranks diverged"
        assert (r["params"] - ref).abs().max() <= _sign_step_bound(ref), "differs from the dense reference (2 ranks)"
        assert r["grads_local"], "DDP changed the local gradients"
        # with the hook, backward all-reduces only DDP's bitmap of used parameters (one value per parameter)
        assert all(n <= len(list(model.parameters())) for n in r["backward_numel"]), r["backward_numel"]
        assert r["control_numel"] >= sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert r["sent"] == [_payload_bytes(_stepped_shapes(model), OPTS, value_bytes=8)] * STEPS  # float64 values
        assert r["collectives"] == STEPS  # one all-gather per step
    assert not torch.equal(ddp[0]["grad0"], ddp[1]["grad0"]), "gradients were averaged"
    resume = case(runs, "resume")
    opts = {**OPTS, "compression_chunk": 64, "compression_topk": 32}
    for r in resume:
        assert torch.equal(r["full"], resume[0]["full"]), "ranks diverged"
        assert torch.equal(r["resumed"], r["full"]), "resume is not bitwise the uninterrupted run"
        assert r["sent"] == [_payload_bytes(_stepped_shapes(model), opts, value_bytes=4)] * 3  # float32 values
    for r in case(runs, "int32"):
        # weight and bias: one chunk each (200 x 200 and 1 x 200), 5 values each; float32 values, int32 positions
        used = (5 + 5) * (4 + 4)
        assert r["sent"] == used + (-(used + 1)) % 8 + 1
    for msg in case(runs, "mismatch"):
        assert "ranks disagree on the parameters" in msg


# ---------------------------------------------------------------- FlexDeMo: 4 ranks as a 2 x 2 mesh


def flex_cases(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shard_group, shard_index = mesh["shard"].get_group(), mesh["shard"].get_local_rank()

    def run() -> dict[str, Any]:
        model = make_model()
        fully_shard(model.fc1, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        opt = FlexDeMo(model.parameters(), mesh, **OPTS)
        # trusted way: plain DeMo over the replicate group on the shard-shaped pieces of an unsharded copy,
        # given the shard group's mean gradient (all-reduced here with a plain collective)
        plain = make_model()
        pieces = [
            torch.nn.Parameter(p.detach().chunk(2, dim=0)[shard_index].clone(), requires_grad=p.requires_grad)
            for p in plain.parameters()
        ]
        ref = DeMo(pieces, group=mesh["replicate"].get_group(), **OPTS)
        sent = []
        for step in range(STEPS):
            opt.zero_grad()
            loss_fn(model, *batch(rank, step)).backward()
            before = opt.comm.stats.bytes_sent
            opt.step()
            sent.append(opt.comm.stats.bytes_sent - before)
            plain.zero_grad()
            loss_fn(plain, *batch(rank, step)).backward()
            for p, piece in zip(plain.parameters(), pieces, strict=True):
                piece.grad = None
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=shard_group)
                    piece.grad = p.grad.div(2).chunk(2, dim=0)[shard_index].clone()
            ref.step()
            with torch.no_grad():  # the unsharded copy follows the pieces (for the next gradient)
                for p, piece in zip(plain.parameters(), pieces, strict=True):
                    start = sum(c.shape[0] for c in p.chunk(2, dim=0)[:shard_index])
                    p.zero_()[start : start + piece.shape[0]] = piece  # uneven pieces: sum zero-padded copies
                    dist.all_reduce(p, group=shard_group)
        local = torch.cat([local_tensor(p).detach().reshape(-1) for p in model.parameters()])
        expect = torch.cat([q.detach().reshape(-1) for q in pieces])
        shapes = [local_tensor(p).shape for p in model.parameters() if p.requires_grad and p.grad is not None]
        return {
            "local": local,
            "expect": expect,
            "sent": sent,
            "shapes": [list(s) for s in shapes],
            "full": torch.cat([_full(p).reshape(-1) for p in model.parameters()]),
        }

    def aligned() -> dict[str, Any]:
        """Shards whose boundaries fall on chunk boundaries (every dim 0 is a multiple of 2 x 8): FlexDeMo equals
        plain DeMo over the replicate group on the full parameters, given the shard group's mean gradient."""
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
        full = copy.deepcopy(model)
        fully_shard(model, mesh=mesh["shard"])
        opt = FlexDeMo(model.parameters(), mesh, **OPTS)
        ref = DeMo(full.parameters(), group=mesh["replicate"].get_group(), **OPTS)
        for step in range(STEPS):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * rank + step))
            for m, o in ((model, opt), (full, ref)):
                o.zero_grad()
                m(x).pow(2).mean().backward()
            for p in full.parameters():
                dist.all_reduce(_grad(p), group=shard_group)
                _grad(p).div_(2)
            opt.step()
            ref.step()
        return {
            "flex": torch.cat([_full(p).reshape(-1) for p in model.parameters()]),
            "full": torch.cat([p.detach().reshape(-1) for p in full.parameters()]),
        }

    def refusals() -> dict[str, str]:
        plain = make_model()
        return value_errors(
            {
                "plain tensor": lambda: FlexDeMo(plain.parameters(), mesh),
                "1-D mesh": lambda: FlexDeMo(plain.parameters(), init_device_mesh("cpu", (4,))),
                "dim name": lambda: FlexDeMo(plain.parameters(), mesh, replicate_dim="dp"),
                "group": lambda: FlexDeMo(plain.parameters(), mesh, group=None),
            }
        )

    return {"run": guard(run), "aligned": guard(aligned), "refusals": guard(refusals)}


def test_flexdemo_2x2_mesh_matches_demo_on_shards():
    runs = run_ranks(flex_cases, 4, timeout=150)
    res = case(runs, "run")
    # mesh [[0, 1], [2, 3]]: replicate groups {0, 2} and {1, 3}, shard groups {0, 1} and {2, 3}
    assert torch.equal(res[0]["local"], res[2]["local"]) and torch.equal(res[1]["local"], res[3]["local"])
    assert not torch.equal(res[0]["local"][:100], res[1]["local"][:100]), "the two shard indices hold different parts"
    for r in res:
        assert torch.equal(r["full"], res[0]["full"]), "shard groups disagree on the model"
        # bitwise: the same operations on pieces of the same shapes as the shards (the mean gradient is exact:
        # a sum of two halves)
        assert torch.equal(r["local"], r["expect"]), "differs from plain DeMo on the shard pieces"
    for r in res:
        assert r["sent"] == [_payload_bytes(r["shapes"], OPTS, value_bytes=4)] * STEPS
    assert [4, 15] in res[0]["shapes"] and [3, 15] in res[1]["shapes"]  # the 7x15 weight's shards
    for r in case(runs, "aligned"):
        # bitwise although the DCT runs on half as many chunks per product (possibly other kernels, other last
        # bits): the update is +-lr (exact) after the same decay, so only a flipped sign or top-k choice could
        # show, and that needs two float32 coefficients within rounding of each other (see _sign_step_bound)
        assert torch.equal(r["flex"], r["full"]), "chunk-aligned shards: differs from plain DeMo on full parameters"
    msgs = case(runs, "refusals")[0]
    assert "fully_shard(module, mesh=mesh['shard'])" in msgs["plain tensor"]
    assert "2-D DeviceMesh" in msgs["1-D mesh"]
    assert "Invalid replicate_dim='dp'" in msgs["dim name"]
    assert "takes no group" in msgs["group"]
