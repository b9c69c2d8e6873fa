"""The quality study (``subnetdp compare --suite quality``): every strategy, the DDP
regularisation baselines, step- and FLOP-matched budgets, several seeds, on real data."""

from subnetdp.study.runner import CellResult, run_suite
from subnetdp.study.suite import QUALITY, QUICK, Cell, Suite, TaskSpec, enumerate_cells

__all__ = ["QUALITY", "QUICK", "Cell", "CellResult", "Suite", "TaskSpec", "enumerate_cells",
           "run_suite"]
