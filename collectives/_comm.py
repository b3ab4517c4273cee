"""A process group seen from one rank: thin wrappers over ``torch.distributed`` that count
bytes, time the communication and turn a backend failure into one clear error.

Byte convention (per rank, counted from the tensors handed to the backend):

- ``all_reduce`` of ``n`` bytes: ``2 (w-1)/w * n`` sent and as much received — what a ring
  allreduce moves, whatever algorithm the backend picks;
- ``all_gather`` of ``n`` bytes per rank: ``(w-1) * n`` sent and received (each rank's block
  reaches the ``w-1`` others; padding included);
- ``all_to_all``: the blocks addressed to other ranks are sent, those from other ranks are
  received (the block a rank keeps for itself is not counted);
- ``send``/``recv``: the tensor's bytes.

With one process (no process group, or a group of one) nothing is sent and nothing counted.
"""
from __future__ import annotations

import contextlib
import os
import threading
from datetime import timedelta
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist

from gradcomp.kernels.memory import empty

from ._telemetry import Record

T = TypeVar("T")


class CommunicationError(RuntimeError):
    """A collective failed in the backend: a peer died, timed out or called something else."""


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def resolve(group) -> Optional[object]:
    """The process group object for ``group`` (``None`` means the default group), or None
    when no process group is initialised (see :func:`check_alone`)."""
    if not initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised; "
                             "call init_process_group first or pass group=None")
        check_alone()
        return None
    return dist.group.WORLD if group is None else group


def check_alone() -> None:
    """Without a process group, refuse to run when a launcher set ``WORLD_SIZE`` above 1: the
    local round trip would leave every rank silently training on its own gradients."""
    world = os.environ.get("WORLD_SIZE", "").strip()
    if world.isdigit() and int(world) > 1:
        raise ValueError(f"WORLD_SIZE={world} says this process is one of {world}, but torch.distributed is not "
                         f"initialised; call init_process_group first, or unset WORLD_SIZE to run alone")


def world_of(group) -> int:
    """World size of ``group`` (None: the default group); 1 without a process group (see
    :func:`check_alone`)."""
    if not initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised; "
                             "call init_process_group first or pass process_group=None")
        check_alone()
        return 1
    return dist.get_world_size(group)


def rank_of(group) -> int:
    """This process's rank in ``group`` (None: the default group); 0 without a process group."""
    return dist.get_rank(group) if initialized() else 0


def backend_for(group, device_type: str) -> Optional[str]:
    """The backend ``group`` (None: the default group) uses for tensors of ``device_type``
    ("cpu", "cuda"): a composite backend such as ``"cpu:gloo,cuda:nccl"`` is read per device
    type; a plain one ("gloo", "nccl") serves every type. None when the group has none for it."""
    name = str(dist.get_backend(group)).lower()
    if ":" not in name:
        return name
    for part in name.split(","):
        dev, _, backend = part.partition(":")
        if dev.strip() == device_type:
            return backend.strip()
    return None


def uses_nccl(group) -> bool:
    """Whether CUDA tensors handed to ``group`` go through NCCL."""
    return backend_for(group, "cuda") == "nccl"


def group_timeout(group) -> Optional[timedelta]:
    """The timeout a group was created with (None when the backend does not say)."""
    try:
        pg = dist.group.WORLD if group is None else group
        order = ("cuda", "cpu") if uses_nccl(pg) else ("cpu", "cuda")
    except Exception:
        return None
    for device_type in order:
        try:
            return pg._get_backend(torch.device(device_type)).options._timeout
        except Exception:  # private API: absent on some backends and versions
            continue
    return None


_thread = threading.local()


@contextlib.contextmanager
def on_device(device) -> Iterator[None]:
    """Run the block with ``device`` as this thread's device: ``torch.cuda.device(device)`` for a
    CUDA device (a new thread's current device is GPU 0, whatever the main thread set), and on
    any device a mark that this thread chose its device (read by :func:`device_is_set`)."""
    device = torch.device(device)
    before = getattr(_thread, "device", None)
    _thread.device = device
    try:
        if device.type == "cuda":
            with torch.cuda.device(device):
                yield
        else:
            yield
    finally:
        _thread.device = before


# ---- work beside the wire: local work while a collective's bytes are in flight ---------------
class Beside:
    """Local work (no collective, no host read) that a :class:`Comm` runs once, on the calling
    thread, while one of its collectives is on the wire: the first one that hands the backend
    at least ``min_bytes`` per rank issues asynchronously, runs the work (after its own
    ``while_sending``) and then waits. What a bucket exchange hands its collectives for the
    next bucket's local phase (:meth:`gradcomp.collectives.bucket.BucketExchange.start`)."""

    def __init__(self, work: Optional[Callable[[], None]], min_bytes: int = 0) -> None:
        self.work, self.min_bytes = work, min_bytes

    def take(self, nbytes: int) -> Optional[Callable[[], None]]:
        """The work, taken (it runs once), for a collective of ``nbytes`` per rank; else None."""
        work = self.work
        if work is None or nbytes < self.min_bytes:
            return None
        self.work = None
        return work


