"""The runtime shared by the DDP hook and the optimizer wrapper: route, submit, keep state.

``Runtime`` owns the policy (which gradients are compressed, with which codec), the
iteration counter that drives the warm-up, and the worker that runs bucket exchanges in
order. An iteration ends at its step decision (:meth:`Runtime.end_iteration`, settled by the
runtime's :class:`~gradcomp.training.step.StepDecision`): its state changes kept, or undone and
counted in ``skipped``. Its ``state_dict`` holds everything a resumed run needs to continue bit-identically:
the iteration and every codec's per-parameter state (residuals, warm starts, step counters).

How each bucket is sent is its **strategy**'s to say (:class:`Routing`): the runtime asks it
per bucket (``route`` on the submitting thread, ``exchange`` in the bucket's job) and per
iteration (``ended``). :class:`Routing` itself sends every gradient as the policy says;
``compressor="auto"`` (``gradcomp.training.auto``) decides per bucket from measurements.
"""
from __future__ import annotations

import fnmatch
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from gradcomp.collectives import (BucketExchange, Hierarchy, Identity, agree, choose_algorithm, describe_params, exchange_bucket,
                                  exchange_bucket_by_owners, fingerprint, key_of, make_node_groups,
                                  rank_of, refuse_on_every_rank, server_feedback, sum_counts, world_of, worker)
from gradcomp.compress.transaction import Transaction
from .policy import Policy
from .step import StepDecision, Stepping

_VERSION = 2  # 2: the identity is an Identity's dict, the parameter names beside it
#: the owner named in this state's identity (the DDP hook's and CompressedOptimizer's runtime)
OWNER = "gradcomp.training"
#: who refuses a checkpoint in the error message
WHAT = "load_state_dict of the compression state"


def build_on_every_rank(make: Callable[[], "Runtime"], group, params: Optional[Sequence[torch.Tensor]]) -> "Runtime":
    """``make()``, the runtime of the DDP hook or ``CompressedOptimizer``. A ``ValueError`` it
    raises on some ranks only (an option computed from the process rank, such as PowerSGD's
    ``rank=dist.get_rank()``) is raised on every rank alike: the failing rank joins the
    registration's agreement (:meth:`Runtime.start`, which the others run next) with its error,
    and every rank raises it there. Without a started process group it raises at once.
    ``params``: the parameters the others agree on (their device is the agreement's)."""
    try:
        return make()
    except ValueError as exc:
        if dist.is_available() and dist.is_initialized() and world_of(group) > 1:
            agree({}, group, "at registration", device=worker.device_of(list(params)) if params else None,
                  problem=str(exc))
        raise


def refuse_frozen(params: Sequence[Any], what: str) -> None:
    """``ValueError`` when no parameter requires a gradient (a frozen model: nothing to average);
    called after the registration's agreement, so that every rank raises it alike."""
    if not params:
        raise ValueError(f"{what}: no parameter requires a gradient (the model is frozen), so there is nothing to "
                         f"average; make the parameters to train require gradients before building it (torch's "
                         f"DistributedDataParallel refuses such a model too)")


