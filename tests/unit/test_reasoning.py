"""Reasoning split from the answer (server/reasoning.py): whole outputs, and the same
outputs streamed in two pieces split at every position and character by character (the
split must not change); behind it, the answer's own processing (tool calls)."""

from __future__ import annotations

import pytest

from server.reasoning import REASONING_PARSERS, ReasoningSplitter, reasoning_format
from server.tools.events import ContentText, ReasoningText, assemble
from server.tools.output import ReasoningOutput, choice_output
from server.tools.parsers import make_parser
from server.tools.plan import ToolPlan


def split(parser: str, pieces: list[str]) -> tuple[str, str]:
    """(reasoning, answer) of the pieces fed in order."""
    splitter = ReasoningSplitter(REASONING_PARSERS[parser])
    reasoning, answer = [], []
    for piece in pieces:
        events, text = splitter.feed(piece)
        reasoning += [e.text for e in events if isinstance(e, ReasoningText)]
        answer.append(text)
    events, text = splitter.finish()
    reasoning += [e.text for e in events if isinstance(e, ReasoningText)]
    answer.append(text)
    return "".join(reasoning), "".join(answer)


def every_split(parser: str, text: str) -> tuple[str, str]:
    whole = split(parser, [text])
    for cut in range(len(text) + 1):
        assert split(parser, [text[:cut], text[cut:]]) == whole, cut
    assert split(parser, list(text)) == whole
    return whole


@pytest.mark.parametrize(
    ("parser", "text", "expected"),
    [
        # DeepSeek-R1: the template opened the block; the output starts inside it.
        ("deepseek_r1", "Let me think.\n</think>\n\nParis.", ("Let me think.\n", "\n\nParis.")),
        ("deepseek_r1", "<think>\nhmm</think>Paris.", ("\nhmm", "Paris.")),  # tag written anyway
        (
            "deepseek_r1",
            "still thinking when max_tokens hit",
            ("still thinking when max_tokens hit", ""),
        ),
        # Qwen3: reasoning only when the output opens a block.
        ("qwen3", "<think>\nA river.\n</think>\n\nThe Seine.", ("\nA river.\n", "\n\nThe Seine.")),
        ("qwen3", "  <think>x</think>y", ("x", "y")),
        ("qwen3", "The Seine, no thinking.", ("", "The Seine, no thinking.")),
        (
            "qwen3",
            "a <think> in the answer</think> is text",
            ("", "a <think> in the answer</think> is text"),
        ),
        ("qwen3", "<thin", ("", "<thin")),  # ended before the tag was whole
        ("qwen3", "<think>unfinished", ("unfinished", "")),
    ],
)
def test_reasoning_and_answer_split_the_same_however_streamed(
    parser: str, text: str, expected: tuple[str, str]
) -> None:
    assert every_split(parser, text) == expected


def test_a_prompt_that_opens_the_block_starts_the_output_inside_it() -> None:
    qwen3 = reasoning_format("qwen3")
    assert qwen3.for_prompt("<|im_start|>assistant\n<think>\n").starts_inside
    assert not qwen3.for_prompt("<|im_start|>assistant\n").starts_inside
    assert not qwen3.for_prompt("<think>\n\n</think>\n\n").starts_inside  # thinking off
    with pytest.raises(ValueError, match="deepseek_r1"):
        reasoning_format("o1")


def test_reasoning_then_tool_calls() -> None:
    """The answer after the reasoning goes through the tool-call parser."""
    parser = make_parser("hermes", ("get_weather",), None)
    output = ReasoningOutput(REASONING_PARSERS["qwen3"], parser)
    body = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = f"<think>The user wants weather.</think>\n<tool_call>\n{body}\n</tool_call>"
    events = [e for piece in (text[:20], text[20:]) for e in output.feed(piece)] + output.finish()
    message = assemble(events).as_openai()
    assert message["reasoning"] == "The user wants weather."
    assert message["content"] is None  # only whitespace besides the call
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"


def test_without_a_parser_think_tags_are_content() -> None:
    output = choice_output(ToolPlan())
    events = output.feed("<think>x</think>y") + output.finish()
    assert events == [ContentText("<think>x</think>y")]
    assert "reasoning" not in assemble(events).as_openai()
