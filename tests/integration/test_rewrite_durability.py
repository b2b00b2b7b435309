"""A file written again before its last close was committed (README "Semantics": Durability).

A close makes the file's content durable and journaled; its commit may still be waiting (a slow or
failing store, a long upload) when a writer opens the file again. The version that was closed must
then still be what a crash publishes, and what a retried commit uploads, until the new writer closes
in turn: never bytes nobody has closed. (Before, the journal row named the staging file the new
writer was changing.) Found in review; each test failed before the fix.
"""

from __future__ import annotations

import contextlib
import os
import time

import pytest

from tests.support import keys, obj, sync_dir, wait_until
from ucfs.commit import COMMIT_SETTLE_S

V1 = b"A" * 200_000


def logged_mount(mount_factory, pt, head_bytes: int):
    """A mount whose train.log holds head_bytes of committed data: (mount, volume path, the data)."""
    m = mount_factory(args=pt)
    v = m.path()
    head = os.urandom(head_bytes)
    (v / "train.log").write_bytes(head)
    sync_dir(v)
    return m, v, head


def kept_versions(m) -> int:
    """How many closed versions the mount has copied aside so far."""
    return m.status()["commits"].get("closed_versions_kept", 0)


def proxied(mount_factory, fault_proxy, *args):
    return mount_factory(args=("--store-timeout", "2", *args), endpoint=fault_proxy.endpoint)


@pytest.mark.parametrize("mode", ["append", "trunc", "inplace"])
@pytest.mark.parametrize("pt", [(), ("--no-passthrough",)], ids=["passthrough", "no-passthrough"])
def test_a_crash_while_a_pending_file_is_written_again_publishes_its_closed_version(
        fault_proxy, mount_factory, s3, bucket, prefix, mode, pt):
    m = proxied(mount_factory, fault_proxy, *pt)
    v = m.path()
    (v / "f.bin").write_bytes(b"v0")
    outage = fault_proxy.fail(503, method="PUT|POST")
    (v / "f.bin").write_bytes(V1)  # closed: durable and journaled, its commit refused
    assert wait_until(lambda: outage.fired >= 1, 10)
    flags = {"append": os.O_WRONLY | os.O_APPEND, "trunc": os.O_WRONLY | os.O_TRUNC, "inplace": os.O_WRONLY}[mode]
    fd = os.open(v / "f.bin", flags)
    os.write(fd, b"PARTIAL-UNCLOSED")
    m.kill()
    with contextlib.suppress(OSError):
        os.close(fd)
    outage.disable()
    m.start()
    sync_dir(m.path())
    got = obj(s3, bucket, f"{prefix}/vol/f.bin")
    assert got == V1, (len(got), got[:20])
    # The unclosed bytes are kept aside for the user, not lost and not published.
    kept = [p.read_bytes() for p in (m.state_dir / "orphans").iterdir()]
    assert any(b"PARTIAL-UNCLOSED" in k for k in kept)


def test_a_retried_commit_uploads_the_closed_version_not_the_one_being_written(fault_proxy, mount_factory, s3,
                                                                               bucket, prefix):
    """No crash: the store comes back while a writer has the file open again."""
    m = proxied(mount_factory, fault_proxy, "--no-passthrough")
    v = m.path()
    outage = fault_proxy.fail(503, method="PUT|POST")
    (v / "f.bin").write_bytes(V1)
    assert wait_until(lambda: "failed (attempt 1)" in m.log_path.read_text(), 30)
    fd = os.open(v / "f.bin", os.O_WRONLY)
    try:
        os.write(fd, b"PARTIAL-UNCLOSED")
        outage.disable()
        assert wait_until(lambda: m.status()["commits"].get("committed", 0) >= 1, 40), m.status()["commits"]
        assert obj(s3, bucket, f"{prefix}/vol/f.bin") == V1
    finally:
        os.close(fd)
    sync_dir(v)  # and the writer's own close is committed after it
    assert obj(s3, bucket, f"{prefix}/vol/f.bin") == b"PARTIAL-UNCLOSED" + V1[16:]


