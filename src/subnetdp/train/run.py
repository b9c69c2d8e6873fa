"""Train one run from a ``TrainConfig``: checks before any worker starts, the workers (local
processes, or this process under torchrun), and the run's summary."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from subnetdp.train.config import TrainConfig

START_TIMEOUT_MIN_S = 120.0  # a loaded machine may take a while to start every worker


def run_training(cfg: TrainConfig, *, start_method: str | None = None) -> dict[str, Any]:
    """Train and return the run's summary (read back from ``summary.json``).

    ``start_method`` is ``launch``'s (None: fork). A long-lived caller that trains many runs
    (the quality study) passes ``"forkserver"``: forking from a process whose threads (the
    elastic agent's TCP store) may hold a libc lock can deadlock a worker."""
    # torch, the models and the trainer load when a run starts, not on import
    from subnetdp.train.launch import WorkerFailedError, launch, under_launcher
    from subnetdp.train.resume import NonFiniteLossError, check_fresh_run_dir, preflight_resume
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
        else:
            check_fresh_run_dir(Path(cfg.out))
    logs = Path(cfg.out) / "logs"  # every worker's output and the agent's log
    try:
        # tee: rank 0's progress lines still show here
        results = launch(train_worker, (cfg.to_dict(),), nproc=cfg.nproc,
                         run_id=f"subnetdp-{int(time.time())}", max_restarts=cfg.max_restarts,
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
