"""The on-paper GPU cluster model (tools/gpu_cluster.py): its communication time against the ring
formulas its section states."""

from __future__ import annotations

import sys

import pytest

from gpu_cluster import ALPHA_S, GPUS, NVLINK_BPS, comm_s

EPS = sys.float_info.epsilon
MB, GBIT = 1e6, 1e9


def close(x: float) -> object:
    return pytest.approx(x, rel=8 * EPS, abs=0)  # a few roundings of doubles, 2x safety


def ring_all_reduce(payload: float, world: int, bps: float, alpha: float, collectives: int = 1) -> float:
    return 2 * (world - 1) / world * payload * 8 / bps + collectives * 2 * (world - 1) * alpha


def test_flat_rings_cross_the_link_between_nodes():
    # bf16: one ring of W = 16 GPUs; the link carries 2 (W-1)/W of the payload in 2 (W-1) messages
    assert comm_s("bf16", MB, 0, 2, GBIT, False) == close(ring_all_reduce(MB, 16, GBIT, ALPHA_S))
    # PowerSGD: P, Q and the exactly sent tensors, three collectives, each paying its messages' latency
    assert comm_s("PowerSGD r32", MB, 0, 2, GBIT, False) == close(ring_all_reduce(MB, 16, GBIT, ALPHA_S, 3))
    # int8 all-gathers: (W-1) times its payload in W-1 messages
    assert comm_s("int8", MB, 0, 2, GBIT, False) == close(15 * MB * 8 / GBIT + 15 * ALPHA_S)


def test_hierarchical_adds_nvlink_inside_and_rings_of_nodes_between():
    nvlink = lambda payload: 2 * (GPUS - 1) / GPUS * payload * 8 / NVLINK_BPS  # an all-reduce's bytes, no alpha
    between = ring_all_reduce(MB, 2, GBIT, ALPHA_S)
    assert comm_s("bf16", MB, 0, 2, GBIT, True) == close(nvlink(MB) + between)
    # the compressors: an exact fp32 mean of all parameters inside the node, then the owners' results gathered
    params = 1000
    exact = 4.0 * params
    inside = nvlink(exact) + (GPUS - 1) * exact / GPUS * 8 / NVLINK_BPS
    assert comm_s("PowerSGD r32", MB, params, 2, GBIT, True) == close(inside + ring_all_reduce(MB, 2, GBIT, ALPHA_S, 3))
