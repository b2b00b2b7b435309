"""Direct cache fills: UCVolumeDataset GETs listed files straight from the store the mount describes,
and falls back to copying through the mount whenever the store's version is not the listed one."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest

pytest.importorskip("torch")

from tests.torch.ranks import sample_name  # noqa: E402
from torchio import DataLoader, UCVolumeDataset  # noqa: E402
from torchio._direct import DirectSource, find_mountpoint  # noqa: E402
from ucfs.config import mount_descriptor_path  # noqa: E402

N_FILES = 24


@pytest.fixture
def samples(mount, s3, bucket, prefix) -> dict[str, bytes]:
    bodies = {}
    for i in range(N_FILES):
        name = f"s{i:03d}.bin"
        bodies[name] = f"{name}\n".encode() + os.urandom(3000 + 101 * i)
        s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/data/{name}", Body=bodies[name])
    time.sleep(3)  # past the cache's racy window (torchio._cache.RACY_WINDOW_NS): copies are trusted
    return bodies


@pytest.fixture
def credentials(monkeypatch, s3_endpoint):
    """This process holds the same credentials as the mount, as a training job on the host would."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_endpoint.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_endpoint.secret_key)
    monkeypatch.setenv("AWS_REGION", s3_endpoint.region)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_the_mount_describes_its_volumes_without_credentials(mount, s3_endpoint, bucket, prefix):
    mp = find_mountpoint(str(mount.path()))
    assert mp == str(mount.mountpoint)
    path = mount_descriptor_path(mp)
    text = path.read_text()
    doc = json.loads(text)
    assert doc["volumes"]["test/s/vol"]["bucket"] == bucket
    assert doc["volumes"]["test/s/vol"]["prefix"] == f"{prefix}/vol/"
    assert s3_endpoint.secret_key not in text and s3_endpoint.access_key not in text
    src = DirectSource.discover(str(mount.path() / "data"), 4)
    assert src is not None
    assert src.locate(str(mount.path() / "data" / "a" / "b.bin"))[1:] == (bucket, f"{prefix}/vol/data/a/b.bin")
    assert src.locate(str(mount.mountpoint / "test" / "s" / "other" / "x")) is None  # not registered
    mount.stop()
    assert not path.exists()  # a mount that is gone describes nothing


def test_direct_fills_bypass_the_daemon_and_match_the_store(mount, samples, credentials, tmp_path,
                                                            store_requests):
    ds = UCVolumeDataset(mount.path() / "data", cache_dir=tmp_path / "cache", free_floor_bytes=0, direct=True)
    mount_gets, before = mount.store_stats().get("get", 0), store_requests.gets_and_heads()
    loader = DataLoader(ds, batch_size=4, num_workers=2)
    got = [p for batch in loader for p in batch]
    assert sorted(sample_name(p) for p in got) == sorted(samples)
    for p in got:
        with open(p, "rb") as f:
            body = f.read()
        assert body == samples[body.split(b"\n", 1)[0].decode()]
    st = ds.statistics()
    assert st["misses"] == st["direct"] == N_FILES  # every copy was one GET of our own...
    assert mount.store_stats().get("get", 0) == mount_gets  # ...and the daemon fetched nothing
    assert store_requests.gets_and_heads() - before == N_FILES
    # Epoch 2: all hits, nothing asked of anyone.
    before = store_requests.gets_and_heads()
    ds.set_epoch(1)
    assert len([p for batch in loader for p in batch]) == N_FILES
    assert ds.statistics()["direct"] == N_FILES and ds.statistics()["hits"] == N_FILES
    assert store_requests.gets_and_heads() == before


def test_versions_the_store_does_not_hold_are_copied_through_the_mount(mount, samples, credentials, tmp_path, s3,
                                                                        bucket, prefix):
    data = mount.path() / "data"
    local = b"s001.bin\nwritten through the mount on this host"
    with open(data / "s001.bin", "wb") as f:  # staged here; the store may not have it yet
        f.write(local)
    ds = UCVolumeDataset(data, cache_dir=tmp_path / "cache", free_floor_bytes=0, direct=True, io_threads=0)
    listed = {os.path.basename(p) for p in ds.files}
    assert listed == set(samples)
    # Changed in the store after the listing: what the GET returns is not the listed version.
    remote = b"s002.bin\na new version from another host"
    s3.put_object(Bucket=bucket, Key=f"{prefix}/vol/data/s002.bin", Body=remote)
    bodies = {}
    for p in ds:
        with open(p, "rb") as f:
            body = f.read()
        bodies[body.split(b"\n", 1)[0].decode()] = body
    assert bodies["s001.bin"] == local
    assert bodies["s002.bin"] in (samples["s002.bin"], remote)  # one whole version, whichever the mount showed
    assert all(bodies[n] == samples[n] for n in samples if n not in ("s001.bin", "s002.bin"))
    st = ds.statistics()
    assert st["misses"] == N_FILES
    assert st["direct"] <= N_FILES - 1  # s002 never came straight from the store
    assert st["direct"] >= N_FILES - 2


def test_without_credentials_every_file_comes_through_the_mount(mount, samples, monkeypatch, tmp_path, caplog):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    ds = UCVolumeDataset(mount.path() / "data",
                         cache_dir=tmp_path / "cache", free_floor_bytes=0, direct=True, io_threads=0)
    gets = mount.store_stats().get("get", 0)
    with caplog.at_level(logging.WARNING, logger="torchio._direct"):
        names = [sample_name(p) for p in ds]
    assert sorted(names) == sorted(samples)
    assert ds.statistics()["direct"] == 0
    assert mount.store_stats().get("get", 0) - gets == N_FILES
    assert sum("direct fills from the store are off" in r.getMessage() for r in caplog.records) == 1
