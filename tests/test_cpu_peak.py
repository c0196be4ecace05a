"""Issue 36 item 5, the CPU half: the memory model prices a model from its own configs (the tiny Klein, SDXL and
Z-Image) by the same functions that price the shipped sizes, and one plan's real run on the tiny Klein, and one with
blocks swapped on the tiny Z-Image (issue 39), measure within a stated factor of their estimates (bench/cpu_peak.py,
whose table is in bench/RESULTS.md)."""
from __future__ import annotations

import shutil
from pathlib import Path

from bench_scripts import load_bench
from stabletune_core.models.flux2_klein.family import SHIPPED_CONFIGS
from stabletune_core.models.flux2_klein.memory import estimate_training_memory
from stabletune_core.models.sd.sdxl_memory import SDXL_CONFIGS, estimate_sdxl_training_memory


def test_a_config_folder_is_priced_exactly_as_the_shipped_size(tmp_path):
    """The shipped configs copied to a folder of their own give the estimate of the shipped size, to the byte, in
    every part (weights, LoRA, activations, set-up), so pricing from a config is the same arithmetic."""
    klein = shutil.copytree(SHIPPED_CONFIGS["4b"], tmp_path / "my-klein")
    for settings in (dict(), dict(base_storage="nf4", blocks_to_swap=6, cache_text_embeddings=False),
                     dict(gradient_checkpointing=False, base_storage="int8", resolution=512)):
        assert estimate_training_memory(klein, **settings) == estimate_training_memory("4b", **settings)
    sdxl = shutil.copytree(SDXL_CONFIGS, tmp_path / "my-sdxl")
    for settings in (dict(resolution=256), dict(resolution=256, base_storage="int8", cache_text_embeddings=False)):
        assert estimate_sdxl_training_memory(folder=sdxl, **settings) == estimate_sdxl_training_memory(**settings)


#: How far a plan's measured training steps may be from the estimate's weights + LoRA + activations, either way.
FACTOR = 1.5


def measure_within_factor(family: str, data: Path, tmp_path: Path, blocks_to_swap: int = 0) -> dict:
    """bench/cpu_peak.py's row for `family`'s tiny model (built as the bench builds it), full storage, gradient
    checkpointing, the text encoder kept, 2 steps: its training steps' peak within FACTOR of the estimate either way,
    at least the weights the estimate counts (the counter sees the model), and the estimate's 0.8 GiB CUDA context
    left out of the ratio."""
    cpu_peak = load_bench("cpu_peak")
    folder = cpu_peak.FAMILIES[family].build(tmp_path / f"tiny-{family}")
    plan = dict(base_storage="full", gradient_checkpointing=True, cache_text_embeddings=False,
                blocks_to_swap=blocks_to_swap)
    row = cpu_peak.measure(family, folder, data, tmp_path / "run", plan, 2)
    assert row["estimate_step_bytes"] / FACTOR < row["measured_step_bytes"] < FACTOR * row["estimate_step_bytes"]
    assert row["measured_step_bytes"] > row["weights_bytes"] + row["lora_bytes"]
    assert row["estimate_bytes"] > row["estimate_step_bytes"]
    return dict(row, folder=folder, plan=plan)


def test_a_tiny_klein_plan_measures_within_a_factor_of_its_estimate(shapes_dataset, tmp_path):
    """Full storage, gradient checkpointing, the text encoder kept: within 1.5x (measured 1.25x, bench/RESULTS.md)."""
    measure_within_factor("flux2_klein", shapes_dataset, tmp_path)


def test_a_tiny_z_image_plan_with_blocks_swapped_measures_within_a_factor_of_its_estimate(shapes_dataset, tmp_path):
    """Issue 39: the tiny Z-Image priced by models/z_image/memory.py from its own configs, full storage, gradient
    checkpointing, the text encoder kept and 3 of its 6 blocks swapped: within the same 1.5x (measured 1.08x,
    bench/RESULTS.md), and the swapped blocks come off the estimate's weights (the bench priced the run it
    measured)."""
    row = measure_within_factor("z_image", shapes_dataset, tmp_path, blocks_to_swap=3)
    cpu_peak = load_bench("cpu_peak")
    unswapped = cpu_peak.plan_config(row["folder"], shapes_dataset, tmp_path / "priced",
                                     {**row["plan"], "blocks_to_swap": 0}, 2)
    assert cpu_peak.estimate(unswapped, "z_image", row["folder"]).weights > row["weights_bytes"]
