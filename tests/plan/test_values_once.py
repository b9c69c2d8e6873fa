"""Values decoded once (issue 26): the strategy is decoded at the edges only, a run's label
keeps its whole composition, the benchmarks honour every composition field; one plan-file
reader for ``plan`` and ``train``; a launch reads its plan once and hands it to the workers;
under --memory-gb the pre-launch check sees the budget plan that runs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import subnetdp
from subnetdp.cli import main
from subnetdp.estimate.spec import BenchSpec
from subnetdp.plan import Plan, make_plan
from subnetdp.plan.objectives import DEFAULT_BALANCE
from subnetdp.strategy import Composition, PlanSpec, RankSpec, get_strategy
from subnetdp.train.config import TrainConfig

SRC = Path(subnetdp.__file__).parent
DECODE = re.compile(r"\b(get_strategy|parse_label)\(")
# every call that turns a strategy name or label into values, and the edges allowed to make
# one: the command line, config files, the public keywords of parallelize,
# SubnetDataParallel and the framework integrations, summaries written before runs recorded
# their label, the study's methods, and the benchmarks' labels
DECODERS = re.compile(r"\b(get_strategy|parse_label|RankSpec\.of)\(")
EDGES = {"commands/options.py", "commands/plan_show.py", "train/options.py", "parallelize.py",
         "runtime/wrapper.py", "metrics/report.py", "study/suite.py", "estimate/spec.py",
         "integrations/wrap.py"}


def _calls(pattern: re.Pattern[str]) -> list[str]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "strategy.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if pattern.search(code) and not code.lstrip().startswith(("def ", "from ")):
                found.append(f"{rel}:{n}")
    return found


def test_the_strategy_is_decoded_at_the_edges_only() -> None:
    # the count: `grep -rn "get_strategy(\|parse_label(" src` outside strategy.py
    sites = _calls(DECODE)
    assert len(sites) <= 4, sites
    outside = [s for s in _calls(DECODERS) if s.split(":")[0] not in EDGES]
    assert not outside, f"decode a strategy at the edge and pass the value down: {outside}"


def test_plan_spec_default_balance_is_the_plans() -> None:
    assert PlanSpec().balance == DEFAULT_BALANCE


def test_a_run_label_keeps_its_whole_composition() -> None:
    cfg = TrainConfig(strategy="b-sdp", zero=2)
    assert cfg.label(0.5) == "b-sdp+zero2 (C=0.5)"
    assert TrainConfig(strategy="ddp", zero=2).label(1.0) == "ddp+zero2"
    # a summary written before runs recorded their label gets the same name from its config
    from subnetdp.metrics.report import label

    old = {"strategy": "b-sdp", "coverage": 0.5, "config": cfg.to_dict()}
    assert label(old) == "b-sdp+zero2 (C=0.5)"


def test_the_summary_records_the_label(tmp_path: Path) -> None:
    from subnetdp.train.trainer import _summary

    cfg = TrainConfig(strategy="b-sdp", zero=2, steps=3).resolved()
    plan = make_plan(world=2, units=4, coverage=0.5)
    ranks = [{"step_time_s": 1.0, "train_time_s": 3.0, "final_train_loss": 2.0,
              "max_active": None} for _ in range(2)]
    summary = _summary(cfg, plan, 2, ranks, {}, items_per_batch=8)
    assert summary["label"] == "b-sdp+zero2 (C=0.5)" and summary["strategy"] == "b-sdp"


def test_values_are_decoded_once_per_config() -> None:
    cfg = TrainConfig(strategy="nb-sdp", refresh_every=2, ckpt_every=4)
    assert cfg.rank_spec is cfg.rank_spec  # cached: decoded and checked once
    assert cfg.rank_spec == RankSpec(get_strategy("nb-sdp"), Composition(refresh_every=2))
    assert cfg.plan_spec.coverage == cfg.coverage


def test_bench_honours_every_composition_field(monkeypatch: pytest.MonkeyPatch) -> None:
    import subnetdp.estimate.spec as spec_module

    spec = BenchSpec(recipe="llama-tiny", strategy="nb-sdp", world=2, batch=1, seq=8,
                     coverage=0.5, fsdp=True, dtype="bf16-mixed", reduce_dtype="bf16",
                     refresh_every=3)
    want = Composition(fsdp=True, dtype="bf16-mixed", reduce_dtype="bf16", refresh_every=3)
    assert spec.composition() == want
    assert BenchSpec(recipe="llama-tiny", strategy="n-sdp", world=2, batch=1, seq=8,
                     output_scaling="none").composition().output_scaling == "none"
    seen: list[Any] = []

    class Built(Exception):
        pass

    def fake_parallelize(model: Any, **kw: Any) -> Any:
        seen.append(kw["strategy"])
        raise Built

    monkeypatch.setattr(spec_module, "parallelize", fake_parallelize)
    with pytest.raises(Built):
        spec_module.build_rank(spec)
    assert seen == [RankSpec(get_strategy("nb-sdp"), want)]


def test_a_memory_budget_is_estimated_with_the_runs_composition() -> None:
    from subnetdp.estimate.spec import composition_fields

    cfg = TrainConfig(strategy="b-sdp", fsdp=True, dtype="bf16-mixed", reduce_dtype="bf16",
                      bucket_cap_mb=5.0)
    spec = BenchSpec(recipe=cfg.recipe, strategy="b-sdp", world=2, batch=1, seq=8,
                     **composition_fields(cfg.composition()))
    assert spec.composition() == cfg.composition()


# -- plan files --------------------------------------------------------------------------------
def _formats(tmp_path: Path) -> dict[str, Path]:
    """The same 2-worker plan over llama-tiny's 4 blocks, in each accepted format."""
    from subnetdp.models import get_recipe
    from subnetdp.subnet.units import describe_units

    recipe = get_recipe("llama-tiny")
    with torch.device("meta"):
        units, shared = describe_units(recipe.build_model(), recipe.adapter)
    plan = make_plan(world=2, units=units, coverage=0.5, shared_size=shared)
    matrix = [[int(x) for x in row] for row in plan.matrix]
    files = {"matrix": matrix, "object": {"matrix": matrix}, "saved": plan.to_dict()}
    out = {}
    for name, data in files.items():
        out[name] = tmp_path / f"{name}.json"
        out[name].write_text(json.dumps(data))
    return out


