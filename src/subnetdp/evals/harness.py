"""Run lm-evaluation-harness on a Hugging Face model folder and summarise per task.

Scores are lm-eval's zero-shot log-likelihood multiple choice: ``acc`` picks the choice with
the highest summed log-probability, ``acc_norm`` divides by its length in bytes first. Each
task's chance level is the mean of 1 / (number of choices) over the documents evaluated, so
a model that guesses scores it in expectation. lm-eval truncates contexts on the left to the
evaluation length: the context the model was trained on (``max_position_embeddings``), but at
least ``MIN_LENGTH`` tokens, since lm-eval cannot score a continuation longer than it (some
HellaSwag endings exceed 32 tokens); rotary positions run past the trained context, the
quality of the scores there is the model's.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from pathlib import Path
from typing import Any

from subnetdp.evals.tasks import LmEvalMissingError, data_root, lm_eval_config

METRICS = ("acc", "acc_norm")
MIN_LENGTH = 128


def _offline() -> None:
    # Before datasets/transformers/lm_eval import: they read these once.
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")


def evaluate_downstream(model_dir: str | Path, tasks: list[str], *, limit: int | None = None,
                        batch_size: int = 16, device: str = "cpu") -> dict[str, Any]:
    """``{"tasks": {name: {acc, acc_stderr, acc_norm, acc_norm_stderr, chance, n}},
    "macro": {acc, acc_norm, chance}, "limit", "max_length", "model"}`` of the HF folder
    ``model_dir``, evaluated on ``device`` (a torch device name: cpu, cuda)."""
    root = data_root()  # a missing data package is reported before anything loads
    configs = [lm_eval_config(t, root) for t in tasks]
    _offline()
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise LmEvalMissingError(
            f"lm-evaluation-harness is not installed ({e}); install it with `make setup` or "
            "`pip install -e '.[eval]'`") from e
    import torch
    import transformers

    # lm-eval warns once per truncated request; the module docstring says what truncation does
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    trained = json.loads((Path(model_dir) / "config.json").read_text())
    max_length = max(int(trained.get("max_position_embeddings", MIN_LENGTH)), MIN_LENGTH)
    lm = HFLM(pretrained=str(model_dir), device=device, batch_size=batch_size,
              dtype=torch.float32, max_length=max_length)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=configs, limit=limit, log_samples=True,
        task_manager=TaskManager(include_defaults=False),
        bootstrap_iters=0)
    assert out is not None  # None only on non-zero ranks of a distributed evaluation
    per_task: dict[str, dict[str, float]] = {}
    for name in tasks:
        key = f"subnetdp_{name}"
        res, samples = out["results"][key], out["samples"][key]
        row = {m: float(res[f"{m},none"]) for m in METRICS}
        row |= {f"{m}_stderr": _float(res.get(f"{m}_stderr,none")) for m in METRICS}
        row["chance"] = statistics.fmean(1.0 / len(s["arguments"]) for s in samples)
        row["n"] = float(len(samples))
        per_task[name] = row
    macro = {k: statistics.fmean(r[k] for r in per_task.values())
             for k in (*METRICS, "chance")}
    return {"model": str(model_dir), "limit": limit, "max_length": max_length,
            "tasks": per_task, "macro": macro}


def _float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):  # lm-eval writes "N/A" where it computed no error
        return float("nan")


def format_table(result: dict[str, Any]) -> str:
    """A plain-text table: one row per task, then the macro average."""
    head = f"{'task':<12} {'n':>6} {'acc':>7} {'acc_norm':>9} {'chance':>7}"
    lines = [head, "-" * len(head)]
    for name, r in result["tasks"].items():
        lines.append(f"{name:<12} {int(r['n']):>6} {r['acc']:>7.4f} {r['acc_norm']:>9.4f} "
                     f"{r['chance']:>7.4f}")
    m = result["macro"]
    lines.append(f"{'macro avg':<12} {'':>6} {m['acc']:>7.4f} {m['acc_norm']:>9.4f} "
                 f"{m['chance']:>7.4f}")
    return "\n".join(lines)
