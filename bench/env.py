"""The environment header every benchmark prints first: versions, machine, ranks and link."""
from __future__ import annotations

import os
import platform
from typing import Any, Dict, List, Optional

import numpy as np
import torch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu() -> str:
    if not torch.cuda.is_available():
        return "none"
    return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))


def environment(world_size: int, link: str, threads: int) -> Dict[str, Any]:
    """Facts about this run that a reader needs to compare numbers across machines."""
    import gradcomp

    return {
        "gradcomp": gradcomp.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "cpu": _cpu_model(),
        "cores": os.cpu_count() or 1,
        "gpu": _gpu(),
        "world_size": world_size,
        "backend": "gloo",
        "threads_per_rank": threads,
        "link": link,
    }


def header(env: Dict[str, Any], settings: Optional[List[str]] = None) -> str:
    """The environment (and the run's settings) as a few aligned lines."""
    lines = [
        f"gradcomp {env['gradcomp']}  torch {env['torch']}  numpy {env['numpy']}  python {env['python']}",
        f"machine  {env['cpu']} ({env['cores']} cores), GPU: {env['gpu']}, {env['os']}",
        f"ranks    {env['world_size']} x {env['backend']}, {env['threads_per_rank']} thread(s) each",
        f"link     {env['link']}",
    ]
    lines += [f"{'run' if i == 0 else '':<8} {s}" for i, s in enumerate(settings or [])]
    return "\n".join(lines)
