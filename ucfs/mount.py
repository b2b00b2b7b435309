"""Lifecycle of a mount: build the parts in dependency order, run, shut down in reverse.

    stores -> cache -> committer -> core -> FUSE session

Everything runs in one trio nursery owned by `serve`. The FUSE loop ends when the file system is
unmounted (`ucfs unmount`, `fusermount3 -u`) or on SIGINT/SIGTERM; then pending commits are drained
(unless told not to), background tasks are cancelled and the session is closed. A SIGINT or SIGTERM
during the drain (the second one, if the first unmounted) stops it: what is left stays staged and
journaled for the next mount, which commits it.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import json
import logging
import os
import resource
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyfuse3
import trio

from . import control, errors, fusewait, telemetry
from .aiostore import AsyncStore
from .allocator import HEAP_AFTER_IDLE_S, Allocator
from .cache import BlockCache, ensure_private_dir
from .commit import Committer
from .catalog import Catalog, StoreSpec
from .config import KiB, MountConfig, mount_descriptor_path, resolve_mountpoint
from .core import Core
from .errors import UcfsError
from .fs import Operations
from .passthrough import PAGE_BYTES, Passthrough, fuse_device_fd
from .store import LocalStore, S3Store, Store

log = logging.getLogger(__name__)


@dataclass
class MountOptions:
    mountpoint: Path
    state_dir: Path  # cache, staging, journal and lock live here (--cache-dir)
    drain_on_exit: bool = True
    # S3 credentials given directly (tests, bench); None means the standard AWS chain.
    access_key: str | None = None
    secret_key: str | None = None


def make_store(spec: StoreSpec, cfg: MountConfig, *, access_key: str | None = None,
               secret_key: str | None = None) -> Store:
    if spec.kind == "local":
        return LocalStore()
    return S3Store(endpoint_url=spec.endpoint_url, region=spec.region, profile=spec.profile,
                   path_style=spec.path_style, payload_signing=spec.payload_signing,
                   concurrency=cfg.store_concurrency,
                   max_attempts=cfg.store_max_attempts, connect_timeout_s=cfg.store_connect_timeout_s,
                   read_timeout_s=cfg.store_read_timeout_s, access_key=access_key, secret_key=secret_key)


# How long the CLI waits for a mount to answer a statfs before it calls the mount hung.
PROBE_TIMEOUT_S = 10.0


def statvfs_answered(path: str | os.PathLike, timeout_s: float | None = None) -> os.statvfs_result:
    """os.statvfs(path), or a UcfsError if no answer comes within `timeout_s`.

    On a FUSE mount whose daemon is alive but stopped or hung, statfs waits for ever (only SIGKILL
    ends the wait), and `ucfs mount`, `status` or `unmount` would hang with it. The call runs in a
    daemon thread: the process can give up on it and exit, which ends the wait."""
    timeout_s = PROBE_TIMEOUT_S if timeout_s is None else timeout_s
    out: list = []

    def probe() -> None:
        try:
            out.append(os.statvfs(path))
        except OSError as e:
            out.append(e)

    t = threading.Thread(target=probe, name="ucfs-statvfs-probe", daemon=True)
    t.start()
    t.join(timeout_s)
    if not out:
        raise errors.UcfsError(
            f"{path} is a mount that does not answer (no reply to statfs in {timeout_s:g} s): the daemon "
            f"serving it is stopped or hung. Clear it with: fusermount3 -u -z {path} (a ucfs mount "
            "loses nothing that was closed: the next mount of its cache directory commits it)")
    if isinstance(out[0], OSError):
        raise out[0]
    return out[0]


def check_mountpoint(path: Path) -> Path:
    """The mountpoint to mount at (as `resolve_mountpoint` names it), made if missing; a UcfsError
    when it cannot be used."""
    path = resolve_mountpoint(path)
    try:
        statvfs_answered(path)  # not stat, which a mount that just died may answer from cached attributes
    except (FileNotFoundError, NotADirectoryError):
        pass  # made below, or the message says what is missing
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            # What a FUSE mount whose daemon died (or was killed) leaves behind: the mount stays,
            # and every access to it fails like this until it is unmounted.
            raise UcfsError(f"{path} is a dead FUSE mount (its daemon has exited: {e.strerror}); "
                            f"clear it with: fusermount3 -u -z {path}") from None
        raise UcfsError(f"mountpoint {path}: {e.strerror}") from None
    if not path.exists():
        if not path.parent.is_dir():
            raise UcfsError(f"mountpoint {path}: parent directory {path.parent} does not exist")
        try:
            path.mkdir()
        except OSError as e:
            raise UcfsError(f"mountpoint {path}: cannot create it: {e.strerror}") from None
    if not path.is_dir():
        raise UcfsError(f"mountpoint {path} is not a directory")
    if os.path.ismount(path):
        raise UcfsError(f"{path} is already a mount point (unmount it first: ucfs unmount {path})")
    return path


def hidden_entries(path: Path) -> int:
    """How many entries the directory `path` has: a mount over it hides them until it is unmounted.
    FUSE mounts over a non-empty directory, and nothing there is lost, but whoever put files there
    sees them vanish and should be told why. 0 when it cannot be listed (then we cannot tell)."""
    try:
        with os.scandir(path) as it:
            return sum(1 for _ in it)
    except OSError:
        return 0


class StateDirLock:
    """One daemon per state directory: two daemons sharing a cache or journal would corrupt both."""

    def __init__(self, state_dir: Path):
        self.path = state_dir / "lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 100).decode(errors="replace").strip()
            os.close(fd)
            raise UcfsError(f"cache directory {self.path.parent} is in use by another ucfs daemon "
                            f"({holder or 'pid unknown'}); give this mount its own --cache-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _bdi_of(mountpoint: Path) -> str | None:
    """major:minor of the FUSE connection at mountpoint, from /proc (stat would ask ourselves)."""
    target = str(mountpoint)
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        fields = line.split()
        if len(fields) > 4 and fields[4] == target:
            return fields[2]
    return None


MAX_PAGES_LIMIT = Path("/proc/sys/fs/fuse/max_pages_limit")
# The kernel's own cap on a FUSE request before that setting existed (Linux 6.13), and its default.
FUSE_DEFAULT_MAX_PAGES = 256
FUSE_MAX_PAGES_FIELD = 65535  # max_pages is a 16-bit field of the INIT reply


def _invalidate_attrs(ino: int) -> None:
    """The kernel's attributes of `ino` are stale (Core.invalidate_attrs). Attributes only: that
    takes no page lock, so it is safe on the event loop while reads wait for us. An inode the kernel
    has forgotten has nothing to invalidate."""
    try:
        pyfuse3.invalidate_inode(ino, attr_only=True)
    except OSError as e:
        if e.errno != errno.ENOENT:
            log.warning("could not tell the kernel that inode %d changed: %s", ino, e)


def allow_read_requests(want_bytes: int, limit_path: Path = MAX_PAGES_LIMIT, *, can_ask: bool = True) -> int:
    """The largest read request the kernel will send us, raising its limit to `want_bytes` if we may.

    A FUSE server may ask for requests of up to fs.fuse.max_pages_limit pages (default 256: 1 MiB).
    Answering a sequential read in 8 MiB requests (our part size) instead of 1 MiB ones halved the
    daemon's work on the FUSE side of a 1 GiB cold read (perf: the reply writes 1,038 -> 537 samples,
    the interpreter 901 -> 517). The limit is the administrator's cap on what servers may ask, not
    a default anyone relies on; as root we raise it when it is lower than asked, and say so.
    Otherwise we take what it allows.

    `can_ask`: whether our INIT reply can ask for more than libfuse's 1 MiB at all (ucfs._fusewire
    is built). Without it the limit is left as it is: raising a host-wide setting would buy nothing."""
    if not can_ask:
        return FUSE_DEFAULT_MAX_PAGES * PAGE_BYTES  # what libfuse asks for by itself
    want = min(max(1, want_bytes // PAGE_BYTES), FUSE_MAX_PAGES_FIELD)
    try:
        limit = int(limit_path.read_text())
    except (OSError, ValueError):
        return min(want, FUSE_DEFAULT_MAX_PAGES) * PAGE_BYTES  # an older kernel: its fixed cap
    if limit < want:
        try:
            limit_path.write_text(str(want))
        except OSError as e:
            log.info("FUSE read requests stay at %d KiB: cannot raise %s to %d (%s)",
                     limit * PAGE_BYTES // KiB, limit_path, want, e.strerror)
        else:
            log.info("raised %s from %d to %d: reads are answered %d KiB at a time", limit_path,
                     limit, want, want * PAGE_BYTES // KiB)
            limit = want
    return min(want, limit) * PAGE_BYTES


# How often, and for how long, to look whether the kernel has taken our FUSE_INIT reply.
_INIT_POLL_S = 0.005
_INIT_WAIT_S = 1.0


async def tune_kernel_readahead(mountpoint: Path, kib: int) -> None:
    """Let the kernel read ahead `kib` on this mount: larger, fewer FUSE read requests.

    The kernel sets the mount's read-ahead when it processes our reply to FUSE_INIT, which happens
    after the main loop has started; so look until the setting sticks. Best effort: needs root and a
    writable /sys; without it reads still work, in 128 KiB requests.

    The mount is announced ready only after this returns: a file takes the mount's read-ahead when it
    is opened and keeps it while open, so a reader that opened a file in the moment before the setting
    stuck was served in 128 KiB requests to its end - eight times the requests, and in the bench,
    whose reader starts the moment the mount answers, a third more of the daemon's CPU for a cold
    read, in about one run of three.
    """
    bdi = _bdi_of(mountpoint)
    if bdi is None:
        return
    path = f"/sys/class/bdi/{bdi}/read_ahead_kb"
    for _ in range(round(_INIT_WAIT_S / _INIT_POLL_S)):
        await trio.sleep(_INIT_POLL_S)
        try:
            with open(path) as f:
                if int(f.read()) == kib:
                    log.debug("kernel read-ahead on %s is %d KiB", mountpoint, kib)
                    break
            with open(path, "w") as f:
                f.write(str(kib))
        except OSError as e:
            log.debug("cannot tune kernel read-ahead (%s); keeping the default", e)
            break
    tune_fuse_connection(bdi)


# Asynchronous requests (read-ahead) the kernel keeps in flight to us, and the count at which it
# considers the connection congested. The kernel's defaults, 12 and 9, are made for one reader: with
# 64 files read at once the connection counts as congested, the kernel stops reading ahead and falls
# back to 4 KiB synchronous reads (measured: 7 requests per 150 KiB file instead of 1).
FUSE_MAX_BACKGROUND = 256
FUSE_CONGESTION_THRESHOLD = 192


def tune_fuse_connection(bdi: str) -> None:
    """Raise the connection's background limits (fusectl; mounted here if it is not). Best effort."""
    ctl = Path("/sys/fs/fuse/connections")
    minor = bdi.split(":")[-1]
    if not (ctl / minor).exists() and ctl.is_dir():
        subprocess.run(["mount", "-t", "fusectl", "fusectl", str(ctl)], capture_output=True)
    try:
        (ctl / minor / "max_background").write_text(str(FUSE_MAX_BACKGROUND))
        (ctl / minor / "congestion_threshold").write_text(str(FUSE_CONGESTION_THRESHOLD))
        log.debug("FUSE connection %s: max_background %d, congestion_threshold %d", minor,
                  FUSE_MAX_BACKGROUND, FUSE_CONGESTION_THRESHOLD)
    except OSError as e:
        log.debug("cannot tune the FUSE connection (%s); keeping the kernel's limits", e)


