"""Read-ahead decisions, counted in store requests (not time) against the in-memory store."""

from __future__ import annotations

import collections
import errno
import os
import random
import resource
import threading
import time

import pytest
import trio

from ucfs.aiostore import AsyncStore
from ucfs.cache import BlockCache, ObjectVersion
from ucfs.config import KiB, MiB, MountConfig
from ucfs.errors import StaleError, StoreError
from ucfs import prefetch
from ucfs.prefetch import MemoryBudget, ObjectReader
from ucfs.store import MemoryStore


class CountingStore(MemoryStore):
    """MemoryStore that records every ranged GET as (start, length)."""

    def __init__(self):
        super().__init__()
        self.ranges: list[tuple[int, int]] = []

    def get(self, bucket, key, start=0, length=None, *, etag=None):
        data, info = super().get(bucket, key, start, length, etag=etag)
        self.ranges.append((start, len(data)))
        return data, info


class PooledStore(CountingStore):
    """CountingStore that reads into the buffer it is given, as the S3 store does."""

    def get(self, bucket, key, start=0, length=None, *, etag=None, into=None):
        data, info = super().get(bucket, key, start, length, etag=etag)
        if into is None:
            return data, info
        into[:len(data)] = data
        return memoryview(into)[:len(data)], info


def make_object(store: CountingStore, size: int, key: str = "obj") -> bytes:
    data = os.urandom(size)
    store.put_bytes("b", key, data)
    return data


async def open_reader(store, cache, cfg, nursery, key="obj", budget=None, inflight=None):
    info = store.head("b", key)
    version = ObjectVersion("mem", "b", key, info.etag)
    return ObjectReader(store=AsyncStore(store, 16), bucket="b", key=key, version=version, size=info.size,
                        cache=cache, budget=budget or MemoryBudget(cfg.readahead_budget_bytes), cfg=cfg,
                        nursery=nursery, inflight=inflight)


def run(fn):
    return trio.run(fn)


@pytest.fixture
def cfg(tmp_path):
    return MountConfig(cache_dir=tmp_path / "cache")


@pytest.fixture
def cache(tmp_path, cfg):
    return BlockCache(tmp_path / "cache", size_bytes=1 << 30, free_floor_bytes=0, block_bytes=cfg.block_bytes)


def test_sequential_read_uses_large_parts_after_a_small_first_request(cfg, cache):
    store = CountingStore()
    data = make_object(store, 64 * MiB)

    async def main():
        async with trio.open_nursery() as n:
            r = await open_reader(store, cache, cfg, n)
            out = bytearray()
            for off in range(0, len(data), 128 * KiB):
                out += await r.read(off, 128 * KiB)
            r.close()
            return bytes(out)

    assert run(main) == data
    first_start, first_len = store.ranges[0]
    assert first_start == 0 and first_len <= 2 * MiB  # a file read only at its head costs little
    assert max(n for _, n in store.ranges) == cfg.part_bytes  # the stream reaches whole parts
    assert sum(n for _, n in store.ranges) == len(data)  # nothing fetched twice
    assert len(store.ranges) <= 64 // 8 + 4  # ramp-up costs a few requests, then one per part


