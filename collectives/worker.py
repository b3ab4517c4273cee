"""The one owner of gradcomp's worker thread and twin process groups.

A compressed collective has several phases (header, payload, maybe more); two of them in
flight at once could interleave differently on different ranks. So asynchronous work — an
``allreduce(..., async_op=True)``, a DDP hook's bucket, ``CompressedOptimizer``'s and
``ShardedOptimizer``'s buckets — is queued and run one job at a time, in submission order, on
one FIFO worker thread per process (per default group), which completes the returned
``torch.futures.Future``. The worker communicates over a *twin* of each group (``new_group``
over the same ranks, made once on the caller's thread), so it never meets the program's own
collectives on that group (DDP's buffer broadcast, a logged loss):

- the default group's twin is created when a worker first takes the default group (every rank
  must reach that point, as for any ``new_group``);
- ``make_node_groups`` creates twins of the groups it builds, on every rank, in order;
- any other group is used as it is: don't issue your own collectives on it while jobs run.

A job is ``job(twin)``, where ``twin`` maps a caller's group to the one to use. It runs in the
submitter's ``contextvars`` context (a state transaction open there covers it).

Devices and streams. Every job is submitted with the device of its tensors (never a thread's
current device: a new thread's is GPU 0 whatever the rank) and runs under
``on_device(device)``. For a CUDA device a queued job runs on the worker's own stream for that
device, after the work the caller's stream had queued when it submitted (an event), and its
inputs are marked used on that stream (``record_stream``), so the caching allocator does not
hand their memory to the caller's stream while the worker's still reads it. Futures of CUDA
jobs are CUDA futures (``torch.futures.Future(devices=[device])``): ``wait()``, ``value()`` and
``.then()`` make the consumer's current stream wait for the job's work and record its result
tensors on that stream.

Threads and communicators (NCCL gives no progress guarantee to kernels of two communicators
issued in different orders on different ranks, and a communicator must not be driven from two
threads):

- one worker thread per process drives every group gradcomp works on; jobs run in program
  order, so the order across communicators is the same on every rank;
- once the worker exists, gradcomp's own synchronous calls (``allreduce`` without
  ``async_op``, the agreement checks, the parameter broadcast) wait for the jobs already
  queued and then run on the caller's thread, so no two threads ever communicate for gradcomp
  at once;
- a job submitted from the worker's own thread (a ``.then()`` callback) runs there at once:
  queued, waiting on it would wait for the worker itself; such callbacks run on every rank
  right after the same job, so the order stays the same everywhere;
- ``inline=True`` runs the job on the caller's thread once the queue is empty (the last bucket
  of a backward pass: nothing is left to overlap with, two thread hand-offs are saved), unless
  the job has an exchange to prepare ahead and the worker is busy: it is queued then, so its
  local phase can run beside the wire time of the job before it.

Work ahead. A job may carry an exchange (``Job.exchange``, e.g. a
:class:`~gradcomp.collectives.bucket.BucketExchange`): an object whose ``prepare(ahead=)`` is its
local phase (compression, error feedback; no collective, no host read; a failure is kept by the
exchange and raised again where the job runs its local phase). A job submitted with
``beside=True`` is called ``job(twin, beside)``: ``beside()`` runs the next queued job's
``prepare(ahead=True)`` when that job has an exchange and works on the same device (in its context, on
the same device and stream, after its inputs are ready), and the job calls it while its
largest exchange is on the wire (``BucketExchange.start(beside)``). So a bucket is compressed
while the one before it is on the wire. Nothing else changes: the jobs' collectives are issued
in the same order, by the same thread, and whether a job was prepared ahead changes no bits.

What users must not do: issue their own collective (on any group: the default group's
twin runs on another communicator) while gradcomp jobs are in flight — between ``backward()``
and ``step()`` of a ``CompressedOptimizer`` or ``ShardedOptimizer``, or while an async
future is pending. Call :func:`wait_all` first (or the optimizer's ``synchronize()``): the
in-flight work then completes, and on CUDA the caller's stream is ordered after it, so the
two communicators are used one after the other on every rank. A DDP hook's buckets are
complete when ``backward()`` returns (DDP waits for them).

``shutdown()`` ends the worker and drops the twins; it runs at exit too. A program that
destroys the default group without it loses nothing for long: an idle worker whose default
group is gone ends within ``_POLL_S`` seconds, dropping its twins, and the next call after a
new ``init_process_group`` drops whatever is left.
"""
from __future__ import annotations

