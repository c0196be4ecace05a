"""Z-Image (Base and Turbo, Tongyi-MAI): a single-stream flow-matching transformer beside a frozen Qwen3 text encoder
and FLUX.1's VAE.

What differs from the other families, all of it behind the family face:

* denoiser: ``ZImageTransformer2DModel`` (in ``bundle.denoiser``). It takes lists (one
  [C, 1, H, W] latent and one [tokens, cap_feat_dim] caption per image: captions are not padded), patchifies 2 x 2
  itself, reads its timestep as 1 - sigma and predicts x0 - eps; the pipeline negates that, so call_transformer
  does too and the shared flow-matching objective (models/flow_matching.py, target eps - x0) trains it unchanged.
* text: Qwen3-4B, the text encoder FLUX.2 Klein 4B reads, through the same path (models/qwen3_text.py): the prompt
  as one user turn of Qwen3's chat template with thinking left on (no empty think block), padded to
  max_sequence_length, the second-to-last hidden state kept for the prompt's own tokens only, exactly as
  ``ZImagePipeline._encode_prompt``. The cache keeps the padded states and the mask; the mask drops the padding
  before the transformer sees them.
* latents: FLUX.1's AutoencoderKL (16 channels), (z - shift) x scale (models/base.py), the VAE's
  mode as for FLUX.2 Klein, so a latent cache does not change the random stream.
* LoRA: the transformer's Linear layers, exported under ``diffusion_model.`` + diffusers' module path (lora_down,
  lora_up, alpha): diffusers' ``ZImageLoraLoaderMixin`` reads it (``_convert_non_diffusers_z_image_lora_to_diffusers``
  strips the prefix and folds alpha), and ComfyUI's ``model_lora_keys_unet`` maps every such key of its Lumina2
  model (``z_image_to_diffusers``: q/k/v into slices of the fused qkv, to_out.0 to out).
* Turbo is step-distilled: LoRAs trained on it directly blur its 8-step output, so the family says so before
  training and names the way out (train on Base, preview on Turbo with preview_model). The two share every config
  file, so only the name tells them apart (``detect_distillation``).

Sources of truth (read, not copied): diffusers 0.42.1 ``pipelines/z_image/pipeline_z_image.py``,
``models/transformers/transformer_z_image.py``, ``loaders/lora_pipeline.py`` (ZImageLoraLoaderMixin),
``loaders/lora_conversion_utils.py``; ComfyUI's ``comfy/lora.py`` (Lumina2 branch) and ``comfy/utils.py``
(``z_image_to_diffusers``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...family_files import Z_IMAGE_PIPELINE, files_name_z_image
from ..base import (Conditioning, ModelBundle, ModelLoadError, denormalize_latents, flow_model_metadata,
                   load_errors_in_one_sentence, normalize_latents)
from ...lora.targets import lora_target_modules
from ..sources import check_source
from ..qwen3_text import MAX_SEQUENCE_LENGTH, caption_token_counter, check_tokenizer, text_length

PIPELINE_CLASS = Z_IMAGE_PIPELINE
#: The hidden state ZImagePipeline reads (hidden_states[-2]); its default prompt length is qwen3_text's.
TEXT_HIDDEN_STATE = -2
BASE_MODEL_REPO = "Tongyi-MAI/Z-Image"
TURBO_MODEL_REPO = "Tongyi-MAI/Z-Image-Turbo"
#: What the kohya file's keys start with: ai-toolkit's Z-Image LoRA names, read by diffusers and ComfyUI.
LORA_KEY_PREFIX = "diffusion_model."

# --------------------------------------------------------------------------- LoRA targets
ATTENTION = ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0"]
MLP = ["feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
LORA_PRESETS: dict[str, list[str]] = {
    "attention": ATTENTION,  # every block's attention: the main layers and both refiners
    "attention_mlp": ATTENTION + MLP,
}


# --------------------------------------------------------------------------- distilled or base
@dataclass(frozen=True)
class Distillation:
    """Whether a Z-Image model is Turbo (step-distilled) or Base, and what said so."""

    verdict: str  # "distilled", "base" or "unknown"
    evidence: str

    def sentence(self) -> str | None:
        """One sentence to show before training; None for Base (nothing to warn about)."""
        if self.verdict == "distilled":
            return (f"This is Z-Image-Turbo, the step-distilled model ({self.evidence}), and LoRAs trained on it "
                    f"blur its 8-step images: train on Z-Image Base ({BASE_MODEL_REPO}) and preview on Turbo with "
                    "preview_model, or merge a de-distilling adapter while training with training_adapter.")
        if self.verdict == "unknown":
            return (f"Could not tell whether this is Z-Image Base or Z-Image-Turbo ({self.evidence}); LoRAs trained "
                    f"on the distilled Turbo blur its images, so make sure it is Base ({BASE_MODEL_REPO}).")
        return None


def swappable_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """What block swap moves (models/block_swap.py), in the order the transformer runs them: the two noise refiners
    (image tokens), the two context refiners (caption tokens), then the 30 main layers over both. Swap keeps the last
    N, so the main layers go first; the refiners are as wide as a main layer (3840, the noise refiners with the same
    adaLN modulation, so nearly as heavy), so they are blocks too and N may reach 34. Each runs once per forward
    through the transformer's own gradient checkpointing, as Klein's blocks do, and the backward pass recomputes them
    in exactly the reverse order (the context refiners before the noise refiners: tests/test_block_swap.py counts
    it), so the shared hooks and their prefetch direction serve unchanged. The memory model prices these same blocks
    (memory.py stored_transformer)."""
    return [*model.noise_refiner, *model.context_refiner, *model.layers]


def detect_distillation(source: str | Path) -> Distillation:
    """Turbo and Base ship the same model_index, transformer, scheduler and VAE configs (only the weights differ),
    so the name decides: Tongyi-MAI names the distilled model ``Z-Image-Turbo`` (ComfyUI's repack
    ``z_image_turbo_bf16.safetensors``) and the base ``Z-Image``; a name with 'turbo' is Turbo, one naming Z-Image
    without it Base, anything else unknown (said, not guessed)."""
    name = Path(str(source).rstrip("/\\")).name
    lowered = name.lower().replace("-", "_").replace(" ", "_")
    if "turbo" in lowered:
        return Distillation("distilled", f"'{name}' is named as Tongyi-MAI names the distilled model")
    if "z_image" in lowered or "zimage" in lowered:
        return Distillation("base", f"'{name}' names Z-Image without 'Turbo'")
    return Distillation("unknown", f"'{name}' names neither Z-Image nor Z-Image-Turbo")


def looks_like_z_image(source: str | Path) -> bool:
    """Cheap test for detect_family: a diffusers folder whose model_index names ZImagePipeline, or a .safetensors
    Z-Image transformer (family_files.py: the rule the UI reads without torch)."""
    return files_name_z_image(source)


# --------------------------------------------------------------------------- the denoiser
def call_transformer(transformer, noisy: torch.Tensor, model_timestep: torch.Tensor, cond: Conditioning
                     ) -> torch.Tensor:
    """The velocity eps - x0 for [B, C, H, W] latents at `model_timestep` (sigma): the transformer reads 1 - sigma
    and predicts x0 - eps, each caption cut to its own tokens, as ZImagePipeline's denoising loop calls it."""
    mask = cond.added_cond_kwargs["attention_mask"].bool()
    captions = [embeds[keep] for embeds, keep in zip(cond.encoder_hidden_states, mask)]
    latents = list(noisy.unsqueeze(2).unbind(dim=0))
    out = transformer(latents, 1.0 - model_timestep, captions, return_dict=False)[0]
    return -torch.stack(out, dim=0).squeeze(2)


