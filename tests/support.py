"""Helpers the tests share: a real ucfs daemon in a subprocess, catalogs, store checks."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from ucfs import control
from ucfs.errors import UcfsError
from ucfs.testing.rgw import RGWServer, S3Endpoint

REPO = Path(__file__).resolve().parent.parent


def delete_prefix(s3, bucket: str, prefix: str) -> None:
    """Remove every object under prefix and abort every multipart upload still open there.

    The uploads matter against a server the suite did not start (UCFS_TEST_ENDPOINT): one that a
    test leaves open (a killed daemon, a lost CreateMultipartUpload answer) holds its parts' bytes
    in the user's bucket for good, listed by nothing but ListMultipartUploads."""
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
        for i in range(0, len(keys), 1000):
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys[i:i + 1000], "Quiet": True})
    for page in s3.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
        for u in page.get("Uploads", ()):
            try:
                s3.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
            except (s3.exceptions.NoSuchUpload, s3.exceptions.NoSuchKey):
                pass  # finished or aborted meanwhile (RGW answers NoSuchKey)


def ensure_bucket(s3, name: str, region: str) -> None:
    """Make sure bucket `name` exists and these credentials may use it; create it if missing.

    Outside us-east-1 a new bucket must name its region (AWS refuses it otherwise), and a name
    someone else owns (on AWS, a short one like ucfs-test surely is) answers 403: say so, once,
    instead of every test failing on AccessDenied."""
    try:
        s3.head_bucket(Bucket=name)
        return
    except s3.exceptions.ClientError as e:
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status != 404:
            raise RuntimeError(f"bucket {name!r} exists but these credentials may not use it (HTTP {status}): "
                               f"set UCFS_TEST_BUCKET to a bucket of your own") from None
    kw = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
    try:
        s3.create_bucket(Bucket=name, **kw)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass  # another test process made it meanwhile


def server_gets(rgw: RGWServer, bucket: str, prefix: str) -> int:
    """Object GETs (not HEADs) the server answered under bucket/prefix, from its ops log."""
    want = f"GET /{bucket}/{prefix}"
    return sum(1 for e in rgw.ops_log() if str(e.get("uri", "")).startswith(want))


def proxy_unusable(endpoint: S3Endpoint) -> str | None:
    """Why a loopback proxy (ucfs.testing.faults.FaultProxy) cannot sit in front of `endpoint`: it
    speaks plain HTTP to the server, so an https endpoint (AWS) cannot be reached through it."""
    u = urllib.parse.urlsplit(endpoint.url)
    if u.scheme != "http":
        return (f"needs a plain-HTTP S3 endpoint for a loopback proxy to forward to (MinIO, RGW); "
                f"{endpoint.url} is {u.scheme}")
    return None


