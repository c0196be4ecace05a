"""`python -m stabletune_core doctor DIR`: what is wrong with a dataset, before training (and after a run).

Before training: unreadable files; exact duplicates (same bytes) and near duplicates (perceptual hash: the
low frequencies of a 32x32 DCT, plus a coarse colour check so one layout in two colours is not a duplicate);
images much smaller than the training resolution; the bucket each image lands in and the crop it gets (with
`--previews DIR`, the crop itself: the pixels the model will see); captions missing, empty or longer than the
text encoder reads (tokens counted with the model family's own tokenizer); and the balance of kohya `N_name`
folders (images x repeats per epoch). After a run (`--run RUN`): the images ranked by how badly the model
fits them, from the run's own per-image losses (tools/image_losses.py).

The dataset is only read; previews and the JSON report go where the flags say, never into the dataset.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.families import FAMILY_CHOICES, TEXT_KNOBS, family_problems, text_options
from .common import progress, refuse
from ..runs.layout import RunPaths
from .image_losses import FLAG_RATIO, image_losses_path, rank_run

HASH_BITS = 64  # the picture hash's length (pHash: 8 x 8 DCT frequencies)
NEAR_DISTANCE = 10  # of 64 hash bits: resized, re-encoded or lightly edited copies of one picture
COLOUR_DISTANCE = 40.0  # mean absolute difference (0-255) of the 4x4 colour thumbnails
MAX_UPSCALE = 1.5  # "much smaller": the image must be enlarged more than this to cover its bucket
IMBALANCE = 3.0  # the largest folder's images x repeats over the smallest's
PREVIEW_SIDE = 256
SETTINGS = ("resolution", "enable_bucket", "bucket_step", "min_bucket_reso", "max_bucket_reso", "caption_extension",
            "default_caption", "center_crop", "pretrained_model_name_or_path", "model_family", "train_data_dir",
            *TEXT_KNOBS)


def add_parser(commands: Any) -> None:
    p = commands.add_parser("doctor", help="Check a dataset before training (duplicates, small images, buckets and "
                            "crops, captions vs the text encoder, folder balance) or rank a run's images by loss.")
    p.add_argument("folder", nargs="?", default=None, help="The dataset folder (default: the --config's or --run's).")
    p.add_argument("--config", default=None, help="A training config (TOML): its resolution, buckets, captions and "
                   "model are used.")
    p.add_argument("--run", default=None, help="A run folder: its config, and the per-image loss ranking of its "
                   "training.")
    p.add_argument("--resolution", type=int, default=None, help="Training resolution (default 512, or the config's).")
    p.add_argument("--no_buckets", action="store_true", help="Square crops only (enable_bucket off).")
    p.add_argument("--model", default=None, help="The base model (its tokenizer counts caption tokens).")
    p.add_argument("--family", choices=[f for f in FAMILY_CHOICES if f != "auto"], default=None,
                   help="Model family whose tokenizer counts tokens (default: detected from --model, else sd1; "
                   "flux2_klein needs --model, whose Qwen3 tokenizer counts).")
    p.add_argument("--caption_extension", "--caption-extension", default=None)
    p.add_argument("--max_sequence_length", "--max-sequence-length", type=int, default=None,
                   help="FLUX.2 Klein: the text length captions are counted against (default 512, or the config's).")
    p.add_argument("--previews", default=None, help="Write the crop each image trains on (JPEG, at most "
                   f"{PREVIEW_SIDE} px) into this new folder.")
    p.add_argument("--json", default=None, help="Also write the full report as JSON to this file.")
    p.add_argument("--near_distance", type=int, default=NEAR_DISTANCE,
                   help="Largest perceptual-hash distance (of 64 bits) counted as a near duplicate.")
    p.add_argument("--top", type=int, default=10, help="Lines per section on the console.")
    p.set_defaults(run_tool=run)


# ------------------------------------------------------------------------------------- perceptual hash
def _dct_matrix(n: int):
    import numpy as np

    k = np.arange(n)[:, None]
    matrix = np.cos(np.pi * (2 * np.arange(n)[None, :] + 1) * k / (2 * n)) * np.sqrt(2.0 / n)
    matrix[0] /= np.sqrt(2.0)
    return matrix


def perceptual_hash(image) -> tuple[int, Any]:
    """(64-bit pHash, 4x4 RGB thumbnail as float): the hash keeps the 8x8 lowest DCT frequencies of the 32x32
    grey image, each bit saying whether a frequency is above their median; the thumbnail tells colours apart."""
    import numpy as np
    from PIL import Image

    grey = np.asarray(image.convert("L").resize((32, 32), Image.Resampling.LANCZOS), dtype=np.float64)
    dct = _dct_matrix(32)
    low = (dct @ grey @ dct.T)[:8, :8].flatten()
    bits = low > np.median(low[1:])  # the DC term (overall brightness) would sway the median
    value = 0
    for bit in bits:
        value = (value << 1) | int(bit)
    colour = np.asarray(image.convert("RGB").resize((4, 4), Image.Resampling.BOX), dtype=np.float64)
    return value, colour


def near_pairs(hashes: list[int], colours: list[Any], max_distance: int) -> list[tuple[int, int, int]]:
    """(i, j, distance) of every pair within `max_distance` bits and of similar colour."""
    import numpy as np

    values = np.array(hashes, dtype=np.uint64)
    pairs = []
    for i in range(len(values) - 1):
        distances = np.bitwise_count(values[i + 1:] ^ values[i])
        for offset in np.nonzero(distances <= max_distance)[0]:
            j = i + 1 + int(offset)
            if float(np.abs(colours[i] - colours[j]).mean()) <= COLOUR_DISTANCE:
                pairs.append((i, j, int(distances[offset])))
    return pairs


def _groups(pairs: list[tuple[int, int]], n: int) -> list[list[int]]:
    """Connected groups (of two or more) of the pairs' indices."""
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in pairs:
        parent[root(i)] = root(j)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(root(i), []).append(i)
    return [g for g in groups.values() if len(g) > 1]


