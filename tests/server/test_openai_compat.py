"""What real OpenAI clients send (issue 13): lenient no-op fields, vLLM's output options,
prefill, echo and prompt logprobs, max_tokens 0 scoring, logprob bytes, CORS, template
errors, early stop of one choice of n, stream failures, /docs behind the key.

All through the official ``openai`` SDK (or raw HTTP where the SDK cannot express the
request) against real uvicorn serving the tiny random Llama with SmolLM2's tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from server.settings import ServerSettings
from tests.server.conftest import TINY_MODEL_NAME, LiveServer, live_server

MESSAGES = [{"role": "user", "content": "Tell me a story about a fox."}]
NO_EOS = {"ignore_eos": True}
EOS_ID = 2  # <|im_end|> in SmolLM2's vocabulary: special, and the model's EOS


def chat(client: Any, messages: list[dict[str, Any]] = MESSAGES, **kwargs: Any) -> Any:
    extra = {**NO_EOS, **kwargs.pop("extra_body", {})}
    kwargs.setdefault("max_tokens", 8)
    kwargs.setdefault("temperature", 0.0)
    return client.chat.completions.create(
        model=TINY_MODEL_NAME, messages=messages, extra_body=extra, **kwargs
    )


def complete(client: Any, prompt: Any, **kwargs: Any) -> Any:
    extra = {**NO_EOS, **kwargs.pop("extra_body", {})}
    kwargs.setdefault("temperature", 0.0)
    return client.completions.create(
        model=TINY_MODEL_NAME, prompt=prompt, extra_body=extra, **kwargs
    )


# -- lenient fields ------------------------------------------------------------------------


def test_no_op_fields_are_accepted_and_change_nothing(client: Any):
    baseline = chat(client).choices[0].message.content
    lenient = chat(
        client,
        store=False,
        metadata={"run": "eval-7"},
        service_tier="auto",
        user="user-1",
        extra_body={
            "prompt_cache_key": "k",
            "safety_identifier": "s",
            "skip_special_tokens": True,
            "spaces_between_special_tokens": True,
            "include_stop_str_in_output": False,
            "chat_template_kwargs": {"enable_thinking": False},
            "add_generation_prompt": True,
            "continue_final_message": False,
        },
    )
    assert lenient.choices[0].message.content == baseline
    text = complete(
        client, "A fox", max_tokens=5, extra_body={"store": False, "metadata": {"a": "b"}}
    )
    assert text.usage.completion_tokens == 5


def test_unknown_top_level_fields_are_ignored_and_nested_ones_refused(client: Any):
    raw = client.chat.completions.with_raw_response.create(
        model=TINY_MODEL_NAME, messages=MESSAGES, max_tokens=2, extra_body={"frobnicate": 1}
    )
    assert raw.headers["x-kvserve-ignored-fields"] == "frobnicate"
    assert raw.parse().usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError):
        chat(client, extra_body={"chat_template_kwargs": {"messages": []}})


def test_developer_role_renders_as_system_and_name_is_accepted(client: Any, server: LiveServer):
    as_system = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    as_developer = [{"role": "developer", "content": "Be brief."}, *MESSAGES]
    template = server.ctx.template()
    from server.protocol import ChatMessage

    render = template.render
    from server.chat_template import ChatTemplateOptions

    options = ChatTemplateOptions()
    system_text = render([ChatMessage.model_validate(m) for m in as_system], options)
    developer_text = render([ChatMessage.model_validate(m) for m in as_developer], options)
    assert developer_text == system_text
    named = [{"role": "user", "content": "Hi", "name": "alice"}]
    assert chat(client, as_developer).choices[0].message.content == (
        chat(client, as_system).choices[0].message.content
    )
    assert chat(client, named).choices[0].finish_reason == "length"


def test_name_and_kwargs_reach_the_template(tiny_built: Any):
    template = (
        "{% for m in messages %}[{{ m.role }}:{{ m.name }}:{{ m.content }}]{% endfor %}"
        "{% if shout %}!{% endif %}"
    )
    settings = ServerSettings(served_model_names=(TINY_MODEL_NAME,), chat_template=template)
    with live_server(tiny_built, settings) as live:
        body = {
            "model": TINY_MODEL_NAME,
            "messages": [{"role": "user", "content": "hi", "name": "alice"}],
        }
        ids = httpx.post(f"{live.url}/tokenize", json=body, timeout=60).json()["tokens"]
        assert live.ctx.tokenizer.decode(ids) == "[user:alice:hi]"
        client = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0, timeout=60)
        resp = chat(
            client,
            [{"role": "user", "content": "hi", "name": "alice"}],
            extra_body={"chat_template_kwargs": {"shout": True}},
            max_tokens=2,
        )
        assert resp.usage.prompt_tokens == len(
            live.ctx.tokenizer.encode("[user:alice:hi]!", add_special_tokens=False)
        )


# -- vLLM output options -------------------------------------------------------------------


def test_skip_and_space_special_tokens(client: Any):
    forced = {"logit_bias": {str(EOS_ID): 100}, "max_tokens": 3}
    skipped = complete(client, "A fox", **forced)
    assert skipped.choices[0].text == ""
    kept = complete(client, "A fox", **forced, extra_body={"skip_special_tokens": False})
    # One space sets each kept special token apart, from the prompt's text too (as
    # Hugging Face's slow tokenizers and vLLM's incremental detokenizer do).
    assert kept.choices[0].text == " <|im_end|> <|im_end|> <|im_end|>"
    packed = complete(
        client,
        "A fox",
        **forced,
        extra_body={"skip_special_tokens": False, "spaces_between_special_tokens": False},
    )
    assert packed.choices[0].text == "<|im_end|>" * 3


def test_stop_token_text_only_with_include_stop_str_in_output(client: Any):
    forced = {"logit_bias": {str(EOS_ID): 100}, "max_tokens": 3}
    options = {"ignore_eos": False, "skip_special_tokens": False}
    cut = complete(client, "A fox", **forced, extra_body=options)
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == ("", "stop")
    kept = complete(
        client, "A fox", **forced, extra_body={**options, "include_stop_str_in_output": True}
    )
    assert (kept.choices[0].text, kept.choices[0].finish_reason) == (" <|im_end|>", "stop")


def test_include_stop_str_in_output(client: Any):
    full = complete(client, "Once upon a time", max_tokens=24).choices[0].text
    stop = full[6:9]
    assert stop and full.find(stop) == 6, full
    without = complete(client, "Once upon a time", max_tokens=24, stop=[stop])
    assert without.choices[0].text == full[:6]
    with_stop = complete(
        client,
        "Once upon a time",
        max_tokens=24,
        stop=[stop],
        extra_body={"include_stop_str_in_output": True},
    )
    assert with_stop.choices[0].text == full[:9]
    assert with_stop.choices[0].finish_reason == "stop"


# -- prefill -------------------------------------------------------------------------------

PREFILL = [*MESSAGES, {"role": "assistant", "content": "Once upon a"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


def test_prefill_continues_the_final_assistant_message(client: Any, server: LiveServer):
    tokenizer = server.ctx.tokenizer
    rendered = tokenizer.apply_chat_template(
        PREFILL, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert rendered.endswith("Once upon a")  # the turn is left open
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    expected = complete(client, ids, max_tokens=10).choices[0].text
    resp = chat(client, PREFILL, max_tokens=10, extra_body=CONTINUE)
    assert resp.choices[0].message.content == expected
    assert resp.usage.prompt_tokens == len(ids)
    stream = chat(client, PREFILL, max_tokens=10, stream=True, extra_body=CONTINUE)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == expected
    echoed = chat(client, PREFILL, max_tokens=10, extra_body={**CONTINUE, "echo": True})
    assert echoed.choices[0].message.content == "Once upon a" + expected
    # Without continue_final_message the assistant turn is closed and a new one opened.
    closed = chat(client, PREFILL, max_tokens=10)
    assert closed.usage.prompt_tokens > len(ids)


def test_prefill_needs_a_final_assistant_message(client: Any):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, MESSAGES, extra_body=CONTINUE)
    assert "continue_final_message" in str(err.value)
    with pytest.raises(openai.BadRequestError):
        chat(client, PREFILL, extra_body={"continue_final_message": True})


# -- echo, prompt logprobs, scoring ---------------------------------------------------------


@pytest.fixture(scope="module")
def reference_logprobs(tiny_model_dir: Any) -> Any:
    """log_softmax of a transformers forward pass over the same tiny weights."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()

    def forward(ids: list[int]) -> Any:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return forward


