"""Every GPU check of gradcomp in one run: ``bash tools/gpu_check.sh [--list] REPORT.md``.

The run is cut into parts (install, environment, collection, NVRTC compile, the ``gpu`` tests in
groups, an NCCL smoke test where there are two GPUs, two benchmarks), each under a time cap;
the caps add up to the budget, which fits one 10-minute device session. A part passes only
if its command succeeded *and* at least its minimum of tests (or checks) passed, so a part
whose tests were all skipped, deselected or never collected fails instead of passing
vacuously. The report (markdown, also printed) lists each part with its passed, failed and
skipped counts, its minimum, its time and cap, and the environment.

Tests are picked by marker and file: every ``tests/**/test_*.py`` that mentions
``mark.gpu`` is collected once with ``-m gpu``, and each test goes to the part of its folder
(the kernel tests to three groups, so that a kernel that faults the device spoils only its
own process). A new GPU test is picked up without editing this file; the minimums are what
existed when they were set (raise them when you add tests).

``--list`` collects and plans only (seconds, no GPU needed): each part with the tests it
would run against its minimum. Nothing beyond torch, CuPy, numpy and pytest is needed on the
device; ``GPU_CHECK_DEVICE_PACKAGES_ONLY=1`` makes the pytest runs hide every other
installed distribution, as on the device (how the test suite checks collection here).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

LIST_LIMIT_S = 900  # --list: only a guard against a hang, never a figure the result depends on
TOOLS = Path(__file__).resolve().parent  # tools/ of the checkout: this script and the ones it runs
MAX_BUDGET_S = 540  # with install and start-up, one device command of at most 10 minutes
KERNEL_TESTS = "tests/kernels/test_cuda_kernels.py"
# substrings of the kernel tests' names (case-insensitive, as pytest -k matches) per group
KERNEL_GROUPS = (("rng, sign, bits", ("uniform", "sign", "count_set", "pack_unpack")),
                 ("select, sparse", ("topk", "threshold", "scatter")),
                 ("quant, plumbing, compressors", ()))  # the rest
# the folders whose GPU tests include multi-rank ones (gloo ranks sharing the GPU), in one part
MULTI_RANK_DIRS = ("tests/collectives", "tests/training", "tests/memory")
_GPU_MARK = re.compile(r"\bmark\.gpu\b")
NCCL_NOT_RUN = ("NCCL between ranks was not exercised: this machine has {n} GPU(s), and NCCL needs one GPU "
                "per rank (two ranks on one GPU are refused). The multi-rank GPU tests ran gloo ranks on "
                "CUDA tensors (devices, streams, kernels), not NCCL.")

# the distributions the device machine has (with what they require); GPU_CHECK_DEVICE_PACKAGES_ONLY=1
# hides every other installed one
DEVICE_DISTRIBUTIONS = ("torch", "numpy", "pytest", "setuptools", "cupy-cuda12x", "cupy-cuda13x", "gradcomp")


@dataclasses.dataclass
class Part:
    """One part of the check. ``minimum``: tests (or PASS lines) that must pass; 0: the exit
    status alone decides. ``kind``: pytest (tests counted from its JUnit XML), lines (PASS/FAIL
    lines counted), command (exit status and ``outputs``)."""
    name: str
    cap_s: int
    minimum: int
    kind: str
    argv: List[str] = dataclasses.field(default_factory=list)
    tests: List[str] = dataclasses.field(default_factory=list)  # pytest node ids
    outputs: List[str] = dataclasses.field(default_factory=list)  # files the command must write
    needs_gpus: int = 1
    note: str = ""


@dataclasses.dataclass
class Outcome:
    part: Part
    ok: bool
    status: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    limit_s: int = 0
    log: str = ""
    by_file: Dict[str, List[int]] = dataclasses.field(default_factory=dict)  # file -> [passed, failed, skipped]
    counted: bool = True  # whether passed/failed/skipped mean anything for this part


# ---- the plan --------------------------------------------------------------------------------------
def gpu_test_files(root: Path) -> List[str]:
    """Every test file under ``tests/`` that marks something ``gpu`` (relative, sorted)."""
    out = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        if _GPU_MARK.search(path.read_text(encoding="utf-8", errors="replace")):
            out.append(path.relative_to(root).as_posix())
    return out


def kernel_group(nodeid: str) -> int:
    """Index into KERNEL_GROUPS of a kernel test: the first group one of whose substrings is in
    its name (parameters included), else the last."""
    name = nodeid.split("::", 1)[-1].lower()
    for i, (_, words) in enumerate(KERNEL_GROUPS):
        if any(w in name for w in words):
            return i
    return len(KERNEL_GROUPS) - 1


# minimum passed tests per pytest part: the GPU tests that existed when they were set (a part
# that runs fewer has lost tests or skipped them)
MINIMUMS = {"kernel tests: rng, sign, bits": 58, "kernel tests: select, sparse": 95,
            "kernel tests: quant, plumbing, compressors": 69,
            "GPU tests: collectives, training, memory (with gloo ranks on CUDA tensors)": 18, "GPU tests: others (compressors, kernels)": 22}
# seconds per part. A part may also use what the parts before it left of their caps (it runs
# until the sum of the caps up to it), so the total never exceeds the sum, and a part that hangs
# costs only its own share.
CAPS = {"install": 20, "environment": 30, "collect GPU tests": 25, "NVRTC compile": 50,
        "kernel tests: rng, sign, bits": 35, "kernel tests: select, sparse": 40,
        "kernel tests: quant, plumbing, compressors": 35,
        "GPU tests: collectives, training, memory (with gloo ranks on CUDA tensors)": 100,
        "GPU tests: others (compressors, kernels)": 25,
        "NCCL smoke: 2 ranks, one GPU each": 60, "memory benchmark (transformer-like)": 25,
        "kernel benchmarks": 35}


def part_of(nodeid: str) -> str:
    """The pytest part a GPU test belongs to, from its file."""
    path = nodeid.split("::", 1)[0]
    if path == KERNEL_TESTS:
        return f"kernel tests: {KERNEL_GROUPS[kernel_group(nodeid)][0]}"
    if path.startswith(tuple(d + "/" for d in MULTI_RANK_DIRS)):
        return "GPU tests: collectives, training, memory (with gloo ranks on CUDA tensors)"
    return "GPU tests: others (compressors, kernels)"


def device_packages_only() -> bool:
    """Whether GPU_CHECK_DEVICE_PACKAGES_ONLY=1 asks for the device's packages alone."""
    return os.environ.get("GPU_CHECK_DEVICE_PACKAGES_ONLY") == "1"