# ---------------------------------------------------------------------------------------- settings
@dataclass
class Settings:
    folder: Path
    resolution: int = 512
    enable_bucket: bool = True
    bucket_step: int = 64
    min_bucket_reso: int = 256
    max_bucket_reso: int = 1024
    caption_extension: str = ".txt"
    default_caption: str = ""
    center_crop: bool = False
    model: str = ""
    family: str = "sd1"
    #: How the run encodes prompts (config/families.text_options: a Klein run's max_sequence_length), handed to the
    #: family's caption_tokens as its load() gets them, so captions are counted against the length the run reads.
    text_options: dict[str, Any] = field(default_factory=dict)


def settings_from(args: argparse.Namespace) -> Settings:
    """Flags over the config's (or the run's) values over TrainConfig's defaults."""
    from ..config import TrainConfig, read_toml

    values = {name: TrainConfig.model_fields[name].default for name in SETTINGS}
    config = args.config or (str(RunPaths(args.run).config) if args.run else None)
    if args.run and not Path(args.run).is_dir():
        raise refuse(f"The run folder {args.run} does not exist; give a folder that StableTune trained into.")
    if config:
        values.update({k: v for k, v in read_toml(config).items() if k in SETTINGS})
    folder = args.folder or values.get("train_data_dir")
    if not folder:
        raise refuse("Give the dataset folder to check (or --config / --run of a training that names one).")
    model = args.model or values.get("pretrained_model_name_or_path") or ""
    family = args.family or (values["model_family"] if values.get("model_family") not in (None, "auto") else None)
    if family is None:
        from ..models import detect_family

        family = detect_family(model) if model and Path(model).expanduser().exists() else "sd1"
    if args.max_sequence_length is not None:
        values["max_sequence_length"] = args.max_sequence_length
    resolution = values["resolution"] if args.resolution is None else args.resolution  # 0 is a value, not unset
    settings = Settings(Path(folder).expanduser(), int(resolution),
                        bool(values["enable_bucket"]) and not args.no_buckets, int(values["bucket_step"]),
                        int(values["min_bucket_reso"]), int(values["max_bucket_reso"]),
                        args.caption_extension or values["caption_extension"], values["default_caption"] or "",
                        bool(values["center_crop"]), model, family, text_settings(values, family))
    if settings.resolution % settings.bucket_step:
        raise refuse(f"--resolution {settings.resolution} is not a multiple of the bucket step "
                     f"{settings.bucket_step}; use {settings.resolution // settings.bucket_step * settings.bucket_step}.")
    return settings


