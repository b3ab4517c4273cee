"""Start benchmark ranks as separate processes (on loopback or in an emulated cluster).

Every rank runs ``python -m gradcomp.bench._worker SPEC RANK``; the ranks meet through a
``FileStore`` in a private temporary folder (no port to pick, works across namespaces), and
each writes its result as JSON next to it. Rank 0 reports progress on its stdout, which the
parent turns into a progress bar. The parent bounds the run in time, stops every rank as soon
as one fails (a dead peer would otherwise leave the others waiting on gloo) and always kills
the ranks and removes the folder, whatever ends the run.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from typing import Any, Callable, Dict, List, Optional

from . import netem

PROGRESS = "@progress "  # prefix of rank 0's progress lines


class RankError(RuntimeError):
    """A rank failed or the run took too long; the message carries the rank's last output."""


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return "(no output)"


def _pump(stream, out: "queue.Queue[Optional[str]]") -> None:
    for line in stream:
        out.put(line)
    out.put(None)


def run_ranks(task: str, cfg: Dict[str, Any], world_size: int, *, link: Optional[netem.Link] = None,
              threads: int = 1, timeout_s: float = 1800.0,
              on_progress: Optional[Callable[[Dict[str, Any]], None]] = None, local_size: int = 1) -> List[Any]:
    """Run ``task`` (a name in ``_worker.TASKS``) on ``world_size`` ranks; results in rank order.
    With ``link``, nodes of ``local_size`` ranks each get a namespace (see ``netem.Cluster``)."""
    if not 1 <= world_size <= netem.MAX_RANKS:
        raise ValueError(f"world size must be between 1 and {netem.MAX_RANKS}, not {world_size}")
    procs: List[subprocess.Popen] = []
    with ExitStack() as stack:
        tmp = tempfile.mkdtemp(prefix="gradcomp-bench-")
        stack.callback(shutil.rmtree, tmp, True)
        cluster = stack.enter_context(netem.Cluster(world_size, link, local_size)) if link is not None else None
        stack.callback(_stop, procs)
        spec = {"task": task, "cfg": cfg, "world_size": world_size, "threads": threads,
                "store": os.path.join(tmp, "store"), "out": tmp, "timeout_s": timeout_s}
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
                   GLOO_SOCKET_IFNAME=netem.IFACE if cluster else "lo")
        logs = [os.path.join(tmp, f"rank{r}.log") for r in range(world_size)]
        for r in range(world_size):
            argv = [sys.executable, "-m", "gradcomp.bench._worker", spec_path, str(r)]
            log = stack.enter_context(open(logs[r], "w", encoding="utf-8"))
            io = {"stdout": subprocess.PIPE if r == 0 else log, "stderr": log, "stdin": subprocess.DEVNULL,
                  "env": env, "text": True}
            if cluster is not None:
                procs.append(cluster.popen(r, argv, **io))
            else:
                # a new session: Ctrl-C reaches only this process, whose cleanup stops the ranks
                procs.append(subprocess.Popen(argv, start_new_session=True, **io))
        lines: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=_pump, args=(procs[0].stdout, lines), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        eof = False
        while True:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                line = ""
            if line is None:
                eof = True
            if line and line.startswith(PROGRESS):
                if on_progress is not None:
                    on_progress(json.loads(line[len(PROGRESS):]))
            elif line:
                sys.stderr.write(line)
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                r = failed[0]
                raise RankError(f"rank {r} exited with code {codes[r]}; its last output:\n{_tail(logs[r])}")
            if eof and all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                raise RankError(f"the run did not finish within {timeout_s:g} s (raise --timeout if it needs "
                                f"longer); rank 0's last output:\n{_tail(logs[0])}")
        results = []
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.json")
            if not os.path.exists(path):
                raise RankError(f"rank {r} exited without writing a result; its last output:\n{_tail(logs[r])}")
            with open(path, encoding="utf-8") as f:
                results.append(json.load(f))
        return results


def _stop(procs: List[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
