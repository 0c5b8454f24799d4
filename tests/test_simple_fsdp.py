"""SimpleFSDP (powertrain.simple_fsdp.data_parallel) on real gloo ranks: parity with FSDP2 and DDP, HSDP,
mixed precision, reshard-after-forward memory (eager and compiled), DCP save/load, and refused input.

The model has a parameter at its root next to submodules with parameters (nested checkpoint regions), a
conv weight and 7x15 / 15-row matrices that do not divide by 2 or 4 ranks, a frozen and an unused layer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_utils import case, guard, run_ranks, value_errors
from models import Adversarial, batch, loss_fn
from powertrain.bench.memory import available as heap_available
from powertrain.bench.memory import heap_in_use
from powertrain.simple_fsdp import MixedPrecision, data_parallel

STEPS = 6


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Adversarial()
        self.scale = nn.Parameter(torch.tensor([1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


def _model(freeze_unused: bool = False) -> Scaled:
    torch.manual_seed(0)
    m = Scaled()
    # An optimizer has no state for a parameter that never got a gradient, but a fresh optimizer's
    # get_state_dict asks for one: checkpoint tests freeze the unused layer.
    m.inner.unused.requires_grad_(not freeze_unused)
    return m


def _full(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1).double()
                      for p in model.parameters()])  # fmt: skip


def _train(model: nn.Module, rank: int, steps: int = STEPS, start: int = 0, opt: Any = None) -> dict[str, Any]:
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(start, steps):
        opt.zero_grad()
        loss = loss_fn(model, *batch(rank, step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"params": _full(model), "losses": losses}


def _fsdp2(world: int, mesh: Any = None, mp: MixedPrecisionPolicy | None = None, freeze: bool = False) -> nn.Module:
    model = _model(freeze)
    mesh = mesh if mesh is not None else init_device_mesh("cpu", (world,))
    kw = {"mp_policy": mp} if mp else {}
    fully_shard(model.inner.fc1, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _simple(world: int, freeze: bool = False, **kw: Any) -> nn.Module:
    return data_parallel(_model(freeze), init_device_mesh("cpu", (world,)), **kw)


def _bucketed(world: int, freeze: bool = False, **kw: Any) -> nn.Module:
    model = _model(freeze)
    return data_parallel(model, init_device_mesh("cpu", (world,)), buckets=[model.inner.fc1, model], **kw)


def _compressed(rank: int, world: int, name: str, opts: dict[str, Any], qag: bool) -> dict[str, Any]:
    """The same compressor (and QSDP weight gather) on SimpleFSDP buckets and on FSDP2 units of the same
    layout: the same code on the same buffers."""
    from powertrain import fsdp as pfsdp
    from powertrain import simple_fsdp
    from powertrain.compress import make_compressor

    out = {}
    for kind in ("simple", "fsdp2"):
        # compressed FSDP2 needs a gradient for every trainable parameter: freeze the unused layer
        model = _bucketed(world, freeze=True) if kind == "simple" else _fsdp2(world, freeze=True)
        comp = make_compressor(name, model.named_parameters(), **opts)
        (simple_fsdp if kind == "simple" else pfsdp).register_compressor(model, comp)
        if qag:
            (simple_fsdp if kind == "simple" else pfsdp).quantize_all_gather(model)
        out[kind] = _train(model, rank)
    return out


def _hsdp(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return {
        "simple": _train(data_parallel(_model(), mesh, mode="hybrid_shard"), rank),
        "fsdp2": _train(_fsdp2(world, mesh), rank),
        "ddp": _train(DDP(_model(), find_unused_parameters=True), rank),
    }


def _mixed(rank: int, world: int) -> dict[str, Any]:
    simple = _simple(world, mp_policy=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    out = {"simple": _train(simple, rank, steps=4)}
    out["master_dtypes"] = sorted({str(p.dtype) for p in simple.parameters()})
    out["fsdp2"] = _train(_fsdp2(world, mp=MixedPrecisionPolicy(torch.bfloat16, torch.float32)), rank, steps=4)
    out["fp32"] = _train(_simple(world), rank, steps=4)
    return out


def _resume(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    total, save_at = 8, 4
    model = _simple(world, freeze=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, rank, steps=save_at, opt=opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    straight = _train(model, rank, steps=total, start=save_at, opt=opt)["params"]

    def load(m: nn.Module) -> tuple[nn.Module, Any]:
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)
        msd, osd = get_state_dict(m, o)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(m, o, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return m, o

    m, o = load(_simple(world, freeze=True))
    resumed = _train(m, rank, steps=total, start=save_at, opt=o)["params"]
    # The keys are the model's own: FSDP2 loads SimpleFSDP's checkpoint and continues identically.
    m, o = load(_fsdp2(world, freeze=True))
    into_fsdp2 = _train(m, rank, steps=total, start=save_at, opt=o)["params"]
    keys = sorted(_simple(world).state_dict()) == sorted(_model().state_dict())
    return {"straight": straight, "resumed": resumed, "fsdp2": into_fsdp2, "same_keys": keys}


def _held(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Heap bytes allocated by forward and still held for backward."""
    before = heap_in_use()
    loss = model(x, y)
    held = heap_in_use() - before
    loss.backward()
    return held


