"""The transformer training benchmark's data and model: a character-level language model of
Python source, learned from the standard library's own files (every Python installation has
them; nothing is downloaded).

Files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` outside test folders and
``site-packages``, at most 128 kB each, taken in the order of a hash of their relative path
and the seed (so the choice does not follow the alphabet), every tenth file to validation,
until the training text holds the asked size. The split is by file: no validation line was
ever seen in training. Characters are ASCII codes (vocabulary 128); the few non-ASCII ones
become ``?``. The choice depends only on the seed and the Python version's standard library.
"""
from __future__ import annotations

import hashlib
import math
import os
import sys
import sysconfig
from typing import Any, Dict, List, Optional, Tuple

import torch

VOCAB = 128
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_MAX_FILE = 128 * 1024  # a few generated files (pydoc's topics) would otherwise dominate the text
VAL_EVERY = 10  # one file in ten goes to validation


def stdlib_files(root: Optional[str] = None) -> List[str]:
    """The standard library's source files this corpus draws from, relative to ``root``, sorted."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for f in files:
            path = os.path.join(here, f)
            if f.endswith(".py") and os.path.isfile(path) and 0 < os.path.getsize(path) <= _MAX_FILE:
                out.append(os.path.relpath(path, root))
    return sorted(out)


def _encode(raw: bytes) -> torch.Tensor:
    text = raw.decode("utf-8", errors="replace").encode("ascii", errors="replace")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()


def corpus(train_bytes: int, seed: int, root: Optional[str] = None) -> Dict[str, Any]:
    """``{"train": uint8 tensor, "val": uint8 tensor, "train_files", "val_files", "root"}``:
    ``train_bytes`` characters of training text and about a ninth of that of validation text
    from whole files (see the module docstring). ``ValueError`` if the library is too small."""
    if train_bytes < 1024:
        raise ValueError(f"the training text must be at least 1 kB, not {train_bytes} bytes")
    root = root or sysconfig.get_paths()["stdlib"]
    names = stdlib_files(root)
    order = sorted(names, key=lambda n: hashlib.sha256(f"{seed}:{n}".encode()).hexdigest())
    parts: Dict[str, List[torch.Tensor]] = {"train": [], "val": []}
    files: Dict[str, List[str]] = {"train": [], "val": []}
    size = {"train": 0, "val": 0}
    want = {"train": train_bytes, "val": max(1024, train_bytes // (VAL_EVERY - 1))}
    sep = _encode(b"\n\n")
    for i, name in enumerate(order):
        split = "val" if i % VAL_EVERY == 0 else "train"
        if size[split] >= want[split]:
            if all(size[s] >= want[s] for s in size):
                break
            continue
        with open(os.path.join(root, name), "rb") as f:
            t = _encode(f.read())
        parts[split] += [t, sep]
        files[split].append(name)
        size[split] += len(t) + len(sep)
    if any(size[s] < want[s] for s in size):
        raise ValueError(f"the standard library at {root} holds {sum(size.values()):,} bytes of source, less than "
                         f"the {train_bytes:,} asked; lower --text-mb")
    return {"train": torch.cat(parts["train"])[:train_bytes], "val": torch.cat(parts["val"]),
            "train_files": files["train"], "val_files": files["val"], "root": root}


def unigram_loss(train: torch.Tensor, val: torch.Tensor) -> float:
    """Cross-entropy (nats per character) on ``val`` of the training text's character
    frequencies (add-one smoothed): what a model that ignores context reaches."""
    counts = torch.bincount(train.long(), minlength=VOCAB).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[val.long()].mean())


def batch(text: torch.Tensor, starts: torch.Tensor, context: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``(n, context)`` and next-character targets (flattened) of the windows at ``starts``."""
    idx = starts[:, None] + torch.arange(context + 1)
    w = text[idx].long()
    return w[:, :-1], w[:, 1:].reshape(-1)


