"""ucfs.fusewait: a worker task takes a queued FUSE request without waiting, and never returns to a
read with nothing queued. A socket pair stands in for /dev/fuse; `slow` for pyfuse3's own wait."""

from __future__ import annotations

import collections
import socket

import trio

from ucfs.fusewait import ready_first


class Slow:
    """pyfuse3's wait: each call runs the next step (which may queue a request) and answers."""

    def __init__(self, *steps):
        self.steps = list(steps)
        self.calls = 0

    async def __call__(self) -> bool:
        self.calls += 1
        step = self.steps.pop(0)
        await trio.lowlevel.checkpoint()
        return step()


def test_a_request_already_queued_is_taken_without_waiting():
    a, b = socket.socketpair()
    with a, b:
        stats: collections.Counter[str] = collections.Counter()
        slow = Slow()
        b.send(b"request")
        assert trio.run(ready_first(slow, a.fileno(), stats)) is True
        assert slow.calls == 0
        assert stats == {"fuse_requests_ready": 1}


def test_a_task_woken_for_a_request_another_took_waits_again():
    """The first wait says readable, but the request is gone (another task's check took it): the
    task must not return to a read that would block the loop. It waits again, for the next one."""
    a, b = socket.socketpair()
    with a, b:
        stats: collections.Counter[str] = collections.Counter()
        slow = Slow(lambda: True, lambda: b.send(b"next") > 0)
        assert trio.run(ready_first(slow, a.fileno(), stats)) is True
        assert slow.calls == 2
        assert a.recv(16) == b"next"
        assert stats == {"fuse_request_waits": 2, "fuse_requests_ready": 1}


def test_the_end_of_the_session_is_passed_on():
    a, b = socket.socketpair()
    with a, b:
        stats: collections.Counter[str] = collections.Counter()
        assert trio.run(ready_first(Slow(lambda: False), a.fileno(), stats)) is False


def test_taking_a_queued_request_is_still_a_checkpoint():
    """A stream of queued requests must not starve the loop's other tasks (a GET's completion, a
    timer): every call yields to the scheduler, which a cancelled scope shows deterministically."""
    a, b = socket.socketpair()
    with a, b:
        async def main():
            wait = ready_first(Slow(), a.fileno(), collections.Counter())
            b.send(b"request")
            with trio.CancelScope() as scope:
                scope.cancel()
                await wait()
            return scope.cancelled_caught

        assert trio.run(main) is True
