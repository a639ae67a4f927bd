"""Incremental detokenisation and stop strings, against the real SmolLM2 tokenizer."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from server.detokenize import IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "Hello, world! This is a plain sentence.",
    "Grüße aus Köln – naïve café, 東京タワー and emoji 🎉🚀 mixed in.",
    "  leading spaces\nnew lines\ttabs and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math letters",
]


def stream_text(tokenizer: Any, ids: list[int], chunk: int) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_streamed_pieces_join_to_the_full_decode(smollm_tokenizer: Any, text: str, chunk: int):
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    pieces = stream_text(smollm_tokenizer, ids, chunk)
    assert "".join(pieces) == smollm_tokenizer.decode(ids)
    assert "".join(pieces) == text


def test_multibyte_characters_are_never_split(smollm_tokenizer: Any):
    text = "🎉🚀東京"
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    # Byte-level BPE needs several tokens per emoji: some pushes must yield nothing.
    assert len(ids) > len(text)
    pieces = stream_text(smollm_tokenizer, ids, 1)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text


@pytest.mark.parametrize("split", [1, 4, 9])
def test_prompt_context_does_not_change_the_text(smollm_tokenizer: Any, split: int):
    ids = smollm_tokenizer.encode(TEXTS[1], add_special_tokens=False)
    prompt, output = ids[:split], ids[split:]
    detok = IncrementalDetokenizer(smollm_tokenizer, prompt_ids=prompt)
    pieces = [detok.push([t]) for t in output] + [detok.flush()]
    assert "".join(pieces) == smollm_tokenizer.decode(output)
    assert detok.token_ids == output


class SentencePieceLike:
    """Decodes like SentencePiece: a word's leading space is dropped at the start."""

    vocab: ClassVar[dict[int, str]] = {1: "▁Once", 2: "▁upon", 3: "▁a", 4: "▁time"}

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.vocab[t] for t in token_ids).replace("▁", " ").lstrip(" ")


def test_prompt_context_keeps_the_first_leading_space():
    without = IncrementalDetokenizer(SentencePieceLike())
    assert without.push([4]) == "time"
    with_context = IncrementalDetokenizer(SentencePieceLike(), prompt_ids=[1, 2, 3])
    assert with_context.push([4]) == " time"


def test_special_tokens_are_skipped(smollm_tokenizer: Any):
    ids = smollm_tokenizer.encode("done", add_special_tokens=False)
    ids.append(smollm_tokenizer.eos_token_id)
    assert "".join(stream_text(smollm_tokenizer, ids, 1)) == "done"


def feed_all(matcher: StopStringMatcher, chunks: list[str]) -> tuple[str, bool]:
    out = []
    for chunk in chunks:
        match = matcher.feed(chunk)
        out.append(match.text)
        if match.stopped:
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


def test_stop_string_inside_one_chunk():
    assert feed_all(StopStringMatcher(["END"]), ["abc END def"]) == ("abc ", True)


def test_stop_string_spanning_chunks_is_never_emitted():
    matcher = StopStringMatcher(["STOP"])
    emitted = [matcher.feed(c) for c in ["hello S", "T", "O", "P tail"]]
    assert "".join(m.text for m in emitted) == "hello "
    assert [m.stopped for m in emitted] == [False, False, False, True]
    # Nothing of the partial match leaked before the decision.
    assert all("S" not in m.text for m in emitted)


def test_partial_match_that_fails_is_released():
    assert feed_all(StopStringMatcher(["STOP"]), ["a ST", "AR b"]) == ("a STAR b", False)


def test_earliest_of_several_stop_strings_wins():
    assert feed_all(StopStringMatcher(["world", "lo"]), ["hello world"]) == ("hel", True)


def test_no_stop_strings_passes_text_through_immediately():
    matcher = StopStringMatcher([])
    assert matcher.feed("abc").text == "abc"
    assert matcher.flush() == ""


def test_after_a_stop_everything_is_dropped():
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("ax").stopped
    assert matcher.feed("more").text == ""
    assert matcher.flush() == ""
