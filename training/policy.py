"""Which gradients are compressed, and how: one warm-up and layer policy for every compressor.

A parameter is sent dense (a plain allreduce, exact) while the iteration is below
``start_iter``, when it is 1-D (biases, norm weights) unless ``compress_1d``, when it has fewer
than ``min_numel`` elements, or when its compressed form would not be at least
``min_compression_rate`` times smaller than the dense one. ``layers`` maps glob patterns of
parameter names to overrides of any of these, of the compressor or of its options (the first
matching pattern wins); the value ``"dense"`` sends those parameters uncompressed.

Error feedback (``error_feedback``, ``ef_options``) follows ``gradcomp.compress.as_codec``.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from gradcomp.compress import Compressor, DGCMomentum, as_codec, compressor_class, get_compressor

_POLICY_KEYS = ("start_iter", "min_compression_rate", "min_numel", "compress_1d")
_RULE_KEYS = frozenset(_POLICY_KEYS) | {"compressor", "error_feedback", "ef_options"}
DENSE = "dense"


def compression_rate(base: Compressor, shape: Tuple[int, ...], dtype: torch.dtype) -> float:
    """Dense bytes over the expected compressed bytes of a tensor of ``shape`` and ``dtype``.

    Compressors whose size depends on the data (threshold) report ``inf``: they decide per step.
    """
    numel = math.prod(shape)
    dense = numel * torch.empty((), dtype=dtype).element_size()
    plan = getattr(base, "plan", None)
    if callable(plan):  # low-rank: the size depends on the matrix view, not only on numel
        p = plan(tuple(shape))
        if p is None:
            return 1.0
        n, m, r = p
        sent = (n + m) * r * (8 if dtype == torch.float64 else 4)
    elif not base.fixed_size:
        return math.inf
    else:
        sent = base.bits_per_element(numel) * numel / 8.0
    return dense / sent if sent else math.inf


@dataclass
class Rule:
    """How the parameters matched by one pattern are sent."""

    pattern: str
    codec: Any  # compressor or error-feedback wrapper; None: always dense
    start_iter: int = 0  # iterations sent dense before compression starts; more => safer start
    min_compression_rate: float = 2.0  # compress only what shrinks at least this much
    min_numel: int = 1024  # smaller tensors stay dense: their bytes are few, their error is not
    compress_1d: bool = False  # biases and norm weights are small and sensitive
    _rates: Dict[Tuple, float] = field(default_factory=dict, repr=False)

    def compresses(self, shape: Tuple[int, ...], dtype: torch.dtype, iteration: int) -> bool:
        if self.codec is None or iteration < self.start_iter:
            return False
        if (len(shape) <= 1 and not self.compress_1d) or math.prod(shape) < self.min_numel:
            return False
        key = (tuple(shape), dtype)
        rate = self._rates.get(key)
        if rate is None:
            rate = self._rates[key] = compression_rate(self.codec.base, tuple(shape), dtype)
        return rate >= self.min_compression_rate


class Policy:
    """The compressor(s) and the rules that decide, per parameter and iteration, what is compressed.

    ``compressor`` is a name (configured by ``compressor_options``), a ``Compressor`` or an
    error-feedback wrapper. State (error feedback, warm starts, step counters) lives in the
    codecs and is keyed by parameter name.
    """

    def __init__(self, compressor: Any = "none", *, start_iter: int = 0, min_compression_rate: float = 2.0,
                 min_numel: int = 1024, compress_1d: bool = False, error_feedback: Any = "auto",
                 ef_options: Optional[Mapping[str, Any]] = None,
                 layers: Optional[Mapping[str, Any]] = None, **compressor_options: Any) -> None:
        settings = _check_settings("", dict(start_iter=start_iter, min_compression_rate=min_compression_rate,
                                            min_numel=min_numel, compress_1d=compress_1d))
        self._compressor = compressor
        self._options = dict(compressor_options)
        self._settings = settings
        self.default = self._rule("*", compressor, self._options, error_feedback, ef_options, settings)
        self.rules = []
        if layers is not None and not isinstance(layers, Mapping):
            raise ValueError(f"layers must be a mapping of name patterns to 'dense' or a dict of overrides, "
                             f"got {type(layers).__name__}")
        for pattern, override in (layers or {}).items():
            self.rules.append(self._override(pattern, override, error_feedback, ef_options))
        self._match: Dict[str, Rule] = {}

    # ---- construction -----------------------------------------------------------------------
    def _rule(self, pattern, compressor, options, error_feedback, ef_options, settings) -> Rule:
        options = dict(options)
        if isinstance(compressor, str):
            allowed = compressor_class(compressor).options
            unknown = sorted(set(options) - set(allowed))
            if unknown:
                raise ValueError(f"{pattern if pattern != '*' else compressor}: unknown keyword(s) {', '.join(unknown)}; "
                                 f"{compressor} options: {', '.join(sorted(allowed)) or 'none'}; policy keywords: "
                                 f"{', '.join(sorted(_RULE_KEYS | {'layers'}))}")
            # PowerSGD has its own min_compression_rate: let the policy's value reach it too
            if "min_compression_rate" in compressor_class(compressor).options:
                options.setdefault("min_compression_rate", max(settings["min_compression_rate"], 1.0))
        codec = as_codec(compressor, options, error_feedback=error_feedback, ef_options=ef_options,
                         what="compressor" if pattern == "*" else f"layers[{pattern!r}]")
        return Rule(pattern, codec, **settings)

    def _override(self, pattern: Any, override: Any, error_feedback: Any, ef_options: Any) -> Rule:
        if not isinstance(pattern, str):
            raise ValueError(f"layers keys must be glob patterns of parameter names (str), got {pattern!r}")
        if override == DENSE:
            return Rule(pattern, None, **self._settings)
        if not isinstance(override, Mapping):
            raise ValueError(f"layers[{pattern!r}] must be 'dense' or a dict of overrides, got {override!r}")
        override = dict(override)
        settings = _check_settings(f"layers[{pattern!r}]: ", {**self._settings,
                                   **{k: override.pop(k) for k in _POLICY_KEYS if k in override}})
        own_feedback = "error_feedback" in override or "ef_options" in override
        error_feedback = override.pop("error_feedback", error_feedback)
        ef_options = override.pop("ef_options", ef_options)
        if "compressor" in override:
            compressor, options = override.pop("compressor"), override
            if not own_feedback:  # another compressor: its own default, not the top level's choice
                error_feedback, ef_options = "auto", None
        elif isinstance(self._compressor, str):
            compressor, options = self._compressor, {**self._options, **override}
        elif override:
            raise ValueError(f"layers[{pattern!r}] gives compressor options {sorted(override)} but the compressor "
                             f"is an instance; name the compressor in the override ('compressor': name)")
        elif own_feedback:  # a copy of the instance with this rule's error feedback
            compressor, options = _fresh_copy(self.default.codec.base), {}
        else:  # a copy of the instance with its error feedback; it must not share state
            return Rule(pattern, _fresh_copy(self.default.codec), **settings)
        return self._rule(pattern, compressor, options, error_feedback, ef_options, settings)

    # ---- use --------------------------------------------------------------------------------
    def rule(self, name: str) -> Rule:
        """The rule of parameter ``name``: the first layer pattern that matches, else the default."""
        rule = self._match.get(name)
        if rule is None:
            rule = next((r for r in self.rules if fnmatch.fnmatchcase(name, r.pattern)), self.default)
            self._match[name] = rule
        return rule

    def route(self, name: str, tensor: torch.Tensor, iteration: int) -> Any:
        """The codec that sends ``tensor`` (parameter ``name``) at ``iteration``, or None: dense."""
        rule = self.rule(name)
        return rule.codec if rule.compresses(tuple(tensor.shape), tensor.dtype, iteration) else None

    def codecs(self) -> Dict[str, Any]:
        """Every codec by its pattern (``"*"`` is the default)."""
        out = {r.pattern: r.codec for r in self.rules if r.codec is not None}
        if self.default.codec is not None:
            out["*"] = self.default.codec
        return out

    def describe(self) -> str:
        parts = [f"{r.pattern}: {'dense' if r.codec is None else repr(r.codec)}" for r in [*self.rules, self.default]]
        return "; ".join(parts)

    def state_dict(self) -> Dict[str, Any]:
        return {pattern: codec.state_dict() for pattern, codec in self.codecs().items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        codecs = self.codecs()
        if set(state) != set(codecs):
            raise ValueError(f"state_dict holds codecs for patterns {sorted(state)}, this policy has "
                             f"{sorted(codecs)}; build it with the same layers")
        for pattern, codec in codecs.items():
            codec.load_state_dict(state[pattern])


def _check_settings(where: str, s: Dict[str, Any]) -> Dict[str, Any]:
    unknown = sorted(set(s) - set(_POLICY_KEYS))
    if unknown:
        raise ValueError(f"{where}unknown setting(s) {unknown}; allowed: {sorted(_RULE_KEYS)} and compressor options")
    checks = {
        "start_iter": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an int >= 0"),
        "min_compression_rate": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                                 and 0 <= v < math.inf, "a finite number >= 0"),
        "min_numel": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an int >= 0"),
        "compress_1d": (lambda v: isinstance(v, bool), "True or False"),
    }
    for key, (ok, rule) in checks.items():
        if not ok(s[key]):
            raise ValueError(f"{where}{key}={s[key]!r} is not allowed; {key} must be {rule}")
    s["min_compression_rate"] = float(s["min_compression_rate"])
    return s


def _fresh_copy(codec: Any) -> Any:
    """A new codec configured like ``codec`` (per-layer rules must not share state with the default)."""
    base = codec.base
    fresh = get_compressor(base.name, **base.config.as_dict())
    if codec is base:
        return fresh
    if isinstance(codec, DGCMomentum):
        return DGCMomentum(fresh, momentum=codec.momentum, clip_norm=codec.clip_norm, masking=codec.masking)
    return type(codec)(fresh)
