"""Every kernel family compiles for sm_80 and sm_90, so a syntax error never waits for a GPU.

The text compiled is what CuPy hands NVRTC (``_cupy.source``: headers inlined) with the
same options; warnings are errors. ``ptxas`` then assembles the PTX, which catches resource
errors (too much shared memory, bad inline PTX) that only show at load time otherwise.
"""
import re
import shutil
import subprocess

import pytest

from gradcomp.kernels import _cupy

ARCHS = ("sm_80", "sm_90")
NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH: CUDA sources cannot be compiled here")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Compile all families for both architectures at once (two parallel nvcc runs)."""
    src = tmp_path_factory.mktemp("cuda_src")
    files = []
    for fam in _cupy.families():
        path = src / f"{fam}.cu"
        path.write_text(_cupy.source(fam))
        files.append(str(path))
    procs = {}
    for arch in ARCHS:
        out = src / arch
        out.mkdir()
        cmd = [NVCC, "-ptx", f"-arch={arch}", *_cupy.COMPILE_OPTIONS, "-Werror", "all-warnings",
               "-odir", str(out), *files]
        procs[arch] = (out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = {}
    for arch, (out, proc) in procs.items():
        log = proc.communicate(timeout=300)[0]
        results[arch] = (proc.returncode, log, out)
    return results


@pytest.mark.parametrize("arch", ARCHS)
def test_every_family_compiles_to_ptx(compiled, arch):
    rc, log, out = compiled[arch]
    assert rc == 0, f"nvcc -ptx -arch={arch} failed:\n{log}"
    for fam in _cupy.families():
        assert (out / f"{fam}.ptx").is_file(), f"no PTX for {fam}.cu"


@pytest.mark.parametrize("arch", ARCHS)
def test_ptx_assembles(compiled, arch):
    rc, log, out = compiled[arch]
    if rc:
        pytest.skip("nvcc failed; reported by test_every_family_compiles_to_ptx")
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("ptxas is not on PATH")
    procs = [(p, subprocess.Popen([ptxas, "-v", f"-arch={arch}", str(p), "-o", str(p.with_suffix(".cubin"))],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
             for p in sorted(out.glob("*.ptx"))]
    logs = {p.name: proc.communicate(timeout=300)[0] for p, proc in procs}
    failures = [f"{p.name}: {logs[p.name]}" for p, proc in procs if proc.returncode != 0]
    assert not failures, "\n".join(failures)
    # a register spill turns a streaming kernel's loads into local-memory round trips
    spills = [f"{name}: {line.strip()}" for name, log in logs.items() for line in log.splitlines()
              if re.search(r"[1-9]\d* bytes spill (stores|loads)", line)]
    assert not spills, "kernels spill registers:\n" + "\n".join(spills)
    assert sum(log.count("Compiling entry function") for log in logs.values()) >= len(_cupy.families())


@pytest.mark.parametrize("family", _cupy.families())
def test_source_needs_no_system_header(family):
    """NVRTC has no C/C++ library headers; nvcc would accept them silently."""
    text = _cupy.source(family)
    assert not re.search(r"^\s*#include", text, re.M), f"{family}.cu includes a header NVRTC lacks"
    assert not re.search(r"\bstd::|\b(u?int(8|16|32|64)_t|size_t)\b", text), \
        f"{family}.cu uses a name that NVRTC defines only with the C++ library headers"
