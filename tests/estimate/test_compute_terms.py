"""What the FLOP rate misses (``steptime.ComputeTerms``): measured by ``estimate.calibrate``,
carried by ``estimate.rates`` to the advisor and the validation page."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from subnetdp.estimate.advisor import advise
from subnetdp.estimate.cluster import DEVICES, Cluster, Link, parse_cluster
from subnetdp.estimate.rates import advisor_rate, compute_terms, read_calibration
from subnetdp.estimate.spec import BenchSpec, make_bench_plan, meta_model
from subnetdp.estimate.steptime import ComputeTerms, held_fraction, predict_step, rank_flops
from subnetdp.models import get_recipe
from subnetdp.subnet.costs import recipe_costs

REPO = Path(__file__).resolve().parents[2]
SPEC = {"recipe": "llama-tiny", "world": 4, "batch": 2, "seq": 32,
        "model_args": (("n_layers", 4),)}
FAST = Cluster(1, 4, DEVICES["cpu"], Link(1e15, 0.0), shared_intra=True)


def _spec(label: str) -> BenchSpec:
    return BenchSpec(strategy=label, coverage=0.5 if "sdp" in label else 1.0,
                     **SPEC)  # type: ignore[arg-type]


def _held(spec: BenchSpec) -> float:
    recipe, meta = meta_model(spec, check_seq=False)
    costs = recipe_costs(recipe, batch=spec.batch, seq=spec.seq,
                         model_args=dict(spec.model_args))
    flops = rank_flops(spec, costs, make_bench_plan(spec, meta, recipe))
    return held_fraction(max(flops, key=lambda f: f.total), costs)


def test_narrow_factor_is_linear_in_the_held_width() -> None:
    """1 at full width, the measured efficiency at the measured width, linear between, the
    measured value below it; unmeasured terms leave the rate alone."""
    t = ComputeTerms(narrow_held=0.5, narrow_efficiency=0.8)
    assert t.narrow(1.0) == 1.0 and t.narrow(0.5) == pytest.approx(0.8)
    assert t.narrow(0.75) == pytest.approx(0.9) and t.narrow(0.25) == pytest.approx(0.8)
    assert ComputeTerms().narrow(0.3) == 1.0


def test_terms_scale_the_compute_they_describe() -> None:
    """n-sdp's narrowed rank runs at the narrow efficiency (with or without FSDP: both run the
    narrowed layers), checkpointed steps at the AC efficiency; the rest is untouched (bb-sdp
    runs every layer whole)."""
    terms = ComputeTerms(narrow_held=_held(_spec("n-sdp")), narrow_efficiency=0.8,
                         ac_efficiency=0.7)
    costs = recipe_costs(get_recipe("llama-tiny"), batch=2, seq=32, model_args={"n_layers": 4})
    for label, factor in (("n-sdp", 1 / 0.8), ("n-sdp+fsdp", 1 / 0.8), ("ddp+ac", 1 / 0.7),
                          ("b-sdp+ac", 1 / 0.7), ("ddp", 1.0), ("b-sdp", 1.0),
                          ("bb-sdp", 1.0), ("fsdp", 1.0)):
        spec = _spec(label)
        base = predict_step(spec, FAST, rate=1e10, backend="gloo", costs=costs)
        with_terms = predict_step(spec, FAST, rate=1e10, backend="gloo", costs=costs,
                                  terms=terms)
        assert with_terms.compute_s == pytest.approx(base.compute_s * factor), label


def _record(tmp_path: Path, **extra: object) -> Path:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"device": "cpu", "model_flops": 1e10, "recipe": "llama-tiny",
                                "batch_size": 4, "seq_len": 128, "nproc": 4,
                                "fsdp_call_s": 1e-3, **extra}))
    return path


def test_calibration_terms_reach_the_advisor(tmp_path: Path) -> None:
    """A ``calibrate`` record's terms become the advisor's rate (``--calibration``): n-sdp's
    row slows by the narrow efficiency, ddp's does not move; a record without them (before
    they were measured) leaves the FLOP rate alone."""
    path = _record(tmp_path, narrow={"coverage": 0.5, "held": 0.5, "efficiency": 0.8},
                   ac_efficiency=0.9)
    cluster = parse_cluster("nodes=1,gpus-per-node=4,gpu=cpu")
    base = BenchSpec(strategy="ddp", **SPEC)  # type: ignore[arg-type]
    rate = advisor_rate(base, cluster, calibration=str(path))
    assert rate.terms == ComputeTerms(0.5, 0.8, 0.9)
    assert "0.80 of the rate" in rate.describe() and "(measured with it)" in rate.describe()
    old = advisor_rate(base, cluster, calibration=str(_record(tmp_path)))
    assert old.terms is None and "(assumed)" in old.describe()
    rows = {}
    for r in (rate, old):
        (table,) = advise(base, [cluster], memory_gb=100, rate=r, coverages=(0.5,),
                          options=("ddp", "n-sdp"))
        rows[r.terms] = {a.spec.strategy: a.time.compute_s for a in table}
    assert rows[rate.terms]["ddp"] == pytest.approx(rows[None]["ddp"])
    assert rows[rate.terms]["n-sdp"] > 1.2 * rows[None]["n-sdp"]


@pytest.mark.parametrize("bad", [{"ac_efficiency": -1.0}, {"narrow": {"held": 0.5}},
                                 {"narrow": {"held": "half", "efficiency": 0.8}}])
def test_bad_terms_are_one_line(tmp_path: Path, bad: dict[str, object]) -> None:
    """A record whose terms are not positive numbers is refused in one line naming the file
    and the fix."""
    path = _record(tmp_path, **{"narrow": {"held": 0.5, "efficiency": 0.8},
                                "ac_efficiency": 0.9, **bad})
    with pytest.raises(ValueError) as e:
        read_calibration(path)
    assert str(e.value).startswith(f"--calibration {path}: ") and "\n" not in str(e.value)
    assert "python -m subnetdp.estimate.calibrate" in str(e.value)


def test_checked_in_calibration_moves_nsdp_the_measured_way() -> None:
    """The campaign measures n-sdp's compute-only step above its FLOP-rate prediction; the
    checked-in calibration (bare models, not the campaign) says the same: its narrowed rank
    runs slower per FLOP, so n-sdp's predicted step grows."""
    record = read_calibration(REPO / "benchmarks/results/cpu_calibration.json")
    terms = compute_terms(record)
    assert terms is not None and terms.narrow_efficiency < 1.0
    spec = _spec("n-sdp")
    assert (predict_step(spec, FAST, rate=1e10, backend="gloo", terms=terms).compute_s
            > predict_step(spec, FAST, rate=1e10, backend="gloo").compute_s)


