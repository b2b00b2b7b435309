"""`python -m torchio.bench`: torchio against plain PyTorch on the same mount, and DCP against the store.

Two comparisons, each against a reference measured in the same run on the same store, so the ratio
says what torchio buys, not how fast this host is today:

    loader  N files of S bytes read as training samples, W workers on both sides:
            a plain torch DataLoader over the mounted paths (a map-style dataset that opens and reads
            each path) versus UCVolumeDataset + torchio.DataLoader (same decoding of the local copy),
            which fills its cache with GETs straight from the store the mount describes, using the
            same credentials as the mount (`--no-direct`: every copy through the mount instead).
            targets: torchio epoch 1 >= 3 x faster than plain epoch 1;
                     torchio epoch 2 >= 10 x faster than plain epoch 1 (and makes no store GETs)
    dcp     dcp.save of a state dict of B bytes through UCVolumeWriter (returns when the checkpoint
            is complete in the store) versus a direct multipart upload of B bytes (ucfs.store,
            8 MiB parts, 16 in flight: the mount's own upload shape).
            target: save throughput >= 0.7 x the direct upload

Every request of both sides goes through ucfs's loopback latency proxy (`--latency-ms`, default 10),
run as `python -m ucfs.testing.proxy` in a child process so it never shares a GIL with us. Each
measured side gets its own fresh mount (`python -m ucfs mount`, empty cache), so an epoch 1 is cold
for both. No S3 endpoint given: a throw-away Ceph RGW is started (`python -m ucfs.testing.rgw`).

Sample files stay in the bucket between runs (under a prefix naming their count and size), so a
rerun skips the upload; checkpoints and the ceiling's object are deleted afterwards.

``--path DIR`` instead measures the two loaders over files already under DIR on a running mount
(no proxy, no fresh mounts: remount between runs for a cold epoch 1).

torchio talks to the mount through files and runs ucfs's tools as commands; of ucfs it imports only
`ucfs.store` (the direct uploads) and `ucfs.config` (sizes), as the layering rules ask.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from ucfs.config import MiB, format_size, parse_size

log = logging.getLogger(__name__)

PHASES = ("loader", "dcp")
# The mount's part size and read-ahead depth: the direct upload uses the same shape.
PART_BYTES = 8 * MiB
UPLOAD_PARTS_IN_FLIGHT = 16
# Threads that upload the sample files (setup, not measured).
SETUP_THREADS = 32
# Tensors the checkpoint's state dict is made of: a model's worth of layers, not one giant blob.
CKPT_TENSORS = 16
# Free space the loader's cache leaves on its disk, in place of UCVolumeDataset's default (8 GiB, a
# host's margin for everything else on it). The bench's cache holds only its own sample files and
# goes with the run; with the default, a disk with less than 8 GiB free had every file bypass the
# cache, and epoch 1 measured reads through the mount instead of what torchio does.
BENCH_FREE_FLOOR_BYTES = 256 * MiB


# Workers by default: one per CPU this process may use (more than that, torch's DataLoader itself
# warns that it may run slowly or freeze), and no more than this on a big host.
MAX_BENCH_WORKERS = 8


def default_workers() -> int:
    """torch's suggested maximum of DataLoader workers for this host, capped at MAX_BENCH_WORKERS.

    Both loaders get the same number. On a host with few CPUs, more workers than CPUs would give the
    plain loader extra requests in flight that a real job on that host would not run with."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_BENCH_WORKERS, cpus))


class BenchError(Exception):
    """Something to tell the user in one line."""


