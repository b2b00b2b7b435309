"""A loopback TCP proxy that puts a fixed latency between a client and an S3 endpoint.

`ucfs bench --latency-ms N` runs every measurement through it to see how the mount behaves when each
request/response round trip costs N ms more (a store across a network instead of on loopback), and
fault-injection tests subclass it to break connections on purpose.

How the delay is added: the client->server direction is a *delay line*. Each chunk read from the
client is stamped with its arrival time and written to the server `delay_ms` later, in order; the line
keeps reading meanwhile. A long upload is therefore shifted by `delay_ms`, not throttled, while every
request (and so every round trip) starts `delay_ms` later. The server->client direction is forwarded
as soon as it arrives.

The proxy shares the CPU with what it measures, so it spends little: one thread moves every
connection's bytes with epoll and splice(2), and the bytes never enter Python (see `_Splicer`).
Measured on a 2-core VM against the test RGW with a 10 ms delay: ~0.2 ms of CPU per proxied 150 KiB
GET and ~0.3 CPU-seconds per GB uploaded, where an asyncio loop with a task per direction spent
~0.45 ms and ~0.75 s. Subclasses that override a data hook get that asyncio path, with the data
in Python.

Not modelled: the extra round trip of a TCP handshake (the proxy accepts locally at once, and the
upstream connection is opened without delay), packet loss, and bandwidth limits.

Hooks for subclasses (a `FaultProxy` for fault-injection tests), all per connection:

- `handle_connection(conn)`: the whole life of one accepted client connection. The default opens the
  upstream connection and relays; override to answer by itself (e.g. an HTTP 503) or refuse.
- `connection_opened(conn)`: called once the upstream connection is open, before relaying; a good
  place to decide this connection's fate and remember it on `conn.tags`.
- `on_request_data(conn, data)` / `on_response_data(conn, data)`: every chunk passes through these
  before it is written on; return what to forward (shorter to truncate, empty to drop), await to
  stall, raise `ConnectionAbort` to break the connection at once, or set `conn.end_after_chunk`
  to end it (with a reset or a clean close) once the returned chunk is sent.

Run on its own as ``python -m ucfs.testing.proxy HOST:PORT --delay-ms N``: it prints the port it
listens on and serves until stdin closes (so it dies with the process that started it). `ucfs bench`
runs it that way so the proxy never competes with the bench's own boto3 threads for one GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import fcntl
import heapq
import itertools
import logging
import os
import select
import socket
import struct
import sys
import termios
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# Largest single read from a socket. 1 MiB keeps a 1 GB/s stream at ~1,000 loop iterations a second
# per direction, a small share of one core, where 64 KiB reads would cost sixteen times as many.
CHUNK_BYTES = 1 << 20

# Chunks a delay line may hold before it stops reading from the client. At most 64 MiB in flight
# covers 1 GB/s with up to ~60 ms delay at full speed, yet bounds memory when the server reads slowly.
DELAY_LINE_CHUNKS = 64


class ConnectionAbort(Exception):
    """Raised by a hook to end a connection at once; both sides see a reset."""


@dataclass(eq=False)
class Connection:
    """One client connection and its upstream twin, with byte counters and a place for hook state."""

    id: int
    client: socket.socket
    server: socket.socket | None = None
    bytes_up: int = 0  # client -> server, forwarded
    bytes_down: int = 0  # server -> client, forwarded
    tags: dict = field(default_factory=dict)  # free for subclasses' per-connection state
    closed: bool = False
    # Set by a data hook to end the connection right after the chunk it returned has been sent:
    # "reset" (peers see ECONNRESET) or "close" (peers see a clean end of stream). This is how a
    # truncated response is made: return the first bytes and ask for the end.
    end_after_chunk: str | None = None
    # Set while the splicer thread moves this connection's bytes (see `_Splicer`): it closes the
    # sockets itself, so no descriptor is closed under it while it still uses it.
    relay: "_Splicer | None" = None

    def reset(self) -> None:
        """Abort both sockets so each peer sees ECONNRESET rather than a clean end of stream."""
        for s in (self.client, self.server):
            if s is None or s.fileno() < 0:
                continue
            try:
                # Linger on with a zero timeout makes close() send RST instead of FIN.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.relay is not None:
            self.relay.close(self)  # the splicer closes the sockets
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self.client, self.server):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    # S3 requests and responses are small header writes followed by bodies; Nagle's algorithm would
    # hold the header back for a delayed ACK (40 ms on Linux) and add latency we did not ask for.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class LatencyProxy:
    """Forward `listen_host:listen_port` to `target_host:target_port`, adding `delay_ms` per round trip.

    `start()` runs the proxy's event loop in a background thread and returns once it listens; `stop()`
    closes every connection and joins the thread. Usable as a context manager.
    """

    def __init__(self, target_host: str, target_port: int, *, delay_ms: float,
                 listen_host: str = "127.0.0.1", listen_port: int = 0):
        if delay_ms < 0:
            raise ValueError("delay_ms must not be negative")
        self.target_host = target_host
        self.target_port = int(target_port)
        self.delay_ms = float(delay_ms)
        self.listen_host = listen_host
        self._listen_port = listen_port
        self._lsock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._ids = itertools.count(1)
        self._conns: dict[Connection, asyncio.Task] = {}
        self._splicer: _Splicer | None = None  # started with the first connection it relays
        self._stats = {"connections": 0, "upstream_failures": 0, "bytes_up": 0, "bytes_down": 0}

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._lsock is None:
            raise RuntimeError("proxy not started")
        return self._lsock.getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.listen_host}]" if ":" in self.listen_host else self.listen_host
        return f"http://{host}:{self.port}"

    def start(self) -> "LatencyProxy":
        if self._thread is not None:
            raise RuntimeError("proxy already started")
        # Bind here, in the caller's thread, so a port in use fails start() itself and `.port` is
        # known the moment start() returns.
        lsock = socket.socket(socket.AF_INET6 if ":" in self.listen_host else socket.AF_INET)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind((self.listen_host, self._listen_port))
        lsock.listen(512)  # 64-way copies open many connections at once
        lsock.setblocking(False)
        self._lsock = lsock
        self._thread = threading.Thread(target=self._thread_main, name=f"proxy-{self.port}", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error
        log.debug("proxy %s -> %s:%d, delay %.1f ms", self.url, self.target_host, self.target_port,
                  self.delay_ms)
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        loop, ev = self._loop, self._stop_event
        if loop is not None and ev is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # loop already closed
                pass
        self._thread.join(timeout=10)
        self._thread = None
        if self._lsock is not None:
            self._lsock.close()

    def __enter__(self) -> "LatencyProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def statistics(self) -> dict[str, int]:
        out = dict(self._stats)
        out["active"] = len(self._conns)
        return out

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - hand start-up failures to start()
            self._start_error = e
            log.exception("proxy event loop failed")
        finally:
            self._started.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        accept = asyncio.create_task(self._accept_loop())
        self._started.set()
        try:
            await self._stop_event.wait()
        finally:
            accept.cancel()
            for conn, task in list(self._conns.items()):
                conn.close()
                task.cancel()
            await asyncio.gather(accept, *self._conns.values(), return_exceptions=True)
            if self._splicer is not None:
                self._splicer.stop()  # after the closes above: it handles its messages in order

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                client, _ = await loop.sock_accept(self._lsock)
            except OSError as e:  # e.g. EMFILE: keep serving the connections we have
                log.warning("proxy accept failed: %s", e)
                await asyncio.sleep(0.05)
                continue
            _tune(client)
            conn = Connection(next(self._ids), client)
            self._stats["connections"] += 1
            task = asyncio.create_task(self._run_connection(conn))
            self._conns[conn] = task

    async def _run_connection(self, conn: Connection) -> None:
        try:
            await self.handle_connection(conn)
        except asyncio.CancelledError:
            raise
        except ConnectionAbort:
            conn.reset()
        except OSError as e:
            log.debug("proxy connection %d ended: %s", conn.id, e)
        except Exception:  # noqa: BLE001 - one broken connection must not end the proxy
            log.exception("proxy connection %d failed", conn.id)
        finally:
            if not conn.closed:
                conn.close()
            self._stats["bytes_up"] += conn.bytes_up
            self._stats["bytes_down"] += conn.bytes_down
            self._conns.pop(conn, None)

    # -- hooks (override in subclasses) ---------------------------------------------------------
    async def handle_connection(self, conn: Connection) -> None:
        """Serve one client connection: open the upstream connection, then relay both ways."""
        try:
            conn.server = await self.open_upstream(conn)
        except OSError as e:
            # The client already has a connection (to us); a reset is the closest thing to the
            # "connection refused" it would have seen talking to the server directly.
            self._stats["upstream_failures"] += 1
            log.debug("proxy connection %d: upstream %s:%d unreachable: %s", conn.id, self.target_host,
                      self.target_port, e)
            conn.reset()
            return
        await self.connection_opened(conn)
        await self.relay(conn)

    async def open_upstream(self, conn: Connection) -> socket.socket:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.target_host, self.target_port, type=socket.SOCK_STREAM)
        err: OSError | None = None
        for family, type_, proto, _, addr in infos:
            s = socket.socket(family, type_, proto)
            try:
                s.setblocking(False)
                await loop.sock_connect(s, addr)
            except OSError as e:
                s.close()
                err = e
                continue
            _tune(s)
            return s
        raise err or OSError(f"cannot resolve {self.target_host}")

    async def connection_opened(self, conn: Connection) -> None:
        """Called once per connection after the upstream connection is open."""

    async def on_request_data(self, conn: Connection, data: bytes | memoryview) -> bytes | memoryview:
        """A chunk on its way to the server (after its delay). Return what to forward; a memoryview
        is only valid until the next chunk is read."""
        return data

    async def on_response_data(self, conn: Connection, data: memoryview) -> bytes | memoryview:
        """A chunk on its way to the client. `data` is only valid until the next chunk is read."""
        return data

    # -- relaying -------------------------------------------------------------------------------
    async def relay(self, conn: Connection) -> None:
        """Copy both directions until both have ended; a reset on either side resets the other."""
        if _SPLICE and _inherited(self, "on_request_data") and _inherited(self, "on_response_data"):
            await self._relay_spliced(conn)
            return
        try:
            await _run_both(self._pump_up(conn), self._pump_down(conn))
        except (ConnectionAbort, ConnectionResetError, BrokenPipeError, ConnectionAbortedError):
            # Pass a broken connection on as one: the other peer must not see a clean end.
            conn.reset()
        except _Ended:
            conn.close()

    async def _relay_spliced(self, conn: Connection) -> None:
        """Both directions through the proxy's splicer thread (see `_Splicer`)."""
        loop = asyncio.get_running_loop()
        ended = loop.create_future()

        def on_end() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the proxy is stopping
                loop.call_soon_threadsafe(lambda: ended.done() or ended.set_result(None))

        if self._splicer is None:
            self._splicer = _Splicer(self.delay_ms / 1000.0)
        conn.relay = self._splicer
        self._splicer.add(conn, on_end)
        await ended

    async def _pump_down(self, conn: Connection) -> None:
        """Server -> client, at once (hooked data only: see `relay`)."""
        loop = asyncio.get_running_loop()
        # One reusable buffer: a chunk is sent before the next one is read.
        buf = memoryview(bytearray(CHUNK_BYTES))
        while True:
            n = await loop.sock_recv_into(conn.server, buf)
            if n == 0:
                _shutdown_write(conn.client)
                return
            data = await self.on_response_data(conn, buf[:n])
            if len(data):
                await loop.sock_sendall(conn.client, data)
                conn.bytes_down += len(data)
            _end_if_asked(conn)

    async def _pump_up(self, conn: Connection) -> None:
        """Client -> server through the delay line, or straight through when there is no delay
        (hooked data only: see `relay`)."""
        loop = asyncio.get_running_loop()
        delay_s = self.delay_ms / 1000.0
        if delay_s <= 0:
            buf = memoryview(bytearray(CHUNK_BYTES))
            while True:
                n = await loop.sock_recv_into(conn.client, buf)
                if n == 0:
                    _shutdown_write(conn.server)
                    return
                await self._send_up(conn, buf[:n])
        # Delay line: the reader stamps chunks with their due time, the writer sends each when due.
        # The reader never waits for the writer (up to DELAY_LINE_CHUNKS), so chunks are shifted in
        # time, not spaced out: throughput is the same as without delay. An empty chunk is the end.
        line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(DELAY_LINE_CHUNKS)

        async def reader() -> None:
            while True:
                data = await loop.sock_recv(conn.client, CHUNK_BYTES)
                await line.put((loop.time() + delay_s, data))
                if not data:
                    return

        async def writer() -> None:
            while True:
                due, data = await line.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    _shutdown_write(conn.server)
                    return
                await self._send_up(conn, data)

        await _run_both(reader(), writer())

    async def _send_up(self, conn: Connection, data: bytes | memoryview) -> None:
        data = await self.on_request_data(conn, data)
        if len(data):
            await asyncio.get_running_loop().sock_sendall(conn.server, data)
            conn.bytes_up += len(data)
        _end_if_asked(conn)


