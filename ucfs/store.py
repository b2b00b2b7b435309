"""Object stores behind one synchronous, thread-safe protocol.

`S3Store` is the production store (AWS S3, MinIO, Ceph RGW) and the only code in ucfs that imports
boto3/botocore. `LocalStore` keeps objects as files in a local directory (the embedded default and
demos). `MemoryStore` keeps them in a dict (unit tests). All three speak `Store`, raise only
`ucfs.errors.StoreError` (an `OSError`), and count their requests in `statistics()`.

Calls block: the file system runs them in worker threads (see `aiostore`), never on its event loop.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
import os
import random
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import BinaryIO, Iterable, Protocol
from xml.sax.saxutils import escape as xml_escape

from . import errors, s3http

log = logging.getLogger(__name__)

# S3 limits (https://docs.aws.amazon.com/AmazonS3/latest/userguide/qfacts.html).
MAX_KEY_BYTES = 1024
MAX_PARTS = 10_000
MIN_PART_BYTES = 5 * 1024 * 1024
MAX_PART_BYTES = 5 * 1024 ** 3
MAX_OBJECT_BYTES = 5 * 1024 ** 4
MAX_SINGLE_COPY_BYTES = 5 * 1024 ** 3
# Where boto3's credential chain looks, for the error when it found nothing.
NO_CREDENTIALS = ("no AWS credentials found (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile in "
                  "~/.aws, or an instance role)")


def _ranged_body(r: s3http.Response, start: int, length: int | None, ranged: bool,
                 key: str) -> tuple[bytes | bytearray | memoryview, int]:
    """(body, object size) of a GET answer, checked to be the bytes asked for: a ranged request
    needs a 206 whose Content-Range starts at `start` (or a 200, the whole object, when `start` is
    0), and exactly the bytes the range holds."""
    data = r.body
    total = None
    first = 0
    cr = r.headers.get("content-range", "")
    if ranged and r.status == 206:
        m = _CONTENT_RANGE.fullmatch(cr.strip())
        if m is None:
            raise errors.connection_error(f"GET answered with Content-Range {cr!r}", key=key)
        first, total = int(m.group(1)), (int(m.group(3)) if m.group(3) != "*" else None)
        if first != start:
            raise errors.connection_error(f"GET asked for bytes from {start}, answered from {first}", key=key)
    elif ranged and start:
        raise errors.connection_error(f"GET of a range from {start} answered {r.status}, not 206", key=key)
    if total is None:
        total = len(data) if not ranged else start + len(data)
    if length is not None and r.status != 206 and len(data) > length:
        data = memoryview(data)[:length]  # a 200 for a range from 0: the object's head is what was asked
    if length is not None and len(data) != min(length, max(0, total - start)):
        raise errors.connection_error(f"GET returned {len(data)} bytes for a {length}-byte range", key=key)
    return data, total


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def botocore_config(*, region: str, path_style: bool = True, payload_signing: bool = False, pool: int,
                    attempts: int, connect_timeout_s: float, read_timeout_s: float):
    """The botocore configuration of every boto3 client ucfs makes (`S3Store`'s, and the plain ones
    of `boto3_client`)."""
    import botocore.config

    return botocore.config.Config(
        region_name=region,
        # payload_signing_enabled False sends UNSIGNED-PAYLOAD instead of hashing every upload
        # body: what botocore does on HTTPS anyway. Opt back in per store where a plain-HTTP
        # link is not trusted.
        s3={"addressing_style": "path" if path_style else "auto", "payload_signing_enabled": payload_signing},
        max_pool_connections=pool,
        retries={"max_attempts": attempts, "mode": "standard"},
        connect_timeout=connect_timeout_s,
        read_timeout=read_timeout_s,
        tcp_keepalive=True,
        # Checksums only where S3 demands them: the default CRC trailers of new botocore cost CPU on
        # every part and are refused by some S3-compatible servers. ETags still guard integrity.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )


def boto3_client(endpoint_url: str | None, *, region: str, access_key: str | None = None,
                 secret_key: str | None = None, pool: int = 10, attempts: int = 5,
                 connect_timeout_s: float = 5.0, read_timeout_s: float = 60.0):
    """A plain boto3 S3 client, configured as `S3Store` configures its own: for `ucfs bench`, whose
    ceilings are by definition what boto3 itself reaches, and so must not go through this module's
    lean client. Its failures are `boto_errors()`'s exceptions, not `StoreError`."""
    import boto3

    cfg = botocore_config(region=region, pool=pool, attempts=attempts, connect_timeout_s=connect_timeout_s,
                          read_timeout_s=read_timeout_s)
    kw = {}
    if access_key:
        kw = {"aws_access_key_id": access_key, "aws_secret_access_key": secret_key}
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=cfg, **kw)


def boto_errors():
    """botocore's exception module, for the callers of `boto3_client` that tell its failures apart."""
    import botocore.exceptions

    return botocore.exceptions


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    etag: str  # without quotes
    mtime_ns: int
    # What a copy returns: the ETag of the version it copied (it names it in its precondition, so
    # the copy holds exactly those bytes), or "" where the store cannot say.
    source_etag: str = ""


@dataclass(frozen=True, slots=True)
class ListPage:
    objects: list[ObjectInfo]  # objects directly under the prefix (up to the delimiter)
    prefixes: list[str]  # common prefixes, each ending with the delimiter
    next_token: str | None  # None on the last page


@dataclass(frozen=True, slots=True)
class Upload:
    key: str
    upload_id: str
    initiated: float | None = None  # when it was created (epoch seconds), where the store says


