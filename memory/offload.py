"""``offload_activations``: saved activations kept in host memory, brought back ahead of use.

::

    with offload_activations(prefetch=2):
        loss = model(x).sum()
    loss.backward()

Inside the block every CUDA floating tensor that autograd saves (``min_numel`` elements or more,
not a parameter) is copied to a host buffer on a side stream, and its device memory is let go
once the copy is done: the forward pass stops keeping its activations on the device. Backward
uses saved tensors in about the reverse order they were saved in, so when it unpacks one, the
next ``prefetch`` in that order are copied back on the side stream, and their transfers overlap
with the compute that comes before their use. ``codec=`` (a name from ``memory.codecs``)
compresses on the device first, so fewer bytes cross the bus.

- Host buffers come from a pool keyed by size (:func:`host_pool`, pinned by default). A buffer
  goes back when autograd frees the saved tensor or once the tensor is back on the device, so a
  second training step allocates no host memory.
- A storage saved twice (a ReLU output that the next Linear saves too) is offloaded once.
- At most ``max_in_flight`` copies to the host are outstanding: a save beyond it waits for the
  oldest, so device memory stays bounded when the bus is slower than the compute.
- The first tensor backward uses (the last saved) is copied back when it is used; each later one
  has been on its way since the use of one before it.
- Once back, a tensor stays on the device until autograd frees it: right after its node ran in
  an ordinary backward, with the graph under ``retain_graph=True`` (a second backward finds it).
- A saved tensor changed in place before its copy is done may reach the host either way (without
  hooks autograd would refuse such a backward; with hooks it cannot tell).
- A stochastic codec draws its random streams from a fresh key each time the block is entered.
- CPU tensors have no faster memory to free: the block leaves them as they are (a no-op), or,
  with a codec, stores them compressed and nothing else.
- What is held is reported to the ledger, so an enclosing ``MemoryMeter`` counts it: device
  bytes while a tensor (or its copy brought back) is on the device, host bytes for host copies.
"""
from __future__ import annotations

import bisect
import collections
import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Hashable, List, Optional, Sequence, Set, Tuple, TypeVar, Union

import torch

from gradcomp.kernels import rng

from . import _ledger
from .codecs import ActivationCodec, Packed, get_codec
from .meter import _Held, is_parameter

__all__ = ["HostPool", "OffloadActivations", "OffloadStats", "host_pool", "offload_activations"]

T = TypeVar("T")
Payload = Any  # a tensor, or a codec's ``Packed``

_MASK64 = (1 << 64) - 1
_keys = itertools.count()  # a fresh codec stream key per entry of any block
_keys_lock = threading.Lock()


# --------------------------------------------------------------------------- host buffers

class HostPool:
    """Host buffers (flat ``uint8``) for offloaded tensors, reused by byte size.

    Kept apart per device (a buffer is only read and written on that device's side stream, so
    reuse is ordered after its last copy) and per pinning. ``allocations`` counts the buffers
    ever allocated: a steady training loop stops adding to it after its first step."""

    def __init__(self) -> None:
        self._free: Dict[Tuple[int, bool, str], List[torch.Tensor]] = {}
        self._lock = threading.RLock()
        self.allocations = 0
        self.allocated_bytes = 0

    def take(self, nbytes: int, pinned: bool, device: torch.device,
             alloc: Callable[[int, bool], torch.Tensor]) -> torch.Tensor:
        """A free buffer of ``nbytes``, or a new one from ``alloc(nbytes, pinned)``."""
        key = (nbytes, pinned, str(device))
        with self._lock:
            free = self._free.get(key)
            if free:
                return free.pop()
            self.allocations += 1
            self.allocated_bytes += nbytes
        return alloc(nbytes, pinned)

    def give(self, buf: torch.Tensor, pinned: bool, device: torch.device) -> None:
        with self._lock:
            self._free.setdefault((buf.numel(), pinned, str(device)), []).append(buf)

    @property
    def cached_bytes(self) -> int:
        """Bytes of free buffers waiting for reuse."""
        with self._lock:
            return sum(key[0] * len(bufs) for key, bufs in self._free.items())

    def clear(self) -> None:
        """Let the free buffers go (buffers in use return to the pool later as usual)."""
        with self._lock:
            self._free.clear()


