"""The pipeline benchmark's parts that run without ranks: boundary compressor pairs, models, option checks,
the table and the timeline picture (ranks and links are covered by the bench tests' launcher)."""
from __future__ import annotations

import pytest
import torch

from gradcomp.bench import pipeline as bench


def test_codec_pairs_parse_with_options_and_delta():
    act, grad, delta = bench._pair("topk:ratio=0.25~delta+fp16")
    assert act.name == "topk" and act.config.ratio == 0.25 and grad.name == "fp16" and delta
    assert bench._pair("int8+fp16")[2] is False


def test_models_have_the_layers_the_balances_assume():
    assert len(bench.heavy_model(64, 4, 0)) == 4 * bench.STAGE_LAYERS
    out = bench.heavy_model(64, 4, 0)(torch.randn(3, 64))
    assert out.shape == (3, 10)
    assert bench.uneven_model(0)(torch.randn(3, 64)).shape == (3, 10)


@pytest.mark.parametrize("argv,message", [
    (["--schedules", "zb"], "choose from gpipe, 1f1b, interleaved"),
    (["--codecs", "int8"], "give ACT\\+GRAD"),
    (["--microbatches", "6"], "--microbatches be a multiple of --world-size"),
    (["--chunks", "6"], "--microbatches be a multiple of --world-size"),  # the option's other name
    (["--world-size", "1"], "one pipeline stage per rank"),
])
def test_bad_options_say_what_is_allowed(argv, message):
    with pytest.raises(ValueError, match=message):
        bench.main(argv)


def _record(method, sps, bubble=0.5, **extra):
    return {"method": method, "world_size": 2, "step_ms": 1e3 * 64 / sps, "samples_per_s": sps, "bubble": bubble,
            "ideal_bubble": 1 / 9, "bytes_per_step": 1e6, **extra}


def test_table_gives_the_ratios_side_by_side(tmp_path):
    events = [[("F", 0, 0, 0.0, 0.01), ("send", 0, 0, 0.01, 0.02), ("B", 0, 0, 0.03, 0.05)],
              [("F", 1, 0, 0.02, 0.03), ("B", 1, 0, 0.03, 0.04)]]
    records = [_record("gradcomp 1f1b none+none", 100, timeline=events), _record("gradcomp 1f1b int8+fp16", 150),
               _record("torch Schedule1F1B", 120, bubble=None, bytes_per_step=None),
               _record("balance equal [4, 4] int8+fp16", 50), _record("balance auto [2, 6] int8+fp16", 60),
               {"method": "accuracy none+none", "test_accuracy": 0.9, "delta_cache_bytes": 0},
               {"method": "accuracy int8+fp16", "test_accuracy": 0.91, "delta_cache_bytes": 0}]
    bench._ratios(records)
    assert records[1]["vs_uncompressed"] == pytest.approx(1.5) and records[1]["vs_torch"] == pytest.approx(1.25)
    assert records[4]["vs_equal_split"] == pytest.approx(1.2)
    assert records[6]["vs_exact_pp"] == pytest.approx(1.0)
    text = bench.table(records)
    assert "| gradcomp 1f1b int8+fp16 | 150 |" in text and "1.20x vs equal split" in text and "+1.00 pp" in text
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    bench.timeline_plot(records, str(path), "test")
    assert path.stat().st_size > 10_000
