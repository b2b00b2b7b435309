"""Names a probe found absent (`Inode.absent`) and files that settle before their commit
(`commit.COMMIT_SETTLE_S`), on the core with the in-memory store.

A create or a rename to a new name reaches the daemon right after the kernel's own lookup of that
name, and each asked the store again. Remembering the answer for the metadata TTL, as the kernel
remembers its negative entry, must never hide a name created here, nor one created elsewhere for
longer than the TTL.
"""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import trio

from ucfs import commit as commit_mod

from tests.support import run_on_core

TTL = 0.3
CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


def _run(tmp_path, body):
    return run_on_core(tmp_path, body, metadata_ttl_s=TTL)


def _heads(inner):
    return inner.statistics().get("head", 0)


def test_a_name_found_absent_is_not_asked_for_again_within_the_ttl(tmp_path):
    async def body(core, committer, vol, inner):
        assert await core.lookup(vol, "late.txt") is None
        heads = _heads(inner)
        inner.put_bytes("bucket", "pfx/late.txt", b"theirs")  # another writer, just after
        assert await core.lookup(vol, "late.txt") is None  # as the kernel's negative entry would say
        assert _heads(inner) == heads
        await trio.sleep(TTL + 0.05)
        attrs = await core.lookup(vol, "late.txt")  # and no longer than that
        assert attrs is not None and attrs.size == len(b"theirs")
        assert _heads(inner) > heads

    _run(tmp_path, body)


def test_a_name_created_here_is_found_after_its_inode_is_forgotten(tmp_path):
    async def body(core, committer, vol, inner):
        assert await core.lookup(vol, "mine.txt") is None
        fh, attrs = await core.create(vol, "mine.txt", CREATE)
        await core.write(fh, 0, b"ours")
        await core.flush(fh)
        await core.release(fh)
        await committer.fsync_tree(core.node(vol))
        assert inner.get("bucket", "pfx/mine.txt")[0] == b"ours"
        node = core.node(attrs.ino)
        core.forget(attrs.ino, node.lookups)  # the kernel lets go of it: the inode is dropped
        with trio.fail_after(5):
            while "mine.txt" in core.node(vol).children_by_name:  # (once its staging file retires)
                await trio.sleep(0.01)
        found = await core.lookup(vol, "mine.txt")  # within the TTL of the lookup that found it absent
        assert found is not None and found.size == 4

    _run(tmp_path, body)


def test_a_name_renamed_in_is_not_remembered_absent(tmp_path):
    async def body(core, committer, vol, inner):
        inner.put_bytes("bucket", "pfx/src.txt", b"moved")
        assert await core.lookup(vol, "src.txt") is not None
        assert await core.lookup(vol, "dst.txt") is None
        await core.rename(vol, "src.txt", vol, "dst.txt")
        assert core.node(vol).absent.get("dst.txt") is None
        attrs = await core.lookup(vol, "dst.txt")
        assert attrs is not None and attrs.size == 5

    _run(tmp_path, body)


def test_a_file_renamed_right_after_its_close_is_sent_once_under_its_final_name(tmp_path):
    async def body(core, committer, vol, inner):
        for i in range(5):
            fh, _ = await core.create(vol, f".f{i}.tmp", CREATE)
            await core.write(fh, 0, b"saved %d" % i)
            await core.flush(fh)
            await core.release(fh)
            assert await core.lookup(vol, f"f{i}") is None
            await core.rename(vol, f".f{i}.tmp", vol, f"f{i}")
        fh, _ = await core.create(vol, "scratch", CREATE)  # a temporary file removed at once
        await core.write(fh, 0, b"scratch")
        await core.flush(fh)
        await core.release(fh)
        await core.unlink(vol, "scratch")
        await committer.fsync_tree(core.node(vol))
        stats = inner.statistics()
        assert stats.get("put", 0) == 5, stats
        assert stats.get("copy", 0) == 0 and stats.get("delete", 0) == 0, stats
        assert sorted(inner.buckets["bucket"]) == [f"pfx/f{i}" for i in range(5)]

    _run(tmp_path, body)


def test_a_settling_file_is_committed_at_once_by_fsync_and_by_the_drain(tmp_path, monkeypatch):
    monkeypatch.setattr(commit_mod, "COMMIT_SETTLE_S", 30.0)  # longer than this test waits

    async def body(core, committer, vol, inner):
        for name in ("synced", "drained"):
            fh, _ = await core.create(vol, name, CREATE)
            await core.write(fh, 0, name.encode())
            await core.flush(fh)
            await core.release(fh)
        s = core.node((await core.lookup(vol, "synced")).ino).staged
        assert s.settling
        t0 = time.monotonic()
        with trio.fail_after(5):
            await committer.fsync(s)
        assert time.monotonic() - t0 < 5
        assert inner.get("bucket", "pfx/synced")[0] == b"synced"
        assert "pfx/drained" not in inner.buckets["bucket"]  # still settling
        # `_run` ends with a drain, which must not wait 30 s: checked after it returns.

    t0 = time.monotonic()
    inner = _run(tmp_path, body)
    assert time.monotonic() - t0 < 10
    assert inner.get("bucket", "pfx/drained")[0] == b"drained"