def train_starts(n_text: int, context: int, rank: int, world: int, per_rank: int, seed: int,
                 step: int) -> torch.Tensor:
    """This rank's window starts for ``step``: one draw shared by every rank and every method
    (``seed``, ``step``), dealt by rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, n_text - context - 1, (world * per_rank,), generator=g)
    return starts[rank * per_rank:(rank + 1) * per_rank]


def val_starts(n_text: int, context: int, windows: int, rank: int, world: int) -> torch.Tensor:
    """This rank's share of ``windows`` evenly spaced validation windows (the same set in every run)."""
    windows -= windows % world
    starts = torch.linspace(0, n_text - context - 2, windows).long()
    return starts[rank::world]


class Block(torch.nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention, then a 4x GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CharTransformer(torch.nn.Module):
    """A GPT-style character model; ``forward(x)`` returns ``(batch * context, VOCAB)`` logits."""

    def __init__(self, layers: int, d: int, heads: int, context: int) -> None:
        super().__init__()
        if d % heads:
            raise ValueError(f"--d-model ({d}) must be a multiple of the number of heads ({heads})")
        self.tok = torch.nn.Embedding(VOCAB, d)
        self.pos = torch.nn.Embedding(context, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, VOCAB, bias=False)
        for m in self.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                torch.nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h)).view(-1, VOCAB)


def model(cfg: Dict[str, Any]) -> CharTransformer:
    torch.manual_seed(cfg["seed"])  # every run and every rank starts from the same weights
    return CharTransformer(cfg["layers"], cfg["d_model"], cfg["heads"], cfg["context"])


def lr_at(step: int, steps: int, warmup: int) -> float:
    """The learning-rate factor: linear warm-up, then cosine decay to a tenth."""
    if step < warmup:
        return (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0)))


def data_line(info: Dict[str, Any]) -> str:
    n_tr, n_va = len(info["train"]), len(info["val"])
    py = ".".join(map(str, sys.version_info[:2]))
    return (f"data     Python {py} standard library source, character level (ASCII, vocabulary {VOCAB}): "
            f"{n_tr / 1e6:.2f} MB train from {len(info['train_files'])} files / {n_va / 1e6:.2f} MB validation "
            f"from {len(info['val_files'])} other files")


def plot(records: List[Dict[str, Any]], path: str, title: str = "") -> None:
    """Training loss per step (smoothed, left) and validation loss at each evaluation (right),
    with the unigram baseline: PyTorch's hooks dashed, gradcomp's solid; the legend below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = ("#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#bcbd22", "#ff7f0e")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.6))
    for i, r in enumerate(records):
        kw: Dict[str, Any] = {"color": colours[i % len(colours)], "lw": 1.4, "label": r["method"],
                              "ls": "--" if r["source"] == "torch" else "-"}
        if r["method"] == "torch-allreduce":
            kw.update(color="#b0b0b0", ls="-", lw=4.0, zorder=1, label="torch-allreduce (dense)")
        curve = r["loss_curve"]
        w = max(1, len(curve) // 25)
        smooth = [sum(curve[max(0, j - w + 1):j + 1]) / len(curve[max(0, j - w + 1):j + 1]) for j in range(len(curve))]
        ax1.plot(range(1, len(curve) + 1), smooth, **kw)
        ax2.plot([s for s, _ in r["val_curve"]], [v for _, v in r["val_curve"]], marker=".", **kw)
    base = records[0]["unigram_loss"]
    for ax in (ax1, ax2):
        ax.axhline(base, color="k", lw=0.8, ls=":")
        ax.text(0.99, base, "unigram baseline", transform=ax.get_yaxis_transform(), ha="right", va="bottom",
                fontsize=8)
        ax.set_xlabel("step")
    ax1.set_ylabel(f"training loss (nats/char; mean of ranks, {w}-step average)")
    ax2.set_ylabel("validation loss (nats/char, held-out files)")
    top = max(base * 1.1, min(r["val_curve"][0][1] for r in records))
    low = min(base, *(v for r in records for _, v in r["val_curve"]))
    for ax in (ax1, ax2):
        ax.set_ylim(low * 0.95, top * 1.02)
    handles, labels = ax1.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
