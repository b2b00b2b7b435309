"""A bounded soak: 32 readers and 8 writers on one shared tree, checked against a model (issue 5 "Load").

Writers overwrite files in place, replace them by rename, delete them, and fsync some; every version
of every file is self-describing (its path, version and size in a header, then bytes derived from
them), so any read can be checked exactly. The model records when each change started and ended;
a read that opened at t0 and finished at t1 may see the state the file had when the last change
before t0 ended, or the state of any change that started before t1 (a change still being written may
show as a prefix of its new content; ESTALE is allowed for a read that overlaps a change, as the
README says). Anything else - mixed versions, a wrong byte, an old version after a newer one was
closed, a lost file - fails the test. At the end every file must be in the store as the model says,
and again after a remount; the event loop must never have stalled for more than 100 ms.

Meanwhile the kernel is made to drop every dentry and inode of the mount that nobody uses, about
once a second (a remount that changes nothing, as root), as memory pressure on a training host
makes it do: it then sends FORGET for them, and the daemon lets their inodes go - while listings,
commits and opens of the same names are on their way.

UCFS_SOAK_S sets the duration (default 150 s, "a few minutes" within the suite's time; CI keeps the
default; 180 s and more are worth a run after changes to the namespace or commit code).
"""

from __future__ import annotations

import errno
import json
import os
import random
import sqlite3
import threading
import time
from dataclasses import dataclass, field

import pytest

from tests.support import foreign_page, forget_unused_inodes, wait_until

KiB = 1 << 10
MiB = 1 << 20
HEADER = 64
DIRS = ("a", "b/c", "b/d")
NAMES = [f"f{i:02d}.bin" for i in range(12)]
PATHS = [f"{d}/{n}" for d in DIRS for n in NAMES]  # 36 files shared by every reader and writer
READERS, WRITERS = 32, 8
DURATION_S = float(os.environ.get("UCFS_SOAK_S", "150"))


