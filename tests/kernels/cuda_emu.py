"""Run gradcomp's CUDA kernels on the CPU: each .cu is compiled with g++ against
``cuda_emu.h`` (threads as fibers) and launched through ctypes.

:class:`Emulator` stands in for ``gradcomp.kernels._cupy.launcher``, so the dispatch code
(grid sizes, buffers, argument types, kernel order) runs unchanged on CPU tensors. Every
launch checks what a real launch would not: each argument against the kernel's parameter
type (a tensor's dtype against the pointee type, a numpy scalar against the C type), the
block size against the kernel's ``__launch_bounds__`` (every gradcomp kernel is written for
exactly that many threads), and writes past the end of any tensor argument (each storage is
copied between guard bytes). :meth:`Emulator.constant` evaluates a constant of a family as
the compiler does, for the test that the launchers' values are the ``.cu`` files'.
"""
from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

from gradcomp.kernels import _cupy

HEADER = Path(__file__).with_name("cuda_emu.h")
GUARD = 256  # bytes checked on each side of every tensor argument
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+__launch_bounds__\s*\(\s*(\d+)\s*\)\s*(\w+)\s*\(([^)]*)\)')
_POINTEE = {
    "float": (torch.float32,), "double": (torch.float64,), "f16": (torch.float16,),
    "bf16": (torch.bfloat16,), "u8": (torch.uint8, torch.bool), "i8": (torch.int8,), "u16": (torch.int16,),
    "int": (torch.int32,), "u32": (torch.int32,), "i64": (torch.int64,), "u64": (torch.int64,),
}
_SCALAR = {
    "float": (np.float32, ctypes.c_float), "double": (np.float64, ctypes.c_double),
    "int": (np.int32, ctypes.c_int32), "u32": (np.uint32, ctypes.c_uint32),
    "i64": (np.int64, ctypes.c_int64), "u64": (np.uint64, ctypes.c_uint64),
}


def _params(text: str) -> List[Tuple[str, bool]]:
    """(base type, is pointer) of each parameter of a kernel signature."""
    out = []
    for p in text.split(","):
        words = p.replace("*", " * ").split()
        words = [w for w in words if w not in ("const", "__restrict__", "__restrict")]
        is_ptr = "*" in words
        words = [w for w in words if w != "*"]
        out.append((" ".join(words[:-1]), is_ptr))
    return out


