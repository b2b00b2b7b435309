"""The commit journal (journal.py): which row of a path is the newest, and what must be on disk before a
row is.

A power loss cannot be staged here, so the directory-sync test watches the order of the two writes
instead: the staging directory's fsync before the transaction that names its file.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import threading
import time

import trio

from ucfs import journal as journal_mod
from ucfs.journal import Journal
from ucfs.store import MemoryStore

from tests.support import open_core
from tests.unit.test_close_commit import _cfg


def _state(tmp_path):
    cfg = _cfg(tmp_path)
    staging = tmp_path / "state" / "staging"
    staging.mkdir(mode=0o700)
    return cfg, staging


async def _rows(journal: Journal, rows):
    async with trio.open_nursery() as n:
        await n.start(journal.run)
        for fn, *args in rows:
            await fn(journal, *args)
        await journal.close()


def test_replay_publishes_the_row_changed_last_even_when_the_clock_went_back(tmp_path, monkeypatch):
    """Two rows for one path (a close, then a newer version renamed over it, say): replay keeps the
    one written last. With the wall clock stepped back by a minute between them, the older row has
    the later time; replay must still publish the newer bytes, and drop the older staging file."""
    cfg, staging = _state(tmp_path)
    (staging / "old.data").write_bytes(b"old version")
    (staging / "new.data").write_bytes(b"new version")
    clock, real_time = [1_000_000.0, 1_000_000.0 - 60], journal_mod.time.time
    monkeypatch.setattr(journal_mod.time, "time", lambda: clock.pop(0) if clock else real_time())
    journal = Journal(tmp_path / "state" / "journal.sqlite3", staging_dir=staging)
    trio.run(_rows, journal, [(Journal.add, "a.b.c", "f.bin", "old.data", 11),
                              (Journal.add, "a.b.c", "f.bin", "new.data", 11)])
    old, new = journal.records()
    assert old.updated > new.updated and new.seq > old.seq  # the clock disagrees with the order
    journal.close_db()
    monkeypatch.undo()

    store = MemoryStore()
    store.buckets["bucket"] = {}

    async def mount_again():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, cfg)
            with trio.fail_after(10):
                while committer.journal.records():
                    await trio.sleep(0.01)
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(mount_again)
    assert store.get("bucket", "pfx/f.bin")[0] == b"new version"
    assert not (staging / "old.data").exists()


def test_a_row_naming_a_new_staging_file_commits_only_after_the_directory_is_synced(tmp_path, monkeypatch):
    """A row that names a staging file made since the staging directory's last fsync (a close's, a
    kept version's) waits for an fsync of the directory in its batch. Rows naming files already
    covered by one, and batches that only note attempts or remove rows, do not pay for another."""
    _, staging = _state(tmp_path)
    events: list[str] = []
    journal = Journal(tmp_path / "state" / "journal.sqlite3", staging_dir=staging)
    real_sync, real_write = journal.sync_staging_dir, journal._write
    monkeypatch.setattr(journal, "sync_staging_dir", lambda: (events.append("dir fsync"), real_sync()))

    def write(batch):
        real_write(batch)
        events.append("commit " + " ".join(sql.split()[0] for sql, *_ in batch))

    monkeypatch.setattr(journal, "_write", write)

    async def made(j: Journal, name: str):
        (staging / name).write_bytes(b"x")
        j.note_new_file(name)

    async def note(j: Journal, rid: int):
        j.note_attempt_nowait(rid, 1, "503", failed=False)
        await j.rename(rid, "g.bin")  # waits for the batch the note went into

    async def restage(j: Journal, rid: int, name: str):
        await j.restage(rid, name)

    async def remove(j: Journal, rid: int):
        await j.remove(rid)

    trio.run(_rows, journal, [(made, "a.data"), (Journal.add, "a.b.c", "f.bin", "a.data", 1), (note, 1),
                              (Journal.mark_ready, 1, 1, "f.bin", "a.data"), (made, "b.data"),
                              (restage, 1, "b.data"), (remove, 1)])
    assert events == ["dir fsync", "commit INSERT", "commit UPDATE UPDATE", "commit UPDATE", "dir fsync",
                      "commit UPDATE", "commit DELETE"]
    journal.close_db()


def test_only_batches_someone_waits_for_pay_for_an_fsync(tmp_path):
    """A batch of statements nobody waits for (a committed file's row removed, an attempt noted) is
    written without syncing the WAL, which a killed daemon still finds; every batch with a waiter
    (a close's row, a durable removal) is written under synchronous=FULL, also right after one that
    was not, and so makes the earlier ones durable with it."""
    _, staging = _state(tmp_path)
    journal = Journal(tmp_path / "state" / "journal.sqlite3", staging_dir=staging)
    level, current, commits = ["FULL"], [], []

    def trace(sql: str) -> None:
        words = sql.replace("=", " ").split()
        if words[:2] == ["PRAGMA", "synchronous"]:
            level[0] = words[2]
        elif words[0] == "COMMIT":
            commits.append((level[0], " ".join(current)))
            current.clear()
        elif words[0] in ("INSERT", "UPDATE", "DELETE"):
            current.append(words[0])

    journal._db.set_trace_callback(trace)

    rids: dict[str, int] = {}

    async def add(j: Journal, name: str):
        rids[name] = await j.add("a.b.c", name, name + ".data", 1)

    async def forget(j: Journal, name: str):
        j.note_attempt_nowait(rids[name], 1, "503", failed=False)
        j.remove_nowait(rids[name])
        for _ in range(100):  # let the batch go out alone
            await trio.sleep(0.01)
            if not j._queue:
                break

    async def remove(j: Journal, name: str):
        await j.remove(rids[name])

    trio.run(_rows, journal, [(add, "f"), (add, "g"), (forget, "f"), (remove, "g"), (add, "h"), (forget, "h")])
    assert commits == [("FULL", "INSERT"), ("FULL", "INSERT"), ("NORMAL", "UPDATE DELETE"),
                       ("FULL", "DELETE"), ("FULL", "INSERT"), ("NORMAL", "UPDATE DELETE")]
    assert journal.records() == []
    journal.close_db()
    # What was written without a sync is in the file all the same: another connection reads it.
    assert sqlite3.connect(tmp_path / "state" / "journal.sqlite3").execute(
        "SELECT count(*) FROM pending").fetchone() == (0,)


def test_a_committed_file_s_removal_written_without_a_sync_is_made_durable_before_its_object_goes(
        tmp_path, monkeypatch):
    """A committed file's row is removed without a sync, and a power loss can bring it back (its
    staging file too: that unlink is not synced either). Replayed, it would publish the file again
    after an unlink or a rename on this host, which writes no row of its own. So such a change in
    the store first waits for a durable batch (`settle`), and only when one is owed; so does an
    unmount, after which nothing would sync them."""
    monkeypatch.setattr(journal_mod, "LAZY_SYNC_S", 60.0)  # not the idle sync: the ones asked for
    store = MemoryStore()
    store.buckets["bucket"] = {}
    cfg = _cfg(tmp_path)
    events: list[str] = []

    def trace(sql: str) -> None:
        words = sql.replace("=", " ").split()
        if words[:2] == ["PRAGMA", "synchronous"]:
            events.append(words[2])
        elif words[0] == "COMMIT":
            events.append("COMMIT")

    real_delete = store.delete

    def delete(bucket, key):
        events.append(f"delete {key}")
        return real_delete(bucket, key)

    store.delete = delete

    def last_sync_level(upto: list[str]) -> str | None:
        """synchronous= in force for the last COMMIT among `upto`."""
        level = "FULL"
        last = None
        for e in upto:
            if e in ("FULL", "NORMAL"):
                level = e
            elif e == "COMMIT":
                last = level
        return last

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, cfg)
            committer.journal._db.set_trace_callback(trace)

            async def written_and_committed(*names):
                for name in names:
                    fh, _ = await core.create(vol, name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    await core.write(fh, 0, b"data")
                    await core.flush(fh)
                    await core.release(fh)
                with trio.fail_after(10):  # and the rows' removals written
                    while committer.staged or committer.journal._queue or committer.journal.records():
                        await trio.sleep(0.01)

            await written_and_committed("a", "b")
            assert last_sync_level(events) == "NORMAL"  # the removals went out without a sync
            await core.unlink(vol, "a")
            assert last_sync_level(events[:events.index("delete pfx/a")]) == "FULL", events
            n_commits = events.count("COMMIT")
            await core.rename(vol, "b", vol, "c")  # nothing owed now: no batch of its own
            assert events.count("COMMIT") == n_commits, events
            await written_and_committed("d")
            assert last_sync_level(events) == "NORMAL"
            await committer.shutdown(drain=True)
            assert last_sync_level(events) == "FULL", events  # an unmount leaves nothing unsynced
            n.cancel_scope.cancel()

    trio.run(main)


def test_what_was_written_without_a_sync_is_synced_soon_after_all(tmp_path, monkeypatch):
    """A row whose removal a power loss undid is replayed, and would put this host's old bytes over
    what another host wrote since: so removals written without a sync are synced within
    LAZY_SYNC_S, on a journal gone quiet as well as under a steady stream of such removals."""
    monkeypatch.setattr(journal_mod, "LAZY_SYNC_S", 0.2)
    _, staging = _state(tmp_path)
    journal = Journal(tmp_path / "state" / "journal.sqlite3", staging_dir=staging)
    level, commits = ["FULL"], []

    def trace(sql: str) -> None:  # runs in the journal's thread
        words = sql.replace("=", " ").split()
        if words[:2] == ["PRAGMA", "synchronous"]:
            level[0] = words[2]
        elif words[0] == "COMMIT":
            commits.append(level[0])

    async def main():
        async with trio.open_nursery() as n:
            await n.start(journal.run)
            rids = [await journal.add("a.b.c", f"f{i}", f"f{i}.data", 1) for i in range(40)]
            journal._db.set_trace_callback(trace)
            journal.remove_nowait(rids[0])
            await trio.sleep(0.6)  # quiet
            assert commits[:1] == ["NORMAL"] and commits[1:] == ["FULL"], commits
            commits.clear()
            for rid in rids[1:]:  # a removal every 20 ms, for about 0.8 s
                journal.remove_nowait(rid)
                await trio.sleep(0.02)
            assert commits[0] == "NORMAL" and 2 <= commits.count("FULL") <= 5, commits
            await journal.close()

    trio.run(main)
    assert journal.records() == []
    journal.close_db()


def test_staging_files_made_ahead_are_durable_before_they_are_handed_out(tmp_path, monkeypatch):
    """Spare staging files are made in batches, and the staging directory is fsynced with each batch:
    a close of a file that took a spare then needs no directory fsync of its own."""
    store = MemoryStore()
    store.buckets["bucket"] = {}
    cfg = _cfg(tmp_path)

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, cfg)
            with trio.fail_after(10):
                while not committer._spares:
                    await trio.sleep(0.01)
            assert not committer.journal._unsynced_names & {p.name for p, _ in committer._spares}
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_journal_from_before_the_change_counter_opens_and_replays_by_time(tmp_path):
    """A journal written by an older ucfs has no `seq` column: it is added, its rows read as seq 0,
    and any row written from then on counts as newer than all of them."""
    path = tmp_path / "journal.sqlite3"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE pending (id INTEGER PRIMARY KEY, volume TEXT NOT NULL, path TEXT NOT NULL,
            staging TEXT NOT NULL, size INTEGER NOT NULL, state TEXT NOT NULL,
            attempts INTEGER NOT NULL DEFAULT 0, error TEXT NOT NULL DEFAULT '',
            created REAL NOT NULL, updated REAL NOT NULL);
        INSERT INTO pending (volume, path, staging, size, state, created, updated)
            VALUES ('a.b.c', 'f.bin', 'old.data', 3, 'ready', 5.0, 5.0);
    """)
    db.commit()
    db.close()
    journal = Journal(path)
    assert [(r.staging, r.seq) for r in journal.records()] == [("old.data", 0)]
    trio.run(_rows, journal, [(Journal.add, "a.b.c", "f.bin", "new.data", 3)])
    assert [(r.staging, r.seq) for r in journal.records()] == [("old.data", 0), ("new.data", 1)]
    journal.close_db()