async def _run_both(*coros) -> None:
    """Run coroutines until all end; the first error cancels the rest and is raised."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                raise t.exception()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _end_if_asked(conn: Connection) -> None:
    if conn.end_after_chunk == "reset":
        raise ConnectionAbort()
    if conn.end_after_chunk == "close":
        # FIN to both peers; ending the relay with an error stops the other direction too.
        _shutdown_write(conn.client)
        _shutdown_write(conn.server)
        raise _Ended()


class _Ended(Exception):
    """A hook ended the connection cleanly (see `Connection.end_after_chunk`)."""


def _inherited(proxy: LatencyProxy, hook: str) -> bool:
    """True when a subclass leaves `hook` alone, so data need not pass through Python at all."""
    return getattr(type(proxy), hook) is getattr(LatencyProxy, hook)


# splice(2) moves data socket -> pipe -> socket inside the kernel, with no copy into Python and back.
_SPLICE = hasattr(os, "splice") and sys.platform.startswith("linux")
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
# The splicer's pipes ask for this much room. The kernel counts every pipe's room, used or not,
# against a per-user limit (/proc/sys/fs/pipe-user-pages-soft, 64 MiB), past which each new pipe
# gets two pages. With 1 MiB pipes kept open per connection, a few dozen pooled connections would
# reach that, and every later transfer would crawl through 8 KiB pipes. 256 KiB still moves a
# 150 KiB response in one splice.
_PIPE_BYTES = 256 << 10
# Pipes a delay line may fill before it stops reading from the client: up to 16 MiB in flight per
# connection (1.6 GB/s through a 10 ms delay), yet memory stays bounded when the server reads
# slowly. Pipes beyond the first are closed again as soon as the line has emptied them.
_LINE_PIPES = 64
_FIONREAD = getattr(termios, "FIONREAD", 0x541B)


@dataclass(eq=False)
class _LinePipe:
    r: int
    w: int
    pending: int = 0  # chunks recorded in the delay line and not yet sent on


@dataclass(eq=False)
class _Relayed:
    """One connection in the splicer: its pipes, its delay line and what it waits for."""

    conn: Connection
    on_end: object
    cfd: int
    sfd: int
    down_r: int
    down_w: int
    down_left: int = 0  # bytes in the down pipe not yet sent to the client
    down_ended: bool = False
    line: collections.deque = field(default_factory=collections.deque)  # [due, pipe, bytes left]
    pipes: list = field(default_factory=list)
    cur: _LinePipe | None = None
    up_eof: bool = False  # the client ended its side (recorded in the line)
    up_paused: bool = False  # every line pipe is full: leave the rest in the client's socket
    up_ended: bool = False  # ... and the end was passed on to the server
    up_blocked: bool = False  # the server's socket is full
    masks: dict = field(default_factory=dict)  # fd -> registered epoll mask (absent: unregistered)


class _Splicer:
    """Both directions of every relayed connection, moved by one thread with epoll and splice(2).

    The bytes never enter Python, and an event costs a few system calls and a few lines of Python.
    That matters on a small host, where the proxy shares the CPU with what it measures: with an
    asyncio loop (a task per direction, a future per wait) the proxy spent ~450 us of CPU per
    proxied GET, and with a thread per direction as much again, in handing the GIL around.

    Server -> client: data is spliced into a pipe and on to the client as it arrives. Client ->
    server is the delay line: each chunk is spliced into a pipe and recorded with the time it is
    due at the server; a timer sends it on then. A pipe holds at most 1 MiB (less when TCP fills it
    with partial pages), so the line is a set of pipes used in turn, opened as needed.

    Other threads talk to it only through `add`, `close` and `stop`; it owns the sockets of the
    connections it relays and closes them.
    """

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self._ep = select.epoll()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._ep.register(self._wake_r, select.EPOLLIN)
        self._inbox: collections.deque = collections.deque()
        self._by_fd: dict[int, _Relayed] = {}
        self._by_conn: dict[Connection, _Relayed] = {}
        self._timers: list[tuple[float, int, _Relayed]] = []
        self._seq = itertools.count()
        self._thread = threading.Thread(target=self._run, name="proxy-splicer", daemon=True)
        self._thread.start()

    # -- from other threads -------------------------------------------------------------------------
    def add(self, conn: Connection, on_end) -> None:
        """Relay `conn` (both sockets open and non-blocking); `on_end()` is called, from this
        thread, once both are closed."""
        self._post(("add", conn, on_end))

    def close(self, conn: Connection, reset: bool = False) -> None:
        self._post(("close", conn, reset))

    def stop(self) -> None:
        self._post(("stop", None, None))
        self._thread.join(timeout=10)

    def _post(self, msg) -> None:
        self._inbox.append(msg)
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    # -- the loop -----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._turn():
                pass
        except Exception:  # noqa: BLE001
            log.exception("proxy splicer failed")
        finally:
            for rel in list(self._by_conn.values()):
                self._end(rel, reset=False)
            self._ep.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _turn(self) -> bool:
        timeout = -1.0
        if self._timers:
            timeout = max(0.0, self._timers[0][0] - time.monotonic())
        events = self._ep.poll(timeout)
        for fd, ev in events:
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
                continue
            rel = self._by_fd.get(fd)
            if rel is None:
                continue
            try:
                if fd == rel.cfd:
                    if ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) and not rel.up_eof:
                        self._read_up(rel)
                    if ev & (select.EPOLLOUT | select.EPOLLHUP | select.EPOLLERR) and rel.down_left:
                        self._write_down(rel)
                else:
                    if ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) and not rel.down_ended \
                            and not rel.down_left:
                        self._read_down(rel)
                    if ev & (select.EPOLLOUT | select.EPOLLHUP | select.EPOLLERR) and rel.up_blocked:
                        rel.up_blocked = False
                        self._write_up(rel)
            except OSError as e:
                self._broken(rel, e)
                continue
            self._settle(rel)
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            rel = heapq.heappop(self._timers)[2]
            if rel.conn in self._by_conn and not rel.up_blocked:
                try:
                    self._write_up(rel)
                except OSError as e:
                    self._broken(rel, e)
                    continue
                self._settle(rel)
        while self._inbox:
            op, conn, arg = self._inbox.popleft()
            if op == "stop":
                return False
            if op == "add":
                self._start(conn, arg)
            elif conn in self._by_conn:
                self._end(self._by_conn[conn], reset=arg)
        return True

    # -- one connection ---------------------------------------------------------------------------
    def _start(self, conn: Connection, on_end) -> None:
        r, w = _new_pipe()
        rel = _Relayed(conn, on_end, conn.client.fileno(), conn.server.fileno(), r, w)
        self._by_conn[conn] = rel
        self._by_fd[rel.cfd] = self._by_fd[rel.sfd] = rel
        self._settle(rel)

    def _read_down(self, rel: _Relayed) -> None:
        """Server -> pipe -> client, as it arrives."""
        try:
            n = os.splice(rel.sfd, rel.down_w, CHUNK_BYTES, flags=_SPLICE_FLAGS)
        except BlockingIOError:
            return
        if n == 0:
            rel.down_ended = True
            _shutdown_write(rel.conn.client)
            return
        rel.down_left = n
        self._write_down(rel)

    def _write_down(self, rel: _Relayed) -> None:
        while rel.down_left:
            try:
                n = os.splice(rel.down_r, rel.cfd, rel.down_left, flags=_SPLICE_FLAGS)
            except BlockingIOError:
                return  # the client's socket is full: _settle asks for EPOLLOUT
            rel.down_left -= n
            rel.conn.bytes_down += n

    def _read_up(self, rel: _Relayed) -> None:
        """Client -> the delay line: a chunk into a pipe, recorded with the time it is due."""
        if rel.cur is None and not self._next_pipe(rel):
            return
        try:
            n = os.splice(rel.cfd, rel.cur.w, CHUNK_BYTES, flags=_SPLICE_FLAGS)
        except BlockingIOError:
            if _pending_bytes(rel.cfd) == 0:
                return  # nothing to read after all
            # The client has data, so this pipe is full: go on in another one (or pause).
            rel.cur = None
            return
        if n == 0:
            rel.up_eof = True
            rel.line.append([time.monotonic() + self.delay_s, None, 0])
        else:
            rel.line.append([time.monotonic() + self.delay_s, rel.cur, n])
            rel.cur.pending += 1
        if len(rel.line) == 1:
            heapq.heappush(self._timers, (rel.line[0][0], next(self._seq), rel))

    def _next_pipe(self, rel: _Relayed) -> bool:
        for p in rel.pipes:
            if p.pending == 0:
                rel.cur = p
                return True
        if len(rel.pipes) < _LINE_PIPES:
            rel.cur = _LinePipe(*_new_pipe())
            rel.pipes.append(rel.cur)
            return True
        rel.up_paused = True  # resumed when the writer empties a pipe
        return False

    def _write_up(self, rel: _Relayed) -> None:
        """The delay line -> server: every chunk that is due."""
        now = time.monotonic()
        while rel.line:
            item = rel.line[0]
            due, pipe, left = item
            if due > now:
                heapq.heappush(self._timers, (due, next(self._seq), rel))
                return
            if pipe is None:
                rel.line.popleft()
                rel.up_ended = True
                _shutdown_write(rel.conn.server)
                return
            while left:
                try:
                    n = os.splice(pipe.r, rel.sfd, left, flags=_SPLICE_FLAGS)
                except BlockingIOError:
                    item[2] = left
                    rel.up_blocked = True  # resumed on EPOLLOUT
                    return
                left -= n
                rel.conn.bytes_up += n
            rel.line.popleft()
            pipe.pending -= 1
            if pipe.pending == 0:
                if rel.up_paused:
                    rel.up_paused = False
                    rel.cur = pipe
                elif pipe is not rel.cur and len(rel.pipes) > 1:
                    rel.pipes.remove(pipe)  # give its room back (see _PIPE_BYTES)
                    os.close(pipe.r)
                    os.close(pipe.w)

    def _settle(self, rel: _Relayed) -> None:
        """End the connection when both directions have ended, else register what it waits for."""
        if rel.conn not in self._by_conn:
            return
        if rel.up_ended and rel.down_ended and not rel.down_left:
            self._end(rel, reset=False)
            return
        want_c = (select.EPOLLIN if not rel.up_eof and not rel.up_paused else 0) | \
                 (select.EPOLLOUT if rel.down_left else 0)
        want_s = (select.EPOLLIN if not rel.down_ended and not rel.down_left else 0) | \
                 (select.EPOLLOUT if rel.up_blocked else 0)
        for fd, want in ((rel.cfd, want_c), (rel.sfd, want_s)):
            have = rel.masks.get(fd)
            if want == have or (not want and have is None):
                continue
            if not want:
                # Unregistered rather than kept with an empty mask: epoll would still report a
                # hang-up on it again and again while the other direction finishes.
                self._ep.unregister(fd)
                del rel.masks[fd]
            elif have is None:
                self._ep.register(fd, want)
                rel.masks[fd] = want
            else:
                self._ep.modify(fd, want)
                rel.masks[fd] = want

    def _broken(self, rel: _Relayed, e: OSError) -> None:
        """Pass a broken connection on as one: both peers see a reset, not a clean end."""
        log.debug("proxy connection %d ended: %s", rel.conn.id, e)
        self._end(rel, reset=True)

    def _end(self, rel: _Relayed, *, reset: bool) -> None:
        conn = rel.conn
        if self._by_conn.pop(conn, None) is None:
            return
        for fd in list(rel.masks):
            with contextlib.suppress(OSError):
                self._ep.unregister(fd)
        self._by_fd.pop(rel.cfd, None)
        self._by_fd.pop(rel.sfd, None)
        for fd in [rel.down_r, rel.down_w] + [f for p in rel.pipes for f in (p.r, p.w)]:
            with contextlib.suppress(OSError):
                os.close(fd)
        conn.relay = None
        if reset:
            conn.reset()
        else:
            conn.close()
        try:
            rel.on_end()
        except Exception:  # noqa: BLE001
            log.exception("proxy connection %d: end callback failed", conn.id)


_SPLICE_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK if _SPLICE else 0


def _new_pipe() -> tuple[int, int]:
    """A pipe (read end, write end) of _PIPE_BYTES. One holds 64 KiB by default: 4 rounds through
    Python for a 256 KiB chunk. A refusal to grow it (per-user pipe limits) only costs speed."""
    r, w = os.pipe2(os.O_CLOEXEC)
    with contextlib.suppress(OSError):
        fcntl.fcntl(w, _F_SETPIPE_SZ, _PIPE_BYTES)
    return r, w


def _pending_bytes(fd: int) -> int:
    try:
        return struct.unpack("i", fcntl.ioctl(fd, _FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 1  # unknown: let the caller assume there is data


def _shutdown_write(sock: socket.socket | None) -> None:
    """Pass on an end of stream (FIN) while the other direction may still carry data."""
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ucfs.testing.proxy",
                                description="Loopback TCP proxy adding a fixed delay per round trip.")
    p.add_argument("target", help="HOST:PORT to forward to")
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--listen-host", default="127.0.0.1")
    p.add_argument("--listen-port", type=int, default=0)
    args = p.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    if not host or not port.isdigit():
        p.error("target must be HOST:PORT")
    proxy = LatencyProxy(host.strip("[]"), int(port), delay_ms=args.delay_ms, listen_host=args.listen_host,
                         listen_port=args.listen_port).start()
    print(proxy.port, flush=True)
    try:
        # Serve until whoever started us closes our stdin (or exits): no orphaned proxies.
        while sys.stdin.buffer.read(4096):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
