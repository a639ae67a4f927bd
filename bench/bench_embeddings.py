"""Embeddings throughput, and what an embedding load costs chat, against a live server.

Four phases, one after the other, against ``--url`` (a running ``kvserve serve``):

1. embeddings/s at batch 1: ``--requests`` requests of one input each, one at a time;
2. embeddings/s at batch 32: requests of 32 inputs each, one at a time;
3. chat alone: ``--chats`` concurrent streams of ``--max-tokens`` tokens (ignore_eos),
   generated tokens/s over the phase and the median gap between a stream's tokens;
4. the same chats with an embedding load beside them (a loop of batch-32 requests until
   the chats end): chat tokens/s and gap again, and the embeddings/s achieved meanwhile.

Inputs are synthetic sentences of about ``--words`` words. Prints one JSON object.

    .venv/bin/python bench/bench_embeddings.py --url http://127.0.0.1:8000 --model smollm2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from typing import Any

import httpx

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "box",
    "jam",
]


def sentence(index: int, words: int) -> str:
    return f"Item {index}: " + " ".join(WORDS[(index + i) % len(WORDS)] for i in range(words))


async def embed(client: httpx.AsyncClient, model: str, texts: list[str]) -> None:
    response = await client.post(
        "/v1/embeddings", json={"model": model, "input": texts, "encoding_format": "base64"}
    )
    response.raise_for_status()


async def embeddings_per_second(
    client: httpx.AsyncClient, model: str, batch: int, requests: int, words: int
) -> float:
    await embed(client, model, [sentence(-1, words)] * batch)  # warm
    start = time.perf_counter()
    for r in range(requests):
        await embed(client, model, [sentence(r * batch + i, words) for i in range(batch)])
    return requests * batch / (time.perf_counter() - start)


async def chat_stream(
    client: httpx.AsyncClient, model: str, index: int, max_tokens: int
) -> list[float]:
    """Arrival times of the stream's content chunks."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Tell me story number {index}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    times: list[float] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    times.append(time.perf_counter())
    return times


async def chat_phase(
    client: httpx.AsyncClient, args: argparse.Namespace, with_embeddings: bool
) -> dict[str, Any]:
    done = asyncio.Event()
    embedded = 0

    async def embedding_load() -> None:
        nonlocal embedded
        index = 0
        while not done.is_set():
            await embed(client, args.model, [sentence(index + i, args.words) for i in range(32)])
            embedded += 32
            index += 32

    start = time.perf_counter()
    load = asyncio.create_task(embedding_load()) if with_embeddings else None
    streams = await asyncio.gather(
        *(chat_stream(client, args.model, i, args.max_tokens) for i in range(args.chats))
    )
    elapsed = time.perf_counter() - start
    done.set()
    if load is not None:
        await load
    gaps = [b - a for times in streams for a, b in itertools.pairwise(times)]
    result = {
        "chat_tokens_per_s": round(sum(len(t) for t in streams) / elapsed, 2),
        "median_token_gap_ms": round(statistics.median(gaps) * 1e3, 2) if gaps else None,
        "seconds": round(elapsed, 2),
    }
    if with_embeddings:
        result["embeddings_per_s_beside"] = round(embedded / elapsed, 2)
    return result


async def main(args: argparse.Namespace) -> dict[str, Any]:
    timeout = httpx.Timeout(args.timeout)
    async with httpx.AsyncClient(base_url=args.url, timeout=timeout) as client:
        batch1 = await embeddings_per_second(client, args.model, 1, args.requests, args.words)
        batch32 = await embeddings_per_second(
            client, args.model, 32, max(1, args.requests // 8), args.words
        )
        alone = await chat_phase(client, args, with_embeddings=False)
        beside = await chat_phase(client, args, with_embeddings=True)
    return {
        "embeddings_per_s_batch_1": round(batch1, 2),
        "embeddings_per_s_batch_32": round(batch32, 2),
        "chat_alone": alone,
        "chat_with_embedding_load": beside,
        "settings": vars(args),
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="the served model name (default: the server's)")
    p.add_argument("--requests", type=int, default=32, help="batch-1 requests (batch 32: 1/8)")
    p.add_argument("--words", type=int, default=24, help="words per input sentence")
    p.add_argument("--chats", type=int, default=4, help="concurrent chat streams")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per chat stream")
    p.add_argument("--timeout", type=float, default=600.0)
    return p.parse_args()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(parse_args())), indent=2))
