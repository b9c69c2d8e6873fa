"""Metrics: measured step memory against hand-computed bytes, sinks, progress output."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from subnetdp.metrics import (
    JsonlSink,
    MemoryReport,
    Progress,
    measure_step_memory,
    process_peak_rss_bytes,
    read_jsonl,
    write_json_atomic,
)
from subnetdp.metrics.memory import CATEGORIES
from subnetdp.metrics.sinks import PEAK_ACTIVE, THROUGHPUT

# --- memory ------------------------------------------------------------------------------------


def _model_and_step() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], float]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return float(loss.item())

    return model, opt, step


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_step_memory_matches_hand_count() -> None:
    model, opt, step = _model_and_step()
    loss, rep = measure_step_memory(step, modules=[model], optimizers=[opt])
    assert math.isfinite(loss)
    assert isinstance(rep, MemoryReport)
    assert rep.device == "cpu"
    assert set(rep.breakdown) == set(CATEGORIES)
    pb = _param_bytes(model)
    b = rep.breakdown
    # Parameters exist before and after: counted exactly once, with their exact size.
    assert b["params"] == pb
    # AdamW keeps exp_avg and exp_avg_sq per parameter (plus tiny step counters).
    assert b["optimizer"] >= 2 * pb
    assert b["grads"] == pb  # the peak is in the optimizer step, when every grad is alive
    assert rep.peak_bytes == b["total"] == sum(v for k, v in b.items() if k != "total")
    assert rep.peak_bytes >= 4 * pb  # params + grads + 2 AdamW moments
    assert rep.cuda_max_allocated is None
    assert rep.process_peak_rss > 0


def test_step_memory_is_repeatable() -> None:
    model, opt, step = _model_and_step()
    reps = [measure_step_memory(step, modules=[model], optimizers=[opt])[1] for _ in range(3)]
    assert reps[0].breakdown == reps[1].breakdown == reps[2].breakdown


def test_step_memory_counts_activations_of_a_forward() -> None:
    # Without an optimizer the peak is in backward: activations saved for it must show up.
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))
    x = torch.randn(512, 256)

    def fwd_bwd() -> None:
        model(x).sum().backward()

    _, rep = measure_step_memory(fwd_bwd, modules=[model])
    # The tanh output (512 x 256 float32) is saved for backward.
    assert rep.breakdown["activations"] + rep.breakdown["temporaries"] >= 512 * 256 * 4


def test_step_memory_leaves_no_global_state() -> None:
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim_mod
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    model, opt, step = _model_and_step()
    before = (
        len(nn_module._global_forward_pre_hooks),
        len(nn_module._global_forward_hooks),
        len(optim_mod._global_optimizer_pre_hooks),
        len(optim_mod._global_optimizer_post_hooks),
        torch.UntypedStorage.resize_,
    )
    measure_step_memory(step, modules=[model], optimizers=[opt])
    after = (
        len(nn_module._global_forward_pre_hooks),
        len(nn_module._global_forward_hooks),
        len(optim_mod._global_optimizer_pre_hooks),
        len(optim_mod._global_optimizer_post_hooks),
        torch.UntypedStorage.resize_,
    )
    assert after == before
    assert _get_current_dispatch_mode() is None
    for p in model.parameters():  # per-parameter grad hooks removed
        assert not p._backward_hooks
        assert not p._post_accumulate_grad_hooks
    step()  # an untracked step still works


def test_memory_report_to_dict_is_json() -> None:
    model, opt, step = _model_and_step()
    _, rep = measure_step_memory(step, modules=[model], optimizers=[opt])
    d = rep.to_dict()
    assert d[PEAK_ACTIVE] == pytest.approx(rep.peak_bytes / 2**30)
    assert d["peak_bytes"] == rep.peak_bytes and d["breakdown"]["params"] == rep.breakdown["params"]
    assert "memory/optimizer(GiB)" in d
    json.dumps(d)


def test_process_peak_rss_is_plausible() -> None:
    rss = process_peak_rss_bytes()
    assert 10 * 2**20 < rss < 64 * 2**30  # a torch process: more than 10 MiB, less than 64 GiB


# --- sinks -------------------------------------------------------------------------------------


def test_jsonl_sink_appends_flushed_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics" / "rank0.jsonl"
    with JsonlSink(path) as sink:
        sink.log(1, {"loss": 2.5, THROUGHPUT: 100.0, "x": torch.tensor(3.0)})
        # Flushed per line: readable while the sink is still open.
        assert read_jsonl(path)[0]["loss"] == 2.5
        sink.log(2, {"loss": float("nan"), "lr": 1e-3})
    with JsonlSink(path) as sink:  # a resumed run appends
        sink.log(3, {"loss": 1.0})
    recs = read_jsonl(path)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert recs[0]["x"] == 3.0 and recs[0][THROUGHPUT] == 100.0
    assert recs[1]["loss"] is None  # NaN -> null keeps the file strict JSON
    assert all(isinstance(r["time"], float) for r in recs)
    for line in path.read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    with pytest.raises(ValueError, match="closed"):
        sink.log(4, {})


def test_read_jsonl_skips_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')
    assert read_jsonl(path) == [{"step": 1}]


def test_write_json_atomic_replaces_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "summary.json"
    write_json_atomic(path, {"a": 1, "p": tmp_path})
    write_json_atomic(path, {"b": [1, 2], "inf": float("inf")})
    assert json.loads(path.read_text()) == {"b": [1, 2], "inf": None}
    assert [p.name for p in path.parent.iterdir()] == ["summary.json"]  # no temp files left


# --- progress ----------------------------------------------------------------------------------


def test_progress_plain_lines_every_n_steps() -> None:
    out = io.StringIO()  # not a TTY: plain lines
    with Progress(10, enabled=True, desc="train", every=4, stream=out) as p:
        for s in range(1, 11):
            p.update(s, loss=1.0 / s, tps=1234.5)
    lines = out.getvalue().splitlines()
    assert [ln.split(" | ")[0] for ln in lines] == [
        "train step  1/10",
        "train step  4/10",
        "train step  8/10",
        "train step 10/10",
    ]
    assert "loss 0.1000" in lines[-1] and "1,234 tok/s" in lines[-1]


def test_progress_disabled_prints_nothing() -> None:
    out = io.StringIO()
    p = Progress(5, enabled=False, stream=out)
    p.update(5, loss=1.0, tps=1.0)
    p.close()
    assert out.getvalue() == ""


def test_progress_bar_mode() -> None:
    out = io.StringIO()
    with Progress(3, enabled=True, desc="tr", stream=out, bar=True) as p:
        p.update(1, loss=0.5)
        p.update(3, loss=0.25, tps=10.0)
    text = out.getvalue()
    assert "3/3" in text and "loss=0.2500" in text
