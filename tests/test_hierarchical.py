"""Hierarchical compression (exact inside a node, compressed between nodes) on 4 real gloo processes laid out as
2 nodes x 2 ranks: the exact path against a flat mean, error feedback's conservation per shard, the DDP hook
against the synchronous program, non-finite gradients, and state that cannot be resharded."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dist_utils import EPS32, EPS64, case, feedback_bound, guard, programs_finished_on_the_worker, run_ranks, within
from models import batch, loss_fn, make_model
from powertrain.checkpoint import from_blob, to_blob
from powertrain.compress import NonFiniteGradientError, hierarchical
from powertrain.compress import base as compress_base
from powertrain.compress.hierarchical import HierarchicalCompressor
from powertrain.ops import finite
from test_fsdp import same_state

NODES, LOCAL, RANK = 2, 2, 2
POWERSGD = {"rank": RANK, "start_compressing_after_num_steps": 0, "min_compression_rate": 0.0, "factor_dtype": "fp32"}


def _grads(model: torch.nn.Module, rank: int, step: int, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    model.zero_grad()
    loss_fn(model, *batch(rank, step, dtype)).backward()
    return [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters() if p.requires_grad
    ]


def _exact(rank: int) -> dict[str, Any]:
    model = make_model(torch.float32)  # "none" averages in float32
    comp = HierarchicalCompressor(model.named_parameters(), "none", local_world=LOCAL)
    grads = _grads(model, rank, 0, torch.float32)
    out = comp.aggregate(grads)
    return {"grads": grads, "out": out, "inter": comp.comm.stats.bytes_sent, "intra": comp.node_stats.bytes_sent}


def _conservation(rank: int) -> dict[str, Any]:
    model = make_model(torch.float64)
    comp = HierarchicalCompressor(model.named_parameters(), "powersgd", local_world=LOCAL, **POWERSGD)
    steps = []
    for step in range(3):
        grads = _grads(model, rank, step)
        old = [r.clone() for r in comp.residuals()]
        out = comp.aggregate(grads)
        steps.append({"grads": grads, "old": old, "out": out, "new": [r.clone() for r in comp.residuals()]})
    return {"steps": steps}


def _ddp_finished_on_the_worker(rank: int) -> dict[str, Any]:
    """:func:`_ddp_matches_program` with each call finished on its chain's worker after the node gather, its last
    collective (what NCCL on CUDA gets): the inner program's collectives stay with the caller."""
    with programs_finished_on_the_worker() as record:
        out = _ddp_matches_program(rank)
    return {**out, "finished": record.finished, "issued": record.issued}


def _ddp_matches_program(rank: int) -> dict[str, Any]:
    """DDP's hook (small buckets: several calls in flight) against the synchronous program on the same buckets."""
    from powertrain.ddp import register_compressor

    model = make_model(torch.float64)
    ref_model = make_model(torch.float64)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.002, find_unused_parameters=True)
    comp = HierarchicalCompressor(model.named_parameters(), "powersgd", local_world=LOCAL, **POWERSGD)
    ref = HierarchicalCompressor(ref_model.named_parameters(), "powersgd", local_world=LOCAL, **POWERSGD)
    calls: list[list[int]] = []
    program = comp.program
    comp.program = lambda grads, indices=None, **kw: (calls.append(list(indices)), program(grads, indices, **kw))[1]
    register_compressor(ddp, comp)
    diffs = []
    for step in range(3):
        calls.clear()
        model.zero_grad()
        loss_fn(ddp, *batch(rank, step, torch.float64)).backward()
        got = [p.grad if p.grad is not None else torch.zeros_like(p) for p in comp.params]
        grads = _grads(ref_model, rank, step)
        for idx in calls:
            avg = ref.aggregate([grads[i] for i in idx], idx)
            diffs.append(max(float((got[i] - a).abs().max()) for i, a in zip(idx, avg, strict=True)))
    return {"diffs": diffs, "calls": len(calls)}


