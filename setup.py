"""gradcomp: compressed gradient communication for distributed PyTorch training."""
from setuptools import setup

_PACKAGES = ["compress", "kernels", "collectives", "training", "bench"]

setup(
    name="gradcomp",
    version="0.1.0",
    description="Gradient compression with error feedback and compressed collectives for torch.distributed",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=["gradcomp"] + [f"gradcomp.{p}" for p in _PACKAGES],
    package_dir={"gradcomp": "gradcomp", **{f"gradcomp.{p}": p for p in _PACKAGES}},
    package_data={"gradcomp.kernels": ["cuda/*.cu", "cuda/*.cuh"]},
    install_requires=["torch>=2.1", "numpy"],
    extras_require={
        # CuPy built for the CUDA major version of torch (torch.version.cuda): 12 or 13
        "cuda": ["cupy-cuda12x"],
        "cuda13": ["cupy-cuda13x"],
        "test": ["pytest", "hypothesis", "pytest-benchmark"],
        "bench": ["matplotlib", "scikit-learn", "tqdm"],
    },
)
