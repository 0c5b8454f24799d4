"""Install powertrain alone and with each optional extra, each in a fresh virtual environment, and import what
the extra is for: ``python tools/check_extras.py [EXTRA ...]`` (default: all). Prints one line per extra and exits
non-zero if any install or import fails. Needs the package index (torch==2.13.0 first, the CPU build, as the
set-up does, docs/getting-started.md, "Install": asking for a range would pull CUDA wheels). Minutes per extra; not
part of ``make test``.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: extra -> a program that uses it (the package's own modules that need the extra, not just the dependency)
USES = {
    "": "import powertrain, powertrain.ddp, powertrain.fsdp; from powertrain.compress import make_compressor",
    "data": "from powertrain.train.config import TrainConfig; from powertrain.train.data import load_data; "
    "print(load_data(TrainConfig(model='resnet', data='mnist1d')).description)",
    "plots": "import pathlib, tempfile; from powertrain.train.metrics import RunWriter; "
    "w = RunWriter(pathlib.Path(tempfile.mkdtemp()), resume_step=None); w.every_step(1, 2.0, 0.1, 0.0); "
    "assert w.plot(), 'no plot'",
    "tensorboard": "from torch.utils.tensorboard import SummaryWriter",
    "lightning": "import powertrain.lightning",
    "hf": "import powertrain.hf",
}


def check(extra: str, work: Path) -> tuple[bool, str]:
    venv = work / (extra or "base")
    py = venv / "bin" / "python"
    spec = f"{ROOT}[{extra}]" if extra else str(ROOT)
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(py), "-m", "pip", "install", "-q", "torch==2.13.0"],
        [str(py), "-m", "pip", "install", "-q", spec],
        [str(py), "-c", USES[extra]],
    ]
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
        if r.returncode != 0:
            return False, f"{' '.join(cmd[-2:])}: {(r.stderr or r.stdout).strip().splitlines()[-1:]}"
    return True, "installs and imports"


def main(argv: list[str]) -> int:
    extras = argv or list(USES)
    unknown = [e for e in extras if e not in USES]
    if unknown:
        print(f"Unknown extra(s) {unknown}: choose from {[e for e in USES if e]}", file=sys.stderr)
        return 2
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for extra in extras:
            t0 = time.monotonic()
            ok, what = check(extra, Path(tmp))
            failed += not ok
            print(
                f"{'ok  ' if ok else 'FAIL'} powertrain{f'[{extra}]' if extra else ''}: {what} "
                f"({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
