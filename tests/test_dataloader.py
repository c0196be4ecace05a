"""The data pipeline: a torch DataLoader whose workers decode images, without giving up exact resume or the
(seed, epoch, index) determinism."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from stabletune_core.data import BucketBatchSampler, ShardedBatchSampler
from stabletune_core.runs.reader import RunReader


def test_sharded_sampler_walks_the_global_order_from_any_position() -> None:
    sampler = BucketBatchSampler([(i, (64, 64) if i % 3 else (48, 80)) for i in range(10)], batch_size=2, seed=5)
    per_epoch = len(sampler)
    order = [(e, k, b) for e in range(4) for k, b in enumerate(sampler.batches_for_epoch(e))]

    def take(start, world, rank, n):
        it = iter(ShardedBatchSampler(sampler, start, world=world, rank=rank))
        return [next(it) for _ in range(n)]

    # One process, from the start: the global order itself, epoch after epoch.
    got = take((0, 0), 1, 0, 2 * per_epoch)
    assert [[k[0] for k in batch] for batch in got] == [b for _, _, b in order[: 2 * per_epoch]]
    assert [batch[0][1:3] for batch in got] == [(e, k) for e, k, _ in order[: 2 * per_epoch]]
    # The position after the last batch of an epoch stays in that epoch (the loop's counter convention).
    assert got[per_epoch - 1][0][3] == (0, per_epoch) and got[per_epoch][0][3] == (1, 1)

    # Two processes from mid-epoch 1: each takes every other batch, and both report the same next position.
    start = (1, per_epoch - 3)
    rank0, rank1 = take(start, 2, 0, 3), take(start, 2, 1, 3)
    flat = [batch for pair in zip(rank0, rank1) for batch in pair]
    first = per_epoch + per_epoch - 3
    assert [[k[0] for k in batch] for batch in flat] == [b for _, _, b in order[first : first + 6]]
    assert [b[0][3] for b in rank0] == [b[0][3] for b in rank1] == [(1, per_epoch - 1), (2, 1), (2, 3)]


def _train(tiny_config, run: Path, **overrides) -> tuple[list[dict], dict[str, torch.Tensor]]:
    from stabletune_core.train.loop import train

    config = tiny_config(output_dir=str(run), max_train_steps=6, train_batch_size=2, random_flip=True,
                         center_crop=False, lora_dropout=0.2, validation_loss_every=0, diagnostics_every=0,
                         activation_stats_every=0, **overrides)
    train(config)
    return RunReader(run).metrics(), load_file(run / "output" / "lora.safetensors")


def test_workers_change_nothing_and_resume_is_exact_with_workers(tiny_config, tmp_path, one_thread) -> None:
    """Random crops, flips and LoRA dropout on: 0 and 2 workers give the same run step for step, and a run
    resumed with 2 workers from a checkpoint written with none continues it exactly."""
    plain, plain_lora = _train(tiny_config, tmp_path / "w0", dataloader_num_workers=0, save_steps=3)
    workers, workers_lora = _train(tiny_config, tmp_path / "w2", dataloader_num_workers=2)
    assert [m["step"] for m in plain] == list(range(1, 7)) and plain[0]["epoch"] == 0 and plain[-1]["epoch"] == 1
    assert [m["loss"] for m in workers] == [m["loss"] for m in plain]
    assert [m["grad_norm"] for m in workers] == [m["grad_norm"] for m in plain]
    assert all(torch.equal(workers_lora[k], plain_lora[k]) for k in plain_lora)

    checkpoint = tmp_path / "w0" / "checkpoints" / "step_000003"
    resumed, resumed_lora = _train(tiny_config, tmp_path / "resumed", dataloader_num_workers=2,
                                   resume_from_checkpoint=str(checkpoint))
    assert [m["step"] for m in resumed] == [4, 5, 6]
    assert [m["loss"] for m in resumed] == [m["loss"] for m in plain[3:]]
    assert [m["epoch"] for m in resumed] == [m["epoch"] for m in plain[3:]]
    assert all(torch.equal(resumed_lora[k], plain_lora[k]) for k in plain_lora)


def test_images_are_decoded_in_the_worker_processes(tiny_config, one_thread) -> None:
    from stabletune_core.train.setup import setup
    from stabletune_core.train.step import next_batches

    s = setup(tiny_config(dataloader_num_workers=2, train_batch_size=2, validation_loss_every=0))
    batches = next_batches(s.feed, s.state, 4)
    assert s.feed.loader.num_workers == 2 and s.feed.loader.persistent_workers
    pids = {pid for b in batches for pid in b["decoded_in"]}
    assert os.getpid() not in pids and len(pids) == 2  # batches alternate between the two workers
    assert all(b["pixel_values"].shape[0] == 2 for b in batches)
    assert (s.state.epoch, s.state.batch_in_epoch) == (0, 4)

    s0 = setup(tiny_config(dataloader_num_workers=0, train_batch_size=2, validation_loss_every=0,
                           output_dir=str(Path(s.config.output_dir).parent / "inline")))
    inline = next_batches(s0.feed, s0.state, 4)
    assert {pid for b in inline for pid in b["decoded_in"]} == {os.getpid()}
    for a, b in zip(batches, inline):
        assert a["index"] == b["index"] and a["position"] == b["position"] and a["caption"] == b["caption"]
        assert torch.equal(a["pixel_values"], b["pixel_values"])
