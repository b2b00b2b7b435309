"""What was known answers while the store cannot be reached (README "Semantics": Reads), on the core
with an in-memory store behind `FaultyStore`: which failures count as unreachable, how seldom the store
is asked meanwhile, the bound on how long, and that the first answer ends it.
"""

from __future__ import annotations

import errno
import time

import pytest
import trio

from ucfs import core as core_mod
from ucfs import inodes
from ucfs.catalog import StoreSpec, Volume
from ucfs.testing.faults import FaultyStore, access_denied, connection_reset

from tests.support import run_on_core

TTL = 0.2


def _run(tmp_path, body, **cfg):
    async def with_faults(core, committer, vol, inner):
        await body(core, vol, inner, core.stores["mem"].store)

    run_on_core(tmp_path, with_faults, drain=False, wrap=FaultyStore, metadata_ttl_s=TTL, **cfg)


def _asked(store: FaultyStore) -> int:
    return sum(store.injected.values())


async def _known_then_failing(core, vol, inner, store, error):
    """a.bin (1 byte) looked up, its TTL run out, then every store call fails with `error`."""
    inner.put_bytes("bucket", "pfx/a.bin", b"a")
    a = await core.lookup(vol, "a.bin")
    await trio.sleep(TTL + 0.05)
    return a, store.fail(error=error)


def test_known_names_answer_from_what_was_known_and_the_store_is_asked_seldom(tmp_path):
    async def body(core, vol, inner, store):
        inner.put_bytes("bucket", "pfx/d/a.bin", b"a" * 10)
        d = await core.lookup(vol, "d")
        core.releasedir(await core.opendir(d.ino))  # d is listed
        assert (await core.lookup(d.ino, "a.bin")).size == 10
        await trio.sleep(TTL + 0.05)
        store.fail(error=connection_reset)
        a = await core.lookup(d.ino, "a.bin")  # asked, failed: the known entry answers
        assert a is not None and a.size == 10
        asked = _asked(store)
        assert asked >= 1
        for _ in range(50):  # within the first back-off nothing asks the store
            assert (await core.getattr(a.ino)).size == 10
            assert (await core.lookup(d.ino, "a.bin")).ino == a.ino
            assert await core.lookup(d.ino, "other.bin") is None  # absent from the last listing
        assert _asked(store) == asked
        assert core.stats["stale_answers"] >= 150
        with pytest.raises(OSError) as e:  # nothing known of it: the store's failure is the answer
            await core.lookup(vol, "never-seen")
        assert e.value.errno == errno.EIO
        st = core.statistics()["unreachable"]
        assert list(st) == ["mem"] and st["mem"]["answered_from_known"] >= 150

        # When the back-off is over, one caller asks again; the store answers, and it is over.
        store.clear()
        inner.put_bytes("bucket", "pfx/d/a.bin", b"b" * 20)
        await trio.sleep(core_mod.RECHECK_FIRST_S * 2 + 0.1)
        assert (await core.lookup(d.ino, "a.bin")).size == 20
        assert core.statistics()["unreachable"] == {}

    _run(tmp_path, body)


def _forget(core, ino: int) -> None:
    """The kernel drops its dentry (it sends FORGET with the lookups it counted)."""
    core.forget(ino, core.node(ino).lookups)


def test_what_was_known_outlives_inodes_the_kernel_forgets_in_an_outage(tmp_path):
    """Memory pressure makes the kernel forget the inodes nobody holds. What was known of a
    directory lived on its inode: once forgotten in an outage, the directory had no listing to
    answer from, nor its parent a name found by a probe, and every cached file under them failed
    with EIO."""
    async def body(core, vol, inner, store):
        inner.put_bytes("bucket", "pfx/d/a.bin", b"a" * 10)
        inner.put_bytes("bucket", "pfx/p/q/b.bin", b"b" * 20)
        d = await core.lookup(vol, "d")
        core.releasedir(await core.opendir(d.ino))  # d is listed
        a = await core.lookup(d.ino, "a.bin")
        p = await core.lookup(vol, "p")  # p and q are found by probes, never listed
        q = await core.lookup(p.ino, "q")
        b = await core.lookup(q.ino, "b.bin")
        for ino in (a.ino, d.ino, b.ino, q.ino, p.ino):
            _forget(core, ino)
        for ino in (a.ino, d.ino, b.ino, q.ino, p.ino):
            assert core.inodes.get(ino) is None  # all gone
        await trio.sleep(TTL + 0.05)
        store.fail(error=connection_reset)
        d = await core.lookup(vol, "d")  # what a probe found of d, kept
        assert d is not None and d.is_dir
        assert (await core.lookup(d.ino, "a.bin")).size == 10  # d's listing, kept
        assert await core.lookup(d.ino, "other.bin") is None  # absent from it
        p = await core.lookup(vol, "p")  # what the probes found, kept
        q = await core.lookup(p.ino, "q")
        assert (await core.lookup(q.ino, "b.bin")).size == 20
        assert core.stats["stale_answers"] >= 5
        with pytest.raises(OSError) as e:  # nothing was known of it
            await core.lookup(q.ino, "never-seen")
        assert e.value.errno == errno.EIO

        # Once the store answers, what it says wins over what was kept.
        store.clear()
        inner.delete("bucket", "pfx/p/q/b.bin")
        await trio.sleep(core_mod.RECHECK_FIRST_S * 2 + 0.1)
        assert await core.lookup(q.ino, "b.bin") is None

    _run(tmp_path, body)


