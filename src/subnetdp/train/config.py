"""The training run's configuration: one dataclass, resolved against the recipe's defaults."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from subnetdp.plan.objectives import DEFAULT_BALANCE, parse_balance
from subnetdp.strategy import Composition, PlanSpec, RankSpec, Strategy, composition_of

# The longest --collective-timeout: a week, already without practical bound. Far beyond, the
# waits it sets (timedelta, the OS's timed waits; 6x for slow phases) overflow in the workers.
MAX_COLLECTIVE_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass
class TrainConfig:
    recipe: str = "llama-tiny"
    strategy: str = "b-sdp"
    coverage: float = 0.5
    scheme: str = "spread"  # spread | random | balanced (plan/balance.py)
    # balanced: what to balance (plan.objectives: one resource or several joined by "+",
    # measured at the run's batch); every unit keeps >= min_holders holders (any scheme)
    balance: str = DEFAULT_BALANCE
    min_holders: int = 1
    max_groups: int | None = None  # at most K distinct holder sets (plan.schemes.make_plan)
    # Heterogeneous workers (train/hetero.py): each rank's share of the units' cost, or each
    # rank's memory budget in GB (a balanced plan the estimator checks, made before the
    # workers start); either replaces --coverage, and needs a block-level SDP strategy.
    capacities: list[float] | None = None
    memory_gb: list[float] | None = None
    # --memory-gb: MiB each NCCL communicator takes in the estimates (None: NCCL's
    # DEFAULT_COMM_MB on CUDA, 0 on CPU, where gloo runs; estimate.communicators.comm_mem_mb,
    # the same count as `plan --memory-gb`)
    comm_mem_mb: float | None = None
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
    # Losses are read (a host sync) and checked for NaN/inf (a collective) every log_every
    # steps, before every checkpoint and at the end ([Note: log steps] in train/trainer.py).
    log_every: int = 10
    memory_step: int = 3  # measure memory on this step (from 1; after warm-up); -1 disables
    device: str = "auto"  # auto | cpu | cuda
    bucket_cap_mb: float = 25.0
    progress: bool = True
    model_args: dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. {"width": 16}
    # Checkpoints (checkpoint/checkpointer.py): every ckpt_every steps (0 = none but the final
    # one, final_ckpt below), keeping the newest ckpt_keep; resume = a run folder or one of its
    # checkpoints; max_restarts = times torch elastic restarts a failed worker group (it then
    # resumes from the newest checkpoint).
    ckpt_every: int = 0
    ckpt_keep: int = 3
    # final_ckpt = also save the state at the end of the run, with or without ckpt_every (what
    # export, eval and a longer --resume read); False: --no-final-ckpt
    final_ckpt: bool = True
    resume: str | None = None
    max_restarts: int = 0
    # Run folder and re-planning: overwrite = replace an earlier run's files in out
    # (checkpoint/rundir.py); reshard = resume under another world size, coverage or plan
    # (checkpoint/reshard.py); min_nproc = elastic shrink: a run that loses a worker for good goes
    # on with one fewer (down to min_nproc) from its newest checkpoint, resharded
    # (train/elastic.py; None = never shrink).
    overwrite: bool = False
    reshard: bool = False
    min_nproc: int | None = None
    # rescue = on a lost worker, go on from the survivors' copies of the step in flight instead
    # of the newest checkpoint when the plan allows it (train/rescue.py, [Note: rescue])
    rescue: bool = True
    # failure domains (plan/nodes.py): the built-in launcher emulates nnodes nodes (contiguous
    # ranks; under torchrun, its nodes); spread_nodes puts each unit's holders on >= 2 of them
    nnodes: int = 1
    spread_nodes: bool = True
    # grow back (train/grow.py): the launcher starts this many workers, those beyond nproc
    # joining the run at a step boundary (also after an elastic shrink: a restarted worker)
    max_nproc: int | None = None
    # Seconds a collective may wait for a peer before the group stops, naming the silent rank
    # (also bounds worker start-up); evaluation and checkpoint writes get longer
    # (distributed/timeouts.py).
    collective_timeout: float = 300.0
    # DDP baselines (subnet/regularize.py): skip each block with this probability per step
    # (stochastic depth, no rescaling, like b-sdp) and drop whole neuron slots of every layer
    # pair with this probability (inverted dropout); training mode only, ddp only.
    stochastic_depth: float = 0.0
    neuron_dropout: float = 0.0
    # Composition (docs/method.md §7, strategy.Composition): FSDP2 inside holder groups (with ddp:
    # plain FSDP over the world), activation checkpointing per block, and the precision
    # (strategy.DTYPES: fp32, bf16-mixed = bf16 compute with fp32 master state, bf16 = pure);
    # reduce_dtype = the dtype FSDP averages gradients in (None: the master dtype).
    fsdp: bool = False
    ac: bool = False
    compile: bool = False  # torch.compile per block (runtime.compile)
    dtype: str = "fp32"
    reduce_dtype: str | None = None
    # ZeRO inside holder groups (runtime/zero.py): 1 shards the optimizer state over each
    # unit's holders, 2 also the reduced gradients; 0 = off
    zero: int = 0
    # Ecosystem (issue 18): rank 0's TensorBoard / W&B sinks (metrics/tracking.py), periodic
    # validation of the assembled model every eval_every steps (0 = at the end only), the
    # device's peak for mfu(%) (None: from the CUDA device name), TF32 matmuls on CUDA; text
    # from any tokenizer.json, Hugging Face `datasets` (a builder such as json/parquet/text, or
    # a local dataset folder) over data_files, and the documents' text field.
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str | None = None
    eval_every: int = 0
    peak_tflops: float | None = None
    tf32: bool = True
    tokenizer: str | None = None
    dataset: str | None = None
    data_files: list[str] = dataclasses.field(default_factory=list)
    text_field: str = "text"
    # Issue 31: downstream accuracy of the assembled model (lm-eval, evals/), scored on rank 0
    # with each validation (every eval_every steps and at the end) on the first eval_limit
    # documents of each task (None: all); LLaMA recipes only
    eval_tasks: list[str] = dataclasses.field(default_factory=list)
    eval_limit: int | None = None
    # Issue 31: start from a Hugging Face LLaMA folder (train/init_from.py: the recipe, model
    # shape and tokenizer follow it); a restored checkpoint's weights win over it
    init_from: str | None = None
    # Issue 27: a resume that goes on although the corpus changed since the run recorded it
    # (train/data_identity.py); never carried over to the next resume
    accept_new_data: bool = False
    # 2: the shared precision words (strategy.DTYPES); recorded configs without it are
    # version 1, whose dtype "bf16" meant bf16 compute with fp32 master state (now
    # "bf16-mixed"); a --config JSON file without it must read alike in both (config_file.py)
    config_version: int = 2

    def resolved(self) -> TrainConfig:
        """A copy with every None filled from the recipe's defaults, validated."""
        from subnetdp.models import get_recipe

        cfg = dataclasses.replace(self)
        if cfg.init_from and not cfg.resume:  # a resume replays what the run recorded
            from subnetdp.train.init_from import apply_init_from

            cfg = apply_init_from(cfg, {f.name for f in dataclasses.fields(cfg)
                                        if getattr(cfg, f.name) != _default(f)})
        recipe = get_recipe(cfg.recipe)
        d = recipe.defaults
        from subnetdp.train.applies import applies

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

    # [Note: values decoded once]
    # The fields above are the run's file form (config.json, TOML, the command line): the
    # strategy's name and flat options. A run's code reads the values instead, decoded here
    # once per config (and carried along when a config is pickled to a worker): nothing below
    # compares strategy names or rebuilds a Composition. A config is not edited after its
    # values are read (``dataclasses.replace`` makes a new one).
    @functools.cached_property
    def rank_spec(self) -> RankSpec:
        """The run's strategy and composition, checked together."""
        return RankSpec.of(self.strategy, composition_of(self))

    @functools.cached_property
    def plan_spec(self) -> PlanSpec:
        """How the run's plan is made (``subnet.planning.build_plan``)."""
        return PlanSpec.of(self)

    @property
    def strategy_value(self) -> Strategy:
        """The run's ``Strategy`` (``strategy`` is its name, as stored in config.json)."""
        return self.rank_spec.strategy

    def composition(self) -> Composition:
        """How the run's rank is built around its strategy (``parallelize`` reads this)."""
        return self.rank_spec.comp

    def label(self, coverage: float | None = None) -> str:
        """The run's name in summary.json and reports (``strategy.label``)."""
        return self.rank_spec.label(coverage)

    @property
    def checkpoints_unbuilt(self) -> str | None:
        """The baseline whose checkpoints are not built, when this run is one (else None)."""
        if self.strategy_value.is_sdp:
            return None
        if self.fsdp:
            return "the plain FSDP2 baseline (ddp with --fsdp)"
        return "ddp --zero 1 (torch's ZeroRedundancyOptimizer)" if self.zero == 1 else None

    @property
    def save_final(self) -> bool:
        """Save the run's state at its end: ``final_ckpt``, where checkpoints are built (the
        two baselines that have none save nothing by default)."""
        return self.final_ckpt and self.checkpoints_unbuilt is None

    def saves_at(self, step: int) -> bool:
        """A checkpoint is written after ``step``: every ``ckpt_every`` steps, and at the end
        of the run (``save_final``)."""
        every = self.ckpt_every
        return (every > 0 and step % every == 0) or (step == self.steps and self.save_final)

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
                or strategy.neuron_level):
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
        from subnetdp.train.applies import check_applicable

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


def _default(f: dataclasses.Field[Any]) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def config_keys() -> frozenset[str]:
    """The fields of ``TrainConfig``: all that a checkpoint's recorded config may hold
    (``checkpoint.files.read_manifest``)."""
    return frozenset(f.name for f in dataclasses.fields(TrainConfig))


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
    if not strategy.is_sdp or strategy.neuron_level:
        raise ValueError(f"{name} needs block units (--strategy b-sdp or bb-sdp), not "
                         f"{strategy.name}")
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"{name} needs one finite positive value per worker, got {values}")
    if cfg.capacities is not None and max(cfg.capacities) > 1:
        raise ValueError(f"--capacities are shares of the units' cost, in (0, 1]; got "
                         f"{cfg.capacities}")
