"""The read path through a real mount against a real S3 server (README "Semantics": Namespace, Reads).

Objects are put with a separate boto3 client; the mount is checked with os, shutil and coreutils.
"""

from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import os
import random
import subprocess
import time

import pytest

from tests.support import obj, sync_dir, wait_until
from ucfs.config import MountConfig

MiB = 1 << 20


def put_many(s3, bucket, items: dict[str, bytes], threads: int = 32) -> None:
    with concurrent.futures.ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda kv: s3.put_object(Bucket=bucket, Key=kv[0], Body=kv[1]), items.items()))


def test_synthetic_levels_list_only_registered_volumes(mount_factory, prefix):
    m = mount_factory({"main.default.raw": {"prefix": f"{prefix}/a"},
                       "main.default.clean": {"prefix": f"{prefix}/b"},
                       "main.other.x": {"prefix": f"{prefix}/c"},
                       "lab.s.y": {"prefix": f"{prefix}/d"}})
    root = m.mountpoint
    assert sorted(os.listdir(root)) == ["lab", "main"]
    assert sorted(os.listdir(root / "main")) == ["default", "other"]
    assert sorted(os.listdir(root / "main" / "default")) == ["clean", "raw"]
    assert os.listdir(root / "main" / "default" / "raw") == []  # registered, still empty
    for p in ["nope", "main/nope", "main/default/nope", "lab/default", "main/default/raw2"]:
        with pytest.raises(FileNotFoundError):
            os.stat(root / p)
    # The synthetic levels are read-only.
    with pytest.raises(OSError) as e:
        os.mkdir(root / "main" / "newschema")
    assert e.value.errno in (errno.EROFS, errno.EACCES, errno.EPERM)


def test_nested_and_empty_directories(mount, s3, bucket, prefix):
    base = f"{prefix}/vol/"
    put_many(s3, bucket, {base + "a/b/c/deep.txt": b"deep", base + "a/top.txt": b"top",
                          base + "a/b/mid.txt": b"mid", base + "root.txt": b"root",
                          base + "empty/": b""})  # a directory marker: an empty directory
    v = mount.path()
    assert sorted(os.listdir(v)) == ["a", "empty", "root.txt"]
    assert sorted(os.listdir(v / "a")) == ["b", "top.txt"]
    assert sorted(os.listdir(v / "a" / "b")) == ["c", "mid.txt"]
    assert os.listdir(v / "empty") == []
    assert (v / "a" / "b" / "c" / "deep.txt").read_bytes() == b"deep"
    assert os.path.isdir(v / "a" / "b" / "c")
    st = os.stat(v / "a" / "top.txt")
    assert st.st_size == 3 and not os.path.isdir(v / "a" / "top.txt")
    # ls -l and find agree with the store.
    out = subprocess.run(["find", str(v), "-type", "f"], capture_output=True, text=True, check=True).stdout
    assert sorted(p[len(str(v)) + 1:] for p in out.split()) == ["a/b/c/deep.txt", "a/b/mid.txt", "a/top.txt",
                                                                 "root.txt"]


def test_listing_past_one_page(mount, s3, bucket, prefix):
    names = [f"f{i:05d}.bin" for i in range(2345)]
    put_many(s3, bucket, {f"{prefix}/vol/big/{n}": n.encode() for n in names})
    d = mount.path() / "big"
    assert sorted(os.listdir(d)) == names
    out = subprocess.run(["ls", "-l", str(d)], capture_output=True, text=True, check=True).stdout
    assert len([line for line in out.splitlines() if line.startswith("-")]) == len(names)
    assert (d / names[-1]).read_bytes() == names[-1].encode()


# Keys as other tools write them: what S3 allows in a key, the mount lists and reads back by name.
ODD_NAMES = ["with space.txt", "pct%41.txt", "plus+sign.txt", "ünïcødé.txt", "tilde~x", "hash#q?a&b=c",
             "semi;colon", "star*", "quote'\"", "back\\slash", "emoji😀", "tab\tname", "nl\nname",
             "cr\rname", "lt<gt>amp&"]


