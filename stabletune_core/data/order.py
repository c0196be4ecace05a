"""The batch order: batches of one bucket each, in a keyed pseudo-random order per epoch, and each process's share
of it. Batch K of epoch E is computed without building the others (resume mid-epoch costs nothing)."""
from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence

from .seeds import derive_seed

Bucket = tuple[int, int]
Position = tuple[int, int]  # (epoch, sampler batches of that epoch already consumed)


class BucketBatchSampler:
    """Batches in which every index shares one bucket, in a per-epoch order.

    `entries` are (item index, bucket) or (item index, bucket, repeats): an item with repeats 5 appears 5 times
    per epoch. Repeats are never expanded into a list: the order of epoch E is a keyed pseudo-random permutation
    (seeded by (seed, E)) computed one batch at a time, so memory and set-up time do not grow with the repeat
    counts and `batches_for_epoch(E)[K]` is batch K of epoch E without building the others (resume mid-epoch).

    The last, incomplete batch of each bucket is kept as a smaller batch.
    Dropping it (drop_last) would silently never train images that land in a
    bucket holding fewer than `batch_size` of them, which is common with
    bucketing; a slightly smaller batch now and then is the cheaper price.
    """

    def __init__(self, entries: Sequence[tuple], batch_size: int, seed: int) -> None:
        if batch_size < 1:
            raise ValueError(f"Batch size must be at least 1, got {batch_size}.")
        if not entries:
            raise ValueError("Cannot make batches from an empty dataset.")
        groups: dict[Bucket, tuple[list[int], list[int]]] = {}  # bucket -> (indices, running total of repeats)
        for index, bucket, *repeats in entries:
            count = repeats[0] if repeats else 1
            if count < 1:
                continue
            indices, totals = groups.setdefault(tuple(bucket), ([], []))
            indices.append(index)
            totals.append((totals[-1] if totals else 0) + count)
        if not groups:
            raise ValueError("Cannot make batches from an empty dataset.")
        self._groups = list(dict(sorted(groups.items())).values())  # fixed order before any shuffling
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.skip_batches = 0
        batch_totals, total = [], 0
        for _, totals in self._groups:
            total += math.ceil(totals[-1] / batch_size)
            batch_totals.append(total)
        self._batch_totals = batch_totals  # running total of batches over the buckets

    def __len__(self) -> int:
        return self._batch_totals[-1]

    def batches_for_epoch(self, epoch: int) -> "EpochOrder":
        """The batches of `epoch`, in order, as a lazy sequence (len, indexing, slicing, iteration)."""
        return EpochOrder(self, epoch)

    def batch(self, epoch: int, k: int) -> list[int]:
        """Batch `k` of `epoch`: item indices, all in one bucket."""
        key = derive_seed("batches", self.seed, epoch)
        slot = _permute(k, len(self), key)  # shuffle across buckets too, so portraits and landscapes mix
        group = bisect.bisect_right(self._batch_totals, slot)
        first_batch = self._batch_totals[group - 1] if group else 0
        indices, totals = self._groups[group]
        size, bucket_key = totals[-1], derive_seed("bucket", self.seed, epoch, group)
        start = (slot - first_batch) * self.batch_size
        positions = (_permute(p, size, bucket_key) for p in range(start, min(start + self.batch_size, size)))
        return [indices[bisect.bisect_right(totals, p)] for p in positions]

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Choose what `__iter__` yields (for use as a DataLoader batch_sampler)."""
        self.epoch = epoch
        self.skip_batches = skip_batches

    def __iter__(self) -> Iterator[list[int]]:
        order = self.batches_for_epoch(self.epoch)
        for k in range(self.skip_batches, len(order)):
            yield order[k]


class EpochOrder(Sequence):
    """The batches of one epoch, computed when asked for (see BucketBatchSampler)."""

    def __init__(self, sampler: BucketBatchSampler, epoch: int) -> None:
        self.sampler, self.epoch = sampler, epoch

    def __len__(self) -> int:
        return len(self.sampler)

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if not -len(self) <= k < len(self):
            raise IndexError(k)
        return self.sampler.batch(self.epoch, k % len(self))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)


def _permute(i: int, n: int, key: int) -> int:
    """Position `i` of a keyed pseudo-random permutation of range(n), in O(1) memory: a 4-round Feistel network
    on the smallest even-bit domain holding n, walking the cycle until the result falls inside range(n)."""
    if n <= 1:
        return 0
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    x = i
    while True:
        left, right = x >> half, x & mask
        for round_ in range(4):
            left, right = right, left ^ (_mix(key + round_ * 0x9E3779B97F4A7C15 + right) & mask)
        x = (left << half) | right
        if x < n:
            return x


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of an integer."""
    x &= 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class ShardedBatchSampler:
    """A DataLoader batch_sampler: the global batch order from a data position on, endlessly, this process's
    share of it.

    Every process walks the same global order (`BucketBatchSampler.batches_for_epoch`) and takes every
    world-th batch, so the global batch of a step is the same whatever the number of processes. Each yielded
    batch is a list of keys (index, epoch, place, after): `place` is the batch's own position (it seeds the
    batch's noise) and `after` the data position once every process has taken its batch of that group: what
    a checkpoint must store. Positions follow the loop's counter exactly: an epoch is entered when the next
    batch is drawn, so after the last batch of epoch E the position is (E, batches per epoch).
    """

    def __init__(self, sampler: BucketBatchSampler, start: Position, *, world: int = 1, rank: int = 0) -> None:
        self.sampler = sampler
        self.start = start
        self.world = world
        self.rank = rank

    def __iter__(self) -> Iterator[list[tuple[int, int, int, Position]]]:
        epoch, place = self.start
        order = self.sampler.batches_for_epoch(epoch)
        while True:
            group = []
            for _ in range(self.world):
                if place >= len(order):
                    epoch, place = epoch + 1, 0
                    order = self.sampler.batches_for_epoch(epoch)
                group.append((epoch, place, order[place]))
                place += 1
            mine_epoch, mine_place, indices = group[self.rank]
            yield [(index, mine_epoch, mine_place, (epoch, place)) for index in indices]
