"""The block cache keeps only versions the store still holds (issue 2: a bounded cache worth its
size). A version this mount replaced or deleted, or saw replaced or deleted elsewhere, leaves the
cache as soon as the mount learns of it: a checkpoint rewritten every epoch would otherwise fill
the cache with dead versions and push the data set out. One it renamed becomes its copy's. A
version an open handle still reads stays until that handle's last close."""

from __future__ import annotations

import hashlib
import os

import pytest

from tests.support import wait_until
from ucfs.cache import LAYOUT, ObjectVersion

pytestmark = pytest.mark.integration

MiB = 1 << 20


def cached(m) -> set[str]:
    """Digests of the versions with segments in the mount's cache directory."""
    root = m.state_dir / "cache" / LAYOUT
    return {sub.name + f.name.split(".")[0] for sub in root.iterdir() if sub.is_dir()
            for f in sub.iterdir() if not f.name.startswith(".")}


def test_the_cache_keeps_only_versions_the_store_still_holds(mount, s3, s3_endpoint, bucket, prefix):
    v = mount.path()
    store = f"s3:{s3_endpoint.url}"  # (ucfs.store.S3Store.name: a cache identity's first part)

    def version(name: str) -> str:
        key = f"{prefix}/vol/{name}"
        etag = s3.head_object(Bucket=bucket, Key=key)["ETag"].strip('"')
        return ObjectVersion(store, bucket, key, etag).digest

    def settles(*names: str) -> None:
        want = {version(n) for n in names}
        assert wait_until(lambda: cached(mount) == want, timeout=10), (cached(mount), want)

    # Read: cached.
    first = os.urandom(4 * MiB)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/a.bin", Body=first)
    assert (v / "a.bin").read_bytes() == first
    settles("a.bin")

    # Replaced elsewhere: once the mount sees the new version, the old one's blocks go.
    second = os.urandom(4 * MiB)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/a.bin", Body=second)
    assert wait_until(lambda: (v / "a.bin").read_bytes() == second, timeout=5)
    settles("a.bin")

    # Replaced here: the commit caches the new version and retires the one it replaced.
    third = os.urandom(4 * MiB)
    (v / "a.bin").write_bytes(third)
    md5 = hashlib.md5(third).hexdigest()
    assert wait_until(lambda: version("a.bin") == ObjectVersion(store, bucket, f"{prefix}/vol/a.bin", md5).digest,
                      timeout=30)
    settles("a.bin")
    # Again, with an fsync just before the close: the fsync's commit caches, the close (the same
    # bytes) commits nothing new, and the version is cached all the same.
    fourth = os.urandom(4 * MiB)
    with open(v / "a.bin", "wb") as f:
        f.write(fourth)
        f.flush()
        os.fsync(f.fileno())
    settles("a.bin")
    # One version's worth, not four. (The index counts a segment until just after its file goes:
    # polled, since a disk thread deletes them and may be preempted in between.)
    assert wait_until(lambda: mount.status()["cache"]["used_bytes"] < 5 * MiB, timeout=10), mount.status()["cache"]

    # Renamed here: the old name's blocks become the copy's (read from them: test_read.py).
    os.rename(v / "a.bin", v / "b.bin")
    settles("b.bin")
    assert (v / "b.bin").read_bytes() == fourth
    settles("b.bin")

    # Deleted here.
    os.unlink(v / "b.bin")
    assert wait_until(lambda: cached(mount) == set(), timeout=10), cached(mount)

    # Renamed while a writer still has it open, after an fsync committed it: the old name's version
    # goes, and the new name's commit caches the file again.
    with open(v / "w.bin", "wb") as f:
        f.write(third)
        f.flush()
        os.fsync(f.fileno())
        settles("w.bin")
        os.rename(v / "w.bin", v / "z.bin")
    settles("z.bin")
    os.unlink(v / "z.bin")
    assert wait_until(lambda: cached(mount) == set(), timeout=10), cached(mount)

    # A directory renamed here: the versions under its old name become those under the new one.
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/d/x.bin", Body=second)
    assert (v / "d" / "x.bin").read_bytes() == second
    settles("d/x.bin")
    os.rename(v / "d", v / "e")
    settles("e/x.bin")
    assert (v / "e" / "x.bin").read_bytes() == second
    os.unlink(v / "e" / "x.bin")
    assert wait_until(lambda: cached(mount) == set(), timeout=10), cached(mount)

    # A version an open handle reads stays while the handle is open, and goes at its last close.
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/c.bin", Body=first)
    old = version("c.bin")
    with open(v / "c.bin", "rb") as f:
        assert f.read() == first
        s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/c.bin", Body=second)
        assert wait_until(lambda: (v / "c.bin").read_bytes() == second, timeout=5)
        new = version("c.bin")
        assert wait_until(lambda: cached(mount) == {old, new}, timeout=10), cached(mount)
        f.seek(0)
        assert f.read(MiB) == first[:MiB]  # (from its own cached blocks)
    assert wait_until(lambda: cached(mount) == {new}, timeout=10), cached(mount)

    # Deleted elsewhere: the mount's next look at the name retires it.
    s3.delete_object(Bucket=bucket, Key=f"{prefix}/vol/c.bin")
    assert wait_until(lambda: not (v / "c.bin").exists(), timeout=5)
    assert wait_until(lambda: cached(mount) == set(), timeout=10), cached(mount)
    assert wait_until(lambda: mount.status()["cache"]["used_bytes"] == 0, timeout=10), mount.status()["cache"]


def test_a_checkpoint_rewritten_every_epoch_leaves_the_data_set_cached(mount_factory, s3, bucket, prefix,
                                                                       store_requests):
    """The case the retirement is for: a 96 MiB cache holds a 48 MiB data set, and a 24 MiB
    checkpoint is written over itself six times (each version is cached at its commit). With the
    dead versions kept, 48 + 6 x 24 MiB would not fit and the data set, used least recently,
    would be evicted; here the next epoch, after a remount, reads it from the disk cache alone."""
    m = mount_factory(args=("--cache-size", "96M"))
    v = m.path()

    def stored(name: str) -> bytes | None:
        try:
            return s3.get_object(Bucket=bucket, Key=f"{prefix}/vol/{name}")["Body"].read()
        except s3.exceptions.NoSuchKey:
            return None

    data = {f"d/{i}.bin": os.urandom(8 * MiB) for i in range(6)}
    for name, body in data.items():
        s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/{name}", Body=body)
    for name, body in data.items():
        assert (v / name).read_bytes() == body
    for epoch in range(6):
        ckpt = os.urandom(24 * MiB)
        with open(v / "ckpt.pt", "wb") as f:
            f.write(ckpt)
            if epoch % 2:  # (torch.distributed.checkpoint fsyncs; torch.save does not)
                f.flush()
                os.fsync(f.fileno())
        assert wait_until(lambda: stored("ckpt.pt") == ckpt, timeout=30)  # the next epoch replaces it
    assert wait_until(lambda: len(cached(m)) == len(data) + 1, timeout=10), cached(m)

    m.stop()
    m.start()
    before = store_requests.object_gets()
    for name, body in data.items():
        assert (v / name).read_bytes() == body
    assert (v / "ckpt.pt").read_bytes() == ckpt
    assert m.store_stats().get("get", 0) == 0, m.status()["cache"]
    assert store_requests.object_gets() == before
