"""``compressed_activations``: keep what autograd saves for backward through a codec.

::

    with compressed_activations("int8"):
        loss = model(x).sum()
        loss.backward()

Inside the block every tensor autograd saves is encoded when it is saved (the payload is what
stays alive until backward) and decoded when backward needs it. Kept as they are (never
encoded): parameters and views of them, tensors under ``min_numel`` elements, tensors the
codec does not take (integer/bool tensors for a lossy codec), tensors whose storage is in
``exclude`` or is already kept whole by this block, and tensors whose payload would not be
smaller than the tensor (``"lossless"`` on dense data) -- so the hook never adds memory.
Memory saved again in the same state (a ReLU output that the next ``Linear`` saves as its
input, a reshape, transpose or slice of an encoded tensor) is served by its first payload;
only overlapping non-contiguous views of one storage are encoded each on its own.

Randomness is keyed: the n-th tensor one entry of the block tries to encode gets the key
derived from ``(key, n)``, n restarting at 0 each entry. Entering again with the same ``key`` and running
the same ops reproduces the same stored bits (what a recomputing memory planner needs); with
``key=None`` each entry draws a fresh key from a process-wide counter (``entry_key`` tells
which).

With ``torch.utils.checkpoint``: PyTorch runs only the innermost ``saved_tensors_hooks``.
Inside a non-reentrant checkpoint region checkpoint's own hooks win: the region's tensors
are recomputed, never encoded, and only what is saved outside it goes through the codec --
including the region's inputs, which checkpoint saves through this hook. A reentrant
checkpoint runs its region without grad and saves only its inputs (through this hook); if
backward runs inside the block, the recomputation's saved tensors are encoded too. Either
way the recomputation starts from the inputs' decoded values: exact with ``"lossless"``,
but with a lossy codec recomputed pre-activations near 0 change sign, so ReLU masks flip
and the gradient error grows (int8 on an MLP: ~7 % instead of ~1 %). Pass the region's
inputs in ``exclude`` (they stay as they are) unless that memory matters more.

Bytes held are reported to the activation ledger (:mod:`gradcomp.memory._ledger`), so an
enclosing :class:`~gradcomp.memory.meter.MemoryMeter` counts payloads at their real size.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Hashable, Iterable, List, Optional, Set, Tuple, Union

import torch

from gradcomp.kernels import rng

from . import _ledger
from .codecs import ActivationCodec, Packed, get_codec
from .meter import _Held, is_parameter

__all__ = ["SavedStats", "compressed_activations"]

_MASK64 = (1 << 64) - 1
_auto_keys = itertools.count()
_auto_lock = threading.Lock()


def _derive(key: int, n: int) -> int:
    """The stable 64-bit key of the n-th tensor encoded under ``key``."""
    return rng.stream_key(key, "saved", n) & _MASK64


@dataclass
class SavedStats:
    """What one entry of :class:`compressed_activations` did with the tensors saved in it."""

    encoded: int = 0  # tensors encoded
    shared: int = 0  # saves served by an earlier encoding of the same memory
    kept: int = 0  # saves kept as they are
    original_bytes: int = 0  # bytes of the tensors encoded
    payload_bytes: int = 0  # bytes of their payloads

    @property
    def ratio(self) -> float:
        """How many times smaller the encoded tensors were kept."""
        return self.original_bytes / self.payload_bytes if self.payload_bytes else 1.0


class _Stored:
    """A saved tensor kept as a payload: the shared :class:`Packed` and this save's geometry.
    ``strides`` None: the payload's elements in this shape (a ``(b, s, d)`` output and the
    ``(b*s, d)`` view the next ``Linear`` saves share one payload); else this save is the view
    ``(shape, strides, offset)`` of the decoded elements (a transpose or slice of them)."""

    __slots__ = ("packed", "shape", "strides", "offset", "__weakref__")

    def __init__(self, packed: Packed, shape: torch.Size, strides: Optional[Tuple[int, ...]] = None,
                 offset: int = 0) -> None:
        self.packed = packed
        self.shape = shape
        self.strides = strides
        self.offset = offset

    def unpack(self) -> torch.Tensor:
        out = self.packed.decode()
        if self.strides is not None:
            return out.as_strided(self.shape, self.strides, self.offset)
        return out if out.shape == self.shape else out.view(self.shape)


class _Plain:
    """A tensor kept as it is without ledger bookkeeping (no strided storage to key it by)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _keep(t: torch.Tensor) -> Union[_Held, _Plain]:
    return _Held(t) if _plain_tensor(t) else _Plain(t)