class Store(Protocol):
    """What the file system needs from an object store. Every method may raise `StoreError`."""

    name: str  # identifies the store in cache keys ("s3:<endpoint>", "local", ...)

    def head(self, bucket: str, key: str) -> ObjectInfo: ...

    def get(self, bucket: str, key: str, start: int = 0, length: int | None = None, *,
            etag: str | None = None, into: bytearray | None = None) -> tuple[bytes, ObjectInfo]:
        """Bytes [start, start+length) (to the end when length is None) and the object's info.

        With `etag`, fail with `StaleError` instead of returning bytes of another version. With
        `into`, a store may read the data into that buffer and return a view of it (an optimisation
        a store is free to ignore).
        """
        ...

    def list_page(self, bucket: str, prefix: str, *, delimiter: str = "/", token: str | None = None,
                  max_keys: int = 1000) -> ListPage: ...

    def put(self, bucket: str, key: str, body: bytes | BinaryIO, size: int) -> ObjectInfo: ...

    def create_multipart(self, bucket: str, key: str) -> str: ...

    def upload_part(self, bucket: str, key: str, upload_id: str, part_number: int,
                    body: bytes | BinaryIO, size: int) -> str: ...

    def complete_multipart(self, bucket: str, key: str, upload_id: str,
                           parts: list[tuple[int, str]]) -> ObjectInfo: ...

    def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None: ...

    def list_multipart(self, bucket: str, prefix: str) -> list[Upload]: ...

    def copy(self, bucket: str, src_key: str, dst_key: str) -> ObjectInfo: ...

    def delete(self, bucket: str, key: str) -> None: ...

    def check_bucket(self, bucket: str) -> None:
        """Raise a StoreError when the bucket cannot be used (missing, no access, unreachable)."""
        ...

    def statistics(self) -> dict[str, int]: ...


class Counters:
    """Thread-safe request and byte counters shared by the stores."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: collections.Counter[str] = collections.Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)


def _read_body(body: bytes | BinaryIO | s3http.FileBody, size: int) -> bytes:
    if isinstance(body, (bytes, bytearray, memoryview)):
        return bytes(body)
    if isinstance(body, s3http.FileBody):
        try:
            return s3http.read_file_body(body)
        except s3http.SourceShort as e:
            raise errors.StoreError(errors.EIO, f"upload source changed: {e}", transient=True) from None
    data = body.read(size)
    if len(data) != size:
        raise errors.StoreError(errors.EIO, f"short read from upload source: {len(data)} of {size} bytes")
    return data


def _check_key(key: str) -> None:
    if len(key.encode()) > MAX_KEY_BYTES:
        raise errors.StoreError(errors.ENAMETOOLONG, f"key longer than {MAX_KEY_BYTES} bytes", key=key,
                                code="KeyTooLongError")


# --------------------------------------------------------------------------------------------------
# S3


def s3_mtime_ns(dt) -> int:
    """An S3 timestamp (a datetime) in nanoseconds, cut to the whole second like s3http's: LIST
    gives milliseconds, HEAD only seconds, and an object's mtime must not depend on which was last."""
    return math.floor(dt.timestamp()) * 1_000_000_000


def _split_etag(value: str | None) -> str:
    return (value or "").strip('"')


def _quoted(etag: str) -> str:
    return f'"{etag}"'


