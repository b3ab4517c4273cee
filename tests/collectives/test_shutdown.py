"""shutdown() ends the worker threads after their queued calls, and async calls work again after
it; a group destroyed without it leaves no thread or descriptor behind."""
import os
import threading
import time
from datetime import timedelta

import pytest
import torch

from ranks import run_ranks


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


def _counts():
    return threading.active_count(), len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def _within(counts, baseline):
    """No more threads or descriptors than at the start (fewer is fine: a native thread of the
    first group, still ending when the baseline was taken, may be gone since)."""
    return all(c <= b for c, b in zip(counts, baseline))


def _cycles_without_shutdown(rank, w, folder):
    import torch.distributed as dist

    from gradcomp.collectives import allreduce, worker
    from gradcomp.training import shutdown

    shutdown()
    dist.destroy_process_group()
    baseline, settled = _counts(), []
    for cycle in range(3):
        store = dist.FileStore(os.path.join(folder, f"cycle{cycle}"), w)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=w, timeout=timedelta(seconds=30))
        allreduce(torch.ones(10), "fp16", key="k", async_op=True).wait()  # the collectives' worker and twin
        training = worker.worker_for((None, dist.new_group([0, 1][:w])))  # a training-style worker of two groups
        training.submit(lambda twin: dist.barrier(group=twin(None)), device=torch.device("cpu")).wait()
        del training  # what the program holds it keeps; the library must hold nothing
        dist.destroy_process_group()  # shutdown() forgotten
        deadline = time.monotonic() + 5
        while not _within(_counts(), baseline) and time.monotonic() < deadline:
            time.sleep(0.05)
        settled.append(_counts())
    store = dist.FileStore(os.path.join(folder, "last"), w)  # the helper destroys one group at the end
    dist.init_process_group("gloo", store=store, rank=rank, world_size=w, timeout=timedelta(seconds=30))
    return baseline, settled


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts threads and descriptors in /proc")
def test_destroying_the_group_without_shutdown_leaks_nothing(tmp_path):
    """Threads (Python and native) and file descriptors return to at most what they were
    before the first init within a few seconds of each destroy_process_group, cycle after cycle."""
    for baseline, settled in run_ranks(_cycles_without_shutdown, 2, tmp_path, str(tmp_path)):
        assert all(_within(c, baseline) for c in settled) and len(settled) == 3, f"(python threads, threads, fds): before {baseline}, after each cycle {settled}"
