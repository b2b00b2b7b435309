"""LatencyProxy: every round trip costs at least `delay_ms` more, bulk transfers are shifted, not throttled.

A tiny threaded TCP server stands in for the S3 endpoint; nothing here needs FUSE or a store.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import socketserver
import struct
import sys
import threading
import time

import pytest

from ucfs.testing.proxy import LatencyProxy

MiB = 1 << 20


class _Handler(socketserver.BaseRequestHandler):
    """Line protocol: 'ping\\n' -> 'pong\\n'; 'sink N\\n' then N bytes -> 'got N\\n'; 'echo N\\n'
    then N bytes -> the same bytes; 'rst N\\n' -> N bytes, then a reset. 'greet' servers say hello
    before the client says anything."""

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.server.greet:
            sock.sendall(b"hello\n")
        f = sock.makefile("rb")
        while True:
            line = f.readline()
            if not line:
                return
            if line == b"ping\n":
                sock.sendall(b"pong\n")
            elif line.startswith(b"sink "):
                n = int(line.split()[1])
                left = n
                while left:
                    chunk = f.read(min(left, MiB))
                    if not chunk:
                        return
                    left -= len(chunk)
                sock.sendall(f"got {n}\n".encode())
            elif line.startswith(b"echo "):
                n = int(line.split()[1])
                sock.sendall(f.read(n))
            elif line.startswith(b"rst "):  # N bytes, then a reset instead of a clean end
                sock.sendall(b"r" * int(line.split()[1]))
                time.sleep(0.1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
                return


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default backlog is 5: 24 connections at once, on a busy machine, overflowed it
    # and one came back reset.
    request_queue_size = 64
    greet = False

    def handle_error(self, request, client_address) -> None:
        # Tests reset connections on purpose (through the proxy): for a handler that is an end, not
        # an error. Its traceback would otherwise be printed, and one that arrives after its test
        # has ended lands in the output of whichever test runs then. Other errors still print.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


@pytest.fixture
def server():
    srv = _Server(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _readline(s: socket.socket) -> bytes:
    out = b""
    while not out.endswith(b"\n"):
        b = s.recv(1)
        if not b:
            break
        out += b
    return out


def test_each_round_trip_costs_the_delay(server):
    delay_ms = 20
    with LatencyProxy(*server.server_address, delay_ms=delay_ms) as proxy:
        with _connect(proxy.port) as s:
            times = []
            for _ in range(5):  # on one connection, like a pooled HTTP client
                t0 = time.monotonic()
                s.sendall(b"ping\n")
                assert _readline(s) == b"pong\n"
                times.append(time.monotonic() - t0)
        assert min(times) >= delay_ms / 1000
        # Once per round trip, not per chunk or per direction (loose bound: CI machines are busy).
        assert sorted(times)[len(times) // 2] < 10 * delay_ms / 1000
        assert proxy.statistics()["connections"] == 1


def test_zero_delay_passes_through(server):
    with LatencyProxy(*server.server_address, delay_ms=0) as proxy, _connect(proxy.port) as s:
        s.sendall(b"ping\n")
        assert _readline(s) == b"pong\n"


def test_server_to_client_is_not_delayed(server):
    server.greet = True
    delay_ms = 1000
    with LatencyProxy(*server.server_address, delay_ms=delay_ms) as proxy:
        t0 = time.monotonic()
        with _connect(proxy.port) as s:
            assert _readline(s) == b"hello\n"
            assert time.monotonic() - t0 < delay_ms / 1000 / 2


def test_bulk_upload_is_shifted_not_throttled(server):
    delay_ms = 50
    size = 64 * MiB
    payload = os.urandom(MiB)
    with LatencyProxy(*server.server_address, delay_ms=delay_ms) as proxy, _connect(proxy.port) as s:
        t0 = time.monotonic()
        s.sendall(f"sink {size}\n".encode())
        for _ in range(size // MiB):
            s.sendall(payload)
        assert _readline(s) == f"got {size}\n".encode()
        elapsed = time.monotonic() - t0
    assert elapsed >= delay_ms / 1000
    # A proxy that waited `delay` per chunk would need at least 64 x delay (3.2 s) for 1 MiB chunks.
    assert elapsed < 64 * delay_ms / 1000 / 2, f"{size / MiB:.0f} MiB took {elapsed:.2f} s"


def test_bytes_arrive_in_order(server):
    data = os.urandom(3 * MiB + 12345)
    with LatencyProxy(*server.server_address, delay_ms=5) as proxy, _connect(proxy.port) as s:
        s.sendall(f"echo {len(data)}\n".encode())
        # Many small writes: the delay line must keep their order.
        for i in range(0, len(data), 7919):
            s.sendall(data[i:i + 7919])
        got = bytearray()
        while len(got) < len(data):
            chunk = s.recv(MiB)
            assert chunk
            got += chunk
    assert bytes(got) == data


def _recv_exactly(s: socket.socket, n: int, pause_s: float = 0.0) -> bytes:
    got = bytearray()
    while len(got) < n:
        chunk = s.recv(min(MiB, n - len(got)))
        assert chunk, f"the stream ended after {len(got)} of {n} bytes"
        got += chunk
        time.sleep(pause_s)
    return bytes(got)


@pytest.mark.parametrize("delay_ms", [0, 5])
def test_slow_reader_loses_nothing(server, delay_ms):
    # The client reads slowly: the proxy must stop reading the server's replies (and so, once the
    # server's buffers fill, the client's upload) without dropping or reordering a byte.
    data = os.urandom(24 * MiB + 777)
    with LatencyProxy(*server.server_address, delay_ms=delay_ms) as proxy, _connect(proxy.port) as s:
        sender = threading.Thread(target=lambda: s.sendall(f"echo {len(data)}\n".encode() + data))
        sender.start()
        time.sleep(0.5)  # let every buffer on the way fill up
        got = _recv_exactly(s, len(data), pause_s=0.002)
        sender.join()
    assert got == data


def test_many_connections_at_once(server):
    blobs = [os.urandom(MiB + i) for i in range(24)]

    def one(blob: bytes) -> bytes:
        with _connect(proxy.port) as s:
            s.sendall(f"echo {len(blob)}\n".encode() + blob)
            return _recv_exactly(s, len(blob))

    with LatencyProxy(*server.server_address, delay_ms=5) as proxy:
        with concurrent.futures.ThreadPoolExecutor(len(blobs)) as pool:
            assert list(pool.map(one, blobs)) == blobs
        assert proxy.statistics()["connections"] == len(blobs)


@pytest.mark.parametrize("delay_ms", [0, 5])
def test_server_reset_reaches_the_client_as_a_reset(server, delay_ms):
    with LatencyProxy(*server.server_address, delay_ms=delay_ms) as proxy, _connect(proxy.port) as s:
        s.sendall(b"rst 1000\n")
        assert _recv_exactly(s, 1000) == b"r" * 1000
        with pytest.raises(ConnectionResetError):
            while s.recv(MiB):
                pass


def test_unreachable_upstream_resets_client():
    # A port nothing listens on: bind one, note it, close it.
    with socket.socket() as tmp:
        tmp.bind(("127.0.0.1", 0))
        dead_port = tmp.getsockname()[1]
    with LatencyProxy("127.0.0.1", dead_port, delay_ms=0) as proxy:
        try:
            # The reset may come before the request is even sent, or before connect() has looked at
            # its own result (a busy host): the proxy learns at once that nothing listens upstream.
            with _connect(proxy.port) as s:
                s.sendall(b"ping\n")
                assert s.recv(10) == b""
        except ConnectionResetError:
            pass
        # Let the proxy's loop finish its bookkeeping of the failed connection.
        deadline = time.monotonic() + 5
        while proxy.statistics()["upstream_failures"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.statistics()["upstream_failures"] == 1


def test_stop_closes_open_connections(server):
    proxy = LatencyProxy(*server.server_address, delay_ms=0).start()
    s = _connect(proxy.port)
    s.sendall(b"ping\n")
    assert _readline(s) == b"pong\n"
    proxy.stop()
    s.settimeout(5)
    try:
        assert s.recv(10) == b""
    except ConnectionResetError:
        pass
    s.close()


class _RecordingProxy(LatencyProxy):
    """Overrides the data hooks (as a fault-injecting subclass would), which takes the copying path."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.up = bytearray()
        self.down = bytearray()
        self.opened = 0

    async def connection_opened(self, conn):
        self.opened += 1

    async def on_request_data(self, conn, data):
        self.up += data
        return data

    async def on_response_data(self, conn, data):
        self.down += data
        return data


