"""A training adapter for Z-Image-Turbo: a LoRA the user supplies (e.g. ostris' de-distilling
``zimage_turbo_training_adapter``) merged into the frozen transformer while training, so the run's own LoRA learns
on top of a model that is no longer step-distilled; it is part of the base weights, not an adapter module, so the
exported LoRA (the run's adapters only) never holds it. Validation images show the merged model; preview_model (e.g.
the same Turbo) shows the trained LoRA without the training adapter, as users run it.

The file is read by diffusers' own ``ZImagePipeline.lora_state_dict``, so every layout that loader reads works
(ai-toolkit's ``diffusion_model.`` + diffusers paths with lora_A / lora_B or lora_down / lora_up and alpha, kohya's
``lora_unet_``, peft names); it returns lora_A / lora_B with alpha folded in, and the merge is W += B @ A (times the
file's lora_alpha / r when its metadata has them, as diffusers' loader scales it).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..base import ModelBundle, ModelLoadError

_PAIR = re.compile(r"transformer\.(.+)\.lora_([AB])\.weight")


def _scale(metadata: dict | None) -> float:
    """lora_alpha / r from the adapter config diffusers stores in a peft-named file's metadata; 1 without it."""
    config = metadata or {}
    if isinstance(config, str):
        config = json.loads(config)
    alpha, rank = config.get("lora_alpha"), config.get("r")
    return float(alpha) / float(rank) if alpha and rank else 1.0


def read_training_adapter(path: str | Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    """{transformer module path: (A [r, in], B [out, r])} and the scale, or ModelLoadError in one sentence."""
    from diffusers import ZImagePipeline

    path = Path(str(path)).expanduser()
    if path.suffix.lower() != ".safetensors":
        raise ModelLoadError(f"training_adapter '{path.name}' is not a .safetensors LoRA (other formats can run code "
                             "when loaded); give the adapter's .safetensors file.")
    try:
        state, metadata = ZImagePipeline.lora_state_dict(str(path), return_lora_metadata=True)
    except Exception as exc:  # diffusers' own words for a file it cannot read, first line only
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")
        raise ModelLoadError(f"training_adapter '{path.name}' is not a Z-Image LoRA that diffusers can read "
                             f"({first}); give a LoRA trained for Z-Image.") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        match = _PAIR.fullmatch(key)
        if match is None:
            raise ModelLoadError(f"training_adapter '{path.name}' holds '{key}', which is not a plain LoRA weight "
                                 "(LoKr, LoHa and DoRA adapters cannot be merged as one); give a LoRA.")
        pairs.setdefault(match[1], {})[match[2]] = value
    lonely = next((name for name, ab in pairs.items() if set(ab) != {"A", "B"}), None)
    if lonely is not None or not pairs:
        raise ModelLoadError(f"training_adapter '{path.name}' has " + (f"no lora_A / lora_B pair for '{lonely}'"
                             if lonely else "no LoRA weights") + "; give a complete Z-Image LoRA.")
    return {name: (ab["A"], ab["B"]) for name, ab in pairs.items()}, _scale(metadata)


@torch.no_grad()
def merge_training_adapter(bundle: ModelBundle, path: str | Path) -> str:
    """Merge the LoRA at `path` into `bundle.denoiser`'s weights (in place, in fp32 before casting back) and return
    the sentence to show. Every layer is checked before any weight changes: a layer the transformer does not have,
    or of another shape, is one sentence (ModelLoadError) and the model is left as it was."""
    name = Path(str(path)).name
    adapter, scale = read_training_adapter(path)
    transformer = bundle.denoiser
    modules = dict(transformer.named_modules())
    for module_path, (a, b) in adapter.items():
        module = modules.get(module_path)
        if not isinstance(module, torch.nn.Linear):
            raise ModelLoadError(f"training_adapter '{name}' adapts '{module_path}', which this Z-Image transformer "
                                 "does not have as a linear layer; give the adapter made for this model.")
        want = tuple(module.weight.shape)
        if (b.shape[0], a.shape[1]) != want or a.shape[0] != b.shape[1]:
            raise ModelLoadError(f"training_adapter '{name}' does not fit this Z-Image: its '{module_path}' is "
                                 f"{b.shape[0]} x {a.shape[1]} and the model's is {want[0]} x {want[1]}; give the "
                                 "adapter made for this model (Z-Image-Turbo's training adapter for Z-Image-Turbo).")
    for module_path, (a, b) in adapter.items():
        weight = modules[module_path].weight
        weight.copy_((weight.float() + scale * (b.float() @ a.float())).to(weight.dtype))
    bundle.extra["training_adapter"] = (f"The training adapter {name} ({len(adapter)} layers) is merged into the "
                                        "transformer while training and left out of the exported LoRA.")
    return bundle.extra["training_adapter"]
