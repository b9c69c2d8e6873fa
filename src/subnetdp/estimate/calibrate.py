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


def _one(args: tuple[str, int, int, int, float], start: Any) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    recipe, batch, seq, steps, seconds = args
    start.wait()  # every process measures at once: the benchmark's contention
    peak = _matmul_rate(seconds)
    flops, step = _model_rate(recipe, batch, seq, steps)
    return {"peak_flops": peak, "model_flops": flops / step, "step_s": step,
            "flops_per_step": flops}


def calibrate(recipe: str = "llama-tiny", batch: int = 4, seq: int = 128, nproc: int = 4,
              steps: int = 8, matmul_seconds: float = 3.0) -> dict[str, Any]:
    """Measure in ``nproc`` concurrent processes (module docstring); the medians."""
    ctx = mp.get_context("spawn")
    start = ctx.Manager().Barrier(nproc)
    with ctx.Pool(nproc) as pool:
        results = pool.starmap(_one, [((recipe, batch, seq, steps, matmul_seconds), start)]
                               * nproc)
    peak = statistics.median(r["peak_flops"] for r in results)
    model = statistics.median(r["model_flops"] for r in results)
    import torch

    return {"device": "cpu", "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "nproc": nproc, "threads_per_process": 1,
            "recipe": recipe, "batch_size": batch, "seq_len": seq,
            "peak_flops": peak, "model_flops": model, "mfu": model / peak,
            "flops_per_step": results[0]["flops_per_step"],
            "step_s_median": statistics.median(r["step_s"] for r in results),
            "per_process": results, "torch": torch.__version__,
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
          f"{out['model_flops'] / 1e9:.2f} GFLOP/s, mfu {out['mfu']:.3f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
