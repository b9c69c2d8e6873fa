"""``subnetdp plan``: a plan, and what fits a budget or a cluster, one job per subcommand.

    subnetdp plan [show] --nproc 8 --recipe llama-tiny --coverage 0.5  a plan (plan_show)
    subnetdp plan budget --recipe llama-1b --nproc 8 --memory-gb 40  what fits (plan_budget)
    subnetdp plan fit --recipe llama-1b --memory-gb 80,40,40,40      per-rank budgets
    subnetdp plan cluster --recipe llama-1b --cluster nodes=4,...    the advisor (plan_cluster)

Each job takes only its own options; the run's options among them are made from their one
declaration (``train.options``), as ``train`` makes them. The old spellings ``plan
--memory-gb``, ``plan --cluster`` still work, with a one-line notice naming the new one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from subnetdp.commands import plan_budget, plan_cluster, plan_show
from subnetdp.commands.options import HelpFormatter

# job -> (help, its options, its run)
JOBS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                      Callable[[argparse.Namespace], int]]] = {
    "show": ("a plan: who holds which unit, its diagnostics, bytes and per-rank costs",
             plan_show.add_arguments, plan_show.run),
    "budget": ("the strategies and coverages that fit one memory budget per worker",
               plan_budget.add_budget_arguments, plan_budget.run_budget),
    "fit": ("a balanced plan in which every rank fits its own memory budget",
            plan_budget.add_fit_arguments, plan_budget.run_fit),
    "cluster": ("every strategy on a cluster: memory, bytes, predicted step time",
                plan_cluster.add_arguments, plan_cluster.run),
}


class PlanParser(argparse.ArgumentParser):
    """``plan``'s parser: ``plan OPTIONS`` is ``plan show OPTIONS``, and the old spellings of
    the jobs (``plan --cluster ...``, ``plan --memory-gb ...``) are read as the new ones, with
    a one-line notice."""

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        if not (argv and argv[0] in (*JOBS, "show")) and argv not in (["-h"], ["--help"]):
            job = old_job(argv)
            if job != "show":
                print(f"{self.prog}: `plan {_OLD[job]} ...` is now `plan {job} ...` (the old "
                      "spelling works for one release)", file=sys.stderr)
            argv = [job, *argv]
        return super().parse_known_args(argv, namespace)


_OLD = {"cluster": "--cluster", "budget": "--memory-gb GB", "fit": "--memory-gb GB,GB,..."}


def old_job(argv: list[str]) -> str:
    """The job of a command line that names none: ``--cluster`` (the advisor), ``--memory-gb``
    with one budget (budget) or one per worker (fit), else showing a plan."""
    if any(a == "--cluster" or a.startswith("--cluster=") for a in argv):
        return "cluster"
    for i, a in enumerate(argv):
        if a.startswith("--memory-gb"):
            value = a.partition("=")[2] or (argv[i + 1] if i + 1 < len(argv) else "")
            return "fit" if "," in value.strip(",") else "budget"
    return "show"


def add_parser(subparsers: Any) -> None:
    """Add the ``plan`` subcommand to an argparse ``add_subparsers()`` object."""
    p = subparsers.add_parser(
        "plan", help="build a plan (who holds which unit) and show its coverage, diagnostics "
                     "and bytes; what fits a memory budget or a cluster",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=HelpFormatter)
    p.__class__ = PlanParser  # argparse builds it; only its reading of the job differs
    jobs = p.add_subparsers(dest="job", metavar="JOB", title="jobs",
                            parser_class=argparse.ArgumentParser,
                            help="show (the default: `plan OPTIONS` is `plan show OPTIONS`), "
                                 "budget, fit or cluster")
    for name, (help_, add_arguments, _) in JOBS.items():
        add_arguments(jobs.add_parser(name, help=help_, description=help_,
                                      formatter_class=HelpFormatter))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``subnetdp plan``'s job; 0 on success, 2 on a user error."""
    return JOBS[args.job][2](args)
