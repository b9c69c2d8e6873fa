"""A cluster as the step-time model sees it: devices, where ranks sit, and the links between them.

``parse_cluster("nodes=4,gpus-per-node=8,gpu=h100,intra=900GB/s,inter=25gbit")`` reads the
``--cluster`` text of ``subnetdp plan``; every bad key or value is a one-line ``ValueError``.

Ranks fill nodes in order (rank r on node ``r // gpus-per-node``). Links:

- ``intra``: between ranks of one node, per rank and direction (NVLink: every GPU has its own),
  unless ``shared-intra=1``: one link for all of a node's ranks together (the emulated network's
  throttled loopback, ``bench.netem``).
- ``inter``: one NIC's rate per direction (full duplex); a node has ``nics`` of them (default 1),
  shared by all its ranks' traffic to other nodes.

``DEVICES`` is the device table: dense peak FLOP/s (no sparsity) per compute dtype, memory, and
the MFU the advisor assumes; ``cpu`` is this project's 2-core machine as measured by
``subnetdp.estimate.calibrate`` (``benchmarks/results/cpu_calibration.json``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s, per direction
    latency: float = 0.0  # seconds, one hop (the α of the α-β model)
    # bytes that pass at once after the link has idled: a token-bucket shaper's bucket (the
    # emulated links' tbf, ``bench.netem.TBF``), refilled at ``bandwidth``; 0 on a real NIC
    burst: float = 0.0


@dataclass(frozen=True)
class Device:
    name: str
    peak_bf16: float  # dense FLOP/s at bf16 compute (tensor cores)
    peak_fp32: float  # dense FLOP/s at fp32 compute (TF32 tensor cores on GPUs)
    memory_gb: float
    mfu: float  # model FLOP/s / datasheet peak (``mfu_source``: which measurement)
    intra: Link  # the default link between ranks of one node
    note: str = ""
    backend: str = "nccl"  # the collectives' (distributed.process_group: gloo on CPUs)
    mfu_source: str = ""
    mfu_assumed: bool = True  # no measurement on this device produced ``mfu``
    memory_assumed: bool = False  # ``memory_gb`` is not the device's datasheet figure
    local: bool = False  # the machine ``plan`` runs on: its rate is measured there and then

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s of the compute dtype (``bf16-mixed`` and ``bf16`` compute in bf16)."""
        return self.peak_fp32 if dtype == "fp32" else self.peak_bf16

    def rate(self, dtype: str) -> float:
        """Sustained model FLOP/s: peak × MFU."""
        return self.peak(dtype) * self.mfu


GB = 1e9
# llama-1b's training step on 8 x H200 (bf16-mixed, 4 x 2048 per rank, eager; ddp, b-sdp,
# n-sdp, fsdp+ac within 2% of each other): 157 TFLOP/s executed per rank, over the 989
# TFLOP/s datasheet peak (benchmarks/results/gpu_h200/mfu.md; torch.compile: 465, 0.47)
H200_MFU = 157.4e12 / 989e12
_H200 = ("measured: llama-1b on 8 x H200, bf16-mixed 4 x 2048, eager, "
         "benchmarks/results/gpu_h200/mfu.md")
_FROM_H200 = "the H200's measured MFU (llama-1b, bf16-mixed, eager), not measured on an "
# Vendor datasheets, SXM parts, dense (the 2:4-sparsity figures are twice these); NVLink is
# the per-GPU bidirectional figure halved: the rate per direction.
DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("a100", 312e12, 156e12, 80, H200_MFU, Link(300 * GB, 5e-6), "A100 SXM 80GB, NVLink 3",
           mfu_source=_FROM_H200 + "A100"),
    Device("h100", 989e12, 494e12, 80, H200_MFU, Link(450 * GB, 5e-6), "H100 SXM, NVLink 4",
           mfu_source=_FROM_H200 + "H100"),
    Device("h200", 989e12, 494e12, 141, H200_MFU, Link(450 * GB, 5e-6), "H200 SXM, NVLink 4",
           mfu_source=_H200, mfu_assumed=False),
    # this project's machine: the rate is calibrated when the advisor runs (estimate.rates);
    # the figures here are python -m subnetdp.estimate.calibrate's earlier record
    # (benchmarks/results/cpu_calibration.json: 4 processes on the 2 cores, load about 7) and
    # the loopback's measured rate; memory is a per-process allowance, not a datasheet's
    Device("cpu", 13.4e9, 13.4e9, 8, 0.25, Link(2.6e9 / 8, 5e-5),
           "this project's 2-core Xeon, 4 processes sharing it", "gloo",
           mfu_source="benchmarks/results/cpu_calibration.json, an earlier day's load",
           memory_assumed=True, local=True),
)}