@pytest.mark.parametrize("pt", [(), ("--no-passthrough",)], ids=["passthrough", "no-passthrough"])
def test_a_readers_close_does_not_make_a_file_being_written_publishable(mount_factory, s3, bucket, prefix, pt):
    """`cat` or `tail` of a file someone is still writing records nothing: a crash after it must not
    publish the half-written file."""
    m = mount_factory(args=pt)
    v = m.path()
    fd = os.open(v / "w.bin", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"HALF-WRITTEN")
    assert (v / "w.bin").read_bytes() == b"HALF-WRITTEN"
    m.kill()
    with contextlib.suppress(OSError):
        os.close(fd)
    m.start()
    sync_dir(m.path())
    assert f"{prefix}/vol/w.bin" not in keys(s3, bucket, f"{prefix}/vol/")


def test_a_pending_commit_keeps_its_age_across_a_restart(fault_proxy, mount_factory):
    m = proxied(mount_factory, fault_proxy, "--no-passthrough")
    outage = fault_proxy.fail(503, method="PUT|POST")
    (m.path() / "f.bin").write_bytes(b"x" * 1000)
    time.sleep(3)
    before = m.status()["commits"]["items"][0]
    m.kill()
    m.start()
    after = m.status()["commits"]["items"][0]
    outage.disable()
    assert after["path"] == before["path"] and after["age_s"] >= before["age_s"] >= 3, (before, after)


@pytest.mark.parametrize("pt", [(), ("--no-passthrough",)], ids=["passthrough", "no-passthrough"])
def test_a_committed_file_still_open_at_a_crash_is_not_taken_for_one_never_closed(mount_factory, s3, bucket,
                                                                                    prefix, pt):
    """Its staging file outlives the commit while a reader has it open. Before, a crash then moved
    it to orphans/ with a warning that it was never closed, a copy of committed data at each crash."""
    m = mount_factory(args=pt)
    v = m.path()
    data = os.urandom(200_000)
    with open(v / "done.bin", "wb") as w:
        w.write(data)
        w.flush()
        fd = os.open(v / "done.bin", os.O_RDONLY)  # a reader of the staged file
    try:
        sync_dir(v)
        assert obj(s3, bucket, f"{prefix}/vol/done.bin") == data
        m.kill()
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    m.start()
    orphans = m.state_dir / "orphans"
    assert not orphans.exists() or not list(orphans.iterdir())
    assert "never closed" not in m.log_path.read_text()
    assert (v / "done.bin").read_bytes() == data


@pytest.mark.parametrize("after", ["commit", "crash", "unmount"])
def test_a_close_after_reopening_during_the_commit_in_flight_is_committed(fault_proxy, mount_factory, s3, bucket,
                                                                         prefix, after):
    """v1's PUT is slow; a writer opens the file meanwhile and writes only once that PUT is done. Its
    close was lost: v1 uploaded again instead, the journal row of v2 removed (a crash lost v2), and
    unmount waited for ever."""
    m = proxied(mount_factory, fault_proxy, "--no-passthrough")
    v = m.path()
    slow = fault_proxy.stall(3, method="PUT", path=r"/f\.bin", times=1)
    (v / "f.bin").write_bytes(b"v1" * 1000)
    assert wait_until(lambda: slow.fired >= 1, 10)
    fd = os.open(v / "f.bin", os.O_WRONLY | os.O_APPEND)
    try:
        assert wait_until(lambda: m.status()["commits"].get("committed", 0) >= 1, 20)
        os.write(fd, b"+v2")
    finally:
        os.close(fd)
    key, want = f"{prefix}/vol/f.bin", b"v1" * 1000 + b"+v2"
    if after == "commit":
        assert wait_until(lambda: obj(s3, bucket, key) == want, 15), m.status()["commits"]
    elif after == "crash":
        m.kill()
        m.start()
        sync_dir(m.path())
        assert obj(s3, bucket, key) == want
    else:
        assert m.stop(wait=True, timeout=30) == 0
        assert obj(s3, bucket, key) == want


