"""The layout setup.py describes: each package folder at the root is gradcomp.<folder>
through a relative link, in a plain checkout, in editable installs and in wheels (which
``pip install .`` builds and installs)."""
import ast
import importlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _packages():
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_PACKAGES":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no _PACKAGES list")


PACKAGES = _packages()


def test_every_root_package_is_listed_and_linked():
    on_disk = sorted(p.name for p in ROOT.iterdir()
                     if (p / "__init__.py").is_file() and not p.is_symlink() and p.name != "gradcomp")
    assert sorted(PACKAGES) == on_disk, "setup.py's _PACKAGES and the package folders at the root differ"
    for name in PACKAGES:
        link = ROOT / "gradcomp" / name
        assert link.is_symlink() and os.readlink(link) == f"../{name}", \
            f"gradcomp/{name} should be a relative symlink to ../{name} (ln -s ../{name} gradcomp/{name})"
    src = ROOT / "src" / "gradcomp"
    assert src.is_symlink() and os.readlink(src) == "../gradcomp", "src/gradcomp should link to ../gradcomp"
    assert (ROOT / "gradcomp" / "py.typed").is_file()


@pytest.mark.parametrize("name", PACKAGES)
def test_package_imports_from_its_root_folder(name):
    mod = importlib.import_module(f"gradcomp.{name}")
    assert Path(mod.__file__).resolve() == ROOT / name / "__init__.py"


def test_bench_holds_only_the_command_line():
    """bench/ ships as ``python -m gradcomp.bench``: each of its modules is one the command line
    imports or starts (a subcommand, a rank's worker). The GPU check and one-off measurements are
    scripts of tools/, which is no package and stays out of the wheel."""
    from gradcomp.bench import cli

    bench = ROOT / "bench"
    modules = {p.stem for p in bench.glob("*.py")}
    todo, reached = ["__init__", "__main__", *cli.SUBCOMMANDS.values()], set()
    while todo:
        name = todo.pop()
        if name in reached or name not in modules:
            continue
        reached.add(name)
        for node in ast.walk(ast.parse((bench / f"{name}.py").read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.level == 1 or node.module == "gradcomp.bench"):
                todo += [node.module] if node.level and node.module else [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradcomp.bench."):
                todo.append(node.module.split(".")[2])
            elif isinstance(node, ast.Constant) and str(node.value).startswith("gradcomp.bench."):
                todo.append(node.value.split(".")[2])  # python -m gradcomp.bench._worker: what each rank runs
    assert modules == reached, f"modules of bench/ the command line never imports or starts: " \
                               f"{sorted(modules - reached)} (scripts of their own belong in tools/)"
    assert not (ROOT / "tools" / "__init__.py").exists() and (ROOT / "tools" / "gpu_check.py").is_file()


def test_the_measured_figures_are_documentation_not_package_data():
    """bench/RESULTS.md indexes one page per area in bench/results/ (with the plots); bench/ ships
    as gradcomp.bench, so setup.py's package_data must not name them, and no .md or .png may sit
    in a package folder that would make setuptools pick it up as a module."""
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    data = next(kw.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                for kw in node.keywords if kw.arg == "package_data")
    patterns = [p for v in ast.literal_eval(data).values() for p in v]
    assert not [p for p in patterns if p.endswith((".md", ".png")) or "results" in p], patterns
    assert (ROOT / "bench" / "RESULTS.md").is_file() and sorted((ROOT / "bench" / "results").glob("*.md"))
    assert not (ROOT / "bench" / "results" / "__init__.py").exists(), "bench/results/ is pages, not a package"


_CHECK_INSTALLED = """
import sys
from pathlib import Path
site = Path(sys.argv[1]).resolve()
sys.path.insert(0, str(site))
import torch
import gradcomp
from gradcomp.compress import ErrorFeedback, get_compressor
from gradcomp.collectives import allreduce
from gradcomp.kernels import _cupy
import gradcomp.bench, gradcomp.memory, gradcomp.optim, gradcomp.pipeline, gradcomp.training
for mod in (gradcomp, gradcomp.compress, gradcomp.bench, gradcomp.pipeline):
    assert Path(mod.__file__).resolve().is_relative_to(site), mod.__file__
t = torch.randn(1000)
c = ErrorFeedback(get_compressor("topk", ratio=0.1))
assert c.decompress(c.compress(t, key="w")).shape == t.shape
assert len(_cupy.families()) >= 6  # the kernels' sources are package data
print("installed ok")
"""


@pytest.mark.slow
def test_wheel_and_pip_install_outside_the_checkout(tmp_path):
    """``pip wheel .`` builds from a copy of the tree (the build writes build/ and *.egg-info
    where it runs); the wheel holds every module of every package folder, the kernels' CUDA
    sources and py.typed, nothing else (tools/ not, nor the measured figures: bench/RESULTS.md and
    bench/results/, pages and plots, are documentation that travels with the repository); installed
    with pip into a folder of its own, gradcomp imports and compresses from there, not from the
    checkout."""
    tree = tmp_path / "tree"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info")  # bench/results/ too: it must not ship
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        tree.mkdir(exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    for name in ["gradcomp", "src", *PACKAGES]:
        shutil.copytree(ROOT / name, tree / name, symlinks=True, ignore=skip)
    dist = tmp_path / "dist"
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(tree)],
                   check=True, cwd=tmp_path, timeout=900)  # a guard against a hang only
    (wheel,) = dist.glob("gradcomp-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {"gradcomp/__init__.py", "gradcomp/py.typed"}
    for name in PACKAGES:  # every module of a package and of its subpackages (collectives/wire)
        for f in (ROOT / name).rglob("*.py"):
            if "__pycache__" not in f.parts and (f.parent / "__init__.py").is_file():
                expected.add(f"gradcomp/{f.relative_to(ROOT).as_posix()}")
    expected |= {f"gradcomp/kernels/cuda/{f.name}" for f in (ROOT / "kernels" / "cuda").iterdir()
                 if f.suffix in (".cu", ".cuh")}
    code = {n for n in names if ".dist-info/" not in n}
    assert code == expected, f"missing: {sorted(expected - code)}; extra: {sorted(code - expected)}"
    site = tmp_path / "site"
    subprocess.run(pip + ["install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
                   check=True, cwd=tmp_path, timeout=900)
    out = subprocess.run([sys.executable, "-c", _CHECK_INSTALLED, str(site)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and out.stdout.strip().endswith("installed ok"), out.stdout + out.stderr
