"""What ``compressor="auto"`` may choose from: its candidates, as one policy."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from gradcomp.compress import ErrorFeedback, parse_spec

from ..policy import DENSE, Policy

__all__ = ["CANDIDATES", "POLICY_KEYS", "Candidate", "AutoPolicy", "parse_candidate"]

#: the default candidates, most faithful first (the order breaks ties and guides the accuracy pass)
CANDIDATES = ("dense", "fp16", "bf16", "int8", "powersgd:rank=8", "powersgd:rank=4", "topk", "onebit")
#: the policy keywords auto passes on to every candidate's policy
POLICY_KEYS = ("start_iter", "min_compression_rate", "min_numel", "compress_1d")


@dataclass
class Candidate:
    """One method auto may choose: its label, the policy that routes each gradient (dense for
    small and 1-D tensors, as for a fixed compressor), and that policy's codec."""

    label: str
    name: str
    options: Dict[str, Any]
    policy: Optional[Policy]  # None: dense

    @property
    def codec(self) -> Any:
        return None if self.policy is None else self.policy.default.codec

    @property
    def light(self) -> bool:
        """8 or more bits per element (what Accordion's critical regime allows)."""
        base = None if self.codec is None else self.codec.base
        return base is None or (base.fixed_size and base.bits_per_element() >= 8)


def parse_candidate(spec: Any) -> Tuple[str, str, Dict[str, Any]]:
    """``(label, name, options)`` from ``"powersgd:rank=4"`` (``gradcomp.compress.parse_spec``)
    or ``("powersgd", {"rank": 4})``."""
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], Mapping):
        name, options = spec[0], dict(spec[1])
    elif isinstance(spec, str) and spec.strip():
        name, options = parse_spec(spec, "auto: candidate")
    else:
        raise ValueError(f"auto: a candidate is a name such as 'topk' or 'powersgd:rank=4', or (name, options); "
                         f"got {spec!r}")
    label = name + "".join(f":{k}={v}" for k, v in sorted(options.items()))
    return label, name, options


class AutoPolicy(Policy):
    """The candidates of ``compressor="auto"`` as one policy: each candidate's codec under its
    label (so the runtime's checkpoint keeps every candidate's residuals and warm starts)."""

    def __init__(self, candidates: Sequence[Any] = CANDIDATES, **settings: Any) -> None:
        unknown = sorted(set(settings) - set(POLICY_KEYS))
        if unknown:
            raise ValueError(f"compressor='auto': unknown keyword(s) {', '.join(unknown)}; auto takes candidates=, "
                             f"trial_steps=, trial_memory_mb=, verify_steps=, margin=, tolerance=, "
                             f"recheck_every=, accordion=, accordion_threshold=, link= and the policy keywords "
                             f"{', '.join(POLICY_KEYS)} (layers= and error_feedback= need a fixed compressor)")
        super().__init__("none", **settings)
        if isinstance(candidates, (str, tuple)) and not (isinstance(candidates, tuple) and all(
                isinstance(c, (str, tuple)) for c in candidates)):
            raise ValueError(f"compressor='auto': candidates must be a list of names, got {candidates!r}")
        self.candidates: List[Candidate] = []
        for spec in candidates:
            label, name, options = parse_candidate(spec)
            if any(c.label == label for c in self.candidates):
                raise ValueError(f"compressor='auto': candidate {label!r} is listed twice")
            policy = None if name == DENSE else Policy(name, **options, **settings)
            cand = Candidate(label, name, options, policy)
            codec = cand.codec
            if codec is not None and codec is codec.base and not codec.base.unbiased and not (
                    codec.base.fixed_size and codec.base.bits_per_element() >= 16):
                raise ValueError(f"compressor='auto': candidate {label!r} is biased and runs without error feedback "
                                 f"(it decodes to a scale-free sign); auto takes biased methods only with error "
                                 f"feedback: leave it out of candidates")
            if codec is not None and codec is not codec.base and not isinstance(codec, ErrorFeedback):
                raise ValueError(f"compressor='auto': candidate {label!r} uses {codec.kind} feedback; auto carries "
                                 f"residuals of residual error feedback only")
            self.candidates.append(cand)
        if not any(c.label == DENSE for c in self.candidates):
            raise ValueError("compressor='auto': candidates must include 'dense' (the method auto never loses to)")
        self.by_label = {c.label: c for c in self.candidates}

    def codecs(self) -> Dict[str, Any]:
        return {c.label: c.codec for c in self.candidates if c.codec is not None}

    def describe(self) -> str:
        return "auto(" + ", ".join(f"{c.label}: {'dense' if c.codec is None else repr(c.codec)}"
                                   for c in self.candidates) + ")"
