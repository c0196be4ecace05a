"""`python -m stabletune_core caption DIR --model MODEL`: write a caption beside every image.

Two kinds of captioner, chosen by what MODEL holds:

* a booru-style tagger of the WD14 family (SmilingWolf's `model.onnx` + `selected_tags.csv`), run with
  onnxruntime. The input is the taggers' layout: the image padded to a white square, resized to the model's
  side (448), BGR, float 0-255, NHWC. The CSV's rows are the model's outputs in order; category 9 is a rating
  (the most likely one is taken), 4 a character (its own threshold), 0 a general tag.
* a natural-language captioner through transformers (BLIP, Florence-2: any model transformers' image-text-to-
  text auto class loads without remote code), from a local folder; a hub id is downloaded only with
  `--allow_download`.

A caption goes to `NAME.txt` beside its image. An image that already has a caption file is left alone unless
`--overwrite` (or `--append`) asks; the old caption is then kept as `NAME.txt.bak` (`.bak2`, ... when that
exists). Unreadable images are listed, never touched. Every write is atomic.
"""
from __future__ import annotations

import argparse
import csv
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..atomic import write_text_atomic
from .common import check_writable, progress, refuse

TAGGER_MODEL, TAGGER_TAGS = "model.onnx", "selected_tags.csv"
RATING, GENERAL, CHARACTER = 9, 0, 4
DEFAULT_FLORENCE_TASK = "<MORE_DETAILED_CAPTION>"
ONNXRUNTIME_PIN = "onnxruntime==1.32.0"


def add_parser(commands: Any) -> None:
    p = commands.add_parser("caption", help="Caption every image of a folder with a WD14 tagger (ONNX) or a "
                            "transformers captioner (BLIP, Florence-2); writes NAME.txt beside each image.")
    p.add_argument("folder", help="The dataset folder (kohya N_name subfolders included).")
    p.add_argument("--model", required=True, help="A WD14 tagger folder (model.onnx + selected_tags.csv) or a "
                   "transformers captioner folder (config.json, weights, processor files).")
    p.add_argument("--prefix", default="", help="Trigger word(s) written first in every caption, e.g. 'mychar'.")
    p.add_argument("--overwrite", action="store_true",
                   help="Replace existing captions (each old one is kept as NAME.txt.bak).")
    p.add_argument("--append", action="store_true", help="Add the new tags/text after an existing caption "
                   "(tags it already has are not repeated; the old one is kept as NAME.txt.bak).")
    p.add_argument("--caption_extension", "--caption-extension", default=".txt")
    p.add_argument("--batch_size", "--batch-size", type=int, default=8)
    tags = p.add_argument_group("tagger (WD14 ONNX)")
    tags.add_argument("--threshold", "--general_threshold", type=float, default=0.35,
                      help="Smallest probability of a general tag that is written.")
    tags.add_argument("--character_threshold", type=float, default=0.85,
                      help="Smallest probability of a character tag that is written.")
    tags.add_argument("--exclude_tags", "--undesired_tags", default="",
                      help="Comma-separated tags never written (as the tagger spells them or with spaces).")
    tags.add_argument("--keep_tags", "--always_first_tags", default="", help="Comma-separated tags written first "
                      "when found, in this order (so keep_tokens keeps them in place while shuffling).")
    tags.add_argument("--keep_underscores", action="store_true", help="Write tags as the tagger spells them "
                      "(long_hair); by default underscores become spaces, except in short tags such as ^_^.")
    tags.add_argument("--rating", action="store_true", help="Also write the most likely rating tag (general, "
                      "sensitive, ...), last.")
    tags.add_argument("--character_first", action="store_true", help="Character tags before general tags.")
    nl = p.add_argument_group("captioner (transformers)")
    nl.add_argument("--prompt", default=None, help="Text the caption starts from (BLIP), or the task token "
                    f"(Florence-2, default {DEFAULT_FLORENCE_TASK}).")
    nl.add_argument("--max_new_tokens", type=int, default=75)
    nl.add_argument("--num_beams", type=int, default=3)
    nl.add_argument("--allow_download", action="store_true",
                    help="Let transformers download a hub id given as --model (off: local folders only).")
    p.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu or cuda.")
    p.set_defaults(run_tool=run)


