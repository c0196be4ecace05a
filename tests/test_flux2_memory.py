"""Issue 23, part 1, item 6 (the CPU part): the real FLUX.2 Klein 4B and 9B parameter counts from the shipped
configs, and the training-memory model behind the presets (4B at 12 GB, 9B at 24 GB) and the UI's estimate."""
from __future__ import annotations

import pytest

from stabletune_core.models.flux2_klein.memory import (GIB, estimate_training_memory, klein_sizes, lora_parameters,
                                                 stored_text_encoder)


def test_parameter_counts_are_the_released_models():
    """BFL's flux-2-klein-4b.safetensors holds 7,751,089,152 bytes of bf16 weights and the 9B file 18,157,162,496:
    exactly the shipped configs' transformers; Qwen3-4B (tied embeddings) and Qwen3-8B as Qwen publishes them."""
    four, nine = klein_sizes("4b"), klein_sizes("9b")
    assert (four.transformer, nine.transformer) == (3_875_544_576, 9_078_581_248)
    assert (four.transformer * 2, nine.transformer * 2) == (7_751_089_152, 18_157_162_496)
    assert (four.text_encoder, nine.text_encoder) == (4_022_468_096, 8_190_735_360)
    assert four.vae == nine.vae == 84_046_115
    assert (four.hidden, four.blocks, nine.hidden, nine.blocks) == (3072, 25, 4096, 32)
    # rank 16 on the 'attention' preset: 8 layers per double block, the two fused layers of each single block
    assert lora_parameters("4b", 16) == 16 * (5 * 8 * 2 * 3072 + 20 * ((3072 + 27648) + (12288 + 3072)))


def test_estimate_matches_the_presets_and_moves_the_right_way():
    base = dict(precision="bf16", gradient_checkpointing=True, batch_size=1, resolution=1024, lora_rank=16,
                cache_text_embeddings=True)
    four, nine = estimate_training_memory("4b", **base), estimate_training_memory("9b", **base)
    assert four.fits(12) and not nine.fits(16) and nine.fits(24)  # the 12 GB and 22-24 GB
    bigger = [estimate_training_memory("4b", **{**base, key: value}).total for key, value in
              [("gradient_checkpointing", False), ("batch_size", 2), ("resolution", 1536), ("lora_rank", 64),
               ("cache_text_embeddings", False), ("precision", "fp32")]]
    assert all(total > four.total for total in bigger)
    shorter = estimate_training_memory("4b", **base, text_tokens=128)  # max_sequence_length 128: fewer tokens
    assert shorter.activations == four.activations * (64 * 64 + 128) // (64 * 64 + 512)
    uncached = estimate_training_memory("4b", **{**base, "cache_text_embeddings": False})
    # Qwen3-4B stays in bf16: its parameters, and its rotary-embedding buffers (256 bytes; issue 36 counts buffers)
    assert uncached.weights - four.weights == stored_text_encoder("4b") == klein_sizes("4b").text_encoder * 2 + 256
    assert abs(four.total_gib - four.total / GIB) < 1e-9
    with pytest.raises(ValueError, match="precision must be one of"):
        estimate_training_memory("4b", precision="fp8")
