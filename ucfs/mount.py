"""Lifecycle of a mount: build the parts in dependency order, run, shut down in reverse.

    stores -> cache -> committer -> core -> FUSE session

Everything runs in one trio nursery owned by `serve`. The FUSE loop ends when the file system is
unmounted (`ucfs unmount`, `fusermount3 -u`) or on SIGINT/SIGTERM; then pending commits are drained
(unless told not to), background tasks are cancelled and the session is closed.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyfuse3
import trio

from . import control, errors, telemetry
from .aiostore import AsyncStore
from .cache import BlockCache, ensure_private_dir
from .commit import Committer
from .catalog import Catalog, StoreSpec
from .config import MountConfig
from .core import Core
from .errors import UcfsError
from .fs import Operations
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


def check_mountpoint(path: Path) -> Path:
    path = path.absolute()
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


async def tune_kernel_readahead(mountpoint: Path, kib: int) -> None:
    """Let the kernel read ahead `kib` on this mount: larger, fewer FUSE read requests.

    The kernel sets the mount's read-ahead when it processes our reply to FUSE_INIT, which happens
    after the main loop has started; so look until the setting sticks. Best effort: needs root and a
    writable /sys; without it reads still work, in 128 KiB requests.
    """
    bdi = _bdi_of(mountpoint)
    if bdi is None:
        return
    path = f"/sys/class/bdi/{bdi}/read_ahead_kb"
    for _ in range(50):
        await trio.sleep(0.02)
        try:
            with open(path) as f:
                if int(f.read()) == kib:
                    log.debug("kernel read-ahead on %s is %d KiB", mountpoint, kib)
                    return
            with open(path, "w") as f:
                f.write(str(kib))
        except OSError as e:
            log.debug("cannot tune kernel read-ahead (%s); keeping the default", e)
            return


def keep_freed_memory() -> None:
    """Ask glibc to keep large freed buffers for reuse instead of returning them to the kernel.

    Every ranged GET allocates a multi-MiB buffer. By default glibc maps each one fresh and unmaps
    it when freed, so every byte read costs a page fault on top of the copy; on virtual machines that
    is the single largest CPU cost of a cold read. Reused heap memory faults once. Memory stays
    bounded by the read-ahead budget. Best effort: not glibc, nothing happens.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from malloc.h
    libc.mallopt(m_mmap_threshold, 64 << 20)
    libc.mallopt(m_trim_threshold, 1 << 30)


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
            if e.errno == errors.ENXIO or e.status == 404:
                problems.append(f"volume {vol.full_name}: bucket {vol.bucket!r} does not exist at {where}")
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
    if os.environ.get("UCFS_MALLOC_DEFAULTS") != "1":
        keep_freed_memory()
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

            def status() -> dict:
                out = core.statistics()
                out.update(watchdog.statistics())
                out["throughput_bytes_per_s"] = rates.rates()
                out["mountpoint"] = str(mountpoint)
                return out

            await nursery.start(control.serve, mountpoint, {"status": status})
            if cfg.metrics_port:
                port = await nursery.start(telemetry.serve_metrics, cfg.metrics_port, status)
                log.info("metrics at http://127.0.0.1:%d/metrics", port)
            options = {"fsname=ucfs", "subtype=ucfs", "noatime"}
            if cfg.allow_other:
                options.add("allow_other")
            pyfuse3.init(Operations(core), str(mountpoint), options)
            try:
                nursery.start_soon(tune_kernel_readahead, mountpoint, cfg.kernel_readahead_kib)
                nursery.start_soon(_watch_signals)
                log.info("mounted %d volume(s) from %s at %s", len(catalog.volumes), catalog.source,
                         mountpoint)
                if ready is not None:
                    ready()
                await pyfuse3.main(min_tasks=4, max_tasks=cfg.fuse_max_tasks)
            finally:
                pyfuse3.close(unmount=True)
            log.info("unmounted %s", mountpoint)
            with trio.CancelScope(shield=True):
                await committer.shutdown(drain=opts.drain_on_exit)
            nursery.cancel_scope.cancel()
    finally:
        lock.release()


def _byte_totals(core: Core) -> dict[str, int]:
    totals = {"read": 0, "written": 0}
    for s in core.stores.values():
        st = s.store.statistics()
        totals["read"] += st.get("get_bytes", 0)
        totals["written"] += st.get("put_bytes", 0)
    return totals


async def _watch_signals() -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s; unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return
