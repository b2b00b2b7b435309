"""ucfs.threads.ThreadPool: the thread hop under every store request and disk call."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import trio

from ucfs.threads import ThreadPool


def test_results_errors_and_the_bound_on_concurrency():
    pool = ThreadPool("t", 3)
    lock = threading.Lock()
    now = {"running": 0, "max": 0}

    def work(i: int) -> int:
        with lock:
            now["running"] += 1
            now["max"] = max(now["max"], now["running"])
        time.sleep(0.01)
        with lock:
            now["running"] -= 1
        if i == 7:
            raise KeyError(i)
        return i * i

    results: dict[int, object] = {}

    async def one(i: int) -> None:
        try:
            results[i] = await pool.run(work, i)
        except KeyError as e:
            results[i] = e

    async def main():
        async with trio.open_nursery() as n:
            for i in range(20):
                n.start_soon(one, i)

    trio.run(main)
    assert {i: v for i, v in results.items() if i != 7} == {i: i * i for i in range(20) if i != 7}
    assert isinstance(results[7], KeyError)
    assert now["max"] == 3
    assert pool.statistics()["threads"] == 3


def test_idle_threads_end_and_new_calls_start_them_again():
    pool = ThreadPool("t", 4, idle_timeout_s=0.05)

    async def burst():
        async with trio.open_nursery() as n:
            for _ in range(8):
                n.start_soon(pool.run, time.sleep, 0.01)

    trio.run(burst)
    assert pool.statistics()["threads"] == 4
    deadline = time.monotonic() + 5
    while pool.statistics()["threads"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.statistics()["threads"] == 0
    assert trio.run(pool.run, sum, [1, 2, 3]) == 6  # works again after every thread ended


def test_a_cancelled_caller_starts_nothing_and_a_running_call_finishes():
    pool = ThreadPool("t", 1)
    started, finished = [], []

    def slow():
        started.append(1)
        time.sleep(0.2)
        finished.append(1)
        return "done"

    async def main():
        with trio.CancelScope() as scope:
            scope.cancel()
            await pool.run(slow)  # cancelled before it starts
        assert started == []
        with trio.move_on_after(0.05):
            got = await pool.run(slow)  # cannot be abandoned: waits for the thread
        assert got == "done" and finished == [1]

    trio.run(main)


def test_needs_a_thread():
    with pytest.raises(ValueError):
        ThreadPool("t", 0)


def test_a_forked_child_starts_with_an_empty_pool():
    pool = ThreadPool("t", 2)
    assert trio.run(pool.run, sum, [1, 2]) == 3  # the parent now has a thread
    pid = os.fork()
    if pid == 0:  # the child: the parent's thread does not exist here; a call must still run
        signal.alarm(5)  # without a fresh pool the call would wait forever: end the child then
        ok = False
        try:
            ok = trio.run(pool.run, sum, [3, 4]) == 7 and pool.statistics()["threads"] == 1
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_pool_threads_carry_their_pool_s_name():
    """`top -H`, `ps -L` and the bench tell the pools' threads apart by the name the kernel holds."""
    pool = ThreadPool("store", 2)

    def comm() -> str:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            return f.read().strip()

    async def main():
        return await pool.run(comm)

    assert trio.run(main) == "ucfs-store"


def test_threads_that_log_leave_no_thread_records_behind(tmp_path, monkeypatch):
    """Pool threads start with _thread (no wait on the event loop); the daemon's logging set-up
    must not make each of them a threading._DummyThread that outlives it."""
    import logging

    from ucfs.cli import _setup_logging

    root = logging.getLogger()
    # All restored afterwards: the set-up changes the process's logging.
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)
    monkeypatch.setattr(logging, "logThreads", logging.logThreads)
    _setup_logging("info", tmp_path / "ucfs.log")
    before = len(threading._active)
    pool = ThreadPool("t", 16, idle_timeout_s=0.05)

    async def main():
        for _ in range(5):  # threads come and go between bursts
            async with trio.open_nursery() as nursery:
                for i in range(32):
                    nursery.start_soon(pool.run, logging.getLogger("ucfs.test").info, "job %d", i)
            await trio.sleep(0.2)

    trio.run(main)
    for handler in root.handlers:
        handler.close()
    assert "job 31" in (tmp_path / "ucfs.log").read_text()
    assert len(threading._active) <= before  # (threads of earlier tests may have ended meanwhile)


def test_submitted_work_runs_in_a_pool_thread_and_the_caller_waits_for_none_of_it():
    """submit() is for code that cannot await (the read path unmapping a buffer it let go of): it
    returns at once, the call runs in a named pool thread, and a failing call harms nothing after."""
    pool = ThreadPool("sub", 2)
    gate, ran = threading.Event(), []

    def job(n):
        gate.wait(5)
        ran.append((n, threading.current_thread() is not threading.main_thread()))

    def boom():
        raise OSError("lost, as documented")

    pool.submit(boom)
    for n in range(3):
        pool.submit(job, n)
    assert ran == []  # nothing waited for the jobs, which are still held at the gate
    gate.set()
    deadline = time.monotonic() + 5
    while len(ran) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(ran) == [(0, True), (1, True), (2, True)]

    async def after():  # the pool still serves awaited calls
        return await pool.run(lambda: 42)

    assert trio.run(after) == 42
