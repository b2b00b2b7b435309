"""Store faults through a real mount (README "Semantics": Reads, Durability; issue 5 "Faults").

The mount talks to the S3 server through a `FaultProxy` (ucfs.testing.faults) that answers chosen
requests with 500/503, resets connections, stalls or truncates responses, or takes the whole store away
for a while. What the tests hold the mount to:

- a read returns exactly the object's bytes (length and SHA-256 checked) or fails with EIO once the
  retry budget is spent - never other bytes, never a short read, never EAGAIN;
- a closed file is committed once the store is back, with nothing lost;
- a 30 s outage in the middle of a read/write loop is ridden out without a remount;
- a drain the store does not let finish ends on a signal, and the next mount commits what is left.

Faults are counted by the proxy; the totals are printed (-s shows them) for the issue's closing note.
"""

from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import os
import random
import re
import signal
import subprocess
import threading
import time

import pytest

from tests.support import forget_unused_inodes, keys, obj, sync_dir, wait_until

MiB = 1 << 20
KiB = 1 << 10

# How the daemon under test retries (MountConfig.store_max_attempts): a request that fails this many
# times in a row is given up.
ATTEMPTS = 5


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def put_many(s3, bucket, items: dict[str, bytes], threads: int = 16) -> None:
    with concurrent.futures.ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda kv: s3.put_object(Bucket=bucket, Key=kv[0], Body=kv[1]), items.items()))


def read_all(path) -> bytes:
    """Read a file the way most programs do; raises OSError with the errno the mount answered."""
    with open(path, "rb", buffering=0) as f:
        chunks = []
        while True:
            b = f.read(MiB)
            if b is None:  # EAGAIN on a blocking file: a lie we must never tell
                raise AssertionError(f"read of {path} returned None (EAGAIN)")
            if not b:
                return b"".join(chunks)
            chunks.append(b)


def proxied(mount_factory, fault_proxy, *args: str, **kw):
    """A mount whose store requests all go through the fault proxy. A short store timeout keeps stalls
    short: a request silent for that long is abandoned and retried."""
    return mount_factory(args=("--store-timeout", "2", *args), endpoint=fault_proxy.endpoint, **kw)


def report(name: str, fault_proxy) -> None:
    st = {k: v for k, v in fault_proxy.statistics().items() if k.startswith("fault_") or k == "requests"}
    print(f"\n[faults] {name}: {st}")


# --------------------------------------------------------------------------------------------------
# Reads


def test_reads_ride_out_transient_faults_with_the_right_bytes(fault_proxy, mount_factory, s3, bucket, prefix):
    """Each kind of transient fault, fewer times than the retry budget: every read still succeeds."""
    m = proxied(mount_factory, fault_proxy)
    listing = ""

    phases = {
        "errors": lambda p: [fault_proxy.fail(500, method="GET", path=p, times=2),
                             fault_proxy.fail(503, method="GET", path=p, times=2)],
        "resets": lambda p: [fault_proxy.reset(method="GET", path=p, times=2),
                             fault_proxy.reset(method="GET", path=p, times=2, after_response=True)],
        "truncated": lambda p: [fault_proxy.truncate(100 * KiB, method="GET", path=p, times=2),
                                fault_proxy.truncate(3 * MiB, method="GET", path=p, times=2, end="reset")],
        "stalled": lambda p: [fault_proxy.stall(20, method="GET", path=p, times=2),
                              fault_proxy.stall(20, method="GET", path=p, times=1, after_bytes=MiB)],
        "metadata": lambda p: [fault_proxy.fail(503, method="HEAD", path=p, times=2),
                               fault_proxy.fail(500, method="GET", path=listing, times=2),
                               fault_proxy.reset(method="HEAD", path=p, times=2)],
    }
    for phase, make_rules in phases.items():
        base = f"{prefix}/vol/{phase}/"
        files = {base + "big.bin": os.urandom(24 * MiB + 17)}
        files.update({base + f"s{i}.bin": os.urandom(200 * KiB + i) for i in range(8)})
        put_many(s3, bucket, files)
        # LIST requests name the prefix in their query string (percent-encoded).
        listing = rf"^/{bucket}\?(?=.*list-type=2)(?=.*prefix={prefix}%2Fvol%2F{phase})"
        rules = make_rules(re.escape(f"/{bucket}/{base}"))
        t0 = time.monotonic()
        for key, data in files.items():
            got = read_all(m.mountpoint / "test" / "s" / key.split("/", 1)[1])
            assert len(got) == len(data) and sha(got) == sha(data), f"{phase}: {key} came back wrong"
        elapsed = time.monotonic() - t0
        fired = sum(r.fired for r in rules)
        assert fired >= 2, f"{phase}: the faults never struck ({[r.fired for r in rules]})"
        if phase == "stalled":
            # Abandoned after --store-timeout (2 s) each, not waited out (20 s each).
            assert elapsed < 20, f"stalled reads took {elapsed:.1f} s: the store timeout did not apply"
        for r in rules:
            fault_proxy.remove(r)
    stats = m.store_stats()
    assert stats["attempts"] > stats.get("get", 0) + stats.get("head", 0)  # retries happened
    report("transient read faults", fault_proxy)


