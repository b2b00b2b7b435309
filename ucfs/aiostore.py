"""The trio face of a `Store`: every call runs in a worker thread, never on the event loop.

All store calls of a mount go through one thread pool (`threads.ThreadPool`) sized like the store's
connection pool, so threads never queue for a socket and the number of threads stays bounded. Local
disk I/O has its own pool (`run_disk`) so a slow store never starves cache reads, and vice versa.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, TypeVar

import trio

from .store import ListPage, ObjectInfo, Store, Upload
from .threads import ThreadPool

T = TypeVar("T")


class AsyncStore:
    def __init__(self, store: Store, concurrency: int):
        self.store = store
        self.name = store.name
        self.pool = ThreadPool("store", concurrency)
        # Upload parts may be given as file ranges (s3http.FileBody) rather than bytes.
        self.sends_files = bool(getattr(store, "sends_files", False))

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if kwargs:
            fn = functools.partial(fn, **kwargs)
        return await self.pool.run(fn, *args)

    async def head(self, bucket: str, key: str) -> ObjectInfo:
        return await self._run(self.store.head, bucket, key)

    async def get(self, bucket: str, key: str, start: int = 0, length: int | None = None, *,
                  etag: str | None = None, into: bytearray | None = None) -> tuple[bytes, ObjectInfo]:
        if into is None:
            return await self._run(self.store.get, bucket, key, start, length, etag=etag)
        return await self._run(self.store.get, bucket, key, start, length, etag=etag, into=into)

    async def list_page(self, bucket: str, prefix: str, *, delimiter: str = "/",
                        token: str | None = None, max_keys: int = 1000) -> ListPage:
        return await self._run(self.store.list_page, bucket, prefix, delimiter=delimiter,
                               token=token, max_keys=max_keys)

    async def put(self, bucket: str, key: str, body, size: int) -> ObjectInfo:
        return await self._run(self.store.put, bucket, key, body, size)

    async def create_multipart(self, bucket: str, key: str) -> str:
        return await self._run(self.store.create_multipart, bucket, key)

    async def upload_part(self, bucket: str, key: str, upload_id: str, part_number: int, body,
                          size: int) -> str:
        return await self._run(self.store.upload_part, bucket, key, upload_id, part_number, body, size)

    async def complete_multipart(self, bucket: str, key: str, upload_id: str,
                                 parts: list[tuple[int, str]]) -> ObjectInfo:
        return await self._run(self.store.complete_multipart, bucket, key, upload_id, parts)

    async def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None:
        await self._run(self.store.abort_multipart, bucket, key, upload_id)

    async def list_multipart(self, bucket: str, prefix: str) -> list[Upload]:
        return await self._run(self.store.list_multipart, bucket, prefix)

    async def copy(self, bucket: str, src_key: str, dst_key: str) -> ObjectInfo:
        return await self._run(self.store.copy, bucket, src_key, dst_key)

    async def delete(self, bucket: str, key: str) -> None:
        await self._run(self.store.delete, bucket, key)

    async def check_bucket(self, bucket: str) -> None:
        # The mount's start-up check, and the one call that may be abandoned: a pool call cannot be
        # cancelled once it runs, so a store that does not answer held Ctrl-C (and the check's own
        # time limit) until its timeouts and retries ran out, minutes later. Nothing else waits for
        # this thread; it ends with its request (and never keeps the process from exiting).
        await trio.to_thread.run_sync(self.store.check_bucket, bucket, abandon_on_cancel=True)


# Local disk work (cache blocks, staging files) shares one pool: enough threads to keep a fast SSD
# busy while a few are blocked on fsync, few enough not to thrash a 2-core host.
_DISK_POOL = ThreadPool("disk", 16)


async def run_disk(fn: Callable[..., T], *args: Any) -> T:
    return await _DISK_POOL.run(fn, *args)


def submit_disk(fn: Callable[..., Any], *args: Any) -> None:
    """fn(*args) in a disk thread, waiting for nothing (ThreadPool.submit)."""
    _DISK_POOL.submit(fn, *args)


# A read of at most this much is tried on the event loop first (`pread_local`): copying it takes
# tens of microseconds, less than the trip to a disk thread and back that it saves.
INLINE_READ_MAX_BYTES = 1024 * 1024


def pread_cached(fd: int, size: int, offset: int) -> bytearray | None:
    """`size` bytes of `fd` at `offset` if the page cache holds every one of them, else None.

    preadv2(RWF_NOWAIT) never waits for the disk: where a page is missing it reads less, or fails
    with EAGAIN, and the caller goes to a disk thread instead. So this may run on the event loop."""
    if size > INLINE_READ_MAX_BYTES or not hasattr(os, "RWF_NOWAIT"):
        return None
    buf = bytearray(size)
    try:
        n = os.preadv(fd, [buf], offset, os.RWF_NOWAIT)
    except OSError:  # EAGAIN; EOPNOTSUPP where the file system cannot say
        return None
    return buf if n == size else None


async def pread_local(fd: int, size: int, offset: int) -> bytes | bytearray:
    """os.pread of a local file, on the event loop when the data is cached, else in a disk thread."""
    data = pread_cached(fd, size, offset)
    if data is not None:
        return data
    return await run_disk(os.pread, fd, size, offset)
