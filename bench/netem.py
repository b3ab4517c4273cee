"""An emulated cluster on one Linux machine: one network namespace per rank, shaped links.

Layout (everything lives in namespaces created here; the host's own network is never touched)::

    rank 0 ns: gc0 ──veth── p0 ┐
    rank 1 ns: gc0 ──veth── p1 ├─ br0 (bridge in a hub namespace)
    ...                        ┘

Each rank's link is shaped in both directions with ``tc``: ``tbf`` on the rank's egress (its
upload) and on the bridge port towards it (its download), as a NIC into a switch would be,
so a rank that receives from several peers at once still gets only ``RATE``. A delay is a
``netem`` qdisc on the rank's egress, so a message from one rank to another takes ``DELAY``
one way (a ping round trip is twice that). The link is gradcomp's one link model
(``gradcomp.training.auto.link.Link``, its ``alpha_ms`` the delay), parsed by its one parser.

The addresses come from a private range that is configured only inside these namespaces.
:class:`Cluster` is a context manager whose cleanup (kill the rank processes, delete the
namespaces, which removes their links) runs on normal exit, on an exception, on Ctrl-C or
SIGTERM (via the caller's ``finally``) and at interpreter exit; namespaces left behind by a
run that was killed outright are removed by the next run.
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Sequence

from gradcomp.training.auto.link import Link, describe_rate

__all__ = ["Link", "describe_rate", "parse_link", "Cluster", "NetemUnavailable", "check_support", "exit_on_signals",
           "remove_stale", "PREFIX", "IFACE", "SUBNET", "MAX_RANKS"]

PREFIX = "gcbench-"  # every namespace this module creates starts with it
IFACE = "gc0"  # each rank's interface name, inside its own namespace
SUBNET = "10.99.0"  # /24; configured only inside the namespaces made here
MAX_RANKS = 64


class NetemUnavailable(RuntimeError):
    """The emulated cluster cannot be built here; the message says why."""


def parse_link(text: str) -> Link:
    """``"1gbit"`` or ``"100mbit,5ms"`` as a :class:`Link` (``Link.parse``: its ``alpha_ms`` is
    the one-way delay), within what the emulation shapes; ``ValueError`` if malformed."""
    link = Link.parse(text, "--netem")
    if not 8000 <= link.rate_bit <= 100 * 10**9:
        raise ValueError(f"--netem rate {str(text).split(',')[0].strip()!r} must be between 8kbit and 100gbit")
    if link.alpha_ms > 10_000:
        raise ValueError(f"--netem delay {str(text).split(',')[1].strip()!r} must be at most 10s")
    return link


def check_support() -> None:
    """Raise :class:`NetemUnavailable` unless namespaces and ``tc`` can be used here."""
    if not sys.platform.startswith("linux"):
        raise NetemUnavailable(f"--netem needs Linux network namespaces; this is {sys.platform}")
    if os.geteuid() != 0:
        raise NetemUnavailable("--netem creates network namespaces and shapes links with tc, which needs root; "
                               "run it as root (e.g. with sudo) or drop --netem to run on loopback")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetemUnavailable(f"--netem needs the iproute2 tools {' and '.join(missing)}, not found on PATH")


def exit_on_signals() -> Dict[int, object]:
    """Turn SIGTERM and SIGHUP into ``SystemExit`` (as Ctrl-C is ``KeyboardInterrupt``), so that
    every ``finally`` and context manager cleans up before the process ends. Returns the
    previous handlers, to restore them."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    return {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}


