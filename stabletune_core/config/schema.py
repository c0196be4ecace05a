"""TrainConfig: every knob of a training run, typed, validated and documented once.

The CLI flags (flags.py), the TOML presets (files.py), the UI form and the validation messages all come
from the fields below. Adding a knob is one edit here. Field names follow
diffusers' `train_text_to_image_lora.py` where that script has the knob, so a
command written for it runs unchanged. A knob that names a file or folder of the
user's machine is marked `path=True`: a LoRA people share never carries those.

This package never imports torch or gradio: the UI process reads it too.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .hosts import run_host_limits
from .families import FAMILY_CHOICES, SD_LORA_TARGETS, WEIGHTING_SCHEMES, family_problems
from .judges import SAMPLE_JUDGES
from .network_rates import TOY_DEMO_RATES
from .tokens import multi_vector_clash

# Where a field lands in the UI and how its flags look.
GROUPS = ("model", "data", "lora", "optimization", "precision", "guards", "validation", "diagnostics", "output")


class ConfigError(ValueError):
    """Bad input, explained in one sentence per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def knob(default: Any, doc: str, group: str, *, aliases: tuple[str, ...] = (), ui: bool = True,
         path: bool = False, **limits: Any) -> Any:
    """A documented field. `path`: its value is a file or folder of the user's machine (or a hub id)."""
    extra = {"group": group, "aliases": list(aliases), "ui": ui, **({"path": True} if path else {})}
    return Field(default, description=doc, json_schema_extra=extra, **limits)


#: The held-out split used when validation_split is left empty (overfitting needs unseen images to show).
AUTO_VALIDATION_SPLIT = 0.1
AUTO_SPLIT_MIN_IMAGES = 8
SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial", "plateau")


