"""Races between readers and writers on one host that the soak (test_soak.py) found, each pinned down
by a small test of its own (README "Semantics": Reads, Writes).
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time

from tests.support import foreign_page, fsync_path, sync_dir, wait_until

KiB = 1 << 10
MiB = 1 << 20


def test_a_directory_read_after_a_commit_does_not_bring_back_the_old_version(mount):
    """readdir lists the names taken at opendir; the attributes it hands the kernel must still be the
    newest we know, or a later open reads the old version from the cache."""
    p = mount.path() / "k.bin"
    p.write_bytes(b"version 1")
    fsync_path(p)
    assert p.read_bytes() == b"version 1"
    it = os.scandir(mount.path())  # opendir: the snapshot of names is taken now
    with open(p, "wb") as f:
        f.write(b"version 2")
        f.flush()
        os.fsync(f.fileno())
    assert [e.name for e in it] == ["k.bin"]  # readdir, after the commit
    it.close()
    assert p.read_bytes() == b"version 2"


def test_unlink_after_a_replacing_rename_leaves_nothing_behind(mount, s3, bucket, prefix):
    """`write tmp; mv tmp f; rm f` before tmp's commit: the object f had before must go too, or it
    comes back once the listing is refreshed."""
    v = mount.path()
    (v / "f.txt").write_bytes(b"old, committed")
    fsync_path(v / "f.txt")
    (v / "tmp").write_bytes(b"new, not yet committed")
    os.rename(v / "tmp", v / "f.txt")
    os.unlink(v / "f.txt")
    sync_dir(v)
    time.sleep(1.5)  # past the metadata TTL: what we see now comes from the store
    assert not (v / "f.txt").exists()
    assert s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/vol/").get("KeyCount", 0) == 0


def test_a_new_open_after_a_local_rewrite_reads_the_new_version_whatever_old_handles_do(mount):
    """An old handle must not put its version back into the kernel's page cache that new opens share."""
    p = mount.path() / "v.bin"
    old, new = os.urandom(6 * MiB), os.urandom(6 * MiB)
    p.write_bytes(old)
    fsync_path(p)
    with open(p, "rb", buffering=0) as f:
        assert f.read(MiB) == old[:MiB]
        with open(p, "wb") as w:
            w.write(new)
            w.flush()
            os.fsync(w.fileno())
        assert p.read_bytes() == new
        try:
            rest = f.read()  # the old handle: the new bytes, or ESTALE; never a mix with zeros
            assert all(rest[i:i + 4096] in (old[MiB + i:MiB + i + 4096], new[MiB + i:MiB + i + 4096])
                       for i in range(0, len(rest), 4096))
        except OSError as e:
            assert e.errno == errno.ESTALE
        assert p.read_bytes() == new


def test_readers_racing_a_shrinking_rewrite_never_see_zeros(mount):
    """A file rewritten shorter (O_TRUNC) while others read it: they see old bytes, new bytes or
    ESTALE - not the zeros the kernel puts where a read comes back short."""
    p = mount.path() / "s.bin"
    versions = [random.Random(i).randbytes(4096) * n for i, n in enumerate([2048, 16, 1536, 8, 2048, 24])]
    p.write_bytes(versions[0])
    stop = threading.Event()
    problems: list[str] = []
    counts = {"reads": 0, "estale": 0}

    def reader() -> None:
        while not stop.is_set():
            try:
                with open(p, "rb", buffering=0) as f:
                    data = b"".join(iter(lambda: f.read(MiB), b""))
            except OSError as e:
                if e.errno != errno.ESTALE:
                    problems.append(repr(e))
                counts["estale"] += 1
                continue
            counts["reads"] += 1
            off = foreign_page(data, versions)
            if off is not None:
                piece = data[off:off + 4096]
                what = "zeros" if piece.count(0) == len(piece) else "unknown bytes"
                problems.append(f"{what} at {off} of {len(data)}")
                return

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 8
    i = 0
    while time.monotonic() < deadline and not problems:
        i += 1
        p.write_bytes(versions[i % len(versions)])
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not problems, problems[:5]
    assert counts["reads"] > 10
    assert wait_until(lambda: mount.status()["commits"]["pending"] == 0, timeout=60)
