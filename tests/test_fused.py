"""powertrain.ops.fused: a fused kernel gives its eager twin's results. On the CPU inductor compiles C++ whose
operations are the eager ones in the same order (IEEE division, the same roundings), so the codes and scales of
quantisation are bitwise equal; on CUDA (test_device.py's leg) Triton's division may differ by an ulp."""

from __future__ import annotations

import pytest
import torch

from powertrain.compress import make_compressor
from powertrain.ops import fused
from powertrain.ops import quantize as q

pytestmark = pytest.mark.timeout(240)


def _compiles_here() -> None:
    try:
        torch.compile(lambda t: t + 1, dynamic=True)(torch.ones(3))
    except Exception as e:  # no C++ toolchain: the eager path is what runs here, and other tests cover it
        pytest.skip(f"torch.compile cannot build a kernel on this machine ({type(e).__name__})")


def test_fused_quantisation_equals_eager_bitwise(monkeypatch):
    """int8 and int4, stochastic and nearest rounding, sizes that leave a partial chunk, zeros and six decades of
    magnitudes: the same codes and scales, with the fused kernel really running (no fallback). A NaN's code is in range
    (the compiled code assumes finite math: not the eager code, but no spill into an int4 neighbour)."""
    _compiles_here()
    torch.manual_seed(0)
    cases = 0
    for n, chunk in ((5000, 256), (777, 64), (1 << 16, 1024), (300, 8)):
        x = torch.randn(n) * torch.logspace(-3, 3, n)
        x[::97] = 0
        noise = torch.rand(n)
        for bits in (8, 4):
            for nz in (None, noise):
                monkeypatch.setenv("POWERTRAIN_FUSED", "0")
                want = q.quantize(x, bits, chunk, nz)
                monkeypatch.setenv("POWERTRAIN_FUSED", "1")
                got = q.quantize(x, bits, chunk, nz)
                assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), (n, chunk, bits, nz is None)
                cases += 1
    assert cases == 16 and "rounded_codes" in fused._COMPILED and not fused._FAILED, fused._FAILED
    x = torch.cat([torch.linspace(-1, 1, 9), torch.linspace(-1, 1, 9)])
    x[8] = float("nan")  # int4, chunk 9: the NaN's code shares a byte with the next chunk's first
    codes, scales = q.quantize(x, 4, 9)
    assert int(codes.abs().max()) <= 7, codes
    decoded = q.dequantize(*q.unpack_codes(q.pack_codes(codes, scales, 4), x.numel(), scales.numel(), 4), 9)
    assert torch.equal(decoded[9:], q.dequantize(codes, scales, 9)[9:]) and decoded[9].item() == -1.0, decoded[9:]


def test_the_setting_is_checked_and_auto_fuses_on_cuda_only(monkeypatch):
    monkeypatch.setenv("POWERTRAIN_FUSED", "yes")
    with pytest.raises(ValueError, match="POWERTRAIN_FUSED='yes': choose auto, 1 or 0"):
        fused.enabled(torch.device("cpu"))
    with pytest.raises(ValueError, match="POWERTRAIN_FUSED='yes'"):  # when the compressor is built, not in backward
        make_compressor("int8", [torch.nn.Parameter(torch.zeros(4, 4))])
    monkeypatch.delenv("POWERTRAIN_FUSED")
    assert fused.enabled(torch.device("cuda")) and not fused.enabled(torch.device("cpu"))
    monkeypatch.setenv("POWERTRAIN_FUSED", "0")
    assert not fused.enabled(torch.device("cuda"))


def test_a_kernel_that_cannot_compile_runs_eager_and_says_so(monkeypatch):
    monkeypatch.setenv("POWERTRAIN_FUSED", "1")
    monkeypatch.setattr(fused, "_COMPILED", {"broken": lambda *a: (_ for _ in ()).throw(RuntimeError("no compiler"))})
    monkeypatch.setattr(fused, "_FAILED", set())
    call = fused.fused_or_eager("broken", lambda t: t, lambda t: t * 2, torch.device("cpu"))
    with pytest.warns(UserWarning, match="fused broken did not run .*no compiler.*eager now"):
        assert torch.equal(call(torch.ones(2)), torch.full((2,), 2.0))
    assert fused.fused_or_eager("broken", lambda t: t, lambda t: t * 3, torch.device("cpu"))(torch.ones(1)).item() == 3


def test_fused_powersgd_equals_eager_bitwise(monkeypatch):
    """PowerSGD's gradient + residual and its extremes in one kernel: the same outputs and state over steps (paper
    and alternating, float32 and bfloat16 gradients, FSDP rows), and a NaN on the way still refused."""
    _compiles_here()
    from powertrain.compress import NonFiniteGradientError
    from test_fsdp import same_state

    def run(mode: str) -> list:
        monkeypatch.setenv("POWERTRAIN_FUSED", mode)
        out: list = []
        for opts in (
            {"rank": 4, "start_compressing_after_num_steps": 1},
            {"rank": 2, "variant": "alternating", "start_compressing_after_num_steps": 0},
        ):
            for dtype in (torch.float32, torch.bfloat16):
                torch.manual_seed(0)
                params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in ((24, 16), (24, 16), (9, 31), (7,))]
                comp = make_compressor("powersgd", params, **opts)
                for step in range(4):
                    g = torch.Generator().manual_seed(step)
                    grads = [torch.randn(p.shape, generator=g).to(dtype) for p in params]
                    out.append(comp.aggregate(grads))
                    out.append(comp.aggregate(grads, rows=[(1, 3)] * len(params)))
                out.append(comp.state_dict())
                grads[0].view(-1)[5] = float("nan")
                with pytest.raises(NonFiniteGradientError):
                    comp.aggregate(grads)
                out.append(comp.state_dict())
        return out

    assert same_state(run("0"), run("1"))
    assert "add_extrema" in fused._COMPILED and not fused._FAILED, fused._FAILED
