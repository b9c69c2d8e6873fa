"""The one-GPU proof (``benchmarks/gpu_check.sh``): rank 0 of an 8-worker run, built on the
real GPU over torch's fake process group, one configuration per fresh process; the card's
measured bf16 matmul peak; gloo parity on one GPU; NCCL communicator memory per extra group.

    python benchmarks/gpu_rank0.py peak   --out OUT    # the card's bf16 matmul rate
    python benchmarks/gpu_rank0.py rank0  --out OUT [--rows fp32,bf16,compile,aligned]
    python benchmarks/gpu_rank0.py leak   --out OUT    # a dropped build frees its memory
    python benchmarks/gpu_rank0.py parity --out OUT    # before anything touches CUDA here
    python benchmarks/gpu_rank0.py comms  --out OUT    # needs >= 2 GPUs (NCCL)

``rank0``: per configuration (``ROWS``: fp32 at 1 x 2048 and bf16-mixed at 4 x 2048, eager and
``--compile``) a fresh ``one`` process measures ``torch.cuda.max_memory_allocated`` of a
steady-state step (against the estimator's peak for rank 0, eager rows; communicators
excluded: NCCL's buffers are not torch allocations), the median step time, and FLOPs two ways:
torchtitan's (6 x non-embedding parameters + 12 x layers x heads x head_dim x seq per token,
for the *full* model) and the executed ones (what this rank's step runs, counted by
``FlopCounterMode`` on an eager step: its subnetwork, recomputation under --ac included). MFU
is either over the bf16 matmul rate ``peak`` measured on the same card (8192^3, random data).
The optimizer is the one training builds (fused AdamW on CUDA). The fake group's collectives
return at once, so step times exclude communication and FSDP's gathered values are garbage:
memory and compute only. The estimates run in a process pool on the CPUs meanwhile.
``--profile``: the eager and compiled ddp rows also write their top CUDA kernels.

``parity``: 4 forked gloo workers sharing GPU 0 (gloo moves CUDA tensors through the host):
b-sdp and n-sdp at C = 1 must end at torch DDP's parameters (oracle (a), docs/testing.md).

``comms``: 2 NCCL workers (NCCL refuses two ranks on one GPU): device memory free before and
after creating K two-rank groups, each used once, per extra group.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from subnetdp.estimate.spec import (
    BenchSpec,
    Built,
    lm_step,
    make_bench_plan,
    meta_model,
    optimizer_for,
    vocab_size,
)
from subnetdp.parallelize import parallelize
from subnetdp.strategy import RankSpec

GiB = float(1 << 30)
# rank 0 of 8 workers, llama-1b (BenchSpec fields; "compile": per-block torch.compile)
_SIX = [{"strategy": "ddp"}, {"strategy": "fsdp+ac"},
        {"strategy": "b-sdp", "coverage": 0.69},
        {"strategy": "b-sdp", "coverage": 0.69, "fsdp": True, "ac": True},
        {"strategy": "n-sdp", "coverage": 0.69},
        {"strategy": "b-sdp", "coverage": 0.69, "zero": 2}]
_MIXED = {"dtype": "bf16-mixed", "batch": 4}
ROWS: dict[str, list[dict[str, Any]]] = {
    "fp32": _SIX,  # batch 1 x 2048: the memory check of issue 32
    "bf16": [{**c, **_MIXED} for c in _SIX],  # a realistic micro-batch, 4 x 2048
    "compile": [{**_SIX[i], **_MIXED, "compile": True} for i in (0, 2, 4)],
    # what the FFN's width costs: llama-1b's 5461 hidden units are no multiple of 8, so
    # every FFN matmul has an unaligned leading dimension; torchtitan rounds to 256 (5632)
    "aligned": [{**_SIX[i], **_MIXED, "compile": c, "model_args": [["ffn_hidden", 5632]]}
                for i in (0, 2) for c in (False, True)],
}
TOLERANCE = 0.05  # measured vs estimated peak (eager rows)


def configs(rows: list[str], recipe: str, world: int, seq: int) -> list[dict[str, Any]]:
    """The configurations of ``rows`` (``ROWS`` keys) as ``one``'s JSON arguments."""
    out = []
    for name in rows:
        for c in ROWS[name]:
            out.append({"recipe": recipe, "world": world, "seq": seq, "batch": 1, **c})
    return out


