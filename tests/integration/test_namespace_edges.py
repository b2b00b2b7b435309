"""Edges of the namespace and of the errno contract that a review found broken (README "Semantics":
Namespace, Reads). Each test failed before its fix.

Directories in an object store exist through a marker object or through what lies beneath them. A
local file system keeps a directory until `rmdir`, so the mount must too: whatever removes the last
thing beneath a directory gives it a marker.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import os
import subprocess
import time

import pytest

from tests.support import forget_unused_inodes, fsync_path, keys, obj, sync_dir, wait_until

libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
RENAME_WHITEOUT = 4
TTL = 1.5  # past the mount's metadata TTL (1 s)


def errno_of(fn) -> str | None:
    try:
        fn()
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
    return None


def test_renaming_a_directory_over_an_empty_one_keeps_it(mount, s3, bucket, prefix):
    v = mount.path()
    (v / "a").mkdir()
    (v / "b").mkdir()
    os.rename(v / "a", v / "b")
    assert keys(s3, bucket, f"{prefix}/vol/") == [f"{prefix}/vol/b/"]
    time.sleep(TTL)
    assert os.listdir(v) == ["b"]


def test_removing_the_last_file_of_a_prefix_only_directory_keeps_the_directory(mount, s3, bucket, prefix):
    """The usual S3 layout has no markers. `rm d/f` (d never listed) and `mv d2/f .` (d2 listed)
    each empty a directory that existed only through that file."""
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/d/f.txt", Body=b"x")
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/d2/f.txt", Body=b"y")
    v = mount.path()
    os.unlink(v / "d" / "f.txt")
    os.listdir(v / "d2")
    os.rename(v / "d2" / "f.txt", v / "g.txt")
    assert keys(s3, bucket, f"{prefix}/vol/") == [f"{prefix}/vol/{k}" for k in ("d/", "d2/", "g.txt")]
    time.sleep(TTL)
    assert sorted(os.listdir(v)) == ["d", "d2", "g.txt"]
    assert os.listdir(v / "d") == os.listdir(v / "d2") == []


def test_rmdir_sees_a_pending_file_in_a_subdirectory_without_a_marker(mount, s3, bucket, prefix):
    base = f"{prefix}/vol/"
    s3.put_object(Bucket=bucket, Key=base + "a/b/x.txt", Body=b"x")
    v = mount.path()
    with open(v / "a" / "b" / "new.txt", "wb") as f:
        f.write(b"pending data")
        os.rename(v / "a" / "b" / "x.txt", v / "top.txt")  # b now holds only the file being written
        assert errno_of(lambda: os.rmdir(v / "a")) == "ENOTEMPTY"
    sync_dir(v)
    assert f"{base}a/b/new.txt" in keys(s3, bucket, base)


@pytest.mark.parametrize("args", [(), ("--no-passthrough",)])
def test_a_handle_reads_back_what_it_truncated_itself(mount_factory, s3, bucket, prefix, args):
    """ESTALE is for handles that had the file's older size; ftruncate through a handle tells it."""
    m = mount_factory(args=args)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/c.txt", Body=b"0123456789")
    v = m.path()
    fd = os.open(v / "c.txt", os.O_RDWR)
    try:
        os.ftruncate(fd, 3)
        assert os.pread(fd, 100, 0) == b"012"
    finally:
        os.close(fd)
    with open(v / "q.txt", "w+b") as f:
        f.write(b"abcdefghij")
        f.flush()
        f.truncate(4)
        f.seek(0)
        assert f.read() == b"abcd"


def test_rename_flags_other_than_noreplace_are_refused(mount):
    v = mount.path()
    (v / "f.txt").write_bytes(b"f")
    r = libc.renameat2(AT_FDCWD, os.fsencode(v / "f.txt"), AT_FDCWD, os.fsencode(v / "h.txt"), RENAME_WHITEOUT)
    assert r == -1 and ctypes.get_errno() == errno.EINVAL
    assert os.listdir(v) == ["f.txt"]


