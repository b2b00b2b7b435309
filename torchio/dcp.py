"""`torch.distributed.checkpoint` storage for checkpoint directories on the mount.

    import torch.distributed.checkpoint as dcp
    from torchio import UCVolumeWriter, UCVolumeReader

    dcp.save(state_dict, storage_writer=UCVolumeWriter("/Volumes/main/ml/ckpt/step-1000"))
    dcp.load(state_dict, storage_reader=UCVolumeReader("/Volumes/main/ml/ckpt/step-1000"))

Both are torch's `FileSystemWriter` / `FileSystemReader` with only the file system swapped, the way
s3-connector-for-pytorch plugs in: planning, file layout and serialisation stay torch's, so a
checkpoint written here is an ordinary DCP directory that torch's own reader loads too.

What the swap adds is the order in which things become durable in the *store*. The mount writes
behind: ``close()`` returns before the upload, ``fsync()`` waits for it. A checkpoint is complete when
its ``.metadata`` exists, so:

1. Before any shard is written, the coordinator removes a ``.metadata`` left by an earlier save to the
   same directory: the shards about to be overwritten would no longer match it, and a save that dies
   midway must not leave something that looks complete.
2. Every file a rank writes is fsynced before its stream is given back, which on the mount waits until
   the file is committed to the store; the rank's part of the save (``write_data``) returns only then.
   DCP gathers every rank's results before the coordinator writes the metadata, so ``.metadata`` is
   written after every shard of every rank -- on every host -- is in the store.
3. ``.metadata`` is written as ``.metadata.tmp``, fsynced, and renamed (torch's `finish`); the rename
   is fsynced too. A failure anywhere before that raises out of ``dcp.save`` and leaves no
   ``.metadata``.
4. Other hosts may hold views of the directory from before the save (the old ``.metadata`` that
   every rank looks up while planning, shards read by an earlier load) for up to the mount's
   metadata TTL. A save over files already there therefore returns no sooner than ``settle_s``
   (twice the default TTL) after planning ended, so a load anywhere that starts after it sees only
   the new checkpoint, never old and new shards mixed. A save that takes longer than that waits for
   nothing, and neither does one into a new or empty directory (a step's own, the usual layout):
   no host can hold a view of a checkpoint that was never there, and one that looked for
   ``.metadata`` meanwhile waits for it to become visible (``UCVolumeReader``).

`dcp.async_save` works the same way in its background thread (``BlockingAsyncStager`` copies the state
to memory first, as `FileSystemWriter` does).
"""

from __future__ import annotations

import errno
import io
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Generator

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan

log = logging.getLogger(__name__)

