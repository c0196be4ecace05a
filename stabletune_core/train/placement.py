"""Where the frozen modules live once their outputs are cached.

With latents cached the VAE is only needed to sample images (and for the LPIPS term); with text embeddings
cached and the text encoders not trained, they are only needed to sample and to encode the validation
captions once. Keeping them on the GPU for the whole run costs hundreds of MB (SD1.5) to gigabytes (SDXL)
of VRAM that training could use, so they move to the CPU after caching and come back only while needed.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from ..config import TrainConfig
from ..models.base import ModelBundle
from .guards.out_of_memory import free_memory

CPU = torch.device("cpu")


def module_device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def frozen_modules_to_offload(bundle: ModelBundle, config: TrainConfig, *, latents_cached: bool,
                              text_cached: bool) -> dict[str, torch.nn.Module]:
    """The modules no training step needs any more, by name."""
    off: dict[str, torch.nn.Module] = {}
    if latents_cached and config.perceptual_lambda <= 0:  # the LPIPS term decodes with the VAE every step
        off["vae"] = bundle.vae
    if text_cached and not config.train_text_encoder:
        off.update({f"text_encoder_{i}": e for i, e in enumerate(bundle.text_encoders)})
    return off


def cast_and_place(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """`module.to(device, dtype)`. diffusers' ModelMixin.to warns about the modules a model keeps in fp32 even when
    it lists none (two lines of "should be kept in float32: []" on every run's console), so a model that lists
    none is cast by torch's own Module.to, which is what ModelMixin.to does after its warning; one that lists some
    still goes through its own `to`."""
    if getattr(module, "_keep_in_fp32_modules", None):
        module.to(device, dtype=dtype)
    else:
        torch.nn.Module.to(module, device, dtype=dtype)


def place_models(bundle: ModelBundle, device: torch.device, weight_dtype: torch.dtype, mixed_precision: str, *,
                 denoiser: bool = True) -> None:
    """The bundle's models on `device` in the run's weight dtype; under fp16 the VAE stays fp32 (its fp16 decode
    overflows). denoiser False places only the encoders (setup caches their outputs before the denoiser comes:
    place_denoiser)."""
    cast_and_place(bundle.vae, device, torch.float32 if mixed_precision == "fp16" else weight_dtype)
    if denoiser:
        place_denoiser(bundle, device, weight_dtype)
    for encoder in bundle.text_encoders:
        cast_and_place(encoder, device, weight_dtype)


def place_denoiser(bundle: ModelBundle, device: torch.device, weight_dtype: torch.dtype) -> None:
    """The denoiser on `device` in the run's weight dtype. A training run places it after the caches are built and
    the encoders they made redundant went back to the CPU, so the set-up's peak on the device is the encoders' or the
    training step's, never both (FLUX.2 Klein 9B: Qwen3-8B and the transformer together do not fit 12 GB)."""
    cast_and_place(bundle.denoiser, device, weight_dtype)


def offload(modules: Iterable[torch.nn.Module], device: torch.device) -> None:
    """Move `modules` to the CPU and give their memory on `device` back."""
    for module in modules:
        module.to(CPU)
    if device.type != "cpu":  # on a CPU they were there already; a gc pass would only cost start-up time
        free_memory(device)


@contextlib.contextmanager
def on_device(modules: Iterable[torch.nn.Module], device: torch.device) -> Iterator[None]:
    """Run the body with `modules` on `device`, then put each back where it was (a no-op for the ones already
    there: on a CPU run, or when nothing was offloaded)."""
    moved = [(m, module_device(m)) for m in modules if module_device(m) != device]
    for module, _ in moved:
        module.to(device)
    try:
        yield
    finally:
        for module, home in moved:
            module.to(home)
        if moved:
            free_memory(device)


def swap_more_blocks(bundle: ModelBundle, count: int, device: torch.device) -> list[int]:
    """Keep the last `count` of the denoiser's blocks in CPU memory from now on (the out-of-memory guard's verdict);
    returns the blocks newly swapped. Their device memory is given back before the step is retried."""
    from ..models.block_swap import BlockSwap

    blocks = bundle.family.swappable_blocks(bundle.denoiser)
    swap = bundle.extra.get("block_swap")
    if swap is None:
        swap = bundle.extra["block_swap"] = BlockSwap.attach(blocks, 0, device)
    added = swap.extend(blocks, count)
    free_memory(device)
    return added
