"""Asynchronous collectives: one FIFO worker thread per group (or group pair), on twin groups.

A compressed collective has several phases (header, payload, maybe more); two of them in
flight at once could interleave differently on different ranks. So async calls are queued
and run one at a time, in call order, on a worker thread, which completes the returned
``torch.futures.Future`` (``set_result``/``set_exception``). The worker communicates over a
*twin* of the caller's group, created once, so it never interleaves with the caller's own
collectives on that group:

- the default group's twin is created on the first async call (every rank is a member and
  makes that call, so ``new_group`` is safe there);
- ``make_node_groups`` creates twins of the groups it builds, on every rank, in order;
- any other group is used as it is: don't issue your own collectives on it while futures
  are pending.

Once a group has a worker, synchronous calls on it go through the queue too (and wait), so
their order relative to pending async calls is the program order on every rank. Calls made
from inside a ``.then()`` callback that runs on the worker run at once on the twin; don't
launch collectives from callbacks that may run on the caller's thread instead, since their
order would then depend on timing.
"""
from __future__ import annotations

import atexit
import contextvars
import queue
import threading
from typing import Any, Callable, Dict, Tuple

import torch
import torch.distributed as dist

from ._comm import group_timeout, initialized, resolve

Job = Callable[[Callable[[Any], Any]], Any]  # job(eff): eff maps a caller's group to the one to use

_lock = threading.Lock()
_twins: Dict[int, Tuple[Any, Any]] = {}  # id(group) -> (group, twin); keeps both alive
_workers: Dict[Tuple[int, ...], "_Worker"] = {}


def register_twin(group, twin) -> None:
    """Make ``twin`` (a group of the same ranks) the one async calls on ``group`` use."""
    with _lock:
        _twins[id(group)] = (group, twin)


def _twin(group):
    with _lock:
        entry = _twins.get(id(group))
        if entry is not None and entry[0] is group:
            return entry[1]
    if group is dist.group.WORLD:
        twin = dist.new_group(timeout=group_timeout(group))
        register_twin(group, twin)
        return twin
    return group


class _Worker:
    def __init__(self, groups: Tuple[Any, ...]) -> None:
        self._map = {id(g): _twin(g) for g in groups}  # on the caller's thread: new_group is not thread-safe
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="gradcomp-collectives", daemon=True)
        self.thread.start()

    def eff(self, group):
        g = resolve(group)
        return self._map.get(id(g), g)

    def submit(self, job: Job) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        # the job runs in the caller's context: a state transaction open there covers it too
        self._queue.put((job, fut, contextvars.copy_context()))
        return fut

    def stop(self, timeout: float) -> None:
        """Finish the queued calls, then end the thread (waiting at most ``timeout`` s)."""
        self._queue.put(None)
        self.thread.join(timeout)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, fut, context = item
            try:
                value = context.run(job, self.eff)
            except Exception as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(value)


def shutdown(timeout: float = 30.0) -> None:
    """Stop every worker thread (after its queued calls) and drop the twin groups.

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


def _direct(group):
    return resolve(group)


def submit(job: Job, groups: Tuple[Any, ...], async_op: bool):
    """Run ``job`` now (sync) or on the groups' worker (async); see the module docstring."""
    if not initialized():
        return _completed(job) if async_op else job(_direct)
    resolved = tuple(resolve(g) for g in groups)
    wkey = tuple(id(g) for g in resolved)
    with _lock:
        worker = _workers.get(wkey)
    if worker is not None and threading.current_thread() is worker.thread:
        if async_op:
            return worker.submit(job)
        return job(worker.eff)
    if async_op:
        if worker is None:
            worker = _Worker(resolved)
            with _lock:
                worker = _workers.setdefault(wkey, worker)
        return worker.submit(job)
    if worker is not None:
        return worker.submit(job).wait()
    return job(_direct)


def _completed(job: Job) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    try:
        fut.set_result(job(_direct))
    except Exception as exc:
        fut.set_exception(exc)
    return fut


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
