"""Queue policy: the waiting and swapped queues, the order they are served in, and room.

Both queues are kept sorted by the queue key (priority, arrival time) -- priorities count
under the ``priority`` policy only -- so admission reads them front to back and merges
them lazily (``merged``: swapped first on a tie). A new request goes after its equals and a
preempted one before them. The waiting queue's token sum is kept with every move, so the
room check on ``add`` and the queue timeouts never walk the queue.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from engine.config import SchedulerConfig
from engine.errors import RequestRejected
from engine.request import Request


class RequestQueues:
    """The waiting and swapped queues under one ordering policy."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.swapped: deque[Request] = deque()
        self.queued_tokens = 0  # tokens of the waiting queue, kept with every move
        # Never-scheduled requests in add order, for queue timeouts; entries that were
        # scheduled or ended since are dropped lazily when they reach the front.
        self._unscheduled: deque[Request] = deque()
        self._arrivals = itertools.count()  # tie-break of equal queue keys: add order
        self._by_priority = config.scheduling_policy == "priority"

    def key(self, request: Request) -> tuple[int, float]:
        """The order of swap-ins and admissions (and, reversed, of preemption victims):
        (priority, arrival); under ``fcfs`` priorities are ignored."""
        return (request.priority if self._by_priority else 0, request.arrival_time)

    def stamp_arrival(self, request: Request) -> None:
        """Give a new request its place among equal keys (add order)."""
        request.arrival_seq = next(self._arrivals)

    def check_room(self, parent: Request) -> None:
        """Raise ``RequestRejected`` when the queue is full by count or by prompt tokens."""
        max_requests = self.config.max_queued_requests
        if max_requests and len(self.waiting) >= max_requests:
            raise RequestRejected(
                "queue_full", f"{len(self.waiting)} requests are already queued; retry later"
            )
        max_tokens = self.config.max_queued_tokens
        if max_tokens:
            queued = self.queued_tokens
            if queued + parent.num_prompt_tokens > max_tokens:
                raise RequestRejected(
                    "queue_full",
                    f"{queued} prompt tokens are already queued (limit {max_tokens}); retry later",
                )

    def add_new(self, request: Request) -> None:
        """Queue a request that was never scheduled (it counts for queue timeouts)."""
        self.enqueue_waiting(request, front=False)
        self._unscheduled.append(request)

    def enqueue_waiting(self, request: Request, front: bool) -> None:
        """Insert by queue key: a new request after its equals, a preempted one before
        them. New requests arrive last, so the scan from the back is short."""
        waiting = self.waiting
        key = self.key(request)
        index = len(waiting)
        if front:
            index = 0
            while index < len(waiting) and self.key(waiting[index]) < key:
                index += 1
        else:
            while index > 0 and self.key(waiting[index - 1]) > key:
                index -= 1
        waiting.insert(index, request)
        self.queued_tokens += request.num_tokens

    def remove_waiting(self, request: Request) -> None:
        self.waiting.remove(request)
        self.queued_tokens -= request.num_tokens

    def enqueue_swapped(self, request: Request) -> None:
        swapped = self.swapped
        key = self.key(request)
        index = len(swapped)
        while index > 0 and self.key(swapped[index - 1]) > key:
            index -= 1
        swapped.insert(index, request)

    def merged(self) -> Iterator[Request]:
        """Swapped and waiting requests merged by queue key (swapped first on a tie),
        lazily: a step reads only as far as it admits."""
        key = self.key
        swapped = ((key(r), 0, r.arrival_seq, r) for r in self.swapped)
        waiting = ((key(r), 1, r.arrival_seq, r) for r in self.waiting)
        return (entry[3] for entry in heapq.merge(swapped, waiting))

    def unscheduled_older_than(self, cutoff: float) -> list[Request]:
        """Waiting requests never scheduled that arrived before ``cutoff`` (monotonic
        seconds), oldest first. Cost: the expired ones plus the stale entries dropped, not
        the queue length (arrivals are in add order)."""
        pending = self._unscheduled
        while pending and (pending[0].first_scheduled_time is not None or pending[0].is_finished):
            pending.popleft()
        expired = []
        for request in pending:
            if request.arrival_time >= cutoff:
                break
            if request.first_scheduled_time is None and not request.is_finished:
                expired.append(request)
        return expired