def say(msg: str) -> None:
    print(f"torchio bench: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# options


def add_store_arguments(p: argparse.ArgumentParser):
    """The options naming the store a bench runs against; returns their group."""
    g = p.add_argument_group("store")
    g.add_argument("--endpoint", help="S3 endpoint URL (default: start a throw-away Ceph RGW on loopback)")
    g.add_argument("--access-key", default=os.environ.get("AWS_ACCESS_KEY_ID"))
    g.add_argument("--secret-key", default=os.environ.get("AWS_SECRET_ACCESS_KEY"))
    g.add_argument("--region", default=os.environ.get("AWS_REGION") or "us-east-1")
    g.add_argument("--bucket", default="torchio-bench", help="created if missing (default torchio-bench)")
    return g


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m torchio.bench", description=__doc__.split("\n\n")[0])
    g = add_store_arguments(p)
    g.add_argument("--prefix", default="torchio-bench", help="key prefix of the bench's data")
    w = p.add_argument_group("workload")
    w.add_argument("--files", type=int, default=2000, help="sample files (default 2000)")
    w.add_argument("--file-size", default="150K", help="size of each sample file (default 150K)")
    w.add_argument("--workers", type=int, default=default_workers(),
                   help="DataLoader workers, both loaders (default: the CPUs this process may use, at most "
                        f"{MAX_BENCH_WORKERS}; here {default_workers()})")
    w.add_argument("--no-direct", action="store_true",
                   help="UCVolumeDataset copies every file through the mount (no direct fills from the store)")
    w.add_argument("--batch-size", type=int, default=32, help="batch size, both loaders (default 32)")
    w.add_argument("--ckpt-size", default="1G", help="bytes in the checkpointed state dict (default 1G)")
    w.add_argument("--dcp-threads", type=int, default=None,
                   help="files each rank writes in parallel (UCVolumeWriter thread_count; default its own)")
    w.add_argument("--latency-ms", type=float, default=10.0,
                   help="added to every request round trip by a loopback proxy (default 10)")
    r = p.add_argument_group("run")
    r.add_argument("--path", help="measure the loaders over the files under this directory of a running "
                                  "mount instead (no proxy, no store set-up, no dcp)")
    r.add_argument("--skip", default="", help="comma list of phases to skip: " + ", ".join(PHASES))
    r.add_argument("--work-dir", help="mountpoints, caches, logs (default: a temp dir, removed)")
    r.add_argument("--json", dest="json_path", help="also write the figures to this file")
    args = p.parse_args(argv)
    args.file_size = parse_size(args.file_size)
    args.ckpt_size = parse_size(args.ckpt_size)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.skip - set(PHASES):
        p.error(f"--skip: unknown phase(s) {sorted(args.skip - set(PHASES))}; known: {', '.join(PHASES)}")
    if args.files < 1 or args.workers < 0 or args.batch_size < 1:
        p.error("--files and --batch-size must be at least 1, --workers at least 0")
    return args


# --------------------------------------------------------------------------------------------------
# figures


@dataclass
class Figure:
    name: str
    value: float
    unit: str
    reference: float | None = None  # what the value is compared with
    ratio: float | None = None
    target: float | None = None  # the ratio must reach this
    note: str = ""

    @property
    def verdict(self) -> str:
        if self.target is None or self.ratio is None:
            return ""
        return "PASS" if self.ratio >= self.target else "FAIL"


def format_table(figures: list[Figure]) -> str:
    rows = [("figure", "value", "reference", "ratio", "target", "", "note")]
    for f in figures:
        rows.append((f.name, f"{f.value:,.2f} {f.unit}",
                     "" if f.reference is None else f"{f.reference:,.2f} {f.unit}",
                     "" if f.ratio is None else f"{f.ratio:.2f} x",
                     "" if f.target is None else f">= {f.target:g} x", f.verdict, f.note))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# child processes: S3 server, latency proxy, mounts


@dataclass
class Endpoint:
    url: str
    access_key: str | None
    secret_key: str | None
    region: str


class Child:
    """A helper process in its own session, stopped (SIGTERM, then SIGKILL) by `stop`."""

    def __init__(self, argv: list[str], **popen):
        self.proc = subprocess.Popen(argv, start_new_session=True, **popen)

    def stop(self, timeout_s: float = 30) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_rgw(memstore_gib: float) -> tuple[Child, Endpoint]:
    say("no --endpoint: starting a throw-away Ceph RGW on loopback (data in RAM)")
    child = Child([sys.executable, "-m", "ucfs.testing.rgw", "--memstore-gib", f"{memstore_gib:g}"],
                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    env: dict[str, str] = {}
    for line in child.proc.stdout:
        line = line.strip()
        if line.startswith("export "):
            k, _, v = line[len("export "):].partition("=")
            env[k] = v.strip("'\"")
        elif line.startswith("#"):
            break
    if "AWS_ENDPOINT_URL" not in env:
        child.stop()
        raise BenchError("the local RGW did not start (python -m ucfs.testing.rgw; is radosgw installed?)")
    return child, Endpoint(env["AWS_ENDPOINT_URL"], env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"],
                           env.get("AWS_REGION", "us-east-1"))


def start_proxy(target_url: str, delay_ms: float) -> tuple[Child, str]:
    u = urllib.parse.urlsplit(target_url)
    if u.scheme != "http":
        raise BenchError("--latency-ms needs an http:// endpoint (the proxy relays plain TCP on loopback)")
    # stdin is the proxy's lifeline: it exits when we close it, or die.
    child = Child([sys.executable, "-m", "ucfs.testing.proxy", f"{u.hostname}:{u.port or 80}",
                   "--delay-ms", str(delay_ms)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = child.proc.stdout.readline().strip()
    if not line.isdigit():
        child.stop()
        raise BenchError(f"the latency proxy did not start (it said {line!r})")
    return child, f"http://127.0.0.1:{int(line)}"


class Mount:
    """`python -m ucfs mount --foreground` on a fresh mountpoint and cache directory."""

    def __init__(self, work: Path, name: str, catalog: Path, env: dict, discard=None):
        self.discard = discard or (lambda p: shutil.rmtree(p, ignore_errors=True))
        self.mountpoint = work / f"mnt-{name}"
        self.state = work / f"state-{name}"
        self.log = work / f"ucfs-{name}.log"
        self.catalog, self.env = catalog, env
        self.child: Child | None = None

    def __enter__(self) -> "Mount":
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.state, ignore_errors=True)
        with open(self.log, "ab") as logf:
            self.child = Child([sys.executable, "-m", "ucfs", "mount", str(self.mountpoint), "--foreground",
                                "--config", str(self.catalog), "--cache-dir", str(self.state),
                                "--log-level", "info"], stdout=logf, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + 60
        # Ready, not merely mounted: the daemon tunes the kernel's read-ahead for the mount first,
        # and a file opened before that would be read in small requests to its end.
        while not (os.path.ismount(self.mountpoint) and self._status().get("ready")):
            if self.child.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise BenchError(f"ucfs mount did not come up; see {self.log}")
            time.sleep(0.05)
        return self

    def volume(self) -> Path:
        return self.mountpoint / "bench" / "torchio" / "data"

    def _status(self) -> dict:
        """The mount's `ucfs status --json`, or {} while it does not answer."""
        res = subprocess.run([sys.executable, "-m", "ucfs", "status", str(self.mountpoint), "--json"],
                             capture_output=True, text=True, env=self.env)
        try:
            return json.loads(res.stdout)[str(self.mountpoint)]
        except (ValueError, KeyError, TypeError):
            return {}

    def gets(self) -> int:
        """Object GETs this mount has sent (from `ucfs status --json`)."""
        st = self._status()
        if not st:
            return -1
        return sum(s.get("get", 0) for s in st.get("stores", {}).values())

    def __exit__(self, *exc) -> None:
        if self.child is None:
            return
        if self.child.proc.poll() is None and os.path.ismount(self.mountpoint):
            subprocess.run([sys.executable, "-m", "ucfs", "unmount", str(self.mountpoint)], env=self.env,
                           capture_output=True, timeout=600)
        self.child.stop()
        if os.path.ismount(self.mountpoint):  # the daemon is gone but the kernel still has it
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)
        self.child = None
        self.discard(self.state)


# --------------------------------------------------------------------------------------------------
# the two loaders


def _sample(path: str):
    """Decoding a sample: the whole file as a uint8 tensor (the same on both sides)."""
    import torch

    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)


def _plain_dataset(root: str):
    import torch.utils.data

    class MountedFiles(torch.utils.data.Dataset):
        """What a script does without torchio: list the mounted directory, open each path."""

        def __init__(self, root: str):
            self.paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)

        def __len__(self) -> int:
            return len(self.paths)

        def __getitem__(self, i: int):
            return _sample(self.paths[i])

    return MountedFiles(root)


def _decoding(volume_dataset):
    import torch.utils.data

    class Decoded(torch.utils.data.IterableDataset):
        def __init__(self, paths):
            self.paths = paths

        def __iter__(self):
            for p in self.paths:
                yield _sample(p)

    return Decoded(volume_dataset)


def _epoch(loader) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = sum(len(batch) for batch in loader)
    return time.perf_counter() - t0, n


def measure_plain(root: str, workers: int, batch: int) -> tuple[float, float, int]:
    """(epoch 1 s, epoch 2 s, samples) of torch's DataLoader over the mounted paths."""
    import torch.utils.data

    t0 = time.perf_counter()
    loader = torch.utils.data.DataLoader(_plain_dataset(root), batch_size=batch, num_workers=workers)
    listing = time.perf_counter() - t0
    e1, n = _epoch(loader)
    e2, _ = _epoch(loader)
    return listing + e1, e2, n


def check_cache_room(cache_dir: str, nbytes: int) -> None:
    """Refuse to measure a loader cache that cannot hold the sample files: every file would bypass
    it, and the figures would say nothing about torchio."""
    probe = Path(cache_dir)
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    need = nbytes + BENCH_FREE_FLOOR_BYTES
    if free < need:
        raise BenchError(f"the loader's cache under {cache_dir} needs {format_size(need)} free "
                         f"({format_size(nbytes)} of samples and a margin of "
                         f"{format_size(BENCH_FREE_FLOOR_BYTES)}); that disk has {format_size(free)}. "
                         "Free some, or give --work-dir on another disk")


def measure_torchio(root: str, cache_dir: str, workers: int, batch: int, between=None,
                    direct: bool = True) -> tuple[float, float, int, list[dict]]:
    """(epoch 1 s including listing, epoch 2 s, samples, cache counters of each epoch: `direct`
    files fetched from the store itself, `bypassed` files read from the mount for want of room) of
    UCVolumeDataset + torchio.DataLoader."""
    from .dataset import UCVolumeDataset
    from .loader import DataLoader

    t0 = time.perf_counter()
    ds = UCVolumeDataset(root, cache_dir=cache_dir, direct=direct, free_floor_bytes=BENCH_FREE_FLOOR_BYTES)
    loader = DataLoader(_decoding(ds), batch_size=batch, num_workers=workers, log_every_batches=0)
    listing = time.perf_counter() - t0
    e1, n = _epoch(loader)
    after1 = ds.statistics()
    if between is not None:
        between()
    ds.set_epoch(1)
    e2, _ = _epoch(loader)
    after2 = ds.statistics()
    keys = ("direct", "bypassed")
    return listing + e1, e2, n, [{k: int(after1[k]) for k in keys},
                                 {k: int(after2[k] - after1[k]) for k in keys}]


@contextlib.contextmanager
def _credentials(env: dict):
    """This process's AWS settings as the mount's, for the dataset's direct fills."""
    keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_EC2_METADATA_DISABLED")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: env[k] for k in keys if k in env})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def loader_figures(plain: tuple[float, float, int], ours: tuple[float, float, int, list[dict]],
                   epoch2_gets: int | None, files: int, workers: int) -> list[Figure]:
    p1, p2, n = plain
    t1, t2, m, counts = ours
    if n != files or m != files:
        raise BenchError(f"loaders yielded {n} and {m} samples, not {files}")
    w = f"{workers} workers"

    def bypassed(c: dict) -> str:
        # Files the cache had no room for were read from the mount: the epoch measured that instead.
        return f", {c['bypassed']} bypassed the cache (no room)" if c["bypassed"] else ""

    return [
        Figure("loader.plain.epoch1", p1, "s", note=f"{files / p1:,.0f} samples/s, {w}"),
        Figure("loader.plain.epoch2", p2, "s", note=f"{files / p2:,.0f} samples/s (mount cache warm)"),
        Figure("loader.torchio.epoch1", t1, "s", p1, p1 / t1, 3.0, f"{files / t1:,.0f} samples/s, "
               f"{counts[0]['direct']} fetched from the store directly{bypassed(counts[0])}; "
               "ratio: plain epoch 1 / this"),
        Figure("loader.torchio.epoch2", t2, "s", p1, p1 / t2, 10.0, f"{files / t2:,.0f} samples/s"
               + ("" if epoch2_gets is None else f", store GETs: {epoch2_gets}") + bypassed(counts[1])),
    ]


