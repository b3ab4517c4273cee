"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with gradcomp's compressed collectives.

``fsdp = compress_fsdp(model, compressor="int8", all_gather="bf16")`` puts, on every
``FSDPModule`` of ``model`` (torch >= 2.9: ``set_custom_reduce_scatter`` /
``set_custom_all_gather``):

- a **reduce-scatter** of the gradients by :func:`gradcomp.collectives.shards.reduce_scatter`:
  FSDP's flat input is rank-major (``input.view(world, -1)[j]`` is rank ``j``'s padded shard of
  every parameter), so piece ``j`` goes to rank ``j`` compressed, with error feedback kept on
  the sender per ``piece_key(fqn, j)``; the owner's own piece never travels and stays exact.
  ``compressor=None`` is the dense exchange (gradcomp's mean rule; bit-identical to FSDP2's own
  on two ranks). FSDP's reduce op is honoured (``AVG``; ``SUM`` for fp16 ``reduce_dtype`` or
  ``set_force_sum_reduction_for_comms``; ``PREMUL_SUM`` for ``set_gradient_divide_factor``);
- optionally a compressed **all-gather** of the parameters (``all_gather="bf16"``/``"int8"`` or
  any compressor): each rank sends ``Q(shard + e)`` and keeps ``e`` (error feedback on the
  weights, per module FQN) and every rank, the owner too, unshards to the decoded bits, so the
  replicas are identical; FSDP's sharded parameters (the optimizer's master copy) are never
  touched. The payload is made once per weight version (the parameters' version counters):
  the re-gather of backward (``reshard_after_forward=True``) resends the same payload, so
  forward and backward use the same weights and the residual moves once per step.

**The step decision** (where a non-finite step is caught): call ``fsdp.step(optimizer)`` (or
``fsdp.step(optimizer, scaler=scaler)`` with a ``torch.amp.GradScaler``) instead of
``optimizer.step()``. The gradient exchanges since the last decision run inside one
:class:`~gradcomp.compress.transaction.Transaction`; ``step`` reads one device flag (every
rank's reduced shards finite), all-reduced: the iteration's one host sync. Finite everywhere:
the residuals are committed and the optimizer steps (through the scaler, if given). Otherwise
every rank rolls the residuals back, skips the step (``skipped`` counts it) and, with a
scaler, backs its scale off; the weights are unchanged, so the weight residuals are too.

State is keyed by module FQN (``"(root)"`` for the root): ``state_dict()`` /
``load_state_dict()`` hold this rank's residuals (save one file per rank beside the model's
distributed checkpoint); a checkpoint of another world size, rank or configuration is refused
on every rank. Supported: ``MixedPrecisionPolicy`` (param and reduce dtypes),
``set_gradient_divide_factor``, ``set_requires_gradient_sync(False)`` accumulation,
``reshard_after_forward`` True/False, ``unshard()``. Refused: HSDP (a 2-D mesh), torch < 2.9,
multi-round compressors (PowerSGD), a compressed all-gather of mixed-dtype modules. See
docs/fsdp.md.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from gradcomp.collectives.identity import Identity, agree, describe_params, fingerprint, refuse_on_every_rank
from gradcomp.collectives.shards import all_gather, reduce_scatter
from gradcomp.compress import as_codec
from gradcomp.compress.transaction import Transaction

__all__ = ["compress_fsdp", "FSDPCompression", "MIN_TORCH"]

MIN_TORCH = (2, 9)  # set_custom_reduce_scatter / set_custom_all_gather
ROOT = "(root)"  # the state key of the root module (its FQN is "")
_WHEN = "when compress_fsdp was called"

try:  # the interfaces FSDP documents for its custom comms (a private module of torch's)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGatherBase
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # torch < 2.9: compress_fsdp refuses before anything is built
    _AllGatherBase = _ReduceScatterBase = object  # type: ignore[misc,assignment]


def _torch_problem() -> Optional[str]:
    release = tuple(int(x) for x in str(torch.__version__).split("+")[0].split(".")[:2] if x.isdigit())
    if release < MIN_TORCH or _ReduceScatterBase is object:
        return (f"compress_fsdp needs torch >= {'.'.join(map(str, MIN_TORCH))} (FSDPModule.set_custom_reduce_scatter "
                f"and set_custom_all_gather); this is torch {torch.__version__}: upgrade torch")
    return None


def _op_scale(op: Any, world: int) -> float:
    """What the mean over ``world`` ranks is multiplied by to give FSDP's reduce ``op``."""
    factor = getattr(op, "factor", None)  # ReduceOp.PREMUL_SUM(f): f * sum
    if factor is not None:
        return world * float(factor)
    if op == dist.ReduceOp.AVG:
        return 1.0
    if op == dist.ReduceOp.SUM:
        return float(world)
    raise ValueError(f"compress_fsdp: FSDP asked for a reduce-scatter with op {op}; only AVG, SUM and PREMUL_SUM "
                     f"(set_gradient_divide_factor) are gradient reductions")


class _ReduceScatter(_ReduceScatterBase):
    """One module's reduce-scatter, as FSDP calls it (on its reduce-scatter stream)."""

    def __init__(self, owner: "FSDPCompression", key: str) -> None:
        self.owner, self.key = owner, key

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        self.owner._reduce_scatter(self.key, output_tensor, input_tensor, group, op)
        return None  # done when it returns: FSDP waits on its stream's event, not on a Work


class _AllGather(_AllGatherBase):
    """One module's parameter all-gather, as FSDP calls it (on its all-gather stream)."""

    def __init__(self, owner: "FSDPCompression", key: str) -> None:
        self.owner, self.key = owner, key

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> None:
        self.owner._all_gather(self.key, output_tensor, input_tensor, group)
        return None


class _SentOnce:
    """The weight codec as ``all_gather`` sees it for one call: the codec's payload (error
    feedback applied) on the first ``compress``, and the payload of an earlier call replayed
    when the weights have not changed since (nothing moves in the residual)."""

    def __init__(self, codec: Any, payload: Any = None) -> None:
        self.codec, self.payload = codec, payload
        self.base, self.name, self.fixed_size = codec.base, codec.name, codec.base.fixed_size

    def __repr__(self) -> str:  # the codec's configuration: what an agreed layout is known by
        return repr(self.codec)

    def compress(self, tensor: torch.Tensor, key: str) -> Any:
        if self.payload is None:
            self.payload = self.codec.compress(tensor, key)
        return self.payload


def _fsdp_modules(model: torch.nn.Module) -> List[Tuple[str, Any]]:
    from torch.distributed.fsdp import FSDPModule

    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, FSDPModule)]


