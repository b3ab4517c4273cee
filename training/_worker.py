"""One FIFO worker thread per process group, communicating over a twin of that group.

A bucket's exchange is several collectives (dense part, compressed rounds). Buckets are
submitted in the same order on every rank (DDP calls hooks in bucket order; the optimizer
wrapper launches its buckets in order), and one thread runs them one after the other, so the
collectives are issued in the same order everywhere while backward goes on: communication
overlaps computation without ever interleaving two buckets.

The last bucket of a backward pass may run on the caller's thread instead (``inline``), once
the worker is idle: nothing is left to overlap it with, and two thread hand-offs are saved.

The worker talks over a *twin* of the default group (``new_group`` over the same ranks, made
once on the caller's thread), so collectives the program itself issues on the default group
(DDP's buffer broadcast, the unused-parameter map, a logged loss) never meet ours. Other
groups are used as they are: issue nothing else on them while a backward pass is running.

A job submitted from the worker's own thread (from a ``.then()`` callback of one of its
futures) runs there at once: queued, waiting on it would wait for the worker itself. Its place
in the order is still the same on every rank, since such a callback runs on every rank right
after the job it follows.

A worker whose default group was destroyed without ``shutdown()`` ends within ``_POLL_S``
seconds and forgets its twin; the next ``worker_for`` after a new ``init_process_group``
forgets whatever is left, so threads and sockets never accumulate over init/destroy cycles.
"""
from __future__ import annotations

import atexit
import queue
import threading
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from gradcomp.collectives._comm import CommunicationError, check_alone

_POLL_S = 1.0  # how often an idle worker checks that its default group still exists
_lock = threading.Lock()
_workers: Dict[int, Tuple[Any, "Worker"]] = {}  # id(group) -> (group, worker); keeps the group alive


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_of(group) -> int:
    """World size of ``group`` (None: the default group); 1 without a process group."""
    if not initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised; "
                             "call init_process_group first or pass process_group=None")
        check_alone()
        return 1
    return dist.get_world_size(group)


class Worker:
    """Runs submitted jobs one at a time, in order; each job gets the group to use."""

    def __init__(self, group) -> None:
        self.world = dist.group.WORLD  # the default group this worker (and its twin) belongs to
        if group is None or group is dist.group.WORLD:
            try:
                self.group = dist.new_group(timeout=_timeout(dist.group.WORLD))
            except RuntimeError as exc:  # the store's wait timed out, or a peer is gone
                said = " ".join(str(exc).split())[:300]
                raise CommunicationError(
                    f"gradcomp training: creating the worker's twin of the default group failed on rank "
                    f"{dist.get_rank()}: every rank must start its first compressed exchange at the same point "
                    f"of the program, and all must be alive (backend: {said})") from exc
        else:
            self.group = group
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._last: Optional[torch.futures.Future] = None  # the latest job queued
        self.thread = threading.Thread(target=self._loop, name="gradcomp-training", daemon=True)
        self.thread.start()

    def submit(self, job: Callable[[Any], Any], device: torch.device,
               then: Optional[Callable[[torch.futures.Future], Any]] = None, *,
               inline: bool = False) -> torch.futures.Future:
        """A future of ``job(group)`` (chained with ``.then(then)``), run after every job
        submitted before it. ``inline``: run it on the calling thread, once the worker is idle
        (for the last bucket of a backward pass there is nothing left to overlap with, and
        two thread hand-offs are saved)."""
        cuda = device.type == "cuda"
        fut = torch.futures.Future(devices=[device]) if cuda else torch.futures.Future()
        out = fut if then is None else fut.then(then)
        if threading.current_thread() is self.thread:  # from a callback: see the module docstring
            try:
                fut.set_result(job(self.group))
            except Exception as exc:
                fut.set_exception(exc)
            return out
        if inline:
            if self._last is not None:
                try:
                    self._last.wait()
                except Exception:  # raised where that future is waited on
                    pass
            try:
                fut.set_result(job(self.group))
            except Exception as exc:
                fut.set_exception(exc)
            return out
        self._last = fut
        ready = None
        if cuda:  # the gradients were written on the caller's stream
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        # Enqueue last: once the worker runs, the caller competes with it for the GIL, so
        # the caller should have nothing left to do but return.
        self._queue.put((job, fut, device, ready))
        return out

    def stop(self, timeout: float) -> None:
        """Finish the queued jobs, then end the thread (waiting at most ``timeout`` s)."""
        self._queue.put(None)
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def _loop(self) -> None:
        streams: Dict[int, Any] = {}
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self.world is not dist.group.WORLD:  # destroyed without shutdown(): free the twin
                    _drop_stale()
                    return
                continue
            if item is None:
                return
            self._run(streams, *item)  # its own frame: nothing of the job stays referenced while idle

    def _run(self, streams: Dict[int, Any], job: Callable[[Any], Any], fut: torch.futures.Future,
             device: torch.device, ready: Optional[Any]) -> None:
        try:
            if ready is None:
                value = job(self.group)
            else:
                stream = streams.setdefault(device.index, torch.cuda.Stream(device))
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    value = job(self.group)
                    fut.set_result(value)  # records the stream's work for the future's users
                    return
        except Exception as exc:  # reported through the future, raised where it is waited on
            fut.set_exception(exc)
        else:
            fut.set_result(value)


