"""The training run's configuration: one dataclass, resolved against the recipe's defaults."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

STRATEGIES = ("ddp", "b-sdp", "n-sdp", "bb-sdp", "nb-sdp")
DTYPES = ("fp32", "bf16")


@dataclass
class TrainConfig:
    recipe: str = "llama-tiny"
    strategy: str = "b-sdp"
    coverage: float = 0.5
    scheme: str = "spread"
    plan_file: str | None = None  # a plan JSON (e.g. from `subnetdp plan --json`) instead
    # n-sdp: groups per layer pair (None = neurons.default_groups: the world size or a multiple
    # of it), which pair kinds to split (None = all the model declares, e.g. "ffn,heads"),
    # rotate the spread window by layer, and output scaling of kept hidden units ("none" or
    # "keep" = 1/keep-rate while training).
    neuron_groups: int | None = None
    neuron_kinds: str | None = None
    rotate: bool = False
    output_scaling: str | None = None  # None: "keep" for n-sdp (measured), else "none"
    # bb-sdp/nb-sdp: refresh non-held units from their owners every this many steps (1 = exact)
    refresh_every: int = 1
    seed: int = 0
    steps: int = 300
    nproc: int = 1
    out: str = "runs/default"
    # None = the recipe's default
    batch_size: int | None = None
    seq_len: int | None = None
    lr: float | None = None
    warmup: int | None = None
    weight_decay: float | None = None
    grad_clip: float | None = None
    vocab_size: int | None = None
    data_dir: str | None = None
    eval_batches: int = 40
    log_every: int = 10
    memory_step: int = 3  # measure memory on this step (after warm-up); -1 disables
    device: str = "auto"  # auto | cpu | cuda
    bucket_cap_mb: float = 25.0
    progress: bool = True
    model_args: dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. {"width": 16}
    # Checkpoints (train/checkpoint.py): every ckpt_every steps and at the end (0 = never),
    # keeping the newest ckpt_keep; resume = a run folder or one of its checkpoints;
    # max_restarts = times torch elastic restarts a failed worker group (it then resumes from
    # the newest checkpoint).
    ckpt_every: int = 0
    ckpt_keep: int = 3
    resume: str | None = None
    max_restarts: int = 0
    # DDP baselines (subnet/regularize.py): skip each block with this probability per step
    # (stochastic depth, no rescaling, like b-sdp) and drop whole neuron slots of every layer
    # pair with this probability (inverted dropout); training mode only, ddp only.
    stochastic_depth: float = 0.0
    neuron_dropout: float = 0.0
    # Composition (method.md §7): FSDP2 inside holder groups (with ddp: plain FSDP over the
    # world), activation checkpointing per block, and the compute dtype: "bf16" = bf16 compute
    # with fp32 master weights and optimizer state; reduce_dtype = the dtype FSDP averages
    # gradients in (None: fp32).
    fsdp: bool = False
    ac: bool = False
    dtype: str = "fp32"
    reduce_dtype: str | None = None

    def resolved(self) -> TrainConfig:
        """A copy with every None filled from the recipe's defaults, validated."""
        from subnetdp.models import get_recipe

        recipe = get_recipe(self.recipe)
        d = recipe.defaults
        cfg = dataclasses.replace(self)
        for name in ("batch_size", "seq_len", "lr", "warmup", "weight_decay", "grad_clip",
                     "vocab_size"):
            if getattr(cfg, name) is None:
                setattr(cfg, name, d.get(name))
        if cfg.warmup is None:
            cfg.warmup = 0
        if cfg.grad_clip is None:
            cfg.grad_clip = 0.0
        cfg.validate(recipe.task)
        return cfg

    def validate(self, task: str) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if self.strategy not in STRATEGIES:
            bad(f"--strategy {self.strategy!r} is not available; choose one of {STRATEGIES}")
        if self.neuron_groups is not None and self.neuron_groups < 1:
            bad(f"--neuron-groups must be >= 1, got {self.neuron_groups}")
        if self.output_scaling not in (None, "none", "keep"):
            bad(f"--output-scaling must be none or keep, got {self.output_scaling!r}")
        if self.output_scaling == "keep" and self.strategy != "n-sdp":
            bad("--output-scaling applies to --strategy n-sdp only")
        if self.refresh_every < 1:
            bad(f"--refresh-every must be >= 1 (1 = exact), got {self.refresh_every}")
        if not 0.0 < self.coverage <= 1.0:
            bad(f"--coverage must be in (0, 1], got {self.coverage}")
        if self.steps < 1:
            bad(f"--steps must be >= 1, got {self.steps}")
        if self.nproc < 1:
            bad(f"--nproc must be >= 1, got {self.nproc}")
        if self.batch_size is not None and self.batch_size < 1:
            bad(f"--batch-size must be >= 1, got {self.batch_size}")
        if task == "lm" and self.seq_len is not None and self.seq_len < 2:
            bad(f"--seq-len must be >= 2, got {self.seq_len}")
        if self.lr is not None and self.lr <= 0:
            bad(f"--lr must be > 0, got {self.lr}")
        if self.device not in ("auto", "cpu", "cuda"):
            bad(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.eval_batches < 1:
            bad(f"--eval-batches must be >= 1, got {self.eval_batches}")
        if self.ckpt_every < 0:
            bad(f"--ckpt-every must be >= 0 (0 = no checkpoints), got {self.ckpt_every}")
        if self.ckpt_keep < 1:
            bad(f"--ckpt-keep must be >= 1, got {self.ckpt_keep}")
        if self.max_restarts < 0:
            bad(f"--max-restarts must be >= 0, got {self.max_restarts}")
        for name, p in (("--stochastic-depth", self.stochastic_depth),
                        ("--neuron-dropout", self.neuron_dropout)):
            if not 0.0 <= p < 1.0:
                bad(f"{name} must be in [0, 1), got {p}")
            if p > 0 and self.strategy != "ddp":
                bad(f"{name} is a DDP baseline; use it with --strategy ddp")
        self._validate_composition(bad)
        if (self.strategy in ("bb-sdp", "nb-sdp") and self.ckpt_every % self.refresh_every):
            # Between refreshes non-holders hold stale copies that no shard records, so only
            # a checkpoint right after a refresh step resumes exactly.
            bad(f"--ckpt-every ({self.ckpt_every}) must be a multiple of --refresh-every "
                f"({self.refresh_every}) under {self.strategy}")

    def _validate_composition(self, bad: Any) -> None:
        if self.dtype not in DTYPES:
            bad(f"--dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.reduce_dtype is not None and self.reduce_dtype not in DTYPES:
            bad(f"--reduce-dtype must be one of {tuple(DTYPES)}, got {self.reduce_dtype!r}")
        if self.ac and (self.stochastic_depth or self.neuron_dropout):
            bad("--ac does not combine with --stochastic-depth/--neuron-dropout: their masks "
                "come from their own generator, so a recomputed block would draw new ones")
        if self.reduce_dtype is not None and not self.fsdp:
            bad("--reduce-dtype needs --fsdp (without it gradients are averaged in fp32)")
        if not self.fsdp:
            return
        if self.strategy == "nb-sdp":
            bad("--fsdp does not compose with nb-sdp (a partly held layer would need one mesh "
                "per neuron group); use n-sdp, b-sdp or bb-sdp")
        if self.ckpt_every or self.resume:
            bad("--fsdp runs cannot write or resume checkpoints yet; drop --ckpt-every/--resume "
                "or --fsdp")
        if self.stochastic_depth or self.neuron_dropout:
            bad("--stochastic-depth/--neuron-dropout are torch DDP baselines; drop --fsdp")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        return cls(**d)
