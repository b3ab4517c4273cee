"""The layout setup.py describes: each package folder at the root is gradcomp.<folder>
through a relative link, in a plain checkout, in editable installs and in wheels."""
import ast
import importlib
import os
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
