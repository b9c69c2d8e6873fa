"""Resume policy: where a run starts, what a resumed run may change, which metrics lines are
replayed, and stopping a diverged run so that its newest checkpoint stays a good one.

The mechanism (writing and restoring one rank's share exactly) is ``checkpoint``; the file
layout, atomic publish and checksums are ``ckpt_io``. [Note: exact resume] in ``checkpoint``
explains why a resumed run replays the steps after its checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from subnetdp.checkpoint.checkpointer import RunStoppedError, check_compatible
from subnetdp.checkpoint.files import (
    CheckpointError,
    checkpoints_root,
    list_checkpoints,
    newest_checkpoint,
    read_manifest,
    resolve_checkpoint,
    verify_files,
)
from subnetdp.checkpoint.rescue import (
    RescueUnavailableError,
    compose_rescue,
    rescue_root,
    rescue_step,
)
from subnetdp.checkpoint.rundir import hold_run_folder
from subnetdp.filemode import check_no_links, write_atomic
from subnetdp.metrics.sinks import read_jsonl
from subnetdp.train.config import TrainConfig, config_keys
from subnetdp.train.data_identity import Recorded, recorded_in

__all__ = [
    "RESHARD_OVERRIDABLE",
    "RESUME_OVERRIDABLE",
    "NonFiniteLossError",
    "check_fresh_run_dir",
    "drop_replayed_metrics",
    "interrupted_message",
    "not_finite_error",
    "preflight_resume",
    "recorded_data",
    "restart_count",
    "resume_config",
    "resume_source",
    "state_finite",
    "truncate_metrics",
]

# Options a resumed run may change: they do not touch the model, the data or the optimiser's
# maths (``steps`` extends the run; the cosine schedule is then computed for the new length).
RESUME_OVERRIDABLE = frozenset({"steps", "progress", "ckpt_every", "ckpt_keep", "final_ckpt",
                                "max_restarts",
                                "eval_batches", "memory_step", "log_every", "resume",
                                "min_nproc", "max_nproc", "rescue", "collective_timeout",
                                # watching the run (metrics/tracking.py)
                                "tensorboard", "wandb", "wandb_project", "eval_every",
                                "peak_tflops", "eval_tasks", "eval_limit",
                                # the optimizer's layout, not its maths: checkpoints are plain
                                "zero",
                                # the data may have changed: train/data_identity.py
                                "accept_new_data"})
# What --reshard may change besides: the world size and the plan ([Note: resharded resume]).
RESHARD_OVERRIDABLE = frozenset({"nproc", "coverage", "scheme", "balance", "min_holders",
                                 "plan_file", "neuron_groups", "neuron_kinds", "rotate",
                                 "nnodes", "spread_nodes"})


class NonFiniteLossError(RunStoppedError):
    """The loss became NaN or infinite: the run stopped and kept its last good checkpoint."""


# -- where a run starts ------------------------------------------------------------------------
def restart_count() -> int:
    """How many times torch elastic has restarted this worker group (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def resume_source(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint a worker starts from, or None for a fresh start.

    A group restarted by torch elastic (``--max-restarts``) continues from the newest
    checkpoint of its own run: that is the automatic fault recovery."""
    newest = newest_checkpoint(checkpoints_root(run_dir)) if restart_count() > 0 else None
    if newest is not None:
        return newest
    if resume:
        return resolve_checkpoint(resume)
    if restart_count() == 0:
        check_fresh_run_dir(run_dir)
    return None


def interrupted_message(signame: str, out: str | None) -> str:
    """The launching process's one line after a signal stopped the run in ``out``."""
    found = list_checkpoints(checkpoints_root(Path(out))) if out else []
    if found:
        return (f"interrupted ({signame}); resume with --resume {out} (newest checkpoint: "
                f"{found[-1].name})")
    return (f"interrupted ({signame}); no checkpoint had been written, so a new run starts "
            "over (use --ckpt-every N to keep progress)")


def check_fresh_run_dir(run_dir: Path) -> None:
    """A new run must not start in a folder holding another run's checkpoints."""
    found = list_checkpoints(checkpoints_root(run_dir))
    if found:
        raise CheckpointError(
            f"{run_dir} already holds checkpoints (latest {found[-1].name}) of an earlier run; "
            f"continue it with --resume {run_dir}, or start a new run with another --out "
            "(nothing was overwritten)")


def resume_config(resume: str, given: dict[str, Any], explicit: set[str],
                  from_file: Collection[str] = (), where: str = "--config") -> TrainConfig:
    """The configuration of a resumed run: the checkpoint's own, plus the options the user set
    explicitly that a resume may change. Any other explicit option that differs is refused.
    ``from_file``: the options a config file (``where``) set and the command line did not;
    they are held to the same list, and those that differ are refused together."""
    ckpt = _resume_checkpoint(resume)
    manifest = read_manifest(ckpt, config_keys=config_keys())
    saved = dict(manifest["config"])
    run_dir = ckpt.parent.parent
    if "overwrite" in explicit:
        raise CheckpointError(f"--overwrite starts a new run in place of {run_dir}; drop it to "
                              "continue the run with --resume")
    reshard = bool(given.get("reshard"))
    saved["nproc"] = manifest["world"]  # the world that wrote it (an elastic shrink changes it)
    for name in sorted(explicit - {"reshard", "overwrite"}):
        if name in RESUME_OVERRIDABLE or (reshard and name in RESHARD_OVERRIDABLE):
            saved[name] = given[name]
        elif name == "out":
            if Path(given["out"]).resolve() != run_dir.resolve():
                raise CheckpointError(f"--out {given['out']} differs from the resumed run's "
                                      f"folder {run_dir}; a resumed run continues in its own "
                                      "folder (drop --out)")
        elif name in given and given[name] != saved.get(name):
            flag = "--" + name.replace("_", "-")
            if name == "nproc":
                raise CheckpointError(
                    f"--nproc {given[name]}: the checkpoint {ckpt} was written by "
                    f"{manifest['world']} workers and its plan is for {manifest['world']}; "
                    f"resume with --nproc {manifest['world']} (or drop --nproc), or add "
                    "--reshard to re-plan it")
            hint = " or add --reshard," if name in RESHARD_OVERRIDABLE else ""
            raise CheckpointError(
                f"{flag} {given[name]!r} differs from the resumed run's {saved.get(name)!r}; "
                f"a resumed run keeps its configuration (drop {flag},{hint} or start a new run "
                "with another --out)")
    _apply_file(saved, given, set(from_file) - explicit, reshard, run_dir, where)
    if saved["steps"] <= manifest["step"]:
        raise CheckpointError(
            f"the checkpoint {ckpt} is at step {manifest['step']} and the run has "
            f"--steps {saved['steps']}: nothing left to train; pass --steps > "
            f"{manifest['step']} to train further")
    saved["out"], saved["resume"] = str(run_dir), str(ckpt)
    saved["reshard"], saved["overwrite"] = reshard, False
    saved["accept_new_data"] = bool(given.get("accept_new_data"))  # for this resume only
    return TrainConfig.from_dict(saved)


# [Note: a rescue left behind]
# A launcher stopped (killed) while its survivors saved their copies, or before it composed
# them ([Note: rescue] in train/rescue.py), leaves them under ``RUN/rescue/``. ``--resume``
# composes them, under the run's lock and with the launcher's own composition, when they make
# a checkpoint newer than the run's newest, and says so; copies that make none are named with
# why, and are removed when the resumed run starts (as every group's start removes them).
def _resume_checkpoint(resume: str) -> Path:
    """``resolve_checkpoint(resume)``, after composing a rescue left behind in its run."""
    p = Path(resume)  # a run folder, its checkpoints/ or one of them
    run = p.parent.parent if p.name.startswith("step_") else \
        p.parent if p.name == "checkpoints" else p
    if not os.path.lexists(rescue_root(run)):
        return resolve_checkpoint(resume)
    check_no_links(run, ("rescue", "checkpoints"))  # [Note: no links inside a run folder]
    newest = newest_checkpoint(checkpoints_root(run))
    where = rescue_root(run)
    try:
        step = rescue_step(run)
    except RescueUnavailableError as e:
        if newest is None:
            raise CheckpointError(
                f"{run} holds no complete checkpoint, and the survivors' copies in {where} "
                f"make none ({e}); train again (nothing was deleted)") from None
        print(f"notice: the survivors' copies in {where} make no checkpoint ({e}); resuming "
              f"uses {newest}, and removes them when it starts", file=sys.stderr)
        return resolve_checkpoint(resume)
    if newest is None or step > int(read_manifest(newest)["step"]):
        with hold_run_folder(run):  # a live run (the stopped launcher's workers) is refused
            ckpt = compose_rescue(run)[0]
        print(f"notice: composed {ckpt} from the survivors' copies in {where} (their launcher "
              "stopped before it did)", file=sys.stderr)
    return resolve_checkpoint(resume)


def _apply_file(saved: dict[str, Any], given: dict[str, Any], names: set[str], reshard: bool,
                run_dir: Path, where: str) -> None:
    """A config file's options on a resume: those a resume may change go into ``saved``; the
    others must equal the run's own, else all of them are named in one refusal (a file is
    often a whole run's options, so most of its keys simply repeat the run's)."""
    kept = []
    for name in sorted(names - {"reshard", "overwrite", "resume"}):
        if name in RESUME_OVERRIDABLE or (reshard and name in RESHARD_OVERRIDABLE):
            saved[name] = given[name]
        elif name == "out":
            if Path(given["out"]).resolve() != run_dir.resolve():
                kept.append(name)
        elif given[name] != saved.get(name):
            kept.append(name)
    if kept:
        also = [n for n in kept if n in RESHARD_OVERRIDABLE]
        reshard_hint = f" (or add --reshard for {', '.join(also)})" if also else ""
        raise CheckpointError(
            f"{where} sets {', '.join(f'{n} = {given[n]!r}' for n in kept)}, but the resumed "
            f"run keeps its own ({', '.join(f'{n} = {saved.get(n)!r}' for n in kept)}): a "
            "resume may change only steps, the checkpoint, restart, logging and tracking "
            f"options (docs/checkpointing.md, Resume); drop them from the file{reshard_hint}, "
            "or start a new run with another --out")


def recorded_data(cfg: TrainConfig) -> Recorded | None:
    """What the checkpoint a run resumes recorded of its data (None: a new run)."""
    if not cfg.resume:
        return None
    ckpt = resolve_checkpoint(cfg.resume)
    return recorded_in(ckpt, read_manifest(ckpt, config_keys=config_keys()))


def preflight_resume(cfg: TrainConfig) -> None:
    """Before any worker starts: the checkpoint is complete, intact and fits ``cfg.nproc``."""
    if not cfg.resume:
        return
    ckpt = resolve_checkpoint(cfg.resume)
    manifest = read_manifest(ckpt, config_keys=config_keys())
    check_compatible(manifest, ckpt, world=cfg.nproc, strategy=cfg.strategy, plan=None,
                     model_state=None, reshard=cfg.reshard)
    verify_files(ckpt, manifest)


def truncate_metrics(path: Path, start: int) -> list[dict[str, Any]]:
    """Keep the metrics lines of the first ``start`` steps (steps count from 1; the steps
    about to be replayed are written again) and return them."""
    if not path.exists():
        return []
    kept = [r for r in read_jsonl(path) if int(r.get("step", 0)) <= start]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept), durable=True)
    return kept


