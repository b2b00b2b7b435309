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