def _sh(args: Sequence[str], what: str) -> str:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise NetemUnavailable(f"{what} failed ({' '.join(args)}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _namespaces() -> List[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_stale() -> List[str]:
    """Delete namespaces of this module whose creating process is gone; returns their names."""
    removed = []
    for name in _namespaces():
        m = re.fullmatch(re.escape(PREFIX) + r"(\d+)-(?:hub|r\d+)", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            removed.append(name)
    return removed


def _tbf(rate_bit: int) -> List[str]:
    # burst: ~4 ms of traffic (and at least one 64 KiB GSO segment) so that the token bucket
    # keeps up with a 250 Hz timer; queue: 20 ms of traffic before tail drop, enough for TCP
    # to hold the rate without turning the shaper into a deep buffer.
    rate_byte = rate_bit / 8
    burst = max(int(rate_byte * 0.004), 64 * 1024)
    limit = max(int(rate_byte * 0.020), 2 * burst)
    return ["tbf", "rate", f"{rate_bit}bit", "burst", str(burst), "limit", str(limit)]


class Cluster:
    """Nodes of ``local_size`` ranks, one namespace per node, joined by shaped veth links; use
    as a context manager. The ranks of a node share its namespace and address, so they talk
    over its loopback (unshaped: the fast links inside a node) and share its shaped link."""

    def __init__(self, world_size: int, link: Link, local_size: int = 1) -> None:
        if not 1 <= world_size <= MAX_RANKS:
            raise ValueError(f"an emulated cluster has 1 to {MAX_RANKS} ranks, not {world_size}")
        if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1 or world_size % local_size:
            raise ValueError(f"local_size={local_size!r} must be an int >= 1 that divides the world size {world_size}")
        self.world_size = world_size
        self.local_size = local_size
        self.link = link
        tag = f"{PREFIX}{os.getpid()}"
        self.hub = f"{tag}-hub"
        self.nodes = [f"{tag}-r{i}" for i in range(world_size // local_size)]
        self.ranks = [self.nodes[r // local_size] for r in range(world_size)]  # each rank's namespace
        self._created: List[str] = []
        self._procs: Dict[int, subprocess.Popen] = {}
        self._closed = False

    # ---- lifetime ---------------------------------------------------------------------
    def __enter__(self) -> "Cluster":
        check_support()
        remove_stale()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill the processes started in the cluster and delete its namespaces (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 3.0
        for proc in self._procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for name in reversed(self._created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._created.clear()
        atexit.unregister(self.close)

    # ---- use --------------------------------------------------------------------------
    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank // self.local_size + 1}"

    def command(self, rank: int, argv: Sequence[str]) -> List[str]:
        """``argv`` prefixed so that it runs inside rank ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.ranks[rank], *argv]

    def popen(self, rank: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` in rank ``rank``'s namespace; it is killed by :meth:`close`."""
        if self._closed:
            raise RuntimeError("the emulated cluster is already closed")
        # a new session: Ctrl-C reaches only the parent, whose cleanup then stops the ranks
        proc = subprocess.Popen(self.command(rank, argv), start_new_session=True, **kwargs)
        self._procs[proc.pid] = proc
        return proc

    # ---- construction -----------------------------------------------------------------
    def _add_ns(self, name: str) -> None:
        _sh(["ip", "netns", "add", name], f"creating network namespace {name}")
        self._created.append(name)
        _sh(["ip", "-n", name, "link", "set", "lo", "up"], "bringing up loopback")

    def _build(self) -> None:
        self._add_ns(self.hub)
        _sh(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"], "creating the bridge")
        _sh(["ip", "-n", self.hub, "link", "set", "br0", "up"], "bringing up the bridge")
        for i, ns in enumerate(self.nodes):
            self._add_ns(ns)
            port = f"p{i}"
            # both ends are created directly inside their namespaces: the host never sees them
            _sh(["ip", "link", "add", IFACE, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.hub],
                "creating a veth pair")
            _sh(["ip", "-n", self.hub, "link", "set", port, "master", "br0"], "attaching a port to the bridge")
            _sh(["ip", "-n", self.hub, "link", "set", port, "up"], "bringing up a bridge port")
            _sh(["ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", IFACE], "assigning an address")
            _sh(["ip", "-n", ns, "link", "set", IFACE, "up"], "bringing up a rank link")
            self._shape(ns, IFACE, delay=True)
            self._shape(self.hub, port, delay=False)

    def _shape(self, ns: str, dev: str, delay: bool) -> None:
        tc = ["tc", "-n", ns, "qdisc", "add", "dev", dev]
        if delay and self.link.alpha_ms > 0:
            try:
                _sh(tc + ["root", "handle", "1:", "netem", "delay", f"{self.link.alpha_ms * 1000:.0f}us",
                          "limit", "100000"], "adding the netem delay")
            except NetemUnavailable as exc:
                if "unknown" in str(exc).lower():
                    raise NetemUnavailable(
                        "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so a delay cannot be "
                        "emulated; rate shaping with tbf works: use --netem RATE without a delay") from None
                raise
            _sh(tc + ["parent", "1:1", "handle", "10:"] + _tbf(self.link.rate_bit), "shaping a link with tbf")
        else:
            _sh(tc + ["root", "handle", "1:"] + _tbf(self.link.rate_bit), "shaping a link with tbf")