# --------------------------------------------------------------------------------------------------
# checkpoints


def make_state_dict(nbytes: int) -> dict:
    import torch

    per = max(1, nbytes // 4 // CKPT_TENSORS)
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(CKPT_TENSORS)}


def direct_upload(store, bucket: str, key: str, nbytes: int) -> float:
    """Seconds to upload nbytes as one multipart object, parts in parallel (the ceiling)."""
    part = os.urandom(PART_BYTES)
    sizes = [PART_BYTES] * (nbytes // PART_BYTES) + ([nbytes % PART_BYTES] if nbytes % PART_BYTES else [])
    t0 = time.perf_counter()
    upload_id = store.create_multipart(bucket, key)
    with concurrent.futures.ThreadPoolExecutor(UPLOAD_PARTS_IN_FLIGHT) as pool:
        etags = list(pool.map(lambda a: store.upload_part(bucket, key, upload_id, a[0], part[:a[1]], a[1]),
                              enumerate(sizes, 1)))
    store.complete_multipart(bucket, key, upload_id, list(enumerate(etags, 1)))
    return time.perf_counter() - t0


def measure_dcp(volume: Path, state: dict, threads: int | None) -> float:
    import torch.distributed.checkpoint as dcp

    from .dcp import UCVolumeWriter

    kw = {} if threads is None else {"thread_count": threads}
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=UCVolumeWriter(volume / "ckpt", **kw))
    return time.perf_counter() - t0