def device_is_set() -> bool:
    """Whether this thread runs inside :func:`on_device`."""
    return getattr(_thread, "device", None) is not None


def thread_device() -> Optional[torch.device]:
    """The device :func:`on_device` set for this thread, or None."""
    return getattr(_thread, "device", None)


def _expected_device(tensors_or_device) -> Optional[torch.device]:
    if tensors_or_device is None:
        return None
    if isinstance(tensors_or_device, (str, torch.device)):
        d = torch.device(tensors_or_device)
        return d if d.type == "cuda" else None
    if isinstance(tensors_or_device, torch.Tensor):
        tensors_or_device = [tensors_or_device]
    for t in tensors_or_device:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            return t.device
    return None


def check_device_set(group, tensors_or_device: Any = None, what: str = "gradcomp") -> None:
    """Under NCCL (a plain or composite backend with NCCL for CUDA), raise ``RuntimeError``
    unless the current CUDA device is the one this rank works on: the device of the first
    CUDA tensor (or the device) given, else ``LOCAL_RANK``. NCCL's object collectives (and
    every NCCL call without a tensor) use the current device, so without
    ``torch.cuda.set_device(local_rank)`` every rank would use GPU 0 and hang or fail."""
    if not initialized() or not uses_nccl(group):
        return
    want = _expected_device(tensors_or_device)
    if want is None:
        local = os.environ.get("LOCAL_RANK", "").strip()
        if not local.isdigit():
            return
        want = torch.device("cuda", int(local))
    index = 0 if want.index is None else want.index
    current = torch.cuda.current_device()
    if current != index:
        raise RuntimeError(
            f"{what}: this rank works on cuda:{index} but the current CUDA device is cuda:{current}; NCCL uses the "
            f"current device (object collectives, barriers, the communicator itself), so call "
            f"torch.cuda.set_device(local_rank) before init_process_group (or at least before building the layer)")