class _WatchedConnection:
    """The journal's sqlite connection, noting every statement run from another thread while one
    thread has a transaction open on it. Each transaction is held open a while (after BEGIN) so that
    a read that can overlap one does."""

    def __init__(self, conn: sqlite3.Connection, hold_s: float):
        self._conn, self._hold_s = conn, hold_s
        self.owner: int | None = None
        self.overlaps: list[str] = []

    def _check(self, sql: str) -> None:
        if self.owner is not None and self.owner != threading.get_ident():
            self.overlaps.append(sql)

    def execute(self, sql, *args):
        self._check(sql)
        return self._conn.execute(sql, *args)

    def cursor(self):
        return _WatchedCursor(self, self._conn.cursor())

    def __getattr__(self, name):
        return getattr(self._conn, name)


class _WatchedCursor:
    def __init__(self, watched: _WatchedConnection, cur: sqlite3.Cursor):
        self._watched, self._cur = watched, cur

    def execute(self, sql, *args):
        w = self._watched
        w._check(sql)
        out = self._cur.execute(sql, *args)
        if sql.startswith("BEGIN"):
            w.owner = threading.get_ident()
            time.sleep(w._hold_s)
        elif sql in ("COMMIT", "ROLLBACK"):
            w.owner = None
        return out

    def __getattr__(self, name):
        return getattr(self._cur, name)


