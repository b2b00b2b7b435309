"""Files being written in FUSE passthrough mode (ucfs/passthrough.py): the kernel writes them to
their staging files itself, and the daemon, which no longer sees the writes, must still commit exactly
what was written - rewrites of parts a stream already sent, truncates, mmap writes included.

These need a kernel that offers passthrough (Linux 6.9+); elsewhere they are skipped, and the rest
of the suite covers the write path as it is without it. The last test runs that path here too."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import subprocess
import sys
import time

import pytest

from tests.support import fsync_path, obj, sync_dir, wait_until

MiB = 1 << 20
TiB = 1 << 40


def _passthrough(m) -> dict:
    pt = m.status().get("passthrough") or {}
    if not pt.get("offered"):
        pytest.skip("this kernel does not offer FUSE passthrough (Linux 6.9+ with CONFIG_FUSE_PASSTHROUGH)")
    assert pt["active"], pt
    return pt


def _writes_seen(m) -> int:
    return m.status()["core"].get("writes", 0)


def test_a_large_file_is_written_past_the_daemon_and_committed_whole(mount, s3, bucket, prefix):
    _passthrough(mount)
    data = os.urandom(48 * MiB)
    src = mount.root / "src.bin"
    src.write_bytes(data)
    p = mount.path() / "big.bin"
    subprocess.run(["dd", f"if={src}", f"of={p}", "bs=1M", "status=none"], check=True)
    st = mount.status()
    assert st["core"].get("passthrough_opens", 0) == 1
    assert _writes_seen(mount) == 0  # not one write request reached the daemon
    text = subprocess.run([sys.executable, "-m", "ucfs", "status", str(mount.mountpoint)], capture_output=True,
                          text=True, check=True).stdout
    assert "passthrough writes: on (opens in this mode so far: 1)" in text, text
    assert os.stat(p).st_size == len(data)
    fsync_path(p)
    assert obj(s3, bucket, f"{prefix}/vol/big.bin") == data
    assert p.read_bytes() == data


def test_size_is_seen_while_a_passthrough_writer_writes(mount):
    _passthrough(mount)
    p = mount.path() / "growing.bin"
    with open(p, "wb") as f:
        f.write(b"x" * 300_000)
        f.flush()
        # Once the kernel's attributes have expired, stat asks the daemon, which did not see the
        # write and must look at the staging file.
        time.sleep(1.2)
        out = subprocess.run(["stat", "-c", "%s", str(p)], capture_output=True, text=True, check=True)
        assert int(out.stdout) == 300_000
        with open(p, "rb") as r:  # a reader while it is written: also in passthrough mode
            assert r.read() == b"x" * 300_000
            f.write(b"y" * 1000)
            f.flush()
            assert r.read() == b"y" * 1000
    assert mount.status()["core"].get("passthrough_opens", 0) == 2


def test_a_part_written_over_after_its_stream_sent_it_is_sent_again(mount, s3, bucket, prefix):
    _passthrough(mount)
    first = os.urandom(72 * MiB)
    patch = os.urandom(MiB)
    p = mount.path() / "rewritten.bin"
    with open(p, "wb") as f:
        f.write(first)
        f.flush()
        # The stream has sent the first parts of the file...
        assert wait_until(lambda: mount.status()["commits"].get("stream_parts", 0) >= 2, 60)
        # ...and now the writer goes back and writes over the start, which we cannot see.
        f.seek(0)
        f.write(patch)
    fsync_path(p)
    expected = patch + first[len(patch):]
    assert obj(s3, bucket, f"{prefix}/vol/rewritten.bin") == expected
    c = mount.status()["commits"]
    assert c.get("stream_parts_resent", 0) >= 1, c
    assert c.get("streamed", 0) == 1, c  # the stream was completed, with the part sent again


@pytest.mark.parametrize("size,sent", [(40 * MiB, {"create_multipart": 1, "upload_part": 5, "put": 0}),
                                       (4 * MiB, {"create_multipart": 0, "upload_part": 0, "put": 1}),
                                       (0, {"create_multipart": 0, "upload_part": 0, "put": 1})])
def test_a_file_fsynced_then_closed_unchanged_is_sent_once(mount, s3, bucket, prefix, size, sent):
    """DCP fsyncs each file it writes, closes it, and (torchio) fsyncs it again. Each of those counts
    as a change of a file we did not see written: the close sent 512 MiB files a second time."""
    _passthrough(mount)
    data = os.urandom(size)
    p = mount.path() / "shard.bin"
    before = mount.store_stats()
    with open(p, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(p)
    assert obj(s3, bucket, f"{prefix}/vol/shard.bin") == data
    after = mount.store_stats()
    assert {k: after.get(k, 0) - before.get(k, 0) for k in sent} == sent
    c = mount.status()["commits"]
    # The close found it unchanged itself: no local sync of the staging file, no journal row.
    assert c.get("closed_unchanged", 0) == 1 and c.get("commits_unchanged", 0) == 1, c


def test_a_change_that_keeps_the_size_after_an_fsync_is_still_sent(mount, s3, bucket, prefix):
    """What lets an unchanged file go unsent is its content, read back and compared: not its size,
    nor its times, which a write through a mapping already dirty does not move."""
    _passthrough(mount)
    data = bytearray(os.urandom(40 * MiB))
    p = mount.path() / "patched.bin"
    with open(p, "r+b" if p.exists() else "w+b") as f:
        f.write(data)
        f.flush()
        with mmap.mmap(f.fileno(), 0) as m:
            m[20 * MiB:20 * MiB + 4] = b"one!"
            os.fsync(f.fileno())  # sends the file, "one!" included
            m[20 * MiB:20 * MiB + 4] = b"two!"
    data[20 * MiB:20 * MiB + 4] = b"two!"
    fsync_path(p)
    assert obj(s3, bucket, f"{prefix}/vol/patched.bin") == bytes(data)


def test_writing_further_on_first_is_not_streamed_and_commits_exactly(mount, s3, bucket, prefix):
    _passthrough(mount)
    data = os.urandom(64 * MiB)
    p = mount.path() / "tail-first.bin"
    with open(p, "wb") as f:
        f.seek(len(data) - MiB)
        f.write(data[-MiB:])
        f.flush()
        # Let the daemon look before the rest is written (it looks every 20 ms, and stat asks it
        # once the attributes have expired): it finds the file grown with a hole below its end.
        # Without the pause a fast writer may fill the hole before anyone looks, and then
        # streaming the file is right.
        time.sleep(1.2)
        subprocess.run(["stat", str(p)], capture_output=True, check=True)
        f.seek(0)
        f.write(data[:-MiB])
    fsync_path(p)
    assert obj(s3, bucket, f"{prefix}/vol/tail-first.bin") == data
    c = mount.status()["commits"]
    assert c.get("stream_parts", 0) == 0, c  # the hole below the end said: not front to back


def test_truncate_fsync_and_mmap_of_a_passthrough_file(mount, s3, bucket, prefix):
    _passthrough(mount)
    key = f"{prefix}/vol/edited.bin"
    p = mount.path() / "edited.bin"
    with open(p, "w+b") as f:
        f.write(b"a" * (3 * MiB))
        f.flush()
        os.fsync(f.fileno())  # reaches the daemon, which commits what it has not seen
        assert obj(s3, bucket, key) == b"a" * (3 * MiB)
        f.truncate(MiB)
        f.seek(0, os.SEEK_END)
        f.write(b"b" * 10)
        f.flush()
        with mmap.mmap(f.fileno(), 0) as m:
            m[0:4] = b"MMAP"
            m.flush()
        os.fsync(f.fileno())
        expected = b"MMAP" + b"a" * (MiB - 4) + b"b" * 10
        assert obj(s3, bucket, key) == expected
    assert p.read_bytes() == expected


@pytest.mark.parametrize("first", ["new", "truncated"])
def test_a_truncating_open_empties_a_file_a_passthrough_writer_holds(mount, s3, bucket, prefix, first):
    """O_TRUNC while another handle is writing past the daemon: the daemon's idea of the size is
    what it saw last (0 after the first open), not what that writer has written since. Found by a
    randomized differential run: the second open kept every byte."""
    _passthrough(mount)
    key = f"{prefix}/vol/held.bin"
    p = mount.path() / "held.bin"
    if first == "truncated":
        p.write_bytes(b"old" * 1000)
        fsync_path(p)
    w1 = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(w1, b"A" * 70_000)
        w2 = os.open(p, os.O_RDWR | os.O_TRUNC)
        try:
            assert os.fstat(w2).st_size == 0
            assert os.pread(w2, 16, 0) == b""
            os.close(w1)
            w1 = -1
            os.write(w2, b"B" * 10)
            os.fsync(w2)
            assert obj(s3, bucket, key) == b"B" * 10
        finally:
            os.close(w2)
    finally:
        if w1 >= 0:
            os.close(w1)
    assert p.read_bytes() == b"B" * 10


def test_a_file_open_for_reading_keeps_its_writer_out_of_passthrough(mount, s3, bucket, prefix):
    """The kernel refuses passthrough beside a page-cache open of the same inode (EIO): a reader of
    the committed object keeps a new writer on the daemon's path, and both work."""
    _passthrough(mount)
    key = f"{prefix}/vol/shared.bin"
    s3.put_object(Bucket=bucket, Key=key, Body=b"old" * 1000)
    p = mount.path() / "shared.bin"
    with open(p, "rb") as r:
        assert r.read(3) == b"old"
        with open(p, "wb") as w:
            w.write(b"new" * 1000)
        assert _writes_seen(mount) >= 1
        assert mount.status()["core"].get("passthrough_opens", 0) == 0
    fsync_path(p)
    assert obj(s3, bucket, key) == b"new" * 1000


