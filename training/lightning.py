"""``GradcompDDPStrategy``: PyTorch Lightning's DDP strategy with gradcomp's communication hook.

    from gradcomp.training.lightning import GradcompDDPStrategy
    trainer = pl.Trainer(accelerator="gpu", devices=8, strategy=GradcompDDPStrategy("powersgd", rank=4))

The first argument and the keywords that are not ``DistributedDataParallel``'s are those of
:func:`gradcomp.training.ddp_comm_hook` (a compressor name or object, its options, the policy
keywords, ``local_size``); DDP's keywords (``find_unused_parameters``, ``bucket_cap_mb``,
``static_graph`` ...) and Lightning's (``timeout``, ``start_method`` ...) go where they go in
``DDPStrategy``. The hook is made once the process group exists and the model is wrapped, on
every rank at the same point, with the parameters named as the LightningModule names them (so
``layers`` patterns read as in ``model.named_parameters()``); it runs on CPU (gloo) as well as
CUDA (Lightning's own ``DDPStrategy`` registers a hook on CUDA only).

Checkpoints: every rank's hook state (residuals, PowerSGD warm starts, step counters) is
gathered to rank 0 and saved under the checkpoint's ``"gradcomp"`` key, so a run resumed with
``trainer.fit(..., ckpt_path=...)`` continues as the uninterrupted one would; resuming needs
the same number of ranks (``gradcomp.training.reshard_states`` converts the states).
``teardown`` stops gradcomp's worker threads (:func:`gradcomp.training.shutdown`) before
Lightning lets the process group go.

Importing this module needs PyTorch Lightning (``pip install lightning``; the older
``pytorch_lightning`` package works too); ``import gradcomp`` never does.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Dict, List, Mapping, Optional

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradcomp.collectives.worker import shutdown, wait_all
from .hooks import HookState, ddp_comm_hook
from .policy import Policy


def _lightning() -> Any:
    """Lightning's ``strategies`` module (imported by name: mypy need not have Lightning)."""
    for name in ("lightning.pytorch.strategies", "pytorch_lightning.strategies"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("gradcomp.training.lightning needs PyTorch Lightning: pip install lightning "
                      "(or the older pytorch_lightning package)")


_strategies = _lightning()
_DDPStrategy: Any = _strategies.DDPStrategy
_DDP_KEYWORDS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module"}
# DDPStrategy's own keywords (everything else it takes goes to DistributedDataParallel)
_STRATEGY_KEYWORDS = frozenset(inspect.signature(_DDPStrategy.__init__).parameters) - {"self", "kwargs"}
_THEIRS = frozenset({"ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period"})
CHECKPOINT_KEY = "gradcomp"


class GradcompDDPStrategy(_DDPStrategy):
    """``DDPStrategy`` whose DDP model exchanges gradients through gradcomp's hook (see the
    module docstring). ``hook_state``: the :class:`~gradcomp.training.HookState` of the latest
    fit (None before the first); its ``compression`` holds the policy and codecs."""

    strategy_name = "gradcomp_ddp"

    def __init__(self, compressor: Any = "powersgd", *, local_size: Optional[int] = None, **kwargs: Any) -> None:
        taken = sorted(_THEIRS & set(kwargs))
        if taken:
            raise ValueError(f"GradcompDDPStrategy makes its own communication hook; {', '.join(taken)} belong to "
                             f"Lightning's DDPStrategy (use that one for a hook of your own)")
        if "process_group" in kwargs:
            raise ValueError("GradcompDDPStrategy exchanges over the default process group Lightning starts; "
                             "process_group is not supported")
        lightning = {k: v for k, v in kwargs.items() if k in _STRATEGY_KEYWORDS}
        ddp = {k: v for k, v in kwargs.items() if k in _DDP_KEYWORDS}
        options = {k: v for k, v in kwargs.items() if k not in lightning and k not in ddp}
        Policy(compressor, **options)  # a bad name, keyword or value: ValueError now, not on the ranks
        super().__init__(**lightning, **ddp)
        self._gradcomp: Dict[str, Any] = {"compressor": compressor, "local_size": local_size, "options": options}
        self.hook_state: Optional[HookState] = None
        self._pending: Optional[Mapping[str, Any]] = None

    # ---- the hook -----------------------------------------------------------------------------
    def _register_ddp_hooks(self) -> None:
        if not isinstance(self.model, DistributedDataParallel):
            raise TypeError(f"GradcompDDPStrategy expected a DistributedDataParallel model, got "
                            f"{type(self.model).__name__}")
        g = self._gradcomp
        # named as the LightningModule names them; DDP's buckets hold the same parameter objects
        state, hook = ddp_comm_hook(g["compressor"], model=self.lightning_module, local_size=g["local_size"],
                                    **g["options"])
        self.hook_state = state
        if self._pending is not None:
            self._load_pending()
        self.model.register_comm_hook(state, hook)

    # ---- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Called on every rank: every rank's hook state goes to rank 0's checkpoint. Weights-only
        checkpoints (no ``optimizer_states``) carry none."""
        if self.hook_state is not None and "optimizer_states" in checkpoint:
            mine = self._state_of_this_rank()
            if dist.is_initialized() and dist.get_world_size() > 1:
                wait_all()  # no gradcomp exchange in flight beside this collective
                gathered: Optional[List[Any]] = [None] * dist.get_world_size() if self.global_rank == 0 else None
                dist.gather_object(mine, gathered, dst=0)
            else:
                gathered = [mine]
            if gathered is not None:
                checkpoint = {**checkpoint, CHECKPOINT_KEY: {"world_size": len(gathered), "ranks": gathered}}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _state_of_this_rank(self) -> Dict[str, Any]:
        assert self.hook_state is not None
        wait_all()  # the state is read when no exchange is running
        return self.hook_state.state_dict()

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """The model's weights, and this rank's hook state kept for the hook (made later, in setup);
        a checkpoint of another number of ranks is refused before anything is loaded."""
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            super().load_model_state_dict(checkpoint, strict=strict)
            return
        world = dist.get_world_size() if dist.is_initialized() else 1
        if not isinstance(saved, Mapping) or saved.get("world_size") != world or len(saved.get("ranks", ())) != world:
            count = saved.get("world_size") if isinstance(saved, Mapping) else "?"
            raise ValueError(f"the checkpoint holds gradcomp hook states of {count} ranks, this run has {world}; "
                             f"resume with {count} ranks, or convert the states with "
                             f"gradcomp.training.reshard_states and load them into strategy.hook_state")
        super().load_model_state_dict(checkpoint, strict=strict)
        self._pending = saved["ranks"][self.global_rank]
        if self.hook_state is not None:  # a strategy that restores after setup
            self._load_pending()

    def _load_pending(self) -> None:
        assert self.hook_state is not None and self._pending is not None
        pending, self._pending = self._pending, None
        self.hook_state.load_state_dict(pending)

    # ---- the end ------------------------------------------------------------------------------
    def teardown(self) -> None:
        registered = self.hook_state is not None
        self._pending = None
        super().teardown()
        if registered:  # the state stays: trainer.save_checkpoint after fit saves it
            wait_all()
            shutdown()  # gradcomp's worker threads and twin groups, before the process group goes


def _register() -> None:
    registry = _strategies.StrategyRegistry
    for name, start in (("gradcomp_ddp", "popen"), ("gradcomp_ddp_spawn", "spawn")):
        if name not in registry:
            registry.register(name, GradcompDDPStrategy,
                              description=f"DDP with gradcomp's PowerSGD hook, start_method '{start}'",
                              start_method=start)


_register()
__all__ = ["GradcompDDPStrategy", "CHECKPOINT_KEY"]
