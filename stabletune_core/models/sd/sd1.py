"""Stable Diffusion 1.x: one CLIP ViT-L/14 text encoder, epsilon prediction, 512px."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..base import (Conditioning, ModelBundle, ModelLoadError, denormalize_latents, load_errors_in_one_sentence,
                   normalize_latents)
from ..sources import check_source

if TYPE_CHECKING:
    from ..ddpm import DDPMObjective

CONFIGS_DIR = Path(__file__).parent / "configs"
SD15_CONFIG_DIR = CONFIGS_DIR / "sd15"


def _pipeline_parts(pipe) -> dict[str, Any]:
    return {"unet": pipe.unet, "vae": pipe.vae, "text_encoder": pipe.text_encoder, "tokenizer": pipe.tokenizer}


class SD1:
    """The Stable Diffusion 1.x family (1.4, 1.5 and their fine-tunes)."""

    name = "sd1"
    display_name = "Stable Diffusion 1.x"
    base_model_version = "sd_v1"
    modelspec_architecture = "stable-diffusion-v1/lora"
    modelspec_implementation = "diffusers"  # what kohya writes for LoRAs
    default_resolution = (512, 512)
    is_v2 = False
    plans_memory = False  # models/memory_plan.py: no memory model of this family yet
    unet_lora_targets = ["to_q", "to_k", "to_v", "to_out.0"]
    text_encoder_lora_targets = ["q_proj", "k_proj", "v_proj", "out_proj"]
    text_encoder_kohya_prefixes = ["lora_te"]
    denoiser_has_convolutions = True  # the UNet's ResNets and samplers (LoCon, extract --conv_rank)
    single_file_merges_into_folder = True  # with the shipped configs/
    fused_lora_export = None  # one kohya name per module
    diffusers_pipeline_class = "StableDiffusionPipeline"
    diffusers_lora_uses_peft_names = False  # diffusers' own names: lora.up / lora.down
    diffusers_lora_layers_argument = "unet_lora_layers"
    denoiser_name = "UNet"
    denoiser_folder = "unet"
    lora_file_markers = ("sd_v1", "stable-diffusion-v1")  # kohya's ss_base_model_version, modelspec's architecture
    lora_module_prefixes: tuple[str, ...] = ()  # SD 2.x files share SD 1.x's names
    lora_target_modules = None  # the suffixes are peft's target names as they are
    text_encoder_parts = ("text_encoder",)  # pipeline component names, in kohya prefix order
    tokenizer_parts = ("tokenizer",)
    default_config_dir = SD15_CONFIG_DIR

    def kohya_denoiser_name(self, module_path: str, denoiser: torch.nn.Module) -> str:
        """kohya's lora_unet_ + the diffusers path with dots as underscores (lora/names.py)."""
        from ...lora.names import kohya_unet_name

        return kohya_unet_name(module_path)

    def swappable_blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """No block swap for a UNet (its blocks differ in size and pass skip connections down to up)."""
        return []

    # ------------------------------------------------------------------ load
    def load(
        self,
        source: str | Path,
        *,
        local_files_only: bool = True,
        config_dir: str | Path | None = None,
        torch_dtype: torch.dtype = torch.float32,
    ) -> ModelBundle:
        """Load a diffusers folder, an A1111-style single ``.safetensors`` file, or (if allowed) a hub id.

        ``config_dir`` is only used for single files: a diffusers-layout folder
        (model_index.json + component configs + tokenizer) describing the
        architecture; default is the shipped SD 1.5 tree.
        """
        from diffusers import DDPMScheduler

        kind, path = check_source(source, local_files_only=local_files_only)
        with load_errors_in_one_sentence(source, self.display_name):
            if kind == "file":
                parts = self._load_single_file(path, config_dir, local_files_only, torch_dtype)
                sched_config = parts.pop("scheduler_config")
                noise_scheduler = DDPMScheduler.from_config(sched_config)
            else:
                where = str(path) if path is not None else str(source)
                parts = self._load_diffusers(where, local_files_only, torch_dtype)
                noise_scheduler = DDPMScheduler.from_pretrained(
                    where, subfolder="scheduler", local_files_only=local_files_only
                )
        text_encoders = [parts[name] for name in self.text_encoder_parts]
        for m in (parts["unet"], parts["vae"], *text_encoders):
            m.requires_grad_(False)
            m.eval()
        return ModelBundle(
            family=self,
            denoiser=parts["unet"],
            vae=parts["vae"],
            text_encoders=text_encoders,
            tokenizers=[parts[name] for name in self.tokenizer_parts],
            noise_scheduler=noise_scheduler,
            source=str(source),
            extra={"source_kind": kind},
        )

    def _load_diffusers(self, where: str, local_files_only: bool, torch_dtype) -> dict[str, Any]:
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTokenizer

        kw = {"local_files_only": local_files_only}
        return {
            "unet": UNet2DConditionModel.from_pretrained(where, subfolder="unet", torch_dtype=torch_dtype, **kw),
            "vae": AutoencoderKL.from_pretrained(where, subfolder="vae", torch_dtype=torch_dtype, **kw),
            "text_encoder": CLIPTextModel.from_pretrained(where, subfolder="text_encoder", dtype=torch_dtype, **kw),
            "tokenizer": CLIPTokenizer.from_pretrained(where, subfolder="tokenizer", **kw),
        }

    def _load_single_file(self, path: Path, config_dir, local_files_only: bool, torch_dtype) -> dict[str, Any]:
        from diffusers import StableDiffusionPipeline

        config_dir = Path(config_dir) if config_dir is not None else self.single_file_config_dir(path)
        if not (config_dir / "model_index.json").is_file():
            raise ModelLoadError(f"The config folder '{config_dir}' has no model_index.json, so it cannot describe the model.")
        pipe = StableDiffusionPipeline.from_single_file(
            str(path),
            config=str(config_dir),
            local_files_only=True,  # the weights are local and the configs are ours: never touch the network
            torch_dtype=torch_dtype,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
        parts = _pipeline_parts(pipe)
        parts["scheduler_config"] = pipe.scheduler.config
        return parts

    def single_file_config_dir(self, path: Path) -> Path:
        """The shipped config tree that describes a single-file checkpoint of this family."""
        return self.default_config_dir

    # ------------------------------------------------------------- objective
    def objective(self, bundle: ModelBundle, options: Any) -> "DDPMObjective":
        """Epsilon or v-prediction on the model's DDPM schedule (models/ddpm.py), weighted as `options` (the
        TrainConfig) asks: snr_gamma, debiased_estimation_loss."""
        from ..ddpm import DDPMObjective

        return DDPMObjective(bundle.noise_scheduler, snr_gamma=options.snr_gamma,
                             debiased=options.debiased_estimation_loss)

    # --------------------------------------------------------------- latents
    def encode_latents(self, bundle: ModelBundle, pixels: torch.Tensor, *,
                       generator: torch.Generator | None = None) -> torch.Tensor:
        """The VAE's posterior sample (from `generator`), or its mean without one, scaled as the UNet trains."""
        vae = bundle.vae
        posterior = vae.encode(pixels.to(vae.device, dtype=vae.dtype)).latent_dist
        latents = posterior.sample(generator=generator) if generator is not None else posterior.mean
        return self.normalize_raw_latents(bundle, latents)

    def normalize_raw_latents(self, bundle: ModelBundle, raw: torch.Tensor) -> torch.Tensor:
        """(z - shift) x scaling from the VAE's config (models/base.py normalize_latents), fp32."""
        return normalize_latents(bundle.vae, raw)

    def decode_latents(self, bundle: ModelBundle, latents: torch.Tensor) -> torch.Tensor:
        return bundle.vae.decode(denormalize_latents(bundle.vae, latents)).sample

    # ---------------------------------------------------------------- encode
    def tokenize(self, bundle: ModelBundle, prompts: list[str]) -> torch.Tensor:
        from ..tokenizer import expand_multi_vector

        tok = bundle.tokenizers[0]
        return tok(expand_multi_vector(tok, prompts), padding="max_length", max_length=tok.model_max_length,
                   truncation=True, return_tensors="pt").input_ids

    def encode_text(self, bundle: ModelBundle, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The cacheable text tensors, per prompt along dim 0: {"encoder_hidden_states": [B, 77, hidden]}.

        Gradients flow when the caller enables them (text encoder training).
        """
        te = bundle.text_encoders[0]
        ids = self.tokenize(bundle, prompts).to(te.device)
        hidden = te(ids, return_dict=False)[0]
        return {"encoder_hidden_states": hidden}

    def make_conditioning(self, bundle: ModelBundle, text: dict[str, torch.Tensor], sizes: Any = None) -> Conditioning:
        """Conditioning from (possibly cached) encode_text output; SD1 has no size conditioning, so sizes are ignored."""
        return Conditioning(encoder_hidden_states=text["encoder_hidden_states"])

    def encode_prompts(
        self, bundle: ModelBundle, prompts: list[str], *, sizes: list[dict[str, tuple[int, int]]] | None = None
    ) -> Conditioning:
        """Last hidden state of the CLIP text encoder, [B, 77, hidden]. Gradients flow if the caller allows them."""
        return self.make_conditioning(bundle, self.encode_text(bundle, prompts), sizes)

    def make_pipeline(self, bundle: ModelBundle, scheduler=None):
        """A StableDiffusionPipeline over the bundle's own modules (no copies, no safety checker), for sampling."""
        from diffusers import StableDiffusionPipeline

        return StableDiffusionPipeline(
            vae=bundle.vae,
            text_encoder=bundle.text_encoders[0],
            tokenizer=bundle.tokenizers[0],
            unet=bundle.denoiser,
            scheduler=scheduler if scheduler is not None else bundle.noise_scheduler,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )

    def validation_sampler(self, bundle: ModelBundle, options: Any) -> tuple[Any, dict[str, Any]]:
        """The validation_sampler the user chose, on the model's own schedule (DDIM with its eta)."""
        from diffusers import (DDIMScheduler, DPMSolverMultistepScheduler, EulerAncestralDiscreteScheduler,
                               EulerDiscreteScheduler)

        samplers = {"ddim": DDIMScheduler, "euler": EulerDiscreteScheduler,
                    "euler_a": EulerAncestralDiscreteScheduler, "dpm++": DPMSolverMultistepScheduler}
        scheduler = samplers[options.validation_sampler].from_config(bundle.noise_scheduler.config)
        extra = {"eta": options.validation_ddim_eta} if options.validation_sampler == "ddim" else {}
        return scheduler, extra

    def decode_sampled(self, bundle: ModelBundle, latents: torch.Tensor) -> torch.Tensor:
        """SD pipelines stop at the UNet's (scaled) latents: the same as decode_latents."""
        return self.decode_latents(bundle, latents)

    def latent_downscale(self, bundle: ModelBundle) -> int:
        return bundle.vae_scale_factor

    def caption_tokens(self, model: Path | None) -> tuple[Any, int, str]:
        """CLIP counts (the longest of the family's tokenizers), without the start and end tokens, against the 75
        tokens a prompt holds; the tokenizers of a diffusers folder, else the family's shipped config tree."""
        from transformers import CLIPTokenizer

        if model is not None and model.is_dir():
            base, where = model, f"{model.name}'s tokenizer"
        elif model is not None and model.is_file():
            base, where = self.single_file_config_dir(model), f"the {self.display_name} tokenizer"
        else:
            base, where = self.default_config_dir, f"the {self.display_name} tokenizer"
        tokenizers = []
        for part in self.tokenizer_parts:
            try:
                tokenizers.append(CLIPTokenizer.from_pretrained(str(base / part), local_files_only=True))
            except (OSError, ValueError) as exc:
                raise ModelLoadError(f"Cannot read the tokenizer in {base / part} ({str(exc).splitlines()[0][:120]}"
                                     "); give --model a diffusers folder with its tokenizer, or --family.") from None
        limit = min(t.model_max_length for t in tokenizers) - 2  # the start and end tokens take two places

        def count(text: str) -> int:
            return max(len(t(text, truncation=False, verbose=False).input_ids) - 2 for t in tokenizers)

        return count, limit, where

    def load_notes(self, bundle: ModelBundle) -> list[str]:
        name = Path(str(bundle.source).rstrip("/\\")).name or str(bundle.source)
        return [f"Loaded {name} as {self.display_name} ({bundle.prediction_type} prediction)."]

    # -------------------------------------------------------------- metadata
    def metadata(self, bundle: ModelBundle) -> dict[str, str]:
        name = Path(str(bundle.source).rstrip("/\\")).name or str(bundle.source)
        w, h = self.default_resolution
        return {
            "ss_sd_model_name": name,
            "ss_base_model_version": self.base_model_version,
            "ss_v2": str(self.is_v2),
            "modelspec.sai_model_spec": "1.0.0",
            "modelspec.architecture": self.modelspec_architecture,
            "modelspec.implementation": self.modelspec_implementation,
            "modelspec.prediction_type": "epsilon" if bundle.prediction_type == "epsilon" else "v",
            "modelspec.resolution": f"{w}x{h}",
        }

    # ------------------------------------------------------------------ the original single-file layout
    def original_state_dict(self, bundle: ModelBundle, components: set[str]) -> dict[str, torch.Tensor]:
        """The given components under CompVis's keys (SDXL: SGM's; the text encoders: CLIP's or OpenCLIP's)."""
        from . import single_file as sf

        state: dict[str, torch.Tensor] = {}
        if "unet" in components:
            state.update(sf.convert_unet_state_dict(bundle.denoiser))
        if "text_encoder" in components:
            state.update(self.original_text_encoder(bundle.text_encoders[0]))
        if "text_encoder_2" in components:
            state.update(sf.convert_open_clip_text_encoder(bundle.text_encoders[1], sf.OPEN_CLIP_PREFIX_SDXL))
        return state

    def original_text_encoder(self, encoder: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The first text encoder under the single file's keys (SD 1.x: CLIP's, under cond_stage_model.)."""
        from .single_file import convert_text_encoder_state_dict

        return convert_text_encoder_state_dict(encoder)

    def full_original_state_dict(self, bundle: ModelBundle) -> dict[str, torch.Tensor]:
        from .single_file import diffusers_to_original_sd

        return diffusers_to_original_sd(bundle.denoiser, bundle.vae, bundle.text_encoders[0])
