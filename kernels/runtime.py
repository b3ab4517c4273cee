"""The CUDA kernels' runtime, public for the GPU check and the kernel benchmark.

Whether CuPy and NVRTC are usable here, the kernel families and their compiled binaries, each
family's launchers (``launch_sign.launch_sign_pack`` ...), and ``torch_only()``, a block in
which every primitive runs its torch code, also on CUDA tensors (the oracle side of a
comparison). Training code never needs this module: the primitives in ``gradcomp.kernels``
choose their path themselves (docs/kernels.md).
"""
from typing import Any

from . import _cupy
from . import _launch_bits as launch_bits
from . import _launch_quant as launch_quant
from . import _launch_rng as launch_rng
from . import _launch_select as launch_select
from . import _launch_sign as launch_sign
from . import _launch_sparse as launch_sparse
from ._cupy import COMPILE_OPTIONS, available, binary, cache_dir, compute_capability, families, module
from ._launch import torch_only

__all__ = ["COMPILE_OPTIONS", "available", "binary", "cache_dir", "compute_capability", "cupy", "families",
           "launch_bits", "launch_quant", "launch_rng", "launch_select", "launch_sign", "launch_sparse", "module",
           "nvrtc", "torch_only"]


def cupy() -> Any:
    """The ``cupy`` module, or None where it does not import (not installed, another CUDA)."""
    return _cupy._cupy()


def nvrtc() -> Any:
    """CuPy's binding of the NVRTC library (compiles without a GPU); ImportError without CuPy."""
    return _cupy._nvrtc()
