"""Compressor math at world size 1: error feedback conserves, codecs round-trip, bad options are refused."""

from __future__ import annotations

import io
import math
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dist_utils import EPS32, feedback_bound, within
from powertrain.comm import Communicator
from powertrain.compress import COMPRESSORS, NonFiniteGradientError, make_compressor
from powertrain.compress.base import GatherRequest, Program, ReduceRequest, guard_nonfinite, run_program
from powertrain.ops.flat import pack
from powertrain.ops.quantize import (
    dequantize,
    pack_2bit,
    pack_bits,
    pack_int4,
    quantize,
    unpack_2bit,
    unpack_bits,
    unpack_int4,
)

EF = [
    ("int8", {}),
    ("int4", {"chunk": 16}),
    ("topk", {"ratio": 0.05}),
    ("topk", {"ratio": 0.05, "bits": 2}),
    ("randk", {"ratio": 0.05}),
    ("sign", {"chunk": 64}),
]


def _params(device: torch.device | str = "cpu") -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(37, 29).to(device)),
        torch.nn.Parameter(torch.randn(11).to(device)),
        torch.nn.Parameter(torch.randn(3, 4, 5).to(device)),
    ]


def _grads(params: list[torch.nn.Parameter], step: int) -> list[torch.Tensor]:
    """Gradients of step ``step``, the same numbers on every device (drawn on the CPU)."""
    return [
        torch.randn(p.shape, generator=torch.Generator().manual_seed(step * 10 + i)).to(p.device)
        for i, p in enumerate(params)
    ]


@pytest.mark.device
@pytest.mark.parametrize(("name", "opts"), EF, ids=[n + "-2bit" * (o.get("bits") == 2) for n, o in EF])
def test_error_feedback_conserves_every_step(name, opts, device):
    params = _params(device)
    comp = make_compressor(name, params, **opts)
    total_in = [torch.zeros_like(p) for p in params]
    total_out = [torch.zeros_like(p) for p in params]
    budget = [torch.zeros_like(p) for p in params]  # the bound on the totals' rounding, step by step
    for step in range(5):
        g = _grads(params, step)
        before = [e.clone() for e in comp.residuals()]
        out = comp.aggregate(g)
        for x, e0, o, e1, ti, to, b in zip(g, before, out, comp.residuals(), total_in, total_out, budget, strict=True):
            # x + e0 here is the compressor's own sum (the same float32 addition): derivation in feedback_bound
            bound = feedback_bound((x + e0)[None], e1[None], eps=EPS32)
            within((o + e1 - (x + e0)).abs(), bound, f"step {step}")
            ti.add_(x)
            to.add_(o)
            # the totals telescope: this step's conservation error, the rounding of x + e0 and of the two
            # running sums (u each on |x + e0|, |ti|, |to|; 2x safety: eps)
            b.add_(bound + EPS32 * ((x + e0).abs() + ti.abs() + to.abs()))
    # over all steps: everything that went in came out, or is still owed (+ the final sum's rounding)
    for ti, to, e, b in zip(total_in, total_out, comp.residuals(), budget, strict=True):
        within((to + e - ti).abs(), b + EPS32 * ti.abs(), "totals")


@pytest.mark.device
def test_exact_compressors(device):
    params = _params(device)
    g = [torch.randn_like(p) for p in params]
    assert all(torch.equal(a, b) for a, b in zip(make_compressor("none", params).aggregate(g), g, strict=True))
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        out = make_compressor(name, params).aggregate(g)
        for o, x in zip(out, g, strict=True):
            assert o.dtype == x.dtype
            # rounded once, nothing else (dividing by W = 1 is exact): a cast is correctly rounded (to nearest,
            # ties to even) by every kernel, so this is bitwise on any CPU and on CUDA
            assert torch.equal(o, x.to(dtype).to(x.dtype))


