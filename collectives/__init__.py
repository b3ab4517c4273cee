"""Compressed collectives on ``torch.distributed``.

``allreduce`` (mean over a group; algorithm chosen from the compressor's declared
capabilities; async with futures; optional hierarchical mode), ``allreduce_buckets``
(many tensors, one collective per bucket, error feedback per name), ``send``/``recv``
(compressed point-to-point), and per-rank telemetry (``telemetry()``,
``reset_telemetry()``).
"""
from ._comm import CommunicationError
from .allreduce import ALGORITHMS, allreduce, choose_algorithm
from .bucket import allreduce_buckets, plan_buckets
from .hierarchical import NodeGroups, make_node_groups
from .p2p import recv, send
from .scatter_reduce import server_feedback
from ._telemetry import reset_telemetry, set_measure_error, telemetry

__all__ = [
    "allreduce", "choose_algorithm", "ALGORITHMS", "allreduce_buckets", "plan_buckets",
    "make_node_groups", "NodeGroups", "send", "recv", "server_feedback",
    "telemetry", "reset_telemetry", "set_measure_error", "CommunicationError",
]
