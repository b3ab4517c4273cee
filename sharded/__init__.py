"""gradcomp.sharded: sharded data parallelism on compressed collectives (docs/sharding.md, docs/fsdp.md).

- :class:`ShardedOptimizer`: ZeRO-1/2 — each rank steps its shard of the optimizer state; the
  gradients reduce-scattered and the weights all-gathered through gradcomp's compressors, with
  error feedback (``sharded/zero.py``; its shard layout ``sharded/layout.py``, its per-rank and
  consolidated checkpoints ``sharded/checkpoint.py``);
- :func:`compress_fsdp` / :class:`FSDPCompression`: FSDP2 (``fully_shard``) with gradcomp's
  compressed reduce-scatter and all-gather (``sharded/fsdp.py``), and :func:`overlap_gathers`, which
  makes FSDP's parameter all-gathers (its own or gradcomp's) run asynchronously beside compute;
- :class:`LowBitState`, :func:`state_nbytes`: optimizer state packed in 8 (or 4) bits
  (``sharded/lowbit.py``), which ``ShardedOptimizer(state_bits=8)`` uses.

``gradcomp.memory`` keeps activation memory (checkpointing, offload, compressed saved tensors)
and still exports ``ShardedOptimizer``, ``LowBitState`` and ``state_nbytes``;
``gradcomp.training`` still exports ``compress_fsdp`` and ``FSDPCompression``.
"""
from .fsdp import FSDPCompression, compress_fsdp, overlap_gathers
from .lowbit import LowBitState, state_nbytes
from .zero import ShardedOptimizer

__all__ = ["ShardedOptimizer", "compress_fsdp", "FSDPCompression", "overlap_gathers", "LowBitState", "state_nbytes"]
