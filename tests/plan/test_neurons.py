"""Neuron-level units, layered plans, pieces and physically narrowed layers (no processes)."""

from __future__ import annotations

import json

import pytest
import torch

from subnetdp.cli import main
from subnetdp.models import get_recipe
from subnetdp.plan import PlanError, make_layered_plan, make_plan
from subnetdp.subnet.adapter import UnitAdapter
from subnetdp.subnet.build import build_full_model, materialize, narrow_tensors
from subnetdp.subnet.neurons import describe_neuron_units, group_bounds, plan_groups
from subnetdp.subnet.pieces import full_pieces, local_pieces, local_slices, reduction_order
from subnetdp.subnet.units import describe_units

SMALL = {"dim": 32, "n_layers": 2, "n_heads": 4, "vocab_size": 64, "ffn_hidden": 50,
         "max_seq_len": 16}
LLAMA = get_recipe("llama-tiny")


def _meta(**cfg):
    with torch.device("meta"):
        return LLAMA.build_model(**(SMALL | cfg))


def _plan(model, world=4, coverage=0.5, groups=4, kinds=None, rotate=False):
    units, shared, layers = describe_neuron_units(model, LLAMA.adapter, groups=groups,
                                                  kinds=kinds)
    return make_layered_plan(world=world, units=units, layers=layers, coverage=coverage,
                             shared_size=shared, rotate=rotate)


def test_group_bounds_are_contiguous_and_near_equal() -> None:
    assert group_bounds(50, 4) == [(0, 12), (12, 25), (25, 37), (37, 50)]
    assert group_bounds(2, 4) == [(0, 1), (1, 2)]  # never more groups than slots


def test_neuron_units_cover_the_pairs_exactly() -> None:
    model = _meta()
    units, shared, layers = describe_neuron_units(model, LLAMA.adapter, groups=4)
    total = sum(p.numel() for p in model.parameters())
    assert shared + sum(u.size for u in units) == total
    assert len(units) == 2 * 2 * 4 and layers == [i for i in range(4) for _ in range(4)]
    assert units[4].name == "layers.0.ffn[0]"
    assert units[4].size == 12 * 32 * 3  # 12 hidden units: rows of w1, w3, columns of w2
    # the kinds option: FFN only leaves the attention shared
    ffn, ffn_shared, _ = describe_neuron_units(model, LLAMA.adapter, groups=4, kinds=["ffn"])
    assert len(ffn) == 8 and ffn_shared > shared
    with pytest.raises(ValueError, match="unknown neuron kind"):
        describe_neuron_units(model, LLAMA.adapter, groups=4, kinds=["conv"])
    with pytest.raises(ValueError, match="declares no neuron pairs"):
        describe_neuron_units(model, UnitAdapter(unit_paths=lambda m: ["layers.0"]), groups=2)


