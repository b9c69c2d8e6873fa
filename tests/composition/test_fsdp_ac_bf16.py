"""SDP composed with FSDP2, activation checkpointing and bf16 (runtime.fsdp, checkpointing).

Oracles: the composed run must equal the plain SDP run (same plan, seed and data) after several
AdamW steps; activation checkpointing must change nothing; bf16 must train and stay finite; and
FSDP must create no process group beyond one per distinct holder set (+ the world).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from subnetdp.models import get_recipe
from subnetdp.plan import make_plan
from subnetdp.runtime import SubnetDataParallel
from subnetdp.runtime.grouped import GroupedLayer
from subnetdp.subnet.neurons import make_neuron_plan
from subnetdp.subnet.units import describe_units, unit_modules
from tests.dist.harness import run_workers

WORLD = 4
STEPS = 4
# the composition tests' llama (test_compile, test_optim and test_schedule_runtime import it)
MODEL = {"dim": 32, "n_layers": 8, "n_heads": 4, "vocab_size": 64, "max_seq_len": 16,
         "ffn_hidden": 48}
# this file's runs: with 4 layers every strategy's plan still has 4 distinct holder pairs (as
# with 8), at half of n-sdp's FSDP groups (each a gather and a reduce-scatter per step: most of
# this file's time)
LAYERS = 4
RESNET = {"width": 4}  # resnet18-fmnist: BatchNorm inside n-sdp's channel groups


def _meta_model(name: str = "llama", layers: int = MODEL["n_layers"]) -> Any:
    recipe = get_recipe("llama-tiny" if name == "llama" else "resnet18-fmnist")
    with torch.device("meta"):
        return recipe, recipe.build_model(
            **({**MODEL, "n_layers": layers} if name == "llama" else RESNET))


def _batch(name: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    if name == "llama":
        tokens = torch.randint(0, MODEL["vocab_size"], (2, 17), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(4, 1, 28, 28, generator=g), torch.randint(0, 10, (4,), generator=g)


def _plan(strategy: str, coverage: float = 0.5, name: str = "llama",
          layers: int = MODEL["n_layers"]):
    recipe, model = _meta_model(name, layers)
    if strategy in ("n-sdp", "nb-sdp"):
        return make_neuron_plan(model, recipe.adapter, world=WORLD, coverage=coverage, seed=0)
    units, shared = describe_units(model, recipe.adapter)
    return make_plan(world=WORLD, units=units, coverage=coverage, seed=0, shared_size=shared)


def _train(rank: int, world: int, strategy: str, plan: Any, opts: dict[str, Any],
           steps: int = STEPS, repeat: bool = False, name: str = "llama") -> dict[str, Any]:
    """``repeat``: the same batch every step (learnable: the loss must fall)."""
    recipe, model = _meta_model(name, LAYERS)
    groups_before = _groups_created()
    sdp = SubnetDataParallel(model, plan=plan, adapter=recipe.adapter, strategy=strategy,
                             device="cpu", init_seed=0, **opts)
    groups = _groups_created() - groups_before
    opt = torch.optim.AdamW(sdp.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
                            foreach=False)
    losses = []
    for step in range(steps):
        x, y = _batch(name, rank, 0 if repeat else step)
        logits = sdp(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        sdp.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        dtype = logits.dtype
    state = sdp.full_state_dict()
    return {"state": state, "losses": losses, "groups": groups, "dtype": dtype,
            "bytes": sdp.comm_stats.last_step_bytes, "created": sdp.groups.created,
            "held": sdp.params_held, "trained": sdp.params_trained,
            "fsdp_modules": len(getattr(sdp.backend, "sharded", [])),
            "grouped": _grouped_layers(sdp.backend.module)}


def _grouped_layers(module: torch.nn.Module) -> dict[str, int]:
    """n-sdp + FSDP's grouped layers: how many, how many run as one matmul, and how many of
    their parts carry forward hooks (FSDP's, where a part is its own FSDP module)."""
    layers = [m for m in module.modules() if isinstance(m, GroupedLayer)]
    return {"layers": len(layers), "as_one": sum(m.as_one for m in layers),
            "hooked_parts": sum(bool(p._forward_pre_hooks) for m in layers for p in m.parts)}


def _groups_created() -> int:
    return len(dist.distributed_c10d._world.pg_map)


FSDP_CASES = [("b-sdp", "llama"), ("bb-sdp", "llama"), ("n-sdp", "llama"), ("n-sdp", "resnet"),
              ("nb-sdp", "llama"), ("nb-sdp", "resnet")]
AC_CASES = [("b-sdp", {}), ("bb-sdp", {}), ("n-sdp", {}), ("nb-sdp", {}), ("b-sdp", {"fsdp": True}),
            ("bb-sdp", {"fsdp": True}), ("n-sdp", {"fsdp": True})]
BF16_CASES = [
    ("b-sdp", {"param_dtype": torch.bfloat16}),
    ("b-sdp", {"fsdp": True, "activation_checkpointing": True, "param_dtype": torch.bfloat16,
               "reduce_dtype": torch.float32}),
    ("bb-sdp", {"fsdp": True, "param_dtype": torch.bfloat16}),  # frozen copies stored bf16
    ("n-sdp", {"fsdp": True, "param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16}),
]
Config = tuple[dict[str, Any], int, bool]  # opts, steps, repeat


def _configs(strategy: str, name: str) -> list[Config]:
    """Every configuration the tests below train for this strategy and model."""
    out: list[Config] = []
    if (strategy, name) in FSDP_CASES:
        out += [({}, STEPS, False), ({"fsdp": True}, STEPS, False)]
    if name == "llama":
        out += [({**o, "activation_checkpointing": ac}, STEPS, False)
                for s, o in AC_CASES if s == strategy for ac in (False, True)]
        out += [(o, 10, True) for s, o in BF16_CASES if s == strategy]
    return out


def _key(opts: dict[str, Any], steps: int, repeat: bool) -> tuple[Any, ...]:
    opts = {k: v for k, v in opts.items() if k != "activation_checkpointing" or v}
    return tuple(sorted(opts.items())), steps, repeat


Case = tuple[str, str, Any, list[Config]]  # strategy, model, plan, configurations


def _train_all(rank: int, world: int, cases: list[Case]) -> list[list[dict[str, Any]]]:
    return [[_train(rank, world, strategy, plan, opts, steps, repeat, name)
             for opts, steps, repeat in configs] for strategy, name, plan, configs in cases]


@cache
def _all_runs() -> dict[tuple[str, str], dict[tuple[Any, ...], list[Any]]]:
    """Every strategy's and model's configurations, trained one after the other in one launch
    of workers, each on ``_plan(strategy, name)``: per (strategy, model), per configuration, the
    per-rank results."""
    cases = [(s, n, _plan(s, name=n, layers=LAYERS),
              list({_key(*c): c for c in _configs(s, n)}.values()))
             for s, n in dict.fromkeys([*FSDP_CASES, *((s, "llama") for s, _ in AC_CASES),
                                        *((s, "llama") for s, _ in BF16_CASES)])]
    by_rank = run_workers(_train_all, WORLD, cases, timeout=480)  # all of them: ~1 min CPU
    return {(s, n): {_key(*c): [res[i][j] for res in by_rank] for j, c in enumerate(configs)}
            for i, (s, n, _, configs) in enumerate(cases)}


def _run(strategy: str, opts: dict[str, Any], steps: int = STEPS, repeat: bool = False,
         name: str = "llama") -> list[Any]:
    """Per-rank results of one configuration."""
    return _all_runs()[strategy, name][_key(opts, steps, repeat)]


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)


@pytest.mark.parametrize(("strategy", "name"), FSDP_CASES)
def test_fsdp_equals_plain_sdp(strategy: str, name: str) -> None:
    plan = _plan(strategy, name=name, layers=LAYERS)
    plain = _run(strategy, {}, name=name)
    sharded = _run(strategy, {"fsdp": True}, name=name)
    _assert_same(plain[0]["state"], sharded[0]["state"], 1e-5)
    for p, s in zip(plain, sharded, strict=True):
        assert p["losses"] == pytest.approx(s["losses"], abs=1e-5)
    # one group per distinct holder set (singletons included: FSDP needs a mesh) + the world,
    # which is the default group; the meshes FSDP builds from them add none
    distinct = {h for h in plan.holder_sets() if len(h) < WORLD}
    for rank, r in enumerate(sharded):
        assert r["created"] == len(distinct)
        assert r["groups"] == sum(rank in h for h in distinct)  # a rank sees its own groups
    # FSDP traffic per step (fp32): each held unit all-gathered twice (forward, backward; once
    # for n-sdp's neuron groups, which stay gathered: runtime.fsdp [Note: neuron groups]) and
    # reduce-scattered once over its holders; the shared parameters gathered once (the root
    # stays unsharded until backward) and reduce-scattered once over the world
    gathers = 1 if strategy in ("n-sdp", "nb-sdp") else 2
    for rank, r in enumerate(sharded):
        units = sum(plan.units[u].size for u in plan.held_units(rank)
                    if len(plan.holders(u)) > 1)
        assert r["bytes"] == 4 * ((gathers + 1) * units + 2 * plan.shared_size)
    # every rank stores a shard of what it holds: less than the plain run
    assert all(s["trained"] < p["trained"] for p, s in zip(plain, sharded, strict=True))
    if (strategy, name) == ("n-sdp", "llama"):  # one FSDP module per block and holder group
        # (+ the root), not one per layer's part: [Note: one FSDP module per block and
        # holder group] in runtime.fsdp
        recipe, model = _meta_model(name, LAYERS)
        blocks = [b for b, _ in unit_modules(model, recipe.adapter)]

        def block(u: int) -> str:
            return next(b for b in blocks if plan.units[u].name.startswith(b + "."))

        for rank, r in enumerate(sharded):
            held = plan.held_units(rank)
            assert r["fsdp_modules"] == 1 + len({(block(u), plan.holders(u)) for u in held})
            assert r["fsdp_modules"] < len(held)
            # the group's hooks sit on its entry alone, and each grouped Linear runs as one
            # matmul over its gathered parts (GroupedLayer.gather_first)
            assert r["grouped"]["layers"] > 0
            assert r["grouped"] == {**r["grouped"], "as_one": r["grouped"]["layers"],
                                    "hooked_parts": 0}
        # under activation checkpointing every part is its own FSDP module, hooked and run
        # on its own
        for r in _run(strategy, {"fsdp": True, "activation_checkpointing": True}):
            assert r["grouped"]["as_one"] == 0
            assert r["grouped"]["hooked_parts"] > 0


@pytest.mark.parametrize(("strategy", "opts"), AC_CASES)
def test_activation_checkpointing_changes_nothing(strategy: str, opts: dict[str, Any]) -> None:
    off = _run(strategy, opts)
    on = _run(strategy, {**opts, "activation_checkpointing": True})
    _assert_same(off[0]["state"], on[0]["state"], 1e-6)


@pytest.mark.parametrize(("strategy", "opts"), BF16_CASES)
def test_bf16_trains(strategy: str, opts: dict[str, Any]) -> None:
    runs = _run(strategy, opts, steps=10, repeat=True)
    for r in runs:
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        assert r["losses"][-1] < 0.9 * r["losses"][0]
        assert r["dtype"] == torch.bfloat16  # computed in bf16 ...
    assert all(v.dtype == torch.float32 for v in runs[0]["state"].values()  # ... fp32 master
               if v.is_floating_point())