def test_reads_across_blocks_of_one_get_are_views_not_copies(cfg, cache):
    # 1 MiB reads half a block off our 1 MiB blocks: each spans two. Inside one GET's buffer the two
    # lie side by side and the answer is a view of it; only a read across two GETs is joined.
    store = CountingStore()
    data = make_object(store, 32 * MiB)

    async def main():
        async with trio.open_nursery() as n:
            r = await open_reader(store, cache, cfg, n)
            out, views = bytearray(), 0
            for off in range(MiB // 2, len(data), MiB):
                got = await r.read(off, MiB)
                views += isinstance(got, memoryview)
                out += got
            joins = r.stats["read_joins"]
            r.close()
            return bytes(out), views, joins

    out, views, joins = run(main)
    assert out == data[MiB // 2:]
    gets = len(store.ranges)
    assert joins <= gets  # at most one per boundary between two GETs
    assert views >= 32 - gets - 1


def test_small_file_costs_exactly_one_get(cfg, cache):
    store = CountingStore()
    data = make_object(store, 150 * KiB)

    async def main():
        async with trio.open_nursery() as n:
            r = await open_reader(store, cache, cfg, n)
            out = bytes(await r.read(0, 128 * KiB)) + bytes(await r.read(128 * KiB, 128 * KiB))
            assert await r.read(150 * KiB, 4096) == b""
            r.close()
            return out

    assert run(main) == data
    assert store.ranges == [(0, 150 * KiB)]


def _read_4k_at(store, cache, cfg, data: bytes, offsets: list[int]) -> None:
    """Read 4 KiB at each offset in turn through one reader, checking the bytes."""

    async def main():
        async with trio.open_nursery() as n:
            r = await open_reader(store, cache, cfg, n)
            for off in offsets:
                assert bytes(await r.read(off, 4096)) == data[off:off + 4096]
            r.close()

    run(main)


def test_random_reads_fetch_only_the_blocks_they_touch(cfg, cache):
    store = CountingStore()
    data = make_object(store, 256 * MiB)
    rng = random.Random(7)
    # Far apart (a seek each time), in random order.
    offsets = [i * 6 * MiB + rng.randrange(0, MiB) for i in range(40)]
    rng.shuffle(offsets)

    _read_4k_at(store, cache, cfg, data, offsets)
    # Each random 4 KiB read costs at most the block(s) it touches, never read-ahead.
    assert all(n <= 2 * cfg.block_bytes for _, n in store.ranges)
    assert sum(n for _, n in store.ranges) <= (len(offsets) + 1) * 2 * cfg.block_bytes


def test_small_reads_a_few_mib_apart_in_order_fetch_only_what_they_touch(cfg, cache):
    """Sorted random offsets (records picked from a file, in file order) are each within the forward
    jump that keeps a stream, but the reader reads 4 KiB of every 3 MiB it passes: the gaps are not
    reading, so the window must not grow with them (it grew to whole parts and fetched everything)."""
    store = CountingStore()
    data = make_object(store, 256 * MiB)
    rng = random.Random(3)
    offsets, off = [], 8 * MiB
    while off < len(data) - 4096:
        offsets.append(off)
        off += rng.randrange(3 * MiB, 4 * MiB - 4096)

    _read_4k_at(store, cache, cfg, data, offsets)
    fetched = sum(n for _, n in store.ranges)
    # The blocks the reads touch (one each, two where a read straddles a boundary), nothing more.
    assert fetched <= (len(offsets) + 1) * 2 * cfg.block_bytes, (fetched / MiB, len(offsets))


def test_footer_read_does_not_fetch_the_whole_file(cfg, cache):
    store = CountingStore()
    data = make_object(store, 100 * MiB)

    async def main():
        async with trio.open_nursery() as n:
            r = await open_reader(store, cache, cfg, n)
            tail = await r.read(len(data) - 8, 8)
            footer = await r.read(len(data) - 64 * KiB, 64 * KiB)
            r.close()
            return bytes(tail), bytes(footer)

    tail, footer = run(main)
    assert tail == data[-8:] and footer == data[-64 * KiB:]
    assert sum(n for _, n in store.ranges) <= cfg.block_bytes


def test_reordered_requests_keep_the_stream(cfg, cache):
    """FUSE may hand us concurrent requests out of order; the stream must survive it."""
    store = CountingStore()
    data = make_object(store, 48 * MiB)
    offsets = list(range(0, len(data), 128 * KiB))
    for i in range(0, len(offsets) - 1, 2):  # swap neighbours
        offsets[i], offsets[i + 1] = offsets[i + 1], offsets[i]

    async def main():
        async with trio.open_nursery() as n:
            r = await open_reader(store, cache, cfg, n)
            out = {}
            for off in offsets:
                out[off] = bytes(await r.read(off, 128 * KiB))
            r.close()
            return b"".join(out[o] for o in sorted(out)), r.stats

    got, stats = run(main)
    assert got == data
    assert stats["random_reads"] == 0
    assert max(n for _, n in store.ranges) == cfg.part_bytes


def test_second_reader_is_served_from_disk_cache(cfg, cache):
    store = CountingStore()
    data = make_object(store, 20 * MiB)

    async def read_all():
        async with trio.open_nursery() as n:
            r = await open_reader(store, cache, cfg, n)
            out = bytearray()
            for off in range(0, len(data), MiB):
                out += await r.read(off, MiB)
            r.close()
            return bytes(out)

    assert run(read_all) == data
    gets = len(store.ranges)
    assert run(read_all) == data
    assert len(store.ranges) == gets  # zero GETs the second time


def test_changed_object_is_stale_not_mixed(cfg, cache):
    store = CountingStore()
    make_object(store, 20 * MiB)

    async def main():
        async with trio.open_nursery() as n:
            r = await open_reader(store, cache, cfg, n)
            await r.read(0, 4096)
            store.put_bytes("b", "obj", os.urandom(20 * MiB))  # overwritten elsewhere
            with pytest.raises(StaleError):
                await r.read(15 * MiB, 4096)
            r.close()

    run(main)


def test_memory_budget_bounds_readahead_and_is_returned(cfg, cache):
    cfg = cfg.replace(readahead_budget_bytes=24 * MiB)
    store = CountingStore()
    for i in range(8):
        make_object(store, 32 * MiB, key=f"o{i}")
    budget = MemoryBudget(cfg.readahead_budget_bytes)
    peak = 0

    async def one(n, key):
        nonlocal peak
        r = await open_reader(store, cache, cfg, n, key=key, budget=budget)
        for off in range(0, 32 * MiB, 256 * KiB):
            await r.read(off, 256 * KiB)
            peak = max(peak, budget.used_bytes)
        r.close()

    async def main():
        async with trio.open_nursery() as n:
            for i in range(8):
                n.start_soon(one, n, f"o{i}")

    run(main)
    # Read-ahead stays inside the budget; only reads being waited on (one block each) may exceed it.
    assert peak <= cfg.readahead_budget_bytes + 8 * 2 * cfg.block_bytes
    assert budget.used_bytes == 0


def test_waits_for_memory_take_back_read_ahead_that_went_idle(monkeypatch):
    """The budget full of read-ahead nobody reads, and nothing being released: an upload waiting
    for room, and a read waiting for the disk cache, must still get on once those blocks are idle
    long enough to be taken back (the resource test once hung here until an unrelated read came)."""
    monkeypatch.setattr(prefetch, "IDLE_RECLAIM_S", 0.2)
    budget = MemoryBudget(8 * MiB)

    class IdleReadAhead:
        def _drop(self, index):
            budget.release(MiB)
            return MiB

    class IdleReadAheadOf:
        def __init__(self, b):
            self.b = b

        def _drop(self, index):
            self.b.release(MiB)
            return MiB

    reader = IdleReadAhead()

    async def main():
        for i in range(8):
            budget.force_reserve(MiB)
            budget.mark_idle(reader, i)
        with trio.fail_after(5):
            await budget.reserve(2 * MiB)  # nobody releases anything meanwhile
        assert budget.used_bytes == 8 * MiB  # two idle blocks went, the upload got their room

        # Reads over the budget while a cache write is on its way; what they fetched goes idle later.
        over = MemoryBudget(8 * MiB)
        for i in range(9):
            over.force_reserve(MiB)
        for i in range(9):
            over.mark_idle(IdleReadAheadOf(over), i)
        over.caching_bytes = MiB
        with trio.fail_after(5):
            await over.wait_for_disk()
        assert over.used_bytes <= over.capacity_bytes

    trio.run(main)


def test_a_read_waited_on_takes_room_from_passed_blocks_then_the_furthest_read_ahead():
    """Over the budget, a read someone waits for first takes blocks readers have already read past
    (kept only for reordered requests), then the newest read-ahead nobody has asked for, never
    one that is still being read."""
    budget = MemoryBudget(6 * MiB)
    dropped = []

    class Reader:
        def __init__(self, name, busy=()):
            self.name, self.busy = name, set(busy)

        def _drop(self, index):
            if index in self.busy:
                return 0  # a read still uses it: it goes later
            dropped.append((self.name, index))
            budget.release(MiB)
            return MiB

    a, b = Reader("a", busy={1}), Reader("b")
    for i in range(6):
        budget.force_reserve(MiB)
    budget.mark_passed(a, 0)
    budget.mark_passed(a, 1)  # still being read
    budget.mark_idle(b, 4)
    budget.mark_idle(b, 5)
    budget.mark_idle(b, 6)
    budget.mark_busy(b, 6)  # a read wants it: no longer idle
    budget.force_reserve(2 * MiB)
    assert dropped == [("a", 0), ("b", 5)]
    assert budget.used_bytes == budget.capacity_bytes



def test_part_buffers_are_private_aligned_and_reusable():
    import ctypes
    import mmap

    async def main():
        budget = MemoryBudget(64 * MiB)
        pool = prefetch.BufferPool(8 * MiB, budget)
        buf = await pool.acquire(8 * MiB)
        assert len(buf) == 8 * MiB
        buf[:4] = b"abcd"
        buf[-4:] = b"wxyz"
        # Page-aligned, as O_DIRECT writes from it want.
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        assert addr % mmap.PAGESIZE == 0
        # Private memory, not shared: a forked child's writes are its own (huge pages need this).
        pid = os.fork()
        if pid == 0:
            buf[:4] = b"CHLD"
            os._exit(0 if buf[:4] == b"CHLD" else 1)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert buf[:4] == b"abcd"
        pool.release(buf)
        assert await pool.acquire(8 * MiB) is buf and pool.reused == 1
        # A buffer someone still views is never handed out again; once the view is gone, it is.
        view = memoryview(buf)[100:200]
        pool.release(buf)
        assert pool.discarded == 1 and await pool.acquire(8 * MiB) is not buf
        view.release()
        pool.release(buf)
        assert await pool.acquire(8 * MiB) is buf
        # Too small for a part buffer: the caller reads into a bytes object instead.
        assert await pool.acquire(1 * MiB) is None

    trio.run(main)


def test_a_read_across_two_fetches_comes_back_in_pieces_when_asked(cfg, cache):
    """The kernel's 8 MiB requests straddle the buffers of two part GETs; for FUSE they are answered
    in pieces (a vectored reply) instead of joined, and the pieces are the bytes, in order."""
    store = CountingStore()
    data = make_object(store, 64 * MiB)

    async def main():
        async with trio.open_nursery() as n:
            r = await open_reader(store, cache, cfg, n)
            got, shapes = bytearray(), []
            off = 0
            for size in (2 * MiB, 4 * MiB) + (8 * MiB,) * 7:  # the kernel's read-ahead ramp
                out = await r.read(off, size, pieces=True)
                shapes.append(len(out) if isinstance(out, tuple) else 1)
                got += b"".join(out) if isinstance(out, tuple) else out
                off += size
            got += await r.read(off, len(data) - off)
            r.close()
            return bytes(got), shapes

    got, shapes = run(main)
    assert got == data
    # Off the 8 MiB part boundaries, a request touches two parts: two pieces, never one per block.
    assert max(shapes) == 2 and shapes.count(2) >= 5, shapes
    assert sum(n for _, n in store.ranges) == len(data)  # and nothing fetched twice for it


def test_the_lazily_loaded_cache_index_is_never_listed_on_the_event_loop(cfg, cache, monkeypatch):
    """A subdirectory of a large cache holds thousands of segments (tens of ms to list): the first
    read of an object whose subdirectory the index has not loaded lists it in a disk thread, never
    on the event loop, where every other FUSE request would wait for it."""
    store = CountingStore()
    data = make_object(store, 3 * MiB)
    where = []
    real = BlockCache._list_subdir

    def listing(self, sub):
        where.append(threading.current_thread() is threading.main_thread())
        return real(self, sub)

    monkeypatch.setattr(BlockCache, "_list_subdir", listing)

    async def main():
        async with trio.open_nursery() as n:
            r = await open_reader(store, cache, cfg, n)
            assert bytes(await r.read(0, 128 * KiB)) == data[:128 * KiB]
            r.close()

    run(main)  # trio runs in the main thread; run_disk's workers do not
    assert where and not any(where), where


def test_idle_pooled_buffers_and_data_in_use_together_stay_in_the_budget(cfg, cache):
    """Part buffers a cold read leaves in the pool are memory too. A second epoch then read from the
    disk cache (blocks that need no pooled buffer) filled the budget beside them: up to twice the
    budget resident. Buffers idle in the pool go once the data in use needs their room."""
    cfg = cfg.replace(readahead_budget_bytes=32 * MiB)
    store = PooledStore()
    data = make_object(store, 64 * MiB)
    budget = MemoryBudget(cfg.readahead_budget_bytes)
    pool = prefetch.BufferPool(cfg.part_bytes, budget)
    peak = 0

    async def read_all(n):
        nonlocal peak
        peak = 0
        r = await open_reader(store, cache, cfg, n, budget=budget)
        r.pool = pool
        for off in range(0, len(data), MiB):
            assert bytes(await r.read(off, MiB)) == data[off:off + MiB]
            peak = max(peak, budget.used_bytes + len(pool._free) * pool.buffer_bytes)
        r.close()

    async def main():
        async with trio.open_nursery() as n:
            await read_all(n)  # cold: ranged GETs into pooled buffers
        assert pool._free  # the pool kept some for the next GETs
        async with trio.open_nursery() as n:
            await read_all(n)  # warm: every block from the disk cache

    run(main)
    assert store.ranges and len(store.ranges) == len({s for s, _ in store.ranges})  # read once
    # Read-ahead stays inside the budget; only a read being waited on (one block) may exceed it.
    assert peak <= cfg.readahead_budget_bytes + 2 * cfg.block_bytes, peak / MiB


def test_a_reread_from_the_disk_cache_comes_in_whole_parts_into_pooled_buffers(cfg, cache):
    """A second epoch from the disk cache read each block into a fresh 1 MiB buffer, one disk
    thread call per block: in a re-read after a remount the page faults of those buffers took the
    disk threads more time than the reads. Whole parts now come in one call each, into the
    buffers the cold read left in the pool, and their blocks share them as a GET's do."""
    store = PooledStore()
    data = make_object(store, 64 * MiB)
    budget = MemoryBudget(cfg.readahead_budget_bytes)
    pool = prefetch.BufferPool(cfg.part_bytes, budget)
    calls = {"get_block": 0, "get_blocks": 0}
    for name in calls:
        def counted(*a, _f=getattr(cache, name), _n=name, **kw):
            calls[_n] += 1
            return _f(*a, **kw)
        setattr(cache, name, counted)

    async def read_all():
        async with trio.open_nursery() as n:
            r = await open_reader(store, cache, cfg, n, budget=budget)
            r.pool = pool
            for off in range(0, len(data), 128 * KiB):
                assert bytes(await r.read(off, 128 * KiB)) == data[off:off + 128 * KiB]
            r.close()
            return r.stats

    run(read_all)  # cold: ranged GETs into pooled buffers, written to the disk cache
    gets, reused, faults = len(store.ranges), pool.reused, dict(calls)
    stats = run(read_all)  # warm: every block from the disk cache
    assert len(store.ranges) == gets  # no GET
    assert stats["cache_hit_blocks"] == 64
    parts = calls["get_blocks"] - faults["get_blocks"]
    assert parts <= 64 * MiB // cfg.part_bytes + 1, calls
    # Only the first part, while the window ramps up to whole parts, comes block by block.
    assert calls["get_block"] - faults["get_block"] <= cfg.part_bytes // cfg.block_bytes, calls
    assert pool.reused - reused >= parts - 1, (pool.reused, reused, parts)


def _faults_writing_every_page(bufs) -> int:
    """Minor faults taken writing a byte to every 4 KiB page of bufs: one strided slice assignment
    per buffer, made in C, so that memory the interpreter maps for itself meanwhile (a new arena
    for the ints of a Python loop, say) does not count as the buffers'."""
    ones = [b"\x01" * -(-len(buf) // 4096) for buf in bufs]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for buf, one in zip(bufs, ones):
        buf[::4096] = one
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_prefilled_pool_hands_a_cold_read_buffers_already_faulted_in(cfg, cache, monkeypatch):
    """The mount fills its pool as it starts (BufferPool.prefill). The first cold read after a mount
    then maps no buffer of its own: on a VM whose free memory goes back to the hypervisor, the page
    clearing of 26 fresh part buffers was a tenth of the machine's CPU for a 1 GiB cold read."""
    store = PooledStore()
    data = make_object(store, 64 * MiB)
    budget = MemoryBudget(cfg.readahead_budget_bytes)
    pool = prefetch.BufferPool(cfg.part_bytes, budget)
    run(lambda: pool.prefill(cfg.prefill_buffers))
    assert pool.prefilled == pool.idle == cfg.prefill_buffers
    # Faulted in already: writing to every page of them faults (next to) nothing; a fresh buffer
    # of the same size faults at least once per huge page, and as many fresh ones as many times.
    fresh = _faults_writing_every_page([prefetch.anonymous_buffer(cfg.part_bytes)])
    assert fresh >= cfg.part_bytes // (2 * MiB) - 1
    assert _faults_writing_every_page(pool._free) < fresh * len(pool._free) // 4

    mapped = []
    real = prefetch.anonymous_buffer
    monkeypatch.setattr(prefetch, "anonymous_buffer", lambda n: mapped.append(n) or real(n))

    async def main():
        async with trio.open_nursery() as n:
            r = await open_reader(store, cache, cfg, n, budget=budget)
            r.pool = pool
            for off in range(0, len(data), MiB):
                assert bytes(await r.read(off, MiB)) == data[off:off + MiB]
            r.close()

    run(main)
    assert len(store.ranges) >= len(data) // cfg.part_bytes  # parts came from the store ...
    assert mapped == [] and pool.mapped == 0  # ... each into a prefilled buffer
    assert pool.reused >= len(data) // cfg.part_bytes - 1


def test_prefill_keeps_no_more_than_the_budget_has_room_for(cfg):
    budget = MemoryBudget(36 * MiB)
    pool = prefetch.BufferPool(cfg.part_bytes, budget)
    run(lambda: pool.prefill(16))
    assert pool.idle == pool.prefilled == 4  # 32 MiB of 36
    assert budget.try_reserve(30 * MiB)  # data in use leaves room for none more
    run(lambda: pool.prefill(16))
    assert pool.idle == 4 and pool.prefilled == 4


class _LetGoBuffer:
    """Stands for a pooled buffer: no view of it is alive, and it records where it is unmapped."""

    def __init__(self):
        self.unmapped_in: threading.Thread | None = None
        self.unmapped = threading.Event()

    def resize(self, n):
        raise ValueError(n)

    def close(self):
        self.unmapped_in = threading.current_thread()
        self.unmapped.set()


def test_buffers_the_pool_lets_go_are_unmapped_off_the_calling_thread():
    """munmap waits for the memory-map lock as mmap does: the event loop, which releases and trims,
    must not be the thread that waits. The one over the budget at release and the one a trim lets
    go are both unmapped in a thread of their own."""
    budget = MemoryBudget(16 * MiB)
    pool = prefetch.BufferPool(8 * MiB, budget)
    kept = [_LetGoBuffer(), _LetGoBuffer()]
    over = _LetGoBuffer()
    for buf in kept + [over]:
        pool.release(buf)
    assert pool.idle == 2
    assert budget.try_reserve(8 * MiB)  # data in use now leaves room for one idle buffer
    pool.trim()
    assert pool.idle == 1 and pool.trimmed == 1
    trimmed = kept[1]  # the pool hands out and lets go of its newest first
    for buf in (over, trimmed):
        assert buf.unmapped.wait(5)
        assert buf.unmapped_in is not threading.current_thread()
    assert kept[0].unmapped_in is None


class CutShortStore(PooledStore):
    """PooledStore whose first ranged GET fails part-way through its body, as a reset connection
    does: the failing call still holds a view of the buffer it was reading into."""

    def __init__(self):
        super().__init__()
        self.failures = 1

    def get(self, bucket, key, start=0, length=None, *, etag=None, into=None):
        if into is not None and self.failures:
            self.failures -= 1
            body = memoryview(into)[:length]  # the body, half read
            body[:4096] = b"\0" * 4096
            raise ConnectionResetError(104, "Connection reset by peer")
        return super().get(bucket, key, start, length, etag=etag, into=into)


def test_a_get_that_fails_part_way_gives_its_buffer_back_to_the_pool(cfg, cache):
    """The failure's traceback keeps the frames of the call that was reading into the buffer, and
    their views of it: the pool, given the buffer back with those alive, threw it away, and the
    next GET mapped and faulted in a fresh 8 MiB."""
    store = CutShortStore()
    data = make_object(store, 64 * MiB)
    budget = MemoryBudget(cfg.readahead_budget_bytes)
    pool = prefetch.BufferPool(cfg.part_bytes, budget)

    async def read_through(n):
        r = await open_reader(store, cache, cfg, n, budget=budget)
        r.pool = pool
        try:
            for off in range(0, len(data), MiB):
                assert bytes(await r.read(off, MiB)) == data[off:off + MiB]
        finally:
            r.close()

    async def main():
        async with trio.open_nursery() as n:
            try:
                await read_through(n)  # once the window reaches whole parts, a GET fails
            except OSError:
                pass  # (or only read-ahead that this pass fetches again: either way)
            await read_through(n)

    run(main)
    assert store.failures == 0  # a GET into a pooled buffer did fail
    assert pool.discarded == 0 and pool.reused >= 1, (pool.discarded, pool.reused)


class SlowStore(CountingStore):
    """CountingStore whose GETs take a while, as a real store's do, so that fetches overlap; the
    first `fail` GETs fail."""

    def __init__(self, fail=0):
        super().__init__()
        self.fail = fail

    def get(self, bucket, key, start=0, length=None, *, etag=None):
        time.sleep(0.02)
        if self.fail:
            self.fail -= 1
            raise StoreError(errno.EIO, "injected", key=key)
        return super().get(bucket, key, start, length, etag=etag)


@pytest.mark.parametrize("readers", [2, 4])
def test_handles_reading_one_file_at_once_share_their_fetches(cfg, cache, readers):
    """Each handle reads ahead for itself: several processes reading one cold file together (ranks
    loading the same weights) made the store send parts of it several times over."""
    store = SlowStore()
    data = make_object(store, 64 * MiB)
    inflight = prefetch.InFlight()
    stats = collections.Counter()

    async def read_all(n, out):
        r = await open_reader(store, cache, cfg, n, inflight=inflight)
        r.stats = stats
        try:
            got = bytearray()
            for off in range(0, len(data), MiB):
                got += await r.read(off, MiB)
            out.append(bytes(got))
        finally:
            r.close()

    async def main():
        out = []
        async with trio.open_nursery() as n:
            for _ in range(readers):
                n.start_soon(read_all, n, out)
        return out

    assert run(main) == [data] * readers
    fetched = sum(length for _, length in store.ranges)
    assert fetched == len(data), (fetched / MiB, sorted(store.ranges))
    assert stats["blocks_from_other_fetches"] > 0, dict(stats)  # (the rest: cached by then)
    assert not inflight._fetching  # every fetch said it ended


def test_a_handle_waiting_on_a_fetch_that_fails_fetches_the_blocks_itself(cfg, cache):
    store = SlowStore(fail=1)
    data = make_object(store, 4 * MiB)
    inflight = prefetch.InFlight()

    async def main():
        async with trio.open_nursery() as n:
            a = await open_reader(store, cache, cfg, n, inflight=inflight)
            b = await open_reader(store, cache, cfg, n, inflight=inflight)
            first = None

            async def read_a():
                nonlocal first
                try:
                    await a.read(0, MiB)
                except OSError as e:
                    first = e

            n.start_soon(read_a)
            with trio.fail_after(5):
                while inflight.fetching(b.version, 0) is None:
                    await trio.sleep(0.001)
            # a's fetch is on its way: b waits for it, then finds nothing cached
            assert bytes(await b.read(0, MiB)) == data[:MiB]
            a.close()
            b.close()
            return first

    assert isinstance(run(main), OSError)
    assert len(store.ranges) == 1  # b's own GET (a's failed before it was counted)
    assert not inflight._fetching