class S3Store:
    """S3 (or any S3-compatible server): boto3's configuration and credentials, requests through
    the lean client (`s3http.LeanClient`), and boto3 itself for rare calls and as the fallback.

    Both are shared by all threads; the lean client's connection pool is sized to `concurrency` so
    threads never wait for a socket. Transient failures are retried with backoff (here for lean
    requests, by botocore for its own); a body that breaks off mid-read is retried too.
    """

    def __init__(self, *, endpoint_url: str | None = None, region: str | None = None,
                 profile: str | None = None, path_style: bool = True, payload_signing: bool = False,
                 concurrency: int = 64,
                 max_attempts: int = 5, connect_timeout_s: float = 5.0, read_timeout_s: float = 30.0,
                 access_key: str | None = None, secret_key: str | None = None, lean: bool = True):
        import boto3

        self.endpoint_url = endpoint_url
        self.name = f"s3:{endpoint_url or 'aws'}"
        self.max_attempts = max_attempts
        self.payload_signing = payload_signing
        self._counters = Counters()
        # time.monotonic() of the last answer the store gave (any status below 500): the file system
        # takes it as the end of an outage it noticed (core.Core._outage).
        self.answered_at = 0.0
        # Set when a request used up every attempt without any answer from the store (connections
        # refused, reset or silent): until the store answers again, each request tries once, so a
        # caller learns of the outage at once instead of after the whole back-off (core answers
        # metadata from what it knew; reads of data the cache lacks fail with EIO).
        self.unreachable = False
        self._etag_forms_noted = False  # logged once: GET answers carry ETags in another form (_check_version)
        session = boto3.session.Session(profile_name=profile)
        cfg = botocore_config(region=region or session.region_name or "us-east-1", path_style=path_style,
                              payload_signing=payload_signing, pool=concurrency, attempts=max_attempts,
                              connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
        kwargs = {}
        if access_key and secret_key:
            kwargs = {"aws_access_key_id": access_key, "aws_secret_access_key": secret_key}
        # The botocore client is made on first use: building one loads S3's service model, about half
        # a second of CPU, and a process that only GETs (torchio's direct fills, one per DataLoader
        # worker) never needs it.
        self._client_args = (session, endpoint_url, cfg, kwargs)
        self._client_obj = None
        self._client_lock = threading.Lock()
        # Every request of normal operation goes through the lean client (see s3http.py): reads,
        # listings, uploads, and the deletes, copies and multipart calls of renames and commits.
        # One pool of `concurrency` sockets then serves them all; with two (botocore's and ours)
        # the daemon held more connections than it was configured for. botocore keeps the rare
        # calls (bucket checks, listing unfinished uploads). The lean client shares boto3's
        # credentials, so rotation and instance roles work the same.
        self._lean = None
        if lean:
            region_name = cfg.region_name
            url = endpoint_url or f"https://s3.{region_name}.amazonaws.com"
            creds = None if access_key and secret_key else session.get_credentials()

            def credentials() -> s3http.Credentials:
                if access_key and secret_key:
                    return s3http.Credentials(access_key, secret_key)
                if creds is None:
                    raise errors.StoreError(errors.EACCES, NO_CREDENTIALS, code="NoCredentials")
                f = creds.get_frozen_credentials()
                return s3http.Credentials(f.access_key, f.secret_key, f.token)

            self._lean = s3http.LeanClient(
                url, region=region_name, path_style=path_style or endpoint_url is not None,
                credentials=credentials, pool_size=concurrency, timeout_s=read_timeout_s,
                ca_bundle=session._session.get_config_variable("ca_bundle"),
                connect_timeout_s=connect_timeout_s)

    @property
    def sends_files(self) -> bool:
        """Whether upload bodies may be `s3http.FileBody` ranges sent with sendfile(2): plain HTTP
        and unsigned payloads (TLS and payload hashes need the bytes in user space; the lean client
        then reads them itself, which a caller with pooled buffers does better)."""
        return self._lean is not None and self._lean.scheme == "http" and not self.payload_signing

    @property
    def _client(self):
        client = self._client_obj
        if client is None:
            with self._client_lock:
                if self._client_obj is None:
                    session, endpoint_url, cfg, kwargs = self._client_args
                    client = session.client("s3", endpoint_url=endpoint_url, config=cfg, **kwargs)
                    # Count every HTTP attempt, so statistics show retries (attempts - requests).
                    client.meta.events.register("request-created.s3", self._count_attempt)
                    self._client_obj = client
                client = self._client_obj
        return client

    def _count_attempt(self, request, **_kwargs) -> None:
        self._counters.add("attempts")

    def statistics(self) -> dict[str, int]:
        return self._counters.snapshot()

    # -- error translation ----------------------------------------------------------------------
    def _call(self, op: str, key: str, fn, **kwargs):
        import botocore.exceptions as bex

        self._counters.add(op)
        try:
            return fn(**kwargs)
        except bex.ClientError as e:
            err = e.response.get("Error", {})
            meta = e.response.get("ResponseMetadata", {})
            code = str(err.get("Code", ""))
            status = int(meta.get("HTTPStatusCode", 0) or 0)
            self._counters.add("not_found" if status == 404 else "errors")
            raise errors.from_s3(code, status, str(err.get("Message", "")) or code,
                                 request_id=meta.get("RequestId", ""), key=key) from None
        except bex.NoCredentialsError:
            self._counters.add("errors")
            raise errors.StoreError(errors.EACCES, NO_CREDENTIALS, code="NoCredentials", key=key) from None
        except (bex.EndpointConnectionError, bex.ConnectionClosedError, bex.ReadTimeoutError,
                bex.ConnectTimeoutError, bex.ProxyConnectionError) as e:
            self._counters.add("errors")
            raise errors.connection_error(f"store unreachable: {e}", key=key) from None
        except bex.BotoCoreError as e:
            self._counters.add("errors")
            raise errors.connection_error(f"store request failed: {e}", key=key) from None

    @staticmethod
    def _info_from_head(key: str, resp: dict, size: int | None = None) -> ObjectInfo:
        lm = resp.get("LastModified")
        mtime_ns = s3_mtime_ns(lm) if lm is not None else 0
        if size is None:
            size = int(resp.get("ContentLength", 0))
        return ObjectInfo(key, size, _split_etag(resp.get("ETag")), mtime_ns)

    # -- reads --------------------------------------------------------------------------------
    def head(self, bucket: str, key: str) -> ObjectInfo:
        if self._lean is not None:
            r = self._lean_request("head", "HEAD", bucket, key, {})
            return ObjectInfo(key, int(r.headers.get("content-length", 0)), _split_etag(r.headers.get("etag")),
                              s3http.http_mtime_ns(r.headers.get("last-modified")))
        resp = self._call("head", key, self._client.head_object, Bucket=bucket, Key=key)
        return self._info_from_head(key, resp)

    def _check_version(self, bucket: str, info: ObjectInfo, etag: str | None) -> None:
        """A GET asked with If-Match must carry the version asked for. A server or proxy that ignores
        If-Match answers with another version's bytes after an overwrite elsewhere; taken as the old
        version's, they would be cached under its identity and served as the file's. Such an answer
        is treated as the 412 it should have been. But some servers honour If-Match and only write
        the ETag of GET answers differently from HEAD's and LIST's (MinIO before mid-2023 sent the
        encrypted form for some SSE-KMS objects): every read of such a file would fail with ESTALE.
        So the object's current ETag, by HEAD, decides: the one asked for, and the bytes are its."""
        if not etag or not info.etag or info.etag == etag:
            return
        try:
            current = self.head(bucket, info.key).etag
        except errors.StoreError as e:
            if e.errno != errors.ENOENT:
                raise
            current = ""
        if current == etag:
            if not self._etag_forms_noted:
                self._etag_forms_noted = True
                log.warning("GET %s: the store answered If-Match %s with ETag %s, and HEAD says %s: its "
                            "GET answers write ETags differently (each such GET costs a HEAD)",
                            info.key, etag, info.etag, current)
            return
        log.warning("GET %s: asked for version %s, the store answered with %s (it ignored If-Match); "
                    "the file changed", info.key, etag, info.etag)
        raise errors.StaleError(info.key)

    def get(self, bucket: str, key: str, start: int = 0, length: int | None = None, *,
            etag: str | None = None, into: bytearray | None = None) -> tuple[bytes, ObjectInfo]:
        """Bytes-like data and the object's info. With `into` (a buffer at least `length` long) the
        data is read into it, and a view of it is returned."""
        if length == 0:
            return b"", self.head(bucket, key)  # an empty range cannot be expressed in HTTP
        if self._lean is None:
            return self._get_boto(bucket, key, start, length, etag=etag)
        headers = {}
        if start or length is not None:
            headers["range"] = f"bytes={start}-{'' if length is None else start + length - 1}"
        if etag:
            headers["if-match"] = f'"{etag}"'
        for attempt in range(1, self.max_attempts + 1):
            r = self._lean_request("get", "GET", bucket, key, headers, into=into)
            try:
                data, total = _ranged_body(r, start, length, "range" in headers, key)
                break
            except errors.StoreError as e:
                # An answer for other bytes than asked (a proxy or server bug; a cut connection
                # that looked complete): never taken as the asked bytes. Asked again, like any
                # transient failure.
                if attempt == self.max_attempts:
                    raise
                log.warning("GET %s: %s; asking again (attempt %d of %d)", key, e.strerror, attempt,
                            self.max_attempts)
        info = ObjectInfo(key, total, _split_etag(r.headers.get("etag")),
                          s3http.http_mtime_ns(r.headers.get("last-modified")))
        self._check_version(bucket, info, etag)
        self._counters.add("get_bytes", len(data))
        return data, info

    def _lean_request(self, op: str, method: str, bucket: str, key: str, headers: dict,
                      into: bytearray | None = None, query: dict | None = None,
                      body: bytes | bytearray | memoryview | None = None,
                      error_in_ok: bool = False) -> s3http.Response:
        """One logical request with retries: transient failures (5xx, throttling, broken
        connections) are retried with jittered exponential backoff, like botocore's standard mode.
        `error_in_ok`: a 200 answer may carry an error document (CompleteMultipartUpload,
        CopyObject), taken as the error it reports."""
        self._counters.add(op)
        delay = 0.1
        attempts = 1 if self.unreachable else self.max_attempts
        answered = False
        for attempt in range(1, attempts + 1):
            self._counters.add("attempts")
            try:
                r = self._lean.request(method, bucket, key, headers, into=into, query=query, body=body,
                                       sign_body=self.payload_signing)
            except s3http.SourceShort as e:
                self._counters.add("errors")
                raise errors.StoreError(errors.EIO, f"upload source changed: {e}", key=key,
                                        transient=True) from None
            except s3http.UntrustedServer as e:
                self._counters.add("errors")
                raise errors.StoreError(errors.EIO, f"{e} (AWS_CA_BUNDLE names a file of the authorities "
                                        "to trust)", code="UntrustedCertificate", key=key) from None
            except s3http.RETRYABLE as e:
                err: errors.StoreError = errors.connection_error(f"store request failed: {e}", key=key)
            else:
                answered = True
                if r.status < 500:
                    self.answered_at = time.monotonic()
                    self.unreachable = False
                if r.status < 300 and not (error_in_ok and s3http.embedded_error(r.body)):
                    return r
                if r.status in (304, 412):
                    self._counters.add("errors")
                    raise errors.StaleError(key)
                code, msg, rid = s3http.parse_error(r.body)
                if not code:  # HEAD answers carry no body
                    code = {404: "NoSuchKey", 403: "AccessDenied"}.get(r.status, str(r.status))
                # An error sent after a 200 is the server's failure (InternalError, SlowDown).
                err = errors.from_s3(code, r.status if r.status >= 300 else 500, msg or code,
                                     request_id=rid or r.headers.get("x-amz-request-id", ""), key=key)
            # A missing key is an answer, not a failure: count it apart so status shows real errors.
            self._counters.add("not_found" if err.errno == errors.ENOENT else "errors")
            if not err.transient or attempt == attempts:
                if err.transient and not answered and attempts > 1:
                    self.unreachable = True  # no answer at all, every attempt: see __init__
                raise err
            # Louder as it repeats: one retry is routine, several in a row are worth an operator's eye.
            level = logging.INFO if attempt == 1 else logging.WARNING if attempt < 4 else logging.ERROR
            # A LIST names no key: say which bucket and prefix it was for.
            what = key or (f"{bucket}?prefix={query['prefix']}" if query and "prefix" in query else bucket)
            log.log(level, "%s %s: %s; retrying (attempt %d of %d)", method, what, err, attempt,
                    attempts)
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    def _get_boto(self, bucket: str, key: str, start: int = 0, length: int | None = None, *,
                  etag: str | None = None) -> tuple[bytes, ObjectInfo]:
        import botocore.exceptions as bex
        import urllib3.exceptions as uex

        kwargs: dict = {"Bucket": bucket, "Key": key}
        if start or length is not None:
            end = "" if length is None else str(start + length - 1)
            kwargs["Range"] = f"bytes={start}-{end}"
        if etag:
            kwargs["IfMatch"] = f'"{etag}"'
        delay = 0.1
        for attempt in range(1, self.max_attempts + 1):
            resp = self._call("get", key, self._client.get_object, **kwargs)
            try:
                data = resp["Body"].read()
            except (bex.IncompleteReadError, bex.ReadTimeoutError, bex.ResponseStreamingError,
                    uex.HTTPError, ConnectionError) as e:
                # The status line came back but the body broke off. botocore does not retry a body
                # it has handed over, so retry here; never return a short read.
                self._counters.add("body_retries")
                if attempt == self.max_attempts:
                    raise errors.connection_error(f"body of GET broke off: {e}", key=key) from None
                log.warning("GET %s: body broke off (%s), retrying (attempt %d)", key, e, attempt)
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 5.0)
                continue
            self._counters.add("get_bytes", len(data))
            total = None
            cr = resp.get("ContentRange")
            if cr and "/" in cr:
                tail = cr.rsplit("/", 1)[1]
                total = int(tail) if tail.isdigit() else None
            if total is None:
                total = len(data) if "Range" not in kwargs else start + len(data)
            expected = int(resp.get("ContentLength", len(data)))
            if len(data) != expected:
                raise errors.connection_error(f"GET returned {len(data)} bytes, expected {expected}", key=key)
            info = self._info_from_head(key, resp, size=total)
            self._check_version(bucket, info, etag)
            return data, info
        raise AssertionError("unreachable")

    def list_page(self, bucket: str, prefix: str, *, delimiter: str = "/", token: str | None = None,
                  max_keys: int = 1000) -> ListPage:
        if self._lean is not None:
            query = {"list-type": "2", "prefix": prefix, "max-keys": str(max_keys), "encoding-type": "url"}
            if delimiter:
                query["delimiter"] = delimiter
            if token:
                query["continuation-token"] = token
            r = self._lean_request("list", "GET", bucket, "", {}, query=query)
            try:
                res = s3http.parse_list(r.body)
            except Exception as e:  # noqa: BLE001 - a garbled answer is a failed request
                raise errors.connection_error(f"unreadable LIST answer: {e}", key=prefix) from None
            return ListPage([ObjectInfo(*o) for o in res.objects], res.prefixes, res.next_token)
        kwargs: dict = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": max_keys}
        if delimiter:
            kwargs["Delimiter"] = delimiter
        if token:
            kwargs["ContinuationToken"] = token
        resp = self._call("list", prefix, self._client.list_objects_v2, **kwargs)
        objects = [ObjectInfo(o["Key"], int(o["Size"]), _split_etag(o.get("ETag")),
                              s3_mtime_ns(o["LastModified"]))
                   for o in resp.get("Contents", ())]
        prefixes = [p["Prefix"] for p in resp.get("CommonPrefixes", ())]
        nxt = resp.get("NextContinuationToken") if resp.get("IsTruncated") else None
        return ListPage(objects, prefixes, nxt)

    def check_bucket(self, bucket: str) -> None:
        # On the pooled connections like every request of normal operation: botocore's own pool
        # would keep one more connection open for the life of the mount.
        if self._lean is not None:
            self._lean_request("head_bucket", "HEAD", bucket, "", {})
            return
        self._call("head_bucket", bucket, self._client.head_bucket, Bucket=bucket)

    def create_bucket(self, bucket: str) -> None:
        """Make the bucket unless this account already has it (for benchmarks and test set-up; the
        file system itself never creates buckets)."""
        try:
            self._call("create_bucket", bucket, self._client.create_bucket, Bucket=bucket)
        except errors.StoreError as e:
            if e.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    # -- writes -------------------------------------------------------------------------------
    def put(self, bucket: str, key: str, body: bytes | BinaryIO, size: int) -> ObjectInfo:
        _check_key(key)
        if self._lean is not None and isinstance(body, (bytes, bytearray, memoryview)):
            r = self._lean_request("put", "PUT", bucket, key, {}, body=body)
            self._counters.add("put_bytes", size)
            return ObjectInfo(key, size, _split_etag(r.headers.get("etag")), time.time_ns())
        resp = self._call("put", key, self._client.put_object, Bucket=bucket, Key=key,
                          Body=body, ContentLength=size)
        self._counters.add("put_bytes", size)
        return ObjectInfo(key, size, _split_etag(resp.get("ETag")), time.time_ns())

    def create_multipart(self, bucket: str, key: str) -> str:
        _check_key(key)
        if self._lean is not None:
            r = self._lean_request("create_multipart", "POST", bucket, key, {}, query={"uploads": ""})
            upload_id = s3http.xml_text(r.body, "UploadId")
            if not upload_id:
                raise errors.StoreError(errors.EIO, "CreateMultipartUpload answered no UploadId", key=key)
            return upload_id
        resp = self._call("create_multipart", key, self._client.create_multipart_upload,
                          Bucket=bucket, Key=key)
        return resp["UploadId"]

    def upload_part(self, bucket: str, key: str, upload_id: str, part_number: int,
                    body: bytes | BinaryIO | s3http.FileBody, size: int) -> str:
        if self._lean is not None and isinstance(body, (bytes, bytearray, memoryview, s3http.FileBody)):
            r = self._lean_request("upload_part", "PUT", bucket, key, {}, body=body,
                                   query={"partNumber": str(part_number), "uploadId": upload_id})
            self._counters.add("put_bytes", size)
            return _split_etag(r.headers.get("etag"))
        if isinstance(body, (memoryview, s3http.FileBody)):
            body = _read_body(body, size)  # botocore takes bytes or a file object
        resp = self._call("upload_part", key, self._client.upload_part, Bucket=bucket, Key=key,
                          UploadId=upload_id, PartNumber=part_number, Body=body, ContentLength=size)
        self._counters.add("put_bytes", size)
        return _split_etag(resp.get("ETag"))

    def complete_multipart(self, bucket: str, key: str, upload_id: str,
                           parts: list[tuple[int, str]]) -> ObjectInfo:
        if self._lean is not None:
            doc = "".join(f"<Part><PartNumber>{n}</PartNumber><ETag>{xml_escape(_quoted(e))}</ETag></Part>"
                          for n, e in parts)
            r = self._lean_request("complete_multipart", "POST", bucket, key, {},
                                   query={"uploadId": upload_id}, error_in_ok=True,
                                   body=f"<CompleteMultipartUpload>{doc}</CompleteMultipartUpload>".encode())
            etag = _split_etag(s3http.xml_text(r.body, "ETag"))
        else:
            resp = self._call("complete_multipart", key, self._client.complete_multipart_upload,
                              Bucket=bucket, Key=key, UploadId=upload_id,
                              MultipartUpload={"Parts": [{"PartNumber": n, "ETag": f'"{e}"'}
                                                         for n, e in parts]})
            etag = _split_etag(resp.get("ETag"))
        if not etag:
            # Some servers (Ceph RGW 16.2) answer an empty ETag here; the object has a real one,
            # and cache identity needs it.
            return self.head(bucket, key)
        return ObjectInfo(key, -1, etag, time.time_ns())

    def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None:
        try:
            if self._lean is not None:
                self._lean_request("abort_multipart", "DELETE", bucket, key, {}, query={"uploadId": upload_id})
            else:
                self._call("abort_multipart", key, self._client.abort_multipart_upload, Bucket=bucket,
                           Key=key, UploadId=upload_id)
        except errors.StoreError as e:
            if e.errno != errors.ENOENT:
                raise

    def list_multipart(self, bucket: str, prefix: str) -> list[Upload]:
        out: list[Upload] = []
        kwargs: dict = {"Bucket": bucket, "Prefix": prefix}
        while True:
            resp = self._call("list_multipart", prefix, self._client.list_multipart_uploads, **kwargs)
            for u in resp.get("Uploads", ()):
                initiated = u.get("Initiated")
                out.append(Upload(u["Key"], u["UploadId"], initiated.timestamp() if initiated else None))
            if not resp.get("IsTruncated"):
                return out
            kwargs["KeyMarker"] = resp.get("NextKeyMarker")
            kwargs["UploadIdMarker"] = resp.get("NextUploadIdMarker")

    def copy(self, bucket: str, src_key: str, dst_key: str) -> ObjectInfo:
        _check_key(dst_key)
        src = self.head(bucket, src_key)
        if src.size <= MAX_SINGLE_COPY_BYTES:
            if self._lean is not None:
                r = self._lean_request("copy", "PUT", bucket, dst_key, self._copy_headers(bucket, src_key, src.etag),
                                       error_in_ok=True)
                etag = _split_etag(s3http.xml_text(r.body, "ETag"))
            else:
                resp = self._call("copy", dst_key, self._client.copy_object, Bucket=bucket, Key=dst_key,
                                  CopySource={"Bucket": bucket, "Key": src_key},
                                  CopySourceIfMatch=f'"{src.etag}"')
                etag = _split_etag(resp.get("CopyObjectResult", {}).get("ETag"))
            return ObjectInfo(dst_key, src.size, etag, time.time_ns(), src.etag)
        # Larger than one CopyObject may be: copy in parts on the server side.
        part = 1024 ** 3
        upload_id = self.create_multipart(bucket, dst_key)
        try:
            parts = []
            for n, off in enumerate(range(0, src.size, part), start=1):
                end = min(off + part, src.size) - 1
                if self._lean is not None:
                    hdrs = self._copy_headers(bucket, src_key, src.etag)
                    hdrs["x-amz-copy-source-range"] = f"bytes={off}-{end}"
                    r = self._lean_request("upload_part_copy", "PUT", bucket, dst_key, hdrs, error_in_ok=True,
                                           query={"partNumber": str(n), "uploadId": upload_id})
                    parts.append((n, _split_etag(s3http.xml_text(r.body, "ETag"))))
                    continue
                resp = self._call("upload_part_copy", dst_key, self._client.upload_part_copy,
                                  Bucket=bucket, Key=dst_key, UploadId=upload_id, PartNumber=n,
                                  CopySource={"Bucket": bucket, "Key": src_key},
                                  CopySourceRange=f"bytes={off}-{end}",
                                  CopySourceIfMatch=f'"{src.etag}"')
                parts.append((n, _split_etag(resp["CopyPartResult"]["ETag"])))
            info = self.complete_multipart(bucket, dst_key, upload_id, parts)
            return ObjectInfo(dst_key, src.size, info.etag, info.mtime_ns, src.etag)
        except BaseException:
            self.abort_multipart(bucket, dst_key, upload_id)
            raise

    @staticmethod
    def _copy_headers(bucket: str, src_key: str, etag: str) -> dict[str, str]:
        return {"x-amz-copy-source": s3http.uri_encode_path(f"/{bucket}/{src_key}"),
                "x-amz-copy-source-if-match": f'"{etag}"'}

    def delete(self, bucket: str, key: str) -> None:
        if self._lean is not None:
            self._lean_request("delete", "DELETE", bucket, key, {})
            return
        self._call("delete", key, self._client.delete_object, Bucket=bucket, Key=key)


