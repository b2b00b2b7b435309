"""torchio's sharding, resume state and local file cache, without a mount.

The arithmetic (`torchio._shard`) is checked exhaustively over small sizes; the dataset and loader
run over a local directory with real DataLoader workers, which behave the same on a mount (the mount
tests in tests/torch add the store). See torchio/dataset.py for the contract.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
# Tests use up to 3 DataLoader workers on 2 cores on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

from torchio import DataLoader, UCVolumeDataset  # noqa: E402
from torchio import _shard  # noqa: E402
from torchio._cache import FileCache, SourceFile, disk_bytes  # noqa: E402


def rr_consumption(shares: list[list[int]], batch_size: int) -> list[int]:
    """What torch's DataLoader hands the consumer: one batch per worker in turn, skipping dry ones."""
    batches = [[s[i:i + batch_size] for i in range(0, len(s), batch_size)] for s in shares]
    out: list[int] = []
    for rnd in itertools.count():
        live = [b[rnd] for b in batches if rnd < len(b)]
        if not live:
            return out
        for b in live:
            out.extend(b)


# -- the arithmetic ----------------------------------------------------------------------------------

@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_are_equal_disjoint_and_cover_the_epoch(drop_last):
    for n, world in itertools.product(range(0, 23), range(1, 6)):
        order = _shard.epoch_order(n, epoch=0, seed=0, shuffle=False)
        streams = [_shard.rank_stream(order, rank=r, world_size=world, drop_last=drop_last) for r in range(world)]
        per = _shard.per_rank_count(n, world, drop_last=drop_last)
        assert all(len(s) == per for s in streams), (n, world)
        seen = Counter(i for s in streams for i in s)
        if drop_last:
            assert all(c == 1 for c in seen.values()) and len(seen) == per * world
        else:
            assert set(seen) == set(range(n))  # no gaps
            assert sum(seen.values()) - n == per * world - n  # the only repeats are the padding
            assert per * world - n < world or n == 0


def test_workers_split_a_rank_without_overlap_and_in_consumption_order():
    for n, workers, batch, start in itertools.product(range(0, 30), range(0, 5), range(1, 6), range(0, 8)):
        stream = list(range(100, 100 + n))
        shares = [_shard.worker_share(stream, start=start, worker=w, num_workers=workers, batch_size=batch)
                  for w in range(max(1, workers))]
        assert sorted(i for s in shares for i in s) == stream[start:]
        # The DataLoader's round-robin over these shares gives back the stream in order: that is what
        # makes "items consumed" one exact number.
        assert rr_consumption(shares, batch) == stream[start:], (n, workers, batch, start)


def test_shuffle_is_per_epoch_and_reproducible():
    a0 = _shard.epoch_order(1000, epoch=0, seed=5, shuffle=True)
    assert a0 == _shard.epoch_order(1000, epoch=0, seed=5, shuffle=True)
    assert sorted(a0) == list(range(1000)) and a0 != list(range(1000))
    assert a0 != _shard.epoch_order(1000, epoch=1, seed=5, shuffle=True)
    assert a0 != _shard.epoch_order(1000, epoch=0, seed=6, shuffle=True)
    # seed + epoch would make these two equal
    assert _shard.epoch_order(50, epoch=1, seed=0, shuffle=True) != _shard.epoch_order(50, epoch=0, seed=1,
                                                                                         shuffle=True)


def test_shard_rejects_nonsense():
    with pytest.raises(ValueError):
        _shard.rank_stream([1, 2], rank=2, world_size=2, drop_last=False)
    with pytest.raises(ValueError):
        _shard.worker_share([1, 2], start=0, worker=3, num_workers=2, batch_size=1)
    with pytest.raises(ValueError):
        _shard.per_rank_count(4, 0, drop_last=False)


# -- the dataset over a local directory ---------------------------------------------------------------

@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "src"
    for i in range(37):
        d = root / ("a" if i % 3 else "b/c")
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i:03d}.bin").write_bytes(i.to_bytes(2, "little") * (50 + i))
    (root / "skip.txt").write_text("not a sample")
    return root


def names(paths) -> list[str]:
    """The sample a cached path stands for (its content names it)."""
    out = []
    for p in paths:
        with open(p, "rb") as f:
            out.append(f"f{int.from_bytes(f.read(2), 'little'):03d}.bin")
    return out


def make(tree, tmp_path, **kw) -> UCVolumeDataset:
    kw.setdefault("pattern", "*.bin")
    # No free-space floor: these tests are about caching, and the default floor (8 GiB) would make
    # them fail on a host with less free disk (the floor has a test of its own, with FileCache).
    kw.setdefault("free_floor_bytes", 0)
    return UCVolumeDataset(tree, cache_dir=tmp_path / "cache", **kw)


