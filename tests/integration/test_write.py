"""The write path through a real mount (README "Semantics": Writes, Durability).

Everything is written with os, shutil and coreutils on the mount, and checked in the store with a
separate boto3 client once `fsync` (or a directory fsync) says it is committed.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import time

import pytest

from tests.support import REPO, fsync_path, keys, obj, staging_files, sync_dir, wait_until

MiB = 1 << 20


def test_create_write_close_commits_in_background(mount, s3, bucket, prefix):
    v = mount.path()
    p = v / "hello.txt"
    p.write_bytes(b"hello world\n")
    assert p.read_bytes() == b"hello world\n"  # read-your-writes at once
    fsync_path(p)
    assert obj(s3, bucket, f"{prefix}/vol/hello.txt") == b"hello world\n"
    assert os.stat(p).st_size == 12
    assert mount.status()["commits"]["pending"] == 0


def test_fsync_waits_for_the_commit(mount, s3, bucket, prefix):
    data = os.urandom(3 * MiB)
    with open(mount.path() / "f.bin", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        # Still open, and already in the store.
        assert obj(s3, bucket, f"{prefix}/vol/f.bin") == data


@pytest.mark.parametrize("change", ["write", "truncate"])
def test_fsync_through_a_reader_opened_before_a_change_waits_for_it(mount, s3, bucket, prefix, change):
    """fsync(2) syncs the file, whichever descriptor it is given: also one that was reading the
    committed object when another handle, or truncate(2), changed the file."""
    key = f"{prefix}/vol/r.bin"
    s3.put_object(Bucket=bucket, Key=key, Body=b"Z" * 4063)
    p = mount.path() / "r.bin"
    with open(p, "rb") as r:
        assert r.read(4) == b"ZZZZ"
        if change == "write":
            with open(p, "r+b") as w:
                w.write(b"Y" * 100_000)
            want = b"Y" * 100_000
        else:
            os.truncate(p, 781_014)
            want = b"Z" * 4063 + bytes(781_014 - 4063)
        os.fsync(r.fileno())
        assert obj(s3, bucket, key) == want


def test_overwrite_truncate_append_and_in_place_edit(mount, s3, bucket, prefix):
    key = f"{prefix}/vol/e.txt"
    s3.put_object(Bucket=bucket, Key=key, Body=b"0123456789")
    p = mount.path() / "e.txt"
    with open(p, "r+b") as f:  # in-place edit
        f.seek(3)
        f.write(b"abc")
    fsync_path(p)
    assert obj(s3, bucket, key) == b"012abc6789"
    with open(p, "ab") as f:  # append
        f.write(b"XYZ")
    subprocess.run(f"echo tail >> {p}", shell=True, check=True)
    fsync_path(p)
    assert obj(s3, bucket, key) == b"012abc6789XYZtail\n"
    subprocess.run(["dd", "if=/dev/zero", f"of={p}", "bs=1", "count=2", "seek=1", "conv=notrunc",
                    "status=none"], check=True)
    fsync_path(p)
    assert obj(s3, bucket, key) == b"0\0\0abc6789XYZtail\n"
    p.write_bytes(b"short")  # O_TRUNC
    fsync_path(p)
    assert obj(s3, bucket, key) == b"short"
    os.truncate(p, 2)  # truncate without an open file
    assert p.read_bytes() == b"sh"
    fsync_path(p)
    assert obj(s3, bucket, key) == b"sh"
    with open(p, "r+b") as f:  # grow by truncate
        f.truncate(6)
    fsync_path(p)
    assert obj(s3, bucket, key) == b"sh\0\0\0\0"


def test_mkdir_rmdir_and_enotempty(mount, s3, bucket, prefix):
    v = mount.path()
    os.makedirs(v / "a" / "b" / "c")
    assert f"{prefix}/vol/a/b/c/" in keys(s3, bucket, f"{prefix}/vol/")
    assert os.path.isdir(v / "a" / "b" / "c") and os.listdir(v / "a" / "b" / "c") == []
    with pytest.raises(FileExistsError):
        os.mkdir(v / "a")
    (v / "a" / "b" / "f").write_bytes(b"x")
    with pytest.raises(OSError) as e:
        os.rmdir(v / "a" / "b")
    assert e.value.errno == errno.ENOTEMPTY
    os.rmdir(v / "a" / "b" / "c")
    os.unlink(v / "a" / "b" / "f")
    assert os.listdir(v / "a" / "b") == []  # an emptied directory stays, as on a local disk
    os.rmdir(v / "a" / "b")
    os.rmdir(v / "a")
    sync_dir(v)
    assert keys(s3, bucket, f"{prefix}/vol/") == []


def test_unlink_removes_the_object_and_open_handles_keep_reading(mount, s3, bucket, prefix):
    key = f"{prefix}/vol/gone.bin"
    data = os.urandom(20 * MiB)  # more than the first read's read-ahead fetches
    s3.put_object(Bucket=bucket, Key=key, Body=data)
    p = mount.path() / "gone.bin"
    with open(p, "rb") as f:
        first = f.read(1000)
        os.unlink(p)
        assert not p.exists()
        assert keys(s3, bucket, key) == []
        assert first + f.read() == data
    assert mount.status()["core"]["unlinked_while_open"] == 1
    # A new file unlinked before its commit never reaches the store.
    q = mount.path() / "tmp.bin"
    with open(q, "wb") as f:
        f.write(b"never committed")
        os.unlink(q)
        f.write(b" more")
    sync_dir(mount.path())
    assert keys(s3, bucket, f"{prefix}/vol/") == []



def test_a_file_replaced_by_a_rename_stays_readable_through_handles_already_open(mount, s3, bucket, prefix):
    """A rename over a file is an unlink of the file it replaces: handles already open keep reading
    the replaced content, as on a local disk (the atomic-save pattern: write a temporary file,
    rename it over the target, while a reader has the target open). Those handles used to read
    the name's object from the store and got ESTALE once the new content was there."""
    v = mount.path()
    for how in ("committed", "staged"):
        key = f"{prefix}/vol/{how}.bin"
        old = os.urandom(20 * MiB)  # more than the first read's read-ahead fetches
        s3.put_object(Bucket=bucket, Key=key, Body=old)
        new = os.urandom(3 * MiB)
        with open(v / f"{how}.bin", "rb") as f:
            first = f.read(1000)
            (v / "tmp.bin").write_bytes(new)
            if how == "committed":
                fsync_path(v / "tmp.bin")  # the rename copies it over the target in the store
            os.replace(v / "tmp.bin", v / f"{how}.bin")
            if how == "staged":
                fsync_path(v / f"{how}.bin")  # its commit puts it over the target's object
            assert obj(s3, bucket, key) == new
            assert first + f.read() == old
        assert (v / f"{how}.bin").read_bytes() == new
    sync_dir(v)
    assert keys(s3, bucket, f"{prefix}/vol/") == [f"{prefix}/vol/committed.bin", f"{prefix}/vol/staged.bin"]
    assert mount.status()["core"]["unlinked_while_open"] == 2

