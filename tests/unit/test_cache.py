"""The disk cache: identity by (key, ETag), integrity, bounded size, lazy index, pins."""

from __future__ import annotations

import os

import pytest

from ucfs.cache import BlockCache, ObjectVersion
from ucfs.errors import UcfsError

MiB = 1 << 20


def make(tmp_path, size=64 * MiB, floor=0):
    c = BlockCache(tmp_path / "c", size_bytes=size, free_floor_bytes=floor, block_bytes=MiB)
    c.scan()
    return c


def v(key="k", etag="e1"):
    return ObjectVersion("s3:x", "bucket", key, etag)


def test_roundtrip_and_identity_includes_etag(tmp_path):
    c = make(tmp_path)
    data = os.urandom(MiB)
    assert c.put_block(v(), 0, data)
    assert c.get_block(v(), 0) == data
    assert c.get_block(v(etag="e2"), 0) is None  # a changed object is a miss, never stale data
    assert c.get_block(v(), 1) is None
    assert c.get_block(v(key="other"), 0) is None


def test_damaged_block_is_detected_and_dropped(tmp_path):
    c = make(tmp_path)
    data = os.urandom(MiB)
    c.put_block(v(), 3, data)
    path = c._path(c._name(v(), 3))
    raw = bytearray(path.read_bytes())
    raw[1000] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert c.get_block(v(), 3) is None
    assert not path.exists()
    assert c.statistics()["corrupt"] == 1


def test_truncated_block_is_detected(tmp_path):
    c = make(tmp_path)
    c.put_block(v(), 0, os.urandom(MiB))
    path = c._path(c._name(v(), 0))
    with open(path, "r+b") as f:
        f.truncate(MiB // 2)
    assert c.get_block(v(), 0) is None


def test_size_limit_holds_and_evicts_least_recently_used(tmp_path):
    c = make(tmp_path, size=8 * MiB + 8 * 4096 * 2)
    for i in range(8):
        assert c.put_block(v(), i, os.urandom(MiB))
    c.get_block(v(), 0)  # block 0 is now the most recent
    assert c.put_block(v(), 8, os.urandom(MiB))
    assert c.statistics()["used_bytes"] <= c.size_bytes
    assert c.contains(v(), 0)
    assert not c.contains(v(), 1)  # the least recently used went first
    on_disk = sum(f.stat().st_size for f in (tmp_path / "c").rglob("*") if f.is_file() and f.name != "lock")
    assert on_disk <= c.size_bytes


def test_pinned_versions_are_not_evicted(tmp_path):
    c = make(tmp_path, size=4 * MiB + 4 * 4096 * 2)
    c.pin(v("open"))
    for i in range(3):
        c.put_block(v("open"), i, os.urandom(MiB))
    for i in range(4):
        c.put_block(v("other"), i, os.urandom(MiB))
    assert all(c.contains(v("open"), i) for i in range(3))
    c.unpin(v("open"))
    for i in range(4):
        c.put_block(v("third"), i, os.urandom(MiB))
    assert not c.contains(v("open"), 0)


def test_index_survives_a_new_instance(tmp_path):
    c = make(tmp_path)
    data = os.urandom(MiB)
    c.put_block(v(), 0, data)
    c2 = BlockCache(tmp_path / "c", size_bytes=64 * MiB, free_floor_bytes=0, block_bytes=MiB)
    # Usable before the background scan has run: the mount never waits for the index.
    assert c2.get_block(v(), 0) == data
    c2.scan()
    assert c2.statistics()["blocks"] == 1


def test_half_written_blocks_are_removed_by_the_scan(tmp_path):
    c = make(tmp_path)
    c.put_block(v(), 0, os.urandom(MiB))
    sub = next(p for p in (tmp_path / "c" / "v1").iterdir() if p.is_dir())
    (sub / ".tmpdeadbeef").write_bytes(b"partial")
    BlockCache(tmp_path / "c", size_bytes=64 * MiB, free_floor_bytes=0, block_bytes=MiB).scan()
    assert not (sub / ".tmpdeadbeef").exists()


def test_refuses_a_directory_others_can_write(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(UcfsError, match="other users can write"):
        BlockCache(d, size_bytes=MiB, free_floor_bytes=0, block_bytes=MiB)


def test_new_cache_directory_is_private(tmp_path):
    make(tmp_path)
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o700
