"""`python -m torchio.bench` end to end at a small size: the bench that gives issue 4's figures keeps
working, and what it reports is what happened (samples, store GETs, a checkpoint loaded back equal)."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from tests.support import REPO


def test_a_small_torchio_bench_runs_and_reports_every_figure(s3_endpoint, bucket, prefix, tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, "-m", "torchio.bench", "--endpoint", s3_endpoint.url,
         f"--access-key={s3_endpoint.access_key}", f"--secret-key={s3_endpoint.secret_key}",
         "--region", s3_endpoint.region, "--bucket", bucket, "--prefix", f"{prefix}/tb",
         "--files", "40", "--file-size", "20K", "--workers", "1", "--batch-size", "8",
         "--ckpt-size", "24M", "--work-dir", str(tmp_path / "work"), "--json", str(out)],
        capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = {f["name"]: f for f in json.loads(out.read_text())}
    assert set(figures) == {"loader.plain.epoch1", "loader.plain.epoch2", "loader.torchio.epoch1",
                            "loader.torchio.epoch2", "dcp.ceiling.multipart_put", "dcp.save", "dcp.load"}
    assert all(f["value"] > 0 for f in figures.values()), figures
    # The second epoch comes from the local copies: not one request reaches the store.
    assert "store GETs: 0" in figures["loader.torchio.epoch2"]["note"], figures["loader.torchio.epoch2"]
    for name, target in (("loader.torchio.epoch1", 3.0), ("loader.torchio.epoch2", 10.0), ("dcp.save", 0.7)):
        f = figures[name]
        assert f["target"] == target and f["ratio"] > 0 and f["verdict"] in ("PASS", "FAIL"), f
    # Epoch 1 fetched each file once; the checkpoint was saved whole (and loaded back equal, or the
    # bench would have failed).
    assert "40 fetched from the store directly" in figures["loader.torchio.epoch1"]["note"]
    assert figures["dcp.save"]["note"].startswith("25 MB, complete in the store"), figures["dcp.save"]


def test_the_loader_bench_caches_on_a_disk_with_less_free_than_the_datasets_default_floor(tmp_path, monkeypatch):
    """UCVolumeDataset keeps 8 GiB free by default. The bench's cache holds only its own samples, so
    on a disk with less free than that (as CI's sometimes has) it still caches them: with the default
    every file bypassed the cache, and epoch 1 measured reads of the source instead of torchio."""
    from torchio import _cache, bench

    root = tmp_path / "data"
    root.mkdir()
    for i in range(12):
        (root / f"s{i:02d}.bin").write_bytes(bytes([i]) * 4096)
    monkeypatch.setattr(_cache.FileCache, "_free_bytes", lambda self: 2 << 30)
    _, _, n, counts = bench.measure_torchio(str(root), str(tmp_path / "cache"), workers=0, batch=4)
    assert n == 12
    assert counts[0]["bypassed"] == 0 and counts[1]["bypassed"] == 0, counts
    assert len(list((tmp_path / "cache").rglob("*.bin"))) == 12


def test_the_loader_bench_refuses_a_disk_without_room_for_its_samples(tmp_path, monkeypatch):
    from torchio import bench

    monkeypatch.setattr(bench.shutil, "disk_usage", lambda p: types.SimpleNamespace(total=1 << 40, used=0, free=300 << 20))
    bench.check_cache_room(str(tmp_path / "cache"), 40 << 20)  # 40 MiB and the margin fit in 300
    with pytest.raises(bench.BenchError, match=r"needs 356 MiB free .* that disk has 300 MiB"):
        bench.check_cache_room(str(tmp_path / "cache"), 100 << 20)