class Comm:
    """``group`` from this rank: rank, size, device for control tensors, counted operations.

    ``device``: the device the caller's tensors are on. Under NCCL a CUDA ``device`` is the
    group's device; without one it is the device :func:`on_device` set for this thread, or on
    the main thread only, the current CUDA device (another thread's is GPU 0, whatever the
    rank uses: refused). Other backends: the CPU. ``beside``: see :class:`Beside`."""

    def __init__(self, group, record: Record, op: str, device: Optional[torch.device] = None, *,
                 beside: Optional[Beside] = None) -> None:
        self.record = record
        self.op = op
        self.beside = beside  # work for the wire time of a collective (see Beside)
        self.group = resolve(group)
        if self.group is None:
            self.rank, self.size = 0, 1
            self.device = torch.device("cpu")
            return
        if self.group == dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(self.group) < 0:
            raise ValueError(f"{op}: this rank (global rank {dist.get_rank()}) is not a member of the group it was given")
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.device = _group_device(self.group, device, op)
        record.device = device if device is not None else self.device  # CUDA phases timed by events

    def global_rank(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    # ---- counted operations ----------------------------------------------------------------
    # Tensors on another device than the backend's (CUDA tensors under gloo) are staged
    # through it: gloo's CUDA support differs between operations.
    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        return t.contiguous() if t.device.type == self.device.type else t.to(self.device)

    def all_reduce_(self, t: torch.Tensor, *, count: bool = True) -> torch.Tensor:
        """Sum ``t`` over the group, in place."""
        if self.size > 1:
            buf = self._wire(t)
            self._overlapped("all_reduce", lambda asy: dist.all_reduce(buf, group=self.group, async_op=asy), None,
                             _nbytes(buf))
            if buf is not t:
                t.copy_(buf)
            if count:
                moved = _nbytes(t) * 2 * (self.size - 1) // self.size
                self.record.bytes_sent += moved
                self.record.bytes_recv += moved
        return t

    def reduce_(self, t: torch.Tensor, dst: int) -> torch.Tensor:
        """Sum ``t`` over the group onto rank ``dst`` (in place there; elsewhere ``t`` is only sent)."""
        if self.size > 1:
            buf = self._wire(t)
            self._run(f"reduce onto rank {dst}", lambda: dist.reduce(buf, group=self.group, group_dst=dst))
            if self.rank == dst:
                if buf is not t:
                    t.copy_(buf)
                self.record.bytes_recv += _nbytes(t) * (self.size - 1)
            else:
                self.record.bytes_sent += _nbytes(t)
        return t

    def broadcast_(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Rank ``src``'s ``t`` into ``t`` on every rank, in place."""
        if self.size > 1:
            buf = self._wire(t)
            self._run(f"broadcast from rank {src}", lambda: dist.broadcast(buf, group=self.group, group_src=src))
            if self.rank == src:
                self.record.bytes_sent += _nbytes(t) * (self.size - 1)
            else:
                if buf is not t:
                    t.copy_(buf)
                self.record.bytes_recv += _nbytes(t)
        return t

    def all_gather(self, t: torch.Tensor, while_sending: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """``(w, *t.shape)``: every rank's ``t`` in rank order (same shape on every rank; an
        empty ``t`` is not sent: no backend is asked to move no bytes).
        ``while_sending``: local work run while the all-gather is in flight (it must not write
        ``t``; the calling thread issues nothing else on the group meanwhile)."""
        if self.size == 1 or not t.numel():  # alone, or no bytes on any rank (every rank passes t's shape)
            if while_sending is not None:
                while_sending()
            return t.unsqueeze(0).clone() if self.size == 1 else t.new_empty((self.size, *t.shape))
        src = self._wire(t)
        out = src.new_empty((self.size, *t.shape))
        self._overlapped("all_gather", lambda asy: dist.all_gather(list(out.unbind(0)), src, group=self.group,
                                                                  async_op=asy), while_sending, _nbytes(src))
        moved = _nbytes(t) * (self.size - 1)
        self.record.bytes_sent += moved
        self.record.bytes_recv += moved
        return out if out.device == t.device else out.to(t.device)

    def all_gather_start(self, t: torch.Tensor, out: Optional[torch.Tensor] = None
                         ) -> Tuple[torch.Tensor, Optional[Any]]:
        """Start gathering every rank's 1-D ``t`` (same length everywhere) into ``out``
        (``(w, t.numel())``, a new tensor when None): ``(out, work)``, ``work`` the backend's
        asynchronous work (None when nothing travels). ``out`` holds the result once
        :meth:`finish` has waited on ``work``; ``t`` must not be written before then. Other
        collectives may be issued on the group meanwhile, from this thread, in the same order
        on every rank (NCCL orders them on its stream, gloo by sequence number)."""
        out = t.new_empty((self.size, t.numel())) if out is None else out
        if out.shape != (self.size, t.numel()):
            raise ValueError(f"{self.op}: all_gather_start's out must be ({self.size}, {t.numel()}), "
                             f"got {tuple(out.shape)}")
        if self.size == 1 or not t.numel():
            if self.size == 1:
                out[0].copy_(t)
            return out, None
        src = self._wire(t)
        rows = out if out.device.type == self.device.type and out.is_contiguous() else \
            torch.empty(out.shape, dtype=out.dtype, device=self.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the older name
        work = self._run("all_gather", lambda: gather(rows.view(-1), src, group=self.group, async_op=True))
        moved = _nbytes(t) * (self.size - 1)
        self.record.bytes_sent += moved
        self.record.bytes_recv += moved
        return out, (work, rows, src)

    def finish(self, out: torch.Tensor, started: Optional[Any]) -> torch.Tensor:
        """Wait for what :meth:`all_gather_start` started (the wait is comm time) and return ``out``."""
        if started is not None:
            work, rows, _src = started  # the send buffer lives until the wire is done
            self._run("all_gather", work.wait)
            if rows.is_cuda:  # read (decoded) on the stream that waits, perhaps not the one it was made on
                rows.record_stream(torch.cuda.current_stream(rows.device))
            if rows is not out:
                out.copy_(rows)
        return out

    def all_to_all(self, inp: torch.Tensor, in_splits: Sequence[int], out_splits: Sequence[int],
                   while_sending: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """Block ``j`` of the 1-D ``inp`` goes to rank ``j``; the result holds, in rank order,
        the blocks every rank addressed to this one. ``while_sending``: as for :meth:`all_gather`."""
        if self.size == 1:
            if while_sending is not None:
                while_sending()
            return inp.clone()
        src = self._wire(inp)
        out = src.new_empty(int(sum(out_splits)))
        self._overlapped("all_to_all", lambda asy: dist.all_to_all_single(
            out, src, [int(s) for s in out_splits], [int(s) for s in in_splits], group=self.group, async_op=asy),
            while_sending, _nbytes(src) // max(self.size, 1))
        item = inp.element_size()
        self.record.bytes_sent += item * (int(sum(in_splits)) - int(in_splits[self.rank]))
        self.record.bytes_recv += item * (int(sum(out_splits)) - int(out_splits[self.rank]))
        return out if out.device == inp.device else out.to(inp.device)

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        buf = self._wire(t)
        self._run(f"send to rank {dst}", lambda: dist.send(buf, dst, group=self.group, tag=tag))
        self.record.bytes_sent += _nbytes(t)

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        buf = self._wire(t)
        self._run(f"recv from rank {src}", lambda: dist.recv(buf, src, group=self.group, tag=tag))
        if buf is not t:
            t.copy_(buf)
        self.record.bytes_recv += _nbytes(t)
        return t

    def mean_(self, t: torch.Tensor, *, count: bool = True) -> torch.Tensor:
        """Average ``t`` over the group in place, by gradcomp's one rule: scaled by ``1 / w``
        before the sum, rounded as PyTorch rounds it — ``div_`` for 16-bit tensors (its
        fp16/bf16 hooks; a sum can overflow 16 bits where the mean does not) and a
        multiplication by ``1/w`` otherwise (DDP's reducer). So ``allreduce(t, "none")``, the
        ``none`` hook and plain DDP give the same bits, for any world size."""
        if self.size > 1 and t.numel():
            scale_(t, self.size)
            self.all_reduce_(t, count=count)
        return t

    def mean(self, t: torch.Tensor, *, count: bool = True) -> torch.Tensor:
        """:meth:`mean_` into a new tensor, ``t`` untouched: the scaling writes the copy (one
        pass where a clone and then :meth:`mean_` make two), the same bits."""
        if self.size == 1 or not t.numel():
            return t.clone()
        out = empty(t.numel(), t.dtype, t.device).view(t.shape)  # on CPU in huge pages: fewer page faults
        scale_into(t, self.size, out)
        return self.all_reduce_(out, count=count)

    def exchange(self, values: List[int]) -> torch.Tensor:
        """All-gather a small int64 vector: ``(w, len(values))`` on the CPU."""
        row = torch.tensor(values, dtype=torch.int64, device=self.device)
        return self.all_gather(row).cpu()

    def _overlapped(self, what: str, issue: Callable[[bool], Any], while_sending: Optional[Callable[[], None]],
                    nbytes: int = 0) -> None:
        """``issue(False)`` (a blocking collective), or with ``while_sending`` the collective
        issued asynchronously, the work run, and then waited for, also when the work raises (the
        collective completes on every rank either way). The work's time is not comm time. This
        Comm's :class:`Beside` work, when this collective of ``nbytes`` per rank takes it, runs
        after ``while_sending``."""
        extra = self.beside.take(nbytes) if self.beside is not None else None
        if while_sending is None and extra is None:
            self._run(what, lambda: issue(False))
            return
        work = self._run(what, lambda: issue(True))
        try:
            if while_sending is not None:
                while_sending()
            if extra is not None:
                extra()
        finally:
            self._run(what, work.wait)

    # ---- errors ----------------------------------------------------------------------------
    def _run(self, what: str, fn: Callable[[], T]) -> T:
        with self.record.timing("comm"):
            try:
                return fn()
            except RuntimeError as exc:
                raise CommunicationError(self._explain(what, exc)) from exc

    def _explain(self, what: str, exc: BaseException) -> str:
        timeout = group_timeout(self.group)
        within = f"within the group timeout of {timeout.total_seconds():g} s" if timeout else "in time"
        said = " ".join(str(exc).split())[:300]
        return (f"{self.op}: {what} failed on rank {self.rank} of a group of {self.size}: a peer died, "
                f"did not answer {within}, or called a different collective (backend: {said})")


def _group_device(group, device: Optional[torch.device], op: str) -> torch.device:
    if not uses_nccl(group):
        return torch.device("cpu")
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda":
            return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        if device.type == "cpu" and backend_for(group, "cpu") not in (None, "nccl"):
            return device  # a composite backend ("cpu:gloo,cuda:nccl") takes the CPU tensors as they are
    mine = thread_device()
    if mine is not None and mine.type == "cuda":
        return mine
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(f"{op}: NCCL needs the device of the tensors, and thread "
                           f"{threading.current_thread().name!r} was given none: its current CUDA device is GPU 0 "
                           f"whatever this rank uses; pass device= or run it under on_device(device)")
    return torch.device("cuda", torch.cuda.current_device())


def scale_(t: torch.Tensor, world: int) -> torch.Tensor:
    """``t / world`` in place, rounded as PyTorch rounds it (see :meth:`Comm.mean_`)."""
    return scale_into(t, world, t)


def scale_into(t: torch.Tensor, world: int, out: torch.Tensor) -> torch.Tensor:
    """``t / world`` written into ``out`` (``t`` itself, or a tensor of its shape and dtype),
    rounded as :func:`scale_` rounds it."""
    if t.dtype in (torch.float16, torch.bfloat16):
        return torch.div(t, world, out=out)
    return torch.mul(t, 1.0 / world, out=out)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
