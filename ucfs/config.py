"""Tunables of a mount, as data.

Every field carries its unit in its name and a comment saying why the default is what it is.
The CLI is the only place that builds a `MountConfig` from argv; everything else receives one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


def runtime_dir() -> Path:
    """The user's runtime directory for ucfs (0700): control sockets and mount descriptors."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if os.geteuid() == 0 and os.path.isdir("/run") and os.access("/run", os.W_OK):
        base = "/run"
    if not base or not os.access(base, os.W_OK):
        base = f"/tmp/ucfs-{os.geteuid()}"
    d = Path(base) / "ucfs"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


def resolve_mountpoint(path: str | os.PathLike) -> Path:
    """A mountpoint as the kernel names it in /proc/self/mounts: absolute, symbolic links resolved.

    The daemon and the CLI both name a mount this way, so that a mountpoint given through a symlink
    finds the same socket, descriptor and mount table entry whichever name was used where.
    Only the directories above the mountpoint are resolved with realpath; the mountpoint itself is
    only read as a link, never stat'ed: on a mount that stat would be a request to its daemon, which
    waits for ever when that daemon is hung (or is the caller), and fails on a dead one."""
    p = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on links followed (ELOOP)
        p = p.rstrip("/") or "/"
        parent, name = os.path.split(p)
        if name in ("", ".", ".."):
            # A link's target that ends so names a directory above others; realpath takes ".." from
            # the directory reached so far, without a stat of the one it ends at.
            return Path(os.path.realpath(p))
        p = os.path.join(os.path.realpath(parent), name)
        try:
            target = os.readlink(p)
        except OSError:  # not a link (or not there yet: it may be made)
            break
        # Not normpath: in "a/../m", ".." is the parent of a's target when a is a link, not the
        # directory a is in. The next turn's realpath of the directories takes it so, as the kernel.
        p = os.path.join(os.path.dirname(p), target)
    return Path(p)


def mount_runtime_name(mountpoint: str | os.PathLike) -> str:
    """The name, in `runtime_dir()`, under which a mount's socket and descriptor live (of the
    mountpoint as `resolve_mountpoint` gives it: both daemon and CLI resolve first)."""
    return hashlib.sha256(os.path.abspath(mountpoint).encode()).hexdigest()[:20]


def mount_descriptor_path(mountpoint: str | os.PathLike) -> Path:
    """Where a running mount describes its volumes (locations only, never credentials) for clients
    on the same host that may fetch objects themselves (torchio's cache fills)."""
    return runtime_dir() / f"{mount_runtime_name(mountpoint)}.json"


def default_state_dir() -> Path:
    """Where the cache, staging area and journal live unless told otherwise.

    Root gets a system location; other users get one under their XDG cache home, so two users on one
    host never share (or fight over) a cache directory.
    """
    if os.geteuid() == 0:
        return Path("/var/cache/ucfs")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ucfs"


