"""The local disk cache of object data.

Identity. A block is `block_bytes` (1 MiB) of one object version, identified by (store, bucket, key,
ETag, block index). A changed object has a new ETag, so its old blocks are never asked for again:
a change is a miss, never stale data. Where the mount learns that a version is gone (it overwrote
or deleted the object, or saw another ETag in the store), its blocks are deleted at once (`retire`)
unless a handle still reads them: a checkpoint rewritten every epoch would otherwise fill the cache
with dead versions and push out the data set. Versions nobody told us about age out. A rename is a
copy in the store: the blocks of the version copied become the copy's (`rekey`).

Storage. Blocks fetched together (one ranged GET: up to a part, 8 blocks) are written together, as
one *segment* file::

    <root>/v3/<2 hex>/<38 hex>.<first block>.<block count>      # hex = sha256(store, bucket, key, etag)

holding a 4 KiB header page (magic, block size, data length, block range, the identity hash and an
xxh3 checksum per block) followed by the data. A segment is written to a temporary file and renamed
into place, so a crash leaves a whole segment or none; a block whose checksum fails on read (damage
on disk) takes its segment with it and is fetched again.

Why segments and O_DIRECT: a cold read writes every byte it fetches into the cache, and on the
virtual machines we run on that write cost more CPU than the fetch itself - ~2.2 s of kernel time per
GB through the page cache, ~1 s per GB as 1 MiB files written directly, ~0.15 s per GB as 8 MiB
files written directly. The header takes a whole page so the data starts page-aligned, as O_DIRECT
requires; file systems without O_DIRECT get ordinary writes. Segments under one block (whole small
objects) go through the page cache all the same: a direct write of 150 KiB waits for the disk in a
worker thread and costs a bounce buffer, and a 64-way copy of such files out of the mount read
~10 % faster with buffered writes, whose writeback the kernel batches (`SMALL_SEGMENT_BYTES`).

Reads of whole parts (`get_blocks` into the read path's page-aligned pooled buffers) are direct too:
the mount's own page cache holds what a reader got, and a second copy in the page cache of the
segment files doubled the memory a re-read took, in fresh pages. A 1 GiB re-read after a remount
went from 0.5-1.4 GB/s (buffered reads into a fresh buffer per block) to 2.0-2.3 GB/s, with the disk
threads at 0.01-0.12 CPU-s instead of 0.5-1.5. Single blocks still come through the page cache.

Index. Which blocks exist, in which segment, and how recently each segment was used, lives in memory
and is loaded lazily: the mount never waits for it. The first lookup in one of the 256 subdirectories
lists that subdirectory; a background scan loads the rest, oldest first. Eviction removes whole
segments, least recently used first, keeps the file system's free space above a floor, and never
touches segments of an object version that is pinned (open).

All methods block on disk I/O; the file system calls them from worker threads.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import itertools
import logging
import mmap
import os
import stat
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from .errors import UcfsError

log = logging.getLogger(__name__)

LAYOUT = "v3"
_MAGIC = b"UCFSSEG3"
# magic, block size, data length, first block, block count, identity hash (16 bytes of sha256)
_HEADER = struct.Struct("<8sIQQI16s")
_IDENT_OFFSET = _HEADER.size - 16  # where the identity hash lies in the header
HEADER_BYTES = 4096  # one page, so the data that follows is aligned for O_DIRECT
# Segments with less data than this are written through the page cache (see the module doc).
SMALL_SEGMENT_BYTES = 1 << 20
MAX_BLOCKS_PER_SEGMENT = (HEADER_BYTES - _HEADER.size) // 8  # one 8-byte checksum per block
_ALIGN = 4096


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
    # Its name in the cache, worked out once: a read plans block by block and asks the cache about
    # each block, and a SHA-256 per question was 4 % of the event loop's Python time in a cold
    # read (py-spy).
    digest: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        h = hashlib.sha256("\0".join((self.store, self.bucket, self.key, self.etag)).encode())
        object.__setattr__(self, "digest", h.hexdigest()[:40])


def ensure_private_dir(path: Path) -> Path:
    """Create `path` 0700, or check that an existing one is not writable by others.

    A cache or staging directory others can write to would let them feed us forged data.
    """
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = path.stat()
    except OSError as e:
        why = "not a directory" if e.errno in (errno.EEXIST, errno.ENOTDIR) else e.strerror
        raise UcfsError(f"{path}: cannot use it as a cache directory: {why}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UcfsError(f"{path}: cannot use it as a cache directory: not a directory")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UcfsError(f"{path}: refusing a cache directory that other users can write to "
                        f"(mode {stat.filemode(st.st_mode)}); chmod 700 it or choose another --cache-dir")
    if st.st_uid != os.geteuid():
        raise UcfsError(f"{path}: cache directory belongs to uid {st.st_uid}, not to us "
                        f"(uid {os.geteuid()}); choose another --cache-dir")
    return path


_HEX = frozenset("0123456789abcdef")


def _parse_name(fname: str) -> tuple[str, int, int] | None:
    """'<digest>.<first>.<count>' -> (digest, first, count); None for anything we never write.

    The digest is a version's (40 hex digits; 38 in a file name, whose directory holds the first two:
    `fname` is the whole name, directory first),
    and a segment holds 1 to MAX_BLOCKS_PER_SEGMENT blocks. A stray file that passed a looser check
    (`x.0.300000000`) made the index loop over its "blocks" for minutes, holding the cache's lock."""
    parts = fname.split(".")
    if (len(parts) != 3 or len(parts[0]) != 40 or not _HEX.issuperset(parts[0])
            or not parts[1].isdigit() or not parts[2].isdigit()):
        return None
    count = int(parts[2])
    if not 1 <= count <= MAX_BLOCKS_PER_SEGMENT:
        return None
    return parts[0], int(parts[1]), count


