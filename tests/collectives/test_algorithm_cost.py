"""Each collective algorithm states its cost (``Algorithm.wire`` / ``Algorithm.cost``): the bytes
one rank sends and the messages it waits for, which ``compressor="auto"`` turns into time on
its link. Pure: no ranks."""
from __future__ import annotations

import pytest
import torch

from gradcomp.collectives import ALGORITHMS, Cost, choose_algorithm
from gradcomp.compress import ErrorFeedback, get_compressor


class _Link:
    """A link of 1 ms per message and 1000 bytes per ms."""

    def ms(self, sent_bytes: float, messages: int) -> float:
        return messages * 1.0 + sent_bytes / 1000


def _ring(w: int) -> float:
    return 2 * (w - 1) / w


def test_every_algorithm_states_its_cost():
    assert set(ALGORITHMS) >= {"native", "rounds", "allgather", "scatter-reduce"}
    for name, cls in ALGORITHMS.items():
        for w in (2, 3, 8):
            c = cls.wire(1000.0, w)
            assert isinstance(c, Cost) and c.sent > 0 and c.messages >= 1, (name, w, c)


@pytest.mark.parametrize("w", [2, 3, 4, 8])
def test_native(w):
    """One ring allreduce of the payload: a dense bucket's cost too."""
    assert ALGORITHMS["native"].wire(4000.0, w) == Cost(_ring(w) * 4000.0, 1)
    fp16 = get_compressor("fp16")
    assert ALGORITHMS["native"].cost(fp16, 1000, w) == Cost(_ring(w) * 2000, 1)  # 2 bytes per element


@pytest.mark.parametrize("w", [2, 3, 4, 8])
def test_rounds(w):
    """A ring allreduce per round: PowerSGD's two (P, then Q) unless told."""
    rounds = ALGORITHMS["rounds"]
    assert rounds.wire(3000.0, w) == Cost(_ring(w) * 3000.0, 2)
    assert rounds.wire(3000.0, w, rounds=3) == Cost(_ring(w) * 3000.0, 3)  # type: ignore[call-arg]
    psgd = get_compressor("powersgd", rank=2)
    c = rounds.cost(psgd, 1 << 16, w)
    assert c.messages == 2 and c.sent == pytest.approx(_ring(w) * psgd.bits_per_element(1 << 16) * (1 << 16) / 8)


@pytest.mark.parametrize("w", [2, 3, 4, 8])
def test_allgather(w):
    """Every rank's payload to every other rank, after the sizes: two messages."""
    assert ALGORITHMS["allgather"].wire(1000.0, w) == Cost((w - 1) * 1000.0, 2)


@pytest.mark.parametrize("w", [2, 3, 4, 8])
def test_scatter_reduce(w):
    """Chunks to their servers and the compressed averages back: a ring's share of the payload,
    two exchanges each after its sizes."""
    assert ALGORITHMS["scatter-reduce"].wire(1000.0, w) == Cost(_ring(w) * 1000.0, 4)


@pytest.mark.parametrize("name", ["fp16", "bf16", "int8", "topk", "onebit"])
def test_cost_is_the_wire_of_the_payload_the_compressor_sends(name):
    """``cost(codec, numel, world)`` is ``wire`` of the payload the compressor declares, which
    is what one rank's payload holds; with error feedback the same (the wrapper sends its
    compressor's payload)."""
    base = get_compressor(name)
    t = torch.randn(256, 64)
    nbytes = base.compress(t, "k").nbytes
    for codec in (base, ErrorFeedback(base)):
        for w in (2, 4):
            cls = ALGORITHMS[choose_algorithm(codec, w)]
            assert cls.cost(codec, t.numel(), w) == cls.wire(float(nbytes), w), (name, w)


def test_cost_on_a_link():
    """``Cost.ms``: the link's latency per message plus the bytes at its rate; the choice
    between algorithms follows (allgather sends (w-1) payloads, scatter-reduce a ring's share)."""
    link = _Link()
    assert Cost(5000.0, 2).ms(link) == 7.0
    assert ALGORITHMS["allgather"].wire(1e6, 8).ms(link) > ALGORITHMS["scatter-reduce"].wire(1e6, 8).ms(link)
    assert ALGORITHMS["allgather"].wire(1e6, 2).ms(link) < ALGORITHMS["scatter-reduce"].wire(1e6, 2).ms(link)
