"""A statfs can block on a busy disk (153 ms seen in the soak test), so the event loop never makes
one: `df` on the mount, `ucfs status` and creates (tests/unit/test_close_commit.py) hand it to a
thread (not to the disk pool, whose threads may all be busy with fsyncs and cache writes)."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import pyfuse3
import trio

from ucfs import control
from ucfs.config import MiB, MountConfig
from ucfs.fs import Operations

from tests.support import open_core
from tests.unit.test_close_commit import GatedStore


def test_df_on_the_mount_asks_the_disk_from_a_disk_thread():
    threads: list[str] = []

    class Core:
        def statfs(self):
            threads.append(threading.current_thread().name)
            return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": 100, "f_bfree": 90, "f_bavail": 80,
                    "f_files": 10, "f_ffree": 5, "f_favail": 5, "f_namemax": 255}

    async def main():
        st = await Operations(Core()).statfs(None)
        assert isinstance(st, pyfuse3.StatvfsData) and st.f_bavail == 80 and st.f_namemax == 255
        return threading.current_thread().name

    loop_thread = trio.run(main)
    assert len(threads) == 1 and threads[0] != loop_thread, (loop_thread, threads)


def test_commit_statistics_leave_the_staging_disk_s_room_to_a_disk_thread(tmp_path, monkeypatch):
    cfg = MountConfig(cache_dir=tmp_path / "state" / "cache", part_bytes=MiB, store_concurrency=8)
    (tmp_path / "state").mkdir(mode=0o700)
    calls: list[tuple[str, str]] = []  # (thread, path): spares are made meanwhile, in disk threads
    real = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: (calls.append((threading.current_thread().name, str(p))), real(p))[1])

    async def main():
        here = threading.current_thread().name
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, GatedStore(), n, cfg)
            calls.clear()
            stats = core.statistics()
            assert "pending" in stats["commits"] and not [c for c in calls if c[0] == here], calls
            space = committer.staging_space()  # what a thread runs for `ucfs status`
            assert [c for c in calls if c[0] == here] == [(here, str(committer.staging_dir))]
            assert space["staging_free_bytes"] > 0 and space["staging_dir"] == str(committer.staging_dir)
            assert space["staging_reserve_bytes"] == cfg.cache_free_floor_bytes // 4
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(main)


def test_the_control_socket_awaits_a_handler_that_needs_a_thread():
    mountpoint = Path(tempfile.mkdtemp(prefix="ucfs-control-"))

    async def slow_status() -> dict:
        free = await trio.to_thread.run_sync(lambda: 123)
        return {"free": free}

    async def main():
        async with trio.open_nursery() as n:
            await n.start(control.serve, mountpoint, {"status": slow_status, "plain": lambda: {"ok": 1}})
            got = await trio.to_thread.run_sync(control.query, mountpoint, "status")
            plain = await trio.to_thread.run_sync(control.query, mountpoint, "plain")
            n.cancel_scope.cancel()
        return got, plain

    try:
        got, plain = trio.run(main)
    finally:
        mountpoint.rmdir()
    assert got["free"] == 123 and plain == {"ok": 1}
