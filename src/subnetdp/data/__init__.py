"""Real corpora and image sets, tokenizers, and per-worker batches.

A side layer: imports nothing else of subnetdp and no ``torch.distributed``; a worker is only
the integers ``rank`` and ``world``. Data ships in registry packages (see docs/data.md) and is
located without importing them; anything missing raises ``DatasetMissingError`` naming the
install command.
"""

from __future__ import annotations

from subnetdp.data.batches import (
    image_batch_indices,
    image_batches,
    image_eval_batches,
    lm_batch,
    lm_batches,
    lm_eval_batches,
    random_crop_flip,
    shard_bounds,
    steps_per_epoch,
)
from subnetdp.data.cifar import CIFAR_MEAN, CIFAR_STD, load_cifar, read_cifar_batch
from subnetdp.data.images import (
    FMNIST_CLASSES,
    FMNIST_MEAN,
    FMNIST_STD,
    DataFormatError,
    load_fashion_mnist,
    read_idx,
)
from subnetdp.data.locate import DatasetMissingError
from subnetdp.data.text import Document, load_documents, split_documents
from subnetdp.data.tokenizer import (
    EOT,
    cache_dir,
    load_gpt2_tokenizer,
    load_tokenizer,
    train_bpe,
)
from subnetdp.data.tokens import TextData, prepare_text, text_cache_entry

__all__ = [
    "CIFAR_MEAN",
    "CIFAR_STD",
    "EOT",
    "FMNIST_CLASSES",
    "FMNIST_MEAN",
    "FMNIST_STD",
    "DataFormatError",
    "DatasetMissingError",
    "Document",
    "TextData",
    "cache_dir",
    "image_batch_indices",
    "image_batches",
    "image_eval_batches",
    "lm_batch",
    "lm_batches",
    "lm_eval_batches",
    "load_cifar",
    "load_documents",
    "load_fashion_mnist",
    "load_gpt2_tokenizer",
    "load_tokenizer",
    "prepare_text",
    "random_crop_flip",
    "read_cifar_batch",
    "read_idx",
    "shard_bounds",
    "split_documents",
    "steps_per_epoch",
    "text_cache_entry",
    "train_bpe",
]
