"""Issue 39 item 6 (the memory half): Z-Image's memory model and plan. The released transformer's config shipped in
models/z_image/configs (no weights), its exact bytes per base storage on the meta device, Qwen3-4B read from the one
copy Klein 4B ships, FLUX.1's VAE; the plan picks fitting settings for 12, 16 and 24 GB, the presets carry them, a
vram_gb too small is one sentence before any model loads, and the UI's Model tab shows the plan for Z-Image."""
from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flux2_tools import one_sentence
from stabletune_core.config import ConfigError, build_config, read_toml
from stabletune_core.models.memory import GIB, QWEN3_4B_CONFIG
from stabletune_core.models.memory_plan import plan_memory
from stabletune_core.models.quantize import NF4_BLOCK
from stabletune_core.models.z_image.memory import (Z_IMAGE_CONFIGS, estimate_z_image_training_memory,
                                                   stored_text_encoder, stored_transformer, vae_parameters)
from test_z_image import folders  # noqa: F401 (the module-scoped tiny model)

ROOT = Path(__file__).resolve().parent.parent
CARDS = (12, 16, 24)
PRESET_CARDS = (8, *CARDS)


def meta_transformer():
    from diffusers import ZImageTransformer2DModel

    config = json.loads((Z_IMAGE_CONFIGS / "transformer" / "config.json").read_text())
    with torch.device("meta"):
        return ZImageTransformer2DModel(**{k: v for k, v in config.items() if not k.startswith("_")})


def test_the_shipped_config_is_the_released_transformer():
    """diffusers' ZImageTransformer2DModel defaults are Tongyi-MAI's model; the shipped config.json differs only in
    axes_lens (the RoPE table's length, 1536 in the Hub's config.json: no weights) and is 6.15 B parameters."""
    from diffusers import ZImageTransformer2DModel

    config = json.loads((Z_IMAGE_CONFIGS / "transformer" / "config.json").read_text())
    defaults = {name: p.default for name, p in inspect.signature(ZImageTransformer2DModel.__init__).parameters.items()
                if name != "self"}
    differs = {k for k, v in config.items() if not k.startswith("_") and
               (list(v) if isinstance(v, (list, tuple)) else v) !=
               (list(defaults[k]) if isinstance(defaults[k], (list, tuple)) else defaults[k])}
    assert differs == {"axes_lens"} and config["axes_lens"] == [1536, 512, 512]
    model = meta_transformer()
    assert sum(p.numel() for p in model.parameters()) == 6_154_908_736
    assert (len(model.layers), len(model.noise_refiner), len(model.context_refiner)) == (30, 2, 2)
    assert vae_parameters() == 83_819_683  # FLUX.1's AutoencoderKL: 16 latent channels, no quant convs
    vae = json.loads((Z_IMAGE_CONFIGS / "vae" / "config.json").read_text())
    assert (vae["latent_channels"], vae["scaling_factor"], vae["shift_factor"]) == (16, 0.3611, 0.1159)


