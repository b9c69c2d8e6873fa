"""Tokenise a corpus once into uint16 token files (uint32 past 65,536 ids), cached and safe to
call from many processes.

Layout: ``<cache>/text/<kind><vocab>-<fingerprint>/{tokenizer.json, train.bin, val.bin,
meta.json}``. The fingerprint covers the corpus file list, sizes and modification times, the
options and the ``tokenizers`` version, so changing any of them (an edit in place that keeps a
file's size, too) builds a new entry instead of reusing a stale one.

Concurrency: every worker of a job calls ``prepare_text`` at start-up. One takes an exclusive
``flock`` and builds; the rest block on the lock, then find ``meta.json`` and only read. Each file
is written to a temporary name and renamed (atomic on POSIX), ``meta.json`` last, so a reader
never sees a half-written entry even if a builder is killed mid-way.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import Tokenizer

from subnetdp.data.hf import TextSource, hf_documents
from subnetdp.data.ids import check_token_range, dtype_named, token_dtype
from subnetdp.data.text import Document, load_documents, name_hash, split_documents
from subnetdp.data.tokenizer import (
    cache_dir,
    eot_id,
    load_gpt2_tokenizer,
    load_tokenizer,
    train_bpe,
)

FORMAT_VERSION = 1  # bump when the on-disk layout or the build recipe changes
TokenizerKind = str  # "bpe" (trained on the corpus), "gpt2", or a tokenizer.json path


@dataclass(frozen=True)
class TextData:
    train: np.ndarray  # uint16/uint32, read-only memmap; documents joined by eot_id
    val: np.ndarray
    vocab_size: int  # the tokenizer's real size (≤ the requested one on a tiny corpus)
    tokenizer_path: str  # "" for user pre-tokenised files
    n_train_docs: int
    n_val_docs: int
    eot_id: int

    def tokenizer(self) -> Tokenizer:
        if not self.tokenizer_path:
            raise ValueError("these token files were pre-tokenised by the user; no tokenizer")
        return load_tokenizer(self.tokenizer_path)


def _memmap(path: Path, dtype: type[np.unsignedinteger] = np.uint16) -> np.ndarray:
    # np.memmap refuses empty files; an empty split is legal (e.g. val_fraction=0).
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    if path.stat().st_size % np.dtype(dtype).itemsize:
        raise ValueError(f"{path} is not a whole number of {np.dtype(dtype).name} ids; set "
                         f"meta.json's \"dtype\" to the type it was written with")
    return np.memmap(path, dtype=dtype, mode="r")


def _write_atomic(path: Path, write: object) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if isinstance(write, np.ndarray):
        write.tofile(tmp)
    elif isinstance(write, Tokenizer):
        write.save(str(tmp))
    else:
        tmp.write_text(json.dumps(write, indent=1))
    os.replace(tmp, path)


def _encode(tok: Tokenizer, docs: list[Document], eot: int, chunk: int = 256) -> np.ndarray:
    parts: list[np.ndarray] = []
    dtype = token_dtype(tok.get_vocab_size())
    sep = np.array([eot], dtype=dtype)
    for i in range(0, len(docs), chunk):
        # encode_batch runs on all cores (Rust threads); chunking bounds peak memory.
        for enc in tok.encode_batch([d.text for d in docs[i : i + chunk]]):
            parts += [np.asarray(enc.ids, dtype=dtype), sep]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _build(out: Path, *, kind: TokenizerKind, vocab_size: int, data_dir: str | None,
           val_fraction: float, max_docs: int | None, source: TextSource) -> None:
    if source.dataset or source.data_files:
        docs = hf_documents(source.dataset, list(source.data_files), text_field=source.text_field,
                            max_docs=max_docs)
    else:
        docs = load_documents(data_dir, max_docs=max_docs, text_field=source.text_field)
    train_docs, val_docs = split_documents(docs, val_fraction=val_fraction)
    if not train_docs:
        raise ValueError("no training documents left after the split; lower val_fraction")
    # Rank shards are contiguous slices of train.bin: interleave sources (by a salted name hash)
    # so every rank sees Shakespeare, Bible and news, not one source each.
    train_docs.sort(key=lambda d: name_hash("order/" + d.name))
    if kind == "bpe":
        tok = train_bpe((d.text for d in train_docs), vocab_size=vocab_size, length=len(train_docs))
    elif kind == "gpt2":
        tok = load_gpt2_tokenizer()
    else:
        tok = load_tokenizer(kind)
    eot = eot_id(tok)
    _write_atomic(out / "tokenizer.json", tok)
    _write_atomic(out / "train.bin", _encode(tok, train_docs, eot))
    _write_atomic(out / "val.bin", _encode(tok, val_docs, eot))
    meta = {
        "vocab_size": tok.get_vocab_size(),
        "dtype": np.dtype(token_dtype(tok.get_vocab_size())).name,
        "eot_id": eot,
        "n_train_docs": len(train_docs),
        "n_val_docs": len(val_docs),
        "val_docs": [d.name for d in val_docs],  # for audit: what was held out
    }
    _write_atomic(out / "meta.json", meta)  # last: its presence means the entry is complete


def _read(out: Path) -> TextData:
    meta = json.loads((out / "meta.json").read_text())
    dtype = dtype_named(meta.get("dtype", "uint16"), str(out / "meta.json"))
    return TextData(
        train=_memmap(out / "train.bin", dtype),
        val=_memmap(out / "val.bin", dtype),
        vocab_size=int(meta["vocab_size"]),
        tokenizer_path=str(out / "tokenizer.json"),
        n_train_docs=int(meta["n_train_docs"]),
        n_val_docs=int(meta["n_val_docs"]),
        eot_id=int(meta["eot_id"]),
    )


def _pretokenized(root: Path, vocab_size: int, val_fraction: float) -> TextData:
    """User's ``train.bin`` [+ ``val.bin``, ``meta.json`` with vocab_size, eot_id and dtype
    (uint16 or uint32)], as is; every id is checked against the vocabulary."""
    meta_path = root / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    dtype = dtype_named(meta.get("dtype", "uint16"), str(meta_path))
    train = _memmap(root / "train.bin", dtype)
    if (root / "val.bin").exists():
        val = _memmap(root / "val.bin", dtype)
    else:  # no document boundaries known: hold out the tail
        cut = len(train) - int(len(train) * val_fraction)
        train, val = train[:cut], train[cut:]
    vocab = int(meta.get("vocab_size", vocab_size))
    for name, tokens in (("train.bin", train), ("val.bin", val)):
        if len(tokens):
            check_token_range(tokens, vocab, source=str(root / name))
    return TextData(train, val, vocab, "", 0, 0, int(meta.get("eot_id", -1)))


def _file_identity(path: Path) -> tuple[int, int]:
    """Size and modification time (ns) of a corpus file: an edit in place that keeps the size
    still changes the time, so the cache entry changes with the content."""
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def text_cache_entry(*, vocab_size: int = 4096, data_dir: str | None = None,
                     cache: str | Path | None = None, val_fraction: float = 0.02,
                     tokenizer: TokenizerKind = "bpe", max_docs: int | None = None,
                     source: TextSource | None = None) -> Path:
    """The cache folder ``prepare_text`` uses for these options (not created)."""
    source = source or TextSource()
    files = [(f.key, *_file_identity(f.path)) for f in source.corpus(data_dir)]
    key = {
        "files": files,
        "data": "packages" if data_dir is None else "user",
        "vocab_size": vocab_size if tokenizer == "bpe" else None,
        "val_fraction": val_fraction,
        "tokenizer": tokenizer,
        "max_docs": max_docs,
        "tokenizers": tokenizers.__version__,
        "format": FORMAT_VERSION,
        **source.key(tokenizer),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    label = {"bpe": f"bpe{vocab_size}", "gpt2": "gpt2"}.get(tokenizer, "tok")
    return Path(cache or cache_dir()).expanduser() / "text" / f"{label}-{digest}"


def prepare_text(*, vocab_size: int = 4096, data_dir: str | None = None,
                 cache: str | Path | None = None, val_fraction: float = 0.02,
                 tokenizer: TokenizerKind = "bpe", max_docs: int | None = None,
                 source: TextSource | None = None) -> TextData:
    """Train/load the tokenizer and the tokenised train/val splits, building them on first use.

    ``data_dir``: the user's text files instead of the packaged corpus, or a folder with
    pre-tokenised ``train.bin`` [+ ``val.bin``] uint16/uint32 files, used as is (ids checked
    against the vocabulary). ``cache``: cache root (default ``cache_dir()``).
    ``tokenizer="gpt2"``: the real GPT-2 BPE instead of training one; a path: that
    ``tokenizer.json``. ``source``: a Hugging Face ``datasets`` source and the documents' text
    field (``data.hf``). ``max_docs``: only the first N documents (tests, quick trials).
    """
    source = source or TextSource()
    if data_dir is not None and (Path(data_dir).expanduser() / "train.bin").exists():
        return _pretokenized(Path(data_dir).expanduser(), vocab_size, val_fraction)
    out = text_cache_entry(vocab_size=vocab_size, data_dir=data_dir, cache=cache,
                           val_fraction=val_fraction, tokenizer=tokenizer, max_docs=max_docs,
                           source=source)
    if not (out / "meta.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        with open(out / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # blocks while another process builds
            if not (out / "meta.json").exists():  # it may have finished while we waited
                _build(out, kind=tokenizer, vocab_size=vocab_size, data_dir=data_dir,
                       val_fraction=val_fraction, max_docs=max_docs, source=source)
    return _read(out)