class Emulator:
    """Compiles kernel families for the CPU on first use and launches them."""

    def __init__(self, build_dir: Path) -> None:
        self.build_dir = Path(build_dir)
        self._libs: Dict[str, Tuple[ctypes.CDLL, Dict[str, Tuple[int, list]]]] = {}
        self.launches: List[str] = []  # kernel names, in launch order

    def library(self, family: str):
        if family not in self._libs:
            src = self.build_dir / f"{family}.cu"
            src.write_text(_cupy.source(family))
            pre = subprocess.run(["g++", "-E", "-P", "-x", "c++", str(src)], capture_output=True, text=True, check=True)
            kernels = {m.group(2): (int(m.group(1)), _params(m.group(3))) for m in _KERNEL.finditer(pre.stdout)}
            if len(kernels) != len(re.findall(r"__global__", pre.stdout)):
                raise AssertionError(f"{family}.cu: every kernel needs __launch_bounds__ and an extern \"C\" name")
            glue = [f'#include "{HEADER}"', f'#include "{src}"']
            for name in kernels:
                glue.append(f'extern "C" const char* emu_{name}(unsigned g, unsigned b, void** a) '
                            f'{{ return emu::launch({name}, g, b, a); }}')
            for name in _cupy.constants(family):
                glue.append(f'extern "C" long long emu_const_{name}() {{ return (long long)({name}); }}')
            cpp = self.build_dir / f"{family}_emu.cpp"
            cpp.write_text("\n".join(glue) + "\n")
            lib = self.build_dir / f"{family}_emu.so"
            res = subprocess.run(["g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-w", "-o", str(lib), str(cpp)],
                                 capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(f"g++ failed on {family}.cu:\n{res.stderr[-4000:]}")
            dll = ctypes.CDLL(str(lib))
            for name in kernels:
                fn = getattr(dll, f"emu_{name}")
                fn.restype = ctypes.c_char_p
                fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p]
            for name in _cupy.constants(family):
                getattr(dll, f"emu_const_{name}").restype = ctypes.c_longlong
            self._libs[family] = (dll, kernels)
        return self._libs[family]

    def constant(self, family: str, name: str) -> int:
        """The value of ``name`` (a constant that ``_cupy.constants`` found) as the C++
        compiler evaluates it in ``family``'s source."""
        dll, _ = self.library(family)
        return int(getattr(dll, f"emu_const_{name}")())

    def launch(self, family: str, kernel: str, grid: int, block: int, args: tuple) -> None:
        dll, kernels = self.library(family)
        if kernel not in kernels:
            raise AssertionError(f"{family}.cu has no kernel {kernel!r}")
        bound, params = kernels[kernel]
        if block != bound:
            raise AssertionError(f"{kernel}: launched with {block} threads per block, written for "
                                 f"__launch_bounds__({bound})")
        if len(params) != len(args):
            raise AssertionError(f"{kernel}: {len(args)} arguments for {len(params)} parameters")
        if not (1 <= grid < 2**31 and 32 <= block <= 1024 and block % 32 == 0):
            raise AssertionError(f"{kernel}: bad launch configuration grid={grid} block={block}")
        buffers: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        cargs: list = []
        for i, ((ctype, is_ptr), a) in enumerate(zip(params, args)):
            if is_ptr:
                if not isinstance(a, torch.Tensor):
                    raise AssertionError(f"{kernel}: parameter {i} is a pointer, got {type(a).__name__}")
                if a.dtype not in _POINTEE[ctype]:
                    raise AssertionError(f"{kernel}: parameter {i} is {ctype}*, got a {a.dtype} tensor")
                storage = a.untyped_storage()
                key = storage.data_ptr()
                if key not in buffers:
                    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
                    guarded = torch.full((raw.numel() + 2 * GUARD,), 0xA5, dtype=torch.uint8)
                    guarded[GUARD:GUARD + raw.numel()] = raw
                    buffers[key] = (raw, guarded)
                offset = a.data_ptr() - key
                cargs.append(ctypes.c_void_p(buffers[key][1].data_ptr() + GUARD + offset))
            else:
                want, ctyp = _SCALAR[ctype]
                if type(a) is not want:
                    raise AssertionError(f"{kernel}: parameter {i} is {ctype}, got {type(a).__name__} "
                                         f"(pass {want.__name__})")
                cargs.append(ctyp(a.item()))
        argv = (ctypes.c_void_p * max(1, len(cargs)))(*[ctypes.addressof(c) for c in cargs])
        err = getattr(dll, f"emu_{kernel}")(grid, block, argv)
        self.launches.append(kernel)
        if err:
            raise AssertionError(f"{kernel}: {err.decode()}")
        for raw, guarded in buffers.values():
            n = raw.numel()
            if bool((guarded[:GUARD] != 0xA5).any()) or bool((guarded[GUARD + n:] != 0xA5).any()):
                raise AssertionError(f"{kernel}: wrote outside a tensor argument")
            raw.copy_(guarded[GUARD:GUARD + n])


class EmulatedLauncher:
    """Drop-in for ``_cupy.Launcher`` on CPU tensors."""

    sms = 2  # a few blocks per "device": grid-stride loops and multi-block merges get exercised

    def __init__(self, emu: Emulator, device: torch.device) -> None:
        self.emu = emu
        self.device = device

    def __enter__(self) -> "EmulatedLauncher":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def __call__(self, family: str, kernel: str, grid: int, block: int, *args: Any) -> None:
        for a in args:
            if isinstance(a, torch.Tensor) and a.device.type != "cpu":
                raise AssertionError(f"{kernel}: the emulation runs on CPU tensors, got {a.device}")
        self.emu.launch(family, kernel, int(grid), int(block), args)
