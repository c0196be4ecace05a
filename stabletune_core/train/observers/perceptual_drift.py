"""Perceptual drift: a judge for every run (SD 1.x/2.x/SDXL, FLUX.2 Klein, Z-Image), where the toy judge's degrees
do not apply (issue 35.5). At each sampling it records, into RUN/diagnostics/perceptual_drift.jsonl:
- every prompt's drift: how far each image moved from the base's own image at the same prompt and seed (the run's
  step-0 sampling, read from RUN/samples/step_000000, so a resumed run still counts from step 0); the kept prompts
  (those naming no concept word) are what the LoRA should leave alone;
- each concept prompt's distance to the training images: for each image, the distance to the nearest training
  image whose caption names a concept word (lower: closer to what the LoRA is taught).
One JSON object a sampling: {"step", "measure", "concept_words", "kept": [prompts], "concept": [prompts],
"drift": {prompt: {"mean", "seeds": {seed: value}}}, "nearest": {prompt: {"mean", "seeds": {...}}}, "images",
"unpaired"}.

The measure. LPIPS is the perceptual metric, but its ImageNet backbone weights are a download; it is used only when
torchvision's file is already in the torch hub cache (train/perceptual.py backbone_weights_file), never fetched. A
random backbone (pnet_rand) would be a number without meaning, so without the file the measure is the run's own VAE
instead: images are encoded to the latents the denoiser trains on (the posterior mean, no random draw, so training
is untouched) - a space the model itself uses for what images look like, with no download and the VAE already
loaded. Both measures compare the latents' per-channel mean and standard deviation (colour and texture statistics,
layout-free): the RMS of their difference. The nearest training image is another picture altogether (the shape sits
elsewhere, the crop differs), so a pointwise difference would measure layout there. Two images of the same prompt and
seed share their layout, yet the LoRA moves edges and sizes a little, which a pointwise difference weighs like a
change of colour: on the toy demo the pointwise RMS did not move with the judge's hue drift at all (Pearson -0.04
over 336 images), the statistics did (0.66; bench/perceptual_drift.py, bench/RESULTS.md).

The concept words: the names of the dataset's kohya `N_name` folders that its captions use (the demo's `1_purple`);
without such folders, the words (not articles or prepositions) in at least half of the captions (a trigger word).
An observer: it measures and records; at the end, when no sample judge gives the summary, its line is the run's.
"""
from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from ...config import TrainConfig
from ...data.scan import folder_repeats
from ...runs import events
from ...runs.jsonfiles import append_jsonl, read_jsonl
from ...runs.layout import RunPaths, run_of_sampling, sample_image_name, sample_prompts, step_of
from ..guards.verdicts import Event
from ..placement import on_device
from .base import NOTHING, Observation, Observer, ObserverView

LPIPS_NET = "alex"
VAE_MEASURE = "vae_latent"
LPIPS_MEASURE = f"lpips_{LPIPS_NET}"
_WORD = re.compile(r"[a-z0-9]+")
_NOT_A_CONCEPT = frozenset("a an the of in on at with and or to for by from photo picture image".split())
ENCODE_BATCH = 8


def words(text: str) -> set[str]:
    """The lower-case words of a caption or prompt."""
    return set(_WORD.findall(text.lower()))


def concept_words(train_data_dir: Path | None, captions: Sequence[str]) -> list[str]:
    """What the LoRA is taught (module docstring): the kohya folder names' words that the captions use, else the
    words in at least half of the captions."""
    used = set().union(*(words(c) for c in captions)) if captions else set()
    named: set[str] = set()
    if train_data_dir is not None and Path(train_data_dir).is_dir():
        for folder in Path(train_data_dir).iterdir():
            if folder.is_dir() and folder_repeats(folder.name):
                named |= words(folder.name.split("_", 1)[1]) & used
    if named:
        return sorted(named - _NOT_A_CONCEPT)
    counts: dict[str, int] = {}
    for caption in captions:
        for word in words(caption):
            counts[word] = counts.get(word, 0) + 1
    return sorted(w for w, n in counts.items() if 2 * n >= len(captions) and w not in _NOT_A_CONCEPT)