class _SlowAbortStore(MemoryStore):
    def abort_multipart(self, *args):
        time.sleep(0.05)  # the removal queued after the one before is being written meanwhile
        return super().abort_multipart(*args)


def test_replay_reads_the_journal_only_between_its_batches(tmp_path, monkeypatch):
    """The journal's connection is shared with its writing thread (check_same_thread=False), and
    sqlite3 leaves it to us to keep the two from using it at once. Replay read the pending rows in
    trio's thread while the upload removals it had queued were being written in the journal's: a
    read inside another thread's open transaction, which sees that transaction's rows before they
    are committed (only uploads rows today, so nothing was read wrong yet)."""
    cfg, staging = _state(tmp_path)
    store = _SlowAbortStore()
    store.buckets["bucket"] = {}
    left = [store.create_multipart("bucket", f"pfx/big{i}.bin") for i in range(3)]
    (staging / "f.data").write_bytes(b"closed")
    journal = Journal(tmp_path / "state" / "journal.sqlite3", staging_dir=staging)
    trio.run(_rows, journal, [(Journal.add_upload, u, "a.b.c", f"pfx/big{i}.bin") for i, u in enumerate(left)]
             + [(Journal.add, "a.b.c", "f.bin", "f.data", 6)])
    journal.close_db()

    watched: list[_WatchedConnection] = []
    real_connect = sqlite3.connect

    def connect(*args, **kw):
        watched.append(_WatchedConnection(real_connect(*args, **kw), hold_s=0.5))
        return watched[-1]

    monkeypatch.setattr(journal_mod.sqlite3, "connect", connect)

    async def mount_again():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, cfg)
            during_replay.extend(watched[0].overlaps)  # replay is over once the committer has started
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    during_replay: list[str] = []
    trio.run(mount_again)
    assert store.get("bucket", "pfx/f.bin")[0] == b"closed"
    assert store.list_multipart("bucket", "pfx/") == []  # every upload left was aborted
    assert during_replay == []


