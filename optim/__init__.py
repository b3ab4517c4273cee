"""gradcomp.optim: communication-efficient optimizers (1-bit Adam, 0/1 Adam, 1-bit LAMB) and
``DiLoCo`` (local steps, rare compressed outer steps), and
large-batch optimizers (LAMB, LARS) whose norms are right under data parallel.

``OneBitAdam``, ``ZeroOneAdam`` and ``OneBitLamb`` are data-parallel themselves: dense steps
where their algorithm needs the mean gradient, the momentum exchanged compressed (any gradcomp
compressor, error feedback on both sides) elsewhere; under DDP register ``opt.comm_hook()``.
``Lamb`` and ``Lars`` are plain optimizers whose layer-wise norms are those of the averaged
update, summed over shards under ``shard_layout``. ``linear_scaling`` scales a learning rate
with the batch. Reference: docs/optimizers.md.
"""
from .diloco import DiLoCo
from .lamb import Lamb
from .lars import Lars
from .layerwise import LayerNorms
from .momentum import MomentumExchange
from .onebit_adam import OneBitAdam
from .onebit_lamb import OneBitLamb
from .scaling import linear_scaling
from .zero_one_adam import ZeroOneAdam

__all__ = ["DiLoCo", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Lamb", "Lars", "linear_scaling", "LayerNorms",
           "MomentumExchange"]