def test_listing_is_sorted_recursive_and_filtered(tree, tmp_path):
    ds = make(tree, tmp_path)
    rel = [os.path.relpath(p, tree) for p in ds.files]
    assert rel == sorted(rel) and len(rel) == 37 and "skip.txt" not in rel
    assert len(make(tree, tmp_path, recursive=False).files) == 0
    assert len(make(tree, tmp_path, pattern="a/*").files) == 24
    with pytest.raises(FileNotFoundError):
        UCVolumeDataset(tree / "missing", cache_dir=tmp_path / "cache")
    with pytest.raises(NotADirectoryError):
        UCVolumeDataset(tree / "skip.txt", cache_dir=tmp_path / "cache")


def test_files_and_directories_removed_while_listing_are_left_out(tmp_path, monkeypatch):
    """Another process deletes a file between the directory read and its stat, and a subdirectory
    after its parent was read: the listing is of a moment later, not a FileNotFoundError that stops
    the job from starting."""
    import torchio.dataset as dataset_mod

    root = tmp_path / "src"
    (root / "sub").mkdir(parents=True)
    (root / "keep").mkdir()
    for rel in ("x.bin", "gone.bin", "sub/y.bin", "keep/z.bin"):
        (root / rel).write_bytes(b"\1\0" * 10)
    real = dataset_mod.fnmatch.fnmatchcase

    def fnmatchcase(name, pattern):
        if name == "gone.bin":  # matched just before its stat: the other process removes it now
            (root / "gone.bin").unlink()
            shutil.rmtree(root / "sub")  # listed in the root already, not read yet
        return real(name, pattern)

    monkeypatch.setattr(dataset_mod.fnmatch, "fnmatchcase", fnmatchcase)
    ds = UCVolumeDataset(root, cache_dir=tmp_path / "cache", free_floor_bytes=0)
    monkeypatch.setattr(dataset_mod.fnmatch, "fnmatchcase", real)
    assert [os.path.relpath(p, root) for p in ds.files] == ["keep/z.bin", "x.bin"]


def test_from_files_reads_exactly_those(tree, tmp_path):
    picked = [tree / "b" / "c" / "f000.bin", tree / "a" / "f002.bin", tree / "a" / "f001.bin"]
    ds = UCVolumeDataset.from_files(picked, cache_dir=tmp_path / "cache")
    assert ds.files == sorted(str(p) for p in picked)
    assert names(ds) == ["f001.bin", "f002.bin", "f000.bin"]
    ds.refresh()
    assert len(ds.files) == 3
    with pytest.raises(FileNotFoundError):
        UCVolumeDataset.from_files([tree / "nope.bin", tree / "a" / "f001.bin"], cache_dir=tmp_path / "cache")


def test_files_are_cached_once_and_yielded_as_local_paths(tree, tmp_path):
    ds = make(tree, tmp_path)
    first = list(ds)
    assert all(p.startswith(str(tmp_path / "cache")) for p in first)
    assert sorted(names(first)) == sorted(f"f{i:03d}.bin" for i in range(37))
    assert ds.statistics()["misses"] == 37 and ds.statistics()["hits"] == 0
    assert list(ds) == first
    assert ds.statistics()["hits"] == 37
    # Another dataset (another run) over the same unchanged files reuses the copies.
    again = make(tree, tmp_path)
    assert list(again) == first and again.statistics()["misses"] == 0


def test_a_changed_source_is_a_miss_never_stale(tree, tmp_path):
    p = tree / "a" / "f001.bin"
    ds = make(tree, tmp_path, pattern="a/f001.bin")
    old = list(ds)[0]
    p.write_bytes(b"\x01\x00" + b"new content")
    os.utime(p, ns=(time.time_ns(), time.time_ns() + 10**9))
    fresh = make(tree, tmp_path, pattern="a/f001.bin")
    new = list(fresh)[0]
    assert new != old and open(new, "rb").read() == p.read_bytes()


def _worker1_lists_after_a_file_is_added(worker_id: int) -> None:
    """worker_init_fn: worker 0 lists (`files`), then worker 1 adds a file, then lists in its pass."""
    info = torch.utils.data.get_worker_info()
    flag = os.path.join(info.dataset.root, "..", "worker0-listed")
    if worker_id == 0:
        len(info.dataset.files)
        open(flag, "w").close()
        return
    deadline = time.monotonic() + 30
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.01)
    (Path(info.dataset.root) / "a" / "f999.bin").write_bytes((999).to_bytes(2, "little") * 60)


