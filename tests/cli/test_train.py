"""End to end through the CLI: `subnetdp train` launches real worker processes, trains on the
real corpus / Fashion-MNIST, and writes metrics and a summary whose costs match the plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from subnetdp.cli import main
from subnetdp.metrics.sinks import read_jsonl
from subnetdp.plan import Plan, worker_bytes
from subnetdp.plan.communicators import communicators_per_rank

pytestmark = pytest.mark.dist
STEPS = 6
TINY_LM = ["--recipe", "llama-tiny", "--batch-size", "2", "--seq-len", "32",
           "--eval-batches", "2", "--memory-step", "3", "--no-progress"]


def _train(out: Path, *extra: str) -> dict:
    code = main(["train", "--steps", str(STEPS), "--out", str(out), *extra])
    assert code == 0
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("runs")
    return {
        s: (root / s, _train(root / s, *TINY_LM, "--strategy", s, "--nproc", "2",
                             "--coverage", "0.5"))
        for s in ("ddp", "b-sdp")
    }


def test_bsdp_summary_matches_the_plan(lm_runs) -> None:
    out, summary = lm_runs["b-sdp"]
    plan = Plan.from_json((out / "plan.json").read_text())
    assert summary["strategy"] == "b-sdp" and summary["world"] == 2
    assert summary["steps"] == STEPS and summary["coverage"] == 0.5
    assert 0 < summary["val_loss"] < 20 and summary["step_time_s"] > 0
    for r in summary["per_rank"]:
        wb = worker_bytes(plan, r["rank"])
        assert r["params_held"] * 4 == wb.params
        assert r["comm_bytes_per_step"] == wb.allreduce_payload
        assert r["peak_memory_bytes"] > wb.params + wb.grads + wb.optimizer
        rows = read_jsonl(out / "metrics" / f"rank{r['rank']}.jsonl")
        assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
        assert all(row["comm/bytes_per_step"] == wb.allreduce_payload for row in rows)
    assert summary["plan"]["mask_error"] > 0
    assert summary["plan"]["communicators"] == communicators_per_rank(plan)


def test_ddp_baseline_holds_and_sends_everything(lm_runs) -> None:
    _, ddp = lm_runs["ddp"]
    _, sdp = lm_runs["b-sdp"]
    total = ddp["params_total"]
    for r in ddp["per_rank"]:
        assert r["params_held"] == total
        assert r["comm_bytes_per_step"] == total * 4  # torch DDP all-reduces every gradient
    for r in sdp["per_rank"]:
        assert r["params_held"] < total
        assert r["comm_bytes_per_step"] < total * 4
        assert r["peak_memory_bytes"] < max(d["peak_memory_bytes"] for d in ddp["per_rank"])


def test_composed_runs_train_and_count_fsdp_traffic(lm_runs, tmp_path) -> None:
    """b-sdp + FSDP + activation checkpointing + bf16 compute, and the FSDP + AC baseline
    (``--strategy ddp --fsdp``), end to end through the CLI."""
    _, plain = lm_runs["b-sdp"]
    out = tmp_path / "composed"
    composed = _train(out, *TINY_LM, "--strategy", "b-sdp", "--nproc", "2", "--coverage", "0.5",
                      "--fsdp", "--ac", "--dtype", "bf16-mixed")
    plan = Plan.from_json((out / "plan.json").read_text())
    assert 0 < composed["val_loss"] < 20
    assert composed["config"]["fsdp"] and composed["config"]["dtype"] == "bf16-mixed"
    for r, p in zip(composed["per_rank"], plain["per_rank"], strict=True):
        assert r["params_held"] < p["params_held"]  # the shared parameters are sharded
        # 2 workers at C = 0.5: every unit has one holder (nothing to exchange); the shared
        # parameters are gathered once in bf16 and reduce-scattered in fp32
        assert all(len(plan.holders(u)) == 1 for u in range(plan.num_units))
        assert r["comm_bytes_per_step"] == plan.shared_size * (2 + 4)
    fsdp = _train(tmp_path / "fsdp", *TINY_LM, "--strategy", "ddp", "--nproc", "2", "--fsdp",
                  "--ac")
    assert 0 < fsdp["val_loss"] < 20
    blocks = sum(u.size for u in Plan.from_json((tmp_path / "fsdp" / "plan.json").read_text())
                 .units)
    shared = fsdp["params_total"] - blocks
    for r in fsdp["per_rank"]:
        assert r["params_held"] <= fsdp["params_total"] // 2 + 1
        # blocks gathered in forward and again in backward, the root once; one reduce-scatter
        assert r["comm_bytes_per_step"] == 4 * (3 * blocks + 2 * shared)
        assert r["comm"]["by_collective"].keys() == {"fsdp"}
    # the baseline whose checkpoints are not built trains on and says so (issue 41 item 9)
    assert fsdp["checkpoint"] is None and "ddp with --fsdp" in fsdp["checkpoint_note"]
    assert not (tmp_path / "fsdp" / "checkpoints").exists()


def test_a_default_run_keeps_its_final_state(lm_runs, capsys) -> None:
    """Issue 41 item 9: without --ckpt-every the run saves its state at the end, the summary
    names it, and eval reads it: the validation loss the run reported, to the bit (eval
    computes on the workers' one thread, item 10)."""
    from subnetdp.metrics.report import format_summary

    for out, summary in lm_runs.values():
        assert summary["checkpoint"] == str(out / "checkpoints" / f"step_{STEPS:08d}")
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step_{STEPS:08d}"]
        assert f"  checkpoint         {summary['checkpoint']} (subnetdp eval" in \
            format_summary(summary)
        capsys.readouterr()
        assert main(["eval", str(out), "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["step"] == STEPS and result["val_loss"] == summary["val_loss"]


def test_resnet_fmnist_reports_accuracy(tmp_path) -> None:
    summary = _train(tmp_path / "r", "--recipe", "resnet18-fmnist", "--strategy", "b-sdp",
                     "--nproc", "2", "--batch-size", "8", "--eval-batches", "2",
                     "--model-arg", "width=8", "--memory-step", "-1", "--no-progress")
    assert 0.0 <= summary["val_accuracy"] <= 1.0
    assert summary["per_rank"][0]["peak_memory_bytes"] is None  # not measured when disabled


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--coverage", "0"], "--coverage must be in (0, 1]"),
        (["--recipe", "nope"], "unknown recipe 'nope'"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--model-arg", "width"], "KEY=VALUE"),
        (["--reduce-dtype", "bf16"], "--reduce-dtype needs --fsdp"),
        (["--strategy", "ddp", "--fsdp", "--ckpt-every", "2"],
         "checkpoints of the plain FSDP2 baseline"),
    ],
)
def test_bad_input_is_a_clear_error(args, message, tmp_path, capsys) -> None:
    assert main(["train", "--out", str(tmp_path / "x"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_plan_for_another_world_is_refused(tmp_path, capsys) -> None:
    plan_file = tmp_path / "plan.json"
    assert main(["plan", "--recipe", "llama-tiny", "--nproc", "4", "--coverage", "0.5",
                 "--save", str(plan_file)]) == 0
    capsys.readouterr()
    code = main(["train", *TINY_LM, "--plan-file", str(plan_file), "--nproc", "2",
                 "--out", str(tmp_path / "x")])
    assert code == 2
    err = capsys.readouterr().err
    assert "4" in err and "2" in err
