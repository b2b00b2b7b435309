"""Fault injection for tests: a loopback HTTP proxy that breaks S3 requests on purpose, and a `Store`
wrapper that fails calls on purpose.

`FaultProxy` sits between a ucfs mount and the S3 server (point the catalog's `endpoint_url` at
`proxy.url`). It understands just enough HTTP/1.1 to see where each request and response begins and
ends on a keep-alive connection, so faults hit chosen *requests*, not just connections. Rules say
which requests (method and request-target regexes), how often (a count, a probability, or both) and
what happens to them:

- `fail`: an error response (500 InternalError, 503 SlowDown, 403 AccessDenied...) answered by the
  proxy itself, without the server ever seeing the request;
- `reset`: the connection is reset, either before the request reaches the server or after the
  server has answered it (the client cannot tell whether it took effect: the nasty case for writes);
- `stall`: the response is held back for N seconds (before its head, or after some body bytes);
- `truncate`: the response is cut after N body bytes while its Content-Length promises more.

`outage(seconds)` takes the whole store away: every connection, open or new, is reset at once until
the outage ends. Rules and outages are switched from the test's thread while requests flow.

`FaultyStore` wraps any `ucfs.store.Store` for unit tests: chosen calls raise chosen `StoreError`s,
or a GET returns fewer bytes than asked, by the same kind of rules.

Both count what they did (`statistics()`), so a test can say how many faults it injected.
"""

from __future__ import annotations

import asyncio
import collections
import email.utils
import itertools
import logging
import random
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .. import errors
from ..store import ListPage, ObjectInfo, Store, Upload
from .proxy import CHUNK_BYTES, Connection, ConnectionAbort, LatencyProxy

log = logging.getLogger(__name__)

# Largest request or response head we accept; S3 heads are a few hundred bytes.
MAX_HEAD_BYTES = 64 * 1024

# Standard reason phrases for the statuses tests inject.
_REASONS = {400: "Bad Request", 403: "Forbidden", 404: "Not Found", 409: "Conflict", 429: "Too Many Requests",
            500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable",
            504: "Gateway Timeout"}
# The S3 error code that goes with a status when the test names none.
_DEFAULT_CODES = {403: "AccessDenied", 404: "NoSuchKey", 429: "SlowDown", 500: "InternalError",
                  503: "SlowDown", 504: "GatewayTimeout"}


@dataclass(eq=False)
class Rule:
    """Which requests a fault hits, how often, and what it does to them.

    `method` and `path` are regular expressions searched in the request's method and target (path and
    query, as sent: percent-encoded). `times` caps how often the rule fires (None: no cap);
    `probability` makes it fire on only some of the requests it matches. `enabled` switches it off
    and on while requests flow; `fired` counts the requests it hit.
    """

    action: str  # "fail", "reset", "stall" or "truncate"
    method: str | None = None
    path: str | None = None
    times: int | None = None
    probability: float = 1.0
    # fail
    status: int = 503
    code: str = ""
    # reset: after the server answered (True) or before the request reaches it (False)
    after_response: bool = False
    # stall
    seconds: float = 0.0
    # stall / truncate: body bytes sent before the fault strikes
    after_bytes: int = 0
    # truncate: how the connection ends once the bytes are sent: "close" (a clean FIN) or "reset"
    end: str = "close"
    enabled: bool = True
    fired: int = 0
    _method_re: re.Pattern | None = field(default=None, init=False, repr=False)
    _path_re: re.Pattern | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.action not in ("fail", "reset", "stall", "truncate"):
            raise ValueError(f"unknown fault action {self.action!r}")
        if self.end not in ("close", "reset"):
            raise ValueError("end must be 'close' or 'reset'")
        self._method_re = re.compile(self.method) if self.method else None
        self._path_re = re.compile(self.path) if self.path else None

    def matches(self, method: str, target: str) -> bool:
        if not self.enabled or (self.times is not None and self.fired >= self.times):
            return False
        if self._method_re is not None and not self._method_re.fullmatch(method):
            return False
        return self._path_re is None or self._path_re.search(target) is not None

    def disable(self) -> None:
        self.enabled = False

    def enable(self) -> None:
        self.enabled = True


