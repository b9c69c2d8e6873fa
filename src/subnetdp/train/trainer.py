"""The training loop of one worker, and the run summary."""

from __future__ import annotations

import platform
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from subnetdp.metrics.comm import comm_record, comm_summary
from subnetdp.metrics.memory import measure_step_memory
from subnetdp.metrics.progress import Progress
from subnetdp.metrics.sinks import JsonlSink, rank_jsonl_path, write_json_atomic
from subnetdp.models import get_recipe
from subnetdp.plan import diagnostics, worker_bytes
from subnetdp.runtime import SubnetDataParallel
from subnetdp.runtime.fsdp import local_full_state, local_tensor
from subnetdp.subnet.build import build_full_model
from subnetdp.train.build import (
    DDPCommCounter,
    FSDPCommCounter,
    build_plan,
    make_optimizer,
    save_plan,
    wrap_model,
)
from subnetdp.train.checkpoint import (
    Checkpointer,
    NonFiniteLossError,
    drop_replayed_metrics,
    resume_source,
    run_info,
    stop_if_not_finite,
)
from subnetdp.train.config import TrainConfig
from subnetdp.train.launch import init_distributed, shutdown_distributed
from subnetdp.train.tasks import Task, make_task

WARMUP_STEPS = 2  # excluded from the median step time (allocations, DDP bucket rebuild)


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, sched: Any, task: Task,
    batch: tuple[torch.Tensor, torch.Tensor], grad_clip: float,
) -> float:
    """batch -> forward/backward (gradients come back reduced) -> clip -> step."""
    x, y = batch
    loss = task.loss(model(x), y)
    loss.backward()
    if grad_clip > 0:
        if isinstance(model, SubnetDataParallel):
            model.clip_grad_norm_(grad_clip)  # the full model's norm, same on all holders
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _tracked(model: nn.Module) -> list[nn.Module]:
    return model.tracked_modules() if isinstance(model, SubnetDataParallel) else [model]


def _refresh_bytes(model: nn.Module) -> int:
    return model.comm_stats.total_refresh_bytes if isinstance(model, SubnetDataParallel) else 0


def _stored(params: Any) -> int:
    return sum(local_tensor(p).numel() for p in params)


def _comm_bytes(model: nn.Module, counter: DDPCommCounter | FSDPCommCounter | None) -> int:
    if isinstance(model, SubnetDataParallel):
        return model.comm_stats.total_bytes
    return counter.total_bytes if counter is not None else 0


