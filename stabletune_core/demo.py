"""The built-in demo: the toy base model learns a colour it has never seen, in about two minutes on a CPU.

The toy base (stabletune_core/toy) is a small pretrained SD 1.x that draws red, yellow, green and cyan
shapes when asked; it has never seen purple. The demo trains a LoRA on 12 purple shapes, and its validation
images (same prompts, same seeds at every sampling) show purple appearing; the run ends with a one-line
learning summary measured by the toy judge in degrees (toy/judge.py). Nothing is downloaded.

`draw_demo_dataset` (random shapes in the base colours) stays for tests on random-weight models.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable

from PIL import Image, ImageDraw

from .atomic import atomic_path
from .cache import cache_root
from .config import TOY_DEMO_RATES, ConfigError, TrainConfig, build_config, read_toml
from .runs.layout import RunPaths, sample_image_name, sample_prompts, step_of
from .toy.world import base_prompts, shape_concept_prompts

PRESETS = Path(__file__).resolve().parent.parent / "presets"
COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 40)}
SHAPES = ("circle", "square", "triangle")


def draw_shape(shape: str, color: tuple[int, int, int], size: int, rng: random.Random) -> Image.Image:
    background = tuple(rng.randint(200, 250) for _ in range(3))
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    radius = rng.randint(size // 5, size // 3)
    cx, cy = (rng.randint(radius, size - radius) for _ in range(2))
    box = (cx - radius, cy - radius, cx + radius, cy + radius)
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle(box, fill=color)
    else:
        draw.polygon([(cx, cy - radius), (cx - radius, cy + radius), (cx + radius, cy + radius)], fill=color)
    return image


def draw_demo_dataset(folder: Path, *, count: int = 24, size: int = 64, seed: int = 0) -> Path:
    """Coloured shapes on pale backgrounds, each with a caption like 'a red circle'."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(count):
        shape = SHAPES[i % len(SHAPES)]
        color = list(COLORS)[(i // len(SHAPES)) % len(COLORS)]
        draw_shape(shape, COLORS[color], size, rng).save(folder / f"shape_{i:03d}.png")
        (folder / f"shape_{i:03d}.txt").write_text(f"a {color} {shape}")
    return folder


DEMO_IMAGES = 12  # of the new concept
#: Seeds of the base's own prior images: never a validation seed (the demo's 7, 8) nor a scoring seed
#: (1000-1007), so keeping the base colours is measured on images the LoRA was not shown.
DEMO_PRIOR_FIRST_SEED = 5000


def write_base_images(model: Path, folder: Path, prompts: list[str], seeds: list[int], *,
                      pipeline: Callable[[Path], Any] | None = None) -> Path:
    """Class images rendered by the base model itself (DreamBooth's prior preservation): each prompt at each
    seed, captioned with its prompt, with the toy judge's sampler, steps and guidance. `pipeline` loads the toy
    base's own pipeline (default: the SD 1.x toy base's)."""
    import torch

    from .toy import load_toy_pipeline
    from .toy.evaluate import render

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the toy model is dispatch-bound: one thread is fastest
    try:
        pipe = (pipeline or load_toy_pipeline)(model)
        folder.mkdir(parents=True, exist_ok=True)
        for p, prompt in enumerate(prompts):
            for seed in seeds:  # one image a call: training data bitwise the same however many seeds are asked
                image = render(pipe, [prompt], [seed])[prompt][0]
                stem = f"base_{p:02d}_s{seed}"
                image.save(folder / f"{stem}.png")
                (folder / f"{stem}.txt").write_text(prompt)
    finally:
        torch.set_num_threads(threads)
    return folder


#: What the demo can teach the toy base: a colour it never saw (purple, in its shapes) or a shape it never
#: drew (the ring, in its colours): the second shows a LoRA learns structure, not only tint.
DEMO_CONCEPTS = ("colour", "shape")
#: The shape demo's validation prompts: the ring in every base colour, then every base prompt (the kept colours, each
#: in every shape: the summary measures them all, issue 35.3).
SHAPE_DEMO_PROMPTS = " | ".join(shape_concept_prompts() + base_prompts())


#: The demo preset of a concept other than the colour, per toy base family (presets/NAME); a family without one
#: teaches it with its colour preset. A shape is structure, not tint: on the SD toy base the colour preset draws
#: rings for 12.5 % of the ring prompts' images, its shape preset (a 3x UNet rate, 2.5x the steps) for ~80 %
#: (presets/demo-shape.toml has the measures).
CONCEPT_PRESETS: dict[tuple[str, str], str] = {("shape", "sd1"): "demo-shape.toml"}


def demo_preset(concept: str, family: str) -> Path:
    """The preset the demo trains `concept` on `family`'s toy base with."""
    from .toy.bases import TOY_BASES

    return PRESETS / CONCEPT_PRESETS.get((concept, family), TOY_BASES[family].preset)


def check_concept(concept: str) -> None:
    """One sentence for a concept the demo does not have, before anything is built or loaded."""
    if concept not in DEMO_CONCEPTS:
        raise ConfigError([f"The demo has no concept {concept!r}: choose 'colour' (the toy base learns purple) "
                           "or 'shape' (it learns to draw rings)."])


#: Words a caption's grammar needs, which cannot name a concept (the toy world's colours and shapes are refused too).
RESERVED_WORDS = frozenset({"a", "an", "the"})
MAX_WORD_LENGTH = 20


def concept_word_problem(word: str) -> str | None:
    """One sentence when `word` cannot name a new colour for the toy base (None when it can)."""
    from .toy.score import SHAPE_PROTOTYPES
    from .toy.world import BASE_COLORS

    if not word or not word.isascii() or not word.isalpha() or len(word) > MAX_WORD_LENGTH:
        return (f"--concept-word {word!r} is not one plain word: give the new colour's name in lowercase letters "
                f"only (at most {MAX_WORD_LENGTH}), e.g. 'blue'.")
    if word != word.lower():
        return f"--concept-word {word!r} has capitals: give it in lowercase ({word.lower()!r}), as captions use it."
    if word in BASE_COLORS:
        return (f"--concept-word {word!r} is a colour the toy base already draws ({', '.join(BASE_COLORS)}): "
                "name a colour it never saw, e.g. 'blue'.")
    if word in SHAPE_PROTOTYPES or word in RESERVED_WORDS:
        return (f"--concept-word {word!r} is one of the toy world's own words (a shape or an article): name the "
                "new colour your images show, e.g. 'blue'.")
    return None


def concept_images_in(folder: Path) -> list[Path]:
    """The image files directly in `folder` (by suffix), sorted by name."""
    from .toy.judge import IMAGE_SUFFIXES

    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def check_user_concept(folder: Path | None, word: str | None, concept: str = "colour") -> list[Path]:
    """The user's concept images; one sentence (ConfigError) for a folder or word the demo cannot teach, before
    anything is built or loaded."""
    if (folder is None) != (word is None):
        raise ConfigError(["Your own concept needs both --concept-images FOLDER (your images) and --concept-word "
                           "WORD (the colour they show); give both, or neither for the built-in demo."])
    if concept != "colour":
        raise ConfigError([f"--concept {concept} teaches the demo's own concept; with --concept-images leave "
                           "--concept out (your images teach a new colour)."])
    problem = concept_word_problem(word)
    if problem:
        raise ConfigError([problem])
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError([f"--concept-images {folder} is not a folder: give the folder that holds your images."])
    images = concept_images_in(folder)
    if not images:
        raise ConfigError([f"--concept-images {folder} holds no images (.png, .jpg, .jpeg, .webp, .bmp): put a "
                           "dozen images of your colour in it."])
    for image in images:
        try:
            with Image.open(image) as opened:
                opened.verify()
        except Exception:  # PIL raises many kinds for a file that is not an image
            raise ConfigError([f"{image.name} in --concept-images is not a readable image: remove or replace "
                               "it."]) from None
        caption = image.with_suffix(".txt")
        if caption.is_file() and word not in caption.read_text(encoding="utf-8").lower().split():
            raise ConfigError([f"The caption {caption.name} in --concept-images does not name {word!r}: put the word "
                               "in every caption (or remove the captions, and the demo writes them)."])
    return images


def prior_prompts_and_seeds(per_prompt: int) -> tuple[list[str], list[int]]:
    """What the demo's prior images are: every base prompt at `per_prompt` seeds from DEMO_PRIOR_FIRST_SEED."""
    return base_prompts(), list(range(DEMO_PRIOR_FIRST_SEED, DEMO_PRIOR_FIRST_SEED + per_prompt))


def _caption_of(image: Path, word: str) -> str:
    """The image's own caption, else 'a WORD SHAPE' with the shape the toy judge sees (just 'a WORD' without one):
    the captions the toy base was taught in."""
    from .toy.score import judge
    from .toy.world import SHAPES

    caption = image.with_suffix(".txt")
    if caption.is_file():
        return caption.read_text(encoding="utf-8").strip()
    with Image.open(image) as opened:
        shape = judge(opened).shape
    return f"a {word} {shape}" if shape in SHAPES else f"a {word}"


def user_concept_assets(images: list[Path], word: str, family: str = "sd1") -> tuple[Path, Path]:
    """The toy base model and a dataset of the user's images (check_user_concept's; copied, each with its caption)
    beside the base's own prior images, built once per (images, word, base) into the cache folder; the user's
    folder is only read."""
    import hashlib

    from .toy.bases import TOY_BASES

    check_family(family)
    toy = TOY_BASES[family]
    captions = {image: _caption_of(image, word) for image in images}
    digest = hashlib.sha256(word.encode())
    for image, caption in captions.items():
        digest.update(image.name.encode() + b"\0" + image.read_bytes() + b"\0" + caption.encode())
    model = toy.model()
    per_prompt = toy.prior_images_per_prompt
    data = cache_root() / f"demo-v6-{model.name}" / f"user-{word}-{digest.hexdigest()[:12]}-prior{per_prompt}"

    def write_concept(concept: Path) -> None:
        concept.mkdir()
        for image, caption in captions.items():
            (concept / image.name).write_bytes(image.read_bytes())
            (concept / image.with_suffix(".txt").name).write_text(caption, encoding="utf-8")

    _build_dataset_once(data, f"1_{word}", write_concept, model, toy)
    return model, data


def _build_dataset_once(data: Path, concept_folder: str, write_concept: Callable[[Path], None], model: Path,
                        toy: Any) -> None:
    """The demo dataset at `data`, written whole (the concept's folder, then the base's prior images) unless it is
    there already: a cache, so a second demo of the same concept starts at once."""
    if data.is_dir():
        return
    data.parent.mkdir(parents=True, exist_ok=True)
    prompts, seeds = prior_prompts_and_seeds(toy.prior_images_per_prompt)
    try:
        with atomic_path(data, folder=True) as staging:
            write_concept(staging / concept_folder)
            write_base_images(model, staging / "1_known_colours", prompts, seeds, pipeline=toy.pipeline)
    except OSError:
        if not data.is_dir():
            raise
        # another process wrote it first; its copy is the same


def check_family(family: str) -> None:
    """One sentence for a model family without a toy base, before anything is built or loaded."""
    from .toy.bases import unknown_family_sentence

    problem = unknown_family_sentence(family)
    if problem:
        raise ConfigError([problem])


def demo_assets(concept: str = "colour", family: str = "sd1") -> tuple[Path, Path]:
    """The toy base model and the demo dataset, built once per base version into the cache folder.

    The dataset holds 12 images of the concept (purple shapes, or rings in the base colours) and images of what
    the base already draws (`prior_images_per_prompt` of each of its 12 prompts: 24 on SD 1.x, 48 on Klein),
    rendered by the base itself at its own prompts (prior preservation as DreamBooth does it: the base's images,
    not drawn ones). Drawn images of the known colours (the demo until issue 21.4) are not what the base draws:
    training on them pulls every known colour towards the drawing's palette, and the base's own red and green
    drifted 10-20 degrees; with the base's own images, what the LoRA must keep is exactly what the base did, and
    only the concept has something new to learn.
    """
    from .toy.bases import TOY_BASES
    from .toy.world import CONCEPT_COLOR, CONCEPT_SHAPE, concept_scenes, shape_concept_scenes, write_dataset

    check_concept(concept)
    check_family(family)
    toy = TOY_BASES[family]
    model = toy.model()
    name, scenes = ((CONCEPT_COLOR, concept_scenes(DEMO_IMAGES)) if concept == "colour"
                    else (CONCEPT_SHAPE, shape_concept_scenes(DEMO_IMAGES)))
    per_prompt = toy.prior_images_per_prompt
    data = cache_root() / f"demo-v6-{model.name}" / f"{name}-lora-prior{per_prompt}"
    _build_dataset_once(data, f"1_{name}", lambda folder: write_dataset(folder, scenes), model, toy)
    return model, data


def free_run_dir(base: Path) -> Path:
    """runs/demo, or runs/demo-2, ... : an earlier demo run is never overwritten."""
    if not base.exists():
        return base
    n = 2
    while Path(f"{base}-{n}").exists():
        n += 1
    return Path(f"{base}-{n}")


def demo_config(output_dir: Path, *, max_train_steps: int | None = None, resume: bool = False,
                network_type: str = "lora", concept: str = "colour", family: str = "sd1",
                concept_images: Path | None = None, concept_word: str | None = None,
                seed: int | None = None) -> TrainConfig:
    """The demo's TrainConfig: the family's toy base and the concept's demo preset, the demo dataset, and the
    asked adapter. `concept_images` and `concept_word`: the user's own images of a new colour and its name instead
    of the demo's purple (the colour preset; validation prompts name the word); `seed`: the training seed."""
    check_concept(concept)
    check_family(family)
    user = concept_images is not None or concept_word is not None
    if user:
        images = check_user_concept(concept_images, concept_word, concept)
        model, data = user_concept_assets(images, concept_word, family)
    else:
        model, data = demo_assets(concept, family)
    values = read_toml(demo_preset(concept, family))
    if network_type != "lora":  # LoHa and LoKr need higher rates than the preset's (config.TOY_DEMO_RATES)
        learning_rate, text_encoder_lr = TOY_DEMO_RATES[network_type]
        values.update(network_type=network_type, learning_rate=learning_rate)
        if values.get("train_text_encoder"):  # a preset that keeps its text encoder frozen has no such rate
            values.update(text_encoder_lr=text_encoder_lr)
    if concept == "shape":
        values.update(validation_prompt=SHAPE_DEMO_PROMPTS, output_name="demo_ring_lora")
    if user:
        values.update(validation_prompt=word_validation_prompts(values["validation_prompt"], concept_word),
                      output_name=f"demo_{concept_word}_lora")
    values.update(pretrained_model_name_or_path=str(model), train_data_dir=str(data),
                  output_dir=str(output_dir if resume else free_run_dir(output_dir)))
    if resume:
        values["resume_from_checkpoint"] = "auto"
    if max_train_steps:
        values["max_train_steps"] = max_train_steps
    if seed is not None:
        values["seed"] = seed
    return build_config(values)


def word_validation_prompts(preset_prompts: str, word: str) -> str:
    """The colour preset's validation prompts with `word` as the concept: the word in every base shape, then the
    preset's prompts of the colours the base keeps."""
    from .toy.score import caption_parts
    from .toy.world import BASE_COLORS, SHAPES

    kept = [p.strip() for p in preset_prompts.split(" | ") if caption_parts(p.strip())[0] in BASE_COLORS]
    return " | ".join([f"a {word} {shape}" for shape in SHAPES] + kept)


def make_gallery(run_dir: Path, target: Path | None = None, *, scale: int = 2) -> Path | None:
    """One PNG of the run's validation images: a row per (prompt, seed), a column per sampling step, and
    under them the learning summary in degrees (toy/judge.py).

    The same prompt and seed in every column, so a row shows one image changing as the LoRA learns.
    """
    import json

    from PIL import ImageFont

    steps = RunPaths(run_dir).sample_folders()
    if not steps:
        return None
    meta = json.loads(sample_prompts(steps[0]).read_text())
    # the seeds every sampling drew: the last sampling's extra seeds (final_validation_images, also in step 0's
    # folder) would be rows of empty cells in between; the summary under the sheet reads them all
    every = [set(json.loads(sample_prompts(folder).read_text())["seeds"]) for folder in steps]
    rows = [(p, prompt, seed) for p, prompt in enumerate(meta["prompts"]) for seed in meta["seeds"]
            if all(seed in seeds for seeds in every)]
    with Image.open(steps[0] / sample_image_name(0, meta["seeds"][0])) as first:
        cell = first.width * scale
    label_w, head_h, pad = 150, 18, 4
    from .toy.judge import learning_summary

    width = label_w + len(steps) * (cell + pad)
    summary = _wrap(f"Learning: {learning_summary(run_dir)}", max(40, width // 6 - 2))
    foot_h = 4 + 12 * len(summary)
    sheet = Image.new("RGB", (width, head_h + len(rows) * (cell + pad) + foot_h), "white")
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default()
    for c, folder in enumerate(steps):
        draw.text((label_w + c * (cell + pad) + 4, 3), f"step {step_of(folder)}", fill="black", font=font)
    for r, (p, prompt, seed) in enumerate(rows):
        y = head_h + r * (cell + pad)
        draw.text((4, y + cell // 2 - 12), prompt, fill="black", font=font)
        draw.text((4, y + cell // 2 + 2), f"seed {seed}", fill="gray", font=font)
        for c, folder in enumerate(steps):
            path = folder / sample_image_name(p, seed)
            if path.is_file():
                with Image.open(path) as image:
                    sheet.paste(image.convert("RGB").resize((cell, cell), Image.NEAREST),
                                (label_w + c * (cell + pad), y))
    for i, text in enumerate(summary):  # the judge's measures, in degrees, under the images they measure
        draw.text((4, head_h + len(rows) * (cell + pad) + 2 + 12 * i), text, fill="black", font=font)
    target = target or RunPaths(run_dir).gallery
    sheet.save(target)
    return target


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width) or [""]