@pytest.mark.parametrize("delay_ms", [0, 5])
def test_hooks_see_every_byte(server, delay_ms):
    data = os.urandom(2 * MiB + 1)
    with _RecordingProxy(*server.server_address, delay_ms=delay_ms) as proxy, _connect(proxy.port) as s:
        s.sendall(f"echo {len(data)}\n".encode() + data)
        got = bytearray()
        while len(got) < len(data):
            chunk = s.recv(MiB)
            assert chunk
            got += chunk
    assert bytes(got) == data
    assert proxy.opened == 1
    assert bytes(proxy.up) == f"echo {len(data)}\n".encode() + data
    assert bytes(proxy.down) == data


class _TruncatingProxy(LatencyProxy):
    """What a fault-injecting subclass does: pass the first `keep` response bytes, then end."""

    def __init__(self, *a, keep: int, how: str, **kw):
        super().__init__(*a, **kw)
        self.keep, self.how = keep, how

    async def on_response_data(self, conn, data):
        sent = conn.bytes_down
        if sent + len(data) >= self.keep:
            conn.end_after_chunk = self.how
            return data[:self.keep - sent]
        return data


@pytest.mark.parametrize("how", ["reset", "close"])
def test_hooks_can_truncate_a_response(server, how):
    data = os.urandom(MiB)
    with _TruncatingProxy(*server.server_address, delay_ms=0, keep=1000, how=how) as proxy, \
            _connect(proxy.port) as s:
        s.sendall(f"echo {len(data)}\n".encode() + data)
        got = bytearray()
        ended = "close"
        try:
            while chunk := s.recv(MiB):
                got += chunk
        except ConnectionResetError:
            ended = "reset"
    assert bytes(got) == data[:1000]
    assert ended == how
