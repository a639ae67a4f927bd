"""Fake runners for scheduler tests: no torch, but real paged-KV semantics.

``PrefixHashModel`` is a deterministic "language model": the next token is a hash of the
whole prefix (and the sequence's seed). ``FakeKVRunner`` executes a ``SchedulerOutput``
against simulated device and host block pools that store token ids in slots: it applies
swaps and copies, writes the scheduled tokens into their slots, and computes each sampled
token from what it *reads back from the blocks*. Any bookkeeping bug (a wrong prefix hit,
a missed copy-on-write, a bad swap) changes the tokens, so comparing against
``reference_tokens`` (plain generation without any cache) catches it.

With KV groups (``windows``: one entry per group, None = full attention) every group has
its own block table: each token is written into every group's block, a full group reads
the whole prefix back and a sliding group only its window. The next token is computed
from those reads; a read that disagrees with the sequence (a block released or reused too
early, a wrong prefix hit in one group) yields a poisoned token, so the output differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b

from engine.config import SchedulerConfig
from engine.core import EngineCore
from engine.outputs import NULL_BLOCK, RunnerOutput, ScheduledRequest, SchedulerOutput, TierOp
from engine.request import Request, SamplingParams


@dataclass(frozen=True)
class PrefixHashModel:
    """next token = hash(prefix, seed) mod vocab_size; token ``eos`` ends sequences."""

    vocab_size: int = 64
    eos: int = 0

    def next_token(self, prefix: Sequence[int], seed: int | None) -> int:
        digest = blake2b(repr((tuple(prefix), seed)).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % self.vocab_size


class FakeKVRunner:
    """Runs steps on simulated KV pools of token ids (``None`` = never written)."""

    def __init__(
        self,
        num_device_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        model: PrefixHashModel | None = None,
        windows: Sequence[int | None] = (None,),
    ) -> None:
        self.block_size = block_size
        self.windows = tuple(windows)
        self.model = model or PrefixHashModel()
        self.device = _empty_blocks(num_device_blocks, block_size)
        self.host = _empty_blocks(num_host_blocks, block_size)
        self.steps: list[SchedulerOutput] = []
        # Most blocks a one-token decode found in one sliding group's table.
        self.max_window_blocks = 0

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self.steps.append(scheduler_output)
        self._note_window_blocks(scheduler_output.scheduled)
        for dev, host in scheduler_output.swap_out:
            self.host[host] = list(self.device[dev])
        for host, dev in scheduler_output.swap_in:
            self.device[dev] = list(self.host[host])
        for src, dst in scheduler_output.copies:
            self.device[dst] = list(self.device[src])
        # Like a real forward: every layer writes the batch's K/V before attention reads.
        for req in scheduler_output.scheduled:
            assert len(req.block_tables) == len(self.windows), "one block table per group"
            for table in req.block_tables:
                for offset, token in enumerate(req.token_ids):
                    self._write(table, req.num_computed_tokens + offset, token)
        result = RunnerOutput()
        for req in scheduler_output.scheduled:
            if req.num_draft_tokens:
                result.spec_token_ids[req.request_id] = self._verify(req)
            elif req.sample:
                result.sampled_token_ids[req.request_id] = self._next(req, req.context_len)
        return result

    def _note_window_blocks(self, scheduled: list[ScheduledRequest]) -> None:
        for req in scheduled:
            if req.num_new_tokens != 1 or req.num_computed_tokens == 0:
                continue
            for table, window in zip(req.block_tables, self.windows, strict=True):
                if window is not None:
                    held = len(table) - table.count(NULL_BLOCK)
                    self.max_window_blocks = max(self.max_window_blocks, held)

    def _verify(self, req: ScheduledRequest) -> list[int]:
        """Greedy verification: keep drafts while each is the model's next token for the
        prefix read back from the blocks, then add the model's token after them."""
        first = req.context_len - req.num_draft_tokens  # the prefix before the first draft
        emitted = []
        for i, draft in enumerate([*req.draft_token_ids, None]):
            token = self._next(req, first + i)
            emitted.append(token)
            if token != draft:
                break
        return emitted

    def _next(self, req: ScheduledRequest, context: int) -> int:
        """The model's token after the first ``context`` tokens, from what every group
        reads back: the whole prefix (full) or its last ``window`` tokens (sliding)."""
        reads = []
        for table, window in zip(req.block_tables, self.windows, strict=True):
            start = 0 if window is None else max(0, context - window)
            reads.append([self._read(table, pos) for pos in range(start, context)])
        prefix = next((r for r, w in zip(reads, self.windows, strict=True) if w is None), None)
        if prefix is None:  # every group slides: the first group's read stands for all
            prefix = reads[0]
        token = self.model.next_token(prefix, req.seed)
        for read in reads:
            if read != prefix[len(prefix) - len(read) :]:
                return self.model.next_token([*prefix, -1, *read], req.seed)  # poisoned
        return token

    def _write(self, block_ids: list[int], position: int, token: int) -> None:
        block = block_ids[position // self.block_size]
        assert block != NULL_BLOCK, f"position {position} written to a released block"
        self.device[block][position % self.block_size] = token

    def _read(self, block_ids: list[int], position: int) -> int:
        block = block_ids[position // self.block_size]
        assert block != NULL_BLOCK, f"position {position} read from a released block"
        token = self.device[block][position % self.block_size]
        assert token is not None, f"position {position} read before it was written"
        return token


def _empty_blocks(num_blocks: int, block_size: int) -> list[list[int | None]]:
    return [[None] * block_size for _ in range(num_blocks)]


class ConstantRunner:
    """Samples the same token for everyone: the cheapest runner, for benchmarks."""

    def __init__(self, token: int = 1) -> None:
        self.token = token

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        token = self.token
        return RunnerOutput(
            sampled_token_ids={r.request_id: token for r in scheduler_output.scheduled if r.sample}
        )


def reference_tokens(
    model: PrefixHashModel,
    prompt: Sequence[int],
    params: SamplingParams,
    seed: int | None,
    eos_token_ids: tuple[int, ...],
    max_model_len: int,
    window: int | None = None,
) -> list[int]:
    """What a sequence generates without any cache, batching or preemption (``window``: a
    model whose every layer slides sees only its last ``window`` tokens)."""
    tokens = list(prompt)
    out: list[int] = []
    while True:
        token = model.next_token(tokens if window is None else tokens[-window:], seed)
        tokens.append(token)
        out.append(token)
        stop_ok = len(out) > params.min_tokens
        if stop_ok and (
            token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids)
        ):
            return out
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out


def make_group(
    group_id: str,
    prompt: Sequence[int],
    params: SamplingParams | None = None,
    *,
    eos: tuple[int, ...] = (0,),
    priority: int = 0,
    arrival_time: float = 0.0,
    cache_salt: str | None = None,
) -> list[Request]:
    """The ``n`` sequences of one client request, as the AsyncEngine would build them."""
    params = params or SamplingParams(max_tokens=8)
    return [
        Request(
            request_id=f"{group_id}-{index}" if params.n > 1 else group_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            eos_token_ids=eos,
            group_id=group_id,
            index=index,
            priority=priority,
            arrival_time=arrival_time,
            cache_salt=cache_salt,
        )
        for index in range(params.n)
    ]


def expected_for(
    group: list[Request],
    model: PrefixHashModel,
    config: SchedulerConfig,
    window: int | None = None,
) -> dict[str, list[int]]:
    """Reference outputs of every sequence of a group."""
    return {
        r.request_id: reference_tokens(
            model,
            r.prompt_token_ids,
            r.sampling_params,
            r.seed,
            r.eos_token_ids,
            config.max_model_len,
            window,
        )
        for r in group
    }


def drive(core: EngineCore, max_steps: int = 20_000) -> dict[str, list[int]]:
    """Step until nothing is left, checking the block invariants after every step.

    Returns the tokens each sequence received through its deltas."""
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished():
            return outputs
        for delta in core.step():
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        core.scheduler.check_integrity()
    raise AssertionError(f"still unfinished after {max_steps} steps (livelock?)")


class ScriptedRunner:
    """Samples scripted tokens per request id (then ``default``), ignoring the KV."""

    def __init__(self, script: dict[str, list[int]] | None = None, default: int = 1) -> None:
        self.script = {rid: list(tokens) for rid, tokens in (script or {}).items()}
        self.default = default
        self.steps: list[SchedulerOutput] = []

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self.steps.append(scheduler_output)
        result = RunnerOutput()
        for req in scheduler_output.scheduled:
            if req.sample:
                tokens = self.script.get(req.request_id)
                token = tokens.pop(0) if tokens else self.default
                result.sampled_token_ids[req.request_id] = token
        return result


class FakeDisk:
    """An unbounded disk tier in memory (the ``DiskIndex`` the tier planner reads)."""

    capacity_bytes = 1 << 40

    def __init__(self) -> None:
        self.entries: dict[bytes, list[int | None]] = {}
        self.on_stored = None
        self.on_removed = None

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def contains_or_pending(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    @property
    def used_bytes(self) -> int:
        return len(self.entries)

    @property
    def num_entries(self) -> int:
        return len(self.entries)

    @property
    def dropped_writes(self) -> int:
        return 0

    @property
    def rejected_entries(self) -> dict[str, int]:
        return {}

    @property
    def removed_temp_files(self) -> int:
        return 0


class FakeTierMover:
    """Applies tier ops to a ``FakeKVRunner``'s device blocks, a host tier and a fake
    disk, synchronously. Loads of a hash in ``corrupt`` fail (as a damaged disk entry
    would): that request's later loads do not count either, as in TierIO."""

    def __init__(self, runner: FakeKVRunner, num_host_blocks: int, disk: FakeDisk | None):
        self.pools = {
            "device": runner.device,
            "host": _empty_blocks(num_host_blocks, runner.block_size),
        }
        self.disk = disk
        self.corrupt: set[bytes] = set()
        self.loads = 0
        self.failed_loads = 0

    def apply(self, ops: list[TierOp], *, wait_for_disk: bool = False) -> dict[str, int]:
        loaded: dict[str, int] = {}
        broken: set[str] = set()
        for op in ops:
            ok = not (op.is_load and op.block_hash in self.corrupt)
            if ok:
                self._move(op)
            if op.request_id is None:
                continue
            self.loads += 1
            if not ok:
                self.failed_loads += 1
                broken.add(op.request_id)
            elif op.request_id not in broken:
                loaded[op.request_id] = loaded.get(op.request_id, 0) + 1
        return loaded

    def _move(self, op: TierOp) -> None:
        if op.source == "disk":
            assert self.disk is not None
            data = list(self.disk.entries[op.block_hash])
        else:
            data = list(self.pools[op.source][op.source_block])
        if op.target == "disk":
            assert self.disk is not None
            self.disk.entries[op.block_hash] = data
            if self.disk.on_stored is not None:
                self.disk.on_stored(op.block_hash)
        else:
            self.pools[op.target][op.target_block] = data

    def start_writes_ahead(self, ops: list[TierOp]) -> None:
        self.apply(ops)

    def wait_writes_ahead(self) -> BaseException | None:
        return None

    def close(self) -> None:
        pass
