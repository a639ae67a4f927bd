"""KV events over ZMQ from a live server (--kv-events-config): a real SUB socket decodes
the batches in vLLM's layout; the ids are the request's; parents chain; a tiny pool
evicts; the host tier changes the medium; the replay socket fills a gap."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from engine.config import KVEventsConfig
from server.settings import ServerSettings
from tests.server.conftest import TINY_MODEL_NAME, LiveServer, build_tiny, live_server
from tests.unit.test_kv_events import VllmEventBatch

BLOCK = 16
TOPIC = b"kv@tiny"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Subscriber:
    """A SUB socket on the server's events, decoding every batch it gets."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(VllmEventBatch)
        self.batches: list[tuple[int, bytes, Any]] = []

    def drain(self, settle_s: float = 0.3) -> list[Any]:
        """Receive until nothing arrives for ``settle_s``; the new events, in order."""
        events = []
        while self.sub.poll(int(settle_s * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == TOPIC
            batch = self.decoder.decode(payload)
            self.batches.append((int.from_bytes(seq, "big"), payload, batch))
            events += batch.events
        return events

    def close(self) -> None:
        self.sub.close(linger=0)
        self.context.term()


@pytest.fixture(scope="module")
def events_server(tiny_model_dir: Path) -> Iterator[tuple[LiveServer, KVEventsConfig]]:
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://127.0.0.1:{free_port()}",
        replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
        topic=TOPIC.decode(),
    )
    # 24 blocks of 16 tokens and a host tier of a few blocks: a handful of prompts evicts.
    built = build_tiny(
        tiny_model_dir,
        num_kv_blocks=24,
        max_model_len=384,
        kv_cache_host_gib=0.0002,
        kv_events_config=config,
    )
    settings = ServerSettings(served_model_names=(TINY_MODEL_NAME,))
    with live_server(built, settings) as live:
        yield live, config


@pytest.fixture
def subscriber(events_server: tuple[LiveServer, KVEventsConfig]) -> Iterator[Subscriber]:
    sub = Subscriber(events_server[1].endpoint)
    time.sleep(0.3)  # a SUB socket sees only what is sent after it joined
    sub.drain(0.1)
    yield sub
    sub.close()


def complete(server: LiveServer, prompt: str, max_tokens: int = 1) -> dict[str, Any]:
    body = {"model": TINY_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def rendered_ids(server: LiveServer, prompt: str) -> list[int]:
    body = {"model": TINY_MODEL_NAME, "prompt": prompt}
    resp = httpx.post(f"{server.url}/v1/completions/render", json=body, timeout=60)
    return list(resp.json()[0]["token_ids"])


def stored(events: list[Any], medium: str = "GPU") -> list[Any]:
    return [e for e in events if type(e).__name__ == "BlockStoredV" and e.medium == medium]


def prompt_of(words: int, seed: int) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(words))


def test_a_request_announces_its_blocks_with_its_own_token_ids(
    events_server: tuple[LiveServer, KVEventsConfig], subscriber: Subscriber
) -> None:
    server, _ = events_server
    prompt = prompt_of(30, seed=1)
    complete(server, prompt)
    events = stored(subscriber.drain())
    ids = rendered_ids(server, prompt)
    full = (len(ids) - 1) // BLOCK  # the last token is computed with the output
    announced = [t for event in events for t in event.token_ids]
    assert len(announced) >= full * BLOCK
    assert announced[: full * BLOCK] == ids[: full * BLOCK]
    # One chain: each event's parent is the block before its first.
    chain = [h for event in events for h in event.block_hashes]
    assert events[0].parent_block_hash is None
    for event in events[1:]:
        assert event.parent_block_hash == chain[chain.index(event.block_hashes[0]) - 1]
    assert all(e.block_size == BLOCK and e.group_idx == 0 for e in events)


def test_a_tiny_pool_evicts_and_the_host_tier_takes_the_blocks(
    events_server: tuple[LiveServer, KVEventsConfig], subscriber: Subscriber
) -> None:
    server, _ = events_server
    first = prompt_of(40, seed=2)
    complete(server, first)
    for seed in range(3, 9):  # each takes half of the 24-block pool
        complete(server, prompt_of(40, seed))
    events = subscriber.drain()
    names = [(type(e).__name__, e.medium) for e in events if hasattr(e, "medium")]
    assert ("BlockRemovedV", "GPU") in names
    assert ("BlockStoredV", "CPU") in names
    host = stored(events, "CPU")
    device_tokens = {h: e for e in stored(events) for h in e.block_hashes}
    for event in host:  # a host store repeats the device store's tokens
        (block_hash,) = event.block_hashes
        if block_hash in device_tokens:
            origin = device_tokens[block_hash]
            index = origin.block_hashes.index(block_hash)
            assert list(event.token_ids) == origin.token_ids[index * BLOCK : (index + 1) * BLOCK]


def test_replay_resends_what_a_late_subscriber_missed(
    events_server: tuple[LiveServer, KVEventsConfig], subscriber: Subscriber
) -> None:
    server, config = events_server
    complete(server, prompt_of(20, seed=11))
    subscriber.drain()
    last_seq = subscriber.batches[-1][0]
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(config.replay_endpoint or "")
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed: list[tuple[int, bytes]] = []
        while dealer.poll(5000):
            _, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)
        context.term()
    seqs = [seq for seq, _ in replayed]
    assert seqs == list(range(len(seqs))) and seqs[-1] >= last_seq
    first = msgspec.msgpack.Decoder(VllmEventBatch).decode(replayed[0][1])
    assert type(first.events[0]).__name__ == "AllBlocksClearedV"  # seq 0: a fresh replica
    live = {seq: payload for seq, payload, _ in subscriber.batches}
    for seq, payload in replayed:
        if seq in live:
            assert live[seq] == payload
