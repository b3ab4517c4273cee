"""Compressed collectives on ``torch.distributed``.

``allreduce`` (mean over a group; algorithm chosen from the compressor's declared
capabilities; async with futures; optional hierarchical mode), ``allreduce_buckets``
(many tensors, one collective per bucket, error feedback per name), ``allreduce_fused``
(many tensors, each compressed on its own, sharing each exchange: one all-gather on two ranks,
scatter-reduce's exchanges on three or more), ``send``/``recv``
(compressed point-to-point), and per-rank telemetry (``telemetry()``,
``reset_telemetry()``). Each algorithm (``ALGORITHMS[name]``) states its cost: ``wire(payload,
world)`` / ``cost(codec, numel, world)``, a ``Cost`` (bytes one rank sends, messages it waits for). ``exchange_bucket`` / ``exchange_bucket_by_owners`` are the bucket
exchanges the training runtime (DDP hook, ``CompressedOptimizer``) is built on
(``BucketExchange``: one bucket's exchange in phases, its local phase run ahead while the one
before it is on the wire; ``prepare_bucket`` makes one with that phase done).
:mod:`~gradcomp.collectives.identity`: checkpoint identity and agreement between ranks
(``Identity``, ``agree``, ``refuse_on_every_rank``) for every layer.
"""
from .worker import shutdown, wait_all
from ._comm import CommunicationError, backend_for, check_device_set, group_timeout, on_device, rank_of, world_of
from ._algorithm import Cost
from .allreduce import ALGORITHMS, allreduce, choose_algorithm
from .bucket import BucketExchange, allreduce_buckets, exchange_bucket, plan_buckets, prepare_bucket, sum_counts
from .fused import allreduce_fused
from .hierarchical import Hierarchy, NodeGroups, exchange_bucket_by_owners, make_node_groups
from .identity import Identity, agree, describe_params, fingerprint, names_of, refuse_on_every_rank
from .p2p import recv, send
from .scatter_reduce import key_of, server_feedback, server_key
from ._telemetry import reset_telemetry, set_measure_error, telemetry

__all__ = [
    "allreduce", "choose_algorithm", "ALGORITHMS", "Cost", "allreduce_buckets", "plan_buckets", "BucketExchange",
    "allreduce_fused", "exchange_bucket", "prepare_bucket", "sum_counts", "key_of", "exchange_bucket_by_owners", "Hierarchy",
    "make_node_groups", "NodeGroups", "world_of", "rank_of", "send", "recv", "server_feedback", "server_key",
    "telemetry", "reset_telemetry", "set_measure_error", "CommunicationError", "group_timeout", "shutdown",
    "wait_all", "backend_for", "check_device_set", "on_device",
    "Identity", "agree", "describe_params", "fingerprint", "names_of", "refuse_on_every_rank",
]
