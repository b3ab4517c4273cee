"""Run a function on 2 or 4 real gloo ranks and return every rank's result to the test.

``run_ranks(fn, world_size, tmp_path, *args)`` spawns ``world_size`` processes with
``torch.multiprocessing``, joins them through a ``FileStore`` in ``tmp_path``, calls
``fn(rank, world_size, *args)`` in each and returns the list of return values (rank order).
An exception on any rank is re-raised in the test with that rank's traceback. ``fn`` must be
a module-level function (it is pickled by reference).

Every rank runs under the strict NCCL mode (``tests/strict.py``: gloo made as strict as NCCL on
pair ordering, threads, devices and object collectives) unless ``strict=False``.
"""
from __future__ import annotations

import os
import pickle
import socket
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:
    from . import strict as _strict
except ImportError:  # tests/ is on sys.path and this module is imported as ``ranks``
    import strict as _strict


def _entry(rank: int, world_size: int, store_path: str, out_dir: str, fn: Callable, args: tuple, timeout_s: float,
           port: int, strict: bool = True) -> None:
    torch.set_num_threads(1)
    out = os.path.join(out_dir, f"rank{rank}.pkl")
    result: Any
    try:
        if strict:
            _strict.install()
        if port:  # what torchrun gives a rank; fn initialises (and may destroy) the group itself
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                              LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        else:
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s))
        try:
            result = ("ok", fn(rank, world_size, *args))
        except BaseException as exc:
            # Reported before the clean-up, which may wait on a peer or a thread stuck in the
            # failed exchange; the clean-up then gets a bounded time.
            _write(out, ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
            closer = threading.Thread(target=_close, daemon=True)
            closer.start()
            closer.join(timeout_s)
            os._exit(0)
        _close()
    except BaseException as exc:  # report everything to the parent
        result = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    _write(out, result)


def _close() -> None:
    from gradcomp.training import shutdown

    try:
        shutdown()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _write(path: str, result: Any) -> None:
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)


def _any_error(out_dir: str, world_size: int) -> bool:
    for r in range(world_size):
        path = os.path.join(out_dir, f"rank{r}.pkl")
        if os.path.exists(path):
            try:
                with open(path, "rb") as f:
                    if pickle.load(f)[0] == "error":
                        return True
            except Exception:  # being written
                continue
    return False


def free_ports(n: int) -> List[int]:
    """``n`` distinct TCP ports free on the loopback now."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run_ranks(fn: Callable, world_size: int, tmp_path, *args: Any, timeout_s: float = 60.0,
              torchrun_env: bool = False, strict: Optional[bool] = None) -> List[Any]:
    """Results of ``fn(rank, world_size, *args)`` on every rank; raises if any rank failed.
    ``torchrun_env=True``: no group is made; each rank gets torchrun's environment variables
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ...) and ``fn`` calls
    ``init_process_group`` itself, as a script under torchrun does. ``strict=False``: without
    the strict NCCL mode (say why at the call; ``GRADCOMP_STRICT=0`` turns it off for every
    call, to measure what it costs). Once a rank has reported an error the others
    get ``timeout_s`` more (a rank blocked on a failed peer raises within its group timeout)."""
    if strict is None:
        strict = os.environ.get("GRADCOMP_STRICT", "1") != "0"
    store_path = os.path.join(str(tmp_path), f"store-{os.getpid()}-{id(fn)}-{world_size}")
    out_dir = os.path.join(str(tmp_path), f"out-{os.getpid()}-{id(fn)}-{world_size}")
    os.makedirs(out_dir, exist_ok=True)
    port = free_ports(1)[0] if torchrun_env else 0
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(r, world_size, store_path, out_dir, fn, args, timeout_s, port, strict))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s * 3
    while time.monotonic() < deadline:
        alive = [p for p in procs if p.is_alive()]  # read once: a rank may exit between two readings
        if not alive:
            break
        alive[0].join(0.2)
        if deadline - time.monotonic() > timeout_s and _any_error(out_dir, world_size):
            deadline = time.monotonic() + timeout_s
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results, errors = [], []
    for r in range(world_size):
        path = os.path.join(out_dir, f"rank{r}.pkl")
        if not os.path.exists(path):
            errors.append(f"rank {r}: exited with code {procs[r].exitcode} and no result")
            results.append(None)
            continue
        with open(path, "rb") as f:
            status, value = pickle.load(f)
        if status == "error":
            errors.append(value)
        results.append(value)
    if errors:
        raise AssertionError("distributed run failed:\n" + "\n".join(errors))
    return results