@dataclass(frozen=True)
class MountConfig:
    # Objects changed elsewhere become visible within this time. One second keeps `ls` and `stat` cheap
    # for bursts of metadata calls while still feeling "live" to someone watching another host.
    metadata_ttl_s: float = 1.0

    # Unit of the local disk cache and of random-read fetches. 1 MiB keeps a footer or column-chunk
    # read from pulling megabytes it does not need, yet is large enough that a 1 GiB file is only
    # 1,024 cache files.
    block_bytes: int = 1 * MiB

    # Size of one ranged GET during sequential read-ahead. 8 MiB is where S3 and RGW reach full
    # per-connection throughput; smaller parts spend more time in request overhead.
    part_bytes: int = 8 * MiB

    # First read-ahead window. A file read only at its head (a header, a magic number) costs one GET of
    # about 1 MiB; a reader that goes on doubles the window from there. (Sized when the kernel's first
    # requests for a 1 MiB read were 1 MiB and 128 KiB; with its read-ahead at 8 MiB, the first one is
    # 2 MiB, and a request is always fetched whole.)
    readahead_initial_bytes: int = 1 * MiB + 128 * KiB

    # Largest read-ahead window of one handle. 16 parts in flight keep a 2-core host saturated at
    # ~1 GB/s even with 10-30 ms of store latency (bandwidth-delay product is far below this).
    readahead_max_bytes: int = 128 * MiB

    @property
    def prefill_buffers(self) -> int:
        """Part buffers a mount makes, pages faulted in, before it says it is ready
        (BufferPool.prefill): what one stream at its full window holds at once. Its window is in
        flight, and the parts the reader is being answered from and those still being written to
        the disk cache are held besides: 21-27 of 8 MiB in the bench's cold read of 1 GiB, and
        none mapped on demand in six rounds with 24."""
        return self.readahead_max_bytes * 3 // 2 // self.part_bytes

    # One budget for everything in memory that grows with load: read-ahead of all handles, the buffers
    # of uploads, and the FUSE request buffers (fuse_max_tasks x 1 MiB, set aside first). Many open
    # files share it, so memory stays bounded however many files are streamed at once.
    readahead_budget_bytes: int = 512 * MiB

    @property
    def data_budget_bytes(self) -> int:
        """The part of the budget left for file data once the FUSE request buffers are set aside
        (each worker task owns one of 1 MiB + 4 KiB, FUSE's largest write); at least 16 MiB."""
        return max(16 * MiB, self.readahead_budget_bytes - self.fuse_max_tasks * (MiB + 4 * KiB))

    # Requests to the store in flight at once (threads and pooled connections). 64 lets a 64-way
    # small-file copy keep 64 GETs going, which is what hides per-request latency.
    store_concurrency: int = 64

    # Connect / read timeouts of one store request. Reads that stall longer are retried by botocore.
    store_connect_timeout_s: float = 5.0
    store_read_timeout_s: float = 30.0

    # Attempts per store request for transient failures (5xx, throttling, resets), done by botocore with
    # exponential backoff. Five attempts ride out a few seconds of trouble without hanging a reader.
    store_max_attempts: int = 5

    # While the store cannot be reached (connections refused or broken, timeouts, 5xx once the retries
    # are spent), lookups, stat and listings answer from what was last known for up to this many
    # seconds of the outage, so a job whose data is cached keeps reading through a store's hiccup or
    # restart instead of failing on metadata it already has. 0: they fail with EIO, as data reads
    # the cache cannot serve always do.
    stale_if_error_s: float = 600.0

    # Local disk cache.
    cache_dir: Path = dataclasses.field(default_factory=lambda: default_state_dir() / "cache")
    # Bytes of cached blocks kept at most (least recently used evicted first).
    cache_size_bytes: int = 10 * GiB
    # Keep at least this much free on the cache's file system, whatever cache_size_bytes says, so a
    # training host's local disk never fills up because of us.
    cache_free_floor_bytes: int = 1 * GiB

    # Directory listings larger than this are not refreshed in one go when a lookup finds them expired;
    # single entries are looked up instead (a LIST page holds 1,000 keys).
    relist_max_entries: int = 5000

    # FUSE worker tasks: how many kernel requests we handle concurrently. Enough for the busiest client
    # (a 64-way copy has 64 requests in flight); not more, because each task owns a receive buffer
    # of 1 MiB + 4 KiB (FUSE's largest write) that counts in the daemon's memory.
    fuse_max_tasks: int = 64

    # Read-ahead the kernel itself does on the mount, and the largest read request it sends us (one
    # part). A sequential reader then costs one 8 MiB request per part instead of eight of 1 MiB
    # (FUSE's default cap, raised as root: mount.allow_read_requests) or 64 of 128 KiB (the kernel's
    # default read-ahead). Where requests stay capped at 1 MiB, the read-ahead is 1 MiB too. Our own
    # read-ahead looks further. Needs root.
    kernel_readahead_kib: int = 8192

    # Let users other than the mounting one see the mount (they still need grants).
    allow_other: bool = False

    # Files being written are opened in FUSE passthrough mode where the kernel offers it (Linux 6.9+,
    # as root): their writes go straight to the staging file instead of through this daemon
    # (ucfs.passthrough). Off: every write is a request we answer, as on older kernels.
    passthrough: bool = True

    # Serve Prometheus metrics on 127.0.0.1 at this port (0: off). Loopback only: metrics name paths.
    metrics_port: int = 0

    def __post_init__(self) -> None:
        if self.block_bytes <= 0 or self.part_bytes % self.block_bytes:
            raise ValueError("part_bytes must be a positive multiple of block_bytes")
        if self.readahead_max_bytes < self.part_bytes:
            raise ValueError("readahead_max_bytes must be at least part_bytes")
        if not math.isfinite(self.metadata_ttl_s) or self.metadata_ttl_s < 0:
            raise ValueError("metadata_ttl_s must be a finite number of seconds, not negative")
        if not math.isfinite(self.stale_if_error_s) or self.stale_if_error_s < 0:
            raise ValueError("stale_if_error_s must be a finite number of seconds, not negative")
        if not math.isfinite(self.store_read_timeout_s) or self.store_read_timeout_s <= 0:
            raise ValueError("store_read_timeout_s must be a finite number of seconds, more than 0")

    def replace(self, **changes) -> "MountConfig":
        return dataclasses.replace(self, **changes)


def format_size(n: float) -> str:
    """Bytes for people: 1.5 GiB, 300 MiB, 20 KiB, 512 B (binary units, as `parse_size` reads them)."""
    for unit, mult in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= mult:
            v = n / mult
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def parse_size(text: str) -> int:
    """'10G', '512M', '1.5GiB', '4096' -> bytes (binary units; a bare number is bytes)."""
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": KiB, "M": MiB, "G": GiB, "T": 1024 * GiB}
    mult = 1
    if s and s[-1] in units:
        mult = units[s[-1]]
        s = s[:-1]
    try:
        value = float(s)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (try e.g. 10G, 512M, 4096)") from None
    if not math.isfinite(value):
        raise ValueError(f"not a size: {text!r} (try e.g. 10G, 512M, 4096)")
    if value < 0:
        raise ValueError(f"size must not be negative: {text!r}")
    return int(value * mult)
