"""Renames and unlinks of files whose content is not simply "committed": committed by an fsync but
still staged, opened for writing but not yet written, being committed while their directory moves,
taken up from the journal after a crash, or killed right after an unlink.

In each case the promise is the same (README "Semantics": Writes, Durability): what was closed or
fsynced ends up in the store under the file's current name and nowhere else, and what was deleted
stays deleted, across a SIGKILL too.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import threading
import time

import pytest

from tests.support import fsync_path, keys, obj, sync_dir, wait_until

MiB = 1 << 20


def test_rename_of_a_stored_file_open_for_writing_keeps_it_in_the_store(mount, s3, bucket, prefix):
    """`mv f g` while f, a stored object, is open for writing but not yet written (an editor, a log
    opened r+): f is staged as a copy of the object that no close has recorded. The rename removes
    the old key, so that copy must be committed under the new one at once, not when the writer
    closes."""
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/f.txt", Body=b"existing content\n")
    v = mount.path()
    with open(v / "f.txt", "r+b"):
        os.rename(v / "f.txt", v / "g.txt")
        ok = wait_until(lambda: f"{prefix}/vol/g.txt" in keys(s3, bucket, f"{prefix}/vol/"), 10)
        assert ok, keys(s3, bucket, f"{prefix}/vol/")


def _fsynced_and_held_open(path):
    """Write path, fsync it (committed in place: durable in the store, no journal row) and close it;
    return a reader's handle, which keeps the file staged."""
    with open(path, "wb") as f:
        f.write(os.urandom(300_000))
        f.flush()
        os.fsync(f.fileno())
        return open(path, "rb")


def test_rename_of_an_fsynced_file_still_held_open_is_committed_under_the_new_name(mount_factory, s3, bucket, prefix):
    """write, fsync, close, rename, while another handle (a reader) still has the file open. The
    fsync committed the file in place, without a journal row; the rename takes the old key away, so
    the content must be journaled and committed under the new name.
    (--no-passthrough: a passthrough writer's close counts as a change, which would journal it anyway.)"""
    mount = mount_factory(args=("--no-passthrough",))
    v = mount.path()
    with _fsynced_and_held_open(v / "tmp.bin"):
        os.rename(v / "tmp.bin", v / "final.bin")
        ok = wait_until(lambda: f"{prefix}/vol/final.bin" in keys(s3, bucket, f"{prefix}/vol/"), 10)
        assert ok, (keys(s3, bucket, f"{prefix}/vol/"), mount.status()["commits"])


def test_rename_of_an_fsynced_file_survives_a_crash(mount_factory, s3, bucket, prefix):
    """The same, then a SIGKILL: the moved content was journaled under the new name, so the next
    mount has it there."""
    mount = mount_factory(args=("--no-passthrough",))
    v = mount.path()
    reader = _fsynced_and_held_open(v / "tmp.bin")
    os.rename(v / "tmp.bin", v / "final.bin")
    time.sleep(1)
    mount.kill()  # the reader's handle dies with the daemon
    with contextlib.suppress(OSError):
        reader.close()
    mount.start()
    assert (mount.path() / "final.bin").exists(), os.listdir(mount.path())  # fsynced data: never lost