def test_plain_torch_loader_workers_shard_one_listing_when_the_directory_changes(tree, tmp_path):
    """torch's own DataLoader never asks the dataset anything before its workers start. When the
    listing was left to each worker, a file added between two workers' listings gave them lists of
    37 and 38 files: their shards overlapped and had gaps (about half the files twice, the others
    never). Every worker must shard the one listing made where the dataset was built."""
    ds = make(tree, tmp_path)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2,
                                         worker_init_fn=_worker1_lists_after_a_file_is_added)
    got = Counter(names(loader))
    assert (tree / "a" / "f999.bin").exists()  # the directory did change during the pass
    assert got == Counter(f"f{i:03d}.bin" for i in range(37))


@pytest.mark.parametrize("workers", [0, 1, 3])
@pytest.mark.parametrize("batch", [1, 4])
def test_loader_delivers_the_rank_stream_in_order(tree, tmp_path, workers, batch):
    ds = make(tree, tmp_path, shuffle=True, seed=11)
    ds.set_epoch(3)
    got = [p for b in DataLoader(ds, batch_size=batch, num_workers=workers, log_every_batches=0) for p in b]
    order = _shard.epoch_order(37, epoch=3, seed=11, shuffle=True)
    want = [os.path.basename(ds.files[i]) for i in order]
    assert names(got) == want


def test_ranks_from_the_environment(tree, tmp_path, monkeypatch):
    seen = []
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "3")
        ds = make(tree, tmp_path)
        assert len(ds) == 13
        got = names(p for b in DataLoader(ds, batch_size=2, num_workers=2, log_every_batches=0) for p in b)
        assert len(got) == 13
        seen += got
    c = Counter(seen)
    assert set(c) == {f"f{i:03d}.bin" for i in range(37)} and sum(c.values()) == 39  # 2 pads
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    assert len(make(tree, tmp_path, drop_last=True)) == 12


def test_set_epoch_reaches_persistent_workers(tree, tmp_path):
    ds = make(tree, tmp_path, shuffle=True, seed=1)
    loader = DataLoader(ds, batch_size=3, num_workers=2, persistent_workers=True, log_every_batches=0)
    epochs = []
    for e in range(3):
        ds.set_epoch(e)
        epochs.append(names(p for b in loader for p in b))
    assert epochs[0] != epochs[1] != epochs[2]
    for e, got in enumerate(epochs):
        assert got == [os.path.basename(ds.files[i]) for i in _shard.epoch_order(37, epoch=e, seed=1, shuffle=True)]
    ds.set_epoch(1)
    assert names(p for b in loader for p in b) == epochs[1]


@pytest.mark.parametrize("workers_before,workers_after", [(0, 0), (1, 1), (2, 2), (2, 0), (0, 3)])
def test_resume_mid_epoch_yields_exactly_the_rest(tree, tmp_path, workers_before, workers_after):
    ds = make(tree, tmp_path, shuffle=True, seed=4)
    ds.set_epoch(2)
    loader = DataLoader(ds, batch_size=4, num_workers=workers_before, log_every_batches=0)
    consumed = []
    for k, b in enumerate(loader):
        consumed += b
        if k == 4:
            state = loader.state_dict()
            break
    assert state["dataset"]["consumed"] == 20 and state["dataset"]["epoch"] == 2
    assert ds.state_dict() == state["dataset"]

    ds2 = make(tree, tmp_path, shuffle=True, seed=4)
    loader2 = DataLoader(ds2, batch_size=3, num_workers=workers_after, log_every_batches=0)
    loader2.load_state_dict(state)
    ds2.set_epoch(2)  # the training loop sets the epoch it resumes in: the resume point stays
    rest = [p for b in loader2 for p in b]
    assert sorted(names(consumed + rest)) == sorted(f"f{i:03d}.bin" for i in range(37))
    assert len(consumed) + len(rest) == 37
    assert ds2.state_dict()["consumed"] == 37
    # The next pass of the same epoch starts from its beginning again.
    assert len([p for b in loader2 for p in b]) == 37
    ds2.set_epoch(3)
    assert ds2.state_dict()["consumed"] == 0


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_loaded_state_applies_once_with_a_plain_torch_loader(tree, tmp_path, workers, persistent):
    """torch's own DataLoader does not tell the dataset when a pass starts, as torchio's does: the
    workers themselves must apply a loaded state in the first pass after it only."""
    ds = make(tree, tmp_path, shuffle=True, seed=4, batch_size=4)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=workers,
                                         persistent_workers=persistent)
    order = [os.path.basename(ds.files[i]) for i in _shard.epoch_order(37, epoch=2, seed=4, shuffle=True)]

    def one_pass():
        return names(p for b in loader for p in b)

    ds.load_state_dict({**ds.state_dict(), "epoch": 2, "consumed": 10})
    assert one_pass() == order[10:]
    assert one_pass() == order
    ds.set_epoch(2)  # the epoch the state was saved in: still no second resume
    assert one_pass() == order
    ds.load_state_dict({**ds.state_dict(), "epoch": 2, "consumed": 21})  # a new state applies again
    assert one_pass() == order[21:]
    assert one_pass() == order


