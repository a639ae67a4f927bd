"""The load tester against a fake OpenAI-compatible server with known delays.

The fake server streams ``max_tokens`` one-word tokens: the first after ``TTFT_S``, the
rest ``ITL_S`` apart, and reports usage (prompt tokens = words sent, cached = words of
all but the last message). The statistics the tool derives must match those delays:
sleeps never end early, so lower bounds are tight; upper bounds leave room for a shared,
busy CPU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from loadtest.__main__ import main
from loadtest.config import SLO, LengthDist, LoadTestConfig
from loadtest.report import build_result
from loadtest.runner import run_loadtest

TTFT_S = 0.2
ITL_S = 0.03
MAX_TOKENS = 12
E2E_S = TTFT_S + (MAX_TOKENS - 1) * ITL_S
SLACK_S = 0.15  # scheduling noise allowed on a shared 2-core machine


@dataclass
class FakeBehaviour:
    ttft_s: float = TTFT_S
    itl_s: float = ITL_S
    report_usage: bool = True
    fail_every: int = 0  # every Nth request answers 500 (0: never)
    truncate_every: int = 0  # every Nth stream stops after one token, unfinished (0: never)
    metrics: bool = True
    requests_seen: int = 0
    running: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth_headers: list[str | None] = field(default_factory=list)
    # What the fake exports as kvserve's per-request counters (finished streams only).
    finished: int = 0
    generated: int = 0
    queried_words: int = 0
    cached_words: int = 0


def _words(messages: list[dict[str, str]]) -> int:
    return sum(len(m["content"].split()) for m in messages)


def _chunk(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _stream(body: dict[str, Any], state: FakeBehaviour, truncate: bool) -> AsyncIterator[str]:
    state.running += 1
    try:
        yield _chunk({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        await asyncio.sleep(state.ttft_s)
        for i in range(body["max_tokens"]):
            if i:
                await asyncio.sleep(state.itl_s)
            yield _chunk({"choices": [{"index": 0, "delta": {"content": f"w{i} "}}]})
            if truncate:
                return
        yield _chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        state.finished += 1
        state.generated += body["max_tokens"]
        state.queried_words += _words(body["messages"])
        state.cached_words += _words(body["messages"][:-1])
        if state.report_usage and body.get("stream_options", {}).get("include_usage"):
            usage = {
                "prompt_tokens": _words(body["messages"]),
                "completion_tokens": body["max_tokens"],
                "prompt_tokens_details": {"cached_tokens": _words(body["messages"][:-1])},
            }
            yield _chunk({"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"
    finally:
        state.running -= 1


def fake_app(state: FakeBehaviour) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        state.bodies.append(body)
        state.auth_headers.append(request.headers.get("authorization"))
        state.requests_seen += 1
        if state.fail_every and state.requests_seen % state.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        truncate = bool(state.truncate_every) and state.requests_seen % state.truncate_every == 0
        return StreamingResponse(_stream(body, state, truncate), media_type="text/event-stream")

    @app.get("/metrics")
    async def metrics() -> Response:
        if not state.metrics:
            return PlainTextResponse("not found", status_code=404)
        text = (
            "# TYPE kvserve_kv_cache_usage_ratio gauge\n"
            f"kvserve_kv_cache_usage_ratio {state.running / 10}\n"
            "# TYPE kvserve_num_requests_running gauge\n"
            f"kvserve_num_requests_running {state.running}\n"
            "# TYPE kvserve_num_requests_waiting gauge\n"
            "kvserve_num_requests_waiting 0\n"
            "# TYPE kvserve_preemptions_total counter\n"
            f'kvserve_preemptions_total{{mode="recompute"}} {state.requests_seen}\n'
            f'kvserve_preemptions_total{{mode="swap"}} {2 * state.requests_seen}\n'
            "# TYPE kvserve_requests_finished_total counter\n"
            f'kvserve_requests_finished_total{{finish_reason="length"}} {state.finished}\n'
            "# TYPE kvserve_generation_tokens_total counter\n"
            f"kvserve_generation_tokens_total {state.generated}\n"
            "# TYPE kvserve_prefix_cache_queried_tokens_total counter\n"
            f"kvserve_prefix_cache_queried_tokens_total {state.queried_words}\n"
            "# TYPE kvserve_prefix_cache_hit_tokens_total counter\n"
            f"kvserve_prefix_cache_hit_tokens_total {state.cached_words}\n"
            # Every first token comes after ttft_s: all in the bucket that holds it.
            "# TYPE kvserve_time_to_first_token_seconds histogram\n"
            f'kvserve_time_to_first_token_seconds_bucket{{le="0.1"}} 0\n'
            f'kvserve_time_to_first_token_seconds_bucket{{le="0.4"}} {state.finished}\n'
            f'kvserve_time_to_first_token_seconds_bucket{{le="+Inf"}} {state.finished}\n'
            f"kvserve_time_to_first_token_seconds_count {state.finished}\n"
            f"kvserve_time_to_first_token_seconds_sum {state.finished * state.ttft_s}\n"
        )
        return PlainTextResponse(text)

    return app


@pytest.fixture
def fake_server() -> Iterator[tuple[str, FakeBehaviour]]:
    with _serve_fake() as served:
        yield served


@pytest.fixture
def two_fake_servers() -> Iterator[list[tuple[str, FakeBehaviour]]]:
    with _serve_fake() as first, _serve_fake() as second:
        yield [first, second]


@contextmanager
def _serve_fake() -> Iterator[tuple[str, FakeBehaviour]]:
    state = FakeBehaviour()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(fake_app(state), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _run(config: LoadTestConfig) -> dict[str, Any]:
    return build_result(asyncio.run(run_loadtest(config, progress=False)))


def test_statistics_match_injected_delays(fake_server: tuple[str, FakeBehaviour]) -> None:
    url, state = fake_server
    config = LoadTestConfig(
        url=url,
        concurrency=4,
        turns=3,
        max_tokens=MAX_TOKENS,
        user_len=LengthDist("fixed", 10),
        scrape_interval_s=0.1,
    )
    doc = _run(config)
    summary = doc["summary"]
    assert summary["requests"] == {
        "completed": 12,
        "failed": 0,
        "cancelled": 0,
        "error_rate": 0.0,
        "errors_by_status": {},
        "usage_reported": 12,
    }
    latency = summary["latency_s"]
    assert TTFT_S <= latency["ttft"]["p50"] <= TTFT_S + SLACK_S
    # Chunks delayed by a busy CPU arrive bunched, so single gaps may be a bit short;
    # the per-request mean (tpot) cannot be.
    assert 0.8 * ITL_S <= latency["itl"]["p50"] <= ITL_S + SLACK_S / 3
    assert latency["itl"]["count"] == 12 * (MAX_TOKENS - 1)
    assert E2E_S <= latency["e2e"]["p50"] <= E2E_S + SLACK_S
    assert ITL_S <= latency["tpot"]["p50"] <= ITL_S + SLACK_S / 3
    assert summary["tokens"]["output"] == 12 * MAX_TOKENS
    # Closed loop: three turns back to back, all four conversations in parallel.
    assert 3 * E2E_S <= summary["duration_s"] <= 3 * (E2E_S + SLACK_S) + 0.5
    expected_rate = 12 * MAX_TOKENS / summary["duration_s"]
    assert summary["throughput"]["output_tokens_per_s"] == pytest.approx(expected_rate)
    prompt_words = sum(_words(body["messages"]) for body in state.bodies)
    assert summary["tokens"]["prompt"] == prompt_words
    # Cached prompt tokens are passed through from usage.prompt_tokens_details.
    assert summary["tokens"]["cached_prompt"] == sum(
        _words(body["messages"][:-1]) for body in state.bodies
    )


def test_each_turn_resends_the_whole_history(fake_server: tuple[str, FakeBehaviour]) -> None:
    url, state = fake_server
    _run(LoadTestConfig(url=url, concurrency=2, turns=3, max_tokens=3, system_prompt_len=5))
    assert len(state.bodies) == 6
    by_conversation: dict[str, list[list[dict[str, str]]]] = {}
    for body in state.bodies:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["model"] == "fake-model" and "ignore_eos" not in body
        assert "seed" not in body  # greedy by default: nothing to seed
        first_user = body["messages"][1]["content"]
        by_conversation.setdefault(first_user, []).append(body["messages"])
    assert len(by_conversation) == 2
    for histories in by_conversation.values():
        assert [len(h) for h in histories] == [2, 4, 6]  # system + (user, assistant) pairs
        assert histories[2][:4] == histories[1]  # the previous request, whole
        assert histories[2][4]["content"] == "w0 w1 w2 "  # turn 2's streamed reply, appended
        assert all(h[0]["role"] == "system" for h in histories)


def test_a_model_list_spreads_conversations_over_the_names(
    fake_server: tuple[str, FakeBehaviour],
) -> None:
    """``--model a,b``: each conversation keeps one name, round-robin (LoRA adapters)."""
    url, state = fake_server
    config = LoadTestConfig(url=url, model="a", models=("a", "b"), concurrency=4, turns=2)
    _run(dataclasses.replace(config, max_tokens=2))
    models: dict[str, set[str]] = {}
    for body in state.bodies:
        models.setdefault(body["messages"][0]["content"], set()).add(body["model"])
    assert sorted(sorted(names) for names in models.values()) == [["a"], ["a"], ["b"], ["b"]]


def test_goodput_counts_requests_within_the_slo(fake_server: tuple[str, FakeBehaviour]) -> None:
    url, _ = fake_server
    base = LoadTestConfig(url=url, concurrency=2, turns=2, max_tokens=4)
    strict_slo, loose_slo = SLO(ttft_s=TTFT_S / 2, itl_s=1.0), SLO(ttft_s=5.0, itl_s=1.0)
    strict = _run(dataclasses.replace(base, slo=strict_slo))["summary"]["goodput"]
    loose = _run(dataclasses.replace(base, slo=loose_slo))["summary"]["goodput"]
    assert strict["good_requests"] == 0 and strict["fraction"] == 0.0
    assert loose["good_requests"] == 4 and loose["fraction"] == 1.0


def test_errors_are_counted_by_status(fake_server: tuple[str, FakeBehaviour]) -> None:
    url, state = fake_server
    state.fail_every = 3
    doc = _run(LoadTestConfig(url=url, concurrency=3, turns=2, max_tokens=2))
    requests = doc["summary"]["requests"]
    assert requests["completed"] + requests["failed"] == 6
    assert requests["failed"] == 2 and requests["errors_by_status"] == {"http_500": 2}
    assert requests["error_rate"] == pytest.approx(2 / 6)


def test_unfinished_streams_are_errors(fake_server: tuple[str, FakeBehaviour]) -> None:
    url, state = fake_server
    state.truncate_every = 2
    doc = _run(LoadTestConfig(url=url, concurrency=2, turns=2, max_tokens=3))
    requests = doc["summary"]["requests"]
    assert requests["completed"] == 2 and requests["errors_by_status"] == {"truncated": 2}


def test_missing_usage_is_tolerated(fake_server: tuple[str, FakeBehaviour]) -> None:
    url, state = fake_server
    state.report_usage = False
    state.metrics = False
    doc = _run(LoadTestConfig(url=url, concurrency=2, turns=2, max_tokens=5))
    summary = doc["summary"]
    assert summary["requests"]["completed"] == 4 and summary["requests"]["usage_reported"] == 0
    assert summary["tokens"]["output"] == 20  # counted from content chunks
    assert summary["tokens"]["prompt"] == 0 and summary["tokens"]["cached_prompt"] is None
    assert doc["server_metrics"] == {"available": False, "increase": {}, "peak": {}}


def test_server_metrics_are_scraped_over_time(fake_server: tuple[str, FakeBehaviour]) -> None:
    url, _ = fake_server
    doc = _run(
        LoadTestConfig(
            url=url, concurrency=4, turns=2, max_tokens=MAX_TOKENS, scrape_interval_s=0.05
        )
    )
    samples = doc["timeseries"]["server_metrics"]
    assert doc["server_metrics"]["available"] is True
    assert len(samples) >= 5
    assert max(s["num_running"] for s in samples) >= 2  # seen while requests were in flight
    assert doc["server_metrics"]["peak"]["kv_usage_ratio"] == pytest.approx(
        doc["server_metrics"]["peak"]["num_running"] / 10
    )
    # Preemptions are summed over modes; the last scrape follows the last request.
    assert samples[-1]["preemptions_total"] == 3 * 8
    assert (
        doc["server_metrics"]["increase"]["preemptions_total"]
        == 3 * 8 - samples[0]["preemptions_total"]
    )


def test_duration_bound_stops_the_run(fake_server: tuple[str, FakeBehaviour]) -> None:
    url, state = fake_server
    state.itl_s = 0.5  # each request would take ~10 s
    started = time.monotonic()
    doc = _run(
        LoadTestConfig(
            url=url, concurrency=3, turns=4, max_tokens=20, duration_s=1.0, drain_timeout_s=0.5
        )
    )
    assert time.monotonic() - started < 6.0
    assert doc["stopped_by"] == "duration"
    requests = doc["summary"]["requests"]
    assert requests["cancelled"] == 3 and requests["failed"] == 0
    assert state.requests_seen == 3


def test_max_requests_bound(fake_server: tuple[str, FakeBehaviour]) -> None:
    url, state = fake_server
    doc = _run(LoadTestConfig(url=url, concurrency=2, turns=4, max_tokens=2, max_requests=5))
    assert doc["stopped_by"] == "max_requests"
    assert doc["summary"]["requests"]["completed"] == 5 and state.requests_seen == 5


def test_poisson_mode_reaches_the_offered_rate(fake_server: tuple[str, FakeBehaviour]) -> None:
    url, state = fake_server
    state.ttft_s, state.itl_s = 0.01, 0.001
    doc = _run(
        LoadTestConfig(
            url=url,
            concurrency=4,
            turns=5,
            num_conversations=8,
            request_rate=40.0,
            max_tokens=2,
            seed=3,
        )
    )
    summary = doc["summary"]
    assert summary["requests"]["completed"] == 40
    # 40 exponential gaps of mean 25 ms: about 1 s; generous bounds for a busy machine.
    assert 0.4 <= summary["duration_s"] <= 4.0
    conversations = {r["conversation_id"] for r in doc["requests"]}
    assert conversations == set(range(8))
    assert all(
        sorted(r["turn"] for r in doc["requests"] if r["conversation_id"] == c) == list(range(5))
        for c in conversations
    )


def test_cli_writes_json_and_png(
    fake_server: tuple[str, FakeBehaviour], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, state = fake_server
    json_path, png_path = tmp_path / "r.json", tmp_path / "r.png"
    status = main(
        [
            "--url",
            url + "/v1",
            "-c",
            "2",
            "-t",
            "2",
            "--max-tokens",
            "3",
            "--ignore-eos",
            "--temperature",
            "0.7",
            "--seed",
            "5",
            "--api-key",
            "secret-key",
            "--json",
            str(json_path),
            "--png",
            str(png_path),
            "--no-progress",
        ]
    )
    assert status == 0
    doc = json.loads(json_path.read_text())
    assert doc["summary"]["requests"]["completed"] == 4
    assert "api_key" not in doc["config"] and "secret-key" not in json_path.read_text()
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(body["ignore_eos"] is True for body in state.bodies)
    seeds = [body["seed"] for body in state.bodies]
    assert len(set(seeds)) == 4  # one per conversation and turn, repeatable from --seed
    assert set(state.auth_headers) == {"Bearer secret-key"}
    out = capsys.readouterr().out
    assert "out tok/s" in out and "ttft" in out


def test_poisson_mode_stops_at_its_duration(fake_server: tuple[str, FakeBehaviour]) -> None:
    url, state = fake_server
    state.ttft_s, state.itl_s = 0.01, 0.001
    config = LoadTestConfig(
        url=url,
        concurrency=4,
        turns=1000,
        request_rate=20.0,
        max_tokens=2,
        duration_s=1.0,
        drain_timeout_s=2.0,
        think_time_s=0.05,
    )
    started = time.monotonic()
    doc = _run(config)
    assert time.monotonic() - started < 5.0
    assert doc["stopped_by"] == "duration"
    requests = doc["summary"]["requests"]
    assert requests["failed"] == 0 and 3 <= requests["completed"] <= 60
    assert {r["conversation_id"] for r in doc["requests"]} <= set(range(4))


def test_direct_replicas_pin_conversations_and_add_up(
    two_fake_servers: list[tuple[str, FakeBehaviour]],
) -> None:
    (url_a, state_a), (url_b, state_b) = two_fake_servers
    config = LoadTestConfig(
        urls=(url_a, url_b + "/v1"),
        concurrency=4,
        num_conversations=5,
        turns=3,
        max_tokens=4,
        system_prompt_len=8,
        scrape_interval_s=0.05,
    )
    doc = _run(config)
    assert doc["target"]["urls"] == [url_a, url_b] and doc["target"]["routing"] == "conversation"
    # Conversations 0, 2, 4 on the first replica, 1, 3 on the second, every turn.
    for record in doc["requests"]:
        assert record["target"] == (url_a, url_b)[record["conversation_id"] % 2]
    assert (state_a.requests_seen, state_b.requests_seen) == (9, 6)
    per_replica, total = doc["replicas"]["per_replica"], doc["replicas"]["aggregate"]
    assert [r["url"] for r in per_replica] == [url_a, url_b]
    assert [r["requests_finished"] for r in per_replica] == [9, 6]
    assert [r["client"]["completed"] for r in per_replica] == [9, 6]
    assert total["requests_finished"] == 15 == doc["summary"]["requests"]["completed"]
    for key in ("generation_tokens", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens"):
        assert total[key] == sum(r[key] for r in per_replica) > 0
    assert total["generation_tokens"] == doc["summary"]["tokens"]["output"] == 15 * 4
    assert total["prefix_cache_hit_rate"] == pytest.approx(
        total["prefix_cache_hit_tokens"] / total["prefix_cache_queried_tokens"]
    )
    assert [r["share_of_requests"] for r in per_replica] == pytest.approx([0.6, 0.4])
    # The fake's TTFT histogram holds every first token in (0.1, 0.4]: p50 interpolates.
    for row in (*per_replica, total):
        assert row["ttft_s"]["mean"] == pytest.approx(TTFT_S)
        assert 0.1 < row["ttft_s"]["p50"] < row["ttft_s"]["p95"] <= 0.4
    assert total["ttft_s"]["count"] == 15


def test_request_routing_alternates_replicas(
    two_fake_servers: list[tuple[str, FakeBehaviour]],
) -> None:
    (url_a, state_a), (url_b, state_b) = two_fake_servers
    config = LoadTestConfig(
        urls=(url_a, url_b), routing="request", concurrency=1, turns=4, max_tokens=2
    )
    doc = _run(config)
    assert [r["target"] for r in doc["requests"]] == [url_a, url_b, url_a, url_b]
    assert state_a.requests_seen == state_b.requests_seen == 2


def test_replicas_behind_a_router_are_scraped(
    two_fake_servers: list[tuple[str, FakeBehaviour]], tmp_path: Path
) -> None:
    """The first fake stands in for a router: all requests go to it; both are named as
    replicas, so the idle one shows zero requests and the sum still matches."""
    (url_a, _), (url_b, state_b) = two_fake_servers
    json_path = tmp_path / "result.json"
    argv = ["--url", url_a, "--replica-url", f"{url_a},{url_b}", "-c", "2", "-t", "2"]
    argv += ["--max-tokens", "3", "--json", str(json_path), "--no-progress"]
    assert main(argv) == 0
    doc = json.loads(json_path.read_text())
    assert doc["target"]["urls"] == [url_a]
    per_replica = doc["replicas"]["per_replica"]
    assert [r["requests_finished"] for r in per_replica] == [4, 0] and state_b.requests_seen == 0
    assert doc["replicas"]["aggregate"]["requests_finished"] == 4
    assert "client" in per_replica[0] and "client" not in per_replica[1]
    assert all(r["reachable_at_end"] for r in per_replica)


def test_single_server_has_no_replica_figures(fake_server: tuple[str, FakeBehaviour]) -> None:
    url, _ = fake_server
    doc = _run(LoadTestConfig(url=url, concurrency=1, turns=1, max_tokens=2))
    assert doc["replicas"]["per_replica"] == []
    assert doc["requests"][0]["target"] == url
