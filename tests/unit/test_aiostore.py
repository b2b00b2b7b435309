"""Reads of local files on the event loop when the page cache already has the bytes (`pread_local`)."""

from __future__ import annotations

import os
import time

import pytest
import trio

from ucfs import aiostore


def test_cached_bytes_are_read_in_place_and_anything_else_is_left_to_a_thread(tmp_path):
    p = tmp_path / "f"
    data = os.urandom(300_000)
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY)
    try:
        # Just written: in the page cache.
        assert bytes(aiostore.pread_cached(fd, 300_000, 0)) == data
        assert bytes(aiostore.pread_cached(fd, 1000, 299_000)) == data[299_000:]
        # Past the end the read is short: not an answer, the caller asks a thread.
        assert aiostore.pread_cached(fd, 2000, 299_000) is None
        big = aiostore.INLINE_READ_MAX_BYTES + 1
        assert aiostore.pread_cached(fd, big, 0) is None

        async def main():
            # Short at the end of the file, the thread's pread says how much there is.
            assert await aiostore.pread_local(fd, 2000, 299_000) == data[299_000:]
            assert bytes(await aiostore.pread_local(fd, 10, 5)) == data[5:15]

        trio.run(main)
    finally:
        os.close(fd)


def test_a_read_that_would_wait_for_the_disk_is_not_done_in_place(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(os.urandom(256 * 1024))
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
        for _ in range(20):
            # Drop its clean pages. Pages still in another CPU's batch of pages on their way to the
            # LRU lists are not dropped (seen once in a full run): ask again, a moment later.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if aiostore.pread_cached(fd, 4096, 128 * 1024) is None:
                break
            time.sleep(0.05)
        else:
            pytest.skip("this file system kept the pages (tmpfs has no disk to wait for)")
        assert len(os.pread(fd, 4096, 128 * 1024)) == 4096  # a thread's plain read gets them
    finally:
        os.close(fd)