def test_a_state_used_in_the_consumers_process_is_not_applied_again_by_workers(tree, tmp_path):
    ds = make(tree, tmp_path, shuffle=True, seed=4, batch_size=4)
    order = [os.path.basename(ds.files[i]) for i in _shard.epoch_order(37, epoch=2, seed=4, shuffle=True)]
    ds.load_state_dict({**ds.state_dict(), "epoch": 2, "consumed": 10})
    assert names(ds) == order[10:]  # iterated directly: the resumed pass
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
    assert names(p for b in loader for p in b) == order


def test_resume_state_is_checked(tree, tmp_path):
    ds = make(tree, tmp_path, seed=1)
    state = ds.state_dict()
    with pytest.raises(ValueError, match="seed"):
        make(tree, tmp_path, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="file list"):
        make(tree, tmp_path, seed=1, pattern="a/*").load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        ds.load_state_dict({**state, "version": 99})


def test_resume_refuses_another_world_size(tree, tmp_path, monkeypatch):
    ds = make(tree, tmp_path)
    state = {**ds.state_dict(), "consumed": 3, "world_size": 2}
    ds.load_state_dict(state)
    with pytest.raises(ValueError, match="world size"):
        list(ds)


class Decoded(torch.utils.data.IterableDataset):
    """The ImageDataset pattern: a dataset of paths wrapped by one that decodes them."""

    def __init__(self, paths: UCVolumeDataset):
        self.paths = paths

    def __iter__(self):
        for p in self.paths:
            with open(p, "rb") as f:
                yield torch.tensor(int.from_bytes(f.read(2), "little"))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_wrapping_dataset_shards_and_resumes(tree, tmp_path, workers):
    ds = make(tree, tmp_path)
    loader = DataLoader(Decoded(ds), batch_size=5, num_workers=workers, log_every_batches=0)
    it = iter(loader)
    head = torch.cat([next(it), next(it)]).tolist()
    state = loader.state_dict()
    del it
    assert state["dataset"]["consumed"] == 10
    ds2 = make(tree, tmp_path)
    loader2 = DataLoader(Decoded(ds2), batch_size=5, num_workers=workers, log_every_batches=0)
    loader2.load_state_dict(state)
    rest = torch.cat(list(loader2)).tolist()
    assert head + rest == [int(os.path.basename(p)[1:4]) for p in ds.files]  # in order, each once


def test_loader_defaults_and_stats(tree, tmp_path):
    ds = make(tree, tmp_path)
    loader = DataLoader(ds, batch_size=8)
    assert loader.num_workers >= 1 and loader.persistent_workers and loader.prefetch_factor == 4
    assert loader.stats() is None
    n = sum(1 for _ in loader)
    st = loader.stats()
    assert st.batches == n == 5 and st.wait_s >= st.wait_max_s > 0 and 0 < st.wait_fraction <= 1
    assert st.cache["misses"] + st.cache["hits"] == 37
    plain = DataLoader(list(range(10)), batch_size=4, num_workers=0)  # any dataset works, just timed
    assert [b.tolist() for b in plain] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert plain.stats().batches == 3 and plain.state_dict() == {}


# -- the file cache -----------------------------------------------------------------------------------

def src_file(tmp_path, name: str, size: int) -> SourceFile:
    p = tmp_path / "src" / name
    p.parent.mkdir(exist_ok=True)
    p.write_bytes(os.urandom(size))
    st = p.stat()
    return SourceFile(str(p), st.st_size, st.st_mtime_ns)


