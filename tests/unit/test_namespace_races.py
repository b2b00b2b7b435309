"""Races between a file being created and a listing refresh, on the core with the in-memory store.

A create makes the inode first and its staging file after (in a disk thread, when it has no spare). A listing refresh that
lands in between (opendir and revalidating lookups reach the daemon without the directory lock the
kernel holds for the create) found a file that is neither in the store nor staged yet, and dropped
its name: the file, created, written and closed, then answered ENOENT until its commit. The soak
caught it once in ~7 runs of 180 s; here it is made to happen every time.
"""

from __future__ import annotations

import os
import threading

import trio

from ucfs import commit as commit_mod
from ucfs.config import MountConfig
from ucfs.store import MemoryStore

from tests.support import open_core, run_on_core


def test_a_file_being_created_keeps_its_name_through_a_listing_refresh(tmp_path, monkeypatch):
    # No staging files made ahead: this create makes its own, in a disk thread, and waits there.
    monkeypatch.setattr(commit_mod, "SPARE_STAGING_FILES", 0)
    inner = MemoryStore()
    inner.buckets["bucket"] = {}
    (tmp_path / "state").mkdir(mode=0o700)
    cfg = MountConfig(cache_dir=tmp_path / "state" / "cache")

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, inner, n, cfg)
            parent = core.node(vol)
            await core.refresh_listing(parent)
            # Hold the create while it makes its staging file.
            gate = threading.Event()
            real_check = committer._check_space

            def held_check():
                gate.wait(10)
                real_check()

            monkeypatch.setattr(committer, "_check_space", held_check)
            created = {}

            async def create():
                created["fh"], created["attrs"] = await core.create(
                    vol, "new.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)

            n.start_soon(create)
            with trio.fail_after(5):
                while "new.bin" not in parent.children_by_name:
                    await trio.sleep(0.001)
            await core.refresh_listing(parent)  # lands while the create waits for its staging file
            gate.set()
            with trio.fail_after(5):
                while "fh" not in created:
                    await trio.sleep(0.001)
            monkeypatch.setattr(committer, "_check_space", real_check)
            fh = created["fh"]
            await core.write(fh, 0, b"created")
            await core.flush(fh)
            # Closed (flushed), not committed yet: the name must still lead to it.
            attrs = await core.lookup(vol, "new.bin")
            assert attrs is not None, "a created file vanished from its directory before its commit"
            assert attrs.ino == created["attrs"].ino
            listing = await core.refresh_listing(parent)  # the next refresh must keep it too
            assert (await core.lookup(vol, "new.bin")) is not None, sorted(listing.entries)
            await core.release(fh)
            await committer.shutdown(drain=True)
            assert inner.get("bucket", "pfx/new.bin")[0] == b"created"
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_commit_that_sent_nothing_leaves_the_object_a_rename_copies(tmp_path, monkeypatch):
    """A commit that finds the file as its last commit sent it sends nothing (`_still_stored`). A
    rename moved the name while it compared; it then took the object under the old name for one it
    had just made there, and deleted it. That object was the file's last committed version, which
    the rename, waiting for the commit's lock, copies to the new name for a writer still writing:
    the copy found nothing, and `mv` failed with ENOENT. The soak saw it once a remount (`sync`
    of the file system) made commits happen at any moment."""
    async def body(core, committer, vol, store):
        fh, _ = await core.create(vol, "tmp.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        await core.write(fh, 0, b"first version")
        await core.fsync(fh)  # committed under tmp.bin; the writer goes on
        node = core.node(vol).children_by_name["tmp.bin"]
        # What a commit of a passthrough writer's file records of what it sent (FUSE passthrough,
        # which the soak's writers use, is not there on the core alone).
        node.staged.stored = commit_mod._Stored("pfx/tmp.bin", node.etag,
                                                [(0, 13, commit_mod._digest(b"first version"))])
        await core.write(fh, 0, b"first")  # the same bytes again: a change with nothing to send
        compare, compared = committer._still_stored, trio.Event()

        async def compare_while_renamed(s, key, gen):
            info = await compare(s, key, gen)
            assert info is not None  # unchanged
            compared.set()
            while s.node.key == key:  # until the rename has moved the name
                await trio.sleep(0.001)
            return info

        monkeypatch.setattr(committer, "_still_stored", compare_while_renamed)
        async with trio.open_nursery() as n:
            n.start_soon(core.fsync, fh)
            await compared.wait()
            monkeypatch.setattr(committer, "_still_stored", compare)
            await core.rename(vol, "tmp.bin", vol, "final.bin")
        await core.flush(fh)
        await core.release(fh)
        st = committer.statistics()
        assert st["failed"] == 0, st

    store = run_on_core(tmp_path, body)
    assert store.get("bucket", "pfx/final.bin")[0] == b"first version"
    assert "pfx/tmp.bin" not in store.buckets["bucket"]
