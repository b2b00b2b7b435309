"""`export_table`: a table written into a volume as Parquet files, published whole.

    from torchio import export_table
    from torchio.tables import exported_files

    export_table("/data/delta/events", "/Volumes/main/ml/tables/events")         # a Delta table
    export_table(pyarrow_dataset_or_table, "/Volumes/main/ml/tables/events")      # or any Arrow data

    # Training reads the files directly, with no Spark in the loop:
    import datasets, pyarrow.dataset as ds
    train = datasets.load_dataset("parquet", data_files=exported_files("/Volumes/main/ml/tables/events"))
    events = ds.dataset("/Volumes/main/ml/tables/events")

**Sources.** A Delta table, by path or URI (read with the ``deltalake`` package, no Spark; ``version``
for time travel, ``storage_options`` for remote stores) or as a ``deltalake.DeltaTable``; any
``pyarrow.dataset.Dataset``, ``Table``, ``RecordBatch`` or ``RecordBatchReader``; a pandas DataFrame.
``columns`` and ``filter`` select what is exported.

**Files.** Record batches are gathered into row groups of about ``row_group_bytes`` of Arrow memory
and encoded with pyarrow's ParquetWriter by ``threads`` threads, each filling a file of its own
(encoding, not the upload, is what limits an export: tens of MB/s per core). A file is closed when
the next rows would take it past ``target_file_bytes``; how much rows shrink on disk is learned from
what was already written, so files come out close to the target (the last file of each thread is
shorter). File names carry the export's id (``part-00000-<id>.parquet``), numbered in the order the
files were started, so no two exports ever share a file name.

**Publishing.** A reader must never take a half-written export, nor a mix of an old and a new one.
Object stores have no atomic rename of a directory (on the mount it is a copy and a delete of every
object beneath, README "Semantics"), so the export is published in steps, and what makes it complete
is one small object written last, the *manifest* ``.manifest.json``:

1. *Stage*: files are written into ``.export-<name>-<id>/`` beside the target. The leading dot hides
   it from pyarrow.dataset, ``datasets`` and Spark, which skip names starting with ``.``.
2. *Commit*: each closed file is fsynced in a background thread (on the mount that returns once the
   file is in the store, so the next file is encoded while the last one uploads), then the staging
   directory is.
3. *Retire* (overwrite): the old manifest is removed first, then the old directory is renamed aside
   to ``.export-<name>-<id>.old/``.
4. *Move into place*: the staging directory is renamed to the target.
5. *Manifest*: ``.manifest.json`` (this export's id and every file with its rows and bytes) is written
   under a temporary name, fsynced and renamed into place; last, the retired export is deleted.

What a reader sees while that happens:

- Through the manifest (`exported_files`), on any host: one complete export. The manifest appears
  only after every file it names is in place and committed, it names files by this export's id, and
  it goes before the export it describes starts to go. Between steps 3 and 5 there is no manifest
  (`FileNotFoundError`: try again); a reader that took the old manifest just before step 3 may find
  its files gone (an error), never another export's files.
- Listing the directory (``pyarrow.dataset.dataset(dir)``, a ``*.parquet`` glob) on the host that
  exports: the mount moves a renamed directory in its own namespace only after every object is
  copied, so the directory holds the whole old export, then nothing (``ENOENT``), then the whole new
  one.
- Listing the directory on another host: part of the old export while step 3 deletes it, or part of
  the new one while step 4 copies it in (the non-atomic rename), but never files of both: every old
  object is deleted before the first new one is copied. Readers on other hosts that must not see a
  partial export read the manifest.

Why these choices: the old export is renamed aside rather than deleted file by file so that readers
on the exporting host never see part of it; the manifest's name starts with a dot because readers
skip such names (a ``_SUCCESS``-style name is read as data by ``datasets.load_dataset("parquet",
data_dir=...)``, which then fails on it).

One exporter per target at a time. An export that fails before step 3 removes its staging
directory; one killed outright leaves it behind (hidden, and named after the target, which a later
export logs).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import json
import logging
import os
import queue
import re
import shutil
import sys
import threading
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

log = logging.getLogger(__name__)

MiB = 1 << 20
# Big enough that what every file costs a reader (an open, a footer read, a request's latency) is
# small next to its data; small enough that a table makes many files to spread over ranks and
# loader workers. 128 MiB is also the mount's largest read-ahead window.
DEFAULT_TARGET_FILE_BYTES = 128 * MiB
# Arrow (uncompressed) bytes gathered into one row group. Row groups are what readers fetch and
# decode at a time (`datasets` iterates them, pyarrow prunes them by statistics): tens of MiB keep
# column chunks large enough for efficient ranged reads and the writer's memory bounded.
DEFAULT_ROW_GROUP_BYTES = 64 * MiB
# A file with less room left than this fraction of the target is closed rather than given a sliver
# of a row group.
FULL_ENOUGH = 0.05
# pyarrow's own cap on rows per row group; applies to tables of very narrow rows.
MAX_ROWS_PER_GROUP = 1 << 20
# zstd (at Arrow's default level) encodes about as fast as snappy and makes smaller files, and the
# files are read many more times than they are written. Every current Parquet reader supports it.
DEFAULT_COMPRESSION = "zstd"
# The buffer between the Parquet writer and the file: large writes are fewer FUSE round trips.
WRITE_BUFFER_BYTES = 4 * MiB
# Encoding lanes (threads, each writing a file of its own) by default: Parquet encoding is what
# limits an export's speed (tens of MB/s per core, against hundreds for the upload), and a few lanes
# leave the mount's upload work a core to run on.
DEFAULT_THREADS = max(1, min(4, (os.cpu_count() or 1)))
# Closed files waiting for their commit at once. Each fsync on the mount waits for one file's
# upload; the mount uploads several files in parallel, so a few waiters keep it busy.
FSYNC_THREADS = 4

MANIFEST_NAME = ".manifest.json"
MANIFEST_FORMAT = "torchio.export/1"
STAGING_PREFIX = ".export-"


def export_table(source: Any, volume_dir: str | os.PathLike, *,
                 target_file_bytes: int = DEFAULT_TARGET_FILE_BYTES, overwrite: bool = True,
                 columns: list[str] | None = None, filter: Any = None, version: int | None = None,
                 storage_options: dict[str, str] | None = None, compression: str = DEFAULT_COMPRESSION,
                 row_group_bytes: int | None = None, threads: int = DEFAULT_THREADS) -> list[str]:
    """Export `source` as Parquet files into the directory `volume_dir` and publish them whole.

    Returns the paths of the published files, sorted. Returns only once every file and the manifest
    are committed to the store (on a ucfs mount; durable on disk elsewhere).

    source: a Delta table (path, URI or ``deltalake.DeltaTable``), a ``pyarrow.dataset.Dataset``,
        ``pyarrow.Table``, ``RecordBatch``, ``RecordBatchReader``, or a pandas DataFrame.
    volume_dir: the target directory, inside a volume (not a volume's root: the staging directory
        is made beside it). Created if missing.
    target_file_bytes: about how large each file is on disk.
    overwrite: replace an existing export (or any directory) at `volume_dir`; otherwise a
        non-empty `volume_dir` raises `FileExistsError`.
    columns, filter: which columns and rows (a ``pyarrow.compute`` expression) to export.
    version, storage_options: for a Delta table given by path or URI: the table version to export
        (default: the latest) and the options ``deltalake`` needs to reach its store.
    compression: the Parquet codec.
    row_group_bytes: Arrow bytes per row group (default: the smaller of 64 MiB and the target).
    threads: files encoded in parallel. With one, the files hold the rows in the source's order;
        with more, row groups go to whichever thread is free (and up to `threads` files end short).
    """
    if target_file_bytes <= 0 or threads < 1:
        raise ValueError("target_file_bytes and threads must be positive")
    target = Path(os.path.abspath(os.fspath(volume_dir)))
    scanner, described = _open_scanner(source, columns=columns, filter=filter, version=version,
                                       storage_options=storage_options, target=target)
    if os.path.lexists(target) and not target.is_dir():
        raise NotADirectoryError(f"{target} exists and is not a directory")
    if not overwrite and _non_empty_dir(target):
        raise FileExistsError(f"{target} is not empty (pass overwrite=True to replace it)")
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    _warn_leftovers(parent, target.name)

    export_id = uuid.uuid4().hex[:16]
    staging = parent / f"{STAGING_PREFIX}{target.name}-{export_id}"
    try:
        staging.mkdir()
    except OSError as e:
        raise type(e)(e.errno, f"cannot stage the export beside {target} (the target must be a directory "
                               f"inside a volume, not a volume's root): {e.strerror}", str(staging)) from e
    t0 = time.monotonic()
    try:
        writer = _PartWriter(staging, export_id, scanner.projected_schema, target_file_bytes,
                             row_group_bytes or min(DEFAULT_ROW_GROUP_BYTES, target_file_bytes), compression,
                             threads)
        with writer:
            for batch in scanner.to_batches():
                writer.write(batch)
        _fsync_path(staging)  # on the mount: returns once everything beneath is committed
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    manifest = {
        "format": MANIFEST_FORMAT,
        "export_id": export_id,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": described,
        "columns": scanner.projected_schema.names,
        "rows": sum(f["rows"] for f in writer.files),
        "bytes": sum(f["bytes"] for f in writer.files),
        "files": writer.files,
    }
    _publish(staging, target, parent / f"{STAGING_PREFIX}{target.name}-{export_id}.old", manifest, overwrite)
    seconds = time.monotonic() - t0
    log.info("exported %s rows (%s bytes, %d files) from %s to %s in %.1f s", manifest["rows"],
             manifest["bytes"], len(writer.files), described, target, seconds)
    return [str(target / f["name"]) for f in writer.files]


def exported_files(volume_dir: str | os.PathLike) -> list[str]:
    """The files of the export published at `volume_dir`, from its manifest: always one whole export.

    Raises `FileNotFoundError` when there is no manifest (nothing exported there, or an export is
    being published right now: try again). Pass the list to ``pyarrow.dataset.dataset`` or to
    ``datasets.load_dataset("parquet", data_files=...)``.
    """
    directory = Path(os.fspath(volume_dir))
    manifest = read_manifest(directory)
    return [str(directory / f["name"]) for f in manifest["files"]]


def read_manifest(volume_dir: str | os.PathLike) -> dict:
    """The manifest of the export at `volume_dir` (see the module's docstring)."""
    with open(Path(os.fspath(volume_dir)) / MANIFEST_NAME, "rb") as f:
        manifest = json.load(f)
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{volume_dir}: not a manifest this version understands ({manifest.get('format')!r})")
    return manifest


# --------------------------------------------------------------------------------------------------
# sources


def _open_scanner(source: Any, *, columns: list[str] | None, filter: Any, version: int | None,
                  storage_options: dict | None, target: Path) -> tuple[pads.Scanner, str]:
    """A scanner over the source's selected rows and columns, and a description of the source for the
    manifest and the log. Nothing is read yet: the export streams the source."""
    if isinstance(source, (str, os.PathLike)):
        location = os.fspath(source)
        if "://" not in location:
            location = os.path.abspath(location)
        try:
            from deltalake import DeltaTable  # only exports of Delta tables need it
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError("exporting a Delta table needs deltalake, which is not installed: "
                                      "pip install 'ucfs[tables]'", name="deltalake") from e

        source = DeltaTable(location, version=version, storage_options=storage_options)
    elif version is not None or storage_options is not None:
        raise ValueError("version and storage_options apply only to a Delta table given by path or URI")
    if type(source).__module__.startswith("deltalake"):
        _refuse_table_inside(source.table_uri, target)
        dataset, described = source.to_pyarrow_dataset(), f"delta:{source.table_uri}@{source.version()}"
    elif isinstance(source, pads.Dataset):
        dataset, described = source, type(source).__name__
    elif isinstance(source, pa.RecordBatchReader):
        # Not through pads.dataset(), which would read the whole stream into memory first.
        return pads.Scanner.from_batches(source, columns=columns, filter=filter), "RecordBatchReader"
    elif isinstance(source, (pa.Table, pa.RecordBatch)):
        dataset, described = pads.dataset(source), type(source).__name__
    elif (pandas := sys.modules.get("pandas")) is not None and isinstance(source, pandas.DataFrame):
        # (A DataFrame exists only if pandas was imported.) As pandas' own to_parquet does, so its
        # index and dtypes come back with read_parquet.
        dataset, described = pads.dataset(pa.Table.from_pandas(source)), "pandas.DataFrame"
    else:
        raise TypeError(f"cannot export a {type(source).__qualname__}: pass a Delta table path, a "
                        "deltalake.DeltaTable, a pyarrow Dataset/Table/RecordBatchReader or a pandas DataFrame")
    return dataset.scanner(columns=columns, filter=filter), described


# --------------------------------------------------------------------------------------------------
# writing


class _PartWriter:
    """Record batches in, Parquet files of about `target_file_bytes` out.

    Batches are gathered into row groups here and encoded by `threads` *lanes*, each a thread with a
    file of its own: pyarrow releases the GIL while it encodes, so lanes encode in parallel. A lane
    closes its file when the next rows would take it past the target, and the file is fsynced in the
    background (on the mount: waits for its upload) while encoding goes on. With one lane the files
    keep the source's row order; with more, row groups are dealt to whichever lane is free.
    """

    def __init__(self, directory: Path, export_id: str, schema: pa.Schema, target_file_bytes: int,
                 row_group_bytes: int, compression: str, threads: int):
        self.directory, self.export_id, self.schema = directory, export_id, schema
        self.target_file_bytes, self.row_group_bytes, self.compression = target_file_bytes, row_group_bytes, compression
        self._entries: dict[int, dict] = {}  # file index -> its manifest entry
        self._pending: list[pa.RecordBatch] = []
        self._pending_bytes = 0
        self._lock = threading.Lock()
        # Disk bytes per Arrow byte, learned from what all lanes wrote; 1 until the first row group.
        self._arrow_bytes_written = 0
        self._disk_bytes_written = 0
        self._lanes: list[_Lane] = [_Lane(self) for _ in range(threads)]
        # Free lanes. Taking one before handing it rows bounds the row groups in memory to `threads`.
        self._free: queue.SimpleQueue[_Lane] = queue.SimpleQueue()
        for lane in self._lanes:
            self._free.put(lane)
        self._encoders = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="export-encode")
        self._fsyncs = concurrent.futures.ThreadPoolExecutor(FSYNC_THREADS, thread_name_prefix="export-fsync")
        self._work: list[concurrent.futures.Future] = []

    @property
    def files(self) -> list[dict]:
        """The manifest's entries, in file name order."""
        return [self._entries[i] for i in sorted(self._entries)]

    def __enter__(self) -> "_PartWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._submit()
                self._encoders.shutdown(wait=True)
                self._raise_failures()
                for lane in self._lanes:
                    if lane.writer is not None or (lane is self._lanes[0] and not self._entries):
                        lane.close_file()  # an empty source still makes one file: its schema
        finally:
            # Nothing outlives the export: encoders finish their row group, commits are waited for.
            self._encoders.shutdown(wait=True)
            for lane in self._lanes:
                lane.abandon()
            self._fsyncs.shutdown(wait=True)
        if exc_type is None:
            self._raise_failures()

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        self._pending.append(batch)
        self._pending_bytes += batch.nbytes
        if self._pending_bytes >= self.row_group_bytes:
            self._submit()

    def _submit(self) -> None:
        """Hand the gathered batches to the next free lane."""
        if not self._pending:
            return
        table = pa.Table.from_batches(self._pending, self.schema)
        self._pending, self._pending_bytes = [], 0
        lane = self._free.get()  # waits while every lane is busy
        self._raise_failures()  # stop reading the source as soon as a lane or a commit failed

        def encode() -> None:
            try:
                lane.write(table)
            finally:
                self._free.put(lane)

        future = self._encoders.submit(encode)
        with self._lock:
            self._work.append(future)

    def _raise_failures(self) -> None:
        """Raise the first failure of an encoder or a commit, if any has failed so far."""
        with self._lock:
            done = [f for f in self._work if f.done()]
            self._work = [f for f in self._work if not f.done()]
        for f in done:
            f.result()

    # -- for the lanes ---------------------------------------------------------------------------
    def disk_bytes_per_arrow_byte(self) -> float:
        with self._lock:
            return self._disk_bytes_written / self._arrow_bytes_written if self._arrow_bytes_written else 1.0

    def wrote(self, arrow_bytes: int, disk_bytes: int) -> None:
        with self._lock:
            self._arrow_bytes_written += arrow_bytes
            self._disk_bytes_written += disk_bytes

    def new_file(self) -> tuple[Path, dict]:
        with self._lock:
            index = len(self._entries)
            entry = self._entries[index] = {"name": f"part-{index:05d}-{self.export_id}.parquet", "rows": 0,
                                            "bytes": 0}
        return self.directory / entry["name"], entry

    def closed(self, path: Path) -> None:
        # close() on the mount returned before the upload; the fsync waits for it, off this thread.
        future = self._fsyncs.submit(_fsync_path, path)
        with self._lock:
            self._work.append(future)