@pytest.mark.parametrize("pt", [(), ("--no-passthrough",)], ids=["passthrough", "no-passthrough"])
def test_renaming_a_committed_file_while_a_writer_changes_it_keeps_the_closed_version(mount_factory, s3, bucket,
                                                                                      prefix, pt):
    """The rename journaled the staging file the writer was changing: a crash then published its
    unclosed bytes under the new name, and the committed version was gone with the old key."""
    m = mount_factory(args=pt)
    v = m.path()
    (v / "f.bin").write_bytes(V1)
    sync_dir(v)
    fd = os.open(v / "f.bin", os.O_WRONLY)
    os.write(fd, b"PARTIAL-UNCLOSED")
    os.rename(v / "f.bin", v / "g.bin")
    time.sleep(1)
    m.kill()
    with contextlib.suppress(OSError):
        os.close(fd)
    m.start()
    sync_dir(m.path())
    assert keys(s3, bucket, f"{prefix}/vol/") == [f"{prefix}/vol/g.bin"]
    assert obj(s3, bucket, f"{prefix}/vol/g.bin") == V1


@pytest.mark.parametrize("how", ["append", "overwrite", "truncate", "append-reopen"])
@pytest.mark.parametrize("pt", [(), ("--no-passthrough",)], ids=["passthrough", "no-passthrough"])
def test_a_crash_after_one_of_two_writers_closed_publishes_only_what_that_close_covered(mount_factory, s3, bucket,
                                                                                       prefix, how, pt):
    """B opens the file before A closes it; A's close makes its version durable and journaled, and B
    goes on writing without closing. A crash then must publish A's version, never B's unclosed bytes
    (before, the journal row named the one staging file B was still changing)."""
    m = mount_factory(args=pt)
    v = m.path()
    fa = os.open(v / "log.txt", os.O_CREAT | os.O_WRONLY, 0o644)
    fb = os.open(v / "log.txt", os.O_WRONLY | (os.O_APPEND if how.startswith("append") else 0))
    fc = None
    try:
        os.write(fa, V1)
        os.close(fa)  # A's close: V1 is promised
        if how.startswith("append"):
            os.write(fb, b"UNCLOSED")
            if pt == ("--no-passthrough",):
                assert m.status()["commits"].get("closed_versions_kept", 0) == 0  # appends copy nothing
            if how == "append-reopen":
                fc = os.open(v / "log.txt", os.O_WRONLY | os.O_APPEND)  # keeps A's version, not B's bytes
        elif how == "overwrite":
            os.pwrite(fb, b"UNCLOSED", 1000)
        else:
            os.ftruncate(fb, 1000)
            os.pwrite(fb, b"UNCLOSED", 1000)
        time.sleep(0.5)
        m.kill()
    finally:
        for fd in (fb, fc):
            with contextlib.suppress(OSError, TypeError):
                os.close(fd)
    m.start()
    assert (m.path() / "log.txt").read_bytes() == V1
    sync_dir(m.path())
    got = obj(s3, bucket, f"{prefix}/vol/log.txt")
    assert got == V1, (len(got), got[995:1010])
    # B's unclosed bytes are kept aside for the user, not lost and not published.
    kept = [p.read_bytes() for p in (m.state_dir / "orphans").iterdir()]
    assert any(b"UNCLOSED" in k for k in kept)


