"""What each process of the multi-process torchio tests does (run by tests/torch/_procs.run_ranks).

Every function takes (rank, world, port, ...) and reports through JSON files in an output directory;
an exception is the test's failure message. Sample files name themselves in their first line, so a
rank can tell which file a local cached path stands for.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from torchio import DataLoader, UCVolumeDataset, UCVolumeReader, UCVolumeWriter


def init_dist(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def sample_name(path: str) -> str:
    with open(path, "rb") as f:
        return f.readline().decode().strip()


def write_json(path: str | os.PathLike, data) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


def mount_gets(mountpoint: str) -> int:
    """Object GETs the mount has sent to its stores so far (from the daemon's status)."""
    from ucfs.control import query

    return sum(s.get("get", 0) for s in query(mountpoint, "status")["stores"].values())


# -- datasets -----------------------------------------------------------------------------------------

def dataset_epochs(rank, world, port, root, cache_dir, mountpoint, out_dir):
    """2 ranks x 2 workers: two shuffled epochs, GETs counted around each; a rerun; pad and drop."""
    init_dist(rank, world, port)
    ds = UCVolumeDataset(root, pattern="*.bin", recursive=False, shuffle=True, seed=1234,
                         cache_dir=cache_dir, free_floor_bytes=0)
    loader = DataLoader(ds, batch_size=3, num_workers=2)
    out = {"epochs": [], "gets": [], "lens": []}
    for epoch in range(2):
        dist.barrier()  # both ranks are between epochs: count, then let them start
        before = mount_gets(mountpoint)
        dist.barrier()
        ds.set_epoch(epoch)
        out["epochs"].append([sample_name(p) for batch in loader for p in batch])
        out["lens"].append(len(ds))
        dist.barrier()  # both ranks done: every GET of this epoch has been made
        out["gets"].append(mount_gets(mountpoint) - before)
    # A rerun with the same seed (a fresh dataset, as a new job builds it) sees the same order.
    again = UCVolumeDataset(root, pattern="*.bin", recursive=False, shuffle=True, seed=1234,
                            cache_dir=cache_dir, free_floor_bytes=0)
    out["rerun_epoch0"] = [sample_name(p) for batch in DataLoader(again, batch_size=3, num_workers=2)
                           for p in batch]
    # 41 files over 2 ranks: padded to 21 each, or cut to 20 each.
    for drop_last in (False, True):
        odd = UCVolumeDataset(root, pattern="*.bin", drop_last=drop_last, cache_dir=cache_dir, free_floor_bytes=0)
        out[f"odd_drop_last_{drop_last}"] = [sample_name(p) for batch in DataLoader(odd, batch_size=4, num_workers=2)
                                             for p in batch]
    write_json(Path(out_dir) / f"rank{rank}.json", out)
    dist.barrier()
    dist.destroy_process_group()


def resume_phase1(rank, world, port, root, cache_dir, out_dir, workers, batches):
    """Consume `batches` batches of epoch 1, save the loader's state, and die (SIGKILL) at once."""
    ds = UCVolumeDataset(root, pattern="*.bin", recursive=False, shuffle=True, seed=99,
                         cache_dir=cache_dir, free_floor_bytes=0)
    loader = DataLoader(ds, batch_size=3, num_workers=workers)
    ds.set_epoch(1)
    it = iter(loader)
    consumed = []
    for _ in range(batches):
        consumed += [sample_name(p) for p in next(it)]
    pids = [w.pid for w in it._workers] if workers else []
    write_json(Path(out_dir) / "phase1.json", {"state": loader.state_dict(), "consumed": consumed,
                                               "worker_pids": pids})
    os.kill(os.getpid(), signal.SIGKILL)


def resume_phase2(rank, world, port, root, cache_dir, out_dir, workers):
    """A new process: load the state and finish the epoch."""
    with open(Path(out_dir) / "phase1.json") as f:
        state = json.load(f)["state"]
    ds = UCVolumeDataset(root, pattern="*.bin", recursive=False, shuffle=True, seed=99,
                         cache_dir=cache_dir, free_floor_bytes=0)
    loader = DataLoader(ds, batch_size=3, num_workers=workers)
    loader.load_state_dict(state)
    ds.set_epoch(1)
    rest = [sample_name(p) for batch in loader for p in batch]
    write_json(Path(out_dir) / "phase2.json", {"rest": rest, "state": loader.state_dict()})


def listing_changes_between_ranks(rank, world, port, root, cache_dir, out_dir):
    """Rank 0 lists; a file is added; only then rank 1 lists. Both must shard rank 0's list."""
    init_dist(rank, world, port)
    ds = UCVolumeDataset(root, cache_dir=cache_dir, free_floor_bytes=0)
    out = {}
    if rank == 0:
        out["listed"] = len(ds.files)
        # A dataset only rank 0 builds (an evaluation set) must not wait for the other ranks.
        out["solo"] = len(UCVolumeDataset(root, pattern="s00*", cache_dir=cache_dir, free_floor_bytes=0).files)
        with open(os.path.join(root, "late.bin"), "wb") as f:
            f.write(b"late.bin\n" + os.urandom(3000))
    dist.barrier()
    if rank == 1:
        out["sees_late"] = os.path.exists(os.path.join(root, "late.bin"))
    out["files"] = [os.path.relpath(p, root) for p in ds.files]
    out["len"] = len(ds)
    out["names"] = [sample_name(p) for batch in DataLoader(ds, batch_size=2, num_workers=2) for p in batch]
    write_json(Path(out_dir) / f"rank{rank}.json", out)
    dist.barrier()


def listing_before_init_process_group(rank, world, port, root, cache_dir, out_dir):
    """Each rank builds the dataset (and so lists) before init_process_group, rank 1 only after a
    file was added. Once the group is up, both must shard rank 0's list."""
    late = os.path.join(root, "late.bin")
    if rank == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(late) and time.monotonic() < deadline:
            time.sleep(0.05)
    ds = UCVolumeDataset(root, cache_dir=cache_dir, free_floor_bytes=0)
    out = {"own": len(ds.files)}
    if rank == 0:
        with open(late, "wb") as f:
            f.write(b"late.bin\n" + os.urandom(3000))
    init_dist(rank, world, port)
    out["files"] = [os.path.relpath(p, root) for p in ds.files]
    out["len"] = len(ds)
    out["names"] = [sample_name(p) for batch in DataLoader(ds, batch_size=2, num_workers=2) for p in batch]
    write_json(Path(out_dir) / f"rank{rank}.json", out)
    dist.barrier()


# -- checkpoints --------------------------------------------------------------------------------------

def make_model(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def train_step(model, optim, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    optim.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optim.step()


def assert_identical(a, b, where="") -> None:
    """Bit-identical nested state: same keys, same tensors (dtype, shape, every bit), same values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                           b.view(-1).view(torch.uint8) if b.numel() else b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


class CheckedWriter(UCVolumeWriter):
    """A writer that, just before `.metadata` is written, checks every shard is already in the store."""

    def __init__(self, path, *, s3_args: dict, bucket: str, key_prefix: str, **kw):
        super().__init__(path, **kw)
        self.s3_args, self.bucket, self.key_prefix = s3_args, bucket, key_prefix

    def finish(self, metadata, results):
        import boto3
        import botocore.config

        s3 = boto3.client("s3", config=botocore.config.Config(s3={"addressing_style": "path"}), **self.s3_args)
        sizes: dict[str, int] = {}
        for wr_list in results:
            for wr in wr_list:
                info = wr.storage_data
                sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
        for rel, size in sizes.items():
            head = s3.head_object(Bucket=self.bucket, Key=f"{self.key_prefix}/{rel}")
            assert head["ContentLength"] >= size, f"{rel} is not complete in the store"
        if dist.is_initialized():  # shards are named __<rank>_<n>.distcp: every rank wrote some
            assert len({rel.split("_")[2] for rel in sizes}) == dist.get_world_size()
        super().finish(metadata, results)


def dcp_round_trip(rank, world, port, volumes, out_dir, s3_args, bucket, vol_key_prefix):
    """save and async_save through this rank's mount; load through another mount ("host"), bit-identical.

    With two ranks each writes through its own mount, as two hosts would. Then the seed examples:
    get_state_dict/set_state_dict, and rank 0 torch.save + torch.load on every rank.
    """
    if world > 1:
        init_dist(rank, world, port)
    mine, other = volumes[rank % len(volumes)], volumes[(rank + 1) % len(volumes)]
    model, optim = make_model(0)
    train_step(model, optim, 1)
    # Every rank holds a tensor of its own too, so every rank writes a shard of its own.
    for mode in ("save", "async_save"):
        ckpt = f"ckpt-{mode}"
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd, f"rank{rank}": torch.full((64, 64), float(rank))}
        writer = CheckedWriter(f"{mine}/{ckpt}", s3_args=s3_args, bucket=bucket, key_prefix=f"{vol_key_prefix}/{ckpt}")
        if mode == "save":
            dcp.save(state, storage_writer=writer)
        else:
            dcp.async_save(state, storage_writer=writer).result()
        if world > 1:
            dist.barrier()
        model2, optim2 = make_model(7)  # different weights, no optimizer state yet
        msd2, osd2 = get_state_dict(model2, optim2)
        loaded = {"model": msd2, "optim": osd2, f"rank{rank}": torch.zeros(64, 64)}
        dcp.load(loaded, storage_reader=UCVolumeReader(f"{other}/{ckpt}"))
        set_state_dict(model2, optim2, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        assert_identical(model.state_dict(), model2.state_dict(), f"{mode}: model")
        assert_identical(optim.state_dict(), optim2.state_dict(), f"{mode}: optimizer")
        assert torch.equal(loaded[f"rank{rank}"], torch.full((64, 64), float(rank)))
        # Training goes on identically from the loaded copy.
        train_step(model, optim, 2)
        train_step(model2, optim2, 2)
        assert_identical(model.state_dict(), model2.state_dict(), f"{mode}: after a step")
    # Monolithic: rank 0 saves (and fsyncs: then another host can read it), every rank loads.
    if rank == 0:
        torch.save(model.state_dict(), f"{mine}/model.pt")
        fd = os.open(f"{mine}/model.pt", os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    if world > 1:
        dist.barrier()
    for vol in (mine, other):
        assert_identical(model.state_dict(), torch.load(f"{vol}/model.pt", weights_only=True), "torch.load")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    write_json(Path(out_dir) / f"rank{rank}.json", {"ok": True})


class DyingWriter(UCVolumeWriter):
    """Rank 1 dies (SIGKILL) right after writing its shards, before the checkpoint is finished."""

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return fut


def dcp_overwrite_then_load_elsewhere(rank, world, port, volumes, out_dir):
    """Two hosts: save step 1, load it on the other host; overwrite with step 2 in the same directory
    and load at once on the other host. Each load must see one whole checkpoint."""
    init_dist(rank, world, port)
    mine, other = volumes[rank], volumes[(rank + 1) % world]
    out = {}
    for step in (1, 2):
        state = {"w": torch.full((256,), float(step)), f"r{rank}": torch.full((8,), float(step)), "step": step}
        dcp.save(state, storage_writer=UCVolumeWriter(f"{mine}/ckpt"))
        got = {"w": torch.zeros(256), f"r{rank}": torch.zeros(8), "step": 0}
        dcp.load(got, storage_reader=UCVolumeReader(f"{other}/ckpt"))
        out[step] = {"step": got["step"], "w": got["w"][0].item(), "mine": got[f"r{rank}"][0].item()}
        dist.barrier()
    write_json(Path(out_dir) / f"rank{rank}.json", out)


def dcp_rank_local_save_after_collective(rank, world, port, volume, out_dir):
    """A collective save leaves a global .metadata; then every rank saves with use_collectives=False,
    and each one's planning removes that .metadata (only one can)."""
    init_dist(rank, world, port)
    dcp.save({f"r{rank}": torch.ones(8)}, storage_writer=UCVolumeWriter(f"{volume}/ckpt"))
    dist.barrier()
    dcp.save({f"r{rank}": torch.ones(8) * 2}, storage_writer=UCVolumeWriter(f"{volume}/ckpt"),
             use_collectives=False)
    write_json(Path(out_dir) / f"rank{rank}.json", {"outcome": "ok"})


def dcp_rank_killed(rank, world, port, volume, out_dir):
    """A complete checkpoint, then a second save into the same directory during which rank 1 dies."""
    init_dist(rank, world, port)
    state = {f"rank{rank}": torch.randn(128, 128), "shared": torch.arange(10)}
    dcp.save(state, storage_writer=UCVolumeWriter(f"{volume}/ckpt"))
    dist.barrier()
    write_json(Path(out_dir) / f"rank{rank}-first.json", {"ok": True})
    outcome = "finished"
    try:
        dcp.save({k: v + 1 for k, v in state.items()}, storage_writer=DyingWriter(f"{volume}/ckpt"))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - the survivor must fail, not finish
        outcome = f"raised {type(e).__name__}"
    write_json(Path(out_dir) / f"rank{rank}.json", {"outcome": outcome})
