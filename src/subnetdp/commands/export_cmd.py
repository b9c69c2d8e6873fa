"""``subnetdp export``: a run's checkpoint as one safetensors file of the full model.

The file holds the plain model's ``state_dict`` (every unit assembled from its owner's shard),
so it loads with ``model.load_state_dict(safetensors.torch.load_file(path))`` and no subnetdp
code. Its metadata records the recipe, the model overrides and the training configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

EXPORT_FORMAT = "subnetdp-export"


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("export", help="write a checkpoint's full model (safetensors)")
    p.add_argument("run", help="runs/NAME (its newest checkpoint) or runs/NAME/checkpoints/step_N")
    p.add_argument("--out", required=True,
                   help="the .safetensors file to write (--format hf: the folder)")
    p.add_argument("--format", choices=["safetensors", "hf"], default="safetensors",
                   help="safetensors: our key names, one file; hf: a LlamaForCausalLM folder "
                        "(config.json, model.safetensors, the run's tokenizer)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")


def export_checkpoint(source: str | os.PathLike[str], out: str | os.PathLike[str], *,
                      overwrite: bool = False) -> dict[str, Any]:
    """Verify the checkpoint, assemble the full model and write it to ``out`` atomically.

    Returns ``{"checkpoint", "step", "tensors", "params", "out"}``. Every check runs before
    anything is written, so a refused export leaves ``out`` as it was."""
    from safetensors.torch import save_file

    from subnetdp.checkpoint.files import (
        assemble_full_state,
        read_manifest,
        resolve_checkpoint,
        verify_files,
    )

    out = Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"--out {out} must end in .safetensors")
    if out.exists() and not overwrite:
        raise ValueError(f"{out} already exists; pass --overwrite to replace it or choose "
                         "another --out (nothing was written)")
    ckpt = resolve_checkpoint(source)
    manifest = read_manifest(ckpt)
    verify_files(ckpt, manifest)
    state = assemble_full_state(ckpt, manifest)
    metadata = {
        "format": EXPORT_FORMAT,
        "recipe": manifest["recipe"],
        "model_overrides": json.dumps(manifest["model_overrides"]),
        "config": json.dumps(manifest["config"]),
        "step": str(manifest["step"]),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        save_file(state, str(tmp), metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return {"checkpoint": str(ckpt), "step": manifest["step"], "tensors": len(state),
            "params": sum(t.numel() for t in state.values()), "out": str(out)}


def run(args: argparse.Namespace) -> int:
    from subnetdp.hf import export_hf

    export = export_hf if args.format == "hf" else export_checkpoint
    try:
        info = export(args.run, args.out, overwrite=args.overwrite)
    except (ValueError, OSError) as e:
        print(f"subnetdp export: {e}", file=sys.stderr)
        return 2
    print(f"exported step {info['step']} of {info['checkpoint']}: {info['tensors']} tensors, "
          f"{info['params'] / 1e6:.3f} M values -> {info['out']}")
    if args.format == "hf":
        print("load it with: transformers.LlamaForCausalLM.from_pretrained(DIR) and "
              "AutoTokenizer.from_pretrained(DIR)")
        return 0
    print("load it with: model.load_state_dict(safetensors.torch.load_file(PATH)) "
          "(model built from the recipe and the 'model_overrides' in the file's metadata)")
    return 0
