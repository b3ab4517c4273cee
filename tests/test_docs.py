"""Every Python block of README.md and docs/*.md runs as it stands, on 2 real gloo ranks; the
options table of docs/compressors.md is the one the code generates; the README's commands are
the ones CI runs.

Each block runs alone, as a reader copies it into a script under
``torchrun --nproc_per_node=2``: in a fresh namespace, with a fresh seed, in a folder of its
own (the ranks share it, as jobs on one file system do), with the environment torchrun sets
and a store on a port of its own; a block that needs a process group makes it itself. After
each block gradcomp's threads are shut down and its group destroyed, so the next block starts
as a fresh script would. A docs page's block whose first line is ``# continues the block
above`` (the reader sees it) runs after the run blocks before it on its page, in their
namespace; README.md has none. A block right after a line ``<!-- not run: why -->`` is skipped
(and must say why). One spawn serves every block.
"""
import os
import re
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Dict, List, NamedTuple, Tuple

import pytest

from ranks import free_ports, run_ranks

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(<!-- not run: [^>]+-->\s*\n)?```python\n(.*?)```", re.S)
CONTINUES = "# continues the block above"
GROUP_TIMEOUT = timedelta(seconds=180)  # a block that fails on one rank frees the other within this


class Block(NamedTuple):
    page: str  # file name, as in the test ids
    line: int  # the line of the opening fence
    code: str
    skip: str  # the "not run" line, or ""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def continues(self) -> bool:
        return self.code.startswith(CONTINUES)


def blocks(page: Path) -> List[Block]:
    """The page's Python blocks, in order."""
    text = page.read_text(encoding="utf-8")
    out = []
    for m in _BLOCK.finditer(text):
        fence = m.start(2) - len("```python\n")
        out.append(Block(page.name, text.count("\n", 0, fence) + 1, m.group(2), (m.group(1) or "").strip()))
    return out


def chains(found: List[Block]) -> List[List[Block]]:
    """The run blocks as scripts: one block that stands alone, then the blocks that continue it."""
    out: List[List[Block]] = []
    for b in found:
        if b.skip:
            continue
        if b.continues and out and out[-1][0].page == b.page:
            out[-1].append(b)
        else:
            out.append([b])
    return out


ALL = [b for p in PAGES for b in blocks(p)]
RUN = [b for b in ALL if not b.skip]
CHAINS = chains(ALL)


def _run_blocks(rank: int, world: int, todo: List[List[Block]], ports: List[int], workdir: str) -> Dict[str, Tuple[str, str]]:
    import torch
    import torch.distributed as dist

    from gradcomp.training import shutdown

    init = dist.init_process_group

    def init_bounded(*args, **kwargs):  # a rank whose peer failed raises instead of waiting 30 min
        kwargs.setdefault("timeout", GROUP_TIMEOUT)
        return init(*args, **kwargs)

    dist.init_process_group = init_bounded
    out: Dict[str, Tuple[str, str]] = {}
    for chain, port in zip(todo, ports):
        os.environ["MASTER_PORT"] = str(port)  # a fresh store per script: no key of the one before
        here = Path(workdir) / chain[0].id.replace(":", "-")
        here.mkdir(exist_ok=True)
        os.chdir(here)
        torch.manual_seed(0)
        namespace: dict = {"__name__": "__main__"}
        failed = ""
        try:
            for block in chain:
                if failed:
                    out[block.id] = ("error", f"not run: the block it continues, {failed}, failed")
                    continue
                try:
                    exec(compile(block.code, f"{block.page}, block at line {block.line}", "exec"), namespace)
                    out[block.id] = ("ok", "")
                except BaseException as exc:  # report per block, keep going
                    out[block.id] = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                    failed = block.id
        finally:
            shutdown()
            if dist.is_initialized():
                dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def docs_run(tmp_path_factory):
    """Every rank's results, and what each script left in its working directory."""
    workdir = tmp_path_factory.mktemp("docs")
    results = run_ranks(_run_blocks, 2, workdir, CHAINS, free_ports(len(CHAINS)), str(workdir),
                        timeout_s=600.0, torchrun_env=True)
    left = {}
    for chain in CHAINS:
        here = workdir / chain[0].id.replace(":", "-")
        left[chain[0].id] = sorted(p.name for p in here.iterdir()) if here.exists() else []
    return results, left


