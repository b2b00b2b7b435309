"""UCVolumeDataset and DataLoader end to end: a real mount of the test S3 server, real ranks (gloo) and
real DataLoader workers. Sharding and state arithmetic are covered without a mount in
tests/unit/test_sharding.py; this is what only the mount can show: the store reads, the cache, crashes.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from tests.torch._procs import kill_pids, run_ranks  # noqa: E402
from tests.torch import ranks  # noqa: E402
from tests.torch.ranks import sample_name  # noqa: E402
from torchio import DataLoader, UCVolumeDataset, _shard  # noqa: E402

N_FILES = 40


@pytest.fixture
def samples(mount, s3, bucket, prefix) -> list[str]:
    """40 small files in vol/data/ and one more in vol/data/extra/, put straight into the store."""
    names = [f"s{i:03d}.bin" for i in range(N_FILES)] + ["extra/odd.bin"]
    for i, name in enumerate(names):
        body = f"{name}\n".encode() + os.urandom(2000 + 37 * i)
        s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/data/{name}", Body=body)
    time.sleep(3)  # past the cache's racy window (torchio._cache.RACY_WINDOW_NS)
    return names


def read_json(path):
    with open(path) as f:
        return json.load(f)


@pytest.mark.slow
def test_two_ranks_two_workers_cover_every_file_once_and_epoch_two_reads_nothing(
        mount, samples, tmp_path, store_requests):
    out = tmp_path / "out"
    out.mkdir()
    root = str(mount.path() / "data")
    server_before = store_requests.gets_and_heads()
    run_ranks(ranks.dataset_epochs, 2, root, str(tmp_path / "cache"),
              str(mount.mountpoint), str(out))
    r0, r1 = read_json(out / "rank0.json"), read_json(out / "rank1.json")
    every = set(samples[:N_FILES])
    for epoch in range(2):
        a, b = r0["epochs"][epoch], r1["epochs"][epoch]
        assert len(a) == len(b) == N_FILES // 2 == r0["lens"][epoch]  # equal counts per rank
        assert not set(a) & set(b) and set(a) | set(b) == every  # each file exactly once
        assert len(set(a)) == len(a)
    # Shuffled: each epoch its own order, the one (seed, epoch) fixes for any process and any rerun.
    assert r0["epochs"][0] != r0["epochs"][1]
    assert r0["rerun_epoch0"] == r0["epochs"][0] and r1["rerun_epoch0"] == r1["epochs"][0]
    names = sorted(samples[:N_FILES])
    for epoch in range(2):
        order = _shard.epoch_order(N_FILES, epoch=epoch, seed=1234, shuffle=True)
        assert r0["epochs"][epoch] == [names[i] for i in order[0::2]]
        assert r1["epochs"][epoch] == [names[i] for i in order[1::2]]
    # Epoch 1 fetched every file once through the mount; epoch 2 asked the store for nothing.
    assert r0["gets"][0] >= N_FILES
    assert r0["gets"][1] == 0
    # The server agrees: it answered exactly the GETs the mount counted (40 in epoch 1, and the
    # extra file read at the end), and no HEAD found an object.
    assert store_requests.gets_and_heads() - server_before == mount.store_stats()["get"] == N_FILES + 1
    # 41 files on 2 ranks: padded to 21 each (one file twice), or cut to 20 each (one file left out).
    pad0, pad1 = r0["odd_drop_last_False"], r1["odd_drop_last_False"]
    assert len(pad0) == len(pad1) == 21 and set(pad0) | set(pad1) == set(samples)
    assert sum(Counter(pad0 + pad1).values()) == 42
    drop0, drop1 = r0["odd_drop_last_True"], r1["odd_drop_last_True"]
    assert len(drop0) == len(drop1) == 20 and len(set(drop0) | set(drop1)) == 40


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_killed_mid_epoch_resumes_with_exactly_the_remaining_files(mount, samples, tmp_path, workers):
    out = tmp_path / "out"
    out.mkdir()
    root, cache = str(mount.path() / "data"), str(tmp_path / "cache")
    done = run_ranks(ranks.resume_phase1, 1, root, cache, str(out), workers, 5, check=False)
    assert done.exitcodes == [-9], done.errors  # killed, as a crashed job is
    phase1 = read_json(out / "phase1.json")
    kill_pids(phase1["worker_pids"])  # its orphaned DataLoader workers go with it
    assert len(phase1["consumed"]) == 15 and phase1["state"]["dataset"]["consumed"] == 15
    run_ranks(ranks.resume_phase2, 1, root, cache, str(out), workers)
    phase2 = read_json(out / "phase2.json")
    names = sorted(samples[:N_FILES])
    want = [names[i] for i in _shard.epoch_order(N_FILES, epoch=1, seed=99, shuffle=True)]
    assert phase1["consumed"] + phase2["rest"] == want  # nothing repeated, nothing skipped, same order
    assert phase2["state"]["dataset"]["consumed"] == N_FILES


class Decoded(torch.utils.data.IterableDataset):
    """The ImageDataset pattern: a path dataset wrapped by one that decodes each file into a tensor."""

    def __init__(self, paths):
        self.paths = paths

    def __iter__(self):
        for path in self.paths:
            with open(path, "rb") as f:
                name = f.readline()
                body = f.read()
            yield torch.tensor(int(name[1:4])), torch.frombuffer(bytearray(body[:1000]), dtype=torch.uint8)


def test_a_decoding_dataset_wrapping_the_path_dataset(mount, samples, tmp_path, s3, bucket, prefix):
    ds = UCVolumeDataset(mount.path() / "data", pattern="s*.bin", cache_dir=tmp_path / "cache", free_floor_bytes=0)
    loader = DataLoader(Decoded(ds), batch_size=8, num_workers=2)
    ids, first_bytes = [], {}
    for idx, data in loader:
        assert data.shape[1:] == (1000,)
        ids += idx.tolist()
        for i, row in zip(idx.tolist(), data):
            first_bytes[i] = bytes(row.tolist())
    assert ids == list(range(N_FILES))  # canonical order, each sample once
    body = s3.get_object(Bucket=bucket, Key=f"{prefix}/vol/data/s007.bin")["Body"].read()
    assert first_bytes[7] == body.split(b"\n", 1)[1][:1000]
    st = loader.stats()
    assert st.batches == 5 and st.cache["misses"] == N_FILES


def test_a_changed_file_is_fetched_again_and_the_cache_survives_a_new_run(mount, samples, tmp_path, s3, bucket,
                                                                          prefix):
    cache = tmp_path / "cache"
    first = UCVolumeDataset(mount.path() / "data", pattern="s00*.bin",
                            cache_dir=cache, free_floor_bytes=0, io_threads=0)
    assert [sample_name(p) for p in first] == [f"s00{i}.bin" for i in range(10)]
    gets = mount.store_stats()["get"]
    # A new run (new dataset object) over unchanged files: all hits, nothing read from the store.
    second = UCVolumeDataset(mount.path() / "data", pattern="s00*.bin", cache_dir=cache, free_floor_bytes=0)
    assert len(list(second)) == 10 and second.statistics()["hits"] == 10
    assert mount.store_stats()["get"] == gets
    # Another writer replaces a file in the store: once the mount shows it, the cache misses.
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/data/s003.bin", Body=b"s003.bin\nv2")
    time.sleep(1.5)  # the mount's metadata TTL
    third = UCVolumeDataset(mount.path() / "data", pattern="s00*.bin", cache_dir=cache, free_floor_bytes=0)
    paths = list(third)
    assert third.statistics()["misses"] == 1 and open(paths[3], "rb").read() == b"s003.bin\nv2"


# --------------------------------------------------------------------------------------------------
# Listing changes, stale copies, abandoned passes


def test_ranks_shard_rank0s_listing_when_the_directory_changes_between_their_listings(mount, samples,
                                                                                       tmp_path):
    """A file added after rank 0 listed but before rank 1 did: without agreement rank 1 would have 42
    files to rank 0's 41, different shard sizes, and a DDP job would hang at its next collective."""
    out = tmp_path / "out"
    out.mkdir()
    root = str(mount.path() / "data")
    run_ranks(ranks.listing_changes_between_ranks, 2, root, str(tmp_path / "cache"), str(out))
    r0, r1 = read_json(out / "rank0.json"), read_json(out / "rank1.json")
    assert r0["listed"] == len(samples) and r0["solo"] == 10
    assert r1["sees_late"]  # rank 1's own listing had the new file...
    assert r1["files"] == r0["files"] and "late.bin" not in r0["files"]  # ...but it shards rank 0's
    assert r0["len"] == r1["len"] == 21 == len(r0["names"]) == len(r1["names"])
    assert set(r0["names"]) | set(r1["names"]) == set(samples)


