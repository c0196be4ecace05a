"""Tests for stabletune_core.data; every file is generated into tmp_path."""

from __future__ import annotations

import os
import random
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stabletune_core.data import (
    BucketBatchSampler,
    DatasetError,
    DatasetView,
    EmbeddingCache,
    LatentCache,
    NonFiniteCacheError,
    UnreadableImageError,
    assign_bucket,
    collate,
    load_image,
    make_buckets,
    process_caption,
    resize_and_crop,
    scan_dataset,
    write_caption,
)
from views import view_of


def save_rgb(path: Path, size: tuple[int, int] = (48, 32), color: tuple[int, int, int] = (200, 30, 30)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path


# --------------------------------------------------------------------------- images


def test_exif_rotated_jpeg_comes_out_upright(tmp_path: Path) -> None:
    image = Image.new("RGB", (40, 20), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 20, 20))  # left half red
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 clockwise to display"
    path = tmp_path / "phone.jpg"
    image.save(path, exif=exif, quality=95)

    loaded = load_image(path)
    assert loaded.mode == "RGB"
    assert loaded.size == (20, 40)
    # After a clockwise turn the red left half is on top.
    top, bottom = loaded.getpixel((10, 5)), loaded.getpixel((10, 35))
    assert top[0] > 200 and top[2] < 60
    assert bottom[2] > 200 and bottom[0] < 60


def test_rgba_is_composited_onto_white(tmp_path: Path) -> None:
    image = Image.new("RGBA", (8, 8), (0, 0, 0, 0))  # fully transparent black
    image.putpixel((0, 0), (255, 0, 0, 255))
    image.save(tmp_path / "a.png")
    loaded = load_image(tmp_path / "a.png")
    assert loaded.mode == "RGB"
    assert loaded.getpixel((4, 4)) == (255, 255, 255)
    assert loaded.getpixel((0, 0)) == (255, 0, 0)


def test_palette_with_transparency_and_la(tmp_path: Path) -> None:
    palette = Image.new("P", (8, 8), 0)
    palette.putpalette([0, 0, 0, 0, 255, 0] + [0] * 762)
    palette.putpixel((1, 1), 1)
    palette.save(tmp_path / "p.png", transparency=0)
    loaded = load_image(tmp_path / "p.png")
    assert loaded.getpixel((0, 0)) == (255, 255, 255)
    assert loaded.getpixel((1, 1)) == (0, 255, 0)

    Image.new("LA", (4, 4), (0, 0)).save(tmp_path / "la.png")
    assert load_image(tmp_path / "la.png").getpixel((0, 0)) == (255, 255, 255)


def test_cmyk_and_one_bit(tmp_path: Path) -> None:
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(tmp_path / "c.jpg")  # red in CMYK
    red = load_image(tmp_path / "c.jpg").getpixel((4, 4))
    assert red[0] > 200 and red[1] < 60 and red[2] < 60

    Image.new("1", (8, 8), 1).save(tmp_path / "bw.png")
    assert load_image(tmp_path / "bw.png").getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize("suffix", [".png", ".tif"])
def test_16bit_gray_midtone_stays_mid_gray(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"g16{suffix}"
    Image.fromarray(np.full((8, 8), 32768, dtype=np.uint16)).save(path)
    loaded = load_image(path)
    assert loaded.mode == "RGB"
    r, g, b = loaded.getpixel((3, 3))
    assert r == g == b and 120 <= r <= 135


def test_16bit_rgb_png(tmp_path: Path) -> None:
    # PIL cannot write 48-bit PNGs, so build one by hand: 2x2, colour type 2, depth 16.
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    pixels = np.zeros((2, 2, 3), dtype=">u2")
    pixels[..., 0], pixels[..., 1] = 65535, 32768
    raw = b"".join(b"\x00" + row.tobytes() for row in pixels)
    header = struct.pack(">IIBBBBB", 2, 2, 16, 2, 0, 0, 0)
    path = tmp_path / "rgb16.png"
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    )
    r, g, b = load_image(path).getpixel((1, 1))
    assert r == 255 and 120 <= g <= 135 and b == 0


