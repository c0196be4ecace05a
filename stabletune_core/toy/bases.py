"""The toy bases, one per model family that has one: what the demo asks for, so that it never branches on the family.

Each toy base learned the same toy world (world.py) and is judged by the same judge (score.py, evaluate.py); a
family's toy base names its diffusers folder, the pipeline the judge renders with, and the demo preset that
teaches it the held-out concept.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any, Callable


@dataclass(frozen=True)
class ToyBase:
    family: str  # the model_family value
    display_name: str  # what the demo's console line calls it
    preset: str  # the demo preset (presets/NAME), a partial TrainConfig
    model: Callable[[], Path]  # the shipped weights as a diffusers folder (built once, in the cache)
    pipeline: Callable[[Path], Any]  # the pipeline the toy judge renders with, over that folder
    #: Trains the base anew (`python -m stabletune_core.toy build`): (out or the shipped folder, steps the user
    #: gave, log); each family's build() keeps its own recipe's defaults for the steps not given.
    build: Callable[[Path | None, BuildSteps, Callable[[str], None]], Any]
    #: The demo's prior images per base prompt (the base's own renders of what it must keep, demo.demo_assets).
    #: The toy Klein needs 4: with 2, its demo kept red and green within 3 deg over 8 seeds but not at the
    #: validation seeds its own summary reads (4 deg each); with 4, 1-2 deg there and over 8 seeds
    #: (bench/RESULTS.md, the Klein demo's prior images).
    prior_images_per_prompt: int = 2


@dataclass(frozen=True)
class BuildSteps:
    """The step counts `toy build` was given (None: the family's recipe)."""
    vae_steps: int | None = None
    denoiser_steps: int | None = None  # --unet-steps / --transformer-steps
    vae_polish_steps: int = 300  # the SD 1.x decoder-only polish; the toy Klein has none


def _sd1_model() -> Path:
    from . import toy_base_model

    return toy_base_model()


def _sd1_pipeline(model: Path) -> Any:
    from . import load_toy_pipeline

    return load_toy_pipeline(model)


def _sd1_build(out: Path | None, steps: BuildSteps, log: Callable[[str], None]) -> Any:
    from .build import build, default_out

    return build(out or default_out(), **({"vae_steps": steps.vae_steps} if steps.vae_steps else {}),
                 vae_polish_steps=steps.vae_polish_steps,
                 **({"unet_steps": steps.denoiser_steps} if steps.denoiser_steps else {}), log=log)


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """toy/MODULE's function NAME, imported when first called (listing the toy bases loads no model code)."""
    def call(*args: Any) -> Any:
        return getattr(import_module(f".{module}", __package__), name)(*args)

    call.__name__ = call.__qualname__ = f"{module}.{name}"
    return call


def _flow_build(module: str) -> Callable[[Path | None, BuildSteps, Callable[[str], None]], Any]:
    """The build of a transformer family's toy base (toy/flow_build.py, the family's piece in toy/MODULE)."""
    def build(out: Path | None, steps: BuildSteps, log: Callable[[str], None]) -> Any:
        piece = import_module(f".{module}", __package__)
        return piece.build(out or piece.WEIGHTS, **({"vae_steps": steps.vae_steps} if steps.vae_steps else {}),
                           **({"transformer_steps": steps.denoiser_steps} if steps.denoiser_steps else {}), log=log)

    return build


TOY_BASES: dict[str, ToyBase] = {
    "sd1": ToyBase("sd1", "the toy base model (SD 1.x)", "demo.toml", _sd1_model, _sd1_pipeline, _sd1_build),
    "flux2_klein": ToyBase("flux2_klein", "the toy FLUX.2 Klein base", "demo-flux2-klein.toml",
                           _lazy("klein", "toy_klein_model"), _lazy("klein", "load_toy_klein_pipeline"),
                           _flow_build("klein_build"), prior_images_per_prompt=4),
    "z_image": ToyBase("z_image", "the toy Z-Image base", "demo-z_image.toml", _lazy("z_image", "toy_z_image_model"),
                       _lazy("z_image", "load_toy_z_image_pipeline"), _flow_build("z_image_build"),
                       prior_images_per_prompt=4),
}


def unknown_family_sentence(family: str) -> str | None:
    """One sentence when `family` has no toy base (None when it has one)."""
    if family in TOY_BASES:
        return None
    *others, last = (repr(name) for name in TOY_BASES)
    return f"There is no toy base of model family {family!r}: choose {', '.join(others)} or {last}."
