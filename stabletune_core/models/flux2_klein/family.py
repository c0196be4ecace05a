"""FLUX.2 Klein (4B and 9B): a flow-matching transformer with a frozen Qwen3 text encoder and the FLUX.2 VAE.

What differs from the SD families, all of it behind the family face:

* denoiser: ``Flux2Transformer2DModel`` (``bundle.denoiser``) over packed latent
  tokens, with 4-D position ids for text and image tokens; Klein has no guidance embedding.
* objective: rectified flow (models/flow_matching.py): x_t = (1 - sigma) x0 + sigma eps, target eps - x0.
* text: Qwen3 (4B for Klein 4B, 8B for 9B). A prompt is wrapped in Qwen3's chat template (user turn, assistant turn
  with an empty think block), padded to max_sequence_length tokens (the pipeline's 512 unless the config sets
  another), and the hidden states of layers 9, 18 and 27 are stacked along
  the feature axis (3 x 2560 = 7680 wide for 4B), exactly as ``Flux2KleinPipeline._get_qwen3_prompt_embeds``.
* latents: the VAE's mode (not a sample), patchified 2 x 2 (32 -> 128 channels, 1/16 of the image side) and
  normalised with the VAE's own batch-norm statistics, as the pipeline and diffusers' Klein script do.
* LoRA: the transformer's Linear layers; exported with the BFL names ComfyUI and diffusers read (models/flux2_klein/lora.py).
* distilled vs base: the step-distilled Klein is a poor base for LoRAs (they come out grey or generic); the family
  says which one it was given (``detect_distillation``) before any training.

Sources of truth (read, not copied): diffusers 0.42.1 ``pipelines/flux2/pipeline_flux2_klein.py``,
``examples/dreambooth/train_dreambooth_lora_flux2_klein.py``, ``loaders/single_file_utils.py``; ComfyUI's
``comfy/text_encoders/flux.py``, ``comfy/model_detection.py``, ``comfy/sd.py``; BFL's ``flux2`` parameters.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ...family_files import files_name_klein, flux2_file_kind
from ...lora.targets import lora_target_modules
from ..base import Conditioning, ModelBundle, ModelLoadError, flow_model_metadata, load_errors_in_one_sentence
from ..qwen3_text import (MAX_SEQUENCE_LENGTH, QWEN3_CHAT_TEMPLATE, caption_token_counter, check_tokenizer,
                          text_length)
from ..sources import check_source, safetensors_header

CONFIGS_DIR = Path(__file__).parent / "configs"
SHIPPED_CONFIGS = {"4b": CONFIGS_DIR / "flux2-klein-4b", "9b": CONFIGS_DIR / "flux2-klein-9b"}
VARIANT_NAMES = {"4b": "FLUX.2 Klein 4B", "9b": "FLUX.2 Klein 9B"}
RELEASED_WIDTHS = (3072, 4096)  # the transformers' hidden sizes: Klein 4B, Klein 9B (the shipped configs)
TEXT_ENCODER_NAMES = {"4b": "Qwen3-4B (qwen_3_4b.safetensors)", "9b": "Qwen3-8B (qwen_3_8b.safetensors)"}
BASE_MODEL_FILES = {"4b": "flux-2-klein-base-4b.safetensors", "9b": "flux-2-klein-base-9b.safetensors"}
BASE_MODEL_REPOS = {"4b": "black-forest-labs/FLUX.2-klein-base-4B", "9b": "black-forest-labs/FLUX.2-klein-base-9B"}

#: Flux2KleinPipeline's defaults: which hidden states are stacked and how long the padded prompt is (the latter is
#: the config's max_sequence_length, which the bundle carries: text_length()).
TEXT_ENCODER_OUT_LAYERS = (9, 18, 27)
#: What Qwen3's chat template renders for one user prompt with add_generation_prompt and enable_thinking=False
#: (ComfyUI's KleinTokenizer writes the same text). A tokenizer whose own template renders something else (e.g.
#: ComfyUI's bundled Qwen2.5 tokenizer, which adds a default system turn) is given qwen3_text.py's template instead.
KLEIN_PROMPT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
#: The guidance value fed to a transformer that has a guidance embedding (FLUX.2 [dev]; Klein has none), as the
#: diffusers script's --guidance_scale default.
TRAINING_GUIDANCE = 3.5

# --------------------------------------------------------------------------- LoRA targets
DOUBLE_ATTENTION = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",  # image stream
                    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]  # text stream
DOUBLE_MLP = ["ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out"]
#: A single block computes attention and MLP side by side through two fused layers: q, k, v and the MLP input are
#: one Linear, the attention and MLP outputs another. They cannot be split, so every preset adapts both.
SINGLE = ["attn.to_qkv_mlp_proj", "single_transformer_blocks.*.attn.to_out"]
LORA_PRESETS: dict[str, list[str]] = {
    "attention": DOUBLE_ATTENTION + SINGLE,
    "attention_mlp": DOUBLE_ATTENTION + DOUBLE_MLP + SINGLE,
    # diffusers' train_dreambooth_lora_flux2_klein.py default: image-stream attention of the double blocks
    "diffusers_default": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"] + SINGLE,
}


#: Keys a quantised checkpoint stores beside its weights (ComfyUI's fp8 "scaled" files, torchao / bitsandbytes).
QUANTISED_KEY_SUFFIXES = ("weight_scale", "scale_weight", "comfy_quant", "input_scale", ".absmax", ".quant_map",
                          ".quant_state.bitsandbytes__nf4", ".SCB")


def is_quantised(keys) -> bool:
    """True when a checkpoint's keys say its weights are already quantised."""
    return any(str(k).endswith(QUANTISED_KEY_SUFFIXES) for k in keys)