def test_reads_fail_with_eio_after_the_retry_budget_then_recover(fault_proxy, mount_factory, s3, bucket, prefix):
    """A fault that outlasts the retry budget: the read fails with EIO (not EAGAIN, not a short read),
    within bounded time, loudly logged; once the fault is gone the same file reads right."""
    kinds = ["500", "503", "reset", "truncate", "stall"]
    files = {k: os.urandom(5 * MiB + 3) for k in kinds}
    put_many(s3, bucket, {f"{prefix}/vol/{k}.bin": d for k, d in files.items()})
    m = proxied(mount_factory, fault_proxy, "--store-timeout", "1")  # the stall case waits it out 5+ times
    took = {}
    for kind, data in files.items():
        key = f"{prefix}/vol/{kind}.bin"
        p = m.path() / f"{kind}.bin"
        assert os.stat(p).st_size == len(data)  # the lookup is done; only the data GETs will fail
        match = {"method": "GET", "path": re.escape(f"/{bucket}/{key}") + "$"}
        rule = {"500": lambda: fault_proxy.fail(500, **match),
                "503": lambda: fault_proxy.fail(503, **match),
                "reset": lambda: fault_proxy.reset(**match),
                "truncate": lambda: fault_proxy.truncate(64 * KiB, **match),
                "stall": lambda: fault_proxy.stall(30, **match)}[kind]()
        t0 = time.monotonic()
        with pytest.raises(OSError) as e:
            read_all(p)
        took[kind] = round(time.monotonic() - t0, 1)
        assert e.value.errno == errno.EIO, f"{kind}: expected EIO, got {e.value!r}"
        assert rule.fired >= ATTEMPTS
        assert took[kind] < 60, f"{kind}: giving up took {took[kind]} s"
        rule.disable()
        got = read_all(p)
        assert len(got) == len(data) and sha(got) == sha(data), kind
    # The give-up was logged, and louder as the retries repeated (INFO, then WARNING, then ERROR).
    log = m.log_path.read_text()
    assert re.search(r" INFO ucfs\.store: GET .*retrying \(attempt 1 of 5\)", log)
    assert re.search(r" WARNING ucfs\.store: GET .*retrying \(attempt 2 of 5\)", log)
    assert re.search(r" ERROR ucfs\.store: GET .*retrying \(attempt 4 of 5\)", log)
    assert re.search(r" ERROR ucfs\.fs: read: I/O error", log)
    report(f"reads until EIO, seconds to give up {took}", fault_proxy)


def test_a_read_the_store_refuses_midway_is_eio_with_the_reason_logged(fault_proxy, mount_factory, s3, bucket,
                                                                         prefix):
    """The store answers 403 (a policy changed, credentials expired) to the GETs of a file being
    read: read(2) failed with EACCES, which it never returns and readers do not expect of a file
    they opened; it is EIO, as for a read the store cannot serve, with the store's answer logged."""
    data = os.urandom(48 * MiB)
    key = f"{prefix}/vol/big.bin"
    s3.put_object(Bucket=bucket, Key=key, Body=data)
    m = proxied(mount_factory, fault_proxy)
    with open(m.path() / "big.bin", "rb", buffering=0) as f:
        assert f.read(MiB) == data[:MiB]
        fault_proxy.fail(403, method="GET", path=re.escape(f"/{bucket}/{key}") + "$")
        with pytest.raises(OSError) as e:
            while f.read(8 * MiB):
                pass
    assert e.value.errno == errno.EIO, e.value
    assert re.search(r" ERROR ucfs\.fs: read: I/O error: .*code=AccessDenied status=403", m.log_path.read_text())


