"""The allocator's two modes: heap while nothing is read (FUSE write buffers reuse memory), mapped
as soon as a file is read (read-ahead must not fragment the heap)."""

from __future__ import annotations

import ctypes

from ucfs import allocator
from ucfs.allocator import HEAP_AFTER_IDLE_S, HEAP_THRESHOLD_BYTES, MAPPED_THRESHOLD_BYTES, Allocator


# What pyfuse3 allocates for a 1 MiB write request: a bytes object (1 MiB and its header).
FUSE_WRITE_ALLOCATION = (1 << 20) + 33


class FakeLibc:
    def __init__(self):
        self.calls: list[tuple] = []

    def mallopt(self, param, value):
        self.calls.append(("mallopt", param, value))
        return 1

    def malloc_trim(self, pad):
        self.calls.append(("trim", pad))
        return 1

    def thresholds(self) -> list[int]:
        return [c[2] for c in self.calls if c[0] == "mallopt" and c[1] == allocator._M_MMAP_THRESHOLD]

    def trims(self) -> int:
        return sum(1 for c in self.calls if c[0] == "trim")


def make() -> tuple[Allocator, FakeLibc]:
    libc = FakeLibc()
    a = Allocator(libc)
    a._set("mapped", MAPPED_THRESHOLD_BYTES)
    return a, libc


def test_heap_mode_only_after_a_while_without_readers():
    a, libc = make()
    a.idle(readers=0, now=100.0)
    a.idle(readers=0, now=100.0 + HEAP_AFTER_IDLE_S / 2)
    assert a.mode == "mapped"
    a.idle(readers=1, now=100.0 + HEAP_AFTER_IDLE_S)  # a reader resets the clock
    a.idle(readers=0, now=100.0 + HEAP_AFTER_IDLE_S * 1.5)
    assert a.mode == "mapped"
    a.idle(readers=0, now=100.0 + HEAP_AFTER_IDLE_S * 2.5)
    assert a.mode == "heap" and libc.thresholds()[-1] == HEAP_THRESHOLD_BYTES


def test_a_fuse_write_buffer_is_mapped_in_one_mode_and_from_the_heap_in_the_other():
    assert MAPPED_THRESHOLD_BYTES <= FUSE_WRITE_ALLOCATION < HEAP_THRESHOLD_BYTES


def test_a_reader_switches_back_at_once_and_the_heap_is_trimmed_twice():
    a, libc = make()
    a.idle(readers=0, now=0.0)
    a.idle(readers=0, now=HEAP_AFTER_IDLE_S)
    assert a.mode == "heap"
    a.reading()
    assert a.mode == "mapped" and libc.thresholds()[-1] == MAPPED_THRESHOLD_BYTES and libc.trims() == 1
    a.reading()  # already mapped: nothing more
    assert libc.trims() == 1
    a.idle(readers=1, now=HEAP_AFTER_IDLE_S + 0.25)  # the second trim, for buffers freed since
    assert libc.trims() == 2 and a.mode == "mapped"
    assert a.switches == 2


def test_without_glibc_nothing_happens(monkeypatch):
    def no_libc(name):
        raise OSError("no such library")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    a = Allocator.tune()
    a.reading()
    a.idle(readers=0, now=0.0)
    a.idle(readers=0, now=10.0)
    assert a.mode == "untuned" and a.statistics()["allocator_mode"] == "untuned"
