"""Token files: their integer type, and the check that every id fits the model's vocabulary.

Token files are flat arrays of ids, uint16 while the vocabulary fits (≤ 65,536 ids: GPT-2,
trained BPEs) and uint32 beyond (Llama 3's 128k); a folder's ``meta.json`` names the type
(``"dtype": "uint32"``), uint16 when it says nothing. An id outside the embedding table is an
index error on CPU and a device-side assert on CUDA, so it is refused when the data is loaded.
"""

from __future__ import annotations

import numpy as np

TOKEN_DTYPES: dict[str, type[np.unsignedinteger]] = {"uint16": np.uint16, "uint32": np.uint32}
MAX_UINT16_VOCAB = 1 << 16
_CHUNK = 1 << 24  # ids per pass: bounded memory on a multi-GB memmap


def token_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    """The narrowest type that holds ids ``0 .. vocab_size - 1``."""
    return np.uint16 if vocab_size <= MAX_UINT16_VOCAB else np.uint32


def dtype_named(name: str, where: str) -> type[np.unsignedinteger]:
    if name not in TOKEN_DTYPES:
        raise ValueError(f"{where}: token dtype {name!r} is not one of "
                         f"{', '.join(TOKEN_DTYPES)}; fix meta.json's \"dtype\"")
    return TOKEN_DTYPES[name]


def check_token_range(tokens: np.ndarray, vocab_size: int, *, source: str) -> None:
    """Raise ``ValueError`` (one line, with the fix) if an id of ``tokens`` is ``>= vocab_size``."""
    top = -1
    for i in range(0, len(tokens), _CHUNK):
        top = max(top, int(np.max(tokens[i : i + _CHUNK])))
    if top >= vocab_size:
        raise ValueError(
            f"{source} holds token id {top}, outside the vocabulary of {vocab_size} ids; pass "
            f"--vocab-size {top + 1} (or more), or set \"vocab_size\" in its meta.json to the "
            f"tokenizer's size")
