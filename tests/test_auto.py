"""``powersgd:rank=auto``: the choice from the link and the backward time, the link measured on emulated networks,
and the command choosing once and keeping its choice on resume."""

from __future__ import annotations

import json
import sys

import pytest

from cli_utils import run_cli
from powertrain.bench.netem import EmulatedCluster
from powertrain.compress.auto import RANKS, Link, choose
from powertrain.models import GPT, GPTConfig
from powertrain.train.config import parse_compressor

BACKWARD_S = 0.35  # the default GPT's backward pass on this machine (2 threads) is about this long


def _default_gpt() -> GPT:
    return GPT(GPTConfig(256, 128, 4, 4, 256))  # powertrain train's default model


def _choices(links: dict[str, Link]) -> dict[str, tuple[str, int | None]]:
    model = _default_gpt()
    out = {}
    for key, link in links.items():
        c = choose(model.named_parameters(), backward_s=BACKWARD_S, link=link)
        name, options = parse_compressor(c.spec)  # the choice is a spec the command accepts
        assert name == c.name and options.items() >= c.options.items(), (c.spec, options)
        assert c.reason.startswith("rank=auto chose"), c.reason
        out[key] = (c.name, c.options.get("rank"))
    return out


def test_choice_follows_the_link():
    """3.3M parameters: bf16 all-reduce sends 6.6 MB. At 8 Gbit/s that takes 7 ms and hides behind backward; at
    100 Mbit/s (12.5 MB/s) it takes 0.53 s, so a PowerSGD rank whose message takes < 0.35 s is chosen; at 10 Mbit/s
    ten times less fits; at 1 Mbit/s nothing hides and the smallest rank is chosen."""
    mb = 1e6 / 8  # bytes per second in one Mbit/s
    got = _choices(
        {rate: Link(rate * mb, 3e-4, 2) for rate in (8000, 100, 10, 1)} | {"4 ranks": Link(100 * mb, 3e-4, 4)}
    )
    assert got[8000] == ("bf16", None)
    assert got[100][0] == got[10][0] == got[1][0] == "powersgd"
    assert RANKS[0] >= got[100][1] > got[10][1] > got[1][1] == RANKS[-1], got
    assert got["4 ranks"][1] <= got[100][1], "a ring of 4 sends 1.5x what a ring of 2 does per rank"


def test_choice_respects_the_users_other_options():
    model = _default_gpt()
    c = choose(
        model.named_parameters(),
        backward_s=BACKWARD_S,
        link=Link(1.25e6, 3e-4, 2),
        options={"start_compressing_after_num_steps": 7},
    )
    assert c.options["start_compressing_after_num_steps"] == 7 and c.options["factor_dtype"] == "bf16"
    c = choose(
        model.named_parameters(), backward_s=BACKWARD_S, link=Link(1.25e6, 3e-4, 2), options={"variant": "alternating"}
    )
    assert c.options["variant"] == "alternating" and c.options["factor_dtype"] == "fp32"


def test_rank_auto_checks_its_other_options_at_once():
    """The rank is chosen later, in each run; everything else of the spec is refused now, naming the problem."""
    assert parse_compressor("powersgd:rank=auto")[1]["rank"] == "auto"
    with pytest.raises(ValueError, match="factor_dtype='bf16' needs variant='paper'"):
        parse_compressor("powersgd:rank=auto,variant=alternating,factors=bf16")
    with pytest.raises(ValueError, match=r"Config\.num_iters_per_step=0"):
        parse_compressor("powersgd:rank=auto,iters=0")


_PROBE = """
import json, os, torch.distributed as dist
from powertrain.comm import Communicator
from powertrain.compress.auto import measure_link
dist.init_process_group("gloo")
link = measure_link(Communicator())
print(json.dumps({"bytes_per_s": link.bytes_per_s, "latency_s": link.latency_s}), flush=True)
os._exit(0)  # a group with peers is not destroyed (powertrain.train.launch.leave_world)
"""


def _measure(rate: float | None) -> list[dict[str, float]]:
    with EmulatedCluster(2, rate) as cluster:
        procs = [cluster.spawn(r, [sys.executable, "-c", _PROBE]) for r in range(2)]
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err[-2000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


@pytest.mark.netem
@pytest.mark.timeout(120)
def test_measured_link_picks_smaller_ranks_on_slower_links():
    """The probe measures what tbf allows, and the choice made from it follows: bf16 unthrottled, a smaller rank at
    10 Mbit/s than at 100 Mbit/s. Both ranks measure the same (they agree before choosing). Bound: tbf's payload
    rate is the line rate / FRAMING (1.046) and a 1 MB probe sees a bucket's burst and TCP's ramp-up: within 25%."""
    measured = {rate: _measure(rate) for rate in (None, 100, 10)}
    for runs in measured.values():
        assert runs[0] == runs[1], "every rank must see the same figures"
    for rate in (100, 10):
        mbit = 8 * measured[rate][0]["bytes_per_s"] / 1e6
        assert 0.75 * rate < mbit < 1.25 * rate, (rate, mbit)
    assert 8 * measured[None][0]["bytes_per_s"] / 1e6 > 1000
    got = _choices({rate: Link(m[0]["bytes_per_s"], m[0]["latency_s"], 2) for rate, m in measured.items()})
    assert got[None] == ("bf16", None)
    assert got[10][0] == got[100][0] == "powersgd" and got[10][1] < got[100][1], got


def test_the_command_chooses_once_and_keeps_its_choice(tmp_path):
    """It says what it chose and why; checkpoints and the summary record the choice, and a resume continues with
    it instead of measuring again."""
    out = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--parallel", "ddp", "--compressor", "powersgd:rank=auto,start=2", "--quiet"]
    r = run_cli(*args, "--steps", "4", "--checkpoint-every", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("rank=auto chose") == 1, r.stdout
    chosen = json.loads((out / "summary.json").read_text())["compressor"]
    assert "auto" not in chosen and parse_compressor(chosen)
    r = run_cli(*args, "--steps", "6", "--out", str(out), "--resume", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rank=auto chose" not in r.stdout, "a resume keeps the first choice"
    assert json.loads((out / "summary.json").read_text())["compressor"] == chosen
