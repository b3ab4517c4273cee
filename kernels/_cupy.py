"""The one bridge between torch and CuPy: DLPack views, lazily compiled kernels, launches on
torch's current CUDA stream.

Tensors cross to CuPy with ``cupy.from_dlpack`` (a view: no copy). Each ``kernels/cuda/<family>.cu``
is compiled by NVRTC the first time one of its kernels runs (CuPy caches the binary on disk
and per device). Kernels are queued on ``torch.cuda.current_stream()`` and nothing here
synchronises the device, so compression overlaps whatever else that stream is doing.
Importing this module never fails; without CuPy or a GPU :func:`available` is false.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch

CUDA_DIR = Path(__file__).with_name("cuda")
# IEEE rounding of every operation (no fused multiply-add), so kernels reproduce the torch
# reference's elementwise results exactly.
COMPILE_OPTIONS = ("--std=c++17", "--fmad=false")
_INCLUDE = re.compile(r'^[ \t]*#include[ \t]+"([^"]+)"[ \t]*$', re.M)
# dtypes that DLPack consumers may not know: the kernels only need the bytes.
_DLPACK_AS = {torch.bfloat16: torch.int16, torch.bool: torch.uint8}


def families() -> list:
    """Names of the kernel families: one per ``kernels/cuda/*.cu`` file."""
    return sorted(p.stem for p in CUDA_DIR.glob("*.cu"))


@functools.lru_cache(maxsize=None)
def source(family: str) -> str:
    """The source of ``kernels/cuda/<family>.cu`` with its local headers inlined (each once).

    Inlining (rather than an include path) keeps CuPy's on-disk cache key exact: it hashes
    the source text, so a changed header recompiles.
    """
    path = CUDA_DIR / f"{family}.cu"
    if not path.is_file():
        raise ValueError(f"no CUDA kernel family {family!r}; available: {', '.join(families())}")
    seen: set = set()

    def expand(text: str) -> str:
        def include(m: re.Match) -> str:
            name = m.group(1)
            if name in seen:
                return ""
            seen.add(name)
            return expand((CUDA_DIR / name).read_text())

        return _INCLUDE.sub(include, text)

    return expand(path.read_text())


@functools.lru_cache(maxsize=None)
def _cupy() -> Any:
    try:
        import cupy
    except Exception:  # not installed, or installed for another CUDA: the torch path runs
        return None
    return cupy


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    cp = _cupy()
    if cp is None or not torch.cuda.is_available():
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def as_cupy(t: torch.Tensor) -> Any:
    """A CuPy view of ``t`` (no copy). Call it with torch's stream current in CuPy (as
    :class:`Launcher` does), so DLPack's stream handshake adds no wait."""
    view = _DLPACK_AS.get(t.dtype)
    return _cupy().from_dlpack(t.view(view) if view is not None else t)


def as_torch(a: Any) -> torch.Tensor:
    """A torch view of the CuPy array ``a`` (no copy)."""
    return torch.from_dlpack(a)


@functools.lru_cache(maxsize=None)
def _kernel(family: str, name: str) -> Any:
    module = _module(family)
    return module.get_function(name)


@functools.lru_cache(maxsize=None)
def _module(family: str) -> Any:
    return _cupy().RawModule(code=source(family), options=COMPILE_OPTIONS)


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=64)
def _external_stream(ptr: int, index: int) -> Any:
    # a wrapper of torch's stream, kept so that each launch does not build a new one
    return _cupy().cuda.ExternalStream(ptr, index)


class Launcher:
    """Runs kernels on one CUDA device, on torch's current stream of that device.

    Use as a context manager; inside, ``launcher(family, kernel, grid, block, *args)`` queues
    a 1-D launch. Arguments are tensors (passed as device pointers, each converted through
    DLPack once per launcher) or numpy scalars whose type is the kernel parameter's C type —
    a Python number is refused, since its C type would be a guess.
    """

    def __init__(self, device: torch.device) -> None:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.sms = sm_count(device.index)
        self._views: Dict[int, Any] = {}
        self._keep: list = []
        self._ctx: list = []
        self.stream: Optional[Any] = None

    def __enter__(self) -> "Launcher":
        cp = _cupy()
        dev = cp.cuda.Device(self.device.index)
        dev.__enter__()
        self._ctx.append(dev)
        self.stream = _external_stream(torch.cuda.current_stream(self.device).cuda_stream, self.device.index)
        self.stream.__enter__()
        self._ctx.append(self.stream)
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._ctx:
            self._ctx.pop().__exit__(*exc)
        self._views.clear()
        self._keep.clear()

    def __call__(self, family: str, kernel: str, grid: int, block: int, *args: Any) -> None:
        _kernel(family, kernel)((int(grid),), (int(block),), tuple(self._arg(a) for a in args))

    def _arg(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            if a.device != self.device:
                raise ValueError(f"kernel argument on {a.device}, launcher on {self.device}")
            view = self._views.get(id(a))
            if view is None:
                view = self._views[id(a)] = as_cupy(a.detach())
                self._keep.append(a)  # ids stay unique while the launcher lives
            return view
        if isinstance(a, np.generic):
            return a
        raise TypeError(f"kernel arguments must be tensors or numpy scalars, got {type(a).__name__}")


def launcher(device: torch.device) -> Launcher:
    """A :class:`Launcher` for ``device`` (tests swap this for a CPU emulation)."""
    return Launcher(device)
