"""The disk tier of the prefix cache: one file per KV block, keyed by its prefix hash.

An entry (format: engine/kv/disk_format.py) is served only when its header names the
running configuration, its hash is the one asked for, its length is right and its
checksum matches; anything else is never loaded and is counted by reason
(``REJECT_REASONS``): ``empty``, ``truncated``, ``oversized``, ``header`` and
``checksum`` are damaged, so the file is deleted; ``fingerprint`` (another
configuration's) is kept while there is room, counts against the size bound and is
evicted first.

Shared by processes: several kvserve processes (replicas) may use one directory at once.
The files are the source of truth, each store's index a cache of them; the cross-process
parts (temporary names, their owners, the eviction lock, the rescan) are
engine/kv/disk_shared.py.

- Publish: written to a temporary name unique to the writer, fsynced, renamed. A read
  (one open) of an entry a peer evicts or replaces meanwhile gets a whole entry or a miss.
- Lookup: a hash missing from the index costs one ``stat`` and, when the file exists, a
  header read; a block a peer published is adopted. A miss is trusted ``ABSENT_TTL_S``,
  so the head of the queue does not stat its blocks every step.
- Size bound: a writer that may lack room, or wrote ``capacity / RESCAN_SHARE`` bytes
  since its last rescan, rescans the real sizes under the directory's flock and evicts
  foreign entries first, then the least recently used entry of any process (file mtime;
  a read touches it). The bound holds to within about that share per writing process.
- Crashes: a temporary file whose writer died (kill -9 included) is removed by any store
  at start and at each rescan; a live writer's never. The idle writer rescans every
  ``MAINTENANCE_INTERVAL_S``; index entries whose files are gone then leave the index.
- KV events: ``on_stored`` for a peer's block adopted by a lookup or met by a write (this
  process can serve it; the recorder announces it if it knows the block's tokens);
  ``on_removed`` for an indexed entry found gone, damaged, evicted by this store, or
  replaced by another configuration's. A peer's block never looked up is not announced.
- Processes of different configurations may share a directory, but hashes cover tokens,
  not the model: an entry of one may replace the other's of the same hash.

The directory survives restarts. On start the store removes dead writers' temporary
files, reads every entry's header (oldest modification first, the LRU order) and deletes
what is damaged; payload checksums are then verified by the writer thread whenever it has
no write to do, so a large tier does not delay start-up (a read verifies its entry anyway).

Writes go through a bounded queue to one worker thread, so the engine step never waits
for the disk: a full queue drops the write (counted). The directory is fsynced whenever
the writer runs out of work. A full disk or a read-only directory is logged once and stops
further writes; reads keep working. Pure Python (no torch): the runner hands in payload
producers and gets bytes back.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.kv.accounting import DISK_ENTRY_HEADER_BYTES
from engine.kv.block_pool import BlockHash
from engine.kv.disk_format import FORMAT_VERSION as FORMAT_VERSION
from engine.kv.disk_format import MAGIC as MAGIC
from engine.kv.disk_format import REJECT_REASONS as REJECT_REASONS
from engine.kv.disk_format import DiskFingerprint as DiskFingerprint
from engine.kv.disk_format import check_entry, check_header, is_hex, pack_entry
from engine.kv.disk_shared import RESCAN_SHARE as RESCAN_SHARE
from engine.kv.disk_shared import TEMP_SUFFIX as TEMP_SUFFIX  # re-exported: tests
from engine.kv.disk_shared import SharedBound, SharedDirectory

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
_REJECT_LOGS = {
    "empty": "disk tier %s: an empty entry (a write cut short) was deleted",
    "truncated": "disk tier %s: a truncated entry was deleted",
    "oversized": "disk tier %s: an entry longer than its header says was deleted",
    "header": "disk tier %s: an entry with a damaged header was deleted",
    "checksum": "disk tier %s: an entry failed its checksum and was deleted",
    "fingerprint": "disk tier %s: entries of another configuration are never loaded; they "
    "count against the size bound and are evicted first",
}
# Errors after which writing is pointless until restart: the disk is full or not ours.
_STOP_WRITING = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
DEFAULT_QUEUE_DEPTH = 64
# A lookup's miss is trusted this long before the file is asked again (a peer may have
# published it since): the head of the queue is retried every step.
ABSENT_TTL_S = 1.0
_MAX_ABSENT = 65536
# The idle writer rescans the directory this often: temporary files of dead writers go,
# entries peers evicted leave the index, the size is brought up to date.
MAINTENANCE_INTERVAL_S = 30.0

PayloadProducer = Callable[[], bytes]


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
    removed_temp_files: int = 0  # left by writes a crash cut short (any process's)
    adopted: int = 0  # entries peers published, found by a lookup or a write
    rescans: int = 0  # listings of the directory (start-up's scan not counted)

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
        maintenance_interval_s: float = MAINTENANCE_INTERVAL_S,
    ) -> None:
        self.directory = Path(directory)
        self.maintenance_interval_s = maintenance_interval_s
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.counters = DiskCounters()
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> file bytes
        # Entries of another configuration: path -> file bytes, oldest first.
        self._foreign: OrderedDict[Path, int] = OrderedDict()
        self._pending: set[BlockHash] = set()
        self.bound = SharedBound(capacity_bytes)
        self._logged: set[str] = set()
        self.writable = self._prepare_directory()
        self.shared = SharedDirectory(self.directory, SUFFIX)
        # Hashes a lookup found absent, trusted until _absent_until (then all forgotten).
        self._absent: set[BlockHash] = set()
        self._absent_until = 0.0
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
        """Whether the directory holds a usable entry for ``block_hash``: the index, else
        one ``stat`` (and a header read) that adopts a block a peer published."""
        with self._lock:
            if block_hash in self._index:
                return True
        return self._probe(block_hash)

    def contains_or_pending(self, block_hash: BlockHash) -> bool:
        """Index and queue only (the step asks it per eviction: no file system access);
        the writer skips a block a peer published meanwhile."""
        with self._lock:
            return block_hash in self._index or block_hash in self._pending

    @property
    def used_bytes(self) -> int:
        """Bytes of the entries in the directory (every process's, foreign ones too) at
        the last rescan, plus this store's writes since."""
        return self.bound.used_bytes

    @property
    def num_entries(self) -> int:
        """Entries this store knows it can serve (its own and the adopted)."""
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
        """Writes first; with none waiting, one start-up entry's checksum at a time, and
        a rescan of the directory every ``maintenance_interval_s``."""
        while True:
            if self._queue.empty():
                self._sync_directory()
            try:
                if self._unverified:
                    item = self._queue.get_nowait()
                else:
                    item = self._queue.get(timeout=self.maintenance_interval_s)
            except queue.Empty:
                if self._unverified:
                    self._verify_next()
                elif time.monotonic() - self.bound.listed_at >= self.maintenance_interval_s:
                    self._maintain()
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
        if self._probe(block_hash, remember_absent=False):
            return  # a peer published it since it was queued: adopted, not rewritten
        payload = produce()
        data = pack_entry(self.fingerprint, block_hash, payload)
        if len(data) > self.capacity_bytes:
            return
        self._make_room(len(data))
        path = self._path(block_hash)
        tmp = self.shared.temp_path(path)
        try:
            # Locked from creation to rename: no process's clean-up takes it for a dead
            # writer's while this one lives.
            with self.shared.writing(tmp):
                self.write_file(tmp, data)
                os.replace(tmp, path)
        except OSError as exc:
            self._on_write_error(exc, tmp)
            return
        self._unsynced = True
        with self._lock:
            self.bound.subtract(self._foreign.pop(path, 0))  # a foreign file of that name
            self._index[block_hash] = len(data)
            self._absent.discard(block_hash)
        self.bound.add(len(data), written=True)
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

    # -- room: the shared size bound --------------------------------------------------------

    def _make_room(self, size: int) -> None:
        """Evict until ``size`` more bytes fit under the bound, counting every process's
        entries: nothing to do while clearly under it; else, under the directory's lock,
        evict along the last rescan's order, rescanning first when that is stale."""
        if self.bound.clearly_fits(size):
            return
        with self.shared.exclusive() as locked:
            if not locked:
                self._log_once(
                    "lock",
                    "disk tier %s: the directory's lock was not had; evicting without it",
                    self.directory,
                )
            if self.bound.stale(size):
                self._rescan()
            if not self._evict_until_fits(size):  # the order ran out: look again
                self._rescan()
                self._evict_until_fits(size)

    def _maintain(self) -> None:
        """The idle writer's rescan: orphans go, the index and the size are brought up to
        date, and the bound is enforced (peers may have overshot it)."""
        with self.shared.exclusive():
            self._rescan()
            if self.writable:
                self._evict_until_fits(0)

    def _rescan(self) -> None:
        """List the directory: remove dead writers' temporary files, drop from the index
        (announced) and from the foreign set what is gone, take the real total size, and
        order the eviction candidates (foreign first, then least recently used)."""
        listing = self.shared.scan()
        self.counters.rescans += 1
        if self.writable:
            removed = self.shared.remove_orphans(listing.temps)
            if removed:
                self.counters.removed_temp_files += removed
                self._unsynced = True
                self._log_once(
                    "temp",
                    "disk tier %s: removed temporary files of writers that died",
                    self.directory,
                )
        present = {entry.path for entry in listing.entries}
        with self._lock:
            gone = [key for key in self._index if self._path(key) not in present]
            for key in gone:
                del self._index[key]
            for path in [path for path in self._foreign if path not in present]:
                del self._foreign[path]
            rank = {self._path(key): position for position, key in enumerate(self._index)}
            self.bound.relist(listing, set(self._foreign), rank)
        for key in gone:
            self._announce_removed(key)

    def _evict_until_fits(self, size: int) -> bool:
        """Delete entries along the last rescan's order until ``size`` more bytes fit;
        False when the order ran out first. An entry modified since the rescan (read:
        recent now; or rewritten) is skipped; one already gone is only subtracted."""
        while not self.bound.fits(size):
            entry = self.bound.next_victim()
            if entry is None:
                return False
            try:
                stat = entry.path.stat()
            except OSError:  # a peer evicted it since the rescan
                self.bound.subtract(entry.size)
                continue
            if stat.st_mtime_ns != entry.mtime_ns and entry.path not in self._foreign:
                continue
            if not self._delete(entry.path):
                continue
            self.counters.evictions += 1
            self.bound.subtract(stat.st_size)
            key = bytes.fromhex(entry.path.stem) if is_hex(entry.path.stem) else None
            with self._lock:
                self._foreign.pop(entry.path, None)
                held = key is not None and self._index.pop(key, None) is not None
            if held and key is not None:
                self._announce_removed(key)
        return True

    def _announce_removed(self, block_hash: BlockHash) -> None:
        if self.on_removed is not None:
            self.on_removed(block_hash)

    # -- reads -------------------------------------------------------------------------------

    def read(self, block_hash: BlockHash) -> bytes | None:
        """The block's payload, verified; None when absent, foreign, truncated or corrupt
        (a damaged entry is then dropped from the index, deleted and counted; one another
        configuration's peer put in its place leaves the index and is kept).

        Safe against peers: the file is read through one open, so a peer's eviction or
        replacement meanwhile yields the old whole entry, the new whole entry, or a miss."""
        if not self.contains(block_hash):
            return None
        data = self._read_entry(block_hash)
        if data is None:
            return None
        payload, reason = check_entry(self.fingerprint, data, block_hash)
        if reason == "fingerprint":
            self._set_aside(block_hash, len(data))
            return None
        if reason is not None:
            self._drop(block_hash, reason)
            return None
        path = self._path(block_hash)
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        self.bound.touch(path)  # recent: not a victim of the last rescan's order
        with contextlib.suppress(OSError):
            os.utime(path)  # the LRU order every process (and a restart) evicts by
        return payload

    def _read_entry(self, block_hash: BlockHash) -> bytes | None:
        """The entry's bytes; None (and forgotten) when the file is gone or unreadable."""
        try:
            return self._path(block_hash).read_bytes()
        except FileNotFoundError:  # evicted by a writer (any process's) since the lookup
            pass
        except OSError as exc:
            self._log_once("read", "disk tier %s: a read failed: %s", self.directory, exc)
        with self._lock:
            size = self._index.pop(block_hash, None)
        if size is not None:
            self.bound.subtract(size)
            self._announce_removed(block_hash)
        return None

    def _probe(self, block_hash: BlockHash, *, remember_absent: bool = True) -> bool:
        """Look for an entry of ``block_hash`` a peer published: one ``stat``, then a header
        read. A sound one is adopted into the index (announced as stored); another
        configuration's is set aside as foreign; a damaged one is deleted (counted). A miss
        is remembered for ABSENT_TTL_S (unless ``remember_absent``: the writer asks)."""
        now = time.monotonic()
        with self._lock:
            if now >= self._absent_until or len(self._absent) >= _MAX_ABSENT:
                self._absent.clear()
                self._absent_until = now + ABSENT_TTL_S
            if block_hash in self._absent:
                return False
        path = self._path(block_hash)
        try:
            size = path.stat().st_size
            with open(path, "rb") as file:
                head = file.read(DISK_ENTRY_HEADER_BYTES)
        except OSError:
            if remember_absent:
                with self._lock:
                    self._absent.add(block_hash)
            return False
        _, reason = check_header(self.fingerprint, head, block_hash.hex(), size)
        if reason == "fingerprint":
            with self._lock:
                if path not in self._foreign:
                    self._foreign[path] = size
            return False
        if reason is not None:
            self._reject(reason)
            if not self._delete(path):  # a read-only directory: not every lookup again
                with self._lock:
                    self._absent.add(block_hash)
            return False
        with self._lock:
            if block_hash in self._index:
                return True
            self._index[block_hash] = size
        self.counters.adopted += 1
        if self.on_stored is not None:
            self.on_stored(block_hash)
        return True

    def _set_aside(self, block_hash: BlockHash, size: int) -> None:
        """The indexed entry was replaced by another configuration's (same hash, same
        directory): out of the index (announced), kept as foreign."""
        with self._lock:
            if self._index.pop(block_hash, None) is None:
                return
            self._foreign[self._path(block_hash)] = size
        self._reject("fingerprint")
        self._announce_removed(block_hash)

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
        """Remove dead writers' temporary files; rebuild the index from the headers,
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
            _, reason = check_header(self.fingerprint, head, path.stem, stat.st_size)
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
            self.bound.add(size)
        if not self._unverified:
            self._verified.set()
        if self._index:
            logger.info(
                "disk tier %s: %d blocks (%d bytes) from earlier runs",
                self.directory,
                len(self._index),
                self.bound.used_bytes,
            )

    def _remove_temp_files(self) -> None:
        """Remove the temporary files of writers that died (a live peer's are kept)."""
        if not self.writable:
            return
        removed = self.shared.remove_orphans(self.shared.scan().temps)
        if removed:
            self._unsynced = True
            self.counters.removed_temp_files += removed
            logger.warning(
                "disk tier %s: removed %d temporary files of writes a crash cut short",
                self.directory,
                removed,
            )

    def _verify_next(self) -> None:
        """Check one start-up entry's checksum (the writer's idle work)."""
        block_hash = self._unverified.popleft()
        if self.contains(block_hash):
            data = self._read_entry(block_hash)
            if data is not None:
                _, reason = check_entry(self.fingerprint, data, block_hash)
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
        self.bound.subtract(size)
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