@pytest.fixture(scope="module")
def block_results(docs_run):
    return docs_run[0]


@pytest.mark.parametrize("block", RUN, ids=lambda b: b.id)
def test_block_runs_as_it_stands(block, block_results):
    for rank, out in enumerate(block_results):
        status, error = out[block.id]
        assert status == "ok", f"{block.id} on rank {rank}: {error}"


@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: c[0].id)
def test_a_script_leaves_the_working_directory_as_it_found_it(chain, docs_run):
    """A reader who runs a block in their project folder finds no checkpoint of it there
    afterwards: a block writes its files into a temporary folder, or removes them."""
    left = docs_run[1][chain[0].id]
    assert not left, f"{chain[0].id} (and the blocks continuing it) left {left} in the working directory"


def test_every_skipped_block_says_why():
    for b in ALL:
        assert not b.skip or len(b.skip) > len("<!-- not run:  -->") + 10, f"{b.id}: {b.skip!r}"


def test_readme_blocks_stand_alone_and_continuations_follow_a_block():
    for chain in CHAINS:
        assert not chain[0].continues, f"{chain[0].id} continues a block, but no run block of its page is above it"
    assert all(not b.continues for b in ALL if b.page == "README.md"), "every README block must stand alone"


def test_blocks_are_found_one_by_one(tmp_path):
    """The splitter itself: two blocks, the second skipped, each with its own line."""
    page = tmp_path / "page.md"
    page.write_text("# t\n```python\nx = 1\n```\n\n<!-- not run: needs two GPUs, none here -->\n"
                    "```python\ny = x\n```\n```python\n# continues the block above\nz = x\n```\n"
                    "```python\nw = 0\n```\n", encoding="utf-8")
    found = blocks(page)
    assert [(b.line, b.code, bool(b.skip)) for b in found] == [
        (2, "x = 1\n", False), (7, "y = x\n", True), (10, "# continues the block above\nz = x\n", False),
        (14, "w = 0\n", False)]
    assert [[b.line for b in c] for c in chains(found)] == [[2, 10], [14]]


def test_options_table_is_generated_from_the_configs():
    from gradcomp.compress import available_compressors, compressor_class
    from gradcomp.compress.options import BEGIN, END, option_rows, options_table

    page = (ROOT / "docs" / "compressors.md").read_text(encoding="utf-8")
    assert page.count(BEGIN) == 1 and page.count(END) == 1, "docs/compressors.md lost its options table markers"
    current = page[page.index(BEGIN):page.index(END) + len(END)]
    assert current == options_table(), \
        "docs/compressors.md's options table differs from the compressors' Configs: run " \
        "python -m gradcomp.compress.options --write docs/compressors.md"
    rows = list(option_rows())  # every option of every compressor is a row, nothing else
    assert {(r[0], r[1]) for r in rows} == \
        {(n, o) for n in available_compressors() for o in compressor_class(n).options}
    for name in ("tau", "stochastic", "orthogonalize", "clip", "sample_ratio"):
        assert f"| `{name}` |" in current


def test_readme_commands_are_what_ci_runs():
    """The README's test command is the suite .ci/run runs, and the CPU build's command comes
    before the two commands."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    test_cmd = 'pip install -e ".[test,bench]" && python -m pytest -q'
    first = readme.index("```bash\n")
    bash = readme[first:readme.index("```\n", first + 8)]
    assert "--torch-backend=cpu" in bash, "the README's first block should be the CPU build's command"
    two = readme.index("```bash\n", first + 8)
    assert readme[two:].startswith(f'```bash\npip install -e ".[bench]" && python -m gradcomp.bench\n{test_cmd}\n```'), \
        "the README's two commands changed"
    assert f"python -m pip install -q -e \".[test,bench]\" && python -m pytest -q\n" in ci
    assert "not slow" not in ci  # CI runs the whole suite, as the README's command does
    assert 'pip install -q "torch==2.13.0+cpu"' in ci  # the CPU build, or CI stops (never the CUDA one)
    # where PyTorch's CPU index is out of reach: PyPI's default build, which also runs on a CPU
    setup = " ".join(readme[:two].split())
    assert "`pip install torch` takes PyPI's default build" in setup and "cannot be reached" in setup


def test_readme_is_a_front_page():
    """README.md is the front page: set-up, the two commands, the ways in, a few figures, where
    the rest is and the tests, in at most 200 lines; the detail lives in docs/."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move the detail into docs/ (at most 200)"


