"""One streamed chat completion against any OpenAI-compatible server, timed.

Times are ``time.perf_counter()`` seconds relative to the run's start. The first token is
the first chunk carrying non-empty ``delta.content`` (a role-only opening chunk does not
count). Usage comes from the final chunk (``stream_options.include_usage``); servers that
omit it leave ``prompt_tokens`` None and ``completion_tokens`` falls back to the number of
content chunks, marked by ``usage_reported`` False.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

STATUS_OK = "ok"
STATUS_CANCELLED = "cancelled"  # cut off by the run's bound, not a server failure
STATUS_TRUNCATED = "truncated"  # the stream ended without a finish_reason


@dataclass
class RequestRecord:
    """What one request did, as measured by the client."""

    conversation_id: int
    turn: int
    start: float
    status: str = STATUS_OK  # ok | cancelled | http_<code> | <exception class name>
    error: str | None = None
    first_token_time: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    cached_tokens: int | None = None
    usage_reported: bool = False
    finish_reason: str | None = None
    text: str = ""
    target: str | None = None  # the server root it was sent to

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.start

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive content chunks (one chunk is usually one token)."""
        times = self.chunk_times
        return [later - earlier for earlier, later in itertools.pairwise(times)]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (e2e - ttft) / (tokens - 1)."""
        if self.ttft is None or self.e2e is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        del data["text"]  # the history is reproducible from the seed; keep files small
        data["ttft"], data["e2e"], data["tpot"] = self.ttft, self.e2e, self.tpot
        return data


@dataclass(frozen=True)
class ChatRequest:
    """The body of one chat completion request."""

    model: str
    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float
    ignore_eos: bool
    seed: int | None = None

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:  # a vLLM/llama.cpp/kvserve extension: only sent when asked
            body["ignore_eos"] = True
        if self.seed is not None:
            body["seed"] = self.seed
        return body


def _apply_usage(record: RequestRecord, usage: dict[str, Any]) -> None:
    record.usage_reported = True
    if usage.get("prompt_tokens") is not None:
        record.prompt_tokens = int(usage["prompt_tokens"])
    if usage.get("completion_tokens") is not None:
        record.completion_tokens = int(usage["completion_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        record.cached_tokens = int(details["cached_tokens"])


def _apply_chunk(record: RequestRecord, chunk: dict[str, Any], now: float) -> None:
    if "error" in chunk:
        record.status = "stream_error"
        record.error = json.dumps(chunk["error"])[:500]
        return
    for choice in chunk.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            if record.first_token_time is None:
                record.first_token_time = now
            record.chunk_times.append(now)
            record.text += content
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    if chunk.get("usage"):
        _apply_usage(record, chunk["usage"])


async def _read_stream(response: httpx.Response, record: RequestRecord, t0: float) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            break
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            record.status, record.error = "bad_chunk", payload[:500]
            break
        _apply_chunk(record, chunk, time.perf_counter() - t0)
        if not record.ok:
            break


async def stream_chat(
    client: httpx.AsyncClient,
    url: str,
    request: ChatRequest,
    record: RequestRecord,
    t0: float,
) -> RequestRecord:
    """Send ``request`` to ``url``, stream the reply into ``record`` and return it.

    Never raises for server or network failures: they land in ``record.status``.
    Cancellation (the run's bound) propagates after marking the record cancelled.
    """
    try:
        async with client.stream("POST", url, json=request.body()) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.status, record.error = f"http_{response.status_code}", body[:500]
            else:
                await _read_stream(response, record, t0)
                if record.ok and record.finish_reason is None:
                    # The server closed the stream without finishing the choice (an
                    # interrupted or crashed generation): not a success.
                    record.status, record.error = STATUS_TRUNCATED, "no finish_reason"
    except httpx.HTTPError as exc:
        record.status, record.error = type(exc).__name__, str(exc)[:500]
    except asyncio.CancelledError:
        record.status = STATUS_CANCELLED
        raise
    finally:
        record.end = time.perf_counter() - t0
        if not record.usage_reported:
            record.completion_tokens = len(record.chunk_times)
    return record
