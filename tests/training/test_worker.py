"""The worker the training runtime uses (the collectives' one): a job submitted (and waited on) from inside a ``.then()``
callback that runs on the worker completes, on real gloo ranks; without a process group, a
launcher's ``WORLD_SIZE`` above 1 is an error, not a silent one-process run."""
import threading

import pytest
import torch
import torch.distributed as dist

from ranks import run_ranks


def _waits_inside_callback(rank, w):
    from gradcomp.collectives.worker import worker_for

    worker = worker_for((None,))
    cpu = torch.device("cpu")
    release = threading.Event()

    def mean(value):
        def job(twin):
            t = torch.full((4,), float(value))
            dist.all_reduce(t, group=twin(None))
            return t / w
        return job

    worker.submit(lambda twin: release.wait(30), device=cpu)  # .then() is attached before the job runs
    first = worker.submit(mean(rank), device=cpu,
                          then=lambda f: worker.submit(mean(f.value()[0] + 1), device=cpu).wait())
    done = threading.Event()
    first.add_done_callback(lambda _: done.set())
    release.set()
    if not done.wait(20):
        return "deadlock: the callback's job never completed"
    return first.value(), worker.submit(mean(rank), device=cpu, inline=True).wait()


def test_a_job_waited_on_inside_a_callback_completes(tmp_path):
    for result in run_ranks(_waits_inside_callback, 2, tmp_path):
        assert not isinstance(result, str), result
        inner, inline = result
        assert torch.equal(inner, torch.full((4,), 1.5)) and torch.equal(inline, torch.full((4,), 0.5))


def test_world_size_from_a_launcher_without_a_process_group_is_an_error(monkeypatch):
    from gradcomp.training import CompressedOptimizer

    model = torch.nn.Linear(3, 2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE=2 .* not initialised; call init_process_group first"):
        CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compressor="topk")
    monkeypatch.setenv("WORLD_SIZE", "1")
    CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compressor="topk")
