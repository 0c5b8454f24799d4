"""CommStats accounting and the device a group's collectives take (world size 1; the collectives themselves are
tested on real ranks elsewhere, and on NCCL by tests/test_device.py)."""

import pytest
import torch
import torch.distributed as dist

from powertrain import comm
from powertrain.comm import CommStats, collective_device, group_of_its_own


def test_record_and_record_bytes_count_alike_and_combine():
    a, b = CommStats(), CommStats()
    a.record(torch.zeros(10, dtype=torch.float16), "all_gather")  # 20 bytes
    b.record_bytes(20, "all_gather")
    assert (
        (a.bytes_sent, a.num_collectives, a.by_op)
        == (b.bytes_sent, b.num_collectives, b.by_op)
        == (20, 1, {"all_gather": 20})
    )
    b.record_bytes(300, "reduce_scatter", collectives=3)
    b.add_time(comm_s=0.5, compress_s=0.25)
    total = CommStats.combined([a, b])
    assert (total.bytes_sent, total.num_collectives) == (340, 5)
    assert total.by_op == {"all_gather": 40, "reduce_scatter": 300}
    assert (total.comm_s, total.compress_s) == (0.5, 0.25)  # sums of binary fractions: exact
    b.reset()
    assert (b.bytes_sent, b.num_collectives, b.by_op, b.comm_s) == (0, 0, {}, 0.0)


@pytest.fixture
def world_of_one():
    """A gloo world of one in this process, left again afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_collectives_take_the_cpu_under_gloo_and_the_current_cuda_device_under_nccl(world_of_one, monkeypatch):
    """NCCL refuses CPU tensors ("No backend type associated with device type cpu"): tensors made only to be sent
    go to the current CUDA device under NCCL, to the CPU under gloo and without torch.distributed."""
    assert collective_device() == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")  # gloo serves CPU tensors
    assert collective_device() == torch.device("cpu")


def test_collective_device_without_a_process_group():
    assert not dist.is_initialized() and collective_device() == torch.device("cpu")


def test_group_of_its_own_gathers_on_the_default_groups_device(world_of_one, monkeypatch):
    """The ranks' masks are all-gathered on :func:`collective_device` of the default group (under NCCL a CUDA tensor:
    the diloco strategy's first collective failed on a CPU one), and the group made from them holds this rank."""
    asked, seen = [], []
    gather = comm.all_gather_single

    def recording(out, inp, *args, **kwargs):
        seen.append((out.device, inp.device))
        return gather(out, inp, *args, **kwargs)

    def device(group=None):
        asked.append(group)
        return torch.device("cpu")

    monkeypatch.setattr(comm, "all_gather_single", recording)
    monkeypatch.setattr(comm, "collective_device", device)
    own = group_of_its_own()
    assert own is not None and dist.get_process_group_ranks(own) == [0]
    assert asked == [None] and seen == [(torch.device("cpu"), torch.device("cpu"))]


def test_ring_cost_counts_what_each_ring_collective_sends():
    """Per rank, the bytes per payload byte and the messages of a ring: all-reduce 2 (W-1)/W in 2 (W-1), all-gather
    W-1 in W-1, reduce-scatter (W-1)/W in W-1, all-to-all 1 in W-1; nothing at world size 1 (or 0); an unknown
    collective is named at any world size. Every value is exact in binary (W = 4: 1.5 and 0.75)."""
    from powertrain.comm import ring_cost

    assert ring_cost("all_reduce", 4) == (1.5, 6)
    assert ring_cost("all_gather", 4) == (3, 3)
    assert ring_cost("reduce_scatter", 4) == (0.75, 3)
    assert ring_cost("all_to_all", 4) == (1.0, 3)
    assert ring_cost("all_reduce", 2) == (1.0, 2)
    for world in (1, 0):
        assert ring_cost("all_reduce", world) == (0.0, 0)
    for world in (1, 4):
        with pytest.raises(ValueError, match="Unknown collective 'broadcast'"):
            ring_cost("broadcast", world)
