"""KV events on the wire, as vLLM publishes them: a ZMQ PUB socket and a replay socket.

``--kv-events-config`` takes vLLM's JSON (``KVEventsConfig``); with
``enable_kv_cache_events`` and the ``zmq`` publisher, one thread owns both sockets:

* every batch of events the recorder (engine/kv/events.py) collected goes out on the PUB
  socket at ``endpoint`` as three frames: ``topic``, the batch's sequence number (8 bytes,
  big-endian, from 0) and the msgpack ``EventBatch``: ``[ts, events, data_parallel_rank]``
  (vLLM's ``array_like`` batch), each event a map tagged ``"type": "BlockStored"`` /
  ``"BlockRemoved"`` / ``"AllBlocksCleared"`` with vLLM's field names, ``None`` defaults
  left out (``omit_defaults``), as vLLM 0.28 encodes them with msgspec;
* the last ``buffer_steps`` batches are kept, and a client that saw a gap in the sequence
  asks the ROUTER socket at ``replay_endpoint`` for everything from a sequence number:
  it sends ``[b"", start (8 bytes, big-endian)]`` and gets ``[b"", seq, payload]`` for
  each kept batch from ``start`` on, then ``[b"", -1 (8 bytes, signed), b""]``.

The first batch is ``AllBlocksCleared``: a router that knew a previous process at this
address drops what it believed that process held. PUB drops what a slow subscriber
cannot take (past ``hwm`` messages), as in vLLM; the replay socket is how it catches up.
A step never waits for any of this: the recorder is drained by the publisher's thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from engine.config import KVEventsConfig
from engine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventRecorder

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# How long the publisher waits for events before it looks at the replay socket again.
POLL_S = 0.02


class ZmqEventPublisher:
    """Publishes the recorder's events until ``close``; see the module docstring."""

    def __init__(self, recorder: KVEventRecorder, config: KVEventsConfig) -> None:
        self.recorder = recorder
        self.config = config
        self.published_batches = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, config.buffer_steps))
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def start(self, timeout_s: float = 10.0) -> None:
        """Bind the sockets (a bind error is raised here) and start publishing."""
        self.recorder.cleared()
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError("the KV event publisher did not start")
        if self._error is not None:
            raise RuntimeError(f"KV events: {self._error}") from self._error

    def close(self, timeout_s: float = 5.0) -> None:
        """Publish what is pending, then stop and close the sockets."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        import zmq

        context = zmq.Context()
        try:
            pub, replay = self._bind(context)
        except Exception as exc:  # zmq.ZMQError: address in use, bad endpoint
            self._error = exc
            self._ready.set()
            context.term()
            return
        self._ready.set()
        encoder = WireEncoder()
        seq = 0
        try:
            while True:
                stopping = self._stop.is_set()
                events = self.recorder.take(None if stopping else POLL_S)
                if events:
                    payload = encoder.batch(events)
                    frames = [self.config.topic.encode(), seq.to_bytes(8, "big"), payload]
                    pub.send_multipart(frames)
                    self._buffer.append((seq, payload))
                    seq += 1
                    self.published_batches += 1
                if replay is not None:
                    self._serve_replays(replay)
                if stopping:
                    return
        finally:
            pub.close(linger=500)
            if replay is not None:
                replay.close(linger=0)
            context.term()

    def _bind(self, context: Any) -> tuple[Any, Any]:
        import zmq

        pub = context.socket(zmq.PUB)
        pub.set_hwm(self.config.hwm)
        try:
            pub.bind(self.config.endpoint)
        except Exception:
            pub.close(linger=0)
            raise
        replay = None
        if self.config.replay_endpoint:
            replay = context.socket(zmq.ROUTER)
            try:
                replay.bind(self.config.replay_endpoint)
            except Exception:
                pub.close(linger=0)
                replay.close(linger=0)
                raise
        logger.info(
            "KV events: publishing on %s (replay: %s, topic %r)",
            self.config.endpoint,
            self.config.replay_endpoint or "off",
            self.config.topic,
        )
        return pub, replay

    def _serve_replays(self, replay: Any) -> None:
        """Answer every waiting replay request: the kept batches from its start on."""
        import zmq

        while replay.poll(0, zmq.POLLIN):
            frames = replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("KV events: a malformed replay request was ignored")
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            replay.send_multipart([client, b"", END_SEQ, b""])


class WireEncoder:
    """Events as vLLM's msgspec structs encode them (msgpack)."""

    def __init__(self) -> None:
        import msgspec

        self._encode = msgspec.msgpack.Encoder().encode
        self._structs = _wire_structs()

    def batch(self, events: list[KVEvent], ts: float | None = None) -> bytes:
        batch_type, stored, removed, cleared = self._structs
        wire = []
        for event in events:
            if isinstance(event, BlockStored):
                wire.append(
                    stored(
                        block_hashes=list(event.block_hashes),
                        parent_block_hash=event.parent_block_hash,
                        token_ids=list(event.token_ids),
                        block_size=event.block_size,
                        lora_id=None,
                        medium=event.medium,
                        lora_name=None,
                        extra_keys=None if event.extra_keys is None else list(event.extra_keys),
                        group_idx=event.group_idx,
                        kv_cache_spec_kind=event.kv_cache_spec_kind,
                        kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
                    )
                )
            elif isinstance(event, BlockRemoved):
                wire.append(
                    removed(
                        block_hashes=list(event.block_hashes),
                        medium=event.medium,
                        group_idx=event.group_idx,
                    )
                )
            elif isinstance(event, AllBlocksCleared):
                wire.append(cleared())
        stamp = time.time() if ts is None else ts
        return self._encode(batch_type(ts=stamp, events=wire, data_parallel_rank=0))


def _wire_structs() -> tuple[type, type, type, type]:
    """vLLM 0.28's struct layouts, built when msgspec is first needed."""
    import msgspec

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class WireEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class WireStored(WireEvent, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[Any] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class WireRemoved(WireEvent, tag="BlockRemoved"):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None

    class WireCleared(WireEvent, tag="AllBlocksCleared"):
        pass

    return EventBatch, WireStored, WireRemoved, WireCleared
