"""Error feedback: compression error is remembered and added back at the next step.

``ErrorFeedback(c)`` is residual error feedback (EF-SGD, Karimireddy et al. 2019)::

    acc = g + residual[key];  payload = c.compress(acc);  residual[key] = acc - decompress(payload)

so ``g + old_residual == decompress(payload) + new_residual`` at every step: no gradient mass
is lost, only delayed. Residuals are fp32 (fp64 for fp64 gradients) even for fp16/bf16 input.

``EF21(c)`` (Richtarik et al. 2021) compresses the change of a per-key gradient estimate; the
receivers keep the aggregate estimate, so a collective finishes with :meth:`EF21.combine`.

Both are accepted wherever a compressor is: they expose the wrapped compressor's
``capabilities`` (never ``unbiased``) and ``decompress``.
"""
from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import Any, Dict, Optional, Protocol, Tuple, runtime_checkable

import torch

from gradcomp.kernels.memory import empty

from .base import Capabilities, Compressor, Rounds, _ReadsCapabilities, work_dtype
from .identity import Identity, fingerprint
from .payload import Payload
from .registry import compressor_class
from . import transaction
from .transaction import replace, writable


def _as_compressor(compressor: Any) -> Compressor:
    if isinstance(compressor, str):
        return compressor_class(compressor)()
    if isinstance(compressor, _Feedback):
        raise ValueError("error feedback cannot wrap another error feedback; wrap the compressor once")
    if not isinstance(compressor, Compressor):
        raise ValueError(f"expected a compressor or its name, got {type(compressor).__name__}")
    return compressor


# what the default key (no ``key=``) last saw, per state owner (see check_default_key)
_last_default: "weakref.WeakKeyDictionary[Any, weakref.ref]" = weakref.WeakKeyDictionary()
_warned: "weakref.WeakSet[Any]" = weakref.WeakSet()


def check_default_key(owner: Any, tensor: Any, where: str) -> None:
    """Warn once per ``owner`` (a wrapper or a stateful compressor) when its default key sees a
    tensor while another one, still alive at another address, was the last it saw: the two
    share one residual (or warm start). A tensor made anew each step, the old one gone, is not
    warned about; costs one weak reference per call without ``key``."""
    if not isinstance(tensor, torch.Tensor):
        return
    try:
        ref = _last_default.get(owner)
        _last_default[owner] = weakref.ref(tensor)
    except TypeError:  # an owner that takes no weak reference: nothing to compare with
        return
    prev = ref() if ref is not None else None
    if prev is None or prev is tensor or owner in _warned or (
            prev.numel() and tensor.numel() and prev.data_ptr() == tensor.data_ptr()):
        return
    _warned.add(owner)
    warnings.warn(f"{where}: two tensors were passed without key= to {owner!r}, which keeps state per key, "
                  f"so they share one residual or warm start; pass key= naming each tensor", stacklevel=3)


def _identity(kind: str, config: str) -> Identity:
    """This process's rank and world size (of the default group) and ``config``'s fingerprint.
    A wrapper is one process's object and cannot ask the other ranks: its ``load_state_dict``
    raises here only; the layers above it (the training runtime, the optimizers, the pipeline)
    check their checkpoints on every rank first (:func:`gradcomp.collectives.refuse_on_every_rank`)."""
    import torch.distributed as dist

    live = dist.is_available() and dist.is_initialized()
    return Identity(owner=kind, rank=dist.get_rank() if live else 0, world=dist.get_world_size() if live else 1,
                    config=fingerprint(config))