class _Relay:
    """A server on loopback whose connections a subclass's `_serve` relays elsewhere, run by an
    asyncio loop in a thread of its own. Use as a context manager."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None):
        self._loop = asyncio.new_event_loop()
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=ssl_context))
        self.port = self._server.sockets[0].getsockname()[1]
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        async def close():
            self._server.close()
            await self._server.wait_closed()
        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    @staticmethod
    async def _relay(reader, writer, up_reader, up_writer) -> None:
        """Both directions, until either side closes."""
        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(1 << 20):
                    dst.write(data)
                    await dst.drain()
            except (OSError, ssl.SSLError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))


class TLSFront(_Relay):
    """An https endpoint on loopback in front of a plain-HTTP S3 server: TLS ends here, with a
    throw-away certificate for 127.0.0.1 made by openssl (`ca` is the file a client must trust).
    What AWS, or MinIO with TLS, looks like to a mount."""

    def __init__(self, target_host: str, target_port: int, workdir: Path):
        self.target = (target_host, target_port)
        self.ca, key = workdir / "tls-cert.pem", workdir / "tls-key.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-keyout", str(key), "-out", str(self.ca), "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.ca, key)
        super().__init__(ctx)
        self.url = f"https://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await self._relay(reader, writer, up_reader, up_writer)


class ForwardProxy(_Relay):
    """An HTTP proxy on loopback, as a site's egress proxy: CONNECT tunnels (for https endpoints) and
    requests naming a whole http:// URL. It notes the first request line of every connection
    (`requests`) and the Proxy-Authorization it carried (`auth`), then relays the connection as it
    is. `url` is what HTTPS_PROXY / HTTP_PROXY name."""

    def __init__(self):
        self.requests: list[str] = []
        self.auth: list[str | None] = []
        super().__init__()
        self.url = f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            writer.close()
            return
        lines = head.decode("latin-1").split("\r\n")
        method, target = lines[0].split(" ")[:2]
        self.requests.append(lines[0])
        self.auth.append(next((ln.split(":", 1)[1].strip() for ln in lines[1:]
                               if ln.lower().startswith("proxy-authorization:")), None))
        u = urllib.parse.urlsplit(target if method != "CONNECT" else f"//{target}")
        try:
            up_reader, up_writer = await asyncio.open_connection(u.hostname, u.port)
        except OSError:
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
            writer.close()
            return
        if method == "CONNECT":
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            up_writer.write(head)  # the server takes the whole URL as the target (RFC 9112 3.2.2)
        await self._relay(reader, writer, up_reader, up_writer)


class StoreRequests:
    """Counts requests that reached the S3 server, for tests that check the mount's own figures
    against what the server saw.

    With the suite's own RGW it asks the server (its ops log and perf counters), and `endpoint` is
    the server's. Against an endpoint from the environment (UCFS_TEST_ENDPOINT) nothing on the server
    can be asked; `endpoint` is then a loopback proxy in front of it that counts every request
    passing through (`ProxyStoreRequests`), and whatever the test mounts or reads must go through
    it (mount_factory does so by default when a test asks for `store_requests`)."""

    def __init__(self, rgw: RGWServer, endpoint: S3Endpoint, bucket: str, prefix: str):
        self.rgw, self.endpoint, self.bucket, self.prefix = rgw, endpoint, bucket, prefix

    def object_gets(self) -> int:
        """GetObject requests for keys under the test's prefix (not HEADs), from the ops log."""
        return server_gets(self.rgw, self.bucket, self.prefix)

    def gets_and_heads(self) -> int:
        """GetObject and HeadObject requests of any key that found their object (a 404 is not
        counted): RGW's `get` perf counter. (Not the ops log, which drops lines under concurrent
        requests: RGW 16.2, some entries never appear.)"""
        return self.rgw.perf_counters()["get"]


class ProxyStoreRequests(StoreRequests):
    """StoreRequests counted by a FaultProxy (no rules: it only forwards) in front of the server."""

    def __init__(self, proxy, endpoint: S3Endpoint, bucket: str, prefix: str):
        super().__init__(None, endpoint, bucket, prefix)
        self.proxy = proxy

    def _requests(self) -> list[tuple[str, str, str]]:
        """(method, target, status) of every request the proxy forwarded, oldest first."""
        log = list(self.proxy.log)
        # The proxy keeps its recent requests only; a count taken from a full log would be short.
        assert len(log) < self.proxy.log.maxlen, "the proxy's request log overflowed: counts are unknown"
        return log

    def object_gets(self) -> int:
        want = f"/{self.bucket}/{self.prefix}"
        return sum(1 for method, target, _ in self._requests() if method == "GET" and target.startswith(want))

    def gets_and_heads(self) -> int:
        # An object's target is /bucket/key (path style); /bucket?list-type=2... is a listing.
        return sum(1 for method, target, status in self._requests()
                   if method in ("GET", "HEAD") and status.startswith("2")
                   and "/" in target.split("?", 1)[0].lstrip("/"))


def obj(s3, bucket: str, key: str) -> bytes:
    """An object's bytes, read with the test's own boto3 client."""
    return s3.get_object(Bucket=bucket, Key=key)["Body"].read()


def keys(s3, bucket: str, prefix: str) -> list[str]:
    """Every key under prefix, sorted (the test's own boto3 client)."""
    out = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out.extend(o["Key"] for o in page.get("Contents", ()))
    return sorted(out)