def spec_of(config: dict[str, Any]) -> BenchSpec:
    fields = {k: v for k, v in config.items() if k not in ("compile", "profile")}
    fields["model_args"] = tuple(tuple(kv) for kv in fields.get("model_args", ()))
    return BenchSpec(**fields)


def label_of(config: dict[str, Any]) -> str:
    spec = spec_of(config)
    extra = "".join(f" {k}={v}" for k, v in spec.model_args)
    return (f"{spec.label}{' compile' if config.get('compile') else ''}{extra}, "
            f"{spec.dtype} {spec.batch}x{spec.seq}")


@contextlib.contextmanager
def fake_group(world: int, rank: int = 0) -> Iterator[None]:
    """Rank ``rank`` of ``world`` over torch's fake process group (collectives are no-ops)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_rank0(spec: BenchSpec, device: torch.device, *, compile: bool = False) -> Built:
    """Rank 0's real model and training's optimizer on ``device`` (fake group up). DDP is
    built as the holder reducer at full coverage (``parallelize(fake=True)``): torch DDP's
    reducer needs real peers, and the estimator checks the two have the same memory."""
    recipe, model = meta_model(spec)
    plan = make_bench_plan(spec, model, recipe) if spec.is_sdp else None
    rank_spec = RankSpec(spec.rank.strategy, spec.rank.comp.replace(compile=compile))
    rank = parallelize(model, adapter=recipe.adapter, strategy=rank_spec, plan=plan,
                       device=device, seed=spec.seed, fake=True)
    return Built(rank, optimizer_for(rank, recipe, device=device), plan)


def torchtitan_flops_per_token(spec: BenchSpec) -> float:
    """torchtitan's ``get_num_flop_per_token``: 6 x parameters without the token embedding
    + 12 x layers x heads x head_dim x seq (attention), for the full model."""
    _, model = meta_model(spec)
    cfg: Any = model.config
    params = sum(p.numel() for n, p in model.named_parameters() if "tok_embeddings" not in n)
    return 6.0 * params + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * spec.seq


def executed_flops(built: Built, tokens: torch.Tensor) -> float:
    """FLOPs one training step executes (``FlopCounterMode`` counts eager ATen calls: call
    it before ``--compile``'s blocks run, the arithmetic is the same)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        lm_step(built, tokens)
    return float(counter.get_total_flops())


def measure(built: Built, spec: BenchSpec, device: torch.device, *, warmup: int = 2,
            steps: int = 5, flops: float | None = None) -> dict[str, Any]:
    """Steady-state peak memory (CUDA), median step time, executed FLOPs of one step
    (counted here unless given)."""
    g = torch.Generator().manual_seed(0)
    vocab = vocab_size(spec)

    def tokens() -> torch.Tensor:
        return torch.randint(0, vocab, (spec.batch, spec.seq + 1), generator=g).to(device)

    cuda = device.type == "cuda"
    compile_s = time.perf_counter()
    for _ in range(warmup):
        lm_step(built, tokens())
    compile_s = time.perf_counter() - compile_s
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
    return {"step_time_s": statistics.median(times), "max_memory_allocated": peak,
            "executed_flops": executed_flops(built, tokens()) if flops is None else flops,
            "warmup_s": compile_s}


def row(spec: BenchSpec, measured: dict[str, Any], estimated: int | None,
        peak: float | None, *, label: str | None = None,
        compiled: bool = False) -> dict[str, Any]:
    """One table row: memory vs estimate (eager rows: the estimator models eager memory),
    tokens/s, executed TFLOP/s, both MFUs over ``peak`` (None where unknown)."""
    step = measured["step_time_s"]
    tps = spec.batch * spec.seq / step
    got = measured["max_memory_allocated"]
    ratio = got / estimated if got is not None and estimated else None
    return {
        "label": label or spec.label, "measured_GiB": None if got is None else got / GiB,
        "estimated_GiB": None if estimated is None else estimated / GiB,
        "measured/estimated": ratio,
        "within_5%": None if ratio is None or compiled else abs(ratio - 1) <= TOLERANCE,
        "step_time_s": step, "tps": tps,
        "executed_TFLOPs": measured["executed_flops"] / step / 1e12,
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


def matmul_peak(n: int = 8192, repeats: int = 10) -> float:
    """FLOP/s of an ``n``^3 bf16 matrix product on random data, the mean of ``repeats``
    after three warm-ups: the ceiling MFU is measured against, on this card as it runs now."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2.0 * n**3 * repeats / (start.elapsed_time(end) / 1e3)


def run_peak(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("gpu_rank0: peak needs a CUDA device", file=sys.stderr)
        return 2
    flops = matmul_peak()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peak.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(0), "bf16_matmul_flops": flops,
         "torch": torch.__version__}))
    print(f"gpu_rank0: bf16 8192^3 matmul on {torch.cuda.get_device_name(0)}: "
          f"{flops / 1e12:.1f} TFLOP/s", flush=True)
    return 0


def profile_step(built: Built, spec: BenchSpec, device: torch.device, out: Path,
                 name: str) -> None:
    """The top CUDA kernels of one steady-state step, kernel launches and host time."""
    from torch.profiler import ProfilerActivity, profile

    vocab = vocab_size(spec)
    tokens = torch.randint(0, vocab, (spec.batch, spec.seq + 1)).to(device)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        lm_step(built, tokens)
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    table = events.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel",
                                                         "cuLaunchKernel", "cudaLaunchKernelExC"))
    (out / f"profile_{name}.txt").write_text(
        f"{name}: one step {wall:.3f} s under the profiler; {launches} kernel launches\n"
        + table)


def run_one(args: argparse.Namespace) -> int:
    """One configuration in this (fresh) process: prints ``RESULT {json}``."""
    config = json.loads(args.config)
    spec = spec_of(config)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":  # what train does on CUDA (train.device): TF32 for fp32 rows
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    with fake_group(spec.world):
        built = build_rank0(spec, device)
        flops = None
        if config.get("compile"):  # count eagerly, then compile the blocks in place
            g = torch.Generator().manual_seed(1)
            flops = executed_flops(built, torch.randint(
                0, vocab_size(spec), (spec.batch, spec.seq + 1), generator=g).to(device))
            _compile_built(built, spec)
        m = measure(built, spec, device, flops=flops)
        if config.get("profile") and device.type == "cuda":
            profile_step(built, spec, device, args.out, _slug(label_of(config)))
    print("RESULT " + json.dumps(m), flush=True)
    return 0


def _compile_built(built: Built, spec: BenchSpec) -> None:
    """``--compile`` after the fact, as the wrapper applies it (``runtime.compile``): this
    rank's blocks that hold parameters, compiled in place."""
    from subnetdp.runtime.compile import compile_blocks
    from subnetdp.subnet.units import unit_modules

    recipe, _ = meta_model(spec)
    inner = getattr(built.rank.model, "module", built.rank.model)
    compile_blocks(inner, [name for name, m in unit_modules(inner, recipe.adapter)
                           if any(True for _ in m.parameters())])


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label).strip("_")


def _run_fresh(config: dict[str, Any], out: Path, timeout: float) -> dict[str, Any] | str:
    """``config`` measured by ``one`` in a fresh process: its result, or why it has none."""
    cmd = [sys.executable, __file__, "one", "--out", str(out), "--config", json.dumps(config)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT "):])
            return result
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return f"exit {done.returncode}: {tail[0][:300]}"


def mfu_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The MFU table: each row's executed MFU and its step time per executed FLOP against the
    ddp row of the same precision, batch and compilation (1.0: as fast per FLOP as ddp)."""
    def key(label: str) -> str:  # "b-sdp (C=0.69) compile, bf16-mixed 4x2048" -> its setting
        head, _, tail = label.partition(", ")
        return ("compile" if " compile" in head else "eager") + " " + tail
    ddp = {key(r["label"]): r for r in rows if r["label"].startswith("ddp")
           and "ffn_hidden" not in r["label"]}
    out = []
    for r in rows:
        base = ddp.get(key(r["label"]))
        rel = (None if base is None or "ffn_hidden" in r["label"]
               else base["executed_TFLOPs"] / r["executed_TFLOPs"])
        out.append({"label": r["label"], "step_time_s": r["step_time_s"], "tps": r["tps"],
                    "executed_TFLOPs": r["executed_TFLOPs"],
                    "mfu_executed(%)": r["mfu_executed(%)"],
                    "mfu_torchtitan(%)": r["mfu_torchtitan(%)"], "time_per_FLOP_vs_ddp": rel})
    return out


def run_rank0(args: argparse.Namespace) -> int:
    """Every configuration of ``args.rows`` in its own process, the estimates meanwhile."""
    todo = [c for c in configs(args.rows.split(","), args.recipe, args.world, args.seq)
            if re.search(args.match, label_of(c))]
    peak_file = args.out / "peak.json"
    peak = (args.peak_tflops * 1e12 if args.peak_tflops else
            json.loads(peak_file.read_text())["bf16_matmul_flops"] if peak_file.exists()
            else None)
    args.out.mkdir(parents=True, exist_ok=True)
    rows, failed = [], []
    ctx = get_context("spawn")  # the pool's workers must not inherit CUDA
    with ProcessPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1),
                             mp_context=ctx) as pool:
        estimates: list[Future[int]] = [pool.submit(_estimate, spec_of(
            {k: v for k, v in c.items() if k != "compile"})) for c in todo]
        for config, est in zip(todo, estimates, strict=True):
            if args.profile and config["strategy"] == "ddp" and "model_args" not in config \
                    and config.get("dtype") == "bf16-mixed":
                config = {**config, "profile": True}
            label = label_of(config)
            got = _run_fresh(config, args.out, args.timeout)
            print(f"gpu_rank0: {label}: {got}", flush=True)
            if isinstance(got, str):
                failed.append(f"{label} ({got})")
                continue
            rows.append(row(spec_of(config), got, est.result(), peak, label=label,
                            compiled=bool(config.get("compile"))))
            _write_rank0(rows, args, peak)  # kept as it comes: a timeout keeps what was done
    bad = [r["label"] for r in rows if r["within_5%"] is False]
    for what, names in (("measured memory off the estimate by > 5%", bad),
                        ("failed", failed)):
        if names:
            print(f"gpu_rank0: {what}: {'; '.join(names)}", file=sys.stderr)
    return 1 if bad or failed else 0


def _write_rank0(rows: list[dict[str, Any]], args: argparse.Namespace,
                 peak: float | None) -> None:
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    where = f"rank 0 of {args.world} workers, {args.recipe}, {card}, torch {torch.__version__}"
    write_tables(rows, args.out, "rank0", f"Memory and step time: {where}")
    rate = "unknown" if peak is None else f"{peak / 1e12:.0f} TFLOP/s"
    write_tables(mfu_rows(rows), args.out, "mfu",
                 f"MFU over the measured bf16 matmul rate ({rate}): {where}")


def run_leak(args: argparse.Namespace, builds: int = 4) -> int:
    """Build rank 0 (b-sdp and n-sdp in turn), take a step, drop it: the device memory still
    allocated after each drop must not grow (a dropped model frees its memory)."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    left, rows = [], []
    for i in range(builds):
        spec = BenchSpec(recipe=args.recipe, world=args.world, batch=1, seq=args.seq,
                         strategy=("b-sdp", "n-sdp")[i % 2], coverage=0.69)
        with fake_group(spec.world):
            built = build_rank0(spec, device)
            measure(built, spec, device, warmup=1, steps=1, flops=0.0)
            del built
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            left.append(torch.cuda.memory_allocated(device))
        else:  # on CPU: the live tensors' bytes, as the suite's freed-build oracle counts them
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from tests.dist.tensors import live_bytes

            left.append(live_bytes())
        rows.append({"build": i + 1, "strategy": spec.label, "left_after_drop_GiB": left[-1] / GiB})
        print(f"gpu_rank0: leak: {rows[-1]}", flush=True)
    write_tables(rows, args.out, "leak", f"Memory left after dropping each build, {args.recipe}")
    grown = left[-1] - left[0]
    ok = grown <= 4 * 2**20  # allocator rounding, not a model
    print(f"gpu_rank0: leak: {grown / 2**20:.1f} MiB more after build {builds} than after build 1 "
          f"({'flat' if ok else 'LEAKS'})", flush=True)
    return 0 if ok else 1


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
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("what", choices=("peak", "rank0", "one", "leak", "parity", "comms"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--recipe", default="llama-1b")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rows", default="fp32,bf16,compile",
                    help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--match", default="", help="only the configurations whose label "
                    "matches this regular expression")
    ap.add_argument("--config", help="one: the configuration (JSON)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per configuration")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="instead of OUT/peak.json (the peak step's measurement)")
    args = ap.parse_args(argv)
    run = {"peak": run_peak, "rank0": run_rank0, "one": run_one, "leak": run_leak,
           "parity": run_parity, "comms": run_comms}[args.what]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
