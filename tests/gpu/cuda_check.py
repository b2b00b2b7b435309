"""torchio's CUDA paths, on a machine with a GPU: ``python3 tests/gpu/cuda_check.py [--device cuda]``.

CI has no GPU, so nothing in the test suite moves a tensor to one. This script is what to run where
one is lent. torchio uses the mount only through ordinary file calls, so a local directory stands in
for a volume here (no FUSE, no S3 server, nothing to install beyond torch); what it checks is the
GPU side of each path:

  loader     torchio.DataLoader(pin_memory=True) over a UCVolumeDataset of .pt files, with worker
             processes: every batch arrives in pinned memory, is copied to the GPU with
             non_blocking=True, and equals the files' tensors.
  map        torch.load(map_location=<device>) of the local paths the dataset yields (its cache).
  dcp        dcp.save / dcp.load through UCVolumeWriter / UCVolumeReader of a model and its Adam
             state living on the GPU: loaded into GPU tensors, bit-identical, and training goes on.
  async      dcp.async_save of GPU tensors: the checkpoint holds the values of the moment it was
             called although training changes the GPU tensors before it has been written.

``--device cpu`` runs the same logic without a GPU (pinning is then not checked), to try the
script itself. It prints a line per check and ends with a JSON summary; the exit status is 1 if a
check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for torchio

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from torchio import DataLoader, UCVolumeDataset, UCVolumeReader, UCVolumeWriter  # noqa: E402

FILES = 64
ROWS = 256  # each file holds a ROWS x 64 float32 tensor (64 KiB)


def make_files(root: Path) -> dict[str, torch.Tensor]:
    root.mkdir(parents=True)
    out = {}
    g = torch.Generator().manual_seed(1)
    for i in range(FILES):
        t = torch.randn(ROWS, 64, generator=g)
        name = f"shard-{i:03d}.pt"
        torch.save({"name": name, "rows": t}, root / name)  # the cache names files by hash
        out[name] = t
    return out


def load_batch(paths: list[str]) -> tuple[list[str], torch.Tensor]:
    items = [torch.load(p) for p in paths]
    return [i["name"] for i in items], torch.stack([i["rows"] for i in items])


def check_loader(work: Path, device: str, tensors: dict[str, torch.Tensor]) -> str:
    ds = UCVolumeDataset(work / "volume", pattern="*.pt", cache_dir=work / "cache", batch_size=4)
    pin = device == "cuda"
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=load_batch, pin_memory=pin)
    seen, pinned = 0, 0
    for names, batch in loader:
        pinned += int(batch.is_pinned())
        on_device = batch.to(device, non_blocking=True)
        want = torch.stack([tensors[n] for n in names]).to(device)
        if not torch.equal(on_device, want):
            raise AssertionError(f"batch {names} differs from the files after the copy to {device}")
        seen += len(names)
    if seen != FILES:
        raise AssertionError(f"the loader yielded {seen} files of {FILES}")
    if pin and pinned != FILES // 4:
        raise AssertionError(f"{pinned} of {FILES // 4} batches were in pinned memory")
    return f"{seen} files in {FILES // 4} batches" + (", every batch pinned" if pin else "")


def check_map_location(work: Path, device: str, tensors: dict[str, torch.Tensor]) -> str:
    ds = UCVolumeDataset(work / "volume", pattern="*.pt", cache_dir=work / "cache")
    n = 0
    for path in ds:
        item = torch.load(path, map_location=device)
        t = item["rows"]
        if t.device.type != device or not torch.equal(t.cpu(), tensors[item["name"]]):
            raise AssertionError(f"{path}: loaded on {t.device}, or different")
        n += 1
    return f"{n} cached files loaded onto {device}"


def make_model(seed: int, device: str):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).to(device)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, optim


def train_step(model, optim, device: str, seed: int) -> None:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(32, 64, device=device, generator=g)
    loss = model(x).square().mean()
    optim.zero_grad()
    loss.backward()
    optim.step()


def state(model, optim) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def flat(sd, prefix="") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def assert_same(a: dict, b: dict, device: str, what: str) -> int:
    fa, fb = flat(a), flat(b)
    if fa.keys() != fb.keys():
        raise AssertionError(f"{what}: different keys {sorted(fa.keys() ^ fb.keys())[:5]}")
    for k in fa:
        if fb[k].device.type != device and fb[k].dim() > 0:
            raise AssertionError(f"{what}: {k} loaded on {fb[k].device}, not {device}")
        if not torch.equal(fa[k].cpu(), fb[k].cpu()):
            raise AssertionError(f"{what}: {k} differs")
    return len(fa)


def check_dcp(work: Path, device: str) -> str:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, optim = make_model(0, device)
    train_step(model, optim, device, 1)
    saved = state(model, optim)
    dcp.save(saved, storage_writer=UCVolumeWriter(work / "ckpt"))
    model2, optim2 = make_model(7, device)
    loaded = state(model2, optim2)
    dcp.load(loaded, storage_reader=UCVolumeReader(work / "ckpt"))
    n = assert_same(saved, loaded, device, "dcp.load")
    set_state_dict(model2, optim2, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    train_step(model, optim, device, 2)
    train_step(model2, optim2, device, 2)  # both go on alike from the checkpoint
    assert_same(state(model, optim), state(model2, optim2), device, "training after the load")
    return f"{n} tensors saved and loaded on {device}, bit-identical; training continues alike"


def check_async(work: Path, device: str) -> str:
    model, optim = make_model(3, device)
    train_step(model, optim, device, 1)
    at_call = {k: v.detach().clone() for k, v in flat(state(model, optim)).items()}
    t0 = time.monotonic()
    future = dcp.async_save(state(model, optim), storage_writer=UCVolumeWriter(work / "ckpt-async"))
    returned = time.monotonic() - t0
    for step in range(3):  # the GPU tensors change while the checkpoint is written
        train_step(model, optim, device, 10 + step)
    future.result()
    model2, optim2 = make_model(9, device)
    loaded = state(model2, optim2)
    dcp.load(loaded, storage_reader=UCVolumeReader(work / "ckpt-async"))
    got = flat(loaded)
    for k, v in at_call.items():
        if not torch.equal(v.cpu(), got[k].cpu()):
            raise AssertionError(f"async_save: {k} is not the value it had when async_save was called")
    return f"{len(at_call)} tensors as of the call (async_save returned after {returned:.2f} s)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--work-dir", help="default: a temporary directory, removed")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("cuda_check: no CUDA device here (use --device cpu to try the script)", file=sys.stderr)
        return 2
    summary = {"torch": torch.__version__, "device": args.device, "checks": {}}
    if args.device == "cuda":
        summary["gpu"] = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        work = Path(tmp)
        tensors = make_files(work / "volume")
        checks = [("loader", lambda: check_loader(work, args.device, tensors)),
                  ("map", lambda: check_map_location(work, args.device, tensors)),
                  ("dcp", lambda: check_dcp(work, args.device)),
                  ("async", lambda: check_async(work, args.device))]
        for name, fn in checks:
            try:
                line = fn()
                ok = True
            except Exception as e:  # noqa: BLE001 - report every check, then fail
                line = f"{type(e).__name__}: {e}"
                traceback.print_exc()
                ok = False
            summary["checks"][name] = {"ok": ok, "detail": line}
            print(f"cuda_check: {name:6s} {'ok  ' if ok else 'FAIL'} {line}", flush=True)
    print(json.dumps(summary, indent=1))
    return 0 if all(c["ok"] for c in summary["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
