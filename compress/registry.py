"""The compressor registry: ``@register("name")`` fills one dict and refuses duplicates."""
from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Type, TypeVar

if TYPE_CHECKING:  # only for types: the payload parser asks this registry, and base imports the payload
    from .base import Compressor

_REGISTRY: Dict[str, Type[Compressor]] = {}
_C = TypeVar("_C", bound="Type[Compressor]")


def register(name: str) -> Callable[[_C], _C]:
    """Class decorator: make a compressor available as ``get_compressor(name)``, once its class
    keeps the contract (``Compressor.check_contract``: ``TypeError`` otherwise)."""

    def deco(cls: _C) -> _C:
        if name in _REGISTRY:
            raise ValueError(f"compressor name {name!r} is already registered by {_REGISTRY[name].__name__}")
        cls.name = name
        cls.check_contract()
        _REGISTRY[name] = cls
        return cls

    return deco


def available_compressors() -> List[str]:
    """Names accepted by :func:`get_compressor`, sorted."""
    return sorted(_REGISTRY)


def compressor_class(name: str) -> Type[Compressor]:
    """The class registered under ``name``; ``ValueError`` naming the choices otherwise."""
    if not isinstance(name, str) or name not in _REGISTRY:
        hint = ""
        if isinstance(name, str):
            close = [n for n in _REGISTRY if n.lower() == name.strip().lower()] or \
                difflib.get_close_matches(name.lower(), list(_REGISTRY), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            if name.strip().lower() == "auto":  # a choice made by the training runtime, not a codec
                hint = (" ('auto' chooses per bucket from measurements: pass it to ddp_comm_hook or "
                        "CompressedOptimizer, see gradcomp.training.auto)")
        raise ValueError(f"unknown compressor {name!r}{hint}; available: {', '.join(available_compressors())}")
    return _REGISTRY[name]


def get_compressor(name: str, **options: Any) -> Compressor:
    """A new compressor ``name`` configured by keyword ``options`` (validated at once)."""
    return compressor_class(name)(**options)
