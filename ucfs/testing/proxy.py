"""A loopback TCP proxy that puts a fixed latency between a client and an S3 endpoint.

`ucfs bench --latency-ms N` runs every measurement through it to see how the mount behaves when each
request/response round trip costs N ms more (a store across a network instead of on loopback), and
fault-injection tests subclass it to break connections on purpose.

How the delay is added: the client->server direction is a *delay line*. Each chunk read from the
client is stamped with its arrival time and written to the server `delay_ms` later, in order; the line
keeps reading meanwhile. A long upload is therefore shifted by `delay_ms`, not throttled, while every
request (and so every round trip) starts `delay_ms` later. The server->client direction is forwarded
as soon as it arrives. Bandwidth is limited only by the proxy's own CPU: large buffers keep the number
of Python-level iterations per byte low (see `CHUNK_BYTES`), and a direction that needs neither a delay
nor a data hook is moved by splice(2) without entering Python at all. Measured on a 2-core VM: about
0.45 CPU-seconds per GB relayed through splice, about 1 CPU-second per GB through the delay line.

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
import fcntl
import itertools
import logging
import os
import socket
import struct
import sys
import threading
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
        self._stats = {"connections": 0, "upstream_failures": 0, "bytes_up": 0, "bytes_down": 0}

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._lsock is None:
            raise RuntimeError("proxy not started")
        return self._lsock.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.listen_host}:{self.port}"

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
        try:
            await _run_both(self._pump_up(conn), self._pump_down(conn))
        except (ConnectionAbort, ConnectionResetError, BrokenPipeError, ConnectionAbortedError):
            # Pass a broken connection on as one: the other peer must not see a clean end.
            conn.reset()
        except _Ended:
            conn.close()

    async def _pump_down(self, conn: Connection) -> None:
        """Server -> client, at once."""
        loop = asyncio.get_running_loop()
        if _SPLICE and _inherited(self, "on_response_data"):
            await _splice_stream(conn.server, conn.client, lambda n: _add_down(conn, n))
            return
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
        """Client -> server through the delay line (or straight through when there is no delay)."""
        loop = asyncio.get_running_loop()
        delay_s = self.delay_ms / 1000.0
        if delay_s <= 0 and _SPLICE and _inherited(self, "on_request_data"):
            await _splice_stream(conn.client, conn.server, lambda n: _add_up(conn, n))
            return
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


def _add_up(conn: Connection, n: int) -> None:
    conn.bytes_up += n


def _add_down(conn: Connection, n: int) -> None:
    conn.bytes_down += n


# splice(2) moves data socket -> pipe -> socket inside the kernel: no copy into Python and back,
# which halves the proxy's CPU per byte (measured: ~0.75 -> ~0.4 CPU-seconds per GB on loopback).
_SPLICE = hasattr(os, "splice") and sys.platform.startswith("linux")
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


async def _wait_fd(fd: int, *, write: bool) -> None:
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    if write:
        loop.add_writer(fd, ready)
    else:
        loop.add_reader(fd, ready)
    try:
        await fut
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


async def _splice_stream(src: socket.socket, dst: socket.socket, counted) -> None:
    """Copy src to dst until src ends (then pass the end on), through a pipe with splice(2)."""
    r, w = os.pipe()
    try:
        # A pipe holds 64 KiB by default: 16 round trips through Python per MiB. Ask for CHUNK_BYTES;
        # a refusal (per-user pipe limits) only costs speed.
        for size in (CHUNK_BYTES, 256 << 10):
            try:
                fcntl.fcntl(w, _F_SETPIPE_SZ, size)
                break
            except OSError:
                continue
        flags = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
        sfd, dfd = src.fileno(), dst.fileno()
        while True:
            try:
                n = os.splice(sfd, w, CHUNK_BYTES, flags=flags)
            except BlockingIOError:
                await _wait_fd(sfd, write=False)
                continue
            if n == 0:
                _shutdown_write(dst)
                return
            left = n
            while left:
                try:
                    left -= os.splice(r, dfd, left, flags=flags)
                except BlockingIOError:
                    await _wait_fd(dfd, write=True)
            counted(n)
    finally:
        os.close(r)
        os.close(w)


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