def _nonfinite(rank: int) -> dict[str, Any]:
    """A NaN at the first call (no residual yet) and at the third (after two that committed): every rank raises,
    with the state (residuals, factors, counters) bitwise as before; a finite call reads one flag on the host."""
    model = make_model(torch.float64)
    comp = HierarchicalCompressor(model.named_parameters(), "powersgd", local_world=LOCAL, **POWERSGD)
    out: dict[str, Any] = {"raised": [], "unchanged": []}
    reads = []
    real = finite.read_flag

    def read(flag: Any) -> bool:
        reads.append(1)
        return real(flag)

    for step, bad in ((0, True), (0, False), (1, False), (2, True)):
        grads = _grads(model, rank, step)
        if bad and rank == 3:  # in the second node's second rank's shard only: the other shards must learn of it too
            grads[1].view(-1)[-1] = float("nan")
        before = copy.deepcopy(comp.state_dict())
        del reads[:]
        try:
            for m in (finite, compress_base, hierarchical):
                m.read_flag = read  # type: ignore[attr-defined]
            comp.aggregate(grads)
            out["reads"] = len(reads)
        except NonFiniteGradientError as e:
            out["raised"].append(str(e))
            out["unchanged"].append(same_state(before, comp.state_dict()))
        finally:
            for m in (finite, compress_base, hierarchical):
                m.read_flag = real  # type: ignore[attr-defined]
    return out


def _one_owner_fails(rank: int) -> dict[str, Any]:
    """A finite gradient too large for PowerSGD in one parameter, on every rank: only the local rank that owns it
    fails its inner call; the node gather tells the other, and every rank raises with all state as before."""
    model = make_model(torch.float32)
    comp = HierarchicalCompressor(model.named_parameters(), "powersgd", local_world=LOCAL, **POWERSGD)
    comp.aggregate(_grads(model, rank, 0, torch.float32))
    grads = _grads(model, rank, 1, torch.float32)
    big = max(range(len(grads)), key=lambda i: grads[i].numel())  # the largest: local rank 0's (_assign)
    if rank == NODES * LOCAL - 2:  # the second node's local rank 0
        grads[big].view(-1)[0] = 1e37  # finite, beyond PowerSGD's overflow limit for float32 (its _limit)
    before = copy.deepcopy(comp.state_dict())
    try:
        comp.aggregate(grads)
    except NonFiniteGradientError as e:
        return {"raised": str(e), "unchanged": same_state(before, comp.state_dict()), "owner": comp.owner[big]}
    return {"raised": ""}


def _state(rank: int) -> dict[str, Any]:
    model = make_model(torch.float64)
    comp = HierarchicalCompressor(model.named_parameters(), "powersgd", local_world=LOCAL, **POWERSGD)
    comp.aggregate(_grads(model, rank, 0))
    state = from_blob(to_blob(comp.state_dict()))  # as a checkpoint stores it (CompressorState)
    twin = HierarchicalCompressor(
        make_model(torch.float64).named_parameters(), "powersgd", local_world=LOCAL, **POWERSGD
    )
    twin.load_state_dict(state)
    grads = _grads(model, rank, 1)
    same = all(torch.equal(a, b) for a, b in zip(comp.aggregate(grads), twin.aggregate(grads), strict=True))
    other = dict(state, local_rank=(state["local_rank"] + 1) % LOCAL)
    try:
        twin.load_state_dict(other)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {"same": same, "refused": refused}


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    )