@pytest.mark.parametrize("names", [ODD_NAMES, ["plain.txt", "ctl\x01name"]], ids=["printable", "control"])
def test_keys_with_unusual_characters_list_and_read_back(mount, s3, bucket, prefix, names):
    """A control character cannot travel in a LIST answer's XML as it is (XML 1.0 has no way to
    write it): the listing asks for URL-encoded names, as boto3 does, or one such key would make its
    whole directory unreadable."""
    keys = [f"{prefix}/vol/odd/{n}" for n in names]
    try:
        for i, k in enumerate(keys):
            s3.put_object(Bucket=bucket, Key=k, Body=f"body {i}".encode())
        d = mount.path() / "odd"
        assert sorted(os.listdir(d)) == sorted(names)
        for i, n in enumerate(names):
            assert (d / n).read_bytes() == f"body {i}".encode(), n
    finally:
        for k in keys:  # one at a time: DeleteObjects cannot carry some of these names in its XML
            s3.delete_object(Bucket=bucket, Key=k)


def test_whole_ranged_and_random_offset_reads_match(mount, s3, bucket, prefix):
    data = os.urandom(40 * MiB + 12345)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/obj.bin", Body=data)
    p = mount.path() / "obj.bin"
    assert p.read_bytes() == data
    rng = random.Random(1)
    with open(p, "rb", buffering=0) as f:
        for _ in range(200):
            off = rng.randrange(0, len(data))
            n = rng.choice([1, 17, 4096, 100_000, 3 * MiB])
            assert os.pread(f.fileno(), n, off) == data[off:off + n]
        assert os.pread(f.fileno(), 10, len(data)) == b""  # at EOF
        assert os.pread(f.fileno(), 100, len(data) - 5) == data[-5:]
    # dd with skip/count: a ranged read the way shell users do it.
    out = subprocess.run(["dd", f"if={p}", "bs=4096", "skip=1000", "count=3", "status=none"],
                         capture_output=True, check=True).stdout
    assert out == data[4096 * 1000:4096 * 1003]


def test_dd_and_cp_copy_byte_for_byte(mount, s3, bucket, prefix, tmp_path):
    data = os.urandom(9 * MiB + 7)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/d/x.bin", Body=data)
    subprocess.run(["cp", str(mount.path() / "d" / "x.bin"), str(tmp_path / "copy")], check=True)
    assert (tmp_path / "copy").read_bytes() == data
    out = subprocess.run(["dd", f"if={mount.path() / 'd' / 'x.bin'}", "bs=1M", "status=none"],
                         capture_output=True, check=True).stdout
    assert out == data


@pytest.mark.parametrize("pt", [(), ("--no-passthrough",)], ids=["passthrough", "no-passthrough"])
def test_closing_a_file_read_from_the_store_costs_no_round_trip(mount_factory, s3, bucket, prefix, pt):
    """cp, cat and a data loader close every file they read. Such a close has nothing to do in the
    daemon, so the kernel is told not to ask (FOPEN_NOFLUSH): 200 files read and closed, 50 of them
    again by cat, and no FLUSH request. A written file's close still reaches the daemon, which
    commits it."""
    base = f"{prefix}/vol/small/"
    put_many(s3, bucket, {f"{base}{i:03d}.bin": os.urandom(1000 + i) for i in range(200)})
    mount = mount_factory(args=pt)
    v = mount.path() / "small"
    before = mount.status()["core"].get("flushes", 0)
    for i in range(200):
        assert len((v / f"{i:03d}.bin").read_bytes()) == 1000 + i
    subprocess.run(["cat", *sorted(map(str, v.iterdir()))[:50]], check=True, stdout=subprocess.DEVNULL)
    st = mount.status()
    assert st["core"].get("flushes", 0) == before
    assert st["passthrough"]["noflush_opens"] >= 250 and st["passthrough"]["grants_waiting"] == 0
    (v / "new.bin").write_bytes(b"written")
    assert mount.status()["core"].get("flushes", 0) > before
    sync_dir(v)
    assert obj(s3, bucket, f"{base}new.bin") == b"written"


