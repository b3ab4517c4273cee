"""The collectives in one process, without a process group: a local round trip through the
same code, the algorithm choice from capability flags, argument errors, bucketing plans and
telemetry. (Multi-rank guarantees: test_collectives_dist.py.)"""
from __future__ import annotations

import copy

import pytest
import torch

from gradcomp.collectives import (ALGORITHMS, allreduce, allreduce_buckets, choose_algorithm, make_node_groups,
                                  plan_buckets, recv, reset_telemetry, send, server_feedback, telemetry)
from gradcomp.compress import (EF21, Capabilities, Compressor, DGCMomentum, ErrorFeedback, available_compressors,
                               get_compressor)
from gradcomp.compress.none import NoCompression
from gradcomp.compress.powersgd import _local

NAMES = available_compressors()


def _suitable(name):
    c = get_compressor(name)
    return [a for a, cls in ALGORITHMS.items() if cls.unsuitable(c) is None]




@pytest.mark.parametrize("name", NAMES)
def test_one_process_is_a_local_round_trip(name):
    """Mean of one rank = what the compressor itself makes of the tensor; input untouched."""
    for algo in _suitable(name):
        for shape, dtype in [((33, 17), torch.float32), ((6,), torch.float16), ((), torch.float64), ((0, 3), torch.bfloat16)]:
            t = torch.randn(shape, dtype=torch.float64).to(dtype)
            before = t.clone()
            out = allreduce(t, get_compressor(name), key="k", algorithm=algo)
            assert torch.equal(t, before), f"{name}/{algo} wrote to its input"
            assert out.shape == t.shape and out.dtype == t.dtype
            if t.numel():
                assert out.data_ptr() != t.data_ptr()
            c = get_compressor(name)
            if algo == "rounds":
                expected = _local(c.rounds(t, "k"))
            elif algo == "scatter-reduce":  # one flat chunk, compressed twice
                once = c.decompress(c.compress(t.reshape(-1), "k/chunk0"))
                expected = c.decompress(c.compress(once, "k/chunk0/server")).reshape(shape)
            else:
                expected = c.decompress(c.compress(t, "k"))
            assert torch.equal(out, expected.to(dtype)), f"{name}/{algo}: not the local round trip"


def test_async_without_process_group_is_a_completed_future():
    t = torch.randn(10)
    fut = allreduce(t, "fp16", async_op=True)
    assert fut.done() and torch.equal(fut.wait(), t.half().float())
    assert torch.equal(fut.then(lambda f: f.value() * 2).wait(), t.half().float() * 2)
    bad = allreduce(torch.ones(3, dtype=torch.int64), "fp16", async_op=True)
    with pytest.raises(ValueError, match="dtype"):
        bad.wait()


