"""Read-ahead for one open file: fetch what the reader will want before it asks.

The unit is the cache block (`block_bytes`, 1 MiB). A handle keeps the blocks around its read position
in memory; each one comes from the local disk cache when it is there and otherwise from the store by
ranged GET, and every block fetched from the store is written to the disk cache.

Sequential detection. The kernel splits a reader's `read()` into requests of up to 128 KiB (1 MiB
with a larger read-ahead), and FUSE may hand concurrent requests to us out of order. A read counts as
sequential when it starts between a little behind the furthest byte read so far and up to
`FORWARD_JUMP_BYTES` ahead of it, so reordering and small skips keep the stream.

Window. A sequential stream starts with `readahead_initial_bytes` (1 MiB + 128 KiB: the kernel's
first two requests) so that reading just a file's head costs one small GET, and the window doubles
each time the reader has consumed a whole window, up to `readahead_max_bytes`: the read-ahead never
exceeds twice what the stream has read, which bounds what a long read at a random offset (several
sequential requests from the kernel) costs beyond itself. Once the window reaches
`part_bytes`, read-ahead is issued in whole parts (8 MiB ranged GETs aligned to part boundaries),
several in flight at once; that is where a store delivers full throughput. A random read resets the
window and fetches only the blocks it touches.

Memory. All handles share one `MemoryBudget`. Speculative fetches only start when the budget has
room; a read that needs a block now always proceeds (its size is bounded by the request), so nothing
deadlocks. Blocks well behind the reader are dropped at once; the last ones it read stay for
reordered requests, but anyone short of room takes them first. Blocks fetched ahead but left
untouched for a while can be reclaimed by other handles, since the disk cache still has them; a
read someone waits for may take any of them at once, the furthest ahead first.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterable

import trio

from . import errors
from .aiostore import AsyncStore, run_disk, submit_disk
from .cache import BlockCache, ObjectVersion
from .config import MiB, MountConfig

log = logging.getLogger(__name__)

# A read this far ahead of the stream's end still continues the stream: the kernel's own read-ahead
# sends its first requests together (a read and the window after it) and they may arrive out of
# order; later windows are asked for only once the reader is inside the one before. A read inside
# what we already fetch ahead continues the stream too. Anything further is a seek.
FORWARD_JUMP_BYTES = 4 * MiB
# A read this far behind the stream's end still counts as sequential (FUSE reordering).
BACKWARD_SLACK_BYTES = 2 * MiB
# Blocks kept behind the read position, for reordered or slightly backward reads. A later request for
# an older block is served again from the disk cache; a block a read is waiting for is never dropped.
KEEP_BEHIND_BYTES = 2 * MiB
# Read-ahead blocks untouched this long may be taken back by other handles under memory pressure.
IDLE_RECLAIM_S = 2.0


class MemoryBudget:
    """Bytes of file data held in memory by the whole daemon: read-ahead, reads in flight, and the
    buffers of uploads (parts, small files). One budget for both, so many readers and writers
    together still fit the host (README "Semantics": bounded resources)."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.peak_bytes = 0
        self.caching_bytes = 0  # fetched data waiting for its disk cache write
        self._released = trio.Event()
        # Ready blocks nobody has read yet, oldest first: (reader, index) -> time they became idle.
        self._idle: collections.OrderedDict[tuple["ObjectReader", int], float] = collections.OrderedDict()
        # Blocks a reader has already read past, kept for a reordered request (KEEP_BEHIND_BYTES):
        # the first to go when someone needs room, at once.
        self._passed: collections.OrderedDict[tuple["ObjectReader", int], None] = collections.OrderedDict()
        self.reclaimed = 0
        self.readers = 0  # ObjectReaders open: files being read from the store or the disk cache
        # Called when a reader opens, before it allocates anything (ucfs.allocator.Allocator.reading).
        self.on_reading: Callable[[], None] | None = None

    def reader_opened(self) -> None:
        self.readers += 1
        if self.on_reading is not None:
            self.on_reading()

    def reader_closed(self) -> None:
        self.readers -= 1

    def try_reserve(self, n: int) -> bool:
        if self.used_bytes + n > self.capacity_bytes:
            self._reclaim(self.used_bytes + n - self.capacity_bytes)
            if self.used_bytes + n > self.capacity_bytes:
                return False
        self._take(n)
        return True

    def force_reserve(self, n: int) -> None:
        """Reserve for a read someone is waiting on: never refused (bounded by the request size).
        Short of room, it takes it from read-ahead nobody has asked for yet, however recent, newest
        first (the furthest ahead): that is in the disk cache already, and demand comes before
        speculation."""
        if self.used_bytes + n > self.capacity_bytes:
            self._reclaim(self.used_bytes + n - self.capacity_bytes, for_demand=True)
        self._take(n)

    async def reserve(self, n: int) -> None:
        """Reserve for work that can wait (uploads): wait until it fits. Something always fits when
        nothing else is reserved, so a single large request cannot wait forever."""
        while self.used_bytes + n > self.capacity_bytes and self.used_bytes > 0:
            self._reclaim(self.used_bytes + n - self.capacity_bytes)
            if self.used_bytes + n <= self.capacity_bytes:
                break
            await self._wait_released()
        self._take(n)

    async def wait_for_disk(self) -> None:
        """Backpressure for reads: while memory is over budget because fetched data is still on its
        way to the disk cache, wait for it. (A store faster than the local disk would otherwise pile
        up fetched blocks without bound, since reads someone waits for are never refused.) Waiting is
        safe: cache writes finish on their own."""
        while self.used_bytes > self.capacity_bytes and self.caching_bytes > 0:
            self._reclaim(self.used_bytes - self.capacity_bytes)
            if self.used_bytes <= self.capacity_bytes:
                break
            await self._wait_released()

    async def _wait_released(self) -> None:
        """Wait until memory is given back, or until read-ahead left idle may have become
        reclaimable. Read-ahead nobody reads is only taken back when someone asks for room; if every
        task waits here, nobody asks. Seen once in the resource test: 32 readers and 8 uploads all
        waiting, the budget full of idle read-ahead, until an unrelated read freed it."""
        with trio.move_on_after(IDLE_RECLAIM_S / 2):
            await self._released.wait()

    def _take(self, n: int) -> None:
        self.used_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def release(self, n: int) -> None:
        self.used_bytes -= n
        assert self.used_bytes >= 0, "memory budget released more than reserved"
        self._released.set()
        self._released = trio.Event()

    def mark_idle(self, reader: "ObjectReader", index: int) -> None:
        self._idle[(reader, index)] = time.monotonic()

    def mark_busy(self, reader: "ObjectReader", index: int) -> None:
        self._idle.pop((reader, index), None)
        self._passed.pop((reader, index), None)

    def mark_passed(self, reader: "ObjectReader", index: int) -> None:
        self._idle.pop((reader, index), None)
        self._passed[(reader, index)] = None

    def _reclaim(self, need: int, *, for_demand: bool = False) -> None:
        """Take back up to `need` bytes: blocks readers have read past first (32 readers keeping
        2 MiB each behind them were half of a 64 MiB budget), then read-ahead idle for
        IDLE_RECLAIM_S, oldest first; for a read someone waits on (`for_demand`), then any idle
        read-ahead, newest (the furthest ahead) first."""
        while need > 0 and self._passed:
            need -= self._take_back(self._passed.popitem(last=False)[0])
        cutoff = time.monotonic() - IDLE_RECLAIM_S
        while need > 0 and self._idle:
            key, since = next(iter(self._idle.items()))
            if since > cutoff:
                break
            self._idle.popitem(last=False)
            need -= self._take_back(key)
        while for_demand and need > 0 and self._idle:
            need -= self._take_back(self._idle.popitem(last=True)[0])

    def _take_back(self, key: tuple["ObjectReader", int]) -> int:
        reader, index = key
        self.reclaimed += 1
        return reader._drop(index)


