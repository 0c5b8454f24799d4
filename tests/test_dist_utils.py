"""The multi-process harness itself: a rank that dies by a signal, or hangs, fails the test with its Python stack."""

from __future__ import annotations

import os
import time

import pytest

from dist_utils import RankFailed, run_ranks


def _abort_on_last(rank: int, world: int) -> int:
    if rank == world - 1:
        _dies_in_cpp()
    return rank


def _dies_in_cpp() -> None:
    os.abort()  # as a C++ abort ("malloc(): ... detected", "terminate called ...") ends a rank: SIGABRT, no traceback


def _raises_on_first_then_peer_aborts(rank: int, world: int) -> int:
    import torch.distributed as dist

    if rank == 0:
        time.sleep(0.3)
        raise ValueError("the failure itself, on rank 0")
    try:
        dist.barrier()  # fails on rank 0's reset connection
    except Exception:
        time.sleep(0.5)
        _dies_in_cpp()  # a consequence, as a gloo thread's terminate after a peer's death would be
    return rank


def _hangs_on_first(rank: int, world: int) -> int:
    if rank == 0:
        _waits_forever()
    return rank


def _waits_forever() -> None:
    while True:
        time.sleep(0.1)


def test_a_rank_killed_by_a_signal_shows_its_python_stack():
    with pytest.raises(RankFailed) as info:
        run_ranks(_abort_on_last, 2, timeout=60)
    text = str(info.value)
    assert text.startswith("ranks [1] killed by a signal") and "rank 1: Python stacks at the signal" in text, text
    assert "_dies_in_cpp" in text and "_abort_on_last" in text, text
    assert "rank 0: Python stacks" not in text, text  # killed by the runner: not the story
    assert "Extension modules" not in text, text


def test_a_rank_killed_by_a_signal_after_a_peer_failed_comes_after_the_peers_error():
    """A rank that aborts after a peer raised (inside the runner's grace) is the consequence: the peer's traceback
    comes first, the abort after it with its stack."""
    with pytest.raises(RankFailed) as info:
        run_ranks(_raises_on_first_then_peer_aborts, 2, timeout=60)
    text = str(info.value)
    assert text.startswith("--- rank 0 ---") and "the failure itself, on rank 0" in text, text
    assert "ranks [1] killed by a signal after a peer failed" in text and "rank 1: Python stacks" in text, text
    assert text.index("the failure itself") < text.index("ranks [1] killed"), text


def test_a_hung_rank_fails_at_the_timeout_with_its_python_stack():
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(_hangs_on_first, 2, timeout=10)  # long enough to start under load
    text = str(info.value)
    assert "timed out after 10s: ranks [0, 1] hung" in text, text
    assert "_waits_forever" in text and "_hangs_on_first" in text, text  # rank 1 waits in the barrier after fn
    assert "killed by a signal" not in text, text  # the runner's SIGABRT is not a rank's own death
    assert time.monotonic() - start < 40


def test_a_rank_still_running_when_a_peer_fails_shows_where_it_waits():
    """The usual hang: a peer's collective times out (pg_timeout) long before the run's timeout, and the rank it
    waited for is the one to look at."""
    with pytest.raises(RankFailed) as info:
        run_ranks(_hangs_on_first, 2, timeout=120, pg_timeout=3)
    text = str(info.value)
    assert text.startswith("--- rank 1 ---"), text  # the peer's own error first
    assert "ranks [0] were still running when the run failed" in text and "_waits_forever" in text, text
