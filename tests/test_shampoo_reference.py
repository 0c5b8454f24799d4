"""powertrain's DistributedShampoo against the reference implementation (facebookresearch/optimizers), update by
update: runs where a clone of it is named by POWERTRAIN_SHAMPOO_REFERENCE (or ``distributed_shampoo`` is installed),
skips otherwise. ``python tools/bench_optimizers.py --shampoo-reference CLONE`` times the two (and heavyball).

Teacher-forced (both optimizers get the same parameters and gradient at every step, so differences do not compound),
in float64, for the cases where the two implementations compute the same thing in exact arithmetic (DESIGN_DIFFERENCES
below name where they do not: weight decay with momentum, the eigenvalue-corrected null space). What is left is the
reference computing some scalars in float32: its bias corrections ``1 - beta^t`` start from a float32 ``beta``, off
from the float64 one by up to u32 = 2^-24 relative, which ``1 - beta`` turns into u32 * beta / (1 - beta) relative
(6e-5 at beta 0.999); a root of it or a square root halves that or less. So the relative update difference is bounded
by u32 / (1 - beta) for the largest such beta the case uses (Adam grafting's beta2, an EMA factor's beta2), and by
1e-6 without one (the first-moment correction with beta1 0.9: u32 * 0.9 / 0.1 = 5e-7, twice that).

No noise floor is measured (the reference against itself with options equal in exact arithmetic, epsilon before the
eigendecomposition and packed storage): for these cases in float64 it was at most 2.5e-7 (reference commit
f60660661194), two orders of magnitude below the derived bound, so the bound alone decides.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

import pytest
import torch
from torch import nn

from bench_optimizers import load_shampoo_reference, reference_like
from powertrain.optim.shampoo.optimizer import DistributedShampoo

U32 = 2.0**-24

#: Found by reading both implementations (at reference commit f60660661194); the cases below set each equal, bound
#: it (the float32 scalars) or leave it out. powertrain's side of each is a test (tests/test_shampoo_math.py).
DESIGN_DIFFERENCES: list[str] = [
    "Damping of the factors' eigenvalues: powertrain adds max(eps, rel_eps * lambda_max) with rel_eps "
    "defaulting to the factor dtype's unit round-off (float32: 1.2e-7); the reference damps by epsilon alone unless "
    "told otherwise. With float32 factors and epsilon 1e-12, a rank-deficient factor's round-off eigenvalues weigh up "
    "to epsilon^(-1/2k) in the root, and the preconditioned direction can be mostly round-off (issue 19). The "
    "cases set powertrain's rel_eps=0.",
    "Factor bias correction: both divide the factors by 1 - beta2^t before the root (powertrain's "
    "bias_correction=True, the reference's use_bias_correction=True); the reference flag also switches the bias "
    "correction of the filtered gradient, which powertrain always applies (equal with beta1 = 0 or the flag on).",
    "The reference's lr and its bias corrections of the filtered gradient and of Adam grafting are float32 "
    "scalars even for float64 parameters: a ~1e-7 .. 1e-5 relative floor in float64 (lr 2^-7 avoids the lr's).",
    "Weight decay with momentum: the reference adds weight_decay * W to the direction before momentum; "
    "powertrain decays the weights outside the momentum buffer. Equal without momentum.",
    "Eigenvalue-corrected Shampoo on rank-deficient factors (vectors, first steps): the eigenvectors of the "
    "null space are arbitrary, so both implementations (and the reference against itself) disagree there.",
    "Grafting: the reference divides by ||shampoo|| + 1e-16, powertrain by ||shampoo|| (if > 0).",
]

#: powertrain's options in every case: lr 2^-7 because the reference multiplies by a float32 copy of it (a power of two
#: is exact there); blocks of at most 32 rows, so the MLP's 48 and 40 rows are split and its biases are 1-D blocks
BASE: dict[str, Any] = dict(
    lr=2.0**-7, betas=(0.9, 1.0), eps=1e-12, grafting_beta2=0.999, max_preconditioner_dim=32, precondition_frequency=5
)
#: name: (model, options over BASE)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "Shampoo, AdaGrad factors, Adam grafting": ("mlp", {}),
    "same, epsilon 1e-6": ("mlp", {"eps": 1e-6}),
    "no filtering, EMA factors, AdaGrad grafting": ("mlp", {"betas": (0.0, 0.999), "grafting": "adagrad"}),
    "train CLI settings: EMA factors, weight decay": ("mlp", {"betas": (0.9, 0.999), "weight_decay": 0.1}),
    "momentum 0.9": ("mlp", {"momentum": 0.9}),
    "conv1d weight (8, 3, 5)": ("conv", {}),  # 3-D: the reference blocks it as powertrain does only when told to
}


@pytest.fixture(scope="module")
def ref() -> Any:
    path = os.environ.get("POWERTRAIN_SHAMPOO_REFERENCE")
    if path is None and importlib.util.find_spec("distributed_shampoo") is None:
        pytest.skip("set POWERTRAIN_SHAMPOO_REFERENCE to a clone of facebookresearch/optimizers")
    return load_shampoo_reference(path)


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        model: nn.Module = nn.Sequential(nn.Linear(20, 48), nn.Tanh(), nn.Linear(48, 40), nn.Tanh(), nn.Linear(40, 10))
    else:
        model = nn.Sequential(nn.Conv1d(3, 8, 5), nn.Tanh(), nn.Flatten(), nn.Linear(8 * 16, 10))
    return model.double()


def _batches(kind: str, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Gaussian inputs labelled by a fixed random linear teacher (a learnable task)."""
    g = torch.Generator().manual_seed(1)
    shape = (64, 20) if kind == "mlp" else (64, 3, 20)
    teacher = torch.randn(60 if kind == "conv" else 20, 10, generator=g, dtype=torch.float64)
    out = []
    for _ in range(steps):
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        out.append((x, (x.reshape(64, -1) @ teacher).argmax(dim=1)))
    return out


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _tolerance(options: dict[str, Any]) -> float:
    betas = [options["grafting_beta2"]] if options.get("grafting", "adam") == "adam" else []
    betas += [options["betas"][1]] if options["betas"][1] < 1 else []
    return U32 / (1 - max(betas)) if betas else 1e-6


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kind", "options"), CASES.values(), ids=list(CASES))
def test_updates_agree_with_the_reference_implementation(ref, kind, options):
    """Per step ``||u_ref - u_pt|| / ||u_pt||`` over 30 steps (the first preconditioned one is the fifth), the
    reference's model given powertrain's parameters and gradients before every step."""
    options = BASE | options
    a, b = _model(kind), _model(kind)
    pt = DistributedShampoo(a.parameters(), **options, rel_eps=0.0)  # the reference damps by epsilon alone
    other = reference_like(ref, b.parameters(), pt, torch.float64)
    diffs = []
    for x, y in _batches(kind, 30):
        with torch.no_grad():
            for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
                pb.copy_(pa)  # in place: the reference's blocks are views of the parameters
        before = _flat(a)
        pt.zero_grad()
        nn.functional.cross_entropy(a(x), y).backward()
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            pb.grad = pa.grad.clone()
        pt.step()
        other.step()
        ua, ub = _flat(a) - before, _flat(b) - before
        diffs.append(float((ub - ua).norm() / ua.norm()))
    assert max(diffs) <= _tolerance(options), [f"{d:.1e}" for d in diffs]


