"""powertrain.lightning.GradientCompression in real Lightning fits under torchrun (2 gloo processes, DDP): fewer
bytes, about the same loss as uncompressed DDP, and a fit resumed from Lightning's checkpoint continues with the
uninterrupted fit's losses bitwise (the compressor's per-worker state travels in the checkpoint)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from cli_utils import torchrun

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning is not installed")


@pytest.mark.timeout(300)
def test_lightning_fit_compresses_and_resumes_bitwise(tmp_path):
    r = torchrun(Path(__file__).with_name("lightning_fit.py"), str(tmp_path), timeout=280)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(res["full"]) == 4 * 512 // 2 // 16
        assert res["resumed"] == res["full"]  # bitwise, across Lightning's checkpoint
        assert 0 < res["sent"] < 0.5 * res["dense"], (res["sent"], res["dense"])  # measured 0.21x (rank 4)
        # quality, not parity: the last epoch's mean loss, measured 0.2246 compressed against 0.2191 plain (+2.5%)
        last = [sum(res[k][-16:]) / 16 for k in ("full", "plain")]
        assert abs(last[0] - last[1]) < 0.1 * last[1], last
        # every worker's state on rank 0 (the one that writes the checkpoint); another world size refused
        assert res["saved_world"] == 2 and res["saved_ranks"] == (2 if rank == 0 else 0)
        assert "written by 3 workers and this fit has 2: resume with 3" in res["refusal"], res["refusal"]
        assert res["refit"]  # a second fit of the Trainer registers the same compressor on its new DDP wrapper
