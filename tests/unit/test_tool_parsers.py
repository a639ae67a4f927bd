"""Tool-call parsers and the forced-call scanner on text: whole outputs, and the same
outputs streamed in two pieces split at every position (the result must not change)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from server.tools.constrained import NamedCallOutput, RequiredCallsOutput
from server.tools.events import assemble, delta_of
from server.tools.output import ChoiceOutput
from server.tools.parsers import make_parser

NAMES = ("get_weather", "add")


def run(output: ChoiceOutput, pieces: list[str]) -> dict[str, Any]:
    events = [e for piece in pieces for e in output.feed(piece)] + output.finish()
    message = assemble(events).as_openai()
    for call in message.get("tool_calls", []):  # ids are random: compare the rest
        assert call.pop("id").startswith("call_")
    return message


def every_split(make: Callable[[], ChoiceOutput], text: str) -> dict[str, Any]:
    """The whole-text result, checked equal to every two-piece and per-character stream."""
    whole = run(make(), [text])
    for cut in range(len(text) + 1):
        assert run(make(), [text[:cut], text[cut:]]) == whole, cut
    assert run(make(), list(text)) == whole
    return whole


def hermes(max_calls: int | None = None) -> ChoiceOutput:
    return make_parser("hermes", NAMES, max_calls)


def llama3() -> ChoiceOutput:
    return make_parser("llama3_json", NAMES, None)


def call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def test_hermes_text_without_calls_is_content():
    text = "The weather is <b>fine</b> and 3 < 4 <tool"
    assert every_split(hermes, text) == {"role": "assistant", "content": text}


def test_hermes_call_after_text():
    body = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = f"Let me look.\n<tool_call>\n{body}\n</tool_call>"
    message = every_split(hermes, text)
    assert message["content"] == "Let me look.\n"
    assert message["tool_calls"] == [call("get_weather", {"city": "Paris"})]


def test_hermes_parallel_calls_and_a_list_in_one_tag():
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
        '{"name": "add", "parameters": {"a": 3, "b": 4}}]</tool_call>'
    )
    message = every_split(hermes, text)
    assert message["content"] is None  # only whitespace besides the calls
    assert message["tool_calls"] == [
        call("add", {"a": 1, "b": 2}),
        call("get_weather", {"city": "Oslo"}),
        call("add", {"a": 3, "b": 4}),
    ]


def test_hermes_without_parallel_calls_keeps_the_first():
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    )
    message = every_split(lambda: hermes(max_calls=1), text)
    assert message["tool_calls"] == [call("add", {"a": 1})]


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "add", "arguments": {"a": 1}',  # broken JSON
        '{"name": "rm_rf", "arguments": {}}',  # a function that was not offered
        '{"name": "add", "arguments": [1, 2]}',  # arguments not an object
        '"add"',
    ],
)
def test_hermes_invalid_call_is_content(body: str):
    text = f"ok <tool_call>{body}</tool_call> done"
    assert every_split(hermes, text) == {"role": "assistant", "content": text}


def test_hermes_unclosed_tag_at_the_end_is_still_a_call():
    # A stop string or EOS may end the output right after the JSON.
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
    assert every_split(hermes, text)["tool_calls"] == [call("add", {"a": 1, "b": 2})]
    broken = "<tool_call>\n{"
    assert every_split(hermes, broken) == {"role": "assistant", "content": broken}


def test_hermes_streaming_holds_back_a_partial_tag_only():
    parser = hermes()
    assert [delta_of(e) for e in parser.feed("Hi <tool")] == [{"content": "Hi "}]
    assert [delta_of(e) for e in parser.feed("box>")] == [{"content": "<toolbox>"}]


def test_llama3_json_calls():
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
        '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    )
    message = every_split(llama3, text)
    assert message["content"] is None
    assert message["tool_calls"] == [
        call("get_weather", {"city": "Rome"}),
        call("add", {"a": 1, "b": 2}),
    ]
    assert every_split(llama3, ' {"name": "add", "parameters": {}}')["tool_calls"] == [
        call("add", {})
    ]


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 42.",
        '{"name": "add", "parameters": {"a": 1}} and then some words',
        '{"name": "add", "parameters": {"a": 1}};',
        '{"not": "a call"}',
        "<|python_tag|>",
    ],
)
def test_llama3_json_anything_else_is_content(text: str):
    assert every_split(llama3, text) == {"role": "assistant", "content": text}


def test_llama3_json_streams_plain_text_at_once():
    parser = llama3()
    assert [delta_of(e) for e in parser.feed("Sure")] == [{"content": "Sure"}]


def test_named_call_output_is_the_arguments():
    text = ' {"city": "Paris", "days": [1, 2]}\n '
    message = every_split(lambda: NamedCallOutput("get_weather"), text)
    assert message["content"] is None
    assert message["tool_calls"] == [
        {
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": [1, 2]}'},
        }
    ]


def test_named_call_streams_name_first_then_argument_fragments():
    output = NamedCallOutput("add")
    deltas = [delta_of(e) for piece in ['{"a"', ": 1", "}"] for e in output.feed(piece)]
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:]]
    assert fragments == ['{"a"', ": 1", "}"]


def test_required_single_call():
    text = '{"name": "add", "arguments": {"a": 1, "b": {"c": "}\\"]"}}}'
    message = every_split(lambda: RequiredCallsOutput(parallel=False), text)
    arguments = '{"a": 1, "b": {"c": "}\\"]"}}'
    assert message["tool_calls"] == [
        {"type": "function", "function": {"name": "add", "arguments": arguments}}
    ]


def test_required_parallel_calls_with_whitespace():
    text = (
        '[ {"name" : "get_weather",\n "arguments": {"city": "Lima"} } ,\n'
        '{"name": "add", "arguments": {"a": [1, {"x": null}]}}]'
    )
    message = every_split(lambda: RequiredCallsOutput(parallel=True), text)
    names = [c["function"]["name"] for c in message["tool_calls"]]
    args = [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]]
    assert names == ["get_weather", "add"]
    assert args == [{"city": "Lima"}, {"a": [1, {"x": None}]}]
    assert message["content"] is None


def test_required_arguments_before_the_name_wait_for_it():
    text = '{"arguments": {"a": 1}, "name": "add"}'
    message = every_split(lambda: RequiredCallsOutput(parallel=False), text)
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1}'}


def test_required_streams_argument_fragments_as_they_come():
    output = RequiredCallsOutput(parallel=False)
    pieces = ['{"name": "add", ', '"arguments": {"a"', ": 1}", "}"]
    events = [e for piece in pieces for e in output.feed(piece)]
    deltas = [delta_of(e) for e in events]
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "add"
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:]]
    assert fragments == ['{"a"', ": 1}"]


def test_required_truncated_output_keeps_what_was_generated():
    message = run(RequiredCallsOutput(parallel=False), ['{"name": "add", "arguments": {"a": 1'])
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1'}


@pytest.mark.parametrize("cut", ['{"na', '[{"name": "get_we', '{"name"', ""])
def test_a_required_call_cut_before_its_name_is_dropped(cut: str) -> None:
    """max_tokens ended the output before the call's name was whole: no call of an empty
    name is reported (the choice finishes with ``length``)."""
    message = run(RequiredCallsOutput(parallel=cut.startswith("[")), [cut])
    assert "tool_calls" not in message


def test_a_required_call_cut_in_its_arguments_keeps_its_name() -> None:
    message = run(RequiredCallsOutput(parallel=False), ['{"name": "add", "arguments": {"a": 1'])
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "add" and call["function"]["arguments"] == '{"a": 1'
