"""Everyday tools on a real mount, compared with what they do on a local disk (README "Semantics").

tar, cp and friends look at a file's times to decide whether it changed under them; these tests
check that what the mount does behind the user's back (a commit, the store's description of the
version it committed) does not look to them like a change.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from tests.support import fsync_path, wait_until

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


def _forget_inodes() -> None:
    """Make the kernel forget every inode nobody holds (it sends FUSE FORGET), as memory pressure
    does on a busy host: dentries and inodes only, no page cache."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2")


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
    _forget_inodes()
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
