"""The command line around a mount's life (README "Using it"): `ucfs mount`, `status` and `unmount`
as a user runs them, including after a crash. Each problem a user can fix is one clear message and a
non-zero exit, never a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.support import REPO, obj, sync_dir, wait_until


def ucfs(m, *args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ucfs", *args], env=m.env(), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@contextlib.contextmanager
def daemon_mount(m, mountpoint, *args):
    """`ucfs mount` as a daemon (it returns once the mount is ready); cleared afterwards whatever
    the test left."""
    m.root.mkdir(parents=True, exist_ok=True)
    cat = m.root / "catalog.toml"
    cat.write_text(m.catalog_text)
    r = ucfs(m, "mount", str(mountpoint), "--config", str(cat), "--cache-dir", str(m.state_dir), *args)
    try:
        assert r.returncode == 0, r.stderr
        yield r
    finally:
        real = os.path.realpath(mountpoint)
        if os.path.ismount(real):
            subprocess.run(["fusermount3", "-u", "-z", real], capture_output=True)


def test_a_mountpoint_given_through_a_symlink_is_the_same_mount_by_either_name(mount_factory, s3, bucket, prefix):
    """The kernel mounts at the link's target; status and unmount found nothing by the link's name
    (or by the target's, when the mount had been given the link)."""
    m = mount_factory(start=False)
    real = m.root / "real"
    real.mkdir(parents=True)
    link = m.root / "link"
    link.symlink_to(real)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/hello.txt", Body=b"hello")
    with daemon_mount(m, link) as mounted:
        assert os.path.ismount(real)
        assert (link / "test" / "s" / "vol" / "hello.txt").read_bytes() == b"hello"
        for name in (link, real):
            st = ucfs(m, "status", str(name))
            assert st.returncode == 0 and st.stdout.startswith(f"{real}\n"), (name, st.stdout, st.stderr)
        r = ucfs(m, "unmount", str(link))
        assert r.returncode == 0, r.stderr
        assert not os.path.ismount(real)
        assert f"at {real} " in mounted.stdout, mounted.stdout  # the name the kernel and status use


@contextlib.contextmanager
def crashed(m):
    """SIGKILL the daemon and leave its mount behind, as a crash does; the dead mount is cleared
    afterwards unless the test mounted again."""
    m.proc.send_signal(signal.SIGKILL)
    m.proc.wait(timeout=30)
    m.proc = None
    try:
        with pytest.raises(OSError) as e:
            os.statvfs(m.mountpoint)  # (a stat may still be answered from cached attributes)
        assert e.value.errno == errno.ENOTCONN
        yield
    finally:
        if m.proc is None:
            subprocess.run(["fusermount3", "-u", "-z", str(m.mountpoint)], capture_output=True)


def test_mounting_again_over_a_dead_mount_clears_it_and_serves(mount_factory, s3, bucket, prefix):
    """Mounting again is how a crashed daemon's pending commits get finished; it failed with a
    traceback (ENOTCONN from the mountpoint check) as long as the dead mount was there."""
    m = mount_factory()
    (m.path() / "pending.txt").write_bytes(b"closed before the crash")
    with crashed(m):
        # Another FUSE file system's dead mount is not ours to clear: the check says what to do.
        from ucfs.errors import UcfsError
        from ucfs.mount import check_mountpoint

        with pytest.raises(UcfsError, match=f"{m.mountpoint} is a dead FUSE mount .*fusermount3 -u -z"):
            check_mountpoint(m.mountpoint)
        m.start()
    assert f"{m.mountpoint} was a dead ucfs mount" in m.log_path.read_text()
    assert "Traceback" not in m.log_path.read_text()
    assert (m.path() / "pending.txt").read_bytes() == b"closed before the crash"
    sync_dir(m.path())
    assert obj(s3, bucket, f"{prefix}/vol/pending.txt") == b"closed before the crash"


def test_status_names_a_dead_mount_and_unmount_clears_it(mount_factory):
    m = mount_factory()
    with crashed(m):
        st = ucfs(m, "status", str(m.mountpoint))
        assert st.returncode == 1 and st.stderr.strip() == (
            f"ucfs: {m.mountpoint} is a dead ucfs mount (its daemon has exited); clear it with: "
            f"ucfs unmount {m.mountpoint}"), st.stderr
        r = ucfs(m, "unmount", str(m.mountpoint))
        assert r.returncode == 0, r.stderr
        assert "dead mount" in r.stdout and "Traceback" not in r.stderr
        assert not os.path.ismount(m.mountpoint)
    m.start()  # and the place is usable again
    assert m.stop() == 0


@pytest.mark.parametrize("what", ["a plain directory", "missing"])
def test_status_of_a_place_that_is_no_mount_says_so(tmp_path, what):
    """It said "no ucfs daemon answers for this mountpoint", as of a mount whose daemon is gone."""
    place = tmp_path / "here"
    if what == "a plain directory":
        place.mkdir()
    for args in (["status", str(place)], ["status", "--json", str(place)]):
        r = subprocess.run([sys.executable, "-m", "ucfs", *args], cwd=REPO, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 1
        assert r.stderr.strip() == f"ucfs: {place} is not a ucfs mount", r.stderr


def test_status_json_is_one_document_keyed_by_mountpoint(mount_factory):
    """With two mounts it printed two JSON documents one after the other: not JSON."""
    a, b = mount_factory(name="a"), mount_factory(name="b")
    r = ucfs(a, "status", "--json")  # every ucfs mount of the host (others' too, on a shared one)
    doc = json.loads(r.stdout)
    for m in (a, b):
        assert doc[str(m.mountpoint)]["ready"] is True, doc.get(str(m.mountpoint))
    r = ucfs(a, "status", "--json", str(a.mountpoint))
    assert r.returncode == 0 and list(json.loads(r.stdout)) == [str(a.mountpoint)]
    with crashed(b):
        r = ucfs(b, "status", "--json", str(b.mountpoint))
        assert r.returncode == 1
        assert "dead ucfs mount" in json.loads(r.stdout)[str(b.mountpoint)]["error"]


@pytest.fixture
def silent_store(s3_endpoint):
    """An endpoint that takes connections and never answers: a store that hangs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield dataclasses.replace(s3_endpoint, url=f"http://127.0.0.1:{sock.getsockname()[1]}")


@pytest.mark.parametrize("daemon", [False, True], ids=["foreground", "daemon"])
def test_ctrl_c_during_the_bucket_check_stops_the_mount_at_once(mount_factory, silent_store, daemon):
    """The check waited for the store's own timeouts and retries (a minute or more) before Ctrl-C
    took effect; a daemon went on to mount after the command that started it had given up."""
    m = mount_factory(endpoint=silent_store, start=False)
    m.root.mkdir(parents=True)
    cat = m.root / "catalog.toml"
    cat.write_text(m.catalog_text)
    args = [sys.executable, "-m", "ucfs", "mount", str(m.mountpoint), "--config", str(cat),
            "--cache-dir", str(m.state_dir), "--store-timeout", "20", *(() if daemon else ("-f",))]
    # A terminal's foreground process has SIGINT at its default; a command started in the background
    # by a non-interactive shell (a CI runner's, `cmd &`) inherits it ignored, and Python then raises
    # no KeyboardInterrupt. The mount is started as a terminal would, whatever ran the suite.
    proc = subprocess.Popen(args, env=m.env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lock = m.state_dir / "lock"  # the daemon writes its pid there before the check
        assert wait_until(lambda: lock.exists() and lock.read_text().startswith("pid "), 30)
        pid = int(lock.read_text().split()[1])
        time.sleep(1)  # into the check
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends the terminal's foreground process
        out, err = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 5, err
        assert proc.returncode == 130 and "Traceback" not in err, err
        assert wait_until(lambda: not os.path.exists(f"/proc/{pid}"), 5), "the daemon goes on"
        assert not os.path.ismount(m.mountpoint)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_status_of_another_file_systems_dead_mount_does_not_call_it_ucfs(mount_factory):
    """It said "a dead ucfs mount; clear it with: ucfs unmount", and ucfs unmount then refused it as
    not a ucfs mount. Another FUSE file system's dead mount is named so, with the command that clears it."""
    m = mount_factory(start=False)
    mnt = m.root / "other"
    mnt.mkdir(parents=True)
    other = subprocess.Popen([sys.executable, "-c", (
        "import sys, pyfuse3, trio\n"
        "pyfuse3.init(pyfuse3.Operations(), sys.argv[1], {'fsname=otherfs', 'subtype=otherfs'})\n"
        "trio.run(pyfuse3.main)\n"), str(mnt)])
    try:
        # (os.path.ismount would stat it, which this file system does not answer)
        assert wait_until(lambda: f" {mnt} fuse.otherfs " in open("/proc/self/mounts").read(), 30)
        other.send_signal(signal.SIGKILL)
        other.wait(timeout=30)
        with pytest.raises(OSError) as e:
            os.statvfs(mnt)
        assert e.value.errno == errno.ENOTCONN
        st = ucfs(m, "status", str(mnt))
        assert st.returncode == 1 and "Traceback" not in st.stderr, st.stderr
        assert "ucfs mount" not in st.stderr and "ucfs unmount" not in st.stderr, st.stderr
        assert f"fusermount3 -u -z {mnt}" in st.stderr, st.stderr
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)


def test_mounting_over_a_stopped_daemons_mount_says_so_instead_of_hanging(mount_factory):
    """The mountpoint check's statfs waited for ever on a mount whose daemon is alive but stopped
    (SIGSTOP, a debugger, a hang): `ucfs mount` hung with it, and Ctrl-C could not end it."""
    m = mount_factory()
    m.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = ucfs(m, "mount", str(m.mountpoint), "--foreground", "--config", str(m.root / "catalog.toml"),
                 "--cache-dir", str(m.root / "other-state"), timeout=60)
        took = time.monotonic() - t0
    finally:
        m.proc.send_signal(signal.SIGCONT)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{m.mountpoint} is a mount that does not answer" in r.stderr, r.stderr
    assert f"fusermount3 -u -z {m.mountpoint}" in r.stderr, r.stderr
    assert took < 30, took
    # Nothing was done to the mount: its daemon serves again once it runs.
    assert wait_until(lambda: os.statvfs(m.mountpoint) is not None, 30)
    assert m.stop() == 0


def test_mounting_over_a_non_empty_directory_warns_that_its_entries_are_hidden(mount_factory, s3, bucket, prefix):
    """FUSE mounts over a directory that has entries, and they vanish until the unmount: nothing is
    lost, but whoever put them there was not told why. One warning line on stderr (and in the log),
    and the mount goes on as before."""
    m = mount_factory(start=False)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/hello.txt", Body=b"hello")
    mnt = m.root / "full"
    (mnt / "sub").mkdir(parents=True)
    (mnt / "notes.txt").write_text("mine")
    (mnt / ".hidden").write_text("mine too")
    with daemon_mount(m, mnt) as mounted:
        warnings = [line for line in mounted.stderr.splitlines() if line.strip()]
        assert warnings == [f"ucfs: warning: {mnt} is not empty: its 3 entries are hidden while ucfs is mounted "
                            "over it, and back after ucfs unmount"], mounted.stderr
        assert f"WARNING ucfs: {mnt} is not empty: its 3 entries" in (m.state_dir / "ucfs.log").read_text()
        assert sorted(os.listdir(mnt)) == ["test"]
        assert (mnt / "test" / "s" / "vol" / "hello.txt").read_bytes() == b"hello"
        r = ucfs(m, "unmount", str(mnt))
        assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(mnt)) == [".hidden", "notes.txt", "sub"]
    assert (mnt / "notes.txt").read_text() == "mine"
    # An empty one, the usual case, says nothing; in the foreground the log line is the warning.
    with daemon_mount(m, m.root / "empty") as mounted:
        assert mounted.stderr == "", mounted.stderr
        assert ucfs(m, "unmount", str(m.root / "empty")).returncode == 0
    m.mountpoint.mkdir()
    (m.mountpoint / "one").write_text("x")
    m.start()
    assert m.log_path.read_text().count(f"{m.mountpoint} is not empty: its 1 entry is hidden") == 1
    assert m.stop() == 0
