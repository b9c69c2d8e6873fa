"""A run's configuration when it starts from a Hugging Face LLaMA folder (``--init-from``).

The folder decides what its weights need: the recipe (the one it was exported from, else the
LLaMA recipe nearest its size, for the training defaults), the model shape (``model_args``),
the tokenizer (so the vocabulary) and the longest ``--seq-len``. An option given with another
value is refused in one line naming it; one given with the folder's value is accepted, so a
run's recorded config.json replays. The weights themselves are loaded by the trainer
(``hf.init_from.InitPieces``) into what each rank holds, unless a checkpoint is restored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path
from typing import Any, TypeVar

from subnetdp.hf.init_from import OPTION, HFFolder, InitPieces, read_hf_folder, weights_record
from subnetdp.train.options import TrainOptions

Options = TypeVar("Options", bound=TrainOptions)  # a TrainConfig in, a TrainConfig out

__all__ = ["apply_init_from", "init_weights"]


def apply_init_from(cfg: Options, explicit: Collection[str]) -> Options:
    """``cfg`` with the folder's recipe, shape, tokenizer and (when not given) ``seq_len``;
    ``explicit``: the options the user gave (only those can conflict with the folder)."""
    if cfg.init_from is None:
        return cfg
    folder = read_hf_folder(cfg.init_from)
    if "recipe" in explicit and cfg.recipe != folder.recipe:
        raise ValueError(f"--recipe {cfg.recipe}: with {OPTION} the recipe follows the folder "
                         f"({folder.recipe}); drop --recipe, and set --lr, --batch-size or "
                         "--seq-len to change its defaults")
    if cfg.tokenizer is not None and Path(cfg.tokenizer).expanduser().resolve() != \
            folder.tokenizer.resolve():
        raise ValueError(f"--tokenizer {cfg.tokenizer}: with {OPTION} the run's tokenizer is "
                         f"the folder's ({folder.tokenizer}); drop --tokenizer")
    if cfg.vocab_size is not None:
        raise ValueError(f"--vocab-size {cfg.vocab_size}: with {OPTION} the vocabulary follows "
                         f"the folder (vocab_size {folder.model_args['vocab_size']}); drop "
                         "--vocab-size")
    if cfg.data_dir and (Path(cfg.data_dir).expanduser() / "train.bin").exists():
        raise ValueError(f"--data-dir {cfg.data_dir} holds pre-tokenised ids, which no "
                         f"tokenizer reads; with {OPTION} the folder's tokenizer tokenises the "
                         "text: give a --data-dir of text")
    for key, value in cfg.model_args.items():
        if key in folder.model_args and value != folder.model_args[key]:
            raise ValueError(f"--model-arg {key}={value}: with {OPTION} the model's shape "
                             f"follows the folder's config.json ({key}="
                             f"{folder.model_args[key]}); drop --model-arg {key}")
    _check_tokenizer(folder)
    seq_len = cfg.seq_len
    longest = folder.model_args["max_seq_len"]
    if seq_len is None:
        from subnetdp.models import get_recipe

        seq_len = min(get_recipe(folder.recipe).defaults["seq_len"], longest)
    elif seq_len > longest:
        raise ValueError(f"--seq-len {seq_len} exceeds the folder's max_position_embeddings "
                         f"({longest}); use --seq-len {longest} or less")
    # absolute: a resume from another working folder reads the same files
    return dataclasses.replace(cfg, recipe=folder.recipe, init_from=str(folder.path.resolve()),
                               tokenizer=str(folder.tokenizer.resolve()),
                               model_args={**cfg.model_args, **folder.model_args},
                               seq_len=seq_len)


def _check_tokenizer(folder: HFFolder) -> None:
    """The tokenizer's ids must all be rows of the folder's embedding."""
    from subnetdp.data.tokenizer import load_tokenizer

    size = load_tokenizer(folder.tokenizer).get_vocab_size()
    vocab = folder.model_args["vocab_size"]
    if size > vocab:
        raise ValueError(f"{OPTION} {folder.path}: tokenizer.json has {size} tokens but "
                         f"config.json's vocab_size is {vocab}; it is not this model's "
                         "tokenizer")


def init_weights(init_from: str, model: Any, rank: int, restored: Path | None
                 ) -> dict[str, Any]:
    """What this run's checkpoints record of the folder: ``{"init_from": {"folder",
    "weights": {file: sha256}}}``. A new run first fills this rank's model (a ``RankModel``)
    with the folder's weights, each rank the pieces it holds, and rank 0 hashes them (every
    rank may write a manifest: a rescue's); a run that restores checkpoint ``restored``
    (a resume, a restart) has newer weights and keeps that checkpoint's record."""
    import torch.distributed as dist

    from subnetdp.checkpoint.files import MANIFEST, read_manifest

    if restored is not None:
        record = read_manifest(restored).get("init_from") if (restored / MANIFEST).is_file() \
            else None
        return {"init_from": record} if record is not None else {}
    folder = read_hf_folder(init_from)
    model.load_shard_state(InitPieces(folder))
    box = [weights_record(folder) if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return {"init_from": box[0]}
