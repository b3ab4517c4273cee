"""``python -m gradcomp.bench [train|memory|sharded|optim|pipeline|fsdp|diloco] [options]``: the command line of the benchmarks."""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import signal
import sys
import textwrap
from typing import Any, Callable, Dict, List, Optional, Sequence

from gradcomp import collectives as _collectives

from . import collective, launch, netem, projection, shapes, spread
from . import env as envmod

DEFAULT_NUMEL = 1 << 22  # 16 MB of fp32: the default run stays well under 3 minutes on 2 cores
ALGORITHMS = ("auto", *_collectives.ALGORITHMS)
# python -m gradcomp.bench <subcommand>: the module of bench/ that runs it (each has main(argv) -> int)
SUBCOMMANDS = {"train": "train", "memory": "memory", "sharded": "sharded", "optim": "optim", "pipeline": "pipeline", "fsdp": "fsdp",
               "diloco": "diloco"}
# one line each for ``python -m gradcomp.bench --help``
SUBCOMMAND_HELP = {
    "train": "train a model on several ranks with each compressor beside "
             "PyTorch's hooks: accuracy, step time, bytes",
    "memory": "activation memory against step time in one process: checkpoint_sequential, plan_memory, "
              "compressed_activations",
    "sharded": "ShardedOptimizer (int8 gradients/weights, 8-bit state) against DDP and ZeroRedundancyOptimizer",
    "optim": "1-bit Adam, 0/1 Adam, LAMB and 1-bit LAMB against dense Adam + DDP",
    "pipeline": "pipeline-parallel training with compressed stage boundaries against PyTorch's pipelining",
    "fsdp": "FSDP2 (fully_shard) with gradcomp's compressed reduce-scatter and all-gather against FSDP's fp32/bf16",
    "diloco": "DiLoCo and Streaming DiLoCo (dense and compressed) against data-parallel AdamW on the character "
              "transformer: validation loss at equal tokens, bytes per worker, wall time",
}


# ---- shared pieces ---------------------------------------------------------------------------
def common_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, default=2, metavar="N", help="number of ranks (default 2)")
    p.add_argument("--netem", metavar="RATE[,DELAY]",
                   help="emulate a cluster: each rank in its own network namespace, its link shaped to RATE "
                        "(e.g. 1gbit) and DELAY one way (e.g. 5ms) with tc; needs root on Linux")
    p.add_argument("--threads", type=int, default=1, metavar="N", help="torch threads per rank (default 1)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON records")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot")
    p.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                   help="stop the run after S seconds (default 1800)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