def test_a_store_refusing_a_listing_or_lookup_is_its_errno_and_a_log_line_saying_why(
        fault_proxy, mount_factory, s3, bucket, prefix):
    """403 (a policy, expired credentials) or a bucket deleted under the mount: the caller gets
    EACCES or ENXIO, which nothing on this host decided, so the log must say what the store
    answered. It said nothing (only EIO was logged): `ls` as root failing with "Permission denied"
    left no trace of why."""
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/a/x.bin", Body=b"x")
    m = proxied(mount_factory, fault_proxy)
    v = m.path()
    listing = rf"^/{bucket}\?.*list-type=2"
    cases = [("403 on a listing", lambda: fault_proxy.fail(403, method="GET", path=listing), v / "a", os.listdir,
              errno.EACCES, "AccessDenied"),
             ("bucket gone", lambda: fault_proxy.fail(404, code="NoSuchBucket", method="GET", path=listing),
              v / "b", os.listdir, errno.ENXIO, "NoSuchBucket"),
             ("403 on a lookup", lambda: fault_proxy.fail(403, method="HEAD|GET"), v / "c.bin", os.stat,
              errno.EACCES, "AccessDenied")]
    for what, fault, path, op, want, code in cases:
        rule = fault()
        with pytest.raises(OSError) as e:
            op(path)
        assert e.value.errno == want, (what, e.value)
        rule.disable()
        assert re.search(rf" WARNING ucfs\.fs: \w+: {re.escape(os.strerror(want))} from the store: .*code={code}",
                         m.log_path.read_text()), (what, m.log_tail())
    assert os.listdir(v / "a") == ["x.bin"]  # nothing of it stays once the store answers again


def test_random_faults_never_give_wrong_bytes(fault_proxy, mount_factory, s3, bucket, prefix):
    """Many faults at random: each whole-file read is the object exactly, or EIO; nothing else."""
    files = {f"{prefix}/vol/r/{i}.bin": os.urandom(random.Random(i).randrange(1, 3 * MiB)) for i in range(24)}
    put_many(s3, bucket, files)
    m = proxied(mount_factory, fault_proxy, "--cache-size", "4M")  # small cache: most reads hit the store
    p = re.escape(f"/{bucket}/{prefix}/vol/r/")
    fault_proxy.fail(503, path=p, probability=0.15)
    fault_proxy.fail(500, path=p, probability=0.1)
    fault_proxy.reset(path=p, probability=0.1)
    fault_proxy.truncate(7 * KiB, method="GET", path=p, probability=0.15)
    outcomes = {"ok": 0, "eio": 0}
    rng = random.Random(7)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and outcomes["ok"] + outcomes["eio"] < 80:
        key = rng.choice(sorted(files))
        try:
            got = read_all(m.mountpoint / "test" / "s" / key.split("/", 1)[1])
        except OSError as e:
            assert e.errno == errno.EIO, f"{key}: {e!r}"
            outcomes["eio"] += 1
            continue
        assert len(got) == len(files[key]) and sha(got) == sha(files[key]), f"{key}: wrong bytes"
        outcomes["ok"] += 1
    assert outcomes["ok"] > 10
    fault_proxy.clear()
    for key, data in files.items():
        assert read_all(m.mountpoint / "test" / "s" / key.split("/", 1)[1]) == data
    report(f"random faults, reads {outcomes}", fault_proxy)


def test_dead_pooled_connections_do_not_fail_reads(fault_proxy, mount_factory, s3, bucket, prefix):
    """Idle keep-alive connections the server dropped (a restart, an idle timeout) are not a reason
    to fail a read: the client must not burn its retries on them."""
    big = {f"{prefix}/vol/big{i}.bin": os.urandom(96 * MiB) for i in range(2)}
    small = {f"{prefix}/vol/s/{i}.bin": os.urandom(100 * KiB) for i in range(8)}
    put_many(s3, bucket, {**big, **small})
    m = proxied(mount_factory, fault_proxy, "--metadata-ttl", "300")
    for k in small:
        os.stat(m.mountpoint / "test" / "s" / k.split("/", 1)[1])  # known: reading needs one GET
    # Read-ahead of large files runs many GETs at once: the pool fills with idle connections.
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        list(ex.map(lambda k: read_all(m.mountpoint / "test" / "s" / k.split("/", 1)[1]), big))
    fault_proxy.reset_all()  # every pooled connection is now dead
    dead = fault_proxy.faults["outage_resets"]
    assert dead >= ATTEMPTS, f"only {dead} pooled connections: the test proves nothing"
    for k, data in small.items():  # one GET at a time
        got = read_all(m.mountpoint / "test" / "s" / k.split("/", 1)[1])
        assert got == data
    # The kernel retries a failed read-ahead request with a read of its own, which may hide an EIO
    # from the reader; the daemon's log shows every request it failed.
    failed = [line for line in m.log_path.read_text().splitlines() if "ucfs.fs: read: I/O error" in line]
    assert not failed, f"reads failed on dead pooled connections:\n{failed[0]}"
    report(f"{dead} dead pooled connections", fault_proxy)


