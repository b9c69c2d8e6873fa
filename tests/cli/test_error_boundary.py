"""Every command has one error boundary (issue 27, root cause 7): whatever a malformed file,
folder or output path does to a command, the user gets exit code 2 and one line that names the
path, never a traceback. A table of inputs (missing, a folder for a file, empty, garbage bytes,
unreadable, an output that cannot be written) is fed to every path argument of every command."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import subnetdp.distributed.launch
import subnetdp.train.elastic
from tests.faults.harness import clear_message, run_cli

T = ["train", "--nproc", "2", "--steps", "2", "--no-progress"]

# (command, argv with {p}: the malformed path, {o}: a fresh output path)
POSITIONS: dict[str, list[str]] = {
    "train --config": [*T, "--config", "{p}.toml", "--out", "{o}"],
    "train --config json": [*T, "--config", "{p}.json", "--out", "{o}"],
    "train --plan-file": [*T, "--plan-file", "{p}", "--out", "{o}"],
    "train --tokenizer": [*T, "--tokenizer", "{p}", "--out", "{o}"],
    "train --data-dir": [*T, "--data-dir", "{p}", "--out", "{o}"],
    "train --resume": [*T, "--resume", "{p}"],
    "eval": ["eval", "{p}"],
    "eval safetensors": ["eval", "{p}.safetensors"],
    "export": ["export", "{p}", "--out", "{o}.safetensors"],
    "plot": ["plot", "{p}", "--out", "{o}.png"],
    "plan --plan-file": ["plan", "--plan-file", "{p}"],
}
# outputs: a path below a regular file can be written by no one (root included)
OUTPUTS: dict[str, list[str]] = {
    "train --out": [*T, "--out", "{blocked}/run"],
    "plan --out": ["plan", "--units", "4", "--nproc", "2", "--coverage", "0.5", "--out",
                   "{blocked}/plan.json"],
    "plot --out": ["plot", "{run}", "--out", "{blocked}/curves.png"],
    "compare --out": ["compare", "--suite", "quality", "--quick", "--runs", "{blocked}/runs"],
}
# `bench` takes no path; `export --out` is tested on a real run (tests/checkpoint)


def _make(kind: str, path: Path) -> None:
    """The malformed input ``kind`` at ``path`` (with any suffix the position adds)."""
    for p in (path, path.with_name(path.name + ".toml"), path.with_name(path.name + ".json"),
              path.with_name(path.name + ".safetensors")):
        if kind == "missing":
            continue
        if kind == "directory":
            p.mkdir()
        elif kind == "empty":
            p.write_bytes(b"")
        elif kind == "garbage":
            p.write_bytes(bytes(range(256)) * 4)
        elif kind == "unreadable":
            p.write_text("{}")
            p.chmod(0)


KINDS = ["missing", "directory", "empty", "garbage", "unreadable"]


@pytest.fixture(autouse=True)
def _refused_before_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def launched(*args: object, **kwargs: object) -> None:
        raise AssertionError("workers were launched: the input was accepted")

    monkeypatch.setattr(subnetdp.distributed.launch, "launch", launched)
    monkeypatch.setattr(subnetdp.train.elastic, "launch", launched)


def _one_line(code: int, err: str, names: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err, err
    message = clear_message(err)
    assert message is not None, err
    assert names in message, f"{names!r} not named in: {message}"
    return message


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("position", sorted(POSITIONS))
def test_a_malformed_input_is_one_line_naming_it(position: str, kind: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    if kind == "unreadable" and os.geteuid() == 0:
        pytest.skip("root reads any file")
    bad = tmp_path / "input"
    _make(kind, bad)
    argv = [a.replace("{p}", str(bad)).replace("{o}", str(tmp_path / "out"))
            for a in POSITIONS[position]]
    code, err = run_cli(argv, capsys)
    _one_line(code, err, str(bad))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("position", sorted(OUTPUTS))
def test_an_output_that_cannot_be_written_is_one_line_naming_it(
        position: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    run = tmp_path / "run"  # a run with a loss curve to plot
    run.joinpath("metrics").mkdir(parents=True)
    run.joinpath("metrics", "rank0.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    argv = [a.replace("{blocked}", str(blocked)).replace("{run}", str(run))
            for a in OUTPUTS[position]]
    code, err = run_cli(argv, capsys)
    _one_line(code, err, str(blocked))


# -- the samples -------------------------------------------------------------------------
def _export(path: Path, *, drop: str | None = None, config: dict[str, object] | None = None
            ) -> None:
    """An export file as `subnetdp export` writes it, of a small llama-tiny."""
    import json

    from safetensors.torch import save_file

    from subnetdp.checkpoint.export import EXPORT_FORMAT
    from subnetdp.models import get_recipe

    overrides = {"vocab_size": 300, "max_seq_len": 32}
    state = get_recipe("llama-tiny").build_model(**overrides).state_dict()
    state = {k: v.contiguous() for k, v in state.items() if k != drop}
    save_file(state, str(path), metadata={
        "format": EXPORT_FORMAT, "recipe": "llama-tiny", "step": "2",
        "model_overrides": json.dumps(overrides),
        "config": json.dumps({"recipe": "llama-tiny", "config_version": 2, **(config or {})})})


def test_eval_of_an_export_missing_a_tensor(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "model.safetensors"
    _export(path, drop="output.weight")
    message = _one_line(*run_cli(["eval", str(path), "--device", "cpu"], capsys), str(path))
    assert "missing or misshapen output.weight" in message


def test_eval_of_an_export_with_a_newer_config_key(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "model.safetensors"
    _export(path, config={"flux_capacitor": 1})
    message = _one_line(*run_cli(["eval", str(path)], capsys), str(path))
    assert "flux_capacitor" in message and "newer subnetdp" in message


@pytest.mark.parametrize("line", ['{"step": 2, "loss": 4.0', "[1, 2]", '{"step": "two"}',
                                  '{"loss": 4.0}'])
def test_plot_of_a_bad_metrics_line(line: str, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A damaged line between good ones is named, never silently left out of the curve."""
    run = tmp_path / "run"
    run.joinpath("metrics").mkdir(parents=True)
    metrics = run / "metrics" / "rank0.jsonl"
    metrics.write_text(f'{{"step": 1, "loss": 5.0}}\n{line}\n{{"step": 3, "loss": 3.0}}\n')
    _one_line(*run_cli(["plot", str(run), "--out", str(tmp_path / "c.png")], capsys), str(run))
    assert not (tmp_path / "c.png").exists()