def test_layered_plan_gives_k_groups_of_every_layer() -> None:
    plan = _plan(_meta(), rotate=False)
    rotated = _plan(_meta(), rotate=True)
    for p in (plan, rotated):
        for rank in range(4):
            held = p.held_units(rank)
            assert [sum(1 for u in held if u // 4 == layer) for layer in range(4)] == [2] * 4
    assert plan.matrix != rotated.matrix
    assert set(plan.holder_sets()) == set(rotated.holder_sets())  # no extra process groups
    everyone = _plan(_meta(), coverage=1.0)
    assert all(all(row) for row in everyone.matrix)


def test_pieces_tile_every_tensor_and_local_maps_are_consistent() -> None:
    model = _meta(n_kv_heads=2)
    plan = _plan(model, groups=2)
    groups = plan_groups(model, LLAMA.adapter, [u.name for u in plan.units])
    pieces = full_pieces(model, [u.name for u in plan.units], groups)
    state = model.state_dict()
    assert len({p.name for p in pieces}) == len(pieces)
    for key, t in state.items():
        ps = [p for p in pieces if p.key == key]
        assert sum(p.numel for p in ps) == t.numel(), key
    order = reduction_order(pieces)
    assert {p.name for p in order} == {p.name for p in pieces if p.is_param}
    # each group's slices are consecutive in the reducer's order (one bucket per group)
    units_seq = [p.unit for p in order if p.unit is not None]
    assert all(units_seq.count(u) == len([x for x in units_seq if x == u]) for u in units_seq)
    runs = [u for i, u in enumerate(units_seq) if i == 0 or units_seq[i - 1] != u]
    assert len(runs) == len(set(units_seq))
    held = plan.held_units(1)
    local = local_pieces(pieces, held)
    slices = local_slices(pieces, held)
    dim, index = slices["layers.0.attn.wq.weight"]
    assert dim == 0 and index.numel() == 16  # one of two K/V heads = 2 query heads x 8
    assert [lp.local_start for lp in local["layers.0.attn.wo.weight"]] == [0]


def _resnet_meta():
    with torch.device("meta"):
        return get_recipe("resnet18-fmnist").build_model(width=4)


@pytest.mark.parametrize("name", ["llama-tiny", "resnet18-fmnist"])
def test_materialized_slices_equal_the_full_model_at_their_indices(name: str) -> None:
    recipe = get_recipe(name)
    meta = _meta if name == "llama-tiny" else _resnet_meta
    model = meta()
    units, shared, layers = describe_neuron_units(model, recipe.adapter, groups=4)
    plan = make_layered_plan(world=4, units=units, layers=layers, coverage=0.5,
                             shared_size=shared)
    names = [u.name for u in plan.units]
    pieces = full_pieces(model, names, plan_groups(model, recipe.adapter, names))
    slices = local_slices(pieces, plan.held_units(2))
    narrow = materialize(model, recipe.adapter, device="cpu", seed=5, slices=slices)
    ref = build_full_model(meta(), recipe.adapter, seed=5).state_dict()
    assert slices and set(narrow.state_dict()) == set(ref)
    for key, value in narrow.state_dict().items():
        expected = ref[key]
        if key in slices:
            dim, index = slices[key]
            expected = expected.index_select(dim, index)
        torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_head_sliced_attention_runs_with_valid_shapes(kv_heads) -> None:
    model = build_full_model(_meta(n_kv_heads=kv_heads), LLAMA.adapter, seed=1)
    plan = _plan(model, groups=2, kinds=["heads"])
    names = [u.name for u in plan.units]
    pieces = full_pieces(model, names, plan_groups(model, LLAMA.adapter, names))
    narrow_tensors(model, local_slices(pieces, plan.held_units(0)))
    attn = model.layers[0].attn
    n_rep = 4 // (kv_heads or 4)
    assert attn.wq.weight.shape[0] == attn.wk.weight.shape[0] * n_rep == 16
    assert attn.wo.weight.shape[1] == 16
    logits = model(torch.randint(0, 64, (2, 8)))
    assert logits.shape == (2, 8, 64) and torch.isfinite(logits).all()


def test_a_block_plan_is_refused_for_nsdp() -> None:
    model = _meta()
    units, shared = describe_units(model, LLAMA.adapter)
    plan = make_plan(world=2, units=units, coverage=0.5, shared_size=shared)
    with pytest.raises(PlanError, match="not a neuron group"):
        plan_groups(model, LLAMA.adapter, [u.name for u in plan.units])


def test_plan_command_nsdp(capsys) -> None:
    rc = main(["plan", "--nproc", "4", "--recipe", "llama-tiny", "--strategy", "n-sdp",
               "--coverage", "0.5", "--neuron-kinds", "ffn", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["k"] == 2 and rep["units_per_layer"] == 4
    assert rep["num_units"] == 8 * 4
    assert main(["plan", "--nproc", "4", "--units", "8", "--strategy", "n-sdp",
                 "--coverage", "0.5"]) == 2
    assert "needs --recipe" in capsys.readouterr().err


def test_default_groups_make_coverage_exact() -> None:
    from subnetdp.subnet.neurons import default_groups

    assert default_groups(4, 0.5) == 4
    assert default_groups(4, 0.375) == 8  # 3 of 8, not round(1.5) = 2 of 4 (C = 0.5)
    assert default_groups(4, 0.75) == 4
    assert default_groups(8, 0.69) == 8  # no multiple up to 4x is exact: the world size
