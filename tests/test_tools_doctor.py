"""`doctor` (issue 26.3): duplicates, small images, buckets and crops (with previews of what the model sees),
captions against the text encoder's token limit, folder balance, and after a run the per-image loss ranking."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import tomli_w
from PIL import Image

from stabletune_core.cli import main
from stabletune_core.runs.jsonfiles import append_jsonl
from stabletune_core.tools.image_losses import Sample, image_losses_path, loss_record, rank_images
from tests.tools_helpers import tree_bytes


def blobs(seed: int, size: tuple[int, int]) -> Image.Image:
    """A smooth random picture (8x8 noise enlarged): its low frequencies survive resizing and JPEG."""
    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    return small.resize(size, Image.Resampling.BICUBIC)


@pytest.fixture
def dataset(tmp_path) -> Path:
    root = tmp_path / "data"
    subject, style = root / "10_subject", root / "1_style"
    subject.mkdir(parents=True)
    style.mkdir()
    blobs(1, (64, 64)).save(subject / "a.png")
    shutil.copy(subject / "a.png", subject / "a_copy.png")
    blobs(1, (64, 64)).resize((48, 48), Image.Resampling.LANCZOS).save(subject / "a_small.jpg", quality=90)
    blobs(2, (64, 96)).save(subject / "b.png")
    blobs(3, (16, 16)).save(subject / "tiny.png")
    blobs(4, (80, 64)).save(style / "c.png")
    (subject / "a.txt").write_text("mychar, smile\n")
    (subject / "b.txt").write_text(" ".join(["a very long description of the picture"] * 15) + "\n")
    (subject / "tiny.txt").write_text("\n")
    (root / "broken.png").write_bytes(b"not an image")
    return root


@pytest.fixture
def config(tmp_path, dataset) -> Path:
    path = tmp_path / "train.toml"
    path.write_text(tomli_w.dumps({"train_data_dir": str(dataset), "resolution": 64, "bucket_step": 8,
                                   "min_bucket_reso": 32, "max_bucket_reso": 128}))
    return path


def console_sections(out: str) -> dict[str, list[str]]:
    """The doctor's console listing: each heading ("Unreadable:") with the indented lines under it."""
    sections: dict[str, list[str]] = {}
    heading = None
    for line in out.splitlines():
        if line.endswith(":") and not line.startswith((" ", "!")):
            heading = line[:-1]
            sections[heading] = []
        elif line.startswith("  ") and heading is not None:
            sections[heading].append(line.strip())
        elif not line.strip():
            heading = None
    return sections