def test_a_writer_that_drops_o_direct_for_a_short_block_is_not_refused(mount, s3, bucket, prefix):
    """GNU dd oflag=direct writes whole blocks with O_DIRECT and clears the flag (fcntl F_SETFL)
    for a short last block, and any program may do the same for an unaligned write or read. The
    kernel opens a passthrough file's backing file with the flags of the open, and F_SETFL does not
    reach it: that last write failed with EINVAL, dd exited 1, and the file was committed without
    its tail. An O_DIRECT open stays on the daemon's path, where the flag is the kernel's business
    alone. (Runs whether or not the kernel offers passthrough: either way dd must succeed.)"""
    data = os.urandom(5 * MiB + 12_345)
    src = mount.root / "src.bin"
    src.write_bytes(data)
    p = mount.path() / "direct.bin"
    r = subprocess.run(["dd", f"if={src}", f"of={p}", "bs=1M", "oflag=direct", "status=none"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert p.read_bytes() == data

    # The same by hand, reads included: aligned direct I/O, then unaligned I/O without the flag.
    q = mount.path() / "mixed.bin"
    fd = os.open(q, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        with mmap.mmap(-1, MiB) as buf:  # page-aligned, as O_DIRECT wants
            buf[:] = data[:MiB]
            assert os.pwrite(fd, buf, 0) == MiB
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        assert os.pwrite(fd, data[MiB:MiB + 777], MiB) == 777
        assert os.pread(fd, 1000, 333) == data[333:1333]
    finally:
        os.close(fd)
    assert q.read_bytes() == data[:MiB + 777]
    for name, want in (("direct.bin", data), ("mixed.bin", data[:MiB + 777])):
        fsync_path(mount.path() / name)
        assert obj(s3, bucket, f"{prefix}/vol/{name}") == want, name


def test_without_passthrough_every_write_goes_through_the_daemon(mount_factory, s3, bucket, prefix):
    m = mount_factory(args=("--no-passthrough",))
    data = os.urandom(40 * MiB)
    p = m.path() / "plain.bin"
    with open(p, "wb") as f:
        for i in range(0, len(data), MiB):
            f.write(data[i:i + MiB])
    fsync_path(p)
    assert obj(s3, bucket, f"{prefix}/vol/plain.bin") == data
    st = m.status()
    assert st["core"].get("passthrough_opens", 0) == 0
    assert st["core"].get("writes", 0) >= 40
    assert st["passthrough"]["active"] is False
    text = subprocess.run([sys.executable, "-m", "ucfs", "status", str(m.mountpoint)], capture_output=True,
                          text=True, check=True).stdout
    assert "passthrough writes: off" in text, text


def test_a_passthrough_write_past_the_largest_object_is_efbig_at_close(mount, s3, bucket, prefix):
    _passthrough(mount)
    p = mount.path() / "huge.bin"
    fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_TRUNC)
    os.write(fd, b"head")
    # The kernel writes the (sparse) staging file itself: nothing can refuse this write...
    os.pwrite(fd, b"x", 5 * TiB)
    # ...so close() says that the file can never be committed as it is,
    with pytest.raises(OSError) as e:
        os.close(fd)
    assert e.value.errno == errno.EFBIG
    # and it stays staged, to be cut back and committed.
    assert os.stat(p).st_size == 5 * TiB + 1
    os.truncate(p, 4)
    sync_dir(mount.path())
    assert obj(s3, bucket, f"{prefix}/vol/huge.bin") == b"head"
    assert mount.status()["commits"]["failed"] == 0


def test_refused_opens_leave_nothing_behind_on_the_wire(mount_factory, s3, bucket, prefix):
    """Each OPEN is noted on its way in until its reply goes out - an error reply too, or the notes
    would pile up until new opens could no longer be told apart."""
    m = mount_factory({"test.s.vol": {"prefix": f"{prefix}/vol"},
                       "test.s.ro": {"prefix": f"{prefix}/ro", "read_only": True}})
    _passthrough(m)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/ro/kept.txt", Body=b"kept")
    for _ in range(20):
        with pytest.raises(OSError) as e:
            open(m.path("test.s.ro") / "kept.txt", "r+b")
        assert e.value.errno == errno.EROFS
    (m.path() / "new.txt").write_bytes(b"new")
    assert (m.path() / "new.txt").read_bytes() == b"new"
    pt = m.status()["passthrough"]
    assert pt["opens_awaiting_reply"] == 0, pt
    assert pt["grants_waiting"] == 0, pt
    assert pt["opens"] >= 1, pt
    assert obj(s3, bucket, f"{prefix}/ro/kept.txt") == b"kept"