class Progress:
    """tqdm on stderr when installed, else a one-line bar; silent when stderr is not a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.bar = None

    def __call__(self, info: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        done, total, label = info["done"], info["total"], info.get("label", "")
        try:
            from tqdm import tqdm
        except ImportError:
            width = 30
            fill = int(width * done / max(total, 1))
            sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} {label:<24.24}")
            sys.stderr.flush()
            return
        if self.bar is None:
            self.bar = tqdm(total=total, file=sys.stderr, unit="call", leave=False, dynamic_ncols=True)
        self.bar.set_description_str(f"{label:<20.20}")
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            sys.stderr.write("\r" + " " * 70 + "\r")


def resolve_link(args) -> Optional[netem.Link]:
    if args.netem is None:
        return None
    link = netem.parse_link(args.netem)
    netem.check_support()  # no silent loopback fallback: say why and stop
    return link


def link_text(link: Optional[netem.Link], local_size: int = 1) -> str:
    nodes = f"; nodes of {local_size} ranks ('/node': the hierarchical hook)" if local_size > 1 else ""
    if link is None:
        return f"loopback (all ranks on this machine, unshaped){nodes}"
    if local_size > 1:
        return (f"emulated {link} per node of {local_size} ranks (tc tbf each way"
                f"{', netem delay' if link.alpha_ms else ''}), each node in its own network namespace, "
                f"loopback inside a node ('/node': the hierarchical hook)")
    return (f"emulated {link} per rank (tc tbf each way{', netem delay' if link.alpha_ms else ''}), "
            f"each rank in its own network namespace")


def check_sizes(args) -> None:
    if not 1 <= args.world_size <= netem.MAX_RANKS:
        raise ValueError(f"--world-size must be between 1 and {netem.MAX_RANKS}, not {args.world_size}")
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, not {args.threads}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0 seconds, not {args.timeout}")


def fmt(v: Optional[float], spec: str, dash: str = "-") -> str:
    return dash if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def write_json(path: str, records: List[Dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(records, f, indent=1)


# ---- the collective benchmark ----------------------------------------------------------------
def collective_parser() -> argparse.ArgumentParser:
    width = max(len(k) for k in SUBCOMMAND_HELP) + 2
    subs = "\n".join(textwrap.fill(SUBCOMMAND_HELP[k], 100, initial_indent=f"  {k:<{width}}",
                                    subsequent_indent=" " * (width + 2)) for k in SUBCOMMANDS)
    p = argparse.ArgumentParser(
        prog="python -m gradcomp.bench",
        usage="python -m gradcomp.bench [options]\n       python -m gradcomp.bench SUBCOMMAND [options]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "Without a subcommand: average a gradient over local gloo ranks with every compressor, compare it "
            "with dense all_reduce, and project the result to network links. With neither --json nor --plot it "
            "writes gradcomp-bench.json and gradcomp-bench.png in the current directory.", 100)
        + f"\n\nsubcommands (python -m gradcomp.bench SUBCOMMAND --help for each one's options):\n{subs}")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--numel", type=int, metavar="N",
                      help=f"elements of the fp32 gradient, one tensor (default {DEFAULT_NUMEL:,})")
    size.add_argument("--model", choices=sorted(shapes.MODELS),
                      help="use this model's parameter shapes, bucketed as DDP does, instead of --numel")
    p.add_argument("--bucket-mb", type=float, default=25.0, metavar="MB", help="bucket size with --model (default 25)")
    p.add_argument("--compressors", metavar="A,B,C",
                   help="methods to run, each NAME or NAME:opt=value[:opt=value]: gradcomp compressor names and "
                        f"{', '.join(collective.TORCH_METHODS)} "
                        "(PyTorch's hooks); default: all")
    p.add_argument("--error-feedback", default="auto", choices=("auto", "on", "off", "both"),
                   help="wrap compressors in error feedback; auto: as gradcomp's DDP hook does (biased "
                        "compressors except the 16-bit casts and the plain signs)")
    p.add_argument("--algorithm", default="auto", choices=ALGORITHMS,
                   help="collective algorithm (default: chosen per compressor)")
    p.add_argument("--repeats", type=int, default=5, metavar="N", help="timed calls per method (default 5)")
    p.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed calls first (default 1)")
    p.add_argument("--links", default=None, metavar="R,R",
                   help="link rates to project the measured run to, e.g. 1gbit,10gbit (default "
                        "1gbit,10gbit,25gbit,100gbit; 'none' to skip): the link model in bench/projection.py "
                        "keeps the measured compute time and puts each method's measured bytes on a link of "
                        "that rate; a projection, labelled as such")
    p.add_argument("--local-size", type=int, default=1, metavar="L",
                   help="ranks per node (with --model): with --netem the ranks of a node share one namespace "
                        "(loopback inside) and one shaped link; each gradcomp method then runs twice, flat and "
                        "hierarchical (dense inside a node, compressed across nodes: label '/node'). Dense "
                        "all_reduce and PyTorch's hooks are unchanged (default 1)")
    common_options(p)
    return p


DEFAULT_JSON, DEFAULT_PLOT = "gradcomp-bench.json", "gradcomp-bench.png"


def run_collective(argv: Sequence[str]) -> int:
    args = collective_parser().parse_args(argv)
    if args.json is None and args.plot is None:  # no output named: write both beside the caller
        args.json = DEFAULT_JSON
        args.plot = DEFAULT_PLOT if importlib.util.find_spec("matplotlib") else None
    check_sizes(args)
    if args.repeats < 1 or args.warmup < 1:
        raise ValueError(f"--repeats and --warmup must be >= 1 (got {args.repeats} and {args.warmup}); the first "
                         "call is the warm-up that also measures the relative error")
    numel = args.numel if args.numel is not None else (None if args.model else DEFAULT_NUMEL)
    if numel is not None and numel < 1:
        raise ValueError(f"--numel must be >= 1, not {numel}")
    methods = collective.parse_methods(args.compressors, args.error_feedback)
    if args.model and args.algorithm != "auto":
        raise ValueError("--algorithm applies to the collective on one tensor (--numel); with --model the gradients "
                         "go through gradcomp's DDP hook, which picks the transport per parameter")
    if args.local_size < 1 or args.world_size % args.local_size:
        raise ValueError(f"--local-size must be >= 1 and divide --world-size ({args.world_size}), not {args.local_size}")
    if args.local_size > 1 and not args.model:
        raise ValueError("--local-size applies to gradcomp's DDP hook, which runs with --model")
    if args.local_size > 1:  # each gradcomp method flat and hierarchical, side by side
        methods = [v for m in methods for v in
                   ([m, dict(m, label=m["label"] + "/node", hierarchical=True)] if m["kind"] == "gradcomp" else [m])]
    link = resolve_link(args)
    cfg = {"numel": numel, "model": args.model, "bucket_mb": args.bucket_mb, "methods": methods,
           "algorithm": None if args.algorithm == "auto" else args.algorithm, "repeats": args.repeats,
           "warmup": args.warmup, "seed": args.seed, "local_size": args.local_size}
    env = envmod.environment(args.world_size, link_text(link, args.local_size), args.threads)
    if args.model:
        layers = shapes.model_layers(args.model)
        info = shapes.summary(layers)
        grad = (f"{args.model}: {info['layers']} tensors, {info['numel']:,} fp32 elements "
                f"({fmt_bytes(4 * info['numel'])}) per rank in {len(shapes.buckets(layers, args.bucket_mb))} "
                f"buckets of <= {args.bucket_mb:g} MB")
    else:
        shape = "x".join(map(str, collective.matrix_shape(numel)))
        grad = f"{numel:,} fp32 elements ({fmt_bytes(4 * numel)}) per rank, one {shape} tensor"
    print(envmod.header(env, [
        f"gradient {grad}",
        f"timing: median over {args.repeats} calls after {args.warmup} warm-up, slowest rank per call; "
        f"algorithm {args.algorithm}; error feedback {args.error_feedback}; seed {args.seed}",
    ]), flush=True)
    links = None if (args.links or "").lower() == "none" else projection.parse_links(args.links or projection.DEFAULT_LINKS)
    records = run_and_report("collective", cfg, args, link, env, collective_table)
    for text in auto_lines(records):  # compressor="auto": what it chose, per bucket
        print(text)
    ok = [r for r in records if not r.get("error") and r.get("collective_ms")]
    proj = None
    if links and ok and args.world_size > 1 and args.local_size == 1:
        proj = projection.project(records, links, link.rate_bit if link else None, int(records[0]["numel"]))
        print()
        print(projection.table(proj, env["link"]))
        print()
        for paragraph in projection.summary(proj, link is None, records).split("\n"):
            print(textwrap.fill(paragraph, 100))
        if args.json:
            for r in records:
                row = next((x for x in proj["rows"] if x["compressor"] == r["compressor"]), None)
                if row is not None:
                    r["trainable"] = projection.trainable(r)  # may the recommendation name it
                    r["projection"] = {"efficiency": proj["efficiency"], "pass_ms": proj["pass_ms"],
                                       "compute_ms": row["compute_ms"],
                                       "links": {str(R): v for R, v in row["at"].items()}}
            write_json(args.json, records)
    if args.plot:
        from . import plot

        plot.collective_plot(records, args.plot, proj=proj,
                             title=f"{grad}\n{env['world_size']} rank{'s' if env['world_size'] != 1 else ''}, {env['link']}")
        print(f"wrote {args.plot}")
    return 0


def run_and_report(kind: str, cfg: Dict[str, Any], args: argparse.Namespace, link: Any, env: Dict[str, Any],
                   table: Callable[[List[Dict[str, Any]]], str]) -> List[Dict[str, Any]]:
    """Run benchmark ``kind`` on the ranks (with a progress bar), print rank 0's records as a
    table and write them as JSON if asked; returns the records."""
    bar = Progress(not args.no_progress)
    try:
        results = launch.run_ranks(kind, cfg, args.world_size, link=link, threads=args.threads,
                                   timeout_s=args.timeout, on_progress=bar, local_size=cfg.get("local_size", 1))
    finally:
        bar.close()
    records = results[0]
    for r in records:
        r["env"] = env
    print()
    print(table(records))
    if args.json:
        write_json(args.json, records)
        print(f"\nwrote {args.json}")
    return records


def collective_table(records: List[Dict[str, Any]]) -> str:
    """The records as a fixed-width table, one line per method, then what the spread columns mean."""
    head = ("method", "ratio", "rel.err", "compress", "decomp.", "comm", "collective", "middle half", "dense",
            "speed-up", "vs dense", "bytes/rank")
    units = ("", "", "", "ms", "ms", "ms", "ms", "ms", "ms", "", "", "")
    rows = []
    for r in records:
        if r.get("error"):
            rows.append((r["compressor"], "skipped: " + r["error"]))
            continue
        span = r.get("collective_ms_span")
        vs = r.get("vs_dense") if r.get("speedup") is not None else None
        rows.append((r["compressor"], fmt(r["ratio"], ".1f") + "x", fmt(r["rel_error"], ".3g"),
                     fmt(r["compress_ms"], ".1f"), fmt(r["decompress_ms"], ".1f"), fmt(r.get("comm_ms"), ".1f"),
                     fmt(r["collective_ms"], ".1f"), spread.fmt_span(span), fmt(r.get("dense_ms"), ".1f"),
                     fmt(r["speedup"], ".2f") + "x", {"baseline": "-"}.get(vs or "", vs or "-"),
                     fmt_bytes(r["bytes_per_rank"])))
    w0 = max([len(head[0])] + [len(row[0]) for row in rows])
    widths = [w0, 7, 8, 9, 8, 7, 11, max([11] + [len(row[7]) for row in rows if len(row) == len(head)]), 6, 9, 8, 11]

    def line(cells) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [line(head), line(units)]
    for row in rows:
        out.append(line(row) if len(row) == len(head) else f"{row[0].ljust(w0)}  {row[1]}")
    if any(r.get("collective_ms_span") for r in records):
        out += ["", *textwrap.wrap(
            "collective: the median over the timed calls of the slowest rank's time; middle half: the first to "
            "third quartile of those calls; dense: the median of the dense all_reduce calls made alternately with "
            "this method's, on the same inputs (the dense row: its own calls); speed-up: dense / collective; "
            "vs dense: faster or slower when the method's middle half and those dense calls' do not overlap, tie "
            "when they do (within this run's noise).", 100)]
    return "\n".join(out)


def auto_lines(records: List[Dict[str, Any]]) -> List[str]:
    """What ``compressor="auto"`` chose, after how many untimed calls, and whether its row
    measures those choices alone."""
    out = []
    for r in records:
        if r.get("method") != collective.AUTO or r.get("error"):
            continue
        name, calls = r["compressor"], r.get("auto_setup_calls")
        text = (f"{name} chose per bucket: {r.get('auto_choices')} (after {calls} untimed calls: its trials and the "
                f"checks of its choices, until its decisions settled, like torch-powersgd's untimed start; its "
                f"bytes, times and rel.err are those of these choices).")
        if not r.get("auto_settled", True):
            text = (f"{name}'s decisions had not settled after {calls} untimed calls: its row mixes methods "
                    f"(last: {r.get('auto_choices')}).")
        elif r.get("auto_changed_while_timed"):
            text = (f"{name} changed {r['auto_changed_while_timed']} decision(s) during the timed calls (its "
                    f"recheck_every): its row mixes methods (last: {r.get('auto_choices')}).")
        out.append(textwrap.fill(text, 100))
    return out


# ---- entry point -----------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    previous = netem.exit_on_signals()
    try:
        sub = next((a for a in argv if a in SUBCOMMANDS), None)  # wherever it stands among the options
        if sub is not None:
            argv.remove(sub)
            module = importlib.import_module(f".{SUBCOMMANDS[sub]}", __package__)
            return module.main(argv)
        return run_collective(argv)
    except netem.NetemUnavailable as exc:
        print(f"gradcomp.bench: --netem cannot run here: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"gradcomp.bench: error: {exc}", file=sys.stderr)
        return 2
    except launch.RankError as exc:
        print(f"gradcomp.bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("gradcomp.bench: interrupted; ranks stopped and cleaned up", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