def train_worker(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """One worker's whole run; rank 0 also writes ``summary.json``. Returns this rank's stats."""
    cfg = TrainConfig.from_dict(cfg_dict)
    rank, world = init_distributed("gloo" if cfg.device == "cpu" else None)
    try:
        return _run(cfg, rank, world)
    except NonFiniteLossError as e:
        # All ranks stop at the same step (the check is collective). Returning rather than
        # raising tells torch elastic not to restart a run that would only diverge again.
        return {"error": str(e)}
    finally:
        shutdown_distributed()


def _run(cfg: TrainConfig, rank: int, world: int) -> dict[str, Any]:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    device = _device(cfg)
    recipe = get_recipe(cfg.recipe)
    task = make_task(cfg)
    overrides = task.model_overrides()
    with torch.device("meta"):
        plan = build_plan(cfg, recipe.build_model(**overrides), recipe, world)
    model, counter = wrap_model(cfg, recipe, plan, device, overrides)
    opt, sched = make_optimizer(cfg, recipe, model)
    ckpt = Checkpointer(out, model, opt, sched, plan=plan, cfg=cfg, rank=rank, world=world,
                        info=run_info(recipe, overrides))
    source = resume_source(cfg.resume, out)  # also: after an elastic restart, the newest
    start = ckpt.restore(source) if source is not None else 0
    if rank == 0:
        save_plan(plan, out / "plan.json")
        write_json_atomic(out / "config.json", cfg.to_dict())

    batches = task.batches(rank=rank, world=world, start_step=start)  # exact data position
    times: list[float] = []
    losses = drop_replayed_metrics(rank_jsonl_path(out, rank), start, resumed=source is not None)
    memory: dict[str, Any] = {}
    step_bytes: list[int] = []
    refresh_bytes: list[int] = []  # backward masking: owners -> non-holders, before forward
    progress = Progress(cfg.steps, enabled=rank == 0 and cfg.progress, desc=cfg.strategy)
    with JsonlSink(rank_jsonl_path(out, rank)) as sink:
        for step in range(start, cfg.steps):
            x, y = next(batches)
            batch = (x.to(device), y.to(device))
            sent_before = _comm_bytes(model, counter)
            refreshed_before = _refresh_bytes(model)
            t0 = time.perf_counter()
            if step == cfg.memory_step:
                loss, report = measure_step_memory(
                    partial(train_step, model, opt, sched, task, batch, cfg.grad_clip or 0.0),
                    modules=_tracked(model), optimizers=[opt],
                    grad_tensors=model.grad_buffers() if isinstance(model, SubnetDataParallel)
                    else [],
                )
                memory = report.to_dict()
            else:
                loss = train_step(model, opt, sched, task, batch, cfg.grad_clip or 0.0)
            dt = time.perf_counter() - t0
            if isinstance(counter, FSDPCommCounter):
                counter.count_step()
            # A segment too short for a warm-up (a resume near the end) times every step.
            warm = step - start >= WARMUP_STEPS or cfg.steps - start <= WARMUP_STEPS
            if warm and step != cfg.memory_step:
                times.append(dt)
            sent = _comm_bytes(model, counter) - sent_before
            step_bytes.append(sent)
            refresh_bytes.append(_refresh_bytes(model) - refreshed_before)
            losses.append(loss)
            stop_if_not_finite(loss, step, out, device)
            tps = task.items_per_batch / dt
            sink.log(step, {"loss": loss, "lr": sched.get_last_lr()[0], "time/step_s": dt,
                            "throughput(tps)": tps, "comm/bytes_per_step": sent,
                            "comm/refresh_bytes_per_step": refresh_bytes[-1]})
            progress.update(step + 1, loss=loss, tps=tps * world)
            if ckpt.due(step + 1):
                ckpt.save(step + 1)
    progress.close()

    evaluation = _evaluate(model, recipe, task, device, overrides, rank)
    median = statistics.median(times) if times else float("nan")
    sdp = model if isinstance(model, SubnetDataParallel) else None
    masking = "backward" if sdp is not None and sdp.backward_masked else "forward"
    wb = worker_bytes(plan, rank, masking=masking)
    stats = {
        "rank": rank,
        # stored on this rank (FSDP: its shards)
        "params_held": sdp.params_held if sdp else _stored(model.parameters()),
        "params_trained": sdp.params_trained if sdp else _stored(model.parameters()),
        # the first step has nothing to refresh yet; the median is the steady state
        "refresh_bytes_per_step": statistics.median(refresh_bytes[1:] or refresh_bytes or [0]),
        "units_held": plan.held_units(rank),
        "peak_memory_bytes": memory.get("peak_bytes"),
        "memory": memory,
        "comm_bytes_per_step": statistics.median(step_bytes[1:] or step_bytes or [0]),
        "comm_ring_bytes_per_step": wb.allreduce_ring,
        # counted by the reducers: per step, by collective and by process group (payload, ring)
        "comm": comm_record(model, counter, steps=cfg.steps - start, world=world),
        "analytic": wb.to_dict(),
        "step_time_s": median,
        "final_train_loss": statistics.fmean(losses[-10:]),
    }
    gathered: list[dict[str, Any]] | None = [{} for _ in range(world)] if rank == 0 else None
    dist.gather_object(stats, gathered, dst=0)
    if rank == 0:
        assert gathered is not None
        summary = _summary(cfg, plan, world, gathered, evaluation, task.items_per_batch)
        write_json_atomic(out / "summary.json", summary)
    return stats


def _evaluate(
    model: nn.Module, recipe: Any, task: Task, device: torch.device,
    overrides: dict[str, Any], rank: int,
) -> dict[str, float]:
    """Validation on the *full* model: SDP assembles each unit from its owner on rank 0, FSDP
    gathers every parameter (collective)."""
    if isinstance(model, SubnetDataParallel | FSDPModule):
        state = (model.full_state_dict() if isinstance(model, SubnetDataParallel)
                 else local_full_state(model))
        result: dict[str, float] = {}
        if rank == 0:
            assert state is not None
            with torch.device("meta"):
                full = recipe.build_model(**overrides)
            full = build_full_model(full, recipe.adapter, device=device)
            full.load_state_dict(state)
            result = task.evaluate(full, device)
        return result
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return task.evaluate(module, device) if rank == 0 else {}


def _summary(
    cfg: TrainConfig, plan: Any, world: int, ranks: list[dict[str, Any]],
    evaluation: dict[str, float], items_per_batch: int,
) -> dict[str, Any]:
    diag = diagnostics(plan)
    step_time = max(r["step_time_s"] for r in ranks)  # the slowest rank sets the pace
    return {
        "recipe": cfg.recipe,
        "strategy": cfg.strategy,
        "coverage": cfg.coverage if cfg.strategy != "ddp" else 1.0,
        "world": world,
        "steps": cfg.steps,
        "final_train_loss": statistics.fmean(r["final_train_loss"] for r in ranks),
        **evaluation,
        "step_time_s": step_time,
        "throughput(tps)": world * items_per_batch / step_time,
        "params_total": plan.shared_size + sum(u.size for u in plan.units),
        "plan": {k: diag[k] for k in ("unit_coverage", "param_coverage", "mask_error",
                                      "spectral_gap", "holders")},
        "comm": comm_summary(ranks),
        "per_rank": ranks,
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "config": cfg.to_dict(),
    }
