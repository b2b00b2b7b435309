"""What the daemon reports about itself: throughput, event-loop health, and a Prometheus endpoint.

- `LoopWatchdog` wakes every 50 ms and records how late it woke. A late wake-up means something
  blocked the event loop (which must never happen: every FUSE request waits behind it), so the
  largest stall is reported and long ones are logged. Each long stall is explained: a helper thread
  samples the loop thread's stack (and which of the daemon's threads were running, or in a blocking
  call) while the stall is going on, and the kernel's scheduler counters say how much of it the
  loop thread spent running, waiting for a CPU (a busy machine), or neither.
  Of the rest, what the hypervisor took from the machine's CPUs meanwhile (steal, in /proc/stat)
  is told apart: a virtual CPU stopped by its host stops whichever of our threads it was running,
  the loop or the one holding the GIL. So is the time the loop thread was blocked while some other
  thread on the machine waited for a CPU (the kernel's CPU pressure, /proc/pressure/cpu): the
  thread holding the GIL the loop waits for may have been that one. What is left is blocked: the
  GIL held by a thread that was running, or a blocking call.
- `RateSampler` turns the byte counters of the stores into recent throughput (a 10 s window).
- `serve_metrics` answers `GET /metrics` on a loopback port in Prometheus's text format, built from the
  same figures `ucfs status` prints.
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import sys
import threading
import time
import traceback
from typing import Awaitable, Callable

import trio

from .errors import UcfsError

log = logging.getLogger(__name__)

# How often the watchdog looks; stalls much shorter than this are invisible, which is fine: the
# budget we care about is 100 ms. (Each trio sleep costs a deadline expiry on the event loop;
# waking 100 times a second cost ~5% of a busy loop.)
WATCHDOG_PERIOD_S = 0.05
# Stalls longer than this are logged as they happen.
STALL_LOG_S = 0.1
# The stall sampler thread looks whether the loop is overdue at most this often. It sleeps until
# the loop's latest beat would be overdue, so a healthy loop wakes it ~8 times a second, not 50:
# every wake-up takes the GIL from the loop.
SAMPLER_PERIOD_S = 0.02
# Frames of the loop thread's stack kept per sample (innermost last), enough to see what blocked.
SAMPLE_FRAMES = 10
# /proc/stat counts CPU time in these.
try:
    _CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
except (ValueError, OSError, AttributeError):
    _CLOCK_TICKS = 100


def _open_counters(path: str) -> int | None:
    """A descriptor of kernel counters (a thread's schedstat, /proc/stat), kept open and read with
    pread: the watchdog reads them 20 times a second on the event loop, and a path lookup and a file
    object each time cost more than the read (and allocate, which under memory pressure can wait
    for reclaim)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _proc_stat(fd: int | None) -> bytes:
    """/proc/stat as it is now, unparsed: read at every beat (12 us on a 2-CPU VM; the kernel writes
    every CPU's line and interrupt counts, so more on a big host), parsed only for a stall."""
    if fd is None:
        return b""
    try:
        return os.pread(fd, 1 << 16, 0)
    except OSError:
        return b""


def _cpu_pressure_us(fd: int | None) -> int | None:
    """The kernel's running total of microseconds in which some runnable thread on this machine
    waited for a CPU ("some ... total=" of /proc/pressure/cpu), or None where there is no such file
    (a kernel without PSI)."""
    if fd is None:
        return None
    try:
        some = os.pread(fd, 256, 0).split(b"\n", 1)[0]
        return int(some.rpartition(b"total=")[2])
    except (OSError, ValueError):
        return None


def _stolen_ms(before: bytes, after: bytes) -> float:
    """The most time the hypervisor took from any one CPU between two readings of /proc/stat (its
    "steal" column, in clock ticks). Counted in whole ticks (10 ms), so it says little below that."""
    def steal(raw: bytes) -> dict[bytes, int]:
        out = {}
        for line in raw.split(b"\n"):
            if line.startswith(b"cpu") and not line.startswith(b"cpu "):
                fields = line.split()
                if len(fields) > 8:
                    out[fields[0]] = int(fields[8])
        return out

    try:
        b, a = steal(before), steal(after)
    except ValueError:
        return 0.0
    ticks = max((a[cpu] - b[cpu] for cpu in a.keys() & b.keys()), default=0)
    return max(0, ticks) * 1000 / _CLOCK_TICKS


def _schedstat(fd: int | None) -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for a CPU) of the thread `fd` describes, from the kernel."""
    if fd is None:
        return 0, 0
    try:
        on_cpu, waiting, _ = os.pread(fd, 128, 0).split()
        return int(on_cpu), int(waiting)
    except (OSError, ValueError):
        return 0, 0


def _thread_states(loop_tid: int | None) -> dict:
    """The loop thread's scheduler state at this moment ("R" running or waiting for a CPU, "S"
    asleep, "D" in uninterruptible I/O), the names of the daemon's other threads that were not
    asleep, by state, and how many were. Taken once per long stall, by the sampler thread (which
    holds the GIL then, so threads waiting for it show as asleep): a loop thread in "D" was in a
    blocking call; threads in "R" were running without the GIL (receiving, copying) or waiting for a
    CPU."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict = {"loop": "?", "asleep": 0}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                head, _, tail = f.read().rpartition(b")")
            state = tail.split()[0].decode()
            comm = head.partition(b"(")[2].decode(errors="replace")
        except (OSError, IndexError, UnicodeDecodeError):
            continue
        if int(tid) == loop_tid:
            out["loop"] = state
        elif state == "S":
            out["asleep"] += 1
        else:
            # Pool threads name their OS thread (comm); others are known by their Python name.
            out.setdefault(state, []).append(names.get(int(tid), comm))
    return out


