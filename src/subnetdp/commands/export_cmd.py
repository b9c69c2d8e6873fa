"""``subnetdp export``: a run's checkpoint as one safetensors file of the full model.

The file holds the plain model's ``state_dict`` (every unit assembled from its owner's shard),
so it loads with ``model.load_state_dict(safetensors.torch.load_file(path))`` and no subnetdp
code. Its metadata records the recipe, the model overrides and the training configuration.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from subnetdp._moved import moved_name
from subnetdp.commands.options import HelpFormatter


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("export", help="write a checkpoint's full model (safetensors)",
                              description=__doc__, formatter_class=HelpFormatter)
    p.set_defaults(func=run)
    p.add_argument("run", help="runs/NAME (its newest checkpoint) or runs/NAME/checkpoints/step_N")
    p.add_argument("--out", required=True, metavar="PATH",
                   help="the .safetensors file to write (--format hf: the folder)")
    p.add_argument("--format", choices=["safetensors", "hf"], default="safetensors",
                   help="safetensors: our key names, one file; hf: a LlamaForCausalLM folder "
                        "(config.json, model.safetensors, the run's tokenizer)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")


def run(args: argparse.Namespace) -> int:
    from subnetdp.checkpoint.export import export_checkpoint
    from subnetdp.checkpoint.rundir import check_output
    from subnetdp.hf import export_hf
    from subnetdp.train.config import config_keys

    export = export_hf if args.format == "hf" else export_checkpoint
    try:
        check_output(args.out, sources=(args.run,))
        info = export(args.run, args.out, overwrite=args.overwrite, config_keys=config_keys())
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


def __getattr__(name: str) -> Any:  # library functions that lived here (subnetdp/_moved.py)
    return moved_name(__name__, name)