@dataclass
class _Head:
    """A parsed HTTP request or response head."""

    raw: bytes
    first: list[str]  # request: method, target, version; response: version, status, reason
    headers: dict[str, str]  # lower-case names (last one wins; S3 does not repeat the ones we read)

    @property
    def version(self) -> str:
        # Responses start with the version ("HTTP/1.1 200 OK"), requests end with it.
        if self.raw.startswith(b"HTTP/"):
            return self.first[0]
        return self.first[2] if len(self.first) > 2 else "HTTP/1.0"

    @property
    def keep_alive(self) -> bool:
        conn = self.headers.get("connection", "").lower()
        if self.version == "HTTP/1.0":
            return "keep-alive" in conn
        return "close" not in conn


def _parse_head(raw: bytes) -> _Head:
    lines = raw.decode("latin-1").split("\r\n")
    first = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return _Head(raw, first, headers)


class _SocketReader:
    """Buffered reads from a non-blocking socket on the proxy's event loop."""

    def __init__(self, sock) -> None:
        self.sock = sock
        self.buf = bytearray()

    async def _fill(self) -> bool:
        data = await asyncio.get_running_loop().sock_recv(self.sock, CHUNK_BYTES)
        if not data:
            return False
        self.buf += data
        return True

    async def head(self) -> bytes | None:
        """The next message head (up to and including the blank line); None at a clean end of
        stream between messages."""
        return await self._through(b"\r\n\r\n", none_at_clean_end=True)

    async def some(self, limit: int) -> bytes:
        """Up to `limit` bytes (at least one), or b'' at end of stream."""
        if not self.buf and not await self._fill():
            return b""
        n = min(limit, len(self.buf))
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def line(self) -> bytes:
        return await self._through(b"\r\n")

    async def _through(self, sep: bytes, none_at_clean_end: bool = False) -> bytes | None:
        """The bytes up to and including `sep`. The stream ending before it aborts the connection,
        except (with `none_at_clean_end`) when it ends with nothing buffered: then None."""
        while True:
            i = self.buf.find(sep)
            if i >= 0:
                out = bytes(self.buf[:i + len(sep)])
                del self.buf[:i + len(sep)]
                return out
            if len(self.buf) > MAX_HEAD_BYTES:
                raise ConnectionAbort()
            if not await self._fill():
                if none_at_clean_end and not self.buf:
                    return None
                raise ConnectionAbort()


