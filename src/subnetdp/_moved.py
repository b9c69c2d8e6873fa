"""Modules that moved after 0.1.0 (``docs/architecture.md``), importable under their old
names for one release.

An old name imports the new module and is that same module object (so patching
``subnetdp.train.launch.launch`` patches the real one), with a ``DeprecationWarning``. Only
strings here: this module imports nothing of subnetdp until an old name is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "MOVED_NAMES", "install", "moved_name"]

# old module -> new module; drop this table in the release after next.
MOVED: dict[str, str] = {
    "subnetdp.train.launch": "subnetdp.distributed.launch",
    "subnetdp.train.timeouts": "subnetdp.distributed.timeouts",
    "subnetdp.train.signals": "subnetdp.distributed.signals",
    "subnetdp.train.ckpt_io": "subnetdp.checkpoint.files",
    "subnetdp.train.checkpoint": "subnetdp.checkpoint.checkpointer",
    "subnetdp.train.reshard": "subnetdp.checkpoint.reshard",
    "subnetdp.train.rundir": "subnetdp.checkpoint.rundir",
    "subnetdp.bench.strategies": "subnetdp.estimate.spec",
    "subnetdp.bench.estimate": "subnetdp.estimate.memory",
    "subnetdp.bench.comm": "subnetdp.estimate.comm",
    "subnetdp.bench.budget": "subnetdp.estimate.budget",
    "subnetdp.bench.hetero": "subnetdp.estimate.hetero",
    "subnetdp.commands.downstream": "subnetdp.evals.downstream",
}

# (module, name) -> the module that holds the name now (library code that left the CLI,
# process-group set-up that left the launcher). The old module answers for it from its
# ``__getattr__`` through ``moved_name``.
MOVED_NAMES: dict[tuple[str, str], str] = {
    ("subnetdp.commands.export_cmd", "EXPORT_FORMAT"): "subnetdp.checkpoint.export",
    ("subnetdp.commands.export_cmd", "export_checkpoint"): "subnetdp.checkpoint.export",
    ("subnetdp.commands.eval_cmd", "load_model_state"): "subnetdp.checkpoint.export",
    ("subnetdp.commands.eval_cmd", "evaluate_path"): "subnetdp.train.evaluation",
    ("subnetdp.distributed.launch", "init_distributed"): "subnetdp.distributed.process_group",
    ("subnetdp.distributed.launch", "shutdown_distributed"): "subnetdp.distributed.process_group",
}


def moved_name(module: str, name: str) -> Any:
    """For an old module's ``__getattr__``: ``name`` from its new module, with a
    ``DeprecationWarning``."""
    new = MOVED_NAMES.get((module, name))
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(f"{module}.{name} moved to {new}.{name}; the old name goes in the next "
                  "release", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(new), name)


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new}; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)  # warn() skips importlib's frames
        # The import system keeps an existing module's __name__, __spec__ and __file__.
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the new module is already executed


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once): the old files are gone, so only it
    can answer for an old name."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
