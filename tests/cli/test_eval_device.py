"""``subnetdp eval --device`` reaches the evaluation (issue 28 item 6): the model lm-eval
scores is moved to the device asked for, and ``--device cuda`` without CUDA is one line before any
work."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from subnetdp.cli import main


@pytest.fixture
def hf_folder(tmp_path: Path) -> Path:
    """What ``is_hf_folder`` recognises; never loaded (``from_pretrained`` is replaced)."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama",
                                                    "max_position_embeddings": 64}))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


@pytest.fixture
def hflm_devices(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The device every loaded model is moved to (the one lm-eval's HFLM then scores on, it
    takes the model's); moving one stops the evaluation."""
    import transformers

    seen: list[str] = []

    class Loaded:
        def to(self, device: Any) -> None:
            seen.append(str(device))
            raise ValueError("stopped after placing the model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *_, **__: Loaded())
    return seen


def _eval(capsys, folder: Path, *extra: str) -> tuple[int, str]:
    code = main(["eval", str(folder), "--eval-tasks", "arc_easy", "--eval-limit", "2", *extra])
    return code, capsys.readouterr().err


def test_tasks_run_on_the_device_asked_for(hf_folder, hflm_devices, capsys, monkeypatch) -> None:
    from subnetdp.evals.tasks import data_root

    data_root()  # make setup installs the task data: missing, it fails here and says so
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    _eval(capsys, hf_folder, "--device", "cuda")
    _eval(capsys, hf_folder, "--device", "auto")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    _eval(capsys, hf_folder, "--device", "auto")
    _eval(capsys, hf_folder)
    assert hflm_devices == ["cuda", "cuda", "cpu", "cpu"]


@pytest.mark.parametrize("tasks", [True, False])
def test_cuda_without_cuda_is_one_line_before_any_work(hf_folder, hflm_devices, capsys,
                                                       monkeypatch, tasks: bool) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    argv = ["eval", str(hf_folder), "--device", "cuda"] + (["--eval-tasks", "arc_easy"] if tasks
                                                           else [])
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and hflm_devices == []
    assert err.startswith("subnetdp eval: --device cuda: CUDA is not available") and \
        err.count("\n") == 1


def test_an_hf_folder_without_tasks_is_told_how_to_score_it(hf_folder, capsys) -> None:
    """Issue 41 item 10: not "train with --ckpt-every" (the folder is a model, not a run)."""
    assert main(["eval", str(hf_folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"subnetdp eval: {hf_folder} is a Hugging Face model folder") and \
        err.count("\n") == 1
    assert f"`subnetdp eval {hf_folder} --eval-tasks " in err and "lm_eval" in err
    assert "--ckpt-every" not in err


@pytest.mark.parametrize(("omp", "threads"), [(None, 1), ("2", 2)])
def test_eval_computes_on_the_threads_train_gives_a_worker(hf_folder, capsys, monkeypatch,
                                                           omp: str | None,
                                                           threads: int) -> None:
    """Issue 41 item 10: OMP_NUM_THREADS, 1 when unset (not torch's one per core)."""
    import torch
    import transformers

    from subnetdp.evals.tasks import data_root

    data_root()
    seen: list[int] = []

    class Loaded:
        def to(self, device: Any) -> None:
            seen.append(torch.get_num_threads())
            raise ValueError("stopped after placing the model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *_, **__: Loaded())
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    saved = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        _eval(capsys, hf_folder)
    finally:
        torch.set_num_threads(saved)
    assert seen == [threads]
