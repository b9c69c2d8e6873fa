"""Text corpora as lists of documents, and a deterministic train/validation split by document.

Default corpus (≈14 MB, 2.5 M words): each Shakespeare work, each Bible book and each BBC article
is one document. With ``data_dir`` the user's own ``*.txt`` (one document per file), ``*.jsonl``
and ``*.parquet`` (one document per row, field ``text``) are read instead.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from subnetdp.data import locate
from subnetdp.data.images import DataFormatError
from subnetdp.data.locate import DatasetMissingError
from subnetdp.data.reading import reading

USER_SUFFIXES = (".txt", ".jsonl", ".parquet")


@dataclass(frozen=True)
class Document:
    name: str  # unique and stable: the split hashes it
    text: str
    source: str = "user"  # "shakespeare" | "bible" | "bbc" | "user": the split balances these


@dataclass(frozen=True)
class CorpusFile:
    key: str  # stable name (no absolute path), so a moved venv keeps its cache
    path: Path


# [Note: undecodable bytes]
# Files are read as UTF-8. A byte that is not UTF-8 becomes its Windows-1252 character, one
# byte at a time (one BBC article has a bare 0xA3, which is how its '£' survives; the five
# bytes Windows-1252 leaves undefined become U+FFFD), and each file with such bytes is named in
# one warning line with their count (the packaged corpus' one known byte excepted). Decoding a
# whole document as Windows-1252 because of one bad byte would garble every other non-ASCII
# character in it, silently.
_ONE_BY_ONE = "subnetdp-cp1252-per-byte"
_undecoded = [0]  # bytes the handler replaced in this process (read before and after a file)


def _per_byte(e: UnicodeError) -> tuple[str, int]:
    assert isinstance(e, UnicodeDecodeError)
    bad = bytes(e.object[e.start : e.end])
    _undecoded[0] += len(bad)
    return bad.decode("cp1252", errors="replace"), e.end


codecs.register_error(_ONE_BY_ONE, _per_byte)


@contextlib.contextmanager
def decoding(path: Path, *, warn: bool = True) -> Iterator[Callable[[bytes], str]]:
    """A UTF-8 decoder for the bytes of ``path`` ([Note: undecodable bytes]); on leaving the
    block, one warning line names the file if any of its bytes were not UTF-8 (``warn``)."""
    before = _undecoded[0]
    yield lambda raw: raw.decode("utf-8", errors=_ONE_BY_ONE)
    bad = _undecoded[0] - before
    if bad and warn:
        print(f"warning: {path}: {bad} byte(s) are not UTF-8; each was read as its "
              "Windows-1252 character (save the file as UTF-8 to silence this)",
              file=sys.stderr, flush=True)


def read_text(path: Path, *, warn: bool = True) -> str:
    """A file meant to be UTF-8, decoded per byte where it is not ([Note: undecodable
    bytes])."""
    with decoding(path, warn=warn) as decode:
        return decode(path.read_bytes())


_PG_START = re.compile(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_PG_END = re.compile(r"^\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg licence header/footer when the standard markers are present."""
    start = _PG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _PG_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip()


def corpus_files(data_dir: str | None = None) -> list[CorpusFile]:
    """The files a corpus is read from, in a fixed order (also the tokenizer cache key)."""
    if data_dir is None:
        files = [CorpusFile(f"shakespeare/{p.name}", p) for p in locate.shakespeare_files()]
        files.append(CorpusFile("bible/kjv.jsonl", locate.bible_file()))
        files += [
            CorpusFile(f"bbc/{p.parent.name}/{p.name}", p) for p in locate.bbc_files()
        ]
        return files
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise DatasetMissingError(f"--data-dir {root} is not a directory.")
    found = sorted(
        p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in USER_SUFFIXES
    )
    if not found:
        raise DatasetMissingError(
            f"--data-dir {root} holds no *.txt, *.jsonl or *.parquet files; add some, or omit "
            f"--data-dir to use the packaged corpus (`{locate.TEXT_PIP}`)."
        )
    return [CorpusFile(p.relative_to(root).as_posix(), p) for p in found]


