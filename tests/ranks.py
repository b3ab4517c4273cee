"""Run a function on 2 or 4 real gloo ranks and return every rank's result to the test.

``run_ranks(fn, world_size, tmp_path, *args)`` spawns ``world_size`` processes with
``torch.multiprocessing``, joins them through a ``FileStore`` in ``tmp_path``, calls
``fn(rank, world_size, *args)`` in each and returns the list of return values (rank order).
An exception on any rank is re-raised in the test with that rank's traceback. ``fn`` must be
a module-level function (it is pickled by reference).

Bounds count work, not the machine's load: starting the ranks (a process each, importing
torch and the test) has its own generous bound (``START_S``); the ranks join the group
together once all have started, and the run's deadline (``deadline_s``, by default three
group timeouts) counts from then, so a loaded machine that is slow to start processes eats
neither the group's timeout nor the time a test gives its ranks. A run ends as soon as every
rank has reported, however generous its deadline.

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


START_S = 300.0  # seconds the ranks may take to start (spawn, imports, joining the group) on a loaded machine


def _entry(rank: int, world_size: int, store_path: str, out_dir: str, fn: Callable, args: tuple, timeout_s: float,
           port: int, strict: bool = True) -> None:
    torch.set_num_threads(1)
    out = os.path.join(out_dir, f"rank{rank}.pkl")
    result: Any
    try:
        if strict:
            _strict.install()
        # every rank joins the group only once all have started, so a peer that a loaded machine
        # started late does not count against the group's timeout (nor the run's deadline)
        _start_together(out_dir, rank, world_size)
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


def _started(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.started")


def _all_started(out_dir: str, world_size: int) -> bool:
    return all(os.path.exists(_started(out_dir, r)) for r in range(world_size))


def _start_together(out_dir: str, rank: int, world_size: int) -> None:
    """Say this rank has started (spawned, torch and the test imported) and wait, at most
    ``START_S``, until every rank has."""
    open(_started(out_dir, rank), "w").close()
    until = time.monotonic() + START_S
    while not _all_started(out_dir, world_size):
        if time.monotonic() > until:
            raise RuntimeError(f"not every rank started within {START_S:g} s")
        time.sleep(0.02)


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
              torchrun_env: bool = False, strict: Optional[bool] = None,
              deadline_s: Optional[float] = None) -> List[Any]:
    """Results of ``fn(rank, world_size, *args)`` on every rank; raises if any rank failed.
    ``timeout_s``: the process group's timeout. ``torchrun_env=True``: no group is made; each
    rank gets torchrun's environment variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``, ...) and ``fn`` calls ``init_process_group`` itself, as a script under
    torchrun does. ``strict=False``: without the strict NCCL mode (say why at the call;
    ``GRADCOMP_STRICT=0`` turns it off for every call, to measure what it costs).
    ``deadline_s``: how long the ranks may run once all have started (default ``3 *
    timeout_s``), after up to ``START_S`` to start; once a rank has reported an error the
    others get ``timeout_s`` more (a rank blocked on a failed peer raises within its group
    timeout). A rank still running then is killed and reported as such."""
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
    began = time.monotonic()
    run = timeout_s * 3 if deadline_s is None else deadline_s
    deadline = began + START_S + run  # until every rank has started; then the run's own deadline
    running = False
    while time.monotonic() < deadline:
        alive = [p for p in procs if p.is_alive()]  # read once: a rank may exit between two readings
        if not alive:
            break
        alive[0].join(0.2)
        now = time.monotonic()
        if not running and (_all_started(out_dir, world_size) or len(alive) < world_size):
            running, deadline = True, min(deadline, now + run)
        if deadline - now > timeout_s and _any_error(out_dir, world_size):
            deadline = now + timeout_s
    killed = [p.is_alive() for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results, errors = [], []
    for r in range(world_size):
        path = os.path.join(out_dir, f"rank{r}.pkl")
        if not os.path.exists(path):
            if killed[r]:
                when = ("it had started and was still running at the deadline" if os.path.exists(_started(out_dir, r))
                        else f"it had not started {time.monotonic() - began:.0f} s after it was spawned")
                errors.append(f"rank {r}: killed with no result ({when}; deadline_s={run:g}, timeout_s={timeout_s:g})")
            else:
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
