"""Text documents through Hugging Face ``datasets``, from local files only (extra ``data``).

``--dataset json|parquet|text|csv|arrow --data-files 'shards/*.parquet'`` loads with that
builder; ``--dataset FOLDER`` a dataset saved with ``save_to_disk`` (its ``train`` split);
``--data-files`` alone picks the builder from the files' suffix. The hub is never contacted
(``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` default to 1 here) and datasets' own cache lives in
subnetdp's (``cache_dir()/hf-datasets``).
"""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from subnetdp.data.images import DataFormatError
from subnetdp.data.locate import DatasetMissingError
from subnetdp.data.reading import reading, reason
from subnetdp.data.text import CorpusFile, Document, corpus_files
from subnetdp.data.tokenizer import cache_dir

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text",
             ".csv": "csv", ".arrow": "arrow"}
_INSTALL = "pip install 'subnetdp[data]'"


def hf_files(dataset: str | None, data_files: list[str]) -> list[CorpusFile]:
    """The local files a ``--dataset``/``--data-files`` source reads (the token cache key)."""
    if dataset is not None and dataset not in _BUILDERS.values() \
            and not Path(dataset).expanduser().is_dir():  # a hub name: never fetched here
        raise DatasetMissingError(
            f"--dataset {dataset} is neither a local dataset folder nor a builder "
            f"({', '.join(sorted(set(_BUILDERS.values())))}); subnetdp reads local data only: "
            f"save it where the hub is reachable (datasets.load_dataset({dataset!r})"
            ".save_to_disk(DIR)) and pass --dataset DIR")
    if dataset is not None and Path(dataset).expanduser().is_dir() and not data_files:
        root = Path(dataset).expanduser()
        return [CorpusFile(p.relative_to(root).as_posix(), p)
                for p in sorted(root.rglob("*")) if p.is_file()]
    found: list[Path] = []
    for pattern in data_files:
        matched = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not matched:
            raise DatasetMissingError(f"--data-files {pattern!r} matches no file; give existing "
                                      f"local files (globs allowed)")
        found += [Path(m) for m in matched]
    if not found:
        raise DatasetMissingError("--dataset needs --data-files (local files) or a folder "
                                  "saved with datasets' save_to_disk")
    return [CorpusFile(p.resolve().as_posix(), p) for p in found]


def hf_documents(dataset: str | None, data_files: list[str], *, text_field: str = "text",
                 max_docs: int | None = None) -> list[Document]:
    """One document per row with a non-empty ``text_field``, in file order."""
    files = hf_files(dataset, data_files)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise DatasetMissingError(f"--dataset/--data-files need Hugging Face datasets: "
                                  f"`{_INSTALL}`") from None
    ds: Any
    if dataset is not None and Path(dataset).expanduser().is_dir() and not data_files:
        folder = Path(dataset).expanduser()
        with reading(folder, "a dataset saved with save_to_disk"):
            ds = datasets.load_from_disk(str(folder))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"]
    else:
        builder = dataset or _builder([f.path for f in files])
        ds = _load(datasets, builder, [f.path for f in files])
    source = dataset if dataset is not None and not data_files else ", ".join(data_files)
    if text_field not in ds.column_names:
        raise DataFormatError(f"{source}: no field {text_field!r} (fields: "
                              f"{', '.join(ds.column_names)}); pass --text-field NAME")
    docs = []
    for i, text in enumerate(ds[text_field]):
        if isinstance(text, str) and text.strip():
            docs.append(Document(f"hf:{i}", text))
            if max_docs is not None and len(docs) >= max_docs:
                break
    if not docs:
        raise DataFormatError(f"{source}: no row has a non-empty {text_field!r}; give "
                              "documents, or --text-field NAME")
    return docs


def _load(datasets: Any, builder: str, paths: list[Path]) -> Any:
    """``paths`` through ``builder``; a file it cannot read is named (each file is tried alone
    when the whole load fails: ``datasets`` does not say which one it was)."""
    if builder == "parquet":  # datasets fails on a shard without rows; it holds no text anyway
        given, paths = paths, [p for p in paths if _parquet_rows(p)]
        if not paths:
            raise DataFormatError(f"{', '.join(map(str, given))}: no parquet file holds a row; "
                                  "give files that hold documents")
    # its errors are reported here, in one line; its progress bars would garble that line
    level = datasets.logging.get_verbosity()
    bars = not datasets.are_progress_bars_disabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(builder, data_files=[str(p) for p in paths], split="train",
                                     cache_dir=str(cache_dir() / "hf-datasets"))
    except Exception as whole:  # the boundary: which file, and why
        for p in paths:
            with reading(p, builder):
                datasets.load_dataset(builder, data_files=[str(p)], split="train",
                                      cache_dir=str(cache_dir() / "hf-datasets"))
        names = ", ".join(str(p) for p in paths)
        raise DataFormatError(f"--data-files {names} cannot be read together as {builder} "
                              f"({reason(whole)}); each reads alone: make their fields "
                              "agree") from whole
    finally:
        datasets.logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def _parquet_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    with reading(path, "parquet"):
        return int(pq.read_metadata(path).num_rows)


def _builder(paths: list[Path]) -> str:
    kinds = {_BUILDERS.get(p.suffix.lower()) for p in paths}
    if len(kinds) != 1 or None in kinds:
        suffixes = sorted({p.suffix for p in paths})
        raise ValueError(f"cannot tell the format of --data-files ({suffixes}); pass "
                         f"--dataset json|parquet|text|csv|arrow")
    return str(kinds.pop())


@dataclass(frozen=True)
class TextSource:
    """Where text comes from besides ``data_dir``: a ``datasets`` source, and the documents'
    field. The default is the packaged corpus (or ``data_dir``) with field ``text``."""

    dataset: str | None = None
    data_files: tuple[str, ...] = ()
    text_field: str = "text"

    @property
    def is_hf(self) -> bool:
        return self.dataset is not None or bool(self.data_files)

    def corpus(self, data_dir: str | None) -> list[CorpusFile]:
        """The files read: the token cache's key."""
        return hf_files(self.dataset, list(self.data_files)) if self.is_hf else corpus_files(
            data_dir)

    def key(self, tokenizer: str) -> dict[str, Any]:
        """What the cache key adds for non-default sources (none for the default, so that
        existing entries stay valid): the source, the field, a tokenizer file's content."""
        extra: dict[str, Any] = {}
        if self.is_hf:
            extra["dataset"] = self.dataset if self.dataset is None or not Path(
                self.dataset).is_dir() else "folder"
        if self.text_field != "text":
            extra["text_field"] = self.text_field
        if tokenizer not in ("bpe", "gpt2"):
            path = Path(tokenizer).expanduser()
            if not path.is_file():
                raise ValueError(f"--tokenizer {path}: no such file; give a tokenizer.json, "
                                 f"or gpt2")
            extra["tokenizer_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        return extra