def anonymous_buffer(n: int) -> mmap.mmap:
    """n bytes of page-aligned private memory, in huge pages where the kernel has them to give.

    Each part is pinned page by page twice: by the O_DIRECT write into the disk cache and by the
    kernel copying FUSE replies out of it. On 4 KiB pages that pinning was 9 % of a cold read's
    CPU; a 2 MiB page is pinned in one step. (Python's default anonymous map is shared memory,
    which gets no huge pages unless the administrator enabled them for shmem.)"""
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no THP in this kernel or this Python
        buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


def touched_buffer(n: int) -> mmap.mmap:
    """`anonymous_buffer(n)` with every page already faulted in (a byte written to each)."""
    buf = anonymous_buffer(n)
    for offset in range(0, n, mmap.PAGESIZE):
        buf[offset] = 0
    return buf


def _viewed(buf: mmap.mmap) -> bool:
    """Whether a view of buf is still alive. mmap.resize checks for views before anything else, so
    an impossible size answers without a system call. (A real resize is an mremap, which takes the
    memory-map lock for writing, as mmap does, on the event loop.)"""
    try:
        buf.resize(-1)
    except BufferError:
        return True
    except (ValueError, OverflowError, OSError):
        pass
    return False


class BufferPool:
    """Part-sized, page-aligned buffers for ranged GETs, reused rather than allocated per request.

    A fresh multi-MiB buffer costs a page fault per 4 KiB the first time it is written, which on
    the virtual machines we measured was a third of a cold read's CPU; a reused one costs nothing.
    Page alignment lets the disk cache write a fetched part straight from its buffer with O_DIRECT,
    without a copy. Idle buffers are kept only while they and the data in use together fit the
    memory budget, so the pool never lets memory exceed it.
    """

    def __init__(self, buffer_bytes: int, budget: MemoryBudget):
        self.buffer_bytes = buffer_bytes
        self.budget = budget
        self._free: list[mmap.mmap] = []
        self.reused = 0
        self.discarded = 0
        self.trimmed = 0
        self.prefilled = 0
        self.mapped = 0  # made for a request that found none idle

    @property
    def idle(self) -> int:
        """Buffers kept for reuse now."""
        return len(self._free)

    async def prefill(self, count: int) -> None:
        """Make up to `count` buffers now, their pages faulted in, and keep them idle for reuse.

        Called as the mount starts, so that its first read finds what every later one does.
        Faulting fresh memory is not free: the kernel zeroes every page, and a virtual machine
        whose free memory went back to its hypervisor (free page reporting) faults it in there
        as well. On the 2-core VMs we measure on, 26 new buffers cost the first 1 GiB read after a
        mount 0.4 CPU-seconds of page clearing (`perf`): a tenth of what the whole machine spent on
        that read, all of it in the store threads' receives. Only as many as fit the budget are
        kept, as `release` would."""
        for _ in range(count):
            if not self._room_for_one_more():
                break
            buf = await run_disk(touched_buffer, self.buffer_bytes)
            self.prefilled += 1
            self.release(buf)

    def take(self, n: int) -> mmap.mmap | None:
        """An idle buffer for n bytes, now, if the pool has one and n is worth pooling."""
        if self._free and self.buffer_bytes // 2 <= n <= self.buffer_bytes:
            self.reused += 1
            return self._free.pop()
        return None

    async def acquire(self, n: int) -> mmap.mmap | None:
        """A buffer of at least n bytes, or None for requests too small to be worth pooling."""
        if n > self.buffer_bytes or n < self.buffer_bytes // 2:
            self.trim()  # the caller allocates memory of its own, reserved already
            return None
        buf = self.take(n)
        if buf is not None:
            return buf
        # In a thread: mmap and madvise take the process's memory-map lock for writing, and wait
        # for whatever holds it (another thread's page faults or page pinning, say). In the bench's
        # 1 GiB write the event loop stalled for 110-160 ms once a run (caught in madvise) while
        # other threads read parts into fresh buffers, and every FUSE request waited meanwhile.
        self.mapped += 1
        return await run_disk(anonymous_buffer, self.buffer_bytes)

    def trim(self) -> None:
        """Let idle buffers go while they and the data in use together exceed the budget. Called
        where memory outside the pool is about to be used (short runs read from the disk cache, small
        GETs): a pool filled by a cold read sat beside a warm one's blocks, up to twice the budget."""
        budget = self.budget
        while self._free and budget.used_bytes + len(self._free) * self.buffer_bytes > budget.capacity_bytes:
            _unmap(self._free.pop())
            self.trimmed += 1

    def _room_for_one_more(self) -> bool:
        """Whether one more idle buffer fits the budget beside the data in use."""
        budget = self.budget
        return budget.used_bytes + (len(self._free) + 1) * self.buffer_bytes <= budget.capacity_bytes

    def release(self, buf: mmap.mmap) -> None:
        if _viewed(buf):
            self.discarded += 1  # someone still reads it: never hand it out again
            return
        if self._room_for_one_more():
            self._free.append(buf)
        else:
            _unmap(buf)


