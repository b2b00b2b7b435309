"""Everyday tools on a real mount, compared with what they do on a local disk (README "Semantics").

tar, cp and friends look at a file's times to decide whether it changed under them; these tests
check that what the mount does behind the user's back (a commit, the store's description of the
version it committed) does not look to them like a change. git and sqlite, which teams keep on
shared volumes too, lean on renames over lock files, shared writable mappings, POSIX locks and
fsync; their tests check the result on this host, in the store and on a second mount.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from tests.support import forget_unused_inodes, fsync_path, obj, sync_dir, wait_until

# Timestamps the kernel sets to "now" may trail time.time_ns() by up to a few clock ticks.
COARSE_CLOCK_SLACK_NS = 20_000_000

MiB = 1 << 20


def _times(p) -> tuple[int, int]:
    st = os.stat(p)
    return st.st_mtime_ns, st.st_ctime_ns


def test_a_file_written_here_keeps_its_times_through_its_commit(mount, s3, bucket, prefix):
    """The commit of a file (one PUT, or a multipart upload) and the store's later description of
    that same version (a HEAD, a listing) do not move its mtime or ctime, nor does a rename: the
    commit used to set them to the time it finished, and the next HEAD to the whole second of
    Last-Modified. A version written elsewhere still shows its Last-Modified."""
    v = mount.path()
    files = {"small.bin": os.urandom(100_000), "large.bin": os.urandom(20 * MiB)}
    for name, data in files.items():
        (v / name).write_bytes(data)
    written = {name: _times(v / name) for name in files}
    for name in files:
        fsync_path(v / name)
        assert os.stat(v / name).st_size == len(files[name])
    time.sleep(1.5)  # past the metadata TTL: the next stat asks the store
    for name in files:
        assert _times(v / name) == written[name], name
    time.sleep(1.5)
    assert sorted(os.listdir(v)) == sorted(files)  # a fresh listing describes them too
    for name in files:
        assert _times(v / name) == written[name], name
    os.rename(v / "large.bin", v / "moved.bin")  # a copy in the store, with a Last-Modified of its own
    time.sleep(1.5)
    assert os.stat(v / "moved.bin").st_mtime_ns == written["large.bin"][0]

    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/small.bin", Body=b"from elsewhere")
    last_modified = s3.head_object(Bucket=bucket, Key=f"{prefix}/vol/small.bin")["LastModified"]
    time.sleep(1.5)
    assert (v / "small.bin").read_bytes() == b"from elsewhere"
    assert os.stat(v / "small.bin").st_mtime_ns == int(last_modified.timestamp()) * 1_000_000_000


def test_tar_of_files_just_written_does_not_report_them_changed(mount, tmp_path):
    """GNU tar compares a file's ctime before and after reading it and exits 1 ("file changed as we
    read it") when it moved; files written just before, still being committed, must not trip it."""
    out = mount.path() / "results"
    out.mkdir()
    for i in range(20):
        (out / f"part-{i:02d}.bin").write_bytes(os.urandom(3 * MiB))
    r = subprocess.run(["tar", "cf", str(tmp_path / "results.tar"), "-C", str(mount.path()), "results"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    time.sleep(1.5)  # and again once the store describes them
    r = subprocess.run(["tar", "cf", str(tmp_path / "again.tar"), "-C", str(mount.path()), "results"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_times_set_on_a_file_still_open_for_writing_are_kept(mount, tmp_path):
    """tar x sets each file's mtime with futimens before it closes the file, and so do cp -p and
    rsync -t's like in Python (os.utime on the descriptor). With the file open in passthrough mode,
    the daemon's next look at the staging file put the mtime of the writes back over it."""
    import tarfile

    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "f.bin").write_bytes(os.urandom(200_000))
    (src / "g.txt").write_text("g")
    os.utime(src / "a" / "f.bin", (1_577_934_245, 1_577_934_245))
    os.utime(src / "g.txt", (1_000_000_000, 1_000_000_000))
    with tarfile.open(tmp_path / "src.tar", "w") as t:
        t.add(src, arcname=".")
    out = mount.path() / "x"
    out.mkdir()
    subprocess.run(["tar", "xf", str(tmp_path / "src.tar"), "-C", str(out)], check=True)
    fd = os.open(out / "py.bin", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"abc")
        os.utime(fd, (1_100_000_000, 1_100_000_000))
        fstat_mtime = os.fstat(fd).st_mtime_ns
    finally:
        os.close(fd)
    assert fstat_mtime == 1_100_000_000 * 10**9
    want = {"a/f.bin": 1_577_934_245, "g.txt": 1_000_000_000, "py.bin": 1_100_000_000}
    for rel, t in want.items():
        assert os.stat(out / rel).st_mtime_ns == t * 10**9, rel
    for rel in want:
        fsync_path(out / rel)
    time.sleep(1.5)  # committed, and described by the store since: still the times set here
    for rel, t in want.items():
        assert os.stat(out / rel).st_mtime_ns == t * 10**9, rel


def test_touch_of_a_committed_file_keeps_the_time_it_set(mount, s3, bucket, prefix):
    """touch, os.utime and touch -r on a file whose version is in the store (committed here, or
    written elsewhere) showed the new mtime until the metadata TTL ran out, then the old one again:
    only a staged file's mtime was kept. A stamp file touched again (make, a job's done-marker,
    find -newer) went back in time by itself. What was set is kept on this host for that version;
    a newer version written elsewhere shows its Last-Modified."""
    v = mount.path()
    (v / "mine.txt").write_text("written here")
    fsync_path(v / "mine.txt")
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/theirs.txt", Body=b"written elsewhere")
    os.utime(v / "mine.txt", (1_500_000_000, 1_500_000_000))
    subprocess.run(["touch", "-m", "-d", "@1400000000", str(v / "theirs.txt")], check=True)
    want = {"mine.txt": 1_500_000_000 * 10**9, "theirs.txt": 1_400_000_000 * 10**9}
    for name, t in want.items():
        assert os.stat(v / name).st_mtime_ns == t, name
    time.sleep(1.5)  # past the metadata TTL: the next stat asks the store
    for name, t in want.items():
        assert os.stat(v / name).st_mtime_ns == t, name
    time.sleep(1.5)
    assert sorted(os.listdir(v)) == sorted(want)  # a fresh listing describes them too
    for name, t in want.items():
        assert os.stat(v / name).st_mtime_ns == t, name
    # The kernel stamps "now" from its coarse clock, up to a tick (4 ms at HZ=250) behind time_ns():
    # a touch run just after this line once read 0.47 ms before it.
    before = time.time_ns() - COARSE_CLOCK_SLACK_NS
    subprocess.run(["touch", str(v / "mine.txt")], check=True)  # to now, as a stamp file is
    time.sleep(1.5)
    assert os.stat(v / "mine.txt").st_mtime_ns >= before

    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/theirs.txt", Body=b"a newer version")
    last_modified = s3.head_object(Bucket=bucket, Key=f"{prefix}/vol/theirs.txt")["LastModified"]
    time.sleep(1.5)
    assert (v / "theirs.txt").read_bytes() == b"a newer version"
    assert os.stat(v / "theirs.txt").st_mtime_ns == int(last_modified.timestamp()) * 10**9


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the kernel's inodes needs root")
def test_a_file_written_here_keeps_its_times_after_the_kernel_forgets_it(mount):
    """The local mtime of a version committed here (what cp -p, rsync -a or tar x set) lived only on
    its inode: once the kernel forgot that inode (memory pressure, a large tree), the next lookup
    made a new one from the listing, with the store's Last-Modified. rsync -a then sent every such
    file again, and find -newer took them for changed."""
    d = mount.path() / "tree" / "sub"
    d.mkdir(parents=True)
    want = {"old.bin": 1_577_934_245, "older.txt": 1_000_000_000}
    for name, t in want.items():
        (d / name).write_bytes(os.urandom(50_000))
        os.utime(d / name, (t, t))
    (d / "now.txt").write_text("written now")
    now_mtime = os.stat(d / "now.txt").st_mtime_ns
    for name in (*want, "now.txt"):
        fsync_path(d / name)
    inos = {name: os.stat(d / name).st_ino for name in (*want, "now.txt")}
    time.sleep(1.5)  # the listing that describes them is the store's now
    assert forget_unused_inodes(mount.mountpoint, sync=True)
    # A new inode number says the daemon made the inode anew: the old one was forgotten.
    assert wait_until(lambda: all(os.stat(d / n).st_ino != i for n, i in inos.items()), 10), \
        "the kernel did not forget the inodes"
    for name, t in want.items():
        assert os.stat(d / name).st_mtime_ns == t * 10**9, name
    assert os.stat(d / "now.txt").st_mtime_ns == now_mtime


def test_df_shows_the_volume_unused_with_the_staging_disks_room_available(mount):
    """A store has no fixed size: df showed 1 PiB 100 % used (all of it less the staging disk's free
    space), which monitoring reads as a full disk. It shows 0 % used, and as available what writes
    need first: the free space of the disk under the cache directory."""
    v = mount.path()
    out = subprocess.run(["df", "-P", "-B1", str(v)], capture_output=True, text=True, check=True).stdout
    size, used, avail, pcent = out.splitlines()[1].split()[1:5]
    assert int(used) == 0 and pcent == "0%", out
    staging = os.statvfs(mount.state_dir)
    staging_avail = staging.f_bavail * staging.f_frsize
    assert abs(int(avail) - staging_avail) < 64 * MiB, (out, staging_avail)  # (other tests write meanwhile)
    assert int(size) >= 1 << 50
    usage = shutil.disk_usage(v)
    assert usage.used == 0 and abs(usage.free - staging_avail) < 64 * MiB


def _git(*args: str, cwd) -> str:
    r = subprocess.run(["git", "-c", "user.name=ucfs test", "-c", "user.email=test@ucfs.invalid",
                        "-c", "init.defaultBranch=main", *args],
                       cwd=cwd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"git {' '.join(args)} in {cwd}: {r.stderr}"
    return r.stdout


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_git_repository_on_the_volume_is_shared_by_two_hosts(mount_factory, tmp_path, s3, bucket, prefix):
    """A repository kept on a volume, as teams keep experiment code next to its data: git clones
    into it, commits in it (lock files renamed over the index and refs, loose objects made by
    link-or-rename), and another host that mounts the same volume sees the history, commits on
    top, and the first host sees that commit in turn, with `git fsck --full` clean on both."""
    origin = tmp_path / "origin"
    origin.mkdir()
    _git("init", "-q", cwd=origin)
    for i in range(3):
        (origin / f"train_{i}.py").write_text(f"print({i})\n" * (i + 1))
        _git("add", ".", cwd=origin)
        _git("commit", "-q", "-m", f"step {i}", cwd=origin)
    a = mount_factory(name="a")
    b = mount_factory(name="b")
    _git("clone", "-q", str(origin), str(a.path() / "repo"), cwd=tmp_path)
    repo_a, repo_b = a.path() / "repo", b.path() / "repo"
    (repo_a / "train_0.py").write_text("print('edited on a')\n")
    _git("commit", "-q", "-am", "edit on a", cwd=repo_a)
    sync_dir(repo_a)
    head = _git("rev-parse", "HEAD", cwd=repo_a).strip()
    ref = obj(s3, bucket, f"{prefix}/vol/repo/.git/refs/heads/main")
    assert ref.decode().strip() == head  # what the other host will read is in the store

    assert wait_until(lambda: (repo_b / ".git").is_dir(), 5)
    assert _git("rev-parse", "HEAD", cwd=repo_b).strip() == head
    assert _git("status", "--porcelain", cwd=repo_b) == ""
    _git("fsck", "--full", "--no-progress", cwd=repo_b)
    assert (repo_b / "train_0.py").read_text() == "print('edited on a')\n"
    (repo_b / "train_2.py").write_text("print('edited on b')\n")
    _git("commit", "-q", "-am", "edit on b", cwd=repo_b)
    sync_dir(repo_b)
    head_b = _git("rev-parse", "HEAD", cwd=repo_b).strip()

    # Within the metadata TTL, host a sees the new ref, the objects it names and the file.
    assert wait_until(lambda: _git("rev-parse", "HEAD", cwd=repo_a).strip() == head_b, 5)
    assert _git("log", "--format=%s", cwd=repo_a).splitlines()[:2] == ["edit on b", "edit on a"]
    assert (repo_a / "train_2.py").read_text() == "print('edited on b')\n"
    assert _git("status", "--porcelain", cwd=repo_a) == ""
    _git("fsck", "--full", "--no-progress", cwd=repo_a)


def _sqlite_writer(path: str, writer: int, rows: int) -> None:
    import sqlite3

    db = sqlite3.connect(path, timeout=60)
    try:
        for i in range(rows):
            with db:  # one transaction (and one WAL fsync) per row
                db.execute("INSERT INTO runs (writer, step) VALUES (?, ?)", (writer, i))
    finally:
        db.close()


def test_a_sqlite_database_in_wal_mode_takes_writers_from_several_processes(mount_factory, s3, bucket, prefix):
    """Experiment trackers (MLflow's and Optuna's sqlite back ends) keep a database next to the runs:
    WAL mode maps its -shm file shared and writable, every commit fsyncs the -wal file, and
    concurrent writers take turns through POSIX locks. Every row committed by every process is
    there, the database checks out, and once the last connection is closed (the WAL folded in)
    another host reads the same rows from the store."""
    import multiprocessing
    import sqlite3

    a = mount_factory(name="a")
    path = a.path() / "tracking" / "runs.db"
    path.parent.mkdir()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
    db.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, writer INTEGER, step INTEGER)")
    db.commit()
    writers, rows = 3, 40
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_sqlite_writer, args=(str(path), w, rows)) for w in range(writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    counts = dict(db.execute("SELECT writer, COUNT(DISTINCT step) FROM runs GROUP BY writer"))
    assert counts == {w: rows for w in range(writers)}
    db.close()  # the last connection: the WAL is checkpointed into the database and removed
    sync_dir(path.parent)
    assert sorted(os.listdir(path.parent)) == ["runs.db"]
    stored = obj(s3, bucket, f"{prefix}/vol/tracking/runs.db")
    assert stored.startswith(b"SQLite format 3\0") and stored == path.read_bytes()

    b = mount_factory(name="b")
    other = sqlite3.connect(f"file:{b.path() / 'tracking' / 'runs.db'}?mode=ro", uri=True)
    try:
        assert other.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert other.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == writers * rows
    finally:
        other.close()