def test_cache_evicts_least_recently_used_within_capacity(tmp_path):
    cache = FileCache(tmp_path / "c", capacity_bytes=10 * 4096, free_floor_bytes=0, protect_s=0)
    files = [src_file(tmp_path, f"f{i}", 4000) for i in range(12)]
    for f in files[:8]:
        assert not cache.get(f).hit
    time.sleep(0.01)
    assert cache.get(files[0]).hit  # now the most recently used
    for f in files[8:]:
        got = cache.get(f)
        assert not got.bypassed and open(got.path, "rb").read() == open(f.path, "rb").read()
        assert cache.usage_bytes() <= 10 * 4096
    assert cache.lookup(files[0]) is not None  # survived: recently used
    assert cache.lookup(files[1]) is None  # the oldest went first


def test_cache_bypasses_what_cannot_fit(tmp_path):
    big = src_file(tmp_path, "big", 50_000)
    assert FileCache(tmp_path / "c1", capacity_bytes=4096, free_floor_bytes=0).get(big).bypassed
    floor = FileCache(tmp_path / "c2", capacity_bytes=1 << 40, free_floor_bytes=1 << 60)
    got = floor.get(big)
    assert got.bypassed and got.path == big.path
    # Files in use (touched within protect_s) are not evicted to make room.
    busy = FileCache(tmp_path / "c3", capacity_bytes=2 * 4096, free_floor_bytes=0, protect_s=3600)
    a, b, c = (src_file(tmp_path, n, 4000) for n in "abc")
    assert not busy.get(a).bypassed and not busy.get(b).bypassed
    assert busy.get(c).bypassed and busy.lookup(a) and busy.lookup(b)


def test_a_bypass_says_once_which_bound_and_how_much_the_disk_has(tmp_path, monkeypatch, caplog):
    """A disk fuller than the floor is the usual reason (CI's disk once had under 8 GiB free, the
    default floor): the warning says how much the disk has and which options move the bounds."""
    cache = FileCache(tmp_path / "c", capacity_bytes=64 << 30, free_floor_bytes=8 << 30)
    monkeypatch.setattr(FileCache, "_free_bytes", lambda self: 5 << 30)
    a, b = src_file(tmp_path, "a", 20 << 10), src_file(tmp_path, "b", 4000)
    with caplog.at_level(logging.DEBUG, logger="torchio._cache"):
        assert cache.get(a).bypassed and cache.get(b).bypassed
    first, second = [r for r in caplog.records if "has no room" in r.getMessage()]
    assert first.levelno == logging.WARNING and second.levelno == logging.DEBUG
    assert (f"has no room for {a.path} (20 KiB): its disk has 5 GiB free and the cache leaves 8 GiB free "
            "(free_floor_bytes), holding at most 64 GiB (cache_size_bytes)") in first.getMessage()
    assert "said once per process" in first.getMessage()


def test_cache_recounts_usage_after_drift(tmp_path):
    cache = FileCache(tmp_path / "c", capacity_bytes=1 << 30, free_floor_bytes=0)
    f = src_file(tmp_path, "x", 10_000)
    cache.get(f)
    (cache.base / "usage").write_text("garbage")
    assert cache.usage_bytes() == disk_bytes(10_000)


def _aged_cache_pair(tmp_path, n: int):
    """Two caches on one directory (separate flock descriptions, as in two processes), holding n
    files of 4000 bytes last used two minutes ago, the first of them least recently."""
    root = tmp_path / "c"
    a = FileCache(root, capacity_bytes=16 * 4096, free_floor_bytes=0, protect_s=60)
    b = FileCache(root, capacity_bytes=16 * 4096, free_floor_bytes=0, protect_s=60)
    old = [src_file(tmp_path, f"old{i}", 4000) for i in range(n)]
    past = time.time() - 120
    for k, f in enumerate(old):
        a.get(f)
        os.utime(a.local_path(f), (past - (10 if k == 0 else 0),) * 2)
    return a, b, old


def test_a_hit_during_an_eviction_scan_is_not_deleted(tmp_path, monkeypatch):
    """Process a gets a path from lookup() (a hit, which marks it used) after process b's eviction
    scan has read the mtimes it sorts by and picked that file as the least recently used: b must
    see the hit and keep the file, or a's consumer fails to open what it was given."""
    a, b, old = _aged_cache_pair(tmp_path, 14)
    victim = old[0]
    given = {}
    real_evict = b._evict

    def evict(path, scanned_ns):
        # The scan has read the stats it sorts by and starts on the least recently used.
        if "path" not in given:
            given["path"] = a.lookup(victim)
        return real_evict(path, scanned_ns)

    monkeypatch.setattr(b, "_evict", evict)
    for f in (src_file(tmp_path, f"new{i}", 4000) for i in range(6)):
        assert not b.get(f).bypassed  # b fills past the capacity: it evicts
    monkeypatch.setattr(b, "_evict", real_evict)
    assert given["path"] is not None
    with open(given["path"], "rb") as f:
        assert f.read() == open(victim.path, "rb").read()
    assert any(a.lookup(f) is None for f in old[1:])  # others went instead
    assert b.usage_bytes() <= b.capacity_bytes


