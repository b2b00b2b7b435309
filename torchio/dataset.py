"""`UCVolumeDataset`: the files under a volume directory, sharded, cached locally, yielded as local paths.

    from torchio import UCVolumeDataset, DataLoader

    ds = UCVolumeDataset("/Volumes/main/vision/images/train", shuffle=True, seed=7)
    loader = DataLoader(ds, batch_size=32)
    for epoch in range(start_epoch, epochs):
        ds.set_epoch(epoch)
        for paths in loader:
            ...  # paths of local copies; decode them, or wrap `ds` in a decoding IterableDataset

**Listing.** Files are listed once per dataset object, when it is built, in the process that builds
it (sorted by path, so every rank and every rerun agrees), with the size and mtime the mount reports:
DataLoader workers, which torch's own DataLoader starts without asking the dataset anything, all
shard that one listing instead of each making its own. The listing is a snapshot: files added later
join after `refresh()`. Every cache decision uses the snapshot, so
an epoch that finds everything cached touches neither the mount nor the store. Under
`torch.distributed` every rank uses rank 0's listing, so a directory that changes while the ranks
list it cannot give them different shard sizes (see `_agree`; rank 0 never waits for the others).
A dataset built before the process group was initialised takes rank 0's listing the first time the
consumer's process uses it under the group.

**Sharding** (see `_shard`): rank and world size come from `torch.distributed` when it is
initialised, else from the ``RANK`` / ``WORLD_SIZE`` environment, else one process; the worker from
`get_worker_info()`. All are read when iteration starts, not when the dataset is built. Ranks get
equal counts: the epoch is padded by repeating files (``drop_last=False``, as `DistributedSampler`)
or cut (``drop_last=True``).

**Caching** (see `_cache`): each file is copied to a host-local cache on first use and its local path
yielded; a bounded pool of I/O threads copies the next `readahead_files` of the shard while the
consumer works on the current ones. Where the mount describes its volumes, a copy is one GET
straight from the store, checked against the version the mount listed (see `_direct`); otherwise,
and whenever that check fails, it is a copy through the mount.

**Resuming.** The state is ``(epoch, items consumed by this rank)``. That one number is exact because
the shard gives each DataLoader worker whole batches round-robin, the order in which the DataLoader
hands them out, so the consumer receives the rank's items in order (see `_shard`). Every rank consumes
the same count, so the state is the same on every rank and rank 0 may save it for all.

Who counts: iterated in the consumer's own process (``num_workers=0``, or no DataLoader) the dataset
counts what it yields. With worker processes the dataset the consumer holds is a copy that never
iterates; `torchio.DataLoader` counts the batches it hands out and tells the dataset. A plain
`torch.utils.data.DataLoader` with workers cannot, so use torchio's for mid-epoch resume with
workers. Exactness needs the DataLoader's default ``in_order=True`` and, for a wrapping dataset, one
sample per path, in order. With either loader a loaded state applies to the first pass after it
only: torch's does not say when a pass starts, so there each worker notes the state it has applied
(see `_worker_resume_start`).

**Worker processes hold copies.** `set_epoch`, `load_state_dict` and what torchio's DataLoader
publishes (rank, world size, batch size) go into a small shared-memory tensor that the copies read
when they start an iteration, so they reach persistent workers too.
"""

from __future__ import annotations

import collections
import concurrent.futures
import fnmatch
import itertools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info

from . import _agree, _shard
from ._cache import Fetched, FileCache, SourceFile
from ._direct import DirectSource, enabled_by_env

log = logging.getLogger(__name__)

GiB = 1 << 30

# Defaults, each sized for a training host's local NVMe and a store ~10 ms away.
# The cache holds this much at most. 64 GiB keeps a typical image or text training set whole, so
# epochs after the first read nothing remotely, without claiming a whole disk uninvited.
DEFAULT_CACHE_SIZE_BYTES = 64 * GiB
# ... and leaves at least this much free on its file system for checkpoints, logs and everyone else.
DEFAULT_FREE_FLOOR_BYTES = 8 * GiB
# Copies in flight per iterating process. At ~10 ms per request a 150 KiB file takes a few round
# trips; 16 at once keep one worker's shard ahead of a consumer doing a few thousand samples/s, and
# 4 workers x 16 match the mount's default of 64 store requests in flight.
DEFAULT_IO_THREADS = 16
# Files fetched ahead of the consumer per iterating process: several times the threads, so a slow file
# does not stall the pipeline behind it. Counted in files: they wait on local disk, not in memory.
DEFAULT_READAHEAD_FILES = 64