def test_ranks_that_listed_before_init_process_group_shard_rank0s_listing(mount, samples, tmp_path):
    """A dataset lists when it is built; one built before the process group exists cannot share its
    listing then, and must take rank 0's at its first use under the group."""
    out = tmp_path / "out"
    out.mkdir()
    root = str(mount.path() / "data")
    run_ranks(ranks.listing_before_init_process_group, 2, root, str(tmp_path / "cache"), str(out))
    r0, r1 = read_json(out / "rank0.json"), read_json(out / "rank1.json")
    assert r0["own"] == len(samples) and r1["own"] == len(samples) + 1  # rank 1's own list had late.bin
    assert r1["files"] == r0["files"] and "late.bin" not in r0["files"]
    assert r0["len"] == r1["len"] == 21 == len(r0["names"]) == len(r1["names"])
    assert set(r0["names"]) | set(r1["names"]) == set(samples)


def test_refresh_reaches_persistent_workers(mount, s3, bucket, prefix, tmp_path):
    """refresh() makes files added or changed since visible - also to the DataLoader's persistent
    workers (its default), which hold copies of the dataset made when they started."""
    for i in range(6):
        s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/data/s{i:03d}.bin", Body=f"s{i:03d}.bin\nv1".encode())
    ds = UCVolumeDataset(mount.path() / "data", cache_dir=tmp_path / "cache", free_floor_bytes=0)
    loader = DataLoader(ds, batch_size=2, num_workers=1)  # persistent_workers defaults to True
    assert sorted(sample_name(p) for b in loader for p in b) == [f"s{i:03d}.bin" for i in range(6)]
    # Another writer adds a file and changes one (to another size).
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/data/s006.bin", Body=b"s006.bin\nnew")
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/data/s002.bin", Body=b"s002.bin\nversion-2")
    time.sleep(1.5)  # the mount's metadata TTL
    ds.refresh()
    ds.set_epoch(1)
    assert len(ds) == 7
    paths = [p for b in loader for p in b]
    assert sorted(sample_name(p) for p in paths) == [f"s{i:03d}.bin" for i in range(7)]
    by_name = {sample_name(p): p for p in paths}
    with open(by_name["s002.bin"], "rb") as f:
        assert f.read() == b"s002.bin\nversion-2"


