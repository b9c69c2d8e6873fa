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


def test_the_configurations() -> None:
    labels = [gpu_rank0.label_of(c) for c in gpu_rank0.configs(
        ["fp32", "bf16", "compile"], "llama-1b", 8, 2048)]
    six = ["ddp", "fsdp+ac", "b-sdp (C=0.69)", "b-sdp+fsdp+ac (C=0.69)", "n-sdp (C=0.69)",
           "b-sdp+zero2 (C=0.69)"]
    assert labels == ([f"{x}, fp32 1x2048" for x in six]
                      + [f"{x}, bf16-mixed 4x2048" for x in six]
                      + [f"{x} compile, bf16-mixed 4x2048" for x in (six[0], six[2], six[4])])
    aligned = gpu_rank0.configs(["aligned"], "llama-1b", 8, 2048)
    assert gpu_rank0.label_of(aligned[1]) == "ddp compile ffn_hidden=5632, bf16-mixed 4x2048"
    assert gpu_rank0.spec_of(aligned[1]).model_args == (("ffn_hidden", 5632),)


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
    assert r["executed_TFLOPs"] == pytest.approx(2.0)
    off = gpu_rank0.row(spec, {**measured, "max_memory_allocated": 110 * 2**20}, 100 * 2**20,
                        peak=None)
    assert off["within_5%"] is False and off["mfu_torchtitan(%)"] is None
    # compiled rows: the estimator models eager memory, so no verdict
    assert gpu_rank0.row(spec, measured, 50 * 2**20, None, compiled=True)["within_5%"] is None
    md = gpu_rank0.write_tables([r, off], tmp_path, "rank0", "title")
    lines = md.read_text().splitlines()
    assert lines[0] == "# title" and lines[2].startswith("| label | measured_GiB |")
    assert lines[4].startswith("| ddp | 0.1006 |") and "| yes |" in lines[4]
    assert "| NO |" in lines[5] and "| - |" in lines[5]
    assert json.loads((tmp_path / "rank0.json").read_text())[0]["label"] == "ddp"


def test_mfu_rows_compare_each_row_with_ddp_of_its_setting() -> None:
    def r(label: str, tflops: float) -> dict[str, object]:
        return {"label": label, "step_time_s": 1.0, "tps": 1.0, "executed_TFLOPs": tflops,
                "mfu_executed(%)": tflops, "mfu_torchtitan(%)": 1.0}
    rows = gpu_rank0.mfu_rows([
        r("ddp, bf16-mixed 4x2048", 300.0), r("b-sdp (C=0.69), bf16-mixed 4x2048", 250.0),
        r("ddp compile, bf16-mixed 4x2048", 400.0),
        r("b-sdp (C=0.69) compile, bf16-mixed 4x2048", 400.0),
        r("ddp ffn_hidden=5632, bf16-mixed 4x2048", 500.0)])
    rel = [x["time_per_FLOP_vs_ddp"] for x in rows]
    assert rel == [pytest.approx(1.0), pytest.approx(1.2), pytest.approx(1.0),
                   pytest.approx(1.0), None]


def test_one_configuration_in_a_fresh_process(tmp_path: Path) -> None:
    config = {"strategy": "b-sdp", "coverage": 0.5, "recipe": "llama-tiny", "world": 8,
              "batch": 1, "seq": 16, "model_args": [["n_layers", 4]]}
    got = gpu_rank0._run_fresh(config, tmp_path, timeout=120)
    assert isinstance(got, dict), got
    assert got["step_time_s"] > 0 and got["executed_flops"] > 0
    assert got["max_memory_allocated"] is None  # CPU
    bad = gpu_rank0._run_fresh({**config, "coverage": 2.0}, tmp_path, timeout=120)
    assert isinstance(bad, str) and "coverage must be in (0, 1]" in bad


def test_leak_step_finds_memory_flat(tmp_path: Path) -> None:
    """The script's leak step on CPU: four builds of rank 0 (b-sdp, n-sdp) dropped in turn."""
    import argparse

    args = argparse.Namespace(recipe="llama-tiny", world=8, seq=16, out=tmp_path)
    assert gpu_rank0.run_leak(args) == 0
    rows = json.loads((tmp_path / "leak.json").read_text())
    assert [r["strategy"] for r in rows] == ["b-sdp (C=0.69)", "n-sdp (C=0.69)"] * 2
