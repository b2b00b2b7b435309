"""A file that shrinks tells the kernel at once, on the core with the in-memory store.

The kernel learns a new, smaller size from our reply to the request that shrank the file (an
`open(..., "wb")`, a truncate), when the process that made it runs again. A reader that opens the
file in between still holds the old size: it asks for bytes the file no longer has, gets a short
answer from a handle opened after the shrink (which core.read cannot tell from a read at the end of
the file), and its kernel fills the rest with zeros, bytes of no version. The soak caught a reader
reading 96,804 zeros that way, 5 ms after a writer's `open(..., "wb")`.

`Kernel` below models the part of the kernel these races turn on: the size it holds for the inode,
which it asks for again before a read only when told it is stale (auto_inval_data), and the zeros it
puts after a short answer inside that size.
"""

from __future__ import annotations

import errno
import os

import pytest

from ucfs import commit as commit_mod

from tests.support import run_on_core

CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
V1 = bytes(range(256)) * 378 + b"tail"  # 96,772 bytes, no zeros at its end


class Kernel:
    """The kernel's view of one inode: the size it holds, and whether we told it that is stale."""

    def __init__(self, core, ino: int):
        self.core, self.ino = core, ino
        self.size: int | None = None
        self.stale = True
        self.told = 0
        self.size_when_told: int | None = None
        core.invalidate_attrs = self._invalidated

    def _invalidated(self, ino: int) -> None:
        if ino == self.ino:
            self.stale = True
            self.told += 1
            # What a stat sent right now gets: told before the new size is in place, the kernel
            # could take up the old one again after the notice.
            self.size_when_told = self.core.attributes(self.core.node(ino)).size

    async def getattr(self) -> int:
        self.size = (await self.core.getattr(self.ino)).size
        self.stale = False
        return self.size

    async def read_all(self, fh: int) -> bytes:
        """read() of the whole file through a fresh handle, as the kernel answers it."""
        if self.stale:
            await self.getattr()
        want = self.size
        if not want:
            return b""  # the kernel sends no read past the size it holds
        data = await self.core.read(fh, 0, want)
        data = b"".join(data) if isinstance(data, tuple) else bytes(data)
        return data + b"\0" * (want - len(data))  # a short answer inside the size: zeros


def _run(tmp_path, monkeypatch, body):
    # Closed versions wait for their commit, so the file stays staged throughout.
    monkeypatch.setattr(commit_mod, "COMMIT_SETTLE_S", 30.0)
    return run_on_core(tmp_path, body, drain=False, metadata_ttl_s=30.0)


async def _closed(core, vol, name: str, data: bytes) -> int:
    fh, attrs = await core.create(vol, name, CREATE)
    await core.write(fh, 0, data)
    await core.flush(fh)
    await core.release(fh)
    return attrs.ino


async def _read_through_new_handle(core, kernel: Kernel) -> bytes | None:
    """What a reader opening now reads: the bytes, or None for ESTALE (the file changed)."""
    fh, _ = await core.open(kernel.ino, os.O_RDONLY)
    try:
        return await kernel.read_all(fh)
    except OSError as e:
        assert e.errno == errno.ESTALE
        return None
    finally:
        await core.release(fh)


@pytest.mark.parametrize("staged", [True, False], ids=["closed-here", "committed-only"])
def test_a_reader_opening_right_after_a_truncating_open_returns_reads_no_zeros(tmp_path, monkeypatch, staged):
    """`committed-only`: not staged yet, the open puts an empty staging file in place of the object."""
    async def body(core, committer, vol, inner):
        if staged:
            ino = await _closed(core, vol, "f.bin", V1)
        else:
            inner.put_bytes("bucket", "pfx/f.bin", V1)
            ino = (await core.lookup(vol, "f.bin")).ino
        kernel = Kernel(core, ino)
        assert await kernel.getattr() == len(V1)
        wfh, _ = await core.open(ino, os.O_WRONLY | os.O_TRUNC)
        # The writer's open has been answered; its process has not yet run to apply the new size.
        got = await _read_through_new_handle(core, kernel)
        assert got == b"", f"read {len(got or b'')} bytes, {(got or b'').count(0)} of them zeros"
        assert (kernel.told, kernel.size_when_told) == (1, 0)
        await core.release(wfh)

    _run(tmp_path, monkeypatch, body)


def test_a_reader_opening_right_after_a_truncate_reads_no_zeros(tmp_path, monkeypatch):
    async def body(core, committer, vol, inner):
        ino = await _closed(core, vol, "f.bin", V1)
        kernel = Kernel(core, ino)
        wfh, _ = await core.open(ino, os.O_RDWR)
        assert kernel.told == 0  # an open that changes nothing costs the kernel nothing
        assert await kernel.getattr() == len(V1)
        await core.setattr(ino, size=1000, fh=wfh)  # ftruncate, answered; the writer not yet run
        got = await _read_through_new_handle(core, kernel)
        assert got == V1[:1000], f"read {len(got or b'')} bytes, {(got or b'')[1000:].count(0)} zeros past 1000"
        assert (kernel.told, kernel.size_when_told) == (1, 1000)
        await core.setattr(ino, size=5000, fh=wfh)  # growing: nothing to tell (zeros are its content)
        assert kernel.told == 1
        await core.release(wfh)

    _run(tmp_path, monkeypatch, body)
