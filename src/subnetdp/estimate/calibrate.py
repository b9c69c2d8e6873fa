"""The step-time model's device rate on this machine, measured (``estimate.steptime``).

    python -m subnetdp.estimate.calibrate [--recipe llama-tiny] [--batch-size 4] \\
        [--seq-len 128] [--nproc 4] [--steps 8] [--matmul-seconds 3] [--coverage 0.5]
        [--out benchmarks/results/cpu_calibration.json]

``nproc`` processes start together (one thread each, as the benchmark's workers run) and each
measures, with nothing else of its own running:

- ``peak_flops``: a 1024 x 1024 fp32 matmul, repeated (2·n³ FLOPs each), median rate;
- ``model_flops``: one rank's training step of the whole recipe (forward, backward, AdamW
  ``foreach=False`` as the benchmarks build it, no process group and no communication):
  counted forward + backward FLOPs (``subnet.costs``) over the median step time;
- ``narrow``: the same step of the recipe narrowed as n-sdp's slowest rank runs it at
  ``--coverage`` (every split layer cut to the rank's neuron groups, output scaling folded
  in; bare, no SDP runtime): its FLOP rate over ``model_flops`` (``efficiency``) at the rank's
  ``held`` fraction of each layer's width;
- ``ac_efficiency``: the same step with every block checkpointed, FLOPs counting the
  recompute, over ``model_flops``.
  The three steps are interleaved, so load hits them alike; the two ratios are the model's
  ``steptime.ComputeTerms``;
- ``fsdp_call_s``: the host time of one FSDP collective call: the processes form a gloo
  group and train ``FSDP_MODULES`` tiny FSDP modules (8 x 8 linears, sharded as the runtime
  shards the baselines: ``runtime.fsdp.shard_over_mesh``, gloo's ring and asynchronous
  gathers), whose compute and bytes are negligible: step time / calls (a gather each in
  forward and backward, a reduce-scatter per module). Hooks, copy-in/out and the
  rendezvous of ``nproc`` processes sharing the machine are in it.

``mfu = model_flops / peak_flops``. The medians over the processes are written to ``--out``
(JSON), with the load average before and after. None of these are step times of the
strategies the model predicts: the model is calibrated here and on the links' probes, then
compared with the benchmark.
"""

from __future__ import annotations

import argparse
import copy
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


def _variants(recipe_name: str, batch: int, seq: int, nproc: int, coverage: float
              ) -> tuple[dict[str, tuple[Any, float]], float]:
    """The bare models the step rates are measured on (module docstring), each with its FLOPs
    per step as ``steptime.rank_flops`` counts them: ``full``, ``narrow`` (the slowest rank of
    n-sdp at ``coverage`` over ``nproc`` ranks (at least 2), its layers narrowed as the
    runtime narrows them, output scaling folded in, no process group) and ``ac`` (``full``
    with every block checkpointed); and the narrow rank's held fraction
    (``steptime.held_fraction``)."""
    import torch

    from subnetdp.estimate.spec import BenchSpec, make_bench_plan, meta_model
    from subnetdp.estimate.steptime import held_fraction, rank_flops
    from subnetdp.runtime.checkpointing import checkpoint_blocks
    from subnetdp.subnet.build import materialize
    from subnetdp.subnet.costs import recipe_costs
    from subnetdp.subnet.match import match_plan
    from subnetdp.subnet.pieces import full_pieces, local_slices
    from subnetdp.subnet.scaling import scale_kept_outputs
    from subnetdp.subnet.units import unit_modules

    base = BenchSpec(recipe_name, "ddp", nproc, batch, seq)
    # n-sdp needs two ranks: one process measures the narrowed rank of two
    nsdp = base.replace(strategy="n-sdp", world=max(nproc, 2), coverage=coverage)
    ac = base.replace(strategy="ddp+ac")
    recipe, narrow_meta = meta_model(nsdp, check_seq=False)
    costs = recipe_costs(recipe, batch=batch, seq=seq)
    torch.manual_seed(0)
    full = recipe.build_model()
    checkpointed = copy.deepcopy(full)
    checkpoint_blocks(checkpointed, [n for n, m in unit_modules(checkpointed, recipe.adapter)
                                     if any(True for _ in m.parameters())])
    plan = make_bench_plan(nsdp, narrow_meta, recipe)
    groups = match_plan(plan, narrow_meta, recipe.adapter, nsdp.strategy_value)
    pieces = full_pieces(narrow_meta, [u.name for u in plan.units], groups)
    per_rank = rank_flops(nsdp, costs, plan)
    slowest = max(range(nsdp.world), key=lambda r: per_rank[r].total)
    held = plan.held_units(slowest)
    narrow = materialize(narrow_meta, recipe.adapter, device="cpu", seed=0,
                         slices=local_slices(pieces, held))
    if groups:
        scale_kept_outputs(narrow, groups, held)
    return ({"full": (full, rank_flops(base, costs, None)[0].total),
             "narrow": (narrow, per_rank[slowest].total),
             "ac": (checkpointed, rank_flops(ac, costs, None)[0].total)},
            held_fraction(per_rank[slowest], costs))


