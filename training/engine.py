"""The runtime shared by the DDP hook and the optimizer wrapper: route, submit, keep state.

``Compression`` owns the policy (which gradients are compressed, with which codec), the
iteration counter that drives the warm-up, and the worker that runs bucket exchanges in
order. Its ``state_dict`` holds everything a resumed run needs to continue bit-identically:
the iteration and every codec's per-parameter state (residuals, warm starts, step counters).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch

from gradcomp.collectives import choose_algorithm, server_feedback

from . import _worker
from ._transport import exchange
from .policy import Policy, base_of

_VERSION = 1


class Compression:
    """Averages named gradients over ``group`` as ``policy`` says; see the module docstring."""

    def __init__(self, policy: Policy, group=None) -> None:
        self.policy = policy
        self.group = group
        self.iteration = 0  # completed exchanges of the whole model; drives ``start_iter``
        self.world = _worker.world_of(group)
        self._worker: Optional[_worker.Worker] = None
        codec = policy.default.codec
        self.label = base_of(codec).name if codec is base_of(codec) else f"{codec.kind}+{base_of(codec).name}"

    def start(self) -> None:
        """Create the worker (and its twin group) now; every rank must call this at the same point."""
        if self.world > 1 and self._worker is None:
            self._worker = _worker.worker_for(self.group)

    def submit(self, names: Sequence[str], grads: Sequence[torch.Tensor], *,
               buffer: Optional[torch.Tensor] = None, then: Optional[Callable] = None,
               advance: bool = False, inline: bool = False) -> torch.futures.Future:
        """A future of the mean of every gradient (a list in order; chained with ``.then(then)``),
        sent as the policy says at the current iteration, which ``advance`` then increments.
        ``buffer``: see :func:`gradcomp.training._transport.exchange`; ``inline``: see
        :meth:`gradcomp.training._worker.Worker.submit`."""
        items = [(n, g, self.policy.route(n, g, self.iteration)) for n, g in zip(names, grads)]
        world, label = self.world, self.label
        if advance:
            self.iteration += 1

        def job(group):
            return exchange(items, group, world, buffer=buffer, label=label)

        if world == 1:
            return _worker.completed(job, then)
        self.start()
        device = buffer.device if buffer is not None else grads[0].device if grads else torch.device("cpu")
        return self._worker.submit(job, device, then, inline=inline)

    def compressed(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (parameter ``name``) is compressed at the current iteration."""
        return self.policy.route(name, tensor, self.iteration) is not None

    def _servers(self) -> Dict[str, Any]:
        """Scatter-reduce's second error feedback (more than two ranks), per codec pattern:
        the collectives keep it with the codec, and a resumed run needs it too."""
        out = {}
        for pattern, codec in self.policy.codecs().items():
            if codec is not base_of(codec) and choose_algorithm(codec, self.world) == "scatter-reduce":
                out[pattern] = server_feedback(codec)
        return out

    def state_dict(self) -> Dict[str, Any]:
        """Iteration and every codec's state (CPU tensors); call it when no exchange is running."""
        return {"version": _VERSION, "iteration": self.iteration, "codecs": self.policy.state_dict(),
                "servers": {p: s.state_dict() for p, s in self._servers().items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or state.get("version") != _VERSION:
            raise ValueError(f"not a gradcomp training state_dict of version {_VERSION}")
        self.policy.load_state_dict(state["codecs"])
        servers = self._servers()
        if set(servers) != set(state.get("servers", {})):
            raise ValueError(f"state_dict was saved with {len(state.get('servers', {}))} scatter-reduce codecs, this "
                             f"run has {len(servers)}; resume on the same number of ranks")
        for pattern, server in servers.items():
            server.load_state_dict(state["servers"][pattern])
        self.iteration = int(state["iteration"])


def names_of(params: Sequence[torch.Tensor], model: Optional[torch.nn.Module]) -> List[str]:
    """Stable names for ``params``: their names in ``model``, else ``param{i}`` by position."""
    if model is None:
        return [f"param{i}" for i in range(len(params))]
    by_id = {id(p): n for n, p in model.named_parameters()}
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise ValueError(f"{len(missing)} parameter(s) (positions {missing[:5]}) are not parameters of the model "
                         f"given; pass the model whose parameters are trained")
    return [by_id[id(p)] for p in params]
