"""The pieces of a pipeline in one process: every schedule runs without deadlock and with the
textbook bubble; 1F1B's in-flight bound; the balance programme's optimum and its measured
inputs; the delta feedback's round trip; the split backward over several inputs and outputs; a
message's parts table refuses what it does not make; bad options get an error naming what is
allowed."""
from __future__ import annotations

import itertools
import os
import sys

import pytest
import torch
from torch import nn

from gradcomp.compress import get_compressor
from gradcomp.pipeline import DeltaFeedback, LayerCost, auto_balance, build, ideal_bubble, partition, simulate
from gradcomp.pipeline.schedule import PASSES, SCHEDULES, check_shape

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/models.py


def _shapes():
    for schedule, p, m in itertools.product(SCHEDULES, (2, 3, 4, 8), (1, 2, 3, 4, 8, 12)):
        for v in ((2, 3) if SCHEDULES[schedule].virtual else (1,)):
            if not SCHEDULES[schedule].virtual or m % p == 0:
                yield schedule, p, m, v


@pytest.mark.parametrize("schedule,p,m,v", list(_shapes()))
def test_schedule_never_deadlocks_and_has_the_textbook_bubble(schedule, p, m, v):
    sim = simulate(schedule, p, m, v)  # raises on a deadlock or a missing pass
    if schedule == "zb-h2":  # the bound of unit passes for m >= p, never above ZB-H1's, stage 0 at 2p - 1
        assert ideal_bubble(p, m, v, schedule) - 1e-12 <= sim.bubble <= simulate("zb-h1", p, m).bubble + 1e-12
        if m >= p:
            assert sim.bubble == pytest.approx(ideal_bubble(p, m, v, schedule))
        assert all(k <= min(2 * p - 1 - r, m) for r, k in enumerate(sim.peak_in_flight)), sim.peak_in_flight
        assert sim.peak_in_flight[0] == min(2 * p - 1, m, max(sim.peak_in_flight))
        return
    if schedule == "zb-h1":  # between the paper's bound (reached on 2 ranks, m >= 2) and 1F1B's bubble
        assert ideal_bubble(p, m, v, schedule) - 1e-12 <= sim.bubble < simulate("1f1b", p, m).bubble
        if p == 2 and m >= 2:
            assert sim.bubble == pytest.approx(ideal_bubble(p, m, v, schedule))
        assert sim.peak_in_flight == [min(p, p - r + 1, m) for r in range(p)]
        return
    assert sim.bubble == pytest.approx(ideal_bubble(p, m, v))
    if schedule == "1f1b":
        assert sim.peak_in_flight == [min(p - r, m) for r in range(p)]
    if schedule == "gpipe":
        assert sim.peak_in_flight == [m] * p


@pytest.mark.parametrize("plan,message", [
    ([("F", 0), ("W", 0), ("I", 0)], "before I"),
    ([("F", 0), ("I", 0)], "it must run F, then B or I and W"),
    ([("F", 0), ("B", 0), ("B", 0)], "runs again"),
    ([("F", 0), ("F", 1), ("I", 0), ("I", 1), ("W", 1), ("W", 0)], "micro-batch order"),
    ([("F", 0), ("X", 0)], "'X' is not one of F, B, I, W"),
])
def test_a_plan_the_pass_table_refuses_says_why(plan, message):
    from gradcomp.pipeline.schedule import Action, check_plan

    with pytest.raises(ValueError, match=message):
        check_plan([[Action(k, 0, mb) for k, mb in plan]], 1, 1 + max(mb for _, mb in plan))


def _split_cases():
    from models import KINDS

    return [(kind, ck) for kind in ("chain", "shared") + KINDS for ck in (False, True)]


