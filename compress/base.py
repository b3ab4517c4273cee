"""The compressor base class: validated keyword config, per-key step counters, dtype handling.

A compressor subclass declares ``options`` (name -> :class:`Option`) and implements
``_compress(flat, key, step) -> (tensors, meta)`` on a flat contiguous tensor and
``_decompress(payload) -> flat tensor``. The base class validates config and input, flattens,
handles empty tensors, restores shape/dtype on the way back and keeps the step counter per
key that seeds stochastic compressors. It never writes into its input.

Two faster forms serve error feedback and the collectives, each with a generic default that
a compressor may override with a single pass: ``decompress_into(payload, out)`` adds the
decoding into an existing buffer (``_decompress_into``), and ``compress_residual(acc)``
compresses ``acc`` and leaves ``acc - decoding`` in it (``_compress_residual``, declared by
``_in_place``).

Class attributes tell the collectives how a payload may travel (they choose the algorithm from
these, never from the name):

- ``native``: ``tensors[0]`` of payloads from many ranks may be averaged element-wise and the
  result decodes to the average; any further tensors are identical on every rank;
- ``fixed_size``: payload tensor sizes depend only on the number of elements;
- ``multi_round``: the compressor needs communication between its steps (``rounds``);
- ``unbiased``: ``E[decompress(compress(x))] == x``;
- ``stochastic``: draws randomness (keyed by seed, key and step, never the global RNG).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple

import torch

from gradcomp.kernels import rng
from gradcomp.kernels.quant import block_runs

from .payload import Payload, dtype_name
from .transaction import replace

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Option:
    """One keyword of a compressor's config."""

    default: Any
    kind: type | Tuple[type, ...]
    doc: str  # what it does and which way the trade-off goes
    check: Optional[Callable[[Any], bool]] = None
    rule: str = ""  # the allowed values, in words, for the error message
    choices: Optional[Tuple[Any, ...]] = None

    def validate(self, cname: str, name: str, value: Any) -> Any:
        kinds = self.kind if isinstance(self.kind, tuple) else (self.kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if ok and self.choices is not None:
            ok = value in self.choices
        if ok and self.check is not None:
            ok = bool(self.check(value))
        if not ok:
            allowed = self.rule or (f"one of {self.choices}" if self.choices else "/".join(k.__name__ for k in kinds))
            raise ValueError(f"{cname}: option {name}={value!r} is not allowed; {name} must be {allowed}")
        return value


def positive_int(doc: str, default: int) -> Option:
    return Option(default, int, doc, lambda v: v >= 1, "an int >= 1")


def seed_option() -> Option:
    return Option(0, int, "seed of the counter-based random streams; ranks that must agree share it",
                  lambda v: 0 <= v < 2**63, "an int in [0, 2**63)")


class Compressor:
    """Base class of every compressor; see the module docstring."""

    name: ClassVar[str] = "?"
    options: ClassVar[Dict[str, Option]] = {}
    native: ClassVar[bool] = False
    fixed_size: ClassVar[bool] = True
    multi_round: ClassVar[bool] = False
    unbiased: ClassVar[bool] = False
    stochastic: ClassVar[bool] = False
    # True when ``_compress(flat, key, step, want_decoded)`` takes the 4th argument and then
    # returns ``(tensors, meta, decoded_flat)``, saving error feedback a decode pass.
    _fused: ClassVar[bool] = False
    # True when ``_compress_residual(flat, key, step) -> (tensors, meta)`` exists: it compresses
    # ``flat`` and subtracts the decoding from it in place, so error feedback keeps its residual
    # in one buffer and never materialises the decoded tensor.
    _in_place: ClassVar[bool] = False

    def __init__(self, **options: Any) -> None:
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            allowed = ", ".join(sorted(self.options)) or "none"
            raise ValueError(f"{self.name}: unknown option(s) {', '.join(unknown)}; allowed: {allowed}")
        self.config: Dict[str, Any] = {}
        for oname, opt in self.options.items():
            value = opt.validate(self.name, oname, options.get(oname, opt.default))
            self.config[oname] = value
            setattr(self, oname, value)
        self._steps: Dict[str, int] = {}
        self._post_init()

    def _post_init(self) -> None:
        """Cross-option validation and derived fields; subclasses override."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"get_compressor({self.name!r}{', ' if args else ''}{args})"

    # ---- public API -------------------------------------------------------------------
    def compress(self, tensor: torch.Tensor, key: Optional[str] = None, *, step: Optional[int] = None) -> Payload:
        """Compress ``tensor`` (left unchanged). ``key`` names it across steps."""
        return self._run(tensor, key, step, want_decoded=False)[0]

    def compress_decoded(self, tensor: torch.Tensor, key: Optional[str] = None, *,
                         step: Optional[int] = None) -> Tuple[Payload, torch.Tensor]:
        """``(payload, decompress(payload))`` — what error feedback needs — in as few passes as
        the compressor manages: ``_compress`` may return the decoded tensor as a third item."""
        payload, decoded = self._run(tensor, key, step, want_decoded=True)
        if decoded is None:
            return payload, self.decompress(payload)
        return payload, decoded.to(payload.dtype).reshape(payload.shape)

    def compress_residual(self, acc: torch.Tensor, key: Optional[str] = None, *,
                          step: Optional[int] = None) -> Payload:
        """Compress ``acc`` and leave the compression error in it: afterwards ``acc`` holds
        ``acc - decompress(payload)``, bit for bit up to the sign of a NaN. Changes ``acc``, which
        must be contiguous; error feedback's residual update without a decoded temporary."""
        self._check_input(acc)
        if not acc.is_contiguous():
            raise ValueError(f"{self.name}: compress_residual needs a contiguous tensor to update in place")
        if not self._in_place:
            payload, decoded = self.compress_decoded(acc, key, step=step)
            # the payload must not see the subtraction below (a compressor may send views of acc)
            payload.tensors = [t.clone() if _shares(t, acc) else t for t in payload.tensors]
            acc.sub_(decoded.reshape(acc.shape).to(acc.dtype))
            return payload
        skey, step = self._step(key, step)
        flat = acc.detach().view(-1)
        if not flat.numel():
            return self._run(acc, key, step, want_decoded=False)[0]
        tensors, meta = self._compress_residual(flat, skey, step)
        return Payload(self.name, tuple(acc.shape), acc.dtype, list(tensors), dict(meta))

    def _step(self, key: Optional[str], step: Optional[int]) -> Tuple[str, int]:
        """The key as a string and this call's step (the key's counter, advanced, by default)."""
        skey = "" if key is None else str(key)
        if step is None:
            step = self._steps.get(skey, 0)
            replace(self._steps, skey)  # an open transaction may have to undo it
            self._steps[skey] = step + 1
        return skey, int(step)

    def _run(self, tensor, key, step, want_decoded):
        self._check_input(tensor)
        skey, step = self._step(key, step)
        flat = tensor.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        out = self._encode(flat, tuple(tensor.shape), skey, int(step), want_decoded)
        tensors, meta = out[0], out[1]
        decoded = out[2] if len(out) > 2 else None
        return Payload(self.name, tuple(tensor.shape), tensor.dtype, list(tensors), dict(meta)), decoded

    def _encode(self, flat: torch.Tensor, shape: Tuple[int, ...], key: str, step: int, want_decoded: bool):
        """``_compress`` of the flat input; a compressor that needs the original ``shape`` (a
        matrix view) overrides this instead."""
        return self._compress(flat, key, step, want_decoded) if self._fused else self._compress(flat, key, step)

    def decompress(self, payload: Payload) -> torch.Tensor:
        """The tensor a payload stands for: original shape, dtype and device."""
        if not isinstance(payload, Payload):
            raise ValueError(f"{self.name}: decompress expects a Payload, got {type(payload).__name__}")
        if payload.compressor != self.name:
            raise ValueError(f"payload was made by {payload.compressor!r}, not by {self.name!r}")
        flat = self._decompress(payload)
        return flat.to(payload.dtype).reshape(payload.shape)

    def decompress_into(self, payload: Payload, out: torch.Tensor, *, alpha: float = 1.0,
                        accumulate: bool = True) -> torch.Tensor:
        """Add ``alpha * decompress(payload)`` to ``out`` in place (write it, with
        ``accumulate=False``) and return ``out``: a collective sums payloads into one buffer
        instead of decoding each into a temporary. ``out``: contiguous, floating, the payload's
        number of elements, any shape. With ``alpha == 1`` the result has the bits of
        ``out + decompress(payload).to(out.dtype)`` (of that cast, without ``accumulate``), except
        that a sparse payload leaves ``out`` alone off its indices, where adding +0.0 would turn
        a -0.0 into +0.0; any other ``alpha`` is applied with the decoder's own rounding."""
        if not isinstance(payload, Payload):
            raise ValueError(f"{self.name}: decompress_into expects a Payload, got {type(payload).__name__}")
        if payload.compressor != self.name:
            raise ValueError(f"payload was made by {payload.compressor!r}, not by {self.name!r}")
        if (not isinstance(out, torch.Tensor) or not out.is_floating_point() or not out.is_contiguous()
                or out.numel() != payload.numel):
            raise ValueError(f"{self.name}: decompress_into needs a contiguous floating tensor of {payload.numel} "
                             f"elements to write into")
        flat = out.view(-1)
        if flat.numel():
            self._decompress_into(payload, flat, float(alpha), bool(accumulate))
        return out

    def _decompress_into(self, payload: Payload, out: torch.Tensor, alpha: float, accumulate: bool) -> None:
        """``decompress_into`` on a flat ``out``; subclasses override with a pass that needs no
        temporary."""
        add_into(out, self.decompress(payload).reshape(-1), alpha, accumulate)

    def _decode_runs_into(self, payload: Payload, out: torch.Tensor, align: int, alpha: float,
                          accumulate: bool) -> None:
        """``_decompress_into`` in cache-sized runs whose starts are multiples of ``align``,
        each decoded by the subclass's ``_decode(payload, a, b)`` (elements ``a:b``, work
        dtype): the bits of the generic form without a full-size temporary."""
        for a, b in block_runs(payload.numel, align, out.device):
            add_into(out[a:b], self._decode(payload, a, b).to(payload.dtype), alpha, accumulate)

    def bits_per_element(self, numel: int = 1 << 20) -> float:
        """Theoretical wire bits per element for a tensor of ``numel`` elements."""
        return 8.0 * self._wire_bytes(numel) / max(numel, 1)

    def state_dict(self) -> Dict[str, Any]:
        """Runtime state (step counters and any warm-start data), keyed by tensor key."""
        return {"name": self.name, "config": dict(self.config), "steps": dict(self._steps)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"state_dict was saved by {state.get('name')!r}, not by {self.name!r}")
        if state.get("config") != self.config:
            raise ValueError(f"{self.name}: state_dict config {state.get('config')} differs from {self.config}")
        self._steps = dict(state["steps"])

    @classmethod
    def check_payload(cls, payload: Payload) -> None:
        """Raise ``ValueError`` unless ``payload`` is well formed for this compressor.

        Called by ``Payload.from_bytes`` before anything decodes the tensors.
        """
        if payload.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{cls.name}: payload dtype must be floating point, got {payload.dtype}")
        cls._check_tensors(payload)

    # ---- for subclasses ---------------------------------------------------------------
    def rounds(self, tensor: torch.Tensor, key: Optional[str] = None, *, out: Optional[torch.Tensor] = None):
        """Multi-round form (``multi_round`` compressors only), a generator protocol.

        It yields tensors that the caller averages over all ranks and sends back with
        ``gen.send(average)``; its return value (``StopIteration.value``) is the result, with
        the shape and dtype of ``tensor``. With one process the average is the tensor itself.
        ``out``: a contiguous tensor of ``tensor``'s shape, dtype and device that receives the
        result (which is then ``out``); it may be ``tensor`` itself, when the caller no longer
        needs the input (a DDP bucket's gradient): the input is read in full first.
        """
        raise ValueError(f"{self.name} is not a multi-round compressor")

    def _compress(self, flat: torch.Tensor, key: str, step: int) -> Tuple[List[torch.Tensor], Dict[str, Any]]:
        raise NotImplementedError

    def _compress_residual(self, flat: torch.Tensor, key: str, step: int) -> Tuple[List[torch.Tensor], Dict[str, Any]]:
        raise NotImplementedError

    def _decompress(self, payload: Payload) -> torch.Tensor:
        raise NotImplementedError

    def _wire_bytes(self, numel: int) -> float:
        raise NotImplementedError

    @classmethod
    def _check_tensors(cls, payload: Payload) -> None:
        raise NotImplementedError

    def _uniform(self, numel: int, key: str, step: int, device: torch.device, salt: str = "") -> torch.Tensor:
        """Uniform [0, 1) float32 draws from the stream (seed, key, step)."""
        seed = self.config.get("seed", 0)
        return rng.uniform(numel, rng.stream_key(seed, f"{self.name}{salt}/{key}", step), device)

    def _check_input(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{self.name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{self.name}: tensor dtype {tensor.dtype} not supported; use one of "
                             f"{', '.join(dtype_name(d) for d in FLOAT_DTYPES)}")


def add_into(out: torch.Tensor, decoded: torch.Tensor, alpha: float, accumulate: bool) -> None:
    """The rule of ``decompress_into`` for ``decoded`` (the decoder's values, in the payload's
    dtype): cast to ``out``'s dtype, then added with ``alpha`` or written (scaled)."""
    decoded = decoded.to(out.dtype)
    if accumulate:
        out.add_(decoded, alpha=alpha)
    elif alpha == 1.0:
        out.copy_(decoded)
    else:
        torch.mul(decoded, alpha, out=out)


def _shares(t: torch.Tensor, other: torch.Tensor) -> bool:
    return bool(t.numel()) and t.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()


def expect(cond: bool, cname: str, what: str) -> None:
    """Payload validation helper: ``ValueError`` naming the compressor unless ``cond``."""
    if not cond:
        raise ValueError(f"{cname}: malformed payload: {what}")


def tensor_spec(payload: Payload, specs: List[Tuple[torch.dtype, int]], cname: str) -> None:
    """Check that ``payload.tensors`` are 1-D with exactly these (dtype, numel) pairs."""
    expect(len(payload.tensors) == len(specs), cname, f"expected {len(specs)} tensors, got {len(payload.tensors)}")
    for i, (t, (dtype, numel)) in enumerate(zip(payload.tensors, specs)):
        expect(t.dtype == dtype, cname, f"tensor {i} has dtype {t.dtype}, expected {dtype}")
        expect(t.dim() == 1 and t.numel() == numel, cname,
               f"tensor {i} has shape {tuple(t.shape)}, expected ({numel},)")


def meta_int(payload: Payload, name: str, cname: str, lo: int = 0, hi: int = 1 << 62) -> int:
    v = payload.meta.get(name)
    expect(isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi, cname,
           f"meta {name}={v!r} must be an int in [{lo}, {hi}]")
    return v


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype for a gradient of ``dtype``: fp32, or fp64 for fp64 input."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def numel_of(payload: Payload) -> int:
    return math.prod(payload.shape)
