"""What the daemon reports about itself: throughput, event-loop health, and a Prometheus endpoint.

- `LoopWatchdog` wakes every 10 ms and records how late it woke. A late wake-up means something
  blocked the event loop (which must never happen: every FUSE request waits behind it), so the
  largest stall is reported and long ones are logged.
- `RateSampler` turns the byte counters of the stores into recent throughput (a 10 s window).
- `serve_metrics` answers `GET /metrics` on a loopback port in Prometheus's text format, built from the
  same figures `ucfs status` prints.
"""

from __future__ import annotations

import collections
import gc
import logging
import time
from typing import Callable

import trio

log = logging.getLogger(__name__)

# How often the watchdog looks; stalls much shorter than this are invisible, which is fine: the
# budget we care about is 100 ms. (Each trio sleep costs a deadline expiry on the event loop;
# waking 100 times a second cost ~5% of a busy loop.)
WATCHDOG_PERIOD_S = 0.05
# Stalls longer than this are logged as they happen.
STALL_LOG_S = 0.1


class LoopWatchdog:
    def __init__(self) -> None:
        self.max_stall_s = 0.0
        self.stalls_over_100ms = 0
        self.started = time.monotonic()
        # Garbage collection pauses every thread; time them so a stall can be told apart from one.
        self.max_gc_pause_s = 0.0
        self._gc_started = 0.0
        gc.callbacks.append(self._gc_callback)

    def _gc_callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started:
            self.max_gc_pause_s = max(self.max_gc_pause_s, time.perf_counter() - self._gc_started)

    async def run(self) -> None:
        while True:
            t0 = time.monotonic()
            await trio.sleep(WATCHDOG_PERIOD_S)
            stall = time.monotonic() - t0 - WATCHDOG_PERIOD_S
            if stall > self.max_stall_s:
                self.max_stall_s = stall
            if stall > STALL_LOG_S:
                self.stalls_over_100ms += 1
                log.warning("event loop stalled for %.0f ms", stall * 1000)

    def statistics(self) -> dict:
        return {"loop_max_stall_ms": round(self.max_stall_s * 1000, 1),
                "loop_stalls_over_100ms": self.stalls_over_100ms,
                "gc_max_pause_ms": round(self.max_gc_pause_s * 1000, 1)}


class RateSampler:
    """Recent bytes per second of named counters, from a function returning their totals."""

    def __init__(self, totals: Callable[[], dict[str, int]], window_s: float = 10.0):
        self.totals = totals
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, dict[str, int]]] = collections.deque()

    async def run(self) -> None:
        while True:
            self.sample()
            await trio.sleep(1.0)

    def sample(self) -> None:
        now = time.monotonic()
        self._samples.append((now, self.totals()))
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()

    def rates(self) -> dict[str, float]:
        if len(self._samples) < 2:
            return {}
        (t0, a), (t1, b) = self._samples[0], self._samples[-1]
        dt = max(t1 - t0, 1e-9)
        return {k: round((b.get(k, 0) - a.get(k, 0)) / dt, 1) for k in b}


def prometheus_text(status: dict) -> str:
    """Flatten the status document into Prometheus metrics (numbers only; names prefixed ucfs_)."""
    lines: list[str] = []

    def emit(name: str, value, labels: dict[str, str] | None = None) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        lab = ""
        if labels:
            lab = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
        lines.append(f"ucfs_{name}{lab} {value}")

    for key, value in status.items():
        if key == "stores" and isinstance(value, dict):
            for store, counters in value.items():
                for k, v in counters.items():
                    emit(f"store_{k}_total", v, {"store": store})
        elif isinstance(value, dict):
            for k, v in value.items():
                emit(f"{key}_{k}", v)
        else:
            emit(key, value)
    return "\n".join(lines) + "\n"


async def serve_metrics(port: int, status: Callable[[], dict], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A minimal HTTP server on 127.0.0.1:port answering GET /metrics (loopback only, on purpose)."""

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            request = b""
            with trio.move_on_after(5):
                while b"\r\n\r\n" not in request and len(request) < 8192:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        break
                    request += chunk
            line = request.split(b"\r\n", 1)[0].decode(errors="replace").split()
            if len(line) >= 2 and line[0] == "GET" and line[1].split("?")[0] == "/metrics":
                body = prometheus_text(status()).encode()
                head = (f"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
            else:
                body = b"not found\n"
                head = (f"HTTP/1.1 404 Not Found\r\nContent-Length: {len(body)}\r\n"
                        f"Connection: close\r\n\r\n").encode()
            try:
                await stream.send_all(head + body)
            except trio.BrokenResourceError:
                pass

    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)