def test_files_read_64_at_a_time_match_and_queued_requests_are_taken_at_once(mount, s3, bucket, prefix):
    """64 readers at once keep requests queued in the kernel: the daemon's worker tasks take those
    without a trip through the event loop's poller (ucfs.fusewait), and every byte still matches."""
    files = {f"{prefix}/vol/many/{i:03d}.bin": os.urandom(4096 + 37 * i) for i in range(300)}
    put_many(s3, bucket, files)
    v = mount.path() / "many"
    before = mount.status()["core"].get("fuse_requests_ready", 0)
    with concurrent.futures.ThreadPoolExecutor(64) as ex:
        got = dict(ex.map(lambda key: (key, (v / key.rsplit("/", 1)[1]).read_bytes()), files))
    assert got == files
    assert mount.status()["core"].get("fuse_requests_ready", 0) > before


def test_a_file_opened_as_soon_as_the_mount_is_ready_is_read_in_large_requests(mount_factory, s3, bucket,
                                                                                 prefix):
    """The kernel gives a file the mount's read-ahead when it is opened, for as long as it stays open,
    and the daemon can only raise it once the kernel has taken its FUSE_INIT reply. A reader starting
    the moment the mount is ready must get the large requests, not the kernel's default 128 KiB.

    As root (as here) the mount asks for reads of a whole part (8 MiB, fs.fuse.max_pages_limit raised
    where lower); those straddle the buffers of two ranged GETs, and are answered in pieces (vectored)
    with every byte in place."""
    data = os.urandom(40 * MiB + 5)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/seq.bin", Body=data)
    m = mount_factory()  # returns at once when the mount says it is ready
    kernel = m.status()["kernel"]
    assert kernel == {"read_request_bytes": 8 * MiB, "readahead_kib": 8192}, kernel
    dev = os.stat(m.mountpoint).st_dev
    with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb") as f:
        assert int(f.read()) == 8192  # MountConfig.kernel_readahead_kib
    out = subprocess.run(["dd", f"if={m.path() / 'seq.bin'}", "bs=1M", "status=none"], capture_output=True,
                         check=True).stdout
    assert hashlib.sha256(out).hexdigest() == hashlib.sha256(data).hexdigest()
    status = m.status()
    reads = status["core"]["reads"]
    # 2, 4 and then 8 MiB at a time as the kernel's read-ahead ramps up: 7 requests, not 41 or 321.
    assert reads <= 9, f"{reads} read requests for 40 MiB: the kernel read ahead in small pieces"
    assert status["passthrough"]["vectored_replies"] >= 1, status["passthrough"]


def test_the_first_cold_read_after_a_mount_maps_no_buffer_of_its_own(mount, s3, bucket, prefix):
    """A mount makes the part buffers of one stream at its full window as it starts, pages faulted
    in, before it says it is ready (BufferPool.prefill): its first cold read then receives every
    ranged GET into memory that is already there, as every later one does."""
    data = os.urandom(96 * MiB)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/first.bin", Body=data)
    cfg, status = MountConfig(), mount.status()
    parts = len(data) // cfg.part_bytes
    assert cfg.prefill_buffers >= cfg.readahead_max_bytes // cfg.part_bytes
    assert status["buffers_prefilled"] == status["buffers_idle"] == cfg.prefill_buffers, status
    gets = mount.store_stats().get("get", 0)
    out = subprocess.run(["dd", f"if={mount.path() / 'first.bin'}", "bs=1M", "status=none"],
                         capture_output=True, check=True).stdout
    assert hashlib.sha256(out).hexdigest() == hashlib.sha256(data).hexdigest()
    status = mount.status()
    assert mount.store_stats().get("get", 0) - gets >= parts
    assert status["buffers_mapped"] == 0, {k: v for k, v in status.items() if k.startswith("buffers_")}
    assert status["buffers_reused"] >= parts - 1