def sync_dir(path) -> None:
    """fsync on a directory: returns when everything pending beneath it is committed."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def forget_unused_inodes(mountpoint, *, sync: bool = False) -> bool:
    """Make the kernel drop every dentry and inode of the mount at `mountpoint` that nobody holds, as
    memory pressure does on a busy host: it sends FUSE FORGET for them. A remount that changes
    nothing does that to one file system alone (the kernel prunes its unused dentries first, and a
    FUSE inode goes with its last dentry). `drop_caches` did it to every file system on the machine:
    the tests running beside this one saw their own inodes forgotten under them (new inode numbers,
    listings they did not expect) and the daemon's cache disk its dentries. `sync` writes dirty pages
    back first, so that inodes holding some can go too. False where this process may not (not
    root): nothing was dropped."""
    if sync:
        os.sync()
    # -i: the kernel's remount, not a mount.fuse helper's; options the kernel ignores for FUSE.
    done = subprocess.run(["mount", "-i", "-o", "remount", str(mountpoint)], capture_output=True)
    return done.returncode == 0


def fsync_path(path) -> None:
    """fsync a file by path: returns when its content is committed to the store."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def foreign_page(data: bytes, versions: list[bytes]) -> int | None:
    """Offset of the first 4 KiB page of `data` with a byte that no version has at that offset, or
    None. A page torn between versions (a read racing a write, as on a local file system) passes:
    every byte only has to be some version's byte at its place."""
    for off in range(0, len(data), 4096):
        piece = data[off:off + 4096]
        if any(v[off:off + len(piece)] == piece for v in versions):
            continue
        if not all(any(len(v) > off + j and v[off + j] == b for v in versions) for j, b in enumerate(piece)):
            return off
    return None


def staging_files(staging: Path) -> list[Path]:
    """The files of a staging directory that hold something: not the empty spares the daemon makes
    ahead of time. One the daemon takes or removes while this looks is left out."""
    out = []
    for p in staging.iterdir():
        try:
            if p.name.startswith("spare-") and p.stat().st_size == 0:
                continue
        except FileNotFoundError:
            continue
        out.append(p)
    return out


def wait_until(pred, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(interval)


# The free space a test mount's cache and staging leave on the disk (`--min-free`; a test's own
# --min-free wins). The default, 1 GiB, is a host's margin. A CI machine's disk has had little free
# (a few GiB, and once 287 MB, on machines of its kind), and below the margin every block read
# bypasses the cache: tests of caching then failed for a reason that was not theirs. The tests of a
# full disk set their own, on a small disk of their own.
TEST_MIN_FREE = "64M"


@dataclass
class Mount:
    """One `ucfs mount --foreground` daemon in a subprocess, on its own mountpoint and cache."""

    root: Path
    endpoint: S3Endpoint
    catalog_text: str
    extra_args: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None
    open_files: int | None = None  # soft RLIMIT_NOFILE the daemon starts with (default: ours)
    extra_env: dict[str, str] | None = None  # for the daemon alone (proxy settings, say)

    @property
    def mountpoint(self) -> Path:
        return self.root / "mnt"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def log_path(self) -> Path:
        return self.root / "ucfs.log"

    def env(self) -> dict:
        env = dict(os.environ)
        env.update(AWS_ACCESS_KEY_ID=self.endpoint.access_key, AWS_SECRET_ACCESS_KEY=self.endpoint.secret_key,
                   AWS_REGION=self.endpoint.region, AWS_EC2_METADATA_DISABLED="true",
                   PYTHONUNBUFFERED="1")
        env.update(self.extra_env or {})
        return env

    def start(self, timeout: float = 60) -> "Mount":
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        cat = self.root / "catalog.toml"
        cat.write_text(self.catalog_text)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ucfs", "mount", str(self.mountpoint), "--foreground", "--config", str(cat),
             "--cache-dir", str(self.state_dir), "--log-level", "debug", "--min-free", TEST_MIN_FREE,
             *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, env=self.env(), cwd=REPO, preexec_fn=self._limits)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ucfs mount exited with {self.proc.returncode}:\n{self.log_tail()}")
            if os.path.ismount(self.mountpoint):
                try:
                    if self.status().get("ready"):
                        return self
                except (OSError, UcfsError):
                    pass
            time.sleep(0.01)
        raise RuntimeError(f"ucfs mount not ready after {timeout} s:\n{self.log_tail()}")

    def _limits(self) -> None:
        if self.open_files is not None:
            _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.open_files, hard))

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def status(self) -> dict:
        return control.query(self.mountpoint, "status")

    def store_stats(self) -> dict:
        stores = self.status()["stores"]
        assert len(stores) == 1
        return next(iter(stores.values()))

    def path(self, volume: str = "test.s.vol") -> Path:
        return self.mountpoint.joinpath(*volume.split("."))

    def stop(self, wait: bool = True, timeout: float = 120) -> int:
        """Unmount the way a user does (ucfs unmount) and wait for the daemon to exit."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None and os.path.ismount(self.mountpoint):
            args = [sys.executable, "-m", "ucfs", "unmount", str(self.mountpoint)]
            if not wait:
                args.append("--no-wait")
            subprocess.run(args, env=self.env(), cwd=REPO, capture_output=True, timeout=timeout)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"ucfs daemon did not exit after unmount:\n{self.log_tail()}")
        self.proc = None
        return code

    def kill(self) -> None:
        """SIGKILL the daemon (a crash) and clear the dead mount."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None
        subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)


