"""NVRTC through ctypes, with the interface of CuPy's binding (``cupy_backends.cuda.libs.nvrtc``),
so the tests compile the kernels exactly as ``_cupy.binary`` does on a GPU machine, on machines
with no GPU and no CuPy. NVRTC needs no device: only its library, found in the pip package
``nvidia-cuda-nvrtc`` (CI installs it), next to ``nvcc``, or under ``$CUDA_HOME``.
"""
import ctypes
import glob
import os
import shutil
import site
import sys
from typing import Optional


def _candidates():
    roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    for root in roots:
        for sub in ("nvidia/cu*/lib", "nvidia/cuda_nvrtc/lib"):
            yield from sorted(glob.glob(os.path.join(root, sub, "libnvrtc.so*")), reverse=True)
    nvcc = shutil.which("nvcc")
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
             os.path.dirname(os.path.dirname(nvcc)) if nvcc else None]
    for home in filter(None, homes):
        yield from sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")), reverse=True)


def find_library() -> Optional[str]:
    for path in _candidates():
        if "builtins" not in os.path.basename(path) and os.path.isfile(path):
            return path
    return None


class NVRTCError(RuntimeError):
    pass


class Binding:
    """The subset of CuPy's NVRTC binding that ``gradcomp.kernels._cupy`` uses."""

    NVRTCError = NVRTCError

    def __init__(self, path: str):
        self.path = path
        self.lib = lib = ctypes.CDLL(path)
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        self.compiled = []  # options of every compileProgram call, for the tests

    def _check(self, rc: int) -> None:
        if rc != 0:
            raise NVRTCError(self.lib.nvrtcGetErrorString(rc).decode())

    def getVersion(self):
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)))
        return major.value, minor.value

    def getSupportedArchs(self):
        n = ctypes.c_int()
        self._check(self.lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)))
        archs = (ctypes.c_int * n.value)()
        self._check(self.lib.nvrtcGetSupportedArchs(archs))
        return tuple(archs)

    def createProgram(self, src, name, headers, include_names):
        assert not headers and not include_names
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None))
        return prog

    def compileProgram(self, prog, options):
        self.compiled.append(tuple(options))
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        self._check(self.lib.nvrtcCompileProgram(prog, len(options), opts))

    def _blob(self, prog, size_fn, get_fn) -> bytes:
        n = ctypes.c_size_t()
        self._check(getattr(self.lib, size_fn)(prog, ctypes.byref(n)))
        buf = ctypes.create_string_buffer(n.value)
        self._check(getattr(self.lib, get_fn)(prog, buf))
        return buf.raw[: n.value]

    def getCUBIN(self, prog) -> bytes:
        return self._blob(prog, "nvrtcGetCUBINSize", "nvrtcGetCUBIN")

    def getPTX(self, prog) -> str:
        return self._blob(prog, "nvrtcGetPTXSize", "nvrtcGetPTX").rstrip(b"\0").decode()

    def getProgramLog(self, prog) -> str:
        return self._blob(prog, "nvrtcGetProgramLogSize", "nvrtcGetProgramLog").rstrip(b"\0").decode()

    def destroyProgram(self, prog) -> None:
        self._check(self.lib.nvrtcDestroyProgram(ctypes.byref(prog)))