@pytest.mark.slow
def test_large_object_sha256(mount, s3, bucket, prefix):
    size = 256 * MiB + 3
    h = hashlib.sha256()
    chunk = os.urandom(8 * MiB)
    mp = s3.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/vol/large.bin")
    parts, sent, n = [], 0, 1
    while sent < size:
        body = chunk[: min(len(chunk), size - sent)] if size - sent < len(chunk) else chunk
        body = bytes([n % 256]) + body[1:]
        h.update(body)
        r = s3.upload_part(Bucket=bucket, Key=f"{prefix}/vol/large.bin", UploadId=mp["UploadId"],
                           PartNumber=n, Body=body)
        parts.append({"PartNumber": n, "ETag": r["ETag"]})
        sent += len(body)
        n += 1
    s3.complete_multipart_upload(Bucket=bucket, Key=f"{prefix}/vol/large.bin", UploadId=mp["UploadId"],
                                 MultipartUpload={"Parts": parts})
    out = subprocess.run(["sha256sum", str(mount.path() / "large.bin")], capture_output=True, text=True,
                         check=True).stdout
    assert out.split()[0] == h.hexdigest()
    assert os.stat(mount.path() / "large.bin").st_size == size
    # Every GET buffer went back to the pool once read, none thrown away because the read that let
    # it go was still answering with a view of it (prefetch: _let_go_after_reply): a cold read then
    # faults in only as many fresh buffers as it has in use at once.
    status = mount.status()
    assert status["buffers_discarded"] == 0, {k: status[k] for k in ("buffers_reused", "buffers_discarded")}


def test_processes_reading_one_cold_file_together_fetch_it_once(mount, s3, bucket, prefix):
    """Ranks on one host loading the same weights: the kernel's page cache is shared, but each open
    file read ahead for itself, and the store sent parts of the file more than once (four `dd` of
    one cold 256 MiB file: 378 MiB)."""
    data = os.urandom(96 * MiB)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/weights.bin", Body=data)
    path = mount.path() / "weights.bin"
    os.stat(path)
    before = mount.store_stats().get("get_bytes", 0)
    readers = [subprocess.Popen(["sha256sum", str(path)], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    sums = [p.communicate(timeout=120)[0].split()[0] for p in readers]
    assert sums == [hashlib.sha256(data).hexdigest()] * 4
    fetched = mount.store_stats().get("get_bytes", 0) - before
    assert fetched == len(data), f"{fetched / MiB:.0f} MiB fetched for a {len(data) // MiB} MiB file"


def test_reread_after_remount_makes_zero_gets(mount, s3, bucket, prefix, store_requests):
    data = os.urandom(30 * MiB)
    small = {f"{prefix}/vol/s/{i}.bin": os.urandom(150 * 1024) for i in range(20)}
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/big.bin", Body=data)
    put_many(s3, bucket, small)
    v = mount.path()
    assert (v / "big.bin").read_bytes() == data
    for k, body in small.items():
        assert (v / "s" / k.rsplit("/", 1)[1]).read_bytes() == body
    assert mount.store_stats().get("get", 0) >= 21
    assert wait_until(lambda: store_requests.object_gets() >= 21, 5)  # the count below sees this mount's GETs
    mount.stop()
    mount.start()
    server_before = store_requests.object_gets()
    assert (v / "big.bin").read_bytes() == data
    for k, body in small.items():
        assert (v / "s" / k.rsplit("/", 1)[1]).read_bytes() == body
    assert mount.store_stats().get("get", 0) == 0  # every byte came from the disk cache
    assert mount.status()["cache"]["hits"] >= 30 + 20
    assert store_requests.object_gets() == server_before  # and the server agrees


def test_what_was_read_before_mv_is_read_from_the_cache_after_it(mount, s3, bucket, prefix, store_requests):
    """`mv` of a file, and of a directory, that was read: the store copies the objects, and their
    cached blocks become the copies' - not deleted with the old names and fetched again. A remount
    (no kernel page cache left) then reads every byte from the disk cache."""
    files = {"weights.bin": os.urandom(20 * MiB + 7), "d/a.bin": os.urandom(3 * MiB), "d/b.bin": b"small"}
    put_many(s3, bucket, {f"{prefix}/vol/{k}": body for k, body in files.items()})
    key = f"{prefix}/vol/parts.bin"  # uploaded in parts: AWS gives its copy another ETag (RGW does not)
    body = os.urandom(12 * MiB)
    up = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    etags = [s3.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=n, Body=body[off:off + 6 * MiB])["ETag"]
             for n, off in ((1, 0), (2, 6 * MiB))]
    s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up, MultipartUpload={
        "Parts": [{"PartNumber": n, "ETag": e} for n, e in zip((1, 2), etags)]})
    files["parts.bin"] = body
    v = mount.path()
    for name, data in files.items():
        assert (v / name).read_bytes() == data
    os.rename(v / "weights.bin", v / "final.bin")
    os.rename(v / "parts.bin", v / "parts2.bin")
    os.rename(v / "d", v / "e")
    moved = {"final.bin": files["weights.bin"], "parts2.bin": body,
             "e/a.bin": files["d/a.bin"], "e/b.bin": files["d/b.bin"]}
    cached = sum(len(d) for d in moved.values())
    assert wait_until(lambda: mount.status()["core"].get("cache_bytes_moved", 0) >= cached, 10), mount.status()["core"]
    mount.stop()
    mount.start()
    server_before = store_requests.object_gets()
    for name, data in moved.items():
        assert (v / name).read_bytes() == data
    assert mount.store_stats().get("get", 0) == 0, mount.store_stats()
    assert store_requests.object_gets() == server_before
    for gone in ("weights.bin", "parts.bin", "d/a.bin"):
        assert not (v / gone).exists()


