"""How close() and fsync() make written data durable (commit.py): by finishing the upload when that is
the sooner way, by syncing the staging file and recording it in the journal otherwise.

Driven through Core and Committer over the in-memory store, without FUSE, so that the store's pace is
ours to set: the integration tests (tests/integration/test_write.py) show the same through a mount.
"""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import trio

from ucfs import commit as commit_mod
from ucfs.config import MiB, MountConfig
from ucfs.store import MemoryStore

from tests.support import open_core


class GatedStore:
    """A MemoryStore whose part uploads wait until `gate` is set (they run in store threads)."""

    def __init__(self):
        self.inner = MemoryStore()
        self.inner.buckets["bucket"] = {}
        self.name = self.inner.name
        self.gate = threading.Event()
        self.gate.set()
        self.parts_waiting = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def upload_part(self, *args, **kw):
        if not self.gate.is_set():
            self.parts_waiting += 1
            self.gate.wait(30)
        return self.inner.upload_part(*args, **kw)


def _cfg(tmp_path) -> MountConfig:
    (tmp_path / "state").mkdir(mode=0o700)
    return MountConfig(cache_dir=tmp_path / "state" / "cache", part_bytes=MiB, store_concurrency=8)


async def _write(core, vol, name: str, data: bytes):
    fh, _ = await core.create(vol, name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for off in range(0, len(data), MiB):
        await core.write(fh, off, data[off:off + MiB])
    return fh


async def _write_closed_streamed(core, committer, vol, name: str, data: bytes):
    """Write `data` (24 MiB and more, with STREAM_START_BYTES at 4 MiB) while its stream keeps up,
    then close it: close() finishes the stream itself. Returns the handle, not yet released."""
    fh = await _write(core, vol, name, data)
    while committer.statistics().get("stream_parts", 0) < 18:  # the upload keeps up
        await trio.sleep(0.01)
    await core.flush(fh)
    return fh


def _stored(store: GatedStore, name: str) -> bytes | None:
    try:
        return store.inner.get("bucket", f"pfx/{name}")[0]
    except OSError:
        return None


def test_close_finishes_a_stream_that_keeps_up(tmp_path, monkeypatch):
    monkeypatch.setattr(commit_mod, "STREAM_START_BYTES", 4 * MiB)
    store = GatedStore()
    data = os.urandom(24 * MiB + 123)

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            fh = await _write_closed_streamed(core, committer, vol, "s.bin", data)
            # close() returned: the object is in the store, and was never journaled.
            assert _stored(store, "s.bin") == data
            st = committer.statistics()
            assert st["committed_at_close"] == 1 and st["streamed"] == 1 and st["pending"] == 0
            assert committer.journal.records() == []
            await core.release(fh)
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(main)


def test_close_of_a_stream_that_lags_syncs_and_journals_instead(tmp_path, monkeypatch):
    monkeypatch.setattr(commit_mod, "STREAM_START_BYTES", 2 * MiB)
    monkeypatch.setattr(commit_mod, "BACKGROUND_SYNC_BYTES", 4 * MiB)
    store = GatedStore()
    store.gate.clear()  # parts do not get through: the writer runs ahead of its upload
    data = os.urandom(40 * MiB)

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            # The window is (4 part slots + 1) x 1 MiB; 4 windows behind, background syncs resume.
            assert committer._stream_window == 5 * MiB
            fh = await _write(core, vol, "lag.bin", data)
            staged = core.file_handle(fh).staged
            assert committer._stream_lag(staged) == len(data)
            assert staged.unsynced < 4 * MiB  # synced in the background while it lagged
            await core.flush(fh)
            # close() returned before the upload: durable locally, with a journal record.
            assert _stored(store, "lag.bin") is None
            assert [r.path for r in committer.journal.records()] == ["lag.bin"]
            assert committer.statistics().get("committed_at_close", 0) == 0
            await core.release(fh)
            with trio.fail_after(30):
                # The stream's parts are held at the gate. (They get there in store threads: on a
                # busy host the first may arrive only now; the check raced them once in a full run.)
                while store.parts_waiting == 0:
                    await trio.sleep(0.01)
            store.gate.set()  # the workers commit it from the staging file
            with trio.fail_after(30):
                while _stored(store, "lag.bin") != data:
                    await trio.sleep(0.01)
                while committer.journal.records():
                    await trio.sleep(0.01)
            assert store.parts_waiting > 0
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(main)


class SlowPartStore(GatedStore):
    """Part uploads take `delay` seconds each: an upload rate well below any local disk's."""

    delay = 0.05

    def upload_part(self, *args, **kw):
        import time
        time.sleep(self.delay)
        return super().upload_part(*args, **kw)


@pytest.mark.parametrize("disk", ["faster", "slower"])
def test_close_picks_by_measured_rates_whichever_makes_the_data_durable_sooner(tmp_path, monkeypatch, disk):
    """An upload slower than the staging disk is left to the workers: close() syncs, as a close of a
    file that does not stream would, instead of waiting for the store. Against a slower disk, close()
    finishes the upload. (On one 2-core machine the upload ran at half the disk's rate, and close()
    waited 2.3 x as long as a local write with fsync.)"""
    monkeypatch.setattr(commit_mod, "STREAM_START_BYTES", 2 * MiB)
    monkeypatch.setattr(commit_mod, "RATE_SAMPLE_BYTES", 2 * MiB)
    store = SlowPartStore()
    data = os.urandom(24 * MiB)

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            # As measured by earlier syncs: the disk takes 1 TB/s, or 1 byte/s.
            committer._sync_rate = 1e12 if disk == "faster" else 1.0
            committer._sync_rate_at = time.monotonic()
            fh = await _write(core, vol, "r.bin", data)
            staged = core.file_handle(fh).staged
            with trio.fail_after(30):
                while committer._stream_rate(staged.stream) is None:
                    await trio.sleep(0.01)
            assert committer._stream_lag(staged) > 0
            await core.flush(fh)
            st = committer.statistics()
            if disk == "faster":
                assert st.get("committed_at_close", 0) == 0
                assert [r.path for r in committer.journal.records()] == ["r.bin"]
            else:
                assert st["committed_at_close"] == 1 and _stored(store, "r.bin") == data
                assert committer.journal.records() == []
            await core.release(fh)
            with trio.fail_after(30):
                while _stored(store, "r.bin") != data or committer.journal.records():
                    await trio.sleep(0.01)
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(main)


class FakeDisk:
    """A staging disk that writes `rate` bytes per second, one sync at a time, as fdatasync does on
    Linux: a sync writes what was dirty when it began, after whatever the syncs before it write.
    Install with monkeypatch.setattr(os, "fdatasync", disk.fdatasync)."""

    def __init__(self, rate: float):
        self.rate = rate
        self.lock = threading.Lock()
        self.synced: dict[tuple[int, int], int] = {}  # (dev, inode) -> bytes on the disk
        self.stalls: list[float] = []  # extra seconds for the next syncs, one each (a hiccup)
        self.busy = 0  # syncs in flight

    def fdatasync(self, fd: int) -> None:
        st = os.fstat(fd)
        ident, target = (st.st_dev, st.st_ino), st.st_size
        self.busy += 1
        try:
            with self.lock:
                dirty = max(0, target - self.synced.get(ident, 0))
                stall = self.stalls.pop(0) if self.stalls else 0.0
                time.sleep(dirty / self.rate + stall)
                self.synced[ident] = max(self.synced.get(ident, 0), target)
        finally:
            self.busy -= 1

    async def idle(self) -> None:
        """Wait until no sync is in flight, and the tasks that waited for them have run."""
        with trio.fail_after(30):
            while self.busy:
                await trio.sleep(0.01)
        await trio.sleep(0.05)


def test_syncs_that_overlap_measure_the_disk_together_not_each_its_own_bytes_over_its_wait(tmp_path, monkeypatch):
    """A writer faster than the staging disk has several background syncs in flight at once, each
    waiting for the ones before it. Each one's bytes over its own wait said the disk was several
    times slower than it is (the k-th sync, about 1/k of it); a disk thought slow makes close() wait
    for uploads slower than the disk, and skips the syncs that would correct it. Overlapping syncs
    are one sample: their bytes over the time any of them was in flight."""
    monkeypatch.setattr(commit_mod, "STREAM_START_BYTES", 1 << 40)  # no stream: syncs only
    monkeypatch.setattr(commit_mod, "BACKGROUND_SYNC_BYTES", 4 * MiB)
    monkeypatch.setattr(commit_mod, "RATE_SAMPLE_BYTES", 2 * MiB)
    disk = FakeDisk(32 * MiB)
    monkeypatch.setattr(os, "fdatasync", disk.fdatasync)
    store = GatedStore()
    data = os.urandom(32 * MiB)

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            fh = await _write(core, vol, "f.bin", data)  # much faster than 32 MiB/s
            await core.flush(fh)
            await disk.idle()
            rate = committer._sync_rate
            assert rate is not None and 0.6 * disk.rate < rate < 1.5 * disk.rate, rate / MiB
            await core.release(fh)
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_disk_rate_measured_low_once_is_measured_again_and_close_stops_waiting_for_slow_uploads(
        tmp_path, monkeypatch):
    """One slow sync (a hiccup of the disk) made the staging disk look slower than an upload that is
    in fact much slower than the disk. From then on every stream was thought to keep up: its
    background syncs were skipped and its close() finished the upload instead of syncing, so no sync
    ever measured the disk again, and close() waited for uploads slower than the disk for as long as
    the daemon ran. An estimate that is not recent any more is measured again."""
    monkeypatch.setattr(commit_mod, "STREAM_START_BYTES", 2 * MiB)
    monkeypatch.setattr(commit_mod, "BACKGROUND_SYNC_BYTES", 4 * MiB)
    monkeypatch.setattr(commit_mod, "RATE_SAMPLE_BYTES", 2 * MiB)
    monkeypatch.setattr(commit_mod, "SYNC_RATE_MAX_AGE_S", 0.3, raising=False)  # 60 s in a daemon
    disk = FakeDisk(256 * MiB)
    disk.stalls = [1.5]  # the very first sync stalls
    monkeypatch.setattr(os, "fdatasync", disk.fdatasync)
    store = SlowPartStore()
    store.delay = 0.2  # 16 parts of 1 MiB in flight: some 40 MiB/s, far below the disk
    data = os.urandom(24 * MiB)

    async def write_measured(core, committer, vol, name):
        # Half the file, until its upload has a measured rate, then the rest: the second half's
        # background syncs, and the close, are decided by both rates.
        fh = await _write(core, vol, name, data[:12 * MiB])
        staged = core.file_handle(fh).staged
        with trio.fail_after(30):
            while committer._stream_rate(staged.stream) is None:
                await trio.sleep(0.01)
        for off in range(12 * MiB, len(data), MiB):
            await core.write(fh, off, data[off:off + MiB])
        return fh

    async def main():
        async with trio.open_nursery() as n:
            cfg = _cfg(tmp_path)
            cfg = MountConfig(cache_dir=cfg.cache_dir, part_bytes=MiB, store_concurrency=64)
            core, committer, vol = await open_core(tmp_path, store, n, cfg)
            fh = await write_measured(core, committer, vol, "hiccup.bin")
            await core.flush(fh)
            await core.release(fh)
            await disk.idle()
            assert committer._sync_rate < 20 * MiB  # the hiccup: the disk looks slower than the upload
            at_close = []
            for i in range(3):
                await trio.sleep(0.5)  # time passes between files, as between checkpoints
                fh = await write_measured(core, committer, vol, f"f{i}.bin")
                before = committer.statistics().get("committed_at_close", 0)
                await core.flush(fh)
                at_close.append(committer.statistics().get("committed_at_close", 0) - before)
                await core.release(fh)
                await disk.idle()
            # The upload is slower than the disk: close() syncs instead of waiting for it.
            assert at_close[-1] == 0, at_close
            assert committer._sync_rate > 128 * MiB, committer._sync_rate / MiB
            with trio.fail_after(60):
                while any(_stored(store, f"f{i}.bin") != data for i in range(3)):
                    await trio.sleep(0.05)
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(main)


def test_fsync_commits_at_once_without_a_journal_record(tmp_path):
    store = GatedStore()

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            fh = await _write(core, vol, "f.bin", b"fsynced")
            await core.fsync(fh)
            assert _stored(store, "f.bin") == b"fsynced"
            st = committer.statistics()
            assert st["committed_by_fsync"] == 1 and st["pending"] == 0
            assert committer.journal.records() == []
            # close() after that has nothing left to make durable.
            await core.flush(fh)
            await core.release(fh)
            assert committer.journal.records() == []
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(main)


class GatedPutStore(GatedStore):
    """PUTs too wait for `gate` (in their store thread), and say they are waiting."""

    def __init__(self):
        super().__init__()
        self.put_waiting = threading.Event()

    def put(self, *args, **kw):
        if not self.gate.is_set():
            self.put_waiting.set()
            self.gate.wait(30)
        return self.inner.put(*args, **kw)


def _rows_a_crash_would_find(committer) -> list[tuple[int]]:
    """The sizes of the journal's rows as a crash now would find them: a second connection sees
    committed rows only."""
    import sqlite3

    db = sqlite3.connect(committer.journal.path)
    try:
        return db.execute("SELECT size FROM pending").fetchall()
    finally:
        db.close()


async def _released_and_committed(core, committer, store, fh, data: bytes) -> None:
    """Release f.bin's handle, wait until the store holds `data` and no row is left, and stop."""
    await core.release(fh)
    with trio.fail_after(10):
        while _stored(store, "f.bin") != data or committer.journal.records():
            await trio.sleep(0.01)
    await committer.shutdown(drain=True)


def test_fsync_past_a_recorded_close_leaves_no_row_that_would_roll_the_store_back(tmp_path):
    """A writer closes a duplicate (a row for v1), writes on and fsyncs, and writes more while that
    fsync uploads: v2 is in the store when fsync returns. The row names v1 (a replay publishes only
    the closed bytes), so no row may be left then for a crash to replay: it would put v1 back over
    the v2 that fsync promised. The writes made during the upload were never closed: a crash leaves
    the store at v2."""
    store = GatedPutStore()

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            fh = await _write(core, vol, "f.bin", b"v1")
            await core.flush(fh)  # a close of a duplicate: the writer goes on
            assert [r.size for r in committer.journal.records()] == [2]
            await core.write(fh, 2, b"+v2")
            store.gate.clear()
            done = trio.Event()

            async def fsync():
                await core.fsync(fh)
                done.set()

            n.start_soon(fsync)
            with trio.fail_after(10):
                while not store.put_waiting.is_set():
                    await trio.sleep(0.01)
            await core.write(fh, 5, b" more")  # during the upload of v2
            store.gate.set()
            with trio.fail_after(10):
                await done.wait()
            left = _rows_a_crash_would_find(committer)
            assert _stored(store, "f.bin") == b"v1+v2"
            assert left == [], f"a crash now would publish the closed {left} bytes over the fsynced 5"
            await core.flush(fh)
            await _released_and_committed(core, committer, store, fh, b"v1+v2 more")
            n.cancel_scope.cancel()

    trio.run(main)


def test_an_upload_a_killed_daemon_never_recorded_is_named_and_no_other_writer_s_is_aborted(tmp_path, caplog):
    """A daemon killed after CreateMultipartUpload and before recording the upload's id leaves only
    its intent record (key, time). The next mount aborted every upload of that key from those
    minutes: another host's upload of the same key, busy with its parts, was aborted with it. The
    one left by the killed daemon holds no parts, and cannot be told from the other: both stay,
    the log names them, and the intent goes."""
    import time

    from ucfs.journal import Journal

    store = GatedStore()
    cfg = _cfg(tmp_path)
    leaked = store.inner.create_multipart("bucket", "pfx/big.bin")  # what the killed daemon created
    busy = store.inner.create_multipart("bucket", "pfx/big.bin")  # another host's, under way
    store.inner.upload_part("bucket", "pfx/big.bin", busy, 1, b"x" * 100, 100)
    older = store.inner.create_multipart("bucket", "pfx/big.bin")  # someone else's, an hour earlier
    store.inner._uploads[older]["initiated"] = time.time() - 3600
    other = store.inner.create_multipart("bucket", "pfx/other.bin")  # another key
    everyone = sorted([leaked, busy, older, other])

    async def record_intent():
        journal = Journal(tmp_path / "state" / "journal.sqlite3")
        async with trio.open_nursery() as n:
            await n.start(journal.run)
            await journal.add_upload_intent("a.b.c", "pfx/big.bin")
            await journal.close()
        journal.close_db()

    async def mount_again():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, cfg)
            assert sorted(u.upload_id for u in store.inner.list_multipart("bucket", "pfx/")) == everyone
            # A multipart commit through this daemon leaves no record behind either.
            fh = await _write(core, vol, "m.bin", os.urandom(20 * MiB))
            await core.fsync(fh)
            await core.release(fh)
            assert _stored(store, "m.bin") is not None
            await committer.shutdown(drain=True)
            while committer.journal.uploads():  # the intent's removal is written in the background
                await trio.sleep(0.01)
            n.cancel_scope.cancel()

    trio.run(record_intent)
    with caplog.at_level("WARNING", logger="ucfs.commit"):
        trio.run(mount_again)
    assert sorted(u.upload_id for u in store.inner.list_multipart("bucket", "pfx/")) == everyone
    named = [r.getMessage() for r in caplog.records if "may have left it behind" in r.getMessage()]
    assert len(named) == 1 and "'pfx/big.bin'" in named[0], caplog.text
    assert leaked in named[0] and busy in named[0] and older not in named[0] and other not in named[0]


