"""The tiered prefix cache on a real engine (tiny random Llama, real builder, real disk).

Every test checks the scheduler's invariants after every step, compares greedy tokens
with an engine that has no prefix cache at all, and checks block identity: a block that a
tier holds under a hash carries exactly the bytes the device computed for that hash.
"""

from __future__ import annotations

import errno
import json
import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.builder import build_engine
from engine.config import EngineArgs
from engine.kv.accounting import DISK_ENTRY_HEADER_BYTES, GIB
from engine.kv.disk_store import MAGIC, SUFFIX
from engine.kv.hashing import extend_block_hashes
from engine.request import Request, SamplingParams

BLOCK = 16
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * BLOCK  # K+V, 2 layers, 2 KV heads, head_dim 16, fp32
PROMPT_LEN = 200
MAX_TOKENS = 6

pytestmark = pytest.mark.slow


def engine_args(model_dir: Path, **overrides: Any) -> EngineArgs:
    fields: dict[str, Any] = {
        "model": str(model_dir),
        "device": "cpu",
        "dtype": "float32",
        "max_model_len": 512,
        "num_kv_blocks": 40,  # 640 tokens: four 200-token prompts evict the first
        "block_size": BLOCK,
        "swap_space_gib": 0.0,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 512,
    }
    fields.update(overrides)
    return EngineArgs(**fields)


def host_gib(blocks: int) -> float:
    return blocks * BLOCK_BYTES / GIB