@pytest.mark.parametrize("kind,recompute", _split_cases())
def test_input_then_weight_gradients_equal_the_whole_backward(kind, recompute):
    """Issue 27: I (the input's gradient) then W (the weights') accumulate the bits of one
    backward, over two micro-batches, on every test model cut in the middle, with torch's
    recompute; a weight used twice (no split possible) runs the whole backward in I."""
    import copy

    from torch.utils.checkpoint import checkpoint

    from gradcomp.pipeline.backward import input_grad
    from models import data as model_data, sequential

    torch.manual_seed(0)
    if kind in ("chain", "shared"):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
        if kind == "shared":
            model[3][0].weight = model[2][0].weight
        x = torch.randn(6, 8)
    else:
        model = sequential(kind)
        x = model_data(kind, 6)[0]
    cut = max(1, len(model) // 2)
    runs = []
    for split in (False, True):
        m = copy.deepcopy(model)
        h = m[:cut](x).detach().requires_grad_(True)
        tail = m[cut:]
        grads = []
        for mb in range(2):
            out = checkpoint(tail, h, use_reentrant=False) if recompute else tail(h)
            g = torch.full_like(out, 0.25 + mb)
            if split:
                (dx,), w = input_grad([out], [g], [h], list(tail.parameters()))
                w.run()
            else:
                h.grad = None
                torch.autograd.backward(out, g)
                dx = h.grad
            grads.append(dx.clone())
        runs.append(grads + [p.grad for p in tail.parameters()])
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("recompute", [False, True])
def test_input_then_weight_gradients_over_tuples_equal_the_whole_backward(recompute):
    """A stage whose input and output are tuples (a hidden state used twice, one passed through
    unchanged, one no output depends on): I gives each input's gradient (None for the unused
    one) and I + W the bits of one backward; an output no input reaches runs the whole backward
    in I."""
    import copy

    from torch.utils.checkpoint import checkpoint

    from gradcomp.pipeline.backward import input_grad
    from gradcomp.pipeline.pipe import _StageInput

    torch.manual_seed(0)
    lin, other = nn.Linear(8, 8), nn.Linear(8, 8)
    x = [torch.randn(6, 8) for _ in range(3)]
    w = nn.Parameter(torch.randn(8))
    for with_weight_output in (False, True):
        runs = []
        for split in (False, True):
            params = [copy.deepcopy(m) for m in (lin, other)] + [copy.deepcopy(w)]
            lin_, other_, w_ = params
            leaves = [v.clone().requires_grad_(True) for v in x]

            def run(a, b, c):  # b passed through, c unused, w_ * 2 an output from a weight alone
                h = torch.tanh(lin_(a)) + other_(a * b)
                return (h, b, w_ * 2) if with_weight_output else (h, b)

            given = [_StageInput.apply(v) for v in leaves]  # as a stage gets its received values
            outs = list(checkpoint(run, *given, use_reentrant=False) if recompute else run(*given))
            grads = [torch.full_like(o, 0.5 + i) for i, o in enumerate(outs)]
            weights = [p for m in params for p in (m.parameters() if isinstance(m, nn.Module) else [m])]
            if split:
                dxs, wg = input_grad(outs, grads, leaves, weights)
                assert dxs[2] is None and not wg.whole
                assert bool(wg._parts) != with_weight_output, "split, unless an output no input reaches"
                wg.run()
            else:
                torch.autograd.backward(outs, grads)
                dxs = [v.grad for v in leaves]
            runs.append(dxs + [p.grad for p in weights])
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(*runs)), with_weight_output


def test_every_rank_runs_each_pass_once_in_micro_batch_order():
    for r in range(4):
        acts = build("1f1b", r, 4, 8)
        for kind in "FB":
            assert [a.mb for a in acts if a.kind == kind] == list(range(8))


@pytest.mark.parametrize("args,message", [
    (("zb", 2, 4, 1), "allowed: 'gpipe', '1f1b', 'interleaved'"),
    (("1f1b", 2, 0, 1), "microbatches=0"),
    (("interleaved", 2, 4, 1), "at least 2 virtual stages"),
    (("interleaved", 4, 6, 2), "multiple of the 4"),
    (("gpipe", 2, 4, 2), "one virtual stage"),
    (("zb-h1", 2, 4, 2), "one virtual stage"),
])
def test_bad_schedule_shape_says_what_is_allowed(args, message):
    with pytest.raises(ValueError, match=message):
        check_shape(*args)


def _costs(seconds, act):
    return [LayerCost(s, a, a) for s, a in zip(seconds, act)]