def test_write_fsync_close_rename_of_a_mid_sized_file_is_committed(mount_factory, s3, bucket, prefix):
    """The atomic-save pattern (write tmp, fsync, close, rename) with no other handle. A file of 1 to
    64 MiB committed by fsync stays staged for a moment after its close, while its blocks are put in
    the cache (Committer._cache_committed_later): a rename right after the close finds it staged, and
    must commit it under the new name."""
    mount = mount_factory(args=("--no-passthrough",))
    v = mount.path()
    data = os.urandom(64 * MiB)
    for i in range(3):
        with open(v / f"tmp{i}", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(v / f"tmp{i}", v / f"final{i}")
    want = {f"{prefix}/vol/final{i}" for i in range(3)}
    ok = wait_until(lambda: want <= set(keys(s3, bucket, f"{prefix}/vol/")), 10)
    assert ok, (sorted(keys(s3, bucket, f"{prefix}/vol/")), mount.status()["commits"])


def test_directory_rename_while_a_file_beneath_is_open_for_writing_keeps_the_file(mount, s3, bucket, prefix):
    """A stored file opened for writing (not yet written) is staged as a copy of the object. The
    rename of its directory leaves its object to the commit of that copy (no server-side copy) and
    deletes the old key: so the copy must be committed under the new name at once."""
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/d/log.txt", Body=b"existing content\n")
    v = mount.path()
    f = open(v / "d" / "log.txt", "r+b")  # e.g. a log opened for append, an editor
    try:
        os.rename(v / "d", v / "d2")
        ok = wait_until(lambda: f"{prefix}/vol/d2/log.txt" in keys(s3, bucket, f"{prefix}/vol/"), 10)
        assert ok, keys(s3, bucket, f"{prefix}/vol/")
    finally:
        f.close()


def _write_out_of_order(path, data):
    """Not front to back: no stream, so close() queues a whole-file commit that runs afterwards."""
    with open(path, "wb") as f:
        f.seek(len(data) - MiB)
        f.write(data[-MiB:])
        f.seek(0)
        f.write(data[:-MiB])


def test_directory_rename_while_children_commit_loses_none_of_them(mount_factory, s3, bucket, prefix):
    """`mv d d2` while files beneath are being committed. The rename takes the files' commit locks
    one by one; a file whose commit finishes while it waits for another's is done and let go. Its
    object is then in the store under the old name, and must be moved like any committed file."""
    mount = mount_factory(args=("--no-passthrough",))
    v = mount.path()
    (v / "d").mkdir()
    big = os.urandom(160 * MiB)
    small = os.urandom(24 * MiB)
    _write_out_of_order(v / "d" / "big.bin", big)  # first in the committer's table; slow commit
    _write_out_of_order(v / "d" / "small.bin", small)  # commit in flight, done long before big's
    os.rename(v / "d", v / "d2")
    sync_dir(v)
    got = sorted(keys(s3, bucket, f"{prefix}/vol/"))
    assert f"{prefix}/vol/d2/small.bin" in got, got
    assert obj(s3, bucket, f"{prefix}/vol/d2/small.bin") == small
    assert (v / "d2" / "small.bin").read_bytes() == small


def test_unlink_of_a_replayed_overwrite_removes_the_old_object(fault_proxy, mount_factory, s3, bucket, prefix):
    """f is committed (v1), rewritten (v2), and the daemon killed before v2's commit. The next mount
    takes v2 up from the journal without asking the store what the key holds; `rm f` before the
    replayed commit must still delete v1, or it comes back once the listing is refreshed."""
    m = mount_factory(args=("--store-timeout", "2", "--no-passthrough"), endpoint=fault_proxy.endpoint)
    v = m.path()
    (v / "f.txt").write_bytes(b"version 1")
    fsync_path(v / "f.txt")
    outage = fault_proxy.fail(503, method="PUT|POST")  # commits retry (transient), nothing is lost
    (v / "f.txt").write_bytes(b"version 2")
    assert wait_until(lambda: outage.fired >= 1, 10)
    m.kill()
    m.start()
    assert (m.path() / "f.txt").read_bytes() == b"version 2"  # replayed, from staging
    os.unlink(m.path() / "f.txt")
    outage.disable()
    sync_dir(m.path())
    time.sleep(1.5)  # past the metadata TTL
    assert not (m.path() / "f.txt").exists()
    assert f"{prefix}/vol/f.txt" not in keys(s3, bucket, f"{prefix}/vol/"), obj(s3, bucket, f"{prefix}/vol/f.txt")


def test_a_file_unlinked_just_before_a_kill_stays_deleted(mount_factory):
    """A file closed (so journaled) and then unlinked: its journal row must be gone for good once
    unlink() returns, or a daemon killed right after brings the deleted file back, and uploads it, at
    the next mount."""
    m = mount_factory(args=("--no-passthrough",))
    back = []
    for i in range(5):
        v = m.path()
        fd = os.open(v / f"gone{i}", os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, b"x" * 1000)
        os.close(os.dup(fd))  # a close (flush): durable and journaled; still open, so not yet queued
        os.unlink(v / f"gone{i}")
        m.proc.send_signal(9)
        m.kill()
        with contextlib.suppress(OSError):
            os.close(fd)
        m.start()
        if (m.path() / f"gone{i}").exists():
            back.append(i)
    assert not back, f"deleted files back after a restart: {back}"


def _save_atomically(path, data: bytes) -> None:
    """What torch.save-then-replace and many libraries do: write a temp file, close it, os.replace
    it onto the final name."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        for i in range(0, len(data), MiB):
            f.write(data[i:i + MiB])
    os.replace(tmp, path)


def test_atomic_save_of_a_large_file_sends_its_bytes_once(mount_factory, s3, bucket, prefix):
    """A large file streams its parts under the temp name while it is written; the rename comes while
    its upload is finished (or just after). It used to give that upload up and send the whole file
    again under the new name (2x the bytes); the object is now copied on the server. A reader elsewhere
    sees nothing or the whole file under the final name, never a part, and the temp name goes.
    (--no-passthrough: the daemon sees the writes, so its stream keeps up with them.)"""
    m = mount_factory(args=("--no-passthrough",))
    data = os.urandom(80 * MiB + 7)
    key = f"{prefix}/vol/ckpt.pt"
    seen, stop = set(), threading.Event()

    def observe():
        while not stop.is_set():
            try:
                seen.add(s3.head_object(Bucket=bucket, Key=key)["ContentLength"])
            except s3.exceptions.ClientError:
                seen.add(None)
            time.sleep(0.02)

    watcher = threading.Thread(target=observe)
    watcher.start()
    try:
        before = m.store_stats().get("put_bytes", 0)
        _save_atomically(m.path() / "ckpt.pt", data)
        fsync_path(m.path() / "ckpt.pt")
        sent = m.store_stats().get("put_bytes", 0) - before
    finally:
        stop.set()
        watcher.join()
    assert hashlib.sha256(obj(s3, bucket, key)).digest() == hashlib.sha256(data).digest()
    assert wait_until(lambda: keys(s3, bucket, f"{prefix}/vol/") == [key], 10), keys(s3, bucket, f"{prefix}/vol/")
    assert sent < 1.2 * len(data), (sent / MiB, m.status()["commits"])
    assert seen <= {None, len(data)}, seen
    assert not s3.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/").get("Uploads")


def test_atomic_save_of_a_large_file_survives_a_kill_after_the_rename(mount_factory, s3, bucket, prefix):
    """Killed right after os.replace returned: the next mount has the file under its final name, in
    the store too, and nothing is left under the temp name (no object, no upload)."""
    m = mount_factory()
    data = os.urandom(64 * MiB + 3)
    _save_atomically(m.path() / "ckpt.pt", data)
    m.kill()
    m.start()
    assert (m.path() / "ckpt.pt").read_bytes() == data
    sync_dir(m.path())
    assert obj(s3, bucket, f"{prefix}/vol/ckpt.pt") == data
    assert keys(s3, bucket, f"{prefix}/vol/") == [f"{prefix}/vol/ckpt.pt"]
    assert not s3.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/").get("Uploads")


@pytest.mark.parametrize("close", ["dup", "mmap"])
def test_rename_after_its_directory_moved_twice_while_a_close_was_committed(mount_factory, s3, bucket, prefix,
                                                                             close):
    """A file held open for writing is closed once (a dup's close, or a map's), and its directory is
    renamed there and back while that close's commit runs. The commit gives way to each rename and
    starts again under the new name; then the file itself is renamed, and the commit restarted by
    that rename can finish under the file's new name before the rename's turn. The rename used to
    copy the "committed" object from the old name, where there was none: mv failed with ENOENT."""
    mount = mount_factory()
    v = mount.path()
    (v / "d").mkdir()
    data = bytearray(os.urandom(20 * MiB))
    fd = os.open(v / "d" / "f", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        patch = os.urandom(100_000)
        if close == "mmap":
            with mmap.mmap(fd, len(data)) as m:
                m[1000:1000 + len(patch)] = patch
        else:
            os.pwrite(fd, patch, 1000)
            os.close(os.dup(fd))
        data[1000:1000 + len(patch)] = patch
        os.rename(v / "d", v / "e")
        os.rename(v / "e", v / "d")
        more = os.urandom(50_000)
        os.pwrite(fd, more, 136_434)
        data[136_434:136_434 + len(more)] = more
        os.rename(v / "d" / "f", v / "g")
        os.fsync(fd)
    finally:
        os.close(fd)
    assert obj(s3, bucket, f"{prefix}/vol/g") == bytes(data)
    assert (v / "g").read_bytes() == bytes(data)
    assert f"{prefix}/vol/d/f" not in keys(s3, bucket, f"{prefix}/vol/")
