"""The compressor contract, written down once: what a compressor declares, implements and may add.

A compressor is one class in one file, registered with ``@register(name)``. It declares

- ``Config``: a frozen dataclass of its keyword options, one :func:`option` per field (default,
  the trade-off, the allowed values), validated at construction and read as
  ``self.config.ratio``. Options live in ``config`` only, never as attributes of the
  compressor, and registration refuses one named like a capability, a method or an attribute;
- ``capabilities``: a :class:`Capabilities` (how its payloads may travel), as a class attribute,
  or as a property computed from ``config`` where an option decides one (``int8``'s
  ``stochastic``, declared ``option(..., capability=True)``). ``c.native`` and the other four
  read it; nothing else declares them;

and implements, on a flat contiguous tensor (the base validates the input, flattens, handles
empty tensors, restores shape and dtype, and keeps the per-key step counter that seeds
stochastic compressors; it never writes into its input):

- ``_compress(flat, shape, key, step, want_decoded) -> Encoded``: the wire tensors and meta, and,
  when ``want_decoded`` and it comes without an extra pass, the decoding (``None`` otherwise:
  the base then decodes); ``shape`` is the input's, for a compressor that views it as a matrix;
- ``_decompress(payload) -> flat tensor``, ``_wire_bytes(numel)``, ``_check_tensors(payload)``.

Optional hooks, each a faster form with a generic default, used where overridden:

- ``_compress_residual(flat, key, step) -> Encoded``: compress ``flat`` and leave
  ``flat - decoding`` in it, one pass. Overriding it is what makes :attr:`compresses_in_place`
  true, so error feedback keeps its residual in one buffer (``compress_residual``);
- ``_compress_residual_sum(flat, a, b, key, step, defer) -> Encoded | None``: the same for
  ``flat = a + b`` with the sum inside the compressor's first pass (error feedback's residual
  plus gradient), or None where that form does not apply (the base then adds first); given a
  list ``defer``, it may leave the residual's pass to a callable it appends there;
- ``_decompress_into(payload, out, alpha, accumulate)``: add the decoding into a buffer;
- ``_decode(payload, a, b)``: elements ``a:b`` of the decoding, so that ``_decompress_into`` can
  decode in cache-sized runs with :meth:`_decode_runs_into`;
- ``rounds(tensor, key)``: the multi-round form (``capabilities.multi_round``);
- ``_post_init()``: runtime state (warm starts, momenta), kept apart from config.

One word per concept: the decoding that ``_compress`` hands back when asked is
:attr:`Encoded.decoded`; a compressor that updates the residual in its own buffer
:attr:`compresses_in_place`, and error feedback that does so for a tensor
``keeps_residual_in_place(tensor)``; "fused" means only ``allreduce_fused``, many tensors in
one collective.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import MappingProxyType
from typing import (Any, Callable, ClassVar, Dict, Generator, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Type,
                    TypeVar, cast)

import torch

from gradcomp.kernels import rng
from gradcomp.kernels.quant import block_runs

from .payload import Payload, dtype_name
from .transaction import replace

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_T = TypeVar("_T")


@dataclass(frozen=True)
class Capabilities:
    """How a compressor's payloads may travel: the collectives choose the algorithm from these,
    never from the name."""

    # tensors[0] of payloads from many ranks may be averaged element-wise and the result
    # decodes to the average; any further tensors are identical on every rank
    native: bool = False
    fixed_size: bool = True  # payload tensor sizes depend only on the number of elements
    multi_round: bool = False  # needs communication between its steps (``rounds``)
    unbiased: bool = False  # E[decompress(compress(x))] == x
    stochastic: bool = False  # draws randomness (keyed by seed, key and step, never the global RNG)


CAPABILITIES = tuple(f.name for f in dataclasses.fields(Capabilities))

# The multi-round protocol (``Compressor.rounds``): yields tensors to average over the ranks,
# is sent each average back, returns the result.
Rounds = Generator[torch.Tensor, torch.Tensor, torch.Tensor]


class Encoded(NamedTuple):
    """What ``_compress`` and ``_compress_residual`` return."""

    tensors: List[torch.Tensor]  # what crosses the wire
    meta: Dict[str, Any]  # what the receiver needs besides them (JSON-able)
    # the flat decoding, when asked for and cheaper than a decode pass; None: the base decodes
    decoded: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class Option:
    """One keyword of a compressor's config, as :attr:`Compressor.options` lists it."""

    default: Any
    kind: type | Tuple[type, ...]  # the field's annotated type
    doc: str  # what it does and which way the trade-off goes
    check: Optional[Callable[[Any], bool]] = None
    rule: str = ""  # the allowed values, in words, for the error message
    choices: Optional[Tuple[Any, ...]] = None
    capability: bool = False  # the option is the capability of the same name (see ``option``)

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


