"""FUSE passthrough for files being written: the kernel writes them straight to their staging files.

Without it every `write()` into the mount is a round trip through this daemon: the kernel copies
the data into a request, we copy it into a `bytes`, write it to the staging file and answer, and the
writer waits for each answer in turn. A 1 GiB `dd` took 3.1-3.5 s that way, against 0.5-1.0 s to
the same local disk. With passthrough (Linux 6.9+, CAP_SYS_ADMIN) an open file is bound to a
"backing" file and the kernel serves its reads, writes and mmaps from it: a staged file is written at
the local disk's speed, and this daemon sees only open, flush, fsync, setattr and release.

What that changes, and how the rest of ucfs copes (see `commit.Committer`):
  - we no longer see the writes. A staged file with a passthrough writer is watched instead: its size
    is read from the staging file (`Committer.observe`), often enough to start and feed a streaming
    upload while it grows; every close and fsync by such a writer counts as a change.
  - a stream cannot tell appends from rewrites any more, so each part it uploaded is checked against
    the staging file before the upload is completed, and sent again if it differs.
  - the kernel refuses to mix passthrough and page-cache opens of one inode (the open fails with EIO).
    So a file is opened in passthrough mode only while every open handle of it is a passthrough one,
    and then must be (`Core._may_passthrough`).
  - the kernel opens its own backing file with the flags of the open, and fcntl(F_SETFL) on the
    FUSE file does not reach it: an O_DIRECT open is not given passthrough while it has a choice.
    (An O_APPEND handle whose flag is cleared that way goes on appending; README, "Writes".)

libfuse 3.14 (Debian 12) and pyfuse3 cannot ask for passthrough; `ucfs._fusewire` adds the two
fields on the wire. Where the kernel does not offer it, or the staging directory cannot back a
passthrough file (an overlay file system, no CAP_SYS_ADMIN), files are written the old way.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct

log = logging.getLogger(__name__)

try:
    from . import _fusewire
except ImportError as e:  # built by `pip install`; a source tree without the build still mounts
    _fusewire = None
    _IMPORT_ERROR = str(e)
else:
    _IMPORT_ERROR = ""

# ioctls on /dev/fuse (include/uapi/linux/fuse.h): _IOW(229, 1, struct fuse_backing_map) and
# _IOW(229, 2, uint32_t).
FUSE_DEV_IOC_BACKING_OPEN = 0x4010E501
FUSE_DEV_IOC_BACKING_CLOSE = 0x4004E502
PAGE_BYTES = 4096  # the unit of FUSE's max_pages
NO_BACKING = -1  # a grant of FOPEN_NOFLUSH alone (ucfs._fusewire)


def fuse_device_fd() -> int | None:
    """The descriptor of /dev/fuse this process holds (pyfuse3 does not expose it)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                return int(name)
        except OSError:
            continue
    return None


class Passthrough:
    """Whether passthrough is on for this mount, and the kernel objects it needs."""

    def __init__(self, wanted: bool):
        self.wanted = wanted and _fusewire is not None
        self.fd: int | None = None
        self.broken = ""  # why passthrough was given up after the mount started
        self.backing_opened = 0
        self.hooked = False  # ucfs._fusewire watches libfuse's traffic (install)
        if wanted and _fusewire is None:
            log.info("FUSE passthrough unavailable: ucfs._fusewire is not built (%s)", _IMPORT_ERROR)

    def install(self, max_read_bytes: int = 0) -> None:
        """Call after pyfuse3.init() and before pyfuse3.main(): the kernel's INIT is answered there.

        The same hooks ask the kernel for read requests of up to `max_read_bytes` (0: libfuse's
        1 MiB) and let reads be answered in pieces (`vector_reply`); `hooked` says they are in place."""
        if _fusewire is None:
            return
        fd = fuse_device_fd()
        if fd is None:
            self.wanted = False
            log.info("FUSE passthrough off: no /dev/fuse descriptor found")
            return
        try:
            _fusewire.install(fd, self.wanted, max_read_bytes // PAGE_BYTES)
        except (OSError, RuntimeError) as e:
            self.wanted = False
            log.info("FUSE passthrough off: %s", e)
            return
        self.fd = fd
        self.hooked = True

    @property
    def can_hook(self) -> bool:
        """Whether `install` can hook libfuse's traffic at all (ucfs._fusewire is built)."""
        return _fusewire is not None

    @property
    def active(self) -> bool:
        return self.wanted and not self.broken and self.fd is not None and _fusewire.negotiated()

    def open_backing(self, fd: int) -> int | None:
        """Register fd's file as a backing file; its id, or None (and passthrough is given up for
        good when the reason is not this one file)."""
        arg = bytearray(struct.pack("iIQ", fd, 0, 0))
        try:
            backing_id = fcntl.ioctl(self.fd, FUSE_DEV_IOC_BACKING_OPEN, arg, True)
        except OSError as e:
            why = {errno.EPERM: "needs CAP_SYS_ADMIN",
                   errno.ELOOP: "the staging directory is on a stacked file system (overlayfs?)"}.get(e.errno, "")
            self.broken = f"{os.strerror(e.errno)}{': ' + why if why else ''}"
            log.warning("FUSE passthrough given up, files are written through the daemon: %s", self.broken)
            return None
        self.backing_opened += 1
        return backing_id

    def close_backing(self, backing_id: int) -> None:
        try:
            fcntl.ioctl(self.fd, FUSE_DEV_IOC_BACKING_CLOSE, struct.pack("I", backing_id))
        except OSError as e:  # the connection is gone (unmounted): the kernel freed it with it
            log.debug("closing backing file %d: %s", backing_id, e)

    @staticmethod
    def grant(fh: int, backing_id: int) -> bool:
        """The reply to the open that returns fh opens it in passthrough mode."""
        return _fusewire.grant(fh, backing_id)

    def skip_flush(self, fh: int) -> None:
        """The reply to the open that returns fh asks the kernel to send no FLUSH when the handle
        is closed (FOPEN_NOFLUSH): for handles whose close has nothing to do. Only once `hooked`."""
        if self.hooked:
            _fusewire.grant(fh, NO_BACKING)

    @staticmethod
    def vector_reply(pieces: tuple) -> memoryview:
        """What to answer a read with so that its data goes out as `pieces` (buffers, in order),
        without joining them. Only once `hooked`, from the FUSE loop's thread, for its next reply."""
        return _fusewire.vector(pieces)

    @staticmethod
    def revoke(fh: int) -> None:
        if _fusewire is not None:
            _fusewire.revoke(fh)

    def statistics(self) -> dict:
        out = {"wanted": self.wanted, "active": self.active, "backing_files": self.backing_opened}
        if _fusewire is not None:
            out.update(_fusewire.statistics())
        if self.broken:
            out["broken"] = self.broken
        return out
