"""A resumed or evaluated run reads the data it was trained on, or says why it cannot.

Each checkpoint's manifest records the run's data (``"data"``: the sha256 of its tokenizer,
token files and corpus files, [Note: data identity] in data/tokens.py) and the run folder keeps
its tokenizer. Before anything is tokenised the corpus is compared with the record, so an edited
corpus is refused in one line naming the file instead of silently training a new tokenizer;
the tokenizer is the run's own (the cache's only when it is the same file), and the token files
must hash as recorded. ``--accept-new-data`` goes on with the current corpus, still with the
run's tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from subnetdp.data import TextData, prepare_text, text_cache_entry
from subnetdp.data.hf import TextSource
from subnetdp.data.tokens import cached_tokenizer_sha, current_corpus, sha256_of
from subnetdp.hf.tokenizer import RUN_TOKENIZER

__all__ = ["DataChangedError", "Recorded", "prepare_recorded", "recorded_in"]

ACCEPT = "--accept-new-data"


class DataChangedError(ValueError):
    """The data or tokenizer differs from what the run recorded; the message says how to go on."""


@dataclass(frozen=True)
class Recorded:
    identity: dict[str, Any]  # a manifest's "data" ({}: nothing recorded, an older run)
    tokenizer: Path | None  # the run folder's own tokenizer.json, if any
    where: str  # the checkpoint or export, for messages


def recorded_in(ckpt: Path, manifest: dict[str, Any]) -> Recorded:
    """What checkpoint folder ``ckpt`` (``runs/NAME/checkpoints/step_N``) recorded."""
    tokenizer = ckpt.parent.parent / RUN_TOKENIZER
    return Recorded(dict(manifest.get("data") or {}),
                    tokenizer if tokenizer.is_file() else None, str(ckpt))


def prepare_recorded(rec: Recorded | None, *, vocab_size: int, data_dir: str | None, tokenizer: str,
                     source: TextSource, accept_new_data: bool) -> TextData:
    """``prepare_text`` for a run that recorded ``rec`` (None: a new run): its own tokenizer,
    its own data."""
    opts: dict[str, Any] = {"vocab_size": vocab_size, "data_dir": data_dir,
                            "tokenizer": tokenizer, "source": source}
    if rec is None or not rec.identity:  # a new run, or one from before runs recorded it
        return prepare_text(**opts)
    ident = rec.identity
    if not accept_new_data:
        _same_files(rec, "corpus file", ident.get("corpus", {}), current_corpus(data_dir, source))
    want = ident.get("tokenizer")
    if want is not None and cached_tokenizer_sha(text_cache_entry(**opts)) != want:
        # the cache holds another tokenizer for these options, or none: use the run's file
        if rec.tokenizer is None or sha256_of(rec.tokenizer) != want:
            raise DataChangedError(
                f"{rec.where} was trained with a tokenizer (sha256 {want[:12]}) that neither "
                f"the token cache nor its run folder's {RUN_TOKENIZER} holds; restore the run's "
                f"{RUN_TOKENIZER}, or evaluate or resume the run folder itself")
        opts["tokenizer"] = str(rec.tokenizer)
    data = prepare_text(**opts)
    if data.identity.get("tokenizer") != want:
        raise DataChangedError(f"{rec.where} was trained with another tokenizer than the one "
                               "these options give; resume or evaluate with the run's options")
    if not accept_new_data:
        _same_files(rec, "token file", {k: ident[k] for k in ("train.bin", "val.bin")
                                        if k in ident},
                    {k: data.identity[k] for k in ("train.bin", "val.bin")
                     if k in data.identity})
    return data


def _same_files(rec: Recorded, what: str, recorded: dict[str, Any], now: dict[str, Any]
                ) -> None:
    for name in sorted(set(recorded) | set(now)):
        if name not in now:
            change = "is gone"
        elif name not in recorded:
            change = "is new"
        elif now[name] != recorded[name]:
            change = (f"changed ({recorded[name]['bytes']} -> {now[name]['bytes']} bytes, "
                      f"sha256 {recorded[name]['sha256'][:12]} -> {now[name]['sha256'][:12]})")
        else:
            continue
        raise DataChangedError(
            f"{rec.where} was trained on other data: the {what} {name} {change} since; restore "
            f"it, or pass {ACCEPT} to go on with the current data (tokenised with the run's "
            "own tokenizer)")
