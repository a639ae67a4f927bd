"""What every part of the scheduler reads and moves requests through.

``SchedulerState`` holds the request queues (queues.py), the running and loading lists,
the ``n > 1`` groups (groups.py), the KV manager and the counters; the parts in this
package are functions over it, and ``engine.scheduler.Scheduler`` is it plus the step
loop. Each live request is in exactly one of: running, loading, swapped, waiting, or a
group's unforked children (``check_integrity``).
"""

from __future__ import annotations

from collections import deque

from engine.config import CacheConfig, SchedulerConfig
from engine.kv.accounting import KVShape
from engine.kv.manager import KVCacheManager, PrefixHit
from engine.kv.stats import StatsCounters
from engine.request import Request, RequestStatus
from engine.sched.groups import SequenceGroups
from engine.sched.queues import RequestQueues
from engine.speculative.drafts import Speculator
from engine.step_cost import StepCost


class SchedulerState:
    """The scheduler's requests, blocks and counters; see the module docstring."""

    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, kv_shape: KVShape
    ) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.kv_shape = kv_shape
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(cache_config, kv_shape.groups)
        self.queues = RequestQueues(scheduler_config)
        self.running: list[Request] = []
        # Admitted with a prefix to load back from a tier (engine/kv/tiers.py): not
        # computing this step; finish_loads() moves them to running. Request id -> its hit.
        self.loading: list[Request] = []
        self.loads: dict[str, PrefixHit] = {}
        self.live: dict[str, Request] = {}  # every live request, by id
        self.groups = SequenceGroups()
        self.finished_ids: list[str] = []
        self.counters = StatsCounters()
        self.step_cost = StepCost()
        spec = scheduler_config.speculative
        self.speculator = Speculator(spec) if spec is not None else None

    @property
    def waiting(self) -> deque[Request]:
        return self.queues.waiting

    @property
    def swapped(self) -> deque[Request]:
        return self.queues.swapped

    @property
    def _requests(self) -> dict[str, Request]:
        """The live requests by id, under the name tests of the engine read it by."""
        return self.live

    def retire(self, request: Request, status: RequestStatus) -> None:
        """End a request: free its blocks, forget its drafts, report it finished. The
        caller has taken it out of its queue."""
        request.status = status
        self.kv.free(request)
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        del self.live[request.request_id]
        self.finished_ids.append(request.request_id)

    def check_integrity(self) -> None:
        """Assert the block invariants and that every queue holds requests in its state."""
        kv = self.kv
        kv.check_integrity()
        for request in self.running:
            assert request.status is RequestStatus.RUNNING, request
            assert kv.has_tables(request.request_id), request
        for request in self.swapped:
            assert request.status is RequestStatus.SWAPPED, request
            assert kv.has_host_tables(request.request_id), request
        for request in self.waiting:
            assert request.status is RequestStatus.WAITING, request
            assert not kv.has_tables(request.request_id), request
        for request in self.loading:
            assert request.status is RequestStatus.LOADING, request
            assert kv.has_tables(request.request_id), request
        assert len(self.loads) == len(self.loading), "a load is planned for no request"
        queued = len(self.running) + len(self.swapped) + len(self.waiting)
        queued += len(self.loading) + self.groups.total_unforked()
        assert queued == len(self.live), "a live request is in no queue, or in two"
