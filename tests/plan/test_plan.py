"""Plans: schemes (balance, connectivity), validation errors, diagnostics, bytes, JSON."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest

from subnetdp.plan import (
    Plan,
    PlanError,
    Unit,
    can_connect,
    connected_components,
    diagnostics,
    explicit_plan,
    is_connected,
    make_plan,
    mask_error,
    min_units_per_worker,
    mixing_matrix,
    naive_window,
    param_coverage,
    random_matrix,
    spectral_gap,
    spread_matrix,
    unit_coverage,
    units_for_coverage,
    worker_bytes,
)


def _counts(m: tuple[tuple[bool, ...], ...]) -> list[int]:
    return [sum(row[u] for row in m) for u in range(len(m[0]))]


def _feasible(max_world: int, max_units: int):
    for n in range(1, max_world + 1):
        for u in range(1, max_units + 1):
            for k in range(math.ceil(u / n), u + 1):
                yield n, u, k


def _assert_balanced(m: tuple[tuple[bool, ...], ...], n: int, u: int, k: int) -> None:
    assert len(m) == n and all(len(row) == u for row in m)
    assert all(sum(row) == k for row in m)
    c = _counts(m)
    assert min(c) >= 1
    assert max(c) - min(c) <= 1
    if (n * k) % u == 0:
        assert c == [n * k // u] * u


# -- schemes ----------------------------------------------------------------------------------
def test_spread_balanced_and_connected_exactly_when_possible() -> None:
    # 4000+ configurations: spread is balanced and connected iff a connected plan can exist.
    checked = connected = 0
    for n, u, k in _feasible(16, 24):
        m = spread_matrix(n, u, k)
        _assert_balanced(m, n, u, k)
        conn = len(connected_components(m)) == 1
        assert conn == can_connect(n, u, k), (n, u, k)
        checked += 1
        connected += conn
    assert checked > 4000 and connected > 3000


def test_spread_layout_matches_method() -> None:
    # worker i starts at floor(i*U/N): N=4, U=6, k=3 -> starts 0, 1, 3, 4.
    p = make_plan(world=4, units=6, coverage=0.5)
    assert [p.held_units(i) for i in range(4)] == [[0, 1, 2], [1, 2, 3], [3, 4, 5], [0, 4, 5]]
    assert p.holder_counts() == [2] * 6


def test_spread_offset_rotates() -> None:
    base, rot = spread_matrix(4, 8, 3), spread_matrix(4, 8, 3, offset=2)
    for i in range(4):
        assert [u for u in range(8) if rot[i][u]] == sorted((u + 2) % 8 for u in range(8)
                                                               if base[i][u])


def test_random_balanced_connected_and_seeded() -> None:
    checked = 0
    for n, u, k in _feasible(8, 12):
        if not can_connect(n, u, k):
            continue
        m = random_matrix(n, u, k, np.random.default_rng(n * 100 + u))
        _assert_balanced(m, n, u, k)
        assert len(connected_components(m)) == 1, (n, u, k)
        checked += 1
    assert checked > 300
    a = make_plan(world=8, units=16, coverage=0.25, scheme="random", seed=7)
    b = make_plan(world=8, units=16, coverage=0.25, scheme="random", seed=7)
    c = make_plan(world=8, units=16, coverage=0.25, scheme="random", seed=8)
    assert a == b and a.matrix != c.matrix
    assert a.matrix != make_plan(world=8, units=16, coverage=0.25).matrix  # not just spread


def test_random_refuses_when_no_connected_plan_exists() -> None:
    # N=4, U=8, k=2: a disjoint partition, the only balanced layout; random must refuse.
    with pytest.raises(PlanError, match=r"no connected plan.*k >= 3.*the spread scheme"):
        make_plan(world=4, units=8, coverage=0.25, scheme="random")
    assert min_units_per_worker(4, 8, connected=True) == 3
    assert min_units_per_worker(4, 8) == 2


def test_naive_window_splits_but_spread_connects() -> None:
    # N=8, U=6, k=3: naive gives even workers {0,1,2} and odd workers {3,4,5}: two islands.
    naive = naive_window(8, 6, 3)
    _assert_balanced(naive, 8, 6, 3)
    assert connected_components(naive) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    spread = spread_matrix(8, 6, 3)
    assert len(connected_components(spread)) == 1
    # N=8, U=16, k=4: naive pairs worker i with i+4 only -> four islands; spread is connected.
    naive = naive_window(8, 16, 4)
    assert connected_components(naive) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    p = make_plan(world=8, units=16, coverage=0.25)
    assert is_connected(p) and spectral_gap(p) > 0.01
    naive_plan = explicit_plan(naive)
    assert not is_connected(naive_plan) and spectral_gap(naive_plan) < 1e-9


def test_coverage_rounding() -> None:
    assert units_for_coverage(0.5, 5) == 3  # half rounds up, not to even
    assert units_for_coverage(0.35, 10) == 4  # 3.4999... from float error still rounds to 4
    assert units_for_coverage(0.69, 16) == 11
    assert units_for_coverage(0.01, 10) == 1  # never zero units
    assert make_plan(world=2, units=5, coverage=0.5).held_units(0) == [0, 1, 2]


# -- extremes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["spread", "random"])
def test_full_coverage_is_ddp(scheme: str) -> None:
    p = make_plan(world=5, units=[Unit(f"b{i}", 10 * (i + 1)) for i in range(7)], coverage=1.0,
                  scheme=scheme, shared_size=3)
    assert all(p.held_units(i) == list(range(7)) for i in range(5))
    assert p.holder_counts() == [5] * 7 and p.holder_sets() == [(0, 1, 2, 3, 4)]
    assert mask_error(p) == pytest.approx(0.0, abs=1e-12)
    assert spectral_gap(p) == pytest.approx(1.0)
    np.testing.assert_allclose(mixing_matrix(p), np.full((5, 5), 0.2))
    assert unit_coverage(p) == [1.0] * 5 and param_coverage(p) == [1.0] * 5


def test_disjoint_partition() -> None:
    p = make_plan(world=4, units=8, coverage=0.25)
    assert p.holder_counts() == [1] * 8
    assert mask_error(p) == pytest.approx(3 / 4)
    assert spectral_gap(p) == pytest.approx(0.0, abs=1e-9)
    assert not is_connected(p)
    assert len(connected_components(p.matrix)) == 4


def test_mask_error_and_gap_by_hand() -> None:
    # N=2, unit0 held by both (size 2), unit1 only by rank 1 (size 1), shared 1; S = 4.
    p = explicit_plan([[1, 0], [1, 1]], [Unit("a", 2), Unit("b", 1)], shared_size=1)
    # eps = (2*(1/2-1/2) + 1*(1-1/2)) / 4 = 1/8
    assert mask_error(p) == pytest.approx(1 / 8)
    # W = (1*J/2 + 2*J/2 + 1*I)/4 = [[5/8, 3/8], [3/8, 5/8]] -> eigenvalues 1, 1/4 -> gap 3/4.
    np.testing.assert_allclose(mixing_matrix(p), [[5 / 8, 3 / 8], [3 / 8, 5 / 8]])
    assert spectral_gap(p) == pytest.approx(0.75)
    assert param_coverage(p) == [0.75, 1.0] and unit_coverage(p) == [0.5, 1.0]


def test_zero_sizes_treated_as_equal_and_world_one() -> None:
    zero = [Unit(f"u{i}", 0) for i in range(8)]
    a = make_plan(world=4, units=zero, coverage=0.5)
    b = make_plan(world=4, units=8, coverage=0.5)
    assert mask_error(a) == pytest.approx(mask_error(b))
    assert spectral_gap(a) == pytest.approx(spectral_gap(b))
    with pytest.raises(PlanError, match="minimum coverage for 1 workers"):
        make_plan(world=1, units=3, coverage=1 / 3)
    assert spectral_gap(make_plan(world=1, units=3, coverage=1.0)) == 1.0
    assert is_connected(make_plan(world=1, units=3, coverage=1.0))


# -- plan queries -----------------------------------------------------------------------------
def test_holders_owner_and_holder_sets_order() -> None:
    p = explicit_plan([[0, 1, 1, 0], [1, 1, 0, 1], [1, 0, 1, 1]])
    assert [p.holders(u) for u in range(4)] == [(1, 2), (0, 1), (0, 2), (1, 2)]
    assert [p.owner(u) for u in range(4)] == [1, 0, 0, 1]
    assert p.holder_sets() == [(1, 2), (0, 1), (0, 2)]  # first appearance, deduplicated
    assert p.held_units(1) == [0, 1, 3] and p.holds(2, 2) and not p.holds(0, 0)
    d = diagnostics(p)
    assert d["assignment"] == [[1, 2], [0, 1, 3], [0, 2, 3]]
    assert d["holders"] == [2, 2, 2, 2] and d["holder_sets"] == 3
    assert d["k_per_worker"] == [2, 3, 3] and d["connected"] is True


def test_json_round_trip() -> None:
    units = [Unit("layers.0", 123), Unit("layers.1", 0), Unit("layers.2", 7)]
    p = make_plan(world=3, units=units, coverage=2 / 3, scheme="random", seed=5, shared_size=9)
    q = Plan.from_json(p.to_json())
    assert q == p and q.to_dict() == p.to_dict()
    assert q.coverage == 2 / 3 and q.seed == 5 and q.scheme == "random" and q.units == p.units
    e = explicit_plan([[True, False], [True, True]])
    assert Plan.from_dict(e.to_dict()) == e
    assert e.to_dict()["matrix"] == [[1, 0], [1, 1]]


def test_plan_module_does_not_import_torch() -> None:
    code = "import sys, subnetdp.plan; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# -- errors -----------------------------------------------------------------------------------
def test_explicit_unit_without_holder() -> None:
    with pytest.raises(PlanError, match=r"unit\(s\) 1 \(unit1\) have no holder"):
        explicit_plan([[1, 0, 1], [1, 0, 0]])


@pytest.mark.parametrize(
    ("matrix", "pattern"),
    [
        ([[1, 1], [1]], r"row 1 .* 1 entries but there are 2 units"),
        ([[1, 2]], r"0/1 or true/false"),
        ([], r"empty"),
    ],
)
def test_explicit_bad_shape(matrix: list, pattern: str) -> None:
    with pytest.raises(PlanError, match=pattern):
        explicit_plan(matrix)


def test_explicit_units_mismatch() -> None:
    with pytest.raises(PlanError, match="2 columns but 3 units"):
        explicit_plan([[1, 1]], [Unit("a", 1), Unit("b", 1), Unit("c", 1)])


@pytest.mark.parametrize("coverage", [0.0, 1.5, -0.1])
def test_coverage_out_of_range(coverage: float) -> None:
    with pytest.raises(PlanError, match=r"coverage must be in \(0, 1\]"):
        make_plan(world=4, units=8, coverage=coverage)


def test_too_little_coverage_names_minimum() -> None:
    # N=3, U=10, C=0.2 -> k=2, 2*3 < 10; minimum is ceil(10/3)=4 units -> 0.4.
    with pytest.raises(PlanError, match=r"no holder .*minimum coverage .* 4/10 = 0\.4"):
        make_plan(world=3, units=10, coverage=0.2)


def test_other_make_plan_errors() -> None:
    with pytest.raises(PlanError, match=r"unknown scheme 'ring'.*'spread', 'random' or 'balanced'"):
        make_plan(world=4, units=8, coverage=0.5, scheme="ring")
    with pytest.raises(PlanError, match="world must be >= 1"):
        make_plan(world=0, units=8, coverage=0.5)
    with pytest.raises(PlanError, match="at least one unit"):
        make_plan(world=2, units=0, coverage=0.5)
    with pytest.raises(PlanError, match="at least one unit"):
        make_plan(world=2, units=[], coverage=0.5)
    assert issubclass(PlanError, ValueError)


def test_validate_world_mismatch() -> None:
    p = make_plan(world=8, units=16, coverage=0.5)
    p.validate(8)
    with pytest.raises(PlanError, match=r"built for 8 workers but 4 are running; rebuild it "
                                        r"for 4 \(subnetdp plan --nproc 4 \.\.\., or "
                                        r"make_plan\(world=4, \.\.\.\)\)"):
        p.validate(world_size=4)


@pytest.mark.parametrize("call", [
    lambda: make_plan(world=1, units=4, coverage=0.5),
    lambda: make_plan(world=4, units=10, coverage=0.25, scheme="random"),
    lambda: make_plan(world=2, units=0, coverage=0.5),
])
def test_api_errors_name_no_cli_flag(call: Callable[[], object]) -> None:
    """Issue 41, item 12: the Python API's errors name no flag (``--world`` is not even the
    CLI's name any more): they name the quantity."""
    with pytest.raises(PlanError) as err:
        call()
    assert "--" not in str(err.value), err.value


