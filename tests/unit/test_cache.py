"""The disk cache: identity by (key, ETag), integrity, bounded size, lazy index, pins."""

from __future__ import annotations

import errno
import os
import types

import pytest

from ucfs import cache as cache_mod
from ucfs.cache import HEADER_BYTES, LAYOUT, BlockCache, ObjectVersion
from ucfs.errors import UcfsError

MiB = 1 << 20


def make(tmp_path, size=64 * MiB, floor=0, scan=True):
    c = BlockCache(tmp_path / "c", size_bytes=size, free_floor_bytes=floor, block_bytes=MiB)
    if scan:
        c.scan()
    return c


def v(key="k", etag="e1"):
    return ObjectVersion("s3:x", "bucket", key, etag)


def seg_path(c, version, index):
    return c._path(c._blocks[(version.digest, index)])


def test_roundtrip_and_identity_includes_etag(tmp_path):
    c = make(tmp_path)
    data = os.urandom(MiB)
    assert c.put_block(v(), 0, data)
    assert c.get_block(v(), 0) == data
    assert c.get_block(v(etag="e2"), 0) is None  # a changed object is a miss, never stale data
    assert c.get_block(v(), 1) is None
    assert c.get_block(v(key="other"), 0) is None


def test_a_segment_holds_consecutive_blocks(tmp_path):
    c = make(tmp_path)
    data = os.urandom(8 * MiB - 100)  # a part, its last block short
    assert c.put_blocks(v(), 16, data)
    for k in range(8):
        assert c.get_block(v(), 16 + k) == data[k * MiB:(k + 1) * MiB]
    assert c.get_block(v(), 24) is None and c.get_block(v(), 15) is None
    assert c.statistics()["segments"] == 1 and c.statistics()["blocks"] == 8


def test_consecutive_blocks_are_read_into_the_callers_buffer_across_segments(tmp_path):
    c = make(tmp_path)
    data = os.urandom(11 * MiB - 100)  # segments of 4, 4 and 3 blocks, the last block short
    for first in (0, 4, 8):  # blocks 0-3, 4-7 and 8-10
        assert c.put_blocks(v(), first, data[first * MiB:(first + 4) * MiB])
    buf = bytearray(9 * MiB - 100)  # blocks 2-10: the end of one segment, all of the next two
    assert c.get_blocks(v(), 2, memoryview(buf)) == [True] * 9
    assert buf == data[2 * MiB:]
    assert c.statistics()["hits"] == 9 and c.statistics()["hit_bytes"] == len(buf)
    # A block the cache does not hold is reported missing; the others still arrive.
    c._remove(c._blocks[(v().digest, 4)])
    buf = bytearray(6 * MiB)
    assert c.get_blocks(v(), 2, memoryview(buf)) == [True, True, False, False, False, False]
    assert buf[:2 * MiB] == data[2 * MiB:4 * MiB]
    assert c.get_blocks(v(etag="e2"), 2, memoryview(buf)) == [False] * 6  # another version


@pytest.mark.parametrize("how", ["one block", "with its neighbours"])
def test_damaged_block_is_detected_and_dropped(tmp_path, how):
    c = make(tmp_path)
    data = os.urandom(4 * MiB)
    c.put_blocks(v(), 0, data)
    path = seg_path(c, v(), 3)
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 3 * MiB + 1000] ^= 0xFF  # a flipped bit in block 3
    path.write_bytes(bytes(raw))
    if how == "one block":
        assert c.get_block(v(), 3) is None
    else:
        assert c.get_blocks(v(), 0, memoryview(bytearray(4 * MiB))) == [False] * 4
    assert not path.exists()  # the damaged segment is gone; its blocks are fetched again
    assert c.get_block(v(), 0) is None
    assert c.statistics()["corrupt"] == 1


def test_header_damage_is_detected(tmp_path):
    c = make(tmp_path)
    c.put_block(v(), 0, os.urandom(MiB))
    path = seg_path(c, v(), 0)
    raw = bytearray(path.read_bytes())
    raw[40] ^= 0x01  # inside the identity hash
    path.write_bytes(bytes(raw))
    assert c.get_block(v(), 0) is None


def test_partial_last_block_round_trips(tmp_path):
    c = make(tmp_path)
    data = os.urandom(150 * 1024 + 7)  # not a multiple of the 4 KiB O_DIRECT unit
    assert c.put_block(v(), 9, data)
    assert c.get_block(v(), 9) == data
    assert seg_path(c, v(), 9).stat().st_size == HEADER_BYTES + len(data)


