"""Nothing lost under pressure: through the real HTTP server, greedy float32 outputs of the
tiny model under a tiny KV budget -- many concurrent multi-turn conversations, so requests
are preempted (by recompute, or by swap), prompts are prefilled in chunks and the second
turns hit the prefix cache -- equal, request by request, the outputs of an unpressured
server. A preempted, swapped, chunked or cache-served request continues exactly where it
was: no token dropped, repeated or garbled."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.settings import ServerSettings
from tests.server.conftest import TINY_MODEL_NAME, LiveServer, build_tiny, live_server

NUM_CONVERSATIONS = 16
TURNS = 2
MAX_MODEL_LEN = 256
SETTINGS = ServerSettings(served_model_names=(TINY_MODEL_NAME,))

Replies = dict[tuple[int, int], tuple[str, int, str]]


def opening(i: int) -> str:
    topics = ("paged attention", "block tables", "prefix caching", "swap space")
    return f"Conversation {i}: explain {topics[i % 4]} " + "in detail " * (i % 5)


async def converse(http: httpx.AsyncClient, url: str, i: int) -> Replies:
    """One conversation: each turn resends the whole history (the prefix-cache case)."""
    messages = [
        {"role": "system", "content": "You are a careful assistant for KV cache questions."},
        {"role": "user", "content": opening(i)},
    ]
    replies: Replies = {}
    for turn in range(TURNS):
        body = {
            "model": TINY_MODEL_NAME,
            "messages": messages,
            "max_tokens": 20 + (i * 7 + turn) % 17,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        resp = await http.post(url, json=body)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        text = data["choices"][0]["message"]["content"]
        replies[(i, turn)] = (
            text,
            data["usage"]["completion_tokens"],
            data["choices"][0]["finish_reason"],
        )
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"And turn {turn + 2}?"},
        ]
    return replies


def run_conversations(live: LiveServer) -> Replies:
    async def main() -> Replies:
        url = f"{live.url}/v1/chat/completions"
        async with httpx.AsyncClient(timeout=300) as http:
            parts = await asyncio.gather(
                *(converse(http, url, i) for i in range(NUM_CONVERSATIONS))
            )
        return {key: value for part in parts for key, value in part.items()}

    return asyncio.run(main())


@pytest.fixture(scope="module")
def unpressured(tiny_model_dir: Path) -> Iterator[Replies]:
    built = build_tiny(tiny_model_dir, max_model_len=MAX_MODEL_LEN)
    with live_server(built, SETTINGS) as live:
        replies = run_conversations(live)
        stats = live.wait_idle()
    assert sum(stats.preemptions_total.values()) == 0, "the reference run must be unpressured"
    yield replies


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_pressured_outputs_equal_unpressured(tiny_model_dir: Path, unpressured: Replies, mode):
    built = build_tiny(
        tiny_model_dir,
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=MAX_MODEL_LEN // 16 + 4,  # 20 blocks: 320 tokens for 16 conversations
        max_num_batched_tokens=32,  # chat prompts are longer: prefill in chunks
        preemption_mode=mode,
    )
    with live_server(built, SETTINGS) as live:
        pressured = run_conversations(live)
        stats = live.wait_idle()
        live.ctx.engine.core.scheduler.check_integrity()
    assert stats.preemptions_total[mode] > 0, stats.preemptions_total
    if mode == "swap":
        assert stats.blocks_swapped_out_total > 0 and stats.blocks_swapped_in_total > 0
    assert stats.prefix_cache_hits_total > 0
    assert stats.device_blocks.used == 0 and stats.host_blocks.used == 0
    mismatched = [key for key in unpressured if pressured[key] != unpressured[key]]
    assert not mismatched, {key: (unpressured[key], pressured[key]) for key in mismatched}
    assert all(finish == "length" for _, _, finish in pressured.values())