def test_a_burst_of_creates_makes_its_spares_in_few_batches(tmp_path, monkeypatch):
    """Creates in one directory come one at a time (the kernel holds its lock), each taking a spare.
    Spares are made in batches that end with an fsync of the staging directory, so the pool is
    topped up only once it is half used: topping it up after every take made one file per fsync."""
    store = MemoryStore()
    store.buckets["bucket"] = {}
    cfg = _cfg(tmp_path)

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, cfg)
            with trio.fail_after(10):
                while len(committer._spares) < commit_mod.SPARE_STAGING_FILES:
                    await trio.sleep(0.01)
            batches = []
            real = committer._new_spares
            monkeypatch.setattr(committer, "_new_spares", lambda k: (batches.append(k), real(k))[1])
            taken = []
            for _ in range(64):
                taken.append(await committer._staging_file())
                with trio.fail_after(10):
                    while committer._refilling:  # the next create comes after the refill, if any
                        await trio.sleep(0.001)
            for path, fd in taken:
                os.close(fd)
                path.unlink()
            assert 1 <= len(batches) <= 8, batches  # 8 or more files per directory fsync
            assert len(committer._spares) >= commit_mod.SPARE_LOW_WATER
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(main)


def test_creates_never_read_the_disk_s_free_space_on_the_event_loop(tmp_path, monkeypatch):
    """A statfs can block on a busy disk (153 ms in the soak), so a create takes a spare on the last
    reading, made in a thread, and has a thread read it again in the background when it is old."""
    store = GatedStore()
    cfg = _cfg(tmp_path)
    real_statvfs = os.statvfs
    callers: list[str] = []

    def statvfs(path):
        callers.append(threading.current_thread().name)
        return real_statvfs(path)

    monkeypatch.setattr(os, "statvfs", statvfs)

    async def main():
        loop_thread = threading.current_thread().name
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, cfg)
            with trio.fail_after(10):
                while len(committer._spares) < commit_mod.SPARE_STAGING_FILES:
                    await trio.sleep(0.01)
            callers.clear()
            fhs = [await _write(core, vol, f"a{i}.bin", b"x") for i in range(4)]  # readings still fresh
            await trio.sleep(commit_mod.ROOM_READING_MAX_AGE_S + 0.1)
            spares_before = {p for p, _ in committer._spares}
            read_at = committer._room_reading[0]
            fh = await _write(core, vol, "late.bin", b"y")  # an old reading: read again meanwhile
            assert core.file_handle(fh).staged.path in spares_before
            with trio.fail_after(10):
                while committer._room_reading[0] == read_at:
                    await trio.sleep(0.01)
            for h in fhs + [fh]:
                await core.fsync(h)
                await core.release(h)
            assert callers and loop_thread not in callers, (loop_thread, callers)
            assert _stored(store, "late.bin") == b"y"
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(main)


