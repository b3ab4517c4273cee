"""DDP communication hooks for every compressor, and a 16-bit cast wrapper for any hook.

``state, hook = ddp_comm_hook("powersgd", rank=4, model=model)`` then
``ddp_model.register_comm_hook(state, hook)``. The hook hands the bucket to an ordered
worker (so communication overlaps the rest of backward) and returns that future chained with
``.then()``, which writes the averaged gradients into the bucket in place.

Compressor, error-feedback and PowerSGD state is kept per *parameter name*, never per bucket
index: DDP rebuilds its buckets after the first iteration (and a resumed run starts from the
initial layout again), which loses nothing here, so compression may start at iteration 0.
Names come from ``model`` (the module DDP wraps, or the DDP model itself); without it they are
``param{i}`` in the order the parameters are first seen, which is the same on every rank and
in every run of the same model.
"""
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .auto import make_runtime
from .engine import Runtime, build_on_every_rank, refuse_frozen
from .step import Stepping
from .policy import Policy

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


class HookState(Stepping):
    """What the hook needs between calls: the compression runtime and parameter names.

    ``state_dict()``/``load_state_dict()`` checkpoint it (residuals, warm starts, step
    counters, the iteration); load it on every rank before the first backward of the
    resumed run.
    """

    def __init__(self, compression: Runtime, model: Optional[torch.nn.Module] = None) -> None:
        self.compression = compression
        self.decision = compression.decision  # the runtime's: it ends every iteration (skipped counts the undone)
        if isinstance(model, DistributedDataParallel):
            model = model.module  # name the parameters as the wrapped module does
        self._names: Dict[int, str] = {} if model is None else {id(p): n for n, p in model.named_parameters()}
        self._named = model is not None
        self._seen: List[torch.Tensor] = []  # keeps first-seen parameters alive, so their ids stay theirs

    @property
    def iteration(self) -> int:
        """Iterations completed (the last bucket of each backward pass counts one)."""
        return self.compression.iteration

    @property
    def policy(self) -> Policy:
        return self.compression.policy

    def name_of(self, param: torch.Tensor) -> str:
        name = self._names.get(id(param))
        if name is None:
            if self._named:
                raise ValueError(f"a parameter of shape {tuple(param.shape)} in a DDP bucket is not a parameter "
                                 f"of the model given to ddp_comm_hook; pass the module DDP wraps")
            name = self._names[id(param)] = f"param{len(self._seen)}"
            self._seen.append(param)
        return name

    def state_dict(self) -> Dict[str, Any]:
        """The compression state with its identity (rank, world size, parameter names, a
        configuration fingerprint): save one file per rank; loading refuses another rank's."""
        self.compression.names = list(self._names.values())
        return self.compression.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.compression.load_state_dict(state, "HookState.load_state_dict")


# real annotations (no ``from __future__ import annotations``): DDP checks them at registration
def compressed_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket's gradients, each compressed per the state's policy."""
    buffer = bucket.buffer()
    grads = bucket.gradients()
    names = [state.name_of(p) for p in bucket.parameters()]

    def write(done: torch.futures.Future) -> torch.Tensor:
        # decompress in place, into the bucket, to keep peak memory low
        for grad, avg in zip(grads, done.value()):
            if avg.data_ptr() != grad.data_ptr():
                grad.copy_(avg)
        return buffer

    # The last bucket of a backward pass completes an iteration (as in PyTorch's PowerSGD
    # hook); nothing is left to overlap it with, so it runs on this thread.
    last = bucket.is_last()
    return state.compression.submit(names, grads, buffer=buffer, then=write, advance=last, inline=last)


def _before_init() -> bool:
    """Whether the default process group is not started yet. Frameworks (PyTorch Lightning)
    create the hook first; the launching process may not even know yet that it will be one of
    several (its ``WORLD_SIZE`` is set later), so the hook never counts ranks before the group
    exists: every rank defers alike, and registration runs at the first bucket."""
    return not (dist.is_available() and dist.is_initialized())


def ddp_comm_hook(compressor: Any = "none", *, model: Optional[torch.nn.Module] = None,
                  process_group=None, local_size: Optional[int] = None, **options: Any) -> Tuple[HookState, Hook]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    ``compressor``: any registered name (its options as keywords), a ``Compressor``, an
    error-feedback wrapper, or ``"auto"`` (per bucket, the fastest method measured; its keywords
    in :mod:`gradcomp.training.auto`). Policy keywords (see :mod:`gradcomp.training.policy`):
    ``start_iter``, ``min_compression_rate``, ``min_numel``, ``compress_1d``, ``layers``,
    ``error_feedback``, ``ef_options``. ``model`` names the parameters (recommended);
    ``process_group`` as given to DDP. ``local_size``: ranks per node (consecutive global
    ranks); then each bucket is averaged densely inside the node and compressed only across
    nodes, each gradient sent by one rank per node. Call it on every rank at the same point:
    it creates the worker's twin of the default group (and the node groups). An invalid option,
    or a ``model`` with no parameter that requires a gradient, raises ``ValueError`` on every
    rank alike, also when only some ranks were given it.
    """
    params = None
    if model is not None:
        module = model.module if isinstance(model, DistributedDataParallel) else model
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    # an invalid option on some ranks only raises on every rank, at the registration's agreement
    compression = build_on_every_rank(lambda: make_runtime(compressor, options, process_group, local_size),
                                      process_group, None if params is None else [p for _, p in params])
    state = HookState(compression, model)
    if params is not None:
        compression.names = [n for n, _ in params]
        compression.warn_unmatched([n for n, _ in params])  # now, where the user's code is
    if not _before_init():
        compression.start(params)
    else:  # a framework (PyTorch Lightning) creates the hook before it starts the process group:
        compression.deferred = params  # registration runs at the first bucket, on every rank alike
    if params is not None:
        refuse_frozen(params, "ddp_comm_hook")  # after the agreement: on every rank alike
    return state, compressed_hook


def cast_wrapper(hook: Hook, dtype: torch.dtype = torch.float16) -> Hook:
    """Wrap any DDP hook so that it sees the bucket cast to ``dtype`` (fp16 or bf16) and the
    result is cast back, like PyTorch's ``fp16_compress_wrapper``. Error-feedback residuals of
    a gradcomp hook stay fp32 whatever the bucket's dtype."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"cast_wrapper casts to torch.float16 or torch.bfloat16, not {dtype}")

    def wrapped(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        bucket.set_buffer(buffer.to(dtype))
        fut = hook(state, bucket)

        def back(done: torch.futures.Future) -> torch.Tensor:
            value = done.value()
            buffer.copy_(value[0] if isinstance(value, list) else value)
            return buffer

        return fut.then(back)

    short = "fp16" if dtype == torch.float16 else "bf16"
    wrapped.__name__ = f"{short}_{getattr(hook, '__name__', 'hook')}"
    return wrapped
