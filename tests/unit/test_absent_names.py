"""Files that settle before their commit (`commit.COMMIT_SETTLE_S`), on the core with the
in-memory store.

A file saved under a temporary name and renamed (or removed) right after its close must be sent
once under its final name (or not at all), and nothing that waits for the store (fsync, the drain
of an unmount) may wait out the settling time.
"""

from __future__ import annotations

import os
import threading
import time

import trio

from ucfs import commit as commit_mod
from ucfs.config import MountConfig
from ucfs.store import MemoryStore

from tests.support import open_core

TTL = 0.3
CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


def _run(tmp_path, body):
    inner = MemoryStore()
    inner.buckets["bucket"] = {}
    (tmp_path / "state").mkdir(mode=0o700)
    cfg = MountConfig(cache_dir=tmp_path / "state" / "cache", metadata_ttl_s=TTL)

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, inner, n, cfg)
            await body(core, committer, vol, inner)
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(main)
    return inner


def test_a_file_renamed_right_after_its_close_is_sent_once_under_its_final_name(tmp_path):
    async def body(core, committer, vol, inner):
        for i in range(5):
            fh, _ = await core.create(vol, f".f{i}.tmp", CREATE)
            await core.write(fh, 0, b"saved %d" % i)
            await core.flush(fh)
            await core.release(fh)
            assert await core.lookup(vol, f"f{i}") is None
            await core.rename(vol, f".f{i}.tmp", vol, f"f{i}")
        fh, _ = await core.create(vol, "scratch", CREATE)  # a temporary file removed at once
        await core.write(fh, 0, b"scratch")
        await core.flush(fh)
        await core.release(fh)
        await core.unlink(vol, "scratch")
        await committer.fsync_tree(core.node(vol))
        stats = inner.statistics()
        assert stats.get("put", 0) == 5, stats
        assert stats.get("copy", 0) == 0 and stats.get("delete", 0) == 0, stats
        assert sorted(inner.buckets["bucket"]) == [f"pfx/f{i}" for i in range(5)]

    _run(tmp_path, body)


def test_a_settling_file_is_committed_at_once_by_fsync_and_by_the_drain(tmp_path, monkeypatch):
    monkeypatch.setattr(commit_mod, "COMMIT_SETTLE_S", 30.0)  # longer than this test waits

    async def body(core, committer, vol, inner):
        for name in ("synced", "drained"):
            fh, _ = await core.create(vol, name, CREATE)
            await core.write(fh, 0, name.encode())
            await core.flush(fh)
            await core.release(fh)
        s = core.node((await core.lookup(vol, "synced")).ino).staged
        assert s.settling
        t0 = time.monotonic()
        with trio.fail_after(5):
            await committer.fsync(s)
        assert time.monotonic() - t0 < 5
        assert inner.get("bucket", "pfx/synced")[0] == b"synced"
        assert "pfx/drained" not in inner.buckets["bucket"]  # still settling
        # `_run` ends with a drain, which must not wait 30 s: checked after it returns.

    t0 = time.monotonic()
    inner = _run(tmp_path, body)
    assert time.monotonic() - t0 < 10
    assert inner.get("bucket", "pfx/drained")[0] == b"drained"


def test_a_directory_fsync_sends_the_files_settling_beneath_it_together(tmp_path, monkeypatch):
    """fsync() of a directory right after many closes (a job saying "my outputs are in") hands
    every settling file to the workers at once, not one file's PUT after another."""
    monkeypatch.setattr(commit_mod, "COMMIT_SETTLE_S", 30.0)
    lock = threading.Lock()
    in_flight = [0, 0]  # now, most at once

    async def body(core, committer, vol, inner):
        real_put = inner.put

        def slow_put(bucket, key, body, size):
            with lock:
                in_flight[0] += 1
                in_flight[1] = max(in_flight[1], in_flight[0])
            try:
                time.sleep(0.05)
                return real_put(bucket, key, body, size)
            finally:
                with lock:
                    in_flight[0] -= 1

        monkeypatch.setattr(inner, "put", slow_put)
        for i in range(8):
            fh, _ = await core.create(vol, f"out{i}", CREATE)
            await core.write(fh, 0, b"output %d" % i)
            await core.flush(fh)
            await core.release(fh)
        await committer.fsync_tree(core.node(vol))
        assert sorted(inner.buckets["bucket"]) == [f"pfx/out{i}" for i in range(8)]

    _run(tmp_path, body)
    assert in_flight[1] > 1, in_flight
