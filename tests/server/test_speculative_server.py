"""Speculative decoding through the HTTP API with the real ``openai`` client: the same
greedy text as a server without speculation, streamed or not, with logprobs, stop strings
and max_tokens honoured, the speculation metrics exported, and the CLI flag parsed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.config import SpeculativeConfig
from server import cli
from server.settings import ServerSettings
from tests.server.conftest import TINY_MODEL_NAME, LiveServer, build_tiny, live_server

# Repetitive text: the n-gram proposer finds matches, and the tiny random model's greedy
# output soon loops, so drafts get accepted and rejected.
MESSAGES = [{"role": "user", "content": "one two three one two three one two three one two"}]
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


@pytest.fixture(scope="module")
def spec_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    built = build_tiny(tiny_model_dir, speculative_config=SPEC)
    with live_server(built, ServerSettings(served_model_names=(TINY_MODEL_NAME,))) as live:
        yield live


def chat(server: LiveServer, **extra: Any) -> Any:
    import openai

    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)
    params = {"model": TINY_MODEL_NAME, "messages": MESSAGES, "temperature": 0, **extra}
    return client.chat.completions.create(**params)


def metric(server: LiveServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_same_greedy_text_as_without_speculation(server: LiveServer, spec_server: LiveServer):
    plain = chat(server, max_tokens=48, logprobs=True, top_logprobs=2)
    drafts_before = metric(spec_server, "kvserve_spec_decode_num_drafts_total")
    spec = chat(spec_server, max_tokens=48, logprobs=True, top_logprobs=2)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.usage.completion_tokens == plain.usage.completion_tokens
    got, want = spec.choices[0].logprobs.content, plain.choices[0].logprobs.content
    assert [e.token for e in got] == [e.token for e in want]
    assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(got, want, strict=True))
    assert metric(spec_server, "kvserve_spec_decode_num_drafts_total") > drafts_before
    assert metric(spec_server, "kvserve_spec_decode_num_accepted_tokens_total") > 0
    assert 0 < metric(spec_server, "kvserve_spec_decode_acceptance_rate") <= 1
    assert metric(spec_server, "kvserve_spec_decode_mean_accepted_length") > 1
    spec_server.wait_idle()


def test_streaming_max_tokens_and_stop_strings(server: LiveServer, spec_server: LiveServer):
    full = chat(spec_server, max_tokens=40).choices[0].message.content
    stream = chat(spec_server, max_tokens=40, stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces) == full
    assert usage is not None and usage.completion_tokens <= 40
    for max_tokens in (1, 2, 5, 7):
        reply = chat(spec_server, max_tokens=max_tokens)
        assert reply.usage.completion_tokens == max_tokens
        assert reply.choices[0].finish_reason == "length"
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = chat(spec_server, max_tokens=40, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[: full.index(stop)]
    spec_server.wait_idle()


def test_cli_flag_parses_and_rejects_bad_json(capsys: Any):
    args = cli.build_parser().parse_args(
        ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    )
    assert cli.engine_args_from(args).speculative_config == SpeculativeConfig(
        num_speculative_tokens=3
    )
    assert cli.engine_args_from(cli.build_parser().parse_args(["serve"])).speculative_config is None
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(["serve", "--speculative-config", '{"k": 3}'])
    assert exit_info.value.code == 2
    assert "unknown keys ['k']" in capsys.readouterr().err
