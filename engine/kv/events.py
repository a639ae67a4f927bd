"""KV cache events: which prefix blocks this replica holds, and where, as they change.

A router that sends each request where its prefix is cached (vllm-router's ``kv_aware``,
llm-d's precise prefix scorer, Dynamo's KV router) keeps an index of every replica's
blocks from these events. They mirror vLLM's (``vllm/distributed/kv_events.py``):

* ``BlockStored``: blocks a medium now holds, consecutive blocks of one prefix in one
  event: their hashes, the hash of the block before the first (None at a prompt's start),
  their token ids (``block_size`` per block), the medium and the KV group.
* ``BlockRemoved``: blocks a medium no longer holds.
* ``AllBlocksCleared``: the replica holds nothing (it just started).

The medium says which tier: ``GPU`` is the device pool (vLLM's name for the engine's own KV
memory, on a CPU server too), ``CPU`` the host tier and ``DISK`` the disk tier
(engine/kv/tiers.py), so a router sees a demotion as a store a tier down and a removal
from the one above, and can credit a host hit below a device hit.

``KVEventRecorder`` is what the cache reports to: the KV manager when it registers a
computed block, the pools when they drop a hash, the tiers when they take or lose one, and
the disk store when a file is published, adopted from a peer process sharing the
directory, or deleted or found gone; so it is thread-safe.
A tier store is announced with the token ids the device store recorded (``_Held``, kept
while any medium holds the block, and for the ``recent`` blocks last held by none: a disk
write lands after the host tier let the block go): a router indexes blocks by their
tokens, not by kvserve's hashes, which are opaque keys for chaining and removal. A block
found on disk at start-up has no recorded tokens and is announced when it is next loaded
and stored.
The publisher (engine/kv/event_publisher.py) drains the recorder from its own thread;
nothing here blocks a step.

Hashes on the wire are vLLM's default integer form: the low 64 bits of the block's
digest, without kvserve's group suffix (the group rides in ``group_idx``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.kv.block_pool import BlockHash
from engine.kv.groups import KVGroup
from engine.kv.hashing import DIGEST_SIZE

MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"
MEDIUM_DISK = "DISK"
MEDIUMS = (MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_DISK)
# Blocks whose tokens are kept after the last medium dropped them: enough for the disk
# writes in flight (its queue holds 64) many times over, ~6 MB at 16 tokens a block.
DEFAULT_RECENT = 16384
# Events waiting for the publisher, at most (vLLM's max_queue_size); more are dropped.
DEFAULT_MAX_PENDING = 100_000
FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str
    group_idx: int
    kv_cache_spec_kind: str
    kv_cache_spec_sliding_window: int | None = None
    # vLLM's per-block extra keys: the cache salt of a prompt's first block, else None.
    extra_keys: tuple[tuple[str, ...] | None, ...] | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str
    group_idx: int


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def split_key(key: BlockHash) -> tuple[BlockHash, int]:
    """A prefix-cache key as (block hash, KV group): kvserve tags the hash of a block of
    group g > 0 with g (engine/kv/manager.py's ``group_key``)."""
    if len(key) <= DIGEST_SIZE:
        return key, 0
    return key[:DIGEST_SIZE], int.from_bytes(key[DIGEST_SIZE:], "little")


def external_hash(block_hash: BlockHash) -> int:
    """vLLM's integer block hash: the digest's low 64 bits, unsigned."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass
class _Held:
    """What a store of this block a tier down must announce, and which media hold it."""

    parent: BlockHash | None
    token_ids: tuple[int, ...]
    salt: str | None
    media: set[str] = field(default_factory=set)


class KVEventRecorder:
    """Collects events as the cache changes; ``take`` hands them to the publisher."""

    def __init__(
        self,
        block_size: int,
        groups: Sequence[KVGroup] = (),
        *,
        max_pending: int = DEFAULT_MAX_PENDING,
        recent: int = DEFAULT_RECENT,
    ) -> None:
        self.block_size = block_size
        self._max_pending = max_pending
        self.dropped = 0  # events dropped while max_pending were waiting (vLLM's queue)
        self._windows = tuple(group.window for group in groups) or (None,)
        self._lock = threading.Condition()
        self._events: list[KVEvent] = []
        self._held: dict[BlockHash, _Held] = {}
        # Blocks no medium holds any more, newest last, kept for a late tier store.
        self._recent: OrderedDict[BlockHash, _Held] = OrderedDict()
        self._max_recent = recent
        self.unannounced = 0  # tier stores of blocks whose tokens were never recorded

    # -- what the cache reports ---------------------------------------------------------

    def stored(
        self,
        keys: Sequence[BlockHash],
        parent: BlockHash | None,
        token_ids: Sequence[int],
        salt: str | None = None,
    ) -> None:
        """The device pool registered consecutive blocks of one group (``keys``, their
        ``token_ids`` back to back; ``parent`` the key before the first, ``salt`` the cache
        salt when the first is a prompt's first block)."""
        if not keys:
            return
        size = self.block_size
        with self._lock:
            previous = parent
            for index, key in enumerate(keys):
                tokens = tuple(token_ids[index * size : (index + 1) * size])
                held = self._find(key)
                if held is None:
                    held = self._held[key] = _Held(previous, tokens, salt if index == 0 else None)
                held.media.add(MEDIUM_DEVICE)
                previous = key
            first_salt = salt if parent is None else None
            self._append(
                self._stored_event(keys, parent, tuple(token_ids), MEDIUM_DEVICE, first_salt)
            )

    def copied(self, medium: str, key: BlockHash) -> None:
        """A tier (host or disk) now holds the block under ``key``."""
        with self._lock:
            held = self._find(key)
            if held is None:
                self.unannounced += 1
                return
            if medium in held.media:
                return
            held.media.add(medium)
            salt = held.salt if held.parent is None else None
            self._append(self._stored_event([key], held.parent, held.token_ids, medium, salt))

    def removed(self, medium: str, key: BlockHash) -> None:
        """``medium`` no longer holds the block under ``key``."""
        with self._lock:
            held = self._held.get(key)
            if held is None or medium not in held.media:
                return
            held.media.discard(medium)
            if not held.media:
                self._forget(key)
            block_hash, group = split_key(key)
            self._append(BlockRemoved((external_hash(block_hash),), medium, group))

    def cleared(self) -> None:
        """The replica holds no block on any medium."""
        with self._lock:
            for key in list(self._held):
                self._held[key].media.clear()
                self._forget(key)
            self._append(AllBlocksCleared())

    # -- what the publisher takes ----------------------------------------------------------

    def take(self, timeout_s: float | None = None) -> list[KVEvent]:
        """Every event since the last call, in order, consecutive removals of one medium
        and group merged; waits up to ``timeout_s`` for the first (None: do not wait)."""
        with self._lock:
            if not self._events and timeout_s:
                self._lock.wait(timeout_s)
            events, self._events = self._events, []
        return _merge_removals(events)

    def holds(self, key: BlockHash) -> frozenset[str]:
        """The media holding ``key`` as announced so far (tests and /ui)."""
        with self._lock:
            held = self._held.get(key)
            return frozenset(held.media) if held else frozenset()

    # -- internals ----------------------------------------------------------------------------

    def _find(self, key: BlockHash) -> _Held | None:
        """The block's record, brought back from ``_recent`` when no medium held it."""
        held = self._held.get(key)
        if held is None:
            held = self._recent.pop(key, None)
            if held is not None:
                self._held[key] = held
        return held

    def _forget(self, key: BlockHash) -> None:
        self._recent[key] = self._held.pop(key)
        while len(self._recent) > self._max_recent:
            self._recent.popitem(last=False)

    def _append(self, event: KVEvent) -> None:
        if not self._events:
            self._lock.notify_all()
        elif len(self._events) >= self._max_pending:  # the publisher is stuck
            self.dropped += 1
            return
        self._events.append(event)

    def _stored_event(
        self,
        keys: Sequence[BlockHash],
        parent: BlockHash | None,
        token_ids: tuple[int, ...],
        medium: str,
        salt: str | None,
    ) -> BlockStored:
        _, group = split_key(keys[0])
        window = self._windows[group] if group < len(self._windows) else None
        extra = None
        if salt is not None:
            extra = ((salt,), *([None] * (len(keys) - 1)))
        return BlockStored(
            block_hashes=tuple(external_hash(split_key(key)[0]) for key in keys),
            parent_block_hash=None if parent is None else external_hash(split_key(parent)[0]),
            token_ids=token_ids,
            block_size=self.block_size,
            medium=medium,
            group_idx=group,
            kv_cache_spec_kind=FULL_ATTENTION if window is None else SLIDING_WINDOW,
            kv_cache_spec_sliding_window=window,
            extra_keys=extra,
        )


def _merge_removals(events: list[KVEvent]) -> list[KVEvent]:
    merged: list[KVEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if (
            isinstance(event, BlockRemoved)
            and isinstance(last, BlockRemoved)
            and (last.medium, last.group_idx) == (event.medium, event.group_idx)
        ):
            merged[-1] = BlockRemoved(
                last.block_hashes + event.block_hashes, last.medium, last.group_idx
            )
        else:
            merged.append(event)
    return merged