def test_bench_part_times_every_optimizer(ref, tmp_path):
    """``python tools/bench_optimizers.py --preset tiny --shampoo-reference CLONE``: a row per optimizer, in a section
    of its own beside the optimizers' section."""
    from bench_optimizers import run_optimizers_bench

    path = os.environ.get("POWERTRAIN_SHAMPOO_REFERENCE")
    if path is None:
        pytest.skip("the command needs the clone's path: set POWERTRAIN_SHAMPOO_REFERENCE")
    out = tmp_path / "B.md"
    report = run_optimizers_bench(preset="tiny", write=str(out), shampoo_reference=path)
    rows = {r["label"]: r for r in report["shampoo_reference"]["rows"]}
    kinds = ("Shampoo", "eigenvalue-corrected")
    heavyball = ["heavyball SOAP", "heavyball KLShampoo"] if importlib.util.find_spec("heavyball") else []
    assert list(rows) == [
        "torch AdamW",
        *(f"{who} {k}" for who in ("powertrain", "reference") for k in kinds),
        *heavyball,
    ]
    assert all(r["error"] is None and r["step_median_s"] > 0 and r["loss"] > 0 for r in rows.values()), rows
    text = out.read_text()
    section = text.split("<!-- bench:shampoo-reference-tiny -->")[1].split("<!-- /bench:shampoo-reference-tiny -->")[0]
    assert section.count("\n| ") == len(rows) + 1 and "reference eigenvalue-corrected" in section
    assert f"Command: `python tools/bench_optimizers.py --preset tiny --shampoo-reference {path}`" in section
    assert (
        "<!-- bench:optimizers-tiny -->" in text and "Shampoo side by side" not in text.split("<!-- bench:shampoo")[0]
    )


def test_a_path_without_the_reference_is_refused_before_the_bench_runs(tmp_path):
    from bench_optimizers import run_optimizers_bench

    with pytest.raises(ValueError, match=r"Invalid Shampoo reference '.*': no distributed_shampoo/ package there"):
        run_optimizers_bench(preset="tiny", write=None, shampoo_reference=str(tmp_path))


def test_options_the_reference_has_no_counterpart_for_are_refused(ref):
    p = lambda: [torch.nn.Parameter(torch.zeros(4, 4))]
    with pytest.raises(ValueError, match=r"cannot map nesterov=True .* with nesterov=False"):
        reference_like(ref, p(), DistributedShampoo(p(), momentum=0.9, nesterov=True, rel_eps=0.0))
    with pytest.raises(ValueError, match=r"cannot map rel_eps=None .* with rel_eps=0.0"):
        reference_like(ref, p(), DistributedShampoo(p()))
    with pytest.raises(ValueError, match="options of its own"):
        reference_like(ref, p(), DistributedShampoo([{"params": p(), "lr": 0.1}, {"params": p()}], rel_eps=0.0))


def test_a_clone_that_does_not_import_is_refused_before_the_bench_runs(tmp_path, monkeypatch):
    from bench_optimizers import run_optimizers_bench

    (tmp_path / "distributed_shampoo").mkdir()
    (tmp_path / "distributed_shampoo" / "__init__.py").write_text("import a_module_no_one_has\n")
    monkeypatch.delitem(sys.modules, "distributed_shampoo", raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the clone's root is put first while loading
    with pytest.raises(ValueError, match=r"does not run here \(ModuleNotFoundError: No module named 'a_module_no_"):
        run_optimizers_bench(preset="tiny", write=None, shampoo_reference=str(tmp_path))
