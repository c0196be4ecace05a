"""The one face every model family shows to the loop, the exporter and the UI.

A family is one folder (models/sd/, models/flux2_klein/, models/z_image/) whose class is a `ModelFamily`. The
loop never asks "is this SDXL?" or "is this a flow model?": it asks the family to
load, to encode images and prompts, for its training objective and to name its
LoRA keys.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch


@dataclass
class Conditioning:
    """What the UNet needs besides the noisy latents and the timesteps."""

    encoder_hidden_states: torch.Tensor
    added_cond_kwargs: dict[str, torch.Tensor] | None = None

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "Conditioning":
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype) if dtype is not None and t.is_floating_point() else t.to(device)

        extra = {k: move(v) for k, v in self.added_cond_kwargs.items()} if self.added_cond_kwargs else None
        return Conditioning(move(self.encoder_hidden_states), extra)

    def index(self, rows: slice | list[int] | torch.Tensor) -> "Conditioning":
        extra = {k: v[rows] for k, v in self.added_cond_kwargs.items()} if self.added_cond_kwargs else None
        return Conditioning(self.encoder_hidden_states[rows], extra)

    @staticmethod
    def cat(parts: list["Conditioning"]) -> "Conditioning":
        hidden = torch.cat([p.encoder_hidden_states for p in parts])
        extra = None
        if parts[0].added_cond_kwargs:
            extra = {k: torch.cat([p.added_cond_kwargs[k] for p in parts]) for k in parts[0].added_cond_kwargs}
        return Conditioning(hidden, extra)


@dataclass
class ModelBundle:
    """Everything a family loads. Modules are on CPU in fp32 until the loop places them."""

    family: "ModelFamily"
    denoiser: Any  # what predicts from noisy latents: SD's UNet2DConditionModel, FLUX.2 Klein's transformer
    vae: Any  # diffusers.AutoencoderKL
    text_encoders: list[Any]  # transformers CLIPTextModel / CLIPTextModelWithProjection
    tokenizers: list[Any]  # transformers CLIPTokenizer
    noise_scheduler: Any  # diffusers.DDPMScheduler
    source: str  # what the user pointed at; goes into ss_sd_model_name
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prediction_type(self) -> str:
        return self.noise_scheduler.config.prediction_type

    @property
    def vae_scale_factor(self) -> int:
        """How much the VAE downscales. Never assume 8: tiny test VAEs differ."""
        return 2 ** (len(self.vae.config.block_out_channels) - 1)


class Objective(Protocol):
    """How a family trains (DESIGN.md, "Model families behind one face"): how timesteps are drawn, how noise is
    added, what the model predicts and how each sample's loss is weighted. The step asks these, never
    `if flow:`; SD 1.x/2.x/XL share `models/ddpm.py`, a flow-matching family brings its own.

    Timesteps `t` are whatever the denoiser takes (DDPM: integers in [0, num_train_timesteps)); `noise_level(t)`
    puts them on one scale, 0 (clean) to 1 (pure noise), for what must not depend on the family's units (the
    validation loss bands). The noise itself is drawn by the step (train/noise.py: offset, pyramid, input
    perturbation), the same for every family, so the random stream stays the one a run has always drawn.
    """

    def draw_timesteps(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """`batch` training timesteps, drawn on the CPU from `generator` (the sampler batch's own)."""
        ...

    def noisy_input(self, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """What the denoiser sees: `latents` noised with `noise` at `t`."""
        ...

    def target(self, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """What the denoiser should predict for those inputs."""
        ...

    def loss_weight(self, t: torch.Tensor) -> torch.Tensor | None:
        """Per-sample weights of the training loss at `t` (min-SNR, debiased, ...); None = all 1. The validation
        loss never applies them, so it means the same whatever the run trains with."""
        ...

    def predict(self, denoiser: torch.nn.Module, noisy: torch.Tensor, t: torch.Tensor,
                cond: Conditioning) -> torch.Tensor:
        """The denoiser's output (the only place the model is called; the caller sets dtype and autocast)."""
        ...

    def predicted_clean(self, noisy: torch.Tensor, prediction: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The clean latents a prediction implies (the perceptual term decodes them)."""
        ...

    def validation_timesteps(self, count: int) -> torch.Tensor:
        """`count` fixed timesteps evenly spread over the schedule (validation loss, the diagnostics probe)."""
        ...

    def noise_level(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as a fraction of the schedule: 0 = clean, 1 = pure noise (float tensor)."""
        ...


@dataclass(frozen=True)
class FusedLoraExport:
    """How a family whose kohya names fuse modules writes and reads an adapter: `lora_tensors(layers, dtype)` for
    the LoRA layer views of its denoiser, `lokr_tensors(modules, dtype)` for its LoKr modules as (diffusers path,
    parts), and `named_modules(denoiser, blocks_only)` for the denoiser's modules under every name its adapter files
    use, a fused name's modules in row order (blocks_only: the blocks a LoRA trains, under kohya names alone), what
    tools/lora_file.py merges into and extracts from."""
    lora_tensors: Callable[[list[Any], torch.dtype], dict[str, torch.Tensor]]
    lokr_tensors: Callable[[Iterator[tuple[str, Any]], torch.dtype], dict[str, torch.Tensor]]
    named_modules: Callable[[torch.nn.Module, bool], dict[str, list[torch.nn.Module]]]


class ModelFamily(Protocol):
    """The interface of one model family module."""

    name: str  # "sd1", "sd2", "sdxl"
    base_model_version: str  # ss_base_model_version, e.g. "sd_v1"
    modelspec_architecture: str  # e.g. "stable-diffusion-v1/lora"
    unet_lora_targets: list[str]  # module name suffixes in the UNet that get LoRA
    text_encoder_lora_targets: list[str]
    text_encoder_kohya_prefixes: list[str]  # one per text encoder: ["lora_te"] or ["lora_te1", "lora_te2"]
    display_name: str  # what a sentence calls the family, e.g. "Stable Diffusion 1.x"
    # the denoiser has convolutions a LoCon adapts (SD's UNet: conv_rank, extract --conv_rank); a transformer has none
    denoiser_has_convolutions: bool
    # a merge into a single file of this family can write a diffusers folder: SD's shipped configs, Z-Image's
    # model_config_dir (a diffusers folder, which its single files need anyway); FLUX.2's shipped config trees hold no
    # tokenizer, so its single files merge into a single file only
    single_file_merges_into_folder: bool
    denoiser_name: str  # what a sentence calls the denoiser: "UNet" or "transformer"
    denoiser_folder: str  # the denoiser's folder in a diffusers model folder: "unet" or "transformer"
    # What a LoRA file made for this family says of itself: lowercase words its ss_base_model_version or
    # modelspec.architecture holds (tools/lora_file.py), and module-name prefixes only this family's files use
    # (empty where another family's files share them: SD 1.x and 2.x, which shapes tell apart)
    lora_file_markers: tuple[str, ...]
    lora_module_prefixes: tuple[str, ...]
    modelspec_implementation: str  # the LoRA file's modelspec.implementation
    default_resolution: tuple[int, int]  # (width, height) the family trains at by default (kohya's metadata)
    is_v2: bool  # kohya's ss_v2 (SD 2.x)
    # models/memory_plan.py has a memory model of this family: vram_gb, or a CUDA card's free memory, plans its run
    plans_memory: bool
    diffusers_pipeline_class: str  # the diffusers pipeline class that loads the family's LoRA (export check)
    # the diffusers-format LoRA is written in peft's names (lora_A / lora_B, each layer's alpha / rank folded into
    # lora_B: FLUX.2 Klein, Z-Image), not diffusers' own (SD's lora.up / lora.down); lora/export.py asks
    diffusers_lora_uses_peft_names: bool
    diffusers_lora_layers_argument: str  # save_lora_weights' argument for the denoiser: unet_ or transformer_...
    # A family whose target suffixes also name containers resolves them to the module names LoRA wraps
    # (model, suffixes) -> names; None: the suffixes are peft's target names as they are.
    lora_target_modules: Callable[[torch.nn.Module, list[str]], list[str]] | None

    # A family whose kohya names fuse several modules into one (FLUX.2's q/k/v under BFL's names) writes and names its
    # adapter tensors itself (lora/export.py and tools/lora_file.py ask it, so neither imports a family folder);
    # None: one kohya name per module, `kohya_denoiser_name`.
    fused_lora_export: FusedLoraExport | None

    def kohya_denoiser_name(self, module_path: str, denoiser: torch.nn.Module) -> str:
        """The name a kohya-format LoRA file gives the adapter on the denoiser's module `module_path` (SD 1.x/2.x:
        lora_unet_ + the diffusers path; SDXL: SGM's; FLUX.2 Klein: the LyCORIS name of a DoRA / LoHa, its LoRA's
        names being `fused_lora_export`'s; Z-Image: diffusion_model. + the path)."""
        ...

    def swappable_blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The denoiser's blocks in the order they run, what block swap moves; [] for a family without blocks to
        swap."""
        ...

    def load(self, source: str, *, local_files_only: bool = True) -> ModelBundle: ...

    def objective(self, bundle: ModelBundle, options: Any) -> Objective:
        """The training objective of this model; `options` is the run's TrainConfig (the loss knobs it reads)."""
        ...

    def encode_latents(self, bundle: ModelBundle, pixels: torch.Tensor, *,
                       generator: torch.Generator | None = None) -> torch.Tensor:
        """Images in [-1, 1] to the latents the denoiser trains on (fp32): a posterior sample drawn from
        `generator`, or the posterior mean without one."""
        ...

    def normalize_raw_latents(self, bundle: ModelBundle, raw: torch.Tensor) -> torch.Tensor:
        """The VAE's own latents (a posterior sample or mode) to what the denoiser trains on, fp32: what
        `encode_latents` does after encoding (SD, Z-Image: this module's `normalize_latents`, from the VAE's config;
        FLUX.2 Klein: patchified, then its batch norm's statistics). The toy build asks it of latents it encoded
        once for the whole latent bank (toy/flow_build.py)."""
        ...

    def decode_latents(self, bundle: ModelBundle, latents: torch.Tensor) -> torch.Tensor:
        """The inverse of `encode_latents`: latents (any dtype) to images in [-1, 1], in the VAE's dtype."""
        ...

    def encode_text(self, bundle: ModelBundle, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Per-prompt text-encoder outputs (dim 0 = prompt), what a text-embedding cache stores."""
        ...

    def make_conditioning(self, bundle: ModelBundle, text: dict[str, torch.Tensor],
                          sizes: list[dict[str, tuple[int, int]]] | None = None) -> Conditioning:
        """Denoiser conditioning from text outputs plus per-image sizes (SDXL's time ids; SD1/2 ignore them).
        sizes: one {"original_size": (h, w), "crop_top_left": (top, left), "target_size": (h, w)} per row."""
        ...

    def encode_prompts(
        self, bundle: ModelBundle, prompts: list[str], *, sizes: list[dict[str, tuple[int, int]]] | None = None
    ) -> Conditioning: ...

    def make_pipeline(self, bundle: ModelBundle, scheduler: Any = None) -> Any:
        """A diffusers inference pipeline sharing the bundle's modules (for validation images)."""
        ...

    def validation_sampler(self, bundle: ModelBundle, options: Any) -> tuple[Any, dict[str, Any]]:
        """(scheduler, extra pipeline-call arguments) the validation images are sampled with, as `options` (the
        TrainConfig) asks: an SD family's choice of validation_sampler, a flow model's own Euler scheduler."""
        ...

    def decode_sampled(self, bundle: ModelBundle, latents: torch.Tensor) -> torch.Tensor:
        """What the family's pipeline returns for output_type="latent", decoded to images in [-1, 1] in the VAE's
        dtype (SD pipelines return the denoiser's latents, FLUX.2 Klein's the VAE's own)."""
        ...

    def latent_downscale(self, bundle: ModelBundle) -> int:
        """Image side / the side of the latents the denoiser trains on."""
        ...

    def caption_tokens(self, model: Any, **text_options: Any) -> tuple[Any, int, str]:
        """(count, limit, where) for checking captions before training (tools/doctor.py): count(caption) is the
        number of tokens the text encoder reads of it, limit how many it reads at most, where names the tokenizer.
        `model`: a local model path or None (the family's shipped tokenizer). `text_options`: how the run encodes
        prompts, as load() takes them (config/families.text_options: FLUX.2 Klein's max_sequence_length, the
        limit its captions are counted against); a family without such knobs is never handed one. ModelLoadError
        (one sentence) when no tokenizer can be read."""
        ...

    def load_notes(self, bundle: ModelBundle) -> list[str]:
        """What a user must know about the loaded model before training, one sentence each: which model and variant
        it is, and a warning when it is a poor base (e.g. the step-distilled FLUX.2 Klein). The first is the
        console line every run prints."""
        ...

    def metadata(self, bundle: ModelBundle) -> dict[str, str]: ...

    def original_state_dict(self, bundle: ModelBundle, components: set[str]) -> dict[str, torch.Tensor]:
        """The given components ("unet" = the denoiser, "text_encoder", "text_encoder_2") under the keys of the
        single-file checkpoints users run (CompVis / SGM / OpenCLIP; FLUX.2: BFL's transformer file); a merged
        model is written in it (tools/merge.py)."""
        ...

    def single_file_config_dir(self, path: Path) -> Path | None:
        """The shipped diffusers config tree that describes the single-file checkpoint `path` (what a merge from it
        into a diffusers folder copies when no model_config_dir is given); None where the family ships none that
        would do (FLUX.2's and Z-Image's single files are the transformer alone)."""
        ...

    def full_original_state_dict(self, bundle: ModelBundle) -> dict[str, torch.Tensor]:
        """The whole model in that single-file layout (a family whose single file is the denoiser alone: the
        denoiser)."""
        ...


def normalize_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """VAE latents to the scale the denoiser trains on, from the VAE's own config: (z - mean) x scaling / std when
    it gives per-channel statistics, else (z - shift) x scaling (SD 1.x/2.x/XL: shift 0). fp32."""
    mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
    scaling = float(vae.config.scaling_factor)
    if mean is not None and std is not None:
        mean = torch.tensor(mean).view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.tensor(std).view(1, -1, 1, 1).to(latents.device, latents.dtype)
        return ((latents - mean) * scaling / std).float()
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return ((latents - shift) * scaling).float()


def denormalize_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """The inverse of `normalize_latents`, computed in fp32 and returned in the VAE's dtype (what it decodes)."""
    latents = latents.float()
    mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
    scaling = float(vae.config.scaling_factor)
    if mean is not None and std is not None:
        mean = torch.tensor(mean).view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.tensor(std).view(1, -1, 1, 1).to(latents.device, latents.dtype)
        return (latents * std / scaling + mean).to(vae.dtype)
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return (latents / scaling + shift).to(vae.dtype)


class ModelLoadError(Exception):
    """A model could not be loaded; the message is one sentence a user can act on."""


def flow_model_metadata(family: Any, bundle: ModelBundle) -> dict[str, str]:
    """kohya's and modelspec's metadata of a LoRA for a flow-matching transformer family (FLUX.2 Klein, Z-Image):
    the model's name, the family's version strings and its default resolution."""
    from pathlib import Path

    name = Path(str(bundle.source).rstrip("/\\")).name or str(bundle.source)
    w, h = family.default_resolution
    return {
        "ss_sd_model_name": name,
        "ss_base_model_version": family.base_model_version,
        "ss_v2": "False",
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": family.modelspec_architecture,
        "modelspec.implementation": family.modelspec_implementation,
        "modelspec.resolution": f"{w}x{h}",
    }


@contextmanager
def load_errors_in_one_sentence(source: Any, display_name: str) -> Iterator[None]:
    """Inside, a model that fails to load raises ModelLoadError with one sentence for the user (the first line of
    the library's message), the cause chained for the log; a ModelLoadError passes as it is."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as exc:  # one sentence for the user, the cause chained for the log
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"Could not load '{source}' as a {display_name} model: {first}") from exc
