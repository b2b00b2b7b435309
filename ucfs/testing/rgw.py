"""Throw-away single-node Ceph RADOS Gateway (RGW) on loopback, for tests and benchmarks.

One mon, one OSD (``memstore``: data in RAM, or a file-backed ``bluestore``), one radosgw with
the beast frontend, all bound to 127.0.0.1, every file under one work directory, every command
given this cluster's own config file.  Nothing touches /etc/ceph or /var/lib/ceph, so several
servers (and other people's clusters) can run side by side.  See DESIGN.md section 4.

Start-up recipe (about 1 s on 2 cores), chosen because each step is the cheapest that works:

1. Write ``ceph.conf`` (fsid, mon address, cephx off, size-1 pools, quiet logs).
2. ``ceph-osd --mkfs --no-mon-config`` runs in the background (it needs no mon and no osd
   id in the map) while ``monmaptool --create`` and ``ceph-mon --mkfs`` run.
3. Start ``ceph-mon -f`` and ``ceph-osd -f`` at once.  No ``ceph osd new`` (a Python CLI
   call costs ~0.35 s): with cephx off, an OSD that is not in the map yet registers itself
   (``osd create`` + ``osd crush create-or-move``) when it boots.
4. Wait until the OSD's admin socket says ``state: active``.  This matters: a librados client
   started before the OSD is up parks its first op until the objecter's next 5 s tick, so
   starting radosgw early made start-up ~1 s or ~6 s at random.
5. Start ``radosgw -f``; it creates the realm/zone and its pools.  Once it answers HTTP, run
   ``radosgw-admin user create`` (not concurrently with radosgw's own zone bootstrap), then
   wait for a SigV4-signed ListBuckets with the new keys to return 200.

Things about RGW 16.2 that tests should know (measured with this setup):

- CompleteMultipartUpload answers with an empty ``<ETag></ETag>``; HeadObject has the real
  ``"<md5>-<parts>"`` ETag.
- GetObject/HeadObject with ``If-Match`` work (412 on mismatch), ``If-None-Match`` gives 304.
- PutObject with ``If-Match: "<etag>"`` (quoted, as S3 sends ETags) gets 412 even when it
  matches; the same ETag *unquoted* is compared correctly (200 / 412).  ``If-None-Match: *``
  works (412 if the key exists).  Conditional CopyObject headers are ignored.
- The ``get`` perf counter counts HEAD requests too; see :meth:`RGWServer.perf_counters`.
- botocore's default upload checksums work over plain HTTP (sent as a header, ignored), but
  its HTTPS form (aws-chunked body + trailer) is refused with 411; configure clients with
  ``request_checksum_calculation="when_required"``.

Usage::

    with RGWServer() as srv:
        ep = srv.endpoint            # S3Endpoint(url, access_key, secret_key, region)
        ...
        srv.perf_counters()          # {'get': n, 'put': n, 'req': n, ...}

    python -m ucfs.testing.rgw [--port N] [--objectstore memstore|bluestore] [--dir D]
    python -m ucfs.testing.rgw --selfcheck

Only the standard library is used here; :func:`selfcheck` uses the boto3 clients of ucfs.store.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import ctypes
import ctypes.util
import datetime
import hashlib
import hmac
import http.client
import json
import logging
import os
import queue
import secrets
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass

log = logging.getLogger(__name__)

__all__ = ["RGWError", "S3Endpoint", "RGWServer", "selfcheck", "main"]

INSTALL_HINT = "apt-get install radosgw ceph-mon ceph-osd ceph-common"
_BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool")
_RGW_NAME = "client.rgw"  # radosgw's entity name; its config section and asok name follow
_UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the NUL


class RGWError(RuntimeError):
    """The RGW test server could not be started or queried (one-line message + log tail)."""


@dataclass(frozen=True)
class S3Endpoint:
    url: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """The usual AWS_* variables that point boto3/aws-cli/etc. at this endpoint."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
        }


# --------------------------------------------------------------------------------------------
# Child processes: die with us, even if we are SIGKILLed.

_PR_SET_PDEATHSIG = 1
_libc_prctl = None


def _resolve_prctl():
    # Resolve the libc symbol in the parent: the preexec_fn runs between fork and exec, where
    # loading a library (malloc, locks) could deadlock if another thread held those locks.
    global _libc_prctl
    if _libc_prctl is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc_prctl = libc.prctl
    return _libc_prctl


def _make_preexec():
    prctl = _resolve_prctl()
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # parent died before prctl took effect
            os._exit(1)

    return preexec


