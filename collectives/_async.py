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
from inside a ``.then()`` callback that runs on the worker, async ones included, run at once
on the twin (queued, an async call waited on there would wait for the worker itself); don't
launch collectives from callbacks that may run on the caller's thread instead, since their
order would then depend on timing.

``shutdown()`` ends the workers and drops the twins. A program that destroys the default
group without it loses nothing for long: a worker whose default group is gone ends within
``_POLL_S`` seconds, dropping its twins, and the next call after a new
``init_process_group`` drops whatever is left, so threads and sockets never accumulate
over init/destroy cycles.
"""
from __future__ import annotations

import atexit
import contextvars
import queue
import threading
from typing import Any, Callable, Dict, Tuple

import torch
import torch.distributed as dist

from ._comm import CommunicationError, group_timeout, initialized, resolve

Job = Callable[[Callable[[Any], Any]], Any]  # job(eff): eff maps a caller's group to the one to use

_POLL_S = 1.0  # how often an idle worker checks that its default group still exists
_lock = threading.Lock()
_twins: Dict[int, Tuple[Any, Any, Any]] = {}  # id(group) -> (group, twin, default group); keeps them alive
_workers: Dict[Tuple[int, ...], "_Worker"] = {}


def register_twin(group, twin) -> None:
    """Make ``twin`` (a group of the same ranks) the one async calls on ``group`` use."""
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
                f"async collective: creating the worker's twin of the default group failed on rank "
                f"{dist.get_rank()}: every rank must make its first async call (or call shutdown) at the same "
                f"point of the program, and all must be alive (backend: {said})") from exc
        register_twin(group, twin)
        return twin
    return group


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


class _Worker:
    def __init__(self, groups: Tuple[Any, ...]) -> None:
        self.world = dist.group.WORLD  # the default group this worker and its twins belong to
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
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def _loop(self) -> None:
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
            self._run(*item)  # its own frame: nothing of the job stays referenced while idle

    def _run(self, job: Job, fut: torch.futures.Future, context: contextvars.Context) -> None:
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
    if worker is not None and worker.world is not dist.group.WORLD:  # left from a destroyed group
        _drop_stale()
        worker = None
    if worker is not None and threading.current_thread() is worker.thread:
        return _completed(job, worker.eff) if async_op else job(worker.eff)
    if async_op:
        if worker is None:
            _drop_stale()
            worker = _Worker(resolved)
            with _lock:
                worker = _workers.setdefault(wkey, worker)
        return worker.submit(job)
    if worker is not None:
        return worker.submit(job).wait()
    return job(_direct)


def _completed(job: Job, eff: Callable[[Any], Any] = _direct) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    try:
        fut.set_result(job(eff))
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
