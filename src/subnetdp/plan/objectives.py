"""What ``--scheme balanced`` balances: one resource, or several at once (``params+time``).

Torch-free, so that option parsing and config checks need no model. The costs themselves are
measured in ``subnet.costs``; the scheme (``plan.balance``) minimises the largest per-rank
ratio, over every resource named, of held cost to target.
"""

from __future__ import annotations

from subnetdp.plan.plan import PlanError

# params: parameter elements; flops: forward + backward; memory: parameters, gradients,
# optimizer state and saved activations; time / cpu-time: a step-time model, compute (FLOPs
# and activation traffic) plus the gradient all-reduce, with accelerator or CPU rates
# (subnet.costs.RATES).
RESOURCES = ("params", "flops", "memory", "time", "cpu-time")
# The default: parameters (the state b-sdp shrinks) and step time together, one plan near the
# coverage in both (benchmarks/results/balanced.md: params alone unbalances ResNet-18's
# compute, time alone keeps most of layer4 on one rank).
DEFAULT_BALANCE = "params+time"


def parse_balance(text: str) -> tuple[str, ...]:
    """``"params+time"`` -> ``("params", "time")``; a one-line error for unknown names."""
    names = tuple(x.strip() for x in text.split("+"))
    bad = [n for n in names if n not in RESOURCES]
    if bad or not names or len(set(names)) != len(names):
        raise PlanError(f"--balance {text!r}: give one or more of {', '.join(RESOURCES)} "
                        "joined by '+', each once (e.g. params+time)")
    return names
