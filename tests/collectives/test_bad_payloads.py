"""A payload that claims another size than the agreed header is refused by name, before
anything is allocated for it (real gloo ranks; rank 0 is made to lie on the wire).

Each receiving rank knows from the agreed header how many elements every payload must hold
(the whole tensor for allgather, chunk j for scatter-reduce); a payload that claims 2**31 - 1
elements (8 GiB of fp32 once decoded) must raise ``ValueError`` naming the sender, not try
to allocate. Under scatter-reduce the failure is reported through the status exchange, so
every rank raises instead of hanging.
"""
from __future__ import annotations

import pytest
import torch

from ranks import run_ranks

HUGE = 2**31 - 1  # still int32 indices for top-k, so only the size is wrong


def _liar(encode):
    from gradcomp.compress import Payload

    def lying_encode(payload, device):
        return encode(Payload(payload.compressor, (HUGE,), payload.dtype, payload.tensors, dict(payload.meta)), device)
    return lying_encode


def _rank_main(rank, world, algorithm):
    from gradcomp.collectives import allgather, allreduce, allreduce_fused, scatter_reduce

    if rank == 0:  # its own result never parses these bytes back
        allgather.encode = _liar(allgather.encode)
        scatter_reduce.encode = _liar(scatter_reduce.encode)
    out = {}
    for what, call in (
            ("single", lambda: allreduce(torch.randn(1000), "topk", key="w", algorithm=algorithm)),
            ("fused", lambda: allreduce_fused([("a", torch.randn(500), "topk"), ("b", torch.randn(300), "topk")],
                                              algorithm=algorithm))):
        try:
            call()
            out[what] = "no error"
        except ValueError as exc:
            out[what] = str(exc)
    # the group is still in step afterwards
    out["after"] = allreduce(torch.full((4,), float(rank)), "none", key="after")
    return out


@pytest.mark.parametrize("world, algorithm", [(2, "allgather"), (3, "scatter-reduce")])
def test_a_payload_of_the_wrong_size_is_refused_by_name(tmp_path, world, algorithm):
    runs = run_ranks(_rank_main, world, tmp_path, algorithm, timeout_s=120)
    for rank, r in enumerate(runs):
        for what in ("single", "fused"):
            if rank == 0 and algorithm == "allgather":
                assert r[what] == "no error", r[what]  # the liar decodes only the others' honest bytes
            elif rank == 0:
                assert "scatter-reduce failed on rank(s) [1, 2]" in r[what], r[what]
            else:
                assert "from rank 0" in r[what] and str(HUGE) in r[what], r[what]
        assert torch.equal(r["after"], torch.full((4,), (world - 1) / 2))


def _p2p_liar(rank, world):
    import torch.distributed as dist

    from gradcomp.collectives import p2p, recv, send
    from gradcomp.collectives.wire.message import compressor_hash, dtype_code, header_tensor
    from gradcomp.compress import get_compressor

    out = {}
    if rank == 0:  # announce payloads of 2**40 and 2**60 bytes, send neither, then an honest one
        for claim in (2**40, 2**60):
            dist.send(header_tensor(p2p._KIND, claim, compressor_hash(get_compressor("topk")), dtype_code(torch.float32),
                                    torch.device("cpu")), 1)
        send(torch.arange(10.0), 1, "topk")
        return out
    for what, bound in (("bounded", 1000), ("unbounded", None)):
        try:
            recv(0, "topk", max_numel=bound)
            out[what] = "no error"
        except Exception as exc:
            out[what] = f"{type(exc).__name__}: {exc}"
    out["after"] = recv(0, "topk", max_numel=1000)
    return out


def test_a_p2p_length_beyond_the_bound_is_refused_before_allocating(tmp_path):
    """``recv(..., max_numel=1000)`` once allocated the 2**40 bytes the sender announced."""
    r = run_ranks(_p2p_liar, 2, tmp_path)[1]
    assert r["bounded"].startswith("ValueError: recv: rank 0 announced a payload of 1099511627776 bytes, more than "
                                   "a payload of at most max_numel=1000 elements"), r["bounded"]
    assert r["unbounded"].startswith("ValueError: recv: rank 0 announced a payload of 1152921504606846976 bytes, "
                                     "more than this machine's memory"), r["unbounded"]
    assert torch.equal(r["after"], torch.zeros(10).index_fill_(0, torch.tensor([9]), 9.0))


def _p2p_refused_then_good(rank, world):
    import torch.distributed as dist

    from gradcomp.collectives import p2p, recv, send
    from gradcomp.collectives.wire.message import compressor_hash, dtype_code, header_tensor
    from gradcomp.compress import get_compressor

    x = torch.arange(20000.0)
    if rank == 0:  # each refused message is followed by a good one on the same pair
        send(x, 1, "none")  # 80 kB, longer than any payload of the receiver's max_numel=10
        send(x[:5], 1, "none")
        send(x, 1, "int8")  # another compressor than the receiver's
        send(x[:6], 1, "none")
        buf = torch.arange(7, dtype=torch.uint8)  # a gradcomp message of another kind, with its payload
        dist.send(header_tensor(p2p._KIND + 1, 7, compressor_hash(get_compressor("none")), dtype_code(torch.float32),
                                torch.device("cpu")), 1)
        dist.send(buf, 1)
        send(x[:7], 1, "none")
        return None
    out = []
    for compressor, bound in (("none", 10), ("none", 10), ("none", None), ("none", None), ("none", None),
                              ("none", None)):
        try:
            out.append(recv(0, compressor, max_numel=bound).tolist())
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_a_refused_p2p_message_is_drained_so_the_next_one_arrives(tmp_path):
    """Item 8 of issue 22: a refused header (length over max_numel, another compressor, another
    kind) once raised without receiving the payload; on NCCL the sender's payload send then
    waits for ever, and under the strict mode (as on NCCL) the next header pairs with it."""
    r = run_ranks(_p2p_refused_then_good, 2, tmp_path)[1]
    too_long, first, other, second, kind, third = r
    assert too_long.startswith("recv: rank 0 announced a payload of ") and "max_numel=10" in too_long, too_long
    assert "received and dropped, so the channel stays in step" in too_long
    assert first == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert "different compressor or options" in other and "received and dropped" in other, other
    assert second == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert "of kind 0, not a send" in kind and "received and dropped" in kind, kind
    assert third == [float(i) for i in range(7)]
