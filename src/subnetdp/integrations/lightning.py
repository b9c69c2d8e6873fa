"""SDP as a Lightning 2.x strategy (docs/integrations.md)::

    import subnetdp.integrations.lightning  # registers "sdp"
    trainer = L.Trainer(strategy="sdp", devices=2)  # b-sdp at coverage 0.5, or:
    trainer = L.Trainer(strategy=SDPStrategy("n-sdp", plan=PlanSpec(coverage=0.75),
                                             adapter=...), devices=2)

``SDPStrategy`` is a ``DDPStrategy`` (Lightning's launchers, process group, samplers,
``barrier``/``reduce``) whose model set-up wraps the ``LightningModule`` in
``SubnetDataParallel``: each rank keeps the blocks the plan gives it (found in the module by
``auto_adapter``, or ``blocks=``/``adapter=``), and ``training_step`` runs through the wrapper,
so each gradient is averaged over its block's holders. What else changes:

- gradient clipping by norm (``Trainer(gradient_clip_val=...)``) clips by the *full* model's
  norm (``SubnetDataParallel.clip_grad_norm_``), the same factor on every rank;
- a checkpoint (``trainer.save_checkpoint``, ``ModelCheckpoint``) is Lightning's file, written
  by rank 0 with the *full* model's ``state_dict`` (assembled from the ranks' blocks: it loads
  with ``MyModule.load_from_checkpoint`` into the plain class), plus a folder beside it,
  ``<name>.sdp/``, where every rank writes its share of the optimizer state and its RNG
  through subnetdp's checkpointer (``subnetdp.save``); ``fit(ckpt_path=...)`` restores both,
  exactly. Both must be on a filesystem every rank sees.
- after ``fit`` the module you passed holds this rank's subnetwork (validation *during* fit
  runs each rank's subnetwork); the full model is in the checkpoint (and
  ``strategy.full_state_dict()`` on rank 0): ``MyModule.load_from_checkpoint`` it for
  ``validate``/``test``/``predict`` (the fitted module itself is refused, in one line).

One optimizer, over the module's parameters (``configure_optimizers`` as usual); under the
backward-masked strategies (bb-sdp, nb-sdp) over ``self.trainer.strategy.parameters()``.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError:
    raise ImportError("subnetdp.integrations.lightning needs Lightning 2.x: pip install "
                      "'subnetdp[lightning]'") from None

from subnetdp.integrations.wrap import SDPOptions
from subnetdp.plan import Plan
from subnetdp.runtime.wrapper import SubnetDataParallel
from subnetdp.strategy import Composition, PlanSpec, RankSpec, Strategy
from subnetdp.subnet.adapter import UnitAdapter
from subnetdp.train.script import load, save

__all__ = ["SDPStrategy", "shards_of"]

_SUBNETWORK = "_subnetdp_subnetwork"  # marks a module SDPStrategy has cut to one rank's share


def shards_of(ckpt: str | Path) -> Path:
    """The folder of the ranks' shards beside a Lightning checkpoint file."""
    return Path(ckpt).with_suffix(".sdp")


