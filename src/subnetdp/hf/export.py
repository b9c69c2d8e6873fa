"""``subnetdp export RUN --format hf --out DIR``: a run's LLaMA as a Hugging Face folder.

``DIR`` then loads offline with ``LlamaForCausalLM.from_pretrained(DIR)`` and
``AutoTokenizer.from_pretrained(DIR)`` and gives the run's own logits. The folder is built
beside ``DIR`` and renamed into place, so a refused or interrupted export leaves ``DIR`` as it
was.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any

# config.json keys recording where the weights came from (HF keeps unknown keys as attributes)
PROVENANCE = ("subnetdp_recipe", "subnetdp_step", "subnetdp_checkpoint")
# and, for a run started with --init-from, the folder its first weights came from (with hashes)
INIT_FROM = "subnetdp_init_from"


def export_hf(source: str | os.PathLike[str], out: str | os.PathLike[str], *,
              overwrite: bool = False, config_keys: Collection[str] | None = None
              ) -> dict[str, Any]:
    """Verify the checkpoint, rename its full LLaMA state to HF names and write ``out``.
    ``config_keys``: as in ``checkpoint.files.read_manifest``.

    Returns ``{"checkpoint", "step", "tensors", "params", "out"}``."""
    import torch
    from tokenizers import Tokenizer

    from subnetdp.checkpoint.files import (
        assemble_full_state,
        read_manifest,
        resolve_checkpoint,
        verify_files,
    )
    from subnetdp.data.tokenizer import EOT
    from subnetdp.hf.llama import hf_config, to_hf_state
    from subnetdp.hf.tokenizer import check_run_tokenizer, hf_tokenizer_files, run_tokenizer
    from subnetdp.models import get_recipe
    from subnetdp.models.llama.model import Llama

    out = Path(out)
    _check_out(out, overwrite)
    ckpt = resolve_checkpoint(source)
    manifest = read_manifest(ckpt, config_keys=config_keys)
    with torch.device("meta"):
        model = get_recipe(manifest["recipe"]).build_model(**manifest["model_overrides"])
    if not isinstance(model, Llama):
        raise ValueError(f"--format hf exports LLaMA recipes only; {manifest['recipe']} is not "
                         "one (export it with the default --format safetensors)")
    tokenizer = run_tokenizer(ckpt.parent.parent)
    check_run_tokenizer(tokenizer, manifest.get("data", {}).get("tokenizer"), ckpt)
    tok = Tokenizer.from_file(str(tokenizer))
    eot_id = tok.token_to_id(EOT)
    if eot_id is None:
        raise ValueError(f"{tokenizer} has no {EOT} token; it is not the run's tokenizer")
    if tok.get_vocab_size() > model.config.vocab_size:
        raise ValueError(f"{tokenizer} has {tok.get_vocab_size()} tokens but the model of {ckpt} "
                         f"{model.config.vocab_size}: it is not the run's tokenizer")
    verify_files(ckpt, manifest)
    state = to_hf_state(assemble_full_state(ckpt, manifest))
    extra = dict(zip(PROVENANCE, (manifest["recipe"], manifest["step"], str(ckpt)),
                     strict=True))
    if "init_from" in manifest:
        extra[INIT_FROM] = manifest["init_from"]
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) != 1:
        raise ValueError(f"{ckpt} mixes parameter dtypes {sorted(map(str, dtypes))}; a Hugging "
                         "Face folder has one (nothing was written)")
    config = hf_config(model.config, eot_id=eot_id, dtype=dtypes.pop(), extra=extra)
    files = {"config.json": json.dumps(config, indent=2),
             **hf_tokenizer_files(tokenizer, eot=EOT, max_length=model.config.max_seq_len)}
    _publish(out, state, files)
    return {"checkpoint": str(ckpt), "step": manifest["step"], "tensors": len(state),
            "params": sum(t.numel() for t in state.values()), "out": str(out)}


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse an ``out`` that is a file, or that holds anything but an earlier export (which
    only ``overwrite`` replaces), before anything is read."""
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} already exists and is not empty; pass --overwrite to replace "
                         "it or choose another --out (nothing was written)")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; --format hf writes a folder")
    if out.is_dir() and any(out.iterdir()) and not _is_export(out):
        raise ValueError(f"--out {out} holds files that `subnetdp export --format hf` did not "
                         "write; --overwrite replaces only an earlier export: choose another "
                         "--out (nothing was written)")


def _publish(out: Path, state: dict[str, Any], files: dict[str, str]) -> None:
    """``state`` as ``model.safetensors`` and ``files`` written to a staging folder beside
    ``out``, which then replaces ``out`` whole."""
    from safetensors.torch import save_file

    from subnetdp.filemode import share

    staging = out.with_name(f".{out.name}.tmp")
    old = out.with_name(f".{out.name}.old")
    for stale in (staging, old):
        shutil.rmtree(stale, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        # "format": "pt" is what transformers expects of a PyTorch safetensors file
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        share(staging / "model.safetensors")  # safetensors writes 0600 whatever the umask
        for name, text in files.items():
            (staging / name).write_text(text + "\n")
        if out.exists():
            out.rename(old)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def _is_export(folder: Path) -> bool:
    """``folder`` is what an earlier ``export --format hf`` wrote (its config.json names where
    the weights came from), so ``--overwrite`` may replace it."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and all(k in config for k in PROVENANCE)
