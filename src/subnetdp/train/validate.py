"""Checks a run passes in the launching process, before any worker starts.

Everything a worker would otherwise discover minutes in (and report as a traceback from every
rank) is checked here on the meta device: the model arguments, the plan against the model,
the data against the batch and the vocabulary, the device and the run folder. Each check raises
``ValueError`` with a message that says how to fix the input; nothing is written.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from subnetdp.plan import Plan
from subnetdp.train.config import TrainConfig

__all__ = ["check_out_writable", "preflight"]


def preflight(cfg: TrainConfig, task: Any, plan: Plan | None = None) -> Plan:
    """``cfg`` resolved and validated, ``task`` its ``make_task``: raise before launch.
    Returns the plan the workers will run (checked against the model): ``plan`` (e.g. the
    --memory-gb budget plan), else the run's own, read or built here once."""
    from subnetdp.models import get_recipe
    from subnetdp.subnet.match import match_plan
    from subnetdp.train.build import run_plan

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine (torch "
                         f"{torch.__version__}); use --device cpu or auto")
    recipe = get_recipe(cfg.recipe)
    overrides = task.model_overrides()
    with torch.device("meta"):
        try:
            model = recipe.build_model(**overrides)
        except TypeError as e:  # e.g. a model class refusing an unknown keyword
            given = " ".join(f"{k}={v!r}" for k, v in cfg.model_args.items())
            raise ValueError(f"--model-arg {given}: {e}") from e
        if plan is None:
            plan = run_plan(cfg, model, recipe, cfg.nproc)
        match_plan(plan, model, recipe.adapter, cfg.strategy_value)
    if recipe.task == "lm":
        _check_tokens(cfg, task, model)
    else:
        _check_images(cfg, task)
    check_out_writable(Path(cfg.out))
    return plan


def _check_tokens(cfg: TrainConfig, task: Any, model: Any) -> None:
    import numpy as np

    assert cfg.seq_len is not None and cfg.batch_size is not None
    data = task.data
    where = f"--data-dir {cfg.data_dir}" if cfg.data_dir else "the packaged corpus"
    # lm_batches draws windows of seq_len + 1 tokens from each rank's contiguous shard
    need = cfg.seq_len + 1
    per_rank = len(data.train) // cfg.nproc
    if per_rank < need:
        raise ValueError(f"{where} has {len(data.train)} training tokens: {per_rank} per "
                         f"worker, fewer than one sequence of --seq-len {cfg.seq_len} + 1; add "
                         "text, or lower --seq-len or --nproc")
    if len(data.val) < need:
        docs = f" ({data.n_train_docs + data.n_val_docs} document(s))" if data.tokenizer_path \
            else ""
        raise ValueError(f"{where}{docs} leaves {len(data.val)} validation tokens, fewer than "
                         f"one sequence of --seq-len {cfg.seq_len} + 1; evaluation would fail "
                         "after training. Add documents (about 2% are held out) or a val.bin, "
                         "or lower --seq-len")
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or data.vocab_size)
    for name, split in (("train", data.train), ("val", data.val)):
        top = int(np.max(split)) if len(split) else -1
        if top >= vocab:
            raise ValueError(f"{where}: {name} token id {top} is outside the model's vocabulary "
                             f"of {vocab}; set the vocabulary in meta.json (vocab_size) or "
                             "--model-arg vocab_size=N above the largest id")


def _check_images(cfg: TrainConfig, task: Any) -> None:
    assert cfg.batch_size is not None
    n = len(task.train_y)
    if (n // cfg.nproc) // cfg.batch_size < 1 or len(task.test_y) < 1:
        raise ValueError(f"the image data has {n} training and {len(task.test_y)} test samples; "
                         f"too few for one batch of --batch-size {cfg.batch_size} on each of "
                         f"{cfg.nproc} workers; add data or lower --batch-size or --nproc")


def check_out_writable(out: Path) -> None:
    """``out`` is (or can become) a folder we can write to; nothing is left behind."""
    parent = out
    while not parent.exists():
        if parent.parent == parent:
            break
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--out {out}: {parent} exists and is not a folder; pick another --out")
    try:
        fd, probe = tempfile.mkstemp(prefix=".subnetdp-write-test-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write in {parent} ({e.strerror}); pick a "
                         "writable --out") from e
