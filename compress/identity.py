"""Whose a checkpoint is: one fingerprint, one parameter description, one ``Identity`` value.

The pure, single-process part of checkpoint identity (no process group needed), kept here so
that ``compress`` (error feedback) can use it; :mod:`gradcomp.collectives.identity` re-exports
it with the parts that talk to the other ranks (``agree``, ``refuse_on_every_rank``).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Collection, Dict, Mapping, Optional, Sequence, Tuple

import torch

__all__ = ["fingerprint", "describe_params", "Identity"]

#: the fields every identity has, in the order :meth:`Identity.mismatch` checks them
CORE = ("owner", "world", "rank", "params", "config")

_FIXES = {
    "owner": "load a checkpoint saved by the same kind of object",
    "world": "resume on as many ranks as it was saved on",
    "rank": "every rank loads its own file (e.g. ckpt-rank{rank}.pt)",
    "params": "load it into the model it was saved with",
    "config": "resume with the same configuration",
}


def fingerprint(text: str | bytes) -> str:
    """A short hex digest of ``text`` (8 bytes of BLAKE2b): the same on every rank, run and
    platform. The one digest every layer's checkpoint identity and agreement check uses."""
    data = text.encode() if isinstance(text, str) else bytes(text)
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def describe_params(named: Sequence[Tuple[str, torch.Tensor]]) -> str:
    """``"name (shape) dtype; ..."`` for ``(name, tensor)`` pairs, in order (names, shapes and
    dtypes: what two ranks or a checkpoint and a model must share)."""
    return "; ".join(f"{n} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for n, t in named)


@dataclass(frozen=True)
class Identity:
    """Whose state a checkpoint holds: ``owner`` (the class that saved it, e.g.
    ``"ShardedOptimizer"``), ``rank`` and ``world`` (of its process group), ``config`` (a
    :func:`fingerprint` of the configuration text), ``params`` (a fingerprint of
    :func:`describe_params`; ``""``: not part of this identity) and ``fields``: layer-specific
    extras (e.g. the pipeline stage), each a printable string."""

    owner: str
    rank: int
    world: int
    config: str
    params: str = ""
    fields: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        """Plain types only (``torch.load(weights_only=True)`` reads them)."""
        return {"owner": self.owner, "rank": int(self.rank), "world": int(self.world), "config": self.config,
                "params": self.params, "fields": dict(self.fields)}

    @classmethod
    def from_dict(cls, d: Any) -> "Identity":
        """The identity :meth:`to_dict` wrote; ``ValueError`` for anything else."""
        if not isinstance(d, Mapping) or any(k not in d for k in ("owner", "rank", "world", "config")):
            raise ValueError(f"not a gradcomp checkpoint identity ({type(d).__name__})")
        fields = d.get("fields") or {}
        if not isinstance(fields, Mapping):
            raise ValueError("not a gradcomp checkpoint identity (its fields are not a mapping)")
        try:
            rank, world = int(d["rank"]), int(d["world"])
        except (TypeError, ValueError):
            raise ValueError(f"not a gradcomp checkpoint identity (rank {d['rank']!r}, world {d['world']!r})") from None
        return cls(owner=str(d["owner"]), rank=rank, world=world, config=str(d["config"]),
                   params=str(d.get("params", "")), fields={str(k): str(v) for k, v in fields.items()})

    def mismatch(self, saved: Any, *, skip: Collection[str] = (), fixes: Optional[Mapping[str, str]] = None
                 ) -> Optional[str]:
        """None when ``saved`` (an :class:`Identity` or its dict) is this identity, else one
        sentence naming the first field that differs and the fix. ``skip``: fields not checked
        (e.g. ``rank`` and ``world`` for a checkpoint that loads at any world size); ``fixes``:
        a layer's own fix per field (``{rank}`` and ``{world}`` are filled with this run's)."""
        if not isinstance(saved, Identity):
            try:
                saved = Identity.from_dict(saved)
            except ValueError:
                return (f"it carries no gradcomp identity (not a {self.owner} checkpoint, or saved by an older "
                        f"gradcomp), so it cannot be checked against this rank, world size and model; save it "
                        f"again with this version")
        fix = {**_FIXES, **(fixes or {})}

        def hint(name: str) -> str:
            return fix.get(name, "resume with the same configuration").format(rank=self.rank, world=self.world)

        for name in CORE:
            if name in skip:
                continue
            have, had = getattr(self, name), getattr(saved, name)
            if have == had or (name == "params" and not have):
                continue
            if name == "owner":
                return f"it was saved by {had}, not by {have}; {hint(name)}"
            if name == "world":
                return f"it was saved on {had} ranks, this run has {have}; {hint(name)}"
            if name == "rank":
                return f"it is rank {had}'s, loaded on rank {have}; {hint(name)}"
            if name == "params":
                return f"it holds the state of other parameters; {hint(name)}"
            return f"it was saved with another configuration; {hint(name)}"
        for name in sorted(set(self.fields) | set(saved.fields)):
            if name in skip:
                continue
            have, had = self.fields.get(name, "none"), saved.fields.get(name, "none")
            if have != had:
                return f"it was saved with another {name} ({_clip(had)}, this run has {_clip(have)}); {hint(name)}"
        return None


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