def independent_bytes(model: torch.nn.Module, storage: str) -> int:
    """The bytes by hand: every tensor in bf16, each quantised Linear weight a byte a weight and an fp32 scale a row
    (int8 / fp8), or two 4-bit codes a byte and an fp32 absmax per 64 weights (nf4)."""
    total = 2 * sum(p.numel() for p in model.parameters()) + 2 * sum(b.numel() for b in model.buffers())
    if storage == "full":
        return total
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            count, rows = module.weight.numel(), module.weight.shape[0]
            blocks = -(-count // NF4_BLOCK)
            total += -2 * count + (blocks * NF4_BLOCK // 2 + blocks * 4 if storage == "nf4" else count + rows * 4)
    return total


@pytest.mark.parametrize("storage, expected", [("full", 12_309_817_472), ("int8", 6_163_368_320),
                                               ("fp8", 6_163_368_320), ("nf4", 3_463_639_168)])
def test_weight_bytes_per_storage_are_exact_on_the_meta_device(storage, expected):
    stored = stored_transformer(storage)
    model = meta_transformer()
    assert stored.total == independent_bytes(model, storage) == expected
    # the blocks block swap moves, in run order, each exact: 2 noise refiners, 2 context refiners, 30 main layers
    blocks = [*model.noise_refiner, *model.context_refiner, *model.layers]
    assert stored.blocks == tuple(independent_bytes(block, storage) for block in blocks) and len(stored.blocks) == 34
    assert stored.resident(0) == stored.total
    # swapped: the rest stays, and the two largest swapped blocks (computing, being copied in) are on the device too
    assert stored.resident(11) == stored.total - sum(stored.blocks[-11:]) + 2 * stored.blocks[-1]
    assert stored.resident(34) == stored.total - sum(stored.blocks) + 2 * max(stored.blocks)
    # Qwen3-4B, the encoder Klein 4B reads: the one config both families price (not a copy)
    from stabletune_core.models.flux2_klein.memory import stored_text_encoder as klein_text_encoder

    assert stored_text_encoder(storage) == klein_text_encoder("4b", storage)
    assert not (Z_IMAGE_CONFIGS / "text_encoder").exists() and QWEN3_4B_CONFIG.parent.name == "flux2-klein-4b"


def test_activations_follow_the_tokens_each_block_runs_on():
    base = estimate_z_image_training_memory(resolution=1024)
    assert base.weights == 12_309_817_472 + 83_819_683 * 2  # the transformer and the VAE, bf16 (text cached)
    bigger = [estimate_z_image_training_memory(**{k: v}).total for k, v in
              [("gradient_checkpointing", False), ("batch_size", 2), ("resolution", 1536), ("lora_rank", 64),
               ("cache_text_embeddings", False), ("precision", "fp32"), ("text_tokens", 1024)]]
    assert all(total > base.total for total in bigger)
    assert estimate_z_image_training_memory(base_storage="int8").total < base.total
    uncached = estimate_z_image_training_memory(cache_text_embeddings=False)
    assert uncached.weights - base.weights == stored_text_encoder() and uncached.setup == 0 < base.setup


def z_image_config(**values):
    return build_config(dict(model_family="z_image", pretrained_model_name_or_path="z", train_data_dir="d",
                             resolution=1024, mixed_precision="bf16", **values))


def test_the_plan_picks_the_cheapest_settings_that_fit_12_16_and_24_gb():
    twelve, sixteen, roomy = (plan_memory(z_image_config(vram_gb=card), family="z_image") for card in CARDS)
    assert twelve.update == {"cache_text_embeddings": True, "gradient_checkpointing": True, "base_storage": "int8"}
    assert sixteen.update == roomy.update == {"cache_text_embeddings": True, "gradient_checkpointing": True}
    for plan, card in zip((twelve, sixteen, roomy), CARDS):
        assert plan.estimate.fits(card) and plan.sentence.startswith(f"Memory plan for {card} GiB: chose ")
        assert "Estimated GPU memory for Z-Image: about " in plan.sentence and "\n" not in plan.sentence
    # the cheaper rung before each choice does not fit: bf16 at 12 GB, no gradient checkpointing at 16 GB
    assert not plan_memory(z_image_config(vram_gb=80, base_storage="full", cache_text_embeddings=True,
                                          gradient_checkpointing=True), family="z_image").estimate.fits(12)
    assert not plan_memory(z_image_config(vram_gb=80, cache_text_embeddings=True, gradient_checkpointing=False),
                           family="z_image").estimate.fits(16)
    assert "blocks_to_swap" not in twelve.update  # int8 fits 12 GB: no block is swapped


def test_the_plan_swaps_blocks_when_the_base_storage_alone_does_not_fit():
    """8 GB at 1024 px: int8 alone needs 9.5 GiB, so the plan keeps int8 and swaps blocks (int8 with blocks swapped
    comes before nf4, as for Klein), the fewest that fit; 6 GB swaps more; a base_storage the user set is kept."""
    eight, six = (plan_memory(z_image_config(vram_gb=card), family="z_image") for card in (8, 6))
    assert eight.update == {"cache_text_embeddings": True, "gradient_checkpointing": True, "base_storage": "int8",
                            "blocks_to_swap": 11}
    assert six.update["base_storage"] == "int8" and six.update["blocks_to_swap"] == 22
    for plan, card in ((eight, 8), (six, 6)):
        assert plan.estimate.fits(card) and f", {plan.update['blocks_to_swap']} blocks swapped." in plan.sentence
        fewer = estimate_z_image_training_memory(base_storage="int8", blocks_to_swap=plan.update["blocks_to_swap"] - 1)
        assert not fewer.fits(card)  # the fewest blocks that fit
    assert not estimate_z_image_training_memory(base_storage="int8").fits(8)
    kept = plan_memory(z_image_config(vram_gb=6, base_storage="nf4"), family="z_image")
    assert "base_storage" not in kept.update and 0 < kept.update["blocks_to_swap"] < 22


def test_blocks_to_swap_is_read_on_z_image_with_gradient_checkpointing():
    """It was refused on Z-Image in one sentence until a swapped run was shown bitwise the plain one
    (tests/test_block_swap.py); it still needs gradient checkpointing, as on Klein."""
    assert z_image_config(blocks_to_swap=4, gradient_checkpointing=True).blocks_to_swap == 4
    with pytest.raises((ConfigError, ValueError)) as refused:
        z_image_config(blocks_to_swap=4)
    assert "needs gradient_checkpointing" in str(refused.value)
    with_swap = estimate_z_image_training_memory(base_storage="int8", blocks_to_swap=4)
    assert with_swap.weights < estimate_z_image_training_memory(base_storage="int8").weights


@pytest.mark.parametrize("card", PRESET_CARDS)
def test_each_card_preset_loads_validates_and_its_plan_fits(card):
    preset = ROOT / "presets" / f"z_image-{card}gb.toml"
    values = read_toml(preset)
    assert values["model_family"] == "z_image" and values["vram_gb"] == card
    assert not {"base_storage", "gradient_checkpointing", "cache_text_embeddings", "blocks_to_swap"} & set(values)
    config = build_config({**values, "pretrained_model_name_or_path": "z", "train_data_dir": "d"})
    plan = plan_memory(config, family="z_image")
    assert plan.estimate.fits(card)
    said = f"about {plan.estimate.total_gib:.1f} GiB"
    assert said in plan.sentence and said in preset.read_text()  # the preset's comment is the plan's number


def test_a_vram_gb_too_small_is_one_sentence():
    with pytest.raises(ConfigError) as caught:
        plan_memory(z_image_config(vram_gb=3), family="z_image")
    (sentence,) = caught.value.problems
    assert sentence.startswith("vram_gb 3 is below anything this run fits in: the smallest plan (")
    assert "base nf4, 34 blocks swapped" in sentence and one_sentence(sentence.replace("; ", " "))


def test_a_run_with_vram_gb_too_small_fails_in_one_sentence_before_the_model_loads(folders, tmp_path,  # noqa: F811
                                                                                   shapes_dataset):
    from test_faults import environment

    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "stabletune_core", "train", "--model_family", "z_image",
                           "--pretrained_model_name_or_path", str(folders["base"]), "--train_data_dir",
                           str(shapes_dataset), "--output_dir", str(run), "--resolution", "64",
                           "--max_train_steps", "1", "--vram_gb", "1"],
                          cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "vram_gb 1 is below anything" in line]
    assert "Loaded" not in done.stderr
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and "vram_gb 1 is below anything" in status["error"]


