"""Which files each (rank, worker) reads in an epoch, and where a resumed epoch starts.

Pure arithmetic on file indices, without torch, so every property is unit-tested directly
(tests/unit/test_sharding.py).

One epoch, step by step:

1. **Order.** The sorted file list, or a permutation of it drawn from ``(seed, epoch)`` when shuffling:
   the same on every rank and every rerun, different from one epoch to the next.
2. **Even ranks.** The order is padded (files repeated from its start, as torch's
   ``DistributedSampler`` does) or cut (``drop_last``) to a multiple of the world size, so every rank
   gets exactly ``per_rank_count`` items and DDP ranks never disagree on the number of steps.
3. **Ranks.** Rank ``r`` takes every ``world_size``-th item starting at ``r``: its *rank stream*.
4. **Resume.** A resumed epoch drops the first ``start`` items of the rank stream (what the
   consumer had already received).
5. **Workers.** The rest is cut into batches of the loader's batch size and the batches are dealt
   round-robin to the DataLoader workers: worker ``w`` gets batches ``w, w + W, w + 2W, ...``.

Step 5 is what makes resuming exact. torch's DataLoader asks its workers for batches round-robin and
hands them to the consumer in that order, skipping workers that have run dry. With batches dealt
this way, the consumer therefore receives the rank stream *in order*: batch ``k`` is items
``[kB, (k+1)B)``, only the very last batch can be short, and "how far did the consumer get" is one
number -- items consumed -- whatever the number of workers. Resuming with another number of
workers, or another batch size, is still exact.
"""

from __future__ import annotations

import math
import random


def epoch_order(n: int, *, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The order of the n files in this epoch: identity, or a permutation fixed by (seed, epoch)."""
    order = list(range(n))
    if shuffle:
        # A string seed is hashed with SHA-512 by `random`: stable across processes, Python versions
        # and PYTHONHASHSEED, and (seed=1, epoch=0) does not collide with (seed=0, epoch=1) as
        # seed + epoch would.
        random.Random(f"torchio:{seed}:{epoch}").shuffle(order)
    return order


def per_rank_count(n: int, world_size: int, *, drop_last: bool) -> int:
    """Items every rank yields in one epoch."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    return n // world_size if drop_last else math.ceil(n / world_size)


def rank_stream(order: list[int], *, rank: int, world_size: int, drop_last: bool) -> list[int]:
    """Rank `rank`'s items of the epoch, in the order its consumer receives them."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    n = len(order)
    total = per_rank_count(n, world_size, drop_last=drop_last) * world_size
    if total <= n:
        even = order[:total]
    else:
        # Pad by repeating the order from its start (several times over when n < world_size).
        even = (order * math.ceil(total / n))[:total]
    return even[rank::world_size]


def worker_share(stream: list[int], *, start: int, worker: int, num_workers: int,
                 batch_size: int) -> list[int]:
    """The items of one worker: batches of `stream[start:]` dealt round-robin to the workers.

    `num_workers` 0 means the consumer's own process (one worker that gets everything).
    """
    workers = max(1, num_workers)
    if not 0 <= worker < workers:
        raise ValueError(f"worker {worker} is outside num_workers {num_workers}")
    if start < 0:
        raise ValueError(f"start must not be negative, not {start}")
    size = max(1, batch_size)
    rest = stream[start:]
    out: list[int] = []
    for b, i in enumerate(range(0, len(rest), size)):
        if b % workers == worker:
            out.extend(rest[i:i + size])
    return out


def shard(n: int, *, epoch: int, seed: int, shuffle: bool, drop_last: bool, rank: int, world_size: int,
          worker: int, num_workers: int, batch_size: int, start: int = 0) -> list[int]:
    """Everything above in one call: the file indices one (rank, worker) yields, in order."""
    order = epoch_order(n, epoch=epoch, seed=seed, shuffle=shuffle)
    stream = rank_stream(order, rank=rank, world_size=world_size, drop_last=drop_last)
    return worker_share(stream, start=start, worker=worker, num_workers=num_workers, batch_size=batch_size)