def test_doctor_finds_what_is_wrong_and_leaves_the_dataset_alone(dataset, config, tmp_path, capsys):
    before = tree_bytes(dataset)
    previews, report_file = tmp_path / "previews", tmp_path / "report.json"
    assert main(["doctor", "--config", str(config), "--previews", str(previews), "--json", str(report_file)]) == 0
    out = capsys.readouterr().out
    report = json.loads(report_file.read_text())
    assert tree_bytes(dataset) == before
    s = str(dataset / "10_subject")
    assert report["images"] == 6 and [u["path"] for u in report["unreadable"]] == [str(dataset / "broken.png")]
    assert report["exact_duplicates"] == [[f"{s}/a.png", f"{s}/a_copy.png"]]
    assert [g["paths"] for g in report["near_duplicates"]] == [[f"{s}/a.png", f"{s}/a_small.jpg"]]
    assert [(x["path"], x["upscale"]) for x in report["small"]] == [(f"{s}/tiny.png", 4.0)]
    # captions: counted with SD1's CLIP tokenizer, 75 tokens after the start and end tokens
    captions = report["captions"]
    assert captions["limit"] == 75 and "Stable Diffusion 1.x" in captions["tokenizer"]
    assert [c["path"] for c in captions["too_long"]] == [f"{s}/b.png"] and captions["too_long"][0]["tokens"] > 75
    assert captions["empty"] == [f"{s}/tiny.png"]
    assert sorted(captions["missing"]) == [f"{s}/a_copy.png", f"{s}/a_small.jpg", str(dataset / "1_style/c.png")]
    items = {Path(i["path"]).name: i for i in report["items"]}
    assert items["a.png"]["tokens"] == 4 and items["a.png"]["caption"] == "ok"  # my|char|,|smile
    # b (64 x 96, 2:3) lands in the 48 x 80 bucket (3:5); its centred crop cuts a little of each side
    b = items["b.png"]
    width, height = b["bucket"]
    assert (width, height) == (48, 80) and b["crop"] == [4, 0, 60, 96] and b["kept"] == pytest.approx(48 / 54)
    preview = Image.open(b["preview"])
    assert preview.size == (width, height) and Path(b["preview"]).is_relative_to(previews)
    from stabletune_core.data import load_image, resize_and_crop

    pixels, _, _ = resize_and_crop(load_image(dataset / "10_subject/b.png"), (width, height), random_crop=False)
    seen = ((pixels.permute(1, 2, 0).numpy() + 1) * 127.5)
    assert np.abs(np.asarray(preview, dtype=np.float32) - seen).mean() < 4  # the same pixels, up to JPEG
    assert sum(row["images"] for row in report["buckets"]) == 5 * 10 + 1
    # balance: 5 images x 10 repeats against 1 x 1
    assert "rename 1_style to 50_style" in report["balance"]
    # The console says the same as the report, each finding under its heading with the files it is about, and
    # the summary line counts what the section lists.
    sections = console_sections(out)
    assert sections["Unreadable"] == [f"{dataset / 'broken.png'}: Cannot read image {dataset / 'broken.png'}: it is "
                                      "not an image file or its format is not supported."]
    assert sections["Exact duplicates"] == [f"{s}/a.png = {s}/a_copy.png"]
    assert sections["Near duplicates"] == [f"{s}/a.png ~ {s}/a_small.jpg (distance 0)"]
    assert sections["Much smaller than the resolution"] == [f"{s}/tiny.png: 16x16 -> bucket 64x64 (4.0x)"]
    assert sections["Captions too long"] == [f"{s}/b.png: {captions['too_long'][0]['tokens']} tokens (limit 75)"]
    assert sections["No caption file"] == [f"{s}/a_copy.png", f"{s}/a_small.jpg", str(dataset / "1_style/c.png")]
    assert sections["Empty caption"] == [f"{s}/tiny.png"]
    assert sections["Buckets (images per epoch)"] == ["48x80: 10", "64x64: 40", "72x56: 1"]
    summary = {line for line in out.splitlines() if line.startswith("! ")}
    for count, words in ((1, "cannot be read"), (1, "byte-for-byte copies"), (1, "near-duplicate"),
                         (1, "much smaller"), (3, "no caption file"), (1, "caption file(s) are empty"),
                         (1, "longer than the 75")):
        assert [line for line in summary if words in line and line.startswith(f"! {count} ")], (count, words)
    assert any("rename 1_style to 50_style" in line for line in summary)


def test_sdxl_family_counts_with_both_tokenizers(dataset, config, tmp_path):
    report_file = tmp_path / "report.json"
    assert main(["doctor", "--config", str(config), "--family", "sdxl", "--json", str(report_file)]) == 0
    captions = json.loads(report_file.read_text())["captions"]
    assert captions["limit"] == 75 and "Stable Diffusion XL" in captions["tokenizer"]


def write_losses(run: Path, records: list[dict]) -> None:
    image_losses_path(run).parent.mkdir(parents=True)
    for record in records:
        append_jsonl(image_losses_path(run), record)


def synthetic_run(paths: list[str], hard: str, early: str, steps: int = 60, seed: int = 0) -> list[dict]:
    """Loss depends on the timestep (10x at t < 200); `hard` is fitted 2.5x worse than the rest; `early` is
    always drawn at small timesteps (high raw loss, yet fitted like the rest)."""
    rng = random.Random(seed)
    records = []
    for step in range(1, steps + 1):
        batch = rng.sample(paths, 4)
        timesteps = [rng.randrange(0, 200) if p == early else rng.randrange(0, 1000) for p in batch]
        losses = [(0.5 if t < 200 else 0.05) * (2.5 if p == hard else 1.0) * rng.uniform(0.8, 1.25)
                  for p, t in zip(batch, timesteps)]
        records.append(loss_record(step, batch, losses, timesteps))
    return records


