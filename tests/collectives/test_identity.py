"""Checkpoint identity: one fingerprint, one parameter description, one ``Identity`` whose
``mismatch`` names what differs and the fix; ``refuse_on_every_rank`` raises locally without
a process group. (Every layer refusing on every rank: tests/training/test_refuse_every_rank.py.)
"""
from __future__ import annotations

import hashlib

import pytest
import torch

from gradcomp.collectives import Identity, describe_params, fingerprint, names_of, refuse_on_every_rank


def test_fingerprint_is_stable_and_one_digest():
    # pinned: a checkpoint saved by one run must match the fingerprint of the next
    assert fingerprint("gradcomp") == hashlib.blake2b(b"gradcomp", digest_size=8).hexdigest()
    assert fingerprint("gradcomp") == fingerprint(b"gradcomp") and len(fingerprint("")) == 16
    assert fingerprint("a") != fingerprint("b")


def test_the_wire_hash_is_the_fingerprint_as_an_int64():
    from gradcomp.collectives.wire.header import h64

    for text in ("", "topk(ratio=0.1)", "x" * 1000):
        assert h64(text) == int.from_bytes(bytes.fromhex(fingerprint(text)), "little", signed=True)
        assert -2 ** 63 <= h64(text) < 2 ** 63


def test_describe_params_names_shapes_and_dtypes():
    named = [("w", torch.zeros(2, 3)), ("b", torch.zeros(3, dtype=torch.bfloat16))]
    assert describe_params(named) == "w (2, 3) float32; b (3,) bfloat16"
    assert describe_params([]) == ""


def test_names_of_by_model_or_position():
    model = torch.nn.Linear(2, 1)
    params = list(model.parameters())
    assert names_of(params, model) == ["weight", "bias"]
    assert names_of(params, None) == ["param0", "param1"]
    with pytest.raises(ValueError, match="not parameters of the model"):
        names_of([torch.nn.Parameter(torch.zeros(1))], model)


MINE = Identity(owner="Thing", rank=1, world=2, config=fingerprint("cfg"), params=fingerprint("p"),
                fields={"stage": "0"})


@pytest.mark.parametrize("saved,words", [
    (None, "carries no gradcomp identity (not a Thing checkpoint"),
    ({"rank": 1}, "carries no gradcomp identity"),
    ({**MINE.to_dict(), "rank": "one"}, "carries no gradcomp identity"),
    (Identity("Other", 1, 2, MINE.config, MINE.params), "it was saved by Other, not by Thing"),
    (Identity("Thing", 1, 4, MINE.config, MINE.params), "it was saved on 4 ranks, this run has 2; resume on"),
    (Identity("Thing", 0, 2, MINE.config, MINE.params), "it is rank 0's, loaded on rank 1; every rank loads its "
                                                        "own file (e.g. ckpt-rank1.pt)"),
    (Identity("Thing", 1, 2, MINE.config, "other"), "other parameters; load it into the model it was saved with"),
    (Identity("Thing", 1, 2, "other", MINE.params), "another configuration; resume with the same configuration"),
    (Identity("Thing", 1, 2, MINE.config, MINE.params, {"stage": "1"}),
     "another stage (1, this run has 0)"),
    (Identity("Thing", 1, 2, MINE.config, MINE.params), "another stage (none, this run has 0)"),
])
def test_mismatch_names_the_first_difference_and_the_fix(saved, words):
    said = MINE.mismatch(saved)
    assert said is not None and words in said, said
    # the dict form (what a checkpoint holds) says the same
    if isinstance(saved, Identity):
        assert MINE.mismatch(saved.to_dict()) == said


def test_mismatch_none_when_equal_and_skips_what_a_layer_does_not_check():
    assert MINE.mismatch(MINE) is None and MINE.mismatch(MINE.to_dict()) is None
    assert Identity.from_dict(MINE.to_dict()) == MINE
    other_job = Identity("Thing", 0, 4, MINE.config, MINE.params, {"stage": "0"})
    assert MINE.mismatch(other_job.to_dict(), skip=("rank", "world")) is None
    # no params in this identity: not compared
    assert Identity("Thing", 1, 2, "c").mismatch(Identity("Thing", 1, 2, "c", "p")) is None
    said = MINE.mismatch(Identity("Thing", 0, 2, MINE.config, MINE.params, {"stage": "0"}),
                         fixes={"rank": "load ckpt-rank{rank}-of-{world}.pt"})
    assert said == "it is rank 0's, loaded on rank 1; load ckpt-rank1-of-2.pt"


def test_refuse_without_a_process_group_raises_locally():
    refuse_on_every_rank(None, None, "Thing.load_state_dict")
    refuse_on_every_rank("", None, "Thing.load_state_dict")
    with pytest.raises(ValueError) as info:
        refuse_on_every_rank("it is bad", None, "Thing.load_state_dict")
    assert str(info.value) == "Thing.load_state_dict refused the checkpoint (rank 0: it is bad); nothing was loaded"


def test_a_long_disagreement_shows_where_the_ranks_differ():
    """A configuration text longer than a message's window is cut around its first
    difference, so both ranks' differing values are in the error (betas late in a long text)."""
    from gradcomp.collectives.identity import _first_difference, _short

    head = "Adam(lr=0.001, " + "x" * 300
    texts = [head + "betas=(0.9, 0.999))", head + "betas=(0.8, 0.999))"]
    at = _first_difference(texts)
    assert texts[0][at] != texts[1][at]
    shown = [_short(t, at) for t in texts]
    assert "betas=(0.9" in shown[0] and "betas=(0.8" in shown[1]
    assert all(len(s) <= 160 + 6 for s in shown) and shown[0].startswith("...")
    assert _short("short text", 0) == "short text"
    # as its docstring says: limit // 4 before the difference, moved back to fit at the end
    text = "".join(chr(65 + i % 26) for i in range(400))
    assert _short(text, 200, limit=40) == "..." + text[190:230] + "..."
    assert _short(text, 399, limit=40) == "..." + text[360:]
    assert _short(text, 0, limit=40) == text[:40] + "..."
