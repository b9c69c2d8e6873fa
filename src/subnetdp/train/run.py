"""Train one run from a ``TrainConfig``: checks before any worker starts, the workers (local
processes, or this process under torchrun), and the run's summary."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from subnetdp.train.config import TrainConfig

if TYPE_CHECKING:
    from subnetdp.plan import Plan

START_TIMEOUT_MIN_S = 120.0  # a loaded machine may take a while to start every worker


def run_training(cfg: TrainConfig, *, start_method: str | None = None) -> dict[str, Any]:
    """Train and return the run's summary (read back from ``summary.json``).

    ``start_method`` is ``launch``'s (None: a fork server, or spawn once this process holds a
    process group or CUDA)."""
    # The launching process says what it does while the checks run and the workers start
    # (seconds to a minute); under torchrun there is none, and rank 0 speaks for the run.
    say = _say if cfg.progress and "RANK" not in os.environ else None
    # torch, the models and the trainer load when a run starts, not on import
    from subnetdp.checkpoint.rundir import check_run_inputs, hold_run_folder
    from subnetdp.distributed.launch import WorkerFailedError
    from subnetdp.distributed.process_group import under_launcher
    from subnetdp.filemode import write_atomic
    from subnetdp.metrics.progress import LiveBar, draws_bar
    from subnetdp.train.elastic import launch_shrinking
    from subnetdp.train.hetero import check_world, write_budget_plan
    from subnetdp.train.resume import NonFiniteLossError, restart_count
    from subnetdp.train.trainer import train_worker

    cfg = cfg.resolved()
    if under_launcher():
        cfg = _under_torchrun(cfg)
    if not cfg.resume:  # a resumed run reads what it read before, from its own folder too
        check_run_inputs(cfg.out, _inputs(cfg))  # [Note: outputs apart from sources]
    # under torchrun every worker makes its own plan
    plan, holders, mapped = (None, {}, []) if under_launcher() else _preflight(cfg, say)
    # One writer per run folder, held across restarts and shrinks (checkpoint/rundir.py); under
    # torchrun rank 0 holds it, before the process group (so any rank's write) exists.
    owner = not under_launcher() or os.environ.get("RANK") == "0"
    logs = Path(cfg.out) / "logs"  # every worker's output and the agent's log
    with hold_run_folder(Path(cfg.out)) if owner else contextlib.nullcontext() as lock:
        if owner and restart_count() == 0:  # a torchrun restart continues its own folder
            _claim_folder(cfg)
        # --capacities/--memory-gb (train/hetero.py); under torchrun each worker checks them
        check_world(cfg, int(os.environ["WORLD_SIZE"]) if under_launcher() else cfg.nproc,
                    worker=under_launcher())
        cfg = write_budget_plan(cfg, plan)
        run_id = f"subnetdp-{int(time.time())}"
        # on a terminal this process draws rank 0's progress as a live bar; else (a pipe, a
        # file, a terminal of zero columns) its lines are echoed here (tee) as they are
        live = say is not None and draws_bar(sys.stdout)
        if say:
            say(f"starting {cfg.nproc} workers (their logs: {logs}) ...")
        try:
            with (LiveBar(logs, f"{run_id}_*/attempt_*/0/stdout.log") if live
                  else contextlib.nullcontext()):
                results = launch_shrinking(
                    train_worker, cfg, plan=plan, run_id=run_id, start_method=start_method,
                    holders=holders,
                    log_dir=str(logs), tee_rank0=not live,
                    start_timeout=max(START_TIMEOUT_MIN_S, cfg.collective_timeout),
                    hold_fd=lock)
        except WorkerFailedError as e:
            e.mapped = mapped
            # the tracebacks, named in the line the user sees (e.summary); on a full disk that
            # line names the workers' error without them
            with contextlib.suppress(OSError):
                write_atomic(logs / "failure.log", str(e) + "\n")
                e.log = str(logs / "failure.log")
            raise
    stopped = [r["error"] for r in results.values() if isinstance(r, dict) and "error" in r]
    if stopped:
        raise NonFiniteLossError(stopped[0])
    summary_path = Path(cfg.out) / "summary.json"
    return json.loads(summary_path.read_text()) if summary_path.exists() else {}


def _under_torchrun(cfg: TrainConfig) -> TrainConfig:
    """What torchrun decides for the run: its nodes ([Note: emulated nodes] in
    distributed/nodes.py); growing is its own too (``--max-nproc`` is the local launcher's)."""
    from subnetdp.distributed.nodes import launcher_nnodes

    if cfg.max_nproc is not None:
        raise ValueError("--max-nproc grows a local run; under torchrun a node joins by "
                         "torchrun's --nnodes MIN:MAX (docs/checkpointing.md): drop it")
    return dataclasses.replace(cfg, nnodes=launcher_nnodes())


def _preflight(
    cfg: TrainConfig, say: Callable[[str], None] | None,
) -> tuple[Plan, dict[int, int], list[str]]:
    """The launching process's checks before any worker starts. Returns the plan that will
    run (read or built once, here: the workers get it), the --min-holders of each world a
    shrink may reach, and the files the workers memory-map (named if one dies of SIGBUS)."""
    from subnetdp.distributed import faults
    from subnetdp.train.build import replanner
    from subnetdp.train.elastic import check_replan_options, shrink_holders
    from subnetdp.train.grow import check_growth
    from subnetdp.train.hetero import budget_plan
    from subnetdp.train.rescue import unreached_phase
    from subnetdp.train.resume import preflight_resume, recorded_data
    from subnetdp.train.tasks import make_task
    from subnetdp.train.validate import preflight

    if say:
        say("checking the model, plan and data (the first run also builds the tokenizer) "
            "...")
    # the tokenizer/token cache is built once, here, before the workers start; then the
    # model, the plan, data and folder are checked on the meta device (train/validate.py)
    task = make_task(cfg, recorded_data(cfg))
    plan = preflight(cfg, task, budget_plan(cfg, cfg.nproc))
    mapped = task.mapped_files()
    # Refuse a damaged checkpoint or one for another world before anything is written.
    if cfg.resume:
        preflight_resume(cfg)
    check_replan_options(cfg)
    make = replanner(cfg, task.model_overrides())
    holders = shrink_holders(cfg, make)
    check_growth(cfg, make)  # --max-nproc: the grown world's plan (train/grow.py)
    # a testing hook ([Note: rescue]), ignored unless set: refused if it could never fire
    faults.check_env(cfg.nproc, nodes=cfg.nnodes, first=_first_step(cfg), last=cfg.steps,
                     unreached=functools.partial(unreached_phase, cfg))
    return plan, holders, mapped


def _claim_folder(cfg: TrainConfig) -> None:
    """The run folder's owner, before the first worker: no links inside it, fresh unless
    resumed or overwritten, a resumed run's newer checkpoints set aside (never deleted)."""
    from subnetdp.checkpoint.files import resolve_checkpoint
    from subnetdp.checkpoint.rundir import RUN_ENTRIES, check_fresh, set_aside_newer
    from subnetdp.filemode import check_no_links, folder_id

    out = Path(cfg.out)
    check_no_links(out, RUN_ENTRIES)  # [Note: no links inside a run folder]
    check_fresh(out, resume=bool(cfg.resume), overwrite=cfg.overwrite,
                folder=folder_id(out))
    aside = set_aside_newer(resolve_checkpoint(cfg.resume)) if cfg.resume else None
    if aside is not None:
        print(f"notice: resuming from {cfg.resume}: the run's newer checkpoints were "
              f"moved to {aside} (nothing was deleted)", file=sys.stderr, flush=True)


def _first_step(cfg: TrainConfig) -> int:
    """The first step this run trains (after its resumed checkpoint's)."""
    if not cfg.resume:
        return 1
    from subnetdp.checkpoint.files import read_manifest, resolve_checkpoint

    return int(read_manifest(resolve_checkpoint(cfg.resume))["step"]) + 1


def _inputs(cfg: TrainConfig) -> list[tuple[str, str | None]]:
    """What a run reads from paths: (option, path); a glob pattern up to its first wildcard."""
    tokenizer = cfg.tokenizer if cfg.tokenizer != "gpt2" else None
    files = [("--data-files", re.split(r"[*?\[]", p, maxsplit=1)[0] or ".")
             for p in cfg.data_files]
    # --init-from first: its tokenizer.json is the run's --tokenizer
    return [("--init-from", cfg.init_from), ("--data-dir", cfg.data_dir),
            ("--tokenizer", tokenizer),
            ("--plan-file", cfg.plan_file), *files]


def _say(line: str) -> None:
    print(line, flush=True)
