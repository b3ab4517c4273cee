"""plan_buckets' element count (bytes_per_element: ShardedOptimizer sizes its buckets in fp32
elements whatever the dtype) and the shards' residual-key builder."""
from __future__ import annotations

import torch

from gradcomp.collectives import plan_buckets
from gradcomp.collectives.shards import piece_key


def test_bytes_per_element_counts_every_element_alike():
    ts = [(f"t{i}", torch.zeros(n, dtype=torch.bfloat16)) for i, n in enumerate([3, 2, 4, 1, 9, 2])]
    assert plan_buckets(ts, 16 / 2**20) == [[0, 1], [2, 3], [4], [5]]  # 8 bf16 elements a bucket
    assert plan_buckets(ts, 16 / 2**20, bytes_per_element=4) == [[0], [1], [2], [3], [4], [5]]
    assert plan_buckets(ts, 24 / 2**20, bytes_per_element=4) == [[0, 1], [2, 3], [4], [5]]  # 6 elements
    assert plan_buckets(ts, 24 / 2**20, bytes_per_element=2) == plan_buckets(ts, 24 / 2**20)


def test_piece_key_is_the_reduce_scatter_rule():
    assert piece_key("g0/b3", 2) == "g0/b3/to2"
