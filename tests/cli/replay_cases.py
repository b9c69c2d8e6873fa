"""The configurations a run may be given, and how main's code resolved them
(tests/cli/data/replay_expected.json): every TOML file of docs/ and README.md, the TOML files
of tests/cli/data/replay/, run config.json files of config_version 1 and 2 (written from the
runs below), and command lines over the train options. ``test_config_replay`` compares.

Regenerate the expectation from a tree's code (only when a change of the resolved run is
meant): ``PYTHONPATH=TREE/src:. python -m tests.cli.replay_cases --write``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "cli" / "data"
EXPECTED = DATA / "replay_expected.json"
OUT = ["--out", "runs/replayed"]

# command lines: (name, argv after `train`)
ARGV: dict[str, list[str]] = {
    "defaults": [],
    "readme-first-run": ["--recipe", "llama-tiny", "--nproc", "4", "--strategy", "b-sdp",
                         "--coverage", "0.5"],
    "plan-options": ["--strategy", "b-sdp", "--coverage", "0.75", "--scheme", "random",
                     "--min-holders", "2", "--max-groups", "2", "--seed", "7", "--nproc", "8"],
    "balanced": ["--scheme", "balanced", "--balance", "memory", "--nproc", "4"],
    "capacities": ["--capacities", "1,0.5,0.5,0.5", "--nproc", "4"],
    "neurons": ["--strategy", "nb-sdp", "--neuron-groups", "8", "--neuron-kinds", "ffn",
                "--rotate", "--refresh-every", "2", "--ckpt-every", "4"],
    "composition": ["--strategy", "b-sdp", "--fsdp", "--ac", "--compile", "--dtype", "bf16",
                    "--reduce-dtype", "fp32", "--bucket-cap-mb", "12.5", "--no-tf32",
                    "--device", "cuda"],
    "zero": ["--strategy", "bb-sdp", "--zero", "1"],
    "optim": ["--lr", "0.01", "--warmup", "7", "--weight-decay", "0.2", "--grad-clip", "0.5",
              "--steps", "12", "--batch-size", "3", "--seq-len", "32", "--vocab-size", "300"],
    "ckpt": ["--ckpt-every", "5", "--ckpt-keep", "1", "--no-final-ckpt", "--max-restarts", "2",
             "--min-nproc", "2", "--no-rescue", "--nproc", "4", "--collective-timeout", "60",
             "--overwrite"],
    "tracking": ["--log-every", "2", "--no-progress", "--eval-every", "3", "--eval-batches",
                 "2", "--memory-step", "-1", "--peak-tflops", "100", "--tensorboard",
                 "--wandb", "--wandb-project", "x"],
    "data": ["--dataset", "json", "--data-files", "a.jsonl", "--data-files", "b.jsonl",
             "--text-field", "body", "--tokenizer", "gpt2", "--model-arg", "n_layers=2",
             "--model-arg", "dim=32"],
    "ddp-baselines": ["--strategy", "ddp", "--stochastic-depth", "0.1", "--neuron-dropout",
                      "0.2"],
    "n-sdp-scaling": ["--strategy", "n-sdp", "--output-scaling", "none", "--coverage", "0.25"],
    "images": ["--recipe", "resnet18-fmnist", "--strategy", "b-sdp", "--batch-size", "16"],
    "eval-tasks": ["--eval-tasks", "arc_easy,sciq", "--eval-limit", "4"],
    "memory-gb": ["--memory-gb", "40,40", "--comm-mem-mb", "8", "--nproc", "2"],
}
# runs whose config.json is replayed (each becomes a version-2 and a version-1 file)
RECORDED = ("defaults", "neurons", "composition", "ckpt", "data")


def doc_tomls() -> dict[str, str]:
    """Every ```toml block of README.md and docs/*.md, by file and position."""
    out = {}
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, block in enumerate(re.findall(r"```toml\n(.*?)```", md.read_text(), re.S)):
            out[f"{md.relative_to(ROOT)}#{i}"] = block
    return out


def _args(argv: list[str]) -> argparse.Namespace:
    from subnetdp.cli import build_parser

    args = build_parser().parse_args(["train", *argv])
    args.argv = ["train", *argv]
    return args


def resolve(argv: list[str]) -> dict[str, Any]:
    """The run ``subnetdp train ARGV`` trains, as its config.json records it."""
    from subnetdp.commands.train_cmd import config_from_args

    d: dict[str, Any] = config_from_args(_args([*argv, *OUT])).resolved().to_dict()
    return dict(sorted(d.items()))


def recorded(name: str, version: int) -> dict[str, Any]:
    """The config.json the run ``ARGV[name]`` records, as ``config_version`` ``version``
    writes it (1: no version, "bf16" for bf16-mixed)."""
    d = dict(EXPECTED_RUNS()[name])
    if version == 1:
        del d["config_version"]
        d["dtype"] = {"bf16-mixed": "bf16", "bf16": "bf16"}.get(d["dtype"], d["dtype"])
    return d


def EXPECTED_RUNS() -> dict[str, dict[str, Any]]:
    return json.loads(EXPECTED.read_text())["argv"]


def cases(tmp: Path) -> dict[str, list[str]]:
    """Every case as a command line; files it reads are written under ``tmp``."""
    out = {f"argv:{k}": v for k, v in ARGV.items()}
    for name, text in doc_tomls().items():
        f = tmp / (re.sub(r"\W", "_", name) + ".toml")
        f.write_text(text)
        out[f"doc:{name}"] = ["--config", str(f)]
    for f in sorted((DATA / "replay").glob("*.toml")):
        out[f"toml:{f.name}"] = ["--config", str(f)]
    return out


def config_json_cases(tmp: Path) -> dict[str, list[str]]:
    out = {}
    for name in RECORDED:
        for version in (1, 2):
            d = recorded(name, version)
            if version == 1 and d["dtype"] == "bf16":
                continue  # pure bf16 has no version-1 spelling
            f = tmp / f"{name}-v{version}.json"
            f.write_text(json.dumps(d))
            out[f"config.json:v{version}:{name}"] = ["--config", str(f)]
    return out


def resolve_all() -> dict[str, dict[str, Any]]:
    with tempfile.TemporaryDirectory() as d:
        return {name: resolve(argv) for name, argv in cases(Path(d)).items()}


if __name__ == "__main__" and "--write" in sys.argv:
    runs = {k[len("argv:"):]: v for k, v in resolve_all().items() if k.startswith("argv:")}
    EXPECTED.write_text(json.dumps({"argv": runs}, indent=1, sort_keys=True) + "\n")
    with tempfile.TemporaryDirectory() as d:
        files = {**resolve_all(), **{k: resolve(v) for k, v in
                                     config_json_cases(Path(d)).items()}}
    EXPECTED.write_text(json.dumps({"argv": runs, "resolved": files}, indent=1,
                                   sort_keys=True) + "\n")
    print(f"{EXPECTED}: {len(files)} cases")
