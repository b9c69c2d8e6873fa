"""Train one run from a ``TrainConfig``: checks before any worker starts, the workers (local
processes, or this process under torchrun), and the run's summary."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from subnetdp.train.config import TrainConfig


def run_training(cfg: TrainConfig, *, start_method: str | None = None) -> dict[str, Any]:
    """Train and return the run's summary (read back from ``summary.json``).

    ``start_method`` is ``launch``'s (None: fork). A long-lived caller that trains many runs
    (the quality study) passes ``"forkserver"``: forking from a process whose threads (the
    elastic agent's TCP store) may hold a libc lock can deadlock a worker."""
    # torch, the models and the trainer load when a run starts, not on import
    from subnetdp.train.hetero import prepare_hetero
    from subnetdp.train.launch import launch, under_launcher
    from subnetdp.train.resume import NonFiniteLossError, check_fresh_run_dir, preflight_resume
    from subnetdp.train.tasks import make_task
    from subnetdp.train.trainer import train_worker

    cfg = cfg.resolved()
    if not under_launcher():
        if cfg.plan_file:  # refuse a plan for another world size before starting anyone
            from subnetdp.plan import Plan

            Plan.from_json(Path(cfg.plan_file).read_text()).validate(cfg.nproc)
        make_task(cfg)  # build the tokenizer/token cache once, before the workers start
        # Refuse a damaged checkpoint or one for another world before anything is written.
        if cfg.resume:
            preflight_resume(cfg)
        else:
            check_fresh_run_dir(Path(cfg.out))
        cfg = prepare_hetero(cfg, cfg.nproc)  # --capacities/--memory-gb (train/hetero.py)
    else:
        cfg = prepare_hetero(cfg, int(os.environ["WORLD_SIZE"]), worker=True)
    results = launch(train_worker, (cfg.to_dict(),), nproc=cfg.nproc,
                     run_id=f"subnetdp-{int(time.time())}", max_restarts=cfg.max_restarts,
                     start_method=start_method)
    stopped = [r["error"] for r in results.values() if isinstance(r, dict) and "error" in r]
    if stopped:
        raise NonFiniteLossError(stopped[0])
    summary_path = Path(cfg.out) / "summary.json"
    return json.loads(summary_path.read_text()) if summary_path.exists() else {}