class _Spawner:
    """Runs every Popen on one long-lived daemon thread.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process.
    Forking from the caller's thread would kill the daemons as soon as, say, a thread-pool
    worker that called start() finishes.  This thread lives until the process exits.
    """

    _lock = threading.Lock()
    _queue = None

    @classmethod
    def popen(cls, argv: list[str], **kwargs) -> subprocess.Popen:
        with cls._lock:
            if cls._queue is None:
                cls._queue = queue.SimpleQueue()
                threading.Thread(target=cls._loop, name="rgw-spawner", daemon=True).start()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        cls._queue.put((argv, kwargs, fut))
        return fut.result()

    @classmethod
    def _loop(cls) -> None:
        while True:
            argv, kwargs, fut = cls._queue.get()
            try:
                fut.set_result(subprocess.Popen(argv, preexec_fn=_make_preexec(), **kwargs))
            except BaseException as e:  # e.g. FileNotFoundError: hand it to the caller
                fut.set_exception(e)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # A caller's CEPH_ARGS/CEPH_CONF would be merged into every command line; keep them out.
    env.pop("CEPH_ARGS", None)
    env.pop("CEPH_CONF", None)
    return env


def _free_port() -> int:
    # Bind-then-release: racy by nature, so callers retry when the daemon fails to bind.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, n: int = 20) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    return [ln for ln in lines if ln.strip()][-n:]


# --------------------------------------------------------------------------------------------
# Tiny S3 client for readiness checks: SigV4 over http.client, no boto3.


