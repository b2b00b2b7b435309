"""`python -m torchio.bench` end to end at a small size: the bench that gives issue 4's figures keeps
working, and what it reports is what happened (samples, store GETs, a checkpoint loaded back equal)."""

from __future__ import annotations

import json
import subprocess
import sys

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
