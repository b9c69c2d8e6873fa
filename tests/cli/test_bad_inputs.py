"""Bad input gets one clear line from the launching process and loses nothing.

Each case runs ``subnetdp ...`` in this process (fast: refused before any worker starts) and
asserts: exit code != 0, stderr one line (argparse: its usage, then one ``error:`` line)
without a traceback, naming what to fix (``expect``), no ``--out`` created, and an existing
run folder byte-for-byte unchanged. ``benchmarks/faults.py`` counts the outcomes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.faults.harness import clear_message, fingerprint, run_cli

T = ["train", "--nproc", "2", "--steps", "2", "--no-progress"]
TB = [*T, "--strategy", "b-sdp"]
TN = [*T, "--strategy", "n-sdp"]

# (id, argv with {d} = prepared inputs, {out} = a fresh --out, expected text in the message)
CASES: list[tuple[str, list[str], str]] = [
    # -- train: numbers out of range (the silent ones first: they used to be accepted)
    ("vocab-size-0", [*T, "--vocab-size", "0"], "--vocab-size"),
    ("vocab-size-neg", [*T, "--vocab-size", "-3"], "--vocab-size"),
    ("vocab-size-1", [*T, "--vocab-size", "1"], "--vocab-size"),
    ("grad-clip-neg", [*T, "--grad-clip", "-1"], "--grad-clip"),
    ("grad-clip-nan", [*T, "--grad-clip", "nan"], "--grad-clip"),
    ("grad-clip-inf", [*T, "--grad-clip", "inf"], "--grad-clip"),
    ("warmup-neg", [*T, "--warmup", "-5"], "--warmup"),
    ("weight-decay-neg", [*T, "--weight-decay", "-0.1"], "--weight-decay"),
    ("weight-decay-nan", [*T, "--weight-decay", "nan"], "--weight-decay"),
    ("lr-nan", [*T, "--lr", "nan"], "--lr"),
    ("lr-inf", [*T, "--lr", "inf"], "--lr"),
    ("lr-zero", [*T, "--lr", "0"], "--lr"),
    ("lr-neg", [*T, "--lr", "-0.1"], "--lr"),
    ("steps-0", [*T[:-3], "--steps", "0"], "--steps"),
    ("steps-neg", [*T[:-3], "--steps", "-4"], "--steps"),
    ("nproc-0", ["train", "--nproc", "0", "--steps", "2"], "--nproc"),
    ("nproc-neg", ["train", "--nproc", "-2", "--steps", "2"], "--nproc"),
    ("coverage-0", [*TB, "--coverage", "0"], "--coverage"),
    ("coverage-big", [*TB, "--coverage", "1.5"], "--coverage"),
    ("coverage-neg", [*TB, "--coverage", "-0.2"], "--coverage"),
    ("coverage-nan", [*TB, "--coverage", "nan"], "--coverage"),
    ("coverage-below-min", [*TB, "--coverage", "0.01"], "coverage"),
    ("batch-0", [*T, "--batch-size", "0"], "--batch-size"),
    ("batch-neg", [*T, "--batch-size", "-8"], "--batch-size"),
    ("seq-1", [*T, "--seq-len", "1"], "--seq-len"),
    ("seq-0", [*T, "--seq-len", "0"], "--seq-len"),
    ("seq-huge", [*T, "--seq-len", "100000000"], "--seq-len"),
    ("log-every-0", [*T, "--log-every", "0"], "--log-every"),
    ("eval-batches-0", [*T, "--eval-batches", "0"], "--eval-batches"),
    ("eval-batches-neg", [*T, "--eval-batches", "-3"], "--eval-batches"),
    ("ckpt-every-neg", [*T, "--ckpt-every", "-1"], "--ckpt-every"),
    ("ckpt-keep-0", [*T, "--ckpt-keep", "0"], "--ckpt-keep"),
    ("max-restarts-neg", [*T, "--max-restarts", "-1"], "--max-restarts"),
    ("bucket-cap-0", [*T, "--bucket-cap-mb", "0"], "--bucket-cap-mb"),
    ("bucket-cap-nan", [*T, "--bucket-cap-mb", "nan"], "--bucket-cap-mb"),
    ("timeout-0", [*T, "--collective-timeout", "0"], "--collective-timeout"),
    ("timeout-neg", [*T, "--collective-timeout", "-5"], "--collective-timeout"),
    ("timeout-nan", [*T, "--collective-timeout", "nan"], "--collective-timeout"),
    ("stochastic-depth-1", [*T, "--strategy", "ddp", "--stochastic-depth", "1"],
     "--stochastic-depth"),
    ("stochastic-depth-sdp", [*TB, "--stochastic-depth", "0.2"], "--stochastic-depth"),
    ("neuron-dropout-neg", [*T, "--strategy", "ddp", "--neuron-dropout", "-0.1"],
     "--neuron-dropout"),
    ("neuron-groups-0", [*TN, "--neuron-groups", "0"], "--neuron-groups"),
    ("min-holders-0", [*TB, "--min-holders", "0"], "--min-holders"),
    ("refresh-every-0", [*T, "--strategy", "bb-sdp", "--refresh-every", "0"], "refresh"),
    ("sync-every-0", [*TB, "--sync-every", "0"], "--sync-every"),
    ("sync-fragments", [*TB, "--sync-every", "4", "--sync-fragments", "3"], "--sync-fragments"),
    ("outer-lr-0", [*TB, "--sync-every", "4", "--outer-lr", "0"], "--outer-lr"),
    ("outer-momentum-1", [*TB, "--sync-every", "4", "--outer-momentum", "1"], "--outer-momentum"),
    ("sync-zero", [*TB, "--sync-every", "4", "--zero", "1"], "drop --zero"),
    ("sync-fsdp", [*TB, "--sync-every", "4", "--fsdp"], "drop --fsdp"),
    ("sync-eval-every", [*TB, "--sync-every", "4", "--eval-every", "6"], "--eval-every"),
    ("sync-ckpt-bb-sdp", [*T, "--strategy", "bb-sdp", "--sync-every", "4", "--ckpt-every", "2"],
     "--sync-every x --refresh-every"),
    ("ckpt-vs-refresh", [*T, "--strategy", "bb-sdp", "--refresh-every", "2",
                         "--ckpt-every", "3"], "--refresh-every"),
    ("fsdp-baseline-ckpt", [*T, "--strategy", "ddp", "--fsdp", "--ckpt-every", "1"],
     "plain FSDP2 baseline"),
    ("ac-with-stochastic-depth", [*T, "--strategy", "ddp", "--ac", "--stochastic-depth",
                                  "0.1"], "--ac"),
    ("seed-neg", [*T, "--seed", "-1"], "--seed"),
    # -- train: errors that blamed the wrong thing (issue 41, item 7)
    ("model-arg-nan", [*T, "--model-arg", "norm_eps=NaN"],
     "--model-arg norm_eps=nan: not a finite number"),
    ("dataset-hub-name", [*T, "--dataset", "imdb"],
     "--dataset imdb is neither a local dataset folder nor a builder"),
    ("dataset-hub-name-files", [*T, "--dataset", "imdb", "--data-files", "{d}/one-doc/only.txt"],
     "--dataset imdb is neither a local dataset folder nor a builder"),
    ("data-dir-symlink-loop", [*T, "--data-dir", "{d}/loop"],
     "loop: Too many levels of symbolic links; a symbolic link there points back"),
    ("timeout-huge", [*T, "--collective-timeout", "1e300"],
     "--collective-timeout must be a number of seconds in (0, 604800]"),
    ("memory-gb-nan", [*T, "--memory-gb", "nan,nan"],
     "--memory-gb needs one finite positive value per worker, got [nan, nan]"),
    ("init-from-heads-0", [*T, "--init-from", "{d}/hf-heads-0"],
     "hf-heads-0: config.json has num_attention_heads 0; it must be a whole number > 0"),
    ("init-from-truncated", [*T, "--init-from", "{d}/hf-truncated"],
     "hf-truncated: model.safetensors cannot be read as safetensors"),
    ("config-eval-tasks-string", [*T, "--config", "{d}/eval-tasks.toml"],
     'eval_tasks = "arc_easy" is not a list of strings; write eval_tasks = ["arc_easy"]'),
    # -- train: argparse-level
    ("steps-text", [*T[:-3], "--steps", "abc"], "--steps"),
    ("lr-text", [*T, "--lr", "fast"], "--lr"),
    ("dtype-unknown", [*T, "--dtype", "fp8"], "--dtype"),
    ("strategy-unknown", [*T, "--strategy", "zero-sdp"], "strategy"),
    ("device-unknown", [*T, "--device", "tpu"], "--device"),
    ("option-unknown", [*T, "--learning-rate", "1"], "unrecognized"),
    # -- train: recipe and model
    ("recipe-unknown", [*T, "--recipe", "llama-99b"], "llama-99b"),
    ("model-arg-unknown", [*T, "--model-arg", "bogus=3"], "bogus"),
    ("model-arg-no-equals", [*T, "--model-arg", "dim"], "--model-arg"),
    ("model-arg-empty-key", [*T, "--model-arg", "=3"], "--model-arg"),
    ("model-arg-text-for-int", [*T, "--model-arg", "n_layers=many"], "n_layers"),
    ("model-arg-heads", [*T, "--model-arg", "n_heads=3"], "n_heads"),
    ("model-arg-zero-layers", [*T, "--model-arg", "n_layers=0"], "units"),
    ("model-arg-small-vocab", [*T, "--model-arg", "vocab_size=10"], "vocab"),
    ("image-model-arg-unknown", ["train", "--recipe", "resnet18-fmnist", "--nproc", "2",
                                 "--steps", "2", "--model-arg", "bogus=1"], "bogus"),
    ("image-batch-too-big", ["train", "--recipe", "resnet18-fmnist", "--nproc", "2",
                             "--steps", "2", "--batch-size", "10000000"], "--batch-size"),
    ("image-data-dir-missing", ["train", "--recipe", "resnet18-fmnist", "--nproc", "2",
                                "--data-dir", "{d}/nowhere"], "nowhere"),
    # -- train: plan files
    ("plan-missing", [*TB, "--plan-file", "{d}/nowhere.json"], "nowhere.json"),
    ("plan-not-json", [*TB, "--plan-file", "{d}/not-json.json"], "JSON"),
    ("plan-empty", [*TB, "--plan-file", "{d}/empty.json"], "plan"),
    ("plan-wrong-world", [*TB, "--plan-file", "{d}/plan-world4.json"], "4"),
    ("plan-wrong-units", [*TB, "--plan-file", "{d}/plan-3-units.json"], "units"),
    ("plan-wrong-sizes", [*TB, "--plan-file", "{d}/plan-bad-sizes.json"], "sizes"),
    ("plan-wrong-names-nsdp", [*TN, "--plan-file", "{d}/plan-bad-names.json"], "plan"),
    ("plan-block-for-nsdp", [*TN, "--plan-file", "{d}/plan-block.json"], "plan"),
    ("plan-with-ddp", [*T, "--strategy", "ddp", "--plan-file", "{d}/plan-block.json"],
     "--plan-file"),
    ("plan-bad-matrix", [*TB, "--plan-file", "{d}/plan-bad-matrix.json"], "matrix"),
    ("plan-unit-unheld", [*TB, "--plan-file", "{d}/plan-unheld.json"], "holder"),
    # -- train: data
    ("data-dir-missing", [*T, "--data-dir", "{d}/nowhere"], "nowhere"),
    ("data-dir-empty", [*T, "--data-dir", "{d}/empty-dir"], "empty-dir"),
    ("data-dir-is-file", [*T, "--data-dir", "{d}/not-json.json"], "not-json.json"),
    ("one-document", [*T, "--data-dir", "{d}/one-doc", "--vocab-size", "300"], "document"),
    ("tokens-out-of-range", [*T, "--data-dir", "{d}/big-ids"], "token id"),
    ("tokens-too-few", [*T, "--data-dir", "{d}/few-tokens"], "tokens"),
    ("tokens-no-val", [*T, "--data-dir", "{d}/no-val", "--seq-len", "64"], "validation"),
    # -- train: device, output folder, resume
    ("out-under-file", [*T, "--out", "{d}/not-json.json/run"], "--out"),
    ("out-is-file", [*T, "--out", "{d}/not-json.json"], "--out"),
    ("out-not-writable", [*T, "--out", "/proc/subnetdp-run"], "--out"),
    ("resume-missing", ["train", "--resume", "{d}/nowhere"], "nowhere"),
    ("resume-no-checkpoints", ["train", "--resume", "{d}/empty-dir"], "checkpoint"),
    ("resume-not-a-run", ["train", "--resume", "{d}/not-json.json"], "not-json.json"),
    # -- plan
    ("plan-world-0", ["plan", "--recipe", "llama-tiny", "--nproc", "0", "--coverage", "0.5"],
     "world"),
    ("plan-world-neg", ["plan", "--units", "4", "--nproc", "-2", "--coverage", "0.5"], "world"),
    ("plan-coverage-0", ["plan", "--units", "4", "--nproc", "2", "--coverage", "0"],
     "coverage"),
    ("plan-coverage-big", ["plan", "--units", "4", "--nproc", "2", "--coverage", "3"],
     "coverage"),
    ("plan-no-coverage", ["plan", "--units", "4", "--nproc", "2"], "--coverage"),
    ("plan-units-0", ["plan", "--units", "0", "--nproc", "2", "--coverage", "0.5"], "unit"),
    ("plan-recipe-unknown", ["plan", "--recipe", "gpt-5", "--nproc", "2", "--coverage",
                             "0.5"], "gpt-5"),
    ("plan-units-and-recipe", ["plan", "--units", "4", "--recipe", "llama-tiny"],
     "not allowed"),
    ("plan-scheme-unknown", ["plan", "--units", "4", "--scheme", "zigzag"], "--scheme"),
    ("plan-file-missing", ["plan", "--plan-file", "{d}/nowhere.json"], "nowhere.json"),
    ("plan-file-not-json", ["plan", "--plan-file", "{d}/not-json.json"], "JSON"),
    ("plan-min-holders-0", ["plan", "--units", "4", "--nproc", "2", "--coverage", "0.5",
                            "--min-holders", "0"], "holders"),
    ("plan-min-holders-big", ["plan", "--units", "4", "--nproc", "2", "--coverage", "0.5",
                              "--min-holders", "5"], "holders"),
    ("plan-capacities-bad", ["plan", "--units", "4", "--nproc", "2", "--scheme", "balanced",
                             "--capacities", "a,b"], "capacit"),
    ("plan-memory-gb-bad", ["plan", "budget", "--recipe", "llama-tiny", "--nproc", "2",
                            "--memory-gb", "lots"], "memory"),
    ("plan-memory-gb-nan", ["plan", "fit", "--recipe", "llama-tiny", "--nproc", "2",
                            "--memory-gb", "nan,nan"],
     "--memory-gb takes finite budgets > 0 GB, got nan,nan"),
    ("plan-save-unwritable", ["plan", "--units", "4", "--nproc", "2", "--coverage", "0.5",
                              "--out", "{d}/not-json.json/p.json"], "p.json"),
    # -- bench
    ("bench-world-0", ["bench", "comm", "--nproc", "0"], "world"),
    ("bench-world-neg", ["bench", "memory", "--nproc", "-1"], "world"),
    ("bench-coverage-0", ["bench", "comm", "--nproc", "2", "--coverage", "0"], "coverage"),
    ("bench-recipe-unknown", ["bench", "comm", "--recipe", "llama-99b"], "llama-99b"),
    ("bench-strategy-unknown", ["bench", "comm", "--strategy", "zero"], "strategy"),
    ("bench-strategies-unknown", ["bench", "step", "--strategies", "ddp,zero"], "zero"),
    ("bench-model-arg-unknown", ["bench", "comm", "--nproc", "2", "--model-arg", "bogus=1"],
     "bogus"),
    ("bench-model-arg-malformed", ["bench", "comm", "--model-arg", "dim"], "--model-arg"),
    ("bench-seq-too-long-memory", ["bench", "memory", "--nproc", "2"], "--seq-len"),
    ("bench-batch-0", ["bench", "memory", "--nproc", "2", "--batch-size", "0",
                       "--seq-len", "32"], "batch"),
    ("bench-warmup-low", ["bench", "step", "--nproc", "2", "--warmup", "1", "--seq-len", "32"],
     "--warmup"),
    ("bench-steps-0", ["bench", "step", "--nproc", "2", "--steps", "0", "--seq-len", "32"],
     "--steps"),
    ("bench-cuda-missing", ["bench", "step", "--nproc", "2", "--device", "cuda", "--seq-len",
                            "32"], "cuda"),
    ("bench-what-unknown", ["bench", "speed"], "speed"),
    # -- export / eval / compare
    ("export-missing", ["export", "{d}/nowhere", "--out", "{out}.safetensors"], "nowhere"),
    ("export-no-checkpoints", ["export", "{d}/empty-dir", "--out", "{out}.safetensors"],
     "checkpoint"),
    ("export-no-out", ["export", "{d}/empty-dir"], "--out"),
    ("eval-missing", ["eval", "{d}/nowhere"], "nowhere"),
    ("eval-no-checkpoints", ["eval", "{d}/empty-dir"], "checkpoint"),
    ("eval-not-safetensors", ["eval", "{d}/not-json.json"], "not-json.json"),
    ("compare-suite-unknown", ["compare", "--suite", "speed"], "--suite"),
    ("compare-tasks-unknown", ["compare", "--tasks", "chess", "--out", "{out}"], "chess"),
    ("compare-seeds-bad", ["compare", "--seeds", "x", "--out", "{out}"], "seeds"),
    ("compare-steps-0", ["compare", "--steps", "0", "--out", "{out}"], "steps"),
]
if torch.cuda.is_available():
    CASES = [c for c in CASES if "cuda" not in c[0]]
else:
    CASES.append(("device-cuda-missing", [*T, "--device", "cuda"], "CUDA"))


def _write_pretokenised(root: Path, train: np.ndarray, val: np.ndarray | None,
                        vocab: int) -> None:
    root.mkdir(parents=True)
    train.astype(np.uint16).tofile(root / "train.bin")
    if val is not None:
        val.astype(np.uint16).tofile(root / "val.bin")
    (root / "meta.json").write_text(json.dumps({"vocab_size": vocab, "eot_id": 0}))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Bad files for the cases: plans, corpora, token files."""
    from subnetdp.cli import main

    d = tmp_path_factory.mktemp("bad-inputs")
    (d / "not-json.json").write_text("this is { not json")
    (d / "empty.json").write_text("{}")
    (d / "empty-dir").mkdir()
    assert main(["plan", "--recipe", "llama-tiny", "--nproc", "2", "--coverage", "0.5",
                 "--save", str(d / "plan-block.json")]) == 0
    assert main(["plan", "--recipe", "llama-tiny", "--nproc", "4", "--coverage", "0.5",
                 "--save", str(d / "plan-world4.json")]) == 0
    assert main(["plan", "--recipe", "llama-tiny", "--nproc", "2", "--coverage", "0.5",
                 "--strategy", "n-sdp", "--save", str(d / "plan-nsdp.json")]) == 0
    assert main(["plan", "--units", "3", "--nproc", "2", "--coverage", "0.5",
                 "--save", str(d / "plan-3-units.json")]) == 0
    block = json.loads((d / "plan-block.json").read_text())
    bad_sizes = {**block, "units": [{**u, "size": u["size"] + 7} for u in block["units"]]}
    (d / "plan-bad-sizes.json").write_text(json.dumps(bad_sizes))
    bad_matrix = {**block, "matrix": [[2] * len(block["units"])] * block["world"]}
    (d / "plan-bad-matrix.json").write_text(json.dumps(bad_matrix))
    unheld = {**block, "matrix": [[0] * len(block["units"])] * block["world"]}
    (d / "plan-unheld.json").write_text(json.dumps(unheld))
    nsdp = json.loads((d / "plan-nsdp.json").read_text())
    bad_names = {**nsdp, "units": [{**u, "name": f"nowhere.{i}[0]"}
                                   for i, u in enumerate(nsdp["units"])]}
    (d / "plan-bad-names.json").write_text(json.dumps(bad_names))
    (d / "one-doc").mkdir()
    (d / "one-doc" / "only.txt").write_text("the only document of this corpus. " * 400)
    rng = np.random.default_rng(0)
    _write_pretokenised(d / "big-ids", rng.integers(0, 1000, 20000), rng.integers(0, 50, 4000),
                        vocab=50)
    _write_pretokenised(d / "few-tokens", rng.integers(0, 50, 40), rng.integers(0, 50, 400),
                        vocab=50)
    _write_pretokenised(d / "no-val", rng.integers(0, 50, 4000), np.zeros(3), vocab=50)
    (d / "loop").symlink_to("loop")
    (d / "eval-tasks.toml").write_text('eval_tasks = "arc_easy"\n')
    _write_hf_folder(d / "hf-heads-0", num_attention_heads=0)
    _write_hf_folder(d / "hf-truncated")
    weights = (d / "hf-truncated" / "model.safetensors").read_bytes()
    (d / "hf-truncated" / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    return d


def _write_hf_folder(root: Path, **config: object) -> None:
    """An --init-from folder as far as its checks read (config, a tokenizer file, weights)."""
    from safetensors.torch import save_file

    root.mkdir()
    (root / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 256, "intermediate_size": 128,
        "max_position_embeddings": 64, **config}))
    (root / "tokenizer.json").write_text("{}")
    save_file({"model.embed_tokens.weight": torch.zeros(256, 64)},
              str(root / "model.safetensors"))


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder shaped like an earlier run (its files only need to stay byte-identical)."""
    run = tmp_path_factory.mktemp("earlier") / "run"
    (run / "metrics").mkdir(parents=True)
    (run / "metrics" / "rank0.jsonl").write_text('{"step": 0, "loss": 5.0}\n')
    (run / "config.json").write_text(json.dumps({"recipe": "llama-tiny"}))
    (run / "summary.json").write_text(json.dumps({"val_loss": 4.0}))
    return run


def _argv(argv: list[str], d: Path, out: Path) -> list[str]:
    args = [a.replace("{d}", str(d)).replace("{out}", str(out)) for a in argv]
    if args[0] == "train" and "--out" not in args and "--resume" not in args:
        args += ["--out", str(out)]
    return args


@pytest.mark.parametrize(("argv", "expect"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line(argv: list[str], expect: str, inputs: Path,
                                     tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "new-run"
    before = fingerprint(inputs)
    code, err = run_cli(_argv(argv, inputs, out), capsys)
    assert code != 0, f"accepted silently (exit 0); stderr: {err!r}"
    message = clear_message(err)
    assert message is not None, f"not one clear line:\n{err}"
    assert expect.lower() in message.lower(), message
    assert not out.exists() and not Path(f"{out}.safetensors").exists()
    assert fingerprint(inputs) == before


# Into an existing run's folder: the refusal leaves every byte of it as it was.
INTO_EXISTING = ["vocab-size-0", "lr-nan", "grad-clip-neg", "warmup-neg", "model-arg-unknown",
                 "plan-wrong-units", "coverage-below-min", "tokens-out-of-range", "one-document",
                 "seq-huge"]


@pytest.mark.parametrize("case", INTO_EXISTING)
def test_bad_input_leaves_an_existing_run_unchanged(case: str, inputs: Path,
                                                    existing_run: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    argv = next(c[1] for c in CASES if c[0] == case)
    before = fingerprint(existing_run)
    code, err = run_cli(_argv([*argv, "--out", str(existing_run)], inputs, existing_run),
                        capsys)
    assert code != 0 and clear_message(err) is not None, err
    assert fingerprint(existing_run) == before


def test_case_count() -> None:
    assert len(CASES) >= 100 and len({c[0] for c in CASES}) == len(CASES)


@pytest.fixture(autouse=True)
def _refused_before_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case must be refused before a worker starts: starting one fails the case."""
    import subnetdp.distributed.launch
    import subnetdp.train.elastic

    def launched(*args: object, **kwargs: object) -> None:
        raise AssertionError("workers were launched: the input was accepted")

    # elastic binds ``launch`` at import: patched there too, or a first import under this
    # fixture would keep the fake for every later test
    monkeypatch.setattr(subnetdp.distributed.launch, "launch", launched)
    monkeypatch.setattr(subnetdp.train.elastic, "launch", launched)