PROMPT = "The quick brown fox jumps over the lazy dog, and then"


def test_echo_with_logprobs_equals_a_forward_pass(
    client: Any, server: LiveServer, reference_logprobs: Any
):
    ids = server.ctx.tokenizer.encode(PROMPT)
    resp = complete(client, PROMPT, max_tokens=2, echo=True, logprobs=3)
    lp = resp.choices[0].logprobs
    assert resp.choices[0].text.startswith(PROMPT)
    assert len(lp.tokens) == len(ids) + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    reference = reference_logprobs(ids)
    for position in range(1, len(ids)):
        expected = reference[position - 1, ids[position]].item()
        assert lp.token_logprobs[position] == pytest.approx(expected, abs=2e-3)
        top = reference[position - 1].topk(3)
        decoded = [server.ctx.tokenizer.decode([t]) for t in top.indices.tolist()]
        assert list(lp.top_logprobs[position]) == decoded
    assert lp.text_offset[0] == 0
    assert resp.usage.completion_tokens == 2


def test_max_tokens_zero_scores_the_prompt(
    client: Any, server: LiveServer, reference_logprobs: Any
):
    ids = server.ctx.tokenizer.encode(PROMPT)
    complete(client, PROMPT, max_tokens=2)  # fill the prefix cache with this prompt
    resp = complete(
        client, PROMPT, max_tokens=0, echo=True, logprobs=0, extra_body={"prompt_logprobs": 1}
    )
    choice = resp.choices[0]
    assert choice.text == PROMPT
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 0
    assert resp.usage.prompt_tokens == len(ids)
    # A scoring request recomputes its prompt instead of reading the prefix cache.
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    reference = reference_logprobs(ids)
    scored = choice.logprobs.token_logprobs
    assert scored[0] is None and len(scored) == len(ids)
    for position in range(1, len(ids)):
        assert scored[position] == pytest.approx(
            reference[position - 1, ids[position]].item(), abs=2e-3
        )
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    entry = prompt_logprobs[1][str(ids[1])]
    assert entry["logprob"] == pytest.approx(scored[1], abs=1e-6)
    expected_rank = int((reference[0] > reference[0, ids[1]]).sum()) + 1
    assert entry["rank"] == expected_rank
    server.wait_idle()


