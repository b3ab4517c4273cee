"""The kernels compiled the way a GPU machine compiles them: ``_cupy.binary`` calling NVRTC with
our options, no GPU needed. Runs where the NVRTC library is found (CI installs the pip package
``nvidia-cuda-nvrtc``); the plain ``nvcc`` check is ``test_cuda_compile.py``.

The arithmetic must be IEEE: CuPy's ``RawModule(code=...)`` appends ``-ftz=true`` after the
caller's options, which flushes subnormals to zero (a negative subnormal would pack as a
positive sign, a subnormal residual would vanish). The PTX we build has no ``.ftz``
instruction; the same source built with CuPy's extra option has them, so the check bites.

The cache's fallback in the temp folder has a predictable name, so another local user could
plant code there: it is used only as a private folder (this user's, mode 0700), and a cached
file is loaded only if it is a regular file holding a cubin. Those checks use a stand-in
binding and run everywhere.
"""
import os
import re
import stat
import tempfile
from pathlib import Path

import pytest

from gradcomp.kernels import _cupy

from nvrtc_ctypes import Binding, find_library  # beside this file (conftest puts it on the path)

LIB = find_library()
needs_nvrtc = pytest.mark.skipif(LIB is None, reason="no NVRTC library (pip install nvidia-cuda-nvrtc)")


@pytest.fixture(scope="module")
def nvrtc():
    return Binding(LIB)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADCOMP_KERNEL_CACHE", str(tmp_path / "kernels"))
    return tmp_path / "kernels"


@needs_nvrtc
@pytest.mark.parametrize("capability", [80, 90])
def test_every_family_compiles_to_a_cubin_and_is_cached(nvrtc, cache, capability):
    for fam in _cupy.families():
        path = _cupy.binary(fam, capability, nvrtc)
        assert path.parent == cache and path.suffix == ".cubin" and f"sm_{capability}" in path.name
        assert path.read_bytes()[:4] == b"\x7fELF", f"{fam}: not a cubin"
    calls = len(nvrtc.compiled)
    assert [_cupy.binary(fam, capability, nvrtc) for fam in _cupy.families()] == sorted(cache.glob(f"*sm_{capability}*"))
    assert len(nvrtc.compiled) == calls, "a cached family was compiled again"
    assert not list(cache.glob(".*")), "temporary files left in the cache"


@needs_nvrtc
def test_options_are_ours_and_complete(nvrtc, cache):
    _cupy.binary("bits", 90, nvrtc)
    opts = nvrtc.compiled[-1]
    assert opts == _cupy.COMPILE_OPTIONS + ("--gpu-architecture=sm_90",)
    assert "--ftz=false" in opts and "--fmad=false" in opts and not any("ftz=true" in o for o in opts)


@needs_nvrtc
@pytest.mark.parametrize("family", _cupy.families())
def test_ptx_keeps_subnormals(nvrtc, family):
    ptx = _cupy.compile_family(family, "compute_90", nvrtc).decode()
    assert ".entry" in ptx
    flushing = re.findall(r"^\s*\S*\.ftz\.\S*.*$", ptx, re.M)
    assert not flushing, f"{family}.cu flushes subnormals:\n" + "\n".join(flushing[:5])


@needs_nvrtc
def test_the_subnormal_check_bites(nvrtc, monkeypatch):
    """What CuPy's own compile path would build: options followed by -ftz=true."""
    monkeypatch.setattr(_cupy, "COMPILE_OPTIONS", _cupy.COMPILE_OPTIONS + ("-ftz=true",))
    ptx = _cupy.compile_family("sign", "compute_90", nvrtc).decode()
    assert re.search(r"\.ftz\b", ptx)


@needs_nvrtc
def test_compile_error_carries_the_log(nvrtc, monkeypatch):
    monkeypatch.setattr(_cupy, "source", lambda family: "extern \"C\" __global__ void k() { undeclared(); }")
    with pytest.raises(_cupy.KernelCompileError, match="undeclared"):
        _cupy.compile_family("broken", "sm_90", nvrtc)


