"""kvserve replicas behind the real vllm-router (a Rust binary from PyPI).

Three replicas of the tiny random Llama start once for the module, each publishing its KV
cache events on ports of its own (``--kv-events-config``); each test starts its own router
in front of two of them:

- ``kv_aware``: a conversation's first turn goes straight to one replica, so only that
  replica's events tell the router where its blocks are; every later turn, sent through
  the router, must land there (checked on each replica's request counter).
- SIGKILL of a replica under load: the requests in flight on it fail promptly (no client
  waits out its timeout), later requests succeed on the survivor.
- SIGTERM drain: the draining replica finishes its streams in flight (one the router
  sent there, one a client sent directly) and gets no new request; the router sends the
  new ones (even those whose prefix it holds) elsewhere. kvserve closes its listener at
  SIGTERM, so /health is unreachable while it drains.

The tests run in file order: the drain test ends replica 1, the kill test replica 2.
Skipped only when the router binary is missing: ``KVSERVE_VLLM_ROUTER`` names it
(.ci/run installs vllm-router into /tmp/kvserve-router and sets it), else ``vllm-router``
on PATH. The replicas run ``--kernels torch``: no test waits on a native-kernel compile.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.client import ChatRequest, RequestRecord, stream_chat
from loadtest.cluster import Replica, ReplicaGroup, Router
from loadtest.prompts import random_words
from loadtest.replicas import REPLICA_COUNTERS
from loadtest.scrape import METRICS, parse_metrics

pytestmark = pytest.mark.slow

NAME = "tiny-llama"
CLIENT_TIMEOUT_S = 30.0  # every request of these tests is bounded by this
LONG = 900  # tokens of a stream that must outlast the drain test's new requests (context 1024)


def _router_binary() -> str | None:
    path = os.environ.get("KVSERVE_VLLM_ROUTER") or shutil.which("vllm-router")
    return path if path and os.access(path, os.X_OK) else None


ROUTER = _router_binary()
if ROUTER is None:
    pytest.skip(
        "vllm-router binary absent: set KVSERVE_VLLM_ROUTER (.ci/run installs it into "
        "/tmp/kvserve-router: pip install vllm-router==0.1.17)",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def group(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaGroup]:
    args = ("--model", str(tiny_model_dir), "--kernels", "torch", "--max-model-len", "1024")
    args += ("--num-kv-blocks", "512", "--log-level", "info")
    replicas = ReplicaGroup(
        count=3, served_name=NAME, args=args, log_dir=tmp_path_factory.mktemp("replicas")
    )
    with replicas:
        yield replicas


def _router(replicas: list[Replica], policy: str, tmp_path: Path) -> Router:
    assert all(r.managed is not None and r.managed.alive() for r in replicas), (
        "a replica this test needs is gone: run the module in file order"
    )
    assert ROUTER is not None
    return Router(ROUTER, replicas, policy, served_name=NAME, log=tmp_path / "router.log")


def _counters(replica: Replica) -> dict[str, float]:
    text = httpx.get(f"{replica.url}/metrics", timeout=10.0).text
    return parse_metrics(text, REPLICA_COUNTERS + METRICS)


def _finished(replica: Replica) -> float:
    return _counters(replica)["requests_finished"]


def _chat(url: str, messages: list[dict[str, str]], max_tokens: int = 4) -> str:
    body = {"model": NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def _opening(index: int, words: int = 90) -> list[dict[str, str]]:
    """A first user turn of its own (about ``words`` tokens: several KV blocks).

    Its own system message too: without one the chat template puts the same default
    system prompt first, and a router started after that first block was stored skips
    every block chained onto it (vllm-router: "unknown parent; skipping unanchored store").
    """
    text = f"conversation {index}: " + random_words(random.Random(index), words)
    system = f"You are assistant number {index}."
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


def _served_by(replicas: list[Replica], before: list[float], timeout_s: float = 10.0) -> int:
    """The index of the one replica whose finished-request counter moved by one."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = [_finished(r) for r in replicas]
        moved = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a > b]
        if moved:
            assert len(moved) == 1 and after[moved[0]] == before[moved[0]] + 1, (before, after)
            return moved[0]
        assert time.monotonic() < deadline, f"no replica counted the request: {after}"
        time.sleep(0.05)