def test_variants_are_the_models_the_terms_describe() -> None:
    """``calibrate``'s bare models: the narrowed one is n-sdp's slowest rank (its parameters
    and FLOPs), the checkpointed one has every block checkpointed (they train in
    ``test_steptime.test_calibration_file_round_trip``)."""
    from subnetdp.estimate.calibrate import _variants

    variants, held = _variants("llama-tiny", 1, 8, 4, 0.5)
    spec = BenchSpec(strategy="n-sdp", recipe="llama-tiny", world=4, batch=1, seq=8,
                     coverage=0.5)
    assert held == pytest.approx(_held(spec))
    recipe = get_recipe("llama-tiny")
    costs = recipe_costs(recipe, batch=1, seq=8)
    full, narrow = variants["full"][0], variants["narrow"][0]
    assert variants["full"][1] == pytest.approx(costs.shared.flops
                                                + sum(u.flops for u in costs.units))
    shared = sum(p.numel() for n, p in full.named_parameters() if not n.startswith("layers."))
    ratio = (sum(p.numel() for p in narrow.parameters()) - shared) / (
        sum(p.numel() for p in full.parameters()) - shared)
    assert 0.3 < ratio < 0.7
    ac_model = variants["ac"][0]
    assert all(getattr(b, "_subnetdp_checkpointed", False) for b in ac_model.layers)
    assert variants["ac"][1] > variants["full"][1]
