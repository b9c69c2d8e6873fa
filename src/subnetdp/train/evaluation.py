"""Validation loss (and accuracy) of a checkpoint or an exported model: the plain model class
built from the recipe, loaded strictly with the full state, on the run's own validation batches
(the same evaluation as the end of ``subnetdp train``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["evaluate_path"]


def evaluate_path(path: str | Path, *, eval_batches: int | None = None,
                  device: str | None = None, accept_new_data: bool = False
                  ) -> dict[str, float]:
    """``accept_new_data``: evaluate on the current corpus although it changed since the run
    recorded it (train/data_identity.py)."""
    from subnetdp.checkpoint.export import load_model_state
    from subnetdp.evals.downstream import is_hf_folder
    from subnetdp.models import get_recipe
    from subnetdp.train.config import TrainConfig, config_keys
    from subnetdp.train.data_identity import Recorded, recorded_in
    from subnetdp.train.device import device_name, run_device
    from subnetdp.train.tasks import make_task

    if is_hf_folder(Path(path)):
        raise ValueError(_hf_folder_message(Path(path)))
    state, info = load_model_state(path, config_keys=config_keys())
    newer = sorted(set(info["config"]) - config_keys())  # a checkpoint's manifest is checked
    if newer:
        raise ValueError(f"{path} records option(s) {', '.join(newer)} that this subnetdp does "
                         "not know: it was written by a newer subnetdp; upgrade subnetdp")
    cfg = TrainConfig.from_dict(info["config"])
    if eval_batches is not None:
        if eval_batches < 1:
            raise ValueError(f"--eval-batches must be >= 1, got {eval_batches}")
        cfg.eval_batches = eval_batches
    if device is not None:
        cfg.device = device
    cfg.accept_new_data = accept_new_data
    recorded = (recorded_in(Path(info["checkpoint"]), info) if "checkpoint" in info
                else Recorded(info["data"], None, str(path)))
    device_name(cfg.device)  # the run's own cuda, evaluated where there is none: one line
    dev = run_device(cfg)
    model = get_recipe(info["recipe"]).build_model(**info["model_overrides"])
    missing, unexpected = _mismatch(model.state_dict(), state)
    if missing or unexpected:
        what = "; ".join(f"{label} {', '.join(keys[:3])}" for label, keys in (
            ("missing or misshapen", missing), ("unexpected", unexpected)) if keys)
        raise ValueError(f"{path} does not hold the {info['recipe']} model its metadata "
                         f"describes: {what}; export the run's checkpoint again")
    model.load_state_dict(state)
    result = make_task(cfg, recorded).evaluate(model.to(dev), dev)
    return {"step": float(info["step"]), **result}


def _hf_folder_message(folder: Path) -> str:
    """What to do with an ``export --format hf`` folder: it holds the model but not the run's
    validation data, which its checkpoint names."""
    import json

    from subnetdp.checkpoint.files import MANIFEST
    from subnetdp.hf.export import PROVENANCE

    source = json.loads((folder / "config.json").read_text()).get(PROVENANCE[2])
    origin = (f"; its validation loss is its checkpoint's: `subnetdp eval {source}`"
              if source and (Path(source) / MANIFEST).is_file() else "")
    return (f"{folder} is a Hugging Face model folder, which records no validation data: score "
            f"it with `subnetdp eval {folder} --eval-tasks arc_easy,sciq` (or lm_eval, with "
            f"--model hf --model_args pretrained={folder}){origin}")


def _mismatch(expected: dict[str, Any], state: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Tensors the model has that ``state`` lacks (or holds in another shape), and extra
    ones."""
    missing = sorted(k for k, v in expected.items()
                     if k not in state or tuple(state[k].shape) != tuple(v.shape))
    return missing, sorted(set(state) - set(expected))