def test_quantize_roundtrip_and_unbiased_rounding():
    x = torch.randn(1000) * 3
    for bits in (8, 4):
        codes, scales = quantize(x, bits, 64)
        qmax = 2 ** (bits - 1) - 1
        assert codes.abs().max() <= qmax
        err = (dequantize(codes, scales, 64) - x).abs().view(-1)
        step = scales.repeat_interleave(64)[: x.numel()]
        # nearest: half a step, plus the roundings of x / s and of code * s (u |x| each, u s / 2); 2x safety on those
        within(err, step / 2 + EPS32 * (step / 2 + 2 * x.abs()), f"{bits}-bit nearest")
    gen = torch.Generator().manual_seed(0)
    draws_n = 2000
    _, scales = quantize(x, 4, 64)
    step = scales.repeat_interleave(64)[: x.numel()]
    draws = [dequantize(*quantize(x, 4, 64, torch.rand(x.numel(), generator=gen)), 64) for _ in range(draws_n)]
    mean = torch.stack(draws).mean(0)
    # Stochastic rounding is unbiased: each draw lies within one step s of x and averages to x (up to the 2^-24 grid
    # of torch.rand), so by Hoeffding the mean of N draws is off by more than s sqrt(ln(2 n / delta) / (2 N)) in
    # any of the n values with probability < delta = 1e-9; plus the N-term float32 mean (N u (|x| + s)), 2x safety.
    hoeffding = math.sqrt(math.log(2 * x.numel() / 1e-9) / (2 * draws_n))
    within((mean - x).abs(), step * (hoeffding + 2**-24) + draws_n * EPS32 * (x.abs() + step), "stochastic mean")


@pytest.mark.device
def test_bit_packing_roundtrips(device):
    codes = torch.randint(-7, 8, (101,), dtype=torch.int8).to(device)
    packed = pack_int4(codes)
    assert packed.numel() == 51 and torch.equal(unpack_int4(packed, 101), codes)
    bits = (torch.rand(77) > 0.5).to(device)
    assert pack_bits(bits).numel() == 10 and torch.equal(unpack_bits(pack_bits(bits), 77), bits)
    two = torch.randint(0, 4, (103,), dtype=torch.uint8).to(device)
    assert pack_2bit(two).numel() == 26 and torch.equal(unpack_2bit(pack_2bit(two), 103), two)


def test_sparseloco_outer_step_two_bit_values_and_a_decayed_accumulator():
    """top-k with 2-bit values: every value sent is one of (-1, -1/3, 1/3, 1) x its parameter's largest chosen
    magnitude; with error_decay 0.5 (a power of two: beta e is exact) what a call takes in is g + 0.5 e, and it all
    comes out or stays owed (the same derivation as classic error feedback, on that input)."""
    params = _params()
    comp = make_compressor("topk", params, ratio=0.1, bits=2, error_decay=0.5)
    for step in range(4):
        g = _grads(params, step)
        before = [e.clone() for e in comp.residuals()]
        out = comp.aggregate(g)
        for x, e0, o, e1 in zip(g, before, out, comp.residuals(), strict=True):
            taken = x + 0.5 * e0
            within((o + e1 - taken).abs(), feedback_bound(taken[None], e1[None], eps=EPS32), f"step {step}")
            sent = o[o != 0].abs()
            scale = sent.max()
            levels = torch.stack([scale, scale / 3])
            assert torch.isclose(sent[:, None], levels[None], rtol=1e-6).any(dim=1).all(), (step, sent.unique())
    with pytest.raises(ValueError, match="Invalid bits=4"):
        make_compressor("topk", params, bits=4)
    with pytest.raises(ValueError, match="Invalid error_decay=0"):
        make_compressor("topk", params, error_decay=0)


def test_loco_moving_average_low_precision_and_reset():
    params = _params()[:1]
    comp = make_compressor("int8", params, loco_beta=0.5, loco_reset_every=3, stochastic=False)
    assert comp.residuals()[0].dtype == torch.bfloat16
    g = [torch.randn_like(params[0])]
    comp.aggregate(g)
    codes, scales = quantize(g[0].view(-1), 8, comp.chunk)  # one parameter: chunks as in the compressor
    expected = 0.5 * (g[0].view(-1) - dequantize(codes, scales, comp.chunk))  # the compressor's float32 operations
    # stored in bf16: one rounding to nearest, |error| <= u_bf16 |value| = eps_bf16 / 2 |value|, nothing else
    err = (comp.residuals()[0].float().view(-1) - expected).abs()
    within(err, torch.finfo(torch.bfloat16).eps / 2 * expected.abs(), "bf16 residual")
    comp.aggregate(g)
    assert comp.residuals()[0].abs().sum() > 0
    comp.aggregate(g)  # third step: reset
    assert comp.residuals()[0].abs().sum() == 0