# --------------------------------------------------------------------------- distilled or base
@dataclass(frozen=True)
class Distillation:
    """Whether a Klein checkpoint is the step-distilled model or the base, and what said so."""

    verdict: str  # "distilled", "base" or "unknown"
    evidence: str  # e.g. "model_index.json says is_distilled: true"

    def sentence(self, variant: str = "4b") -> str | None:
        """One sentence to show before training; None for the base model (nothing to warn about)."""
        base = f"FLUX.2 Klein base ({BASE_MODEL_FILES[variant]} or {BASE_MODEL_REPOS[variant]})"
        if self.verdict == "distilled":
            return (f"This is the step-distilled {VARIANT_NAMES[variant]} ({self.evidence}), and LoRAs trained on it "
                    f"come out grey or generic: train on {base} and preview on the distilled model with "
                    "preview_model.")
        if self.verdict == "unknown":
            return (f"Could not tell whether this is {VARIANT_NAMES[variant]} base or the step-distilled model "
                    f"({self.evidence}); LoRAs trained on the distilled one come out grey or generic, so make sure "
                    f"it is {base}.")
        return None


def detect_distillation(source: str | Path, metadata: dict[str, str] | None = None) -> Distillation:
    """diffusers decides by model_index.json's ``is_distilled`` (its modular pipelines switch on it); the weights
    cannot tell (both have the same keys and shapes, neither a guidance embedding), so a single file is judged by
    the name BFL gave it (``flux-2-klein-4b`` is distilled, ``flux-2-klein-base-4b`` is not) or by its metadata."""
    path = Path(str(source)).expanduser()
    index = path / "model_index.json"
    if path.is_dir() and index.is_file():
        data = json.loads(index.read_text())
        if "is_distilled" in data:
            flag = bool(data["is_distilled"])
            return Distillation("distilled" if flag else "base",
                                f"its model_index.json says is_distilled: {str(flag).lower()}")
    texts = [str(v).lower() for k, v in (metadata or {}).items() if "title" in k or "name" in k or "desc" in k]
    for text in texts:
        if "klein" in text and "base" in text:
            return Distillation("base", "its metadata names the base model")
        if "distill" in text:
            return Distillation("distilled", "its metadata says distilled")
    name = path.name.lower()
    if "klein" in name:
        if "base" in name:
            return Distillation("base", f"'{path.name}' is named as BFL names the base model")
        return Distillation("distilled", f"'{path.name}' is named as BFL names the distilled model, without 'base'")
    return Distillation("unknown", "neither a model_index.json flag nor a BFL file name says which")


# --------------------------------------------------------------------------- latents
def patchify(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, 4C, H/2, W/2] (Flux2KleinPipeline._patchify_latents)."""
    from diffusers import Flux2KleinPipeline

    return Flux2KleinPipeline._patchify_latents(latents)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    from diffusers import Flux2KleinPipeline

    return Flux2KleinPipeline._unpatchify_latents(latents)


def latent_stats(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the patchified latents, from the VAE's batch norm, shaped [1, 4C, 1, 1] like `like`."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
    return mean, std


def normalize_latents(vae, raw: torch.Tensor) -> torch.Tensor:
    """VAE latents [B, C, H, W] -> what the transformer is trained on: patchified and normalised."""
    packed = patchify(raw)
    mean, std = latent_stats(vae, packed)
    return (packed - mean) / std


def denormalize_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """The inverse of normalize_latents (what the pipeline does before decoding)."""
    mean, std = latent_stats(vae, latents)
    return unpatchify(latents * std + mean)


def call_transformer(transformer, noisy: torch.Tensor, model_timestep: torch.Tensor, cond: Conditioning
                     ) -> torch.Tensor:
    """The transformer's velocity for [B, C, H, W] latents: packed into H x W tokens with their position ids,
    cropped to the image tokens and scattered back, as diffusers' Klein script does."""
    from diffusers import Flux2KleinPipeline

    extra = cond.added_cond_kwargs or {}
    img_ids = Flux2KleinPipeline._prepare_latent_ids(noisy).to(noisy.device)
    tokens = Flux2KleinPipeline._pack_latents(noisy)
    out = transformer(hidden_states=tokens, timestep=model_timestep, guidance=extra.get("guidance"),
                      encoder_hidden_states=cond.encoder_hidden_states, txt_ids=extra["txt_ids"], img_ids=img_ids,
                      return_dict=False)[0]
    out = out[:, : tokens.size(1)]
    return Flux2KleinPipeline._unpack_latents_with_ids(out, img_ids, noisy.shape[2], noisy.shape[3])