# Files each rank writes (and uploads) in parallel. The mount streams a large file's parts while it
# is written, so one file already keeps several uploads going; a second file overlaps one file's
# serialisation with the other's upload tail.
DEFAULT_THREAD_COUNT = 2
# A reader waits this long for a file written on another host to become visible: twice the mount's
# default metadata TTL (1 s), so a cached "no such file" has surely expired.
DEFAULT_WAIT_VISIBLE_S = 2.0
VISIBILITY_POLL_S = 0.05


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file (or directory) by path: on the mount, returns once it is committed to the store."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class VolumeFileSystem(FileSystem):
    """torch's local `FileSystem`, made durable in the store: every file written, and every rename,
    is fsynced before the call that produced it returns."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        with super().create_stream(path, mode) as stream:
            yield stream
            # Reached only when the writer finished without an error: a failed write is never
            # waited for (and is never referenced by a .metadata).
            if _writes(mode):
                if stream.closed:  # torch closes shard streams itself after its own fsync
                    fsync_path(path)
                else:
                    stream.flush()
                    os.fsync(stream.fileno())

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        fsync_path(new_path)

    def rm_file(self, path: str | os.PathLike) -> None:
        # Unlinking a committed file deletes the object before returning; fsyncing the directory
        # also settles a file that was still pending there.
        super().rm_file(path)
        fsync_path(Path(path).parent)


def _has_entries(path: os.PathLike) -> bool:
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is not None
    except (FileNotFoundError, NotADirectoryError):
        return False


def _writes(mode: str) -> bool:
    return any(c in mode for c in "wax+")


class VolumeReaderFileSystem(VolumeFileSystem):
    """Opens for reading wait a little for files that are not visible yet.

    A file another host committed shows on this host within the mount's metadata TTL (1 s by
    default). DCP's own save looks `.metadata` up on every rank before writing it, so a host that
    loads right after a save would otherwise find the lookup's "no such file" still cached. Every
    file a reader opens is named by a complete checkpoint, so "missing" here can only mean "not
    visible yet" -- or a checkpoint that is not there, which then fails `wait_visible_s` later.
    """

    def __init__(self, wait_visible_s: float):
        super().__init__()
        self.wait_visible_s = wait_visible_s

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if not _writes(mode):
            deadline = time.monotonic() + self.wait_visible_s
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(VISIBILITY_POLL_S)
        with super().create_stream(path, mode) as stream:
            yield stream


class UCVolumeWriter(FileSystemWriter):
    """DCP storage writer for a directory on the mount; see the module docstring for the guarantees.

    Keyword-only options are `FileSystemWriter`'s, except ``sync_files``, which is always on: it is
    what makes ``.metadata`` mean "complete".
    """

    def __init__(self, path: str | os.PathLike, *, single_file_per_rank: bool = True,
                 thread_count: int = DEFAULT_THREAD_COUNT, per_thread_copy_ahead: int = 10_000_000,
                 cache_staged_state_dict: bool = False, overwrite: bool = True,
                 settle_s: float = DEFAULT_WAIT_VISIBLE_S, **kwargs):
        if kwargs.pop("sync_files", True) is False:
            log.warning("UCVolumeWriter ignores sync_files=False: without it a checkpoint could be "
                        "marked complete before its shards are in the store")
        super().__init__(path, single_file_per_rank=single_file_per_rank, sync_files=True,
                         thread_count=thread_count, per_thread_copy_ahead=per_thread_copy_ahead,
                         cache_staged_state_dict=cache_staged_state_dict, overwrite=overwrite, **kwargs)
        self.fs = VolumeFileSystem()
        self.path = self.fs.init_path(path)
        self.settle_s = settle_s
        self._planned_at: float | None = None
        self._over_files = True  # the directory held files when this save began (point 4 above)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._over_files = _has_entries(self.path)
        plan = super().prepare_local_plan(plan)  # creates the directory; refuses if overwrite=False
        if not self.use_collectives and self.rank is not None:
            self._retract(self._get_metadata_path(self.rank))  # each rank owns its own metadata file
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The coordinator runs this after every rank planned (and looked up the old .metadata) and
        # before any rank writes a shard. Without collectives, every rank runs it for itself.
        self._planned_at = time.monotonic()
        self._retract(self._get_metadata_path())
        return super().prepare_global_plan(plans)

    def _retract(self, metadata_path: os.PathLike) -> None:
        try:
            self.fs.rm_file(metadata_path)
        except FileNotFoundError:
            return  # none, or another rank saving without collectives removed it first
        log.info("%s: removed the metadata of the checkpoint being overwritten", metadata_path)

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        if self._planned_at is not None and self._over_files:
            # What other hosts cached before the save expires before any rank's dcp.save returns.
            wait = self._planned_at + self.settle_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        # Every shard stream was fsynced as it closed; this also waits for anything else pending
        # under the checkpoint directory on this host before the rank reports its part done.
        fsync_path(self.path)
        return fut


class UCVolumeReader(FileSystemReader):
    """DCP storage reader for a directory on the mount (any host's mount of the same volume).

    ``wait_visible_s``: how long to wait for a checkpoint file another host has just written to
    become visible here; a little over the mount's metadata TTL. A directory still missing after that
    is a `FileNotFoundError` from the constructor.
    """

    def __init__(self, path: str | os.PathLike, *, wait_visible_s: float = DEFAULT_WAIT_VISIBLE_S, **kwargs):
        # A checkpoint that is not there is a plain FileNotFoundError here, not an exception that DCP
        # raises from inside `dcp.load` wrapped in its CheckpointException (a BaseException).
        deadline = time.monotonic() + wait_visible_s
        while not os.path.isdir(path):
            if time.monotonic() >= deadline:
                raise FileNotFoundError(errno.ENOENT, "no checkpoint directory here (if another host is "
                                        "writing it, load after its dcp.save returns)", os.fspath(path))
            time.sleep(VISIBILITY_POLL_S)
        super().__init__(path, **kwargs)
        self.fs = VolumeReaderFileSystem(wait_visible_s)
        self.path = self.fs.init_path(path)