@pytest.mark.device
@pytest.mark.parametrize(("name", "opts"), EF, ids=[n for n, _ in EF])
def test_nonfinite_leaves_state_untouched_and_state_roundtrips(name, opts, device):
    params = _params(device)
    comp = make_compressor(name, params, **opts)
    comp.aggregate(_grads(params, 0))
    buf = io.BytesIO()
    torch.save(comp.state_dict(), buf)
    bad = _grads(params, 1)
    bad[0][3, 3] = float("inf")
    with pytest.raises(NonFiniteGradientError, match=r"param\[0\]"):
        comp.aggregate(bad)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True, map_location="cpu")  # written on the device, read on the CPU
    after = comp.state_dict()
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(saved["errors"], after["errors"], strict=True))
    assert saved["steps"] == after["steps"] and saved["seed"] == after["seed"]
    fresh = make_compressor(name, params, **opts)
    fresh.load_state_dict(saved)  # back onto the device
    g = _grads(params, 2)
    assert all(torch.equal(a, b) for a, b in zip(fresh.aggregate(g), comp.aggregate(g), strict=True))


@pytest.mark.parametrize(
    ("name", "saved_with", "loaded_with", "message"),
    [
        ("int4", {}, {"chunk": 256}, "saved with chunk=1024, this compressor has chunk=256"),
        (
            "int4",
            {"loco_beta": 0.5},
            {},
            "saved with loco_beta=0.5, error_dtype='bfloat16', this compressor has loco_beta=0.0, "
            "error_dtype='float32'",
        ),
        ("int8", {"stochastic": False}, {}, "saved with stochastic=False, this compressor has stochastic=True"),
        ("topk", {"ratio": 0.01}, {"ratio": 0.5}, "saved with ratio=0.01, this compressor has ratio=0.5"),
        ("randk", {"ratio": 0.01}, {"ratio": 0.02}, "saved with ratio=0.01, this compressor has ratio=0.02"),
        ("sign", {}, {"chunk": 64}, "saved with chunk=4096, this compressor has chunk=64"),
    ],
)
def test_a_state_saved_with_other_settings_is_refused(name, saved_with, loaded_with, message):
    """An error-feedback state is its compressor's: loaded into one built with other settings (DiLoCo's outer step
    built as int8 from an int4 run's checkpoint), its buffers would be owed in another code. One line names the
    setting; a state written before the settings were saved (no "settings") still loads."""
    params = _params(torch.device("cpu"))
    comp = make_compressor(name, params, **saved_with)
    comp.aggregate(_grads(params, 0))
    state = comp.state_dict()
    with pytest.raises(ValueError, match=re.escape(message)):
        make_compressor(name, params, **loaded_with).load_state_dict(state)
    older = {k: v for k, v in state.items() if k != "settings"}
    fresh = make_compressor(name, params, **saved_with)
    fresh.load_state_dict(older)
    g = _grads(params, 1)
    assert all(torch.equal(a, b) for a, b in zip(fresh.aggregate(g), comp.aggregate(g), strict=True))


@pytest.mark.parametrize(
    ("name", "opts", "message"),
    [
        ("int8", {"chunk": 4}, "chunk=4"),
        ("int4", {"loco_beta": 1.0}, "loco_beta=1.0"),
        ("topk", {"ratio": 0}, "ratio=0"),
        ("randk", {"ratio": 1.5}, "ratio=1.5"),
        ("sign", {"chunk": 0}, "chunk=0"),
        ("topk", {"rank": 2}, "Bad option for compressor 'topk'"),
        ("powersgd", {"rank": 0}, "Config.rank=0"),
        ("zip", {}, "Unknown compressor 'zip'"),
    ],
)
def test_bad_options_are_value_errors(name, opts, message):
    with pytest.raises(ValueError, match=message):
        make_compressor(name, _params(), **opts)