_SPEC = "gradcomp.option"  # the metadata key of an option's field


def option(default: _T, doc: str, check: Optional[Callable[[Any], bool]] = None, rule: str = "",
           choices: Optional[Tuple[Any, ...]] = None, *, capability: bool = False) -> _T:
    """A field of a compressor's ``Config``: its ``default``, what it does (``doc``: which way the
    trade-off goes) and the values allowed (``check``, described by ``rule``, or ``choices``).
    ``capability=True`` says the option is the capability of the same name, which the class's
    ``capabilities`` property then reports (registration checks both values of the bool)."""
    spec = {"doc": doc, "check": check, "rule": rule, "choices": choices, "capability": capability}
    return dataclasses.field(default=default, metadata={_SPEC: spec})


def positive_int(doc: str, default: int) -> int:
    return option(default, doc, lambda v: v >= 1, "an int >= 1")


def seed_option() -> int:
    return option(0, "seed of the counter-based random streams; ranks that must agree share it",
                  lambda v: 0 <= v < 2**63, "an int in [0, 2**63)")


@dataclass(frozen=True)
class CompressorConfig:
    """Base of every compressor's ``Config``: a frozen dataclass whose fields are :func:`option`\\ s."""

    @classmethod
    def options(cls) -> Dict[str, Option]:
        """Field name -> :class:`Option`, in declaration order (the order of ``repr``)."""
        hints = typing.get_type_hints(cls)
        out = {}
        for f in dataclasses.fields(cls):
            spec = f.metadata.get(_SPEC)
            if spec is None:
                raise TypeError(f"{cls.__qualname__}.{f.name} must be declared with option(...)")
            out[f.name] = Option(f.default, hints[f.name], **spec)
        return out

    def as_dict(self) -> Dict[str, Any]:
        """The options by name, in declaration order (what ``state_dict`` and ``repr`` show)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class _ReadsCapabilities:
    """``c.native``, ``c.fixed_size``, ...: read-only views of ``c.capabilities``, the one place
    they are declared (shared by compressors and the error-feedback wrappers)."""

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities()

    @property
    def native(self) -> bool:
        return self.capabilities.native

    @property
    def fixed_size(self) -> bool:
        return self.capabilities.fixed_size

    @property
    def multi_round(self) -> bool:
        return self.capabilities.multi_round

    @property
    def unbiased(self) -> bool:
        return self.capabilities.unbiased

    @property
    def stochastic(self) -> bool:
        return self.capabilities.stochastic


class Compressor(_ReadsCapabilities, ABC):
    """Base class of every compressor; see the module docstring."""

    name: ClassVar[str] = "?"
    Config: ClassVar[Type[CompressorConfig]] = CompressorConfig
    config: CompressorConfig
    # name -> Option, from Config (read by the policy and the benchmarks for allowed keywords)
    options: ClassVar[Mapping[str, Option]] = MappingProxyType({})
    # its own payloads' indices lie in range and strictly increase by construction: they are
    # marked ``Payload.checked`` and decode without a host check (see ``check_on_device``)
    payloads_checked: ClassVar[bool] = False
    # its decompress_mean_into saves a pass when ``out`` holds zeros (``zeroed=True``: a sparse
    # combine writes only the positions sent); a collective then allocates the result zeroed,
    # and leaves it uninitialised otherwise (zeroing a recycled heap block is a pass of its own)
    starts_from_zeros: ClassVar[bool] = False
    # a variable-size compressor (fixed_size=False) that sends payloads of an agreed capacity
    # where the collectives ask it to (``compress.sparse.payload_bounds``): under error feedback
    # its agreed exchanges then need no size vector, and no host read
    bounded_sizes: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "options" in vars(cls):
            raise TypeError(f"{cls.__qualname__}: declare options as fields of a Config dataclass "
                            f"(name: type = option(...)); options is derived from it")
        cls.options = MappingProxyType(cls.Config.options())

    def __init__(self, **options: Any) -> None:
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            allowed = ", ".join(sorted(self.options)) or "none"
            raise ValueError(f"{self.name}: unknown option(s) {', '.join(unknown)}; allowed: {allowed}")
        self.config = self.Config(**{oname: opt.validate(self.name, oname, options.get(oname, opt.default))
                                     for oname, opt in self.options.items()})
        self._steps: Dict[str, int] = {}
        self._post_init()

    def _post_init(self) -> None:
        """Runtime state (warm starts, momenta) and cross-option checks; subclasses override."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config.as_dict().items())
        return f"get_compressor({self.name!r}{', ' if args else ''}{args})"

    @property
    def base(self) -> "Compressor":
        """The compressor that encodes and decodes: itself (a wrapper's ``base`` is the one inside)."""
        return self

    @property
    def compresses_in_place(self) -> bool:
        """Whether :meth:`compress_residual` is one in-place pass: the class overrides
        ``_compress_residual`` (detected, never declared)."""
        return type(self)._compress_residual is not Compressor._compress_residual

    # ---- public API -------------------------------------------------------------------
    def compress(self, tensor: torch.Tensor, key: Optional[str] = None, *, step: Optional[int] = None) -> Payload:
        """Compress ``tensor`` (left unchanged). ``key`` names it across steps."""
        return self._run(tensor, key, step, want_decoded=False)[0]

    def compress_view(self, tensor: torch.Tensor, key: Optional[str] = None, *, step: Optional[int] = None) -> Payload:
        """:meth:`compress` for a caller that copies the payload's tensors out before ``tensor``
        changes (the pipeline's transport, which frames them at once): the same payload, whose
        tensors may be views of ``tensor`` where the compressor would only copy it. By default
        :meth:`compress` itself; the identity codec's is a view."""
        return self.compress(tensor, key, step=step)

    def compress_decoded(self, tensor: torch.Tensor, key: Optional[str] = None, *,
                         step: Optional[int] = None) -> Tuple[Payload, torch.Tensor]:
        """``(payload, decompress(payload))`` — what error feedback needs — in as few passes as
        the compressor manages: ``_compress`` may hand back the decoding (``Encoded.decoded``)."""
        payload, decoded = self._run(tensor, key, step, want_decoded=True)
        if decoded is None:
            return payload, self.decompress(payload)
        return payload, decoded.to(payload.dtype).reshape(payload.shape)

    def compress_residual(self, acc: torch.Tensor, key: Optional[str] = None, *,
                          step: Optional[int] = None,
                          sum_of: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                          defer: Optional[List[Callable[[], None]]] = None) -> Payload:
        """Compress ``acc`` and leave the compression error in it: afterwards ``acc`` holds
        ``acc - decompress(payload)``, bit for bit up to the sign of a NaN. Changes ``acc``, which
        must be contiguous; error feedback's residual update without a decoded temporary (one
        pass where :attr:`compresses_in_place`).

        ``sum_of=(a, b)`` (tensors of ``acc``'s shape and dtype; either may be ``acc``): ``acc``
        is first overwritten with ``a + b``, the bits of ``torch.add(a, b, out=acc)``, inside
        the compressor's first pass where it has that form (one pass over memory fewer).
        ``defer`` (a list, with ``sum_of``): the compressor may append a callable that completes
        ``acc``'s residual later, the payload being complete already; the caller runs it before
        anything reads ``acc`` (a collective: while the payload is on the wire)."""
        self._check_input(acc)
        if not acc.is_contiguous():
            raise ValueError(f"{self.name}: compress_residual needs a contiguous tensor to update in place")
        if sum_of is not None:
            a, b = (t.detach() for t in sum_of)
            if a.shape != acc.shape or b.shape != acc.shape or a.dtype != acc.dtype or b.dtype != acc.dtype:
                raise ValueError(f"{self.name}: compress_residual's sum_of must match acc's shape and dtype")
            if self.compresses_in_place and acc.numel() and a.is_contiguous() and b.is_contiguous():
                skey, step = self._step(key, step)
                enc = self._compress_residual_sum(acc.detach().view(-1), a.view(-1), b.view(-1), skey, step, defer)
                if enc is not None:
                    return Payload(self.name, tuple(acc.shape), acc.dtype, list(enc.tensors), dict(enc.meta),
                                   self.payloads_checked)
                return self._compress_residual_now(torch.add(a, b, out=acc), skey, step)
            torch.add(a, b, out=acc)
        if not self.compresses_in_place:
            payload, decoded = self.compress_decoded(acc, key, step=step)
            # the payload must not see the subtraction below (a compressor may send views of acc)
            payload.tensors = [t.clone() if _shares(t, acc) else t for t in payload.tensors]
            acc.sub_(decoded.reshape(acc.shape).to(acc.dtype))
            return payload
        skey, step = self._step(key, step)
        flat = acc.detach().view(-1)
        if not flat.numel():
            return self._run(acc, key, step, want_decoded=False)[0]
        return self._compress_residual_now(acc, skey, step)

    def _compress_residual_now(self, acc: torch.Tensor, skey: str, step: int) -> Payload:
        tensors, meta, _ = self._compress_residual(acc.detach().view(-1), skey, step)
        return Payload(self.name, tuple(acc.shape), acc.dtype, list(tensors), dict(meta), self.payloads_checked)

    def count(self, key: Optional[str]) -> int:
        """Advance ``key``'s step counter as a call would, without compressing (a bucket that
        casts a whole buffer at once still counts each tensor's call); the step it had."""
        return self._step(key, None)[1]

    def _step(self, key: Optional[str], step: Optional[int]) -> Tuple[str, int]:
        """The key as a string and this call's step (the key's counter, advanced, by default)."""
        skey = "" if key is None else str(key)
        if step is None:
            step = self._steps.get(skey, 0)
            replace(self._steps, skey)  # an open transaction may have to undo it
            self._steps[skey] = step + 1
        return skey, int(step)

    def _run(self, tensor: torch.Tensor, key: Optional[str], step: Optional[int],
             want_decoded: bool) -> Tuple[Payload, Optional[torch.Tensor]]:
        self._check_input(tensor)
        skey, step = self._step(key, step)
        flat = tensor.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        shape = tuple(tensor.shape)
        tensors, meta, decoded = self._compress(flat, shape, skey, int(step), want_decoded)
        return Payload(self.name, shape, tensor.dtype, list(tensors), dict(meta), self.payloads_checked), decoded

    def decompress(self, payload: Payload) -> torch.Tensor:
        """The tensor a payload stands for: original shape, dtype and device."""
        if not isinstance(payload, Payload):
            raise ValueError(f"{self.name}: decompress expects a Payload, got {type(payload).__name__}")
        if payload.compressor != self.name:
            raise ValueError(f"payload was made by {payload.compressor!r}, not by {self.name!r}")
        flat = self._decompress(payload)
        return flat.to(payload.dtype).reshape(payload.shape)

    def decoding_of(self, payload: Payload) -> Optional[torch.Tensor]:
        """The decoding of ``payload`` when it is its first tensor as it lies (no pass, no new
        memory: a view of it, which the caller then owns), else None. The identity codec's
        is; a collective that averaged that tensor returns it instead of copying it into a
        fresh buffer (whose first touch costs page faults on CPU)."""
        return None

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

    def decompress_mean_into(self, payloads: Sequence[Payload], out: torch.Tensor, *,
                             zeroed: bool = False) -> torch.Tensor:
        """``out`` = the mean of the payloads' decodings, a collective's combine: the bits of
        ``decompress_into`` of each in turn (the first writing) and one ``out.div_``. A
        compressor may override it with one pass (the sign family and top-k on large CPU
        tensors do). ``zeroed``: ``out`` holds +0.0 everywhere (a fresh zeroed buffer), which a
        combine that starts from zeros need not write again."""
        for r, payload in enumerate(payloads):
            self.decompress_into(payload, out, accumulate=r > 0)
        return out.div_(len(payloads))

    def decodes_finite(self, payload: Payload, dtype: Optional[torch.dtype] = None) -> bool:
        """True when ``payload``'s decoding (``decompress_into`` a tensor of ``dtype``, by default
        the payload's) is known to be finite from its small tensors alone, with no host read (a
        CPU payload); False when that is not known. By default False."""
        return False

    def bits_per_element(self, numel: int = 1 << 20) -> float:
        """Theoretical wire bits per element for a tensor of ``numel`` elements."""
        return 8.0 * self._wire_bytes(numel) / max(numel, 1)

    def state_dict(self) -> Dict[str, Any]:
        """Runtime state (step counters and any warm-start data), keyed by tensor key."""
        return {"name": self.name, "config": self.config.as_dict(), "steps": dict(self._steps)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"state_dict was saved by {state.get('name')!r}, not by {self.name!r}")
        config = self.config.as_dict()
        if state.get("config") != config:
            raise ValueError(f"{self.name}: state_dict config {state.get('config')} differs from {config}")
        self._steps = dict(state["steps"])

    def step_count(self, key: str) -> Optional[int]:
        """``key``'s step counter: its calls that advanced it (None: never compressed). Ranks
        whose counters agree draw the same randomness at the next call."""
        return self._steps.get(key)

    @classmethod
    def check_contract(cls) -> None:
        """What ``@register`` checks of this class before admitting it (:func:`check_contract`)."""
        check_contract(cls)

    @classmethod
    def check_payload(cls, payload: Payload) -> None:
        """Raise ``ValueError`` unless ``payload`` is well formed for this compressor.

        Called by ``Payload.from_bytes`` before anything decodes the tensors.
        """
        if payload.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{cls.name}: payload dtype must be floating point, got {payload.dtype}")
        cls._check_tensors(payload)

    @classmethod
    def check_on_device(cls, payload: Payload) -> Tuple[Payload, Optional[torch.Tensor]]:
        """A payload received on an agreed layout (its tensors' dtypes and shapes known before
        it arrived, so what :meth:`check_payload` checks on the host holds) made safe to decode
        without reading anything back, and a device flag (non-zero: invalid) for what only its
        values can show, read when the step ends. By default nothing is needed: any bits of
        the agreed sizes decode without an out-of-range access (and a non-finite decoding is
        caught by the step's finiteness); payloads with indices or lengths override it."""
        return payload, None

    def rounds(self, tensor: torch.Tensor, key: Optional[str] = None, *, out: Optional[torch.Tensor] = None) -> Rounds:
        """Multi-round form (``multi_round`` compressors only), a generator protocol.

        It yields tensors that the caller averages over all ranks and sends back with
        ``gen.send(average)``; its return value (``StopIteration.value``) is the result, with
        the shape and dtype of ``tensor``. With one process the average is the tensor itself.
        ``out``: a contiguous tensor of ``tensor``'s shape, dtype and device that receives the
        result (which is then ``out``); it may be ``tensor`` itself, when the caller no longer
        needs the input (a DDP bucket's gradient): the input is read in full first.
        """
        raise ValueError(f"{self.name} is not a multi-round compressor")

    # ---- what every compressor implements -------------------------------------------------
    @abstractmethod
    def _compress(self, flat: torch.Tensor, shape: Tuple[int, ...], key: str, step: int,
                  want_decoded: bool) -> Encoded:
        """Encode ``flat`` (the input of ``shape``, flattened and contiguous) for step ``step`` of
        ``key``; with ``want_decoded``, also return the decoding if it costs no extra pass."""

    @abstractmethod
    def _decompress(self, payload: Payload) -> torch.Tensor:
        """The flat decoding of ``payload`` (any floating dtype; the base casts and reshapes)."""

    @abstractmethod
    def _wire_bytes(self, numel: int) -> float:
        """Theoretical payload bytes for ``numel`` elements."""

    @classmethod
    @abstractmethod
    def _check_tensors(cls, payload: Payload) -> None:
        """``ValueError`` (see :func:`expect`) unless tensors and meta are well formed."""

    # ---- optional hooks: a faster form, used where overridden --------------------------------
    def _compress_residual(self, flat: torch.Tensor, key: str, step: int) -> Encoded:
        """Encode ``flat`` and subtract the decoding from it in place; overriding it makes
        :attr:`compresses_in_place` true. Never called otherwise."""
        raise NotImplementedError(f"{self.name}: _compress_residual is not overridden; call compress_residual")

    def _compress_residual_sum(self, flat: torch.Tensor, a: torch.Tensor, b: torch.Tensor, key: str,
                               step: int, defer: Optional[List[Callable[[], None]]] = None) -> Optional[Encoded]:
        """``_compress_residual`` of ``flat = a + b`` (flat, contiguous, one dtype; ``a`` or ``b``
        may be ``flat``) with the sum inside the first pass, or None (nothing written) where this
        compressor has no such form for these tensors. With a list ``defer`` it may append a
        callable that does the residual's pass and return the payload before it. By default None."""
        return None

    def _decompress_into(self, payload: Payload, out: torch.Tensor, alpha: float, accumulate: bool) -> None:
        """``decompress_into`` on a flat ``out``; subclasses override with a pass that needs no
        temporary."""
        add_into(out, self.decompress(payload).reshape(-1), alpha, accumulate)

    def _decode(self, payload: Payload, a: int, b: int) -> torch.Tensor:
        """Elements ``a:b`` of the decoding in the work dtype, for :meth:`_decode_runs_into`; a
        compressor that decodes in runs overrides it."""
        raise NotImplementedError(f"{self.name}: _decode_runs_into needs _decode(payload, a, b), which "
                                  f"{type(self).__name__} does not override")

    def _decode_runs_into(self, payload: Payload, out: torch.Tensor, align: int, alpha: float,
                          accumulate: bool) -> None:
        """``_decompress_into`` in cache-sized runs whose starts are multiples of ``align``,
        each decoded by ``_decode(payload, a, b)``: the bits of the generic form without a
        full-size temporary."""
        for a, b in block_runs(payload.numel, align, out.device):
            add_into(out[a:b], self._decode(payload, a, b).to(payload.dtype), alpha, accumulate)

    # ---- helpers ----------------------------------------------------------------------
    def _uniform(self, numel: int, key: str, step: int, device: torch.device, salt: str = "") -> torch.Tensor:
        """Uniform [0, 1) float32 draws from the stream (seed, key, step)."""
        seed = getattr(self.config, "seed", 0)
        return rng.uniform(numel, rng.stream_key(seed, f"{self.name}{salt}/{key}", step), device)

    def _check_input(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{self.name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{self.name}: tensor dtype {tensor.dtype} not supported; use one of "
                             f"{', '.join(dtype_name(d) for d in FLOAT_DTYPES)}")


def check_contract(cls: Type[Compressor]) -> None:
    """What ``@register`` checks of a class before admitting it (``TypeError`` naming the fix):
    a frozen ``Config`` of options, capabilities declared only in ``capabilities``, no option
    named like a capability (unless declared as that capability, and reported so), a method or
    an attribute, and the one signature of each hook it overrides."""
    where = f"compressor {cls.name!r} ({cls.__qualname__})"
    params = vars(cls.Config).get("__dataclass_params__")  # set by @dataclass on the class itself
    if not issubclass(cls.Config, CompressorConfig) or params is None or not params.frozen:
        raise TypeError(f"{where}: Config must be a CompressorConfig decorated with @dataclass(frozen=True)")
    own = cls.__mro__[:cls.__mro__.index(Compressor)]
    if not any("capabilities" in vars(klass) for klass in own):
        raise TypeError(f"{where}: declare its capabilities, capabilities = Capabilities(...) (the defaults "
                        f"if none applies)")
    if not isinstance(inspect.getattr_static(cls, "capabilities"), (Capabilities, property)):
        raise TypeError(f"{where}: capabilities must be a Capabilities(...) or a property returning one")
    for klass in own:
        for cap in CAPABILITIES:
            if cap in vars(klass):
                raise TypeError(f"{where}: {klass.__name__} sets {cap!r} itself; declare it once, in "
                                f"capabilities = Capabilities({cap}=...)")
    for oname, opt in cls.options.items():
        if oname in CAPABILITIES:
            if not opt.capability:
                raise TypeError(f"{where}: option {oname!r} is named like the capability {oname!r}; rename the "
                                f"option, or declare it option(..., capability=True) and compute "
                                f"capabilities from config")
            _check_capability_option(cls, where, oname, opt)
        elif opt.capability:
            raise TypeError(f"{where}: option {oname!r} says capability=True, but there is no capability "
                            f"{oname!r}; capabilities are {', '.join(CAPABILITIES)}")
        elif hasattr(cls, oname):
            raise TypeError(f"{where}: option {oname!r} is named like an attribute or method of the compressor; "
                            f"rename the option (options are read as config.{oname})")
    for hook in ("_compress", "_compress_residual", "_decode"):
        mine, base = _signature(getattr(cls, hook)), _signature(getattr(Compressor, hook))
        if mine != base:
            raise TypeError(f"{where}: {hook}({', '.join(mine)}) must have the signature "
                            f"{hook}({', '.join(base)})")


def _check_capability_option(cls: Type[Compressor], where: str, oname: str, opt: Option) -> None:
    if opt.kind is not bool or not isinstance(inspect.getattr_static(cls, "capabilities"), property):
        raise TypeError(f"{where}: option {oname!r} (capability=True) must be a bool that a capabilities "
                        f"property reports")
    for value in (False, True):
        if getattr(cls(**{oname: value}).capabilities, oname) is not value:
            raise TypeError(f"{where}: with option {oname}={value} its capabilities must report {oname}={value}")


def _signature(fn: Callable[..., Any]) -> Tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


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
    return cast(int, v)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype for a gradient of ``dtype``: fp32, or fp64 for fp64 input."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def numel_of(payload: Payload) -> int:
    return math.prod(payload.shape)
