"""Bad input through a real mount (README "Semantics": Namespace, Reads, Durability; issue 5 "Bad input").

Names and keys that are too long, files larger than the store allows, a full cache disk, damaged cache
blocks, a damaged commit journal and malformed catalogs: each gets a clear error, and none of them
loses data that was already promised (closed) or serves bytes that are not the object's.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import REPO, keys, mount_refused, obj, staging_files, sync_dir, wait_until

MiB = 1 << 20
KiB = 1 << 10
TiB = 1 << 40


def errno_of(fn) -> int | None:
    try:
        fn()
    except OSError as e:
        return e.errno
    return None


# --------------------------------------------------------------------------------------------------
# Names, keys and sizes


def test_names_over_255_bytes_are_enametoolong(mount, s3, bucket, prefix):
    v = mount.path()
    long_ascii = "n" * 256
    long_utf8 = "é" * 128  # 128 characters, 256 bytes: the limit is in bytes
    for name in (long_ascii, long_utf8):
        assert errno_of(lambda: os.stat(v / name)) == errno.ENAMETOOLONG
        assert errno_of(lambda: open(v / name, "wb")) == errno.ENAMETOOLONG
        assert errno_of(lambda: os.mkdir(v / name)) == errno.ENAMETOOLONG
    (v / "ok.txt").write_bytes(b"x")
    assert errno_of(lambda: os.rename(v / "ok.txt", v / long_ascii)) == errno.ENAMETOOLONG
    (v / ("m" * 255)).write_bytes(b"255 bytes is fine")
    sync_dir(v)
    assert keys(s3, bucket, f"{prefix}/vol/") == sorted([f"{prefix}/vol/ok.txt", f"{prefix}/vol/{'m' * 255}"])


def test_a_name_that_is_not_utf8_does_not_exist_and_cannot_be_made(mount):
    """Object keys are UTF-8: no object can have such a name, so looking it up is ENOENT (not EIO
    with a traceback in the log), and making one is EINVAL."""
    v = os.fsencode(mount.path())
    for path in (v + b"/\xff", v + b"/sub\xe9.txt"):
        assert errno_of(lambda: os.stat(path)) == errno.ENOENT
        assert errno_of(lambda: open(path, "wb")) == errno.EINVAL
    assert "Traceback" not in mount.log_path.read_text(errors="replace")


def test_keys_over_1024_bytes_are_enametoolong_and_never_half_made(mount, s3, bucket, prefix):
    v = mount.path()
    base = f"{prefix}/vol/"
    seg = "d" * 200
    # Directories nest until the key (bucket prefix included) would pass 1,024 bytes.
    path, depth = v, 0
    while len((base + "/".join([seg] * (depth + 1)) + "/").encode()) <= 1024:
        path = path / seg
        path.mkdir()
        depth += 1
    assert errno_of(lambda: (path / seg).mkdir()) == errno.ENAMETOOLONG
    room = 1024 - len((base + "/".join([seg] * depth) + "/").encode())
    assert errno_of(lambda: open(path / ("f" * (room + 1)), "wb")) == errno.ENAMETOOLONG
    (path / ("f" * room)).write_bytes(b"exactly 1024")  # the longest key there is
    # Renaming a directory to a longer name would push that file's key over the limit: refused
    # before anything moves, so the store never holds half a renamed tree.
    top = v / seg
    (top / "other.txt").write_bytes(b"other")
    sync_dir(v)
    before = keys(s3, bucket, base)
    assert errno_of(lambda: os.rename(top, v / (seg + "x"))) == errno.ENAMETOOLONG
    sync_dir(v)
    assert keys(s3, bucket, base) == before
    assert max(len(k.encode()) for k in before) == 1024
    assert (path / ("f" * room)).read_bytes() == b"exactly 1024"


def test_a_file_larger_than_the_store_allows_is_efbig(mount_factory, s3, bucket, prefix):
    # Writes that reach the daemon (test_passthrough.py has those the kernel writes past it).
    mount = mount_factory(args=("--no-passthrough",))
    p = mount.path() / "huge.bin"
    fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, b"head")
        # pwrite beyond 5 TiB costs nothing locally (the staging file would be sparse) but could
        # never be committed: refused at once.
        assert errno_of(lambda: os.pwrite(fd, b"x", 5 * TiB)) == errno.EFBIG
        assert errno_of(lambda: os.ftruncate(fd, 5 * TiB + 1)) == errno.EFBIG
        assert errno_of(lambda: os.truncate(p, 6 * TiB)) == errno.EFBIG
    finally:
        os.close(fd)
    assert os.stat(p).st_size == 4
    sync_dir(mount.path())
    assert obj(s3, bucket, f"{prefix}/vol/huge.bin") == b"head"
    assert mount.status()["commits"]["failed"] == 0


# --------------------------------------------------------------------------------------------------
# A full cache disk


@pytest.fixture
def small_disk(tmp_path):
    """A 48 MiB tmpfs of our own to fill up (root only)."""
    d = tmp_path / "smalldisk"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,mode=0700", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield d
    subprocess.run(["umount", "-l", str(d)], capture_output=True)


def fill(path: Path) -> int:
    """Write to `path` until the disk is full; returns the bytes written."""
    n = 0
    chunk = b"\0" * MiB
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                n += f.write(chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                break
        for size in (64 * KiB, 4 * KiB, 512):
            while True:
                try:
                    n += f.write(b"\0" * size)
                except OSError:
                    break
    return n


def test_a_full_cache_disk_refuses_new_writes_keeps_closed_files_and_reads_uncached(
        fault_proxy, small_disk, mount_factory, s3, bucket, prefix):
    state = small_disk / "state"
    m = mount_factory(args=("--cache-dir", str(state), "--min-free", "8M", "--cache-size", "1G"),
                      endpoint=fault_proxy.endpoint)
    v = m.path()
    big = os.urandom(20 * MiB)  # more than the disk has room for once it is full
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/big.bin", Body=big)
    # Closed files whose commits cannot happen yet: the store refuses writes for now.
    hold = fault_proxy.fail(503, method="PUT|POST")
    closed = {f"c{i}.bin": os.urandom(512 * KiB + i) for i in range(6)}
    for name, data in closed.items():
        (v / name).write_bytes(data)
    assert m.status()["commits"]["pending"] == len(closed)

    filled = fill(small_disk / "filler")
    # New writes are refused with ENOSPC (at open, or at the first write).
    def new_write():
        with open(v / "new.bin", "wb") as f:
            f.write(os.urandom(MiB))
    assert errno_of(new_write) == errno.ENOSPC
    # Closed files are still there, read back from staging.
    for name, data in closed.items():
        assert (v / name).read_bytes() == data
    # Reads go on, served without the cache.
    skipped_before = m.status()["cache"].get("skipped", 0)
    assert (v / "big.bin").read_bytes() == big
    cache = m.status()["cache"]
    assert cache.get("skipped", 0) > skipped_before
    assert os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize < 8 * MiB

    # Room again and the store back: every closed file is committed, and new writes work.
    os.unlink(small_disk / "filler")
    hold.disable()
    (v / "after.bin").write_bytes(b"room again")
    sync_dir(v)
    for name, data in closed.items():
        assert obj(s3, bucket, f"{prefix}/vol/{name}") == data
    assert obj(s3, bucket, f"{prefix}/vol/after.bin") == b"room again"
    print(f"\n[bad input] full disk: filled {filled / MiB:.1f} MiB; {len(closed)} closed files kept; "
          f"cache {cache}")


def test_a_disk_filling_under_a_streaming_writer_is_enospc_and_the_mount_lives_on(
        fault_proxy, small_disk, mount_factory, s3, bucket, prefix):
    """The staging disk fills while a large file is being written, its upload already streaming:
    the journal (on the same disk) cannot record the upload either. The writer gets ENOSPC; the
    daemon must not die of the journal's failure (it did: every file of the mount was gone, closed
    ones waiting for their commits included), and writing works again once there is room."""
    m = mount_factory(args=("--cache-dir", str(small_disk / "state"), "--min-free", "8M"),
                      endpoint=fault_proxy.endpoint)
    v = m.path()
    (v / "before.bin").write_bytes(b"closed before")
    # The stream's upload is created slowly: the disk is full by the time its id is to be recorded.
    fault_proxy.stall(3.0, method="POST", path=r"\?uploads")
    fd = os.open(v / "big.bin", os.O_CREAT | os.O_WRONLY | os.O_TRUNC)
    try:
        def fill_it():
            for _ in range(64):
                os.write(fd, os.urandom(MiB))
        assert errno_of(fill_it) == errno.ENOSPC
        # Full for the journal too: the room it keeps for itself is taken as well.
        (small_disk / "state" / "journal.sqlite3.reserve").unlink(missing_ok=True)
        fill(small_disk / "filler")
        status = subprocess.run([sys.executable, "-m", "ucfs", "status", str(m.mountpoint)], capture_output=True,
                                text=True, timeout=60, cwd=REPO)
        assert "staging disk full" in status.stdout and "ENOSPC" in status.stdout, status.stdout  # says why
        time.sleep(4)  # the upload's creation answers meanwhile
        assert m.proc.poll() is None, m.log_tail()
        assert errno_of(lambda: os.fsync(fd)) == errno.ENOSPC  # not EIO: the journal's disk is full
    finally:
        closed = errno_of(lambda: os.close(fd))
    assert closed == errno.ENOSPC
    assert m.proc.poll() is None, m.log_tail()
    assert (v / "before.bin").read_bytes() == b"closed before"
    fault_proxy.clear()
    os.unlink(v / "big.bin")  # room again
    os.unlink(small_disk / "filler")
    assert wait_until(lambda: "staging disk full" not in subprocess.run(
        [sys.executable, "-m", "ucfs", "status", str(m.mountpoint)], capture_output=True, text=True, timeout=60,
        cwd=REPO).stdout, timeout=20)
    (v / "after.bin").write_bytes(b"room again")
    sync_dir(v)
    assert obj(s3, bucket, f"{prefix}/vol/before.bin") == b"closed before"
    assert obj(s3, bucket, f"{prefix}/vol/after.bin") == b"room again"
    log = m.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "cannot rollback" not in log


def test_files_waiting_for_their_commits_can_be_removed_and_renamed_on_a_full_disk(
        fault_proxy, small_disk, mount_factory, s3, bucket, prefix):
    """Closed files wait for their commits; then the staging disk fills up (a passthrough writer,
    another program). Removing or renaming one of them must be recorded in the journal, on that
    disk: rm failed with ENOSPC, and mv failed with ENOSPC after renaming the file all the same,
    its journal row left under the old name (so the next mount published it under both)."""
    m = mount_factory(args=("--cache-dir", str(small_disk / "state"), "--min-free", "8M"),
                      endpoint=fault_proxy.endpoint)
    v = m.path()
    hold = fault_proxy.fail(503, method="PUT|POST")
    files = {f"p{i}.bin": os.urandom(1000 + i) for i in range(40)}
    for name, data in files.items():
        (v / name).write_bytes(data)
    fill(small_disk / "filler")
    for i in range(0, 40, 2):
        assert errno_of(lambda: os.unlink(v / f"p{i}.bin")) is None, i
        assert errno_of(lambda: os.rename(v / f"p{i + 1}.bin", v / f"q{i + 1}.bin")) is None, i
    assert sorted(os.listdir(v)) == sorted(f"q{i}.bin" for i in range(1, 40, 2))
    hold.disable()
    m.kill()  # what the journal says is what the next mount publishes
    os.unlink(small_disk / "filler")
    m.start()
    sync_dir(v)
    assert keys(s3, bucket, f"{prefix}/vol/") == sorted(f"{prefix}/vol/q{i}.bin" for i in range(1, 40, 2))
    for i in range(1, 40, 2):
        assert obj(s3, bucket, f"{prefix}/vol/q{i}.bin") == files[f"p{i}.bin"]


def test_an_unlink_or_rename_the_full_journal_cannot_record_changes_nothing(fault_proxy, small_disk, mount_factory, s3,
                                                                   bucket, prefix):
    """The staging disk is full, the journal's own room taken too: an unlink or a rename of a file
    waiting for its commit cannot be recorded and fails (ENOSPC). It must then have changed nothing:
    after a failed unlink the file was left listed but never committed, and a second unlink
    succeeded with its row kept, so the next mount published the deleted file again."""
    m = mount_factory(args=("--cache-dir", str(small_disk / "state"), "--min-free", "8M"),
                      endpoint=fault_proxy.endpoint)
    v = m.path()
    hold = fault_proxy.fail(503, method="PUT|POST")
    data = os.urandom(5000)
    (v / "p.bin").write_bytes(data)
    fill(small_disk / "filler")
    (small_disk / "state" / "journal.sqlite3.reserve").unlink(missing_ok=True)
    fill(small_disk / "filler2")
    for _ in range(2):
        assert errno_of(lambda: os.unlink(v / "p.bin")) == errno.ENOSPC
        # A rename neither: it was done all the same, its row left under the old name.
        assert errno_of(lambda: os.rename(v / "p.bin", v / "q.bin")) == errno.ENOSPC
    assert os.listdir(v) == ["p.bin"]
    assert (v / "p.bin").read_bytes() == data
    os.unlink(small_disk / "filler")
    os.unlink(small_disk / "filler2")
    hold.disable()
    sync_dir(v)
    assert obj(s3, bucket, f"{prefix}/vol/p.bin") == data  # still the file it was: committed
    os.unlink(v / "p.bin")
    m.kill()
    m.start()
    sync_dir(v)
    assert keys(s3, bucket, f"{prefix}/vol/") == []  # and gone for good once removed


def test_a_directory_rename_the_full_journal_cannot_record_changes_nothing(fault_proxy, small_disk, mount_factory,
                                                                          s3, bucket, prefix):
    """A directory holds files waiting for their commits; the staging disk is full, the journal's
    own room taken too. Renaming the directory copies what the store holds and then renames the
    files' journal rows: that fails (ENOSPC). It left the directory renamed inside the daemon while
    mv said it was not, the files committed under the new name once the store took them again and
    under the old one after a kill (their rows), and the copy standing under the new name. A
    failed rename must change nothing, in the store and the journal as in the mount."""
    m = mount_factory(args=("--cache-dir", str(small_disk / "state"), "--min-free", "8M"),
                      endpoint=fault_proxy.endpoint)
    v = m.path()
    (v / "d").mkdir()
    (v / "d" / "stored.txt").write_bytes(b"in the store already")
    sync_dir(v / "d")
    hold = fault_proxy.fail(503, method="PUT|POST", path=r"/p\d\.bin")  # not the directory's copies
    files = {f"p{i}.bin": os.urandom(3000 + i) for i in range(3)}
    for name, data in files.items():
        (v / "d" / name).write_bytes(data)
    fill(small_disk / "filler")
    (small_disk / "state" / "journal.sqlite3.reserve").unlink(missing_ok=True)
    fill(small_disk / "filler2")
    for _ in range(2):
        assert errno_of(lambda: os.rename(v / "d", v / "e")) == errno.ENOSPC
    assert os.listdir(v) == ["d"]
    assert sorted(os.listdir(v / "d")) == sorted([*files, "stored.txt"])
    for name, data in files.items():
        assert (v / "d" / name).read_bytes() == data
    assert keys(s3, bucket, f"{prefix}/vol/e") == []  # no copy left under the new name
    assert "rename of /test/s/vol/d to /test/s/vol/e undone" in m.log_tail(400), m.log_tail()
    os.unlink(small_disk / "filler")
    os.unlink(small_disk / "filler2")
    m.kill()  # what the journal says is what the next mount publishes
    m.start()
    hold.disable()
    sync_dir(v / "d")
    want = sorted(f"{prefix}/vol/d/{n}" for n in ("", "stored.txt", *files))
    assert keys(s3, bucket, f"{prefix}/vol/") == want
    for name, data in files.items():
        assert obj(s3, bucket, f"{prefix}/vol/d/{name}") == data
    # Renamed once there is room, the journal says the new names: a kill before the commits
    # publishes them there, and nothing is left under the old ones.
    hold.enable()
    for name, data in files.items():
        (v / "d" / name).write_bytes(data[::-1])
    os.rename(v / "d", v / "e")
    m.kill()
    hold.disable()
    m.start()
    sync_dir(v / "e")
    assert keys(s3, bucket, f"{prefix}/vol/") == sorted(f"{prefix}/vol/e/{n}" for n in ("", "stored.txt", *files))
    for name, data in files.items():
        assert obj(s3, bucket, f"{prefix}/vol/e/{name}") == data[::-1]


def test_a_commit_the_full_staging_disk_holds_up_goes_on_once_there_is_room(
        fault_proxy, small_disk, mount_factory, s3, bucket, prefix):
    """A closed file large enough for a multipart upload, whose commit is retried while the staging
    disk is full: the upload cannot be recorded in the journal (same disk). That is a passing
    condition of this host, not the store refusing the file: the commit must go on by itself once
    there is room, not be reported failed for good until someone calls fsync."""
    m = mount_factory(args=("--cache-dir", str(small_disk / "state"), "--min-free", "8M"),
                      endpoint=fault_proxy.endpoint)
    v = m.path()
    hold = fault_proxy.fail(503, method="PUT|POST")
    data = os.urandom(17 * MiB)  # more than one PUT takes
    (v / "big.bin").write_bytes(data)
    assert wait_until(lambda: m.status()["commits"].get("retries", 0) >= 1, timeout=30)
    fill(small_disk / "filler")
    (small_disk / "state" / "journal.sqlite3.reserve").unlink(missing_ok=True)  # the journal's room too
    fill(small_disk / "filler2")
    hold.disable()
    # Retries meet the full disk now, and ucfs status says so.
    assert wait_until(lambda: "database or disk is full" in m.log_tail(400), timeout=60), m.log_tail()
    status = subprocess.run([sys.executable, "-m", "ucfs", "status", str(m.mountpoint)], capture_output=True,
                            text=True, timeout=60, cwd=REPO).stdout
    assert re.search(r"queued +/test/s/vol/big\.bin .*retrying after: .*disk is full", status) or \
        re.search(r"uploading +/test/s/vol/big\.bin .*retrying after: .*disk is full", status), status
    os.unlink(small_disk / "filler")
    os.unlink(small_disk / "filler2")
    assert wait_until(lambda: f"{prefix}/vol/big.bin" in keys(s3, bucket, prefix), timeout=90), \
        (m.status()["commits"], m.log_tail())
    assert obj(s3, bucket, f"{prefix}/vol/big.bin") == data
    assert m.status()["commits"]["failed"] == 0
    assert "failed permanently" not in m.log_path.read_text(errors="replace")


# --------------------------------------------------------------------------------------------------
# Damaged local state


def test_a_corrupted_cache_block_is_detected_and_fetched_again(mount, s3, bucket, prefix):
    data = os.urandom(12 * MiB + 5)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/c.bin", Body=data)
    assert (mount.path() / "c.bin").read_bytes() == data
    mount.stop()
    segments = sorted(p for p in (mount.state_dir / "cache" / "v3").glob("*/*") if not p.name.startswith("."))
    assert segments
    # Flip bytes in the data of every segment, and in the header of one.
    for seg in segments:
        with open(seg, "r+b") as f:
            f.seek(4096 + 1000)
            b = f.read(16)
            f.seek(4096 + 1000)
            f.write(bytes(x ^ 0xFF for x in b))
    with open(segments[0], "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xff")
    mount.start()
    assert (mount.path() / "c.bin").read_bytes() == data
    st = mount.status()
    assert st["cache"]["corrupt"] >= 1
    assert mount.store_stats().get("get", 0) >= 1  # fetched again
    # The good copies are written to the cache in the background: let them land before unmounting.
    assert wait_until(lambda: mount.status()["cache"]["blocks"] >= -(-len(data) // MiB), timeout=20)
    mount.stop()
    mount.start()
    assert (mount.path() / "c.bin").read_bytes() == data  # the good copy was cached in their place
    assert mount.store_stats().get("get", 0) == 0
    print(f"\n[bad input] corrupted cache: {len(segments)} segments damaged, {st['cache']['corrupt']} detected")


def test_a_cache_directory_that_refuses_writes_costs_only_the_caching(mount, s3, bucket, prefix):
    """The disk cache is an optimisation: where it cannot be written (here its directory is made
    immutable; in the field, a cache disk remounted read-only or failing), reads are served from
    the store and commits succeed. A file of 1-64 MiB is cached after its commit, and an error
    there was taken for the commit's own: counted failed for good, though it was in the store."""
    v3 = mount.state_dir / "cache" / "v3"
    made = subprocess.run(["chattr", "+i", str(v3)], capture_output=True, text=True)
    if made.returncode != 0:  # needs CAP_LINUX_IMMUTABLE and a file system with the attribute
        pytest.skip(f"cannot make the cache directory immutable: {made.stderr.strip()}")
    try:
        data = os.urandom(3 * MiB + 7)
        s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/r.bin", Body=data)
        assert (mount.path() / "r.bin").read_bytes() == data
        written = os.urandom(2 * MiB + 3)
        p = mount.path() / "w.bin"
        with open(p, "wb") as w:
            w.write(written)
            reader = open(p, "rb")  # keeps the staged file (and any error of its commit) around
        try:
            assert wait_until(lambda: f"{prefix}/vol/w.bin" in keys(s3, bucket, prefix), timeout=30)
            assert obj(s3, bucket, f"{prefix}/vol/w.bin") == written
            time.sleep(0.5)  # the caching after the commit
            commits = mount.status()["commits"]
            assert commits["failed"] == 0 and commits["pending"] == 0, commits
            os.fsync(reader.fileno())  # no error of a commit that did not fail
            assert reader.read() == written
        finally:
            reader.close()
        assert "failed permanently" not in mount.log_tail(400)
    finally:
        subprocess.run(["chattr", "-i", str(v3)], check=True)
    assert mount.status()["cache"].get("puts", 0) == 0  # nothing was cached: the test made its point


