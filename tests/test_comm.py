"""CommStats accounting (world size 1; the collectives themselves are tested on real ranks elsewhere)."""

import torch

from powertrain.comm import CommStats


def test_record_and_record_bytes_count_alike_and_combine():
    a, b = CommStats(), CommStats()
    a.record(torch.zeros(10, dtype=torch.float16), "all_gather")  # 20 bytes
    b.record_bytes(20, "all_gather")
    assert (a.bytes_sent, a.num_collectives, a.by_op) == (b.bytes_sent, b.num_collectives, b.by_op) == (
        20, 1, {"all_gather": 20})  # fmt: skip
    b.record_bytes(300, "reduce_scatter", collectives=3)
    b.add_time(comm_s=0.5, compress_s=0.25)
    total = CommStats.combined([a, b])
    assert (total.bytes_sent, total.num_collectives) == (340, 5)
    assert total.by_op == {"all_gather": 40, "reduce_scatter": 300}
    assert (total.comm_s, total.compress_s) == (0.5, 0.25)  # sums of binary fractions: exact
    b.reset()
    assert (b.bytes_sent, b.num_collectives, b.by_op, b.comm_s) == (0, 0, {}, 0.0)