def _managed(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The parameters ``fully_shard(module)`` manages: its subtree's, less the sub-FSDP modules'."""
    from torch.distributed.fsdp import FSDPModule

    out: Dict[int, torch.nn.Parameter] = {}
    stack = [module]
    while stack:
        m = stack.pop(0)
        for p in m.parameters(recurse=False):
            out.setdefault(id(p), p)
        stack.extend(c for c in m.children() if not isinstance(c, FSDPModule))
    return list(out.values())


def _mesh_problem(meshes: List[Any]) -> Optional[str]:
    if not meshes:
        return "the model has no parameter under fully_shard; call fully_shard on its modules first"
    if any(m.ndim != 1 for m in meshes):
        return ("HSDP (a 2-D device mesh) is not supported: the replicas' all-reduce after the reduce-scatter would "
                "stay dense and its divide factor spans both dimensions; shard on a 1-D mesh")
    if len({id(m) for m in meshes}) > 1 and len({tuple(m.mesh.flatten().tolist()) for m in meshes}) > 1:
        return "the FSDP modules shard over different device meshes; compress_fsdp needs one mesh for the model"
    return None


class FSDPCompression:
    """What :func:`compress_fsdp` installed on a model's FSDP modules (see the module docstring).

    ``step(optimizer, scaler=None)`` is the step decision; ``skipped`` counts the steps skipped
    because a reduced gradient was not finite on some rank; ``state_dict``/``load_state_dict``
    hold this rank's residuals; ``describe()`` says what runs where."""

    def __init__(self, model: torch.nn.Module, compressor: Any, all_gather_spec: Any,
                 compressor_options: Optional[Mapping[str, Any]], all_gather_options: Optional[Mapping[str, Any]]
                 ) -> None:
        problem = _torch_problem()
        if problem:
            raise RuntimeError(problem)
        modules: List[Tuple[str, Any, List[torch.nn.Parameter]]] = [(fqn, m, _managed(m))
                                                                    for fqn, m in _fsdp_modules(model)]
        modules = [(fqn, m, ps) for fqn, m, ps in modules if ps]  # a module without parameters never communicates
        meshes = [p.device_mesh for _, _, ps in modules for p in ps if hasattr(p, "device_mesh")]
        problem = _mesh_problem(meshes)
        if problem:  # the same model on every rank: the same error everywhere, without talking
            raise ValueError(f"compress_fsdp: {problem}")
        self.group = meshes[0].get_group()
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        names = {id(p): n for n, p in model.named_parameters()}
        self.keys = [fqn or ROOT for fqn, _, _ in modules]
        self._params = {k: ps for k, (_, _, ps) in zip(self.keys, modules)}
        problem = ""
        self.grad_codec: Any = None
        self.weight_codec: Any = None
        try:
            self.grad_codec = self._codec(compressor, compressor_options, "compressor")
            self.weight_codec = self._codec(all_gather_spec, all_gather_options, "all_gather")
            if self.weight_codec is not None:
                mixed = [k for k, ps in self._params.items() if len({p.dtype for p in ps}) > 1]
                if mixed:
                    raise ValueError(f"all_gather: module {mixed[0]!r} mixes parameter dtypes, which FSDP gathers as "
                                     f"raw bytes; give it one dtype or use all_gather=None")
        except ValueError as exc:
            problem = str(exc)
        self._config = {"torch": str(torch.__version__), "compressor": repr(self.grad_codec),
                        "all_gather": repr(self.weight_codec), "setup problem": problem or "none",
                        "modules": describe_params([(f"{k}:{names.get(id(p), '?')}", p)
                                                    for k, ps in self._params.items() for p in ps])}
        agree(self._config, self.group, _WHEN)  # one error on every rank when they differ
        if problem:
            raise ValueError(problem)
        self.skipped = 0
        self._txn = Transaction()
        # each module's pieces are the same at every step: after the first, checked reduce-scatter
        # and all-gather, its payloads travel on their agreed layouts (no size exchange, no parsing)
        self._layouts: Dict[Any, Any] = {}
        self._bad: Optional[torch.Tensor] = None  # non-finite reduced shards since the last decision
        self._sent: Dict[str, Tuple[Tuple[int, ...], Any]] = {}  # key -> (weight versions, payload sent)
        self.reduce_scatters: Dict[str, _ReduceScatter] = {}
        self.all_gathers: Dict[str, _AllGather] = {}
        for key, (_, module, _) in zip(self.keys, modules):
            if hasattr(module, "set_reduce_scatter_unused_params"):
                # an unused parameter then sends zeros instead of leaving the flat layout, so a
                # piece's residual always covers the same elements
                module.set_reduce_scatter_unused_params(True)
            self.reduce_scatters[key] = _ReduceScatter(self, key)
            module.set_custom_reduce_scatter(self.reduce_scatters[key])
            if self.weight_codec is not None:
                self.all_gathers[key] = _AllGather(self, key)
                module.set_custom_all_gather(self.all_gathers[key])

    @staticmethod
    def _codec(spec: Any, options: Optional[Mapping[str, Any]], what: str) -> Any:
        if spec is None or (isinstance(spec, str) and spec == "none" and not options):
            return None
        codec = as_codec(spec, options, error_feedback="ef", wrappers="refuse", what=what)
        if codec.base.multi_round:
            raise ValueError(f"{what}: {codec.name} is multi-round (its payloads are summed in rounds); a "
                             f"reduce-scatter sends each piece once: use a single-round compressor (int8, onebit, topk)")
        return codec

    # ---- the comms FSDP calls -------------------------------------------------------------
    def _reduce_scatter(self, key: str, output: torch.Tensor, flat: torch.Tensor, group: Any, op: Any) -> None:
        world = dist.get_world_size(group)
        scale = _op_scale(op, world)
        if flat.numel() != output.numel() * world:
            raise ValueError(f"compress_fsdp: module {key!r}: FSDP passed {flat.numel()} elements for {world} pieces "
                             f"of {output.numel()}")
        with self._txn.active():
            out = reduce_scatter(flat, [output.numel()] * world, compressor=self.grad_codec, key=key, group=group,
                                 layouts=self._layouts)
        if scale != 1.0:
            out.mul_(scale)
        output.copy_(out)
        bad = torch.isfinite(output).logical_not().any()
        self._bad = bad if self._bad is None else self._bad.logical_or(bad)

    def _all_gather(self, key: str, output: torch.Tensor, shard: torch.Tensor, group: Any) -> None:
        if not shard.is_floating_point():
            raise ValueError(f"compress_fsdp: module {key!r} is all-gathered as {shard.dtype} (mixed dtypes or a "
                             f"tensor subclass's own all-gather); use all_gather=None for this model")
        versions = tuple(p._version for p in self._params[key])
        kept = self._sent.get(key)
        codec = _SentOnce(self.weight_codec, kept[1] if kept is not None and kept[0] == versions else None)
        world = dist.get_world_size(group)
        full = all_gather(shard, [shard.numel()] * world, compressor=codec, key=key, group=group,
                          layouts=self._layouts)
        self._sent[key] = (versions, codec.payload)
        output.copy_(full)

    # ---- the step decision -----------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, scaler: Any = None) -> bool:
        """Step ``optimizer`` (through ``scaler.step``/``update`` when given) if every rank's
        reduced gradients since the last call are finite; otherwise undo the compression state
        of those exchanges, skip the step on every rank (backing the scaler off) and return
        False. One small all-reduce and one host read."""
        flag = self._bad
        if flag is None:
            device = next(iter(self._params.values()))[0].device
            flag = torch.zeros((), dtype=torch.float32, device=device)
        flag = flag.to(torch.float32).reshape(1)
        dist.all_reduce(flag, group=self.group)
        bad = bool(flag.item() > 0)  # the iteration's one host sync
        self._bad = None
        txn, self._txn = self._txn, Transaction()
        if bad:
            txn.rollback()
            self.skipped += 1
            if scaler is not None:  # what GradScaler.update does after an overflow: back off, no step
                scaler.update(scaler.get_scale() * scaler.get_backoff_factor())
            return False
        txn.commit()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        return True

    # ---- checkpoints -------------------------------------------------------------------------
    def _identity(self) -> Identity:
        return Identity(owner="compress_fsdp", rank=self.rank, world=self.world,
                        config=fingerprint(repr(sorted((k, v) for k, v in self._config.items()
                                                       if k != "modules"))),
                        params=fingerprint(self._config["modules"]))

    def state_dict(self) -> Dict[str, Any]:
        """This rank's residuals (gradient pieces per ``piece_key(fqn, j)``, weights per FQN),
        with whose they are. Save it between steps."""
        return {"identity": self._identity().to_dict(), "skipped": self.skipped,
                "reduce_scatter": None if self.grad_codec is None else self.grad_codec.state_dict(),
                "all_gather": None if self.weight_codec is None else self.weight_codec.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load this rank's :meth:`state_dict`; every rank raises the same ``ValueError``
        (nothing loaded) when any rank's does not fit (another world size, rank, model or
        configuration)."""
        problem: Optional[str] = None
        if not isinstance(state, Mapping) or "identity" not in state:
            problem = "not a compress_fsdp state_dict"
        else:
            try:
                problem = self._identity().mismatch(state["identity"])
            except ValueError as exc:
                problem = str(exc)
            if problem and "world" in problem:
                problem += " (the residuals are owed to the pieces of that world size's shards; no resharding)"
        refuse_on_every_rank(problem, self.group, "compress_fsdp.load_state_dict")
        for codec, part in ((self.grad_codec, "reduce_scatter"), (self.weight_codec, "all_gather")):
            if codec is not None:
                codec.load_state_dict(state[part])
        self.skipped = int(state.get("skipped", 0))
        self._txn, self._bad = Transaction(), None
        self._sent.clear()  # the next gather compresses the loaded weights with the loaded residual
        self._layouts.clear()  # and the next exchanges are checked again

    def describe(self) -> str:
        """What runs on which module, one line each."""
        rs = "dense (gradcomp's mean)" if self.grad_codec is None else f"{self.grad_codec!r}, EF per piece"
        ag = "FSDP's own (exact)" if self.weight_codec is None else f"{self.weight_codec!r}, EF on the weights"
        lines = [f"compress_fsdp: {len(self.keys)} FSDP modules on {self.world} ranks; reduce-scatter {rs}; "
                 f"all-gather {ag}; {self.skipped} steps skipped"]
        lines += [f"  {k}: {sum(p.numel() for p in self._params[k])} parameters" for k in self.keys]
        return "\n".join(lines)


def compress_fsdp(model: torch.nn.Module, compressor: Any = "int8", *, all_gather: Any = None,
                  compressor_options: Optional[Mapping[str, Any]] = None,
                  all_gather_options: Optional[Mapping[str, Any]] = None) -> FSDPCompression:
    """Put gradcomp's reduce-scatter (``compressor``: a name, a ``Compressor``, or None for
    dense; error feedback per piece) and, with ``all_gather`` (e.g. ``"bf16"``, ``"int8"``), a
    compressed parameter all-gather (error feedback on the weights) on every FSDP module of
    ``model`` (after ``fully_shard``). Every rank must call it; ranks that disagree on the
    configuration or the model all raise the same ``ValueError``. Step with the returned
    handle's ``step(optimizer)`` (module docstring)."""
    return FSDPCompression(model, compressor, all_gather, compressor_options, all_gather_options)