@pytest.mark.device
def test_every_listed_compressor_builds_and_averages_one_rank(device):
    """Every name in COMPRESSORS builds and averages over one rank: an empty call gives nothing; one output per
    parameter, of its shape, dtype and device; zeros stay zeros (there is nothing to send and no error to feed
    back); a random gradient gives finite values, unchanged by the exact one."""
    params = _params(device)
    for name in COMPRESSORS:
        opts = {"rank": 2, "start_compressing_after_num_steps": 0} if name == "powersgd" else {}
        assert make_compressor(name, params, **opts).aggregate([], []) == [], f"{name}: an empty call"  # (top-k raised)
        zeros = make_compressor(name, params, **opts).aggregate([torch.zeros_like(p) for p in params])
        assert [(z.shape, z.dtype, z.device) for z in zeros] == [(p.shape, p.dtype, p.device) for p in params], name
        assert all(not z.any() for z in zeros), name
        comp = make_compressor(name, params, **opts)
        g = _grads(params, 0)
        first = [o.clone() for o in comp.aggregate([t.clone() for t in g])]
        assert all(o.isfinite().all() for o in first), name
        if name in ("none", "fp32"):
            assert all(torch.equal(o, t) for o, t in zip(first, g, strict=True)), name


@pytest.mark.parametrize(("name", "opts"), EF, ids=[n for n, _ in EF])
def test_results_do_not_depend_on_grouping(name, opts):
    """DDP buckets group parameters differently before and after its rebuild (and on resume): per-parameter
    chunks, selections and random streams make every grouping give the same bits."""
    # Bitwise: every operation is elementwise, or a per-chunk reduction (exact max; sign's sum) over the same
    # chunk of the same parameter, so grouping changes no operation, on any CPU.
    params = _params()
    whole, split = make_compressor(name, params, **opts), make_compressor(name, params, **opts)
    for step in range(3):
        g = [torch.randn(p.shape, generator=torch.Generator().manual_seed(step * 10 + i)) for i, p in enumerate(params)]
        a = whole.aggregate(g)
        b = split.aggregate([g[2], g[0]], [2, 0]) + split.aggregate([g[1]], [1])
        for x, y in zip(a, [b[1], b[2], b[0]], strict=True):
            assert torch.equal(x, y)
        assert all(torch.equal(x, y) for x, y in zip(whole.residuals(), split.residuals(), strict=True))


def test_the_registry_names_each_compressors_class_and_its_reduce_scatter_form():
    """compressor_class is what make_compressor builds, and its reduce_scatter flag is what FSDP2 accepts: the
    command's refusals (train/config) and FSDP2's own (fsdp.check_supported) read the same flag."""
    from powertrain.compress import COMPRESSORS, compressor_class, make_compressor
    from powertrain.fsdp import check_supported

    params = [torch.nn.Parameter(torch.zeros(4, 4))]
    sharded = set()
    for name in COMPRESSORS:
        comp = make_compressor(name, params)
        assert type(comp) is compressor_class(name), name
        try:
            check_supported(comp, "FSDP2")
            sharded.add(name)
        except ValueError as e:
            assert "no reduce-scatter form" in str(e)
    assert sharded == {n for n in COMPRESSORS if compressor_class(n).reduce_scatter}
    assert sharded >= {"none", "powersgd", "int8"} and "topk" not in sharded  # the layouts test_fsdp trains
    with pytest.raises(ValueError, match="Unknown compressor 'zstd'"):
        compressor_class("zstd")


