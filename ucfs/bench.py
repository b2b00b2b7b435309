"""`ucfs bench`: the mount against the direct-to-store ceiling, in one run, on one machine.

Every mount figure is paired with the same work done directly with boto3 (the "ceiling") on the same
store at the same moment, so the ratio says what the mount costs, not how fast this host happens to
be today. The targets are the ones the issues set:

    cold read >= 0.8 x ceiling.read          warm read >= 3 x cold read
    64-way small copy >= 0.8 x small GETs    ls -l of 10,000 entries < 2 s
    close of a big write <= 1.5 x local dd   its commit <= 1.25 x direct multipart upload
    64-way small writes committed >= 0.7 x direct small PUTs

Data read by the benchmark stays in the bucket between runs, under keys that carry its sizes, so a
re-run against the same server skips the upload. Written data goes to a scratch prefix of this run
and is deleted afterwards.

With `--latency-ms N` every request (ceilings and mount alike) passes through
`ucfs.testing.proxy.LatencyProxy`, run in a child process so it never competes with our own boto3
threads for the GIL. `--latency-ms 0` measures the proxy itself.

The ceilings use plain boto3 clients (`ucfs.store.boto3_client`, not `S3Store`): they are the reference
the store layer is judged against. boto3 is imported lazily, because the CLI imports this module to
build its parser.

Two more direct measurements carry no target. They bound what any implementation can reach on this
machine, given what the mount must do besides what the ceilings do, and the report ends with what
they imply:

- `ceiling.read_keep`: the ranged GETs of `ceiling.read`, each part also written to local disk
  (O_DIRECT, beside the mount's cache) - a cold read must keep every block it reads.
- `ceiling.write_pair`: the local dd of `ceiling.local_write` and the upload of `ceiling.put` at the
  same time - the least a write-behind close() (local data durable) with its commit running
  meanwhile can cost.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable

from . import __version__, control
from .config import MiB, MountConfig, format_size, parse_size
from .errors import UcfsError
from .prefetch import anonymous_buffer

log = logging.getLogger(__name__)

# Phases in the order they run. Each one is a name `--skip` accepts; `--skip ceiling` skips every
# `ceiling.*`, `--skip mount` every `mount.*`, `--skip write` the write phases.
PHASES = ("setup", "ceiling.read", "ceiling.read_keep", "ceiling.small_get", "mount.cold_read",
          "mount.warm_read", "mount.remount_read", "mount.ls_cold", "mount.small_serial",
          "mount.small_parallel", "ceiling.put", "ceiling.local_write", "ceiling.write_pair", "mount.write",
          "ceiling.small_put", "mount.small_write")
WRITE_PHASES = ("ceiling.put", "ceiling.local_write", "ceiling.write_pair", "mount.write",
                "ceiling.small_put", "mount.small_write")

# Parallelism of the small-file work, both direct and through the mount: the 64-way copy the
# targets are stated for (and what MountConfig.store_concurrency is sized for).
SMALL_PARALLEL = 64
# Threads for uploading the test data; setup is not measured, so this only needs to be quick.
SETUP_THREADS = 32
# The mount and a direct client must use the same part size for the comparison to mean anything.
_DEFAULTS = MountConfig()
PART_BYTES = _DEFAULTS.part_bytes
DEFAULT_CONCURRENCY = _DEFAULTS.readahead_max_bytes // _DEFAULTS.part_bytes
# Threads writing ceiling.read_keep's parts to disk. More do not make this kind of disk faster.
KEEP_WRITERS = 4
# The ls target is stated for 10,000 entries; smaller listings get a proportional share of it.
LS_TARGET_S_PER_10K = 2.0


class BenchError(UcfsError):
    """Something the user can fix or should know about; printed as one line, no traceback."""


def say(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


_CPU_KINDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
# The kinds that count as the machine working: not idle, not waiting for the disk, not stolen.
_BUSY_KINDS = ("user", "nice", "system", "irq", "softirq")


def _cpu_ticks() -> list[int] | None:
    """The whole machine's CPU time so far by kind (the first line of /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:1 + len(_CPU_KINDS)]]
    except (OSError, ValueError):
        return None


def _cpu_shares(before: list[int] | None, after: list[int] | None) -> dict[str, float] | None:
    """Percent of all CPUs' time between two `_cpu_ticks` readings, by kind."""
    if not before or not after:
        return None
    delta = [b - a for a, b in zip(before, after)]
    total = sum(delta)
    if total <= 0:
        return None
    return {k: round(100 * d / total, 1) for k, d in zip(_CPU_KINDS, delta)}


def _busy_seconds(before: CpuReading, after: CpuReading) -> float | None:
    """CPU seconds the whole machine worked between two readings (every process and the kernel;
    not idle, not waiting for the disk, not stolen), or None where /proc/stat is not readable."""
    if not before.machine or not after.machine:
        return None
    busy = [_CPU_KINDS.index(k) for k in _BUSY_KINDS]
    return sum(after.machine[i] - before.machine[i] for i in busy) / os.sysconf("SC_CLK_TCK")


def _mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes: how much could be had without swapping."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# Free page reporting: a virtual machine's kernel hands free memory back to its hypervisor. A cold
# read through any file system fills new page cache (the object's size of it) where ceiling.read
# reuses its buffers, and on the VMs we measure on it read slower when the guest had handed back
# more (README, "ucfs bench"). Where reporting is on, each phase says how much went back.
PAGE_REPORTING = Path("/sys/module/page_reporting/parameters")


def _returned_to_host_kib(root: Path = PAGE_REPORTING) -> int | None:
    """KiB of free memory this VM has handed back to its hypervisor since boot, or None where the
    kernel does not report free pages."""
    try:
        return int((root / "reported_kib").read_text())
    except (OSError, ValueError):
        return None


def _stat_ticks(text: str) -> int:
    """utime + stime, in clock ticks, from the text of a /proc/<pid>[/task/<tid>]/stat file."""
    fields = text[text.rindex(")") + 2:].split()  # the name before may hold spaces and ')'
    return int(fields[11]) + int(fields[12])


def _process_ticks() -> dict[int, tuple[str, int]]:
    """CPU time so far (user + system, in clock ticks) of every process: pid -> (name, ticks)."""
    out: dict[int, tuple[str, int]] = {}
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                text = f.read()
            name = text[text.index("(") + 1:text.rindex(")")]  # a name may hold spaces and ')'
            out[pid] = (name, _stat_ticks(text))
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
    return out


def _process_cpu_s(pid: int) -> float | None:
    """CPU seconds process `pid` has used so far, all its threads together, ended ones included, or
    None if it is gone.

    From its CPU-time clock (the clock id glibc's clock_getcpuclockid makes: the inverted pid, then
    CPUCLOCK_SCHED), which counts nanoseconds run as schedstat does; its stat's utime + stime (also
    the ended threads') has only whole clock ticks."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return _stat_ticks(f.read()) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


THREAD_KINDS = ("loop", "store", "disk", "journal", "other")


def _thread_kind(pid: int, tid: int, comm: str) -> str:
    """Which of THREAD_KINDS a daemon's thread is: its event loop (the main thread), one of its thread
    pools (by the names ucfs.threads gives them), or another ("other": the cache index's scan...)."""
    if tid == pid:
        return "loop"
    kind = comm.removeprefix("ucfs-")
    return kind if kind in THREAD_KINDS and comm != kind else "other"


@dataclass
class ThreadCpu:
    """A daemon's CPU seconds so far: each live thread's (tid -> (kind, seconds)), and the whole
    process's, which still holds what threads that have ended used (None if unknown)."""
    threads: dict[int, tuple[str, float]] = field(default_factory=dict)
    process_s: float | None = None


@dataclass
class CpuReading:
    """What the CPUs had done at one moment: the machine by kind, each process, and this process and
    its waited-for children (the mount daemons, dd and cp, whose own entries are gone once they end)."""
    machine: list[int] | None
    processes: dict[int, tuple[str, int]]
    own: float
    children: float

    @classmethod
    def now(cls) -> "CpuReading":
        t = os.times()
        return cls(_cpu_ticks(), _process_ticks(), t.user + t.system, t.children_user + t.children_system)


def _cpu_by_process(before: CpuReading, after: CpuReading, labels: dict[int, str] | None = None,
                    top: int = 4) -> list[tuple[str, float]]:
    """CPU seconds between two readings by process name (processes alive at both; `labels` names
    some by pid), the busiest `top`, then this bench and its children that ended meanwhile."""
    hz = os.sysconf("SC_CLK_TCK")
    by_name: dict[str, float] = {}
    for pid, (name, ticks) in after.processes.items():
        old = before.processes.get(pid)
        if old is not None and old[0] == name and pid != os.getpid() and ticks > old[1]:
            name = (labels or {}).get(pid, name)
            by_name[name] = by_name.get(name, 0.0) + (ticks - old[1]) / hz
    named = set((labels or {}).values())
    busiest = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return [(n, round(v, 1)) for n, v in busiest if v >= 0.05 or n in named] + [
        (n, round(by_name.get(n, 0.0), 1)) for n in sorted(named - {n for n, _ in busiest})] + [
        ("this bench", round(after.own - before.own, 1)),
        ("its ended children (mounts, dd, cp)", round(after.children - before.children, 1))]


# --------------------------------------------------------------------------------------------------
# command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("store")
    g.add_argument("--endpoint", help="S3 endpoint URL (default: start a throw-away Ceph RGW on loopback)")
    g.add_argument("--access-key", help="S3 access key (default: the AWS credential chain)")
    g.add_argument("--secret-key", help="S3 secret key (default: the AWS credential chain)")
    g.add_argument("--region", help="S3 region (default: $AWS_REGION, else us-east-1)")
    g.add_argument("--bucket", default="ucfs-bench", help="bucket, created if missing (default ucfs-bench)")
    g.add_argument("--prefix", default="bench/", help="key prefix of all bench data (default bench/)")
    w = p.add_argument_group("workload")
    w.add_argument("--size", default="1G", help="size of the large object (default 1G)")
    w.add_argument("--small-files", type=int, default=2000, help="number of small files (default 2000)")
    w.add_argument("--small-size", default="150K", help="size of each small file (default 150K)")
    w.add_argument("--listing-entries", type=int, default=10000,
                   help="entries of the directory listed by ls -l (default 10000)")
    w.add_argument("--latency-ms", type=float, default=None,
                   help="add this many ms to every request round trip, for ceilings and mount alike "
                        "(through a loopback proxy; 0 measures the proxy itself)")
    w.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY,
                   help="parallel ranged GETs / upload parts of the direct ceilings (default "
                        f"{DEFAULT_CONCURRENCY}: the mount's read-ahead window in parts of "
                        f"{PART_BYTES // MiB} MiB)")
    r = p.add_argument_group("run")
    r.add_argument("--work-dir", help="mountpoints, cache dirs and local files (default: a temp dir, removed)")
    r.add_argument("--skip", default="", help="comma list of phases to skip: " + ", ".join(PHASES)
                   + " (or a group: ceiling, mount, write)")
    r.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run every measured phase N times, in rounds, and judge each figure by its median "
                        "round (default 1). Each round measures a ceiling just before the mount figure it "
                        "is compared with, so a ratio is never made of two moments of a noisy host")
    r.add_argument("--json", dest="json_path", metavar="FILE", help="also write all figures to FILE")


