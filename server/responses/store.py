"""Stored responses, for ``previous_response_id``, ``GET`` / ``DELETE`` and ``/cancel``.

A bounded in-memory LRU by response id: at most ``max_responses`` responses and
``max_bytes`` bytes of them (their JSON and the conversation kept for continuing it,
measured as UTF-8 JSON when stored). Storing, reading or continuing a response makes it
the most recent; past either bound the least recently used go first. Evictions, misses
(an id not, or no longer, stored) and the current count and bytes are in /metrics
(``kvserve_responses_*``). A miss is a 404 in OpenAI's shape. Nothing survives a restart.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StoredResponse:
    """A response and what continuing it needs: the chat messages of its conversation
    (its input history and its own output), and its input items as sent."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    input_items: list[dict[str, Any]] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class StoreCounters:
    evicted: int = 0
    misses: int = 0


class ResponseStore:
    def __init__(self, max_responses: int = 1024, max_bytes: int = 64 * 1024 * 1024) -> None:
        if max_responses < 0 or max_bytes < 0:
            raise ValueError("the response store's bounds must be >= 0")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.counters = StoreCounters()
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, stored: StoredResponse) -> None:
        """Store (or replace) a response; evict the least recently used past the bounds.
        One larger than ``max_bytes`` alone is not kept."""
        response_id = stored.response["id"]
        self._drop(response_id)
        stored.nbytes = _json_bytes(stored.response, stored.messages, stored.input_items)
        self._entries[response_id] = stored
        self._bytes += stored.nbytes
        while self._entries and (
            len(self._entries) > self.max_responses or self._bytes > self.max_bytes
        ):
            oldest = next(iter(self._entries))
            self._drop(oldest)
            self.counters.evicted += 1

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._entries.get(response_id)
        if stored is None:
            self.counters.misses += 1
            return None
        self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        stored = self._entries.pop(response_id, None)
        if stored is None:
            return False
        self._bytes -= stored.nbytes
        return True


def _json_bytes(*values: Any) -> int:
    return sum(len(json.dumps(v, ensure_ascii=False).encode()) for v in values)
