"""shutdown() ends the worker threads after their queued calls, and async calls work again after it."""
import threading

import torch

from dist import run_ranks


def _rank(rank, w):
    from gradcomp.collectives import allreduce, shutdown

    fut = allreduce(torch.full((100,), float(rank)), "fp16", key="s", async_op=True)
    first = fut.wait()
    shutdown()
    alive = [t.name for t in threading.enumerate() if t.name.startswith("gradcomp")]
    again = allreduce(torch.full((100,), float(rank)), "fp16", key="s", async_op=True).wait()
    return first, alive, again


def test_shutdown_stops_workers_and_async_still_works(tmp_path):
    results = run_ranks(_rank, 2, tmp_path)
    for first, alive, again in results:
        assert alive == [], f"worker threads still running after shutdown: {alive}"
        assert torch.equal(first, torch.full((100,), 0.5)) and torch.equal(again, first)
