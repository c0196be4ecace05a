"""Masked loss: mask files are found, follow their image's crop and flip, and weight the loss."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stabletune_core.data import collate
from views import view_of
from stabletune_core.data.masks import batch_loss_mask
from stabletune_core.data.scan import scan_dataset


def _square_image(size, box):
    """A grey image with a red rectangle at box=(left, top, right, bottom), and its exact mask."""
    pixels = np.full((size[1], size[0], 3), 128, np.uint8)
    mask = np.zeros((size[1], size[0]), np.uint8)
    left, top, right, bottom = box
    pixels[top:bottom, left:right] = (230, 20, 20)
    mask[top:bottom, left:right] = 255
    return Image.fromarray(pixels), Image.fromarray(mask)


def test_masks_are_not_training_images_and_follow_crop_and_flip(tmp_path):
    data = tmp_path / "data"
    (data / "masks").mkdir(parents=True)
    first, first_mask = _square_image((96, 64), (10, 8, 40, 30))  # wider than the bucket: a random crop
    first.save(data / "a.png")
    first_mask.save(data / "a.mask.png")
    second, second_mask = _square_image((64, 96), (30, 50, 60, 90))
    second.save(data / "b.png")
    second_mask.resize((32, 48), Image.Resampling.NEAREST).save(data / "masks" / "b.png")  # drawn at half size
    Image.new("RGB", (64, 64), (40, 90, 200)).save(data / "c.png")  # no mask

    scan = scan_dataset(data)
    assert sorted(item.path.name for item in scan.items) == ["a.png", "b.png", "c.png"]
    view = view_of(scan, 64, bucket_step=8, min_bucket_reso=32, max_bucket_reso=128, random_crop=True, flip=True,
                   seed=3)
    flips = set()
    for epoch in range(6):
        for index, name in enumerate(("a.png", "b.png")):
            example = view.example(index, epoch)
            assert example["path"].name == name
            red = (example["pixel_values"][0] > 0.5) & (example["pixel_values"][1] < -0.5)
            mask = example["loss_mask"][0] > 0.5
            assert red.any() and mask.shape == red.shape
            agreement = float((red == mask).float().mean())
            assert agreement > 0.97, (name, epoch, agreement)  # the mask stays on the pixels it was drawn on
            if name == "a.png":  # its square is in the left half: in the right half means flipped
                columns = red.nonzero()[:, 1].float()
                flips.add(bool(columns.mean() > red.shape[1] / 2))
    assert flips == {True, False}  # both flipped and unflipped crops were checked
    assert view.example(2, 0)["loss_mask"] is None

    batch = collate([view.example(2, 0), view.example(2, 1)])
    assert batch_loss_mask(batch, (8, 8)) is None  # no mask in the batch: the loss is computed as before


def test_loss_ignores_the_target_outside_the_mask(tiny_config, one_thread):
    """Gradient of the LoRA: changing the training target where the mask is black changes nothing; changing it
    where the mask is white does. (Pixels outside the mask still reach the UNet as context, as in kohya's
    masked loss: the mask decides what is trained, not what is seen.)"""
    from stabletune_core.train.loop import setup
    from stabletune_core.train.loss import per_sample_loss

    session = setup(tiny_config())
    unet = session.trained["unet"]
    gen = torch.Generator().manual_seed(0)
    noisy, hidden = torch.randn(2, 4, 8, 8, generator=gen), torch.randn(2, 77, 32, generator=gen)
    timesteps = torch.tensor([100, 700])
    target = torch.randn(2, 4, 8, 8, generator=gen)
    mask = torch.zeros(2, 1, 8, 8)
    mask[..., :4] = 1.0  # train the left half only

    def grads(target):
        session.optimizer.zero_grad(set_to_none=True)
        pred = unet(noisy, timesteps, encoder_hidden_states=hidden).sample
        per_sample_loss(pred, target, mask).sum().backward()
        return [p.grad.clone() for p in session.params]

    base = grads(target)
    outside, inside = target.clone(), target.clone()
    outside[..., 4:] = torch.randn(2, 4, 8, 4, generator=gen)
    inside[..., :4] = torch.randn(2, 4, 8, 4, generator=gen)
    assert any(g.abs().sum() > 0 for g in base)
    assert all(torch.equal(a, b) for a, b in zip(base, grads(outside)))
    assert any(not torch.allclose(a, b) for a, b in zip(base, grads(inside)))


def _train_with_masks(tiny_config, shapes_dataset, tmp_path, name, mask_fn):
    from stabletune_core.train.checkpoint import load_checkpoint
    from stabletune_core.train.loop import train

    data = tmp_path / f"data-{name}"
    shutil.copytree(shapes_dataset, data)
    for image in sorted(data.glob("*.png")):
        if mask_fn is not None:
            with Image.open(image) as opened:
                mask_fn(opened.size).save(image.with_name(image.stem + ".mask.png"))
    config = tiny_config(train_data_dir=str(data), output_dir=str(tmp_path / name), max_train_steps=2,
                         random_flip=True, diagnostics_every=0, activation_stats_every=0, validation_loss_every=0)
    train(config)
    root = Path(config.output_dir)
    losses = [json.loads(line)["loss"] for line in (root / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line)["message"] for line in (root / "events.jsonl").read_text().splitlines()]
    return losses, load_checkpoint(root / "checkpoints" / "step_000002").adapter, events


def test_all_white_mask_trains_exactly_as_no_mask_and_a_mask_changes_training(tiny_config, one_thread,
                                                                                shapes_dataset, tmp_path):
    def half(size):
        mask = Image.new("L", size, 0)
        mask.paste(255, (0, 0, size[0] // 2, size[1]))
        return mask

    plain, plain_lora, _ = _train_with_masks(tiny_config, shapes_dataset, tmp_path, "plain", None)
    white, white_lora, events = _train_with_masks(tiny_config, shapes_dataset, tmp_path, "white",
                                                  lambda size: Image.new("L", size, 255))
    assert "8 of 8 images have a loss mask (white = trained, black = ignored)." in events
    assert white == plain and all(torch.equal(plain_lora[k], white_lora[k]) for k in plain_lora)
    halved, halved_lora, _ = _train_with_masks(tiny_config, shapes_dataset, tmp_path, "half", half)
    assert halved != plain and any(not torch.equal(plain_lora[k], halved_lora[k]) for k in plain_lora)