def test_a_directory_fsync_sends_the_files_settling_beneath_it_together(tmp_path, monkeypatch):
    """fsync() of a directory right after many closes (a job saying "my outputs are in") hands
    every settling file to the workers at once, not one file's PUT after another."""
    monkeypatch.setattr(commit_mod, "COMMIT_SETTLE_S", 30.0)
    lock = threading.Lock()
    in_flight = [0, 0]  # now, most at once

    async def body(core, committer, vol, inner):
        real_put = inner.put

        def slow_put(bucket, key, body, size):
            with lock:
                in_flight[0] += 1
                in_flight[1] = max(in_flight[1], in_flight[0])
            try:
                time.sleep(0.05)
                return real_put(bucket, key, body, size)
            finally:
                with lock:
                    in_flight[0] -= 1

        monkeypatch.setattr(inner, "put", slow_put)
        for i in range(8):
            fh, _ = await core.create(vol, f"out{i}", CREATE)
            await core.write(fh, 0, b"output %d" % i)
            await core.flush(fh)
            await core.release(fh)
        await committer.fsync_tree(core.node(vol))
        assert sorted(inner.buckets["bucket"]) == [f"pfx/out{i}" for i in range(8)]

    _run(tmp_path, body)
    assert in_flight[1] > 1, in_flight


def _bytes(got) -> bytes:
    return b"".join(bytes(p) for p in got) if isinstance(got, tuple) else bytes(got)


def test_an_open_racing_an_unlink_never_reads_the_version_before_the_last_close(tmp_path, monkeypatch):
    """The store holds v1; v2 is closed here and not committed yet (settling) when the file is
    unlinked. While the DELETE is on its way the kernel's dentry still leads to the inode: an open
    then reads v2, a lookup finds nothing, and once the unlink is done an open is ESTALE (the
    kernel looks the name up again). Reading v1, from the store or the disk cache, is a stale read
    the soak caught once the commit of v2 waited to settle."""
    monkeypatch.setattr(commit_mod, "COMMIT_SETTLE_S", 30.0)
    gate = threading.Event()
    entered = threading.Event()

    async def body(core, committer, vol, inner):
        inner.put_bytes("bucket", "pfx/f.bin", b"v1" * 1000)
        attrs = await core.lookup(vol, "f.bin")
        fh, _ = await core.open(attrs.ino, os.O_RDONLY)
        assert _bytes(await core.read(fh, 0, 2000)) == b"v1" * 1000  # v1 is in the disk cache now
        await core.release(fh)
        fh, _ = await core.open(attrs.ino, os.O_WRONLY | os.O_TRUNC)
        await core.write(fh, 0, b"v2" * 1000)
        await core.flush(fh)
        await core.release(fh)
        assert core.node(attrs.ino).staged.settling
        real_delete = inner.delete

        def held_delete(bucket, key):
            entered.set()
            gate.wait(10)
            real_delete(bucket, key)

        monkeypatch.setattr(inner, "delete", held_delete)
        async with trio.open_nursery() as n:
            n.start_soon(core.unlink, vol, "f.bin")
            with trio.fail_after(5):
                while not entered.is_set():
                    await trio.sleep(0.005)
            assert await core.lookup(vol, "f.bin") is None
            fh, _ = await core.open(attrs.ino, os.O_RDONLY)  # through the kernel's dentry
            assert _bytes(await core.read(fh, 0, 2000)) == b"v2" * 1000
            await core.release(fh)
            gate.set()
        with pytest.raises(OSError) as e:
            await core.open(attrs.ino, os.O_RDONLY)
        assert e.value.errno == errno.ESTALE
        assert "pfx/f.bin" not in inner.buckets["bucket"]

    _run(tmp_path, body)


def test_a_reader_opening_while_a_truncating_open_takes_the_file_aside_gets_estale_not_zeros(tmp_path,
                                                                                               monkeypatch):
    """v1 is closed and waiting for its commit when a writer opens the file with O_TRUNC: the open
    takes v1's staging file aside and starts an empty one, then records that in the journal. Until
    that open returns, the kernel still believes the file is v1's size, so a reader that opens
    meanwhile and reads it gets a short answer, which the kernel fills with zeros: bytes of no
    version. The soak caught that once the settling delay made such opens common. Such a read is
    ESTALE, as for a reader racing any truncate."""
    monkeypatch.setattr(commit_mod, "COMMIT_SETTLE_S", 30.0)
    v1 = b"1" * 39116
    entered, gate = trio.Event(), trio.Event()

    async def body(core, committer, vol, inner):
        fh, attrs = await core.create(vol, "f.bin", CREATE)
        await core.write(fh, 0, v1)
        await core.flush(fh)
        await core.release(fh)
        assert core.node(attrs.ino).staged.settling
        real_restage = committer.journal.restage

        async def held_restage(*args):
            entered.set()
            await gate.wait()
            return await real_restage(*args)

        monkeypatch.setattr(committer.journal, "restage", held_restage)
        writer = []

        async def open_truncating():
            writer.append(await core.open(attrs.ino, os.O_WRONLY | os.O_TRUNC))

        async with trio.open_nursery() as n:
            n.start_soon(open_truncating)
            with trio.fail_after(5):
                await entered.wait()
            rfh, _ = await core.open(attrs.ino, os.O_RDONLY)  # its size, to the kernel: v1's
            with pytest.raises(OSError) as e:
                await core.read(rfh, 0, len(v1))
            assert e.value.errno == errno.ESTALE
            gate.set()
        with pytest.raises(OSError) as e:  # and after the open returned, for the handle opened before
            await core.read(rfh, 0, len(v1))
        assert e.value.errno == errno.ESTALE
        await core.release(rfh)
        (wfh, _), = writer
        await core.write(wfh, 0, b"v2")
        await core.flush(wfh)
        await core.release(wfh)

    inner = _run(tmp_path, body)
    assert inner.get("bucket", "pfx/f.bin")[0] == b"v2"