class BlockCache:
    def __init__(self, root: Path, *, size_bytes: int, free_floor_bytes: int, block_bytes: int):
        self.root = ensure_private_dir(Path(root)) / LAYOUT
        self.root.mkdir(exist_ok=True, mode=0o700)
        self.size_bytes = size_bytes
        self.free_floor_bytes = free_floor_bytes
        self.block_bytes = block_bytes
        self._lock = threading.Lock()
        self._room_lock = threading.Lock()  # one eviction pass at a time
        # segment name ("<digest>.<first>.<count>") -> bytes on disk, least recently used first
        self._lru: collections.OrderedDict[str, int] = collections.OrderedDict()
        # (digest, block index) -> segment name holding it
        self._blocks: dict[tuple[str, int], str] = {}
        # digest -> names of its segments (what `retire` deletes)
        self._segments: dict[str, set[str]] = {}
        self._used = 0
        self._loaded_subdirs: set[str] = set()
        self._pins: collections.Counter[str] = collections.Counter()
        self._scanned = threading.Event()
        self._stats: collections.Counter[str] = collections.Counter()
        self._direct = hasattr(os, "O_DIRECT")
        self._tls = threading.local()
        # Segments are written under a temporary name first. Ours start with a prefix of this
        # instance's own: a listing removes leftovers of writers that died, never a segment another
        # of our threads is writing (a read's disk thread listing a subdirectory for the first time,
        # or the background scan, used to delete one now and then, and its rename then failed).
        self._tmp_prefix = f".tmp{os.urandom(6).hex()}."
        self._tmp_ids = itertools.count()
        # Free space is looked up again after this many bytes were written (statvfs per write is waste).
        self._free_checked_at = 0
        self._free_cached = 0
        self._written = 0

    # -- names ----------------------------------------------------------------------------------
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
    def _list_subdir(self, sub: str) -> list[tuple[int, str, int]]:
        """(mtime, segment name, disk bytes) of the segments in one subdirectory; removes leftovers
        of writers that died before their rename (other instances' temporary files)."""
        found = []
        try:
            entries = list(os.scandir(self.root / sub))
        except FileNotFoundError:
            return found
        except OSError as e:  # a failing disk: what it holds cannot be used, reads go to the store
            log.warning("cannot list cache directory %s: %s", self.root / sub, e)
            return found
        for e in entries:
            if e.name.startswith(".tmp"):
                if not e.name.startswith(self._tmp_prefix):
                    try:
                        os.unlink(e.path)
                    except OSError:
                        pass
                continue
            if _parse_name(sub + e.name) is None:  # 38 digits here, the directory has the first two
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue  # never a segment we wrote (and a FIFO would hang the first read of it)
            found.append((st.st_mtime_ns, sub + e.name, _disk_bytes(st.st_size)))
        return found

    def _add_found(self, found: list[tuple[int, str, int]]) -> None:
        """Index segments found on disk as older than anything this mount touched (lock held)."""
        found.sort(reverse=True)  # newest first: each goes to the front, so the oldest ends up first
        for _, name, size in found:
            if name not in self._lru:
                self._index(name, size)
                self._lru.move_to_end(name, last=False)

    def _index(self, name: str, size: int) -> None:
        digest, first, count = _parse_name(name)  # type: ignore[misc]
        self._lru[name] = size
        self._used += size
        self._segments.setdefault(digest, set()).add(name)
        for i in range(first, first + count):
            self._blocks[(digest, i)] = name

    def _ensure_subdir(self, sub: str) -> None:
        if sub in self._loaded_subdirs:
            return
        found = self._list_subdir(sub)
        with self._lock:
            if sub not in self._loaded_subdirs:
                self._loaded_subdirs.add(sub)
                self._add_found(found)

    def index_loaded_for(self, version: ObjectVersion) -> bool:
        """Whether `contains` answers for this version without listing a directory first."""
        return version.digest[:2] in self._loaded_subdirs

    def load_index_for(self, version: ObjectVersion) -> None:
        """List the subdirectory holding this version's segments, if not yet (a disk thread's job:
        a subdirectory of a large cache holds thousands of segments, tens of ms to list)."""
        self._ensure_subdir(version.digest[:2])

    def scan(self) -> None:
        """Index what earlier mounts left. Runs once, in a background thread."""
        n = 0
        try:
            subs = [e.name for e in os.scandir(self.root)
                    if len(e.name) == 2 and _HEX.issuperset(e.name) and e.is_dir(follow_symlinks=False)]
        except OSError as e:
            log.warning("cache scan of %s failed: %s", self.root, e)
            subs = []
        for sub in subs:
            if sub in self._loaded_subdirs:
                continue
            found = self._list_subdir(sub)
            n += len(found)
            with self._lock:
                if sub not in self._loaded_subdirs:
                    self._loaded_subdirs.add(sub)
                    self._add_found(found)
        self._scanned.set()
        log.info("cache index loaded: %d segment(s), %.1f MiB", n, self._used / 2**20)
        self._evict()

    def wait_scanned(self, timeout: float | None = None) -> bool:
        return self._scanned.wait(timeout)

    # -- reading --------------------------------------------------------------------------------
    def contains(self, version: ObjectVersion, index: int) -> bool:
        d = version.digest
        self._ensure_subdir(d[:2])
        with self._lock:
            return (d, index) in self._blocks

    def get_block(self, version: ObjectVersion, index: int) -> bytes | None:
        """The block's data, or None when absent or damaged (a damaged segment is deleted)."""
        d = version.digest
        self._ensure_subdir(d[:2])
        with self._lock:
            name = self._blocks.get((d, index))
        if name is None:
            self._stats["misses"] += 1
            return None
        return self._read_segment(version, name, index, None)  # type: ignore[return-value]

    def get_blocks(self, version: ObjectVersion, first: int, into: memoryview, *,
                   aligned: bool = False) -> list[bool]:
        """Blocks `first`, `first + 1`, ... read into `into`, block k at k * block_bytes; as many as
        `into` holds, the last of them as short as the object's last block. Returns, per block,
        whether it was there (a damaged segment is deleted and its blocks missing).

        The read path's way in: one open and one read per segment, into a buffer the caller reuses.
        A fresh buffer per block (`get_block`) costs a page fault per 4 KiB, which in a re-read
        from the cache after a remount took the disk threads more time than the reads themselves."""
        B = self.block_bytes
        count = -(-len(into) // B)
        d = version.digest
        self._ensure_subdir(d[:2])
        with self._lock:
            names = [self._blocks.get((d, first + k)) for k in range(count)]
        found = [False] * count
        k = 0
        while k < count:
            name = names[k]
            j = k + 1
            if name is None:
                self._stats["misses"] += 1
            else:
                while j < count and names[j] == name:
                    j += 1
                part = into[k * B:min(j * B, len(into))]
                if self._read_segment(version, name, first + k, part, aligned) is not None:
                    found[k:j] = [True] * (j - k)
            k = j
        return found

    def _read_segment(self, version: ObjectVersion, name: str, index: int, into: memoryview | None,
                      aligned: bool = False) -> bytes | memoryview | None:
        """Blocks of segment `name` from block `index` on: into `into` (its length says how many
        bytes), or with `into` None the one block `index` in a new buffer. Each block read is checked
        against its checksum. None when the segment is gone, damaged or unreadable (then deleted).
        `aligned`: `into` is page-aligned memory, so whole pages of it are read with O_DIRECT."""
        d = version.digest
        _, first, count = _parse_name(name)  # type: ignore[misc]
        failure: OSError | None = None
        got: bytes | memoryview | None = None
        direct = aligned and self._direct and into is not None and len(into) % _ALIGN == 0
        try:
            fd = self._open_for_reading(name, direct)
            direct = direct and self._direct
        except FileNotFoundError:
            self._forget(name)
            self._stats["misses"] += 1
            return None
        except OSError as e:
            fd, failure = None, e
        try:
            checked = None
            if fd is not None:
                if direct:
                    page = self._header_page()
                    header = page[:] if os.preadv(fd, [page], 0) == HEADER_BYTES else b""
                else:
                    header = os.pread(fd, HEADER_BYTES, 0)
                checked = self._check_header(header, d, first, count)
            if checked is not None:
                length, sums = checked
                off = (index - first) * self.block_bytes
                want = min(self.block_bytes, length - off) if into is None else len(into)
                if 0 < want and off + want <= length:
                    if into is None:
                        got = os.pread(fd, want, HEADER_BYTES + off)
                    elif os.preadv(fd, [into], HEADER_BYTES + off) == want:
                        got = into
                    if got is not None and (len(got) != want or not self._sums_match(got, sums, index - first)):
                        got = None
            if got is not None and self._stats["hits"] % 64 == 0:
                try:
                    os.utime(fd)  # recency survives a remount (not on every hit: a disk write)
                except OSError:
                    pass  # a read-only cache disk still serves what it holds
        except OSError as e:
            # The disk could not give the block back (EIO; something that is not a segment file):
            # as for a bad checksum, the store still has it. The read must not fail for it.
            got, failure = None, e
        finally:
            if fd is not None:
                os.close(fd)
        if got is None:
            log.warning("cache segment %s of %r is %s; dropping it and fetching again", name,
                        version.key, f"unreadable ({failure})" if failure else "damaged")
            self._stats["corrupt"] += 1
            self._remove(name)
            return None
        with self._lock:
            if name in self._lru:
                self._lru.move_to_end(name)
        nblocks = -(-len(got) // self.block_bytes)
        self._stats["hits"] += nblocks
        self._stats["hit_bytes"] += len(got)
        return got

    def _open_for_reading(self, name: str, direct: bool) -> int:
        if direct:
            try:
                return os.open(self._path(name), os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                log.info("%s does not take O_DIRECT; reading cache blocks through the page cache", self.root)
                self._direct = False
        return os.open(self._path(name), os.O_RDONLY)

    def _sums_match(self, data: bytes | memoryview, sums: tuple[int, ...], k0: int) -> bool:
        """Whether each block of `data` (segment blocks k0, k0 + 1, ...) has its checksum."""
        B = self.block_bytes
        view = memoryview(data)
        return all(xxhash.xxh3_64_intdigest(view[i:i + B]) == sums[k0 + i // B]
                   for i in range(0, len(view), B))

    def _check_header(self, header: bytes, digest: str, first: int, count: int):
        if len(header) < _HEADER.size + 8 * count:
            return None
        magic, bsize, length, hfirst, hcount, ident = _HEADER.unpack_from(header)
        if (magic != _MAGIC or bsize != self.block_bytes or hfirst != first or hcount != count
                or ident != bytes.fromhex(digest[:32]) or length > count * bsize):
            return None
        sums = struct.unpack_from(f"<{count}Q", header, _HEADER.size)
        return length, sums

    # -- writing --------------------------------------------------------------------------------
    def put_blocks(self, version: ObjectVersion, first: int, data: bytes | memoryview,
                   backing: mmap.mmap | None = None) -> bool:
        """Store consecutive blocks starting at `first` (all full but maybe the last) as one segment.
        False when they could not be kept (no room, disk full or failing), which callers may ignore.

        `backing`: a page-aligned buffer that `data` starts at (the read path's pooled GET buffers);
        the segment is then written from it directly, without a copy."""
        B = self.block_bytes
        count = (len(data) + B - 1) // B
        if count == 0 or count > MAX_BLOCKS_PER_SEGMENT:
            raise ValueError(f"a segment holds 1 to {MAX_BLOCKS_PER_SEGMENT} blocks, not {count}")
        d = version.digest
        self._ensure_subdir(d[:2])
        name = f"{d}.{first}.{count}"
        with self._lock:
            if name in self._lru:
                # The same blocks of the same version, already here (two fetches of one part, or a
                # commit's and a read's). Not written again: a removal of the segment (eviction,
                # `retire`) between our rename and our indexing would have unlinked our file and
                # left its name indexed, and its bytes counted, with nothing on disk.
                self._lru.move_to_end(name)
                return True
        size = _disk_bytes(HEADER_BYTES + len(data))
        if size > self.size_bytes:
            return False
        if not self._make_room(size):
            self._stats["skipped"] += 1
            return False
        view = memoryview(data)
        sums = [xxhash.xxh3_64_intdigest(view[k * B:(k + 1) * B]) for k in range(count)]
        header = _HEADER.pack(_MAGIC, B, len(data), first, count, bytes.fromhex(d[:32])) + \
            struct.pack(f"<{count}Q", *sums)
        path = self._path(name)
        tmp = path.parent / f"{self._tmp_prefix}{next(self._tmp_ids)}"
        try:
            path.parent.mkdir(exist_ok=True, mode=0o700)
            self._write_file(tmp, header, view, backing)
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            with self._lock:
                self._used -= size  # give back the room reserved by _make_room
            # The cache is an optimisation: whatever keeps a segment from being written (a full
            # disk, one remounted read-only or failing, a directory refusing new files) costs the
            # caching only, never the read or the commit that asked for it.
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                log.warning("cache disk full; serving %r without caching", version.key)
            else:
                log.warning("could not write cache blocks of %r: %s", version.key, e)
                self._stats["write_errors"] += 1
            self._stats["skipped"] += 1
            return False
        with self._lock:
            old = self._lru.pop(name, None)
            self._used -= size + (old or 0)  # _index counts it again
            self._index(name, size)
            self._written += size
        self._stats["puts"] += 1
        self._stats["put_bytes"] += len(data)
        return True

    def put_block(self, version: ObjectVersion, index: int, data: bytes | memoryview) -> bool:
        return self.put_blocks(version, index, data)

    def _write_file(self, path: Path, header: bytes, data: memoryview, backing: mmap.mmap | None) -> None:
        """Write header page + data, directly to the disk when possible (see the module doc)."""
        if self._direct and len(data) >= SMALL_SEGMENT_BYTES:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                log.info("%s does not take O_DIRECT; writing cache blocks through the page cache", self.root)
                self._direct = False
            else:
                self._write_direct(fd, header, data, backing)
                return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.writev(fd, [header.ljust(HEADER_BYTES, b"\0"), data])
        finally:
            os.close(fd)

    def _write_direct(self, fd: int, header: bytes, data: memoryview, backing: mmap.mmap | None) -> None:
        """O_DIRECT needs page-aligned memory and lengths: the header goes in a page of its own, the
        data is written from its aligned buffer (or a copy in one), padded, then truncated."""
        n = len(data)
        padded = (n + _ALIGN - 1) & ~(_ALIGN - 1)
        page = self._header_page()
        page[:len(header)] = header
        page[len(header):] = bytes(HEADER_BYTES - len(header))
        tmpbuf = None
        if backing is not None and len(backing) >= padded:
            body = memoryview(backing)[:padded]  # the bytes past n are truncated away below
        else:
            tmpbuf = mmap.mmap(-1, max(padded, _ALIGN))  # small segments mostly
            tmpbuf[:n] = data
            body = memoryview(tmpbuf)[:padded]
        try:
            written = os.pwritev(fd, [page, body], 0)
            if written != HEADER_BYTES + padded:
                raise OSError(errno.EIO, f"short cache write ({written} of {HEADER_BYTES + padded} bytes)")
            if padded != n:
                os.ftruncate(fd, HEADER_BYTES + n)
        finally:
            os.close(fd)
            body.release()  # the pooled buffer may only be reused once no view of it is left
            if tmpbuf is not None:
                tmpbuf.close()

    def _header_page(self) -> mmap.mmap:
        """This thread's page-aligned header page (O_DIRECT needs aligned memory)."""
        page = getattr(self._tls, "page", None)
        if page is None:
            page = self._tls.page = mmap.mmap(-1, HEADER_BYTES)
        return page

    # -- room -----------------------------------------------------------------------------------
    def _make_room(self, size: int) -> bool:
        """Reserve `size` bytes, evicting first, so the cache never exceeds its limit even with writes
        in flight. False when it cannot be done (everything left is pinned)."""
        with self._room_lock:
            while True:
                with self._lock:
                    fits = self._used + size <= self.size_bytes
                if fits and self._above_floor_after(size):
                    with self._lock:
                        self._used += size
                    return True
                if not self._evict_one():
                    return False

    def _above_floor_after(self, size: int) -> bool:
        """Whether writing `size` bytes leaves the disk above the free-space floor. The estimate
        ignores what others freed and what we evicted since the last look: where it says no, the
        disk itself is asked before anything is evicted for it."""
        floor = self.free_floor_bytes
        return self._free_bytes() - size >= floor or self._free_bytes(fresh=True) - size >= floor

    def _free_bytes(self, fresh: bool = False) -> int:
        """Free space on the cache's disk, looked up again every 64 MiB written (or when `fresh`)."""
        if fresh or self._written - self._free_checked_at >= 64 << 20 or not self._free_cached:
            st = os.statvfs(self.root)
            self._free_cached = st.f_bavail * st.f_frsize
            self._free_checked_at = self._written
        return self._free_cached - (self._written - self._free_checked_at)

    def _evict_one(self) -> bool:
        with self._lock:
            victim = next((n for n in self._lru if n[:40] not in self._pins), None)
        if victim is None:
            return False
        self._remove(victim)
        self._stats["evicted"] += 1
        return True

    def _evict(self) -> bool:
        """Evict LRU unpinned segments until under the size limit and above the free floor."""
        with self._room_lock:
            while True:
                with self._lock:
                    over = self._used > self.size_bytes
                if not over and self._above_floor_after(0):
                    return True
                if not self._evict_one():
                    return False

    def may_hold(self, version: ObjectVersion, blocks: int = 0) -> bool:
        """Whether some block of the version, or with `blocks` each of its first `blocks` blocks,
        may be on disk: False only where the index says not. Asks the index only (no disk I/O, for
        the event loop)."""
        d = version.digest
        with self._lock:
            if d[:2] not in self._loaded_subdirs and not self._scanned.is_set():
                return True  # (once the scan is done, the index has all: it lists what exists)
            if not blocks:
                return d in self._segments
            return all((d, i) in self._blocks for i in range(blocks))

    def retire(self, version: ObjectVersion) -> int:
        """Delete the segments of a version nobody will ask for again (replaced or deleted in the
        store); not while it is pinned: an open handle still reads it (the mount asks again at the
        handle's last close). Returns the bytes freed."""
        d = version.digest
        self._ensure_subdir(d[:2])
        with self._lock:
            if d in self._pins:
                return 0
            names = list(self._segments.get(d, ()))
            freed = sum(self._lru.get(n, 0) for n in names)
        for name in names:
            self._remove(name)
        if names:
            self._stats["retired"] += len(names)
        return freed

    def rekey(self, old: ObjectVersion, new: ObjectVersion) -> int:
        """`new` is a copy the store made of `old` (a rename: the same bytes under another key, often
        with another ETag): old's segments become new's, so that what was read before `mv` is not
        fetched again after it. Each segment gets new's identity in its header, then new's name; a
        crash between the two leaves a header naming another version than the file name, which a
        read rejects (a miss, never wrong data). Not while `old` is pinned: its readers go on asking
        for it by its own name (it is retired at their last close). Returns the bytes moved."""
        d, nd = old.digest, new.digest
        if d == nd:
            return 0
        self._ensure_subdir(d[:2])
        self._ensure_subdir(nd[:2])
        ident = bytes.fromhex(nd[:32])
        moved = 0
        with self._room_lock:  # no eviction removes a segment while it is moved
            with self._lock:
                if d in self._pins:
                    return 0
                names = sorted(self._segments.get(d, ()))
            for name in names:
                _, first, count = _parse_name(name)  # type: ignore[misc]
                new_name = f"{nd}.{first}.{count}"
                path, new_path = self._path(name), self._path(new_name)
                try:
                    fd = os.open(path, os.O_WRONLY)
                    try:
                        if os.pwrite(fd, ident, _IDENT_OFFSET) != len(ident):
                            raise OSError(errno.EIO, "short write of a segment header")
                    finally:
                        os.close(fd)
                    new_path.parent.mkdir(exist_ok=True, mode=0o700)
                    os.replace(path, new_path)
                    size = _disk_bytes(os.stat(new_path).st_size)
                except FileNotFoundError:
                    self._forget(name)  # retired meanwhile
                    continue
                except OSError as e:
                    # Whichever version its header names now, it is not to be trusted: drop it.
                    log.info("could not move cache segment %s to %s: %s", name, new_name, e)
                    self._remove(name)
                    continue
                self._forget(name)
                self._forget(new_name)  # a read of the new name that fetched the same blocks first
                with self._lock:
                    self._index(new_name, size)
                moved += size
        if moved:
            self._stats["moved"] += 1
        return moved

    def shrink_for(self, need_bytes: int) -> int:
        """Evict least recently used unpinned segments until `need_bytes` are freed (the disk is
        short of space for staging writes). Returns the bytes freed."""
        freed = 0
        with self._room_lock:
            while freed < need_bytes:
                before = self._used
                if not self._evict_one():
                    break
                freed += max(0, before - self._used)
        self._free_cached = 0  # look again
        return freed

    def _remove(self, name: str) -> None:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass
        except OSError as e:  # not ours to delete (a directory), or a failing disk: just forget it
            log.warning("could not remove cache segment %s: %s", name, e)
        self._forget(name)

    def _forget(self, name: str) -> None:
        with self._lock:
            size = self._lru.pop(name, None)
            if size is None:
                return
            self._used -= size
            digest, first, count = _parse_name(name)  # type: ignore[misc]
            names = self._segments.get(digest)
            if names is not None:
                names.discard(name)
                if not names:
                    del self._segments[digest]
            for i in range(first, first + count):
                if self._blocks.get((digest, i)) == name:
                    del self._blocks[(digest, i)]

    def statistics(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._stats)
            out.update(used_bytes=self._used, segments=len(self._lru), blocks=len(self._blocks),
                       limit_bytes=self.size_bytes, pinned_versions=len(self._pins),
                       index_loaded=int(self._scanned.is_set()))
        return out
