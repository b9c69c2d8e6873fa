"""Per-rank memory budgets (bench/hetero.py): met by every rank as the estimator sees it, or
refused with budgets that do work; ``subnetdp plan --memory-gb A,B,...``."""

from __future__ import annotations

import json
import re
from functools import cache

import pytest

from subnetdp.cli import build_parser, main
from subnetdp.estimate.hetero import GB, BudgetError, plan_for_budgets
from subnetdp.estimate.memory import MemoryEstimate, estimate_memory
from subnetdp.estimate.spec import BenchSpec

BASE = BenchSpec(recipe="resnet18-fmnist", strategy="b-sdp", world=4, batch=4, seq=2,
                 model_args=(("width", 4),))


@cache
def _estimate(spec: BenchSpec) -> MemoryEstimate:
    return estimate_memory(spec)


def _full_gb() -> float:
    full = BASE.replace(coverage=1.0, scheme="balanced", balance="memory")  # as the planner
    return _estimate(full).peak_bytes / GB


def test_budgets_2_1_1_1_are_met_by_every_rank() -> None:
    full = _full_gb()
    budgets = [full, 0.6 * full, 0.6 * full, 0.6 * full]
    bp = plan_for_budgets(BASE, budgets, estimate=_estimate)
    caps = bp.spec.capacities
    assert caps is not None and caps[0] > max(caps[1:])
    for r in bp.estimate.per_rank:
        assert r.peak_bytes <= budgets[r.rank] * GB, r.rank
        assert r.state == r.analytic
    # the small ranks really hold less than the big one
    small = max(r.state["params"] for r in bp.estimate.per_rank[1:])
    assert small < bp.estimate.per_rank[0].state["params"]


def test_too_small_budgets_are_refused_with_budgets_that_work() -> None:
    full = _full_gb()
    with pytest.raises(BudgetError, match="too small") as e:
        plan_for_budgets(BASE, [0.3 * full] * 4, estimate=_estimate)
    found = re.search(r"--memory-gb ([0-9.e,-]+);", str(e.value))
    assert found is not None
    suggested = [float(x) for x in found.group(1).split(",")]
    assert min(suggested) > 0.3 * full
    bp = plan_for_budgets(BASE, suggested, estimate=_estimate)
    assert all(r.peak_bytes <= suggested[r.rank] * GB for r in bp.estimate.per_rank)


def test_plan_command_per_rank_budgets_errors(capsys) -> None:  # type: ignore[no-untyped-def]
    args = ["plan", "fit", "--recipe", "llama-tiny", "--seq-len", "32", "--batch-size", "2"]
    assert main([*args, "--nproc", "3", "--memory-gb", "1,1,1,1"]) == 2
    assert "one per worker" in capsys.readouterr().err
    # two workers: each estimate of llama-tiny (8 blocks) is a few seconds per rank
    assert main([*args, "--memory-gb", "0.001,0.0005"]) == 2
    err = capsys.readouterr().err
    assert "too small" in err and "--memory-gb" in err
    with pytest.raises(SystemExit):
        main([*args, "--memory-gb", "1,x"])
    assert "numbers separated by commas" in capsys.readouterr().err


# One fake-mode estimate per spec for the train-and-plan tests, whoever asks: train and plan
# estimate the same specs when they agree, so the second command costs no estimate.
_shared = cache(estimate_memory)