def measure_dcp_load(volume: Path, state: dict) -> float:
    import torch
    import torch.distributed.checkpoint as dcp

    from .dcp import UCVolumeReader

    target = {k: torch.empty_like(v) for k, v in state.items()}
    t0 = time.perf_counter()
    dcp.load(target, storage_reader=UCVolumeReader(volume / "ckpt"))
    dt = time.perf_counter() - t0
    if not all(torch.equal(target[k], state[k]) for k in state):
        raise BenchError("the checkpoint loaded back differs from what was saved")
    return dt


# --------------------------------------------------------------------------------------------------
# the run


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.a = args
        self.figures: list[Figure] = []
        self.stack = contextlib.ExitStack()
        self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="torchio-bench-")).absolute()
        self.data_prefix = f"{args.prefix.strip('/')}/files-{args.files}x{args.file_size}"
        self.scratch_prefix = f"{args.prefix.strip('/')}/scratch-{uuid.uuid4().hex[:8]}"

    def run(self) -> list[Figure]:
        with self.stack:
            if not self.a.work_dir:
                self.stack.callback(shutil.rmtree, self.work, True)
            self.work.mkdir(parents=True, exist_ok=True)
            if self.a.path:
                self._loaders_on_path(self.a.path)
            else:
                self._full()
        return self.figures

    def _leave(self, path: Path) -> None:
        """Remove a directory a phase leaves behind (a mount's cache, the loader's cache) when the
        run ends, not before the next phase: on ext4 without a journal, thousands of files deleted
        just before a phase slow every file it creates (see ucfs.bench.Leftovers). Before the work
        directory goes: the stack's callbacks run last in, first out."""
        self.stack.callback(shutil.rmtree, path, True)

    # -- over an existing mount -------------------------------------------------------------------
    def _loaders_on_path(self, root: str) -> None:
        a = self.a
        files = sum(len(fs) for _, _, fs in os.walk(root))
        say(f"{files} files under {root}; plain DataLoader first, then torchio ({a.workers} workers)")
        plain = measure_plain(root, a.workers, a.batch_size)
        # Sizes only now: a stat of every file before the plain loader's first epoch would warm the
        # mount for it.
        nbytes = sum(os.stat(os.path.join(d, f)).st_size for d, _, fs in os.walk(root) for f in fs)
        check_cache_room(str(self.work / "cache"), nbytes)
        ours = measure_torchio(root, str(self.work / "cache"), a.workers, a.batch_size, direct=not a.no_direct)
        self.figures += loader_figures(plain, ours, None, files, a.workers)

    # -- a store, a proxy and fresh mounts ----------------------------------------------------------
    def _full(self) -> None:
        from ucfs.store import S3Store

        a = self.a
        if a.endpoint:
            direct = Endpoint(a.endpoint, a.access_key, a.secret_key, a.region)
        else:
            data = a.files * a.file_size + 3 * a.ckpt_size
            rgw, direct = start_rgw(max(8.0, 2.5 * data / (1 << 30)))
            self.stack.callback(rgw.stop)
        store = S3Store(endpoint_url=direct.url, region=direct.region, access_key=direct.access_key,
                        secret_key=direct.secret_key, concurrency=64)
        self._setup(store, direct)
        proxy, measured_url = start_proxy(direct.url, a.latency_ms)
        self.stack.callback(proxy.stop)
        say(f"every request goes through a {a.latency_ms:g} ms latency proxy at {measured_url}")
        measured = S3Store(endpoint_url=measured_url, region=direct.region, access_key=direct.access_key,
                           secret_key=direct.secret_key, concurrency=64)
        catalog = self.work / "catalog.toml"
        catalog.write_text("\n".join([
            "[stores.bench]", f'endpoint_url = "{measured_url}"', f'region = "{direct.region}"', "",
            '[volumes."bench.torchio.data"]', f'location = "s3://{a.bucket}/{self.data_prefix}"', 'store = "bench"',
            "", '[volumes."bench.torchio.scratch"]', f'location = "s3://{a.bucket}/{self.scratch_prefix}"',
            'store = "bench"', ""]))
        env = dict(os.environ, PYTHONUNBUFFERED="1", AWS_REGION=direct.region, AWS_EC2_METADATA_DISABLED="true")
        if direct.access_key:
            env.update(AWS_ACCESS_KEY_ID=direct.access_key, AWS_SECRET_ACCESS_KEY=direct.secret_key)
        self.stack.callback(self._delete_scratch, store)
        if "loader" not in a.skip:
            self._loaders(catalog, env)
        if "dcp" not in a.skip:
            self._dcp(catalog, env, measured)

    def _setup(self, store, ep: Endpoint) -> None:
        """Create the bucket and upload the sample files unless a previous run left them (not measured)."""
        a = self.a
        store.create_bucket(a.bucket)
        have: dict[str, int] = {}
        token = None
        while True:
            page = store.list_page(a.bucket, self.data_prefix + "/", delimiter="", token=token)
            have.update((o.key, o.size) for o in page.objects)
            token = page.next_token
            if token is None:
                break
        keys = [f"{self.data_prefix}/{i // 1000:03d}/sample-{i:06d}.bin" for i in range(a.files)]
        missing = [k for k in keys if have.get(k) != a.file_size]
        if not missing:
            say(f"{a.files} sample files of {a.file_size} bytes already in s3://{a.bucket}/{self.data_prefix}/")
            return
        say(f"uploading {len(missing)} sample files of {a.file_size} bytes (not measured)")
        body = os.urandom(a.file_size)
        with concurrent.futures.ThreadPoolExecutor(SETUP_THREADS) as pool:
            list(pool.map(lambda k: store.put(a.bucket, k, body, a.file_size), missing))

    def _loaders(self, catalog: Path, env: dict) -> None:
        a = self.a
        check_cache_room(str(self.work / "torchio-cache"), a.files * a.file_size)
        say(f"plain DataLoader over the mounted paths, fresh mount ({a.files} files, {a.workers} workers)")
        with Mount(self.work, "plain", catalog, env, self._leave) as m:
            plain = measure_plain(str(m.volume()), a.workers, a.batch_size)
        say(f"plain: epoch 1 {plain[0]:.2f} s, epoch 2 {plain[1]:.2f} s")
        say("UCVolumeDataset + torchio.DataLoader, fresh mount and fresh local cache")
        with Mount(self.work, "torchio", catalog, env, self._leave) as m:
            gets: list[int] = []
            with _credentials(env):
                ours = measure_torchio(str(m.volume()), str(self.work / "torchio-cache"), a.workers,
                                       a.batch_size, between=lambda: gets.append(m.gets()),
                                       direct=not a.no_direct)
            gets.append(m.gets())
            gets[1] += ours[3][1]["direct"]  # epoch 2's direct fills were store GETs too
        say(f"torchio: epoch 1 {ours[0]:.2f} s, epoch 2 {ours[1]:.2f} s")
        self.figures += loader_figures(plain, ours, gets[1] - gets[0] if min(gets) >= 0 else None, a.files,
                                       a.workers)
        self._leave(self.work / "torchio-cache")

    def _dcp(self, catalog: Path, env: dict, measured) -> None:
        a = self.a
        mb = a.ckpt_size / 1e6
        say(f"direct multipart upload of {mb:,.0f} MB ({UPLOAD_PARTS_IN_FLIGHT} parts of "
            f"{PART_BYTES // MiB} MiB in flight)")
        key = f"{self.scratch_prefix}/ceiling.bin"
        ceiling_s = direct_upload(measured, a.bucket, key, a.ckpt_size)
        measured.delete(a.bucket, key)
        ceiling = mb / ceiling_s
        state = make_state_dict(a.ckpt_size)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        say(f"dcp.save of {nbytes / 1e6:,.0f} MB through UCVolumeWriter, fresh mount")
        with Mount(self.work, "dcp", catalog, env, self._leave) as m:
            scratch = m.mountpoint / "bench" / "torchio" / "scratch"
            save_s = measure_dcp(scratch, state, a.dcp_threads)
        with Mount(self.work, "dcp-load", catalog, env, self._leave) as m:
            scratch = m.mountpoint / "bench" / "torchio" / "scratch"
            load_s = measure_dcp_load(scratch, state)
        rate = nbytes / 1e6 / save_s
        self.figures += [
            Figure("dcp.ceiling.multipart_put", ceiling, "MB/s", note=f"{mb:,.0f} MB in {ceiling_s:.2f} s"),
            Figure("dcp.save", rate, "MB/s", ceiling, rate / ceiling, 0.7,
                   f"{nbytes / 1e6:,.0f} MB, complete in the store in {save_s:.2f} s"),
            Figure("dcp.load", nbytes / 1e6 / load_s, "MB/s", note=f"cold mount, {load_s:.2f} s"),
        ]

    def _delete_scratch(self, store) -> None:
        delete_prefix(store, self.a.bucket, self.scratch_prefix + "/")


def delete_prefix(store, bucket: str, prefix: str) -> None:
    """Delete every object under prefix (best effort: what cannot be deleted stays)."""
    token = None
    while True:
        page = store.list_page(bucket, prefix, delimiter="", token=token)
        for o in page.objects:
            with contextlib.suppress(OSError):
                store.delete(bucket, o.key)
        token = page.next_token
        if token is None:
            return


def run_bench(name: str, make_bench, args: argparse.Namespace) -> int:
    """Run a bench from the command line: the table on stdout, errors as one line, --json saved."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        figures = make_bench(args).run()
    except BenchError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    print(format_table(figures))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps([asdict(f) | {"verdict": f.verdict} for f in figures], indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_bench("torchio bench", Bench, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