# --------------------------------------------------------------------------------------------------
# Writes


def test_writes_commit_once_the_store_recovers(fault_proxy, mount_factory, s3, bucket, prefix):
    """Every write request fails for a while: close() still returns at once (write-behind), fsync waits,
    and once the store is back every file is committed with its exact content."""
    m = proxied(mount_factory, fault_proxy)
    v = m.path()
    (v / "w").mkdir()  # mkdir writes its marker at once: before the store starts refusing
    outage = fault_proxy.fail(503, method="PUT|POST")
    files = {f"w/small{i}.bin": os.urandom(100 * KiB + i) for i in range(12)}
    files["w/big.bin"] = os.urandom(40 * MiB + 1)  # multipart, streamed while written
    t0 = time.monotonic()
    for rel, data in files.items():
        with open(v / rel, "wb") as f:
            f.write(data)
    assert time.monotonic() - t0 < 30
    assert wait_until(lambda: outage.fired >= 5, timeout=30)
    st = m.status()["commits"]
    assert st["pending"] == len(files) and st["failed"] == 0  # transient: retried, not failed

    synced = threading.Event()

    def fsync_big() -> None:
        with open(v / "w/big.bin", "rb") as f:
            os.fsync(f.fileno())
        synced.set()

    t = threading.Thread(target=fsync_big)
    t.start()
    time.sleep(3)
    assert not synced.is_set(), "fsync returned while the store refused every write"
    outage.disable()
    t.join(timeout=120)
    assert synced.is_set()
    sync_dir(v / "w")
    for rel, data in files.items():
        got = obj(s3, bucket, f"{prefix}/vol/{rel}")
        assert len(got) == len(data) and sha(got) == sha(data), rel
    assert m.status()["commits"]["pending"] == 0
    assert not s3.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/").get("Uploads")
    log = m.log_path.read_text()
    assert re.search(r" WARNING ucfs\.commit: commit of .* failed \(attempt 1\)", log)
    report(f"writes during {outage.fired} refused write requests", fault_proxy)


def test_a_signal_ends_a_drain_the_store_refuses_and_the_next_mount_commits(fault_proxy, mount_factory, s3,
                                                                             bucket, prefix):
    """Unmounted from outside (fusermount3 -u) while the store refuses writes, the daemon drains and
    cannot finish: it keeps trying, holding its cache directory. A SIGTERM ends the drain and the daemon;
    the file stays staged, and the next mount of that cache directory commits it."""
    m = proxied(mount_factory, fault_proxy)
    v = m.path()
    refused = fault_proxy.fail(503, method="PUT|POST")
    data = os.urandom(300 * KiB)
    (v / "late.bin").write_bytes(data)  # close() returns: staged and journaled
    assert wait_until(lambda: refused.fired >= 1, timeout=30)
    subprocess.run(["fusermount3", "-u", str(m.mountpoint)], check=True)
    assert wait_until(lambda: "draining: 1 file(s)" in m.log_path.read_text(), timeout=10), m.log_tail()
    time.sleep(1)
    assert m.proc.poll() is None, "the daemon gave up a pending commit on its own"
    m.proc.send_signal(signal.SIGTERM)
    assert m.proc.wait(timeout=30) == 0, m.log_tail()
    assert re.search(r"stopped draining \(received SIGTERM\): 1 file\(s\)", m.log_path.read_text()), m.log_tail()
    assert keys(s3, bucket, f"{prefix}/vol/") == []
    refused.disable()
    m.proc = None
    m.start()
    sync_dir(m.path())
    assert obj(s3, bucket, f"{prefix}/vol/late.bin") == data