def _plain_tensor(t: torch.Tensor) -> bool:
    """A dense tensor with a storage of its own kind (not sparse, not a wrapper subclass)."""
    return t.layout == torch.strided and type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type != "meta"


def _unpack(obj: Any) -> torch.Tensor:
    if isinstance(obj, _Stored):
        return obj.unpack()
    return obj.tensor


def _span(t: torch.Tensor) -> Tuple[int, int]:
    """The elements of its storage that ``t`` reaches: ``[start, stop)`` in units of its dtype."""
    start = int(t.storage_offset())
    if t.numel() == 0:
        return start, start
    return start, start + 1 + sum((int(n) - 1) * int(st) for n, st in zip(t.shape, t.stride()))


class _Entry:
    """The state of one entry of the block: the key, the encode counter, and the memory
    already encoded or kept (weakly referenced, so the cache never keeps anything alive).

    A tensor saved again is served by an earlier payload when that covers the same memory in
    the same state (storage, dtype, ``_version``): the same geometry, or any view into a
    contiguous encoded tensor. A weak reference to the encoded tensor proves the storage was
    not freed and reused meanwhile."""

    def __init__(self, codec: ActivationCodec, min_numel: int, key: int, exclude: Set[Hashable]) -> None:
        self.codec = codec
        self.min_numel = min_numel
        self.key = key
        self.exclude = exclude
        self.n = 0
        self.stats = SavedStats()
        self.lock = threading.RLock()
        # (storage, offset, dtype, version, geometry) -> (weakref to the tensor, weakref to its Packed)
        self.encoded: Dict[Hashable, Tuple[weakref.ref, weakref.ref]] = {}
        # (storage, dtype, version) -> [(start, stop, weakref to the tensor, weakref to its Packed)]
        self.spans: Dict[Hashable, List[Tuple[int, int, weakref.ref, weakref.ref]]] = {}
        self.kept: Dict[Hashable, weakref.ref] = {}  # storage -> weakref to the _Held keeping it

    def _encodable(self, t: torch.Tensor) -> bool:
        return (_plain_tensor(t) and t.numel() >= self.min_numel and self.codec.accepts(t.dtype)
                and not is_parameter(t))

    def pack(self, t: torch.Tensor) -> Any:
        if not self._encodable(t):
            return self._keep(t)
        storage = _ledger.storage_key(t)
        if storage in self.exclude:
            return self._keep(t)
        contiguous = t.is_contiguous()
        geometry: Tuple[Any, ...] = (t.numel(),) if contiguous else (tuple(t.shape), t.stride())
        ident = (storage, t.storage_offset(), t.dtype, t._version) + geometry
        state = (storage, t.dtype, t._version)
        with self.lock:
            holder = self.kept.get(storage)
            if holder is not None and holder() is not None:  # kept whole anyway: a payload only adds
                return self._keep(t)
            served = self._served(t, ident, state)
            if served is not None:
                self.stats.shared += 1
                return served
            n = self.n
            self.n += 1
        limit = min(t.numel() * t.element_size(), _ledger.storage_nbytes(t))
        packed = self.codec.encode_if_smaller(t, _derive(self.key, n), limit)
        if packed is None:
            return self._keep(t)
        _ledger.hold(packed, ("payload", id(packed)), packed.nbytes)
        refs = (weakref.ref(t), weakref.ref(packed))
        with self.lock:
            self.encoded[ident] = refs
            if contiguous:
                self.spans.setdefault(state, []).append(_span(t) + refs)
            self.stats.encoded += 1
            self.stats.original_bytes += t.numel() * t.element_size()
            self.stats.payload_bytes += packed.nbytes
        return _Stored(packed, t.shape)

    def _served(self, t: torch.Tensor, ident: Hashable, state: Hashable) -> Optional[_Stored]:
        """An earlier payload holding ``t``'s memory in its present state, as ``t``."""
        hit = self.encoded.get(ident)
        if hit is not None:
            alive, packed = hit[0](), hit[1]()
            if alive is not None and packed is not None:
                return _Stored(packed, t.shape)
        start, stop = _span(t)
        for lo, hi, tensor_ref, packed_ref in self.spans.get(state, ()):
            if lo <= start and stop <= hi:
                alive, packed = tensor_ref(), packed_ref()
                if alive is not None and packed is not None:
                    return _Stored(packed, t.shape, tuple(t.stride()), start - lo)
        return None

    def _keep(self, t: torch.Tensor) -> Union[_Held, _Plain]:
        """``t`` kept as it is; its storage is remembered as alive while the holder lives."""
        held = _keep(t)
        with self.lock:
            self.stats.kept += 1
            if isinstance(held, _Held):
                storage = _ledger.storage_key(t)
                earlier = self.kept.get(storage)
                if earlier is None or earlier() is None:
                    self.kept[storage] = weakref.ref(held)
        return held

    def close(self) -> None:
        with self.lock:
            self.encoded.clear()
            self.spans.clear()
            self.kept.clear()


