"""gradcomp.memory: training in less memory (docs/memory.md).

- :func:`plan_memory`: per stage of a chain, keep / recompute / store compressed / offload
  what autograd saves, the fastest choice within a byte budget (``memory/planner.py``);
- :func:`compressed_activations`: what autograd saves, through a codec (``memory/saved.py``);
- :func:`offload_activations`: what autograd saves, in host memory, prefetched for backward
  (``memory/offload.py``);
- :class:`MemoryMeter`: the peak bytes of saved activations, measured (``memory/meter.py``);
- :class:`ShardedOptimizer`, :class:`LowBitState`, :func:`state_nbytes`: kept importable here;
  sharded data parallelism (ZeRO, FSDP2, packed low-bit state) is :mod:`gradcomp.sharded`.
"""
from .codecs import available_codecs, get_codec
from .meter import MemoryMeter
from .offload import offload_activations
from .planner import BudgetTooSmall, Plan, plan_memory
from .saved import compressed_activations
# sharded data parallelism lives in gradcomp.sharded; its names stay importable here
from gradcomp.sharded import LowBitState, ShardedOptimizer, state_nbytes

__all__ = ["plan_memory", "Plan", "BudgetTooSmall", "compressed_activations", "offload_activations", "MemoryMeter",
           "available_codecs", "get_codec", "ShardedOptimizer", "LowBitState", "state_nbytes"]
