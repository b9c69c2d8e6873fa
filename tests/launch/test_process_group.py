"""``init_distributed`` on CUDA ([Note: split communicators]), checked on CPU by recording the
calls: the worker's GPU is set first, then the default group is created eagerly with that
``device_id`` (so holder groups are split from it); gloo gets no device."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from subnetdp.distributed import process_group


def _record(monkeypatch: pytest.MonkeyPatch, cuda: bool) -> list[tuple[str, Any]]:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda **kw: calls.append(("init_process_group", kw)))
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 8)
    return calls


def test_nccl_group_is_bound_to_the_device_before_any_split(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _record(monkeypatch, cuda=True)
    assert process_group.init_distributed() == (3, 8)
    gpu = torch.device("cuda", 1)
    assert [c[0] for c in calls] == ["set_device", "init_process_group"]
    assert calls[0][1] == gpu
    assert calls[1][1]["backend"] == "nccl" and calls[1][1]["device_id"] == gpu


def test_gloo_group_has_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _record(monkeypatch, cuda=False)
    process_group.init_distributed()
    assert calls == [("init_process_group",
                      {"backend": "gloo", "timeout": None, "device_id": None})]