def _pixels(path: Path, size: tuple[int, int]) -> torch.Tensor:
    """An image as a (3, H, W) tensor in [-1, 1] at `size` (centre-cropped to its aspect first)."""
    import numpy as np
    from PIL import Image, ImageOps

    with Image.open(path) as image:
        fitted = ImageOps.fit(image.convert("RGB"), size, method=Image.Resampling.BICUBIC)
    return torch.from_numpy(np.asarray(fitted, dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1.0


def latent_statistics(latents: torch.Tensor) -> torch.Tensor:
    """(C, H, W) latents (or a flat vector) -> each channel's mean, then each channel's standard deviation."""
    flat = latents.flatten(1) if latents.dim() > 1 else latents[None]
    return torch.cat([flat.mean(1), flat.std(1, unbiased=False)])


class PerceptualDrift(Observer):
    """Records drift and concept distance at every complete sampling (module docstring); `bundle`, `device` and
    the training items come from the validation-loss evaluator (setup builds it for every run)."""

    name = "perceptual_drift"

    def __init__(self, config: TrainConfig, bundle: Any, device: torch.device, items: Sequence[Any]) -> None:
        from ..perceptual import backbone_weights_file

        self.config, self.bundle, self.device = config, bundle, device
        self.captions = {Path(item.path): str(item.caption or "") for item in items}
        data = Path(config.train_data_dir) if config.train_data_dir else None
        self.words = concept_words(data, list(self.captions.values()))
        self.lpips: Any = None
        self.measure = VAE_MEASURE
        if backbone_weights_file(LPIPS_NET).is_file():  # on the machine already: never downloaded from here
            self.measure = LPIPS_MEASURE
        self.features: dict[Path, torch.Tensor] = {}  # encoded images, by file (the base's and the training ones)
        self.last: dict[str, Any] | None = None
        self.first: dict[str, Any] | None = None
        self.seconds = 0.0

    # ---- the measure ----------------------------------------------------------------------------------------
    def _net(self) -> Any:
        if self.lpips is None:
            import warnings

            import lpips

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torchvision's 'pretrained is deprecated' chatter
                self.lpips = lpips.LPIPS(net=LPIPS_NET, verbose=False).to(self.device).eval().requires_grad_(False)
        return self.lpips

    @torch.no_grad()
    def encode(self, paths: list[Path], size: tuple[int, int], *, keep: bool = False) -> list[torch.Tensor]:
        """Each image as the measure sees it: LPIPS takes pixels, the VAE measure the latents (CPU, fp32).
        `keep`: remember them (the base's images and the training images are measured against again)."""
        out: dict[Path, torch.Tensor] = {p: self.features[p] for p in paths if p in self.features}
        todo = [p for p in paths if p not in out]
        for start in range(0, len(todo), ENCODE_BATCH):
            batch = todo[start:start + ENCODE_BATCH]
            pixels = torch.stack([_pixels(p, size) for p in batch])
            if self.measure == VAE_MEASURE:
                family = self.bundle.family
                with on_device((self.bundle.vae,), self.device):
                    encoded = family.encode_latents(self.bundle, pixels.to(self.device)).float().cpu()
            else:
                encoded = pixels
            for path, tensor in zip(batch, encoded):
                out[path] = tensor
                if keep:
                    self.features[path] = tensor
        return [out[p] for p in paths]

    @torch.no_grad()
    def pair_distance(self, a: torch.Tensor, b: torch.Tensor) -> float:
        """Two images of the same prompt and seed: LPIPS, or the distance of their latents' statistics."""
        return self.nearest_distance(a, [b])

    @torch.no_grad()
    def nearest_distance(self, a: torch.Tensor, references: list[torch.Tensor]) -> float:
        """An image against the nearest of `references`: by LPIPS, or by the RMS difference of the latents'
        per-channel mean and standard deviation (layout-free, module docstring)."""
        if self.measure == LPIPS_MEASURE:
            net = self._net()
            return min(float(net(a[None].to(self.device), r[None].to(self.device)).flatten()[0]) for r in references)
        mine = latent_statistics(a)
        return min(float((mine - latent_statistics(r)).pow(2).mean().sqrt()) for r in references)

    # ---- the observer ---------------------------------------------------------------------------------------
    def concept_images(self) -> list[Path]:
        return [p for p, caption in self.captions.items() if words(caption) & set(self.words) and p.is_file()]

    def measure_sampling(self, folder: Path, run_dir: Path) -> dict[str, Any]:
        """The record of one sampling folder (module docstring)."""
        meta = json.loads(sample_prompts(folder).read_text(encoding="utf-8"))
        prompts, seeds = meta["prompts"], meta["seeds"]
        base = RunPaths(run_dir).sample_dir(0)
        base_meta = json.loads(sample_prompts(base).read_text(encoding="utf-8")) if sample_prompts(base).is_file() \
            else {"prompts": [], "seeds": []}
        base_index = {prompt: i for i, prompt in enumerate(base_meta["prompts"])}
        concept = [p for p in prompts if words(p) & set(self.words)]
        kept = [p for p in prompts if p not in concept]
        references = self.concept_images() if concept else []
        drift: dict[str, dict[str, Any]] = {}
        nearest: dict[str, dict[str, Any]] = {}
        images = unpaired = 0
        size: tuple[int, int] | None = None
        ref_features: list[torch.Tensor] = []
        for p, prompt in enumerate(prompts):
            paths = [folder / sample_image_name(p, s) for s in seeds]
            made = [(s, path) for s, path in zip(seeds, paths) if path.is_file()]
            if not made:
                continue
            images += len(made)
            if size is None:
                from PIL import Image

                with Image.open(made[0][1]) as first:
                    size = first.size
                if references:
                    ref_features = self.encode(references, size, keep=True)
            mine = self.encode([path for _, path in made], size, keep=step_of(folder) == 0)
            pairs = {}
            for (seed, _), feature in zip(made, mine):
                before = base / sample_image_name(base_index[prompt], seed) if prompt in base_index else None
                if before is None or not before.is_file():
                    unpaired += 1
                    continue
                pairs[str(seed)] = round(self.pair_distance(feature, self.encode([before], size, keep=True)[0]), 6)
            if pairs:
                drift[prompt] = {"mean": round(sum(pairs.values()) / len(pairs), 6), "seeds": pairs}
            if prompt in concept and ref_features:
                near = {str(s): round(self.nearest_distance(f, ref_features), 6) for (s, _), f in zip(made, mine)}
                nearest[prompt] = {"mean": round(sum(near.values()) / len(near), 6), "seeds": near}
        return {"step": step_of(folder), "measure": self.measure, "concept_words": self.words, "kept": kept,
                "concept": concept, "drift": drift, "nearest": nearest, "images": images, "unpaired": unpaired}

    def on_samples(self, view: ObserverView, folder: Path, paths: list[Path]) -> Observation:
        if not paths:
            return NOTHING
        start = time.perf_counter()
        run_dir = view.run_paths.root if view.run_paths else run_of_sampling(folder)
        record = self.measure_sampling(Path(folder), run_dir)
        append_jsonl(RunPaths(run_dir).perceptual_drift, record)
        self.first = self.first or record
        self.last = record
        self.seconds += time.perf_counter() - start
        return NOTHING

    def on_end(self, view: ObserverView) -> Observation:
        """The run's summary when no sample judge gives one (sample_judge none)."""
        if self.config.sample_judge != "none" or view.run_paths is None:
            return NOTHING
        records = read_records(view.run_paths.perceptual_drift)
        line = drift_summary(records)
        if not line:
            return NOTHING
        summary = f"Learning summary ({describe_measure(records[-1]['measure'])}): {line}."
        return Observation(events=(Event(events.LEARNING, summary, console=True, fields=dict(step=view.step)),),
                           summary=summary)


def read_records(path: Path) -> list[dict[str, Any]]:
    """perceptual_drift.jsonl's records, oldest sampling first."""
    return read_jsonl(Path(path))[0]


def describe_measure(measure: str) -> str:
    return ("LPIPS (AlexNet)" if measure == LPIPS_MEASURE
            else "distances in the model's own VAE latent space; no judge applies to these prompts")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def drift_summary(records: list[dict[str, Any]]) -> str:
    """'kept prompts drift 0.012 from the base's images (most: 'a cat' 0.03); concept prompts 0.41 -> 0.12 from the
    training images; read 30 images at step 400 against step 0's' - first -> last sampling. A run without step 0's
    images or without a sampling after it says what is missing."""
    if not records:
        return ""
    first, last = records[0], records[-1]
    parts = []
    kept = {p: v["mean"] for p, v in last["drift"].items() if p in last["kept"]}
    if kept:
        worst = max(kept, key=kept.get)
        parts.append(f"kept prompts drift {_mean(list(kept.values())):.3g} from the base's own images (most: "
                     f"'{worst}' {kept[worst]:.3g})")
    now = _mean([v["mean"] for v in last["nearest"].values()])
    if last["nearest"]:
        before = _mean([v["mean"] for v in first["nearest"].values()]) if first is not last and first["nearest"] \
            else None
        parts.append(f"concept prompts {before:.3g} -> {now:.3g} from the nearest training image" if before is not None
                     else f"concept prompts {now:.3g} from the nearest training image")
    elif last["concept_words"]:
        parts.append(f"no concept prompt measured (none of the validation prompts names "
                     f"{', '.join(last['concept_words'])})")
    line = f"read {last['images']} images at step {last['step']}"
    if first.get("step") != 0:
        return "; ".join(parts + [line + "; the base's own images (step 0) are missing, so no drift was measured"])
    if last is first:
        return "; ".join(parts + [line + " only: no validation images after step 0, so nothing learned was "
                                  "measured"])
    line += " against step 0's"
    if last["unpaired"]:
        line += f" ({last['unpaired']} without their step-0 image, not measured)"
    return "; ".join(parts + [line])