def test_a_cache_segment_that_cannot_be_read_is_fetched_again(mount, s3, bucket, prefix):
    """A read error of the cache's disk (here: a segment that is a directory, so reading it fails
    with EISDIR; in the field, EIO from a bad sector) is damage like a bad checksum: the block is
    fetched from the store again, and the read does not fail."""
    data = os.urandom(6 * MiB + 11)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/u.bin", Body=data)
    assert (mount.path() / "u.bin").read_bytes() == data
    assert wait_until(lambda: mount.status()["cache"]["blocks"] >= 7, timeout=20)
    mount.stop()
    segments = [p for p in (mount.state_dir / "cache" / "v3").glob("*/*") if not p.name.startswith(".")]
    assert segments
    for seg in segments:
        seg.unlink()
        seg.mkdir()
    mount.start()
    assert (mount.path() / "u.bin").read_bytes() == data
    assert mount.store_stats().get("get", 0) >= 1


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_damaged_journal_is_a_clear_message_and_staged_data_is_kept(fault_proxy, mount_factory, s3, bucket,
                                                                       prefix, damage):
    m = mount_factory(endpoint=fault_proxy.endpoint)
    v = m.path()
    fault_proxy.fail(503, method="PUT|POST")  # commits stay pending
    files = {f"j{i}.bin": os.urandom(100 * KiB + i) for i in range(10)}
    for name, data in files.items():
        (v / name).write_bytes(data)
    assert m.status()["commits"]["pending"] == len(files)
    m.kill()  # the daemon dies with every commit pending
    fault_proxy.clear()
    journal = m.state_dir / "journal.sqlite3"
    staging = m.state_dir / "staging"
    # Fold the write-ahead log in first, as a clean sqlite would, so the damage hits the records.
    import sqlite3
    db = sqlite3.connect(journal)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    size = journal.stat().st_size
    with open(journal, "r+b") as f:
        if damage == "garbage":
            f.seek(0)
            f.write(os.urandom(200))  # the header and the start of the first page
        else:
            f.truncate(size // 2 + 100)  # cut in the middle of a page
    def staged_data():  # empty staging files the daemon made ahead of time hold nothing
        return {p.name: p.read_bytes() for p in staging_files(staging)}

    staged_before = staged_data()
    assert sorted(staged_before.values()) == sorted(files.values())

    with pytest.raises(RuntimeError) as e:
        m.start(timeout=60)
    message = str(e.value)
    assert "journal" in message and str(journal) in message, message
    assert "staging" in message  # says where the data is
    assert m.proc is not None and m.proc.returncode == 1
    assert "Traceback" not in m.log_path.read_text()
    # Nothing was deleted or moved.
    assert staged_data() == staged_before
    m.proc = None

    # Doing what the message says recovers everything by hand: the files wait in orphans/.
    journal.rename(journal.with_suffix(".sqlite3.damaged"))
    for extra in ("journal.sqlite3-wal", "journal.sqlite3-shm"):
        (m.state_dir / extra).unlink(missing_ok=True)
    m.start()
    orphans = {p.read_bytes() for p in (m.state_dir / "orphans").iterdir()}
    assert orphans == set(files.values())
    print(f"\n[bad input] {damage} journal: {len(files)} staged files kept; message: {message.splitlines()[-1]}")


# --------------------------------------------------------------------------------------------------
# Malformed catalogs


GOOD = """\
[stores.s]
endpoint_url = "http://127.0.0.1:1"

[volumes."a.b.cd"]
location = "s3://bucket/cd"
store = "s"

"""

CATALOGS = {
    # name: (catalog text, line the message must name, words it must contain)
    "toml syntax": (GOOD + '[volumes."a.b.c"]\nlocation = "s3://bucket/x\n', 9, "TOML"),
    "unknown volume key": (GOOD + '[volumes."a.b.c"]\nlocation = "s3://b/x"\nstore = "s"\nreadonly = true\n',
                           11, "readonly"),
    "read_only not a bool": (GOOD + '[volumes."a.b.c"]\nlocation = "s3://b/x"\nstore = "s"\nread_only = "yes"\n',
                             11, "read_only"),
    "unknown user": (GOOD + '[volumes."a.b.c"]\nlocation = "s3://b/x"\nstore = "s"\n'
                            'writers = ["no-such-user-ucfs"]\n', 11, "no-such-user-ucfs"),
    "missing store": (GOOD + '[volumes."a.b.c"]\nlocation = "s3://b/x"\nstore = "nope"\n', 10, "nope"),
    "no location": (GOOD + '[volumes."a.b.c"]\nstore = "s"\n', 8, "location"),
    "bad volume name": (GOOD + '[volumes."a.b"]\nlocation = "s3://b/x"\n', 8, "catalog.schema.volume"),
    "relative path": (GOOD + '[volumes."a.b.c"]\nlocation = "data/x"\n', 9, "absolute"),
    "store key type": ('[stores.s]\nendpoint_url = 9000\n\n[volumes."a.b.c"]\nlocation = "s3://b/x"\n'
                       'store = "s"\n', 2, "endpoint_url"),
    "store named local": ('[stores.local]\nendpoint_url = "http://127.0.0.1:1"\n\n[volumes."a.b.c"]\n'
                          'location = "s3://b/x"\nstore = "local"\n', 1, "reserved"),
    # No [stores] table named local may exist, so the message must not ask for one.
    "s3 volume on the local store": (GOOD + '[volumes."a.b.c"]\nlocation = "s3://b/x"\nstore = "local"\n', 10,
                                     "built-in store of volumes on local directories"),
    "not utf-8": (GOOD.encode() + b'[volumes."a.b.c"]\nlocation = "s3://b/\xff"\n', 9, "UTF-8"),
    # Refused at mount time, as "Port out of range 0-65535" or "unsupported endpoint", with no file or line.
    "endpoint port out of range": ('[stores.s]\nregion = "r"\nendpoint_url = "http://127.0.0.1:99999"\n\n'
                                   '[volumes."a.b.c"]\nlocation = "s3://b/x"\nstore = "s"\n', 3, "port"),
    "endpoint without scheme": ('[stores.s]\nendpoint_url = "127.0.0.1:9000"\n\n[volumes."a.b.c"]\n'
                                'location = "s3://b/x"\nstore = "s"\n', 2, "http://"),
}


@pytest.mark.parametrize("case", sorted(CATALOGS))
def test_a_malformed_catalog_is_one_message_naming_file_and_line(tmp_path, case):
    text, line, words = CATALOGS[case]
    cat = tmp_path / "bad catalog.toml"  # a space in the name, to be sure it is quoted whole
    cat.write_bytes(text if isinstance(text, bytes) else text.encode())
    r = mount_refused(tmp_path, cat)
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr  # one message, no traceback
    assert lines[0].startswith(f"ucfs: {cat}:{line}: "), lines[0]
    assert words in lines[0], lines[0]
    assert not (tmp_path / "state").exists()  # refused before anything was made


def test_no_credentials_at_all_is_one_message_saying_so_not_access_denied(tmp_path):
    """With no credentials anywhere, the mount said "access to bucket 'b' denied at <endpoint>
    (check credentials)", even for an endpoint that nothing listens on: no request had been sent."""
    port = socket.socket()
    port.bind(("127.0.0.1", 0))  # bound, never listening: a request to it would be refused
    url = f"http://127.0.0.1:{port.getsockname()[1]}"
    cat = tmp_path / "catalog.toml"
    cat.write_text(f'[stores.s]\nendpoint_url = "{url}"\n\n[volumes."a.b.c"]\nlocation = "s3://b/x"\nstore = "s"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(HOME=str(tmp_path), AWS_EC2_METADATA_DISABLED="true")  # no ~/.aws, no instance role
    try:
        r = mount_refused(tmp_path, cat, env=env)
    finally:
        port.close()
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("ucfs: volume a.b.c: no AWS credentials found (AWS_ACCESS_KEY_ID"), lines[0]
    assert url in lines[0] and "denied" not in lines[0], lines[0]
    assert not os.path.ismount(tmp_path / "mnt")


@pytest.mark.parametrize("case", ["missing", "a file"])
def test_a_local_location_that_is_no_directory_is_one_message_saying_so(tmp_path, case):
    """A volume on a local directory that is missing, or a file: the message says which, about a
    directory (it spoke of a "bucket ... at local disk", and called the file missing)."""
    where = tmp_path / "data"
    if case == "a file":
        where.write_text("x")
    cat = tmp_path / "catalog.toml"
    cat.write_text(f'[volumes."a.b.c"]\nlocation = "{where}"\n')
    r = mount_refused(tmp_path, cat)
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    want = "is not a directory" if case == "a file" else "does not exist"
    assert lines[0].startswith("ucfs: volume a.b.c: ") and str(where) in lines[0] and want in lines[0], lines[0]
    assert "bucket" not in lines[0], lines[0]


# --------------------------------------------------------------------------------------------------
# Bad mount options


OPTIONS = {
    # name: (arguments, words the one message must contain); {file} is a regular file, {busy} a port in
    # use, {mnt} the mountpoint
    "cache size inf": (["--cache-size", "inf"], "not a size"),
    "memory budget 1e400": (["--memory-budget", "1e400"], "not a size"),
    "min free inf": (["--min-free", "infG"], "not a size"),
    "cache dir is a file": (["--cache-dir", "{file}"], "not a directory"),
    "cache dir under a file": (["--cache-dir", "{file}/sub"], "not a directory"),
    "cache dir in the mountpoint": (["--cache-dir", "{mnt}/state"], "inside the mountpoint"),  # hung
    "metrics port negative": (["--metrics-port", "-3"], "1 to 65535"),
    "metrics port too large": (["--metrics-port", "70000"], "1 to 65535"),  # was served on 70000 % 65536
    "metrics port in use": (["--metrics-port", "{busy}"], "in use"),
    "metadata ttl nan": (["--metadata-ttl", "nan"], "--metadata-ttl"),
    "metadata ttl negative": (["--metadata-ttl", "-1"], "--metadata-ttl"),
    "store timeout zero": (["--store-timeout", "0"], "--store-timeout"),
    "store timeout inf": (["--store-timeout", "inf"], "--store-timeout"),
    "stale if error negative": (["--stale-if-error", "-5"], "--stale-if-error"),
}


@pytest.mark.parametrize("daemon", [False, True], ids=["foreground", "daemon"])
@pytest.mark.parametrize("case", sorted(OPTIONS))
def test_a_bad_mount_option_is_one_message_and_no_mount(tmp_path, case, daemon):
    args, words = OPTIONS[case]
    data = tmp_path / "data"
    data.mkdir()
    cat = tmp_path / "catalog.toml"
    cat.write_text(f'[volumes."a.b.c"]\nlocation = "{data}"\n')
    afile = tmp_path / "afile"
    afile.write_text("x")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    mnt = tmp_path / "mnt"
    args = [a.format(file=afile, busy=busy.getsockname()[1], mnt=mnt) for a in args]
    if "--cache-dir" not in args:
        args += ["--cache-dir", str(tmp_path / "state")]
    try:
        r = subprocess.run([sys.executable, "-m", "ucfs", "mount", str(mnt), "--config", str(cat), *args,
                            *(() if daemon else ("--foreground",))],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
        mounted = os.path.ismount(mnt)
    finally:
        busy.close()
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
    assert not mounted, "the mount came up with this option"
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if " INFO " not in ln and " DEBUG " not in ln]
    assert len(lines) == 1 and lines[0].startswith("ucfs: "), r.stderr[-800:]  # one message, no traceback
    assert words in lines[0], lines[0]