def test_rename_file_and_noreplace(mount, s3, bucket, prefix):
    v = mount.path()
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/committed.txt", Body=b"old")
    os.rename(v / "committed.txt", v / "moved.txt")  # a committed file: copy + delete in the store
    assert keys(s3, bucket, f"{prefix}/vol/") == [f"{prefix}/vol/moved.txt"]
    (v / "new.txt").write_bytes(b"pending")  # a file not yet committed: committed under the new name
    os.rename(v / "new.txt", v / "final.txt")
    assert (v / "final.txt").read_bytes() == b"pending"
    sync_dir(v)
    assert keys(s3, bucket, f"{prefix}/vol/") == [f"{prefix}/vol/final.txt", f"{prefix}/vol/moved.txt"]
    assert obj(s3, bucket, f"{prefix}/vol/final.txt") == b"pending"
    # Replacing rename, and one that must not replace (mv -n uses RENAME_NOREPLACE).
    os.rename(v / "final.txt", v / "moved.txt")
    sync_dir(v)
    assert obj(s3, bucket, f"{prefix}/vol/moved.txt") == b"pending"
    (v / "other.txt").write_bytes(b"other")
    r = subprocess.run(["mv", "--no-clobber", str(v / "other.txt"), str(v / "moved.txt")], capture_output=True)
    assert (v / "other.txt").exists() and (v / "moved.txt").read_bytes() == b"pending"
    assert r.returncode in (0, 1)


