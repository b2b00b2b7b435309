"""Write-behind: files are written to local staging files and committed to the store in the background.

Life of a written file (README "Semantics": Writes, Durability):

1. Opening for writing gives the inode a `Staged` file in the staging directory (empty for a new or
   truncated file, otherwise a copy of the object; empty ones are made a few ahead of time). Every
   handle, readers included, now reads it: read-your-writes.
2. `write()` goes to the staging file. A large file written front to back starts a multipart upload
   while it is being written (`Stream`): each full part is uploaded as soon as it is written, so the
   commit completes soon after `close()`.
3. `close()` (FUSE flush) makes the staging file durable (fdatasync) and writes a journal record, then
   queues the file and returns. From here on a crash loses nothing: the next mount replays the journal.
   One exception: a stream whose upload is close behind the writer is finished instead, when by
   the rates measured here that is sooner than the sync (`_close_commits`). Most of the file is in
   the store already, so completing the upload can take less than writing the whole staging file to
   the disk, and the data is then durable in the store itself; the staging file is never synced at
   all, and goes without reaching the disk.
4. A bounded pool of commit workers uploads queued files oldest first: one PUT for small files, a
   multipart upload with parallel parts for large ones. A reader elsewhere sees the old object or the
   new one, never a mixture: parts are read under the file's lock and the upload is abandoned if the
   file changed underneath it.
5. On success the journal row goes; the staging file goes too once no handle has it open and it has
   not changed since. Transient failures are retried with jittered, capped exponential backoff;
   permanent ones are kept, logged, shown by `ucfs status` and returned by the next fsync/close.

`fsync(file)` waits until the file's current content is committed; `fsync(dir)` until everything
pending beneath the directory is. fsync commits in the caller's time, without syncing the staging
file first; only if that fails does it fall back to a durable close and the retrying workers.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import random
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio
import xxhash

from . import errors
from .aiostore import AsyncStore, pread_local, run_disk
from .cache import ObjectVersion, ensure_private_dir
from .catalog import Volume
from .config import MiB, MountConfig
from .inodes import Inode
from .journal import DELETE, INTENT, Journal, Record
from .s3http import FileBody
from .store import MAX_OBJECT_BYTES, MAX_PARTS, ObjectInfo

if TYPE_CHECKING:
    from .core import Core, FileHandle

log = logging.getLogger(__name__)

# Files up to this size are committed with one PUT; larger ones as a multipart upload.
SINGLE_PUT_MAX_BYTES = 16 * MiB
# A file of up to one PUT waits this long after its last close before a worker takes it. Saving a
# file atomically (rsync, editors, `torch.save` to a temporary name, then `os.replace`) renames or
# removes it right after the close, once the kernel has looked up the new name, a store round
# trip. Taken at once, such a file cost a PUT under the temporary name, a COPY and a DELETE, and
# the rename waited for the PUT; taken after the rename, one PUT under the final name, and nothing
# at all for a temporary file removed. An fsync() or an unmount does not wait for it.
COMMIT_SETTLE_S = 0.1
# A stream (upload while writing) starts once a file opened for writing has grown this large by
# appends only: smaller files are cheaper to send whole at close.
STREAM_START_BYTES = 32 * MiB
# Flush written data to the disk in the background every this many bytes, so the fdatasync at
# close() has little left to do. Not while a stream keeps up with the writer: its close() completes
# the upload instead of syncing, and the staged bytes need never reach the disk.
BACKGROUND_SYNC_BYTES = 64 * MiB
# ... nor while a stream is at most this many windows (parts in flight) behind the writer, unless
# the upload is known to be slower than the local disk (then close() will sync: see `_close_commits`).
STREAM_LAG_WINDOWS = 4
# A sync of at least this many bytes measures the staging disk's write rate (smaller ones measure
# mostly latency); a stream measures its upload rate once it has sent this many bytes.
RATE_SAMPLE_BYTES = 16 * MiB
# Weight of the newest sample in the staging disk's measured write rate.
SYNC_RATE_WEIGHT = 0.3
# The staging disk's measured rate is gone by for this long after its last sample; then it counts as
# not measured (the next stream's first background sync is not skipped), and the next sample
# replaces it. A disk thought slower than an upload is never synced by a stream that keeps up, so
# without this one slow sample would decide every close() for as long as the daemon runs.
SYNC_RATE_MAX_AGE_S = 60.0
# close() finishes a stream unless syncing is expected to be more than this many times sooner: a
# finished upload leaves nothing behind (no journal row, no upload to come, a staging file that never
# reaches the disk), while after a sync the whole upload is still to do.
CLOSE_UPLOAD_PREFERENCE = 2.0
# A file being written checks the staging disk's free space (making room by evicting cache, or
# refusing with ENOSPC) once per this many bytes written: often enough not to overrun the floor by
# much, seldom enough that a 1 MiB write does not pay a statfs in a disk thread every time. (A check
# keyed to unsynced bytes ran at every write of a stream that kept up, since such a stream is never
# synced: a second thread trip in the writer's serial chain of requests.)
SPACE_CHECK_BYTES = 16 * MiB
# Retry delays for transient failures: doubling from the first, jittered, capped.
RETRY_FIRST_S = 0.5
RETRY_CAP_S = 60.0
# A multipart upload a killed daemon may have created but never recorded is looked for, to be named in
# the log, among the key's uploads created from this long before its intent record (the store's
# clock against ours)...
INTENT_CLOCK_SLACK_S = 120.0
# ... to this long after it (a create that took its retries, plus the same slack).
INTENT_CREATE_WINDOW_S = 600.0
# Empty staging files made ahead of time. The kernel holds a directory's lock while we handle a
# create in it, so a 64-way copy into one directory creates one file at a time; a create that had
# to wait for a disk thread (busy with fsyncs and cache writes) to make its staging file held up all
# the others. A spare is taken without leaving the event loop (see ROOM_READING_MAX_AGE_S).
SPARE_STAGING_FILES = 32
# ... topped up once fewer than this are left: in batches, since each batch ends with an fsync of the
# staging directory (topping up after every take made one or two files per fsync).
SPARE_LOW_WATER = SPARE_STAGING_FILES // 2
SPARE_PREFIX = "spare-"
# A spare is taken only while the staging disk had room when a statfs last looked. The event loop
# never makes that statfs itself: on a busy disk one blocked it for 153 ms (the soak's watchdog).
# Disk threads read it whenever they make staging files or room; a create that finds the reading
# older than this has a thread read it again in the background, for the creates after it (not a
# disk thread: those may all be busy with fsyncs and cache writes). The create itself does not
# wait: on a disk that filled since, its writes fail with ENOSPC, as for a file opened before.
ROOM_READING_MAX_AGE_S = 0.5
# A staging file whose content is committed, kept only because handles still read it: a crash
# leaves nothing to keep (`_collect_orphans`). Named back before anyone writes it again.
COMMITTED_PREFIX = "committed-"
# Parts of one file uploaded at once; parts of all files together are bounded by the store limiter.
PARTS_IN_FLIGHT_PER_FILE = 8
# How often a file written in passthrough mode (ucfs.passthrough), which we do not see being
# written, is looked at: its growth feeds its stream and its background syncs. 1 GiB written at
# 2 GB/s grows by 40 MB between looks: a few parts, handed out at once.
PASSTHROUGH_POLL_S = 0.02
PASSTHROUGH_IDLE_POLL_S = 1.0
# Blocks of a freshly committed file up to this size are put in the block cache straight from the
# staging file, so reading back what was just written costs no GET.
CACHE_AFTER_COMMIT_MAX_BYTES = 64 * MiB
# ... but not for files smaller than this. A file that small costs a segment of its own: a new cache
# file, a direct write and a rename, which for a 64-way copy of 150 KiB files was a sixth of the
# daemon's CPU and held the commit rate back by a sixth (`ucfs bench`, mount.small_write). Reading
# one back right away costs nothing either way (the kernel keeps its pages, see Inode.page_cache_etag);
# only a re-read after those pages are gone pays one GET, and caches the file then.
CACHE_AFTER_COMMIT_MIN_BYTES = 1 * MiB
# A renamed file whose object under the old name already holds its content (its commit was done, or
# finishing a stream, when the rename came) is copied to the new name on the server from this size
# up, rather than uploaded again: a copy sends no bytes, while the rename waits for it. Smaller files
# are uploaded again in the background, which keeps a rename of one at a single request (the delete).
RENAME_COPY_MIN_BYTES = SINGLE_PUT_MAX_BYTES


def _digest(data) -> bytes:
    return xxhash.xxh3_128_digest(data)


def _close_and_remove_all(files: list[tuple[int, Path]]) -> None:
    for fd, path in files:
        _close_and_remove(fd, path)


def _close_and_remove(fd: int, path: Path) -> None:
    """Close a staging file and remove it (blocking: run it in a thread)."""
    try:
        os.close(fd)
    except OSError:
        pass
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _copy_file(src: int, dst: int, size: int) -> None:
    """Copy the first `size` bytes of src into the empty dst and make them durable (blocking)."""
    off = 0
    while off < size:
        n = os.copy_file_range(src, dst, size - off, off, off)
        if n == 0:
            break  # src is shorter than recorded: keep what it has
        off += n
    os.fdatasync(dst)


def _first_hole(fd: int, start: int) -> int:
    """Where the first hole at or after `start` begins (the end of the file if none), or `start`
    for a file system that cannot say: assume the worst."""
    try:
        return os.lseek(fd, start, os.SEEK_HOLE)
    except OSError:
        return start


def part_bytes_for(n: int, base: int) -> int:
    """Size of part number n (1-based): `base`, doubling every 1,000 parts, so 10,000 parts reach
    the largest object S3 allows while small files still use small parts."""
    return base << ((n - 1) // 1000)


class _Changed(Exception):
    """The file changed while it was being committed; commit it again later."""


def _representative(group: BaseExceptionGroup) -> BaseException:
    """The one failure of parallel part uploads that decides what happens next: a change of the
    file first (commit again), then a store error (retry or report), else the group itself."""
    changed, rest = group.split(_Changed)
    if changed is not None:
        return _Changed()
    stores, rest = group.split(errors.StoreError)
    if stores is not None:
        leaf = stores
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        return leaf
    return group


@dataclass(eq=False)
class Stream:
    """A multipart upload that runs while the file is being written front to back."""

    key: str
    upload_id: str | None = None
    created: trio.Event = field(default_factory=trio.Event)
    parts: dict[int, str] = field(default_factory=dict)
    next_off: int = 0  # bytes handed to part uploads so far
    next_part: int = 1
    done_bytes: int = 0  # bytes of parts uploaded
    # Seconds during which parts were in flight, and since when they have been (trio time; None
    # while none are): the upload's rate is done_bytes over that busy time, so that a writer slower
    # than the store does not make the store look slow.
    busy_s: float = 0.0
    busy_since: float | None = None
    inflight: int = 0
    idle: trio.Event = field(default_factory=trio.Event)
    valid: bool = True
    error: BaseException | None = None
    # Written in passthrough mode: we cannot see whether a write went past the end or into a part
    # already sent, so each part sent while a passthrough writer has the file open is sent from
    # memory, and its digest kept and checked against the file before completing. (Parts sent once
    # the last one has let go are sent from the file: nobody can change it unseen any more.)
    verify: bool = False
    digests: dict[int, tuple[int, int, bytes]] = field(default_factory=dict)  # part -> off, len, xxh3
    checked: set[int] = field(default_factory=set)  # parts found (or made) to match the file
    # Once completed: the object's whole content as (offset, length, xxh3) ranges, when every part
    # has a digest (`Staged.stored`).
    content: list[tuple[int, int, bytes]] | None = None


@dataclass(frozen=True)
class _Stored:
    """What a commit put in the store under `key` as `etag`: its content as (offset, length, xxh3)
    ranges, in order (`Staged.stored`)."""

    key: str
    etag: str
    ranges: list[tuple[int, int, bytes]]

    @property
    def size(self) -> int:
        return self.ranges[-1][0] + self.ranges[-1][1] if self.ranges else 0

    def may_describe(self, s: "Staged") -> bool:
        """Whether s may still hold this, as far as its name, ETag and size tell (no I/O)."""
        return self.key == s.node.key and self.etag == s.node.etag and self.size == s.size


@dataclass(eq=False)
class _Kept:
    """A closed version of a staged file, kept in a staging file of its own while the file is written
    again (`Committer.keep_closed_version`): the journal row names it until a later close or commit."""

    path: Path
    fd: int
    size: int
    mtime_ns: int
    generation: int  # the flushed generation it holds


@dataclass
class _Rename:
    """How a staged file's rename is recorded (`Committer._plan_rename`): the journal row it changes
    (the file's own, or a first row, whose id becomes its rid and which records `size`), or
    neither; whether the file is then queued to be committed under the new name."""

    renames_row: bool = False
    adds_row: bool = False
    size: int = 0
    queue: bool = False
    # The old key holds an object of this file that the rename leaves behind: the caller deletes it,
    # unless it was copied to the new key on the server (then `Committer.renamed` does).
    old_object: bool = False
    copied: bool = False
    # What a copy on the server made under the new key, where the rename made one: the cached
    # blocks of the version it copied become its (`Core.moved_version`).
    copy: ObjectInfo | None = None


@dataclass(eq=False)
class Staged:
    node: Inode
    volume: Volume
    path: Path  # the staging file
    fd: int
    size: int
    mtime_ns: int
    rid: int | None = None  # journal row, once the file has been closed with changes
    # The size the row recorded at its close. While the row names this staging file (`_closed_here`),
    # its bytes below this are that closed version: a writer still open (one that opened before the
    # close) may append past it at no cost, and a replay publishes only these bytes; a write or
    # truncate below it first moves the closed version aside (`_changes_closed`).
    closed_size: int = 0
    generation: int = 0  # bumped by every change
    flushed_generation: int = -1  # latest generation made durable by close()/fsync
    committed_generation: int = -1  # latest generation known to be in the store
    # The key that generation went to. Not always the file's key now: a rename moves the name
    # first, and a commit restarted meanwhile may finish under the new key before the rename's
    # turn, or the object may wait under the old key for the rename to copy it (`_plan_move`).
    committed_key: str | None = None
    # Open handles, plus pins: work that uses the staging file without a handle of its own (a
    # truncate without an open file, fsync of a directory, part uploads, background syncs). The
    # file is closed and removed only when this is zero (see `Committer._maybe_retire`).
    handles: int = 0
    writers: int = 0
    # Opens for writing under way (in `Committer.stage`): writers from the moment their handle is
    # made, which may follow several awaits. Until then the file must not be marked committed.
    opening: int = 0
    error: OSError | None = None  # permanent commit failure
    attempts: int = 0
    retry_reason: str = ""  # why the last attempt failed, while it is retried (ucfs status)
    queued: bool = False
    # Queued, but waiting out COMMIT_SETTLE_S first (`Committer._settling`), until `settle_due`.
    settling: bool = False
    settle_due: float = 0.0
    fsync_waiters: int = 0
    dropped: bool = False  # unlinked: never commit
    # A rename or unlink waits for the commit lock: the commit holding it gives up at its next part
    # (and is queued again) rather than finish an upload under a name that is going away.
    abandon: bool = False
    # Renames and unlinks waiting for the commit lock now. A worker whose turn comes while any do
    # steps aside for them (`_take`): the lock is handed over in turn, and a second worker that
    # took the file meanwhile was ahead of them, and committed it whole under the old name.
    namespace_waiters: int = 0
    # ... except the rename of a file (`renamed`) that waits while the commit finishes a stream under
    # this key, the file's name until then: all of its parts are on their way, so that commit
    # completes the upload and leaves the object (`published`) for the rename to copy.
    moving_from: str | None = None
    published: tuple[str, int] | None = None  # (key, generation) completed for a waiting rename
    # A stand-in committing this file's kept version (`Committer._commit_kept`) gives up when the
    # file itself is asked to (`giving_up`).
    kept_of: "Staged | None" = None
    row_pending: bool = False  # a close is writing the file's first journal row (flush)
    # The generation a close is pointing the file's journal row at (flush), while it does: a commit
    # of an older version that ends meanwhile must leave that row alone, or the close is not
    # recorded anywhere until its own commit.
    recording: int = -1
    # Taken up from the journal at mount: its inode was made without asking the store, so an
    # older object may be under its key that unlink/rename must still delete.
    replayed: bool = False
    retired: bool = False  # staging file closed and removed; its fd number may belong to another file
    # The largest size the file has had (the kernel may still believe it), when it last finished
    # shrinking, and whether it is shrinking now: reads racing a truncate are told apart from reads
    # at the end of the file (core.read).
    high_water: int = 0
    shrunk_at: float = 0.0
    shrinking: int = 0
    appends_only: bool = True  # every write so far extended the file (stream candidate)
    stream: Stream | None = None
    # What the last commit put in the store, as (offset, length, xxh3) ranges, with its key and
    # ETag; known when it was sent while passthrough writers had the file open (a verified stream,
    # or a commit for an fsync). Their close counts as a change, since we do not see their writes:
    # a commit that finds the file still holds this content has nothing to send (`_still_stored`).
    stored: _Stored | None = None
    unsynced: int = 0
    unchecked: int = 0  # bytes written since the last free-space check
    # Passthrough (ucfs.passthrough): the kernel's id of the staging file as a backing file, the
    # handles open in that mode and how many of them write, whether any ever wrote (the kernel's
    # pages of the inode then do not hold what was committed), and the staging file's mtime when we
    # last looked.
    backing_id: int | None = None
    pt_handles: int = 0
    pt_writers: int = 0
    # Of those writers, the ones that may write below the file's end: all but the append-only
    # (O_WRONLY | O_APPEND: every write lands at the end, and with no read access the file cannot
    # be mapped and written through memory either).
    pt_rewriters: int = 0
    pt_written: bool = False
    seen_mtime_ns: int = 0
    filled: int = 0  # the staging file has no hole below this offset (`_probe_appends`)
    look_every: float = PASSTHROUGH_POLL_S  # `_watch_passthrough`: how often, and when next
    next_look: float = 0.0
    created_at: float = field(default_factory=time.time)
    kept: _Kept | None = None  # the closed version waiting for its commit while this is written again
    # committed_generation when a commit's turn last found append-only writers open and gave them
    # one more settle to close rather than keep the closed version aside (`Committer._worker`).
    appenders_awaited_at: int = -2
    # Kept versions superseded while a commit held the lock (it may be reading one): whoever holds
    # the lock removes them when done (`_remove_superseded`).
    superseded: list[_Kept] = field(default_factory=list)
    lock: trio.Lock = field(default_factory=trio.Lock)  # data changes vs. snapshot reads
    commit_lock: trio.Lock = field(default_factory=trio.Lock)  # one commit at a time
    # One flush at a time: two closes at once (a reader's and the writer's) both found no journal row
    # and added one each, and the row whose id was overwritten outlived every commit.
    flush_lock: trio.Lock = field(default_factory=trio.Lock)
    # One rename of the staging file to or from its committed- name at a time: a commit marking it
    # and an open, write or close taking the mark back raced, and the second rename found no file.
    name_lock: trio.Lock = field(default_factory=trio.Lock)
    progress: trio.Event = field(default_factory=trio.Event)  # set (and replaced) on commit or failure

    @property
    def giving_up(self) -> bool:
        """Whether the commit holding the lock is asked to stop at its next part (`abandon`)."""
        return self.abandon or (self.kept_of is not None and self.kept_of.abandon)

    @property
    def dirty(self) -> bool:
        return self.committed_generation < self.generation

    def note_committed(self, generation: int, key: str | None) -> None:
        """Generation `generation` of the file is in the store, under `key`."""
        if generation >= self.committed_generation:
            self.committed_generation, self.committed_key = generation, key

    def notify(self) -> None:
        self.progress.set()
        self.progress = trio.Event()

    @contextlib.contextmanager
    def shrinking_if(self, shrinks: bool):
        """While the block runs, the file may be shorter than the kernel believes: reads running
        meanwhile must know it at once (core.read answers them ESTALE, not short)."""
        self.shrinking += shrinks
        try:
            yield
        finally:
            self.shrinking -= shrinks


class Committer:
    def __init__(self, state_dir: Path, core: "Core", cfg: MountConfig, *, workers: int = 64):
        self.core = core
        self.cfg = cfg
        self.staging_dir = ensure_private_dir(state_dir / "staging")
        self.orphans_dir = state_dir / "orphans"
        self.journal = Journal(state_dir / "journal.sqlite3", staging_dir=self.staging_dir)
        self.workers = workers
        self.staged: dict[int, Staged] = {}  # by inode number
        self._queue: collections.OrderedDict[int, Staged] = collections.OrderedDict()
        self._idle_workers = trio.lowlevel.ParkingLot()
        # Closed files waiting out COMMIT_SETTLE_S, in the order they are due: (due, file). An
        # entry whose file has left (`Staged.settling` false, or due again later) is skipped.
        self._settling: collections.deque[tuple[float, Staged]] = collections.deque()
        self._settler = trio.lowlevel.ParkingLot()
        self._nursery: trio.Nursery | None = None
        self._part_slots = trio.CapacityLimiter(max(4, cfg.store_concurrency // 4))
        # What a stream that keeps up has left to upload: the parts that may be in flight at once,
        # and the part being written (see `_close_commits`).
        self._stream_window = (int(self._part_slots.total_tokens) + 1) * cfg.part_bytes
        # Bytes per second the staging disk took in recent syncs (None until one was measured).
        self._sync_rate: float | None = None
        self._sync_rate_at = 0.0  # when it was last measured (time.monotonic)
        # Syncs in flight; since when (time.monotonic) one has been, what those synced, and whether
        # one of them failed: syncs that overlap wait for each other's writes, so they are measured
        # together (see `_sync`).
        self._syncs_inflight = 0
        self._sync_busy_since = 0.0
        self._sync_busy_bytes = 0
        self._sync_busy_failed = False
        self._retired: set[str] = set()
        self.stats: collections.Counter[str] = collections.Counter()
        self._shutting_down = False
        self._drain_stopped: str | None = None  # why a drain was told to stop, if it was
        self._spares: list[tuple[Path, int]] = []  # (path, fd) of empty staging files made ahead
        self._refilling = False
        self._room_reading = (-ROOM_READING_MAX_AGE_S, False)  # (monotonic time, room) of the last statfs
        self._reading_room = False
        self._removals: list[tuple[int, Path]] = []  # retired staging files: (fd, path) to close and remove
        self._removing = False
        self._watched: set[Staged] = set()  # files with passthrough writers (`_watch_passthrough`)
        # Parts being put in the cache after their file's commit, all files together: a background
        # nicety, kept to a few parts' worth of memory however many files commit at once.
        self._caching = trio.CapacityLimiter(2)
        self._watching = False

    # -- lifecycle ------------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as n:
            self._nursery = n
            await n.start(self.journal.run)
            await self._replay()
            for i in range(self.workers):
                n.start_soon(self._worker, name=f"commit-worker-{i}")
            n.start_soon(self._settle, name="commit-settle")
            self._refill_spares()
            task_status.started()
            await trio.sleep_forever()

    async def _replay(self) -> None:
        """Take up what a previous daemon left: every journal row is committed again."""
        intended: dict[tuple[str, str], list[tuple[str, float]]] = {}
        for upload_id, vname, key, created in await self.journal.read_uploads():
            vol = self._volume(vname)
            if vol is None:
                self.journal.remove_upload_nowait(upload_id)
            elif upload_id.startswith(DELETE):
                await self._delete_left_behind(vol, key, upload_id)
            elif upload_id.startswith(INTENT):
                intended.setdefault((vname, key), []).append((upload_id, created))
            else:
                await self._abort_quietly(vol, key, upload_id)  # also forgets it
        for (vname, key), intents in intended.items():
            await self._report_intended(self._volume(vname), key, intents)
        records = await self.journal.read_records()
        named = {r.staging for r in records}
        self._collect_orphans(named)
        # Several rows for one path: only the one changed last (its close, or the rename that put it
        # there) holds the file's content; the others are versions it replaced. Replaying one of those
        # would publish old bytes over newer ones, so they are dropped with their staging files. "Last"
        # is the rows' shared counter, not the clock (rows of journals older than it: by their times).
        latest: dict[tuple[str, str], Record] = {}
        for r in records:
            k = (r.volume, r.path)
            if k not in latest or (r.seq, r.updated, r.id) > (latest[k].seq, latest[k].updated, latest[k].id):
                latest[k] = r
        for r in records:
            vol = self._volume(r.volume)
            staging = self.staging_dir / r.staging
            if latest[(r.volume, r.path)] is not r:
                log.info("journal entry for %s:%s was replaced by a later one; dropping it", r.volume, r.path)
                self.journal.remove_nowait(r.id)
                if r.staging != latest[(r.volume, r.path)].staging:
                    staging.unlink(missing_ok=True)
                continue
            if vol is None or not staging.exists():
                log.error("journal entry for %s:%s cannot be replayed (%s); dropping it", r.volume, r.path,
                          "volume no longer registered" if vol is None else "staging file missing")
                self.journal.remove_nowait(r.id)
                continue
            node = self.core.materialize(vol, r.path)
            fd = os.open(staging, os.O_RDWR)
            st = os.fstat(fd)
            if st.st_size > r.size:
                self._cut_unclosed(staging, fd, r.size)
                st = os.fstat(fd)
            s = Staged(node, vol, staging, fd, st.st_size, st.st_mtime_ns, rid=r.id, closed_size=st.st_size,
                       generation=1, flushed_generation=1, attempts=r.attempts, appends_only=False,
                       replayed=True, created_at=r.created)
            node.staged = s
            self.staged[node.ino] = s
            self._enqueue(s)
            self.stats["replayed"] += 1
        if records:
            log.info("replaying %d pending commit(s) from the journal", len(records))

    async def _delete_left_behind(self, vol: Volume, key: str, marker: str) -> None:
        """A renamed file's object under its old key, which a killed daemon had copied to the new
        key and not yet deleted (`_delete_moved`); before any row is replayed, so that a file the
        journal has for that old name is published after this."""
        try:
            await self.core.store_for(vol).delete(vol.bucket, key)
        except errors.StoreError as e:
            log.warning("could not delete %r, left behind by a rename before the daemon stopped: %s; the next "
                        "mount tries again", key, e)
            return
        log.info("deleted %r, left behind by a rename before the daemon stopped", key)
        self.journal.remove_upload_nowait(marker)

    def _cut_unclosed(self, staging: Path, fd: int, size: int) -> None:
        """A journaled staging file longer than its row says: a writer that had it open when the
        recorded close happened appended to it and never closed. Only the closed bytes are published;
        the whole file is kept in orphans/ for the user, as a file never closed is."""
        dest = self._orphan_path(staging.name)
        shutil.copyfile(staging, dest)
        os.ftruncate(fd, size)
        log.warning("staging file %s was written past its last close (%d bytes) before the daemon stopped; "
                    "that close's version is committed, and the whole file kept as %s", staging.name, size, dest)

    def _orphan_path(self, name: str) -> Path:
        """Where a staging file kept for the user goes: orphans/<name>, or a unique name beside it
        when an earlier crash left one of that name (it must not be overwritten)."""
        self.orphans_dir.mkdir(mode=0o700, exist_ok=True)
        dest = self.orphans_dir / name
        return dest.with_name(f"{uuid.uuid4().hex}-{name}") if dest.exists() else dest

    def _collect_orphans(self, named: set[str]) -> None:
        """Staging files no journal row names (written but never closed before a crash): keep them
        aside for the user rather than publish a half-written file or silently delete it."""
        for p in self.staging_dir.iterdir():
            if p.name in named:
                continue
            if p.name.startswith(SPARE_PREFIX) and p.stat().st_size == 0:
                p.unlink()  # made ahead, never written: nothing to keep
                continue
            if p.name.startswith(COMMITTED_PREFIX):
                p.unlink()  # its content is in the store; it only waited for its readers
                continue
            dest = self._orphan_path(p.name)
            shutil.move(str(p), dest)
            log.warning("staging file %s was never closed before the daemon stopped; kept as %s", p.name, dest)

    def stop_draining(self, why: str) -> None:
        """End a drain under way, or the next one, at once: what is left stays staged and journaled,
        and the next mount commits it (a store that cannot be reached would keep a drain going)."""
        self._drain_stopped = why

    def _waiting(self) -> list[Staged]:
        return [s for s in self.staged.values() if s.dirty and s.error is None and not s.dropped]

    async def shutdown(self, *, drain: bool) -> None:
        """Stop: with drain, first wait (with progress in the log) until nothing commits any more,
        or `stop_draining` is called."""
        self._shutting_down = True
        for _, s in list(self._settling):
            if s.settling:
                self._enqueue(s)  # no more waiting: the drain starts them all now
        if drain:
            last = 0.0
            while self._drain_stopped is None and (pending := self._waiting()):
                if time.monotonic() - last > 2:
                    log.info("draining: %d file(s), %.1f MiB waiting to be committed", len(pending),
                             sum(s.size for s in pending) / MiB)
                    last = time.monotonic()
                await trio.sleep(0.05)
            left = self._waiting()
            if left and self._drain_stopped is not None:
                log.warning("stopped draining (%s): %d file(s), %.1f MiB stay staged; the next mount "
                            "of this cache directory commits them", self._drain_stopped, len(left),
                            sum(s.size for s in left) / MiB)
        # Removals written without a sync are synced before the journal stops: nothing closes the
        # database (whose checkpoint would), and a power loss after the unmount would otherwise
        # bring their rows back and commit those files again at the next mount.
        try:
            await self.journal.settle()
        except OSError as e:
            log.warning("commit journal: %s", e)
        await self.journal.close()
        with trio.move_on_after(10):
            while self.journal._queue:
                await trio.sleep(0.01)
        for s in self.staged.values():
            s.retired = True  # closed here: tasks ending after us must not close the number again
            try:
                os.close(s.fd)
            except OSError:
                pass
        # Retired, their thread trip not yet begun. Nothing retires after this: every file left is
        # marked retired above.
        removals, self._removals = self._removals, []
        _close_and_remove_all(removals)
        spares, self._spares = self._spares, []
        for path, fd in spares:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _volume(self, full_name: str) -> Volume | None:
        parts = tuple(full_name.split("."))
        return self.core.catalog.volumes.get(parts) if len(parts) == 3 else None

    # -- opening --------------------------------------------------------------------------------
    def _new_staging(self, prefix: str = "") -> tuple[Path, int]:
        """Make room if needed and create a staging file (blocking: one trip to a disk thread)."""
        self._check_space()
        path = self.staging_dir / f"{prefix}{uuid.uuid4().hex}.data"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.journal.note_new_file(path.name)  # after: a sync that began before it cannot count
        return path, fd

    async def _staging_file(self) -> tuple[Path, int]:
        """An empty staging file: a spare when there is one and the disk had room at the last
        reading (ROOM_READING_MAX_AGE_S), else one made now."""
        got = None
        if self._spares:
            seen_at, room = self._room_reading
            if time.monotonic() - seen_at > ROOM_READING_MAX_AGE_S:
                self._refresh_room_reading()
            if room:
                got = self._spares.pop()
        if got is None:
            got = await run_disk(self._new_staging)  # makes room, or refuses with ENOSPC
        self._refill_spares()
        return got

    def _refresh_room_reading(self) -> None:
        """Read the staging disk's room again, in the background (for the creates after this one)."""
        if self._reading_room or self._nursery is None or self._shutting_down:
            return
        self._reading_room = True

        async def read() -> None:
            try:
                await trio.to_thread.run_sync(self._has_room)  # a thread of its own: not behind disk work
            except OSError as e:
                log.debug("staging disk's free space not read: %s", e)
            finally:
                self._reading_room = False

        self._nursery.start_soon(read)

    def _refill_spares(self) -> None:
        if (len(self._spares) < SPARE_LOW_WATER and not self._refilling and self._nursery is not None
                and not self._shutting_down):
            self._refilling = True
            self._nursery.start_soon(self._refill)

    def _new_spares(self, n: int) -> list[tuple[Path, int]]:
        """Up to n empty staging files, in one trip to a disk thread (a burst of creates uses many)."""
        made: list[tuple[Path, int]] = []
        try:
            for _ in range(n):
                made.append(self._new_staging(SPARE_PREFIX))
        except OSError:
            if not made:
                raise
        # Their directory entries are made durable here, once for the batch, so that the close of a
        # file that took one need not wait for a directory fsync (journal.py).
        with contextlib.suppress(OSError):
            self.journal.sync_staging_dir()
        return made

    async def _refill(self) -> None:
        try:
            while len(self._spares) < SPARE_STAGING_FILES and not self._shutting_down:
                made = await run_disk(self._new_spares, SPARE_STAGING_FILES - len(self._spares))
                if self._shutting_down:
                    for path, fd in made:
                        os.close(fd)
                        os.unlink(path)
                    return
                self._spares.extend(made)
        except OSError as e:
            log.debug("no spare staging files made: %s", e)  # a create makes its own, or says why not
        finally:
            self._refilling = False

    def _staging_shortfall(self) -> int:
        """Bytes the staging disk is short of its free-space floor (0 when it has room). A statfs,
        which may block: never on the event loop. Records the reading for `_staging_file`."""
        st = os.statvfs(self.staging_dir)
        short = max(0, self._staging_reserve_bytes - st.f_bavail * st.f_frsize)
        self._room_reading = (time.monotonic(), short == 0)
        return short

    @property
    def _staging_reserve_bytes(self) -> int:
        """Free space the staging disk keeps for new writes (the cache gives way before they fail)."""
        return self.cfg.cache_free_floor_bytes // 4

    def _has_room(self) -> bool:
        return self._staging_shortfall() == 0

    def _check_space(self) -> None:
        """New data needs room on the staging disk; make it by evicting cache, or refuse (ENOSPC)."""
        short = self._staging_shortfall()
        if short and self.core.cache is not None:
            self.core.cache.shrink_for(short)
            short = self._staging_shortfall()
        if short:
            raise errors.fs_error(errors.ENOSPC, "no space left for staging writes")

    async def stage(self, node: Inode, *, truncate: bool, append_only: bool = False) -> Staged:
        """The inode's staging file, made if needed (a copy of the object unless truncating).
        `append_only`: opened O_WRONLY | O_APPEND, so its writes cannot change what an earlier close
        left (see `keep_closed_version`)."""
        if node.staged is not None:
            s = node.staged
            s.opening += 1
            try:
                # A truncating open shrinks the file from the moment it takes the closed version
                # aside (an empty staging file in its place) until it returns, and only then does the
                # kernel learn the new size: reads meanwhile, and handles opened before then, may ask
                # for bytes the file no longer has.
                with s.shrinking_if(truncate):
                    await self.keep_closed_version(s, truncate=truncate, append_only=append_only)
                    # s.size is what we saw last: a passthrough writer's bytes are not in it until
                    # truncate() reads the staging file's size.
                    if truncate and (s.size or s.pt_writers):
                        # Pinned: a commit finishing meanwhile must not retire it under the truncate.
                        # The caller takes a handle before its next await.
                        s.handles += 1
                        try:
                            await self.truncate(s, 0)
                        finally:
                            s.handles -= 1
            finally:
                s.opening -= 1
                if truncate and s.high_water:
                    self._shrank(s)
            return s
        path, fd = await self._staging_file()
        s = Staged(node, node.volume, path, fd, 0, time.time_ns())
        try:
            if not truncate and node.etag and node.size:
                await self._copy_in(node, s)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        if truncate or not node.etag:
            s.generation = 1  # new content: must be committed even if nothing is written
        s.high_water = node.size if node.etag else 0
        node.staged = s
        self.staged[node.ino] = s
        if truncate and s.high_water:
            self._shrank(s)  # the committed object was longer
        return s

    def _shrank(self, s: Staged) -> None:
        """s has just become shorter than it was, and its new size is in place.

        The kernel learns the new size from our reply to the request that shrank it (a truncating
        open, a truncate), in the context of the process that made it, when that process runs
        again: a moment after the reply, several ms on a loaded machine. A reader opening meanwhile
        would still read with the old size, get a short answer from a handle sized after the shrink
        (so no ESTALE, see core.read) and be given zeros by its kernel. So the kernel is told now
        that the attributes it holds are stale: every read that starts from now on asks for them
        first (libfuse enables the kernel's auto_inval_data), and gets the new size. Handles opened
        before now are those `shrunk_at` tells apart."""
        if self.core.invalidate_attrs is not None:
            self.core.invalidate_attrs(s.node.ino)
        s.shrunk_at = time.monotonic()

    async def keep_closed_version(self, s: Staged, *, truncate: bool, append_only: bool = False) -> None:
        """s is about to be written again (an open for writing, a truncating open). If a close of it
        is still waiting for its commit, its journal row names the staging file that is about to
        change: a crash during the new write would then publish bytes nobody closed, in place of the
        version that was closed, and a commit retried meanwhile would upload them (README
        "Semantics": Durability). So that version moves to a staging file of its own first, the row
        is pointed at it, and it is committed from there (`_commit_kept`) unless a later close or
        commit supersedes it. A truncating open with no handle open takes the file itself for the
        kept version and starts an empty one; otherwise the closed bytes are copied.

        Not for an append-only open (`append_only`, never truncating): its writes land past the
        closed version's end, which costs nothing (`_changes_closed`; a replay cuts the staging
        file back to the recorded size). A log opened, appended to and closed again at every step
        used to copy the whole file aside at every open while its last close waited to be sent.

        s stays pinned throughout: a commit finishing meanwhile must not retire it under the open,
        which takes its handle as soon as this returns."""
        s.handles += 1
        try:
            async with s.name_lock:
                if s.path.name.startswith(COMMITTED_PREFIX):
                    # Written again: until its next close, a crash must keep it as an orphan.
                    path = s.path.with_name(s.path.name[len(COMMITTED_PREFIX):])
                    await run_disk(os.rename, s.path, path)
                    self.journal.note_new_file(path.name)
                    s.path = path
            if not append_only:
                await self._keep_closed_version(s, truncate=truncate)
        except BaseException:
            self.unpin(s)
            raise
        s.handles -= 1

    async def _keep_closed_version(self, s: Staged, *, truncate: bool) -> None:
        async with s.flush_lock:
            if (s.rid is None or s.kept is not None or s.dropped
                    or s.flushed_generation <= s.committed_generation):
                return  # nothing closed waits, or its version is kept already
            path, fd = await self._staging_file()
            if truncate and s.handles == 1 and not s.commit_lock.locked():  # only our pin
                kept = _Kept(s.path, s.fd, s.closed_size, s.mtime_ns, s.flushed_generation)
                if s.backing_id is not None:
                    self.core.passthrough.close_backing(s.backing_id)  # bound to the kept file
                    s.backing_id = None
                self._invalidate_stream(s, "written again")
                s.path, s.fd, s.size, s.filled, s.unsynced = path, fd, 0, 0, 0
                s.appends_only = True
                s.generation += 1
            else:
                try:
                    async with s.lock:
                        # Only what the close covered: a writer still open may have appended since.
                        await run_disk(_copy_file, s.fd, fd, s.closed_size)
                except BaseException:
                    await run_disk(_close_and_remove, fd, path)
                    raise
                kept = _Kept(path, fd, s.closed_size, s.mtime_ns, s.flushed_generation)
            await self.journal.restage(s.rid, kept.path.name)
            s.kept = kept
            self.stats["closed_versions_kept"] += 1
            log.debug("%s is written again before its last close was committed; that version is "
                     "kept aside until then", s.node.mount_path())

    @staticmethod
    def _closed_here(s: Staged) -> bool:
        """Whether s's journal row names its own staging file for a closed version that is not in
        the store yet: the bytes below `s.closed_size` must then stay as that close left them."""
        return (s.rid is not None and s.kept is None and not s.dropped
                and s.flushed_generation > s.committed_generation)

    def _changes_closed(self, s: Staged, off: int) -> bool:
        """Whether a write or truncate at `off` (by a handle open before the last close, or a dup of
        the closing one) would change the closed version the journal row names: that version is
        then moved aside first (`keep_closed_version`). Appends past it cost nothing: a replay cuts
        the staging file back to the recorded size. So several processes appending to one log pay
        no copy; only a change below the closed end does, once per close. (A plain test, not a
        coroutine: every write asks.)"""
        return off < s.closed_size and self._closed_here(s)

    def _end_kept(self, s: Staged) -> None:
        """s's kept version is in the store, or a newer version is, or the file is gone: remove it
        and the journal row that names it."""
        kept, s.kept = s.kept, None
        if kept is None:
            return
        if s.rid is not None:
            self.journal.remove_nowait(s.rid)
            s.rid = None
        self._remove_later(kept.fd, kept.path)

    def _supersede_kept(self, s: Staged) -> None:
        """A later close of s has taken the journal row over: its kept version is never to be
        committed. Removed now, or by the commit holding the lock (which may be reading it)."""
        kept, s.kept = s.kept, None
        if kept is not None:
            s.superseded.append(kept)
        if not s.commit_lock.locked():
            self._remove_superseded(s)

    def _remove_superseded(self, s: Staged) -> None:
        while s.superseded:
            kept = s.superseded.pop()
            self._remove_later(kept.fd, kept.path)

    def _remove_later(self, fd: int, path: Path) -> None:
        if self._nursery is None:
            _close_and_remove(fd, path)
            return
        self._removals.append((fd, path))
        if not self._removing:
            self._removing = True
            self._nursery.start_soon(self._remove_retired)

    async def _commit_kept(self, s: Staged) -> None:
        """Commit s's kept closed version (under s's commit lock) while s itself is written again."""
        kept = s.kept
        shadow = Staged(s.node, s.volume, kept.path, kept.fd, kept.size, kept.mtime_ns,
                        generation=kept.generation, flushed_generation=kept.generation,
                        pt_written=True,  # the kernel's pages hold the new writes, not this
                        kept_of=s)  # a rename or unlink of s stops this commit too
        await self._commit(shadow)
        # (A kept version is never left for a rename to copy: `_finishes_for_rename`.)
        s.note_committed(kept.generation, shadow.committed_key)
        s.attempts = 0
        s.retry_reason = ""
        s.error = None
        if s.kept is kept:  # else a close superseded it meanwhile, and the row is that close's
            if s.recording > kept.generation:
                self._supersede_kept(s)  # a close is taking the row over right now
            else:
                self._end_kept(s)
        s.notify()

    async def _copy_in(self, node: Inode, s: Staged) -> None:
        """Fill a staging file with the object's current bytes (for append and in-place edits)."""
        from .prefetch import ObjectReader

        vol = node.volume
        store = self.core.store_for(vol)
        version = ObjectVersion(store.name, vol.bucket, node.key, node.etag)
        reader = ObjectReader(store=store, bucket=vol.bucket, key=node.key, version=version, size=node.size,
                              cache=self.core.cache, budget=self.core.budget, cfg=self.cfg,
                              nursery=self._nursery, stats=self.core.stats, inflight=self.core.inflight)
        try:
            off = 0
            while off < node.size:
                chunk = await reader.read(off, self.cfg.part_bytes)
                await run_disk(os.pwrite, s.fd, chunk, off)
                off += len(chunk)
        finally:
            reader.close()
        s.size = node.size
        s.mtime_ns = node.mtime_ns
        s.committed_generation = s.generation = 0  # same content as the store: nothing to commit yet
        s.committed_key = node.key
        s.appends_only = True

    # -- data -----------------------------------------------------------------------------------
    async def write(self, s: Staged, off: int, data: bytes) -> int:
        if s.error is not None and s.error.errno != errors.ENOSPC:
            pass  # a failed commit does not stop further writes; the next commit may succeed
        end = off + len(data)
        if end > MAX_OBJECT_BYTES:
            raise errors.fs_error(errors.EFBIG, "larger than the store's largest object (5 TiB)")
        if s.unchecked >= SPACE_CHECK_BYTES:
            s.unchecked = 0
            await run_disk(self._check_space)
        if self._changes_closed(s, off):
            await self.keep_closed_version(s, truncate=False)
        async with s.lock:
            appending = off == s.size
            try:
                n = await run_disk(os.pwrite, s.fd, data, off)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise errors.fs_error(errors.ENOSPC, "staging disk is full") from None
                raise
            s.size = max(s.size, end)
            s.high_water = max(s.high_water, s.size)
            s.mtime_ns = time.time_ns()
            s.generation += 1
            if not appending:
                s.appends_only = False
                self._invalidate_stream(s, "write inside already written data")
        s.unsynced += n
        s.unchecked += n
        self._grown(s)
        return n

    def _grown(self, s: Staged) -> None:
        """s has new data: sync it in the background, or hand it to the stream."""
        if s.unsynced >= BACKGROUND_SYNC_BYTES and not self._stream_keeps_up(s):
            n, s.unsynced = s.unsynced, 0
            self.pin(s)
            self._nursery.start_soon(self._background_sync, s, n)
        self._maybe_stream(s)

    # -- passthrough ----------------------------------------------------------------------------
    def passthrough_opened(self, s: Staged, writable: bool, append_only: bool = False) -> None:
        s.pt_handles += 1
        if not writable:
            return
        s.pt_writers += 1
        s.pt_rewriters += not append_only
        s.pt_written = True
        s.generation += 1  # it may change from now on without our seeing it
        if s.stream is not None:
            # Parts sent while nobody could write unseen carry no digests to check them by, and
            # may now be written over.
            self._invalidate_stream(s, "a passthrough writer opened it")
        self._watched.add(s)
        if not self._watching and self._nursery is not None:
            self._watching = True
            self._nursery.start_soon(self._watch_passthrough)

    def passthrough_closed(self, s: Staged, writable: bool, append_only: bool = False) -> None:
        s.pt_handles -= 1
        if writable:
            self.observe(s)  # the last bytes it wrote, before the release commits them
            s.pt_writers -= 1
            s.pt_rewriters -= not append_only
            if not s.pt_writers:
                self._watched.discard(s)

    def observe(self, s: Staged) -> int:
        """Bring s's size and mtime up to date with its staging file, which passthrough writers
        write behind our back. Returns how many bytes it grew by."""
        if s.retired:
            return 0
        st = os.fstat(s.fd)
        grew = st.st_size - s.size
        if grew or st.st_mtime_ns != s.seen_mtime_ns:
            s.seen_mtime_ns = st.st_mtime_ns
            s.mtime_ns = st.st_mtime_ns
            s.size = st.st_size
            s.high_water = max(s.high_water, s.size)
        if grew > 0:
            s.unsynced += grew
            s.unchecked += grew
        return grew

    async def _watch_passthrough(self) -> None:
        """Look at the files passthrough writers are writing, and act on their growth as write()
        does on ours: streams get their parts, background syncs and space checks happen."""
        try:
            while self._watched and not self._shutting_down:
                now = trio.current_time()
                for s in list(self._watched):
                    if s.retired or not s.pt_writers:
                        self._watched.discard(s)
                        continue
                    if now < s.next_look:
                        continue
                    if self.observe(s) > 0:
                        await self._probe_appends(s)
                        s.look_every = PASSTHROUGH_POLL_S
                        if s.unchecked >= SPACE_CHECK_BYTES:
                            s.unchecked = 0
                            await run_disk(self._check_space_quietly)
                        self._grown(s)
                    else:
                        # A file held open without being written (a log, a handle kept for later)
                        # is looked at less and less often, down to once a second.
                        s.look_every = min(PASSTHROUGH_IDLE_POLL_S, 2 * s.look_every)
                    s.next_look = now + s.look_every
                await trio.sleep(PASSTHROUGH_POLL_S)
        finally:
            self._watching = False

    @staticmethod
    def _check_size(s: Staged) -> None:
        """write() refuses to grow a file past the store's largest object; a passthrough writer's
        writes reach the staging file unchecked, so its close and fsync say it instead. The file
        stays staged: truncated back, it commits."""
        if s.size > MAX_OBJECT_BYTES:
            raise errors.fs_error(errors.EFBIG, "larger than the store's largest object (5 TiB); "
                                                "truncate it to commit it")

    async def _take_unseen_writes(self, s: Staged) -> None:
        """Before a flush or fsync of a file passthrough writers write: what they wrote so far, which
        we did not see, counts as a change (a new generation) of known size and shape."""
        self.observe(s)
        s.generation += 1
        self._check_size(s)
        await self._probe_appends(s)

    async def _probe_appends(self, s: Staged) -> None:
        """Whether a passthrough writer still writes front to back, as far as we can tell: a hole
        below the end means it wrote further on first. Then the file is not streamed, as write()
        decides for the writes it sees. (Rewrites of data already written are not holes: a stream's
        parts are checked against the file before its upload completes, `_verify_stream`. So this
        only spares uploads that would be sent again; it is not what keeps the object right.)

        The probe, lseek(SEEK_HOLE), runs in a thread: ext4 answers it under the file's inode lock,
        which the writer holds through each write(), including the time the kernel holds it back
        until dirty pages are written. On the event loop it stalled every FUSE request for
        120-140 ms while a 1 GiB file was written."""
        if not s.appends_only or s.size <= s.filled or s.retired:
            return
        if s.stream is None and s.size < STREAM_START_BYTES:
            return  # nothing to decide yet; a thread trip (40-80 µs of CPU) per small file is waste
        size, filled = s.size, s.filled
        self.pin(s)  # the staging file stays open while the thread looks at it
        try:
            hole = await run_disk(_first_hole, s.fd, filled)
        finally:
            self.unpin(s)
        if hole < size:
            if s.appends_only:
                s.appends_only = False
                self._invalidate_stream(s, "written out of order")
        elif s.filled == filled:  # not truncated meanwhile
            s.filled = min(size, s.size)

    def _check_space_quietly(self) -> None:
        """Make room as `_check_space` does; a full disk is the writer's to see (the kernel's write
        to the staging file fails with ENOSPC)."""
        try:
            self._check_space()
        except OSError:
            pass

    async def _background_sync(self, s: Staged, n: int) -> None:
        try:
            await self._sync(s, n)
        except OSError:
            pass  # the fdatasync at close reports problems
        finally:
            self.unpin(s)

    async def _sync(self, s: Staged, n: int) -> None:
        """fdatasync s's staging file, n bytes of which were written since its last sync; enough
        bytes synced measure the staging disk's write rate (`_close_commits` weighs it).

        Syncs that overlap are one sample: their bytes over the time from the first one's start to
        the last one's end. A sync that starts while others write waits for them too (fdatasync
        waits for pages already under writeback, and the disk is shared), so its own bytes over its
        own time would make the disk look several times slower than it is."""
        if self._syncs_inflight == 0:
            self._sync_busy_since = time.monotonic()
            self._sync_busy_bytes, self._sync_busy_failed = 0, False
        self._syncs_inflight += 1
        ok = False
        try:
            await run_disk(os.fdatasync, s.fd)
            ok = True
        finally:
            self._syncs_inflight -= 1
            if ok:
                self._sync_busy_bytes += n
            else:
                self._sync_busy_failed = True  # its time counted, its bytes may not be on the disk
            if self._syncs_inflight == 0:
                dt = time.monotonic() - self._sync_busy_since
                if self._sync_busy_bytes >= RATE_SAMPLE_BYTES and dt > 0 and not self._sync_busy_failed:
                    rate = self._sync_busy_bytes / dt
                    old = self._disk_rate()
                    self._sync_rate = rate if old is None else old + SYNC_RATE_WEIGHT * (rate - old)
                    self._sync_rate_at = time.monotonic()

    def _disk_rate(self) -> float | None:
        """The staging disk's write rate measured by recent syncs (None if none is recent)."""
        if self._sync_rate is None or time.monotonic() - self._sync_rate_at > SYNC_RATE_MAX_AGE_S:
            return None
        return self._sync_rate

    def pin(self, s: Staged) -> None:
        """Keep s's staging file while work without a handle of its own uses it (see `handles`)."""
        s.handles += 1

    def unpin(self, s: Staged) -> None:
        s.handles -= 1
        self._maybe_retire(s)

    async def truncate(self, s: Staged, size: int) -> None:
        if size > MAX_OBJECT_BYTES:  # as in write(): the store could never hold it
            raise errors.fs_error(errors.EFBIG, "larger than the store's largest object (5 TiB)")
        if self._changes_closed(s, size):
            await self.keep_closed_version(s, truncate=False)
        async with s.lock:
            if s.pt_writers:
                self.observe(s)
            s.high_water = max(s.high_water, s.size, size)
            shrinks = size < s.size
            # Not when the size stays: on ext4, truncating a file to 0 (as the O_TRUNC of a new file
            # does) makes its last close start writeback of everything written meanwhile
            # (auto_da_alloc), so a committed staging file would still be written to the disk before
            # it could be removed.
            if size != s.size:
                with s.shrinking_if(shrinks):
                    await run_disk(os.ftruncate, s.fd, size)
            s.filled = min(s.filled, size)
            s.size = size
            s.mtime_ns = time.time_ns()
            s.generation += 1
            if shrinks:
                s.appends_only = False
                self._invalidate_stream(s, "truncated")
                self._shrank(s)  # handles opened before now may read the old size

    async def read_staged(self, node: Inode, off: int, size: int) -> bytes:
        s = node.staged
        if off >= s.size:
            return b""
        # The reader's handle may predate the staging file (it opened the committed object): pin the
        # file so a commit finishing meanwhile cannot close it - its fd number could be another
        # file's by the time the read runs.
        self.pin(s)
        try:
            return await pread_local(s.fd, min(size, s.size - off), off)
        finally:
            self.unpin(s)

    # -- close / fsync ----------------------------------------------------------------------------
    async def flush(self, s: Staged, *, unseen: bool = False, append_only: bool = False) -> None:
        """close(): make the data durable locally and record it. Reports a permanent failure of an
        earlier commit of this file. `unseen`: closed by a passthrough writer, whose writes we did
        not see; the file counts as changed. `append_only`: that writer's handle is append-only.

        The commit is queued when the last writer lets go (release), not here: FUSE flushes on every
        close() of every descriptor, and a shell's `> file` closes a dup of the file before writing to
        it, so committing at each flush would publish an empty object first and upload twice."""
        if s.dropped:
            return
        if unseen:
            await self._take_unseen_writes(s)
        async with s.flush_lock:
            if s.generation > s.flushed_generation and s.dirty and not s.dropped:
                gen, size = s.generation, s.size  # the version this close covers (the sync's)
                if self._close_commits(s) and await self._commit_in_place(s):
                    s.flushed_generation = max(s.flushed_generation, gen)
                    self.stats["committed_at_close"] += 1
                    return
                if (unseen and s.stored is not None and s.stored.may_describe(s)
                        and not s.commit_lock.locked()  # (never wait for another commit here)
                        and await self._commit_in_place(s, unchanged_only=True)):
                    # Fsynced (DCP does), then closed: the store has this content already, and
                    # there is nothing to sync or record (the sync was 0.5-1.5 s for 512 MiB).
                    s.flushed_generation = max(s.flushed_generation, gen)
                    self.stats["closed_unchanged"] += 1
                    return
                n, s.unsynced = s.unsynced, 0
                await self._sync(s, n)
                path = s.node.rel_path()
                if s.rid is None:
                    s.row_pending = True
                    try:
                        s.rid = await self.journal.add(s.volume.full_name, path, s.path.name, size)
                    finally:
                        s.row_pending = False
                    s.closed_size = size
                    if s.kept is not None:
                        self._supersede_kept(s)  # this close is newer, and its row names it
                else:
                    s.recording = gen
                    try:
                        await self.journal.mark_ready(s.rid, size, path, s.path.name)
                    finally:
                        s.recording = -1
                    s.closed_size = size
                    if s.kept is not None:
                        self._supersede_kept(s)  # this close is newer: the row names it now
                # While the row was written, the file may have been renamed or unlinked, and that
                # found no row to change: the row must not publish it under the old name, or bring
                # it back, after a crash.
                if s.dropped:
                    rid, s.rid = s.rid, None
                    await self.journal.remove(rid)
                    return
                if s.node.rel_path() != path:
                    await self.journal.rename(s.rid, s.node.rel_path())
                s.flushed_generation = max(s.flushed_generation, gen)
                if s.error is not None and s.error.errno != errors.ENOSPC:
                    s.error = None  # new data: try again
                if s.writers == 0:
                    self._enqueue(s, settle=True)
        if s.pt_rewriters > (1 if unseen and not append_only else 0):
            # Other passthrough writers hold it open, and what they write we do not see: the closed
            # version cannot be kept only when they write below its end (`_changes_closed`), so
            # it is kept aside now, a copy of the staging file as this close left it. (Append-only
            # writers cannot write there: several processes appending to one log copy nothing.)
            await self.keep_closed_version(s, truncate=False)
        if s.error is not None:
            raise s.error

    async def fsync(self, s: Staged) -> None:
        """Return once the file's current content is in the store (or its commit failed)."""
        s.fsync_waiters += 1  # before anything is queued: a stream must not wait for the last close
        self.pin(s)  # fsync of a directory holds no handle of the file
        try:
            if s.pt_writers:
                await self._take_unseen_writes(s)
            if s.dirty and not s.dropped:
                # The caller waits for the store anyway: commit now, and skip the local sync and the
                # journal record, which only matter while the file waits for a worker.
                if await self._commit_in_place(s):
                    self.stats["committed_by_fsync"] += 1
                    if s.error is None:
                        return
            if s.error is not None:
                s.error = None  # asked again: try again (the cause may be fixed by now)
                self._enqueue(s)
            await self.flush(s)
            target = s.generation
            while not s.dropped and s.committed_generation < target:
                if s.error is not None:
                    raise s.error
                if s.settling or (not s.queued and not s.commit_lock.locked()):
                    self._enqueue(s)  # (and waiting out COMMIT_SETTLE_S no longer)
                await s.progress.wait()
        finally:
            s.fsync_waiters -= 1
            self.unpin(s)

    async def fsync_tree(self, node: Inode) -> None:
        """fsync on a directory: wait for everything pending beneath it."""
        prefix = node.dir_prefix
        vol = node.volume
        beneath = [s for s in self.staged.values()
                   if s.volume is vol and not s.dropped and s.node.key.startswith(prefix) and s.dirty]
        for s in beneath:
            if s.settling:
                self._enqueue(s)  # all at once: waiting for them one by one would send them so
        for s in beneath:
            await self.fsync(s)

    async def release(self, h: "FileHandle") -> None:
        s = h.staged
        if s is None:
            return
        s.handles -= 1
        if h.writable:
            s.writers -= 1
        if s.writers == 0 and s.dirty and s.flushed_generation >= 0:
            self._enqueue(s, settle=True)  # the last writer is done: commit what close() made durable
        self._maybe_retire(s)

    def _stream_lag(self, s: Staged) -> int | None:
        """How many bytes of s its stream has still to upload, or None if s does not stream."""
        st = s.stream
        if st is None or not st.valid or st.error is not None or st.key != s.node.key:
            return None
        return s.size - st.done_bytes

    @staticmethod
    def _stream_rate(st: Stream) -> float | None:
        """Bytes per second st uploads while it has parts in flight, once that says something."""
        busy = st.busy_s
        if st.busy_since is not None:
            busy += trio.current_time() - st.busy_since
        if st.done_bytes < RATE_SAMPLE_BYTES or busy <= 0:
            return None
        return st.done_bytes / busy

    def _stream_keeps_up(self, s: Staged) -> bool:
        """Whether s streams with its upload no more than a few windows behind the writer, and
        not known to be slower than the staging disk. While it does, background syncs are skipped:
        close() will likely finish the upload instead, and staged bytes that were never written
        back need never reach the disk. Once it falls behind, or its upload is found slower than
        the disk (close() will then sync, see `_close_commits`), syncing resumes, so that a close()
        that has to sync finds little left to write. Until a sync has measured the disk, the first
        background sync is never skipped."""
        lag = self._stream_lag(s)
        disk = self._disk_rate()
        if lag is None or lag > STREAM_LAG_WINDOWS * self._stream_window or disk is None:
            return False
        up = self._stream_rate(s.stream)
        return up is None or up >= disk

    def _close_commits(self, s: Staged) -> bool:
        """Whether close() should finish s's stream rather than sync its staging file: whichever
        is expected to make the data durable sooner, by the rates measured on this host (this
        stream's upload since it began; recent syncs of the staging disk). On a training host both
        run at GB/s; on a small machine one may be twice the other, in either direction. Until
        both are measured, bytes stand in for time: the upload has less left to send than the
        sync would have to write, or no more than the parts in flight hold."""
        lag = self._stream_lag(s)
        if lag is None:
            return False
        up, disk = self._stream_rate(s.stream), self._disk_rate()
        if up is not None and disk is not None:
            return lag / up <= CLOSE_UPLOAD_PREFERENCE * s.unsynced / disk
        return lag <= max(self._stream_window, s.unsynced)

    async def _commit_in_place(self, s: Staged, *, unchanged_only: bool = False) -> bool:
        """Commit s's current content in the caller's time: True once it is in the store. On any
        failure return False, and leave the file for the durable path (flush, the workers' retries).
        `unchanged_only`: only if that takes sending nothing (`_still_stored`); quietly False if not."""
        async with s.commit_lock:
            s.abandon = False
            if s.dropped or s.node.staged is not s:
                return False
            if not s.dirty:
                return True
            gen = s.generation
            try:
                await self._commit(s, in_place=True, unchanged_only=unchanged_only)
            except (_Changed, errors.StoreError, OSError) as e:
                self._remove_superseded(s)
                if unchanged_only and isinstance(e, _Changed):
                    return False
                if not isinstance(e, _Changed):
                    s.attempts += 1
                log.info("committing %s at once did not work (%s); it is staged and queued instead",
                         s.node.mount_path(), e)
                self.stats["in_place_fallbacks"] += 1
                return False
            self._remove_superseded(s)
        return s.committed_generation >= gen

    # -- the queue ------------------------------------------------------------------------------
    def _enqueue(self, s: Staged, *, settle: bool = False) -> None:
        """Queue s for a worker; `settle`: a close queues it, and a small file waits out
        COMMIT_SETTLE_S first. Without `settle`, a file waiting so is queued at once."""
        if s.dropped:
            return
        if s.settling:
            if settle:
                return
            s.settling = False  # its entry in `_settling` is skipped
        elif s.queued:
            return
        elif (settle and not self._shutting_down and not s.fsync_waiters and s.stream is None
              and s.size <= SINGLE_PUT_MAX_BYTES and self._nursery is not None):
            s.queued = s.settling = True
            s.settle_due = time.monotonic() + COMMIT_SETTLE_S
            self._settling.append((s.settle_due, s))
            self._settler.unpark()
            return
        s.queued = True
        self._queue[id(s)] = s
        # Wake one idle worker, not all of them: with 64 workers, waking every one for each file
        # closed cost 64 task switches per file, most of the event loop's time writing small files.
        # A worker that is busy now looks at the queue before it waits again, so nothing is missed.
        self._idle_workers.unpark()

    async def _settle(self) -> None:
        """Hand files to the workers as their COMMIT_SETTLE_S runs out."""
        while True:
            while not self._settling:
                await self._settler.park()
            due, s = self._settling[0]
            wait = due - time.monotonic()
            if wait > 0:
                await trio.sleep(wait)
                continue
            self._settling.popleft()
            if s.settling and s.settle_due == due:
                s.settling = s.queued = False
                self._enqueue(s)

    async def _next(self) -> Staged:
        while not self._queue:
            await self._idle_workers.park()
        _, s = self._queue.popitem(last=False)
        s.queued = False
        return s

    async def _worker(self) -> None:
        while True:
            s = await self._next()
            if s.kept is None and self._closed_here(s) and self._open_past_close(s):
                # Opened again by append-only writers only (any other open keeps the closed
                # version aside itself), and still open now that this close's turn has come: keep
                # its version aside now, once, and commit that, rather than wait for them to let
                # go - a log held open for hours would otherwise hold back what was closed before.
                # (Before the commit lock: a flush takes its own lock, then the commit lock.)
                if self._await_appenders(s):
                    continue
                try:
                    await self.keep_closed_version(s, truncate=False)
                except OSError as e:
                    self._failed_here(s, e)
                    continue
            async with s.commit_lock:
                await self._take(s)
            # Also when it found nothing to do: a commit by fsync() that ended while this worker
            # held the lock could not retire the file, and nothing else would have.
            self._maybe_retire(s)

    async def _take(self, s: Staged) -> None:
        """A worker's turn with s, under its commit lock."""
        if s.namespace_waiters:
            # A rename or unlink waits for the lock, and asked the commit before this one to give
            # up: it goes first. The file is queued again, for its turn after that.
            self.stats["stepped_aside"] += 1
            self._enqueue(s)
            return
        s.abandon = False  # whoever asked has had the lock by now (or gave up waiting)
        self._remove_superseded(s)
        if s.dropped or s.node.staged is not s:
            return
        kept = s.kept is not None
        if not kept and (not s.dirty or s.flushed_generation < 0):
            return
        if not kept and self._open_past_close(s):
            return  # written since its last close, and still open: the last release queues it
        try:
            if kept:
                await self._commit_kept(s)
            else:
                await self._commit(s)
        except _Changed as e:
            log.debug("commit of %s starts again: %s", s.node.mount_path(), e)
            self.stats["restarted"] += 1
            self._enqueue(s)
        except errors.StoreError as e:
            self._failed(s, e)
        except OSError as e:
            self._failed_here(s, e)
        except Exception as e:  # noqa: BLE001 - a bug must not kill the worker pool
            log.exception("commit of %s failed unexpectedly", s.node.mount_path())
            self._failed(s, errors.StoreError(errors.EIO, f"unexpected: {e!r}", transient=True))
        finally:
            self._remove_superseded(s)

    def _await_appenders(self, s: Staged) -> bool:
        """A commit's turn found append-only writers open past the last close: give them one more
        COMMIT_SETTLE_S to close, once per commit, and say whether it did. A logger that opens the
        file for every line holds it open for a moment only: under load the turn of each close often
        came while the next line was being written, and each time the whole file was copied aside
        (3-9 copies of 4 MiB in 50 lines). Once they close, that close is committed, every line in
        it; a writer still open at the next turn (a log held open for hours) gets its copy then."""
        if s.appenders_awaited_at == s.committed_generation:
            return False
        s.appenders_awaited_at = s.committed_generation
        self._enqueue(s, settle=True)  # queued at once where no settle applies: that turn copies
        return True

    @staticmethod
    def _open_past_close(s: Staged) -> bool:
        """Still open for writing, and written since its last close (or by passthrough writers,
        whose writes we do not see), with nobody in fsync(): what it holds now no close covers."""
        return (s.writers > 0 and not s.fsync_waiters
                and (s.generation > s.flushed_generation or s.pt_writers > 0))

    def _failed_here(self, s: Staged, e: OSError) -> None:
        """A commit step failed for this host's own trouble. A full disk (the journal's, or the
        cache's) passes: retried like a store's 503, not reported failed until the next fsync()."""
        self._failed(s, errors.StoreError(e.errno or errors.EIO, str(e),
                                          transient=e.errno in (errno.ENOSPC, errno.EDQUOT)))

    def _failed(self, s: Staged, e: errors.StoreError) -> None:
        s.attempts += 1
        path = s.node.mount_path()
        if e.transient:
            delay = min(RETRY_CAP_S, RETRY_FIRST_S * 2 ** min(s.attempts - 1, 10))
            delay *= 0.5 + random.random()
            level = logging.WARNING if s.attempts < 5 else logging.ERROR
            log.log(level, "commit of %s failed (attempt %d): %s; retrying in %.1f s", path, s.attempts, e, delay)
            self.stats["retries"] += 1
            s.retry_reason = str(e)
            if s.rid is not None:
                self.journal.note_attempt_nowait(s.rid, s.attempts, str(e), failed=False)
            self._nursery.start_soon(self._retry_later, s, delay)
            return
        log.error("commit of %s failed permanently: %s; the data stays staged in %s", path, e, s.path)
        self.stats["failed"] += 1
        # strerror, not str(e): the code, status and key are carried over and printed once.
        s.error = errors.StoreError(e.errno, f"commit failed: {e.strerror}", code=e.code, status=e.status,
                                    request_id=e.request_id, key=e.key)
        if s.rid is not None:
            self.journal.note_attempt_nowait(s.rid, s.attempts, str(e), failed=True)
        s.notify()

    async def _retry_later(self, s: Staged, delay: float) -> None:
        await trio.sleep(delay)
        self._enqueue(s)

    # -- committing -------------------------------------------------------------------------------
    async def _commit(self, s: Staged, *, in_place: bool = False, unchanged_only: bool = False) -> None:
        """Upload s's content (under its commit lock). `in_place`: for a caller waiting on it
        (`_commit_in_place`), so even a file still open for writing is committed now.
        `unchanged_only`: only if nothing needs sending (`_still_stored`), else _Changed."""
        vol = s.volume
        store = self.core.store_for(vol)
        key = s.node.key
        gen = s.generation
        t0 = time.monotonic()
        st = s.stream
        s.published = None  # what this commit makes replaces it
        content = None
        unchanged = False
        if st is not None and st.valid and st.key == key:
            if unchanged_only:
                raise _Changed("it streams again")  # its parts are on their way: that upload finishes it
            if s.writers > 0 and not s.fsync_waiters and not in_place:
                return  # still being written: its last close queues it again
            info, gen = await self._finish_stream(s, store, for_rename=not in_place)
            content = st.content
        elif (info := await self._still_stored(s, key, gen)) is not None:
            content, unchanged = s.stored.ranges, True
            self.stats["commits_unchanged"] += 1
        elif unchanged_only:
            raise _Changed("changed since its last commit")
        else:
            self._invalidate_stream(s, "committing whole")
            if s.size <= SINGLE_PUT_MAX_BYTES:
                budget = self.core.budget
                reserved = s.size
                await budget.reserve(reserved)
                try:
                    async with s.lock:
                        if (s.generation != gen and s.writers > 0 and not in_place
                                and not s.fsync_waiters):
                            # Opened and written while we waited for memory: what it holds now no
                            # close covers. Its last close queues it again.
                            raise _Changed("written while its commit waited")
                        gen = s.generation
                        size = s.size
                        data = await pread_local(s.fd, size, 0)
                    if len(data) != size:
                        raise errors.StoreError(errors.EIO, "staging file shorter than recorded",
                                                transient=True)
                    if s.pt_writers:
                        content = [(0, size, await run_disk(_digest, data))] if size else []
                    info = await store.put(vol.bucket, key, data, size)
                finally:
                    budget.release(reserved)
            else:
                # Written past us by writers still open: their close will count as a change, and
                # what we send now is what it is compared with (`_still_stored`).
                content = [] if s.pt_writers else None
                info = await self._multipart(s, store, key, for_rename=not in_place, content=content)
        # Published. Record it before anything else can look.
        node = s.node
        if node.key != key and not in_place and gen == s.generation and self._finishes_for_rename(s, key):
            # Renamed meanwhile, and the rename waits for this lock: it copies the object to the
            # new name (`_plan_rename`) and deletes this one, rather than have it sent again.
            # Queued too: should the rename not copy it after all (it fails, or the file changed
            # meanwhile), the file is committed again; if it does, the worker finds nothing to do.
            s.published = (key, gen)
            self.stats["published_for_rename"] += 1
            self._enqueue(s)
            return
        if node.key != key or s.dropped:
            # A parent directory was renamed (or the file unlinked) while we uploaded: the object we
            # just made sits under the old name. Take it away again; the file commits anew if live.
            # Unless this commit sent nothing: the object there is the file's last commit, which
            # the rename (or unlink) waiting for our lock deals with - a rename copies it to the
            # new name for a writer still writing.
            if not unchanged:
                await store.delete(vol.bucket, key)
            raise _Changed("renamed or unlinked while it was uploaded" if not unchanged
                           else "renamed or unlinked while it was compared")
        if node.etag and node.etag != info.etag:
            self.core.retire_version(vol, key, node.etag)  # the version this commit replaced
        node.etag = info.etag
        node.size = s.size if info.size < 0 else info.size
        s.stored = _Stored(key, info.etag, content) if content is not None else None
        # The mtime it showed while staged (its last write, or what touch set), not the time the
        # upload ended: a commit is no change to the file (core.Core._describe).
        node.mtime_ns = s.mtime_ns
        node.local_mtime_etag = info.etag
        node.attr_expires = time.monotonic() + self.cfg.metadata_ttl_s
        # The kernel's pages are this content - unless passthrough writers wrote it, past the pages.
        node.page_cache_etag = None if s.pt_written else info.etag
        self.core.note_changed(node)  # listings and probes still on their way must not undo this
        s.note_committed(gen, key)
        s.attempts = 0
        s.retry_reason = ""
        s.error = None
        # The journal row of what is now in the store goes. Its removal may wait for the journal's
        # next batch when the row names this same content (a crash meanwhile publishes it again:
        # no harm). When the store now holds newer content than the row's version (an fsync of
        # writes no close has covered), the removal is durable before anyone is told: a crash would
        # otherwise put the row's older version back over what fsync promised.
        stale_row = None
        if s.kept is not None and gen >= s.kept.generation:
            if s.recording > gen:
                self._supersede_kept(s)  # a newer close is taking its row over
            else:
                if gen > s.kept.generation:
                    stale_row, s.rid = s.rid, None
                self._end_kept(s)  # its version, or a newer one, is in the store: it must never follow
        self.stats["committed"] += 1
        self.stats["committed_bytes"] += s.size
        log.debug("committed %s (%d bytes) in %.2f s%s", node.mount_path(), s.size, time.monotonic() - t0,
                  ": unchanged since its last commit, nothing sent" if unchanged else "")
        if s.committed_generation >= s.flushed_generation and s.rid is not None and s.recording <= gen:
            # (Also while the file is dirty again: what was written since no close has covered.)
            if gen > s.flushed_generation:
                stale_row, s.rid = s.rid, None
            else:
                self.journal.remove_nowait(s.rid)
                s.rid = None
        if stale_row is not None:
            await self.journal.remove(stale_row)
        if (not s.dirty and s.rid is None and s.kept is None and s.handles > 0 and not s.dropped
                and not s.writers and not s.opening
                and not s.path.name.startswith(COMMITTED_PREFIX) and s.node.staged is s):
            # Readers keep it open: after a crash it would look like a file never closed. Say it is
            # committed, in its name (a crash cannot leave the name and the content disagreeing).
            # Never while a writer has it open or is opening it: its close would record the name
            # this is about to change (and a crash then lose the row's file).
            async with s.name_lock:
                try:
                    if (not s.path.name.startswith(COMMITTED_PREFIX) and not s.writers
                            and not s.opening and not s.dirty):
                        path = s.path.with_name(COMMITTED_PREFIX + s.path.name)
                        await run_disk(os.rename, s.path, path)
                        s.path = path
                    if s.path.name.startswith(COMMITTED_PREFIX) and (s.writers or s.dirty or s.opening):
                        # (Defensive: a writer's open renames it back itself, under the lock.)
                        path = s.path.with_name(s.path.name[len(COMMITTED_PREFIX):])
                        await run_disk(os.rename, s.path, path)
                        self.journal.note_new_file(path.name)
                        s.path = path
                except OSError as e:
                    log.debug("could not mark %s committed: %s", s.path, e)
        parent = node.parent
        if parent is not None and parent.listing is not None:
            from .inodes import Entry

            parent.listing.entries[node.name] = Entry(False, node.size, node.etag, node.mtime_ns)
        cache, version = self.core.cache, ObjectVersion(store.name, vol.bucket, key, info.etag)
        blocks = -(-s.size // self.cfg.block_bytes)
        # Unchanged: that version was cached when it was committed, unless a change cut the caching
        # short (an fsync's commit, then the close at once: the close counts as a change).
        if (CACHE_AFTER_COMMIT_MIN_BYTES <= s.size <= CACHE_AFTER_COMMIT_MAX_BYTES and cache is not None
                and not s.dirty and (not unchanged or not cache.may_hold(version, blocks))):
            if in_place:  # someone waits for the commit, not for the cache
                self.pin(s)
                self._nursery.start_soon(self._cache_committed_later, s, version)
            else:
                await self._cache_committed(s, version)
        s.notify()

    async def _still_stored(self, s: Staged, key: str, gen: int) -> ObjectInfo | None:
        """The object's info if s's staging file holds exactly what its last commit sent to `key`,
        whose ETag the file still shows; else None. DCP, for one, fsyncs each file and then closes
        it: both count as changes of a passthrough writer's file, and the close sent 512 MiB files
        a second time. Reads and hashes the file (about a tenth of the time an upload takes)."""
        stored = s.stored
        if stored is None or stored.key != key or not stored.may_describe(s):
            return None
        same = True

        async def one(off: int, length: int, digest: bytes) -> None:
            nonlocal same
            async with self._part_slots, self._part_data(s, None, off, length, in_memory=True) as data:
                if same and (len(data) != length or await run_disk(_digest, data) != digest):
                    same = False

        self.pin(s)
        try:
            async with trio.open_nursery() as nursery:
                for off, length, digest in stored.ranges:
                    nursery.start_soon(one, off, length, digest)
        finally:
            self.unpin(s)
        if not same or s.generation != gen or s.size != stored.size:
            return None
        return ObjectInfo(key, stored.size, stored.etag, s.mtime_ns)

    async def _cache_committed_later(self, s: Staged, version: ObjectVersion) -> None:
        try:
            await self._cache_committed(s, version)
        except OSError as e:
            log.debug("could not cache %s after its commit: %s", s.node.mount_path(), e)
        finally:
            self.unpin(s)

    async def _cache_committed(self, s: Staged, version: ObjectVersion) -> None:
        """Put the committed file's blocks in the cache, a part at a time as the read path does:
        read into a pooled, page-aligned buffer under the memory budget and written from it with
        O_DIRECT, without a copy. (Block by block, each took an unbudgeted `bytes` and a copy into
        an aligned buffer, and made a cache file of its own.)"""
        B, P = self.cfg.block_bytes, self.cfg.part_bytes
        if s.dirty:
            return  # changed since the commit (this may run later, see _cache_committed_later)
        gen = s.generation  # a change from here on ends the caching (_part_data: _Changed)
        off = 0
        try:
            while off < s.size and not s.giving_up:  # optional work: a rename or unlink goes first
                n = min(P, s.size - off)
                async with self._caching, self._part_data(s, None, off, n, gen, in_memory=True) as data:
                    if len(data) != n:
                        return  # shorter than committed: changed meanwhile (and so no longer cached)
                    # A pooled buffer is page-aligned: the segment is written from it, without a copy.
                    backing = data.obj if isinstance(data, memoryview) else None
                    await run_disk(self.core.cache.put_blocks, version, off // B, data, backing)
                off += n
        except _Changed:
            return

    @contextlib.asynccontextmanager
    async def _part_data(self, s: Staged, store: AsyncStore | None, off: int, length: int,
                         gen: int | None = None, *, in_memory: bool = False):
        """The body of one upload part. Where the store sends files (plain HTTP), that is the range
        of s's staging file itself: sendfile(2) hands its page-cache pages to the socket, with no
        copy into or out of our memory, so it takes nothing from the memory budget. Otherwise the
        bytes are read, under the budget, into a pooled buffer when the part is pool-sized: a fresh
        8 MiB bytes object costs 2,048 page faults and an munmap, per part. With `gen`, check under
        the file's lock that the file is still at that generation, or fail with _Changed (a stream
        reads appended data no write touches, without the lock). `in_memory`: the bytes are wanted
        (to take their digest), never a file range.

        A file range is read while it is sent, after the check: a write meanwhile can put newer
        bytes in the part. Every caller checks the generation again before it completes the upload
        (or, for a stream, any such write abandons the stream), so such a part is never published."""
        lock = s.lock if gen is not None else contextlib.nullcontext()

        async def read(fn, *args):
            async with lock:
                if gen is not None and s.generation != gen:
                    raise _Changed("written while its parts were read")
                return await run_disk(fn, *args) if fn is not None else None

        if not in_memory and store.sends_files:
            await read(None)
            yield FileBody(s.fd, off, length)
            return
        budget, pool = self.core.budget, self.core.pool
        await budget.reserve(length)
        buf = await pool.acquire(length)
        whole = data = None
        try:
            if buf is None:
                data = await read(os.pread, s.fd, length, off)
                yield data
                return
            whole = memoryview(buf)
            n = await read(os.preadv, s.fd, [whole[:length]], off)
            data = whole[:n]
            yield data
        finally:
            if buf is not None:
                for view in (data, whole):
                    if view is not None:
                        try:
                            view.release()
                        except BufferError:
                            pass  # still in use somewhere: the pool sees that and drops the buffer
                pool.release(buf)
            budget.release(length)

    async def _multipart(self, s: Staged, store: AsyncStore, key: str, *, for_rename: bool = False,
                         content: list | None = None) -> object:
        """Upload s whole as a multipart upload to `key`. A rename or unlink makes the parts not yet
        started give up; `for_rename`: if none was left to start when a rename of the file away
        from `key` came, the upload is completed for the rename to copy (`namespace_lock`).
        `content`: filled with each part's (offset, length, xxh3), the parts then read into memory
        to be hashed as they are sent."""
        vol = s.volume
        gen = s.generation
        size = s.size
        upload_id = await self._start_upload(vol, store, key)
        parts: dict[int, str] = {}
        ranges = []
        off, n = 0, 1
        while off < size:
            ps = part_bytes_for(n, self.cfg.part_bytes)
            ranges.append((n, off, min(ps, size - off)))
            off += ps
            n += 1
        if len(ranges) > MAX_PARTS:
            raise errors.StoreError(errors.EFBIG, "too many parts", key=key)
        digests: dict[int, tuple[int, int, bytes]] = {}
        try:
            sem = trio.Semaphore(PARTS_IN_FLIGHT_PER_FILE)

            async def one(n: int, off: int, length: int) -> None:
                async with sem, self._part_slots:
                    if s.giving_up:
                        raise _Changed("renamed or unlinked while its parts were uploaded")
                    async with self._part_data(s, store, off, length, gen, in_memory=content is not None) as data:
                        if content is not None:
                            if len(data) != length:
                                raise _Changed("the file shrank while its parts were read")
                            digests[n] = (off, length, await run_disk(_digest, data))
                        parts[n] = await store.upload_part(vol.bucket, key, upload_id, n, data, length)

            try:
                async with trio.open_nursery() as nursery:
                    for n, off, length in ranges:
                        nursery.start_soon(one, n, off, length)
            except BaseExceptionGroup as group:
                raise _representative(group) from None
            async with s.lock:
                if s.generation != gen:
                    raise _Changed("written while its parts were uploaded")
            if s.giving_up and not (for_rename and self._finishes_for_rename(s, key)):
                raise _Changed("renamed or unlinked while its parts were uploaded")
            info = await store.complete_multipart(vol.bucket, key, upload_id, sorted(parts.items()))
            self.journal.remove_upload_nowait(upload_id)
            self.stats["multipart"] += 1
            if content is not None:
                content.extend(digests[n] for n in sorted(digests))
            return info
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._abort_quietly(vol, key, upload_id)
            raise

    async def _start_upload(self, vol: Volume, store: AsyncStore, key: str) -> str:
        """Create a multipart upload, recorded durably first so a crash cannot leave its parts behind.

        The record is made before the upload exists (an intent: key and time) and given the upload's
        id once the store answers; no part is sent before that. A daemon killed in between leaves an
        intent, and the next mount names in the log the uploads it may have created
        (`_report_intended`)."""
        intent = await self.journal.add_upload_intent(vol.full_name, key)
        try:
            upload_id = await store.create_multipart(vol.bucket, key)
        except errors.StoreError as e:
            if e.status and not e.transient:
                self.journal.remove_upload_nowait(intent)  # refused: the store created nothing
            # Otherwise it may have been created with the answer lost: the intent stays for the
            # next mount to clean up.
            raise
        try:
            await self.journal.resolve_upload(intent, upload_id)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._abort_quietly(vol, key, upload_id)
                self.journal.remove_upload_nowait(intent)
            raise
        return upload_id

    async def _report_intended(self, vol: Volume, key: str, intents: list[tuple[str, float]]) -> None:
        """A killed daemon recorded `intents` ((id, time) rows) for multipart uploads of `key` and
        never their ids: each create may have reached the store with its answer lost, or not. Such
        an upload holds no parts (none is sent before its id is recorded), so leaving it costs no
        stored bytes; but it cannot be told from another writer's upload of the same key (another
        host's, busy with its parts): the store lists only key and time for both. Aborting by key
        and time aborted those too. The uploads it may be are named in the log, for the operator or
        the bucket's lifecycle rule for incomplete uploads, and only the intents go."""
        lo = min(t for _, t in intents) - INTENT_CLOCK_SLACK_S
        hi = max(t for _, t in intents) + INTENT_CREATE_WINDOW_S
        try:
            uploads = await self.core.store_for(vol).list_multipart(vol.bucket, key)
            found = ", ".join(u.upload_id for u in uploads
                              if u.key == key and (u.initiated is None or lo <= u.initiated <= hi)) or "none"
        except errors.StoreError as e:
            found = f"not known ({e})"
        log.warning("a daemon stopped while creating a multipart upload of %r may have left it behind, holding "
                    "no parts; it is not aborted, since another writer's upload of that key looks the same. "
                    "Uploads of that key from then: %s", key, found)
        for intent, _ in intents:
            self.journal.remove_upload_nowait(intent)

    async def _abort_quietly(self, vol: Volume, key: str, upload_id: str) -> None:
        try:
            await self.core.store_for(vol).abort_multipart(vol.bucket, key, upload_id)
            self.journal.remove_upload_nowait(upload_id)
        except errors.StoreError as e:
            log.info("could not abort multipart upload %s of %r: %s", upload_id, key, e)

    # -- streaming uploads ----------------------------------------------------------------------
    def _maybe_stream(self, s: Staged) -> None:
        if self._shutting_down or not s.appends_only or s.writers != 1 or s.dropped:
            return
        st = s.stream
        if st is None:
            if s.size < STREAM_START_BYTES:
                return
            if s.commit_lock.locked():
                # A commit (an fsync's, say) is sending the file as it is now, and a stream would
                # send the same bytes again from its first part. The next write (or growth the
                # watcher finds) after the commit begins one; a passthrough watcher that found
                # this growth before the fsync took it comes back only now.
                return
            st = s.stream = Stream(s.node.key, verify=s.pt_writers > 0)
            st.idle.set()
            self._nursery.start_soon(self._create_stream, s, st)
        if not st.valid:
            return
        while True:
            ps = part_bytes_for(st.next_part, self.cfg.part_bytes)
            if s.size - st.next_off < ps:
                return
            n, off = st.next_part, st.next_off
            st.next_part += 1
            st.next_off += ps
            if st.inflight == 0:
                st.busy_since = trio.current_time()
            st.inflight += 1
            st.idle = trio.Event() if st.idle.is_set() else st.idle
            self.pin(s)  # the part is read from the file later, maybe after the last close
            self._nursery.start_soon(self._stream_part, s, st, n, off, ps)

    async def _create_stream(self, s: Staged, st: Stream) -> None:
        vol = s.volume
        try:
            st.upload_id = await self._start_upload(vol, self.core.store_for(vol), st.key)
        except OSError as e:  # the store's refusal, or the journal's (a full staging disk)
            st.error = e
            st.valid = False
        finally:
            st.created.set()
        if not st.valid and st.upload_id:
            await self._abort_quietly(vol, st.key, st.upload_id)

    async def _stream_part(self, s: Staged, st: Stream, n: int, off: int, length: int) -> None:
        vol = s.volume
        try:
            await st.created.wait()
            if not st.valid or st.upload_id is None:
                return
            store = self.core.store_for(vol)
            async with self._part_slots:
                verify = st.verify and s.pt_writers > 0
                async with self._part_data(s, store, off, length, in_memory=verify) as data:
                    digest = await run_disk(_digest, data) if verify else b""
                    if not st.valid:
                        return
                    st.parts[n] = await self._upload_part_retrying(store, vol, st, n, data, length)
                if verify:
                    st.digests[n] = (off, length, digest)
                st.done_bytes += length
                self.stats["stream_parts"] += 1
        except errors.StoreError as e:
            st.error = e
            self._invalidate_stream(s, f"part upload failed: {e}")
        except Exception as e:  # noqa: BLE001 - this task's nursery is the committer's: all of it would end
            # This host's own trouble (the staging file could not be read: EIO, say) or a bug. The
            # stream is given up like one the store refused: the file is committed whole after its
            # close, by a worker that handles the error as any commit's.
            if isinstance(e, OSError):
                log.warning("stream part %d of %s failed here: %s", n, s.node.mount_path(), e)
            else:
                log.exception("stream part %d of %s failed unexpectedly", n, s.node.mount_path())
            st.error = e
            self._invalidate_stream(s, f"part {n} failed here: {e!r}")
        finally:
            st.inflight -= 1
            if st.inflight == 0:
                st.idle.set()
                if st.busy_since is not None:
                    st.busy_s += trio.current_time() - st.busy_since
                    st.busy_since = None
            self.unpin(s)

    async def _upload_part_retrying(self, store: AsyncStore, vol: Volume, st: Stream, n: int, data,
                                    length: int) -> str:
        delay = RETRY_FIRST_S
        for attempt in range(5):
            try:
                return await store.upload_part(vol.bucket, st.key, st.upload_id, n, data, length)
            except errors.StoreError as e:
                if not e.transient or attempt == 4 or not st.valid:
                    raise
                await trio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, RETRY_CAP_S)
        raise AssertionError("unreachable")

    async def _verify_stream(self, s: Staged, st: Stream, store: AsyncStore) -> None:
        """Check each part a stream sent against the staging file now, and send again the ones
        that were written over since (passthrough writers: we could not see where they wrote).
        Parts checked by an earlier call are not checked again."""
        vol = s.volume
        resent = 0
        todo = [(n, part) for n, part in sorted(st.digests.items()) if n not in st.checked]

        async def one(n: int, off: int, length: int, digest: bytes) -> None:
            nonlocal resent
            async with self._part_slots, self._part_data(s, store, off, length, in_memory=True) as data:
                if len(data) != length:
                    raise _Changed(f"the file shrank under part {n} of its stream")
                now = await run_disk(_digest, data)
                if now == digest:
                    st.checked.add(n)
                    return
                st.parts[n] = await self._upload_part_retrying(store, vol, st, n, data, length)
                st.digests[n] = (off, length, now)  # what the part holds in the store now
                st.checked.add(n)
                resent += 1

        try:
            async with trio.open_nursery() as nursery:
                for n, (off, length, digest) in todo:
                    nursery.start_soon(one, n, off, length, digest)
        except BaseExceptionGroup as group:
            raise _representative(group) from None
        self.stats["stream_parts_verified"] += len(todo)
        if resent:
            self.stats["stream_parts_resent"] += resent
            log.debug("%s: %d part(s) of its stream were written over and sent again", s.node.mount_path(), resent)

    def _invalidate_stream(self, s: Staged, why: str) -> None:
        st = s.stream
        if st is None:
            return
        s.stream = None
        if not st.valid:
            return
        st.valid = False
        # Parts already sent are wasted, and a file that streamed may now finish later than its
        # close: worth a line in the log. Before any part, it costs nothing.
        sent = st.next_part - 1
        log.log(logging.INFO if sent else logging.DEBUG, "stream upload of %s abandoned after %d part(s), "
                "%d bytes: %s", s.node.mount_path(), sent, st.next_off, why)
        self.stats["streams_abandoned"] += 1
        if self._nursery is not None:
            self._nursery.start_soon(self._abort_stream, s.volume, st)

    async def _abort_stream(self, vol: Volume, st: Stream) -> None:
        await st.created.wait()
        await st.idle.wait()
        if st.upload_id:
            await self._abort_quietly(vol, st.key, st.upload_id)

    async def _finish_stream(self, s: Staged, store: AsyncStore, *, for_rename: bool = False) -> tuple[object, int]:
        """Complete a stream: upload what follows its last full part, then complete the upload.

        Returns the object's info and the generation it holds. Appends that arrive meanwhile belong
        to a later generation (and a later commit); they do not disturb this one. `for_rename`: a
        rename of the file away from the stream's key that waits meanwhile does not stop it
        (`namespace_lock`).
        """
        st = s.stream
        await st.created.wait()
        vol = s.volume
        async with s.lock:
            if s.stream is not st or not st.valid or st.upload_id is None:
                raise _Changed("its stream was abandoned or never created")
            s.stream = None  # no part joins this upload any more
            gen, size = s.generation, s.size
            tail = size - st.next_off
            data = await run_disk(os.pread, s.fd, tail, st.next_off) if tail > 0 else b""
        try:
            if st.verify:
                # The writers are gone: check the parts sent so far while the last ones are still
                # on their way, then those.
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._verify_stream, s, st, store)
                        await st.idle.wait()
                except BaseExceptionGroup as group:
                    raise _representative(group) from None
            await st.idle.wait()
            if st.error is not None or not st.valid:
                raise _Changed(f"its stream failed: {st.error}" if st.error is not None
                               else "its stream was abandoned")
            if st.verify:
                await self._verify_stream(s, st, store)
            if s.giving_up and not (for_rename and self._finishes_for_rename(s, st.key)):
                raise _Changed("renamed or unlinked while its stream was finished")
            if tail > 0:
                st.parts[st.next_part] = await store.upload_part(vol.bucket, st.key, st.upload_id,
                                                                 st.next_part, data, tail)
            info = await store.complete_multipart(vol.bucket, st.key, st.upload_id, sorted(st.parts.items()))
            self.journal.remove_upload_nowait(st.upload_id)
        except BaseException:
            st.valid = False
            with trio.CancelScope(shield=True):
                await self._abort_quietly(vol, st.key, st.upload_id)
            raise
        ranges = [st.digests.get(n) for n in range(1, st.next_part)]
        if st.verify and all(r is not None for r in ranges):
            if tail > 0:
                ranges.append((st.next_off, tail, await run_disk(_digest, data)))
            st.content = ranges
        self.stats["streamed"] += 1
        return info, gen

    @staticmethod
    def _finishes_for_rename(s: Staged, key: str) -> bool:
        """Whether a commit that made (or is making) s's object under `key` leaves it there for the
        rename that waits for it to copy (`namespace_lock`)."""
        return (s.moving_from == key and not s.dropped and s.kept_of is None and s.kept is None
                and s.size >= RENAME_COPY_MIN_BYTES)

    # -- namespace changes of staged files --------------------------------------------------------
    @contextlib.asynccontextmanager
    async def namespace_lock(self, s: Staged, *, moving_from: str | None = None):
        """s's commit lock, for a rename or an unlink of the file (or of a directory above it).

        A commit that holds the lock now is asked to give up at its next part: its upload goes to
        a name that is about to change or vanish, and finishing it first would keep `mv` or `rm`
        (and the directory, which the kernel locks meanwhile) waiting for the whole upload - and
        the file would then be uploaded again under its new name anyway.

        `moving_from`: the file is renamed away from this key. A commit finishing the file's
        stream there goes on (`_finish_stream`), as does a multipart upload with every part on its
        way (`_multipart`): the rename waits for the parts in flight either way, and after them
        only the last part and the completion are left, where giving up would send every byte
        again. The rename then copies the object on the server."""
        if s.commit_lock.locked():
            s.abandon = True
            s.moving_from = moving_from
        s.namespace_waiters += 1
        waiting = True
        try:
            async with s.commit_lock:
                s.namespace_waiters -= 1
                waiting = False
                s.abandon = False
                s.moving_from = None
                yield
        finally:
            if waiting:
                s.namespace_waiters -= 1
            s.moving_from = None

    async def settle_journal(self) -> None:
        """Before an object is deleted or renamed away in the store: no journal row of what this
        mount committed may come back after a power loss and publish it again (Journal.settle)."""
        await self.journal.settle()

    async def drop(self, s: Staged) -> None:
        """The file was unlinked or replaced: never commit it; its data goes with its last handle."""
        async with self.namespace_lock(s):
            was_queued = s.queued
            s.dropped = True
            self._queue.pop(id(s), None)
            s.queued = s.settling = False
            self._invalidate_stream(s, "dropped")
            if s.rid is not None:
                rid, s.rid = s.rid, None
                # Durably before unlink/rename returns: a row left behind by a crash would bring
                # the deleted file back, and publish it, at the next mount.
                try:
                    await self.journal.remove(rid)
                except BaseException:
                    # Not recorded (its disk full): nothing is dropped, and the unlink or rename
                    # fails. Left half done, the file stayed listed but was never committed, and a
                    # second unlink then succeeded with its row still there to publish it again.
                    s.rid, s.dropped = rid, False
                    if was_queued or (s.writers == 0 and s.dirty and s.flushed_generation >= 0):
                        self._enqueue(s)
                    raise
            self._end_kept(s)
            s.notify()
        self._maybe_retire(s)

    async def renamed(self, s: Staged, old_key: str | None = None) -> "_Rename":
        """The file now has another key: its content must be committed there. Says whether
        `old_key` holds an object of the file that the caller must delete (`_Rename.old_object`: a
        commit finished there while the rename waited) or had it copied and deleted (`copied`)."""
        async with self.namespace_lock(s, moving_from=old_key):
            had = s.committed_generation, s.committed_key
            try:
                plan = await self.renamed_locked(s, old_key)
            except BaseException:
                # Not renamed after all: the caller puts the name back.
                s.committed_generation, s.committed_key = had
                raise
            if plan.copied:
                await self._delete_moved(s.volume, old_key)
        self._maybe_retire(s)  # copied on the server, it may have nothing left to commit
        return plan

    async def renamed_locked(self, s: Staged, old_key: str | None = None) -> "_Rename":
        """`renamed`, for a caller that already holds the file's commit lock (`namespace_lock`).
        `old_key`: where the file's object is until the caller deletes it (see `_Rename`)."""
        return (await self.renamed_together([(s, old_key)], alone=True))[0]

    async def _delete_moved(self, vol: Volume, old_key: str) -> None:
        """Delete a renamed file's object under its old key, now that it is copied to the new one.
        Recorded in the journal first, so that a daemon killed before the delete has it done at the
        next mount (`_delete_left_behind`): otherwise the old name would be back for good. (Not
        before the copy: the object under the old key is then the file's only committed copy.) The
        record also makes durable the removal of the file's row, queued before it (`_copied`)."""
        try:
            marker = await self.journal.add_delete(vol.full_name, old_key)
        except OSError as e:
            log.warning("could not record the deletion of %r in the journal (%s); deleting it unrecorded", old_key, e)
            marker = None
        try:
            await self.core.store_for(vol).delete(vol.bucket, old_key)
        except errors.StoreError as e:
            log.warning("could not delete %r after its file was renamed and copied: %s%s", old_key, e,
                        "; the next mount deletes it" if marker else "")
            return
        if marker is not None:
            try:
                await self.journal.remove_delete(marker)
            except OSError as e:
                # The rename is done in the store (new key copied, old one gone): failing it now
                # would put the name back here over an object that is no longer there. The record
                # goes with the journal's next batch instead; until then, a kill would have the next
                # mount delete the old key again, which is gone already unless written anew since.
                log.warning("could not remove the journal's record of deleting %r (%s); it goes with the "
                            "next batch", old_key, e)
                self.journal.remove_upload_nowait(marker)

    async def renamed_together(self, files: list[tuple[Staged, str | None]], *,
                               alone: bool = False) -> list["_Rename"]:
        """`renamed_locked` for several files (those beneath a renamed directory), their journal
        rows changed in one transaction. The rows change all or none: a failure (the journal's disk
        full) raises with every file's commit state as it was, for the caller to put the names back.
        One at a time, a failure half way left the rows of some files under the new names and of
        the others under the old ones, for the next mount to publish there. `alone`: a rename of
        one file (`renamed_locked`), which may copy its object on the server (`_plan_rename`).
        Returns, per file, what was done (`_Rename`: whether its old key holds an object to delete)."""
        had = [(s, s.committed_generation, s.committed_key) for s, _ in files]
        try:
            plans = [await self._plan_rename(s, old_key, may_copy=alone) for s, old_key in files]
            # Made at once, with no await between: the rows' change counter (seq) and the names
            # are those of now, as queued.
            statements, adds = [], []  # adds: per statement, (file, size) for a first row, else None
            for (s, _), plan in zip(files, plans):
                if plan.renames_row and s.rid is not None:
                    statements.append(self.journal.rename_statement(s.rid, s.node.rel_path()))
                    adds.append(None)
                elif plan.adds_row and s.rid is None and not s.row_pending:  # else a close added it since
                    statements.append(self.journal.add_statement(s.volume.full_name, s.node.rel_path(),
                                                                 s.path.name, plan.size))
                    adds.append((s, plan.size))
            rowids = await self.journal.execute_together(statements) if statements else []
        except BaseException:
            for s, generation, key in had:
                s.committed_generation, s.committed_key = generation, key
            raise
        for added, rowid in zip(adds, rowids):
            if added is not None:
                s, size = added
                s.closed_size, s.rid = size, rowid
        for (s, _), plan in zip(files, plans):
            # Not while a writer still has it open and has written since the content recorded:
            # that would publish a snapshot of a file half written. Its last close queues it.
            if plan.queue and (s.writers == 0 or s.generation <= s.flushed_generation or s.kept is not None):
                self._enqueue(s)
        return plans

    async def _plan_rename(self, s: Staged, old_key: str | None, *, may_copy: bool = False) -> "_Rename":
        """What a rename of s to its node's new name needs before it is recorded: done here, except
        the change of its journal row, which is returned for `renamed_together` to write.
        `may_copy`: a large file whose object under the old key holds what the file holds now (its
        commit was done, or finished while the rename waited: `namespace_lock`) is copied to the
        new key on the server rather than uploaded again."""
        published, s.published = s.published, None
        plan = await self._plan_move(s, old_key, may_copy, published)
        if published is not None and published[0] == old_key:
            # Completed under the old key while the rename waited: copied, or (changed since, or
            # in a directory's rename) uploaded again under the new key. The old key's must go.
            plan.old_object = True
        return plan

    async def _plan_move(self, s: Staged, old_key: str | None, may_copy: bool,
                         published: tuple[str, int] | None) -> "_Rename":
        self._invalidate_stream(s, "renamed")
        s.stored = None  # what it says was sent to the old key
        had = s.committed_generation
        if (may_copy and old_key is not None and s.kept is None and s.size >= RENAME_COPY_MIN_BYTES
                and not s.pt_writers
                and (published == (old_key, s.generation)
                     or (had >= s.generation and s.flushed_generation <= had and s.committed_key == old_key))):
            vol = s.volume
            try:
                info = await self.core.store_for(vol).copy(vol.bucket, old_key, s.node.key)
            except errors.StoreError as e:
                # The copy only saves sending the bytes again: the rename does not fail for it.
                log.info("could not copy %s from %r on the server (%s); it is uploaded again", s.node.mount_path(),
                         old_key, e)
            else:
                self._copied(s, info, s.generation)
                return _Rename(old_object=True, copied=True, copy=info)
        if (old_key is not None and had >= 0 and s.flushed_generation <= had and s.kept is None
                and s.writers > 0 and (s.generation > had or s.pt_writers)
                and s.committed_key in (old_key, s.node.key)):
            # Committed, then written again by a writer that still has it open: the object is the
            # file's last closed version, and the staging file holds bytes nobody has closed yet
            # (journaling it here would publish them after a crash). The object is copied to the new
            # name on the server, as for a file not staged; the writer's last close commits the rest.
            # Unless that commit already went to the new name: restarted after the name moved, it
            # may have finished before the rename's turn came.
            if s.committed_key == old_key:
                vol = s.volume
                info = await self.core.store_for(vol).copy(vol.bucket, old_key, s.node.key)
                s.node.etag = info.etag
                s.committed_key = s.node.key
                return _Rename(renames_row=True, copy=info)
            return _Rename(renames_row=True)
        s.committed_generation = -1  # whatever was committed went under the old name
        if s.flushed_generation < had:
            # Content in the store that no close recorded (committed by fsync, or an unchanged copy
            # of the object opened for writing): the old key goes, so it must now be committed under
            # the new one like a closed file - durable and journaled first.
            await run_disk(os.fdatasync, s.fd)
            s.flushed_generation = had
        if s.flushed_generation >= 0 and s.rid is None:
            # A close writing the first row names the file anew once it is written (flush):
            # a second row now would have the file committed twice after a crash.
            return _Rename(adds_row=not s.row_pending, size=s.size, queue=True)
        return _Rename(renames_row=True, queue=s.flushed_generation >= 0)

    def _copied(self, s: Staged, info, gen: int) -> None:
        """s's content of generation `gen` was copied to its key on the server (a rename): what a
        commit records (`_commit`), for the node, the file and its journal row."""
        node = s.node
        node.etag = info.etag
        node.size = s.size
        node.mtime_ns = s.mtime_ns  # renamed, not changed: its mtime stays
        node.local_mtime_etag = info.etag
        node.attr_expires = time.monotonic() + self.cfg.metadata_ttl_s
        node.page_cache_etag = None if s.pt_written else info.etag
        s.note_committed(gen, node.key)
        s.attempts = 0
        s.retry_reason = ""
        s.error = None
        if s.rid is not None and s.committed_generation >= s.flushed_generation:
            # Lazily: made durable with the record of the old key's deletion (`_delete_moved`),
            # before it (a row back after a power loss would publish the file under the old name).
            self.journal.remove_nowait(s.rid)
            s.rid = None
        self.stats["copied_for_rename"] += 1
        s.notify()

    def _maybe_retire(self, s: Staged) -> None:
        """Remove the staging file once it is committed (or dropped) and no handle has it open.

        Once only: a second close of its fd would close whatever file has that number by then."""
        if s.retired or s.handles > 0 or s.commit_lock.locked() or (s.dirty and not s.dropped):
            return
        s.retired = True
        self._end_kept(s)
        self._remove_superseded(s)
        node = s.node
        if node.staged is s:
            node.staged = None
        if self.staged.get(node.ino) is s:
            del self.staged[node.ino]
        self._invalidate_stream(s, "retired")
        self._watched.discard(s)
        if s.backing_id is not None:
            self.core.passthrough.close_backing(s.backing_id)
            s.backing_id = None
        # Off the event loop: on ext4 the close of a file that was truncated and written again
        # starts its writeback (auto_da_alloc), measured at 100-300 ms on a busy disk, during which
        # every FUSE request would wait. The fd stays ours until the thread closes it. Files retired
        # meanwhile go in the same trip: 64 small files committed at once would otherwise cost 64
        # trips to a thread and back.
        self._remove_later(s.fd, s.path)
        if s.rid is not None:
            self.journal.remove_nowait(s.rid)
            s.rid = None
        self.core.inodes.forget(node.ino, 0)  # may drop the inode now that nothing holds it

    async def _remove_retired(self) -> None:
        try:
            while self._removals:
                batch, self._removals = self._removals, []
                await run_disk(_close_and_remove_all, batch)
        finally:
            self._removing = False

    # -- status ---------------------------------------------------------------------------------
    def staging_space(self) -> dict:
        """The room new writes need on the staging disk: without it they fail with ENOSPC. A statfs,
        which may block: never on the event loop (`ucfs status` adds it to `statistics`)."""
        try:
            st = os.statvfs(self.staging_dir)
        except OSError:
            return {}
        return dict(staging_free_bytes=st.f_bavail * st.f_frsize,
                    staging_reserve_bytes=self._staging_reserve_bytes, staging_dir=str(self.staging_dir))

    def statistics(self) -> dict:
        items = []
        now = time.time()
        pending = [s for s in self.staged.values() if (s.dirty and not s.dropped) or s.error is not None]
        for s in sorted(pending, key=lambda s: s.created_at)[:50]:
            items.append({"path": s.node.mount_path(), "size": s.size, "age_s": round(now - s.created_at, 1),
                          "attempts": s.attempts,
                          "state": "failed" if s.error is not None else (
                              "open" if s.writers else ("uploading" if s.commit_lock.locked() else "queued")),
                          "error": str(s.error) if s.error is not None else "",
                          "retrying": s.retry_reason if s.error is None else ""})
        out = dict(self.stats)
        out.update(pending=len(pending), failed=sum(1 for s in pending if s.error is not None),
                   writing=sum(1 for s in pending if s.error is None and s.writers and s.kept is None),
                   pending_bytes=sum(s.size for s in pending), staged_files=len(self.staged), items=items)
        return out
