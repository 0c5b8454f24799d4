"""powertrain.ops.lowrank_kernels: PowerSGD's Triton kernel against its eager twin, run on the CPU by Triton's
interpreter (``TRITON_INTERPRET=1``), alone and inside the paper variant.

Tolerances. Without kept factors the sum is one float32 addition per entry in both (the gradient rounded to float32
first): bitwise. A product is a sum of ``k`` float32 products in another order than the BLAS's: each of the two results
is within ``gamma_k |A| |B|`` of the exact product (``gamma_k = k u / (1 - k u)``, ``u = 2^-24``, for any order of
summation; Higham, Accuracy and Stability of Numerical Algorithms, eq. 3.13). The sum ``g + e - P Q^T`` is one of
``r + 2`` terms in each (the kernel: the dot product, then the subtraction and the gradient; the eager twin: addmm,
then the gradient), so each is within ``gamma_{r+2} (|g| + |e| + |P| |Q|^T)`` of the exact sum, computed in float64
(whose own error is counted too). Each is checked against that rather than against the other, since on some CPUs the
two orders give the same bits and on others they do not; so the two differ by at most twice it. The first product
then takes the sums' difference times ``|Q|`` beside its own ``gamma_m`` of each. With integer-valued gradients, kept
matrices and factors (``Q`` a power of two after the unit scaling), every product the kernel forms is exact in any
order (every partial sum an integer below 2^24): the same sums and ``P``, after which the paper variant runs the same
operations with or without the kernel, so the whole call is bitwise.
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


#: float64's own error in the exact sums below (up to 1,000 terms: gamma_1000 in float64), counted in full
GAMMA64 = 1e3 * 2.0**-53 / (1 - 1e3 * 2.0**-53)


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
    (rounded up exactly), a transposed gradient (strides), no residual yet, kept factors of another rank (and
    transposed). Only POWERTRAIN_FUSED=1 asks for the kernel."""
    assert K.usable(torch.device("cpu"), torch.float32) and not K.usable(torch.device("cpu"), torch.float64)
    monkeypatch.setenv("POWERTRAIN_FUSED", "auto")  # fused elementwise work on CUDA, not yet this kernel
    assert not K.usable(torch.device("cuda"), torch.float32) and not K.usable(torch.device("cpu"), torch.float32)
    monkeypatch.setenv("POWERTRAIN_FUSED", "1")
    torch.manual_seed(n + m + r)
    q = torch.randn(m, r)
    kr = max(1, r - 1)
    kept = (torch.randn(n, kr), torch.randn(m, kr))
    cases = [
        (torch.randn(n, m), torch.randn(n, m), None),
        (torch.randn(n, m).bfloat16(), torch.randn(n, m), None),
        (torch.randn(m, n).t(), torch.randn(n, m), None),
        (torch.randn(n, m), None, None),
        (torch.randn(n, m), torch.randn(n, m), kept),
        (torch.randn(n, m).bfloat16(), torch.randn(m, n).t(), (kept[0], torch.randn(kr, m).t())),
    ]
    for g, e, k in cases:
        want_m, got_m, want_p, got_p = torch.empty(n, m), torch.empty(n, m), torch.empty(n, r), torch.empty(n, r)
        want_x = K.sum_project_eager(want_m, g, e, k, q, want_p)
        got_x = K.sum_project(got_m, g, e, k, q, got_p)
        what = (g.dtype, e is None, k is None)
        assert torch.equal(got_x, torch.stack(torch.aminmax(got_m))), what  # the extremes of what it wrote
        if k is None:
            assert torch.equal(got_m, want_m) and torch.equal(got_x, want_x), what
        else:
            assert e is not None
            # each against the exact sum, not against each other: on some CPUs (an Intel Xeon here) the BLAS and
            # Triton's interpreter add in the same order and agree bit for bit, on others they differ
            exact = g.double() + (e.double() - k[0].double() @ k[1].double().T)
            terms = g.double().abs() + e.double().abs() + k[0].double().abs() @ k[1].double().abs().T
            most = (gamma(kr + 2) + GAMMA64) * terms
            for got in (got_m, want_m):
                err = (got.double() - exact).abs()
                assert (err <= most).all(), (what, float((err - most).max()))
        bound = (got_m - want_m).abs() @ q.abs() + gamma(m) * ((got_m.abs() + want_m.abs()) @ q.abs())
        assert ((got_p - want_p).abs() <= bound).all(), (what, float(((got_p - want_p).abs() - bound).max()))