class _HostReads(TorchDispatchMode):
    """Counts the reads of a tensor's value by the host (``bool(t)``, ``t.item()``: a synchronisation on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.n += func.overloadpacket is torch.ops.aten._local_scalar_dense
        return func(*args, **(kwargs or {}))


def test_powersgd_reads_one_finiteness_flag_a_call():
    """PowerSGD's exact part, P and Q are three collectives (bf16 factors: the exact part is not fused), and the host
    reads whether to raise once, at the last (guard_nonfinite): the other two results' flags stay on the device and
    travel in the next message. It read one per collective (3) before."""
    params = [
        torch.nn.Parameter(torch.randn(64, 48)),
        torch.nn.Parameter(torch.randn(48, 32)),
        torch.nn.Parameter(torch.randn(7)),
    ]
    comp = make_compressor("powersgd", params, rank=2, start_compressing_after_num_steps=0)
    comp.aggregate(_grads(params, 0))
    with _HostReads() as reads:
        comp.aggregate(_grads(params, 1))
    assert reads.n == 1


def test_a_deferred_check_raises_at_the_next_collective_before_the_commit():
    """A result not read on the host (check=False) that came back non-finite poisons the next message (its own
    input was finite), so the next, checked, collective raises, before the program commits; a program whose last
    collective is not checked is a bug, said as such."""
    committed: list[bool] = []

    def program(last_checked: bool) -> Program:
        yield ReduceRequest(torch.tensor([1.0, float("inf")]), "sum", check=False)
        yield ReduceRequest(torch.ones(3), "sum", check=last_checked)
        committed.append(True)
        return []

    def error() -> NonFiniteGradientError:
        return NonFiniteGradientError("not finite")

    comm = Communicator()
    with pytest.raises(NonFiniteGradientError, match="not finite"):
        run_program(guard_nonfinite(program(True), local_ok=True, error=error), comm)
    assert not committed
    with pytest.raises(AssertionError, match="last collective must be checked"):
        run_program(guard_nonfinite(program(False), local_ok=True, error=error), comm)

    def empty_after_unchecked() -> Program:  # the flag of the first result would have nowhere to go
        yield ReduceRequest(torch.ones(2), "sum", check=False)
        yield ReduceRequest(torch.ones(0), "sum")
        committed.append(True)
        return []

    committed.clear()  # the unchecked last collective's program did commit (the bug it reports)
    with pytest.raises(AssertionError, match="must not be empty"):
        run_program(guard_nonfinite(empty_after_unchecked(), local_ok=True, error=error), comm)
    assert not committed

    # a finite deferred result: nothing raised, and the host read one flag for two collectives
    def finite() -> Program:
        a, b = torch.ones(2), torch.ones(3)
        yield ReduceRequest(a, "sum", check=False)
        yield GatherRequest(torch.zeros(8, dtype=torch.uint8))
        return [a, b]

    with _HostReads() as reads:
        out = run_program(guard_nonfinite(finite(), local_ok=torch.tensor(True), error=error), comm)
    assert reads.n == 1 and torch.equal(out[0], torch.ones(2))


def test_pack_keeps_autograd_and_reduce_gradients_owns_new_grads():
    """pack concatenates into a buffer of the target dtype in one call, except where autograd must see it (RTP's
    double backward); a gradient reduce_gradients creates (the parameter had none) is not a view that would keep the
    call's whole buffer alive."""
    a, b = torch.randn(3, requires_grad=True), torch.randn(2, 2, requires_grad=True)
    pack([a, b], torch.float32, a.device).square().sum().backward()
    assert torch.equal(a.grad, 2 * a.detach()) and torch.equal(b.grad, 2 * b.detach())
    with torch.no_grad():
        assert torch.equal(pack([a, b], torch.bfloat16, a.device), torch.cat([a.bfloat16(), b.bfloat16().view(-1)]))
    params = [torch.nn.Parameter(torch.randn(1000)), torch.nn.Parameter(torch.randn(10))]
    params[0].grad = torch.randn(1000)
    make_compressor("bf16", params).reduce_gradients()
    assert params[1].grad is not None and params[1].grad.untyped_storage().nbytes() == 10 * 4


def test_stochastic_rounding_draws_what_torch_rand_draws():
    """int8's noise is drawn in place into its padded buffer: the numbers torch.rand(n) gives from the same
    generator state (a resumed run from a checkpoint of an older version draws the same)."""
    for n in (1, 7, 1023, 1025, 65537):
        g = torch.Generator().manual_seed(n)
        expected = torch.rand(n, generator=g, dtype=torch.float32)
        buf = torch.zeros(n + 5)
        buf[3 : 3 + n].uniform_(generator=g.manual_seed(n))
        assert torch.equal(buf[3 : 3 + n], expected) and not buf[:3].any() and not buf[3 + n :].any()