def test_the_model_tab_shows_the_plan_for_z_image(folders):  # noqa: F811
    """query_cli memory answers for Z-Image in the run's words, and the UI asks for a Z-Image it detects itself."""
    from extension.validation import names_planned_family
    from test_memory_plan_ui import ask_memory

    form = build_config(dict(model_family="z_image", resolution=1024, vram_gb=12))
    answer = ask_memory({k: v for k, v in form.model_dump(mode="json").items() if v is not None})
    assert answer["plan"] == plan_memory(build_config(dict(model_family="z_image", resolution=1024, vram_gb=12)),
                                         family="z_image").sentence
    assert answer["plan"].startswith("Memory plan for 12 GiB: chose text embeddings cached, bf16, gradient "
                                     "checkpointing, base int8.")  # the form's mixed_precision "no" left to the plan
    assert "base_storage full " in answer["costs"] and "blocks_to_swap 0 (now) " in answer["costs"]
    assert answer["gib"] == round(answer["gib"], 2) and answer["gib"] > 12  # the settings as they stand: bf16
    assert names_planned_family({"pretrained_model_name_or_path": str(folders["base"])})  # auto: detected


def test_the_bench_tables_are_the_memory_models_numbers():
    """bench/z_image_memory.py prints bench/RESULTS.md's Z-Image tables from the model itself."""
    from bench_scripts import load_bench

    bench = load_bench("z_image_memory")
    assert "| Z-Image transformer | 12,309,817,472 (11.46 GiB) | 6,163,368,320 (5.74 GiB) |" in bench.bytes_table()[2]
    table = "\n".join(bench.plan_table())
    assert "| 1024 | int8 | on | yes | 5.90 | 2.16 | 9.5 | 5.3 | no / yes / yes / yes |" in table
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    assert bench.bytes_table()[2] in results and all(row in results for row in bench.plan_table()[2:])
