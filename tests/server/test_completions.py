"""POST /v1/completions: every prompt form, echo, logprobs, streaming, n."""

from __future__ import annotations

from typing import Any

import httpx

from tests.server.conftest import TINY_MAX_MODEL_LEN, TINY_MODEL_NAME, LiveServer

NO_EOS = {"ignore_eos": True}


def complete(client: Any, prompt: Any, **kwargs: Any) -> Any:
    extra = {**NO_EOS, **kwargs.pop("extra_body", {})}
    return client.completions.create(
        model=TINY_MODEL_NAME, prompt=prompt, extra_body=extra, **kwargs
    )


def test_string_prompt(client: Any, server: LiveServer):
    resp = complete(client, "Once upon a time", max_tokens=7, temperature=0.0)
    assert resp.object == "text_completion"
    assert resp.id.startswith("cmpl-")
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 7
    expected_prompt = len(server.ctx.tokenizer.encode("Once upon a time"))
    assert resp.usage.prompt_tokens == expected_prompt


def test_token_id_prompt_equals_string_prompt(client: Any, server: LiveServer):
    ids = server.ctx.tokenizer.encode("Once upon a time")
    by_text = complete(client, "Once upon a time", max_tokens=8, temperature=0.0)
    by_ids = complete(client, ids, max_tokens=8, temperature=0.0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_list_of_prompts_with_n(client: Any, server: LiveServer):
    prompts = ["The sky is", "Numbers: 1, 2,"]
    resp = complete(client, prompts, max_tokens=4, n=2, temperature=0.0)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    singles = [complete(client, p, max_tokens=4, temperature=0.0) for p in prompts]
    texts = {c.index: c.text for c in resp.choices}
    # Choice index = prompt index * n + choice; greedy choices of one prompt agree.
    assert texts[0] == texts[1] == singles[0].choices[0].text
    assert texts[2] == texts[3] == singles[1].choices[0].text
    tokenizer = server.ctx.tokenizer
    assert resp.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert resp.usage.completion_tokens == 16


def test_list_of_token_id_lists(client: Any):
    resp = complete(client, [[1, 2, 3, 4], [5, 6, 7]], max_tokens=3)
    assert len(resp.choices) == 2
    assert resp.usage.prompt_tokens == 7
    assert resp.usage.completion_tokens == 6


def test_echo_prepends_the_prompt(client: Any):
    plain = complete(client, "Echo this:", max_tokens=5, temperature=0.0)
    echoed = complete(client, "Echo this:", max_tokens=5, temperature=0.0, echo=True)
    assert echoed.choices[0].text == "Echo this:" + plain.choices[0].text


def test_completion_logprobs_legacy_shape(client: Any):
    resp = complete(client, "Hello", max_tokens=4, temperature=0.0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 4
    assert all(len(top) <= 2 and len(top) >= 1 for top in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset[0] == 0


def test_omitted_max_tokens_defaults_to_16_capped_by_the_context(client: Any):
    # OpenAI's and vLLM's default: 16 tokens, or what the context leaves when less.
    for room, expected in ((20, 16), (5, 5)):
        ids = list(range(100, 100 + TINY_MAX_MODEL_LEN - room))
        resp = complete(client, ids, extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == expected
        assert resp.choices[0].finish_reason == "length"


def test_streaming_completion_with_usage(client: Any):
    expected = complete(client, "Streaming test", max_tokens=10, temperature=0.0)
    stream = complete(
        client,
        "Streaming test",
        max_tokens=10,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_streaming_echo_and_stop(server: LiveServer, client: Any):
    full = complete(client, "abc", max_tokens=20, temperature=0.0).choices[0].text
    stop = full[5:8]
    body = {
        "model": TINY_MODEL_NAME,
        "prompt": "abc",
        "max_tokens": 20,
        "temperature": 0.0,
        "ignore_eos": True,
        "echo": True,
        "stop": stop,
        "stream": True,
    }
    import json

    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == "abc" + full[: full.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