def test_a_file_renamed_while_open_after_its_fsync_keeps_its_cached_blocks(mount_factory, store_requests):
    """The same for a file written here and still open: the fsync committed it and cached it, and
    the rename copies the committed object on the server (--no-passthrough: a passthrough writer's
    close counts as a change, and would upload it again under the new name)."""
    mount = mount_factory(args=("--no-passthrough",))
    v = mount.path()
    data = os.urandom(24 * MiB)
    with open(v / "tmp.bin", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        assert wait_until(lambda: mount.status()["cache"]["used_bytes"] >= len(data), 10), mount.status()["cache"]
        os.rename(v / "tmp.bin", v / "final.bin")
    assert mount.status()["commits"].get("copied_for_rename", 0) == 1, mount.status()["commits"]
    assert wait_until(lambda: mount.status()["core"].get("cache_bytes_moved", 0) >= len(data), 10), \
        mount.status()["core"]
    mount.stop()
    mount.start()
    server_before = store_requests.object_gets()
    assert (v / "final.bin").read_bytes() == data
    assert mount.store_stats().get("get", 0) == 0, mount.store_stats()
    assert store_requests.object_gets() == server_before


def test_remote_changes_are_seen_within_the_ttl(mount, s3, bucket, prefix):
    key = f"{prefix}/vol/live.txt"
    s3.put_object(Bucket=bucket, Key=key, Body=b"version one")
    p = mount.path() / "live.txt"
    assert p.read_bytes() == b"version one"
    assert p.read_bytes() == b"version one"  # served by the kernel page cache now

    # Overwritten elsewhere, same length: no stale bytes from any cache once the change is visible.
    s3.put_object(Bucket=bucket, Key=key, Body=b"version two")
    t0 = time.monotonic()
    assert wait_until(lambda: p.read_bytes() == b"version two", timeout=5)
    assert time.monotonic() - t0 <= 1.0 + 0.5  # TTL 1 s, plus scheduling slack

    # Overwritten with a different size.
    s3.put_object(Bucket=bucket, Key=key, Body=b"version three, longer")
    assert wait_until(lambda: p.read_bytes() == b"version three, longer", timeout=3)

    # Created elsewhere.
    new = mount.path() / "new.txt"
    assert not new.exists()
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/new.txt", Body=b"hello")
    t0 = time.monotonic()
    assert wait_until(new.exists, timeout=5)
    assert time.monotonic() - t0 <= 1.5
    assert "new.txt" in os.listdir(mount.path())

    # Deleted elsewhere.
    s3.delete_object(Bucket=bucket, Key=key)
    t0 = time.monotonic()
    assert wait_until(lambda: not p.exists(), timeout=5)
    assert time.monotonic() - t0 <= 1.5
    assert "live.txt" not in os.listdir(mount.path())
    with pytest.raises(FileNotFoundError):
        open(p, "rb")


def test_an_older_directory_listing_never_brings_back_an_older_version(mount, s3, bucket, prefix):
    """Once this host has seen a change, answers the store gave before it (a directory handle's
    listing taken earlier, a LIST sent before the HEAD that saw the change) must not put the old
    version back: the next open would read it from the disk cache."""
    key = f"{prefix}/vol/d/f.bin"
    v1, v2 = b"1" * 100_000, b"2" * 100_000
    s3.put_object(Bucket=bucket, Key=key, Body=v1)
    d = mount.path() / "d"
    assert os.listdir(d) == ["f.bin"]
    fd = os.open(d / "f.bin", os.O_RDONLY)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)  # opendir: a snapshot of the listing (v1)
    try:
        assert os.pread(fd, len(v1), 0) == v1  # v1 is now in the disk cache
        s3.put_object(Bucket=bucket, Key=key, Body=v2)
        time.sleep(1.3)  # past the metadata TTL
        os.fstat(fd)  # getattr: a HEAD finds v2
        assert (d / "f.bin").read_bytes() == v2  # the change is visible
        with os.scandir(dfd) as it:  # a slow `ls` or os.walk reading the handle opened before
            assert [e.name for e in it] == ["f.bin"]
        assert (d / "f.bin").read_bytes() == v2, "the old version came back after the new one was seen"
    finally:
        os.close(dfd)
        os.close(fd)