def content(path: str, version: int, size: int) -> bytes:
    """The bytes of `version` of `path`: a header saying so, then a pattern only this version has."""
    head = f"{path}|{version}|{size}|".encode().ljust(HEADER, b".")
    block = random.Random(f"{path}#{version}").randbytes(4096)
    body = block * ((size - HEADER) // 4096 + 1)
    return head + body[:size - HEADER]


def parse_header(data: bytes) -> tuple[str, int, int] | None:
    try:
        path, version, size, _ = data[:HEADER].decode().split("|", 3)
        return path, int(version), int(size)
    except (UnicodeDecodeError, ValueError):
        return None


def pick_size(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.03:
        return rng.randrange(17 * MiB, 24 * MiB)  # multipart commits
    if r < 0.15:
        return rng.randrange(MiB, 3 * MiB)  # several blocks, read-ahead
    return rng.randrange(HEADER, 200 * KiB)


@dataclass
class Change:
    kind: str  # "write" (in place), "replace" (write a temporary name, rename over) or "delete"
    version: int
    size: int
    start: float
    end: float | None = None


@dataclass
class PathModel:
    changes: list[Change] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one writer per file at a time


class Model:
    def __init__(self) -> None:
        self.paths = {p: PathModel() for p in PATHS}
        self.lock = threading.Lock()
        self.versions = iter(range(1, 1 << 62))

    def begin(self, path: str, kind: str, size: int) -> Change:
        with self.lock:
            c = Change(kind, next(self.versions), size, time.monotonic())
            self.paths[path].changes.append(c)
            return c

    def end(self, c: Change) -> None:
        with self.lock:
            c.end = time.monotonic()

    def allowed(self, path: str, t0: float, t1: float) -> tuple[Change | None, list[Change]]:
        """(the settled change before t0, the changes overlapping [t0, t1])."""
        with self.lock:
            changes = list(self.paths[path].changes)
        settled = None
        for c in changes:
            if c.end is not None and c.end < t0 and (settled is None or c.end > settled.end):
                settled = c
        overlapping = [c for c in changes if c.start < t1 and (c.end is None or c.end >= t0) and c is not settled]
        return settled, overlapping

    def history(self, path: str, since: float) -> str:
        with self.lock:
            recent = [c for c in self.paths[path].changes if c.end is None or c.end >= since]
        return ", ".join(f"{c.kind} v{c.version} [{c.start:.3f}, {'open' if c.end is None else f'{c.end:.3f}'}]"
                         for c in recent)

    def final(self, path: str) -> Change | None:
        with self.lock:
            done = [c for c in self.paths[path].changes if c.end is not None]
        return max(done, key=lambda c: c.end) if done else None


def check_read(model: Model, path: str, t0: float, t1: float, data: bytes | None, err: int | None) -> str:
    """'' when the outcome is one the model allows, else why not.

    A read that overlaps no in-place write must return exactly one allowed version. One that overlaps
    an in-place write may, as on a local file system, see the file part old and part new (a reader's
    open handle sees the writer's data at once: read-your-writes); then every 4 KiB of what it got
    must still be the bytes of some allowed version at that offset (byte by byte where a page is torn
    between two), and nothing may come from nowhere.
    """
    settled, overlapping = model.allowed(path, t0, t1)
    states = ([settled] if settled is not None else []) + overlapping
    versions = [c for c in states if c.kind != "delete"]
    in_place = [c for c in overlapping if c.kind == "write"]
    if err is not None:
        if err == errno.ENOENT:
            gone = settled is None or settled.kind == "delete"
            if gone or any(c.kind in ("delete", "replace") for c in overlapping):
                return ""
            return f"ENOENT, but version {settled.version} was closed before the open"
        if err == errno.ESTALE and overlapping:
            return ""
        return f"error {errno.errorcode.get(err, err)}"
    assert data is not None
    allowed = [(c.kind, c.version) for c in states]
    if in_place:
        if len(data) > max(c.size for c in versions):
            return f"{len(data)} bytes, longer than any allowed version {allowed}"
        expected = [content(path, c.version, c.size) for c in versions]
        off = foreign_page(data, expected)
        if off is not None:
            piece = data[off:off + 4096]
            zeros = piece.count(0) == len(piece)
            return (f"bytes at {off} of {len(data)} are from no allowed version {allowed} "
                    f"({'zeros' if zeros else piece[:16].hex()}; sizes {[c.size for c in versions]})")
        return ""
    head = parse_header(data) if data else None
    if head is None or head[0] != path:
        return f"{len(data)} bytes that are no version of {path}: {data[:40]!r}; allowed {allowed}"
    _, version, size = head
    match = next((c for c in versions if c.version == version), None)
    if match is None:
        return f"version {version}, allowed {allowed} (stale, or from nowhere)"
    if data != content(path, version, size):
        return f"version {version}: {len(data)} of {size} bytes, not its content"
    return ""


def log_lines_of(m, paths: list[str], n: int = 80) -> str:
    """The daemon's last `n` log lines that name one of `paths` (its debug log says what each lookup,
    listing, rename and commit decided): what a failure that seldom happens needs to be understood,
    in its message, since the test's directory may be gone by the time someone looks."""
    if not paths:
        return ""
    names = {f"/{p}" for p in paths}
    try:
        lines = m.log_path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"\n(no daemon log: {e})"
    mine = [line for line in lines if any(x in line for x in names)]
    return (f"\nthe daemon's last {min(n, len(mine))} log lines about {sorted(set(paths))} (all of it: "
            f"{m.log_path}):\n" + "\n".join(mine[-n:]))


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}

    def add(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + n


@pytest.mark.slow
def test_soak_readers_and_writers_against_a_model(mount_factory, s3, bucket, prefix):
    # Versions replaced or deleted leave the cache as the mount learns of them (retire): of the
    # 5.5 GB the soak puts in the cache, 34 MB were left at its end with no limit (5.5 GB before),
    # about what its 36 files hold. A cache smaller than that makes eviction run under the load
    # too, beside the readers it takes blocks from.
    m = mount_factory(args=("--cache-size", "32M"))
    v = m.path()
    model, stats = Model(), Stats()
    failures: list[str] = []
    failed_paths: list[str] = []  # whose lines of the daemon's (debug) log a failure shows
    # Every file starts with a first version, committed.
    for d in DIRS:
        (v / d).mkdir(parents=True, exist_ok=True)
    setup_rng = random.Random(0)
    for p in PATHS:
        c = model.begin(p, "write", setup_rng.randrange(HEADER, 100 * KiB))
        (v / p).write_bytes(content(p, c.version, c.size))
        model.end(c)
    fd = os.open(v, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)
    m.status()  # the watchdog has been running since the mount; the soak is what it judges

    deadline = time.monotonic() + DURATION_S
    stop = threading.Event()

    def fail(msg: str, path: str | None = None) -> None:
        failures.append(msg)
        if path is not None:
            failed_paths.append(path)
        stop.set()

    def writer(w: int) -> None:
        rng = random.Random(1000 + w)
        n = 0
        while not stop.is_set() and time.monotonic() < deadline:
            path = rng.choice(PATHS)
            pm = model.paths[path]
            if not pm.lock.acquire(blocking=False):
                continue  # another writer has it; files are shared, writes to one file are not
            try:
                r = rng.random()
                exists = (f := model.final(path)) is not None and f.kind != "delete"
                if r < 0.08 and exists:
                    c = model.begin(path, "delete", 0)
                    os.unlink(v / path)
                    model.end(c)
                    stats.add("deletes")
                    continue
                kind = "replace" if r < 0.25 else "write"
                c = model.begin(path, kind, pick_size(rng))
                data = content(path, c.version, c.size)
                target = v / path if kind == "write" else v / f"{path}.tmp-{w}-{n}"
                n += 1
                with open(target, "wb") as fh:
                    for i in range(0, len(data), MiB):
                        fh.write(data[i:i + MiB])
                    if rng.random() < 0.25:
                        fh.flush()
                        os.fsync(fh.fileno())
                        stats.add("fsyncs")
                if kind == "replace":
                    os.rename(target, v / path)
                    stats.add("renames")
                model.end(c)
                stats.add("writes")
                stats.add("bytes_written", len(data))
            except OSError as e:
                fail(f"writer {w}: {path}: {e!r}")
            finally:
                pm.lock.release()

    def reader(r: int) -> None:
        rng = random.Random(r)
        while not stop.is_set() and time.monotonic() < deadline:
            if rng.random() < 0.05:
                d = rng.choice(DIRS)
                try:
                    names = os.listdir(v / d)
                except OSError as e:
                    fail(f"listdir {d}: {e!r}")
                    return
                stray = [x for x in names if x not in NAMES and ".tmp-" not in x and x not in ("c", "d")]
                if stray:
                    fail(f"listdir {d}: unknown names {stray}")
                stats.add("listings")
                continue
            path = rng.choice(PATHS)
            t0 = time.monotonic()
            data, err = None, None
            try:
                with open(v / path, "rb", buffering=0) as fh:
                    chunks = []
                    while chunk := fh.read(MiB):
                        chunks.append(chunk)
                data = b"".join(chunks)
            except OSError as e:
                err = e.errno
            t1 = time.monotonic()
            why = check_read(model, path, t0, t1, data, err)
            if why:
                wall = time.strftime("%H:%M:%S", time.localtime(time.time() - (time.monotonic() - t0)))
                fail(f"reader {r}: {path} read in [{t0:.3f}, {t1:.3f}] (wall {wall}): {why}; "
                     f"its recent changes: {model.history(path, t0 - 5)}", path)
                return
            stats.add("reads" if err is None else f"reads_{errno.errorcode.get(err, err)}")
            stats.add("bytes_read", len(data or b""))

    def memory_pressure() -> None:
        while not stop.wait(0.7) and time.monotonic() < deadline:
            if not forget_unused_inodes(m.mountpoint):
                stats.add("forgets_refused")  # not root: no pressure
                return
            stats.add("forgets")

    threads = [threading.Thread(target=writer, args=(w,), name=f"writer-{w}") for w in range(WRITERS)]
    threads.append(threading.Thread(target=memory_pressure, name="memory-pressure"))
    threads += [threading.Thread(target=reader, args=(r,), name=f"reader-{r}") for r in range(READERS)]
    t_start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=DURATION_S + 120)
    stuck = [t.name for t in threads if t.is_alive()]
    stop.set()
    soak_s = time.monotonic() - t_start
    assert not stuck, f"threads still blocked after the soak (deadlock?): {stuck}"
    assert not failures, "\n".join(failures[:10]) + log_lines_of(m, failed_paths)

    # Nothing lost: every file reaches the store as the model says.
    fd = os.open(v, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)
    status = m.status()
    assert wait_until(lambda: m.status()["commits"]["pending"] == 0, timeout=60)
    assert status["commits"]["failed"] == 0
    cache = status["cache"]
    assert cache["used_bytes"] <= cache["limit_bytes"] == 32 * MiB, cache
    assert cache.get("evicted", 0) > 0 and cache.get("retired", 0) > 0, cache
    stored = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/vol/"):
        stored.update({o["Key"][len(f"{prefix}/vol/"):]: o["Size"] for o in page.get("Contents", ())})
    for p in PATHS:
        final = model.final(p)
        if final.kind == "delete":
            assert p not in stored, f"{p} was deleted last but is in the store"
            continue
        got = s3.get_object(Bucket=bucket, Key=f"{prefix}/vol/{p}")["Body"].read()
        assert got == content(p, final.version, final.size), f"{p}: store does not hold version {final.version}"
    assert not [k for k in stored if ".tmp-" in k], "temporary names left in the store"
    # A clean unmount leaves no commit pending in the journal: a row left behind would be replayed at
    # the next mount, over whatever the path holds by then.
    m.stop()
    db = sqlite3.connect(m.state_dir / "journal.sqlite3")
    left = db.execute("SELECT path, staging FROM pending").fetchall()
    db.close()
    assert not left, f"{len(left)} journal rows outlived a clean unmount: {left[:5]}"
    # And through a fresh mount (cache and journal reloaded).
    m.start()
    for p in PATHS:
        final = model.final(p)
        if final.kind == "delete":
            assert not (m.path() / p).exists()
        else:
            assert (m.path() / p).read_bytes() == content(p, final.version, final.size)

    # The event loop never stalls for more than 100 ms. The watchdog explains every long stall: how
    # long the loop thread was on a CPU, runnable but waiting for a CPU, stopped with a CPU the
    # hypervisor took (steal), blocked while other threads on the machine waited for a CPU, or
    # blocked (the GIL, a blocking call), and where it was. Waiting for a CPU is the machine's doing
    # (these machines are shared and often run at a load of 5-20 on 2 cores), steal is its host's
    # (bursts of 30-50 ms in 100 ms on both CPUs, a few times a minute, during this soak), and so is
    # the loop waiting for the GIL while the thread holding it waited for a CPU: the watchdog cannot
    # tell which thread held it, so it leaves out as much blocked time as other threads spent waiting
    # for a CPU then (the kernel's CPU pressure), at most. CI failed on a stall with 72 ms blocked at
    # a line that cannot block, beside a pytest process running the rest of the suite. Those parts
    # are left out of the daemon's share, explicitly, and reported. Everything else counts; on a
    # quiet machine, all of the blocked time does.
    samples = status.get("loop_stall_samples") or []
    ours = [round(max(0.0, s["stall_ms"] - s["waiting_for_cpu_ms"] - s["cpu_stolen_by_host_ms"]
                      - s["blocked_while_others_waited_for_cpu_ms"]), 1)
            for s in samples]
    loop = {k: status[k] for k in ("loop_max_stall_ms", "loop_stalls_over_100ms", "gc_max_pause_ms")}
    loop["daemon_share_max_ms"] = max(ours, default=0.0)
    summary = dict(sorted(stats.counts.items()), seconds=round(soak_s, 1), **loop,
                   cache={k: cache.get(k, 0) for k in ("put_bytes", "retired", "evicted", "used_bytes")})
    print(f"\n[soak] {json.dumps(summary)}")
    explained = "\n".join(json.dumps(s) for s in samples)
    assert status["loop_stalls_over_100ms"] <= len(samples), f"stalls the watchdog did not explain: {loop}"
    assert all(o <= 100 for o in ours), (
        f"the daemon stalled its event loop: {loop}; the stalls (loop thread on a CPU / waiting for a "
        f"CPU / CPU taken by the host / blocked while others waited for a CPU / blocked, where it was, "
        f"and the daemon's threads by state then):\n{explained}")