def test_creates_take_staging_files_made_ahead_and_none_is_left_behind(tmp_path):
    """A create takes an empty staging file made ahead (no trip to a disk thread while the kernel
    holds the directory's lock). Spares never written are removed at shutdown, and at the next
    start if a daemon died holding them; one that was written is kept as an orphan, as before."""
    store = GatedStore()
    cfg = _cfg(tmp_path)
    staging = tmp_path / "state" / "staging"
    staging.mkdir(mode=0o700)
    (staging / f"{commit_mod.SPARE_PREFIX}dead.data").write_bytes(b"")  # a killed daemon's spare
    (staging / f"{commit_mod.SPARE_PREFIX}used.data").write_bytes(b"half-written")  # one in use

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, cfg)
            assert not (staging / f"{commit_mod.SPARE_PREFIX}dead.data").exists()
            assert not (tmp_path / "state" / "orphans" / f"{commit_mod.SPARE_PREFIX}dead.data").exists()
            assert (tmp_path / "state" / "orphans" / f"{commit_mod.SPARE_PREFIX}used.data").read_bytes() == \
                b"half-written"
            with trio.fail_after(10):
                while len(committer._spares) < commit_mod.SPARE_STAGING_FILES:
                    await trio.sleep(0.01)
            spare_paths = {p for p, _ in committer._spares}
            fh = await _write(core, vol, "small.bin", b"x" * 1000)
            used = core.file_handle(fh).staged.path
            assert used in spare_paths
            await core.fsync(fh)
            await core.release(fh)
            assert _stored(store, "small.bin") == b"x" * 1000
            with trio.fail_after(10):
                while used.exists():  # committed and closed: removed in the background
                    await trio.sleep(0.01)
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()
        assert not [p.name for p in staging.iterdir() if p.name.startswith(commit_mod.SPARE_PREFIX)]

    trio.run(main)


