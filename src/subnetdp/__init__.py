"""subnetdp: Subnetwork Data Parallelism for PyTorch.

Each worker trains a structured subnetwork (some residual blocks, or some neurons) that still
runs from input to loss; each parameter's gradient is averaged only among the workers that
hold it. See ``SubnetDataParallel``, ``subnetdp.plan.make_plan`` and ``subnetdp.parallelize``
(one rank's model for any strategy, baselines included).
"""

from __future__ import annotations

from typing import Any

from subnetdp import _moved

_moved.install()  # old module names of 0.1 still import, for one release

__version__ = "0.1.0"

__all__ = ["SubnetDataParallel", "__version__", "make_plan", "parallelize"]


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
    raise AttributeError(name)
