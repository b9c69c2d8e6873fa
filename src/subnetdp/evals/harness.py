"""Run lm-evaluation-harness on a Hugging Face model (a folder, or a model in memory) and
summarise per task.

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

import logging
import os
import random
import statistics
from pathlib import Path
from typing import Any

from subnetdp.evals.tasks import (
    LM_EVAL_INSTALL,
    PREFIX,
    TASK_DIR,
    LmEvalMissingError,
    check_data,
    check_tasks,
)

METRICS = ("acc", "acc_norm")
MIN_LENGTH = 128


def _offline() -> None:
    # Before datasets/transformers/lm_eval import: they read these once.
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")


def _require() -> None:
    """Import lm-eval and transformers (a one-line error if missing) and quiet them."""
    try:
        import lm_eval  # noqa: F401  (only: is it there)
        import transformers
    except ImportError as e:
        raise LmEvalMissingError(
            f"lm-evaluation-harness is not installed ({e}); {LM_EVAL_INSTALL}") from e
    # lm-eval warns once per truncated request (the module docstring says what truncation
    # does) and once that it was handed a model object; the tokenizer, of every long document
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()


def evaluate_downstream(model_dir: str | Path, tasks: list[str], *, limit: int | None = None,
                        batch_size: int = 16, device: str = "cpu") -> dict[str, Any]:
    """``{"tasks": {name: {acc, acc_stderr, acc_norm, acc_norm_stderr, chance, n}},
    "macro": {acc, acc_norm, chance}, "limit", "max_length", "model"}`` of the HF folder
    ``model_dir``, evaluated on ``device`` (a torch device name: cpu, cuda)."""
    check_tasks(tasks)
    check_data(tasks)  # a missing data package or task folder is reported before any load
    _offline()
    _require()
    import torch
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                                   dtype=torch.float32)
    model = model.to(device)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    return evaluate_model(model, tokenizer, tasks, limit=limit,
                          batch_size=batch_size) | {"model": str(model_dir)}


def evaluate_model(model: Any, tokenizer: Any, tasks: list[str], *, limit: int | None = None,
                   batch_size: int = 16) -> dict[str, Any]:
    """``evaluate_downstream`` of a model in memory (a ``transformers`` causal LM on its
    device, and its tokenizer), as ``train --eval-tasks`` scores the assembled model: the
    same scoring as of a folder, so the numbers equal those of its export. Leaves the
    process's random streams as they were (lm-eval reseeds them).

    The model object goes to lm-eval's ``HFLM`` (never a folder name, which would let HFLM
    load it its own way and set up a distributed evaluation of its own in a training
    process)."""
    check_tasks(tasks)
    check_data(tasks)
    _offline()
    _require()
    import lm_eval
    import numpy as np
    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    max_length = max(int(getattr(model.config, "max_position_embeddings", MIN_LENGTH)),
                     MIN_LENGTH)
    was_training = model.training
    model.eval()
    py_state, np_state = random.getstate(), np.random.get_state()
    devices = [model.device] if model.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size,
                      max_length=max_length)
            out = lm_eval.simple_evaluate(
                model=lm, tasks=[PREFIX + t for t in tasks], limit=limit, log_samples=True,
                task_manager=TaskManager(include_defaults=False, include_path=str(TASK_DIR)),
                bootstrap_iters=0)
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
            model.train(was_training)
    assert out is not None  # None only on non-zero ranks of a distributed evaluation
    per_task: dict[str, dict[str, float]] = {}
    for name in tasks:
        key = PREFIX + name
        res, samples = out["results"][key], out["samples"][key]
        row = {m: float(res[f"{m},none"]) for m in METRICS}
        row |= {f"{m}_stderr": _float(res.get(f"{m}_stderr,none")) for m in METRICS}
        row["chance"] = statistics.fmean(1.0 / len(s["arguments"]) for s in samples)
        row["n"] = float(len(samples))
        per_task[name] = row
    macro = {k: statistics.fmean(r[k] for r in per_task.values())
             for k in (*METRICS, "chance")}
    return {"limit": limit, "max_length": max_length, "tasks": per_task, "macro": macro}


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
