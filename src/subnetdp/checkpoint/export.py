"""A checkpoint's full model: written as one safetensors file (``export_checkpoint``) and read
back, from a checkpoint or such a file (``load_model_state``).

The file holds the plain model's ``state_dict`` (every unit assembled from its owner's shard),
so it loads with ``model.load_state_dict(safetensors.torch.load_file(path))`` and no subnetdp
code. Its metadata records the recipe, the model overrides and the training configuration.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from subnetdp.checkpoint.files import (
    assemble_full_state,
    read_manifest,
    resolve_checkpoint,
    verify_files,
)

if TYPE_CHECKING:
    import torch

__all__ = ["EXPORT_FORMAT", "export_checkpoint", "load_model_state"]

EXPORT_FORMAT = "subnetdp-export"


def export_checkpoint(source: str | os.PathLike[str], out: str | os.PathLike[str], *,
                      overwrite: bool = False, config_keys: Collection[str] | None = None
                      ) -> dict[str, Any]:
    """Verify the checkpoint, assemble the full model and write it to ``out`` atomically.
    ``config_keys``: as in ``read_manifest``.

    Returns ``{"checkpoint", "step", "tensors", "params", "out"}``. Every check runs before
    anything is written, so a refused export leaves ``out`` as it was."""
    from safetensors.torch import save_file

    from subnetdp.filemode import share

    out = Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"--out {out} must end in .safetensors")
    if out.exists() and not overwrite:
        raise ValueError(f"{out} already exists; pass --overwrite to replace it or choose "
                         "another --out (nothing was written)")
    ckpt = resolve_checkpoint(source)
    manifest = read_manifest(ckpt, config_keys=config_keys)
    verify_files(ckpt, manifest)
    state = assemble_full_state(ckpt, manifest)
    metadata = {
        "format": EXPORT_FORMAT,
        "recipe": manifest["recipe"],
        "model_overrides": json.dumps(manifest["model_overrides"]),
        "config": json.dumps(manifest["config"]),
        "step": str(manifest["step"]),
        "data": json.dumps(manifest.get("data", {})),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        save_file(state, str(tmp), metadata=metadata)
        share(tmp)  # safetensors writes 0600 whatever the umask
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return {"checkpoint": str(ckpt), "step": manifest["step"], "tensors": len(state),
            "params": sum(t.numel() for t in state.values()), "out": str(out)}


def load_model_state(path: str | Path, *, config_keys: Collection[str] | None = None
                     ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The full state and ``{"recipe", "model_overrides", "config", "step", "data"}`` (and
    ``"checkpoint"``, the folder, for a checkpoint) of a checkpoint (verified against its
    checksums) or of an export file. ``config_keys``: as in
    ``read_manifest``."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    p = Path(path)
    if p.is_file():
        try:
            with safe_open(str(p), framework="pt") as f:
                meta = dict(f.metadata() or {})
            state = load_file(str(p))
        except Exception as e:  # safetensors' own error types for a bad header/body
            raise ValueError(f"{p} cannot be read as safetensors ({e}); it is truncated or "
                             "not a model file") from e
        if meta.get("format") != EXPORT_FORMAT:
            raise ValueError(f"{p} was not written by `subnetdp export` (no recipe/config in "
                             "its metadata); evaluate the run's checkpoint instead")
        try:
            info = {"recipe": meta["recipe"],
                    "model_overrides": json.loads(meta["model_overrides"]),
                    "config": json.loads(meta["config"]), "step": int(meta["step"]),
                    "data": json.loads(meta.get("data", "{}"))}
        except (KeyError, ValueError) as e:
            raise ValueError(f"{p}: its subnetdp metadata is damaged ({type(e).__name__}: "
                             f"{e}); export the run's checkpoint again") from None
        return state, info
    ckpt = resolve_checkpoint(p)
    manifest = read_manifest(ckpt, config_keys=config_keys)
    verify_files(ckpt, manifest)
    info = {k: manifest[k] for k in ("recipe", "model_overrides", "config", "step")}
    info["data"], info["checkpoint"] = manifest.get("data", {}), str(ckpt)
    return assemble_full_state(ckpt, manifest), info
