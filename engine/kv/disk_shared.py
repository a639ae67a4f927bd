"""What lets several processes share one disk-tier directory (engine/kv/disk_store.py).

The directory is the only shared state: no lock files, no shared index, nothing a crash
can leave half-updated beyond one temporary file.

- Temporary names. A block is written to ``.<hash>.kvb.<pid>-<token>-<n>.tmp``: a random
  token per store and a counter per write, created with ``O_EXCL``, so two writers of one
  block (two processes, or two stores of one process) never share a temporary file. The
  rename that publishes it is atomic; when two publish the same block the last rename
  wins, and both wrote equal bytes.
- Who owns a temporary file. Its writer holds an ``flock`` on it from creation to the
  rename. The kernel drops that lock when the writer dies (``kill -9`` included), so a
  process that can take it knows the writer is gone and removes the file
  (``remove_orphans``); a live writer's file is never removed. An empty unlocked file is
  left alone for ``EMPTY_GRACE_S``: its writer may be between creating and locking it.
  Temporary files named the old way (``.<hash>.kvb.tmp``, one process per directory) are
  judged the same way; their writers never locked them.
- Eviction. ``exclusive()`` flocks the directory itself while a writer rescans the real
  sizes (``scan``) and evicts, so two writers never both evict for the same room.
  ``SharedBound`` keeps the total between listings and the order to evict in: foreign
  entries, then the least recently modified file of any process (a read touches it).
- Where ``flock`` is refused (some network filesystems), ``exclusive()`` goes on without
  the lock after a bounded wait (the size bound is then looser) and a temporary file is
  removed only once older than ``STALE_TEMP_S``.

Processes must share the filesystem's locks: one host, or a network filesystem whose
``flock`` works across its clients. Pure Python, no torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

TEMP_SUFFIX = ".tmp"
# An empty, unlocked temporary file younger than this may be a writer's between its
# create and its flock (microseconds apart): it is left for a later pass.
EMPTY_GRACE_S = 10.0
# Without flock, only a temporary file this old is taken for a dead writer's: a live
# write takes milliseconds.
STALE_TEMP_S = 900.0
_LOCK_POLL_S = 0.005
# Bytes a store may write between two listings, as a share of the bound: how far peers'
# writes can go unseen (per writer), against how often a writer lists the directory.
RESCAN_SHARE = 32


@dataclass(frozen=True)
class DirEntry:
    """One published entry as ``scan`` found it."""

    path: Path
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Listing:
    """The directory at one moment: published entries and temporary files."""

    entries: list[DirEntry]
    temps: list[Path]

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.entries)


class SharedDirectory:
    """Temporary-name ownership, the eviction lock and the rescan of one directory."""

    def __init__(self, directory: Path, suffix: str) -> None:
        self.directory = directory
        self.suffix = suffix
        # pid for a person reading the directory; the token for uniqueness (pids are
        # reused, and differ per container namespace, so they prove nothing alone).
        self.owner = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._counter = itertools.count()
        self.lock_refused = False  # flock on the directory failed once (logged by the store)

    # -- temporary files -------------------------------------------------------------------

    def temp_path(self, final: Path) -> Path:
        """A fresh temporary name beside ``final`` that no other writer will ever use."""
        return final.with_name(f".{final.name}.{self.owner}-{next(self._counter)}{TEMP_SUFFIX}")

    @contextlib.contextmanager
    def writing(self, tmp: Path) -> Iterator[None]:
        """Create ``tmp`` (``O_EXCL``: OSError if it exists) and hold its flock until the
        block is renamed, so ``remove_orphans`` in any process leaves it alone while this
        process lives. The caller writes and renames inside the ``with``."""
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with contextlib.suppress(OSError):  # no flock here: STALE_TEMP_S protects it
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            yield
        finally:
            os.close(fd)

    def is_temp(self, name: str) -> bool:
        return name.startswith(".") and name.endswith(TEMP_SUFFIX) and self.suffix in name

    def remove_orphans(self, temps: list[Path]) -> int:
        """Remove the temporary files among ``temps`` whose writer is gone; the number
        removed. A file locked by its writer, or empty and recent, is kept."""
        removed = 0
        for path in temps:
            if self._orphaned(path):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed += 1
        return removed

    def _orphaned(self, path: Path) -> bool:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # renamed (published) or removed since the listing
            return False
        try:
            stat = os.fstat(fd)
            age = time.time() - stat.st_mtime
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # its writer holds it: alive
            except OSError:
                return age > STALE_TEMP_S
            # The lock is ours until close: the writer is dead, or finished (then the
            # name is gone and the unlink finds nothing), or not yet locked (empty).
            return stat.st_size > 0 or age > EMPTY_GRACE_S
        finally:
            os.close(fd)

    # -- the whole directory -----------------------------------------------------------------

    def scan(self) -> Listing:
        """Published entries (``*<suffix>``, oldest modification first) and temporary
        files, by one listing; entries that vanish meanwhile are left out."""
        entries: list[DirEntry] = []
        temps: list[Path] = []
        try:
            with os.scandir(self.directory) as listing:
                for item in listing:
                    if self.is_temp(item.name):
                        temps.append(Path(item.path))
                    elif item.name.endswith(self.suffix) and not item.name.startswith("."):
                        try:
                            stat = item.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        entries.append(DirEntry(Path(item.path), stat.st_size, stat.st_mtime_ns))
        except OSError:
            pass
        entries.sort(key=lambda entry: entry.mtime_ns)
        return Listing(entries, temps)

    @contextlib.contextmanager
    def exclusive(self, timeout_s: float = 10.0) -> Iterator[bool]:
        """Hold the directory's eviction lock (an flock on the directory) while inside;
        yields False when it could not be had (refused, or a peer held it ``timeout_s``),
        and the caller goes on without it: a looser bound beats a stalled writer."""
        try:
            fd = os.open(self.directory, os.O_RDONLY)
        except OSError:
            yield False
            return
        try:
            yield self._lock(fd, timeout_s)
        finally:
            os.close(fd)  # drops the lock

    def _lock(self, fd: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(_LOCK_POLL_S)
            except OSError as exc:
                if exc.errno not in (errno.EINTR,):
                    self.lock_refused = True
                    return False


class SharedBound:
    """One store's view of the size bound all processes share, between two listings.

    ``used_bytes`` is the directory's bytes as last listed, plus this store's writes
    since, less what it saw leave. Peers' writes since the listing are unseen: that is
    why a store lists again once it has written ``capacity / RESCAN_SHARE`` bytes, so the
    bound holds to within about that much per writing process. Thread-safe.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.slack = capacity_bytes // RESCAN_SHARE
        self._lock = threading.Lock()
        self._used = 0
        self._since = 0  # bytes written since the listing
        self._order: deque[DirEntry] = deque()  # eviction candidates, first victim first
        self._touched: set[Path] = set()  # read since the listing: recent, kept
        self.listed_at = time.monotonic()

    @property
    def used_bytes(self) -> int:
        return self._used

    def clearly_fits(self, size: int) -> bool:
        """``size`` more bytes fit and the listing is fresh enough to believe it."""
        with self._lock:
            return self._fits(size) and self._since + size <= self.slack

    def stale(self, size: int) -> bool:
        """Whether to list again before evicting for ``size`` bytes."""
        with self._lock:
            return self._since + size > self.slack or not self._order

    def fits(self, size: int) -> bool:
        with self._lock:
            return self._fits(size)

    def _fits(self, size: int) -> bool:
        return self._used + size <= self.capacity_bytes

    def add(self, size: int, *, written: bool = False) -> None:
        with self._lock:
            self._used += size
            if written:
                self._since += size

    def subtract(self, size: int) -> None:
        with self._lock:
            self._used = max(0, self._used - size)

    def touch(self, path: Path) -> None:
        with self._lock:
            self._touched.add(path)

    def relist(self, listing: Listing, first: Collection[Path], rank: Mapping[Path, int]) -> None:
        """Start over from ``listing``: evict the paths in ``first`` before the rest, the
        rest oldest modification first (ties, from coarse clocks, by ``rank``: this
        store's LRU position, unknown entries first)."""
        ahead = [entry for entry in listing.entries if entry.path in first]
        rest = sorted(
            (entry for entry in listing.entries if entry.path not in first),
            key=lambda entry: (entry.mtime_ns, rank.get(entry.path, -1)),
        )
        with self._lock:
            self._order = deque(ahead + rest)
            self._touched.clear()
            self._used = listing.total_bytes
            self._since = 0
            self.listed_at = time.monotonic()

    def next_victim(self) -> DirEntry | None:
        """The next eviction candidate not read since the listing; None when none left.
        The caller checks it is unchanged (its mtime) before deleting it."""
        with self._lock:
            while self._order:
                entry = self._order.popleft()
                if entry.path not in self._touched:
                    return entry
            return None