STATE_VERSION = 1

# The shared control block: int64 slots read by every copy of the dataset.
_EPOCH, _RESUME_EPOCH, _RESUME_START, _RESUME_WORLD, _BATCH, _RANK, _WORLD, _RESUME_GEN = range(8)
# Counter slots: one per DataLoader worker id up to 63, and the last one for the consumer's process.
_SLOTS = 65
_MAIN_SLOT = _SLOTS - 1
# Then, per DataLoader worker id up to 63, the resume generation (`_RESUME_GEN`, one per loaded
# state) that worker id has applied; see `_worker_resume_start`.
_APPLIED = 8
_HEADER = _APPLIED + _MAIN_SLOT
_COUNTERS = ("hits", "misses", "bypassed", "copied_bytes", "fetch_ns", "direct")


def default_cache_dir() -> Path:
    env = os.environ.get("UCFS_TORCHIO_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ucfs-torchio"


def current_rank_world() -> tuple[int, int]:
    """(rank, world size): torch.distributed if initialised, else RANK/WORLD_SIZE, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        raise ValueError("RANK and WORLD_SIZE must be integers when set") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is not within WORLD_SIZE={world}")
    return rank, world


class UCVolumeDataset(IterableDataset):
    """Local paths of the files under a directory on the mount, sharded by (rank, worker) and cached.

    Keyword-only options:

    - ``pattern``: glob on the path relative to the directory (``"*.jpg"``, ``"shard-*/*.bin"``).
    - ``recursive``: descend into subdirectories (default True).
    - ``shuffle``, ``seed``: a new order every epoch (see `set_epoch`), the same on every rerun.
    - ``drop_last``: ranks get equal counts by dropping the extra files (True) or by repeating
      files to pad (False, the default, like `DistributedSampler`).
    - ``cache_dir``, ``cache_size_bytes``, ``free_floor_bytes``: the host-local cache and its bounds;
      every process on the host may share one directory.
    - ``io_threads``, ``readahead_files``: copies in flight and files fetched ahead, per iterating
      process (0 threads: copy synchronously when asked).
    - ``batch_size``: the DataLoader's batch size; `torchio.DataLoader` sets it for you.
    - ``direct``: fill the cache with GETs straight from the store the mount describes, using this
      process's AWS credentials, for files whose listed version the store still has (see
      `torchio._direct`); anything else is copied through the mount. Default: on, unless
      ``UCFS_TORCHIO_DIRECT=0``.
    """

    def __init__(self, path: str | os.PathLike, *, pattern: str = "*", recursive: bool = True,
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False,
                 cache_dir: str | os.PathLike | None = None,
                 cache_size_bytes: int = DEFAULT_CACHE_SIZE_BYTES,
                 free_floor_bytes: int = DEFAULT_FREE_FLOOR_BYTES,
                 io_threads: int = DEFAULT_IO_THREADS, readahead_files: int = DEFAULT_READAHEAD_FILES,
                 batch_size: int = 1, direct: bool | None = None, _files: list[str] | None = None):
        super().__init__()
        self.root = os.path.abspath(os.fspath(path))
        if not os.path.isdir(self.root):
            err = NotADirectoryError if os.path.exists(self.root) else FileNotFoundError
            raise err(f"{self.root}: not a directory (UCVolumeDataset reads the files under one)")
        self.pattern = pattern
        self.recursive = recursive
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        if io_threads < 0 or readahead_files < 0:
            raise ValueError("io_threads and readahead_files must not be negative")
        self.io_threads = int(io_threads)
        self.readahead_files = int(readahead_files)
        if direct is None:
            direct = enabled_by_env()
        source = DirectSource.discover(self.root, max(1, self.io_threads)) if direct else None
        self.cache = FileCache(cache_dir if cache_dir is not None else default_cache_dir(),
                               capacity_bytes=cache_size_bytes, free_floor_bytes=free_floor_bytes,
                               direct=source)
        self._explicit: list[str] | None = _files  # from_files: these paths instead of a listing
        self._entries: list[SourceFile] | None = None
        self._agreed = False  # the ranks shard this listing (see `_take_rank0_listing`)
        self._names: list[str] | None = None  # relative paths, for the state's file-list digest
        self._listing_gen = 0  # bumped by refresh(): worker copies holding an older listing are stale
        self._block = torch.zeros(_HEADER + _SLOTS * len(_COUNTERS), dtype=torch.int64).share_memory_()
        self._block[_RESUME_EPOCH] = -1
        self._block[_BATCH] = max(1, int(batch_size))
        self._block[_WORLD] = 0  # not published: each copy detects it
        self._resume_armed = False  # consumer-side: a loaded state waits for the next iteration
        self._progress = (0, 0)  # consumer-side: (epoch, items consumed)
        self._counter_lock = threading.Lock()
        # List now, here: torch's DataLoader starts its workers without calling anything of the
        # dataset first, so a listing left for later was made by each worker on its own, and a
        # directory that changed between two workers' listings gave them overlapping shards.
        self._listing()

    # -- factories ------------------------------------------------------------------------------
    @classmethod
    def from_directory(cls, path: str | os.PathLike, **options: Any) -> "UCVolumeDataset":
        """The files under `path` (same as the constructor)."""
        return cls(path, **options)

    @classmethod
    def from_files(cls, paths: Iterable[str | os.PathLike], **options: Any) -> "UCVolumeDataset":
        """Exactly these files (e.g. from a manifest), in sorted order, each stat-ed once."""
        abs_paths = sorted({os.path.abspath(os.fspath(p)) for p in paths})
        if not abs_paths:
            raise ValueError("from_files needs at least one path")
        root = os.path.commonpath(abs_paths)
        if not os.path.isdir(root):
            root = os.path.dirname(root)
        return cls(root, _files=abs_paths, **options)  # stat-ed now: a missing file fails here

    # -- the file list --------------------------------------------------------------------------
    @property
    def files(self) -> list[str]:
        """Paths on the mount, in the dataset's canonical (sorted) order."""
        return [e.path for e in self._listing()]

    def refresh(self) -> None:
        """List the directory again (files added or changed since become visible)."""
        self._entries = self._names = None
        self._listing_gen += 1
        self._listing()

    def _listing(self) -> list[SourceFile]:
        if self._entries is None:
            t0 = time.monotonic()
            if self._explicit is not None:
                self._set_entries([_stat(p) for p in self._explicit])
                self._agreed = True  # the caller's own list: nothing to agree on
            else:
                self._set_entries(_list_files(self.root, self.pattern, self.recursive))
                self._agreed = False
            log.info("%s: %d files listed in %.2f s", self.root, len(self._entries), time.monotonic() - t0)
        if not self._agreed and get_worker_info() is None:
            self._take_rank0_listing()
        return self._entries

    def _take_rank0_listing(self) -> None:
        """Under torch.distributed, shard rank 0's listing on every rank (see `_agree`). Outside a
        process group of two or more ranks this does nothing, and is tried again at the next use, so
        that a dataset built before `init_process_group` agrees with the other ranks once there is one."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        self._agreed = True
        mine = [(n, e.size, e.mtime_ns) for n, e in zip(self._names, self._entries)]
        theirs = _agree.rank0_listing(f"{self.root}\0{self.pattern}\0{self.recursive}", mine)
        if theirs is not None:
            self._set_entries([SourceFile(os.path.join(self.root, n), size, mtime)
                               for n, size, mtime in theirs])
            self._listing_gen += 1  # persistent workers started on our own listing must restart

    def _set_entries(self, entries: list[SourceFile]) -> None:
        entries.sort(key=lambda e: e.path)
        self._entries = entries
        self._names = [os.path.relpath(e.path, self.root) for e in entries]

    def _digest(self) -> str:
        self._listing()
        return _agree.names_digest(self._names)

    # -- epochs, length, state ------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return int(self._block[_EPOCH])

    def set_epoch(self, epoch: int) -> None:
        """Use this epoch's order from the next iteration on (and in persistent workers too).

        Setting the epoch a loaded state was saved in keeps that state's resume point; any other
        epoch starts from its beginning.
        """
        b = self._block
        b[_EPOCH] = int(epoch)
        if int(b[_RESUME_EPOCH]) != int(epoch):
            b[_RESUME_EPOCH] = -1
            self._resume_armed = False
            self._progress = (int(epoch), 0)
        else:
            self._progress = (int(epoch), int(b[_RESUME_START]))

    def __len__(self) -> int:
        """Items this rank yields in one whole epoch."""
        _, world = self._rank_world()
        return _shard.per_rank_count(len(self._listing()), world, drop_last=self.drop_last)

    def state_dict(self) -> dict:
        """Where the consumer is: the epoch and the items of it this rank has consumed.

        The same on every rank (all ranks consume equal counts), so rank 0 may save it for all.
        """
        _, world = self._rank_world()
        epoch, consumed = self._progress
        return {"version": STATE_VERSION, "epoch": epoch, "consumed": consumed, "world_size": world,
                "num_files": len(self._listing()), "files_digest": self._digest(),
                "shuffle": self.shuffle, "seed": self.seed, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next iteration continues the saved epoch after what was consumed."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unknown UCVolumeDataset state version {state.get('version')!r}")
        for k in ("shuffle", "seed", "drop_last"):
            if state[k] != getattr(self, k):
                raise ValueError(f"cannot resume: the state was saved with {k}={state[k]!r}, "
                                 f"this dataset has {k}={getattr(self, k)!r}")
        n = len(self._listing())
        if state["num_files"] != n or state["files_digest"] != self._digest():
            raise ValueError(f"cannot resume exactly: the file list changed ({state['num_files']} files "
                             f"when saved, {n} now, or other names)")
        consumed = int(state["consumed"])
        if consumed < 0:
            raise ValueError("consumed must not be negative")
        b = self._block
        b[_EPOCH] = int(state["epoch"])
        b[_RESUME_EPOCH] = int(state["epoch"])
        b[_RESUME_START] = consumed
        b[_RESUME_WORLD] = int(state["world_size"])
        b[_RESUME_GEN] += 1  # every worker applies this state once (see `_worker_resume_start`)
        self._resume_armed = True
        self._progress = (int(state["epoch"]), consumed)

    # Consumer-side hooks for torchio.DataLoader ---------------------------------------------------
    def _publish(self, *, batch_size: int) -> None:
        """Tell worker copies the consumer's rank, world size and batch size."""
        rank, world = current_rank_world()
        b = self._block
        b[_RANK], b[_WORLD], b[_BATCH] = rank, world, max(1, int(batch_size))

    def _begin_iteration(self) -> tuple[int, int]:
        """Consumer side: a new pass starts. A loaded state applies to the first pass after it only."""
        b = self._block
        epoch = int(b[_EPOCH])
        if self._resume_armed:
            self._resume_armed = False
        else:
            b[_RESUME_EPOCH] = -1
        start = self._resume_start(epoch)
        self._progress = (epoch, start)
        return epoch, start

    def _note_consumed(self, epoch: int, consumed: int) -> None:
        self._progress = (epoch, consumed)

    def _resume_start(self, epoch: int) -> int:
        b = self._block
        if int(b[_RESUME_EPOCH]) != epoch:
            return 0
        _, world = self._rank_world()
        saved_world = int(b[_RESUME_WORLD])
        if saved_world != world:
            raise ValueError(f"cannot resume: the state was saved with world size {saved_world}, "
                             f"this run has {world}")
        return int(b[_RESUME_START])

    def _worker_resume_start(self, epoch: int, worker: int, workers: int) -> int:
        """`_resume_start` in DataLoader worker `worker` of `workers`, once per loaded state.

        torchio's DataLoader disarms a loaded state in the consumer's process when a later pass
        begins (`_begin_iteration`). torch's own cannot, so its workers applied the state on every
        pass of that epoch: each pass after a resume yielded only the rest of the epoch. So each
        worker id records the resume generation it applied, in the shared block where it outlives
        the process of a non-persistent worker, and applies a generation in one pass only.

        A worker also marks the ids above its pass's worker count: a later pass with more workers
        is still a later pass, and all its workers must agree, or the shards overlap. For the same
        reason a pass with more workers than there are slots keeps the old rule for all of them
        (the state applies in every pass of its epoch): use torchio's DataLoader with that many.
        """
        if workers > _MAIN_SLOT:
            return self._resume_start(epoch)
        b = self._block
        gen = int(b[_RESUME_GEN])
        if int(b[_APPLIED + worker]) == gen:
            return 0
        start = self._resume_start(epoch)
        b[_APPLIED + worker] = gen
        b[_APPLIED + workers:_APPLIED + _MAIN_SLOT] = gen
        return start

    def _resume_used_here(self) -> None:
        """A pass in the consumer's process has used the loaded state: worker copies must not
        apply it again in a later pass (see `_worker_resume_start`)."""
        self._block[_APPLIED:_APPLIED + _MAIN_SLOT] = int(self._block[_RESUME_GEN])

    def _rank_world(self) -> tuple[int, int]:
        b = self._block
        if get_worker_info() is not None and int(b[_WORLD]) > 0:
            return int(b[_RANK]), int(b[_WORLD])
        return current_rank_world()

    # -- iteration ------------------------------------------------------------------------------
    def _my_share(self) -> tuple[list[int], int, int, int | None, bool]:
        """(file indices, epoch, start, counter slot, in the consumer's process) of this iterator."""
        entries = self._listing()
        info = get_worker_info()
        if info is None:
            epoch, start = self._begin_iteration()
            self._resume_used_here()
            worker, workers, slot = 0, 0, _MAIN_SLOT
        else:
            epoch = int(self._block[_EPOCH])
            start = self._worker_resume_start(epoch, info.id, info.num_workers)
            worker, workers = info.id, info.num_workers
            slot = info.id if info.id < _MAIN_SLOT else None
        rank, world = self._rank_world()
        indices = _shard.shard(len(entries), epoch=epoch, seed=self.seed, shuffle=self.shuffle,
                               drop_last=self.drop_last, rank=rank, world_size=world, worker=worker,
                               num_workers=workers, batch_size=int(self._block[_BATCH]), start=start)
        return indices, epoch, start, slot, info is None

    def __iter__(self) -> Iterator[str]:
        indices, epoch, start, slot, consumer = self._my_share()
        entries = self._listing()
        fetched = self._fetch_ahead(entries, indices, slot)
        try:
            for k, path in enumerate(fetched, 1):
                if consumer:
                    self._progress = (epoch, start + k)  # counted before the consumer has it
                yield path
        finally:
            fetched.close()

    def _fetch_ahead(self, entries: list[SourceFile], indices: list[int],
                     slot: int | None) -> Iterator[str]:
        """Local paths of `indices` in order, with up to `readahead_files` fetched ahead by a pool.

        A file already cached is answered here, without the pool (a stat and a touch); only misses
        go to the I/O threads, so a cached epoch costs no thread hand-offs.
        """
        counts = _Counts(self, slot)
        pool = None
        if self.io_threads > 0 and len(indices) > 1:
            pool = concurrent.futures.ThreadPoolExecutor(self.io_threads, thread_name_prefix="torchio-fetch")

        def fetch(i: int) -> str:
            t0 = time.perf_counter_ns()
            f = self.cache.fill(entries[i])  # start() just found it missing
            counts.add(f, time.perf_counter_ns() - t0)
            return f.path

        def start(i: int) -> concurrent.futures.Future | str:
            local = self.cache.lookup(entries[i])
            if local is not None:
                counts.hit()
                return local
            return pool.submit(fetch, i) if pool is not None else fetch(i)

        window: collections.deque[concurrent.futures.Future | str] = collections.deque()
        todo = iter(indices)
        depth = max(self.readahead_files, 1) if pool is not None else 1
        try:
            for i in itertools.islice(todo, depth):
                window.append(start(i))
            while window:
                head = window.popleft()
                nxt = next(todo, None)
                if nxt is not None:
                    window.append(start(nxt))
                yield head if isinstance(head, str) else head.result()
        finally:
            counts.flush()
            if pool is not None:
                # An abandoned iteration (break, error, worker shutdown) stops fetching; copies already
                # running finish on their own and leave complete cache files behind.
                pool.shutdown(wait=False, cancel_futures=True)

    # -- statistics -----------------------------------------------------------------------------
    def statistics(self) -> dict[str, float]:
        """Cache hits, misses (``direct`` of them fetched from the store itself), bypasses, bytes
        copied and fetch time of all copies of this dataset."""
        c = self._block[_HEADER:].view(_SLOTS, len(_COUNTERS)).sum(dim=0).tolist()
        out = dict(zip(_COUNTERS, c))
        out["fetch_s"] = out.pop("fetch_ns") / 1e9
        return out

    # -- pickling (DataLoader workers started by spawn or forkserver) ----------------------------
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_counter_lock"]
        # A worker that is not forked cannot see torch.distributed of its parent: publish the rank
        # now, while the consumer's process pickles us for it at the start of an iteration.
        if get_worker_info() is None and int(self._block[_WORLD]) <= 0:
            with _ignore_errors():
                self._block[_RANK], self._block[_WORLD] = current_rank_world()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._counter_lock = threading.Lock()

    def __repr__(self) -> str:
        n = len(self._entries) if self._entries is not None else "?"
        return (f"UCVolumeDataset({self.root!r}, files={n}, shuffle={self.shuffle}, seed={self.seed}, "
                f"drop_last={self.drop_last}, cache={str(self.cache.root)!r})")


