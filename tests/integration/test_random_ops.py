"""Random file operations on one mount, checked against a model after every step (README "Semantics").

One process opens, writes, truncates, maps, reads, fsyncs, renames and unlinks a handful of files,
and renames their directory back and forth, in a mix no hand-written test would choose; another
writer replaces and deletes files in the store, the kernel is made to forget every unused inode of
the mount (a remount, as root), and the daemon is killed and started again now and then. The model is
what a local file system would hold, with the allowances the README makes for a handle that was
open when someone else changed the file: it may fail with ESTALE, after a prefix of the file at
most, or go on reading the version it had (the file as of its open, or of its own last change).
Another writer's changes are seen within the metadata TTL. Every fsync is checked in the store, and
listings now and then; at the end the listing, every file, the store, and a remount must all agree
with the model.

Runs like this found four bugs the rest of the suite had missed: a truncating open beside a
passthrough writer kept the writer's bytes, fsync through a handle opened before a change did not
wait for it, a file renamed out of a directory that had just moved twice failed with ENOENT, and a
close lost its journal row to a commit of the version before it, so a crash lost the close
(test_passthrough.py, test_write.py, test_rename_durability.py and test_close_commit.py pin them down).
UCFS_RANDOM_OPS_STEPS sets the steps per seed (default 600), UCFS_RANDOM_OPS_SEEDS the seeds
(default "7,14").
"""

from __future__ import annotations

import errno
import mmap
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support import forget_unused_inodes, obj, wait_until

MiB = 1 << 20
STEPS = int(os.environ.get("UCFS_RANDOM_OPS_STEPS", "600"))
SEEDS = [int(s) for s in os.environ.get("UCFS_RANDOM_OPS_SEEDS", "7,14").split(",")]
# "D/" stands for the directory, which the run renames back and forth between d and e.
NAMES = ("f0", "f1", "f2", "D/g0", "D/g1")
MAX_SIZE = 12 * MiB
OPEN_FLAGS = {
    "r": os.O_RDONLY,
    "r+": os.O_RDWR,
    "w": os.O_RDWR | os.O_CREAT | os.O_TRUNC,
    "a": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
    "x": os.O_RDWR | os.O_CREAT | os.O_EXCL,
}
# Weighted: opens and writes often, the slow steps (a remote write waits for the TTL, a crash for
# a restart) seldom.
OPS = {"open": 8, "write": 10, "big_write": 2, "truncate": 4, "truncate_path": 2, "read": 8, "mmap": 2,
       "close": 7, "fsync": 3, "rename": 3, "unlink": 2, "read_whole": 5, "remote_write": 1, "crash": 1,
       "rename_dir": 3, "remote_delete": 1, "listdir": 3, "forget": 2}


@dataclass(eq=False)
class File:
    data: bytearray = field(default_factory=bytearray)
    changes: int = 0  # every change, so that a handle can tell whether someone else changed it

    def write(self, off: int, buf: bytes) -> None:
        if off > len(self.data):
            self.data.extend(bytes(off - len(self.data)))
        self.data[off:off + len(buf)] = buf
        self.changes += 1

    def resize(self, size: int) -> None:
        del self.data[size:]
        self.data.extend(bytes(size - len(self.data)))
        self.changes += 1


@dataclass(eq=False)
class Handle:
    fd: int
    file: File
    mode: str
    seen: int  # file.changes as of this handle's open or its own last change
    # The file as of `seen`: what a handle that went on reading the version it had would return.
    version: bytes = b""

    @property
    def readable(self) -> bool:
        return self.mode != "a"

    @property
    def writable(self) -> bool:
        return self.mode != "r"

    def changed(self) -> None:
        """This handle changed the file: if it had seen everything before, it still has."""
        if self.seen == self.file.changes - 1:
            self.seen = self.file.changes
            self.version = bytes(self.file.data)

    @property
    def may_be_stale(self) -> bool:
        return self.file.changes > self.seen


