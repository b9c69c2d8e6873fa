"""ZeRO-1/2 inside holder groups (``runtime.zero``): the same training as without it, the same
bytes, and per-rank state and gradients of exactly the shard sizes."""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from subnetdp.checkpoint.files import assemble_full_state, list_checkpoints, read_manifest
from subnetdp.cli import main
from subnetdp.models import get_recipe
from subnetdp.parallelize import parallelize
from subnetdp.strategy import SDP_NAMES, Composition, get_strategy
from subnetdp.subnet.planning import plan_for
from tests.dist.harness import run_workers
from tests.dist.runs import rank_losses

pytestmark = pytest.mark.dist

ARGS = {"n_layers": 4, "dim": 24, "n_heads": 2, "n_kv_heads": 2, "vocab_size": 61,
        "ffn_hidden": 40, "max_seq_len": 16}
CAP_MB = 0.004  # ~4 KB buckets: several per unit, most not a multiple of their holder count


def _rank(world: int, strategy: str, zero: int, coverage: float = 0.75) -> Any:
    recipe = get_recipe("llama-tiny")
    with torch.device("meta"):
        model = recipe.build_model(**ARGS)
    plan = plan_for(model, recipe.adapter, get_strategy(strategy), world=world,
                    coverage=coverage)
    return parallelize(model, adapter=recipe.adapter, strategy=strategy, plan=plan,
                       comp=Composition(zero=zero, bucket_cap_mb=CAP_MB))


def _backward(rank: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, ARGS["vocab_size"], (2, 9), generator=g)
    logits = rank.model(x[:, :-1])
    nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()