# ----------------------------------------------------------------------------------------------- tags
@dataclass(frozen=True)
class Label:
    name: str
    category: int


@dataclass
class TagOptions:
    threshold: float = 0.35
    character_threshold: float = 0.85
    exclude: set[str] = field(default_factory=set)
    keep_first: list[str] = field(default_factory=list)
    keep_underscores: bool = False
    rating: bool = False
    character_first: bool = False


def split_tags(text: str) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def spell(tag: str, keep_underscores: bool) -> str:
    """long_hair -> long hair; tags of three characters or fewer are emoticons (^_^, >_<) and keep theirs."""
    return tag if keep_underscores or len(tag) <= 3 else tag.replace("_", " ")


def read_tag_table(path: Path) -> list[Label]:
    """The labels of selected_tags.csv (columns tag_id, name, category, count), in the model's output order."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise refuse(f"Cannot read the tag list {path} ({exc}); it should be the tagger's selected_tags.csv.")
    if not rows or not {"name", "category"} <= set(rows[0]):
        raise refuse(f"{path} has no 'name' and 'category' columns; it should be the tagger's selected_tags.csv "
                     "(tag_id,name,category,count).")
    try:
        return [Label(row["name"], int(row["category"])) for row in rows]
    except (TypeError, ValueError):
        raise refuse(f"{path} has a category that is not a number; it should be the tagger's selected_tags.csv.")


def _key(tag: str) -> str:
    """A tag's identity whatever its spelling: 'long hair' and 'long_hair' are one tag."""
    return tag.strip().replace(" ", "_")


def select_tags(probs: list[float], labels: list[Label], options: TagOptions) -> list[str]:
    """The tags one image gets, in the tagger's order (most common first), options applied."""
    excluded = {_key(t) for t in options.exclude}
    general, characters, ratings = [], [], []
    for p, label in zip(probs, labels):
        if label.category == RATING:
            ratings.append((p, label.name))
        elif label.category == CHARACTER and p >= options.character_threshold:
            characters.append(label.name)
        elif label.category not in (RATING, CHARACTER) and p >= options.threshold:
            general.append(label.name)
    tags = characters + general if options.character_first else general + characters
    if options.rating and ratings:
        tags.append(max(ratings)[1])
    tags = [t for t in tags if _key(t) not in excluded]
    order = [_key(k) for k in options.keep_first]
    first = sorted((t for t in tags if _key(t) in order), key=lambda t: order.index(_key(t)))
    return [spell(t, options.keep_underscores) for t in first + [t for t in tags if t not in first]]


class WD14Tagger:
    """A WD14-family ONNX tagger: `model.onnx` and `selected_tags.csv` in one folder."""

    def __init__(self, folder: Path, options: TagOptions, device: str = "auto") -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise refuse(f"The WD14 tagger needs onnxruntime, which is not installed: pip install "
                         f"{ONNXRUNTIME_PIN}") from None
        self.labels = read_tag_table(folder / TAGGER_TAGS)
        self.options = options
        settings = ort.SessionOptions()
        threads = os.environ.get("OMP_NUM_THREADS", "")
        settings.intra_op_num_threads = int(threads) if threads.isdigit() else 0
        available = ort.get_available_providers()
        providers = ["CPUExecutionProvider"]
        if device != "cpu" and "CUDAExecutionProvider" in available:
            providers.insert(0, "CUDAExecutionProvider")
        try:
            self.session = ort.InferenceSession(str(folder / TAGGER_MODEL), settings, providers=providers)
        except Exception as exc:  # onnxruntime raises its own types for a bad file
            raise refuse(f"{folder / TAGGER_MODEL} is not a model onnxruntime can load "
                         f"({str(exc).splitlines()[0][:160]}).") from None
        model_input = self.session.get_inputs()[0]
        self.input_name = model_input.name
        shape = list(model_input.shape)
        if len(shape) != 4 or 3 not in (shape[1], shape[3]):
            raise refuse(f"{folder / TAGGER_MODEL} takes input {shape}, not images; a WD14 tagger takes "
                         "[batch, 448, 448, 3].")
        self.channels_last = shape[3] == 3
        side = shape[1] if self.channels_last else shape[2]
        self.side = side if isinstance(side, int) and side > 0 else 448
        outputs = self.session.get_outputs()[0].shape
        if isinstance(outputs[-1], int) and outputs[-1] != len(self.labels):
            raise refuse(f"{folder / TAGGER_MODEL} predicts {outputs[-1]} labels but {TAGGER_TAGS} lists "
                         f"{len(self.labels)}; they come from different taggers.")

    def pixels(self, image) -> Any:
        """The WD14 input: padded to a white square, resized to the model's side, BGR float 0-255."""
        import numpy as np
        from PIL import Image

        side = max(image.size)
        square = Image.new("RGB", (side, side), (255, 255, 255))
        square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
        if side != self.side:
            square = square.resize((self.side, self.side), Image.Resampling.BICUBIC)
        array = np.asarray(square, dtype=np.float32)[:, :, ::-1]  # RGB -> BGR
        return array if self.channels_last else array.transpose(2, 0, 1)

    def __call__(self, images: list) -> list[str]:
        import numpy as np

        batch = np.ascontiguousarray(np.stack([self.pixels(image) for image in images]))
        probs = self.session.run(None, {self.input_name: batch})[0]
        return [", ".join(select_tags(row.tolist(), self.labels, self.options)) for row in probs]