def test_a_full_disk_while_metrics_are_written_names_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/full answers every write with ENOSPC, as a full disk does."""
    import builtins

    from subnetdp.commands.boundary import os_error_line
    from subnetdp.metrics import sinks

    path = tmp_path / "metrics" / "rank0.jsonl"
    monkeypatch.setattr(sinks, "append_text",
                        lambda *a, **k: builtins.open("/dev/full", "a"))  # noqa: SIM115
    sink = sinks.JsonlSink(path)
    with pytest.raises(OSError) as info:
        sink.log(1, {"loss": 1.0})
    assert info.value.filename == str(path)
    line = f"OSError: {info.value}"  # what a worker's summary line shows
    assert str(path) in line and "No space left on device" in line and "--out" in line
    assert os_error_line(info.value).startswith(f"{path}: No space left on device")
    with pytest.raises(OSError, match=r"rank0\.jsonl"):  # the buffered line, on close
        sink.close()


def test_a_tokenizer_regex_that_backtracks_without_end_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """Oniguruma gives up on ``(a|aa)*$`` over a long run of "a" and tokenizers panics: Rust's
    report (a backtrace under RUST_BACKTRACE) stays off the terminal, the line names the file
    ([Note: a panic in tokenizers])."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.train_from_iterator(["hello world"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(a|aa)*$"), "isolated")
    crafted = tmp_path / "crafted-tokenizer.json"
    tok.save(str(crafted))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("a" * 60 + "!")
    (corpus / "b.txt").write_text("hello world. " * 400)
    monkeypatch.setenv("SUBNETDP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("RUST_BACKTRACE", "1")
    code, err = run_cli([*T, "--tokenizer", str(crafted), "--data-dir", str(corpus), "--out",
                         str(tmp_path / "out")], capfd)  # fd 2: Rust writes there
    message = _one_line(code, err, f"{crafted}: the tokenizer failed while encoding the corpus "
                        "(Onig: Regex search error: retry-limit-in-match over)")
    assert "fix that tokenizer.json" in message


@pytest.mark.parametrize(("builder", "name", "text"), [
    ("json", "bad.jsonl", '{"text": "one"}\n{"text": "two\n'),
    ("csv", "bad.csv", 'text,label\n"unclosed,1\n'),
    ("json", "binary.json", "\x00\x01\xff garbage"),
])
def test_a_malformed_dataset_file_is_one_line_naming_it(
        builder: str, name: str, text: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / name
    path.write_text(text)
    code, err = run_cli([*T, "--dataset", builder, "--data-files", str(path), "--out",
                         str(tmp_path / "out")], capsys)
    _one_line(code, err, str(path))


def test_a_survivor_of_a_dead_rank_says_so_not_internal_error(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Under torchrun every rank runs the command itself: the survivors of a rank that died
    fail in a collective with gloo's "connection closed by peer", which is not a bug."""
    import argparse

    from subnetdp.commands.boundary import run_command

    def lost(_: argparse.Namespace) -> int:
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
                           "closed by peer [127.0.0.1]:41234")

    def bug(_: argparse.Namespace) -> int:
        raise RuntimeError("shape mismatch in a block")

    monkeypatch.setenv("RANK", "3")
    assert run_command(argparse.Namespace(command="train", func=lost)) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "internal error" not in err, err
    assert err.startswith("subnetdp train: rank 3 lost its connection to another rank ("), err
    assert "--resume" in err
    assert run_command(argparse.Namespace(command="train", func=bug)) == 1
    assert "internal error RuntimeError: shape mismatch" in capsys.readouterr().err