def _optimizer(rank: Any) -> torch.optim.Optimizer:
    params = list(rank.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return rank.optimizer(torch.optim.AdamW, groups, lr=1e-2, betas=(0.9, 0.95))


def _train(r: int, world: int, strategy: str, zero: int, steps: int = 3) -> dict[str, Any]:
    rank = _rank(world, strategy, zero)
    opt = _optimizer(rank)
    norms = []
    for step in range(steps):
        if step == 1:  # gradient accumulation: one local backward, then a reduced one
            with rank.model.no_sync():
                _backward(rank, 7000 + 100 * step + r)
        _backward(rank, 100 * step + r)
        norms.append(float(rank.clip_grad_norm_(0.05)))  # small: clipping is active
        opt.step()
        opt.zero_grad(set_to_none=True)
    stats = rank.comm_stats
    state_elems = sum(v.numel() for st in opt.state.values() for v in st.values()
                      if torch.is_tensor(v) and v.ndim > 0)
    reducer = rank.backend.reducer
    shards = []  # analytic: (c, k, numel) of every bucket this rank holds with others or not
    for spec in reducer.specs:
        if r in spec.holders:
            shards.append((len(spec.holders), spec.holders.index(r), spec.numel))
    return {
        "state": rank.full_state_dict(), "norms": norms,
        "bytes": (stats.last_step_bytes, stats.last_step_ring_bytes, stats.total_bytes,
                  dict(stats.by_group)),
        "state_elems": state_elems, "shards": shards,
        "grad_elems": sum(b.numel() for b in rank.grad_buffers()),
        "param_grads": sum(p.grad is not None for p in rank.module.parameters()),
        "trained": rank.params_trained,
        "masters": (sum(m.numel() for m in rank._zero_opt.master_params())
                    if rank._zero_opt is not None else 0),
    }


def _train_each_zero(r: int, world: int) -> dict[str, dict[int, dict[str, Any]]]:
    return {s: {z: _train(r, world, s, z) for z in (0, 1, 2)} for s in SDP_NAMES}


@cache
def _all_runs() -> dict[str, dict[int, list[dict[str, Any]]]]:
    """zero 0, 1 and 2 of every SDP strategy one after the other in the same 4 workers (one
    launch for all): per strategy, per zero stage, the per-rank results."""
    by_rank = run_workers(_train_each_zero, 4)
    return {s: {z: [res[s][z] for res in by_rank] for z in (0, 1, 2)} for s in SDP_NAMES}


def _run(strategy: str) -> dict[int, list[dict[str, Any]]]:
    return _all_runs()[strategy]


def _real(c: int, k: int, n: int) -> int:
    size = math.ceil(n / c)
    return max(0, min(n, (k + 1) * size) - k * size)


@pytest.mark.parametrize("strategy", SDP_NAMES)
def test_zero_trains_exactly_as_without(strategy: str) -> None:
    """Three AdamW steps (decay and no-decay groups, clipping active, one accumulated step)
    give the same model with zero 1 and 2 as without; the same bytes per step; and each rank
    keeps optimizer state for exactly its shards (ZeRO-2: and only shard gradients)."""
    runs = _run(strategy)
    plain = runs[0]
    ref = plain[0]["state"]
    for zero in (1, 2):
        got = runs[zero]
        assert got[0]["state"].keys() == ref.keys()
        diff = max(float((got[0]["state"][k].float() - v.float()).abs().max())
                   for k, v in ref.items())
        assert diff <= 1e-6, (zero, diff)
        for r, res in enumerate(got):
            assert res["norms"] == pytest.approx(plain[r]["norms"], rel=1e-5)
            assert res["bytes"] == plain[r]["bytes"]  # payload, ring, total, by group: exact
            sizes = [_real(c, k, n) for c, k, n in res["shards"]]
            assert res["state_elems"] == 2 * sum(sizes)  # exp_avg + exp_avg_sq, shards only
            assert plain[r]["state_elems"] == 2 * plain[r]["trained"]
            if zero == 2:  # only the shard gradients remain
                assert res["grad_elems"] == sum(math.ceil(n / c) for c, _, n in res["shards"])
            else:  # ZeRO-1 keeps the full (padded) buffers; its shards are slices of them
                assert res["grad_elems"] == sum(math.ceil(n / c) * c
                                                for c, _, n in res["shards"])
            assert res["param_grads"] == 0
            if get_strategy(strategy).level == "block":  # whole tensors: updated in place
                assert res["masters"] == 0
        # every element's state is on exactly one rank
        assert sum(res["state_elems"] for res in got) < sum(r["state_elems"] for r in plain)


def _train_ddp(r: int, world: int, zero: int) -> dict[str, Any]:
    recipe = get_recipe("llama-tiny")
    with torch.device("meta"):
        model = recipe.build_model(**ARGS)
    rank = parallelize(model, adapter=recipe.adapter, strategy="ddp",
                       comp=Composition(zero=zero, bucket_cap_mb=CAP_MB))
    opt = _optimizer(rank)
    for step in range(3):
        _backward(rank, 100 * step + r)
        rank.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"state": rank.full_state_dict(), "optimizer": type(opt).__name__,
            "bytes": dict(rank.comm_stats.by_group)}


def _train_ddp_each_zero(r: int, world: int) -> dict[int, dict[str, Any]]:
    return {z: _train_ddp(r, world, z) for z in (0, 1, 2)}


def test_ddp_zero_baselines_train_as_ddp() -> None:
    """ddp+zero1 (torch's ZeroRedundancyOptimizer) and ddp+zero2 (the holder reducer at full
    coverage, zero=2) end where ddp does; ddp+zero2 counts DDP's bytes."""
    by_rank = run_workers(_train_ddp_each_zero, 3)
    runs = {z: [res[z] for res in by_rank] for z in (0, 1, 2)}
    ref = runs[0][0]["state"]
    assert runs[1][0]["optimizer"] == "ZeroRedundancyOptimizer"
    for z in (1, 2):
        got = runs[z][0]["state"]
        diff = max(float((got[k] - v).abs().max()) for k, v in ref.items())
        assert diff <= 1e-6, (z, diff)
    assert [r["bytes"] for r in runs[2]] == [r["bytes"] for r in runs[0]]


def test_zero_with_fsdp_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="--zero does not combine with --fsdp") as e:
        Composition(zero=1, fsdp=True).check(get_strategy("b-sdp"))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="--zero must be 0, 1 or 2"):
        Composition(zero=3).check(get_strategy("b-sdp"))


