"""Before/after timings of a refactor: one benchmark command run alternately from two source
trees on the same machine, so a change in the machine's load hits both alike.

    python tools/alternate.py --before /path/to/old/tree --after . --rounds 3 \\
        --metric collective_ms --key method -- --numel 25000000 --compressors onebit,topk,fp16 --repeats 3

Each round runs ``python -m gradcomp.bench <args> --json F`` in the "before" tree, then in the
"after" tree (the order alternates from round to round), each with that tree first on
``PYTHONPATH`` and as the working directory (its rank processes import that tree's gradcomp).
Prints, per record key, the median of ``--metric`` over the rounds for each tree and their ratio
(after / before: below 1 is faster), and the per-round values.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List


def run(tree: str, args: List[str], out: str) -> List[Dict]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "gradcomp.bench", *args, "--json", out, "--no-progress"]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    with open(out) as f:
        return json.load(f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True)
    p.add_argument("--after", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--metric", required=True, help="the JSON field to compare (e.g. collective_ms, step_ms)")
    p.add_argument("--key", default="method", help="the JSON field that names a record (default method)")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the benchmark's arguments")
    a = p.parse_args()
    args = a.bench[1:] if a.bench[:1] == ["--"] else a.bench
    values: Dict[str, Dict[str, List[float]]] = {"before": {}, "after": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            order = ("before", "after") if i % 2 == 0 else ("after", "before")
            for side in order:
                recs = run(getattr(a, side), args, os.path.join(tmp, f"{side}{i}.json"))
                for r in recs:
                    if r.get(a.metric) is not None:
                        values[side].setdefault(str(r[a.key]), []).append(float(r[a.metric]))
                print(f"round {i + 1} {side}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in values[side].items()),
                      flush=True)
    print(f"\n| {a.key} | before {a.metric} (median) | after | after / before |")
    print("|---|---|---|---|")
    for k in values["before"]:
        b, f = statistics.median(values["before"][k]), statistics.median(values["after"].get(k, [float("nan")]))
        print(f"| {k} | {b:.2f} | {f:.2f} | {f / b:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