class _RefusedPutStore(MemoryStore):
    """PUTs of the files' keys fail as a busy store's would: the files stay staged, their rows kept."""

    def put(self, bucket, key, *args, **kw):
        if key.rsplit("/", 1)[-1].startswith("p"):
            from ucfs import errors
            raise errors.StoreError(errors.EIO, "503 Slow Down", status=503, transient=True, key=key)
        return super().put(bucket, key, *args, **kw)


def test_a_directory_rename_changes_the_rows_of_all_its_files_or_of_none(tmp_path, monkeypatch):
    """Renaming a directory renames the journal rows of the files beneath that wait for their
    commits. One row at a time, a journal that filled its disk after the first left that row under
    the new name and the others under the old one: the next mount split the directory between the
    two names. The rows change together or not at all, and a failed rename leaves the directory,
    its rows and the store as they were."""
    cfg, staging = _state(tmp_path)
    store = _RefusedPutStore()
    store.buckets["bucket"] = {}
    full_after = []  # statements to let through before the disk is full

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, cfg)
            d = (await core.mkdir(vol, "d")).ino
            for i in range(3):
                fh, _ = await core.create(d, f"p{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                await core.write(fh, 0, b"x" * (10 + i))
                await core.flush(fh)
                await core.release(fh)
            assert sorted(r.path for r in committer.journal.records()) == ["d/p0.bin", "d/p1.bin", "d/p2.bin"]
            real_write = committer.journal._write_batch

            def write_batch(batch):
                for sql, *_ in batch:
                    if sql.startswith("UPDATE pending SET path=") and not full_after.pop(0):
                        e = sqlite3.OperationalError("database or disk is full")
                        e.sqlite_errorcode = sqlite3.SQLITE_FULL
                        raise e
                return real_write(batch)

            monkeypatch.setattr(committer.journal, "_write_batch", write_batch)
            committer.journal._reserve.unlink()  # its room taken too
            full_after[:] = [True, False, False]  # the first row's change fits, the second's not
            try:
                await core.rename(vol, "d", vol, "e")
            except OSError as e:
                assert e.errno == errno.ENOSPC
            else:
                raise AssertionError("the rename was recorded on a full disk")
            monkeypatch.undo()
            assert sorted(r.path for r in committer.journal.records()) == ["d/p0.bin", "d/p1.bin", "d/p2.bin"]
            assert (await core.lookup(vol, "e")) is None
            d_again = await core.lookup(vol, "d")
            assert d_again is not None and d_again.ino == d
            assert {name for name in core.node(d).children_by_name} == {"p0.bin", "p1.bin", "p2.bin"}
            assert sorted(store.buckets["bucket"]) == ["pfx/d/"]  # nothing made under the new name
            await committer.shutdown(drain=False)
            n.cancel_scope.cancel()

    trio.run(main)
