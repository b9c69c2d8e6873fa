"""Emulated networks for the step benchmark: throttled links in private network namespaces.

``run_emulated(layout, fn, args)`` builds the namespaces of ``layout``, runs ``fn(*args,
placement)`` in a child process inside them and removes everything it made, also on failure,
Ctrl-C or SIGTERM. Nothing outside the namespaces it creates is touched: the host's interfaces,
addresses and qdiscs stay as they were.

* ``nodes=1`` (a *shared* link): one namespace; its loopback is throttled with ``tbf``, so all
  ranks' traffic, every direction together, shares one link of the given rate (a hub).
* ``nodes=K`` (two tiers): a hub namespace with a bridge, and per node a namespace joined to the
  bridge by a veth pair whose two ends are throttled (each node's "NIC": the rate per
  direction, full duplex). Ranks of one node talk over their namespace's loopback, unthrottled.

The launcher (``fn``) runs in the hub namespace (``nodes=1``: the only one); ``placement.wrap``
moves each worker into its node's namespace before it joins the process group, and points
gloo at that namespace's interface. ``probe_link`` measures a link's bandwidth and round trip
with gloo send/recv between two ranks.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from subnetdp.distributed.lifeline import pid_alive
from subnetdp.plan.nodes import node_of

PREFIX = "sdpnet-"  # every namespace a run creates: sdpnet-<pid>-<role>
SUBNET = "10.200.0"  # node k is .(k+1), the hub's bridge .254: inside our namespaces only
HUB_ADDR = f"{SUBNET}.254"
NODE_IF = "eth0"  # a node namespace's end of its veth pair
CLONE_NEWNET = 0x40000000
TBF_BURST = 512 * 1024  # bytes: the token bucket, >= the MTU (9000); tc reads "kb" as KiB
TBF = ("burst", f"{TBF_BURST // 1024}kb", "latency", "200ms")  # and 200 ms of queue
MTU = "9000"

_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


class NetemUnavailableError(ValueError):
    """Namespaces or qdiscs cannot be made here (not root, no iproute2, no netem)."""


@dataclass(frozen=True)
class Link:
    """A throttled link: ``rate_bit`` bits/s (None: unthrottled), ``latency_ms`` added delay
    one way (``tc netem``)."""

    rate_bit: float | None
    latency_ms: float = 0.0

    @property
    def rate_mbit(self) -> float | None:
        return None if self.rate_bit is None else self.rate_bit / 1e6

    def label(self) -> str:
        rate = "unthrottled" if self.rate_bit is None else f"{self.rate_bit / 1e6:g}mbit"
        return rate + (f",latency={self.latency_ms:g}ms" if self.latency_ms else "")


def parse_link(text: str) -> Link:
    """``RATE[,latency=Xms]``: RATE as tc writes it (``100mbit``, ``1gbit``, ``500kbit``) or
    ``unthrottled``; e.g. ``300mbit,latency=1ms``."""
    rate_text, *opts = [p.strip() for p in text.split(",")]
    latency = 0.0
    for opt in opts:
        m = re.fullmatch(r"latency=([0-9.]+)ms", opt)
        if not m:
            raise ValueError(f"--link: unknown option {opt!r}; expected latency=Xms")
        latency = float(m.group(1))
    if rate_text.lower() in ("unthrottled", "none", "unlimited"):
        return Link(None, latency)
    m = re.fullmatch(r"([0-9.]+)\s*([kmgt]?bit)", rate_text.lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--link: cannot read rate {rate_text!r}; give e.g. 100mbit, 1gbit "
                         "or unthrottled")
    return Link(float(m.group(1)) * _UNITS[m.group(2)], latency)


@dataclass(frozen=True)
class Layout:
    """``nodes`` namespaces of ``world // nodes`` ranks each; ``link`` is the shared link
    (``nodes=1``) or each node's link to the others."""

    link: Link
    nodes: int = 1

    @property
    def tier(self) -> str:
        return "shared" if self.nodes == 1 else "inter-node"


@dataclass(frozen=True)
class Placement:
    """Where each rank runs: picklable, handed to the launcher inside the namespaces."""

    namespaces: tuple[str, ...]  # per node
    ranks_per_node: int
    probe_bytes: int = 32 * 2**20  # the bulk transfer that measures the link

    def node(self, rank: int) -> int:
        nnodes = len(self.namespaces)  # the map train's --nnodes and torchrun use
        return node_of(rank, nnodes * self.ranks_per_node, nnodes)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as a worker entry point that first enters its rank's node namespace."""
        return _InNode(self, fn)

    def probe_pairs(self, world: int) -> dict[str, tuple[int, int]]:
        """The rank pairs whose link ``probe_link`` measures: across the throttled tier, and
        (two tiers) within a node."""
        pairs = {"link": (0, world - 1)}
        if len(self.namespaces) > 1 and self.ranks_per_node > 1:
            pairs["intra"] = (0, 1)
        return pairs


