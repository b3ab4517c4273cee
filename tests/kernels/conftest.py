"""Fixtures of the kernel tests: ``emu`` runs the CUDA kernels on CPU tensors (g++ needed)."""
import shutil
import sys
from pathlib import Path

import pytest

from gradcomp.kernels import _cupy

sys.path.insert(0, str(Path(__file__).parent))  # cuda_emu sits beside this file
from cuda_emu import EmulatedLauncher, Emulator  # noqa: E402


@pytest.fixture(scope="session")
def _emulator(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to run the CUDA kernels on the CPU emulation")
    return Emulator(tmp_path_factory.mktemp("cuda_emu"))


@pytest.fixture
def emu(_emulator, monkeypatch):
    """While a test runs, ``_cupy.launcher`` is the CPU emulation: call the ``launch_<op>``
    functions of ``kernels/_launch_<family>.py`` on CPU tensors."""
    monkeypatch.setattr(_cupy, "launcher", lambda device: EmulatedLauncher(_emulator, device))
    _emulator.launches.clear()
    return _emulator
