"""The one-GPU proof (``benchmarks/gpu_check.sh``): rank 0 of an 8-worker run, built on the
real GPU over torch's fake process group, per strategy; gloo parity on one GPU; NCCL
communicator memory per extra group.

    python benchmarks/gpu_rank0.py rank0  --out OUT [--recipe llama-1b --world 8 ...]
    python benchmarks/gpu_rank0.py parity --out OUT    # before anything touches CUDA here
    python benchmarks/gpu_rank0.py comms  --out OUT    # needs >= 2 GPUs (NCCL)

``rank0``: per strategy (ddp, fsdp+ac, b-sdp C=0.69, b-sdp+fsdp+ac, n-sdp, b-sdp+zero2) the
measured ``torch.cuda.max_memory_allocated`` of a steady-state step against the estimator's
peak for rank 0 (communicators excluded: NCCL's buffers are not torch allocations), step
time, tokens/s and MFU two ways: torchtitan's (6 x non-embedding parameters + 12 x layers x
heads x head_dim x seq per token, for the *full* model: what the run trains towards) and the
executed one (FLOPs this rank's step runs, counted by ``FlopCounterMode``: its subnetwork,
recomputation under --ac included). The fake group's collectives return at once, so step
times exclude communication and FSDP's gathered values are garbage: memory and compute only.
The estimates run in a process pool on the CPUs while the GPU measures.

``parity``: 4 forked gloo workers sharing GPU 0 (gloo moves CUDA tensors through the host):
b-sdp and n-sdp at C = 1 must end at torch DDP's parameters (oracle (a), docs/testing.md).

``comms``: 2 NCCL workers (NCCL refuses two ranks on one GPU): device memory free before and
after creating K two-rank groups, each used once, per extra group.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from subnetdp.estimate.spec import BenchSpec, Built, build_rank, lm_step, meta_model, vocab_size
from subnetdp.metrics.tracking import peak_flops

GiB = float(1 << 30)
# (label suffix, BenchSpec fields): the six configurations of issue 32
CONFIGS: list[dict[str, Any]] = [
    {"strategy": "ddp"}, {"strategy": "fsdp+ac"},
    {"strategy": "b-sdp", "coverage": 0.69},
    {"strategy": "b-sdp", "coverage": 0.69, "fsdp": True, "ac": True},
    {"strategy": "n-sdp", "coverage": 0.69},
    {"strategy": "b-sdp", "coverage": 0.69, "zero": 2},
]
TOLERANCE = 0.05  # measured vs estimated peak


def specs(recipe: str, world: int, batch: int, seq: int,
          model_args: tuple[tuple[str, Any], ...] = ()) -> list[BenchSpec]:
    return [BenchSpec(recipe=recipe, world=world, batch=batch, seq=seq, model_args=model_args,
                      **c) for c in CONFIGS]


@contextlib.contextmanager
def fake_group(world: int, rank: int = 0) -> Iterator[None]:
    """Rank ``rank`` of ``world`` over torch's fake process group (collectives are no-ops)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_rank0(spec: BenchSpec, device: torch.device) -> Built:
    """Rank 0's real model and optimizer on ``device`` (fake group up). DDP is built as the
    holder reducer at full coverage (``parallelize(fake=True)``): torch DDP's reducer needs
    real peers, and the estimator checks the two have the same memory."""
    return build_rank(spec, device=device, fake=True)


def torchtitan_flops_per_token(spec: BenchSpec) -> float:
    """torchtitan's ``get_num_flop_per_token``: 6 x parameters without the token embedding
    + 12 x layers x heads x head_dim x seq (attention), for the full model."""
    _, model = meta_model(spec)
    cfg: Any = model.config
    params = sum(p.numel() for n, p in model.named_parameters() if "tok_embeddings" not in n)
    return 6.0 * params + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * spec.seq


