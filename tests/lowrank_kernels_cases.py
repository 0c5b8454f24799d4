"""powertrain.ops.lowrank_kernels: PowerSGD's two Triton kernels against their eager twins, run on the CPU by Triton's
interpreter (``TRITON_INTERPRET=1``), alone and inside the paper variant.

Tolerances. The sum is one float32 addition per entry in both (the gradient rounded to float32 first): bitwise. A
product is a sum of ``k`` float32 products in another order than the BLAS's: each of the two results is within
``gamma_k |A| |B|`` of the exact product (``gamma_k = k u / (1 - k u)``, ``u = 2^-24``, for any order of summation;
Higham, Accuracy and Stability of Numerical Algorithms, eq. 3.13), so they differ by at most ``2 gamma_k |A| |B|``.
The residual ``M - approx`` is then within that of the eager one, plus one rounding of each (``u`` times each
magnitude). With integer-valued gradients, residuals and ``Q`` (powers of two after the unit scaling), the first
product is exact in any order (every partial sum an integer below 2^24): the same ``P``, so the whole paper variant
runs the same operations up to the approximation, and only that and the residual differ, within the bound above.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

from powertrain.ops import lowrank_kernels as K

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed"),
    pytest.mark.timeout(300),
]

U = 2.0**-24


def gamma(k: int) -> float:
    return k * U / (1 - k * U)


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("POWERTRAIN_FUSED", "1")
    monkeypatch.setattr(K, "_FAILED", [])  # a failure seen elsewhere would turn the kernels off here
    K._kernels.cache_clear()  # decorated under the interpreter
    yield
    K._kernels.cache_clear()
    assert not K._FAILED, f"a kernel fell back to its eager twin: {K._FAILED}"


@pytest.mark.parametrize(("n", "m", "r"), [(70, 130, 4), (33, 64, 32), (128, 96, 1), (17, 200, 33), (1, 5, 2)])
def test_sum_project_equals_its_eager_twin(interpreted, monkeypatch, n, m, r):
    """Sizes off the blocks on both sides, rank 1, 32 and 33 (a 64-wide rank tile, half unused), a bf16 gradient
    (rounded up exactly), a transposed gradient (strides), no residual yet. Only POWERTRAIN_FUSED=1 asks for them."""
    assert K.usable(torch.device("cpu"), torch.float32) and not K.usable(torch.device("cpu"), torch.float64)
    monkeypatch.setenv("POWERTRAIN_FUSED", "auto")  # fused elementwise work on CUDA, not yet these kernels
    assert not K.usable(torch.device("cuda"), torch.float32) and not K.usable(torch.device("cpu"), torch.float32)
    monkeypatch.setenv("POWERTRAIN_FUSED", "1")
    torch.manual_seed(n + m + r)
    q = torch.randn(m, r)
    cases = [
        (torch.randn(n, m), torch.randn(n, m)),
        (torch.randn(n, m).bfloat16(), torch.randn(n, m)),
        (torch.randn(m, n).t(), torch.randn(n, m)),
        (torch.randn(n, m), None),
    ]
    for g, e in cases:
        want_m, got_m, want_p, got_p = torch.empty(n, m), torch.empty(n, m), torch.empty(n, r), torch.empty(n, r)
        want_x = K.sum_project_eager(want_m, g, e, q, want_p)
        got_x = K.sum_project(got_m, g, e, q, got_p)
        assert torch.equal(got_m, want_m) and torch.equal(got_x, want_x), (g.dtype, e is None)
        bound = 2 * gamma(m) * (want_m.abs() @ q.abs())
        assert ((got_p - want_p).abs() <= bound).all(), float(((got_p - want_p).abs() - bound).max())


def test_sum_project_extremes_fail_a_finiteness_check_on_nan_and_inf(interpreted):
    g, q = torch.randn(40, 70), torch.randn(70, 3)
    for bad in (float("nan"), float("inf"), float("-inf")):
        g2 = g.clone()
        g2[37, 69] = bad  # in the last block of rows and of columns
        got = K.sum_project(torch.empty(40, 70), g2, torch.zeros(40, 70), q, torch.empty(40, 3))
        assert not torch.isfinite(got).all(), (bad, got)
        if bad != bad:  # NaN, where the eager twin's extremes are NaN
            assert got.tolist() == [float("-inf"), float("inf")]


@pytest.mark.parametrize(("b", "n", "m", "r"), [(3, 70, 130, 4), (1, 33, 64, 32), (2, 128, 96, 1), (2, 9, 300, 40)])
def test_approx_residual_equals_its_eager_twin(interpreted, b, n, m, r):
    torch.manual_seed(b * n + m + r)
    m_bnm, p, q = torch.randn(b, n, m), torch.randn(b, n, r), torch.randn(b, m, r)
    want_m, got_m = m_bnm.clone(), m_bnm.clone()
    want = K.approx_residual_eager(want_m, p, q)
    got = K.approx_residual(got_m, p, q[:, :, :].contiguous())
    bound = 2 * gamma(r) * torch.bmm(p.abs(), q.abs().transpose(1, 2))
    assert ((got - want).abs() <= bound).all()
    assert ((got_m - want_m).abs() <= bound + U * (got_m.abs() + want_m.abs())).all()


def test_the_paper_variant_with_the_kernels_equals_it_without(monkeypatch, interpreted):
    """One call on a 1-rank compressor, integer-valued gradients and Q (see the module): the factors bitwise, the
    approximation (the output) and the residual within the derived bound of the last product; the vector's exact
    all-reduce bitwise. The kernels really ran (their calls counted)."""
    from powertrain.compress import make_compressor

    torch.manual_seed(0)
    shapes = [(40, 24), (40, 24), (65, 33), (7,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    grads = [torch.randint(-8, 9, s).float() for s in shapes]
    calls = {"sum_project": 0, "approx_residual": 0}
    for name in calls:
        real = getattr(K, name)

        def counted(*a, _real=real, _name=name):
            calls[_name] += 1
            return _real(*a)

        monkeypatch.setattr(K, name, counted)

    def run(kernels: bool, rows=None):
        monkeypatch.setenv("POWERTRAIN_FUSED", "1" if kernels else "0")
        comp = make_compressor(
            "powersgd", params, rank=4, variant="paper", factor_dtype="fp32", start_compressing_after_num_steps=0
        )
        state = comp.state_dict()
        gen = torch.Generator().manual_seed(1)
        state["q"] = [None if q is None else torch.randint(-8, 9, q.shape, generator=gen).float() for q in state["q"]]
        comp.load_state_dict(state)
        return comp.aggregate(grads, rows=rows), comp.state_dict()

    (want, want_state), (got, got_state) = run(False), run(True)
    assert calls == {"sum_project": 3, "approx_residual": 2}, calls  # one per matrix; one per batch (2 shapes)
    assert torch.equal(want[3], got[3])
    for i in range(3):
        p, q = want_state["p"][i], want_state["q"][i]
        assert torch.equal(p, got_state["p"][i]) and torch.equal(q, got_state["q"][i]), i
        bound = 2 * gamma(4) * (p.abs() @ q.abs().T)
        assert ((got[i] - want[i]).abs() <= bound).all(), i
        res_w, res_g = want_state["errors"][i], got_state["errors"][i]
        assert ((res_g - res_w).abs() <= bound + U * (res_g.abs() + res_w.abs())).all(), i
    # an FSDP shard's rows: the first product still through the kernel (its one call a matrix), the approximation of
    # those rows and the full residual eager: the same operations on the same factors, bitwise
    rows = [(8, 24), (0, 40), (30, 65), (0, 7)]
    (want, want_state), (got, got_state) = run(False, rows), run(True, rows)
    assert calls == {"sum_project": 3 + 3, "approx_residual": 2}, calls
    for w, g in zip([*want, *want_state["errors"][:3]], [*got, *got_state["errors"][:3]], strict=True):
        assert torch.equal(w, g)


def test_a_kernel_that_cannot_run_warns_once_and_the_eager_twins_take_over(interpreted, monkeypatch):
    """A Triton that cannot compile for this device (or does not match torch's) must not fail a backward: the call
    gets its eager twin's results, one warning says so, and later calls go eager (usable() False)."""

    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("no compiler for this device")

    monkeypatch.setattr(K, "_kernels", functools.cache(lambda: type("Kernels", (), {"sum_project": Broken()})))
    monkeypatch.setattr(K, "_FAILED", [])
    g, e, q = torch.randn(9, 20), torch.randn(9, 20), torch.randn(20, 3)
    want_m, got_m, want_p, got_p = torch.empty(9, 20), torch.empty(9, 20), torch.empty(9, 3), torch.empty(9, 3)
    want = K.sum_project_eager(want_m, g, e, q, want_p)
    with pytest.warns(UserWarning, match="Triton kernel sum_project did not run .RuntimeError: no compiler"):
        got = K.sum_project(got_m, g, e, q, got_p)
    assert torch.equal(got, want) and torch.equal(got_m, want_m) and torch.equal(got_p, want_p)
    assert not K.usable(torch.device("cpu"), torch.float32)
    got = K.sum_project(got_m, g, e, q, got_p)  # no second attempt (on CUDA a compilation each), no second warning
    assert K._FAILED == ["sum_project"] and torch.equal(got, want)
    K._FAILED.clear()  # the fixture's check is for the other tests