def _memory(rank: int, world: int, compiled: bool, bucketed: bool = False) -> dict[str, Any]:
    from powertrain.train.model import GPT, GPTConfig

    cfg = GPTConfig(n_layer=2, n_head=2, d_model=128, block_size=16)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)
    out: dict[str, Any] = {}
    for reshard in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg)
        buckets = [*model.blocks, model] if bucketed else []
        data_parallel(model, init_device_mesh("cpu", (world,)), reshard_after_forward=reshard, buckets=buckets)
        run: Any = torch.compile(model, fullgraph=True) if compiled else model
        run(x, y).backward()  # warm-up (compiles)
        model.zero_grad(set_to_none=False)
        out[reshard] = _held(run, x, y)
        out[f"grads/{reshard}"] = torch.cat([p.grad.full_tensor().reshape(-1) for p in model.parameters()])
    torch.manual_seed(0)
    ref = GPT(cfg)
    out["param_bytes"] = sum(p.numel() * 4 for p in ref.parameters())
    out["block_bytes"] = sum(p.numel() * 4 for p in ref.blocks.parameters())
    return out


def _compiled_parity(rank: int, world: int) -> dict[str, Any]:
    from powertrain.train.model import GPT, GPTConfig

    cfg = GPTConfig(n_layer=2, n_head=2, d_model=64, block_size=16)
    res = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = data_parallel(GPT(cfg), init_device_mesh("cpu", (world,)))
        run: Any = torch.compile(model, fullgraph=True) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(100 * rank + step)
            x, y = torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)
            opt.zero_grad()
            loss = run(x, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        res[compiled] = {"losses": losses, "params": _full(model)}
    return res


def _bad(rank: int, world: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (world,))
    attempts = {
        "mode": lambda: data_parallel(_model(), mesh, mode="zero3"),  # type: ignore[arg-type]
        "hybrid_1d": lambda: data_parallel(_model(), mesh, mode="hybrid_shard"),
        "mesh": lambda: data_parallel(_model(), "cpu"),  # type: ignore[arg-type]
        "mp": lambda: data_parallel(_model(), mesh, mp_policy=MixedPrecisionPolicy()),  # type: ignore[arg-type]
        "reshard": lambda: data_parallel(_model(), mesh, reshard_after_forward="yes"),  # type: ignore[arg-type]
        "twice": lambda: data_parallel(data_parallel(_model(), mesh), mesh),
        "dtensor": lambda: data_parallel(_fsdp2(world), mesh),
        "device": lambda: data_parallel(Scaled().to("meta"), mesh),
        "dtype": lambda: MixedPrecision(param_dtype=torch.int8),
        "bucket_mode": lambda: data_parallel(_model(), mesh, mode="replicate", buckets=[Scaled()]),
        "bucket_foreign": lambda: data_parallel(_model(), mesh, buckets=[nn.Linear(2, 2)]),
    }
    return value_errors(attempts)


def simple_cases(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    res: dict[str, Any] = {
        "ddp": guard(_train, DDP(_model(), find_unused_parameters=True), rank),
        "fsdp2": guard(lambda: _train(_fsdp2(world), rank)),
        "simple": guard(lambda: _train(_simple(world), rank)),
        "simple_keep": guard(lambda: _train(_simple(world, reshard_after_forward=False), rank)),
        "replicate": guard(lambda: _train(_simple(world, mode="replicate"), rank)),
        "bucketed": guard(lambda: _train(_bucketed(world), rank)),
        "bucketed_keep": guard(lambda: _train(_bucketed(world, reshard_after_forward=False), rank)),
        "bucketed_frozen": guard(lambda: _train(_bucketed(world, freeze=True), rank)),
        "fsdp2_frozen": guard(lambda: _train(_fsdp2(world, freeze=True), rank)),
        "mixed": guard(_mixed, rank, world),
        "compressed/none": guard(_compressed, rank, world, "none", {}, False),
        "compressed/powersgd": guard(
            _compressed, rank, world, "powersgd", {"rank": 2, "start_compressing_after_num_steps": 2}, False
        ),
        "compressed/int8+qsdp": guard(_compressed, rank, world, "int8", {}, True),
        "compressed/int8": guard(_compressed, rank, world, "int8", {}, False),
        "compressed/qsdp": guard(_compressed, rank, world, "none", {}, True),
        "resume": guard(_resume, rank, world, ckpt),
        "bad": guard(_bad, rank, world),
    }
    if world == 4:
        res["hsdp"] = guard(_hsdp, rank, world)
    dist.barrier()
    return res


@pytest.fixture(scope="module", params=[2, 4], ids=["w2", "w4"])
def results(request, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("simple-fsdp-ckpt"))
    return request.param, run_ranks(simple_cases, request.param, ckpt, timeout=180)


def test_fully_shard_equals_fsdp2(results):
    """Same shards, same AVG reductions: bitwise FSDP2 at 2 ranks (a sum of two terms has one order). At 4,
    gloo's reduce-scatter is a ring all-reduce whose chunking depends on the buffer: FSDP2 reduces one flat
    buffer per fully_shard unit, SimpleFSDP one per parameter, so the summation order (and the last bits)
    differ; measured max |diff| 1.2e-6 after 6 AdamW steps at lr 1e-2. Resharding changes nothing."""
    world, runs = results
    for a, b in zip(case(runs, "simple"), case(runs, "simple_keep"), strict=True):
        assert torch.equal(a["params"], b["params"])
    for a, b in zip(case(runs, "simple"), case(runs, "fsdp2"), strict=True):
        gap = (a["params"] - b["params"]).abs().max().item()
        print(f"world {world}: SimpleFSDP vs FSDP2 max |diff| {gap:.2e}")
        assert gap == 0.0 if world == 2 else gap < 1e-5, gap


def test_eager_buckets_equal_fsdp2(results):
    """Buckets laid out like FSDP2's units (fc1, and the root with the rest): bitwise FSDP2 at 2 ranks, with
    and without resharding. At 4, FSDP2 leaves the parameters that got no gradient (the unused layer) out
    of its reduce-scatter buffer and a bucket sends zeros for them, so the ring's chunking and summation
    order differ: measured 1e-7 after 6 steps."""
    world, runs = results
    # Without parameters that get no gradient, the buffers are identical: bitwise at 4 ranks too.
    for a, b in zip(case(runs, "bucketed_frozen"), case(runs, "fsdp2_frozen"), strict=True):
        assert torch.equal(a["params"], b["params"])
    for name in ("bucketed", "bucketed_keep"):
        for a, b in zip(case(runs, name), case(runs, "fsdp2"), strict=True):
            gap = (a["params"] - b["params"]).abs().max().item()
            print(f"world {world}: {name} vs FSDP2 max |diff| {gap:.2e}")
            assert gap == 0.0 if world == 2 else gap < 1e-5, (name, gap)


@pytest.mark.parametrize("name", ["none", "powersgd", "int8", "qsdp", "int8+qsdp"])
def test_compressed_buckets_equal_compressed_fsdp2_bitwise(results, name):
    """powertrain's compressed reduce-scatter and quantised weight all-gather on SimpleFSDP buckets: bitwise
    the same compressors on FSDP2 (same layout, same code), and training still lowers the loss."""
    for r in case(results[1], f"compressed/{name}"):
        assert torch.equal(r["simple"]["params"], r["fsdp2"]["params"])
        assert r["simple"]["losses"][-1] < r["simple"]["losses"][0]


def test_matches_ddp(results):
    """2 ranks: bitwise DDP (a sum of two terms has one order). 4 ranks: DDP pre-divides and sums in its
    own bucket order, SimpleFSDP averages per parameter, so the last bits differ, and AdamW's per-element
    normalisation enlarges that on near-zero gradients: measured max |diff| 1.1e-5 after 6 steps at lr 1e-2."""
    world, runs = results
    for name in ("simple", "replicate"):
        for a, b in zip(case(runs, name), case(runs, "ddp"), strict=True):
            if world == 2:
                assert torch.equal(a["params"], b["params"]), name
            else:
                assert (a["params"] - b["params"]).abs().max() < 1e-4, name


def test_hybrid_shard_on_2x2_mesh(results):
    world, runs = results
    if world != 4:
        pytest.skip("HSDP needs a 2x2 mesh")
    for r in case(runs, "hsdp"):
        gap = (r["simple"]["params"] - r["fsdp2"]["params"]).abs().max().item()
        print(f"HSDP vs FSDP2 HSDP max |diff| {gap:.2e}")
        # FSDP2 reduce-scatters within the shard group, then all-reduces across replicas; DTensor reduces
        # the two mesh dims in its own order: measured 5.5e-5 after 6 AdamW steps at lr 1e-2.
        assert gap < 1e-4, gap
        assert (r["simple"]["params"] - r["ddp"]["params"]).abs().max() < 1e-4  # as test_matches_ddp


def test_mixed_precision_matches_fsdp2_and_keeps_fp32_master_weights(results):
    """bf16 compute, fp32 reduction: bitwise FSDP2's MixedPrecisionPolicy at 2 ranks; at 4 the reduction
    order differs (see test_fully_shard_equals_fsdp2)."""
    world, runs = results
    for r in case(runs, "mixed"):
        assert r["master_dtypes"] == ["torch.float32"]
        gap = (r["simple"]["params"] - r["fsdp2"]["params"]).abs().max().item()
        print(f"world {world}: mixed precision vs FSDP2 max |diff| {gap:.2e}")
        assert gap == 0.0 if world == 2 else gap < 1e-4, gap
        # and bf16 compute is really on: different from the fp32 run
        assert not torch.equal(r["simple"]["params"], r["fp32"]["params"])


def test_dcp_resume_is_bitwise_and_loads_into_fsdp2(results):
    """Save at step 4, load into a fresh SimpleFSDP model: bitwise the uninterrupted run. FSDP2 loads the
    same checkpoint (same keys) and continues identically up to its reduction order (4 ranks)."""
    world, runs = results
    for r in case(runs, "resume"):
        assert r["same_keys"]
        assert torch.equal(r["resumed"], r["straight"])
        gap = (r["fsdp2"] - r["straight"]).abs().max().item()
        assert gap == 0.0 if world == 2 else gap < 1e-5, gap


def test_bad_input_refused_with_clear_errors(results):
    expected = {
        "mode": "Invalid mode='zero3'",
        "hybrid_1d": "needs a 2-D mesh",
        "mesh": "pass a DeviceMesh",
        "mp": "powertrain.simple_fsdp.MixedPrecision",
        "reshard": "reshard_after_forward='yes'",
        "twice": "already applied",
        "dtensor": "already a DTensor",
        "device": "move the model to the mesh's device",
        "dtype": "param_dtype=torch.int8",
        "bucket_mode": "buckets need mode='fully_shard'",
        "bucket_foreign": "buckets must be submodules of the model",
    }
    for r in case(results[1], "bad"):
        for name, text in expected.items():
            assert text in r[name], (name, r[name])


@pytest.mark.skipif(not heap_available(), reason="needs glibc mallinfo2")
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("compiled", "bucketed"), [(False, False), (False, True), (True, False)],
                         ids=["eager", "eager-bucketed", "compiled"])  # fmt: skip
def test_reshard_after_forward_frees_gathered_parameters(compiled, bucketed):
    """Memory held between forward and backward drops by about the gathered weights of the resharded blocks
    (the root bucket keeps its own, as in FSDP2); gradients unchanged."""
    runs = run_ranks(_memory, 2, compiled, bucketed, timeout=240)
    for r in runs:
        saved = r[False] - r[True]
        print(f"reshard saves {saved / 1e6:.3f} MB; weights {r['param_bytes'] / 1e6:.3f} MB")
        assert saved > 0.7 * (r["block_bytes"] if bucketed else r["param_bytes"]), (r[False], r[True])
        assert torch.equal(r["grads/False"], r["grads/True"])


@pytest.mark.timeout(300)
def test_torch_compile_fullgraph_matches_eager():
    """Compiled (inductor, fullgraph) vs eager: inductor fuses and reorders float math, so the last bits
    differ: measured <= 2e-6 in the losses over 3 AdamW steps."""
    for r in run_ranks(_compiled_parity, 2, timeout=240):
        for a, b in zip(r[True]["losses"], r[False]["losses"], strict=True):
            assert abs(a - b) < 1e-4, (a, b)
        assert (r[True]["params"] - r[False]["params"]).abs().max() < 1e-4