def pytest_argv(py: str, only_device_packages: Optional[bool] = None) -> List[str]:
    """How a pytest run starts: plain, or (``only_device_packages``, by default
    GPU_CHECK_DEVICE_PACKAGES_ONLY=1) through this module with every distribution the device
    lacks hidden; run it with PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 then (see :func:`run_part`)."""
    # "-o addopts=": not pytest.ini's two pytest-xdist workers (the device has no pytest-xdist, and its
    # tests share one GPU)
    if device_packages_only() if only_device_packages is None else only_device_packages:
        return [py, str(TOOLS / "gpu_check.py"), "--pytest-device-packages", "--", "-o", "addopts="]
    return [py, "-m", "pytest", "-o", "addopts="]


def plan(root: Path, logs: Path, py: str = sys.executable) -> List[Part]:
    """Every part in running order (pytest parts without their tests: :func:`assign` fills them
    from the collection)."""
    here = [py, str(TOOLS / "gpu_check.py")]
    pt = pytest_argv(py)
    files = gpu_test_files(root)
    parts = [
        Part("install", CAPS["install"], 1, "lines", here + ["--install", str(root)],
             note="pip install --no-deps --no-build-isolation -e . (nothing is downloaded; where setuptools is "
                  "too old to build it without the wheel package, setup.py develop)"),
        Part("environment", CAPS["environment"], 1, "lines", here + ["--environment"]),
        Part("collect GPU tests", CAPS["collect GPU tests"], 1, "collect",
             pt + ["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
             + files, note=f"{len(files)} files mark tests gpu"),
        Part("NVRTC compile", CAPS["NVRTC compile"], len(list((root / "kernels" / "cuda").glob("*.cu"))), "lines",
             here + ["--compile"],
             note="every kernel family (warms CuPy's cache for the tests)"),
    ]
    for name in [f"kernel tests: {g}" for g, _ in KERNEL_GROUPS] + [
            "GPU tests: collectives, training, memory (with gloo ranks on CUDA tensors)", "GPU tests: others (compressors, kernels)"]:
        parts.append(Part(name, CAPS[name], MINIMUMS[name], "pytest",
                          pt + ["-v", "-m", "gpu", "-rfEs", "--durations=5", "-p", "no:cacheprovider"]))
    # 4: gpu_check_nccl.CHECKS (not imported here: this module stays free of torch)
    parts.append(Part("NCCL smoke: 2 ranks, one GPU each", CAPS["NCCL smoke: 2 ranks, one GPU each"], 4, "lines",
                      [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       str(TOOLS / "gpu_check_nccl.py")], needs_gpus=2,
                      note="DDP hook, CompressedOptimizer, a Pipeline step, a ShardedOptimizer step over NCCL"))
    parts.append(Part("memory benchmark (transformer-like)", CAPS["memory benchmark (transformer-like)"], 0,
                      "command", [py, "-m", "gradcomp.bench", "memory", "--model", "transformer-like",
                                  "--device", "cuda", "--repeats", "2", "--plan-repeats", "1", "--codecs", "int8",
                                  "--budgets", "0.25", "--json", str(logs / "memory.json")],
                      outputs=[str(logs / "memory.json")]))
    parts.append(Part("kernel benchmarks", CAPS["kernel benchmarks"], 0, "command",
                      [py, str(TOOLS / "kernel_bench.py"), "--out", str(logs / "kernel_bench.md")],
                      outputs=[str(logs / "kernel_bench.md")]))
    return parts


def assign(parts: Sequence[Part], nodeids: Sequence[str]) -> None:
    """Give each pytest part its collected tests."""
    by_part: Dict[str, List[str]] = {}
    for n in nodeids:
        by_part.setdefault(part_of(n), []).append(n)
    for p in parts:
        if p.kind == "pytest":
            p.tests = by_part.get(p.name, [])


def caps_total(parts: Sequence[Part], gpus: int) -> int:
    """Seconds the parts that run on a machine with ``gpus`` GPUs may take together."""
    return sum(p.cap_s for p in parts if p.needs_gpus <= max(gpus, 1))


# ---- reading what a part did ----------------------------------------------------------------------
def read_collection(text: str) -> Tuple[List[str], List[str]]:
    """(node ids, files that failed to collect) from ``pytest --collect-only -q`` output."""
    ids = [line.strip() for line in text.splitlines() if "::" in line and not line.startswith(("ERROR", "FAILED"))
           and not line.startswith(" ")]
    errors = sorted(set(re.findall(r"^ERROR (\S+?\.py)\b", text, re.M)))
    return ids, errors


def read_junit(path: Path) -> Dict[str, List[int]]:
    """file -> [passed, failed, skipped] from a JUnit XML report (errors count as failed)."""
    out: Dict[str, List[int]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        f = case.get("file") or (case.get("classname") or "?").replace(".", "/") + ".py"
        row = out.setdefault(f, [0, 0, 0])
        if case.find("failure") is not None or case.find("error") is not None:
            row[1] += 1
        elif case.find("skipped") is not None:
            row[2] += 1
        else:
            row[0] += 1
    return out


_VERBOSE = re.compile(r"^(\S+?\.py)::.*? (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)


def read_verbose(text: str) -> Dict[str, List[int]]:
    """file -> [passed, failed, skipped] from ``pytest -v`` progress lines (when the run was
    killed before it wrote its XML)."""
    out: Dict[str, List[int]] = {}
    for f, word in _VERBOSE.findall(text):
        row = out.setdefault(f, [0, 0, 0])
        row[{"PASSED": 0, "XPASS": 0, "FAILED": 1, "ERROR": 1}.get(word, 2)] += 1
    return out


def read_lines(text: str) -> Tuple[int, int]:
    """(PASS lines, FAIL lines) of a part that reports its checks one a line."""
    return len(re.findall(r"^PASS\b", text, re.M)), len(re.findall(r"^FAIL\b", text, re.M))


def judge(kind: str, rc: Optional[int], passed: int, failed: int, minimum: int, limit_s: int,
          missing: Sequence[str] = ()) -> Tuple[bool, str]:
    """(ok, status) of a part from its exit status (None: killed at its limit) and counts."""
    if rc is None:
        return False, f"TIMEOUT after {limit_s}s"
    if kind in ("pytest", "collect") and rc == 5:
        return False, "NOTHING RAN: no tests collected (pytest exit 5)"
    if rc != 0 or failed:
        what = f"{failed} failed, " if failed else ""
        return False, f"FAILED: {what}exit code {rc}"
    if missing:
        return False, "FAILED: wrote no " + ", ".join(Path(m).name for m in missing)
    if passed < minimum:
        return False, f"BELOW MINIMUM: {passed} passed, at least {minimum} expected"
    return True, "ok"


def run_command(argv: Sequence[str], limit_s: int, log: Path, cwd: Path,
                env: Optional[Dict[str, str]] = None) -> Optional[int]:
    """Exit status of ``argv`` (output to ``log``), or None if it ran past ``limit_s`` (then
    its whole process group is killed: spawned ranks too)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                start_new_session=True)
        try:
            return proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            return None


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def run_part(part: Part, limit_s: int, logs: Path, cwd: Path) -> Outcome:
    """Run one part under ``limit_s`` and judge it."""
    log = logs / f"{slug(part.name)}.log"
    argv = list(part.argv)
    xml = logs / f"{slug(part.name)}.xml"
    if part.kind == "pytest":
        if not part.tests:
            log.write_text("no GPU test of this part was collected\n")
            ok, status = judge("pytest", 5, 0, 0, part.minimum, limit_s)
            return Outcome(part, ok, status, limit_s=limit_s, log=str(log))
        xml.unlink(missing_ok=True)
        argv += [f"--junitxml={xml}"] + part.tests
    for out in part.outputs:
        Path(out).unlink(missing_ok=True)
    # gradcomp from the checkout (the folder the parts run in), even before the install part has run
    path = [str(cwd)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(path))
    if "--pytest-device-packages" in argv:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # installed plugins the device lacks would load first
    t0 = time.monotonic()
    rc = run_command(argv, limit_s, log, cwd, env)
    seconds = time.monotonic() - t0
    text = log.read_text(errors="replace")
    o = Outcome(part, False, "", seconds=seconds, limit_s=limit_s, log=str(log))
    if part.kind == "pytest":
        o.by_file = read_junit(xml) if xml.is_file() else read_verbose(text)
        o.passed, o.failed, o.skipped = (sum(r[i] for r in o.by_file.values()) for i in range(3))
    elif part.kind == "lines":
        o.passed, o.failed = read_lines(text)
    elif part.kind == "collect":
        ids, errors = read_collection(text)
        o.passed, o.failed = len(ids), len(errors)
    else:
        o.counted = False
    missing = [m for m in part.outputs if not Path(m).is_file() or Path(m).stat().st_size == 0]
    o.ok, o.status = judge(part.kind, rc, o.passed, o.failed, part.minimum, limit_s, missing)
    return o


# ---- the run ---------------------------------------------------------------------------------------
def environment_facts(text: str) -> Dict[str, Any]:
    """The JSON line the environment part prints (empty if it printed none)."""
    m = re.search(r"^ENV (\{.*\})$", text, re.M)
    return json.loads(m.group(1)) if m else {}


def describe(env: Dict[str, Any]) -> str:
    if not env:
        return "unknown (the environment part printed nothing)"
    gpus = "; ".join(env.get("gpus", [])) or "no CUDA GPU visible to torch"
    return (f"{env.get('gpu_count', 0)} GPU(s): {gpus} | driver {env.get('driver', '?')} | torch {env.get('torch')} "
            f"(CUDA {env.get('torch_cuda')}) | CuPy {env.get('cupy')} | numpy {env.get('numpy')} | "
            f"NCCL {env.get('nccl')} | python {env.get('python')}")


def listed(parts: Sequence[Part], collected: Outcome) -> List[Outcome]:
    """``--list``: every part as it would run; pytest parts judged on their collected tests
    (the collection's own errors fail the collection part)."""
    out = []
    for p in parts:
        if p.kind == "pytest":
            n = len(p.tests)
            ok = n >= p.minimum
            status = f"would run {n} tests" if ok else f"BELOW MINIMUM: {n} collected, at least {p.minimum} expected"
            out.append(Outcome(p, ok, status, passed=n))
        elif p is collected.part:
            out.append(collected)
        else:
            out.append(Outcome(p, True, "listed (not run with --list)", counted=False))
    return out


def table(outcomes: Sequence[Outcome], list_mode: bool) -> List[str]:
    head = "collected" if list_mode else "passed"
    rows = [f"| part | status | {head} | failed | skipped | minimum | time | cap (limit) |",
            "|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        def n(v: int) -> str:
            return str(v) if o.counted else "-"
        mini = str(o.part.minimum) if o.part.minimum else "-"
        took = f"{o.seconds:.0f}s" if o.seconds else "-"
        limit = f" ({o.limit_s}s)" if o.limit_s and o.limit_s != o.part.cap_s else ""
        rows.append(f"| {o.part.name} | {o.status} | {n(o.passed)} | {n(o.failed)} | {n(o.skipped)} | {mini} "
                    f"| {took} | {o.part.cap_s}s{limit} |")
    return rows


def limit_for(deadline_s: int, budget_s: int, elapsed_s: float) -> int:
    """Seconds the next part may run: until the sum of the caps up to it (``deadline_s``) or
    the budget, whichever comes first, counted from the start of the run."""
    return int(min(deadline_s, budget_s) - elapsed_s)


def run_all(parts: Sequence[Part], budget: Optional[int], logs: Path, root: Path,
            only: Sequence[str] = ()) -> Tuple[List[Outcome], Dict[str, Any], int]:
    """Run the parts in order: (outcomes, environment facts, the budget used). Each part runs
    until the sum of the caps up to it (or the budget) is spent; with no GPU visible, the
    parts after the environment are not run (and fail)."""
    t_start = time.monotonic()
    outcomes: List[Outcome] = []
    env: Dict[str, Any] = {}
    gpus = 1
    spend = budget or caps_total(parts, gpus)
    deadline = 0  # the sum of the caps of the parts run so far
    for p in parts:
        if only and p.kind != "collect" and not any(w in p.name for w in only):
            outcomes.append(Outcome(p, True, "not run (--only)", counted=False))
            continue
        if p.needs_gpus > gpus:
            outcomes.append(Outcome(p, True, f"NOT RUN: needs {p.needs_gpus} GPUs, {gpus} here", counted=False))
            continue
        if env and not env.get("gpu_count") and p.kind != "collect":
            outcomes.append(Outcome(p, False, "NOT RUN: no CUDA GPU", counted=False))
            continue
        deadline += p.cap_s
        limit = limit_for(deadline, spend, time.monotonic() - t_start)
        if limit < 5:
            outcomes.append(Outcome(p, False, "SKIPPED: time budget used up", counted=False))
            continue
        print(f"== {p.name} (limit {limit}s)", flush=True)
        o = run_part(p, limit, logs, root)
        if p.name == "environment":
            env = environment_facts(Path(o.log).read_text(errors="replace"))
            gpus = max(int(env.get("gpu_count", 0)), 1)
            spend = budget or caps_total(parts, gpus)
            if not env.get("gpu_count"):
                o.ok, o.status = False, "FAILED: no CUDA GPU visible to torch"
        if p.kind == "collect":
            assign(parts, read_collection(Path(o.log).read_text(errors="replace"))[0])
        outcomes.append(o)
        print(f"   -> {o.status}", flush=True)
    return outcomes, env, spend


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="bash tools/gpu_check.sh", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("report", help="the markdown report to write (logs go to REPORT.logs/)")
    ap.add_argument("--list", action="store_true", help="collect and plan only: what each part would run")
    ap.add_argument("--root", default=".", help="the checkout (default: the current directory)")
    ap.add_argument("--budget", type=int, default=int(os.environ.get("GPU_CHECK_BUDGET", "0")),
                    help="seconds for all parts together (default: the sum of their caps)")
    ap.add_argument("--only", default="", help="run only the parts whose names contain one of these "
                    "comma-separated words (the others are reported as not run)")
    args = ap.parse_args(argv)
    root = Path(args.root).resolve()
    report = Path(args.report).resolve()
    logs = Path(f"{report}.logs")
    logs.mkdir(parents=True, exist_ok=True)
    parts = plan(root, logs)
    if max(args.budget, caps_total(parts, 2) if not args.budget else 0) > MAX_BUDGET_S:
        print(f"a budget of {args.budget or caps_total(parts, 2)}s is more than {MAX_BUDGET_S}s, what one "
              f"device command allows with its start-up; give GPU_CHECK_BUDGET={MAX_BUDGET_S} or less, or "
              f"lower the caps", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    env: Dict[str, Any] = {}
    if args.list:
        collect = next(p for p in parts if p.kind == "collect")
        c = run_part(collect, LIST_LIMIT_S, logs, root)  # a check of the plan: load must not fail it
        assign(parts, read_collection(Path(c.log).read_text(errors="replace"))[0])
        outcomes = listed(parts, c)
        budget = args.budget or caps_total(parts, 1)
    else:
        outcomes, env, budget = run_all(parts, args.budget or None, logs, root,
                                        [w.strip() for w in args.only.split(",") if w.strip()])
    total = time.monotonic() - t_start
    failed = [o for o in outcomes if not o.ok]
    gpus = int(env.get("gpu_count", 0))
    nccl = next(o for o in outcomes if o.part.needs_gpus == 2)
    if args.list:
        nccl_line = "NCCL smoke: runs only on a machine with 2 or more GPUs (one per rank)."
    elif nccl.status.startswith("NOT RUN: needs"):
        nccl_line = NCCL_NOT_RUN.format(n=gpus)
    else:
        nccl_line = f"NCCL between ranks: {nccl.status} ({nccl.part.note})."
    caps = caps_total(parts, max(gpus, 1))
    verdict = "PASS (every part met its minimum)" if not failed else \
        f"FAIL ({len(failed)} of {len(outcomes)} parts: {', '.join(o.part.name for o in failed)})"
    lines = ["# gradcomp GPU check" + (" (--list: collected, not run)" if args.list else ""), "",
             f"- started: {started}, took {total:.0f}s; budget {budget}s, the parts' caps add up to {caps}s"
             + ("" if budget >= caps else " (more than the budget: the last parts may be cut)"),
             f"- environment: {describe(env) if not args.list else 'not read (--list)'}",
             f"- {nccl_line}", f"- result: {verdict}", f"- logs: {logs.name}/", "", "## Summary", ""]
    lines += table(outcomes, args.list)
    for o in outcomes:
        lines += ["", f"## {o.part.name}: {o.status}", ""]
        if o.part.note:
            lines += [o.part.note, ""]
        if o.by_file:
            lines += ["| file | passed | failed | skipped |", "|---|---|---|---|"]
            lines += [f"| {f} | {r[0]} | {r[1]} | {r[2]} |" for f, r in sorted(o.by_file.items())]
            lines.append("")
        if o.log and Path(o.log).is_file():
            tail = Path(o.log).read_text(errors="replace").splitlines()[-(15 if o.ok else 60):]
            lines += ["```"] + tail + ["```"]
    bench = logs / "kernel_bench.md"
    if not args.list and bench.is_file() and bench.stat().st_size:
        lines += ["", bench.read_text()]
    report.write_text("\n".join(lines) + "\n")
    print("\n".join(table(outcomes, args.list)))
    if not args.list:
        print(f"environment: {describe(env)}")
    print(nccl_line)
    print(f"{verdict}\nreport: {report}")
    return 1 if failed else 0


# ---- helpers the parts run (each in its own process) -------------------------------------------
def install(root: Path, py: str = sys.executable) -> int:
    """Install the checkout editable without downloading anything; a PASS or FAIL line."""
    tries = [("pip install --no-deps --no-build-isolation -e .",
              [py, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
               "--disable-pip-version-check", "-e", str(root)]),
             # setuptools before 70.1 builds pip's editable wheel only with the wheel package
             ("python setup.py develop --no-deps (pip's editable install failed above)",
              [py, "setup.py", "develop", "--no-deps"])]
    for what, argv in tries:
        r = subprocess.run(argv, cwd=root, capture_output=True, text=True)
        print(f"$ {' '.join(argv)}\n{(r.stdout + r.stderr)[-2500:]}", flush=True)
        if r.returncode == 0:
            print(f"PASS installed: {what}")
            return 0
    print("FAIL not installed (the parts import gradcomp from the checkout)")
    return 1


def print_environment() -> int:
    """Print the GPU, versions and whether CuPy sees the device; the facts as one ``ENV {json}`` line."""
    import platform

    import numpy
    import torch

    facts: Dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                             "torch_cuda": torch.version.cuda, "numpy": numpy.__version__,
                             "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0, "gpus": []}
    for i in range(facts["gpu_count"]):
        p = torch.cuda.get_device_properties(i)
        facts["gpus"].append(f"{i}: {p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                             f"{p.total_memory / 2**30:.0f} GiB)")
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        facts["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else "?"
    except (OSError, subprocess.TimeoutExpired):
        facts["driver"] = "? (no nvidia-smi)"
    try:
        import cupy

        facts["cupy"] = f"{cupy.__version__} (CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()})"
    except Exception as exc:  # noqa: BLE001 - reported, the kernel parts then fail
        facts["cupy"] = f"not importable: {type(exc).__name__}: {exc}"
    from gradcomp.kernels import runtime

    facts["kernels_available"] = runtime.available()
    facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if facts["gpu_count"] else None
    for k, v in facts.items():
        print(f"{k}: {v}")
    print("ENV " + json.dumps(facts))
    print("PASS environment read")
    return 0


def compile_families() -> int:
    """Compile (or read from the cache) every kernel family for GPU 0; a PASS or FAIL line each."""
    import traceback

    from gradcomp.kernels import runtime

    if not runtime.available():
        print("FAIL CuPy cannot see a CUDA device or NVRTC: nothing to compile")
        return 1
    cc = runtime.compute_capability(0)
    print("NVRTC", runtime.nvrtc().getVersion(), "| options", " ".join(runtime.COMPILE_OPTIONS), "| cache",
          runtime.cache_dir())
    bad = 0
    for fam in runtime.families():
        t = time.perf_counter()
        try:
            path = runtime.binary(fam, cc)
            runtime.module(fam, cc, 0)  # loaded on GPU 0, as the tests will use it
            print(f"PASS {fam}.cu: {path.name} ({path.stat().st_size} bytes) in {time.perf_counter() - t:.1f}s")
        except Exception:  # noqa: BLE001 - every family is tried
            bad += 1
            print(f"FAIL {fam}.cu\n{traceback.format_exc()}")
    return 1 if bad else 0


class _Hide:
    """One finder of ``sys.meta_path`` that no longer finds the given top-level modules: to
    ``import`` and to ``importlib.util.find_spec`` they are absent, as on the device."""

    def __init__(self, finder: Any, names: set) -> None:
        self.finder, self.names = finder, names

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name.partition(".")[0] in self.names or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr: str) -> Any:  # invalidate_caches, find_distributions, ...
        return getattr(self.finder, attr)


def refused_modules() -> set:
    """Top-level import names that only distributions outside the device's set (and what they
    require) provide."""
    import importlib.metadata as md

    from packaging.requirements import Requirement  # pytest's own dependency

    keep, todo = set(), [d for d in DEVICE_DISTRIBUTIONS]
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in keep:
            continue
        keep.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for r in map(Requirement, reqs):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r.name)
    refused = set()
    for top, dists in md.packages_distributions().items():
        if not any(d.lower().replace("_", "-") in keep for d in dists):
            refused.add(top)
    return refused


def pytest_with_device_packages(args: Sequence[str]) -> int:
    names = refused_modules()
    sys.meta_path[:] = [_Hide(f, names) for f in sys.meta_path]
    import pytest

    return int(pytest.main(list(args)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--install"]:
        sys.exit(install(Path(sys.argv[2])))
    if sys.argv[1:2] == ["--environment"]:
        sys.exit(print_environment())
    if sys.argv[1:2] == ["--compile"]:
        sys.exit(compile_families())
    if sys.argv[1:2] == ["--pytest-device-packages"]:
        sys.exit(pytest_with_device_packages(sys.argv[3:] if sys.argv[2:3] == ["--"] else sys.argv[2:]))
    sys.exit(main())
