"""``as_codec``: what a compressor argument becomes, the same rules for every layer.

A spec is a registered name (configured by ``options``), a ``Compressor`` instance, or an
error-feedback wrapper (``ErrorFeedback``, ``EF21``, ``DGCMomentum``). ``None`` is the caller's
to handle (dense); ``"none"`` is the identity compressor.

Error feedback (``error_feedback``): ``"ef"`` residual memory, ``"ef21"``, ``"dgc"`` (DGC's
momentum correction; its keywords in ``ef_options``), ``"none"`` (or ``False``; ``True`` is
``"ef"``), or ``"auto"``: residual error feedback for every biased compressor except the 16-bit
casts (their error is far below gradient noise) and the scale-free signs ``signsgd``/``signum``
(they decode to +-1, which error feedback would turn into a noisy SGD with the sign's learning
rate). A wrapper is used as it is: with no options, and ``error_feedback`` ``"auto"``, off, or
its own kind. A layer that adds its own feedback passes ``wrappers="refuse"``.

A spec written as text, ``"name:key=value,..."`` (``"powersgd:rank=4"``, ``"topk:ratio=0.01"``),
is read by :func:`parse_spec` only, wherever it is written (``compressor="auto"``'s candidates,
the benchmark's ``--compressors``).
"""
from __future__ import annotations

import ast
from typing import Any, Dict, Literal, Mapping, Optional, Tuple, Type, overload

from .base import Compressor
from .dgc import DGCMomentum
from .error_feedback import EF21, ErrorFeedback, _Feedback
from .registry import compressor_class

__all__ = ["as_codec", "wants_feedback", "parse_spec", "FEEDBACK"]

FEEDBACK: Dict[str, Type[_Feedback]] = {"ef": ErrorFeedback, "ef21": EF21, "dgc": DGCMomentum}
_WRAPPERS = (ErrorFeedback, EF21, DGCMomentum)
_SCALE_FREE = frozenset({"signsgd", "signum"})  # decode to +-1 whatever the gradient's size
_EF_CHOICES = "use 'auto', 'ef', 'ef21', 'dgc', 'none', True or False"


def parse_spec(text: str, what: str = "compressor") -> Tuple[str, Dict[str, Any]]:
    """``"powersgd:rank=4:seed=1"`` -> ``("powersgd", {"rank": 4, "seed": 1})``: the name, then
    ``key=value`` options separated by ``:``; a value is read as a Python literal when it is
    one (``4``, ``0.01``, ``True``), else kept as text. ``ValueError`` (starting with ``what``)
    for an option without ``=``."""
    name, *pairs = [p.strip() for p in str(text).strip().split(":")]
    options: Dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"{what}: option {pair!r} in {text!r} must look like name=value (e.g. topk:ratio=0.001)")
        k, v = pair.split("=", 1)
        try:
            options[k.strip()] = ast.literal_eval(v.strip())
        except (ValueError, SyntaxError):
            options[k.strip()] = v.strip()
    return name, options


def wants_feedback(base: Compressor) -> bool:
    """Whether ``error_feedback="auto"`` wraps ``base`` (see the module docstring)."""
    if base.unbiased or base.name in _SCALE_FREE:
        return False
    return not (base.fixed_size and base.bits_per_element() >= 16)


@overload
def as_codec(spec: Any, options: Optional[Mapping[str, Any]] = None, *,
             error_feedback: Literal["none", False], ef_options: None = None,
             wrappers: Literal["refuse"], what: str = "compressor") -> Compressor: ...


@overload
def as_codec(spec: Any, options: Optional[Mapping[str, Any]] = None, *, error_feedback: Any = "auto",
             ef_options: Optional[Mapping[str, Any]] = None, wrappers: str = "keep",
             what: str = "compressor") -> Any: ...