def test_reading_a_file_deleted_elsewhere_is_estale(mount, s3, bucket, prefix):
    """The version an open handle reads is gone: as for a replaced one, the file changed under it."""
    key = f"{prefix}/vol/big.bin"
    s3.put_object(Bucket=bucket, Key=key, Body=os.urandom(24 << 20))
    fd = os.open(mount.path() / "big.bin", os.O_RDONLY)
    try:
        os.pread(fd, 1, 0)
        s3.delete_object(Bucket=bucket, Key=key)
        assert errno_of(lambda: os.pread(fd, 4096, 20 << 20)) == "ESTALE"
    finally:
        os.close(fd)


def test_an_older_directory_handle_never_brings_back_a_file_deleted_elsewhere(mount, s3, bucket, prefix):
    """A directory handle opened before a remote delete lists the old name; reading it after a newer
    listing saw the delete used to make the file exist again, with its old bytes from the disk cache."""
    key = f"{prefix}/vol/d/f.bin"
    s3.put_object(Bucket=bucket, Key=key, Body=b"1" * 100_000)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/d/other.bin", Body=b"x")
    d = mount.path() / "d"
    assert sorted(os.listdir(d)) == ["f.bin", "other.bin"]
    assert (d / "f.bin").read_bytes() == b"1" * 100_000
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        s3.delete_object(Bucket=bucket, Key=key)
        time.sleep(TTL)
        assert sorted(os.listdir(d)) == ["other.bin"]
        with os.scandir(dfd) as it:
            list(it)
        assert not (d / "f.bin").exists()
    finally:
        os.close(dfd)


def test_an_older_directory_handle_never_brings_back_a_version_replaced_elsewhere(mount, s3, bucket, prefix):
    """A directory too large to list again for one name has a lookup probe the name instead. The
    probe saw v2, but reading a directory handle opened before gave the file v1's attributes back
    from the listing it was opened with: the next open read v1 from the cache, after v2 was seen."""
    base = f"{prefix}/vol/d/"
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda i: s3.put_object(Bucket=bucket, Key=f"{base}f{i:04d}", Body=b"x"), range(1000)))
    v1, v2 = os.urandom(200 << 10), os.urandom(300 << 10)
    s3.put_object(Bucket=bucket, Key=base + "a.bin", Body=v1)
    d = mount.path() / "d"
    p = d / "a.bin"
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)  # its listing has v1
    try:
        assert p.read_bytes() == v1
        s3.put_object(Bucket=bucket, Key=base + "a.bin", Body=v2)
        time.sleep(TTL)
        assert os.stat(p).st_size == len(v2)  # a probe: 1,001 names are not listed for one lookup
        with os.scandir(dfd) as it:
            assert sum(1 for _ in it) == 1001
        assert p.read_bytes() == v2
    finally:
        os.close(dfd)


@pytest.mark.parametrize("renamed", ["file", "directory"])
def test_a_file_renamed_here_reads_on_through_handles_opened_before(mount, s3, bucket, prefix, renamed):
    """As on a local file system, for a file renamed alone or with its directory. Before, the next
    block not yet cached came from the old key, deleted by the rename: ESTALE."""
    size, at = (40 << 20, 30 << 20) if renamed == "file" else (24 << 20, 20 << 20)
    old, src, dst, new = (("a.bin", "a.bin", "b.bin", "b.bin") if renamed == "file"
                          else ("d/a.bin", "d", "e", "e/a.bin"))
    data = os.urandom(size)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/{old}", Body=data)
    v = mount.path()
    fd = os.open(v / old, os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 0) == data[:4096]
        os.rename(v / src, v / dst)
        assert os.pread(fd, 1 << 20, at) == data[at:at + (1 << 20)]
    finally:
        os.close(fd)
    if renamed == "file":
        assert keys(s3, bucket, f"{prefix}/vol/") == [f"{prefix}/vol/b.bin"]
    assert (v / new).read_bytes() == data