class _Counts:
    """One iterator's cache counters, added to its slot of the shared block every so many files: a
    torch operation per file would cost more than a cache hit itself."""

    FLUSH_EVERY = 64

    def __init__(self, ds: UCVolumeDataset, slot: int | None):
        self.ds, self.slot = ds, slot
        self.lock = threading.Lock()
        self.pending = [0] * len(_COUNTERS)
        self.n = 0

    def hit(self) -> None:
        self._add((1, 0, 0, 0, 0, 0))

    def add(self, f: Fetched, ns: int) -> None:
        self._add((int(f.hit), int(not f.hit and not f.bypassed), int(f.bypassed), f.copied_bytes, ns,
                   int(f.direct)))

    def _add(self, delta) -> None:
        with self.lock:
            for k, v in enumerate(delta):
                self.pending[k] += v
            self.n += 1
            if self.n >= self.FLUSH_EVERY:
                self._flush_locked()

    def flush(self) -> None:
        with self.lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        self.n = 0
        if self.slot is None or not any(self.pending):
            return
        base = _HEADER + self.slot * len(_COUNTERS)
        with self.ds._counter_lock:  # a slot has one writing process; this lock serialises its iterators
            self.ds._block[base:base + len(_COUNTERS)] += torch.tensor(self.pending, dtype=torch.int64)
        self.pending = [0] * len(_COUNTERS)


