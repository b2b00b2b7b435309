"""A lean pool of worker threads for the blocking calls of trio tasks (store requests, disk I/O).

Why not `trio.to_thread.run_sync`: it is general (cancellable threads, contextvars, a thread cache
shared by every limiter) and names the worker's OS thread after the calling task twice per call.
On the 2-core virtual machines we measure on, one hop cost ~150-230 µs of CPU that way against
~100 µs here, and writing a small file takes about ten hops (staging file, writes, fdatasync,
upload, clean-up). What a hop must cost - waking a thread, the GIL, waking the event loop - stays.

Semantics are those of `to_thread.run_sync` without `abandon_on_cancel`: a call checks for
cancellation before it starts and then cannot be cancelled; its result or exception comes back to
the calling task. At most `max_threads` calls run at once (later ones queue, oldest first); threads
start when calls need them and end after `idle_timeout_s` without work. A child process made by
fork() starts with empty pools: its parent's threads do not exist there.
"""

from __future__ import annotations

import _thread
import os
import queue
import threading
import weakref
from typing import Any, Callable, TypeVar

import outcome
import trio

T = TypeVar("T")

IDLE_TIMEOUT_S = 10.0


_POOLS: "weakref.WeakSet[ThreadPool]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for pool in list(_POOLS):
        pool._reset()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _name_os_thread(name: str) -> None:
    """Give the calling thread the name `top -H`, `ps -L` and /proc/<pid>/task/<tid>/comm show
    (the kernel keeps 15 bytes): which pool a busy thread belongs to, and the bench's CPU split."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass  # not Linux, or no /proc: the name is only for people looking


def _cannot_abort(_raise_cancel) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED  # the call is running in its thread: wait for it


class ThreadPool:
    def __init__(self, name: str, max_threads: int, *, idle_timeout_s: float = IDLE_TIMEOUT_S):
        if max_threads < 1:
            raise ValueError("a thread pool needs at least one thread")
        self.name = name
        self.max_threads = max_threads
        self.idle_timeout_s = idle_timeout_s
        self._reset()
        _POOLS.add(self)

    def _reset(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # Jobs are queued under the lock, so a thread that finds the queue empty under it may end:
        # whoever queues next sees one idle thread fewer and starts another if needed.
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._queued = 0
        self.running = 0  # calls being run now, for statistics

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._queue((fn, args, trio.lowlevel.current_trio_token(), trio.lowlevel.current_task()))
        return await trio.lowlevel.wait_task_rescheduled(_cannot_abort)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) in a pool thread and wait for nothing: for work whose result nobody needs
        (unmapping a buffer let go), from code that cannot await. An exception it raises is lost."""
        self._queue((fn, args, None, None))

    def _queue(self, job: tuple) -> None:
        with self._lock:
            self._jobs.put(job)
            self._queued += 1
            start = self._queued > self._idle and self._threads < self.max_threads
            if start:
                self._threads += 1
        if start:
            # Not threading.Thread.start(): it waits until the new thread has run, which needs a CPU
            # and the GIL, both scarce exactly when the pool grows. The event loop stalled 120-140 ms
            # there in the bench's 1 GiB write, and every FUSE request with it.
            _thread.start_new_thread(self._work, ())

    def _work(self) -> None:
        _name_os_thread(f"ucfs-{self.name}")
        while True:
            with self._lock:
                self._idle += 1
            try:
                fn, args, token, task = self._jobs.get(timeout=self.idle_timeout_s)
            except queue.Empty:
                with self._lock:
                    self._idle -= 1
                    if self._jobs.empty():
                        self._threads -= 1
                        return
                continue
            with self._lock:
                self._idle -= 1
                self._queued -= 1
                self.running += 1
            result = outcome.capture(fn, *args)
            del fn, args
            with self._lock:
                self.running -= 1
            if token is None:  # submitted: nobody waits for the result
                del result
                continue
            try:
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)
            except trio.RunFinishedError:
                pass  # the caller's run ended meanwhile; nobody is waiting for this any more
            del task, result

    def statistics(self) -> dict[str, int]:
        with self._lock:
            return {"threads": self._threads, "running": self.running, "queued": self._queued}
