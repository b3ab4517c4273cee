"""Every Python snippet of README.md and docs/*.md runs as written, on 2 real gloo ranks.

The snippets of a page run in order in one namespace, as one script under
``torchrun --nproc_per_node=2`` would: a page that needs a process group calls
``init_process_group`` itself, with the environment torchrun sets. After each page its group
is destroyed, so the next page starts as a fresh script. A block right after a line
``<!-- not run: why -->`` is skipped (and must say why); ranks share one working folder, as
jobs on one file system do. One spawn serves every page.
"""
import os
import re
import traceback
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from ranks import free_ports, run_ranks

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(<!-- not run: [^>]+-->\s*\n)?```python\n(.*?)```", re.S)


def snippets(page: Path) -> List[str]:
    """The page's runnable Python blocks, in order."""
    return [code for skip, code in _BLOCK.findall(page.read_text(encoding="utf-8")) if not skip]


def _run_pages(rank: int, world: int, pages: List[str], ports: List[int], workdir: str) -> Dict[str, Tuple[str, str]]:
    import torch
    import torch.distributed as dist

    from gradcomp.training import shutdown

    os.chdir(workdir)
    out: Dict[str, Tuple[str, str]] = {}
    for page, port in zip(pages, ports):
        os.environ["MASTER_PORT"] = str(port)  # a fresh store per page: no key of the page before
        torch.manual_seed(0)
        namespace: dict = {"__name__": "__main__"}
        try:
            for i, code in enumerate(snippets(Path(page))):
                exec(compile(code, f"{Path(page).name}, snippet {i + 1}", "exec"), namespace)
            out[page] = ("ok", "")
        except BaseException as exc:  # report per page, keep going
            out[page] = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        finally:
            shutdown()
            if dist.is_initialized():
                dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def page_results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("docs")
    results = run_ranks(_run_pages, 2, workdir, [str(p) for p in PAGES], free_ports(len(PAGES)), str(workdir),
                        timeout_s=240.0, torchrun_env=True)
    return results, workdir


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_snippets_run(page, page_results):
    results, _ = page_results
    if not snippets(page):
        pytest.skip(f"{page.name} has no Python snippet")
    for rank, out in enumerate(results):
        status, error = out[str(page)]
        assert status == "ok", f"{page.name} on rank {rank}: {error}"


def test_every_skipped_block_says_why():
    for page in PAGES:
        for skip, _ in _BLOCK.findall(page.read_text(encoding="utf-8")):
            assert not skip or len(skip.strip()) > len("<!-- not run:  -->") + 10, f"{page.name}: {skip!r}"