# The pages a user reads describe gradcomp as it is, the measured figures included (bench/RESULTS.md,
# the index, and one current page per area in bench/results/). How it got there (issues, commits, the
# work's sessions and rounds, one release against another, older measurements) is git's history.
RESULTS = ROOT / "bench" / "RESULTS.md"
RESULT_PAGES = sorted((ROOT / "bench" / "results").glob("*.md"))
USER_PAGES = [*PAGES, ROOT / "CONTRIBUTING.md", RESULTS, *RESULT_PAGES]
HISTORY = [
    ("an issue number", r"\bissues? #?\d+|(?<![\w&/#])#\d+\b|\b(pull request|PR) #?\d+"),
    ("a commit", r"`[0-9a-f]{7,40}`|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"
                 r"|\b(this|that|the previous|previous|last|an earlier|earlier) commit\b|\bcommit [0-9a-f]{7}"),
    ("'session'", r"\bsessions?\b"),
    # "round" only as history: a round trip, rounding, PowerSGD's rounds and round-robin stay
    ("'round' as history", r"\bround \d+\b|\b(this|last|an earlier|earlier|previous) round\b|\brounds? ago\b"),
    ("a comparison with earlier code", r"\b(this|the previous|previous|last|prior|former) (release|version)s?\b"
                                       r"|\bagainst the previous\b|\bprevious code\b|\bbefore/after\b|\b(to|until) now\b"
                                       r"|\d(x|ms|%) before\b|\d(x|ms|%)?\s*(→|->)\s*\d[\d.,–-]*\s?(x|ms|%)"
                                       r"|\b(took|cut|went|brought|dropped|rose)\b[^.]{0,60}\bfrom \d[\d.,–-]*\S* to \d"),
    ("a missed target", r"target [\d.]+x: missed"),
    # the results are pages with headings, not a log of numbered sections: cite the page and heading
    ("a numbered section", r"\bsections? \d+[a-z]?\b|\bRESULTS(\.md)?`?,? \d+[a-z]?\b"),
]


def history(text: str) -> List[Tuple[int, str, str]]:
    """(line, what, the words) of each mention of how gradcomp was made (a mention may run over
    a line break)."""
    found = []
    for what, pattern in HISTORY:
        for m in re.finditer(pattern.replace(" ", r"\s+"), text, re.I):
            found.append((text.count("\n", 0, m.start()) + 1, what, " ".join(m.group(0).split())))
    return sorted(found)


def test_user_pages_describe_gradcomp_as_it_is():
    """README.md, docs/*.md, CONTRIBUTING.md and the results pages cite no issue, commit, session or
    round of the work nor a numbered section, and compare no release with an earlier one: every
    offence, by file and line."""
    wrong = [f"{page.relative_to(ROOT)}:{n}: {what}: {words!r}"
             for page in USER_PAGES for n, what, words in history(page.read_text(encoding="utf-8"))]
    assert not wrong, "history in pages users read (say what gradcomp does now; the history is in git):\n" \
                      + "\n".join(wrong)