def _hsdp_grads(model: torch.nn.Module, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * rank + step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()


def _hsdp(rank: int) -> dict[str, Any]:
    """HSDP with its replicate dimension averaged by a compressor (powertrain.fsdp.compress_replicas) against
    FSDP2's own HSDP on the same 2 x 2 mesh: the gradients of one step with the exact compressor, and a few SGD
    steps with PowerSGD."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from powertrain.fsdp import compress_replicas

    mesh = init_device_mesh("cpu", (NODES, LOCAL), mesh_dim_names=("replicate", "shard"))
    native = fully_shard(_mlp(), mesh=mesh)
    ours = fully_shard(_mlp(), mesh=mesh["shard"])
    comp = compress_replicas(ours, "none", group=mesh["replicate"].get_group())
    for m in (native, ours):
        _hsdp_grads(m, rank, 0)
    partial = _mlp()
    fully_shard(partial[0], mesh=mesh["shard"])  # the root not sharded: its other layers would never be averaged
    try:
        compress_replicas(partial, "none", group=mesh["replicate"].get_group())
        refused = ""
    except ValueError as e:
        refused = str(e)
    grads = [
        (a.grad.to_local().clone(), b.grad.to_local().clone())
        for a, b in zip(native.parameters(), ours.parameters(), strict=True)
    ]
    model = fully_shard(_mlp(), mesh=mesh["shard"])
    psgd = compress_replicas(
        model,
        "powersgd",
        group=mesh["replicate"].get_group(),
        rank=2,
        start_compressing_after_num_steps=1,
        min_compression_rate=0.0,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, sent = [], []
    for _ in range(6):
        opt.zero_grad()
        g = torch.Generator().manual_seed(100 * rank)  # one batch per rank: the loss must fall
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        sent.append(psgd.comm.stats.bytes_sent)
    shards = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
    return {
        "grads": grads,
        "refused": refused,
        "exact_bytes": comp.comm.stats.bytes_sent,
        "psgd_bytes": sent[-1] - sent[-2],
        "losses": losses,
        "shards": shards,
    }


def _cases(rank: int, world: int) -> dict[str, Any]:
    assert world == NODES * LOCAL
    torch.manual_seed(0)
    return {
        name: guard(fn, rank)
        for name, fn in {
            "exact": _exact,
            "conservation": _conservation,
            "ddp": _ddp_matches_program,
            "ddp_worker": _ddp_finished_on_the_worker,
            "nonfinite": _nonfinite,
            "one_owner": _one_owner_fails,
            "state": _state,
            "hsdp": _hsdp,
        }.items()
    }


@pytest.fixture(scope="module")
def results():
    return run_ranks(_cases, NODES * LOCAL, timeout=120)


def test_exact_inner_is_the_flat_mean(results):
    runs = case(results, "exact")
    for j in range(len(runs[0]["grads"])):
        xs = torch.stack([r["out"][j] for r in runs])
        assert (xs == xs[0]).all(), "ranks got different averages"
        g = torch.stack([r["grads"][j] for r in runs])
        # Divisions by 2 are exact; the node sum and the inter-node sum round once each (2 u) against the
        # reference's 3-term sum (3 u) over terms <= mean |g| x 4 / 4: 5 u = 2.5 eps; 2x safety.
        within((xs[0] - g.mean(0)).abs(), 5 * EPS32 * g.abs().mean(0), f"tensor {j}")
    # inter-node: each rank sends its shard only (about half its gradient's bytes), inside the node the whole one
    total = sum(g.numel() * 4 for g in runs[0]["grads"])
    assert runs[0]["intra"] >= total
    assert runs[0]["inter"] < 0.6 * total, (runs[0]["inter"], total)


def test_error_feedback_is_conserved_per_shard(results):
    runs = case(results, "conservation")
    for step in range(len(runs[0]["steps"])):
        for j in range(len(runs[0]["steps"][step]["grads"])):
            g, old, new, out = (
                torch.stack([r["steps"][step][key][j] for r in runs]) for key in ("grads", "old", "new", "out")
            )
            assert (out == out[0]).all(), "ranks got different averages"
            # per node: its mean gradient (bitwise what the ranks averaged: two halves summed) and its residual,
            # the sum of its ranks' shards (disjoint rows: exact)
            x = torch.stack(
                [
                    g[n * LOCAL : (n + 1) * LOCAL].div(LOCAL).sum(0) + old[n * LOCAL : (n + 1) * LOCAL].sum(0)
                    for n in range(NODES)
                ]
            )
            e1 = torch.stack([new[n * LOCAL : (n + 1) * LOCAL].sum(0) for n in range(NODES)])
            # The flat compressor's bound over the NODES inputs (dist_utils.feedback_bound), plus the node mean's
            # one rounding and the residual's addition (2 u |x|) inside its 2x safety.
            bound = feedback_bound(x, e1, eps=EPS64, iters=1, rank=RANK, matrix=x.dim() > 2)
            within((out[0] + e1.mean(0) - x.mean(0)).abs(), bound, f"step {step} tensor {j}")


def test_ddp_hook_runs_the_same_program(results):
    runs = case(results, "ddp")
    assert runs[0]["calls"] >= 3, "small buckets must make several hook calls"
    # identical operations in identical order on identical inputs: bitwise
    for r in runs:
        assert max(r["diffs"]) == 0.0, r["diffs"]


def test_ddp_hook_finished_on_the_worker_is_the_same_program(results):
    """Each call's program, finished on the worker after its node gather (its only checked collective: the inner
    PowerSGD's are unchecked for the driver, so no collective is issued from the worker), is still bitwise the
    synchronous program."""
    for r in case(results, "ddp_worker"):
        assert r["calls"] >= 3 and max(r["diffs"]) == 0.0, r["diffs"]
        assert r["finished"] and set(r["finished"]) == {"powertrain-chain"}, r["finished"]
        assert r["issued"] and "powertrain-chain" not in r["issued"], "a collective was issued from the worker"


def test_nonfinite_on_one_rank_raises_everywhere(results):
    for rank, r in enumerate(case(results, "nonfinite")):
        assert len(r["raised"]) == 2 and all("non-finite" in m for m in r["raised"]), f"rank {rank}: {r['raised']}"
        assert r["unchanged"] == [True, True], f"rank {rank} changed its state"
        # the node gather's read only: the inner PowerSGD's flag travels in it (a read of its own would hold a DDP
        # hook's issuing thread on CUDA: its last collective is unchecked for the driver)
        assert r["reads"] == 1, f"rank {rank}: {r['reads']} host reads of a flag in a call"
    for rank, r in enumerate(case(results, "one_owner")):
        assert r["raised"] and r["owner"] == 0, f"rank {rank}: {r}"
        assert r["unchanged"], f"rank {rank} changed its state (its own inner call was finite: the node decides)"


def test_state_round_trip_and_no_resharding(results):
    for r in case(results, "state"):
        assert r["same"]
        assert "cannot be resharded" in r["refused"]


def test_bad_layout_is_refused():
    model = make_model()
    with pytest.raises(ValueError, match="local_world=0"):
        HierarchicalCompressor(model.parameters(), local_world=0)
    with pytest.raises(ValueError, match="would nest"):
        HierarchicalCompressor(model.parameters(), "hierarchical", local_world=1)


def test_single_process_is_the_inner_compressor():
    """Alone (no process group), one node of one rank: nothing is sent and the mean is the gradient."""
    model = make_model(torch.float32)  # "none" averages in float32
    comp = HierarchicalCompressor(model.named_parameters(), "none", local_world=1)
    grads = _grads(model, 0, 0, torch.float32)
    assert all(torch.equal(a, g) for a, g in zip(comp.aggregate(grads), grads, strict=True))
    assert comp.comm.stats.bytes_sent == 0 and comp.node_stats.bytes_sent == 0
    assert not dist.is_initialized()


def test_hsdp_with_a_compressed_replicate_dimension(results):
    runs = case(results, "hsdp")
    for r in runs:
        assert "manage 2 of the model's trainable parameters" in r["refused"], r["refused"]
        for j, (native, ours) in enumerate(r["grads"]):
            # Each entry: 4 ranks' gradients reduced in two stages by both (reduce-scatter in the node, then the
            # replicas), divided by powers of two: the same sums in the same order up to how the halving is placed,
            # which is exact. Allow the 3 roundings of a 4-term sum (u = eps/2) of terms <= |entry| x 4: 6 eps.
            within(
                (native - ours).abs(), 6 * EPS32 * native.abs().clamp_min(native.abs().max() * 1e-3), f"gradient {j}"
            )
        assert 0 < r["psgd_bytes"] < r["exact_bytes"] / 2, "a compressed step sends less over the replicas"
        assert r["losses"][-1] < r["losses"][0]
    # the two replicas of each shard agree bitwise: the compressor hands both the same average
    for n in range(1, NODES):
        for j in range(LOCAL):
            assert torch.equal(runs[j]["shards"], runs[n * LOCAL + j]["shards"])
