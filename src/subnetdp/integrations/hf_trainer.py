"""SDP under the Hugging Face ``Trainer`` (docs/integrations.md)::

    trainer = SDPTrainer(model=LlamaForCausalLM(cfg), args=TrainingArguments(
        ..., remove_unused_columns=False), train_dataset=..., strategy="b-sdp",
        plan=PlanSpec(coverage=0.5))
    trainer.train()           # under torchrun (NCCL, or gloo on the CPU); plain python: 1 process
    trainer.save_model(out)   # every rank: the full model, LlamaForCausalLM.from_pretrained(out)

The ``Trainer`` hands the model to accelerate, which would DDP-wrap it (and
``SubnetDataParallel`` refuses a second data-parallel wrapper). ``SDPTrainer`` wraps the
model itself, once, at construction (the process group ``TrainingArguments`` set up):
``self.model`` is then this rank's subnetwork (the blocks it does not hold are identity
layers) and ``_wrap_model`` returns the ``SubnetDataParallel`` over it, a different object, so
that accelerate prepares only the optimizer and the data. What else changes:

- gradient clipping (``max_grad_norm``) and the logged ``grad_norm`` are the full model's
  norm, the same on every rank (``SubnetDataParallel.clip_grad_norm_``);
- ``save_model`` is collective: rank 0 writes the *full* model (assembled from the ranks'
  blocks) as the plain class's folder, with the tokenizer and ``training_args.bin``;
- a checkpoint folder ``checkpoint-N`` holds that full model, and in ``checkpoint-N/sdp/``
  every rank's share of the optimizer state, the scheduler and its RNG (``subnetdp.save``);
  ``train(resume_from_checkpoint=...)`` restores model and optimizer from the shards, exactly;
- ``evaluate``/``predict`` run each rank's subnetwork (its loss, averaged over the ranks); for
  the full model's, load the folder ``save_model`` wrote; gradient accumulation runs the
  wrapper's ``no_sync`` (accelerate calls it).
"""

from __future__ import annotations

import atexit
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

try:
    import transformers
    from transformers import Trainer, TrainingArguments
except ImportError:
    raise ImportError("subnetdp.integrations.hf_trainer needs transformers: pip install "
                      "'subnetdp[hf]'") from None
if not hasattr(Trainer, "_clip_grad_norm"):  # before 5.3 it clipped inline, by one rank's norm
    raise ImportError(f"SDPTrainer needs transformers>=5.3 (tested: 5.3 to 5.25), found "
                      f"{transformers.__version__}: pip install 'subnetdp[hf]'")

from subnetdp.distributed.process_group import one_process_group, shutdown_distributed
from subnetdp.integrations.hf_models import hf_decoder_adapter
from subnetdp.integrations.wrap import SDPOptions
from subnetdp.plan import Plan, PlanError
from subnetdp.runtime.wrapper import SubnetDataParallel
from subnetdp.strategy import Composition, PlanSpec, RankSpec, Strategy
from subnetdp.subnet.adapter import UnitAdapter
from subnetdp.train.script import load, save

__all__ = ["SDPTrainer"]

SHARDS = "sdp"  # the shards' folder inside a checkpoint-N folder