def test_a_hit_just_before_an_eviction_takes_the_file_keeps_it(tmp_path, monkeypatch):
    """The hit lands after b's last look at the file's mtime, just before b moves it aside: b sees
    it on the file it moved, and puts it back."""
    a, b, old = _aged_cache_pair(tmp_path, 16)
    victim = old[0]
    given = {}
    real_rename = os.rename

    def rename(src, dst, *args, **kw):
        if ".evict." in os.fspath(dst) and os.fspath(src) == a.local_path(victim) and "path" not in given:
            given["path"] = a.lookup(victim)
        return real_rename(src, dst, *args, **kw)

    monkeypatch.setattr(os, "rename", rename)
    assert not b.get(src_file(tmp_path, "new", 4000)).bypassed
    monkeypatch.setattr(os, "rename", real_rename)
    assert given["path"] is not None
    with open(given["path"], "rb") as f:
        assert f.read() == open(victim.path, "rb").read()
    assert any(a.lookup(f) is None for f in old[1:])
    # Nothing is left aside, and what was put back is counted.
    names = [n for _, _, fs in os.walk(a.base / "objects") for n in fs]
    assert not [n for n in names if ".evict." in n] and len(names) < 17
    (a.base / "usage").write_text("garbage")
    assert b.usage_bytes() == len(names) * 4096


def test_a_file_left_aside_by_a_dead_eviction_is_removed_and_not_counted(tmp_path):
    cache = FileCache(tmp_path / "c", capacity_bytes=1 << 30, free_floor_bytes=0)
    f = src_file(tmp_path, "x.evict", 10_000)  # an extension that looks like the marker
    local = cache.get(f).path
    aside = f"{cache.local_path(src_file(tmp_path, 'y', 8000))}.evict.{2**22 + 1}"
    os.makedirs(os.path.dirname(aside), exist_ok=True)
    with open(aside, "wb") as out:
        out.write(b"\0" * 8000)
    (cache.base / "usage").write_text("garbage")
    assert cache.usage_bytes() == disk_bytes(10_000)
    assert not os.path.exists(aside) and cache.lookup(f) == local


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs unshare(1) and root for a process in another PID namespace")
def test_a_fill_in_progress_is_not_taken_for_dead_by_a_job_in_another_pid_namespace(tmp_path, monkeypatch):
    """Two jobs in two containers share a host's cache. A process in the other PID namespace cannot
    see our pid, so it took our fill in progress for a dead one's and deleted its temporary file at
    start: our rename then failed (FileNotFoundError out of the pass)."""
    import torchio._cache as cache_mod

    root = tmp_path / "c"
    cache = FileCache(root, capacity_bytes=1 << 30, free_floor_bytes=0)
    src = src_file(tmp_path, "a.bin", 10_000)
    real_copy = cache_mod._copy
    other = []

    def copy_then_another_job_starts(fin, fout):
        n = real_copy(fin, fout)
        code = ("import sys; from torchio._cache import FileCache; "
                "FileCache(sys.argv[1], capacity_bytes=1 << 30, free_floor_bytes=0).usage_bytes()")
        other.append(subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", code, str(root)],
                                    env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                                    capture_output=True, text=True, timeout=120))
        return n

    monkeypatch.setattr(cache_mod, "_copy", copy_then_another_job_starts)
    got = cache.get(src)
    assert other and other[0].returncode == 0, other[0].stderr
    assert not got.bypassed and open(got.path, "rb").read() == open(src.path, "rb").read()