def test_an_old_handle_never_reads_the_newer_version_another_open_brought_in(mount, s3, bucket, prefix):
    """The kernel's page cache of a file is shared by all its handles. A handle opened on v1 read
    v2's bytes, with no error, once a later open had read v2 into it. While handles of an older
    version are open, a newer version is now read past the page cache."""
    key = f"{prefix}/vol/pc.bin"
    size = 48 << 20
    v1, v2 = b"\x01" * size, b"\x02" * size
    s3.put_object(Bucket=bucket, Key=key, Body=v1)
    p = mount.path() / "pc.bin"
    fd = os.open(p, os.O_RDONLY)
    try:
        assert os.pread(fd, 64 << 10, 0) == v1[:64 << 10]
        s3.put_object(Bucket=bucket, Key=key, Body=v2)
        time.sleep(TTL)
        assert p.read_bytes() == v2
        try:
            got = os.pread(fd, 1 << 20, 40 << 20)
        except OSError as e:  # the README allows this once v1's blocks are not cached
            assert e.errno == errno.ESTALE
        else:
            assert got == v1[40 << 20:41 << 20]
    finally:
        os.close(fd)
    assert p.read_bytes() == v2  # and once the old handle is gone, through the page cache again


@pytest.mark.parametrize("seen_by", ["stat", "fstat", "listdir"])
@pytest.mark.parametrize("new_size", [100 << 10, 12 << 20])
def test_a_version_replaced_elsewhere_reads_on_whole_through_handles_open_on_it(mount, s3, bucket, prefix,
                                                                               seen_by, new_size):
    """A handle open on v1 when another writer replaces it goes on reading v1 whole, as a file
    replaced under its name on a local file system does, and the name shows v2 within the TTL.
    Before, the kernel took v2's size for the one inode both shared: after a smaller v2 it ended
    the old handle's reads there, silently, without asking the daemon (a 4 MiB file read 1 MiB and
    then EOF). However the change is noticed: a stat of the path, an fstat of the old handle, a
    listing."""
    key = f"{prefix}/vol/d/r.bin"
    v1 = os.urandom(4 << 20)
    v2 = os.urandom(new_size)
    s3.put_object(Bucket=bucket, Key=key, Body=v1)
    p = mount.path() / "d" / "r.bin"
    fd = os.open(p, os.O_RDONLY)
    try:
        assert os.pread(fd, len(v1), 0) == v1
        ino = os.fstat(fd).st_ino
        s3.put_object(Bucket=bucket, Key=key, Body=v2)
        time.sleep(TTL)
        if seen_by == "stat":
            os.stat(p)
        elif seen_by == "fstat":
            assert os.fstat(fd).st_size == len(v1)  # the old handle's own file is v1
        else:
            assert "r.bin" in os.listdir(p.parent)
        assert wait_until(lambda: os.stat(p).st_size == len(v2), timeout=2 * TTL), os.stat(p)
        assert p.read_bytes() == v2
        assert os.pread(fd, len(v1), 0) == v1  # its blocks are cached: all of v1, not cut at v2's size
        assert os.fstat(fd).st_size == len(v1)
        assert os.stat(p).st_ino != ino
    finally:
        os.close(fd)
    assert p.read_bytes() == v2
    assert mount.status()["core"]["versions_superseded"] == 1


@pytest.mark.parametrize("seen_by", ["stat", "listdir"])
def test_a_version_replaced_elsewhere_keeps_the_one_new_inode_it_got(mount, s3, bucket, prefix, seen_by):
    """The lookup (or listing) that found v2 beside a handle of v1 gave the name a new inode, and
    also queued an invalidation of the name's dentry, which the kernel ran after its reply: it
    dropped the new inode's fresh dentry, forgot that inode, and the next stat gave the unchanged
    v2 yet another inode number (and lost its cached pages)."""
    key = f"{prefix}/vol/d/r.bin"
    v1, v2 = os.urandom(4 << 20), os.urandom(1 << 20)
    s3.put_object(Bucket=bucket, Key=key, Body=v1)
    p = mount.path() / "d" / "r.bin"
    fd = os.open(p, os.O_RDONLY)
    try:
        assert os.pread(fd, len(v1), 0) == v1
        s3.put_object(Bucket=bucket, Key=key, Body=v2)
        time.sleep(TTL)
        if seen_by == "stat":
            ino = os.stat(p).st_ino
        else:  # ls -i: the inode numbers of the listing (readdirplus), each name then stat'ed
            out = subprocess.run(["ls", "-li", str(p.parent)], capture_output=True, text=True, check=True)
            ino = int(next(line for line in out.stdout.splitlines() if line.endswith(" r.bin")).split()[0])
        assert ino != os.fstat(fd).st_ino
        time.sleep(0.5)  # the kernel has long run anything queued for it by then
        assert os.stat(p).st_ino == ino
        assert p.read_bytes() == v2
        assert os.stat(p).st_ino == ino
    finally:
        os.close(fd)


