"""One benchmark rank: ``python -m gradcomp.bench._worker SPEC RANK`` (started by ``launch``).

Joins the gloo group through the spec's ``FileStore``, runs the named task and writes its
result to ``rank{RANK}.json`` in the spec's folder. Rank 0 prints progress lines.
"""
from __future__ import annotations

import gc
import json
import os
import sys
from datetime import timedelta
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist

from .launch import PROGRESS

COLLECTIVE_TIMEOUT_S = 300.0  # no single collective of a benchmark takes this long: a peer is gone


def _task(name: str) -> Callable:
    import importlib

    module, func = {"collective": ("collective", "run_rank"), "train": ("train", "run_rank"),
                    "dense-probe": ("collective", "dense_probe"), "sharded": ("sharded", "run_rank"),
                    "optim": ("optim", "run_rank"), "pipeline": ("pipeline", "run_rank"),
                    "fsdp": ("fsdp", "run_rank"), "diloco": ("diloco", "run_rank")}[name]
    return getattr(importlib.import_module(f"gradcomp.bench.{module}"), func)


def main(argv) -> int:
    spec_path, rank = argv[0], int(argv[1])
    with open(spec_path, encoding="utf-8") as f:
        spec: Dict[str, Any] = json.load(f)
    torch.set_num_threads(int(spec["threads"]))
    world = int(spec["world_size"])
    store = dist.FileStore(spec["store"], world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=min(float(spec["timeout_s"]), COLLECTIVE_TIMEOUT_S)))

    def progress(**info: Any) -> None:
        if rank == 0:
            print(PROGRESS + json.dumps(info), flush=True)

    try:
        result = _task(spec["task"])(rank, world, spec["cfg"], progress)
        dist.barrier()
    finally:
        from gradcomp.training import shutdown

        # the task's models, FSDP states and pending works (reference cycles) go now, while
        # their process groups still exist, not at interpreter exit after them
        gc.collect()
        shutdown()  # worker threads and twin groups go before the groups they mirror
        dist.destroy_process_group()
    tmp = os.path.join(spec["out"], f".rank{rank}.json")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(spec["out"], f"rank{rank}.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