class _InNode:
    def __init__(self, placement: Placement, fn: Callable[..., Any]) -> None:
        self.placement, self.fn = placement, fn
        self.__name__ = getattr(fn, "__name__", "worker")  # the elastic agent's logs

    def __call__(self, *args: Any) -> Any:
        p = self.placement
        if len(p.namespaces) > 1:  # one namespace: the launcher's, inherited already
            _setns(p.namespaces[p.node(int(os.environ["RANK"]))])
            # the agent's store listens in the hub; gloo binds to this node's address
            os.environ.update(MASTER_ADDR=HUB_ADDR, GLOO_SOCKET_IFNAME=NODE_IF)
        return self.fn(*args)


def _setns(name: str) -> None:
    """Move the calling thread (a worker's main thread, before it opens any socket) into the
    named namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def check_available(layout: Layout) -> None:
    """Raise ``NetemUnavailableError`` (one line, how to fix) when the layout cannot be built."""
    if os.geteuid() != 0:
        raise NetemUnavailableError("--link needs root (network namespaces and tc qdiscs); "
                                    "run as root, or drop --link")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetemUnavailableError(f"--link needs iproute2's `{tool}` on PATH (apt-get "
                                        "install iproute2), or drop --link")
    if layout.nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {layout.nodes}")


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NetemUnavailableError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")


def our_namespaces() -> list[str]:
    """Namespaces named with ``PREFIX`` (any run's)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [ln.split()[0] for ln in out.stdout.splitlines()
            if ln.strip() and ln.split()[0].startswith(PREFIX)]


