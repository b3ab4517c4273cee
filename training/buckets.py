"""``BucketLauncher``: start each bucket's exchange from backward's gradient hooks, in order.

The optimizers that exchange gradients while backward runs (``CompressedOptimizer``,
``memory.ShardedOptimizer``) cut their parameters into buckets and own one launcher. A
parameter's post-accumulate-grad hook marks it ready; when the next bucket in order has all
its gradients, the launcher starts it (``launch(b)``, the owner's, returns a future), and then
any later buckets already complete. Buckets start strictly in order whatever the timing, so
every rank issues its collectives in the same order; ``launch_rest`` starts those still waiting
(a parameter without a gradient) at ``step()``. A gradient accumulated again after its bucket
left is an error; one accumulated twice before is sent once. Under ``no_sync()`` hooks do
nothing (gradient accumulation).

The hooks hold their target weakly and the launcher holds no reference to its owner: an
optimizer that is dropped stops exchanging and is freed, and its hooks go with the launcher.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Dict, Hashable, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

Launch = Callable[[int], Any]  # starts bucket b, returns a future (``wait()`` gives its result)


class BucketLauncher:
    """The backward-hook bucket machinery of one optimizer; see the module docstring.

    ``plan(buckets, names)`` sets the buckets (each a list of member ids, hashable: a
    parameter's position, or ``(group, position)``) and each member's parameter name (for
    messages); ``watch(params, on_grad)`` hooks parameters (``on_grad(param)`` is held weakly:
    pass a bound method of the owner); the owner's ``on_grad`` calls :meth:`ready` with the
    member and its ``launch``, which is passed on each call so that the launcher keeps no
    reference to its owner.

    Use::

        self._launcher = BucketLauncher()
        self._launcher.plan(buckets, names)
        self._launcher.watch(params, self._grad_ready)

        def _grad_ready(self, param):            # the owner's hook target
            self._launcher.ready(member_of(param), self._launch)

        def _launch(self, b):                     # starts bucket b, returns its future
            ...

        # step(): launch_rest(self._launch); results, error = wait(); reset()
        # zero_grad / state_dict / load_state_dict: if drain(): undo the iteration's state
    """

    def __init__(self) -> None:
        self.buckets: List[List[Hashable]] = []
        self._bucket_of: Dict[Hashable, int] = {}
        self._names: Mapping[Hashable, str] = {}
        self._handles: List[Any] = []
        self._paused = False
        self.reset()

    # ---- set up -------------------------------------------------------------------------
    def plan(self, buckets: Sequence[Sequence[Hashable]], names: Mapping[Hashable, str]) -> None:
        """Use ``buckets`` (in launch order; ``names``: each member's parameter name) from now
        on; starts a fresh iteration."""
        self.buckets = [list(b) for b in buckets]
        self._bucket_of = {m: b for b, members in enumerate(self.buckets) for m in members}
        self._names = dict(names)
        self.reset()

    def watch(self, params: Iterable[torch.Tensor], on_grad: Callable[[torch.Tensor], None]) -> None:
        """Call ``on_grad(param)`` after each accumulation of a gradient into ``param.grad``
        (held weakly: nothing once its owner is gone)."""
        ref = weakref.WeakMethod(on_grad) if hasattr(on_grad, "__self__") else (lambda: on_grad)

        def hook(param: torch.Tensor) -> None:
            target = ref()
            if target is not None:
                target(param)

        self._handles.extend(p.register_post_accumulate_grad_hook(hook) for p in params)

    def close(self) -> None:
        """Remove the hooks (also when the launcher is freed)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __del__(self) -> None:
        self.close()

    # ---- one iteration ------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients; the next one outside exchanges them."""
        previous, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = previous

    @property
    def paused(self) -> bool:
        """Inside :meth:`no_sync`: gradient hooks do nothing."""
        return self._paused

    def reset(self) -> None:
        """A new iteration: no gradient ready, no bucket launched (futures are forgotten)."""
        self._missing = [len(b) for b in self.buckets]
        self._ready: set = set()
        self.futures: List[Optional[Any]] = [None] * len(self.buckets)
        self._next = 0

    def ready(self, member: Hashable, launch: Launch) -> None:
        """``member``'s gradient is accumulated: launch every bucket, in order, that is complete."""
        if self._paused:
            return
        b = self._bucket_of[member]
        if self.futures[b] is not None:
            raise ValueError(f"the gradient of {self._names.get(member, member)!r} was accumulated again after its bucket was "
                             f"sent; call step() between backward passes, or run the extra passes under "
                             f"`with optimizer.no_sync():`")
        if member in self._ready:  # accumulated twice before its bucket left: it is still sent once
            return
        self._ready.add(member)
        self._missing[b] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] <= 0:
            self._start(self._next, launch)

    def launch_rest(self, launch: Launch) -> None:
        """Launch, in order, every bucket not launched yet (some gradient never came)."""
        while self._next < len(self.buckets):
            self._start(self._next, launch)

    def _start(self, b: int, launch: Launch) -> None:
        self.futures[b] = launch(b)
        self._next = b + 1

    @property
    def in_flight(self) -> bool:
        """Whether some bucket of this iteration was launched."""
        return any(f is not None for f in self.futures)

    def wait(self) -> Tuple[List[Any], Optional[BaseException]]:
        """Every bucket's result (None where not launched or failed) and the first error, once all
        are done: the owner undoes state only when no exchange is still running."""
        results: List[Any] = []
        error: Optional[BaseException] = None
        for fut in self.futures:
            try:
                results.append(None if fut is None else fut.wait())
            except Exception as exc:
                results.append(None)
                error = error or exc
        return results, error

    def drain(self) -> bool:
        """Wait for the exchanges in flight, drop their results and start a new iteration; True
        when there were some (the owner then undoes their state changes)."""
        if not self.in_flight:
            return False
        self.wait()
        self.reset()
        return True
