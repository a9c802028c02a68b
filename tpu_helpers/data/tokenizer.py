"""Tokenizers with one small interface: ``encode``, ``decode``, ``vocab_size`` and ``name``.

The default byte tokenizer needs nothing to be installed or downloaded, which keeps notebooks and tests
working offline. Any other name is looked up with Hugging Face ``transformers`` (imported only then).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "get_tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of the package relies on; any object with these members works."""

    name: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab_size 256, every string round-trips, no files needed."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # A model's sample can stop in the middle of a multi-byte character or emit invalid sequences;
        # "replace" shows those as U+FFFD instead of failing on the whole generation.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A thin adapter over a ``transformers`` tokenizer that exposes the same four members."""

    def __init__(self, name: str, hf_tokenizer: Any) -> None:
        self.name = name
        self._tok = hf_tokenizer
        # len() counts added special tokens too; .vocab_size alone can be smaller than the largest id.
        self.vocab_size = len(hf_tokenizer)

    def encode(self, text: str) -> list[int]:
        # No BOS/EOS per call: callers encode whole corpora and pack them into fixed blocks themselves.
        # verbose=False silences the "sequence longer than the model's maximum" warning, which does not
        # apply when the ids are cut into blocks afterwards.
        return list(self._tok.encode(text, add_special_tokens=False, verbose=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids]))

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size})"


def get_tokenizer(name: str = "byte") -> ByteTokenizer | HFTokenizer:
    """Return the tokenizer called ``name``: ``"byte"`` (default, built in) or a Hugging Face hub name.

    A hub name such as ``"gpt2"`` needs ``pip install transformers`` and network access (or a local cache).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"tokenizer name must be a non-empty string such as 'byte' or 'gpt2', got {name!r}")
    if name == "byte":
        return ByteTokenizer()
    try:
        # Imported here, not at module top: transformers is heavy and optional.
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError(
            f"tokenizer {name!r} needs Hugging Face transformers: pip install transformers "
            "(the default tokenizer 'byte' needs nothing)"
        ) from e
    return HFTokenizer(name, AutoTokenizer.from_pretrained(name))
