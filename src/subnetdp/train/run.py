"""Train one run from a ``TrainConfig``: checks before any worker starts, the workers (local
processes, or this process under torchrun), and the run's summary."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from subnetdp.train.config import TrainConfig

START_TIMEOUT_MIN_S = 120.0  # a loaded machine may take a while to start every worker


def run_training(cfg: TrainConfig, *, start_method: str | None = None) -> dict[str, Any]:
    """Train and return the run's summary (read back from ``summary.json``).

    ``start_method`` is ``launch``'s (None: a fork server, or spawn once this process holds a
    process group or CUDA)."""
    # torch, the models and the trainer load when a run starts, not on import
    from subnetdp.checkpoint.rundir import check_fresh, hold_run_folder
    from subnetdp.distributed.launch import WorkerFailedError
    from subnetdp.distributed.process_group import under_launcher
    from subnetdp.train.elastic import check_replan_options, launch_shrinking
    from subnetdp.train.hetero import prepare_hetero
    from subnetdp.train.resume import NonFiniteLossError, preflight_resume, restart_count
    from subnetdp.train.tasks import make_task
    from subnetdp.train.trainer import train_worker

    cfg = cfg.resolved()
    if not under_launcher():
        from subnetdp.train.validate import preflight

        # the tokenizer/token cache is built once, here, before the workers start; then the
        # model, plan, data and folder are checked on the meta device (train/validate.py)
        preflight(cfg, make_task(cfg))
        # Refuse a damaged checkpoint or one for another world before anything is written.
        if cfg.resume:
            preflight_resume(cfg)
        check_replan_options(cfg)
    # One writer per run folder, held across restarts and shrinks (checkpoint/rundir.py); under
    # torchrun rank 0 holds it, before the process group (so any rank's write) exists.
    owner = not under_launcher() or os.environ.get("RANK") == "0"
    logs = Path(cfg.out) / "logs"  # every worker's output and the agent's log
    with hold_run_folder(Path(cfg.out)) if owner else contextlib.nullcontext():
        if owner and restart_count() == 0:  # a torchrun restart continues its own folder
            check_fresh(Path(cfg.out), resume=bool(cfg.resume), overwrite=cfg.overwrite)
        # --capacities/--memory-gb (train/hetero.py); under torchrun each worker checks them
        cfg = (prepare_hetero(cfg, int(os.environ["WORLD_SIZE"]), worker=True)
               if under_launcher() else prepare_hetero(cfg, cfg.nproc))
        try:
            # tee: rank 0's progress lines still show here
            results = launch_shrinking(
                train_worker, cfg, run_id=f"subnetdp-{int(time.time())}",
                start_method=start_method, log_dir=str(logs), tee_rank0=True,
                start_timeout=max(START_TIMEOUT_MIN_S, cfg.collective_timeout))
        except WorkerFailedError as e:
            e.log = str(logs / "failure.log")  # the tracebacks; the user sees e.summary
            Path(e.log).write_text(str(e) + "\n")
            raise
    stopped = [r["error"] for r in results.values() if isinstance(r, dict) and "error" in r]
    if stopped:
        raise NonFiniteLossError(stopped[0])
    summary_path = Path(cfg.out) / "summary.json"
    return json.loads(summary_path.read_text()) if summary_path.exists() else {}
