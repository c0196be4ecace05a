"""A tiny FLUX.2 Klein with the real layout and random weights, for tests: built offline, in seconds, from a seed.

Every part is the real class in Klein's arrangement, only narrow: a Flux2Transformer2DModel with two double and two
single blocks, an AutoencoderKLFlux2 with four levels and the latent batch norm (given non-trivial statistics so
the normalisation is exercised), a Qwen3ForCausalLM with 28 layers (so the pipeline's hidden layers 9, 18, 27 are
intermediate ones, as in the real 36-layer encoder), a byte-level BPE tokenizer trained here with the
``tokenizers`` package on a fixed corpus (Qwen's pre-tokenizer, its special tokens, a chat template that renders
what Qwen3's does for Klein's prompts) and the shipped scheduler config. 64 px images are 8 x 8 VAE latents,
4 x 4 = 16 image tokens after the 2 x 2 patchify.

It is written as a diffusers folder (``build_tiny_klein``) and as the files a ComfyUI user keeps
(``build_tiny_klein_single_files``): the transformer in BFL keys under ``models/diffusion_models``, the text encoder
under ``models/text_encoders``, the VAE in the LDM layout under ``models/vae`` and the tokenizer where ComfyUI ships
Qwen's (``comfy/text_encoders/qwen25_tokenizer``: vocab.json, merges.txt, tokenizer_config.json).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .family import KLEIN_CHAT_TEMPLATE, SHIPPED_CONFIGS

TINY_IMAGE_SIZE = 64

TRANSFORMER_CONFIG = dict(
    patch_size=1,
    in_channels=16,  # 4 latent channels x the 2 x 2 patch
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=48,  # the three stacked text-encoder layers x 16
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(4, 4, 4, 4),
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=False,
)
VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(8, 16, 16, 16),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=8,
    sample_size=TINY_IMAGE_SIZE,
    use_quant_conv=True,
    use_post_quant_conv=True,
    patch_size=(2, 2),
)
TEXT_HIDDEN = 16
TEXT_LAYERS = 28

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINK_TOKENS = ("<think>", "</think>")  # added, not special, as in Qwen3's tokenizer
_CORPUS_WORDS = ("a an the of on in with and photo picture drawing image shape circle square triangle star heart "
                 "red yellow green cyan blue purple white black background small large big user assistant think "
                 "system hello world cat dog sign holding").split()


def tiny_corpus() -> list[str]:
    words = _CORPUS_WORDS
    return [f"{a} {b} {c}" for a in words for b in words[::3] for c in words[::5]]


def build_tiny_tokenizer(out_dir: Path | None = None, *, comfy_layout: bool = False):
    """A Qwen2Tokenizer trained here (deterministic) and, if out_dir is given, saved there: tokenizer.json +
    tokenizer_config.json (diffusers layout) or vocab.json + merges.txt + tokenizer_config.json (ComfyUI's)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(tiny_corpus(), trainer=trainer)
    data = json.loads(bpe.to_str())["model"]
    pairs = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in data["merges"]]
    merges = [" ".join(p) for p in pairs]
    tok = Qwen2Tokenizer(vocab=data["vocab"], merges=pairs, unk_token=None, bos_token=None,
                         additional_special_tokens=list(SPECIAL_TOKENS))
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"
    tok.add_tokens(list(THINK_TOKENS))
    tok.chat_template = KLEIN_CHAT_TEMPLATE
    tok.model_max_length = 131072
    if out_dir is not None:
        out_dir = Path(out_dir)
        tok.save_pretrained(str(out_dir))
        if comfy_layout:
            _as_comfy_ships_it(out_dir, tok, data["vocab"], merges)
    return tok