@dataclass
class Options:
    endpoint: str | None
    access_key: str | None
    secret_key: str | None
    region: str
    bucket: str
    prefix: str
    size: int
    small_files: int
    small_size: int
    listing_entries: int
    latency_ms: float | None
    concurrency: int
    work_dir: Path | None
    skip: frozenset[str]
    json_path: Path | None
    repeat: int = 1

    @classmethod
    def from_args(cls, args) -> "Options":
        skip = {s.strip() for s in (args.skip or "").split(",") if s.strip()}
        groups = {"ceiling", "mount", "write"}
        unknown = skip - set(PHASES) - groups
        if unknown:
            raise BenchError(f"--skip: unknown phase(s) {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(PHASES)}, or ceiling, mount, write")
        if bool(args.access_key) != bool(args.secret_key):
            raise BenchError("give both --access-key and --secret-key, or neither (then the AWS chain is used)")
        if args.small_files < 1 or args.listing_entries < 1:
            raise BenchError("--small-files and --listing-entries must be at least 1")
        if args.concurrency < 1:
            raise BenchError("--concurrency must be at least 1")
        if args.repeat < 1:
            raise BenchError("--repeat must be at least 1")
        if args.latency_ms is not None and args.latency_ms < 0:
            raise BenchError("--latency-ms must not be negative")
        size, small = parse_size(args.size), parse_size(args.small_size)
        if size < 1 or small < 1:
            raise BenchError("--size and --small-size must be at least 1 byte")
        prefix = args.prefix.strip("/")
        return cls(endpoint=args.endpoint, access_key=args.access_key, secret_key=args.secret_key,
                   region=args.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                   or "us-east-1",
                   bucket=args.bucket, prefix=prefix + "/" if prefix else "", size=size,
                   small_files=args.small_files, small_size=small, listing_entries=args.listing_entries,
                   latency_ms=args.latency_ms, concurrency=args.concurrency,
                   work_dir=Path(args.work_dir).absolute() if args.work_dir else None,
                   skip=frozenset(skip), json_path=Path(args.json_path) if args.json_path else None,
                   repeat=args.repeat)

    def wants(self, phase: str) -> bool:
        if phase in self.skip or phase.split(".")[0] in self.skip:
            return False
        return not ("write" in self.skip and phase in WRITE_PHASES)


def run(args) -> int:
    """Entry point of `ucfs bench`: 0 when every phase ran (whatever the verdicts), 1 on an error."""
    try:
        opts = Options.from_args(args)
    except (BenchError, ValueError) as e:
        print(f"ucfs bench: {e}", file=sys.stderr)
        return 2
    bench = Bench(opts)
    try:
        bench.run()
    except BenchError as e:
        print(f"ucfs bench: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ucfs bench: interrupted", file=sys.stderr)
        return 130
    return 0


# --------------------------------------------------------------------------------------------------
# results


@dataclass
class Figure:
    name: str
    value: float
    unit: str
    ceiling: float | None = None  # what `value` is compared with (same unit)
    ratio: float | None = None  # value / ceiling
    target: str = ""  # e.g. ">= 0.8"
    passed: bool | None = None  # None: no target, or its reference was not measured
    note: str = ""
    rounds: list[float] | None = None  # with --repeat: each round's ratio (or value), in round order


def _ratio_figure(name: str, value: float, unit: str, ceiling: float | None, *, at_least: float | None = None,
                  at_most: float | None = None, note: str = "") -> Figure:
    f = Figure(name, value, unit, ceiling, note=note)
    if ceiling:
        f.ratio = value / ceiling
    if at_least is not None:
        f.target = f">= {at_least:g}"
        f.passed = None if f.ratio is None else f.ratio >= at_least
    elif at_most is not None:
        f.target = f"<= {at_most:g}"
        f.passed = None if f.ratio is None else f.ratio <= at_most
    return f


def _fmt_num(v: float | None) -> str:
    if v is None:
        return "-"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}" if v >= 0.1 else f"{v:.3f}"


def format_table(figures: list[Figure]) -> str:
    with_rounds = any(f.rounds for f in figures)
    rows = [("figure", "value", "unit", "ceiling", "ratio", "target", "result")
            + (("each round",) if with_rounds else ())]
    for f in figures:
        result = {True: "PASS", False: "FAIL", None: ""}[f.passed]
        if f.target and f.passed is None:
            result = "n/a"
        row = (f.name, _fmt_num(f.value), f.unit, _fmt_num(f.ceiling),
               "-" if f.ratio is None else f"{f.ratio:.2f}", f.target or "-", result)
        if with_rounds:
            fmt = (lambda v: f"{v:.2f}") if f.ratio is not None else _fmt_num
            row += (" ".join(fmt(v) for v in f.rounds or ()),)
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {1, 3, 4}
    lines = []
    for j, r in enumerate(rows):
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)]
        lines.append(" | ".join(cells).rstrip())
        if j == 0:
            lines.append("-+-".join("-" * w for w in widths))
    notes = [f"  {f.name}: {f.note}" for f in figures if f.note]
    return "\n".join(lines + (["notes:"] + notes if notes else []))


def median_rounds(rounds: list[dict[str, Figure]]) -> dict[str, int]:
    """Which round stands for each figure: the median one, by ratio where the figure has one (value
    otherwise). With an even number of rounds, of the two in the middle the one that is worse for
    the target (the lower for ">=", the higher for "<="), so that repeating never flatters."""
    chosen = {}
    names = dict.fromkeys(n for r in rounds for n in r)
    for name in names:
        have = [(i, r[name]) for i, r in enumerate(rounds) if name in r]
        by_ratio = all(f.ratio is not None for _, f in have)
        key = (lambda f: f.ratio) if by_ratio else (lambda f: f.value)
        ordered = sorted(have, key=lambda x: key(x[1]))
        lo, hi = ordered[(len(ordered) - 1) // 2], ordered[len(ordered) // 2]
        pick = hi if have[0][1].target.startswith("<=") else lo
        chosen[name] = pick[0]
    return chosen


def combine_rounds(rounds: list[dict[str, Figure]], chosen: dict[str, int] | None = None) -> dict[str, Figure]:
    """One figure per name: its median round's (`chosen`, else found here), carrying every round's
    ratio (or value)."""
    out = {}
    for name, i in (chosen or median_rounds(rounds)).items():
        f = rounds[i][name]
        per_round = [(r[name].ratio if f.ratio is not None else r[name].value) for r in rounds if name in r]
        out[name] = replace(f, rounds=per_round)
    return out


# --------------------------------------------------------------------------------------------------
# store access (plain boto3 clients from ucfs.store, lazily imported)


@dataclass
class Endpoint:
    url: str
    access_key: str | None
    secret_key: str | None
    region: str


def make_client(ep: Endpoint, *, pool: int, attempts: int = 5):
    """A boto3 S3 client set up the way `ucfs.store.S3Store` sets up its own (no payload hashing, no
    CRC trailers), so the ceiling is not slowed by work the mount does not do either."""
    from .store import boto3_client

    # max(pool, 10): never make a thread wait for a socket.
    return boto3_client(ep.url, region=ep.region, access_key=ep.access_key, secret_key=ep.secret_key,
                        pool=max(pool, 10), attempts=attempts)


def _boto_errors():
    from .store import boto_errors

    return boto_errors()


def _store_error(e: BaseException, ep: Endpoint, what: str) -> BenchError:
    """A boto3/botocore failure as one line a user can act on."""
    bex = _boto_errors()

    if isinstance(e, bex.NoCredentialsError):
        return BenchError("no S3 credentials: give --access-key and --secret-key, or set "
                          "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or a profile)")
    if isinstance(e, (bex.EndpointConnectionError, bex.ConnectTimeoutError)):
        return BenchError(f"cannot reach the store at {ep.url} ({what}): {e}")
    if isinstance(e, bex.ClientError):
        err = e.response.get("Error", {})
        code = err.get("Code", "")
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"):
            return BenchError(f"the store at {ep.url} refused the credentials ({code}); check "
                              "--access-key/--secret-key")
        return BenchError(f"{what} failed at {ep.url}: {code or status} {err.get('Message', '')}".rstrip())
    if isinstance(e, bex.BotoCoreError):
        return BenchError(f"{what} failed at {ep.url}: {e}")
    raise e


def check_store(ep: Endpoint, bucket: str) -> None:
    """Fail early, in one line, on an unreachable store, refused credentials or an unusable bucket;
    create the bucket if it is missing."""
    bex = _boto_errors()

    s3 = make_client(ep, pool=1, attempts=1)
    try:
        s3.head_bucket(Bucket=bucket)
        return
    except bex.ClientError as e:
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if status == 403:
            # HEAD has no body to say why; ask a request that does.
            try:
                s3.list_objects_v2(Bucket=bucket, MaxKeys=1)
            except bex.ClientError as e2:
                raise _store_error(e2, ep, f"access to bucket {bucket!r}") from None
            return
        if status != 404:
            raise _store_error(e, ep, f"HEAD of bucket {bucket!r}") from None
    except bex.BotoCoreError as e:
        raise _store_error(e, ep, "first request") from None
    try:
        kw = {}
        if ep.region != "us-east-1":
            kw["CreateBucketConfiguration"] = {"LocationConstraint": ep.region}
        s3.create_bucket(Bucket=bucket, **kw)
        say(f"created bucket {bucket!r}")
    except (bex.ClientError, bex.BotoCoreError) as e:
        raise _store_error(e, ep, f"creating bucket {bucket!r}") from None


def run_parallel(fn: Callable, items: Iterable, threads: int) -> list:
    """fn over items in `threads` threads; the first error (or Ctrl-C) cancels what has not started."""
    ex = concurrent.futures.ThreadPoolExecutor(threads)
    try:
        futures = [ex.submit(fn, it) for it in items]
        return [f.result() for f in futures]
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def list_sizes(s3, bucket: str, prefix: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", ()):
            out[o["Key"]] = int(o["Size"])
    return out


def delete_prefix(s3, bucket: str, prefix: str) -> int:
    keys = list(list_sizes(s3, bucket, prefix))
    for i in range(0, len(keys), 1000):
        s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]],
                                                 "Quiet": True})
    return len(keys)


