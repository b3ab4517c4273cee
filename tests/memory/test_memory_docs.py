"""docs/memory.md's snippets run as written in one process, and the plan's prediction holds."""
import re
from pathlib import Path

import torch

PAGE = Path(__file__).resolve().parents[2] / "docs" / "memory.md"


def test_the_saving_memory_snippets_run(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)
    # the page's first block and the one continuing it (later blocks stand alone; tests/test_docs.py runs them)
    assert len(blocks) >= 2 and blocks[1].startswith("# continues the block above")
    blocks = blocks[:2]
    monkeypatch.chdir(tmp_path)  # the first writes plan.json into a temporary folder, not here
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/memory.md, snippet {i + 1}", "exec"), namespace)
    assert namespace["path"].endswith("plan.json") and not list(tmp_path.iterdir())
    assert isinstance(namespace["planned"], torch.nn.Module)  # the plan read back from its JSON, applied
    meter, plan = namespace["meter"], namespace["plan"]
    assert meter.peak_saved_bytes <= 4 * 2**20 * 1.1
    assert abs(meter.peak_saved_bytes - plan.predicted_peak) <= 0.1 * plan.predicted_peak
    assert "predicted peak" in capsys.readouterr().out