def _step_rates(variants: dict[str, tuple[Any, float]], vocab: int, batch: int, seq: int,
                steps: int) -> dict[str, float]:
    """Per variant, its counted FLOPs over its median training step (forward, backward,
    AdamW ``foreach=False`` as the benchmarks build it); the variants' steps interleaved, so
    the machine's load hits them alike and their ratios hold."""
    import torch
    import torch.nn.functional as F

    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=False)
            for k, (m, _) in variants.items()}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(steps + 2):  # two warm-up steps (optimizer state, allocator)
        tokens = torch.randint(0, vocab, (batch, seq + 1))
        for k, (model, _) in variants.items():
            t0 = time.perf_counter()
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                            tokens[:, 1:].reshape(-1)).backward()
            opts[k].step()
            opts[k].zero_grad(set_to_none=True)
            if i >= 2:
                times[k].append(time.perf_counter() - t0)
    return {k: variants[k][1] / statistics.median(times[k]) for k in variants}


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


def _one(args: tuple[str, int, int, int, float, float, str], start: Any, rank: int
         ) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    recipe, batch, seq, steps, seconds, coverage, store = args
    nproc = start.parties
    variants, held = _variants(recipe, batch, seq, nproc, coverage)
    config: Any = variants["full"][0].config  # the language models the benchmarks drive
    vocab = int(config.vocab_size)
    start.wait()  # every process measures at once: the benchmark's contention
    peak = _matmul_rate(seconds)
    rates = _step_rates(variants, vocab, batch, seq, steps)
    call = _fsdp_call_s(rank, nproc, store, max(steps, 3))
    flops = variants["full"][1]
    return {"peak_flops": peak, "model_flops": rates["full"], "step_s": flops / rates["full"],
            "flops_per_step": flops, "fsdp_call_s": call,
            "narrow_held": held, "narrow_efficiency": rates["narrow"] / rates["full"],
            "ac_efficiency": rates["ac"] / rates["full"]}


def calibrate(recipe: str = "llama-tiny", batch: int = 4, seq: int = 128, nproc: int = 4,
              steps: int = 8, matmul_seconds: float = 3.0, coverage: float = 0.5
              ) -> dict[str, Any]:
    """Measure in ``nproc`` concurrent processes (module docstring); the medians."""
    load = os.getloadavg()[0]  # the machine as it was: other jobs share it
    ctx = mp.get_context("spawn")
    start = ctx.Manager().Barrier(nproc)
    with tempfile.TemporaryDirectory() as tmp, ctx.Pool(nproc) as pool:
        args = (recipe, batch, seq, steps, matmul_seconds, coverage,
                os.path.join(tmp, "store"))
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
            "narrow": {"coverage": coverage, "held": results[0]["narrow_held"],
                       "efficiency": statistics.median(r["narrow_efficiency"]
                                                       for r in results)},
            "ac_efficiency": statistics.median(r["ac_efficiency"] for r in results),
            "per_process": results, "torch": torch.__version__, "load_before": load,
            "load_after": os.getloadavg()[0],
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
    p.add_argument("--coverage", type=float, default=0.5,
                   help="n-sdp's coverage for the narrowed step (default %(default)s)")
    p.add_argument("--out", help="write the JSON here (default: print it)")
    args = p.parse_args(argv)
    if min(args.batch_size, args.seq_len, args.nproc, args.steps) < 1 or not (
            args.matmul_seconds > 0) or not 0 < args.coverage < 1:
        print("calibrate: error: --batch-size, --seq-len, --nproc and --steps must be >= 1, "
              "--matmul-seconds > 0, 0 < --coverage < 1", file=sys.stderr)
        return 2
    out = calibrate(args.recipe, args.batch_size, args.seq_len, args.nproc, args.steps,
                    args.matmul_seconds, args.coverage)
    text = json.dumps(out, indent=1) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    print(f"peak {out['peak_flops'] / 1e9:.2f} GFLOP/s per process, model "
          f"{out['model_flops'] / 1e9:.2f} GFLOP/s, mfu {out['mfu']:.3f}, "
          f"{out['fsdp_call_s'] * 1e3:.2f} ms per FSDP call, narrowed to "
          f"{out['narrow']['held']:.2f} at {out['narrow']['efficiency']:.3f} of the rate, "
          f"checkpointed at {out['ac_efficiency']:.3f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
