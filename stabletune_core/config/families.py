"""The model families a config can name, and which knobs apply to which, in one place.

The SD families (sd1, sd2, sdxl) train a UNet on a DDPM schedule; FLUX.2 Klein (flux2_klein) and Z-Image (z_image)
train a flow-matching transformer beside a frozen Qwen3 text encoder. A knob one kind of model has no meaning for is
refused in one sentence before any model loads, never silently ignored. The schema asks this module when the
family is named; with model_family auto the run's set-up asks it again once the checkpoint says which family it is.

Torch-free, like the rest of config/ (the UI reads it).
"""
from __future__ import annotations

from typing import Any

from ..family_files import PLANNED_FAMILIES, is_flux2_klein

#: What `model_family` accepts: auto (detected from the checkpoint) and every family the engine trains.
FAMILY_CHOICES = ("auto", "sd1", "sd2", "sdxl", "flux2_klein", "z_image")
#: The names users know them by (the UI's picker, sentences).
FAMILY_NAMES = {"auto": "detect from the checkpoint", "sd1": "Stable Diffusion 1.x", "sd2": "Stable Diffusion 2.x",
                "sdxl": "Stable Diffusion XL", "flux2_klein": "FLUX.2 Klein (4B / 9B)",
                "z_image": "Z-Image (Base / Turbo)"}
FLOW_FAMILIES = frozenset({"flux2_klein", "z_image"})
#: What a sentence about one flow family's knobs calls it (the _SD_ONLY reasons are written for FLUX.2 Klein).
_FLOW_NAMES = {"flux2_klein": "FLUX.2 Klein", "z_image": "Z-Image"}

#: The flow-matching timestep densities / loss weightings (diffusers' training_utils, the Klein example's
#: --weighting_scheme); models/flow_matching.py implements them.
WEIGHTING_SCHEMES = ("none", "logit_normal", "mode", "sigma_sqrt", "cosmap")

#: The UNet LoRA targets every SD family starts from (the schema's default of unet_lora_targets).
SD_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
#: Klein's default: the attention of the double blocks (both streams) and both fused layers of the single blocks.
#: The same list as models/flux2_klein/family.py LORA_PRESETS["attention"] (a test keeps them equal): a single block's
#: attention and MLP share those two layers, so attention alone cannot be chosen there.
KLEIN_LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                      "attn.add_v_proj", "attn.to_add_out", "attn.to_qkv_mlp_proj",
                      "single_transformer_blocks.*.attn.to_out"]

#: Z-Image's default: the attention of every block (main layers and both refiners); the same list as
#: models/z_image/family.py LORA_PRESETS["attention"] (a test keeps them equal).
Z_IMAGE_LORA_TARGETS = ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0"]
_FLOW_LORA_TARGETS = {"flux2_klein": KLEIN_LORA_TARGETS, "z_image": Z_IMAGE_LORA_TARGETS}

#: The validation guidance a Klein base samples with when the config keeps the SD default.
KLEIN_VALIDATION_GUIDANCE = 4.0
#: ZImagePipeline's own default guidance, what Z-Image Base samples with when the config keeps the SD default.
Z_IMAGE_VALIDATION_GUIDANCE = 5.0
_FLOW_GUIDANCE = {"flux2_klein": KLEIN_VALIDATION_GUIDANCE, "z_image": Z_IMAGE_VALIDATION_GUIDANCE}
#: The families a training adapter (a LoRA merged into the base while training, models/z_image/adapter.py) is read
#: for: Z-Image, whose Turbo is step-distilled.
TRAINING_ADAPTER_FAMILIES = frozenset({"z_image"})
#: Knobs of FLUX.2 Klein that Z-Image does not read yet (its separate files; vram_gb it reads: it has a memory plan, as
#: every family of MEMORY_PLAN_FAMILIES; blocks_to_swap it reads too: tests/test_block_swap.py proves its swap).
_KLEIN_ONLY = ("text_encoder_path", "vae_path", "tokenizer_path", "vram_gb")

#: Knobs of the SD families' DDPM UNet that mean nothing on a flow-matching transformer: (knob, what it does there).
_SD_ONLY = (
    ("prediction_type", "chooses between epsilon and v-prediction, and FLUX.2 Klein predicts the flow velocity"),
    ("snr_gamma", "weights DDPM timesteps by their signal-to-noise ratio (on FLUX.2 Klein, weighting_scheme "
                  "weights the timesteps)"),
    ("debiased_estimation_loss", "weights DDPM timesteps by their signal-to-noise ratio (on FLUX.2 Klein, "
                                 "weighting_scheme weights the timesteps)"),
    ("down_lr_scale", "scales the UNet's down blocks, which FLUX.2 Klein's transformer does not have"),
    ("mid_lr_scale", "scales the UNet's mid block, which FLUX.2 Klein's transformer does not have"),
    ("up_lr_scale", "scales the UNet's up blocks, which FLUX.2 Klein's transformer does not have"),
    ("train_text_encoder", "adapts the text encoder, and FLUX.2 Klein's Qwen3 text encoder stays frozen (Klein "
                           "LoRAs adapt the transformer only)"),
    ("text_encoder_lr", "is the text encoder's rate, and FLUX.2 Klein's Qwen3 text encoder stays frozen"),
    ("validation_sampler", "picks an SD sampler, and FLUX.2 Klein samples with its own flow-matching Euler "
                           "scheduler"),
    ("validation_ddim_eta", "belongs to the DDIM sampler, which FLUX.2 Klein does not use"),
    ("pivotal_tokens", "adds words to CLIP's token table, and FLUX.2 Klein's Qwen3 text encoder has no CLIP token "
                       "embeddings to train (pivotal tuning is for SD 1.x, SD 2.x and SDXL)"),
)
#: Knobs of the flow-matching objective, and of FLUX.2 Klein's separate files, that mean nothing on an SD model.
_FLOW_ONLY = ("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "flow_shift", "max_sequence_length",
              "text_encoder_path", "vae_path", "tokenizer_path", "blocks_to_swap", "vram_gb")