def test_loss_ranking_points_at_the_image_the_model_cannot_fit(tmp_path):
    paths = [f"/data/img{i}.png" for i in range(10)]
    records = synthetic_run(paths, hard="/data/img3.png", early="/data/img7.png")
    samples = [Sample(r["step"], p, v, t, False) for r in records
               for p, v, t in zip(r["paths"], r["losses"], r["timesteps"])]
    ranking = rank_images(samples)
    assert ranking[0].path == "/data/img3.png" and ranking[0].flagged and 2.0 < ranking[0].score < 3.0
    assert [s.path for s in ranking if s.flagged] == ["/data/img3.png"]
    early = next(s for s in ranking if s.path == "/data/img7.png")
    assert not early.flagged and early.mean_loss > 3 * ranking[-1].mean_loss  # raw loss high, fit typical
    # without timesteps the raw loss would have blamed the image drawn at small timesteps
    untimed = rank_images([Sample(s.step, s.path, s.loss, None, False) for s in samples])
    assert untimed[0].path == "/data/img7.png"
    with pytest.raises(ValueError, match="one each per sample"):
        loss_record(1, ["a"], [0.1, 0.2], [5])


def test_doctor_run_ranks_the_runs_images(dataset, config, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(config.read_text())
    images = sorted(str(p) for p in dataset.rglob("*.png") if p.name != "broken.png")
    write_losses(run, synthetic_run(images, hard=images[1], early=images[0]))
    with open(image_losses_path(run), "a") as f:
        f.write('{"step": 61, "paths": ["x"]')  # a half-written last line is ignored
    report_file = tmp_path / "report.json"
    assert main(["doctor", "--run", str(run), "--json", str(report_file)]) == 0
    ranking = json.loads(report_file.read_text())["loss_ranking"]
    assert ranking["images"][0]["path"] == images[1] and ranking["images"][0]["flagged"]
    assert "cannot fit" in capsys.readouterr().out


def test_doctor_refusals(dataset, config, tmp_path, capsys):
    assert main(["doctor", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["doctor", "--config", str(config), "--previews", str(dataset / "previews")]) == 2
    assert "inside the dataset" in capsys.readouterr().err and not (dataset / "previews").exists()
    assert main(["doctor", "--config", str(config), "--previews", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["doctor", "--run", str(tmp_path / "no-run")]) == 2
    assert capsys.readouterr().err.strip().startswith("error: The run folder")
    assert main(["doctor", str(dataset), "--resolution", "100"]) == 2
    assert "not a multiple of the bucket step 64" in capsys.readouterr().err


def test_a_real_run_records_per_image_losses_that_the_doctor_ranks(tiny_model, small_config, shapes_dataset,
                                                                    tmp_path, capsys):
    """Issue 26.3, after a run: the engine writes RUN/diagnostics/image_losses.jsonl from its own per-image losses
    (one line per step, every image of the step with its unweighted loss and timestep), and `doctor --run RUN`
    ranks the run's images from it."""
    import torch

    from stabletune_core.tools.image_losses import read_samples
    from stabletune_core.train.loop import train

    run = tmp_path / "run"
    config = small_config(tiny_model, run, max_train_steps=6, validation_loss_every=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(config)
    finally:
        torch.set_num_threads(threads)
    lines = [json.loads(line) for line in image_losses_path(run).read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]
    dataset_images = {str(p) for p in shapes_dataset.rglob("*.png")}
    for record in lines:
        assert len(record["paths"]) == len(record["losses"]) == len(record["timesteps"]) == 4
        assert set(record["paths"]) <= dataset_images and not any(record["reg"])
        assert all(0 <= t < 1000 for t in record["timesteps"]) and all(v > 0 for v in record["losses"])

    report_file = tmp_path / "report.json"
    assert main(["doctor", "--run", str(run), "--json", str(report_file)]) == 0
    ranking = json.loads(report_file.read_text())["loss_ranking"]["images"]
    seen = {s.path for s in read_samples(image_losses_path(run))}
    assert {i["path"] for i in ranking} == seen and len(seen) >= 6
    assert [i["score"] for i in ranking] == sorted((i["score"] for i in ranking), reverse=True)
    late = [r for r in lines if r["step"] > 3.5]  # the ranking reads the run's second half when it saw most images
    late = late if len({p for r in late for p in r["paths"]}) * 2 >= len(seen) else lines
    for image in ranking:  # each image's mean is the mean of its own recorded losses
        own = [v for r in late for p, v in zip(r["paths"], r["losses"]) if p == image["path"]]
        assert image["samples"] == len(own) and image["mean_loss"] == pytest.approx(sum(own) / len(own))
    assert "Hardest images to fit" in capsys.readouterr().out