def test_sum_project_extremes_fail_a_finiteness_check_on_nan_and_inf(interpreted):
    g, q = torch.randn(40, 70), torch.randn(70, 3)
    for bad in (float("nan"), float("inf"), float("-inf")):
        g2 = g.clone()
        g2[37, 69] = bad  # in the last block of rows and of columns
        kept = (torch.randn(40, 2), torch.randn(70, 2))
        got = K.sum_project(torch.empty(40, 70), g2, torch.zeros(40, 70), kept, q, torch.empty(40, 3))
        assert not torch.isfinite(got).all(), (bad, got)
        if bad != bad:  # NaN, where the eager twin's extremes are NaN
            assert got.tolist() == [float("-inf"), float("inf")]


def test_the_paper_variant_with_the_kernels_equals_it_without(monkeypatch, interpreted):
    """One call on a 1-rank compressor from a state that owes integer-valued residuals through kept factors (two
    matrices) or nothing yet (one), integer-valued gradients and Q (see the module): the sums (the kept M after the
    call), factors and approximations (the outputs) bitwise, and the vector's exact all-reduce. The kernel really ran
    (its calls counted)."""
    from powertrain.compress import make_compressor

    torch.manual_seed(0)
    shapes = [(40, 24), (40, 24), (65, 33), (7,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    grads = [torch.randint(-8, 9, s).float() for s in shapes]
    calls = 0
    real = K.sum_project

    def counted(*a):
        nonlocal calls
        calls += 1
        return real(*a)

    monkeypatch.setattr(K, "sum_project", counted)

    def run(kernels: bool, rows=None):
        monkeypatch.setenv("POWERTRAIN_FUSED", "1" if kernels else "0")
        comp = make_compressor(
            "powersgd", params, rank=4, variant="paper", factor_dtype="fp32", start_compressing_after_num_steps=0
        )
        state = comp.state_dict()
        gen = torch.Generator().manual_seed(1)
        ints = lambda t: None if t is None else torch.randint(-8, 9, t.shape, generator=gen).float()
        state["q"], state["p"] = [ints(q) for q in state["q"]], [ints(p) for p in state["p"]]
        state["m"] = [None if i in (1, 3) else ints(torch.empty(shapes[i])) for i in range(4)]
        comp.load_state_dict(state)
        return comp.aggregate(grads, rows=rows), comp.state_dict()

    (want, want_state), (got, got_state) = run(False), run(True)
    assert calls == 3, calls  # one per matrix
    assert torch.equal(want[3], got[3])
    for i in range(3):
        p, q = want_state["p"][i], want_state["q"][i]
        assert torch.equal(p, got_state["p"][i]) and torch.equal(q, got_state["q"][i]), i
        assert torch.equal(want_state["m"][i], got_state["m"][i]) and torch.equal(want[i], got[i]), i
    # an FSDP shard's rows: the first product still through the kernel (its one call a matrix), the approximation of
    # those rows eager: the same operations on the same factors, bitwise
    rows = [(8, 24), (0, 40), (30, 65), (0, 7)]
    (want, want_state), (got, got_state) = run(False, rows), run(True, rows)
    assert calls == 3 + 3, calls
    for w, g in zip([*want, *want_state["m"][:3]], [*got, *got_state["m"][:3]], strict=True):
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
    kept = (torch.randn(9, 2), torch.randn(20, 2))
    want_m, got_m, want_p, got_p = torch.empty(9, 20), torch.empty(9, 20), torch.empty(9, 3), torch.empty(9, 3)
    want = K.sum_project_eager(want_m, g, e, kept, q, want_p)
    with pytest.warns(UserWarning, match="Triton kernel sum_project did not run .RuntimeError: no compiler"):
        got = K.sum_project(got_m, g, e, kept, q, got_p)
    assert torch.equal(got, want) and torch.equal(got_m, want_m) and torch.equal(got_p, want_p)
    assert not K.usable(torch.device("cpu"), torch.float32)
    got = K.sum_project(
        got_m, g, e, kept, q, got_p
    )  # no second attempt (on CUDA a compilation each), no second warning
    assert K._FAILED == ["sum_project"] and torch.equal(got, want)
    K._FAILED.clear()  # the fixture's check is for the other tests