#: Knobs of how a flow transformer is kept in memory (block swap, the memory plan: not for the SD UNets yet).
MEMORY_KNOBS = ("blocks_to_swap", "vram_gb")
#: The families with a memory model, so a memory plan (vram_gb; models/memory_plan.py FAMILY_MEMORY_MODELS): SDXL
#: has one (models/sd/sdxl_memory.py) but no block swap. Declared once, in family_files.py (the UI reads it too).
MEMORY_PLAN_FAMILIES = PLANNED_FAMILIES
#: The knobs the memory plan (models/memory_plan.py) may choose when the user left them alone.
PLAN_KNOBS = ("cache_text_embeddings", "mixed_precision", "gradient_checkpointing", "base_storage", "blocks_to_swap",
              "train_batch_size", "gradient_accumulation_steps")
#: Knobs of how FLUX.2 Klein encodes its prompts, handed to the family's load() by these names (a set one only).
TEXT_KNOBS = ("max_sequence_length",)
#: The knobs naming a model's separate files (the family's load() takes them by these names minus "_path").
MODEL_FILE_KNOBS = ("text_encoder_path", "vae_path", "tokenizer_path")


def _default(config: Any, name: str) -> Any:
    return type(config).model_fields[name].default


def _leave(config: Any, name: str) -> str:
    default = _default(config, name)
    return "leave it empty" if default is None else f"leave it at {default!r}"


def _changed(config: Any, name: str) -> bool:
    """True when the knob holds something other than its default (defaults are never refused: a saved
    config.toml carries every knob)."""
    return getattr(config, name) != _default(config, name)


def _what_it_is(knob: str) -> str:
    if knob in MEMORY_KNOBS:
        return "its transformer's memory plan and block swap"
    if knob in MODEL_FILE_KNOBS:
        return "its separate model files"
    return "its Qwen3 prompt encoding" if knob in TEXT_KNOBS else "its flow-matching objective"


def family_problems(config: Any, family: str) -> list[str]:
    """One sentence per knob set on `config` (a TrainConfig) that does not apply to `family` ("sd1", ...,
    "flux2_klein"; "auto" is not judged: the set-up judges the detected family)."""
    if family == "auto":
        return []
    adapter = [f"training_adapter is set to {config.training_adapter!r}, but it is a LoRA merged into Z-Image while "
               f"training, and {FAMILY_NAMES.get(family, family)} takes none; leave it empty."
               ] if family not in TRAINING_ADAPTER_FAMILIES and _changed(config, "training_adapter") else []
    return adapter + _knob_problems(config, family)


def _knob_problems(config: Any, family: str) -> list[str]:
    if family in FLOW_FAMILIES:
        flow_name = _FLOW_NAMES[family]
        problems = [f"{name} is set to {getattr(config, name)!r}, but it {why.replace('FLUX.2 Klein', flow_name)}; "
                    f"{_leave(config, name)} for model_family {family}."
                    for name, why in _SD_ONLY if _changed(config, name)]
        if not is_flux2_klein(family):
            problems += [f"{name} is set to {getattr(config, name)!r}, but it belongs to FLUX.2 Klein "
                         f"({_what_it_is(name)}), which {flow_name} does not have yet; {_leave(config, name)}."
                         for name in _KLEIN_ONLY if _changed(config, name) and not _planned(name, family)]
        return problems
    return [f"{name} is set to {getattr(config, name)!r}, but it belongs to FLUX.2 Klein ("
            f"{_what_it_is(name)}) and "
            f"{FAMILY_NAMES.get(family, family)} has no such thing; {_leave(config, name)}."
            for name in _FLOW_ONLY if _changed(config, name) and not _planned(name, family)]


def _planned(knob: str, family: str) -> bool:
    """vram_gb on a family with a memory plan: it plans that family's run (models/memory_plan.py)."""
    return knob == "vram_gb" and family in MEMORY_PLAN_FAMILIES


def family_defaults(config: Any, family: str) -> dict[str, Any]:
    """The knobs whose schema default is an SD family's and which `family` replaces with its own (an update for
    `config.model_copy`); empty for the SD families, so their runs stay as they were."""
    if family not in FLOW_FAMILIES:
        return {}
    update: dict[str, Any] = {}
    if list(config.unet_lora_targets) == SD_LORA_TARGETS:
        update["unet_lora_targets"] = list(_FLOW_LORA_TARGETS[family])
    if config.validation_guidance_scale == type(config).model_fields["validation_guidance_scale"].default:
        # SD's 7.5 over-saturates a Klein base; 4.0 is Flux2KleinPipeline's own default (and the Klein presets'),
        # 5.0 ZImagePipeline's
        update["validation_guidance_scale"] = _FLOW_GUIDANCE[family]
    return update


def model_file_options(config: Any) -> dict[str, str]:
    """The separate model files a config names, as keyword arguments of the family's load() (text_encoder, vae,
    tokenizer); only set ones, so a family without such files is never handed one (family_problems refused it)."""
    return {name.removesuffix("_path"): getattr(config, name) for name in MODEL_FILE_KNOBS if getattr(config, name)}


def text_options(config: Any) -> dict[str, Any]:
    """How the family encodes prompts, as keyword arguments of its load() (max_sequence_length); only knobs set
    away from their default, so a family without them is never handed one (family_problems refused it) and a
    Klein run at the default encodes as it always did."""
    return {name: getattr(config, name) for name in TEXT_KNOBS if _changed(config, name)}