def _gate_journal_adds(committer):
    """Make the journal's `add` wait at `gate` (entered: `entered`), as a slow disk would."""
    entered, gate = trio.Event(), trio.Event()
    add = committer.journal.add

    async def gated_add(*args):
        entered.set()
        await gate.wait()
        return await add(*args)

    committer.journal.add = gated_add
    return entered, gate


def _start_close(nursery, core, fh) -> trio.Event:
    """close() of fh (its FUSE flush) in the background; the event is set once it returned."""
    done = trio.Event()

    async def close():
        await core.flush(fh)
        done.set()

    nursery.start_soon(close)
    return done


@pytest.mark.parametrize("op", ["rename", "unlink"])
def test_a_rename_or_unlink_while_a_close_writes_its_journal_row(tmp_path, op):
    """The first close of a file writes its journal row; a rename or unlink meanwhile finds no row
    to change. Once the close returns, the row must name the new path (a replay after a crash
    publishes what the row says), or be gone (or a crash would bring the deleted file back)."""
    store = GatedStore()

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            fh = await _write(core, vol, "old.bin", b"content")
            entered, gate = _gate_journal_adds(committer)
            closed = _start_close(n, core, fh)
            await entered.wait()
            if op == "rename":
                await core.rename(vol, "old.bin", vol, "new.bin")
            else:
                await core.unlink(vol, "old.bin")
            gate.set()
            with trio.fail_after(10):
                await closed.wait()
            assert [r.path for r in committer.journal.records()] == (["new.bin"] if op == "rename" else [])
            await core.release(fh)
            await committer.shutdown(drain=True)
            assert _stored(store, "new.bin") == (b"content" if op == "rename" else None)
            assert _stored(store, "old.bin") is None
            n.cancel_scope.cancel()

    trio.run(main)


def _gated_store_counting_parts() -> tuple[GatedStore, dict[str, int]]:
    """A GatedStore with its gate closed, and the part uploads it was asked for, by key."""
    store = GatedStore()
    parts_by_key: dict[str, int] = {}
    upload_part = store.upload_part

    def counting_upload_part(bucket, key, *args, **kw):
        parts_by_key[key] = parts_by_key.get(key, 0) + 1
        return upload_part(bucket, key, *args, **kw)

    store.upload_part = counting_upload_part
    store.gate.clear()
    return store, parts_by_key


