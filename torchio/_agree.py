"""One file list for every rank: rank 0's.

Each rank lists the dataset's directory itself, at a slightly different moment. If the directory
changes meanwhile (a pipeline still adding files, another host replacing some), ranks get different
lists, so different shard sizes. A DDP job whose ranks run different numbers of steps hangs in its
next collective. So under `torch.distributed` every rank shards rank 0's list.

This is not a collective. Rank 0 puts its listing into the process group's key-value store and never
waits, so a dataset built on rank 0 alone (an evaluation set, say) costs it nothing. Every other rank
lists as before, waits for the digest of rank 0's listing, and only when that differs from its own
does it fetch rank 0's entries and use them. A listing is matched by what it lists (root, pattern,
recursion) and by how many listings of that this process has made: the n-th on rank 1 takes the n-th
on rank 0.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import threading
import zlib
from typing import Sequence

log = logging.getLogger(__name__)

# How long a rank waits for rank 0's listing of the same files. Rank 0 may be listing a large
# directory; a rank that builds a dataset rank 0 never builds gives up after this and keeps its own.
RANK0_WAIT_S = 300.0

_counts: dict[str, int] = {}
_counts_lock = threading.Lock()


def names_digest(names: Sequence[str]) -> str:
    """A digest of a sorted list of relative names: equal digests, equal lists."""
    h = hashlib.sha256()
    for name in names:
        h.update(os.fsencode(name) + b"\0")
    return h.hexdigest()[:32]


def group_store():
    """(store, rank) of the default process group, or None outside one of two or more ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        return _get_default_store(), dist.get_rank()
    except Exception as e:  # a torch without it, or a group with no store: ranks list on their own
        log.warning("ranks cannot share a listing (%s); each rank uses its own", e)
        return None


def rank0_listing(what: str, entries: list[tuple[str, int, int]]) -> list[tuple[str, int, int]] | None:
    """Rank 0's listing of `what`, when this rank's `entries` (sorted (name, size, mtime_ns)) differ
    from it; None to keep them (on rank 0, outside a process group, or when they agree)."""
    found = group_store()
    if found is None:
        return None
    store, rank = found
    with _counts_lock:
        n = _counts.get(what, 0)
        _counts[what] = n + 1
    key = f"torchio/listing/{hashlib.sha256(os.fsencode(what)).hexdigest()[:24]}/{n}"
    mine = names_digest([e[0] for e in entries])
    if rank == 0:
        store.set(key + "/entries", _encode(entries))
        store.set(key + "/digest", mine)  # last: a rank that sees it finds the entries there
        return None
    try:
        store.wait([key + "/digest"], datetime.timedelta(seconds=RANK0_WAIT_S))
        theirs = store.get(key + "/digest").decode()
    except Exception as e:
        log.warning("rank %d: rank 0's listing of %s did not come within %.0f s (%s); using this "
                    "rank's own, so shard sizes may differ", rank, what.split("\0")[0], RANK0_WAIT_S, e)
        return None
    if theirs == mine:
        return None
    adopted = _decode(store.get(key + "/entries"))
    log.warning("rank %d listed %d files under %s, rank 0 listed %d (the directory changed between "
                "the listings): using rank 0's, so that every rank shards the same list",
                rank, len(entries), what.split("\0")[0], len(adopted))
    return adopted


def _encode(entries: list[tuple[str, int, int]]) -> bytes:
    fields = []
    for name, size, mtime_ns in entries:
        fields += (os.fsencode(name), b"%d" % size, b"%d" % mtime_ns)
    return zlib.compress(b"\0".join(fields), 1)


def _decode(blob: bytes) -> list[tuple[str, int, int]]:
    raw = zlib.decompress(blob)
    if not raw:
        return []
    f = raw.split(b"\0")
    return [(os.fsdecode(f[i]), int(f[i + 1]), int(f[i + 2])) for i in range(0, len(f), 3)]