def test_a_fill_put_in_place_while_a_scan_recounts_is_counted(tmp_path, monkeypatch):
    """A scan recounts `usage` from the files under objects/ and the fills in progress under tmp/.
    Another process's fill that moved from tmp/ to objects/ between the two passes was in neither
    (seen: `usage` two pages below what was on disk after three processes shared a cache), so the
    cache could pass its capacity by such files until the next scan. Let the rename land before each
    directory listing of the scan in turn: the recount must never come out below the disk."""
    import torchio._cache as cache_mod

    cache = FileCache(tmp_path / "c", capacity_bytes=1 << 30, free_floor_bytes=0)
    for i in range(6):
        cache.get(src_file(tmp_path, f"old{i}", 5000))
    late = src_file(tmp_path, "late", 9000)
    dst = cache.local_path(late)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = cache.base / "tmp" / f"{os.path.basename(dst)}.{cache._tmp_owner}.1.0"  # a live fill's name
    real_scandir = cache_mod._scandir
    calls = []

    def scandir_and_rename_at(k):
        def scandir(path):
            if len(calls) == k and os.path.exists(tmp):
                os.rename(tmp, dst)  # the other process's fill goes into place now
            calls.append(path)
            return real_scandir(path)
        return scandir

    k = 0
    while True:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dst)
        tmp.write_bytes(os.urandom(late.size))
        (cache.base / "usage").write_text("garbage")  # the next use recounts
        calls.clear()
        monkeypatch.setattr(cache_mod, "_scandir", scandir_and_rename_at(k))
        used = cache.usage_bytes()
        monkeypatch.setattr(cache_mod, "_scandir", real_scandir)
        on_disk = sum(disk_bytes(os.path.getsize(os.path.join(d, f)))
                      for d, _, fs in os.walk(cache.base) for f in fs if f != "usage")
        assert used >= on_disk == 6 * disk_bytes(5000) + disk_bytes(9000), (k, used, calls)
        if k >= len(calls):
            break
        k += 1


def _fill_many(root: str, paths: list[tuple[str, int, int]], q) -> None:
    cache = FileCache(root, capacity_bytes=40 * 4096, free_floor_bytes=0, protect_s=0)
    for p in paths:
        while True:
            got = cache.get(SourceFile(*p))
            try:
                f = open(got.path, "rb")
            except FileNotFoundError:
                # protect_s=0 promises nothing: on a loaded host another process evicted the file
                # between get() and open(). Ask again, as a consumer without protection must.
                continue
            with f:
                if f.read() != open(p[0], "rb").read():
                    q.put("corrupt")
            break
    q.put("ok")


def test_cache_is_shared_safely_by_processes(tmp_path):
    files = [src_file(tmp_path, f"s{i}", 3000 + i) for i in range(60)]
    args = [(f.path, f.size, f.mtime_ns) for f in files]
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_fill_many, args=(str(tmp_path / "c"), args[i::2] + args, q)) for i in range(4)]
    for p in procs:
        p.start()
    results = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert results == ["ok"] * 4
    cache = FileCache(tmp_path / "c", capacity_bytes=40 * 4096, free_floor_bytes=0)
    on_disk = sum(disk_bytes(os.path.getsize(os.path.join(d, f)))
                  for d, _, fs in os.walk(cache.base / "objects") for f in fs)
    assert on_disk <= 40 * 4096
    assert not os.listdir(cache.base / "tmp")


def test_a_fill_on_room_taken_before_another_process_scanned_stays_within_capacity(tmp_path, monkeypatch):
    """Process a fills a file on room it took in advance, without the lock. Meanwhile process b
    fills the cache to its capacity, and its last fill scans: the recount cannot see a's file, not
    yet in place. Before a's file goes in, a must count it again, and finding no room (everything is
    in use), read the source instead of passing the limit."""
    import torchio._cache as cache_mod

    root = tmp_path / "c"
    cap = 64 * 4096  # room is taken in advance one page at a time (1/64 of the capacity)
    a = FileCache(root, capacity_bytes=cap, free_floor_bytes=0, protect_s=3600)
    b = FileCache(root, capacity_bytes=cap, free_floor_bytes=0, protect_s=3600)
    first, second = src_file(tmp_path, "a0", 4000), src_file(tmp_path, "a1", 4000)
    others = [src_file(tmp_path, f"b{i}", 4000) for i in range(64)]
    assert not a.get(first).hit  # takes the lock: room for it and one page in advance
    real_copy = cache_mod._copy
    b_fills: list = []
    started = []

    def copy_while_b_fills(fin, fout):
        if not started:  # once, in a's fill: b fills everything meanwhile
            started.append(True)
            b_fills.extend(b.get(f) for f in others)
        return real_copy(fin, fout)

    monkeypatch.setattr(cache_mod, "_copy", copy_while_b_fills)
    got = a.get(second)  # on the page taken in advance
    # b filled the cache, a's page included: its last fill scanned, and the recount left out what a
    # had taken in advance (a's file was not in place yet).
    assert sum(not f.bypassed for f in b_fills) == 63
    assert got.bypassed and got.path == second.path  # a found no room left for it
    on_disk = sum(disk_bytes(os.path.getsize(os.path.join(d, f)))
                  for d, _, fs in os.walk(a.base / "objects") for f in fs)
    assert on_disk <= cap
    assert a.usage_bytes() <= cap
    assert not os.listdir(a.base / "tmp")


