"""powertrain's DistributedShampoo against the reference implementation (facebookresearch/optimizers), update by
update: runs where a clone of it is named by POWERTRAIN_SHAMPOO_REFERENCE (or ``distributed_shampoo`` is installed),
skips otherwise. tools/shampoo_reference.py measures the same agreement for BENCHMARKS.md, with step times.

Teacher-forced (both optimizers get the same parameters and gradient at every step, so differences do not compound),
in float64, for the cases where the two implementations compute the same thing in exact arithmetic (the tool's
DESIGN_DIFFERENCES name where they do not: weight decay with momentum, the eigenvalue-corrected null space). What is
left is the reference computing some scalars in float32: its bias corrections ``1 - beta^t`` start from a float32
``beta``, off from the float64 one by up to u32 = 2^-24 relative, which ``1 - beta`` turns into u32 * beta / (1 - beta)
relative (6e-5 at beta 0.999); a root of it or a square root halves that or less. So the relative update difference
is bounded by u32 / (1 - beta) for the largest such beta the case uses (Adam grafting's beta2, an EMA factor's
beta2), and by 1e-6 without one (the first-moment correction with beta1 0.9: u32 * 0.9 / 0.1 = 5e-7, twice that).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
U32 = 2.0**-24
#: cases with a documented difference in exact arithmetic (the tool's DESIGN_DIFFERENCES)
DIFFERENT = ("momentum 0.9, weight decay 0.1", "eigenvalue-corrected")


def _tool() -> Any:
    spec = importlib.util.spec_from_file_location("shampoo_reference", ROOT / "tools" / "shampoo_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["shampoo_reference"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _tolerance(case: Any) -> float:
    betas = [case.grafting_beta2] if case.grafting == "adam" else []
    betas += [case.betas[1]] if case.betas[1] < 1 else []
    return U32 / (1 - max(betas)) if betas else 1e-6


@pytest.mark.timeout(300)
def test_updates_agree_with_the_reference_implementation():
    tool = _tool()
    path = os.environ.get("POWERTRAIN_SHAMPOO_REFERENCE")
    ref = tool.load_reference(path)
    if ref is None:
        pytest.skip("set POWERTRAIN_SHAMPOO_REFERENCE to a clone of facebookresearch/optimizers")
    cases = [c for c in tool.default_cases() if not c.name.startswith(DIFFERENT)]
    assert len(cases) >= 5, [c.name for c in cases]
    seen = []
    for case in cases:
        summary = tool.agreement(ref, case, steps=30, dtype=torch.float64)["summary"]
        worst, tol = max(summary["graft_phase"], summary["shampoo_phase"]), _tolerance(case)
        seen.append(f"{case.name}: {worst:.1e} (tolerance {tol:.1e})")
        assert worst <= tol, seen
