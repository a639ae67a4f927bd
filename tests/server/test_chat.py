"""POST /v1/chat/completions through the official openai client against a live server."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.conftest import TINY_MODEL_NAME, LiveServer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]
GREEDY = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}


def prompt_len(server: LiveServer, messages: list[dict[str, Any]]) -> int:
    body = {"model": TINY_MODEL_NAME, "messages": messages}
    return int(httpx.post(f"{server.url}/tokenize", json=body).json()["count"])


def greedy_text(client: Any, max_tokens: int = 24, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=MESSAGES,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={**NO_EOS, **extra},
    )


def test_chat_completion_shape_and_usage(client: Any, server: LiveServer):
    resp = greedy_text(client, max_tokens=12)
    assert resp.object == "chat.completion"
    assert resp.id.startswith("chatcmpl-")
    assert resp.model == TINY_MODEL_NAME
    assert len(resp.choices) == 1
    choice = resp.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 12
    assert resp.usage.prompt_tokens == prompt_len(server, MESSAGES)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0


def test_max_completion_tokens_is_honoured(client: Any):
    resp = client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=MESSAGES,
        max_completion_tokens=5,
        extra_body=NO_EOS,
    )
    assert resp.usage.completion_tokens == 5
    assert resp.choices[0].finish_reason == "length"


def test_repeated_prompt_reports_cached_tokens(client: Any, server: LiveServer):
    first = greedy_text(client, max_tokens=2)
    second = greedy_text(client, max_tokens=2)
    block = server.ctx.engine.stats().block_size
    full_blocks = (first.usage.prompt_tokens - 1) // block * block
    assert second.usage.prompt_tokens_details.cached_tokens >= min(full_blocks, block)


def test_content_part_arrays_equal_plain_strings(client: Any):
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
        {"role": "user", "content": [{"type": "text", "text": "Name three colours."}]},
    ]
    plain = greedy_text(client)
    with_parts = client.chat.completions.create(
        model=TINY_MODEL_NAME, messages=parts, max_tokens=24, temperature=0.0, extra_body=NO_EOS
    )
    assert with_parts.usage.prompt_tokens == plain.usage.prompt_tokens
    assert with_parts.choices[0].message.content == plain.choices[0].message.content


def test_assistant_turns_are_part_of_the_prompt(client: Any, server: LiveServer):
    history = [
        *MESSAGES,
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "More"},
    ]
    resp = client.chat.completions.create(
        model="alias", messages=history, max_tokens=3, extra_body=NO_EOS
    )
    assert resp.usage.prompt_tokens == prompt_len(server, history)
    # The first served name is the one reported, whichever alias was asked for.
    assert resp.model == TINY_MODEL_NAME


def test_streaming_matches_non_streaming_and_reports_usage(client: Any):
    expected = greedy_text(client).choices[0].message.content
    stream = client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=MESSAGES,
        max_tokens=24,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_EOS,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes.count("length") == 1 and finishes[-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 24
    assert all(c.object == "chat.completion.chunk" and c.id == last.id for c in chunks)


def test_continuous_usage_stats_grow_per_chunk(server: LiveServer):
    body = {
        "model": TINY_MODEL_NAME,
        "messages": MESSAGES,
        "max_tokens": 6,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events = sse_events(server, "/v1/chat/completions", body)
    counts = [e["usage"]["completion_tokens"] for e in events if e.get("usage")]
    assert counts == sorted(counts) and counts[-1] == 6


def sse_events(server: LiveServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    import json

    events: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        events.append(json.loads(line[len("data: ") :]))
    return events


def test_n_choices_non_streaming_and_streaming(client: Any):
    resp = client.chat.completions.create(
        model=TINY_MODEL_NAME, messages=MESSAGES, n=3, max_tokens=8, seed=5, extra_body=NO_EOS
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.completion_tokens == 24
    assert len({c.message.content for c in resp.choices}) > 1  # seeds differ per choice
    stream = client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=MESSAGES,
        n=3,
        max_tokens=8,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_EOS,
    )
    texts = {0: "", 1: "", 2: ""}
    finished = []
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.append(choice.index)
    assert sorted(finished) == [0, 1, 2]
    assert usage is not None and usage.completion_tokens == 24
    assert texts == {c.index: c.message.content for c in resp.choices}


def test_seed_reproducibility(client: Any):
    def sample(seed: int) -> str:
        resp = client.chat.completions.create(
            model=TINY_MODEL_NAME,
            messages=MESSAGES,
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            extra_body=NO_EOS,
        )
        return str(resp.choices[0].message.content)

    assert sample(1234) == sample(1234)
    assert len({sample(1), sample(2), sample(3)}) > 1


def test_logprobs_and_top_logprobs(client: Any):
    resp = client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
        extra_body=NO_EOS,
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        best = max(t.logprob for t in entry.top_logprobs)
        # Greedy: the chosen token is the most likely one.
        assert abs(entry.logprob - best) < 1e-4
    assert "".join(e.token for e in content) == resp.choices[0].message.content


def test_no_logprobs_unless_asked(client: Any):
    assert greedy_text(client, max_tokens=2).choices[0].logprobs is None


def test_stop_string_is_cut_and_reported(client: Any):
    full = str(greedy_text(client, max_tokens=30).choices[0].message.content)
    assert len(full) > 12
    stop = full[6:10]
    expected = full[: full.index(stop)]
    resp = client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=MESSAGES,
        max_tokens=30,
        temperature=0.0,
        stop=[stop, "never-appears-xyz"],
        extra_body=NO_EOS,
    )
    assert resp.choices[0].message.content == expected
    assert resp.choices[0].finish_reason == "stop"


def test_stop_string_spanning_streamed_chunks(client: Any):
    ref = client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=MESSAGES,
        max_tokens=30,
        temperature=0.0,
        logprobs=True,
        extra_body=NO_EOS,
    )
    tokens = [e.token for e in ref.choices[0].logprobs.content]
    full = "".join(tokens)
    # A stop string made of the end of one token and the start of the next.
    i = next(k for k in range(2, len(tokens) - 1) if tokens[k] and tokens[k + 1])
    stop = tokens[i][-1:] + tokens[i + 1][:1]
    expected = full[: full.index(stop)]
    stream = client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=MESSAGES,
        max_tokens=30,
        temperature=0.0,
        stop=stop,
        stream=True,
        extra_body=NO_EOS,
    )
    pieces, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == expected
    assert stop not in "".join(pieces)
    assert finish == "stop"


def test_stop_token_ids_and_min_tokens(client: Any):
    forced = 28  # logit_bias makes this token the certain choice

    def run(**extra: Any) -> Any:
        return client.chat.completions.create(
            model=TINY_MODEL_NAME,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0.0,
            logit_bias={str(forced): 100},
            extra_body={"stop_token_ids": [forced], **NO_EOS, **extra},
        )

    stopped = run()
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 1
    # min_tokens masks the stop token for the first 4 tokens; the 5th is the forced one.
    held = run(min_tokens=4)
    assert held.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens == 5


def test_logit_bias_forces_a_token(client: Any, server: LiveServer):
    token_id = 28
    resp = client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0.0,
        logit_bias={str(token_id): 100},
        extra_body=NO_EOS,
    )
    text = server.ctx.tokenizer.decode([token_id] * 5)
    assert resp.choices[0].message.content == text


def test_sampling_controls_change_or_keep_output(client: Any):
    greedy = greedy_text(client).choices[0].message.content
    top_k_1 = client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=MESSAGES,
        max_tokens=24,
        temperature=1.0,
        seed=9,
        extra_body={"top_k": 1, **NO_EOS},
    )
    assert top_k_1.choices[0].message.content == greedy
    tiny_top_p = client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=MESSAGES,
        max_tokens=24,
        temperature=1.0,
        top_p=1e-6,
        seed=9,
        extra_body=NO_EOS,
    )
    assert tiny_top_p.choices[0].message.content == greedy
    min_p_1 = client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=MESSAGES,
        max_tokens=24,
        temperature=1.0,
        seed=9,
        extra_body={"min_p": 1.0, **NO_EOS},
    )
    assert min_p_1.choices[0].message.content == greedy
    penalised = [
        greedy_text(client, **{"repetition_penalty": 2.0}),
        client.chat.completions.create(
            model=TINY_MODEL_NAME,
            messages=MESSAGES,
            max_tokens=24,
            temperature=0.0,
            presence_penalty=2.0,
            extra_body=NO_EOS,
        ),
        client.chat.completions.create(
            model=TINY_MODEL_NAME,
            messages=MESSAGES,
            max_tokens=24,
            temperature=0.0,
            frequency_penalty=2.0,
            extra_body=NO_EOS,
        ),
    ]
    for resp in penalised:
        assert resp.choices[0].message.content != greedy


def test_user_and_a_zero_priority_are_accepted(client: Any):
    resp = client.chat.completions.create(
        model=TINY_MODEL_NAME,
        messages=MESSAGES,
        max_tokens=2,
        user="tenant-a",
        extra_body={"priority": 0, **NO_EOS},
    )
    assert resp.usage.completion_tokens == 2


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_a_priority_under_fcfs_is_a_400_naming_the_field(server: LiveServer, path: str):
    """The default --scheduling-policy fcfs: any client could otherwise jump the queue
    and never be preempted."""
    body: dict[str, Any] = {"model": TINY_MODEL_NAME, "max_tokens": 2, "priority": -1}
    if path == "/completions":
        body["prompt"] = "hello"
    else:
        body["messages"] = MESSAGES
    resp = httpx.post(f"{server.v1}{path}", json=body, timeout=30)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "priority" and "--scheduling-policy" in error["message"]
    assert server.wait_idle().device_blocks.used == 0


def test_cache_salt_separates_prefix_cache_sharing(server: LiveServer):
    """Equal salts share prefix blocks, different salts (or none) never do: the timing
    side channel between tenants is closed by giving each its own salt."""
    # Unique text, several blocks long, so no earlier test cached it.
    text = "salted prefix " + " ".join(f"w{i}" for i in range(64))
    url = f"{server.v1}/chat/completions"

    def hits_of(salt: str | None, path: str = "/chat/completions") -> int:
        before = server.wait_idle().prefix_cache_hits_total
        body: dict[str, Any] = {"model": TINY_MODEL_NAME, "max_tokens": 1}
        if path == "/completions":
            body["prompt"] = text
        else:
            body["messages"] = [{"role": "user", "content": text}]
        if salt is not None:
            body["cache_salt"] = salt
        resp = httpx.post(f"{server.v1}{path}", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return server.wait_idle().prefix_cache_hits_total - before

    assert hits_of("tenant-a") == 0
    assert hits_of("tenant-b") == 0  # same prompt, another salt: no block shared
    # Unsalted, it may share only the chat template's opening block with earlier unsalted
    # requests of this module, never the salted prompt's blocks.
    unsalted = hits_of(None)
    assert unsalted <= 16
    assert hits_of("tenant-a") > unsalted  # the same salt shares all its full blocks
    assert hits_of("tenant-c", "/completions") == 0
    assert hits_of("tenant-c", "/completions") > 0
    resp = httpx.post(url, json={"model": TINY_MODEL_NAME, "messages": MESSAGES, "cache_salt": ""})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt"


def test_load_tool_style_request(server: LiveServer):
    """The body shape guidellm sends: content parts, explicit null stop, both usage
    options, max_completion_tokens with ignore_eos, prior turns in the history."""
    body = {
        "model": TINY_MODEL_NAME,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": 7,
        "stop": None,
        "ignore_eos": True,
        "messages": [
            {"role": "system", "content": "prefix text"},
            {"role": "user", "content": [{"type": "text", "text": "first turn"}]},
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": [{"type": "text", "text": "second turn"}]},
        ],
    }
    events = sse_events(server, "/v1/chat/completions", body)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 7
    completion = {
        "model": TINY_MODEL_NAME,
        "prompt": "a prompt",
        "max_tokens": 5,
        "stop": None,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events = sse_events(server, "/v1/completions", completion)
    assert events[-1]["usage"]["completion_tokens"] == 5
