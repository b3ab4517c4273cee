"""The small header every rank all-gathers before a collective's payload.

It makes a mismatch an error on every rank instead of a hang or garbage: shape, dtype,
compressor (name and options), algorithm, key and the option to measure error must agree;
a rank whose own input or compressor failed says so here, so the others raise too. The same
exchange carries the payload sizes (one per rank, or one per destination chunk), so variable
payloads cost no extra round trip. Fixed part: 22 int64; then ``w`` size slots.

``allreduce_fused`` sends the same row for its set of tensors, with the hash of the whole
layout in the ``shape`` field where ``allreduce`` has the hash of its tensor's shape; so a
row whose ``shape`` hash is not that of its own dims comes from ``allreduce_fused``, and a
rank in one call while another is in the other is told so by name.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from gradcomp.compress.identity import fingerprint

MAGIC = 0x67636F6C6C01  # "gcoll" + version 1
_DIMS = 8
FIELDS = ["magic", "op", "algorithm", "dtype", "ndim", "numel", "shape",
          *(f"d{i}" for i in range(_DIMS)), "compressor", "key", "part", "parts", "measure", "error", "check"]
IDX = {name: i for i, name in enumerate(FIELDS)}
SIZES = len(FIELDS)  # index of the first size slot

OPS = {"allreduce": 1, "hierarchical": 2}
# every exchange's number in the header: the registered algorithms' codes (see
# ``register_algorithm``) and the phases that are no algorithm (a hierarchical call's dense phase)
_CODES: Dict[str, int] = {"dense": 5}


def claim_code(name: str, code: int) -> None:
    """Give ``name`` header code ``code``; refuses a name or code that is taken."""
    for other, taken in _CODES.items():
        if other == name or taken == code:
            raise ValueError(f"algorithm {name!r} (code {code}) collides with {other!r} (code {taken})")
    if code <= 0:
        raise ValueError(f"algorithm {name!r} must declare a header code > 0")
    _CODES[name] = code


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
           torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
_DTYPE_CODE = {d: i + 1 for i, d in enumerate(_DTYPES)}


def h64(text: str | bytes) -> int:
    """Wire format only: :func:`~gradcomp.compress.identity.fingerprint`'s digest of ``text``
    as the signed int64 a header slot holds (the same on every rank and run). Checkpoint
    identity and agreement use the fingerprint itself."""
    return int.from_bytes(bytes.fromhex(fingerprint(text)), "little", signed=True)


def build(world_size: int, *, op: str, algorithm: str, tensor, compressor: str, key: str,
          part: int = 0, parts: int = 1, measure: bool = False, error: bool = False,
          check: int = 0, sizes: Sequence[int] = ()) -> List[int]:
    """This rank's header; ``tensor`` may be anything (a non-tensor is described as such)."""
    row = [0] * (SIZES + world_size)
    row[IDX["magic"]] = MAGIC
    row[IDX["op"]] = OPS[op]
    row[IDX["algorithm"]] = _CODES.get(algorithm, 0)
    if isinstance(tensor, torch.Tensor):
        shape = tuple(tensor.shape)
        row[IDX["dtype"]] = _DTYPE_CODE.get(tensor.dtype, 0)
        row[IDX["ndim"]] = len(shape)
        row[IDX["numel"]] = tensor.numel()
        row[IDX["shape"]] = h64(repr(shape))
        for i in range(_DIMS):
            row[IDX[f"d{i}"]] = shape[i] if i < len(shape) else -1
    else:
        row[IDX["dtype"]] = -1
        row[IDX["ndim"]] = -1
    row[IDX["compressor"]] = h64(compressor)
    row[IDX["key"]] = h64(key)
    row[IDX["part"]] = part
    row[IDX["parts"]] = parts
    row[IDX["measure"]] = int(measure)
    row[IDX["error"]] = int(error)
    row[IDX["check"]] = check
    for i, s in enumerate(sizes):
        row[SIZES + i] = int(s)
    return row


def sizes(table: torch.Tensor) -> torch.Tensor:
    """The ``(w, w)`` size slots of an exchanged header table."""
    return table[:, SIZES:]


def verify(table: torch.Tensor, *, op: str, error: Optional[BaseException], local: Dict[str, str]) -> None:
    """Raise the same ``ValueError`` on every rank if the ranks' headers disagree; re-raise
    this rank's own ``error`` (or report the ranks that failed) if any rank failed locally.

    ``local`` describes this rank's compressor, key and algorithm for the message.
    """
    rows = table.tolist()

    def col(name: str) -> List[int]:
        return [row[IDX[name]] for row in rows]

    def differs(*names: str) -> bool:
        return any(len(set(col(n))) > 1 for n in names)

    check_same_call(table, op=op)
    if differs("dtype"):
        per_rank = ", ".join(f"rank {r}: {_dtype_name(row)}" for r, row in enumerate(rows))
        raise ValueError(f"{op}: ranks passed tensors of different dtypes ({per_rank}); every rank must pass the same shape and dtype")
    if differs("ndim", "numel", "shape", *(f"d{i}" for i in range(_DIMS))):
        per_rank = ", ".join(f"rank {r}: {_shape_text(row)}" for r, row in enumerate(rows))
        raise ValueError(f"{op}: ranks passed tensors of different shapes ({per_rank}); every rank must pass the same shape and dtype")
    if differs("compressor"):
        raise ValueError(f"{op}: ranks use different compressors or options (this rank: {local['compressor']}); "
                         f"every rank must pass the same compressor configuration")
    if differs("algorithm"):
        names = {v: k for k, v in _CODES.items()}
        per_rank = ", ".join(f"rank {r}: {names.get(a, '?')}" for r, a in enumerate(col("algorithm")))
        raise ValueError(f"{op}: ranks chose different algorithms ({per_rank}); pass the same algorithm= on every rank")
    if differs("key"):
        raise ValueError(f"{op}: ranks passed different keys (this rank: {local['key']!r}); calls were made in a "
                         f"different order on some rank, or keys differ")
    if differs("part", "parts"):
        per_rank = ", ".join(f"rank {r}: {row[IDX['part']]}/{row[IDX['parts']]}" for r, row in enumerate(rows))
        raise ValueError(f"{op}: ranks of the inter-node group hold different shards ({per_rank}); each inter "
                         f"group must join the ranks with the same local index, as make_node_groups builds them")
    if differs("measure"):
        raise ValueError(f"{op}: ranks disagree on measure_error; pass the same value on every rank")
    failed = [r for r, e in enumerate(col("error")) if e]
    if failed:
        if error is not None:
            raise error
        raise ValueError(f"{op}: rank(s) {failed} rejected their input or failed to compress it (the error is "
                         f"raised there); nothing was exchanged")
    if differs("check"):
        raise ValueError(f"{op}: the native payloads differ between ranks outside the averaged tensor (metadata "
                         f"or index tensors), so they cannot be summed; the compressor's shared state (seed, "
                         f"step of key {local['key']!r}) is out of step across ranks")


