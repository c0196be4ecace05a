"""The DataLoader a run draws its batches from: worker processes decode the next examples (in the global batch order,
this process's share of it) while the training process runs the current step."""
from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from .examples import DatasetView, collate
from .order import BucketBatchSampler, Position, ShardedBatchSampler


class ExampleDataset(torch.utils.data.Dataset):
    """`DatasetView.example` addressed by the sampler's keys, so DataLoader workers decode the images.

    An example is a pure function of (seed, epoch, index): which process or worker builds it changes
    nothing. `decoded_in` records the process that did (the training process when there are no workers).
    """

    def __init__(self, view: DatasetView, *, with_pixels: bool) -> None:
        self.view = view
        self.with_pixels = with_pixels

    def __len__(self) -> int:
        return len(self.view)

    def __getitem__(self, key: tuple[int, int, int, Position]) -> dict[str, Any]:
        index, epoch, place, after = key
        example = self.view.example(index, epoch, with_pixels=self.with_pixels)
        example.update(index=index, position=(epoch, place), next_position=after, decoded_in=os.getpid())
        return example


def collate_positioned(examples: list[dict[str, Any]]) -> dict[str, Any]:
    """`collate`, with the batch's position and the data position after it as single values."""
    batch = collate(examples)
    batch["position"] = tuple(examples[0]["position"])
    batch["next_position"] = tuple(examples[0]["next_position"])
    return batch


class BatchFeed:
    """A torch DataLoader over the view, from a data position on: workers decode and prefetch the next
    batches while the training process runs the current step.

    `position` is the data position after the last batch taken. `take(position, count)` returns the next `count`
    collated batches from `position` on; the DataLoader's iterator starts at the first call (after a resume has
    restored the data position) and starts again, keeping the worker processes, when asked for another position.
    """

    def __init__(self, view: DatasetView, sampler: BucketBatchSampler, start: Position = (0, 0), *,
                 with_pixels: bool, num_workers: int = 0, world: int = 1, rank: int = 0, pin_memory: bool = False,
                 prefetch_factor: int = 2) -> None:
        self.batch_sampler = ShardedBatchSampler(sampler, start, world=world, rank=rank)
        workers = dict(prefetch_factor=prefetch_factor, persistent_workers=True) if num_workers > 0 else {}
        self.loader = torch.utils.data.DataLoader(
            ExampleDataset(view, with_pixels=with_pixels), batch_sampler=self.batch_sampler,
            collate_fn=collate_positioned, num_workers=num_workers, pin_memory=pin_memory,
            # Its own generator: making an iterator draws a seed, and that must not move the global torch
            # RNG (LoRA dropout draws from it; a resumed run makes its iterator at another step).
            generator=torch.Generator().manual_seed(0), **workers)
        self.position = tuple(start)
        self._iterator: Iterator[dict[str, Any]] | None = None

    def restart(self, start: Position) -> None:
        self.batch_sampler.start = tuple(start)
        self.position = tuple(start)
        self._iterator = iter(self.loader)  # persistent workers drop what they prefetched and start again

    def take(self, position: Position, count: int) -> list[dict[str, Any]]:
        if self._iterator is None or self.position != tuple(position):
            self.restart(position)
        return [next(self) for _ in range(count)]

    def __next__(self) -> dict[str, Any]:
        if self._iterator is None:
            self.restart(self.position)
        batch = next(self._iterator)
        self.position = tuple(batch["next_position"])  # a tuple whatever pin_memory's thread made of it
        return batch