def _stat(path: str) -> SourceFile:
    st = os.stat(path)
    return SourceFile(path, st.st_size, st.st_mtime_ns)


def _list_files(root: str, pattern: str, recursive: bool) -> list[SourceFile]:
    """Every file under root matching pattern, with its size and mtime.

    One stat per file, serially: the mount answers a directory read with each entry's attributes
    (READDIRPLUS), so these stats are served by the kernel without a round trip to the daemon.

    A file or subdirectory that another process removes while this runs is left out, as a listing
    made a moment later would: only the root itself must be there.
    """
    out: list[SourceFile] = []
    pending = [root]
    while pending:
        d = pending.pop()
        try:
            it = os.scandir(d)
        except FileNotFoundError:
            if d == root:
                raise
            continue  # removed since its parent was read
        with it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    if recursive:
                        pending.append(e.path)
                    continue
                if not e.is_file(follow_symlinks=False):
                    continue
                if not fnmatch.fnmatchcase(os.path.relpath(e.path, root), pattern):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed since the directory was read
                out.append(SourceFile(e.path, st.st_size, st.st_mtime_ns))
    return out


class _ignore_errors:
    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb) -> bool:
        return typ is not None and issubclass(typ, Exception)


def find_volume_dataset(dataset: Any, depth: int = 3) -> UCVolumeDataset | None:
    """The UCVolumeDataset `dataset` is, or wraps (an attribute of it, a few levels deep)."""
    if isinstance(dataset, UCVolumeDataset):
        return dataset
    if depth <= 0:
        return None
    for v in getattr(dataset, "__dict__", {}).values():
        found = find_volume_dataset(v, depth - 1) if not isinstance(v, (str, bytes, int, float)) else None
        if found is not None:
            return found
    return None