def check_same_call(table: torch.Tensor, *, op: str) -> None:
    """Raise the same ``ValueError`` on every rank unless every rank is in the same collective
    (``allreduce``, ``allreduce_fused``, the hierarchical exchange)."""
    rows = table.tolist()
    names = {v: k for k, v in OPS.items()}
    calls = [names.get(row[IDX["op"]], "another gradcomp version") if row[IDX["magic"]] == MAGIC
             else "another gradcomp version" for row in rows]
    calls = [f"{c}_fused" if c == "allreduce" and _fused_row(row) else c for c, row in zip(calls, rows)]
    if len(set(calls)) > 1:
        per_rank = ", ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
        raise ValueError(f"{op}: ranks are in different collectives ({per_rank}); every rank must make the same "
                         f"calls in the same order")


def _fused_row(row: List[int]) -> bool:
    """Whether a row describes a set of tensors (see the module docstring): one tensor of at
    most ``_DIMS`` dims has the hash of its dims, a larger one has all ``_DIMS`` dims set,
    while a set's row has its total size in ``d0`` and no other dim."""
    ndim = row[IDX["ndim"]]
    if ndim < 0:
        return False  # not a tensor
    dims = [row[IDX[f"d{i}"]] for i in range(_DIMS)]
    if ndim > _DIMS:
        return dims[-1] == -1
    return row[IDX["shape"]] != h64(repr(tuple(dims[:ndim])))


def _dtype_name(row: List[int]) -> str:
    code = row[IDX["dtype"]]
    if code == -1:
        return "not a tensor"
    return str(_DTYPES[code - 1]).replace("torch.", "") if 0 < code <= len(_DTYPES) else "unsupported dtype"


def _shape_text(row: List[int]) -> str:
    ndim = row[IDX["ndim"]]
    if ndim < 0:
        return "not a tensor"
    if ndim > _DIMS:
        return f"{ndim}-d with {row[IDX['numel']]} elements"
    return str(tuple(row[IDX[f"d{i}"]] for i in range(ndim)))


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODE.get(dtype, 0)


def code_dtype(code: int) -> torch.dtype:
    if not 0 < code <= len(_DTYPES):
        raise ValueError(f"dtype code {code} is not one gradcomp sends")
    return _DTYPES[code - 1]


# ---- a set of tensors' row (allreduce_fused) -------------------------------------------------
def set_layout(items: List[Any]) -> str:
    """Every tensor's shape and dtype, in order (hashed into a set's header row)."""
    return repr([(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else type(t).__name__
                 for _, t, _ in items])


def set_header(world: int, algorithm: str, items: List[Any], specs: list, error, sizes: List[int]) -> List[int]:
    """The header row of a set of tensors (``allreduce_fused``): the row of one tensor of their
    total size, with the hash of the whole layout in its ``shape`` field."""
    numel = sum(t.numel() for _, t, _ in items if isinstance(t, torch.Tensor))
    row = build(world, op="allreduce", algorithm=algorithm, tensor=torch.empty(numel, device="meta"),
                compressor="|".join(s.desc for s in specs), key="\n".join(k for k, _, _ in items),
                error=error is not None, sizes=sizes)
    row[IDX["shape"]] = h64(set_layout(items))  # every tensor's shape and dtype, in order
    row[IDX["ndim"]] = len(items)
    return row


def verify_set(table: torch.Tensor, items: List[Any], specs: list, error) -> None:
    """Every rank's set header row (``table``) checked against this rank's: the same call, the
    same tensors, compressors and keys; ValueError on every rank otherwise."""
    def same(name: str) -> bool:
        return len(set(table[:, IDX[name]].tolist())) == 1

    check_same_call(table, op="allreduce")  # a rank in allreduce instead: say so, not "different tensors"
    if not (same("shape") and same("ndim") and same("numel")):
        per_rank = ", ".join(f"rank {r}: {row[IDX['ndim']]} tensors of {row[IDX['numel']]} elements"
                             for r, row in enumerate(table.tolist()))
        raise ValueError(f"allreduce_fused: ranks passed different tensors ({per_rank}, layouts compared by hash); "
                         f"every rank must pass the same shapes and dtypes in the same order")
    descs = sorted({s.desc for s in specs})
    keys = f"{items[0][0]}..{items[-1][0]}" if items else ""
    verify(table, op="allreduce", error=error, local={"compressor": ", ".join(descs), "key": keys})