async def _write_back_to_front(core, vol, name: str, data: bytes):
    """Create `name`, write its last MiB first (so it does not stream) and close it; the handle stays."""
    fh, _ = await core.create(vol, name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    await core.write(fh, len(data) - MiB, data[-MiB:])  # not front to back: no stream
    for off in range(0, len(data) - MiB, MiB):
        await core.write(fh, off, data[off:off + MiB])
    await core.flush(fh)
    return fh


async def _rename_or_unlink_once_parts_wait(core, vol, store: GatedStore, op: str) -> None:
    """Once a part upload waits at the gate: rename (or unlink) old.bin, let the parts go after a
    moment, and return when the rename has returned."""
    with trio.fail_after(10):
        while store.parts_waiting < 1:
            await trio.sleep(0.01)
    done = trio.Event()

    async def rename():
        if op == "rename":
            await core.rename(vol, "old.bin", vol, "new.bin")
        else:
            await core.unlink(vol, "old.bin")
        done.set()

    async with trio.open_nursery() as n:
        n.start_soon(rename)
        await trio.sleep(0.2)  # the rename waits for the upload's parts in flight
        store.gate.set()
        with trio.fail_after(10):
            await done.wait()


@pytest.mark.parametrize("op", ["rename", "unlink"])
def test_a_rename_or_unlink_does_not_wait_for_the_whole_upload_of_the_file(tmp_path, op):
    """`mv` or `rm` of a file whose upload is under way: the upload goes to a name that is going
    away, so it gives up after the parts already on their way (a renamed file is then uploaded
    under its new name), instead of keeping the rename or unlink - and the directory, locked by the
    kernel meanwhile - waiting until every part is sent. Nothing is published under the old name."""
    store, parts_by_key = _gated_store_counting_parts()
    data = os.urandom(64 * MiB)  # 64 parts of 1 MiB

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            fh = await _write_back_to_front(core, vol, "old.bin", data)
            await core.release(fh)  # queued: a worker starts the multipart upload
            await _rename_or_unlink_once_parts_wait(core, vol, store, op)
            await committer.shutdown(drain=True)
            assert parts_by_key.get("pfx/old.bin", 0) <= 16, parts_by_key  # not all 64
            assert _stored(store, "new.bin") == (data if op == "rename" else None)
            assert _stored(store, "old.bin") is None
            assert committer.statistics().get("restarted", 0) >= 1
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_rename_while_a_writer_is_still_writing_publishes_only_the_whole_file(tmp_path):
    """A file closed once (a dup, as a shell's `>` does), written further and renamed while still
    open: the rename must not publish what the file holds at that moment under its new name - a
    reader elsewhere sees the old object or the whole new one, never a part. The last close does."""
    store = GatedStore()

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            fh = await _write(core, vol, "old.txt", b"first half, ")
            await core.flush(fh)  # close() of a dup: durable and journaled, still open for writing
            await core.write(fh, 12, b"second half")
            await core.rename(vol, "old.txt", vol, "new.txt")
            await trio.sleep(0.5)  # workers are idle: nothing was queued
            assert _stored(store, "new.txt") is None and _stored(store, "old.txt") is None
            await core.flush(fh)
            await core.release(fh)
            await committer.shutdown(drain=True)
            assert _stored(store, "new.txt") == b"first half, second half"
            assert _stored(store, "old.txt") is None
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_rename_while_a_close_writes_the_row_of_an_fsynced_file_leaves_one_row(tmp_path):
    """A file committed by fsync, written further and closed: the close writes its first journal
    row. A rename meanwhile must journal the content it moves too (the old key goes) - but not as a
    second row beside the close's: after a crash both would be committed."""
    store = GatedStore()

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            fh = await _write(core, vol, "a.bin", b"version one")
            await core.fsync(fh)  # committed in place: no journal row
            await core.write(fh, 11, b", and more")
            entered, gate = _gate_journal_adds(committer)
            closed = _start_close(n, core, fh)
            await entered.wait()
            async with trio.open_nursery() as inner:  # waits for the rename too
                inner.start_soon(core.rename, vol, "a.bin", vol, "b.bin")
                await trio.sleep(0.2)
                gate.set()
            with trio.fail_after(10):
                await closed.wait()
            assert [r.path for r in committer.journal.records()] == ["b.bin"]
            await core.release(fh)
            await committer.shutdown(drain=True)
            assert _stored(store, "b.bin") == b"version one, and more" and _stored(store, "a.bin") is None
            n.cancel_scope.cancel()

    trio.run(main)



@pytest.mark.parametrize("op", ["rename", "unlink"])
def test_a_rename_or_unlink_does_not_wait_for_the_whole_upload_of_a_kept_version(tmp_path, op):
    """As above, for the closed version kept aside while the file is written again: its commit ran
    on a stand-in for the file that never saw the rename's request to give up, so `mv` waited for
    every part. Now it stops after the parts on their way; a renamed file's kept version is then
    committed under the new name, and the writer's last close after it."""
    store, parts_by_key = _gated_store_counting_parts()
    data = os.urandom(64 * MiB)  # 64 parts of 1 MiB

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            fh = await _write_back_to_front(core, vol, "old.bin", data)  # closed: durable and journaled
            staged = core.file_handle(fh).staged
            fh2, _ = await core.open(core.file_handle(fh).inode.ino, os.O_WRONLY)  # written again
            await core.release(fh)
            assert staged.kept is not None  # the closed version is kept aside
            kept_name = staged.kept.path.name
            await core.write(fh2, 0, b"EDIT")
            committer._enqueue(staged)  # as a retry would: the kept version is committed meanwhile
            await _rename_or_unlink_once_parts_wait(core, vol, store, op)
            assert parts_by_key.get("pfx/old.bin", 0) <= 16, parts_by_key  # not all 64
            assert _stored(store, "old.bin") is None
            # What a crash now would publish: the kept version under the new name, or nothing.
            want = [("new.bin", kept_name)] if op == "rename" else []
            assert [(r.path, r.staging) for r in committer.journal.records()] == want
            if op == "rename":  # the closed version reaches the new name while the writer still writes
                with trio.fail_after(30):
                    while _stored(store, "new.bin") != data:
                        await trio.sleep(0.01)
            await core.flush(fh2)
            await core.release(fh2)
            await committer.shutdown(drain=True)
            assert _stored(store, "new.bin") == (b"EDIT" + data[4:] if op == "rename" else None)
            assert _stored(store, "old.bin") is None
            assert committer.statistics().get("restarted", 0) >= 1
            assert store.inner.list_multipart("bucket", "pfx/") == []  # the given-up upload is aborted
            n.cancel_scope.cancel()

    trio.run(main)


def test_an_append_racing_a_queued_single_put_is_not_published_before_its_close(tmp_path):
    """The worker checks that nobody writes the file, then waits for memory before it reads it: a
    writer that opens and appends in that wait must not have its unclosed bytes uploaded with the
    closed version (the store would show bytes no close covered, and a crash would keep them)."""

    async def main():
        async with trio.open_nursery() as n:
            store = GatedStore()
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            budget = core.budget
            held = budget.capacity_bytes - budget.used_bytes
            budget.force_reserve(held)  # the worker's commit waits for memory
            fh = await _write(core, vol, "log.txt", b"closed\n")
            staged = core.file_handle(fh).staged
            await core.flush(fh)
            await core.release(fh)
            with trio.fail_after(10):
                while not staged.commit_lock.locked():  # the worker has it, past its check
                    await trio.sleep(0.005)
            fh2, _ = await core.open(staged.node.ino, os.O_WRONLY | os.O_APPEND)
            await core.write(fh2, 7, b"unclosed")
            budget.release(held)
            with trio.fail_after(10):
                while _stored(store, "log.txt") is None:
                    await trio.sleep(0.005)
            assert _stored(store, "log.txt") == b"closed\n"
            await core.flush(fh2)
            await core.release(fh2)
            with trio.fail_after(10):
                while _stored(store, "log.txt") != b"closed\nunclosed":
                    await trio.sleep(0.005)
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_close_during_the_commit_mark_names_the_staging_file_it_leaves(tmp_path, monkeypatch):
    """A commit renames a staging file that readers keep open to `committed-<name>` (so a crash does
    not take it for a file never closed). It did so with a writer open too, and renamed it back when
    it saw the writer: a close in between recorded the `committed-` name in its journal row, and the
    file then had the other name. A crash would have found the row's file missing."""
    real_rename = os.rename
    back_started, back_go = threading.Event(), threading.Event()

    def rename(src, dst, *a, **kw):
        if os.path.basename(src).startswith(commit_mod.COMMITTED_PREFIX):
            back_started.set()  # renaming back: let the test close its writer meanwhile
            back_go.wait(10)
        return real_rename(src, dst, *a, **kw)

    async def main():
        async with trio.open_nursery() as n:
            store = GatedPutStore()
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            fh = await _write(core, vol, "f.bin", b"v1")
            s = core.file_handle(fh).staged
            store.gate.clear()  # the commit waits until the reader and the writer are open
            await core.flush(fh)
            await core.release(fh)
            with trio.fail_after(10):
                while not store.put_waiting.is_set():
                    await trio.sleep(0.005)
            reader, _ = await core.open(s.node.ino, os.O_RDONLY)
            writer, _ = await core.open(s.node.ino, os.O_WRONLY)
            monkeypatch.setattr(os, "rename", rename)
            store.gate.set()
            with trio.move_on_after(2):  # the old code renames back: close the writer meanwhile
                while not back_started.is_set() and _stored(store, "f.bin") is None:
                    await trio.sleep(0.005)
                while not back_started.is_set():
                    await trio.sleep(0.005)
            await core.write(writer, 0, b"v2")
            await core.flush(writer)
            back_go.set()
            with trio.fail_after(10):
                while s.path.name.startswith(commit_mod.COMMITTED_PREFIX):
                    await trio.sleep(0.005)
            rows = committer.journal.records()
            assert [r.path for r in rows] == ["f.bin"]
            on_disk = os.listdir(committer.staging_dir)
            assert rows[0].staging in on_disk, (rows[0].staging, on_disk)
            await core.release(writer)
            await core.release(reader)
            with trio.fail_after(10):
                while _stored(store, "f.bin") != b"v2":
                    await trio.sleep(0.01)
            monkeypatch.setattr(os, "rename", real_rename)
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_stream_part_the_staging_file_cannot_give_abandons_the_stream_not_the_mount(tmp_path, monkeypatch,
                                                                                      caplog):
    """A part of a stream is read from the staging file in a disk thread. A read that fails there
    (EIO from the disk) raised past the part's task, whose only catch was for the store's errors,
    into the committer's nursery: every commit worker was cancelled with it, and the mount ended.
    It must abandon the stream instead, saying why, and the file still reaches the store whole (by a
    later stream, or committed whole after its close)."""
    monkeypatch.setattr(commit_mod, "STREAM_START_BYTES", 4 * MiB)
    store = GatedStore()
    data = os.urandom(12 * MiB + 5)
    failed = []
    real_preadv, real_pread = os.preadv, os.pread

    def failing(real):
        def read(fd, *args):
            if not failed and fd == failing.fd:
                failed.append(fd)
                raise OSError(5, "Input/output error")
            return real(fd, *args)
        return read

    failing.fd = None
    monkeypatch.setattr(os, "preadv", failing(real_preadv))
    monkeypatch.setattr(os, "pread", failing(real_pread))

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            fh, _ = await core.create(vol, "s.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            failing.fd = core.file_handle(fh).staged.fd  # the stream's first part read fails
            for off in range(0, len(data), MiB):
                await core.write(fh, off, data[off:off + MiB])
            with trio.fail_after(10):
                while not committer.statistics().get("streams_abandoned"):
                    await trio.sleep(0.01)
            await core.flush(fh)
            await core.release(fh)
            with trio.fail_after(30):
                while _stored(store, "s.bin") != data or committer.journal.records():
                    await trio.sleep(0.01)
            assert committer.statistics()["streams_abandoned"] == 1
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    with caplog.at_level("INFO", logger="ucfs.commit"):
        trio.run(main)
    assert failed
    assert any(r.levelname == "WARNING" and "of /a/b/c/s.bin failed here" in r.getMessage()
               and "Input/output error" in r.getMessage() for r in caplog.records), caplog.text


def _counting_puts(store: GatedStore) -> dict[str, int]:
    """Bytes the store was sent (parts and single PUTs) by key, counted as they arrive."""
    sent: dict[str, int] = {}
    upload_part, put = store.upload_part, store.inner.put

    def counting_upload_part(bucket, key, upload_id, n, data, length, *args, **kw):
        sent[key] = sent.get(key, 0) + length
        return upload_part(bucket, key, upload_id, n, data, length, *args, **kw)

    def counting_put(bucket, key, data, size, *args, **kw):
        sent[key] = sent.get(key, 0) + size
        return put(bucket, key, data, size, *args, **kw)

    store.upload_part = counting_upload_part
    store.put = counting_put
    return sent


def test_a_rename_while_a_closed_stream_is_finished_sends_its_bytes_once(tmp_path, monkeypatch):
    """The atomic-save idiom (write tmp, close, os.replace onto the final name) on a file that
    streamed: the rename came while a worker finished the stream under the temp name. It used to
    abort the upload and send the whole file again under the new name; the parts already sent are
    kept: the upload is completed under the temp name and copied to the new one on the server."""
    monkeypatch.setattr(commit_mod, "STREAM_START_BYTES", 2 * MiB)
    monkeypatch.setattr(commit_mod, "BACKGROUND_SYNC_BYTES", 4 * MiB)
    store = GatedStore()
    store.gate.clear()  # the stream lags: close() syncs and journals, a worker finishes the stream
    sent = _counting_puts(store)
    data = os.urandom(16 * MiB + 5)

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            fh = await _write(core, vol, "old.bin", data)
            s = core.file_handle(fh).staged
            await core.flush(fh)
            assert committer.statistics().get("committed_at_close", 0) == 0
            await core.release(fh)
            with trio.fail_after(10):
                while not s.commit_lock.locked():  # a worker is finishing the stream
                    await trio.sleep(0.01)
            await _rename_or_unlink_once_parts_wait(core, vol, store, "rename")
            await committer.shutdown(drain=True)
            assert _stored(store, "new.bin") == data
            assert _stored(store, "old.bin") is None
            assert store.inner.list_multipart("bucket", "pfx/") == []
            assert sent == {"pfx/old.bin": len(data)}, sent  # every byte once, none under new.bin
            assert committer.journal.records() == []
            st = committer.statistics()
            assert st["published_for_rename"] == 1 and st["copied_for_rename"] == 1
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_rename_of_a_large_file_committed_at_close_copies_it_on_the_server(tmp_path, monkeypatch):
    """close() finished the stream itself (the upload kept up), and the rename came before the
    kernel's release: the staged file is clean, its object under the old name. It was uploaded
    again whole under the new name; it is copied on the server instead."""
    monkeypatch.setattr(commit_mod, "STREAM_START_BYTES", 4 * MiB)
    store = GatedStore()
    sent = _counting_puts(store)
    data = os.urandom(24 * MiB + 123)

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            fh = await _write_closed_streamed(core, committer, vol, "old.bin", data)
            assert committer.statistics()["committed_at_close"] == 1
            await core.rename(vol, "old.bin", vol, "new.bin")
            await core.release(fh)
            await committer.shutdown(drain=True)
            assert _stored(store, "new.bin") == data
            assert _stored(store, "old.bin") is None
            assert sent == {"pfx/old.bin": len(data)}, sent
            assert committer.journal.records() == []
            assert committer.journal.uploads() == []  # nor the record of the old key's deletion
            assert committer.statistics()["copied_for_rename"] == 1
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_rename_whose_server_side_copy_fails_uploads_the_file_again(tmp_path, monkeypatch):
    """The copy only saves sending the bytes again: when the store refuses it, the rename still
    succeeds and the file is uploaded under its new name, as before."""
    from ucfs import errors

    monkeypatch.setattr(commit_mod, "STREAM_START_BYTES", 4 * MiB)
    store = GatedStore()
    sent = _counting_puts(store)

    def refused_copy(*args, **kw):
        raise errors.StoreError(errors.EIO, "copy refused", status=500, transient=False)

    store.copy = refused_copy
    data = os.urandom(24 * MiB + 123)

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            fh = await _write_closed_streamed(core, committer, vol, "old.bin", data)
            assert committer.statistics()["committed_at_close"] == 1
            await core.rename(vol, "old.bin", vol, "new.bin")
            await core.release(fh)
            await committer.shutdown(drain=True)
            assert _stored(store, "new.bin") == data
            assert _stored(store, "old.bin") is None
            assert sent == {"pfx/old.bin": len(data), "pfx/new.bin": len(data)}, sent
            assert committer.journal.records() == []
            n.cancel_scope.cancel()

    trio.run(main)


def test_the_old_key_of_a_copied_rename_is_deleted_by_the_next_mount_if_this_one_could_not(tmp_path, monkeypatch):
    """Renamed and copied on the server, the file's object under the old key must go; a daemon that
    could not delete it (killed, or the store refused) leaves a journal record, and the next mount
    deletes it before anything else. Without the record the temp name came back for good."""
    from ucfs import errors

    monkeypatch.setattr(commit_mod, "STREAM_START_BYTES", 4 * MiB)
    store = GatedStore()
    cfg = _cfg(tmp_path)
    data = os.urandom(24 * MiB + 123)

    def refused_delete(bucket, key):
        raise errors.StoreError(errors.EIO, "delete refused", status=500, transient=False)

    async def rename_and_stop():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, cfg)
            fh = await _write_closed_streamed(core, committer, vol, "old.bin", data)
            assert committer.statistics()["committed_at_close"] == 1
            store.delete = refused_delete
            await core.rename(vol, "old.bin", vol, "new.bin")
            del store.delete
            assert committer.statistics()["copied_for_rename"] == 1
            assert [key for _, _, key, _ in committer.journal.uploads()] == ["pfx/old.bin"]
            await core.release(fh)
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    async def mount_again():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, cfg)
            assert _stored(store, "old.bin") is None
            assert _stored(store, "new.bin") == data
            with trio.fail_after(5):
                while committer.journal.uploads():  # its removal is written in the background
                    await trio.sleep(0.01)
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(rename_and_stop)
    assert _stored(store, "old.bin") == data  # left behind, and recorded
    trio.run(mount_again)


