"""``powertrain train`` once per ``--parallel`` mode at world size 1, in this one process (``python -m device_modes
BACKEND OUT``): each run joins and leaves its own world of one, so the next can start; a run that raises is recorded
and the next one still runs. Prints one JSON line: mode -> the run's summary, or {"error": its traceback}."""

from __future__ import annotations

import json
import sys
import traceback
import typing
from pathlib import Path
from typing import Any

from powertrain.cli import main
from powertrain.train.strategy import Parallel

#: Extra runs beyond one per mode: the DDP hook's gather program, and SimpleFSDP compiled (inductor).
EXTRA = {
    "ddp+int8": ["--parallel", "ddp", "--compressor", "int8"],
    "simple_fsdp+compile": ["--parallel", "simple_fsdp", "--compressor", "none", "--compile"],
}
#: Each mode's compressor: PowerSGD where the mode takes one (the hook's chain, FSDP2's rows), else none.
COMPRESSOR = {
    "reference": "powersgd:rank=2,start=2",
    "ddp": "powersgd:rank=2,start=2",
    "fsdp": "powersgd:rank=2,start=2",
    "simple_fsdp": "powersgd:rank=2,start=2",
}


def runs() -> dict[str, list[str]]:
    out = {}
    for mode in typing.get_args(Parallel):
        args = ["--parallel", mode, "--compressor", COMPRESSOR.get(mode, "none")]
        out[mode] = args + (["--tp", "1"] if mode == "tp" else [])
    return {**out, **EXTRA}


def run_all(backend: str, out: Path, steps: int = 4) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, args in runs().items():
        where = out / name.replace("+", "_")
        argv = [
            "train",
            "--preset",
            "tiny",
            "--steps",
            str(steps),
            "--nproc",
            "1",
            "--backend",
            backend,
            "--quiet",
            "--out",
            str(where),
            *args,
        ]
        try:
            code = main(argv)
            if code != 0:
                results[name] = {"code": code}
                continue
            summary = json.loads((where / "summary.json").read_text())
            rows = [json.loads(line) for line in (where / "metrics.jsonl").read_text().splitlines()]
            results[name] = {"code": code, "summary": summary, "losses": [r["loss"] for r in rows]}
        except BaseException:  # a mode that fails must not hide the others
            results[name] = {"error": traceback.format_exc()[-3000:]}
    return results


if __name__ == "__main__":
    print(json.dumps(run_all(sys.argv[1], Path(sys.argv[2]))), flush=True)
