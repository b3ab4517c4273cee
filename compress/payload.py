"""Payload: the tensors that cross the wire plus what is needed to decode them.

Wire format (all integers little-endian)::

    b"GCMP" | u16 version | u32 header_len | header (UTF-8 JSON) | tensor data, back to back

The JSON header holds the compressor name, the original shape and dtype, decode parameters
(``meta``: numbers, strings, booleans and lists of them) and the dtype and shape of every
tensor. Lengths are explicit and checked against the buffer before anything is allocated, so
truncated, oversized or random bytes raise ``ValueError``; the compressor then checks that
the tensors fit its format (sizes, index ranges) before any decode can scatter with them.

Bounds, all checked before the part they bound is parsed or allocated:

- the header is at most ``MAX_HEADER`` bytes and holds at most ``MAX_BRACKETS`` ``[``/``{``
  and ``MAX_COMMAS`` commas (counted in the raw bytes, strings included), so neither the
  nesting depth nor the parsed objects can grow past a small multiple of those bytes;
- the tensor data is at most ``MAX_BYTES_PER_ELEMENT`` bytes per element of the original
  tensor (an fp64 value and an int64 index) plus ``TENSOR_SLACK`` bytes per tensor (scales,
  bit padding), so :func:`max_wire_bytes` bounds a payload's bytes before they are received;
- without an explicit ``max_numel``, the original tensor must also fit in this machine's
  memory once decoded: a few bytes that claim a tensor nothing could hold are refused rather
  than handed to ``decompress``.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from gradcomp.kernels.memory import copy_from_host

from .registry import compressor_class

MAGIC = b"GCMP"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")
MAX_HEADER = 1 << 16  # bytes of JSON header; no compressor writes more than a few hundred
_HEAD_GUESS = 1024  # JSON header bytes read with the prefix in one go (the rest, if longer, in a second)
MAX_BRACKETS = 256  # "[" and "{" in a header: bounds nesting and containers before parsing
MAX_COMMAS = 1 << 14  # "," in a header: bounds the parsed values before parsing
MAX_META_DEPTH = 4  # lists nested in a meta value
MAX_TENSORS = 64
MAX_DIMS = 16
MAX_NUMEL = 1 << 40  # largest original tensor a payload may describe
MAX_BYTES_PER_ELEMENT = 16  # tensor data per original element: an fp64 value and an int64 index
TENSOR_SLACK = 64  # tensor data per tensor beyond that: scales, bit padding

DTYPES: Dict[str, torch.dtype] = {
    "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def max_wire_bytes(numel: int) -> int:
    """The most bytes ``to_bytes`` may make for a payload of at most ``numel`` elements (what
    :meth:`Payload.from_bytes` accepts)."""
    return _PREFIX.size + MAX_HEADER + MAX_BYTES_PER_ELEMENT * max(numel, 0) + TENSOR_SLACK * MAX_TENSORS


def memory_bytes() -> Optional[int]:
    """This machine's physical memory in bytes (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def view_bytes(raw: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """The bytes of the 1-D uint8 tensor ``raw`` as a tensor of ``dtype`` and ``shape`` on its
    device: a view where they lie aligned for ``dtype``, a copy where not. No bytes give a new
    empty tensor: a slice of no bytes keeps its storage offset, which need not be aligned (row
    ``r`` of a ``(world, 0)`` buffer starts at byte ``r``), and has nothing to view."""
    if not raw.numel():
        return torch.empty(tuple(shape), dtype=dtype, device=raw.device)
    if raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).reshape(tuple(shape))


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype; ``ValueError`` for one the wire cannot carry."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot cross the wire; allowed: {', '.join(DTYPES)}") from None


@dataclass
class Payload:
    """A compressed tensor. Only ``tensors`` cross the wire in a collective."""

    compressor: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    tensors: List[torch.Tensor]
    meta: Dict[str, Any] = field(default_factory=dict)
    # the indices (of a sparse payload) are known to be in range, so decoding reads nothing
    # back to check them: set by the compressor that built them, or by its check_on_device on
    # a received payload (which clamps them and flags any that were out of range or out of
    # order). Never sent; a payload parsed from bytes starts unchecked.
    checked: bool = field(default=False, compare=False, repr=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Exact bytes of the tensors that cross the wire (the framing header excluded)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device if self.tensors else torch.device("cpu")

    def to(self, device: torch.device | str) -> "Payload":
        return Payload(self.compressor, self.shape, self.dtype, [t.to(device) for t in self.tensors], dict(self.meta),
                       self.checked)

    def to_bytes(self) -> bytes:
        """Self-describing bytes; inverse of :meth:`from_bytes`. No pickle."""
        return self.to_tensor().numpy().tobytes()

    def wire_head(self) -> bytes:
        """The wire format's first bytes: magic, version, the JSON header's length and the JSON
        header, padded with spaces to a multiple of 8 bytes after the prefix, so that the first
        tensor starts aligned and a receiver can view it where it lies."""
        header = {
            "c": self.compressor,
            "shape": [int(s) for s in self.shape],
            "dtype": dtype_name(self.dtype),
            "meta": self.meta,
            "t": [[dtype_name(t.dtype), list(t.shape)] for t in self.tensors],
        }
        hbytes = json.dumps(header, separators=(",", ":"), allow_nan=True).encode()
        hbytes += b" " * (-(_PREFIX.size + len(hbytes)) % 8)
        if len(hbytes) > MAX_HEADER:
            raise ValueError(f"payload header of {len(hbytes)} bytes exceeds the limit of {MAX_HEADER}; keys and meta "
                             f"must be short")
        return _PREFIX.pack(MAGIC, VERSION, len(hbytes)) + hbytes

    @property
    def wire_nbytes(self) -> int:
        """Length of the wire format: :meth:`wire_head` and the tensors' bytes."""
        return len(self.wire_head()) + self.nbytes

    def write_wire(self, out: torch.Tensor, head: Optional[bytes] = None) -> int:
        """Write the wire format into the 1-D uint8 tensor ``out`` (any device, at least
        :attr:`wire_nbytes` long) from its start: the head copied from the host once (pinned
        and asynchronous on a GPU), each tensor copied once straight into place on ``out``'s
        device. ``head``: :meth:`wire_head`, when the caller made it. Returns the length."""
        head = self.wire_head() if head is None else head
        copy_from_host(out[:len(head)], torch.frombuffer(bytearray(head), dtype=torch.uint8))
        pos = len(head)
        for t in self.tensors:
            size = t.numel() * t.element_size()
            if size:
                out[pos:pos + size].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
            pos += size
        return pos

    def to_tensor(self) -> torch.Tensor:
        """The bytes of :meth:`to_bytes` as one new 1-D CPU uint8 tensor, each tensor copied
        once, straight into place (:meth:`write_wire`)."""
        head = self.wire_head()
        out = torch.empty(len(head) + self.nbytes, dtype=torch.uint8)
        self.write_wire(out, head)
        return out

    @classmethod
    def from_tensor(cls, data: torch.Tensor, *, max_numel: Optional[int] = None,
                    head: Optional[bytes] = None) -> "Payload":
        """:meth:`from_bytes` for wire bytes held in a 1-D uint8 tensor on any device, which the
        caller owns and will not change: only the prefix and the JSON header are read to the
        host (``head``: the first bytes of ``data`` when the caller has read them already; read
        here as far as they fall short), and the tensors are views of ``data`` where they lie,
        on its device (copies where a tensor's bytes are not aligned for its dtype). Validated
        as :meth:`from_bytes` validates, by the compressor's ``check_payload``."""
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise ValueError(f"Payload.from_tensor expects a 1-D uint8 tensor, got {data.dtype} of shape "
                             f"{tuple(data.shape)}")
        if data.device.type == "cpu":
            return cls.from_bytes(data.numpy().data, max_numel=max_numel, copy=False)
        return cls._from_tensor_views(data, max_numel, head)

    @classmethod
    def _from_tensor_views(cls, data: torch.Tensor, max_numel: Optional[int], head: Optional[bytes]) -> "Payload":
        """:meth:`from_tensor` off the CPU (tested on CPU tensors too): the head read, the
        tensors viewed on ``data``'s device."""
        n = data.numel()
        if head is None or len(head) < min(n, _PREFIX.size):
            head = data[:min(n, _PREFIX.size + _HEAD_GUESS)].cpu().numpy().tobytes()  # one small host read
        if len(head) >= _PREFIX.size:
            want = _PREFIX.size + _PREFIX.unpack_from(head, 0)[2]
            if len(head) < want <= min(n, _PREFIX.size + MAX_HEADER):  # a long header: the rest of it
                head = head + data[len(head):want].cpu().numpy().tobytes()
        header, pos = _read_prefix(memoryview(head[:n]))
        name, shape, dtype, meta, sized = _read_header(header, max_numel)
        klass = compressor_class(name)
        tensors = []
        for tdtype, tshape, size in sized:
            if size > n - pos:
                raise ValueError(f"payload truncated: a tensor needs {size} bytes, {n - pos} remain")
            tensors.append(view_bytes(data[pos:pos + size], tdtype, tshape))
            pos += size
        if pos != n:
            raise ValueError(f"payload has {n - pos} trailing bytes after its last tensor")
        payload = cls(name, shape, dtype, tensors, meta)
        klass.check_payload(payload)
        return payload

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *, max_numel: Optional[int] = None,
                   copy: bool = True) -> "Payload":
        """Parse and validate bytes made by :meth:`to_bytes`; ``ValueError`` on anything else.

        ``max_numel`` bounds the elements the payload may describe; without it, at most
        ``MAX_NUMEL`` elements that fit in this machine's memory once decoded. ``copy=False``
        (for a writable buffer the caller owns and will not change, such as a freshly received
        one): the payload's tensors are views of ``data`` where their bytes are aligned for
        their dtype, copies elsewhere."""
        buf, copy = _buffer(data, copy)
        header, pos = _read_prefix(buf)
        name, shape, dtype, meta, sized = _read_header(header, max_numel)
        klass = compressor_class(name)
        tensors = _read_tensors(buf, pos, sized, copy)
        payload = cls(name, shape, dtype, tensors, meta)
        klass.check_payload(payload)
        return payload