def test_small_segments_go_through_the_page_cache(tmp_path, monkeypatch):
    """Whole small objects are written buffered, parts of large ones directly (module doc)."""
    import ucfs.cache as cache_mod

    flags = []
    real_open = os.open

    def spy(path, fl, *args):
        flags.append(fl)
        return real_open(path, fl, *args)

    monkeypatch.setattr(cache_mod.os, "open", spy)
    c = make(tmp_path)
    small, big = os.urandom(150 * 1024), os.urandom(2 * MiB + 5)
    assert c.put_block(v("small"), 0, small) and c.put_blocks(v("big"), 0, big)
    assert c.get_block(v("small"), 0) == small and c.get_block(v("big"), 2) == big[2 * MiB:]
    direct = getattr(os, "O_DIRECT", 0)
    assert not flags[0] & direct
    if c._direct:  # the file system takes O_DIRECT (tmpfs does not)
        assert flags[1] & direct


def resident_pages(path) -> int:
    """Pages of the file at `path` that are in the page cache (mincore(2) of a mapping of it)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        m = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        base = ctypes.c_char.from_buffer(m)
        try:
            if libc.mincore(ctypes.c_void_p(ctypes.addressof(base)), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            del base
        return sum(b & 1 for b in vec)
    finally:
        m.close()


def test_blocks_read_into_aligned_memory_skip_the_page_cache(tmp_path):
    """The read path's pooled buffers are page-aligned: the cache reads into them straight from the
    disk, so a block read once is not held twice in memory (by the mount's own page cache and by
    its segment file's)."""
    import mmap

    c = make(tmp_path)
    data = os.urandom(8 * MiB)
    assert c.put_blocks(v(), 0, data)
    if not c._direct:
        pytest.skip("this file system does not take O_DIRECT")
    path = seg_path(c, v(), 0)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    buf = mmap.mmap(-1, 8 * MiB)
    with memoryview(buf) as view:
        assert c.get_blocks(v(), 0, view, aligned=True) == [True] * 8
    assert buf[:] == data
    assert resident_pages(path) == 0
    # Memory of unknown alignment is read through the page cache, as before.
    plain = bytearray(8 * MiB)
    assert c.get_blocks(v(), 0, memoryview(plain)) == [True] * 8 and plain == data
    assert resident_pages(path) > 0


def test_a_file_system_refusing_o_direct_still_serves_blocks(tmp_path, monkeypatch):
    import mmap

    c = make(tmp_path)
    data = os.urandom(4 * MiB)
    assert c.put_blocks(v(), 0, data)
    real_open = os.open

    def no_direct(path, fl, *args):
        if fl & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, fl, *args)

    monkeypatch.setattr(cache_mod.os, "open", no_direct)
    buf = mmap.mmap(-1, 4 * MiB)
    with memoryview(buf) as view:
        assert c.get_blocks(v(), 0, view, aligned=True) == [True] * 4
    assert buf[:] == data and not c._direct
    assert c.statistics().get("corrupt", 0) == 0