@pytest.mark.parametrize("pt", [(), ("--no-passthrough",)], ids=["passthrough", "no-passthrough"])
def test_with_no_crash_the_other_writers_close_supersedes(mount_factory, s3, bucket, prefix, pt):
    """A closes while B still writes: the file is committed as B's close left it."""
    m = mount_factory(args=pt)
    v = m.path()
    fa = os.open(v / "log.txt", os.O_CREAT | os.O_WRONLY, 0o644)
    fb = os.open(v / "log.txt", os.O_WRONLY)
    os.write(fa, V1)
    os.close(fa)
    os.pwrite(fb, b"B-LINE", len(V1))
    os.pwrite(fb, b"B-EDIT", 10)
    os.close(fb)
    sync_dir(v)
    want = V1[:10] + b"B-EDIT" + V1[16:] + b"B-LINE"
    assert obj(s3, bucket, f"{prefix}/vol/log.txt") == want
    assert (v / "log.txt").read_bytes() == want


@pytest.mark.parametrize("pt", [(), ("--no-passthrough",)], ids=["passthrough", "no-passthrough"])
def test_a_log_opened_for_each_line_is_not_copied_at_each_open(mount_factory, s3, bucket, prefix, pt):
    """The training-loop logger: open with 'a', write a line, close, at every step. Each open came
    while the last close still waited for its commit, and copied the whole file aside (49 copies of
    4 MiB for 50 lines). An append-only open cannot change what that close left, so nothing is
    copied; the lines all reach the store, in order."""
    m, v, head = logged_mount(mount_factory, pt, 4 << 20)
    kept0 = kept_versions(m)
    lines = [f"step {i} loss {1 / (i + 1):.4f}\n".encode() for i in range(50)]
    for line in lines:
        with open(v / "train.log", "ab") as f:
            f.write(line)
        time.sleep(0.02)
    sync_dir(v)
    kept = kept_versions(m) - kept0
    assert kept <= 5, kept  # (only when a commit's turn comes while a line is being written)
    assert obj(s3, bucket, f"{prefix}/vol/train.log") == head + b"".join(lines)


@pytest.mark.parametrize("pt", [(), ("--no-passthrough",)], ids=["passthrough", "no-passthrough"])
def test_a_commit_due_while_a_line_is_written_waits_for_it_rather_than_copy_the_file(
        mount_factory, s3, bucket, prefix, pt):
    """The logger again, its commit coming due while the next line is being written (the moment a
    loaded host makes likely): the commit gives that writer a moment to close, then sends both
    lines together. Before, it copied the whole file aside at once, to send the first line alone."""
    m, v, head = logged_mount(mount_factory, pt, 1 << 20)
    kept0 = kept_versions(m)
    with open(v / "train.log", "ab") as f:
        f.write(b"step 1\n")  # its close is committed once COMMIT_SETTLE_S has passed
    with open(v / "train.log", "ab") as f:
        f.write(b"step 2\n")
        f.flush()
        time.sleep(COMMIT_SETTLE_S * 1.4)  # that turn comes meanwhile; this close comes within one more
    sync_dir(v)
    assert kept_versions(m) - kept0 == 0
    assert obj(s3, bucket, f"{prefix}/vol/train.log") == head + b"step 1\nstep 2\n"


@pytest.mark.parametrize("pt", [(), ("--no-passthrough",)], ids=["passthrough", "no-passthrough"])
def test_an_appender_holding_the_file_open_does_not_hold_back_its_last_close(mount_factory, s3, bucket, prefix,
                                                                             pt):
    """A file closed, then opened for appending and held open (a log handler for the rest of the
    run): the closed version is committed meanwhile, not only once the appender lets go; the
    appender's own lines follow at its close."""
    m = mount_factory(args=pt)
    v = m.path()
    (v / "metrics.jsonl").write_bytes(V1)
    with open(v / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 1}\n')
        f.flush()
        assert wait_until(lambda: f"{prefix}/vol/metrics.jsonl" in keys(s3, bucket, f"{prefix}/vol/"), 10)
        assert obj(s3, bucket, f"{prefix}/vol/metrics.jsonl") == V1
    sync_dir(v)
    assert obj(s3, bucket, f"{prefix}/vol/metrics.jsonl") == V1 + b'{"step": 1}\n'