import atexit
import collections
import contextvars
from dataclasses import dataclass
import queue
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist

# on_device: torch.cuda.device on CUDA; also marks the thread as having set its device (the strict
# test mode refuses object collectives elsewhere)
from ._comm import CommunicationError, group_timeout, initialized, on_device, resolve

Twin = Callable[[Any], Any]  # maps a caller's group to the one a job uses
Fn = Callable[..., Any]  # fn(twin), or fn(twin, beside) for a job submitted with beside=True
Then = Optional[Callable[[torch.futures.Future], Any]]
Device = Any  # a torch.device or what torch.device() accepts

_POLL_S = 1.0  # how often an idle worker checks that its default group still exists
_CPU = torch.device("cpu")
_lock = threading.Lock()
_twins: Dict[int, Tuple[Any, Any, Any]] = {}  # id(group) -> (group, twin, default group); keeps them alive
_workers: Dict[int, "Worker"] = {}  # id(default group) -> its worker (at most one live)


class Exchange(Protocol):
    """What a job may carry for the worker to run early (see the module docstring)."""

    def prepare(self, *, ahead: bool = False) -> None: ...


@dataclass
class Job:
    """One queued job: ``fn`` run on ``device`` after the jobs before it, its value or error
    into ``future``, in ``context`` (the submitter's). ``exchange``: its local phase, which the
    worker may run early (beside the job before it); ``beside``: ``fn`` takes a second argument,
    the work to run while its largest exchange is on the wire. ``ready``: on CUDA, the event
    after the work the caller's stream had queued; ``inputs``: the tensors made there."""

    fn: Fn
    device: torch.device
    future: torch.futures.Future
    context: Optional[contextvars.Context] = None  # set when queued
    exchange: Optional[Exchange] = None
    beside: bool = False
    ready: Optional[Any] = None
    inputs: Tuple[torch.Tensor, ...] = ()


def device_of(*values: Any) -> torch.device:
    """The device of the first tensor in ``values``, searched through lists, tuples and dict
    values (an ``allreduce_fused`` item list, a bucket); the CPU when there is none."""
    found = _first_device(values)
    return _CPU if found is None else found


def _first_device(value: Any) -> Optional[torch.device]:
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for v in value:
            found = _first_device(v)
            if found is not None:
                return found
    return None


