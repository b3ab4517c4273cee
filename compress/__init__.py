"""Compressors, error feedback and the payload wire format.

Every module in this package that defines a compressor registers it with
``@register(name)``; importing the package imports them all. The others, listed in
``_INFRA``, are what compressors are built from: the contract (``base``), the shared bases of
the 16-bit casts (``cast``) and of the sign compressors (``sign``), the sparse payload
(``sparse``), the wire format (``payload``), error feedback, the registry, ``as_codec``
(``spec``: what a compressor argument becomes) and transactions.
"""
import importlib as _importlib
import pkgutil as _pkgutil

from .base import Capabilities, Compressor, CompressorConfig, Encoded, Option, option
from .error_feedback import EF21, ErrorFeedback, Feedback, is_feedback
from .payload import Payload
from .registry import available_compressors, compressor_class, get_compressor, register

_INFRA = {"base", "cast", "error_feedback", "options", "payload", "registry", "sign", "sparse", "spec", "transaction"}
for _mod in sorted(m.name for m in _pkgutil.iter_modules(__path__)):
    if _mod not in _INFRA and not _mod.startswith("_"):
        _importlib.import_module(f"{__name__}.{_mod}")
from .dgc import DGCMomentum
from .spec import as_codec, parse_spec, wants_feedback

__all__ = [
    "Capabilities", "Compressor", "CompressorConfig", "Encoded", "Option", "option",
    "Payload", "Feedback", "is_feedback", "ErrorFeedback", "EF21", "DGCMomentum",
    "available_compressors", "compressor_class", "get_compressor", "register", "as_codec", "parse_spec", "wants_feedback",
]
