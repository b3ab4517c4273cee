"""The one owner of gradcomp's worker threads and twin process groups.

A compressed collective has several phases (header, payload, maybe more); two of them in
flight at once could interleave differently on different ranks. So asynchronous work — an
``allreduce(..., async_op=True)``, a DDP hook's bucket, ``CompressedOptimizer``'s buckets —
is queued and run one job at a time, in submission order, on one FIFO worker thread per
group (or tuple of groups), which completes the returned ``torch.futures.Future``. The
worker communicates over a *twin* of each group (``new_group`` over the same ranks, made once
on the caller's thread), so it never meets the program's own collectives on that group (DDP's
buffer broadcast, a logged loss):

- the default group's twin is created when its worker is created (every rank must reach
  that point, as for any ``new_group``);
- ``make_node_groups`` creates twins of the groups it builds, on every rank, in order;
- any other group is used as it is: don't issue your own collectives on it while jobs run.

A job is ``job(eff)``, where ``eff`` maps a caller's group to the one to use. It runs in the
submitter's ``contextvars`` context (a state transaction open there covers it). Rules:

- once a group has a worker, synchronous calls on it go through the queue too (and wait), so
  their order relative to pending jobs is the program order on every rank;
- a job submitted from the worker's own thread (a ``.then()`` callback) runs there at once:
  queued, waiting on it would wait for the worker itself; such callbacks run on every rank
  right after the same job, so the order stays the same everywhere;
- ``inline=True`` runs the job on the caller's thread once the queue is empty (the last bucket
  of a backward pass: nothing is left to overlap with, two thread hand-offs are saved);
- for a CUDA ``device`` the job runs on the worker's own stream, after the work the caller's
  stream had queued when it submitted.

``shutdown()`` ends the workers and drops the twins; it runs at exit too. A program that
destroys the default group without it loses nothing for long: an idle worker whose default
group is gone ends within ``_POLL_S`` seconds, dropping its twins, and the next call after a
new ``init_process_group`` drops whatever is left.
"""
from __future__ import annotations

import atexit
import contextvars
import queue
import threading
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ._comm import CommunicationError, group_timeout, initialized, resolve

Job = Callable[[Callable[[Any], Any]], Any]  # job(eff): eff maps a caller's group to the one to use
Then = Optional[Callable[[torch.futures.Future], Any]]

_POLL_S = 1.0  # how often an idle worker checks that its default group still exists
_lock = threading.Lock()
_twins: Dict[int, Tuple[Any, Any, Any]] = {}  # id(group) -> (group, twin, default group); keeps them alive
_workers: Dict[Tuple[int, ...], "Worker"] = {}


def register_twin(group, twin) -> None:
    """Make ``twin`` (a group of the same ranks) the one workers use for ``group``."""
    with _lock:
        _twins[id(group)] = (group, twin, dist.group.WORLD)


def _twin(group):
    with _lock:
        entry = _twins.get(id(group))
        if entry is not None and entry[0] is group:
            return entry[1]
    if group is dist.group.WORLD:
        try:
            twin = dist.new_group(timeout=group_timeout(group))
        except RuntimeError as exc:  # the store's wait timed out, or a peer is gone
            said = " ".join(str(exc).split())[:300]
            raise CommunicationError(
                f"gradcomp: creating the worker's twin of the default group failed on rank {dist.get_rank()}: every "
                f"rank must make its first async call (or register its hook or optimizer) at the same point of the "
                f"program, and all must be alive (backend: {said})") from exc
        register_twin(group, twin)
        return twin
    return group