def test_world_size_from_a_launcher_without_a_process_group_is_an_error(monkeypatch):
    """torchrun sets WORLD_SIZE; without init_process_group a local round trip would silently
    leave every rank with its own tensor."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for call in (lambda: allreduce(torch.ones(3), "fp16"), lambda: allreduce(torch.ones(3), "fp16", async_op=True).wait()):
        with pytest.raises(ValueError, match="WORLD_SIZE=2 says this process is one of 2, but torch.distributed is not"):
            call()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert torch.equal(allreduce(torch.ones(3), "fp16"), torch.ones(3))


def test_the_default_key_warns_once_when_two_tensors_share_its_state():
    """Without key= every tensor shares one residual: warned once per wrapper when a second
    tensor, alive beside the first, comes through; a tensor made anew each step is not warned
    about, nor a compressor that keeps no state beyond step counters, nor an explicit key."""
    import warnings

    ef, a, b = ErrorFeedback("topk"), torch.randn(100), torch.randn(100)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            allreduce(torch.randn(100), ef)  # the step's new gradient; the old one is gone
            allreduce(a, ef)
            allreduce(a.view(10, 10).view(-1), ef)  # the same memory
        for _ in range(2):
            allreduce(a, "topk")
            allreduce(b, "topk")
            allreduce(a, ef, key="a")
            allreduce(b, ef, key="b")
        assert not caught, [str(w.message) for w in caught]
        for _ in range(2):
            allreduce(a, ef)
            allreduce(b, ef)
        powersgd = get_compressor("powersgd")  # its warm start is kept per key too
        allreduce(a, powersgd)
        allreduce(b, powersgd)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and all("pass key= naming each tensor" in m for m in messages), messages
    assert "ErrorFeedback" in messages[0] and "powersgd" in messages[1]
    assert all(w.filename == __file__ for w in caught), "the warning should point at the caller"


def _flags(native: bool, multi_round: bool) -> Compressor:
    """Unregistered stand-in: only the declared capabilities matter to the choice."""

    class Flags(NoCompression):
        name = "flags"
        capabilities = Capabilities(native=native, multi_round=multi_round)

    return Flags()


@pytest.mark.parametrize("native,multi_round,world,expected", [
    (True, False, 2, "native"), (True, False, 8, "native"), (False, True, 4, "rounds"), (True, True, 4, "rounds"),
    (False, False, 1, "allgather"), (False, False, 2, "allgather"), (False, False, 3, "scatter-reduce"),
    (False, False, 64, "scatter-reduce"),
])
def test_algorithm_follows_capability_flags(native, multi_round, world, expected):
    c = _flags(native, multi_round)
    assert choose_algorithm(c, world) == expected
    assert choose_algorithm(ErrorFeedback(c), world) == expected


def test_impossible_pairings_and_bad_arguments_are_value_errors():
    non_native = next(n for n in NAMES if not get_compressor(n).native and not get_compressor(n).multi_round)
    with pytest.raises(ValueError, match="does not declare native=True"):
        allreduce(torch.ones(4), non_native, algorithm="native")
    with pytest.raises(ValueError, match="does not declare multi_round=True"):
        allreduce(torch.ones(4), "fp16", algorithm="rounds")
    with pytest.raises(ValueError, match="allowed"):
        allreduce(torch.ones(4), "fp16", algorithm="ring")
    with pytest.raises(ValueError, match="compressor must be"):
        allreduce(torch.ones(4), 3.5)
    with pytest.raises(ValueError, match="unknown compressor"):
        allreduce(torch.ones(4), "zip")
    with pytest.raises(ValueError, match="dtype"):
        allreduce(torch.ones(4, dtype=torch.int32), "none")
    with pytest.raises(ValueError, match="torch.Tensor"):
        allreduce([1.0, 2.0], "none")
    with pytest.raises(ValueError, match="not initialised"):
        allreduce(torch.ones(4), "none", group=object())
    with pytest.raises(ValueError, match="both"):
        allreduce(torch.ones(4), "none", intra_group=object())
    with pytest.raises(ValueError, match="process group"):
        send(torch.ones(3), 1, "fp16")
    with pytest.raises(ValueError, match="process group"):
        recv(1, "fp16")
    with pytest.raises(ValueError, match="process group"):
        make_node_groups(2)
    with pytest.raises(ValueError, match="True or False"):
        allreduce(torch.ones(4), "none", measure_error="yes")


def test_feedback_wrappers_keep_their_invariants_through_allreduce():
    g = [torch.randn(40, 8) for _ in range(3)]
    ef, ref = ErrorFeedback("topk"), ErrorFeedback("topk")
    for x in g:  # one process: allreduce == the wrapper's own compress/decompress
        assert torch.equal(allreduce(x, ef, key="w", algorithm="allgather"), ref.decompress(ref.compress(x, key="w")))
        assert torch.equal(ef.residual("w"), ref.residual("w"))
    ef21, ref21 = EF21("onebit"), EF21("onebit")
    for x in g:
        expected = ref21.combine("w", ref21.decompress(ref21.compress(x, key="w")))
        assert torch.allclose(allreduce(x, ef21, key="w"), expected, atol=1e-6)
    dgc = DGCMomentum(get_compressor("topk", ratio=0.1), momentum=0.0)  # no momentum: plain residual memory
    total_in, total_out = torch.zeros(40, 8), torch.zeros(40, 8)
    for x in g:
        total_in += x
        total_out += allreduce(x, dgc, key="w")
    assert torch.allclose(total_out + dgc.residual("w"), total_in, atol=1e-5), "DGC feedback lost gradient mass"


def test_scatter_reduce_server_feedback_is_kept_per_key_and_resumable():
    ef = ErrorFeedback("topk")
    for step in range(2):
        allreduce(torch.randn(50), ef, key="s", algorithm="scatter-reduce")
    server = server_feedback(ef)
    assert server.residual("s/chunk0/server").shape == (50,)
    sd = server.state_dict()
    other = ErrorFeedback("topk")
    server_feedback(other).load_state_dict(sd)
    assert torch.equal(server_feedback(other).residual("s/chunk0/server"), server.residual("s/chunk0/server"))
    with pytest.raises(ValueError, match="error-feedback"):
        server_feedback(get_compressor("topk"))


def test_error_feedback_owns_its_server_residuals_owes_and_gives_them_back():
    """The wrapper holds scatter-reduce's server residuals: ``owed`` adds them (``w`` times, at
    their chunk: one chunk on one process) to the residual, ``take`` empties both, a copy of the
    wrapper owes the same, and the server part's ``state_dict`` says where its residuals sit."""
    ef = ErrorFeedback("topk")
    for step in range(2):
        allreduce(torch.randn(5, 10), ef, key="s", algorithm="scatter-reduce")
    # on one process the average's recompression is exact: give the server part something to owe
    server_feedback(ef).update("s/chunk0/server", torch.randn(50), torch.zeros(50))
    res, sres = ef.residual("s"), server_feedback(ef).residual("s/chunk0/server")
    assert res.shape == (5, 10) and sres.shape == (50,) and sres.any()
    owed = ef.owed("s")
    assert torch.equal(owed, res + sres.view(5, 10)) and ef.owed("nothing") is None
    assert torch.equal(ef.owed("s", torch.float64), res.double() + sres.double().view(5, 10))
    assert torch.equal(copy.deepcopy(ef).owed("s"), owed), "a copy of the wrapper owes what it owes"
    other = ErrorFeedback("topk")  # a resumed run: one state holds the residuals and the server part's
    other.load_state_dict(ef.state_dict())
    assert "server" in ef.state_dict()
    assert torch.equal(other.owed("s"), owed)
    assert torch.equal(server_feedback(other).residual("s/chunk0/server"), sres)
    taken = other.take("s")
    assert torch.equal(taken, owed) and not other.owed("s").any()
    assert not other.residual("s").any() and not server_feedback(other).residual("s/chunk0/server").any()
    assert torch.equal(ef.owed("s"), owed), "another wrapper's take left this one alone"
    # a server state saved without where its residuals sit: they load, and are owed again once
    # an exchange of their key has said where they sit
    third = ErrorFeedback("topk")
    third.load_state_dict(ef.state_dict())
    server_feedback(third).load_state_dict({k: v for k, v in server_feedback(ef).state_dict().items() if k != "layouts"})
    assert torch.equal(third.owed("s"), res) and torch.equal(server_feedback(third).residual("s/chunk0/server"), sres)
    allreduce(torch.zeros(5, 10), third, key="s", algorithm="scatter-reduce")
    assert "s/chunk0/server" in server_feedback(third)._layouts["s"]


