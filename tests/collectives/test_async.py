"""The async worker on real gloo ranks, in one shared run:

- a call made and waited on inside a ``.then()`` callback that runs on the worker completes
  (it runs at once there instead of waiting for the worker itself);
- every collective gradcomp issues — async and sync ``allreduce``, ``allreduce_buckets``,
  ``allreduce_fused``, the DDP hook, ``CompressedOptimizer``, ``gradcomp.optim``'s DDP hook and
  ``MomentumExchange.mean``, the agreement checks — runs inside ``on_device`` of its tensors'
  device, on the worker thread as on the caller's (issue 22, item 3: a worker thread's current
  device is GPU 0 whatever the rank);
- gradcomp's own blocking calls (``agree``, ``broadcast_params``, a sync ``allreduce`` on a
  group the worker never took) run after the jobs in flight, never beside them on another
  thread and communicator (item 7), one worker thread serves every group, and ``wait_all()``
  returns once every job submitted has completed;

and a first async call made on one rank only fails as a ``CommunicationError``."""
import threading

import torch

from ranks import run_ranks
from strict import tensors_in

_RECORDED = ("all_reduce", "reduce", "broadcast", "all_gather", "all_to_all_single", "send", "recv",
             "all_gather_object", "broadcast_object_list", "barrier")


def _spy(log):
    """Record (op, thread, device set by on_device or None, tensors' devices) for every
    collective gradcomp's own code issues in this process."""
    import contextlib
    import sys

    import torch.distributed as dist
    from gradcomp.collectives import worker

    local = threading.local()
    real_on = worker.on_device

    @contextlib.contextmanager
    def on_device(device):
        stack = local.__dict__.setdefault("stack", [])
        stack.append(str(torch.device(device)))
        try:
            with real_on(device):
                yield
        finally:
            stack.pop()

    worker.on_device = on_device
    for name in _RECORDED:
        def wrapped(*args, _real=getattr(dist, name), _name=name, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("gradcomp"):
                stack = getattr(local, "stack", [])
                devices = sorted({str(t.device) for t in tensors_in([args, list(kwargs.values())], [])})
                log.append((_name, threading.current_thread().name, stack[-1] if stack else None, devices))
            return _real(*args, **kwargs)
        setattr(dist, name, wrapped)


def _callback(rank):
    from gradcomp.collectives import allreduce, worker

    release = threading.Event()
    # hold the worker so that .then() below is attached before the call completes: the
    # callback then runs on the worker thread, on every rank
    worker.submit(lambda twin: release.wait(30), (None,), True, device=torch.device("cpu"))
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


def _every_layer(rank, w):
    """One small step of every layer that submits work; returns nothing (the spy judges)."""
    import types

    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradcomp.collectives import allreduce, allreduce_buckets, allreduce_fused
    from gradcomp.compress import get_compressor
    from gradcomp.optim.ddp import dense_or_local_hook
    from gradcomp.optim.momentum import MomentumExchange
    from gradcomp.training import CompressedOptimizer, ddp_comm_hook

    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(rank))
    allreduce(x, "fp16", key="a", async_op=True).wait()
    allreduce(x, "fp16", key="s")
    allreduce_buckets({"p": x, "q": x[0]}, "fp16", async_op=True, key_prefix="b/").wait()
    allreduce_fused([("f1", x, "fp16"), ("f2", x[1], "none")], async_op=True).wait()
    MomentumExchange(get_compressor("onebit")).mean(x.reshape(-1))

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))

    m = model()
    opt = CompressedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), "topk", model=m, bucket_mb=1e-4,
                              ratio=0.5)
    m(x).sum().backward()
    opt.step()
    for make in [lambda m: ddp_comm_hook("fp16", model=m),
                 lambda m: (types.SimpleNamespace(wants_dense=lambda: True, display_name="t", process_group=None),
                            dense_or_local_hook)]:
        m = model()
        ddp = DDP(m, bucket_cap_mb=1e-4)
        ddp.register_comm_hook(*make(m))
        ddp(x).sum().backward()


