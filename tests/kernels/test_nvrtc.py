"""The kernels compiled the way a GPU machine compiles them: ``_cupy.binary`` calling NVRTC with
our options, no GPU needed. Runs where the NVRTC library is found (CI installs the pip package
``nvidia-cuda-nvrtc``); the plain ``nvcc`` check is ``test_cuda_compile.py``.

The arithmetic must be IEEE: CuPy's ``RawModule(code=...)`` appends ``-ftz=true`` after the
caller's options, which flushes subnormals to zero (a negative subnormal would pack as a
positive sign, a subnormal residual would vanish). The PTX we build has no ``.ftz``
instruction; the same source built with CuPy's extra option has them, so the check bites.
"""
import re

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
