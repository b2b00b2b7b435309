"""A directory looked up in a burst is listed again before its listing expires (core
`_maybe_refresh_ahead`), on the core with an in-memory store whose LIST takes its time.

Without that, the first lookup after expiry relisted the directory itself, and on a mount every
other lookup and create in the directory waited for it (the kernel holds the directory's lock).
"""

from __future__ import annotations

import threading
import time

import trio

from ucfs import errors
from ucfs.config import MountConfig
from ucfs.core import REFRESH_AHEAD_MAX_IN_FLIGHT
from ucfs.store import MemoryStore

from tests.support import open_core

LIST_S = 0.3


class _SlowList(MemoryStore):
    def __init__(self, list_s: float = LIST_S):
        super().__init__()
        self.lists = 0
        self.list_s = list_s

    def list_page(self, *args, **kwargs):
        self.lists += 1
        time.sleep(self.list_s)  # a store thread's time, as a LIST of thousands of names over a WAN
        return super().list_page(*args, **kwargs)


def _config(tmp_path, store: MemoryStore, names: list[str], ttl_s: float) -> MountConfig:
    """A state directory and a config with this TTL; `names` made under the volume's d/."""
    for name in names:
        store.put_bytes("bucket", f"pfx/d/{name}", b"x")
    (tmp_path / "state").mkdir(mode=0o700)
    return MountConfig(cache_dir=tmp_path / "state" / "cache", metadata_ttl_s=ttl_s)


async def _listed_dir(tmp_path, store, nursery, cfg):
    """A core over `store` with d/ looked up and listed, as `ls` or a loader's scan does first:
    (core, committer, the volume's inode, d's inode)."""
    core, committer, vol = await open_core(tmp_path, store, nursery, cfg)
    d = (await core.lookup(vol, "d")).ino
    await core.refresh_listing(core.node(d))
    return core, committer, vol, d


def test_a_directory_looked_up_in_a_burst_never_makes_a_lookup_wait_for_its_listing(tmp_path):
    store = _SlowList()
    cfg = _config(tmp_path, store, [f"f{i:04d}" for i in range(200)], ttl_s=1.0)

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol, d = await _listed_dir(tmp_path, store, n, cfg)
            lists0, slowest, seen_late = store.lists, 0.0, None
            start = time.monotonic()
            added = None
            k = 0
            while time.monotonic() - start < 4.0:
                if added is None and time.monotonic() - start > 1.2:
                    store.put_bytes("bucket", "pfx/d/late.bin", b"late")  # made elsewhere
                    added = time.monotonic()
                t0 = time.monotonic()
                assert await core.lookup(d, f"f{k % 200:04d}") is not None
                assert await core.lookup(d, f"new-{k}") is None
                if added is not None and seen_late is None and await core.lookup(d, "late.bin") is not None:
                    seen_late = time.monotonic() - added
                slowest = max(slowest, time.monotonic() - t0)
                k += 1
                await trio.sleep(0.01)
            assert slowest < LIST_S / 2, f"a lookup waited {slowest:.2f} s for a listing"
            # Still within the TTL (plus the LIST's own time) for a change made elsewhere...
            assert seen_late is not None and seen_late <= cfg.metadata_ttl_s + LIST_S + 0.2, seen_late
            # ... and no more LISTs than one per half TTL.
            assert store.lists - lists0 <= 4.0 / (cfg.metadata_ttl_s / 2) + 1, store.lists - lists0
            assert core.stats["listings_ahead"] >= 3
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_quick_listing_is_refreshed_shortly_before_it_expires_not_at_half_its_life(tmp_path):
    """The refresh starts twice the LIST's own time before expiry (a tenth of the TTL at least):
    for a LIST that takes 10 ms, a directory looked up without pause is listed about once per TTL,
    as often as relisting on expiry would, not once per half TTL."""
    store = _SlowList(list_s=0.01)
    cfg = _config(tmp_path, store, [f"f{i:04d}" for i in range(50)], ttl_s=1.0)

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol, d = await _listed_dir(tmp_path, store, n, cfg)
            lists0, start, k = store.lists, time.monotonic(), 0
            while time.monotonic() - start < 4.0:
                assert await core.lookup(d, f"new-{k}") is None
                k += 1
                await trio.sleep(0.01)
            lists = store.lists - lists0
            assert 3 <= lists <= 5, lists  # 4 s of lookups; refreshing at half the TTL made 7 or 8
            assert core.stats["listings_ahead"] >= 3  # ... and each of them ahead of time
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(main)


class _ListWhenAnswering(MemoryStore):
    """A LIST of d/ by directory ('/' delimiter) that the server works out only when it answers,
    LIST_S after it was sent; other requests (a directory rename's own flat LIST, probes, copies,
    deletes) at once."""

    def __init__(self):
        super().__init__()
        self.sent = 0

    def list_page(self, bucket, prefix, **kwargs):
        if prefix == "pfx/d/" and kwargs.get("delimiter", "/") == "/" and kwargs.get("max_keys", 1000) > 2:
            self.sent += 1
            time.sleep(LIST_S)
        return super().list_page(bucket, prefix, **kwargs)


