"""The one bridge between torch and CuPy: DLPack views, lazily compiled kernels, launches on
torch's current CUDA stream.

Tensors cross to CuPy with ``cupy.from_dlpack`` (a view: no copy). Each ``kernels/cuda/<family>.cu``
is compiled by NVRTC the first time one of its kernels runs, for the device's architecture,
cached on disk (:func:`cache_dir`) and loaded with ``cupy.RawModule(path=...)``. We call NVRTC
ourselves rather than hand the source to ``RawModule(code=...)``, because CuPy appends
``-ftz=true`` after the caller's options (NVRTC honours the last one): subnormals would be
flushed to zero, so a negative subnormal gradient would pack as a positive sign and a subnormal
residual would vanish, where torch keeps both. Kernels are queued on
``torch.cuda.current_stream()`` and nothing here synchronises the device, so compression
overlaps whatever else that stream is doing. Importing this module never fails; without CuPy,
NVRTC or a GPU :func:`available` is false.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import numpy as np
import torch

CUDA_DIR = Path(__file__).with_name("cuda")
# IEEE arithmetic in every operation: no fused multiply-add, subnormals kept (not flushed),
# exact division and square root, so kernels reproduce the torch reference's elementwise
# results exactly.
COMPILE_OPTIONS = ("--std=c++17", "--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")
_INCLUDE = re.compile(r'^[ \t]*#include[ \t]+"([^"]+)"[ \t]*$', re.M)
# object-like macros (a function-like one has "(" right after its name) and enumerators
_DEFINE = re.compile(r"^[ \t]*#define[ \t]+([A-Za-z_]\w*)[ \t]+(.+?)[ \t]*(?://.*)?$", re.M)
_ENUM = re.compile(r"\benum\s+\w+\s*\{([^}]*)\}")
_C_INT = re.compile(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]*\b")
_C_OPS = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__, ast.Div: int.__floordiv__,
          ast.FloorDiv: int.__floordiv__, ast.LShift: int.__lshift__, ast.RShift: int.__rshift__,
          ast.BitOr: int.__or__, ast.BitAnd: int.__and__}
# dtypes that DLPack consumers may not know: the kernels only need the bytes.
_DLPACK_AS = {torch.bfloat16: torch.int16, torch.bool: torch.uint8}


def families() -> list:
    """Names of the kernel families: one per ``kernels/cuda/*.cu`` file."""
    return sorted(p.stem for p in CUDA_DIR.glob("*.cu"))


@functools.lru_cache(maxsize=None)
def source(family: str) -> str:
    """The source of ``kernels/cuda/<family>.cu`` with its local headers inlined (each once).

    Inlining (rather than an include path) keeps the disk cache key exact: :func:`binary`
    hashes this text (with the options, architecture and NVRTC version), so a changed header
    recompiles.
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
def constants(family: str) -> Dict[str, int]:
    """The integer constants of ``kernels/cuda/<family>.cu`` and its headers: each ``#define``
    whose value is an integer expression of numbers and earlier constants, and each enumerator
    with an explicit value. The launchers take their block sizes, workspace layouts and mode
    numbers from here, so the ``.cu`` file is the one place each is set."""
    text = source(family)
    found: Dict[str, int] = {}
    pairs = [(m.start(), m.group(1), m.group(2)) for m in _DEFINE.finditer(text)]
    for m in _ENUM.finditer(text):
        offset = m.start(1)
        for item in m.group(1).split(","):
            name, eq, value = item.partition("=")
            if eq:
                pairs.append((offset, name.strip(), value))
            offset += len(item) + 1
    for _, name, value in sorted(pairs):
        number = _c_int(value, found)
        if number is not None:
            found[name] = number
    return found


def _c_int(expr: str, known: Dict[str, int]) -> Optional[int]:
    """The value of a C integer expression (numbers, known names, + - * / << >> | &), or None."""
    try:
        tree = ast.parse(_C_INT.sub(lambda m: str(int(m.group(1), 0)), expr.strip()), mode="eval").body
    except SyntaxError:
        return None

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name) and node.id in known:
            return known[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _C_OPS:
            return _C_OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(ast.dump(node))

    try:
        return value(tree)
    except (ValueError, ZeroDivisionError):
        return None


@functools.lru_cache(maxsize=None)
def _cupy() -> Any:
    try:
        import cupy
    except Exception:  # not installed, or installed for another CUDA: the torch path runs
        return None
    return cupy


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when CuPy imports, sees at least one CUDA device and reaches NVRTC."""
    cp = _cupy()
    if cp is None or not torch.cuda.is_available():
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0 and _nvrtc().getVersion() is not None
    except Exception:
        return False


class KernelCompileError(RuntimeError):
    """NVRTC refused a kernel family; the message carries its log."""


def _nvrtc() -> Any:
    # CuPy's binding of the NVRTC library it loads itself (no GPU needed to compile)
    from cupy_backends.cuda.libs import nvrtc

    return nvrtc


def gpu_architecture(capability: int, supported: Optional[Sequence[int]]) -> str:
    """NVRTC's ``--gpu-architecture`` for a device of compute capability ``capability``
    (e.g. 90): the device's own machine code when NVRTC knows it, otherwise PTX of the newest
    architecture below it, which the driver compiles when loading."""
    if not supported or capability in supported:
        return f"sm_{capability}"
    older = [a for a in supported if a <= capability]
    if not older:
        raise KernelCompileError(f"NVRTC supports no architecture at or below sm_{capability} "
                                 f"(it knows {', '.join(map(str, sorted(supported)))})")
    return f"compute_{max(older)}"


def compile_family(family: str, arch: str, nvrtc: Any = None) -> bytes:
    """Compile ``kernels/cuda/<family>.cu`` with :data:`COMPILE_OPTIONS` for ``arch``
    (``sm_XX``: a cubin; ``compute_XX``: PTX text). ``nvrtc`` is a binding with CuPy's
    interface (createProgram, compileProgram, getCUBIN, getPTX, getProgramLog,
    destroyProgram); CuPy's own by default."""
    nv = _nvrtc() if nvrtc is None else nvrtc
    prog = nv.createProgram(source(family), f"{family}.cu", (), ())
    try:
        try:
            nv.compileProgram(prog, COMPILE_OPTIONS + (f"--gpu-architecture={arch}",))
        except Exception as exc:
            raise KernelCompileError(f"NVRTC failed on {family}.cu for {arch} (GRADCOMP_CUDA_KERNELS=0 runs the "
                                     f"torch path instead):\n{nv.getProgramLog(prog)}") from exc
        if arch.startswith("sm_"):
            return bytes(nv.getCUBIN(prog))
        ptx = nv.getPTX(prog)
        return ptx.encode() if isinstance(ptx, str) else bytes(ptx)
    finally:
        nv.destroyProgram(prog)


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$GRADCOMP_KERNEL_CACHE``, else
    ``$XDG_CACHE_HOME/gradcomp/kernels`` (``~/.cache`` when unset). When it is not writable,
    :func:`temp_cache_dir` instead."""
    env = os.environ.get("GRADCOMP_KERNEL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gradcomp" / "kernels"


def temp_cache_dir() -> Path:
    """The fallback cache in the temp folder, ``gradcomp-kernels-<uid>``: its name is
    predictable, so it is used only as a private folder (see :func:`_private`)."""
    return Path(tempfile.gettempdir()) / f"gradcomp-kernels-{os.getuid()}"


def binary(family: str, capability: int, nvrtc: Any = None) -> Path:
    """The compiled ``family`` for a device of compute capability ``capability``: read from the
    cache when the source, options, architecture and NVRTC version match and the file holds
    what NVRTC makes (:func:`_cached`), else compiled and written there (atomically:
    concurrent ranks never see half a file)."""
    nv = _nvrtc() if nvrtc is None else nvrtc
    supported = getattr(nv, "getSupportedArchs", None)
    arch = gpu_architecture(capability, tuple(supported()) if supported else None)
    key = json.dumps([source(family), COMPILE_OPTIONS, arch, list(nv.getVersion())])
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    name = f"{family}-{arch}-{digest}.{'cubin' if arch.startswith('sm_') else 'ptx'}"
    data, problems = None, []
    for folder, private in ((cache_dir(), False), (temp_cache_dir(), True)):
        path = folder / name
        try:
            if private:
                _private(folder)
            if _cached(path, arch, private):
                return path
            if data is None:
                data = compile_family(family, arch, nv)
            _write_atomically(path, data)
            return path
        except OSError as exc:  # not writable, or not private: the next one
            problems.append(f"{folder}: {exc.strerror or exc}")
    raise KernelCompileError(f"no usable folder for compiled kernels ({'; '.join(problems)}); set "
                             f"GRADCOMP_KERNEL_CACHE to a folder this user can write")


def _private(folder: Path) -> None:
    """Make sure ``folder`` is private: created with mode 0700 if missing; an existing one must be
    a real folder (not a link) owned by this user that no one else can write to (read access
    for others is taken away); ``PermissionError`` otherwise, since another user could have
    planted files in it."""
    try:
        folder.mkdir(mode=0o700, parents=False)
    except FileExistsError:
        pass
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"not a private folder (it must be a folder owned by uid {os.getuid()} that no one "
                              f"else can write to; it is {'a folder' if stat.S_ISDIR(st.st_mode) else 'not a folder'} "
                              f"owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o})")
    if st.st_mode & 0o077:
        os.chmod(folder, 0o700)


def _cached(path: Path, arch: str, private: bool) -> bool:
    """Whether ``path`` holds a kernel to load: a regular file (not a link) whose bytes are what
    NVRTC makes for ``arch`` (an ELF cubin for a CUDA device, or PTX text for that target),
    and in the private folder also owned by this user and writable by no one else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or (private and (st.st_uid != os.getuid() or st.st_mode & 0o022)):
        return False
    data = path.read_bytes()
    if arch.startswith("sm_"):  # ELF, e_machine EM_CUDA (190)
        return data[:4] == b"\x7fELF" and len(data) > 20 and int.from_bytes(data[18:20], "little") == 190
    return data.lstrip().startswith(b"//") and b".version" in data and b".target sm_" + arch[8:].encode() in data


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def as_cupy(t: torch.Tensor) -> Any:
    """A CuPy view of ``t`` (no copy). Call it with torch's stream current in CuPy (as
    :class:`Launcher` does), so DLPack's stream handshake adds no wait."""
    view = _DLPACK_AS.get(t.dtype)
    return _cupy().from_dlpack(t.view(view) if view is not None else t)


def as_torch(a: Any) -> torch.Tensor:
    """A torch view of the CuPy array ``a`` (no copy)."""
    return torch.from_dlpack(a)


@functools.lru_cache(maxsize=None)
def _kernel(family: str, name: str, capability: int, index: int) -> Any:
    with _cupy().cuda.Device(index):  # a loaded module and its functions belong to one device
        return module(family, capability, index).get_function(name)


@functools.lru_cache(maxsize=None)
def module(family: str, capability: int, index: Optional[int] = None) -> Any:
    """The ``cupy.RawModule`` of ``family`` compiled for compute capability ``capability``
    (on first use, see :func:`binary`), one per device ``index``: a module loaded on one GPU
    cannot launch on another, even of the same capability (None: a module not yet tied to a
    device, loaded wherever it is first used)."""
    return _cupy().RawModule(path=str(binary(family, capability)))


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def compute_capability(index: int) -> int:
    """The device's compute capability as NVRTC spells it (9.0 -> 90)."""
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


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
        self.capability = compute_capability(device.index)
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
        _kernel(family, kernel, self.capability, self.device.index)((int(grid),), (int(block),), tuple(self._arg(a) for a in args))

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