_default_pool = HostPool()


def host_pool() -> HostPool:
    """The pool every ``offload_activations`` block shares by default."""
    return _default_pool


class _Token:
    """The owner of one ledger holding: dropping it releases the holding."""

    __slots__ = ("__weakref__",)


def _hold(key: Optional[Hashable], nbytes: int, where: str = "device") -> Optional[_Token]:
    """Report ``nbytes`` under ``key`` (the token's own identity when ``None``) to the open meters."""
    if not _ledger.active():
        return None
    token = _Token()
    _ledger.hold(token, key if key is not None else ("offload", id(token)), nbytes, where)
    return token


def _hold_payload(payload: Payload) -> Optional[_Token]:
    """Device bytes of a payload: a tensor by its storage (as the meter counts it), a packed
    form by its identity, at its compressed size."""
    if not _ledger.active():
        return None
    if isinstance(payload, torch.Tensor):
        return _hold(("storage",) + _ledger.storage_key(payload), _ledger.storage_nbytes(payload))
    return _hold(("packed", id(payload)), int(payload.nbytes))


def _tensors(payload: Payload) -> Sequence[torch.Tensor]:
    return (payload,) if isinstance(payload, torch.Tensor) else tuple(payload.tensors)


class _Lease:
    """A pool buffer lent to one saved tensor; ``release`` gives it back once."""

    __slots__ = ("pool", "buf", "pinned", "device", "token")

    def __init__(self, pool: HostPool, buf: torch.Tensor, pinned: bool, device: torch.device) -> None:
        self.pool, self.pinned, self.device = pool, pinned, device
        self.buf: Optional[torch.Tensor] = buf
        self.token = _hold(("host", buf.data_ptr()), buf.numel(), "host")

    def release(self) -> None:
        buf, self.buf, self.token = self.buf, None, None
        if buf is not None:
            self.pool.give(buf, self.pinned, self.device)


# --------------------------------------------------------------------------- transfers

class _Mover:
    """Where the bytes travel, apart from the logic that decides when: this base copies at once
    on the calling thread (CPU), :class:`_CudaMover` on a side stream. ``copy`` does the copy
    and returns what it made; ``to_host``/``to_device`` return it with an event that ``done``
    tells about, ``sync`` waits for on the host and ``wait`` makes the current stream wait for
    (``None``: nothing to wait for). ``index`` is the tensor's pack index (for the tests' log)."""

    def alloc(self, nbytes: int, pinned: bool) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def to_host(self, index: int, device: torch.device, copy: Callable[[], T]) -> Tuple[T, Any]:
        return copy(), None

    def to_device(self, index: int, device: torch.device, copy: Callable[[], T]) -> Tuple[T, Any]:
        return copy(), None

    def done(self, event: Any) -> bool:
        return True

    def sync(self, event: Any) -> None:
        pass

    def wait(self, index: int, device: torch.device, event: Any, tensors: Sequence[torch.Tensor]) -> None:
        pass


_side_streams: Dict[torch.device, Any] = {}
_side_lock = threading.Lock()


def _side_stream(device: torch.device) -> Any:
    """One side stream per device, shared by every block: pool buffers of a device are then only
    touched on one stream, in order."""
    with _side_lock:
        stream = _side_streams.get(device)
        if stream is None:
            stream = _side_streams[device] = torch.cuda.Stream(device)
        return stream


