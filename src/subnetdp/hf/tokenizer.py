"""A run's tokenizer: kept in the run folder, and written in Hugging Face's layout on export.

The tokenizer is trained once per corpus and option set into a user cache (data/tokens.py).
A cache can be cleared or rebuilt by another ``tokenizers`` version, so a run keeps its own
copy: the token ids its model learned stay decodable, and an export needs nothing else.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

RUN_TOKENIZER = "tokenizer.json"  # in the run folder, beside summary.json


def save_run_tokenizer(task: Any, run_dir: Path) -> None:
    """Copy the tokenizer of an LM task (``task.data.tokenizer_path``) into ``run_dir``.

    Nothing to copy for an image task or user pre-tokenised files. The copy is always
    replaced: a new run in place of an old one (``--overwrite``) must not keep the old run's
    tokenizer, and a resumed run uses the very tokenizer the run recorded
    (train/data_identity.py), so replacing it changes nothing there."""
    source = getattr(getattr(task, "data", None), "tokenizer_path", "")
    target = run_dir / RUN_TOKENIZER
    if not source:
        target.unlink(missing_ok=True)  # no tokenizer: none of an earlier run's either
        return
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.copyfile(source, tmp)
    os.replace(tmp, target)


def run_tokenizer(run_dir: Path) -> Path:
    """The tokenizer a run kept; a one-line error for a run without one."""
    path = run_dir / RUN_TOKENIZER
    if not path.is_file():
        raise ValueError(f"{run_dir} has no {RUN_TOKENIZER} (a run trained before runs kept "
                         "their tokenizer, or on pre-tokenised files); retrain it to export")
    return path


def check_run_tokenizer(path: Path, recorded: str | None, ckpt: Path) -> None:
    """Refuse a run folder's tokenizer that is not the one ``ckpt`` recorded (its sha256;
    None: a checkpoint from before runs recorded it)."""
    if recorded is not None and hashlib.sha256(path.read_bytes()).hexdigest() != recorded:
        raise ValueError(f"{path} is not the tokenizer {ckpt} was trained with (sha256 "
                         f"{recorded[:12]}); restore the run's tokenizer.json, or export a "
                         "checkpoint of the run that wrote this one")


def _tokenizer_config(eot: str, max_length: int) -> dict[str, Any]:
    """The end-of-text token doubles as BOS, EOS and padding: it is the only special token the
    corpus has (documents are joined by it)."""
    return {"bos_token": eot, "eos_token": eot, "unk_token": eot, "pad_token": eot,
            "model_max_length": max_length, "add_bos_token": False, "add_eos_token": False,
            "clean_up_tokenization_spaces": False}


def hf_tokenizer_files(tokenizer_json: Path, *, eot: str, max_length: int) -> dict[str, str]:
    """``{file name: text}`` of a ``PreTrainedTokenizerFast`` folder around our tokenizer."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **_tokenizer_config(eot, max_length)}
    special = {"bos_token": eot, "eos_token": eot, "unk_token": eot, "pad_token": eot}
    return {"tokenizer.json": tokenizer_json.read_text(),
            "tokenizer_config.json": json.dumps(config, indent=2),
            "special_tokens_map.json": json.dumps(special, indent=2)}


def hf_tokenizer(tokenizer_json: Path, *, eot: str, max_length: int) -> Any:
    """The ``PreTrainedTokenizerFast`` that ``hf_tokenizer_files`` describes, in memory."""
    import transformers

    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json),
                                                **_tokenizer_config(eot, max_length))
