"""The commit journal: which closed files still have to reach the store, durable on local disk.

One sqlite3 database (WAL) in the state directory. A row is written, and made durable
(synchronous=FULL), when a file is closed with changes (after its staging file is fsynced): from then
on a crash cannot lose it. The row is removed once the file is committed; that removal need not be
durable at once (after a power loss the commit is simply repeated, which is harmless), so a batch of
such statements alone is written without an fsync, and the next durable batch syncs it too; one
comes within LAZY_SYNC_S, and before an unlink or rename of a committed file and an unmount
(`settle`): a row back after a power loss would publish the old name again. A row removed because
its file was unlinked or replaced is removed durably before the unlink returns: a crash must not
bring a deleted file back, and publish it, at the next mount.

A row that names a staging file is committed only once that file's directory entry is durable: on
a file system without a journal of its own (ext4 without one, as on these hosts) a new file's entry
is not made durable by the file's fdatasync, and a power loss would keep the row but lose the file.
Names made since the staging directory was last fsynced are noted (`note_new_file`); a batch whose
rows name one of them fsyncs the directory first, once for the whole batch. Most staging files are
made ahead in batches whose directory fsync happens then (commit.Committer._new_spares), off the
path of any close.

Which of several rows for one path is the newest is said by `seq`, a counter the rows share, not by
the wall clock: a clock stepped back between two closes must not make replay publish the older one.

Writes are batched: whatever callers queue while a transaction is being written goes into the next
one, so 64 files closed at once cost a few fsyncs, not 64. sqlite runs in one dedicated thread.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import trio

from .errors import UcfsError
from .threads import ThreadPool

log = logging.getLogger(__name__)

# A batch written without a sync (see `_write`) is synced at the latest this long after it was taken.
LAZY_SYNC_S = 1.0

# upload_id of an `uploads` row written before its upload was created (Journal.add_upload_intent).
INTENT = "intent:"
# upload_id of an `uploads` row that names an object to delete, not an upload: a renamed file's
# object left under its old key once it was copied to the new one (Journal.add_delete).
DELETE = "delete:"
# Room kept on the journal's disk for the journal alone (a file of this size beside it, given up when
# a write finds the disk full, made again once there is room). The staging files share the disk: a
# writer that filled it must not leave the journal unable to record an unlink or a rename, or those
# fail with ENOSPC too (and a deleted file's row would outlive it).
RESERVE_BYTES = 4 << 20

SCHEMA = """
CREATE TABLE IF NOT EXISTS pending (
    id INTEGER PRIMARY KEY,
    volume TEXT NOT NULL,      -- catalog.schema.volume
    path TEXT NOT NULL,        -- path inside the volume
    staging TEXT NOT NULL,     -- file name in the staging directory
    size INTEGER NOT NULL,
    state TEXT NOT NULL,       -- 'ready' (to commit) or 'failed' (permanent error, kept)
    attempts INTEGER NOT NULL DEFAULT 0,
    error TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
    -- seq INTEGER: added by Journal._migrate (journals made before it lack the column)
);
-- Multipart uploads started and not yet completed or aborted: a restarted daemon aborts them, so a
-- crash never leaves parts behind in the store. A row is written before the upload is created, with
-- an upload_id of 'intent:...' until the store has answered (see Committer._start_upload). A row
-- whose upload_id is 'delete:...' names an object that a restarted daemon deletes (add_delete).
CREATE TABLE IF NOT EXISTS uploads (
    upload_id TEXT PRIMARY KEY,
    volume TEXT NOT NULL,
    key TEXT NOT NULL,
    created REAL NOT NULL
);
"""


@dataclass
class Record:
    id: int
    volume: str
    path: str
    staging: str
    size: int
    state: str
    attempts: int
    error: str
    created: float
    updated: float  # the row's last change: its close, or a rename that moved it to `path`
    seq: int = 0  # order of those changes among all rows (0: written before the column existed)


class Journal:
    def __init__(self, path: Path, *, staging_dir: Path | None = None):
        self.path = path
        self.staging_dir = staging_dir  # fsynced before a batch whose rows name its new files commits
        # Staging files made or renamed since its last fsync (added and taken from several threads:
        # set operations are atomic under the GIL, and a name is only ever taken after a sync).
        self._unsynced_names: set[str] = set()
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._synced = True  # whether synchronous=FULL is in force (see _write)
            self._db.executescript(SCHEMA)
            self._migrate()
            # The rows' shared change counter: statements take values in the order they are queued,
            # which is the order they are written in.
            self._seq = self._db.execute("SELECT coalesce(max(seq), 0) FROM pending").fetchone()[0]
            self._db.execute("SELECT count(*) FROM pending").fetchone()
            check = self._db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise sqlite3.DatabaseError(check)
        except sqlite3.DatabaseError as e:
            raise UcfsError(
                f"commit journal {path} is damaged ({e}). Staged data is kept in {path.parent / 'staging'}. "
                f"Move the journal aside (mv {path} {path}.damaged) and mount again: files in the staging "
                f"directory that no journal names are then moved to {path.parent / 'orphans'} for you to "
                "recover by hand.") from None
        self._reserve = path.with_name(path.name + ".reserve")
        self._make_reserve()
        # sqlite in one thread at a time, through the lean pool: a batch per close or two in a burst
        # of small files, and each trip through trio.to_thread cost about twice as much CPU.
        self._thread = ThreadPool("journal", 1)
        # (sql, params, waiter, the staging file the statement names or None)
        self._queue: list[tuple[str, tuple, dict | None, str | None]] = []
        self._wakeup = trio.Event()
        self._closed = False
        # A batch was taken that is (or is being) written without a sync, and no durable batch has
        # been written after it: a power loss may undo its statements (see `settle`).
        self._lazy = False
        self._lazy_since = 0.0  # trio.current_time() when _lazy was set
        self._settles = 0

    def _migrate(self) -> None:
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(pending)")}
        if "seq" not in columns:
            self._db.execute("ALTER TABLE pending ADD COLUMN seq INTEGER NOT NULL DEFAULT 0")

    # -- reading (at mount, before serving) -------------------------------------------------------
    # Blocking, on the connection the journal's thread writes with: call them before `run` or after
    # it has ended, or through `read_records`/`read_uploads` while it runs. sqlite3 leaves it to us to
    # keep two threads from using one connection at once (check_same_thread=False): a read from
    # another thread runs inside the transaction of a batch being written, sees its rows before
    # they are committed (and a rollback, on a full disk, may take them back), and waits on the
    # connection's mutex through the batch's fsync, in the event loop.
    async def read_records(self) -> list[Record]:
        """`records`, in the journal's thread: between its batches, never during one."""
        return await self._thread.run(self.records)

    async def read_uploads(self) -> list[tuple[str, str, str, float]]:
        """`uploads`, in the journal's thread."""
        return await self._thread.run(self.uploads)

    def records(self) -> list[Record]:
        rows = self._db.execute("SELECT id, volume, path, staging, size, state, attempts, error, "
                                "created, updated, seq FROM pending ORDER BY id").fetchall()
        return [Record(*r) for r in rows]

    def uploads(self) -> list[tuple[str, str, str, float]]:
        """(upload_id, volume, key, created) of multipart uploads a previous daemon left unfinished;
        an upload_id starting with INTENT is one whose creation it did not see answered."""
        return self._db.execute("SELECT upload_id, volume, key, created FROM uploads").fetchall()

    # -- writing --------------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Write queued statements in batches until closed."""
        task_status.started()
        while True:
            if not self._queue:
                if self._closed:
                    return
                if self._lazy:
                    with trio.move_on_at(self._lazy_since + LAZY_SYNC_S):
                        await self._wakeup.wait()
                else:
                    await self._wakeup.wait()
                self._wakeup = trio.Event()
                if not self._queue and not self._sync_due():
                    continue
            batch, self._queue = self._queue, []
            lazy = all(waiter is None for _, _, waiter, _ in batch)
            if lazy and self._sync_due():
                # What was written without a sync is synced within LAZY_SYNC_S all the same: a
                # row a power loss brings back is replayed, and would put this host's old bytes
                # over what another host wrote since.
                batch.append((*self._settle_statement(), {"done": trio.Event()}, None))
                lazy = False
            elif lazy and not self._lazy:
                self._lazy, self._lazy_since = True, trio.current_time()
            with trio.CancelScope(shield=True):  # a batch once started is written whole
                try:
                    await self._thread.run(self._write, batch)
                    if not lazy:
                        self._lazy = False  # synced, and every batch before it with it
                except Exception as e:  # noqa: BLE001 - hand the failure to every waiter
                    log.error("commit journal write failed: %s", e)
                    if self._lazy:
                        self._lazy_since = trio.current_time()  # the next try at a sync: not at once
                    for _, _, waiter, _ in batch:
                        if waiter is not None:
                            waiter["error"] = e
            for _, _, waiter, _ in batch:
                if waiter is not None:
                    waiter["done"].set()  # trio events are set here, in trio's thread

    def _make_reserve(self) -> None:
        """Set RESERVE_BYTES aside for the journal, when the disk has room for it several times
        over (blocking: at open, and in the journal's thread)."""
        if self._reserve.exists():
            return
        tmp = self._reserve.with_name(self._reserve.name + ".tmp")
        try:
            st = os.statvfs(self._reserve.parent)
            if st.f_bavail * st.f_frsize < 4 * RESERVE_BYTES:
                return
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, RESERVE_BYTES)
            finally:
                os.close(fd)
            os.rename(tmp, self._reserve)
        except OSError as e:
            log.debug("no reserve made for the commit journal: %s", e)
            tmp.unlink(missing_ok=True)

    def _sync_due(self) -> bool:
        return self._lazy and trio.current_time() >= self._lazy_since + LAZY_SYNC_S

    def _write(self, batch) -> None:
        if self._unsynced_names and any(name in self._unsynced_names for *_, name in batch):
            self.sync_staging_dir()
        self._make_reserve()  # again once there is room (a stat while it is there)
        try:
            self._write_batch(batch)
        except sqlite3.OperationalError as e:
            if e.sqlite_errorcode != sqlite3.SQLITE_FULL or not self._reserve.exists():
                raise
            self._reserve.unlink(missing_ok=True)
            log.warning("the disk of %s is full: its reserve of %d MiB is given up for the journal; it is made "
                        "again once there is room", self.path, RESERVE_BYTES >> 20)
            self._write_batch(batch)  # rolled back whole: written again from the start

    def _write_batch(self, batch) -> None:
        cur = self._db.cursor()
        # Only statements nobody waits for (a committed file's row, a finished upload's): no fsync.
        # In WAL mode their frames still reach the file before COMMIT returns, so a killed daemon
        # loses none of them; only a power loss can, and then a commit is repeated or a row names a
        # staging file that is gone (dropped at the next mount). The next durable batch makes them
        # durable too, since the WAL is synced in order; one comes within LAZY_SYNC_S (run), and
        # before an unlink or rename of a committed file (settle).
        durable = any(waiter is not None for _, _, waiter, _ in batch)
        if durable != self._synced:
            cur.execute("PRAGMA synchronous=FULL" if durable else "PRAGMA synchronous=NORMAL")
            self._synced = durable
        cur.execute("BEGIN IMMEDIATE")
        try:
            for sql, params, waiter, _ in batch:
                cur.execute(sql, params)
                if waiter is not None:
                    waiter["rowid"] = cur.lastrowid
            cur.execute("COMMIT")
        except BaseException:
            # sqlite has already rolled back after some errors (a full disk among them): a second
            # rollback would fail and hide the error that says why.
            if self._db.in_transaction:
                cur.execute("ROLLBACK")
            raise

    def note_new_file(self, name: str) -> None:
        """A staging file was made or renamed to `name`: its entry is not durable until the next
        `sync_staging_dir` (blocking callers make it in a thread; any thread may note it)."""
        self._unsynced_names.add(name)

    def sync_staging_dir(self) -> None:
        """fsync the staging directory: every name noted before this call is durable after it
        (blocking: a disk thread's or the journal thread's work; the files' data is their callers')."""
        if self.staging_dir is None:
            return
        noted = set(self._unsynced_names)
        fd = os.open(self.staging_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self._unsynced_names -= noted

    def _enqueue(self, sql: str, params: tuple, waiter: dict | None, names_file: str | None = None) -> None:
        self._queue.append((sql, params, waiter, names_file))
        self._wakeup.set()

    async def _execute(self, sql: str, params: tuple, *, names_file: str | None = None) -> int:
        return (await self.execute_together([(sql, params, names_file)]))[0]

    async def execute_together(self, statements: list[tuple[str, tuple, str | None]]) -> list[int]:
        """Write `statements` ((sql, params, the staging file named or None), as the *_statement
        methods make them) durably in one transaction: all of them, or none and an OSError. Queued
        with no checkpoint between them, they go out in one batch, which `_write_batch` commits
        whole or rolls back whole. Returns each one's rowid."""
        waiters = [{"done": trio.Event()} for _ in statements]
        for (sql, params, names_file), waiter in zip(statements, waiters):
            self._enqueue(sql, params, waiter, names_file)
        for waiter in waiters:
            await waiter["done"].wait()
        for waiter in waiters:
            if "error" in waiter:
                e = waiter["error"]
                full = getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or (
                    isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
                raise OSError(errno.ENOSPC if full else errno.EIO, f"commit journal write failed: {e}")
        return [waiter.get("rowid", 0) for waiter in waiters]

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    async def add(self, volume: str, path: str, staging: str, size: int) -> int:
        return (await self.execute_together([self.add_statement(volume, path, staging, size)]))[0]

    def add_statement(self, volume: str, path: str, staging: str, size: int) -> tuple[str, tuple, str | None]:
        now = time.time()
        return ("INSERT INTO pending (volume, path, staging, size, state, created, updated, seq) "
                "VALUES (?, ?, ?, ?, 'ready', ?, ?, ?)", (volume, path, staging, size, now, now, self._next_seq()),
                staging)

    async def mark_ready(self, rid: int, size: int, path: str, staging: str) -> None:
        await self._execute("UPDATE pending SET size=?, path=?, staging=?, state='ready', error='', updated=?, "
                            "seq=? WHERE id=?", (size, path, staging, time.time(), self._next_seq(), rid),
                            names_file=staging)

    async def restage(self, rid: int, staging: str) -> None:
        """The row's content now lives in another staging file (commit.Committer.keep_closed_version)."""
        await self._execute("UPDATE pending SET staging=? WHERE id=?", (staging, rid), names_file=staging)

    async def rename(self, rid: int, path: str) -> None:
        await self.execute_together([self.rename_statement(rid, path)])

    def rename_statement(self, rid: int, path: str) -> tuple[str, tuple, str | None]:
        return ("UPDATE pending SET path=?, updated=?, seq=? WHERE id=?", (path, time.time(), self._next_seq(), rid),
                None)

    def note_attempt_nowait(self, rid: int, attempts: int, error: str, failed: bool) -> None:
        self._enqueue("UPDATE pending SET attempts=?, error=?, state=?, updated=? WHERE id=?",
                      (attempts, error[:500], "failed" if failed else "ready", time.time(), rid), None)

    async def add_upload(self, upload_id: str, volume: str, key: str) -> None:
        await self._execute("INSERT OR REPLACE INTO uploads (upload_id, volume, key, created) VALUES (?, ?, ?, ?)",
                            (upload_id, volume, key, time.time()))

    async def add_upload_intent(self, volume: str, key: str) -> str:
        """Record, durably, that a multipart upload of `key` is about to be created; returns the
        row's placeholder id, for `resolve_upload` once the store has given the real one."""
        intent = f"{INTENT}{uuid.uuid4().hex}"
        await self.add_upload(intent, volume, key)
        return intent

    async def resolve_upload(self, intent: str, upload_id: str) -> None:
        await self._execute("UPDATE uploads SET upload_id=? WHERE upload_id=?", (upload_id, intent))

    async def add_delete(self, volume: str, key: str) -> str:
        """Record, durably, that the object under `key` must go (a file renamed away from it and
        copied to its new key): a daemon killed before it deleted it deletes it at the next mount.
        Returns the row's id, for `remove_delete` once the object is deleted."""
        marker = f"{DELETE}{uuid.uuid4().hex}"
        await self.add_upload(marker, volume, key)
        return marker

    async def remove_delete(self, marker: str) -> None:
        """Durably: the old name may be written again as soon as the rename returns, and a row left
        behind by a power loss would then delete that new file at the next mount."""
        await self._execute("DELETE FROM uploads WHERE upload_id=?", (marker,))

    def remove_upload_nowait(self, upload_id: str) -> None:
        self._enqueue("DELETE FROM uploads WHERE upload_id=?", (upload_id,), None)

    async def remove(self, rid: int) -> None:
        """Remove a row durably: for a file that must not come back (unlinked, replaced)."""
        await self._execute("DELETE FROM pending WHERE id=?", (rid,))

    def remove_nowait(self, rid: int) -> None:
        self._enqueue("DELETE FROM pending WHERE id=?", (rid,), None)

    async def settle(self) -> None:
        """Return once every statement queued so far is durable. Before a change in the store that
        a committed file's row, back after a power loss, would undo at the next mount: that row's
        removal (remove_nowait) may have been written without a sync, and the staging file it names
        may be back too (its unlink was not synced either). An unlink or rename of a committed file
        writes no row of its own; replayed, the row would publish the deleted name again. Costs a
        sync only when a batch since the last durable one was written without one."""
        if self._lazy or any(waiter is None for _, _, waiter, _ in self._queue):
            await self._execute(*self._settle_statement())

    def _settle_statement(self) -> tuple[str, tuple]:
        """A statement that writes a frame: in a batch with a waiter (synchronous=FULL) it syncs the
        WAL, and every frame before it with it."""
        self._settles += 1
        return f"PRAGMA user_version={self._settles % 2}", ()

    async def close(self) -> None:
        self._closed = True
        self._wakeup.set()

    def close_db(self) -> None:
        self._db.close()
