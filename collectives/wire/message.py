"""Messages between two ranks: the one header of every point-to-point message gradcomp sends.

``collectives.p2p``'s ``send``/``recv`` and the pipeline's stage boundaries
(``pipeline/transport.py``) frame each message alike: a 64-byte header of eight int64 fields
(:data:`FIELDS`), then the payload in the wire format (``frame.py``), or a table of parts and
their values. The header says what the receiver must know before it takes the payload:

- ``magic``: :data:`MAGIC` (a message of gradcomp at this version);
- ``code``: which message this is (``p2p``'s :data:`SEND`, or the pipeline's message code);
- ``length``: the bytes that follow the header;
- ``compressor``: :func:`compressor_hash` of the sender's compressor configuration;
- ``dtype``: the tensor's dtype (:func:`~gradcomp.collectives.wire.header.dtype_code`; 0 for a
  message of parts);
- ``table``: the bytes of a message's parts table at the start of the payload (0: one tensor);
- two spare fields, zero.

NCCL ignores tags, so a receiver that refuses a message still receives its payload (its
length is in the header) before it raises: the channel stays in step.
"""
from __future__ import annotations

from typing import List, NamedTuple, Sequence

import torch

from gradcomp.compress.identity import fingerprint

from .header import code_dtype, dtype_code

MAGIC = 0x676D736701  # "gmsg" + version 1
FIELDS = ("magic", "code", "length", "compressor", "dtype", "table", "spare", "spare")
HEADER_BYTES = 8 * len(FIELDS)
SEND = -1  # the code of collectives.p2p's messages: one no pipeline message has (theirs are >= 0)

__all__ = ["MAGIC", "FIELDS", "HEADER_BYTES", "SEND", "Header", "compressor_hash", "h63", "header_bytes",
           "header_tensor", "read_header", "dtype_code", "code_dtype"]


def h63(text: str) -> int:
    """A non-negative 63-bit hash of ``text``, the same on every rank and run."""
    return int.from_bytes(bytes.fromhex(fingerprint(text)), "little") >> 1


def compressor_hash(compressor: object) -> int:
    """What a header says of the sender's compressor: a hash of its configuration (its repr)."""
    return h63(repr(compressor))


class Header(NamedTuple):
    """A received header's fields."""

    magic: int
    code: int
    length: int
    compressor: int
    dtype: int
    table: int

    @property
    def ours(self) -> bool:
        """Whether the message is one of gradcomp's at this version."""
        return self.magic == MAGIC


def _fields(code: int, length: int, compressor: int, dtype: int, table: int) -> List[int]:
    return [MAGIC, code, length, compressor, dtype, table, 0, 0]


def header_bytes(code: int, length: int, compressor: int, dtype: int = 0, table: int = 0) -> bytes:
    """A header as host bytes (to be copied to the device with the payload's first bytes)."""
    return torch.tensor(_fields(code, length, compressor, dtype, table), dtype=torch.int64).view(
        torch.uint8).numpy().tobytes()


def header_tensor(code: int, length: int, compressor: int, dtype: int, device: torch.device, table: int = 0
                  ) -> torch.Tensor:
    """A header as an int64 tensor on ``device`` (a message sent as two: header, then payload)."""
    return torch.tensor(_fields(code, length, compressor, dtype, table), dtype=torch.int64, device=device)


def read_header(values: Sequence[int]) -> Header:
    """The fields of a header read as ``len(FIELDS)`` ints (the caller checks them: it knows
    what it expects and how to say what went wrong)."""
    return Header(*(int(v) for v in values[:6]))
