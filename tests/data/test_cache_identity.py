"""Issue 27, root cause 5, in the data layer (in-process): token cache entries verify their
files and are rebuilt, never used, when one changed; a byte that is not UTF-8 is decoded alone
and reported; a run's recorded tokenizer is used when the cache no longer holds it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from subnetdp.data import prepare_text, text_cache_entry
from subnetdp.data.tokens import sha256_of
from subnetdp.train.data_identity import DataChangedError, Recorded, prepare_recorded

WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(4):
        (root / f"d{i}.txt").write_text(" ".join(WORDS[(i + j * j) % 10] for j in range(600)))
    return root


def _prepare(corpus: Path, cache: Path) -> tuple[bytes, bytes, bytes]:
    data = prepare_text(vocab_size=300, data_dir=str(corpus), cache=cache)
    return (np.asarray(data.train).tobytes(), np.asarray(data.val).tobytes(),
            Path(data.tokenizer_path).read_bytes())


def _mutations(path: Path) -> dict[str, Callable[[], None]]:
    raw = path.read_bytes()
    return {"truncated": lambda: path.write_bytes(raw[: len(raw) // 2]),
            "a flipped byte": lambda: path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1])),
            "replaced": lambda: path.write_bytes(b"\x00" * len(raw)),
            "removed": path.unlink}


def test_every_damaged_cache_file_is_rebuilt(corpus: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Property: each file of an entry (and its meta.json), truncated, one byte flipped,
    replaced or removed: the next read names it, rebuilds the entry and gives the clean data."""
    cache = tmp_path / "cache"
    clean = _prepare(corpus, cache)
    entry = text_cache_entry(vocab_size=300, data_dir=str(corpus), cache=cache)
    for name in ("train.bin", "val.bin", "tokenizer.json", "meta.json"):
        for how, mutate in _mutations(entry / name).items():
            capsys.readouterr()
            mutate()
            assert _prepare(corpus, cache) == clean, (name, how)
            err = capsys.readouterr().err
            if (name, how) == ("meta.json", "removed"):  # an unfinished entry: built anew
                continue
            assert f"the token cache {entry} is damaged" in err and "rebuilding" in err, (
                name, how, err)
            assert name in err or name == "meta.json", (name, how, err)


def test_one_invalid_byte_is_one_character_and_one_warning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from subnetdp.data import load_documents

    (tmp_path / "a.txt").write_bytes("café au lait ".encode() + b"\xa3" + " 5 — naïve".encode())
    rows = [{"text": "crème"}, {"text": "zq"}]
    raw = "\n".join(json.dumps(r, ensure_ascii=False) for r in rows).encode()
    (tmp_path / "b.jsonl").write_bytes(raw.replace(b"zq", b"zq\x81\x9d"))
    docs = {d.name: d.text for d in load_documents(str(tmp_path))}
    assert docs["a.txt"] == "café au lait £ 5 — naïve"  # not the whole file as cp1252
    assert docs["b.jsonl:0"] == "crème" and docs["b.jsonl:1"] == "zq\ufffd\ufffd"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert "a.txt: 1 byte(s) are not UTF-8" in err[0]
    assert "b.jsonl: 2 byte(s) are not UTF-8" in err[1]


def test_the_runs_tokenizer_is_used_when_the_cache_lost_it(corpus: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """The cache is gone (or rebuilt with another tokenizer): a resumed run tokenises with the
    tokenizer.json it kept, so its token files hash as recorded; with none kept, one line."""
    from subnetdp.data.hf import TextSource

    monkeypatch.setenv("SUBNETDP_CACHE", str(tmp_path / "cache"))
    data = prepare_text(vocab_size=300, data_dir=str(corpus))
    kept = tmp_path / "tokenizer.json"
    kept.write_bytes(Path(data.tokenizer_path).read_bytes())
    opts = {"vocab_size": 300, "data_dir": str(corpus), "tokenizer": "bpe",
            "source": TextSource(), "accept_new_data": False}
    monkeypatch.setenv("SUBNETDP_CACHE", str(tmp_path / "other-cache"))
    # a BPE trained now would not be the run's: refuse training one
    monkeypatch.setattr("subnetdp.data.tokens.train_bpe", None)
    again = prepare_recorded(Recorded(data.identity, kept, "R"), **opts)  # type: ignore[arg-type]
    assert again.identity["train.bin"] == data.identity["train.bin"]
    assert sha256_of(Path(again.tokenizer_path)) == data.identity["tokenizer"]
    monkeypatch.setenv("SUBNETDP_CACHE", str(tmp_path / "third-cache"))
    with pytest.raises(DataChangedError, match="neither the token cache nor its run folder"):
        prepare_recorded(Recorded(data.identity, None, "R"), **opts)  # type: ignore[arg-type]
