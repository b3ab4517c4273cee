"""The collective benchmark: every compressor's averaged gradient exchange on real gloo ranks.

Each rank draws its own N(0, 1) gradient (seeded by rank); call ``i`` sends it rotated by an
``i``-dependent offset, so consecutive calls see different data, as training steps do, and
every method sees the same sequence. With ``--numel`` the gradient is one near-square matrix;
with ``--model`` it has the model's parameter shapes, in DDP's buckets. A *method* averages
it over the ranks:

- ``dense``: ``torch.distributed.all_reduce`` then a division by the world size, bucket by
  bucket, as DDP does without a hook. Every speed-up is against it.
- a gradcomp compressor, with or without error feedback: on one tensor the compressed
  collective itself (``gradcomp.collectives.allreduce``); with model shapes gradcomp's DDP
  hook (``gradcomp.training.ddp_comm_hook``), which compresses parameter by parameter.
- ``torch-fp16`` / ``torch-powersgd``: PyTorch's own ``fp16_compress_hook`` and
  ``powerSGD_hook``, called on stand-in buckets as DDP calls them.

- ``auto``: gradcomp's ``compressor="auto"`` through the DDP hook, on one tensor or model
  shapes alike. Its trial calls (dense exchanges while it times its candidates) and the calls
  that check a new choice are set-up, untimed like PyTorch PowerSGD's first steps: the
  benchmark calls it, untimed, until its decisions have settled (every bucket decided and the
  last decision older than its ``verify_steps``, so the check of a new choice has run and the
  residual a bucket owed the method it left has gone into an untimed call). Its row then
  measures the methods it chose, and ``auto_choices`` names them. A decision that changes
  during the timed calls (a short ``recheck_every``) is reported with the row.

Every call starts after a barrier; a call's time is the slowest rank's; figures are medians
over the timed calls, after warm-up, and each timed figure also keeps its calls' middle half
(``bench/spread.py``: methods whose middle halves overlap are a tie). Bytes (sent per rank; a
ring allreduce of ``n`` bytes counts ``2 (w-1)/w * n``) and compress / communicate / decompress
times come from gradcomp's telemetry, measured during the call; for PyTorch's hooks and the
dense baseline the bytes handed to ``all_reduce`` are counted the same way. The relative error
is the first call's against the exact average of what the call was to average: for a fixed
method that is the first call ever (no residual, no warm start yet); for ``auto`` the first
call after its decisions settled, against the average of the gradient plus what each rank
still owed it (``AutoRuntime.owed``: the residual its trial and check calls left), so the
error is the chosen method's own, not a residual of a method it left.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import hooks, shapes, spread

# Benchmark settings that differ from a compressor's own defaults: PowerSGD at rank 4 (the rank
# users compare), and a threshold that keeps ~1% of the benchmark's N(0, 1) gradient (|x| >=
# 2.576 sigma), like topk's default ratio; the default tau is meant for real gradient scales.
BENCH_OPTIONS: Dict[str, Dict[str, Any]] = {"powersgd": {"rank": 4}, "threshold": {"tau": 2.576}}
TORCH_METHODS = ("torch-fp16", "torch-powersgd")
AUTO = "auto"  # gradcomp's compressor="auto": a method per bucket, chosen from measurements
FIELDS = ("compressor", "world_size", "numel", "bytes_per_rank", "dense_bytes_per_rank", "ratio", "rel_error",
          "compress_ms", "decompress_ms", "collective_ms", "dense_ms", "speedup")


# ---- method specs (parsed in the parent, sent to the ranks as JSON) --------------------------
def parse_methods(text: Optional[str], error_feedback: str = "auto") -> List[Dict[str, Any]]:
    """Method specs from ``"topk,qsgd:levels=4,torch-fp16"``; ``None`` means every compressor.

    ``error_feedback``: ``on``/``off``/``both``, or ``auto``: as gradcomp's DDP hook decides
    (biased compressors get it, except 16-bit casts and the scale-free signs).
    """
    from gradcomp.compress import available_compressors, get_compressor, wants_feedback

    if error_feedback not in ("auto", "on", "off", "both"):
        raise ValueError(f"error feedback must be auto, on, off or both, not {error_feedback!r}")
    if text is None:
        entries: List[Tuple[str, Dict[str, Any]]] = [(n, {}) for n in (*available_compressors(), *TORCH_METHODS,
                                                                        AUTO)]
    else:
        entries = [parse_entry(e) for e in text.split(",") if e.strip()]
        if not entries:
            raise ValueError("--compressors is empty; give names separated by commas")
    specs: List[Dict[str, Any]] = []
    for name, opts in entries:
        if name in TORCH_METHODS:
            specs.append(_torch_spec(name, opts))
            continue
        if name == AUTO:  # its own error feedback per candidate; options such as trial_steps=2
            specs.append({"label": AUTO + "".join(f":{k}={v}" for k, v in opts.items()), "kind": AUTO,
                          "options": opts, "ef": True})
            continue
        options = {k: v for k, v in BENCH_OPTIONS.get(name, {}).items() if k in _option_names(name)}
        options.update(opts)
        comp = get_compressor(name, **options)  # validates name and options here, once
        efs = {"auto": [wants_feedback(comp)], "on": [True], "off": [False], "both": [False, True]}[error_feedback]
        for ef in efs:
            label = name + "".join(f":{k}={v}" for k, v in opts.items()) + ("+ef" if ef else "")
            specs.append({"label": label, "kind": "gradcomp", "name": name, "options": options, "ef": ef})
    return specs


def _option_names(name: str) -> Sequence[str]:
    from gradcomp.compress import compressor_class

    return tuple(compressor_class(name).options)


def parse_entry(entry: str) -> Tuple[str, Dict[str, Any]]:
    """``"topk:ratio=0.001"`` -> ``("topk", {"ratio": 0.001})`` (``gradcomp.compress.parse_spec``)."""
    from gradcomp.compress import parse_spec

    return parse_spec(entry, "--compressors")


def _torch_spec(name: str, opts: Dict[str, Any]) -> Dict[str, Any]:
    allowed = {"torch-fp16": set(), "torch-powersgd": {"rank"}}[name]
    bad = sorted(set(opts) - allowed)
    if bad:
        raise ValueError(f"{name}: unknown option(s) {', '.join(bad)}; allowed: {', '.join(sorted(allowed)) or 'none'}")
    if name == "torch-powersgd":
        rank = opts.get("rank", BENCH_OPTIONS["powersgd"]["rank"])
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"torch-powersgd: rank={rank!r} must be an int >= 1")
        return {"label": f"{name}:rank={rank}", "kind": name, "options": {"rank": rank}, "ef": True}
    return {"label": name, "kind": name, "options": {}, "ef": False}


# ---- per-rank work ---------------------------------------------------------------------------
def _layout(cfg: Dict[str, Any]) -> List[List[shapes.Layer]]:
    if cfg.get("model"):
        return shapes.buckets(shapes.model_layers(cfg["model"]), cfg.get("bucket_mb", 25.0))
    return [[("grad", matrix_shape(int(cfg["numel"])))]]


def matrix_shape(numel: int) -> Tuple[int, ...]:
    """The most nearly square ``(rows, cols)`` with ``rows * cols == numel`` (a weight matrix,
    so that matrix compressors apply too; element-wise ones do not care), or ``(numel,)``."""
    rows = next(d for d in range(math.isqrt(numel), 0, -1) if numel % d == 0)
    return (rows, numel // rows) if rows > 1 else (numel,)


def _method(spec: Dict[str, Any], world: int, layout, algorithm: Optional[str], model: bool,
            local_size: int = 1) -> Callable:
    """``run(bufs) -> (outputs, stats)`` for one method; ``bufs`` are the per-bucket inputs."""
    kind = spec["kind"]
    if kind == "dense":
        def dense(bufs):
            with hooks.CountingAllReduce(world) as counter:
                for b in bufs:
                    dist.all_reduce(b)
                    b.div_(world)
            return bufs, {"bytes": counter.nbytes}
        return dense
    # stand-in parameters (no storage) that give the hooks each bucket's layer shapes and names
    params = [[torch.empty(shape, device="meta") for _, shape in bucket] for bucket in layout]

    def launch(state, hook, bufs):
        # one bucket at a time: PyTorch's PowerSGD hook issues collectives from future callbacks,
        # so with several buckets in flight the ranks could issue them in different orders
        return [hook(state, hooks.Bucket(i, b, params[i], i == len(bufs) - 1)).wait() for i, b in enumerate(bufs)]

    def in_flight(state, hook, bufs):
        # every bucket in flight at once, as DDP launches them (gradcomp's ordered worker keeps the
        # ranks in step, and compresses a bucket while the one before it is on the wire): there is
        # no backward here to hide an exchange behind
        futures = [hook(state, hooks.Bucket(i, b, params[i], i == len(bufs) - 1)) for i, b in enumerate(bufs)]
        return [f.wait() for f in futures]

    if kind in TORCH_METHODS:
        state, hook, setup = hooks.torch_hook(kind, spec["options"])

        def torch_run(bufs):
            with hooks.CountingAllReduce(world) as counter:
                outs = launch(state, hook, bufs)
            return outs, {"bytes": counter.nbytes}
        torch_run.setup_calls = setup  # type: ignore[attr-defined]
        return torch_run

    from gradcomp.collectives import allreduce, reset_telemetry, telemetry
    from gradcomp.compress import ErrorFeedback, get_compressor

    auto = None
    if kind == AUTO:  # gradcomp's DDP hook deciding per bucket, on one tensor or model shapes alike
        from gradcomp.training import ddp_comm_hook

        state, hook = ddp_comm_hook(AUTO, **spec["options"])
        auto = state.compression

        def exchange(bufs):
            return in_flight(state, hook, bufs)
    elif model:  # realistic layers: gradcomp's DDP hook, which compresses parameter by parameter
        state, hook = hooks.gradcomp_hook(spec, local_size=local_size if spec.get("hierarchical") else None)

        def exchange(bufs):
            return in_flight(state, hook, bufs)
    else:  # one tensor: the compressed collective itself
        base = get_compressor(spec["name"], **spec["options"])
        comp = ErrorFeedback(base) if spec["ef"] else base

        def exchange(bufs):
            return [allreduce(b.view(p.shape), compressor=comp, key=f"bucket{i}", algorithm=algorithm)
                    for i, (b, p) in enumerate(zip(bufs, (ps[0] for ps in params)))]

    def ours(bufs):
        reset_telemetry()
        outs = exchange(bufs)
        total = telemetry()["total"]
        stats = {"bytes": total["bytes_sent"], "bytes_recv": total["bytes_recv"],
                 "payload_bytes": total["payload_bytes"], "compress_ms": 1e3 * total["compress_s"],
                 "decompress_ms": 1e3 * total["decompress_s"], "comm_ms": 1e3 * total["comm_s"]}
        if auto is not None:
            stats["auto"], stats["auto_describe"] = auto.summary(), auto.describe()
            stats["auto_history"] = len(auto.history)  # decisions so far: a change during the timed calls shows
        return outs, stats
    if auto is not None:  # its trials and checks are set-up, as PyTorch PowerSGD's start
        from gradcomp.training.auto import AutoRuntime

        runtime = auto
        assert isinstance(runtime, AutoRuntime)
        flat_shapes = [shape for bucket in layout for _, shape in bucket]

        def owed() -> torch.Tensor:
            """What this rank owes every gradient element (float64, the buckets' order)."""
            names = [n for key in runtime.decisions() for n in key]
            return torch.cat([runtime.owed(n, s).reshape(-1) for n, s in zip(names, flat_shapes)])

        ours.setup_calls = auto.trial_steps + auto.verify_steps  # type: ignore[attr-defined]
        ours.settled = lambda: auto_settled(runtime)  # type: ignore[attr-defined]
        ours.settle_limit = 4 * (auto.trial_steps + auto.verify_steps + 1)  # type: ignore[attr-defined]
        ours.owed = owed  # type: ignore[attr-defined]
        ours.auto = runtime  # type: ignore[attr-defined]
    return ours


def auto_settled(auto: Any) -> bool:
    """Whether ``compressor="auto"``'s decisions are final for the calls to time (the same on
    every rank: its decisions and history are agreed): every bucket decided, and the last
    decision at least ``verify_steps`` iterations old, so the check of a new choice (which may
    send the bucket back to dense) has run, in the iteration that also flushed the residual
    owed to the method the bucket left."""
    if auto.world == 1:  # nothing to decide: one rank sends nothing
        return True
    decided = auto.decisions()
    if not decided or any(c is None for c in decided.values()):
        return False
    last = max((h["iteration"] for h in auto.history), default=-1)
    return auto.iteration > last + auto.verify_steps


def _step_input(flat: torch.Tensor, call: int) -> torch.Tensor:
    """The gradient of call ``call``: the rank's draw rotated by a call-dependent offset, so
    that consecutive calls see different data (as consecutive training steps do; a constant
    gradient would let error-feedback residuals grow without bound) at the cost of one copy."""
    return torch.roll(flat, 104_729 * call % max(flat.numel(), 1)) if call else flat.clone()


def _timed(run: Callable, bufs: List[torch.Tensor]) -> Tuple[Any, Dict[str, Any], float]:
    """One call of ``run`` after a barrier: its outputs, stats and milliseconds."""
    dist.barrier()
    t0 = time.perf_counter()
    outs, st = run(bufs)
    return outs, st, (time.perf_counter() - t0) * 1e3


def _time_calls(run: Callable, flat: torch.Tensor, views: Callable, exact: torch.Tensor, warmup: int, repeats: int,
                tick: Callable[[], None], reference: Optional[Callable] = None) -> Dict[str, Any]:
    """Set-up, warm-up then timed calls of ``run``; this rank's raw times and stats, and the first
    call's error.

    Set-up: ``run.setup_calls`` untimed calls, then (``run.settled``, ``compressor="auto"``) more
    until its decisions have settled, at most ``run.settle_limit`` in all (the same count on
    every rank: the predicate reads agreed state). The first call's error is against the exact
    average of the gradient plus what the ranks owed (``run.owed``) before it. With
    ``reference`` (dense allreduce), each timed call is paired with one of it on the same input,
    the two alternating which goes first: the method's speed-up compares calls made under the
    same load, not a dense run made earlier."""
    setup, settled = getattr(run, "setup_calls", 0), getattr(run, "settled", None)
    limit, calls = getattr(run, "settle_limit", setup), 0
    while calls < setup or (settled is not None and calls < limit and not settled()):
        run(views(flat.clone()))
        calls += 1
    times: List[float] = []
    ref_times: List[float] = []
    stats: List[Dict[str, Any]] = []
    rel_error, warm = None, {}
    for i in range(warmup + repeats):
        bufs = views(_step_input(flat, i))  # untimed; a fresh tensor also serves the in-place hooks
        target = exact
        if i == 0 and hasattr(run, "owed"):  # untimed: what the call is to average includes what is owed
            owed = run.owed()
            dist.all_reduce(owed)
            target = exact.double() + owed / dist.get_world_size()
        first = reference if reference is not None and i >= warmup and i % 2 else None
        second = reference if reference is not None and i >= warmup and not i % 2 else None
        if first is not None:
            ref_times.append(_timed(first, views(_step_input(flat, i)))[2])
        outs, st, ms = _timed(run, bufs)
        if second is not None:
            ref_times.append(_timed(second, views(_step_input(flat, i)))[2])
        if i == 0:
            out = torch.cat([o.reshape(-1) for o in outs])
            rel_error = float((out.double() - target.double()).norm() / target.double().norm().clamp_min(1e-30))
        if i >= warmup:
            times.append(ms)
            stats.append(st)
        else:
            warm = st  # the state the timed calls start from
        tick()
    return {"times_ms": times, "dense_times_ms": ref_times, "stats": stats, "warm_stats": warm,
            "rel_error": rel_error, "setup_calls": calls, "settled": settled() if settled is not None else True}


def run_rank(rank: int, world: int, cfg: Dict[str, Any], progress: Callable[..., None]) -> Any:
    """Benchmark every method in ``cfg['methods']``; rank 0 returns the records, others None."""
    layout = _layout(cfg)
    sizes = [sum(math.prod(s) for _, s in bucket) for bucket in layout]
    numel = sum(sizes)
    gen = torch.Generator().manual_seed(int(cfg.get("seed", 0)) * 1000 + rank)
    flat = torch.randn(numel, generator=gen, dtype=torch.float32)
    exact = flat.clone()
    dist.all_reduce(exact)
    exact.div_(world)

    def views(t: torch.Tensor) -> List[torch.Tensor]:
        return list(torch.split(t, sizes))

    warmup, repeats = int(cfg["warmup"]), int(cfg["repeats"])
    methods = [{"label": "dense", "kind": "dense", "ef": False, "options": {}}] + list(cfg["methods"])
    total, done = len(methods) * (warmup + repeats), [0]

    def tick(label: str) -> Callable[[], None]:
        def f() -> None:
            done[0] += 1
            progress(done=done[0], total=total, label=label)
        return f

    raw: List[Dict[str, Any]] = []
    dense = _method(methods[0], world, layout, None, False)  # every method's timed calls alternate with it
    for m, spec in enumerate(methods):
        try:
            run = dense if m == 0 else _method(spec, world, layout, cfg.get("algorithm"), bool(cfg.get("model")),
                                                int(cfg.get("local_size", 1)))
            res = _time_calls(run, flat, views, exact, warmup, repeats, tick(spec["label"]),
                              reference=None if m == 0 else dense)
        except ValueError as exc:  # e.g. an algorithm this compressor cannot use: same on every rank
            res = {"error": str(exc)}
            done[0] += warmup + repeats
        raw.append(res)
    everyone = [None] * world
    dist.all_gather_object(everyone, raw)
    if rank != 0:
        return None
    return _records(methods, everyone, cfg, world, numel)


def _per_call_max(per_rank: List[List[float]]) -> List[float]:
    """Per timed call the slowest rank's value (it decides when the step can go on)."""
    return [max(vals) for vals in zip(*per_rank)]


def _median_of_max(per_rank: List[List[float]]) -> float:
    """Per repeat the slowest rank, then the median."""
    return statistics.median(_per_call_max(per_rank))


def _records(methods, everyone, cfg, world, numel) -> List[Dict[str, Any]]:
    """Rank 0's records from every rank's raw results. A method's ``dense_ms`` is the median of
    the dense calls paired with its own, so its speed-up compares calls made under the same
    load. The dense row's figures are of every dense call of the run (its own and all the
    paired ones), spread over the whole run: the projection's reference."""
    dense = everyone[0][0]
    dense_bytes = statistics.median(st["bytes"] for st in dense["stats"])
    records = []
    for m, spec in enumerate(methods):
        results = [r[m] for r in everyone]
        rec: Dict[str, Any] = {"compressor": spec["label"], "method": spec["kind"], "error_feedback": spec["ef"],
                               "options": spec.get("options", {}), "world_size": world, "numel": numel,
                               "model": cfg.get("model"), "algorithm": cfg.get("algorithm") or "auto",
                               "local_size": int(cfg.get("local_size", 1)), "hierarchical": bool(spec.get("hierarchical")),
                               "repeats": cfg["repeats"], "warmup": cfg["warmup"], "dense_bytes_per_rank": dense_bytes}
        if "error" in results[0]:
            rec.update({f: None for f in FIELDS if f not in rec}, error=results[0]["error"])
            records.append(rec)
            continue
        calls_ms = _per_call_max([r["times_ms"] for r in results])
        if m == 0:  # dense: its own calls and every one paired with another method, spread over the run
            calls_ms += [v for i in range(1, len(methods)) if "error" not in everyone[0][i]
                         for v in _per_call_max([r[i]["dense_times_ms"] for r in everyone])]
            dense_calls = calls_ms
        else:
            dense_calls = _per_call_max([r["dense_times_ms"] for r in results])
        dense_ms, dense_span = statistics.median(dense_calls), spread.middle_half(dense_calls)
        rec.update({"dense_ms": dense_ms, "dense_ms_span": list(dense_span), "dense_ms_repeats": dense_calls})
        coll, span = statistics.median(calls_ms), spread.middle_half(calls_ms)
        calls = range(len(results[0]["stats"]))
        nbytes = statistics.median(max(r["stats"][i]["bytes"] for r in results) for i in calls)

        def timing(field: str) -> Optional[float]:
            if any(field not in st for r in results for st in r["stats"]):
                return None
            return _median_of_max([[st[field] for st in r["stats"]] for r in results])

        rec.update({"bytes_per_rank": nbytes, "comm_ms": timing("comm_ms"),
                    "ratio": dense_bytes / nbytes if nbytes else None,
                    "rel_error": max(r["rel_error"] for r in results),
                    "compress_ms": timing("compress_ms"), "decompress_ms": timing("decompress_ms"),
                    "collective_ms": coll, "speedup": dense_ms / coll if coll else None,
                    "collective_ms_repeats": calls_ms, "collective_ms_span": list(span),
                    "collective_ms_range": [min(calls_ms), max(calls_ms)],
                    "speedup_span": list(spread.ratio_span(dense_span, span)),
                    "vs_dense": "baseline" if m == 0 else spread.versus(span, dense_span)})
        if spec["kind"] == AUTO:  # what it chose per bucket (the same on every rank)
            first, last = results[0].get("warm_stats") or {}, results[0]["stats"][-1]
            rec["auto_choices"] = last.get("auto")
            rec["auto_describe"] = last.get("auto_describe")
            rec["auto_setup_calls"] = results[0].get("setup_calls")
            rec["auto_settled"] = bool(results[0].get("settled", True))
            # decisions made during the timed calls: the row then mixes methods, and says so
            rec["auto_changed_while_timed"] = last.get("auto_history", 0) - first.get("auto_history", 0)
        records.append(rec)
    return records


def dense_probe(rank: int, world: int, cfg: Dict[str, Any], progress: Callable[..., None]) -> List[float]:
    """Milliseconds of plain dense ``all_reduce`` calls (after one warm-up): a link check."""
    t = torch.ones(int(cfg["numel"]))
    dist.all_reduce(t)
    out = []
    for i in range(int(cfg["repeats"])):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        out.append((time.perf_counter() - t0) * 1e3)
        progress(done=i + 1, total=int(cfg["repeats"]), label="dense")
    return out