def _device(device: Device) -> torch.device:
    """``device`` as a torch.device; a CUDA one without an index is the caller's current one
    (read here, on the submitting thread, never on the worker's)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _future(devices: Iterable[torch.device]) -> torch.futures.Future:
    """A CUDA future over the CUDA ones among ``devices``, or a plain one."""
    cuda: List[Any] = sorted({d for d in devices if d.type == "cuda"}, key=lambda d: d.index or 0)
    return torch.futures.Future(devices=cuda) if cuda else torch.futures.Future()


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
    """The process's FIFO thread; see the module docstring."""

    def __init__(self, groups: Tuple[Any, ...] = ()) -> None:
        self.world = dist.group.WORLD  # the default group this worker and its twins belong to
        self._map: Dict[int, Any] = {}
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._ahead: "collections.deque" = collections.deque()  # items taken off the queue early (look-ahead)
        self._last: Optional[torch.futures.Future] = None  # the latest job queued (with its .then())
        self._last_on: Dict[torch.device, torch.futures.Future] = {}  # the same per CUDA device
        self.adopt(groups)
        self.thread = threading.Thread(target=self._loop, name="gradcomp-worker", daemon=True)
        self.thread.start()

    def adopt(self, groups: Sequence[Any]) -> None:
        """Take ``groups`` on (their twins from now on). Call it on the caller's thread, on every
        rank at the same point: making the default group's twin is a collective, and
        ``new_group`` is not thread-safe."""
        for g in groups:
            g = resolve(g)
            if id(g) not in self._map:
                self._map[id(g)] = _twin(g)

    def owns(self, group) -> bool:
        return id(resolve(group)) in self._map

    def twin(self, group):
        """The group a job uses for the caller's ``group`` (its twin, when it has one)."""
        g = resolve(group)
        return self._map.get(id(g), g)

    def submit(self, fn: Fn, *, device: Device, then: Then = None, inline: bool = False,
               inputs: Sequence[torch.Tensor] = (), exchange: Optional[Exchange] = None,
               beside: bool = False) -> torch.futures.Future:
        """A future of ``fn(twin)`` (``fn(twin, beside)`` with ``beside``; chained with
        ``.then(then)``), run after every job submitted before it, under ``on_device(device)`` —
        ``device`` is where the job's tensors are. ``inputs``: the tensors made on the caller's
        stream that the job reads (see the module docstring); ``inline``: run it on this thread
        once the queue is empty; ``exchange``: its local phase, which may run early."""
        device = _device(device)
        fut = _future([device])
        out = fut if then is None else fut.then(then)
        job = Job(fn, device, fut, exchange=exchange, beside=beside)
        if threading.current_thread() is self.thread:  # from a callback on this worker
            _complete(fut, _with(job, None), self.twin, device)
            return out
        if inline and not (exchange is not None and self._busy()):
            self.wait_queued()  # on CUDA this orders the caller's stream after the worker's too
            _complete(fut, _with(job, None), self.twin, device)
            return out
        self._last = out
        if device.type == "cuda":  # the inputs were written on the caller's stream
            self._last_on[device] = out
            job.ready = torch.cuda.Event()
            job.ready.record(torch.cuda.current_stream(device))
        job.inputs, job.context = tuple(inputs), contextvars.copy_context()
        # Enqueue last: once the worker runs, the caller competes with it for the GIL, so
        # the caller should have nothing left to do but return.
        self._queue.put(job)
        return out

    def _busy(self) -> bool:
        """Whether a queued job may still be running (its future not done)."""
        last = self._last
        return last is not None and not last.done()

    def wait_queued(self) -> None:
        """Wait until every job queued so far (and its ``.then()``) has run; on CUDA, the
        caller's current stream of each device used waits for the worker's work too. Errors
        stay with their futures."""
        if threading.current_thread() is self.thread:
            return  # from a callback: every earlier job is done, the running one is the caller
        # a device's jobs run in order on one worker stream: its latest job's events cover them all
        for last in [*self._last_on.values(), self._last]:
            if last is not None:
                try:
                    last.wait()
                except Exception:  # raised where that future is waited on
                    pass

    def stop(self, timeout: float) -> None:
        """Finish the queued jobs, then end the thread (waiting at most ``timeout`` s)."""
        self._queue.put(None)
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def _loop(self) -> None:
        streams: Dict[Any, Any] = {}
        while True:
            try:
                job = self._ahead.popleft() if self._ahead else self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self.world is not dist.group.WORLD:  # destroyed without shutdown(): free the twins
                    _drop_stale()
                    return
                continue
            if job is None:
                return
            self._run(streams, job)  # its own frame: nothing of the job stays referenced while idle

    def _peek(self) -> Optional[Job]:
        """The next queued job, taken off the queue into the look-ahead (None: nothing queued)."""
        if not self._ahead:
            try:
                self._ahead.append(self._queue.get_nowait())
            except queue.Empty:
                return None
        return self._ahead[0]

    def _beside(self, device: torch.device) -> Callable[[], None]:
        """The work a job on ``device`` runs while its bytes are on the wire: the next queued
        job's ``exchange.prepare()``, when it has one and works on the same device."""
        def work() -> None:
            nxt = self._peek()
            if nxt is None or nxt.exchange is None or nxt.device != device:  # nothing queued, or the stop mark
                return
            exchange = nxt.exchange
            if nxt.ready is not None:  # the next job's inputs were written on its caller's stream
                stream = torch.cuda.current_stream(nxt.device)
                stream.wait_event(nxt.ready)
                for t in nxt.inputs:
                    if isinstance(t, torch.Tensor) and t.device == nxt.device:
                        t.record_stream(stream)

            def run() -> None:
                with on_device(device):
                    try:
                        exchange.prepare(ahead=True)
                    except Exception:  # noqa: BLE001 (kept by the exchange, raised where its job prepares)
                        pass
            assert nxt.context is not None
            nxt.context.run(run)
        return work

    def _complete(self, job: Job, beside: Optional[Callable[[], None]]) -> None:
        """Run a queued ``job`` here, in its context (``beside``: the work its wire time may run)."""
        assert job.context is not None
        job.context.run(_complete, job.future, _with(job, beside), self.twin, job.device)

    def _run(self, streams: Dict[Any, Any], job: Job) -> None:
        device = job.device
        if job.ready is None:
            self._complete(job, self._beside(device))
            return
        stream = streams.get(device.index)
        if stream is None:
            stream = streams[device.index] = torch.cuda.Stream(device=device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            stream.wait_event(job.ready)
            for t in job.inputs:  # made on the caller's stream, read on this one until its work is done
                if isinstance(t, torch.Tensor) and t.device == device:
                    t.record_stream(stream)
            self._complete(job, self._beside(device))  # set_result records the stream's work


def _with(job: Job, beside: Optional[Callable[[], None]]) -> Fn:
    """``job.fn`` as a function of the twin alone (given ``beside`` when it takes it)."""
    if not job.beside:
        return job.fn
    return lambda twin: job.fn(twin, beside)


def _complete(fut: torch.futures.Future, job: Fn, twin: Twin, device: torch.device) -> None:
    try:
        with on_device(device):  # inside the job's context: the strict mode's mark lives there
            value = job(twin)
    except Exception as exc:  # reported through the future, raised where it is waited on
        fut.set_exception(exc)
    else:
        fut.set_result(value)


def _direct(group):
    return resolve(group)


def current() -> Optional[Worker]:
    """The worker of the current default group, if one was made (stale ones are dropped)."""
    with _lock:
        worker = _workers.get(id(dist.group.WORLD)) if initialized() else None
    if worker is not None and worker.world is not dist.group.WORLD:
        worker = None
    if worker is None and _workers:
        _drop_stale()
    return worker


def worker_for(groups: Tuple[Any, ...]) -> Worker:
    """The process's worker, created on first use, having taken ``groups`` (None: the default
    group) on. The first time a group is taken, call it on every rank at the same point of the
    program: creating the default group's twin is a collective."""
    resolved = tuple(resolve(g) for g in groups)
    worker = current()
    if worker is None:
        made = Worker(resolved)
        with _lock:
            worker = _workers.setdefault(id(made.world), made)
        if worker is not made:
            made.stop(0.0)
    worker.adopt(resolved)
    return worker


def submit(job: Fn, groups: Tuple[Any, ...], async_op: bool, *, device: Device,
           inputs: Sequence[torch.Tensor] = ()):
    """Run ``job`` now (sync) or on the worker (async), under ``on_device(device)`` — the
    device of the job's tensors; see the module docstring. ``inputs``: the tensors the job
    reads (marked used on the worker's stream)."""
    device = _device(device)
    if not initialized():
        return completed(job, device=device) if async_op else _now(job, _direct, device)
    worker = current()
    if worker is not None and threading.current_thread() is worker.thread:
        return completed(job, twin=worker.twin, device=device) if async_op else _now(job, worker.twin, device)
    if async_op:
        return worker_for(groups).submit(job, device=device, inputs=inputs)
    if worker is not None:  # after the jobs in flight, never beside them
        return worker.submit(job, device=device, inline=True).wait()
    return _now(job, _direct, device)


def _now(job: Fn, twin: Callable[[Any], Any], device: torch.device) -> Any:
    with on_device(device):
        return job(twin)


def completed(job: Fn, then: Then = None, *, twin: Callable[[Any], Any] = _direct,
              device: Device = _CPU) -> torch.futures.Future:
    """Run ``job(twin)`` now under ``on_device(device)``; its finished future (a CUDA future for
    a CUDA device; chained with ``.then(then)``)."""
    device = _device(device)
    fut = _future([device])
    _complete(fut, job, twin, device)
    return fut if then is None else fut.then(then)


def wait_all() -> None:
    """Wait for every gradcomp job submitted so far (async collectives, training buckets); on
    CUDA the caller's current stream is then ordered after their work. Call it before a
    collective of your own while gradcomp work may be in flight (see the module docstring).
    Errors stay with their futures; without a worker it returns at once."""
    worker = current()
    if worker is not None:
        worker.wait_queued()


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


def all_of(futures, assemble: Callable[[list], Any], *, devices: Iterable[torch.device] = ()) -> torch.futures.Future:
    """A future of ``assemble([f.value() ...])`` once every future is done (a CUDA future over
    the CUDA ones among ``devices``: reading the values in the last callback orders its streams
    after every future's work); the first error (by position) is passed on with its own type."""
    out = _future(devices)
    futures = list(futures)
    remaining = [len(futures)]
    lock = threading.Lock()

    def finish() -> None:
        values: List[Any] = []
        error = None
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