class _Lane:
    """One encoding thread's current file. Used by one thread at a time (the writer's free queue)."""

    def __init__(self, parts: _PartWriter):
        self.parts = parts
        self.sink: pa.NativeFile | None = None
        self.writer: pq.ParquetWriter | None = None
        self.path: Path | None = None
        self.entry: dict | None = None

    def write(self, table: pa.Table) -> None:
        """Write rows, cutting files where they reach the target."""
        target = self.parts.target_file_bytes
        while table.num_rows:
            if self.writer is None:
                self._open_file()
            room = target - self.sink.tell()
            if self.entry["rows"] and room < target * FULL_ENOUGH:
                self.close_file()
                continue
            disk_per_row = max(self.parts.disk_bytes_per_arrow_byte() * table.nbytes / table.num_rows, 1e-9)
            # As many rows as the estimate says fit (at least one: a row larger than a file still
            # goes somewhere). The loop then looks again with what this write taught the estimate,
            # so a first guess that was too cautious does not leave the file short.
            take = min(table.num_rows, max(1, int(room // disk_per_row)))
            rows = table.slice(0, take)
            before = self.sink.tell()
            self.writer.write_table(rows, row_group_size=MAX_ROWS_PER_GROUP)
            self.parts.wrote(rows.nbytes, self.sink.tell() - before)
            self.entry["rows"] += take
            table = table.slice(take)

    def _open_file(self) -> None:
        self.path, self.entry = self.parts.new_file()
        self.sink = pa.output_stream(str(self.path), buffer_size=WRITE_BUFFER_BYTES)
        self.writer = pq.ParquetWriter(self.sink, self.parts.schema, compression=self.parts.compression)

    def close_file(self) -> None:
        if self.writer is None:
            self._open_file()
        self.writer.close()
        self.sink.close()
        self.writer = self.sink = None
        self.entry["bytes"] = os.stat(self.path).st_size
        self.parts.closed(self.path)

    def abandon(self) -> None:
        """After a failure: close without publishing anything (the staging directory goes)."""
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.close()
            with contextlib.suppress(Exception):
                self.sink.close()
            self.writer = self.sink = None


# --------------------------------------------------------------------------------------------------
# publishing


def _publish(staging: Path, target: Path, aside: Path, manifest: dict, overwrite: bool) -> None:
    """Steps 3 to 5 of the module's docstring: the committed staging directory becomes `target`."""
    retired = False
    if os.path.lexists(target):
        if not target.is_dir():
            raise NotADirectoryError(f"{target} exists and is not a directory")
        if _non_empty_dir(target):
            if not overwrite:  # someone wrote there while we exported
                shutil.rmtree(staging, ignore_errors=True)
                raise FileExistsError(f"{target} is not empty (pass overwrite=True to replace it)")
            # The manifest goes first: from here on nobody takes the old export as complete.
            try:
                os.unlink(target / MANIFEST_NAME)
            except FileNotFoundError:
                pass
            os.rename(target, aside)
            retired = True
        else:
            os.rmdir(target)  # an empty directory: nothing to retire
    os.rename(staging, target)
    tmp = target / (MANIFEST_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, target / MANIFEST_NAME)
    # The target, not its parent: on the mount a directory fsync waits for everything pending
    # beneath it, and the parent may hold other people's work in progress.
    _fsync_path(target)
    if retired:
        shutil.rmtree(aside)


def _fsync_path(path: Path) -> None:
    """fsync by path; on a ucfs mount it returns once the file (or everything beneath the directory)
    is committed to the store."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _refuse_table_inside(table_uri: str, target: Path) -> None:
    """Overwriting a directory that holds the source table would delete the table and its history.
    Checked on the table's own URI, however it was given (a path, a file:// URI, a DeltaTable), and
    through symbolic links."""
    if table_uri.startswith("file:"):
        local = urllib.parse.unquote(urllib.parse.urlsplit(table_uri).path)
    elif "://" in table_uri:
        return  # another file system: it cannot lie inside a local target
    else:
        local = table_uri
    location = Path(os.path.realpath(local))
    real_target = Path(os.path.realpath(target))
    if location == real_target or real_target in location.parents:
        raise ValueError(f"the Delta table {location} lies inside the target {target}")


def _non_empty_dir(path: Path) -> bool:
    try:
        with os.scandir(path) as it:
            return next(it, None) is not None
    except FileNotFoundError:
        return False


def _warn_leftovers(parent: Path, name: str) -> None:
    # Exactly this target's staging names: an export to "events" must not claim "events-v0"'s.
    mine = re.compile(re.escape(f"{STAGING_PREFIX}{name}-") + r"[0-9a-f]{16}(\.old)?")
    try:
        left = sorted(e.name for e in os.scandir(parent) if mine.fullmatch(e.name))
    except FileNotFoundError:
        return
    if left:
        log.warning("%s holds %d directories left by exports to %s that did not finish (%s); remove them "
                    "once no export to it is running", parent, len(left), name, ", ".join(left))
