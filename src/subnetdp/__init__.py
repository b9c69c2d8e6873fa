"""subnetdp: Subnetwork Data Parallelism for PyTorch.

Each worker trains a structured subnetwork (some residual blocks, or some neurons) that still
runs from input to loss; each parameter's gradient is averaged only among the workers that
hold it. See ``SubnetDataParallel``, ``subnetdp.plan.make_plan`` and ``subnetdp.parallelize``
(one rank's model for any strategy, baselines included).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import types
from typing import Any

from subnetdp import _moved

__version__ = "0.1.0"

# The oldest torch subnetdp runs on (pyproject.toml's range; subnetdp.torch_compat, docs/testing.md)
TORCH_FLOOR = (2, 9)


class TorchTooOldError(ImportError):
    """The installed torch is older than ``TORCH_FLOOR``, or missing."""


def _torch_version() -> str | None:
    """The installed torch's version, read without importing torch where its metadata says."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # a source build on the path, say
        if importlib.util.find_spec("torch") is None:
            return None
        import torch

        return str(torch.__version__)


def _check_torch(found: str | None) -> None:
    floor = ".".join(map(str, TORCH_FLOOR))
    if found is None or tuple(int(x) for x in found.split(".")[:2]) < TORCH_FLOOR:
        raise TorchTooOldError(f"subnetdp needs torch >= {floor} (found {found or 'none'}): "
                               f"pip install 'torch>={floor}'")


def _one_line(hook: Any) -> Any:
    """``sys.excepthook`` that prints a ``TorchTooOldError`` as its one line (a command's
    import of subnetdp raises it), and hands anything else to ``hook``."""
    def excepthook(kind: type[BaseException], error: BaseException, tb: Any) -> None:
        if isinstance(error, TorchTooOldError):
            print(f"error: {error}", file=sys.stderr)
        else:
            hook(kind, error, tb)
    return excepthook


try:
    _check_torch(_torch_version())
except TorchTooOldError:
    sys.excepthook = _one_line(sys.excepthook)
    raise

_moved.install()  # old module names of 0.1 still import, for one release

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