#: ComfyUI's bundled tokenizer carries Qwen2.5's chat template, which opens with a default system turn; Klein's
#: prompt has none (the family replaces such a template when it loads the tokenizer).
QWEN25_STYLE_TEMPLATE = (
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def _as_comfy_ships_it(out_dir: Path, tok, vocab: dict, merges: list[str]) -> None:
    """vocab.json + merges.txt + a tokenizer_config.json listing the added tokens, no tokenizer.json (the layout of
    ComfyUI's comfy/text_encoders/qwen25_tokenizer)."""
    for name in ("tokenizer.json", "chat_template.jinja"):
        (out_dir / name).unlink(missing_ok=True)
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    added = {str(tok.convert_tokens_to_ids(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                                 "single_word": False, "special": t in SPECIAL_TOKENS}
             for t in SPECIAL_TOKENS + THINK_TOKENS}
    config = {"add_prefix_space": False, "added_tokens_decoder": added, "additional_special_tokens":
              list(SPECIAL_TOKENS[1:]), "bos_token": None, "chat_template": QWEN25_STYLE_TEMPLATE,
              "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 131072,
              "pad_token": "<|endoftext|>", "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _vocab_rows(tokenizer) -> int:
    return ((len(tokenizer) + 63) // 64) * 64  # rows padded as Qwen pads 151669 tokens to 151936


def text_encoder_config(tokenizer) -> dict:
    return dict(vocab_size=_vocab_rows(tokenizer), hidden_size=TEXT_HIDDEN, intermediate_size=32,
                num_hidden_layers=TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))


def build_tiny_klein_components(seed: int = 0) -> dict:
    """transformer, vae, text_encoder, tokenizer, scheduler of the tiny Klein, in memory, deterministic from seed."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(**TRANSFORMER_CONFIG)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLFlux2(**VAE_CONFIG)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():  # latent statistics as a trained VAE has them, not the identity
        vae.bn.running_mean.copy_(0.2 * torch.randn(vae.bn.running_mean.shape, generator=g))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape, generator=g))
    torch.manual_seed(seed + 3)
    text_encoder = Qwen3ForCausalLM(Qwen3Config(**text_encoder_config(tokenizer)))
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(
        str(SHIPPED_CONFIGS["4b"]), subfolder="scheduler", local_files_only=True)
    for m in (transformer, vae, text_encoder):
        m.eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
            "scheduler": scheduler}


def build_tiny_klein(out_dir: Path, seed: int = 0, *, distilled: bool = False) -> Path:
    """Write a complete tiny Klein diffusers folder (``is_distilled`` as asked) and return its path."""
    import diffusers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = build_tiny_klein_components(seed)
    for name in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        parts[name].save_pretrained(str(out_dir / name))
    index = json.loads((SHIPPED_CONFIGS["4b"] / "model_index.json").read_text())
    index.update(_diffusers_version=diffusers.__version__, is_distilled=distilled)
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2))
    return out_dir


def build_tiny_klein_single_files(root: Path, seed: int = 0, *, distilled: bool = False) -> dict[str, Path]:
    """The same model as a ComfyUI user keeps it under `root`; returns the paths of the four parts. The transformer
    file is named as BFL names theirs (``flux-2-klein-base-...`` for the base model)."""
    from safetensors.torch import save_file

    from .single_file import transformer_to_bfl, vae_to_ldm

    root = Path(root)
    parts = build_tiny_klein_components(seed)
    paths = {
        "transformer": root / "models" / "diffusion_models" / (
            "flux-2-klein-tiny.safetensors" if distilled else "flux-2-klein-base-tiny.safetensors"),
        "text_encoder": root / "models" / "text_encoders" / "qwen_3_tiny.safetensors",
        "vae": root / "models" / "vae" / "flux2-vae-tiny.safetensors",
        "tokenizer": root / "comfy" / "text_encoders" / "qwen25_tokenizer",
    }
    te_state = {k: v for k, v in parts["text_encoder"].state_dict().items() if k != "lm_head.weight"}  # tied
    states = {"transformer": transformer_to_bfl(parts["transformer"].state_dict()), "text_encoder": te_state,
              "vae": vae_to_ldm(parts["vae"])}
    for name, state in states.items():
        paths[name].parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, str(paths[name]))
    paths["tokenizer"].mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(paths["tokenizer"], comfy_layout=True)
    return paths


def write_tiny_config_tree(out_dir: Path, seed: int = 0) -> Path:
    """A config tree (model_index + component configs, no weights) describing the tiny model, the counterpart of
    the shipped ``configs/flux2-klein-4b``, for loading the tiny single files."""
    out_dir = Path(out_dir)
    parts = build_tiny_klein_components(seed)
    for name in ("transformer", "vae", "text_encoder"):
        (out_dir / name).mkdir(parents=True, exist_ok=True)
        parts[name].config.to_json_file(str(out_dir / name / "config.json")) if name == "text_encoder" else \
            parts[name].save_config(str(out_dir / name))
    parts["scheduler"].save_config(str(out_dir / "scheduler"))
    (out_dir / "model_index.json").write_text((SHIPPED_CONFIGS["4b"] / "model_index.json").read_text())
    return out_dir
