"""Downstream accuracy (``subnetdp eval PATH --eval-tasks ...``) of a run, checkpoint or HF
folder."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Collection
from pathlib import Path
from typing import Any


def is_hf_folder(path: Path) -> bool:
    """An ``export --format hf`` folder (a run folder also has a config.json: the training
    configuration, without ``model_type``)."""
    config = path / "config.json"
    if not (path.is_dir() and config.is_file() and (path / "model.safetensors").is_file()):
        return False
    try:
        return "model_type" in json.loads(config.read_text())
    except json.JSONDecodeError:
        return False


def downstream(path: str | Path, tasks: list[str], *, config_keys: Collection[str],
               limit: int | None = None, device: str = "cpu") -> dict[str, Any]:
    """Evaluate an HF folder as is, or a run/checkpoint exported to a temporary folder, on
    ``device`` (cpu or cuda). ``config_keys``: ``train.config.config_keys()``, the fields a
    checkpoint's recorded configuration may hold (given by the caller: ``train`` scores
    through this package, so it cannot import ``train``)."""
    from subnetdp.evals import evaluate_downstream
    from subnetdp.evals.tasks import check_data
    from subnetdp.hf import export_hf

    p = Path(path)
    if is_hf_folder(p):
        return evaluate_downstream(p, tasks, limit=limit, device=device)
    check_data(tasks)  # a missing data package or task folder is reported before the export
    with tempfile.TemporaryDirectory(prefix="subnetdp-eval-") as tmp:
        info = export_hf(p, Path(tmp) / "hf", config_keys=config_keys)
        result = evaluate_downstream(info["out"], tasks, limit=limit, device=device)
    return result | {"model": str(p), "checkpoint": info["checkpoint"], "step": info["step"]}