def test_a_directory_renamed_while_a_version_replaced_elsewhere_is_open_moves_whole(mount, s3, bucket, prefix):
    """A handle open on v1 of d/r.bin when another writer replaced it with v2: `mv d e` copied every
    object and then failed with ESTALE (mv's retry then said ENOTEMPTY), leaving them under both
    names. The rename tried to give the old handle a local copy of v1, read from the store, which
    holds v2 now; v1 was not the store's to move any more."""
    key = f"{prefix}/vol/d/r.bin"
    v1, v2 = os.urandom(24 << 20), os.urandom(1 << 20)
    s3.put_object(Bucket=bucket, Key=key, Body=v1)
    v = mount.path()
    fd = os.open(v / "d" / "r.bin", os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 0) == v1[:4096]
        s3.put_object(Bucket=bucket, Key=key, Body=v2)
        time.sleep(TTL)
        assert os.stat(v / "d" / "r.bin").st_size == len(v2)  # the name has v2's inode now
        os.rename(v / "d", v / "e")
        assert keys(s3, bucket, f"{prefix}/vol/") == [f"{prefix}/vol/e/", f"{prefix}/vol/e/r.bin"]
        assert os.pread(fd, 4096, 0) == v1[:4096]  # cached: the old handle reads on
        assert os.fstat(fd).st_size == len(v1)
    finally:
        os.close(fd)
    assert (v / "e" / "r.bin").read_bytes() == v2


@pytest.mark.parametrize("seen_by", ["read", "listdir"])
def test_a_file_deleted_elsewhere_reads_on_through_handles_open_on_it(mount, s3, bucket, prefix, seen_by):
    """A handle's cached blocks stay readable after the object is deleted elsewhere (README
    "Semantics": Reads), and fstat of it works, as for a file unlinked while open. Before, the
    first read once the attributes had expired failed with ENOENT: the kernel asks for the file's
    attributes before a read, and the daemon answered that getattr with the HEAD's ENOENT."""
    key = f"{prefix}/vol/d/r.bin"
    v1 = os.urandom(4 << 20)
    s3.put_object(Bucket=bucket, Key=key, Body=v1)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/d/other.bin", Body=b"x")
    p = mount.path() / "d" / "r.bin"
    fd = os.open(p, os.O_RDONLY)
    try:
        assert os.pread(fd, len(v1), 0) == v1
        s3.delete_object(Bucket=bucket, Key=key)
        time.sleep(TTL)
        if seen_by == "listdir":
            assert os.listdir(p.parent) == ["other.bin"]
        assert os.pread(fd, 4096, 1 << 20) == v1[1 << 20:(1 << 20) + 4096]
        assert os.fstat(fd).st_size == len(v1)
        assert not p.exists()
    finally:
        os.close(fd)
    assert not p.exists()


@pytest.mark.parametrize("op", ["unlink", "rename"])
def test_removing_files_by_name_costs_no_listing_each(mount_factory, s3, bucket, prefix, op):
    """Keeping a directory that lost an entry (a marker) asks the store only when nothing known
    beneath it is in the store."""
    for i in range(25):
        s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/d/f{i:03d}", Body=b"x")
    # A long TTL, so that what the names' lookups know stays fresh through the loop: once it
    # expires, each lookup asks the store again (a HEAD and a one-key LIST), and a loop slowed past
    # one second by a loaded machine counted those LISTs too (5 in one run of the whole suite).
    m = mount_factory(args=("--metadata-ttl", "60"))
    v = m.path()
    (v / "e").mkdir()
    for i in range(20):
        os.stat(v / "d" / f"f{i:03d}")
    before = m.store_stats()
    for i in range(20):
        if op == "unlink":
            os.unlink(v / "d" / f"f{i:03d}")
        else:
            os.rename(v / "d" / f"f{i:03d}", v / "e" / f"f{i:03d}")
    after = m.store_stats()
    assert after.get("list", 0) - before.get("list", 0) <= 2


