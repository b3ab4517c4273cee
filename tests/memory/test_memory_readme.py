"""The README's "Saving memory" snippets run as written."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_saving_memory_snippets_run(tmp_path, monkeypatch, capsys):
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Saving memory"):text.index("## CUDA kernels")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    monkeypatch.chdir(tmp_path)  # the first writes plan.json
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md, Saving memory, snippet {i + 1}", "exec"), namespace)
    assert (tmp_path / "plan.json").is_file()
    meter, plan = namespace["meter"], namespace["plan"]
    assert meter.peak_saved_bytes <= 4 * 2**20 * 1.1
    assert abs(meter.peak_saved_bytes - plan.predicted_peak) <= 0.1 * plan.predicted_peak
    assert "predicted peak" in capsys.readouterr().out
