"""``subnetdp plan cluster``: every strategy on a cluster (``estimate.advisor``).

    subnetdp plan cluster --recipe llama-1b --cluster nodes=4,gpus-per-node=8,gpu=h100,inter=25gbit

Per strategy and coverage: fits in --memory-gb (default: the device's), peak memory, bytes per
step, predicted step time and tokens/s (docs/advisor.md).
"""

from __future__ import annotations

import argparse
import json
import sys

from subnetdp.commands.options import add_declared, strategy_list
from subnetdp.commands.plan_budget import ESTIMATED, search_base
from subnetdp.estimate.cluster import DEVICES
from subnetdp.estimate.cluster import KEYS as CLUSTER_KEYS
from subnetdp.estimate.communicators import comm_mem_mb
from subnetdp.train.options import floats

# the coverages it tries are a list here; --coverages is their old spelling
NARROW = {"memory_gb": {"type": float, "metavar": "GB",
                        "default": None},
          "coverage": {"type": floats, "default": [0.5, 0.75], "metavar": "C[,C...]",
                       "aliases": ("--coverages",)}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_declared(p, "plan cluster", (*ESTIMATED, "coverage", "peak_tflops"), narrow=NARROW)
    p.add_argument("--cluster", action="append", metavar="K=V,...", required=True,
                   help="e.g. nodes=4,gpus-per-node=8,gpu=h100,intra=900GB/s,inter=25gbit "
                        "(keys: " + ", ".join(CLUSTER_KEYS) + "; gpu: " + ", ".join(DEVICES)
                        + "); repeat for one table per cluster of the same size")
    p.add_argument("--strategies", type=strategy_list, metavar="S[,S...]",
                   help="estimate only these, e.g. ddp,b-sdp+fsdp (default: the advisor's "
                        "list)")
    p.add_argument("--mfu", type=float, help="model FLOP/s utilisation (default: the device "
                                             "table's)")
    p.add_argument("--calibration", metavar="FILE",
                   help="gpu=cpu: the rate of a python -m subnetdp.estimate.calibrate --out "
                        "FILE record (default: calibrate now, a few seconds)")
    p.add_argument("--no-overlap", action="store_true",
                   help="put every collective on the critical path (default: buckets overlap "
                        "backward, FSDP prefetches)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """The advisor's table per cluster."""
    from subnetdp.estimate.advisor import OPTIONS, advise, format_advice, left_out
    from subnetdp.estimate.cluster import parse_cluster
    from subnetdp.estimate.rates import advisor_rate

    try:
        clusters = [parse_cluster(text) for text in args.cluster]
        if args.recipe is None:
            raise ValueError("--cluster needs --recipe NAME")
        if args.nproc is not None and args.nproc != clusters[0].world:
            raise ValueError(f"--nproc {args.nproc} differs from the cluster's "
                             f"{clusters[0].world} ranks; drop --nproc")
        comm_mb = comm_mem_mb(args.comm_mem_mb, nccl=clusters[0].device.backend == "nccl")
        if args.mfu is not None and not 0 < args.mfu <= 1:
            raise ValueError(f"--mfu must be in (0, 1], got {args.mfu}")
        if args.peak_tflops is not None and args.peak_tflops <= 0:
            raise ValueError(f"--peak-tflops must be > 0, got {args.peak_tflops}")
        device = clusters[0].device
        memory_gb = args.memory_gb if args.memory_gb is not None else device.memory_gb
        base = search_base(args, clusters[0].world, comm_mb)
        options = tuple(args.strategies) if args.strategies else OPTIONS
        coverages = tuple(args.coverage)
        rate = advisor_rate(base, clusters[0], mfu=args.mfu, peak_tflops=args.peak_tflops,
                            calibration=args.calibration)
        tables = advise(base, clusters, memory_gb=memory_gb, rate=rate,
                        coverages=coverages, options=options, overlap=not args.no_overlap)
        skipped = left_out(base, clusters[0].world, coverages, options)
    except ValueError as e:
        print(f"subnetdp plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{"cluster": c.describe(), "rate_flops": rate.flops,
                           "rate_source": rate.source, "rate_assumed": rate.assumed,
                           "memory_gb": memory_gb, "not_estimated": skipped,
                           "rows": [a.to_dict() for a in rows]}
                          for c, rows in zip(clusters, tables, strict=True)]))
        return 0
    print("\n\n".join(format_advice(rows, c, base, memory_gb=memory_gb, rate=rate,
                                    overlap=not args.no_overlap, skipped=skipped,
                                    memory_given=args.memory_gb is not None)
                       for c, rows in zip(clusters, tables, strict=True)))
    return 0