# --------------------------------------------------------------------------- reading what the user gave
def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


SD_MARKERS = ("model.diffusion_model.input_blocks.", "conditioner.embedders.", "cond_stage_model.",
              "first_stage_model.", "down_blocks.0.resnets.0.conv1.weight")


def checkpoint_kind(keys: dict[str, tuple[int, ...]] | set[str]) -> str:
    """'klein', 'flux2_dev', 'sd' or 'other' for a single file's keys (ComfyUI's and diffusers' markers)."""
    kind = flux2_file_kind(keys)
    if kind:
        return kind
    if any(k.startswith(SD_MARKERS) for k in keys):
        return "sd"
    return "other"


def looks_like_klein(source: str | Path) -> bool:
    """Cheap test for detect_family: a Klein diffusers folder or a BFL Klein transformer file (family_files.py: the
    rule the UI reads too)."""
    return files_name_klein(source)


def _comfy_root(path: Path) -> Path | None:
    """The ComfyUI folder a model file lives in (the parent of its ``models/``), if it does."""
    return next((parent.parent for parent in path.resolve().parents if parent.name == "models"), None)


Shapes = dict[str, tuple[int, ...]]


def _find_beside(transformer: Path, folder: str, fits: Callable[[Shapes], bool]) -> Path | None:
    """The first .safetensors file in ComfyUI's ``models/<folder>`` (of the ComfyUI the transformer lives in) whose
    keys and shapes `fits` accepts; None when there is no such folder or file. Only headers are read."""
    root = _comfy_root(transformer)
    where = root / "models" / folder if root else None
    if where is None or not where.is_dir():
        return None
    for candidate in sorted(where.glob("*.safetensors")):
        try:
            shapes, _ = safetensors_header(candidate)
        except (OSError, ValueError):
            continue
        if fits(shapes):
            return candidate
    return None


def _is_qwen3_of_width(hidden: int) -> Callable[[Shapes], bool]:
    """A Qwen3 text encoder of the width the transformer reads (Qwen3 has q_norm; Qwen2.5 does not)."""
    def fits(shapes: Shapes) -> bool:
        norm = shapes.get("model.layers.0.post_attention_layernorm.weight")
        return "model.layers.0.self_attn.q_norm.weight" in shapes and bool(norm) and norm[0] == hidden
    return fits


def _is_flux2_vae(shapes: Shapes) -> bool:
    """The FLUX.2 VAE: the only LDM-layout VAE with a batch norm over its latents."""
    return "bn.running_mean" in shapes and "decoder.conv_in.weight" in shapes


def _find_tokenizer(transformer: Path, text_encoder: Path | None) -> Path | None:
    if text_encoder is not None and text_encoder.is_dir():
        for folder in (text_encoder, text_encoder.parent / "tokenizer"):
            if (folder / "tokenizer_config.json").is_file():
                return folder
    root = _comfy_root(transformer)
    if root is not None:
        shipped = root / "comfy" / "text_encoders" / "qwen25_tokenizer"  # Qwen's BPE, bundled with ComfyUI
        if (shipped / "vocab.json").is_file():
            return shipped
    return None