def test_from_json_errors() -> None:
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("{")
    with pytest.raises(PlanError, match="needs world, units and matrix"):
        Plan.from_json('{"world": 2}')
    d = make_plan(world=2, units=2, coverage=0.5).to_dict()
    d["matrix"] = [[1, 0], [1, 0]]
    with pytest.raises(PlanError, match="no holder"):
        Plan.from_dict(d)
    d["version"] = 99
    with pytest.raises(PlanError, match="version 99"):
        Plan.from_dict(d)


# -- cost -------------------------------------------------------------------------------------
def test_worker_bytes_by_hand() -> None:
    # 3 workers, shared 10; unit a (100) held by 0,1,2; b (20) by 0,1; c (5) by 2 only.
    units = [Unit("a", 100), Unit("b", 20), Unit("c", 5)]
    p = explicit_plan([[1, 1, 0], [1, 1, 0], [1, 0, 1]], units, shared_size=10)
    w0 = worker_bytes(p, 0)
    assert w0.params == w0.grads == (10 + 100 + 20) * 4 == 520
    assert w0.optimizer == 2 * 520
    assert w0.allreduce_payload == 520  # shared + a + b, all with >= 2 holders
    # ring: (10 + 100) elements over 3 workers -> 4/3 * 440 bytes; b over 2 -> 1 * 80 bytes.
    assert w0.allreduce_ring == round(4 / 3 * 440 + 80) == 667
    w2 = worker_bytes(p, 2, param_bytes=2, optimizer_states=1)
    assert w2.params == (10 + 100 + 5) * 2 == 230 and w2.optimizer == 230
    assert w2.allreduce_payload == (10 + 100) * 2  # c has one holder: never communicated
    assert w2.allreduce_ring == round(4 / 3 * 220)
    assert w2.to_dict() == {"params": 230, "grads": 230, "optimizer": 230,
                            "allreduce_payload": 220, "allreduce_ring": 293,
                            "refresh_sent": 0, "refresh_received": 0}
    # backward masking: the full model is stored; gradients and optimizer state only for what
    # is held; owners send each unit to its non-holders (a: none; b: 0 -> 2; c: 2 -> 0, 1)
    b0 = worker_bytes(p, 0, masking="backward")
    assert b0.params == 135 * 4 and b0.grads == 520 and b0.optimizer == 1040
    assert (b0.refresh_sent, b0.refresh_received) == (20 * 4, 5 * 4)
    b1 = worker_bytes(p, 1, masking="backward")
    assert (b1.refresh_sent, b1.refresh_received) == (0, 5 * 4)
    b2 = worker_bytes(p, 2, masking="backward")
    assert (b2.refresh_sent, b2.refresh_received) == (5 * 2 * 4, 20 * 4)
    with pytest.raises(ValueError, match="masking"):
        worker_bytes(p, 0, masking="sideways")
    solo = worker_bytes(make_plan(world=1, units=[Unit("a", 3)], coverage=1.0, shared_size=2), 0)
    assert solo.params == 20 and solo.allreduce_payload == 0 and solo.allreduce_ring == 0
    with pytest.raises(IndexError):
        worker_bytes(p, 3)