def test_float_image_in_unit_range(tmp_path: Path) -> None:
    path = tmp_path / "f.tif"
    Image.fromarray(np.full((4, 4), 0.5, dtype=np.float32)).save(path)
    assert 120 <= load_image(path).getpixel((0, 0))[0] <= 135


def test_unreadable_files_raise_one_sentence(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"this is not a png at all" * 10)
    with pytest.raises(UnreadableImageError) as info:
        load_image(garbage)
    assert "garbage.png" in str(info.value)
    assert isinstance(info.value, ValueError)


# --------------------------------------------------------------------------- scan


def make_truncated_jpeg(path: Path) -> None:
    noise = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(path, quality=95)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_scan_skips_bad_files_and_never_deletes_them(tmp_path: Path) -> None:
    save_rgb(tmp_path / "good.png")
    make_truncated_jpeg(tmp_path / "broken.jpg")
    (tmp_path / "garbage.png").write_bytes(b"\x00\x01garbage" * 20)
    (tmp_path / "notes.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    scan = scan_dataset(tmp_path)

    assert [item.path.name for item in scan.items] == ["good.png"]
    skipped = {s.path.name: s.reason for s in scan.skipped}
    assert set(skipped) == {"broken.jpg", "garbage.png"}  # notes.json is ignored, not skipped
    assert "broken.jpg" in skipped["broken.jpg"] and "truncated" in skipped["broken.jpg"]
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert after == before


def test_scan_captions_repeats_and_order(tmp_path: Path) -> None:
    save_rgb(tmp_path / "b.png")
    save_rgb(tmp_path / "a.png", size=(30, 60))
    (tmp_path / "a.txt").write_text("  mychar, red hair \n", encoding="utf-8")
    save_rgb(tmp_path / "5_mychar" / "x.jpg")
    save_rgb(tmp_path / "misc" / "deeper" / "y.png")
    save_rgb(tmp_path / ".ipynb_checkpoints" / "a-checkpoint.png")

    scan = scan_dataset(tmp_path, default_caption="photo")

    by_name = {item.path.name: item for item in scan.items}
    assert [i.path.relative_to(tmp_path).as_posix() for i in scan.items] == [
        "5_mychar/x.jpg",
        "a.png",
        "b.png",
        "misc/deeper/y.png",
    ]
    assert by_name["a.png"].caption == "mychar, red hair"
    assert by_name["b.png"].caption == "photo"
    assert by_name["x.jpg"].repeats == 5
    assert by_name["a.png"].repeats == 1 and by_name["y.png"].repeats == 1
    assert (by_name["a.png"].width, by_name["a.png"].height) == (30, 60)
    assert scan.total_with_repeats == 8
    counts = scan.bucket_counts(make_buckets(64, step=8))
    assert sum(counts.values()) == 8
    frequency = scan.tag_frequency()
    assert frequency[tmp_path.name]["mychar"] == 1 and frequency["5_mychar"] == {"photo": 1}


def test_scan_errors_are_clear_sentences(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DatasetError) as info:
        scan_dataset(missing)
    assert str(info.value) == f"Dataset folder {missing} does not exist: choose the folder that holds your images."

    file = tmp_path / "file.png"
    save_rgb(file)
    with pytest.raises(DatasetError, match="not a folder"):
        scan_dataset(file)

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.txt").write_text("hi")
    with pytest.raises(DatasetError, match="holds no images"):
        scan_dataset(empty)

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.png").write_bytes(b"junk")
    with pytest.raises(DatasetError, match="all 1 were skipped") as info:
        scan_dataset(bad)
    assert "x.png" in str(info.value)


def test_write_caption_is_atomic_and_leaves_image_alone(tmp_path: Path) -> None:
    image = save_rgb(tmp_path / "img.png")
    original = image.read_bytes()
    caption_path = write_caption(image, "first")
    write_caption(image, "mychar, smiling")
    assert caption_path == tmp_path / "img.txt"
    assert caption_path.read_text(encoding="utf-8").strip() == "mychar, smiling"
    assert image.read_bytes() == original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["img.png", "img.txt"]  # no temp files left
    assert scan_dataset(tmp_path).items[0].caption == "mychar, smiling"


# --------------------------------------------------------------------------- buckets


@pytest.mark.parametrize("resolution,step", [(512, 64), (1024, 64), (64, 8)])
def test_buckets_are_multiples_of_step_within_area(resolution: int, step: int) -> None:
    buckets = make_buckets(resolution, step=step)
    assert (resolution, resolution) in buckets
    assert any(w > h for w, h in buckets) and any(w < h for w, h in buckets)
    for w, h in buckets:
        assert w % step == 0 and h % step == 0
        assert w * h <= resolution * resolution


def test_assign_bucket_follows_aspect_ratio() -> None:
    buckets = make_buckets(512)
    w, h = assign_bucket(1920, 1080, buckets)
    assert w > h
    w, h = assign_bucket(1080, 1920, buckets)
    assert w < h
    assert assign_bucket(700, 700, buckets) == (512, 512)


def test_resize_and_crop_shapes_and_range() -> None:
    image = Image.new("RGB", (300, 100), (255, 255, 255))
    image.paste((0, 0, 0), (0, 0, 150, 100))
    pixels, crop, original = resize_and_crop(image, (128, 64), random_crop=False)
    assert pixels.shape == (3, 64, 128) and pixels.dtype == torch.float32
    assert pixels.min() >= -1 and pixels.max() <= 1
    assert original == (100, 300)
    assert crop == (0, (192 - 128) // 2)

    rng_a, rng_b = random.Random(1), random.Random(1)
    assert torch.equal(
        resize_and_crop(image, (64, 64), random_crop=True, rng=rng_a)[0],
        resize_and_crop(image, (64, 64), random_crop=True, rng=rng_b)[0],
    )


# --------------------------------------------------------------------------- captions


def test_process_caption_keep_tokens_shuffle_and_dropout() -> None:
    caption = "mychar, red hair, smile, outdoors, hat, night"
    outputs = {
        process_caption(caption, random.Random(s), shuffle=True, keep_tokens=1, caption_dropout=0) for s in range(20)
    }
    assert len(outputs) > 1
    for out in outputs:
        tags = out.split(", ")
        assert tags[0] == "mychar" and sorted(tags) == sorted(caption.split(", "))

    same = [
        process_caption(caption, random.Random(3), shuffle=True, keep_tokens=2, caption_dropout=0, tag_dropout=0.5)
        for _ in range(2)
    ]
    assert same[0] == same[1] and same[0].startswith("mychar, red hair")

    assert process_caption(caption, random.Random(0), shuffle=True, keep_tokens=1, caption_dropout=1.0) == ""
    assert process_caption(" a ,b", random.Random(0), shuffle=False, keep_tokens=0, caption_dropout=0) == " a ,b"


# --------------------------------------------------------------------------- sampler and view


def test_sampler_batches_single_bucket_deterministic_and_complete() -> None:
    buckets = [(64, 64), (96, 40), (40, 96)]
    entries = [(i, buckets[i % 3]) for i in range(23)] + [(0, buckets[0])] * 4  # item 0 repeated
    bucket_of = {i: b for i, b in entries}
    sampler = BucketBatchSampler(entries, batch_size=4, seed=7)

    epoch0 = sampler.batches_for_epoch(0)
    assert len(epoch0) == len(sampler)
    assert epoch0 == BucketBatchSampler(entries, batch_size=4, seed=7).batches_for_epoch(0)
    assert epoch0 != sampler.batches_for_epoch(1)
    assert epoch0 != BucketBatchSampler(entries, batch_size=4, seed=8).batches_for_epoch(0)
    for epoch in range(3):
        batches = sampler.batches_for_epoch(epoch)
        assert all(len({bucket_of[i] for i in batch}) == 1 for batch in batches)
        assert sorted(i for batch in batches for i in batch) == sorted(i for i, _ in entries)

    sampler.set_epoch(1, skip_batches=2)
    assert list(sampler) == sampler.batches_for_epoch(1)[2:]


def make_view_dataset(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    save_rgb(root / "wide.png", size=(120, 60))
    save_rgb(root / "tall.png", size=(60, 120), color=(20, 200, 20))
    save_rgb(root / "3_char" / "square.png", size=(80, 80), color=(20, 20, 200))
    (root / "wide.txt").write_text("char, a, b, c, d")
    return root


def test_dataset_view_examples_are_reproducible(tmp_path: Path) -> None:
    scan = scan_dataset(make_view_dataset(tmp_path))
    options = dict(bucket_step=8, random_crop=True, flip=True, shuffle_caption=True, keep_tokens=1, seed=3)
    view = view_of(scan, 64, **options)
    again = view_of(scan, 64, **options)
    wide = next(i for i, item in enumerate(view.items) if item.path.name == "wide.png")

    a, b = view.example(wide, epoch=2), again.example(wide, epoch=2)
    assert torch.equal(a["pixel_values"], b["pixel_values"]) and a["caption"] == b["caption"]
    assert a["caption"].startswith("char")
    assert a["pixel_values"].shape[2] > a["pixel_values"].shape[1]  # landscape bucket
    assert a["original_size"] == (60, 120)
    assert a["target_size"] == tuple(a["pixel_values"].shape[1:])
    # Without pixels (latents cached elsewhere) the crop coordinates agree.
    assert view.example(wide, epoch=2, with_pixels=False)["crop_top_left"] == a["crop_top_left"]

    assert len(view.entries()) == scan.total_with_repeats == 5
    for batch_indices in view.sampler(batch_size=2).batches_for_epoch(0):
        batch = collate([view.example(i, 0) for i in batch_indices])
        assert batch["pixel_values"].shape[0] == len(batch_indices)
        assert len(batch["caption"]) == len(batch_indices)


# --------------------------------------------------------------------------- caches


class CountingEncoder:
    """A stand-in VAE: 8x downsampling, 4 channels; counts images it encodes."""

    def __init__(self, value: float | None = None) -> None:
        self.images = 0
        self.value = value

    def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
        self.images += pixel_values.shape[0]
        latents = pixel_values[:, :, ::8, ::8].mean(dim=1, keepdim=True).repeat(1, 4, 1, 1)
        return latents if self.value is None else torch.full_like(latents, self.value)


def cached_view(tmp_path: Path, **options) -> DatasetView:
    return view_of(scan_dataset(make_view_dataset(tmp_path)), 64, bucket_step=8, cache_latents=True, **options)


def test_latent_cache_hit_does_not_re_encode(tmp_path: Path) -> None:
    view = cached_view(tmp_path, random_crop=True, flip=True)
    assert view.fixed_augmentation and len(view.notes) == 2
    encoder = CountingEncoder()
    cache = LatentCache(model_id="vae-test")

    assert cache.build(view, encoder, batch_size=2, disable=True) == 3
    assert cache.build(view, encoder, disable=True) == 0
    assert encoder.images == 3

    example = view.example(0, epoch=5, with_pixels=False)
    assert "pixel_values" not in example
    latents = cache.get_batch([0, 0])
    assert latents.shape == (2, 4, *(size // 8 for size in example["target_size"]))
    batch = collate([example])
    assert batch["sizes"][0]["target_size"] == example["target_size"]


def test_latent_cache_on_disk_survives_new_instance(tmp_path: Path) -> None:
    view = cached_view(tmp_path)
    folder = tmp_path / "cache"
    first = LatentCache(folder, model_id="vae-test")
    first.build(view, CountingEncoder(), disable=True)
    expected = first.get(1)
    assert len(list(folder.glob("*.safetensors"))) == 3

    encoder = CountingEncoder()
    second = LatentCache(folder, model_id="vae-test")
    assert second.build(view, encoder, disable=True) == 0
    assert torch.equal(second.get(1), expected)
    assert encoder.images == 0

    # Another VAE must not reuse the entries, and an edited image is re-encoded.
    assert LatentCache(folder, model_id="other-vae").build(view, CountingEncoder(), disable=True) == 3
    edited = view.items[1].path
    save_rgb(edited, size=(view.items[1].width, view.items[1].height), color=(1, 2, 3))
    stat = edited.stat()  # make the edit visible even on filesystems with coarse timestamps
    os.utime(edited, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))
    assert LatentCache(folder, model_id="vae-test").build(view, CountingEncoder(), disable=True) == 1


def test_nan_latent_raises_naming_the_file(tmp_path: Path) -> None:
    view = cached_view(tmp_path)
    with pytest.raises(NonFiniteCacheError) as info:
        LatentCache(model_id="vae-test").build(view, CountingEncoder(value=float("nan")), disable=True)
    assert info.value.path in {item.path for item in view.items}
    assert str(info.value.path) in str(info.value)


def test_latent_cache_refuses_random_augmentation(tmp_path: Path) -> None:
    view = view_of(scan_dataset(make_view_dataset(tmp_path)), 64, bucket_step=8, random_crop=True)
    with pytest.raises(ValueError, match="random crop or flip"):
        LatentCache(model_id="vae-test").build(view, CountingEncoder(), disable=True)


def test_embedding_cache(tmp_path: Path) -> None:
    scan = scan_dataset(make_view_dataset(tmp_path), default_caption="photo")
    calls: list[list[str]] = []

    def encode(captions: list[str]) -> dict[str, torch.Tensor]:
        calls.append(captions)
        return {"prompt_embeds": torch.randn(len(captions), 3, 5), "pooled": torch.randn(len(captions), 5)}

    cache = EmbeddingCache(tmp_path / "emb", model_id="te-test")
    view = view_of(scan, 64, bucket_step=8, caption_dropout_rate=0.1)
    assert cache.build(view, encode, disable=True) == 3  # "char, a, b, c, d", "photo" and ""
    first = cache.get("photo")
    assert first["prompt_embeds"].shape == (3, 5)
    reopened = EmbeddingCache(tmp_path / "emb", model_id="te-test")
    assert torch.equal(reopened.get("photo")["pooled"], first["pooled"])
    assert reopened.get_batch(["photo", ""])["prompt_embeds"].shape == (2, 3, 5)
    assert len(calls) == 1

    with pytest.raises(ValueError, match="caption shuffle"):
        cache.build(view_of(scan, 64, bucket_step=8, shuffle_caption=True), encode, disable=True)


def test_view_from_config_maps_kohya_names(tmp_path: Path) -> None:
    from types import SimpleNamespace

    config = SimpleNamespace(
        resolution=64,
        enable_bucket=False,
        bucket_step=8,
        min_bucket_reso=32,
        max_bucket_reso=128,
        center_crop=True,
        random_flip=True,
        shuffle_caption=False,
        keep_tokens=1,
        caption_dropout_rate=0.0,
        caption_tag_dropout_rate=0.0,
        seed=1,
        cache_latents=True,
        masked_loss=True,
    )
    view = DatasetView(scan_dataset(make_view_dataset(tmp_path)), config)
    assert view.buckets == [(64, 64)] and set(view.item_buckets) == {(64, 64)}
    assert view.fixed_augmentation and view.notes  # flip was asked for, turned off by caching