_Sized = List[Tuple[torch.dtype, Tuple[int, ...], int]]  # each tensor's dtype, shape and bytes


def _buffer(data: Any, copy: bool) -> Tuple[memoryview, bool]:
    """``data`` as a byte view, copied unless the caller's buffer may be viewed."""
    try:
        view = memoryview(data)
    except TypeError:
        raise ValueError(f"Payload.from_bytes expects bytes, a bytearray or another buffer of bytes, "
                         f"got {type(data).__name__}") from None
    copy = copy or view.readonly  # a view of read-only bytes could not be a writable tensor
    return (memoryview(bytes(view)) if copy else view.cast("B")), copy


def _read_prefix(buf: memoryview) -> Tuple[Any, int]:
    """The parsed JSON header after the magic bytes and version, and where the tensors start."""
    if len(buf) < _PREFIX.size:
        raise ValueError(f"payload too short: {len(buf)} bytes, the prefix alone is {_PREFIX.size}")
    magic, version, hlen = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ValueError("not a gradcomp payload (bad magic bytes)")
    if version != VERSION:
        raise ValueError(f"payload version {version} is not supported (this build reads version {VERSION})")
    pos = _PREFIX.size
    if hlen > MAX_HEADER:
        raise ValueError(f"payload header length {hlen} exceeds the limit of {MAX_HEADER} bytes")
    if pos + hlen > len(buf):
        raise ValueError(f"payload truncated: the header needs {hlen} bytes, {len(buf) - pos} follow")
    return _parse_header(bytes(buf[pos:pos + hlen])), pos + hlen


