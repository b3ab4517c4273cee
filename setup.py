"""gradcomp: compressed gradient communication for distributed PyTorch training."""
import os

from setuptools import setup

# Layout: the code stays in the folders at the repository root, and gradcomp/<folder> is a
# relative symlink to each (gradcomp/compress -> ../compress), so the tree itself has the
# package's shape: a plain checkout imports gradcomp.* from the root, and mypy and pyright
# resolve it with no package_dir mapping (which they cannot read). src/ holds only
# src/gradcomp -> ../gradcomp and is the package root, so an editable install is one plain
# path in a .pth file (static tools follow it, unlike setuptools' import hook) that puts
# exactly one name, gradcomp, on sys.path; the repository root there would also make compress,
# bench, tests and setup importable as top-level names. Wheels and sdists get the files
# behind the links. A checkout needs symlinks (git on Windows: core.symlinks=true).
# tests/test_layout.py keeps the links, this list and the folders in step. tools/ (the GPU check,
# one-off measurements, the pytest-benchmark file) is no package: it stays out of wheels and sdists.
# The measured figures (bench/RESULTS.md and bench/results/: pages and plots) are documentation, not
# package data: they stay out of wheels and sdists too (a checkout reaches them as gradcomp/bench/...).
_PACKAGES = ["compress", "kernels", "collectives", "training", "sharded", "memory", "optim", "pipeline", "bench"]


def _subpackages(roots):
    """Every folder with an __init__.py below the packages (collectives/wire -> gradcomp.collectives.wire)."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = []
    for root in roots:
        for path, dirs, files in os.walk(os.path.join(here, root)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            rel = os.path.relpath(path, here)
            if rel != root and "__init__.py" in files:
                found.append("gradcomp." + rel.replace(os.sep, "."))
    return found


setup(
    name="gradcomp",
    version="0.1.0",
    description="Gradient compression with error feedback and compressed collectives for torch.distributed",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    license_files=["LICENSE"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
        "Typing :: Typed",
    ],
    python_requires=">=3.9",
    package_dir={"": "src"},
    packages=["gradcomp"] + [f"gradcomp.{p}" for p in _PACKAGES] + _subpackages(_PACKAGES),
    package_data={"gradcomp": ["py.typed"], "gradcomp.kernels": ["cuda/*.cu", "cuda/*.cuh"]},
    # numpy 2: np.bitwise_count (onebit, bit counting); torch 2.6: group_dst/group_src in
    # torch.distributed's point-to-point and gather/scatter calls; numba 0.60: the first for
    # numpy 2 (kernels/cpu.py's fused CPU loops; without it the numpy paths run). README,
    # "Tests", says how each floor is checked.
    install_requires=["torch>=2.6", "numpy>=2.0", "numba>=0.60"],
    extras_require={
        # CuPy built for the CUDA major version of torch (torch.version.cuda): 12 or 13
        "cuda": ["cupy-cuda12x"],
        "cuda13": ["cupy-cuda13x"],
        "test": ["pytest", "pytest-xdist", "hypothesis", "pytest-benchmark", "mypy"],
        "bench": ["matplotlib", "scikit-learn", "tqdm"],
        # what examples/train_lightning.py and examples/train_accelerate.py run on
        "lightning": ["lightning"],
        "accelerate": ["accelerate"],
    },
)