def test_plan_buckets_groups_by_dtype_caps_size_and_keeps_order():
    ts = [("a", torch.zeros(100)), ("b", torch.zeros(100, dtype=torch.float16)), ("c", torch.zeros(200)),
          ("d", torch.zeros(10)), ("e", torch.zeros(1000)), ("f", torch.zeros(5, dtype=torch.float16))]
    cap = 1200 / 2**20  # 1200 bytes: 300 fp32 elements
    assert plan_buckets(ts, cap) == [[0, 2], [3], [4], [1, 5]]
    assert plan_buckets(ts, 100.0) == [[0, 2, 3, 4], [1, 5]]
    with pytest.raises(ValueError, match="bucket_mb"):
        plan_buckets(ts, 0)


def test_buckets_equal_per_tensor_results_locally():
    named = {f"p{i}": torch.randn(s) for i, s in enumerate([(3, 4), (5,), (), (0,), (7, 2)])}
    before = {n: t.clone() for n, t in named.items()}
    got = allreduce_buckets(named, "fp16", bucket_mb=1e-4)
    assert list(got) == list(named)
    for n, t in named.items():
        assert torch.equal(t, before[n]) and got[n].shape == t.shape
        assert torch.equal(got[n], t.half().float())
    fut = allreduce_buckets(named, "fp16", bucket_mb=1e-4, async_op=True)
    assert all(torch.equal(fut.wait()[n], got[n]) for n in named)
    with pytest.raises(ValueError, match="unique"):
        allreduce_buckets([("a", torch.ones(1)), ("a", torch.ones(1))])


def test_telemetry_counts_calls_and_times_and_resets():
    reset_telemetry()
    t = torch.randn(1000)
    allreduce(t, "fp16", key="t")
    allreduce(t, "onebit", key="t", measure_error=True)
    tel = telemetry()
    assert set(tel["by_op"]) == {"allreduce/native", "allreduce/allgather"}
    native = tel["by_op"]["allreduce/native"]
    assert native["calls"] == 1 and native["bytes_sent"] == 0 and native["dense_bytes"] == 4000
    assert native["payload_bytes"] == 2000 and native["ratio"] == 2.0 and "rel_error" not in native
    last = tel["last"]
    assert last["compressor"] == "onebit" and last["world_size"] == 1 and last["ratio"] > 20
    assert 0 < last["rel_error"] < 1 and 0 < last["cos_sim"] <= 1
    assert tel["total"]["calls"] == 2 and tel["total"]["compress_s"] > 0
    reset_telemetry()
    assert telemetry() == {"by_op": {}, "total": telemetry()["total"], "last": None}
    assert telemetry()["total"]["calls"] == 0