def test_open_handle_keeps_reading_its_version_from_cache(mount, s3, bucket, prefix):
    """Close-to-open: a handle opened before a change finishes the version it opened."""
    key = f"{prefix}/vol/v.bin"
    old = os.urandom(2 * MiB)
    s3.put_object(Bucket=bucket, Key=key, Body=old)
    with open(mount.path() / "v.bin", "rb") as f:
        head = f.read(MiB)
        s3.put_object(Bucket=bucket, Key=key, Body=os.urandom(2 * MiB))
        # The kernel's first request for a 1 MiB read is its first read-ahead window, 2 MiB: the
        # whole file was fetched with it, and is that version's. (Bytes the handle never fetched
        # cannot be had once the object changed: a read of those fails with ESTALE.)
        rest = f.read()
    assert head + rest == old


def test_cache_stays_under_its_limit(mount_factory, s3, bucket, prefix):
    limit = 64 * MiB
    m = mount_factory(args=("--cache-size", str(limit)))
    files = {f"{prefix}/vol/c/{i}.bin": os.urandom(16 * MiB) for i in range(8)}  # twice the limit
    put_many(s3, bucket, files, threads=8)
    for k, body in files.items():
        assert (m.path() / "c" / k.rsplit("/", 1)[1]).read_bytes() == body
    st = m.status()["cache"]
    assert st["used_bytes"] <= limit
    du = subprocess.run(["du", "-sb", str(m.state_dir / "cache")], capture_output=True, text=True,
                        check=True).stdout
    assert int(du.split()[0]) <= limit + 64 * 1024  # directories and the lock file
    assert st["evicted"] > 0


def test_unregistered_paths_do_not_exist(mount):
    for p in ["other", "test/other", "test/s/other", "test/s/vol/../../x"]:
        with pytest.raises(FileNotFoundError):
            os.stat(mount.mountpoint / p)
    with pytest.raises(FileNotFoundError):
        open(mount.mountpoint / "test" / "s" / "nothere" / "f", "rb")


def test_writes_into_a_read_only_volume_fail_with_erofs(mount_factory, s3, bucket, prefix):
    s3.put_object(Bucket=bucket, Key=f"{prefix}/ro/existing.txt", Body=b"keep me")
    m = mount_factory({"test.s.ro": {"prefix": f"{prefix}/ro", "read_only": True}})
    v = m.path("test.s.ro")
    assert (v / "existing.txt").read_bytes() == b"keep me"
    for action in (lambda: open(v / "existing.txt", "wb"), lambda: open(v / "existing.txt", "ab"),
                   lambda: open(v / "new.txt", "wb"), lambda: os.mkdir(v / "d"),
                   lambda: os.unlink(v / "existing.txt"),
                   lambda: os.rename(v / "existing.txt", v / "moved.txt")):
        with pytest.raises(OSError) as e:
            action()
        assert e.value.errno == errno.EROFS
    r = subprocess.run(["touch", str(v / "t.txt")], capture_output=True, text=True)
    assert r.returncode != 0 and "Read-only file system" in r.stderr
    assert s3.get_object(Bucket=bucket, Key=f"{prefix}/ro/existing.txt")["Body"].read() == b"keep me"
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/ro/")
    assert [o["Key"] for o in listed["Contents"]] == [f"{prefix}/ro/existing.txt"]


def test_name_too_long_is_enametoolong(mount):
    with pytest.raises(OSError) as e:
        os.stat(mount.path() / ("x" * 256))
    assert e.value.errno == errno.ENAMETOOLONG