def test_an_atomic_save_sends_each_file_once_under_its_final_name(mount, s3, bucket, prefix):
    """A file saved by writing a temporary name and renaming it over the final one right after the
    close (rsync, editors, torch.save then os.replace) is one PUT under the final name: no COPY, no
    DELETE, no temporary name in the store. A temporary file removed right after its close costs
    nothing. Each new name is asked of the store once (the kernel's lookup), not again by the
    create or the rename that follow it."""
    v = mount.path()
    datas = {f"f{i:02d}.bin": os.urandom(10_000 + i) for i in range(20)}
    before = mount.store_stats()
    for name, data in datas.items():
        tmp = v / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.utime(tmp, (1_600_000_000, 1_600_000_000))
        os.replace(tmp, v / name)
    for i in range(5):
        scratch = v / f"scratch{i}"
        scratch.write_bytes(b"x" * 1000)
        os.unlink(scratch)
    sync_dir(v)
    after = mount.store_stats()
    sent = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert sent.get("put", 0) == len(datas), sent
    assert sent.get("copy", 0) == 0 and sent.get("delete", 0) == 0, sent
    assert sent.get("head", 0) <= 2 * len(datas) + 5, sent
    assert keys(s3, bucket, f"{prefix}/vol/") == sorted(f"{prefix}/vol/{n}" for n in datas)
    for name, data in datas.items():
        assert obj(s3, bucket, f"{prefix}/vol/{name}") == data
    assert os.stat(v / "f00.bin").st_mtime == 1_600_000_000


def test_cp_tree_mv_directory_and_rm_rf(mount, s3, bucket, prefix, tmp_path):
    src = tmp_path / "tree"
    files = {}
    for i in range(30):
        rel = f"d{i % 4}/sub{i % 3}/f{i}.bin"
        data = os.urandom(1000 * (i + 1))
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
        files[rel] = data
    (src / "big.bin").write_bytes(big := os.urandom(20 * MiB))
    files["big.bin"] = big
    v = mount.path()
    subprocess.run(["cp", "-r", str(src), str(v / "tree")], check=True)
    subprocess.run(["mv", str(v / "tree"), str(v / "moved")], check=True)  # directory rename
    assert not (v / "tree").exists()
    for rel, data in files.items():
        assert (v / "moved" / rel).read_bytes() == data
    sync_dir(v)
    stored = keys(s3, bucket, f"{prefix}/vol/")
    assert not any(k.startswith(f"{prefix}/vol/tree/") for k in stored)
    for rel, data in files.items():
        assert hashlib.sha256(obj(s3, bucket, f"{prefix}/vol/moved/{rel}")).digest() == hashlib.sha256(data).digest()
    subprocess.run(["rm", "-rf", str(v / "moved")], check=True)
    assert not (v / "moved").exists()
    sync_dir(v)
    assert keys(s3, bucket, f"{prefix}/vol/") == []


