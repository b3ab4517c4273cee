"""gradcomp: send fewer bytes in distributed PyTorch training.

Subpackages, lowest first (each imports only those before it): ``gradcomp.kernels``
(primitives and their CUDA kernels), ``gradcomp.compress`` (compressors, error feedback, the
wire format), ``gradcomp.collectives`` (compressed allreduce and friends, identity and
agreement), ``gradcomp.training`` (DDP hooks, the optimizer wrapper, the runtime they share),
``gradcomp.memory`` (activation planner, sharded optimizer, low-bit state), ``gradcomp.optim``
(1-bit Adam and friends), ``gradcomp.pipeline`` (pipeline stages and schedules) and
``gradcomp.bench`` (``python -m gradcomp.bench``). README.md is the front page; docs/ has one
page per layer.
"""
__version__ = "0.1.0"
