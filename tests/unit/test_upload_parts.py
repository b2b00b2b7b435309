"""Upload parts from memory: a store that cannot send files (here the in-memory one) gets each part
read into a pooled buffer under the memory budget, streamed while the file is written or as one
multipart upload after it. Over plain HTTP the same parts go out with sendfile (tests/integration)."""

from __future__ import annotations

import os

import trio

from ucfs.config import MiB, MountConfig
from ucfs.store import MemoryStore

from tests.support import open_core


def test_parts_read_into_pooled_buffers_arrive_whole_and_give_their_memory_back(tmp_path):
    inner = MemoryStore()
    inner.buckets["bucket"] = {}
    (tmp_path / "state").mkdir(mode=0o700)
    cfg = MountConfig(cache_dir=tmp_path / "state" / "cache")
    streamed = os.urandom(40 * MiB + 12345)  # written in order: streamed while written
    rewritten = bytearray(os.urandom(20 * MiB + 7))  # then edited in place: one multipart upload

    async def write_file(core, vol, name, chunks):
        fh, _ = await core.create(vol, name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        for off, data in chunks:
            await core.write(fh, off, data)
        await core.flush(fh)
        await core.release(fh)

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, inner, n, cfg)
            assert not core.store_for(core.node(vol).volume).sends_files
            step = MiB
            await write_file(core, vol, "streamed.bin",
                             [(o, streamed[o:o + step]) for o in range(0, len(streamed), step)])
            chunks = [(o, bytes(rewritten[o:o + step])) for o in range(0, len(rewritten), step)]
            rewritten[5:9] = b"EDIT"
            chunks.append((5, b"EDIT"))  # a write inside written data: no stream, a whole multipart
            await write_file(core, vol, "rewritten.bin", chunks)
            await committer.shutdown(drain=True)
            assert core.budget.used_bytes == 0
            n.cancel_scope.cancel()

    trio.run(main)
    assert inner.get("bucket", "pfx/streamed.bin")[0] == streamed
    assert inner.get("bucket", "pfx/rewritten.bin")[0] == bytes(rewritten)
    assert inner.statistics().get("upload_part", 0) >= 5 + 2