class compressed_activations:
    """Within the ``with`` block, tensors autograd saves are stored through ``codec`` (a name
    of :func:`~gradcomp.memory.codecs.get_codec` with ``codec_options``, or a codec); see the
    module docstring for what is kept as it is, the keys and checkpointing.

    ``min_numel``: smaller tensors are kept as they are; ``key``: the entry key (an int; None
    draws a fresh one per entry); ``exclude``: tensors whose storage the caller keeps alive
    anyway (encoding them would only add their payload). After an entry, ``entry_key`` is the
    key it used and ``stats`` (:class:`SavedStats`) what it did. The object may be entered
    again (also nested): each entry is independent."""

    def __init__(self, codec: Union[str, ActivationCodec] = "int8", *, min_numel: int = 4096,
                 key: Optional[int] = None, exclude: Iterable[torch.Tensor] = (), **codec_options: Any) -> None:
        self.codec = get_codec(codec, **codec_options)
        if not isinstance(min_numel, int) or isinstance(min_numel, bool) or min_numel < 0:
            raise ValueError(f"min_numel must be an int >= 0, got {min_numel!r}")
        if key is not None and (not isinstance(key, int) or isinstance(key, bool)):
            raise ValueError(f"key must be an int or None, got {key!r}")
        self.min_numel = min_numel
        self.key = key
        exclude = tuple(exclude)
        for t in exclude:
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"exclude holds tensors, got {type(t).__name__}")
        # storages only: a context reused across steps must not keep the first step's tensors
        self.exclude: Set[Hashable] = {_ledger.storage_key(t) for t in exclude}
        self.entry_key: Optional[int] = None
        self.stats: Optional[SavedStats] = None
        self._stack: List[Tuple[_Entry, torch.autograd.graph.saved_tensors_hooks]] = []

    def __enter__(self) -> "compressed_activations":
        if self.key is not None:
            key = self.key
        else:
            with _auto_lock:
                key = rng.stream_key(next(_auto_keys), "compressed_activations", 0) & _MASK64
        entry = _Entry(self.codec, self.min_numel, key, self.exclude)
        hooks = torch.autograd.graph.saved_tensors_hooks(entry.pack, _unpack)
        hooks.__enter__()
        self._stack.append((entry, hooks))
        self.entry_key, self.stats = key, entry.stats
        return self

    def __exit__(self, *exc: Any) -> None:
        entry, hooks = self._stack.pop()
        hooks.__exit__(*exc)
        entry.close()
        self.entry_key, self.stats = entry.key, entry.stats

    def __repr__(self) -> str:
        return f"compressed_activations({self.codec!r}, min_numel={self.min_numel}, key={self.key})"
