"""The step-time model's device rate on this machine, measured (``estimate.steptime``).

    python -m subnetdp.estimate.calibrate [--recipe llama-tiny] [--batch-size 4] \\
        [--seq-len 128] [--nproc 4] [--steps 8] [--matmul-seconds 3]
        [--out benchmarks/results/cpu_calibration.json]

``nproc`` processes start together (one thread each, as the benchmark's workers run) and each
measures, with nothing else of its own running:

- ``peak_flops``: a 1024 x 1024 fp32 matmul, repeated (2·n³ FLOPs each), median rate;
- ``model_flops``: one rank's training step of the whole recipe (forward, backward, AdamW
  ``foreach=False`` as the benchmarks build it, no process group and no communication):
  counted forward + backward FLOPs (``subnet.costs``) over the median step time.

- ``fsdp_call_s``: the host time of one FSDP collective call: the processes form a gloo
  group and train ``FSDP_MODULES`` tiny FSDP modules (8 x 8 linears, sharded as the runtime
  shards the baselines: ``runtime.fsdp.shard_over_mesh``, gloo's ring and asynchronous
  gathers), whose compute and bytes are negligible: step time / calls (a gather each in
  forward and backward, a reduce-scatter per module). Hooks, copy-in/out and the
  rendezvous of ``nproc`` processes sharing the machine are in it.

``mfu = model_flops / peak_flops``. The medians over the processes are written to ``--out``
(JSON). None of these are step times of the strategies the model predicts: the model is
calibrated here and on the links' probes, then compared with the benchmark.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

MATMUL_N = 1024


def _matmul_rate(seconds: float) -> float:
    import torch

    a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)
    rates: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(rates) < 3:
        t0 = time.perf_counter()
        torch.mm(a, b)
        rates.append(2 * MATMUL_N**3 / (time.perf_counter() - t0))
    return statistics.median(rates)


def _model_rate(recipe_name: str, batch: int, seq: int, steps: int) -> tuple[float, float]:
    """(counted FLOPs per step, median step seconds) of the full model's training step."""
    import torch
    import torch.nn.functional as F

    from subnetdp.models import get_recipe
    from subnetdp.subnet.costs import recipe_costs

    recipe = get_recipe(recipe_name)
    costs = recipe_costs(recipe, batch=batch, seq=seq)
    flops = costs.shared.flops + sum(u.flops for u in costs.units)
    torch.manual_seed(0)
    model = recipe.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    config: Any = getattr(model, "config", None)
    vocab = int(config.vocab_size)
    times = []
    for i in range(steps + 2):  # two warm-up steps (optimizer state, allocator)
        tokens = torch.randint(0, vocab, (batch, seq + 1))
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                        tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return float(flops), statistics.median(times)


FSDP_MODULES = 16
FSDP_CALLS_PER_MODULE = 3  # forward gather, backward gather, reduce-scatter


def _fsdp_call_s(rank: int, nproc: int, store: str, steps: int) -> float:
    """Median seconds per FSDP collective call (module docstring), in a gloo group."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from subnetdp.runtime.fsdp import shard_over_mesh, world_mesh

    dist.init_process_group("gloo", store=dist.FileStore(store, nproc), rank=rank,
                            world_size=nproc)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(FSDP_MODULES)))
        shard_over_mesh(model, list(model), world_mesh("cpu"), MixedPrecisionPolicy())
        x = torch.randn(4, 8)
        times = []
        for i in range(steps + 2):  # two warm-up steps (FSDP's lazy init)
            dist.barrier()
            t0 = time.perf_counter()
            model(x).sum().backward()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        return statistics.median(times) / (FSDP_MODULES * FSDP_CALLS_PER_MODULE)
    finally:
        dist.destroy_process_group()


def _one(args: tuple[str, int, int, int, float, str], start: Any, rank: int
         ) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    recipe, batch, seq, steps, seconds, store = args
    nproc = start.parties
    start.wait()  # every process measures at once: the benchmark's contention
    peak = _matmul_rate(seconds)
    flops, step = _model_rate(recipe, batch, seq, steps)
    call = _fsdp_call_s(rank, nproc, store, max(steps, 3))
    return {"peak_flops": peak, "model_flops": flops / step, "step_s": step,
            "flops_per_step": flops, "fsdp_call_s": call}


def calibrate(recipe: str = "llama-tiny", batch: int = 4, seq: int = 128, nproc: int = 4,
              steps: int = 8, matmul_seconds: float = 3.0) -> dict[str, Any]:
    """Measure in ``nproc`` concurrent processes (module docstring); the medians."""
    load = os.getloadavg()[0]  # the machine as it was: other jobs share it
    ctx = mp.get_context("spawn")
    start = ctx.Manager().Barrier(nproc)
    with tempfile.TemporaryDirectory() as tmp, ctx.Pool(nproc) as pool:
        args = (recipe, batch, seq, steps, matmul_seconds, os.path.join(tmp, "store"))
        results = pool.starmap(_one, [(args, start, rank) for rank in range(nproc)])
    peak = statistics.median(r["peak_flops"] for r in results)
    model = statistics.median(r["model_flops"] for r in results)
    import torch

    return {"device": "cpu", "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "nproc": nproc, "threads_per_process": 1,
            "recipe": recipe, "batch_size": batch, "seq_len": seq,
            "peak_flops": peak, "model_flops": model, "mfu": model / peak,
            "flops_per_step": results[0]["flops_per_step"],
            "fsdp_call_s": statistics.median(r["fsdp_call_s"] for r in results),
            "step_s_median": statistics.median(r["step_s"] for r in results),
            "per_process": results, "torch": torch.__version__, "load_before": load,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m subnetdp.estimate.calibrate",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--recipe", default="llama-tiny")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--nproc", type=int, default=4, help="concurrent processes (default 4)")
    p.add_argument("--steps", type=int, default=8, help="timed training steps per process")
    p.add_argument("--matmul-seconds", type=float, default=3.0,
                   help="seconds of matmuls per process (default %(default)s)")
    p.add_argument("--out", help="write the JSON here (default: print it)")
    args = p.parse_args(argv)
    if min(args.batch_size, args.seq_len, args.nproc, args.steps) < 1 or not (
            args.matmul_seconds > 0):
        print("calibrate: error: --batch-size, --seq-len, --nproc and --steps must be >= 1, "
              "--matmul-seconds > 0", file=sys.stderr)
        return 2
    out = calibrate(args.recipe, args.batch_size, args.seq_len, args.nproc, args.steps,
                    args.matmul_seconds)
    text = json.dumps(out, indent=1) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    print(f"peak {out['peak_flops'] / 1e9:.2f} GFLOP/s per process, model "
          f"{out['model_flops'] / 1e9:.2f} GFLOP/s, mfu {out['mfu']:.3f}, "
          f"{out['fsdp_call_s'] * 1e3:.2f} ms per FSDP call", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