def test_balance_is_the_optimum_of_the_cost_model():
    costs = _costs([1, 1, 4, 1, 1, 1], [10, 10, 10, 10, 10, 10])
    got = partition(costs, 3, None)
    best = min(max(sum(c.seconds for c in costs[a:b]) for a, b in zip((0, i, j), (i, j, 6)))
               for i in range(1, 5) for j in range(i + 1, 6))
    assert max(got.stage_seconds) == best == 4
    assert sum(got.balance) == 6 and all(b >= 1 for b in got.balance)


def test_balance_cuts_where_boundaries_are_small_at_a_slow_link():
    # equal compute; one boundary is 1000x smaller than the others
    big, small = 100_000_000, 100_000  # at 100 Mbit/s: 8 s and 8 ms
    costs = _costs([1, 1, 1, 1], [big, big, small, big])
    assert partition(costs, 2, None).balance == [2, 2], "compute alone: the even split"
    slow = partition(costs, 2, 1e8)
    assert slow.balance == [3, 1], "at a slow link the cut moves to the small boundary"
    assert max(slow.stage_seconds) == pytest.approx(3 + small * 8 / 1e8)


def test_auto_balance_measures_and_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 256), nn.BatchNorm1d(256), nn.Linear(256, 8), nn.ReLU(), nn.Linear(8, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = auto_balance(model, torch.randn(16, 8), 2, activation_codec="int8", link_bps=1e9, repeats=1)
    assert sum(out.balance) == 5
    assert out.costs[0].act_bytes < 16 * 256 * 4 / 3, "int8 bytes are measured from the payload"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="sample="):
        auto_balance(model, None, 2)  # type: ignore[arg-type]


def test_auto_balance_measures_layers_that_pass_tuples():
    class Split(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 64)

        def forward(self, x):
            return self.lin(x), x[:, 0] > 0

    class Join(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 8)

        def forward(self, parts):
            h, mask = parts
            return self.lin(h) * mask[:, None]

    torch.manual_seed(0)
    out = auto_balance(nn.Sequential(Split(), Join(), nn.Linear(8, 8)), torch.randn(16, 8), 2, repeats=1)
    assert sum(out.balance) == 3
    assert out.costs[0].act_bytes == 16 * 64 * 4 + 16, "the float value through the codec, the mask exact"
    assert out.costs[0].grad_bytes == 16 * 64 * 4, "a gradient for the float value only"


def test_delta_feedback_round_trip_keeps_both_ends_equal():
    codec = get_compressor("int8")
    sender, receiver = DeltaFeedback(codec), DeltaFeedback(get_compressor("int8"))
    ids = torch.tensor([3, 1, 4, 5])
    a = torch.randn(4, 6)
    for epoch in range(3):
        x = a + 0.01 * epoch * torch.randn(4, 6)
        for end in (sender, receiver):
            end.expect("k", ids)
        acc = sender.accumulate(x, "k")
        payload, sent = codec.compress_decoded(acc, "k")
        sender.update("k", acc, sent)
        out = receiver.combine("k", receiver.compressor.decompress(payload))
        assert torch.allclose(out, x, atol=0.05 if epoch == 0 else 0.01)
    assert all(torch.equal(sender.state_dict()[k], receiver.state_dict()[k]) for k in sender.state_dict())
    assert sender.nbytes == 4 * 6 * 4
    sender.expect("k", ids[:2])
    with pytest.raises(ValueError, match="4 rows but 2 sample ids"):
        sender.accumulate(a, "k")


def test_delta_feedback_keeps_a_row_per_sample_and_value_of_a_message_of_parts():
    end = DeltaFeedback(get_compressor("none"))
    ids = torch.tensor([3, 1])
    end.expect("act0:1", ids)
    plain, part = torch.randn(2, 4), torch.randn(2, 5)
    end.combine("act0:1", plain)
    end.combine("act0:1.2", part)  # value 2 of the message: its own rows, the message's ids
    state = end.state_dict()
    assert set(state) == {"3", "1", "3.2", "1.2"}
    assert torch.equal(state["1.2"], part[1]) and torch.equal(state["3"], plain[0])
    again = DeltaFeedback(get_compressor("none"))
    again.load_state_dict(state)
    again.expect("act0:1", ids)
    assert torch.equal(again.accumulate(part, "act0:1.2"), torch.zeros(2, 5)), "the part's rows, restored"