# The most open files the daemon asks for (soft limit), when the hard limit allows it.
OPEN_FILES_WANTED = 1 << 20
# Below this, say in the log that the limit bounds how many files can be written at once.
OPEN_FILES_WARN_BELOW = 4096


def raise_open_file_limit() -> int:
    """Raise the soft limit on open files to the hard limit; returns the limit now in force.

    Every file being written, or closed and waiting for its commit, keeps its staging file open, and
    each store connection is a socket. The usual soft limit of 1,024 would make a burst of small
    writes (a `cp -r` of thousands of files closes them faster than they upload) fail with EMFILE;
    the hard limit, usually far higher, is there to be asked for.
    """
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return -1
    want = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            log.debug("open files: soft limit raised from %d to %d", soft, want)
            soft = want
        except (OSError, ValueError) as e:
            log.debug("cannot raise the open-file limit from %d: %s", soft, e)
    if soft != resource.RLIM_INFINITY and soft < OPEN_FILES_WARN_BELOW:
        log.warning("the open-file limit is %d (hard limit %d): at most about that many files can be "
                    "written or wait for their commit at once; raise it with ulimit -Hn", soft, hard)
    return soft


async def _follow_readers(allocator: Allocator, budget) -> None:
    """Let the allocator's mode follow whether files are being read (see ucfs.allocator)."""
    while True:
        await trio.sleep(HEAP_AFTER_IDLE_S / 4)
        allocator.idle(budget.readers)


