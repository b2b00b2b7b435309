"""A directory listing sent before this mount committed a file must not undo the commit, even when
the kernel forgets the file's inode before the listing comes back (on the core, in-memory store).

What this mount changed is known per inode (`Core._changed_at`), and a listing is checked against
the inodes of the names it lists. A file created (or rewritten), closed and committed, whose dentry
the kernel then dropped (memory pressure, `drop_caches`), lost its inode at once - and with it the
record of the commit. A LIST sent before the commit and answered after that then listed the
directory without the file (or with its old version), and the name answered so for a whole TTL:
ENOENT for a file closed a moment before, as two of the soak's readers once saw (the cause is
likely this; that run's log was lost). Here the LIST is held until the kernel has forgotten the
inode, every time.

(A probe of one name cannot be on its way so: a change here to a name starts with a lookup of it,
which waits for the probe and shares its answer.)

The same holds for what a revalidating HEAD learns of another host's change while the directory's
listing is still fresh (the last test).
"""

from __future__ import annotations

import errno
import os

import pytest
import trio

from tests.support import run_on_core


class HeldRequests:
    """Wraps the core's store: a held call takes the store's answer at once (what the store says
    as it is sent) and hands it back only when released."""

    def __init__(self, store):
        self.store = store
        self.hold: set[str] = set()  # method names to hold
        self.sent = trio.Event()
        self.release = trio.Event()

    def __getattr__(self, name):
        real = getattr(self.store, name)
        if name not in self.hold or not callable(real):
            return real

        async def held(*args, **kwargs):
            try:
                answer = await real(*args, **kwargs)
            except Exception as e:  # an answer too (a HEAD's 404)
                answer = e
            self.sent.set()
            await self.release.wait()
            if isinstance(answer, Exception):
                raise answer
            return answer

        return held


async def _create_committed(core, vol, name: str, data: bytes) -> int:
    """Create, write, fsync (committed) and close `name`, as `echo > name` with sync would."""
    fh, attrs = await core.create(vol, name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    await core.write(fh, 0, data)
    await core.flush(fh)
    await core.fsync(fh)
    await core.release(fh)
    return attrs.ino


def _hold(core, *methods: str) -> HeldRequests:
    held = HeldRequests(core.stores["mem"])
    held.hold.update(methods)
    core.stores["mem"] = held
    return held


def _forget(core, ino: int) -> None:
    """The kernel drops its dentry (it sends FORGET with the lookups it counted)."""
    core.forget(ino, core.node(ino).lookups)


@pytest.mark.parametrize("before", [None, b"the old version"], ids=["new file", "overwritten"])
def test_a_listing_sent_before_a_commit_does_not_undo_it_once_the_inode_is_forgotten(tmp_path, before):
    async def body(core, committer, vol, store):
        parent = core.node(vol)
        if before is not None:
            _forget(core, await _create_committed(core, vol, "f.bin", before))
            assert "f.bin" not in parent.children_by_name
        await core.refresh_listing(parent)
        held = _hold(core, "list_page")
        async with trio.open_nursery() as n:
            n.start_soon(core.refresh_listing, parent)
            await held.sent.wait()  # the LIST is on its way, from before the commit
            ino = await _create_committed(core, vol, "f.bin", b"committed here")
            assert store.get("bucket", "pfx/f.bin")[0] == b"committed here"
            _forget(core, ino)  # nothing else holds the inode: it would go at once
            held.hold.clear()
            held.release.set()
        # Gone once the listing was checked against it, not kept for good.
        assert "f.bin" not in parent.children_by_name and core.inodes.get(ino) is None
        attrs = await core.lookup(vol, "f.bin")
        assert attrs is not None, "a committed file vanished: a LIST older than its commit said it was absent"
        assert attrs.size == len(b"committed here"), "a LIST older than the commit brought the old version back"
        fh, _ = await core.open(attrs.ino, os.O_RDONLY)
        assert bytes(await core.read(fh, 0, 100)) == b"committed here"
        await core.release(fh)

    run_on_core(tmp_path, body)


@pytest.mark.parametrize("change", ["overwritten", "deleted"])
def test_what_a_head_learned_outlives_the_inode_when_the_listing_is_older(tmp_path, change):
    """Another host changed a file. A revalidating HEAD (the file's attributes expired first) saw
    it, but the directory's listing, fresh for a while yet, still said what the file was before:
    once the kernel forgot the inode, the next lookup took the listing's word and opened the old
    version (whose GETs then failed with ESTALE), or the deleted file. The random-ops test saw the
    first under `drop_caches`."""
    async def body(core, committer, vol, store):
        parent = core.node(vol)
        store.put_bytes("bucket", "pfx/f.bin", b"the version listed")
        await core.refresh_listing(parent)
        attrs = await core.lookup(vol, "f.bin")
        if change == "overwritten":
            store.put_bytes("bucket", "pfx/f.bin", b"another host's newer version")
        else:
            store.delete("bucket", "pfx/f.bin")
        node = core.node(attrs.ino)
        node.attr_expires = 0.0  # its attributes expire before the listing does
        try:
            await core.getattr(attrs.ino)  # a stat: HEAD
        except OSError as e:
            assert change == "deleted" and e.errno == errno.ENOENT
        _forget(core, attrs.ino)
        assert parent.listing.fresh(core.cfg.metadata_ttl_s)
        again = await core.lookup(vol, "f.bin")
        if change == "deleted":
            assert again is None, "a file found deleted came back from an older listing"
            return
        assert again is not None and again.size == len(b"another host's newer version"), \
            "an older listing brought the old version back"
        fh, _ = await core.open(again.ino, os.O_RDONLY)
        assert bytes(await core.read(fh, 0, 100)) == b"another host's newer version"
        await core.release(fh)

    run_on_core(tmp_path, body)
