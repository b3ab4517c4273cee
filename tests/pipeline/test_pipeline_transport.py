"""The pipeline's transport driven directly on 2 gloo ranks (strict NCCL mode): what a receiver
says of a message it cannot take, and that the channel is still usable where the message was
received in full.

Invariants protected:

- a message sent with another boundary compressor is received in full and refused (the
  receiver names the compressor it expected); the channel stays in step for the next step;
- a message other than the one the agreed order expects (ranks running different schedules),
  and bytes that are not a pipeline message, are refused naming both; the transport is then
  broken (its ranks are out of step) and refuses further steps;
- a raw step's payload that left its channel's layout is sent as the agreed bytes of zeros and
  noted (``mismatched``); the receiver takes what arrived and the channel stays in step.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ranks import run_ranks  # noqa: E402


def _transport(rank):
    from gradcomp.pipeline.transport import Transport

    return Transport(None, lambda stage: stage, [rank], torch.device("cpu"))


def _errors(rank, w):
    import torch.distributed as dist

    from gradcomp.compress import get_compressor
    from gradcomp.pipeline.transport import Message

    fp16, int8 = get_compressor("fp16"), get_compressor("int8")
    x = torch.linspace(-1, 1, 24).reshape(4, 6)
    out = {}
    m0, m1 = Message("act", 0, 0), Message("act", 0, 1)

    # another boundary compressor: refused after the whole message arrived; the next step goes on
    t = _transport(rank)
    t.begin([m0])
    if rank == 0:
        t.send(m0, x, fp16)
    else:
        try:
            t.take(m0, int8)
            out["compressor"] = "taken"
        except ValueError as exc:
            out["compressor"] = str(exc)
    t.finish()
    t.begin([m0])
    if rank == 0:
        t.send(m0, x, fp16)
    else:
        out["after compressor"] = t.take(m0, fp16)
    t.finish()

    # another message than the agreed order says (the first step sets the channel's capacity, so
    # the second message is one operation that the receiver takes whole)
    t = _transport(rank)
    t.begin([m0])
    if rank == 0:
        t.send(m0, x, fp16)
    else:
        t.take(m0, fp16)
    t.finish()
    if rank == 0:
        t.begin([m1])
        t.send(m1, x, fp16)
        t.finish()
    else:
        t.begin([m0])
        try:
            t.take(m0, fp16)
            out["order"] = "taken"
        except ValueError as exc:
            out["order"] = str(exc)
        try:
            t.begin([m0])
            out["broken"] = "began"
        except ValueError as exc:
            out["broken"] = str(exc)

    # bytes that are not a pipeline message (a channel's first message: the header alone)
    t = _transport(rank)
    if rank == 0:
        dist.send(torch.zeros(64, dtype=torch.uint8), 1)
    else:
        t.begin([m0])
        try:
            t.take(m0, fp16)
            out["not ours"] = "taken"
        except ValueError as exc:
            out["not ours"] = str(exc)

    # a raw step whose payload left its layout: zeros of the agreed bytes, noted; then framed again
    t = _transport(rank)
    for step, value in enumerate((x, x, x[:2])):
        raw = step > 0
        t.begin([m0], raw=raw, learn=not raw)
        if rank == 0:
            t.send(m0, value, fp16)
            out[("mismatched", step)] = t.mismatched
        else:
            out[("raw", step)] = t.take(m0, fp16)
        t.finish()
    t.forget()
    t.begin([m0])
    if rank == 0:
        t.send(m0, x[:2], fp16)
    else:
        out["after void"] = t.take(m0, fp16)
    t.finish()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_errors, 2, tmp_path_factory.mktemp("transport"), timeout_s=60)


def test_another_compressor_is_refused_and_the_channel_stays_in_step(results):
    said = results[1]["compressor"]
    assert said.startswith("pipeline: act0:0 from rank 0 was sent with another boundary compressor than "), said
    assert "every rank must be built with the same activation_codec and grad_codec" in said
    x = torch.linspace(-1, 1, 24).reshape(4, 6)
    assert torch.equal(results[1]["after compressor"], x.half().float())


def test_a_message_out_of_order_or_not_ours_breaks_the_transport(results):
    said = results[1]["order"]
    assert said == ("pipeline: rank 0 sent another message (0x1) where this rank expected act0:0 (0x0): the ranks "
                    "run different schedules"), said
    assert results[1]["broken"] == said  # refused from then on: the ranks are out of step
    said = results[1]["not ours"]
    assert said == ("pipeline: the message from rank 0 expected as act0:0 is not a pipeline message (header [0, 0, "
                    "0]): the ranks are out of step"), said


def test_a_raw_payload_off_its_layout_is_sent_as_zeros(results):
    x = torch.linspace(-1, 1, 24).reshape(4, 6)
    assert [results[0][("mismatched", s)] for s in range(3)] == [False, False, True]
    assert torch.equal(results[1][("raw", 0)], x.half().float())
    assert torch.equal(results[1][("raw", 1)], x.half().float())
    assert torch.equal(results[1][("raw", 2)], torch.zeros(4, 6))  # the agreed bytes, zeros
    assert torch.equal(results[1]["after void"], x[:2].half().float())