def test_mknod_of_a_regular_file_makes_an_empty_file(mount, s3, bucket, prefix):
    v = mount.path()
    os.mknod(v / "empty.txt")  # mode 0: a regular file
    assert (v / "empty.txt").stat().st_size == 0
    for unstorable in (lambda: os.mkfifo(v / "fifo"), lambda: os.symlink("empty.txt", v / "sym"),
                       lambda: os.link(v / "empty.txt", v / "hard")):
        with pytest.raises(OSError) as e:
            unstorable()
        assert e.value.errno == errno.EPERM
    sync_dir(v)
    assert keys(s3, bucket, f"{prefix}/vol/") == [f"{prefix}/vol/empty.txt"]


def test_what_the_store_cannot_keep_is_eopnotsupp_and_the_usual_fallbacks_work(mount, s3, bucket, prefix):
    """Extended attributes, fallocate(2) and O_TMPFILE are refused with EOPNOTSUPP, the answer
    programs know to fall back from: glibc's posix_fallocate then writes the range itself, and the
    file it extended is committed at that size, zeros included."""
    v = mount.path()
    (v / "f.bin").write_bytes(b"head")
    refused = {
        "setxattr": lambda: os.setxattr(v / "f.bin", "user.origin", b"x"),
        "getxattr": lambda: os.getxattr(v / "f.bin", "user.origin"),
        "listxattr": lambda: os.listxattr(v / "f.bin"),
        "fallocate": lambda: subprocess.run(["fallocate", "-l", "1M", str(v / "f.bin")], check=True,
                                            capture_output=True),
        "O_TMPFILE": lambda: os.close(os.open(v, os.O_TMPFILE | os.O_WRONLY, 0o600)),
    }
    for what, call in refused.items():
        with pytest.raises((OSError, subprocess.CalledProcessError)) as e:
            call()
        if what == "fallocate":
            assert "Operation not supported" in e.value.stderr.decode(), e.value.stderr
        else:
            assert e.value.errno == errno.EOPNOTSUPP, what
    fd = os.open(v / "f.bin", os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, 100_000)
    finally:
        os.close(fd)
    want = b"head" + bytes(100_000 - 4)
    assert (v / "f.bin").read_bytes() == want
    fsync_path(v / "f.bin")
    assert obj(s3, bucket, f"{prefix}/vol/f.bin") == want


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the kernel's inodes needs root")
def test_every_directory_lists_dot_and_dotdot_and_they_hold_no_inode(mount, s3, bucket, prefix):
    """`ls -a` showed neither "." nor ".." anywhere in the mount, as on no local file system. They
    come first, with the inode numbers stat gives the directory and its parent; the kernel takes no
    lookup reference for them, so counting one would keep their inodes forever."""
    for k in ("a/b/x.bin", "a/y.bin"):
        s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/{k}", Body=b"x")
    v = mount.path()
    for d, parent in ((v / "a", v), (v / "a" / "b", v / "a"), (v, v.parent), (mount.mountpoint, mount.mountpoint.parent)):
        out = subprocess.run(["ls", "-a1i", "--sort=none", str(d)], capture_output=True, text=True,
                             check=True).stdout.split("\n")
        got = [line.split(maxsplit=1) for line in out[:2]]
        assert got == [[str(os.stat(d).st_ino), "."], [str(os.stat(parent).st_ino), ".."]], (d, out)
    assert sorted(os.listdir(v / "a")) == ["b", "y.bin"]  # programs that skip them see what they did
    found = subprocess.run(["find", str(v / "a")], capture_output=True, text=True, check=True).stdout.split()
    assert sorted(found) == sorted(str(p) for p in (v / "a", v / "a" / "b", v / "a" / "b" / "x.bin", v / "a" / "y.bin"))

    # No reference is kept for them: once the kernel forgets what nobody holds, the directories
    # listed many times go too, as those never listed do.
    for _ in range(20):
        subprocess.run(["ls", "-a", str(v / "a"), str(v / "a" / "b")], capture_output=True, check=True)
    assert forget_unused_inodes(mount.mountpoint, sync=True)
    # The root stays (the mount holds it); counted references would keep a, b and those above them.
    assert wait_until(lambda: mount.status()["inodes"] <= 2, timeout=10), mount.status()["inodes"]