def _with_shared_estimates(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import subnetdp.estimate.hetero as hetero

    planner = hetero.plan_for_budgets

    def plan_for_budgets(base, budgets, *, estimate=None):  # type: ignore[no-untyped-def]
        return planner(base, budgets, estimate=_shared)

    monkeypatch.setattr(hetero, "plan_for_budgets", plan_for_budgets)


# llama-tiny at 2 x 32 tokens: its units about 31 MB, the rest of a rank about 21 MB; at 8 MiB
# per communicator rank 1 of these budgets holds 3 units, at 0 (CPU, gloo) 5.
COMMON = ["--recipe", "llama-tiny", "--seq-len", "32", "--batch-size", "2",
          "--memory-gb", "0.064,0.042"]


def test_train_counts_communicators_like_plan(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``train --memory-gb A,B --comm-mem-mb M`` hands its workers the plan that ``plan
    --memory-gb A,B --comm-mem-mb M --out`` writes, for an M that changes the plan; without
    --comm-mem-mb a CPU run counts none, as ``plan --comm-mem-mb 0`` (gloo)."""
    import subnetdp.train.elastic as elastic
    from subnetdp.plan import Plan

    launched: list[tuple] = []

    def launch(fn, cfg, *, plan=None, **kw):  # type: ignore[no-untyped-def]
        launched.append((cfg, plan))
        return {}

    monkeypatch.setattr(elastic, "launch_shrinking", launch)
    _with_shared_estimates(monkeypatch)
    for given, comm in ((["--comm-mem-mb", "8"], "8"), ([], "0")):
        saved = tmp_path / f"plan{comm}.json"
        assert main(["plan", "fit", *COMMON, "--comm-mem-mb", comm, "--out", str(saved)]) == 0
        assert main(["train", *COMMON, *given, "--nproc", "2", "--steps", "1", "--no-progress",
                     "--out", str(tmp_path / f"run{comm}")]) == 0
        cfg, plan = launched[-1]
        assert plan == Plan.from_json(saved.read_text()), given
        assert cfg.comm_mem_mb is None and cfg.memory_gb is None  # the plan file stands
    counted, free = (Plan.from_json((tmp_path / f"plan{m}.json").read_text()) for m in "80")
    assert len(counted.held_units(1)) < len(free.held_units(1))  # M changes the plan


def test_train_counts_nccl_communicators_by_default_on_cuda(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The default per run device: DEFAULT_COMM_MB where the run's collectives are NCCL's
    (CUDA), 0 on CPU (gloo); a value given wins on either."""
    import subnetdp.estimate.hetero as hetero
    import subnetdp.train.device as device
    from subnetdp.estimate.communicators import DEFAULT_COMM_MB
    from subnetdp.train.config import TrainConfig
    from subnetdp.train.hetero import budget_plan

    counted: list[float] = []

    class Stop(Exception):
        pass

    def plan_for_budgets(spec: BenchSpec, gb: list[float]) -> None:
        counted.append(spec.comm_mem_mb)
        raise Stop

    monkeypatch.setattr(hetero, "plan_for_budgets", plan_for_budgets)
    monkeypatch.setattr(device, "device_name", lambda requested: requested)  # no CUDA here
    for dev, given in (("cuda", None), ("cpu", None), ("cuda", 100.0), ("cpu", 100.0)):
        cfg = TrainConfig(recipe="llama-tiny", nproc=2, device=dev, memory_gb=[1.0, 1.0],
                          comm_mem_mb=given).resolved()
        with pytest.raises(Stop):
            budget_plan(cfg, 2)
    assert counted == [DEFAULT_COMM_MB, 0.0, 100.0, 100.0]


def test_comm_mem_mb_is_checked_and_recorded_alike(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """One message for a bad --comm-mem-mb from both commands; ``train`` takes it from a
    --config file too, and a config.json written before the option loads."""
    from subnetdp.commands.train_cmd import config_from_args
    from subnetdp.train.config import TrainConfig
    from subnetdp.train.config_file import load_config_file

    message = "--comm-mem-mb must be >= 0 (0: communicators not counted), got -1"
    assert main(["plan", "fit", *COMMON, "--comm-mem-mb", "-1"]) == 2
    assert message in capsys.readouterr().err
    assert main(["train", *COMMON, "--comm-mem-mb", "-1", "--nproc", "2",
                 "--out", str(tmp_path / "bad")]) == 2
    assert message in capsys.readouterr().err
    toml = tmp_path / "run.toml"
    toml.write_text('recipe = "llama-tiny"\nmemory-gb = [1.0, 0.5]\ncomm-mem-mb = 8\n')
    args = build_parser().parse_args(["train", "--config", str(toml), "--nproc", "2"])
    assert config_from_args(args).comm_mem_mb == 8.0
    old = tmp_path / "config.json"
    recorded = TrainConfig(recipe="llama-tiny").to_dict()
    del recorded["comm_mem_mb"]
    old.write_text(json.dumps(recorded))
    assert TrainConfig(**load_config_file(old)).comm_mem_mb is None
    assert TrainConfig.from_dict(recorded).comm_mem_mb is None


# What train feeds its budget estimate beyond COMMON, each with the arguments of a plan
# without it and budgets at which it changes the plan (llama-tiny at 2 x 32, 2 workers):
# --model-arg: 4 units instead of 8; --zero 1: the optimizer state sharded, rank 1 holds 6
# units instead of 3. --reduce-dtype bf16 (with --fsdp, bf16-mixed) halves FSDP's
# reduce-scatter buffers, about 1 MB per rank: it moves the plan only at budgets where FSDP's
# peak is far from the planner's linear model, so it has only a spec case below, as has
# --bucket-cap-mb (bytes of ZeRO's buckets; the advisor's step times). --refresh-every
# changes no estimate (the estimated step refreshes alike for every K): plan has no option.
RUN_OPTIONS = [
    pytest.param(["--model-arg", "n_layers=4"], [], "0.064,0.042", id="model-arg"),
    pytest.param(["--zero", "1"], [], "0.064,0.036", id="zero"),
]


@pytest.mark.parametrize(("option", "without", "budgets"), RUN_OPTIONS)
def test_train_and_plan_estimate_the_same_run(option, without, budgets, tmp_path,  # type: ignore[no-untyped-def]
                                              monkeypatch) -> None:
    """``train --memory-gb A,B OPTION`` hands its workers the plan that ``plan --memory-gb
    A,B OPTION --out`` writes (a CPU run: plan's --comm-mem-mb 0), and OPTION changes it."""
    import subnetdp.train.elastic as elastic
    from subnetdp.plan import Plan

    _with_shared_estimates(monkeypatch)
    launched: list[Plan] = []

    def launch(fn, cfg, *, plan=None, **kw):  # type: ignore[no-untyped-def]
        launched.append(plan)
        return {}

    monkeypatch.setattr(elastic, "launch_shrinking", launch)
    common = ["--recipe", "llama-tiny", "--seq-len", "32", "--batch-size", "2",
              "--memory-gb", budgets]
    plans = {}
    for name, given in (("with", option), ("without", without)):
        saved = tmp_path / f"{name}.json"
        assert main(["plan", "fit", *common, *given, "--comm-mem-mb", "0", "--out",
                     str(saved)]) == 0
        plans[name] = Plan.from_json(saved.read_text())
    assert main(["train", *common, *option, "--nproc", "2", "--steps", "1", "--no-progress",
                 "--out", str(tmp_path / "run")]) == 0
    assert launched == [plans["with"]]
    assert plans["with"] != plans["without"]  # the option changes the plan


@pytest.mark.parametrize("option", [
    pytest.param(["--model-arg", "n_layers=4", "--model-arg", "dim=64"], id="model-arg"),
    pytest.param(["--zero", "1", "--bucket-cap-mb", "5"], id="zero"),
    pytest.param(["--fsdp", "--dtype", "bf16-mixed", "--reduce-dtype", "bf16", "--ac"],
                 id="reduce-dtype"),
])
def test_train_and_plan_hand_the_planner_one_spec(option, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """What ``train --memory-gb A,B`` and ``plan --memory-gb A,B`` give ``plan_for_budgets``
    is one spec, for every option train estimates with (no estimate runs)."""
    import subnetdp.estimate.hetero as hetero

    specs: list[BenchSpec] = []

    def plan_for_budgets(spec, budgets, *, estimate=None):  # type: ignore[no-untyped-def]
        specs.append(spec)
        raise hetero.BudgetError("stop here")  # both commands refuse it in one line

    monkeypatch.setattr(hetero, "plan_for_budgets", plan_for_budgets)
    for argv in (["plan", "fit", *COMMON, *option, "--comm-mem-mb", "0"],
                 ["train", *COMMON, *option, "--nproc", "2", "--out", str(tmp_path / "run")]):
        assert main(argv) == 2
    plan_spec, train_spec = specs
    assert plan_spec == train_spec
    assert plan_spec != BenchSpec(recipe="llama-tiny", strategy="b-sdp", world=2, batch=2,
                                  seq=32)  # the options reached it


@pytest.mark.parametrize(("argv", "refused"), [
    (["plan", "--units", "8", "--nproc", "4", "--coverage", "0.5", "--model-arg",
      "n_layers=2"], "--model-arg"),
    (["plan", "--units", "8", "--nproc", "4", "--coverage", "0.5", "--zero", "2"], "--zero"),
    (["plan", "budget", "--recipe", "llama-tiny", "--nproc", "2", "--memory-gb", "1", "--zero",
      "1"], "--zero"),
    (["plan", "cluster", "--recipe", "llama-tiny", "--cluster", "nodes=1", "--reduce-dtype",
      "bf16"], "--reduce-dtype"),
])
def test_each_plan_job_takes_only_its_own_options(argv: list[str], refused: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Showing a plan takes no estimate's options; one budget and a cluster search the
    compositions, so they take no --zero/--reduce-dtype (``plan fit`` composes one)."""
    with pytest.raises(SystemExit):
        main(argv)
    assert f"unrecognized arguments: {refused}" in capsys.readouterr().err