def test_cp_a_rsync_style_metadata_and_tar_extract(mount, s3, bucket, prefix, tmp_path):
    src = tmp_path / "src"
    (src / "x" / "y").mkdir(parents=True)
    (src / "x" / "y" / "a.txt").write_text("alpha")
    (src / "b.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(src / "b.sh", 0o755)
    v = mount.path()
    subprocess.run(["cp", "-a", str(src), str(v / "copy")], check=True)  # chmod/chown/utimens accepted
    assert (v / "copy" / "x" / "y" / "a.txt").read_text() == "alpha"
    tarball = tmp_path / "t.tar"
    with tarfile.open(tarball, "w") as t:
        t.add(src, arcname="src")
    subprocess.run(["tar", "xf", str(tarball), "-C", str(v)], check=True)
    assert (v / "src" / "b.sh").read_text() == "#!/bin/sh\necho hi\n"
    sync_dir(v)
    assert obj(s3, bucket, f"{prefix}/vol/src/x/y/a.txt") == b"alpha"
    assert obj(s3, bucket, f"{prefix}/vol/copy/b.sh") == b"#!/bin/sh\necho hi\n"


def test_git_init_add_commit_inside_a_volume(mount):
    repo = mount.path() / "repo"
    repo.mkdir()
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.com", HOME=str(repo))

    def git(*args):
        return subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    (repo / "README").write_text("hello\n")
    (repo / "src").mkdir()
    (repo / "src" / "main.py").write_text("print('hi')\n")
    git("add", ".")
    git("commit", "-q", "-m", "first")
    (repo / "README").write_text("hello again\n")
    git("commit", "-q", "-am", "second")
    assert git("log", "--oneline").count("\n") == 2
    assert git("status", "--porcelain") == ""
    assert git("show", "HEAD~1:README") == "hello\n"
    assert "fsck" not in git("fsck", "--no-progress")


def test_a_second_mount_sees_committed_files(mount_factory, prefix):
    a = mount_factory(name="a")
    b = mount_factory(name="b")
    p = a.path() / "shared.txt"
    p.write_bytes(b"from host a")
    fsync_path(p)
    t0 = time.monotonic()
    assert wait_until(lambda: (b.path() / "shared.txt").exists(), timeout=5)
    assert time.monotonic() - t0 <= 1.5
    assert (b.path() / "shared.txt").read_bytes() == b"from host a"
    p.write_bytes(b"changed on a")
    fsync_path(p)
    assert wait_until(lambda: (b.path() / "shared.txt").read_bytes() == b"changed on a", timeout=3)


def test_large_file_is_committed_as_multipart_and_streamed(mount_factory, s3, bucket, prefix):
    # Writes through the daemon, whose upload keeps up with them. (A passthrough writer outruns
    # any upload, so its close() syncs instead: test_passthrough.py.)
    mount = mount_factory(args=("--no-passthrough",))
    data = os.urandom(100 * MiB + 5)
    p = mount.path() / "big.bin"
    with open(p, "wb") as f:
        for i in range(0, len(data), MiB):
            f.write(data[i:i + MiB])
    # Its parts went up while it was written, so close() had at most the parts in flight left to
    # upload. Whether it finished them or synced the rest to the staging disk depends on which this
    # host does faster (test_close_commit.py pins both cases down); either way, a close() that
    # finished the upload left the whole object in the store.
    if mount.status()["commits"].get("committed_at_close", 0) == 1:
        head = s3.head_object(Bucket=bucket, Key=f"{prefix}/vol/big.bin")
        assert head["ContentLength"] == len(data)
    else:
        assert mount.status()["commits"].get("pending", 0) + mount.status()["commits"].get("committed", 0) >= 1
    fsync_path(p)
    head = s3.head_object(Bucket=bucket, Key=f"{prefix}/vol/big.bin")
    assert head["ContentLength"] == len(data)
    assert "-" in head["ETag"]  # a multipart upload
    assert hashlib.sha256(obj(s3, bucket, f"{prefix}/vol/big.bin")).digest() == hashlib.sha256(data).digest()
    st = mount.status()["commits"]
    assert st.get("streamed", 0) >= 1 and st.get("stream_parts", 0) >= 8


def test_sigkill_after_close_loses_nothing(mount, s3, bucket, prefix):
    v = mount.path()
    files = {f"k/f{i}.bin": os.urandom(100_000 + i) for i in range(40)}
    (v / "k").mkdir()
    for rel, data in files.items():
        (v / rel).write_bytes(data)  # close() returned: the data is promised
    mount.kill()
    assert len(keys(s3, bucket, f"{prefix}/vol/k/")) < len(files) + 1 or True  # may be partly there
    mount.start()
    for rel, data in files.items():
        assert (mount.path() / rel).read_bytes() == data  # visible again at once, from staging
    sync_dir(mount.path())
    for rel, data in files.items():
        assert obj(s3, bucket, f"{prefix}/vol/{rel}") == data
    assert mount.status()["commits"].get("replayed", 0) >= 1


def test_replay_publishes_what_a_path_held_last(mount_factory, s3, bucket, prefix):
    """A killed daemon may leave two journal rows for one path: a file closed, and a later version
    (rewritten, or another file renamed over it, which can have the older row id). The restart must
    publish the version the path held last, by when its row last changed, never the one it replaced."""
    import sqlite3

    from ucfs.journal import SCHEMA

    m = mount_factory(start=False)
    staging = m.state_dir / "staging"
    staging.mkdir(parents=True, mode=0o700)
    os.chmod(m.state_dir, 0o700)
    bodies = {name: name.encode() + os.urandom(30_000) for name in ("a-old", "a-new", "b-new", "b-old")}
    for name, body in bodies.items():
        (staging / f"{name}.data").write_bytes(body)
    db = sqlite3.connect(m.state_dir / "journal.sqlite3")
    db.executescript(SCHEMA)
    t = time.time() - 60
    rows = [("dup.bin", "a-old", t), ("dup.bin", "a-new", t + 1),  # rewritten: the later row wins
            ("ren.bin", "b-new", t + 5), ("ren.bin", "b-old", t + 2)]  # renamed over: older id, later change
    for path, name, when in rows:
        db.execute("INSERT INTO pending (volume, path, staging, size, state, created, updated) "
                   "VALUES ('test.s.vol', ?, ?, ?, 'ready', ?, ?)", (path, f"{name}.data", 30_000 + 5, when, when))
    db.commit()
    db.close()
    m.start()
    sync_dir(m.path())
    for path, name in (("dup.bin", "a-new"), ("ren.bin", "b-new")):
        assert obj(s3, bucket, f"{prefix}/vol/{path}") == bodies[name]
        assert (m.path() / path).read_bytes() == bodies[name]
    assert not (staging / "a-old.data").exists() and not (staging / "b-old.data").exists()


def test_sigkill_during_multipart_commit_never_shows_a_partial_object(fault_proxy, mount_factory, s3, bucket,
                                                                     prefix):
    mount = mount_factory(endpoint=fault_proxy.endpoint)
    key = f"{prefix}/vol/mp.bin"
    old = os.urandom(5 * MiB)
    s3.put_object(Bucket=bucket, Key=key, Body=old)
    new = os.urandom(120 * MiB)
    p = mount.path() / "mp.bin"
    seen = set()

    def observe():
        try:
            h = s3.head_object(Bucket=bucket, Key=key)
            seen.add(h["ContentLength"])
        except s3.exceptions.ClientError:
            seen.add(None)

    # Parts past the second are refused (and retried), so the kill always lands mid-commit: before,
    # on a busy host the whole upload could finish between the first listed part and the kill.
    held = fault_proxy.fail(503, method="PUT", path=r"partNumber=([3-9]|\d\d)")
    with open(p, "wb") as f:
        # Not front to back: no part is uploaded while writing, so close() syncs the staging file
        # and the whole multipart upload runs after it (a stream's close would finish its upload).
        f.seek(len(new) - MiB)
        f.write(new[-MiB:])
        f.seek(0)
        f.write(new[:-MiB])

    def parts_uploaded() -> bool:
        observe()
        for u in s3.list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", []):
            try:
                if s3.list_parts(Bucket=bucket, Key=key, UploadId=u["UploadId"]).get("Parts"):
                    return True
            except (s3.exceptions.NoSuchUpload, s3.exceptions.NoSuchKey):
                pass  # aborted between the two calls (RGW answers NoSuchKey): look again
        return False

    assert wait_until(lambda: parts_uploaded() and held.fired >= 1, 60, interval=0.02)
    mount.kill()
    observe()
    assert seen == {len(old)}
    fault_proxy.remove(held)
    mount.start()
    assert mount.status()["commits"].get("replayed", 0) == 1  # it was pending when killed
    assert p.read_bytes() == new
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and obj(s3, bucket, key) != new:
        observe()
        time.sleep(0.2)
    assert obj(s3, bucket, key) == new
    assert seen <= {len(old), len(new)}  # old or new, never a part, never missing
    uploads = s3.list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", [])
    assert wait_until(lambda: not s3.list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads"), 10), uploads


def test_unmount_drains_pending_commits(mount, s3, bucket, prefix):
    v = mount.path()
    for i in range(20):
        (v / f"u{i}.bin").write_bytes(os.urandom(300_000))
    assert mount.stop() == 0
    assert len(keys(s3, bucket, f"{prefix}/vol/")) == 20


def ucfs_cli(m, *args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ucfs", *args], env=m.env(), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_unmount_no_wait_leaves_pending_commits_to_the_next_mount(fault_proxy, mount_factory, s3, bucket, prefix):
    """Before, the daemon drained anyway after `--no-wait`, retrying for ever against a store that
    refused, and held the cache directory: the next mount of it failed ("in use")."""
    m = mount_factory(args=("--store-timeout", "2"), endpoint=fault_proxy.endpoint)
    outage = fault_proxy.fail(503, method="PUT|POST")
    data = os.urandom(300_000)
    (m.path() / "late.bin").write_bytes(data)
    assert wait_until(lambda: outage.fired >= 1, 30)
    r = ucfs_cli(m, "unmount", "--no-wait", str(m.mountpoint))
    assert r.returncode == 0, r.stderr
    assert m.proc.wait(timeout=30) == 0  # gone at once, leaving the file staged and journaled
    m.proc = None
    assert "late.bin" not in str(keys(s3, bucket, f"{prefix}/vol/"))
    outage.disable()
    m.start()
    sync_dir(m.path())
    assert obj(s3, bucket, f"{prefix}/vol/late.bin") == data


def test_unmount_does_not_wait_for_a_file_still_open_for_writing(mount_factory):
    """Its commit waits for its close, which waiting cannot bring: unmount says so and stops
    (the kernel then refuses to unmount a busy file system) instead of waiting for ever."""
    m = mount_factory()
    fd = os.open(m.path() / "held.bin", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"x" * 1000)
        r = ucfs_cli(m, "unmount", str(m.mountpoint), timeout=30)
        assert r.returncode != 0 and "1 file(s) still open for writing" in r.stderr, r.stderr
        assert os.path.ismount(m.mountpoint)
    finally:
        os.close(fd)


def test_read_only_volume_refuses_and_keeps_store_untouched(mount_factory, s3, bucket, prefix):
    m = mount_factory({"test.s.ro": {"prefix": f"{prefix}/ro", "read_only": True}})
    with pytest.raises(OSError) as e:
        (m.path("test.s.ro") / "x").write_bytes(b"x")
    assert e.value.errno == errno.EROFS
    assert keys(s3, bucket, f"{prefix}/ro/") == []


def test_cross_volume_rename_is_exdev_so_mv_copies(mount_factory, s3, bucket, prefix):
    m = mount_factory({"test.s.a": {"prefix": f"{prefix}/a"}, "test.s.b": {"prefix": f"{prefix}/b"}})
    (m.path("test.s.a") / "f.txt").write_bytes(b"travelling")
    with pytest.raises(OSError) as e:
        os.rename(m.path("test.s.a") / "f.txt", m.path("test.s.b") / "f.txt")
    assert e.value.errno == errno.EXDEV
    subprocess.run(["mv", str(m.path("test.s.a") / "f.txt"), str(m.path("test.s.b") / "f.txt")], check=True)
    sync_dir(m.path("test.s.b"))
    sync_dir(m.path("test.s.a"))
    assert obj(s3, bucket, f"{prefix}/b/f.txt") == b"travelling"
    assert keys(s3, bucket, f"{prefix}/a/") == []


def test_shutil_copytree_and_rmtree(mount, tmp_path):
    src = tmp_path / "s"
    (src / "p" / "q").mkdir(parents=True)
    for i in range(10):
        (src / "p" / "q" / f"{i}.txt").write_text(str(i) * 100)
    shutil.copytree(src, mount.path() / "ct")
    assert sorted(os.listdir(mount.path() / "ct" / "p" / "q")) == sorted(f"{i}.txt" for i in range(10))
    shutil.rmtree(mount.path() / "ct")
    assert not (mount.path() / "ct").exists()


def test_an_upload_a_kill_left_unrecorded_is_named_and_another_writer_s_is_not_aborted(mount, s3, bucket, prefix):
    """The daemon records each multipart upload before creating it. Killed after the create and
    before recording the upload's id, it leaves an intent (key, time). The next mount aborted every
    upload of that key from those minutes, another writer's under way among them. Now it aborts
    none: it names them in its log and forgets the intent."""
    import sqlite3

    key = f"{prefix}/vol/intended.bin"
    mount.stop()
    leaked = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]  # as the killed daemon did
    busy = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]  # another host's, under way
    s3.upload_part(Bucket=bucket, Key=key, UploadId=busy, PartNumber=1, Body=b"x" * 100)
    db = sqlite3.connect(mount.state_dir / "journal.sqlite3")
    with db:
        db.execute("INSERT INTO uploads (upload_id, volume, key, created) VALUES (?, ?, ?, ?)",
                   ("intent:0123", "test.s.vol", key, time.time()))
    db.close()
    try:
        mount.start()
        db = sqlite3.connect(mount.state_dir / "journal.sqlite3")
        assert wait_until(lambda: not db.execute("SELECT * FROM uploads").fetchall(), 10)
        db.close()
        uploads = s3.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/vol/").get("Uploads", [])
        assert {u["UploadId"] for u in uploads} == {leaked, busy}
        assert s3.list_parts(Bucket=bucket, Key=key, UploadId=busy)["Parts"][0]["Size"] == 100
        log = mount.log_tail(400)
        assert "may have left it behind" in log and leaked in log and busy in log, log
    finally:
        for upload_id in (leaked, busy):
            s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)