def test_writes_survive_broken_write_requests(fault_proxy, mount_factory, s3, bucket, prefix):
    """Write requests that break in each way, a few times: the files are committed, exactly once."""
    m = proxied(mount_factory, fault_proxy)
    left_behind = 0
    for fault in ("reset", "reset_after", "truncate", "stall", "complete_lost"):
        d = m.path() / fault
        d.mkdir()
        put = {"method": "PUT", "path": re.escape(f"/{bucket}/{prefix}/vol/{fault}/")}
        rules = {
            "reset": lambda: [fault_proxy.reset(times=3, **put)],
            # The server stored the object but the client never heard: retrying must be harmless.
            "reset_after": lambda: [fault_proxy.reset(times=3, after_response=True, **put)],
            # PUT answers have no body to cut; multipart create and complete answers (XML) do.
            "truncate": lambda: [fault_proxy.truncate(20, method="POST", path=rf"{fault}/.*\?uploads", times=1),
                                 fault_proxy.truncate(20, method="POST", path=rf"{fault}/.*uploadId=", times=1)],
            "stall": lambda: [fault_proxy.stall(20, times=2, **put)],
            # CompleteMultipartUpload done by the server, its answer lost: the retry finds no upload.
            "complete_lost": lambda: [fault_proxy.reset(method="POST", path=rf"{fault}/.*uploadId=", times=1,
                                                        after_response=True)],
        }[fault]()
        files = {f"f{i}.bin": os.urandom(200 * KiB + i) for i in range(4)}
        files["big.bin"] = os.urandom(20 * MiB + 5)  # multipart
        for rel, data in files.items():
            (d / rel).write_bytes(data)
        sync_dir(d)
        for rel, data in files.items():
            got = obj(s3, bucket, f"{prefix}/vol/{fault}/{rel}")
            assert len(got) == len(data) and sha(got) == sha(data), f"{fault}: {rel}"
        st = m.status()["commits"]
        assert st["pending"] == 0 and st["failed"] == 0, (fault, st)
        assert sum(r.fired for r in rules) >= 1, fault
        left = s3.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/vol/{fault}/").get("Uploads") or []
        if fault == "truncate":
            # A CreateMultipartUpload whose answer is lost leaves an upload only the server knows of:
            # the client never learnt its id and cannot tell it from another host's upload of the
            # same key. It is invisible and holds no object; a bucket lifecycle rule
            # (AbortIncompleteMultipartUpload) removes it. Nothing else may be left.
            assert len(left) <= rules[0].fired, left
            left_behind = len(left)
        else:
            assert not left, (fault, left)
        for r in rules:
            fault_proxy.remove(r)
    report(f"broken write requests; {left_behind} unknown multipart upload(s) left by a lost create answer",
           fault_proxy)


# --------------------------------------------------------------------------------------------------
# An outage


