"""Payload: the tensors that cross the wire plus what is needed to decode them.

Wire format (all integers little-endian)::

    b"GCMP" | u16 version | u32 header_len | header (UTF-8 JSON) | tensor data, back to back

The JSON header holds the compressor name, the original shape and dtype, decode parameters
(``meta``: numbers, strings, booleans and lists of them) and the dtype and shape of every
tensor. Lengths are explicit and checked against the buffer before anything is allocated, so
truncated, oversized or random bytes raise ``ValueError``; the compressor then checks that
the tensors fit its format (sizes, index ranges) before any decode can scatter with them.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

import torch

MAGIC = b"GCMP"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")
MAX_HEADER = 1 << 20  # bytes of JSON header; metadata is small
MAX_TENSORS = 64
MAX_DIMS = 16
MAX_NUMEL = 1 << 40  # largest original tensor a payload may describe

DTYPES: Dict[str, torch.dtype] = {
    "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


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
        return Payload(self.compressor, self.shape, self.dtype, [t.to(device) for t in self.tensors], dict(self.meta))

    def to_bytes(self) -> bytes:
        """Self-describing bytes; inverse of :meth:`from_bytes`. No pickle."""
        header = {
            "c": self.compressor,
            "shape": [int(s) for s in self.shape],
            "dtype": dtype_name(self.dtype),
            "meta": self.meta,
            "t": [[dtype_name(t.dtype), list(t.shape)] for t in self.tensors],
        }
        hbytes = json.dumps(header, separators=(",", ":"), allow_nan=True).encode()
        parts = [_PREFIX.pack(MAGIC, VERSION, len(hbytes)), hbytes]
        for t in self.tensors:
            t = t.detach().to("cpu").contiguous()
            parts.append(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *, max_numel: int = MAX_NUMEL) -> "Payload":
        """Parse and validate bytes made by :meth:`to_bytes`; ``ValueError`` on anything else."""
        from .registry import compressor_class

        buf = memoryview(bytes(data))
        if len(buf) < _PREFIX.size:
            raise ValueError(f"payload too short: {len(buf)} bytes, the prefix alone is {_PREFIX.size}")
        magic, version, hlen = _PREFIX.unpack_from(buf, 0)
        if magic != MAGIC:
            raise ValueError("not a gradcomp payload (bad magic bytes)")
        if version != VERSION:
            raise ValueError(f"payload version {version} is not supported (this build reads version {VERSION})")
        pos = _PREFIX.size
        if hlen > MAX_HEADER or pos + hlen > len(buf):
            raise ValueError(f"payload header length {hlen} exceeds the {len(buf) - pos} bytes that follow")
        try:
            header = json.loads(bytes(buf[pos:pos + hlen]).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"payload header is not valid JSON: {exc}") from None
        pos += hlen
        if not isinstance(header, dict) or set(header) != {"c", "shape", "dtype", "meta", "t"}:
            raise ValueError("payload header must hold exactly the fields c, shape, dtype, meta, t")
        name = header["c"]
        klass = compressor_class(name)
        shape = _shape(header["shape"], "shape")
        if math.prod(shape) > max_numel:
            raise ValueError(f"payload describes {math.prod(shape)} elements, more than the limit {max_numel}")
        dtype = _dtype(header["dtype"])
        meta = header["meta"]
        if not isinstance(meta, dict) or not all(_plain(v) for v in meta.values()):
            raise ValueError("payload meta must be a dict of numbers, strings, booleans and lists of them")
        specs = header["t"]
        if not isinstance(specs, list) or len(specs) > MAX_TENSORS:
            raise ValueError(f"payload must list at most {MAX_TENSORS} tensors")
        tensors = []
        for spec in specs:
            if not isinstance(spec, list) or len(spec) != 2:
                raise ValueError("each payload tensor is described by [dtype, shape]")
            tdtype, tshape = _dtype(spec[0]), _shape(spec[1], "tensor shape")
            itemsize = torch.empty((), dtype=tdtype).element_size()
            size = math.prod(tshape) * itemsize
            if size > len(buf) - pos:
                raise ValueError(f"payload truncated: a tensor needs {size} bytes, {len(buf) - pos} remain")
            raw = torch.frombuffer(bytearray(buf[pos:pos + size]), dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
            tensors.append(raw.view(tdtype).reshape(tshape))
            pos += size
        if pos != len(buf):
            raise ValueError(f"payload has {len(buf) - pos} trailing bytes after its last tensor")
        payload = cls(name, shape, dtype, tensors, meta)
        klass.check_payload(payload)
        return payload


def _shape(value: Any, what: str) -> Tuple[int, ...]:
    if (not isinstance(value, list) or len(value) > MAX_DIMS
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < MAX_NUMEL for s in value)):
        raise ValueError(f"payload {what} must be a list of at most {MAX_DIMS} non-negative ints, got {value!r:.80}")
    return tuple(value)


def _dtype(value: Any) -> torch.dtype:
    if not isinstance(value, str) or value not in DTYPES:
        raise ValueError(f"payload dtype {value!r:.40} unknown; allowed: {', '.join(DTYPES)}")
    return DTYPES[value]


def _plain(v: Any) -> bool:
    if isinstance(v, (bool, int, float, str)) or v is None:
        return True
    return isinstance(v, list) and len(v) <= 4096 and all(_plain(x) for x in v)
