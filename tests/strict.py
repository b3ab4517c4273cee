"""Strict NCCL mode: gloo made as strict as NCCL where it matters, for the multi-rank tests.

``install()`` (called by ``tests/ranks.py`` in every rank process before ``fn`` runs) wraps
``torch.distributed``'s functions in this process so that, on gloo and CPU tensors:

1. Point-to-point between a pair is matched in issue order, tags ignored (every tag is forced
   to 0, so gloo matches FIFO per pair as NCCL does), and a pair's operations run one at a time
   as on NCCL's single stream per pair: an operation waits until every earlier one on the same
   (group, peer) has completed. ``batch_isend_irecv`` is one grouped operation (its ops proceed
   together; later ops on the pair wait for the whole batch); ``isend``/``irecv`` are each a
   batch of one. A wait that cannot progress within a bound raises ``RuntimeError("strict NCCL
   mode: ... would deadlock on NCCL ...")`` instead of hanging. A blocking ``send``/``recv``
   here stands for an NCCL enqueue (which returns at once) followed by the pair's stream
   running it; so a second thread may queue behind a p2p operation that is *running*, but two
   threads both waiting to enqueue on one pair race for the order and are refused at once.
2. A collective entered by a thread while another thread of the process is inside a collective
   on the same group is an error naming both threads and the group. So is one entered while
   another thread is inside a collective on another group of shared ranks (the worker's twin
   group beside a collective of the caller's): NCCL gives no progress guarantee across
   concurrent kernels of two communicators. The worker using its twin while the caller
   computes is legal.
3. Every tensor handed to a collective or p2p must be on the group's device (CPU unless a test
   calls ``declare_device``), and must not be one that gradcomp's own code allocated on the host
   without ``device=`` (``torch.empty/zeros/ones/full/tensor/arange/...`` with no device,
   ``torch.from_numpy``/``as_tensor``, ``Tensor.cpu()``, ``Tensor.to("cpu")``): under NCCL such a
   tensor would be a CPU tensor handed to NCCL. Tracking is done by wrapping those factories (not
   by a ``TorchFunctionMode``: its stack is thread-local, so the worker's and channels' threads
   would escape it, and it would tax every torch call); ``x.new_*``, ``torch.*_like`` and any call
   with ``device=`` are not tracked. ``.cpu()``/``.to("cpu")`` of a CPU tensor return a copy here,
   as they would for a CUDA tensor.
   gradcomp's ``Comm`` built off the main thread must be given its tensors' device (or run
   under ``on_device``): under NCCL it would otherwise take the thread's current device.
4. Object collectives are refused unless the calling thread has set its device: a rank's main
   thread counts as set (as a script calling ``torch.cuda.set_device(local_rank)``); any other
   thread must run inside ``gradcomp.collectives._comm.on_device``.
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_PACKAGES = ("compress", "collectives", "training", "sharded", "memory", "optim", "pipeline", "kernels")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "broadcast", "reduce",
                "gather", "scatter", "barrier")
_OBJECT = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
           "send_object_list", "recv_object_list")
_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "as_tensor", "asarray", "arange", "linspace", "logspace",
              "rand", "randn", "randint", "randperm", "empty_strided", "eye", "from_numpy", "frombuffer")

# Functions that build host tensors by contract, moved to the group's device by their one caller
# when it is not the CPU (so on CPU the move is skipped and the tensor would look like a defect):
# the self-describing wire format is made on the host and ``collectives/wire/frame.encode`` moves it.
_HOST_BY_CONTRACT = {(os.path.join("compress", "payload.py"), "to_tensor")}

_installed = False
_REAL: Dict[str, Callable] = {}
_cond = threading.Condition()
_queues: Dict[Tuple[Any, int], List["_Op"]] = {}  # (group, global peer) -> ops in issue order, not completed
_inside: Dict[Any, List[Any]] = {}  # group -> [thread, what, depth] of the thread inside a collective
_declared: Dict[Any, torch.device] = {}
_wait_s: Optional[float] = None
# rules switched off, for finding which rule catches what: GRADCOMP_STRICT_OFF=pairs,threads,groups,host,comm,objects
_OFF = frozenset(filter(None, os.environ.get("GRADCOMP_STRICT_OFF", "").split(",")))
_cross_group = "groups" not in _OFF
_host: Dict[int, Tuple[Any, str]] = {}  # storage data_ptr -> (weakref to the allocated tensor, "file:line")
_ours_cache: Dict[Tuple[str, str], bool] = {}


# ---- configuration ---------------------------------------------------------------------------
def install() -> None:
    """Wrap ``torch.distributed`` and the host factories in this process (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    for name in ("send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp") + _COLLECTIVES + _OBJECT:
        if hasattr(dist, name):
            _REAL[name] = getattr(dist, name)
    dist.send = _blocking_p2p("send")
    dist.recv = _blocking_p2p("recv")
    dist.isend = _async_p2p("isend")
    dist.irecv = _async_p2p("irecv")
    dist.batch_isend_irecv = _batch
    dist.P2POp = _P2POp
    for name in _COLLECTIVES:
        if name in _REAL:
            setattr(dist, name, _collective(name, _REAL[name], objects=False))
    for name in _OBJECT:
        if name in _REAL:
            setattr(dist, name, _collective(name, _REAL[name], objects=True))
    from torch.jit import _builtins

    builtins = _builtins._get_builtin_table()
    for name in _FACTORIES:
        if hasattr(torch, name):
            real = getattr(torch, name)
            wrapped = _factory(real)
            setattr(torch, name, wrapped)
            if id(real) in builtins:  # TorchScript (scripted in torch's own modules) sees the aten op
                _builtins._register_builtin(wrapped, builtins[id(real)])
    _REAL["Tensor.cpu"], _REAL["Tensor.to"] = torch.Tensor.cpu, torch.Tensor.to
    torch.Tensor.cpu = _tensor_cpu
    torch.Tensor.to = _tensor_to
    from gradcomp.collectives import _comm

    _REAL["_group_device"] = _comm._group_device
    _comm._group_device = _group_device


def _group_device(group, device, op):
    """Rule 3 for gradcomp's ``Comm``: off the main thread, its device must come from the
    tensors (``device=``) or the thread's ``on_device``; under NCCL it would otherwise be the
    thread's current CUDA device, GPU 0 whatever the rank uses."""
    from gradcomp.collectives._comm import device_is_set

    me = _me()
    if device is None and me is not threading.main_thread() and not device_is_set() and "comm" not in _OFF \
            and not me.name.startswith("strict-p2p"):
        raise _error(f"strict NCCL mode: {op} built its communicator in thread {me.name!r} with no device: "
                           f"under NCCL it would use that thread's current CUDA device, GPU 0 whatever this rank "
                           f"uses; pass the tensors' device or run the job under on_device(device)")
    return _REAL["_group_device"](group, device, op)


def installed() -> bool:
    return _installed


def declare_device(device, group=None) -> None:
    """The device ``group`` (None: the default group) stands for; every tensor handed to it must
    be there. Default: the CPU."""
    _declared["world" if group is None else group] = torch.device(device)


def set_wait(seconds: Optional[float]) -> None:
    """How long an operation may wait behind its pair's earlier ones before the mode calls it a
    deadlock (None: half the group's timeout, 20 s when unknown)."""
    global _wait_s
    _wait_s = seconds


def set_cross_group(on: bool) -> None:
    """Whether two threads inside collectives on two groups of shared ranks at once is an error
    (default: yes)."""
    global _cross_group
    _cross_group = on


# ---- helpers ---------------------------------------------------------------------------------
def _group(group):
    return c10d._get_default_group() if group is None or group is dist.GroupMember.WORLD else group


def _gname(pg) -> str:
    if pg is c10d._get_default_group():
        return "the default group"
    return f"group {getattr(pg, 'group_name', '?')!r} (ranks {dist.get_process_group_ranks(pg)})"


def _bound(pg) -> float:
    if _wait_s is not None:
        return _wait_s
    from gradcomp.collectives._comm import group_timeout

    t = group_timeout(pg)
    return 0.5 * t.total_seconds() if t is not None else 20.0


def _bind(real: Callable, args, kwargs) -> inspect.BoundArguments:
    b = _signature(real).bind(*args, **kwargs)
    b.apply_defaults()
    return b


@functools.lru_cache(maxsize=None)
def _signature(real: Callable) -> inspect.Signature:
    return inspect.signature(real)


def tensors_in(value, out: List[torch.Tensor]) -> List[torch.Tensor]:
    """The tensors in ``value`` (nested lists and tuples), appended to ``out``."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            tensors_in(v, out)
    return out


def _check_tensors(name: str, pg, tensors: List[torch.Tensor]) -> None:
    want = _declared.get(pg) or (_declared.get("world") if pg is c10d._get_default_group() else None) \
        or torch.device("cpu")
    for t in tensors:
        if t.device.type != want.type or (want.index is not None and t.device.index != want.index):
            raise _error(f"strict NCCL mode: {name} on {_gname(pg)} was handed a tensor on {t.device}; the "
                               f"group stands for {want} and under NCCL every tensor must live on its device")
        where = _origin(t) if "host" not in _OFF else None
        if where is not None:
            raise _error(f"strict NCCL mode: {name} was handed a tensor allocated on the host without device= "
                               f"at {where}; under NCCL it must live on the group's device")


def _error(message: str) -> RuntimeError:
    """The mode's error, also written to stderr at once: raised on a thread whose errors surface
    late (a pipeline channel, the worker), it is seen before the hang it prevents."""
    sys.stderr.write(f"[rank {dist.get_rank() if dist.is_initialized() else '?'}] {message}\n")
    return RuntimeError(message)


def _me() -> threading.Thread:
    return threading.current_thread()


# ---- rule 3: host tensors made by gradcomp's code --------------------------------------------
def _ours(frame) -> bool:
    """Whether ``frame`` runs gradcomp's own code (not tests, not torch)."""
    code = frame.f_code
    hit = _ours_cache.get((code.co_filename, code.co_name))
    if hit is None:
        real = os.path.realpath(code.co_filename)
        hit = any(real.startswith(os.path.join(_ROOT, p) + os.sep) for p in _PACKAGES) \
            and (os.path.relpath(real, _ROOT), code.co_name) not in _HOST_BY_CONTRACT
        _ours_cache[(code.co_filename, code.co_name)] = hit
    return hit


def _ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # tensors without storage (sparse, meta, wrapper subclasses)
        return 0


def _track(t: torch.Tensor, frame) -> None:
    _track_as(t, f"{os.path.relpath(frame.f_code.co_filename, _ROOT)}:{frame.f_lineno}")


def _track_as(t: torch.Tensor, where: str) -> None:
    p = _ptr(t)
    if p:
        def forget(ref, p=p):
            e = _host.get(p)
            if e is not None and e[0] is ref:
                del _host[p]

        _host[p] = (weakref.ref(t, forget), where)


def _origin(t: torch.Tensor) -> Optional[str]:
    p = _ptr(t) if t.device.type == "cpu" else 0
    e = _host.get(p) if p else None
    if e is None or e[0]() is None:  # views keep their base alive, so a dead base means a reused address
        return None
    return e[1]


def _untrack(t: torch.Tensor) -> None:
    _host.pop(_ptr(t), None)


def _shares(out: torch.Tensor, args) -> bool:
    p = _ptr(out)
    return any(isinstance(a, torch.Tensor) and _ptr(a) == p for a in args)


def _factory(real: Callable) -> Callable:
    @functools.wraps(real)
    def factory(*args, **kwargs):
        out = real(*args, **kwargs)
        if kwargs.get("device") is None and "out" not in kwargs and isinstance(out, torch.Tensor) \
                and out.device.type == "cpu":
            frame = sys._getframe(1)
            if _ours(frame) and not _shares(out, args):
                _track(out, frame)
        return out

    return factory


def _host_copy(self: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (a host copy of ``self`` made by gradcomp's code) as a tensor of its own, tracked:
    for a CUDA tensor it would be a copy, so it is one here too."""
    frame = sys._getframe(2)
    if not _ours(frame):
        return out
    if out.device.type == "cpu" and _ptr(out) == _ptr(self) and out.numel():
        out = out.clone()
    _track(out, frame)
    return out


def _tensor_cpu(self, *args, **kwargs):
    return _host_copy(self, _REAL["Tensor.cpu"](self, *args, **kwargs))


def _tensor_to(self, *args, **kwargs):
    out = _REAL["Tensor.to"](self, *args, **kwargs)
    target = kwargs.get("device")
    if target is None and args and isinstance(args[0], (str, torch.device, int, torch.Tensor)):
        target = args[0]
    if isinstance(target, str) and target == "cpu":
        return _host_copy(self, out)
    if target is not None:  # placed on a device the code computed: what NCCL would get is on it
        if _ptr(out) == _ptr(self):
            _untrack(out)
    elif _origin(self) is not None and _ptr(out) != _ptr(self):  # a dtype change of a host tensor
        _track_as(out, _origin(self))
    return out


# ---- rules 1 and 2 for point-to-point --------------------------------------------------------
class _Op:
    """One point-to-point operation (or batch) in its pairs' queues. The works of an
    asynchronous one are waited on a thread of their own (gloo's works report completion only
    once waited, and a gloo wait that times out closes the pair), so the op completes when its
    data has moved, as on NCCL's stream, whenever the caller waits."""

    def __init__(self, what: str, keys: List[Tuple[Any, int]]) -> None:
        self.what, self.keys, self.thread = what, keys, _me()
        self.issued = False
        self.done = threading.Event()
        self.works: List[Any] = []
        self.finished: List[threading.Event] = []
        self.errors: List[Optional[BaseException]] = []

    def complete(self) -> None:
        with _cond:
            if self.done.is_set():
                return
            self.done.set()
            for k in self.keys:
                q = _queues.get(k)
                if q is not None and self in q:
                    q.remove(self)
            _cond.notify_all()

    def start(self, works: List[Any]) -> None:
        self.works = works
        self.finished = [threading.Event() for _ in works]
        self.errors = [None] * len(works)
        threading.Thread(target=self._complete_works, name=f"strict-p2p {self.what}", daemon=True).start()

    def _complete_works(self) -> None:
        try:
            for i, w in enumerate(self.works):
                try:
                    w.wait()
                except BaseException as exc:  # handed to whoever waits this work
                    self.errors[i] = exc
                self.finished[i].set()
        finally:
            self.complete()

    def wait_work(self, i: int, timeout: Optional[float]) -> None:
        if not self.finished[i].wait(timeout):
            raise _error(f"strict NCCL mode: {self.what} did not complete within {timeout:g} s")
        if self.errors[i] is not None:
            raise self.errors[i]


class _Work:
    """The work an asynchronous p2p returns; ``wait`` re-raises what the backend raised."""

    def __init__(self, op: _Op, i: int) -> None:
        self._op, self._i = op, i

    def wait(self, timeout=None) -> bool:
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        self._op.wait_work(self._i, timeout)
        return True

    def is_completed(self) -> bool:
        return self._op.finished[self._i].is_set()

    def is_success(self) -> bool:
        return self.is_completed() and self._op.errors[self._i] is None

    def exception(self):
        return self._op.errors[self._i]

    def __getattr__(self, name):
        return getattr(self._op.works[self._i], name)


def _enqueue(op: _Op, pg) -> None:
    """Put ``op`` in its pairs' queues and wait (bounded) until everything before it completed."""
    me = op.thread
    if "pairs" in _OFF:
        op.issued = True
        return
    with _cond:
        for k in op.keys:
            for other in _queues.get(k, ()):
                if other.thread is not me and not other.issued:
                    raise _error(
                        f"strict NCCL mode: {op.what} on {_gname(pg)} from thread {me.name!r} while thread "
                        f"{other.thread.name!r} is queueing {other.what} on the same pair: two threads racing for "
                        f"one NCCL communicator (their order, hence the matching, differs from run to run)")
        before: List[_Op] = []
        for k in op.keys:
            q = _queues.setdefault(k, [])
            before.extend(o for o in q if o not in before)
            q.append(op)
    bound = _bound(pg)
    end = time.monotonic() + bound
    for prev in before:
        left = end - time.monotonic()
        if not prev.done.wait(max(left, 0.0)):
            op.complete()
            raise _error(
                f"strict NCCL mode: {op.what} on {_gname(pg)} would deadlock on NCCL: it is queued behind "
                f"{prev.what} (issued by thread {prev.thread.name!r}), which did not complete within {bound:g} s; "
                f"NCCL runs a pair's operations one at a time in issue order on one stream: post the ones that "
                f"must proceed together in one batch_isend_irecv, in an order both ranks agree on")
    op.issued = True


def _peer(name: str, b: inspect.BoundArguments, pg, sending: bool) -> int:
    a = b.arguments
    peer, gpeer = (a.get("dst"), a.get("group_dst")) if sending else (a.get("src"), a.get("group_src"))
    if peer is None and gpeer is None:
        raise _error(f"strict NCCL mode: {name} without a peer rank; NCCL has no receive from any source")
    return peer if peer is not None else dist.get_global_rank(pg, gpeer)


def _one(name: str, args, kwargs):
    real = _REAL[name]
    b = _bind(real, args, kwargs)
    pg = _group(b.arguments.get("group"))
    sending = "send" in name
    peer = _peer(name, b, pg, sending)
    _check_tensors(name, pg, [b.arguments["tensor"]])
    b.arguments["tag"] = 0
    op = _Op(f"{name} {'to' if sending else 'from'} rank {peer}", [(pg, peer)])
    return real, b, pg, op


def _blocking_p2p(name: str) -> Callable:
    def p2p(*args, **kwargs):
        real, b, pg, op = _one(name, args, kwargs)
        _enqueue(op, pg)
        try:
            return real(*b.args, **b.kwargs)
        finally:
            op.complete()

    p2p.__name__ = name
    return p2p


def _async_p2p(name: str) -> Callable:
    def p2p(*args, **kwargs):
        real, b, pg, op = _one(name, args, kwargs)
        _enqueue(op, pg)
        try:
            work = real(*b.args, **b.kwargs)
        except BaseException:
            op.complete()
            raise
        if work is None:
            op.complete()
            return None
        op.start([work])
        return _Work(op, 0)

    p2p.__name__ = name
    return p2p


def _real_op(fn: Callable) -> Callable:
    for name in ("isend", "irecv"):
        if fn is getattr(dist, name, None) or fn is _REAL.get(name):
            return _REAL[name]
    return fn


class _P2POp(c10d.P2POp):
    """``P2POp`` accepting the wrapped ``dist.isend``/``dist.irecv``."""

    def __new__(cls, op, tensor, *args, **kwargs):
        return super().__new__(cls, _real_op(op), tensor, *args, **kwargs)

    def __init__(self, op, tensor, *args, **kwargs):
        super().__init__(_real_op(op), tensor, *args, **kwargs)


def _batch(p2p_op_list):
    if not p2p_op_list:
        return _REAL["batch_isend_irecv"](p2p_op_list)
    pg = _group(p2p_op_list[0].group)
    keys, parts = [], []
    for p in p2p_op_list:
        p.op = _real_op(p.op)
        sending = p.op is _REAL["isend"]
        _check_tensors("batch_isend_irecv", pg, [p.tensor])
        p.tag = 0
        if (pg, p.peer) not in keys:
            keys.append((pg, p.peer))
        parts.append(f"{'isend to' if sending else 'irecv from'} rank {p.peer}")
    op = _Op(f"batch_isend_irecv [{', '.join(parts)}]", keys)
    _enqueue(op, pg)
    try:
        works = list(_REAL["batch_isend_irecv"](p2p_op_list))
    except BaseException:
        op.complete()
        raise
    if not works:
        op.complete()
        return works
    op.start(works)
    return [_Work(op, i) for i in range(len(works))]


# ---- rule 2 for collectives, rule 4 for object collectives -----------------------------------
def _collective(name: str, real: Callable, *, objects: bool) -> Callable:
    def collective(*args, **kwargs):
        b = _bind(real, args, kwargs)
        pg = _group(b.arguments.get("group"))
        me = _me()
        if objects and me is not threading.main_thread() and "objects" not in _OFF:
            from gradcomp.collectives._comm import device_is_set

            if not device_is_set():
                raise _error(
                    f"strict NCCL mode: {name} on {_gname(pg)} from thread {me.name!r}, which has not set its device: "
                    f"NCCL's object collectives stage through torch.cuda.current_device(), GPU 0 in a new thread; run "
                    f"it under gradcomp.collectives._comm.on_device(device)")
        if not objects:
            _check_tensors(name, pg, tensors_in(list(b.arguments.values()), []))
        with _cond:
            inside = _inside.get(pg)
            if inside is not None and inside[0] is not me and "threads" not in _OFF:
                raise _error(
                    f"strict NCCL mode: {name} on {_gname(pg)} entered by thread {me.name!r} while thread "
                    f"{inside[0].name!r} is inside {inside[1]} on the same group; an NCCL communicator must be "
                    f"driven by one thread at a time")
            if _cross_group:
                _check_other_groups(name, pg, me)
            if inside is None or inside[0] is not me:
                _inside[pg] = [me, name, 1]
            else:
                inside[2] += 1
        try:
            return real(*b.args, **b.kwargs)
        finally:
            with _cond:
                entry = _inside.get(pg)
                if entry is not None and entry[0] is me:
                    entry[2] -= 1
                    if entry[2] == 0:
                        del _inside[pg]

    collective.__name__ = name
    return collective


@functools.lru_cache(maxsize=None)
def _ranks(pg) -> frozenset:
    return frozenset(dist.get_process_group_ranks(pg))


def _check_other_groups(name: str, pg, me: threading.Thread) -> None:
    """Rule 2 across groups: another thread inside a collective on another group of shared
    ranks (called with ``_cond`` held)."""
    for other_pg, (thread, what, _) in _inside.items():
        if thread is me or other_pg is pg:
            continue
        shared = _ranks(pg) & _ranks(other_pg)
        if len(shared) > 1:
            raise _error(
                f"strict NCCL mode: {name} on {_gname(pg)} entered by thread {me.name!r} while thread {thread.name!r} "
                f"is inside {what} on {_gname(other_pg)}, which shares ranks {sorted(shared)}: two communicators "
                f"driven from two threads at once can deadlock on NCCL (no progress guarantee across concurrent "
                f"kernels, and the ranks may launch them in different orders); let one finish before the other "
                f"starts (e.g. wait for gradcomp's jobs in flight before a collective of your own)")
