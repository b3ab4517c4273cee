"""What the launcher modules share: the switch between the kernels and the torch references,
and the geometry of a launch.

There is one launcher module per kernel family, ``kernels/_launch_<family>.py`` for
``kernels/cuda/<family>.cu``, holding only ``launch_<op>`` functions: each allocates its
outputs with torch on the tensors' device and queues the family's kernels through
``_cupy.launcher`` (the tests swap that for a CPU emulation of CUDA and call the launchers on
CPU tensors). The primitives (``kernels/sign.py`` …) decide: a CUDA tensor goes to
``launch_<op>`` when :func:`kernels_apply` and the dtype is one the kernel has, otherwise to
the primitive's torch code, which is also the kernel's reference. Dependencies go
primitive -> launcher -> ``_cupy``, never back. Constants shared with a ``.cu`` file (block
sizes, workspace layouts, mode numbers) are read from it (``_cupy.constants``).

``GRADCOMP_CUDA_KERNELS=0`` in the environment switches the kernels off for the whole
process; :func:`torch_only` does so within a block. Importing this module never fails.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Tuple

import numpy as np
import torch

from . import _cupy

THREADS_PER_SM = 2048  # resident threads per SM (sm_80, sm_90): a grid-stride launch fills the device
FLOAT_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}  # kernel name suffixes
_MASK64 = (1 << 64) - 1
_enabled = os.environ.get("GRADCOMP_CUDA_KERNELS", "1") != "0"


@contextlib.contextmanager
def torch_only() -> Iterator[None]:
    """Within this block every primitive runs its torch code, also on CUDA tensors."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def enabled() -> bool:
    """Whether the kernels may run at all (not switched off by the environment or :func:`torch_only`)."""
    return _enabled


def device_applies(device: torch.device) -> bool:
    """True when the kernels would run on ``device``: a CUDA device, CuPy there."""
    return _enabled and device.type == "cuda" and _cupy.available()


def kernels_apply(*tensors: torch.Tensor) -> bool:
    """True when the kernels would run for these tensors: all on one CUDA device, CuPy there."""
    if not tensors:
        return False
    dev = tensors[0].device
    return device_applies(dev) and all(t.device == dev for t in tensors)


def grid(launcher, work_items: int, block: int) -> int:
    """Blocks of ``block`` threads for a grid-stride loop over ``work_items``: enough to fill
    the device, no more."""
    return max(1, min(-(-work_items // block), launcher.sms * THREADS_PER_SM // block))


def key_words(key128: int) -> Tuple[np.uint64, np.uint64]:
    """A 128-bit Philox key as the two 64-bit kernel arguments, low word first."""
    return np.uint64(key128 & _MASK64), np.uint64((key128 >> 64) & _MASK64)
