"""`DataLoader`: torch's DataLoader with defaults for reading from the mount, resumable, and timed.

A drop-in subclass: every argument of `torch.utils.data.DataLoader` means what it means there. What
changes:

- **Defaults.** ``num_workers`` defaults to `default_num_workers()` instead of 0, and with workers
  ``prefetch_factor`` to 4 and ``persistent_workers`` to True: decoding gets processes of its own,
  several batches wait ready per worker, and an epoch does not pay for starting workers again (nor
  lose their warm state).
- **Fetching ahead.** Given a `UCVolumeDataset` (or a dataset wrapping one), each worker copies the
  upcoming files of its shard into the local cache with a bounded pool of I/O threads
  (``io_threads``, ``readahead_files``), so reading overlaps the consumer's compute.
- **Resuming.** The loader counts the batches it hands out and keeps the dataset's consumed count
  current, so `state_dict()` (the loader's or the dataset's) is exact with any number of workers.
- **Waiting time.** `stats()` says how long the consumer waited for each batch, and every
  ``log_every_batches`` batches a log line says it too. Time spent waiting is time the accelerator
  idles: the one figure that says whether input is the bottleneck.
"""

from __future__ import annotations

import logging
import os
import time
from array import array
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.utils.data

from .dataset import UCVolumeDataset, find_volume_dataset

log = logging.getLogger(__name__)

# Batches each worker prepares ahead (torch's default is 2). Four absorb the jitter of remote reads
# (one slow file delays only its batch) at the cost of a few batches of memory.
DEFAULT_PREFETCH_FACTOR = 4
# A log line per this many batches: often enough to watch a run, rare enough not to flood its log.
DEFAULT_LOG_EVERY_BATCHES = 100
# Workers at most by default. I/O needs no processes (the threads do it); these are for decoding.
MAX_DEFAULT_WORKERS = 8


def default_num_workers() -> int:
    """One worker per CPU this process may use, up to `MAX_DEFAULT_WORKERS`, leaving one for the trainer."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_WORKERS, cpus - 1))


@dataclass(frozen=True)
class LoaderStats:
    """How one pass over the loader went (so far, while it runs)."""

    epoch: int | None  # the dataset's epoch, when the loader reads a UCVolumeDataset
    batches: int
    elapsed_s: float  # from the start of the pass to the latest batch
    wait_s: float  # of which the consumer spent waiting for batches
    wait_first_s: float  # the first batch: start-up of workers and the first fetches
    wait_mean_s: float
    wait_p50_s: float
    wait_p95_s: float
    wait_max_s: float
    cache: dict[str, float] = field(default_factory=dict)  # hits, misses, copied bytes, ... (all passes)

    @property
    def wait_fraction(self) -> float:
        return self.wait_s / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["wait_fraction"] = self.wait_fraction
        return d


class DataLoader(torch.utils.data.DataLoader):
    """torch's DataLoader, tuned for `UCVolumeDataset`. Extra keyword-only options:

    - ``io_threads``, ``readahead_files``: override the dataset's fetch-ahead settings.
    - ``log_every_batches``: a timing log line per this many batches (0: none).
    """

    def __init__(self, dataset, batch_size: int | None = 1, shuffle: bool | None = None, sampler=None,
                 batch_sampler=None, num_workers: int | None = None, *args: Any,
                 prefetch_factor: int | None = None, persistent_workers: bool | None = None,
                 io_threads: int | None = None, readahead_files: int | None = None,
                 log_every_batches: int = DEFAULT_LOG_EVERY_BATCHES, **kwargs: Any):
        if num_workers is None:
            num_workers = default_num_workers()
        if num_workers > 0:
            prefetch_factor = DEFAULT_PREFETCH_FACTOR if prefetch_factor is None else prefetch_factor
            persistent_workers = True if persistent_workers is None else persistent_workers
        else:
            persistent_workers = bool(persistent_workers)
        volume = find_volume_dataset(dataset)
        if volume is not None:
            if io_threads is not None:
                volume.io_threads = int(io_threads)
            if readahead_files is not None:
                volume.readahead_files = int(readahead_files)
            # List now, in this process: the workers inherit the listing instead of each making one.
            volume._listing()
        super().__init__(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, *args,
                         prefetch_factor=prefetch_factor, persistent_workers=persistent_workers, **kwargs)
        self._volume = volume
        self.log_every_batches = int(log_every_batches)
        self._pass: _Pass | None = None
        self._workers_listing_gen = volume._listing_gen if volume is not None else 0
        if volume is not None and not self.in_order:
            log.warning("in_order=False: batches may arrive out of order, so a resumed epoch may repeat "
                        "or skip files")

    # -- iteration ------------------------------------------------------------------------------
    def __iter__(self):
        vol = self._volume
        epoch = start = None
        total = 0
        if vol is not None:
            vol._listing()  # a dataset built before init_process_group may take rank 0's listing now
            if self._iterator is not None and self._workers_listing_gen != vol._listing_gen:
                # Persistent workers hold copies of the dataset made when they started: after
                # refresh() their listing is the old one. Start new workers with the new listing.
                shutdown = getattr(self._iterator, "_shutdown_workers", None)
                if shutdown is not None:
                    shutdown()
                self._iterator = None
            self._workers_listing_gen = vol._listing_gen
            vol._publish(batch_size=self.batch_size or 1)
            if self.num_workers > 0:
                # The copies in the workers iterate; this process keeps the count (see dataset.py).
                epoch, start = vol._begin_iteration()
                total = len(vol)
            else:
                epoch = vol.epoch
        # The loader keeps only the pass's timing: holding torch's iterator here would keep the
        # workers of an abandoned pass (a `break`) alive, where torch's DataLoader shuts them down.
        self._pass = _Pass(vol, self.batch_size or 1, self.log_every_batches, epoch, start, total)
        return _PassIterator(super().__iter__(), self._pass)

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The dataset's state (epoch and items consumed); empty when the dataset is not ours."""
        return {"dataset": self._volume.state_dict()} if self._volume is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self._volume is None:
            if state:
                raise ValueError("this DataLoader's dataset is not a UCVolumeDataset; nothing to resume")
            return
        self._volume.load_state_dict(state["dataset"])

    # -- statistics -----------------------------------------------------------------------------
    def stats(self) -> LoaderStats | None:
        """Timing of the current pass, or of the last one; None before the first."""
        return self._pass.stats() if self._pass is not None else None