def test_the_history_check_tells_history_from_technique():
    page = ("As issue 24 found, see #24 and `5319183`, fixed in 9c0ffee1.\n"
            "In this round the hook got faster; Round 3 added it; the previous session's VM, the previous\ncommit.\n"
            "| speed-up (previous release) |, this release against the previous; 1.87x → 2.39x; 2.19x before;\n"
            "that took top-k from 418-450 to 317-336 ms per call; 1 MB: 1.46 →\n0.35–0.56 ms.\n"
            "A round trip, rounding to nearest, PowerSGD's two rounds (each round one allreduce), round-robin.\n"
            "Resharding 4 → 2 ranks, from 2 to 4 ranks; the transaction's commit or roll back; 1000000 elements; `2048`.\n")
    found = history(page)
    assert sorted({n for n, _, _ in found}) == [1, 2, 4, 5], found
    assert {w for _, w, _ in found} == {"an issue number", "a commit", "'session'", "'round' as history",
                                        "a comparison with earlier code"}
    assert len([f for f in found if f[0] == 1]) == 4 and len([f for f in found if f[0] == 2]) == 4, found


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_CITE = re.compile(r"(?:\.\./)*bench/results/([\w-]+\.md)(?:#([\w-]+))?")


def anchors(page: Path) -> set:
    """The anchors of a page's headings as GitHub makes them (fenced code left out)."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    found = set()
    for m in re.finditer(r"^#{1,6} (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def test_the_results_are_an_index_and_one_page_per_area():
    """bench/RESULTS.md links every page of bench/results/; every image and page a results page
    links exists; every plot in bench/results/ is on a page (a plot no page shows is a lost figure,
    or history that belongs in git)."""
    index = RESULTS.read_text(encoding="utf-8")
    assert RESULT_PAGES, "bench/results/ has no pages"
    for page in RESULT_PAGES:
        assert f"(results/{page.name})" in index, f"bench/RESULTS.md does not link results/{page.name}"
    shown = set()
    for page in [RESULTS, *RESULT_PAGES]:
        for target in _LINK.findall(page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{page.relative_to(ROOT)} links {target}, which does not exist"
            shown.add(path)
    plots = {p.resolve() for p in (ROOT / "bench" / "results").glob("*.png")}
    assert plots <= shown, f"plots on no results page: {sorted(p.name for p in plots - shown)}"


def test_citations_of_the_results_name_a_page_and_heading_that_exist():
    """Code, tests, tools and pages cite the results by page (and heading), never by a numbered
    section of bench/RESULTS.md; each cited page and heading exists."""
    files = [*USER_PAGES]
    for folder in ("bench", "collectives", "compress", "kernels", "memory", "optim", "pipeline", "sharded",
                   "training", "tests", "tools", "examples"):
        files += sorted((ROOT / folder).rglob("*.py"))
    wrong, cited = [], 0
    for f in files:
        text = f.read_text(encoding="utf-8")
        for m in re.finditer(r"RESULTS(\.md)?['`\"]*,?\s+(sections?\s+)?\d+[a-z]?\b", text):
            wrong.append(f"{f.relative_to(ROOT)}: {m.group(0)!r}")
        for m in _CITE.finditer(text):
            cited += 1
            page = ROOT / "bench" / "results" / m.group(1)
            if not page.exists():
                wrong.append(f"{f.relative_to(ROOT)}: {m.group(0)!r}: no such page")
            elif m.group(2) and m.group(2) not in anchors(page):
                wrong.append(f"{f.relative_to(ROOT)}: {m.group(0)!r}: no such heading on {m.group(1)}")
    assert not wrong, "citations of the results that do not resolve:\n" + "\n".join(wrong)
    assert cited, "nothing cites bench/results/ (the check would pass on nothing)"


@pytest.mark.parametrize("example, module, extra", [("train_lightning.py", "lightning", "lightning"),
                                                    ("train_accelerate.py", "accelerate", "accelerate")])
def test_an_example_without_its_framework_says_what_to_install(example, module, extra):
    """No traceback ending in a bare ModuleNotFoundError: one line naming the extra, which
    setup.py defines."""
    import ast
    import subprocess
    import sys

    run = (f"import runpy, sys; sys.modules[{module!r}] = None; "
           f"runpy.run_path({str(ROOT / 'examples' / example)!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", run, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"pip install 'gradcomp[{extra}]'" in proc.stderr, proc.stderr
    setup = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    extras = next(kw.value for node in ast.walk(setup) if isinstance(node, ast.Call)
                  for kw in node.keywords if kw.arg == "extras_require")
    assert extra in ast.literal_eval(extras), f"setup.py has no extra [{extra}]"
