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
  touched. Every forward's gather makes a payload from the weights as they are then; a
  re-gather in backward (``reshard_after_forward=True``, activation recomputation) resends the
  forward's, so backward uses the weights forward used (``regather="local"``: it decodes the
  forward's received payloads again, kept compressed until the step decision, and sends
  nothing). Asked with ``async_op=True`` (:func:`overlap_gathers`), the gather encodes and
  starts the wire, and returns a ``Work`` whose ``wait`` (FSDP's copy-out) decodes straight
  into FSDP's output. Nothing else resends a payload: what
  moved the weights since (an optimizer step, foreach or fused, a write through ``.data``, a
  load) need not show in a version counter, so it is never trusted to.

**The step decision** (where a non-finite step is caught): call ``fsdp.step(optimizer)`` (or
``fsdp.step(optimizer, scaler=scaler)`` with a ``torch.amp.GradScaler``) instead of
``optimizer.step()``. The gradient exchanges since the last decision run inside one
:class:`~gradcomp.compress.transaction.Transaction`; ``step`` makes the decision with the
handle's :class:`~gradcomp.training.step.StepDecision` (``fsdp.decision``): its device flags
(every rank's reduced shards finite, every received payload valid), all-reduced together: the
iteration's one host sync. Finite everywhere: the residuals are committed and the optimizer
steps (through the scaler, if given). Otherwise every rank rolls the gradient residuals back,
skips the step (``skipped``, the decision's counter, counts it) and, with a scaler, backs its
scale off. (The weight residuals move with each forward's gather and owe no
gradient: they are not part of the decision.) An exchange that starts while the previous
backward's decision is still open (``optimizer.step()`` or ``GradScaler.step`` called without
``fsdp.step``, or a second synced backward before the step) reads it then, on every rank: a new
iteration's makes the decision there (kept, or undone when not finite) and warns once with the
fix; the next micro-batch of the same step keeps it open for ``step``, undoing a non-finite one
at once. No residual keeps a non-finite value.

State is keyed by module FQN (``"(root)"`` for the root): ``state_dict()`` /
``load_state_dict()`` hold this rank's residuals (save one file per rank beside the model's
distributed checkpoint); a checkpoint of another world size, rank or configuration is refused
on every rank. No payload outlives its step decision, so between steps nothing the next step
uses lives outside it and the model's and optimizer's checkpoints: a resume continues bit for
bit, frozen parameters included. Supported: ``MixedPrecisionPolicy`` (param and reduce dtypes),
``set_gradient_divide_factor``, ``set_requires_gradient_sync(False)`` accumulation,
``reshard_after_forward`` True/False, ``unshard()``, and HSDP with a compressed all-reduce between
the replicas (``replicate=``, see :func:`compress_fsdp`). Refused: a model sharded on a 2-D mesh
(FSDP2's own HSDP, whose dense all-reduce FSDP runs itself), torch < 2.9,
multi-round compressors (PowerSGD), a compressed all-gather of mixed-dtype modules. See
docs/fsdp.md.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradcomp.collectives import allreduce, allreduce_fused
from gradcomp.collectives.identity import Identity, agree, describe_params, fingerprint, refuse_on_every_rank
from gradcomp.collectives.shards import all_gather, decode_gathered, reduce_scatter
from gradcomp.compress import as_codec
from gradcomp.compress.transaction import Transaction
from gradcomp.training.step import StepDecision, Stepping, Verdict
from gradcomp.training.wrapper import broadcast_params

__all__ = ["compress_fsdp", "FSDPCompression", "MIN_TORCH", "overlap_gathers"]

MIN_TORCH = (2, 9)  # set_custom_reduce_scatter / set_custom_all_gather
REGATHER = ("wire", "local")  # how backward re-gathers a module (compress_fsdp's regather)
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
                 async_op: bool = False) -> Optional["_GatherWork"]:
        pending = self.owner._all_gather(self.key, output_tensor, input_tensor, group, async_op)
        return None if pending is None else _GatherWork(pending)


class _GatherWork(dist.distributed_c10d.Work):
    """A compressed all-gather on the wire, as FSDP waits for it (``unshard(async_op=True)``:
    ``set_unshard_async_op(True)``, and the prefetches of ``set_modules_to_forward_prefetch`` /
    backward prefetching): the payload was encoded when FSDP asked, the wire runs beside
    whatever runs next, and ``wait()`` (FSDP's copy-out) decodes every piece into FSDP's output."""

    def __init__(self, pending: Any) -> None:
        super().__init__()
        self.pending = pending

    def wait(self, timeout: Any = None) -> bool:
        self.pending.wait()
        return True

    def is_completed(self) -> bool:
        return bool(self.pending.is_completed())

    def get_future(self) -> Any:
        """Completes when the wire is done (before the decode that ``wait`` does)."""
        future = self.pending.get_future()
        if future is None:
            future = torch.futures.Future()
            future.set_result(None)
        return future


class _SentOnce:
    """The weight codec as ``all_gather`` sees it for one call: the codec's payload (error
    feedback applied) on the first ``compress``, or the payload of the forward's gather replayed
    by a re-gather in backward (nothing moves in the residual)."""

    def __init__(self, codec: Any, payload: Any = None) -> None:
        self.codec, self.payload = codec, payload
        self.base, self.name, self.fixed_size = codec.base, codec.name, codec.base.fixed_size

    def __repr__(self) -> str:  # the codec's configuration: what an agreed layout is known by
        return repr(self.codec)

    def compress(self, tensor: torch.Tensor, key: str) -> Any:
        if self.payload is None:
            self.payload = self.codec.compress(tensor, key)
        return self.payload


def _backward() -> int:
    """The id of the backward autograd's engine is running on this thread, -1 outside one
    (FSDP's own test): a gather in one re-gathers the weights the forward used
    (``reshard_after_forward``, recomputation)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if task is None else int(task())


def _versions(params: Sequence[torch.nn.Parameter]) -> Tuple[int, ...]:
    """The version counters of ``params`` and of their local shards (a write through
    ``to_local()`` moves only the shard's)."""
    with torch.no_grad():
        return tuple(v for p in params
                     for v in (p._version, p.to_local()._version if hasattr(p, "to_local") else 0))


def _remove(handles: List[Any]) -> None:
    for handle in handles:
        handle.remove()


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
        return ("the model is sharded on a 2-D device mesh (FSDP2's own HSDP), whose all-reduce between replicas "
                "FSDP runs itself, dense; for HSDP with compression shard on the mesh's shard dimension "
                "(fully_shard(m, mesh=mesh['shard'])) and pass compress_fsdp(model, replicate=mesh, "
                "replicate_compressor=...)")
    if len({id(m) for m in meshes}) > 1 and len({tuple(m.mesh.flatten().tolist()) for m in meshes}) > 1:
        return "the FSDP modules shard over different device meshes; compress_fsdp needs one mesh for the model"
    return None


def _replicate_groups(replicate: Any, shard_group: Any) -> Tuple[Any, Any, int]:
    """(the replicas' group of this rank, the group of every rank of the model, the number of
    replicas) from ``replicate``: None (plain FSDP), a 2-D ``DeviceMesh`` (replicate x shard:
    its dimension named ``"replicate"``, else its first) whose other dimension is the shard
    group, or the process group of this rank's replicas (then the model spans every rank)."""
    if replicate is None:
        return None, shard_group, 1
    shard_ranks = sorted(dist.get_process_group_ranks(shard_group))
    if hasattr(replicate, "get_group"):
        if replicate.ndim != 2:
            raise ValueError(f"compress_fsdp: replicate must be a 2-D DeviceMesh (replicate x shard), got a "
                             f"{replicate.ndim}-D one")
        names = list(getattr(replicate, "mesh_dim_names", None) or ())
        dim = names.index("replicate") if "replicate" in names else 0
        group = replicate.get_group(dim)
        other = replicate.get_group(1 - dim)
        if sorted(dist.get_process_group_ranks(other)) != shard_ranks:
            raise ValueError("compress_fsdp: the model is not sharded on the replicate mesh's shard dimension; "
                             "call fully_shard(m, mesh=mesh['shard']) (the mesh's other dimension)")
        ranks = sorted(int(r) for r in replicate.mesh.flatten().tolist())
        # a mesh of part of the world: a group of its ranks, made by them alone
        span = None if ranks == list(range(dist.get_world_size())) else \
            dist.new_group(ranks, use_local_synchronization=True)
        return group, span, dist.get_world_size(group)
    replicas = dist.get_world_size(replicate)
    if replicas * len(shard_ranks) != dist.get_world_size():
        raise ValueError(f"compress_fsdp: replicate is a process group of {replicas} ranks and the shard group has "
                         f"{len(shard_ranks)}, but the world has {dist.get_world_size()}; pass the 2-D DeviceMesh")
    return replicate, None, replicas


def _broadcast_shards(params: Sequence[torch.nn.Parameter], group: Any) -> None:
    """Every replica's shards from the group's first rank (the same shards: the same position)."""
    with torch.no_grad():
        broadcast_params([p.to_local() if hasattr(p, "to_local") else p for p in params], group)


class FSDPCompression(Stepping):
    """What :func:`compress_fsdp` installed on a model's FSDP modules (see the module docstring).

    ``step(optimizer, scaler=None)`` is the step decision; ``skipped`` counts the steps skipped
    because a reduced gradient was not finite on some rank; ``state_dict``/``load_state_dict``
    hold this rank's residuals; ``describe()`` says what runs where."""

    def __init__(self, model: torch.nn.Module, compressor: Any, all_gather_spec: Any,
                 compressor_options: Optional[Mapping[str, Any]], all_gather_options: Optional[Mapping[str, Any]],
                 replicate: Any = None, replicate_compressor: Any = None,
                 replicate_options: Optional[Mapping[str, Any]] = None, regather: str = "wire") -> None:
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
        # HSDP: the replicas' all-reduce after the reduce-scatter (None: plain FSDP); ``span`` is
        # every rank of the model (the step decision's group: the replicas decide together)
        self.replicate, self.span, self.replicas = _replicate_groups(replicate, self.group)
        names = {id(p): n for n, p in model.named_parameters()}
        self.keys = [fqn or ROOT for fqn, _, _ in modules]
        self._params = {k: ps for k, (_, _, ps) in zip(self.keys, modules)}
        problem = ""
        self.grad_codec: Any = None
        self.weight_codec: Any = None
        self.replica_codec: Any = None
        try:
            self.grad_codec = self._codec(compressor, compressor_options, "compressor")
            self.weight_codec = self._codec(all_gather_spec, all_gather_options, "all_gather")
            self.replica_codec = self._codec(replicate_compressor, replicate_options, "replicate_compressor")
            if regather not in REGATHER:
                raise ValueError(f"regather: {regather!r} is not one of {', '.join(map(repr, REGATHER))}")
            if regather == "local" and self.weight_codec is None:
                raise ValueError("regather='local' decodes backward's re-gathers from the payloads of the forward's "
                                 "compressed all-gather; pass all_gather= (e.g. 'bf16') too, or leave regather out")
            if self.replicate is None and (replicate_compressor is not None or replicate_options):
                raise ValueError("replicate_compressor: it compresses HSDP's all-reduce between replicas; pass "
                                 "replicate= (the 2-D DeviceMesh) too, or leave it out")
            if self.weight_codec is not None:
                mixed = [k for k, ps in self._params.items() if len({p.dtype for p in ps}) > 1]
                if mixed:
                    raise ValueError(f"all_gather: module {mixed[0]!r} mixes parameter dtypes, which FSDP gathers as "
                                     f"raw bytes; give it one dtype or use all_gather=None")
        except ValueError as exc:
            problem = str(exc)
        self._config = {"torch": str(torch.__version__), "compressor": repr(self.grad_codec),
                        "all_gather": repr(self.weight_codec), "setup problem": problem or "none",
                        "replicas": str(self.replicas), "replicate_compressor": repr(self.replica_codec),
                        "regather": str(regather),
                        "modules": describe_params([(f"{k}:{names.get(id(p), '?')}", p)
                                                    for k, ps in self._params.items() for p in ps])}
        agree(self._config, self.span, _WHEN)  # one error on every rank when they differ
        if problem:
            raise ValueError(problem)
        if self.replicate is not None:  # the replicas start equal: every shard from the first replica's
            _broadcast_shards([p for ps in self._params.values() for p in ps], self.replicate)
        self.decision = StepDecision(self.span, "compress_fsdp")  # the step decision, and its skipped counter
        self._replica_layouts: Dict[Any, Any] = {}  # the replicas' exchange per module, agreed after the first
        self._txn = Transaction()
        # each module's pieces are the same at every step: after the first, checked reduce-scatter
        # and all-gather, its payloads travel on their agreed layouts (no size exchange, no parsing)
        self._layouts: Dict[Any, Any] = {}
        self._bad: Optional[torch.Tensor] = None  # non-finite reduced shards since the last decision
        # key -> (weight versions, payload) of the module's last forward gather, for backward's re-gathers
        self._sent: Dict[str, Tuple[Tuple[int, ...], Any, List[Any]]] = {}
        self.regather = regather  # "local": those re-gathers decode the forward's received payloads
        self._modules = {key: module for key, (_, module, _) in zip(self.keys, modules)}
        self._ids: Optional[Set[int]] = None  # the managed parameters' ids (refreshed after a load)
        # the open decision: modules reduce-scattered since the last one; an optimizer holding these
        # parameters stepped outside step(); it already found a non-finite micro-batch (see _reopen)
        self._reduced: Dict[str, int] = {}  # key -> the backward (_backward) that reduce-scattered it last
        self._outside = self._stepping = self._doomed = self._warned = False
        self.reduce_scatters: Dict[str, _ReduceScatter] = {}
        self.all_gathers: Dict[str, _AllGather] = {}
        self._hooks(modules)
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

    def _hooks(self, modules: List[Tuple[str, Any, List[torch.nn.Parameter]]]) -> None:
        """Learn of an optimizer step of these parameters outside step() (torch's global pre-hook,
        which every optimizer's step passes, foreach and fused included): a new iteration for
        _reopen; and of a ``load_state_dict`` of any FSDP module, which may replace the
        parameters (``assign=True``). The hooks hold this object weakly and go with it."""
        ref = weakref.ref(self)

        def stepping(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            owner = ref()
            if owner is not None:
                owner._optimizer_steps(optimizer)

        def loaded(module: torch.nn.Module, incompatible: Any) -> None:
            owner = ref()
            if owner is not None:
                owner._weights_loaded()

        handles = [register_optimizer_step_pre_hook(stepping)]
        handles += [module.register_load_state_dict_post_hook(loaded) for _, module, _ in modules]
        weakref.finalize(self, _remove, handles)

    def _optimizer_steps(self, optimizer: torch.optim.Optimizer) -> None:
        if self._stepping:
            return
        if self._ids is None:
            self._ids = {id(p) for ps in self._params.values() for p in ps}
        ids = self._ids
        if any(id(p) in ids for group in optimizer.param_groups for p in group["params"]):
            self._outside = True

    def _weights_loaded(self) -> None:
        self._params = {key: _managed(module) for key, module in self._modules.items()}
        self._ids = None
        self._sent.clear()

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
        backward = _backward()
        if key in self._reduced and (backward == -1 or self._reduced[key] != backward):
            self._reopen(flat.device)  # a second backward since the last decision (one may reduce twice)
        with self._txn.active():  # straight into FSDP's output; FSDP drops its input after the call
            reduce_scatter(flat, [output.numel()] * world, compressor=self.grad_codec, key=key, group=group,
                           layouts=self._layouts, out=output, consume=True)
            if self.replicate is not None:  # HSDP: the mean over the replicas of this shard, in place
                if self.replica_codec is None:  # dense: the group's own all-reduce (a ring, as FSDP2's
                    mean = allreduce(output, "none", group=self.replicate)  # HSDP), gradcomp's mean rule
                else:
                    mean = allreduce_fused([(f"{key}/replicas", output, self.replica_codec)], self.replicate,
                                           layouts=self._replica_layouts, into=True)[0]
                if mean is not output:
                    output.copy_(mean)
                scale = _op_scale(op, world * self.replicas)
        if scale != 1.0:
            output.mul_(scale)
        bad = torch.isfinite(output).logical_not().any()
        self._bad = bad if self._bad is None else self._bad.logical_or(bad)
        self._reduced[key] = backward

    def _all_gather(self, key: str, output: torch.Tensor, shard: torch.Tensor, group: Any,
                    async_op: bool = False) -> Any:
        if not shard.is_floating_point():
            raise ValueError(f"compress_fsdp: module {key!r} is all-gathered as {shard.dtype} (mixed dtypes or a "
                             f"tensor subclass's own all-gather); use all_gather=None for this model")
        backward = _backward() != -1
        if self._reduced and not backward:  # a forward after a backward's exchanges, with no decision between
            self._reopen(shard.device)
        # Only a re-gather in backward resends the forward's payload, so backward uses the weights
        # forward used: whatever moved the weights since the forward (an optimizer step of any
        # kind, writes through .data, loads) cannot be seen from here, so a forward always encodes.
        kept = self._sent.get(key)
        if backward and self.regather == "local" and kept is not None and kept[2]:
            # every rank holds every payload of the forward's gather (the same on every rank: no
            # rank talks, so none waits); decoded again they give the forward's bits
            decode_gathered(self.weight_codec, kept[2], output)
            return None
        versions = _versions(self._params[key])
        codec = _SentOnce(self.weight_codec, kept[1] if backward and kept is not None and kept[0] == versions else None)
        world = dist.get_world_size(group)
        received: List[Any] = []  # filled when the gather finishes: kept for regather="local"
        # encoded now, decoded straight into FSDP's output (at FSDP's wait when asynchronous)
        pending = all_gather(shard, [shard.numel()] * world, compressor=codec, key=key, group=group,
                             layouts=self._layouts, out=output.view(-1), async_op=async_op,
                             keep=received if self.regather == "local" else None)
        self._sent[key] = (versions, codec.payload, received)
        return pending if async_op else None

    # ---- the step decision -----------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, scaler: Any = None) -> bool:
        """Step ``optimizer`` (through ``scaler.step``/``update`` when given) if every rank's
        reduced gradients since the last call are finite; otherwise undo the compression state
        of those exchanges, skip the step on every rank (backing the scaler off) and return
        False (and raise the same ``ValueError`` on every rank when a received payload was
        invalid). One small all-reduce and one host read."""
        verdict = self._agree(self._device(), False)
        if not self._decide(verdict["nonfinite"] or self._doomed, verdict["invalid"]):
            if scaler is not None:  # what GradScaler.update does after an overflow: back off, no step
                scaler.update(scaler.get_scale() * scaler.get_backoff_factor())
            return False
        self._stepping = True  # not a step outside this decision (_optimizer_steps)
        try:
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
        finally:
            self._stepping = False
        return True

    def _device(self) -> torch.device:
        return self._bad.device if self._bad is not None else next(iter(self._params.values()))[0].device

    def _agree(self, device: torch.device, new: bool) -> Verdict:
        """Over every rank (the decision's flags): ``nonfinite``, a reduced shard since the last
        decision was not finite; ``invalid``, a received payload was invalid; ``new``, ``new``
        on some rank. One small all-reduce and one host read; the device flags stay on the
        device until then."""
        return self.decision.reduce({"nonfinite": self._bad, "invalid": self._txn.flagged(), "new": new},
                                    device=device)

    def _decide(self, bad: bool, invalid: bool) -> bool:
        """End the open decision (the same arguments on every rank): keep its compression state,
        or undo it (not finite; or a received payload failed its check on the device: then the
        same ``ValueError`` on every rank). True when kept."""
        txn, self._txn = self._txn, Transaction()
        problems = txn.problems if invalid else []  # read only when some rank flagged a payload
        keep = not (bad or invalid)
        if self._doomed:  # a micro-batch of this step was undone and counted it (_reopen): undo the rest
            txn.rollback()
        else:
            self.decision.settle(keep, txn)
        self._bad, self._doomed, self._outside = None, False, False
        self._reduced.clear()
        self._sent.clear()
        if invalid:  # the same ValueError on every rank, naming the rank that found it
            agree({}, self.span, "at compress_fsdp's step decision",
                  problem=f"compress_fsdp: {'; '.join(problems)}; the iteration was undone" if problems else None)
        return keep

    def _grads_cleared(self) -> bool:
        """Whether some module reduce-scattered since the last decision has had its gradients
        cleared (``zero_grad``): a new iteration, not the next micro-batch of this one."""
        for key in self._reduced:
            trained = [p for p in self._params[key] if p.requires_grad]
            if trained and all(p.grad is None for p in trained):
                return True
        return False

    def _reopen(self, device: torch.device) -> None:
        """An exchange starts while an earlier backward's exchanges are still undecided (the same
        call on every rank: FSDP's exchanges are). Read their finiteness over every rank now.

        - A new iteration (some rank stepped an optimizer of these parameters or cleared their
          gradients without step()): the previous iteration's decision is made now, as step()
          would have made it (kept, or undone when not finite anywhere), and a warning says once
          how to make it exact.
        - The next micro-batch of the same step (accumulation with a synced backward each): the
          decision stays open for step(); a non-finite micro-batch is undone now and step() will
          skip, so no residual ever holds a non-finite value."""
        verdict = self._agree(device, self._outside or self._grads_cleared())
        nonfinite, invalid, new = verdict["nonfinite"], verdict["invalid"], verdict["new"]
        if new or invalid:
            if new and not self._warned:
                self._warned = True
                warnings.warn(
                    "compress_fsdp: an exchange started while the previous iteration's step decision was open: an "
                    "optimizer stepped these parameters (or their gradients were cleared) without fsdp.step. The "
                    "decision was made now on every rank (its compression state undone where a reduced gradient "
                    "was not finite on some rank), but a rank that stepped on its own has stepped. Call "
                    "fsdp.step(optimizer) in place of optimizer.step() (fsdp.step(optimizer, scaler=scaler) in place "
                    "of scaler.step and scaler.update) so a non-finite step is skipped on every rank together.",
                    stacklevel=2)
            self._decide(nonfinite or self._doomed, invalid)
            return
        self._reduced.clear()
        self._bad = None  # read: finite so far, or undone below
        if nonfinite:
            if self._doomed:  # counted already, by the micro-batch that doomed the step
                self._txn.rollback()
            else:  # the step is skipped: counted now, its residuals undone
                self.decision.settle(False, self._txn)
                self._doomed = True

    # ---- checkpoints -------------------------------------------------------------------------
    def _identity(self) -> Identity:
        return Identity(owner="compress_fsdp", rank=self.rank, world=self.world * self.replicas,
                        config=fingerprint(repr(sorted((k, v) for k, v in self._config.items()
                                                       if k != "modules"))),
                        params=fingerprint(self._config["modules"]))

    def state_dict(self) -> Dict[str, Any]:
        """This rank's residuals (gradient pieces per ``piece_key(fqn, j)``, weights per FQN),
        with whose they are. Save it between steps."""
        return {"identity": self._identity().to_dict(), "skipped": self.skipped,
                "reduce_scatter": None if self.grad_codec is None else self.grad_codec.state_dict(),
                "all_gather": None if self.weight_codec is None else self.weight_codec.state_dict(),
                "replicas": None if self.replica_codec is None else self.replica_codec.state_dict()}

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
        refuse_on_every_rank(problem, self.span, "compress_fsdp.load_state_dict")
        for codec, part in ((self.grad_codec, "reduce_scatter"), (self.weight_codec, "all_gather"),
                            (self.replica_codec, "replicas")):
            if codec is not None:
                codec.load_state_dict(state[part])
        self.skipped = int(state.get("skipped", 0))
        self._txn, self._bad = Transaction(), None
        self._reduced.clear()
        self._outside = self._doomed = False
        self._sent.clear()  # the next gather compresses the loaded weights with the loaded residual
        self._layouts.clear()  # and the next exchanges are checked again
        self._replica_layouts.clear()

    def describe(self) -> str:
        """What runs on which module, one line each."""
        rs = "dense (gradcomp's mean)" if self.grad_codec is None else f"{self.grad_codec!r}, EF per piece"
        ag = "FSDP's own (exact)" if self.weight_codec is None else (
            f"{self.weight_codec!r}, EF on the weights, backward's re-gathers "
            f"{'decoded from the forward' if self.regather == 'local' else 'resent'}")
        hsdp = "" if self.replicate is None else (
            f" x {self.replicas} replicas (their all-reduce "
            f"{'dense' if self.replica_codec is None else repr(self.replica_codec) + ', EF per shard'})")
        lines = [f"compress_fsdp: {len(self.keys)} FSDP modules on {self.world} ranks{hsdp}; reduce-scatter {rs}; "
                 f"all-gather {ag}; {self.skipped} steps skipped"]
        lines += [f"  {k}: {sum(p.numel() for p in self._params[k])} parameters" for k in self.keys]
        return "\n".join(lines)


def compress_fsdp(model: torch.nn.Module, compressor: Any = "int8", *, all_gather: Any = None,
                  compressor_options: Optional[Mapping[str, Any]] = None,
                  all_gather_options: Optional[Mapping[str, Any]] = None, replicate: Any = None,
                  replicate_compressor: Any = None,
                  replicate_options: Optional[Mapping[str, Any]] = None, regather: str = "wire") -> FSDPCompression:
    """Put gradcomp's reduce-scatter (``compressor``: a name, a ``Compressor``, or None for
    dense; error feedback per piece) and, with ``all_gather`` (e.g. ``"bf16"``, ``"int8"``), a
    compressed parameter all-gather (error feedback on the weights) on every FSDP module of
    ``model`` (after ``fully_shard``). Every rank must call it; ranks that disagree on the
    configuration or the model all raise the same ``ValueError``. Step with the returned
    handle's ``step(optimizer)`` (module docstring).

    HSDP: shard with ``fully_shard(m, mesh=mesh["shard"])`` on a 2-D mesh (replicate x shard)
    and pass ``replicate=mesh``: after each reduce-scatter the shard's mean over the replicas
    (the slow links between nodes) goes through ``replicate_compressor`` (None: dense; any
    single-round compressor, error feedback per shard), in FSDP's output, before FSDP reads it.

    ``regather`` (with a compressed ``all_gather`` and ``reshard_after_forward=True``): ``"wire"``
    (default) resends the forward's payload when backward re-gathers a module; ``"local"`` keeps
    every rank's payload of the forward's gather (compressed: half the module's fp32 weights in
    bf16, a quarter in int8) until the step decision and decodes backward's re-gathers from it,
    the same bits with no bytes on the wire and no wait."""
    return FSDPCompression(model, compressor, all_gather, compressor_options, all_gather_options,
                           replicate, replicate_compressor, replicate_options, regather)


def overlap_gathers(model: torch.nn.Module, order: Optional[Sequence[torch.nn.Module]] = None) -> None:
    """Let every parameter all-gather of ``model``'s FSDP modules run beside compute, FSDP's own
    and gradcomp's compressed one alike: FSDP unshards with ``async_op=True`` (its gathers return
    a Work it waits on at copy-out; backward's prefetch of the module before is then in flight
    while this module's gradients are computed) and, in forward, each module of ``order`` (the
    FSDP modules in the order forward runs them; default: ``model``'s FSDP submodules in
    registration order, the root left out) starts the next one's gather when its own forward
    begins (``set_modules_to_forward_prefetch``). On CUDA FSDP overlaps on its streams already;
    on a CPU this is what makes a gather and compute overlap at all. Call after ``fully_shard``,
    before or after :func:`compress_fsdp`."""
    modules: List[Any] = [m for _, m in _fsdp_modules(model) if m is not model] if order is None else list(order)
    for _, m in _fsdp_modules(model):
        setter = getattr(m, "set_unshard_async_op", None) or getattr(m, "_set_unshard_async_op", None)
        if setter is None:
            raise RuntimeError(f"overlap_gathers: this torch ({torch.__version__}) has no set_unshard_async_op on "
                               f"FSDP modules")
        setter(True)
    for a, b in zip(modules, modules[1:]):
        getattr(a, "set_modules_to_forward_prefetch")([b])