@pytest.mark.parametrize("kw,message", [
    ({"checkpoint": "sometimes"}, "checkpoint='sometimes' is not allowed"),
    ({"delta": 1}, "delta=1 is not allowed"),
])
def test_bad_pipeline_options_say_what_is_allowed(kw, message):
    from gradcomp.pipeline import Pipeline

    with pytest.raises(ValueError, match=message):
        Pipeline(nn.Linear(2, 2), **kw)


def test_microbatches_and_chunks_are_one_keyword():
    from gradcomp.pipeline import Pipeline

    with pytest.raises(ValueError, match="name the same thing .*give one of them"):
        Pipeline(nn.Linear(2, 2), microbatches=4, chunks=4)


def test_what_ranks_found_wrong_at_construction_is_one_text():
    """Each rank's (problem, stage -> least budget): a budget too small is said as such, with the
    least budget that fits every stage; one rank's other problem names that rank."""
    from gradcomp.pipeline.pipe import _construction_verdict

    budget = _construction_verdict([("over", {0: 9000}), ("", {}), ("over", {2: 12000, 5: 100})], 4096)
    assert budget.startswith("Pipeline: memory_budget=4096 bytes (4.00 KiB) of saved activations per micro-batch "
                             "is too small: stage 0 (rank 0) needs at least 9000 bytes (8.79 KiB)"), budget
    assert "stage 2 (rank 2) needs at least 12000" in budget and "stage 5 (rank 2) needs at least 100 bytes" in budget
    assert budget.endswith("; raise memory_budget to at least 12000")
    assert _construction_verdict([("", {}), ("bad name", {})], None) == "Pipeline: rank 1: bad name"
    assert _construction_verdict([("same", {}), ("same", {})], None) == "same"
    assert _construction_verdict([("", {}), ("", {})], 4096) == ""


def test_a_pipeline_needs_two_ranks():
    from gradcomp.pipeline import Pipeline

    with pytest.raises(ValueError, match="at least 2 stages"):
        Pipeline(nn.Linear(2, 2))


def _nccl_run(plans, p, queues):
    """Whether every rank finishes when each issues the operations of ``queues[r]`` (messages,
    in order) on one stream for all its peers (stricter than NCCL's stream per pair): an
    operation completes only together with its peer's matching one, both first on their
    streams; a rank runs its actions in order, each waiting for its input, and a send's data
    exists once the action producing it ran."""
    from gradcomp.pipeline.transport import Message

    n = p * (1 + max(a.vstage for plan in plans for a in plan))
    queues = [list(q) for q in queues]
    produced, delivered, pos = set(), set(), [0] * p
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(plans[r]):
                a = plans[r][pos[r]]
                s = a.vstage * p + r
                row = PASSES[a.kind]
                need = (Message("act", s - 1, a.mb) if row.receives == "act" and s > 0 else
                        Message("grad", s, a.mb) if row.receives == "grad" and s < n - 1 else None)
                if need is not None and need not in delivered:
                    break
                out = (Message("act", s, a.mb) if row.sends == "act" and s < n - 1 else
                       Message("grad", s - 1, a.mb) if row.sends == "grad" and s > 0 else None)
                if out is not None:
                    produced.add(out)
                pos[r] += 1
                moved = True
        for r in range(p):
            if queues[r]:
                m = queues[r][0]
                peer = (m.dst if m.src % p == r else m.src) % p
                if m in produced and queues[peer] and queues[peer][0] == m:
                    queues[r].pop(0)
                    queues[peer].pop(0)
                    delivered.add(m)
                    moved = True
    return all(pos[r] == len(plans[r]) for r in range(p)) and not any(queues)


