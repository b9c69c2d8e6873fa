"""The training loop of one worker, and the run summary."""

from __future__ import annotations

import math
import platform
import statistics
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from subnetdp.checkpoint.checkpointer import (
    Checkpointer,
    RunStoppedError,
    run_info,
    seed_generators,
)
from subnetdp.checkpoint.reshard import HeldCheckpoint
from subnetdp.distributed import faults
from subnetdp.distributed.process_group import init_distributed, shutdown_distributed
from subnetdp.distributed.signals import GracefulStop
from subnetdp.distributed.stragglers import StragglerWatch
from subnetdp.distributed.timeouts import naming_silent_ranks, set_timeout, slow_phase, slow_timeout
from subnetdp.hf.tokenizer import save_run_tokenizer
from subnetdp.metrics.comm import comm_record, comm_summary
from subnetdp.metrics.memory import measure_step_memory
from subnetdp.metrics.numerics import numerics
from subnetdp.metrics.progress import Progress
from subnetdp.metrics.sinks import JsonlSink, rank_jsonl_path, val_jsonl_path, write_json_atomic
from subnetdp.metrics.tracking import (
    GLOBAL_AVG_LOSS,
    GRAD_NORM,
    MAX_ACTIVE,
    MFU,
    Tracker,
    peak_flops,
)
from subnetdp.models import get_recipe
from subnetdp.parallelize import storage_dtype
from subnetdp.plan import Plan, diagnostics, worker_bytes
from subnetdp.runtime.local_steps import LocalSteps
from subnetdp.runtime.rank import RankModel
from subnetdp.runtime.reducer import CommStats
from subnetdp.subnet.build import build_full_model
from subnetdp.train.build import build_rank, local_steps, make_optimizer, run_plan, save_plan
from subnetdp.train.config import TrainConfig
from subnetdp.train.device import run_device, to_device
from subnetdp.train.flops import rank_step_flops
from subnetdp.train.grow import Growth, grow_worker, grows
from subnetdp.train.init_from import init_weights
from subnetdp.train.rescue import StepCommit, rescue_enabled, save_rescue
from subnetdp.train.resume import (
    drop_replayed_metrics,
    not_finite_error,
    recorded_data,
    resume_source,
    state_finite,
)
from subnetdp.train.shared_folder import check_shared_folder
from subnetdp.train.tasks import Task, make_task

WARMUP_STEPS = 2  # excluded from the median step time (allocations, DDP bucket rebuild)


