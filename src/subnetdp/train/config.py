"""The training run's configuration: ``TrainConfig``, its options (declared in
``train.options``) checked and resolved against the recipe's defaults."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from subnetdp.plan.objectives import parse_balance
from subnetdp.strategy import REDUCE_DTYPES, local_steps_problems
from subnetdp.train.applies import applies, check_applicable
from subnetdp.train.options import TrainOptions, declared
from subnetdp.train.options import default as option_default

# The longest --collective-timeout: a week, already without practical bound. Far beyond, the
# waits it sets (timedelta, the OS's timed waits; 6x for slow phases) overflow in the workers.
MAX_COLLECTIVE_TIMEOUT_S = 7 * 24 * 3600.0


class TrainConfig(TrainOptions):
    """A run's options (``train.options``: each declared once) with their checks
    (``validate``) and the recipe's defaults (``resolved``)."""

    def resolved(self) -> TrainConfig:
        """A copy with every None filled from the recipe's defaults, validated."""
        from subnetdp.models import get_recipe

        cfg = dataclasses.replace(self)
        if cfg.init_from and not cfg.resume:  # a resume replays what the run recorded
            from subnetdp.train.init_from import apply_init_from

            cfg = apply_init_from(cfg, {f.name for f in declared()
                                        if getattr(cfg, f.name) != option_default(f.name)})
        recipe = get_recipe(cfg.recipe)
        d = recipe.defaults
        for name in ("batch_size", "seq_len", "lr", "warmup", "weight_decay", "grad_clip",
                     "vocab_size"):
            # a run records only values that act on it (a replay would refuse the others)
            if getattr(cfg, name) is None and applies(cfg, name):
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

        strategy = self.rank_spec.strategy  # checks the composition too
        if self.plan_file is not None and not strategy.is_sdp:
            bad("--plan-file needs an SDP strategy (ddp holds the whole model); drop it")
        parse_balance(self.balance)  # a PlanError (ValueError) that says what is allowed
        if self.capacities is not None or self.memory_gb is not None:
            _check_hetero(self)
        if self.comm_mem_mb is not None:
            from subnetdp.estimate.communicators import check_comm_mem_mb

            check_comm_mem_mb(self.comm_mem_mb)
        if self.min_holders < 1:
            bad(f"--min-holders must be >= 1, got {self.min_holders}")
        _check_machines(self)
        if self.max_groups is not None and (
                self.max_groups < 1 or self.plan_spec.balanced or self.memory_gb is not None
                or strategy.splits_layers):
            bad(f"--max-groups K (K >= 1, got {self.max_groups}) tiles a spread or random "
                "block plan: drop it with --scheme balanced, --capacities, --memory-gb or "
                "n-sdp/nb-sdp")
        if self.neuron_groups is not None and self.neuron_groups < 1:
            bad(f"--neuron-groups must be >= 1, got {self.neuron_groups}")
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
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            bad(f"--lr must be a finite number > 0, got {self.lr}")
        for flag, value in (("--warmup", self.warmup), ("--grad-clip", self.grad_clip),
                            ("--weight-decay", self.weight_decay)):
            if value is not None and not (math.isfinite(value) and value >= 0):
                bad(f"{flag} must be a finite number >= 0 (0 = off), got {value}")
        for key, value in self.model_args.items():  # JSON and TOML both read nan and inf
            if isinstance(value, float) and not math.isfinite(value):
                bad(f"--model-arg {key}={value}: not a finite number; give a finite {key}")
        if self.seed < 0:  # numpy's generators refuse negative seeds
            bad(f"--seed must be >= 0, got {self.seed}")
        if self.vocab_size is not None and self.vocab_size < 2:
            bad(f"--vocab-size must be >= 2, got {self.vocab_size}")
        if not (math.isfinite(self.bucket_cap_mb) and self.bucket_cap_mb > 0):
            bad(f"--bucket-cap-mb must be a finite number > 0, got {self.bucket_cap_mb}")
        if not 0 < self.collective_timeout <= MAX_COLLECTIVE_TIMEOUT_S:
            bad(f"--collective-timeout must be a number of seconds in (0, "
                f"{MAX_COLLECTIVE_TIMEOUT_S:g}] (a week), got {self.collective_timeout:g}")
        if self.device not in ("auto", "cpu", "cuda"):
            bad(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.log_every < 1:
            bad(f"--log-every must be >= 1, got {self.log_every}")
        if self.eval_batches < 1:
            bad(f"--eval-batches must be >= 1, got {self.eval_batches}")
        if self.ckpt_every < 0:
            bad(f"--ckpt-every must be >= 0 (0: only the final checkpoint), got "
                f"{self.ckpt_every}")
        if self.ckpt_keep < 1:
            bad(f"--ckpt-keep must be >= 1, got {self.ckpt_keep}")
        if self.max_restarts < 0:
            bad(f"--max-restarts must be >= 0, got {self.max_restarts}")
        for name, p in (("--stochastic-depth", self.stochastic_depth),
                        ("--neuron-dropout", self.neuron_dropout)):
            if not 0.0 <= p < 1.0:
                bad(f"{name} must be in [0, 1), got {p}")
            if p > 0 and strategy.is_sdp:
                bad(f"{name} is a DDP baseline; use it with --strategy ddp")
        self._validate_composition(bad)
        self._validate_local_steps(bad)
        self._validate_ecosystem(bad)
        if strategy.backward_masked and self.ckpt_every % self.refresh_every:
            # Between refreshes non-holders hold stale copies that no shard records, so only
            # a checkpoint right after a refresh step resumes exactly.
            bad(f"--ckpt-every ({self.ckpt_every}) must be a multiple of --refresh-every "
                f"({self.refresh_every}) under {self.strategy}")

    def _validate_ecosystem(self, bad: Any) -> None:
        from subnetdp.metrics.tracking import check_sinks

        check_sinks(tensorboard=self.tensorboard, wandb=self.wandb or bool(self.wandb_project))
        if self.eval_every < 0:
            bad(f"--eval-every must be >= 0 (0 = at the end only), got {self.eval_every}")
        if self.peak_tflops is not None and not (math.isfinite(self.peak_tflops)
                                                 and self.peak_tflops > 0):
            bad(f"--peak-tflops must be a finite number > 0, got {self.peak_tflops}")
        if self.wandb_project is not None and not self.wandb_project.strip():
            bad("--wandb-project needs a project name, got an empty one; drop it for the "
                "default (subnetdp)")
        if (self.dataset or self.data_files) and self.data_dir:
            bad("--dataset/--data-files and --data-dir are two sources of text; pick one")
        if self.eval_tasks or self.eval_limit is not None:
            self._validate_eval_tasks(bad)

    def _validate_eval_tasks(self, bad: Any) -> None:
        from subnetdp.evals.tasks import LmEvalMissingError, check_available, check_tasks
        check_applicable(self, only=("eval_tasks", "eval_limit"))  # the Python API's too
        check_tasks(self.eval_tasks)
        if self.eval_limit is not None and self.eval_limit < 1:
            bad(f"--eval-limit must be >= 1, got {self.eval_limit}")
        if self.tokenizer not in (None, "gpt2") and Path(self.tokenizer).expanduser().is_file():
            from tokenizers import Tokenizer

            from subnetdp.data.tokenizer import EOT

            if Tokenizer.from_file(str(Path(self.tokenizer).expanduser())).token_to_id(EOT) is None:
                bad(f"--eval-tasks scores the model as `export --format hf` writes it, which "
                    f"needs {EOT} in the tokenizer; {self.tokenizer} has none: add it to its "
                    "added_tokens, or drop --eval-tasks")
        try:
            check_available(self.eval_tasks)  # before any worker starts, not at an evaluation
        except LmEvalMissingError as e:  # an ImportError: the error boundary reads ValueError
            bad(str(e))

    def _validate_local_steps(self, bad: Any) -> None:
        """--sync-every and the outer step's options (runtime/local_steps.py)."""
        h = self.sync_every
        for problem in local_steps_problems(h, self.sync_fragments, zero=self.zero,
                                            fsdp=self.fsdp):
            bad(problem)
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0
                and 0 <= self.outer_momentum < 1):
            bad(f"--outer-lr must be > 0 and --outer-momentum in [0, 1), got "
                f"{self.outer_lr} and {self.outer_momentum}")
        if self.outer_dtype not in (None, *REDUCE_DTYPES):
            bad(f"--outer-dtype must be one of {', '.join(REDUCE_DTYPES)}, got "
                f"{self.outer_dtype!r}")
        if h == 1:
            return
        if self.eval_every % h:  # the model evaluated is the holders' common one
            bad(f"--eval-every ({self.eval_every}) must be a multiple of --sync-every ({h})")
        every = h * self.refresh_every
        if self.strategy_value.backward_masked and self.ckpt_every % every:
            # non-holders' copies are the owners' at a refresh, which follows a sync
            bad(f"--ckpt-every ({self.ckpt_every}) must be a multiple of --sync-every x "
                f"--refresh-every ({every}) under {self.strategy}")

    def _validate_composition(self, bad: Any) -> None:
        """What ``Composition.check`` cannot see: the run's regularisers and checkpoints."""
        if self.ac and (self.stochastic_depth or self.neuron_dropout):
            bad("--ac does not combine with --stochastic-depth/--neuron-dropout: their masks "
                "come from their own generator, so a recomputed block would draw new ones")
        if self.zero and not self.strategy_value.is_sdp:
            if self.stochastic_depth or self.neuron_dropout:
                bad("--stochastic-depth/--neuron-dropout are torch DDP baselines; drop --zero")
            if self.zero == 1 and (self.ckpt_every or self.resume):
                bad("checkpoints of ddp --zero 1 (torch's ZeroRedundancyOptimizer) are not "
                    "built: use --ckpt-every 0, or --zero 2")
        if not self.fsdp:
            return
        if (self.ckpt_every or self.resume) and not self.strategy_value.is_sdp:
            bad("checkpoints of the plain FSDP2 baseline (ddp with --fsdp) are not built: "
                "checkpoint an SDP strategy with --fsdp, or ddp without it")
        if self.stochastic_depth or self.neuron_dropout:
            bad("--stochastic-depth/--neuron-dropout are torch DDP baselines; drop --fsdp")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        return cls(**upgrade_config(d))