def _read_header(header: Any, max_numel: Optional[int]
                 ) -> Tuple[str, Tuple[int, ...], torch.dtype, Dict[str, Any], _Sized]:
    """The header's fields, each bounded: compressor name, shape, dtype, meta, tensor specs."""
    if not isinstance(header, dict) or set(header) != {"c", "shape", "dtype", "meta", "t"}:
        raise ValueError("payload header must hold exactly the fields c, shape, dtype, meta, t")
    name = header["c"]
    compressor_class(name)  # an unknown compressor is refused before any size is trusted
    shape = _shape(header["shape"], "shape")
    dtype = _dtype(header["dtype"])
    numel = math.prod(shape)
    _check_numel(numel, dtype, max_numel)
    meta = header["meta"]
    if not isinstance(meta, dict) or not all(_plain(v) for v in meta.values()):
        raise ValueError(f"payload meta must be a dict of numbers, strings, booleans and lists of them "
                         f"(nested at most {MAX_META_DEPTH} deep)")
    specs = header["t"]
    if not isinstance(specs, list) or len(specs) > MAX_TENSORS:
        raise ValueError(f"payload must list at most {MAX_TENSORS} tensors")
    sized: _Sized = []
    for spec in specs:
        if not isinstance(spec, list) or len(spec) != 2:
            raise ValueError("each payload tensor is described by [dtype, shape]")
        tdtype, tshape = _dtype(spec[0]), _shape(spec[1], "tensor shape")
        sized.append((tdtype, tshape, math.prod(tshape) * torch.empty((), dtype=tdtype).element_size()))
    data_bytes, allowed = sum(s for _, _, s in sized), MAX_BYTES_PER_ELEMENT * numel + TENSOR_SLACK * len(sized)
    if data_bytes > allowed:
        raise ValueError(f"payload tensors hold {data_bytes} bytes, more than the {allowed} allowed for "
                         f"{numel} elements in {len(sized)} tensors")
    return name, shape, dtype, meta, sized