class LoopWatchdog:
    def __init__(self) -> None:
        self.max_stall_s = 0.0
        self.stalls_over_100ms = 0
        self.started = time.monotonic()
        # Garbage collection pauses every thread; time them so a stall can be told apart from one.
        self.max_gc_pause_s = 0.0
        self._gc_started = 0.0
        gc.callbacks.append(self._gc_callback)
        # The latest long stalls, explained (see the module doc).
        self.stall_samples: collections.deque[dict] = collections.deque(maxlen=32)
        self._beat = time.monotonic()  # when the loop last went to sleep in `run`
        self._loop_ident: int | None = None
        self._loop_tid: int | None = None
        # (beat, stack, the threads' states) taken during a stall
        self._sample: tuple[float, list[str], dict] | None = None
        self._running = False

    def _gc_callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started:
            self.max_gc_pause_s = max(self.max_gc_pause_s, time.perf_counter() - self._gc_started)

    async def run(self) -> None:
        self._loop_ident = threading.get_ident()
        self._loop_tid = threading.get_native_id()
        stat_fd = _open_counters(f"/proc/self/task/{self._loop_tid}/schedstat")
        cpus_fd = _open_counters("/proc/stat")
        pressure_fd = _open_counters("/proc/pressure/cpu")
        self._running = True
        threading.Thread(target=self._sample_stalls, name="ucfs-stall-sampler", daemon=True).start()
        try:
            while True:
                t0 = time.monotonic()
                self._beat = t0
                cpu0, wait0 = _schedstat(stat_fd)
                cpus0 = _proc_stat(cpus_fd)
                pressure0 = _cpu_pressure_us(pressure_fd)
                await trio.sleep(WATCHDOG_PERIOD_S)
                stall = time.monotonic() - t0 - WATCHDOG_PERIOD_S
                if stall > self.max_stall_s:
                    self.max_stall_s = stall
                if stall > STALL_LOG_S:
                    self.stalls_over_100ms += 1
                    cpu1, wait1 = _schedstat(stat_fd)
                    pressure1 = _cpu_pressure_us(pressure_fd)
                    pressure_ms = (pressure1 - pressure0) / 1e3 if None not in (pressure0, pressure1) else 0.0
                    self._explain(t0, stall, (cpu1 - cpu0) / 1e6, (wait1 - wait0) / 1e6,
                                  _stolen_ms(cpus0, _proc_stat(cpus_fd)), pressure_ms)
        finally:
            self._running = False
            for fd in (stat_fd, cpus_fd, pressure_fd):
                if fd is not None:
                    os.close(fd)

    def _explain(self, beat: float, stall_s: float, on_cpu_ms: float, cpu_wait_ms: float,
                 stolen_ms: float, pressure_ms: float = 0.0) -> None:
        """Log a long stall with what the loop thread was doing meanwhile. `pressure_ms`: how long,
        in the same window, some thread on the machine waited for a CPU."""
        window_ms = (stall_s + WATCHDOG_PERIOD_S) * 1000
        rest = max(0.0, window_ms - on_cpu_ms - cpu_wait_ms)
        # An estimate: the steal of the CPU that lost most, up to what the window leaves. The loop
        # thread (or the thread holding the GIL it waited for) ran on one CPU at a time, and which
        # one is not known.
        stolen_ms = min(rest, stolen_ms)
        # Blocked while another thread waited for a CPU. The loop's own waits count in the
        # pressure too, and never overlap its blocked time, so they are taken off first. This is
        # the most the GIL holder's waits can have cost the loop, not a measure of them: which thread
        # held the GIL is not known. A blocking call made while the machine's CPUs were full lands
        # here too, so a stall under that load says less about the daemon than one without it.
        others_ms = min(rest - stolen_ms, max(0.0, pressure_ms - cpu_wait_ms))
        ours = self._sample is not None and self._sample[0] == beat
        stack = self._sample[1] if ours else []
        threads = self._sample[2] if ours else {}
        sample = {"stall_ms": round(stall_s * 1000, 1), "on_cpu_ms": round(on_cpu_ms, 1),
                  "waiting_for_cpu_ms": round(cpu_wait_ms, 1), "cpu_stolen_by_host_ms": round(stolen_ms, 1),
                  "blocked_while_others_waited_for_cpu_ms": round(others_ms, 1),
                  "blocked_ms": round(rest - stolen_ms - others_ms, 1), "stack": stack, "threads": threads,
                  "at": time.time()}
        self.stall_samples.append(sample)
        log.warning("event loop stalled for %.0f ms (loop thread on a CPU %.0f ms, waiting for a CPU "
                    "%.0f ms, CPU taken by the host %.0f ms, blocked while other threads waited for a "
                    "CPU %.0f ms, blocked %.0f ms)%s", sample["stall_ms"], on_cpu_ms,
                    cpu_wait_ms, stolen_ms, others_ms, sample["blocked_ms"],
                    "; it was at:\n  " + "\n  ".join(stack) if stack else "")

    def _sample_stalls(self) -> None:
        """Helper thread: while the loop is overdue, take one sample of its stack per stall."""
        overdue_after = WATCHDOG_PERIOD_S + STALL_LOG_S * 0.8
        while self._running:
            beat = self._beat
            time.sleep(max(SAMPLER_PERIOD_S, beat + overdue_after - time.monotonic()))
            beat = self._beat
            if time.monotonic() - beat < overdue_after:
                continue
            if self._sample is not None and self._sample[0] == beat:
                continue  # this stall has its sample
            frame = sys._current_frames().get(self._loop_ident)
            if frame is None:
                continue
            stack = [f"{_short(fs.filename)}:{fs.lineno} {fs.name}"
                     for fs in traceback.extract_stack(frame)[-SAMPLE_FRAMES:]]
            self._sample = (beat, stack, _thread_states(self._loop_tid))

    def statistics(self) -> dict:
        return {"loop_max_stall_ms": round(self.max_stall_s * 1000, 1),
                "loop_stalls_over_100ms": self.stalls_over_100ms,
                "gc_max_pause_ms": round(self.max_gc_pause_s * 1000, 1),
                "loop_stall_samples": list(self.stall_samples)}