def _get_range(s3, bucket: str, key: str, start: int, length: int) -> bytes:
    resp = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + length - 1}")
    return resp["Body"].read()


# --------------------------------------------------------------------------------------------------
# proxy and mount processes


_HTTPS_PROXY_ERROR = ("--latency-ms works with http:// endpoints only: the proxy relays TCP on loopback, "
                      "and TLS would not accept 127.0.0.1 as the server's name")


class ProxyProcess:
    """`python -m ucfs.testing.proxy` in a child process: the bench's own boto3 threads and the proxy
    would otherwise share one GIL, which would penalise the ceilings but not the mount."""

    def __init__(self, target_url: str, delay_ms: float):
        u = urllib.parse.urlsplit(target_url)
        if u.scheme != "http":
            raise BenchError(_HTTPS_PROXY_ERROR)
        self.target = f"{u.hostname}:{u.port or 80}"
        self.delay_ms = delay_ms
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> "ProxyProcess":
        # stdin is the lifeline: the proxy exits when we close it, or when we die.
        self.proc = subprocess.Popen([sys.executable, "-m", "ucfs.testing.proxy", self.target,
                                      "--delay-ms", str(self.delay_ms)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        line = self.proc.stdout.readline().decode().strip()
        if not line.isdigit():
            self.stop()
            raise BenchError(f"the latency proxy did not start (said {line!r})")
        self.url = f"http://127.0.0.1:{int(line)}"
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


class Leftovers:
    """Files and directories a bench phase leaves behind (a cache, copies), removed when the run
    ends, not between phases. On ext4 without a journal, as on the VMs we measure on, the inode
    allocator skips every inode freed in the last minutes one by one: deleting 2,000 files right
    before a phase made each file that phase created scan past them (15-20% of the daemon's CPU in
    mount.small_parallel, all of it in `recently_deleted`). A bench must not charge its own
    housekeeping to the next figure."""

    def __init__(self) -> None:
        self._paths: list[Path] = []

    def add(self, path: Path) -> None:
        self._paths.append(path)

    def remove_all(self) -> None:
        for p in self._paths:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        self._paths.clear()


class BenchMount:
    """One `ucfs mount --foreground` daemon on its own mountpoint and fresh cache directory."""

    def __init__(self, root: Path, catalog: Path, env: dict, name: str,
                 discard: Callable[[Path], None] | None = None):
        self.root = root
        self.discard = discard or (lambda p: shutil.rmtree(p, ignore_errors=True))
        self.mountpoint = root / f"mnt-{name}"
        self.state_dir = root / f"state-{name}"
        self.log_path = root / f"ucfs-{name}.log"
        self.catalog = catalog
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60, *, keep_cache: bool = False) -> "BenchMount":
        """Mount; with `keep_cache`, on the disk cache the previous start of this mount left."""
        _lazy_unmount(self.mountpoint)  # left over from a run that was killed: it is ours
        try:
            self.mountpoint.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise BenchError(f"mountpoint {self.mountpoint}: {e.strerror}") from None
        if not keep_cache:
            shutil.rmtree(self.state_dir, ignore_errors=True)  # fresh, empty cache every time
        with open(self.log_path, "ab") as logf:
            # Own session: a Ctrl-C meant for the bench must not reach the daemon, which we unmount
            # ourselves, in order. --no-drain: we wait for commits explicitly where we measure them.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ucfs", "mount", str(self.mountpoint), "--foreground",
                 "--config", str(self.catalog), "--cache-dir", str(self.state_dir), "--log-level", "info",
                 "--no-drain"],
                stdout=logf, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"ucfs mount exited with status {self.proc.returncode}: {self.log_tail(5)}")
            if os.path.ismount(self.mountpoint):
                with contextlib.suppress(OSError, UcfsError):
                    if self.status().get("ready"):  # tuned as it will run: see ucfs.mount.serve
                        return self
            time.sleep(0.05)
        raise BenchError(f"ucfs mount not ready after {timeout_s:.0f} s: {self.log_tail(5)}")

    def status(self) -> dict:
        return control.query(self.mountpoint, "status")

    def thread_cpu(self) -> "ThreadCpu":
        """CPU seconds the daemon's live threads and the whole process have used so far (`ThreadCpu`).

        Threads from each one's schedstat (nanoseconds run): the per-thread utime and stime in its
        stat are tick samples rounded so as never to go back, which for a pool of threads that each
        ran a little summed to 0.33 s where the whole process had run 0.57 s (a 1 GiB cold read).
        The process is read last, so that a thread ending during the scan is counted once: up to
        the scan among the live, the rest among the ended."""
        pid = self.proc.pid if self.proc else None
        out = ThreadCpu()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except (OSError, TypeError):
            return out
        assert pid is not None
        hz = os.sysconf("SC_CLK_TCK")
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    comm = f.read().strip()
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    seconds = int(f.read().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                try:  # a kernel without schedstats
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        seconds = _stat_ticks(f.read()) / hz
                except (OSError, ValueError, IndexError):
                    continue  # a thread that ended meanwhile
            out.threads[int(tid)] = (_thread_kind(pid, int(tid), comm), seconds)
        out.process_s = _process_cpu_s(pid)
        return out

    def requests(self) -> dict[str, int]:
        """Store counters of all the mount's stores, summed."""
        total: dict[str, int] = {}
        for s in (self.status().get("stores") or {}).values():
            for k, v in s.items():
                total[k] = total.get(k, 0) + v
        return total

    def wait_committed(self, committed_at_least: int, timeout_s: float) -> float:
        """Poll until nothing is pending and `committed` reached the given count; return the time."""
        deadline = time.monotonic() + timeout_s
        while True:
            c = self.status().get("commits") or {}
            now = time.monotonic()
            if c.get("failed"):
                errs = "; ".join(i.get("error", "") for i in c.get("items", []) if i.get("error"))[:500]
                raise BenchError(f"{c['failed']} commit(s) failed: {errs}")
            if c.get("pending", 0) == 0 and c.get("committed", 0) >= committed_at_least:
                return now
            if now > deadline:
                raise BenchError(f"commits not done after {timeout_s:.0f} s: {c.get('pending')} pending, "
                                 f"{c.get('committed')} committed")
            time.sleep(0.01)

    def log_end(self) -> int:
        """Where the log ends now, for `notable_since`."""
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def notable_since(self, offset: int, limit: int = 5) -> list[str]:
        """The daemon's warnings, errors and notes of wasted work (a stream upload abandoned, a
        commit that could not finish at once) logged after `offset`: what explains an odd figure."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return []
        notable = [ln for ln in lines
                   if " WARNING " in ln or " ERROR " in ln or "abandoned" in ln or "did not work" in ln]
        return notable[:limit] + ([f"... and {len(notable) - limit} more"] if len(notable) > limit else [])

    def log_tail(self, n: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-n:]
        except OSError:
            return "(no log)"
        return " | ".join(lines) + f" (log: {self.log_path})"

    def stop(self, *, timeout_s: float = 30, keep_cache: bool = False) -> None:
        """Unmount the way a user does; fall back to a lazy unmount and a kill if the daemon hangs.
        With `keep_cache`, the disk cache stays for the next start."""
        if self.proc is None:
            return
        with _sigint_deferred():
            try:
                if self.proc.poll() is None:
                    if _is_mounted(self.mountpoint):
                        res = subprocess.run([sys.executable, "-m", "ucfs", "unmount", "--no-wait",
                                              str(self.mountpoint)], env=self.env, capture_output=True,
                                             text=True, timeout=timeout_s)
                        if res.returncode != 0:
                            say(f"ucfs unmount {self.mountpoint} failed: {res.stderr.strip()}")
                    else:
                        # Still starting (interrupted before it was ready): SIGTERM ends it either way.
                        self.proc.terminate()
                    self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                say(f"the mount daemon of {self.mountpoint} did not exit; killing it")
                self.proc.kill()
                self.proc.wait()
            finally:
                self.proc = None
                _lazy_unmount(self.mountpoint)
                if not keep_cache:
                    self.discard(self.state_dir)


def _is_mounted(path: Path) -> bool:
    """From /proc, not os.path.ismount: a dead FUSE mount fails stat() and would look unmounted."""
    target = str(path)
    with contextlib.suppress(OSError), open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 1 and fields[1].replace("\\040", " ") == target:
                return True
    return False


def _lazy_unmount(path: Path) -> None:
    """Detach a mount whose daemon is gone (or hung), so the mountpoint is usable again."""
    if not _is_mounted(path):
        return
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    subprocess.run([tool, "-u", "-z", str(path)] if tool else ["umount", "-l", str(path)], capture_output=True)


def _run_timed(cmd: list[str], what: str, *, input: bytes | None = None, mount: BenchMount | None = None,
               capture_stdout: bool = False) -> tuple[float, bytes]:
    """Run a command, return (seconds, stdout); a failure is a BenchError carrying its stderr."""
    t0 = time.monotonic()
    res = subprocess.run(cmd, input=input, stdout=subprocess.PIPE if capture_stdout else subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    dt = time.monotonic() - t0
    if res.returncode != 0:
        err = res.stderr.decode(errors="replace").strip().splitlines()
        msg = f"{what}: {cmd[0]} exited with {res.returncode}: {' | '.join(err[-3:])}"
        if mount is not None:
            msg += f"; mount log: {mount.log_tail(5)}"
        raise BenchError(msg)
    return dt, res.stdout or b""


# Store counters that are not requests: every other counter names one kind of logical request.
_NOT_REQUESTS = ("attempts", "errors", "not_found", "body_retries")
_REQUEST_ORDER = ("get", "head", "list", "put", "create_multipart", "upload_part", "complete_multipart",
                  "abort_multipart", "copy", "delete")


def _request_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What the counters grew by, requests in a fixed order first."""
    keys = [k for k in _REQUEST_ORDER if k in after] + sorted(k for k in after if k not in _REQUEST_ORDER)
    return {k: after[k] - before.get(k, 0) for k in keys if after[k] - before.get(k, 0)}


def _cpu_delta(before: ThreadCpu, after: ThreadCpu) -> dict[str, float]:
    """The daemon's CPU seconds between two readings, by kind of thread (THREAD_KINDS), and "exited":
    threads that ended in between. Pool threads end after ucfs.threads.IDLE_TIMEOUT_S idle; what
    one used in the phase before it ended is in the process's time but in no live thread's, so it
    is that difference, and the kinds add up to what the process used."""
    out = dict.fromkeys(THREAD_KINDS, 0.0)
    for tid, (kind, seconds) in after.threads.items():
        _, was = before.threads.get(tid, (kind, 0.0))
        out[kind] += seconds - was if seconds >= was else seconds  # less: a new thread with an old tid
    if before.process_s is not None and after.process_s is not None:
        out["exited"] = after.process_s - before.process_s - sum(out.values())
    return out


def _fmt_thread_cpu(cpu: dict[str, float]) -> str:
    """The daemon's CPU over a phase, and how its threads shared it (BenchMount.thread_cpu)."""
    names = {"loop": "event loop", "store": "store threads", "disk": "disk threads", "journal": "journal",
             "other": "other", "exited": "exited threads"}
    parts = ", ".join(f"{names[k]} {v:.2f}" for k, v in cpu.items() if k in names and (v >= 0.005 or k == "loop"))
    return f"{sum(cpu.values()):.2f} s ({parts})"


def _fmt_requests(d: dict[str, int]) -> str:
    """Requests by kind, then the errors and retries among their attempts. Every kind counts,
    whether listed in _REQUEST_ORDER or not, so a request of a new kind is never shown as a retry."""
    requests = {k: v for k, v in d.items() if not k.endswith("_bytes") and k not in _NOT_REQUESTS}
    shown = [f"{k} {v}" for k, v in requests.items()]
    if d.get("errors"):
        shown.append(f"errors {d['errors']}")
    retries = d.get("attempts", 0) - sum(requests.values())
    if retries > 0:
        shown.append(f"retries {retries}")
    return ", ".join(shown) or "none"


def _write_random(path: Path, size: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        left = size
        while left:
            n = min(left, 8 * MiB)
            f.write(os.urandom(n))
            left -= n
    tmp.rename(path)


# --------------------------------------------------------------------------------------------------
# the benchmark


@dataclass
class Layout:
    """Where the data lives: read-only data keyed by its sizes (reused), scratch per run (deleted)."""

    prefix: str
    size: int
    small_files: int
    small_size: int
    listing_entries: int
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    @property
    def data(self) -> str:
        return f"{self.prefix}data/"

    @property
    def scratch(self) -> str:
        return f"{self.prefix}scratch/{self.run_id}/"

    # Paths relative to the data volume (same for keys and for the mount).
    @property
    def large(self) -> str:
        return f"large/{self.size}.bin"

    @property
    def small_dir(self) -> str:
        return f"small/{self.small_files}x{self.small_size}"

    def small(self, i: int) -> str:
        return f"{self.small_dir}/f{i:06d}.bin"

    @property
    def listing_dir(self) -> str:
        return f"listing/{self.listing_entries}"

    def entry(self, i: int) -> str:
        return f"{self.listing_dir}/e{i:06d}"


class Bench:
    def __init__(self, opts: Options):
        self.o = opts
        self.lay = Layout(opts.prefix, opts.size, opts.small_files, opts.small_size, opts.listing_entries)
        self.figures: dict[str, Figure] = {}
        self.details: dict[str, dict] = {}
        self.phase_cpu: dict[str, dict[str, float]] = {}  # per phase: % of all CPUs by kind (/proc/stat)
        self.phase_cpu_seconds: dict[str, dict[str, float]] = {}  # per phase: CPU seconds by process
        self.phase_returned_mib: dict[str, int] = {}  # per phase: MiB handed back to the hypervisor
        self.mount_pids: dict[int, str] = {}  # live mount daemons, named in the CPU lines
        # With --repeat: what each finished round measured, and the suffix that gives this round's
        # mounts and local copies names of their own (removing the last round's right before a
        # phase would make that phase pay for it: see Leftovers).
        self.rounds: list[dict] = []
        self.tag = ""
        self.stack = contextlib.ExitStack()
        self.leftovers = Leftovers()
        self.loadavg_start = os.getloadavg()
        self.returned_kib_start = self.returned_kib_mark = _returned_to_host_kib()
        self.direct: Endpoint | None = None  # the store itself (setup, checks)
        self.measured: Endpoint | None = None  # what ceilings and mounts talk to (the proxy, if any)
        self.work: Path | None = None
        self.temp_work = False  # work dir made by us, removed at the end
        self.rgw = None  # the RGWServer we started, if any
        self.s3 = None  # direct client for setup and checks; never measured
        self.catalog: Path | None = None
        self.env: dict = {}
        self.src_large: Path | None = None
        self.src_small: Path | None = None

    # -- orchestration --------------------------------------------------------------------------
    def run(self) -> None:
        ok = False
        try:
            self._run()
            ok = True
        finally:
            # A second Ctrl-C during cleanup would leave mounts or servers behind.
            with _sigint_deferred():
                self.stack.close()
                self.leftovers.remove_all()
                if self.temp_work:
                    self._discard_work_dir(keep_logs=not ok)

    def _discard_work_dir(self, *, keep_logs: bool) -> None:
        """Remove the temporary work dir; after a failure keep the mount logs the error points to."""
        if not keep_logs or not any(self.work.glob("ucfs-*.log")):
            shutil.rmtree(self.work, ignore_errors=True)
            return
        for p in self.work.iterdir():
            if p.suffix not in (".log", ".toml"):
                if p.is_dir() and not _is_mounted(p):
                    shutil.rmtree(p, ignore_errors=True)
                elif p.is_file():
                    p.unlink(missing_ok=True)
        say(f"mount logs kept in {self.work}")

    def _run(self) -> None:
        self._prepare()
        phases = [p for p in PHASES if self.o.wants(p)]
        say(f"phases: {', '.join(phases)}")
        self._phase("setup", self.setup, always=True)
        for i in range(self.o.repeat):
            if self.o.repeat > 1:
                self.tag = f"-r{i + 1}"
                say(f"round {i + 1} of {self.o.repeat}")
            self._round()
            if self.o.repeat > 1:
                self.rounds.append({"figures": self.figures, "details": self.details,
                                    "phase_cpu_percent": self.phase_cpu,
                                    "phase_cpu_seconds_by_process": self.phase_cpu_seconds,
                                    "phase_returned_to_host_mib": self.phase_returned_mib})
                self.figures, self.details, self.phase_cpu, self.phase_cpu_seconds = {}, {}, {}, {}
                self.phase_returned_mib = {}
        if self.rounds:
            chosen = median_rounds([r["figures"] for r in self.rounds])
            self.figures = combine_rounds([r["figures"] for r in self.rounds], chosen)
            self.details = {n: self.rounds[i]["details"].get(n, {}) for n, i in chosen.items()}
        self._report()

    def _round(self) -> None:
        """Every measured phase once, each ceiling just before the mount figures compared with it."""
        self._phase("ceiling.read", self.ceiling_read)
        self._phase("ceiling.read_keep", self.ceiling_read_keep)
        self._phase("ceiling.small_get", self.ceiling_small_get)
        if any(self.o.wants(p) for p in ("mount.cold_read", "mount.warm_read", "mount.remount_read")):
            self._phase("mount.read", self.mount_reads, always=True)
        self._phase("mount.ls_cold", self.mount_ls_cold)
        self._phase("mount.small_serial", self.mount_small_serial)
        self._phase("mount.small_parallel", self.mount_small_parallel)
        if any(self.o.wants(p) for p in WRITE_PHASES):
            self._prepare_local_sources()
            try:
                self._phase("ceiling.put", self.ceiling_put)
                self._phase("ceiling.local_write", self.ceiling_local_write)
                self._phase("ceiling.write_pair", self.ceiling_write_pair)
                self._phase("mount.write", self.mount_write)
                self._phase("ceiling.small_put", self.ceiling_small_put)
                self._phase("mount.small_write", self.mount_small_write)
            finally:
                self._clean_scratch()

    def _phase(self, name: str, fn: Callable[[], None], always: bool = False) -> None:
        if not always and not self.o.wants(name):
            return
        bex = _boto_errors()

        # Start clean: what earlier phases left dirty in the page cache (the mount writes small cache
        # segments and staging files through it) would otherwise be written back during this one.
        os.sync()
        cpu0 = CpuReading.now()
        try:
            fn()
        except (bex.BotoCoreError, bex.ClientError) as e:
            raise _store_error(e, self.measured or self.direct, name) from None
        if name != "mount.read":  # that one notes its cold and warm reads apart
            self._note_cpu(name, cpu0)

    def _note_cpu(self, name: str, since: CpuReading) -> None:
        """Say what the whole machine's CPUs did since `since`, and which processes used them, so
        that a figure measured while the host was busy elsewhere, or lost time to the hypervisor
        (steal), can be read for what it is, and a slow phase shows where its time went."""
        now = CpuReading.now()
        shares = _cpu_shares(since.machine, now.machine)
        if shares is None:
            return
        self.phase_cpu[name] = shares
        busy = sum(shares[k] for k in _BUSY_KINDS)
        avail = _mem_available()
        say(f"{name}: CPUs {busy:.0f}% busy, {shares['iowait']:.0f}% waiting for the disk, "
            f"{shares['steal']:.0f}% stolen by the hypervisor, {shares['idle']:.0f}% idle"
            + ("" if avail is None else f"; memory available at the end {format_size(avail)}"))
        procs = _cpu_by_process(since, now, self.mount_pids)
        self.phase_cpu_seconds[name] = dict(procs)
        say(f"{name}: CPU seconds by process: " + ", ".join(f"{n} {v:.1f}" for n, v in procs))
        returned = _returned_to_host_kib()
        if returned is not None and self.returned_kib_mark is not None:
            mib = (returned - self.returned_kib_mark) // 1024
            self.phase_returned_mib[name] = mib
            say(f"{name}: free memory handed back to the hypervisor since the phase before: {mib} MiB")
        self.returned_kib_mark = returned

    def _prepare(self) -> None:
        o = self.o
        if o.work_dir is not None:
            o.work_dir.mkdir(parents=True, exist_ok=True)
            self.work = o.work_dir
        else:
            self.work = Path(tempfile.mkdtemp(prefix="ucfs-bench-"))
            self.temp_work = True
        self._check_disk()
        if o.endpoint:
            u = urllib.parse.urlsplit(o.endpoint)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise BenchError(f"--endpoint {o.endpoint!r} is not an http(s)://host[:port] URL")
            if u.scheme == "https" and o.latency_ms is not None:
                raise BenchError(_HTTPS_PROXY_ERROR)
            self.direct = Endpoint(o.endpoint.rstrip("/"), o.access_key, o.secret_key, o.region)
        else:
            self.direct = self._start_rgw()
        check_store(self.direct, o.bucket)
        self.measured = self.direct
        if o.latency_ms is not None:
            proxy = ProxyProcess(self.direct.url, o.latency_ms).start()
            self.stack.callback(proxy.stop)
            self.measured = Endpoint(proxy.url, self.direct.access_key, self.direct.secret_key, self.direct.region)
            say(f"every request goes through a latency proxy at {proxy.url} "
                f"(+{o.latency_ms:g} ms per round trip)")
        self.s3 = make_client(self.direct, pool=SMALL_PARALLEL)  # setup and checks, never measured
        self.catalog = self.work / "catalog.toml"
        self.catalog.write_text(self._catalog_text())
        self.env = self._mount_env()

    def _check_disk(self) -> None:
        o = self.o
        small = o.small_files * o.small_size
        # Cache of the large object (or ceiling.read_keep's copy, deleted before); with writes, its
        # local source, a local copy and the mount's staging file too; three copies of the small files.
        need = 4 * o.size + 4 * small if any(o.wants(p) for p in WRITE_PHASES) else o.size + 3 * small
        free = shutil.disk_usage(self.work).free
        if free < need + (1 << 30):
            raise BenchError(f"{self.work}: {format_size(free)} free, the bench needs about "
                             f"{format_size(need + (1 << 30))} there (choose another --work-dir or a smaller --size)")

    def _start_rgw(self) -> Endpoint:
        try:
            from .testing.rgw import RGWServer
        except ImportError as e:
            raise BenchError(f"no --endpoint given, and the local RGW launcher is unavailable ({e})") from None
        o = self.o
        # memstore keeps data in RAM (about twice the bytes stored); report room for everything.
        data = 3 * o.size + 2 * o.small_files * o.small_size + (1 << 30)
        # Its garbage collector only runs when we ask (`_reclaim`), never during a measurement.
        server = RGWServer(memstore_bytes=max(8 << 30, 2 * data), gc_period_s=24 * 3600)
        say("no --endpoint given: starting a throw-away Ceph RGW on loopback (data in RAM)")
        try:
            ep = server.start()
        except Exception as e:  # noqa: BLE001 - RGWError, OSError...: one line for the user
            raise BenchError(f"could not start a local RGW: {e}") from None
        self.stack.callback(server.stop)
        self.rgw = server
        say(f"RGW ready at {ep.url}")
        return Endpoint(ep.url, ep.access_key, ep.secret_key, ep.region)

    def _catalog_text(self) -> str:
        o, lay = self.o, self.lay
        lines = ["[stores.bench]", f'endpoint_url = "{self.measured.url}"', f'region = "{self.direct.region}"',
                 ""]
        for name, prefix in (("data", lay.data), ("scratch", lay.scratch)):
            lines += [f'[volumes."bench.default.{name}"]', f'location = "s3://{o.bucket}/{prefix.rstrip("/")}"',
                      'store = "bench"', ""]
        return "\n".join(lines)

    def _mount_env(self) -> dict:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        if self.direct.access_key:
            for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
                env.pop(k, None)
            env.update(AWS_ACCESS_KEY_ID=self.direct.access_key, AWS_SECRET_ACCESS_KEY=self.direct.secret_key,
                       AWS_EC2_METADATA_DISABLED="true")
        env["AWS_REGION"] = self.direct.region
        return env

    @contextlib.contextmanager
    def _mount(self, name: str):
        m = BenchMount(self.work, self.catalog, self.env, name + self.tag, discard=self.leftovers.add)
        try:
            m.start()
            self.mount_pids[m.proc.pid] = "ucfs mount"
            yield m
        finally:
            if m.proc is not None:
                self.mount_pids.pop(m.proc.pid, None)
            m.stop()

    def _vol(self, m: BenchMount, volume: str) -> Path:
        return m.mountpoint / "bench" / "default" / volume

    def _figure(self, f: Figure, **detail) -> None:
        self.figures[f.name] = f
        self.details[f.name] = {k: v for k, v in detail.items() if v is not None}

    # -- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        """Upload what is missing (not measured). With --skip setup, only check that it is there."""
        bex = _boto_errors()

        o, lay, s3 = self.o, self.lay, self.s3
        upload = self.o.wants("setup")
        t0 = time.monotonic()
        large_key = lay.data + lay.large
        try:
            have = int(s3.head_object(Bucket=o.bucket, Key=large_key)["ContentLength"])
        except bex.ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 404:
                raise
            have = -1
        if have != o.size:
            self._need(upload, f"large object {large_key}")
            say(f"setup: uploading the large object ({format_size(o.size)}) to {large_key}")
            self._upload_random(large_key, o.size)
        small = list_sizes(s3, o.bucket, lay.data + lay.small_dir + "/")
        missing = [i for i in range(o.small_files) if small.get(lay.data + lay.small(i)) != o.small_size]
        if missing:
            self._need(upload, f"{len(missing)} small files under {lay.data + lay.small_dir}/")
            say(f"setup: uploading {len(missing)} small files of {format_size(o.small_size)}")
            run_parallel(lambda i: s3.put_object(Bucket=o.bucket, Key=lay.data + lay.small(i),
                                                 Body=os.urandom(o.small_size)), missing, SETUP_THREADS)
        entries = list_sizes(s3, o.bucket, lay.data + lay.listing_dir + "/")
        missing = [i for i in range(o.listing_entries) if lay.data + lay.entry(i) not in entries]
        if missing:
            self._need(upload, f"{len(missing)} listing entries under {lay.data + lay.listing_dir}/")
            say(f"setup: creating {len(missing)} empty objects for the listing")
            run_parallel(lambda i: s3.put_object(Bucket=o.bucket, Key=lay.data + lay.entry(i), Body=b""),
                         missing, SETUP_THREADS)
        # Leftovers of an interrupted run would be listed by nothing, but cost space on the server.
        stale = delete_prefix(s3, o.bucket, f"{o.prefix}scratch/")
        if stale:
            say(f"setup: deleted {stale} leftover scratch objects of earlier runs")
        say(f"setup: data in s3://{o.bucket}/{lay.data} ready ({time.monotonic() - t0:.1f} s)")

    def _need(self, upload: bool, what: str) -> None:
        if not upload:
            raise BenchError(f"{what} missing in s3://{self.o.bucket}/ and --skip setup given")

    def _upload_random(self, key: str, size: int) -> None:
        s3, bucket = self.s3, self.o.bucket
        if size <= PART_BYTES:
            s3.put_object(Bucket=bucket, Key=key, Body=os.urandom(size))
            return
        uid = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        try:
            def part(n: int) -> dict:
                start = (n - 1) * PART_BYTES
                body = os.urandom(min(PART_BYTES, size - start))
                r = s3.upload_part(Bucket=bucket, Key=key, UploadId=uid, PartNumber=n, Body=body)
                return {"PartNumber": n, "ETag": r["ETag"]}

            parts = run_parallel(part, range(1, math.ceil(size / PART_BYTES) + 1), SETUP_THREADS // 2)
            s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=uid, MultipartUpload={"Parts": parts})
        except BaseException:
            with contextlib.suppress(Exception):
                s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=uid)
            raise

    def _prepare_local_sources(self) -> None:
        """Random local files the write phases copy from (not measured; reused within a work dir)."""
        o = self.o
        self.src_large = self.work / f"src-large-{o.size}.bin"
        if not self.src_large.exists() or self.src_large.stat().st_size != o.size:
            say(f"preparing a local source file of {format_size(o.size)}")
            _write_random(self.src_large, o.size)
        self.src_small = self.work / f"src-small-{o.small_files}x{o.small_size}"
        self.src_small.mkdir(exist_ok=True)
        for i in range(o.small_files):
            p = self.src_small / f"f{i:06d}.bin"
            if not p.exists() or p.stat().st_size != o.small_size:
                p.write_bytes(os.urandom(o.small_size))
        # Read once so the local side comes from the page cache in every write phase alike.
        with open(self.src_large, "rb") as f:
            while f.read(8 * MiB):
                pass

    # -- ceilings -------------------------------------------------------------------------------
    def _direct_read(self, what: str, keep: Callable[[int, bytes], None] | None = None,
                     slots: threading.Semaphore | None = None) -> tuple[float, float | None]:
        """The large object in `o.concurrency` parallel ranged GETs of PART_BYTES; seconds until the
        last one arrived, and the CPU seconds the whole machine worked meanwhile. `keep(offset, data)`,
        if given, takes each part (in the GET's thread); with `slots`, each GET first takes one
        (`keep` gives it back)."""
        o = self.o
        s3 = make_client(self.measured, pool=o.concurrency)
        key = self.lay.data + self.lay.large
        ranges = [(s, min(PART_BYTES, o.size - s)) for s in range(0, o.size, PART_BYTES)]

        def get(r: tuple[int, int]) -> None:
            if slots is not None:
                slots.acquire()
            data = _get_range(s3, o.bucket, key, *r)
            if len(data) != r[1]:
                raise BenchError(f"{what}: ranged GET returned {len(data)} bytes, expected {r[1]}")
            if keep is not None:
                keep(r[0], data)

        say(f"{what}: {len(ranges)} ranged GETs of {PART_BYTES // MiB} MiB, {o.concurrency} at a time"
            + (", every part also written to local disk" if keep else ""))
        cpu0, t0 = CpuReading.now(), time.monotonic()
        run_parallel(get, ranges, o.concurrency)
        dt = time.monotonic() - t0
        return dt, _busy_seconds(cpu0, CpuReading.now())

    def ceiling_read(self) -> None:
        o = self.o
        dt, busy = self._direct_read("ceiling.read")
        rate = o.size / dt / 1e6
        say(f"ceiling.read: {format_size(o.size)} in {dt:.2f} s = {rate:.0f} MB/s")
        self._figure(Figure("ceiling.read", rate, "MB/s"), seconds=dt, bytes=o.size, machine_cpu_s=busy)

    def ceiling_read_keep(self) -> None:
        """ceiling.read, every part also written to a local file beside the mount's cache, the way
        the mount writes its cache: O_DIRECT from an aligned buffer, by writer threads of their own,
        the parts fetched but not yet written bounded by the mount's memory budget. The clock stops
        when the last GET arrives, as a reader is done then; the writes may still be finishing, as
        the mount's may. Where the file system refuses O_DIRECT, the writes are buffered."""
        o = self.o
        dst = self.work / "read-keep.bin"
        self.leftovers.add(dst)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        direct = hasattr(os, "O_DIRECT")
        try:
            fd = os.open(dst, flags | (os.O_DIRECT if direct else 0), 0o600)
        except OSError:
            fd, direct = os.open(dst, flags, 0o600), False
        slots = threading.Semaphore(max(1, _DEFAULTS.data_budget_bytes // PART_BYTES))
        writers = concurrent.futures.ThreadPoolExecutor(KEEP_WRITERS, thread_name_prefix="bench-keep")
        buffers = threading.local()
        pending: list[concurrent.futures.Future] = []

        def write(off: int, data: bytes) -> None:
            try:
                if not direct:
                    os.pwrite(fd, data, off)
                    return
                buf = getattr(buffers, "buf", None)
                if buf is None:
                    # Page-aligned, as O_DIRECT wants, and huge-paged like the mount's own part buffers.
                    buf = buffers.buf = anonymous_buffer(PART_BYTES)
                buf[:len(data)] = data
                n = -(-len(data) // 4096) * 4096  # a short last part is padded to whole blocks
                with memoryview(buf) as view:
                    os.pwrite(fd, view[:n], off)
            finally:
                slots.release()

        try:
            t0 = time.monotonic()
            dt, _ = self._direct_read("ceiling.read_keep", lambda off, data: pending.append(
                writers.submit(write, off, data)), slots)
            for f in pending:
                f.result()
            if not direct:
                os.fdatasync(fd)
            kept = time.monotonic() - t0
        finally:
            writers.shutdown(wait=True, cancel_futures=True)
            os.close(fd)
            dst.unlink(missing_ok=True)  # at once: its pages would crowd the next phases' memory
        rate = o.size / dt / 1e6
        say(f"ceiling.read_keep: {format_size(o.size)} in {dt:.2f} s = {rate:.0f} MB/s, all on disk after "
            f"{kept:.2f} s" + ("" if direct else " (buffered writes: the file system refused O_DIRECT)"))
        read = self.figures.get("ceiling.read")
        self._figure(_ratio_figure("ceiling.read_keep", rate, "MB/s", read and read.value,
                                   note="no target: ceiling.read keeping every part on local disk, as a "
                                        "cold read must"), seconds=dt, kept_seconds=kept, bytes=o.size,
                     o_direct=direct)

    def ceiling_small_get(self) -> None:
        o, lay = self.o, self.lay
        s3 = make_client(self.measured, pool=SMALL_PARALLEL)
        keys = [lay.data + lay.small(i) for i in range(o.small_files)]
        say(f"ceiling.small_get: {len(keys)} GETs, {SMALL_PARALLEL} at a time")
        t0 = time.monotonic()
        run_parallel(lambda k: s3.get_object(Bucket=o.bucket, Key=k)["Body"].read(), keys, SMALL_PARALLEL)
        dt = time.monotonic() - t0
        rate = len(keys) / dt
        say(f"ceiling.small_get: {len(keys)} files in {dt:.2f} s = {rate:.0f} files/s")
        self._figure(Figure("ceiling.small_get", rate, "files/s"), seconds=dt, files=len(keys))

    def ceiling_put(self) -> None:
        o = self.o
        nparts = math.ceil(o.size / PART_BYTES)
        say(f"ceiling.put: multipart upload of {format_size(o.size)} in {nparts} parts, {o.concurrency} at a time")
        dt = self._direct_upload("ceiling/large.bin")
        rate = o.size / dt / 1e6
        say(f"ceiling.put: {format_size(o.size)} in {dt:.2f} s = {rate:.0f} MB/s")
        self._figure(Figure("ceiling.put", rate, "MB/s"), seconds=dt, bytes=o.size, parts=nparts)

    def _direct_upload(self, name: str) -> float:
        """The large local source uploaded under the scratch prefix as `o.concurrency` parallel parts of
        PART_BYTES (one PUT below S3's smallest part), then deleted; seconds until it was complete."""
        o = self.o
        s3 = make_client(self.measured, pool=o.concurrency)
        key = self.lay.scratch + name
        nparts = math.ceil(o.size / PART_BYTES)
        fd = os.open(self.src_large, os.O_RDONLY)
        try:
            t0 = time.monotonic()
            if o.size < 5 * MiB:  # below S3's smallest part: one PUT is what anyone would do
                s3.put_object(Bucket=o.bucket, Key=key, Body=os.pread(fd, o.size, 0))
            else:
                uid = s3.create_multipart_upload(Bucket=o.bucket, Key=key)["UploadId"]

                def part(n: int) -> dict:
                    start = (n - 1) * PART_BYTES
                    body = os.pread(fd, min(PART_BYTES, o.size - start), start)
                    r = s3.upload_part(Bucket=o.bucket, Key=key, UploadId=uid, PartNumber=n, Body=body)
                    return {"PartNumber": n, "ETag": r["ETag"]}

                try:
                    parts = run_parallel(part, range(1, nparts + 1), o.concurrency)
                    s3.complete_multipart_upload(Bucket=o.bucket, Key=key, UploadId=uid,
                                                 MultipartUpload={"Parts": parts})
                except BaseException:
                    with contextlib.suppress(Exception):
                        s3.abort_multipart_upload(Bucket=o.bucket, Key=key, UploadId=uid)
                    raise
            dt = time.monotonic() - t0
        finally:
            os.close(fd)
        self.s3.delete_object(Bucket=o.bucket, Key=key)
        self._reclaim()
        return dt

    def _local_write(self, what: str) -> float:
        dst = self.work / "local-write.bin"
        self.leftovers.add(dst)
        try:
            dt, _ = _run_timed(["dd", f"if={self.src_large}", f"of={dst}", "bs=1M", "conv=fsync"], what)
        finally:
            dst.unlink(missing_ok=True)  # at once: its pages would crowd the next phases' memory
        return dt

    def ceiling_local_write(self) -> None:
        say(f"ceiling.local_write: dd of {format_size(self.o.size)} to {self.work} with conv=fsync")
        dt = self._local_write("ceiling.local_write")
        say(f"ceiling.local_write: {dt:.2f} s = {self.o.size / dt / 1e6:.0f} MB/s")
        self._figure(Figure("ceiling.local_write", dt, "s"), bytes=self.o.size)

    def ceiling_write_pair(self) -> None:
        """ceiling.local_write and ceiling.put at once: a close() that returns once the data is
        durable locally, with the upload running meanwhile, costs at least this on this machine."""
        say("ceiling.write_pair: the local dd and the direct upload at the same time")
        result: dict[str, float | BaseException] = {}

        def upload() -> None:
            try:
                result["put"] = self._direct_upload("ceiling/pair.bin")
            except BaseException as e:  # noqa: BLE001 - re-raised below, in the bench's thread
                result["put"] = e

        t = threading.Thread(target=upload, name="bench-pair-upload")
        t.start()
        try:
            local = self._local_write("ceiling.write_pair")
        finally:
            t.join()
        put = result["put"]
        if isinstance(put, BaseException):
            raise put
        say(f"ceiling.write_pair: local dd {local:.2f} s, upload {put:.2f} s")
        alone_local = self.figures.get("ceiling.local_write")
        alone_put = self.details.get("ceiling.put", {}).get("seconds")
        self._figure(_ratio_figure("ceiling.write_pair.local", local, "s", alone_local and alone_local.value,
                                   note="no target: the local dd while the upload runs; ceiling column: "
                                        "ceiling.local_write (s)"), bytes=self.o.size)
        self._figure(_ratio_figure("ceiling.write_pair.put", put, "s", alone_put,
                                   note="no target: the upload while the local dd runs; ceiling column: "
                                        "ceiling.put (s)"), bytes=self.o.size)

    def ceiling_small_put(self) -> None:
        o, lay = self.o, self.lay
        s3 = make_client(self.measured, pool=SMALL_PARALLEL)
        files = sorted(self.src_small.iterdir())

        def put(p: Path) -> None:
            # Read inside the timing, as cp must: both sides start from the page cache.
            s3.put_object(Bucket=o.bucket, Key=f"{lay.scratch}ceiling-small/{p.name}", Body=p.read_bytes())

        say(f"ceiling.small_put: {len(files)} PUTs, {SMALL_PARALLEL} at a time")
        t0 = time.monotonic()
        run_parallel(put, files, SMALL_PARALLEL)
        dt = time.monotonic() - t0
        delete_prefix(self.s3, o.bucket, f"{lay.scratch}ceiling-small/")
        self._reclaim()
        rate = len(files) / dt
        say(f"ceiling.small_put: {len(files)} files in {dt:.2f} s = {rate:.0f} files/s")
        self._figure(Figure("ceiling.small_put", rate, "files/s"), seconds=dt, files=len(files))

    # -- mount: reads ---------------------------------------------------------------------------
    def mount_reads(self) -> None:
        o = self.o
        with self._mount("read") as m:
            path = self._vol(m, "data") / self.lay.large
            dd = ["dd", f"if={path}", "of=/dev/null", "bs=1M"]
            r0 = m.requests()
            t0 = m.thread_cpu()
            cpu0 = CpuReading.now()
            dt, _ = _run_timed(dd, "mount.cold_read", mount=m)
            busy = _busy_seconds(cpu0, CpuReading.now())
            self._note_cpu("mount.cold_read", cpu0)
            r1 = m.requests()
            self._note_daemon(m, "mount.cold_read", t0)
            cold = o.size / dt / 1e6
            if self.o.wants("mount.cold_read"):
                req = _request_delta(r0, r1)
                say(f"mount.cold_read: {format_size(o.size)} in {dt:.2f} s = {cold:.0f} MB/s "
                    f"(requests: {_fmt_requests(req)})")
                ceiling = self.figures.get("ceiling.read")
                # The same round's ceiling, so that the CPU bound (_bounds_text) pairs two moments
                # of one round, as the ratio does.
                ceiling_busy = self.details.get("ceiling.read", {}).get("machine_cpu_s")
                self._figure(_ratio_figure("mount.cold_read", cold, "MB/s", ceiling and ceiling.value,
                                           at_least=0.8), seconds=dt, requests=req, machine_cpu_s=busy,
                             ceiling_machine_cpu_s=ceiling_busy)
            if self.o.wants("mount.warm_read"):
                cpu0 = CpuReading.now()
                dt2, _ = _run_timed(dd, "mount.warm_read", mount=m)
                self._note_cpu("mount.warm_read", cpu0)
                req = _request_delta(r1, m.requests())
                warm = o.size / dt2 / 1e6
                say(f"mount.warm_read: {dt2:.2f} s = {warm:.0f} MB/s (requests: {_fmt_requests(req)})")
                cold_ref = cold if self.o.wants("mount.cold_read") else None
                self._figure(_ratio_figure("mount.warm_read", warm, "MB/s", cold_ref, at_least=3,
                                           note="ceiling column: the cold read"), seconds=dt2, requests=req)
            self._verify_large(path)
            if self.o.wants("mount.remount_read"):
                self._remount_read(m, dd, cold if self.o.wants("mount.cold_read") else None)

    def _remount_read(self, m: BenchMount, dd: list[str], cold: float | None) -> None:
        """The same read again after an unmount and a mount on the same disk cache: the kernel's page
        cache of the file went with the unmount, so every byte comes from the disk cache, and not one
        GET may reach the store (the next epoch after a restart of the daemon)."""
        o = self.o
        self.mount_pids.pop(m.proc.pid, None)
        m.stop(keep_cache=True)
        m.start(keep_cache=True)
        self.mount_pids[m.proc.pid] = "ucfs mount"
        r0, t0, cpu0 = m.requests(), m.thread_cpu(), CpuReading.now()
        dt, _ = _run_timed(dd, "mount.remount_read", mount=m)
        self._note_cpu("mount.remount_read", cpu0)
        self._note_daemon(m, "mount.remount_read", t0)
        req = _request_delta(r0, m.requests())
        if req.get("get"):
            raise BenchError(f"mount.remount_read: {req['get']} GETs reached the store; the disk cache "
                             f"should have served every block (mount log: {m.log_tail(5)})")
        rate = o.size / dt / 1e6
        say(f"mount.remount_read: {format_size(o.size)} in {dt:.2f} s = {rate:.0f} MB/s "
            f"(requests: {_fmt_requests(req)})")
        self._figure(_ratio_figure("mount.remount_read", rate, "MB/s", cold,
                                   note="no target: after a remount, from the disk cache; ceiling column: "
                                        "the cold read"), seconds=dt, requests=req)

    def _note_daemon(self, m: BenchMount, name: str, since: ThreadCpu, files: int = 0) -> None:
        """Where the daemon's CPU went during a read, and how its read path ran: what to look at
        first when a read is slower than the rounds beside it. `files`: also per file."""
        cpu = _cpu_delta(since, m.thread_cpu())
        per_file = f", {sum(cpu.values()) / files * 1e3:.2f} ms per file" if files else ""
        with contextlib.suppress(OSError, UcfsError):
            st = m.status()
            core = st.get("core") or {}
            say(f"{name}: daemon CPU {_fmt_thread_cpu(cpu)}{per_file}; "
                f"{core.get('reads', 0)} read requests, {core.get('read_waits', 0)} waited for data; "
                f"GET buffers reused {st.get('buffers_reused', 0)}, mapped {st.get('buffers_mapped', 0)}, "
                f"discarded {st.get('buffers_discarded', 0)}")

    def _verify_large(self, path: Path) -> None:
        """Head and tail of the file as read through the mount equal the object's (not timed)."""
        o = self.o
        n = min(MiB, o.size)
        with open(path, "rb") as f:
            head = f.read(n)
            f.seek(o.size - n)
            tail = f.read(n)
        key = self.lay.data + self.lay.large
        if head != _get_range(self.s3, o.bucket, key, 0, n) or tail != _get_range(self.s3, o.bucket, key,
                                                                                  o.size - n, n):
            raise BenchError(f"{path}: bytes read through the mount differ from the object {key}")

    def mount_ls_cold(self) -> None:
        o = self.o
        with self._mount("ls") as m:
            d = self._vol(m, "data") / self.lay.listing_dir
            r0 = m.requests()
            dt, out = _run_timed(["ls", "-l", str(d)], "mount.ls_cold", mount=m, capture_stdout=True)
            req = _request_delta(r0, m.requests())
        count = sum(1 for line in out.splitlines() if line.startswith(b"-"))
        note = ""
        if count != o.listing_entries:
            raise BenchError(f"mount.ls_cold: ls -l showed {count} files, expected {o.listing_entries}")
        target_s = LS_TARGET_S_PER_10K * o.listing_entries / 10000
        if o.listing_entries != 10000:
            note = f"target scaled from < {LS_TARGET_S_PER_10K:g} s for 10,000 entries"
        say(f"mount.ls_cold: ls -l of {count} entries in {dt:.2f} s (requests: {_fmt_requests(req)})")
        f = Figure("mount.ls_cold", dt, "s", target=f"< {target_s:.2g} s", passed=dt < target_s, note=note)
        self._figure(f, entries=count, requests=req)

    def mount_small_serial(self) -> None:
        dest = self.work / f"copy-serial{self.tag}"
        shutil.rmtree(dest, ignore_errors=True)
        with self._mount("small-serial") as m:
            src = self._vol(m, "data") / self.lay.small_dir
            r0 = m.requests()
            cpu0 = m.thread_cpu()
            dt, _ = _run_timed(["cp", "-r", str(src), str(dest)], "mount.small_serial", mount=m)
            req = _request_delta(r0, m.requests())
            self._note_daemon(m, "mount.small_serial", cpu0, files=self.o.small_files)
        n = self._check_copies(dest, "mount.small_serial")
        self.leftovers.add(dest)
        rate = n / dt
        say(f"mount.small_serial: {n} files in {dt:.2f} s = {rate:.0f} files/s (requests: {_fmt_requests(req)})")
        ceiling = self.figures.get("ceiling.small_get")
        self._figure(_ratio_figure("mount.small_serial", rate, "files/s", ceiling and ceiling.value),
                     seconds=dt, files=n, requests=req)

    def mount_small_parallel(self) -> None:
        o = self.o
        dest = self.work / f"copy-parallel{self.tag}"
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir()
        per_cp = math.ceil(o.small_files / SMALL_PARALLEL)
        with self._mount("small-parallel") as m:
            src = self._vol(m, "data") / self.lay.small_dir
            r0 = m.requests()
            cpu0 = m.thread_cpu()
            t0 = time.monotonic()
            names = os.listdir(src)  # the listing is part of the job, as in `ls | xargs cp`
            paths = b"\0".join(os.fsencode(src / name) for name in names)
            dt_cp, _ = _run_timed(["xargs", "-0", "-P", str(SMALL_PARALLEL), "-n", str(per_cp), "cp", "-t",
                                   str(dest)], "mount.small_parallel", input=paths, mount=m)
            dt = time.monotonic() - t0
            req = _request_delta(r0, m.requests())
            self._note_daemon(m, "mount.small_parallel", cpu0, files=len(names))
        n = self._check_copies(dest, "mount.small_parallel", verify=3)
        self.leftovers.add(dest)
        rate = n / dt
        say(f"mount.small_parallel: {n} files in {dt:.2f} s = {rate:.0f} files/s "
            f"({SMALL_PARALLEL} cp at a time; requests: {_fmt_requests(req)})")
        ceiling = self.figures.get("ceiling.small_get")
        self._figure(_ratio_figure("mount.small_parallel", rate, "files/s", ceiling and ceiling.value,
                                   at_least=0.8), seconds=dt, files=n, requests=req)

    def _check_copies(self, dest: Path, what: str, verify: int = 0) -> int:
        o, lay = self.o, self.lay
        files = sorted(dest.iterdir())
        if len(files) != o.small_files or any(p.stat().st_size != o.small_size for p in files):
            raise BenchError(f"{what}: {len(files)} files copied (expected {o.small_files} of "
                             f"{o.small_size} bytes each)")
        # Byte-for-byte against the store: first, middle and last.
        for i in sorted({0, o.small_files // 2, o.small_files - 1})[:verify]:
            want = self.s3.get_object(Bucket=o.bucket, Key=lay.data + lay.small(i))["Body"].read()
            if (dest / f"f{i:06d}.bin").read_bytes() != want:
                raise BenchError(f"{what}: copy of {lay.small(i)} differs from the object in the store")
        return len(files)

    # -- mount: writes --------------------------------------------------------------------------
    def mount_write(self) -> None:
        o = self.o
        with self._mount("write") as m:
            target = self._vol(m, "scratch") / "written.bin"
            c0 = (m.status().get("commits") or {}).get("committed", 0)
            r0 = m.requests()
            say(f"mount.write: dd of {format_size(o.size)} into the mount, then waiting for the commit")
            log_at = m.log_end()
            cpu0 = m.thread_cpu()
            t0 = time.monotonic()
            dt_close, _ = _run_timed(["dd", f"if={self.src_large}", f"of={target}", "bs=1M"], "mount.write",
                                     mount=m)
            t_commit = m.wait_committed(c0 + 1, timeout_s=max(300.0, o.size / 5e6)) - t0
            req = _request_delta(r0, m.requests())
            cpu = _cpu_delta(cpu0, m.thread_cpu())
            # close() finishes an upload that kept up with the writer, else syncs the staging file
            st = m.status()
            how = ("close() finished the upload" if (st.get("commits") or {}).get("committed_at_close")
                   else "close() synced the staging file")
            how += ("; written in passthrough mode, past the daemon" if (st.get("core") or {}).get("passthrough_opens")
                    else "; every write through the daemon")
            for line in m.notable_since(log_at):
                say(f"mount.write: the mount logged: {line}")
        key = self.lay.scratch + "written.bin"
        got = int(self.s3.head_object(Bucket=o.bucket, Key=key)["ContentLength"])
        if got != o.size:
            raise BenchError(f"mount.write: the committed object {key} has {got} bytes, expected {o.size}")
        say(f"mount.write: close after {dt_close:.2f} s, committed after {t_commit:.2f} s; {how} "
            f"(requests: {_fmt_requests(req)}); daemon CPU {_fmt_thread_cpu(cpu)}")
        local = self.figures.get("ceiling.local_write")
        direct_s = self.details.get("ceiling.put", {}).get("seconds")
        self._figure(_ratio_figure("mount.write.close", dt_close, "s", local and local.value, at_most=1.5,
                                   note="ceiling column: local dd with conv=fsync (s)"), bytes=o.size)
        self._figure(_ratio_figure("mount.write.commit", t_commit, "s", direct_s, at_most=1.25,
                                   note="from the start of dd; ceiling column: direct multipart upload (s)"),
                     requests=req)

    def mount_small_write(self) -> None:
        o = self.o
        files = sorted(self.src_small.iterdir())
        per_cp = math.ceil(len(files) / SMALL_PARALLEL)
        with self._mount("small-write") as m:
            dest = self._vol(m, "scratch") / "small"
            dest.mkdir()
            m.wait_committed(0, timeout_s=60)  # the directory's marker, should it be a commit
            c0 = (m.status().get("commits") or {}).get("committed", 0)
            r0 = m.requests()
            say(f"mount.small_write: {len(files)} files, {SMALL_PARALLEL} cp at a time, then waiting for commits")
            cpu0 = m.thread_cpu()
            t0 = time.monotonic()
            dt_closed, _ = _run_timed(["xargs", "-0", "-P", str(SMALL_PARALLEL), "-n", str(per_cp), "cp", "-t",
                                       str(dest)], "mount.small_write",
                                      input=b"\0".join(os.fsencode(p) for p in files), mount=m)
            dt_committed = m.wait_committed(c0 + len(files), timeout_s=300) - t0
            req = _request_delta(r0, m.requests())
            cpu = _cpu_delta(cpu0, m.thread_cpu())
        stored = list_sizes(self.s3, o.bucket, self.lay.scratch + "small/")
        n_ok = sum(1 for k, v in stored.items() if v == o.small_size)
        if n_ok != len(files):
            raise BenchError(f"mount.small_write: {n_ok} of {len(files)} files reached the store")
        closed, committed = len(files) / dt_closed, len(files) / dt_committed
        say(f"mount.small_write: all closed after {dt_closed:.2f} s ({closed:.0f} files/s), committed after "
            f"{dt_committed:.2f} s ({committed:.0f} files/s; requests: {_fmt_requests(req)}); "
            f"daemon CPU {_fmt_thread_cpu(cpu)}, {sum(cpu.values()) / len(files) * 1e3:.2f} ms per file")
        ceiling = self.figures.get("ceiling.small_put")
        ref = ceiling and ceiling.value
        self._figure(_ratio_figure("mount.small_write.closed", closed, "files/s", ref),
                     seconds=dt_closed, files=len(files))
        self._figure(_ratio_figure("mount.small_write.committed", committed, "files/s", ref, at_least=0.7),
                     seconds=dt_committed, files=len(files), requests=req)

    def _clean_scratch(self) -> None:
        with contextlib.suppress(Exception):  # also reached on the way out of a failure
            delete_prefix(self.s3, self.o.bucket, self.lay.scratch)
            self._reclaim()

    def _reclaim(self) -> None:
        """Free now, between measurements, what deleted objects still hold in the RGW we started.
        Its collector is otherwise off: left to its timer, it freed a deleted GiB in the middle of
        later measured uploads, which then cost the OSD 2.4-2.9 CPU-s instead of 1.0 (its memstore
        keeps everything in RAM, so nothing may pile up either)."""
        if self.rgw is not None:
            self.rgw.collect_garbage()

    # -- report ---------------------------------------------------------------------------------
    def _report(self) -> None:
        o = self.o
        load_end = os.getloadavg()
        bounds = _bounds_text(self.figures, self.details)
        order = ["ceiling.read", "ceiling.read_keep", "mount.cold_read", "mount.warm_read", "mount.remount_read",
                 "ceiling.small_get", "mount.small_serial", "mount.small_parallel", "mount.ls_cold",
                 "ceiling.local_write", "ceiling.put", "ceiling.write_pair.local", "ceiling.write_pair.put",
                 "mount.write.close", "mount.write.commit", "ceiling.small_put", "mount.small_write.closed",
                 "mount.small_write.committed"]
        figures = [self.figures[n] for n in order if n in self.figures]
        where = f"{self.direct.url}" + (" (RGW started by the bench)" if self.rgw is not None else "")
        latency = "none added" if o.latency_ms is None else f"+{o.latency_ms:g} ms per round trip (proxy)"
        header = [
            f"ucfs bench (ucfs {__version__}) on {os.uname().nodename}: {os.cpu_count()} CPUs, load average "
            f"{' '.join(f'{x:.2f}' for x in self.loadavg_start)} at start, "
            f"{' '.join(f'{x:.2f}' for x in load_end)} at end",
            f"store {where}, bucket {o.bucket}, prefix {o.prefix or '(none)'}; latency: {latency}",
            f"large object {format_size(o.size)}, {o.small_files} small files of {format_size(o.small_size)}, "
            f"{o.listing_entries} listing entries; ceilings: {o.concurrency} x {PART_BYTES // MiB} MiB ranges, "
            f"{SMALL_PARALLEL} threads for small files",
        ]
        if self.rounds:
            header.append(f"{len(self.rounds)} rounds: each figure is its median round's, judged on its own; "
                          "the last column has every round's ratio (or value)")
        print("\n".join(header))
        print()
        print(format_table(figures))
        verdicts = [f.passed for f in figures if f.passed is not None]
        if verdicts:
            print(f"\n{sum(verdicts)} of {len(verdicts)} targets met")
        if bounds:
            print("\nwhat this machine allows (from ceiling.read_keep, ceiling.write_pair and the CPU time "
                  "of the reads):")
            print("\n".join(f"  {b}" for b in bounds))
        returned = _returned_to_host_kib()
        returned_mib = (None if returned is None or self.returned_kib_start is None
                        else (returned - self.returned_kib_start) // 1024)
        if returned_mib:
            print(f"\nthis VM handed {returned_mib} MiB of free memory back to its hypervisor during the run "
                  "(free page reporting); the mount's cold read, which fills new page cache where ceiling.read "
                  "reuses its buffers, measured slower when it did (README, \"ucfs bench\")")
        if o.json_path:
            doc = {"ucfs_version": __version__, "host": {"nodename": os.uname().nodename, "nproc": os.cpu_count(),
                                                         "loadavg_start": self.loadavg_start,
                                                         "loadavg_end": load_end,
                                                         "returned_to_host_mib": returned_mib},
                   "store": {"endpoint": self.direct.url, "started_rgw": self.rgw is not None, "bucket": o.bucket,
                             "prefix": o.prefix, "latency_ms": o.latency_ms},
                   "workload": {"size_bytes": o.size, "small_files": o.small_files,
                                "small_size_bytes": o.small_size, "listing_entries": o.listing_entries,
                                "concurrency": o.concurrency, "part_bytes": PART_BYTES,
                                "small_parallel": SMALL_PARALLEL},
                   "figures": {f.name: asdict(f) for f in figures},
                   "details": self.details,
                   "phase_cpu_percent": self.phase_cpu,
                   "phase_cpu_seconds_by_process": self.phase_cpu_seconds,
                   "phase_returned_to_host_mib": self.phase_returned_mib,
                   "bounds": bounds, "repeat": o.repeat,
                   "rounds": [{"figures": {n: asdict(f) for n, f in r["figures"].items()},
                               **{k: v for k, v in r.items() if k != "figures"}} for r in self.rounds]}
            o.json_path.write_text(json.dumps(doc, indent=2) + "\n")
            say(f"figures written to {o.json_path}")


def _bounds_text(figures: dict[str, Figure], details: dict[str, dict]) -> list[str]:
    """What the bound measurements imply for the targets, a line each (none if not measured)."""
    out = []
    keep, cold = figures.get("ceiling.read_keep"), figures.get("mount.cold_read")
    if keep is not None and keep.ratio is not None:
        line = (f"cold read: keeping every part on local disk, a direct reader gets {keep.ratio:.2f} x "
                f"ceiling.read (target for the mount: 0.8)")
        if cold is not None:
            line += f"; the mount's cold read is {cold.value / keep.value:.2f} x that"
        out.append(line)
    cold_detail = details.get("mount.cold_read", {})
    mount_cpu, ceiling_cpu = cold_detail.get("machine_cpu_s"), cold_detail.get("ceiling_machine_cpu_s")
    if mount_cpu and ceiling_cpu:
        # Where the CPUs are what limits both reads, each takes its work divided by the CPUs: the
        # ratio of the work is then the most the cold read can reach, whatever the mount does with
        # its time. The store server's work is in both.
        out.append(f"cold read, CPU: the whole machine worked {ceiling_cpu:.2f} CPU-s for ceiling.read and "
                   f"{mount_cpu:.2f} for the mount's cold read (server, daemon, kernel and reader); where "
                   f"the CPUs are the limit, the cold read reaches at most {ceiling_cpu / mount_cpu:.2f} x "
                   f"ceiling.read")
    local = figures.get("ceiling.local_write")
    put_s = details.get("ceiling.put", {}).get("seconds")
    pair_local, pair_put = figures.get("ceiling.write_pair.local"), figures.get("ceiling.write_pair.put")
    if local is not None and put_s and pair_local is not None and pair_put is not None:
        out += [
            "1 GiB write, close <= 1.5 x local dd and commit <= 1.25 x direct upload, three ways:",
            f"  close waits for the upload: close >= {put_s / local.value:.2f} x local dd",
            f"  close after a local sync, upload afterwards: commit >= {(local.value + put_s) / put_s:.2f} x direct",
            f"  close after a local sync, upload meanwhile: close >= {pair_local.ratio:.2f} x local dd, "
            f"commit >= {pair_put.ratio:.2f} x direct",
        ]
    return out


class _sigint_deferred:
    """Cleanup runs to its end even if Ctrl-C is pressed meanwhile; the Ctrl-C then takes effect
    (unless an exception is already on its way out)."""

    def __enter__(self) -> "_sigint_deferred":
        self.pressed = False
        try:
            self.old = signal.signal(signal.SIGINT, self._note)
        except ValueError:  # not the main thread: signals cannot reach us here anyway
            self.old = None
        return self

    def _note(self, signum, frame) -> None:
        self.pressed = True

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
        if self.pressed and exc_type is None:
            raise KeyboardInterrupt
        return False