def measure(built: Built, spec: BenchSpec, device: torch.device, *, warmup: int = 2,
            steps: int = 5) -> dict[str, Any]:
    """Steady-state peak memory (CUDA), median step time, executed FLOPs of one step."""
    from torch.utils.flop_counter import FlopCounterMode

    g = torch.Generator().manual_seed(0)
    vocab = vocab_size(spec)

    def tokens() -> torch.Tensor:
        return torch.randint(0, vocab, (spec.batch, spec.seq + 1), generator=g).to(device)

    for _ in range(warmup):
        lm_step(built, tokens())
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        batch = tokens()
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        lm_step(built, batch)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    counter = FlopCounterMode(display=False)
    with counter:
        lm_step(built, tokens())
    return {"step_time_s": statistics.median(times), "max_memory_allocated": peak,
            "executed_flops": float(counter.get_total_flops())}


def row(spec: BenchSpec, measured: dict[str, Any], estimated: int | None,
        peak: float | None) -> dict[str, Any]:
    """One table row: memory vs estimate, tokens/s, both MFUs (None where unknown)."""
    step = measured["step_time_s"]
    tps = spec.batch * spec.seq / step
    got = measured["max_memory_allocated"]
    ratio = got / estimated if got is not None and estimated else None
    return {
        "label": spec.label, "measured_GiB": None if got is None else got / GiB,
        "estimated_GiB": None if estimated is None else estimated / GiB,
        "measured/estimated": ratio,
        "within_5%": None if ratio is None else abs(ratio - 1) <= TOLERANCE,
        "step_time_s": step, "tps": tps,
        "mfu_torchtitan(%)": (None if peak is None else
                              100 * torchtitan_flops_per_token(spec) * tps / peak),
        "mfu_executed(%)": (None if peak is None else
                            100 * measured["executed_flops"] / step / peak),
    }


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def write_tables(rows: list[dict[str, Any]], out: Path, name: str, title: str) -> Path:
    """``out/name.md`` (a markdown table, columns from the first row) and ``out/name.json``;
    returns the markdown path."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1))
    cols = list(rows[0]) if rows else []
    lines = [f"# {title}", "", "| " + " | ".join(cols) + " |",
             "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]
    md = out / f"{name}.md"
    md.write_text("\n".join(lines) + "\n")
    return md


def _estimate(spec: BenchSpec) -> int:
    from subnetdp.estimate.memory import estimate_memory

    torch.set_num_threads(1)
    return estimate_memory(spec, ranks=[0]).per_rank[0].peak_bytes


def run_rank0(args: argparse.Namespace) -> int:
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    peak = peak_flops(torch.cuda.get_device_name(0) if device.type == "cuda" else None,
                      args.peak_tflops)
    todo = specs(args.recipe, args.world, args.batch, args.seq)
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = get_context("spawn")  # the pool's workers must not inherit CUDA
    with ProcessPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1),
                             mp_context=ctx) as pool:
        estimates: list[Future[int]] = [pool.submit(_estimate, s) for s in todo]
        measured = []
        for spec in todo:
            with fake_group(spec.world):
                built = build_rank0(spec, device)
                measured.append(measure(built, spec, device))
                print(f"gpu_rank0: {spec.label}: {measured[-1]}", flush=True)
                # kept as it comes: a timeout still leaves what was measured
                (args.out / "rank0_measured.json").write_text(json.dumps(
                    dict(zip([s.label for s in todo], measured, strict=False)), indent=1))
                del built
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for spec, m, est in zip(todo, measured, estimates, strict=True):
            rows.append(row(spec, m, est.result(), peak))
    write_tables(rows, args.out, "rank0",
                 f"Rank 0 of {args.world} workers, {args.recipe}, batch {args.batch} x "
                 f"{args.seq}, {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}")
    bad = [r["label"] for r in rows if r["within_5%"] is False]
    if bad:
        print(f"gpu_rank0: measured memory off the estimate by > 5%: {', '.join(bad)}",
              file=sys.stderr)
    return 1 if bad else 0


def _parity_worker(rank: int, world: int, strategy: str) -> dict[str, torch.Tensor]:
    import torch.nn.functional as F

    from subnetdp.models import get_recipe
    from subnetdp.parallelize import parallelize
    from subnetdp.plan import make_plan
    from subnetdp.subnet.neurons import make_neuron_plan
    from subnetdp.subnet.units import describe_units

    # GPU 0 for every worker (a CPU run checks the script itself)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    recipe = get_recipe("llama-tiny")
    with torch.device("meta"):
        model = recipe.build_model(n_layers=4)
    if strategy == "n-sdp":
        plan = make_neuron_plan(model, recipe.adapter, world=world, coverage=1.0, seed=0)
    else:
        units, shared = describe_units(model, recipe.adapter)
        plan = make_plan(world=world, units=units, coverage=1.0, shared_size=shared)
    rank_model = parallelize(model, adapter=recipe.adapter, strategy=strategy,
                             plan=None if strategy == "ddp" else plan, device=device, seed=0)
    opt = torch.optim.AdamW(rank_model.parameters(), lr=1e-3, foreach=False)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        tokens = torch.randint(0, 4096, (2, 65), generator=g).to(device)
        logits = rank_model.model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = rank_model.full_state_dict()
    return {k: v.cpu() for k, v in (state or {}).items()}


def run_parity(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.dist.harness import run_workers

    ref = run_workers(_parity_worker, 4, "ddp")[0]
    rows, status = [], 0
    for strategy in ("b-sdp", "n-sdp"):
        got = run_workers(_parity_worker, 4, strategy)[0]
        diff = max((got[k].float() - ref[k].float()).abs().max().item() for k in ref)
        ok = diff <= 1e-5
        status |= not ok
        rows.append({"strategy": f"{strategy} (C=1)", "vs": "ddp", "max_abs_diff": diff,
                     "equal": ok})
    write_tables(rows, args.out, "parity", "gloo on one GPU, 4 workers: SDP at C = 1 vs DDP")
    return status


def _comms_worker(rank: int, world: int, k: int) -> list[int]:
    torch.cuda.set_device(rank)
    free = [torch.cuda.mem_get_info(rank)[0]]
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)  # the world communicator, connected
    torch.cuda.synchronize()
    free.append(torch.cuda.mem_get_info(rank)[0])
    for _ in range(k):
        dist.all_reduce(x, group=dist.new_group([0, 1]))
        torch.cuda.synchronize()
        free.append(torch.cuda.mem_get_info(rank)[0])
    return free


def _nccl_entry(rank: int, world: int, k: int, addr: str, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=addr, RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from subnetdp.distributed.process_group import init_distributed, shutdown_distributed

    init_distributed("nccl")  # eager, bound to the GPU: later groups are NCCL splits
    try:
        queue.put((rank, _comms_worker(rank, world, k)))
    finally:
        shutdown_distributed()


def run_comms(args: argparse.Namespace, k: int = 4) -> int:
    if torch.cuda.device_count() < 2:
        print("gpu_rank0: comms needs 2 GPUs (NCCL refuses two ranks on one GPU): skipped")
        return 0
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    ctx = get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_nccl_entry, args=(r, 2, k, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join()
    free = results[0]
    per_group = [(free[i] - free[i + 1]) / 2**20 for i in range(1, len(free) - 1)]
    rows = [{"communicator": "world (first use)", "MiB": (free[0] - free[1]) / 2**20}]
    rows += [{"communicator": f"extra group {i + 1}", "MiB": m} for i, m in enumerate(per_group)]
    share = os.environ.get("NCCL_COMM_SPLIT_SHARE_RESOURCES", "unset")
    write_tables(rows, args.out, "comms", "NCCL device memory per communicator, rank 0 of 2 "
                 f"(NCCL_COMM_SPLIT_SHARE_RESOURCES={share})")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("rank0", "parity", "comms"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--recipe", default="llama-1b")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--peak-tflops", type=float, default=None)
    args = ap.parse_args(argv)
    run = {"rank0": run_rank0, "parity": run_parity, "comms": run_comms}[args.what]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