def remove_stale() -> list[str]:
    """Delete namespaces a run left behind (``sdpnet-<pid>-*`` whose pid no longer runs):
    killed with SIGKILL, say. Other live runs' namespaces are left alone."""
    removed = []
    for name in our_namespaces():
        m = re.match(rf"{PREFIX}(\d+)-", name)
        if m and not pid_alive(int(m.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
            removed.append(name)
    return removed


class Network:
    """The namespaces, veth pairs and qdiscs of one layout; ``with Network(layout) as net``
    builds them and removes them on exit (deleting a namespace deletes its links and qdiscs)."""

    def __init__(self, layout: Layout, world: int) -> None:
        if world % layout.nodes:
            raise ValueError(f"--nodes {layout.nodes} must divide the number of workers "
                             f"({world})")
        self.layout, self.world = layout, world
        tag = f"{PREFIX}{os.getpid()}-{time.monotonic_ns() % 10**6}"
        self.hub = f"{tag}-hub"
        self.nodes = ([self.hub] if layout.nodes == 1
                      else [f"{tag}-n{k}" for k in range(layout.nodes)])
        self.made: list[str] = []
        # about two seconds of transfer at the nominal rate, 8 to 32 MiB: tbf's 512 KiB
        # bucket, full at the start, then adds at most 4%
        rate = layout.link.rate_bit
        probe = 32 * 2**20 if rate is None else int(min(max(rate / 4, 8 * 2**20), 32 * 2**20))
        self.placement = Placement(tuple(self.nodes), world // layout.nodes, probe)

    def __enter__(self) -> Network:
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        for name in reversed(self.made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        self.made.clear()

    def _add(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _shape(self, ns: str, dev: str) -> None:
        """tbf (and netem for latency) on ``dev``'s egress in ``ns``."""
        link = self.layout.link
        tc = ("tc", "-n", ns, "qdisc", "add", "dev", dev)
        parent: tuple[str, ...] = ("root",)
        if link.latency_ms:
            _run(*tc, "root", "handle", "1:", "netem", "delay", f"{link.latency_ms}ms")
            parent = ("parent", "1:1")
        if link.rate_bit is not None:
            _run(*tc, *parent, "tbf", "rate", f"{int(link.rate_bit)}bit", *TBF)

    def _build(self) -> None:
        self._add(self.hub)
        if self.layout.nodes == 1:
            _run("ip", "-n", self.hub, "link", "set", "lo", "mtu", MTU)
            self._shape(self.hub, "lo")
            return
        _run("ip", "-n", self.hub, "link", "add", "br0", "mtu", MTU, "type", "bridge")
        _run("ip", "-n", self.hub, "addr", "add", f"{HUB_ADDR}/24", "dev", "br0")
        _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        for k, ns in enumerate(self.nodes):
            self._add(ns)
            hub_end = f"n{k}"
            _run("ip", "-n", self.hub, "link", "add", hub_end, "mtu", MTU, "type", "veth",
                 "peer", "name", NODE_IF, "mtu", MTU, "netns", ns)
            _run("ip", "-n", self.hub, "link", "set", hub_end, "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{k + 1}/24", "dev", NODE_IF)
            _run("ip", "-n", ns, "link", "set", NODE_IF, "up")
            self._shape(ns, NODE_IF)  # the node's sending side
            self._shape(self.hub, hub_end)  # and its receiving side

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """``fn(*args, self.placement)`` in a child process inside the hub namespace (its
        fork server and workers die with it, nothing of them outlives the namespaces)."""
        with tempfile.TemporaryDirectory(prefix="subnetdp-netem-") as tmp:
            job, out = os.path.join(tmp, "job.pkl"), os.path.join(tmp, "out.pkl")
            with open(job, "wb") as f:
                pickle.dump((fn, (*args, self.placement)), f)
            cmd = ["ip", "netns", "exec", self.hub, sys.executable, "-c",
                   f"import sys; from {__name__} import _child_main; "
                   "sys.exit(_child_main(sys.argv[1], sys.argv[2]))", job, out]
            with _child(cmd) as proc:
                code = proc.wait()
            if not os.path.exists(out):
                raise RuntimeError(f"the emulated-network run exited with code {code} before "
                                   "it wrote its result")
            with open(out, "rb") as f:
                ok, value = pickle.load(f)
        if not ok:
            raise _rebuild(value)
        return value


@contextlib.contextmanager
def _child(cmd: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    """The child process; SIGTERM/SIGINT here stop it (it stops its workers) before the
    namespaces go."""
    proc = subprocess.Popen(cmd)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for s in saved:
        signal.signal(s, stop)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for s, h in saved.items():
            signal.signal(s, h)


def run_emulated(layout: Layout, world: int, fn: Callable[..., Any],
                 args: tuple[Any, ...]) -> Any:
    """``fn(*args, placement)`` with the workers in ``layout``'s namespaces (see the module
    docstring); ``fn`` starts the workers through ``placement.wrap``."""
    check_available(layout)
    with Network(layout, world) as net:
        return net.run(fn, args)


# -- exceptions across the child boundary -------------------------------------------------

def _portable(e: BaseException) -> tuple[str, Any]:
    launch = sys.modules.get("subnetdp.distributed.launch")  # not imported: not raised
    if launch is not None and isinstance(e, launch.WorkerFailedError):
        return ("worker", (str(e), e.failures, e.first))
    if isinstance(e, ValueError):
        return ("value", str(e))
    return ("other", f"{type(e).__name__}: {e}")


def _rebuild(value: tuple[str, Any]) -> BaseException:
    from subnetdp.distributed.launch import WorkerFailedError

    kind, data = value
    if kind == "worker":
        return WorkerFailedError(data[0], data[1], first=data[2])
    if kind == "value":
        return ValueError(data)
    return RuntimeError(data)


def _child_main(job: str, out: str) -> int:
    with open(job, "rb") as f:
        fn, args = pickle.load(f)
    try:
        result: tuple[bool, Any] = (True, fn(*args))
    except Exception as e:  # reported by the parent, as it would have been raised there
        result = (False, _portable(e))
    with open(out, "wb") as f:
        pickle.dump(result, f)
    return 0


# -- link measurement (inside workers, default process group up) ----------------------------

def probe_link(src: int, dst: int, *, nbytes: int = 32 * 2**20, repeats: int = 2,
               pings: int = 20) -> dict[str, float]:
    """Bandwidth (a bulk ``nbytes`` send, best of ``repeats``, its round trip subtracted)
    and median round trip (ping-pong of one float) between ranks ``src`` and ``dst`` over
    gloo; the other ranks wait at a barrier. Collective: every rank calls it."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    tiny = torch.zeros(1)
    rtts: list[float] = []
    bulk: list[float] = []
    if rank in (src, dst):
        peer = dst if rank == src else src
        for _ in range(pings):
            t0 = time.perf_counter()
            if rank == src:
                dist.send(tiny, peer)
                dist.recv(tiny, peer)
            else:
                dist.recv(tiny, peer)
                dist.send(tiny, peer)
            rtts.append(time.perf_counter() - t0)
        data = torch.empty(nbytes // 4)
        for _ in range(repeats):
            t0 = time.perf_counter()
            if rank == src:
                dist.send(data, peer)
                dist.recv(tiny, peer)
            else:
                dist.recv(data, peer)
                dist.send(tiny, peer)
            bulk.append(time.perf_counter() - t0)
    dist.barrier()
    if rank != src:
        return {}
    rtt = statistics.median(rtts)
    return {"mbit": nbytes * 8 / max(min(bulk) - rtt, 1e-9) / 1e6, "rtt_ms": rtt * 1e3,
            "bytes": float(nbytes)}