class ZImage:
    """The Z-Image family (Base and Turbo)."""

    name = "z_image"
    display_name = "Z-Image"
    objective_kind = "flow_matching"
    denoiser_name = "transformer"
    denoiser_folder = "transformer"
    lora_file_markers = ("z_image", "z-image")
    lora_module_prefixes = (LORA_KEY_PREFIX,)
    base_model_version = "z_image"
    modelspec_architecture = "Z-Image/lora"
    modelspec_implementation = "https://github.com/Tongyi-MAI/Z-Image"
    default_resolution = (1024, 1024)
    is_v2 = False
    plans_memory = True  # models/memory_plan.py (its memory model: z_image/memory.py)
    lora_presets = LORA_PRESETS
    unet_lora_targets = LORA_PRESETS["attention"]
    text_encoder_lora_targets: list[str] = []  # Qwen3 stays frozen: Z-Image LoRAs adapt the transformer only
    text_encoder_kohya_prefixes: list[str] = []
    text_encoder_parts = ("text_encoder",)
    tokenizer_parts = ("tokenizer",)
    diffusers_pipeline_class = PIPELINE_CLASS
    diffusers_lora_layers_argument = "transformer_lora_layers"
    diffusers_lora_uses_peft_names = True  # lora_A / lora_B with alpha folded, as for FLUX.2 Klein (lora/export.py)
    # kohya files: "diffusion_model." + the diffusers module path (kohya_denoiser_name)
    fused_lora_export = None  # one kohya name per module
    denoiser_has_convolutions = False  # the transformer's layers are all Linear
    single_file_merges_into_folder = True  # from model_config_dir, the diffusers folder its single files need

    # ------------------------------------------------------------------ load
    def load(self, source: str | Path, *, local_files_only: bool = True, config_dir: str | Path | None = None,
             torch_dtype: torch.dtype = torch.float32, max_sequence_length: int = MAX_SEQUENCE_LENGTH,
             **files: Any) -> ModelBundle:
        """A Z-Image diffusers folder (Base or Turbo), or its transformer as one file (ComfyUI's
        z_image_turbo_bf16.safetensors, original or diffusers names) with the rest read from `config_dir`, a Z-Image
        diffusers folder (models/z_image/single_file.py). Bad input raises ModelLoadError, one sentence."""
        if any(files.values()):
            raise ModelLoadError("Z-Image reads its text encoder, VAE and tokenizer from a diffusers folder "
                                 "(text_encoder_path, vae_path and tokenizer_path are for FLUX.2 Klein); leave them "
                                 "empty and, for a single transformer file, set model_config_dir to that folder.")
        kind, path = check_source(source, local_files_only=local_files_only)
        if config_dir and kind != "file":
            raise ModelLoadError("model_config_dir names the folder a single Z-Image transformer file reads its "
                                 "other parts from, and the base model is already a folder; leave it empty.")
        if kind == "folder" and not looks_like_z_image(path):
            raise ModelLoadError(f"'{path}' is not a Z-Image diffusers folder (its model_index.json does not name "
                                 f"{PIPELINE_CLASS}); choose its own model family (or model_family auto).")
        where = str(path) if path is not None else str(source)
        with load_errors_in_one_sentence(source, self.display_name):
            if kind == "file":
                parts = self._load_single_file(path, config_dir, torch_dtype)
            else:
                parts = self._load_diffusers(where, local_files_only, torch_dtype)
        check_tokenizer(parts["tokenizer"], parts["text_encoder"])
        width = parts["text_encoder"].config.hidden_size
        wanted = parts["transformer"].config["cap_feat_dim"]
        if width != wanted:
            raise ModelLoadError(f"The text encoder in '{where}' is {width} wide but the transformer reads "
                                 f"{wanted}-wide captions; Z-Image needs Qwen3-4B's text encoder (2560).")
        for m in (parts["transformer"], parts["vae"], parts["text_encoder"]):
            m.requires_grad_(False)
            m.eval()
        return ModelBundle(family=self, denoiser=parts["transformer"], vae=parts["vae"],
                           text_encoders=[parts["text_encoder"]], tokenizers=[parts["tokenizer"]],
                           noise_scheduler=parts["scheduler"], source=str(source),
                           extra={"source_kind": kind, "distillation": detect_distillation(source),
                                  "max_sequence_length": max_sequence_length})

    @staticmethod
    def _load_diffusers(where: str, local_files_only: bool, torch_dtype, skip: tuple[str, ...] = ()
                        ) -> dict[str, Any]:
        """The parts of a Z-Image diffusers folder, less those in `skip` (a single file brings its transformer)."""
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
        from transformers import Qwen2TokenizerFast, Qwen3ForCausalLM

        kw = {"local_files_only": local_files_only}
        loaders = {
            "transformer": lambda: ZImageTransformer2DModel.from_pretrained(where, subfolder="transformer",
                                                                            torch_dtype=torch_dtype, **kw),
            "scheduler": lambda: FlowMatchEulerDiscreteScheduler.from_pretrained(where, subfolder="scheduler", **kw),
            "vae": lambda: AutoencoderKL.from_pretrained(where, subfolder="vae", torch_dtype=torch_dtype, **kw),
            "text_encoder": lambda: Qwen3ForCausalLM.from_pretrained(where, subfolder="text_encoder",
                                                                     dtype=torch_dtype, **kw),
            "tokenizer": lambda: Qwen2TokenizerFast.from_pretrained(where, subfolder="tokenizer", **kw),
        }
        return {name: load() for name, load in loaders.items() if name not in skip}

    def _load_single_file(self, path: Path, companions: str | Path | None, torch_dtype) -> dict[str, Any]:
        """The transformer from one file (models/z_image/single_file.py), the rest from `companions`, a Z-Image
        diffusers folder (its transformer weights are not read, its config is); checked before anything loads."""
        from .single_file import check_transformer_file, load_transformer_file

        shapes = check_transformer_file(path)
        if not companions:
            raise ModelLoadError(f"'{path.name}' holds Z-Image's transformer only, and Z-Image also needs its Qwen3 "
                                 "text encoder, VAE and tokenizer: set model_config_dir to a Z-Image diffusers folder "
                                 f"({BASE_MODEL_REPO} layout), which StableTune reads them from.")
        folder = Path(str(companions)).expanduser()
        if not looks_like_z_image(folder):
            raise ModelLoadError(f"model_config_dir '{folder}' is not a Z-Image diffusers folder (no model_index.json "
                                 f"naming {PIPELINE_CLASS}); point it at one ({BASE_MODEL_REPO} layout).")
        missing = next((p for p in ("transformer", "scheduler", "vae", "text_encoder", "tokenizer")
                        if not (folder / p).is_dir()), None)
        if missing:
            raise ModelLoadError(f"'{folder}' has no {missing}/ folder, which '{path.name}' needs beside it; use a "
                                 f"complete Z-Image diffusers folder ({BASE_MODEL_REPO} layout) as model_config_dir.")
        transformer = load_transformer_file(path, shapes, folder / "transformer", torch_dtype)
        return {**self._load_diffusers(str(folder), True, torch_dtype, skip=("transformer",)),
                "transformer": transformer}

    def distillation_note(self, bundle: ModelBundle) -> str | None:
        return bundle.extra["distillation"].sentence()

    # ---------------------------------------------------------------- encode
    def encode_text(self, bundle: ModelBundle, prompts: list[str]) -> dict[str, torch.Tensor]:
        """{"prompt_embeds": [B, max_sequence_length, hidden], "attention_mask": [B, max_sequence_length]}: the
        pipeline's second-to-last hidden state, padded; the mask says which rows are the prompt's."""
        from ..qwen3_text import qwen3_hidden_states

        te = bundle.text_encoders[0]
        hidden, mask = qwen3_hidden_states(bundle.tokenizers[0], te, prompts, max_length=text_length(bundle),
                                           enable_thinking=True)
        return {"prompt_embeds": hidden[TEXT_HIDDEN_STATE].to(te.dtype), "attention_mask": mask.long()}

    def make_conditioning(self, bundle: ModelBundle, text: dict[str, torch.Tensor], sizes: Any = None
                          ) -> Conditioning:
        embeds = text["prompt_embeds"]
        return Conditioning(encoder_hidden_states=embeds,
                            added_cond_kwargs={"attention_mask": text["attention_mask"].to(embeds.device)})

    def encode_prompts(self, bundle: ModelBundle, prompts: list[str], *, sizes: Any = None) -> Conditioning:
        return self.make_conditioning(bundle, self.encode_text(bundle, prompts), sizes)

    @torch.no_grad()
    def encode_latents(self, bundle: ModelBundle, pixels: torch.Tensor, *,
                       generator: torch.Generator | None = None) -> torch.Tensor:
        """Pixels in [-1, 1] -> normalised latents, fp32: the VAE's mode (`generator` is not drawn from)."""
        vae = bundle.vae
        return self.normalize_raw_latents(bundle, vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode())

    def normalize_raw_latents(self, bundle: ModelBundle, raw: torch.Tensor) -> torch.Tensor:
        """(z - shift) x scaling, the VAE config's shift and scaling factors (models/base.py normalize_latents)."""
        return normalize_latents(bundle.vae, raw)

    def decode_latents(self, bundle: ModelBundle, latents: torch.Tensor) -> torch.Tensor:
        vae = bundle.vae
        return vae.decode(denormalize_latents(vae, latents.to(vae.device)), return_dict=False)[0]

    def decode_sampled(self, bundle: ModelBundle, latents: torch.Tensor) -> torch.Tensor:
        """ZImagePipeline's output_type="latent" is the transformer's own (normalised) latents."""
        return self.decode_latents(bundle, latents)

    def latent_downscale(self, bundle: ModelBundle) -> int:
        return 2 ** (len(bundle.vae.config.block_out_channels) - 1)

    def objective(self, bundle: ModelBundle, options: Any):
        from ..flow_matching import FlowMatching

        return FlowMatching.for_run(bundle.noise_scheduler.config, options, call_transformer)

    def lora_target_modules(self, model: torch.nn.Module, targets: list[str]) -> list[str]:
        return lora_target_modules(model, targets)

    def swappable_blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return swappable_blocks(model)

    # -------------------------------------------------------------- pipeline
    def make_pipeline(self, bundle: ModelBundle, scheduler=None):
        from diffusers import ZImagePipeline

        return ZImagePipeline(scheduler=scheduler if scheduler is not None else bundle.noise_scheduler,
                              vae=bundle.vae, text_encoder=bundle.text_encoders[0], tokenizer=bundle.tokenizers[0],
                              transformer=bundle.denoiser)

    def validation_sampler(self, bundle: ModelBundle, options: Any) -> tuple[Any, dict[str, Any]]:
        """Z-Image's own FlowMatchEulerDiscreteScheduler (a copy) and the run's prompt length."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return (FlowMatchEulerDiscreteScheduler.from_config(bundle.noise_scheduler.config),
                {"max_sequence_length": text_length(bundle)})

    def caption_tokens(self, model: Path | None, *, max_sequence_length: int = MAX_SEQUENCE_LENGTH
                       ) -> tuple[Any, int, str]:
        """Qwen3 counts of the whole prompt (the chat template around the caption) against max_sequence_length,
        with the tokenizer of a Z-Image folder."""
        from transformers import Qwen2TokenizerFast

        folder = Path(model) / "tokenizer" if model is not None else None
        if folder is None or not (folder / "tokenizer_config.json").is_file():
            raise ModelLoadError("Counting caption tokens for Z-Image needs Qwen3's tokenizer: give --model a "
                                 "Z-Image diffusers folder.")
        tokenizer = Qwen2TokenizerFast.from_pretrained(str(folder), local_files_only=True)

        return caption_token_counter(tokenizer, enable_thinking=True), max_sequence_length, f"the Qwen3 tokenizer in {folder}"

    def load_notes(self, bundle: ModelBundle) -> list[str]:
        """Which model this is (Base, Turbo or not known, and why), then the Turbo warning when there is one."""
        distillation = bundle.extra["distillation"]
        kind = {"distilled": "Z-Image-Turbo (step-distilled)", "base": "Z-Image Base"}.get(
            distillation.verdict, "Z-Image (Base or Turbo: not known)")
        name = Path(str(bundle.source).rstrip("/\\")).name or str(bundle.source)
        warning = bundle.extra.get("training_adapter") or self.distillation_note(bundle)  # an adapter is the way out
        return [f"Loaded {name} as {kind} ({distillation.evidence})."] + ([warning] if warning else [])

    # -------------------------------------------------------------- metadata
    def metadata(self, bundle: ModelBundle) -> dict[str, str]:
        return flow_model_metadata(self, bundle)

    def kohya_denoiser_name(self, module_path: str, denoiser: torch.nn.Module) -> str:
        """diffusers' module path under ai-toolkit's diffusion_model. prefix (what ComfyUI maps)."""
        return LORA_KEY_PREFIX + module_path

    def single_file_config_dir(self, path: Path) -> None:
        """None: a Z-Image single file is the transformer alone (ComfyUI's layout); model_config_dir names the rest."""
        return None

    def original_state_dict(self, bundle: ModelBundle, components: set[str]) -> dict[str, torch.Tensor]:
        """Z-Image has no single-file layout here yet (the family loads diffusers folders only)."""
        raise ModelLoadError("StableTune cannot write a Z-Image model as one single file yet; give an output path "
                             "without .safetensors to write a diffusers folder.")

    def full_original_state_dict(self, bundle: ModelBundle) -> dict[str, torch.Tensor]:
        return self.original_state_dict(bundle, {"unet"})