def test_truncated_segment_is_detected(tmp_path):
    c = make(tmp_path)
    c.put_blocks(v(), 0, os.urandom(2 * MiB))
    path = seg_path(c, v(), 1)
    with open(path, "r+b") as f:
        f.truncate(HEADER_BYTES + MiB + MiB // 2)
    assert c.get_block(v(), 1) is None


def test_size_limit_holds_and_evicts_least_recently_used(tmp_path):
    c = make(tmp_path, size=8 * (MiB + HEADER_BYTES))
    for i in range(8):
        assert c.put_block(v(), i, os.urandom(MiB))
    c.get_block(v(), 0)  # block 0 is now the most recent
    assert c.put_block(v(), 8, os.urandom(MiB))
    assert c.statistics()["used_bytes"] <= c.size_bytes
    assert c.contains(v(), 0)
    assert not c.contains(v(), 1)  # the least recently used went first
    on_disk = sum(f.stat().st_size for f in (tmp_path / "c").rglob("*") if f.is_file())
    assert on_disk <= c.size_bytes


def test_pinned_versions_are_not_evicted(tmp_path):
    c = make(tmp_path, size=4 * (MiB + HEADER_BYTES))
    c.pin(v("open"))
    for i in range(3):
        c.put_block(v("open"), i, os.urandom(MiB))
    for i in range(4):
        c.put_block(v("other"), i, os.urandom(MiB))
    assert all(c.contains(v("open"), i) for i in range(3))
    c.unpin(v("open"))
    for i in range(4):
        c.put_block(v("third"), i, os.urandom(MiB))
    assert not c.contains(v("open"), 0)


def test_a_retired_version_leaves_the_disk_at_once_unless_a_handle_reads_it(tmp_path):
    c = make(tmp_path)
    old, new, other = v(etag="e1"), v(etag="e2"), v("other")
    for first in (0, 8):
        assert c.put_blocks(old, first, os.urandom(8 * MiB))
    assert c.put_block(old, 16, b"tail")
    assert c.put_blocks(new, 0, os.urandom(2 * MiB))
    assert c.put_block(other, 0, os.urandom(MiB))
    segment_bytes = 2 * (HEADER_BYTES + 8 * MiB) + 2 * HEADER_BYTES
    used = c.statistics()["used_bytes"]

    assert c.retire(old) == segment_bytes
    assert not any(c.contains(old, i) for i in range(17))
    assert c.contains(new, 1) and c.contains(other, 0)
    st = c.statistics()
    assert st["used_bytes"] == used - segment_bytes and st["segments"] == 2 and st["retired"] == 3
    on_disk = [f.name for f in (tmp_path / "c" / LAYOUT / old.digest[:2]).iterdir()]
    assert not [n for n in on_disk if n.startswith(old.digest[2:])]
    assert c.retire(old) == 0  # nothing left of it
    assert not c.may_hold(old) and c.may_hold(new)
    assert c.may_hold(new, 2) and not c.may_hold(new, 3)  # blocks 0-1 of it are here, not 2
    assert not c.may_hold(v("never", "e0"))  # scanned: the index knows every segment on disk

    # A version a handle has open keeps its blocks: the handle still reads them.
    c.pin(new)
    assert c.retire(new) == 0 and c.contains(new, 0)
    c.unpin(new)
    # A mount that has not indexed the version's directory yet finds its segments all the same.
    c2 = make(tmp_path, scan=False)
    assert c2.may_hold(v("never", "e0"))  # (its directory is not indexed yet: it may)
    assert c2.retire(new) == HEADER_BYTES + 2 * MiB
    assert make(tmp_path).statistics()["segments"] == 1  # only `other` is left on disk


def test_a_copied_version_takes_over_the_blocks_of_the_one_it_copies(tmp_path):
    """A rename copies the object in the store: its cached blocks become the copy's (`rekey`),
    rather than be deleted with the old name and fetched again under the new one."""
    c = make(tmp_path)
    old, new = v("a/old.bin", "e1"), v("b/new.bin", "e1-copy")
    data = os.urandom(16 * MiB + 5)
    for first in (0, 8, 16):
        assert c.put_blocks(old, first, data[first * MiB:(first + 8) * MiB])
    used = c.statistics()["used_bytes"]

    assert c.rekey(old, new) == used
    assert not any(c.contains(old, i) for i in range(17))
    got = bytearray(17 * MiB)
    assert c.get_blocks(new, 0, memoryview(got)[:len(data)]) == [True] * 17
    assert bytes(got[:len(data)]) == data
    st = c.statistics()
    assert st["used_bytes"] == used and st["segments"] == 3
    fresh = make(tmp_path)  # and so it is on disk: the next mount finds the copy's blocks
    assert fresh.get_block(new, 16) == data[16 * MiB:] and fresh.get_block(old, 0) is None

    # Renamed back while a handle reads the copy: its blocks stay where the handle looks for them.
    c.pin(new)
    assert c.rekey(new, old) == 0 and c.get_block(new, 0) == data[:MiB]
    c.unpin(new)


def test_a_segment_whose_move_a_crash_cut_short_is_a_miss(tmp_path):
    """`rekey` writes the copy's identity into a segment's header, then renames it: a crash between
    the two leaves a header that names neither the version its file name says nor any other there."""
    c = make(tmp_path)
    old, new = v("old", "e1"), v("new", "e2")
    assert c.put_blocks(old, 0, os.urandom(2 * MiB))
    path = seg_path(c, old, 0)

    def crash(src, dst):
        raise SystemExit("killed")  # the process ends between the header and the rename

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cache_mod.os, "replace", crash)
        with pytest.raises(SystemExit):
            c.rekey(old, new)
    assert path.exists()
    after = make(tmp_path)
    assert after.get_block(old, 0) is None and after.get_block(new, 0) is None
    assert not path.exists()  # taken for damage, and removed


