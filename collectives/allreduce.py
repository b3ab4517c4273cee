"""``allreduce``: the mean of a tensor over a process group, sent compressed.

The algorithm is chosen from what the compressor declares, never from its name (see
``choose_algorithm`` and the table in docs/collectives.md): ``rounds`` for multi-round compressors,
``native`` for payloads that can be summed as they are, otherwise ``allgather`` on two ranks
and ``scatter-reduce`` on more. ``algorithm=`` forces one; a pairing that cannot work raises
``ValueError`` before anything is sent.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Optional, Union, overload

import torch

from gradcomp.compress import Compressor
from gradcomp.compress.error_feedback import check_default_key

from . import worker
from .reduction import ALGORITHMS, choose_algorithm, flat_job, make_spec
from .hierarchical import hierarchical_job

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["allreduce", "choose_algorithm", "ALGORITHMS"]


# async_op decides the return type: a tensor, or a future of one
@overload
def allreduce(tensor: torch.Tensor, compressor: Any = ..., key: Optional[str] = ...,
              group: Optional[ProcessGroup] = ..., async_op: Literal[False] = ..., *,
              algorithm: Optional[str] = ..., intra_group: Optional[ProcessGroup] = ...,
              inter_group: Optional[ProcessGroup] = ..., measure_error: Optional[bool] = ...,
              verify: bool = ...) -> torch.Tensor: ...
@overload
def allreduce(tensor: torch.Tensor, compressor: Any, key: Optional[str], group: Optional[ProcessGroup],
              async_op: Literal[True], *, algorithm: Optional[str] = ...,
              intra_group: Optional[ProcessGroup] = ..., inter_group: Optional[ProcessGroup] = ...,
              measure_error: Optional[bool] = ..., verify: bool = ...) -> torch.futures.Future[torch.Tensor]: ...
@overload
def allreduce(tensor: torch.Tensor, compressor: Any = ..., key: Optional[str] = ...,
              group: Optional[ProcessGroup] = ..., *, async_op: Literal[True],
              algorithm: Optional[str] = ..., intra_group: Optional[ProcessGroup] = ...,
              inter_group: Optional[ProcessGroup] = ..., measure_error: Optional[bool] = ...,
              verify: bool = ...) -> torch.futures.Future[torch.Tensor]: ...
@overload
def allreduce(tensor: torch.Tensor, compressor: Any = ..., key: Optional[str] = ...,
              group: Optional[ProcessGroup] = ..., async_op: bool = ..., *,
              algorithm: Optional[str] = ..., intra_group: Optional[ProcessGroup] = ...,
              inter_group: Optional[ProcessGroup] = ..., measure_error: Optional[bool] = ...,
              verify: bool = ...) -> Union[torch.Tensor, torch.futures.Future[torch.Tensor]]: ...
def allreduce(tensor: torch.Tensor, compressor: Any = "none", key: Optional[str] = None,
              group: Optional[ProcessGroup] = None, async_op: bool = False, *, algorithm: Optional[str] = None,
              intra_group: Optional[ProcessGroup] = None, inter_group: Optional[ProcessGroup] = None,
              measure_error: Optional[bool] = None,
              verify: bool = False) -> Union[torch.Tensor, torch.futures.Future[torch.Tensor]]:
    """The mean of ``tensor`` over ``group`` (default: every rank), sent compressed.

    ``compressor``: a name, a compressor, or an error-feedback wrapper (``ErrorFeedback(c)``).
    ``key`` names the tensor across steps: error feedback, warm starts and shared random
    streams are kept per key, in the object passed (pass the same one at every step); a name
    makes a new compressor for this call alone, so nothing carries from one call to the next. Returns a new tensor of the input's shape and dtype, the same
    bits on every rank; the input is never written to. ``async_op=True`` returns a
    ``torch.futures.Future`` at once (chain with ``.then()``); async calls run in FIFO order
    on a worker thread over a dedicated twin of the group, so leave ``tensor`` unchanged until
    the future completes. ``intra_group``/``inter_group``:
    hierarchical mean (dense inside a node, compressed across nodes; see ``make_node_groups``).
    ``measure_error``: also record relative error and cosine similarity to the dense mean (one
    extra dense allreduce). ``verify``: for ``native``, also check that the payload tensors
    that are not summed are identical on every rank. Mismatched shapes, dtypes, compressors or
    keys raise ``ValueError`` on every rank; a dead or stalled peer raises
    ``CommunicationError`` within the group's timeout.
    """
    spec = make_spec(compressor, algorithm, measure_error, verify)
    if key is None and not isinstance(compressor, str) and (
            spec.feedback is not None or type(spec.base).state_dict is not Compressor.state_dict):
        # state per key (beyond step counters): two tensors sharing the default key share it
        check_default_key(spec.feedback if spec.feedback is not None else spec.base, tensor, "allreduce")
    key = "" if key is None else str(key)
    if (intra_group is None) != (inter_group is None):
        raise ValueError("hierarchical allreduce needs both intra_group and inter_group (see make_node_groups), or neither")
    # the job runs under the tensor's device (a worker thread's current device is GPU 0)
    device, inputs = worker.device_of(tensor), [tensor] if isinstance(tensor, torch.Tensor) else []
    if intra_group is not None:
        return worker.submit(lambda twin: hierarchical_job(tensor, spec, key, twin(intra_group), twin(inter_group)),
                             (intra_group, inter_group), async_op, device=device, inputs=inputs)
    return worker.submit(lambda twin: flat_job(tensor, spec, key, twin(group)), (group,), async_op,
                         device=device, inputs=inputs)