def _train_cfg(tmp_path: Path, **kw: Any) -> TrainConfig:
    return TrainConfig(recipe="llama-tiny", strategy="b-sdp", nproc=2, steps=1,
                       out=str(tmp_path / "run"), progress=False, **kw).resolved()


def test_plan_and_train_accept_the_same_plan_files(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from subnetdp.train.tasks import make_task
    from subnetdp.train.validate import preflight

    for name, path in _formats(tmp_path).items():
        assert main(["plan", "--plan-file", str(path), "--recipe", "llama-tiny",
                     "--json"]) == 0, name
        shown = json.loads(capsys.readouterr().out)["assignment"]
        cfg = _train_cfg(tmp_path, plan_file=str(path))
        plan = preflight(cfg, make_task(cfg))
        assert [plan.held_units(r) for r in range(plan.world)] == shown, name


def test_a_launch_reads_its_plan_once_and_hands_it_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subnetdp.plan.files as files
    import subnetdp.subnet.planning as planning
    import subnetdp.train.elastic as elastic
    from subnetdp.train.run import run_training

    path = _formats(tmp_path)["saved"]
    reads, validations, launched = [], [], []
    real_read, real_validate = files.read_plan_file, Plan.validate

    def read(*args: Any, **kw: Any) -> Plan:
        reads.append(args[0])
        return real_read(*args, **kw)

    def validate(self: Plan, world_size: int | None = None) -> None:
        validations.append(world_size)
        real_validate(self, world_size)

    def launch(fn: Any, cfg: TrainConfig, *, plan: Plan | None = None, **kw: Any) -> dict:
        launched.append(plan)
        return {}

    monkeypatch.setattr(files, "read_plan_file", read)
    monkeypatch.setattr(planning, "read_plan_file", read)
    monkeypatch.setattr(Plan, "validate", validate)
    monkeypatch.setattr(elastic, "launch_shrinking", launch)
    run_training(_train_cfg(tmp_path, plan_file=str(path)))
    assert reads == [str(path)] and len(validations) == 1
    assert len(launched) == 1 and isinstance(launched[0], Plan)
    assert launched[0] == Plan.from_json(path.read_text())


def test_the_pre_launch_check_sees_the_budget_plan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subnetdp.estimate.hetero as hetero
    import subnetdp.subnet.match as match
    import subnetdp.train.elastic as elastic
    from subnetdp.train.run import run_training

    class Fitted:  # the estimator's answer, stubbed: two ranks, the second holding less
        def __init__(self, spec: BenchSpec) -> None:
            self.spec = spec.replace(world=2, scheme="balanced", balance="params",
                                     coverage=1.0, capacities=(1.0, 0.5))

        plan = hetero.BudgetPlan.plan  # the real answer's plan of its spec

    checked, launched = [], []
    real_match = match.match_plan

    def match_plan(plan: Plan, *args: Any) -> Any:
        checked.append(plan)
        return real_match(plan, *args)

    def launch(fn: Any, cfg: TrainConfig, *, plan: Plan | None = None, **kw: Any) -> dict:
        launched.append((cfg, plan))
        return {}

    monkeypatch.setattr(hetero, "plan_for_budgets", lambda spec, gb: Fitted(spec))
    monkeypatch.setattr(match, "match_plan", match_plan)
    monkeypatch.setattr(elastic, "launch_shrinking", launch)
    run_training(_train_cfg(tmp_path, memory_gb=[40.0, 20.0]))
    cfg, plan = launched[0]
    assert cfg.plan_file is not None and cfg.memory_gb is None
    written = Plan.from_json(Path(cfg.plan_file).read_text())
    assert plan == written and plan.scheme == "balanced"
    assert len(plan.held_units(1)) < len(plan.held_units(0))
    assert checked == [written]  # the plan the workers run, not a coverage plan
