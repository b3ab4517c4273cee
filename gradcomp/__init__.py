"""gradcomp: send fewer bytes in distributed PyTorch training.

Subpackages: ``gradcomp.kernels`` (primitives, CUDA kernels), ``gradcomp.compress``
(compressors, error feedback, wire format), ``gradcomp.collectives`` (compressed
allreduce and friends), ``gradcomp.training`` (DDP hooks, optimizer wrapper) and
``gradcomp.bench`` (``python -m gradcomp.bench``).
"""
__version__ = "0.1.0"