def test_kv_aware_routes_later_turns_to_the_replica_holding_the_blocks(
    group: ReplicaGroup, tmp_path: Path
) -> None:
    replicas = group.replicas[:2]
    conversations = [_opening(i) for i in range(6)]
    homes = [i % 2 for i in range(6)]
    with _router(replicas, "kv_aware", tmp_path) as router:
        # Turn 1 bypasses the router: only the home replica's events announce the blocks.
        hits_before = [_counters(r)["prefix_cache_hit_tokens"] for r in replicas]
        for messages, home in zip(conversations, homes, strict=True):
            before = [_finished(r) for r in replicas]
            messages.append({"role": "assistant", "content": _chat(replicas[home].url, messages)})
            assert _served_by(replicas, before) == home
        time.sleep(1.0)  # the events travel over ZMQ: give the router's index a moment
        served: list[list[int]] = [[] for _ in conversations]
        for turn in (2, 3):
            for index, messages in enumerate(conversations):
                messages.append({"role": "user", "content": f"turn {turn}: and then?"})
                before = [_finished(r) for r in replicas]
                messages.append({"role": "assistant", "content": _chat(router.url, messages)})
                served[index].append(_served_by(replicas, before))
        assert served == [[home, home] for home in homes], (served, router.log.read_text()[-2000:])
        # Each later turn re-used the blocks its home replica computed.
        hits_after = [_counters(r)["prefix_cache_hit_tokens"] for r in replicas]
        for before_hits, after_hits in zip(hits_before, hits_after, strict=True):
            assert after_hits - before_hits >= 6 * 5 * 16  # 3 x 2 turns, >= 5 blocks each


def _stream_request(messages: list[dict[str, str]], max_tokens: int) -> ChatRequest:
    return ChatRequest(NAME, messages, max_tokens, temperature=0.0, ignore_eos=True)


async def _stream(
    client: httpx.AsyncClient, url: str, request: ChatRequest, t0: float
) -> RequestRecord:
    record = RequestRecord(0, 0, time.perf_counter() - t0)
    return await stream_chat(client, f"{url}/v1/chat/completions", request, record, t0)


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(CLIENT_TIMEOUT_S, connect=5.0))


async def _until_running(
    replica: Replica, other: Replica, streams: list[asyncio.Task[RequestRecord]]
) -> None:
    """Wait until every stream in ``streams`` runs on ``replica`` (none may end first)."""
    deadline = time.monotonic() + 20
    while _counters(replica).get("num_running", 0) < len(streams):
        ended = [(t.result().status, t.result().error) for t in streams if t.done()]
        assert time.monotonic() < deadline and not ended, (
            f"the streams did not reach the replica: {ended}, "
            f"{_counters(replica)}, {_counters(other)}"
        )
        await asyncio.sleep(0.05)