class Run:
    def __init__(self, m, s3, bucket: str, key_prefix: str, seed: int):
        self.m, self.s3, self.bucket, self.key_prefix = m, s3, bucket, key_prefix
        self.rng = random.Random(seed)
        self.names: dict[str, File] = {}
        self.handles: list[Handle] = []
        self.history: list[str] = []
        self.base = m.path()
        self.dir = "d"
        (self.base / "d").mkdir()

    # -- helpers ----------------------------------------------------------------------------------
    def fail(self, what: str) -> None:
        pytest.fail(f"{what}\nlast steps:\n  " + "\n  ".join(self.history[-30:]), pytrace=False)

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            self.fail(what)

    def note(self, *words) -> None:
        self.history.append(" ".join(map(str, words)))

    def bytes_of(self, n: int) -> bytes:
        return self.rng.randbytes(4096) * (n // 4096) + self.rng.randbytes(n % 4096)

    def size(self) -> int:
        r = self.rng.random()
        return self.rng.randrange(4096) if r < 0.3 else self.rng.randrange(MiB) if r < 0.7 else self.rng.randrange(MAX_SIZE)

    def handle(self, want) -> Handle | None:
        fit = [h for h in self.handles if want(h)]
        return self.rng.choice(fit) if fit else None

    def name_of(self, f: File) -> str | None:
        return next((n for n, g in self.names.items() if g is f), None)

    def real(self, name: str) -> str:
        return name.replace("D/", self.dir + "/")

    def path(self, name: str) -> Path:
        return self.base / self.real(name)

    def key(self, name: str) -> str:
        return f"{self.key_prefix}/{self.real(name)}"

    # -- steps ------------------------------------------------------------------------------------
    def open(self) -> None:
        if len(self.handles) >= 4:
            return
        name, mode = self.rng.choice(NAMES), self.rng.choice(list(OPEN_FLAGS))
        exists = name in self.names
        refused = errno.ENOENT if mode in ("r", "r+") and not exists else errno.EEXIST if mode == "x" and exists else None
        try:
            fd = os.open(self.path(name), OPEN_FLAGS[mode], 0o644)
        except OSError as e:
            self.expect(e.errno == refused, f"open {name} {mode}: {e!r}, expected {refused}")
            return
        self.expect(refused is None, f"open {name} {mode} succeeded; expected errno {refused}")
        f = self.names.setdefault(name, File())
        if mode == "w" and f.data:
            f.resize(0)
        self.handles.append(Handle(fd, f, mode, f.changes, bytes(f.data)))
        self.note("open", name, mode, "fd", fd, "size", len(f.data))

    def write(self, big: bool = False) -> None:
        h = self.handle(lambda h: h.writable)
        if h is None:
            return
        n = self.rng.randrange(1, 3 * MiB) if big else self.rng.randrange(1, 70_000)
        buf = self.bytes_of(n)
        if h.mode == "a":
            self.expect(os.write(h.fd, buf) == n, "short append")
            h.file.write(len(h.file.data), buf)
            self.note("append fd", h.fd, n)
        else:
            off = self.rng.randrange(min(MAX_SIZE, len(h.file.data) + 2 * MiB))
            self.expect(os.pwrite(h.fd, buf, off) == n, "short pwrite")
            h.file.write(off, buf)
            self.note("pwrite fd", h.fd, off, n)
        h.changed()

    def big_write(self) -> None:
        self.write(big=True)

    def truncate(self) -> None:
        h = self.handle(lambda h: h.writable)
        if h is None:
            return
        size = self.size()
        os.ftruncate(h.fd, size)
        h.file.resize(size)
        h.seen = h.file.changes  # ftruncate tells the handle the new size
        h.version = bytes(h.file.data)
        self.note("ftruncate fd", h.fd, size)

    def truncate_path(self) -> None:
        name, size = self.rng.choice(NAMES), self.size()
        try:
            os.truncate(self.path(name), size)
        except FileNotFoundError:
            self.expect(name not in self.names, f"truncate {name}: ENOENT")
            return
        self.expect(name in self.names, f"truncate of missing {name} succeeded")
        self.names[name].resize(size)
        self.note("truncate", name, size)

    def read(self) -> None:
        h = self.handle(lambda h: h.readable)
        if h is None:
            return
        data = h.file.data
        off, n = self.rng.randrange(len(data) + 1), self.rng.randrange(3 * MiB)
        want = bytes(data[off:off + n])
        try:
            got = os.pread(h.fd, n, off)
        except OSError as e:
            self.expect(e.errno == errno.ESTALE and h.may_be_stale, f"pread fd {h.fd} {off} {n}: {e!r}")
            self.note("pread fd", h.fd, off, n, "ESTALE")
            return
        if got != want and h.may_be_stale and got == h.version[off:off + len(got)]:
            # The version this handle had before someone else changed the file: then ESTALE, its
            # end, or more of it.
            end = off + len(got)
            self.then(h, off, n, end, "the version it had",
                      lambda more: len(got) == n or more == h.version[end:end + 4096])
            return
        if got != want and h.may_be_stale and len(got) < len(want) and want.startswith(got):
            # A prefix: then ESTALE, or the end of the version this handle opened (another handle
            # appended since; the bytes it had are the same).
            end = off + len(got)
            self.then(h, off, n, end, "a prefix of the file",
                      lambda more: more == b"" and os.fstat(h.fd).st_size == end)
            return
        self.expect(got == want, f"pread fd {h.fd} at {off} for {n}: {len(got)} bytes, expected {len(want)}"
                                 f" (file changed since open: {h.may_be_stale})")
        self.note("pread fd", h.fd, off, n)

    def then(self, h: Handle, off: int, n: int, end: int, what: str, fits) -> None:
        """A stale handle answered a read at `off` with `what`, up to `end`: the next read from
        there must fail with ESTALE, or return what `fits`."""
        try:
            more = os.pread(h.fd, 4096, end)
        except OSError as e:
            self.expect(e.errno == errno.ESTALE, f"pread after a short one: {e!r}")
            self.note("pread fd", h.fd, off, n, what, "then ESTALE")
            return
        self.expect(fits(more), f"pread fd {h.fd} at {off} for {n}: {what} up to {end}, then {len(more)} more bytes")
        self.note("pread fd", h.fd, off, n, what, "up to", end)

    def mmap(self) -> None:
        # Not through a handle that may be stale: a page fault that fails is SIGBUS, which would
        # end the test run instead of failing one test.
        h = self.handle(lambda h: h.mode in ("r+", "w", "x") and h.file.data and not h.may_be_stale)
        if h is None:
            return
        data = h.file.data
        self.expect(os.fstat(h.fd).st_size == len(data), f"fstat of fd {h.fd}: {os.fstat(h.fd).st_size} bytes,"
                                                         f" expected {len(data)}")
        off = self.rng.randrange(len(data))
        n = self.rng.randrange(1, min(len(data) - off, 300_000) + 1)
        buf = self.bytes_of(n)
        with mmap.mmap(h.fd, len(data)) as mm:
            self.expect(mm[off:off + n] == bytes(data[off:off + n]), f"mmap of fd {h.fd}: other bytes at {off}")
            mm[off:off + n] = buf
            if self.rng.random() < 0.5:
                mm.flush()
        h.file.write(off, buf)
        h.changed()
        self.note("mmap write fd", h.fd, off, n)

    def close(self) -> None:
        if self.handles:
            h = self.handles.pop(self.rng.randrange(len(self.handles)))
            os.close(h.fd)
            self.note("close fd", h.fd)

    def fsync(self) -> None:
        h = self.handle(lambda h: True)
        if h is None:
            return
        os.fsync(h.fd)
        name = self.name_of(h.file)
        if name is not None:
            self.expect(obj(self.s3, self.bucket, self.key(name)) == bytes(h.file.data),
                        f"after fsync of fd {h.fd}, {name} in the store differs from the file")
        self.note("fsync fd", h.fd, name)

    def rename(self) -> None:
        a, b = self.rng.sample(NAMES, 2)
        try:
            os.rename(self.path(a), self.path(b))
        except FileNotFoundError:
            self.expect(a not in self.names, f"rename {a} {b}: ENOENT")
            return
        self.expect(a in self.names, f"rename of missing {a} succeeded")
        self.names[b] = self.names.pop(a)
        self.note("rename", a, b)

    def unlink(self) -> None:
        name = self.rng.choice(NAMES)
        try:
            os.unlink(self.path(name))
        except FileNotFoundError:
            self.expect(name not in self.names, f"unlink {name}: ENOENT")
            return
        self.expect(name in self.names, f"unlink of missing {name} succeeded")
        del self.names[name]
        self.note("unlink", name)

    def read_whole(self, name: str | None = None) -> None:
        name = name or self.rng.choice(NAMES)
        try:
            got = self.path(name).read_bytes()
        except FileNotFoundError:
            self.expect(name not in self.names, f"{name}: ENOENT")
            return
        self.expect(name in self.names, f"{name} exists; it should not")
        want = bytes(self.names[name].data)
        self.expect(got == want, f"{name}: {len(got)} bytes read, expected {len(want)}")
        self.expect(os.stat(self.path(name)).st_size == len(want), f"{name}: stat size")
        self.note("read", name, len(got))

    def remote_write(self) -> None:
        """Another host replaces a file none of our handles holds."""
        name = self.rng.choice(NAMES)
        if name in self.names and any(h.file is self.names[name] for h in self.handles):
            return
        if name in self.names:
            with open(self.path(name), "rb") as f:
                os.fsync(f.fileno())  # our last close first, or it would land after theirs
        data = self.bytes_of(self.size())
        self.s3.put_object(Bucket=self.bucket, Key=self.key(name), Body=data)
        self.names[name] = File(bytearray(data))
        self.expect(wait_until(lambda: self.shows(name, data), timeout=10),
                    f"{name}: another writer's version not seen within 10 s")
        self.note("remote write", name, len(data))

    def shows(self, name: str, data: bytes) -> bool:
        try:
            return self.path(name).read_bytes() == data
        except FileNotFoundError:
            return False  # its absence, seen before the write, stands for a TTL
        except OSError as e:
            if e.errno != errno.ESTALE:
                raise
            return False  # opened as the mount learned of the new version: try again

    def crash(self) -> None:
        if self.handles:
            return
        self.m.kill()
        self.m.start()
        self.note("kill -9, mount again")

    def forget(self) -> None:
        """The kernel forgets every inode nobody holds (it sends FORGET), as memory pressure makes it
        do: names are then looked up anew, from listings and HEADs the daemon may have had before."""
        if forget_unused_inodes(self.m.mountpoint):  # (not root: the kernel forgets only what it would have anyway)
            self.note("forget")

    def rename_dir(self) -> None:
        new = "e" if self.dir == "d" else "d"
        os.rename(self.base / self.dir, self.base / new)
        self.note("rename", self.dir, new)
        self.dir = new

    def remote_delete(self) -> None:
        """Another host deletes a file none of our handles holds."""
        name = self.rng.choice(NAMES)
        if name not in self.names or any(h.file is self.names[name] for h in self.handles):
            return
        with open(self.path(name), "rb") as f:
            os.fsync(f.fileno())  # our last close first
        self.s3.delete_object(Bucket=self.bucket, Key=self.key(name))
        del self.names[name]
        p = self.path(name)
        self.expect(wait_until(lambda: not p.exists() and p.name not in os.listdir(p.parent), timeout=10),
                    f"{name}: another writer's delete not seen within 10 s")
        self.note("remote delete", name)

    def listdir(self) -> None:
        top = sorted(os.listdir(self.base))
        want = sorted({n for n in self.names if "/" not in n} | {self.dir})
        self.expect(top == want, f"listing of the volume: {top}, expected {want}")
        sub = sorted(os.listdir(self.base / self.dir))
        want = sorted(n[len("D/"):] for n in self.names if n.startswith("D/"))
        self.expect(sub == want, f"listing of {self.dir}: {sub}, expected {want}")
        self.note("listdir")

    # -- the run ----------------------------------------------------------------------------------
    def run(self, steps: int) -> None:
        ops, weights = list(OPS), list(OPS.values())
        for _ in range(steps):
            getattr(self, self.rng.choices(ops, weights)[0])()
        for h in self.handles:
            os.close(h.fd)
        self.handles.clear()
        files = sorted(str(p.relative_to(self.base)) for p in self.base.rglob("*") if p.is_file())
        want = sorted(self.real(n) for n in self.names)
        self.expect(files == want, f"listing {files}, expected {want}")
        for name in self.names:
            self.read_whole(name)

    def check_store(self) -> None:
        listed = self.s3.list_objects_v2(Bucket=self.bucket, Prefix=self.key_prefix + "/").get("Contents", [])
        stored = sorted(o["Key"][len(self.key_prefix) + 1:] for o in listed if not o["Key"].endswith("/"))
        want = sorted(self.real(n) for n in self.names)
        self.expect(stored == want, f"store holds {stored}, expected {want}")
        for name, f in self.names.items():
            self.expect(obj(self.s3, self.bucket, self.key(name)) == bytes(f.data), f"{name} in the store")


@pytest.mark.parametrize("seed", SEEDS)
def test_random_operations_agree_with_a_model(mount_factory, s3, bucket, prefix, seed):
    m = mount_factory()
    run = Run(m, s3, bucket, f"{prefix}/vol", seed)
    run.run(STEPS)
    m.stop()  # drains every commit
    run.check_store()
    m.start()
    for name in run.names:
        run.read_whole(name)