def test_a_file_written_here_is_in_the_cache_once_committed(mount, s3, bucket, prefix):
    """Files of 1 MiB to 64 MiB go into the block cache when committed (README "Semantics": Reads):
    read back after a remount, they cost no GET."""
    data = os.urandom(20 * MiB + 12345)
    p = mount.path() / "cached.bin"
    p.write_bytes(data)
    fsync_path(p)
    assert obj(s3, bucket, f"{prefix}/vol/cached.bin") == data
    # The cache is filled in the background after the commit: let it land before unmounting.
    assert wait_until(lambda: mount.status()["cache"]["blocks"] >= -(-len(data) // MiB), timeout=20)
    mount.stop()
    mount.start()
    assert p.read_bytes() == data
    assert mount.store_stats().get("get", 0) == 0


def test_committed_files_leave_no_staging_files_behind(mount, s3, bucket, prefix):
    """Retired staging files are closed and removed in batches; every one goes, at once or at
    unmount, and the next mount finds nothing to set aside as an orphan."""
    v = mount.path()
    staging = mount.state_dir / "staging"
    payload = {f"s{i:03d}.bin": os.urandom(20_000 + i) for i in range(120)}
    src = mount.state_dir.parent / "small-src"
    src.mkdir()
    for name, data in payload.items():
        (src / name).write_bytes(data)
    subprocess.run(["xargs", "-0", "-P", "16", "-n", "8", "cp", "-t", str(v)], check=True,
                   input=b"\0".join(os.fsencode(src / n) for n in payload))
    sync_dir(v)  # every file committed

    def written_staging():
        return [p.name for p in staging_files(staging)]

    assert wait_until(lambda: not written_staging(), timeout=10), written_staging()
    assert mount.stop() == 0
    assert not written_staging()
    mount.start()
    assert not (mount.state_dir / "orphans").exists()
    for name, data in list(payload.items())[::17]:
        assert obj(s3, bucket, f"{prefix}/vol/{name}") == data