def test_sigterm_drain_finishes_streams_and_takes_no_new_request(
    group: ReplicaGroup, tmp_path: Path
) -> None:
    survivor, drained = group.replicas[0], group.replicas[1]
    assert drained.managed is not None
    openings = [_opening(100 + i, words=40) for i in range(4)]

    async def scenario(router: Router) -> None:
        t0 = time.perf_counter()
        async with _client() as client:
            # One stream through the router (its prefix is on the replica: it lands there),
            # then, once it runs there, one straight to it (sent at once, the router's load
            # balancing could send the first elsewhere).
            streams: list[asyncio.Task[RequestRecord]] = []
            for url, messages in ((router.url, openings[0]), (drained.url, openings[1])):
                request = _stream_request(messages, LONG)
                streams.append(asyncio.create_task(_stream(client, url, request, t0)))
                await _until_running(drained, survivor, streams)
            before = _finished(survivor)
            drained.managed.process.terminate()  # SIGTERM: kvserve drains
            await asyncio.sleep(0.5)
            # /health of a draining replica: uvicorn closed the listener at once.
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{drained.url}/health", timeout=2.0)
            # New requests, two of them with their prefix on the draining replica.
            fresh = [_stream_request(openings[i], 8) for i in (2, 3)]
            fresh.append(_stream_request(_opening(200), 8))
            new = await asyncio.gather(*(_stream(client, router.url, r, t0) for r in fresh))
            assert [r.status for r in new] == ["ok"] * 3, [r.error for r in new]
            draining_after_new = drained.managed.alive()
            assert _finished(survivor) == before + 3
            done = await asyncio.gather(*streams)
        assert draining_after_new, "the streams ended before the new requests: inconclusive"
        for record in done:
            assert record.status == "ok", record.error
            assert record.finish_reason == "length" and record.completion_tokens == LONG

    with _router([survivor, drained], "kv_aware", tmp_path) as router:
        # Opened after the router subscribed to the events (as in the kv_aware test): a
        # router started later never hears of these blocks and may balance the stream away.
        for messages in openings:  # their blocks live on the replica about to drain
            messages.append({"role": "assistant", "content": _chat(drained.url, messages)})
            messages.append({"role": "user", "content": "go on"})
        time.sleep(1.0)  # the events travel over ZMQ: give the router's index a moment
        asyncio.run(scenario(router))
    assert drained.managed.process.wait(timeout=30) == 0


def test_sigkill_under_load_fails_fast_and_the_survivor_serves(
    group: ReplicaGroup, tmp_path: Path
) -> None:
    survivor, victim = group.replicas[0], group.replicas[2]
    assert victim.managed is not None
    records: list[RequestRecord] = []

    async def worker(
        client: httpx.AsyncClient, url: str, index: int, t0: float, stop: float
    ) -> None:
        turn = 0
        while time.perf_counter() - t0 < stop:
            messages = _opening(300 + index * 100 + turn, words=30)
            records.append(await _stream(client, url, _stream_request(messages, 200), t0))
            turn += 1

    async def scenario(router: Router) -> float:
        t0 = time.perf_counter()
        async with _client() as client:
            load = asyncio.gather(*(worker(client, router.url, i, t0, 9.0) for i in range(6)))
            deadline = time.monotonic() + 20
            while _counters(victim).get("num_running", 0) < 1:
                assert time.monotonic() < deadline, "no request reached the victim"
                await asyncio.sleep(0.05)
            before = _finished(survivor)
            victim.managed.process.kill()  # SIGKILL
            kill_t = time.perf_counter() - t0
            await asyncio.wait_for(load, timeout=9.0 + CLIENT_TIMEOUT_S)
            assert _finished(survivor) > before
        return kill_t

    with _router([survivor, victim], "round_robin", tmp_path) as router:
        kill_t = asyncio.run(scenario(router))
    failed = [r for r in records if r.status != "ok"]
    after = [r for r in records if r.start > kill_t + 1.0]
    assert failed, "no request was in flight on the killed replica"
    # Failures are the requests the victim held when it died, and they ended promptly.
    assert all(r.start <= kill_t + 0.5 for r in failed), [(r.start, r.status) for r in failed]
    assert all(r.end is not None and r.end - kill_t < 10.0 for r in failed)
    assert all(r.end is not None and r.e2e is not None for r in records)
    assert max(r.e2e or 0 for r in records) < CLIENT_TIMEOUT_S
    # The survivor served everything sent after the kill.
    assert len(after) >= 3 and all(r.status == "ok" for r in after), [r.status for r in after]
