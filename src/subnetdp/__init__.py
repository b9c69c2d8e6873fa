"""subnetdp: Subnetwork Data Parallelism for PyTorch.

Each worker trains a structured subnetwork (some residual blocks, or some neurons) that still
runs from input to loss; each parameter's gradient is averaged only among the workers that
hold it. See ``SubnetDataParallel``, ``subnetdp.plan.make_plan`` and ``subnetdp.parallelize``
(one rank's model for any strategy, baselines included).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from subnetdp import _moved

_moved.install()  # old module names of 0.1 still import, for one release

__version__ = "0.1.0"

__all__ = ["SubnetDataParallel", "__version__", "init_distributed", "load", "make_plan",
           "parallelize", "save"]


def __getattr__(name: str) -> Any:  # lazy: `import subnetdp` must not pull torch.distributed
    if name == "SubnetDataParallel":
        from subnetdp.runtime.wrapper import SubnetDataParallel

        return SubnetDataParallel
    if name == "parallelize":
        from subnetdp.parallelize import parallelize

        return parallelize
    if name == "make_plan":
        from subnetdp.plan import make_plan

        return make_plan
    if name in ("init_distributed", "save", "load"):  # for your own script: docs/own-model.md
        from subnetdp.train import script

        return getattr(script, name)
    raise AttributeError(name)


class _Package(types.ModuleType):
    """``subnetdp.parallelize`` is the function, not its module ``subnetdp/parallelize.py``:
    Python binds a submodule on its package when it is first imported (by anyone, e.g.
    ``subnetdp.train``), which would replace the function that ``__getattr__`` gave."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "parallelize" and isinstance(value, types.ModuleType):
            value = value.parallelize
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