# ------------------------------------------------------------------------------------- transformers
class TransformersCaptioner:
    """BLIP, Florence-2 or another image-to-text model transformers loads without remote code."""

    def __init__(self, source: str, *, allow_download: bool, device: str, prompt: str | None,
                 max_new_tokens: int, num_beams: int) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

        local = not allow_download
        try:
            config = AutoConfig.from_pretrained(source, local_files_only=local)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise refuse(f"{source} is not a transformers captioner transformers can read ({first[:160]}).") from None
        if getattr(config, "auto_map", None) and config.model_type not in _image_text_models():
            raise refuse(f"{source} needs its own Python code (trust_remote_code), which StableTune never runs; "
                         "use a transformers-native version of the model (e.g. a Florence-2 '-hf' conversion).")
        if config.model_type not in _image_text_models():
            raise refuse(f"{source} is a '{config.model_type}' model, not an image captioner; use BLIP or "
                         "Florence-2 (transformers' image-text-to-text models).")
        self.device = "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"
        dtype = torch.float16 if self.device == "cuda" else torch.float32
        try:
            self.processor = AutoProcessor.from_pretrained(source, local_files_only=local)
            self.model = AutoModelForImageTextToText.from_pretrained(source, local_files_only=local, dtype=dtype)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise refuse(f"Could not load the captioner in {source}: {first[:200]}") from None
        self.model.to(self.device).eval()
        self.is_florence = config.model_type.startswith("florence")
        self.prompt = prompt if prompt is not None else (DEFAULT_FLORENCE_TASK if self.is_florence else None)
        self.generate = {"max_new_tokens": max_new_tokens, "num_beams": num_beams, "do_sample": False}

    def __call__(self, images: list) -> list[str]:
        import torch

        kwargs: dict[str, Any] = {"images": images, "return_tensors": "pt"}
        if self.prompt:
            kwargs["text"] = [self.prompt] * len(images)
        inputs = self.processor(**kwargs).to(self.device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        with torch.inference_mode():
            ids = self.model.generate(**inputs, **self.generate)
        texts = self.processor.batch_decode(ids, skip_special_tokens=True)
        return [" ".join(text.split()).strip(" ,") for text in texts]


def _image_text_models() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


# -------------------------------------------------------------------------------------- captions
def model_kind(model: str, allow_download: bool) -> tuple[str, Path]:
    """("tagger" | "captioner", path) of what --model names; one sentence when it is neither."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".onnx":
        if not (path.parent / TAGGER_TAGS).is_file():
            raise refuse(f"{path.parent} has no {TAGGER_TAGS} beside {path.name}; a WD14 tagger needs both files.")
        if path.name != TAGGER_MODEL:
            raise refuse(f"Give the tagger's folder holding {TAGGER_MODEL} and {TAGGER_TAGS} as the captioning model "
                         "(--model), not one of its files.")
        return "tagger", path.parent
    if path.is_dir():
        if (path / TAGGER_MODEL).is_file():
            if not (path / TAGGER_TAGS).is_file():
                raise refuse(f"{path} has {TAGGER_MODEL} but no {TAGGER_TAGS}; a WD14 tagger needs both files.")
            return "tagger", path
        if (path / "config.json").is_file():
            return "captioner", path
        raise refuse(f"{path} holds neither a WD14 tagger ({TAGGER_MODEL} + {TAGGER_TAGS}) nor a transformers "
                     "captioner (config.json); give the folder of one of them as the captioning model (--model).")
    hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if hub_id and allow_download:
        return "captioner", path
    hint = " (a hub id is downloaded only with --allow_download)" if hub_id else ""
    raise refuse(f"The captioning model folder {model} does not exist{hint}; give a local WD14 tagger folder "
                 "(model.onnx + selected_tags.csv) or a transformers captioner folder as the captioning model "
                 "(--model).")


def compose(generated: str, *, prefix: str, existing: str | None, append: bool, tags: bool) -> str:
    """The caption to write: the prefix's words first, then (with --append) the existing caption, then the new
    tags (those not there yet) or the new sentence."""
    if tags:
        parts: list[str] = []
        for tag in split_tags(prefix) + (split_tags(existing) if append and existing else []) + split_tags(generated):
            if _key(tag) not in {_key(p) for p in parts}:
                parts.append(tag)
        return ", ".join(parts)
    pieces = [prefix.strip().strip(","), existing.strip() if append and existing else "", generated.strip()]
    return ", ".join(p for p in pieces if p)


def backup_path(caption: Path) -> Path:
    """NAME.txt.bak, or .bak2, .bak3 ... when older backups exist: a backup is never overwritten."""
    n = 1
    while True:
        candidate = caption.with_name(caption.name + (".bak" if n == 1 else f".bak{n}"))
        if not candidate.exists():
            return candidate
        n += 1


def write_caption(caption: Path, text: str) -> Path | None:
    """Write `text` to `caption` atomically, first keeping any old content as a backup; returns the backup."""
    backup = None
    if caption.exists():
        backup = backup_path(caption)
        write_text_atomic(backup, caption.read_text(encoding="utf-8-sig"))
    write_text_atomic(caption, text.strip() + "\n")
    return backup


@dataclass
class CaptionReport:
    pending: list[Path] = field(default_factory=list)  # images still to caption
    written: list[Path] = field(default_factory=list)
    backups: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)  # images whose existing caption was left alone
    unreadable: list[tuple[Path, str]] = field(default_factory=list)
    tags: dict[str, int] = field(default_factory=dict)


def _extension(caption_extension: str) -> str:
    return caption_extension if caption_extension.startswith(".") else f".{caption_extension}"


def plan_captions(folder: Path, *, caption_extension: str = ".txt", overwrite: bool = False,
                  append: bool = False) -> CaptionReport:
    """Which images get a caption; refuses (one sentence) a missing, empty or read-only folder. No model."""
    from ..data import DatasetError, scan_dataset

    extension = _extension(caption_extension)
    try:
        scan = scan_dataset(folder, caption_extension=extension)
    except DatasetError as exc:
        raise refuse(str(exc)) from None
    report = CaptionReport(unreadable=[(s.path, s.reason) for s in scan.skipped])
    for item in scan.items:
        if item.path.with_suffix(extension).exists() and not (overwrite or append):
            report.kept.append(item.path)
        else:
            report.pending.append(item.path)
    check_writable({p.parent for p in report.pending}, "captions")
    return report


def caption_pending(report: CaptionReport, captioner, *, caption_extension: str = ".txt", prefix: str = "",
                    append: bool = False, batch_size: int = 8, tags: bool = True) -> CaptionReport:
    """Caption the planned images with `captioner` (a callable: list of PIL images -> texts), in batches;
    `tags`: the texts are comma-separated tags (merged without repeats), else sentences."""
    from ..data import load_image
    from ..data.images import UnreadableImageError

    extension = _extension(caption_extension)
    todo = report.pending
    batches = [todo[i:i + batch_size] for i in range(0, len(todo), batch_size)]
    for batch in progress(batches, len(batches), "captioning", unit="batch"):
        images, paths = [], []
        for path in batch:
            try:
                images.append(load_image(path))
                paths.append(path)
            except UnreadableImageError as exc:  # changed since the scan: listed, never touched
                report.unreadable.append((path, exc.reason))
        for path, text in zip(paths, captioner(images) if images else []):
            caption = path.with_suffix(extension)
            existing = caption.read_text(encoding="utf-8-sig").strip() if caption.exists() else None
            final = compose(text, prefix=prefix, existing=existing, append=append, tags=tags)
            try:
                backup = write_caption(caption, final)
            except OSError as exc:
                raise refuse(f"Could not write {caption} ({exc.strerror or exc}); {len(report.written)} captions "
                             "were written before it.") from None
            report.written.append(caption)
            if backup:
                report.backups.append(backup)
            for tag in split_tags(final) if tags else []:
                report.tags[tag] = report.tags.get(tag, 0) + 1
    return report


#: Upper bounds of the captioner's numbers: beyond them a value is a typo that would only exhaust memory.
MAX_BATCH, MAX_NEW_TOKENS, MAX_BEAMS = 1024, 1024, 32


def run(args: argparse.Namespace) -> int:
    if args.overwrite and args.append:
        raise refuse("--overwrite and --append exclude each other: replace captions, or add to them.")
    for name, most, what in (("batch_size", MAX_BATCH, "a batch size"), ("max_new_tokens", MAX_NEW_TOKENS,
                                                                          "a caption length in tokens"),
                             ("num_beams", MAX_BEAMS, "a number of beams")):
        if not 1 <= getattr(args, name) <= most:
            raise refuse(f"--{name} {getattr(args, name)} is not {what}; give a whole number from 1 to {most}.")
    for name in ("threshold", "character_threshold"):
        if not 0 <= getattr(args, name) <= 1:
            raise refuse(f"--{name} {getattr(args, name)} is not a probability; give a number from 0 to 1.")
    kind, model = model_kind(args.model, args.allow_download)
    report = plan_captions(Path(args.folder).expanduser(), caption_extension=args.caption_extension,
                           overwrite=args.overwrite, append=args.append)  # refusals before any model loads
    if report.pending:
        if kind == "tagger":
            options = TagOptions(args.threshold, args.character_threshold, set(split_tags(args.exclude_tags)),
                                 split_tags(args.keep_tags), args.keep_underscores, args.rating,
                                 args.character_first)
            captioner = WD14Tagger(model, options, args.device)
        else:
            captioner = TransformersCaptioner(str(model) if model.exists() else args.model,
                                              allow_download=args.allow_download, device=args.device,
                                              prompt=args.prompt, max_new_tokens=args.max_new_tokens,
                                              num_beams=args.num_beams)
        caption_pending(report, captioner, caption_extension=args.caption_extension, prefix=args.prefix,
                        append=args.append, batch_size=args.batch_size, tags=kind == "tagger")
    print(summary(report, kind))
    return 0


def summary(report: CaptionReport, kind: str) -> str:
    lines = [f"Captioned {len(report.written)} image(s) with the {kind}."]
    if report.backups:
        lines.append(f"{len(report.backups)} earlier caption(s) kept as .bak files beside them.")
    if report.kept:
        lines.append(f"{len(report.kept)} image(s) already had a caption and were left as they are; pass "
                     "--overwrite (old captions kept as .txt.bak) or --append to change them.")
    for path, reason in report.unreadable[:5]:
        lines.append(f"skipped {path}: {reason}")
    if len(report.unreadable) > 5:
        lines.append(f"... and {len(report.unreadable) - 5} more unreadable file(s), left untouched.")
    if report.tags and kind == "tagger":
        top = sorted(report.tags.items(), key=lambda kv: (-kv[1], kv[0]))[:15]
        lines.append("Most frequent tags: " + ", ".join(f"{t} ({n})" for t, n in top))
    return "\n".join(lines)
