"""``train --init-from`` on folders written by transformers itself (no training, in process):
RoPE in both config layouts, integer weights, and a shard index that points out of the folder
(issue 41 items 1-3). The end-to-end runs are tests/models/test_hf_export.py's."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from subnetdp.cli import main
from subnetdp.hf.init_from import INDEX, InitPieces, read_hf_folder, weights_record
from subnetdp.hf.llama import hf_key
from subnetdp.models import get_recipe
from subnetdp.train.config import TrainConfig

VOCAB = 256
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
         "max_position_embeddings": 64, "tie_word_embeddings": False}


def _save(folder: Path, **config: Any) -> Path:
    """A ``LlamaForCausalLM`` saved by transformers' own ``save_pretrained``, with a word-level
    tokenizer.json of ``VOCAB`` tokens."""
    from tokenizers import Tokenizer, models

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, **config)) \
        .save_pretrained(folder)
    words = {f"t{i}": i for i in range(VOCAB - 1)} | {"<|endoftext|>": VOCAB - 1}
    Tokenizer(models.WordLevel(words, unk_token="t0")).save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(autouse=True)
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder that is not refused must not start a run here."""
    def launched(*_: object, **__: object) -> None:
        raise AssertionError("the run started: the folder was not refused")

    monkeypatch.setattr("subnetdp.train.run.run_training", launched)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama 3's RoPE base, which transformers 5 writes inside ``rope_parameters``."""
    return _save(tmp_path_factory.mktemp("hf") / "llama3", rope_theta=500000.0)


def _copy(src: Path, to: Path, **config: Any) -> Path:
    shutil.copytree(src, to)
    c = json.loads((to / "config.json").read_text())
    (to / "config.json").write_text(json.dumps({**c, **config}))
    return to


def _refused(args: list[str], out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """``train ARGS`` is refused in one line before any run starts; that line."""
    capsys.readouterr()  # save_pretrained's progress bars
    assert main(["train", *args, "--out", str(out)]) == 2, args
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_rope_theta_of_both_layouts_gives_hf_logits(llama3: Path, tmp_path: Path) -> None:
    """Our model built as a run builds it from the folder computes transformers' logits, with
    theta inside ``rope_parameters`` (transformers 5) or at the top level (before)."""
    raw = json.loads((llama3 / "config.json").read_text())
    assert raw["rope_parameters"] == {"rope_theta": 500000.0, "rope_type": "default"}
    assert "rope_theta" not in raw
    old = {k: v for k, v in raw.items() if k != "rope_parameters"}
    flat = tmp_path / "flat"
    shutil.copytree(llama3, flat)
    (flat / "config.json").write_text(json.dumps({**old, "rope_theta": 500000.0}))
    hf = transformers.LlamaForCausalLM.from_pretrained(llama3).eval()
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
    for folder in (llama3, flat):
        cfg = TrainConfig(init_from=str(folder), out=str(tmp_path / "out")).resolved()
        assert cfg.model_args["rope_theta"] == 500000.0
        ours = get_recipe(cfg.recipe).build_model(**cfg.model_args)
        pieces = InitPieces(read_hf_folder(folder))
        ours.load_state_dict({k: pieces[k] for k in pieces})
        with torch.no_grad():
            diff = (ours.eval()(ids) - want).abs().max().item()
        assert diff <= 1e-5, (folder.name, diff)  # theta 10000 instead: 3.8e-3


def test_other_ropes_are_refused_naming_the_key(llama3: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    llama31 = _save(tmp_path / "llama31", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    assert json.loads((llama31 / "config.json").read_text())["rope_parameters"][
        "rope_type"] == "llama3"
    cases = [
        (llama31, "config.json has rope_parameters.rope_type 'llama3'; subnetdp's LLaMA "
                  "represents only plain RoPE"),
        (_copy(llama3, tmp_path / "linear", rope_parameters=None, rope_theta=10000.0,
               rope_scaling={"type": "linear", "factor": 2.0}),
         "config.json has rope_scaling.type 'linear'"),
        (_copy(llama3, tmp_path / "partial", rope_parameters={
            "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
         "config.json has rope_parameters.partial_rotary_factor 0.5"),
        (_copy(llama3, tmp_path / "theta", rope_parameters={"rope_theta": "big"}),
         "config.json has rope_parameters.rope_theta 'big'; give a positive number"),
    ]
    for folder, fragment in cases:
        assert fragment in _refused(["--init-from", str(folder)], tmp_path / "o", capsys)
    assert not (tmp_path / "o").exists()


def test_integer_weights_are_refused(llama3: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Right names and shapes, int8 values: refused, never trained from float(int8)."""
    ints = _copy(llama3, tmp_path / "int8")
    state = load_file(ints / "model.safetensors")
    save_file({k: v.mul(100).to(torch.int8) for k, v in state.items()},
              str(ints / "model.safetensors"))
    err = _refused(["--init-from", str(ints)], tmp_path / "o", capsys)
    named = re.search(r": (\S+) in model\.safetensors is torch\.int8, not floating point", err)
    assert named and named[1] in state, err  # the first int8 tensor, by its name


def _shard(folder: Path, names: tuple[str, str]) -> dict[str, torch.Tensor]:
    """``folder``'s model.safetensors split in two files ``names`` and an index naming them."""
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    keys = sorted(state)
    halves = {names[0]: keys[: len(keys) // 2], names[1]: keys[len(keys) // 2:]}
    for name, part in halves.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        save_file({k: state[k] for k in part}, str(folder / name))
    (folder / INDEX).write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: n for n, part in halves.items() for k in part}}))
    return state


def test_shard_index_stays_inside_the_folder(llama3: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    outside = _copy(llama3, tmp_path / "outside")
    for name in ("../outside/model.safetensors", str(outside / "model.safetensors")):
        escape = _copy(llama3, tmp_path / f"escape{len(name)}")
        _shard(escape, ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"))
        index = json.loads((escape / INDEX).read_text())
        index["weight_map"] = dict.fromkeys(index["weight_map"], name)
        (escape / INDEX).write_text(json.dumps(index))
        err = _refused(["--init-from", str(escape)], tmp_path / "o", capsys)
        assert f"names the weight file {name!r}, outside the folder" in err, err
    # what the run records is what it read: each file by its name in the folder, and its hash
    inside = _copy(llama3, tmp_path / "inside")
    state = _shard(inside, ("shards/a.safetensors", "b.safetensors"))
    folder = read_hf_folder(inside)
    pieces = InitPieces(folder)
    assert all(torch.equal(pieces[k], state[hf_key(k)]) for k in pieces)
    assert weights_record(folder)["weights"] == {
        n: hashlib.sha256((inside / n).read_bytes()).hexdigest()
        for n in ("b.safetensors", "shards/a.safetensors")}