def test_index_is_usable_before_the_background_scan(tmp_path):
    c = make(tmp_path)
    data = os.urandom(3 * MiB)
    c.put_blocks(v(), 0, data)
    c.put_block(v("other"), 0, b"x" * 100)
    c2 = make(tmp_path, scan=False)
    # The mount never waits for the index: a lookup loads just its own subdirectory.
    assert c2.get_block(v(), 2) == data[2 * MiB:]
    assert c2.statistics()["index_loaded"] == 0
    c2.scan()
    st = c2.statistics()
    assert st["index_loaded"] == 1 and st["segments"] == 2 and st["blocks"] == 4


def test_half_written_segments_are_removed_by_the_scan(tmp_path):
    c = make(tmp_path)
    c.put_block(v(), 0, os.urandom(MiB))
    sub = next(p for p in (tmp_path / "c" / LAYOUT).iterdir() if p.is_dir())
    (sub / ".tmp12345").write_bytes(b"partial")
    make(tmp_path)
    assert not (sub / ".tmp12345").exists()


def test_a_listing_while_a_segment_is_written_leaves_that_segment_alone(tmp_path):
    """The first lookup in a subdirectory lists it, and so does the background scan; a segment
    another thread was writing there under its temporary name was deleted as a dead writer's
    leftover, and its rename failed."""
    c = make(tmp_path)
    write_file = c._write_file

    def listed_meanwhile(path, *args):
        write_file(path, *args)
        c._list_subdir(path.parent.name)  # another thread's first look at this subdirectory

    c._write_file = listed_meanwhile
    data = os.urandom(MiB + 5)
    assert c.put_blocks(v(), 0, data)
    assert c.get_block(v(), 1) == data[MiB:]
    assert c.statistics().get("write_errors", 0) == 0