async def _check_volumes(catalog: Catalog, stores: dict[str, AsyncStore]) -> None:
    """Fail fast, with one clear line, when a volume's bucket cannot be used."""
    problems: list[str] = []

    async def check(vol) -> None:
        try:
            with trio.fail_after(30):
                await stores[vol.store.name].check_bucket(vol.bucket)
        except trio.TooSlowError:
            problems.append(f"volume {vol.full_name}: store at {vol.store.endpoint_url or 'AWS'} did "
                            "not answer within 30 s")
        except errors.StoreError as e:
            where = vol.store.endpoint_url or ("AWS" if vol.store.kind == "s3" else "local disk")
            if vol.store.kind == "local":  # a directory, not a bucket: the store says what is wrong
                problems.append(f"volume {vol.full_name}: {e.strerror}")
            elif e.errno == errors.ENXIO or e.status == 404:
                problems.append(f"volume {vol.full_name}: bucket {vol.bucket!r} does not exist at {where}")
            elif e.code == "UntrustedCertificate":
                problems.append(f"volume {vol.full_name}: {e.strerror}")  # names the server
            elif e.code == "NoCredentials":  # nothing was sent: the store did not deny anything
                problems.append(f"volume {vol.full_name}: {e.strerror}, needed to sign requests to {where}")
            elif e.errno == errors.EACCES:
                problems.append(f"volume {vol.full_name}: access to bucket {vol.bucket!r} denied at "
                                f"{where} ({e.code or 'check credentials'})")
            else:
                problems.append(f"volume {vol.full_name}: store at {where} unreachable: {e.strerror}")

    async with trio.open_nursery() as n:
        for vol in catalog.volumes.values():
            n.start_soon(check, vol)
    if problems:
        raise UcfsError("; ".join(sorted(problems)))