class TrainConfigSchema(BaseModel):
    """Every knob of a training run (TrainConfig, files.py, adds its TOML form)."""


    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    # ---- model ---------------------------------------------------------------------------------------
    pretrained_model_name_or_path: str = knob(
        "", "The base model: a diffusers folder, a single .safetensors checkpoint (A1111 style), or a hub id "
        "(hub ids need internet the first time).", "model", aliases=("model",), path=True)
    model_family: Literal[FAMILY_CHOICES] = knob(  # type: ignore[valid-type]  (config/families.py)
        "auto", "Model family: sd1, sd2, sdxl, flux2_klein (FLUX.2 Klein 4B and 9B) or z_image (Z-Image Base and "
        "Turbo). 'auto' detects it from the checkpoint.", "model")
    model_config_dir: Optional[str] = knob(
        None, "Config tree for a single-file checkpoint whose architecture is not a standard one; "
        "normally left empty and the shipped config of the family is used. Z-Image from one transformer file "
        "(z_image_turbo_bf16.safetensors): a Z-Image diffusers folder, which its text encoder, VAE and tokenizer "
        "are read from.", "model", path=True)
    text_encoder_path: Optional[str] = knob(
        None, "FLUX.2 Klein from a single transformer file: its Qwen3 text encoder (qwen_3_4b.safetensors for 4B, "
        "qwen_3_8b.safetensors for 9B, or a Qwen3 folder). Empty = found in the ComfyUI folder the transformer is "
        "in (models/text_encoders).", "model", path=True)
    vae_path: Optional[str] = knob(
        None, "FLUX.2 Klein from a single transformer file: the FLUX.2 VAE (flux2-vae.safetensors). Empty = found in "
        "the ComfyUI folder the transformer is in (models/vae).", "model", path=True)
    tokenizer_path: Optional[str] = knob(
        None, "FLUX.2 Klein: a folder with Qwen3's tokenizer files. Empty = the model folder's own, or the one "
        "ComfyUI ships (comfy/text_encoders/qwen25_tokenizer).", "model", path=True)
    max_sequence_length: int = knob(
        512, "FLUX.2 Klein: how many Qwen3 tokens every prompt is padded (and truncated) to, chat template "
        "included, as Flux2KleinPipeline's and diffusers' Klein script's max_sequence_length. The transformer attends "
        "over these tokens beside the image's, so short captions train faster with a shorter length; the validation "
        "images are sampled with the same length. Keep it above your longest caption (about 15 tokens are the "
        "template).", "model", ge=16, le=4096)
    training_adapter: Optional[str] = knob(
        None, "Z-Image: a LoRA merged into the base while training and left out of the exported LoRA, e.g. a "
        "de-distilling training adapter for Z-Image-Turbo (whose LoRAs trained directly blur its 8-step images). "
        "Validation images show the merged model; set preview_model to the Turbo to see the LoRA without it. "
        "Empty = none.", "model", path=True)
    local_files_only: bool = knob(
        True, "Never touch the network when loading the model.", "model")

    # ---- data ----------------------------------------------------------------------------------------
    train_data_dir: str = knob(
        "", "Folder of training images with same-name .txt captions; kohya 'N_name' subfolders repeat "
        "their images N times.", "data", aliases=("dataset",), path=True)
    reg_data_dir: Optional[str] = knob(
        None, "Folder of regularisation (class) images for prior preservation, with the same rules as "
        "train_data_dir (captions, 'N_name' repeats). Each epoch sees as many of them as instance images, cycled "
        "to fill, mixed into the batches as kohya does. Empty = none.", "data", path=True)
    prior_loss_weight: float = knob(1.0, "Weight of the regularisation images' loss (prior preservation); "
                                    "instance images keep weight 1.", "data", ge=0.0, le=100.0)
    caption_extension: str = knob(".txt", "Extension of the caption files next to the images.", "data")
    default_caption: str = knob("", "Caption for images without a caption file.", "data")
    resolution: int = knob(512, "Training resolution in pixels (the side of the square bucket).", "data",
                           ge=64, le=4096)
    enable_bucket: bool = knob(True, "Group images by aspect ratio instead of cropping everything square.", "data")
    bucket_step: int = knob(64, "Bucket sides are multiples of this many pixels.", "data", ge=8, le=256)
    min_bucket_reso: int = knob(256, "Smallest bucket side in pixels.", "data", ge=8)
    max_bucket_reso: int = knob(1024, "Largest bucket side in pixels.", "data", ge=64)
    center_crop: bool = knob(False, "Crop the center of each image instead of a random crop.", "data")
    random_flip: bool = knob(False, "Flip images horizontally at random (not for asymmetric subjects).", "data")
    shuffle_caption: bool = knob(False, "Shuffle comma-separated caption tags each time an image is used.", "data")
    keep_tokens: int = knob(0, "How many leading caption tags stay in place when shuffling.", "data", ge=0)
    caption_dropout_rate: float = knob(0.0, "Probability of training an image with an empty caption.", "data",
                                       ge=0.0, le=1.0)
    caption_tag_dropout_rate: float = knob(0.0, "Probability of dropping each non-kept tag.", "data", ge=0.0, le=1.0)
    cache_latents: bool = knob(False, "Encode every image with the VAE once and reuse the latents "
                               "(faster; disables random crop and flip).", "data")
    cache_latents_to_disk: bool = knob(False, "Keep the latent cache on disk so later runs reuse it.", "data")
    cache_text_embeddings: bool = knob(False, "Encode every caption once (only without caption shuffle, tag dropout "
                                       "and text-encoder training; caption dropout is fine: the empty caption is "
                                       "cached too).", "data")
    masked_loss: bool = knob(
        True, "Use loss masks where they exist: NAME.mask.png beside an image, or masks/NAME.png in its folder "
        "(white = train, black = ignore; resized, cropped and flipped with the image). Images without one train "
        "everywhere. Mask files and masks/ folders are never training images.", "data")
    dataloader_num_workers: int = knob(0, "Worker processes that load images (0 = in the training process).",
                                       "data", ge=0, le=64)

    # ---- LoRA ----------------------------------------------------------------------------------------
    network_type: Literal["lora", "loha", "lokr"] = knob(
        "lora", "Adapter kind. lora: low-rank up@down (every loader reads it). loha: LyCORIS LoHa, the Hadamard "
        "product of two low-rank pairs (more expressive at the same rank). lokr: LyCORIS LoKr, a Kronecker product "
        "(very small files). LoHa/LoKr files load in A1111 1.5+, Forge and ComfyUI; lora_rank and lora_alpha "
        "apply to them as in LyCORIS.", "lora", aliases=("algo",))
    lokr_factor: int = knob(-1, "LoKr: split each weight's sides by this factor in the Kronecker product (-1 = as "
                            "square as possible, LyCORIS's default).", "lora", ge=-1)
    lora_rank: int = knob(16, "LoRA rank (dim): capacity of the adapter.", "lora", aliases=("rank", "network_dim"),
                          ge=1, le=1024)
    lora_alpha: Optional[float] = knob(None, "LoRA alpha; the update is scaled by alpha/rank. Empty = rank.", "lora",
                                       aliases=("network_alpha",), gt=0)
    lora_dropout: float = knob(0.0, "Dropout on the LoRA path during training (regularises small datasets).", "lora",
                               ge=0.0, lt=1.0)
    use_dora: bool = knob(
        False, "DoRA: also learn each layer's weight magnitude (per input channel), beside the LoRA direction; often "
        "closer to full fine-tuning at the same rank, at about twice the compute of the adapted layers. The file "
        "(a dora_scale per layer) loads in A1111 1.9+, Forge and ComfyUI; not in diffusers.", "lora")
    unet_lora_targets: list[str] = knob(list(SD_LORA_TARGETS),
                                        "UNet (or FLUX.2 transformer) modules (name suffixes) that get a LoRA. On "
                                        "FLUX.2 Klein this default stands for Klein's own: the attention of the "
                                        "double blocks and both fused layers of the single blocks.", "lora")
    train_text_encoder: bool = knob(False, "Also train LoRA adapters on the text encoder(s).", "lora")
    text_encoder_lr: Optional[float] = knob(None, "Learning rate of the text-encoder LoRA. Empty = learning_rate.",
                                            "lora", gt=0)
    pivotal_tokens: list[str] = knob(
        [], "Pivotal tuning: new tokens to train as text embeddings together with the LoRA, each as TOKEN=INIT_WORD "
        "(e.g. <p1>=red: the new word <p1> starts from the embedding of 'red', an existing single-token word). "
        "Write the token in your captions ('a <p1> circle'). Its vectors go into the LoRA file as A1111 reads them "
        "(bundle_emb) and into a separate embedding file beside it. Empty = off. SD 1.x, SD 2.x and SDXL.", "lora")
    num_vectors_per_token: int = knob(1, "Pivotal tuning: embedding vectors per new token (more = more capacity, "
                                      "each takes a place of the prompt's 75).", "lora", ge=1, le=16)
    embedding_lr: float = knob(1e-3, "Pivotal tuning: learning rate of the new token embeddings.", "lora",
                               gt=0, le=1.0)
    embedding_train_fraction: float = knob(
        1.0, "Pivotal tuning: the embeddings train for this fraction of the run, then freeze while the LoRA goes on "
        "learning around them (1 = they train to the end).", "lora", gt=0.0, le=1.0)

    # ---- optimization --------------------------------------------------------------------------------
    train_batch_size: int = knob(1, "Images per micro-batch on each device.", "optimization", aliases=("batch_size",),
                                 ge=1, le=1024)
    gradient_accumulation_steps: int = knob(1, "Micro-batches summed before each optimizer step "
                                            "(effective batch = batch size x this x devices).", "optimization",
                                            ge=1, le=4096)
    learning_rate: float = knob(1e-4, "Peak learning rate of the LoRA weights.", "optimization", aliases=("lr",),
                                gt=0, le=1.0)
    scale_lr: bool = knob(False, "Multiply the learning rate by the effective batch size.", "optimization")
    lr_scheduler: Literal[SCHEDULERS] = knob(  # type: ignore[valid-type]
        "constant", "Learning-rate schedule. 'plateau' lowers the rate when validation loss stalls.", "optimization")
    lr_warmup_steps: int = knob(0, "Steps of linear warm-up at the start.", "optimization", ge=0)
    lr_num_cycles: int = knob(1, "Restarts of cosine_with_restarts.", "optimization", ge=1)
    lr_power: float = knob(1.0, "Power of the polynomial schedule.", "optimization", gt=0)
    max_train_steps: Optional[int] = knob(None, "Optimizer steps to train. Empty = num_train_epochs decides.",
                                          "optimization", ge=1)
    num_train_epochs: int = knob(1, "Passes over the dataset when max_train_steps is empty.", "optimization", ge=1)
    optimizer: Literal["adamw", "adamw8bit", "prodigy", "lion", "adafactor", "adamw_schedulefree"] = knob(
        "adamw", "Optimizer. adamw8bit needs bitsandbytes and a GPU; prodigy picks its own step size and "
        "multiplies it by learning_rate (left unset, learning_rate becomes 1.0 for prodigy); lion (lion-pytorch) wants a 3-10x smaller learning rate than adamw; adafactor "
        "(transformers) runs at the fixed learning_rate; adamw_schedulefree (schedulefree) needs "
        "lr_scheduler=constant, warms up with lr_warmup_steps and exports its averaged weights.", "optimization")
    use_8bit_adam: bool = knob(False, "Same as optimizer=adamw8bit (diffusers' flag).", "optimization", ui=False)
    ema_decay: float = knob(
        0.0, "Keep an exponential moving average of the LoRA weights and export it beside the LoRA as "
        "NAME-ema.safetensors (0 = off; 0.999 is common for runs of thousands of steps, 0.99 for a few hundred). "
        "The decay warms up as min(decay, (1+n)/(10+n)) after n updates, as in diffusers.", "optimization",
        ge=0.0, lt=1.0)
    ema_on_cpu: bool = knob(False, "Keep the EMA copy in CPU memory instead of beside the weights (saves VRAM, "
                            "costs a copy per step).", "optimization")
    adam_beta1: float = knob(0.9, "Adam beta1.", "optimization", ge=0, lt=1)
    adam_beta2: float = knob(0.999, "Adam beta2.", "optimization", ge=0, lt=1)
    adam_weight_decay: float = knob(1e-2, "Decoupled weight decay.", "optimization", ge=0)
    adam_epsilon: float = knob(1e-8, "Adam epsilon.", "optimization", gt=0)
    snr_gamma: Optional[float] = knob(None, "Min-SNR weighting gamma (5.0 is the paper's value). Empty = off.",
                                      "optimization", gt=0)
    noise_offset: float = knob(0.0, "Noise offset (0.05-0.1 helps very dark/bright images).", "optimization",
                               ge=0, le=1)
    multires_noise_iterations: int = knob(
        0, "Multi-resolution (pyramid) noise levels, as kohya's sd-scripts (0 = off; the community uses 6-10). "
        "Adds low-frequency noise so the LoRA can shift overall colour and contrast.", "optimization", ge=0, le=64)
    multires_noise_discount: float = knob(
        0.3, "Weight decay per pyramid-noise level (the community uses 0.3-0.8; lower = gentler).", "optimization",
        ge=0.0, le=1.0)
    ip_noise_gamma: float = knob(
        0.0, "Input perturbation: the noised input gets this much extra noise the target does not have (0 = off; "
        "the community uses 0.1).", "optimization", ge=0.0, le=1.0)
    debiased_estimation_loss: bool = knob(
        False, "Debiased estimation loss: weight each sample by 1/sqrt(SNR) of its timestep (v-prediction: "
        "1/(SNR+1)), as kohya's sd-scripts.", "optimization")
    weighting_scheme: Literal[WEIGHTING_SCHEMES] = knob(  # type: ignore[valid-type]  (config/families.py)
        "none", "FLUX.2 Klein: how training sigmas are drawn and weighted, as diffusers' Klein script offers: none "
        "(uniform), logit_normal and mode (more draws mid-schedule), sigma_sqrt and cosmap (uniform draws, weighted "
        "loss).", "optimization")
    logit_mean: float = knob(0.0, "FLUX.2 Klein, weighting_scheme logit_normal: mean of the normal draw.",
                             "optimization", ge=-10.0, le=10.0)
    logit_std: float = knob(1.0, "FLUX.2 Klein, weighting_scheme logit_normal: std of the normal draw.",
                            "optimization", gt=0.0, le=10.0)
    mode_scale: float = knob(1.29, "FLUX.2 Klein, weighting_scheme mode: how strongly draws gather mid-schedule.",
                             "optimization", ge=0.0, le=10.0)
    flow_shift: Optional[float] = knob(
        None, "FLUX.2 Klein: shift of the training sigmas towards noise (3.0 is FLUX's value at 1024 px). Empty = "
        "the model scheduler's (Klein's shifts only when sampling, so training draws unshifted sigmas, as "
        "diffusers' Klein script does).", "optimization", gt=0.0, le=100.0)
    prediction_type: Optional[Literal["epsilon", "v_prediction"]] = knob(
        None, "Override the model's prediction type. Empty = the model's own.", "optimization")
    seed: int = knob(42, "Seed of everything random: the same seed gives the same run. -1 = a random seed, "
                     "recorded in the run's config.toml.", "optimization", ge=-1, le=2**32 - 1)

    # ---- precision & memory --------------------------------------------------------------------------
    mixed_precision: Literal["no", "fp16", "bf16"] = knob(
        "no", "Mixed precision. The frozen model runs in this dtype; LoRA weights stay fp32.", "precision")
    gradient_checkpointing: bool = knob(False, "Recompute activations in the backward pass: much less VRAM, "
                                        "about 20-30% slower.", "precision")
    enable_xformers_memory_efficient_attention: bool = knob(
        False, "Use xformers attention when it is installed (PyTorch SDPA is used otherwise).", "precision")
    allow_tf32: bool = knob(False, "Allow TF32 matmuls on Ampere+ GPUs.", "precision")
    base_storage: Literal["full", "int8", "nf4", "fp8"] = knob(
        "full", "How the frozen model's weights are stored: full = in the mixed_precision dtype (bf16: 2 bytes a "
        "weight); int8 = 8 bits a weight, one scale per output channel (half of bf16); nf4 = 4 bits (QLoRA's "
        "NormalFloat, a quarter of bf16); fp8 = float8 e4m3, GPUs with native fp8 only (RTX 40xx, L4, H100 and newer). "
        "Applies to the Linear layers of the UNet or FLUX.2 transformer; each is dequantised only while it computes. "
        "The LoRA trains in its own precision and its file is the same kind of file; its metadata records this "
        "setting.", "precision")
    vram_gb: Optional[float] = knob(
        None, "FLUX.2 Klein, SDXL and Z-Image: plan the run for a GPU with this many GiB (e.g. 6, 8, 12, 16): before "
        "any model loads, the cheapest settings that fit by the memory model are chosen, in this order: text embeddings cached, "
        "bf16, gradient checkpointing, base_storage int8, blocks swapped (Klein and Z-Image), base_storage nf4, then a "
        "smaller micro-batch with more accumulation. Knobs you set yourself are kept. The plan and its estimate are one "
        "console line and go into the run's config.toml. Empty = on a GPU, plan for its free memory as measured at "
        "the start, less 0.5 GiB (when nothing fits by the estimate the smallest plan is tried, never refused); on a "
        "CPU, no plan. Set a number to plan for another card (a number below anything that fits is refused in one "
        "sentence).", "precision", gt=0, le=1024)
    blocks_to_swap: int = knob(
        0, "FLUX.2 Klein and Z-Image: keep the frozen weights of this many transformer blocks (the last ones) in CPU "
        "memory and bring each onto the GPU only while it runs, forward and backward, the next one copied while the "
        "current one computes. Saves about one block's weights per block swapped (Klein 4B: 25 blocks, 9B: 32; "
        "Z-Image: 34, its 30 main layers first, then its 4 refiners) at some speed; needs "
        "gradient_checkpointing. The LoRA and its optimizer stay on the GPU. 0 = off.", "precision", ge=0, le=256)

    # ---- guards --------------------------------------------------------------------------------------
    max_grad_norm: float = knob(1.0, "Gradient clipping threshold (fixed mode).", "guards", ge=0)
    clip_mode: Literal["fixed", "adaptive", "off"] = knob(
        "fixed", "Gradient clipping: a fixed max norm, adaptive (a percentile of recent norms), or off.", "guards")
    nan_guard: bool = knob(True, "Skip steps with non-finite loss or gradients and roll back when they repeat.",
                           "guards")
    oom_guard: bool = knob(True, "On out-of-memory, halve the micro-batch and double accumulation so the "
                           "effective batch stays.", "guards")
    nan_window: int = knob(20, "Steps the non-finite guard looks back over when counting bad steps.", "guards",
                           ge=1, le=10000)
    nan_max_bad: int = knob(3, "Non-finite steps within nan_window that trigger a rollback to the last good "
                            "weights and a lower learning rate.", "guards", ge=1)
    nan_lr_factor: float = knob(0.5, "Learning-rate multiplier applied at each non-finite rollback.", "guards",
                                gt=0, le=1)
    oom_retries: int = knob(3, "Micro-batch halvings tried after out-of-memory errors before the run stops "
                            "with advice.", "guards", ge=0, le=16)
    clip_percentile: float = knob(95.0, "Adaptive clipping: clip at this percentile of recent gradient norms.",
                                  "guards", gt=0, le=100)
    clip_window: int = knob(100, "Adaptive clipping: how many recent gradient norms the percentile uses "
                            "(no clipping until 10 are seen, except max_grad_norm as a ceiling when set).",
                            "guards", ge=10, le=100000)
    scale_weight_norms: Optional[float] = knob(
        None, "Max-norm regularisation (kohya's scale_weight_norms): a LoRA module whose update up@down has a "
        "larger norm is scaled down to it after each step. Empty = off; 1.0 is typical.", "guards", gt=0)
    down_lr_scale: float = knob(1.0, "Learning-rate multiplier of the UNet down blocks' LoRA (0 freezes them).",
                                "guards", ge=0, le=100)
    mid_lr_scale: float = knob(1.0, "Learning-rate multiplier of the UNet mid block's LoRA (0 freezes it).",
                               "guards", ge=0, le=100)
    up_lr_scale: float = knob(1.0, "Learning-rate multiplier of the UNet up blocks' LoRA (0 freezes them).",
                              "guards", ge=0, le=100)
    fp16_fallback: bool = knob(True, "When fp16 keeps overflowing (the loss scale collapses or fp16_max_skips "
                               "steps in a row overflow), continue in bf16 where the GPU has it, else fp32.",
                               "guards")
    fp16_max_skips: int = knob(8, "Consecutive fp16-overflow steps that trigger the precision fallback.",
                               "guards", ge=1, le=1000)
    plateau_patience: int = knob(3, "lr_scheduler=plateau: validation evaluations without improvement before "
                                 "the learning rate is lowered.", "guards", ge=1)
    plateau_factor: float = knob(0.5, "lr_scheduler=plateau: learning-rate multiplier on a plateau.", "guards",
                                 gt=0, lt=1)
    min_lr: float = knob(1e-6, "lr_scheduler=plateau and non-finite rollbacks never lower the rate below this.",
                         "guards", ge=0)
    preflight: bool = knob(False, "Before training, run one step at the largest bucket and one sampling pass, "
                           "report peak memory, and start at the largest micro-batch that fits (GPU).", "guards")

    # ---- checkpoints & output ------------------------------------------------------------------------
    output_dir: str = knob("./lora_output", "The run directory: config, metrics, samples, checkpoints and "
                           "the LoRA go here.", "output", aliases=("run_dir",), path=True)
    output_name: str = knob("lora", "File name of the exported LoRA (without .safetensors).", "output")
    save_precision: Literal["fp16", "bf16", "fp32"] = knob("fp16", "Precision of the exported LoRA.", "output")
    export_diffusers_format: bool = knob(False, "Also write a diffusers/PEFT-format LoRA folder.", "output")
    save_steps: int = knob(500, "Save a resumable checkpoint every this many steps.", "output",
                           aliases=("checkpointing_steps",), ge=1)
    checkpoints_total_limit: Optional[int] = knob(3, "Keep this many recent checkpoints (plus the best).", "output",
                                                  ge=1)
    resume_from_checkpoint: Optional[str] = knob(
        None, "Continue a run: 'auto'/'latest' (newest good checkpoint in the run directory) or a checkpoint path.",
        "output", aliases=("resume",), path=True)
    allow_restart: bool = knob(False, "With resume_from_checkpoint auto: when the run's checkpoints exist but none "
                               "can be read, start over from step 0 instead of refusing.", "output")
    logging_steps: int = knob(1, "Write metrics every this many steps.", "output", ge=1)
    report_to: Literal["jsonl", "tensorboard"] = knob(
        "jsonl", "Where metrics go besides metrics.jsonl (always written): 'jsonl' (nowhere else) or 'tensorboard' "
        "(event files under RUN/tensorboard: loss, lr, grad norm, memory, validation loss, sample images; open "
        "with `tensorboard --logdir RUN/tensorboard`). 'none' = jsonl, 'all' = tensorboard.", "output")
    overwrite_output_dir: bool = knob(
        False, "When --output_dir holds an earlier run, move that run aside into RUN/previous-<time>/ and start a "
        "new one there (nothing is deleted); without it such a folder is refused.", "output",
        aliases=("overwrite_output",))

    # ---- validation ----------------------------------------------------------------------------------
    validation_prompt: Optional[str] = knob(
        None, "Prompt(s) for validation images; separate several with ' | '.", "validation")
    num_validation_images: int = knob(2, "Images per prompt, each with its own fixed seed.", "validation",
                                      ge=1, le=16)
    validation_steps: int = knob(250, "Make validation images every this many steps.", "validation", ge=1)
    final_validation_images: int = knob(
        0, "At the run's last sampling only (its last step), images per prompt when more than "
        "num_validation_images: the extra seeds are drawn with the LoRA and, adapters off, with the base model (into "
        "the step-0 folder), so the learning summary reads more images (the demo: 8). Training is unchanged. "
        "0 = num_validation_images.", "validation", ge=0, le=16)
    validation_epochs: Optional[int] = knob(
        None, "diffusers' flag: validation images every this many epochs; converted to validation_steps once the "
        "dataset's steps per epoch are known (the run's events say the result).", "validation", ui=False, ge=1)
    validation_inference_steps: int = knob(20, "Sampler steps for validation images.", "validation", ge=1, le=200)
    validation_guidance_scale: float = knob(7.5, "Classifier-free guidance scale for validation images.",
                                            "validation", ge=1.0, le=30.0)
    validation_sampler: Literal["ddim", "euler", "euler_a", "dpm++"] = knob(
        "ddim", "Sampler for validation images.", "validation")
    validation_ddim_eta: float = knob(0.0, "DDIM eta (0 = deterministic).", "validation", ge=0.0, le=1.0)
    preview_model: Optional[str] = knob(
        None, "Make the validation images with this model instead of the one being trained (the trained LoRA "
        "applied to it): e.g. train on FLUX.2 Klein base and preview on the step-distilled Klein, which samples in "
        "4 steps. The same family and architecture as the base model. Empty = the trained model.", "validation",
        path=True)
    validation_with_ema: bool = knob(True, "With ema_decay above 0: validation images show the EMA weights "
                                     "(off: the weights as trained).", "validation")
    sample_judge: Literal[tuple(SAMPLE_JUDGES)] = knob(  # type: ignore[valid-type]  (config/judges.py)
        "none", "Measure every set of validation images with a built-in judge. 'toy_colors' (toy-world prompts such "
        "as 'a purple circle'): the concept colour's hue error in degrees against the run's training images, each "
        "known colour's drift in degrees against the base model's step-0 image, shapes right in percent; the run "
        "ends with a learning summary (the demo).",
        "validation")

    # ---- diagnostics (overfitting control) -----------------------------------------------------------
    perceptual_lambda: float = knob(0.0, "Weight of the LPIPS perceptual regulariser between the image decoded "
                                    "from the predicted x0 and the training image (0 = off).", "diagnostics",
                                    ge=0.0, le=10.0)
    perceptual_net: Literal["alex", "vgg", "squeeze"] = knob(
        "alex", "LPIPS backbone. Its ImageNet weights must be in the torch cache (~/.cache/torch/hub/checkpoints).",
        "diagnostics")
    perceptual_random_backbone: bool = knob(
        False, "When the LPIPS backbone weights are not in the torch cache, train with a randomly initialised "
        "backbone instead of refusing to start (that is NOT the LPIPS perceptual metric; for tests).",
        "diagnostics")
    perceptual_every: int = knob(1, "Add the perceptual term on every this many optimizer steps.", "diagnostics",
                                 ge=1)
    perceptual_timestep_max: int = knob(
        400, "Only images noised at timesteps below this get the perceptual term (x0 predicted from very noisy "
        "latents is a blur).", "diagnostics", ge=1, le=1000)
    perceptual_batch: int = knob(1, "At most this many images per batch of train_batch_size get the perceptual "
                                 "term (each one is decoded by the VAE with gradients: memory); the term is the "
                                 "mean over them.", "diagnostics", ge=1, le=64)
    diagnostics_every: int = knob(100, "Singular-value spectra of every LoRA module every this many steps "
                                  "(0 = off).", "diagnostics", ge=0)
    activation_stats_every: int = knob(200, "Statistics of the LoRA outputs on a fixed probe batch every this many "
                                       "steps (0 = off).", "diagnostics", ge=0)
    collapse_threshold: float = knob(
        0.15, "Warn of rank collapse when the second singular value falls under this fraction of the first in "
        "most LoRA modules.", "diagnostics", gt=0.0, lt=1.0)
    validation_split: Optional[float] = knob(
        None, "Fraction of the images held out of training to measure validation loss on. Empty = automatic: "
        f"{AUTO_VALIDATION_SPLIT:.0%} (at least one image) when the dataset has {AUTO_SPLIT_MIN_IMAGES} images or "
        "more and validation loss is on, else none. 0 = measure on a fixed subset of the training images, which "
        "shows divergence but not overfitting.", "validation", ge=0.0, lt=1.0)
    validation_count: int = knob(4, "At most this many images are measured for validation loss.", "validation",
                                 ge=1, le=256)
    validation_loss_every: int = knob(100, "Validation loss (fixed noise and timesteps) every this many steps "
                                      "(0 = off).", "validation", ge=0)
    validation_timesteps: int = knob(3, "Fixed timesteps, evenly spread, at which each validation image is "
                                     "measured (3 and up put one in each noise band the metrics report: low, mid "
                                     "and high noise).", "validation", ge=1, le=50)
    early_stopping: bool = knob(False, "Stop when validation loss rises clearly above its best (use with "
                                "validation_split > 0); the best LoRA is exported next to the last.", "validation")
    early_stopping_window: int = knob(5, "Validation evaluations in the reference window around the best.",
                                      "validation", ge=2, le=100)
    early_stopping_factor: float = knob(1.3, "An evaluation triggers when it is above this factor times the upper "
                                        "quartile of the reference window.", "validation", gt=1.0, le=10.0)
    early_stopping_patience: int = knob(3, "Triggers since the best that stop the run.", "validation", ge=1, le=100)
    early_stopping_min_steps: int = knob(500, "Never stop before this many steps.", "validation", ge=0)

    # ------------------------------------------------------------------------------------------------
    @field_validator("resolution")
    @classmethod
    def _resolution_multiple_of_8(cls, v: int) -> int:
        if v % 8:
            raise ValueError(f"{v} is not a multiple of 8; use {v - v % 8} or {v - v % 8 + 8}")
        return v

    @field_validator("output_name")
    @classmethod
    def _plain_file_name(cls, v: str) -> str:
        if not v or any(c in v for c in '/\\:*?"<>|') or v.startswith("."):
            raise ValueError(f"'{v}' is not a plain file name; use letters, digits, '-' and '_'")
        return v

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_names(cls, v: Any) -> Any:
        # accelerate's spellings (diffusers' scripts pass them through): 'none' and 'all'.
        return {"none": "jsonl", "": "jsonl", "all": "tensorboard"}.get(str(v).strip().lower(), v)

    @field_validator("pivotal_tokens")
    @classmethod
    def _pivotal_token_syntax(cls, v: list[str]) -> list[str]:
        from .tokens import parse_tokens

        parse_tokens(v)  # raises ValueError with the sentence
        return v

    @field_validator("unet_lora_targets")
    @classmethod
    def _some_targets(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("is empty; name at least one UNet module such as to_q")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "TrainConfigSchema":
        for problem in family_problems(self, self.model_family)[:1]:  # config/families.py: knobs per family
            raise ValueError(problem.rstrip("."))
        if self.use_8bit_adam and self.optimizer == "adamw":
            object.__setattr__(self, "optimizer", "adamw8bit")
        if self.min_bucket_reso > self.max_bucket_reso:
            raise ValueError(f"min_bucket_reso ({self.min_bucket_reso}) is larger than max_bucket_reso "
                             f"({self.max_bucket_reso}); swap them")
        if self.optimizer == "prodigy" and "learning_rate" not in self.model_fields_set:
            object.__setattr__(self, "learning_rate", 1.0)  # Prodigy's lr multiplies the step size it finds
        if clash := multi_vector_clash(self.pivotal_tokens, self.num_vectors_per_token):
            raise ValueError(clash)
        if self.pivotal_tokens and self.cache_text_embeddings:
            raise ValueError("cache_text_embeddings cannot be combined with pivotal_tokens (the new token embeddings "
                             "change every step); turn one of them off")
        if self.cache_text_embeddings and (self.shuffle_caption or self.caption_tag_dropout_rate
                                           or self.train_text_encoder):
            raise ValueError("cache_text_embeddings cannot be combined with caption shuffle, tag dropout or "
                             "text-encoder training; turn one of them off")
        if self.optimizer == "adamw_schedulefree" and self.lr_scheduler != "constant":
            raise ValueError(f"optimizer=adamw_schedulefree replaces the learning-rate schedule; set "
                             f"lr_scheduler=constant instead of {self.lr_scheduler} (lr_warmup_steps still warms up)")
        if self.blocks_to_swap and not self.gradient_checkpointing:
            raise ValueError(f"blocks_to_swap {self.blocks_to_swap} needs gradient_checkpointing (without it every "
                             "block's weights stay on the GPU until the backward pass); turn gradient_checkpointing on")
        if self.early_stopping and not self.validation_loss_every:
            raise ValueError("early_stopping needs validation loss; set validation_loss_every above 0")
        if self.network_type != "lora" and self.export_diffusers_format:
            raise ValueError(f"diffusers cannot load {self.network_type} files; turn export_diffusers_format off "
                             "(the .safetensors file loads in A1111, Forge and ComfyUI)")
        if self.use_dora and self.network_type != "lora":
            raise ValueError(f"use_dora decomposes a LoRA's weight; it does not apply to network_type "
                             f"{self.network_type}; turn use_dora off or use network_type=lora")
        if self.use_dora and self.export_diffusers_format:
            raise ValueError("diffusers applies DoRA per output channel, StableTune's DoRA (the WebUIs' form) is per "
                             "input channel; turn export_diffusers_format off (the .safetensors file loads in A1111, "
                             "Forge and ComfyUI)")
        if self.network_type != "lora" and self.scale_weight_norms:
            raise ValueError(f"scale_weight_norms measures LoRA's up@down update, which {self.network_type} does not "
                             "have; leave scale_weight_norms empty or use network_type=lora")
        if self.lr_scheduler == "plateau" and not self.validation_loss_every:
            raise ValueError("lr_scheduler plateau lowers the rate when validation loss stalls, but "
                             "validation_loss_every is 0; set it above 0 or choose another lr_scheduler")
        return self

    # ------------------------------------------------------------------------------------------------
    @property
    def effective_lora_alpha(self) -> float:
        return float(self.lora_alpha if self.lora_alpha is not None else self.lora_rank)

    @property
    def validation_prompts(self) -> list[str]:
        if not self.validation_prompt:
            return []
        return [p.strip() for p in self.validation_prompt.split(" | ") if p.strip()]

    def notes(self) -> list[str]:
        """Settings that are valid but probably not what the user meant, one sentence each (the console, the
        event log and the UI show them; they never block a run)."""
        notes = []
        if self.optimizer == "prodigy" and not 0.1 <= self.learning_rate:
            notes.append(f"optimizer prodigy finds its own step size and multiplies it by learning_rate, so "
                         f"learning_rate {self.learning_rate:g} makes every step {1 / self.learning_rate:.0f}x "
                         "smaller than Prodigy's; use learning_rate 1.0 (or leave it unset).")
        if self.network_type in ("loha", "lokr"):
            times = round(TOY_DEMO_RATES[self.network_type][0] / TOY_DEMO_RATES["lora"][0])
            notes.append(f"network_type {self.network_type} moves the weights less per step than LoRA at the same "
                         f"learning rate: the toy demo needs {times}x LoRA's rate to learn its concept in the same "
                         "steps; if the concept does not appear, raise learning_rate and text_encoder_lr rather "
                         "than training longer.")
        if self.network_type != "lora" and (self.diagnostics_every or self.activation_stats_every):
            notes.append(f"network_type {self.network_type}: the rank spectra, collapse check and activation "
                         "statistics read LoRA's low-rank up/down factors, so this run skips them.")
        if self.use_dora and self.network_type == "lora" and (self.diagnostics_every or self.activation_stats_every):
            notes.append("use_dora: the rank spectra and collapse check describe the LoRA direction (up@down) only, "
                         "not the learned magnitudes.")
        return notes + run_host_limits(self, self.model_family)  # a Klein named here; with auto the UI asks too


#: The knobs whose values name files or folders of the user's machine (marked `path=True` above).
PATH_KNOBS: tuple[str, ...] = tuple(name for name, info in TrainConfigSchema.model_fields.items()
                                    if (info.json_schema_extra or {}).get("path"))
