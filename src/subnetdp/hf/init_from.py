"""``train --init-from DIR``: a run that starts from a Hugging Face ``LlamaForCausalLM`` folder.

The folder's ``config.json`` becomes our ``LlamaConfig`` (the run's model shape), its
``tokenizer.json`` the run's tokenizer and its safetensors the first weights, renamed by the
inverse of ``export --format hf`` (``hf/llama.py``: the two models compute the same function,
so there is no RoPE permutation either way). Every check reads headers only, in the launching
process, so a folder our LLaMA cannot represent is refused in one line naming the field or
tensor before any worker starts; each worker then reads only the pieces it holds
(``InitPieces``, the same ``load_shard_state`` a resume uses).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from subnetdp.checkpoint.coverage import ST_DTYPES
from subnetdp.checkpoint.files import split_piece
from subnetdp.hf.llama import hf_key
from subnetdp.models.llama.model import LlamaConfig

__all__ = ["HFFolder", "InitPieces", "read_hf_folder", "weights_record"]

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"  # sharded weights (transformers' save_pretrained)
OPTION = "--init-from"

# (field, value our LLaMA computes; None: absent or null is the only value it represents)
_FIXED: tuple[tuple[str, object], ...] = (
    ("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
    ("tie_word_embeddings", False))
# RoPE keys: transformers 5 writes ``rope_parameters`` ({"rope_type", "rope_theta", ...}),
# earlier releases a top-level ``rope_theta`` and ``rope_scaling``; transformers reads
# ``rope_scaling`` over ``rope_parameters``, and a theta inside either over the top-level one
_ROPE_DICTS = ("rope_scaling", "rope_parameters")
_DEFAULT_THETA = 10000.0


@dataclass(frozen=True)
class HFFolder:
    """What a LLaMA folder gives a run: the model shape (``model_args``, the recipe's override
    keys), the tokenizer, the weight files and the recipe whose training defaults it takes."""

    path: Path
    model_args: dict[str, Any]
    tokenizer: Path
    weights: tuple[Path, ...]
    recipe: str

    @property
    def config(self) -> LlamaConfig:
        return LlamaConfig(**self.model_args)


def read_hf_folder(folder: str | Path) -> HFFolder:
    """``folder`` decoded and checked (headers only); ``ValueError``, one line, otherwise."""
    path = Path(folder).expanduser()
    where = f"{OPTION} {folder}"
    if not path.is_dir():
        raise ValueError(f"{where}: no such folder; give a Hugging Face LLaMA folder "
                         "(config.json, model.safetensors, tokenizer.json)")
    if (path / "checkpoints").is_dir():
        raise ValueError(f"{where} is a subnetdp run folder; export it first (subnetdp export "
                         f"{folder} --format hf --out HF) or continue it with --resume")
    try:
        raw = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"{where} has no config.json; give the folder that "
                         "save_pretrained wrote") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: config.json is not readable JSON ({e})") from None
    if not isinstance(raw, dict) or raw.get("model_type") != "llama":
        kind = raw.get("model_type") if isinstance(raw, dict) else None
        raise ValueError(f"{where}: config.json has model_type {kind!r}; subnetdp's LLaMA "
                         "starts only from model_type \"llama\" (LlamaForCausalLM)")
    cfg = _llama_config(raw, where)
    tokenizer = path / "tokenizer.json"
    if not tokenizer.is_file():
        raise ValueError(f"{where} has no tokenizer.json (a fast tokenizer); write one with "
                         "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)")
    weights = _weight_files(path, where)
    _check_tensors(weights, cfg, where)
    recipe = raw.get("subnetdp_recipe")
    args = {"dim": cfg.dim, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
            "n_kv_heads": cfg.n_kv_heads, "ffn_hidden": cfg.ffn_hidden,
            "vocab_size": cfg.vocab_size, "max_seq_len": cfg.max_seq_len,
            "norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta}
    return HFFolder(path, args, tokenizer, weights,
                    recipe if isinstance(recipe, str) and recipe in _llama_recipes()
                    else _nearest_recipe(cfg))


def _llama_config(raw: dict[str, Any], where: str) -> LlamaConfig:
    for name, ours in _FIXED:
        if raw.get(name, ours) != ours:
            raise ValueError(f"{where}: config.json has {name} {raw[name]!r}; subnetdp's LLaMA "
                             f"represents only {json.dumps(ours)} (no biases, untied head, "
                             "SiLU, plain RoPE)")

    def need(name: str) -> Any:
        if name not in raw:
            raise ValueError(f"{where}: config.json has no {name}")
        if isinstance(raw[name], bool) or not isinstance(raw[name], int) or raw[name] < 1:
            raise ValueError(f"{where}: config.json has {name} {raw[name]!r}; it must be a "
                             "whole number > 0")
        return raw[name]

    dim, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    kv = int(raw.get("num_key_value_heads") or heads)
    if raw.get("head_dim") not in (None, dim // heads) or dim % heads:
        raise ValueError(f"{where}: config.json has head_dim {raw.get('head_dim')} with "
                         f"hidden_size {dim} and {heads} heads; subnetdp's LLaMA needs "
                         "head_dim = hidden_size / num_attention_heads")
    theta = _rope_theta(raw, where)
    try:
        return LlamaConfig(dim=dim, n_layers=int(need("num_hidden_layers")), n_heads=heads,
                           n_kv_heads=kv, vocab_size=int(need("vocab_size")),
                           ffn_hidden=int(need("intermediate_size")),
                           max_seq_len=int(need("max_position_embeddings")),
                           norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                           rope_theta=theta)
    except ValueError as e:  # LlamaConfig's own shape checks, in its words
        raise ValueError(f"{where}: config.json: {e}") from None


def _rope_theta(raw: dict[str, Any], where: str) -> float:
    """The folder's RoPE base, read as transformers reads it (both layouts); a RoPE other than
    the plain one (``rope_type`` llama3, linear, yarn, ...; a partial rotation) is refused,
    naming the key: our LLaMA rotates every dimension with ``theta ** (-2i / head_dim)``."""
    name = next((k for k in _ROPE_DICTS if raw.get(k)), None)
    rope = raw[name] if name else {}
    if not isinstance(rope, dict):
        raise ValueError(f"{where}: config.json has {name} {rope!r}, not an object")
    kind_key = "rope_type" if "rope_type" in rope else "type"
    kind = rope.get(kind_key, "default")
    if kind != "default":
        raise ValueError(f"{where}: config.json has {name}.{kind_key} {kind!r}; subnetdp's "
                         "LLaMA represents only plain RoPE (\"default\": no scaling, as in "
                         "Llama 2 and Llama 3.0)")
    partial_key = f"{name}.partial_rotary_factor" if "partial_rotary_factor" in rope else \
        "partial_rotary_factor"
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{where}: config.json has {partial_key} {partial!r}; subnetdp's "
                         "LLaMA rotates every dimension of a head (1.0)")
    key = f"{name}.rope_theta" if "rope_theta" in rope else "rope_theta"
    theta = rope.get("rope_theta", raw.get("rope_theta", _DEFAULT_THETA))
    if isinstance(theta, bool) or not isinstance(theta, int | float) or \
            not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"{where}: config.json has {key} {theta!r}; give a positive number "
                         "(Llama 2: 10000.0, Llama 3: 500000.0)")
    return float(theta)


def _weight_files(path: Path, where: str) -> tuple[Path, ...]:
    if (path / WEIGHTS).is_file():
        return (path / WEIGHTS,)
    if (path / INDEX).is_file():
        try:
            index = json.loads((path / INDEX).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{where}: {INDEX} is not readable JSON ({e})") from None
        shards = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(shards, dict) or not all(isinstance(n, str) for n in shards.values()):
            raise ValueError(f"{where}: {INDEX} has no weight_map of tensor names to file "
                             "names; write the folder again with save_pretrained")
        names = sorted(set(shards.values()))
        for name in names:
            _check_inside(name, where)
        missing = [n for n in names if not (path / n).is_file()]
        if not names or missing:
            raise ValueError(f"{where}: {INDEX} names weight files that are absent "
                             f"({', '.join(missing) or 'none listed'})")
        return tuple(path / n for n in names)
    raise ValueError(f"{where} has no {WEIGHTS} (only safetensors are read, never pickles); "
                     "convert it with LlamaForCausalLM.from_pretrained(DIR)"
                     ".save_pretrained(DIR, safe_serialization=True)")


def _check_inside(name: str, where: str) -> None:
    """A shard the index names is a file of the folder (or of a folder inside it): a name
    that leaves it (absolute, ``..``) would read weights nobody put in this folder. The file
    itself may be a link (the Hugging Face cache links a snapshot's files to its blobs)."""
    parts = Path(name).parts
    if not parts or Path(name).is_absolute() or ".." in parts:
        raise ValueError(f"{where}: {INDEX} names the weight file {name!r}, outside the "
                         "folder; the index may name only files inside it")


def _ours(cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Our LLaMA's state for ``cfg``, on the meta device (keys and shapes only)."""
    from subnetdp.models.llama.model import Llama

    with torch.device("meta"):
        return Llama(cfg).state_dict()


def _expected(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor our LLaMA of ``cfg`` has."""
    return {hf_key(k): tuple(v.shape) for k, v in _ours(cfg).items()}


def _check_tensors(weights: tuple[Path, ...], cfg: LlamaConfig, where: str) -> None:
    from safetensors import SafetensorError, safe_open

    found: dict[str, tuple[int, ...]] = {}
    for file in weights:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    found[name] = tuple(f.get_slice(name).get_shape())
                    _check_floating(name, f.get_slice(name).get_dtype(), file, where)
        except (SafetensorError, OSError) as e:  # a bad header or size: in its words
            raise ValueError(f"{where}: {file.name} cannot be read as safetensors ({e}); it "
                             "is truncated or not a weights file: copy or save it again") from e
    # older transformers saved each layer's RoPE frequencies; our model derives them
    found = {k: v for k, v in found.items() if not k.endswith("rotary_emb.inv_freq")}
    want = _expected(cfg)
    problems = [f"{k} is missing" for k in want if k not in found]
    problems += [f"{k} is {list(found[k])}, config.json says {list(want[k])}"
                 for k in want if k in found and found[k] != want[k]]
    problems += [f"{k} is not a LLaMA tensor" for k in found if k not in want]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(f"{where}: the weights do not fit config.json: "
                         f"{'; '.join(problems[:3])}{more}")


def _check_floating(name: str, code: str, file: Path, where: str) -> None:
    """Weights are cast to the run's dtype on loading, which is exact only from a floating
    type: an int8 tensor (a quantised model) would train from ``float(int8)``, as a checkpoint
    piece of another dtype would (``checkpoint.coverage``, never cast either)."""
    dtype = ST_DTYPES.get(code)
    if dtype is None or not dtype.is_floating_point:
        raise ValueError(f"{where}: {name} in {file.name} is {dtype or code}, not floating "
                         "point; give the model's unquantised weights (fp32, bf16 or fp16)")


def _llama_recipes() -> dict[str, int]:
    """LLaMA recipe -> its parameter count."""
    from subnetdp.models import RECIPES
    from subnetdp.models.llama.model import LLAMA_FLAVOURS

    return {f"llama-{f}": _params(c) for f, c in LLAMA_FLAVOURS.items()
            if f"llama-{f}" in RECIPES}


def _params(cfg: LlamaConfig) -> int:
    attn = cfg.dim * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.kv_heads)
    block = attn + 3 * cfg.dim * cfg.ffn_hidden + 2 * cfg.dim
    return cfg.n_layers * block + 2 * cfg.vocab_size * cfg.dim + cfg.dim


def _nearest_recipe(cfg: LlamaConfig) -> str:
    """A folder from elsewhere takes the training defaults of the LLaMA recipe nearest in
    size (log of the parameter count): its learning rate and batch are meant for that scale."""
    size = math.log(_params(cfg))
    return min(_llama_recipes().items(), key=lambda kv: abs(math.log(kv[1]) - size))[0]


class InitPieces(Mapping[str, torch.Tensor]):
    """A folder's weights as a rank's ``load_shard_state`` asks for them: our state keys,
    whole (``key``) or sliced (``key@dim:start:stop``); each tensor is read when asked."""

    def __init__(self, folder: HFFolder) -> None:
        from safetensors import safe_open

        self._files = [safe_open(str(f), framework="pt") for f in folder.weights]
        self._where = {name: f for f in self._files for name in f.keys()}  # noqa: SIM118
        self._keys = {k: hf_key(k) for k in _ours(folder.config)}

    def __contains__(self, piece: object) -> bool:
        return isinstance(piece, str) and split_piece(piece)[0] in self._keys

    def __getitem__(self, piece: str) -> torch.Tensor:
        key, where = split_piece(piece)
        if key not in self._keys:
            raise KeyError(piece)
        name = self._keys[key]
        if where is None:
            return self._where[name].get_tensor(name)
        dim, start, stop = where
        # read only the slice (safetensors slices along any one dimension)
        index = tuple([slice(None)] * dim + [slice(start, stop)])
        return self._where[name].get_slice(name)[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def weights_record(folder: HFFolder) -> dict[str, Any]:
    """What a run's checkpoints record of where their first weights came from."""
    return {"folder": str(folder.path.resolve()),
            "weights": {f.relative_to(folder.path).as_posix(): _sha256(f)
                        for f in folder.weights}}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()