@pytest.mark.parametrize(("extra", "says"), [
    (["--strategy", "b-sdp", "--zero", "2", "--fsdp"], "--zero does not combine with --fsdp"),
    (["--strategy", "ddp", "--zero", "1", "--ckpt-every", "2"],
     "checkpoints of ddp --zero 1"),
])
def test_cli_refuses_in_one_line(extra: list[str], says: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["train", "--recipe", "llama-tiny", *extra, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err and "Traceback" not in err
    assert not out.exists()


# -- checkpoints through the CLI ---------------------------------------------------------------
ZWORLD = 3
ZTINY = ["--recipe", "llama-tiny", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1",
         "--memory-step", "-1", "--no-progress", "--warmup", "2", "--nproc", str(ZWORLD),
         "--coverage", "0.67", "--grad-clip", "0.05", "--model-arg", "n_layers=3",
         "--model-arg", "dim=24", "--model-arg", "ffn_hidden=40", "--bucket-cap-mb", "0.004"]


def _final(run: Path) -> dict[str, torch.Tensor]:
    ckpt = list_checkpoints(run / "checkpoints")[-1]
    return assemble_full_state(ckpt, read_manifest(ckpt))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["b-sdp", "nb-sdp", "ddp"])
def test_zero_checkpoints_resume_exactly_and_load_without_zero(
    strategy: str, tmp_path: Path
) -> None:
    """A --zero 2 run (ddp: the holder reducer at full coverage) resumed from its middle
    checkpoint continues bit-for-bit; the same
    checkpoint (optimizer state saved per parameter, plain) continues under --zero 0 with the
    same values up to rounding, and the zero-free run written from scratch agrees too."""
    zero, plain = tmp_path / "zero", tmp_path / "plain"
    cov = ZTINY.index("--coverage")
    tiny = ZTINY[:cov] + ZTINY[cov + 2:] if strategy == "ddp" else ZTINY  # ddp has no plan
    args = [*tiny, "--strategy", strategy, "--steps", "4", "--ckpt-every", "2"]
    assert main(["train", *args, "--zero", "2", "--out", str(zero)]) == 0
    assert main(["train", *args, "--out", str(plain)]) == 0
    losses, final = rank_losses(zero, ZWORLD), _final(zero)
    assert main(["train", "--resume", str(zero / "checkpoints" / "step_00000002")]) == 0
    assert rank_losses(zero, ZWORLD) == losses  # bit-identical
    again = _final(zero)
    assert all(torch.equal(again[k], final[k]) for k in final)
    # the zero checkpoint into a run without zero
    assert main(["train", "--resume", str(zero / "checkpoints" / "step_00000002"),
                 "--zero", "0"]) == 0
    assert np.allclose(rank_losses(zero, ZWORLD), losses, rtol=0, atol=1e-5)
    assert np.allclose(rank_losses(plain, ZWORLD), losses, rtol=0, atol=1e-5)
    for name, ref in _final(plain).items():
        assert float((_final(zero)[name].float() - ref.float()).abs().max()) <= 1e-5, name


def _readme(r: int, world: int) -> dict[str, Any]:
    from subnetdp import SubnetDataParallel, make_plan
    from subnetdp.subnet.units import describe_units

    recipe = get_recipe("llama-tiny")
    with torch.device("meta"):
        model = recipe.build_model(**ARGS)
    units, shared = describe_units(model, recipe.adapter)
    plan = make_plan(world=world, units=units, coverage=0.5, shared_size=shared)
    model = SubnetDataParallel(model, plan=plan, adapter=recipe.adapter, zero=2)
    opt = model.optimizer(torch.optim.AdamW, lr=3e-4, weight_decay=0.1)  # on this rank's shards
    before = {k: v.clone() for k, v in model.module.state_dict().items()}
    _backward(model, r)
    model.clip_grad_norm_(1.0)
    opt.step()
    after = model.module.state_dict()
    return {"moved": all(not torch.equal(before[k], after[k]) for k in before),
            "groups": [g["weight_decay"] for g in opt.param_groups]}


def test_readme_zero_lines() -> None:
    """The README's two lines: every held parameter moves after one step on shards."""
    for res in run_workers(_readme, 4):
        assert res["moved"] and res["groups"] == [0.1]