def test_a_same_size_rewrite_in_the_same_second_is_not_served_from_the_cache(mount, s3, bucket, prefix,
                                                                             tmp_path):
    """A copy is named by (path, size, mtime), and a stored file's mtime is its Last-Modified in
    whole seconds: two versions of one size written within a second look alike. A copy made while
    that could still happen is not trusted later (git's "racily clean" rule), so it is fetched again."""
    d = mount.path() / "same"
    for attempt in range(5):
        key = f"{prefix}/vol/same/x{attempt}.bin"
        while time.time() % 1 > 0.05:  # start just after a second boundary
            time.sleep(0.005)
        s3.put_object(Bucket=bucket, Key=key, Body=b"version-1")
        first = UCVolumeDataset(d, pattern=f"x{attempt}.bin", cache_dir=tmp_path / "cache",
                                free_floor_bytes=0, io_threads=0)
        assert [open(p, "rb").read() for p in first] == [b"version-1"]
        s3.put_object(Bucket=bucket, Key=key, Body=b"version-2")
        h = s3.head_object(Bucket=bucket, Key=key)
        if int(first._listing()[0].mtime_ns // 1_000_000_000) == int(h["LastModified"].timestamp()):
            break  # both versions carry the same whole-second Last-Modified
    else:
        pytest.skip("could not write two versions within one second")
    time.sleep(1.5)  # the mount's metadata TTL: it shows version 2 now
    assert open(d / f"x{attempt}.bin", "rb").read() == b"version-2"
    second = UCVolumeDataset(d, pattern=f"x{attempt}.bin", cache_dir=tmp_path / "cache",
                             free_floor_bytes=0, io_threads=0)
    assert [open(p, "rb").read() for p in second] == [b"version-2"]


def test_breaking_out_of_a_pass_shuts_its_workers_down_as_torch_does(tmp_path):
    """torch's DataLoader shuts non-persistent workers down once the iterator of an abandoned pass
    (a `break`, a validation loop capped at a few batches) is dropped; torchio's must too, not keep
    them fetching. (A local directory: no mount needed.)"""
    import gc
    import multiprocessing

    root = tmp_path / "data"
    root.mkdir()
    for i in range(40):
        (root / f"f{i:02d}.bin").write_bytes(b"x")
    alive = {}
    for cls in (torch.utils.data.DataLoader, DataLoader):
        ds = UCVolumeDataset(root, cache_dir=tmp_path / "cache", free_floor_bytes=0)
        loader = cls(ds, batch_size=2, num_workers=2, persistent_workers=False)
        for _ in loader:
            break
        gc.collect()
        time.sleep(0.5)
        alive[cls.__module__] = len(multiprocessing.active_children())
        del loader
        gc.collect()
        time.sleep(0.5)
    assert alive == {"torch.utils.data.dataloader": 0, "torchio.loader": 0}


def test_an_abandoned_pass_leaves_no_partial_files_in_the_cache(mount_factory, fault_proxy, s3, bucket, prefix,
                                                                 tmp_path):
    """torch joins the worker of an abandoned pass for 5 s, then terminates it, mid-copy: the copy's
    temporary file stays under tmp/. The next pass removes what processes that are gone left there,
    rather than count it as cache use until a scan an hour later."""
    import gc

    m = mount_factory(endpoint=fault_proxy.endpoint)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/data/a0.bin", Body=b"a0.bin\n")
    for i in range(1, 4):
        s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/data/z{i}.bin", Body=os.urandom(3 << 20))
    cache = tmp_path / "cache"
    ds = UCVolumeDataset(m.path() / "data", cache_dir=cache, free_floor_bytes=0)
    loader = DataLoader(ds, batch_size=1, num_workers=1, persistent_workers=False)
    fault_proxy.stall(12, method="GET", path=r".*/data/z.*", after_bytes=1 << 20)  # slow large files
    it = iter(loader)
    assert sample_name(next(it)[0]) == "a0.bin"
    del it, loader  # abandon the pass
    gc.collect()
    time.sleep(1)
    fault_proxy.clear()
    left = os.listdir(cache / "v1" / "tmp")
    ds2 = UCVolumeDataset(m.path() / "data", pattern="a0.bin", cache_dir=cache, free_floor_bytes=0)
    assert [sample_name(p) for b in DataLoader(ds2, batch_size=1, num_workers=1) for p in b] == ["a0.bin"]
    assert os.listdir(cache / "v1" / "tmp") == [], left

