"""The disk tier of the prefix cache: one file per KV block, keyed by its prefix hash.

File format (version ``FORMAT_VERSION``)::

    bytes [0, 8)        magic b"KVSBLK01"
    bytes [8, 512)      JSON header, space-padded: format, the configuration fingerprint
                        (model, dtype, KV dtype, block size, layer/head shape), the block's
                        hash, payload length and a BLAKE2b checksum of the payload
    bytes [512, ...)    payload: the block's K, V (and scale) bytes, as the runner packs them

An entry is served only when its header names the running configuration, its hash is the
one asked for, its length is right and its checksum matches: anything else is skipped
(and a corrupt file deleted), never loaded. The directory survives restarts; on start the
headers are scanned (oldest modification first) to rebuild the LRU index.

Writes go through a bounded queue to one worker thread, so the engine step never waits
for the disk: a full queue drops the write (counted). A full disk or a read-only
directory is logged once and stops further writes; reads keep working. Pure Python (no
torch): the runner hands in payload producers and gets bytes back.
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
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from hashlib import blake2b
from pathlib import Path

from engine.kv.accounting import DISK_ENTRY_HEADER_BYTES
from engine.kv.block_pool import BlockHash

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"KVSBLK01"
SUFFIX = ".kvb"
_CHECKSUM_BYTES = 16
# Errors after which writing is pointless until restart: the disk is full or not ours.
_STOP_WRITING = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
DEFAULT_QUEUE_DEPTH = 64

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

    def as_dict(self) -> dict[str, object]:
        return {
            "model": self.model,
            "dtype": self.dtype,
            "kv_dtype": self.kv_dtype,
            "block_size": self.block_size,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
        }


@dataclass
class DiskCounters:
    """Monotonic counters of the disk tier (read by the stats snapshot)."""

    writes: int = 0
    bytes_written: int = 0
    dropped_writes: int = 0
    failed_writes: int = 0
    rejected_entries: int = 0  # corrupt, truncated or from another configuration
    evictions: int = 0


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
        self._pending: set[BlockHash] = set()
        self._used_bytes = 0
        self._logged: set[str] = set()
        self.writable = self._prepare_directory()
        self._queue: queue.Queue[tuple[BlockHash, PayloadProducer] | None] = queue.Queue(
            maxsize=queue_depth
        )
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
        return self._used_bytes

    @property
    def num_entries(self) -> int:
        return len(self._index)

    @property
    def dropped_writes(self) -> int:
        return self.counters.dropped_writes

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
        """Finish queued writes (bounded) and stop the worker."""
        self.flush(timeout_s)
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            return
        self._worker.join(timeout=timeout_s)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
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
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            self.write_file(tmp, data)
            os.replace(tmp, path)
        except OSError as exc:
            self._on_write_error(exc, tmp)
            return
        with self._lock:
            self._index[block_hash] = len(data)
            self._used_bytes += len(data)
        self.counters.writes += 1
        self.counters.bytes_written += len(data)

    def write_file(self, path: Path, data: bytes) -> None:
        """The one place bytes reach the disk (tests substitute a failing one)."""
        with open(path, "wb") as file:
            file.write(data)

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
        while True:
            with self._lock:
                if self._used_bytes + size <= self.capacity_bytes or not self._index:
                    return
                victim, victim_size = self._index.popitem(last=False)
                self._used_bytes -= victim_size
            self.counters.evictions += 1
            with contextlib.suppress(OSError):
                self._path(victim).unlink()

    def _header(self, block_hash: BlockHash, payload: bytes) -> bytes:
        fields = {
            "format": FORMAT_VERSION,
            **self.fingerprint.as_dict(),
            "hash": block_hash.hex(),
            "payload_bytes": len(payload),
            "checksum": blake2b(payload, digest_size=_CHECKSUM_BYTES).hexdigest(),
        }
        text = json.dumps(fields, separators=(",", ":")).encode()
        room = DISK_ENTRY_HEADER_BYTES - len(MAGIC)
        if len(text) > room:
            raise ValueError(f"disk tier header of {len(text)} bytes exceeds {room}")
        return MAGIC + text.ljust(room)

    # -- reads -------------------------------------------------------------------------------

    def read(self, block_hash: BlockHash) -> bytes | None:
        """The block's payload, verified; None when absent, foreign, truncated or corrupt
        (the bad entry is then dropped from the index and deleted)."""
        if not self.contains(block_hash):
            return None
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # evicted by the writer since the lookup
            self._forget(block_hash, delete=False)
            return None
        except OSError as exc:
            self._log_once("read", "disk tier %s: a read failed: %s", self.directory, exc)
            self._forget(block_hash, delete=False)
            return None
        payload = self._verified_payload(data, block_hash)
        if payload is None:
            self._forget(block_hash, delete=True)
            return None
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        with contextlib.suppress(OSError):
            os.utime(path)  # the LRU order survives a restart
        return payload

    def _verified_payload(self, data: bytes, block_hash: BlockHash) -> bytes | None:
        header = self._parse_header(data[:DISK_ENTRY_HEADER_BYTES])
        if header is None or header.get("hash") != block_hash.hex():
            self._reject("corrupt", "disk tier %s: a corrupt entry header was skipped")
            return None
        payload = data[DISK_ENTRY_HEADER_BYTES:]
        if len(payload) != header.get("payload_bytes"):
            self._reject("truncated", "disk tier %s: a truncated entry was skipped")
            return None
        checksum = blake2b(payload, digest_size=_CHECKSUM_BYTES).hexdigest()
        if checksum != header.get("checksum"):
            self._reject("checksum", "disk tier %s: an entry failed its checksum and was skipped")
            return None
        return payload

    def _parse_header(self, head: bytes) -> dict[str, object] | None:
        """The header's fields when it is well-formed and names this configuration."""
        if len(head) < DISK_ENTRY_HEADER_BYTES or not head.startswith(MAGIC):
            return None
        try:
            fields = json.loads(head[len(MAGIC) :].decode().rstrip())
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
        if not isinstance(fields, dict):
            return None
        if fields.get("format") != FORMAT_VERSION:
            return None
        if any(fields.get(key) != value for key, value in self.fingerprint.as_dict().items()):
            return None
        return fields

    # -- index -----------------------------------------------------------------------------

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
        """Rebuild the index from the files' headers, oldest first (LRU order)."""
        try:
            paths = [p for p in self.directory.glob(f"*{SUFFIX}") if p.is_file()]
        except OSError:
            return
        entries = []
        for path in paths:
            try:
                stat = path.stat()
                with open(path, "rb") as file:
                    head = file.read(DISK_ENTRY_HEADER_BYTES)
            except OSError:
                continue
            header = self._parse_header(head)
            valid = header is not None and path.stem == header.get("hash")
            if not valid or header is None:
                self._reject(
                    "foreign",
                    "disk tier %s: entries of another configuration or "
                    "with a bad header are ignored",
                )
                continue
            expected = DISK_ENTRY_HEADER_BYTES + int(str(header.get("payload_bytes")))
            if stat.st_size != expected:
                self._reject("truncated", "disk tier %s: a truncated entry was skipped")
                continue
            entries.append((stat.st_mtime, bytes.fromhex(path.stem), stat.st_size))
        for _, block_hash, size in sorted(entries):
            self._index[block_hash] = size
            self._used_bytes += size
        if entries:
            logger.info(
                "disk tier %s: %d blocks (%d bytes) from earlier runs",
                self.directory,
                len(entries),
                self._used_bytes,
            )

    def _forget(self, block_hash: BlockHash, *, delete: bool) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._used_bytes -= size
        if delete and self.writable:
            with contextlib.suppress(OSError):
                self._path(block_hash).unlink()

    def _path(self, block_hash: BlockHash) -> Path:
        return self.directory / f"{block_hash.hex()}{SUFFIX}"

    def _reject(self, key: str, message: str) -> None:
        self.counters.rejected_entries += 1
        self._log_once(key, message, self.directory)

    def _log_once(self, key: str, message: str, *args: object) -> None:
        """Each kind of fault is logged once per store: a failing disk must not flood."""
        if key in self._logged:
            return
        self._logged.add(key)
        logger.warning(message, *args)
