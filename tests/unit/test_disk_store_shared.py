"""One disk-tier directory shared by several OS processes (engine/kv/disk_store.py,
engine/kv/disk_shared.py): real processes, real files, no mocks.

Each child runs ``WORKER`` (a small Python program) with its role; the test process is a
store of its own where a test needs one. Every payload is a function of its key, so any
process can tell a whole entry from torn or foreign bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from engine.kv.accounting import DISK_ENTRY_HEADER_BYTES
from engine.kv.disk_store import SUFFIX, TEMP_SUFFIX, DiskFingerprint, DiskStore

ROOT = Path(__file__).resolve().parents[2]
FINGERPRINT = DiskFingerprint("m", "float32", "float32", 4, 2, 2, 8)

WORKER = r"""
import hashlib, json, random, sys, time
from pathlib import Path
from engine.kv.disk_store import DiskFingerprint, DiskStore

FINGERPRINT = DiskFingerprint("m", "float32", "float32", 4, 2, 2, 8)

def key(i):
    return i.to_bytes(16, "big")

def payload(i):
    base = hashlib.blake2b(key(i)).digest()
    return (base * 400)[: 1000 + 97 * i]

role, directory, capacity = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
store = DiskStore(directory, capacity, FINGERPRINT)
stored = []
store.on_stored = stored.append

