"""A host-local cache of whole files copied from the mount, shared by every process that points at it.

Layout (versioned, so a future change never misreads an old cache)::

    <root>/v1/objects/<2 hex>/<38 hex><suffix>   # hex = sha256(source path, size, mtime_ns)
    <root>/v1/tmp/                              # fills in progress
    <root>/v1/usage                             # bytes in use, guarded by an flock on it

**Identity.** A cached copy is named after the source path *and* the size and mtime the mount
reported for it (the object's size and last-modified time). A source that changes gets a new name: a
miss, never stale data. The old copy is no longer asked for and ages out. The same name on the next
run, or in another process, is a hit: the cache survives restarts while the source is unchanged.

**Atomic fill.** A miss copies the source into a private file under ``tmp/`` and renames it into
place, so another worker or process on the host sees the whole file or nothing, and two processes that
miss the same file at once both end with the same complete copy. The copy is not fsynced: after a
power loss a truncated file fails the size check at its next lookup and is fetched again.

**Bounds.** The bytes in use are kept in ``usage`` and changed under an exclusive flock, so the limit
holds for all processes together, not for each one. When a fill would pass ``capacity_bytes``, or
leave less than ``free_floor_bytes`` free on the file system, one process scans the cache and deletes
least recently used files (a hit refreshes a file's mtime) down to 90 % of the capacity, so a full
cache is not rescanned for every file. The scan also recomputes ``usage``, correcting any drift left
by a process that died between reserving room and filling it. Files used in the last
``protect_s`` seconds are never evicted: they may have just been handed to a consumer that has not
opened them yet. When room cannot be found the file is *bypassed*: the caller reads it from the mount.

**Eviction and hits.** A hit takes no lock, so one may land on a file after the scan read its mtime
and chose it. The file is therefore checked again, then moved aside (``<name>.evict.<pid>``, a name
no lookup asks for) and checked once more before it is deleted; a hit found there puts it back. A
lookup after the move is a miss, and fills the file again.

No torch in here: the cache is plain files and locks, tested on its own.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import itertools
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ucfs.config import format_size

log = logging.getLogger(__name__)

LAYOUT = "v1"

# Eviction frees down to this share of the capacity: a cache that is full stays mostly full, yet the
# next few hundred fills do not each trigger a scan of the whole directory.
EVICT_TO_FRACTION = 0.9
# A temporary file older than this belongs to a fill that died; the next eviction scan removes it.
STALE_TMP_S = 3600.0
# A copy that meets a version change (ESTALE from the mount) is tried again this many times, after
# this many seconds times the attempt: the mount's metadata TTL (1 s by default) bounds how long the
# old version can still be shown.
STALE_RETRIES = 3
STALE_RETRY_S = 0.5
# Room a process reserves at once, so that most fills do not take the cross-process lock.
CREDIT_BYTES = 64 << 20
# A stored file's mtime is its Last-Modified in whole seconds, so (size, mtime) does not tell apart two
# same-size versions written within one second. A copy made before that second had passed, plus the
# mount's metadata TTL (1 s by default) and a margin for clock skew, may hold the older of two such
# versions: it is not trusted, and is fetched again (once: the new copy is made after the window).
# The same rule as git's "racily clean" index entries.
RACY_WINDOW_NS = 3_000_000_000
NS_PER_S = 1_000_000_000
# Copy buffer: one read per file for the small samples this cache is for, few for big ones.
COPY_BUFFER_BYTES = 1 << 20


def disk_bytes(n: int) -> int:
    """Space a file of n bytes takes in whole 4 KiB file-system blocks (what `du` counts)."""
    return (n + 4095) & ~4095


@dataclass(frozen=True, slots=True)
class SourceFile:
    """A file on the mount as the listing reported it: the unit of cache identity."""

    path: str
    size: int
    mtime_ns: int


@dataclass(frozen=True, slots=True)
class Fetched:
    """Where to read a file from, and what getting it cost."""

    path: str  # the local copy, or the source itself when bypassed
    hit: bool
    copied_bytes: int = 0
    bypassed: bool = False
    direct: bool = False  # fetched from the store itself, not through the mount


class FileCache:
    """Whole-file copies under `root`. Thread-safe, fork-safe and picklable (opens nothing eagerly)."""

    def __init__(self, root: str | os.PathLike, *, capacity_bytes: int, free_floor_bytes: int,
                 protect_s: float = 60.0, direct=None):
        if capacity_bytes < 0 or free_floor_bytes < 0:
            raise ValueError("capacity_bytes and free_floor_bytes must not be negative")
        self.root = Path(root).absolute()
        self.capacity_bytes = int(capacity_bytes)
        self.free_floor_bytes = int(free_floor_bytes)
        self.protect_s = float(protect_s)
        # A `torchio._direct.DirectSource`: fills that GET the listed version from the store
        # themselves, falling back to the mount (None: always through the mount).
        self.direct = direct
        self._init_local()

    # Per-process state is rebuilt after unpickling or forking: an flock belongs to an open file
    # description, which a forked child would share with its parent (and so not exclude it).
    def _init_local(self) -> None:
        self._objects = str(self.root / LAYOUT / "objects")
        self._pid = os.getpid()
        self._thread_lock = threading.Lock()
        self._lock_fd: int | None = None
        self._ready = False
        self._tmp_ids = itertools.count()
        # Who owns a temporary file: a pid means something only in its own PID namespace (two
        # containers sharing the host's cache each have a pid 1), so the namespace goes with it.
        self._tmp_owner = f"{self._pid}_{_pid_namespace()}"
        self._warned_bypass = False
        self._credit = 0  # bytes this process has reserved in `usage` and not used yet
        self._credit_scans = -1  # the scan id `usage` had when the credit was taken

    def __getstate__(self) -> dict:
        return {"root": self.root, "capacity_bytes": self.capacity_bytes,
                "free_floor_bytes": self.free_floor_bytes, "protect_s": self.protect_s,
                "direct": self.direct}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_local()

    @property
    def base(self) -> Path:
        return self.root / LAYOUT

    def _prepare(self) -> None:
        if self._pid != os.getpid():
            self._init_local()
        if self._ready:
            return
        for d in (self.base / "objects", self.base / "tmp"):
            # 0700: copies of training data are as private as the user's access to the volume.
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._ready = True
        # Fills of processes that died mid-copy (a DataLoader worker terminated at the end of an
        # abandoned pass, a SIGKILL) leave their temporary files: remove them now, once per process.
        for e in _scandir(self.base / "tmp"):
            if _tmp_owner_dead(e.name):
                with _suppress_missing():
                    os.unlink(e.path)

    # -- identity -------------------------------------------------------------------------------
    def local_path(self, src: SourceFile) -> str:
        h = hashlib.sha256(f"{src.path}\0{src.size}\0{src.mtime_ns}".encode()).hexdigest()[:40]
        # Keep the extension: some decoders choose a format by it.
        suffix = os.path.splitext(src.path)[1]
        if len(suffix) > 16 or not suffix[1:].isalnum():
            suffix = ""
        # Plain strings, not Path objects: this runs for every sample of every epoch.
        return os.path.join(self._objects, h[:2], h[2:] + suffix)

    # -- lookup and fill ------------------------------------------------------------------------
    def lookup(self, src: SourceFile) -> str | None:
        """The local copy of `src` if there is one (and mark it recently used), else None."""
        self._prepare()
        p = self.local_path(src)
        try:
            st = os.stat(p)
        except FileNotFoundError:
            return None
        if st.st_size != src.size:
            return None  # torn by a crash (the fill is not fsynced): fetch it again
        if src.mtime_ns % NS_PER_S == 0 and st.st_ctime_ns < src.mtime_ns + RACY_WINDOW_NS:
            return None  # copied while another version of the same size and second could follow
        try:
            os.utime(p)  # recency for LRU; mount options like noatime make atime useless
        except FileNotFoundError:
            return None  # evicted this very moment
        return p

    def get(self, src: SourceFile) -> Fetched:
        """The local copy of `src`, copying it from the mount first if needed."""
        local = self.lookup(src)
        if local is not None:
            return Fetched(local, hit=True)
        return self.fill(src)

    def fill(self, src: SourceFile) -> Fetched:
        self._prepare()
        if self.direct is not None:
            data = self.direct.fetch(src.path, src.size, src.mtime_ns)
            if data is not None:
                return self._install(src, lambda fout: _write_all(fout, data), direct=True)
        for attempt in range(STALE_RETRIES + 1):
            try:
                return self._fill_through_mount(src)
            except OSError as e:
                # The object changed in the store while the mount still showed the old version: the
                # mount refuses to mix versions (ESTALE). Once it has seen the change (its metadata
                # TTL), a new open reads the new version whole.
                if e.errno != errno.ESTALE or attempt == STALE_RETRIES:
                    raise
                log.debug("%s changed while it was copied; copying it again", src.path)
                time.sleep(STALE_RETRY_S * (attempt + 1))
        raise AssertionError("unreachable")

    def _fill_through_mount(self, src: SourceFile) -> Fetched:
        with open(src.path, "rb", buffering=0) as fin:
            st = os.fstat(fin.fileno())
            actual = src
            if (st.st_size, st.st_mtime_ns) != (src.size, src.mtime_ns):
                # Changed since it was listed: what we read now is the new version; name it so.
                actual = SourceFile(src.path, st.st_size, st.st_mtime_ns)
                log.debug("%s changed since it was listed; caching its current version", src.path)
                local = self.lookup(actual)
                if local is not None:
                    return Fetched(local, hit=True)
            return self._install(actual, lambda fout: _copy(fin, fout))

    def _install(self, src: SourceFile, write, direct: bool = False) -> Fetched:
        """Make room for `src`, let `write(fout)` fill a private file with its bytes (returning how
        many) and rename that into place; or bypass the cache when no room can be made."""
        need = disk_bytes(src.size)
        scans = self._reserve(need)
        if scans is None:
            self._note_bypass(src)
            return Fetched(src.path, hit=False, bypassed=True)
        dst = self.local_path(src)
        tmp = self.base / "tmp" / f"{os.path.basename(dst)}.{self._tmp_owner}.{threading.get_ident()}.{next(self._tmp_ids)}"
        try:
            with open(tmp, "wb", buffering=0) as fout:
                copied = write(fout)
            if copied != src.size:
                raise OSError(errno.EIO, f"{src.path}: read {copied} bytes of {src.size}")
            if not self._still_counted(need, scans):
                with _suppress_missing():
                    os.unlink(tmp)
                self._note_bypass(src)
                return Fetched(src.path, hit=False, bypassed=True)
            os.makedirs(os.path.dirname(dst), mode=0o700, exist_ok=True)
            os.rename(tmp, dst)  # atomic: readers see the whole file or none
        except BaseException:
            self._release(need)
            with _suppress_missing():
                os.unlink(tmp)
            raise
        return Fetched(dst, hit=False, copied_bytes=copied, direct=direct)

    def _note_bypass(self, src: SourceFile) -> None:
        level = logging.DEBUG if self._warned_bypass else logging.WARNING
        self._warned_bypass = True
        if not log.isEnabledFor(level):
            return
        # Once per process as a warning: the numbers a user needs to see which bound it is (a disk
        # fuller than the floor is the usual one) and the options that move them.
        try:
            free = format_size(self._free_bytes())
        except OSError:
            free = "an unknown amount"
        log.log(level, "cache %s has no room for %s (%s): its disk has %s free and the cache leaves "
                "%s free (free_floor_bytes), holding at most %s (cache_size_bytes). Reading it from "
                "the mount instead%s", self.root, src.path, format_size(src.size), free,
                format_size(self.free_floor_bytes), format_size(self.capacity_bytes),
                "" if level == logging.DEBUG else "; this is said once per process")

    # -- accounting -----------------------------------------------------------------------------
    def _reserve(self, nbytes: int) -> int | None:
        """Account for `nbytes` more, evicting if needed. Returns the id of the scan the room was
        counted after (see `_still_counted`), or None when no room can be made.

        A process takes room in advance (`_credit`, up to CREDIT_BYTES or 1/64 of the capacity) so
        that most fills take no lock: with 64 copies in flight across the workers of a host, the
        flock on ``usage`` at every fill was where the copies queued. A scan recounts ``usage``
        from what is on disk, which leaves every credit out, so it bumps a scan count kept beside
        the total (a new random id per scan) and a credit taken before the last scan is void. Room taken and not used by a
        process that exits stays counted until the next scan, which a cache that seems full runs.

        Credit is room under the capacity only: the free space on the file system is another
        program's to take, so a fill on credit still looks at it (one statvfs, no lock), and below
        the floor goes the locked way, which evicts or bypasses."""
        with self._thread_lock:
            if self._credit >= nbytes and self._lock_fd is not None:
                if (self._read_usage(self._lock_fd)[1] == self._credit_scans
                        and self._free_bytes() - nbytes >= self.free_floor_bytes):
                    self._credit -= nbytes
                    return self._credit_scans
        if nbytes > self.capacity_bytes:
            return None
        chunk = min(CREDIT_BYTES, self.capacity_bytes // 64)
        with self._locked() as fd:  # holds _thread_lock too
            used, scans = self._read_usage(fd)
            if used is None:
                used, scans = self._scan_and_evict(fd, 0, evict=False), _scan_id()
            if scans != self._credit_scans:
                self._credit, self._credit_scans = 0, scans
            for extra in (chunk, 0):
                if self._fits(used, nbytes + extra):
                    self._write_usage(fd, used + nbytes + extra, scans)
                    self._credit += extra
                    return scans
            used, scans = self._scan_and_evict(fd, nbytes, evict=True), _scan_id()
            self._credit, self._credit_scans = 0, scans
            fits = self._fits(used, nbytes)
            self._write_usage(fd, used + nbytes if fits else used, scans)
            return scans if fits else None

    def _still_counted(self, nbytes: int, scans: int) -> bool:
        """Before a filled file goes into place: whether its room, counted after scan `scans`, still
        is. A scan by another process since then recounted ``usage`` from the disk while this file
        was missing or half written, and may have filled the cache up to its capacity without it:
        the rename would then pass the limit by this file (seen: 41 pages in a cache of 40). So
        count it again, under the lock, evicting if needed; False when there is no room for it now,
        and the caller reads the source instead."""
        fd = self._lock_fd
        if fd is not None and self._read_usage(fd)[1] == scans:
            return True  # no scan since: the room taken (with or without the lock) is counted
        with self._locked() as fd:
            used, now = self._read_usage(fd)
            if used is not None and self._fits(used, nbytes):
                # The scan counted what it saw of our file as a fill in progress: counting all of
                # it again errs on the side of room, until the next scan.
                self._write_usage(fd, used + nbytes, now)
                return True
            used, now = self._scan_and_evict(fd, nbytes, evict=True), _scan_id()  # counts our file
            self._credit, self._credit_scans = 0, now
            self._write_usage(fd, used, now)
            if self._fits(used - nbytes, nbytes):
                return True
            self._write_usage(fd, used - nbytes, now)  # the file will not stay
            return False

    def _release(self, nbytes: int) -> None:
        with self._thread_lock:
            self._credit += nbytes  # still counted in `usage`: the next fill of this process uses it

    def _fits(self, used: int, nbytes: int) -> bool:
        return used + nbytes <= self.capacity_bytes and self._free_bytes() - nbytes >= self.free_floor_bytes

    def _free_bytes(self) -> int:
        s = os.statvfs(self.base)
        return s.f_bavail * s.f_frsize

    def usage_bytes(self) -> int:
        """Bytes the cache accounts for (all processes)."""
        self._prepare()
        with self._locked() as fd:
            used, scans = self._read_usage(fd)
            if used is None:
                used = self._scan_and_evict(fd, 0, evict=False)
                self._write_usage(fd, used, _scan_id())
            return used

    def _scan_and_evict(self, fd: int, nbytes: int, *, evict: bool) -> int:
        """Recount what is on disk; with `evict`, delete LRU files until `nbytes` more fit. Returns the
        bytes in use afterwards. Called with the lock held."""
        now = time.time()
        files: list[tuple[int, int, str]] = []
        used = 0
        # Fills in progress first, then what is in place: a fill that moves from tmp/ to objects/
        # while this runs is then counted twice (until the next scan), never missed.
        for e in _scandir(self.base / "tmp"):
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if now - st.st_mtime > STALE_TMP_S or _tmp_owner_dead(e.name):
                with _suppress_missing():
                    os.unlink(e.path)
            else:
                used += disk_bytes(st.st_size)  # a fill in progress elsewhere (or our own)
        for sub in _scandir(self.base / "objects"):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for e in _scandir(sub.path):
                if _set_aside(e.name):
                    # Evictions run under this lock, so no other is between its two renames now: this
                    # one was left by a process that died there. It was on its way out; finish it.
                    with _suppress_missing():
                        os.unlink(e.path)
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    files.append((st.st_mtime_ns, disk_bytes(st.st_size), e.path))
                    used += disk_bytes(st.st_size)
        if not evict:
            return used
        target = min(int(self.capacity_bytes * EVICT_TO_FRACTION), self.capacity_bytes - nbytes)
        files.sort()
        freed = evicted = 0
        for mtime_ns, size, path in files:
            if used <= target and self._free_bytes() - nbytes >= self.free_floor_bytes:
                break
            if now - mtime_ns / NS_PER_S < self.protect_s:
                break  # everything from here on is in use right now
            if not self._evict(path, mtime_ns):
                continue  # used since the scan: keep it, try the next oldest
            used -= size
            freed += size
            evicted += 1
        log.info("cache %s: evicted %d files (%d bytes); %d bytes in use", self.root, evicted, freed, used)
        return used

    def _used_since(self, st: os.stat_result, scanned_ns: int) -> bool:
        """Whether a file the scan saw with mtime `scanned_ns` has been used since (a hit touched it,
        or a fill replaced it), or just now, within `protect_s`."""
        return st.st_mtime_ns != scanned_ns or time.time() - st.st_mtime < self.protect_s

    def _evict(self, path: str, scanned_ns: int) -> bool:
        """Delete cached file `path` unless a hit has used it since the scan. True when it is gone.

        A hit (`lookup`) takes no lock: it stats the file, touches it, and hands its path to a
        consumer that opens it later. Unlinking on the scan's word alone deleted files handed out
        while the scan ran, and the consumer's open failed. Moving the file aside first makes later
        lookups miss (their touch finds no file), so a touch that succeeded happened before the move
        and shows on the file moved aside: the check there is the one that counts. The check before
        the move only spares most used files the two renames. What remains is a consumer given the
        path in the moment between the first check and the move, that opens it in the moment
        between the two renames: far narrower than the whole scan before, and not closed without a
        lock on every hit.
        """
        try:
            if self._used_since(os.stat(path), scanned_ns):
                return False
        except FileNotFoundError:
            return True
        aside = f"{path}.evict.{os.getpid()}"
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return True
        try:
            keep = self._used_since(os.stat(aside), scanned_ns)
        except FileNotFoundError:
            return True
        if keep:
            # A lookup in between missed and may have filled the same name again: same source, same
            # size and mtime, same bytes. Putting ours back replaces that copy, which stays counted
            # twice (an overestimate, on the safe side) until the next scan recounts.
            os.rename(aside, path)
            return False
        with _suppress_missing():
            os.unlink(aside)
        return True

    # -- the usage file and its lock ------------------------------------------------------------
    class _Locked:
        def __init__(self, cache: "FileCache"):
            self.cache = cache

        def __enter__(self) -> int:
            c = self.cache
            c._thread_lock.acquire()  # an flock does not exclude threads sharing one descriptor
            try:
                if c._lock_fd is None:
                    c._lock_fd = os.open(c.base / "usage", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                fcntl.flock(c._lock_fd, fcntl.LOCK_EX)
            except BaseException:
                c._thread_lock.release()
                raise
            return c._lock_fd

        def __exit__(self, *exc) -> None:
            c = self.cache
            try:
                fcntl.flock(c._lock_fd, fcntl.LOCK_UN)
            finally:
                c._thread_lock.release()

    def _locked(self) -> "_Locked":
        self._prepare()
        return FileCache._Locked(self)

    @staticmethod
    def _read_usage(fd: int) -> tuple[int | None, int]:
        """(bytes in use or None when unknown, id of the last scan) from ``usage``."""
        raw = os.pread(fd, 64, 0).split()
        try:
            return int(raw[0]), int(raw[1])
        except (ValueError, IndexError):
            return None, 0  # missing, damaged, or an older layout: recount

    @staticmethod
    def _write_usage(fd: int, used: int, scans: int) -> None:
        # Fixed width, one write: a rewrite never leaves old digits behind, and a reader that takes
        # no lock (`_reserve`) sees the old line or the new one.
        os.pwrite(fd, f"{used:<20d} {scans:<20d}\n".encode(), 0)


def _copy(fin, fout) -> int:
    """Copy fin to fout; return the bytes copied.

    sendfile copies inside the kernel: no buffer to allocate and fill in Python, and one system call
    per chunk. That matters because a cold epoch is bound by CPU, ours and the mount daemon's, long
    before it is bound by the network. Falls back to plain reads where sendfile is refused.
    """
    in_fd, out_fd = fin.fileno(), fout.fileno()
    total = 0
    try:
        while True:
            n = os.sendfile(out_fd, in_fd, None, COPY_BUFFER_BYTES)
            if n == 0:
                return total
            total += n
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) or total:
            raise
    while True:
        chunk = os.read(in_fd, COPY_BUFFER_BYTES)
        if not chunk:
            return total
        view = memoryview(chunk)
        while view:
            view = view[os.write(out_fd, view):]
        total += len(chunk)


def _pid_namespace() -> int:
    """An id of this process's PID namespace (the inode of its ns link); 0 where there is none."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _tmp_owner_dead(name: str) -> bool:
    """Whether the process that made temporary file `name` (``<object>.<pid>_<pid namespace>.<thread>.<n>``)
    is gone (a zombie counts as gone). A file of another PID namespace -- another container sharing
    the cache -- is not judged here: its pid names no process of ours, dead or alive, and only the
    file's age (`STALE_TMP_S`) tells. Neither are unknown names."""
    parts = name.rsplit(".", 3)
    if len(parts) != 4:
        return False
    pid_s, sep, ns = parts[1].partition("_")
    if not pid_s.isdigit() or (sep and (not ns.isdigit() or int(ns) != _pid_namespace())):
        return False
    pid = int(pid_s)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def _set_aside(name: str) -> bool:
    """Whether `name` in objects/ is a file an eviction moved aside (``<name>.evict.<pid>``). A
    cached file's name has one dot at most (``<hex><suffix>``, see `local_path`), so no cached file
    is taken for one, whatever its extension."""
    parts = name.rsplit(".", 2)
    return len(parts) == 3 and parts[1] == "evict" and parts[2].isdigit()


def _scan_id() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 2


def _write_all(fout, data) -> int:
    view = memoryview(data)
    total = len(view)
    while view:
        view = view[fout.write(view):]
    return total


def _scandir(path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []


class _suppress_missing:
    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb) -> bool:
        return typ is not None and issubclass(typ, FileNotFoundError)
