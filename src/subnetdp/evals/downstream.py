"""``subnetdp eval PATH --tasks ...``: downstream accuracy of a run, checkpoint or HF folder."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
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


def downstream(path: str | Path, tasks: list[str], *, limit: int | None = None
               ) -> dict[str, Any]:
    """Evaluate an HF folder as is, or a run/checkpoint exported to a temporary folder."""
    from subnetdp.evals import evaluate_downstream
    from subnetdp.evals.tasks import data_root
    from subnetdp.hf import export_hf

    p = Path(path)
    if is_hf_folder(p):
        return evaluate_downstream(p, tasks, limit=limit)
    data_root()  # a missing data package is reported before the export
    with tempfile.TemporaryDirectory(prefix="subnetdp-eval-") as tmp:
        info = export_hf(p, Path(tmp) / "hf")
        result = evaluate_downstream(info["out"], tasks, limit=limit)
    return result | {"model": str(p), "checkpoint": info["checkpoint"], "step": info["step"]}


def run_downstream(args: argparse.Namespace) -> int:
    from subnetdp.evals import EvalDataMissingError, LmEvalMissingError, format_table
    from subnetdp.evals.tasks import parse_tasks

    try:
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {args.limit}")
        result = downstream(args.path, parse_tasks(args.tasks), limit=args.limit)
    except (EvalDataMissingError, LmEvalMissingError, ValueError, OSError) as e:
        print(f"subnetdp eval: {e}", file=sys.stderr)
        return 2
    if args.out:
        from subnetdp.metrics.sinks import write_json_atomic

        write_json_atomic(args.out, result)
    print(json.dumps(result) if args.json else format_table(result))
    return 0