@pytest.mark.slow
def test_a_30s_outage_in_a_read_write_loop_is_survived(fault_proxy, mount_factory, s3, bucket, prefix):
    """Readers and writers keep going while the store vanishes for 30 s. During the outage reads and
    opens may fail with EIO (and nothing else); afterwards everything works again without a remount,
    and every file whose close() succeeded is in the store with its content."""
    readable = {f"{prefix}/vol/r/{i}.bin": os.urandom(256 * KiB + i) for i in range(60)}
    put_many(s3, bucket, readable)
    m = proxied(mount_factory, fault_proxy, "--cache-size", "8M")
    v = m.path()
    (v / "w").mkdir()
    pid = m.proc.pid
    closed: dict[str, bytes] = {}  # rel path -> content of the last successful close
    events: list[tuple[float, str, str]] = []  # (time, "read"/"write", "ok" or errno name)
    stop = threading.Event()
    lock = threading.Lock()

    def note(kind: str, what: str) -> None:
        with lock:
            events.append((time.monotonic(), kind, what))

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        keys = sorted(readable)
        while not stop.is_set():
            key = rng.choice(keys)
            try:
                got = read_all(v / key.split("/vol/", 1)[1])
            except OSError as e:
                note("read", errno.errorcode.get(e.errno, str(e.errno)))
                time.sleep(0.05)
                continue
            assert got == readable[key], f"{key}: wrong bytes"
            note("read", "ok")

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        i = 0
        while not stop.is_set():
            # New files and overwrites of earlier ones.
            rel = f"w/{seed}-{rng.randrange(i + 1) if i and rng.random() < 0.3 else i}.bin"
            i += 1
            data = os.urandom(rng.randrange(1, 200 * KiB))
            try:
                with open(v / rel, "wb") as f:
                    f.write(data)
            except OSError as e:
                note("write", errno.errorcode.get(e.errno, str(e.errno)))
                time.sleep(0.05)
                continue
            with lock:
                closed[rel] = data
            note("write", "ok")
            time.sleep(0.02)

    failures: list[BaseException] = []

    def guarded(fn, seed: int) -> None:
        try:
            fn(seed)
        except BaseException as e:  # noqa: BLE001 - a wrong byte in a thread fails the test below
            failures.append(e)
            stop.set()

    threads = [threading.Thread(target=guarded, args=(reader, s)) for s in range(4)]
    threads += [threading.Thread(target=guarded, args=(writer, s)) for s in range(2)]
    for t in threads:
        t.start()
    time.sleep(6)
    outage_start = time.monotonic()
    fault_proxy.outage(30)
    time.sleep(30)
    outage_end = time.monotonic()
    time.sleep(14)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert not failures, failures
    assert m.proc.poll() is None and m.proc.pid == pid and os.path.ismount(m.mountpoint)

    # Recovery: connections are re-made and retries back off for a few seconds at most.
    grace = 8
    before = [e for e in events if e[0] < outage_start]
    during = [e for e in events if outage_start <= e[0] < outage_end + grace]
    after = [e for e in events if e[0] >= outage_end + grace]
    assert before and all(e[2] == "ok" for e in before), [e for e in before if e[2] != "ok"][:5]
    assert {e[2] for e in during} <= {"ok", "EIO"}, {e[2] for e in during}
    assert after and all(e[2] == "ok" for e in after), [e for e in after if e[2] != "ok"][:5]
    assert any(e[1] == "read" for e in after) and any(e[1] == "write" for e in after)

    # Every closed file reaches the store with its last content.
    sync_dir(v / "w")
    assert wait_until(lambda: m.status()["commits"]["pending"] == 0, timeout=120)
    for rel, data in closed.items():
        assert obj(s3, bucket, f"{prefix}/vol/{rel}") == data, rel
    counts = {k: sum(1 for e in events if (e[1], e[2]) == k) for k in
              {(e[1], e[2]) for e in events}}
    report(f"30 s outage: {len(closed)} files closed and committed, outcomes {counts}", fault_proxy)


# --------------------------------------------------------------------------------------------------
# A store that cannot be reached


def test_cached_files_stay_readable_while_the_store_cannot_be_reached(fault_proxy, mount_factory, s3, bucket,
                                                                      prefix):
    """README "Semantics": Reads. A job has read its files once; then the store goes away, long after
    every metadata TTL: lookups, stat, `ls -l` and reads of the cached files go on from what was known,
    without paying the retry budget per file; data that is not cached fails with EIO. Once the store is
    back, a change made meanwhile is seen, with no remount."""
    d = f"{prefix}/vol/d"
    files = {f"{d}/{i:02d}.bin": os.urandom(300 * KiB + i) for i in range(20)}
    put_many(s3, bucket, {**files, f"{d}/uncached.bin": os.urandom(2 * MiB)})
    m = proxied(mount_factory, fault_proxy, "--metadata-ttl", "0.5")
    dpath = m.path() / "d"
    for key, data in files.items():
        assert read_all(m.path() / key.split("/vol/", 1)[1]) == data
    listed = subprocess.run(["ls", "-l", str(dpath)], capture_output=True, text=True, check=True).stdout
    assert os.stat(dpath / "uncached.bin").st_size == 2 * MiB

    fault_proxy.outage(120)
    time.sleep(1.5)  # every name's TTL has run out
    t0 = time.monotonic()
    for key, data in files.items():
        p = m.path() / key.split("/vol/", 1)[1]
        assert os.stat(p).st_size == len(data)
        assert read_all(p) == data
    # ls -l during the outage shows what it showed before it (sizes; times are the objects').
    during = subprocess.run(["ls", "-l", str(dpath)], capture_output=True, text=True, check=True).stdout
    assert during == listed
    took = time.monotonic() - t0
    # Asking the store costs a caller its retry budget (~1.5 s with connections refused): 40 lookups,
    # stats and opens that each asked would take a minute. Answered from what is known, the store is
    # asked again only now and then.
    assert took < 15, f"reading 20 cached files in the outage took {took:.1f} s"
    t0 = time.monotonic()
    with pytest.raises(OSError) as e:
        read_all(dpath / "uncached.bin")
    assert e.value.errno == errno.EIO
    # Once a request has found no store at all, the next ones try once: not ~1.5 s of back-off each
    # (the kernel asks twice: its read-ahead, then the page it was reading).
    took = time.monotonic() - t0
    assert took < 1.2, f"a read of uncached data in the outage took {took:.1f} s to fail"
    down = m.status()["unreachable"]
    assert list(down) and next(iter(down.values()))["answered_from_known"] >= 20, down
    # A file written meanwhile in a directory the mount knows is staged, to be committed later.
    written = os.urandom(50 * KiB)
    with open(dpath / "written-meanwhile.bin", "wb") as f:
        f.write(written)

    # Meanwhile another host changed a file; once the store answers again the change is seen.
    changed = os.urandom(100 * KiB)
    s3.put_object(Bucket=bucket, Key=f"{d}/00.bin", Body=changed)
    fault_proxy.end_outage()
    assert wait_until(lambda: read_all(dpath / "00.bin") == changed, timeout=40)
    assert m.status()["unreachable"] == {}
    sync_dir(dpath)
    assert obj(s3, bucket, f"{d}/written-meanwhile.bin") == written
    log = m.log_path.read_text()
    assert re.search(r" WARNING ucfs\.core: store '.*' cannot be reached .*answer from what was known", log)
    assert re.search(r" WARNING ucfs\.core: store '.*' answers again after [\d.]+ s; \d+ answers", log)
    assert f"ucfs.store: GET {bucket}?prefix={prefix}/vol/d/: " in log  # a LIST's retries say what it was for