def text_settings(values: dict[str, Any], family: str) -> dict[str, Any]:
    """The text knobs of `values` as the family's load() would get them (families.text_options), checked as a run
    checks them: out of range, or set on a family without them, is refused in the run's own sentence."""
    from ..config import build_config

    config = build_config({name: values[name] for name in TEXT_KNOBS})
    problems = family_problems(config, family)
    if problems:
        raise refuse(problems[0])
    return text_options(config)


def caption_counter(settings: Settings) -> tuple[Any, int, str]:
    """(count, limit, where): the family's caption token count and how many tokens its text encoder reads
    (models/base.py `caption_tokens`: SD's CLIP tokenizers, FLUX.2 Klein's Qwen3 chat prompt at the run's
    max_sequence_length), from the model when one is given, else the family's shipped config tree."""
    from ..models import ModelLoadError, get_family

    model = Path(settings.model).expanduser() if settings.model else None
    try:
        return get_family(settings.family).caption_tokens(model, **settings.text_options)
    except ModelLoadError as exc:
        raise refuse(str(exc)) from None


# ---------------------------------------------------------------------------------------- report
@dataclass
class Report:
    root: str
    settings: dict[str, Any]
    images: int = 0
    unreadable: list[dict[str, str]] = field(default_factory=list)
    exact_duplicates: list[list[str]] = field(default_factory=list)
    near_duplicates: list[dict[str, Any]] = field(default_factory=list)
    small: list[dict[str, Any]] = field(default_factory=list)
    long_names: list[str] = field(default_factory=list)  # images too long-named for a NAME.mask.png beside them
    buckets: list[dict[str, Any]] = field(default_factory=list)
    items: list[dict[str, Any]] = field(default_factory=list)
    captions: dict[str, Any] = field(default_factory=dict)
    folders: list[dict[str, Any]] = field(default_factory=list)
    balance: str | None = None
    loss_ranking: dict[str, Any] | None = None
    problems: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def crop_of(width: int, height: int, bucket: tuple[int, int]) -> dict[str, Any]:
    """Where the (centred) crop lands in the original image, the share of the image it keeps, the upscale."""
    from ..data import crop_geometry

    (scaled_w, scaled_h), (top, left) = crop_geometry(width, height, bucket, random_crop=False, rng=None)
    sx, sy = scaled_w / width, scaled_h / height
    box = [round(left / sx), round(top / sy), round((left + bucket[0]) / sx), round((top + bucket[1]) / sy)]
    return {"crop": box, "kept": bucket[0] * bucket[1] / (scaled_w * scaled_h), "upscale": max(sx, sy),
            "spare": [scaled_w - bucket[0], scaled_h - bucket[1]]}


def folder_balance(items: list[Any], root: Path) -> tuple[list[dict[str, Any]], str | None]:
    """Images, repeats and share of an epoch per top-level folder; a note when they are far apart."""
    folders: dict[str, dict[str, Any]] = {}
    for item in items:
        relative = item.path.relative_to(root)
        name = relative.parts[0] if len(relative.parts) > 1 else "."
        entry = folders.setdefault(name, {"folder": name, "images": 0, "repeats": item.repeats, "per_epoch": 0})
        entry["images"] += 1
        entry["per_epoch"] += item.repeats
    rows = sorted(folders.values(), key=lambda r: r["folder"])
    total = sum(r["per_epoch"] for r in rows) or 1
    for row in rows:
        row["share"] = row["per_epoch"] / total
    if len(rows) < 2:
        return rows, None
    big = max(rows, key=lambda r: r["per_epoch"])
    small = min(rows, key=lambda r: r["per_epoch"])
    for row in rows:
        row["balanced_repeats"] = max(1, round(big["per_epoch"] / row["images"]))
    if big["per_epoch"] < IMBALANCE * small["per_epoch"]:
        return rows, None
    note = (f"Folder {big['folder']} gives {big['per_epoch']} images per epoch and {small['folder']} only "
            f"{small['per_epoch']} ({big['per_epoch'] / small['per_epoch']:.1f}x): the LoRA will mostly learn "
            f"{big['folder']}; rename {small['folder']} to {small['balanced_repeats']}_"
            f"{small['folder'].split('_', 1)[-1] if small['folder'][0].isdigit() else small['folder']} to balance "
            "them.")
    return rows, note


