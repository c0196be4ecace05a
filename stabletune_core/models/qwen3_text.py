"""Prompts through a frozen Qwen3 text encoder, the one text path of the families that read Qwen3 (FLUX.2 Klein,
Z-Image): each prompt wrapped in Qwen3's chat template as one user turn, padded to a fixed length and run through
the encoder with every hidden state kept. Which hidden states a family reads, and whether the assistant turn carries
an empty think block, are the family's (Klein: layers 9, 18, 27 stacked, no thinking; Z-Image: the second to last
layer, thinking left on, as ``ZImagePipeline._encode_prompt``).

Both families load the same Qwen3 tokenizer and check it the same way (`check_tokenizer`), and their tests build the
same tiny Qwen3 (`build_tiny_tokenizer`, `text_encoder_config`): all of it lives here, once.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from .base import ModelLoadError

#: Qwen3's chat template as far as these prompts reach it: one user turn, the assistant turn opened, and the empty
#: think block that enable_thinking=False adds (ComfyUI's KleinTokenizer writes the same text).
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")
#: The tokens Qwen3's chat template needs; a tokenizer without them is not Qwen's.
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def qwen3_hidden_states(tokenizer, text_encoder, prompts: list[str], *, max_length: int, enable_thinking: bool
                        ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """(every hidden state of the encoder, each [B, max_length, hidden]; the attention mask [B, max_length]) of
    `prompts`, each rendered by the tokenizer's chat template and padded (or cut) to `max_length` tokens."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True, enable_thinking=enable_thinking)
             for p in prompts]
    inputs = tokenizer(texts, return_tensors="pt", padding="max_length", truncation=True, max_length=max_length)
    mask = inputs["attention_mask"].to(text_encoder.device)
    out = text_encoder(input_ids=inputs["input_ids"].to(text_encoder.device), attention_mask=mask,
                       output_hidden_states=True, use_cache=False)
    return out.hidden_states, mask


#: Qwen3's prompt length when the run sets none (FLUX.2 Klein's and Z-Image's pipelines pad to 512).
MAX_SEQUENCE_LENGTH = 512


def text_length(bundle: Any) -> int:
    """How many tokens this bundle's prompts are padded to (the config's max_sequence_length, given to load())."""
    return int(bundle.extra.get("max_sequence_length", MAX_SEQUENCE_LENGTH))


def caption_token_counter(tokenizer: Any, *, enable_thinking: bool) -> Callable[[str], int]:
    """How many tokens a caption takes in the prompt the text encoder reads: the caption inside the family's chat
    template (Klein without thinking, Z-Image with it, as each pipeline encodes), untruncated."""
    def count(text: str) -> int:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True, enable_thinking=enable_thinking)
        return len(tokenizer(prompt, truncation=False, verbose=False).input_ids)

    return count


def check_tokenizer(tokenizer, text_encoder) -> None:
    """One sentence when the tokenizer cannot be Qwen3's for this text encoder: Qwen3's chat tokens unknown, or ids
    past the encoder's embedding table."""
    vocab = tokenizer.get_vocab()
    missing = [t for t in CHAT_TOKENS if t not in vocab]
    rows = text_encoder.get_input_embeddings().weight.shape[0]
    if missing:
        raise ModelLoadError(f"The tokenizer does not match the Qwen3 text encoder: it has no {missing[0]} token, so "
                             "it is not Qwen's; use the tokenizer of the Qwen3 model the text encoder came from.")
    if len(tokenizer) > rows:
        raise ModelLoadError(f"The tokenizer does not match the Qwen3 text encoder: it has {len(tokenizer)} tokens "
                             f"but the encoder embeds only {rows}; use the tokenizer of that Qwen3 model.")


# --------------------------------------------------------------------------- the tiny Qwen3 of the tests
#: A tiny Qwen3 text encoder for the families' tiny real-layout models (models/*/tiny.py): 16 wide, 28 layers (so
#: Klein's hidden layers 9, 18, 27 are intermediate ones, as in the real 36-layer encoder), and a byte-level BPE
#: tokenizer trained here with the ``tokenizers`` package on a fixed corpus (Qwen's pre-tokenizer, its special
#: tokens, the chat template above), built offline and deterministically.
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
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    tok.model_max_length = 131072
    if out_dir is not None:
        out_dir = Path(out_dir)
        tok.save_pretrained(str(out_dir))
        if comfy_layout:
            _as_comfy_ships_it(out_dir, tok, data["vocab"], merges)
    return tok


#: ComfyUI's bundled tokenizer carries Qwen2.5's chat template, which opens with a default system turn; Klein's
#: prompt has none (that family replaces such a template when it loads the tokenizer).
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