def train_step(
    rank: RankModel, opt: torch.optim.Optimizer, sched: Any, task: Task,
    batch: tuple[torch.Tensor, torch.Tensor], grad_clip: float,
    commit: StepCommit | None = None, outer: LocalSteps | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """batch -> forward/backward (gradients come back reduced) -> clip -> step. Returns the
    loss and the gradient norm as device tensors: reading them is a host sync, left to the
    caller's log steps. ``commit``: the step boundary of a rescuable run ([Note: rescue]);
    ``outer``: local steps (gradients stay local; a sync after every H-th step)."""
    x, y = batch
    faults.point("forward")
    with nullcontext() if outer is None else outer.inner(rank.model):
        loss = task.loss(rank.model(x), y)
        faults.point("backward")
        loss.backward()
    # the full model's norm, the same on every holder (SDP: each piece counted by its owner);
    # with local steps, this rank's own
    norm = None
    if grad_clip > 0:
        norm = (rank.clip_grad_norm_ if outer is None else outer.clip)(grad_clip)
    if commit is not None:
        commit.reduced()
    faults.point("optimizer")
    opt.step()
    sched.step()
    if outer is not None:
        outer.after_step()
    if commit is not None:
        commit.applied_step()
    opt.zero_grad(set_to_none=True)
    return loss.detach(), None if norm is None else norm.detach()


def train_worker(cfg_dict: dict[str, Any], plan: Plan | None = None) -> dict[str, Any]:
    """One worker's whole run; rank 0 also writes ``summary.json``. Returns this rank's stats.
    ``plan``: the run's plan, read and validated by the launching process (None: build it
    here, as under torchrun or after an elastic shrink)."""
    cfg = TrainConfig.from_dict(cfg_dict)
    if grows(cfg):  # a launch with joiners ([Note: growing a run] in train/grow.py)
        return grow_worker(cfg, plan, _run)
    # start-up (model build, restore) may be slow; the steps get --collective-timeout
    rank, world = init_distributed("gloo" if cfg.device == "cpu" else None,
                                   timeout=slow_timeout(cfg.collective_timeout))
    try:
        with naming_silent_ranks(rank, world):
            return _run(cfg, rank, world, plan)
    except RunStoppedError as e:
        # All ranks stop at the same step (the check is collective). Returning rather than
        # raising tells torch elastic not to restart a run that would only diverge again
        # (or fill the same full disk, or read the same damaged checkpoint, again).
        return {"error": str(e)}
    finally:
        shutdown_distributed()


class _Window:
    """Per-step records of the steps since the last log step. Losses and norms stay on the
    device until ``flush``, which reads them all with one host sync and checks them with one
    collective ([Note: log steps])."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.losses: list[torch.Tensor] = []
        self.norms: list[torch.Tensor | None] = []
        self.rows: list[dict[str, Any]] = []

    def _clear(self) -> None:
        self.steps, self.losses, self.norms, self.rows = [], [], [], []

    def add(self, step: int, loss: torch.Tensor, norm: torch.Tensor | None,
            row: dict[str, Any]) -> None:
        self.steps.append(step)
        self.losses.append(loss)
        self.norms.append(norm)
        self.rows.append(row)

    def flush(self, sink: JsonlSink, out: Path, tracker: Tracker,
              state_ok: torch.Tensor) -> list[float]:
        """Write the window's lines; raise ``NonFiniteLossError`` on every rank at once if any
        rank's loss, or its state now (``state_ok``, ``resume.state_finite``), went NaN/inf.
        Returns this rank's losses.

        One all-gather of the window's losses and the state flag gives every rank the
        all-rank average of each step (``loss_metrics/global_avg_loss``) and whether any rank
        diverged; one host sync reads it with the gradient norms."""
        if not self.steps:
            return []
        mine = torch.cat([torch.stack(self.losses).to(torch.float64),
                          state_ok.to(self.losses[0].device, torch.float64).reshape(1)])
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        rows = torch.stack(everyone).tolist()  # [world][steps + 1]: losses, then the flag
        by_rank = [r[:-1] for r in rows]
        losses = by_rank[dist.get_rank()]
        known = [n for n in self.norms if n is not None]
        norm_values = iter(torch.stack(known).float().tolist() if known else [])
        norms = [None if n is None else next(norm_values) for n in self.norms]
        for i, (step, loss, norm, row) in enumerate(
                zip(self.steps, losses, norms, self.rows, strict=True)):
            record = {"loss": loss,
                      GLOBAL_AVG_LOSS: statistics.fmean(r[i] for r in by_rank),
                      **({GRAD_NORM: norm} if norm is not None else {}), **row}
            sink.log(step, record)
            tracker.log(step, {k: v for k, v in record.items() if k != "loss"})
        for i, step in enumerate(self.steps):
            bad = {r: v[i] for r, v in enumerate(by_rank) if not math.isfinite(v[i])}
            if bad:
                raise not_finite_error(out, step=step, bad=bad)
        broken = [r for r, row in enumerate(rows) if row[-1] != 1.0]
        if broken:
            raise not_finite_error(out, step=self.steps[-1], broken=broken)
        self._clear()
        return losses


# [Note: log steps]
# Reading a loss (``.item()``) waits for the device, and a finiteness check across ranks is a
# collective; doing either every step would stall a GPU pipeline that the step itself never
# needs to stall. So losses stay on the device and are read every ``log_every`` steps, before
# every checkpoint (a non-finite loss, or non-finite weights: [Note: the finite-state guard] in
# train/resume.py, are caught before the checkpoint after them is written, so the newest
# checkpoint stays good) and at the end; every rank checks at the same steps, so all
# stop at the same step. Step times are host times (exact on CPU; on GPU the log steps' sync
# makes each window's total exact).


def _run(cfg: TrainConfig, rank: int, world: int, plan: Plan | None, *,
         held: HeldCheckpoint | None = None, grow: Growth | None = None) -> dict[str, Any]:
    """``held``: a grown group's state, in memory; ``grow``: the members' side of a launch
    with joiners ([Note: growing a run] in train/grow.py)."""
    run = _start(cfg, rank, world, plan, held)
    run.grow = grow
    _loop(run)
    return _finish(run)


@dataclass
class _RunState:
    """One worker's run: built by ``_start``, advanced by ``_loop`` (``_step`` per step),
    summarised by ``_finish``."""

    cfg: TrainConfig
    rank: int
    world: int
    out: Path
    device: torch.device
    recipe: Any
    task: Task
    overrides: dict[str, Any]
    plan: Plan
    model: RankModel
    opt: torch.optim.Optimizer
    sched: Any
    ckpt: Checkpointer
    start: int  # the last step already applied (a resume's), 0 for a fresh run
    stop: GracefulStop
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    losses: list[float]
    progress: Progress
    comm: CommStats
    peak: float | None
    flops: float | None
    val_sink: JsonlSink | None
    tracker: Tracker
    loop_start: float
    commit: StepCommit
    outer: LocalSteps | None  # --sync-every H > 1
    watch: StragglerWatch  # [Note: stragglers]
    window: _Window = field(default_factory=_Window)
    times: list[float] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)
    step_bytes: list[int] = field(default_factory=list)
    # backward masking: owners -> non-holders, before forward
    refresh_bytes: list[int] = field(default_factory=list)
    saved: Path | None = None  # the newest checkpoint this run wrote (the summary names it)
    max_active: float | None = None  # CPU: known from the memory step on
    train_time: float = 0.0
    evaluation: dict[str, float] = field(default_factory=dict)  # the summary's
    grow: Growth | None = None  # joiners wait ([Note: growing a run] in train/grow.py)


def _start(cfg: TrainConfig, rank: int, world: int, plan: Plan | None,
           held: HeldCheckpoint | None = None) -> _RunState:
    """Everything before the first step: the folder, the plan, this rank's model, optimizer
    and checkpointer (restored on a resume), the run's files (rank 0), the data and sinks."""
    out = Path(cfg.out)
    check_shared_folder(out, rank)  # a node-local --out fails here, not at the first checkpoint
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0 and cfg.progress:  # the first line from the workers, before the slow part
        print(f"building the model and plan ({world} workers) ...", flush=True)
    seed_generators(cfg.seed)
    device = run_device(cfg)
    recipe = get_recipe(cfg.recipe)
    task = make_task(cfg, recorded_data(cfg))  # a resume: the data the run recorded
    overrides = task.model_overrides()
    if plan is None:
        with torch.device("meta"):
            plan = run_plan(cfg, recipe.build_model(**overrides), recipe, world)
    model = build_rank(cfg, recipe, plan, device, overrides)
    # also: after an elastic restart, the newest; a grown group's is in memory (held)
    source = resume_source(cfg.resume, out) if held is None else None
    # --init-from: every rank reads the pieces it holds, before the optimizer sees them,
    # unless a checkpoint (a resume, a restart) holds newer weights
    init = init_weights(cfg.init_from, model, rank, source) \
        if cfg.init_from and held is None else {}
    opt, sched = make_optimizer(cfg, recipe, model)
    ckpt = Checkpointer(out, model, opt, sched, plan=plan, cfg=cfg, rank=rank, world=world,
                        info={**run_info(recipe, overrides, storage_dtype(cfg.composition())),
                              "data": task.data_identity(),
                              **init}, holders_differ=cfg.sync_every > 1)
    start = (ckpt.restore_held(held) if held is not None else
             ckpt.restore(source) if source is not None else 0)
    outer = local_steps(cfg, model, plan, opt, start)  # --sync-every H > 1
    resumed = source is not None or held is not None
    set_timeout(cfg.collective_timeout)
    stop = GracefulStop()  # SIGTERM/SIGINT: finish a checkpoint that is due soon, then exit
    if rank == 0:
        save_plan(plan, out / "plan.json")
        write_json_atomic(out / "config.json", {**cfg.to_dict(), "nproc": world})
        save_run_tokenizer(task, out)  # the run keeps its own tokenizer (for export)

    batches = task.batches(rank=rank, world=world, start_step=start)  # exact data position
    losses = drop_replayed_metrics(rank_jsonl_path(out, rank), start, resumed=resumed)
    progress = Progress(cfg.steps, enabled=rank == 0 and cfg.progress,
                        desc=cfg.strategy_value.name, start=start)
    comm = model.comm_stats
    peak = peak_flops(torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                      cfg.peak_tflops)
    flops = (rank_step_flops(cfg, recipe, overrides, plan, model.strategy, rank)
             if peak is not None else None)
    val_sink = None
    if rank == 0:
        drop_replayed_metrics(val_jsonl_path(out), start, resumed=resumed)
        val_sink = JsonlSink(val_jsonl_path(out))
    tracker = Tracker(out, tensorboard=cfg.tensorboard,
                      wandb_project=cfg.wandb_project or ("subnetdp" if cfg.wandb else None),
                      config=cfg.to_dict(), enabled=rank == 0)
    loop_start = time.perf_counter()
    # a lost peer: save what this rank holds for the launcher to compose ([Note: rescue])
    commit = StepCommit(rescue_enabled(cfg), applied=start, device=device)
    watch = StragglerWatch(rank, world, device, start=start, enabled=not cfg.fsdp)
    return _RunState(cfg, rank, world, out, device, recipe, task, overrides, plan, model, opt,
                     sched, ckpt, start, stop, batches, losses, progress, comm, peak, flops,
                     val_sink, tracker, loop_start, commit, outer, watch)


def _loop(run: _RunState) -> None:
    """The steps after ``run.start`` up to ``--steps``, then the full model's validation (the
    summary's)."""
    cfg = run.cfg
    with (JsonlSink(rank_jsonl_path(run.out, run.rank)) as sink,
          save_rescue(run.commit, run.ckpt, run.opt, run.sched, run.out)):
        for done in range(run.start + 1, cfg.steps + 1):  # steps are counted from 1 (torchtitan)
            _step(run, done, sink)
        run.progress.close()
        run.train_time = time.perf_counter() - run.loop_start
        set_timeout(slow_timeout(cfg.collective_timeout))  # peers wait while rank 0 evaluates
        run.progress.message(f"validating the full model ({cfg.eval_batches} batches"
                             f"{', ' + ','.join(cfg.eval_tasks) if cfg.eval_tasks else ''}) ...")
        run.evaluation = _evaluate(run.model, run.recipe, run.task, run.device, run.overrides,
                                   run.rank, cfg)
        _log_evaluation(cfg.steps, run.evaluation, run.val_sink, run.tracker)


def _step(run: _RunState, done: int, sink: JsonlSink) -> None:
    """Step ``done``: train, record, write the window on log steps, checkpoint when due,
    validate every ``--eval-every`` steps."""
    cfg, model, opt, sched, comm = run.cfg, run.model, run.opt, run.sched, run.comm
    faults.at_step(done)
    batch = to_device(next(run.batches), run.device)
    lr = sched.get_last_lr()[0]  # the rate this step uses
    sent_before, refreshed_before = comm.total_bytes, comm.total_refresh_bytes
    t0 = time.perf_counter()
    if done == cfg.memory_step:
        (loss, norm), report = measure_step_memory(
            partial(train_step, model, opt, sched, run.task, batch, cfg.grad_clip or 0.0,
                    run.commit, run.outer),
            modules=model.tracked_modules(), optimizers=[opt],
            grad_tensors=model.grad_buffers(),
        )
        run.memory = report.to_dict()
        run.max_active = report.peak_bytes / 2**30
    else:
        loss, norm = train_step(model, opt, sched, run.task, batch, cfg.grad_clip or 0.0,
                                run.commit, run.outer)
    dt = time.perf_counter() - t0
    run.watch.step_done(done)
    # A segment too short for a warm-up (a resume near the end) times every step.
    warm = done - run.start > WARMUP_STEPS or cfg.steps - run.start <= WARMUP_STEPS
    if warm and done != cfg.memory_step:
        run.times.append(dt)
    run.step_bytes.append(comm.total_bytes - sent_before)
    run.refresh_bytes.append(comm.total_refresh_bytes - refreshed_before)
    tps = run.task.items_per_batch / dt
    if run.device.type == "cuda":  # the allocator's counter: no sync
        run.max_active = torch.cuda.max_memory_allocated(run.device) / 2**30
    flops, peak, max_active = run.flops, run.peak, run.max_active
    run.window.add(done, loss, norm, {
        "lr": lr, "time/step_s": dt, "throughput(tps)": tps,
        **({MFU: 100 * flops / dt / peak} if flops is not None and peak else {}),
        **({MAX_ACTIVE: max_active} if max_active is not None else {}),
        "comm/bytes_per_step": run.step_bytes[-1],
        "comm/refresh_bytes_per_step": run.refresh_bytes[-1]})
    due = run.ckpt.due(done)
    # collective and a host sync: asked on log steps only, which read the losses anyway
    growing = (run.grow is not None and done % cfg.log_every == 0
               and run.grow.due(done))  # joiners wait
    # the first step too, so that a progress line shows at once (one more host sync)
    if due or growing or done % cfg.log_every == 0 or done in (cfg.steps, run.start + 1):
        run.losses += run.window.flush(sink, run.out, run.tracker, state_finite(model, opt))
        if slow := run.watch.exchange(done):
            print(slow, flush=True)
        run.progress.update(done, loss=run.losses[-1], tps=tps * run.world, lr=float(lr))
    if due:
        faults.point("checkpoint")
        with slow_phase(cfg.collective_timeout):
            run.saved = run.ckpt.save(done)
    if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
        with slow_phase(cfg.collective_timeout):  # peers wait while rank 0 evaluates
            evaluation = _evaluate(model, run.recipe, run.task, run.device, run.overrides,
                                   run.rank, cfg)
            _log_evaluation(done, evaluation, run.val_sink, run.tracker)
            # here, not in the next step's collective, whose timeout is the short one
            dist.barrier(**_barrier_device(run.device))
        run.progress.message(f"validation at step {done}/{cfg.steps}: "
                             + _format_evaluation(evaluation))
    run.stop.after_step(done, every=cfg.ckpt_every, total=cfg.steps, step_s=dt, saved=due)
    if run.grow is not None and growing:  # [Note: growing a run] in train/grow.py
        raise run.grow.handover(done, run.ckpt)


def _finish(run: _RunState) -> dict[str, Any]:
    """Close the sinks; gather every rank's stats; rank 0 writes ``summary.json``. Returns
    this rank's stats."""
    cfg, rank, world, plan, model = run.cfg, run.rank, run.world, run.plan, run.model
    run.tracker.close()
    if run.val_sink is not None:
        run.val_sink.close()
    median = statistics.median(run.times) if run.times else float("nan")
    wb = worker_bytes(plan, rank, masking=model.strategy.cost_masking)
    step_bytes, refresh_bytes = run.step_bytes, run.refresh_bytes
    stats = {
        "rank": rank,
        "params_held": model.params_held,  # stored on this rank (FSDP: its shards)
        "params_trained": model.params_trained,
        # the first step has nothing to refresh yet; the median is the steady state
        "refresh_bytes_per_step": statistics.median(refresh_bytes[1:] or refresh_bytes or [0]),
        "units_held": plan.held_units(rank),
        "peak_memory_bytes": run.memory.get("peak_bytes"),
        "max_active": run.max_active,  # GiB; the summary's memory/max_active(GiB)
        "memory": run.memory,
        # local steps send at syncs only: their mean
        "comm_bytes_per_step": (statistics.median(step_bytes[1:] or step_bytes or [0])
                                if run.outer is None else statistics.fmean(step_bytes or [0])),
        "comm_ring_bytes_per_step": (wb.allreduce_ring if run.outer is None
                                     else wb.allreduce_ring / cfg.sync_every),
        # counted by the reducers: per step, by collective and by process group (payload, ring)
        "comm": comm_record(run.comm, steps=cfg.steps - run.start),
        "analytic": wb.to_dict(),
        "step_time_s": median,
        "train_time_s": run.train_time,
        "final_train_loss": statistics.fmean(run.losses[-10:]),
    }
    gathered: list[dict[str, Any]] | None = [{} for _ in range(world)] if rank == 0 else None
    dist.gather_object(stats, gathered, dst=0)
    if rank == 0:
        assert gathered is not None
        summary = {**_summary(cfg, plan, world, gathered, run.evaluation,
                              run.task.items_per_batch),
                   **_checkpoint_record(cfg, run.saved),
                   # rank 0's kernels, which also computed the validation ([Note: figures that
                   # repeat on one machine])
                   "numerics": numerics(run.device)}
        write_json_atomic(run.out / "summary.json", summary)
    return stats


def _log_evaluation(step: int, evaluation: dict[str, float], sink: JsonlSink | None,
                    tracker: Tracker) -> None:
    """Rank 0's evaluation after ``step`` into ``metrics/val.jsonl`` and the sinks (other
    ranks have none)."""
    if evaluation and sink is not None:
        sink.log(step, evaluation)
        tracker.log(step, evaluation)


def _format_evaluation(evaluation: dict[str, float]) -> str:
    return " | ".join(f"{k} {int(v)}" if float(v).is_integer() else f"{k} {v:.4f}"
                      for k, v in evaluation.items())


def _evaluate(
    model: RankModel, recipe: Any, task: Task, device: torch.device,
    overrides: dict[str, Any], rank: int, cfg: TrainConfig,
) -> dict[str, float]:
    """Validation on the *full* model, on rank 0: SDP assembles each unit from its owner,
    FSDP gathers every parameter, DDP hands over its replica (collective). With
    ``--eval-tasks``, also its downstream accuracy ([Note: downstream while training])."""
    state = model.full_state_dict()
    if rank != 0:
        return {}
    assert state is not None
    with torch.device("meta"):
        full = recipe.build_model(**overrides)
    full = build_full_model(full, recipe.adapter, device=device)
    full.load_state_dict(state)
    evaluation = task.evaluate(full, device)
    if cfg.eval_tasks:
        evaluation |= _downstream(full, cfg)
    return evaluation


# [Note: downstream while training]
# ``--eval-tasks`` scores the assembled full model with lm-eval at each validation: rank 0
# renames its state into an in-memory ``LlamaForCausalLM`` with the run's tokenizer
# (hf/llama.py, hf/tokenizer.py: what ``export --format hf`` writes) and scores it with
# ``evals.evaluate_model``, the scoring of ``subnetdp eval --tasks`` on a folder, so the two
# give the same numbers for the same weights and ``--limit``. The other ranks wait at a
# barrier under the slow-phase timeout (distributed/timeouts.py: max(30 min, 6 x
# --collective-timeout)), which an evaluation must fit. lm-eval reseeds the random streams;
# they are restored, so the run trains as it would without it.


def _downstream(full: torch.nn.Module, cfg: TrainConfig) -> dict[str, float]:
    """``eval/<task>/acc`` and ``eval/<task>/acc_norm`` of the assembled LLaMA ``full``."""
    from subnetdp.data.tokenizer import EOT
    from subnetdp.evals import evaluate_model
    from subnetdp.hf.llama import hf_model
    from subnetdp.hf.tokenizer import hf_tokenizer, run_tokenizer
    from subnetdp.models.llama.model import Llama

    assert isinstance(full, Llama)  # --eval-tasks applies to LLaMA recipes only (train/applies)
    config = full.config
    tokenizer = hf_tokenizer(run_tokenizer(Path(cfg.out)), eot=EOT,
                             max_length=config.max_seq_len)
    hf = hf_model(config, full.state_dict(), eot_id=tokenizer.convert_tokens_to_ids(EOT))
    result = evaluate_model(hf, tokenizer, cfg.eval_tasks, limit=cfg.eval_limit)
    return {f"eval/{name}/{metric}": row[metric]
            for name, row in result["tasks"].items() for metric in ("acc", "acc_norm")}


def _barrier_device(device: torch.device) -> dict[str, Any]:
    """NCCL's barrier is told its device (else it guesses one from the rank)."""
    return {"device_ids": [device.index]} if device.type == "cuda" else {}


def _summary(
    cfg: TrainConfig, plan: Any, world: int, ranks: list[dict[str, Any]],
    evaluation: dict[str, float], items_per_batch: int,
) -> dict[str, Any]:
    diag = diagnostics(plan)
    step_time = max(r["step_time_s"] for r in ranks)  # the slowest rank sets the pace
    # what the plan gives (a --plan-file's, the units' rounding), not the option
    coverage = round(statistics.fmean(diag["unit_coverage"]), 6)
    return {
        "recipe": cfg.recipe,
        "strategy": cfg.strategy_value.name,
        "label": cfg.label(coverage),  # the run's name in reports, e.g. b-sdp+zero2 (C=0.5)
        "coverage": coverage,
        "world": world,
        "steps": cfg.steps,
        "final_train_loss": statistics.fmean(r["final_train_loss"] for r in ranks),
        **evaluation,
        "step_time_s": step_time,
        "train_time_s": max(r["train_time_s"] for r in ranks),
        # per device, as in the JSONL lines; the world's: throughput_total(tps)
        "throughput(tps)": items_per_batch / step_time,
        "throughput_total(tps)": world * items_per_batch / step_time,
        **_max_active(ranks),
        "params_total": plan.shared_size + sum(u.size for u in plan.units),
        "plan": {k: diag[k] for k in ("unit_coverage", "param_coverage", "mask_error",
                                      "spectral_gap", "holders", "communicators")},
        "comm": comm_summary(ranks),
        "per_rank": ranks,
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "config": cfg.to_dict(),
    }


def _checkpoint_record(cfg: TrainConfig, saved: Path | None) -> dict[str, Any]:
    """The newest checkpoint this run wrote (export and eval read it), or why there is none."""
    if saved is not None:
        return {"checkpoint": str(saved)}
    if cfg.checkpoints_unbuilt is not None:
        why = f"checkpoints of {cfg.checkpoints_unbuilt} are not built"
    elif cfg.final_ckpt:
        why = "the run wrote none"  # a resume with no step left to train
    else:
        why = "--no-final-ckpt: drop it (or add --ckpt-every N) to keep the model next time"
    return {"checkpoint": None, "checkpoint_note": why}


def _max_active(ranks: list[dict[str, Any]]) -> dict[str, float]:
    """``memory/max_active(GiB)`` of the run: the largest rank's (when measured)."""
    values = [r["max_active"] for r in ranks if r.get("max_active") is not None]
    return {MAX_ACTIVE: max(values)} if values else {}