def _sigv4_request(ep: S3Endpoint, method: str, path: str = "/", timeout: float = 5.0):
    """Send a signed, empty-body request; return (status, body)."""
    u = urllib.parse.urlsplit(ep.url)
    now = datetime.datetime.now(datetime.timezone.utc)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    payload_hash = hashlib.sha256(b"").hexdigest()
    headers = {"host": u.netloc, "x-amz-content-sha256": payload_hash, "x-amz-date": amz_date}
    signed = ";".join(sorted(headers))
    canonical = "\n".join([
        method,
        urllib.parse.quote(path, safe="/-_.~"),
        "",  # no query string
        "".join(f"{k}:{headers[k]}\n" for k in sorted(headers)),
        signed,
        payload_hash,
    ])
    scope = f"{day}/{ep.region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                         hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + ep.secret_key).encode()
    for part in (day, ep.region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={ep.access_key}/{scope}, "
                                f"SignedHeaders={signed}, Signature={sig}")
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request(method, path, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


# --------------------------------------------------------------------------------------------
# Admin socket: same protocol as `ceph daemon <asok> ...`, without the 0.3 s Python CLI start.


def admin_socket(path: str, command: dict, timeout: float = 5.0) -> dict:
    """Send one JSON command to a Ceph admin socket and return the decoded JSON reply.

    Protocol: the command is JSON terminated by NUL; the reply is a 4-byte big-endian length
    followed by that many bytes, then the daemon closes the connection.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(json.dumps(command).encode() + b"\0")
        chunks = []
        while True:
            c = s.recv(65536)
            if not c:
                break
            chunks.append(c)
    data = b"".join(chunks)
    if len(data) < 4:
        raise RGWError(f"empty reply from admin socket {path} for {command}")
    (n,) = struct.unpack(">I", data[:4])
    body = data[4:4 + n]
    try:
        return json.loads(body) if body.strip() else {}
    except ValueError:
        raise RGWError(f"admin socket {path}: {body[:200]!r}") from None


# --------------------------------------------------------------------------------------------


class RGWServer:
    """A single-node Ceph cluster + radosgw on 127.0.0.1, owned by this process.

    ``workdir``: where the cluster lives; default a fresh ``tempfile.mkdtemp(prefix="ucfs-rgw-")``.
    A workdir we created is removed by :meth:`stop` unless ``keep=True``; a workdir given by the
    caller is kept unless ``keep=False``.  It must be empty (or not exist).
    ``port``: the S3 port; 0 picks a free one (and retries on a bind race).
    ``objectstore``: ``memstore`` (RAM; ~1.5-2x the bytes stored; ``memstore_bytes`` is the
    capacity the OSD reports, not an allocation) or ``bluestore`` (a sparse ``bluestore_bytes``
    block file under the workdir, for data sets bigger than RAM).
    ``log_dir``: daemon logs (default ``<workdir>/log``); give one outside the workdir to keep
    logs after stop().
    ``ops_log``: also write RGW's per-request ops log (JSON lines) to ``<log_dir>/rgw-ops.log``,
    read with :meth:`ops_log`.  Off by default: it grows ~0.7 KB per request.
    ``debug``: verbose daemon logs (rgw at level 20, the rest at 1), for diagnosing the server
    itself; also enabled by the environment variable ``UCFS_RGW_DEBUG=1``.

    memstore keeps everything in the OSD's RAM; past 95% of ``memstore_bytes`` the cluster
    reports itself full and writes fail.  Deleted objects' tails are freed by RGW's garbage
    collector about 1-2 minutes later.
    """

    def __init__(self, workdir: str | None = None, *, port: int = 0, objectstore: str = "memstore",
                 memstore_bytes: int = 8 << 30, log_dir: str | None = None,
                 bluestore_bytes: int = 200 << 30, keep: bool | None = None,
                 ops_log: bool = False, debug: bool | None = None, gc_period_s: int = 60):
        if objectstore not in ("memstore", "bluestore"):
            raise ValueError(f"objectstore must be 'memstore' or 'bluestore', not {objectstore!r}")
        self._given_workdir = workdir
        self._want_port = int(port)
        self.objectstore = objectstore
        self.memstore_bytes = int(memstore_bytes)
        self.bluestore_bytes = int(bluestore_bytes)
        # How often radosgw's garbage collector frees what deleted objects held. A benchmark sets it
        # long and calls collect_garbage() between measurements instead: the collector freeing a
        # deleted GiB in the middle of a measured upload costs the OSD twice that upload's CPU.
        self.gc_period_s = int(gc_period_s)
        self._given_log_dir = log_dir
        self._keep = keep
        self._ops_log_enabled = ops_log
        self.debug = debug if debug is not None else os.environ.get("UCFS_RGW_DEBUG") == "1"

        self.workdir: str | None = None
        self.log_dir: str | None = None
        self.conf: str | None = None  # path of this cluster's ceph.conf (for `ceph -c ...`)
        self.port: int | None = None
        self.mon_port: int | None = None
        self._fsid = ""
        self._endpoint: S3Endpoint | None = None
        self._procs: dict[str, subprocess.Popen] = {}
        self._created_workdir = False
        self._lock = threading.Lock()
        self._stopped = True

    # ---- public API --------------------------------------------------------------------------

    @property
    def endpoint(self) -> S3Endpoint:
        if self._endpoint is None:
            raise RGWError("RGW server not started")
        return self._endpoint

    def start(self, timeout_s: float = 60) -> S3Endpoint:
        """Bring the cluster up; return once a signed ListBuckets with our keys succeeds."""
        missing = [b for b in _BINARIES if shutil.which(b) is None]
        if missing:
            raise RGWError(f"radosgw not installed (missing {', '.join(missing)}): {INSTALL_HINT}")
        if self._endpoint is not None:
            return self._endpoint
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        self._stopped = False
        atexit.register(self.stop)
        try:
            self._prepare_dirs()
            for attempt in range(3):
                try:
                    self._start_cluster(deadline)
                    break
                except _PortInUse as e:
                    # Someone grabbed the mon port between our probe and ceph-mon's bind.
                    log.info("mon port %s taken (%s); retrying with another", self.mon_port, e)
                    self._kill_all()
                    self._reset_cluster_dirs()
                    if attempt == 2:
                        raise RGWError(f"ceph-mon could not bind a port: {e}") from None
            self._start_rgw(deadline)
        except BaseException:
            self.stop()
            raise
        log.info("RGW ready at %s in %.2fs (%s, workdir %s)", self._endpoint.url,
                 time.monotonic() - t0, self.objectstore, self.workdir)
        return self._endpoint

    def stop(self) -> None:
        """Kill all daemons and remove the workdir (unless kept).  Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        atexit.unregister(self.stop)
        self._kill_all()
        self._endpoint = None
        if self.workdir and self._should_remove_workdir():
            shutil.rmtree(self.workdir, ignore_errors=True)
        elif self.workdir:
            log.info("kept RGW workdir %s", self.workdir)

    def alive(self) -> bool:
        """True while every daemon is still running."""
        return bool(self._procs) and all(p.poll() is None for p in self._procs.values())

    def collect_garbage(self, timeout_s: float = 300) -> None:
        """Reclaim now what deleted objects still hold (``radosgw-admin gc process --include-all``),
        instead of after ``rgw gc obj min wait``. memstore keeps it in RAM meanwhile: a benchmark
        that writes and deletes gigabytes round after round would otherwise run its later rounds
        short of memory."""
        self._run(["radosgw-admin", "-c", self.conf, "gc", "process", "--include-all"],
                  time.monotonic() + timeout_s, what="radosgw-admin-gc")

    def perf_counters(self) -> dict[str, int]:
        """radosgw's request counters (the ``rgw`` section of ``perf dump``), as ints.

        Meaning in Ceph 16.2 (measured):
          ``req``        every S3 request, signed or anonymous, including failed ones
          ``failed_req`` requests that failed before/at their op (e.g. GET of a missing key: 404)
          ``get``        GetObject *and HeadObject* (both are RGWGetObj), ranged or not, incl.
                         conditional ones answered 304/412; not a 404 on a missing key
          ``get_b``      body bytes sent by those GETs - one less than sent per request
                         (16.2 adds ``end - ofs`` of an inclusive range)
          ``put``        PutObject and UploadPart (RGWPutObj), incl. empty bodies; not
                         CopyObject, CreateMultipartUpload or CompleteMultipartUpload
          ``put_b``      body bytes received by those PUTs
          ``qlen``/``qactive``  requests queued / in flight now
          ``cache_hit``/``cache_miss``  RGW's metadata cache (users, buckets)
        ListObjects, DeleteObject(s), CopyObject, bucket ops only count in ``req``.  For exact
        per-operation counts (e.g. GET without HEAD) use ``ops_log=True`` and :meth:`ops_log`.
        """
        reply = self._rgw_asok({"prefix": "perf dump", "logger": "rgw"})
        section = reply.get("rgw")
        if section is None:  # older daemons ignore the logger filter and dump everything
            section = self._rgw_asok({"prefix": "perf dump"}).get("rgw", {})
        return {k: int(v) for k, v in section.items() if isinstance(v, (int, float))}

    def reset_perf_counters(self) -> None:
        """Zero radosgw's counters (``perf reset all``), e.g. before a measured phase."""
        self._rgw_asok({"prefix": "perf reset", "var": "all"})

    def ops_log(self, min_entries: int = 0, timeout_s: float = 2.0) -> list[dict]:
        """Parsed RGW ops-log entries (needs ``ops_log=True``), oldest first.

        Each entry has ``operation`` (get_obj, put_obj, list_bucket, copy_obj, delete_obj,
        init_multipart, complete_multipart, ...), ``uri`` ("HEAD /bucket/key HTTP/1.1"),
        ``http_status``, ``bytes_sent``, ``bytes_received``, ``bucket``, ``object_size``, ...
        RGW appends an entry a few ms *after* sending the response, and logs nothing for
        requests that name no bucket (ListBuckets), so this waits up to ``timeout_s`` for at
        least ``min_entries`` entries.
        """
        if not self._ops_log_enabled:
            raise RGWError("ops log not enabled: construct RGWServer(..., ops_log=True)")
        path = os.path.join(self.log_dir, "rgw-ops.log")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    lines = f.read().splitlines()
            except FileNotFoundError:
                lines = []
            if len(lines) >= min_entries or time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        out = []
        for ln in lines:
            try:
                out.append(json.loads(ln))
            except ValueError:
                pass  # a line being written right now
        return out

    def __enter__(self) -> RGWServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = self._endpoint.url if self._endpoint else "stopped"
        return f"<RGWServer {self.objectstore} {state} workdir={self.workdir}>"

    # ---- start-up steps ----------------------------------------------------------------------

    def _prepare_dirs(self) -> None:
        if self._given_workdir:
            self.workdir = os.path.abspath(self._given_workdir)
            self._check_socket_path()
            os.makedirs(self.workdir, exist_ok=True)
            if os.listdir(self.workdir):
                raise RGWError(f"workdir {self.workdir} is not empty")
        else:
            self.workdir = tempfile.mkdtemp(prefix="ucfs-rgw-")
            self._created_workdir = True
        self.log_dir = os.path.abspath(self._given_log_dir or os.path.join(self.workdir, "log"))
        os.makedirs(self.log_dir, exist_ok=True)
        self.conf = os.path.join(self.workdir, "ceph.conf")
        self._check_socket_path()
        self._reset_cluster_dirs()

    def _check_socket_path(self) -> None:
        longest = os.path.join(self.workdir, "run", f"{_RGW_NAME}.asok")
        if len(longest.encode()) > _UNIX_PATH_MAX:
            raise RGWError(f"workdir path too long for a unix socket: {longest}")

    def _reset_cluster_dirs(self) -> None:
        for sub in ("run", "mon", "osd", "rgw"):
            shutil.rmtree(os.path.join(self.workdir, sub), ignore_errors=True)
            os.makedirs(os.path.join(self.workdir, sub))
        os.makedirs(os.path.join(self.workdir, "osd", "osd.0"))

    def _write_conf(self) -> None:
        w, logs = self.workdir, self.log_dir
        quiet = "1/5" if self.debug else "0/0"
        g = {
            "fsid": self._fsid,
            "mon host": f"v2:127.0.0.1:{self.mon_port}",
            # cephx off everywhere: nothing to bootstrap, and a single process owns it all.
            "auth cluster required": "none",
            "auth service required": "none",
            "auth client required": "none",
            "keyring": "/dev/null",
            # Loopback only, msgr2 only (one port per daemon role instead of two).
            "public network": "127.0.0.1/32",
            "ms bind ipv6": "false",
            "ms bind msgr1": "false",
            # Everything under the workdir (not /var/run/ceph, /var/log/ceph).
            "run dir": f"{w}/run",
            "admin socket": f"{w}/run/$name.asok",
            "log file": f"{logs}/$name.log",
            "log to stderr": "false",
            "err to stderr": "true",
            "mon data": f"{w}/mon/$name",
            "osd data": f"{w}/osd/$name",
            "rgw data": f"{w}/rgw",
            # One OSD: size-1 pools, CRUSH picks OSDs not hosts, small PG counts for quick
            # pool creation, and no PG-per-OSD limit hit by RGW's ~8 pools.
            "osd pool default size": "1",
            "osd pool default min size": "1",
            "mon allow pool size one": "true",
            "osd crush chooseleaf type": "0",
            "osd pool default pg num": "8",
            "osd pool default pgp num": "8",
            "osd pool default pg autoscale mode": "off",
            "mon max pg per osd": "1000",
            # Health warnings that are expected here; and never shut the mon down because
            # the shared disk is nearly full (mon data avail crit defaults to 5%). Not 0: the mon
            # compares the whole percent free, so with under 1 % free (2.5 GB of a 252 GB disk)
            # 0 refused to start ("available: 0%"), and with it every integration test.
            "mon warn on pool no redundancy": "false",
            "mon data avail warn": "1",
            "mon data avail crit": "-1",
            # Quiet logs: errors still land in <log_dir>/<name>.log.
            **{f"debug {s}": ("20/20" if self.debug and s == "rgw" else quiet)
               for s in ("rgw", "ms", "mon", "paxos", "osd", "bluestore", "bluefs", "rocksdb",
                         "memstore", "objecter", "rados", "monc", "auth", "asok")},
        }
        mon = {
            # Commit paxos proposals almost at once: start-up ~1 s instead of ~10 s.
            "paxos propose interval": "0.01",
            "paxos min wait": "0.01",
            # If another process took our mon port, exit at once (we retry with another
            # port) instead of retrying the same port 3 times 5 s apart.  (0 here means
            # "never even try".)
            "ms bind retry count": "1",
            "ms bind retry delay": "1",
        }
        osd = {
            "osd objectstore": self.objectstore,
            # RGW stripes objects into <= 4 MiB RADOS objects, but leave headroom for any
            # future change of rgw max chunk/stripe size.
            "osd max object size": str(1 << 30),
        }
        if self.objectstore == "memstore":
            osd["memstore device bytes"] = str(self.memstore_bytes)
            # Judge fullness by the bytes the placement groups hold, not by memstore's own running
            # count: that count can drift below zero (seen once at the end of a full test run: the
            # OSD reported 2^64 - 47,906 bytes used, engaged its failsafe at "-2147483648% full",
            # and every write after it timed out). Ceph offers this switch for test clusters; the
            # limit still stands at memstore_bytes of stored data.
            osd["fake statfs for testing"] = str(self.memstore_bytes)
        else:
            osd.update({
                # No "bluestore block path": mkfs then creates <osd data>/block itself, as a
                # sparse file (ftruncate) of "bluestore block size" bytes.
                "bluestore block create": "true",
                "bluestore block size": str(self.bluestore_bytes),
                "bluestore fsck on mkfs": "false",
                "bluestore fsck on mount": "false",
                "osd memory target": str(2 << 30),
            })
        client = {
            # Without these in radosgw's own section it loops on an auth error (DESIGN.md 4).
            "auth client required": "none",
            "ms mon client mode": "crc",
        }
        rgw = dict(client)
        rgw.update({
            # tcp_nodelay: without it every LIST and empty-body PUT waits ~40 ms (Nagle).
            "rgw frontends": f"beast endpoint=127.0.0.1:{self.port} tcp_nodelay=1",
            "rgw max chunk size": str(4 << 20),
            "rgw obj stripe size": str(4 << 20),
            # No background index resharding while tests run.
            "rgw dynamic resharding": "false",
            # Reclaim deleted objects' tails within ~2 min, not 2 h (memstore is RAM).
            "rgw gc obj min wait": str(min(60, self.gc_period_s)),
            "rgw gc processor period": str(self.gc_period_s),
        })
        if self._ops_log_enabled:
            rgw.update({
                "rgw enable ops log": "true",
                "rgw ops log rados": "false",
                "rgw ops log file path": os.path.join(logs, "rgw-ops.log"),
            })
        sections = {"global": g, "mon": mon, "osd": osd, "client": client, _RGW_NAME: rgw}
        with open(self.conf, "w") as f:
            for name, opts in sections.items():
                f.write(f"[{name}]\n")
                for k, v in opts.items():
                    f.write(f"{k} = {v}\n")
                f.write("\n")

    def _start_cluster(self, deadline: float) -> None:
        self._fsid = str(uuid.uuid4())
        self.mon_port = _free_port()
        if self.port is None:
            self.port = self._want_port or _free_port()
        self._write_conf()
        w = self.workdir
        monmap = os.path.join(w, "monmap")
        # The OSD's mkfs needs neither the mon nor an osd id in the map (--no-mon-config),
        # so it runs while the monmap and mon store are made.  (bluestore mkfs takes longest.)
        osd_mkfs = self._spawn("osd-mkfs", ["ceph-osd", "-c", self.conf, "-i", "0", "--mkfs",
                                            "--osd-uuid", str(uuid.uuid4()), "--no-mon-config"],
                               daemon=False)
        self._run(["monmaptool", "--create", "--clobber", "--fsid", self._fsid,
                   "--addv", "a", f"[v2:127.0.0.1:{self.mon_port}]", monmap], deadline)
        self._run(["ceph-mon", "-c", self.conf, "--mkfs", "-i", "a", "--monmap", monmap],
                  deadline)
        self._wait_proc(osd_mkfs, "ceph-osd --mkfs", deadline, "osd-mkfs", "osd.0")
        log.debug("mkfs done")
        self._spawn("mon.a", ["ceph-mon", "-c", self.conf, "-i", "a", "-f"])
        self._spawn("osd.0", ["ceph-osd", "-c", self.conf, "-i", "0", "-f"])
        self._wait_osd_active(deadline)
        log.debug("osd.0 active")

    def _wait_osd_active(self, deadline: float) -> None:
        asok = os.path.join(self.workdir, "run", "osd.0.asok")
        while True:
            self._check_daemons()
            try:
                if admin_socket(asok, {"prefix": "status"}, timeout=2).get("state") == "active":
                    return
            except (OSError, RGWError):
                pass  # socket not there yet
            if time.monotonic() > deadline:
                raise self._failure("timed out waiting for the OSD to come up", "osd.0")
            time.sleep(0.02)

    def _start_rgw(self, deadline: float) -> None:
        access = "UCFS" + secrets.token_hex(8).upper()
        secret = secrets.token_urlsafe(30)
        user_created = False
        for attempt in range(5):
            ep = S3Endpoint(f"http://127.0.0.1:{self.port}", access, secret)
            self._spawn("rgw", ["radosgw", "-c", self.conf, "-n", _RGW_NAME, "-f"])
            try:
                self._wait_http(ep, deadline, anonymous=True)
                log.debug("radosgw answers HTTP")
                if not user_created:
                    # After radosgw answers, so that the two never race to create the
                    # default zone/zonegroup.
                    self._run(["radosgw-admin", "-c", self.conf, "user", "create",
                               "--uid", "ucfs", "--display-name", "ucfs test user",
                               "--access-key", access, "--secret", secret,
                               "--max-buckets", "10000"], deadline, what="radosgw-admin")
                    user_created = True
                    log.debug("S3 user created")
                self._wait_http(ep, deadline, anonymous=False)
                self._endpoint = ep
                return
            except _PortInUse:
                if self._want_port or attempt == 4:
                    raise self._failure(f"radosgw could not bind 127.0.0.1:{self.port}",
                                        _RGW_NAME) from None
                log.info("RGW port %s taken; retrying with another", self.port)
                self.port = _free_port()
                self._write_conf()

    def _wait_http(self, ep: S3Endpoint, deadline: float, anonymous: bool) -> None:
        last = "no answer"
        while True:
            proc = self._procs["rgw"]
            if proc.poll() is not None:
                tail = "\n".join(_tail(os.path.join(self.log_dir, f"{_RGW_NAME}.log"), 50)
                                 + _tail(os.path.join(self.log_dir, "rgw.out"), 50))
                del self._procs["rgw"]
                if "Address already in use" in tail or "failed to bind" in tail:
                    raise _PortInUse(tail)
                raise self._failure(f"radosgw exited with status {proc.returncode}", _RGW_NAME)
            try:
                if anonymous:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                    try:
                        conn.request("GET", "/")
                        resp = conn.getresponse()
                        resp.read()
                        status = resp.status
                    finally:
                        conn.close()
                else:
                    status, body = _sigv4_request(ep, "GET", "/", timeout=2)
                    last = f"HTTP {status}: {body[:200]!r}"
                if status == 200:
                    return
            except OSError as e:
                last = str(e)
            if time.monotonic() > deadline:
                raise self._failure(f"timed out waiting for radosgw on port {self.port} "
                                    f"({'anonymous' if anonymous else 'signed'} "
                                    f"ListBuckets: {last})", _RGW_NAME)
            time.sleep(0.01)

    # ---- processes ---------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], daemon: bool = True) -> subprocess.Popen:
        out = open(os.path.join(self.log_dir, f"{name}.out"), "ab")
        try:
            proc = _Spawner.popen(
                argv, cwd=self.workdir, env=_child_env(), stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT,
                # Own session/process group: a terminal's Ctrl-C reaches only us, we stop the
                # daemons in order; and killpg reaches anything a daemon might fork.
                start_new_session=True)
        finally:
            out.close()
        if daemon:
            self._procs[name] = proc
        log.debug("started %s (pid %d): %s", name, proc.pid, " ".join(argv))
        return proc

    def _run(self, argv: list[str], deadline: float, what: str | None = None) -> None:
        what = what or argv[0]
        proc = self._spawn(what, argv, daemon=False)
        self._wait_proc(proc, what, deadline, what)

    def _wait_proc(self, proc: subprocess.Popen, what: str, deadline: float, *log_names: str):
        try:
            rc = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _killpg(proc, signal.SIGKILL)
            proc.wait()
            raise self._failure(f"{what} timed out", *log_names) from None
        if rc != 0:
            raise self._failure(f"{what} failed with status {rc}", *log_names)

    def _check_daemons(self) -> None:
        for name, proc in list(self._procs.items()):
            if proc.poll() is not None:
                tail = "\n".join(self._log_tail(name, n=50))
                if name == "mon.a" and "unable to bind" in tail:
                    raise _PortInUse(tail.splitlines()[-1] if tail else "")
                raise self._failure(f"{name} exited with status {proc.returncode}", name)

    def _kill_all(self) -> None:
        procs = self._procs
        self._procs = {}
        # One at a time, radosgw first: with the mon already gone, radosgw's clean shutdown
        # hangs on it until the grace period ends (~3 s instead of ~0.6 s in total).
        order = sorted(procs.items(), key=lambda kv: {"rgw": 0, "osd.0": 1}.get(kv[0], 2))
        for name, proc in order:
            # A memstore OSD would write all its data into the osd dir on a clean shutdown;
            # the data is being thrown away, so it gets SIGKILL straight away.
            if name == "osd.0" and self.objectstore == "memstore":
                _killpg(proc, signal.SIGKILL)
            else:
                _killpg(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=3.0)
            except subprocess.TimeoutExpired:
                log.debug("%s did not exit on SIGTERM; killing", name)
                _killpg(proc, signal.SIGKILL)
                proc.wait()
            _killpg(proc, signal.SIGKILL)  # anything left in its process group

    def _should_remove_workdir(self) -> bool:
        return not self._keep if self._keep is not None else self._created_workdir

    # ---- diagnostics -------------------------------------------------------------------------

    def _rgw_asok(self, command: dict) -> dict:
        if self._endpoint is None:
            raise RGWError("RGW server not started")
        return admin_socket(os.path.join(self.workdir, "run", f"{_RGW_NAME}.asok"), command)

    def _log_tail(self, *names: str, n: int = 20) -> list[str]:
        """Last lines of each named daemon's log file and captured stdout/stderr."""
        lines = []
        for name in names:
            files = [f"{name}.log", f"{name}.out"] + (["rgw.out"] if name == _RGW_NAME else [])
            for fn in files:
                lines += _tail(os.path.join(self.log_dir or "", fn), n)
        # "err to stderr" puts error lines in both the .log and the .out file.
        return list(dict.fromkeys(lines))[-n:]

    def _failure(self, message: str, *log_names: str) -> RGWError:
        tail = self._log_tail(*log_names)
        text = f"{message} (logs in {self.log_dir})"
        if tail:
            text += "\n" + "\n".join("    " + ln for ln in tail)
        if self._keep is None and self._created_workdir:
            text += "\n    (set keep=True to keep the workdir for inspection)"
        return RGWError(text)


class _PortInUse(Exception):
    """A daemon lost the race for the port we picked; pick another and retry."""


def _killpg(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # pgid == pid: started with start_new_session
    except (ProcessLookupError, PermissionError):
        pass


# --------------------------------------------------------------------------------------------
# Self-check with boto3 (imported lazily: the module itself is stdlib only).


def selfcheck(endpoint: S3Endpoint, server: RGWServer | None = None) -> dict:
    """Exercise the endpoint like the test suite will; return a dict of results.

    Raises AssertionError on a wrong answer.  With ``server``, also checks that the perf
    counters move on GET and PUT.
    """
    # The clients ucfs makes itself (ucfs.store: the one module that imports boto3). Their checksums
    # are "when_required": botocore >= 1.36 checksums every upload by default, over HTTPS as an
    # aws-chunked body with a CRC32 trailer, which RGW 16.2 refuses (411 MissingContentLength).
    from ucfs.store import boto3_client, boto_errors

    ClientError = boto_errors().ClientError
    s3 = boto3_client(endpoint.url, region=endpoint.region, access_key=endpoint.access_key,
                      secret_key=endpoint.secret_key, pool=32)
    res: dict = {}
    bucket = f"selfcheck-{secrets.token_hex(4)}"
    t = time.monotonic()
    s3.create_bucket(Bucket=bucket)
    try:
        # 20 MiB object as a multipart upload with 8 MiB parts: 8 + 8 + 4.
        data = os.urandom(20 << 20)
        part = 8 << 20
        before = server.perf_counters() if server else None
        up = s3.create_multipart_upload(Bucket=bucket, Key="big")["UploadId"]
        parts = []
        for i, off in enumerate(range(0, len(data), part), start=1):
            r = s3.upload_part(Bucket=bucket, Key="big", UploadId=up, PartNumber=i,
                               Body=data[off:off + part])
            parts.append({"ETag": r["ETag"], "PartNumber": i})
        done = s3.complete_multipart_upload(Bucket=bucket, Key="big", UploadId=up,
                                            MultipartUpload={"Parts": parts})
        # RGW 16.2 answers CompleteMultipartUpload with an empty <ETag></ETag> (a known RGW
        # bug, Red Hat BZ 2266579); HEAD has the real one.
        etag = s3.head_object(Bucket=bucket, Key="big")["ETag"]
        assert etag.strip('"').endswith("-3"), repr(etag)
        res["complete_multipart_etag"] = repr(done.get("ETag")) + (
            " (empty: use HeadObject)" if not done.get("ETag") else "")
        got = s3.get_object(Bucket=bucket, Key="big")["Body"].read()
        assert got == data, "multipart object read back differs"
        rng = s3.get_object(Bucket=bucket, Key="big", Range="bytes=8388600-8388699")
        assert rng["ContentRange"] == f"bytes 8388600-8388699/{len(data)}", rng["ContentRange"]
        assert rng["Body"].read() == data[8388600:8388700]
        res["multipart_20MiB"] = f"ok (3 parts, ETag {etag})"
        res["ranged_get"] = "ok (206, 100 bytes across the part-1/part-2 boundary)"
        if server:
            after = server.perf_counters()
            d = {k: after[k] - before[k] for k in ("get", "put", "req")}
            assert d["put"] == 3 and d["get"] == 3, d  # HEAD counts as a get
            res["perf_counters_delta"] = d

        # GET with If-Match: the right ETag serves the object, a wrong one gets 412.
        r = s3.get_object(Bucket=bucket, Key="big", IfMatch=etag, Range="bytes=0-0")
        assert r["ResponseMetadata"]["HTTPStatusCode"] == 206
        try:
            s3.get_object(Bucket=bucket, Key="big", IfMatch='"0123456789abcdef"')
            res["get_if_match"] = "NOT enforced (mismatch returned the object)"
        except ClientError as e:
            status = e.response["ResponseMetadata"]["HTTPStatusCode"]
            assert status == 412, status
            res["get_if_match"] = "ok (match: served; mismatch: 412 PreconditionFailed)"

        # 1,500 keys, listed in pages of 1,000.
        keys = [f"many/{i:05d}" for i in range(1500)]
        t_put = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda k: s3.put_object(Bucket=bucket, Key=k, Body=k.encode()), keys))
        t_list = time.monotonic()
        seen, pages = [], 0
        for page in s3.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix="many/", PaginationConfig={"PageSize": 1000}):
            pages += 1
            seen += [o["Key"] for o in page.get("Contents", [])]
        assert seen == keys, (len(seen), pages)
        assert pages == 2, pages
        res["list_1500"] = (f"ok ({len(seen)} keys in {pages} pages, "
                            f"{time.monotonic() - t_list:.2f}s; the 1500 PUTs took "
                            f"{t_list - t_put:.2f}s)")

    finally:
        # Delete everything and the bucket.
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            objs = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objs:
                s3.delete_objects(Bucket=bucket, Delete={"Objects": objs, "Quiet": True})
        s3.delete_bucket(Bucket=bucket)
    names = [b["Name"] for b in s3.list_buckets()["Buckets"]]
    assert bucket not in names
    res["delete"] = "ok (objects and bucket gone)"
    res["seconds"] = round(time.monotonic() - t, 2)
    return res


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ucfs.testing.rgw",
                                description="Run a throw-away Ceph RGW (S3) on 127.0.0.1.")
    p.add_argument("--port", type=int, default=0, help="S3 port (default: a free one)")
    p.add_argument("--objectstore", choices=("memstore", "bluestore"), default="memstore")
    p.add_argument("--memstore-gib", type=float, default=8, help="memstore capacity")
    p.add_argument("--bluestore-gib", type=float, default=200, help="sparse block file size")
    p.add_argument("--dir", help="work directory (kept afterwards); default a temp dir")
    p.add_argument("--keep", action="store_true", help="keep the temp work directory")
    p.add_argument("--ops-log", action="store_true", help="write RGW's per-request ops log")
    p.add_argument("--debug", action="store_true", help="verbose daemon logs")
    p.add_argument("--selfcheck", action="store_true",
                   help="start, run the boto3 self-check, print results, stop")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        stream=sys.stderr)

    srv = RGWServer(args.dir, port=args.port, objectstore=args.objectstore,
                    memstore_bytes=int(args.memstore_gib * (1 << 30)),
                    bluestore_bytes=int(args.bluestore_gib * (1 << 30)),
                    keep=True if args.keep else None, ops_log=args.ops_log,
                    debug=args.debug or None)
    stop = threading.Event()
    # Handlers before start(), so a SIGTERM during start-up still tears down cleanly.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        t0 = time.monotonic()
        try:
            ep = srv.start()
        except RGWError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        started = time.monotonic() - t0
        if args.selfcheck:
            print(f"start-up: {started:.2f}s  {ep.url}")
            results = selfcheck(ep, srv)
            for k, v in results.items():
                print(f"  {k}: {v}")
            pc = srv.perf_counters()
            print("  perf_counters: " + ", ".join(
                f"{k}={pc[k]}" for k in ("req", "failed_req", "get", "get_b", "put", "put_b")))
            return 0
        for k, v in ep.env().items():
            print(f"export {k}={shlex.quote(v)}")
        print(f"# ceph.conf: {srv.conf}  (Ctrl-C to stop)", flush=True)
        while not stop.wait(1.0):
            if not srv.alive():
                print("error: a daemon exited; logs in " + str(srv.log_dir), file=sys.stderr)
                return 1
        return 0
    finally:
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