def test_a_copied_rename_whose_journal_cannot_remove_the_delete_record_still_succeeds(tmp_path, monkeypatch):
    """Copied to the new key and deleted under the old one, the rename is done in the store. A full
    journal disk refusing the removal of the delete record then failed the rename: the name went back
    to the old one, whose object was already deleted, and the new name's object was unknown here."""
    monkeypatch.setattr(commit_mod, "STREAM_START_BYTES", 4 * MiB)
    store = GatedStore()
    cfg = _cfg(tmp_path)
    data = os.urandom(24 * MiB + 123)

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, cfg)
            fh = await _write_closed_streamed(core, committer, vol, "old.bin", data)
            assert committer.statistics()["committed_at_close"] == 1

            async def journal_full(marker):
                raise OSError(errno.ENOSPC, "commit journal write failed: database or disk is full")

            monkeypatch.setattr(committer.journal, "remove_delete", journal_full)
            await core.rename(vol, "old.bin", vol, "new.bin")
            assert committer.statistics()["copied_for_rename"] == 1
            assert _stored(store, "old.bin") is None and _stored(store, "new.bin") == data
            assert (await core.lookup(vol, "new.bin")).size == len(data)
            assert await core.lookup(vol, "old.bin") is None
            with trio.fail_after(5):
                while committer.journal.uploads():  # removed with the next batch instead
                    await trio.sleep(0.01)
            await core.release(fh)
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("then", ["rename back", "rename again", "unlink", "rewrite"])
def test_what_follows_a_rename_that_copied_a_finished_stream_stays_right(tmp_path, monkeypatch, then):
    """After a rename that let a stream's finish complete under the old key and copied it: a rename
    back, a second rename, an unlink of the new name or a rewrite each leave the store as a local
    file system would, with nothing under any other name."""
    monkeypatch.setattr(commit_mod, "STREAM_START_BYTES", 2 * MiB)
    monkeypatch.setattr(commit_mod, "BACKGROUND_SYNC_BYTES", 4 * MiB)
    store = GatedStore()
    store.gate.clear()
    data = os.urandom(16 * MiB + 5)

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            fh = await _write(core, vol, "old.bin", data)
            s = core.file_handle(fh).staged
            await core.flush(fh)
            await core.release(fh)
            with trio.fail_after(10):
                while not s.commit_lock.locked():
                    await trio.sleep(0.01)
            await _rename_or_unlink_once_parts_wait(core, vol, store, "rename")
            assert committer.statistics()["copied_for_rename"] == 1
            want = {"new.bin": data}
            if then == "rename back":
                await core.rename(vol, "new.bin", vol, "old.bin")
                want = {"old.bin": data}
            elif then == "rename again":
                await core.rename(vol, "new.bin", vol, "third.bin")
                want = {"third.bin": data}
            elif then == "unlink":
                await core.unlink(vol, "new.bin")
                want = {}
            else:
                fh2, _ = await core.create(vol, "new.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                await core.write(fh2, 0, b"second version")
                await core.flush(fh2)
                await core.release(fh2)
                want = {"new.bin": b"second version"}
            await committer.shutdown(drain=True)
            assert {k[len("pfx/"):]: store.inner.get("bucket", k)[0] for k in store.inner.buckets["bucket"]} == want
            assert store.inner.list_multipart("bucket", "pfx/") == []
            assert committer.journal.records() == [] and committer.journal.uploads() == []
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_rename_while_every_part_of_a_whole_file_upload_is_in_flight_sends_its_bytes_once(tmp_path, monkeypatch):
    """A file committed whole as a multipart upload (it did not stream: a passthrough writer's, say),
    renamed once every part is on its way: the rename waits for those parts anyway, so the upload
    is completed and copied instead of given up and sent again. (With parts still to start, it is
    given up: test_a_rename_or_unlink_does_not_wait_for_the_whole_upload_of_the_file.)"""
    monkeypatch.setattr(commit_mod, "SINGLE_PUT_MAX_BYTES", 2 * MiB)
    monkeypatch.setattr(commit_mod, "RENAME_COPY_MIN_BYTES", 2 * MiB)
    store, _ = _gated_store_counting_parts()
    sent = _counting_puts(store)
    data = os.urandom(4 * MiB)  # 4 parts: as many as the 4 part slots

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            fh = await _write_back_to_front(core, vol, "old.bin", data)
            await core.release(fh)
            with trio.fail_after(10):
                while store.parts_waiting < 4:
                    await trio.sleep(0.01)
            await _rename_or_unlink_once_parts_wait(core, vol, store, "rename")
            await committer.shutdown(drain=True)
            assert _stored(store, "new.bin") == data
            assert _stored(store, "old.bin") is None
            assert sent == {"pfx/old.bin": len(data)}, sent
            st = committer.statistics()
            assert st["published_for_rename"] == 1 and st["copied_for_rename"] == 1
            assert committer.journal.records() == [] and committer.journal.uploads() == []
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_close_recording_its_row_while_the_kept_version_commits_keeps_that_row(tmp_path):
    """v1 is closed (a row), then opened again with O_TRUNC before its commit, so v1 is kept aside;
    v2 is written and closed. That close points the row at v2 while v1's commit is still running,
    and v1's commit ends during that journal write. It removed the row as its own (`_end_kept`):
    until v2's own commit, a crash had nothing of v2 to publish, and the store kept v1. Found by the
    random run (seed 319), where a directory rename queued the kept version's commit at once."""
    store = GatedPutStore()

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            fh = await _write(core, vol, "f.bin", b"v1" * 1000)
            await core.flush(fh)
            store.gate.clear()  # v1's commit waits in its PUT
            await core.release(fh)
            ino = (await core.lookup(vol, "f.bin")).ino
            fh, _ = await core.open(ino, os.O_WRONLY | os.O_TRUNC)  # v1 kept aside
            await core.write(fh, 0, b"v2")
            with trio.fail_after(10):
                while not store.put_waiting.is_set():
                    await trio.sleep(0.01)
            committed = committer.stats["committed"]
            mark_ready = committer.journal.mark_ready

            async def mark_ready_while_v1_ends(*args):
                await mark_ready(*args)
                store.gate.set()  # v1's commit ends before this close has recorded its row
                with trio.fail_after(10):
                    while committer.stats["committed"] == committed:
                        await trio.sleep(0.01)
                await trio.sleep(0.1)  # and whatever it does after

            committer.journal.mark_ready = mark_ready_while_v1_ends
            await core.flush(fh)
            await committer.journal.settle()
            left = _rows_a_crash_would_find(committer)
            assert _stored(store, "f.bin") == b"v1" * 1000
            assert left == [(2,)], f"a crash now would publish {left}, not the closed 2 bytes of v2"
            await _released_and_committed(core, committer, store, fh, b"v2")
            n.cancel_scope.cancel()

    trio.run(main)


def test_growth_a_commit_already_sends_does_not_begin_a_stream_of_it(tmp_path, monkeypatch):
    """The watcher finds that a passthrough writer's file grew and looks for holes in it, in a thread.
    An fsync that arrives meanwhile commits the file whole. The watcher, back from its look, began a
    stream of those same bytes, and the close then finished it: the file was sent twice (seen in CI,
    test_passthrough.py, 40 MiB written, fsynced and closed)."""
    monkeypatch.setattr(commit_mod, "STREAM_START_BYTES", 4 * MiB)
    looking, look_back = threading.Event(), threading.Event()
    first_hole = commit_mod._first_hole
    looks = []

    def slow_first_hole(fd, start):
        looks.append(start)
        if len(looks) == 1:  # the watcher's look: it ends once the fsync is sending the file
            looking.set()
            look_back.wait(30)
        return first_hole(fd, start)

    monkeypatch.setattr(commit_mod, "_first_hole", slow_first_hole)
    store = GatedStore()
    data = os.urandom(24 * MiB)

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            fh, _ = await core.create(vol, "pt.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            h = core.file_handle(fh)
            s = h.staged
            h.passthrough = True  # as if the kernel had granted it (ucfs.passthrough)
            committer.passthrough_opened(s, True)
            grown = committer._grown
            watcher_acted = trio.Event()

            def grown_then_noted(staged):
                grown(staged)
                watcher_acted.set()

            committer._grown = grown_then_noted
            os.pwrite(s.fd, data, 0)  # the kernel writes it, past the daemon
            with trio.fail_after(10):
                while not looking.is_set():
                    await trio.sleep(0.01)
            store.gate.clear()
            async with trio.open_nursery() as inner:
                inner.start_soon(core.fsync, fh)
                with trio.fail_after(10):
                    while not store.parts_waiting:  # the fsync's commit is sending the file
                        await trio.sleep(0.01)
                look_back.set()
                with trio.fail_after(10):
                    await watcher_acted.wait()
                store.gate.set()
            assert _stored(store, "pt.bin") == data
            await core.flush(fh)  # unchanged since the fsync: nothing more to send
            await core.release(fh)
            await committer.shutdown(drain=True)
            sent = store.inner.statistics()
            assert sent.get("create_multipart", 0) == 1, sent
            assert sent.get("upload_part", 0) == 24, sent
            assert committer.statistics().get("closed_unchanged", 0) == 1
            n.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("op", ["rename", "unlink"])
def test_a_rename_or_unlink_does_not_wait_for_a_commit_queued_behind_the_one_it_stops(tmp_path, op):
    """A log appended to and closed again while its last version uploads: a second worker takes the
    file and waits for its commit lock. `mv` (or `rm`) then asks the upload under way to give up,
    and it does - but the lock went to that second worker first, which uploaded the whole file
    under the name going away while the rename waited (and the kernel held the directory)."""
    store, parts_by_key = _gated_store_counting_parts()
    data, more = os.urandom(64 * MiB), os.urandom(MiB)  # 64 parts of 1 MiB, then one more

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, _cfg(tmp_path))
            fh = await _write_back_to_front(core, vol, "old.bin", data)
            await core.release(fh)  # queued: a worker starts the multipart upload
            with trio.fail_after(10):
                while store.parts_waiting < 1:
                    await trio.sleep(0.01)
            ino = (await core.lookup(vol, "old.bin")).ino
            fh, _ = await core.open(ino, os.O_WRONLY | os.O_APPEND)
            await core.write(fh, len(data), more)
            await core.flush(fh)
            await core.release(fh)  # queued again: a second worker waits for the commit lock
            with trio.fail_after(10):
                while committer._queue:
                    await trio.sleep(0.01)
            await _rename_or_unlink_once_parts_wait(core, vol, store, op)
            await committer.shutdown(drain=True)
            assert parts_by_key.get("pfx/old.bin", 0) <= 16, parts_by_key  # not 64, nor 64 + 65
            assert _stored(store, "new.bin") == (data + more if op == "rename" else None)
            assert _stored(store, "old.bin") is None
            n.cancel_scope.cancel()

    trio.run(main)
