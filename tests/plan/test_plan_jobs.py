"""``subnetdp plan``'s jobs (issue 43): show (the default), budget, fit and cluster, each with
its own options; the old spellings (``plan --memory-gb``, ``plan --cluster``, ``--coverages``,
``--world``, ``--save``) still work with a one-line notice naming the new one; and ``plan
cluster --coverage`` is the coverages it tries (``plan --cluster`` used to ignore it)."""

from __future__ import annotations

import json

import pytest

from subnetdp.cli import build_parser, main
from subnetdp.commands.plan_cmd import old_job

CLUSTER = ["--recipe", "llama-tiny", "--cluster", "nodes=1,gpus-per-node=2,gpu=h100",
           "--batch-size", "2", "--seq-len", "32", "--model-arg", "n_layers=2",
           "--strategies", "b-sdp", "--json"]


def _coverages(out: str) -> set[str]:
    (table,) = json.loads(out)
    return {row["label"] for row in table["rows"]}


def test_cluster_takes_its_coverages_from_coverage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "cluster", *CLUSTER, "--coverage", "0.6"]) == 0
    new = capsys.readouterr()
    assert _coverages(new.out) == {"b-sdp (C=0.6)"} and new.err == ""
    # the old spelling: the same table, and one line that names the new one
    assert main(["plan", *CLUSTER, "--coverage", "0.6"]) == 0
    old = capsys.readouterr()
    assert old.out == new.out
    assert old.err.strip() == ("subnetdp plan: `plan --cluster ...` is now `plan cluster ...` "
                               "(the old spelling works for one release)")
    assert main(["plan", "cluster", *CLUSTER, "--coverages", "0.6"]) == 0
    assert capsys.readouterr().err.strip() == ("subnetdp plan cluster: --coverages is now "
                                               "--coverage (the old spelling works for one "
                                               "release)")


@pytest.mark.parametrize(("argv", "job"), [
    (["--units", "8", "--nproc", "4", "--coverage", "0.5"], "show"),
    (["--recipe", "x", "--memory-gb", "40"], "budget"),
    (["--recipe", "x", "--memory-gb=40"], "budget"),
    (["--recipe", "x", "--memory-gb", "80,40,40"], "fit"),
    (["--recipe", "x", "--cluster", "nodes=2", "--memory-gb", "40"], "cluster"),
])
def test_old_spellings_name_their_job(argv: list[str], job: str) -> None:
    assert old_job(argv) == job
    args = build_parser().parse_args(["plan", *argv])
    assert args.job == job


@pytest.mark.parametrize(("old", "new", "line"), [
    (["plan", "--world", "4", "--units", "8", "--coverage", "0.5", "--json"],
     ["plan", "--nproc", "4", "--units", "8", "--coverage", "0.5", "--json"],
     "subnetdp plan show: --world is now --nproc"),
    (["plan", "--nproc", "2", "--memory-gb", "1"],
     ["plan", "budget", "--nproc", "2", "--memory-gb", "1"],
     "subnetdp plan: `plan --memory-gb GB ...` is now `plan budget ...`"),
])
def test_old_spelling_parses_to_the_new_with_one_line(
        old: list[str], new: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = vars(build_parser().parse_args(old)), vars(build_parser().parse_args(new))
    assert a == b
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(line)


def test_every_job_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    for job in ("show", "budget", "fit", "cluster"):
        with pytest.raises(SystemExit):
            main(["plan", job, "--help"])
        assert f"usage: subnetdp plan {job}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert all(job in out for job in ("show", "budget", "fit", "cluster"))
