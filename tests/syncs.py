"""Count gradcomp's host syncs: the calls that, on a CUDA tensor, make the host wait for the GPU.

``with HostSyncs() as s: ...`` patches the ``torch.Tensor`` methods that read a tensor's value
on the host or size an output from its data (``item``, ``tolist``, ``cpu``, ``numpy``,
``__bool__``, ``__int__``, ``__float__``, ``__index__``, ``nonzero``, ``unique``,
``masked_select``, ``.to("cpu")`` and boolean-mask indexing) plus ``torch.nonzero`` /
``torch.unique`` / ``torch.masked_select``, in every thread of the process (gradcomp's worker
thread included, which a ``TorchFunctionMode`` would not see), and counts each call made
directly from gradcomp's own source (not torch's internals, not the test). On CPU tensors these
calls cost little, but the same code on CUDA waits for the stream, so counting them on CPU
tells what the GPU path will pay (issue 24's budget: at most one per training iteration).

``s.count`` is the total, ``s.sites`` a Counter of ``"op file:line"``; ``s.mark()`` returns
the count so far, to take the difference over one iteration.

``CPU_ONLY`` lists the only exceptions: sites in branches that run for CPU tensors alone (the
numpy fast paths), whose CUDA branch reads nothing back; each names why. Their calls are kept
apart in ``s.cpu_only``, not counted, and shown by ``report``.
"""
from __future__ import annotations

import collections
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Counter, Dict, List, Tuple

import torch

ROOT = Path(__file__).resolve().parents[1]
_PACKAGES = ("compress", "kernels", "collectives", "training", "sharded", "memory", "optim", "pipeline")
_OURS = tuple(str(ROOT / p) + "/" for p in _PACKAGES) + tuple(str(ROOT / "gradcomp" / p) + "/" for p in _PACKAGES)

_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
            "unique", "masked_select")
_FUNCTIONS = ("nonzero", "unique", "masked_select")


# (file, function, op or "*") -> why the site runs only on host memory and its CUDA branch has no sync
CPU_ONLY: Dict[Tuple[str, str, str], str] = {
    ("compress/sign.py", "decodes_finite", "*"): "reads the decode values of a CPU payload only; for a payload "
                                                  "on a device it answers False without reading",
    ("kernels/sign.py", "_pack_cpu", "*"): "sign_pack's branch for a CPU x; on CUDA launch_sign_pack reads "
                                           "nothing back",
    ("kernels/sign.py", "_sum", "*"): "called by _pack_cpu only",
    ("kernels/sign.py", "_unpack_cpu", "*"): "sign_unpack's branch for CPU bits and out; the CUDA kernel reads "
                                             "nothing back",
    ("kernels/sign.py", "_patterns", "*"): "called by _unpack_cpu only, on a tensor it builds from Python floats",
    ("kernels/sign.py", "_unpack_cpu_values", "*"): "sign_unpack_values's branch for CPU tensors; elsewhere the values "
                                                     "stay on the device",
    ("kernels/sign.py", "_count_set_cpu", "*"): "count_set_tensor's branch for CPU bits; the CUDA kernel writes a "
                                                "device tensor",
    ("kernels/bits.py", "pack_bits", "numpy"): "numpy branch for CPU tensors; other devices use torch ops",
    ("kernels/bits.py", "unpack_bits", "numpy"): "numpy branch for CPU tensors; other devices use torch ops",
    ("kernels/bits.py", "pack_codes", "numpy"): "numpy branch for CPU tensors; other devices use torch ops",
    ("kernels/bits.py", "unpack_codes", "numpy"): "numpy branch for CPU tensors; other devices use torch ops",
    ("kernels/quant.py", "natural_decode", "numpy"): "np.take branch for CPU codes; CUDA runs a kernel",
    ("kernels/minifloat.py", "e2m1_decode", "numpy"): "np.take branch for CPU codes; other devices index the "
                                                      "table there",
    ("kernels/quant.py", "natural_decode", "__int__"): "the exponent of CPU codes, a CPU tensor; elsewhere the "
                                                      "table is built on the device (natural_table)",
    ("kernels/quant.py", "max_exponent", "*"): "natural_encode's exponent of a CPU x; other devices find it "
                                               "there (_natural_encode_on_device)",
    ("kernels/select.py", "_at_least", "item"): "the integer compare branch, taken for CPU x only",
    ("kernels/select.py", "_at_least", "__float__"): "the integer compare branch, taken for CPU x only",
    ("kernels/select.py", "_at_least", "numpy"): "the integer compare branch, taken for CPU x only",
    ("kernels/select.py", "_round_up", "__float__"): "reads a tensor it built on the host from a Python float",
    ("kernels/select.py", "_host_threshold", "item"): "reads a tensor it built on the host from a Python float "
                                                      "(_round_up's result), once per tau and dtype",
    ("kernels/select.py", "_sampled_cpu", "*"): "the sampled threshold, taken for CPU x only; other devices "
                                                 "select on the whole tensor without reading back (_exact)",
    ("kernels/select.py", "_exact_cpu", "*"): "called by _sampled_cpu and kernels/cpu.py only",
    ("kernels/select.py", "kth_smallest_cpu", "*"): "numpy's selection of a CPU tensor, called by _sampled_cpu, "
                                                    "_exact_cpu and kernels/cpu.py only",
    ("compress/randomk.py", "_all_finite_cpu", "*"): "the finiteness of a CPU tensor; other devices decide it "
                                                     "on the device",
    ("kernels/quant.py", "may_hold", "__bool__"): "reads a flag of a CPU tensor only; for others it answers True "
                                                 "and the caller's branch decides with torch.where",
    ("kernels/quant.py", "bucket_norms", "nonzero"): "the second look, reached for CPU x only (other devices "
                                                     "take _norms_again)",
    ("compress/signum.py", "_signal_cpu", "*"): "signum's momentum step for a CPU gradient; other devices take "
                                                "_signal_on_device, which reads nothing back",
    ("kernels/quant.py", "_gather_blocks", "*"): "called by bucket_norms' CPU branch only",
    ("compress/powersgd.py", "_finite_and_absmax", "*"): "PowerSGD's retry decisions and bound for CPU factors; "
                                                          "other devices take _factors_on_device, two rounds, "
                                                          "nothing read",
    ("compress/powersgd.py", "_product_cpu", "*"): "P Q^T of CPU factors near the dtype's top; other devices take "
                                                   "_product_on_device, whose bound stays there",
    ("compress/powersgd.py", "_absmax", "*"): "called by _product_cpu only",
    ("kernels/cpu.py", "*", "*"): "the fused CPU loops' entry points, taken for CPU tensors only (cpu.applies)",
    ("optim/onebit_adam.py", "_compressed_step", "__float__"): "the step counter, a CPU tensor wherever the "
                                                               "parameters are (as torch.optim.Adam keeps it)",
}