@pytest.mark.parametrize("schedule,p,m,v", [s for s in _shapes() if s[1] <= 4 and s[2] <= 8])
def test_message_order_runs_under_nccl_rules(schedule, p, m, v):
    """The transport's agreed order completes under pair matching in issue order with one
    operation at a time; the channel threads' order (every receive of the step posted before
    the first send, issue 22) deadlocks under the same rules."""
    from gradcomp.pipeline.schedule import Action
    from gradcomp.pipeline.transport import message_order

    plans = [build(schedule, r, p, m, v) for r in range(p)]
    order = message_order(plans, p)
    assert len(order) == len(set(order)) == 2 * m * (p * v - 1)
    mine = [[x for x in order if r in (x.src % p, x.dst % p)] for r in range(p)]
    assert _nccl_run(plans, p, mine)
    old = [[x for x in order if x.dst % p == r] + [x for x in order if x.src % p == r] for r in range(p)]
    assert not _nccl_run(plans, p, old)
    evals = [[Action("F", c, i) for i in range(m) for c in range(v)] for _ in range(p)]
    eval_order = message_order(evals, p)
    assert _nccl_run(evals, p, [[x for x in eval_order if r in (x.src % p, x.dst % p)] for r in range(p)])


def test_a_message_sent_without_waiting_is_ordered_before_one_made_after_a_hop():
    """1F1B on 2 ranks: the last stage sends micro-batch i+1's gradient right after its
    backward, while stage 0's activation of i+2 waits for micro-batch i's gradient to cross
    first. With free messages the two tie and the activation went first, so stage 0 posted the
    gradient's receive only after its forward (gloo moves a send once its receive is posted);
    with messages that cost time the gradient comes first. The passes' own times do not move."""
    from gradcomp.pipeline.schedule import timeline
    from gradcomp.pipeline.transport import MESSAGE_COST, message_order

    assert MESSAGE_COST > 0
    m = 8
    plans = [build("1f1b", r, 2, m) for r in range(2)]
    order = [f"{x.kind[0]}{x.mb}" for x in message_order(plans, 2)]
    # in the steady state two messages cross each way per period; before: a0 a1 g0 a2 g1 a3 g2 ...
    assert order == "a0 a1 g0 g1 a2 a3 g2 g3 a4 a5 g4 g5 a6 a7 g6 g7".split()
    free = timeline(plans, 2)
    assert free[("grad", 0, 1)] == free[("act", 0, 2)]  # the tie the order used to break by kind
    assert max(free.values()) == simulate("1f1b", 2, m).makespan


def test_transport_is_built_on_the_collectives_point_to_point():
    """The transport posts through ``collectives.p2p.batch_send_recv`` and learns layouts with
    the wire's ``LayoutCache``: no ``torch.distributed`` call and no layout cache of its own."""
    import ast
    import inspect

    from gradcomp.collectives.wire.layouts import LayoutCache
    from gradcomp.pipeline import transport

    tree = ast.parse(inspect.getsource(transport))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "torch.distributed" not in imported and not any(m and m.startswith("torch.distributed") for m in modules)
    assert {"batch_send_recv", "LayoutCache"} <= imported
    t = transport.Transport(None, lambda s: s, [0], torch.device("cpu"))
    assert isinstance(t._layouts, LayoutCache)


def test_the_example_prints_from_rank_0_only():
    """Issue 28: ``examples/train_pipeline.py --replicas 2`` printed two ranks' lines into each
    other; every print now sits under ``if rank == 0`` (what other ranks know is gathered to it)."""
    import ast
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "train_pipeline.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    guarded, prints = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).startswith("rank == 0"):
            guarded |= {id(n) for n in ast.walk(node)}
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
            prints.append(node)
    assert prints, "the example prints nothing"
    alone = [ast.unparse(p)[:60] for p in prints if id(p) not in guarded]
    assert not alone, f"printed by other ranks than rank 0: {alone}"


def _table(form, rows):
    import json

    raw = json.dumps({"f": form, "p": rows}).encode()
    return raw + b" " * (-len(raw) % 8)