class _Pass:
    """One pass over the loader: counts and times the batches its `_PassIterator` hands out.

    Holds no reference to the loader, nor to torch's iterator (the loader keeps this object for
    `stats()`; the iterator, and the workers of a non-persistent pass, go with the consumer's loop).
    """

    def __init__(self, volume: UCVolumeDataset | None, batch_size: int, log_every: int,
                 epoch: int | None, start: int | None, total: int):
        self.volume = volume
        self.batch_size = batch_size
        self.log_every = log_every
        self.epoch = epoch
        self.start = start  # set when this process keeps the consumed count (workers > 0)
        self.total = total
        self.waits = array("d")
        self.t0 = time.perf_counter()
        self.t_last = self.t0
        self.logged_at = 0

    def next_from(self, inner):
        t = time.perf_counter()
        batch = next(inner)  # StopIteration ends the pass
        self.t_last = time.perf_counter()
        self.waits.append(self.t_last - t)
        n = len(self.waits)
        vol = self.volume
        if vol is not None and self.start is not None:
            # Batch k holds items [kB, (k+1)B) of the rest of the rank's stream; only the last is short.
            vol._note_consumed(self.epoch, self.start + min(n * self.batch_size, self.total - self.start))
        every = self.log_every
        if every > 0 and n - self.logged_at >= every:
            self._log(self.logged_at, n)
            self.logged_at = n
        return batch

    def _log(self, first: int, end: int) -> None:
        waits = self.waits[first:end]
        cache = self.volume.statistics() if self.volume is not None else {}
        log.info("batches %d-%d: waited %.3f s for data (mean %.1f ms, max %.1f ms) of %.2f s elapsed%s",
                 first, end - 1, sum(waits), 1e3 * sum(waits) / len(waits), 1e3 * max(waits),
                 self.t_last - self.t0,
                 f"; cache hits {cache['hits']} misses {cache['misses']}" if cache else "")

    def stats(self) -> LoaderStats:
        w = sorted(self.waits)
        n = len(w)

        def pct(p: float) -> float:
            return w[min(n - 1, int(p * n))] if n else 0.0

        vol = self.volume
        return LoaderStats(epoch=self.epoch, batches=n, elapsed_s=self.t_last - self.t0, wait_s=sum(w),
                           wait_first_s=self.waits[0] if n else 0.0, wait_mean_s=sum(w) / n if n else 0.0,
                           wait_p50_s=pct(0.5), wait_p95_s=pct(0.95), wait_max_s=w[-1] if n else 0.0,
                           cache=vol.statistics() if vol is not None else {})


class _PassIterator:
    """What `iter(loader)` returns: torch's iterator, counted and timed by its `_Pass`."""

    def __init__(self, inner, timing: _Pass):
        self.inner = inner
        self.timing = timing

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self.inner)

    def __next__(self):
        return self.timing.next_from(self.inner)

    def stats(self) -> LoaderStats:
        return self.timing.stats()

    def __getattr__(self, name: str):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)  # anything else torch's iterator offers