def _is_bool_mask(index: Any) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype == torch.bool
    if isinstance(index, tuple):
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    return False


def _to_host(args: tuple, kwargs: Dict[str, Any]) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, (str, torch.device)):
        return torch.device(target).type == "cpu"
    return False


class HostSyncs:
    """Counts host syncs made by gradcomp's code while active (see the module docstring)."""

    def __init__(self) -> None:
        self.sites: Counter[str] = collections.Counter()
        self.cpu_only: Counter[str] = collections.Counter()  # calls at CPU_ONLY sites, not counted
        self._lock = threading.Lock()
        self._saved: List[Tuple[Any, str, Any]] = []

    @property
    def count(self) -> int:
        return sum(self.sites.values())

    def mark(self) -> int:
        return self.count

    def _record(self, op: str) -> None:
        frame = sys._getframe(2)
        path = frame.f_code.co_filename
        if path.startswith(_OURS):
            rel = Path(path).resolve().relative_to(ROOT).as_posix()
            func = frame.f_code.co_name
            cpu_only = any(k in CPU_ONLY for k in ((rel, func, "*"), (rel, func, op), (rel, "*", "*")))
            with self._lock:
                (self.cpu_only if cpu_only else self.sites)[f"{op} {rel}:{frame.f_lineno}"] += 1

    def _wrap(self, op: str, fn: Callable, when: Callable[..., bool] = lambda *a, **k: True) -> Callable:
        record = self._record

        def counted(*args: Any, **kwargs: Any) -> Any:
            if when(*args, **kwargs):
                record(op)
            return fn(*args, **kwargs)

        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        return counted

    def __enter__(self) -> "HostSyncs":
        for name in _METHODS:
            self._patch(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        self._patch(torch.Tensor, "to", self._wrap(".to(cpu)", torch.Tensor.to, lambda self_, *a, **k: _to_host(a, k)))
        self._patch(torch.Tensor, "__getitem__", self._wrap("bool-mask index", torch.Tensor.__getitem__,
                                                            lambda self_, index: _is_bool_mask(index)))
        for name in _FUNCTIONS:
            self._patch(torch, name, self._wrap(f"torch.{name}", getattr(torch, name)))
        return self

    def _patch(self, owner: Any, name: str, new: Callable) -> None:
        self._saved.append((owner, name, owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)))
        setattr(owner, name, new)

    def __exit__(self, *exc: Any) -> None:
        for owner, name, old in reversed(self._saved):
            setattr(owner, name, old)
        self._saved.clear()

    def report(self, top: int = 12) -> str:
        lines = [f"{n:5d}  {site}" for site, n in self.sites.most_common(top)]
        if self.cpu_only:
            lines.append(f"not counted, CPU-only branches (tests/syncs.py CPU_ONLY): {sum(self.cpu_only.values())} "
                         f"calls at {len(self.cpu_only)} sites")
        return "\n".join(lines)
