"""Cache fills straight from the store, for files the mount has listed.

A cold epoch copies thousands of small files. Through the mount each one costs the daemon a lookup,
an open, reads, a release and a cache write: several milliseconds of its CPU per file, which on a
small host caps a cold epoch at a few hundred files per second however many copies are in flight.
The bytes themselves come from one GET. So when the mount says where a volume lives, the cache's
I/O threads send that GET themselves, with the process's own AWS credentials, and the mount serves
only the listing.

**Where.** A running mount writes a descriptor next to its control socket
(`ucfs.config.mount_descriptor_path`): for each S3 volume its bucket, prefix and endpoint, never
credentials. A path under the mountpoint maps to ``(bucket, prefix + rest)`` exactly as the mount
maps it. No descriptor, a daemon that is gone, a local-directory volume: no direct fills.

**Which version.** The file's identity in the cache is the size and mtime the mount listed. The
mount reports a stored object's Last-Modified cut to the second, and a file written on this host
(staged or committed, until a remount) its local mtime, which is not a whole second. So a direct
fill is tried only for a whole-second mtime, and its bytes are kept only when the GET's size and
Last-Modified are those the mount listed. Anything else -- a local version, an object changed since the listing, an
error -- falls back to copying through the mount, which knows the newest state of the file. Access
is the mount's first: only files the mount let this user list are fetched at all; a store that
refuses our credentials switches direct fills off for the process (one log line).

``UCFS_TORCHIO_DIRECT=0`` (or ``UCVolumeDataset(direct=False)``) turns this off.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import threading

from ucfs import errors
from ucfs.config import mount_descriptor_path

log = logging.getLogger(__name__)

NS_PER_S = 1_000_000_000
# Files larger than this go through the mount: they are read in parallel ranged GETs there, and a
# whole-object GET into memory would hold that much per I/O thread.
DIRECT_MAX_BYTES = 64 << 20


def enabled_by_env() -> bool:
    return os.environ.get("UCFS_TORCHIO_DIRECT", "1").strip().lower() not in ("0", "false", "no", "off")


def find_mountpoint(path: str) -> str | None:
    """The mountpoint of the ucfs mount holding `path`, or None when it is not on one."""
    best = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, fstype = left.split(), right.split(" ", 1)[0]
                if fstype != "fuse.ucfs" or len(fields) < 5:
                    continue
                mp = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
                if (path == mp or path.startswith(mp.rstrip("/") + "/")) and (best is None or len(mp) > len(best)):
                    best = mp
    except OSError:
        return None
    return best


class DirectSource:
    """GETs of listed files from the store a mount describes. Picklable; stores are per process."""

    def __init__(self, mountpoint: str, volumes: dict[str, dict], io_threads: int):
        self.mountpoint = mountpoint.rstrip("/") or "/"
        self.volumes = volumes
        self.io_threads = max(1, io_threads)
        self._init_local()

    @classmethod
    def discover(cls, path: str, io_threads: int) -> "DirectSource | None":
        """The direct source for files under `path`, or None (not on a mount that describes itself,
        or nothing to fetch directly)."""
        mp = find_mountpoint(os.path.abspath(path))
        if mp is None:
            return None
        try:
            with open(mount_descriptor_path(mp)) as f:
                doc = json.load(f)
            os.kill(int(doc["pid"]), 0)  # the daemon that wrote it still runs
            volumes = doc["volumes"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.debug("no direct fills under %s: %s", mp, e)
            return None
        if os.path.realpath(str(doc.get("mountpoint"))) != os.path.realpath(mp) or not volumes:
            return None
        # Import the store (boto3, ~0.3 s of CPU) here, once: DataLoader workers forked from this
        # process then start with it loaded instead of each importing it during epoch 1.
        importlib.import_module("ucfs.store")
        return cls(mp, volumes, io_threads)

    def _init_local(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._stores: dict[tuple, object] = {}
        self._off_why: str | None = None

    def __getstate__(self) -> dict:
        return {"mountpoint": self.mountpoint, "volumes": self.volumes, "io_threads": self.io_threads}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_local()

    def locate(self, path: str) -> tuple[dict, str, str] | None:
        """(volume description, bucket, key) of a file path on the mount, or None."""
        if not path.startswith(self.mountpoint.rstrip("/") + "/"):
            return None
        parts = path[len(self.mountpoint.rstrip("/")) + 1:].split("/")
        if len(parts) < 4:
            return None
        vol = self.volumes.get("/".join(parts[:3]))
        if vol is None:
            return None
        return vol, vol["bucket"], vol["prefix"] + "/".join(parts[3:])

    def _store(self, vol: dict):
        if self._pid != os.getpid():  # forked: connections and locks are the parent's
            self._init_local()
        spec = (vol.get("endpoint_url"), vol.get("region"), vol.get("profile"),
                bool(vol.get("path_style", True)), bool(vol.get("payload_signing", False)))
        with self._lock:
            store = self._stores.get(spec)
            if store is None:
                from ucfs.store import S3Store
                # Fail fast: every failure here falls back to a copy through the mount, which works.
                store = S3Store(endpoint_url=spec[0], region=spec[1], profile=spec[2],
                                path_style=spec[3], payload_signing=spec[4],
                                concurrency=self.io_threads, max_attempts=2, connect_timeout_s=2.0)
                self._stores[spec] = store
            return store

    def fetch(self, path: str, size: int, mtime_ns: int) -> bytes | memoryview | None:
        """The bytes of the version the mount listed (`size`, `mtime_ns`), or None: fetch it
        through the mount instead."""
        if self._off_why is not None or size > DIRECT_MAX_BYTES or size == 0 or mtime_ns % NS_PER_S:
            return None
        where = self.locate(path)
        if where is None:
            return None
        vol, bucket, key = where
        try:
            data, info = self._store(vol).get(bucket, key, 0, size)
        except errors.StoreError as e:
            if e.errno in (errors.EACCES, errors.EPERM) or _unreachable(e):
                # Refused credentials, or a store this process cannot reach (another network
                # namespace, a proxy only the daemon has): every file would pay for it again.
                self._off_why = str(e)
                log.warning("direct fills from the store are off for this process (%s); copying "
                            "through the mount instead", e)
            else:
                log.debug("direct fill of %s failed (%s); copying through the mount", path, e)
            return None
        except Exception as e:  # noqa: BLE001 - whatever goes wrong here, the mount can still serve it
            log.debug("direct fill of %s failed (%r); copying through the mount", path, e)
            return None
        if info.size != size or info.mtime_ns != mtime_ns or len(data) != size:
            log.debug("%s: the store has another version than the mount listed; copying through "
                      "the mount", path)
            return None
        return data

    def statistics(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for store in self._stores.values():
            for k, v in store.statistics().items():
                out[k] = out.get(k, 0) + v
        return out


def _unreachable(e: Exception) -> bool:
    """Whether a store error says the endpoint cannot be reached at all (no HTTP answer)."""
    return isinstance(e, errors.StoreError) and e.transient and not e.status
