"""Build a toy base of a flow-matching transformer family (FLUX.2 Klein, Z-Image): a tiny real-layout model that has
really learned the toy world.

    python -m stabletune_core.toy build --family flux2_klein|z_image [--out DIR] [--vae-steps N] [--unet-steps N]

The same world as the SD 1.x toy base (world.py), the same judge (score.py, evaluate.py), the same recipe for every
such family, in the family's own terms: the family's VAE is trained first as a codec of shapes in *any* colour (so
it can draw the held-out concept once a LoRA asks for it), with build.py's codec loss, and is given the statistics
of the toy world's latents (however the family normalises them); then the transformer learns the base vocabulary
(every base colour x shape, never the concept colour) with the shared flow-matching objective
(models/flow_matching.py, through the family face: text encoding, latents, conditioning, noise path, target and loss
are the ones a LoRA run uses), conditioned by the tiny Qwen3 of models/flux2_klein/tiny.py, which stays at its
seeded random initialisation (frozen, as the real families' text encoders are). The shipped weights are the
transformer's exponential moving average, in fp16, with the tokenizer files; `manifest.json` records the seed,
steps, final losses, scores, the build's CPU seconds and the sha256 of every shipped file.

What differs per family (its components, how its VAE takes the latents' statistics, its pipeline and diffusers folder)
is a FlowToy: toy/klein_build.py and toy/z_image_build.py each declare one. How latents are normalised with those
statistics the family face says (ModelFamily.normalize_raw_latents), as it does for a LoRA run.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch

from .build import BUILD_SEED, pixels, train_vae, write_manifest
from .world import BASE_COLORS, SHAPES, base_scenes, draw_scene

CFG_DROPOUT = 0.1  # empty captions, for classifier-free guidance (the pipelines' negative prompt is "")
#: The family's objective with logit-normal sigmas (diffusers' Klein script's --weighting_scheme logit_normal): more
#: draws mid-schedule, where the shape is decided. Trials on the toy Klein at 32 text tokens, 3000 steps of 32,
#: 4 seeds per prompt (kleinbase report): uniform lr 1e-3 right 48 % (shape 65 %), logit-normal 48 % (shape 73 %),
#: logit-normal at lr 2e-3 79 % (shape 96 %).
OBJECTIVE_OPTIONS = SimpleNamespace(flow_shift=None, weighting_scheme="logit_normal", logit_mean=0.0, logit_std=1.0,
                                    mode_scale=1.29)


@dataclass(frozen=True)
class Recipe:
    """The build's numbers (what the manifest records); each family's FlowToy holds its own defaults."""

    vae_steps: int = 1500
    vae_batch: int = 16
    transformer_steps: int = 10000
    transformer_batch: int = 32
    transformer_lr: float = 2e-3
    scenes_per_combo: int = 256
    eval_seeds: int = 8
    ema_max_decay: float = 0.998
    evaluate_every: int = 2500  # the EMA's quick evaluations in the log (2 seeds a prompt)
    #: The training table's shift (OBJECTIVE_OPTIONS' flow_shift): None is the family scheduler's own (Klein: 1, as
    #: it shifts dynamically at sampling; Z-Image: its static 3). logit_mean moves the logit-normal draw (> 0: towards
    #: clean latents, where a shape's corners are drawn).
    flow_shift: float | None = None
    logit_mean: float = 0.0

    def objective_options(self) -> SimpleNamespace:
        """OBJECTIVE_OPTIONS with this recipe's shift and logit mean."""
        return SimpleNamespace(**{**vars(OBJECTIVE_OPTIONS), "flow_shift": self.flow_shift,
                                  "logit_mean": self.logit_mean})


@dataclass(frozen=True)
class FlowToy:
    """What one transformer family's toy base needs of its family; the build is the same for every one."""

    family: str  # the model_family value
    recipe: Recipe
    text_length: int  # max_sequence_length the toy is built, sampled and taught at
    #: transformer, vae, text_encoder, tokenizer, scheduler at initialisation, deterministic from the seed
    components: Callable[[int], dict]
    #: the family's ModelBundle over in-memory parts, so the build encodes and trains as a LoRA run does
    bundle_of: Callable[[dict], Any]
    #: give the VAE the statistics of the toy world's raw latents (mode), as the family normalises them
    set_latent_statistics: Callable[[Any, torch.Tensor], None]
    pipeline_of: Callable[[dict], Any]  # the family's pipeline over in-memory parts (the build's evaluations)
    materialize: Callable[[Path], Path]  # shipped fp16 weights -> the diffusers folder users load
    load_pipeline: Callable[[Path], Any]  # the pipeline the judge renders with, over that folder
    shipped_files: tuple[str, ...] = ("transformer.safetensors", "vae.safetensors", "text_encoder.safetensors")