if role == "churn":  # write and read overlapping keys until the deadline
    seconds, seed, writes, keys = float(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1", 40
    rnd = random.Random(seed)
    mine, stats = set(), {"hits": 0, "misses": 0, "bad": 0, "peer_hits": 0}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        i = rnd.randrange(keys)
        if writes and rnd.random() < 0.5:
            store.submit(key(i), lambda i=i: payload(i))
            mine.add(i)
        else:
            got = store.read(key(i))
            if got is None:
                stats["misses"] += 1
            elif got != payload(i):
                stats["bad"] += 1
            else:
                stats["hits"] += 1
                stats["peer_hits"] += i not in mine
        time.sleep(0.0005)
    store.close()
    stats["evictions"] = store.counters.evictions
    print(json.dumps(stats), flush=True)

elif role == "reader":  # one command a line on stdin: "read 0 1 2" -> {"0": true, ...}
    print(json.dumps({"ready": store.num_entries}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[0] == "read":
            got = {w: store.read(key(int(w))) == payload(int(w)) for w in words[1:]}
            print(json.dumps({"read": got, "stored": [k.hex() for k in stored]}), flush=True)
        elif words[0] == "quit":
            break

elif role == "stalled":  # half a block written, then stuck until killed
    def stuck(path, data):
        with open(path, "wb") as file:
            file.write(data[: len(data) // 2])
            file.flush()
            print(json.dumps({"temp": str(path)}), flush=True)
            time.sleep(120)
            file.write(data[len(data) // 2 :])
    store.write_file = stuck
    store.submit(key(int(sys.argv[4])), lambda: payload(int(sys.argv[4])))
    time.sleep(120)

elif role == "start":  # a process starting on the directory: what it found and cleaned
    i = int(sys.argv[4])
    print(json.dumps({"removed": store.removed_temp_files, "read": store.read(key(i)) is not None}))
"""


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def payload(i: int) -> bytes:
    import hashlib

    return (hashlib.blake2b(key(i)).digest() * 400)[: 1000 + 97 * i]


def spawn(role: str, directory: Path, capacity: int, *args: object) -> subprocess.Popen[str]:
    command = [sys.executable, "-c", WORKER, role, str(directory), str(capacity)]
    return subprocess.Popen(
        [*command, *map(str, args)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def reply(process: subprocess.Popen[str]) -> Any:
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, f"worker exited ({process.poll()})"
    return json.loads(line)


def ask(process: subprocess.Popen[str], command: str) -> Any:
    assert process.stdin is not None
    process.stdin.write(command + "\n")
    process.stdin.flush()
    return reply(process)


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def entries(directory: Path) -> list[Path]:
    return [path for path in directory.iterdir() if path.name.endswith(SUFFIX)]


def temps(directory: Path) -> list[Path]:
    return [path for path in directory.iterdir() if path.name.endswith(TEMP_SUFFIX)]


def test_concurrent_writers_and_readers_see_whole_entries_or_misses(tmp_path: Path) -> None:
    """Three writers and a reader on overlapping keys, the bound far below the working set
    (constant eviction by every writer): every read is None or the exact payload, the
    reader serves blocks only peers wrote, and the directory stays near its bound."""
    capacity = 40_000
    largest = DISK_ENTRY_HEADER_BYTES + len(payload(39))
    writers = [spawn("churn", tmp_path, capacity, 6, seed, 1) for seed in range(3)]
    reader = spawn("churn", tmp_path, capacity, 6, 99, 0)
    peak = 0
    try:
        while any(process.poll() is None for process in [*writers, reader]):
            size = 0
            for path in entries(tmp_path):
                with contextlib.suppress(FileNotFoundError):
                    size += path.stat().st_size
            peak = max(peak, size)
            time.sleep(0.02)
        results = [reply(process) for process in [*writers, reader]]
    finally:
        for process in [*writers, reader]:
            if process.poll() is None:
                process.kill()
            process.wait()
    assert all(result["bad"] == 0 for result in results), results
    assert all(result["hits"] > 0 for result in results), results
    assert results[-1]["peer_hits"] > 0, "the reader served blocks the writers published"
    assert sum(result["evictions"] for result in results[:3]) > 0
    # Each writer may publish one entry the others' last rescan did not see.
    assert peak <= capacity + len(writers) * largest, (peak, capacity)
    assert sum(path.stat().st_size for path in entries(tmp_path)) <= capacity + largest
    assert not temps(tmp_path), "every write finished or was cleaned up"
    after = DiskStore(tmp_path, capacity, FINGERPRINT)
    assert after.wait_verified(10) and sum(after.rejected_entries.values()) == 0
    after.close()


def test_a_replica_starts_warm_and_adopts_blocks_a_peer_publishes_later(tmp_path: Path) -> None:
    """Blocks the test process wrote before a peer started are served by the peer (the
    start-up scan); blocks written after it started are found by its lookups (one stat,
    adopted into its index and announced as stored); blocks this process then evicts are
    misses for the peer, never torn reads."""
    capacity = 200_000
    mine = DiskStore(tmp_path, capacity, FINGERPRINT)
    for i in range(5):
        assert mine.submit(key(i), partial(payload, i))
    assert mine.flush(10)
    peer = spawn("reader", tmp_path, capacity)
    try:
        assert reply(peer) == {"ready": 5}
        warm = ask(peer, "read 0 1 2 3 4")
        assert all(warm["read"].values()) and warm["stored"] == []
        for i in range(5, 10):
            assert mine.submit(key(i), partial(payload, i))
        assert mine.flush(10)
        later = ask(peer, "read 5 6 7 8 9")
        assert all(later["read"].values()), later
        assert later["stored"] == [key(i).hex() for i in range(5, 10)]
        for i in (0, 5):  # another process evicts them under the peer's index
            (tmp_path / f"{key(i).hex()}{SUFFIX}").unlink()
        gone = ask(peer, "read 0 5 6")
        assert gone["read"] == {"0": False, "5": False, "6": True}
    finally:
        peer.kill()
        peer.wait()
        mine.close()


def test_a_writer_killed_mid_write_leaves_nothing_served_and_its_temp_file_is_cleaned(
    tmp_path: Path,
) -> None:
    """A writer stalls with half a block in its temporary file: a peer starting meanwhile
    keeps that file (its writer lives) and serves nothing for the block. After kill -9,
    the next process to start removes it and still serves nothing torn."""
    capacity = 200_000
    stalled = spawn("stalled", tmp_path, capacity, 7)
    try:
        temp = Path(reply(stalled)["temp"])
        assert temp.exists() and 0 < temp.stat().st_size < len(payload(7))
        peer = DiskStore(tmp_path, capacity, FINGERPRINT, maintenance_interval_s=0.1)
        assert peer.removed_temp_files == 0 and temp.exists(), "a live writer's file is kept"
        assert not peer.contains(key(7)) and peer.read(key(7)) is None
        rescans = peer.counters.rescans
        wait_for(lambda: peer.counters.rescans >= rescans + 3)  # the periodic rescans too
        assert temp.exists() and peer.removed_temp_files == 0
        peer.close()  # its rescans stop: the next process to start is the one that cleans
        os.kill(stalled.pid, signal.SIGKILL)
        stalled.wait(10)
        starter = spawn("start", tmp_path, capacity, 7)
        found = reply(starter)
        starter.wait(10)
        assert found == {"removed": 1, "read": False}
        assert not temp.exists() and not temps(tmp_path) and not entries(tmp_path)
        assert peer.read(key(7)) is None
    finally:
        if stalled.poll() is None:
            stalled.kill()
        stalled.wait()


def test_a_dead_writers_temp_file_is_removed_by_a_running_peers_rescan(tmp_path: Path) -> None:
    """Clean-up from time to time, not only at start: a peer already running removes the
    file at its next rescan once the writer died."""
    capacity = 200_000
    peer = DiskStore(tmp_path, capacity, FINGERPRINT, maintenance_interval_s=0.1)
    stalled = spawn("stalled", tmp_path, capacity, 3)
    try:
        temp = Path(reply(stalled)["temp"])
        os.kill(stalled.pid, signal.SIGKILL)
        stalled.wait(10)
        wait_for(lambda: peer.removed_temp_files == 1)  # counted once the rescan is done
        assert not temp.exists()
    finally:
        if stalled.poll() is None:
            stalled.kill()
        stalled.wait()
        peer.close()
