"""The local disk cache of object data.

A block is `block_bytes` of one object version, identified by (store, bucket, key, ETag, block index):
a changed object has a new ETag, so its old blocks are simply never asked for again (a miss, never
stale data) and age out. Each block is one file::

    <root>/v1/<2 hex>/<38 hex>.<index>     # hex = sha256(store, bucket, key, etag)

holding a 48-byte header (magic, layout version, data length, xxh3 checksum of the data, block
index, the identity hash) followed by the data. Blocks are written to a temporary file and renamed
into place, so a crash leaves either a whole block or none; the checksum catches a block damaged on
disk later, which is then deleted and fetched again.

The index (which blocks exist, their sizes and recency) lives in memory. It is filled lazily: a
mount starts at once and a background scan adds what the previous mount left, oldest first, so a
large cache never delays a mount. Eviction is least-recently-used by bytes, keeps the file system's
free space above a floor, and never removes blocks of an object version that is pinned (open).

All methods block on disk I/O; the file system calls them from worker threads.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import itertools
import logging
import os
import stat
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import xxhash

from .errors import UcfsError

log = logging.getLogger(__name__)

LAYOUT = "v1"
_MAGIC = b"UCFSBLK1"
# magic, data length, checksum of data, block index, identity hash (first 16 bytes of sha256)
_HEADER = struct.Struct("<8sIQQ16s")
HEADER_BYTES = 48  # _HEADER.size (44) padded, leaving room for a flag word in a later layout
assert _HEADER.size <= HEADER_BYTES


def _disk_bytes(n: int) -> int:
    """Space a file of n bytes takes (whole 4 KiB file system blocks): what `du` counts."""
    return (n + 4095) & ~4095


@dataclass(frozen=True, slots=True)
class ObjectVersion:
    """One version of one object: the unit of cache identity."""

    store: str
    bucket: str
    key: str
    etag: str

    @property
    def digest(self) -> str:
        h = hashlib.sha256("\0".join((self.store, self.bucket, self.key, self.etag)).encode())
        return h.hexdigest()[:40]


def ensure_private_dir(path: Path) -> Path:
    """Create `path` 0700, or check that an existing one is not writable by others.

    A cache or staging directory others can write to would let them feed us forged data.
    """
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UcfsError(f"{path}: refusing a cache directory that other users can write to "
                        f"(mode {stat.filemode(st.st_mode)}); chmod 700 it or choose another --cache-dir")
    if st.st_uid != os.geteuid():
        raise UcfsError(f"{path}: cache directory belongs to uid {st.st_uid}, not to us "
                        f"(uid {os.geteuid()}); choose another --cache-dir")
    return path


class BlockCache:
    def __init__(self, root: Path, *, size_bytes: int, free_floor_bytes: int, block_bytes: int):
        self.root = ensure_private_dir(Path(root)) / LAYOUT
        self.root.mkdir(exist_ok=True, mode=0o700)
        self.size_bytes = size_bytes
        self.free_floor_bytes = free_floor_bytes
        self.block_bytes = block_bytes
        self._lock = threading.Lock()
        self._room_lock = threading.Lock()  # one eviction pass at a time
        # name -> bytes on disk, least recently used first
        self._lru: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._used = 0
        self._pins: collections.Counter[str] = collections.Counter()
        self._scanned = threading.Event()
        self._stats = collections.Counter()
        self._tmp_ids = itertools.count(int.from_bytes(os.urandom(4), "little") << 20)
        self._subdirs: set[str] = set()
        # Free space is checked again after this many bytes were written (statvfs per block is waste).
        self._free_checked_at = 0
        self._free_cached = 0
        self._written = 0

    # -- identity -------------------------------------------------------------------------------
    def _name(self, version: ObjectVersion, index: int) -> str:
        return f"{version.digest}.{index}"

    def _path(self, name: str) -> Path:
        return self.root / name[:2] / name[2:]

    # -- pinning ------------------------------------------------------------------------------
    def pin(self, version: ObjectVersion) -> None:
        with self._lock:
            self._pins[version.digest] += 1

    def unpin(self, version: ObjectVersion) -> None:
        with self._lock:
            d = version.digest
            self._pins[d] -= 1
            if self._pins[d] <= 0:
                del self._pins[d]

    # -- lazily loaded index --------------------------------------------------------------------
    def scan(self) -> None:
        """Add blocks left by earlier mounts to the index, oldest first. Runs once, in a thread."""
        found: list[tuple[int, str, int]] = []
        try:
            for sub in os.scandir(self.root):
                if not sub.is_dir(follow_symlinks=False):
                    continue
                for e in os.scandir(sub.path):
                    if e.name.startswith(".tmp"):
                        # A block whose writer died before the rename: never valid.
                        try:
                            os.unlink(e.path)
                        except OSError:
                            pass
                        continue
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    found.append((st.st_mtime_ns, sub.name + e.name, _disk_bytes(st.st_size)))
        except OSError as e:
            log.warning("cache scan of %s failed: %s", self.root, e)
        found.sort()
        with self._lock:
            # Blocks already touched by this mount are more recent than anything found on disk.
            recent = list(self._lru.items())
            reserved = self._used - sum(self._lru.values())  # puts in progress
            self._lru.clear()
            self._used = reserved
            for _, name, size in found:
                if name not in self._lru:
                    self._lru[name] = size
                    self._used += size
            for name, size in recent:
                old = self._lru.pop(name, None)
                if old is not None:
                    self._used -= old
                self._lru[name] = size
                self._used += size
        self._scanned.set()
        log.info("cache index loaded: %d blocks, %.1f MiB", len(found), self._used / 2**20)
        self._evict()

    def wait_scanned(self, timeout: float | None = None) -> bool:
        return self._scanned.wait(timeout)

    # -- blocks -------------------------------------------------------------------------------
    def contains(self, version: ObjectVersion, index: int) -> bool:
        name = self._name(version, index)
        with self._lock:
            if name in self._lru:
                return True
            if self._scanned.is_set():
                return False
        return self._path(name).exists()

    def get_block(self, version: ObjectVersion, index: int) -> bytes | None:
        """The block's data, or None when absent or damaged (a damaged block is deleted)."""
        name = self._name(version, index)
        path = self._path(name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._forget(name)
            self._stats["misses"] += 1
            return None
        try:
            raw = os.read(fd, HEADER_BYTES + self.block_bytes + 1)
            os.utime(fd)  # recency survives a remount
        finally:
            os.close(fd)
        data = self._check(raw, version, index)
        if data is None:
            log.warning("cache block %s of %r is damaged; dropping it and fetching again", index,
                        version.key)
            self._stats["corrupt"] += 1
            self._remove(name)
            return None
        with self._lock:
            if name in self._lru:
                self._lru.move_to_end(name)
            else:
                self._lru[name] = _disk_bytes(len(raw))
                self._used += _disk_bytes(len(raw))
        self._stats["hits"] += 1
        self._stats["hit_bytes"] += len(data)
        return data

    def _check(self, raw: bytes, version: ObjectVersion, index: int) -> bytes | None:
        if len(raw) < HEADER_BYTES:
            return None
        magic, length, checksum, idx, ident = _HEADER.unpack_from(raw)
        if (magic != _MAGIC or idx != index or ident != bytes.fromhex(version.digest[:32])
                or len(raw) != HEADER_BYTES + length):
            return None
        data = memoryview(raw)[HEADER_BYTES:]
        if xxhash.xxh3_64_intdigest(data) != checksum:
            return None
        return raw[HEADER_BYTES:]

    def put_block(self, version: ObjectVersion, index: int, data: bytes | memoryview) -> bool:
        """Store a block; False when it could not be kept (no room), which callers may ignore."""
        name = self._name(version, index)
        size = _disk_bytes(HEADER_BYTES + len(data))
        if size > self.size_bytes:
            return False
        if not self._make_room(size):
            self._stats["skipped"] += 1
            return False
        path = self._path(name)
        header = _HEADER.pack(_MAGIC, len(data), xxhash.xxh3_64_intdigest(data), index,
                              bytes.fromhex(version.digest[:32])).ljust(HEADER_BYTES, b"\0")
        tmp = path.parent / f".tmp{next(self._tmp_ids)}"
        try:
            if name[:2] not in self._subdirs:
                path.parent.mkdir(exist_ok=True, mode=0o700)
                self._subdirs.add(name[:2])
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.writev(fd, [header, data])
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            with self._lock:
                self._used -= size  # give back the room reserved by _make_room
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                log.warning("cache disk full; serving %r without caching", version.key)
                self._stats["skipped"] += 1
                return False
            raise
        with self._lock:
            old = self._lru.pop(name, None)
            self._used -= old or 0  # _make_room already counted `size`
            self._lru[name] = size
            self._written += size
        self._stats["puts"] += 1
        self._stats["put_bytes"] += len(data)
        return True

    def _make_room(self, size: int) -> bool:
        """Reserve `size` bytes, evicting first, so the cache never exceeds its limit even with writes
        in flight. False when it cannot be done (everything left is pinned)."""
        with self._room_lock:
            while True:
                with self._lock:
                    fits = self._used + size <= self.size_bytes
                if fits and self._free_bytes() - size >= self.free_floor_bytes:
                    with self._lock:
                        self._used += size
                    return True
                if not self._evict_one():
                    return False

    def _free_bytes(self) -> int:
        """Free space on the cache's disk, looked up again every 64 MiB written."""
        if self._written - self._free_checked_at >= 64 << 20 or not self._free_cached:
            st = os.statvfs(self.root)
            self._free_cached = st.f_bavail * st.f_frsize
            self._free_checked_at = self._written
        return self._free_cached - (self._written - self._free_checked_at)

    def _evict_one(self) -> bool:
        with self._lock:
            victim = next((n for n in self._lru if n.split(".", 1)[0] not in self._pins), None)
        if victim is None:
            return False
        self._remove(victim)
        self._stats["evicted"] += 1
        return True

    def _evict(self) -> bool:
        """Evict LRU unpinned blocks until under the size limit and above the free floor."""
        with self._room_lock:
            while True:
                with self._lock:
                    over = self._used > self.size_bytes
                if not over and self._free_bytes() >= self.free_floor_bytes:
                    return True
                if not self._evict_one():
                    return False

    def shrink_for(self, need_bytes: int) -> int:
        """Evict least recently used unpinned blocks until `need_bytes` are freed (the disk is short
        of space for staging writes). Returns the bytes freed."""
        freed = 0
        with self._room_lock:
            while freed < need_bytes:
                before = self._used
                if not self._evict_one():
                    break
                freed += max(0, before - self._used)
        return freed

    def _remove(self, name: str) -> None:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass
        self._forget(name)

    def _forget(self, name: str) -> None:
        with self._lock:
            size = self._lru.pop(name, None)
            if size is not None:
                self._used -= size

    def drop_version(self, version: ObjectVersion, nblocks: int) -> None:
        """Remove a version's blocks (it was overwritten or deleted through this mount)."""
        for i in range(nblocks):
            self._remove(self._name(version, i))

    def statistics(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._stats)
            out.update(used_bytes=self._used, blocks=len(self._lru), limit_bytes=self.size_bytes,
                       pinned_versions=len(self._pins), index_loaded=int(self._scanned.is_set()))
        return out