def _unmap(buf: mmap.mmap) -> None:
    """Unmap a buffer let go of, in a disk thread, now. munmap takes the process's memory-map lock
    for writing, as mmap does (BufferPool.acquire), and waits for whoever holds it: on the event loop
    that wait stalls every request. Nobody uses the buffer any more; only its memory goes."""
    submit_disk(buf.close)


class InFlight:
    """Blocks that some open handle is fetching from the store now, by object version: another handle
    of the same version that wants them waits for that fetch and reads them from the disk cache it
    writes them to, instead of asking the store for the same bytes again.

    Several processes reading one file at once (ranks loading the same weights, `DataLoader` workers
    on one shard) share the kernel's page cache, but each handle reads ahead for itself here: four
    `dd` of one cold 256 MiB file made the store send 378 MiB. One event per fetch, set once its
    blocks are in the disk cache or the fetch has failed (then the waiter fetches them itself)."""

    def __init__(self) -> None:
        self._fetching: dict[tuple[str, int], trio.Event] = {}

    def fetching(self, version: ObjectVersion, index: int) -> trio.Event | None:
        return self._fetching.get((version.digest, index))

    def announce(self, version: ObjectVersion, first: int, stop: int) -> trio.Event:
        done = trio.Event()
        for i in range(first, stop):
            self._fetching[(version.digest, i)] = done
        return done

    def finish(self, version: ObjectVersion, first: int, stop: int, done: trio.Event) -> None:
        for i in range(first, stop):
            if self._fetching.get((version.digest, i)) is done:
                del self._fetching[(version.digest, i)]
        done.set()


