"""The disk tier of the prefix cache: one file per KV block, keyed by its prefix hash.

File format (version ``FORMAT_VERSION``)::

    bytes [0, 8)        magic b"KVSBLK01"
    bytes [8, 512)      JSON header, space-padded: format, the configuration fingerprint
                        (model, dtype, KV dtype, block size, layer/head shape), the block's
                        hash, payload length and a BLAKE2b checksum of the payload
    bytes [512, ...)    payload: the block's K, V (and scale) bytes, as the runner packs them

An entry is served only when its header names the running configuration, its hash is the
one asked for, its length is right and its checksum matches; anything else is rejected,
never loaded, and counted by reason (``REJECT_REASONS``):

- ``empty``, ``truncated``, ``oversized``, ``header`` (no magic, no JSON, or another
  block's hash) and ``checksum``: damaged, so the file is deleted;
- ``fingerprint``: written by another configuration (model, dtype, block size, format).
  Not ours to delete while there is room: it is kept, its bytes count against the size
  bound, and it is the first thing evicted when room is needed.

The directory survives restarts. On start the store removes the temporary files a crashed
write left behind, reads every entry's header (oldest modification first, to rebuild the
LRU index) and deletes what is damaged; the payload checksums are then verified by the
writer thread whenever it has no write to do, so a large tier does not delay start-up
(a read verifies its entry anyway).

Writes go through a bounded queue to one worker thread, so the engine step never waits
for the disk: a full queue drops the write (counted). A block is written to a temporary
file, fsynced, and only then renamed to its name, so a name never points at bytes a crash
could lose; the directory is fsynced whenever the writer runs out of work. A full disk or
a read-only directory is logged once and stops further writes; reads keep working. Pure
Python (no torch): the runner hands in payload producers and gets bytes back.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from hashlib import blake2b
from pathlib import Path

from engine.kv.accounting import DISK_ENTRY_HEADER_BYTES
from engine.kv.block_pool import BlockHash

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"KVSBLK01"
SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"  # a block is written as ".<hash>.kvb.tmp", then renamed
_CHECKSUM_BYTES = 16
# Errors after which writing is pointless until restart: the disk is full or not ours.
_STOP_WRITING = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
DEFAULT_QUEUE_DEPTH = 64

# Why an entry was rejected; every one but "fingerprint" deletes the file.
REJECT_REASONS = ("empty", "truncated", "oversized", "header", "checksum", "fingerprint")
_REJECT_LOGS = {
    "empty": "disk tier %s: an empty entry (a write cut short) was deleted",
    "truncated": "disk tier %s: a truncated entry was deleted",
    "oversized": "disk tier %s: an entry longer than its header says was deleted",
    "header": "disk tier %s: an entry with a damaged header was deleted",
    "checksum": "disk tier %s: an entry failed its checksum and was deleted",
    "fingerprint": "disk tier %s: entries of another configuration are never loaded; they "
    "count against the size bound and are evicted first",
}

PayloadProducer = Callable[[], bytes]


@dataclass(frozen=True)
class DiskFingerprint:
    """What must match for a stored block to be usable by the running engine."""

    model: str
    dtype: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # A hybrid model's KV groups (layers and window of each: a block holds one group's
    # layers); empty for one group of every layer, so such entries read as before.
    kv_groups: str = ""

    def as_dict(self) -> dict[str, object]:
        fields: dict[str, object] = {
            "model": self.model,
            "dtype": self.dtype,
            "kv_dtype": self.kv_dtype,
            "block_size": self.block_size,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
        }
        if self.kv_groups:
            fields["kv_groups"] = self.kv_groups
        return fields


@dataclass
class DiskCounters:
    """Monotonic counters of the disk tier (read by the stats snapshot)."""

    writes: int = 0
    bytes_written: int = 0
    dropped_writes: int = 0
    failed_writes: int = 0
    evictions: int = 0
    # Entries rejected at start-up, by the verifier or by a read, per REJECT_REASONS.
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECT_REASONS, 0))
    removed_temp_files: int = 0  # left by writes a crash cut short

    @property
    def rejected_entries(self) -> int:
        return sum(self.rejected.values())


class DiskStore:
    """A size-bounded LRU of KV blocks in ``directory``; see the module docstring."""

    def __init__(
        self,
        directory: str | Path,
        capacity_bytes: int,
        fingerprint: DiskFingerprint,
        *,
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
    ) -> None:
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.counters = DiskCounters()
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> file bytes
        # Entries of another configuration: path -> file bytes, oldest first.
        self._foreign: OrderedDict[Path, int] = OrderedDict()
        self._pending: set[BlockHash] = set()
        self._used_bytes = 0
        self._logged: set[str] = set()
        self.writable = self._prepare_directory()
        self._queue: queue.Queue[tuple[BlockHash, PayloadProducer] | None] = queue.Queue(
            maxsize=queue_depth
        )
        self._unverified: deque[BlockHash] = deque()  # checksums the writer has yet to check
        self._verified = threading.Event()
        self._unsynced = False  # a rename or delete the directory's fsync has not covered
        # Told (from the writer thread, or a reader's) when an entry is published or leaves
        # the index: the KV event recorder (engine/kv/events.py) announces it.
        self.on_stored: Callable[[BlockHash], None] | None = None
        self.on_removed: Callable[[BlockHash], None] | None = None
        self._scan()
        self._worker = threading.Thread(target=self._write_loop, name="kv-disk-tier", daemon=True)
        self._worker.start()

    # -- queries (any thread) --------------------------------------------------------------

    def contains(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._index

    def contains_or_pending(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._index or block_hash in self._pending

    @property
    def used_bytes(self) -> int:
        """Bytes of the files in the directory: usable entries and foreign ones."""
        return self._used_bytes

    @property
    def num_entries(self) -> int:
        return len(self._index)

    @property
    def dropped_writes(self) -> int:
        return self.counters.dropped_writes

    @property
    def rejected_entries(self) -> dict[str, int]:
        """Rejected entries by reason (REJECT_REASONS), a copy."""
        return dict(self.counters.rejected)

    @property
    def removed_temp_files(self) -> int:
        return self.counters.removed_temp_files

    def wait_verified(self, timeout_s: float = 30.0) -> bool:
        """Wait (bounded) until every entry found at start-up had its checksum checked."""
        return self._verified.wait(timeout_s)

    # -- writes -----------------------------------------------------------------------------

    def submit(
        self, block_hash: BlockHash, produce: PayloadProducer, *, block: bool = False
    ) -> bool:
        """Queue one block for writing; False (dropped, counted) when the queue is full,
        writing is stopped, or the block is already stored or queued. Never blocks unless
        ``block`` (shutdown only: persisting everything matters more than latency)."""
        if not self.writable:
            return False
        with self._lock:
            if block_hash in self._index or block_hash in self._pending:
                return False
            self._pending.add(block_hash)
        try:
            self._queue.put((block_hash, produce), block=block, timeout=10.0 if block else None)
        except queue.Full:
            with self._lock:
                self._pending.discard(block_hash)
            self.counters.dropped_writes += 1
            return False
        return True

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait (bounded) until every queued write is done; True when it drained."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish queued writes (bounded) and stop the worker (verification stops too)."""
        self.flush(timeout_s)
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            return
        self._worker.join(timeout=timeout_s)

    def _write_loop(self) -> None:
        """Writes first; with none waiting, one start-up entry's checksum at a time."""
        while True:
            if self._queue.empty():
                self._sync_directory()
            try:
                item = self._queue.get(block=not self._unverified)
            except queue.Empty:
                self._verify_next()
                continue
            try:
                if item is None:
                    self._sync_directory()
                    return
                block_hash, produce = item
                self._write_entry(block_hash, produce)
            except Exception:  # the worker must survive anything one entry does
                logger.exception("disk tier: writing a block failed")
            finally:
                if item is not None:
                    with self._lock:
                        self._pending.discard(item[0])
                self._queue.task_done()

    def _write_entry(self, block_hash: BlockHash, produce: PayloadProducer) -> None:
        if not self.writable:
            return
        payload = produce()
        data = self._header(block_hash, payload) + payload
        if len(data) > self.capacity_bytes:
            return
        self._make_room(len(data))
        path = self._path(block_hash)
        tmp = path.with_name(f".{path.name}{TEMP_SUFFIX}")
        try:
            self.write_file(tmp, data)
            os.replace(tmp, path)
        except OSError as exc:
            self._on_write_error(exc, tmp)
            return
        self._unsynced = True
        with self._lock:
            self._used_bytes -= self._foreign.pop(path, 0)  # a foreign file of that name
            self._index[block_hash] = len(data)
            self._used_bytes += len(data)
        self.counters.writes += 1
        self.counters.bytes_written += len(data)
        if self.on_stored is not None:
            self.on_stored(block_hash)

    def write_file(self, path: Path, data: bytes) -> None:
        """The one place bytes reach the disk (tests substitute a failing one): written and
        fsynced, so the rename that follows never publishes bytes a crash could lose."""
        with open(path, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())

    def _sync_directory(self) -> None:
        """fsync the directory, making the renames and deletions so far durable."""
        if not self._unsynced:
            return
        self._unsynced = False
        try:
            fd = os.open(self.directory, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:  # some filesystems cannot fsync a directory: nothing more to do
            pass
        finally:
            os.close(fd)

    def _on_write_error(self, exc: OSError, tmp: Path) -> None:
        self.counters.failed_writes += 1
        with contextlib.suppress(OSError):
            tmp.unlink()
        if exc.errno in _STOP_WRITING:
            self.writable = False
            self._log_once(
                "stop",
                "disk tier %s: %s; no more blocks are written, stored ones still load",
                self.directory,
                exc,
            )
        else:
            self._log_once("write", "disk tier %s: a write failed: %s", self.directory, exc)

    def _make_room(self, size: int) -> None:
        """Evict until ``size`` more bytes fit: foreign entries first, then the LRU."""
        while True:
            victim: BlockHash | None = None
            with self._lock:
                if self._used_bytes + size <= self.capacity_bytes:
                    return
                if self._foreign:
                    path, victim_size = self._foreign.popitem(last=False)
                elif self._index:
                    victim, victim_size = self._index.popitem(last=False)
                    path = self._path(victim)
                else:
                    return
                self._used_bytes -= victim_size
            if victim is not None:
                self._announce_removed(victim)
            self.counters.evictions += 1
            self._delete(path)

    def _announce_removed(self, block_hash: BlockHash) -> None:
        if self.on_removed is not None:
            self.on_removed(block_hash)

    def _header(self, block_hash: BlockHash, payload: bytes) -> bytes:
        fields = {
            "format": FORMAT_VERSION,
            **self.fingerprint.as_dict(),
            "hash": block_hash.hex(),
            "payload_bytes": len(payload),
            "checksum": _checksum(payload),
        }
        text = json.dumps(fields, separators=(",", ":")).encode()
        room = DISK_ENTRY_HEADER_BYTES - len(MAGIC)
        if len(text) > room:
            raise ValueError(f"disk tier header of {len(text)} bytes exceeds {room}")
        return MAGIC + text.ljust(room)

    # -- reads -------------------------------------------------------------------------------

    def read(self, block_hash: BlockHash) -> bytes | None:
        """The block's payload, verified; None when absent, foreign, truncated or corrupt
        (the bad entry is then dropped from the index, deleted and counted)."""
        if not self.contains(block_hash):
            return None
        data = self._read_entry(block_hash)
        if data is None:
            return None
        payload, reason = self._check_entry(data, block_hash)
        if reason is not None:
            self._drop(block_hash, reason)
            return None
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        with contextlib.suppress(OSError):
            os.utime(self._path(block_hash))  # the LRU order survives a restart
        return payload

    def _read_entry(self, block_hash: BlockHash) -> bytes | None:
        """The entry's bytes; None (and forgotten) when the file is gone or unreadable."""
        try:
            return self._path(block_hash).read_bytes()
        except FileNotFoundError:  # evicted by the writer since the lookup
            pass
        except OSError as exc:
            self._log_once("read", "disk tier %s: a read failed: %s", self.directory, exc)
        with self._lock:
            size = self._index.pop(block_hash, None)
        if size is not None:
            self._used_bytes -= size
            self._announce_removed(block_hash)
        return None

    def _check_entry(self, data: bytes, block_hash: BlockHash) -> tuple[bytes, str | None]:
        """(payload, None) for a sound entry of ``block_hash``, else (b"", the reason)."""
        fields, reason = self._check_header(data[:DISK_ENTRY_HEADER_BYTES], block_hash.hex())
        if reason is None:
            reason = _length_problem(fields, len(data))
        if reason is not None:
            return b"", reason
        payload = data[DISK_ENTRY_HEADER_BYTES:]
        if _checksum(payload) != fields.get("checksum"):
            return b"", "checksum"
        return payload, None

    def _check_header(self, head: bytes, name: str) -> tuple[dict[str, object], str | None]:
        """(fields, None) when the header is sound, belongs to the entry named ``name`` and
        to this configuration; else the fields read and the reason."""
        if not head:
            return {}, "empty"
        if len(head) < DISK_ENTRY_HEADER_BYTES:
            return {}, "truncated"
        fields = _read_header(head)
        if fields is None or fields.get("hash") != name or not _is_hex(name):
            return {}, "header"
        if fields.get("format") != FORMAT_VERSION or any(
            fields.get(key) != value for key, value in self.fingerprint.as_dict().items()
        ):
            return fields, "fingerprint"
        if not isinstance(fields.get("payload_bytes"), int):
            return {}, "header"
        return fields, None

    # -- start-up: index, clean-up, verification -------------------------------------------

    def _prepare_directory(self) -> bool:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._log_once("mkdir", "disk tier %s: cannot create: %s", self.directory, exc)
            return False
        if not os.access(self.directory, os.W_OK):
            self._log_once(
                "stop",
                "disk tier %s is read-only: stored blocks load, none are written",
                self.directory,
            )
            return False
        return True

    def _scan(self) -> None:
        """Remove crashed writes' temporary files; rebuild the index from the headers,
        oldest first (LRU order), deleting what is damaged and setting aside foreign
        entries; queue the usable ones for checksum verification."""
        self._remove_temp_files()
        try:
            paths = [p for p in self.directory.glob(f"*{SUFFIX}") if p.is_file()]
        except OSError:
            return
        entries: list[tuple[float, Path, BlockHash | None, int]] = []
        for path in paths:
            try:
                stat = path.stat()
                with open(path, "rb") as file:
                    head = file.read(DISK_ENTRY_HEADER_BYTES)
            except OSError:
                continue
            fields, reason = self._check_header(head, path.stem)
            if reason is None:
                reason = _length_problem(fields, stat.st_size)
            if reason == "fingerprint":
                self._reject(reason)
                entries.append((stat.st_mtime, path, None, stat.st_size))
            elif reason is not None:
                self._reject(reason)
                self._delete(path)
            else:
                entries.append((stat.st_mtime, path, bytes.fromhex(path.stem), stat.st_size))
        for _, path, block_hash, size in sorted(entries, key=lambda entry: entry[0]):
            if block_hash is None:
                self._foreign[path] = size
            else:
                self._index[block_hash] = size
                self._unverified.append(block_hash)
            self._used_bytes += size
        if not self._unverified:
            self._verified.set()
        if self._index:
            logger.info(
                "disk tier %s: %d blocks (%d bytes) from earlier runs",
                self.directory,
                len(self._index),
                self._used_bytes,
            )

    def _remove_temp_files(self) -> None:
        if not self.writable:
            return
        try:
            leftovers = [p for p in self.directory.glob(f".*{SUFFIX}{TEMP_SUFFIX}") if p.is_file()]
        except OSError:
            return
        for path in leftovers:
            if self._delete(path):
                self.counters.removed_temp_files += 1
        if leftovers:
            logger.warning(
                "disk tier %s: removed %d temporary files of writes a crash cut short",
                self.directory,
                len(leftovers),
            )

    def _verify_next(self) -> None:
        """Check one start-up entry's checksum (the writer's idle work)."""
        block_hash = self._unverified.popleft()
        if self.contains(block_hash):
            data = self._read_entry(block_hash)
            if data is not None:
                _, reason = self._check_entry(data, block_hash)
                if reason is not None:
                    self._drop(block_hash, reason)
        if not self._unverified:
            self._verified.set()

    # -- index -----------------------------------------------------------------------------

    def _drop(self, block_hash: BlockHash, reason: str) -> None:
        """Reject a bad indexed entry: out of the index, deleted, counted once."""
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is None:  # already dropped (the verifier and a read both saw it)
                return
            self._used_bytes -= size
        self._announce_removed(block_hash)
        self._reject(reason)
        self._delete(self._path(block_hash))

    def _delete(self, path: Path) -> bool:
        """Unlink ``path`` when the directory is writable; True when it is gone."""
        if not self.writable:
            return False
        try:
            path.unlink()
        except FileNotFoundError:
            return True
        except OSError:
            return False
        self._unsynced = True
        return True

    def _path(self, block_hash: BlockHash) -> Path:
        return self.directory / f"{block_hash.hex()}{SUFFIX}"

    def _reject(self, reason: str) -> None:
        self.counters.rejected[reason] += 1
        self._log_once(reason, _REJECT_LOGS[reason], self.directory)

    def _log_once(self, key: str, message: str, *args: object) -> None:
        """Each kind of fault is logged once per store: a failing disk must not flood."""
        if key in self._logged:
            return
        self._logged.add(key)
        logger.warning(message, *args)


def _read_header(head: bytes) -> dict[str, object] | None:
    """The header's fields when it has the magic and a JSON object; else None."""
    if not head.startswith(MAGIC):
        return None
    try:
        fields = json.loads(head[len(MAGIC) :].decode().rstrip())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return fields if isinstance(fields, dict) else None


def _is_hex(name: str) -> bool:
    try:
        bytes.fromhex(name)
    except ValueError:
        return False
    return True


def _length_problem(fields: dict[str, object], size: int) -> str | None:
    """``truncated`` / ``oversized`` when the file is not the length its header says."""
    declared = fields.get("payload_bytes")
    if not isinstance(declared, int):
        return None
    expected = DISK_ENTRY_HEADER_BYTES + declared
    if size < expected:
        return "truncated"
    return "oversized" if size > expected else None


def _checksum(payload: bytes) -> str:
    return blake2b(payload, digest_size=_CHECKSUM_BYTES).hexdigest()
