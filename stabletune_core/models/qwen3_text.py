"""Prompts through a frozen Qwen3 text encoder, the one text path of the families that read Qwen3 (FLUX.2 Klein,
Z-Image): each prompt wrapped in Qwen3's chat template as one user turn, padded to a fixed length and run through
the encoder with every hidden state kept. Which hidden states a family reads, and whether the assistant turn carries
an empty think block, are the family's (Klein: layers 9, 18, 27 stacked, no thinking; Z-Image: the second to last
layer, thinking left on, as ``ZImagePipeline._encode_prompt``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch


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