def test_cached_files_stay_readable_in_an_outage_after_the_kernel_forgets_them(fault_proxy, mount_factory, s3,
                                                                              bucket, prefix):
    """As above, with memory pressure: the kernel forgets the inodes nobody holds (it sends FORGET)
    while the store cannot be reached. What was known of a directory went with its inode: its next
    lookup had no listing to answer from, and every cached file under it failed with EIO (seen when
    another test made the whole machine drop its caches during the test above)."""
    d = f"{prefix}/vol/a/b"
    files = {f"{d}/{i:02d}.bin": os.urandom(100 * KiB + i) for i in range(5)}
    put_many(s3, bucket, files)
    m = proxied(mount_factory, fault_proxy, "--metadata-ttl", "0.5")
    paths = {m.path() / key.split("/vol/", 1)[1]: data for key, data in files.items()}
    for p, data in paths.items():
        assert read_all(p) == data
    dpath = m.path() / "a" / "b"
    listed = subprocess.run(["ls", "-l", str(dpath)], capture_output=True, text=True, check=True).stdout

    fault_proxy.outage(120)
    time.sleep(1.0)  # every name's TTL has run out
    known = m.status()["inodes"]
    assert forget_unused_inodes(m.mountpoint)
    # The files, a/b, a, and the volume's own directory are forgotten.
    assert wait_until(lambda: m.status()["inodes"] <= known - len(files) - 3, timeout=10), (known, m.status()["inodes"])
    for p, data in paths.items():
        assert os.stat(p).st_size == len(data)
        assert read_all(p) == data
    during = subprocess.run(["ls", "-l", str(dpath)], capture_output=True, text=True, check=True).stdout
    assert during == listed
    fault_proxy.end_outage()


def test_without_stale_answers_an_unreachable_store_fails_lookups_with_eio(fault_proxy, mount_factory, s3, bucket,
                                                                            prefix):
    """`--stale-if-error 0`: what was known answers nothing once its TTL has run out; the caller gets
    EIO and the log says why, as before the store went away."""
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/d/a.bin", Body=b"a" * 1000)
    m = proxied(mount_factory, fault_proxy, "--metadata-ttl", "0.5", "--stale-if-error", "0")
    p = m.path() / "d" / "a.bin"
    assert read_all(p) == b"a" * 1000
    fault_proxy.outage(60)
    time.sleep(1.5)
    with pytest.raises(OSError) as e:
        os.stat(p)
    assert e.value.errno == errno.EIO
    assert m.status()["core"].get("stale_answers", 0) == 0
    fault_proxy.end_outage()
    assert wait_until(lambda: os.stat(p).st_size == 1000, timeout=30)
