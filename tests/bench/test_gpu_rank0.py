"""benchmarks/gpu_rank0.py's steps that need no GPU: rank 0 built over the fake process group
and measured, torchtitan's FLOPs per token, the rows and the table writer."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from subnetdp.estimate.spec import BenchSpec

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_rank0.py"
spec_ = importlib.util.spec_from_file_location("gpu_rank0", SCRIPT)
assert spec_ is not None and spec_.loader is not None
gpu_rank0 = importlib.util.module_from_spec(spec_)
sys.modules["gpu_rank0"] = gpu_rank0
spec_.loader.exec_module(gpu_rank0)

TINY = {"recipe": "llama-tiny", "world": 8, "batch": 1, "seq": 16,
        "model_args": (("n_layers", 4),)}


def test_the_six_configurations() -> None:
    labels = [s.label for s in gpu_rank0.specs("llama-1b", 8, 1, 2048)]
    assert labels == ["ddp", "fsdp+ac", "b-sdp (C=0.69)", "b-sdp+fsdp+ac (C=0.69)",
                      "n-sdp (C=0.69)", "b-sdp+zero2 (C=0.69)"]


def test_rank0_over_the_fake_group_executes_its_subnetwork() -> None:
    flops = {}
    for strategy, coverage in (("ddp", 1.0), ("b-sdp", 0.5)):
        spec = BenchSpec(strategy=strategy, coverage=coverage, **TINY)
        with gpu_rank0.fake_group(spec.world):
            built = gpu_rank0.build_rank0(spec, torch.device("cpu"))
            m = gpu_rank0.measure(built, spec, torch.device("cpu"), warmup=1, steps=1)
        assert m["step_time_s"] > 0 and m["max_memory_allocated"] is None
        flops[strategy] = m["executed_flops"]
    # b-sdp at C = 0.5 holds 2 of 4 blocks: fewer executed FLOPs than DDP, more than half
    assert 0.5 * flops["ddp"] < flops["b-sdp"] < flops["ddp"]


def test_torchtitan_flops_per_token_by_hand() -> None:
    spec = BenchSpec(strategy="ddp", **TINY)
    # llama-tiny, 4 layers: dim 128, 4 heads, vocab 4096, ffn 352; no embedding in the 6N
    per_layer = 4 * 128 * 128 + 3 * 128 * 352 + 2 * 128
    n = 4 * per_layer + 128 + 4096 * 128  # + final norm + output layer
    assert gpu_rank0.torchtitan_flops_per_token(spec) == 6 * n + 12 * 4 * 4 * 32 * 16


def test_rows_and_tables(tmp_path: Path) -> None:
    spec = BenchSpec(strategy="ddp", **TINY)
    measured = {"step_time_s": 0.5, "max_memory_allocated": 103 * 2**20, "executed_flops": 1e12}
    r = gpu_rank0.row(spec, measured, 100 * 2**20, peak=1e13)
    assert r["measured/estimated"] == pytest.approx(1.03) and r["within_5%"] is True
    assert r["tps"] == 32 and r["mfu_executed(%)"] == pytest.approx(20.0)
    off = gpu_rank0.row(spec, {**measured, "max_memory_allocated": 110 * 2**20}, 100 * 2**20,
                        peak=None)
    assert off["within_5%"] is False and off["mfu_torchtitan(%)"] is None
    md = gpu_rank0.write_tables([r, off], tmp_path, "rank0", "title")
    lines = md.read_text().splitlines()
    assert lines[0] == "# title" and lines[2].startswith("| label | measured_GiB |")
    assert lines[4].startswith("| ddp | 0.1006 |") and "| yes |" in lines[4]
    assert "| NO |" in lines[5] and "| - |" in lines[5]
    assert json.loads((tmp_path / "rank0.json").read_text())[0]["label"] == "ddp"
