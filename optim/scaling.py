"""``linear_scaling``: the learning rate for a larger batch (Goyal et al. 2017).

"When the minibatch size is multiplied by k, multiply the learning rate by k": ``base_lr *
batch / base_batch``. Pair it with a warm-up from torch's own schedulers (``LinearLR`` then the
main schedule, joined by ``SequentialLR``); see docs/optimizers.md.
"""
from __future__ import annotations

from . import _common as common


def linear_scaling(base_lr: float, batch: int, base_batch: int = 256) -> float:
    """``base_lr * batch / base_batch``: the learning rate for a global ``batch`` when
    ``base_lr`` was tuned at ``base_batch`` (ResNet-50: 0.1 at 256)."""
    common.check_number("base_lr", base_lr, low_open=True)
    common.check_int("batch", batch, low=1)
    common.check_int("base_batch", base_batch, low=1)
    return float(base_lr) * batch / base_batch