class Recorder:
    """Drives a core and remembers, per block hash, the bytes the device computed."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.computed: dict[bytes, list[torch.Tensor]] = {}
        self.count = 0

    def run(self, prompt: list[int]) -> tuple[list[int], int]:
        """Greedy tokens and cached prompt tokens of one request, checking every step."""
        self.count += 1
        rid = f"r{self.count}"
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        self.core.add_request([Request(rid, list(prompt), params)])
        tokens: list[int] = []
        cached = 0
        while self.core.has_unfinished():
            for delta in self.core.step():
                tokens.extend(delta.new_token_ids)
                cached = delta.num_cached_tokens
            self.core.scheduler.check_integrity()
            self.record_and_verify()
        return tokens, cached

    def record_and_verify(self) -> None:
        kv = self.core.scheduler.kv
        device = self.core.runner.device_pool
        for block_hash, block in kv.device.cached.items():
            content = block_bytes(device, block.block_id)
            known = self.computed.setdefault(block_hash, content)
            assert same_block(known, content), "a device block is not what its hash names"
        tiers = kv.tiers
        host_pool = self.core.tier_io.pools.get("host") if tiers is not None else None
        if tiers is None or host_pool is None:
            return
        for block_hash, block in tiers.host.cached.items():
            content = block_bytes(host_pool, block.block_id)
            assert same_block(self.computed[block_hash], content), (
                "a host tier block does not hold what the device computed for its hash"
            )


def same_block(known: list[torch.Tensor], content: list[torch.Tensor]) -> bool:
    """Same K/V up to float rounding: a prefix recomputed in a chunk of another length
    runs GEMMs of another shape, so its bits may differ in the last place; a stale or
    misplaced block differs entirely."""
    return all(
        torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(known, content, strict=True)
    )


def block_bytes(pool: Any, block_id: int) -> list[torch.Tensor]:
    return [t[:, :, block_id].clone() for t in pool.tensors()]


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 4000) for _ in range(PROMPT_LEN)] for _ in range(count)]


def full_block_hashes(tokens: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, (len(tokens) - 1) // BLOCK, BLOCK)
    return hashes


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Any:
    """Greedy tokens of an engine without any prefix cache."""
    core = build_engine(engine_args(tiny_model_dir, enable_prefix_caching=False)).core
    recorder = Recorder(core)
    return lambda prompt: recorder.run(prompt)[0]


def evict_with_fillers(recorder: Recorder, seed: int) -> None:
    for filler in prompts(seed, 4):
        recorder.run(filler)


def tier(core: Any, name: str) -> Any:
    return next(t for t in core.stats().tiers if t.name == name)


def test_host_tier_serves_an_evicted_prefix_with_the_same_bytes_and_tokens(
    tiny_model_dir: Path, reference: Any
) -> None:
    core = build_engine(engine_args(tiny_model_dir, kv_cache_host_gib=host_gib(64))).core
    recorder = Recorder(core)
    first = prompts(1, 1)[0]
    answer, _ = recorder.run(first)
    evict_with_fillers(recorder, seed=2)
    kv = core.scheduler.kv
    hashes = full_block_hashes(first)
    assert kv.tiers is not None
    demoted = [h for h in hashes if kv.tiers.host.lookup(h) is not None]
    assert len(demoted) == len(hashes), "every evicted block of the first prompt is on host"
    assert all(kv.device.lookup(h) is None for h in hashes), "the fillers evicted them"

    second = first + answer + prompts(3, 1)[0][:40]
    tokens, cached = recorder.run(second)

    assert cached >= len(hashes) * BLOCK
    assert tier(core, "host").hits_total >= len(hashes)
    assert tier(core, "host").loaded_bytes_total >= len(hashes) * BLOCK_BYTES
    assert tokens == reference(second)
    for block_hash in hashes:  # loaded back under the same hash, with the same bytes
        assert kv.device.lookup(block_hash) is not None


def run_beside_a_decode(recorder: Recorder, prompt: list[int]) -> None:
    """Run ``prompt`` while a second request decodes, and step once after it finishes: the
    engine keeps stepping, as a busy server does, so its freed blocks can be written ahead."""
    core = recorder.core
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    longer = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    core.add_request([Request("first", list(prompt), params)])
    core.add_request([Request("beside", prompts(9, 1)[0][:64], longer)])
    steps_after = 0
    while steps_after < 2:
        finished = any(d.finished for d in core.step())
        core.scheduler.check_integrity()
        recorder.record_and_verify()  # every host block holds what the device computed
        if finished or steps_after:
            steps_after += 1
    assert core.has_unfinished(), "the second request still decodes"
    while core.has_unfinished():
        core.step()


def test_cached_blocks_are_written_ahead_beside_the_forward_not_at_eviction(
    tiny_model_dir: Path, reference: Any
) -> None:
    core = build_engine(engine_args(tiny_model_dir, kv_cache_host_gib=host_gib(64))).core
    recorder = Recorder(core)
    first = prompts(10, 1)[0]
    kv = core.scheduler.kv
    assert kv.tiers is not None
    hashes = full_block_hashes(first)

    run_beside_a_decode(recorder, first)

    # On host while still cached on the device: copied before any eviction, by the writer.
    assert all(kv.device.lookup(h) is not None for h in hashes)
    assert all(kv.tiers.host.lookup(h) is not None for h in hashes)
    host = tier(core, "host")
    assert host.in_step_stores_total == 0
    assert host.stored_bytes_total >= len(hashes) * BLOCK_BYTES

    # Evicted later by other prompts, the prefix comes back from host.
    recorder.run(prompts(11, 1)[0])
    recorder.run(prompts(12, 1)[0])
    assert any(kv.device.lookup(h) is None for h in hashes), "the fillers evicted some"
    second = first + prompts(13, 1)[0][:20]
    tokens, cached = recorder.run(second)
    assert cached >= len(hashes) * BLOCK
    assert tokens == reference(second)


def test_the_host_tier_gets_each_block_as_it_is_computed(
    tiny_model_dir: Path, reference: Any
) -> None:
    core = build_engine(engine_args(tiny_model_dir, kv_cache_host_gib=host_gib(64))).core
    recorder = Recorder(core)
    kv = core.scheduler.kv
    assert kv.tiers is not None
    first = prompts(17, 1)[0]
    hashes = full_block_hashes(first)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    core.add_request([Request("first", list(first), params)])
    core.step()  # the prompt's prefill registers its full blocks
    core.step()  # ... which the next step's writer copies beside its forward
    recorder.record_and_verify()
    assert core.has_unfinished(), "the request is still running"
    assert all(kv.tiers.host.lookup(h) is not None for h in hashes)
    while core.has_unfinished():
        core.step()
    evict_with_fillers(recorder, seed=18)
    assert tier(core, "host").in_step_stores_total == 0, "nothing was left for the eviction"
    second = first + prompts(19, 1)[0][:20]
    tokens, cached = recorder.run(second)
    assert cached >= len(hashes) * BLOCK
    assert tokens == reference(second)


def test_a_failed_write_ahead_costs_only_its_cached_copies(
    tiny_model_dir: Path, reference: Any, caplog: pytest.LogCaptureFixture
) -> None:
    core = build_engine(engine_args(tiny_model_dir, kv_cache_host_gib=host_gib(64))).core
    recorder = Recorder(core)

    def broken(ops: Any) -> None:
        raise RuntimeError("injected: the host pool copy failed")

    core.tier_io._write_ahead = broken
    first = prompts(14, 1)[0]
    kv = core.scheduler.kv
    assert kv.tiers is not None
    with caplog.at_level(logging.ERROR, logger="engine.core"):
        run_beside_a_decode(recorder, first)
    assert "tier write-ahead failed" in caplog.text
    hashes = full_block_hashes(first)
    assert all(kv.tiers.host.lookup(h) is None for h in hashes), "nothing half-copied is served"
    kv.tiers.check_integrity()

    # The engine goes on; an eviction now copies in the step, and the tokens are right.
    evict_with_fillers(recorder, seed=15)
    second = first + prompts(16, 1)[0][:20]
    tokens, _ = recorder.run(second)
    assert tokens == reference(second)


def test_a_small_host_tier_never_serves_an_overwritten_block(
    tiny_model_dir: Path, reference: Any
) -> None:
    core = build_engine(engine_args(tiny_model_dir, kv_cache_host_gib=host_gib(4))).core
    recorder = Recorder(core)  # checks every host block against its hash after each step
    first = prompts(4, 1)[0]
    answer, _ = recorder.run(first)
    evict_with_fillers(recorder, seed=5)
    kv = core.scheduler.kv
    assert kv.tiers is not None
    hashes = full_block_hashes(first)
    assert all(kv.tiers.host.lookup(h) is None for h in hashes), "overwritten by fillers"

    second = first + answer
    tokens, cached = recorder.run(second)
    assert cached == 0
    assert tokens == reference(second)


def test_disk_tier_survives_a_restart_with_identical_tokens(
    tiny_model_dir: Path, reference: Any, tmp_path: Path
) -> None:
    disk = tmp_path / "kv"
    args = engine_args(tiny_model_dir, kv_cache_disk_dir=str(disk), kv_cache_disk_gib=0.01)
    core = build_engine(args).core
    recorder = Recorder(core)
    first = prompts(6, 1)[0]
    answer, _ = recorder.run(first)
    core.close()  # shutdown: every cached block goes to disk
    hashes = full_block_hashes(first)
    files = {p.stem for p in disk.glob(f"*{SUFFIX}")}
    assert {h.hex() for h in hashes} <= files
    header = (disk / f"{hashes[0].hex()}{SUFFIX}").read_bytes()[:DISK_ENTRY_HEADER_BYTES]
    assert header.startswith(MAGIC)
    fields = json.loads(header[len(MAGIC) :])
    assert fields["format"] == 1 and fields["block_size"] == BLOCK
    assert fields["dtype"] == "float32" and fields["kv_dtype"] == "float32"
    assert fields["model"] == tiny_model_dir.name

    restarted = build_engine(args).core
    second = first + answer + prompts(7, 1)[0][:30]
    tokens, cached = Recorder(restarted).run(second)
    assert cached >= len(hashes) * BLOCK
    assert tier(restarted, "disk").hits_total >= len(hashes)
    assert tokens == reference(second)
    restarted.close()


def test_host_and_disk_tiers_chain(tiny_model_dir: Path, reference: Any, tmp_path: Path) -> None:
    """A tiny host tier spills to disk; the prefix comes back from both."""
    args = engine_args(
        tiny_model_dir,
        kv_cache_host_gib=host_gib(6),
        kv_cache_disk_dir=str(tmp_path / "kv"),
        kv_cache_disk_gib=0.01,
    )
    core = build_engine(args).core
    recorder = Recorder(core)
    first = prompts(8, 1)[0]
    answer, _ = recorder.run(first)
    evict_with_fillers(recorder, seed=9)
    disk = core.tier_io.disk
    assert disk.flush(timeout_s=30)
    second = first + answer
    tokens, cached = recorder.run(second)
    assert cached >= len(full_block_hashes(first)) * BLOCK
    assert tier(core, "disk").hits_total > 0
    assert tokens == reference(second)
    core.close()


# -- faults -----------------------------------------------------------------------------------


def persisted(model_dir: Path, disk: Path, seed: int, **overrides: Any) -> tuple[list[int], Any]:
    """Run one prompt on an engine with a disk tier and shut it down; (prompt+answer, args)."""
    args = engine_args(model_dir, kv_cache_disk_dir=str(disk), kv_cache_disk_gib=0.01, **overrides)
    core = build_engine(args).core
    prompt = prompts(seed, 1)[0]
    answer, _ = Recorder(core).run(prompt)
    core.close()
    return prompt + answer, args


def warnings_about(caplog: pytest.LogCaptureFixture, word: str) -> int:
    return sum(1 for r in caplog.records if r.levelno == logging.WARNING and word in r.getMessage())


def test_corrupt_entries_are_deleted_at_start_up_and_logged_once(
    tiny_model_dir: Path, reference: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    disk = tmp_path / "kv"
    conversation, args = persisted(tiny_model_dir, disk, seed=10)
    hashes = full_block_hashes(conversation[:PROMPT_LEN])
    for block_hash in hashes[2:4]:  # flip one payload byte in two entries
        path = disk / f"{block_hash.hex()}{SUFFIX}"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING)
    core = build_engine(args).core
    # The writer verifies start-up entries' checksums while idle; a read would verify
    # them too (tests/unit/test_kv_tiers.py), this waits for the start-up pass.
    assert core.tier_io.disk.wait_verified(30)
    assert not (disk / f"{hashes[2].hex()}{SUFFIX}").exists(), "a corrupt entry is deleted"
    tokens, cached = Recorder(core).run(conversation)
    assert tokens == reference(conversation)
    assert cached == 2 * BLOCK  # the leading intact run only; the rest was recomputed
    stats = tier(core, "disk")  # the snapshot published by the run's steps
    assert dict(stats.rejected_entries_total)["checksum"] == 2
    assert stats.failed_loads_total == 0  # found before any load tried them
    assert warnings_about(caplog, "checksum") == 1
    core.close()


def test_entries_of_another_block_size_are_ignored(
    tiny_model_dir: Path, reference: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    disk = tmp_path / "kv"
    conversation, _ = persisted(tiny_model_dir, disk, seed=11)
    caplog.set_level(logging.WARNING)
    other = engine_args(
        tiny_model_dir,
        block_size=32,
        num_kv_blocks=20,
        kv_cache_disk_dir=str(disk),
        kv_cache_disk_gib=0.01,
    )
    core = build_engine(other).core
    assert tier(core, "disk").used_blocks == 0
    assert warnings_about(caplog, "another configuration") == 1
    tokens, cached = Recorder(core).run(conversation)
    assert cached == 0 and tier(core, "disk").hits_total == 0
    assert tokens == reference(conversation)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS], ids=["disk-full", "read-only"])
def test_a_full_or_read_only_disk_stops_writes_and_keeps_serving(
    tiny_model_dir: Path,
    reference: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    code: int,
) -> None:
    disk = tmp_path / "kv"
    conversation, args = persisted(tiny_model_dir, disk, seed=12)
    before = {p.name for p in disk.iterdir()}
    caplog.set_level(logging.WARNING)
    core = build_engine(args).core
    store = core.tier_io.disk
    failures = []

    def failing_write(path: Path, data: bytes) -> None:
        failures.append(path)
        raise OSError(code, "simulated", str(path))

    store.write_file = failing_write  # the store's one write path
    recorder = Recorder(core)
    tokens, cached = recorder.run(conversation)  # stored blocks still load
    assert cached > 0 and tokens == reference(conversation)
    for filler in prompts(13, 4):  # evictions now try to write, and fail
        assert recorder.run(filler)[0] == reference(filler)
    assert store.flush(timeout_s=30)
    assert len(failures) == 1, "the first failure stops further writes"
    assert not store.writable
    assert warnings_about(caplog, "no more blocks are written") == 1
    core.close()
    assert {p.name for p in disk.iterdir()} == before, "no partial file is left behind"