def _after_in_flight(log, rank):
    """Each of gradcomp's blocking calls is issued while a job is queued; it must run after it."""
    import torch.distributed as dist

    from gradcomp.collectives import allreduce, worker
    from gradcomp.training import agree
    from gradcomp.training.wrapper import broadcast_params

    cpu = torch.device("cpu")
    other = dist.new_group([0, 1])  # a group the worker never took
    calls = {"agree": lambda: agree({"field": "same"}, None, "in the test"),
             "broadcast_params": lambda: broadcast_params([torch.nn.Parameter(torch.ones(3))]),
             "sync allreduce on another group": lambda: allreduce(torch.ones(3), "none", key="o", group=other)}
    orders = {}
    for what, call in calls.items():
        release = threading.Event()

        def held(twin, release=release):
            # released at once by the caller's first collective (the old code issued it beside
            # this job), else after a while
            release.wait(1.0)
            allreduce(torch.ones(2), "none", key="held")  # on the worker thread: recorded as such

        start = len(log)
        worker.submit(held, (None,), True, device=cpu)
        watch = threading.Thread(target=lambda: _release_on_caller(log, start, release), daemon=True)
        watch.start()
        call()
        watch.join(5)
        orders[what] = [thread for _, thread, _, _ in log[start:]]
    return orders


def _release_on_caller(log, start, release):
    import time

    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and not release.is_set():
        if any(thread != "gradcomp-worker" for _, thread, _, _ in log[start:]):
            release.set()
        time.sleep(0.005)


def _wait_all(rank):
    from gradcomp.collectives import allreduce, worker

    timer = threading.Event()
    held = worker.submit(lambda twin: timer.wait(0.3), (None,), True, device=torch.device("cpu"))
    fut = allreduce(torch.ones(4), "fp16", key="w", async_op=True)
    from gradcomp.training import wait_all

    wait_all()
    return held.done() and fut.done()


def _checks(rank, w):
    import torch.distributed as dist

    from gradcomp.collectives import worker

    callback = _callback(rank)
    log = []
    _spy(log)
    _every_layer(rank, w)
    layers = list(log)
    orders = _after_in_flight(log, rank)
    one_thread = worker.worker_for((None,)) is worker.worker_for((None, dist.new_group([0, 1])))
    return callback, layers, orders, one_thread, _wait_all(rank)


def test_async_calls_devices_and_thread_rules(tmp_path):
    for callback, layers, orders, one_thread, waited in run_ranks(_checks, 2, tmp_path):
        assert not isinstance(callback, str), callback
        inner, after = callback
        assert torch.equal(inner, torch.full((8,), 1.5)) and torch.equal(after, torch.full((2,), 0.5))
        # every collective gradcomp issued ran under on_device of its tensors' device
        assert layers and any(thread == "gradcomp-worker" for _, thread, _, _ in layers), layers
        outside = [entry for entry in layers if entry[2] is None or any(d != entry[2] for d in entry[3])]
        assert not outside, f"collectives issued outside on_device(their tensors' device): {outside[:5]}"
        assert {op for op, *_ in layers} >= {"all_gather", "all_reduce", "all_gather_object"}, layers
        for what, threads in orders.items():
            assert threads and threads[0] == "gradcomp-worker", f"{what} ran beside the job in flight: {threads}"
        assert one_thread, "two workers: two threads would drive gradcomp's communicators"
        assert waited, "wait_all() returned before the jobs submitted had completed"


def _first_async_on_one_rank(rank, w, flag):
    import os
    import time

    from gradcomp.collectives import allreduce

    if rank == 1:  # never makes the call: rank 0's worker cannot make its twin group
        deadline = time.monotonic() + 30
        while not os.path.exists(flag) and time.monotonic() < deadline:  # leave once rank 0 has its answer
            time.sleep(0.05)
        return None
    try:
        allreduce(torch.ones(4), "fp16", key="lonely", async_op=True).wait()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    finally:
        open(flag, "w").close()
    return "no error"


def test_a_first_async_call_on_one_rank_only_is_a_communication_error(tmp_path):
    # the group timeout (10 s) bounds the twin's creation; run_ranks allows 3 times that, spawning included
    result = run_ranks(_first_async_on_one_rank, 2, tmp_path, str(tmp_path / "answered"), timeout_s=10)[0]
    assert result[0] == "CommunicationError", result
    assert "first async call" in result[1] and "rank 0" in result[1], result[1]
