"""Issue 27, root causes 5 and 6, on one tiny real run (n-sdp, 2 workers, so its checkpoint
holds sliced pieces) trained once for the module:

- the run records its data and tokenizer, and ``--resume``/``eval``/``export --format hf``
  refuse in one line every change to a file the run depends on (corpus files, the run's
  tokenizer), or go on only when told (``--accept-new-data``);
- crafted or damaged checkpoints (gap, overlap, wrong dtype, out of bounds, huge shape, missing
  or duplicated piece) are refused in one line naming the checkpoint and the tensor before
  anything is assembled, and an untouched rewrite assembles bit-identically.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from subnetdp.checkpoint.files import (
    CheckpointError,
    assemble_full_state,
    read_manifest,
    sha256_file,
    write_manifest,
)
from subnetdp.checkpoint.reshard import PieceReader
from subnetdp.cli import main

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

TINY = ["--recipe", "llama-tiny", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1",
        "--memory-step", "-1", "--no-progress", "--warmup", "1", "--nproc", "2",
        "--strategy", "n-sdp", "--coverage", "0.5", "--ckpt-every", "2", "--vocab-size", "300",
        "--model-arg", "n_layers=2", "--model-arg", "dim=32", "--model-arg", "ffn_hidden=64"]
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
         "small", "cats", "sing"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("recorded")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(
            " ".join(WORDS[(i * 7 + j * j) % len(WORDS)] for j in range(2000)))
    out = root / "run"
    assert main(["train", *TINY, "--steps", "2", "--data-dir", str(corpus),
                 "--out", str(out)]) == 0
    return out


def file_entry_of(path: Path) -> dict[str, object]:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _ckpt(run: Path) -> Path:
    return run / "checkpoints" / "step_00000002"


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# -- root cause 5: results depend on state the run did not record ------------------------------
def test_the_manifest_records_the_data(run: Path) -> None:
    data = read_manifest(_ckpt(run))["data"]
    assert sorted(data["corpus"]) == [f"doc{i}.txt" for i in range(6)]
    assert data["tokenizer"] == file_entry_of(run / "tokenizer.json")["sha256"]
    assert {"train.bin", "val.bin"} <= set(data)


def _mutations(path: Path) -> dict[str, Callable[[], None]]:
    raw = path.read_bytes()
    return {"truncated": lambda: path.write_bytes(raw[: len(raw) // 2]),
            "a flipped byte": lambda: path.write_bytes(
                raw[:10] + bytes([raw[10] ^ 1]) + raw[11:]),
            "replaced": lambda: path.write_bytes(b"other text " * 50),
            "removed": path.unlink}


def test_every_changed_corpus_file_is_refused_by_resume_and_eval(
        run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Property: each corpus file, truncated, one byte flipped, replaced or removed (and a new
    file added): ``eval`` and ``--resume`` refuse in one line naming the file, before a
    tokenizer is trained; restored, ``eval`` gives the run's own number again."""
    corpus = Path(json.loads((run / "config.json").read_text())["data_dir"])
    assert main(["eval", str(run), "--json"]) == 0
    before = json.loads(capsys.readouterr().out)["val_loss"]
    for doc in [*sorted(corpus.iterdir()), corpus / "new.txt"]:
        raw = doc.read_bytes() if doc.exists() else None
        mutations = _mutations(doc) if raw is not None else {
            "added": lambda d=doc: d.write_text("new text " * 40)}  # type: ignore[misc]
        for how, mutate in mutations.items():
            mutate()
            try:
                assert main(["eval", str(run)]) == 2, how
                err = _one_line(capsys)
                assert doc.name in err and "--accept-new-data" in err, (how, err)
                assert main(["train", "--resume", str(run), "--steps", "4"]) == 2, how
                assert doc.name in _one_line(capsys), how
            finally:
                if raw is None:
                    doc.unlink(missing_ok=True)
                else:
                    doc.write_bytes(raw)
    assert main(["eval", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["val_loss"] == before


def test_accepting_new_data_uses_the_runs_tokenizer(
        run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = Path(json.loads((run / "config.json").read_text())["data_dir"])
    doc = corpus / "doc0.txt"
    raw = doc.read_bytes()
    try:
        doc.write_text("seven lazy cats " * 300)
        assert main(["eval", str(run), "--accept-new-data", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["step"] == 2
    finally:
        doc.write_bytes(raw)


def test_accept_new_data_needs_resume(run: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    corpus = json.loads((run / "config.json").read_text())["data_dir"]
    assert main(["train", *TINY, "--steps", "2", "--data-dir", corpus, "--accept-new-data",
                 "--out", str(tmp_path / "new")]) == 2
    assert "use it with --resume" in _one_line(capsys)
    assert not (tmp_path / "new").exists()


def test_without_the_cache_eval_uses_the_runs_tokenizer(
        run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Property for the run's tokenizer.json: with the token cache gone, ``eval`` tokenises
    with it and gives the run's own number; truncated, one byte flipped, replaced or removed,
    it is refused in one line (never a new tokenizer trained in its place)."""
    assert main(["eval", str(run), "--json"]) == 0
    before = json.loads(capsys.readouterr().out)["val_loss"]
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("logs"))
    monkeypatch.setenv("SUBNETDP_CACHE", str(tmp_path / "empty-cache"))
    assert main(["eval", str(copy), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["val_loss"] == before
    raw = (copy / "tokenizer.json").read_bytes()
    for how, mutate in _mutations(copy / "tokenizer.json").items():
        monkeypatch.setenv("SUBNETDP_CACHE", str(tmp_path / f"cache-{len(how)}"))
        mutate()
        assert main(["eval", str(copy)]) == 2, how
        assert "neither the token cache nor its run folder" in _one_line(capsys), how
        (copy / "tokenizer.json").write_bytes(raw)


def test_a_changed_run_tokenizer_is_refused(run: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The run's tokenizer.json, replaced by another one: export --format hf refuses it."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("logs"))
    tok = json.loads((copy / "tokenizer.json").read_text())
    tok["added_tokens"][0]["content"] = "<|other|>"
    (copy / "tokenizer.json").write_text(json.dumps(tok))
    assert main(["export", str(copy), "--format", "hf", "--out", str(tmp_path / "hf")]) == 2
    assert "is not the tokenizer" in _one_line(capsys)


def test_overwrite_replaces_the_runs_tokenizer(run: Path, tmp_path: Path) -> None:
    """A new run in place of another keeps no file of it: the old tokenizer is replaced."""
    from subnetdp.hf.tokenizer import save_run_tokenizer

    class Task:
        class data:
            tokenizer_path = str(run / "tokenizer.json")

    (tmp_path / "tokenizer.json").write_text("{}")
    save_run_tokenizer(Task(), tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()


# -- root cause 6: crafted or damaged checkpoints ----------------------------------------------
Shards = dict[str, dict[str, torch.Tensor]]


def _crafted(run: Path, dest: Path, change: Callable[[Shards, dict], None]) -> Path:
    """A copy of the run's checkpoint with ``change`` applied to its tensors and manifest,
    resealed (file sizes, sha256 and the manifest's checksum recomputed): only the assembly
    checks can refuse it."""
    src = _ckpt(run)
    ckpt = dest / "checkpoints" / src.name
    ckpt.mkdir(parents=True)
    manifest = read_manifest(src)
    shards = {name: load_file(src / name) for name in manifest["files"]}
    change(shards, manifest)
    for name, tensors in shards.items():
        save_file(tensors, str(ckpt / name))
        manifest["files"][name] = file_entry_of(ckpt / name)
    write_manifest(ckpt, manifest)
    return ckpt


def _sliced(shards: Shards) -> tuple[str, str]:
    """rank 1's first sliced model piece: (its name, the key)."""
    name = next(n for n in sorted(shards["rank00001.safetensors"]) if n.startswith("model/")
                and "@" in n)
    return name, name[len("model/"):].split("@")[0]


def _rename(shards: Shards, old: str, new: str, value: torch.Tensor | None = None) -> None:
    t = shards["rank00001.safetensors"].pop(old)
    shards["rank00001.safetensors"][new] = t if value is None else value


def _gap(s: Shards, m: dict) -> None:
    del s["rank00001.safetensors"][_sliced(s)[0]]


def _same_count_other_positions(s: Shards, m: dict) -> None:
    name, _ = _sliced(s)  # w@d:n:2n moved onto w@d:0:n: the count is full, half is missing
    dim, start, stop = name.split("@")[1].split(":")
    _rename(s, name, name.replace(f"@{dim}:{start}:{stop}", f"@{dim}:0:{start}"))


def _overlap(s: Shards, m: dict) -> None:
    name, _ = _sliced(s)
    dim, start, stop = (int(x) for x in name.split("@")[1].split(":"))
    _rename(s, name, name.replace(f"@{dim}:{start}:{stop}", f"@{dim}:{start - 1}:{stop - 1}"))


def _past_the_end(s: Shards, m: dict) -> None:
    name, _ = _sliced(s)
    dim, start, stop = (int(x) for x in name.split("@")[1].split(":"))
    _rename(s, name, name.replace(f"@{dim}:{start}:{stop}", f"@{dim}:{start + 1}:{stop + 1}"))


def _bad_dim(s: Shards, m: dict) -> None:
    name, _ = _sliced(s)
    dim = name.split("@")[1].split(":")[0]
    _rename(s, name, name.replace(f"@{dim}:", "@7:"))


def _int8(s: Shards, m: dict) -> None:
    name, _ = _sliced(s)
    s["rank00001.safetensors"][name] = s["rank00001.safetensors"][name].to(torch.int8)


def _huge_shape(s: Shards, m: dict) -> None:
    _, key = _sliced(s)
    entry = next(e for e in m["model_state"] if e[0] == key)
    entry[1] = [1 << 25, 1 << 25]


def _missing_whole_piece(s: Shards, m: dict) -> None:
    del s["rank00000.safetensors"]["model/norm.weight"]


def _duplicate_other_values(s: Shards, m: dict) -> None:
    s["rank00001.safetensors"]["model/norm.weight"] = s["rank00000.safetensors"][
        "model/norm.weight"] + 1


def _piece_of_no_entry(s: Shards, m: dict) -> None:
    s["rank00001.safetensors"]["model/ghost.weight"] = torch.zeros(3)


def _whole_beside_slices(s: Shards, m: dict) -> None:
    _, key = _sliced(s)
    shape = next(e[1] for e in m["model_state"] if e[0] == key)
    s["rank00001.safetensors"][f"model/{key}"] = torch.zeros(shape)


def _unknown_dtype(s: Shards, m: dict) -> None:
    m["model_state"][0][2] = "torch.float99"


CASES = {"gap": _gap, "two pieces at one position": _same_count_other_positions,
         "overlap, the count covered": _overlap, "slice past its tensor": _past_the_end,
         "no such dim": _bad_dim,
         "int8 piece of a float32 entry": _int8, "2^50-element shape": _huge_shape,
         "missing piece": _missing_whole_piece,
         "duplicated piece, other values": _duplicate_other_values,
         "piece of no entry": _piece_of_no_entry, "whole piece beside slices": _whole_beside_slices,
         "unknown dtype in the manifest": _unknown_dtype}


def test_an_untouched_rewrite_assembles_bit_identically(run: Path, tmp_path: Path) -> None:
    clean = _crafted(run, tmp_path, lambda s, m: None)
    want, got = assemble_full_state(_ckpt(run), read_manifest(_ckpt(run))), \
        assemble_full_state(clean, read_manifest(clean))
    assert list(got) == list(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("case", CASES)
def test_every_crafted_checkpoint_is_refused_in_one_line(
        run: Path, tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Property: each mutation is refused by the export path (assemble_full_state), the resume
    path (PieceReader) and the CLI (one line naming the checkpoint), nothing assembled."""
    ckpt = _crafted(run, tmp_path, CASES[case])
    with pytest.raises(CheckpointError) as export_error:
        assemble_full_state(ckpt, read_manifest(ckpt))
    message = str(export_error.value)
    assert str(ckpt) in message and "\n" not in message, message
    if case != "unknown dtype in the manifest":  # refused by read_manifest, before a reader
        # (a KeyError for a piece not there at all: Checkpointer.restore names the checkpoint)
        with pytest.raises((CheckpointError, KeyError)):
            manifest = read_manifest(ckpt)
            reader = PieceReader(ckpt, manifest, "model/")
            for key, _, _ in manifest["model_state"]:
                reader[key]
    out = tmp_path.with_name(f"{tmp_path.name}-m.safetensors")  # not inside the run
    assert main(["export", str(ckpt), "--out", str(out)]) == 2
    assert str(ckpt) in _one_line(capsys)
    assert not out.exists()


def test_live_assembly_refuses_gaps_and_broadcastable_pieces() -> None:
    """The in-memory gather (runtime/assemble.py): slices that do not tile their dim, or a
    piece that would broadcast into its place, are refused instead of leaving memory unset."""
    from subnetdp.runtime.assemble import assemble
    from subnetdp.subnet.pieces import Piece

    def piece(start: int, stop: int, rows: int | None = None) -> Piece:
        return Piece("w", 0, 0, start, stop, (stop - start if rows is None else rows, 3),
                     torch.float32, True)

    whole = torch.arange(12.0).view(4, 3)
    tiled = [piece(0, 2), piece(2, 4)]
    parts = [{"w@0:0:2": whole[:2]}, {"w@0:2:4": whole[2:]}]
    assert torch.equal(assemble(parts, tiled, ["w"])["w"], whole)
    gap = [piece(0, 2), piece(3, 5)]
    with pytest.raises(RuntimeError, match="do not tile dim 0"):
        assemble([{"w@0:0:2": whole[:2]}, {"w@0:3:5": whole[2:]}], gap, ["w"])
    with pytest.raises(RuntimeError, match=r"arrived as \(1, 3\)"):
        assemble([{"w@0:0:2": whole[:1]}, {"w@0:2:4": whole[2:]}], tiled, ["w"])