@dataclass(eq=False)
class _Run:
    """The blocks one GET fetched, sharing its buffer. The buffer, and the budget it holds, go back
    only when every block has let go of it and the cache has written it: memory is counted as long
    as it is actually held, not block by block."""

    buf: mmap.mmap | None
    refs: int
    reserved: int = 0
    view: memoryview | None = None  # all the run's data, while the run lives
    first: int = 0  # index of its first block


@dataclass(eq=False)
class _Block:
    index: int
    ready: trio.Event = field(default_factory=trio.Event)
    data: memoryview | bytes | None = None
    error: BaseException | None = None
    reserved: int = 0  # bytes of budget held
    cached: bool = False  # on disk (or not worth caching): memory copy may be dropped
    drop_when_cached: bool = False
    waiters: int = 0  # reads waiting for this block: it is not dropped under them
    run: _Run | None = None  # the pooled buffer this block's data lives in


class ObjectReader:
    """Reads of one object version through one open handle (see the module doc)."""

    def __init__(self, *, store: AsyncStore, bucket: str, key: str, version: ObjectVersion, size: int,
                 cache: BlockCache | None, budget: MemoryBudget, cfg: MountConfig,
                 nursery: trio.Nursery, stats: collections.Counter | None = None,
                 pool: BufferPool | None = None, inflight: InFlight | None = None):
        self.store = store
        self.bucket = bucket
        self.key = key
        self.version = version
        self.size = size
        self.cache = cache
        self.budget = budget
        self.cfg = cfg
        self.B = cfg.block_bytes
        self.nursery = nursery
        self.stats = stats if stats is not None else collections.Counter()
        self.pool = pool
        # Shared with the other handles; only with a disk cache, through which their fetches are shared.
        self.inflight = inflight if cache is not None else None
        self.blocks: dict[int, _Block] = {}
        self.window = cfg.readahead_initial_bytes
        self.stream_start = 0  # where the current sequential stream began
        self.stream_end = 0  # furthest byte read by the current sequential stream
        # Bytes the current stream's requests asked for: what the window grows with. Not the span
        # stream_end - stream_start, which counts the bytes a stream skipped over as read.
        self.stream_read = 0
        self._index_loaded = False  # the cache's index covers this version's subdirectory
        self._scheduled_end = 0  # end of the contiguous scheduled region of the stream
        self._low = 0  # no block below this index is held (blocks behind the reader are dropped)
        self._closed = False
        self._cancel_scopes: set[trio.CancelScope] = set()
        self.gets = 0  # ranged GETs issued (tests count them)
        budget.reader_opened()

    @property
    def nblocks(self) -> int:
        return (self.size + self.B - 1) // self.B

    # -- the read path ----------------------------------------------------------------------
    async def read(self, off: int, size: int, *, pieces: bool = False
                   ) -> bytes | memoryview | tuple[memoryview, ...]:
        """The bytes [off, off + size) (fewer at the end of the object). With `pieces`, a read that
        spans the buffers of several fetches comes back as a tuple of views, in order, for the
        caller to send without joining them (FUSE: Passthrough.vector_reply)."""
        if off >= self.size or size <= 0:
            return b""
        end = min(off + size, self.size)
        if not self._index_loaded:
            # Planning asks the cache which blocks it has, on the event loop: the first question
            # about a subdirectory the lazily loaded index has not listed yet would list it there,
            # holding up every other request meanwhile. (Asked once per reader: the question costs
            # a digest of the version, and a listed subdirectory stays listed.)
            if self.cache is not None and not self.cache.index_loaded_for(self.version):
                await run_disk(self.cache.load_index_for, self.version)
            self._index_loaded = True
        if self.budget.used_bytes > self.budget.capacity_bytes:
            await self.budget.wait_for_disk()
        self._plan(off, end)
        B = self.B
        first, last = off // B, (end - 1) // B
        if first == last:
            blk = await self._wait(first)
            base = first * B
            out: bytes | memoryview = blk.data[off - base:end - base]
            self._let_go_after_reply([blk])
        else:
            blocks: list[_Block] = []
            viewed = False  # the answer is a view of the blocks' buffers
            try:
                for i in range(first, last + 1):
                    blocks.append(await self._wait(i))
                parts = _pieces(blocks, off, end, B)
                if len(parts) == 1:
                    # Fetched by one GET, the blocks lie side by side in its buffer: answer with a
                    # view of it. A copy would cost a fresh 1 MiB buffer (256 page faults) and a
                    # memcpy, for every read the kernel does not align to our blocks.
                    out, viewed = parts[0], True
                elif pieces:
                    self.stats["read_pieces"] += 1
                    out, viewed = parts, True
                else:
                    self.stats["read_joins"] += 1
                    out = b"".join(parts)
            finally:
                if viewed:
                    self._let_go_after_reply(blocks)
                else:
                    for blk in blocks:
                        self._done_with(blk)
        self._drop_behind(first, end)
        return out

    def _let_go_after_reply(self, blocks: list[_Block]) -> None:
        """`_done_with` for blocks whose buffers the answer views, once that answer is sent.

        The last read of a block that was waiting to be dropped lets its buffer go. Let go while the
        answer still views it, the pool must discard the buffer (it cannot hand out memory someone
        reads), and the next GET maps and faults in a fresh one: 8 MiB of first-touch page faults,
        1 to 12 times per cold GiB. The caller sends the answer before its task next yields (pyfuse3
        replies as the handler returns), so a task started now runs after it."""
        if any(b.drop_when_cached for b in blocks):
            self.nursery.start_soon(self._let_go, blocks)
        else:
            for blk in blocks:
                self._done_with(blk)

    async def _let_go(self, blocks: list[_Block]) -> None:
        for blk in blocks:
            self._done_with(blk)

    def _done_with(self, blk: _Block) -> None:
        blk.waiters -= 1
        if blk.drop_when_cached and blk.waiters == 0:
            self._drop(blk.index, blk)

    async def _wait(self, index: int) -> _Block:
        """The block, ready, with this read counted as using it (release with `_done_with`)."""
        while True:
            blk = self.blocks.get(index)
            if blk is None:
                # Dropped between planning and now (memory pressure): fetch it on demand.
                self._schedule(index, index + 1, index + 1)
                blk = self.blocks[index]
            blk.waiters += 1
            if not blk.ready.is_set():
                self.stats["read_waits"] += 1
                try:
                    await blk.ready.wait()
                except BaseException:
                    blk.waiters -= 1
                    raise
            if blk.error is not None:
                blk.waiters -= 1
                raise _as_oserror(blk.error, self.key)
            if blk.data is None:  # taken back while we waited: fetch again
                blk.waiters -= 1
                continue
            self.budget.mark_busy(self, index)
            return blk

    def _plan(self, off: int, end: int) -> None:
        B = self.B
        first, demand_stop = off // B, (end - 1) // B + 1
        sequential = (self.stream_end - BACKWARD_SLACK_BYTES <= off
                      <= max(self.stream_end + FORWARD_JUMP_BYTES, self._scheduled_end))
        if not sequential:
            self.stats["random_reads"] += 1
            self.window = self.cfg.readahead_initial_bytes
            self.stream_start = off
            self.stream_end = end
            self.stream_read = end - off
            self._scheduled_end = end
            self._schedule(first, demand_stop, demand_stop)
            return
        self.stream_end = max(self.stream_end, end)
        self.stream_read += end - off
        # The reader has consumed a whole window since the stream began: it keeps up, so look twice
        # as far ahead. Growing with what was read (not per request) keeps a long read at a random
        # offset - which the kernel hands us as several sequential requests - from fetching far
        # more than it asked for: the window never exceeds twice what the stream has read. Read,
        # not passed over: small reads a few MiB apart in increasing order (sorted random offsets,
        # records picked from a file) stay one stream, and counting the gaps as read grew the
        # window to whole parts until they fetched the whole file.
        while self.stream_read >= self.window and self.window < self.cfg.readahead_max_bytes:
            self.window = min(self.window * 2, self.cfg.readahead_max_bytes)
        if self.stream_start > 0 and self.stream_read < self.cfg.readahead_initial_bytes:
            # A stream that began at a seek has not shown it is one yet: a column chunk or record read
            # at a random offset arrives as a few requests in a row. Fetch what they touch, nothing
            # more, until it has read a first window's worth. (A stream from the file's head reads
            # ahead at once: small files then cost one GET.)
            self._schedule(first, demand_stop, demand_stop)
            self._scheduled_end = max(self._scheduled_end, min(demand_stop * B, self.size))
            return
        part = self.cfg.part_bytes
        target = min(off + self.window, self.size)
        ahead_from = self._scheduled_end if off <= self._scheduled_end else end
        ahead_from = max(ahead_from, end)
        if self.window >= part:
            # Whole aligned parts from here on, topped up only once a part's worth is missing, so each
            # GET is a full part rather than a trickle of single blocks.
            target = min(-(-target // part) * part, self.size)
            if target - ahead_from < part and target < self.size:
                target = end
        elif target - ahead_from < self.window // 2 and target < self.size:
            target = end  # likewise while ramping up: top up by half a window at a time
        stop = max(demand_stop, -(-target // B))
        if all(i in self.blocks for i in range(first, demand_stop)):
            # Steady state: what this read needs is here or coming; only extend the read-ahead.
            first = max(demand_stop, ahead_from // B)
        got = self._schedule(first, demand_stop, stop)
        self._scheduled_end = max(ahead_from, min(got * B, self.size))

    def _schedule(self, first: int, demand_stop: int, stop: int) -> int:
        """Make sure blocks [first, stop) are present or on their way; returns where it stopped.

        Blocks before `demand_stop` are wanted by a waiting read and always fetched; the rest are
        read-ahead and stop at the first one the memory budget cannot hold. Runs of missing blocks
        become one fetch each, cut at part boundaries, so a cold first read and its read-ahead share
        one GET.
        """
        stop = min(stop, self.nblocks)
        per_part = self.cfg.part_bytes // self.B
        self._low = min(self._low, first)
        i = first
        while i < stop:
            if i in self.blocks:
                i += 1
                continue
            source = self._source(i)
            j = i + 1
            part_end = (i // per_part + 1) * per_part
            while j < stop and j < part_end and j not in self.blocks and self._source(j) == source:
                j += 1
            forced_end = min(j, max(i, demand_stop))
            forced = min(forced_end * self.B, self.size) - i * self.B if forced_end > i else 0
            spec = min(j * self.B, self.size) - i * self.B - forced
            if forced:
                self.budget.force_reserve(forced)
            if spec and not self.budget.try_reserve(spec):
                self.stats["readahead_throttled"] += 1
                j = forced_end
                if j == i:
                    return i
            run = [_Block(k) for k in range(i, j)]
            for blk in run:
                blk.reserved = min((blk.index + 1) * self.B, self.size) - blk.index * self.B
                self.blocks[blk.index] = blk
            # A pooled buffer idle now goes to this run at once, as the budget just counted its
            # memory: left in the pool until the fetch starts, it would be counted twice meanwhile.
            buf = self.pool.take(min(j * self.B, self.size) - i * self.B) if self.pool is not None else None
            if source is _STORE:
                # Announced now, not when the fetch starts: another handle may plan before then.
                done = self.inflight.announce(self.version, i, j) if self.inflight is not None else None
                self.nursery.start_soon(self._fetch, run, False, buf, (), done)
            else:
                after = () if source is _CACHE else {self.inflight.fetching(self.version, k) for k in range(i, j)}
                self.nursery.start_soon(self._fetch, run, True, buf, after)
            i = j
        return stop

    def _source(self, index: int) -> object:
        """Where block `index` comes from: the disk cache, another handle's fetch now on its way
        there, or the store."""
        if self.cache is not None and self.cache.contains(self.version, index):
            return _CACHE
        if self.inflight is not None and self.inflight.fetching(self.version, index) is not None:
            return _ELSEWHERE
        return _STORE

    # -- fetching -----------------------------------------------------------------------------
    async def _fetch(self, run: list[_Block], from_cache: bool, buf: mmap.mmap | None = None,
                     after: Iterable[trio.Event | None] = (), done: trio.Event | None = None) -> None:
        """Bring the run's blocks into memory; `buf`, a pooled buffer for them taken already.
        `after`: other handles' fetches of these blocks, to wait for before reading the disk cache.
        `done`: this fetch as announced to the others (`InFlight`), told when its blocks are cached."""
        try:
            await self._fetch_run(run, from_cache, buf, after)
        finally:
            if done is not None:
                self.inflight.finish(self.version, run[0].index, run[-1].index + 1, done)

    async def _fetch_run(self, run: list[_Block], from_cache: bool, buf: mmap.mmap | None,
                         after: Iterable[trio.Event | None]) -> None:
        fetched: list[tuple[list[_Block], memoryview, _Run | None]] = []
        with trio.CancelScope() as scope:
            # close() cancels what is still on its way; data that has arrived is cached regardless.
            self._cancel_scopes.add(scope)
            try:
                if from_cache:
                    for other in after:
                        if other is not None:
                            await other.wait()
                    missing = await self._load_cached(run, buf)
                    if after:
                        self.stats["blocks_from_other_fetches"] += len(run) - len(missing)
                    # Evicted or damaged since we looked: fetch those from the store.
                    for sub in _contiguous(missing):
                        fetched.append((sub, *await self._get(sub)))
                else:
                    fetched.append((run, *await self._get(run, buf)))
            except BaseException as e:  # Cancelled too: no waiter may hang, no budget may leak
                self._abandon(run, e)
                if isinstance(e, trio.Cancelled) or not isinstance(e, Exception):
                    raise
                log.warning("read of %r failed: %s", self.key, e)
            finally:
                self._cancel_scopes.discard(scope)
        while fetched:
            blocks, view, r = fetched.pop()
            n = len(view)
            self.budget.caching_bytes += n
            try:
                await self._cache_run(blocks, view, r.buf)
            finally:
                # Counted down before the run lets go of its memory, so whoever that wakes sees it.
                self.budget.caching_bytes -= n
                del view  # the buffer can only go back to the pool once no view of it is left
                self._unref(r)

    def _abandon(self, run: list[_Block], e: BaseException) -> None:
        for blk in run:
            if not blk.ready.is_set():
                blk.error = e if isinstance(e, Exception) and not isinstance(e, trio.Cancelled) \
                    else errors.fs_error(errors.EIO, "read abandoned")
                blk.ready.set()
                if self.blocks.get(blk.index) is blk:
                    del self.blocks[blk.index]  # a later read tries again
                self._release(blk)
            elif not blk.cached:
                self._cached(blk)  # give up on caching it; memory goes back when it is dropped

    async def _load_cached(self, run: list[_Block], buf: mmap.mmap | None = None) -> list[_Block]:
        """Read the run's blocks from the disk cache; returns those it no longer has.

        A run big enough for the pool is read into a pooled buffer (`buf`, or one acquired now), in
        one call to a disk thread, and its blocks share that buffer as a GET's do. (Smaller runs
        take memory of their own, block by block; `BufferPool.acquire` makes room for it.)"""
        length = min((run[-1].index + 1) * self.B, self.size) - run[0].index * self.B
        if buf is None and self.pool is not None:
            buf = await self.pool.acquire(length)
        if buf is None:
            return await self._load_cached_blocks(run)
        view = memoryview(buf)[:length]
        try:
            found = await run_disk(self._read_cached, view, run[0].index)
        except BaseException:
            del view
            self.pool.release(buf)
            raise
        # Each block found holds the run, and so does this call until it has handed them out.
        r = _Run(buf, sum(found) + 1, view=view, first=run[0].index)
        missing = []
        for k, blk in enumerate(run):
            if not found[k]:
                missing.append(blk)
                continue
            self.stats["cache_hit_blocks"] += 1
            self._share(blk, r, k)
            blk.cached = True
            self._ready(blk)
        del view
        self._unref(r)
        return missing

    def _share(self, blk: _Block, r: _Run, k: int) -> None:
        """The block is the k-th of run r: its data is that slice of the run's buffer, and its share
        of the budget is the run's from now on (given back when the buffer goes)."""
        assert r.view is not None
        blk.data = r.view[k * self.B:(k + 1) * self.B]
        blk.run = r
        r.reserved += blk.reserved
        blk.reserved = 0

    def _read_cached(self, view: memoryview, first: int) -> list[bool]:
        # A pooled buffer is page-aligned: the cache reads into it directly from the disk, so the
        # blocks are not kept a second time in the page cache of its files (the kernel's cache of
        # this file holds them already, once they are read).
        return self.cache.get_blocks(self.version, first, view, aligned=True)

    async def _load_cached_blocks(self, run: list[_Block]) -> list[_Block]:
        missing = []
        for blk in run:
            data = await run_disk(self.cache.get_block, self.version, blk.index)
            if data is None:
                missing.append(blk)
                continue
            self.stats["cache_hit_blocks"] += 1
            blk.data = data
            blk.cached = True
            self._ready(blk)
        return missing

    async def _get(self, run: list[_Block], buf: mmap.mmap | None = None) -> tuple[memoryview, _Run]:
        """One ranged GET of the run's blocks, into `buf` or a buffer from the pool."""
        start = run[0].index * self.B
        length = min((run[-1].index + 1) * self.B, self.size) - start
        self.gets += 1
        self.stats["gets"] += 1
        if buf is None and self.pool is not None:
            buf = await self.pool.acquire(length)
        try:
            data, info = await self.store.get(self.bucket, self.key, start, length, etag=self.version.etag,
                                              into=buf)
        except BaseException as e:
            if buf is not None:
                # The frames of the call that was reading into buf are in e's traceback, and may
                # still hold views of it: the pool would have to throw it away.
                traceback.clear_frames(e.__traceback__)
                self.pool.release(buf)
            if isinstance(e, errors.StoreError) and e.errno == errors.ENOENT:
                # The version this handle reads was deleted: for the handle, as for a replaced one,
                # the file changed under it (README "Semantics": Reads).
                raise errors.StaleError(self.key) from e
            raise
        if len(data) != length:
            raise errors.StoreError(errors.EIO, f"store returned {len(data)} bytes for a {length}-byte "
                                    "range", key=self.key)
        self.stats["get_bytes"] += length
        view = memoryview(data)
        if buf is not None and view.obj is not buf:
            self.pool.release(buf)  # the store did not use it
            buf = None
        del data
        r = _Run(buf, len(run) + 1, view=view, first=run[0].index)  # each block, plus the cache write
        for k, blk in enumerate(run):
            self._share(blk, r, k)
            self._ready(blk)
        return view, r

    def _unref(self, r: _Run | None) -> int:
        """One holder of a run let go; returns the bytes of budget given back (when it was the last)."""
        if r is None:
            return 0
        r.refs -= 1
        if r.refs > 0:
            return 0
        r.view = None  # no view of the buffer may outlive the run (the pool reuses it)
        n, r.reserved = r.reserved, 0
        if n:
            self.budget.release(n)
        if r.buf is not None and self.pool is not None:
            self.pool.release(r.buf)
        return n

    async def _cache_run(self, run: list[_Block], view: memoryview, backing: mmap.mmap | None) -> None:
        """Keep blocks fetched together in the disk cache, as one segment; their memory may go once
        they are there. `backing`, when given, is the page-aligned buffer `view` starts at."""
        if self.cache is not None:
            try:
                with trio.CancelScope(shield=True):
                    await run_disk(self.cache.put_blocks, self.version, run[0].index, view, backing)
            except OSError as e:
                log.warning("could not write cache blocks of %r: %s", self.key, e)
        for blk in run:
            if not blk.cached:
                self._cached(blk)

    def _ready(self, blk: _Block) -> None:
        blk.ready.set()
        if blk.cached:
            self._cached(blk)

    def _cached(self, blk: _Block) -> None:
        blk.cached = True
        if blk.drop_when_cached or self._closed:
            self._drop(blk.index, blk)
        elif self.blocks.get(blk.index) is blk:
            self.budget.mark_idle(self, blk.index)

    # -- letting go ---------------------------------------------------------------------------
    def _drop_behind(self, first: int, end: int) -> None:
        """After a read of [first block, end): drop blocks well behind it; those it has read to
        their end stay for reordered requests, but anyone short of memory may take them."""
        keep = KEEP_BEHIND_BYTES // self.B
        if self.budget.used_bytes > self.budget.capacity_bytes:
            keep = 0  # memory is short: what the reader has passed is on disk, let it go now
        limit = first - keep
        while self._low < limit:
            if self._low in self.blocks:
                self._drop(self._low)
            self._low += 1
        done = end // self.B if end < self.size else self.nblocks  # blocks read to their end
        for index in range(max(self._low, limit), done):
            if index in self.blocks:
                self.budget.mark_passed(self, index)

    def _drop(self, index: int, blk: _Block | None = None) -> int:
        """Forget a block's memory copy; returns the bytes given back to the budget."""
        blk = blk or self.blocks.get(index)
        if blk is None:
            return 0
        if not blk.ready.is_set() or not blk.cached or blk.waiters:
            blk.drop_when_cached = True  # the fetch, the cache write or a read still needs it
            return 0
        if self.blocks.get(index) is blk:
            del self.blocks[index]
        self.budget.mark_busy(self, index)
        blk.data = None
        r, blk.run = blk.run, None
        return self._unref(r) + self._release(blk)

    def _release(self, blk: _Block) -> int:
        n, blk.reserved = blk.reserved, 0
        if n:
            self.budget.release(n)
        return n

    def close(self) -> None:
        """The handle is released: give back memory now, let in-flight fetches end quietly."""
        if not self._closed:
            self.budget.reader_closed()
        self._closed = True
        for idx in list(self.blocks):
            self._drop(idx)
        for scope in list(self._cancel_scopes):
            scope.cancel()


# Where a scheduled run of blocks comes from (ObjectReader._source).
_CACHE, _ELSEWHERE, _STORE = object(), object(), object()


def _pieces(blocks: list[_Block], off: int, end: int, B: int) -> tuple[memoryview, ...]:
    """[off, end) out of consecutive blocks, in as few views as their buffers allow: the blocks of
    one fetch lie side by side in its buffer and make one view."""
    out: list[memoryview] = []
    i = 0
    while i < len(blocks):
        r, j = blocks[i].run, i + 1
        while r is not None and r.view is not None and j < len(blocks) and blocks[j].run is r:
            j += 1
        lo = max(off, blocks[i].index * B)
        hi = min(end, (blocks[j - 1].index + 1) * B)
        if j - i > 1:
            out.append(r.view[lo - r.first * B:hi - r.first * B])
        else:
            out.append(memoryview(blocks[i].data)[lo - blocks[i].index * B:hi - blocks[i].index * B])
        i = j
    return tuple(out)


def _contiguous(blocks: list[_Block]) -> list[list[_Block]]:
    runs: list[list[_Block]] = []
    for b in blocks:
        if runs and runs[-1][-1].index + 1 == b.index:
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs


def _as_oserror(e: BaseException, key: str) -> OSError:
    if isinstance(e, OSError):
        return e
    log.error("read of %r failed unexpectedly: %r", key, e)
    return errors.fs_error(errors.EIO, f"read failed: {e!r}")