def to_finite(acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``acc`` (a residual-corrected sum, fp32 or fp64) cast to the gradient's ``dtype``, with
    every finite value that the cast would round to infinity saturated to ``dtype``'s largest
    finite value of its sign instead: compressed from there, the excess stays in the residual
    (``acc - decoded``), so finite input never sends inf and no mass is lost. Non-finite values
    stay as they are. One read-only check of the cast tensor on the common path."""
    src = acc.to(dtype)
    if src.dtype.is_floating_point and src.dtype.itemsize < acc.dtype.itemsize and src.numel() \
            and not bool(torch.isfinite(src.sum())):
        over = torch.isinf(src) & torch.isfinite(acc)
        if bool(over.any()):
            top = torch.finfo(dtype).max
            src = torch.where(over, torch.where(acc > 0, top, -top).to(dtype), src)
    return src


@runtime_checkable
class Feedback(Protocol):
    """What the collectives need of an error-feedback wrapper (``ErrorFeedback``, ``EF21``,
    ``DGCMomentum``, or an adapter such as a bucket's per-name view): the protocol of
    ``gradcomp.collectives``' ``reduce``::

        acc = fb.accumulate(tensor, key)     # what is compressed (a new tensor)
        ... the algorithm compresses acc, sends, decodes what this rank sent ...
        fb.update(key, acc, sent)            # remember what the wire did not carry
        result = fb.combine(key, average)    # the collective's result

    or, when ``keeps_residual_in_place(tensor)``, ``accumulate_in_place`` returns the state
    buffer itself for ``compress_residual`` to leave the new residual in, and ``update`` is
    skipped."""

    compressor: Compressor
    kind: str

    def accumulate(self, tensor: torch.Tensor, key: Optional[str]) -> torch.Tensor: ...

    def update(self, key: Optional[str], acc: torch.Tensor, sent: torch.Tensor) -> None: ...

    def combine(self, key: Optional[str], averaged: torch.Tensor) -> torch.Tensor: ...

    def keeps_residual_in_place(self, tensor: torch.Tensor) -> bool: ...

    def accumulate_in_place(self, tensor: torch.Tensor, key: Optional[str]) -> torch.Tensor: ...


class _Feedback(_ReadsCapabilities):
    """What both feedback kinds share: a wrapped compressor and fp32 state per key."""

    kind = "?"

    def __init__(self, compressor: Compressor | str, *, _server: bool = True) -> None:
        self.compressor = _as_compressor(compressor)
        # the wrapped compressor's, so collectives treat us like it; feedback makes the sent
        # value depend on the past, so never unbiased (config is frozen: computed once)
        self._capabilities = dataclasses.replace(self.compressor.capabilities, unbiased=False)
        self._state: Dict[str, torch.Tensor] = {}
        # the other buffer of each key inside a transaction (see gradcomp.compress.transaction)
        self._spares: Dict[str, torch.Tensor] = {}
        # the residuals of the second compression of scatter-reduce (see server); a server part
        # has none of its own, and notes where each of its residuals sits (see place)
        self._server: Optional[ErrorFeedback] = ErrorFeedback(self.compressor, _server=False) if _server else None
        self._layouts: Dict[str, Dict[str, Tuple[int, int, int]]] = {}

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    @property
    def base(self) -> Compressor:
        """The compressor inside, which encodes and decodes."""
        return self.compressor

    @property
    def name(self) -> str:
        return self.compressor.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.compressor!r})"

    def decompress(self, payload: Payload) -> torch.Tensor:
        return self.compressor.decompress(payload)

    @property
    def server(self) -> "ErrorFeedback":
        """The error feedback of scatter-reduce's second compression, owned by this wrapper: on
        more than two ranks each rank averages one chunk of every tensor and compresses the
        average again, keeping that compression's error here, per server key
        (``{key}/chunk{rank}/server``). Saved and loaded with its own ``state_dict``."""
        if self._server is None:
            raise ValueError(f"{self.kind}: a server part keeps no server part of its own")
        return self._server

    def place(self, key: str, part: str, numel: int, world: int, index: int) -> None:
        """Note that this server part's residual ``part`` belongs to ``key``: chunk ``index`` of
        the ``world`` chunks (``torch.tensor_split``) of the ``numel`` elements exchanged under
        ``key``, which ``owed``/``take`` of the wrapper owning this part read."""
        where = self._layouts.setdefault(key, {})
        if where.get(part) != (numel, world, index):
            where[part] = (numel, world, index)

    def _server_parts(self, key: str) -> Dict[str, Tuple[int, int, int]]:
        """``{server key: (numel, world, index)}`` of the server residuals held for ``key``."""
        if self._server is None:
            return {}
        held = self._server._state
        return {part: where for part, where in self._server._layouts.get(key, {}).items() if part in held}

    def bits_per_element(self, numel: int = 1 << 20) -> float:
        return self.compressor.bits_per_element(numel)

    def _slot(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        wd = work_dtype(tensor.dtype)
        buf = self._state.get(key)
        if buf is None or buf.shape != tensor.shape or buf.device != tensor.device:
            if buf is not None and buf.numel() != tensor.numel():
                raise ValueError(f"{self.kind}: key {key!r} held a tensor of shape {tuple(buf.shape)}, "
                                 f"now {tuple(tensor.shape)}; use a distinct key per tensor")
            if buf is None:  # numpy-backed: its first touch costs a quarter of a torch.zeros
                buf = empty(tensor.numel(), wd, tensor.device).zero_().view(tensor.shape)
            else:  # a copy: the old buffer may have to be restored (a transaction's rollback)
                buf = buf.reshape(tensor.shape).to(tensor.device, copy=True)
            self._set(key, buf)
        elif buf.dtype != wd:
            buf = self._set(key, buf.to(wd))
        return buf

    def _set(self, key: str, buf: torch.Tensor) -> torch.Tensor:
        """Make ``buf`` (a new tensor) the state of ``key``; an open transaction remembers the old."""
        replace(self._state, key, self._spares)
        self._state[key] = buf
        return buf

    def _writable(self, key: str) -> torch.Tensor:
        """The state of ``key`` about to be overwritten whole (see
        :func:`gradcomp.compress.transaction.writable`)."""
        return writable(self._state, key, self._spares)

    def state_dict(self) -> Dict[str, Any]:
        """The state per key, with whose it is: this process's rank and world size and the
        configuration (residuals belong to one rank of one job), and the server part's (see
        :attr:`server`; under ``"server"``, with ``"layouts"``, see :meth:`place`): everything
        this wrapper owes, in one state. Resharding folds the server part into the residuals."""
        sd = {"kind": self.kind, "compressor": self.compressor.state_dict(),
              "state": {k: v.detach().cpu().clone() for k, v in self._state.items()},
              "identity": _identity(self.kind, repr(self)).to_dict()}
        if self._server is None:
            sd["layouts"] = {k: {p: list(w) for p, w in where.items()} for k, where in self._layouts.items()}
        else:
            sd["server"] = self._server.state_dict()
        return sd

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(f"state_dict is for {state.get('kind')!r}, not {self.kind!r}")
        saved = state.get("identity")
        problem = None if saved is None else _identity(self.kind, repr(self)).mismatch(saved, fixes={
            "world": "residuals belong to one rank of one world size: load each rank's own state_dict",
            "config": f"residuals belong to one configuration: load it into the one it was saved with "
                      f"(this one: {self!r})"})
        if problem:  # this rank only: see _identity
            raise ValueError(f"{self.kind}: {problem}")
        if self._server is not None and state.get("server") is not None:
            self._server.load_state_dict(state["server"])  # checked before anything of this one loads
        self.compressor.load_state_dict(state["compressor"])
        self._state = {k: v.clone() for k, v in state["state"].items()}
        self._spares = {}
        if self._server is None:  # where the residuals sit: known again at the next exchange when not saved
            self._layouts = {k: {p: (int(w[0]), int(w[1]), int(w[2])) for p, w in where.items()}
                             for k, where in state.get("layouts", {}).items()}

    def _send(self, acc: torch.Tensor, dtype: torch.dtype, key: Optional[str],
              step: Optional[int]) -> Tuple[Payload, torch.Tensor]:
        """Compress ``acc`` as a tensor of the gradient's ``dtype``: the payload is exactly what
        the compressor sends without feedback, and the cast's rounding lands in the memory."""
        src = acc if acc.dtype == dtype else to_finite(acc, dtype)
        return self.compressor.compress_decoded(src, key, step=step)

    def combine(self, key: Optional[str], averaged: torch.Tensor) -> torch.Tensor:
        """Turn the average of decoded payloads into the collective's result."""
        return averaged

    def keeps_residual_in_place(self, tensor: torch.Tensor) -> bool:
        """Whether a step on ``tensor`` may use :meth:`accumulate_in_place` (residual error
        feedback only; see ``ErrorFeedback``)."""
        return False

    def accumulate_in_place(self, tensor: torch.Tensor, key: Optional[str]) -> torch.Tensor:
        raise ValueError(f"{self.kind}: keeps no residual in place; use accumulate and update")

    def compress(self, tensor: torch.Tensor, key: Optional[str] = None, *, step: Optional[int] = None) -> Payload:
        """Compress ``tensor`` with this feedback; updates the state of ``key``. A step that
        does not leave that state finite (a non-finite input or decoding) changes nothing: the
        payload still says so, the state stays as it was (see
        :mod:`gradcomp.compress.transaction`)."""
        if key is None:
            check_default_key(self, tensor, f"{type(self).__name__}.compress")
        with transaction.step() as st:
            payload = self._compress_step(tensor, key, step)
            # the new state is finite exactly when the accumulated input and its decoding are
            st.observe(self._state.get("" if key is None else str(key)))
        return payload

    def _compress_step(self, tensor: torch.Tensor, key: Optional[str], step: Optional[int]) -> Payload:
        raise NotImplementedError


def is_feedback(obj: Any) -> bool:
    """``isinstance(obj, Feedback)``, at once for gradcomp's own wrappers: a runtime-checkable
    protocol's ``isinstance`` inspects every member (~30 us), which the collectives would pay
    per tensor on the hot path."""
    return isinstance(obj, _Feedback) or isinstance(obj, Feedback)


class ErrorFeedback(_Feedback):
    """Residual error feedback around any compressor; residual memory kept per key."""

    kind = "ef"

    def residual(self, key: Optional[str] = None) -> torch.Tensor:
        """The current residual of ``key`` (a scalar zero before its first step)."""
        buf = self._state.get("" if key is None else str(key))
        return buf.clone() if buf is not None else torch.zeros(())

    def owed(self, key: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
        """What this wrapper owes ``key`` (None when nothing): its residual plus, where
        scatter-reduce ran over ``w`` ranks, ``w`` times the server residual of the chunk this
        rank averaged, at that chunk's place (the average's error, owed to the sum), in the
        residual's shape (flat when only a server part is held) and dtype, or summed in
        ``dtype``. With the averages sent it closes the error-feedback invariant: over the
        ranks, ``sum(inputs) == w * sum(averages) + sum(owed)``. Changes nothing."""
        skey = "" if key is None else str(key)
        res = self._state.get(skey)
        total = None if res is None else res.to(dtype or res.dtype, copy=True)
        for part, (numel, world, index) in self._server_parts(skey).items():
            sres = self.server._state[part]
            flat = torch.zeros(numel, dtype=dtype or sres.dtype, device=sres.device)
            flat.tensor_split(world)[index].add_(sres.reshape(-1).to(flat.dtype), alpha=world)
            total = flat if total is None else total + flat.view(total.shape)
        return total

    def take(self, key: Optional[str] = None) -> Optional[torch.Tensor]:
        """Remove and return what this wrapper owes ``key`` (:meth:`owed`; None when nothing):
        its residual and its server residuals become zero (an open transaction can restore
        them)."""
        skey = "" if key is None else str(key)
        owed = self.owed(skey)
        res = self._state.get(skey)
        if res is not None:
            self.update(skey, res, res)  # residual := 0
        for part in self._server_parts(skey):
            sres = self.server._state[part]
            self.server.update(part, sres, sres)
        return owed

    def accumulate(self, tensor: torch.Tensor, key: Optional[str]) -> torch.Tensor:
        """``tensor + residual`` in the residual's dtype (a new tensor)."""
        self.compressor._check_input(tensor)
        res = self._slot("" if key is None else str(key), tensor)
        acc = empty(res.numel(), res.dtype, res.device).view(res.shape)
        return torch.add(res, tensor.detach(), out=acc)

    def update(self, key: Optional[str], acc: torch.Tensor, sent: torch.Tensor) -> None:
        """Set the residual of ``key`` to ``acc - sent`` (``sent``: what the wire carried)."""
        skey = "" if key is None else str(key)
        self._slot(skey, acc)
        torch.sub(acc, sent.to(work_dtype(acc.dtype)), out=self._writable(skey))

    def keeps_residual_in_place(self, tensor: torch.Tensor) -> bool:
        """Whether the residual of a step on ``tensor`` can be kept in place: the compressor
        :attr:`~Compressor.compresses_in_place` and ``tensor`` already has the residual's dtype,
        so no cast separates what is compressed from what is remembered."""
        return self.compressor.compresses_in_place and tensor.dtype == work_dtype(tensor.dtype)

    def accumulate_in_place(self, tensor: torch.Tensor, key: Optional[str]) -> torch.Tensor:
        """Add ``tensor`` to the residual of ``key`` and return the residual itself: compress it
        with ``compressor.compress_residual`` (whole or in pieces), which leaves the new
        residual there. Only when :meth:`keeps_residual_in_place` says so."""
        buf, res = self.in_place_sum(tensor, key)
        # the same bits and passes as res.add_(tensor); inside a transaction into the other buffer
        return torch.add(res, tensor.detach(), out=buf)

    def in_place_sum(self, tensor: torch.Tensor, key: Optional[str]) -> Tuple[torch.Tensor, torch.Tensor]:
        """:meth:`accumulate_in_place` with the sum left to the caller: ``(buf, res)``, where
        ``buf`` is to hold ``res + tensor`` (``res``, the residual of ``key``, itself outside a
        transaction) — for ``compressor.compress_residual(buf, key, sum_of=(res, tensor))``,
        which adds inside its first pass."""
        self.compressor._check_input(tensor)
        if not self.keeps_residual_in_place(tensor):
            raise ValueError(f"ef: {self.compressor.name} on a {tensor.dtype} tensor cannot update its residual in "
                             f"place; use accumulate and update")
        skey = "" if key is None else str(key)
        res = self._slot(skey, tensor)
        if not res.is_contiguous():  # e.g. loaded from a state_dict; the compressor needs it flat
            res = self._set(skey, res.contiguous())
        return self._writable(skey), res

    def _compress_step(self, tensor: torch.Tensor, key: Optional[str], step: Optional[int]) -> Payload:
        """Compress ``tensor + residual``; the residual becomes the new compression error."""
        if isinstance(tensor, torch.Tensor) and self.keeps_residual_in_place(tensor):
            buf, res = self.in_place_sum(tensor, key)
            return self.compressor.compress_residual(buf, key, step=step, sum_of=(res, tensor.detach()))
        acc = self.accumulate(tensor, key)
        payload, decoded = self._send(acc, tensor.dtype, key, step)
        self.update(key, acc, decoded)
        return payload

    def rounds(self, tensor: torch.Tensor, key: Optional[str] = None, *,
               out: Optional[torch.Tensor] = None) -> Rounds:
        """Multi-round form (PowerSGD): the residual is ``acc`` minus the agreed result.

        When the gradient already has the residual's dtype, ``acc`` is the residual buffer
        itself and the update happens in place (no allocation, one pass fewer). ``out``: see
        ``Compressor.rounds`` (may be ``tensor``: it is added into the residual first)."""
        self.compressor._check_input(tensor)
        skey = "" if key is None else str(key)
        res = self._slot(skey, tensor)
        if tensor.dtype == res.dtype and res.is_contiguous():
            acc = torch.add(res, tensor.detach(), out=self._writable(skey))  # = res.add_(tensor)
            result = yield from self.compressor.rounds(acc, key, out=out)
            acc.sub_(result.reshape(acc.shape))
            return result
        acc = self.accumulate(tensor, key)
        result = yield from self.compressor.rounds(acc, key)
        result = result.to(tensor.dtype)
        self.update(key, acc, result)
        return result if out is None else out.copy_(result)


class EF21(_Feedback):
    """EF21: send ``C(g - estimate)``; every receiver adds the average to a shared estimate.

    ``compress`` updates this rank's own estimate; ``combine`` updates the aggregate estimate
    (identical on every rank) and returns it. With one process both are the same.
    """

    kind = "ef21"

    def __init__(self, compressor: Compressor | str) -> None:
        super().__init__(compressor)
        self._aggregate: Dict[str, torch.Tensor] = {}

    def estimate(self, key: Optional[str] = None) -> torch.Tensor:
        buf = self._state.get("" if key is None else str(key))
        return buf.clone() if buf is not None else torch.zeros(())

    def residual(self, key: Optional[str] = None) -> torch.Tensor:
        """Not kept: EF21's memory is the estimate (see :meth:`estimate`)."""
        raise ValueError("EF21 keeps an estimate, not a residual; use estimate(key)")

    def accumulate(self, tensor: torch.Tensor, key: Optional[str]) -> torch.Tensor:
        """``tensor - estimate`` (a new tensor): what EF21 compresses. With :meth:`update` this
        is the same two-step protocol as ``ErrorFeedback``, for collectives that compress
        pieces of it separately."""
        self.compressor._check_input(tensor)
        est = self._slot("" if key is None else str(key), tensor)
        return tensor.detach().to(est.dtype) - est

    def update(self, key: Optional[str], acc: torch.Tensor, sent: torch.Tensor) -> None:
        """Add ``sent`` (what the wire carried for ``acc``, decoded) to the estimate of ``key``."""
        skey = "" if key is None else str(key)
        est = self._slot(skey, acc)
        torch.add(est, sent.to(est.dtype).reshape(est.shape), out=self._writable(skey))

    def _compress_step(self, tensor: torch.Tensor, key: Optional[str], step: Optional[int]) -> Payload:
        self.compressor._check_input(tensor)
        skey = "" if key is None else str(key)
        est = self._slot(skey, tensor)
        payload, decoded = self._send(tensor.detach().to(est.dtype) - est, tensor.dtype, key, step)
        torch.add(est, decoded.to(est.dtype).reshape(est.shape), out=self._writable(skey))
        return payload

    def combine(self, key: Optional[str], averaged: torch.Tensor) -> torch.Tensor:
        skey = "" if key is None else str(key)
        agg = self._aggregate.get(skey)
        if agg is None or agg.shape != averaged.shape:
            agg = torch.zeros(averaged.shape, dtype=work_dtype(averaged.dtype), device=averaged.device)
        agg = agg + averaged.to(agg.dtype)
        replace(self._aggregate, skey)
        self._aggregate[skey] = agg
        return agg.to(averaged.dtype)

    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        sd["aggregate"] = {k: v.detach().cpu().clone() for k, v in self._aggregate.items()}
        return sd

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._aggregate = {k: v.clone() for k, v in state.get("aggregate", {}).items()}
