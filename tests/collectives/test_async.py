"""The async worker on real gloo ranks: a call made and waited on inside a ``.then()`` callback
that runs on the worker completes (it runs at once there instead of waiting for the worker
itself), and a first async call made on one rank only fails as a ``CommunicationError``."""
import threading

import torch

from ranks import run_ranks


def _waits_inside_callback(rank, w):
    from gradcomp.collectives import allreduce, worker

    release = threading.Event()
    # hold the worker so that .then() below is attached before the call completes: the
    # callback then runs on the worker thread, on every rank
    worker.submit(lambda eff: release.wait(30), (None,), True)
    first = allreduce(torch.full((8,), float(rank)), "fp16", key="first", async_op=True)

    def inner(fut):
        return allreduce(fut.value() + 1, "fp16", key="inner", async_op=True).wait()

    chained = first.then(inner)
    done = threading.Event()
    chained.add_done_callback(lambda _: done.set())
    release.set()
    if not done.wait(20):
        return "deadlock: the callback's async call never completed"
    after = allreduce(torch.full((2,), float(rank)), "fp16", key="after", async_op=True).wait()
    return chained.value(), after


def test_an_async_call_waited_on_inside_a_callback_completes(tmp_path):
    for result in run_ranks(_waits_inside_callback, 2, tmp_path):
        assert not isinstance(result, str), result
        inner, after = result
        assert torch.equal(inner, torch.full((8,), 1.5)) and torch.equal(after, torch.full((2,), 0.5))


def _first_async_on_one_rank(rank, w):
    from gradcomp.collectives import allreduce

    if rank == 1:
        return None  # never makes the call: rank 0's worker cannot make its twin group
    try:
        allreduce(torch.ones(4), "fp16", key="lonely", async_op=True).wait()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error"


def test_a_first_async_call_on_one_rank_only_is_a_communication_error(tmp_path):
    result = run_ranks(_first_async_on_one_rank, 2, tmp_path, timeout_s=5)[0]
    assert result[0] == "CommunicationError", result
    assert "first async call" in result[1] and "rank 0" in result[1], result[1]