class SDPStrategy(DDPStrategy):
    """Subnetwork Data Parallelism for Lightning: ``strategy`` (a name such as ``"b-sdp"``,
    or a ``RankSpec``) with ``comp``, the plan (a ``PlanSpec`` as the CLI's options, or a
    ``Plan``; default coverage 0.5), the block list (``blocks=`` a path for ``auto_adapter``,
    or ``adapter=``), ``seed`` (of the plan's blocks' init, for a model on the meta device).
    Other keywords go to ``DDPStrategy`` (``process_group_backend``, ``timeout``, ...)."""

    strategy_name = "sdp"

    def __init__(self, strategy: RankSpec | Strategy | str = "b-sdp", *,
                 comp: Composition | None = None, plan: PlanSpec | Plan | None = None,
                 blocks: str | list[str] | None = None, adapter: UnitAdapter | None = None,
                 seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.options = SDPOptions.of(strategy, comp=comp, plan=plan, blocks=blocks,
                                     adapter=adapter, seed=seed, framework="Lightning")
        self._fitted = False  # fit ended: the full model was assembled (teardown)
        self._full_state: dict[str, torch.Tensor] | None = None  # ... on rank 0
        self._ckpt_path: Path | None = None  # the checkpoint fit() resumes from

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        # (DDPStrategy's would register its own names for this class)
        strategy_registry.register("sdp", cls, description="Subnetwork Data Parallelism "
                                   "(subnetdp): b-sdp at coverage 0.5",
                                   override=True)  # a re-imported module registers again

    @property
    def sdp(self) -> SubnetDataParallel:
        if not isinstance(self.model, SubnetDataParallel):
            raise RuntimeError("the SDP model exists while Trainer.fit runs")
        return self.model

    # -- set-up ----------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        if module is not None and getattr(module, _SUBNETWORK, False):
            # DDP's set-up would broadcast rank 0's subnetwork over other ranks' different ones
            raise ValueError(
                f"this {type(module).__name__} was trained with SDPStrategy and holds one rank's "
                "subnetwork; for validate/test/predict or another fit, load the full model from "
                f"its checkpoint ({type(module).__name__}.load_from_checkpoint(path)) or resume "
                "with fit(ckpt_path=path) on a new module")
        super().setup(trainer)

    def configure_ddp(self) -> None:
        """Called by ``DDPStrategy.setup`` when fitting: the wrapper instead of DDP."""
        assert isinstance(self.model, pl.LightningModule)
        self._fitted, self._full_state = False, None
        setattr(self.model, _SUBNETWORK, True)  # modified in place: see setup
        self.model = self.options.wrap(self.model, self.root_device)
        # Lightning's norm clipping is per rank; holders of one block must scale alike.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(f"SDPStrategy trains with one optimizer; configure_optimizers "
                             f"returned {len(self.optimizers)}")
        trained = {id(p) for p in self.sdp.parameters()}
        for group in self.optimizers[0].param_groups:
            if any(id(p) not in trained for p in group["params"]):
                raise ValueError("the optimizer must train this rank's parameters: build it "
                                 "over self.trainer.strategy.parameters() in "
                                 "configure_optimizers (bb-sdp and nb-sdp freeze or slice "
                                 "the blocks a rank does not hold)")

    def parameters(self) -> Any:
        """What ``configure_optimizers`` should optimize (the rank's trainable parameters)."""
        return self.sdp.parameters()

    def _clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        del optimizer
        self.sdp.clip_grad_norm_(float(clip_val))

    # -- checkpoints -----------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full model's state on rank 0 (collective while fitting), ``{}`` elsewhere."""
        if self._fitted:  # assembled at teardown (rank 0)
            return self._full_state or {}
        if isinstance(self.model, SubnetDataParallel):
            return self.model.full_state_dict() or {}
        return super().lightning_module_state_dict()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full model after ``fit`` (rank 0; None elsewhere), keyed like the module."""
        return self._full_state

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        del optimizer
        return {}  # sharded: in the shards folder (save_checkpoint)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Rank 0 writes Lightning's file (the full model); every rank its shard of the
        optimizer state and its RNG into ``<name>.sdp/``. Collective."""
        if isinstance(self.model, SubnetDataParallel):
            step = int(checkpoint.get("global_step", 0))
            save(shards_of(filepath), self.model, self._optimizer(), step=step, keep=1)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            shutil.rmtree(shards_of(filepath), ignore_errors=True)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        self._ckpt_path = Path(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Lightning loaded the full model into the module before set-up; the shards give
        each rank its optimizer state and RNG back (and its blocks again, the same values)."""
        del checkpoint
        if self._ckpt_path is None:
            raise RuntimeError("internal: no checkpoint path to resume from")
        shards = shards_of(self._ckpt_path)
        if not shards.is_dir():
            raise FileNotFoundError(f"{self._ckpt_path} has no optimizer shards beside it "
                                    f"({shards}/): it was not written by SDPStrategy; load "
                                    "its weights with MyModule.load_from_checkpoint instead")
        load(shards, self.sdp, self._optimizer())

    def _optimizer(self) -> torch.optim.Optimizer:
        [opt] = self.optimizers
        return opt

    # -- the end of fit ----------------------------------------------------------------------
    def teardown(self) -> None:
        """After ``fit``, the full model is assembled on rank 0 (while the process group still
        has the tensors where it expects them): for ``save_checkpoint`` after fit."""
        module = self.lightning_module
        trainer = None if module is None else module._trainer
        # not after an exception: another rank may never get here
        fitted = (trainer is not None and trainer.state.fn == TrainerFn.FITTING
                  and not trainer.interrupted)
        if isinstance(self.model, SubnetDataParallel) and fitted:
            self._full_state, self._fitted = self.model.full_state_dict(), True
        super().teardown()


SDPStrategy.register_strategies(StrategyRegistry)
