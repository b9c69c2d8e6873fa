"""`subnetdp plan`: JSON and table output, plan files, model units, user errors, no torch."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from subnetdp.commands import plan_cmd
from subnetdp.plan import Plan, make_plan


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="subnetdp")
    plan_cmd.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    rc = plan_cmd.run(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(["--nproc", "8", "--units", "12", "--coverage", "0.5", "--json"], capsys)
    assert rc == 0 and err == ""
    rep = json.loads(out)
    assert rep["assignment"][0] == [0, 1, 2, 3, 4, 5]
    assert rep["assignment"][1] == [1, 2, 3, 4, 5, 6]  # starts at floor(1*12/8) = 1
    assert rep["holders"] == [4] * 12 and rep["k"] == 6
    assert rep["unit_coverage"] == [0.5] * 8 and rep["param_coverage"] == [0.5] * 8
    assert rep["mask_error"] == pytest.approx(12 * (1 / 4 - 1 / 8) / 12)
    assert 0 < rep["spectral_gap"] < 1 and rep["connected"] is True
    assert rep["model"] is None and rep["shared_size"] == 0 and rep["unit_sizes"] == [1] * 12
    assert rep["bytes_per_worker"][0] == {"params": 24, "grads": 24, "optimizer": 48,
                                          "allreduce_payload": 24, "allreduce_ring": 36,
                                          "refresh_sent": 0, "refresh_received": 0}


def test_random_scheme_and_save(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    argv = ["--nproc", "4", "--units", "8", "--coverage", "0.5", "--scheme", "random",
            "--seed", "3", "--shared-size", "5", "--save", str(path), "--json"]
    rc, out, _ = _run(argv, capsys)
    assert rc == 0
    saved = Plan.from_json(path.read_text())
    assert saved == make_plan(world=4, units=8, coverage=0.5, scheme="random", seed=3,
                              shared_size=5)
    rep = json.loads(out)
    assert rep["scheme"] == "random" and rep["seed"] == 3
    assert rep["param_coverage"] == [pytest.approx((5 + 4) / 13)] * 4


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(["--nproc", "4", "--units", "8", "--coverage", "0.25"], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("plan: 4 workers, 8 units, scheme spread, coverage 0.25 (k=2)")
    assert "connected NO" in lines[1] and "mask error 0.7500" in lines[1]
    assert "payload MB" in lines[2]
    assert lines[3].split() == ["0", "0-1", "0.250", "0.250", "0.000"]
    assert len(lines) == 3 + 4 + 1 and lines[-1].startswith("single-holder units 8")


def test_explicit_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "m.json"
    f.write_text("[[1, 1, 0], [0, 1, 1]]")
    rc, out, _ = _run(["--plan-file", str(f), "--json"], capsys)
    assert rc == 0
    rep = json.loads(out)
    assert rep["scheme"] == "explicit" and rep["assignment"] == [[0, 1], [1, 2]]
    assert rep["holders"] == [1, 2, 1]
    # A saved plan works as --plan-file input too (units and shared size kept).
    saved = tmp_path / "p.json"
    saved.write_text(make_plan(world=2, units=4, coverage=0.75, shared_size=2).to_json())
    rc, out, _ = _run(["--plan-file", str(saved), "--json"], capsys)
    assert rc == 0 and json.loads(out)["shared_size"] == 2


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["--nproc", "4", "--units", "8", "--coverage", "0"], r"coverage must be in \(0, 1\]"),
        (["--nproc", "4", "--units", "8", "--coverage", "1.5"], r"coverage must be in"),
        (["--nproc", "2", "--units", "8", "--coverage", "0.25"], r"minimum coverage"),
        (["--nproc", "4", "--coverage", "0.5"], r"give --units N or --recipe NAME"),
        (["--units", "8", "--coverage", "0.5"], r"give --nproc N"),
        (["--nproc", "4", "--units", "8"], r"give --coverage"),
        (["--nproc", "4", "--units", "8", "--coverage", "0.25", "--scheme", "random"],
         r"no connected plan"),
    ],
)
def test_user_errors_exit_2(
    argv: list[str], pattern: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and out == ""
    assert err.startswith("subnetdp plan: error: ")
    assert re.search(pattern, err), err


def test_explicit_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "m.json"
    f.write_text("[[1, 0, 0], [0, 1, 0]]")
    rc, _, err = _run(["--plan-file", str(f)], capsys)
    assert rc == 2 and "unit(s) 2 (unit2) have no holder" in err
    f.write_text("[[1, 1], [1, 1]]")
    rc, _, err = _run(["--plan-file", str(f), "--nproc", "3"], capsys)
    assert rc == 2 and "--nproc 3 but the explicit matrix has 2 rows" in err
    rc, _, err = _run(["--plan-file", str(f), "--coverage", "0.5"], capsys)
    assert rc == 2 and "do not apply with --plan-file" in err
    rc, _, err = _run(["--plan-file", str(tmp_path / "missing.json")], capsys)
    assert rc == 2 and "cannot read --plan-file" in err


def test_dtype_sets_the_bytes_per_element(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--nproc", "2", "--units", "4", "--coverage", "0.5", "--json"]
    for dtype, width in (("fp32", 4), ("bf16-mixed", 4), ("bf16", 2)):
        rc, out, _ = _run([*argv, "--dtype", dtype], capsys)
        assert rc == 0 and json.loads(out)["bytes_per_worker"][0]["params"] == 2 * width


def test_units_and_recipe_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(["--nproc", "2", "--units", "4", "--recipe", "llama-tiny", "--coverage",
                       "1"], capsys)
    assert rc == 2 and "--units and --recipe are not allowed together" in err


@pytest.mark.parametrize("extra", [["--units", "12", "--coverage", "0.5"], ["--plan-file"],
                                   ["--units", "12", "--capacities", "1,.5,.5,.5,.5,.5,.5,.5"]])
def test_plan_without_a_recipe_imports_no_torch(extra: list[str], tmp_path: Path) -> None:
    if extra == ["--plan-file"]:
        path = tmp_path / "p.json"
        path.write_text(make_plan(world=8, units=12, coverage=0.5).to_json())
        extra = ["--plan-file", str(path)]
    argv = ["plan", "--nproc", "8", *extra]
    code = ("import sys; from subnetdp.cli import main; "
            f"assert main({argv!r}) == 0; assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("plan: 8 workers, 12 units")


@pytest.mark.parametrize("name", ["llama-tiny", "resnet18-fmnist"])
def test_model_units(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(["--nproc", "4", "--recipe", name, "--coverage", "0.5", "--json"],
                        capsys)
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["model"] == name and rep["shared_size"] > 0
    sizes = rep["unit_sizes"]
    assert len(sizes) == rep["num_units"] >= 2 and all(s > 0 for s in sizes)
    total = rep["shared_size"] + sum(sizes)
    for i, held in enumerate(rep["assignment"]):
        held_elems = rep["shared_size"] + sum(sizes[u] for u in held)
        assert rep["param_coverage"][i] == pytest.approx(held_elems / total)
        assert rep["bytes_per_worker"][i]["params"] == 4 * held_elems


def test_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(["--nproc", "2", "--recipe", "no-such-model", "--coverage", "1"],
                        capsys)
    assert rc == 2 and out == "" and err.startswith("subnetdp plan: error: ")