# --------------------------------------------------------------------------------------------------
# Local directory


class LocalStore:
    """Objects as files under a directory; the bucket is the directory's path.

    Used for the embedded default volume and for demos without an S3 server. Keys map to paths; a
    key ending in "/" is a directory marker (a directory). A local file system cannot hold both "a"
    and "a/b" as objects, and an emptied directory stays until removed; that is the price of keeping
    the files readable with ordinary tools.
    """

    name = "local"
    _MULTIPART = ".ucfs-multipart"

    def __init__(self) -> None:
        self._counters = Counters()

    def statistics(self) -> dict[str, int]:
        return self._counters.snapshot()

    @staticmethod
    def _path(bucket: str, key: str) -> str:
        if ".." in key.split("/"):
            raise errors.StoreError(errors.EINVAL, "'..' is not allowed in a key", key=key)
        return os.path.join(bucket, key)

    @staticmethod
    def _etag(st: os.stat_result) -> str:
        return hashlib.md5(f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}".encode()).hexdigest()

    def _info(self, key: str, st: os.stat_result) -> ObjectInfo:
        return ObjectInfo(key, st.st_size, self._etag(st), st.st_mtime_ns)

    def _wrap(self, key: str, e: OSError) -> errors.StoreError:
        err = e.errno if e.errno in (errors.ENOENT, errors.EACCES, errors.ENAMETOOLONG, errors.ENOSPC) \
            else errors.EIO
        if e.errno in (errors.ENOTDIR, errors.EISDIR):
            err = errors.ENOENT
        return errors.StoreError(err, e.strerror or str(e), key=key)

    def head(self, bucket: str, key: str) -> ObjectInfo:
        self._counters.add("head")
        path = self._path(bucket, key)
        try:
            st = os.stat(path)
        except OSError as e:
            raise self._wrap(key, e) from None
        if key.endswith("/"):
            if not os.path.isdir(path):
                raise errors.StoreError(errors.ENOENT, "no such key", key=key)
            return ObjectInfo(key, 0, "dir", st.st_mtime_ns)
        if not os.path.isfile(path):
            raise errors.StoreError(errors.ENOENT, "no such key", key=key)
        return self._info(key, st)

    def get(self, bucket: str, key: str, start: int = 0, length: int | None = None, *,
            etag: str | None = None, into: bytearray | None = None) -> tuple[bytes, ObjectInfo]:
        self._counters.add("get")
        try:
            with open(self._path(bucket, key), "rb") as f:
                st = os.fstat(f.fileno())
                info = self._info(key, st)
                if etag and info.etag != etag:
                    raise errors.StaleError(key)
                n = st.st_size - start if length is None else length
                data = os.pread(f.fileno(), max(n, 0), start)
        except IsADirectoryError:
            raise errors.StoreError(errors.ENOENT, "no such key", key=key) from None
        except errors.StoreError:
            raise
        except OSError as e:
            raise self._wrap(key, e) from None
        self._counters.add("get_bytes", len(data))
        return data, info

    def list_page(self, bucket: str, prefix: str, *, delimiter: str = "/", token: str | None = None,
                  max_keys: int = 1000) -> ListPage:
        self._counters.add("list")
        # Only directory-shaped prefixes ("" or ending in "/") are needed by the file system; a
        # name-prefix inside a directory is answered by filtering that directory.
        dir_part, _, name_part = prefix.rpartition("/")
        base = dir_part + "/" if dir_part else ""
        entries: list[tuple[str, bool, os.stat_result | None]] = []
        if not delimiter:
            # Every directory is a marker key ("a/b/"), every file an object key, as in S3.
            for root, dirs, files in os.walk(self._path(bucket, base) if base else bucket):
                dirs[:] = [d for d in dirs if d != self._MULTIPART]
                rel = os.path.relpath(root, bucket)
                rel = "" if rel == "." else rel + "/"
                if rel and rel.startswith(prefix):
                    entries.append((rel, False, None))
                for f in files:
                    if (rel + f).startswith(prefix) and not f.startswith(".ucfs-tmp-"):
                        entries.append((rel + f, False, None))
        else:
            try:
                with os.scandir(self._path(bucket, base) if base else bucket) as it:
                    for e in it:
                        if e.name == self._MULTIPART or e.name.startswith(".ucfs-tmp-"):
                            continue
                        if not e.name.startswith(name_part):
                            continue
                        isdir = e.is_dir(follow_symlinks=False)
                        entries.append((base + e.name + ("/" if isdir else ""), isdir, None))
            except (FileNotFoundError, NotADirectoryError):
                pass
            except OSError as e:
                raise self._wrap(prefix, e) from None
            if prefix.endswith("/") and os.path.isdir(self._path(bucket, prefix)) and prefix:
                entries.append((prefix, False, None))  # the directory's own marker
        entries.sort()
        start = 0
        if token:
            start = next((i for i, (k, _, _) in enumerate(entries) if k > token), len(entries))
        chunk = entries[start:start + max_keys]
        objects, prefixes = [], []
        for k, isdir, _ in chunk:
            if isdir:
                prefixes.append(k)
                continue
            try:
                st = os.stat(self._path(bucket, k))
            except OSError:
                continue
            objects.append(ObjectInfo(k, 0, "dir", st.st_mtime_ns) if k.endswith("/")
                           else self._info(k, st))
        nxt = chunk[-1][0] if start + max_keys < len(entries) else None
        return ListPage(objects, prefixes, nxt)

    def _atomic_write(self, path: str, chunks: Iterable[bytes]) -> os.stat_result:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = os.path.join(os.path.dirname(path), f".ucfs-tmp-{uuid.uuid4().hex}")
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
        os.replace(tmp, path)
        return os.stat(path)

    def put(self, bucket: str, key: str, body: bytes | BinaryIO, size: int) -> ObjectInfo:
        self._counters.add("put")
        _check_key(key)
        path = self._path(bucket, key)
        try:
            if key.endswith("/"):
                os.makedirs(path, exist_ok=True)
                return ObjectInfo(key, 0, "dir", os.stat(path).st_mtime_ns)
            st = self._atomic_write(path, [_read_body(body, size)])
        except OSError as e:
            raise self._wrap(key, e) from None
        self._counters.add("put_bytes", size)
        return self._info(key, st)

    def _mp_dir(self, bucket: str, upload_id: str) -> str:
        return os.path.join(bucket, self._MULTIPART, upload_id)

    def create_multipart(self, bucket: str, key: str) -> str:
        _check_key(key)
        upload_id = uuid.uuid4().hex
        d = self._mp_dir(bucket, upload_id)
        os.makedirs(d)
        with open(os.path.join(d, "key"), "w") as f:
            f.write(key)
        return upload_id

    def upload_part(self, bucket: str, key: str, upload_id: str, part_number: int,
                    body: bytes | BinaryIO, size: int) -> str:
        self._counters.add("upload_part")
        data = _read_body(body, size)
        d = self._mp_dir(bucket, upload_id)
        if not os.path.isdir(d):
            raise errors.StoreError(errors.ENOENT, "no such upload", key=key, code="NoSuchUpload")
        with open(os.path.join(d, f"{part_number:05d}"), "wb") as f:
            f.write(data)
        return hashlib.md5(data).hexdigest()

    def complete_multipart(self, bucket: str, key: str, upload_id: str,
                           parts: list[tuple[int, str]]) -> ObjectInfo:
        d = self._mp_dir(bucket, upload_id)
        if not os.path.isdir(d):
            raise errors.StoreError(errors.ENOENT, "no such upload", key=key, code="NoSuchUpload")

        def chunks():
            for n, _ in sorted(parts):
                with open(os.path.join(d, f"{n:05d}"), "rb") as f:
                    yield f.read()

        st = self._atomic_write(self._path(bucket, key), chunks())
        self.abort_multipart(bucket, key, upload_id)
        return self._info(key, st)

    def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None:
        import shutil

        shutil.rmtree(self._mp_dir(bucket, upload_id), ignore_errors=True)

    def list_multipart(self, bucket: str, prefix: str) -> list[Upload]:
        out = []
        root = os.path.join(bucket, self._MULTIPART)
        for upload_id in sorted(os.listdir(root)) if os.path.isdir(root) else ():
            try:
                with open(os.path.join(root, upload_id, "key")) as f:
                    key = f.read()
                    initiated = os.fstat(f.fileno()).st_mtime
            except OSError:
                continue
            if key.startswith(prefix):
                out.append(Upload(key, upload_id, initiated))
        return out

    def copy(self, bucket: str, src_key: str, dst_key: str) -> ObjectInfo:
        self._counters.add("copy")
        _check_key(dst_key)
        if src_key.endswith("/"):
            return self.put(bucket, dst_key, b"", 0)  # a directory marker
        try:
            with open(self._path(bucket, src_key), "rb") as f:
                st = self._atomic_write(self._path(bucket, dst_key), iter(lambda: f.read(1 << 20), b""))
        except OSError as e:
            raise self._wrap(src_key, e) from None
        return self._info(dst_key, st)

    def delete(self, bucket: str, key: str) -> None:
        self._counters.add("delete")
        path = self._path(bucket, key)
        try:
            if key.endswith("/"):
                os.rmdir(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass  # S3 deletes are idempotent
        except OSError as e:
            if e.errno == errors.ENOTEMPTY:
                return  # the marker "goes away" but the prefix stays, as in S3
            raise self._wrap(key, e) from None

    def check_bucket(self, bucket: str) -> None:
        if not os.path.isdir(bucket):
            why = (f"{bucket!r} is not a directory" if os.path.lexists(bucket)
                   else f"local directory {bucket!r} does not exist")
            raise errors.StoreError(errors.ENXIO, why, code="NoSuchBucket")


# --------------------------------------------------------------------------------------------------
# In memory


@dataclass
class _MemObject:
    data: bytes
    etag: str
    mtime_ns: int


@dataclass
class MemoryStore:
    """Objects in a dict, for unit tests. Same semantics as S3 for everything the file system uses."""

    name: str = "memory"
    buckets: dict[str, dict[str, _MemObject]] = field(default_factory=dict)
    _uploads: dict[str, dict] = field(default_factory=dict)
    _counters: Counters = field(default_factory=Counters)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def statistics(self) -> dict[str, int]:
        return self._counters.snapshot()

    def _bucket(self, bucket: str) -> dict[str, _MemObject]:
        try:
            return self.buckets[bucket]
        except KeyError:
            raise errors.from_s3("NoSuchBucket", 404, "no such bucket", key=bucket) from None

    def _obj(self, bucket: str, key: str) -> _MemObject:
        try:
            return self._bucket(bucket)[key]
        except KeyError:
            raise errors.from_s3("NoSuchKey", 404, "no such key", key=key) from None

    def put_bytes(self, bucket: str, key: str, data: bytes) -> ObjectInfo:
        """Test helper: create the bucket if needed and store `data`."""
        self.buckets.setdefault(bucket, {})
        return self.put(bucket, key, data, len(data))

    def head(self, bucket: str, key: str) -> ObjectInfo:
        self._counters.add("head")
        o = self._obj(bucket, key)
        return ObjectInfo(key, len(o.data), o.etag, o.mtime_ns)

    def get(self, bucket: str, key: str, start: int = 0, length: int | None = None, *,
            etag: str | None = None, into: bytearray | None = None) -> tuple[bytes, ObjectInfo]:
        self._counters.add("get")
        o = self._obj(bucket, key)
        if etag and o.etag != etag:
            raise errors.StaleError(key)
        if start and start >= len(o.data):
            raise errors.from_s3("InvalidRange", 416, "range not satisfiable", key=key)
        end = len(o.data) if length is None else start + length
        data = o.data[start:end]
        self._counters.add("get_bytes", len(data))
        return data, ObjectInfo(key, len(o.data), o.etag, o.mtime_ns)

    def list_page(self, bucket: str, prefix: str, *, delimiter: str = "/", token: str | None = None,
                  max_keys: int = 1000) -> ListPage:
        self._counters.add("list")
        with self._lock:
            keys = sorted(k for k in self._bucket(bucket) if k.startswith(prefix))
        entries: list[tuple[str, bool]] = []
        seen_prefix: set[str] = set()
        for k in keys:
            rest = k[len(prefix):]
            if delimiter and delimiter in rest:
                p = prefix + rest.split(delimiter, 1)[0] + delimiter
                if p not in seen_prefix:
                    seen_prefix.add(p)
                    entries.append((p, True))
            else:
                entries.append((k, False))
        if token:
            entries = [e for e in entries if e[0] > token]
        chunk = entries[:max_keys]
        b = self._bucket(bucket)
        objects = [ObjectInfo(k, len(b[k].data), b[k].etag, b[k].mtime_ns) for k, isp in chunk if not isp]
        prefixes = [k for k, isp in chunk if isp]
        nxt = chunk[-1][0] if len(entries) > max_keys else None
        return ListPage(objects, prefixes, nxt)

    def put(self, bucket: str, key: str, body: bytes | BinaryIO, size: int) -> ObjectInfo:
        self._counters.add("put")
        _check_key(key)
        data = _read_body(body, size)
        o = _MemObject(data, hashlib.md5(data).hexdigest(), time.time_ns())
        with self._lock:
            self._bucket(bucket)[key] = o
        self._counters.add("put_bytes", size)
        return ObjectInfo(key, size, o.etag, o.mtime_ns)

    def create_multipart(self, bucket: str, key: str) -> str:
        self._counters.add("create_multipart")
        _check_key(key)
        self._bucket(bucket)
        upload_id = uuid.uuid4().hex
        with self._lock:
            self._uploads[upload_id] = {"bucket": bucket, "key": key, "parts": {}, "initiated": time.time()}
        return upload_id

    def upload_part(self, bucket: str, key: str, upload_id: str, part_number: int,
                    body: bytes | BinaryIO, size: int) -> str:
        self._counters.add("upload_part")
        data = _read_body(body, size)
        with self._lock:
            up = self._uploads.get(upload_id)
            if up is None:
                raise errors.from_s3("NoSuchUpload", 404, "no such upload", key=key)
            up["parts"][part_number] = data
        return hashlib.md5(data).hexdigest()

    def complete_multipart(self, bucket: str, key: str, upload_id: str,
                           parts: list[tuple[int, str]]) -> ObjectInfo:
        self._counters.add("complete_multipart")
        with self._lock:
            up = self._uploads.pop(upload_id, None)
        if up is None:
            raise errors.from_s3("NoSuchUpload", 404, "no such upload", key=key)
        data = b"".join(up["parts"][n] for n, _ in sorted(parts))
        digest = hashlib.md5(b"".join(bytes.fromhex(e) for _, e in sorted(parts))).hexdigest()
        o = _MemObject(data, f"{digest}-{len(parts)}", time.time_ns())
        with self._lock:
            self._bucket(bucket)[key] = o
        return ObjectInfo(key, len(data), o.etag, o.mtime_ns)

    def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None:
        self._counters.add("abort_multipart")
        with self._lock:
            self._uploads.pop(upload_id, None)

    def list_multipart(self, bucket: str, prefix: str) -> list[Upload]:
        with self._lock:
            return [Upload(u["key"], uid, u["initiated"]) for uid, u in self._uploads.items()
                    if u["bucket"] == bucket and u["key"].startswith(prefix)]

    def copy(self, bucket: str, src_key: str, dst_key: str) -> ObjectInfo:
        self._counters.add("copy")
        _check_key(dst_key)
        o = self._obj(bucket, src_key)
        n = _MemObject(o.data, o.etag, time.time_ns())
        with self._lock:
            self._bucket(bucket)[dst_key] = n
        return ObjectInfo(dst_key, len(o.data), n.etag, n.mtime_ns, o.etag)

    def delete(self, bucket: str, key: str) -> None:
        self._counters.add("delete")
        with self._lock:
            self._bucket(bucket).pop(key, None)

    def check_bucket(self, bucket: str) -> None:
        self._bucket(bucket)
