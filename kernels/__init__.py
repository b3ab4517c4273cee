"""Shared primitives of every compressor: bit packing, counter-based randomness, selection,
quantisation helpers.

Each primitive has a vectorised torch (or numpy C routine) implementation that runs on any
device and serves as the oracle for the CUDA kernels in ``kernels/cuda``. On CUDA tensors a
primitive calls the ``launch_<op>`` of its family's launcher module (``kernels/cuda/sign.cu``
-> ``_launch_sign.py``; shared switch and geometry in ``_launch.py``, the torch <-> CuPy
bridge in ``_cupy.py``). ``gradcomp.kernels`` imports nothing else of gradcomp.
"""
from .bits import pack_bits, unpack_bits, pack_codes, unpack_codes, packed_nbytes
from .rng import stream_key, uniform
from .quant import (block_absmax, bucket_norms, dequantize_levels, natural_decode, natural_encode,
                    quantize_levels, stochastic_round)
from .select import threshold_indices, topk_indices
from .sparse import check_indices, densify, index_dtype, scatter_add_checked
from .sign import sign_pack, sign_unpack
from .linalg import orthonormalize

__all__ = [
    "pack_bits", "unpack_bits", "pack_codes", "unpack_codes", "packed_nbytes",
    "stream_key", "uniform",
    "block_absmax", "bucket_norms", "dequantize_levels", "natural_decode", "natural_encode",
    "quantize_levels", "stochastic_round",
    "threshold_indices", "topk_indices",
    "check_indices", "densify", "index_dtype", "scatter_add_checked",
    "sign_pack", "sign_unpack", "orthonormalize",
]