def test_a_listing_sent_before_its_directory_was_renamed_is_not_taken_for_the_new_name(tmp_path):
    """A refresh (ahead of time, in the background) of d is on its way when d is renamed to e. Its
    answer lists d/, which the rename has emptied: installed as e's listing, it would say e's files
    do not exist, for a whole TTL, and take their inodes away."""
    store = _ListWhenAnswering()
    cfg = _config(tmp_path, store, [f"f{i}" for i in range(3)], ttl_s=5.0)

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol, d = await _listed_dir(tmp_path, store, n, cfg)
            assert await core.lookup(d, "f0") is not None
            sent = store.sent
            n.start_soon(core.refresh_listing, core.node(d))  # as _maybe_refresh_ahead does
            while store.sent == sent:
                await trio.sleep(0.001)
            await core.rename(vol, "d", vol, "e")
            assert sorted(store.buckets["bucket"]) == ["pfx/e/", "pfx/e/f0", "pfx/e/f1", "pfx/e/f2"]
            await trio.sleep(LIST_S * 3)  # the refresh has landed
            for i in range(3):
                assert await core.lookup(d, f"f{i}") is not None, f"e/f{i} vanished"
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(main)


class _FailingOnce(MemoryStore):
    """A LIST of d/ that fails once, after LIST_S (a store that keeps erroring while the client
    retries); the others are answered at once."""

    def __init__(self):
        super().__init__()
        self.fail_next = False

    def list_page(self, bucket, prefix, **kwargs):
        if prefix == "pfx/d/" and self.fail_next:
            self.fail_next = False
            time.sleep(LIST_S)
            raise errors.connection_error("store unreachable", key=prefix)
        return super().list_page(bucket, prefix, **kwargs)


def test_a_listing_that_failed_in_the_background_is_not_shown_once_expired(tmp_path):
    """An `ls` (opendir) of a directory whose listing expired while a refresh of it was on its
    way (in the background, ahead of expiry) waits for that refresh. When that one fails, the old,
    expired listing is not what it shows: files made elsewhere since would be missing past the
    TTL. It lists the directory itself."""
    store = _FailingOnce()
    cfg = _config(tmp_path, store, ["old"], ttl_s=0.2)

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol, d = await _listed_dir(tmp_path, store, n, cfg)
            store.put_bytes("bucket", "pfx/d/new", b"made elsewhere")
            store.fail_next = True
            n.start_soon(core._refresh_ahead, core.node(d))
            await trio.sleep(0.25)  # expired, its refresh still on its way
            assert core.node(d).listing_refresh is not None
            fh = await core.opendir(d)
            names = sorted(name for _, name, _ in core.readdir(fh, 0))
            assert names == ["new", "old"], names
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(main)


class _CountingList(_SlowList):
    """A slow LIST that also records how many were on their way at once."""

    def __init__(self, list_s: float = LIST_S):
        super().__init__(list_s)
        self._lock = threading.Lock()
        self.in_flight = self.most_in_flight = 0

    def list_page(self, *args, **kwargs):
        with self._lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return super().list_page(*args, **kwargs)
        finally:
            with self._lock:
                self.in_flight -= 1


def test_many_hot_directories_refresh_only_a_few_listings_at_once(tmp_path):
    """Many directories looked up in bursts (a loader's) would each send a LIST ahead of
    expiry, all at about the same time, taking the store's limiter from foreground reads. Only
    REFRESH_AHEAD_MAX_IN_FLIGHT go in the background at once; the others are not queued but listed
    when their listing expires, as before, so a change made elsewhere still shows. (The store's limiter
    here is 8 wide: without the cap, 8 LISTs went at once.)"""
    store = _CountingList(list_s=0.1)
    dirs = [f"d{i:02d}" for i in range(12)]
    for name in dirs:
        store.put_bytes("bucket", f"pfx/{name}/f", b"x")
    cfg = _config(tmp_path, store, [], ttl_s=1.0)

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, store, n, cfg)
            inos = [(await core.lookup(vol, name)).ino for name in dirs]
            async with trio.open_nursery() as listing:  # all listed at about the same time
                for ino in inos:
                    listing.start_soon(core.refresh_listing, core.node(ino))
            store.most_in_flight = 0
            start, added, seen, k = time.monotonic(), None, set(), 0
            while time.monotonic() - start < 3.0:
                if added is None and time.monotonic() - start > 0.5:
                    for name in dirs:
                        store.put_bytes("bucket", f"pfx/{name}/late", b"late")  # made elsewhere
                    added = time.monotonic()
                for ino in inos:
                    assert await core.lookup(ino, f"new-{k}") is None
                    if added is not None and ino not in seen and await core.lookup(ino, "late") is not None:
                        seen.add(ino)
                k += 1
                await trio.sleep(0.01)
            # One foreground LIST (this loop's lookups wait, one at a time) besides the background's.
            assert store.most_in_flight <= REFRESH_AHEAD_MAX_IN_FLIGHT + 1, store.most_in_flight
            assert core.stats["listings_ahead"] >= 1
            assert core.stats["listings_ahead_skipped"] >= 1
            assert len(seen) == len(dirs), f"{len(dirs) - len(seen)} directories never showed 'late'"
            await committer.shutdown(drain=True)
            n.cancel_scope.cancel()

    trio.run(main)