class Flux2Klein:
    """The FLUX.2 Klein family (4B and 9B, base and distilled)."""

    name = "flux2_klein"
    display_name = "FLUX.2 Klein"
    objective_kind = "flow_matching"
    denoiser_name = "transformer"
    denoiser_folder = "transformer"
    lora_file_markers = ("flux2_klein", "flux.2-klein")  # ai-toolkit's ss_base_model_version, musubi's modelspec
    # BFL's block names (LoRA) and the LyCORIS names of diffusers' paths (DoRA, LoHa): models/flux2_klein/lora.py
    lora_module_prefixes = ("lora_unet_double_blocks", "lora_unet_single_blocks", "lycoris_transformer_blocks",
                            "lycoris_single_transformer_blocks")
    # Until a model is loaded the family describes Klein 4B; load() and metadata() follow the model's width.
    variant = "4b"
    base_model_version = "flux2_klein_4b"  # what ai-toolkit writes into ss_base_model_version
    modelspec_architecture = "Flux.2-klein-4b/lora"  # what kohya's musubi-tuner writes
    modelspec_implementation = "https://github.com/black-forest-labs/flux2"
    default_resolution = (1024, 1024)
    is_v2 = False
    plans_memory = True  # models/memory_plan.py (its memory model: flux2_memory.py)
    lora_presets = LORA_PRESETS
    unet_lora_targets = LORA_PRESETS["attention"]
    text_encoder_lora_targets: list[str] = []  # Qwen3 stays frozen: Klein LoRAs adapt the transformer only
    text_encoder_kohya_prefixes: list[str] = []
    text_encoder_parts = ("text_encoder",)
    tokenizer_parts = ("tokenizer",)
    diffusers_pipeline_class = "Flux2KleinPipeline"
    diffusers_lora_layers_argument = "transformer_lora_layers"  # the save_lora_weights argument for the denoiser
    diffusers_lora_uses_peft_names = True  # lora_A / lora_B, as diffusers' Klein script saves (see lora/export.py)
    denoiser_has_convolutions = False  # the transformer's layers are all Linear
    single_file_merges_into_folder = False  # the shipped config trees hold no tokenizer

    @property
    def fused_lora_export(self):
        """kohya files in BFL's module names, q/k/v fused (LoRA), or LyCORIS names (DoRA, LoHa, LoKr): this folder's
        lora.py, which lora/export.py and tools/lora_file.py ask for."""
        from .lora import FUSED_EXPORT

        return FUSED_EXPORT

    def single_file_config_dir(self, path: Path) -> None:
        """None: a FLUX.2 single file is the transformer alone, and the shipped config trees lack its tokenizer."""
        return None

    # ------------------------------------------------------------------ load
    def load(self, source: str | Path, *, local_files_only: bool = True, config_dir: str | Path | None = None,
             torch_dtype: torch.dtype = torch.float32, text_encoder: str | Path | None = None,
             tokenizer: str | Path | None = None, vae: str | Path | None = None,
             max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> ModelBundle:
        """A Klein diffusers folder (or hub id when allowed), or the BFL transformer file with its text encoder,
        VAE and tokenizer given or found where ComfyUI keeps them; every prompt is then encoded at
        `max_sequence_length` tokens (training, cached embeddings, validation images). Bad input raises
        ModelLoadError, one sentence."""
        kind, path = check_source(source, local_files_only=local_files_only)
        given = {k: Path(str(v)).expanduser() if v else None
                 for k, v in (("text_encoder", text_encoder), ("tokenizer", tokenizer), ("vae", vae))}
        for what, where in given.items():
            if where is not None and not where.exists():
                raise ModelLoadError(f"The {what.replace('_', ' ')} '{where}' was not found.")
        with load_errors_in_one_sentence(source, self.display_name):
            if kind == "file":
                parts = self._load_single_file(path, config_dir, given, torch_dtype)
            else:
                parts = self._load_diffusers(str(path) if path is not None else str(source), local_files_only,
                                             given, torch_dtype)
        check_tokenizer(parts["tokenizer"], parts["text_encoder"])
        replaced = use_klein_chat_template(parts["tokenizer"])
        for m in (parts["transformer"], parts["vae"], parts["text_encoder"]):
            m.requires_grad_(False)
            m.eval()
        bundle = ModelBundle(family=self, denoiser=parts["transformer"], vae=parts["vae"],
                             text_encoders=[parts["text_encoder"]], tokenizers=[parts["tokenizer"]],
                             noise_scheduler=parts["scheduler"], source=str(source),
                             extra={"source_kind": kind, "distillation": parts["distillation"],
                                    "chat_template_replaced": replaced, "max_sequence_length": max_sequence_length})
        self.describe(bundle)
        return bundle

    def _load_diffusers(self, where: str, local_files_only: bool, given: dict, torch_dtype) -> dict[str, Any]:
        from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

        folder = Path(where)
        if folder.is_dir():
            index = json.loads((folder / "model_index.json").read_text())
            cls = str(index.get("_class_name", ""))
            if not cls.startswith("Flux2Klein"):
                what = "FLUX.2 [dev], whose Mistral text encoder Klein does not use" if cls.startswith("Flux2") \
                    else f"a {cls or 'diffusers'} model"
                raise ModelLoadError(f"'{folder}' is {what}, not FLUX.2 Klein; choose its own model family "
                                     "(or model_family auto).")
            if given["text_encoder"] is None and not (folder / "text_encoder").is_dir():
                raise ModelLoadError(f"'{folder}' has no text_encoder/ folder, and FLUX.2 Klein needs its Qwen3 text "
                                     "encoder; add it or pass text_encoder.")
            transformer_config = folder / "transformer" / "config.json"
            if transformer_config.is_file() and "quantization_config" in json.loads(transformer_config.read_text()):
                raise ModelLoadError(f"'{folder}' holds an already-quantised transformer (its config has a "
                                     "quantization_config), and StableTune trains on the bf16 weights and quantises "
                                     "them itself: use the bf16 Klein folder and set base_storage int8, nf4 or fp8.")
        kw = {"local_files_only": local_files_only}
        parts = {
            "transformer": Flux2Transformer2DModel.from_pretrained(where, subfolder="transformer",
                                                                   torch_dtype=torch_dtype, **kw),
            "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(where, subfolder="scheduler", **kw),
            "distillation": detect_distillation(where),
        }
        parts["vae"] = (self._vae_file(given["vae"], where, torch_dtype) if given["vae"] else
                        AutoencoderKLFlux2.from_pretrained(where, subfolder="vae", torch_dtype=torch_dtype, **kw))
        if given["text_encoder"]:
            parts["text_encoder"] = self._text_encoder(given["text_encoder"], where, torch_dtype, local_files_only)
        else:
            from transformers import Qwen3ForCausalLM

            parts["text_encoder"] = Qwen3ForCausalLM.from_pretrained(where, subfolder="text_encoder",
                                                                     dtype=torch_dtype, **kw)
        if given["tokenizer"]:
            parts["tokenizer"] = self._tokenizer(given["tokenizer"], local_files_only)
        else:
            from transformers import Qwen2TokenizerFast

            parts["tokenizer"] = Qwen2TokenizerFast.from_pretrained(where, subfolder="tokenizer", **kw)
        return parts

    def _load_single_file(self, path: Path, config_dir, given: dict, torch_dtype) -> dict[str, Any]:
        from accelerate import init_empty_weights
        from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

        from .single_file import bfl_shape_facts, transformer_config_facts, transformer_from_bfl

        shapes, metadata = safetensors_header(path)
        kind = checkpoint_kind(shapes)
        if kind == "sd":
            raise ModelLoadError(f"'{path.name}' is a Stable Diffusion checkpoint, not FLUX.2 Klein; choose the "
                                 "sd1, sd2 or sdxl model family (or model_family auto).")
        if kind == "flux2_dev":
            raise ModelLoadError(f"'{path.name}' is FLUX.2 [dev] (it has a guidance embedding), not FLUX.2 Klein, "
                                 "which StableTune trains.")
        if kind != "klein":
            raise ModelLoadError(f"'{path.name}' is not a FLUX.2 Klein transformer (it lacks the FLUX.2 keys such as "
                                 "double_stream_modulation_img.lin.weight); point at flux-2-klein-base-4b.safetensors "
                                 "or a Klein diffusers folder.")
        if is_quantised(shapes):
            raise ModelLoadError(f"'{path.name}' is already quantised (it stores weight scales), and StableTune trains "
                                 "on the bf16 file and quantises it itself: use flux-2-klein-base-4b.safetensors (or "
                                 "9b) and set base_storage int8, nf4 or fp8.")
        facts = bfl_shape_facts(shapes)
        config_dir = Path(config_dir) if config_dir else self._config_for(facts, path)
        config = Flux2Transformer2DModel.load_config(str(config_dir / "transformer"))
        if transformer_config_facts(config) != facts:
            raise ModelLoadError(f"'{path.name}' does not match the config in '{config_dir}' "
                                 f"(file: {facts}, config: {transformer_config_facts(config)}).")
        variant = "9b" if facts["hidden_size"] == 4096 else "4b"
        te_path = given["text_encoder"] or _find_beside(path, "text_encoders",
                                                         _is_qwen3_of_width(config_dir_text_hidden(config_dir)))
        if te_path is None:
            raise ModelLoadError(
                f"FLUX.2 Klein needs its Qwen3 text encoder and none was found for '{path.name}': pass text_encoder "
                f"(the {TEXT_ENCODER_NAMES[variant]} file ComfyUI keeps in models/text_encoders, or a Qwen3 folder).")
        vae_path = given["vae"] or _find_beside(path, "vae", _is_flux2_vae)
        if vae_path is None:
            raise ModelLoadError(f"FLUX.2 Klein needs the FLUX.2 VAE and none was found for '{path.name}': pass vae "
                                 "(flux2-vae.safetensors, which ComfyUI keeps in models/vae).")
        tok_path = given["tokenizer"] or _find_tokenizer(path, te_path)
        if tok_path is None:
            raise ModelLoadError(
                "FLUX.2 Klein needs the Qwen3 tokenizer and none was found: pass tokenizer (a folder with Qwen3's "
                "tokenizer files, such as ComfyUI/comfy/text_encoders/qwen25_tokenizer or a Qwen3 model's folder).")
        with init_empty_weights():
            transformer = Flux2Transformer2DModel.from_config(config)
        state = {k: v.to(torch_dtype) for k, v in transformer_from_bfl(_load_safetensors(path)).items()}
        _load_strict(transformer, state, path.name)
        return {
            "transformer": transformer,
            "vae": self._vae_file(vae_path, str(config_dir), torch_dtype),
            "text_encoder": self._text_encoder(te_path, str(config_dir), torch_dtype, True),
            "tokenizer": self._tokenizer(tok_path, True),
            "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(str(config_dir), subfolder="scheduler",
                                                                         local_files_only=True),
            "distillation": detect_distillation(path, metadata),
        }

    def _config_for(self, facts: dict, path: Path) -> Path:
        from diffusers import Flux2Transformer2DModel

        from .single_file import transformer_config_facts

        for variant, folder in SHIPPED_CONFIGS.items():
            if transformer_config_facts(Flux2Transformer2DModel.load_config(str(folder / "transformer"))) == facts:
                return folder
        raise ModelLoadError(f"'{path.name}' is a FLUX.2 transformer of a size StableTune does not ship a config for "
                             f"(hidden size {facts['hidden_size']}, {facts['num_layers']} double and "
                             f"{facts['num_single_layers']} single blocks); pass model_config_dir.")

    @staticmethod
    def _vae_file(path: Path, config_from: str, torch_dtype):
        from accelerate import init_empty_weights
        from diffusers import AutoencoderKLFlux2

        from .single_file import vae_from_ldm

        path = Path(path)
        if path.is_dir():
            return AutoencoderKLFlux2.from_pretrained(str(path), torch_dtype=torch_dtype, local_files_only=True)
        with init_empty_weights():
            vae = AutoencoderKLFlux2.from_config(AutoencoderKLFlux2.load_config(config_from, subfolder="vae"))
        try:
            state = vae_from_ldm(_load_safetensors(path), vae)
        except KeyError as exc:
            raise ModelLoadError(f"'{path.name}' is not the FLUX.2 VAE (it has no '{exc.args[0]}'); pass "
                                 "flux2-vae.safetensors.") from None
        _load_strict(vae, {k: v.to(torch_dtype) if v.is_floating_point() else v for k, v in state.items()},
                     path.name)
        return vae

    @staticmethod
    def _text_encoder(path: Path, config_from: str, torch_dtype, local_files_only: bool):
        from accelerate import init_empty_weights
        from transformers import Qwen3Config, Qwen3ForCausalLM

        path = Path(path)
        if path.is_dir():  # a transformers Qwen3 folder
            if not (path / "config.json").is_file():
                raise ModelLoadError(f"'{path}' has no config.json, so it is not a Qwen3 text encoder folder.")
            return Qwen3ForCausalLM.from_pretrained(str(path), dtype=torch_dtype, local_files_only=local_files_only)
        if path.suffix.lower() != ".safetensors":
            raise ModelLoadError(f"Refusing to open '{path.name}': only .safetensors text encoders are read (other "
                                 "formats can run code when loaded).")
        shapes, _ = safetensors_header(path)
        if "model.layers.0.self_attn.q_norm.weight" not in shapes:
            raise ModelLoadError(f"'{path.name}' is not a Qwen3 text encoder (no model.layers.0.self_attn.q_norm); "
                                 "FLUX.2 Klein 4B reads qwen_3_4b.safetensors and 9B reads qwen_3_8b.safetensors.")
        if is_quantised(shapes):
            raise ModelLoadError(f"'{path.name}' is a quantised (fp8) text encoder, which StableTune cannot train "
                                 "with; use the bf16 file (qwen_3_4b.safetensors or qwen_3_8b.safetensors).")
        config = Qwen3Config.from_pretrained(str(Path(config_from) / "text_encoder"))
        width = shapes["model.layers.0.post_attention_layernorm.weight"][0]
        if width != config.hidden_size:
            raise ModelLoadError(f"'{path.name}' is a Qwen3 {width} wide, but this Klein transformer reads a "
                                 f"{config.hidden_size}-wide one (Klein 4B: Qwen3-4B, 2560; Klein 9B: Qwen3-8B, "
                                 "4096).")
        with init_empty_weights():
            model = Qwen3ForCausalLM(config)
        state = {k: v.to(torch_dtype) for k, v in _load_safetensors(path).items()}
        if "lm_head.weight" not in state:  # unused for embeddings; tied or absent in ComfyUI's file
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        _load_strict(model, state, path.name)
        model.tie_weights()
        return model

    @staticmethod
    def _tokenizer(path: Path, local_files_only: bool):
        from transformers import Qwen2TokenizerFast

        path = Path(path)
        if not path.is_dir() or not any((path / f).is_file() for f in ("tokenizer.json", "vocab.json")):
            raise ModelLoadError(f"'{path}' holds no tokenizer (no tokenizer.json or vocab.json); FLUX.2 Klein needs "
                                 "Qwen3's tokenizer.")
        return Qwen2TokenizerFast.from_pretrained(str(path), local_files_only=local_files_only)

    def describe(self, bundle: ModelBundle) -> None:
        """Set the variant and the version strings from the loaded transformer's width."""
        config = bundle.denoiser.config
        width = config["num_attention_heads"] * config["attention_head_dim"]
        self.variant = "9b" if width == 4096 else "4b"
        self.base_model_version = f"flux2_klein_{self.variant}"
        self.modelspec_architecture = f"Flux.2-klein-{self.variant}/lora"

    def distillation_note(self, bundle: ModelBundle) -> str | None:
        """The one sentence to show before training when the model is (or may be) the distilled Klein."""
        return bundle.extra["distillation"].sentence(self.variant)

    # ---------------------------------------------------------------- encode
    def encode_text(self, bundle: ModelBundle, prompts: list[str]) -> dict[str, torch.Tensor]:
        """{"prompt_embeds": [B, max_sequence_length, 3 x hidden]}: Flux2KleinPipeline._get_qwen3_prompt_embeds,
        batched."""
        from ..qwen3_text import qwen3_hidden_states

        te = bundle.text_encoders[0]
        hidden, _ = qwen3_hidden_states(bundle.tokenizers[0], te, prompts, max_length=text_length(bundle),
                                        enable_thinking=False)
        stacked = torch.stack([hidden[k] for k in TEXT_ENCODER_OUT_LAYERS], dim=1).to(te.dtype)
        b, layers, length, hidden = stacked.shape
        return {"prompt_embeds": stacked.permute(0, 2, 1, 3).reshape(b, length, layers * hidden)}

    def make_conditioning(self, bundle: ModelBundle, text: dict[str, torch.Tensor], sizes: Any = None
                          ) -> Conditioning:
        """Prompt embeddings plus the text tokens' position ids (and a guidance value for a transformer that has
        a guidance embedding, which Klein does not). Image ids depend on the latent size: call_transformer."""
        from diffusers import Flux2KleinPipeline

        embeds = text["prompt_embeds"]
        extra = {"txt_ids": Flux2KleinPipeline._prepare_text_ids(embeds).to(embeds.device)}
        if bundle.denoiser.config["guidance_embeds"]:
            extra["guidance"] = torch.full((embeds.shape[0],), TRAINING_GUIDANCE, device=embeds.device)
        return Conditioning(encoder_hidden_states=embeds, added_cond_kwargs=extra)

    def encode_prompts(self, bundle: ModelBundle, prompts: list[str], *, sizes: Any = None) -> Conditioning:
        return self.make_conditioning(bundle, self.encode_text(bundle, prompts), sizes)

    @torch.no_grad()
    def encode_latents(self, bundle: ModelBundle, pixels: torch.Tensor, *,
                       generator: torch.Generator | None = None) -> torch.Tensor:
        """Pixels in [-1, 1] -> normalised, patchified latents, fp32. The VAE's mode, as the pipeline and diffusers'
        Klein script encode: `generator` is not drawn from (no posterior sample), so the run's random stream is the
        same with and without a latent cache."""
        vae = bundle.vae
        raw = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode()
        return self.normalize_raw_latents(bundle, raw)

    def normalize_raw_latents(self, bundle: ModelBundle, raw: torch.Tensor) -> torch.Tensor:
        """Patchified, then normalised by the VAE's latent batch norm's statistics (this module's
        normalize_latents), fp32."""
        return normalize_latents(bundle.vae, raw).float()

    def decode_latents(self, bundle: ModelBundle, latents: torch.Tensor) -> torch.Tensor:
        """The inverse of encode_latents, in the VAE's dtype; gradients flow when the caller allows them (the
        perceptual term decodes the predicted clean latents)."""
        vae = bundle.vae
        return vae.decode(denormalize_latents(vae, latents.to(vae.device, vae.dtype)), return_dict=False)[0]

    def decode_sampled(self, bundle: ModelBundle, latents: torch.Tensor) -> torch.Tensor:
        """Flux2KleinPipeline's output_type="latent" is the VAE's own latents (already denormalised and
        unpatchified): the VAE decodes them as they are."""
        vae = bundle.vae
        return vae.decode(latents.to(vae.device, vae.dtype), return_dict=False)[0]

    def latent_downscale(self, bundle: ModelBundle) -> int:
        """Image side / latent side, the 2 x 2 patchify included (16 for the real VAE)."""
        return 2 ** (len(bundle.vae.config.block_out_channels) - 1) * 2

    def objective(self, bundle: ModelBundle, options: Any):
        """The flow-matching objective of this bundle, drawn and weighted as `options` (the TrainConfig) asks:
        weighting_scheme, logit_mean, logit_std, mode_scale and flow_shift."""
        from ..flow_matching import FlowMatching

        return FlowMatching.for_run(bundle.noise_scheduler.config, options, call_transformer)

    def lora_target_modules(self, model: torch.nn.Module, targets: list[str]) -> list[str]:
        return lora_target_modules(model, targets)

    def swappable_blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The transformer's blocks in the order they run (double, then single): what block swap moves."""
        return [*model.transformer_blocks, *model.single_transformer_blocks]

    # -------------------------------------------------------------- pipeline
    def make_pipeline(self, bundle: ModelBundle, scheduler=None):
        """A Flux2KleinPipeline over the bundle's own modules, for validation images."""
        from diffusers import Flux2KleinPipeline

        return Flux2KleinPipeline(scheduler=scheduler if scheduler is not None else bundle.noise_scheduler,
                                  vae=bundle.vae, text_encoder=bundle.text_encoders[0],
                                  tokenizer=bundle.tokenizers[0], transformer=bundle.denoiser,
                                  is_distilled=bundle.extra["distillation"].verdict == "distilled")

    def validation_sampler(self, bundle: ModelBundle, options: Any) -> tuple[Any, dict[str, Any]]:
        """Klein's own FlowMatchEulerDiscreteScheduler (a copy: sampling sets its timesteps), and the pipeline
        call's text length, the one the run trains with; the SD samplers of validation_sampler do not apply
        (config/families.py refuses them)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return (FlowMatchEulerDiscreteScheduler.from_config(bundle.noise_scheduler.config),
                {"max_sequence_length": text_length(bundle)})

    def caption_tokens(self, model: Path | None, *, max_sequence_length: int = MAX_SEQUENCE_LENGTH
                       ) -> tuple[Any, int, str]:
        """Qwen3 counts of the whole Klein prompt (the chat template around the caption) against the
        `max_sequence_length` tokens the run pads and truncates it to (the pipeline's 512 unless the config sets
        another); the tokenizer of a Klein folder, or the one found for a transformer file (beside it, or
        ComfyUI's). The shipped config trees carry no tokenizer, so a model is needed."""
        path = None
        if model is not None and model.is_dir():
            path = next((f for f in (model / "tokenizer", model) if (f / "tokenizer_config.json").is_file()), None)
        elif model is not None and model.is_file():
            path = _find_tokenizer(model, None)
        if path is None:
            raise ModelLoadError("Counting caption tokens for FLUX.2 Klein needs Qwen3's tokenizer: give --model a "
                                 "Klein diffusers folder, or a transformer file inside ComfyUI (which ships it).")
        tokenizer = self._tokenizer(path, True)
        use_klein_chat_template(tokenizer)

        return caption_token_counter(tokenizer, enable_thinking=False), max_sequence_length, f"the Qwen3 tokenizer in {path}"

    def load_notes(self, bundle: ModelBundle) -> list[str]:
        """Which Klein this is (variant, base or distilled, where the text encoder came from), then the
        distilled-model warning when there is one."""
        self.describe(bundle)
        distillation = bundle.extra["distillation"]
        kind = {"distilled": "the step-distilled model", "base": "the base model"}.get(
            distillation.verdict, "base or distilled: not known")
        name = Path(str(bundle.source).rstrip("/\\")).name or str(bundle.source)
        config = bundle.denoiser.config
        width = config["num_attention_heads"] * config["attention_head_dim"]
        what = VARIANT_NAMES[self.variant] if width in RELEASED_WIDTHS else \
            f"a FLUX.2 Klein-layout transformer of width {width}, not a released size,"
        notes = [f"Loaded {name} as {what} {kind} ({distillation.evidence})."]
        if bundle.extra.get("chat_template_replaced"):
            notes.append("The tokenizer's own chat template renders prompts differently from Klein's, so Klein's "
                         "template is used (as ComfyUI and diffusers render them).")
        warning = self.distillation_note(bundle)
        return notes + ([warning] if warning else [])

    # -------------------------------------------------------------- metadata
    def metadata(self, bundle: ModelBundle) -> dict[str, str]:
        self.describe(bundle)
        return flow_model_metadata(self, bundle)

    def kohya_denoiser_name(self, module_path: str, denoiser: torch.nn.Module) -> str:
        """The LyCORIS name of a DoRA / LoHa module (lora.py); a LoRA's BFL names, q/k/v fused, come from
        lora.py's kohya_lora_tensors, which lora/export.py calls through fused_lora_export."""
        from .lora import lycoris_name

        return lycoris_name(module_path)

    def original_state_dict(self, bundle: ModelBundle, components: set[str]) -> dict[str, torch.Tensor]:
        """BFL's transformer keys: a FLUX.2 single file is the transformer alone (ComfyUI's layout)."""
        from .single_file import transformer_to_bfl

        return transformer_to_bfl(bundle.denoiser.state_dict()) if "unet" in components else {}

    def full_original_state_dict(self, bundle: ModelBundle) -> dict[str, torch.Tensor]:
        return self.original_state_dict(bundle, {"unet"})


def config_dir_text_hidden(config_dir: Path) -> int:
    return int(json.loads((Path(config_dir) / "text_encoder" / "config.json").read_text())["hidden_size"])


def use_klein_chat_template(tokenizer) -> bool:
    """Give the tokenizer Klein's chat template unless its own renders the same prompt; True if it was replaced."""
    probe = "a red circle"
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": probe}], tokenize=False,
                                                 add_generation_prompt=True, enable_thinking=False)
    except Exception:  # no template at all, or one that fails on these arguments
        rendered = None
    if rendered == KLEIN_PROMPT.format(probe):
        return False
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return True


def _load_strict(model: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Load every parameter and buffer of `model` from `state` (assign: the model may be on the meta device); one
    sentence naming the first missing or extra key otherwise."""
    own = model.state_dict()
    missing = [k for k in own if k not in state and not k.endswith("num_batches_tracked")]
    extra = [k for k in state if k not in own]
    if missing or extra:
        problem = f"lacks '{missing[0]}'" if missing else f"has '{extra[0]}', which the model does not"
        raise ModelLoadError(f"'{what}' does not fit the FLUX.2 Klein config: it {problem}.")
    wrong = [k for k, v in state.items() if tuple(v.shape) != tuple(own[k].shape)]
    if wrong:
        raise ModelLoadError(f"'{what}' does not fit the FLUX.2 Klein config: '{wrong[0]}' is "
                             f"{tuple(state[wrong[0]].shape)}, the config makes it {tuple(own[wrong[0]].shape)}.")
    model.load_state_dict(state, strict=False, assign=True)
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:  # e.g. a batch norm's num_batches_tracked the file did not carry
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            module.register_buffer(attr, torch.zeros(buf.shape, dtype=buf.dtype))
