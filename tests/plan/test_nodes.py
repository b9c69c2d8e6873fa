"""Failure domains ([Note: holders across nodes], [Note: emulated nodes]): the one rank->node
map, plans whose holders span nodes, the per-node blast radius ``plan`` prints, and the
variables a worker on an emulated or torchrun node reads. The launched node loss is
tests/faults/test_node_loss.py."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from subnetdp.bench.netem import Placement
from subnetdp.cli import main
from subnetdp.distributed.nodes import emulate_nodes, launcher_nnodes
from subnetdp.plan import make_plan
from subnetdp.plan.nodes import confined_units, node_of, node_ranks, spread_over_nodes
from subnetdp.strategy import PlanSpec

CASES = [  # world, units, coverage, nodes, scheme
    (4, 4, 0.5, 2, "spread"), (4, 8, 0.5, 2, "spread"), (8, 16, 0.25, 2, "spread"),
    (8, 16, 0.25, 4, "spread"), (6, 4, 0.5, 2, "spread"), (6, 4, 0.5, 3, "spread"),
    (16, 32, 0.125, 4, "spread"), (8, 13, 0.3, 3, "random"), (12, 24, 0.25, 3, "random"),
]


def test_node_map_is_contiguous_and_shared_with_netem() -> None:
    assert node_ranks(4, 2) == [[0, 1], [2, 3]]
    assert node_ranks(3, 2) == [[0, 1], [2]]
    assert node_ranks(5, 5) == [[0], [1], [2], [3], [4]]
    placement = Placement(("a", "b", "c"), ranks_per_node=2)
    assert [placement.node(r) for r in range(6)] == [node_of(r, 6, 3) for r in range(6)]
    assert [placement.node(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize(("world", "units", "coverage", "nodes", "scheme"), CASES)
def test_holders_span_nodes_and_rows_are_the_schemes(world: int, units: int, coverage: float,
                                                     nodes: int, scheme: str) -> None:
    plan = make_plan(world=world, units=units, coverage=coverage, min_holders=2,
                     scheme=scheme, seed=3)
    spread = spread_over_nodes(plan, nodes)
    assert confined_units(spread, nodes) == []
    assert sorted(spread.matrix) == sorted(plan.matrix)  # a relabelling of the rows only
    assert spread.holder_counts() == plan.holder_counts()
    assert spread_over_nodes(plan, nodes) == spread  # deterministic: every rank the same
    if confined_units(plan, nodes) == []:
        assert spread is plan  # nothing to spread: the scheme's own plan


def test_the_run_spreads_by_default_with_nodes_and_two_holders() -> None:
    from subnetdp.models import get_recipe
    from subnetdp.strategy import get_strategy
    from subnetdp.subnet.planning import recipe_plan

    def plan(**kw: Any) -> Any:
        spec = PlanSpec(coverage=0.5, **{"min_holders": 2, "nnodes": 2, **kw})
        return recipe_plan(get_recipe("llama-tiny"), get_strategy("b-sdp"), spec, world=4)

    assert confined_units(plan(nnodes=1), 2) != []  # the scheme alone puts pairs on a node
    assert confined_units(plan(), 2) == []
    assert plan(spread_nodes=False) == plan(nnodes=1)
    assert plan(min_holders=1) == plan(nnodes=1, min_holders=1)  # one holder: nothing to save


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    assert main(["plan", "--units", "4", "--nproc", "4", "--coverage", "0.75",
                 "--min-holders", "2", *args]) == 0
    return capsys.readouterr().out


def test_plan_prints_each_nodes_blast_radius(capsys: pytest.CaptureFixture[str]) -> None:
    out = _plan(capsys, "--nnodes", "2", "--min-nproc", "2")
    assert ("node 1 (ranks 2-3): its loss takes no unit; survives without rollback (2 workers "
            "go on from the step in flight; not with --zero/--fsdp)") in out
    out = _plan(capsys, "--nnodes", "2")  # not elastic: the loss of any node rolls back
    assert ("node 0 (ranks 0-1): its loss takes no unit; rollback to the newest checkpoint "
            "(only an elastic run (--min-nproc 2 or fewer) goes on)") in out
    out = _plan(capsys, "--nnodes", "4", "--min-nproc", "3", "--coverage", "0.25",
                "--min-holders", "1")
    assert ("node 2 (ranks 2): its loss takes unit(s) 2; rollback to the newest checkpoint "
            "(every holder of those units is on it)") in out
    rep = json.loads(_plan(capsys, "--nnodes", "2", "--min-nproc", "2", "--json"))
    assert [n["rollback"] for n in rep["nodes"]] == [None, None]
    assert "node 0" not in _plan(capsys)  # one node: no per-node lines


def test_spreading_changes_what_a_node_takes(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--coverage", "0.5", "--nnodes", "2", "--min-nproc", "3"]
    spread = json.loads(_plan(capsys, *args, "--json"))
    kept = json.loads(_plan(capsys, *args, "--no-spread-nodes", "--json"))
    assert [n["lost_units"] for n in spread["nodes"]] == [[], []]
    assert [n["lost_units"] for n in kept["nodes"]] == [[1], [3]]
    # as docs/checkpointing.md shows it
    assert ("node 0 (ranks 0-1): its loss takes unit(s) 1; rollback to the newest checkpoint "
            "(every holder of those units is on it)") in _plan(capsys, *args,
                                                               "--no-spread-nodes")


def test_plan_refuses_more_nodes_than_workers(capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["plan", "--units", "4", "--nproc", "4", "--coverage", "0.5", "--nnodes",
                 "5"]) == 2
    assert capsys.readouterr().err == ("subnetdp plan: error: --nnodes must be between 1 and "
                                       "the number of workers (4), got 5\n")


def _seen() -> dict[str, str]:
    return {k: os.environ[k] for k in ("GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE")}


def test_an_emulated_worker_reads_its_node_as_torchrun_says_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # the launching process: no launcher
        monkeypatch.delenv(k, raising=False)
    wrapped = emulate_nodes(_seen, 2)
    assert emulate_nodes(_seen, 1) is _seen
    monkeypatch.setenv("WORLD_SIZE", "5")
    monkeypatch.setenv("RANK", "4")
    monkeypatch.setenv("LOCAL_RANK", "4")  # this machine's device index: left alone
    assert wrapped() == {"GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert os.environ["LOCAL_RANK"] == "4"


def test_torchrun_nodes_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"WORLD_SIZE": "8", "RANK": "5", "GROUP_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert launcher_nnodes() == 2
    monkeypatch.setenv("GROUP_RANK", "0")  # 6 ranks on node 0, 2 on node 1
    with pytest.raises(ValueError, match="give every node the same --nproc-per-node"):
        launcher_nnodes()