class Routing:
    """A runtime's strategy (see the module docstring): fixed routing, every gradient as the
    policy says at the current iteration. A strategy that decides per bucket overrides what it
    decides; the runtime it serves is passed to every call."""

    #: whether a flat bucket's local phase may run ahead, on the worker, beside the wire time of
    #: the bucket before it (then the bucket is a ``BucketExchange`` and :meth:`exchange` is not
    #: called): false for a strategy whose :meth:`exchange` times or chooses per bucket
    prepares_ahead = True

    def route(self, runtime: "Runtime", names: Sequence[str],
              grads: Sequence[torch.Tensor]) -> List[Tuple[str, torch.Tensor, Any]]:
        """Each gradient with its codec (None: dense); on the submitting thread, in bucket order."""
        return [(n, g, runtime.policy.route(n, g, runtime.iteration)) for n, g in zip(names, grads)]

    def exchange(self, runtime: "Runtime", items: Sequence[Any], group, world: int, buffer: Optional[torch.Tensor],
                 label: str, layouts: Dict[Any, Any]) -> List[torch.Tensor]:
        """One flat bucket's exchange, inside its job (``layouts``: the runtime's agreed ones)."""
        return exchange_bucket(items, group, world, buffer=buffer, label=label, layouts=layouts)

    def ended(self, runtime: "Runtime", kept: bool) -> None:
        """After :meth:`Runtime.end_iteration` kept (``kept``) or undid the iteration."""

    def config(self, config: Dict[str, str]) -> None:
        """Add what every rank must agree on to the runtime's ``config`` (printable fields)."""

    def state_dict(self) -> Dict[str, Any]:
        """What the strategy adds to the runtime's ``state_dict`` (entries of its own)."""
        return {}

    def problem(self, state: Mapping[str, Any]) -> Optional[str]:
        """What is wrong with ``state`` for this strategy (None: it loads); nothing changes."""
        return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load what :meth:`state_dict` added (after the runtime loaded its own)."""


class Runtime(Stepping):
    """Averages named gradients over ``group`` as ``policy`` says, each bucket sent as
    ``strategy`` decides (default: :class:`Routing`, the policy's fixed routes); see the
    module docstring."""

    def __init__(self, policy: Policy, group=None, local_size: Optional[int] = None,
                 strategy: Optional[Routing] = None) -> None:
        self.strategy = strategy if strategy is not None else Routing()
        self.policy = policy
        self.group = group
        self.iteration = 0  # completed exchanges of the whole model; drives ``start_iter``
        self._worker: Optional[worker.Worker] = None
        if local_size is not None:
            if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1:
                raise ValueError(f"local_size={local_size!r} must be an int >= 1 that divides the number of ranks")
            if group is not None:
                raise ValueError("local_size (dense inside a node, compressed across nodes) works on the default "
                                 "process group only; pass process_group=None")
        self._local_size_arg = local_size
        # the ranks are counted when first needed, not here: frameworks (PyTorch Lightning)
        # create the hook before they start the process group
        self._world: Optional[int] = None
        self._local: Optional[int] = None
        self._nodes: Any = None  # NodeGroups when hierarchical
        self._txn: Optional[Transaction] = None  # the state changes of the iteration in flight
        # ends every iteration (end_iteration); its counter, skipped: iterations undone
        self.decision = StepDecision(group, OWNER)
        self._checked: set = set()  # bucket layouts every rank has agreed on
        # their exchanges skip the header once checked (allreduce_fused's layouts=)
        self._layouts: Dict[Any, Any] = {}
        self._warned: set = set()  # layers patterns already warned about
        self._registered = False  # start() checked the configuration
        self.names: List[str] = []  # the parameter names, when the caller knows them (identity of a checkpoint)
        self._owners: Dict[str, int] = {}  # parameter name -> the local rank that sends it across nodes
        self._loads: List[int] = []  # elements owned per local rank (sized when the ranks are counted)
        # the parameters to check at registration when start() runs later than the hook's creation
        self.deferred: Optional[Sequence[Tuple[str, torch.Tensor]]] = None
        codec = policy.default.codec
        self.label = codec.base.name if codec is codec.base else f"{codec.kind}+{codec.base.name}"

    def _resolve(self) -> None:
        world = world_of(self.group)
        local = self._local_size_arg
        if local is not None and world % local:
            raise ValueError(f"local_size={local!r} must be an int >= 1 that divides the number of ranks ({world})")
        self._world = world
        # ranks per node for the hierarchical exchange (None: flat); one node of one rank is flat
        self._local = local if local is not None and world > 1 else None
        self._loads = [0] * (self._local or 1)

    @property
    def world(self) -> int:
        """The number of ranks (counted at first use)."""
        if self._world is None:
            self._resolve()
        assert self._world is not None
        return self._world

    @property
    def local_size(self) -> Optional[int]:
        """Ranks per node for the hierarchical exchange; None when flat."""
        if self._world is None:
            self._resolve()
        return self._local

    @property
    def exchange_world(self) -> int:
        """The ranks a compressed exchange spans: one per node when hierarchical."""
        return self.world // self.local_size if self.local_size else self.world

    def start(self, params: Optional[Sequence[Tuple[str, torch.Tensor]]] = None) -> None:
        """Check that every rank has the same configuration (and ``params``: names, shapes and
        dtypes, when known), then create the worker (and its twin group, and the node groups
        when hierarchical); every rank must call this at the same point."""
        if params is None:
            params = self.deferred
        if not self._registered:
            self._registered = True
            self.check(params, "at registration")
        if self.world > 1 and self._worker is None:
            groups = (self.group,)
            if self.local_size is not None:
                self._nodes = make_node_groups(self.local_size)
                groups = (self.group, self._nodes.intra, self._nodes.inter)
            # the collectives' worker for these groups: training buckets and async calls share its order
            self._worker = worker.worker_for(groups)

    @property
    def started(self) -> bool:
        """Whether :meth:`start` ran (it checks agreement and creates the worker once)."""
        return self._registered

    def check(self, params: Optional[Sequence[Tuple[str, torch.Tensor]]], when: str) -> None:
        """``ValueError`` on every rank unless all agree on the configuration and ``params``."""
        if params is not None:
            self.warn_unmatched([n for n, _ in params])
        if self.world > 1:
            agree(self._config(params), self.group, when, device=worker.device_of(params) if params else None)

    def warn_unmatched(self, names: Sequence[str]) -> None:
        """A warning for each ``layers`` pattern that matches none of ``names`` (a typo would send
        those parameters with the default rule, silently otherwise); local, needs no group, and
        said once per pattern."""
        for rule in self.policy.rules:
            if rule.pattern not in self._warned and not any(fnmatch.fnmatchcase(n, rule.pattern) for n in names):
                self._warned.add(rule.pattern)
                warnings.warn(f"layers pattern {rule.pattern!r} matches no parameter of the model (e.g. "
                              f"{names[0] if names else 'none'!r}); check the pattern", stacklevel=3)

    def _config(self, params: Optional[Sequence[Tuple[str, torch.Tensor]]] = None) -> Dict[str, str]:
        """What every rank must agree on, as printable fields (see :func:`agree`)."""
        config = {"compressor and policy": self.policy.describe(),
                  "policy settings": repr([(r.pattern, r.start_iter, r.min_compression_rate, r.min_numel,
                                            r.compress_1d) for r in [*self.policy.rules, self.policy.default]]),
                  "ranks per node (local_size)": repr(self.local_size),
                  "iteration": repr(self.iteration)}
        if params is not None:
            config["parameters"] = describe_params(params)
        self.strategy.config(config)
        return config

    def _check_bucket(self, items: Sequence[Any], group) -> None:
        """The first time this rank sees a bucket layout (names, shapes, dtypes, routes), every
        rank checks that it agrees, with the codecs' step counters of its gradients: a cheap
        exchange when DDP builds or rebuilds its buckets, none in the steady state. Called
        inside the bucket's job, so it is ordered with the exchanges."""
        signature = tuple((n, tuple(g.shape), g.dtype, id(c)) for n, g, c in items)
        if signature in self._checked:
            return
        self._checked.add(signature)
        if self.world == 1:
            return
        # hierarchical: a gradient's codec state lives on its owner only, so counters differ
        steps = [] if self.local_size else [(n, c.base.step_count(n)) for n, _, c in items if c is not None]
        agree({"bucket": describe_params([(n, g) for n, g, _ in items]),
               "routes (compressed or dense) at this iteration": repr([c is not None for _, _, c in items]),
               "iteration": repr(self.iteration), "step counters": repr(steps)},
              group, "when a bucket layout was first seen", device=worker.device_of([g for _, g, _ in items]))

    def submit(self, names: Sequence[str], grads: Sequence[torch.Tensor], *,
               buffer: Optional[torch.Tensor] = None, then: Optional[Callable] = None,
               advance: bool = False, inline: bool = False, tally: Optional[torch.Tensor] = None
               ) -> torch.futures.Future:
        """A future of the mean of every gradient (a list in order; chained with ``.then(then)``),
        sent as the policy says at the current iteration. ``advance``: this is the iteration's
        last bucket; once it is done the iteration ends (:meth:`end_iteration`).
        ``buffer``: see :func:`gradcomp.collectives.bucket.exchange_bucket`; ``inline``: see
        :meth:`gradcomp.collectives.worker.Worker.submit`. ``tally``: a small int tensor summed
        over the ranks after the bucket (``sum_counts``), in its job; the list then ends with
        the sum."""
        items = self.route(names, grads)
        world, label = self.world, self.label
        if world > 1:
            self.start()
        nodes, local_size = self._nodes, self.local_size
        owners = self._own(names, grads) if nodes is not None else None
        if self._txn is None:  # the iteration's first bucket
            self._txn = Transaction()
        txn = self._txn

        # a flat bucket of a layout every rank agreed on is an exchange object, so that the worker
        # may run its local phase ahead, while the bucket before it is on the wire
        bucket = BucketExchange(items, self._worker.twin(self.group), world, buffer=buffer, label=label,
                                layouts=self._layouts, txn=txn) \
            if nodes is None and self._ahead_ok(items) and self._worker is not None else None

        def job(twin, beside):
            group = twin(self.group)
            with txn.active():  # every state change of the iteration, kept or undone together
                try:
                    self._check_bucket(items, group)
                    if nodes is not None:
                        hier = Hierarchy(twin(nodes.intra), twin(nodes.inter), local_size, nodes.local_rank,
                                         world // local_size)
                        out = exchange_bucket_by_owners(items, hier, owners, label=label)
                    elif bucket is not None:  # its local phase raises here if it failed ahead
                        bucket.prepare()
                        out = bucket.finish(bucket.start(beside))
                    else:
                        out = self.exchange(items, group, world, buffer, label)
                    if tally is not None:
                        out = [*out, sum_counts(tally, group, world, label)]
                    # both exchanges tell txn whether every mean is finite (its cheapest witnesses)
                except BaseException:
                    txn.failed = True
                    if advance:
                        self.end_iteration()
                    raise
            if advance:
                self.end_iteration()
            return out

        # the gradients' device, never the thread's: a worker thread's current device is GPU 0
        device = worker.device_of(buffer, grads)
        if world == 1:
            return worker.completed(lambda twin: job(twin, None), then, twin=lambda g: None, device=device)
        assert self._worker is not None
        inputs = [buffer, *grads] if buffer is not None else list(grads)  # made on the caller's stream
        inputs += [tally] if tally is not None else []
        return self._worker.submit(job, device=device, then=then, inline=inline, inputs=inputs, exchange=bucket,
                                   beside=True)

    @property
    def prepares_ahead(self) -> bool:
        """Whether a flat bucket's local phase may run ahead (the strategy's
        ``Routing.prepares_ahead``; set it here to turn the look-ahead off)."""
        return self.strategy.prepares_ahead

    @prepares_ahead.setter
    def prepares_ahead(self, value: bool) -> None:
        self.strategy.prepares_ahead = bool(value)

    def _ahead_ok(self, items: Sequence[Any]) -> bool:
        """Whether a bucket's local phase may run ahead (:attr:`prepares_ahead`): a flat exchange
        of a layout every rank has already agreed on, over more than one rank."""
        if not self.prepares_ahead or self.world == 1:
            return False
        return tuple((n, tuple(g.shape), g.dtype, id(c)) for n, g, c in items) in self._checked

    def route(self, names: Sequence[str], grads: Sequence[torch.Tensor]) -> List[Tuple[str, torch.Tensor, Any]]:
        """Each gradient with its codec (None: dense) at the current iteration, as the strategy
        says; called on the submitting thread, in bucket order (``compressor="auto"``
        decides here)."""
        return self.strategy.route(self, names, grads)

    def exchange(self, items: Sequence[Any], group, world: int, buffer: Optional[torch.Tensor],
                 label: str) -> List[torch.Tensor]:
        """One flat bucket's exchange, inside its job, as the strategy says
        (``compressor="auto"`` times it here)."""
        return self.strategy.exchange(self, items, group, world, buffer, label, self._layouts)

    @property
    def in_iteration(self) -> bool:
        """Whether an iteration is in flight: a bucket was submitted since it last ended."""
        return self._txn is not None

    def _identity(self) -> Identity:
        """Whose state this is: rank, world size and a configuration fingerprint (a checkpoint
        must be loaded by the same rank of the same job); the parameter names travel beside it."""
        config = self._config()
        fields = ("compressor and policy", "policy settings", "ranks per node (local_size)")  # not the iteration
        return Identity(owner=OWNER, rank=rank_of(self.group), world=self.world,
                        config=fingerprint("\n".join(config[f] for f in fields)))

    def _problem(self, state: Any) -> Optional[str]:
        """What is wrong with ``state`` for this rank (None: it loads); nothing changes."""
        if state is None:
            return ("it holds no gradcomp state (a plain optimizer's state_dict?); to start the compression state "
                    "afresh, load it into the inner optimizer on every rank (opt.optimizer.load_state_dict)")
        if not isinstance(state, Mapping) or state.get("version") != _VERSION:
            return f"it is not a gradcomp training state_dict of version {_VERSION}"
        problem = self._identity().mismatch(state.get("identity"), fixes={
            "world": "error-feedback residuals belong to one rank of one world size: resume on the world size it "
                     "was saved on (or start the compression state afresh)",
            "config": f"resume with the same compressor, options and policy (this run's: {self.policy.describe()})"})
        if problem:
            return problem
        saved, mine = list(state.get("names") or []), sorted(self.names)
        if not mine and saved and not all(n.startswith("param") for n in saved):
            return ("it was saved with model= (its state is kept under parameter names such as "
                    f"{saved[0]!r}); pass the same model= to resume it")
        if mine and saved and saved != mine:
            a, b = set(saved), set(mine)
            diff = sorted(a - b)[:3] + sorted(b - a)[:3]
            hint = (" (it was saved without model=, which names parameters param0, param1, ...; pass the same "
                    "model= as when it was saved)" if any(n.startswith("param") for n in a ^ b) else "")
            return (f"it holds the compression state of other parameters (e.g. {diff}){hint}; load it into the "
                    f"model it was saved with")
        extra = set(state.get("servers") or {}) - set(self._servers())
        if extra:
            return f"it holds scatter-reduce state for codecs {sorted(extra)} that this run does not have; resume " \
                   f"with the same policy"
        owners, loads = state.get("owners"), state.get("owner_loads")
        if self.local_size is None and owners is not None:
            return "it was saved with local_size (hierarchical exchange); pass the same local_size"
        if self.local_size is not None and (
                not isinstance(owners, Mapping) or not isinstance(loads, (list, tuple))
                or len(loads) != self.local_size
                or any(not isinstance(o, int) or not 0 <= o < self.local_size for o in owners.values())):
            return (f"it holds no gradient owners for {self.local_size} ranks per node; resume with the "
                    f"local_size it was saved with")
        return self.strategy.problem(state)

    def end_iteration(self, keep: bool = True) -> bool:
        """End the iteration whose buckets were submitted: keep its state changes and count it
        when every bucket completed with finite means (and ``keep``), else undo all of them on
        every bucket and leave the iteration as it was — the step a loss scaler skips, or one
        whose exchange failed, is as if it never happened (counted in :attr:`skipped`). The
        means are the same on every rank, so the verdict is too: the step decision settles it
        without a reduction. Call it when no exchange of the iteration is running. True when
        kept. Then the strategy's ``ended``."""
        kept = self._settle(keep)
        self.strategy.ended(self, kept)
        return kept

    def _settle(self, keep: bool) -> bool:
        """:meth:`end_iteration` without the strategy's part."""
        txn, self._txn = self._txn, None
        if txn is None:
            return keep
        problems = [] if txn.failed else txn.problems  # with finiteness: the iteration's one host read
        if self.decision.settle(keep and not problems and txn.finite and not txn.failed, txn):
            self.iteration += 1
            return True
        if problems:  # a received payload was invalid (checked on the device, read here)
            raise ValueError(f"{self.label}: the iteration was undone: " + "; ".join(problems))
        return False

    def unused_everywhere(self, counts: torch.Tensor, absent: Mapping[int, str]) -> Set[int]:
        """Of ``absent`` (position in ``counts`` -> name of a parameter this rank sent as zeros
        this iteration, having no gradient for it), those that no rank had a gradient for
        (``counts``: per position, the number of ranks that had one, from a ``tally`` sent with
        the iteration's last bucket). Decided at the iteration's one host read
        (:meth:`end_iteration`, which fills the returned set then) and, for those, every state
        change of the iteration kept under their names (residuals, warm starts, step counters,
        scatter-reduce's chunks) is undone: what they owed stays owed, as if they had not been
        sent. Call it between the last bucket's completion and :meth:`end_iteration`."""
        found: Set[int] = set()
        txn = self._txn
        if txn is None or not absent:
            return found

        def receive(values: List[int]) -> None:
            found.update(i for i in absent if values[i] == 0)
            names = {absent[i] for i in found}
            if names:
                txn.rollback_keys(lambda key: isinstance(key, str) and key_of(key) in names)

        txn.read_with(counts, receive)
        return found

    def _own(self, names: Sequence[str], grads: Sequence[torch.Tensor]) -> List[int]:
        """The owner (local rank) of each gradient, fixed the first time its name is seen: the
        largest new gradients first, each to the least loaded local rank (ties to the lowest).
        Every rank submits the same names in the same order, so every node agrees, and the
        owner never changes, so the error feedback kept on it is never stranded (a DDP bucket
        rebuild moves gradients between buckets, not between owners)."""
        new = sorted((-g.numel(), pos, n) for pos, (n, g) in enumerate(zip(names, grads)) if n not in self._owners)
        for negative, _, name in new:
            numel = -negative
            owner = min(range(len(self._loads)), key=lambda r: (self._loads[r], r))
            self._owners[name] = owner
            self._loads[owner] += numel
        return [self._owners[n] for n in names]

    def compressed(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (parameter ``name``) is compressed at the current iteration."""
        return self.policy.route(name, tensor, self.iteration) is not None

    def _servers(self) -> Dict[str, Any]:
        """Scatter-reduce's second error feedback (more than two ranks), per codec pattern:
        the collectives keep it with the codec, and a resumed run needs it too."""
        out = {}
        for pattern, codec in self.policy.codecs().items():
            if codec is not codec.base and choose_algorithm(codec, self.exchange_world) == "scatter-reduce":
                out[pattern] = server_feedback(codec)
        return out

    def state_dict(self) -> Dict[str, Any]:
        """Iteration and every codec's state (CPU tensors); call it when no exchange is running."""
        # each codec's error feedback holds its scatter-reduce server part too (one owner)
        state = {"version": _VERSION, "iteration": self.iteration, "codecs": self.policy.state_dict(),
                 "identity": self._identity().to_dict(), "names": sorted(self.names)}
        if self.local_size is not None:  # which rank of a node holds which gradient's state
            state["owners"] = dict(self._owners)
            state["owner_loads"] = list(self._loads)
        state.update(self.strategy.state_dict())
        return state

    def load_state_dict(self, state: Mapping[str, Any], what: str = WHAT) -> None:
        """Load :meth:`state_dict` on every rank at the same point: when any rank's ``state``
        does not fit (another rank, world size, model or configuration), every rank raises the
        same ``ValueError`` (naming ``what``) and nothing changes."""
        refuse_on_every_rank(self._problem(state), self.group, what)
        self.end_iteration(keep=False)  # an iteration left unfinished is not part of the state
        self._checked.clear()  # the next bucket checks the loaded step counters on every rank
        self._layouts.clear()  # and its first exchange checks the layout again
        self.policy.load_state_dict(state["codecs"])
        servers, saved = self._servers(), state.get("servers", {})
        for pattern, server in servers.items():
            if pattern in saved:  # a state saved when the server parts were kept beside the codecs
                server.load_state_dict(saved[pattern])
        if self.local_size is not None:
            owners, loads = state["owners"], state["owner_loads"]
            self._owners = {str(n): int(o) for n, o in owners.items()}
            self._loads = [int(v) for v in loads]
        self.iteration = int(state["iteration"])
        self.strategy.load_state_dict(state)
