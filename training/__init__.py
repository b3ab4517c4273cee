"""Training entry points: DDP communication hooks and a compressed optimizer wrapper.

``state, hook = ddp_comm_hook(name, **options)`` for ``ddp_model.register_comm_hook``, and
``CompressedOptimizer(optimizer, compressor=name, **options)`` for data-parallel training
without DDP. Both share one warm-up / layer policy (:mod:`gradcomp.training.policy`) and keep
compressor and error-feedback state per parameter name. ``wait_all()``: wait for every
gradcomp exchange in flight before a collective of your own (see docs/training.md, "Threads,
streams and your own collectives").
"""
from gradcomp.collectives import shutdown
from gradcomp.collectives.worker import wait_all
from gradcomp.collectives.identity import agree
from .engine import Runtime
from .hooks import HookState, cast_wrapper, compressed_hook, ddp_comm_hook
from .optimizer import CompressedOptimizer
from .policy import Policy, Rule
from .reshard import reshard_states

__all__ = ["agree", "ddp_comm_hook", "CompressedOptimizer", "HookState", "cast_wrapper", "compressed_hook",
           "Runtime", "Policy", "Rule", "reshard_states", "shutdown", "wait_all"]
__all__ += ["compress_fsdp", "FSDPCompression"]


def __getattr__(name: str):
    """``compress_fsdp`` and ``FSDPCompression`` live in :mod:`gradcomp.sharded` (a layer above
    this one, with the rest of sharded data parallelism); they stay importable from here, loaded
    when first asked for."""
    if name in ("compress_fsdp", "FSDPCompression"):
        from gradcomp.sharded import fsdp
        return getattr(fsdp, name)
    raise AttributeError(f"module 'gradcomp.training' has no attribute {name!r}")