def _read_tensors(buf: memoryview, pos: int, sized: _Sized, copy: bool) -> List[torch.Tensor]:
    """The tensors after the header: views of ``buf`` where aligned and allowed, else copies;
    the buffer must end exactly after the last one."""
    tensors = []
    for tdtype, tshape, size in sized:
        if size > len(buf) - pos:
            raise ValueError(f"payload truncated: a tensor needs {size} bytes, {len(buf) - pos} remain")
        if not size:
            raw = torch.empty(0, dtype=torch.uint8)
        elif copy or pos % tdtype.itemsize:
            raw = torch.frombuffer(bytearray(buf[pos:pos + size]), dtype=torch.uint8)
        else:  # a view of the caller's buffer, aligned for its dtype
            raw = torch.frombuffer(buf[pos:pos + size], dtype=torch.uint8)
        tensors.append(view_bytes(raw, tdtype, tshape))
        pos += size
    if pos != len(buf):
        raise ValueError(f"payload has {len(buf) - pos} trailing bytes after its last tensor")
    return tensors


def _parse_header(raw: bytes) -> Any:
    """The JSON header, its structure bounded before parsing (see the module docstring)."""
    brackets, commas = raw.count(b"[") + raw.count(b"{"), raw.count(b",")
    if brackets > MAX_BRACKETS or commas > MAX_COMMAS:
        raise ValueError(f"payload header holds {brackets} '[' or '{{' and {commas} ','; at most {MAX_BRACKETS} "
                         f"and {MAX_COMMAS} are allowed (metadata is small and shallow)")
    try:
        return json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, or an int of too many digits
        raise ValueError(f"payload header is not valid JSON: {exc}") from None


def _check_numel(numel: int, dtype: torch.dtype, max_numel: Optional[int]) -> None:
    if max_numel is not None:
        if numel > max_numel:
            raise ValueError(f"payload describes {numel} elements, more than the limit {max_numel}")
        return
    if numel > MAX_NUMEL:
        raise ValueError(f"payload describes {numel} elements, more than the limit {MAX_NUMEL}")
    decoded, memory = numel * torch.empty((), dtype=dtype).element_size(), memory_bytes()
    if memory is not None and decoded > memory:
        raise ValueError(f"payload describes {numel} elements of {dtype_name(dtype)} ({decoded} bytes decoded), more "
                         f"than this machine's {memory} bytes of memory; pass max_numel to allow a size explicitly")


def _shape(value: Any, what: str) -> Tuple[int, ...]:
    if (not isinstance(value, list) or len(value) > MAX_DIMS
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < MAX_NUMEL for s in value)):
        raise ValueError(f"payload {what} must be a list of at most {MAX_DIMS} non-negative ints, got {value!r:.80}")
    return tuple(value)


def _dtype(value: Any) -> torch.dtype:
    if not isinstance(value, str) or value not in DTYPES:
        raise ValueError(f"payload dtype {value!r:.40} unknown; allowed: {', '.join(DTYPES)}")
    return DTYPES[value]


def _plain(v: Any, depth: int = 0) -> bool:
    if isinstance(v, (bool, int, float, str)) or v is None:
        return True
    return (isinstance(v, list) and len(v) <= 4096 and depth < MAX_META_DEPTH
            and all(_plain(x, depth + 1) for x in v))
