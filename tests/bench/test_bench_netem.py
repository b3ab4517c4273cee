"""The emulated cluster: links are shaped as asked, and nothing is left behind, whatever ends the run.

The tests that build namespaces need root and iproute2; elsewhere they skip and say why.
"""
import os
import shutil
import signal
import subprocess
import sys

import pytest

from gradcomp.bench import netem


def _can_build():
    if not sys.platform.startswith("linux"):
        return "network namespaces exist only on Linux"
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    return None


needs_root = pytest.mark.skipif(_can_build() is not None, reason=str(_can_build()))

SERVER = """
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 5201)); s.listen(1)
c, _ = s.accept(); n, t0 = 0, None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    t0 = t0 or time.perf_counter()
    n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""
CLIENT = """
import socket, sys, time
deadline = time.monotonic() + 5
while True:
    try:
        t0 = time.perf_counter(); s = socket.create_connection((sys.argv[1], 5201), timeout=5); break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
print(time.perf_counter() - t0, flush=True)
s.sendall(b"x" * int(sys.argv[2])); s.close()
"""


def _ours():
    return [n for n in netem._namespaces() if n.startswith(f"{netem.PREFIX}{os.getpid()}-")]


def test_parse_link():
    assert netem.parse_link("1gbit") == netem.Link.of(0.0, 1)
    assert netem.parse_link("100mbit,5ms") == netem.Link.of(5.0, 0.1)
    assert netem.parse_link("2.5Gbit, 250us") == netem.Link.of(0.25, 2.5)
    assert netem.parse_link("2.5Gbit, 250us").rate_bit == 2_500_000_000
    assert str(netem.parse_link("100mbit,5ms")) == "100 Mbit/s, 5 ms delay"
    for bad in ("1gb", "fast", "1gbit,5", "1gbit,5ms,1%", "0bit", ""):
        with pytest.raises(ValueError, match="RATE|delay|between"):
            netem.parse_link(bad)


def test_without_root_it_says_why(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(netem.NetemUnavailable, match="root"):
        netem.check_support()


@needs_root
def test_link_is_shaped_and_everything_is_removed():
    rate = 40 * 10**6
    nbytes = 1_500_000  # 0.3 s at 40 Mbit/s
    with netem.Cluster(2, netem.Link.of(0.0, rate / 1e9)) as cluster:
        assert len(_ours()) == 3
        srv = cluster.popen(1, [sys.executable, "-c", SERVER, cluster.address(1)], stdout=subprocess.PIPE, text=True)
        cli = cluster.popen(0, [sys.executable, "-c", CLIENT, cluster.address(1), str(nbytes)],
                            stdout=subprocess.PIPE, text=True)
        n, seconds = srv.communicate(timeout=20)[0].split()
        cli.communicate(timeout=20)
        assert int(n) == nbytes
        measured = int(n) * 8 / float(seconds)
        assert 0.6 * rate < measured < 1.15 * rate, f"measured {measured / 1e6:.1f} Mbit/s on a 40 Mbit/s link"
        sleeper = cluster.popen(0, ["sleep", "60"])
    assert sleeper.poll() is not None, "a process started in the cluster outlived it"
    assert _ours() == []


def _transfer(cluster, src, dst, nbytes):
    """Bits per second from rank ``src`` to rank ``dst`` (a server in dst's namespace)."""
    srv = cluster.popen(dst, [sys.executable, "-c", SERVER, cluster.address(dst)], stdout=subprocess.PIPE, text=True)
    cli = cluster.popen(src, [sys.executable, "-c", CLIENT, cluster.address(dst), str(nbytes)],
                        stdout=subprocess.PIPE, text=True)
    n, seconds = srv.communicate(timeout=20)[0].split()
    cli.communicate(timeout=20)
    assert int(n) == nbytes
    return int(n) * 8 / float(seconds)


@needs_root
def test_nodes_share_a_namespace_and_a_shaped_link():
    """Nodes of 2 ranks: inside a node the ranks share an address and talk over loopback
    (unshaped), between nodes over the node's shaped link."""
    rate = 40 * 10**6
    with netem.Cluster(4, netem.Link.of(0.0, rate / 1e9), local_size=2) as cluster:
        assert len(_ours()) == 3  # the hub and 2 nodes
        assert cluster.address(0) == cluster.address(1) != cluster.address(2) == cluster.address(3)
        across = _transfer(cluster, 0, 2, 1_500_000)
        assert 0.6 * rate < across < 1.15 * rate, f"measured {across / 1e6:.1f} Mbit/s between nodes"
        inside = _transfer(cluster, 3, 2, 1_500_000)
        assert inside > 5 * rate, f"measured {inside / 1e6:.1f} Mbit/s inside a node: shaped?"
    assert _ours() == []
    with pytest.raises(ValueError, match="divides the world size"):
        netem.Cluster(4, netem.Link.of(0.0, rate / 1e9), local_size=3)


@needs_root
def test_delay_is_emulated_or_refused_with_the_reason():
    try:
        with netem.Cluster(2, netem.Link.of(20.0, 1)) as cluster:
            srv = cluster.popen(1, [sys.executable, "-c", SERVER, cluster.address(1)], stdout=subprocess.PIPE,
                                text=True)
            cli = cluster.popen(0, [sys.executable, "-c", CLIENT, cluster.address(1), "1"], stdout=subprocess.PIPE,
                                text=True)
            connect_s = float(cli.communicate(timeout=20)[0])
            srv.communicate(timeout=20)
            # a TCP connect is one round trip: 20 ms each way
            assert 0.035 < connect_s < 0.5, f"connect took {connect_s * 1e3:.1f} ms with 20 ms one-way delay"
    except netem.NetemUnavailable as exc:
        assert "netem" in str(exc) and "without a delay" in str(exc)
    assert _ours() == []


@needs_root
def test_an_error_inside_removes_the_cluster():
    with pytest.raises(ZeroDivisionError):
        with netem.Cluster(2, netem.Link.of(0.0, 1)):
            assert len(_ours()) == 3
            1 / 0
    assert _ours() == []


CHILD = """
import subprocess, sys, time
from gradcomp.bench import netem
netem.exit_on_signals()
with netem.Cluster(2, netem.Link.of(0.0, 1)) as c:
    p = c.popen(1, ["sleep", "60"])
    print(p.pid, flush=True)
    time.sleep(60)
"""


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_removes_the_cluster(sig):
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        sleeper = int(child.stdout.readline())
        prefix = f"{netem.PREFIX}{child.pid}-"
        assert sum(n.startswith(prefix) for n in netem._namespaces()) == 3
        child.send_signal(sig)
        assert child.wait(15) != 0
        assert not any(n.startswith(prefix) for n in netem._namespaces())
        assert not os.path.exists(f"/proc/{sleeper}") or _is_zombie(sleeper)
    finally:
        if child.poll() is None:
            child.kill()


def _is_zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


@needs_root
def test_namespaces_of_a_killed_run_are_removed_by_the_next():
    stale = f"{netem.PREFIX}{2**22 + 7}-hub"  # above any pid the kernel hands out
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in netem.remove_stale()
        assert stale not in netem._namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
