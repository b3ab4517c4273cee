"""Compressed collectives on ``torch.distributed``.

``allreduce`` (mean over a group; algorithm chosen from the compressor's declared
capabilities; async with futures; optional hierarchical mode), ``allreduce_buckets``
(many tensors, one collective per bucket, error feedback per name), ``allreduce_fused``
(many tensors, each compressed on its own, sharing each exchange: one all-gather on two ranks,
scatter-reduce's exchanges on three or more), ``send``/``recv``
(compressed point-to-point), and per-rank telemetry (``telemetry()``,
``reset_telemetry()``).
"""
from .worker import shutdown
from ._comm import CommunicationError
from .allreduce import ALGORITHMS, allreduce, choose_algorithm
from .bucket import allreduce_buckets, plan_buckets
from .fused import allreduce_fused
from .hierarchical import NodeGroups, make_node_groups
from .p2p import recv, send
from .scatter_reduce import server_feedback
from ._telemetry import reset_telemetry, set_measure_error, telemetry

__all__ = [
    "allreduce", "choose_algorithm", "ALGORITHMS", "allreduce_buckets", "plan_buckets",
    "allreduce_fused",
    "make_node_groups", "NodeGroups", "send", "recv", "server_feedback",
    "telemetry", "reset_telemetry", "set_measure_error", "CommunicationError", "shutdown",
]