def _short(filename: str) -> str:
    """'/.../site-packages/trio/_core/_run.py' -> 'trio/_core/_run.py': enough to know the code."""
    for marker in ("/site-packages/", "/lib/python3"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    parts = filename.rsplit("/", 2)
    return "/".join(parts[-2:])


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
            # Just started: no rate yet, but say so with zeros rather than leave the figures out.
            return {k: 0.0 for k in (self._samples[-1][1] if self._samples else self.totals())}
        (t0, a), (t1, b) = self._samples[0], self._samples[-1]
        dt = max(t1 - t0, 1e-9)
        return {k: round((b.get(k, 0) - a.get(k, 0)) / dt, 1) for k in b}


def _label_value(value) -> str:
    """A label value as the text exposition format writes it: backslash, double quote and newline
    escaped. Store names come from the catalog and may hold any of them; unescaped, one such name
    makes the page unparseable, and Prometheus rejects the whole scrape."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(status: dict) -> str:
    """Flatten the status document into Prometheus metrics (numbers only; names prefixed ucfs_)."""
    lines: list[str] = []

    def emit(name: str, value, labels: dict[str, str] | None = None) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        lab = ""
        if labels:
            lab = "{" + ",".join(f'{k}="{_label_value(v)}"' for k, v in labels.items()) + "}"
        lines.append(f"ucfs_{name}{lab} {value}")

    for key, value in status.items():
        if key == "stores" and isinstance(value, dict):
            for store, counters in value.items():
                for k, v in counters.items():
                    emit(f"store_{k}_total", v, {"store": store})
        elif key == "unreachable" and isinstance(value, dict):
            # Only stores in an outage are listed: absent means reachable (or not yet asked).
            for store, outage in value.items():
                emit("store_unreachable_seconds", outage.get("for_s"), {"store": store})
        elif isinstance(value, dict):
            for k, v in value.items():
                emit(f"{key}_{k}", v)
        else:
            emit(key, value)
    return "\n".join(lines) + "\n"


async def serve_metrics(port: int, status: Callable[[], Awaitable[dict]], *,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A minimal HTTP server on 127.0.0.1:port answering GET /metrics (loopback only, on purpose).
    `status` is the daemon's status, awaited: it reads the staging disk in a disk thread."""

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
                body = prometheus_text(await status()).encode()
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

    try:
        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    except OSError as e:
        raise UcfsError(f"metrics port 127.0.0.1:{port}: {e.strerror or e}") from None
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)
