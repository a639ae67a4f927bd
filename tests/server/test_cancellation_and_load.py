"""Client disconnects abort their requests and free blocks; 32 concurrent streams."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.server.conftest import TINY_MODEL_NAME, LiveServer

LONG = 900  # tokens: far more than a test waits for


def long_chat(stream: bool) -> dict[str, Any]:
    return {
        "model": TINY_MODEL_NAME,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": stream,
    }


def generated_total(server: LiveServer) -> int:
    return int(server.ctx.engine.stats().generation_tokens_total)


def test_disconnect_mid_stream_frees_blocks(server: LiveServer):
    server.wait_idle()
    before = generated_total(server)
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=long_chat(True), timeout=30
    ) as resp:
        lines = resp.iter_lines()
        data = [line for line in (next(lines) for _ in range(8)) if line.startswith("data: ")]
        assert data, "no events before disconnecting"
        # While streaming, the request holds KV blocks.
        assert server.ctx.engine.stats().device_blocks.used > 0
    stats = server.wait_idle()
    assert stats.device_blocks.used == 0
    assert generated_total(server) - before < LONG


def test_disconnect_of_non_streaming_request_aborts_it(server: LiveServer):
    server.wait_idle()
    before = generated_total(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=long_chat(False), timeout=0.3)
    stats = server.wait_idle()
    assert stats.num_running == 0
    assert generated_total(server) - before < LONG


def test_many_disconnects_leave_the_pool_clean(server: LiveServer):
    async def drop_after_first_token() -> None:
        async with (
            httpx.AsyncClient(timeout=30) as http,
            http.stream("POST", f"{server.url}/v1/chat/completions", json=long_chat(True)) as resp,
        ):
            async for line in resp.aiter_lines():
                if '"content"' in line:
                    return

    async def main() -> None:
        await asyncio.gather(*(drop_after_first_token() for _ in range(12)))

    asyncio.run(main())
    stats = server.wait_idle()
    assert stats.device_blocks.used == 0


def test_32_concurrent_streams_with_correct_usage(server: LiveServer):
    import openai

    tokenizer = server.ctx.tokenizer

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, int, int, str]:
        content = f"Request number {i}: " + "word " * (i % 7)
        stream = await client.chat.completions.create(
            model=TINY_MODEL_NAME,
            messages=[{"role": "user", "content": content}],
            max_tokens=8 + i % 9,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage, finishes = "", None, 0
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finishes += choice.finish_reason is not None
        assert usage is not None
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        expected_prompt = len(tokenizer.encode(prompt, add_special_tokens=False))
        assert usage.prompt_tokens == expected_prompt
        return i, usage.completion_tokens, 8 + i % 9, finishes, text

    async def main() -> list[tuple[int, int, int, int, str]]:
        async with openai.AsyncOpenAI(
            base_url=server.v1, api_key="x", max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32
    for _, completion_tokens, requested, finishes, _ in results:
        assert completion_tokens == requested
        assert finishes == 1
    server.wait_idle()


def test_sse_framing_is_plain_data_lines(server: LiveServer):
    body = {**long_chat(True), "max_tokens": 3}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        assert event.startswith("data: ")
        json.loads(event[6:])