class FaultProxy(LatencyProxy):
    """An HTTP-aware loopback proxy in front of an S3 server that injects faults by rule.

    Use it like `LatencyProxy` (start/stop or a `with` block); then add rules with `fail`, `reset`,
    `stall` and `truncate`, and take the store away with `outage`. Every method may be called from any
    thread while the proxy runs.
    """

    def __init__(self, target_host: str, target_port: int, *, seed: int = 0, **kwargs):
        kwargs.setdefault("delay_ms", 0.0)
        super().__init__(target_host, target_port, **kwargs)
        self._lock = threading.Lock()
        self._rules: list[Rule] = []
        self._rng = random.Random(seed)
        self._outage_until = 0.0  # time.monotonic(); an outage is on while now < this
        self._request_ids = itertools.count(1)
        self.faults: collections.Counter[str] = collections.Counter()  # what was injected, by kind
        # (method, target, what happened) of recent requests, for assertions and for debugging a test.
        self.log: collections.deque[tuple[str, str, str]] = collections.deque(maxlen=20_000)
        self._n_requests = 0

    # -- rules (called from the test's thread) ---------------------------------------------------
    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self._rules.append(rule)
        return rule

    def remove(self, rule: Rule) -> None:
        with self._lock:
            if rule in self._rules:
                self._rules.remove(rule)

    def clear(self) -> None:
        """Remove every rule and end any outage."""
        with self._lock:
            self._rules.clear()
            self._outage_until = 0.0

    def fail(self, status: int = 503, code: str = "", **match) -> Rule:
        """Answer matching requests with an S3 error response, without asking the server."""
        return self.add(Rule("fail", status=status, code=code or _DEFAULT_CODES.get(status, str(status)),
                             **match))

    def reset(self, *, after_response: bool = False, **match) -> Rule:
        """Reset the connection of matching requests, before the server sees them or (with
        after_response) once the server has answered, before the client gets the answer."""
        return self.add(Rule("reset", after_response=after_response, **match))

    def stall(self, seconds: float, *, after_bytes: int = 0, **match) -> Rule:
        """Hold matching responses back for `seconds`: before the head, or after `after_bytes` of body."""
        return self.add(Rule("stall", seconds=seconds, after_bytes=after_bytes, **match))

    def truncate(self, after_bytes: int, *, end: str = "close", **match) -> Rule:
        """Cut matching responses after `after_bytes` body bytes (Content-Length says more)."""
        return self.add(Rule("truncate", after_bytes=after_bytes, end=end, **match))

    def outage(self, seconds: float) -> None:
        """Take the store away for `seconds` from now: open connections are reset at once, new ones
        (and new requests on connections that survive) are reset until the outage ends."""
        with self._lock:
            self._outage_until = time.monotonic() + seconds
        self.faults["outages"] += 1
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._reset_all)

    def end_outage(self) -> None:
        with self._lock:
            self._outage_until = 0.0

    @property
    def in_outage(self) -> bool:
        return time.monotonic() < self._outage_until

    def reset_all(self) -> None:
        """Reset every open connection once (idle keep-alive ones too), as a restarting server would."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            done = threading.Event()

            def run() -> None:
                self._reset_all()
                done.set()

            loop.call_soon_threadsafe(run)
            done.wait(5)

    def _reset_all(self) -> None:
        # Cancel each connection's task and let it reset its own sockets: closing a socket under a
        # task still waiting to read it would leave that wait registered on a file descriptor number
        # the next accepted connection may get, and the stale reader would steal its bytes.
        for conn, task in list(self._conns.items()):
            if not conn.closed:
                self.faults["outage_resets"] += 1
                conn.tags["reset"] = True
                task.cancel()

    def statistics(self) -> dict:
        out = super().statistics()
        out.update({f"fault_{k}": v for k, v in self.faults.items()})
        out["requests"] = self._n_requests
        return out

    def _choose(self, method: str, target: str) -> Rule | None:
        with self._lock:
            for rule in self._rules:
                if rule.matches(method, target) and (rule.probability >= 1.0 or
                                                     self._rng.random() < rule.probability):
                    rule.fired += 1
                    return rule
        return None

    # -- serving (the proxy's event loop) ----------------------------------------------------------
    async def handle_connection(self, conn: Connection) -> None:
        if self.in_outage:
            self.faults["outage_resets"] += 1
            conn.reset()
            return
        try:
            await self._serve(conn)
        except asyncio.CancelledError:
            if conn.tags.get("reset"):
                conn.reset()  # `_reset_all`: the peers must see a reset, not a clean close
            raise

    async def _serve(self, conn: Connection) -> None:
        client = _SocketReader(conn.client)
        upstream: _SocketReader | None = None
        while True:
            raw = await client.head()
            if raw is None:
                return  # the client closed between requests
            req = _parse_head(raw)
            if len(req.first) < 2:
                raise ConnectionAbort()
            method, target = req.first[0], req.first[1]
            self._n_requests += 1
            if self.in_outage:
                self.log.append((method, target, "outage"))
                self.faults["outage_resets"] += 1
                raise ConnectionAbort()
            rule = self._choose(method, target)
            if rule is not None and rule.action == "fail":
                self.log.append((method, target, f"fail {rule.status}"))
                self.faults[f"status_{rule.status}"] += 1
                if not await self._answer_error(conn, client, req, rule):
                    return
                continue
            if rule is not None and rule.action == "reset" and not rule.after_response:
                self.log.append((method, target, "reset"))
                self.faults["resets"] += 1
                raise ConnectionAbort()
            if upstream is None:
                try:
                    conn.server = await self.open_upstream(conn)
                except OSError:
                    self._stats["upstream_failures"] += 1
                    raise ConnectionAbort() from None
                upstream = _SocketReader(conn.server)
            keep = await self._forward(conn, client, upstream, req, rule)
            if not keep:
                return

    async def _answer_error(self, conn: Connection, client: _SocketReader, req: _Head, rule: Rule) -> bool:
        """Send an S3 error document for `req`; True when the connection can carry on."""
        keep = req.keep_alive
        expects = req.headers.get("expect", "").lower() == "100-continue"
        if expects:
            keep = False  # the body was never sent: the stream is in an unknown state after us
        else:
            # Read the request body away so the next request starts where it should.
            await self._relay_body(client, None, self._request_framing(req))
        rid = f"fault-{next(self._request_ids)}"
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{rule.code}</Code>'
                f"<Message>injected by FaultProxy</Message><RequestId>{rid}</RequestId></Error>").encode()
        if req.first[0] == "HEAD":
            body = b""
        head = (f"HTTP/1.1 {rule.status} {_REASONS.get(rule.status, 'Error')}\r\n"
                f"Date: {email.utils.formatdate(usegmt=True)}\r\n"
                f"x-amz-request-id: {rid}\r\nContent-Type: application/xml\r\n"
                f"Content-Length: {len(body)}\r\nConnection: {'keep-alive' if keep else 'close'}\r\n\r\n")
        await asyncio.get_running_loop().sock_sendall(conn.client, head.encode() + body)
        if not keep:
            conn.close()
        return keep

    async def _forward(self, conn: Connection, client: _SocketReader, upstream: _SocketReader, req: _Head,
                       rule: Rule | None) -> bool:
        """Relay one request and its response, applying `rule`; True when the connection carries on."""
        loop = asyncio.get_running_loop()
        method, target = req.first[0], req.first[1]
        await loop.sock_sendall(conn.server, req.raw)
        conn.bytes_up += len(req.raw)
        expects = req.headers.get("expect", "").lower() == "100-continue"
        resp = None
        if expects:
            # The server answers "100 Continue" (then wants the body) or a final status at once.
            resp = await self._response_head(upstream)
            if resp.first[1] == "100":
                await loop.sock_sendall(conn.client, resp.raw)
                resp = None
        if resp is None:
            await self._relay_body(client, conn, self._request_framing(req), up=True)
            resp = await self._response_head(upstream)
            while resp.first[1] == "100":  # an unasked-for interim response: pass it on
                await loop.sock_sendall(conn.client, resp.raw)
                resp = await self._response_head(upstream)
        framing = self._response_framing(req, resp)
        status = resp.first[1]
        if rule is not None and rule.action == "reset":
            # The server has done the work; the client never learns of it.
            self.log.append((method, target, f"reset after {status}"))
            self.faults["resets_after_response"] += 1
            raise ConnectionAbort()
        if rule is not None and rule.action == "stall" and rule.after_bytes <= 0:
            self.log.append((method, target, f"stall {rule.seconds:g}s"))
            self.faults["stalls"] += 1
            await asyncio.sleep(rule.seconds)
        if rule is None:
            # Logged before the client can have the answer: a test that counts requests in the log
            # once its call returned must find this one there.
            self.log.append((method, target, status))
        await loop.sock_sendall(conn.client, resp.raw)
        conn.bytes_down += len(resp.raw)
        if rule is not None and rule.action == "truncate" and framing[0] != "none":
            self.log.append((method, target, f"truncate {status} after {rule.after_bytes}"))
            self.faults["truncations"] += 1
            await self._relay_body(upstream, conn, framing, limit=rule.after_bytes)
            if rule.end == "reset":
                raise ConnectionAbort()
            conn.close()
            return False
        if rule is not None and rule.action == "stall" and rule.after_bytes > 0 and framing[0] != "none":
            self.log.append((method, target, f"stall {rule.seconds:g}s after {rule.after_bytes}"))
            self.faults["stalls"] += 1
            sent = await self._relay_body(upstream, conn, framing, limit=rule.after_bytes)
            await asyncio.sleep(rule.seconds)
            await self._relay_body(upstream, conn, framing, skip=sent)
        else:
            await self._relay_body(upstream, conn, framing)
        if framing[0] == "close":
            conn.close()
            return False
        return req.keep_alive and resp.keep_alive

    async def _response_head(self, upstream: _SocketReader) -> _Head:
        raw = await upstream.head()
        if raw is None:
            raise ConnectionAbort()  # the server closed without answering: let the client see it too
        head = _parse_head(raw)
        if len(head.first) < 2:
            raise ConnectionAbort()
        return head

    @staticmethod
    def _request_framing(req: _Head) -> tuple:
        if "chunked" in req.headers.get("transfer-encoding", "").lower():
            return ("chunked",)
        n = int(req.headers.get("content-length", "0") or 0)
        return ("length", n) if n else ("none",)

    @staticmethod
    def _response_framing(req: _Head, resp: _Head) -> tuple:
        status = int(resp.first[1])
        if req.first[0] == "HEAD" or status in (204, 304) or 100 <= status < 200:
            return ("none",)
        if "chunked" in resp.headers.get("transfer-encoding", "").lower():
            return ("chunked",)
        if "content-length" in resp.headers:
            n = int(resp.headers["content-length"])
            return ("length", n) if n else ("none",)
        return ("close",)

    async def _relay_body(self, src: _SocketReader, conn: Connection | None, framing: tuple, *,
                          up: bool = False, limit: int | None = None, skip: int = 0) -> int:
        """Copy one message body from src to the other side of conn (or drop it when conn is None).

        With `limit`, stop after that many body bytes; with `skip`, the first `skip` bytes were sent
        already (a stalled body resuming). Returns the body bytes sent. Chunked bodies are passed on
        with their framing; `limit` counts framing bytes there, which is close enough for a fault.
        """
        loop = asyncio.get_running_loop()
        dst = None if conn is None else (conn.server if up else conn.client)
        sent = 0

        async def emit(data: bytes) -> None:
            nonlocal sent
            if dst is not None and data:
                await loop.sock_sendall(dst, data)
                if up:
                    conn.bytes_up += len(data)
                else:
                    conn.bytes_down += len(data)
            sent += len(data)

        kind = framing[0]
        if kind == "none":
            return 0
        if kind == "chunked":
            while True:
                if limit is not None and sent >= limit:
                    return sent
                line = await src.line()
                await emit(line)
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while True:  # trailers, up to the blank line
                        t = await src.line()
                        await emit(t)
                        if t == b"\r\n":
                            return sent
                left = size + 2  # the data and its CRLF
                while left:
                    data = await src.some(left)
                    if not data:
                        raise ConnectionAbort()
                    left -= len(data)
                    await emit(data)
        total = framing[1] if kind == "length" else None
        left = None if total is None else total - skip
        sent_limit = None if limit is None else limit
        while left is None or left > 0:
            want = CHUNK_BYTES if left is None else min(left, CHUNK_BYTES)
            if sent_limit is not None:
                want = min(want, sent_limit - sent)
                if want <= 0:
                    return sent
            data = await src.some(want)
            if not data:
                if left is None:
                    return sent  # "close" framing: the end of the stream is the end of the body
                raise ConnectionAbort()
            if left is not None:
                left -= len(data)
            await emit(data)
        return sent


# --------------------------------------------------------------------------------------------------
# A Store wrapper for unit tests


def slow_down(key: str = "") -> errors.StoreError:
    """What S3 says when it throttles: 503 SlowDown (transient)."""
    return errors.from_s3("SlowDown", 503, "Please reduce your request rate (injected)", key=key,
                          request_id="fault")


def internal_error(key: str = "") -> errors.StoreError:
    return errors.from_s3("InternalError", 500, "We encountered an internal error (injected)", key=key,
                          request_id="fault")


def access_denied(key: str = "") -> errors.StoreError:
    """A permanent failure: retrying does not help."""
    return errors.from_s3("AccessDenied", 403, "Access Denied (injected)", key=key, request_id="fault")


def connection_reset(key: str = "") -> errors.StoreError:
    return errors.connection_error("store request failed: connection reset (injected)", key=key)


@dataclass(eq=False)
class StoreFault:
    """One rule of a `FaultyStore`: which calls (`ops`, a key regex), how often, and what happens."""

    ops: frozenset[str] | None  # Store method names ("get", "put", ...); None: every call
    key: str | None = None
    error: Callable[[str], errors.StoreError] | None = None  # raise this (given the key)...
    keep_bytes: int | None = None  # ...or, for get, return only this many bytes of the answer
    times: int | None = None
    probability: float = 1.0
    enabled: bool = True
    fired: int = 0

    def matches(self, op: str, key: str) -> bool:
        if not self.enabled or (self.times is not None and self.fired >= self.times):
            return False
        if self.ops is not None and op not in self.ops:
            return False
        return self.key is None or re.search(self.key, key) is not None

    def disable(self) -> None:
        self.enabled = False

    def enable(self) -> None:
        self.enabled = True


class FaultyStore:
    """Any `Store`, with calls that fail or come back short by rule (for unit tests).

    Calls are forwarded to the wrapped store unless a rule says otherwise. An error rule raises
    before the wrapped store is asked (the request "never arrived"); a short-data rule lets a GET
    through and cuts its answer, as a broken connection would if nothing checked the length.
    """

    def __init__(self, inner: Store, *, seed: int = 0):
        self.inner = inner
        self.name = inner.name
        self._rules: list[StoreFault] = []
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self.injected: collections.Counter[str] = collections.Counter()

    # -- rules ----------------------------------------------------------------------------------
    def fail(self, ops: str | tuple[str, ...] | None = None,
             error: Callable[[str], errors.StoreError] = slow_down, **kw) -> StoreFault:
        """Calls of `ops` (all when None) raise `error(key)` instead of reaching the store."""
        return self._add(StoreFault(self._ops(ops), error=error, **kw))

    def short(self, keep_bytes: int, **kw) -> StoreFault:
        """GETs return only `keep_bytes` of what they should."""
        return self._add(StoreFault(frozenset({"get"}), keep_bytes=keep_bytes, **kw))

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    @staticmethod
    def _ops(ops) -> frozenset[str] | None:
        if ops is None:
            return None
        return frozenset({ops} if isinstance(ops, str) else ops)

    def _add(self, rule: StoreFault) -> StoreFault:
        with self._lock:
            self._rules.append(rule)
        return rule

    def _choose(self, op: str, key: str, *, short: bool) -> StoreFault | None:
        with self._lock:
            for rule in self._rules:
                if (rule.keep_bytes is not None) != short or not rule.matches(op, key):
                    continue
                if rule.probability < 1.0 and self._rng.random() >= rule.probability:
                    continue
                rule.fired += 1
                self.injected["short" if short else op] += 1
                return rule
        return None

    def _before(self, op: str, key: str) -> None:
        rule = self._choose(op, key, short=False)
        if rule is not None and rule.error is not None:
            raise rule.error(key)

    # -- the Store protocol ----------------------------------------------------------------------
    def statistics(self) -> dict[str, int]:
        out = dict(self.inner.statistics())
        out.update({f"injected_{k}": v for k, v in self.injected.items()})
        return out

    def head(self, bucket: str, key: str) -> ObjectInfo:
        self._before("head", key)
        return self.inner.head(bucket, key)

    def get(self, bucket: str, key: str, start: int = 0, length: int | None = None, *,
            etag: str | None = None) -> tuple[bytes, ObjectInfo]:
        self._before("get", key)
        data, info = self.inner.get(bucket, key, start, length, etag=etag)
        rule = self._choose("get", key, short=True)
        if rule is not None:
            data = data[:rule.keep_bytes]
        return data, info

    def list_page(self, bucket: str, prefix: str, *, delimiter: str = "/", token: str | None = None,
                  max_keys: int = 1000) -> ListPage:
        self._before("list_page", prefix)
        return self.inner.list_page(bucket, prefix, delimiter=delimiter, token=token, max_keys=max_keys)

    def put(self, bucket: str, key: str, body, size: int) -> ObjectInfo:
        self._before("put", key)
        return self.inner.put(bucket, key, body, size)

    def create_multipart(self, bucket: str, key: str) -> str:
        self._before("create_multipart", key)
        return self.inner.create_multipart(bucket, key)

    def upload_part(self, bucket: str, key: str, upload_id: str, part_number: int, body, size: int) -> str:
        self._before("upload_part", key)
        return self.inner.upload_part(bucket, key, upload_id, part_number, body, size)

    def complete_multipart(self, bucket: str, key: str, upload_id: str,
                           parts: list[tuple[int, str]]) -> ObjectInfo:
        self._before("complete_multipart", key)
        return self.inner.complete_multipart(bucket, key, upload_id, parts)

    def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None:
        self._before("abort_multipart", key)
        self.inner.abort_multipart(bucket, key, upload_id)

    def list_multipart(self, bucket: str, prefix: str) -> list[Upload]:
        self._before("list_multipart", prefix)
        return self.inner.list_multipart(bucket, prefix)

    def copy(self, bucket: str, src_key: str, dst_key: str) -> ObjectInfo:
        self._before("copy", dst_key)
        return self.inner.copy(bucket, src_key, dst_key)

    def delete(self, bucket: str, key: str) -> None:
        self._before("delete", key)
        self.inner.delete(bucket, key)

    def check_bucket(self, bucket: str) -> None:
        self._before("check_bucket", bucket)
        self.inner.check_bucket(bucket)