@needs_nvrtc
def test_unwritable_cache_falls_back_to_the_temp_folder(nvrtc, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("GRADCOMP_KERNEL_CACHE", str(blocker / "kernels"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(_cupy.tempfile, "tempdir", None)  # re-read TMPDIR
    path = _cupy.binary("rng", 90, nvrtc)
    assert path.is_relative_to(tmp_path / "tmp") and path.read_bytes()[:4] == b"\x7fELF"


def test_architecture_choice():
    supported = (75, 80, 86, 87, 89, 90, 100, 120)
    assert _cupy.gpu_architecture(90, supported) == "sm_90"
    assert _cupy.gpu_architecture(88, supported) == "compute_87"  # unknown to NVRTC: PTX, driver JIT
    assert _cupy.gpu_architecture(130, supported) == "compute_120"
    assert _cupy.gpu_architecture(90, None) == "sm_90"
    with pytest.raises(_cupy.KernelCompileError, match="no architecture at or below sm_70"):
        _cupy.gpu_architecture(70, supported)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("GRADCOMP_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _cupy.cache_dir() == tmp_path / "gradcomp" / "kernels"
    monkeypatch.setenv("GRADCOMP_KERNEL_CACHE", str(tmp_path / "k"))
    assert _cupy.cache_dir() == tmp_path / "k"


class _FakeNVRTC:
    """CuPy's NVRTC interface without NVRTC: every compile makes the same small cubin (ELF,
    e_machine EM_CUDA), so the cache logic runs anywhere."""

    CUBIN = b"\x7fELF" + bytes(14) + (190).to_bytes(2, "little") + b"compiled here"

    def __init__(self):
        self.compiled = 0

    def getVersion(self):
        return (12, 4)

    def createProgram(self, *args):
        return object()

    def compileProgram(self, prog, options):
        self.compiled += 1

    def getCUBIN(self, prog):
        return self.CUBIN

    def destroyProgram(self, prog):
        pass


@pytest.fixture
def temp_only(tmp_path, monkeypatch):
    """Only the temp-folder fallback is usable: the cache folder sits under a regular file."""
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("GRADCOMP_KERNEL_CACHE", str(tmp_path / "file" / "kernels"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(_cupy.tempfile, "tempdir", None)  # re-read TMPDIR
    return _temp_folder()


def _temp_folder():
    return Path(tempfile.gettempdir()) / f"gradcomp-kernels-{os.getuid()}"


def _plant(folder, mode, content=b"\x7fELF planted by another user"):
    """A cubin where ``binary("rng", 90)`` would look for it, in ``folder`` of ``mode``."""
    folder.mkdir(exist_ok=True)
    os.chmod(folder, 0o700)
    path = _cupy.binary("rng", 90, _FakeNVRTC())  # where the real one goes
    path.write_bytes(content)
    os.chmod(folder, mode)
    return path


def test_the_temp_folder_is_made_private(temp_only):
    nv = _FakeNVRTC()
    path = _cupy.binary("rng", 90, nv)
    assert path.parent == temp_only and path.read_bytes() == _FakeNVRTC.CUBIN
    st = os.lstat(temp_only)
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert _cupy.binary("rng", 90, nv) == path and nv.compiled == 1, "a valid cached kernel was compiled again"


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777], ids=oct)
def test_a_temp_folder_others_can_write_to_is_refused(temp_only, mode):
    planted = _plant(temp_only, mode)
    with pytest.raises(_cupy.KernelCompileError, match="not a private folder"):
        _cupy.binary("rng", 90, _FakeNVRTC())
    assert planted.read_bytes().endswith(b"planted by another user")


def test_a_temp_folder_of_another_user_is_refused(temp_only, monkeypatch):
    """The folder exists under the name of a uid that is not its owner's."""
    monkeypatch.setattr(_cupy.os, "getuid", lambda: os.lstat(temp_only.parent).st_uid + 1)
    other = _temp_folder()
    other.mkdir(mode=0o700)
    with pytest.raises(_cupy.KernelCompileError, match=f"owned by uid {os.lstat(other).st_uid} "):
        _cupy.binary("rng", 90, _FakeNVRTC())


def test_a_temp_folder_that_is_a_link_is_refused(temp_only, tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    temp_only.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(_cupy.KernelCompileError, match="not a private folder"):
        _cupy.binary("rng", 90, _FakeNVRTC())


def test_a_readable_temp_folder_of_this_user_is_made_private(temp_only):
    """Only writing lets others plant files: an own folder others may read is kept, at 0700."""
    temp_only.mkdir(mode=0o755)
    os.chmod(temp_only, 0o755)
    path = _cupy.binary("rng", 90, _FakeNVRTC())
    assert path.parent == temp_only and stat.S_IMODE(os.lstat(temp_only).st_mode) == 0o700


@pytest.mark.parametrize("content", [b"", b"\x7fELF", b"#!/bin/sh\n", _FakeNVRTC.CUBIN[:18] + b"\x03\x00rest"],
                         ids=["empty", "magic-only", "script", "x86-elf"])
def test_a_cached_file_that_is_not_a_cubin_is_compiled_again(temp_only, content):
    planted = _plant(temp_only, 0o700, content)
    nv = _FakeNVRTC()
    assert _cupy.binary("rng", 90, nv) == planted and nv.compiled == 1
    assert planted.read_bytes() == _FakeNVRTC.CUBIN


def test_a_cached_link_is_not_followed(temp_only, tmp_path):
    target = tmp_path / "elsewhere.cubin"
    target.write_bytes(_FakeNVRTC.CUBIN)
    planted = _plant(temp_only, 0o700)
    planted.unlink()
    planted.symlink_to(target)
    nv = _FakeNVRTC()
    path = _cupy.binary("rng", 90, nv)
    assert nv.compiled == 1 and not path.is_symlink() and path.read_bytes() == _FakeNVRTC.CUBIN