def test_refuses_a_directory_others_can_write(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(UcfsError, match="other users can write"):
        BlockCache(d, size_bytes=MiB, free_floor_bytes=0, block_bytes=MiB)


def test_new_cache_directory_is_private(tmp_path):
    make(tmp_path)
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o700


def fake_disk(monkeypatch, root, free_outside):
    """statvfs of a disk whose free space is free_outside[0] minus what the cache holds on it."""
    def statvfs(path):
        used = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
        return types.SimpleNamespace(f_bavail=max(0, free_outside[0] - used) // 4096, f_frsize=4096)
    monkeypatch.setattr(cache_mod.os, "statvfs", statvfs)


def test_the_free_space_floor_evicts_only_what_it_needs(tmp_path, monkeypatch):
    floor = 100 * MiB
    free = [floor + 4 * MiB + 512 * 1024]  # room above the floor for 4 one-MiB segments, not 5
    fake_disk(monkeypatch, tmp_path / "c", free)
    c = make(tmp_path, size=1 << 40, floor=floor)
    for i in range(4):
        assert c.put_block(v(), i, os.urandom(MiB))
    # A fifth block: evicting the least recently used one makes room above the floor. (The free
    # space was estimated from what was written, so evicting never raised it: everything went.)
    assert c.put_block(v(), 4, os.urandom(MiB))
    assert [i for i in range(5) if c.contains(v(), i)] == [1, 2, 3, 4]


def test_space_freed_elsewhere_on_the_disk_is_used_again(tmp_path, monkeypatch):
    floor = 100 * MiB
    free = [floor + MiB // 2]  # the disk is short of room: nothing can be kept
    fake_disk(monkeypatch, tmp_path / "c", free)
    c = make(tmp_path, size=1 << 40, floor=floor)
    assert not c.put_block(v(), 0, os.urandom(MiB))
    free[0] = 100 * 1024 * MiB  # someone deleted 100 GiB elsewhere on the disk
    assert c.put_block(v(), 1, os.urandom(MiB)), "the cache never looked at the free space again"


def test_files_the_cache_never_writes_are_ignored_by_its_index(tmp_path):
    """A stray file named like a segment of 300 million blocks made the scan loop for minutes with
    the cache's lock held (every read waited); one of 0 blocks, or with a name that is not a
    digest, was indexed and counted. Only what put_blocks writes is taken up now."""
    c = make(tmp_path)
    data = os.urandom(2 * MiB)
    assert c.put_blocks(v(), 0, data)
    good = seg_path(c, v(), 0)
    d = good.parent
    for stray in ("cd.0.300000000", good.name.split(".")[0] + ".0.300000000",
                  good.name.split(".")[0] + ".5.0", "z" * 38 + ".0.1", "notes.txt"):
        (d / stray).write_bytes(b"x")
    again = make(tmp_path)  # a remount: the scan indexes what it finds
    assert again.get_block(v(), 1) == data[MiB:]
    assert sorted(again._lru) == [d.name + good.name]


def test_a_stray_file_with_a_whole_digest_for_a_name_does_not_break_the_index(tmp_path):
    """Inside a subdirectory a segment's name holds 38 digits of its digest (the directory has the
    first two). A stray file with all 40 was taken up as a 42-digit segment the index could not
    parse: a TypeError that ended the background scan (the size limit was never enforced on what
    earlier mounts left) and failed every read of objects in that subdirectory."""
    c = make(tmp_path)
    data = os.urandom(2 * MiB)
    assert c.put_blocks(v(), 0, data)
    good = seg_path(c, v(), 0)
    (good.parent / ("ab" * 20 + ".0.1")).write_bytes(b"x")
    fresh = make(tmp_path, scan=False)  # a remount: the first read lists the subdirectory
    assert fresh.get_block(v(), 1) == data[MiB:]
    again = make(tmp_path, size=MiB)  # a remount with a smaller limit: the scan evicts
    assert again.wait_scanned(0)
    assert again.statistics()["used_bytes"] <= MiB and not good.exists()


def test_a_block_the_disk_cannot_read_is_a_miss_not_an_error(tmp_path, monkeypatch):
    """EIO from the cache's disk is damage like a bad checksum: the reader fetches the block again
    from the store instead of failing (the segment is dropped)."""
    c = make(tmp_path)
    ver = v()
    assert c.put_blocks(ver, 0, b"x" * (2 * MiB))
    real_pread = os.pread

    def failing_pread(fd, n, off):
        if off >= 4096:
            raise OSError(errno.EIO, "Input/output error")
        return real_pread(fd, n, off)

    monkeypatch.setattr(os, "pread", failing_pread)
    assert c.get_block(ver, 1) is None
    monkeypatch.setattr(os, "pread", real_pread)
    assert not c.contains(ver, 0)  # the segment went with it
    assert c.statistics()["used_bytes"] == 0
    assert not [p for p in (tmp_path / "c" / LAYOUT).glob("*/*")]


def test_a_cache_directory_the_disk_cannot_list_is_a_miss_not_an_error(tmp_path, monkeypatch):
    """Listing a subdirectory of the lazily loaded index fails with EIO on a failing disk: its
    segments cannot be used, but the read (a miss) and the background scan go on."""
    c = make(tmp_path)
    assert c.put_blocks(v(), 0, b"x" * MiB)
    sub = seg_path(c, v(), 0).parent
    real = os.scandir

    def scandir(path):
        if os.fspath(path) == os.fspath(sub):
            raise OSError(errno.EIO, "Input/output error")
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    again = make(tmp_path, scan=False)
    assert again.get_block(v(), 0) is None
    again.scan()
    assert again.wait_scanned(0)


def test_blocks_already_here_are_not_written_again(tmp_path, monkeypatch):
    """Two fetches of one part (or a commit's caching and a read's) put the same segment twice. The
    second is not written: had an eviction removed the segment between its rename and its indexing,
    the name would stay indexed and counted with no file on disk."""
    c = make(tmp_path)
    data = os.urandom(2 * MiB)
    assert c.put_blocks(v(), 0, data)
    used = c.statistics()["used_bytes"]
    writes = []
    real = c._write_file
    monkeypatch.setattr(c, "_write_file", lambda *a: writes.append(a) or real(*a))
    assert c.put_blocks(v(), 0, data)
    assert writes == [] and c.statistics()["used_bytes"] == used and c.statistics()["puts"] == 1
    assert c.put_blocks(v(), 2, data)  # other blocks of it are written as ever
    assert len(writes) == 1