def _bible_books(path: Path) -> Iterator[Document]:
    # Verses arrive in canonical order; a book is the run of verses sharing its "book" field.
    books: dict[str, list[str]] = {}
    with decoding(path) as decode, path.open("rb") as f:
        for raw in f:
            line = decode(raw)
            if line.strip():
                verse = json.loads(line)
                books.setdefault(verse["book"], []).append(verse["text"])
    for book, verses in books.items():
        yield Document(f"bible/{book}", "\n".join(verses), "bible")


def _jsonl_docs(cf: CorpusFile, field: str) -> Iterator[Document]:
    with decoding(cf.path) as decode, cf.path.open("rb") as f:
        for i, raw in enumerate(f):
            line = decode(raw)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFormatError(f"{cf.path}:{i + 1}: not a line of JSON ({e.msg}, column "
                                      f"{e.colno}); fix or remove the line") from None
            if not isinstance(row, dict) or not isinstance(row.get(field), str):
                raise DataFormatError(f"{cf.path}:{i + 1}: each JSONL line needs a string field "
                                      f"`{field}` (--text-field names another)")
            yield Document(f"{cf.key}:{i}", row[field])


def _parquet_docs(cf: CorpusFile, field: str) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(
            f"Reading {cf.path} needs pyarrow: `pip install 'subnetdp[data]'`, or convert it "
            f"to JSONL."
        ) from e
    if field not in pq.read_schema(cf.path).names:
        raise DataFormatError(f"{cf.path} has no column `{field}`; pass --text-field NAME")
    table = pq.read_table(cf.path, columns=[field])
    for i, text in enumerate(table.column(field).to_pylist()):
        if text is not None:
            yield Document(f"{cf.key}:{i}", str(text))


def _docs_of(cf: CorpusFile, *, packaged: bool, field: str) -> Iterator[Document]:
    if packaged:
        if cf.key.startswith("bible/"):
            yield from _bible_books(cf.path)
            return
        source = cf.key.split("/", 1)[0]
        # the packaged corpus' one such byte is known (docs/data.md): no warning to act on
        yield Document(cf.key.removesuffix(".txt"),
                       strip_gutenberg(read_text(cf.path, warn=False)), source)
        return
    suffix = cf.path.suffix.lower()
    if suffix == ".txt":
        yield Document(cf.key, strip_gutenberg(read_text(cf.path)))
    elif suffix == ".jsonl":
        yield from _jsonl_docs(cf, field)
    else:
        yield from _parquet_docs(cf, field)


def load_documents(data_dir: str | None = None, *, max_docs: int | None = None,
                   text_field: str = "text") -> list[Document]:
    """All documents of the corpus, in a deterministic order, empty and duplicate ones dropped.

    Exact duplicates (the BBC set holds ~100 re-published articles) are dropped, keeping the
    first, so the same text can never land in both train and validation.
    """
    docs: list[Document] = []
    seen: set[bytes] = set()
    for cf in corpus_files(data_dir):
        with reading(cf.path, cf.path.suffix.lstrip(".").lower() or "text"):
            for doc in _docs_of(cf, packaged=data_dir is None, field=text_field):
                norm = " ".join(doc.text.split())
                digest = hashlib.sha1(norm.encode()).digest()
                if not norm or digest in seen:
                    continue
                seen.add(digest)
                docs.append(doc)
                if max_docs is not None and len(docs) >= max_docs:
                    return docs
    return docs


def name_hash(name: str) -> float:
    """Uniform in [0, 1), stable across runs, machines and Python versions (unlike hash())."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2.0**64


def split_documents(
    docs: list[Document], *, val_fraction: float = 0.02
) -> tuple[list[Document], list[Document]]:
    """Hold out whole documents: a document is validation iff hash(name) < val_fraction.

    Each source with at least two documents gets at least one validation document (its lowest
    hash), so a small source such as the 66 Bible books is still measured. Order is preserved.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    is_val = {d.name: name_hash(d.name) < val_fraction for d in docs}
    if val_fraction > 0:
        by_source: dict[str, list[Document]] = {}
        for d in docs:
            by_source.setdefault(d.source, []).append(d)
        for group in by_source.values():
            if len(group) >= 2 and not any(is_val[d.name] for d in group):
                is_val[min(group, key=lambda d: name_hash(d.name)).name] = True
            if all(is_val[d.name] for d in group):  # never starve a source's training data
                is_val[max(group, key=lambda d: name_hash(d.name)).name] = False
    train = [d for d in docs if not is_val[d.name]]
    val = [d for d in docs if is_val[d.name]]
    return train, val