def as_codec(spec: Any, options: Optional[Mapping[str, Any]] = None, *, error_feedback: Any = "auto",
             ef_options: Optional[Mapping[str, Any]] = None, wrappers: str = "keep",
             what: str = "compressor") -> Any:
    """The compressor ``spec`` names, wrapped in the chosen error feedback (module docstring).

    ``wrappers="refuse"``: a wrapper (anything with the feedback protocol's ``accumulate``) is an
    error, for layers that add their own error feedback. Every ``ValueError`` starts with
    ``what`` (the caller's argument name) and names the fix. A name builds a new compressor;
    an instance or a wrapper is returned itself, never copied.
    """
    if wrappers not in ("keep", "refuse"):
        raise ValueError(f"{what}: wrappers={wrappers!r} is not allowed; use 'keep' or 'refuse'")
    options = dict(options or {})
    kind = _feedback_kind(error_feedback, what)
    if isinstance(spec, _Feedback) or (wrappers == "refuse" and hasattr(spec, "accumulate")):
        return _wrapper(spec, options, kind, ef_options, wrappers, what)
    base = _compressor(spec, options, wrappers, what)
    if kind == "auto":
        kind = "ef" if wants_feedback(base) else None
    if kind is None:
        if ef_options:
            raise ValueError(f"{what}: ef_options were given but error feedback is off; set error_feedback='dgc'")
        return base
    if base.multi_round and kind != "ef":
        raise ValueError(f"{what}: error_feedback={kind!r} needs a single-round compressor; {base.name} is "
                         f"multi-round, use error_feedback='ef' or 'none'")
    if ef_options and kind != "dgc":
        raise ValueError(f"{what}: ef_options are keywords of DGC's momentum correction; they need "
                         f"error_feedback='dgc', not {kind!r}")
    if kind == "dgc":
        return _dgc(base, dict(ef_options or {}), what)
    return FEEDBACK[kind](base)


def _feedback_kind(value: Any, what: str) -> Optional[str]:
    """``"auto"``, a key of ``FEEDBACK``, or None (off)."""
    if value is True:
        return "ef"
    if value is False or value is None or (isinstance(value, str) and value == "none"):
        return None
    if isinstance(value, str) and (value == "auto" or value in FEEDBACK):
        return value
    raise ValueError(f"{what}: error_feedback={value!r} is not allowed; {_EF_CHOICES}")


def _wrapper(spec: Any, options: Mapping[str, Any], kind: Optional[str], ef_options: Any, wrappers: str,
             what: str) -> Any:
    if wrappers == "refuse":
        raise ValueError(f"{what}: got a {type(spec).__name__}, but the caller adds its own error feedback; "
                         f"pass the compressor itself (a name or a Compressor)")
    if options or ef_options or kind not in ("auto", None, spec.kind):
        raise ValueError(f"{what}: {spec!r} is already wrapped in error feedback ({spec.kind}); pass no compressor "
                         f"options, other error_feedback or ef_options with it, or pass the bare compressor")
    return spec


def _compressor(spec: Any, options: Mapping[str, Any], wrappers: str, what: str) -> Compressor:
    if isinstance(spec, str):
        try:
            return compressor_class(spec)(**options)
        except ValueError as e:  # unknown name or option: the registry's message, with whose it is
            raise ValueError(f"{what}: {e}") from None
    if isinstance(spec, Compressor):
        if options:
            raise ValueError(f"{what}: options {sorted(options)} were given with a Compressor instance; "
                             f"configure the instance, or pass the compressor by name")
        return spec
    allowed = "a registered name or a Compressor" if wrappers == "refuse" else \
        "a registered name, a Compressor or an error-feedback wrapper (ErrorFeedback, EF21, DGCMomentum)"
    raise ValueError(f"{what} must be {allowed}, got {type(spec).__name__}")


def _dgc(base: Compressor, ef_options: Dict[str, Any], what: str) -> DGCMomentum:
    unknown = sorted(set(ef_options) - {"momentum", "clip_norm", "masking"})
    if unknown:
        raise ValueError(f"{what}: unknown ef_options {unknown}; DGC's momentum correction takes momentum, "
                         f"clip_norm and masking")
    try:
        return DGCMomentum(base, **ef_options)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None