@pytest.mark.parametrize("raw,message", [
    (b"[" * 200, "nested too deep"),
    (b"\xff\xfe      ", "not valid JSON"),
    (_table("dict", []), "malformed"),
    (_table("tensor", []), "malformed"),
    (_table("tuple", [["t", "int64", [], False, 8]]), "invalid entry"),  # a compressed value of ints
    (_table("tuple", [["x", "float32", [2], False, 8]]), "invalid entry"),  # exact bytes of a float
    (_table("tuple", [["x", "int64", [2], False, 8]]), "invalid entry"),  # 2 int64 are 16 bytes
    (_table("tuple", [["x", "bool", [2], True, 2]]), "invalid entry"),  # a mask needs no gradient
    (_table("tuple", [["n", "float32", [], False, 4]]), "invalid entry"),  # None has no bytes
    (_table("tuple", [["x", "int64", [-1], False, 0]]), "invalid entry"),
    (_table("tuple", [["x", "complex64", [1], False, 8]]), "invalid entry"),
    (_table("tuple", [["n", "float32", [], False, 0]] * 65), "too deep"),  # more values than a message holds
], ids=["nested", "not json", "form", "tensor of none", "ints compressed", "exact float", "bytes", "mask grad",
        "none bytes", "negative", "complex", "too many"])
def test_a_parts_table_the_sender_would_not_make_is_refused(raw, message):
    from gradcomp.pipeline.transport import _read_table

    with pytest.raises(ValueError, match=message):
        _read_table(raw)


def test_a_parts_table_round_trips():
    from gradcomp.pipeline.transport import Message, Parts, _encode, _parts_table, _read_table

    value = Parts("list", (torch.randn(2, 3), torch.tensor([True, False]), None, torch.arange(4)),
                  (True, False, False, False))
    form, encs = _encode(Message("act", 0, 1), value, get_compressor("int8"))
    sizes = [len(e.payload.wire_head()) + e.payload.nbytes if e.payload else
             sum(t.numel() * t.element_size() for t in e.tensors) for e in encs]
    got_form, rows = _read_table(_parts_table(form, encs, sizes))
    assert got_form == "list" and [r[0] for r in rows] == ["t", "x", "n", "x"]
    assert [r[1] for r in rows] == [torch.float32, torch.bool, torch.float32, torch.int64]
    assert [r[2] for r in rows] == [(), (2,), (), (4,)] and [r[3] for r in rows] == [True, False, False, False]
    assert [r[4] for r in rows] == sizes and sizes[1:] == [2, 0, 32]


def test_a_stage_output_that_cannot_cross_a_boundary_says_what_can():
    from gradcomp.pipeline.pipe import _outgoing
    from gradcomp.pipeline.transport import Message, _encode

    with pytest.raises(ValueError, match="stage 1 returned dict: a stage's output crosses a boundary as a tensor"):
        _outgoing({"h": torch.ones(2)}, 1)
    with pytest.raises(ValueError, match="stage 0 returned tuple"):
        _outgoing((torch.ones(2), 3), 0)
    with pytest.raises(ValueError, match="dtype torch.complex64 cannot cross a boundary"):
        _encode(Message("act", 0, 0), _outgoing((torch.ones(2, dtype=torch.complex64),), 0), get_compressor("none"))


@pytest.mark.parametrize("raw", [False, True], ids=["framed", "raw"])
def test_a_message_puts_the_same_bits_on_the_wire_whatever_its_buffer_held(monkeypatch, raw):
    """A message of parts whose values end off an 8-byte boundary (a 3-byte mask, an int8
    payload): the alignment bytes are zeros, not what the channel's buffer held before."""
    from gradcomp.pipeline import transport as tr

    value = tr.Parts("tuple", (torch.randn(3, 5), torch.tensor([True, False, True]), torch.arange(3, dtype=torch.int8)),
                  (True, False, False))
    msg = tr.Message("act", 0, 0)
    sent = []
    for fill in (0xAB, 0x5C):
        monkeypatch.setattr(tr.memory, "empty", lambda n, dtype, device, fill=fill: torch.full((n,), fill,
                                                                                               dtype=dtype))
        t = tr.Transport(None, lambda s: s, [0], torch.device("cpu"))
        slot = tr._Slot(msg, True, 1)
        form, encs = tr._encode(msg, value, get_compressor("int8"))
        if raw:
            t._layouts.begin(learn=True)
            t._layouts.note((msg.kind, msg.boundary), tr.Layout.of(form, [e.part for e in encs]))
            t._layouts.end()
            t._raw_frame(slot, form, encs)
        else:
            t._frame(slot, tr._split(get_compressor("int8"))[0], form, encs)
        sent.append(bytes(slot.buf.numpy()) + (bytes(slot.tail.numpy()) if slot.tail is not None else b""))
    assert sent[0] == sent[1]