_RATE = re.compile(r"([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(bit|b|B)(?:ps|/s)?")
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME = re.compile(r"([0-9]*\.?[0-9]+)\s*(ns|us|ms|s)")
_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_rate(text: str) -> float:
    """Bytes/s from ``25gbit``, ``100Gbit/s``, ``400Gb/s`` (bits) or ``900GB/s`` (bytes)."""
    m = _RATE.fullmatch(text.strip())
    if not m or float(m[1]) <= 0:
        raise ValueError(f"cannot read the rate {text!r}; write e.g. 25gbit, 100Gb/s or 900GB/s "
                         "(b, bit: bits; B: bytes)")
    bits = m[3] != "B"
    return float(m[1]) * _PREFIX[m[2].lower()] / (8 if bits else 1)


def parse_latency(text: str) -> float:
    m = _TIME.fullmatch(text.strip())
    if not m:
        raise ValueError(f"cannot read the latency {text!r}; write e.g. 5us or 1ms")
    return float(m[1]) * _SECONDS[m[2]]


@dataclass(frozen=True)
class Cluster:
    nodes: int
    ranks_per_node: int
    device: Device
    intra: Link
    inter: Link | None = None  # None: one node
    nics: int = 1
    shared_intra: bool = False
    # the keys whose values are defaults, marked "assumed" in ``describe``: "intra",
    # "intra-latency", "inter-latency"
    assumed: frozenset[str] = frozenset()

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def replace(self, **changes: object) -> Cluster:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def describe(self) -> str:
        def mark(key: str) -> str:
            return ", assumed" if key in self.assumed else ""

        inter = "" if self.inter is None else (
            f", inter-node {_rate_text(self.inter.bandwidth)} x {self.nics} NIC(s) per node "
            f"(latency {self.inter.latency * 1e6:g} us{mark('inter-latency')})")
        share = " shared by the node's ranks" if self.shared_intra else " per rank"
        return (f"{self.nodes} node(s) x {self.ranks_per_node} {self.device.name}, intra-node "
                f"{_rate_text(self.intra.bandwidth)}{share}{mark('intra')} (latency "
                f"{self.intra.latency * 1e6:g} us{mark('intra-latency')}){inter}")


def _rate_text(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    if bits >= 1e12:
        return f"{bytes_per_s / GB:g} GB/s"
    return f"{bits / 1e9:g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:g} Mbit/s"


KEYS = ("nodes", "gpus-per-node", "gpu", "intra", "inter", "intra-latency", "inter-latency",
        "nics", "shared-intra")


def parse_cluster(text: str) -> Cluster:
    """``key=value,...`` (``KEYS``); ``gpu`` names a ``DEVICES`` row (default h100),
    ``gpus-per-node`` defaults to 8, ``intra`` to the device's link, ``inter`` is needed
    with more than one node (latency default 10 us)."""
    values: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, value = part.partition("=")
        key = key.strip().lower().replace("_", "-")
        key = "gpus-per-node" if key == "ranks-per-node" else key
        if not sep or key not in KEYS:
            raise ValueError(f"--cluster: cannot read {part!r}; use key=value with keys "
                             f"{', '.join(KEYS)}")
        if key in values:
            raise ValueError(f"--cluster: {key} is given twice")
        values[key] = value.strip()
    name = values.get("gpu", "h100").lower()
    if name not in DEVICES:
        raise ValueError(f"--cluster: unknown gpu {name!r}; choose one of {', '.join(DEVICES)}")
    device = DEVICES[name]
    nodes = _positive_int(values, "nodes", 1)
    per_node = _positive_int(values, "gpus-per-node", 8)
    try:
        intra = Link(parse_rate(values["intra"]) if "intra" in values else device.intra.bandwidth,
                     parse_latency(values["intra-latency"]) if "intra-latency" in values
                     else device.intra.latency)
        inter = None
        if "inter" in values:
            inter = Link(parse_rate(values["inter"]),
                         parse_latency(values.get("inter-latency", "10us")))
    except ValueError as e:
        raise ValueError(f"--cluster: {e}") from None
    if nodes > 1 and inter is None:
        raise ValueError("--cluster: more than one node needs inter=RATE (e.g. inter=25gbit), "
                         "the NIC rate between nodes")
    shared = values.get("shared-intra", "0")
    if shared not in ("0", "1"):
        raise ValueError(f"--cluster: shared-intra must be 0 or 1, got {shared!r}")
    # the device table's link (a datasheet peak; the CPU's, an earlier day's loopback) and
    # the default latencies: nobody measured them for this cluster
    assumed = {k for k in ("intra", "intra-latency", "inter-latency") if k not in values}
    if inter is None:
        assumed.discard("inter-latency")
    return Cluster(nodes, per_node, device, intra, inter, _positive_int(values, "nics", 1),
                   shared == "1", frozenset(assumed))


def _positive_int(values: dict[str, str], key: str, default: int) -> int:
    text = values.get(key, str(default))
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--cluster: {key} must be a whole number >= 1, got {text!r}")
    return int(text)