def examine(settings: Settings, *, previews: Path | None = None, near_distance: int = NEAR_DISTANCE,
            run_dir: Path | None = None) -> Report:
    """The whole check; reads the dataset, writes only previews (when asked)."""
    from ..data import DatasetError, assign_bucket, load_image, make_buckets, resize_and_crop, scan_dataset
    from ..data.images import UnreadableImageError
    from ..data.filenames import is_file
    from ..data.masks import mask_name_too_long
    from .captions import caption_path

    try:
        scan = scan_dataset(settings.folder, settings.default_caption, settings.caption_extension)
    except DatasetError as exc:
        raise refuse(str(exc)) from None
    if settings.enable_bucket:
        buckets = make_buckets(settings.resolution, settings.min_bucket_reso, settings.max_bucket_reso,
                               settings.bucket_step)
    else:
        buckets = [(settings.resolution, settings.resolution)]
    count_tokens, limit, tokenizer_name = caption_counter(settings)
    report = Report(str(scan.root), {k: str(v) for k, v in settings.__dict__.items()}, images=len(scan.items),
                    unreadable=[{"path": str(s.path), "reason": s.reason} for s in scan.skipped])
    if previews is not None:
        previews.mkdir(parents=True)
    digests: dict[str, list[str]] = {}
    hashes, colours, paths = [], [], []
    missing, empty, too_long = [], [], []
    for item in progress(scan.items, len(scan.items), "checking"):
        path = str(item.path)
        digests.setdefault(hashlib.sha256(item.path.read_bytes()).hexdigest(), []).append(path)
        bucket = assign_bucket(item.width, item.height, buckets)
        entry = {"path": path, "width": item.width, "height": item.height, "bucket": list(bucket),
                 "repeats": item.repeats, **crop_of(item.width, item.height, bucket)}
        try:
            with load_image(item.path) as image:
                value, colour = perceptual_hash(image)
                hashes.append(value)
                colours.append(colour)
                paths.append(path)
                if previews is not None:
                    entry["preview"] = str(_write_preview(image, bucket, previews, item.path, scan.root,
                                                          resize_and_crop))
        except UnreadableImageError as exc:  # changed since the scan
            report.unreadable.append({"path": path, "reason": exc.reason})
            continue
        text_file = caption_path(item.path, settings.caption_extension)
        text = text_file.read_text(encoding="utf-8-sig").strip() if is_file(text_file) else None
        if mask_name_too_long(item.path):
            report.long_names.append(path)
        if text is None:
            entry["caption"] = "missing"
            missing.append(path)
        elif not text:
            entry["caption"] = "empty"
            empty.append(path)
        else:
            tokens = count_tokens(text)
            entry["tokens"] = tokens
            entry["caption"] = "too long" if tokens > limit else "ok"
            if tokens > limit:
                too_long.append({"path": path, "tokens": tokens})
        if entry["upscale"] > MAX_UPSCALE:
            report.small.append({k: entry[k] for k in ("path", "width", "height", "bucket", "upscale")})
        report.items.append(entry)
    report.exact_duplicates = [group for group in digests.values() if len(group) > 1]
    exact = {p for group in report.exact_duplicates for p in group[1:]}
    pairs = [(i, j, d) for i, j, d in near_pairs(hashes, colours, near_distance)
             if paths[i] not in exact and paths[j] not in exact]
    distance = {(i, j): d for i, j, d in pairs}
    for group in _groups([(i, j) for i, j, _ in pairs], len(paths)):
        worst = max(d for (i, j), d in distance.items() if i in group and j in group)
        report.near_duplicates.append({"paths": [paths[i] for i in group], "distance": worst})
    counts: dict[str, int] = {}
    for entry in report.items:
        key = f"{entry['bucket'][0]}x{entry['bucket'][1]}"
        counts[key] = counts.get(key, 0) + entry["repeats"]
    report.buckets = [{"bucket": k, "images": n} for k, n in sorted(counts.items())]
    report.captions = {"missing": missing, "empty": empty, "too_long": too_long, "limit": limit,
                       "tokenizer": tokenizer_name, "default_caption": settings.default_caption}
    report.folders, report.balance = folder_balance([i for i in scan.items if not i.is_reg], scan.root)
    if run_dir is not None:
        ranking = rank_run(run_dir)
        report.loss_ranking = None if ranking is None else {
            "run": str(run_dir), "flag_ratio": FLAG_RATIO,
            "images": [{"path": s.path, "score": s.score, "samples": s.samples, "mean_loss": s.mean_loss,
                        "flagged": s.flagged} for s in ranking]}
    report.problems = problems(report)
    return report