def test_what_is_kept_of_forgotten_inodes_is_bounded(monkeypatch):
    """Listings are kept up to a number of names in all, the oldest going first, and entries up to
    a number of names; a new inode of the name takes what was kept back."""
    monkeypatch.setattr(inodes, "KEPT_LISTING_NAMES_MAX", 5)
    monkeypatch.setattr(inodes, "KEPT_ENTRIES_MAX", 2)
    vol = Volume("c", "s", "v", StoreSpec("mem"), "bucket", "pfx/")
    table = inodes.InodeTable()
    top = table.add_child(table.root, "v", inodes.Kind.VOLUME, vol)
    top.lookups = 1

    def forgotten_dir(name: str, names: int) -> None:
        d = table.add_child(top, name, inodes.Kind.DIR, vol)
        d.listing = inodes.Listing({f"f{i}": inodes.Entry(False, i) for i in range(names)}, time.monotonic())
        d.lookups = 1
        table.forget(d.ino, 1)

    forgotten_dir("a", 3)
    forgotten_dir("b", 2)
    assert list(table.kept_listings) == [("c.s.v", "pfx/a/"), ("c.s.v", "pfx/b/")]
    forgotten_dir("c", 2)  # 7 names: a's go
    assert list(table.kept_listings) == [("c.s.v", "pfx/b/"), ("c.s.v", "pfx/c/")]
    forgotten_dir("huge", 6)  # more than the bound alone: not kept
    assert list(table.kept_listings) == [("c.s.v", "pfx/b/"), ("c.s.v", "pfx/c/")]
    again = table.add_child(top, "b", inodes.Kind.DIR, vol)
    assert again.listing is not None and set(again.listing.entries) == {"f0", "f1"}
    assert not again.listing.fresh(60.0)  # what was known, not an answer while the store answers
    assert list(table.kept_listings) == [("c.s.v", "pfx/c/")]
    # a, b and c were probed (top has no listing): what was known of them is kept, the last two.
    assert [k for _, k in table.kept_entries] == ["pfx/c", "pfx/huge"]
    assert table.kept_entry(top, "huge")[0].is_dir


def test_a_refusal_is_an_answer_and_never_covered_up(tmp_path):
    async def body(core, vol, inner, store):
        a, _ = await _known_then_failing(core, vol, inner, store, access_denied)
        with pytest.raises(OSError) as e:
            await core.getattr(a.ino)
        assert e.value.errno == errno.EACCES
        assert core.stats["stale_answers"] == 0 and core.statistics()["unreachable"] == {}

    _run(tmp_path, body)


def test_what_was_known_answers_no_longer_than_stale_if_error(tmp_path):
    async def body(core, vol, inner, store):
        a, _ = await _known_then_failing(core, vol, inner, store, connection_reset)
        assert (await core.getattr(a.ino)).size == 1
        await trio.sleep(0.6)
        with pytest.raises(OSError) as e:
            await core.getattr(a.ino)
        assert e.value.errno == errno.EIO

    _run(tmp_path, body, stale_if_error_s=0.5)


def test_any_answer_of_the_store_ends_the_outage(tmp_path):
    """A commit or a read may be first to get through: an S3 store notes every answer it gets, and the
    next metadata call asks the store again at once instead of waiting out its back-off."""
    async def body(core, vol, inner, store):
        a, rule = await _known_then_failing(core, vol, inner, store, connection_reset)
        assert (await core.getattr(a.ino)).size == 1
        asked = _asked(store)
        assert (await core.getattr(a.ino)).size == 1
        assert _asked(store) == asked  # in its back-off
        rule.disable()
        inner.put_bytes("bucket", "pfx/a.bin", b"abc")
        store.answered_at = time.monotonic()  # what S3Store does when any request is answered
        assert (await core.getattr(a.ino)).size == 3
        assert core.statistics()["unreachable"] == {}

    _run(tmp_path, body)
