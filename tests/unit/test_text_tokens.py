"""server/text_tokens.py gives exactly ``tokenizer.encode``'s ids (SmolLM2's tokenizer)."""

from __future__ import annotations

from typing import Any

import pytest

from server.text_tokens import IDS_PER_SLICE, encode_text

TEXTS = [
    "",
    "Hello, world!",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "  leading and trailing spaces  ",
    "naïve café — 日本語のテキスト 🙂 and \u0000 NUL",
    "word " * 20_000,  # more than one slice of ids
]


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_encode_text_is_tokenizer_encode(
    smollm_tokenizer: Any, text: str, add_special_tokens: bool
) -> None:
    expected = smollm_tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert encode_text(smollm_tokenizer, text, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("pair", ["Paris is the capital of France.", "", "word " * 800])
def test_a_pair_is_the_tokenizers_pair(smollm_tokenizer: Any, pair: str) -> None:
    """A cross-encoder's (query, document): ``tokenizer(query, document)``'s ids."""
    query = "What is the capital of France?"
    expected = smollm_tokenizer(query, pair)["input_ids"]
    assert encode_text(smollm_tokenizer, query, pair=pair, add_special_tokens=True) == expected


def test_a_long_text_is_read_in_slices_and_reassembled(smollm_tokenizer: Any) -> None:
    text = "alpha beta gamma delta " * 40_000
    ids = encode_text(smollm_tokenizer, text, add_special_tokens=True)
    assert len(ids) > 2 * IDS_PER_SLICE
    assert ids == smollm_tokenizer.encode(text, add_special_tokens=True)


def test_a_tokenizer_configured_to_truncate_falls_back_to_encode(smollm_tokenizer: Any) -> None:
    text = "one two three " * 10
    expected = smollm_tokenizer.encode(text, add_special_tokens=False)
    backend = smollm_tokenizer.backend_tokenizer
    backend.enable_truncation(8)
    try:
        # transformers switches truncation off for a plain encode; so must we.
        assert encode_text(smollm_tokenizer, text, add_special_tokens=False) == expected
    finally:
        backend.no_truncation()
    assert len(expected) > 8