def drop_replayed_metrics(path: Path, start: int, *, resumed: bool) -> list[float]:
    """On a resumed or restarted run, drop the metrics lines of the steps about to be replayed
    and return the losses logged before ``start``; a fresh run keeps its file as it is."""
    if not (resumed or restart_count() > 0):
        return []
    return [float(r["loss"]) for r in truncate_metrics(path, start) if r.get("loss") is not None]


# -- stopping a diverged run ------------------------------------------------------------------
# [Note: the finite-state guard]
# A loss is computed *before* the update of its step, so a finite loss says nothing about the
# weights that update produced: with an absurd learning rate the step-2 loss is fine and the
# step-2 weights are NaN. The guard therefore also checks the state itself: at every log step
# (and so before every checkpoint) each rank takes the max-abs norm of every tensor it trains
# and of their optimizer state (``torch._foreach_norm``, one fused kernel per dtype, no host
# sync: a max is finite exactly when every value is, and cannot overflow as a 2-norm can) and
# adds that one flag to the losses it already gathers (trainer._Window.flush), so the check
# costs no extra collective.
# A checkpoint is written only after its state passed, so the checkpoint a stopped run names
# holds finite weights.
def state_finite(model: Any, opt: torch.optim.Optimizer) -> torch.Tensor:
    """0-dim tensor: 1.0 if every trained parameter of this rank and its optimizer state are
    finite, else 0.0 ([Note: the finite-state guard])."""
    from subnetdp.runtime.fsdp import local_tensor

    tensors = [local_tensor(p).detach() for p in model.parameters()]
    tensors += [local_tensor(v) for st in opt.state.values() for v in st.values()
                if torch.is_tensor(v) and v.is_floating_point() and v.numel() > 0]
    if not tensors:
        return torch.ones(())
    norms = torch._foreach_norm(tensors, float("inf"))
    return torch.stack([n.float() for n in norms]).isfinite().all().float()


def not_finite_error(run_dir: Path, *, step: int, bad: dict[int, float] | None = None,
                     broken: list[int] | None = None) -> NonFiniteLossError:
    """The error that stops every rank at once: non-finite losses ``bad`` (by rank) at
    ``step``, or ranks ``broken`` whose state after ``step`` is not finite; it names the last
    good checkpoint (every checkpoint's state passed the guard)."""
    found = list_checkpoints(checkpoints_root(run_dir))
    kept = (f"the last good checkpoint is kept: {found[-1]}" if found else
            "no checkpoint had been written (use --ckpt-every N to keep progress)")
    what = (f"the loss is not finite at step {step} (loss by rank: {bad})" if bad else
            f"the weights or optimizer state after step {step} are not finite on "
            f"rank(s) {broken} (the losses so far were finite)")
    return NonFiniteLossError(f"{what}; training stopped and {kept}. Lower --lr or set "
                              "--grad-clip and start a new run")