class _CudaMover(_Mover):
    """Copies on the device's side stream, after the work queued on the current stream."""

    def _side(self, device: torch.device, copy: Callable[[], T]) -> Tuple[T, Any]:
        current = torch.cuda.current_stream(device)
        side = _side_stream(device)
        ready = torch.cuda.Event()
        ready.record(current)
        side.wait_event(ready)
        with torch.cuda.stream(side):
            out = copy()
        event = torch.cuda.Event()
        event.record(side)
        return out, event

    def to_host(self, index: int, device: torch.device, copy: Callable[[], T]) -> Tuple[T, Any]:
        return self._side(device, copy)

    def to_device(self, index: int, device: torch.device, copy: Callable[[], T]) -> Tuple[T, Any]:
        return self._side(device, copy)

    def done(self, event: Any) -> bool:
        return event is None or bool(event.query())

    def sync(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def wait(self, index: int, device: torch.device, event: Any, tensors: Sequence[torch.Tensor]) -> None:
        if event is None:
            return
        current = torch.cuda.current_stream(device)
        current.wait_event(event)
        for t in tensors:  # made on the side stream, used on this one: not reused before that use
            if t.is_cuda:
                t.record_stream(current)


# --------------------------------------------------------------------------- what autograd keeps

class _Transfer:
    """A copy to the host in flight: keeps its device source alive (and counted) until done."""

    __slots__ = ("event", "source", "token")

    def __init__(self, event: Any, source: Payload) -> None:
        self.event, self.source = event, source
        self.token = _hold_payload(source)

    def finish(self) -> None:
        self.source = self.token = None


def _dense_stride(t: torch.Tensor) -> Tuple[int, ...]:
    """``t``'s strides if its layout is dense (contiguous, channels-last, transposed), else
    contiguous ones: the host copy holds exactly ``t.numel()`` elements."""
    return tuple(torch.empty_like(t, device="meta").stride())


class _Entry:
    """An offloaded saved tensor, as autograd keeps it (one object per storage saved, however
    often). Its payload (the tensor, or a codec's payload tensors) is in ``host`` (pool views),
    ``fetched`` (copy back started, not yet used) or ``resident`` (back on the device for good)."""

    __slots__ = ("index", "device", "packing", "host", "leases", "d2h", "fetched", "fetched_event",
                 "resident", "token", "dedup_key", "_dead", "__weakref__")

    def __init__(self, index: int, device: torch.device, packing: Optional[Tuple[Any, ...]],
                 dead: Deque[Tuple[int, Hashable]]) -> None:
        self.index, self.device, self._dead = index, device, dead
        self.packing = packing  # (codec, shape, dtype, meta) of a codec payload; None: a plain tensor
        self.host: List[torch.Tensor] = []
        self.leases: List[_Lease] = []
        self.d2h: Optional[_Transfer] = None
        self.fetched: Payload = None
        self.fetched_event: Any = None
        self.resident: Payload = None
        self.token: Optional[_Token] = None
        self.dedup_key: Hashable = None

    def rebuild(self, parts: List[torch.Tensor]) -> Payload:
        """The payload from its tensors on the device."""
        if self.packing is None:
            return parts[0]
        codec, shape, dtype, meta = self.packing
        return Packed(codec, parts, shape, dtype, self.device, meta)

    def drop_host(self) -> None:
        self.host = []
        for lease in self.leases:
            lease.release()
        self.leases = []

    def __del__(self) -> None:  # autograd let it go: its buffers back to the pool, its index forgotten
        try:
            self.drop_host()
            self._dead.append((self.index, self.dedup_key))
        except Exception:  # interpreter shutdown
            pass


class _Encoded:
    """A CPU tensor stored compressed (the codec-only path)."""

    __slots__ = ("packed", "token", "dedup_key", "__weakref__")

    def __init__(self, packed: Packed) -> None:
        self.packed = packed
        self.token = _hold_payload(packed)
        self.dedup_key: Hashable = None


@dataclass
class OffloadStats:
    """What a block did, counted over its life (every ``with`` on it)."""

    saved: int = 0          # tensors autograd saved in the block
    kept: int = 0           # stored as they were (CPU, small, parameters, not floating)
    offloaded: int = 0      # copied to the host
    encoded: int = 0        # encoded by the codec (offloaded or, on the CPU, kept compressed)
    deduplicated: int = 0   # saves whose storage was already stored
    bytes_to_host: int = 0  # bytes copied to the host (the payload's with a codec)
    prefetched: int = 0     # unpacks whose tensor had been brought back ahead of use
    on_demand: int = 0      # unpacks that had to start their copy back then
    resident: int = 0       # unpacks served by a device copy already there (second use, copy out unfinished)
    max_ahead: int = 0      # most tensors brought back ahead of use at once
    waited_out: int = 0     # saves that waited for an earlier copy out (``max_in_flight``)


# --------------------------------------------------------------------------- the block

class OffloadActivations:
    """The context manager :func:`offload_activations` returns; reusable (one ``with`` at a time).
    ``stats``: an :class:`OffloadStats`."""

    def __init__(self, prefetch: int = 2, *, pin_memory: bool = True, codec: Union[str, ActivationCodec, None] = None,
                 min_numel: int = 4096, max_in_flight: int = 4, _mover: Optional[_Mover] = None,
                 _offload_cpu: bool = False, _pool: Optional[HostPool] = None) -> None:
        for name, value, least in (("prefetch", prefetch, 0), ("min_numel", min_numel, 0),
                                   ("max_in_flight", max_in_flight, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"offload_activations: {name} must be an int >= {least}, got {value!r}")
        if not isinstance(pin_memory, bool):
            raise ValueError(f"offload_activations: pin_memory must be True or False, got {pin_memory!r}")
        self.prefetch, self.pin_memory, self.min_numel = prefetch, pin_memory, min_numel
        self.max_in_flight = max_in_flight
        self.codec: Optional[ActivationCodec] = None if codec is None else get_codec(codec)
        self._mover = _mover if _mover is not None else (_Mover() if _offload_cpu else _CudaMover())
        self._offload_cpu = _offload_cpu  # tests: CPU tensors go the offload way, through _mover
        self._pool = _pool if _pool is not None else _default_pool
        self.stats = OffloadStats()
        self._lock = threading.RLock()  # backward may run on another thread than forward
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self._key, self._encodes = 0, 0                        # the codec's stream keys: this entry's, how many drawn
        self._next = 0                                         # the next pack index
        self._live: Dict[int, "weakref.ref[_Entry]"] = {}      # index -> entry, while autograd keeps it
        self._on_host: List[int] = []                          # sorted: indices only on the host, not fetched
        self._ahead: Set[int] = set()                          # fetched, not yet used
        self._in_flight: Deque[_Transfer] = collections.deque()  # copies out, oldest first
        self._dedup: Dict[Hashable, Tuple["weakref.ref[torch.Tensor]", "weakref.ref[Any]"]] = {}
        self._dead: Deque[Tuple[int, Hashable]] = collections.deque()  # entries autograd let go

    # the ``with`` block -----------------------------------------------------------------

    def __enter__(self) -> "OffloadActivations":
        if self._hooks is not None:
            raise RuntimeError("offload_activations: this block is already open")
        if self.codec is not None:
            with _keys_lock:
                self._key, self._encodes = rng.stream_key(next(_keys), "offload_activations", 0) & _MASK64, 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._hooks is not None
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc)
        with self._lock:
            self._tidy()

    def __repr__(self) -> str:
        codec = "" if self.codec is None else f", codec={self.codec.name!r}"
        return f"offload_activations(prefetch={self.prefetch}{codec}, min_numel={self.min_numel})"

    # pack ---------------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        with self._lock:
            self._tidy()
            self.stats.saved += 1
            offload = t.is_cuda or (self._offload_cpu and t.device.type == "cpu")
            if (not (offload or self.codec is not None) or not t.is_floating_point()
                    or t.numel() < max(self.min_numel, 1) or is_parameter(t)):
                return self._keep(t)
            key = (str(t.device), t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                   tuple(t.stride()), t.dtype, t._version)
            seen = self._dedup.get(key)
            if seen is not None:
                stored = seen[1]()
                if stored is not None and seen[0]() is not None:  # the original alive: its storage is this one
                    self.stats.deduplicated += 1
                    return stored
            src = t.detach()
            with torch.no_grad():
                packed = self._encode(src)
                if offload:
                    obj: Union[_Entry, _Encoded] = self._offload(src, packed)
                elif packed is not None:
                    obj = _Encoded(packed)
                else:
                    return self._keep(t)
            obj.dedup_key = key
            self._dedup[key] = (weakref.ref(t), weakref.ref(obj))
            return obj

    def _keep(self, t: torch.Tensor) -> Any:
        self.stats.kept += 1
        return _Held(t) if _ledger.active() else t

    def _encode(self, src: torch.Tensor) -> Optional[Packed]:
        """``src`` through the codec, on its device; None without a codec, for a dtype it does not
        take, or where the payload would not be smaller (``"lossless"`` on dense data)."""
        if self.codec is None or not self.codec.accepts(src.dtype):
            return None
        key = rng.stream_key(self._key, "offload", self._encodes) & _MASK64
        self._encodes += 1
        packed = self.codec.encode_if_smaller(src, key, src.numel() * src.element_size())
        if packed is not None:
            self.stats.encoded += 1
        return packed

    def _offload(self, src: torch.Tensor, packed: Optional[Packed]) -> _Entry:
        while len(self._in_flight) >= self.max_in_flight:  # bound the device memory copies out hold
            self.stats.waited_out += 1
            self._mover.sync(self._in_flight[0].event)
            self._in_flight.popleft().finish()
        index, self._next = self._next, self._next + 1
        device = src.device
        payload: Payload = src if packed is None else packed
        packing = None if packed is None else (packed.codec, packed.shape, packed.dtype, packed.meta)
        entry = _Entry(index, device, packing, self._dead)
        parts = list(_tensors(payload))
        for part in parts:
            nbytes = part.numel() * part.element_size()
            lease = _Lease(self._pool, self._pool.take(nbytes, self.pin_memory, device, self._mover.alloc),
                           self.pin_memory, device)
            assert lease.buf is not None
            entry.leases.append(lease)
            entry.host.append(lease.buf.view(part.dtype).as_strided(part.shape, _dense_stride(part)))
            self.stats.bytes_to_host += nbytes
        host, pin = entry.host, self.pin_memory

        def copy_out() -> None:
            for h, part in zip(host, parts):
                h.copy_(part, non_blocking=pin)

        _, event = self._mover.to_host(index, device, copy_out)
        entry.d2h = _Transfer(event, payload)
        self._in_flight.append(entry.d2h)
        self._live[index] = weakref.ref(entry)
        self._on_host.append(index)  # indices grow: the list stays sorted
        self.stats.offloaded += 1
        return entry

    # unpack -------------------------------------------------------------------------------

    def _unpack(self, obj: Any) -> torch.Tensor:
        if isinstance(obj, torch.Tensor):
            return obj
        if isinstance(obj, _Held):
            return obj.tensor
        if isinstance(obj, _Encoded):
            with torch.no_grad():
                return obj.packed.decode()
        assert isinstance(obj, _Entry), f"offload_activations: unexpected saved object {type(obj).__name__}"
        with self._lock:
            self._tidy()
            payload = self._bring_back(obj)
            self._prefetch_below(obj.index)
        if obj.packing is None:
            return payload
        with torch.no_grad():
            return payload.decode()

    def _bring_back(self, entry: _Entry) -> Payload:
        """``entry`` on the device for good: its prefetched copy, the device tensor itself while
        its copy out is unfinished, or a copy started now."""
        if entry.resident is not None:
            self.stats.resident += 1
            return entry.resident
        if entry.fetched is not None:
            self.stats.prefetched += 1
            payload, event = entry.fetched, entry.fetched_event
            self._ahead.discard(entry.index)
        else:
            self._forget_host(entry.index)
            source = entry.d2h.source if entry.d2h is not None else None
            if source is not None:
                self.stats.resident += 1
                payload, event = source, None
            else:
                self.stats.on_demand += 1
                payload, event = self._fetch(entry)
        self._mover.wait(entry.index, entry.device, event, _tensors(payload))
        entry.resident, entry.fetched, entry.fetched_event = payload, None, None
        if entry.token is None:
            entry.token = _hold_payload(payload)
        entry.drop_host()
        return payload

    def _fetch(self, entry: _Entry) -> Tuple[Payload, Any]:
        """Start the copy of ``entry`` back to its device."""
        host, device = entry.host, entry.device

        def copy_in() -> Payload:
            return entry.rebuild([torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=device)
                                  .copy_(h, non_blocking=True) for h in host])

        payload, event = self._mover.to_device(entry.index, device, copy_in)
        entry.token = _hold_payload(payload)
        return payload, event

    def _prefetch_below(self, index: int) -> None:
        """Bring back the nearest tensors saved before ``index`` (the next ones backward uses),
        while fewer than ``prefetch`` are ahead of use."""
        pos = bisect.bisect_left(self._on_host, index)
        while pos > 0 and len(self._ahead) < self.prefetch:
            pos -= 1
            nxt = self._on_host.pop(pos)
            ref = self._live.get(nxt)
            entry = ref() if ref is not None else None
            if entry is None:
                continue
            source = entry.d2h.source if entry.d2h is not None else None
            if source is not None:  # its copy out is unfinished: keep the device tensor instead
                entry.fetched, entry.fetched_event = source, None
                entry.token = _hold_payload(source)
            else:
                entry.fetched, entry.fetched_event = self._fetch(entry)
            self._ahead.add(nxt)
            self.stats.max_ahead = max(self.stats.max_ahead, len(self._ahead))

    # bookkeeping --------------------------------------------------------------------------

    def _forget_host(self, index: int) -> None:
        pos = bisect.bisect_left(self._on_host, index)
        if pos < len(self._on_host) and self._on_host[pos] == index:
            del self._on_host[pos]

    def _tidy(self) -> None:
        """Drop the device sources of finished copies out, and forget what autograd let go."""
        while self._in_flight and self._mover.done(self._in_flight[0].event):
            self._in_flight.popleft().finish()
        while self._dead:
            index, key = self._dead.popleft()
            self._live.pop(index, None)
            self._ahead.discard(index)
            self._forget_host(index)
            seen = self._dedup.get(key)
            if seen is not None and seen[1]() is None:
                del self._dedup[key]


def offload_activations(prefetch: int = 2, *, pin_memory: bool = True,
                        codec: Union[str, ActivationCodec, None] = None,
                        min_numel: int = 4096, max_in_flight: int = 4, **private: Any) -> OffloadActivations:
    """Saved activations to host memory inside a ``with`` block, brought back ``prefetch``
    tensors ahead of use in backward; see the module docstring.

    ``prefetch``: tensors copied back ahead of use (0: each when used). ``pin_memory``: pinned
    host buffers (asynchronous copies). ``codec``: a ``memory.codecs`` name, applied on the
    device before the copy. ``min_numel``: smaller tensors stay where they are.
    ``max_in_flight``: copies to the host that may be outstanding before a save waits."""
    return OffloadActivations(prefetch, pin_memory=pin_memory, codec=codec, min_numel=min_numel,
                              max_in_flight=max_in_flight, **private)