CONFIG_VERSION = 2


def upgrade_config(d: dict[str, Any]) -> dict[str, Any]:
    """A recorded configuration (config.json, a manifest, an export) in today's words: one
    without ``config_version`` is version 1, whose dtype "bf16" meant bf16 compute with fp32
    master state (now "bf16-mixed"); a version newer than this subnetdp knows is refused."""
    d = dict(d)
    version = d.setdefault("config_version", 1)
    if version == 1:
        if d.get("dtype") == "bf16":
            d["dtype"] = "bf16-mixed"
        d["config_version"] = CONFIG_VERSION
    elif version != CONFIG_VERSION:
        why = ("it was written by a newer subnetdp; upgrade subnetdp to use it"
               if isinstance(version, int) and version > CONFIG_VERSION else
               "drop it to read the file as version 1")
        raise ValueError(f"config_version {version!r} is not one this subnetdp reads (1 to "
                         f"{CONFIG_VERSION}): {why}")
    return d


def config_keys() -> frozenset[str]:
    """The fields of ``TrainConfig``: all that a checkpoint's recorded config may hold
    (``checkpoint.files.read_manifest``)."""
    return frozenset(f.name for f in declared())


def _check_machines(cfg: TrainConfig) -> None:
    """What ``TrainConfig.validate`` checks of --nnodes (plan/nodes.py) and --max-nproc
    (train/grow.py)."""
    if cfg.max_nproc is not None and cfg.max_nproc < cfg.nproc:
        raise ValueError(f"--max-nproc must be >= --nproc ({cfg.nproc}), got {cfg.max_nproc}")
    if not 1 <= cfg.nnodes <= cfg.nproc:
        raise ValueError(f"--nnodes must be between 1 and --nproc ({cfg.nproc}), got "
                         f"{cfg.nnodes}")


def _check_hetero(cfg: TrainConfig) -> None:
    """What ``TrainConfig.validate`` checks for --capacities/--memory-gb (world-free; the
    rest is ``train.hetero.prepare_hetero``)."""
    if cfg.capacities is not None and cfg.memory_gb is not None:
        raise ValueError("give --capacities or --memory-gb, not both")
    name = "--capacities" if cfg.capacities is not None else "--memory-gb"
    values = cfg.capacities if cfg.capacities is not None else cfg.memory_gb
    assert values is not None
    if cfg.plan_file is not None:
        raise ValueError(f"{name} makes the plan; drop --plan-file (or {name})")
    strategy = cfg.strategy_value
    if not strategy.balanceable:
        raise ValueError(f"{name} needs block units (--strategy b-sdp or bb-sdp), not "
                         f"{strategy.name}")
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"{name} needs one finite positive value per worker, got {values}")
    if cfg.capacities is not None and max(cfg.capacities) > 1:
        raise ValueError(f"--capacities are shares of the units' cost, in (0, 1]; got "
                         f"{cfg.capacities}")
