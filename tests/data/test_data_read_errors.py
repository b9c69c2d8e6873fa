"""Every text-reader error (--dataset builders and --data-dir files; empty, malformed,
unreadable) is one line from ``subnetdp train`` that names the file (issue 28 item 8)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from subnetdp.cli import main


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBNETDP_CACHE", str(tmp_path / "cache"))


def _train(capsys: pytest.CaptureFixture[str], tmp_path: Path, *source: str) -> str:
    """stderr of a `subnetdp train` over ``source``, which must fail in one line (exit 2)."""
    code = main(["train", "--recipe", "llama-tiny", "--nproc", "1", "--steps", "1",
                 "--out", str(tmp_path / "run"), *source])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_empty_parquet_shard_is_one_line(tmp_path: Path, capsys) -> None:
    """The issue's reproduction: an empty parquet shard, one without rows (55 lines of
    `datasets` traceback on 40e75c9) or of 0 bytes (a log line and a message without the
    file)."""
    shard = tmp_path / "shard-00001.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), shard)
    err = _train(capsys, tmp_path, "--dataset", "parquet", "--data-files", str(shard))
    assert err == f"subnetdp train: {shard}: no parquet file holds a row; give files that " \
                  "hold documents\n"
    shard.write_bytes(b"")
    err = _train(capsys, tmp_path, "--dataset", "parquet", "--data-files", str(shard))
    assert err.startswith(f"subnetdp train: {shard} cannot be read as parquet (")


@pytest.mark.parametrize(("builder", "name", "text"), [
    ("csv", "bad.csv", 'text,n\n"unclosed,1\n'),
    ("json", "bad.json", '{"text": "a"\n'),
    ("json", "bad.jsonl", '{"text": "a"}\n{broken\n'),
    ("csv", "header-only.csv", "text\n"),
])
def test_malformed_files_are_one_line(tmp_path: Path, capsys, builder: str, name: str,
                                      text: str) -> None:
    f = tmp_path / name
    f.write_text(text)
    err = _train(capsys, tmp_path, "--dataset", builder, "--data-files", str(f))
    assert f"{f} cannot be read as {builder}" in err


def test_the_bad_file_among_good_ones_is_named(tmp_path: Path, capsys) -> None:
    good, bad = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    good.write_text('{"text": "hello"}\n')
    bad.write_text('{"text": \n')
    err = _train(capsys, tmp_path, "--dataset", "json", "--data-files", str(good),
                 "--data-files", str(bad))
    assert f"{bad} cannot be read as json" in err and str(good) not in err


def test_a_folder_where_a_file_is_meant_is_named(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "shard.json"
    folder.mkdir()
    err = _train(capsys, tmp_path, "--dataset", "json", "--data-files", str(folder))
    assert f"{folder} cannot be read as json" in err


def test_zero_row_parquet_shards(tmp_path: Path, capsys) -> None:
    """A shard without rows holds no text: skipped beside others (datasets itself fails on it),
    one line when every shard is empty."""
    from subnetdp.data.hf import hf_documents

    empty, full = tmp_path / "empty.parquet", tmp_path / "full.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty)
    pq.write_table(pa.table({"text": ["one doc", "two docs"]}), full)
    docs = hf_documents("parquet", [str(full), str(empty)])
    assert [d.text for d in docs] == ["one doc", "two docs"]
    err = _train(capsys, tmp_path, "--dataset", "parquet", "--data-files", str(empty))
    assert f"{empty}: no parquet file holds a row" in err


def test_data_dir_files_are_named(tmp_path: Path, capsys) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.parquet").write_bytes(b"PAR1 not really")
    err = _train(capsys, tmp_path, "--data-dir", str(data))
    assert f"{data / 'a.parquet'} cannot be read as parquet" in err
    (data / "a.parquet").unlink()
    (data / "b.jsonl").write_text('{"text": "a"}\n{oops\n')
    err = _train(capsys, tmp_path, "--data-dir", str(data))
    assert f"{data / 'b.jsonl'}:2: not a line of JSON" in err


def test_a_missing_text_field_names_the_files(tmp_path: Path, capsys) -> None:
    f = tmp_path / "docs.jsonl"
    f.write_text('{"body": "hello"}\n')
    err = _train(capsys, tmp_path, "--dataset", "json", "--data-files", str(f))
    assert f"{f}: no field 'text' (fields: body); pass --text-field NAME" in err
