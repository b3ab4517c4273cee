"""Batched point-to-point (``collectives.p2p.batch_send_recv``) on 2 real gloo ranks, under the
strict NCCL mode (pairs matched in issue order, tags ignored), and the wire's
:class:`~gradcomp.collectives.wire.layouts.LayoutCache` (what the pipeline's transport posts
and learns with).

Invariants protected:

- a batch posts its operations in the list's order: a pair's sends arrive in the receives the
  other end listed in the same order, whatever their dtypes and sizes, both directions of a
  pair in one batch, batch after batch;
- the works say which completes each operation; waiting them all completes the batch;
- telemetry counts the sends' bytes as sent and the receives' as received (``"p2p/batch"``);
- an operation that is neither a send nor a receive, or whose peer is this rank or no rank, is
  refused before anything is posted; an empty batch posts nothing;
- a layout cache learns a channel's layout only from an exchange in which every message on it
  had the same one, replaces it from the next exchange that learns, and forgets on request.
"""
from __future__ import annotations

import pytest
import torch

from ranks import run_ranks


def _batches(rank, w):
    from gradcomp.collectives import reset_telemetry, telemetry
    from gradcomp.collectives.p2p import P2P, batch_send_recv

    peer = 1 - rank
    out = {}
    reset_telemetry()
    # one batch, both directions of the pair, several tensors each way (different dtypes and sizes)
    mine = [torch.arange(5, dtype=torch.float32) + 10 * rank, torch.arange(3, dtype=torch.int64) - rank,
            torch.full((7,), rank, dtype=torch.uint8)]
    theirs = [torch.empty(5), torch.empty(3, dtype=torch.int64), torch.empty(7, dtype=torch.uint8)]
    if rank == 0:  # the sends first on rank 0, the receives first on rank 1: the order per direction matches
        ops = [P2P("send", t, peer) for t in mine] + [P2P("recv", t, peer) for t in theirs]
    else:
        ops = [P2P("recv", t, peer) for t in theirs] + [P2P("send", t, peer) for t in mine]
    batch = batch_send_recv(ops)
    out["works"] = (len(batch.works), [batch.index(i) for i in range(len(ops))])
    batch.wait()
    out["received"] = theirs
    # same-sized messages in a row: matched in order, not by size; batch after batch
    got = []
    for step in range(3):
        if rank == 0:
            b = batch_send_recv([P2P("send", torch.full((4,), float(step * 2 + j)), peer) for j in range(2)])
        else:
            bufs = [torch.empty(4), torch.empty(4)]
            b = batch_send_recv([P2P("recv", t, peer) for t in bufs])
        b.wait()
        assert b.is_completed()
        if rank == 1:
            got.append([t[0].item() for t in bufs])
    out["in order"] = got
    out["telemetry"] = telemetry()["by_op"].get("p2p/batch")
    # refused before anything is posted
    errors = []
    for bad in (P2P("send", torch.ones(1), rank), P2P("send", torch.ones(1), w), P2P("put", torch.ones(1), peer)):
        try:
            batch_send_recv([bad])
            errors.append("posted")
        except ValueError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    empty = batch_send_recv([])
    out["empty"] = (empty.works, empty.is_completed())
    # the pair is still in step after the refusals
    t = torch.tensor([float(rank)])
    r = torch.empty(1)
    batch_send_recv([P2P("send", t, peer), P2P("recv", r, peer)] if rank == 0 else
                    [P2P("recv", r, peer), P2P("send", t, peer)]).wait()
    out["after"] = r.item()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_batches, 2, tmp_path_factory.mktemp("p2p_batch"), timeout_s=60)


def test_batch_matches_a_pairs_operations_in_order(results):
    for rank, res in enumerate(results):
        peer = 1 - rank
        a, b, c = res["received"]
        assert torch.equal(a, torch.arange(5, dtype=torch.float32) + 10 * peer)
        assert torch.equal(b, torch.arange(3, dtype=torch.int64) - peer)
        assert torch.equal(c, torch.full((7,), peer, dtype=torch.uint8))
        assert res["after"] == float(peer)
    assert results[1]["in order"] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_batch_works_and_telemetry(results):
    for res in results:
        count, index = res["works"]
        assert index == ([0, 1, 2, 3, 4, 5] if count == 6 else [count - 1] * 6)
        tel = res["telemetry"]
        assert tel["calls"] == 4  # the first batch and three in a row
    first = 5 * 4 + 3 * 8 + 7
    assert results[0]["telemetry"]["bytes_sent"] == first + 3 * 2 * 16
    assert results[0]["telemetry"]["bytes_recv"] == first
    assert results[1]["telemetry"]["bytes_sent"] == first
    assert results[1]["telemetry"]["bytes_recv"] == first + 3 * 2 * 16


def test_batch_refuses_bad_operations(results):
    for res in results:
        self_peer, no_rank, kind = res["errors"]
        assert "must be another rank in [0, 2)" in self_peer
        assert "must be another rank in [0, 2)" in no_rank
        assert "'send' or a 'recv'" in kind
        assert res["empty"] == ([], True)


def test_layout_cache_learns_one_layout_per_channel():
    from gradcomp.collectives.wire.layouts import LayoutCache

    cache = LayoutCache()
    assert cache.knows([]) and not cache.knows(["a"])
    cache.begin(learn=False)  # an exchange that does not learn notes nothing
    cache.note("a", 1)
    cache.end()
    assert "a" not in cache
    cache.begin(learn=True)
    for ch, layout in (("a", 1), ("a", 1), ("b", 2), ("b", 3), ("b", 2)):
        cache.note(ch, layout)
    cache.end()
    assert cache.knows(["a"]) and cache["a"] == 1 and "b" not in cache  # b's messages had two layouts
    assert not cache.learning
    cache.begin(learn=True)  # a later exchange replaces what it shows, per channel it used
    cache.note("b", 4)
    cache.end()
    assert cache["a"] == 1 and cache["b"] == 4
    cache.begin(learn=True)
    cache.note("a", 5)
    cache.note("a", 6)
    cache.end()
    assert "a" not in cache and cache["b"] == 4  # a mixed exchange forgets the channel's layout
    cache.forget()
    assert not cache.knows(["b"])
