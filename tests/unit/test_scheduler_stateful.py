"""Random add/abort/step sequences on small pools; invariants after every step.

Pools of 8-64 blocks of 1-16 tokens, every preemption mode and admission policy, a host
pool or none, tiny token budgets. After every step ``check_integrity()`` must hold; at the
end every block is free or cached-free, every request that was not aborted has finished,
and its tokens equal plain uncached generation of the deterministic fake model.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.config import CacheConfig, SchedulerConfig
from engine.core import EngineCore
from engine.errors import RequestRejected
from engine.kv.accounting import KVShape, blocks_for_tokens
from engine.request import Request, SamplingParams
from engine.scheduler import Scheduler
from tests.unit.fakes import FakeKVRunner, PrefixHashModel, drive, expected_for, make_group

SHAPE = KVShape(num_layers=1, num_kv_heads=1, head_dim=4, kv_dtype="float32")
MAX_MODEL_LEN = 64
SHARED_PREFIX = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 3, 7, 1, 9, 2, 8, 3, 6, 5, 4]


class SchedulerMachine(RuleBasedStateMachine):
    """Drives an EngineCore with a FakeKVRunner through random operations."""

    def __init__(self) -> None:
        super().__init__()
        self.model = PrefixHashModel(vocab_size=32)
        self.groups: dict[str, list[Request]] = {}
        self.expected: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.aborted: set[str] = set()
        self.counter = 0

    @initialize(
        blocks=st.integers(8, 64),
        block_size=st.integers(1, 16),
        host=st.sampled_from([0, 4, 32]),
        mode=st.sampled_from(["recompute", "swap", "auto"]),
        policy=st.sampled_from(["optimistic", "reserve"]),
        budget=st.integers(1, 48),
        max_seqs=st.integers(1, 8),
        caching=st.booleans(),
        watermark=st.sampled_from([0.0, 0.1]),
    )
    def setup(
        self,
        blocks: int,
        block_size: int,
        host: int,
        mode: str,
        policy: str,
        budget: int,
        max_seqs: int,
        caching: bool,
        watermark: float,
    ) -> None:
        self.sched_config = SchedulerConfig(
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            preemption_mode=mode,  # type: ignore[arg-type]
            admission_policy=policy,  # type: ignore[arg-type]
            swap_min_tokens=6,
        )
        self.cache_config = CacheConfig(
            num_device_blocks=blocks,
            block_size=block_size,
            num_host_blocks=host,
            enable_prefix_caching=caching,
            watermark=watermark,
        )
        scheduler = Scheduler(self.sched_config, self.cache_config, SHAPE)
        self.core = EngineCore(scheduler, FakeKVRunner(blocks, block_size, host, self.model))

    @rule(
        shared=st.integers(0, len(SHARED_PREFIX)),
        tail=st.lists(st.integers(1, 31), min_size=0, max_size=30),
        max_tokens=st.integers(1, 24),
        n=st.integers(1, 3),
        priority=st.integers(0, 2),
        min_tokens=st.integers(0, 2),
    )
    def add(
        self, shared: int, tail: list[int], max_tokens: int, n: int, priority: int, min_tokens: int
    ) -> None:
        self.counter += 1
        gid = f"g{self.counter}"
        params = SamplingParams(
            max_tokens=max_tokens, n=n, seed=self.counter, min_tokens=min_tokens
        )
        prompt = SHARED_PREFIX[:shared] + tail
        group = make_group(
            gid, prompt, params, eos=(0,), priority=priority, arrival_time=float(self.counter)
        )
        try:
            self.core.add_request(group)
        except RequestRejected as rejected:
            self._assert_rejection_is_justified(group, rejected)
            return
        self.groups[gid] = group
        self.expected.update(expected_for(group, self.model, self.sched_config))

    def _assert_rejection_is_justified(self, group: list[Request], error: RequestRejected) -> None:
        prompt_len = group[0].num_prompt_tokens
        if error.reason == "empty_prompt":
            assert prompt_len == 0
        elif error.reason == "too_long":
            assert prompt_len >= MAX_MODEL_LEN
        else:
            assert error.reason == "no_capacity", error.reason
            final = min(prompt_len + group[0].sampling_params.max_tokens, MAX_MODEL_LEN)
            usable = self.cache_config.num_device_blocks - self.cache_config.watermark_blocks
            assert blocks_for_tokens(final, self.cache_config.block_size) > usable or (
                self.sched_config.admission_policy == "reserve" and len(group) > 1
            )

    @precondition(lambda self: bool(self.groups))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        gid = data.draw(st.sampled_from(sorted(self.groups)))
        self.core.abort(gid)
        self.aborted.add(gid)

    @rule()
    def step(self) -> None:
        for delta in self.core.step():
            self.outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)

    @invariant()
    def blocks_are_consistent(self) -> None:
        if hasattr(self, "core"):
            self.core.scheduler.check_integrity()
            stats = self.core.stats()
            pool = stats.device_blocks
            assert pool.used + pool.free + pool.cached == pool.total
            if self.sched_config.admission_policy == "reserve":
                assert sum(stats.preemptions_total.values()) == 0, "reserve never preempts"

    def teardown(self) -> None:
        if not hasattr(self, "core"):
            return
        for request_id, tokens in drive(self.core).items():
            self.outputs.setdefault(request_id, []).extend(tokens)
        stats = self.core.stats()
        assert stats.device_blocks.used == 0 and stats.host_blocks.used == 0
        kv = self.core.scheduler.kv
        assert not kv.tables and not kv.host_tables, "a finished request kept a block table"
        for gid, group in self.groups.items():
            for request in group:
                assert request.is_finished
                if gid not in self.aborted:
                    rid = request.request_id
                    assert self.outputs.get(rid, []) == self.expected[rid], rid


SchedulerMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerStateful = SchedulerMachine.TestCase
