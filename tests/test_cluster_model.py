"""The on-paper cluster model of ``powertrain bench cluster``: its arithmetic against the ring formulas it states."""

from __future__ import annotations

import sys

import pytest

from powertrain.bench.cluster import ALPHA_S, NVLINK_BPS, _comm_s, _payloads, scale_model

EPS = sys.float_info.epsilon


def test_ring_formulas():
    close = lambda x: pytest.approx(x, rel=8 * EPS, abs=0)  # a few roundings of doubles, 2x safety
    mb, gbit = 1e6, 1e9
    # flat: one ring of W = 16 GPUs; the link between nodes carries 2 (W-1)/W of the payload in 2 (W-1) messages
    assert _comm_s(mb, 2, 8, gbit, False) == close(2 * 15 / 16 * mb * 8 / gbit + 30 * ALPHA_S)
    # hierarchical: NVLink inside, then rings of N = 2 nodes sharing the node's link
    inside = 2 * 7 / 8 * mb * 8 / NVLINK_BPS
    assert _comm_s(mb, 2, 8, gbit, True) == close(inside + 2 * 1 / 2 * mb * 8 / gbit + 2 * ALPHA_S)
    # one GPU per node: nothing inside, the same ring
    assert _comm_s(mb, 4, 1, gbit, True) == close(_comm_s(mb, 4, 1, gbit, False))


def test_payloads_and_table():
    pay = _payloads(4, 4, 256, 128)  # the default GPT, shapes only
    assert pay["fp32"] == 4 * pay["params"] == 2 * pay["bf16"]
    assert 0 < pay["PowerSGD r32"] < pay["bf16"] / 4  # rank 32 of 256-wide matrices in bf16
    text = scale_model()
    rows = [line for line in text.splitlines() if line.startswith(("| default GPT (", "| GPT 24 x 2048"))]
    assert len(rows) == 2 * 2 * 3 * 3  # models x link rates x cluster sizes x ways to send
