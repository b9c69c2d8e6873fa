"""``subnetdp eval``: validation loss (and accuracy) of a checkpoint or an exported model;
with ``--tasks``, downstream zero-shot accuracy through lm-evaluation-harness.

The model is the plain model class built from the recipe, loaded strictly with the full
state: the same evaluation as the end of ``subnetdp train`` (same validation batches).
``--tasks`` evaluates a Hugging Face folder (``subnetdp export --format hf``), exporting a
run or checkpoint into a temporary one first (subnetdp.evals).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads when a model is evaluated: `subnetdp plan` parses this module
    import torch


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("eval", help="validation loss/accuracy of a checkpoint or export")
    p.add_argument("path", help="runs/NAME, runs/NAME/checkpoints/step_N or an exported "
                                ".safetensors file")
    p.add_argument("--eval-batches", type=int, default=None,
                   help="validation batches (default: the run's own --eval-batches)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--device", default=None, choices=("auto", "cpu", "cuda"),
                   help="where to evaluate (default: the run's own --device; auto = CUDA "
                        "when available)")
    p.add_argument("--tasks", default=None,
                   help="downstream tasks instead of validation loss, comma-separated: "
                        "arc_easy,boolq,hellaswag,openbookqa,sciq (path may also be an "
                        "`export --format hf` folder)")
    p.add_argument("--limit", type=int, default=None,
                   help="--tasks: only the first N documents of each task")
    p.add_argument("--out", default=None, help="--tasks: also write the result to this JSON file")


def load_model_state(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The full state and ``{"recipe", "model_overrides", "config", "step"}`` of a checkpoint
    (verified against its checksums) or of an export file."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from subnetdp.checkpoint.files import (
        assemble_full_state,
        read_manifest,
        resolve_checkpoint,
        verify_files,
    )
    from subnetdp.commands.export_cmd import EXPORT_FORMAT

    p = Path(path)
    if p.is_file():
        try:
            with safe_open(str(p), framework="pt") as f:
                meta = dict(f.metadata() or {})
            state = load_file(str(p))
        except Exception as e:  # safetensors' own error types for a bad header/body
            raise ValueError(f"{p} cannot be read as safetensors ({e}); it is truncated or "
                             "not a model file") from e
        if meta.get("format") != EXPORT_FORMAT:
            raise ValueError(f"{p} was not written by `subnetdp export` (no recipe/config in "
                             "its metadata); evaluate the run's checkpoint instead")
        info = {"recipe": meta["recipe"], "model_overrides": json.loads(meta["model_overrides"]),
                "config": json.loads(meta["config"]), "step": int(meta["step"])}
        return state, info
    ckpt = resolve_checkpoint(p)
    manifest = read_manifest(ckpt)
    verify_files(ckpt, manifest)
    info = {k: manifest[k] for k in ("recipe", "model_overrides", "config", "step")}
    return assemble_full_state(ckpt, manifest), info


def evaluate_path(path: str | Path, *, eval_batches: int | None = None,
                  device: str | None = None) -> dict[str, float]:
    from subnetdp.models import get_recipe
    from subnetdp.train.config import TrainConfig
    from subnetdp.train.device import run_device
    from subnetdp.train.tasks import make_task

    state, info = load_model_state(path)
    cfg = TrainConfig.from_dict(info["config"])
    if eval_batches is not None:
        if eval_batches < 1:
            raise ValueError(f"--eval-batches must be >= 1, got {eval_batches}")
        cfg.eval_batches = eval_batches
    if device is not None:
        cfg.device = device
    dev = run_device(cfg)
    model = get_recipe(info["recipe"]).build_model(**info["model_overrides"])
    model.load_state_dict(state)
    result = make_task(cfg).evaluate(model.to(dev), dev)
    return {"step": float(info["step"]), **result}


def run(args: argparse.Namespace) -> int:
    from subnetdp.data import DatasetMissingError

    if args.tasks is not None:
        from subnetdp.evals.downstream import run_downstream

        return run_downstream(args)
    try:
        result = evaluate_path(args.path, eval_batches=args.eval_batches, device=args.device)
    except (ValueError, OSError, DatasetMissingError) as e:
        print(f"subnetdp eval: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        rest = "  ".join(f"{k} {v:.4f}" for k, v in result.items() if k != "step")
        print(f"step {int(result['step'])}  {rest}")
    return 0
