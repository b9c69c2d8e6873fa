"""Tokenise a corpus once into uint16 token files (uint32 past 65,536 ids), cached and safe to
call from many processes.

Layout: ``<cache>/text/<kind><vocab>-<fingerprint>/{tokenizer.json, train.bin, val.bin,
meta.json}``. The fingerprint covers the corpus file list, sizes and modification times, the
options and the ``tokenizers`` version, so changing any of them (an edit in place that keeps a
file's size, too) builds a new entry instead of reusing a stale one.

[Note: data identity]
``meta.json`` records the size and sha256 of the entry's three files and of every corpus file
it was built from. Every read checks the three files against it, and an entry that no longer
matches (a truncated ``train.bin``, a flipped byte) is rebuilt with a notice, never used.
``TextData.identity`` carries these hashes to the run, which records them in each checkpoint's
manifest; a resumed or evaluated run compares them with the data it finds (train/data.py).

Concurrency: every worker of a job calls ``prepare_text`` at start-up. One takes an exclusive
``flock`` and builds; the rest block on the lock, then find ``meta.json`` and only read. Each file
is written to a temporary name and renamed (atomic on POSIX), ``meta.json`` last, so a reader
never sees a half-written entry even if a builder is killed mid-way.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from tokenizers import Tokenizer

from subnetdp.data.hf import TextSource, hf_documents
from subnetdp.data.ids import check_token_range, dtype_named, token_dtype
from subnetdp.data.text import CorpusFile, Document, load_documents, name_hash, split_documents
from subnetdp.data.tokenizer import (
    cache_dir,
    eot_id,
    load_gpt2_tokenizer,
    load_tokenizer,
    tokenizer_panics,
    train_bpe,
)

FORMAT_VERSION = 2  # bump when the layout or the build recipe changes (2: file hashes)
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
    # sha256 and sizes of the tokenizer, token files and corpus files ([Note: data identity])
    identity: dict[str, Any] = dataclasses.field(default_factory=dict)

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
    with tokenizer_panics(kind):
        train, val = _encode(tok, train_docs, eot), _encode(tok, val_docs, eot)
    _write_atomic(out / "train.bin", train)
    _write_atomic(out / "val.bin", val)
    meta = {
        "files": {name: file_entry(out / name) for name in ENTRY_FILES},
        "corpus": corpus_identity(source.corpus(data_dir)),
        "vocab_size": tok.get_vocab_size(),
        "dtype": np.dtype(token_dtype(tok.get_vocab_size())).name,
        "eot_id": eot,
        "n_train_docs": len(train_docs),
        "n_val_docs": len(val_docs),
        "val_docs": [d.name for d in val_docs],  # for audit: what was held out
    }
    _write_atomic(out / "meta.json", meta)  # last: its presence means the entry is complete


ENTRY_FILES = ("tokenizer.json", "train.bin", "val.bin")


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": sha256_of(path)}


def corpus_identity(files: list[CorpusFile]) -> dict[str, dict[str, Any]]:
    """``{key: {bytes, sha256}}`` of the files a corpus is read from."""
    return {f.key: file_entry(f.path) for f in files}


def cached_tokenizer_sha(out: Path) -> str | None:
    """The sha256 meta.json records for the entry's tokenizer (None: no complete entry)."""
    try:
        return str(json.loads((out / "meta.json").read_text())["files"]["tokenizer.json"]
                   ["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def current_corpus(data_dir: str | None, source: TextSource) -> dict[str, dict[str, Any]]:
    """The identity of the corpus these options read now (``TextData.identity["corpus"]``),
    without tokenising anything."""
    root = Path(data_dir).expanduser() if data_dir is not None else None
    if root is not None and (root / "train.bin").exists():  # pre-tokenised, used as is
        return {p.name: file_entry(p) for p in (root / "train.bin", root / "val.bin",
                                               root / "meta.json") if p.exists()}
    return corpus_identity(source.corpus(data_dir))


def entry_problem(out: Path) -> str | None:
    """Why the cache entry ``out`` cannot be used as it is ([Note: data identity]), or None."""
    try:
        meta = json.loads((out / "meta.json").read_text())
        recorded = meta["files"]
        for name in ENTRY_FILES:
            path, want = out / name, recorded[name]
            if not path.is_file():
                return f"{name} is missing"
            size = path.stat().st_size
            if size != want["bytes"]:
                return f"{name} is {size} bytes, meta.json says {want['bytes']}"
            if sha256_of(path) != want["sha256"]:
                return f"{name} does not match its sha256 in meta.json"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"meta.json cannot be read ({type(e).__name__}: {e})"
    return None


def _read(out: Path) -> TextData:
    meta = json.loads((out / "meta.json").read_text())
    dtype = dtype_named(meta.get("dtype", "uint16"), str(out / "meta.json"))
    files = meta["files"]
    identity = {"tokenizer": files["tokenizer.json"]["sha256"],
                "train.bin": files["train.bin"], "val.bin": files["val.bin"],
                "corpus": meta["corpus"]}
    return TextData(
        train=_memmap(out / "train.bin", dtype),
        val=_memmap(out / "val.bin", dtype),
        vocab_size=int(meta["vocab_size"]),
        tokenizer_path=str(out / "tokenizer.json"),
        n_train_docs=int(meta["n_train_docs"]),
        n_val_docs=int(meta["n_val_docs"]),
        eot_id=int(meta["eot_id"]),
        identity=identity,
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
    given = [p for p in (root / "train.bin", root / "val.bin", meta_path) if p.exists()]
    identity = {"tokenizer": None, "corpus": {p.name: file_entry(p) for p in given}}
    return TextData(train, val, vocab, "", 0, 0, int(meta.get("eot_id", -1)), identity)


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
        # a tokenizer.json by its content (source.key), not its path: a moved or copied file
        # (an HF folder's, --init-from) reuses the entry
        "tokenizer": tokenizer if tokenizer in ("bpe", "gpt2") else "file",
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
    if not (out / "meta.json").exists() or entry_problem(out) is not None:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # blocks while another process builds
            # it may have been built or repaired while we waited
            problem = entry_problem(out) if (out / "meta.json").exists() else "new"
            if problem is not None:
                if problem != "new":
                    print(f"notice: the token cache {out} is damaged ({problem}); rebuilding "
                          "it", file=sys.stderr, flush=True)
                    (out / "meta.json").unlink()  # the entry is incomplete until rebuilt
                _build(out, kind=tokenizer, vocab_size=vocab_size, data_dir=data_dir,
                       val_fraction=val_fraction, max_docs=max_docs, source=source)
    return _read(out)

