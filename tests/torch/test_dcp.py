"""Checkpoints on the mount: torch.distributed.checkpoint with UCVolumeWriter/UCVolumeReader, and the
monolithic torch.save / torch.load route. The store is checked with a separate client: a checkpoint
counts as written only when its `.metadata` is in the store, and then all its shards must be too.
"""

from __future__ import annotations

import json
import os
import time

import pytest

torch = pytest.importorskip("torch")
# Single-process saves and loads are meant: torch.distributed is deliberately not initialised here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

from tests.torch import ranks  # noqa: E402
from tests.torch._procs import run_ranks  # noqa: E402
from torchio import UCVolumeReader, UCVolumeWriter  # noqa: E402


def keys(s3, bucket, prefix) -> list[str]:
    out = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out.extend(o["Key"] for o in page.get("Contents", ()))
    return sorted(out)


def s3_args(endpoint) -> dict:
    return {"endpoint_url": endpoint.url, "aws_access_key_id": endpoint.access_key,
            "aws_secret_access_key": endpoint.secret_key, "region_name": endpoint.region}


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_single_process_round_trip_is_bit_identical(mount, s3, bucket, prefix, mode):
    model, optim = ranks.make_model(0)
    ranks.train_step(model, optim, 1)
    msd, osd = get_state_dict(model, optim)
    path = mount.path() / "ckpt"
    if mode == "save":
        dcp.save({"model": msd, "optim": osd}, storage_writer=UCVolumeWriter(path))
    else:
        dcp.async_save({"model": msd, "optim": osd}, storage_writer=UCVolumeWriter(path)).result()
    # Returned: complete in the store, shard and metadata alike.
    stored = keys(s3, bucket, f"{prefix}/vol/ckpt/")
    assert f"{prefix}/vol/ckpt/.metadata" in stored and any(k.endswith(".distcp") for k in stored)
    assert not any(k.endswith(".tmp") for k in stored)
    model2, optim2 = ranks.make_model(5)
    msd2, osd2 = get_state_dict(model2, optim2)
    loaded = {"model": msd2, "optim": osd2}
    dcp.load(loaded, storage_reader=UCVolumeReader(path))
    set_state_dict(model2, optim2, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    ranks.assert_identical(model.state_dict(), model2.state_dict(), "model")
    ranks.assert_identical(optim.state_dict(), optim2.state_dict(), "optimizer")


@pytest.mark.slow
def test_two_ranks_on_two_hosts_round_trip_and_torch_save(mount_factory, s3_endpoint, bucket, prefix, tmp_path):
    """Rank r writes through mount r (two hosts) and loads through the other one, for save and
    async_save; `.metadata` is written only once every shard of both ranks is in the store."""
    a, b = mount_factory(name="a"), mount_factory(name="b")
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(ranks.dcp_round_trip, 2, [str(a.path()), str(b.path())], str(out), s3_args(s3_endpoint), bucket,
              f"{prefix}/vol")
    assert all(json.loads((out / f"rank{r}.json").read_text())["ok"] for r in range(2))


def test_a_load_right_after_an_overwrite_on_another_host_sees_one_whole_checkpoint(mount_factory, tmp_path):
    """Every rank looks the old .metadata up while planning; the other host's view of it (and of the
    old shards) lasts a TTL. Before dcp.save waited that out, the load got old and new shards mixed,
    silently, or ESTALE."""
    a, b = mount_factory(name="a"), mount_factory(name="b")
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(ranks.dcp_overwrite_then_load_elsewhere, 2, [str(a.path()), str(b.path())], str(out))
    for r in range(2):
        got = json.loads((out / f"rank{r}.json").read_text())
        assert got == {str(s): {"step": s, "w": float(s), "mine": float(s)} for s in (1, 2)}, (r, got)


def test_ranks_saving_without_collectives_over_a_collective_checkpoint(mount, tmp_path):
    """Each rank's planning removes the old global .metadata; the second to get there must not fail.
    (The race lost 3 of 5 first tries.)"""
    for attempt in range(2):
        out = tmp_path / f"out{attempt}"
        out.mkdir()
        run_ranks(ranks.dcp_rank_local_save_after_collective, 2, str(mount.path()), str(out))
        assert all(json.loads((out / f"rank{r}.json").read_text())["outcome"] == "ok" for r in range(2))


@pytest.mark.slow
def test_a_rank_killed_during_save_leaves_no_metadata(mount, s3, bucket, prefix, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    done = run_ranks(ranks.dcp_rank_killed, 2, str(mount.path()), str(out), check=False)
    assert (out / "rank0-first.json").exists() and (out / "rank1-first.json").exists()
    assert done.exitcodes[1] == -9, done.errors  # rank 1 died mid-save
    assert done.exitcodes[0] == 0, done.errors
    assert json.loads((out / "rank0.json").read_text())["outcome"].startswith("raised")
    # The first, complete checkpoint's .metadata went as soon as the second save began to overwrite
    # its shards, and the second save never got to write one.
    stored = keys(s3, bucket, f"{prefix}/vol/ckpt/")
    assert f"{prefix}/vol/ckpt/.metadata" not in stored, stored
    assert any(k.endswith(".distcp") for k in stored)
    assert not os.path.exists(mount.path() / "ckpt" / ".metadata")
    with pytest.raises(CheckpointException, match="metadata"):
        dcp.load({"shared": torch.zeros(10, dtype=torch.long)}, storage_reader=UCVolumeReader(mount.path() / "ckpt"))


@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint:UserWarning")  # the overwrite meant
def test_only_a_save_over_an_earlier_checkpoint_waits_out_other_hosts_views(mount):
    """Into a new directory there is nothing older another host could hold a view of: the save
    returns once its .metadata is in the store (a 34 MB save took 2.0 s, 0.2 s of it saving). Over
    an earlier checkpoint it still returns no sooner than settle_s after planning."""
    path = mount.path() / "step-1"
    first, second = {"w": torch.arange(1000.0)}, {"w": torch.arange(1000.0) * 2}
    t0 = time.monotonic()
    dcp.save(first, storage_writer=UCVolumeWriter(path, settle_s=60))
    assert time.monotonic() - t0 < 30
    t0 = time.monotonic()
    dcp.save(second, storage_writer=UCVolumeWriter(path, settle_s=3))
    assert time.monotonic() - t0 >= 3
    loaded = {"w": torch.zeros(1000)}
    dcp.load(loaded, storage_reader=UCVolumeReader(path))
    assert torch.equal(loaded["w"], second["w"])


def test_loading_a_checkpoint_that_is_not_there_is_file_not_found(mount):
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        UCVolumeReader(mount.path() / "no-such-ckpt", wait_visible_s=0.2)


def test_torch_save_and_load_weights_only_on_the_mount(mount_factory, s3, bucket, prefix):
    a, b = mount_factory(name="a"), mount_factory(name="b")
    model, optim = ranks.make_model(3)
    ranks.train_step(model, optim, 1)
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "step": 7}
    path = a.path() / "sub" / "model.pt"
    path.parent.mkdir()
    torch.save(state, path)
    ranks.assert_identical(state, torch.load(path, weights_only=True), "same host")  # read-your-writes
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # committed: now every host can read it
    os.close(fd)
    assert f"{prefix}/vol/sub/model.pt" in keys(s3, bucket, f"{prefix}/vol/sub/")
    ranks.assert_identical(state, torch.load(b.path() / "sub" / "model.pt", weights_only=True), "other host")
