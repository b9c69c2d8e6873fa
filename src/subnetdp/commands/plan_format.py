"""What ``subnetdp plan`` prints of a plan: its table, the per-rank cost table, and the line
on a lost worker (the report itself is ``plan.report.plan_report``)."""

from __future__ import annotations

from typing import Any


def _bar(x: float, width: int = 20) -> str:
    n = round(max(0.0, min(1.0, x)) * width)
    return "#" * n + "." * (width - n)


def format_costs(rep: dict) -> str:
    """The per-rank cost table with text bars (share of the full model's cost)."""
    rows = rep["per_rank_cost"]
    c = rep["unit_costs"]
    batch = f"batch {c['batch']}" + (f" x {c['seq']} tokens" if c["seq"] else "")
    kinds = list(rows[0])
    lines = [f"per-rank cost, share of the full model (measured on meta tensors, {batch}; "
             "memory = parameters, gradients, optimizer state and saved activations; time = "
             "compute + gradient all-reduce, subnet.costs' step-time model)"
             + (f"; the plan balances {rep['balance']}" if rep.get("balance") else "") + ":",
             f"{'worker':>6}  " + "  ".join(f"{k:>8} {'':12}" for k in kinds)]
    for i, r in enumerate(rows):
        lines.append(f"{i:>6}  " + "  ".join(f"{r[k]:>8.3f} {_bar(r[k], 12)}" for k in kinds))
    for k in kinds:
        vals = [r[k] for r in rows]
        lines.append(f"{k:>8}: max / mean = {max(vals) / (sum(vals) / len(vals)):.3f}")
    return "\n".join(lines)


def _ranges(units: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8" (keeps the table narrow for big plans)."""
    parts: list[str] = []
    i = 0
    while i < len(units):
        j = i
        while j + 1 < len(units) and units[j + 1] == units[j] + 1:
            j += 1
        parts.append(str(units[i]) if i == j else f"{units[i]}-{units[j]}")
        i = j + 1
    return ",".join(parts) or "-"


def format_table(rep: dict) -> str:
    title = f"plan: {rep['world']} workers, {rep['num_units']} units, scheme {rep['scheme']}"
    if rep.get("coverage") is not None:
        per = "" if rep["units_per_layer"] == rep["num_units"] else \
            f" per layer of {rep['units_per_layer']}"
        title += f", coverage {rep['coverage']:g} (k={rep['k']}{per})"
    if rep["model"] is not None:
        title += f", model {rep['model']} (shared {rep['shared_size']:,} elements)"
    lines = [
        title,
        f"mask error {rep['mask_error']:.4f}   spectral gap {rep['spectral_gap']:.4f}   "
        f"connected {'yes' if rep['connected'] else 'NO'}   holder sets {rep['holder_sets']}   "
        f"communicators per rank <= {max(rep['communicators'])}",
        f"{'worker':>6}  {'units held':<20}  {'unit cov':>8}  {'param cov':>9}  {'payload MB':>10}",
    ]
    for i, held in enumerate(rep["assignment"]):
        mb = rep["bytes_per_worker"][i]["allreduce_payload"] / 1e6
        lines.append(
            f"{i:>6}  {_ranges(held):<20}  {rep['unit_coverage'][i]:>8.3f}  "
            f"{rep['param_coverage'][i]:>9.3f}  {mb:>10.3f}"
        )
    lines.append(_rescue_line(rep))
    lines += [_node_line(n) for n in rep.get("nodes", [])]
    return "\n".join(lines)


def _node_line(n: dict[str, Any]) -> str:
    """One node's blast radius ([Note: holders across nodes] in plan/nodes.py)."""
    head = f"node {n['node']} (ranks {_ranges(n['ranks'])}): its loss takes "
    head += f"unit(s) {_ranges(n['lost_units'])}" if n["lost_units"] else "no unit"
    if n["rollback"] is None:
        return head + (f"; survives without rollback ({n['survivors']} workers go on from the "
                       "step in flight; not with --zero/--fsdp)")
    return head + f"; rollback to the newest checkpoint ({n['rollback']})"


def _rescue_line(rep: dict) -> str:
    """Whether losing one worker costs a rollback to the newest checkpoint ([Note: rescue]),
    and how an elastic run of the plan shrinks (``_shrink``)."""
    ok, world, shrink = rep["rescuable_ranks"], rep["world"], rep["shrink"]
    line = f"single-holder units {rep['single_holder_units']}   "
    if "refused" in shrink:
        if not shrink["given"]:
            return line + ("a lost worker costs a rollback to the newest checkpoint "
                           f"(--max-restarts); an elastic run is refused: {shrink['refused']}")
        return line + f"an elastic run is refused at its start: {shrink['refused']}"
    kept = "".join(f"; at {w} workers it re-plans with --min-holders {h}"
                   for w, h in shrink["min_holders"].items() if h < rep["min_holders"])
    if world > 1 and shrink["min_nproc"] == world:
        return line + f"a lost worker is not rescued: --min-nproc {world} leaves no smaller world"
    if world > 1 and len(ok) == world:
        return line + ("a lost worker is recoverable without rollback (any one rank; "
                       f"--min-nproc {shrink['min_nproc']}, not with --zero/--fsdp){kept}")
    if not ok or world == 1:
        return line + "a lost worker costs a rollback to the newest checkpoint (--min-holders 2)"
    return line + (f"only the loss of rank(s) {_ranges(ok)} is recoverable without rollback "
                   f"(--min-holders 2 for any){kept}")
