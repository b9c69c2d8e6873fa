"""Real worker processes: step time, measured memory and counted bytes, all strategies at once.

``run_step_bench(specs, nproc=)`` starts ``nproc`` gloo workers (NCCL on GPU) through
``subnetdp.distributed.launch.launch``; every worker builds one model per spec and runs them with
steps *interleaved* (step i of every strategy, rotating which goes first), so machine noise
hits all strategies alike. Per strategy and rank it returns the step times after warm-up
(forward + backward + reduction + optimizer step), the memory of one steady-state step measured
with ``metrics.memory.measure_step_memory`` (and ``torch.cuda.max_memory_allocated`` on GPU),
and the bytes the reducers counted (``metrics.comm.comm_record``). With ``compute=True`` the
same workers then time every strategy again over torch's fake process group (communication
off); with ``network=`` they run on an emulated network (``bench.netem``) and measure its link
first.

Local steps (``spec.sync_every`` H > 1, ``runtime.local_steps``): the warm-up ends a sync
window, the timed steps are whole windows (``steps`` a multiple of H), and a step's time is its
window's mean, the sync amortised over the window.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from subnetdp.bench.netem import Layout, Placement, run_emulated
from subnetdp.estimate.spec import BenchSpec, build_rank, lm_step, vocab_size, with_local_steps
from subnetdp.metrics.comm import comm_record
from subnetdp.metrics.memory import measure_step_memory

MIN_WARMUP = 3


def bench_worker(specs: list[BenchSpec], steps: int, warmup: int, device: str,
                 rank: int, world: int, *, measure_memory: bool = True) -> dict[str, Any]:
    """Body of one worker (process group already up); results keyed by ``spec.label``.
    ``measure_memory=False``: the last warm-up step is timed like the others, not measured.
    Bytes are the timed steps' (with local steps: whole windows)."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else (
        torch.device("cpu"))
    # local steps: started so that the warm-up ends a window
    built = {s.label: with_local_steps(s, build_rank(s, device=dev),
                                       start=-warmup % s.sync_every) for s in specs}
    vocab = vocab_size(specs[0])
    g = torch.Generator().manual_seed(1000 + rank)
    times: dict[str, list[float]] = {k: [] for k in built}
    memory: dict[str, Any] = {}
    labels = list(built)
    for step in range(warmup + steps):
        tokens = torch.randint(0, vocab, (specs[0].batch, specs[0].seq + 1), generator=g).to(dev)
        order = labels[step % len(labels):] + labels[: step % len(labels)]
        if step == warmup:
            for b in built.values():
                b.rank.comm_stats.by_group.clear()
        for label in order:
            b = built[label]
            if measure_memory and step == warmup - 1:
                # steady state (optimizer state exists, DDP has rebuilt its buckets in
                # gradient order during the second step): measured, not timed
                _, rep = measure_step_memory(
                    partial(lm_step, b, tokens), modules=b.rank.tracked_modules(),
                    optimizers=[b.optimizer], grad_tensors=b.rank.grad_buffers())
                memory[label] = rep.to_dict()
                continue
            _sync(dev)
            t0 = time.perf_counter()
            lm_step(b, tokens)
            _sync(dev)
            if step >= warmup:
                times[label].append(time.perf_counter() - t0)
    return {
        "rank": rank,
        "times": times,
        "memory": memory,
        "comm": {k: comm_record(b.rank.comm_stats, steps=steps)
                 for k, b in built.items()},
        "params_held": {k: b.rank.params_held for k, b in built.items()},
    }


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def compute_worker(specs: list[BenchSpec], steps: int, warmup: int, device: str,
                   rank: int, world: int) -> dict[str, list[float]]:
    """Step times with communication off: the same models and steps over torch's fake
    process group (every collective returns at once, nothing is sent), all ranks running
    together as in the real phase. Per label, the timed steps' seconds."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    # the fake group's futures carry no value, which DDP's hook returns: the bucket instead
    saved = default_hooks.allreduce_hook
    default_hooks.allreduce_hook = _no_comm_hook  # type: ignore[assignment]
    try:
        out = bench_worker(specs, steps, warmup, device, rank, world, measure_memory=False)
        return out["times"]
    finally:
        default_hooks.allreduce_hook = saved  # type: ignore[assignment]
        dist.destroy_process_group()


def _no_comm_hook(_state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _launched(specs: list[BenchSpec], steps: int, warmup: int, device: str, compute: bool,
              probes: dict[str, tuple[int, int]], probe_bytes: int) -> dict[str, Any]:
    from subnetdp.bench.netem import probe_link
    from subnetdp.distributed.process_group import init_distributed, shutdown_distributed

    rank, world = init_distributed("gloo" if device == "cpu" else None)
    try:
        links = {name: probe_link(*pair, nbytes=probe_bytes) for name, pair in probes.items()}
        out = bench_worker(specs, steps, warmup, device, rank, world)
        out["links"] = links
    finally:
        shutdown_distributed()
    if compute:
        out["compute_times"] = compute_worker(specs, steps, warmup, device, rank, world)
    return out


def _launch_all(specs: list[BenchSpec], steps: int, warmup: int, device: str, compute: bool,
                placement: Placement | None = None) -> list[dict[str, Any]]:
    from subnetdp.distributed.launch import launch

    world = specs[0].world
    fn: Any = _launched if placement is None else placement.wrap(_launched)
    probes = placement.probe_pairs(world) if placement is not None else {}
    probe_bytes = placement.probe_bytes if placement is not None else 0
    results = launch(fn, (specs, steps, warmup, device, compute, probes, probe_bytes),
                     nproc=world, run_id="subnetdp-bench-step")
    return [results[r] for r in sorted(results)]


def run_step_bench(specs: list[BenchSpec], *, steps: int = 10, warmup: int = 3,
                   device: str = "cpu", compute: bool = False,
                   network: Layout | None = None) -> dict[str, Any]:
    """Launch ``specs[0].world`` workers and summarise: per strategy, the median step time
    over all ranks and steps (the slowest rank's median too), its ratio to ``ddp`` when
    present, the worst rank's measured peak memory and the counted bytes per step.

    ``compute``: also the median step with communication off (``compute_worker``) and the
    exposed communication, step minus that. ``network``: the workers run on an emulated
    network (``bench.netem``), whose links are measured first (``links``)."""
    worlds = {s.world for s in specs}
    if len(worlds) != 1 or len({(s.recipe, s.batch, s.seq) for s in specs}) != 1:
        raise ValueError("all specs of one step benchmark must share recipe, world, batch, seq")
    if len({s.label for s in specs}) != len(specs):  # results are keyed by label
        raise ValueError("two specs of one step benchmark have the same label (strategy, "
                         "composition, coverage); e.g. run one dtype per benchmark")
    if steps < 1:
        raise ValueError(f"--steps must be >= 1 (timed steps), got {steps}")
    if bad := [s.sync_every for s in specs if steps % s.sync_every]:
        raise ValueError(f"--steps ({steps}) must be a multiple of --sync-every ({bad[0]}): "
                         "the timed steps are whole sync windows")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine; use --device "
                         "cpu")
    if warmup < MIN_WARMUP:
        raise ValueError(f"--warmup must be >= {MIN_WARMUP}: memory is measured on the last "
                         "warm-up step, after DDP's second step has rebuilt its buckets")
    args = (specs, steps, warmup, device, compute)
    if network is None:
        per_rank = _launch_all(*args)
    else:
        per_rank = run_emulated(network, worlds.pop(), _launch_all, args)
    out = summarise(specs, per_rank)
    if network is not None:
        link = network.link
        out["network"] = {"rate_mbit": link.rate_mbit, "latency_ms": link.latency_ms,
                          "tier": network.tier, "nodes": network.nodes,
                          "links": per_rank[0]["links"]}
    return out


def windows(times: list[float], every: int) -> list[float]:
    """Step seconds as each sync window's mean (H = 1: the steps themselves): a window's steps
    are cheap but its syncing ones, which a median of steps would drop."""
    return [statistics.fmean(times[i : i + every]) for i in range(0, len(times), every)]


def summarise(specs: list[BenchSpec], per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for s in specs:
        k, h = s.label, s.sync_every
        all_t = [t for r in per_rank for t in windows(r["times"][k], h)]
        mems = [r["memory"][k] for r in per_rank]
        worst = max(mems, key=lambda m: m["peak_bytes"])
        comms = [r["comm"][k] for r in per_rank]
        rows[k] = {
            "spec": asdict(s),
            "median_step_s": statistics.median(all_t) if all_t else float("nan"),
            "slowest_rank_median_s": max(statistics.median(windows(r["times"][k], h))
                                         for r in per_rank)
            if all_t else float("nan"),
            "measured_peak_bytes": worst["peak_bytes"],
            "measured_breakdown": worst["breakdown"],
            "cuda_max_allocated": worst.get("cuda_max_allocated"),
            "per_rank_peak_bytes": [m["peak_bytes"] for m in mems],
            "comm": max(comms, key=lambda c: c["comm/ring_bytes_per_step"]) if comms else None,
            "per_rank_comm": comms,
            "params_held": [r["params_held"][k] for r in per_rank],
        }
        if "compute_times" in per_rank[0]:
            compute = statistics.median(t for r in per_rank
                                        for t in windows(r["compute_times"][k], h))
            rows[k]["compute_step_s"] = compute
            rows[k]["exposed_comm_s"] = rows[k]["median_step_s"] - compute
    base = rows.get("ddp")
    for row in rows.values():
        row["step_ratio_to_ddp"] = (row["median_step_s"] / base["median_step_s"]
                                    if base else None)
    return {"rows": rows, "world": specs[0].world, "versions": {"torch": torch.__version__},
            "backend": dist.Backend.GLOO if specs else None}