def test_max_tokens_zero_needs_n_1(client: Any):
    with pytest.raises(openai.BadRequestError):
        complete(client, PROMPT, max_tokens=0, n=2)


def test_streamed_echo_with_logprobs(client: Any):
    whole = complete(client, PROMPT, max_tokens=4, echo=True, logprobs=1)
    chunks = list(complete(client, PROMPT, max_tokens=4, echo=True, logprobs=1, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert text == whole.choices[0].text
    assert tokens == whole.choices[0].logprobs.tokens


def test_chat_prompt_logprobs(client: Any, server: LiveServer):
    resp = chat(client, max_tokens=2, extra_body={"prompt_logprobs": 0})
    entries = resp.model_extra["prompt_logprobs"]
    assert entries[0] is None
    assert len(entries) == resp.usage.prompt_tokens
    assert all(len(e) == 1 for e in entries[1:])


# -- logprob bytes ------------------------------------------------------------------------


def test_logprob_bytes_rebuild_the_content(client: Any):
    resp = chat(client, max_tokens=40, temperature=1.0, seed=11, logprobs=True, top_logprobs=1)
    content = resp.choices[0].message.content
    raw = b"".join(bytes(e.bytes) for e in resp.choices[0].logprobs.content)
    assert raw.decode("utf-8", errors="replace") == content


def test_tokens_of_a_cut_stop_string_are_not_in_logprobs(client: Any):
    resp = chat(client, max_tokens=30, logprobs=True)
    entries = resp.choices[0].logprobs.content
    content = resp.choices[0].message.content
    # A stop string equal to a whole later token's text, first seen at that token.
    for k in range(3, len(entries)):
        piece = bytes(entries[k].bytes).decode("utf-8", errors="ignore")
        prefix = b"".join(bytes(e.bytes) for e in entries[:k]).decode("utf-8", errors="ignore")
        if piece.strip() and piece == entries[k].token and piece not in prefix + piece[:-1]:
            break
    else:
        pytest.skip(f"no usable stop token in {content!r}")
    stopped = chat(client, max_tokens=30, logprobs=True, stop=[piece])
    assert stopped.choices[0].message.content == prefix
    assert [e.token for e in stopped.choices[0].logprobs.content] == [e.token for e in entries[:k]]


# -- n > 1: one choice stops early -----------------------------------------------------------


def test_a_choice_ended_by_a_stop_string_stops_decoding(client: Any, server: LiveServer):
    budget = 120
    sampled = dict(n=3, temperature=1.0, seed=5, max_tokens=budget)
    texts = [c.text for c in complete(client, PROMPT, **sampled).choices]
    stop = next(
        (
            texts[0][i : i + 3]
            for i in range(1, 12)
            if texts[0].find(texts[0][i : i + 3]) == i
            and len(texts[0][i : i + 3]) == 3
            and all(texts[0][i : i + 3] not in t for t in texts[1:])
        ),
        None,
    )
    assert stop is not None, texts
    server.wait_idle()
    before = server.ctx.engine.stats().generation_tokens_total
    resp = complete(client, PROMPT, stop=[stop], **sampled)
    server.wait_idle()
    generated = server.ctx.engine.stats().generation_tokens_total - before
    by_index = {c.index: c for c in resp.choices}
    assert by_index[0].finish_reason == "stop"
    assert by_index[0].text == texts[0][: texts[0].find(stop)]
    assert [by_index[i].text for i in (1, 2)] == texts[1:]
    # The siblings made 2 * budget tokens; choice 0 stopped long before its budget.
    assert generated < 2 * budget + budget // 2, generated
    assert resp.usage.completion_tokens < 2 * budget + budget // 2


# -- template errors, CORS, docs, stream failures --------------------------------------------


def test_a_template_that_raises_is_a_400_with_its_message(tiny_built: Any):
    template = (
        "{% if messages|length > 1 %}{{ raise_exception('Conversation roles must alternate') }}"
        "{% endif %}{{ messages[0]['content'] }}"
    )
    settings = ServerSettings(served_model_names=(TINY_MODEL_NAME,), chat_template=template)
    with live_server(tiny_built, settings) as live:
        client = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as err:
            chat(client, [*MESSAGES, *MESSAGES])
        assert "Conversation roles must alternate" in str(err.value)
        assert err.value.body["param"] == "messages"
        assert chat(client, MESSAGES, max_tokens=2).choices[0].finish_reason == "length"


ORIGIN = "http://app.example"
KEY = "sk-cors-test"


def preflight(url: str) -> httpx.Response:
    return httpx.options(
        f"{url}/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
        timeout=30,
    )


def test_cors_preflight_with_and_without_allowed_origins(tiny_built: Any, server: LiveServer):
    refused = preflight(server.url)
    assert refused.status_code == 405
    assert "access-control-allow-origin" not in refused.headers
    settings = ServerSettings(
        served_model_names=(TINY_MODEL_NAME,), api_key=KEY, allowed_origins=(ORIGIN,)
    )
    with live_server(tiny_built, settings) as live:
        answered = preflight(live.url)
        assert answered.status_code == 200
        assert answered.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in answered.headers["access-control-allow-methods"]
        body = {"model": TINY_MODEL_NAME, "messages": MESSAGES, "max_tokens": 2}
        headers = {"Origin": ORIGIN}
        no_key = httpx.post(f"{live.url}/v1/chat/completions", json=body, headers=headers)
        assert no_key.status_code == 401  # the key still guards the real request
        with_key = httpx.post(
            f"{live.url}/v1/chat/completions",
            json=body,
            headers={**headers, "Authorization": f"Bearer {KEY}"},
            timeout=60,
        )
        assert with_key.status_code == 200
        assert with_key.headers["access-control-allow-origin"] == ORIGIN
        other = httpx.options(
            f"{live.url}/v1/models",
            headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "GET"},
        )
        assert other.status_code == 400
        assert "access-control-allow-origin" not in other.headers


def test_docs_follow_protect_open_endpoints(tiny_built: Any):
    for protect in (False, True):
        settings = ServerSettings(
            served_model_names=(TINY_MODEL_NAME,), api_key=KEY, protect_open_endpoints=protect
        )
        with live_server(tiny_built, settings) as live:
            for path in ("/docs", "/openapi.json"):
                anonymous = httpx.get(f"{live.url}{path}")
                assert anonymous.status_code == (401 if protect else 200), path
                keyed = httpx.get(f"{live.url}{path}", headers={"Authorization": f"Bearer {KEY}"})
                assert keyed.status_code == 200


def sse_events(response: httpx.Response) -> Iterator[str]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


def test_a_stream_that_fails_ends_with_an_error_event_and_done(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
):
    from server.routes import chat as chat_route

    def broken(self: Any, logprobs: Any) -> Any:
        raise RuntimeError("formatter bug")

    # Fault injection: the formatter raises once the stream has started.
    monkeypatch.setattr(chat_route._ChatFormatter, "_logprob_entries", broken)
    body = {
        "model": TINY_MODEL_NAME,
        "messages": MESSAGES,
        "max_tokens": 4,
        "stream": True,
        "logprobs": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = list(sse_events(r))
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "internal_error" and "RuntimeError" in error["message"]
    server.wait_idle()