def mount_refused(tmp_path: Path, cat: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`ucfs mount --foreground` of catalog `cat` at tmp_path/mnt, expected to refuse: its completed
    process (a mount it made after all is taken away again). `env`: the daemon's whole environment."""
    mnt = tmp_path / "mnt"
    try:
        return subprocess.run([sys.executable, "-m", "ucfs", "mount", str(mnt), "--config", str(cat), "--foreground",
                               "--cache-dir", str(tmp_path / "state")], capture_output=True, text=True, timeout=120,
                              cwd=REPO, env=env)
    finally:
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)


def make_catalog(endpoint: S3Endpoint, bucket: str, volumes: dict[str, dict]) -> str:
    """Catalog TOML: volumes maps 'cat.schema.vol' -> {'prefix': ..., 'read_only': ..., ...}."""
    lines = ["[stores.test]", f'endpoint_url = "{endpoint.url}"', f'region = "{endpoint.region}"', ""]
    for name, v in volumes.items():
        lines.append(f'[volumes."{name}"]')
        lines.append(f'location = "s3://{bucket}/{v["prefix"]}"')
        lines.append('store = "test"')
        for k, val in v.items():
            if k == "prefix":
                continue
            lines.append(f"{k} = {json.dumps(val)}")
        lines.append("")
    return "\n".join(lines)


async def open_core(tmp_path, store, nursery, cfg):
    """A Core and Committer over `store` (one volume a.b.c at s3://bucket/pfx), started in `nursery`, without
    FUSE; returns (core, committer, the volume's inode number)."""
    from ucfs.aiostore import AsyncStore
    from ucfs.catalog import Catalog
    from ucfs.commit import Committer
    from ucfs.core import Core
    from ucfs.inodes import ROOT_INO

    catalog = Catalog.from_dict({"stores": {"mem": {}},
                                 "volumes": {"a.b.c": {"location": "s3://bucket/pfx", "store": "mem"}}})
    core = Core(catalog, {"mem": AsyncStore(store, 8)}, None, cfg)
    core.attach(nursery)
    committer = Committer(tmp_path / "state", core, cfg, workers=4)
    await nursery.start(committer.run)
    core.committer = committer
    ino = ROOT_INO
    for name in ("a", "b", "c"):
        ino = (await core.lookup(ino, name)).ino
    return core, committer, ino


def run_on_core(tmp_path, body, *, drain: bool = True, wrap=None, **cfg):
    """trio.run of `body(core, committer, volume inode, store)` on a Core over a new in-memory store
    with one bucket, "bucket" (see `open_core`); `cfg`: MountConfig fields. The committer is shut
    down afterwards, finishing what is left to commit (`drain`) or not. Returns the store. With
    `wrap` (e.g. ucfs.testing.faults.FaultyStore), the core talks to `wrap(store)` instead; `body`
    still gets the store itself, and finds the wrapper as `core.stores["mem"].store`."""
    import trio

    from ucfs.config import MountConfig
    from ucfs.store import MemoryStore

    inner = MemoryStore()
    inner.buckets["bucket"] = {}
    (tmp_path / "state").mkdir(mode=0o700)
    config = MountConfig(cache_dir=tmp_path / "state" / "cache", **cfg)

    async def main():
        async with trio.open_nursery() as n:
            core, committer, vol = await open_core(tmp_path, inner if wrap is None else wrap(inner), n, config)
            await body(core, committer, vol, inner)
            await committer.shutdown(drain=drain)
            n.cancel_scope.cancel()

    trio.run(main)
    return inner
