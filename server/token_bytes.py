"""The raw bytes of a token, for logprob ``bytes`` that rebuild the text.

Decoding one token alone gives U+FFFD when the token holds part of a UTF-8 character
(byte-level BPE splits characters freely), so ``text.encode()`` would be wrong. The
token's vocabulary string is mapped back instead:

* byte-level BPE (GPT-2, Llama 3, SmolLM, Qwen): every character of the string stands for
  one byte through GPT-2's printable byte alphabet;
* SentencePiece byte fallback: ``<0xNN>`` is the byte NN; ``▁`` is a space.
"""

from __future__ import annotations

import re
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "\u2581"


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's map from the printable stand-in characters back to bytes."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenBytes:
    """``bytes_of(token_id)`` for one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._byte_decoder = gpt2_byte_decoder() if is_byte_level(tokenizer) else {}

    def bytes_of(self, token_id: int) -> list[int]:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return []
        byte = _BYTE_TOKEN.fullmatch(piece)
        if byte is not None:
            return [int(byte.group(1), 16)]
        decoder = self._byte_decoder
        if decoder and all(char in decoder for char in piece):
            return [decoder[char] for char in piece]
        return list(piece.replace(_SPIECE_SPACE, " ").encode("utf-8"))


def is_byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer's vocabulary strings are GPT-2 byte stand-ins."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)