class Worker:
    """One FIFO thread for a tuple of groups; see the module docstring."""

    def __init__(self, groups: Tuple[Any, ...]) -> None:
        self.world = dist.group.WORLD  # the default group this worker and its twins belong to
        self._map = {id(g): _twin(g) for g in groups}  # on the caller's thread: new_group is not thread-safe
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._last: Optional[torch.futures.Future] = None  # the latest job queued
        self.thread = threading.Thread(target=self._loop, name="gradcomp-worker", daemon=True)
        self.thread.start()

    def eff(self, group):
        """The group a job uses for the caller's ``group`` (its twin, when it has one)."""
        g = resolve(group)
        return self._map.get(id(g), g)

    def submit(self, job: Job, *, device: Optional[torch.device] = None, then: Then = None,
               inline: bool = False) -> torch.futures.Future:
        """A future of ``job(eff)`` (chained with ``.then(then)``), run after every job submitted
        before it; see the module docstring for ``inline`` and ``device``."""
        cuda = device is not None and device.type == "cuda"
        fut: torch.futures.Future = torch.futures.Future(devices=[device]) if device is not None and cuda \
            else torch.futures.Future()
        out = fut if then is None else fut.then(then)
        if threading.current_thread() is self.thread:  # from a callback on this worker
            _complete(fut, job, self.eff)
            return out
        if inline:
            if self._last is not None:
                try:
                    self._last.wait()
                except Exception:  # raised where that future is waited on
                    pass
            _complete(fut, job, self.eff)
            return out
        self._last = fut
        ready = None
        if cuda:  # the inputs were written on the caller's stream
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        # Enqueue last: once the worker runs, the caller competes with it for the GIL, so
        # the caller should have nothing left to do but return.
        self._queue.put((job, fut, contextvars.copy_context(), device, ready))
        return out

    def stop(self, timeout: float) -> None:
        """Finish the queued jobs, then end the thread (waiting at most ``timeout`` s)."""
        self._queue.put(None)
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def _loop(self) -> None:
        streams: Dict[Any, Any] = {}
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self.world is not dist.group.WORLD:  # destroyed without shutdown(): free the twins
                    _drop_stale()
                    return
                continue
            if item is None:
                return
            self._run(streams, *item)  # its own frame: nothing of the job stays referenced while idle

    def _run(self, streams: Dict[Any, Any], job: Job, fut: torch.futures.Future, context: contextvars.Context,
             device: Optional[torch.device], ready: Optional[Any]) -> None:
        if ready is None or device is None:
            context.run(_complete, fut, job, self.eff)
            return
        stream = streams.setdefault(device.index, torch.cuda.Stream(device))
        with torch.cuda.device(device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            context.run(_complete, fut, job, self.eff)  # set_result records the stream's work for its users


def _complete(fut: torch.futures.Future, job: Job, eff: Callable[[Any], Any]) -> None:
    try:
        value = job(eff)
    except Exception as exc:  # reported through the future, raised where it is waited on
        fut.set_exception(exc)
    else:
        fut.set_result(value)


def _direct(group):
    return resolve(group)


def worker_for(groups: Tuple[Any, ...]) -> Worker:
    """The worker of ``groups`` (None: the default group), created on first use. The first
    time, call it on every rank at the same point of the program: creating the default
    group's twin is a collective."""
    resolved = tuple(resolve(g) for g in groups)
    wkey = tuple(id(g) for g in resolved)
    with _lock:
        worker = _workers.get(wkey)
    if worker is not None and worker.world is dist.group.WORLD:
        return worker
    _drop_stale()
    worker = Worker(resolved)
    with _lock:
        return _workers.setdefault(wkey, worker)


def submit(job: Job, groups: Tuple[Any, ...], async_op: bool):
    """Run ``job`` now (sync) or on the groups' worker (async); see the module docstring."""
    if not initialized():
        return completed(job) if async_op else job(_direct)
    resolved = tuple(resolve(g) for g in groups)
    with _lock:
        worker = _workers.get(tuple(id(g) for g in resolved))
    if worker is not None and worker.world is not dist.group.WORLD:  # left from a destroyed group
        _drop_stale()
        worker = None
    if worker is not None and threading.current_thread() is worker.thread:
        return completed(job, eff=worker.eff) if async_op else job(worker.eff)
    if async_op:
        return worker_for(resolved).submit(job)
    if worker is not None:
        return worker.submit(job).wait()
    return job(_direct)


def completed(job: Job, then: Then = None, *, eff: Callable[[Any], Any] = _direct) -> torch.futures.Future:
    """Run ``job(eff)`` now; its finished future (chained with ``.then(then)``)."""
    fut: torch.futures.Future = torch.futures.Future()
    _complete(fut, job, eff)
    return fut if then is None else fut.then(then)


def _drop_stale() -> None:
    """Forget the workers and twins made under a default group that is no longer the current
    one (destroyed without ``shutdown``), and end those workers without waiting."""
    world = dist.group.WORLD
    with _lock:
        workers = [_workers.pop(k) for k in [k for k, w in _workers.items() if w.world is not world]]
        for k in [k for k, e in _twins.items() if e[2] is not world]:
            del _twins[k]
    for w in workers:
        w.stop(0.0)


def shutdown(timeout: float = 30.0) -> None:
    """Stop every worker thread (after its queued jobs) and drop the twin groups.

    Call it before ``torch.distributed.destroy_process_group()``; it also runs at exit, so no
    thread or group outlives the interpreter's teardown (a gloo group destroyed during that
    teardown can abort the process)."""
    with _lock:
        workers = list(_workers.values())
        _workers.clear()
    for w in workers:
        if w.thread is not threading.current_thread():
            w.stop(timeout)
    with _lock:
        _twins.clear()


atexit.register(shutdown)


def all_of(futures, assemble: Callable[[list], Any]) -> torch.futures.Future:
    """A future of ``assemble([f.value() ...])`` once every future is done; the first error
    (by position) is passed on with its own type."""
    out: torch.futures.Future = torch.futures.Future()
    futures = list(futures)
    remaining = [len(futures)]
    lock = threading.Lock()

    def finish():
        values, error = [], None
        for f in futures:
            try:
                values.append(f.value())
            except Exception as exc:
                error = error or exc
        if error is not None:
            out.set_exception(error)
            return
        try:
            out.set_result(assemble(values))
        except Exception as exc:
            out.set_exception(exc)

    def done(_):
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            finish()

    if not futures:
        finish()
    for f in futures:
        f.add_done_callback(done)
    return out
