"""Shared primitives of every compressor: bit packing, counter-based randomness, selection,
quantisation helpers.

Each primitive has a vectorised torch (or numpy C routine) implementation that runs on any
device and serves as the oracle for the CUDA kernels in ``kernels/cuda``. ``gradcomp.kernels``
imports nothing else of gradcomp.
"""
from .bits import pack_bits, unpack_bits, pack_codes, unpack_codes, packed_nbytes
from .rng import stream_key, uniform

__all__ = [
    "pack_bits", "unpack_bits", "pack_codes", "unpack_codes", "packed_nbytes",
    "stream_key", "uniform",
]