def test_cache_fills_take_room_in_advance_and_a_scan_voids_it(tmp_path, monkeypatch):
    root = tmp_path / "c"
    a = FileCache(root, capacity_bytes=64 * 16 * 4096, free_floor_bytes=0, protect_s=0)  # 16-page credit
    locks = []
    real = FileCache._locked
    monkeypatch.setattr(FileCache, "_locked", lambda self: locks.append(self) or real(self))
    files = [src_file(tmp_path, f"f{i}", 4000) for i in range(40)]
    for f in files[:16]:
        assert not a.get(f).hit
    assert len(locks) == 1  # one reservation for 16 fills
    # Another process (here: another instance) scans: `usage` is recounted from disk, which leaves
    # a's unused credit out, so a must not fill on it any more.
    b = FileCache(root, capacity_bytes=a.capacity_bytes, free_floor_bytes=0, protect_s=0)
    (root / "v1" / "usage").write_text("garbage")
    assert b.usage_bytes() == 16 * 4096
    a._credit += 4096  # what a still holds
    locks.clear()
    assert not a.get(files[16]).hit
    assert locks  # went back to the lock and took fresh room
    assert a.usage_bytes() <= a.capacity_bytes


def test_the_free_space_floor_holds_for_fills_on_room_taken_in_advance(tmp_path, monkeypatch):
    """Room taken in advance skips the lock, not the floor: once another program has filled the
    disk below it, the next fill is bypassed even though the process still holds credit."""
    cache = FileCache(tmp_path / "c", capacity_bytes=1 << 30, free_floor_bytes=1 << 30)
    free = [10 << 30]
    monkeypatch.setattr(FileCache, "_free_bytes", lambda self: free[0])
    assert not cache.get(src_file(tmp_path, "a", 4000)).bypassed  # takes room in advance
    assert cache._credit >= 4096
    free[0] = (1 << 30) - 1
    got = cache.get(src_file(tmp_path, "b", 4000))
    assert got.bypassed and got.path.endswith("/src/b")
    free[0] = 10 << 30  # room again: fills resume
    assert not cache.get(src_file(tmp_path, "c", 4000)).bypassed


def test_a_listing_travels_between_ranks_intact():
    """What rank 0 publishes for the others (torchio._agree) decodes to the same entries, whatever
    the names hold; and outside a process group nothing is published or awaited."""
    from torchio import _agree

    entries = [("a b/new\nline.bin", 0, 1), (os.fsdecode(b"caf\xe9.bin"), 2**40, 1_700_000_000_123_456_789),
               ("z.bin", 7, 0)]
    assert _agree._decode(_agree._encode(entries)) == entries
    assert _agree._decode(_agree._encode([])) == []
    assert _agree.names_digest(["a", "bc"]) != _agree.names_digest(["ab", "c"])
    assert _agree.rank0_listing("root\0*\0True", entries) is None


def test_a_store_this_process_cannot_reach_switches_direct_fills_off(monkeypatch):
    """Direct fills fall back to the mount. An endpoint only the daemon can reach (another network
    namespace, a proxy) used to cost every file 5 refused connections with backoff, 1-2 s each."""
    from torchio._direct import DirectSource

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    vols = {"c/s/v": {"bucket": "b", "prefix": "p/", "endpoint_url": f"http://127.0.0.1:{port}",
                      "region": "us-east-1", "profile": None, "path_style": True, "payload_signing": False}}
    src = DirectSource("/Volumes", vols, 1)
    whole_second = 1_700_000_000 * 1_000_000_000
    assert src.fetch("/Volumes/c/s/v/a.bin", 100, whole_second) is None
    t0 = time.monotonic()
    for i in range(3):
        assert src.fetch(f"/Volumes/c/s/v/f{i}.bin", 100, whole_second) is None
    assert time.monotonic() - t0 < 0.1


def test_export_table_without_pyarrow_says_which_extra_to_install(monkeypatch):
    import sys

    import torchio

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed
    for mod in [m for m in sys.modules if m == "torchio.tables" or m.startswith("pyarrow.")]:
        monkeypatch.delitem(sys.modules, mod)
    if "export_table" in vars(torchio):  # imported by an earlier test (getattr would import it again)
        monkeypatch.delitem(vars(torchio), "export_table")
    with pytest.raises(ModuleNotFoundError, match=r"needs pyarrow.*pip install 'ucfs\[tables\]'"):
        torchio.export_table