@torch.no_grad()
def encode_scenes(vae, scenes: list, batch: int = 128) -> torch.Tensor:
    """The raw latents (the posterior's mode, as the families encode) of `scenes`."""
    raws = [vae.encode(pixels([draw_scene(s) for s in scenes[i:i + batch]])).latent_dist.mode()
            for i in range(0, len(scenes), batch)]
    return torch.cat(raws)


@torch.no_grad()
def codec_hue_error(vae, per_colour: int = 8) -> float:
    """Mean hue distance in degrees between drawn toy images (every colour, concept included) and the codec's
    reconstruction of them (the mode): how much colour the VAE alone loses."""
    from PIL import Image

    from .score import hue_distance, judge
    from .world import ALL_COLORS, Scene

    scenes = [Scene(c, SHAPES[i % len(SHAPES)], 90_000 + i) for c in ALL_COLORS for i in range(per_colour)]
    x = pixels([draw_scene(s) for s in scenes])
    recon = vae.decode(vae.encode(x).latent_dist.mode()).sample
    images = ((recon.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()
    errors = [hue_distance(judge(draw_scene(s)).hue, judge(Image.fromarray(im)).hue) for s, im in zip(scenes, images)]
    return float(np.mean(errors))


def train_transformer(bundle, latents: torch.Tensor, text: dict[str, torch.Tensor], labels: torch.Tensor, steps: int,
                      batch: int, log: Callable[[str], None], lr: float = 1e-3, ema_max_decay: float = 0.999,
                      evaluate: Callable[[object, int], None] | None = None, objective_options=OBJECTIVE_OPTIONS,
                      cfg_dropout: float = CFG_DROPOUT, evaluate_every: int = 600) -> tuple[object, float]:
    """Flow-matching training of the transformer on normalised latents, with CFG_DROPOUT empty captions; returns
    the transformer's EMA copy and the final mean loss. `text` is the family's encode_text output with one row per
    caption, the empty one last; `objective_options` are the TrainConfig knobs of the family's objective
    (weighting_scheme, ...)."""
    transformer = bundle.denoiser
    objective = bundle.family.objective(bundle, objective_options)
    generator = torch.Generator().manual_seed(BUILD_SEED + 21)
    ema = copy.deepcopy(transformer).requires_grad_(False)
    transformer.requires_grad_(True).train()
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=0.0)
    warmup = 100
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps))))
    empty = len(next(iter(text.values()))) - 1
    losses = []
    for step in range(steps):
        pick = torch.randint(0, len(latents), (batch,), generator=generator)
        clean = latents[pick]
        noisy, noise, timesteps = objective.add_noise(clean, generator)
        rows = labels[pick].clone()
        rows[torch.rand(batch, generator=generator) < cfg_dropout] = empty
        conditioning = bundle.family.make_conditioning(bundle, {k: v[rows] for k, v in text.items()})
        prediction = objective.predict(transformer, noisy, timesteps, conditioning)
        loss = objective.loss(prediction, objective.target(clean, noise, timesteps), timesteps).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        decay = min(ema_max_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            for e, p in zip(ema.parameters(), transformer.parameters()):
                e.lerp_(p, 1 - decay)
        losses.append(float(loss))
        if step % 100 == 0 or step == steps - 1:
            log(f"transformer step {step}/{steps} loss {np.mean(losses[-100:]):.4f} "
                f"lr {schedule.get_last_lr()[0]:.2e}")
        if evaluate and step and step % evaluate_every == 0:
            evaluate(ema, step)
    transformer.requires_grad_(False).eval()
    return ema, float(np.mean(losses[-200:]))


def build(out: Path, toy: FlowToy, *, log: Callable[[str], None] = print, **numbers: Any) -> dict:
    """Train `toy`'s base with its recipe (less the `numbers` given, Recipe's fields) and write its shipped files and
    manifest into `out`."""
    from safetensors.torch import save_file

    from .evaluate import base_report

    recipe = dataclasses.replace(toy.recipe, **numbers)
    torch.set_num_threads(1)  # the tiny model is dispatch-bound: one thread is fastest on shared cores
    started, cpu_started = time.time(), time.process_time()
    parts = toy.components(BUILD_SEED)
    vae = parts["vae"]
    vae_loss = train_vae(vae, recipe.vae_steps, recipe.vae_batch, log)  # build.py's codec recipe, any colour
    codec = codec_hue_error(vae)
    log(f"codec: reconstructed hue error {codec:.1f} deg (mean over the base and concept colours)")

    scenes = base_scenes(recipe.scenes_per_combo * len(BASE_COLORS) * len(SHAPES), seed=BUILD_SEED + 5)
    raw = encode_scenes(vae, scenes)
    with torch.no_grad():
        toy.set_latent_statistics(vae, raw)
    bundle = toy.bundle_of(parts)
    latents = bundle.family.normalize_raw_latents(bundle, raw).float()  # as a LoRA run's encode_latents normalises
    log(f"latent bank: {len(scenes)} scenes, normalised latents {tuple(latents.shape)}")

    captions = sorted({s.caption for s in scenes})
    with torch.no_grad():
        text = {k: v.float() if v.is_floating_point() else v
                for k, v in bundle.family.encode_text(bundle, captions + [""]).items()}
    labels = torch.tensor([captions.index(s.caption) for s in scenes])

    def evaluate(ema, step: int) -> None:
        report = base_report(toy.pipeline_of({**parts, "transformer": ema}), seeds_per_prompt=2)
        log(f"  eval at step {step}: right {report['base_right']:.0%} (colour within "
            f"{report['color_tolerance_deg']:.0f} deg {report['base_color_score']:.0%}, shape "
            f"{report['base_shape_score']:.0%}), base hue error {report['base_hue_error']:.1f} deg, concept "
            f"{report['concept_hue_error']:.0f} deg off")

    ema, transformer_loss = train_transformer(bundle, latents, text, labels, recipe.transformer_steps,
                                              recipe.transformer_batch, log, lr=recipe.transformer_lr,
                                              ema_max_decay=recipe.ema_max_decay, evaluate=evaluate,
                                              evaluate_every=recipe.evaluate_every,
                                              objective_options=recipe.objective_options())

    out.mkdir(parents=True, exist_ok=True)
    for name, module in (("transformer", ema), ("vae", vae), ("text_encoder", parts["text_encoder"])):
        state = {k: v.detach().to(torch.float16).contiguous() for k, v in module.state_dict().items()
                 if k != "lm_head.weight"}  # Qwen3's lm_head is tied to its embeddings
        save_file(state, str(out / f"{name}.safetensors"), metadata={"format": "pt"})
    configs = {"transformer": dict(ema.config), "vae": dict(vae.config),
               "text_encoder": parts["text_encoder"].config.to_dict(), "scheduler": dict(parts["scheduler"].config)}
    (out / "configs.json").write_text(json.dumps(configs, indent=1, default=list))
    parts["tokenizer"].save_pretrained(str(out / "tokenizer"))

    model = toy.materialize(out)  # what users and tests load: the shipped fp16 weights, as an fp32 folder
    report = base_report(toy.load_pipeline(model), seeds_per_prompt=recipe.eval_seeds)
    manifest = {
        "family": toy.family, "seed": BUILD_SEED, "vae_steps": recipe.vae_steps, "vae_batch": recipe.vae_batch,
        "transformer_steps": recipe.transformer_steps, "transformer_batch": recipe.transformer_batch,
        "transformer_lr": recipe.transformer_lr, "scenes_per_combo": recipe.scenes_per_combo,
        "ema_max_decay": recipe.ema_max_decay, "max_sequence_length": toy.text_length,
        "objective": vars(recipe.objective_options()), "cfg_dropout": CFG_DROPOUT,
        "final_vae_loss": round(vae_loss, 5), "codec_hue_error_deg": round(codec, 2),
        "final_transformer_loss": round(transformer_loss, 5),
    }
    return write_manifest(out, manifest, report, toy.shipped_files, started, cpu_started, log)