def _write_preview(image, bucket, folder: Path, path: Path, root: Path, resize_and_crop) -> Path:
    """The crop the model trains on (the engine's own resize and centred crop), at most PREVIEW_SIDE px."""
    from PIL import Image

    pixels, _, _ = resize_and_crop(image, tuple(bucket), random_crop=False)
    array = ((pixels.permute(1, 2, 0).numpy() + 1.0) * 127.5).clip(0, 255).round().astype("uint8")
    crop = Image.fromarray(array)
    crop.thumbnail((PREVIEW_SIDE, PREVIEW_SIDE))
    target = folder / path.relative_to(root).with_suffix(".jpg")
    target.parent.mkdir(parents=True, exist_ok=True)
    crop.save(target, quality=90)
    return target


def problems(report: Report) -> list[str]:
    """One sentence per kind of problem found (what the console and the UI put first)."""
    out = []
    if report.unreadable:
        out.append(f"{len(report.unreadable)} file(s) cannot be read and will be skipped.")
    if report.exact_duplicates:
        extra = sum(len(g) - 1 for g in report.exact_duplicates)
        out.append(f"{extra} image(s) are byte-for-byte copies of another; each copy trains that image again.")
    if report.near_duplicates:
        out.append(f"{len(report.near_duplicates)} group(s) of near-duplicate images (same picture resized, "
                   "re-encoded or lightly edited).")
    if report.small:
        out.append(f"{len(report.small)} image(s) are much smaller than the {report.settings['resolution']} px "
                   f"training resolution (enlarged more than {MAX_UPSCALE}x): expect blur.")
    if report.long_names:
        out.append(f"{len(report.long_names)} image name(s) are too long for a mask file beside them (NAME.mask.png "
                   "would pass the file system's limit of 255 bytes a name); such an image's mask goes in "
                   "masks/NAME.png, or shorten its name.")
    captions = report.captions
    if captions.get("missing"):
        fallback = (f"they train with the default caption '{captions['default_caption']}'"
                    if captions.get("default_caption") else "they train with an empty caption")
        out.append(f"{len(captions['missing'])} image(s) have no caption file; {fallback}.")
    if captions.get("empty"):
        out.append(f"{len(captions['empty'])} caption file(s) are empty.")
    if captions.get("too_long"):
        out.append(f"{len(captions['too_long'])} caption(s) are longer than the {captions['limit']} tokens the text "
                   "encoder reads; the rest is cut off.")
    if report.balance:
        out.append(report.balance)
    ranking = report.loss_ranking
    if ranking:
        flagged = [i for i in ranking["images"] if i["flagged"]]
        if flagged:
            out.append(f"{len(flagged)} image(s) kept a loss {FLAG_RATIO}x above the typical one at the same noise "
                       "level: the model cannot fit them (check their captions, crops and quality).")
    return out


