"""The strict NCCL mode (tests/strict.py) on two real gloo ranks: each rule fires on the pattern
NCCL would hang or misroute on, and the legal patterns pass. One spawn runs every case."""
import os
import threading
import time

import pytest
import torch

import strict
from ranks import run_ranks

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Code compiled as if it were gradcomp's own (rule 3 looks at the caller's file).
_PROBE = '''
import torch
def host(n):
    return torch.zeros(n)
def placed(n, like):
    return torch.zeros(n, device=like.device)
def new_like(like):
    return like.new_zeros(like.shape), torch.zeros_like(like), torch.tensor([1.0, 2.0], device=like.device)
def copies(t):
    return t.cpu(), t.to("cpu"), torch.from_numpy(t.numpy().copy())
def to_device(n, device):
    return torch.zeros(n).to(device)
'''


def _probe():
    ns = {}
    exec(compile(_PROBE, os.path.join(_ROOT, "collectives", "_strict_probe.py"), "exec"), ns)
    return ns


def _raises(fn):
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return None


def _cases(rank, world):
    import torch.distributed as dist

    from gradcomp.collectives import _comm, allreduce

    assert strict.installed()
    peer = 1 - rank
    side = dist.new_group(backend="gloo")  # for the test's own signals
    out = {}

    # legal: one batch in both directions, tags differing (NCCL ignores them), and a second
    # batch posted before the first is waited
    a, b = torch.full((3,), float(rank)), torch.empty(3)
    c, d = torch.full((2,), 10.0 + rank), torch.empty(2)
    w1 = dist.batch_isend_irecv([dist.P2POp(dist.isend, a, peer, tag=5), dist.P2POp(dist.irecv, b, peer, tag=9)])
    w2 = dist.batch_isend_irecv([dist.P2POp(dist.irecv, d, peer), dist.P2POp(dist.isend, c, peer)])
    for w in w2 + w1:
        w.wait()
    out["batch"] = (b.tolist(), d.tolist())

    # legal: blocking p2p in an order both ranks agree on, tags ignored
    if rank == 0:
        dist.send(torch.ones(2), 1, tag=3)
        got = torch.empty(1)
        dist.recv(got, 1, tag=4)
    else:
        got = torch.empty(2)
        dist.recv(got, 0, tag=8)
        dist.send(torch.ones(1), 0)
    out["blocking"] = got.tolist()

    # legal: the worker on its twin group while the caller computes, then a collective of the caller's
    fut = allreduce(torch.full((4,), float(rank)), "none", key="twin", async_op=True)
    torch.ones(64, 64) @ torch.ones(64, 64)
    out["twin"] = fut.wait().tolist()
    dist.all_reduce(torch.ones(1))

    # rule 2: two threads in one collective on the same group (signals through the store: a
    # collective of the test's own would be a third one at once)
    store = dist.distributed_c10d._get_default_store()
    held = threading.Event()
    if rank == 0:
        t = threading.Thread(target=lambda: (held.set(), dist.all_reduce(torch.ones(1))), name="other")
        t.start()
        held.wait()
        while strict._inside.get(strict._group(None)) is None:
            time.sleep(0.01)
        out["threads"] = _raises(lambda: dist.all_reduce(torch.ones(1)))
        store.set("strict-threads", "checked")
        t.join()
    else:
        store.get("strict-threads")
        dist.all_reduce(torch.ones(1))

    # rule 2 across groups: a collective on the default group while another thread is inside
    # one on another group of the same ranks (issue 22 item 7: the worker's twin beside the caller's)
    if rank == 0:
        t = threading.Thread(target=lambda: dist.all_reduce(torch.ones(1), group=side), name="twin-like")
        t.start()
        while strict._inside.get(side) is None:
            time.sleep(0.01)
        out["groups"] = _raises(lambda: dist.all_reduce(torch.ones(1)))
        store.set("strict-groups", "checked")
        t.join()
    else:
        store.get("strict-groups")
        dist.all_reduce(torch.ones(1), group=side)

    # rule 3: a host tensor made without device= by gradcomp's code is refused; device=, new_*,
    # *_like and .to(device) pass; .cpu(), .to("cpu") and a numpy round trip are refused
    probe = _probe()
    x = torch.ones(4)
    out["host"] = _raises(lambda: dist.all_reduce(probe["host"](4)))
    out["host_view"] = _raises(lambda: dist.all_reduce(probe["host"](8)[2:6]))
    out["copies"] = [_raises(lambda t=t: dist.all_reduce(t)) for t in probe["copies"](x)]
    out["x_after_copy"] = _raises(lambda: dist.all_reduce(x))
    passing = [probe["placed"](4, x), *probe["new_like"](x), probe["to_device"](3, torch.device("cpu"))]
    out["placed"] = [_raises(lambda t=t: dist.all_reduce(t)) for t in passing]
    out["from_test"] = _raises(lambda: dist.all_reduce(torch.zeros(2)))  # the test's own tensor
    strict.declare_device("meta", side)
    out["declared"] = _raises(lambda: dist.all_reduce(torch.ones(1), group=side))
    strict._declared.pop(side)

    # rule 4: an object collective from a plain thread is refused, under on_device it runs
    res = {}

    def plain():
        res["plain"] = _raises(lambda: dist.all_gather_object([None] * world, rank))

    def placed_thread():
        got = [None] * world
        with _comm.on_device("cpu"):
            dist.all_gather_object(got, rank)
        res["placed"] = got

    for target in (plain, placed_thread):
        t = threading.Thread(target=target, name="plain")
        t.start()
        t.join()
    objs = [None] * world
    dist.all_gather_object(objs, rank * 2)  # the main thread counts as having set its device
    out["objects"] = (res["plain"], res["placed"], objs)

    # rule 3 for gradcomp's Comm: off the main thread its device comes from the tensors or on_device
    rec = _comm.Record("t", "t", "none", "", 1)

    def comms():
        res["comm"] = [_raises(lambda: _comm.Comm(None, rec, "job")),
                       _raises(lambda: _comm.Comm(None, rec, "job", device=torch.device("cpu")))]
        with _comm.on_device("cpu"):
            res["comm"].append(_raises(lambda: _comm.Comm(None, rec, "job")))

    t = threading.Thread(target=comms, name="job")
    t.start()
    t.join()
    out["comm"] = res["comm"]

    # check_device_set and Comm's device under a composite backend, from what they read
    real_backend, real_current = dist.get_backend, torch.cuda.current_device
    try:
        dist.get_backend = lambda group=None: "cpu:gloo,cuda:nccl"
        torch.cuda.current_device = lambda: 0
        os.environ["LOCAL_RANK"] = "1"
        checks = [_raises(lambda: _comm.check_device_set(None, None, "agree")),
                  _raises(lambda: _comm.check_device_set(None, torch.device("cuda", 0))),
                  _comm.backend_for(None, "cpu"), _comm.backend_for(None, "cuda"), _comm.uses_nccl(None)]
        torch.cuda.current_device = lambda: 1
        checks.append(_raises(lambda: _comm.check_device_set(None, None)))
        checks.append(str(_comm.Comm(None, rec, "t", device=torch.device("cuda", 3)).device))
        checks.append(str(_comm.Comm(None, rec, "t", device=torch.device("cpu")).device))  # gloo takes CPU ones
        checks.append(str(_comm.Comm(None, rec, "t").device))  # main thread: the current device
        in_thread = {}
        _comm._group_device = strict._REAL["_group_device"]  # Comm's own check, not the strict mode's
        t = threading.Thread(target=lambda: in_thread.update(e=_raises(lambda: _comm.Comm(None, rec, "t"))),
                             name="job")
        t.start()
        t.join()
        checks.append(in_thread["e"])
    finally:
        dist.get_backend, torch.cuda.current_device = real_backend, real_current
        _comm._group_device = strict._group_device
        os.environ["LOCAL_RANK"] = str(rank)
    out["checks"] = checks

    # rule 1: rank 0 posts a receive from rank 1, then a send to it: on NCCL the send waits behind
    # the receive on the pair's stream, so while rank 1 holds back its send (here until rank 0
    # has raised) nothing moves; here the send raises within the bound instead of hanging
    strict.set_wait(2.0)
    buf = torch.empty(2)
    if rank == 0:
        pending = dist.irecv(buf, 1)
        out["deadlock"] = _raises(lambda: dist.send(torch.zeros(2), 1))
        dist.barrier(group=side)
        pending.wait()
        dist.send(torch.zeros(2), 1)  # legal now: the receive has completed
    else:
        dist.barrier(group=side)
        dist.send(torch.ones(2), 0)
        dist.recv(buf, 0)
    out["after"] = buf.tolist()
    dist.barrier()
    return out


