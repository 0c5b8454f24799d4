"""2-D tensor x data parallelism (powertrain.tp) on real gloo ranks: a (dp, tp) mesh of 2x2, gradients and
AdamW steps against a single-process run, the traffic it computes against what DTensor sends, and refused input.

Tolerances (float64; u = 2**-53). Tensor parallelism computes the same sums in another order: a row-parallel Linear
adds tp partial products (a reduce-scatter) instead of one dot product, the column-parallel inputs' gradients
likewise, sequence parallelism sums the LayerNorm gains' gradients over the sequence shards, and FSDP2 averages the
two data-parallel groups' gradients by a reduce-scatter where the reference averages two losses. Any order of an
n-term sum is within n u of the sum of the terms' magnitudes; the longest sum here is the weight gradients' over 2 x
3 x 16 = 96 tokens, ~1.1e-14 relative per op, over a chain of ~30 ops. Errors scale with the summands, not with the
result (the key projection's bias has an exactly zero gradient, since it shifts every score of a query alike, and
gets rounding noise of the other terms' size), so the bound is REL = 1e-10 of the largest gradient entry of the
model: ~10^4 x the one-op figure for the chain. A wrong head split or a missing reduction moves a gradient by O(1)
of its size. Measured: <= 3e-16 relative.

AdamW (lr 1e-3, eps 1e-8) after k steps: parameters within 2 k lr Delta / eps with Delta = REL x the largest
gradient entry (see test_rtp).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._python_dispatch import TorchDispatchMode

from dist_utils import case, guard, run_ranks, value_errors, within
from models import PARITY_GPT, parity_gpt, token_batch
from powertrain.models import GPT, GPTConfig
from powertrain.tp import tensor_parallel, traffic

REL = 1e-10
STEPS, LR, ADAM_EPS = 3, 1e-3, 1e-8
UNEVEN = GPTConfig(65, 15, 1, 2, 32)  # vocabulary and positions that do not divide by tp = 2


def _reference_grad(ref: dict[str, torch.Tensor], name: str, shape: torch.Size) -> torch.Tensor:
    """The single-process gradient of a TP parameter: ``qkv.q/k/v`` are row blocks of the fused ``qkv``."""
    if ".qkv." not in name:
        return ref[name]
    block, which = name.split(".qkv.")
    part, kind = which.split(".")
    i = "qkv".index(part)
    return ref[f"{block}.qkv.{kind}"][i * shape[0] : (i + 1) * shape[0]]


_FUNCOL = torch.ops._c10d_functional
_OPS = {
    _FUNCOL.all_gather_into_tensor.default: "all_gather",
    _FUNCOL.reduce_scatter_tensor.default: "reduce_scatter",
    _FUNCOL.all_reduce.default: "all_reduce",
}


class _Sent(TorchDispatchMode):
    """Payload bytes and count of the functional collectives DTensor issues (FSDP2's own are not among them)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[str, tuple[int, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in _OPS:
            nbytes, n = self.sent.get(_OPS[func], (0, 0))
            self.sent[_OPS[func]] = (nbytes + args[0].numel() * args[0].element_size(), n + 1)
        return func(*args, **(kwargs or {}))


def _parity(rank: int, world: int, dp: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    me = mesh["dp"].get_local_rank()
    ref = parity_gpt()
    model = tensor_parallel(copy.deepcopy(ref), mesh)
    opts = [torch.optim.AdamW(m.parameters(), lr=LR, eps=ADAM_EPS) for m in (model, ref)]
    grads, gmax = {}, 0.0
    real_rs, fsdp_rs = dist.reduce_scatter_single, [0, 0]

    def counted(*args: Any, **kwargs: Any) -> Any:  # FSDP2's gradient reduce-scatter, as handed to it
        fsdp_rs[0] += kwargs["input"].numel() * kwargs["input"].element_size()
        fsdp_rs[1] += 1
        return real_rs(*args, **kwargs)

    for step in range(STEPS):
        with _Sent() as sent:
            dist.reduce_scatter_single = counted if step == 0 else real_rs  # type: ignore[assignment]
            model(*token_batch(me, step)).backward()
        (sum(ref(*token_batch(r, step)) for r in range(dp)) / dp).backward()
        refg = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
        gmax = max(gmax, max(g.abs().max().item() for g in refg.values()))
        if step == 0:
            for n, p in model.named_parameters():
                full = p.grad.full_tensor()
                grads[n] = (full, _reference_grad(refg, n, full.shape).clone())
        for o in opts:
            o.step()
            o.zero_grad()
    logits = model(token_batch(me, 0)[0]).detach()
    params = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    refp = dict(ref.named_parameters())
    expect = {n: _reference_grad({k: v.detach() for k, v in refp.items()}, n, params[n].shape) for n in params}
    dist.reduce_scatter_single = real_rs  # type: ignore[assignment]
    return {
        "sent": sent.sent,
        "fsdp_rs": fsdp_rs,
        "grads": grads,
        "gmax": gmax,
        "params": params,
        "expect": expect,
        "logits": (logits, ref(token_batch(me, 0)[0]).detach()),
    }


def _loss_parallel(rank: int, world: int) -> dict[str, Any]:
    """One step with the logits left vocabulary-sharded on the 2x2 mesh: loss, gradients and logits against the
    single process, and the traffic: DTensor's own collectives (the dispatch counter) and the loss's all-reduces,
    which torch's loss_parallel issues inside DTensor's dispatch where that counter cannot see them (counted at
    funcol.all_reduce, which every DTensor all-reduce goes through)."""
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    me = mesh["dp"].get_local_rank()
    ref = parity_gpt()
    model = tensor_parallel(copy.deepcopy(ref), mesh, loss_parallel=True)
    real, reduced = funcol.all_reduce, [0, 0]

    def counted(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        reduced[0] += t.numel() * t.element_size()
        reduced[1] += 1
        return real(t, *args, **kwargs)

    funcol.all_reduce = counted  # type: ignore[assignment]
    try:
        with _Sent() as sent, loss_parallel():
            loss = model(*token_batch(me, 0))
            loss.backward()
    finally:
        funcol.all_reduce = real  # type: ignore[assignment]
    ref_loss = sum(ref(*token_batch(r, 0)) for r in range(world // 2)) / (world // 2)
    ref_loss.backward()
    refg = {n: p.grad for n, p in ref.named_parameters()}
    grads = {n: (p.grad.full_tensor(), _reference_grad(refg, n, p.shape)) for n, p in model.named_parameters()}
    logits = model(token_batch(me, 0)[0])
    seen = {k: v for k, v in sent.sent.items() if k != "all_reduce"}
    return {
        "loss": (loss.item(), ref(*token_batch(me, 0)).item()),
        "grads": grads,
        "logits": (type(logits).__name__, logits.full_tensor().detach(), ref(token_batch(me, 0)[0]).detach()),
        "sent": {**seen, "all_reduce": tuple(reduced)},
    }


def _compressed(rank: int, world: int) -> dict[str, Any]:
    """FSDP2's gradient reduce-scatter over dp through a compressor built on the tp-local blocks
    (powertrain.fsdp.compress_gradients): AdamW steps of the plain 2-D model, the exact compressor and rank-2
    PowerSGD, from the same start on the same batches; and a compressor on the wrong group."""
    from powertrain.fsdp import compress_gradients

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    me, dp = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    ref = parity_gpt().float()  # the exact compressor averages in float32, as FSDP2 then does itself
    out: dict[str, Any] = {}
    for kind, options in (
        ("plain", None),
        ("none", {}),
        ("powersgd", {"rank": 2, "start_compressing_after_num_steps": 1}),
    ):
        model = tensor_parallel(copy.deepcopy(ref), mesh)
        comp = None if options is None else compress_gradients(model, kind, group=dp, **options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(8):  # one batch again and again: a loss that must fall
            loss = model(*token_batch(me, 0))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        params = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
        built = {} if comp is None else {n: tuple(p.shape) for n, p in zip(comp.names, comp.params, strict=True)}
        out[kind] = {
            "losses": losses,
            "params": params,
            "shapes": built,
            "bytes": None if comp is None else comp.comm.stats.bytes_sent,
            "local": {n: tuple(p.to_local().shape) for n, p in model.named_parameters()},
        }
    model = tensor_parallel(copy.deepcopy(ref), mesh)
    compress_gradients(model, "none")  # the world: 4 ranks, where FSDP2 reduce-scatters over dp's 2
    try:
        model(*token_batch(me, 0)).backward()
        out["wrong_group"] = ""
    except RuntimeError as e:
        out["wrong_group"] = str(e)
    return out


def _refusals(rank: int, world: int) -> dict[str, str]:
    def pairs() -> DeviceMesh:
        return init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))

    return value_errors(
        {
            "heads": lambda: tensor_parallel(GPT(GPTConfig(64, 16, 1, 1, 32)), pairs()),
            "mesh": lambda: tensor_parallel(parity_gpt(), init_device_mesh("cpu", (world,))),
            "model": lambda: tensor_parallel(nn.Linear(4, 4), pairs()),  # type: ignore[arg-type]
            "loss_parallel": lambda: tensor_parallel(parity_gpt(), pairs(), loss_parallel=1),  # type: ignore[arg-type]
        }
    )


def _uneven(rank: int, world: int) -> dict[str, Any]:
    """A vocabulary, positions and a sequence that do not divide by tp: loss, gradients and traffic of one batch."""
    torch.manual_seed(0)
    ref = GPT(UNEVEN).double()
    model = tensor_parallel(copy.deepcopy(ref), init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp")))
    g = torch.Generator().manual_seed(5)
    x, y = (torch.randint(0, 65, (2, 13), generator=g) for _ in range(2))
    with _Sent() as sent:
        loss = model(x, y)
        loss.backward()
    ref_loss = ref(x, y)
    ref_loss.backward()
    refg = {n: p.grad for n, p in ref.named_parameters()}
    grads = {n: (p.grad.full_tensor(), _reference_grad(refg, n, p.shape)) for n, p in model.named_parameters()}
    return {"loss": (loss.item(), ref_loss.item()), "grads": grads, "sent": sent.sent}


def tp_cases(rank: int, world: int) -> dict[str, Any]:
    res = {
        "2d": guard(_parity, rank, world, world // 2),
        "refusals": guard(_refusals, rank, world),
        "uneven": guard(_uneven, rank, world),
        "loss_parallel": guard(_loss_parallel, rank, world),
        "compressed": guard(_compressed, rank, world),
    }
    dist.barrier()
    return res


@pytest.fixture(scope="module")
def results():
    # 2x2: tensor parallelism and FSDP2 together (a 1x2 mesh is TP alone; the command's tp test runs one)
    return 4, run_ranks(tp_cases, 4, timeout=240)


def test_gradients_logits_and_adamw_steps_equal_single_process(results):
    world, runs = results
    for rank, run in enumerate(case(runs, "2d")):
        scale = max(r.abs().max().item() for _, r in run["grads"].values())
        for name, (got, ref) in run["grads"].items():
            within((got - ref).abs(), REL * scale, f"{world} ranks, rank {rank}: gradient of {name}")
        got, ref = run["logits"]
        within((got - ref).abs(), REL * ref.abs().max(), f"{world} ranks, rank {rank}: logits after {STEPS} steps")
        bound = 2 * STEPS * LR * REL * run["gmax"] / ADAM_EPS
        for name, p in run["params"].items():
            within((p - run["expect"][name]).abs(), bound, f"{world} ranks, rank {rank}: {name} after {STEPS} steps")


def test_compressed_gradients_on_the_tensor_parallel_blocks(results):
    """The exact compressor hands FSDP2's own reduce-scatter through unchanged: bitwise the plain 2-D run. Rank-2
    PowerSGD (built on each rank's tp-local blocks, which is what FSDP2 reduces: the compressor's shapes are the
    unsharded local ones) sends less and trains: 8 steps on one batch make at least half the exact run's progress
    (measured here: 72%; a compressor averaging the wrong blocks or ranks makes none)."""
    _, runs = results
    for run in case(runs, "compressed"):
        plain, exact, psgd = run["plain"], run["none"], run["powersgd"]
        assert torch.equal(plain["params"], exact["params"]) and plain["losses"] == exact["losses"]
        assert psgd["bytes"] < exact["bytes"], (psgd["bytes"], exact["bytes"])
        first = plain["losses"][0]
        assert first - psgd["losses"][-1] > 0.5 * (first - plain["losses"][-1]), (psgd["losses"], plain["losses"])
        # FSDP2 shards over dp = 2 the tp-local block the compressor is built on
        assert {n: (2 * s[0], *s[1:]) for n, s in psgd["local"].items()} == psgd["shapes"], psgd
        assert "reduce-scatters over 2 ranks but the compressor averages over 4" in run["wrong_group"], run


def test_refusals_name_the_value_and_the_fix(results):
    _, runs = results
    for out in case(runs, "refusals"):
        assert "n_head=1 does not divide by tp=2" in out["heads"], out
        assert "mesh_dim_names=('dp', 'tp')" in out["mesh"], out
        assert "powertrain's GPT" in out["model"], out
        assert "loss_parallel=1" in out["loss_parallel"], out


def test_computed_traffic_is_what_dtensor_sends(results):
    """powertrain.tp.traffic (the command's byte count) against the tensor-parallel collectives DTensor issued in a
    step, by collective: bytes and count. FSDP2's part (dp = 2 here) is not seen by the counter: tp only."""
    _, runs = results
    for run in case(runs, "2d"):
        expect = traffic(PARITY_GPT, 2, 1, *token_batch(0, 0)[0].shape, itemsize=8)  # the parity model is float64
        assert run["sent"] == expect, run["sent"]
        # FSDP2 over dp = 2: each unit's gradients (the blocks and the root) reduce-scattered once
        both = traffic(PARITY_GPT, 2, 2, *token_batch(0, 0)[0].shape, itemsize=8)["reduce_scatter"]
        assert tuple(run["fsdp_rs"]) == (both[0] - expect["reduce_scatter"][0], both[1] - expect["reduce_scatter"][1])


def test_shards_need_not_be_even(results):
    # one sum of 2 x 13 token losses, and the gradients, in another order: within REL as above; DTensor pads the
    # uneven shards, and the computed traffic counts the padding
    _, runs = results
    for run in case(runs, "uneven"):
        got, ref = run["loss"]
        assert abs(got - ref) <= REL * abs(ref), (got, ref)
        scale = max(r.abs().max().item() for _, r in run["grads"].values())
        for name, (g, r) in run["grads"].items():
            within((g - r).abs(), REL * scale, f"uneven shards: gradient of {name}")
        assert run["sent"] == traffic(UNEVEN, 2, 1, 2, 13, itemsize=8), run["sent"]


def test_loss_parallel_keeps_logits_sharded_and_equals_single_process(results):
    """The loss is float32 (the model's cross-entropy) in both runs, but loss_parallel sums a token's exponentials
    in tp partial sums and its mean over tokens as one: the log-sum-exp moves by at most gamma_V ~ V u32 (V = 64,
    u32 = 2**-24: 3.8e-6), so each logit's gradient (softmax - one-hot) / N moves by ~4e-6 relative, and the
    float64 backward carries that linearly into every gradient; the loss moves by (V + N) u32 ~ 7e-6 relative
    (N = 48 tokens). REL32 = 1e-4 of the largest entry leaves 25x for the backward's chain. A missing shard or a
    sum over the wrong group moves them by >= 1/2. The logits themselves are float64 and gathered, not reduced:
    REL as everywhere."""
    _, runs = results
    rel32 = 1e-4
    for run in case(runs, "loss_parallel"):
        got, ref = run["loss"]
        assert abs(got - ref) <= rel32 * abs(ref), (got, ref)
        scale = max(r.abs().max().item() for _, r in run["grads"].values())
        for name, (g, r) in run["grads"].items():
            within((g - r).abs(), rel32 * scale, f"loss parallel: gradient of {name}")
        kind, logits, ref_logits = run["logits"]
        assert kind == "DTensor"
        within((logits - ref_logits).abs(), REL * ref_logits.abs().max(), "loss parallel: logits")
        assert run["sent"] == traffic(PARITY_GPT, 2, 1, *token_batch(0, 0)[0].shape, itemsize=8, loss_parallel=True)
        # no tokens x vocabulary all-gather: the plain plan's traffic less exactly the logits
        plain = traffic(PARITY_GPT, 2, 1, *token_batch(0, 0)[0].shape, itemsize=8)["all_gather"]
        b, t = token_batch(0, 0)[0].shape
        assert run["sent"]["all_gather"] == (plain[0] - 8 * b * t * PARITY_GPT.vocab_size // 2, plain[1] - 1)