def console(report: Report, top: int) -> str:
    lines = [f"Dataset {report.root}: {report.images} image(s)."]
    lines += [f"! {p}" for p in report.problems] or ["No problems found."]

    def section(title: str, rows: list[str]) -> None:
        if rows:
            lines.append(f"\n{title}:")
            lines.extend(f"  {r}" for r in rows[:top])
            if len(rows) > top:
                lines.append(f"  ... and {len(rows) - top} more (--json has them all)")

    section("Unreadable", [f"{u['path']}: {u['reason']}" for u in report.unreadable])
    section("Exact duplicates", [" = ".join(g) for g in report.exact_duplicates])
    section("Near duplicates", [f"{' ~ '.join(g['paths'])} (distance {g['distance']})" for g in report.near_duplicates])
    section("Much smaller than the resolution", [f"{s['path']}: {s['width']}x{s['height']} -> bucket "
                                                 f"{s['bucket'][0]}x{s['bucket'][1]} ({s['upscale']:.1f}x)"
                                                 for s in report.small])
    section("Names too long for a mask beside them", report.long_names)
    section("Captions too long", [f"{c['path']}: {c['tokens']} tokens (limit {report.captions['limit']})"
                                  for c in report.captions["too_long"]])
    section("No caption file", report.captions["missing"])
    section("Empty caption", report.captions["empty"])
    section("Buckets (images per epoch)", [f"{b['bucket']}: {b['images']}" for b in report.buckets])
    cropped = sorted((i for i in report.items if i["kept"] < 0.8), key=lambda i: i["kept"])
    section("Most cropped (share of the image the model sees)",
            [f"{i['path']}: {i['kept']:.0%} in bucket {i['bucket'][0]}x{i['bucket'][1]}" for i in cropped])
    if len(report.folders) > 1:
        section("Folders", [f"{f['folder']}: {f['images']} images x {f['repeats']} = {f['per_epoch']} per epoch "
                            f"({f['share']:.0%})" for f in report.folders])
    if report.loss_ranking is not None:
        section("Hardest images to fit (loss vs the typical loss at the same noise level)",
                [f"{i['path']}: {i['score']:.2f}x over {i['samples']} samples" + ("  <- cannot fit" if i["flagged"]
                                                                                    else "")
                 for i in report.loss_ranking["images"]])
    return "\n".join(lines)


def check_numbers(args: argparse.Namespace) -> None:
    """The doctor's numbers, checked as the training flags are (the resolution by TrainConfig's own rule)."""
    from ..config import ConfigError, build_config

    if args.resolution is not None:
        try:
            build_config({"resolution": args.resolution})
        except ConfigError as exc:
            raise refuse(exc.problems[0]) from None
    if not 0 <= args.near_distance <= HASH_BITS:
        raise refuse(f"--near_distance {args.near_distance} is not a distance between picture hashes; give a whole "
                     f"number from 0 (exact copies only) to {HASH_BITS}, e.g. {NEAR_DISTANCE}.")
    if args.top < 1:
        raise refuse(f"--top {args.top} is not a number of lines; give a whole number of 1 or more.")


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)  # first: its bucket-step sentence is the more useful one for a resolution
    check_numbers(args)
    if args.json:
        report_file = Path(args.json).expanduser()
        if report_file.is_dir() or not report_file.parent.is_dir():
            raise refuse(f"--json {report_file} is not a file in an existing folder; give the path of the JSON "
                         "report to write.")
    run_dir = Path(args.run).expanduser() if args.run else None
    if run_dir is not None and not image_losses_path(run_dir).is_file():
        print(f"note: {run_dir} has no per-image losses ({image_losses_path(run_dir).relative_to(run_dir)}); "
              "the loss ranking needs a run that recorded them.")
    previews = Path(args.previews).expanduser() if args.previews else None
    if previews is not None and previews.exists():
        raise refuse(f"{previews} already exists; give --previews a new folder (the doctor never writes over "
                     "files).")
    if previews is not None and previews.resolve().is_relative_to(settings.folder.resolve()):
        raise refuse(f"--previews {previews} is inside the dataset, where it would become training images; "
                     "choose a folder outside it.")
    report = examine(settings, previews=previews, near_distance=args.near_distance, run_dir=run_dir)
    print(console(report, args.top))
    if args.json:
        from ..atomic import write_text_atomic

        write_text_atomic(Path(args.json).expanduser(), json.dumps(report.as_json(), indent=1))
    return 0
