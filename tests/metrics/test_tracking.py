"""Issue 18's pieces one by one: the sinks, peak FLOPs, config files, token ids, datasets,
plots and packaging."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import tomllib

import subnetdp
from subnetdp.commands.train_cmd import add_parser, config_from_args
from subnetdp.data.ids import check_token_range, token_dtype
from subnetdp.metrics.tracking import GLOBAL_AVG_LOSS, MAX_ACTIVE, Tracker, check_sinks, peak_flops
from subnetdp.train.config_file import load_config_file

ROOT = Path(__file__).resolve().parents[2]


def test_tensorboard_events_are_written_and_readable(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracker(tmp_path, tensorboard=True)
    for step in range(3):
        tracker.log(step, {GLOBAL_AVG_LOSS: 5.0 - step, "note": "text", "nan": float("nan")})
    tracker.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert acc.Tags()["scalars"] == [GLOBAL_AVG_LOSS]  # only finite numbers reach the sinks
    assert [(e.step, e.value) for e in acc.Scalars(GLOBAL_AVG_LOSS)] == [(0, 5), (1, 4), (2, 3)]


def test_wandb_runs_offline(tmp_path: Path, monkeypatch) -> None:
    import wandb  # noqa: F401  (the wandb extra: missing, this must fail)

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracker(tmp_path / "run", wandb_project="subnetdp-test", config={"lr": 1e-3})
    tracker.log(0, {GLOBAL_AVG_LOSS: 2.0})
    tracker.close()
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


def test_missing_sink_package_is_named(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"subnetdp\[tensorboard\]"):
        check_sinks(tensorboard=True, wandb=False)
    check_sinks(tensorboard=False, wandb=False)


def test_peak_flops() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3", None) == 989e12
    assert peak_flops(None, 2.0) == 2e12
    assert peak_flops(None, None) is None and peak_flops("Some GPU", None) is None


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", *argv])
    args.argv = argv
    return args


def test_toml_config_with_command_line_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[train]\nrecipe = "llama-tiny"\nstrategy = "n-sdp"\nsteps = 7\n'
                 'batch-size = 3\nnproc = 2\n[train.model_args]\nn_layers = 2\n')
    cfg = config_from_args(_args(["--config", str(f), "--steps", "9", "--coverage", "0.5"]))
    assert (cfg.strategy, cfg.steps, cfg.batch_size, cfg.nproc) == ("n-sdp", 9, 3, 2)
    assert cfg.coverage == 0.5 and cfg.model_args == {"n_layers": 2}
    assert cfg.out == "runs/llama-tiny-n-sdp"
    cfg = config_from_args(_args(["--config", str(f), "--model-arg", "n_layers=4"]))
    assert cfg.model_args == {"n_layers": 4}


def test_config_json_of_a_run_and_bad_files(tmp_path: Path) -> None:
    run = tmp_path / "config.json"
    run.write_text(json.dumps({"recipe": "llama-tiny", "steps": 5, "resume": "runs/x"}))
    assert load_config_file(run) == {"recipe": "llama-tiny", "steps": 5}  # a replay: no resume
    bad = tmp_path / "bad.toml"
    bad.write_text("stepz = 3\n")
    with pytest.raises(ValueError, match=r"unknown option.*stepz"):
        load_config_file(bad)
    with pytest.raises(ValueError, match="no such file"):
        load_config_file(tmp_path / "none.toml")
    (tmp_path / "c.yaml").write_text("")
    with pytest.raises(ValueError, match=r"use a \.toml file"):
        load_config_file(tmp_path / "c.yaml")


def test_token_dtype_and_range_check() -> None:
    assert token_dtype(50257) is np.uint16 and token_dtype(128_256) is np.uint32
    check_token_range(np.arange(10, dtype=np.uint32), 10, source="x")
    with pytest.raises(ValueError, match=r"token id 10, outside the vocabulary of 10 ids; "
                                         r"pass --vocab-size 11"):
        check_token_range(np.arange(11, dtype=np.uint32), 10, source="x")


def test_datasets_source_reads_a_field(tmp_path: Path, monkeypatch) -> None:
    import datasets  # noqa: F401  (the data extra)

    from subnetdp.data.hf import hf_documents

    monkeypatch.setenv("SUBNETDP_CACHE", str(tmp_path / "cache"))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["one doc", "", "two doc"], "n": [1, 2, 3]}),
                   tmp_path / "a.parquet")
    docs = hf_documents(None, [str(tmp_path / "*.parquet")], text_field="body")
    assert [d.text for d in docs] == ["one doc", "two doc"]
    with pytest.raises(ValueError, match=r"no field 'text'.*--text-field"):
        hf_documents("parquet", [str(tmp_path / "a.parquet")])


def test_plot_command(tmp_path: Path) -> None:
    import matplotlib  # noqa: F401  (the dev extra)

    from subnetdp.cli import main

    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    (run / "metrics" / "rank0.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 3.0 - s / 10, GLOBAL_AVG_LOSS: 3.0 - s / 10,
                    MAX_ACTIVE: 0.5}) + "\n" for s in range(5)))
    (run / "metrics" / "val.jsonl").write_text(json.dumps({"step": 4, "val_loss": 2.9}) + "\n")
    assert main(["plot", str(run), str(run), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["plot", str(tmp_path)]) == 2


def test_packaging_files() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert "version" in pyproject["project"]["dynamic"]  # the one __version__
    assert subnetdp.__version__ in (ROOT / "CHANGELOG.md").read_text()
    assert (ROOT / "src" / "subnetdp" / "py.typed").exists()
    assert any(d.startswith("safetensors") for d in pyproject["project"]["dependencies"])
    for doc in ("method", "architecture", "data"):
        assert (ROOT / "docs" / f"{doc}.md").exists()
    assert "shared/docs" not in (ROOT / "README.md").read_text()
