"""glibc's allocator, tuned for a daemon whose memory must stay within one budget.

Every ranged GET, FUSE write and upload part is a buffer of a MiB or more, allocated in one thread
and often freed in another. glibc's defaults let that grow well past the budget: each thread that
allocates gets an arena of its own (up to 8 per core), each keeps what is freed in it, and the
dynamic mmap threshold soon sends multi-MiB buffers into those arenas where they fragment. Measured
with 32 readers and 8 writers under a 128 MiB budget: ~520 MiB resident with the defaults, ~380 MiB
with two arenas and a 4 MiB threshold, ~150 MiB with what `Allocator` sets:

- one arena, so memory freed by any thread is reused by all;
- freed memory at the top of the heap is returned beyond 16 MiB;
- buffers of 1 MiB and more mapped on their own (*mapped* mode), so they go back to the kernel when
  freed and resident memory follows what is live. The BufferPool keeps part buffers (GETs, upload
  parts) for reuse within the budget, which saves the page faults a fresh mapping costs.

That last rule has a price when files are written. The data of every FUSE write request (1 MiB and
a header, allocated by pyfuse3, freed when the request is answered) is then a fresh mapping: 256
page faults and an munmap per request, ~0.8 s of the daemon's CPU per GiB written and a quarter of
all it spent. So while no file is being read from the store, the threshold sits just above that size
(*heap* mode) and those buffers reuse the same heap memory. Writes alone leave nothing long-lived
there. Mixed with reads, whose blocks stay in memory as read-ahead, the freed write buffers became
holes the heap could not give back: the resource test's daemon then peaked at 250 MiB against a
bound of 185. So the first reader switches back to mapped mode at once, and what the heap holds
free is released (malloc_trim), then once more a moment later. Heap mode returns only after a
while without readers (`HEAP_AFTER_IDLE_S`), so a stream of small reads does not flip the mode for
each file.

Best effort: without glibc (or without mallopt) nothing is tuned and the modes do nothing.
"""

from __future__ import annotations

import ctypes
import logging
import time

from .config import KiB, MiB

log = logging.getLogger(__name__)

# mallopt parameters, from malloc.h.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8

# Buffers from this size up are mapped on their own while files are read.
MAPPED_THRESHOLD_BYTES = 1 * MiB
# ... and from this size up while none is: a FUSE write request's data (1 MiB + a header) is below.
HEAP_THRESHOLD_BYTES = MiB + 64 * KiB
# Free memory at the top of the heap beyond this goes back to the kernel.
TRIM_THRESHOLD_BYTES = 16 * MiB
# Heap mode comes back after this long with no file open for reading from the store.
HEAP_AFTER_IDLE_S = 1.0


class Allocator:
    """The process's allocator settings and the mode they are in ("mapped" or "heap")."""

    def __init__(self, libc=None):
        self.libc = libc
        self._mallinfo2 = getattr(libc, "mallinfo2", None)  # glibc 2.33 and later
        if self._mallinfo2 is not None:
            self._mallinfo2.restype = _MallInfo2
        self.mode = "untuned"
        self.switches = 0
        self._idle_since: float | None = None
        self._trim_again = False

    @classmethod
    def tune(cls) -> "Allocator":
        """Tune this process's glibc (one arena, trim threshold, mapped mode)."""
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            return cls(None)
        libc.mallopt(_M_ARENA_MAX, 1)
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
        self = cls(libc)
        self._set("mapped", MAPPED_THRESHOLD_BYTES)
        return self

    def reading(self) -> None:
        """A file is being read from the store: mapped mode, now."""
        self._idle_since = None
        if self.mode == "heap":
            self._set("mapped", MAPPED_THRESHOLD_BYTES)
            # What the heap keeps for reuse goes back, now and once more at the next `idle` call:
            # write requests in flight at the switch free their buffers into the heap after it.
            self.libc.malloc_trim(0)
            self._trim_again = True

    def idle(self, readers: int, now: float | None = None) -> None:
        """Called now and then with the number of files being read: heap mode once none has been
        for HEAP_AFTER_IDLE_S."""
        now = time.monotonic() if now is None else now
        if self._trim_again:
            self._trim_again = False
            self.libc.malloc_trim(0)
        if readers:
            self._idle_since = None
            return
        if self._idle_since is None:
            self._idle_since = now
        elif self.mode == "mapped" and now - self._idle_since >= HEAP_AFTER_IDLE_S:
            self._set("heap", HEAP_THRESHOLD_BYTES)

    def _set(self, mode: str, threshold: int) -> None:
        if self.libc is None:
            return
        self.libc.mallopt(_M_MMAP_THRESHOLD, threshold)
        if self.mode != "untuned":
            self.switches += 1
            log.debug("allocator: %s mode (buffers of %d bytes and more mapped on their own)", mode,
                      threshold)
        self.mode = mode

    def statistics(self) -> dict:
        out = {"allocator_mode": self.mode, "allocator_switches": self.switches}
        if self._mallinfo2 is not None:
            m = self._mallinfo2()
            out.update(heap_bytes=m.arena, heap_in_use_bytes=m.uordblks, malloc_mapped_bytes=m.hblkhd)
        return out


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]