def worker_for(group) -> Worker:
    """The worker of ``group`` (None: the default group), created on first use.

    Call it on every rank at the same point of the program the first time: creating the
    twin of the default group is a collective.
    """
    g = dist.group.WORLD if group is None else group
    with _lock:
        entry = _workers.get(id(g))
    if entry is not None and entry[0] is g and entry[1].world is dist.group.WORLD:
        return entry[1]
    _drop_stale()
    worker = Worker(g)
    with _lock:
        _workers[id(g)] = (g, worker)
    return worker


def shutdown(timeout: float = 30.0) -> None:
    """Stop the training workers (after their queued jobs), drop their twin groups, then do the
    same for the collectives' workers. Call it before ``destroy_process_group()``; it also
    runs at exit, so no thread or group outlives the interpreter's teardown."""
    from gradcomp.collectives import shutdown as collectives_shutdown

    with _lock:
        workers = [w for _, w in _workers.values()]
        _workers.clear()
    for w in workers:
        if w.thread is not threading.current_thread():
            w.stop(timeout)
    collectives_shutdown(timeout)


atexit.register(shutdown)


def _drop_stale() -> None:
    """Forget the workers made under a default group that is no longer the current one
    (destroyed without ``shutdown``), and end them without waiting."""
    world = dist.group.WORLD
    with _lock:
        stale = [k for k, (_, w) in _workers.items() if w.world is not world]
        workers = [_workers.pop(k)[1] for k in stale]
    for w in workers:
        w.stop(0.0)


def completed(job: Callable[[Any], Any], then: Optional[Callable[[torch.futures.Future], Any]] = None
              ) -> torch.futures.Future:
    """Run ``job(None)`` now (one process: no communication); its finished future, chained."""
    fut: torch.futures.Future = torch.futures.Future()
    try:
        fut.set_result(job(None))
    except Exception as exc:
        fut.set_exception(exc)
    return fut if then is None else fut.then(then)


class Hierarchy(NamedTuple):
    """This rank's groups for the hierarchical exchange: its node, and one rank per node."""

    intra: Any  # the ranks of this node (consecutive global ranks)
    inter: Any  # the ranks with this rank's local index, one per node
    local_size: int
    local_rank: int
    nodes: int


def node_groups(local_size: int) -> Hierarchy:
    """Groups for nodes of ``local_size`` consecutive ranks of the default group, used only by
    gradcomp's training exchange. A collective: every rank calls it at the same point."""
    world, rank = dist.get_world_size(), dist.get_rank()
    timeout = _timeout(dist.group.WORLD)
    nodes = world // local_size
    intra = inter = None
    for n in range(nodes):
        members = list(range(n * local_size, (n + 1) * local_size))
        g = dist.new_group(members, timeout=timeout)
        if rank in members:
            intra = g
    for i in range(local_size):
        members = list(range(i, world, local_size))
        g = dist.new_group(members, timeout=timeout)
        if rank in members:
            inter = g
    return Hierarchy(intra, inter, local_size, rank % local_size, nodes)


def _timeout(group) -> Optional[Any]:
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # private API: absent on some backends and versions
        return None