async def serve(catalog: Catalog, cfg: MountConfig, opts: MountOptions,
                ready: Callable[[], None] | None = None) -> None:
    """Mount, serve until unmounted or signalled, then shut down in order."""
    mountpoint = check_mountpoint(opts.mountpoint)
    allocator = Allocator.tune()
    raise_open_file_limit()
    state = ensure_private_dir(opts.state_dir)
    lock = StateDirLock(state)
    lock.acquire()
    try:
        stores = {spec.name: AsyncStore(make_store(spec, cfg, access_key=opts.access_key,
                                                   secret_key=opts.secret_key), cfg.store_concurrency)
                  for spec in catalog.stores()}
        await _check_volumes(catalog, stores)
        cache = BlockCache(state / "cache", size_bytes=cfg.cache_size_bytes,
                           free_floor_bytes=cfg.cache_free_floor_bytes, block_bytes=cfg.block_bytes)
        core = Core(catalog, stores, cache, cfg)
        core.passthrough = Passthrough(cfg.passthrough)
        core.budget.on_reading = allocator.reading
        committer = Committer(state, core, cfg)
        async with trio.open_nursery() as nursery:
            core.attach(nursery)
            nursery.start_soon(trio.to_thread.run_sync, cache.scan)
            await nursery.start(committer.run)
            core.committer = committer
            watchdog = telemetry.LoopWatchdog()
            rates = telemetry.RateSampler(lambda: _byte_totals(core))
            nursery.start_soon(watchdog.run)
            nursery.start_soon(rates.run)
            nursery.start_soon(_follow_readers, allocator, core.budget)
            # The part buffers of one stream at its full window, made while the rest of the mount
            # comes up, and awaited before it is announced (BufferPool.prefill).
            prefilled = trio.Event()

            async def prefill() -> None:
                try:
                    await core.pool.prefill(cfg.prefill_buffers)
                except (OSError, MemoryError) as e:  # a speed-up only: the mount comes up without it
                    log.warning("could not make the read-ahead buffers in advance (%s); reads make "
                                "them as they need them", e)
                finally:
                    prefilled.set()

            nursery.start_soon(prefill)

            announced = trio.Event()  # the mount is tuned and announced: `ucfs status` says "ready"
            kernel: dict[str, int] = {}  # how the kernel was asked to send us reads (below)

            async def status() -> dict:
                out = core.statistics()
                # A statfs can block on a busy disk: a thread makes it, not the event loop.
                out.setdefault("commits", {}).update(await trio.to_thread.run_sync(committer.staging_space))
                out.update(watchdog.statistics())
                out["throughput_bytes_per_s"] = rates.rates()
                out.update(allocator.statistics())
                out["mountpoint"] = str(mountpoint)
                out["ready"] = announced.is_set()
                out["kernel"] = dict(kernel)
                return out

            def no_drain() -> dict:
                # `ucfs unmount --no-wait`: what is pending stays staged for the next mount, and this
                # daemon exits as soon as it is unmounted instead of draining first.
                committer.stop_draining("ucfs unmount --no-wait")
                return {"ok": True}

            await nursery.start(control.serve, mountpoint, {"status": status, "no-drain": no_drain})
            if cfg.metrics_port:
                port = await nursery.start(telemetry.serve_metrics, cfg.metrics_port, status)
                log.info("metrics at http://127.0.0.1:%d/metrics", port)
            # Everything made so far (modules, botocore's service models, the catalog) lives as long
            # as the mount. Freezing it keeps the cyclic garbage collector from walking all of it again
            # at every full collection, a pause of every thread (the GIL is held throughout) that the
            # watchdog measured at 80-140 ms under load.
            gc.collect()
            gc.freeze()
            options = {"fsname=ucfs", "subtype=ucfs", "noatime"}
            if cfg.allow_other:
                options.add("allow_other")
            # Before the mount: the kernel takes max_pages_limit into the connection it makes then.
            max_read = allow_read_requests(cfg.kernel_readahead_kib * KiB,
                                           can_ask=core.passthrough.can_hook)
            pyfuse3.init(Operations(core), str(mountpoint), options)
            # From a thread of pyfuse3's own: the kernel takes the directory's lock for it, which a
            # request being answered may hold.
            core.invalidate_entry = lambda parent_ino, name: pyfuse3.invalidate_entry_async(
                parent_ino, os.fsencode(name), ignore_enoent=True)
            core.invalidate_attrs = _invalidate_attrs
            # Before main(), where the kernel's INIT is answered.
            core.passthrough.install(max_read)
            _take_queued_requests_at_once(core)  # also before main(), where the workers start
            core.vectored_replies = core.passthrough.hooked
            if not core.passthrough.hooked:
                max_read = FUSE_DEFAULT_MAX_PAGES * PAGE_BYTES  # what libfuse asks for by itself
            # The kernel's read-ahead is capped at what one request carries: with smaller requests,
            # reading further ahead would not make them fewer, only pull more bytes around a reader
            # that jumps (a Parquet reader going from column chunk to column chunk).
            readahead_kib = min(cfg.kernel_readahead_kib, max_read // KiB)
            kernel.update(read_request_bytes=max_read, readahead_kib=readahead_kib)
            fuse_done = trio.Event()  # the FUSE loop has ended: unmounted, by us or from outside

            async def announce() -> None:
                # Ready once the kernel runs the mount as tuned (see tune_kernel_readahead).
                try:
                    await tune_kernel_readahead(mountpoint, readahead_kib)
                except Exception:  # noqa: BLE001 - tuning is best effort; the mount must come up
                    log.warning("could not tune the kernel's read-ahead on %s", mountpoint, exc_info=True)
                await prefilled.wait()
                announced.set()
                log.info("mounted %d volume(s) from %s at %s", len(catalog.volumes), catalog.source,
                         mountpoint)
                if ready is not None:
                    ready()

            try:
                nursery.start_soon(_watch_signals, committer, fuse_done)
                write_descriptor(mountpoint, catalog)
                nursery.start_soon(announce)
                # Idle tasks beyond min_tasks exit, freeing their receive buffers; keeping a few
                # spares avoids churning 1 MiB buffers through the allocator under bursty load.
                await pyfuse3.main(min_tasks=8, max_tasks=cfg.fuse_max_tasks)
            finally:
                fuse_done.set()
                remove_descriptor(mountpoint)
                pyfuse3.close(unmount=True)
            log.info("unmounted %s", mountpoint)
            with trio.CancelScope(shield=True):
                await committer.shutdown(drain=opts.drain_on_exit)
            nursery.cancel_scope.cancel()
    finally:
        lock.release()


# pyfuse3's own, kept: a later mount in this process wraps it again, not the wrapper around it.
_PYFUSE3_WAIT = getattr(pyfuse3, "_wait_fuse_readable", None)


def _take_queued_requests_at_once(core: Core) -> None:
    """pyfuse3's worker tasks read a request that is already queued without a trip through the
    event loop's poller first (ucfs.fusewait). Left as it is where that pyfuse3 lacks the wait."""
    wait = _PYFUSE3_WAIT
    fd = fuse_device_fd()
    if wait is None or fd is None:
        log.info("FUSE requests are read as pyfuse3 %s reads them (%s)", getattr(pyfuse3, "__version__", "?"),
                 "no _wait_fuse_readable" if wait is None else "no /dev/fuse descriptor found")
        return
    pyfuse3._wait_fuse_readable = fusewait.ready_first(wait, fd, core.stats)


DESCRIPTOR_VERSION = 1


def write_descriptor(mountpoint: Path, catalog: Catalog) -> Path | None:
    """Describe where this mount's S3 volumes live, for clients on this host that fetch objects
    themselves (torchio's cache fills: `torchio/_direct.py`). Locations only: a client uses its own
    credentials, and its reads still start from what the mount lists. Best effort."""
    volumes = {}
    for vol in catalog.volumes.values():
        if vol.store.kind != "s3":
            continue
        volumes["/".join((vol.catalog, vol.schema, vol.name))] = {
            "bucket": vol.bucket, "prefix": vol.prefix, "endpoint_url": vol.store.endpoint_url,
            "region": vol.store.region, "profile": vol.store.profile,
            "path_style": vol.store.path_style, "payload_signing": vol.store.payload_signing,
        }
    doc = {"version": DESCRIPTOR_VERSION, "mountpoint": str(mountpoint), "pid": os.getpid(),
           "volumes": volumes}
    path = mount_descriptor_path(mountpoint)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except OSError as e:
        log.debug("cannot write the mount descriptor %s: %s", path, e)
        return None
    return path


def remove_descriptor(mountpoint: Path) -> None:
    try:
        path = mount_descriptor_path(mountpoint)
        with open(path) as f:
            mine = json.load(f).get("pid") == os.getpid()
        if mine:  # a later mount at the same place may have replaced it
            path.unlink()
    except (OSError, ValueError):
        pass


def _byte_totals(core: Core) -> dict[str, int]:
    totals = {"read": 0, "written": 0}
    for s in core.stores.values():
        st = s.store.statistics()
        totals["read"] += st.get("get_bytes", 0)
        totals["written"] += st.get("put_bytes", 0)
    return totals


async def _watch_signals(committer: Committer, fuse_done: trio.Event) -> None:
    """The first SIGINT/SIGTERM while mounted unmounts (and the drain follows); one during the drain,
    or a second one, stops the drain."""
    unmounting = False
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if not unmounting and not fuse_done.is_set():
                unmounting = True
                log.info("received %s; unmounting", name)
                pyfuse3.terminate()
            else:
                committer.stop_draining(f"received {name}")