class SDPTrainer(Trainer):
    """A ``Trainer`` that trains ``model`` with ``strategy`` (b-sdp, n-sdp, ... or a
    ``RankSpec``; ``comp``), the plan (a ``PlanSpec``, the CLI's options, or a ``Plan``;
    default coverage 0.5) over the block list that ``auto_adapter`` finds (``blocks=`` a path,
    or ``adapter=``); n-sdp and nb-sdp default to ``hf_decoder_adapter`` (LLaMA-style heads
    and MLP units). ``args`` must say
    ``remove_unused_columns=False`` (the wrapper's forward takes ``**kwargs``)."""

    def __init__(self, model: nn.Module, args: TrainingArguments, *,
                 strategy: RankSpec | Strategy | str = "b-sdp",
                 comp: Composition | None = None, plan: PlanSpec | Plan | None = None,
                 blocks: str | list[str] | None = None, adapter: UnitAdapter | None = None,
                 seed: int = 0, **kwargs: Any) -> None:
        options = SDPOptions.of(strategy, comp=comp, plan=plan, blocks=blocks, adapter=adapter,
                                seed=seed, framework="the Hugging Face Trainer")
        if options.spec.strategy.splits_layers and adapter is None and blocks is None:
            options = replace(options, adapter=hf_decoder_adapter(model))
        if args.remove_unused_columns:
            raise ValueError("SDPTrainer needs TrainingArguments(remove_unused_columns=False): "
                             "the wrapper's forward takes **kwargs, so the Trainer would drop "
                             "every column")
        if args.load_best_model_at_end:
            raise ValueError("SDPTrainer cannot load the best checkpoint into a rank's "
                             "subnetwork: set load_best_model_at_end=False and load the best "
                             "checkpoint-N folder with from_pretrained (it holds the full model)")
        config: Any = getattr(model, "config", None)
        if getattr(config, "use_cache", False):
            config.use_cache = False  # a dropped block cannot fill a KV cache
        device = args.device  # (sets up the process group, under torchrun)
        self.sdp = _wrap(options, model, device)
        super().__init__(model=model, args=args, **kwargs)

    # -- the model: ours, not accelerate's -------------------------------------------------
    def _wrap_model(self, model: nn.Module, training: bool = True,
                    dataloader: Any = None) -> nn.Module:
        del model, training, dataloader
        return self.sdp

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        opt = super().create_optimizer(model)
        trained = {id(p) for p in self.sdp.parameters()}
        if any(id(p) not in trained for g in opt.param_groups for p in g["params"]):
            raise ValueError("the optimizer must train the SDP model's parameters "
                             "(trainer.sdp.parameters()); pass optimizers= built over them")
        return opt

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        del model
        return self.sdp.clip_grad_norm_(float(self.args.max_grad_norm))

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:  # the full model's norm (collective), not this rank's
            grad_norm = self.sdp.clip_grad_norm_(float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # -- saving and resuming -----------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The full model as the plain class's folder (rank 0). Collective: call it on every
        rank."""
        state = self.sdp.full_state_dict()
        if self.args.should_save:
            self._save(output_dir or self.args.output_dir, state_dict=state)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save(Path(output_dir) / SHARDS, self.sdp, self._raw_optimizer(),
             step=self.state.global_step, scheduler=self.lr_scheduler, keep=1)

    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: nn.Module | None = None) -> None:
        """Nothing here: the folder's model is the full one, and this rank's share of it
        comes from the shards, with the optimizer (``_load_optimizer_and_scheduler``)."""
        del model
        if not (Path(resume_from_checkpoint) / SHARDS).is_dir():
            raise FileNotFoundError(f"{resume_from_checkpoint} has no {SHARDS}/ folder: it was "
                                    "not written by SDPTrainer (start from its weights with "
                                    "from_pretrained instead)")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            load(Path(checkpoint) / SHARDS, self.sdp, self._raw_optimizer(),
                 scheduler=self.lr_scheduler)

    def _raw_optimizer(self) -> torch.optim.Optimizer:
        opt: Any = self.optimizer
        raw = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps it
        assert isinstance(raw, torch.optim.Optimizer)
        return raw


def _wrap(options: SDPOptions, model: nn.Module,
          device: torch.device) -> SubnetDataParallel:
    """This rank's ``SubnetDataParallel``; in a process no launcher started (plain
    ``python``, or ``accelerate launch`` without a multi-process setup), over a world of one,
    which only a plan that gives the one process every block fits."""
    if not dist.is_initialized():
        one_process_group("nccl" if device.type == "cuda" else "gloo")
        atexit.register(shutdown_distributed)
    try:
        return options.wrap(model, device)
    except PlanError as e:
        if dist.get_world_size() > 1:
            raise
        raise PlanError(f"SDPTrainer runs in 1 process here: start N >= 2 with `torchrun "
                        "--nproc-per-node N train.py`, or pass plan=PlanSpec(coverage=1.0) to "
                        f"train the whole model in this one ({e})") from None