def test_strict_mode_rules_fire_and_legal_patterns_pass(tmp_path):
    res = run_ranks(_cases, 2, tmp_path)
    for rank, out in enumerate(res):
        peer = 1 - rank
        assert out["batch"] == ([float(peer)] * 3, [10.0 + peer] * 2)
        assert out["blocking"] == ([1.0] if rank == 0 else [1.0, 1.0])
        assert out["twin"] == [0.5] * 4
        # rule 3
        assert "allocated on the host without device= at collectives/_strict_probe.py:4" in out["host"]
        assert "under NCCL it must live on the group's device" in out["host"]
        assert "_strict_probe.py:4" in out["host_view"]
        assert all(e is not None and "_strict_probe.py:10" in e for e in out["copies"]), out["copies"]
        assert out["x_after_copy"] is None  # .cpu() of a host tensor copied it, leaving x untracked
        assert out["placed"] == [None] * 5
        assert out["from_test"] is None
        assert "was handed a tensor on cpu; the group stands for meta" in out["declared"]
        # rule 4
        plain, placed, objs = out["objects"]
        assert "all_gather_object" in plain and "'plain', which has not set its device" in plain
        assert "on_device" in plain
        assert placed == [0, 1] and objs == [0, 2]
        bare, given_cpu, under = out["comm"]
        assert "strict NCCL mode: job built its communicator in thread 'job' with no device" in bare, bare
        assert given_cpu is None and under is None
        # check_device_set, backend_for, Comm's device
        missing, fine, cpu, cuda, nccl, matching, given, given_cpu, main, thread = out["checks"]
        assert "agree: this rank works on cuda:1 but the current CUDA device is cuda:0" in missing
        assert "torch.cuda.set_device(local_rank) before init_process_group" in missing
        assert fine is None and matching is None
        assert (cpu, cuda, nccl) == ("gloo", "nccl", True)
        assert (given, given_cpu, main) == ("cuda:3", "cpu", "cuda:1")
        assert "thread 'job' was given none" in thread and "on_device" in thread
        assert out["after"] == [float(peer)] * 2
    assert "entered by thread 'MainThread' while thread 'other' is inside all_reduce" in res[0]["threads"]
    assert "the default group" in res[0]["threads"]
    groups = res[0]["groups"]
    assert "entered by thread 'MainThread' while thread 'twin-like' is inside all_reduce on group" in groups, groups
    assert "which shares ranks [0, 1]: two communicators driven from two threads at once can deadlock" in groups
    # rule 1
    deadlock = res[0]["deadlock"]
    assert "strict NCCL mode: send to rank 1 on the default group would deadlock on NCCL" in deadlock, deadlock
    assert "queued behind irecv from rank 1 (issued by thread 'MainThread')" in deadlock


def _off(rank, world):
    return strict.installed()


def test_strict_false_runs_without_the_mode(tmp_path):
    assert run_ranks(_off, 1, tmp_path, strict=False) == [False]


@pytest.mark.parametrize("spec,expected", [("gloo", ("gloo", "gloo")), ("nccl", ("nccl", "nccl")),
                                           ("cpu:gloo,cuda:nccl", ("gloo", "nccl")), ("cuda:nccl", (None, "nccl"))])
def test_backend_for_reads_composite_backends_per_device_type(monkeypatch, spec, expected):
    import torch.distributed as dist

    from gradcomp.collectives import _comm

    monkeypatch.setattr(dist, "get_backend", lambda group=None: spec)
    assert (_comm.backend_for(None, "cpu"), _comm.backend_for(None, "cuda")) == expected
